"""Shared orchestration for weight quantizers: pick layers, install records, summarize.

Kept apart from the math so a method module only says how one weight becomes a record.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from compress import streaming
from compress.calibration_checks import relative_error
from compress.context import RunContext, StageRecord
from compress.errors import CompressError
from compress.quantizers.core import QuantizedWeight, sqnr_db
from compress.quantizers.targets import select_linears
from compress.schema.quantize import QuantScheme, WeightQuantConfig


def select_or_fail(
    model: nn.Module, cfg: WeightQuantConfig, label: str, extra: list[tuple[str, nn.Linear]] = ()
) -> tuple[list[tuple[str, nn.Linear]], list[str]]:
    chosen, unused_ignore = select_linears(model, cfg.targets, cfg.ignore, extra)
    if not chosen:
        names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][:6]
        raise CompressError(
            f"{label}: targets {cfg.targets} with ignore {cfg.ignore} select no Linear layer. "
            f"This model's Linear layers are named like: {', '.join(names) or '(none)'}."
        )
    widest = max(m.in_features for _, m in chosen)
    if cfg.group_size is not None and cfg.group_size > widest:
        raise CompressError(
            f"{label}: group_size {cfg.group_size} is wider than every layer it quantizes (the widest input is "
            f"{widest}); use a group size up to {widest}, or null for one scale per output row"
        )
    return chosen, unused_ignore


def install_record(model: nn.Module, name: str, module: nn.Linear, record: QuantizedWeight, ctx: RunContext, label: str) -> dict:
    """Replace ``module``'s weight with the record's dequantized values and keep the record.

    A new Parameter is installed, so a weight tied to another module (lm_head and the token
    embedding) is untied rather than silently changing the other module.
    Returns the per-layer summary for the manifest.
    """
    if name in ctx.quantized:
        raise CompressError(f"{label}: layer {name} was already quantized by {ctx.quantized_by[name]}; quantize each layer once.")
    tied = tied_elsewhere(model, name, module)
    original = module.weight.detach()
    deq = record.dequantize(original.dtype).to(original.device)
    module.weight = nn.Parameter(deq, requires_grad=False)
    ctx.quantized[name] = record.cpu()  # records wait on the CPU; only the block being worked on sits on the accelerator
    ctx.quantized_by[name] = label
    return layer_summary(original, deq, record.bits_per_weight, tied, ctx.input_sums.get(name))


def tied_elsewhere(model: nn.Module, name: str, module: nn.Linear) -> list[str]:
    """The other parameter names that hold Linear ``name``'s weight (a head tied to the token embedding)."""
    return [n for n, p in model.named_parameters(remove_duplicate=False) if p is module.weight and n != f"{name}.weight"]


def layer_summary(
    original: torch.Tensor, dequantized: torch.Tensor, bits_per_weight: float, tied: list[str], sums: tuple | None = None
) -> dict:
    """A quantized layer's manifest summary: shape, SQNR, relative error, bits a weight, and the names it was untied from.
    The relative error is ‖ΔW‖²/‖W‖², weighted by the calibration's Σx² per input column (``sums``) when a calibrated
    method measured it; unweighted it is the SQNR's own ratio, so no second pass over the weight."""
    sqnr = sqnr_db(original, dequantized)
    rel = relative_error(original, dequantized, sums[0]) if sums else (0.0 if math.isinf(sqnr) else 10 ** (-sqnr / 10))
    info = {
        "shape": list(original.shape),
        "sqnr_db": round(sqnr, 3),
        "relative_error": float(f"{rel:.4g}"),
        "bits_per_weight": round(bits_per_weight, 4),
    }
    if tied:
        info["untied_from"] = tied
    return info


