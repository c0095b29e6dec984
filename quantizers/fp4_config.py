"""The recipe config of ``quantize: {method: fp4, format: nvfp4 | mxfp4, ...}`` (quantizers/fp4.py).

Torch-free, validated when the recipe is (compress validate). One method for both formats: they share
the E2M1 value grid, the record type, the Linear module and the algorithms; they differ only in how
each group of weights is scaled, which ``format`` chooses. The format fixes the scheme (4-bit E2M1
values, symmetric, its own group size), so ``bits``, ``group_size`` and ``symmetric`` may only be left
out or given the format's values.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from compress.quantizers.configs import AWQConfig
from compress.schema.quantize import FloatGridGPTQFields, QuantScheme, WeightQuantConfig

Format = Literal["nvfp4", "mxfp4"]
Activations = Literal["dynamic"] | None
GROUP = {"nvfp4": 16, "mxfp4": 32}
"""Weights per scale: NVFP4 scales each 16 weights with a float8 E4M3 scale (and the tensor with one
float32), MXFP4 each 32 with an E8M0 power of two (OCP Microscaling v1.0)."""
SCALE_DTYPE = {"nvfp4": "float8_e4m3fn", "mxfp4": "e8m0"}
"""The group scales' encoding: float8 E4M3 (NVFP4) or an E8M0 biased exponent byte (MXFP4)."""
GLOBAL_SCALE_BITS = {"nvfp4": 32, "mxfp4": 0}
"""NVFP4's one float32 global scale per tensor; MXFP4 has none."""


class FP4Scheme(QuantScheme):
    """The scheme of an fp4 layer as manifests and `compress plan` see it: 4-bit E2M1 codes, one 8-bit scale
    per group (``scale_dtype``: float8_e4m3fn for NVFP4, e8m0 for MXFP4) and NVFP4's float32 per tensor."""

    scale_dtype: Literal["float8_e4m3fn", "e8m0"] = Field(description="The group scales' encoding (8 bits each).")  # type: ignore[assignment]

    @property
    def scale_bits(self) -> int:
        return 8

    @property
    def tensor_scale_bits(self) -> int:
        return 32 if self.scale_dtype == SCALE_DTYPE["nvfp4"] else 0

    @property
    def format(self) -> Format:
        return "nvfp4" if self.tensor_scale_bits else "mxfp4"

    def describe(self) -> str:
        return f"{self.format.upper()} g{self.group_size}"


