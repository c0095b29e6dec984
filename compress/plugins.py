"""The plugin tables: explicit dicts from a recipe name to the plugin object that answers every
per-kind question (validate, plan, run, export, verify, time, size, model-card text).

Three tables live here: quantization methods (``QUANT_METHODS``), stage kinds
(``STAGE_KINDS``) and export formats (``EXPORT_FORMATS``). Code asks the plugin object; it never
switches on the name. A name missing from its table is an error that says which names are
known (in a recipe, a validation error naming the recipe key: the recipe model's stage keys,
``quantize:`` union and ``exports`` union are made from these tables, compress.recipe.recipe_model).
Adding a method, stage kind or format is one module or package (its config, code and plugin object) and one
entry here; nothing is discovered by walking packages (tests/test_plugin_entries.py).

Torch-free: plugin objects name their implementations through loaders that import them when a run
needs them (`compress validate` and `import compress` stay light; tests/test_schema.py checks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compress.distill.plugin import DISTILL, DRAFT
from compress.errors import CompressError
from compress.export.checkpoint.plugin import COMPRESSED_TENSORS
from compress.export.checkpoint.plugin import GPTQ as GPTQ_CHECKPOINT
from compress.export.format import HF_FORMAT, TORCH_RUNTIME, ExportFormat
from compress.export.gguf.plugin import GGUF
from compress.export.onnx.plugin import ONNX
from compress.export.tensorrt.plugin import TENSORRT
from compress.plugin_types import QuantMethod, StageKind
from compress.pruning.plugin import PRUNE
from compress.quantizers.fp4_plugin import FP4
from compress.quantizers.fp8_plugin import FP8
from compress.quantizers.plugin import AWQ, GPTQ, KV_CACHE, LLM_INT8, RTN, W8A8, quantize_kind
from compress.quantizers.rotate.plugin import ROTATE

__all__ = [
    "EXPORT_FORMATS",
    "QUANT_METHODS",
    "STAGE_KINDS",
    "device_names",
    "export_format",
    "quant_method",
    "runtime_formats",
    "source_format",
    "stage_kind",
]

# --------------------------------------------------------------------------- quantization methods and stage kinds

QUANT_METHODS: dict[str, QuantMethod] = {
    "rtn": RTN,  # quantizers/rtn.py
    "gptq": GPTQ,  # quantizers/gptq.py
    "awq": AWQ,  # quantizers/awq.py
    "llm_int8": LLM_INT8,  # quantizers/llm_int8.py
    "w8a8": W8A8,  # quantizers/w8a8.py
    "fp8": FP8,  # quantizers/fp8.py
    "fp4": FP4,  # quantizers/fp4.py
}
"""``quantize: {method: <name>}`` -> its QuantMethod (config model, stage, plan estimate, search cost)."""

STAGE_KINDS: dict[str, StageKind] = {
    "prune": PRUNE,  # pruning/prune.py
    "distill": DISTILL,  # distill/distill.py
    "quantize": quantize_kind(lambda name, label="": quant_method(name, label)),  # quantizers/: the method chosen in QUANT_METHODS
    "kv_cache": KV_CACHE,  # quantizers/kv_cache.py
    "rotate": ROTATE,  # quantizers/rotate/
    "draft": DRAFT,  # distill/draft.py (its files and measurements: compress/steps/draft.py)
}
"""A ``stages:`` item's key -> its StageKind (stage, plan estimate and shape, console summary)."""

# --------------------------------------------------------------------------- export formats

EXPORT_FORMATS: dict[str, ExportFormat] = {
    COMPRESSED_TENSORS.name: COMPRESSED_TENSORS,  # export/checkpoint/
    GPTQ_CHECKPOINT.name: GPTQ_CHECKPOINT,  # export/checkpoint/ (AutoGPTQ v1)
    GGUF.name: GGUF,  # export/gguf/
    ONNX.name: ONNX,  # export/onnx/
    TENSORRT.name: TENSORRT,  # export/tensorrt/
}
"""Export formats by the recipe's ``exports[].format`` key (one package each under export/)."""


def _where(label: str) -> str:
    return f"{label}: " if label else ""


def quant_method(name: str, label: str = "") -> QuantMethod:
    """Quantization method ``name``; an unregistered name is a CompressError naming the known ones."""
    method = QUANT_METHODS.get(name)
    if method is None:
        raise CompressError(
            f"{_where(label)}quantization method '{name}' is not registered in compress.plugins.QUANT_METHODS; "
            f"known: {', '.join(QUANT_METHODS) or '(none)'}"
        )
    return method


def stage_kind(name: str, label: str = "") -> StageKind:
    """Stage kind ``name``; an unregistered name is a CompressError naming the known ones."""
    kind = STAGE_KINDS.get(name)
    if kind is None:
        raise CompressError(
            f"{_where(label)}stage kind '{name}' is not registered in compress.plugins.STAGE_KINDS; "
            f"known: {', '.join(STAGE_KINDS) or '(none)'}"
        )
    return kind


def stage_streams(stage: Any) -> bool:
    """Whether a recipe stage works on a streamed model one unit at a time (for ``quantize``: when
    its method streams); else the run reads the whole model into memory before it."""
    kind = stage_kind(stage.kind)
    if kind.quantizes_weights:
        return kind.streams and method_streams(stage.config)
    return kind.streams(stage.config) if callable(kind.streams) else kind.streams


def method_streams(config: Any) -> bool:
    """Whether a weight-quantization method's stage with ``config`` works on a streamed model (its
    QuantMethod's ``streams``); else it needs the whole model in memory (e.g. ``backend: llmcompressor``)."""
    streams = quant_method(config.method).streams
    return streams(config) if callable(streams) else streams


def export_format(name: str) -> ExportFormat:
    """Export format ``name``; an unregistered name is a CompressError naming the known ones."""
    fmt = EXPORT_FORMATS.get(name)
    if fmt is None:
        raise CompressError(f"export format '{name}' is not available; available: {', '.join(EXPORT_FORMATS)}")
    return fmt


def source_format(path: Path) -> ExportFormat | None:
    """The export format whose file this model source is (a GGUF file), else None."""
    return next((fmt for fmt in EXPORT_FORMATS.values() if fmt.input_kind is not None and fmt.recognizes(path)), None)


def runtime_formats() -> dict[str, ExportFormat]:
    """The export formats with a runtime of their own, by runtime name (llama.cpp, onnxruntime, …)."""
    return {f.runtime: f for f in EXPORT_FORMATS.values() if f.own_runtime}


def device_names() -> tuple[list[str], list[str]]:
    """(formats, runtimes) a device profile may list: hf / torch (the in-memory model and Hugging
    Face folders) and each export format's ``device_names``, in table order."""
    pairs = [(HF_FORMAT, TORCH_RUNTIME), *(fmt.device_names for fmt in EXPORT_FORMATS.values())]
    return list(dict.fromkeys(f for f, _ in pairs)), list(dict.fromkeys(r for _, r in pairs))