def swap_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` at the dotted path ``name`` of ``model``."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def install_module(
    model: nn.Module,
    name: str,
    module: nn.Linear,
    new: nn.Module,
    dequantized: torch.Tensor,
    bits_per_weight: float,
    ctx: RunContext,
    label: str,
) -> dict:
    """Replace Linear ``name`` with ``new``, the module of a method whose records are not ``QuantizedWeight``
    (fp8, fp4: it holds its record, whose values are ``dequantized``). ``new`` has a Parameter of its own, so
    a weight tied to another module is untied. Returns the per-layer summary for the manifest."""
    original = module.weight.detach()
    tied = tied_elsewhere(model, name, module)
    swap_module(model, name, new)
    ctx.quantized_by[name] = label
    return layer_summary(original, dequantized.to(original.device), bits_per_weight, tied)


def layers_activations(model: nn.Module, kind: type) -> Any:
    """How ``model``'s layers of module type ``kind`` (FP8Linear, FP4Linear) quantize their inputs (their
    ``activations``; one stage sets them all), None without such layers."""
    found = {m.activations for m in model.modules() if isinstance(m, kind)}
    if len(found) > 1:
        raise CompressError(f"the model's {kind.__name__} layers quantize their inputs in different ways ({sorted(map(str, found))})")
    return found.pop() if found else None


def quantize_each_layer(
    model: nn.Module,
    ctx: RunContext,
    cfg: WeightQuantConfig,
    label: str,
    quantize: Callable[[torch.Tensor, QuantScheme], QuantizedWeight],
    schemes: Callable[[dict[str, nn.Linear]], tuple[Callable[[str], QuantScheme], dict[str, Any] | None]] | None = None,
) -> StageRecord:
    """Run a calibration-free ``quantize(weight, scheme)`` on every selected layer independently;
    ``schemes(selected)`` gives each layer's scheme and the facts of that choice (default: the
    stage's scheme for every layer)."""
    start = time.perf_counter()
    chosen, unused_ignore = select_or_fail(model, cfg, label)
    if schemes is None:
        scheme = cfg.scheme()
        scheme_of, mix = (lambda _name: scheme), None
    else:
        scheme_of, mix = schemes(dict(chosen))
    layers: dict[str, dict] = {}
    # One streamed unit (a block, the head) at a time: read, quantize its layers, written back.
    by_unit: dict[int, tuple[nn.Module | None, list[tuple[str, nn.Linear]]]] = {}
    for name, module in chosen:
        unit = streaming.owner(model, name)
        by_unit.setdefault(id(unit), (unit, []))[1].append((name, module))
    progress = ctx.reporter.track(list(by_unit.values()), f"{label} {cfg.method} {cfg.describe_scheme()}")
    for unit, members in progress:
        with streaming.resident(unit, write_back=True) if unit is not None else contextlib.nullcontext():
            for name, module in members:
                record = quantize(module.weight.detach().to(ctx.device), scheme_of(name))
                layers[name] = install_record(model, name, module, record, ctx, label)
    return quantize_record(
        cfg, start, {**summarize(layers, unused_ignore, cfg.summary_scheme()), **({"gguf_mix": mix} if mix else {})}, layers
    )


def quantize_record(cfg: Any, started: float, summary: dict, layers: dict, method: str | None = None) -> StageRecord:
    """The StageRecord of a ``quantize`` stage that began at ``time.perf_counter()`` == ``started``: its method
    (``cfg.method`` unless given), its config as JSON, the duration, the summary and the per-layer facts."""
    return StageRecord(
        kind="quantize",
        method=method or cfg.method,
        config=cfg.model_dump(mode="json"),
        duration_s=time.perf_counter() - started,
        summary=summary,
        layers=layers,
    )


def summarize(layers: dict[str, dict], unused_ignore: list[str], scheme: QuantScheme | None) -> dict:
    params = sum(layer["shape"][0] * layer["shape"][1] for layer in layers.values())
    bits = sum(layer["shape"][0] * layer["shape"][1] * layer["bits_per_weight"] for layer in layers.values())
    sqnrs = [layer["sqnr_db"] for layer in layers.values()]
    return {
        "scheme": None if scheme is None else scheme.model_dump(mode="json"),  # None: per layer, in each layer's entry
        "layers_quantized": len(layers),
        "params_quantized": params,
        "bits_per_weight": round(bits / params, 4),
        "sqnr_db_mean": round(sum(sqnrs) / len(sqnrs), 3),
        "sqnr_db_min": round(min(sqnrs), 3),
        "ignore_patterns_unmatched": unused_ignore,
    }


def records_stage_config(stages: list[dict[str, Any]], records_file: str, config: type) -> Any:
    """The config (``config``, validated) of the manifest stage whose summary names ``records_file``: how the
    float-grid layers (FP8, FP4) of an artifact's records file are rebuilt on load. ValueError without one."""
    stage = next((s for s in stages if (s.get("summary") or {}).get("records_file") == records_file), None)
    if stage is None:
        raise ValueError(f"no stage of the manifest wrote {records_file}")
    return config.model_validate(stage["config"])
