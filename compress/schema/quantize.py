"""The recipe's ``quantize:`` stage: the weight scheme and one config model per method.

Torch-free: the math, the records and the stages live in compress/quantizers/ (one module per
method), which import these models from here. ``QUANTIZE_CONFIGS`` maps a built-in method name to its
config; the plugin table (name -> MethodSpec: config, stage, plan estimate, ...) is
``compress.plugins.QUANT_METHODS``, which recipe validation reads (see StageSpec in recipe.py).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from compress.schema.base import StageConfig, Strict
from compress.schema.gguf_types import GGUF_GRID_TYPES, GGUF_GRIDS, GGUFGrid, llama_cpp_spelling, normalize_type
from compress.schema.patterns import check_pattern, matches

ScaleDType = Literal["float16", "bfloat16", "float32"]


class QuantScheme(Strict):
    """How one weight matrix is quantized. Frozen, hashable, and written in full to manifests."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bits: int = Field(ge=2, le=8, description="Bits per weight code (2-8).")
    group_size: int | None = Field(
        default=128,
        description="Input features per scale group; null means per-channel (one group per row).",
    )
    symmetric: bool = Field(
        default=True,
        description="Symmetric: fixed zero point 2**(bits-1). Asymmetric: one integer zero point per group.",
    )
    scale_dtype: ScaleDType = Field(default="float16", description="Precision the scales are rounded to and stored in.")
    gguf_type: str | None = Field(
        default=None,
        description="Quantize on llama.cpp's own grid of this GGUF block type ("
        + ", ".join(GGUF_GRID_TYPES)
        + "; llama.cpp's spellings such as Q4_K accepted): its block or sub-block groups, fp16 minimum (q4_1, q5_1) "
        "and, for K-quants, the quantized sub-block scales under fp16 super-block scales, exactly as the GGUF export "
        "stores them. Fixes bits, group_size, symmetric and scale_dtype (leave them out). Rows whose width is not a "
        "multiple of 256 use llama.cpp's fallback type (q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0; q2_k, q3_k -> q4_0).",
    )

    @model_validator(mode="before")
    @classmethod
    def _fill_from_gguf_type(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("gguf_target") is True and data.get("gguf_type") is None:
            given = [k for k in ("bits", "group_size", "symmetric", "scale_dtype") if k in data]
            if given:
                raise ValueError(f"gguf_target: true gives each layer a GGUF type's scheme; remove {', '.join(given)}")
            return {**data, "bits": 4}  # unused: every layer's scheme is its chosen type's (WeightQuantConfig.summary_scheme)
        if not isinstance(data, dict) or data.get("gguf_type") is None:
            return data
        name = normalize_type(data["gguf_type"])
        if name not in GGUF_GRIDS:
            raise ValueError(f"gguf_type '{data['gguf_type']}': expected one of {', '.join(GGUF_GRID_TYPES)} (any case)")
        grid = GGUF_GRIDS[name]
        fixed = {"bits": grid.bits, "group_size": grid.group, "symmetric": grid.symmetric, "scale_dtype": grid.scale_dtype}
        for key, value in fixed.items():
            if key in data and data[key] != value:
                raise ValueError(
                    f"gguf_type {llama_cpp_spelling(name)} fixes {key} to {value} (got {data[key]}); remove {key} from the recipe"
                )
        return {**data, **fixed, "gguf_type": name}

    @field_validator("group_size")
    @classmethod
    def _positive_group(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("group_size must be a positive integer, or null for per-channel")
        return v

    @property
    def qmax(self) -> int:
        return 2**self.bits - 1

    @property
    def symmetric_zero(self) -> int:
        return 2 ** (self.bits - 1)

    def group_width(self, in_features: int) -> int:
        return in_features if self.group_size is None else self.group_size

    def n_groups(self, in_features: int) -> int:
        return math.ceil(in_features / self.group_width(in_features))

    @property
    def gguf_grid(self) -> GGUFGrid | None:
        """The llama.cpp block type whose grid the codes lie on, or None (our plain integer grid)."""
        return None if self.gguf_type is None else GGUF_GRIDS[self.gguf_type]

    def for_width(self, in_features: int) -> QuantScheme:
        """The scheme a row of ``in_features`` weights is quantized with: this one, or, on a GGUF grid
        whose blocks do not divide the row, llama.cpp's fallback type's."""
        grid = self.gguf_grid
        if grid is None or grid.for_width(in_features) is grid:
            return self
        return QuantScheme(gguf_type=grid.for_width(in_features).name)

    def describe(self) -> str:
        if self.gguf_grid is not None:
            return f"{llama_cpp_spelling(self.gguf_type)} grid"
        group = "per-channel" if self.group_size is None else f"g{self.group_size}"
        return f"W{self.bits} {group} {'sym' if self.symmetric else 'asym'}"


HEAD = "lm_head"  # the output head's module name in the supported architectures


class WeightQuantConfig(QuantScheme, StageConfig):
    """Fields every weight-quantization method takes: the scheme plus which Linear layers to touch.

    Patterns are matched against module names (``model.layers.0.mlp.down_proj``): a glob that
    matches the whole name or its trailing components (``down_proj``, ``mlp.*``), or a regular
    expression with the prefix ``re:`` that must match the whole name.
    """

    targets: list[str] = Field(default_factory=lambda: ["*"], description="Linear layers to quantize.")
    ignore: list[str] = Field(
        default_factory=lambda: [HEAD],
        description="Linear layers to leave in float. The default keeps the output head (lm_head) float; "
        "`ignore: []` quantizes it too (rtn, gptq; a head tied to the embeddings is untied, the embedding table stays float).",
    )

    @field_validator("targets", "ignore")
    @classmethod
    def _patterns_run_in_bounded_time(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            if (problem := check_pattern(pattern)) is not None:
                raise ValueError(problem)
        return patterns

    gguf_target: bool = Field(
        False,
        description="Quantize each layer on the GGUF block type that the recipe's GGUF export's `target:` (a size "
        "budget) chooses for it from measured sensitivity (rtn, gptq; leave gguf_type out). The choice is in the "
        "stage's summary (`gguf_mix`).",
    )

    @model_validator(mode="after")
    def _target_or_type(self) -> WeightQuantConfig:
        if self.gguf_target and self.gguf_type is not None:
            raise ValueError("gguf_target: true chooses a gguf_type per layer; remove gguf_type")
        return self

    def scheme(self) -> QuantScheme:
        return QuantScheme(**{k: getattr(self, k) for k in QuantScheme.model_fields})

    def describe_scheme(self) -> str:
        """The scheme for progress lines: the stage's own, or a budget's per-layer GGUF types."""
        return "GGUF types per layer under the export's target" if self.gguf_target else self.scheme().describe()

    def summary_scheme(self) -> QuantScheme | None:
        """The scheme every layer shares (for the stage's summary), or None with ``gguf_target`` (each layer's is in its record)."""
        return None if self.gguf_target else self.scheme()

    @property
    def selects_head(self) -> bool:
        """The patterns select a layer named ``lm_head`` (the output head of the supported architectures)."""
        return any(matches(HEAD, p) for p in self.targets) and not any(matches(HEAD, p) for p in self.ignore)


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


class LLMInt8Config(WeightQuantConfig):
    """`quantize: {method: llm_int8, threshold, batch_size, targets, ignore}`; the scheme is fixed."""

    method: Literal["llm_int8"] = "llm_int8"
    bits: int = Field(8, description="Fixed at 8 for llm_int8 (int8 weight codes).")
    group_size: int | None = Field(None, description="Fixed at null for llm_int8 (one scale per output row).")
    symmetric: bool = Field(True, description="Fixed at true for llm_int8 (absmax scaling, codes in [-127, 127]).")
    threshold: float = Field(
        6.0,
        gt=0,
        allow_inf_nan=True,
        description="llm_int8: input features where any |x| reaches this value are computed in float; "
        "the rest in int8. .inf disables the decomposition (plain int8 weights and activations).",
    )
    batch_size: int = Field(8, ge=1, description="Calibration chunks per forward pass.")
    kernel: Kernel = Field(
        "auto",
        description="The int8 GEMM. auto: bitsandbytes' int8_linear_matmul on CUDA when bitsandbytes is installed, "
        "torch._int_mm otherwise; torch: always torch; bitsandbytes: always bitsandbytes (its CPU kernels off CUDA).",
    )

    @field_validator("gguf_type", "gguf_target")
    @classmethod
    def _no_gguf_type(cls, v: str | bool | None, info: ValidationInfo) -> str | bool | None:
        if v:
            raise ValueError(f"llm_int8 has a fixed int8 scheme; {info.field_name} applies to methods rtn and gptq")
        return v

    @field_validator("bits")
    @classmethod
    def _bits_8(cls, v: int) -> int:
        if v != 8:
            raise ValueError(f"llm_int8 stores weights as int8, so bits must be 8 (got {v}); for fewer bits use method rtn, gptq or awq")
        return v

    @field_validator("group_size")
    @classmethod
    def _per_row(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError(
                f"llm_int8 uses one scale per output row, so group_size must be null (got {v}); "
                "for grouped int8 use method rtn with bits: 8"
            )
        return v

    @field_validator("symmetric")
    @classmethod
    def _symmetric(cls, v: bool) -> bool:
        if not v:
            raise ValueError("llm_int8 is absmax (symmetric) quantization, so symmetric must be true")
        return v

    @property
    def needs_calibration(self) -> bool:
        """Calibration finds the outlier features whose float columns are kept; with
        ``threshold: .inf`` there are none, so plain W8A8 needs no calibration data."""
        return math.isfinite(self.threshold)


QUANTIZE_CONFIGS: dict[str, type[WeightQuantConfig]] = {
    "rtn": RTNConfig,
    "gptq": GPTQConfig,
    "awq": AWQConfig,
    "llm_int8": LLMInt8Config,
}
"""Built-in method name -> config model (the full specs are in compress.plugins.QUANT_METHODS)."""

# The recipe's `quantize:` value, chosen by its `method`.
QuantizeConfig = Annotated[RTNConfig | GPTQConfig | AWQConfig | LLMInt8Config, Field(discriminator="method")]
