"""Step 5: each of the recipe's exports written from the records read back from model/, and verified
on its own runtime (compress/export/recipe_exports.py asks each export's ExportFormat)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compress import streaming
from compress.eval.baseline import head_read_from_disk
from compress.eval.metrics import Evaluation
from compress.export.parity import VerifyInputs
from compress.export.recipe_exports import check_exports, write_exports
from compress.fsutil import tree_size
from compress.schema.exports import EXPORTS_DIR
from compress.steps.load import Run, Source
from compress.steps.stages import Staged, not_carried


@dataclass
class Exported:
    """The manifest entries of the exports and their evaluations on their runtimes."""

    entries: list[dict[str, Any]] = field(default_factory=list)
    evaluations: list[Evaluation] = field(default_factory=list)


def check(run: Run, source: Source, staged: Staged) -> None:
    """Before evaluation: fail fast on an export that cannot hold the records exactly."""
    check_exports(run.recipe.exports, staged.model, staged.ctx.quantized, source.eval_chunks is not None)


def write(root: Path, run: Run, source: Source, staged: Staged) -> Exported:
    """Write and verify every export under ``root/exports/``; each runtime evaluation carries the
    deployable's size (the KL-against-size plot), and each entry what it does not carry."""
    recipe = run.recipe
    with run.timed("exports_s", record=bool(recipe.exports)):
        streaming.to_device(staged.model, "cpu")
        evaluation = recipe.data.evaluation
        inputs = VerifyInputs(  # the heads read from disk by slices: each runtime holds its own copy of the model
            head_read_from_disk(source.baseline_forward),
            staged.model,
            head_read_from_disk(staged.records_forward("cpu")),
            None if source.eval_chunks is None else source.eval_chunks.tokens,
            evaluation.min_context if evaluation else 1,
            run.threads,
            source.lm.source_path,
        )
        entries, evaluations = write_exports(
            root / EXPORTS_DIR,
            recipe.exports,
            staged.model,
            source.lm.tokenizer,
            staged.ctx.quantized,
            run.reporter,
            inputs,
            staged.ctx.kv_cache,
            _importance(run, staged),
        )
    for ev in evaluations:
        ev.metrics["size_mb"] = tree_size(root / EXPORTS_DIR / ev.artifact) / 2**20
    notes = not_carried(staged)
    if notes:
        for entry in entries:
            entry["not_carried"] = notes
    return Exported(entries, evaluations)


def _importance(run: Run, staged: Staged) -> tuple[dict[str, Any], list[str], int] | None:
    """What the calibration measured of each Linear's inputs, where its text came from and its sequence length."""
    calibration = run.recipe.data.calibration
    if not staged.ctx.input_sums or calibration is None:
        return None
    return staged.ctx.input_sums, [calibration.source], calibration.seq_len
