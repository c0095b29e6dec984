"""Step 2: the recipe's stages, applied in order to a copy of the source model."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from compress import streaming
from compress.context import RunContext, SizeBudget, Stage, StageRecord
from compress.distill.train import end_processes
from compress.eval.baseline import RememberedRows
from compress.eval.metrics import HiddenStates
from compress.export.parity import SAME_WEIGHTS_CHUNKS
from compress.fsutil import remove_if_only_marked
from compress.plugins import export_format, quant_method, stage_kind, stage_streams
from compress.quantizers.core import RecordStore
from compress.schema.recipe import Recipe
from compress.steps.load import Run, Source, load_teacher, work_dir_for

if TYPE_CHECKING:
    from compress.plugin_types import QuantMethod


@dataclass
class Staged:
    """The compressed model (the source itself when the recipe has no stages), what each stage did,
    and the context the stages filled: quantized records, KV-cache scheme, files to write."""

    model: torch.nn.Module
    records: list[StageRecord]
    ctx: RunContext
    _forward: RememberedRows | None = field(default=None, repr=False)

    @property
    def changed(self) -> bool:
        return bool(self.records)

    def forward(self, device: torch.device | str) -> RememberedRows:
        """The compressed model's forward on ``device``, one for the whole run: the hidden states of
        the first evaluation rows stay in memory for the exports' same-weights checks."""
        if self._forward is None:
            self._forward = RememberedRows(self.model, torch.device(device), SAME_WEIGHTS_CHUNKS)
        self._forward.device = torch.device(device)
        return self._forward

    def exported_methods(self) -> list[QuantMethod]:
        """The quantization methods whose records the exports hold: those of the quantize stages that
        quantized a layer still in ``ctx.quantized``, in stage order."""
        used = set(self.ctx.quantized_by.values())
        return [
            quant_method(r.method) for i, r in enumerate(self.records) if f"stages[{i}]" in used and stage_kind(r.kind).quantizes_weights
        ]

    def records_forward(self, device: torch.device | str) -> RememberedRows:
        """The forward the exports' same-weights checks compare their runtimes with: the model as the
        exports hold it. That is ``forward`` unless a method used computes more than its records
        carry (LLM.int8's int8 activations): then the model inside each such method's ``records_only``."""
        loaders = [method.load_records_only for method in self.exported_methods() if method.load_records_only is not None]
        if not loaders:
            return self.forward(device)
        contexts = list(dict.fromkeys(load() for load in loaders))
        return RecordsOnlyRows(self.model, torch.device(device), SAME_WEIGHTS_CHUNKS, contexts)


