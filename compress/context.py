"""Small typed objects that pass between the pipeline and its stages (no global state)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from compress.calibration_checks import CalibrationChecker
    from compress.distill.draft import Draft
    from compress.export.format import ExportFormat
    from compress.progress import Reporter
    from compress.quantizers.core import QuantizedWeight
    from compress.quantizers.kv_cache import KVCacheScheme


@dataclass
class StageRecord:
    """What a stage did, for the manifest: expanded config, timing, and a summary."""

    kind: str
    method: str
    config: dict[str, Any]
    duration_s: float
    summary: dict[str, Any] = field(default_factory=dict)
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "method": self.method,
            "config": self.config,
            "duration_s": round(self.duration_s, 3),
            "summary": self.summary,
            "layers": self.layers,
        }


@dataclass(frozen=True)
class SizeBudget:
    """An export's size ``target`` for quantize stages with ``gguf_target: true`` to choose each
    layer's grid under (quantizers/mix.py): the export's recipe config (its ``target`` and
    ``float_type``) and its format, which says what a file of it holds (``ExportFormat.file_layout``)."""

    export: Any
    format: ExportFormat


@dataclass
class RunContext:
    """What a stage may use. Stages read inputs from here and add their outputs here."""

    seed: int
    device: torch.device
    tokenizer: Any
    reporter: Reporter
    calibration: Callable[[], torch.Tensor]
    """Returns calibration token chunks [samples, seq_len]; built on first call. Raises when the
    recipe has no `data.calibration` section."""
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)
    """Quantized Linear weights by module name; exporters pack these without re-quantizing."""
    quantized_by: dict[str, str] = field(default_factory=dict)
    """Which stage (e.g. ``stages[0]``) quantized each module."""
    kv_cache: KVCacheScheme | None = None
    """The KV-cache scheme a ``kv_cache`` stage set (evaluation decodes through it; exporters record it)."""
    draft: Draft | None = None
    """The draft model a ``draft`` stage made (compress/steps/draft.py writes and measures it)."""
    text: Callable[[str, int, int, str | list[str] | None, int | None, str | None], torch.Tensor] | None = None
    """``text(role, samples, seq_len, source, seed, text_field)``: token chunks of the calibration
    ("calibration", optionally from other ``source``s, still kept apart from the evaluation
    text) or evaluation role at a size a stage chooses (distillation's training and monitoring text)."""
    original: nn.Module | None = None
    """The model as loaded (the pipeline's baseline; read-only for stages)."""
    applied: list[str] = field(default_factory=list)
    """Kinds of the stages applied so far, in order."""
    teacher: nn.Module | None = None
    """The model before the prune stage changed it, for a later distill stage."""
    mapping: Any = None
    """What a prune stage kept (``compress.pruning.prune.KeptIndices``): student -> teacher layers and channels."""
    input_sums: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)
    """What a calibrated quantizer saw of each Linear's input, by module name: the sum over the
    calibration tokens of each input column's square (float32 [in]) and the number of tokens; the
    GGUF export writes it as llama.cpp's importance matrix (export/gguf/imatrix.py)."""
    size_budget: SizeBudget | None = None
    """The export with a size ``target`` and its format, for a quantize stage with ``gguf_target: true``
    to choose each layer's grid under (quantizers/mix.py)."""
    files: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Tensors a stage leaves in the artifact: relative safetensors path -> tensors (e.g. importance scores)."""
    work_dir: Path | None = None
    """Where a stage keeps resumable state (training checkpoints) across a killed run; removed when the artifact is written."""
    run_id: str = ""
    """Identifies the run's inputs (recipe and model); a checkpoint of another run is refused."""
    source_sha256: str | None = None
    """The SHA-256 of the source model's files (keys what a stage stores about the source across runs)."""
    load_teacher: Callable[[str], nn.Module] | None = None
    """Loads another model by a model.source-style string (a named distillation teacher)."""
    checks: CalibrationChecker | None = None
    sensitivity: dict[str, Any] | None = None
    """Per-layer sensitivities measured for a GGUF size budget (quantizers/mix.py), kept by a caller that
    quantizes copies of one model on the same text under several budgets (``compress bench gguf``) so
    the measurement runs once; None: measured by every stage that needs it."""
    """The recipe's calibration sanity checks, which the calibrated quantizers run as they go (None: none run)."""

    def frozen_copy(self, model: nn.Module) -> nn.Module:
        """``model`` as it is now, kept from later changes: the loaded model itself when no stage
        has changed it yet (no copy), else a frozen copy."""
        if self.original is not None and not self.applied:
            return self.original
        return copy.deepcopy(model).eval().requires_grad_(False)

    def keep_teacher(self, model: nn.Module) -> None:
        """Remember ``model`` as it is now as the teacher of a later distill stage."""
        self.teacher = self.frozen_copy(model)


class Stage(Protocol):
    """One step of a recipe. ``label`` is its place in the recipe (``stages[0]``) for messages."""

    label: str

    def apply(self, model: nn.Module, ctx: RunContext) -> StageRecord: ...
