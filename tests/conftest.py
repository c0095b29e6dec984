"""Fixtures: generated text files, the tiny random Llamas on disk (built by tests/tiny.py), a private cache
directory, the reference model and its text."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def _pin_xdist_worker() -> None:
    """Under pytest-xdist (`-n 2` in pyproject.toml's addopts), worker gwN keeps every n-th of the CPUs it may
    use, before torch is imported: each worker, and every command it starts, then counts only its own CPUs
    (compress.paths.usable_cpus, the default thread count), so two workers on two cores run one thread each
    instead of two thread pools of two waiting on each other."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= count:
        index = int(worker.removeprefix("gw")) % count
        os.sched_setaffinity(0, cpus[index::count])


_pin_xdist_worker()

from tests.helpers import make_text  # noqa: E402  (after the pinning: these import torch)
from tests.tiny import tiny_llama_dir, tiny_moe_dir, train_tiny  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # the registry tests' client and server: no usage reports
ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test carries unit, runtime or slow (pyproject.toml says what each means): real_model tests are
    slow; a test marked neither runtime nor slow is unit."""
    for item in items:
        if item.get_closest_marker("real_model"):
            item.add_marker(pytest.mark.slow)
        if not (item.get_closest_marker("runtime") or item.get_closest_marker("slow")):
            item.add_marker(pytest.mark.unit)
    # Longest first: the tests marked minutes(n) by n, then the other real-model tests, then the other slow
    # ones, then the rest (each file's tests in their order within a rank). `--dist loadgroup` hands every
    # test to whichever worker is nearly idle, so the two workers start the long tests early and fill in
    # with short ones, rather than one ending on a fifteen-minute test while the other waits.
    items.sort(key=_start_rank)


def _start_rank(item: pytest.Item) -> tuple[int, float]:
    minutes = item.get_closest_marker("minutes")
    if minutes:
        return 0, -float(minutes.args[0])
    return (1 if item.get_closest_marker("real_model") else 2 if item.get_closest_marker("slow") else 3), 0.0


def texts_of(text_dir: Path) -> list[str]:
    return [p.read_text() for p in sorted(text_dir.glob("*.txt"))]


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three text files (~60 KB in all) of generated English-like prose."""
    d = tmp_path_factory.mktemp("texts")
    for i in range(3):
        (d / f"doc{i}.txt").write_text(make_text(i, 120))
    return d


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, text_dir: Path) -> Path:
    """A random 2-block Llama (width 96, tied embeddings) and its BPE tokenizer trained on the generated text."""
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny") / "tiny-llama", texts_of(text_dir))


@pytest.fixture(scope="session")
def tiny_moe_model_dir(tmp_path_factory: pytest.TempPathFactory, text_dir: Path) -> Path:
    """A random 2-block Qwen3-MoE (8 experts, top-2) and its BPE tokenizer trained on the generated text."""
    return tiny_moe_dir(tmp_path_factory.mktemp("moe") / "tiny-qwen3-moe", texts_of(text_dir))


@pytest.fixture(scope="session")
def trained_tiny_dir(tmp_path_factory: pytest.TempPathFactory, text_dir: Path) -> Path:
    """A 4-block tiny Llama trained for 150 steps on the generated text (~5 s): a teacher worth distilling from."""
    texts = texts_of(text_dir)
    root = tmp_path_factory.mktemp("trained")
    return train_tiny(tiny_llama_dir(root / "random", texts, layers=4), root / "trained", texts)


@pytest.fixture()
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private compress cache for tests that must not touch the real one."""
    d = tmp_path / "cache"
    monkeypatch.setenv("COMPRESS_CACHE", str(d))
    return d


@pytest.fixture(scope="session")
def smollm2():
    """The reference model (SmolLM2-135M-Instruct) for the real-model tests, loaded once, in memory."""
    import torch

    from compress import streaming
    from compress.models import load_model
    from compress.paths import usable_cpus
    from compress.progress import Reporter
    from compress.schema.recipe import ModelConfig

    torch.set_num_threads(usable_cpus())
    lm = load_model(ModelConfig(source="reference:smollm2-135m"), ROOT, Reporter(quiet=True))
    # Read into memory once: the method tests apply stages to copies of it directly, and stages that
    # do not stream expect an in-memory model (a run reads it whole for them: compress/steps/stages.py).
    lm.model = streaming.materialize(lm.model)
    return lm


def reference_chunks(tokenizer, cal: tuple[int, int], ev: tuple[int, int]):
    """(calibration, evaluation) token chunks of the reference Shakespeare text, (samples, seq_len) each."""
    from compress.data import DataPlan
    from compress.progress import Reporter
    from compress.schema.recipe import DataConfig

    data = DataConfig(
        calibration={"source": "reference:shakespeare", "samples": cal[0], "seq_len": cal[1]},
        evaluation={"source": "reference:shakespeare", "samples": ev[0], "seq_len": ev[1]},
    )
    plan = DataPlan.load(data, ROOT, Reporter(quiet=True))
    return plan.chunks("calibration", tokenizer).tokens, plan.chunks("evaluation", tokenizer).tokens


@pytest.fixture(scope="session")
def shakespeare_chunks(smollm2):
    """Reduced calibration (16 x 256 tokens) and evaluation (8 x 256) chunks of the reference text, to keep CI short."""
    return reference_chunks(smollm2.tokenizer, (16, 256), (8, 256))


@pytest.fixture(scope="session")
def quickstart_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """recipes/quickstart.yaml run once by the CLI on the reference model, its evaluation cut to 8 x 512
    tokens; shared read-only by the tests marked ``xdist_group("quickstart")`` (one worker runs them)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("quickstart") / "out"
    cmd = [sys.executable, "-m", "compress", "run", str(ROOT / "recipes" / "quickstart.yaml"), "-o", str(out), "-q"]
    run = subprocess.run([*cmd, "--set", "data.evaluation.samples=8"], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def onnx_model_dir(tmp_path_factory: pytest.TempPathFactory, text_dir: Path) -> Path:
    """The tiny test model with 6 heads of 16 (ONNX Runtime's CPU attention wants head sizes in multiples of 16);
    hidden 96 and MLP 160 leave partial last groups of 64."""
    return tiny_llama_dir(tmp_path_factory.mktemp("onnx") / "tiny-llama-h16", texts_of(text_dir), heads=6, head_dim=16)
