"""Optional backend: run llmcompressor's GPTQ or AWQ and import its result as our records.

``backend: llmcompressor`` on a ``method: gptq`` or ``method: awq`` stage (extra
``llmcompressor``). The stage's scheme and options are translated into llmcompressor modifiers
(``GPTQModifier``; ``AWQModifier`` followed by ``QuantizationModifier``), ``llmcompressor.oneshot``
runs them on a deep copy of the model with the recipe's own calibration chunks, and each
quantized layer is packed by compressed-tensors' own pack-quantized compressor (what
llmcompressor writes to disk) and read back with our compressed-tensors reader. The model in
memory then gets the records' dequantized weights (``install_record``) and llmcompressor's
float tensors (AWQ folds its scales into the norms), so both backends leave the same kind of
result: records in ``ctx.quantized`` and a float model computing exactly what they say.

What cannot be mapped is listed in the stage summary (``not_mapped``):

* GPTQ ``act_order: false``: both visit columns in order, but llmcompressor computes every
  group's scale and zero point up front from the original weights, where ours computes each
  group's when the algorithm reaches it (from the already-updated weights). ``act_order: true``
  is llmcompressor's ``actorder: static`` (static groups, columns by decreasing Hessian diagonal).
* AWQ ``clip``, ``clip_grid``, ``max_shrink``, ``clip_tokens``, ``clip_in_search``: llmcompressor's AWQ has no
  clipping search (its quantizer takes min/max per group); ``search_tokens``: it searches scales
  on all calibration tokens.

compressed-tensors has no partial last group, and llmcompressor refuses such layers: every
selected layer's width must be a multiple of ``group_size`` (an error says which to use).
"""

from __future__ import annotations

import copy
import math
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from compress.context import RunContext, StageRecord
from compress.errors import CompressError, FormatError
from compress.experts import expert_view
from compress.quantizers.apply import install_record, quantize_record, summarize
from compress.quantizers.compressed_tensors_args import LINEAR_TARGET, weight_args
from compress.quantizers.core import QuantizedWeight, one_cpu_thread, scale_torch_dtype
from compress.quantizers.sequential import peak_memory_mb, select_block_linears
from compress.schema.quantize import QuantScheme

if TYPE_CHECKING:
    from compress.quantizers.configs import AWQConfig, GPTQConfig

EXTRA = "llmcompressor"
NAME = "llmcompressor"


def not_mapped(cfg: GPTQConfig | AWQConfig) -> dict[str, str]:
    """Options of ``cfg`` that llmcompressor does not do the same way (for the stage summary)."""
    if cfg.method == "gptq":
        return (
            {}
            if cfg.act_order
            else {
                "act_order=false": "llmcompressor computes all group scales from the original weights up front (ours: when a group starts)"
            }
        )
    differences = {
        "clip, clip_grid, max_shrink, clip_tokens, clip_in_search": "llmcompressor's AWQ has no clipping search (min/max per group)",
        "search_tokens": "llmcompressor searches scales on all calibration tokens",
    }
    if cfg.duo_scaling == "both":
        differences["duo_scaling=both"] = "llmcompressor splits its grid between the two families (ours: the whole grid for each)"
    return differences


@dataclass(frozen=True)
class _Method:
    modifiers: Callable[[Any, dict[str, Any], list[str]], list[Any]]
    quantizes_in_place: bool
    """GPTQ leaves fake-quantized weights in llmcompressor's model (our float weights are the
    reference for SQNR); AWQ leaves the scaled float weights that were rounded (they are)."""
    one_cpu_thread: bool
    """GPTQ's column loop is thousands of tiny ops: on CPU, one thread is far faster (timed in
    docs/quantization.md#backend-llmcompressor). AWQ's scale search is matrix products, which use every thread."""


_SCALE_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _weight_args(scheme: QuantScheme) -> dict[str, Any]:
    """compressed-tensors ``QuantizationArgs`` (as a dict) for our scheme; scales are rounded to ``scale_dtype``."""
    return {**weight_args(scheme), "scale_dtype": scale_torch_dtype(scheme)}


