"""W8A8 int8 with SmoothQuant scale migration (Xiao et al., 2023): what vLLM runs for a compressed-tensors
``int-quantized`` W8A8 checkpoint, simulated exactly in memory.

* Weights: int8 symmetric per output channel, ``scale = absmax_row / 127`` rounded up to fp16, codes in
  [-127, 127] (LLM.int8's record, ``quantize_weight_int8``).
* Activations: int8 symmetric per token, dynamic: each input row's ``absmax / 127`` at run time
  (``quantize_rows_int8``), no outlier decomposition.
* The product: ``int8_matmul`` (exact int32 accumulation) times ``s_x · s_w`` in float32, bias added in float.

Smoothing (``smoothing: {alpha}``) first moves part of each input channel's range from the activations
into the weights. For each group of Linears reading one tensor (q/k/v after the input norm, gate/up after
the MLP's norm, o_proj after v_proj when v_proj's rows are o_proj's columns), with ``max|X_j|`` from the
calibration data and ``max|W_j|`` over the group's columns:

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

The preceding norm's weight (or v_proj's rows) is divided by ``s`` and the Linears' columns multiplied by
it (AWQ's ``fold_scales``, which keeps Gemma's ``1 + w`` norm offset), so the float model computes the
same function, and the activations the int8 quantizer sees are flatter. down_proj reads the MLP's
activation and is not smoothed (as in SmoothQuant). Under grouped-query attention v_proj has fewer rows than
o_proj has columns: each value channel feeds the same channel of every query head it serves, so o_proj's
channels are smoothed by one scale per value channel (maxima taken over the heads sharing it) and the
scale divides that v_proj row (``kv_channel_index``).
Pure math first, the module next, the stage last.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from compress.context import RunContext, StageRecord
from compress.errors import CompressError
from compress.quantizers.apply import install_record, quantize_record, summarize, swap_module
from compress.quantizers.arch import Architecture, AWQMapping, architecture_of, decoder_blocks
from compress.quantizers.awq import fold_scales
from compress.quantizers.compressed_tensors_args import TOKEN_INT8_ACTIVATIONS
from compress.quantizers.configs import Kernel, W8A8Config
from compress.quantizers.core import QuantizedWeight
from compress.quantizers.llm_int8 import (
    collect_input_absmax,
    decomposed_matmul,
    kernel_description,
    quantize_weight_int8,
    resolve_kernel,
    signed_codes,
    start_int8_stage,
)
from compress.quantizers.sequential import peak_memory_mb

ACTIVATION_READERS = ("mlp.down_proj",)
"""Linears whose input is the MLP's activation: SmoothQuant leaves them unsmoothed."""

NO_OUTLIERS = torch.zeros(0, dtype=torch.long)


# --------------------------------------------------------------------------- pure math


