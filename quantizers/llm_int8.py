"""LLM.int8(): vector-wise int8 weights and activations with mixed-precision outlier
decomposition (Dettmers et al., 2022), the semantics of bitsandbytes' ``Linear8bitLt``.

A Linear ``y = x Wᵀ + b`` is computed in two parts:

* input features (columns of ``x``) where any |x| in the current input reaches ``threshold``
  are *outliers*: those columns of ``x`` times those columns of ``W`` run in float;
* every other feature runs in int8: per-token absmax int8 activations times per-row absmax
  int8 weight codes, accumulated exactly in int32, then scaled by ``s_x · s_w``.

Outliers are found at run time, per input, as bitsandbytes does. Which float weight the outlier
columns use: for features found to be outliers on the calibration data, the original float
columns (kept in fp16; their bytes are counted in the stage summary); for features that turn
out to be outliers only at run time, the dequantized int8 columns (the original is gone; that is
what bitsandbytes does for every outlier column of its int8 inference weights).
``threshold: .inf`` turns the decomposition off: plain vector-wise W8A8, the paper's baseline.

The int8 GEMM (``kernel``): ``torch._int_mm`` by default; bitsandbytes' ``int8_linear_matmul``
(cuBLASLt's int8 GEMM on CUDA, its own CPU kernels elsewhere) on CUDA when bitsandbytes is
installed, or everywhere with ``kernel: bitsandbytes``. bitsandbytes gets only the products it
computes in integers (inner dimension a multiple of 4 on CUDA; CPUs with AVX-512), the rest take
the torch path, so the int32 result is exact either way and the two kernels give the same output;
the scaling and the outlier part stay ours.

The weight record is ordinary symmetric 8-bit per-channel: ``scale = absmax_row / 127``
(rounded up to fp16), ``q`` in [-127, 127], stored as uint8 ``q + 128`` with zero point 128, so
exporters see plain int8 weights (exactly Q8_0 in GGUF). Export formats carry no activation
quantization or decomposition: a reloaded artifact runs the int8 weights in float.
Pure math first, the module next, the calibration stage last.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
from torch import nn

from compress.context import RunContext, StageRecord
from compress.errors import CompressError
from compress.progress import Reporter
from compress.quantizers.apply import install_record, quantize_record, select_or_fail, summarize, swap_module
from compress.quantizers.configs import Int8ChannelConfig, Kernel, LLMInt8Config, ResolvedKernel
from compress.quantizers.core import QuantizedWeight, round_scale, scale_torch_dtype
from compress.quantizers.sequential import StopForward, peak_memory_mb
from compress.schema.quantize import QuantScheme

INT8_MAX = 127  # codes use [-127, 127]: symmetric, so -q is always representable
INT32_SAFE_K = (2**31 - 1) // (INT8_MAX * INT8_MAX)  # longest dot product an int32 accumulator holds exactly
SHORT_INDEX_LIST = 16  # calibrated outlier indices are listed in the summary up to this many per layer


# --------------------------------------------------------------------------- pure math


def quantize_weight_int8(weight: torch.Tensor, scheme: QuantScheme | None = None) -> QuantizedWeight:
    """Row-wise absmax int8 record of ``weight`` [out, in]: ``scale = absmax_row / 127`` rounded up
    to the scale dtype, ``q = round(w / scale)`` in [-127, 127], stored as ``q + 128``."""
    scheme = scheme or QuantScheme(bits=8, group_size=None, symmetric=True)
    if (scheme.bits, scheme.group_size, scheme.symmetric) != (8, None, True):
        raise ValueError(f"LLM.int8 weights are 8-bit per-channel symmetric, not {scheme.describe()}")
    w = weight.detach().to(torch.float32)
    scale = round_scale(w.abs().amax(dim=1) / INT8_MAX, scheme)  # >= absmax/127, so |w/scale| <= 127
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX)
    return QuantizedWeight(
        codes=(q + scheme.symmetric_zero).to(torch.uint8).contiguous(),
        scale=scale[:, None].to(scale_torch_dtype(scheme)).contiguous(),
        zero_point=torch.full((w.shape[0], 1), scheme.symmetric_zero, dtype=torch.uint8, device=w.device),
        scheme=scheme,
    )


def signed_codes(record: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The record as int8 codes [out, in] and float32 row scales [out] (``w = q · s``)."""
    q = (record.codes.to(torch.int16) - record.zero_point.to(torch.int16)).to(torch.int8)
    return q, record.scale[:, 0].to(torch.float32)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token) absmax int8 of ``x`` [tokens, features]: codes int8 and float32 scales
    [tokens]. An all-zero row gets scale 1 and zero codes."""
    absmax = x.abs().amax(dim=1).to(torch.float32)
    scale = torch.where(absmax > 0, absmax / INT8_MAX, torch.ones_like(absmax))
    q = torch.round(x.to(torch.float32) / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


def _int_mm_supports(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``torch._int_mm(a, b.t())`` runs for these operands. On CPU (checked on torch 2.13)
    any shape works; cuBLAS needs more than 16 rows and both other dimensions multiples of 8."""
    if not hasattr(torch, "_int_mm"):
        return False
    m, k = a.shape
    n = b.shape[0]
    if a.device.type == "cpu":
        return True
    if a.device.type == "cuda":
        return m > 16 and k % 8 == 0 and n % 8 == 0 and k > 0 and n > 0
    return False


