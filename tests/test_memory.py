"""Peak memory per phase of a run (compress.eval.memory)."""

from __future__ import annotations

import pytest

from compress.eval import memory
from compress.eval.memory import PhaseMemory, memory_section
from compress.schema.report import RunMemory

MB = 2**20
linux_reset = pytest.mark.skipif(not memory.CLEAR_REFS.exists(), reason="needs /proc/self/clear_refs (Linux)")


def _touch(n_mb: int) -> bytearray:
    block = bytearray(n_mb * MB)
    block[::4096] = b"\x01" * len(block[::4096])  # every page resident
    return block


@linux_reset
def test_each_phase_has_its_own_peak() -> None:
    """A phase that held 200 MiB peaks about 200 MiB above the next one, which held nothing: the
    high-water mark is reset when a phase starts. The run's peak and a nested phase's parent keep it."""
    meter = PhaseMemory()
    with meter.phase("small"):
        pass
    with meter.phase("outer"):
        with meter.phase("big"):
            block = _touch(200)
            del block
        with meter.phase("after"):
            pass
    with meter.phase("later"):
        pass
    p = {k: v["peak_rss_mb"] for k, v in meter.phases.items()}
    assert meter.method == "vmhwm"
    assert p["big"] - p["after"] > 150 and p["big"] - p["later"] > 150 and p["big"] - p["small"] > 150
    assert p["outer"] >= p["big"]  # a nested phase's peak is its parent's too
    result = meter.result()
    assert result["peak_rss_mb"] >= p["big"] and result["children_peak_rss_mb"] >= 0
    assert set(result["phases"]) == {"small", "outer", "big", "after", "later"}


def test_without_a_resettable_mark_phases_read_the_process_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_reset_high_water", lambda: False)
    meter = PhaseMemory()
    with meter.phase("a"):
        pass
    assert meter.method == "ru_maxrss"
    assert meter.phases["a"]["peak_rss_mb"] == pytest.approx(memory.maxrss_mb(), rel=0.05)


def test_memory_section_against_the_plan_and_without_it() -> None:
    meter = PhaseMemory()
    with meter.phase("load_model"):
        pass
    estimate = {"peak_memory_gb": 0.5, "time_s": 4.0, "phases": {"load_model": 0.25, "stages": 0.5}}
    section = memory_section(meter, 2.0, lambda: estimate)
    RunMemory.model_validate(section)  # report.json's schema
    assert section["predicted"]["peak_rss_mb"] == pytest.approx(0.5e9 / MB, abs=0.1) and section["predicted"]["peak_cuda_mb"] is None
    assert section["measured_over_predicted"]["time"] == 0.5
    assert section["measured_over_predicted"]["peak_rss"] == pytest.approx(
        section["peak_rss_mb"] / section["predicted"]["peak_rss_mb"], abs=1e-3
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
