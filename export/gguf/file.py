"""GGUF export for llama.cpp: the records packed into Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks, and
records quantized on a K-quant's own grid (``gguf_type``, quantizers/gguf_grid.py) into Q2_K … Q6_K
super-blocks, without re-quantizing; float tensors as F32 / F16 / BF16, and the tokenizer and
hyperparameters llama.cpp needs. llama.cpp's own quantizer (its mixes, Q4_K_M …) makes files from
our F16 file in ``runtime.py``; the verification in llama.cpp is in ``export.py``.

Block layouts (ggml, 32 weights a block, little-endian):

* Q4_0 — fp16 ``d``, then 16 bytes: byte ``j`` holds weight ``j`` in its low nibble and weight
  ``j+16`` in its high nibble; ``w = (q - 8) · d``. A symmetric 4-bit record is exactly this with
  ``d`` = the group's scale (our symmetric zero point is 8).
* Q4_1 — fp16 ``d``, fp16 ``m``, 16 nibble bytes as Q4_0; ``w = q · d + m``. An asymmetric record
  ``(q - z) · s`` becomes ``d = s``, ``m = fp16(-z · s)``: the rounding of ``m`` to fp16 is the
  only difference from the record (zero when ``z · s`` is representable).
* Q8_0 — fp16 ``d``, 32 int8; ``w = i · d``. A record with ``|q - z| ≤ 127`` everywhere (any
  record of at most 7 bits, or 8-bit symmetric) is exactly ``d = s``, ``i = q - z``.
* Q5_0 / Q5_1 — as Q4_0 / Q4_1 with the fifth bit of the 32 codes in 4 bytes ``qh``.
* K-quants (256 weights, compress/schema/gguf_types.py) hold only records on their own grid, which
  carry the stored fp16 ``d`` / ``dmin`` and integer sub-block scales (``record.super_blocks``);
  the packers below only lay those values and the codes out in llama.cpp's byte order. A row whose
  width is not a multiple of 256 gets llama.cpp's fallback type (the quantizer already used its grid).

A group of our records may span several blocks (its scale is repeated), so any group size that
is a multiple of 32 maps exactly, including a partial last group. Rows are permuted for
llama-architecture Q/K projections (llama.cpp's rotary layout pairs dimensions ``(i, i+d/2)``
of a head as adjacent rows); whole rows move, so the records stay exact.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from compress.errors import FormatError
from compress.export.gguf.config import GGUF_EXACT_TYPES, GGUF_FLOAT_TYPES
from compress.export.parity import turn_end_id
from compress.quantizers.arch import ARCHITECTURES as QUANT_ARCHITECTURES
from compress.quantizers.core import QuantizedWeight
from compress.schema.gguf_types import GGUF_GRIDS, QK_K
from compress.streaming import tensors

BLOCK = 32
MIX = "mix"  # the export's type when each record keeps the GGUF type of its own grid (a size budget's choice)
METADATA_NAMESPACE = "compress"


@dataclass(frozen=True)
class GGUFArch:
    name: str  # llama.cpp's architecture name
    permute_qk: bool  # llama.cpp's llama arch expects interleaved rotary rows in Q/K
    # The family's own keys (soft-capping, sliding windows) as {GGUFWriter method: value}, after checking
    # that llama.cpp's graph for the family computes what this config does (FormatError naming the key).
    family_keys: Callable[[Any, str], dict[str, Any]] | None = None


def _gemma_keys(cfg: Any, arch_name: str) -> dict[str, Any]:
    """Gemma 2 / 3: llama.cpp scales queries by 1/sqrt(head_dim) (by 1/sqrt(hidden / heads) for the
    27B block counts, 46 and 62), caps attention logits always on gemma2 and never on gemma3, and
    reads each layer's sliding window from a per-layer pattern (written here from ``layer_types``)."""
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    big = int(cfg.num_hidden_layers) == {"gemma2": 46, "gemma3": 62}[arch_name]
    scale_dim = cfg.hidden_size // heads if big else head_dim
    scalar = getattr(cfg, "query_pre_attn_scalar", None)
    if scalar is not None and int(scalar) != scale_dim:
        raise FormatError(
            f"config query_pre_attn_scalar is {scalar}, but llama.cpp's {arch_name} scales queries by 1/sqrt({scale_dim}) "
            f"({'hidden_size / num_attention_heads' if big else 'head_dim'} at {cfg.num_hidden_layers} blocks): "
            "its file would compute a different attention"
        )
    if arch_name == "gemma2" and not getattr(cfg, "tie_word_embeddings", True):
        raise FormatError("config tie_word_embeddings is false: llama.cpp's gemma2 always uses the token embedding as its output")
    keys: dict[str, Any] = {}
    attn_cap = getattr(cfg, "attn_logit_softcapping", None)
    final_cap = getattr(cfg, "final_logit_softcapping", None)
    if arch_name == "gemma2":
        for key, value in (("attn_logit_softcapping", attn_cap), ("final_logit_softcapping", final_cap)):
            if not value:
                raise FormatError(f"config {key} is {value!r}: llama.cpp's gemma2 always soft-caps, so its file would differ")
        keys["add_attn_logit_softcapping"] = float(attn_cap)
    elif attn_cap:
        raise FormatError(f"config attn_logit_softcapping is {attn_cap}: llama.cpp's gemma3 does not cap attention logits")
    if final_cap:
        keys["add_final_logit_softcapping"] = float(final_cap)
    layer_types = list(getattr(cfg, "layer_types", None) or [])
    sliding = [t == "sliding_attention" for t in layer_types]
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise FormatError(f"config layer_types holds {unknown}: GGUF export writes sliding_attention and full_attention layers")
    if any(sliding):
        keys["add_sliding_window"] = int(cfg.sliding_window)
        keys["add_sliding_window_pattern"] = sliding
    elif arch_name == "gemma2":
        raise FormatError("config layer_types has no sliding_attention layer: llama.cpp's gemma2 always slides a window")
    return keys


# transformers model_type -> llama.cpp architecture. Add an entry (and its test) to support more.
ARCHITECTURES: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", permute_qk=True),
    "mistral": GGUFArch("llama", permute_qk=True),
    "qwen2": GGUFArch("qwen2", permute_qk=False),
    "qwen3": GGUFArch("qwen3", permute_qk=False),
    "gemma2": GGUFArch("gemma2", permute_qk=False, family_keys=_gemma_keys),
    "gemma3_text": GGUFArch("gemma3", permute_qk=False, family_keys=_gemma_keys),
}


