"""The checkpoint formats, in one explicit registry: who writes, who reads, and the glue the
pipeline and the model loader call (write + verify exports, detect + import checkpoints).

Exactness is the contract: a writer packs the in-memory ``QuantizedWeight`` records without
re-quantizing, and every export is verified by reading it back with our reader and requiring
identical codes, scales, zero points and schemes. Importers dequantize a checkpoint's records
into a float model and hand the records on, so the pipeline treats those layers as quantized.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.artifact import checksums
from compress.errors import FormatError
from compress.eval.metrics import Evaluation
from compress.export import autoawq, autogptq, compressed_tensors, gguf_export, onnx_export, tensorrt_export
from compress.export.hf_checkpoint import (
    CONFIG_FILE,
    QUANT_METHOD,
    QUANTIZATION_CONFIG,
    ImportedRecords,
    import_float_model,
    read_config,
    read_tensors,
    records_identical,
)
from compress.export.parity import VerifyInputs
from compress.export.specs import EXPORTS_DIR, GGUF, ONNX, TENSORRT
from compress.progress import Reporter
from compress.quantizers.core import QuantizedWeight
from compress.quantizers.kv_cache import KVCacheScheme

Writer = Callable[[Path, nn.Module, Any, dict[str, QuantizedWeight], KVCacheScheme | None], dict[str, Any] | None]
"""Writes the checkpoint; with a KV-cache scheme, returns what the format carries of it."""
Checker = Callable[[nn.Module, dict[str, QuantizedWeight]], None]
Reader = Callable[[dict[str, Any], dict[str, torch.Tensor], str], ImportedRecords]
EXACTNESS_CHECK = "records identical after reload (codes, scales, zero points, schemes)"


@dataclass(frozen=True)
class CheckpointFormat:
    name: str
    quant_method: str  # config.json quantization_config.quant_method
    read: Reader
    write: Writer | None = None  # None: import only
    check: Checker | None = None  # raises FormatError before any heavy work when records cannot be written exactly


FORMATS: dict[str, CheckpointFormat] = {
    "compressed-tensors": CheckpointFormat(
        "compressed-tensors", compressed_tensors.METHOD, compressed_tensors.read, compressed_tensors.write, compressed_tensors.check
    ),
    "gptq": CheckpointFormat("gptq", autogptq.METHOD, autogptq.read, autogptq.write, autogptq.check),
    "awq": CheckpointFormat("awq", autoawq.METHOD, autoawq.read),
}
BY_QUANT_METHOD = {f.quant_method: f for f in FORMATS.values()}
# Exports that run on their own runtime (module with check() and export()): verified there, gated on those numbers.
RUNTIME_EXPORTS = {GGUF: gguf_export, ONNX: onnx_export, TENSORRT: tensorrt_export}


# --------------------------------------------------------------------------- import


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
    model = import_float_model(directory, tensors, found, dtype, trust_remote_code)
    schemes = Counter(r.scheme.describe() + f" ({r.scheme.scale_dtype} scales)" for r in found.records.values())
    facts = {
        **found.facts,
        "layers": len(found.records),
        "schemes": dict(schemes),
        "quantization_config": quantization_config_of(directory),
    }
    return ImportedCheckpoint(model, found.records, facts)


# --------------------------------------------------------------------------- export (pipeline)


def check_exports(specs: list[Any], model: nn.Module, records: dict[str, QuantizedWeight], has_eval: bool = True) -> None:
    """Fail fast, before evaluation, when an export cannot hold the records exactly (or cannot be verified)."""
    for i, spec in enumerate(specs):
        if spec.format in RUNTIME_EXPORTS:
            try:
                RUNTIME_EXPORTS[spec.format].check(spec, model, records, has_eval)
            except FormatError as exc:
                raise FormatError(f"exports[{i}] ({spec.name}): {exc}") from None
            continue
        if not records:
            raise FormatError(
                f"exports[{i}] ({spec.name}): a {spec.format} checkpoint packs quantized layers, and no layer is "
                "quantized; add a quantize stage, or load a quantized checkpoint as model.source"
            )
        fmt = FORMATS[spec.format]
        if fmt.check is not None:
            try:
                fmt.check(model, records)
            except FormatError as exc:
                raise FormatError(f"exports[{i}] ({spec.name}): {exc}") from None


def write_exports(
    root: Path,
    specs: list[Any],
    model: nn.Module,
    tokenizer: Any,
    records: dict[str, QuantizedWeight],
    reporter: Reporter,
    inputs: VerifyInputs | None = None,
    kv: KVCacheScheme | None = None,
) -> tuple[list[dict[str, Any]], list[Evaluation]]:
    """Write each export to ``root/<name>/`` and verify it (reloading its records; runtime exports
    also run on their runtime with ``inputs``). With a KV-cache scheme, each entry says under
    ``kv_cache`` what its format carries of it. Returns manifest entries and runtime evaluations."""
    entries: list[dict[str, Any]] = []
    evaluations: list[Evaluation] = []
    for i, spec in enumerate(specs):
        directory = root / spec.name
        if spec.format in RUNTIME_EXPORTS:
            if inputs is None and spec.verify:
                raise FormatError(f"exports[{i}] ({spec.name}): verify: true needs the evaluation inputs")
            entry, found = RUNTIME_EXPORTS[spec.format].export(
                directory, spec, model, tokenizer, records, inputs, reporter, f"exports[{i}]", kv
            )
            entry.update(path=f"{EXPORTS_DIR}/{spec.name}", files=checksums(directory))
            entries.append(entry)
            evaluations.extend(found)
            continue
        fmt = FORMATS[spec.format]
        assert fmt.write is not None, f"{fmt.name} has no writer"  # the recipe schema admits writable formats only
        with reporter.status(f"exports[{i}] writing {spec.format} to {EXPORTS_DIR}/{spec.name} and verifying it"):
            kv_carried = fmt.write(directory, model, tokenizer, records, kv)
            problems = records_identical(records, read_records(directory, fmt).records)
        if problems:  # a packing bug: the whole artifact is abandoned rather than shipping a wrong checkpoint
            raise FormatError(
                f"exports[{i}] ({spec.name}): reloading the {spec.format} checkpoint does not give the "
                f"records back: {'; '.join(problems[:5])}"
            )
        entries.append(
            {
                "name": spec.name,
                "format": spec.format,
                "path": f"{EXPORTS_DIR}/{spec.name}",
                "layers": len(records),
                "verified": True,
                "check": EXACTNESS_CHECK,
                "quantization_config": read_config(directory)[QUANTIZATION_CONFIG],
                "files": checksums(directory),
                **({"kv_cache": kv_carried} if kv is not None else {}),
            }
        )
    return entries, evaluations


def report_entries(entries: list[dict[str, Any]], evaluations: list[Evaluation]) -> list[dict[str, Any]]:
    """The verification entries for report.json; ``evaluated_as`` names the evaluation that
    covers the export: its own (a runtime export verified on its runtime), else ``compressed`` for
    checkpoints (the same records), None for a runtime export not run (``verify: false``, no
    TensorRT) or when the run evaluated nothing."""
    names = {e.artifact for e in evaluations}
    covered = "compressed" if "compressed" in names else None
    keys = ("name", "format", "path", "verified", "check", "not_carried", "engine", "verification_skipped")

    def evaluated_as(entry: dict[str, Any]) -> str | None:
        if entry["name"] in names:
            return entry["name"]
        return None if entry["format"] in RUNTIME_EXPORTS else covered  # a runtime export is measured on its runtime or not at all

    return [{**{k: e[k] for k in keys if k in e}, "evaluated_as": evaluated_as(e)} for e in entries]


def gate_evaluations(evaluations: list[Evaluation], specs: list[Any]) -> list[Evaluation]:
    """Evaluations by artifact name for the gates. An export holds exactly the records of the
    in-memory compressed model (its verifier proves it, or the run fails), so a gate on an export
    reads the ``compressed`` evaluation. A GGUF or ONNX export is measured on its own runtime (llama.cpp,
    ONNX Runtime), or not at all (``verify: false``: a gate on it then fails as unmeasured, since the
    runtime computes differently and its own quantizers hold other weights)."""
    compressed = [e for e in evaluations if e.artifact == "compressed" and e.kind == "accuracy"]
    stand_ins = [dataclasses.replace(e, artifact=spec.name) for spec in specs if spec.format not in RUNTIME_EXPORTS for e in compressed]
    return [*evaluations, *stand_ins]
