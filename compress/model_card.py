"""The model card published with every registry version: Markdown generated from the artifact's
manifest and report only (no clock, no host), so the same artifact always gives the same card.

It says where the model came from (source, hash, license), what was done to it (each stage with
its fully expanded configuration), how it did (every gate with its value and where the value was
measured, or that it was estimated), what was produced (sizes, intended runtimes, speeds), and the
licenses of the model and of the text used.
"""

from __future__ import annotations

import json
from typing import Any

from compress.eval.reports import runtime_on_device, table_lines
from compress.export.checkpoint.plugin import COMPRESSED_TENSORS  # the format of model/ (compress.artifact.write_model)
from compress.plugins import EXPORT_FORMATS

COMPRESSED_RUNTIME = "compress (`compress gate`, `load_artifact`) on torch"
# model/ of artifacts with a weights_format (compress.artifact.WEIGHTS_FORMAT) is a compressed-tensors checkpoint
PACKED_MODEL = ("compressed-tensors checkpoint (model/)", f"{COMPRESSED_TENSORS.intended_runtimes}; {COMPRESSED_RUNTIME}")
LEGACY_MODEL = ("compress artifact (model/)", COMPRESSED_RUNTIME)
FALLBACK_RECORDS = "fallback-records.safetensors"  # compress.artifact.RECORDS_FILE: records of layers model/ holds as float
_ACCURACY = (("kl_divergence", "KL", ".4f"), ("top1_agreement", "top-1", ".3f"), ("perplexity", "perplexity", ".2f"))
_SPEED = (("decode_tokens_per_s", "decode tok/s", ".1f"), ("ttft_ms", "TTFT ms", ".0f"), ("peak_rss_mb", "peak RSS MiB", ".0f"))


def _cell(value: Any, fmt: str = ".4g") -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) and fmt == ".4g":
        return f"{value:,}"
    if isinstance(value, (int, float)):
        return format(value, fmt)
    return str(value)  # table_lines escapes what Markdown tables cannot hold


def _data_license(source: str | None) -> str:
    from compress.assets import ASSETS

    if source and source.startswith("reference:") and source.split(":", 1)[1] in ASSETS:
        return ASSETS[source.split(":", 1)[1]].license
    return "not recorded (your own text: state its license here)"


def where_measured(entry: dict[str, Any]) -> str:
    """'measured: llama.cpp on cpu' or 'estimated for raspberry-pi-5-8gb (llama.cpp)'."""
    if entry.get("source") == "estimated":
        return f"estimated for {entry.get('device') or '?'} ({entry.get('runtime') or '?'})"
    if entry.get("source") == "missing":
        return "missing (no measurement)"
    return f"measured: {runtime_on_device(entry)}"


def gate_summary(report: dict[str, Any]) -> tuple[str, int, int]:
    """('passed' | 'failed' | 'none', gates passed, gates in all)."""
    gates = report.get("gates") or []
    passed = sum(1 for g in gates if g.get("passed"))
    if not gates:
        return "none", 0, 0
    return ("passed" if passed == len(gates) else "failed"), passed, len(gates)


def _gates(report: dict[str, Any], forced: bool) -> list[str]:
    status, passed, total = gate_summary(report)
    lines = ["## Gates", ""]
    if status == "none":
        return lines + ["The recipe has no gates: nothing was checked before publishing.", ""]
    lines.append(f"{passed} of {total} gates passed.")
    if forced and status == "failed":
        lines.append("**Published with `--force` although a gate failed.**")
    lines.append("")
    rows = []
    for g in report["gates"]:
        threshold = g.get("threshold") or {}
        limit = f"{threshold.get('kind', '?')} {_cell(threshold.get('value'))}"
        if "limit" in threshold and threshold.get("kind", "").startswith("max_"):
            limit += f" (limit {_cell(threshold['limit'])})"
        rows.append(
            [
                _cell(g["name"]),
                _cell(g.get("artifact")),
                _cell(g["metric"]),
                _cell(g.get("value")),
                limit,
                "PASS" if g.get("passed") else "FAIL",
                where_measured(g),
            ]
        )
    return lines + table_lines(["gate", "artifact", "metric", "value", "threshold", "result", "where"], rows)


def _method(manifest: dict[str, Any]) -> list[str]:
    lines = ["## Method", ""]
    stages = manifest.get("stages") or []
    if not stages:
        lines += ["No compression stage: the artifact holds the source model as loaded.", ""]
    for stage in stages:
        method = f" {stage['method']}" if stage.get("method") else ""
        lines += [f"### {stage['label']}: {stage['kind']}{method}", ""]
        what = _what_it_does(stage)
        if what:
            lines += [what, ""]
        lines += [
            "Expanded configuration:",
            "",
            "```json",
            json.dumps(stage.get("config", {}), indent=2, sort_keys=True),
            "```",
            "",
        ]
        summary = stage.get("summary") or {}
        facts = {k: summary[k] for k in ("layers_quantized", "params_quantized", "bits_per_weight", "sqnr_db_mean") if k in summary}
        if facts:
            lines += ["Result: " + ", ".join(f"{k} {_cell(v)}" for k, v in facts.items()) + ".", ""]
    return lines