class FP4Config(WeightQuantConfig, FloatGridGPTQFields):
    """`quantize: {method: fp4, format, activations, algorithm, targets, ignore}`: NVFP4 or MXFP4 weights (W4A16, or
    W4A4 with FP4 inputs), rounded to nearest (rtn), with GPTQ's error feedback on the FP4 grid (gptq; dampening,
    block_size, act_order, batch_size) or after AWQ's activation-aware scales (awq; awq_grid, duo_scaling, search_tokens)."""

    method: Literal["fp4"] = "fp4"
    format: Format = Field(
        "nvfp4",
        description="nvfp4: E2M1 values, one float8 E4M3 scale per 16 weights and one float32 global scale per "
        "tensor (NVIDIA Blackwell's NVFP4, llm-compressor's NVFP4A16); mxfp4: E2M1 values, one E8M0 (power-of-two) "
        "scale per 32 weights (OCP MXFP4, llm-compressor's MXFP4A16).",
    )
    activations: Activations = Field(
        None,
        description="null: float inputs (weight-only, W4A16); dynamic: W4A4, each Linear's input quantized to E2M1 at run "
        "time in groups of the format's size along the input dimension, each group's scale computed from the group "
        "(nvfp4: float8 E4M3 scale per 16 over one float32 global scale per layer, calibrated on data.calibration as "
        "448 * 6 / max|x|, llm-compressor's NVFP4 preset; mxfp4: E8M0 scale per 32, no calibration, its MXFP4 preset).",
    )
    algorithm: Literal["rtn", "gptq", "awq"] = Field(
        "rtn",
        description="rtn: each weight to its nearest E2M1 value; gptq: GPTQ (Hessian of each layer's inputs over "
        "data.calibration), each rounding error pushed onto the columns not yet rounded, on the FP4 grid with every "
        "group's scale fixed from the original weights first (quantizers/gptq.py's column loop); awq: AWQ's per-input-channel "
        "scales searched on data.calibration with FP4 rounding (quantizers/awq.py's search, no clipping), folded into the "
        "preceding norm or Linear, then each weight to its nearest E2M1 value.",
    )
    batch_size: int = Field(8, ge=1, description="gptq, awq, nvfp4 activations: calibration chunks per forward pass.")
    awq_grid: int = Field(
        20, ge=2, description="awq: points of the scale-exponent grid in [0, 1) (method awq's `grid`; `grid` here is the format)."
    )
    duo_scaling: bool | Literal["both"] = Field(
        True, description="awq: s = x_mean^α / w_mean^(1-α) (true), x_mean^α (false), or both families (method awq's)."
    )
    search_tokens: int = Field(4096, ge=64, description="awq: calibration tokens (whole sequences) the scale search replays.")
    calibration_hint: ClassVar[str] = (
        " (algorithm: gptq accumulates each layer's input Hessian, awq searches its scales on it, nvfp4 activations calibrate "
        "each layer's input global scale)"
    )
    bits: int = Field(4, description="Fixed at 4 for fp4 (E2M1 values: 1 sign, 2 exponent, 1 mantissa bit).")
    group_size: int | None = Field(
        None, description="Fixed by the format for fp4 (nvfp4: 16, mxfp4: 32); leave it out or give the format's value."
    )
    symmetric: bool = Field(True, description="Fixed at true for fp4 (absmax scaling; E2M1 has a sign bit).")
    scale_dtype: Literal["float16"] = Field(
        "float16", description="Not used by fp4: the format fixes its scales (nvfp4: float8 E4M3, mxfp4: E8M0); leave it out."
    )

    @field_validator("bits")
    @classmethod
    def _bits_4(cls, v: int) -> int:
        if v != 4:
            raise ValueError(f"fp4 stores 4-bit E2M1 values, so bits is 4 (got {v}); leave bits out, or use rtn/gptq for int{v}")
        return v

    @field_validator("symmetric")
    @classmethod
    def _symmetric(cls, v: bool) -> bool:
        if not v:
            raise ValueError("fp4 is absmax (symmetric) scaling, so symmetric must be true")
        return v

    @model_validator(mode="before")
    @classmethod
    def _format_group(cls, data: Any) -> Any:
        """group_size: the format's own (filled in when left out); no GGUF grid (before QuantScheme reads gguf_type)."""
        if not isinstance(data, dict):
            return data
        for key in ("gguf_type", "gguf_target"):
            if data.get(key):
                raise ValueError(f"fp4 has its own E2M1 grid; {key} applies to methods rtn and gptq (format chooses the FP4 type)")
        if data.get("format", "nvfp4") not in GROUP:
            return data  # a bad format is the format field's error
        fmt = data.get("format", "nvfp4")
        given = data.get("group_size")
        if given is not None and given != GROUP[fmt]:
            other = _format_of(given)
            raise ValueError(
                f"group_size: format {fmt} scales each {GROUP[fmt]} weights (got {given}); leave group_size out"
                + (f" or use format {other}" if other else "")
            )
        return {**data, "group_size": GROUP[fmt]}

    @property
    def needs_calibration(self) -> bool:
        return self.uses_gptq or self.algorithm == "awq" or self.calibrates_inputs

    @property
    def calibrates_inputs(self) -> bool:
        """NVFP4 activations: each layer's float32 input global scale is calibrated (MXFP4's inputs need nothing)."""
        return self.activations is not None and self.format == "nvfp4"

    def awq(self) -> AWQConfig:
        """The AWQConfig of ``algorithm: awq`` (quantizers/awq.py's stage runs it with FP4 rounding): its search settings
        and layers, the format's group, no clipping (AWQ's clipping search rounds on the integer grid)."""
        return AWQConfig(
            bits=4,
            group_size=self.group_size,
            symmetric=True,
            grid=self.awq_grid,
            duo_scaling=self.duo_scaling,
            clip=False,
            clip_in_search=False,
            search_tokens=self.search_tokens,
            batch_size=self.batch_size,
            targets=self.targets,
            ignore=self.ignore,
        )

    def scheme(self) -> FP4Scheme:
        return FP4Scheme(bits=4, group_size=GROUP[self.format], symmetric=True, scale_dtype=SCALE_DTYPE[self.format])

    @property
    def grid(self) -> str:
        """The float grid's name exports are asked about (BaseExportConfig.float_refusal): the format."""
        return self.format

    def describe_scheme(self) -> str:
        inputs = ", FP4 inputs (W4A4)" if self.activations else ""
        return f"{self.format.upper()} weights (E2M1, group {self.group_size}, {self.algorithm}){inputs}"

    def recipe_artifacts(self, label: str, recipe: Any) -> set[str]:
        """Refuses exports that cannot hold this format and other weight-quantizing stages (one scheme family a checkpoint)."""
        for i, export in enumerate(recipe.exports):
            why = export.float_refusal(self.grid)
            if why is not None:
                raise ValueError(
                    f"exports[{i}] ({export.name}): format {export.format} cannot hold the fp4 ({self.format}) stage {label}: {why}; "
                    f"export compressed-tensors ({self.format}-pack-quantized, what vLLM loads)"
                )
            if self.activations is not None and not export.holds_activation_quantization:
                raise ValueError(
                    f"exports[{i}] ({export.name}): format {export.format} cannot hold the FP4 activation quantization of {label} "
                    f"(activations: {self.activations}, W4A4): it would run the FP4 weights on float inputs, another model; "
                    f"export compressed-tensors ({self.format}-pack-quantized with input_activations), or set activations: null"
                )
        others = [
            f"stages[{i}]" for i, st in enumerate(recipe.stages) if isinstance(st.config, WeightQuantConfig) and st.config is not self
        ]
        if others:
            raise ValueError(f"{label}: fp4 quantizes the model's Linear layers in one stage; {others[0]} quantizes weights too")
        return set()


def _format_of(group: int) -> str | None:
    """The format whose group size is ``group``, if any."""
    return next((f for f, g in GROUP.items() if g == group), None)
