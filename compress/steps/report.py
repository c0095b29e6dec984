"""Step 7: the recipe's gates checked against every evaluation, and the report that says so."""

from __future__ import annotations

from typing import Any

from compress.data import Chunks
from compress.eval.gates import GateResult, evaluate_gates
from compress.eval.identity import with_build
from compress.eval.metrics import Evaluation
from compress.export.recipe_exports import gate_evaluations, report_entries
from compress.schema.recipe import Recipe
from compress.schema.report import REPORT_VERSION
from compress.steps.evaluate import InMemory
from compress.steps.exports import Exported


def check_gates(recipe: Recipe, evaluations: list[Evaluation]) -> list[GateResult]:
    """Each gate against the evaluation of the artifact it names (an export without a runtime of its
    own reads the ``compressed`` evaluation: it holds the same records)."""
    return evaluate_gates(recipe.gates, gate_evaluations(evaluations, recipe.exports))


def build_report(
    recipe: Recipe,
    evaluations: list[Evaluation],
    gates: list[GateResult],
    eval_chunks: Chunks | None,
    exported: Exported,
    in_memory: InMemory,
    host: dict[str, Any] | None,
) -> dict[str, Any]:
    """report.json's content (checked against compress.schema.report.Report when written)."""
    report: dict[str, Any] = {
        "schema_version": REPORT_VERSION,
        "recipe": recipe.name,
        "passed": all(g.passed for g in gates),
        "evaluations": [with_build(e).to_json() for e in evaluations],
        "gates": [g.to_json() for g in gates],
        "evaluation_data": None
        if eval_chunks is None
        else {
            "source": eval_chunks.facts["source"],
            "tokens_sha256": eval_chunks.facts["tokens_sha256"],
            "samples": eval_chunks.facts["samples"],
            "seq_len": eval_chunks.facts["seq_len"],
        },
    }
    if host is not None:
        report["host"] = host
    report["exports"] = report_entries(exported.entries, evaluations)
    if in_memory.kv_cache is not None:
        report["kv_cache"] = {**in_memory.kv_cache, "exports": {e["name"]: e.get("kv_cache") for e in exported.entries}}
    return report
