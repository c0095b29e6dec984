"""GGUF block packing and unpacking: a record's codes and stored parameters laid out in ggml's byte
order for its block type (the packers, ``PACKERS``), whether a record maps onto a type exactly
(``record_problem``), the values a type's blocks of a plain record decode to (``plain_values``, what
the read-back check compares gguf-py's dequantization with), and float tensors in F32 / F16 / Q8_0.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from compress.errors import FormatError
from compress.quantizers.core import QuantizedWeight
from compress.quantizers.fp4 import FP4Weight
from compress.quantizers.grids import GRIDS, SUPER_BLOCK

# Block layouts (ggml, 32 weights a block, little-endian):
#
# * Q4_0 — fp16 ``d``, then 16 bytes: byte ``j`` holds weight ``j`` in its low nibble and weight
#   ``j+16`` in its high nibble; ``w = (q - 8) · d``. A symmetric 4-bit record is exactly this with
#   ``d`` = the group's scale (our symmetric zero point is 8).
# * Q4_1 — fp16 ``d``, fp16 ``m``, 16 nibble bytes as Q4_0; ``w = q · d + m``. An asymmetric record
#   ``(q - z) · s`` becomes ``d = s``, ``m = fp16(-z · s)``: the rounding of ``m`` to fp16 is the
#   only difference from the record (zero when ``z · s`` is representable).
# * Q8_0 — fp16 ``d``, 32 int8; ``w = i · d``. A record with ``|q - z| ≤ 127`` everywhere (any
#   record of at most 7 bits, or 8-bit symmetric) is exactly ``d = s``, ``i = q - z``.
# * Q5_0 / Q5_1 — as Q4_0 / Q4_1 with the fifth bit of the 32 codes in 4 bytes ``qh``.
# * K-quants (256 weights, quantizers/grids.py) hold only records on their own grid, which carry the
#   stored fp16 ``d`` / ``dmin`` and integer sub-block scales (``record.super_blocks``); the packers
#   below only lay those values and the codes out in llama.cpp's byte order.
#
# * MXFP4 — one E8M0 byte ``e``, then 16 bytes as Q4_0's nibbles (weight ``j`` low, ``j+16`` high); a
#   4-bit code indexes the doubled E2M1 values (0, 1, 2, 3, 4, 6, 8, 12, then their negatives) and
#   ``w = value · 2^(e-128)``: an fp4 stage's mxfp4 record (quantizers/fp4.py: the same code index,
#   ``w = e2m1 · 2^(E-127)``) is exactly ``e = E``, its codes re-ordered from pairs to Q4_0's halves.
#
# A group of our records may span several blocks (its scale is repeated), so any group size that
# is a multiple of 32 maps exactly, including a partial last group.

BLOCK = 32  # weights per legacy block


def ggml_type(name: str) -> Any:
    """gguf-py's ``GGMLQuantizationType`` of a grid or float type: the type of the same name."""
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


# ---- K-quants: super-blocks of SUPER_BLOCK weights; arrays below are [rows, super-blocks, ...]


def _k_params(record: QuantizedWeight, type_name: str) -> tuple[np.ndarray, ...]:
    """codes [rows, n, 256] uint8, d and dmin [rows, n] fp16 bytes' values, sub-block scales and mins [rows, n, subs] int."""
    grid = GRIDS[type_name]
    if record.scheme.gguf_type != type_name or record.super_blocks is None:
        raise FormatError(f"{type_name.upper()} blocks hold records on the {type_name.upper()} grid, not {record.scheme.describe()}")
    rows, in_f = record.shape
    n = in_f // SUPER_BLOCK
    sb = record.super_blocks
    codes = record.codes.cpu().numpy().reshape(rows, n, SUPER_BLOCK)
    subs = SUPER_BLOCK // grid.group
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


def pack_mxfp4(record: FP4Weight) -> np.ndarray:
    """MXFP4 bytes [out, blocks * 17] of an mxfp4 record (exact): its E8M0 byte, then 16 nibble bytes as Q4_0."""
    if not isinstance(record, FP4Weight) or record.format != "mxfp4":
        raise FormatError(f"MXFP4 blocks hold fp4 stages' mxfp4 records exactly, not {record.scheme.describe()}")
    codes = record.codes().cpu().numpy()
    out = np.concatenate([record.scale.cpu().numpy()[..., None], _nibbles(codes)], axis=-1)
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
    "mxfp4": pack_mxfp4,
}


def plain_values(record: QuantizedWeight, type_name: str) -> np.ndarray:
    """The values ``type_name`` blocks of a plain record decode to (the packers' inverse, as llama.cpp
    reads them): ``d`` rounded to fp16, and Q4_1 / Q5_1's ``m = fp16(-z · d)``."""
    codes, scale, zero = block_params(record)
    d = scale.astype(np.float16).astype(np.float32)[..., None]
    q = codes.reshape(codes.shape[0], -1, BLOCK).astype(np.float32)
    if type_name in ("q4_1", "q5_1"):
        want = q * d + (-zero[..., None] * d).astype(np.float16).astype(np.float32)
    else:
        want = (q - zero[..., None]) * d
    return want.reshape(record.shape)


def record_problem(record: QuantizedWeight, type_name: str) -> str | None:
    """Why ``record`` cannot become ``type_name`` blocks exactly, or None when it can."""
    if isinstance(record, FP4Weight) or type_name == "mxfp4":  # FP4 records and FP4 blocks go only together
        fmt = record.format if isinstance(record, FP4Weight) else None
        return None if fmt == type_name else f"{record.scheme.describe()} records are not {type_name.upper()} blocks"
    s, (_, in_f) = record.scheme, record.shape
    width = s.group_width(in_f)
    grid = GRIDS[type_name]
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
    """A float tensor in ``type_name``: f32, f16; bf16 and q8_0 by llama.cpp's reference rounding
    (gguf-py's); any other block type rounded on its grid with the quantizers' parameter search and
    packed like a record. Its ggml type is ``TensorPlan.info``'s."""
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
    if type_name in ("bf16", "q8_0"):
        return quants.quantize(w, ggml_type(type_name))
    from compress.quantizers.grid_search import grid_quantize
    from compress.schema.quantize import QuantScheme

    return PACKERS[type_name](grid_quantize(weight.to(torch.float32).cpu(), QuantScheme(gguf_type=type_name)))