@functools.cache
def bitsandbytes_functional() -> ModuleType | None:
    """``bitsandbytes.functional``, or None when bitsandbytes is not installed."""
    try:
        import bitsandbytes.functional as bnb_functional
    except ImportError:
        return None
    return bnb_functional


def resolve_kernel(kernel: Kernel, device: torch.device) -> ResolvedKernel:
    """The int8 GEMM ``kernel`` means for tensors on ``device`` (see ``LLMInt8Config.kernel``)."""
    if kernel == "bitsandbytes":
        if bitsandbytes_functional() is None:
            raise CompressError(
                "llm_int8 kernel: bitsandbytes needs the bitsandbytes package: pip install 'bitsandbytes>=0.46' "
                "(or use kernel: auto or torch)"
            )
        return "bitsandbytes"
    if kernel == "auto" and device.type == "cuda" and bitsandbytes_functional() is not None:
        return "bitsandbytes"
    return "torch"


def _bitsandbytes_is_exact(a: torch.Tensor) -> bool:
    """Whether bitsandbytes (checked on 0.50) accumulates ``a``'s products in integers: cuBLASLt's
    int8 GEMM needs an inner dimension that is a multiple of 4, and its CPU backend uses
    ``torch._int_mm`` only on AVX-512 CPUs; elsewhere it multiplies in float32, which rounds
    once a dot product passes 2**24."""
    if a.device.type == "cuda":
        return a.shape[1] % 4 == 0
    return a.device.type == "cpu" and torch.backends.cpu.get_cpu_capability() == "AVX512"


def kernel_description(kernel: ResolvedKernel) -> str:
    """What the manifest says about the GEMM that ran."""
    if kernel == "bitsandbytes":
        import bitsandbytes

        return f"bitsandbytes {bitsandbytes.__version__} int8_linear_matmul"
    return "torch._int_mm (float64 emulation where it does not apply)"


def int8_matmul(a: torch.Tensor, b: torch.Tensor, kernel: ResolvedKernel = "torch") -> torch.Tensor:
    """Exact ``a [m, k] · b [n, k]ᵀ`` of int8 matrices as int32 [m, n].

    ``kernel: bitsandbytes``: bitsandbytes' ``int8_linear_matmul`` where it accumulates in integers,
    otherwise the torch path. ``torch``:
    ``torch._int_mm`` where it supports the device and shape; otherwise float64 matmul, which is
    exact here: every product is at most 127² = 16,129 in magnitude, so every partial sum is an
    integer below k · 16,129 < 2**53 and float64 represents it exactly (no rounding anywhere).
    Both paths need k <= 133,144 for the int32 result (the same bound as int32 accumulation).
    """
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise TypeError(f"int8_matmul takes int8 operands, got {a.dtype} and {b.dtype}")
    if a.shape[1] > INT32_SAFE_K:
        raise ValueError(f"int8 dot products of length {a.shape[1]} can overflow int32 (limit {INT32_SAFE_K})")
    if a.shape[0] == 0:
        return torch.zeros((0, b.shape[0]), dtype=torch.int32, device=a.device)
    if kernel == "bitsandbytes" and _bitsandbytes_is_exact(a):
        return bitsandbytes_functional().int8_linear_matmul(a.contiguous(), b.contiguous())
    if _int_mm_supports(a, b):
        return torch._int_mm(a, b.t())
    return (a.to(torch.float64) @ b.to(torch.float64).t()).to(torch.int32)