# --------------------------------------------------------------------------- block packing


def _ggml_type(name: str) -> Any:
    import gguf

    return gguf.GGMLQuantizationType[name.upper()]


def block_params(record: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per 32-block: codes [out, in] (uint8), scale [out, blocks] and zero point [out, blocks]
    (float32), the group's values repeated over its blocks. Raises FormatError when a block
    would straddle two groups."""
    out_f, in_f = record.shape
    width = record.scheme.group_width(in_f)
    if in_f % BLOCK or width % BLOCK:
        raise FormatError(f"group size {width} and row width {in_f} must be multiples of {BLOCK} for GGUF blocks")
    group_of_block = torch.arange(in_f // BLOCK) * BLOCK // width
    scale = record.scale.to(torch.float32)[:, group_of_block]
    zero = record.zero_point.to(torch.float32)[:, group_of_block]
    return record.codes.cpu().numpy(), scale.cpu().numpy(), zero.cpu().numpy()


def _nibbles(codes: np.ndarray) -> np.ndarray:
    blocks = codes.reshape(codes.shape[0], -1, BLOCK)
    return (blocks[..., :16] | (blocks[..., 16:] << 4)).astype(np.uint8)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)[..., None].view(np.uint8)


def pack_q4_0(record: QuantizedWeight) -> np.ndarray:
    """Q4_0 bytes [out, blocks * 18] of a symmetric 4-bit record (exact)."""
    if record.scheme.bits != 4 or not record.scheme.symmetric:
        raise FormatError(f"Q4_0 holds symmetric 4-bit records exactly, not {record.scheme.describe()}")
    codes, scale, _ = block_params(record)
    out = np.concatenate([_f16_bytes(scale), _nibbles(codes)], axis=-1)
    return out.reshape(codes.shape[0], -1)


def pack_q4_1(record: QuantizedWeight) -> np.ndarray:
    """Q4_1 bytes [out, blocks * 20] of a 4-bit record; ``m = fp16(-z · s)``."""
    if record.scheme.bits != 4:
        raise FormatError(f"Q4_1 holds 4-bit records exactly, not {record.scheme.describe()}")
    codes, scale, zero = block_params(record)
    out = np.concatenate([_f16_bytes(scale), _f16_bytes(_minimum(record, scale, zero)), _nibbles(codes)], axis=-1)
    return out.reshape(codes.shape[0], -1)


def q8_0_exact(record: QuantizedWeight) -> bool:
    return record.plain and (record.scheme.bits <= 7 or record.scheme.symmetric)


def pack_q8_0(record: QuantizedWeight) -> np.ndarray:
    """Q8_0 bytes [out, blocks * 34] of a record whose ``q - z`` fits int8 (exact)."""
    if not q8_0_exact(record):
        raise FormatError(f"Q8_0 cannot hold {record.scheme.describe()} exactly (q - z exceeds int8)")
    codes, scale, zero = block_params(record)
    ints = (codes.astype(np.int16).reshape(codes.shape[0], -1, BLOCK) - zero[..., None].astype(np.int16)).astype(np.int8)
    out = np.concatenate([_f16_bytes(scale), ints.view(np.uint8)], axis=-1)
    return out.reshape(codes.shape[0], -1)


def _minimum(record: QuantizedWeight, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """Per 32-block fp16 minimum ``m`` of ``w = d·q + m``: the record's own offset (float-minimum
    grids) or ``fp16(-z · d)`` for an integer zero point."""
    if record.offset is not None:
        return record.offset.to(torch.float32)[:, _group_of_block(record)].cpu().numpy()
    return -zero * scale.astype(np.float16).astype(np.float32)


def _group_of_block(record: QuantizedWeight) -> torch.Tensor:
    in_f = record.shape[1]
    return torch.arange(in_f // BLOCK) * BLOCK // record.scheme.group_width(in_f)


def _high_bits(codes: np.ndarray, bit: int) -> np.ndarray:
    """Bit ``bit`` of each weight of a 32-block, packed little-endian into 4 bytes (Q5_0 / Q5_1's qh)."""
    blocks = codes.reshape(codes.shape[0], -1, BLOCK)
    return np.packbits((blocks >> bit) & 1, axis=-1, bitorder="little")


def pack_q5_0(record: QuantizedWeight) -> np.ndarray:
    """Q5_0 bytes [out, blocks * 22] of a symmetric 5-bit record (exact): fp16 d, qh (bit 4 of each
    code), 16 nibble bytes as Q4_0; ``w = (q - 16) · d``."""
    if record.scheme.bits != 5 or not record.scheme.symmetric:
        raise FormatError(f"Q5_0 holds symmetric 5-bit records exactly, not {record.scheme.describe()}")
    codes, scale, _ = block_params(record)
    out = np.concatenate([_f16_bytes(scale), _high_bits(codes, 4), _nibbles(codes & 0x0F)], axis=-1)
    return out.reshape(codes.shape[0], -1)


def pack_q5_1(record: QuantizedWeight) -> np.ndarray:
    """Q5_1 bytes [out, blocks * 24] of a 5-bit record: fp16 d and m, qh, nibbles; ``w = d·q + m``."""
    if record.scheme.bits != 5:
        raise FormatError(f"Q5_1 holds 5-bit records exactly, not {record.scheme.describe()}")
    codes, scale, zero = block_params(record)
    m = _minimum(record, scale, zero)
    out = np.concatenate([_f16_bytes(scale), _f16_bytes(m), _high_bits(codes, 4), _nibbles(codes & 0x0F)], axis=-1)
    return out.reshape(codes.shape[0], -1)


# ---- K-quants: super-blocks of QK_K weights; arrays below are [rows, super-blocks, ...]


def _k_params(record: QuantizedWeight, type_name: str) -> tuple[np.ndarray, ...]:
    """codes [rows, n, 256] uint8, d and dmin [rows, n] fp16 bytes' values, sub-block scales and mins [rows, n, subs] int."""
    grid = GGUF_GRIDS[type_name]
    if record.scheme.gguf_type != type_name or record.super_blocks is None:
        raise FormatError(f"{type_name.upper()} blocks hold records on the {type_name.upper()} grid, not {record.scheme.describe()}")
    rows, in_f = record.shape
    n = in_f // QK_K
    sb = record.super_blocks
    codes = record.codes.cpu().numpy().reshape(rows, n, QK_K)
    subs = QK_K // grid.group
    scales = sb.scales.cpu().numpy().astype(np.int16).reshape(rows, n, subs)
    mins = sb.mins.cpu().numpy().astype(np.int16).reshape(rows, n, subs)
    return codes, sb.d.cpu().numpy(), sb.dmin.cpu().numpy(), scales, mins


def _f16_raw(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)[..., None].view(np.uint8)


def _crumbs(values: np.ndarray) -> np.ndarray:
    """2-bit fields of 256 weights in 64 bytes (Q2_K, Q3_K): weight 128h + 32t + b in byte 32h + b, bits 2t."""
    v = (values & 3).astype(np.uint8).reshape(*values.shape[:-1], 2, 4, 32)
    return (v[..., 0, :] | v[..., 1, :] << 2 | v[..., 2, :] << 4 | v[..., 3, :] << 6).reshape(*values.shape[:-1], 64)


def _bit_planes(values: np.ndarray, bit: int) -> np.ndarray:
    """Bit ``bit`` of 256 weights in 32 bytes: weight 32j + b in byte b, bit j (Q3_K's hmask, Q5_K's qh)."""
    v = ((values >> bit) & 1).astype(np.uint8).reshape(*values.shape[:-1], 8, 32)
    return np.bitwise_or.reduce(v << np.arange(8, dtype=np.uint8)[:, None], axis=-2)


def _k_nibbles(values: np.ndarray) -> np.ndarray:
    """Low nibbles of 256 weights in 128 bytes (Q4_K, Q5_K): sub-blocks 2c and 2c+1 share bytes 32c..32c+31."""
    v = (values & 0x0F).astype(np.uint8).reshape(*values.shape[:-1], 4, 2, 32)
    return (v[..., 0, :] | v[..., 1, :] << 4).reshape(*values.shape[:-1], 128)


def _k_scales_6bit(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and eight 6-bit mins in 12 bytes (Q4_K, Q5_K)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    low = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    mid = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    high = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return np.concatenate([low, mid, high], axis=-1)


def pack_q4_k(record: QuantizedWeight) -> np.ndarray:
    """Q4_K bytes [out, n * 144]: fp16 d, dmin, 12 bytes of 6-bit scales and mins, 128 nibble bytes."""
    codes, d, dmin, sc, mn = _k_params(record, "q4_k")
    out = np.concatenate([_f16_raw(d), _f16_raw(dmin), _k_scales_6bit(sc, mn), _k_nibbles(codes)], axis=-1)
    return out.reshape(codes.shape[0], -1)


def pack_q5_k(record: QuantizedWeight) -> np.ndarray:
    """Q5_K bytes [out, n * 176]: as Q4_K with 32 bytes of fifth bits before the nibbles."""
    codes, d, dmin, sc, mn = _k_params(record, "q5_k")
    out = np.concatenate([_f16_raw(d), _f16_raw(dmin), _k_scales_6bit(sc, mn), _bit_planes(codes, 4), _k_nibbles(codes)], axis=-1)
    return out.reshape(codes.shape[0], -1)


def pack_q6_k(record: QuantizedWeight) -> np.ndarray:
    """Q6_K bytes [out, n * 210]: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, fp16 d.
    Weight 128h + p: low nibble in byte 64h + p % 64 (nibble p // 64), high bits in byte 32h + p % 32 (bits 2·(p // 32))."""
    codes, d, _, sc, _ = _k_params(record, "q6_k")
    rows, n = codes.shape[:2]
    halves = codes.reshape(rows, n, 2, 128)
    low = (halves & 0x0F).reshape(rows, n, 2, 2, 64)
    ql = (low[..., 0, :] | low[..., 1, :] << 4).reshape(rows, n, 128)
    high = (halves >> 4).reshape(rows, n, 2, 4, 32)
    qh = (high[..., 0, :] | high[..., 1, :] << 2 | high[..., 2, :] << 4 | high[..., 3, :] << 6).reshape(rows, n, 64)
    out = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16_raw(d)], axis=-1)
    return out.reshape(rows, -1)


