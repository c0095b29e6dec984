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
    grid = float_grid_writer(model)
    if grid is not None:  # FP8 / FP4 records live in the model's FP8Linear / FP4Linear layers (quantizers/fp8.py, fp4.py)
        refused = [g for g in grid.grids(model) if cfg.float_refusal(g) is not None]
        if records or refused:  # refused when the recipe is validated (FP8Config / FP4Config.recipe_artifacts)
            raise FormatError(f"a {cfg.format} checkpoint cannot hold {grid.KIND} layers next to {len(records)} integer-quantized ones")
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
    grid = float_grid_writer(model)
    if grid is not None:
        return _export_float_grid(grid, directory, cfg, model, tokenizer, reporter, label, kv)
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


def float_grid_writer(model: nn.Module) -> Any:
    """The module writing the model's float-grid layers (export/checkpoint/fp8_checkpoint.py for FP8Linear,
    fp4_checkpoint.py for FP4Linear), or None when the model has none."""
    from compress.export.checkpoint import fp4_checkpoint, fp8_checkpoint

    return next((w for w in (fp8_checkpoint, fp4_checkpoint) if w.holds(model)), None)


def _export_float_grid(
    grid: Any, directory: Path, cfg: Any, model: nn.Module, tokenizer: Any, reporter: Reporter, label: str, kv: KVCacheScheme | None
) -> dict[str, Any]:
    """The FP8 / FP4 layers as a float-quantized / fp4-pack-quantized checkpoint (``grid``: its writer module), read back exactly."""
    records = grid.model_records(model)
    with reporter.status(f"{label} writing {cfg.format} ({grid.KIND}) to {EXPORTS_DIR}/{cfg.name} and verifying it"):
        kv_carried = grid.write_model(directory, model, tokenizer, records, kv)
        problems = grid.verify(directory, records)
    if problems:  # a writing bug: the whole artifact is abandoned rather than shipping a wrong checkpoint
        raise FormatError(
            f"{label} ({cfg.name}): reloading the {grid.KIND} checkpoint does not give the records back: {'; '.join(problems[:5])}"
        )
    return _entry(directory, cfg, len(records), grid.EXACTNESS_CHECK, kv, kv_carried)
