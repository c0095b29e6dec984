"""FP8 (E4M3) W8A8: float8 weights with float32 scales, and float8 inputs scaled per token (dynamic) or
per layer (static), the format vLLM and TensorRT-LLM run on Hopper-class GPUs (docs/fp8.md).

Weights: ``channel``, one scale per output row; ``block``, one per 128 x 128 tile (DeepSeek-V3's
layout, which vLLM loads as ``strategy: block``; tiles at a ragged edge are smaller). Each scale is
the absmax of its weights / 448 (the largest finite E4M3 value), at least ``MIN_SCALE``; the weight
divided by its scale is clamped to ±448 and cast with ``tensor.to(torch.float8_e4m3fn)``, which rounds
to nearest, ties to even.

A quantized Linear computes what vLLM's FP8 GEMM computes, up to the order of the float32 sums: the
input quantized to E4M3 with its scale (``dynamic``: absmax / 448 of each token's row, or of each
group of 128 inputs of a token under block weights, as vLLM's block kernel; ``static``: the calibrated
per-layer scale; ``null``: float inputs), the weight in E4M3 with its scale, the matmul in float32 of
the dequantized values, the bias added in float32.

The records (``FP8Weight``: the float8 weight, its scales, the static input scale) live in the
``FP8Linear`` modules that replace the quantized Linears; the stage also keeps them in the
artifact (``RECORDS_FILE``), and the compressed-tensors export writes them as ``float-quantized``
(export/checkpoint/fp8_checkpoint.py). They are not ``QuantizedWeight`` records (integer codes on a
group grid), so they are not in ``RunContext.quantized``; docs/fp8.md says what that leaves out.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from compress.context import RunContext, StageRecord
from compress.errors import CompressError
from compress.quantizers.apply import (
    install_module,
    layers_activations,
    quantize_record,
    records_stage_config,
    select_or_fail,
    summarize,
    swap_module,
)
from compress.quantizers.core import FP8_MAX
from compress.quantizers.fp8_config import BLOCK, FP8Config
from compress.quantizers.grid_search import FixedScales
from compress.quantizers.llm_int8 import collect_input_absmax
from compress.quantizers.sequential import peak_memory_mb

E4M3 = torch.float8_e4m3fn
MIN_SCALE = 1.0 / (FP8_MAX * 512)
"""The smallest scale (vLLM's ``min_scaling_factor`` for dynamic per-token scales): an all-zero row or
tile gets it, and its values stay 0."""
RECORDS_FILE = "fp8/records.safetensors"
"""The artifact's copy of every FP8 record (``<layer>.weight`` float8, ``<layer>.weight_scale``,
``<layer>.input_scale`` for static activations), written by the run from ``RunContext.files``."""

Layout = Literal["channel", "block"]
Activations = Literal["dynamic", "static"] | None


# --------------------------------------------------------------------------- pure math


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) as float8 E4M3: clamped to ±448, then rounded to nearest even by the cast."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(E4M3)


def absmax_scale(absmax: torch.Tensor) -> torch.Tensor:
    """float32 scales ``absmax / 448``, at least MIN_SCALE."""
    return (absmax.to(torch.float32) / FP8_MAX).clamp(min=MIN_SCALE)


def blocks(rows: int, cols: int) -> tuple[int, int]:
    """The block-scale grid of a [rows, cols] weight: ceil(rows/128) x ceil(cols/128) tiles."""
    return math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)


def expand_scale(scale: torch.Tensor, shape: tuple[int, int], layout: Layout) -> torch.Tensor:
    """A [rows, 1] (channel) or [ceil(rows/128), ceil(cols/128)] (block) scale spread over ``shape``."""
    rows, cols = shape
    if layout == "channel":
        return scale.expand(rows, cols)
    return scale.repeat_interleave(BLOCK, dim=0)[:rows].repeat_interleave(BLOCK, dim=1)[:, :cols]


def weight_scales(weight: torch.Tensor, layout: Layout) -> torch.Tensor:
    """float32 scales of ``weight`` [out, in]: [out, 1] per row (channel) or [ceil(out/128), ceil(in/128)] per tile (block)."""
    w = weight.detach().to(torch.float32).abs()
    if layout == "channel":
        return absmax_scale(w.amax(dim=1, keepdim=True))
    rows, cols = w.shape
    br, bc = blocks(rows, cols)
    padded = nn.functional.pad(w, (0, bc * BLOCK - cols, 0, br * BLOCK - rows))  # zeros change no absmax
    return absmax_scale(padded.reshape(br, BLOCK, bc, BLOCK).amax(dim=(1, 3)))


@dataclass
class FP8Weight:
    """One FP8 Linear: ``weight`` float8_e4m3fn [out, in]; ``scale`` float32 [out, 1] (channel) or
    [ceil(out/128), ceil(in/128)] (block); ``input_scale`` float32 [1] for static activations, else None."""

    weight: torch.Tensor
    scale: torch.Tensor
    layout: Layout
    input_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        rows, cols = self.shape
        if self.weight.dtype != E4M3 or self.weight.dim() != 2:
            raise ValueError(f"an FP8 weight is a 2-D float8_e4m3fn tensor, got {self.weight.dtype} {tuple(self.weight.shape)}")
        expect = (rows, 1) if self.layout == "channel" else blocks(rows, cols)
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != expect:
            raise ValueError(f"{self.layout} FP8 weight scales are float32 {list(expect)}, got {self.scale.dtype} {list(self.scale.shape)}")
        if self.input_scale is not None and (self.input_scale.dtype != torch.float32 or self.input_scale.numel() != 1):
            raise ValueError("an FP8 input scale is one float32 value")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.weight.shape[0]), int(self.weight.shape[1]))

    def dequantize(self) -> torch.Tensor:
        """The float32 weight: each E4M3 value times its scale."""
        return self.weight.to(torch.float32) * expand_scale(self.scale, self.shape, self.layout)

    @property
    def bits_per_weight(self) -> float:
        return 8 + 32 * self.scale.numel() / self.weight.numel()

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The record as named tensors (compressed-tensors' names: ``weight``, ``weight_scale``, ``input_scale``)."""
        out = {f"{prefix}.weight": self.weight.contiguous(), f"{prefix}.weight_scale": self.scale.contiguous()}
        if self.input_scale is not None:
            out[f"{prefix}.input_scale"] = self.input_scale.contiguous()
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str, layout: Layout) -> FP8Weight:
        return cls(tensors[f"{prefix}.weight"], tensors[f"{prefix}.weight_scale"], layout, tensors.get(f"{prefix}.input_scale"))

    def cpu(self) -> FP8Weight:
        return FP8Weight(self.weight.cpu(), self.scale.cpu(), self.layout, None if self.input_scale is None else self.input_scale.cpu())


