"""The recipe config of the two checkpoint formats (``exports: [{format: compressed-tensors}]``,
``{format: gptq}``): torch-free, validated when the recipe is (compress validate)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from compress.schema.exports import FORMAT_DOC, BaseExportConfig

COMPRESSED_TENSORS = "compressed-tensors"
GPTQ = "gptq"


class CompressedTensorsExportConfig(BaseExportConfig):
    """compressed-tensors pack-quantized HF directory (transformers with compressed-tensors, vLLM); int-quantized
    W8A8 (int8 weights, dynamic per-token int8 activations) for layers a w8a8 stage quantized."""

    holds_activation_quantization: ClassVar[bool] = True

    format: Literal["compressed-tensors"] = Field("compressed-tensors", description=FORMAT_DOC)
    # FP8 layers are written float-quantized (fp8_checkpoint.py), FP4 ones nvfp4/mxfp4-pack-quantized (fp4_checkpoint.py)
    float_refusals: ClassVar[dict[str, str | None]] = {"fp8": None, "nvfp4": None, "mxfp4": None}


class GPTQExportConfig(BaseExportConfig):
    """AutoGPTQ v1 HF directory (GPTQModel, AutoGPTQ, transformers with optimum/gptqmodel, vLLM)."""

    format: Literal["gptq"] = Field("gptq", description=FORMAT_DOC)
