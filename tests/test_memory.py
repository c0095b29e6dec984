"""Peak memory per phase of a run (compress.eval.memory) and `compress bench memory` with its depth-cut copy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compress.eval import memory
from compress.eval.memory import PhaseMemory, memory_section
from compress.schema.report import RunMemory
from tests.conftest import texts_of
from tests.helpers import run_cli
from tests.tiny import tiny_llama_dir

MB = 2**20
linux_reset = pytest.mark.skipif(not memory.CLEAR_REFS.exists(), reason="needs /proc/self/clear_refs (Linux)")


_PHASES_SCRIPT = """
import json
from compress.eval.memory import PhaseMemory

MB = 2**20


def touch(n_mb):
    block = bytearray(n_mb * MB)
    block[::4096] = b"\\x01" * len(block[::4096])  # every page resident
    return block


meter = PhaseMemory()
with meter.phase("small"):
    pass
with meter.phase("outer"):
    with meter.phase("big"):
        block = touch(200)
        del block
    with meter.phase("after"):
        pass
with meter.phase("later"):
    pass
print(json.dumps({"method": meter.method, "phases": meter.phases, "result": meter.result()}))
"""


@linux_reset
def test_each_phase_has_its_own_peak() -> None:
    """A phase that held 200 MiB peaks about 200 MiB above the next one, which held nothing: the
    high-water mark is reset when a phase starts. The run's peak and a nested phase's parent keep it.
    Measured in a fresh process, as a run is (a long test process has its own resident history)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _PHASES_SCRIPT], capture_output=True, text=True, check=True, timeout=120)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    p = {k: v["peak_rss_mb"] for k, v in found["phases"].items()}
    assert found["method"] == "vmhwm"
    assert p["big"] - p["after"] > 150 and p["big"] - p["later"] > 150 and p["big"] - p["small"] > 150, p
    assert p["outer"] >= p["big"]  # a nested phase's peak is its parent's too
    result = found["result"]
    assert result["peak_rss_mb"] >= p["big"] and result["children_peak_rss_mb"] >= 0
    assert set(result["phases"]) == {"small", "outer", "big", "after", "later"}


def test_without_a_resettable_mark_phases_read_the_process_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_reset_high_water", lambda: False)
    meter = PhaseMemory()
    with meter.phase("a"):
        pass
    assert meter.method == "ru_maxrss"
    assert meter.phases["a"]["peak_rss_mb"] == pytest.approx(memory.maxrss_mb(), rel=0.05)


def test_cuda_phases_read_and_reset_torchs_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CUDA device each phase resets torch's peak counter at its start and reads it at its end
    (torch.cuda stubbed: no GPU here); a CPU phase has no CUDA entry; a parent keeps its child's peak."""
    import torch

    state = {"peak": 0.0, "resets": 0}

    def reset(device: object) -> None:
        state["peak"], state["resets"] = 0.0, state["resets"] + 1

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: state["peak"])
    cuda, meter = torch.device("cuda", 0), PhaseMemory()
    with meter.phase("outer", cuda):
        with meter.phase("inner", cuda):
            state["peak"] = 300 * MB
        with meter.phase("later", cuda):
            state["peak"] = 100 * MB
    with meter.phase("cpu", torch.device("cpu")):
        pass
    assert state["resets"] == 3
    assert meter.phases["inner"]["peak_cuda_mb"] == 300 and meter.phases["later"]["peak_cuda_mb"] == 100
    assert meter.phases["outer"]["peak_cuda_mb"] == 300 and "peak_cuda_mb" not in meter.phases["cpu"]
    assert meter.result()["peak_cuda_mb"] == 300


def test_memory_section_against_the_plan_and_without_it() -> None:
    meter = PhaseMemory()
    with meter.phase("load_model"):
        pass
    estimate = {"peak_memory_gb": 0.5, "time_s": 4.0, "phases": {"load_model": 0.25, "stages": 0.5}}
    section = memory_section(meter, 2.0, lambda: estimate)
    RunMemory.model_validate(section)  # report.json's schema
    assert section["predicted"]["peak_rss_mb"] == pytest.approx(0.5e9 / MB, abs=0.1) and section["predicted"]["peak_cuda_mb"] is None
    assert section["measured_over_predicted"]["time"] == 0.5
    # both sides rounded (the ratio to 3 decimals, the peaks to 0.1 MiB): equal within a part in a thousand
    assert section["measured_over_predicted"]["peak_rss"] == pytest.approx(
        section["peak_rss_mb"] / section["predicted"]["peak_rss_mb"], rel=1e-3
    )
    assert section["phases"]["load_model"]["predicted_rss_mb"] == pytest.approx(0.25e9 / MB, abs=0.1)
    assert "stages" not in section["phases"]  # not run, so not measured

    def fails() -> dict:
        raise ValueError("no config.json")

    broken = memory_section(meter, 2.0, fails)
    RunMemory.model_validate(broken)
    assert "no config.json" in broken["predicted"]["error"] and "measured_over_predicted" not in broken
    assert broken["phases"]["load_model"]["peak_rss_mb"] > 0