def quantize_weight_fp8(weight: torch.Tensor, layout: Layout, input_scale: torch.Tensor | None = None) -> FP8Weight:
    """``weight`` [out, in] as an FP8Weight on ``layout``'s scales (and the static ``input_scale``, if any)."""
    scale = weight_scales(weight, layout)
    q = to_e4m3(weight.detach().to(torch.float32) / expand_scale(scale, tuple(weight.shape), layout))
    return FP8Weight(q, scale, layout, input_scale)


def quantize_input(x: torch.Tensor, activations: Activations, layout: Layout, input_scale: torch.Tensor | None) -> torch.Tensor:
    """What the runtime multiplies: ``x`` [tokens, in] (float32) as E4M3 values times their scales (float32).
    dynamic: per token (channel weights) or per token and group of 128 inputs (block weights); static:
    the layer's ``input_scale``; None: ``x`` unchanged."""
    if activations is None:
        return x
    if activations == "static":
        assert input_scale is not None, "static FP8 activations need the layer's input scale"
        return to_e4m3(x / input_scale).to(torch.float32) * input_scale
    tokens, width = x.shape
    group = width if layout == "channel" else BLOCK
    n = math.ceil(width / group)
    padded = nn.functional.pad(x, (0, n * group - width)).reshape(tokens, n, group)
    scale = absmax_scale(padded.abs().amax(dim=2, keepdim=True))
    return (to_e4m3(padded / scale).to(torch.float32) * scale).reshape(tokens, n * group)[:, :width]