def pack_q3_k(record: QuantizedWeight) -> np.ndarray:
    """Q3_K bytes [out, n * 110]: 32 bytes of third bits (hmask), 64 of 2-bit pairs, 12 of 6-bit
    scales (stored + 32), fp16 d. Scale k: low nibble in byte k % 8 (nibble k // 8), high 2 bits in
    byte 8 + k % 4 (bits 2·(k // 4))."""
    codes, d, _, sc, _ = _k_params(record, "q3_k")
    stored = (sc + 32).astype(np.uint8)
    low = (stored & 0x0F).reshape(*stored.shape[:-1], 2, 8)
    high = (stored >> 4).reshape(*stored.shape[:-1], 4, 4)
    scales = np.concatenate(
        [low[..., 0, :] | low[..., 1, :] << 4, high[..., 0, :] | high[..., 1, :] << 2 | high[..., 2, :] << 4 | high[..., 3, :] << 6],
        axis=-1,
    )
    out = np.concatenate([_bit_planes(codes, 2), _crumbs(codes), scales, _f16_raw(d)], axis=-1)
    return out.reshape(codes.shape[0], -1)


def pack_q2_k(record: QuantizedWeight) -> np.ndarray:
    """Q2_K bytes [out, n * 84]: 16 bytes of 4-bit scale (low) and min (high), 64 of 2-bit codes, fp16 d, dmin."""
    codes, d, dmin, sc, mn = _k_params(record, "q2_k")
    scales = (sc.astype(np.uint8) & 0x0F) | (mn.astype(np.uint8) << 4)
    out = np.concatenate([scales, _crumbs(codes), _f16_raw(d), _f16_raw(dmin)], axis=-1)
    return out.reshape(codes.shape[0], -1)


PACKERS = {
    "q4_0": pack_q4_0,
    "q4_1": pack_q4_1,
    "q5_0": pack_q5_0,
    "q5_1": pack_q5_1,
    "q8_0": pack_q8_0,
    "q2_k": pack_q2_k,
    "q3_k": pack_q3_k,
    "q4_k": pack_q4_k,
    "q5_k": pack_q5_k,
    "q6_k": pack_q6_k,
}


