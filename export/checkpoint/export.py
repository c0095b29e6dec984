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
from compress.quantizers.kv_cache import KVCacheScheme
from compress.schema.exports import EXPORTS_DIR

EXACTNESS_CHECK = "records identical after reload (codes, scales, zero points, schemes)"


def check(cfg: Any, model: nn.Module, records: dict[str, QuantizedWeight]) -> None:
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
    fmt = CHECKPOINT_FORMATS[cfg.format]
    assert fmt.write is not None, f"{fmt.name} has no writer"  # the recipe schema admits writable formats only
    with reporter.status(f"{label} writing {cfg.format} to {EXPORTS_DIR}/{cfg.name} and verifying it"):
        kv_carried = fmt.write(directory, model, tokenizer, records, kv)
        problems = records_identical(records, read_records(directory, fmt).records)
    if problems:  # a packing bug: the whole artifact is abandoned rather than shipping a wrong checkpoint
        raise FormatError(
            f"{label} ({cfg.name}): reloading the {cfg.format} checkpoint does not give the records back: {'; '.join(problems[:5])}"
        )
    return {
        "name": cfg.name,
        "format": cfg.format,
        "path": None,  # set by recipe_exports.write_exports
        "layers": len(records),
        "verified": True,
        "check": EXACTNESS_CHECK,
        "quantization_config": read_config(directory)[QUANTIZATION_CONFIG],
        "files": checksums(directory),
        **({"kv_cache": kv_carried} if kv is not None else {}),
    }