def find_outliers(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Indices (sorted, int64) of the feature columns of ``x`` [tokens, features] where any |x| >= threshold."""
    if threshold == float("inf"):
        return torch.zeros(0, dtype=torch.long, device=x.device)
    return torch.nonzero(x.abs().amax(dim=0) >= threshold).flatten()


def decomposed_matmul(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    outliers: torch.Tensor,
    outlier_weight: torch.Tensor,
    kernel: ResolvedKernel = "torch",
) -> torch.Tensor:
    """``x Wᵀ`` in float32 for ``x`` [tokens, in]: the ``outliers`` columns in float against
    ``outlier_weight`` [out, len(outliers)], every other column as per-token int8 ``x`` times the
    row-wise int8 codes ``w_q`` [out, in] with scales ``w_scale`` [out]. No outliers: plain W8A8,
    ``(x_q · w_qᵀ) · s_x · s_w``."""
    x = x.to(torch.float32)
    regular = x
    if outliers.numel():
        regular = x.clone()
        regular[:, outliers] = 0  # zeroed columns add nothing to the int8 part
    x_q, x_scale = quantize_rows_int8(regular)
    y = int8_matmul(x_q, w_q, kernel).to(torch.float32) * x_scale[:, None] * w_scale[None, :]
    if outliers.numel():
        y = y + x[:, outliers] @ outlier_weight.to(torch.float32).t()
    return y


# --------------------------------------------------------------------------- the module


class LLMInt8Linear(nn.Linear):
    """A Linear that computes with LLM.int8() decomposition.

    ``weight`` holds the record's dequantized values (what exporters and state dicts see); the
    int8 codes, row scales and the calibrated outlier columns of the original float weight are
    non-persistent buffers used by ``forward``. Computes in float32 and returns the input dtype.
    """

    def __init__(
        self,
        linear: nn.Linear,
        record: QuantizedWeight,
        threshold: float,
        outlier_index: torch.Tensor,
        outlier_weight: torch.Tensor,
        kernel: Kernel = "auto",
    ) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.weight = linear.weight  # shared Parameter: install_record has already put the dequantized values in it
        self.bias = linear.bias
        self.threshold = float(threshold)
        self.kernel = kernel  # resolved per call: the module may move between devices
        self.records_only = False  # records_only(): a plain Linear on the record's values, what exports hold
        device = linear.weight.device
        q, scale = signed_codes(record)
        self.register_buffer("weight_int8", q.to(device), persistent=False)
        self.register_buffer("weight_scale", scale.to(device), persistent=False)
        self.register_buffer("outlier_index", outlier_index.to(device=device, dtype=torch.long), persistent=False)
        self.register_buffer("outlier_weight", outlier_weight.to(device=device, dtype=torch.float16), persistent=False)

    def outlier_columns(self, outliers: torch.Tensor) -> torch.Tensor:
        """Float weight columns [out, len(outliers)]: calibrated ones from the kept fp16 original,
        the others dequantized from the int8 codes."""
        cols = self.weight_int8[:, outliers].to(torch.float32) * self.weight_scale[:, None]
        if self.outlier_index.numel() and outliers.numel():
            slot = torch.searchsorted(self.outlier_index, outliers).clamp_(max=self.outlier_index.numel() - 1)
            known = self.outlier_index[slot] == outliers
            cols[:, known] = self.outlier_weight[:, slot[known]].to(torch.float32)
        return cols

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.records_only:
            return super().forward(x)
        flat = x.reshape(-1, self.in_features).to(torch.float32)
        outliers = find_outliers(flat, self.threshold)
        y = decomposed_matmul(
            flat, self.weight_int8, self.weight_scale, outliers, self.outlier_columns(outliers), resolve_kernel(self.kernel, flat.device)
        )
        if self.bias is not None:
            y = y + self.bias.to(torch.float32)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, threshold={self.threshold}, calibrated_outliers={self.outlier_index.numel()}, kernel={self.kernel}"


@contextlib.contextmanager
def records_only(model: nn.Module) -> Iterator[None]:
    """Within the block, every LLM.int8 layer of ``model`` computes as a plain Linear on its int8
    record's values, with float activations: what an export holds of it (GGUF, compressed-tensors),
    so the exports' same-weights checks compare a runtime with the weights it was given, not with
    the int8 activations and outlier decomposition no format carries."""
    layers = [m for m in model.modules() if isinstance(m, LLMInt8Linear)]
    for layer in layers:
        layer.records_only = True
    try:
        yield
    finally:
        for layer in layers:
            layer.records_only = False


# --------------------------------------------------------------------------- calibration and the stage


def collect_input_absmax(
    model: nn.Module,
    linears: dict[str, nn.Linear],
    tokens: torch.Tensor,
    batch_size: int,
    device: torch.device,
    reporter: Reporter,
    description: str,
) -> dict[str, torch.Tensor]:
    """Per input feature, the max |x| each of ``linears`` receives over ``tokens`` [samples, seq_len]
    (float32 [in_features] per layer, on the CPU). The model runs on ``device`` in batches of
    ``batch_size`` and goes back where it was; an unselected output head is never run."""
    stats = {name: torch.zeros(m.in_features, device=device) for name, m in linears.items()}

    def hook(name: str):
        def record(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            stats[name] = torch.maximum(stats[name], x.reshape(-1, x.shape[-1]).abs().amax(dim=0).to(torch.float32))

        return record

    def stop(module: nn.Module, args: tuple[Any, ...]) -> None:
        raise StopForward

    home = next(model.parameters()).device
    was_training = model.training
    handles = [m.register_forward_pre_hook(hook(name)) for name, m in linears.items()]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and all(head is not m for m in linears.values()):
        handles.append(head.register_forward_pre_hook(stop))  # its logits are not needed: save the time and memory
    try:
        model.eval().to(device)
        with torch.no_grad():
            for start in reporter.track(range(0, tokens.shape[0], batch_size), description):
                try:
                    model(input_ids=tokens[start : start + batch_size].to(device), use_cache=False)
                except StopForward:
                    pass
    finally:
        for h in handles:
            h.remove()
        model.to(home).train(was_training)
    return {name: s.cpu() for name, s in stats.items()}


def start_int8_stage(
    model: nn.Module, cfg: Int8ChannelConfig, ctx: RunContext, label: str
) -> tuple[ResolvedKernel, list[tuple[str, nn.Linear]], list[str]]:
    """What an int8 weight-and-activation stage (llm_int8, w8a8) checks first: its GEMM (failing early when
    bitsandbytes is asked for and missing), the Linears it selects (none quantized before) and the unused
    ignore patterns; the device's peak memory counted from here."""
    kernel = resolve_kernel(cfg.kernel, ctx.device)
    chosen, unused_ignore = select_or_fail(model, cfg, label)
    already = [n for n, _ in chosen if n in ctx.quantized]
    if already:
        raise CompressError(
            f"{label}: layer {already[0]} was already quantized by {ctx.quantized_by[already[0]]}; quantize each layer once."
        )
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    return kernel, chosen, unused_ignore


class LLMInt8Stage:
    """The recipe step ``quantize: {method: llm_int8, ...}``."""

    def __init__(self, config: LLMInt8Config, label: str) -> None:
        self.config = config
        self.label = label

    def apply(self, model: nn.Module, ctx: RunContext) -> StageRecord:
        start = time.perf_counter()
        cfg, label = self.config, self.label
        scheme = cfg.scheme()
        kernel, chosen, unused_ignore = start_int8_stage(model, cfg, ctx, label)
        if cfg.needs_calibration:
            tokens = ctx.calibration()
            absmax = collect_input_absmax(
                model,
                dict(chosen),
                tokens,
                cfg.batch_size,
                ctx.device,
                ctx.reporter,
                f"{label} llm_int8 calibrating ({tokens.shape[0]} x {tokens.shape[1]} tokens)",
            )
        else:  # no feature can reach an infinite threshold: skip the pass
            tokens = torch.zeros(0, 0, dtype=torch.long)
            absmax = {name: torch.zeros(m.in_features) for name, m in chosen}
        layers: dict[str, dict[str, Any]] = {}
        indices: dict[str, list[int]] = {}
        extra_bytes = 0
        for name, module in ctx.reporter.track(chosen, f"{label} llm_int8 W8A8 threshold {cfg.threshold:g}"):
            outlier_index = torch.nonzero(absmax[name] >= cfg.threshold).flatten()
            original = module.weight.detach()
            record = quantize_weight_int8(original.to(ctx.device), scheme)
            outlier_weight = original[:, outlier_index.to(original.device)].to(torch.float16)
            info = install_record(model, name, module, record, ctx, label)
            swap_module(model, name, LLMInt8Linear(module, record, cfg.threshold, outlier_index, outlier_weight, cfg.kernel))
            info["outlier_features"] = int(outlier_index.numel())
            layers[name] = info
            extra_bytes += outlier_weight.numel() * outlier_weight.element_size()
            if 0 < outlier_index.numel() <= SHORT_INDEX_LIST:
                indices[name] = outlier_index.tolist()
        summary = summarize(layers, unused_ignore, scheme)
        per_layer = {n: layer["outlier_features"] for n, layer in layers.items()}
        summary.update(
            threshold=cfg.threshold,
            activations="int8 per-token absmax" + ("; outlier features in float" if cfg.needs_calibration else ""),
            kernel=kernel_description(kernel) + f" on {ctx.device.type}",
            calibration_tokens=int(tokens.numel()),
            peak_memory_mb=round(peak_memory_mb(ctx.device), 1),  # `compress run` prints it next to calibration_tokens
            outlier_features_total=sum(per_layer.values()),
            outlier_features_per_layer=per_layer,
            outlier_indices=indices,  # only layers with 1..SHORT_INDEX_LIST calibrated outliers
            outlier_fp16_bytes=extra_bytes,
        )
        return quantize_record(cfg, start, summary, layers)