def _gptq_modifiers(cfg: GPTQConfig, groups: dict[str, Any], ignore: list[str]) -> list[Any]:
    from llmcompressor.modifiers.gptq import GPTQModifier

    return [
        GPTQModifier(
            config_groups=groups,
            ignore=ignore,
            dampening_frac=cfg.dampening,
            block_size=cfg.block_size,
            actorder="static" if cfg.act_order else None,
        )
    ]


def _awq_modifiers(cfg: AWQConfig, groups: dict[str, Any], ignore: list[str]) -> list[Any]:
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    return [AWQModifier(duo_scaling=cfg.duo_scaling, n_grid=cfg.grid), QuantizationModifier(config_groups=groups, ignore=ignore)]


METHODS = {
    "gptq": _Method(_gptq_modifiers, quantizes_in_place=True, one_cpu_thread=True),
    "awq": _Method(_awq_modifiers, quantizes_in_place=False, one_cpu_thread=False),
}


def _require_llmcompressor() -> str:
    """llmcompressor's version; a CompressError naming the extra when it is not installed."""
    try:
        import llmcompressor
    except ImportError as exc:
        raise CompressError(
            f"backend: llmcompressor needs the llmcompressor package ({exc}). Install the extra: "
            f'pip install -e ".[{EXTRA}]" (or pip install "compress[{EXTRA}]"), or use backend: compress.'
        ) from None
    return str(getattr(llmcompressor, "__version__", "unknown"))


def check_whole_groups(selected: dict[str, nn.Linear], scheme: QuantScheme, label: str) -> None:
    """compressed-tensors (and so llmcompressor) has no partial last group."""
    g = scheme.group_size
    partial = [n for n, m in selected.items() if g is not None and m.in_features % g]
    if partial:
        fit = math.gcd(g, *(selected[n].in_features for n in partial))
        raise CompressError(
            f"{label}: backend llmcompressor cannot quantize {partial[0]} ({selected[partial[0]].in_features} input features) "
            f"with group_size {g}: llmcompressor stores groups in compressed-tensors, which has no partial last group "
            f"({len(partial)} layer(s) like this). Use a group_size that divides every quantized layer's width "
            f"(e.g. group_size: {fit}), group_size: null (per-channel), or backend: compress, which handles partial groups."
        )


def _calibration_loader(tokens: torch.Tensor, batch_size: int) -> torch.utils.data.DataLoader:
    """The recipe's calibration chunks, in order, as llmcompressor's batches of ``input_ids``."""
    rows = [{"input_ids": row} for row in tokens]
    return torch.utils.data.DataLoader(rows, batch_size=batch_size, shuffle=False)


@contextmanager
def _quiet_llmcompressor(quiet: bool) -> Iterator[None]:
    """Silence llmcompressor's and compressed-tensors' loguru messages when the run is quiet."""
    if not quiet:
        yield
        return
    from loguru import logger

    for name in ("llmcompressor", "compressed_tensors"):
        logger.disable(name)
    try:
        yield
    finally:
        for name in ("llmcompressor", "compressed_tensors"):
            logger.enable(name)


@contextmanager
def _no_pinning_without_accelerator() -> Iterator[None]:
    """llmcompressor 0.14's AWQ pins its cached activations (``IntermediatesCache.pin_memory``) to
    speed up copies to an accelerator; on a machine without one, torch refuses to pin ("Cannot
    access accelerator device when none is available"). With nothing to copy to, pinning is
    skipped for the duration of the call."""
    if torch.accelerator.is_available():
        yield
        return
    from llmcompressor.pipelines.cache import IntermediatesCache

    original = IntermediatesCache.pin_memory
    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None
    try:
        yield
    finally:
        IntermediatesCache.pin_memory = original


