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
EXPORT_FORMATS = (COMPRESSED_TENSORS, GPTQ)
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

    format: Literal["compressed-tensors"] = Field("compressed-tensors", description="compressed-tensors | gptq")


class GPTQExport(_Export):
    """AutoGPTQ v1 HF directory (GPTQModel, AutoGPTQ, transformers with optimum/gptqmodel, vLLM)."""

    format: Literal["gptq"] = Field("gptq", description="compressed-tensors | gptq")


def _known_format(value: Any) -> Any:
    if isinstance(value, dict) and "format" not in value:
        raise ValueError(f"an export names its format: format: {' | '.join(EXPORT_FORMATS)}")
    if isinstance(value, dict) and value["format"] not in EXPORT_FORMATS:
        raise ValueError(
            f"export format '{value['format']}' is not available in this release; available: {', '.join(EXPORT_FORMATS)} "
            "(GGUF, ONNX and TensorRT are planned)"
        )
    return value


ExportSpec = Annotated[
    Union[CompressedTensorsExport, GPTQExport],
    Field(discriminator="format"),
    BeforeValidator(_known_format),
]
