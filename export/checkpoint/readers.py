"""The quantized Hugging Face checkpoint formats we read and write, in one explicit table, and
the model loader's glue (detect + import checkpoints).

Importers dequantize a checkpoint's records into a float model and hand the records on, so the
pipeline treats those layers as quantized.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.errors import FormatError
from compress.export.checkpoint import autoawq, autogptq, compressed_tensors
from compress.export.checkpoint.hf_checkpoint import (
    CONFIG_FILE,
    QUANT_METHOD,
    QUANTIZATION_CONFIG,
    ImportedRecords,
    import_float_model,
    read_config,
    read_tensors,
)
from compress.quantizers.core import QuantizedWeight
from compress.quantizers.kv_cache import KVCacheScheme

Writer = Callable[[Path, nn.Module, Any, dict[str, QuantizedWeight], KVCacheScheme | None], dict[str, Any] | None]
"""Writes the checkpoint; with a KV-cache scheme, returns what the format carries of it."""
Checker = Callable[[nn.Module, dict[str, QuantizedWeight]], None]
Reader = Callable[[dict[str, Any], dict[str, torch.Tensor], str], ImportedRecords]


@dataclass(frozen=True)
class CheckpointFormat:
    name: str
    quant_method: str  # config.json quantization_config.quant_method
    read: Reader
    write: Writer | None = None  # None: import only
    check: Checker | None = None  # raises FormatError before any heavy work when records cannot be written exactly


CHECKPOINT_FORMATS: dict[str, CheckpointFormat] = {
    compressed_tensors.METHOD: CheckpointFormat(
        compressed_tensors.METHOD,
        compressed_tensors.METHOD,
        compressed_tensors.read,
        compressed_tensors.write_export,
        compressed_tensors.check_export,
    ),
    autogptq.METHOD: CheckpointFormat(autogptq.METHOD, autogptq.METHOD, autogptq.read, autogptq.write, autogptq.check),
    autoawq.METHOD: CheckpointFormat(autoawq.METHOD, autoawq.METHOD, autoawq.read),
}
BY_QUANT_METHOD = {f.quant_method: f for f in CHECKPOINT_FORMATS.values()}


@dataclass
class ImportedCheckpoint:
    model: nn.Module
    records: dict[str, QuantizedWeight]
    facts: dict[str, Any]


def quantization_config_of(directory: Path) -> dict[str, Any] | None:
    """config.json's ``quantization_config``, else AutoGPTQ's ``quantize_config.json``, else None."""
    qcfg = read_config(directory).get(QUANTIZATION_CONFIG)
    if qcfg is None and (directory / autogptq.QUANTIZE_CONFIG_FILE).is_file():
        qcfg = {QUANT_METHOD: autogptq.METHOD, **json.loads((directory / autogptq.QUANTIZE_CONFIG_FILE).read_text())}
    return qcfg


def detect_format(directory: Path) -> CheckpointFormat | None:
    """The format of a quantized HF directory that our importers read, else None. Other
    ``quant_method`` values stay with transformers (e.g. ``gguf`` in our converted GGUF cache,
    which transformers loads as float)."""
    qcfg = quantization_config_of(directory) or {}
    return BY_QUANT_METHOD.get(qcfg.get(QUANT_METHOD))


def read_records(directory: Path, fmt: CheckpointFormat | None = None) -> ImportedRecords:
    """The records of a quantized checkpoint directory (no model is built)."""
    return _read(directory, fmt, read_tensors(directory))


def _read(directory: Path, fmt: CheckpointFormat | None, tensors: dict[str, torch.Tensor]) -> ImportedRecords:
    fmt = fmt or detect_format(directory)
    if fmt is None:
        raise FormatError(f"{directory / CONFIG_FILE} has no quantization_config: not a quantized checkpoint")
    found = fmt.read(quantization_config_of(directory) or {}, tensors, str(directory))
    if not found.records:
        raise FormatError(f"{directory}: a {fmt.name} checkpoint without quantized layers")
    return found


def import_checkpoint(directory: Path, dtype: torch.dtype, trust_remote_code: bool = False) -> ImportedCheckpoint:
    """Records plus the float model with their dequantized weights (never re-quantized)."""
    fmt = detect_format(directory)
    if fmt is None:
        raise FormatError(f"{directory / CONFIG_FILE} has no quantization_config: not a quantized checkpoint")
    tensors = read_tensors(directory)
    found = _read(directory, fmt, tensors)
    if found.facts.get("input_activations"):
        raise FormatError(
            f"{directory}: config groups {', '.join(found.facts['input_activations'])} quantize the input activations "
            "(int8 per token, W8A8), which a float model with weight records would not compute; load the checkpoint "
            "with vLLM, or quantize its float source with method w8a8"
        )
    model = import_float_model(directory, tensors, found, dtype, trust_remote_code)
    schemes = Counter(r.scheme.describe() + f" ({r.scheme.scale_dtype} scales)" for r in found.records.values())
    facts = {
        **found.facts,
        "layers": len(found.records),
        "schemes": dict(schemes),
        "quantization_config": quantization_config_of(directory),
    }
    return ImportedCheckpoint(model, found.records, facts)