def fp8_linear(
    x: torch.Tensor, record: FP8Weight, activations: Activations, bias: torch.Tensor | None, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """``y = x Wᵀ + b`` as the FP8 runtime computes it (float32 [tokens, out]) for ``x`` [tokens, in];
    ``weight``: ``record.dequantize()`` when the caller holds it already."""
    weight = record.dequantize() if weight is None else weight
    y = quantize_input(x.to(torch.float32), activations, record.layout, record.input_scale) @ weight.t()
    return y if bias is None else y + bias.to(torch.float32)


# --------------------------------------------------------------------------- the module


class FP8Linear(nn.Linear):
    """A Linear that computes with its FP8 record (``fp8_linear``). ``weight`` holds the record's
    dequantized values at the model's dtype (what state dicts and model/ see); the float8 weight and
    the scales are non-persistent buffers. Computes in float32 and returns the input dtype."""

    def __init__(self, linear: nn.Linear, record: FP8Weight, activations: Activations) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.layout = record.layout
        device = linear.weight.device
        self.weight = nn.Parameter(record.dequantize().to(device=device, dtype=linear.weight.dtype), requires_grad=False)
        self.bias = linear.bias
        self.activations = activations
        self.register_buffer("weight_fp8", record.weight.to(device), persistent=False)
        self.register_buffer("weight_scale", record.scale.to(device), persistent=False)
        input_scale = torch.ones(1) if record.input_scale is None else record.input_scale
        self.register_buffer("input_scale", input_scale.to(device), persistent=False)

    @property
    def record(self) -> FP8Weight:
        return FP8Weight(self.weight_fp8, self.weight_scale, self.layout, self.input_scale if self.activations == "static" else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        # a float32 model's weight is the record's dequantized weight itself (the same product, not rounded again)
        held = self.weight if self.weight.dtype == torch.float32 else None
        y = fp8_linear(flat, self.record, self.activations, self.bias, held)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, weights={self.record.layout}, activations={self.activations}"


def fp8_records(model: nn.Module) -> dict[str, FP8Weight]:
    """The FP8 records of ``model``'s FP8Linear layers, by module name (on the CPU)."""
    return {name: m.record.cpu() for name, m in model.named_modules() if isinstance(m, FP8Linear)}


def load_fp8_layers(model: nn.Module, tensors: dict[str, torch.Tensor], stages: list[dict[str, Any]]) -> list[str]:
    """Make the layers of an artifact's RECORDS_FILE ``tensors`` FP8Linear layers of ``model`` again, with
    the weights layout and activations of the manifest's stage that wrote it; returns their names."""
    cfg = records_stage_config(stages, RECORDS_FILE, FP8Config)
    names = sorted(k.removesuffix(".weight_scale") for k in tensors if k.endswith(".weight_scale"))
    for name in names:
        layer = model.get_submodule(name)
        if not isinstance(layer, nn.Linear) or tuple(layer.weight.shape) != tuple(tensors[f"{name}.weight"].shape):
            raise ValueError(f"{name} is no Linear of the record's shape")
        swap_module(model, name, FP8Linear(layer, FP8Weight.from_tensors(tensors, name, cfg.weights), cfg.activations))
    return names


def fp8_activations(model: nn.Module) -> Activations:
    """How ``model``'s FP8 layers quantize their inputs (one stage sets them all)."""
    return layers_activations(model, FP8Linear)


# --------------------------------------------------------------------------- GPTQ on the E4M3 grid


def e4m3_nearest_numpy(x: np.ndarray) -> np.ndarray:
    """NumPy's ``to_e4m3(x).to(torch.float32)`` (GPTQ's column loop on the CPU): clamped to ±448, then the
    nearest E4M3 value, ties to even. A value of magnitude in [2^k, 2^(k+1)) has the step 2^(k-3) (3
    mantissa bits), subnormals (below 2^-6) the step 2^-9."""
    a = np.minimum(np.abs(x), np.float32(FP8_MAX))
    _, exponent = np.frexp(a)  # a = m 2^exponent, m in [0.5, 1): a's binade is 2^(exponent - 1)
    step = np.ldexp(np.float32(1), np.maximum(exponent - 1, -6) - 3).astype(np.float32)
    return np.copysign(np.minimum(np.round(a / step) * step, np.float32(FP8_MAX)), x).astype(np.float32)


class FP8Grid(FixedScales):
    """The E4M3 grid of one weight for quantizers/gptq.py's column loop, its scales fixed from the original
    weight before any column is rounded (``FixedScales``: one scale a row, or per row and 128-column tile), value
    rounding (``nearest``, ``nearest_numpy``) and the record of the rounded values (``record``)."""

    def __init__(self, weight: torch.Tensor, config: FP8Config, input_scale: torch.Tensor | None) -> None:
        self.layout: Layout = config.weights
        self.input_scale = input_scale
        rows, cols = weight.shape
        self.stored = weight_scales(weight, self.layout)
        if self.layout == "channel":
            super().__init__(self.stored, cols)
        else:
            super().__init__(self.stored.repeat_interleave(BLOCK, dim=0)[:rows], BLOCK)
        self.scheme = config.scheme()

    @staticmethod
    def nearest(x: torch.Tensor) -> torch.Tensor:
        return to_e4m3(x).to(torch.float32)

    nearest_numpy = staticmethod(e4m3_nearest_numpy)

    def for_scheme(self, scheme: Any) -> Any:
        """The scheme GPTQ's column loop groups columns by: one group a row (channel) or a 128-column tile (block)."""
        return scheme if self.layout == "channel" else scheme.model_copy(update={"group_size": BLOCK})

    def record(self, values: torch.Tensor) -> FP8Weight:
        """The record of ``values`` [out, in], E4M3 values (what the column loop kept of each weight / scale)."""
        return FP8Weight(to_e4m3(values.cpu()), self.stored.cpu(), self.layout, self.input_scale)


def install_fp8(
    model: nn.Module, name: str, module: nn.Linear, record: FP8Weight, activations: Activations, ctx: RunContext, label: str
) -> dict[str, Any]:
    """Replace Linear ``name`` with an FP8Linear of ``record``; its summary."""
    info = install_module(
        model, name, module, FP8Linear(module, record, activations), record.dequantize(), record.bits_per_weight, ctx, label
    )
    return {**info, **({"input_scale": float(record.input_scale)} if record.input_scale is not None else {})}


def _fp8_gptq_stage() -> type:
    """GPTQ's layer-wise stage with each layer rounded on the E4M3 grid and installed as an FP8Linear."""
    from compress.quantizers.gptq import GPTQStage

    class FP8GPTQStage(GPTQStage):
        def __init__(self, config: FP8Config, label: str, input_scales: dict[str, torch.Tensor]) -> None:
            super().__init__(config, label)
            self.input_scales = input_scales

        def quantize_layer(
            self, model: nn.Module, ctx: RunContext, name: str, module: nn.Linear, box: list[torch.Tensor], scheme: Any
        ) -> dict[str, Any]:
            grid = FP8Grid(module.weight.detach().to(torch.float32), self.config, self.input_scales.get(name))
            record, info = self.solve(module.weight, box, grid.for_scheme(scheme), grid)
            record = record.cpu()
            installed = install_fp8(model, name, module, record, self.config.activations, ctx, self.label)
            return {**installed, **{k: round(v, 6) for k, v in info.items()}}

    return FP8GPTQStage


# --------------------------------------------------------------------------- the stage


class FP8Stage:
    """The recipe step ``quantize: {method: fp8, ...}``."""

    def __init__(self, config: FP8Config, label: str) -> None:
        self.config = config
        self.label = label

    def _input_scales(self, model: nn.Module, chosen: list[tuple[str, nn.Linear]], ctx: RunContext) -> tuple[dict[str, torch.Tensor], int]:
        """Static activations: each layer's input scale, the largest absmax / 448 over the calibration tokens."""
        if self.config.activations != "static":
            return {}, 0
        tokens = ctx.calibration()
        absmax = collect_input_absmax(
            model,
            dict(chosen),
            tokens,
            self.config.batch_size,
            ctx.device,
            ctx.reporter,
            f"{self.label} fp8 calibrating input scales ({tokens.shape[0]} x {tokens.shape[1]} tokens)",
        )
        return {name: absmax_scale(a.max()).reshape(1) for name, a in absmax.items()}, int(tokens.numel())

    def apply(self, model: nn.Module, ctx: RunContext) -> StageRecord:
        start = time.perf_counter()
        cfg, label = self.config, self.label
        chosen, unused_ignore = select_or_fail(model, cfg, label)
        already = [n for n, m in chosen if n in ctx.quantized or isinstance(m, FP8Linear)]
        if already:
            raise CompressError(f"{label}: layer {already[0]} is already quantized; quantize each layer once.")
        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)
        input_scales, cal_tokens = self._input_scales(model, chosen, ctx)  # from the float model, before any rounding
        if cfg.uses_gptq:
            record = replace(
                _fp8_gptq_stage()(cfg, label, input_scales).apply(model, ctx), method=cfg.method
            )  # run_layerwise names it gptq
        else:
            layers: dict[str, dict] = {}
            for name, module in ctx.reporter.track(chosen, f"{label} fp8 {cfg.describe_scheme()}"):
                weight = quantize_weight_fp8(module.weight.detach().to(ctx.device), cfg.weights, input_scales.get(name)).cpu()
                layers[name] = install_fp8(model, name, module, weight, cfg.activations, ctx, label)
            record = quantize_record(cfg, start, summarize(layers, unused_ignore, None), layers)
        fp8 = fp8_records(model)
        ctx.files[RECORDS_FILE] = {k: t for name, r in fp8.items() if name in record.layers for k, t in r.tensors(name).items()}
        record.summary.update(
            scheme=cfg.scheme().model_dump(mode="json"),
            weights=f"float8 E4M3, float32 scale per {'output row' if cfg.weights == 'channel' else '128x128 tile'}",
            activations={
                "dynamic": "float8 E4M3, scale per token" + ("" if cfg.weights == "channel" else " and group of 128 inputs"),
                "static": "float8 E4M3, one calibrated float32 scale per layer",
                None: "float (weight-only FP8)",
            }[cfg.activations],
            records_file=RECORDS_FILE,
        )
        if cfg.activations == "static":
            record.summary.update(calibration_tokens=cal_tokens, peak_memory_mb=round(peak_memory_mb(ctx.device), 1))
        return record
