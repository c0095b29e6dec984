"""Reports rendered from report.json: schema, JUnit, Markdown, plots (hand-built reports, no models)."""

from __future__ import annotations

import copy
import importlib.util
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from compress.eval import reports
from compress.eval.reports import (
    REPORT_SCHEMA,
    append_github_summary,
    junit_xml,
    markdown_summary,
    pareto_front,
    pareto_points,
    plot_latency,
    plot_pareto,
    validate_report,
    write_reports,
)
from compress.schema.report import REPORT_VERSION

ROOT = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DEVICE = "jetson-orin-nano-8gb"


def _gate(
    name: str,
    metric: str,
    artifact: str,
    value: float | None,
    kind: str,
    limit: float,
    passed: bool,
    source: str,
    runtime: str | None = "torch",
    device: str | None = "cpu",
    **extra: Any,
) -> dict[str, Any]:
    threshold = {"kind": kind, "value": extra.pop("threshold_value", limit), **({"limit": limit} if value is not None else {}), **extra}
    message = (
        f"no measurement of {metric} for artifact '{artifact}'"
        if value is None
        else f"{metric} = {value:.6g} {'meets' if passed else 'violates'} {'<=' if kind.startswith('max') else '>='} {limit:.6g}"
    )
    return {
        "name": name,
        "metric": metric,
        "artifact": artifact,
        "value": value,
        "threshold": threshold,
        "passed": passed,
        "source": source,
        "runtime": runtime,
        "device": device,
        "message": message,
    }


def _accuracy(artifact: str, kl: float, size: float | None, runtime: str = "torch", source: str = "measured") -> dict[str, Any]:
    metrics = {
        "perplexity": 12.3 * (1 + kl),
        "kl_divergence": kl,
        "kl_divergence_p99": 8 * kl,
        "top1_agreement": 1 - kl,
        "tokens_scored": 65536,
    }
    if size is not None:
        metrics["size_mb"] = size
    return {"artifact": artifact, "runtime": runtime, "device": "cpu", "source": source, "kind": "accuracy", "metrics": metrics}


def _latency(artifact: str, runtime: str, device: str, ttft: float, tpot: float, source: str, size: float) -> dict[str, Any]:
    return {
        "artifact": artifact,
        "runtime": runtime,
        "device": device,
        "source": source,
        "kind": "latency",
        "metrics": {
            "ttft_ms": ttft,
            "tpot_ms": tpot,
            "decode_tokens_per_s": 1000 / tpot,
            "peak_rss_mb": 412.5,
            "size_mb": size,
            "bandwidth_utilization": 0.62,
        },
        "details": {"prompt_tokens": 128, "new_tokens": 64, "repeats": 3},
    }


def failing_report() -> dict[str, Any]:
    """One gate passes, one fails, one has no measurement, one is estimated on a named device."""
    return {
        "schema_version": REPORT_VERSION,
        "recipe": "smollm2-int4",
        "passed": False,
        "evaluations": [
            _accuracy("baseline", 0.0, 256.0),
            _accuracy("compressed", 0.031, 74.2),
            _accuracy("gguf", 0.047, None, runtime="llama.cpp"),
            _latency("gguf", "llama.cpp", "cpu", 41.0, 9.5, "measured", 78.9),
            _latency("gguf", "llama.cpp", DEVICE, 120.0, 31.0, "estimated", 78.9),
        ],
        "gates": [
            _gate("kl", "kl_divergence", "compressed", 0.031, "max", 0.05, True, "measured"),
            _gate(
                "ppl",
                "perplexity",
                "gguf",
                13.1,
                "max_increase_pct",
                12.915,
                False,
                "measured",
                runtime="llama.cpp",
                threshold_value=5.0,
                baseline=12.3,
            ),
            _gate("onnx-kl", "kl_divergence", "onnx", None, "max", 0.05, False, "missing", runtime=None, device=None),
            _gate("orin-tpot", "tpot_ms", "gguf", 31.0, "max", 40.0, True, "estimated", runtime="llama.cpp", device=DEVICE),
        ],
        "evaluation_data": {"source": "corpus/", "tokens_sha256": "ab" * 32, "samples": 64, "seq_len": 1024},
        "exports": [
            {
                "name": "gguf",
                "format": "gguf",
                "path": "exports/gguf/model.gguf",
                "verified": True,
                "check": {"max_abs_logit_diff": 0.01},
                "evaluated_as": "gguf",
            },
            {"name": "onnx", "format": "onnx", "path": "exports/onnx", "verified": None, "check": None, "evaluated_as": None},
        ],
        "host": {"bandwidth_gbs": 38.4, "cpu": "x86_64"},
        "devices": {DEVICE: {"fit": {"fits": True, "memory_fraction": 0.12}}},
        "search": {
            "candidates": [
                {
                    "name": "w4g128",
                    "overrides": ["stages[0].config.group_size=128"],
                    "size_mb": 70.1,
                    "passed": True,
                    "metrics": {"kl_divergence": 0.04},
                    "status": "evaluated",
                },
                {
                    "name": "w3g64",
                    "overrides": ["stages[0].config.bits=3"],
                    "size_mb": 58.0,
                    "passed": False,
                    "metrics": {"kl_divergence": 0.19},
                    "status": "evaluated",
                },
                {
                    "name": "w8",
                    "overrides": ["stages[0].config.bits=8"],
                    "size_mb": None,
                    "passed": None,
                    "metrics": {},
                    "status": "skipped",
                },
            ],
            "chosen": "w4g128",
        },
    }


