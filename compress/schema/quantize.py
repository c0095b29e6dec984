"""The recipe's ``quantize:`` stage: the weight scheme and the fields every method's config shares.

Torch-free. Each method's own config (a ``WeightQuantConfig`` subclass with ``method: Literal[name]``)
lives with its code (quantizers/configs.py for the built-in ones) and is named by its QuantMethod in
``compress.plugins.QUANT_METHODS``; the recipe's ``quantize:`` is the union of those configs, chosen by
``method`` (compress.recipe.recipe_model builds it from the table).
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from compress.quantizers.grids import GRID_NAMES, GRIDS, Grid, llama_cpp_spelling, normalize_type
from compress.schema.base import BaseStageConfig, Strict
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
        + ", ".join(GRID_NAMES)
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
        if name not in GRIDS:
            raise ValueError(f"gguf_type '{data['gguf_type']}': expected one of {', '.join(GRID_NAMES)} (any case)")
        grid = GRIDS[name]
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
    def scale_bits(self) -> int:
        """Bits of one stored group scale."""
        return 32 if self.scale_dtype == "float32" else 16

    @property
    def tensor_scale_bits(self) -> int:
        """Bits stored once per weight matrix beside the group scales (fp4's NVFP4 global scale; 0 here)."""
        return 0

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
    def block_grid(self) -> Grid | None:
        """The block-type grid (quantizers/grids.py) the codes lie on, or None (our plain integer grid)."""
        return None if self.gguf_type is None else GRIDS[self.gguf_type]

    def for_width(self, in_features: int) -> QuantScheme:
        """The scheme a row of ``in_features`` weights is quantized with: this one, or, on a GGUF grid
        whose blocks do not divide the row, llama.cpp's fallback type's."""
        grid = self.block_grid
        if grid is None or grid.for_width(in_features) is grid:
            return self
        return QuantScheme(gguf_type=grid.for_width(in_features).name)

    def describe(self) -> str:
        if self.block_grid is not None:
            return f"{llama_cpp_spelling(self.gguf_type)} grid"
        group = "per-channel" if self.group_size is None else f"g{self.group_size}"
        return f"W{self.bits} {group} {'sym' if self.symmetric else 'asym'}"


SENSITIVITY_SAMPLES = 8
"""Calibration chunks the sensitivity pass of ``gguf_target: true`` runs on by default (a GGUF export's
``target.samples``; `compress plan` does not see the export's own value)."""

HEAD = "lm_head"  # the output head's module name in the supported architectures


class WeightQuantConfig(QuantScheme, BaseStageConfig):
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


class FloatGridGPTQFields(Strict):
    """The algorithm keys of a method with a float grid of its own (fp8, fp4): round to nearest, or GPTQ's
    error feedback on that grid with every scale fixed from the original weights first (quantizers/gptq.py's
    column loop, ``grid=``), with GPTQ's settings."""

    algorithm: Literal["rtn", "gptq"] = Field(
        "rtn",
        description="rtn: each weight to its nearest value on the format's grid; gptq: GPTQ (Hessian of each layer's inputs "
        "over data.calibration), each rounding error pushed onto the columns not yet rounded, on the format's grid with "
        "every scale fixed from the original weights first (quantizers/gptq.py's column loop).",
    )
    dampening: float = Field(0.01, gt=0, lt=1, description="gptq: added to the Hessian diagonal, as a share of its mean.")
    block_size: int = Field(128, ge=1, description="gptq: columns updated together (lazy batch updates).")
    act_order: bool = Field(True, description="gptq: visit columns by decreasing Hessian diagonal (the scales stay fixed).")
    backend: ClassVar[str] = "compress"  # GPTQStage's question: the float grids' gptq is ours

    @property
    def uses_gptq(self) -> bool:
        """``algorithm: gptq``: calibrated, layer-wise (quantizers/gptq.py's stage)."""
        return self.algorithm == "gptq"
