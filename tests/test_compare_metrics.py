"""scripts/compare_metrics.py: the check that a refactor leaves a run's numbers as they were."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "compare_metrics.py"


def _report(path: Path, kl: float, latency_ms: float, extra: dict | None = None) -> Path:
    evaluations = [
        {"artifact": "compressed", "runtime": "torch", "device": "cpu", "source": "measured", "kind": "accuracy",
         "metrics": {"kl_divergence": kl, "perplexity": "inf", **(extra or {})}},
        {"artifact": "compressed", "runtime": "torch", "device": "cpu", "source": "measured", "kind": "latency",
         "metrics": {"decode_ms_per_token": latency_ms}},
    ]  # fmt: skip
    path.mkdir()
    (path / "report.json").write_text(json.dumps({"schema_version": 2, "evaluations": evaluations}))
    return path


def _compare(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_same_metrics_pass_and_timings_are_not_compared(tmp_path: Path) -> None:
    old, new = _report(tmp_path / "a", 0.25, 10.0), _report(tmp_path / "b", 0.25, 99.0)
    result = _compare(old, new)
    assert result.returncode == 0 and "2 metrics compared" in result.stdout, result.stdout


def test_a_changed_or_missing_metric_fails_and_is_named(tmp_path: Path) -> None:
    old, new = _report(tmp_path / "a", 0.25, 10.0, {"top1_agreement": 0.5}), _report(tmp_path / "b", 0.2500001, 10.0)
    result = _compare(old, new)
    assert result.returncode == 1
    assert "differs: compressed/torch/cpu/measured/accuracy/kl_divergence" in result.stdout
    assert "only in OLD: compressed/torch/cpu/measured/accuracy/top1_agreement" in result.stdout
    assert _compare(old / "report.json", new, "--rel", "1e-3").returncode == 1  # top1 is still missing


def test_saved_metrics_compare_within_the_tolerance(tmp_path: Path) -> None:
    old = _report(tmp_path / "a", 0.25, 10.0)
    assert _compare(old, "--save", tmp_path / "saved.json").returncode == 0
    new = _report(tmp_path / "b", 0.25 * (1 + 1e-7), 10.0)
    assert _compare(tmp_path / "saved.json", new).returncode == 1
    assert _compare(tmp_path / "saved.json", new, "--rel", "1e-6").returncode == 0


def test_an_unreadable_file_exits_2(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{")
    result = _compare(tmp_path / "bad.json", tmp_path / "bad.json")
    assert result.returncode == 2 and "bad.json" in result.stderr