def passing_report() -> dict[str, Any]:
    return {
        "schema_version": REPORT_VERSION,
        "recipe": "quickstart",
        "passed": True,
        "evaluations": [_accuracy("baseline", 0.0, None), _accuracy("compressed", 0.02, None)],
        "gates": [_gate("kl", "kl_divergence", "compressed", 0.02, "max", 0.05, True, "measured")],
        "evaluation_data": None,
    }


def empty_report() -> dict[str, Any]:
    return {
        "schema_version": REPORT_VERSION,
        "recipe": "compress gate",
        "passed": True,
        "evaluations": [],
        "gates": [],
        "evaluation_data": None,
    }


# ----------------------------------------------------------------------------------- schema


needs_jsonschema = pytest.mark.skipif(importlib.util.find_spec("jsonschema") is None, reason="jsonschema is not installed (compress[dev])")


@needs_jsonschema
@pytest.mark.parametrize("make", [failing_report, passing_report, empty_report])
def test_schema_accepts_sample_reports(make: Any) -> None:
    assert validate_report(make()) == []
    import jsonschema

    jsonschema.Draft202012Validator.check_schema(REPORT_SCHEMA)


@needs_jsonschema
def test_schema_accepts_non_finite_values_as_written_by_json_safe() -> None:
    report = failing_report()
    report["evaluations"][1]["metrics"]["perplexity"] = "inf"
    report["gates"][1]["value"] = "nan"
    assert validate_report(report) == []


@needs_jsonschema
@pytest.mark.parametrize(
    "path, bad, expected",
    [
        (("gates", 0, "source"), "guessed", "$.gates[0].source"),
        (("evaluations", 3, "source"), "guessed", "$.evaluations[3].source"),
        (("evaluations", 0, "kind"), "throughput", "$.evaluations[0].kind"),
        (("evaluations", 0, "metrics", "kl_divergence"), "small", "$.evaluations[0].metrics.kl_divergence"),
        (("schema_version",), 1, "$.schema_version"),
    ],
)
def test_schema_rejects_bad_values(path: tuple[Any, ...], bad: Any, expected: str) -> None:
    report = failing_report()
    node = report
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    errors = validate_report(report)
    assert errors and any(e.startswith(expected + ":") for e in errors), errors


@needs_jsonschema
def test_schema_rejects_missing_and_unknown_keys() -> None:
    report = failing_report()
    del report["gates"][0]["source"]
    report["surprise"] = 1
    errors = validate_report(report)
    assert any("'source' is a required property" in e for e in errors)
    assert any("surprise" in e for e in errors)


@needs_jsonschema
def test_details_and_metrics_take_any_names() -> None:
    report = failing_report()
    report["evaluations"][3]["details"]["anything"] = {"nested": [1, 2]}
    report["evaluations"][3]["metrics"]["new_metric"] = 3
    assert validate_report(report) == []


def test_shipped_schema_file_is_report_schema(tmp_path: Path) -> None:
    assert json.loads((ROOT / "docs" / "report.schema.json").read_text()) == REPORT_SCHEMA
    assert json.loads(reports.write_schema(tmp_path / "s.json").read_text()) == REPORT_SCHEMA


def test_threshold_kinds_match_the_recipe() -> None:
    from compress.schema.recipe import THRESHOLD_KEYS

    assert reports.THRESHOLD_KINDS == list(THRESHOLD_KEYS)


# ------------------------------------------------------------------------------------ JUnit


def _cases(xml: str) -> tuple[ET.Element, dict[str, ET.Element]]:
    root = ET.fromstring(xml)
    return root, {c.get("name"): c for c in root.iter("testcase")}


