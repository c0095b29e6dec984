"""95% intervals on the accuracy metrics (a percentile bootstrap over evaluation sequences), gates
on an end of the interval (`on: upper_95` / `lower_95`), and their place in report.json and Markdown."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from compress.eval.gates import evaluate_gates
from compress.eval.metrics import Evaluation, Scores, bootstrap_intervals, compare
from compress.schema.recipe import GateConfig
from tests.helpers import recipe_text, run_cli, write_recipe


def _per_sequence(n: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    tokens = np.full(n, 100)
    kl = rng.gamma(2.0, 0.1, n) * tokens
    nll = rng.normal(3.0, 0.3, n) * tokens
    agree = rng.binomial(100, 0.7, n)
    return nll, kl, agree, tokens


def test_bootstrap_intervals_hold_the_estimate_narrow_with_more_sequences_and_repeat() -> None:
    nll, kl, agree, tokens = _per_sequence(16)
    found = bootstrap_intervals(nll, kl, agree, tokens)
    point = {
        "kl_divergence": kl.sum() / tokens.sum(),
        "top1_agreement": agree.sum() / tokens.sum(),
        "perplexity": np.exp(nll.sum() / tokens.sum()),
    }
    for name, value in point.items():
        assert found[name]["lower"] < value < found[name]["upper"], name
        assert found[name]["samples"] == 16 and found[name]["level"] == 0.95
    assert found == bootstrap_intervals(nll, kl, agree, tokens)  # seeded
    wide = found["kl_divergence"]["upper"] - found["kl_divergence"]["lower"]
    nll, kl, agree, tokens = _per_sequence(256)
    narrow = bootstrap_intervals(nll, kl, agree, tokens)["kl_divergence"]
    assert narrow["upper"] - narrow["lower"] < wide / 2  # about 1/sqrt(16) as wide
    assert bootstrap_intervals(nll[:1], kl[:1], agree[:1], tokens[:1]) == {}


def test_compare_gives_each_artifact_intervals_over_its_sequences() -> None:
    torch.manual_seed(0)
    table = torch.randn(32, 32)

    def baseline(ids: torch.Tensor) -> torch.Tensor:
        return table[ids]

    def noisy(ids: torch.Tensor) -> torch.Tensor:
        return table[ids] + 0.5 * torch.randn(*ids.shape, 32, generator=torch.Generator().manual_seed(int(ids.sum())))

    chunks = torch.randint(0, 32, (12, 40), generator=torch.Generator().manual_seed(1))
    scores = compare(baseline, {"noisy": noisy}, chunks, min_context=4, batch_size=5)  # batches of 5, 5 and 2 sequences
    got = scores["noisy"]
    assert isinstance(got, Scores) and set(got.intervals) == {"perplexity", "kl_divergence", "top1_agreement"}
    for name, interval in got.intervals.items():
        assert interval["lower"] <= got[name] <= interval["upper"] and interval["samples"] == 12, name
    assert got.intervals["kl_divergence"]["lower"] > 0
    assert Evaluation("noisy", "torch", "cpu", got).to_json()["intervals"] == got.intervals


def _evaluation(value: float, lower: float, upper: float) -> Evaluation:
    intervals = {"kl_divergence": {"lower": lower, "upper": upper, "level": 0.95, "method": "m", "samples": 8}}
    return Evaluation("compressed", "torch", "cpu", {"kl_divergence": value}, intervals=intervals)


def test_a_gate_on_the_upper_bound_fails_where_the_value_passes() -> None:
    evaluations = [_evaluation(0.30, 0.25, 0.36)]
    value, upper, lower = (
        GateConfig(metric="kl_divergence", max=0.33),
        GateConfig(metric="kl_divergence", max=0.33, on="upper_95"),
        GateConfig(metric="kl_divergence", max=0.26, on="lower_95"),
    )
    results = evaluate_gates([value, upper, lower], evaluations)
    assert [r.passed for r in results] == [True, False, True]
    assert [r.value for r in results] == [0.30, 0.36, 0.25] and results[1].on == "upper_95"
    assert "upper_95 (95% interval over 8 samples) = 0.36 violates <= 0.33" in results[1].message
    assert results[1].name == "compressed.kl_divergence.upper_95.max"
    bare = evaluate_gates([upper], [Evaluation("compressed", "torch", "cpu", {"kl_divergence": 0.30})])[0]
    assert not bare.passed and bare.source == "missing" and "has no interval" in bare.message


def test_a_bound_on_a_metric_without_an_interval_is_refused(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    with pytest.raises(
        ValueError,
        match="on: upper_95 needs an interval, which only perplexity, kl_divergence, top1_agreement, accuracy, accuracy_norm, draft_acceptance, speculative_speedup have",
    ):
        GateConfig(metric="tpot_ms", max=10, on="upper_95")
    text = recipe_text(tiny_model_dir, text_dir, gates="  - metric: kl_divergence\n    on: upper_99\n    max: 1")
    result = run_cli(["validate", write_recipe(tmp_path, text)])
    assert result.exit_code == 2 and "gates[0].on" in result.output and "Traceback" not in result.output


def test_run_reports_intervals_and_gates_on_the_bound(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    gates = "  - metric: kl_divergence\n    on: upper_95\n    max: 100\n  - metric: kl_divergence\n    on: lower_95\n    min: 1.0e-9"
    text = recipe_text(tiny_model_dir, text_dir, bits=3, gates=gates)
    out = tmp_path / "out"
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", out])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    compressed = next(e for e in report["evaluations"] if e["artifact"] == "compressed")
    kl = compressed["intervals"]["kl_divergence"]
    assert kl["lower"] <= compressed["metrics"]["kl_divergence"] <= kl["upper"] and kl["samples"] >= 2
    assert [g["value"] for g in report["gates"]] == [kl["upper"], kl["lower"]] and [g["on"] for g in report["gates"]] == [
        "upper_95",
        "lower_95",
    ]
    summary = (out / "summary.md").read_text()
    assert "kl_divergence (upper 95%)" in summary and "In brackets: the 95% interval" in summary
