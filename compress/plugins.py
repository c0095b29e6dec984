"""The plugin tables: what the recipe's names mean, as explicit dicts of spec objects.

This module holds the three plugin tables of the design (docs/architecture.md): quantization
methods, stage kinds and export formats. Each maps a recipe name to a spec object that answers
every per-kind question; code asks the spec and never branches on the name. Importing this
module stays cheap: specs import their implementations inside their methods (no torch here).
"""

from __future__ import annotations

from compress.export.checkpoint.spec import COMPRESSED_TENSORS, GPTQ
from compress.export.format import ExportFormat
from compress.export.gguf.spec import GGUF
from compress.export.onnx.spec import ONNX
from compress.export.tensorrt.spec import TENSORRT

# --------------------------------------------------------------------------- export formats

EXPORT_FORMATS: dict[str, ExportFormat] = {
    COMPRESSED_TENSORS.name: COMPRESSED_TENSORS,
    GPTQ.name: GPTQ,
    GGUF.name: GGUF,
    ONNX.name: ONNX,
    TENSORRT.name: TENSORRT,
}
"""Export formats by the recipe's ``exports[].format`` key (one package each under export/)."""


def export_format(name: str) -> ExportFormat:
    """The spec of an export format; a KeyError-free message when the name is unknown."""
    from compress.errors import CompressError

    try:
        return EXPORT_FORMATS[name]
    except KeyError:
        raise CompressError(f"export format '{name}' is not available; available: {', '.join(EXPORT_FORMATS)}") from None


def runtime_formats() -> dict[str, ExportFormat]:
    """The export formats with a runtime of their own, by runtime name (llama.cpp, onnxruntime, …)."""
    return {f.runtime: f for f in EXPORT_FORMATS.values() if f.own_runtime}