def test_junit_counts_failures_and_says_estimated() -> None:
    root, cases = _cases(junit_xml(failing_report(), "compress"))
    suite = root.find("testsuite")
    for el in (root, suite):
        assert (el.get("tests"), el.get("failures"), el.get("errors")) == ("4", "2", "0")
    assert suite.get("name") == "compress"
    assert {n: c.get("classname") for n, c in cases.items()} == {"kl": "compressed", "ppl": "gguf", "onnx-kl": "onnx", "orin-tpot": "gguf"}
    assert cases["kl"].find("failure") is None and cases["orin-tpot"].find("failure") is None

    failure = cases["ppl"].find("failure")
    assert "violates" in failure.get("message") and failure.get("type") == "gate"
    for text in ("value: 13.1", "limit: ≤ 12.915 (baseline +5%)", "runtime: llama.cpp", "device: cpu", "source: measured"):
        assert text in failure.text

    missing = cases["onnx-kl"].find("failure")
    assert missing.get("type") == "missing" and "no measurement" in missing.get("message") and "source: missing" in missing.text

    estimated = cases["orin-tpot"]
    props = {p.get("name"): p.get("value") for p in estimated.iter("property")}
    assert props["source"] == "estimated" and props["device"] == DEVICE
    assert "source: estimated" in estimated.find("system-out").text
    assert "source: measured" not in estimated.find("system-out").text


def test_junit_failed_estimated_gate_says_so_in_its_message() -> None:
    report = failing_report()
    report["gates"][3].update(passed=False, message="tpot_ms = 31 violates <= 20")
    _, cases = _cases(junit_xml(report, "s"))
    failure = cases["orin-tpot"].find("failure")
    assert "[estimated]" in failure.get("message") and "source: estimated" in failure.text


def test_junit_with_no_gates_is_an_empty_valid_suite() -> None:
    root, cases = _cases(junit_xml(empty_report(), "compress gate"))
    assert cases == {} and root.get("tests") == "0" and root.find("testsuite").get("tests") == "0"
    assert root.get("failures") == "0"


def test_junit_escapes_markup_and_control_characters(tmp_path: Path) -> None:
    report = failing_report()
    report["gates"][1].update(name='ppl <"&"> gate', message="bad\x00 <value> & more")
    path = reports.write_junit(tmp_path / "junit.xml", report, "a&b")
    root, cases = _cases(path.read_text())
    assert root.get("name") == "a&b"
    assert cases['ppl <"&"> gate'].find("failure").get("message").startswith("bad? <value> & more")


# --------------------------------------------------------------------------------- Markdown


def _row(markdown: str, first_cell: str) -> str:
    return next(line for line in markdown.splitlines() if line.startswith(f"| {first_cell} |"))


def test_markdown_marks_estimated_and_never_calls_it_measured() -> None:
    md = markdown_summary(failing_report())
    assert md.startswith("## ❌ FAIL: smollm2-int4")
    assert "2 of 4 gates passed. 1 had no measurement" in md
    est = _row(md, "orin-tpot")
    assert "estimated" in est and "measured" not in est and DEVICE in est
    assert "[^estimated]:" in md  # the footnote that explains the marker
    assert "measured" in _row(md, "kl") and "**FAIL**" in _row(md, "ppl") and "missing" in _row(md, "onnx-kl")
    assert "≤ 12.91 (baseline +5%)" in _row(md, "ppl")
    latency_rows = [line for line in md.split("### Latency", 1)[1].split("###", 1)[0].splitlines() if DEVICE in line]
    assert len(latency_rows) == 1 and "estimated" in latency_rows[0] and "62.0%" in latency_rows[0]


def test_markdown_tables_for_accuracy_search_and_exports() -> None:
    md = markdown_summary(failing_report())
    for heading in ("### Gates", "### Accuracy", "### Latency", "### Search", "### Exports"):
        assert heading in md
    assert "w4g128 ◀ chosen" in _row(md, "w4g128 ◀ chosen") and "Chosen: **w4g128**" in md
    assert "| w8 |" in md  # a candidate without size or KL is still listed
    assert "96.9%" in _row(md, "compressed")  # top-1 agreement as a percentage


def test_markdown_passing_report_has_no_footnote() -> None:
    md = markdown_summary(passing_report())
    assert md.startswith("## ✅ PASS: quickstart") and "[^estimated]" not in md and "### Latency" not in md


def test_markdown_infers_kind_for_older_reports() -> None:
    report = failing_report()
    for e in report["evaluations"]:
        del e["kind"]
    assert markdown_summary(report) == markdown_summary(failing_report())


def test_github_summary_appends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    assert append_github_summary("# nothing") is False
    target = tmp_path / "step_summary.md"
    target.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(target))
    assert append_github_summary("# one") is True
    assert append_github_summary("# two\n") is True
    assert target.read_text() == "earlier step\n# one\n# two\n"


