"""The recipe's ``prune:`` stage: which widths and blocks to cut, and the text the importance pass reads.

Torch-free; importance scores, slicing and the stage live in compress/pruning/.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from compress.schema.base import BaseStageConfig, Seed
from compress.schema.base import Strict as _Strict


class SizeTarget(_Strict):
    size: int = Field(ge=1, description="Size to keep (neurons per MLP, query heads, or embedding channels).")


class LayerTarget(_Strict):
    drop: int | None = Field(None, ge=1, description="Blocks to remove.")
    size: int | None = Field(None, ge=1, description="Blocks to keep.")
    metric: Literal["cosine", "kl"] = Field(
        "cosine",
        description="cosine: 1 - cos(block input, output) from the importance pass; "
        "kl: KL of the model with the block skipped (one more forward pass per block).",
    )

    @model_validator(mode="after")
    def _one(self) -> LayerTarget:
        if (self.drop is None) == (self.size is None):
            raise ValueError("give exactly one of drop (blocks to remove) or size (blocks to keep)")
        return self


class PruneData(_Strict):
    source: str | list[str] = Field(
        description="Text of the importance pass (file, directory, glob or reference:<name>), or a list of them sharing the "
        "chunks equally. Kept apart from data.evaluation like calibration text."
    )
    samples: int | None = Field(None, ge=1, description="Chunks; default: data.calibration.samples.")
    seq_len: int | None = Field(None, ge=8, description="Tokens per chunk; default: data.calibration.seq_len.")
    seed: Seed = Field(0, description="Seed for choosing the chunks.")
    text_field: str = Field("text", description="Field holding the text in .jsonl records.")


Share = float
Target = Share | SizeTarget | None


class PruneConfig(BaseStageConfig):
    """`prune: {mlp, heads, hidden, layers, multiple_of, batch_size}`."""

    before_quantization: ClassVar[bool] = True

    mlp: Target = Field(None, description="MLP neurons: share to remove in (0, 1), or {size: N} to keep.")
    heads: Target = Field(
        None, description="Attention heads, whole KV groups at a time: share to remove, or {size: N} query heads to keep."
    )
    hidden: Target = Field(None, description="Embedding channels (the residual stream): share to remove, or {size: N} to keep.")
    layers: LayerTarget | None = Field(None, description="Whole decoder blocks: {drop: N} or {size: N}, and the metric.")
    mlp_method: Literal["activation", "obs"] = Field(
        "activation",
        description="Which MLP neurons go. activation: the lowest mean |gated activation| (Minitron); "
        "obs: structured optimal brain surgeon (ZipLM, SlimGPT), the neurons the kept ones can best stand in for, "
        "with the kept down_proj columns updated by least squares on the calibration text (pruning/obs.py).",
    )
    obs_damp: float = Field(0.01, gt=0, description="mlp_method obs: ridge λ = obs_damp · mean(diag(aᵀa)).")
    data: PruneData | None = Field(
        None,
        description="Other text for the importance pass than data.calibration (obs fits to it: give it text as broad "
        "as what the model must keep doing).",
    )
    multiple_of: int = Field(32, ge=1, description="MLP and hidden sizes are rounded down to a multiple of this (GGUF blocks are 32 wide).")
    batch_size: int = Field(4, ge=1, description="Calibration chunks per forward pass of the importance pass.")

    @model_validator(mode="after")
    def _valid(self) -> PruneConfig:
        for name in ("mlp", "heads", "hidden"):
            value = getattr(self, name)
            if isinstance(value, float) and not 0 < value < 1:
                raise ValueError(f"{name}: a share to remove is between 0 and 1 (exclusive), got {value}; use {{size: N}} for a size")
        if not any(getattr(self, n) is not None for n in ("mlp", "heads", "hidden", "layers")):
            raise ValueError("prune needs at least one of mlp, heads, hidden, layers")
        if self.mlp_method == "obs" and self.mlp is None:
            raise ValueError("mlp_method obs chooses MLP neurons: give an mlp target too")
        return self

    @property
    def needs_calibration(self) -> bool:
        return True
