"""The storage side of KV-cache quantization: packing, quantize/dequantize of cache blocks, and
the transformers Cache that holds them (imports transformers; the recipe side is in kv_cache.py).

See :mod:`compress.quantizers.kv_cache` for the layout (KIVI) and the formats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from compress.errors import CompressError
from compress.quantizers.core import FP8_MAX
from compress.quantizers.kv_cache_config import KVCacheConfig

SCALE_DTYPE = torch.float16


# --------------------------------------------------------------------------- pure math


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes < 2**bits along the last dim, 8 // bits to a byte (element i at bits i·b)."""
    per = 8 // bits
    if per == 1:
        return codes.to(torch.uint8)
    n = codes.shape[-1]
    pad = (-n) % per
    c = torch.nn.functional.pad(codes.to(torch.uint8), (0, pad)).reshape(*codes.shape[:-1], -1, per)
    out = torch.zeros(c.shape[:-1], dtype=torch.uint8, device=codes.device)
    for i in range(per):
        out |= c[..., i] << (i * bits)
    return out


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes` for ``n`` codes along the last dim."""
    per = 8 // bits
    if per == 1:
        return packed
    mask = (1 << bits) - 1
    parts = [(packed >> (i * bits)) & mask for i in range(per)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], -1)[..., :n]


@dataclass
class QuantizedBlock:
    """Quantized keys or values of one layer, tokens [..., T, head_dim] in grouped layout.

    ``dim`` -1: groups of ``group`` channels of each token — ``data`` [B, H, T, D/group, packed],
    ``scale``/``low`` [B, H, T, D/group, 1]. ``dim`` -2: one group per channel over each block of
    ``group`` tokens — ``data`` [B, H, D, T packed], ``scale``/``low`` [B, H, D, T/group].
    Blocks of the same layer are concatenated along the token axis by :meth:`extend`.
    """

    data: torch.Tensor  # packed uint8 codes or float8 values
    scale: torch.Tensor | None  # fp16, None when the scale is static
    low: torch.Tensor | None  # fp16 minimum (asymmetric int) or None
    tokens: int
    dim: int
    group: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.low) if t is not None)

    def extend(self, other: QuantizedBlock) -> None:
        """Append ``other`` (later tokens, same layout) in place."""
        axis = 2 if self.dim == -1 else -1
        self.data = torch.cat([self.data, other.data], dim=axis)
        if self.scale is not None:
            self.scale = torch.cat([self.scale, other.scale], dim=axis)
        if self.low is not None:
            self.low = torch.cat([self.low, other.low], dim=axis)
        self.tokens += other.tokens


def _grouped(x: torch.Tensor, dim: int, group: int) -> torch.Tensor:
    """x [B, H, T, D] with each group on the last axis: dim -1 → [B, H, T, D/g, g]; dim -2 → [B, H, D, T/g, g]."""
    b, h, t, d = x.shape
    if dim == -2:
        return x.transpose(-1, -2).reshape(b, h, d, t // group, group)
    return x.reshape(b, h, t, d // group, group)


def quantize_block(x: torch.Tensor, cfg: KVCacheConfig, dim: int, static_scale: torch.Tensor | None = None) -> QuantizedBlock:
    """Quantize ``x`` [batch, heads, tokens, head_dim]; ``static_scale`` [heads] replaces per-group scales.
    Per-channel groups (dim -2) take all of ``x``'s tokens as one block."""
    group = x.shape[-2] if dim == -2 else (cfg.group_size or x.shape[-1])
    if dim == -1 and x.shape[-1] % group:
        raise CompressError(f"kv_cache.group_size {group} does not divide head_dim {x.shape[-1]}")
    g = _grouped(x.float(), dim, group)
    low_store = None
    if static_scale is not None:
        s = static_scale.float().to(x.device).view(1, -1, 1, 1, 1)
        scale_store = None
    elif cfg.is_symmetric:
        qmax = FP8_MAX if cfg.format == "fp8" else 2 ** (cfg.bits - 1) - 1
        scale_store = (g.abs().amax(dim=-1, keepdim=True) / qmax).clamp(min=1e-8).to(SCALE_DTYPE)
        s = scale_store.float()
    else:
        lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
        scale_store = ((hi - lo) / (2**cfg.bits - 1)).clamp(min=1e-8).to(SCALE_DTYPE)
        low_store = lo.to(SCALE_DTYPE)
        s = scale_store.float()
    if cfg.format == "fp8":
        data = (g / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    elif low_store is not None:
        data = pack_codes(torch.round((g - low_store.float()) / s).clamp(0, 2**cfg.bits - 1).to(torch.uint8), cfg.bits)
    else:
        half = 2 ** (cfg.bits - 1)
        data = pack_codes((torch.round(g / s).clamp(-(half - 1), half - 1) + half).to(torch.uint8), cfg.bits)
    if dim == -2:  # one block: [B, H, D, 1, packed] -> [B, H, D, packed]; scales [B, H, D, 1]
        data = data.squeeze(-2)
        scale_store = None if scale_store is None else scale_store.squeeze(-1)
        low_store = None if low_store is None else low_store.squeeze(-1)
    return QuantizedBlock(data, scale_store, low_store, x.shape[-2], dim, group)


def dequantize_block(b: QuantizedBlock, cfg: KVCacheConfig, dtype: torch.dtype, static_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The float tensor [B, H, T, D] of a (possibly extended) block."""
    if b.dim == -2:
        bsz, h, d = b.data.shape[:3]
        n_blocks = b.tokens // b.group
        per = 8 // cfg.bits if cfg.format == "int" else 1
        data = b.data.reshape(bsz, h, d, n_blocks, b.group // per)
        scale = None if b.scale is None else b.scale.unsqueeze(-1)
        low = None if b.low is None else b.low.unsqueeze(-1)
    else:
        data, scale, low = b.data, b.scale, b.low
    s = static_scale.float().to(data.device).view(1, -1, 1, 1, 1) if static_scale is not None else scale.float()
    if cfg.format == "fp8":
        g = data.float() * s
    else:
        codes = unpack_codes(data, cfg.bits, b.group).float()
        g = codes * s + low.float() if low is not None else (codes - 2 ** (cfg.bits - 1)) * s
    if b.dim == -2:
        bsz, h, d = g.shape[:3]
        return g.reshape(bsz, h, d, b.tokens).transpose(-1, -2).to(dtype)
    return g.reshape(*g.shape[:3], -1).to(dtype)


# --------------------------------------------------------------------------- the cache


class QuantizedKVLayer(DynamicLayer):
    """One attention layer's cache: quantized blocks plus a full-precision window."""

    is_croppable = False

    def __init__(self, cfg: KVCacheConfig, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.k_scale, self.v_scale = k_scale, v_scale
        self.k_store: QuantizedBlock | None = None
        self.v_store: QuantizedBlock | None = None
        # What attention reads of the stored blocks: each block dequantized once, when it is stored (dequantizing
        # is elementwise, so this equals dequantizing the whole store at every step, which made decoding 2,048
        # tokens quadratic in unpacking work). Not counted in nbytes: a runtime reads its blocks in its kernel.
        self.k_read: torch.Tensor | None = None
        self.v_read: torch.Tensor | None = None
        self.stored_tokens = 0
        self.k_dim = -2 if cfg.key_axis == "channel" else -1
        self.v_dim = -2 if cfg.value_axis == "channel" else -1

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        rd = self.cfg.residual_dtype
        self.window_dtype = key_states.dtype if rd == "model" else getattr(torch, rd)
        self.read_dtype = key_states.dtype
        self.keys = self.keys.to(self.window_dtype)
        self.values = self.values.to(self.window_dtype)

    def _flush(self, n: int) -> None:
        """Quantize the oldest ``n`` window tokens as one block."""
        k = quantize_block(self.keys[..., :n, :], self.cfg, self.k_dim, self.k_scale)
        v = quantize_block(self.values[..., :n, :], self.cfg, self.v_dim, self.v_scale)
        kd = dequantize_block(k, self.cfg, self.read_dtype, self.k_scale)
        vd = dequantize_block(v, self.cfg, self.read_dtype, self.v_scale)
        if self.k_store is None:
            self.k_store, self.v_store, self.k_read, self.v_read = k, v, kd, vd
        else:
            assert self.v_store is not None and self.k_read is not None and self.v_read is not None
            self.k_store.extend(k)
            self.v_store.extend(v)
            self.k_read, self.v_read = torch.cat([self.k_read, kd], dim=-2), torch.cat([self.v_read, vd], dim=-2)
        self.keys, self.values = self.keys[..., n:, :].clone(), self.values[..., n:, :].clone()
        self.stored_tokens += n

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        dtype = key_states.dtype
        past_k = [] if self.k_read is None else [self.k_read.to(dtype)]
        past_v = [] if self.v_read is None else [self.v_read.to(dtype)]
        # Attention sees the window and the new tokens as stored (window dtype), like a real cache read.
        new_k, new_v = key_states.to(self.window_dtype), value_states.to(self.window_dtype)
        keys = torch.cat([*past_k, self.keys.to(dtype), new_k.to(dtype)], dim=-2)
        values = torch.cat([*past_v, self.values.to(dtype), new_v.to(dtype)], dim=-2)
        self.keys = torch.cat([self.keys, new_k], dim=-2)
        self.values = torch.cat([self.values, new_v], dim=-2)
        block = self.cfg.residual
        if block == 0:
            self._flush(self.keys.shape[-2])
        else:
            while self.keys.shape[-2] >= block:
                self._flush(block)
        return keys, values

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self.stored_tokens + self.keys.shape[-2]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise CompressError("the quantized KV cache does not support beam search reordering; use greedy or sampling")

    def nbytes(self) -> dict[str, int]:
        """Bytes held: quantized data and scales, and the full-precision window."""
        q = sum(b.nbytes for b in (self.k_store, self.v_store) if b is not None)
        return {"quantized": q, "window": window_bytes(self)}


class QuantizedKVCache(Cache):
    """A Cache of :class:`QuantizedKVLayer`, one per decoder layer; works with ``model.generate``."""

    def __init__(self, cfg: KVCacheConfig, num_layers: int, scales: dict[str, torch.Tensor] | None = None) -> None:
        ks = scales["k_scale"] if scales else None
        vs = scales["v_scale"] if scales else None
        layers = [QuantizedKVLayer(cfg, None if ks is None else ks[i], None if vs is None else vs[i]) for i in range(num_layers)]
        super().__init__(layers=layers)


def window_bytes(layer: DynamicLayer) -> int:
    """Bytes of a layer's unquantized keys and values (0 before its first update)."""
    if not layer.is_initialized:
        return 0
    return sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))


def cache_bytes(cache: Cache) -> dict[str, int]:
    """Measured bytes of the tensors a cache holds (quantized data + scales + window), summed over layers."""
    total = {"quantized": 0, "window": 0}
    for layer in cache.layers:
        if isinstance(layer, QuantizedKVLayer):
            for k, v in layer.nbytes().items():
                total[k] += v
        else:
            total["window"] += window_bytes(layer)
    total["total"] = total["quantized"] + total["window"]
    return total


# --------------------------------------------------------------------------- static scales


@torch.no_grad()
def calibrate_scales(
    model: torch.nn.Module, tokens: torch.Tensor, cfg: KVCacheConfig, device: torch.device, reporter: Any = None
) -> dict[str, torch.Tensor]:
    """Per layer and KV head absmax of the cached keys (after RoPE) and values over ``tokens``
    [samples, seq_len], divided by the format's largest value: ``{"k_scale": [layers, heads], ...}``."""
    from transformers import DynamicCache

    qmax = FP8_MAX if cfg.format == "fp8" else 2 ** (cfg.bits - 1) - 1
    k_max: torch.Tensor | None = None
    v_max: torch.Tensor | None = None
    rows = list(tokens)
    it = reporter.track(rows, "kv_cache: calibrating static scales") if reporter else rows
    for row in it:
        cache = DynamicCache(config=model.config)
        model(input_ids=row[None].to(device), past_key_values=cache, use_cache=True)
        k = torch.stack([layer.keys.float().abs().amax(dim=(0, 2, 3)) for layer in cache.layers]).cpu()
        v = torch.stack([layer.values.float().abs().amax(dim=(0, 2, 3)) for layer in cache.layers]).cpu()
        k_max = k if k_max is None else torch.maximum(k_max, k)
        v_max = v if v_max is None else torch.maximum(v_max, v)
    return {"k_scale": (k_max / qmax).clamp(min=1e-8), "v_scale": (v_max / qmax).clamp(min=1e-8)}
