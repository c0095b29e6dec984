"""Write a quantized Hugging Face checkpoint export and prove it: reading it back must give the
records exactly (codes, scales, zero points, schemes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from compress.errors import FormatError
from compress.export.checkpoint.hf_checkpoint import QUANTIZATION_CONFIG, read_config, records_identical
from compress.export.checkpoint.readers import CHECKPOINT_FORMATS, read_records
from compress.hf_model import checksums
from compress.progress import Reporter
from compress.quantizers.core import QuantizedWeight, refuse_gguf_grids
from compress.quantizers.fp8 import FP8Linear, fp8_activations, fp8_records
from compress.quantizers.kv_cache import KVCacheScheme
from compress.schema.exports import EXPORTS_DIR

EXACTNESS_CHECK = "records identical after reload (codes, scales, zero points, schemes)"


def check(cfg: Any, model: nn.Module, records: dict[str, QuantizedWeight]) -> None:
    if has_fp8_layers(model):  # FP8 records live in the model's FP8Linear layers (quantizers/fp8.py)
        if records or cfg.fp8_refusal is not None:  # refused when the recipe is validated (FP8Config.recipe_artifacts)
            raise FormatError(f"a {cfg.format} checkpoint cannot hold FP8 layers next to {len(records)} integer-quantized ones")
        return
    if not records:
        raise FormatError(
            f"a {cfg.format} checkpoint packs quantized layers, and no layer is "
            "quantized; add a quantize stage, or load a quantized checkpoint as model.source"
        )
    refuse_gguf_grids(records, cfg.format)
    fmt = CHECKPOINT_FORMATS[cfg.format]
    if fmt.check is not None:
        fmt.check(model, records)


def export(
    directory: Path,
    cfg: Any,
    model: nn.Module,
    tokenizer: Any,
    records: dict[str, QuantizedWeight],
    reporter: Reporter,
    label: str,
    kv: KVCacheScheme | None,
) -> dict[str, Any]:
    """Write the checkpoint to ``directory``, read it back and require the same records; returns the manifest entry."""
    if has_fp8_layers(model):
        return _export_fp8(directory, cfg, model, tokenizer, reporter, label, kv)
    fmt = CHECKPOINT_FORMATS[cfg.format]
    assert fmt.write is not None, f"{fmt.name} has no writer"  # the recipe schema admits writable formats only
    with reporter.status(f"{label} writing {cfg.format} to {EXPORTS_DIR}/{cfg.name} and verifying it"):
        kv_carried = fmt.write(directory, model, tokenizer, records, kv)
        problems = records_identical(records, read_records(directory, fmt).records)
    if problems:  # a packing bug: the whole artifact is abandoned rather than shipping a wrong checkpoint
        raise FormatError(
            f"{label} ({cfg.name}): reloading the {cfg.format} checkpoint does not give the records back: {'; '.join(problems[:5])}"
        )
    return _entry(directory, cfg, len(records), EXACTNESS_CHECK, kv, kv_carried)


def _entry(directory: Path, cfg: Any, layers: int, check: str, kv: KVCacheScheme | None, kv_carried: Any) -> dict[str, Any]:
    """The manifest entry of a checkpoint export that was read back exactly."""
    return {
        "name": cfg.name,
        "format": cfg.format,
        "path": None,  # set by recipe_exports.write_exports
        "layers": layers,
        "verified": True,
        "check": check,
        "quantization_config": read_config(directory)[QUANTIZATION_CONFIG],
        "files": checksums(directory),
        **({"kv_cache": kv_carried} if kv is not None else {}),
    }


def has_fp8_layers(model: nn.Module) -> bool:
    return any(isinstance(m, FP8Linear) for m in model.modules())


def _export_fp8(
    directory: Path, cfg: Any, model: nn.Module, tokenizer: Any, reporter: Reporter, label: str, kv: KVCacheScheme | None
) -> dict[str, Any]:
    """The FP8 layers as a float-quantized checkpoint (export/checkpoint/fp8_checkpoint.py), read back exactly."""
    from compress.export.checkpoint import fp8_checkpoint

    records = fp8_records(model)
    with reporter.status(f"{label} writing {cfg.format} (float-quantized) to {EXPORTS_DIR}/{cfg.name} and verifying it"):
        kv_carried = fp8_checkpoint.write(directory, model, tokenizer, records, fp8_activations(model), kv)
        problems = fp8_checkpoint.verify(directory, records)
    if problems:  # a writing bug: the whole artifact is abandoned rather than shipping a wrong checkpoint
        raise FormatError(
            f"{label} ({cfg.name}): reloading the float-quantized checkpoint does not give the records back: {'; '.join(problems[:5])}"
        )
    return _entry(directory, cfg, len(records), fp8_checkpoint.EXACTNESS_CHECK, kv, kv_carried)