class RecordsOnlyRows(RememberedRows):
    """``RememberedRows`` of the model computing inside ``contexts`` (each ``records_only(model)``),
    its head too."""

    def __init__(self, model: torch.nn.Module, device: torch.device, limit: int, contexts: list[Callable[[Any], Any]]) -> None:
        super().__init__(model, device, limit)
        self.contexts = contexts

    def _inside(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for context in self.contexts:
            stack.enter_context(context(self.model))
        return stack

    def __call__(self, ids: torch.Tensor) -> HiddenStates:
        with self._inside():
            out = super().__call__(ids)
        head = out.head

        def head_inside(hidden: torch.Tensor) -> torch.Tensor:
            with self._inside():
                return head(hidden)

        return HiddenStates(out.hidden, head_inside, out._hold)


def build_stages(recipe: Recipe) -> list[Stage]:
    """One Stage per recipe stage, built by its StageKind (compress.plugins.STAGE_KINDS); a kind
    or quantization method missing from the tables is a CompressError naming the known ones."""
    return [stage_kind(stage.kind, f"stages[{i}]").build(stage.config, f"stages[{i}]") for i, stage in enumerate(recipe.stages)]


def size_budget(recipe: Recipe) -> SizeBudget | None:
    """The export with a size ``target`` and its format, for stages with ``gguf_target: true``; None without one."""
    export = recipe.gguf_budget()
    return None if export is None else SizeBudget(export, export_format(export.format))


def apply(run: Run, source: Source) -> Staged | None:
    """Run the stages. Under ``accelerate launch`` every process runs them up to the last training
    stage (which trains in all of them); a process other than the main one then returns None."""
    recipe = run.recipe
    stages = build_stages(recipe)
    last_trained = max((i for i, st in enumerate(recipe.stages) if stage_kind(st.kind).trains), default=None)
    model = copy.deepcopy(source.baseline) if stages else source.baseline  # a streamed model copies its skeleton only
    store = streaming.store_of(model)
    if stages and store is not None:
        store.root = work_dir_for(run.out_dir) / "overlay"  # what the stages change, next to the artifact
    ctx = RunContext(
        seed=recipe.seed,
        device=run.device,
        tokenizer=source.lm.tokenizer,
        reporter=run.reporter,
        calibration=source.calibration_tokens,
        checks=source.checks,
        text=source.data.text_for(source.lm.tokenizer, run.base_dir, run.reporter),
        original=source.baseline,
        work_dir=work_dir_for(run.out_dir),
        load_teacher=lambda name: load_teacher(run, name),
        source_sha256=source.lm.facts.get("sha256"),
        size_budget=size_budget(recipe),
        run_id=hashlib.sha256(f"{recipe.sha256()}|{source.lm.facts.get('sha256')}".encode()).hexdigest(),
    )
    if store is not None:  # a streamed model's records wait on disk too, not in memory
        ctx.quantized = RecordStore(work_dir_for(run.out_dir) / "records")
    ctx.quantized.update(source.lm.quantized)  # layers of an imported quantized checkpoint are quantized already
    ctx.quantized_by.update(dict.fromkeys(source.lm.quantized, "model.source"))
    records: list[StageRecord] = []
    for i, stage in enumerate(stages):
        if streaming.is_streamed(model) and not stage_streams(recipe.stages[i]):
            with run.reporter.status(f"reading the whole model into memory for stages[{i}] ({recipe.stages[i].kind})"):
                streaming.materialize(model, run.device)
            # ctx.original (the source) stays streamed: a live distillation teacher reads itself into memory
            # (distill/distill.py), a stored one reads one block at a time once (distill/teacher_store.py)
        records.append(stage.apply(model, ctx))
        ctx.applied.append(recipe.stages[i].kind)
        if i == last_trained and run.world > 1:
            end_processes()  # the processes train together up to here; the main one goes on alone
            if run.rank > 0:  # the main process evaluates, exports and writes
                return None
    ctx.teacher = ctx.mapping = None  # a pre-pruning copy is not needed past the stages
    return Staged(model, records, ctx)


def not_carried(staged: Staged) -> list[str]:
    """What no export carries of the quantization methods whose records the exports hold (a
    QuantMethod's ``not_carried``: LLM.int8's activation quantization and decomposition, which no format
    holds; a GGUF's llama.cpp evaluation measures the cost)."""
    notes = [method.not_carried for method in staged.exported_methods() if method.not_carried]
    return list(dict.fromkeys(notes))


SCRATCH = ("overlay", "records", "baseline")
"""Folders of the work directory a run needs only while it runs: the weights the stages changed,
the quantized records, the baseline's cached hidden states."""


def remove_scratch(run: Run) -> None:
    """Delete a run's scratch folders whether it completed or failed (training checkpoints stay, so a
    failed run resumes), then the work directory if nothing else is in it."""
    _remove_work(run, SCRATCH)


def remove_checkpoints(run: Run) -> None:
    """Delete the training checkpoints of a run whose artifact is complete: only the stage folders
    this run writes, then the work directory if nothing else is in it."""
    _remove_work(run, [f"stages[{i}]" for i, st in enumerate(run.recipe.stages) if stage_kind(st.kind).keeps_checkpoints])


def _remove_work(run: Run, names: Iterable[str]) -> None:
    """Delete the named folders of the run's work directory, then the directory if nothing but its
    marker is left (checkpoints stay, so a failed run resumes)."""
    work_dir = work_dir_for(run.out_dir)
    for name in names:
        shutil.rmtree(work_dir / name, ignore_errors=True)
    remove_if_only_marked(work_dir)