def record_problem(record: QuantizedWeight, type_name: str) -> str | None:
    """Why ``record`` cannot become ``type_name`` blocks exactly, or None when it can."""
    s, (_, in_f) = record.scheme, record.shape
    width = s.group_width(in_f)
    grid = GGUF_GRIDS[type_name]
    if grid.k_quant or not record.plain:  # only records on this very grid
        if s.gguf_type != type_name:
            return f"{s.describe()} records are not on the {type_name.upper()} grid (quantize with gguf_type: {type_name})"
        return None if in_f % grid.block_weights == 0 else f"rows of {in_f} are not a multiple of {grid.block_weights}"
    if in_f % BLOCK:
        return f"rows of {in_f} are not a multiple of {BLOCK}"
    if width % BLOCK:
        return f"group size {width} is not a multiple of {BLOCK}"
    if type_name in ("q4_0", "q5_0") and (s.bits != grid.bits or not s.symmetric):
        return f"{s.describe()} is not symmetric {grid.bits}-bit"
    if type_name in ("q4_1", "q5_1") and s.bits != grid.bits:
        return f"{s.describe()} is not {grid.bits}-bit"
    if type_name == "q4_0" and (s.bits != 4 or not s.symmetric):
        return f"{s.describe()} is not symmetric 4-bit"
    if type_name == "q4_1" and s.bits != 4:
        return f"{s.describe()} is not 4-bit"
    if type_name == "q8_0" and not q8_0_exact(record):
        return f"{s.describe()}: q - z exceeds int8"
    return None


def float_bytes(weight: torch.Tensor, type_name: str) -> np.ndarray:
    """A float tensor in ``type_name`` (f32 | f16 | bf16 | q8_0 by llama.cpp's reference rounding);
    its ggml type is ``TensorPlan.info``'s."""
    w = weight.detach()
    if w.dim() < 2 or w.shape[0] <= FLOAT_ROWS:
        return _float_piece(w, type_name)
    out: np.ndarray | None = None
    for start in range(0, w.shape[0], FLOAT_ROWS):  # a piece of rows at a time: no float32 copy of the whole
        piece = _float_piece(w[start : start + FLOAT_ROWS], type_name)
        if out is None:
            out = np.empty((w.shape[0], *piece.shape[1:]), dtype=piece.dtype)
        out[start : start + piece.shape[0]] = piece
    assert out is not None
    return out


FLOAT_ROWS = 8192
"""Rows of a float tensor converted at once (the 151,936 x 1,536 token embedding of Qwen2.5-1.5B was
an 890 MB float32 copy, and more inside gguf-py's quantizer; 8,192 rows are 48 MB)."""


def _float_piece(weight: torch.Tensor, type_name: str) -> np.ndarray:
    from gguf import quants

    w = weight.to(torch.float32).cpu().numpy()
    if type_name == "f32":
        return w
    if type_name == "f16":
        return w.astype(np.float16)
    return quants.quantize(w, _ggml_type(type_name))


# --------------------------------------------------------------------------- the plan


@dataclass
class TensorPlan:
    hf_name: str
    gguf_name: str
    type_name: str  # f32 | f16 | bf16 | a block type of GGUF_GRIDS
    source: str  # "record" (exact), "requantized" (fallback from a record), "float"
    permute_heads: int | None = None  # Q/K row permutation with this many heads
    shape: tuple[int, ...] = ()  # the tensor's shape (rows, columns) as the state dict holds it
    offset: float = 0.0  # added to the values as written: the norm offset of quantizers/arch.py (Gemma's x_hat * (1 + w)), as llama.cpp computes x_hat * w
    record: str | None = None  # the record it holds, when not its own module's (token_embd holding a tied source's head)

    @property
    def record_name(self) -> str:
        return self.record or self.hf_name.rsplit(".", 1)[0]

    def info(self) -> tuple[tuple[int, ...], Any, int, Any]:
        """What the GGUF tensor-info table says of this tensor before its data is made: (shape as
        gguf-py's writer takes it, numpy dtype, bytes, ggml type or None for plain f32/f16)."""
        import gguf

        numel = int(np.prod(self.shape))
        if self.type_name == "f32":
            return self.shape, np.dtype(np.float32), numel * 4, None
        if self.type_name == "f16":
            return self.shape, np.dtype(np.float16), numel * 2, None
        raw = _ggml_type(self.type_name)
        byte_shape = tuple(int(n) for n in gguf.quant_shape_to_byte_shape(self.shape, raw))
        return byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw


@dataclass
class GGUFPlan:
    arch: GGUFArch
    tensors: list[TensorPlan] = field(default_factory=list)
    fallbacks: dict[str, str] = field(default_factory=dict)  # record name -> why it fell back
    # record name -> the type llama.cpp's rule gives a row the export's K-quant blocks do not divide, and why
    type_fallbacks: dict[str, str] = field(default_factory=dict)
    family_keys: dict[str, Any] = field(default_factory=dict)  # GGUFArch.family_keys: {GGUFWriter method: value}

    @property
    def one_table(self) -> TensorPlan | None:
        """The token embedding written from the head's record (head_table), if the file has one table."""
        return next((t for t in self.tensors if t.record == HEAD_RECORD and t.hf_name != "lm_head.weight"), None)

    def counts(self) -> dict[str, int]:
        return dict(Counter(f"{t.type_name} ({t.source})" for t in self.tensors))


def architecture_of(model: nn.Module) -> GGUFArch:
    model_type = getattr(model.config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise FormatError(
            f"GGUF export does not know the architecture '{model_type}'; known: {', '.join(sorted(ARCHITECTURES))}. "
            "Add an entry to ARCHITECTURES in export/gguf/file.py (llama.cpp's architecture name and whether Q/K rows are permuted) with a test"
        )
    return ARCHITECTURES[model_type]


def tensor_names(model: nn.Module) -> Any:
    """gguf-py's map from the model's Hugging Face tensor names to llama.cpp's (``get_name``)."""
    import gguf

    arch = architecture_of(model)
    return gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch.name], model.config.num_hidden_layers)


def own_head_type(name: str, record: QuantizedWeight) -> str | None:
    """The GGUF type a head record keeps in a file of another type: the head quantized on a GGUF
    type's grid of its own (a stage of its own, ``targets: [lm_head]``, ``gguf_type: q8_0``), as
    llama.cpp's mixes give the output its own type (Q8_0, or Q6_K for rows of a multiple of 256)."""
    return record.scheme.gguf_type if name == HEAD_RECORD else None


