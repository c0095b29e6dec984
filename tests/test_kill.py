"""SIGKILL at random points of `compress run` (with an export), `compress gate -o` and `compress
publish`: afterwards each output is absent or complete and passes `compress verify`, the next run
to the same output succeeds and leaves no leftovers, and the registry holds no version that
`pull` accepts but that is incomplete. 24 kill points in all; the delays are drawn from a fixed
seed between 5% and 110% of the command's own measured duration, so early, middle and late
points (writing, renaming) are all hit."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import recipe_text, write_recipe

pytestmark = [pytest.mark.slow]

POINTS = {"run": 10, "gate": 7, "publish": 7}


def _compress(*args: object, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "compress", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "COMPRESS_REGISTRY": str(cwd / "default-registry")},
        timeout=600,
    )


def _timed(*args: object, cwd: Path) -> float:
    started = time.perf_counter()
    done = _compress(*args, cwd=cwd)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    return time.perf_counter() - started


def _kill_at(delay: float, *args: object, cwd: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "compress", *map(str, args)],
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "COMPRESS_REGISTRY": str(cwd / "default-registry")},
    )
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def _absent_or_verified(path: Path, cwd: Path) -> str:
    if not path.exists():
        return "absent"
    checked = _compress("verify", path, cwd=cwd)
    assert checked.returncode == 0, f"{path} exists but does not verify: {checked.stdout}{checked.stderr}"
    return "complete"


def _leftovers(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.glob(f".{path.name}.*"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, text_dir: Path) -> dict:
    root = tmp_path_factory.mktemp("kill")
    gates = "  - metric: kl_divergence\n    max: 100\n"
    text = recipe_text(tiny_model_dir, text_dir, gates=gates, samples=2).replace("exports: []", "exports:\n  - format: gptq")
    recipe = write_recipe(root, text)
    (root / "gates.yaml").write_text(
        "gates:\n" + gates + f"data:\n  evaluation: {{source: {text_dir}, samples: 2, seq_len: 64, min_context: 8}}\n"
    )
    return {"root": root, "recipe": recipe, "rng": random.Random(25)}


@pytest.mark.minutes(0.9)
def test_kill_during_run(setup: dict) -> None:
    root, recipe, rng = setup["root"], setup["recipe"], setup["rng"]
    full = _timed("run", recipe, "-o", root / "reference", cwd=root)
    out = root / "out"
    seen = []
    for _ in range(POINTS["run"]):
        overwrite = ["--overwrite"] if out.exists() else []
        _kill_at(full * rng.uniform(0.05, 1.1), "run", recipe, "-o", out, *overwrite, cwd=root)
        seen.append(_absent_or_verified(out, cwd=root))
    done = _compress("run", recipe, "-o", out, "--overwrite", cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _absent_or_verified(out, cwd=root) == "complete" and _leftovers(out) == []
    assert "absent" in seen  # early kills left nothing


@pytest.mark.minutes(0.8)
def test_kill_during_gate(setup: dict) -> None:
    root, rng = setup["root"], setup["rng"]
    artifact = root / "reference"
    if not artifact.exists():
        assert _compress("run", setup["recipe"], "-o", artifact, cwd=root).returncode == 0
    full = _timed("gate", artifact, "--gates", root / "gates.yaml", "-o", root / "gate-full", cwd=root)
    report = root / "gate-out"
    for _ in range(POINTS["gate"]):
        overwrite = ["--overwrite"] if report.exists() else []
        _kill_at(full * rng.uniform(0.05, 1.1), "gate", artifact, "--gates", root / "gates.yaml", "-o", report, *overwrite, cwd=root)
        _absent_or_verified(report, cwd=root)
    done = _compress("gate", artifact, "--gates", root / "gates.yaml", "-o", report, "--overwrite", cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _absent_or_verified(report, cwd=root) == "complete" and _leftovers(report) == []
    assert _compress("verify", artifact, cwd=root).returncode == 0  # gating never touched the artifact


@pytest.mark.runtime
@pytest.mark.minutes(0.7)
def test_kill_during_publish(setup: dict) -> None:
    pytest.importorskip("mlflow")
    root, rng = setup["root"], setup["rng"]
    artifact = root / "reference"
    if not artifact.exists():
        assert _compress("run", setup["recipe"], "-o", artifact, cwd=root).returncode == 0
    store = root / "registry"
    full = _timed("publish", artifact, "--store", root / "registry-full", "--name", "kill-test", cwd=root)
    for _ in range(POINTS["publish"]):
        _kill_at(full * rng.uniform(0.05, 1.1), "publish", artifact, "--store", store, "--name", "kill-test", cwd=root)
    listing = _compress("registry", "list", "--store", store, "--json", cwd=root)
    assert listing.returncode in (0, 2), listing.stderr
    versions = [v for m in json.loads(listing.stdout)["models"] for v in m["versions"]] if listing.returncode == 0 else []
    for v in versions:
        pulled = root / f"pulled-{v['version']}"
        got = _compress("pull", f"kill-test/{v['version']}", "--store", store, "-o", pulled, cwd=root)
        if got.returncode == 0:  # whatever pull accepts is complete and unaltered
            assert _absent_or_verified(pulled, cwd=root) == "complete"
        else:
            assert not pulled.exists() and "Traceback" not in got.stderr
    done = _compress("publish", artifact, "--store", store, "--name", "kill-test", cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
    final = json.loads(_compress("registry", "list", "--store", store, "--json", cwd=root).stdout)
    ready = [v for m in final["models"] for v in m["versions"] if v["ready"]]
    assert ready, final
    pulled = root / "pulled-final"
    assert _compress("pull", f"kill-test/{ready[0]['version']}", "--store", store, "-o", pulled, cwd=root).returncode == 0
    assert _absent_or_verified(pulled, cwd=root) == "complete"
