"""Latency on real runtimes, device gates (measured here vs estimated elsewhere), `compress gate`
and the report files, on a tiny random Llama exported to GGUF (llama.cpp) and int4 ONNX (ONNX Runtime)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from compress.eval.reports import validate_report
from tests.helpers import recipe_text, run_cli, write_recipe

pytest.importorskip("llama_cpp")
pytest.importorskip("onnxruntime_genai")
pytestmark = pytest.mark.runtime  # every test here runs exports in llama.cpp and ONNX Runtime GenAI

LATENCY = """\
latency:
  prompt_tokens: 16
  output_tokens: 6
  batch_sizes: [1, 2]
  warmup: 1
  repeats: 2
targets:
  - device: raspberry-pi-5-8gb
    context: 4096
"""
# Estimated gates are computed from the file size and a device profile, the same on every machine, so their bounds
# are tight (the Pi estimate of q4's tpot is 0.0133 ms, the Jetson memory fraction of int4 4.7e-5). Latency measured
# on a shared machine varies by orders of magnitude with the other work on its cores, so measured bounds are loose
# here and test_gate_command_times_the_runtimes_... shows the same gates failing.
GATES = """\
  - metric: kl_divergence
    artifact: q4
    max: 0.01
  - metric: tpot_ms
    artifact: q4
    max: 1000
  - metric: tpot_ms
    artifact: q4
    device: raspberry-pi-5-8gb
    max: 0.5
  - metric: memory_fraction
    artifact: int4
    device: jetson-orin-nano-8gb
    max: 0.001
  - metric: decode_tokens_per_s
    artifact: int4
    min: 1
  - metric: tpot_ms
    artifact: int4
    max_increase_pct: 1000