# ------------------------------------------------------------------------------------ plots


def _assert_png(path: Path | None) -> None:
    assert path is not None and path.is_file() and path.stat().st_size > 0
    assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_pareto_points_and_front() -> None:
    report = failing_report()
    search = report.pop("search")
    points = {p["label"]: p for p in pareto_points(report)}
    # gguf's accuracy has no size of its own: the latency evaluation of the same artifact gives it
    assert points["gguf"]["size_mb"] == 78.9 and points["compressed"]["size_mb"] == 74.2
    assert set(points) == {"baseline", "compressed", "gguf"}
    front = [p["label"] for p in pareto_front(list(points.values()))]
    assert front == ["compressed", "baseline"]
    # a search plots its candidates only (its evaluations are the chosen candidate's, already one of them)
    points = {p["label"]: p for p in pareto_points({**report, "search": search})}
    assert set(points) == {"w4g128 (chosen)", "w3g64"}
    assert [p["label"] for p in pareto_front(list(points.values()))] == ["w3g64", "w4g128 (chosen)"]


def test_plots_are_pngs(tmp_path: Path) -> None:
    _assert_png(plot_pareto(failing_report(), tmp_path / "p" / "pareto.png"))
    _assert_png(plot_latency(failing_report(), tmp_path / "p" / "latency.png"))
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["latency.png", "pareto.png"]  # no partial files left


def test_plots_return_none_without_data(tmp_path: Path) -> None:
    assert plot_pareto(empty_report(), tmp_path / "pareto.png") is None
    assert plot_latency(passing_report(), tmp_path / "latency.png") is None  # accuracy without sizes, no latency
    assert plot_pareto(passing_report(), tmp_path / "pareto.png") is None
    assert not list(tmp_path.iterdir())


def test_write_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    summary = tmp_path / "gh.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    written = write_reports(tmp_path / "out", failing_report(), "compress")
    assert written == {"junit": "junit.xml", "summary": "summary.md", "pareto": "plots/pareto.png", "latency": "plots/latency.png"}
    _assert_png(tmp_path / "out" / written["pareto"])
    assert (tmp_path / "out" / "summary.md").read_text() == summary.read_text()

    monkeypatch.delenv("GITHUB_STEP_SUMMARY")
    written = write_reports(tmp_path / "empty", copy.deepcopy(empty_report()), "compress gate")
    assert written == {"junit": "junit.xml", "summary": "summary.md"}
    assert not (tmp_path / "empty" / "plots").exists()


def test_missing_relative_gate_shows_its_rule_and_none() -> None:
    report = failing_report()
    report["gates"][2] = _gate("onnx-ppl", "perplexity", "onnx", None, "max_increase_pct", 5.0, False, "missing", runtime=None, device=None)
    assert "≤ baseline +5%" in _row(markdown_summary(report), "onnx-ppl")
    _, cases = _cases(junit_xml(report, "s"))
    props = {p.get("name"): p.get("value") for p in cases["onnx-ppl"].iter("property")}
    assert props["value"] == "none" and props["runtime"] == "none" and props["limit"] == "≤ baseline +5%"


def test_importing_reports_loads_neither_torch_nor_matplotlib() -> None:
    import subprocess
    import sys

    code = "import sys, compress.eval.reports; print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_runtime_names_its_build_and_the_summary_lists_each_once() -> None:
    import importlib.metadata

    from compress.eval.identity import runtime_build, with_build
    from compress.eval.metrics import Evaluation

    llama = runtime_build("llama.cpp", "cpu")
    assert llama["llama_cpp_python"] == importlib.metadata.version("llama_cpp_python")
    assert llama["ggml"].count(".") == 2 and "CPU" in llama["system_info"]
    ort = runtime_build("onnxruntime", "cpu")
    assert ort["onnxruntime"] == importlib.metadata.version("onnxruntime") and "git-commit-id=" in ort["onnxruntime_build"]
    assert runtime_build("torch", "cpu")["device"].startswith("cpu: ")
    measured = [with_build(Evaluation("q4_0", "llama.cpp", "cpu", {"kl_divergence": 0.1})) for _ in range(2)]
    estimated = with_build(Evaluation("q4_0", "llama.cpp", "jetson-orin", {"decode_tokens_per_s": 9.0}, source="estimated", kind="latency"))
    assert measured[0].to_json()["build"] == llama and "build" not in estimated.to_json()
    report = {"recipe": "r", "passed": True, "evaluations": [e.to_json() for e in [*measured, estimated]], "gates": []}
    summary = markdown_summary(report)
    assert summary.count("- **llama.cpp** on cpu: ") == 1 and f"llama_cpp_python {llama['llama_cpp_python']}" in summary
