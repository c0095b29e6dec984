"""FP4 weights: NVFP4 and MXFP4 (``quantize: {method: fp4, format: nvfp4 | mxfp4}``; docs/fp4.md).

Both formats store each weight as a 4-bit E2M1 value (1 sign, 2 exponent, 1 mantissa bit: 0, 0.5, 1,
1.5, 2, 3, 4, 6 and their negatives) times the scale of its group of consecutive inputs of a row:

* NVFP4: groups of 16; each group scale is a float8 E4M3 value, and the tensor has one float32 global
  scale ``g``; a weight is ``e2m1 * (scale / g)``. ``g = 448 * 6 / absmax(W)`` so that the group scales
  ``absmax(group) / 6 * g`` use E4M3's whole range (llm-compressor's NVFP4 observer).
* MXFP4: groups of 32; each group scale is a power of two stored as its E8M0 biased exponent byte
  ``E`` (scale ``2 ** (E - 127)``); ``E = 127 + floor(log2(absmax(group))) - 2``, with the absmax
  first rounded up to the next power of two when its mantissa is 1.75 or more (compressed-tensors'
  ``generate_mx_scales``), clamped to 0..254; an all-zero group gets E = 0.

A weight divided by its effective scale is rounded to the nearest E2M1 value, ties to the one with an
even mantissa (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), and saturates at
±6: compressed-tensors' ``cast_to_fp4`` rule. The 4-bit code is ``sign << 3 | index`` (index 0-7 into the
value list), two codes a byte, the even column in the low nibble: compressed-tensors' ``weight_packed``
layout, which GGUF's MXFP4/NVFP4 blocks index the same way (their nibble order within a block differs;
export/gguf re-packs).

The records (``FP4Weight``: packed codes, group scales, NVFP4's global scale) live in the ``FP4Linear``
modules that replace the quantized Linears; the stage also keeps them in the artifact (``RECORDS_FILE``),
and the compressed-tensors export writes them as ``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized``
(export/checkpoint/fp4_checkpoint.py). Like FP8's they are not ``QuantizedWeight`` records (integer codes),
so they are not in ``RunContext.quantized``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any

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
from compress.quantizers.fp4_config import GROUP, SCALE_DTYPE, Activations, Format, FP4Config, FP4Scheme
from compress.quantizers.grid_search import FixedScales
from compress.quantizers.llm_int8 import collect_input_absmax

E4M3 = torch.float8_e4m3fn
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The magnitudes of E2M1, by code index (the low 3 bits of a code; bit 3 is the sign)."""
E2M1_MAX = 6.0
SIGN = 8
E8M0_BIAS = 127
E8M0_MAX = 254  # 255 is E8M0's NaN
E4M3_EPS = 0.125
"""The NVFP4 group scale of an all-zero group (compressed-tensors' eps for float8 E4M3 scales)."""
RECORDS_FILE = "fp4/records.safetensors"
"""The artifact's copy of every FP4 record (``<layer>.weight_packed``, ``<layer>.weight_scale``,
``<layer>.weight_global_scale`` for NVFP4, ``<layer>.input_global_scale`` for NVFP4 W4A4), written by the run
from ``RunContext.files``."""
INPUT_GLOBAL_SCALE = "input_global_scale"


