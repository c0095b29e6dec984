"""Small typed objects that pass between the pipeline and its stages (no global state)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

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


class Stage(Protocol):
    """One step of a recipe. ``label`` is its place in the recipe (``stages[0]``) for messages."""

    label: str

    def apply(self, model: nn.Module, ctx: RunContext) -> StageRecord: ...
