"""Reports of a run for machines, people and CI, all rendered from report.json.

* ``REPORT_SCHEMA``: the JSON Schema of report.json, generated from compress.schema.report.Report
  (committed as docs/schemas/report.schema.json, and as docs/report.schema.json for existing links);
* ``junit_xml``: one test case per gate, for GitLab / Jenkins / any JUnit reader;
* ``markdown_summary``: gates, accuracy, latency and search tables (GitHub step summary);
* ``plot_pareto`` / ``plot_latency``: KL divergence against size, TTFT / TPOT bars.

An estimated value (a device profile, not a run on the device) is marked as estimated in
every output; a gate without a measurement is a failure everywhere. This module needs neither
torch nor a model: it reads the report dict only, so CI can render a report.json anywhere.
"""

from __future__ import annotations

import json
import math
import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from compress.json_schemas import json_schema
from compress.schema import report as _report

REPORT_SCHEMA_VERSION = _report.REPORT_VERSION
SOURCES = list(_report.SOURCES)  # where an evaluation's numbers came from
GATE_SOURCES = list(_report.GATE_SOURCES)  # a gate can also find no measurement at all
EVALUATION_KINDS = list(_report.EVALUATION_KINDS)
THRESHOLD_KINDS = list(_report.THRESHOLD_KINDS)  # compress.recipe.THRESHOLD_KEYS (a test checks)
NON_FINITE = list(_report.NON_FINITE)  # how compress.documents.json_safe writes non-finite floats
UPPER_BOUNDS = ("max", "max_increase", "max_increase_pct")  # threshold kinds that pass when value <= limit
ACCURACY_KINDS = ("accuracy", "kv_cache")
REPORT_FILES = {"junit": "junit.xml", "summary": "summary.md", "pareto": "plots/pareto.png", "latency": "plots/latency.png"}
ESTIMATED_NOTE = (
    "Estimated: computed from the device profile (memory bandwidth, compute, memory size), not from running the artifact on that device."
)


REPORT_SCHEMA: dict[str, Any] = json_schema("report")
"""The JSON Schema of report.json, generated from compress.schema.report.Report."""


def write_schema(path: Path) -> Path:
    path = Path(path)
    _write_text(path, json.dumps(REPORT_SCHEMA, indent=2) + "\n")
    return path


def validate_report(report: dict[str, Any]) -> list[str]:
    """Every way ``report`` breaks REPORT_SCHEMA, as "$.json.path: message" lines (empty: valid)."""
    try:
        import jsonschema
    except ImportError as e:
        raise ImportError("validating a report needs jsonschema: pip install jsonschema (it is in compress[dev])") from e
    validator = jsonschema.Draft202012Validator(REPORT_SCHEMA)
    errors = sorted(validator.iter_errors(report), key=lambda err: list(map(str, err.absolute_path)))
    return [f"{err.json_path}: {err.message}" for err in errors]


# ---------------------------------------------------------------------------------- helpers


def _write_text(path: Path, text: str) -> None:
    """Write atomically: a temporary file next to ``path``, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _num(value: Any) -> float | None:
    """A finite or non-finite float from a report value (numbers, "nan"/"inf" strings); else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)) or value in NON_FINITE:
        return float(value)
    return None


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value) or abs(value) < 10**digits:
        return f"{value:.{digits}g}"
    return f"{value:.0f}"


def _percent(value: Any) -> str:
    v = _num(value)
    return "—" if v is None else f"{100 * v:.1f}%" if math.isfinite(v) else str(value)


def _kind(evaluation: dict[str, Any]) -> str:
    """The evaluation's kind; inferred from its metrics for reports that predate the field."""
    if "kind" in evaluation:
        return evaluation["kind"]
    metrics = evaluation.get("metrics", {})
    if "kl_divergence" in metrics or "perplexity" in metrics:
        return "kv_cache" if evaluation.get("artifact") == "kv_cache" else "accuracy"
    return "latency" if "ttft_ms" in metrics or "tpot_ms" in metrics else "memory"


def _relation(threshold: dict[str, Any]) -> str:
    return "≤" if threshold.get("kind") in UPPER_BOUNDS else "≥"