# --------------------------------------------------------------------------- pure math


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) as 4-bit E2M1 codes (uint8 0-15): nearest value, ties to even mantissa, saturating at ±6; the sign bit is
    ``x``'s own (-0.0 and small negatives give code 8, as compressed-tensors packs them)."""
    a = x.abs()
    index = (a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0)
    return index | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """The float32 E2M1 values of ``codes`` (uint8 0-15)."""
    magnitude = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)[(codes & 7).long()]
    return torch.where((codes & SIGN) != 0, -magnitude, magnitude)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[rows, cols] codes as [rows, cols / 2] bytes, the even column in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack``."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def group_absmax(weight: torch.Tensor, group: int) -> torch.Tensor:
    """float32 [rows, cols / group] largest |w| of each group of ``group`` consecutive inputs of a row."""
    rows, cols = weight.shape
    return weight.detach().to(torch.float32).abs().reshape(rows, cols // group, group).amax(dim=2)


def nvfp4_global_scale(absmax: torch.Tensor) -> torch.Tensor:
    """float32 [1] ``448 * 6 / absmax`` of a tensor (1 where that is not finite, as compressed-tensors' ``generate_gparam``)."""
    a = absmax.to(torch.float32).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(FP8_MAX * E2M1_MAX / a, nan=1.0, posinf=1.0, neginf=1.0).reshape(1)


def nvfp4_scales(absmax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """float8 E4M3 group scales ``absmax / 6 * global_scale`` (clamped to ±448, rounded to nearest even; 0 becomes 0.125)."""
    s = ((absmax / E2M1_MAX) * global_scale).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
    return torch.where(s.to(torch.float32) == 0, torch.tensor(E4M3_EPS, device=s.device).to(E4M3), s)


def mxfp4_exponents(absmax: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 exponents of groups with largest |w| ``absmax``: ``127 + floor(log2(absmax)) - 2``, the absmax
    rounded up to a power of two first when its mantissa is at least 1.75; clamped to 0..254 (0 for a zero group)."""
    mantissa, exponent = torch.frexp(absmax.to(torch.float32))  # absmax = mantissa * 2**exponent, mantissa in [0.5, 1)
    e = (exponent - 1) + (mantissa >= 0.875).to(exponent.dtype) - 2 + E8M0_BIAS
    return torch.where(absmax > 0, e, 0).clamp(0, E8M0_MAX).to(torch.uint8)


def e8m0_to_float(exponents: torch.Tensor) -> torch.Tensor:
    """float32 ``2 ** (E - 127)`` of E8M0 bytes, exactly (E = 0 is the subnormal 2**-127)."""
    e = exponents.to(torch.int32)
    return torch.where(e == 0, torch.tensor(1 << 22, dtype=torch.int32, device=e.device), e << 23).view(torch.float32)


def effective_scales(scale: torch.Tensor, global_scale: torch.Tensor | None) -> torch.Tensor:
    """float32 group scales: ``scale / global_scale`` (nvfp4: float8 E4M3 over float32), ``2 ** (E - 127)`` (mxfp4)."""
    return e8m0_to_float(scale) if global_scale is None else scale.to(torch.float32) / global_scale


@dataclass
class FP4Weight:
    """One FP4 Linear [out, in]: ``packed`` uint8 [out, in/2] E2M1 codes; ``scale`` [out, in/group]: float8 E4M3
    (nvfp4, group 16) or uint8 E8M0 exponents (mxfp4, group 32); ``global_scale`` float32 [1] (nvfp4), else None;
    ``input_global_scale`` float32 [1]: an nvfp4 W4A4 layer's calibrated input global scale, else None."""

    format: Format
    packed: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None = None
    input_global_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        rows, cols = self.shape
        group = GROUP[self.format]
        if self.packed.dtype != torch.uint8 or self.packed.dim() != 2 or cols % group:
            raise ValueError(
                f"{self.format} codes are uint8 [out, in/2] with in a multiple of {group}, got {self.packed.dtype} {list(self.packed.shape)}"
            )
        dtype = E4M3 if self.format == "nvfp4" else torch.uint8
        if self.scale.dtype != dtype or tuple(self.scale.shape) != (rows, cols // group):
            raise ValueError(f"{self.format} scales are {dtype} {[rows, cols // group]}, got {self.scale.dtype} {list(self.scale.shape)}")
        if (self.global_scale is not None) != (self.format == "nvfp4"):
            raise ValueError("an nvfp4 record has one float32 global scale, an mxfp4 record none")
        for g in (self.global_scale, self.input_global_scale):
            if g is not None and (g.dtype != torch.float32 or g.numel() != 1):
                raise ValueError("an nvfp4 global scale is one float32 value")
        if self.input_global_scale is not None and self.format != "nvfp4":
            raise ValueError("only nvfp4 inputs have a global scale (mxfp4 inputs are scaled per group alone)")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.packed.shape[0]), 2 * int(self.packed.shape[1]))

    @property
    def group(self) -> int:
        return GROUP[self.format]

    @property
    def scheme(self) -> FP4Scheme:
        return FP4Scheme(bits=4, group_size=self.group, symmetric=True, scale_dtype=SCALE_DTYPE[self.format])

    plain = False
    """Not on a plain integer grid (exporters that read ``QuantizedWeight.plain``: its values are ``dequantize()``)."""

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> FP4Weight:
        """The record with ``fn`` (a permutation of rows) applied to the rows of its codes and scales."""
        return FP4Weight(self.format, fn(self.packed), fn(self.scale), self.global_scale, self.input_global_scale)

    def codes(self) -> torch.Tensor:
        """uint8 [out, in] 4-bit codes."""
        return unpack(self.packed)

    def group_scales(self) -> torch.Tensor:
        """float32 [out, in/group] effective scales: ``scale / global_scale`` (nvfp4), ``2 ** (E - 127)`` (mxfp4)."""
        return effective_scales(self.scale, self.global_scale)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight: each E2M1 value times its group's effective scale (compressed-tensors' order of operations)."""
        rows, cols = self.shape
        values = e2m1_values(self.codes()).reshape(rows, cols // self.group, self.group)
        return (values * self.group_scales().unsqueeze(-1)).reshape(rows, cols)

    @property
    def bits_per_weight(self) -> float:
        return 4 + 8 / self.group + (32 / (self.shape[0] * self.shape[1]) if self.global_scale is not None else 0)

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The record as named tensors (compressed-tensors' names: ``weight_packed``, ``weight_scale``,
        ``weight_global_scale``, ``input_global_scale``)."""
        out = {f"{prefix}.weight_packed": self.packed.contiguous(), f"{prefix}.weight_scale": self.scale.contiguous()}
        if self.global_scale is not None:
            out[f"{prefix}.weight_global_scale"] = self.global_scale.contiguous()
        if self.input_global_scale is not None:
            out[f"{prefix}.{INPUT_GLOBAL_SCALE}"] = self.input_global_scale.contiguous()
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str, fmt: Format) -> FP4Weight:
        return cls(
            fmt,
            tensors[f"{prefix}.weight_packed"],
            tensors[f"{prefix}.weight_scale"],
            tensors.get(f"{prefix}.weight_global_scale"),
            tensors.get(f"{prefix}.{INPUT_GLOBAL_SCALE}"),
        )

    def cpu(self) -> FP4Weight:
        g, i = (None if t is None else t.cpu() for t in (self.global_scale, self.input_global_scale))
        return FP4Weight(self.format, self.packed.cpu(), self.scale.cpu(), g, i)