def resolve_type(spec_type: str, records: dict[str, QuantizedWeight]) -> str:
    """The block type of an exact export: ``auto`` picks from the records' schemes (a head on a
    GGUF grid of its own keeps its type and does not take part)."""
    if spec_type != "auto":
        return spec_type
    if any(own_head_type(n, r) for n, r in records.items()) and len(records) > 1:
        records = {n: r for n, r in records.items() if not own_head_type(n, r)}
    schemes = {(r.scheme.bits, r.scheme.symmetric) for r in records.values()}
    if not schemes:
        return "f16"
    grids = {r.scheme.gguf_type for r in records.values()}
    for name in grids - {None}:  # records on a type's grid (and its fallbacks'): that type
        if grids <= set(GGUF_GRIDS[name].family):
            return name
    if None not in grids:  # every record on a grid of its own choosing (a size budget's mix): each its own type
        return MIX
    if schemes == {(4, True)}:
        return "q4_0"
    if {b for b, _ in schemes} == {4}:
        return "q4_1"
    if schemes == {(8, True)}:
        return "q8_0"
    raise FormatError(f"type: auto cannot pick one GGUF block type for the schemes {sorted(schemes)}; set type (and fallback)")


def head_table(model: nn.Module, records: dict[str, QuantizedWeight], share: bool = True) -> str | None:
    """The state-dict name of the token embedding when the file's one table is the head's record: the
    source ties them (config ``tie_word_embeddings``), the quantize stage quantized the head (and so
    untied it in memory) and not the embedding. llama.cpp then reads token_embd for both, as for every
    tied model. None otherwise, or when ``share`` is False (``keep_float: [embeddings]``)."""
    from compress.hf_model import embeddings_tied

    if not share or HEAD_RECORD not in records or embeddings_tied(model) or not getattr(model.config, "tie_word_embeddings", False):
        return None
    weight = model.get_input_embeddings().weight
    name = next(n for n, p in model.named_parameters() if p is weight)
    return None if name.removesuffix(".weight") in records else name


HEAD_RECORD = "lm_head"


def plan_tensors(
    model: nn.Module,
    records: dict[str, QuantizedWeight],
    type_name: str,
    float_type: str | None,
    fallback: str | None,
    share_head: bool = True,
) -> GGUFPlan:
    """Which GGUF tensor each state-dict tensor becomes, in which type, and why."""

    from compress.hf_model import embeddings_tied

    arch = architecture_of(model)
    cfg = model.config
    names = tensor_names(model)
    matrix_default = float_type or (type_name if type_name in GGUF_FLOAT_TYPES else "q8_0")
    plan = GGUFPlan(arch, family_keys=arch.family_keys(cfg, arch.name) if arch.family_keys else {})
    tied = embeddings_tied(model)
    shared = head_table(model, records, share_head)
    known = QUANT_ARCHITECTURES.get(getattr(cfg, "model_type", ""))
    norm_offset = known.norm_offset if known is not None else 0.0
    for hf_name, tensor in model.state_dict().items():
        if (tied or shared) and hf_name == "lm_head.weight":
            continue  # llama.cpp uses token_embd for the output when output.weight is absent
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise FormatError(f"no GGUF name for {hf_name} in llama.cpp's '{arch.name}' tensor map")
        module = hf_name.rsplit(".", 1)[0]
        shape = tuple(int(n) for n in tensor.shape)
        heads = None
        if arch.permute_qk and hf_name.endswith((".q_proj.weight", ".q_proj.bias")):
            heads = cfg.num_attention_heads
        elif arch.permute_qk and hf_name.endswith((".k_proj.weight", ".k_proj.bias")):
            heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        if hf_name == shared:  # one table: the head's record, read by llama.cpp as embeddings and as the output
            module = HEAD_RECORD
        if hf_name.endswith(".weight") and module in records:
            record = records[module]
            own = record.scheme.gguf_type if type_name == MIX else own_head_type(module, record)
            tensor_type = type_name if own is None or type_name in GGUF_FLOAT_TYPES else own
            if tensor_type == type_name and type_name in GGUF_GRIDS and GGUF_GRIDS[type_name].for_width(record.shape[1]).name != type_name:
                grid = GGUF_GRIDS[type_name]
                tensor_type = grid.for_width(record.shape[1]).name
                plan.type_fallbacks[module] = (
                    f"rows of {record.shape[1]} are not a multiple of {grid.block_weights}: {tensor_type.upper()}, "
                    + (grid.fallback_note or "llama.cpp's fallback for " + type_name.upper())
                )
            problem = record_problem(record, tensor_type) if tensor_type in GGUF_EXACT_TYPES else f"type {type_name} is a float type"
            if problem is None:
                plan.tensors.append(TensorPlan(hf_name, gguf_name, tensor_type, "record", heads, shape, record=module))
                continue
            if type_name in GGUF_FLOAT_TYPES:
                plan.tensors.append(TensorPlan(hf_name, gguf_name, type_name, "dequantized", heads, shape, record=module))
                continue
            if fallback is None:
                raise FormatError(
                    f"{module} ({record.scheme.describe()}) cannot become {type_name.upper()} exactly: {problem}. "
                    "Quantize it to a scheme that maps, or declare `fallback:` on the export (f16, bf16, f32 or q8_0)"
                )
            exact_fallback = fallback in GGUF_EXACT_TYPES and record_problem(record, fallback) is None
            plan.fallbacks[module] = problem
            plan.tensors.append(
                TensorPlan(hf_name, gguf_name, fallback, "record" if exact_fallback else "fallback", heads, shape, record=module)
            )
        elif tensor.dim() == 1:
            offset = norm_offset if hf_name.endswith("norm.weight") else 0.0
            plan.tensors.append(TensorPlan(hf_name, gguf_name, "f32", "float", heads, shape, offset))
        else:
            usable = matrix_default
            if usable in GGUF_EXACT_TYPES and tensor.shape[-1] % BLOCK:
                usable = "f16"
            plan.tensors.append(TensorPlan(hf_name, gguf_name, usable, "float", heads, shape))
    return plan