def test_markdown_has_the_memory_table() -> None:
    from compress.eval.reports import markdown_summary

    report = {
        "passed": True,
        "gates": [],
        "evaluations": [],
        "memory": {
            "method": "vmhwm",
            "phases": {"load_model": {"peak_rss_mb": 812.5, "predicted_rss_mb": 600.0, "measured_over_predicted": 1.354}},
            "peak_rss_mb": 900.0,
            "children_peak_rss_mb": 0.0,
            "wall_s": 12.0,
            "predicted": {"peak_rss_mb": 700.0, "peak_cuda_mb": None, "time_s": 10.0},
            "measured_over_predicted": {"peak_rss": 1.286, "time": 1.2},
        },
    }
    text = markdown_summary(report)
    assert "### Peak memory per phase" in text
    assert "| load_model | 812.5 | 600 | 1.35 |" in text and "| **run** | 900 | 700 | 1.29 |" in text
    assert "Wall time 12 s, plan 10 s" in text


# ------------------------------------------------------------------------------ the cut copy


@pytest.fixture(scope="module")
def four_blocks(tmp_path_factory: pytest.TempPathFactory, text_dir: Path) -> Path:
    """A random 4-block tiny Llama (tied embeddings) and its tokenizer."""
    return tiny_llama_dir(tmp_path_factory.mktemp("four") / "model", texts_of(text_dir), layers=4)


def test_cut_copy_loads_with_its_blocks_and_the_same_weights(tmp_path: Path, four_blocks: Path) -> None:
    """The 4-block tiny model cut to 2: transformers loads it with 2 blocks, every kept tensor equal
    to the source's (read with safetensors), the tied head still tied, the tokenizer copied."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compress.eval.bench.memory import checkpoint_bytes, cut_blocks

    target = tmp_path / "cut"
    facts = cut_blocks(four_blocks, target, 2)
    assert facts["blocks"] == 2 and facts["source_blocks"] == 4
    model = AutoModelForCausalLM.from_pretrained(target)
    assert model.config.num_hidden_layers == 2 and len(model.model.layers) == 2
    assert model.config.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with safe_open(str(four_blocks / "model.safetensors"), "pt") as src, safe_open(str(target / "model.safetensors"), "pt") as cut:
        kept = set(cut.keys())
        assert kept == {k for k in src.keys() if not any(f"layers.{i}." in k for i in (2, 3))}
        assert any("layers.1." in k for k in kept) and len(kept) == facts["tensors"]
        for name in kept:
            assert torch.equal(cut.get_tensor(name), src.get_tensor(name)), name
    state = model.state_dict()
    with safe_open(str(four_blocks / "model.safetensors"), "pt") as src:
        assert torch.equal(state["model.layers.1.mlp.down_proj.weight"], src.get_tensor("model.layers.1.mlp.down_proj.weight"))
    assert (
        AutoTokenizer.from_pretrained(target)("the king")["input_ids"]
        == AutoTokenizer.from_pretrained(four_blocks)("the king")["input_ids"]
    )
    assert 0 < checkpoint_bytes(target) < checkpoint_bytes(four_blocks)


def test_cut_blocks_refuses_more_blocks_than_the_model_has(tmp_path: Path, tiny_model_dir: Path) -> None:
    from compress.errors import CompressError
    from compress.eval.bench.memory import cut_blocks

    with pytest.raises(CompressError, match="has 2 blocks; give 1 to 2"):
        cut_blocks(tiny_model_dir, tmp_path / "cut", 3)
    assert not (tmp_path / "cut").exists()


# -------------------------------------------------------------------------- the bench, end to end


@pytest.mark.runtime  # several processes
@pytest.mark.slow  # four fresh `compress run` processes: about 30 s on 2 cores
@pytest.mark.minutes(0.4)
def test_bench_memory_end_to_end(tmp_path: Path, four_blocks: Path, text_dir: Path) -> None:
    """RTN and GPTQ on the 4-block tiny model and its 2-block copy: four fresh `compress run`
    processes; results.json has a row per run with the report's peaks and the manifest's per-block
    times, and the table is written."""
    out = tmp_path / "bench"
    result = run_cli(
        ["bench", "memory", "-o", out, "--model", four_blocks, "--calibration", text_dir, "--evaluation", text_dir]
        + [
            "--cal-samples",
            "4",
            "--cal-seq-len",
            "64",
            "--eval-samples",
            "4",
            "--eval-seq-len",
            "64",
            "--cut-blocks",
            "2",
            "--threads",
            "1",
        ]
        + ["--set", "stages.0.quantize.group_size=32"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads((out / "results.json").read_text())
    rows = {(r["variant"], r["method"]): r for r in data["rows"]}
    assert set(rows) == {("full", "rtn"), ("cut", "rtn"), ("full", "gptq"), ("cut", "gptq")}
    for (variant, method), r in rows.items():
        assert r["blocks"] == (4 if variant == "full" else 2)
        assert r["peak_rss_mb"] > 0 and r["process_peak_rss_mb"] > 0 and r["peak_rss_over_checkpoint"] > 0
        assert {"load_model", "stages", "evaluate"} <= set(r["phases"])
        assert r["seconds_per_block"] > 0
        assert r["seconds_per_block_from"] == ("blocks" if method == "gptq" else "stage/blocks")
        report = json.loads((out / "runs" / f"{variant}-{method}" / "report.json").read_text())
        assert report["memory"]["peak_rss_mb"] == r["peak_rss_mb"]
    assert rows[("full", "rtn")]["checkpoint_bytes"] > rows[("cut", "rtn")]["checkpoint_bytes"]
    assert set(data["ratios"]) == {"rtn", "gptq"} and all(v > 0 for v in data["ratios"].values())
    table = (out / "results.md").read_text()
    assert "| gptq |" in table and "Peak RSS, full model / cut copy" in table
    assert not (out / "files").exists()  # the cut copy and the artifacts are removed unless --keep-files