class _PreTokenized:
    """Stands in for a tokenizer: the calibration data is already tokenized, and without a
    processor llmcompressor would try to load one by the model's name (possibly from the hub)."""


def run_oneshot(
    model: nn.Module, tokens: torch.Tensor, ctx: RunContext, modifiers: list[Any], batch_size: int, one_thread: bool = False
) -> nn.Module:
    """``llmcompressor.oneshot`` on a deep copy of ``model`` with calibration chunks ``tokens`` [samples, seq_len]
    (on one CPU thread when ``one_thread`` and the device is the CPU)."""
    from llmcompressor import oneshot

    work = copy.deepcopy(model).eval()
    if hasattr(work.config, "quantization_config"):  # e.g. gguf: the model in memory is float, and oneshot refuses quantized ones
        delattr(work.config, "quantization_config")
    with (
        tempfile.TemporaryDirectory(prefix="compress-llmc-") as config_dir,
        _quiet_llmcompressor(ctx.reporter.quiet),
        _no_pinning_without_accelerator(),
        one_cpu_thread() if one_thread and ctx.device.type == "cpu" else nullcontext(),
    ):
        # oneshot re-reads the config from config.name_or_path; point it at a local copy so it
        # never looks a name up on the hub.
        name_or_path = work.config._name_or_path
        work.config.save_pretrained(config_dir)
        work.config._name_or_path = config_dir
        try:
            oneshot(
                model=work,
                recipe=modifiers,
                dataset=_calibration_loader(tokens, batch_size),
                processor=ctx.tokenizer if ctx.tokenizer is not None else _PreTokenized(),
                num_calibration_samples=int(tokens.shape[0]),
                max_seq_length=int(tokens.shape[1]),
                shuffle_calibration_samples=False,
                batch_size=batch_size,
            )
        finally:
            work.config._name_or_path = name_or_path
    return work


def import_layer(module: nn.Module, name: str, scheme: QuantScheme, label: str) -> QuantizedWeight:
    """One of llmcompressor's quantized layers as our record: its codes from compressed-tensors' own
    ``quantize`` (what its pack-quantized compressor packs), its scales and zero points as llmcompressor
    left them; refused unless the record dequantizes to what compressed-tensors' own compress and
    decompress give. (The compressed-tensors export reads and writes files; this reads a model in memory.)"""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.lifecycle.forward import quantize

    where = f"{label}: llmcompressor result, layer {name}"
    qscheme = getattr(module, "quantization_scheme", None)
    if qscheme is None or qscheme.weights is None:
        raise FormatError(f"{where}: llmcompressor left no quantization scheme on it")
    args = qscheme.weights
    asked = weight_args(scheme)
    got = {"num_bits": args.num_bits, "symmetric": args.symmetric, "group_size": args.group_size}
    if got != {k: asked[k] for k in got}:
        raise FormatError(f"{where}: llmcompressor quantized it as {got}, not as asked ({scheme.describe()})")
    state = {k: getattr(module, k).detach().cpu() for k in ("weight", "weight_scale", "weight_zero_point") if hasattr(module, k)}
    theirs = PackedQuantizationCompressor.decompress(PackedQuantizationCompressor.compress(state, qscheme), qscheme)["weight"]
    weight, scale = state["weight"], state["weight_scale"]
    signed = quantize(x=weight, scale=scale, zero_point=state.get("weight_zero_point"), args=args, dtype=torch.int8)
    offset = 2 ** (scheme.bits - 1)  # compressed-tensors' signed codes and zero points, shifted to our unsigned ones
    want = scale_torch_dtype(scheme)
    if scale.dtype != want and torch.equal(scale.to(want).to(scale.dtype), scale):
        scale = scale.to(want)  # rounded to scale_dtype by llmcompressor, held in the model's dtype
    if scale.dtype not in _SCALE_DTYPE_NAMES:
        raise FormatError(f"{where}: scales are {scale.dtype}; records hold float16, bfloat16 or float32 scales")
    n_groups = math.ceil(weight.shape[1] / (scheme.group_size or weight.shape[1]))
    if tuple(scale.shape) != (weight.shape[0], n_groups):
        raise FormatError(f"{where}: weight_scale has shape {tuple(scale.shape)}, expected {(weight.shape[0], n_groups)}")
    zero = torch.full(scale.shape, offset, dtype=torch.int32)
    if not scheme.symmetric:
        zero = state["weight_zero_point"].to(torch.int32).reshape(scale.shape) + offset
    try:
        record = QuantizedWeight(
            codes=(signed.to(torch.int32) + offset).to(torch.uint8).contiguous(),
            scale=scale.contiguous(),
            zero_point=zero.to(torch.uint8).contiguous(),
            scheme=QuantScheme(
                bits=scheme.bits, group_size=scheme.group_size, symmetric=scheme.symmetric, scale_dtype=_SCALE_DTYPE_NAMES[scale.dtype]
            ),
        )
    except ValueError as exc:
        raise FormatError(f"{where}: {exc}") from None
    tolerance = torch.finfo(theirs.dtype).eps * float(theirs.abs().max())  # fp32 models: measured identical
    if not torch.allclose(record.dequantize(torch.float32), theirs.float(), rtol=0, atol=tolerance):
        raise FormatError(f"{where}: our record of llmcompressor's layer differs from compressed-tensors' own dequantization")
    return record