def permute_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's half-split rotary rows -> llama.cpp's interleaved rows, per head (rows only)."""
    rows = t.shape[0]
    order = torch.arange(rows).reshape(heads, 2, rows // heads // 2).transpose(1, 2).reshape(-1)
    return t[order]


def permuted_record(record: QuantizedWeight, heads: int | None) -> QuantizedWeight:
    if heads is None:
        return record
    return record.map_rows(lambda t: permute_rows(t, heads))


# --------------------------------------------------------------------------- metadata


def _rope(cfg: Any, layer_type: str = "full_attention") -> tuple[float, dict[str, Any]]:
    """(theta, rope parameters) of ``layer_type``'s layers: transformers keeps one set, or one per
    layer type (Gemma 3: ``full_attention`` and ``sliding_attention``)."""
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    if "full_attention" in params:
        params = dict(params.get(layer_type) or params["full_attention"])
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return float(theta), params


def add_hyperparameters(writer: Any, model: nn.Module, arch: GGUFArch) -> None:
    import gguf

    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    writer.add_context_length(int(cfg.max_position_embeddings))
    writer.add_embedding_length(int(cfg.hidden_size))
    writer.add_block_count(int(cfg.num_hidden_layers))
    writer.add_feed_forward_length(int(cfg.intermediate_size))
    writer.add_head_count(int(heads))
    writer.add_head_count_kv(int(getattr(cfg, "num_key_value_heads", None) or heads))
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_vocab_size(int(cfg.vocab_size))
    writer.add_rope_dimension_count(int(head_dim))
    writer.add_key_length(int(head_dim))  # explicit: readers default to hidden / heads (transformers' qwen3 to 128)
    writer.add_value_length(int(head_dim))
    theta, params = _rope(cfg)
    writer.add_rope_freq_base(theta)
    if "sliding_attention" in (getattr(cfg, "rope_parameters", None) or {}):  # sliding layers' own rope (Gemma 3)
        swa_theta, swa = _rope(cfg, "sliding_attention")
        if swa.get("rope_type", "default") != "default":
            raise FormatError(f"sliding_attention rope_type '{swa['rope_type']}': llama.cpp scales only full-attention layers' rope")
        writer.add_rope_freq_base_swa(swa_theta)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", None):
        return
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(params["factor"]))
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(params["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(params.get("original_max_position_embeddings", cfg.max_position_embeddings)))
    else:
        raise FormatError(f"GGUF export does not write rope scaling '{kind}' yet (linear and yarn are supported)")


# llama.cpp pre-tokenizer names, recognized from the Hugging Face tokenizer.json `pre_tokenizer`.
# A signature is the tuple of its steps (see _pre_signature). Extend with a parity test.
_LETTERS_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST_REGEX = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PRE_TOKENIZERS: dict[tuple, str] = {
    (("bytelevel", True, False),): "gpt-2",
    (("digits", True), ("bytelevel", True, False)): "smollm",
    (("split", _LETTERS_REGEX + r"\p{N}{1,3}" + _REST_REGEX), ("bytelevel", False, False)): "llama-bpe",
    (("split", _LETTERS_REGEX + r"\p{N}" + _REST_REGEX), ("bytelevel", False, False)): "qwen2",
}


def _pre_signature(node: dict[str, Any] | None) -> tuple:
    if node is None:
        return ()
    kind = node.get("type")
    if kind == "Sequence":
        return tuple(step for child in node.get("pretokenizers", []) for step in _pre_signature(child))
    if kind == "ByteLevel":
        return (("bytelevel", bool(node.get("use_regex", True)), bool(node.get("add_prefix_space", False))),)
    if kind == "Digits":
        return (("digits", bool(node.get("individual_digits", False))),)
    if kind == "Split":
        pattern = node.get("pattern", {})
        return (("split", pattern.get("Regex", pattern.get("String"))),)
    return ((kind,),)


def pre_tokenizer_of(signature: tuple) -> Any:
    """The Hugging Face tokenizers pre-tokenizer with this signature (``_pre_signature``'s inverse)."""
    from tokenizers import Regex, pre_tokenizers

    steps = []
    for step in signature:
        if step[0] == "bytelevel":
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=step[2], use_regex=step[1]))
        elif step[0] == "digits":
            steps.append(pre_tokenizers.Digits(individual_digits=step[1]))
        elif step[0] == "split":
            steps.append(pre_tokenizers.Split(Regex(step[1]), behavior="isolated", invert=False))
        else:
            raise FormatError(f"no pre-tokenizer is made for the step {step}")
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


def pre_tokenizer_name(tokenizer_json: dict[str, Any], strict: bool = True) -> str | None:
    """llama.cpp's name for tokenizer.json's pre-tokenizer; unknown: FormatError (``strict``) or None."""
    signature = _pre_signature(tokenizer_json.get("pre_tokenizer"))
    if signature not in PRE_TOKENIZERS and not strict:
        return None
    if signature not in PRE_TOKENIZERS:
        raise FormatError(
            f"GGUF export does not recognize this tokenizer's pre-tokenizer {signature}; set `pre_tokenizer:` on the "
            f"export to llama.cpp's name for it (known here: {', '.join(sorted(set(PRE_TOKENIZERS.values())))})"
        )
    return PRE_TOKENIZERS[signature]


