"""Recipe search: a ``search:`` block lists values for recipe keys; every combination is a
candidate recipe, run as a full artifact (stages, exports verified on their runtimes, gates),
smallest expected artifact first. The smallest *measured* artifact that passes every gate is
chosen; ``stop_at_first_pass`` ends the search at the first passing candidate (the smallest by the
estimate, since candidates run in that order).

Layout of the output directory::

    .compress-output          the marker that makes it ours (compress/marker.py: kind ``search``), written first
    candidates/<NN>-<name>/   one complete artifact per candidate run (reused when a search resumes)
    report.json               the chosen candidate's gates, and ``search``: every candidate
    summary.md, junit.xml, plots/pareto.png

Run again without ``--overwrite`` into a search of ours, it resumes; with it, starts afresh. Any
other existing directory is refused (compress/fsutil.py's rule), and a candidate folder is replaced
only when it is an artifact of ours.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compress.errors import EXIT_GATE_FAILED, EXIT_OK, ArtifactError, CompressError, RecipeError
from compress.fsutil import claim_directory
from compress.marker import SEARCH
from compress.plugins import QUANT_METHODS, quant_method, stage_kind
from compress.progress import Reporter
from compress.recipe import LoadedRecipe, apply_override, parse_yaml, validate
from compress.schema.recipe import Recipe


@dataclass
class Candidate:
    name: str
    overrides: list[str]
    recipe: Recipe
    bits_per_weight: float


def expand(loaded: LoadedRecipe) -> list[Candidate]:
    """Every combination of the search values as a validated recipe, smallest expected size first."""
    search = loaded.recipe.search
    if search is None:
        raise CompressError(f"{loaded.path}: no search block")
    data, lines = parse_yaml(loaded.text, str(loaded.path))
    data.pop("search")
    for item in loaded.overrides:
        apply_override(data, item, lines)
    keys = list(search.variants)
    candidates = []
    for values in itertools.product(*(search.variants[k] for k in keys)):
        overrides = [f"{k}={json.dumps(v)}" for k, v in zip(keys, values, strict=True)]
        variant = copy.deepcopy(data)
        for item in overrides:
            apply_override(variant, item, dict(lines))
        try:
            recipe = validate(variant, lines, f"{loaded.path} with {' '.join(overrides)}")
        except RecipeError as exc:
            raise CompressError(f"search candidate {' '.join(overrides)} is not a valid recipe:\n{exc}") from None
        name = "_".join(f"{k.split('.')[-1]}-{v}" for k, v in zip(keys, values, strict=True))
        candidates.append(Candidate(re.sub(r"[^A-Za-z0-9._-]+", "", name), overrides, recipe, bits_per_weight(recipe)))
    candidates.sort(key=lambda c: (c.bits_per_weight, _cost(c.recipe)))
    return candidates


def bits_per_weight(recipe: Recipe) -> float:
    """Expected stored bits per weight of the quantized layers: bits plus the group's scale (and
    zero point) amortised; 16 without a quantize stage."""
    for stage in recipe.stages:
        if stage_kind(stage.kind).quantizes_weights:
            cfg = stage.config
            group = getattr(cfg, "group_size", None)
            extra = 0.0 if not group else (16 if getattr(cfg, "symmetric", True) else 16 + getattr(cfg, "bits", 8)) / group
            return getattr(cfg, "bits", 8) + extra
    return 16.0


def _cost(recipe: Recipe) -> int:
    """Run cheaper methods first among candidates of equal expected size (each QuantMethod's ``cost``)."""
    return sum(quant_method(st.config.method).cost for st in recipe.stages if stage_kind(st.kind).quantizes_weights)


def artifact_size(directory: Path, recipe: Recipe) -> int:
    """The deployable's size: the first export's files (a runtime file or a packed checkpoint).
    Without exports, an estimate from the bits: each quantized layer at its bits per weight with
    scales and zero points (the manifest's stage records), the float tensors as stored (model/ of an
    artifact before the packed layout kept one byte per code; the estimate ranks both alike)."""
    from compress.eval.latency import float_entries
    from compress.fsutil import tree_size
    from compress.inputs import SAFETENSORS_ITEMSIZE

    if recipe.exports:
        return tree_size(directory / "exports" / recipe.exports[0].name)

    manifest = json.loads((directory / "manifest.json").read_text())
    layers = {name: info for stage in manifest["stages"] for name, info in (stage.get("layers") or {}).items() if "bits_per_weight" in info}
    total = sum(info["shape"][0] * info["shape"][1] * info["bits_per_weight"] / 8 for info in layers.values())
    total += sum(numel * SAFETENSORS_ITEMSIZE.get(dtype, 4) for _, numel, dtype in float_entries(directory))
    return int(total)


@dataclass
class SearchResult:
    out_dir: Path
    report: dict[str, Any]

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.report["search"]["chosen"] is not None else EXIT_GATE_FAILED


def run_search(loaded: LoadedRecipe, out_dir: Path, overwrite: bool, reporter: Reporter) -> SearchResult:
    from compress.documents import json_safe, write_document
    from compress.eval.reports import write_reports
    from compress.pipeline import run_recipe
    from compress.schema.report import REPORT_VERSION, Report

    search = loaded.recipe.search
    assert search is not None
    candidates = expand(loaded)
    out_dir = Path(out_dir)
    claim_directory(out_dir, SEARCH, overwrite, resume=True)  # a search of ours resumes; anything else as any output
    (out_dir / "candidates").mkdir(exist_ok=True)
    rows: list[dict[str, Any]] = []
    reports: dict[str, dict[str, Any]] = {}
    for i, cand in enumerate(candidates):
        directory = out_dir / "candidates" / f"{i:02d}-{cand.name}"
        row: dict[str, Any] = {
            "name": cand.name,
            "overrides": cand.overrides,
            "path": str(directory.relative_to(out_dir)),
            "expected_bits_per_weight": round(cand.bits_per_weight, 4),
            "source": "measured",
        }
        if _same_run(directory, cand.recipe):
            report = json.loads((directory / "report.json").read_text())
            row["status"] = "reused"
        else:
            reporter.console.print(f"[bold]search candidate {i + 1}/{len(candidates)}[/]: {' '.join(cand.overrides)}")
            one = LoadedRecipe(recipe=cand.recipe, path=loaded.path, text=loaded.text, overrides=loaded.overrides + cand.overrides)
            try:
                # a candidate of another recipe (or of this one before an edit) is replaced only when it is ours
                report = run_recipe(one, directory, overwrite=True, reporter=reporter, step_summary=False).report
            except CompressError as exc:  # e.g. an export that cannot hold this scheme: the candidate fails, the search goes on
                rows.append({**row, "status": f"error: {exc}", "passed": False, "size_mb": None, "metrics": {}})
                continue
            row["status"] = "run"
        reports[row["path"]] = report
        accuracy = [e for e in report["evaluations"] if e.get("kind", "accuracy") == "accuracy" and e["artifact"] != "baseline"]
        first = recipe_primary(cand.recipe)
        chosen_ev = next((e for e in accuracy if e["artifact"] == first), None) or next((e for e in accuracy), None)
        row.update(
            passed=report["passed"],
            size_mb=artifact_size(directory, cand.recipe) / 2**20,
            metrics={k: v for k, v in (chosen_ev or {}).get("metrics", {}).items() if k != "tokens_scored"},
            gates_failed=[g["name"] for g in report["gates"] if not g["passed"]],
        )
        rows.append(row)
        if search.stop_at_first_pass and report["passed"]:
            break
    for cand in candidates[len(rows) :]:
        rows.append(
            {
                "name": cand.name,
                "overrides": cand.overrides,
                "status": "not run (stopped at the first passing candidate)",
                "passed": None,
                "size_mb": None,
                "expected_bits_per_weight": round(cand.bits_per_weight, 4),
            }
        )
    passing = [r for r in rows if r.get("passed")]
    chosen = min(passing, key=lambda r: r["size_mb"]) if passing else None
    base = reports[chosen["path"]] if chosen else {"evaluations": [], "gates": [], "evaluation_data": None}
    report = {
        "schema_version": REPORT_VERSION,
        "recipe": loaded.recipe.name,
        "passed": chosen is not None,
        "evaluations": base["evaluations"],
        "gates": base["gates"],
        "evaluation_data": base.get("evaluation_data"),
        "search": {
            "candidates": rows,
            "chosen": chosen["name"] if chosen else None,
            "chosen_path": chosen["path"] if chosen else None,
            "stop_at_first_pass": search.stop_at_first_pass,
            "order": f"expected bits per weight, then method cost ({', '.join(sorted(QUANT_METHODS, key=lambda m: QUANT_METHODS[m].cost))})",
            "size": "the first export's files, else model/'s weights as a packed checkpoint stores them, MiB",
        },
    }
    write_document(out_dir / "report.json", report, Report)
    write_reports(out_dir, json_safe(report), suite=f"search {loaded.recipe.name or loaded.path.stem}")
    return SearchResult(out_dir, report)


def _same_run(directory: Path, recipe: Recipe) -> bool:
    """A finished candidate of exactly this recipe: it verifies, and the validated recipe's hash matches."""
    from compress.verify import check_artifact

    try:
        record = check_artifact(directory).manifest.get("recipe")
    except ArtifactError:
        return False
    return isinstance(record, dict) and record.get("sha256") == recipe.sha256()


def recipe_primary(recipe: Recipe) -> str:
    return recipe.exports[0].name if recipe.exports else "compressed"
