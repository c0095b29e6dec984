"""The quantization methods' recipe configs (``quantize: {method: rtn | gptq | awq | llm_int8, ...}``),
one model per method beside its module (rtn.py, gptq.py, awq.py, llm_int8.py) and its QuantMethod
(plugin.py). Torch-free, validated when the recipe is (compress validate). The shared scheme and
layer selection (QuantScheme, WeightQuantConfig) are in compress.schema.quantize."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from compress.schema.base import Strict
from compress.schema.quantize import HEAD, WeightQuantConfig


class RTNConfig(WeightQuantConfig):
    """`quantize: {method: rtn, bits, group_size, symmetric, targets, ignore}`."""

    method: Literal["rtn"] = "rtn"

    @property
    def needs_calibration(self) -> bool:
        return self.gguf_target  # the budget's sensitivity pass runs on calibration text


class MoECalibration(Strict):
    """How a mixture-of-experts block's routed experts are calibrated (docs/quantization.md, "Mixture of experts").

    Each expert's matrices are calibrated on the calibration tokens the router sends to it (its top-k
    choices); the routed tokens are counted per block and expert and written to the stage record.
    """

    min_tokens: int = Field(
        64,
        ge=1,
        description="Fewest routed calibration tokens an expert is calibrated on as routed; an expert the router sends "
        "fewer is handled by `under_min`.",
    )
    under_min: Literal["all_tokens", "fail"] = Field(
        "all_tokens",
        description="all_tokens: an expert routed fewer than min_tokens tokens is calibrated on every calibration token "
        "of its block (its output still uses its routed tokens only); fail: the run stops (exit 2) naming those experts "
        "and their counts.",
    )


class ExpertCoverage(Strict):
    """Routed calibration tokens of one MoE block (a quantize stage's ``summary.moe.blocks[i]``)."""

    block: int = Field(ge=0, description="Decoder block index.")
    experts: str = Field(description="The fused experts' module name, e.g. model.layers.0.mlp.experts.")
    tokens: int = Field(ge=0, description="Calibration tokens that entered the block.")
    top_k: int = Field(ge=1, description="Experts each token is routed to.")
    tokens_per_expert: list[int] = Field(description="Routed tokens per expert (index = expert); they sum to tokens x top_k.")
    under_min: list[int] = Field(description="Experts routed fewer than min_tokens tokens.")
    calibrated_on_all_tokens: list[int] = Field(description="Experts calibrated on every token of the block (under_min: all_tokens).")


class CalibratedConfig(WeightQuantConfig):
    """Fields shared by the layer-wise, calibrated methods (GPTQ, AWQ)."""

    batch_size: int = Field(8, ge=1, description="Calibration chunks per forward pass.")
    backend: Literal["compress", "llmcompressor"] = Field(
        "compress",
        description="compress (ours) or llmcompressor (its GPTQModifier, or AWQModifier + QuantizationModifier; "
        "extra `llmcompressor`, see quantizers/llmcompressor_backend.py).",
    )
    moe: MoECalibration = Field(
        default_factory=MoECalibration,
        description="Mixture-of-experts models: the fewest routed tokens an expert is calibrated on, and what happens "
        "below it (ignored by dense models).",
    )

    @property
    def needs_calibration(self) -> bool:
        return True

    @model_validator(mode="after")
    def _backend_keeps_head_float(self) -> CalibratedConfig:
        if (self.gguf_type is not None or self.gguf_target) and self.backend == "llmcompressor":
            key = "gguf_type" if self.gguf_type is not None else "gguf_target"
            raise ValueError(f"{key} needs backend: compress (llmcompressor quantizes on its own integer grids)")
        if self.selects_head and self.backend == "llmcompressor":
            raise ValueError(
                f"backend llmcompressor does not quantize the output head ({HEAD}); keep {HEAD} in `ignore` (the default), "
                f"or use backend: compress, whose gptq calibrates the head on the final norm's output"
            )
        return self


class GPTQConfig(CalibratedConfig):
    """`quantize: {method: gptq, bits, group_size, symmetric, dampening, block_size, act_order, ...}`."""

    method: Literal["gptq"] = "gptq"
    dampening: float = Field(0.01, gt=0, lt=1, description="Added to the Hessian diagonal, as a share of its mean.")
    block_size: int = Field(128, ge=1, description="Columns updated together (lazy batch updates).")
    act_order: bool = Field(
        True,
        description="Visit columns by decreasing Hessian diagonal; group scales come from the original weights (static groups), so groups stay contiguous. false: columns in order, each group's scale from the updated weights when the group starts.",
    )


class AWQConfig(CalibratedConfig):
    """`quantize: {method: awq, bits, group_size, symmetric (default false), grid, duo_scaling, clip, ...}`."""

    method: Literal["awq"] = "awq"
    symmetric: bool = Field(False, description="AWQ defaults to asymmetric (integer zero point per group).")
    grid: int = Field(20, ge=2, description="Points of the scale-exponent grid in [0, 1).")
    duo_scaling: bool | Literal["both"] = Field(
        True,
        description="s = x_mean^α / w_mean^(1-α) (true), x_mean^α (false, the AWQ paper's form), or both families searched (twice the grid).",
    )
    clip: bool = Field(True, description="Search a clipping range per group after scaling.")
    clip_grid: int = Field(20, ge=2, description="Clipping steps: max |w| · (1 - i/clip_grid).")
    max_shrink: float = Field(0.5, gt=0, lt=1, description="Largest share of max |w| the clipping search removes.")
    search_tokens: int = Field(4096, ge=64, description="Calibration tokens (whole sequences, the first ones) the scale search replays.")
    clip_tokens: int = Field(512, ge=16, description="Calibration tokens (sampled) used by the clipping search.")
    clip_in_search: bool = Field(
        True,
        description="Score each scale candidate with its clipping search applied (false: scales searched on unclipped "
        "weights, then clipped, as in AutoAWQ; faster, worse at 3 bits: docs/benchmarks.md).",
    )

    @model_validator(mode="after")
    def _head_stays_float(self) -> AWQConfig:
        if self.gguf_type is not None or self.gguf_target:
            key = "gguf_type" if self.gguf_type is not None else "gguf_target"
            raise ValueError(f"{key} is supported by methods rtn and gptq; awq quantizes on its own integer grid (omit {key})")
        if self.selects_head and self.backend == "compress":  # llmcompressor: refused by CalibratedConfig
            raise ValueError(
                f"awq does not quantize the output head ({HEAD}) yet: its scales would have to fold into the final norm. "
                f"Keep {HEAD} in `ignore` (the default), or quantize the head in a gptq or rtn stage after this one "
                f"(`targets: [{HEAD}]`, `ignore: []`)"
            )
        return self


Kernel = Literal["auto", "torch", "bitsandbytes"]
ResolvedKernel = Literal["torch", "bitsandbytes"]  # what "auto" becomes on a device


class Int8ChannelConfig(WeightQuantConfig):
    """The fixed scheme of the int8 weight-and-activation methods (llm_int8, w8a8): int8 codes in [-127, 127],
    one absmax scale per output row; and the int8 GEMM they compute with."""

    bits: int = Field(8, description="Fixed at 8 (int8 weight codes).")
    group_size: int | None = Field(None, description="Fixed at null (one scale per output row).")
    symmetric: bool = Field(True, description="Fixed at true (absmax scaling, codes in [-127, 127]).")
    batch_size: int = Field(8, ge=1, description="Calibration chunks per forward pass.")
    kernel: Kernel = Field(
        "auto",
        description="The int8 GEMM. auto: bitsandbytes' int8_linear_matmul on CUDA when bitsandbytes is installed, "
        "torch._int_mm otherwise; torch: always torch; bitsandbytes: always bitsandbytes (its CPU kernels off CUDA).",
    )

    @classmethod
    def _name(cls) -> str:
        return cls.model_fields["method"].default

    @field_validator("gguf_type", "gguf_target")
    @classmethod
    def _no_gguf_type(cls, v: str | bool | None, info: ValidationInfo) -> str | bool | None:
        if v:
            raise ValueError(f"{cls._name()} has a fixed int8 scheme; {info.field_name} applies to methods rtn and gptq")
        return v

    @field_validator("bits")
    @classmethod
    def _bits_8(cls, v: int) -> int:
        if v != 8:
            raise ValueError(
                f"{cls._name()} stores weights as int8, so bits must be 8 (got {v}); for fewer bits use method rtn, gptq or awq"
            )
        return v

    @field_validator("group_size")
    @classmethod
    def _per_row(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError(
                f"{cls._name()} uses one scale per output row, so group_size must be null (got {v}); "
                "for grouped int8 use method rtn with bits: 8"
            )
        return v

    @field_validator("symmetric")
    @classmethod
    def _symmetric(cls, v: bool) -> bool:
        if not v:
            raise ValueError(f"{cls._name()} is absmax (symmetric) quantization, so symmetric must be true")
        return v


class LLMInt8Config(Int8ChannelConfig):
    """`quantize: {method: llm_int8, threshold, batch_size, targets, ignore}`; the scheme is fixed."""

    method: Literal["llm_int8"] = "llm_int8"
    threshold: float = Field(
        6.0,
        gt=0,
        allow_inf_nan=True,
        description="llm_int8: input features where any |x| reaches this value are computed in float; "
        "the rest in int8. .inf disables the decomposition (plain int8 weights and activations).",
    )

    @property
    def needs_calibration(self) -> bool:
        """Calibration finds the outlier features whose float columns are kept; with
        ``threshold: .inf`` there are none, so plain W8A8 needs no calibration data."""
        return math.isfinite(self.threshold)


class SmoothingConfig(Strict):
    """SmoothQuant's scale migration (Xiao et al. 2023) before w8a8 quantizes: ``w8a8.smoothing``."""

    alpha: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Migration strength: s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) per input channel j; "
        "0 leaves the activations as they are, 1 moves all of their range into the weights.",
    )


class W8A8Config(Int8ChannelConfig):
    """`quantize: {method: w8a8, smoothing: {alpha} | null, batch_size, kernel, targets, ignore}`; the scheme is fixed."""

    method: Literal["w8a8"] = "w8a8"
    smoothing: SmoothingConfig | None = Field(
        default_factory=SmoothingConfig,
        description="SmoothQuant scale migration from the activations into the weights, calibrated on "
        "data.calibration and folded into the preceding norms (docs/w8a8.md); null: plain W8A8, no calibration.",
    )

    @property
    def needs_calibration(self) -> bool:
        """The smoothing scales come from the calibration inputs' per-channel maxima."""
        return self.smoothing is not None

    def recipe_artifacts(self, label: str, recipe: Any) -> set[str]:
        """Every export must hold the int8 activation quantization, or the file would be another model."""
        for i, export in enumerate(recipe.exports):
            if (why := export.activation_refusal()) is not None:
                raise ValueError(
                    f"exports[{i}] (format {export.format}): {label} (w8a8) quantizes activations to int8 per token at run "
                    f"time, and {why}; export compressed-tensors (int-quantized W8A8) or onnx (precision w8a8), or use "
                    "method llm_int8 / rtn for weight-only int8 exports"
                )
        return set()