"""


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory, onnx_model_dir: Path, text_dir: Path) -> Path:
    tmp = tmp_path_factory.mktemp("gate")
    text = recipe_text(onnx_model_dir, text_dir, bits=4, group_size=32, symmetric=False, gates=GATES)
    text = text.replace("exports: []", "exports:\n  - format: gguf\n    name: q4\n  - format: onnx\n    name: int4\n" + LATENCY)
    recipe = write_recipe(tmp, text)
    result = run_cli(["run", recipe, "-o", tmp / "out"])
    assert result.exit_code == 0, result.output
    return tmp / "out"


def test_run_measures_latency_on_each_runtime_and_estimates_other_devices(artifact: Path) -> None:
    report = json.loads((artifact / "report.json").read_text())
    assert validate_report(report) == []
    latency = [e for e in report["evaluations"] if e["kind"] == "latency"]
    measured = {e["artifact"]: e for e in latency if e["source"] == "measured"}
    assert {(n, e["runtime"]) for n, e in measured.items()} == {
        ("baseline", "torch"),
        ("compressed", "torch"),
        ("q4", "llama.cpp"),
        ("int4", "onnxruntime"),
    }  # baseline: a gate compares with it
    for e in measured.values():
        m = e["metrics"]
        assert 0 < m["ttft_ms"] <= m["ttft_ms_p90"] and 0 < m["tpot_ms"] <= m["tpot_ms_p90"]
        assert m["decode_tokens_per_s"] == pytest.approx(1e3 / m["tpot_ms"])
        assert m["peak_rss_mb"] > e["details"]["rss_before_load_mb"] > 0
        assert 0 < m["bandwidth_utilization"] and m["size_mb"] > 0
        assert "profile" not in e
    assert "batch_decode_tokens_per_s" in measured["int4"]["metrics"]  # GenAI decodes batch 2
    assert "2" in measured["q4"]["details"]["skipped_batches"]  # llama-cpp-python's Llama decodes one sequence
    assert report["host"]["bandwidth_gbs"] > 0
    estimated = [e for e in report["evaluations"] if e.get("profile") == "raspberry-pi-5-8gb"]
    assert {e["kind"] for e in estimated} == {"latency", "memory"}
    assert all(e["source"] == "estimated" and e["device"] == "raspberry-pi-5-8gb" for e in estimated)
    assert not any(e["runtime"] == "torch" for e in estimated)  # the Pi profile runs llama.cpp and onnxruntime only
    gates = {g["name"]: g for g in report["gates"]}
    assert gates["q4.tpot_ms.max"]["source"] == "measured"
    assert gates["q4.tpot_ms@raspberry-pi-5-8gb.max"]["source"] == "estimated"
    assert gates["int4.memory_fraction@jetson-orin-nano-8gb.max"]["source"] == "estimated"
    relative = gates["int4.tpot_ms.max_increase_pct"]
    assert relative["threshold"]["baseline"] == measured["baseline"]["metrics"]["tpot_ms"] and relative["source"] == "measured"
    # each gate judged the number its evaluation holds, against its limit
    pi_latency = next(e for e in estimated if e["kind"] == "latency" and e["artifact"] == "q4")
    jetson_memory = next(
        e for e in report["evaluations"] if e.get("profile") == "jetson-orin-nano-8gb" and e["kind"] == "memory" and e["artifact"] == "int4"
    )
    assert gates["q4.tpot_ms.max"]["value"] == measured["q4"]["metrics"]["tpot_ms"]
    assert gates["q4.tpot_ms@raspberry-pi-5-8gb.max"]["value"] == pi_latency["metrics"]["tpot_ms"]
    assert gates["int4.memory_fraction@jetson-orin-nano-8gb.max"]["value"] == jetson_memory["metrics"]["memory_fraction"]
    assert gates["int4.decode_tokens_per_s.min"]["value"] == measured["int4"]["metrics"]["decode_tokens_per_s"]
    assert relative["value"] == measured["int4"]["metrics"]["tpot_ms"]
    assert relative["threshold"]["limit"] == pytest.approx(11 * relative["threshold"]["baseline"])  # at most 1000% slower
    for g in gates.values():
        limit = g["threshold"]["limit"]
        assert g["passed"] is (g["value"] >= limit if g["threshold"]["kind"] == "min" else g["value"] <= limit), g


def test_run_writes_junit_markdown_and_plots(artifact: Path) -> None:
    suite = ET.parse(artifact / "junit.xml").getroot()
    cases = suite.findall(".//testcase")
    assert len(cases) == 6 and not suite.findall(".//failure")
    estimated = [c for c in cases if "@" in c.get("name")]
    assert estimated and all("estimated" in (c.findtext("system-out") or "") for c in estimated)
    summary = (artifact / "summary.md").read_text()
    assert "PASS" in summary and "estimated" in summary
    for plot in ("plots/pareto.png", "plots/latency.png"):
        assert (artifact / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert "junit.xml" in manifest["files"] and "latency_s" in manifest["timings"]


def _gates_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "gates.yaml"
    path.write_text("gates:\n" + body)
    return path


def test_gate_command_on_gguf_and_onnx_exports(artifact: Path, tmp_path: Path) -> None:
    body = (
        "  - {metric: kl_divergence, artifact: q4, max: 0.01}\n  - {metric: kl_divergence, artifact: int4, max: 0.01}\n"
        "  - {metric: top1_agreement, artifact: compressed, min: 0.95}\n"
    )  # measured: KL 0.00023 each, top-1 100%
    result = run_cli(["gate", artifact, "--gates", _gates_file(tmp_path, body), "-o", tmp_path / "r1", "-q"])
    assert result.exit_code == 0, result.output
    cases = ET.parse(tmp_path / "r1" / "junit.xml").getroot().findall(".//testcase")
    assert len(cases) == 3
    report = json.loads((tmp_path / "r1" / "report.json").read_text())
    assert validate_report(report) == []
    run_report = json.loads((artifact / "report.json").read_text())
    kl = {e["artifact"]: e["metrics"]["kl_divergence"] for e in report["evaluations"]}
    run_kl = {e["artifact"]: e["metrics"]["kl_divergence"] for e in run_report["evaluations"] if e["kind"] == "accuracy"}
    for name in ("q4", "int4", "compressed"):  # the same text and baseline as the run: the same numbers
        assert kl[name] == pytest.approx(run_kl[name], rel=1e-4, abs=1e-7)
    tightened = body.replace("artifact: q4, max: 0.01", f"artifact: q4, max: {kl['q4'] * 0.5}")
    result = run_cli(["gate", artifact, "--gates", _gates_file(tmp_path, tightened), "-o", tmp_path / "r2", "-q"])
    assert result.exit_code == 1, result.output
    failures = ET.parse(tmp_path / "r2" / "junit.xml").getroot().findall(".//failure")
    assert len(failures) == 1


def test_gate_command_on_a_bare_gguf_file_needs_a_baseline(artifact: Path, onnx_model_dir: Path, text_dir: Path, tmp_path: Path) -> None:
    gguf = artifact / "exports" / "q4" / "model.gguf"
    gates = tmp_path / "gates.yaml"
    gates.write_text(
        f"data:\n  evaluation: {{source: {text_dir}, samples: 2, seq_len: 32, min_context: 8}}\n"
        "gates:\n  - {metric: kl_divergence, max: 0.01}\n"
    )
    result = run_cli(["gate", gguf, "--gates", gates, "-o", tmp_path / "r", "-q"])
    assert result.exit_code == 2 and "--baseline" in result.output
    result = run_cli(["gate", gguf, "--gates", gates, "--baseline", onnx_model_dir, "-o", tmp_path / "r", "-q"])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["artifact"]["kind"] == "gguf"
    assert {(e["artifact"], e["runtime"]) for e in report["evaluations"]} == {("baseline", "torch"), ("compressed", "llama.cpp")}


def test_gate_command_bad_input_exits_2(artifact: Path, tmp_path: Path) -> None:
    result = run_cli(["gate", artifact, "--gates", _gates_file(tmp_path, "  - {metric: kl_divergence, max: 1, devise: x}\n"), "-q"])
    assert result.exit_code == 2 and "gates.yaml:2" in result.output and "devise" in result.output
    result = run_cli(["gate", artifact, "--gates", _gates_file(tmp_path, "  - {metric: memory_fraction, max: 1, device: h100}\n"), "-q"])
    assert result.exit_code == 2 and "h100-sxm" in result.output
    result = run_cli(["gate", artifact, "--gates", _gates_file(tmp_path, "  - {metric: kl_divergence, artifact: q8, max: 1}\n"), "-q"])
    assert result.exit_code == 2 and "q4" in result.output
    result = run_cli(["gate", tmp_path, "--gates", _gates_file(tmp_path, "  - {metric: kl_divergence, max: 1}\n"), "-q"])
    assert result.exit_code == 2 and "not a compress artifact" in result.output


SEARCH = """\
search:
  variants:
    stages.0.quantize.bits: [8, 2, 4, 3]
