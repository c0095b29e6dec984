"""`compress bench quant` on a tiny model: rows for every candidate, written as they finish."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compress.eval.bench_quant import Setting, run_quant_bench
from compress.progress import Reporter
from compress.recipe import DataSpec
from tests.helpers import run_cli


def test_setting_parse() -> None:
    assert Setting.parse("W4g128s") == Setting(4, 128, True)
    assert Setting.parse("w3g64a") == Setting(3, 64, False)
    assert Setting.parse("W8pcs") == Setting(8, None, True)
    with pytest.raises(ValueError, match="expected like W4g128s"):
        Setting.parse("4bit")


def test_bench_scores_every_candidate(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    data = DataSpec(
        calibration={"source": str(text_dir), "samples": 4, "seq_len": 64},
        evaluation={"source": str(text_dir), "samples": 4, "seq_len": 64, "min_context": 8},
    )
    result = run_quant_bench(str(tiny_model_dir), data, ["rtn", "gptq", "awq"], [Setting(3, 32, True)], tmp_path, 1, Reporter(quiet=True))
    assert [r["method"] for r in result["rows"]] == ["rtn", "gptq", "awq"]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    for row in saved["rows"]:
        assert row["metrics"]["tokens_scored"] == 4 * (64 - 8) and row["seconds"] >= 0
    table = (tmp_path / "results.md").read_text()
    assert "| gptq | W3 g32 sym |" in table and "vs RTN" in table


def test_bench_cli_rejects_unknown_method(tmp_path: Path) -> None:
    result = run_cli(["bench", "quant", "-o", tmp_path, "--methods", "rtn,squeeze"])
    assert result.exit_code == 2 and "unknown method(s) squeeze" in result.output