def smoothing_scales(x_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """SmoothQuant's per-input-channel scales [in] (float32): ``max|X_j|^alpha / max|W_j|^(1-alpha)``, with
    ``max|W_j|`` over the columns j of every weight [out, in] in ``weights``. A channel whose activations or
    weights are all zero keeps scale 1 (nothing to balance)."""
    x = x_absmax.to(torch.float32)
    w = torch.cat([weight.detach().abs().to(torch.float32) for weight in weights]).amax(dim=0)
    live = (x > 0) & (w > 0)
    s = x.clamp(min=1e-30).pow(alpha) / w.clamp(min=1e-30).pow(1 - alpha)
    return torch.where(live, s, torch.ones_like(s))


def kv_channel_index(in_features: int, kv_features: int, head_dim: int) -> torch.Tensor:
    """For each input channel of o_proj (query head h, dim d: ``h * head_dim + d``), the v_proj output channel
    it reads under grouped-query attention (``kv * head_dim + d``, ``kv = h // (heads / kv_heads)``)."""
    heads, kv_heads = in_features // head_dim, kv_features // head_dim
    if heads * head_dim != in_features or kv_heads * head_dim != kv_features or heads % kv_heads:
        raise ValueError(f"{in_features} query channels and {kv_features} value channels are not heads of {head_dim}")
    channel = torch.arange(in_features)
    return channel // head_dim // (heads // kv_heads) * head_dim + channel % head_dim


def grouped_smoothing_scales(x_absmax: torch.Tensor, weight: torch.Tensor, index: torch.Tensor, alpha: float) -> torch.Tensor:
    """``smoothing_scales`` with one scale per group of channels ``index`` maps together (the value channel
    o_proj's channels read): the maxima of |X| and |W| taken over each group. Returns [groups]."""
    groups = int(index.max()) + 1
    x = torch.zeros(groups).scatter_reduce(0, index, x_absmax.to(torch.float32), "amax")
    w = torch.zeros(groups).scatter_reduce(0, index, weight.detach().abs().to(torch.float32).amax(dim=0).cpu(), "amax")
    return smoothing_scales(x, [w[None, :]], alpha)


def w8a8_matmul(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, kernel: str = "torch") -> torch.Tensor:
    """``x Wᵀ`` [tokens, out] in float32 for ``x`` [tokens, in]: per-token int8 ``x`` times the int8 codes
    ``w_q`` [out, in], accumulated exactly in int32, times ``s_x · s_w`` (LLM.int8's product with no outliers)."""
    return decomposed_matmul(x, w_q, w_scale, NO_OUTLIERS.to(x.device), w_q[:, :0], kernel)


# --------------------------------------------------------------------------- the module


class W8A8Linear(nn.Linear):
    """A Linear that computes as a W8A8 runtime does: dynamic per-token int8 activations times the record's
    int8 codes (``w8a8_matmul``), bias in float. ``weight`` holds the record's dequantized values (what
    exporters and state dicts see); ``input_activations`` is the activation scheme in compressed-tensors'
    words, which the compressed-tensors export writes for this layer."""

    input_activations = TOKEN_INT8_ACTIVATIONS

    def __init__(self, linear: nn.Linear, record: QuantizedWeight, kernel: Kernel = "auto") -> None:
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.weight = linear.weight  # shared Parameter: install_record has already put the dequantized values in it
        self.bias = linear.bias
        self.kernel = kernel
        q, scale = signed_codes(record)
        self.register_buffer("weight_int8", q.to(linear.weight.device), persistent=False)
        self.register_buffer("weight_scale", scale.to(linear.weight.device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.float32)
        y = w8a8_matmul(flat, self.weight_int8, self.weight_scale, resolve_kernel(self.kernel, flat.device))
        if self.bias is not None:
            y = y + self.bias.to(torch.float32)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activations=int8 per token (dynamic), kernel={self.kernel}"


# --------------------------------------------------------------------------- smoothing


def smoothing_mappings(arch: Architecture) -> tuple[AWQMapping, ...]:
    """The groups SmoothQuant balances: the architecture's AWQ mappings but those into down_proj."""
    return tuple(m for m in arch.awq if not set(m.linears) & set(ACTIVATION_READERS))


def smooth(
    model: nn.Module,
    chosen: dict[str, nn.Linear],
    absmax: dict[str, torch.Tensor],
    alpha: float,
    label: str,
    quantized: Collection[str] = (),
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Fold SmoothQuant's scales into every group of ``chosen`` Linears the architecture allows, in place
    (never into a Linear in ``quantized``: an earlier stage's record must stay its weight).
    Returns per Linear what it was smoothed by (scale range), and per group that was not, why."""
    arch = _architecture(model, label)
    smoothed: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    with torch.no_grad():
        for index, block in enumerate(decoder_blocks(model, arch)):
            prefix = f"{arch.blocks}.{index}."
            for mapping in smoothing_mappings(arch):
                names = [prefix + n for n in mapping.linears]
                prev = block.get_submodule(mapping.prev)
                linears = [chosen.get(n) for n in names]
                if any(lin is None for lin in linears):
                    skipped[prefix + mapping.prev] = "not smoothed: not every Linear it feeds is quantized by this stage"
                    continue
                if prefix + mapping.prev in quantized:
                    skipped[prefix + mapping.prev] = "not smoothed: it was quantized by an earlier stage"
                    continue
                if isinstance(prev, nn.Linear) and prev.out_features != linears[0].in_features:  # GQA: v_proj -> o_proj
                    (reader,) = linears
                    try:
                        channels = kv_channel_index(reader.in_features, prev.out_features, head_dim(model))
                    except ValueError as exc:
                        skipped[prefix + mapping.prev] = f"not smoothed: {exc}"
                        continue
                    s = grouped_smoothing_scales(absmax[names[0]], reader.weight, channels, alpha)
                    fold_scales(prev, [], s.to(prev.weight.device), arch.norm_offset)
                    reader.weight.mul_(s[channels].to(reader.weight.device, reader.weight.dtype).unsqueeze(0))
                else:
                    s = smoothing_scales(absmax[names[0]], [lin.weight for lin in linears], alpha)
                    fold_scales(prev, linears, s.to(prev.weight.device), arch.norm_offset)
                for name in names:
                    smoothed[name] = {"smoothed_by": prefix + mapping.prev, "scale_min": float(s.min()), "scale_max": float(s.max())}
    return smoothed, skipped


def head_dim(model: nn.Module) -> int:
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def _architecture(model: nn.Module, label: str) -> Architecture:
    try:
        arch = architecture_of(model)
    except CompressError as exc:
        raise CompressError(f"{label}.quantize.smoothing: {exc}; or set smoothing: null (plain W8A8)") from None
    if arch.moe is not None:
        raise CompressError(
            f"{label}.quantize.smoothing: the mixture-of-experts architecture {arch.name} is not smoothed (its experts "
            "share one norm through a router); set smoothing: null (plain W8A8)"
        )
    return arch


# --------------------------------------------------------------------------- the stage


class W8A8Stage:
    """The recipe step ``quantize: {method: w8a8, smoothing: {alpha} | null, ...}``."""

    def __init__(self, config: W8A8Config, label: str) -> None:
        self.config = config
        self.label = label

    def apply(self, model: nn.Module, ctx: RunContext) -> StageRecord:
        start = time.perf_counter()
        cfg, label = self.config, self.label
        scheme = cfg.scheme()
        kernel, chosen, unused_ignore = start_int8_stage(model, cfg, ctx, label)
        smoothed: dict[str, dict[str, Any]] = {}
        skipped: dict[str, str] = {}
        tokens = 0
        if cfg.smoothing is not None:
            _architecture(model, label)  # refused before the calibration pass
            calibration = ctx.calibration()
            tokens = int(calibration.numel())
            absmax = collect_input_absmax(
                model,
                dict(chosen),
                calibration,
                cfg.batch_size,
                ctx.device,
                ctx.reporter,
                f"{label} w8a8 calibrating ({calibration.shape[0]} x {calibration.shape[1]} tokens)",
            )
            smoothed, skipped = smooth(model, dict(chosen), absmax, cfg.smoothing.alpha, label, ctx.quantized)
        layers: dict[str, dict[str, Any]] = {}
        for name, module in ctx.reporter.track(chosen, f"{label} w8a8 {scheme.describe()}, int8 activations per token"):
            record = quantize_weight_int8(module.weight.detach().to(ctx.device), scheme)
            info = install_record(model, name, module, record, ctx, label)
            swap_module(model, name, W8A8Linear(module, record, cfg.kernel))
            layers[name] = {**info, **smoothed.get(name, {})}
        summary = summarize(layers, unused_ignore, scheme)
        summary.update(
            activations="int8 per token, dynamic (absmax / 127 at run time)",
            smoothing=None if cfg.smoothing is None else {"alpha": cfg.smoothing.alpha, "layers": len(smoothed), "skipped": skipped},
            kernel=kernel_description(kernel) + f" on {ctx.device.type}",
            calibration_tokens=tokens,
            peak_memory_mb=round(peak_memory_mb(ctx.device), 1),
        )
        return quantize_record(cfg, start, summary, layers)
