"""The recipe config of ``quantize: {method: fp8, weights, activations, ...}`` (quantizers/fp8.py).

Torch-free, validated when the recipe is (compress validate). FP8 fixes the scheme: E4M3 weights
(8 bits, symmetric, float32 scales), so ``bits``, ``group_size``, ``symmetric`` and ``scale_dtype``
may only be left out or given their fixed values; ``weights`` and ``activations`` choose the rest.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from compress.schema.quantize import FloatGridGPTQFields, WeightQuantConfig

BLOCK = 128
"""The weight tile of ``weights: block`` (DeepSeek-V3's and vLLM's 128 x 128 blocks), and the activation
group of dynamic activations under block weights (vLLM's per-token-group 128)."""


class FP8Config(WeightQuantConfig, FloatGridGPTQFields):
    """`quantize: {method: fp8, weights, activations, algorithm, batch_size, targets, ignore}`: FP8 E4M3 W8A8 (or W8A16),
    rounded to nearest (rtn) or with GPTQ's error feedback on the E4M3 grid (gptq; dampening, block_size, act_order)."""

    method: Literal["fp8"] = "fp8"
    bits: int = Field(8, description="Fixed at 8 for fp8 (float8 E4M3 weights).")
    group_size: int | None = Field(None, description="Fixed at null for fp8; `weights` chooses per-channel or 128x128 block scales.")
    symmetric: bool = Field(True, description="Fixed at true for fp8 (absmax scaling).")
    scale_dtype: Literal["float32"] = Field("float32", description="Fixed at float32 for fp8 (the scales vLLM loads).")
    weights: Literal["channel", "block"] = Field(
        "channel",
        description="fp8: channel, one float32 scale per output row (absmax/448); block, one per 128x128 tile of the "
        "weight (DeepSeek-V3 / vLLM block layout; the last tiles of a side not a multiple of 128 are smaller).",
    )
    activations: Literal["dynamic", "static"] | None = Field(
        "dynamic",
        description="fp8 inputs of each Linear: dynamic, scaled at run time per token (absmax/448; under block weights "
        "per token and group of 128 inputs, as vLLM's block kernel); static, one float32 scale per layer calibrated as "
        "the largest absmax/448 over data.calibration; null, float inputs (weight-only FP8).",
    )
    batch_size: int = Field(8, ge=1, description="Calibration chunks per forward pass (activations: static; algorithm: gptq).")

    @field_validator("bits")
    @classmethod
    def _bits_8(cls, v: int) -> int:
        if v != 8:
            raise ValueError(f"fp8 stores float8 E4M3 weights, so bits is 8 (got {v}); leave bits out, or use rtn/gptq for int{v}")
        return v

    @field_validator("group_size")
    @classmethod
    def _no_group(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError(f"fp8 takes no group_size (got {v}); choose `weights: channel` or `weights: block` (128x128 tiles)")
        return v

    @field_validator("symmetric")
    @classmethod
    def _symmetric(cls, v: bool) -> bool:
        if not v:
            raise ValueError("fp8 is absmax (symmetric) scaling, so symmetric must be true")
        return v

    @field_validator("gguf_type", "gguf_target")
    @classmethod
    def _no_gguf(cls, v: str | bool | None, info: ValidationInfo) -> str | bool | None:
        if v:
            raise ValueError(f"fp8 has its own E4M3 grid; {info.field_name} applies to methods rtn and gptq (llama.cpp has no FP8 type)")
        return v

    @model_validator(mode="after")
    def _block_is_dynamic(self) -> FP8Config:
        if self.weights == "block" and self.activations == "static":
            raise ValueError(
                "weights: block goes with activations: dynamic (per token and group of 128, as vLLM's block FP8 kernel) "
                "or null; static activation scales are for weights: channel"
            )
        return self

    @property
    def needs_calibration(self) -> bool:
        return self.activations == "static" or self.uses_gptq

    calibration_hint: ClassVar[str] = (
        " (activations: static calibrates one input scale per layer; algorithm: gptq accumulates each layer's input Hessian)"
    )

    def describe_scheme(self) -> str:
        acts = {"dynamic": "dynamic", "static": "static", None: "float"}[self.activations]
        return f"FP8 E4M3 {self.weights} weights{' (gptq)' if self.uses_gptq else ''}, {acts} activations"

    def recipe_artifacts(self, label: str, recipe: Any) -> set[str]:
        """Refuses exports that cannot hold FP8 and other weight-quantizing stages (one scheme family a checkpoint)."""
        for i, export in enumerate(recipe.exports):
            if (why := export.float_refusal("fp8")) is not None:
                raise ValueError(
                    f"exports[{i}] ({export.name}): format {export.format} cannot hold the fp8 stage {label}: {why}; "
                    "export compressed-tensors (float-quantized, what vLLM loads)"
                )
        others = [
            f"stages[{i}]" for i, st in enumerate(recipe.stages) if isinstance(st.config, WeightQuantConfig) and st.config is not self
        ]
        if others:
            raise ValueError(f"{label}: fp8 quantizes the model's Linear layers in one stage; {others[0]} quantizes weights too")
        return set()