def _what_it_does(stage: dict[str, Any]) -> str | None:
    """The stage kind's description (and its quantization method's) from the plugin tables; None
    for a kind this installation does not register (a card of an artifact made with a plugin)."""
    from compress.plugins import QUANT_METHODS, STAGE_KINDS

    kind = STAGE_KINDS.get(stage.get("kind", ""))
    if kind is None:
        return None
    method = QUANT_METHODS.get(stage.get("method", "")) if kind.quantizes_weights else None
    text = kind.description + (f" ({method.description})" if method else "")
    return text[:1].upper() + text[1:] + "."


def _artifacts(manifest: dict[str, Any], sizes: dict[str, int]) -> list[str]:
    def folder(prefix: str, *files: str) -> tuple[str, str]:
        inside = [size for path, size in sizes.items() if path.startswith(prefix) or path in files]
        return _cell(sum(inside) / 2**20, ".1f"), str(len(inside))

    packed = bool((manifest.get("quantization") or {}).get("weights_format"))
    rows = [["compressed", *(PACKED_MODEL if packed else LEGACY_MODEL), *folder("model/", FALLBACK_RECORDS), "–"]]
    for x in manifest.get("exports") or []:
        fmt = EXPORT_FORMATS.get(x["format"])  # None: a format this installation does not register
        rows.append(
            [
                x["name"],
                fmt.describe_entry(x) if fmt else x["format"],  # the format says what the export is
                fmt.intended_runtimes if fmt else "–",  # where each format is meant to run
                *folder(f"{x['path']}/"),
                _cell(x.get("verified")),
            ]
        )
    return ["## Artifacts", ""] + table_lines(["name", "format", "intended runtime", "size MiB", "files", "verified on its runtime"], rows)


def _results(report: dict[str, Any]) -> list[str]:
    rows = []
    for ev in report.get("evaluations") or []:
        metrics = ev.get("metrics", {})
        wanted = _ACCURACY if ev.get("kind", "accuracy") == "accuracy" else _SPEED
        shown = [f"{label} {format(metrics[key], fmt)}" for key, label, fmt in wanted if isinstance(metrics.get(key), (int, float))]
        if shown:
            rows.append([_cell(ev["artifact"]), _cell(ev.get("kind", "accuracy")), "; ".join(shown), where_measured(ev)])
    if not rows:
        return []
    return [
        "## Accuracy and speed",
        "",
        "Accuracy is against the source model on held-out text (the evaluation data below).",
        "",
    ] + table_lines(["artifact", "kind", "values", "where"], rows)


def _source(manifest: dict[str, Any]) -> list[str]:
    model = manifest.get("model", {})
    rows = [
        ["source", _cell(model.get("source"))],
        ["SHA-256", f"`{model.get('sha256', 'not recorded')}`"],
        ["architecture", _cell(model.get("architecture"))],
        ["parameters", _cell(model.get("parameters"), ",")],
        ["dtype", _cell(model.get("dtype"))],
        ["license", _cell(model.get("license") or "not recorded")],
    ]
    return ["## Source model", ""] + table_lines(["", ""], rows)


def _data(manifest: dict[str, Any]) -> list[str]:
    data = manifest.get("data") or {}
    rows = []
    for role in ("calibration", "evaluation"):
        entry = data.get(role)
        if entry:
            digest = entry.get("tokens_sha256") or entry.get("documents_sha256") or "not recorded"
            rows.append([role, _cell(entry.get("source")), f"`{digest[:16]}…`", _data_license(entry.get("source"))])
    if not rows:
        return []
    return ["## Data", ""] + table_lines(["role", "source", "SHA-256", "license"], rows)


def model_card(manifest: dict[str, Any], report: dict[str, Any], name: str, sizes: dict[str, int], forced: bool = False) -> str:
    """The card's Markdown; ``sizes`` maps the artifact's files (relative paths) to their bytes."""
    recipe = manifest.get("recipe", {})
    versions = manifest.get("versions", {})
    model = manifest.get("model", {})
    licenses = [f"- Model: {model.get('license') or 'not recorded'} (from {model.get('source', '?')})"]
    for role in ("calibration", "evaluation"):
        entry = (manifest.get("data") or {}).get(role)
        if entry:
            licenses.append(f"- {role.capitalize()} text: {_data_license(entry.get('source'))} (from {entry.get('source')})")
    lines = [
        f"# {name}",
        "",
        f"Made by compress {versions.get('compress', '?')} from the recipe `{(recipe.get('expanded') or {}).get('name') or recipe.get('path', '?')}` "
        f"(recipe SHA-256 `{recipe.get('sha256', '?')}`, seed {manifest.get('seed', '?')}).",
        "",
        *_source(manifest),
        *_method(manifest),
        *_gates(report, forced),
        *_artifacts(manifest, sizes),
        *_results(report),
        *_data(manifest),
        "## Licenses",
        "",
        *licenses,
        "",
        "## Reproduce",
        "",
        "The manifest holds the expanded recipe, every hash and the library versions below; `recipe.yaml` is the file as given.",
        "",
        *table_lines(["library", "version"], [[k, _cell(v)] for k, v in sorted(versions.items())]),
    ]
    return "\n".join(lines).rstrip() + "\n"