"""


@pytest.mark.parametrize("stop", [False, True])
def test_search_picks_the_smallest_passing_candidate(tmp_path: Path, tiny_model_dir: Path, text_dir: Path, stop: bool) -> None:
    gates = "  - metric: kl_divergence\n    max: 0.002\n"
    text = recipe_text(tiny_model_dir, text_dir, bits=4, group_size=32, gates=gates) + SEARCH
    if stop:
        text += "  stop_at_first_pass: true\n"
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", tmp_path / "s"])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "s" / "report.json").read_text())
    assert validate_report(report) == []
    rows = report["search"]["candidates"]
    assert [r["overrides"] for r in rows] == [[f"stages.0.quantize.bits={b}"] for b in (2, 3, 4, 8)]  # smallest expected first
    ran = [r for r in rows if r["passed"] is not None]
    passing = [r for r in ran if r["passed"]]
    assert ran[0]["passed"] is False and passing  # 2 bits fails the KL gate, a wider one passes
    chosen = min(passing, key=lambda r: r["size_mb"])
    assert report["search"]["chosen"] == chosen["name"] and report["passed"]
    if stop:
        assert ran[-1] is passing[0] and all(r["status"].startswith("not run") for r in rows[len(ran) :])
    else:
        sizes = [r["size_mb"] for r in ran]
        assert len(ran) == 4 and all(a < b for a, b in zip(sizes, sizes[1:], strict=False))  # packed sizes grow with the bits
    assert (tmp_path / "s" / chosen["path"] / "manifest.json").is_file()
    assert (tmp_path / "s" / "plots" / "pareto.png").is_file() and "chosen" in result.stdout
    again = run_cli(["run", write_recipe(tmp_path, text), "-o", tmp_path / "s"])  # resumes: every candidate run is reused
    assert again.exit_code == 0 and "search candidate 1/" not in again.output
    assert {r["status"] for r in json.loads((tmp_path / "s" / "report.json").read_text())["search"]["candidates"][: len(ran)]} == {"reused"}
    edited = run_cli(["run", write_recipe(tmp_path, text.replace("max: 0.002", "max: 0.003")), "-o", tmp_path / "s"])
    assert edited.exit_code == 0  # another recipe: no candidate is reused
    assert "reused" not in {r["status"] for r in json.loads((tmp_path / "s" / "report.json").read_text())["search"]["candidates"]}


def test_gate_command_times_the_runtimes_and_the_baseline_for_relative_latency(artifact: Path, tmp_path: Path) -> None:
    """Latency gates pass and fail on what the runtimes measure: the last two limits are below anything a runtime
    can reach (1 ns per token, a billion tokens/s), so those two gates fail and the command exits 1."""
    gates = tmp_path / "gates.yaml"
    gates.write_text(
        "latency: {prompt_tokens: 16, output_tokens: 4, batch_sizes: [1], repeats: 2}\n"
        "gates:\n  - {metric: tpot_ms, artifact: q4, max_increase_pct: 1000}\n"
        "  - {metric: decode_tokens_per_s, artifact: q4, device: raspberry-pi-5-8gb, min: 1000}\n"  # estimated: 75,053
        "  - {metric: tpot_ms, artifact: q4, max: 1.0e-6}\n  - {metric: decode_tokens_per_s, artifact: int4, min: 1.0e9}\n"
    )
    result = run_cli(["gate", artifact, "--gates", gates, "-o", tmp_path / "r", "-q"])
    assert result.exit_code == 1, result.output
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert validate_report(report) == []
    latency = {(e["artifact"], e["source"]) for e in report["evaluations"] if e["kind"] == "latency"}
    assert {("baseline", "measured"), ("q4", "measured"), ("q4", "estimated"), ("int4", "measured")} <= latency
    assert [g["source"] for g in report["gates"]] == ["measured", "estimated", "measured", "measured"]
    assert [g["passed"] for g in report["gates"]] == [True, True, False, False]
    relative, _, fast, many = report["gates"]
    assert (
        relative["threshold"]["limit"] == pytest.approx(11 * relative["threshold"]["baseline"])
        and relative["value"] == fast["value"] > 1e-6
    )
    assert 0 < many["value"] < 1e9
    assert len(ET.parse(tmp_path / "r" / "junit.xml").getroot().findall(".//failure")) == 2
    assert "estimated" in result.stdout


def test_gate_command_on_an_onnx_folder_and_a_hugging_face_folder(
    artifact: Path, onnx_model_dir: Path, text_dir: Path, tmp_path: Path
) -> None:
    gates = tmp_path / "gates.yaml"
    gates.write_text(
        f"data:\n  evaluation: {{source: {text_dir}, samples: 2, seq_len: 32, min_context: 8}}\n"
        "gates:\n  - {metric: kl_divergence, max: 0.01}\n"
    )
    kl = {}
    for name, path in (("onnx", artifact / "exports" / "int4"), ("hf", onnx_model_dir)):
        result = run_cli(["gate", path, "--gates", gates, "--baseline", onnx_model_dir, "-o", tmp_path / name, "-q"])
        assert result.exit_code == 0, result.output
        report = json.loads((tmp_path / name / "report.json").read_text())
        assert report["artifact"]["kind"] == name and validate_report(report) == []
        kl[name] = next(e for e in report["evaluations"] if e["artifact"] == "compressed")["metrics"]["kl_divergence"]
    assert kl["hf"] == 0.0 < kl["onnx"]  # the source model against itself; the int4 file against the source


def test_gate_device_option_applies_to_latency_and_memory_gates_only(artifact: Path, tmp_path: Path) -> None:
    body = (
        "  - {metric: kl_divergence, artifact: q4, max: 0.01}\n  - {metric: tpot_ms, artifact: q4, max: 0.5}\n"
        "  - {metric: memory_fraction, artifact: q4, max: 0.001}\n"
    )  # the Pi estimates: 0.0133 ms, 0.0002
    gates = tmp_path / "gates.yaml"
    gates.write_text("latency: {prompt_tokens: 16, output_tokens: 4, batch_sizes: [1], repeats: 1}\ngates:\n" + body)
    result = run_cli(["gate", artifact, "--gates", gates, "--device", "raspberry-pi-5-8gb", "-o", tmp_path / "r", "-q"])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert [(g["metric"], g["source"]) for g in report["gates"]] == [
        ("kl_divergence", "measured"),
        ("tpot_ms", "estimated"),
        ("memory_fraction", "estimated"),
    ]
