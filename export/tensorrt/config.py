"""The TensorRT format's recipe config (``exports: [{format: tensorrt, ...}]``, with its engine's
optimization profile): torch-free, validated when the recipe is (compress validate)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from compress.schema.base import Strict
from compress.schema.exports import FORMAT_DOC, BaseExportConfig

TENSORRT = "tensorrt"
# Axis names of the TensorRT-ready graph's inputs and outputs (what its optimization profiles are keyed by).
BATCH, SEQUENCE, PAST, TOTAL = "batch", "sequence", "past_sequence", "total_sequence"


class DimRange(Strict):
    """Smallest, typical (what TensorRT tunes kernels for) and largest size of one dynamic axis."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min: int = Field(ge=0)
    opt: int = Field(ge=0)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> DimRange:
        if not self.min <= self.opt <= self.max:
            raise ValueError(f"expected min <= opt <= max, got min={self.min} opt={self.opt} max={self.max}")
        return self

    def __add__(self, other: DimRange) -> DimRange:
        return DimRange(min=self.min + other.min, opt=self.opt + other.opt, max=self.max + other.max)


class TensorRTConfig(Strict):
    """`tensorrt:` settings of an engine build."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch: DimRange = Field(DimRange(min=1, opt=1, max=4), description="Sequences per call.")
    sequence: DimRange = Field(
        DimRange(min=1, opt=128, max=1024), description="New tokens per call (prompt length in prefill, 1 when decoding)."
    )
    past: DimRange = Field(DimRange(min=0, opt=256, max=1024), description="Cached tokens before the call (0 in prefill).")
    workspace_mib: int = Field(4096, ge=64, description="Scratch memory TensorRT may use while building and running.")
    timing_cache: Path | None = Field(
        None,
        strict=False,  # a path is written as a string
        description="Kernel timing cache: loaded when the file exists, saved after the build (speeds up rebuilds). "
        "Default: timing.cache next to the engine.",
    )

    @model_validator(mode="after")
    def _sizes(self) -> TensorRTConfig:
        if self.batch.min < 1:
            raise ValueError("batch.min must be at least 1")
        if self.sequence.min < 1:
            raise ValueError("sequence.min must be at least 1 (every call feeds at least one token)")
        return self

    def axis_ranges(self) -> dict[str, DimRange]:
        """Range of every axis name the ONNX graph uses; total_sequence (the mask) is past + sequence."""
        return {BATCH: self.batch, SEQUENCE: self.sequence, PAST: self.past, TOTAL: self.past + self.sequence}


class TensorRTExportConfig(BaseExportConfig):
    """A TensorRT-ready ONNX (standard ops, weights as explicit Q/DQ, explicit past/present KV tensors),
    checked on ONNX Runtime CPU, and a TensorRT engine built from it where TensorRT and a GPU exist."""

    own_runtime: ClassVar[bool] = True
    float_refusals: ClassVar[dict[str, str | None]] = {
        "fp8": "the TensorRT export writes its Q/DQ weights from integer records (its `fp8: true` re-rounds those to FP8 "
        "per row) and does not take an fp8 stage's records and input quantization"
    }

    format: Literal["tensorrt"] = Field("tensorrt", description=FORMAT_DOC)
    dtype: Literal["float16", "float32"] = Field(
        "float16",
        description="Float type of the graph (activations, KV cache, logits, scales); TensorRT's int4 weight-only "
        "path runs with float16 activations.",
    )
    fallback: Literal["symmetric", "int8"] | None = Field(
        None,
        description="For records with no exact Q/DQ form (asymmetric, groups other than 64/128, other bits): symmetric "
        "(re-quantize to int4 blocks of 64/128) or int8 (per-channel); each converted layer is listed in the manifest with "
        "its largest weight change. Default none: such records are an error.",
    )
    fp8: bool = Field(False, description="Write every quantized layer as float8 e4m3fn with per-channel scales.")
    engine: TensorRTConfig = Field(
        default_factory=TensorRTConfig, description="Optimization profile, workspace and timing cache of the engine build."
    )
    check_tokens: int = Field(
        32,
        ge=2,
        description="Tokens of evaluation text the ONNX Runtime CPU check runs (prefill plus "
        "one decode step fed back through the explicit KV tensors).",
    )
    check_max_kl: float = Field(
        1e-3,
        gt=0,
        description="Largest KL (nats/token) allowed between ONNX Runtime CPU on the Q/DQ ONNX "
        "and our in-memory model (float16 graphs round activations).",
    )