def fp4_scales(x: torch.Tensor, fmt: Format, global_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The group scales (float8 E4M3 or E8M0 bytes) and the global scale (nvfp4) of ``x`` [rows, cols]: a weight's
    own global scale, or the given one (one for the weights a runtime fuses, ``SharedGlobalScales``; an input's
    calibrated ``input_global_scale``)."""
    absmax = group_absmax(x, GROUP[fmt])
    if fmt == "mxfp4":
        return mxfp4_exponents(absmax), None
    global_scale = nvfp4_global_scale(absmax.amax()) if global_scale is None else global_scale.to(absmax.device)
    return nvfp4_scales(absmax, global_scale), global_scale


def quantize_weight_fp4(x: torch.Tensor, fmt: Format, global_scale: torch.Tensor | None = None) -> FP4Weight:
    """``x`` [rows, cols] (a weight [out, in], or inputs; cols a multiple of the format's group) rounded to nearest on
    ``fmt``'s scales: the record (``global_scale``: nvfp4's, when given; see ``fp4_scales``)."""
    scale, global_scale = fp4_scales(x, fmt, global_scale)
    rows, cols = x.shape
    grouped = x.detach().to(torch.float32).reshape(rows, cols // GROUP[fmt], GROUP[fmt])
    scaled = grouped / effective_scales(scale, global_scale).unsqueeze(-1)
    return FP4Weight(fmt, pack(e2m1_codes(scaled.reshape(rows, cols))), scale, global_scale)


def quantize_input_fp4(x: torch.Tensor, fmt: Format, global_scale: torch.Tensor | None) -> torch.Tensor:
    """What a W4A4 runtime multiplies: ``x`` [tokens, in] (float32) quantize-dequantized as compressed-tensors'
    NVFP4 / MXFP4 input activations (dynamic group scales, the weights' rule; nvfp4 over the layer's calibrated
    ``global_scale``, a group scale beyond 448 clamped and its values saturated at ±6)."""
    return quantize_weight_fp4(x, fmt, global_scale).dequantize()


FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))
"""Linears of one parent that a serving runtime fuses into one GEMM, as they read the same input: vLLM's
``qkv_proj`` and ``gate_up_proj`` (Mixtral's experts: ``w13``). vLLM keeps one NVFP4 global scale for a
fused weight: it loads each shard's ``weight_global_scale`` and takes their ``.max()``
(compressed-tensors' W4A16/W4A4 FP4 schemes, ``process_weights_after_loading``), so a shard quantized
under another global scale would be dequantized with the wrong one. llm-compressor therefore gives the
shards one global scale (``update_fused_layer_weight_global_scales``), and so does this stage."""


def fused_with(name: str, names: Collection[str]) -> tuple[str, ...]:
    """``name`` and the layers of ``names`` a runtime fuses with it (``FUSED_SIBLINGS`` under the same parent), in order."""
    parent, _, leaf = name.rpartition(".")
    for siblings in FUSED_SIBLINGS:
        if leaf in siblings:
            return tuple(n for n in (f"{parent}.{s}" if parent else s for s in siblings) if n in names)
    return (name,)


class SharedGlobalScales:
    """NVFP4's global scale of each layer of ``names``: one for each set of layers a runtime fuses
    (``fused_with``), ``448 * 6 / `` the largest |w| over the set (the smallest of the members' own, as
    llm-compressor fuses them), read from the members' weights the first time one of the set is asked for
    (before any of them is quantized: the stage asks in order). None for mxfp4 (no global scale)."""

    def __init__(self, model: nn.Module, names: Collection[str], fmt: Format) -> None:
        self.model, self.names, self.format = model, set(names), fmt
        self.found: dict[tuple[str, ...], torch.Tensor] = {}

    def __call__(self, name: str) -> torch.Tensor | None:
        if self.format != "nvfp4":
            return None
        fused = fused_with(name, self.names)
        if len(fused) == 1:
            return None  # the layer's own (fp4_scales)
        if fused not in self.found:
            weights = [self.model.get_submodule(n).weight.detach() for n in fused]
            self.found[fused] = nvfp4_global_scale(torch.stack([w.to(torch.float32).abs().amax() for w in weights]).amax())
        return self.found[fused].clone()  # each record its own tensor (safetensors refuses shared memory)


# --------------------------------------------------------------------------- the module


class FP4Linear(nn.Linear):
    """A Linear that computes with its FP4 record: float32 inputs (W4A4, ``activations: dynamic``: quantize-dequantized
    by ``quantize_input_fp4``) times the record's dequantized weight, the bias added in float32. ``weight`` holds the
    dequantized values at the model's dtype (what state dicts and model/ see); the packed codes and scales are
    non-persistent buffers. Returns the input dtype."""

    def __init__(self, linear: nn.Linear, record: FP4Weight, activations: Activations = None) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.format = record.format
        self.activations: Activations = None
        device = linear.weight.device
        self.weight = nn.Parameter(record.dequantize().to(device=device, dtype=linear.weight.dtype), requires_grad=False)
        self.bias = linear.bias
        self.register_buffer("weight_packed", record.packed.to(device), persistent=False)
        self.register_buffer("weight_scale", record.scale.to(device), persistent=False)
        global_scale = torch.ones(1) if record.global_scale is None else record.global_scale
        self.register_buffer("weight_global_scale", global_scale.to(device), persistent=False)
        self.register_buffer(INPUT_GLOBAL_SCALE, torch.ones(1, device=device), persistent=False)
        if activations is not None:
            self.quantize_inputs(record.input_global_scale)

    @property
    def record(self) -> FP4Weight:
        nvfp4 = self.format == "nvfp4"
        g = self.weight_global_scale if nvfp4 else None
        return FP4Weight(
            self.format, self.weight_packed, self.weight_scale, g, self.input_global_scale if nvfp4 and self.activations else None
        )

    def quantize_inputs(self, input_global_scale: torch.Tensor | None) -> None:
        """Make the layer W4A4 (``activations: dynamic``), with nvfp4's calibrated ``input_global_scale``."""
        if (input_global_scale is None) != (self.format == "mxfp4"):
            raise ValueError("an nvfp4 W4A4 layer needs its calibrated input global scale, an mxfp4 one has none")
        if input_global_scale is not None:
            self.input_global_scale = input_global_scale.to(torch.float32).reshape(1).to(self.weight_packed.device)
        self.activations = "dynamic"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.float32)
        if self.activations is not None:
            flat = quantize_input_fp4(flat, self.format, self.input_global_scale if self.format == "nvfp4" else None)
        # a float32 model's weight is the record's dequantized weight itself
        weight = self.weight if self.weight.dtype == torch.float32 else self.record.dequantize()
        y = flat @ weight.t()
        if self.bias is not None:
            y = y + self.bias.to(torch.float32)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, format={self.format}, activations={self.activations}"


def fp4_records(model: nn.Module) -> dict[str, FP4Weight]:
    """The FP4 records of ``model``'s FP4Linear layers, by module name (on the CPU)."""
    return {name: m.record.cpu() for name, m in model.named_modules() if isinstance(m, FP4Linear)}


def fp4_activations(model: nn.Module) -> Activations:
    """How ``model``'s FP4 layers quantize their inputs (one stage sets them all)."""
    return layers_activations(model, FP4Linear)


def load_fp4_layers(model: nn.Module, tensors: dict[str, torch.Tensor], stages: list[dict[str, Any]]) -> list[str]:
    """Make the layers of an artifact's RECORDS_FILE ``tensors`` FP4Linear layers of ``model`` again, with
    the format of the manifest's stage that wrote it; returns their names."""
    cfg = records_stage_config(stages, RECORDS_FILE, FP4Config)
    names = sorted(k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed"))
    for name in names:
        layer = model.get_submodule(name)
        record = FP4Weight.from_tensors(tensors, name, cfg.format)
        if not isinstance(layer, nn.Linear) or tuple(layer.weight.shape) != record.shape:
            raise ValueError(f"{name} is no Linear of the record's shape")
        swap_module(model, name, FP4Linear(layer, record, cfg.activations))
    return names


# --------------------------------------------------------------------------- GPTQ on the FP4 grid


def e2m1_nearest_numpy(x: np.ndarray) -> np.ndarray:
    """NumPy's ``e2m1_values(e2m1_codes(x))``: the nearest E2M1 value with ``x``'s sign (GPTQ's column loop on the CPU)."""
    a = np.abs(x)
    index = (a > 0.25).astype(np.intp) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0)
    return np.copysign(E2M1_NUMPY[index], x)


E2M1_NUMPY = np.array(E2M1_VALUES, dtype=np.float32)


class FP4Grid(FixedScales):
    """The FP4 grid of one weight for quantizers/gptq.py's column loop, its scales fixed from the original
    weight before any column is rounded (GPTQ's static groups; ``FixedScales``: the effective scales per group of
    the format's size), value rounding (``nearest``, ``nearest_numpy``) and the record of the rounded values (``record``)."""

    def __init__(self, weight: torch.Tensor, fmt: Format, global_scale: torch.Tensor | None = None) -> None:
        self.format = fmt
        self.stored, self.global_scale = fp4_scales(weight, fmt, global_scale)
        super().__init__(effective_scales(self.stored, self.global_scale), GROUP[fmt])
        self.scheme = FP4Config(format=fmt).scheme()

    @staticmethod
    def nearest(x: torch.Tensor) -> torch.Tensor:
        return e2m1_values(e2m1_codes(x))

    nearest_numpy = staticmethod(e2m1_nearest_numpy)

    def record(self, values: torch.Tensor) -> FP4Weight:
        """The record of ``values`` [out, in], E2M1 values (what the column loop kept of each weight / scale)."""
        return FP4Weight(
            self.format, pack(e2m1_codes(values.cpu())), self.stored.cpu(), None if self.global_scale is None else self.global_scale.cpu()
        )


# --------------------------------------------------------------------------- the stage


def install_fp4(model: nn.Module, name: str, module: nn.Linear, record: FP4Weight, ctx: RunContext, label: str) -> dict[str, Any]:
    """Replace Linear ``name`` with an FP4Linear of ``record`` (a new Parameter: a tied weight is untied); its summary."""
    return install_module(model, name, module, FP4Linear(module, record), record.dequantize(), record.bits_per_weight, ctx, label)


def _fp4_gptq_stage() -> type:
    """GPTQ's layer-wise stage with each layer rounded on the FP4 grid and installed as an FP4Linear."""
    from compress.quantizers.gptq import GPTQStage

    class FP4GPTQStage(GPTQStage):
        def __init__(self, config: FP4Config, label: str, global_scales: SharedGlobalScales) -> None:
            super().__init__(config, label)
            self.global_scales = global_scales

        def quantize_layer(
            self, model: nn.Module, ctx: RunContext, name: str, module: nn.Linear, box: list[torch.Tensor], scheme: Any
        ) -> dict[str, Any]:
            grid = FP4Grid(module.weight.detach().to(torch.float32), self.config.format, self.global_scales(name))
            record, info = self.solve(module.weight, box, scheme, grid)
            return {**install_fp4(model, name, module, record, ctx, self.label), **{k: round(v, 6) for k, v in info.items()}}

    return FP4GPTQStage


def _fp4_awq_stage(fmt: Format, global_scales: SharedGlobalScales) -> Any:
    """AWQ's layer-wise stage (its scale search and folding, quantizers/awq.py) with FP4 rounding in the search and
    each layer installed as an FP4Linear, under the global scale it shares with the layers a runtime fuses with it
    (read from their scaled weights: a block's scales are all folded before its first layer is installed; the search
    rounds each candidate under its own)."""
    from compress.quantizers.awq import AWQStage

    class FP4AWQStage(AWQStage):
        def round_trip(self, weight: torch.Tensor, scheme: Any) -> torch.Tensor:
            return quantize_weight_fp4(weight, fmt).dequantize()

        def install(
            self, model: nn.Module, name: str, module: nn.Linear, weight: torch.Tensor, scheme: Any, ctx: RunContext
        ) -> dict[str, Any]:
            return install_fp4(model, name, module, quantize_weight_fp4(weight, fmt, global_scales(name)).cpu(), ctx, self.label)

    return FP4AWQStage


class FP4Stage:
    """The recipe step ``quantize: {method: fp4, ...}``."""

    def __init__(self, config: FP4Config, label: str) -> None:
        self.config = config
        self.label = label

    def apply(self, model: nn.Module, ctx: RunContext) -> StageRecord:
        start = time.perf_counter()
        cfg, label = self.config, self.label
        chosen, unused_ignore = select_or_fail(model, cfg, label)
        already = [n for n, m in chosen if n in ctx.quantized or isinstance(m, FP4Linear)]
        if already:
            raise CompressError(f"{label}: layer {already[0]} is already quantized; quantize each layer once.")
        ragged = [n for n, m in chosen if m.in_features % GROUP[cfg.format]]
        if ragged:
            raise CompressError(
                f"{label}: {cfg.format} scales groups of {GROUP[cfg.format]} inputs, and layer {ragged[0]} has "
                f"{model.get_submodule(ragged[0]).in_features}; add it to `ignore`"
            )
        global_scales = SharedGlobalScales(model, [n for n, _ in chosen], cfg.format)
        if cfg.uses_gptq:
            stage = _fp4_gptq_stage()(cfg, label, global_scales)
            record = replace(stage.apply(model, ctx), method=cfg.method)  # run_layerwise names it gptq
        elif cfg.algorithm == "awq":
            record = replace(_fp4_awq_stage(cfg.format, global_scales)(cfg.awq(), label).apply(model, ctx), method=cfg.method)
        else:
            record = self._rtn(model, ctx, chosen, unused_ignore, start, global_scales)
        if cfg.activations is not None:
            self._quantize_inputs(model, ctx, record)
        ctx.files[RECORDS_FILE] = {
            k: t for name, r in fp4_records(model).items() if name in record.layers for k, t in r.tensors(name).items()
        }
        record.summary.update(
            scheme=cfg.scheme().model_dump(mode="json"),
            weights={
                "nvfp4": "E2M1, float8 E4M3 scale per 16 weights, float32 global scale per tensor (one for the layers a "
                "runtime fuses: q/k/v, gate/up)",
                "mxfp4": "E2M1, E8M0 (power-of-two) scale per 32 weights",
            }[cfg.format],
            activations={
                None: "float (weight-only FP4)",
                "dynamic": {
                    "nvfp4": "E2M1 per 16 inputs, float8 E4M3 scale per group at run time, calibrated float32 global scale per layer",
                    "mxfp4": "E2M1 per 32 inputs, E8M0 scale per group at run time",
                }[cfg.format],
            }[cfg.activations],
            records_file=RECORDS_FILE,
        )
        return record

    def _quantize_inputs(self, model: nn.Module, ctx: RunContext, record: StageRecord) -> None:
        """W4A4: the stage's layers quantize their inputs; nvfp4 first calibrates each layer's input global scale,
        ``448 * 6 / max|x|`` over data.calibration's tokens as the model with FP4 weights and float inputs computes them
        (llm-compressor's NVFP4 ``static_minmax`` observer and ``generate_gparam``)."""
        layers = {name: model.get_submodule(name) for name in record.layers}
        if not self.config.calibrates_inputs:
            for layer in layers.values():
                layer.quantize_inputs(None)
            return
        tokens = ctx.calibration()
        absmax = collect_input_absmax(
            model,
            layers,
            tokens,
            self.config.batch_size,
            ctx.device,
            ctx.reporter,
            f"{self.label} fp4 calibrating input global scales ({tokens.shape[0]} x {tokens.shape[1]} tokens)",
        )
        for name, a in absmax.items():
            layers[name].quantize_inputs(nvfp4_global_scale(a.max()))
            record.layers[name]["input_global_scale"] = float(layers[name].input_global_scale)
        record.summary["input_calibration_tokens"] = int(tokens.numel())

    def _rtn(
        self,
        model: nn.Module,
        ctx: RunContext,
        chosen: list[tuple[str, nn.Linear]],
        unused_ignore: list[str],
        start: float,
        global_scales: SharedGlobalScales,
    ) -> StageRecord:
        cfg, label = self.config, self.label
        layers: dict[str, dict] = {}
        for name, module in ctx.reporter.track(chosen, f"{label} fp4 {cfg.describe_scheme()}"):
            record = quantize_weight_fp4(module.weight.detach().to(ctx.device), cfg.format, global_scales(name)).cpu()
            layers[name] = install_fp4(model, name, module, record, ctx, label)
        return quantize_record(cfg, start, summarize(layers, unused_ignore, None), layers)