def _limit_text(threshold: dict[str, Any], digits: int = 4) -> str:
    kind, limit = threshold.get("kind"), threshold.get("limit")
    if kind in ("max", "min"):
        return f"{_relation(threshold)} {_fmt(threshold.get('value') if limit is None else limit, digits)}"
    unit = "%" if kind.endswith("_pct") else ""
    relative = f"baseline {'+' if kind.startswith('max_increase') else '−'}{_fmt(threshold.get('value'))}{unit}"
    return f"{_relation(threshold)} {relative}" if limit is None else f"{_relation(threshold)} {_fmt(limit, digits)} ({relative})"


def runtime_on_device(item: dict[str, Any]) -> str:
    """ "runtime on device" for a gate or evaluation."""
    runtime, device = item.get("runtime"), item.get("device")
    return " on ".join(str(p) for p in (runtime, device) if p) or "no runtime"


# ------------------------------------------------------------------------------------ JUnit

_XML_ILLEGAL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _x(value: Any) -> str:
    """Text safe for XML 1.0 (ElementTree escapes markup but keeps illegal control characters)."""
    return _XML_ILLEGAL.sub("?", str(value))


def junit_xml(report: dict[str, Any], suite: str) -> str:
    """One <testcase> per gate: classname = artifact, name = gate name. Failed and unmeasured
    gates carry a <failure>; every case says its source in <properties> and <system-out>."""
    gates = report.get("gates", [])
    failures = sum(not g["passed"] for g in gates)
    counts = {"tests": str(len(gates)), "failures": str(failures), "errors": "0", "skipped": "0", "time": "0"}
    root = ET.Element("testsuites", {"name": _x(suite), **counts})
    ts = ET.SubElement(root, "testsuite", {"name": _x(suite), **counts})
    props = ET.SubElement(ts, "properties")
    for key in ("recipe", "schema_version", "passed"):
        ET.SubElement(props, "property", {"name": key, "value": _x(report.get(key))})
    for gate in gates:
        _testcase(ts, gate)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def _testcase(suite_el: ET.Element, gate: dict[str, Any]) -> None:
    case = ET.SubElement(suite_el, "testcase", {"classname": _x(gate["artifact"]), "name": _x(gate["name"]), "time": "0"})
    threshold, source = gate.get("threshold", {}), gate.get("source")
    fields = {
        "metric": gate.get("metric"),
        "on": gate.get("on", "value"),
        "value": "none" if gate.get("value") is None else _fmt(gate.get("value"), 6),
        "limit": _limit_text(threshold, 6),
        "threshold_kind": threshold.get("kind"),
        "runtime": gate.get("runtime"),
        "device": gate.get("device"),
        "source": source,
    }
    props = ET.SubElement(case, "properties")
    fields = {k: "none" if v is None else v for k, v in fields.items()}
    for key, value in fields.items():
        ET.SubElement(props, "property", {"name": key, "value": _x(value)})
    detail = "\n".join(f"{k}: {v}" for k, v in fields.items())
    if source == "estimated":
        detail += "\n" + ESTIMATED_NOTE
    if not gate["passed"]:
        message = gate.get("message", "")
        message += " [estimated]" if source == "estimated" else ""
        fail = ET.SubElement(case, "failure", {"message": _x(message), "type": "missing" if source == "missing" else "gate"})
        fail.text = _x(detail)
    out = ET.SubElement(case, "system-out")
    out.text = _x(f"{gate.get('message', '')}\n{detail}")


def write_junit(path: Path, report: dict[str, Any], suite: str) -> Path:
    path = Path(path)
    _write_text(path, junit_xml(report, suite))
    return path