def apply_llmcompressor(model: nn.Module, ctx: RunContext, cfg: GPTQConfig | AWQConfig, label: str) -> StageRecord:
    """The stage ``quantize: {method: gptq|awq, backend: llmcompressor, ...}``."""
    start = time.perf_counter()
    with _quiet_llmcompressor(ctx.reporter.quiet):  # it logs a warning on import without an accelerator
        version = _require_llmcompressor()
    method = METHODS[cfg.method]
    scheme = cfg.scheme()
    selected, unused_ignore = select_block_linears(model, cfg, label, f"{cfg.method} (backend: llmcompressor)")
    experts = [n for n in selected if expert_view(model, n) is not None]  # fused MoE experts (quantizers/moe.py)
    if experts:
        raise CompressError(
            f"{label}: backend llmcompressor is not wired for fused mixture-of-experts weights ({experts[0]} and "
            f"{len(experts) - 1} more expert matrices); use backend: compress, or add the experts to `ignore`"
        )
    check_whole_groups(selected, scheme, label)
    floats = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in selected]
    groups = {"group_0": {"targets": [LINEAR_TARGET], "weights": _weight_args(scheme)}}
    tokens = ctx.calibration()
    ctx.reporter.info(f"{label} running llmcompressor {version} {cfg.method} {scheme.describe()} on a copy of the model")
    work = run_oneshot(model, tokens, ctx, method.modifiers(cfg, groups, floats), cfg.batch_size, method.one_cpu_thread)

    records = {name: import_layer(work.get_submodule(name), name, scheme, label) for name in selected}
    quantized_weights = {f"{name}.weight" for name in selected}
    ours = model.state_dict()
    taken = 0
    with torch.no_grad():
        for key, tensor in work.state_dict().items():
            if key in ours and (key not in quantized_weights or not method.quantizes_in_place):
                ours[key].copy_(tensor.to(ours[key].device, ours[key].dtype))  # AWQ: folded norms, scaled weights
                taken += 1
    del work
    layer_info = {name: install_record(model, name, selected[name], records[name], ctx, label) for name in selected}
    summary = summarize(layer_info, unused_ignore, scheme)
    summary.update(
        backend=NAME,
        llmcompressor_version=version,
        calibration_tokens=int(tokens.numel()),
        peak_memory_mb=round(peak_memory_mb(ctx.device), 1),
        float_tensors_taken=taken,
        not_mapped=not_mapped(cfg),
    )
    return quantize_record(cfg, start, summary, layer_info)