def add_tokenizer(writer: Any, tokenizer: Any, n_vocab: int, pre_tokenizer: str) -> dict[str, Any]:
    """BPE (``gpt2``) or SentencePiece-style byte-fallback BPE (``llama``) vocabularies from the
    fast tokenizer's tokenizer.json, plus special ids, add-bos/eos and the chat template."""
    import gguf

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        tj = json.loads((Path(tmp) / "tokenizer.json").read_text())
        special = gguf.SpecialVocab(tmp, load_merges=True, n_vocab=n_vocab)
    model = tj["model"]
    if model.get("type") != "BPE":
        raise FormatError(f"GGUF export writes BPE tokenizers; this one is {model.get('type')}")
    byte_level = any(step[0] == "bytelevel" for step in _pre_signature(tj.get("pre_tokenizer")))
    spm = not byte_level and bool(model.get("byte_fallback"))
    if not byte_level and not spm:
        raise FormatError(
            "GGUF export writes byte-level BPE (gpt2) and byte-fallback BPE (SentencePiece-style llama) tokenizers; "
            "this tokenizer is neither"
        )
    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["id"]: t for t in tj.get("added_tokens", [])}
    for tid, tok in added.items():
        vocab.setdefault(tok["content"], tid)
    by_id = {i: t for t, i in vocab.items()}
    tokens, types, scores = [], [], []
    for i in range(n_vocab):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(text)
            if spm and text.startswith("<0x") and len(text) == 6:
                types.append(gguf.TokenType.BYTE)
            elif i in added:
                types.append(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
            else:
                types.append(gguf.TokenType.NORMAL)
        scores.append(-float(i))
    if spm:
        writer.add_tokenizer_model("llama")
        writer.add_token_scores(scores)
        writer.add_add_space_prefix("Prepend" in json.dumps(tj.get("normalizer")) or "Metaspace" in json.dumps(tj.get("pre_tokenizer")))
        pre = "default"
    else:
        writer.add_tokenizer_model("gpt2")
        pre = pre_tokenizer if pre_tokenizer != "auto" else pre_tokenizer_name(tj)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if spm:
        special.merges = []  # SentencePiece merges come from the scores
    # What the Hugging Face tokenizer does, written explicitly (llama.cpp's defaults differ by vocabulary type).
    probe = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    special.add_special_token["bos"] = tokenizer.bos_token_id is not None and probe[:1] == [tokenizer.bos_token_id]
    special.add_special_token["eos"] = tokenizer.eos_token_id is not None and probe[-1:] == [tokenizer.eos_token_id]
    special.add_to_gguf(writer, quiet=True)
    ids = dict(special.special_token_ids)
    eot = turn_end_id(tokenizer)  # written, not left to llama.cpp's guess from the token's text
    if eot is not None:
        writer.add_eot_token_id(eot)
        ids["eot"] = eot
    return {
        "model": "llama" if spm else "gpt2",
        "pre": pre,
        "tokens": len(tokens),
        "merges": len(special.merges),
        "special_ids": ids,
        "add_special": dict(special.add_special_token),
        "chat_template": special.chat_template is not None,
    }


TOKENIZER_PREFIX = "tokenizer."  # every tokenizer key of a GGUF file (tokenizer.ggml.*, tokenizer.chat_template)


def is_gguf_file(path: Path | None) -> bool:
    """Whether ``path`` is a GGUF file (by its magic bytes)."""
    if path is None or not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def copy_tokenizer(writer: Any, source: Path, n_vocab: int, pre_tokenizer: str) -> dict[str, Any]:
    """The source GGUF's own tokenizer, copied key for key (vocabulary, token types, merges or
    scores, special ids, add-BOS/EOS, pre-tokenizer, chat template): what llama.cpp already runs for
    that model, rather than transformers' rebuild of it, which can differ (SmolLM2: EOS and
    pre-tokenizer). ``pre_tokenizer`` other than ``auto`` replaces the source's."""
    import gguf

    fields = {k: f for k, f in gguf.GGUFReader(source).fields.items() if k.startswith(TOKENIZER_PREFIX)}
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise FormatError(f"the source {source} has no tokenizer (no tokenizer.ggml.tokens); a GGUF export needs one")
    if len(tokens.data) != n_vocab:
        raise FormatError(f"the source {source} has {len(tokens.data)} tokens and the model {n_vocab} embeddings; they must match")
    for key, entry in fields.items():
        if key == "tokenizer.ggml.pre" and pre_tokenizer != "auto":
            continue
        vtype = entry.types[0]
        writer.add_key_value(key, entry.contents(), vtype, entry.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    if pre_tokenizer != "auto":
        writer.add_tokenizer_pre(pre_tokenizer)

    def value(key: str) -> Any:
        return fields[key].contents() if key in fields else None

    return {
        "from": f"source GGUF {source.name}",
        "model": value("tokenizer.ggml.model"),
        "pre": pre_tokenizer if pre_tokenizer != "auto" else value("tokenizer.ggml.pre"),
        "tokens": len(tokens.data),
        "merges": len(fields["tokenizer.ggml.merges"].data) if "tokenizer.ggml.merges" in fields else 0,
        "special_ids": {k.removeprefix("tokenizer.ggml.").removesuffix("_token_id"): value(k) for k in fields if k.endswith("_token_id")},
        "add_special": {
            k.removeprefix("tokenizer.ggml.add_").removesuffix("_token"): value(k)
            for k in fields
            if k.startswith("tokenizer.ggml.add_") and k.endswith("_token")
        },
        "chat_template": "tokenizer.chat_template" in fields,
    }


def tokenizer_metadata(path: Path) -> dict[str, Any]:
    """The scalar tokenizer keys of a GGUF file (special ids, add-BOS/EOS, model, pre-tokenizer, chat template)."""
    import gguf

    return {
        k: f.contents()
        for k, f in gguf.GGUFReader(path).fields.items()
        if k.startswith(TOKENIZER_PREFIX) and f.types and f.types[0] != gguf.GGUFValueType.ARRAY
    }


# --------------------------------------------------------------------------- writing


# The file type llama.cpp records for a file mostly of one block type (K-quants: the _S mix, the one
# whose tensors are mostly that type; metadata only, readers go by each tensor's own type).
FILE_TYPES = {
    "f32": "ALL_F32",
    "f16": "MOSTLY_F16",
    "bf16": "MOSTLY_BF16",
    "q8_0": "MOSTLY_Q8_0",
    "q4_0": "MOSTLY_Q4_0",
    "q4_1": "MOSTLY_Q4_1",
    "q5_0": "MOSTLY_Q5_0",
    "q5_1": "MOSTLY_Q5_1",
    "q2_k": "MOSTLY_Q2_K",
    "q3_k": "MOSTLY_Q3_K_S",
    "q4_k": "MOSTLY_Q4_K_S",
    "q5_k": "MOSTLY_Q5_K_S",
    "q6_k": "MOSTLY_Q6_K",
}


def file_type(type_name: str) -> Any:
    import gguf

    return gguf.LlamaFileType[FILE_TYPES[type_name]]


def write_gguf(
    path: Path,
    model: nn.Module,
    tokenizer: Any,
    records: dict[str, QuantizedWeight],
    type_name: str,
    float_type: str | None = None,
    fallback: str | None = None,
    pre_tokenizer: str = "auto",
    extra_metadata: dict[str, Any] | None = None,
    tokenizer_from: Path | None = None,
    share_head: bool = True,
) -> dict[str, Any]:
    """Write ``model`` (records packed exactly where ``type_name`` allows) to ``path``; return facts.
    ``tokenizer_from``: a GGUF source whose tokenizer is copied as it is (else it is built from
    ``tokenizer``'s tokenizer.json)."""
    plan = plan_tensors(model, records, type_name, float_type, fallback, share_head)
    writer, tok_facts = _write_header(path, model, tokenizer, plan, type_name, pre_tokenizer, extra_metadata, tokenizer_from)
    floats = {t.hf_name for t in plan.tensors if t.source not in ("record", "dequantized", "fallback")}
    # The plan follows the state dict's order; the float tensors are read one streamed unit at a time.
    streamed = ((name, tensor) for name, tensor in tensors(model, keep_tied=True) if name in floats)
    pending = dict.fromkeys(floats)
    for t in plan.tensors:
        module = t.record_name
        if t.hf_name in floats:
            while pending.get(t.hf_name) is None:
                name, tensor = next(streamed)
                pending[name] = tensor
        if t.source == "record":
            data = PACKERS[t.type_name](permuted_record(records[module].cpu(), t.permute_heads))
        else:
            tensor = records[module].dequantize() if t.source in ("dequantized", "fallback") else pending.pop(t.hf_name)
            if t.permute_heads is not None:
                tensor = permute_rows(tensor, t.permute_heads)
            if t.offset:
                tensor = tensor.to(torch.float32) + t.offset
            data = float_bytes(tensor, t.type_name)
            del tensor
        expected = t.info()[2]
        if data.nbytes != expected:  # a packer and the tensor table disagree: our bug, caught before the file is used
            raise FormatError(f"{t.hf_name}: {data.nbytes} bytes made for GGUF {t.type_name}, the tensor table says {expected}")
        writer.write_tensor_data(data)
        del data
    writer.close()
    return {
        "architecture": plan.arch.name,
        "type": type_name,
        "tensor_types": plan.counts(),
        "fallbacks": plan.fallbacks,
        "type_fallbacks": plan.type_fallbacks,
        "tokenizer": tok_facts,
        "plan": plan,
    }


def _write_header(
    path: Path,
    model: nn.Module,
    tokenizer: Any,
    plan: GGUFPlan,
    type_name: str,
    pre_tokenizer: str,
    extra_metadata: dict[str, Any] | None,
    tokenizer_from: Path | None,
) -> tuple[Any, dict[str, Any]]:
    """Open the GGUF writer and write everything before the tensor data: the header, the metadata
    (hyperparameters, tokenizer, ``extra_metadata``) and the tensor table from the plan's shapes and
    types (two passes, so that only one tensor's bytes are in memory at a time)."""
    import gguf

    writer = gguf.GGUFWriter(path, plan.arch.name)
    writer.add_name(str(getattr(model.config, "_name_or_path", "") or plan.arch.name))
    add_hyperparameters(writer, model, plan.arch)
    for method, value in plan.family_keys.items():
        getattr(writer, method)(value)
    if type_name == MIX:  # general.file_type is only shown by llama.cpp: the type holding the most weights names a mix
        weights: Counter[str] = Counter()
        for t in plan.tensors:
            if t.source == "record":
                weights[t.type_name] += math.prod(t.shape)
        type_name = weights.most_common(1)[0][0] if weights else "q8_0"
    writer.add_file_type(file_type(type_name))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    n_vocab = int(model.config.vocab_size)
    if tokenizer_from is not None:
        tok_facts = copy_tokenizer(writer, tokenizer_from, n_vocab, pre_tokenizer)
    else:
        tok_facts = add_tokenizer(writer, tokenizer, n_vocab, pre_tokenizer)
    for key, value in (extra_metadata or {}).items():
        writer.add_string(f"{METADATA_NAMESPACE}.{key}", value if isinstance(value, str) else json.dumps(value, sort_keys=True))
    for t in plan.tensors:
        info_shape, dtype, nbytes, raw = t.info()
        writer.add_tensor_info(t.gguf_name, info_shape, dtype, nbytes, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    return writer, tok_facts


def write_metadata_only(path: Path, model: nn.Module, tokenizer: Any, pre_tokenizer: str = "auto") -> int:
    """Bytes a GGUF file of ``model`` holds before its tensor data (what a size budget leaves out
    for the tensors), measured by writing that part alone to ``path``."""
    plan = plan_tensors(model, {}, "q8_0", None, None)  # names and shapes; types do not change the table's size
    writer, _ = _write_header(path, model, tokenizer, plan, "q8_0", pre_tokenizer, None, None)
    writer.close()
    return path.stat().st_size


def tensor_totals(path: Path) -> tuple[int, int]:
    """A GGUF file's tensor data bytes and parameter count (llama.cpp's bits per weight: bytes x 8 / parameters)."""
    import gguf

    tensors = gguf.GGUFReader(str(path)).tensors
    return sum(int(t.n_bytes) for t in tensors), sum(int(t.n_elements) for t in tensors)


def stored_types(path: Path) -> dict[str, str]:
    """The type of every tensor of a GGUF file (lower-case ggml names), by tensor name."""
    import gguf

    return {t.name: t.tensor_type.name.lower() for t in gguf.GGUFReader(path).tensors}


def stored_type_counts(path: Path) -> dict[str, int]:
    """Tensor types in a GGUF file, counted (lower-case ggml names)."""
    return dict(Counter(stored_types(path).values()))


def check_gguf_records(path: Path, plan: GGUFPlan, records: dict[str, QuantizedWeight]) -> list[str]:
    """Read the file back with gguf's own dequantizer and compare every exactly packed record
    with the record's values (Q4_1: with ``m`` rounded to fp16, as stored). Returns problems."""
    import gguf
    from gguf import quants

    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    problems = []
    with open(path, "rb") as f:
        for t in plan.tensors:
            if t.source != "record":
                continue
            stored = by_name.get(t.gguf_name)
            if stored is None:
                problems.append(f"{t.gguf_name} missing")
                continue
            record = permuted_record(records[t.record_name].cpu(), t.permute_heads)
            got = quants.dequantize(_read_data(f, stored), stored.tensor_type).reshape(record.shape)
            problems += _differences(t, record, got)
    return problems


def _read_data(f: Any, stored: Any) -> np.ndarray:
    """A tensor's bytes read from the open file into fresh memory, shaped as the reader's memory-mapped
    view (reading every tensor through the map kept the whole file resident until the check ended)."""
    raw = np.empty(stored.data.shape, dtype=stored.data.dtype)
    f.seek(int(stored.data_offset))
    if f.readinto(memoryview(raw).cast("B")) != raw.nbytes:
        raise FormatError(f"{stored.name}: the file ends inside its data")
    return raw


def _differences(t: TensorPlan, record: QuantizedWeight, got: np.ndarray) -> list[str]:
    """How the values llama.cpp's own dequantization reads back (``got``) differ from the record's."""
    problems: list[str] = []
    if not record.plain:  # on the type's own grid: the record's values exactly
        want = record.dequantize().numpy()
        if not np.array_equal(got, want):
            problems.append(f"{t.gguf_name}: {int((got != want).sum())} values differ from the record")
        return problems
    codes, scale, zero = block_params(record)
    d = scale.astype(np.float16).astype(np.float32)[..., None]
    q = codes.reshape(codes.shape[0], -1, BLOCK).astype(np.float32)
    if t.type_name in ("q4_1", "q5_1"):
        want = q * d + (-zero[..., None] * d).astype(np.float16).astype(np.float32)
    else:
        want = (q - zero[..., None]) * d
    want = want.reshape(record.shape)
    if not np.array_equal(got, want):
        problems.append(f"{t.gguf_name}: {int((got != want).sum())} values differ from the record")
    return problems