# --------------------------------------------------------------------------------- Markdown


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def table_lines(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _source_cell(source: Any) -> str:
    return "**estimated**[^estimated]" if source == "estimated" else str(source)


def _gate_metric(gate: dict[str, Any]) -> str:
    on = gate.get("on", "value")
    return gate["metric"] if on == "value" else f"{gate['metric']} ({on.replace('_95', ' 95%')})"


def _with_interval(e: dict[str, Any], metric: str, show: Any = _fmt) -> str:
    """The value, and its 95% interval in brackets when the evaluation has one."""
    text = show(e["metrics"].get(metric))
    interval = (e.get("intervals") or {}).get(metric)
    return text if interval is None else f"{text} [{show(interval['lower'])}, {show(interval['upper'])}]"


def markdown_summary(report: dict[str, Any]) -> str:
    gates, evaluations = report.get("gates", []), report.get("evaluations", [])
    passed = sum(bool(g["passed"]) for g in gates)
    estimated = [g for g in gates if g.get("source") == "estimated"] + [e for e in evaluations if e.get("source") == "estimated"]
    verdict = "✅ PASS" if report.get("passed") else "❌ FAIL"
    lines = [f"## {verdict}: {report.get('recipe') or 'compress'}", "", f"{passed} of {len(gates)} gates passed."]
    missing = sum(g.get("source") == "missing" for g in gates)
    if missing:
        lines[-1] += f" {missing} had no measurement (counted as failures)."
    lines.append("")
    if gates:
        lines += ["### Gates", ""]
        lines += table_lines(
            ["Gate", "Artifact", "Metric", "Value", "Limit", "Result", "Source", "Runtime / device"],
            [
                [
                    g["name"],
                    g["artifact"],
                    _gate_metric(g),
                    _fmt(g.get("value")),
                    _limit_text(g.get("threshold", {})),
                    "pass" if g["passed"] else "**FAIL**",
                    _source_cell(g.get("source")),
                    runtime_on_device(g) if g.get("source") != "missing" else "—",
                ]
                for g in gates
            ],
        )
    accuracy = [e for e in evaluations if _kind(e) in ACCURACY_KINDS]
    if accuracy:
        lines += ["### Accuracy", ""]
        lines += table_lines(
            ["Artifact", "Runtime", "Device", "Perplexity", "KL", "KL p99", "Top-1", "Tokens", "Size (MiB)", "Source"],
            [
                [
                    e["artifact"],
                    e["runtime"],
                    e["device"],
                    *(_with_interval(e, m) for m in ("perplexity", "kl_divergence", "kl_divergence_p99")),
                    _with_interval(e, "top1_agreement", _percent),
                    _fmt(e["metrics"].get("tokens_scored")),
                    _fmt(e["metrics"].get("size_mb")),
                    _source_cell(e.get("source")),
                ]
                for e in accuracy
            ],
        )
        if any(e.get("intervals") for e in accuracy):
            lines += ["In brackets: the 95% interval (a percentile bootstrap over the evaluation sequences).", ""]
    lines += _task_lines([e for e in evaluations if _kind(e) == "task"])
    lines += _draft_lines([e for e in evaluations if _kind(e) == "draft"])
    latency = [e for e in evaluations if _kind(e) == "latency"]
    if latency:
        lines += ["### Latency", ""]
        lines += table_lines(
            ["Artifact", "Runtime / device", "TTFT (ms)", "TPOT (ms)", "Tokens/s", "Peak RSS (MiB)", "Bandwidth use", "Source"],
            [
                [
                    e["artifact"],
                    runtime_on_device(e),
                    *(_fmt(e["metrics"].get(m)) for m in ("ttft_ms", "tpot_ms", "decode_tokens_per_s", "peak_rss_mb")),
                    _percent(e["metrics"].get("bandwidth_utilization")),
                    _source_cell(e.get("source")),
                ]
                for e in latency
            ],
        )
    memory = [e for e in evaluations if _kind(e) == "memory"]
    if memory:
        names = sorted({m for e in memory for m in e["metrics"]})
        lines += ["### Memory", ""]
        lines += table_lines(
            ["Artifact", "Runtime / device", *names, "Source"],
            [
                [e["artifact"], runtime_on_device(e), *(_fmt(e["metrics"].get(m)) for m in names), _source_cell(e.get("source"))]
                for e in memory
            ],
        )
    lines += _build_lines(evaluations)
    lines += search_lines(report.get("search"))
    lines += _export_lines(report.get("exports"))
    lines += _run_memory_lines(report.get("memory"))
    if estimated:
        lines += [f"[^estimated]: {ESTIMATED_NOTE}", ""]
    return "\n".join(lines).rstrip() + "\n"


def _task_lines(tasks: list[dict[str, Any]]) -> list[str]:
    """Task accuracy per task and artifact, in points, with the 95% interval and the cost."""
    if not tasks:
        return []
    lines = ["### Tasks", ""]
    lines += table_lines(
        ["Task", "Artifact", "Runtime / device", "Accuracy (%)", "Acc. norm (%)", "Questions", "Questions/s"],
        [
            [
                (e.get("details") or {}).get("task", "?"),
                e["artifact"],
                runtime_on_device(e),
                _with_interval(e, "accuracy", lambda v: _fmt(v, 3)),
                _with_interval(e, "accuracy_norm", lambda v: _fmt(v, 3)) if "accuracy_norm" in e["metrics"] else "—",
                _fmt(e["metrics"].get("questions")),
                _fmt(e["metrics"].get("questions_per_s"), 3),
            ]
            for e in tasks
        ],
    )
    return lines + ["Accuracy in percent; in brackets its 95% interval (± 1.96 × lm-eval's standard error).", ""]


def _draft_lines(drafts: list[dict[str, Any]]) -> list[str]:
    """A draft stage's pair on each runtime: greedy speculative decoding at the best k."""
    if not drafts:
        return []
    lines = ["### Speculative decoding", ""]
    lines += table_lines(
        [
            "Artifact",
            "Runtime / device",
            "Draft share",
            "Best k",
            "Tokens / target pass",
            "Accepted / pass",
            "Speed-up",
            "Greedy identical",
        ],
        [
            [
                e["artifact"],
                runtime_on_device(e),
                _percent(e["metrics"].get("draft_share")),
                _fmt(e["metrics"].get("best_k")),
                _fmt(e["metrics"].get("tokens_per_pass"), 3),
                _with_interval(e, "draft_acceptance", lambda v: _fmt(v, 3)),
                _with_interval(e, "speculative_speedup", lambda v: _fmt(v, 3)),
                _percent(e["metrics"].get("draft_greedy_identical")),
            ]
            for e in drafts
        ],
    )
    return lines + [
        "Greedy decoding at the k with the highest speed-up over the target alone on the same runtime and prompts; "
        "in brackets the 95% interval over prompts. Every k and temperature: report.json's details.",
        "",
    ]


def _build_lines(evaluations: list[dict[str, Any]]) -> list[str]:
    """One line per runtime build that measured a number above: which versions, on which device."""
    builds: dict[str, dict[str, str]] = {}
    for e in evaluations:
        if e.get("build"):
            builds.setdefault(json.dumps(e["build"], sort_keys=True), e["build"])
    if not builds:
        return []
    lines = ["### Runtime builds", ""]
    for build in builds.values():
        rest = ", ".join(f"{k} {v}" for k, v in build.items() if k not in ("runtime", "device"))
        lines.append(f"- **{build.get('runtime')}** on {build.get('device')}: {rest}")
    return [*lines, ""]


def search_lines(search: dict[str, Any] | None) -> list[str]:
    if not search or not search.get("candidates"):
        return []
    chosen = search.get("chosen")
    rows = [
        [
            c["name"] + (" ◀ chosen" if c["name"] == chosen else ""),
            ", ".join(c.get("overrides", [])) or "—",
            _fmt(c.get("size_mb")),
            _fmt(c.get("metrics", {}).get("kl_divergence")),
            {True: "pass", False: "**FAIL**"}.get(c.get("passed"), "—"),
            c.get("status", "—"),
        ]
        for c in search["candidates"]
    ]
    return [
        "### Search",
        "",
        *table_lines(["Candidate", "Overrides", "Size (MiB)", "KL", "Gates", "Status"], rows),
        f"Chosen: **{chosen}**" if chosen else "No candidate passed every gate.",
        "",
    ]


def _export_lines(exports: list[dict[str, Any]] | None) -> list[str]:
    if not exports:
        return []
    rows = [
        [e["name"], e["format"], {True: "yes", False: "**no**"}.get(e.get("verified"), "not run"), e.get("evaluated_as") or "—"]
        for e in exports
    ]
    return ["### Exports", "", *table_lines(["Export", "Format", "Verified", "Evaluated as"], rows)]


MEMORY_METHODS = {
    "vmhwm": "each phase's own peak (the kernel's high-water mark, reset when the phase starts)",
    "ru_maxrss": "the process's peak so far at the end of each phase (its high-water mark could not be reset)",
}


def _run_memory_lines(memory: dict[str, Any] | None) -> list[str]:
    """The run's peak memory per phase against `compress plan`'s prediction (report.json's ``memory``)."""
    if not memory:
        return []
    cuda = "peak_cuda_mb" in memory or any("peak_cuda_mb" in p for p in memory.get("phases", {}).values())
    predicted = memory.get("predicted") or {}
    ratios = memory.get("measured_over_predicted") or {}

    def row(name: str, item: dict[str, Any], plan: Any, ratio: Any) -> list[Any]:
        cells = [name, _fmt(item.get("peak_rss_mb"), 6)]
        return cells + ([_fmt(item.get("peak_cuda_mb"), 6)] if cuda else []) + [_fmt(plan, 6), _fmt(ratio, 3)]

    rows = [row(k, p, p.get("predicted_rss_mb"), p.get("measured_over_predicted")) for k, p in memory.get("phases", {}).items()]
    rows.append(row("**run**", memory, predicted.get("peak_rss_mb"), ratios.get("peak_rss")))
    header = ["Phase", "Peak RSS (MiB)", *(["Peak CUDA (MiB)"] if cuda else []), "Plan (MiB)", "Measured / plan"]
    notes = [f"Peak RSS: {MEMORY_METHODS.get(memory.get('method'), memory.get('method'))}."]
    notes.append(
        f"Child processes' peak: {_fmt(memory.get('children_peak_rss_mb'), 6)} MiB (an upper bound: a child counts this "
        "process's memory at its start)."
    )
    if "error" in predicted:
        notes.append(f"No plan: {predicted['error']}")
    else:
        notes.append(
            f"Wall time {_fmt(memory.get('wall_s'), 6)} s, plan {_fmt(predicted.get('time_s'), 6)} s (measured / plan {_fmt(ratios.get('time'), 3)})."
        )
    return ["### Peak memory per phase", "", *table_lines(header, rows), " ".join(notes), ""]


def append_github_summary(markdown: str) -> bool:
    """Append to the file named by $GITHUB_STEP_SUMMARY (GitHub Actions); False when unset."""
    target = os.environ.get("GITHUB_STEP_SUMMARY")
    if not target:
        return False
    with open(target, "a", encoding="utf-8") as f:
        f.write(markdown if markdown.endswith("\n") else markdown + "\n")
    return True


# ------------------------------------------------------------------------------------ plots


def pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("report plots need matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}.png")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    os.replace(tmp, path)
    return path


def pareto_points(report: dict[str, Any]) -> list[dict[str, Any]]:
    """(label, size_mb, kl, estimated) for every artifact or search candidate with both values."""
    evaluations = report.get("evaluations", [])
    sizes = {e["artifact"]: e["metrics"]["size_mb"] for e in evaluations if "size_mb" in e.get("metrics", {})}
    accuracy = [e for e in evaluations if _kind(e) in ACCURACY_KINDS and "kl_divergence" in e["metrics"]]
    runtimes: dict[str, int] = {}
    for e in accuracy:
        runtimes[e["artifact"]] = runtimes.get(e["artifact"], 0) + 1
    search = report.get("search")
    if search:  # a search plots its candidates; the evaluations are the chosen one's, already a candidate
        chosen = search.get("chosen")
        raw = [
            (
                c["name"] + (" (chosen)" if c["name"] == chosen else ""),
                c.get("size_mb"),
                (c.get("metrics") or {}).get("kl_divergence"),
                c.get("source") == "estimated",
            )
            for c in search.get("candidates", [])
        ]
    else:
        raw = [
            (
                e["artifact"] + (f" ({e['runtime']})" if runtimes[e["artifact"]] > 1 else ""),
                e["metrics"].get("size_mb", sizes.get(e["artifact"])),
                e["metrics"]["kl_divergence"],
                e.get("source") == "estimated",
            )
            for e in accuracy
        ]
    points = []
    for label, size, kl, estimated in raw:
        size, kl = _num(size), _num(kl)
        if size is not None and kl is not None and math.isfinite(size) and math.isfinite(kl):
            points.append({"label": label, "size_mb": size, "kl": kl, "estimated": estimated})
    return points


def pareto_front(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The points no other point beats on both size and KL (both lower is better), by size."""
    front: list[dict[str, Any]] = []
    for p in sorted(points, key=lambda p: (p["size_mb"], p["kl"])):
        if not front or p["kl"] < front[-1]["kl"]:
            front.append(p)
    return front


def plot_pareto(report: dict[str, Any], path: Path) -> Path | None:
    points = pareto_points(report)
    if not points:
        return None
    plt = pyplot()
    front = pareto_front(points)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        ax.plot([p["size_mb"] for p in front], [p["kl"] for p in front], "-", color="tab:red", lw=1.5, zorder=1, label="Pareto front")
        for p in points:
            on_front = any(p is q for q in front)
            color = "tab:red" if on_front else "tab:blue"
            ax.scatter(
                p["size_mb"],
                p["kl"],
                s=70 if on_front else 40,
                zorder=2,
                linewidths=1.5,
                edgecolors=color,
                facecolors="none" if p["estimated"] else color,
            )
            ax.annotate(
                p["label"] + (" (estimated)" if p["estimated"] else ""),
                (p["size_mb"], p["kl"]),
                textcoords="offset points",
                xytext=(5, 5),
                fontsize=8,
            )
        positive = [p["kl"] for p in points if p["kl"] > 0]
        if positive and max(positive) > 100 * min(positive):
            ax.set_yscale("symlog", linthresh=min(positive))
        if any(p["estimated"] for p in points):
            ax.scatter([], [], facecolors="none", edgecolors="gray", label="hollow = estimated")
        ax.set_xlabel("size (MiB)")
        ax.set_ylabel("KL divergence vs baseline (nats/token)")
        ax.set_title(f"Size vs accuracy: {report.get('recipe') or 'compress'}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        return save_figure(fig, path)
    finally:
        plt.close(fig)


def plot_latency(report: dict[str, Any], path: Path) -> Path | None:
    rows = [
        e
        for e in report.get("evaluations", [])
        if _kind(e) == "latency" and any(_num(e["metrics"].get(m)) is not None for m in ("ttft_ms", "tpot_ms"))
    ]
    if not rows:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(rows) + 2), 4.5))
    try:
        width = 0.38
        for j, (metric, color) in enumerate((("ttft_ms", "tab:blue"), ("tpot_ms", "tab:orange"))):
            for i, e in enumerate(rows):
                value = _num(e["metrics"].get(metric))
                if value is None or not math.isfinite(value):
                    continue
                estimated = e.get("source") == "estimated"
                bar = ax.bar(
                    i + (j - 0.5) * width,
                    value,
                    width,
                    color=color,
                    hatch="//" if estimated else None,
                    edgecolor="black" if estimated else color,
                    label=metric if i == 0 else None,
                )
                ax.bar_label(bar, labels=[_fmt(value, 3) + ("\nest." if estimated else "")], fontsize=7)
        ax.set_xticks(
            range(len(rows)),
            [f"{e['artifact']}\n{e['runtime']}\n{e['device']}" + ("\n(estimated)" if e.get("source") == "estimated" else "") for e in rows],
            fontsize=8,
        )
        handles, labels = ax.get_legend_handles_labels()
        if any(e.get("source") == "estimated" for e in rows):
            from matplotlib.patches import Patch

            handles.append(Patch(facecolor="white", edgecolor="black", hatch="//"))
            labels.append("hatched = estimated")
        ax.legend(handles, labels, fontsize=8)
        ax.margins(y=0.15)
        ax.set_ylabel("ms (median)")
        ax.set_title("Time to first token and time per output token")
        ax.grid(True, axis="y", alpha=0.3)
        return save_figure(fig, path)
    finally:
        plt.close(fig)


# ---------------------------------------------------------------------------------- all of it


def write_reports(out_dir: Path, report: dict[str, Any], suite: str, step_summary: bool = True) -> dict[str, str]:
    """junit.xml, summary.md and the plots that apply under ``out_dir``; returns {kind: relative
    path}. With ``step_summary``, the summary is also appended to the GitHub Actions step summary
    when there is one (a search appends its own summary once, not each candidate's)."""
    out_dir = Path(out_dir)
    written = {"junit": write_junit(out_dir / REPORT_FILES["junit"], report, suite)}
    summary = markdown_summary(report)
    _write_text(out_dir / REPORT_FILES["summary"], summary)
    written["summary"] = out_dir / REPORT_FILES["summary"]
    for kind, plot in (("pareto", plot_pareto), ("latency", plot_latency)):
        if (path := plot(report, out_dir / REPORT_FILES[kind])) is not None:
            written[kind] = path
    if step_summary:
        append_github_summary(summary)
    return {kind: path.relative_to(out_dir).as_posix() for kind, path in written.items()}
