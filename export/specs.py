"""The recipe's ``exports:`` items: one spec class per format, discriminated by ``format``.

Kept free of torch so the recipe schema can import it cheaply. The writers and verifiers are
registered in ``registry.py``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

COMPRESSED_TENSORS = "compressed-tensors"
GPTQ = "gptq"
GGUF = "gguf"
EXPORT_FORMATS = (COMPRESSED_TENSORS, GPTQ, GGUF)
EXPORTS_DIR = "exports"
RESERVED_NAMES = ("baseline", "compressed")  # the in-memory artifacts gates already know
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class _Export(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(
        None,
        description="Names the export in reports and gates and its folder exports/<name>/ in the artifact; "
        "defaults to the format; unique within the recipe.",
    )

    @model_validator(mode="after")
    def _default_name(self) -> _Export:
        if self.name is None:
            self.name = getattr(self, "format")
        if not NAME_PATTERN.match(self.name):
            raise ValueError(f"export name '{self.name}' must be letters, digits, '.', '_' or '-' (it names a folder)")
        if self.name in RESERVED_NAMES:
            raise ValueError(f"export name '{self.name}' is reserved for the in-memory artifacts {', '.join(RESERVED_NAMES)}")
        return self


class CompressedTensorsExport(_Export):
    """compressed-tensors pack-quantized HF directory (transformers with compressed-tensors, vLLM)."""

    format: Literal["compressed-tensors"] = Field("compressed-tensors", description="compressed-tensors | gptq | gguf")


class GPTQExport(_Export):
    """AutoGPTQ v1 HF directory (GPTQModel, AutoGPTQ, transformers with optimum/gptqmodel, vLLM)."""

    format: Literal["gptq"] = Field("gptq", description="compressed-tensors | gptq | gguf")


GGUF_FLOAT_TYPES = ("f32", "f16", "bf16")
GGUF_EXACT_TYPES = ("q8_0", "q4_0", "q4_1")  # blocks our records map into exactly
GGUF_RECORD_TYPES = (*GGUF_FLOAT_TYPES, *GGUF_EXACT_TYPES)
# llama.cpp's file types made by its quantizer, by our lower-case names (gguf.LlamaFileType members).
GGUF_LLAMA_CPP_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m",
                        "q5_k_s", "q5_k_m", "q6_k", "iq4_nl", "iq4_xs", "f16", "bf16")
GGUFFloat = Literal["f32", "f16", "bf16", "q8_0"]


class GGUFExport(_Export):
    """A GGUF file for llama.cpp (exports/<name>/model.gguf), verified in llama.cpp."""

    format: Literal["gguf"] = Field("gguf", description="compressed-tensors | gptq | gguf")
    type: str = Field(
        "auto",
        description="Block type. With quantizer records: auto (q4_0 for symmetric 4-bit records, q4_1 for other 4-bit, q8_0 for "
        "8-bit symmetric, f16 without records), q4_0, q4_1, q8_0 (records packed exactly), f32, f16, bf16. With quantizer "
        "llama.cpp: " + ", ".join(GGUF_LLAMA_CPP_TYPES) + " (llama.cpp re-quantizes our F16 file).",
    )
    quantizer: Literal["records", "llama.cpp"] | None = Field(
        None, description="records: pack our records exactly; llama.cpp: llama.cpp's own quantizer from our F16 file. "
        "Default: records for the types it writes, llama.cpp for the others (K-quants …).")
    float_type: GGUFFloat | None = Field(
        None, description="Type of weight matrices without a record (embeddings, output head, layers left unquantized); "
        "default q8_0 for quantized types (as llama.cpp stores SmolLM-sized embeddings), else the type itself. "
        "With quantizer llama.cpp: the token-embedding type passed to its quantizer (default: its own choice).")
    fallback: GGUFFloat | None = Field(
        None, description="Type for records that cannot become the block type exactly (3-bit, group size not a multiple of "
        "32, …); recorded per layer in the manifest. Default none: such records are an error.")
    pre_tokenizer: str = Field("auto", description="llama.cpp pre-tokenizer name; auto recognizes it from tokenizer.json.")
    verify: bool = Field(True, description="Run the file in llama.cpp after writing it: tokenizer parity, metrics against the "
                         "baseline on the evaluation chunks, and the same-weights check (needs the gguf extra).")
    verify_samples: int | None = Field(None, ge=1, description="Evaluation chunks scored in llama.cpp; default all of them.")
    same_weights_max_kl: float = Field(
        0.02, gt=0, description="Largest KL (nats/token) allowed between llama.cpp on this file and our in-memory model with "
        "the same weights; llama.cpp quantizes activations internally, so it is small but not zero. A larger value is a layout bug.")

    @model_validator(mode="after")
    def _check_type(self) -> GGUFExport:
        if self.quantizer is None:
            self.quantizer = "records" if self.type == "auto" or self.type in GGUF_RECORD_TYPES else "llama.cpp"
        allowed = ("auto", *GGUF_RECORD_TYPES) if self.quantizer == "records" else GGUF_LLAMA_CPP_TYPES
        if self.type not in allowed:
            raise ValueError(f"gguf type '{self.type}' with quantizer {self.quantizer}: expected one of {', '.join(allowed)}")
        if self.quantizer == "llama.cpp" and self.fallback is not None:
            raise ValueError("fallback applies to quantizer records; llama.cpp's quantizer chooses its own types")
        return self


def _known_format(value: Any) -> Any:
    if isinstance(value, dict) and "format" not in value:
        raise ValueError(f"an export names its format: format: {' | '.join(EXPORT_FORMATS)}")
    if isinstance(value, dict) and value["format"] not in EXPORT_FORMATS:
        raise ValueError(
            f"export format '{value['format']}' is not available in this release; available: {', '.join(EXPORT_FORMATS)} "
            "(ONNX and TensorRT are planned)"
        )
    return value


ExportSpec = Annotated[
    Union[CompressedTensorsExport, GPTQExport, GGUFExport],
    Field(discriminator="format"),
    BeforeValidator(_known_format),
]
