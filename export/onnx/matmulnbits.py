"""ONNX Runtime's ``MatMulNBits`` weight layout (com.microsoft domain): pure packing functions.

``Y = A · Wᵀ`` with ``W[n, k] = (q[n, k] − zp[n, b]) · scale[n, b]`` for ``b = k // block_size``:

- ``B``: uint8 ``[N, k_blocks, block_size · bits / 8]``; for 4 bits, element ``2j`` of a block sits in the
  low nibble of byte ``j`` and element ``2j + 1`` in the high nibble; for 8 bits one byte each. A
  partial last block (K not a multiple of ``block_size``) is padded; the padding is never read.
- ``scales``: ``[N · k_blocks]`` (or ``[N, k_blocks]``) in A's dtype.
- ``zero_points``: uint8, ``ceil(k_blocks · bits / 8)`` bytes a row, packed like ``B``; absent means
  ``2**(bits − 1)`` (8 for 4 bits, 128 for 8 bits).

A record's group maps onto blocks exactly when the group size is a multiple of the block size:
the group's scale and zero point are repeated over its blocks (a per-channel record repeats one
scale over every block of its row). Nothing is re-quantized.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from compress.errors import FormatError
from compress.quantizers.core import QuantizedWeight

BLOCK_SIZES = (16, 32, 64, 128, 256)  # what the contrib op accepts (powers of two, at least 16)
BITS = (4, 8)


@dataclass
class Blocks:
    """One MatMulNBits weight, unpacked: codes [N, K] and per-block scales / zero points [N, k_blocks]."""

    codes: np.ndarray  # uint8 [N, K]
    scales: np.ndarray  # float32 [N, k_blocks]
    zero_points: np.ndarray  # uint8 [N, k_blocks]
    bits: int
    block_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    def dequantize(self) -> np.ndarray:
        """W [N, K] in float32."""
        k = self.shape[1]
        scales = np.repeat(self.scales, self.block_size, axis=1)[:, :k]
        zeros = np.repeat(self.zero_points.astype(np.float32), self.block_size, axis=1)[:, :k]
        return (self.codes.astype(np.float32) - zeros) * scales


def common_block_size(records: dict[str, QuantizedWeight]) -> int:
    """The largest block size that splits every record's groups and input width evenly: the builder
    quantizes a MatMul only when its width is a whole number of blocks, and a group spanning whole
    blocks maps onto them exactly (a partial last group of 64 in a row of 576 with groups of 128 →
    blocks of 64)."""
    for size in reversed(BLOCK_SIZES):
        if all((r.scheme.group_size is None or r.scheme.group_size % size == 0) and r.shape[1] % size == 0 for r in records.values()):
            return size
    widths = sorted({(r.scheme.group_size, r.shape[1]) for r in records.values()}, key=str)
    raise FormatError(
        f"no MatMulNBits block size ({', '.join(map(str, BLOCK_SIZES))}) divides every (group size, input width): {widths[:4]}"
    )


def record_blocks(record: QuantizedWeight, block_size: int) -> Blocks:
    """The record as MatMulNBits blocks (exact: the group's scale and zero point repeated over its blocks)."""
    bits = record.scheme.bits
    if bits not in BITS:
        raise FormatError(f"{record.scheme.describe()}: MatMulNBits holds {' or '.join(map(str, BITS))}-bit codes")
    out_f, in_f = record.shape
    group = record.scheme.group_width(in_f)
    if record.scheme.group_size is not None and group % block_size:
        raise FormatError(f"{record.scheme.describe()}: groups of {group} do not split into blocks of {block_size}")
    k_blocks = math.ceil(in_f / block_size)
    index = torch.arange(k_blocks) * block_size // group  # the group each block lies in
    scales = record.scale.to(torch.float32)[:, index]
    zeros = record.zero_point[:, index]
    return Blocks(record.codes.numpy(), scales.numpy(), zeros.numpy(), bits, block_size)


def concat_rows(parts: list[Blocks]) -> Blocks:
    """Blocks of several weights stacked along N (the builder fuses q/k/v into one MatMulNBits)."""
    first = parts[0]
    if any(p.bits != first.bits or p.block_size != first.block_size or p.shape[1] != first.shape[1] for p in parts):
        raise FormatError(
            "fused weights need the same bits, block size and input width: "
            + ", ".join(f"{p.bits}-bit block {p.block_size} K={p.shape[1]}" for p in parts)
        )
    return Blocks(
        np.concatenate([p.codes for p in parts]),
        np.concatenate([p.scales for p in parts]),
        np.concatenate([p.zero_points for p in parts]),
        first.bits,
        first.block_size,
    )


def _pack_fields(values: np.ndarray, bits: int, width: int) -> np.ndarray:
    """uint8 fields [rows, n] → bytes [rows, width] (two 4-bit fields a byte, low nibble first)."""
    rows, n = values.shape
    per_byte = 8 // bits
    padded = np.zeros((rows, width * per_byte), dtype=np.uint8)
    padded[:, :n] = values
    if bits == 8:
        return padded
    return (padded[:, 0::2] | (padded[:, 1::2] << 4)).astype(np.uint8)


def _unpack_fields(data: np.ndarray, bits: int, n: int) -> np.ndarray:
    if bits == 8:
        return data[:, :n]
    out = np.empty((data.shape[0], data.shape[1] * 2), dtype=np.uint8)
    out[:, 0::2] = data & 0x0F
    out[:, 1::2] = data >> 4
    return out[:, :n]


def pack(blocks: Blocks, with_zero_points: bool = True) -> dict[str, np.ndarray]:
    """The node's initializers: ``B`` [N, k_blocks, blob], ``scales`` [N·k_blocks] float32 and, unless every
    zero point is the default ``2**(bits−1)`` and ``with_zero_points`` is False, ``zero_points``."""
    n, k = blocks.shape
    k_blocks = math.ceil(k / blocks.block_size)
    blob = blocks.block_size * blocks.bits // 8
    padded = np.zeros((n, k_blocks * blocks.block_size), dtype=np.uint8)
    padded[:, :k] = blocks.codes
    # the padding of a partial last block is never read; zero-point codes keep it a zero weight anyway
    padded[:, k:] = blocks.zero_points[:, -1:]
    packed = _pack_fields(padded.reshape(n * k_blocks, blocks.block_size), blocks.bits, blob).reshape(n, k_blocks, blob)
    out = {"B": packed, "scales": blocks.scales.reshape(-1).astype(np.float32)}
    default = 1 << (blocks.bits - 1)
    if with_zero_points or bool((blocks.zero_points != default).any()):
        width = math.ceil(k_blocks * blocks.bits / 8)
        out["zero_points"] = _pack_fields(blocks.zero_points, blocks.bits, width).reshape(-1)
    return out


def unpack(b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, n: int, k: int, bits: int, block_size: int) -> Blocks:
    """Inverse of :func:`pack`, reading a node's initializers as ONNX Runtime does."""
    k_blocks = math.ceil(k / block_size)
    blob = block_size * bits // 8
    if b.dtype != np.uint8 or b.size != n * k_blocks * blob:
        raise FormatError(f"MatMulNBits B holds {b.size} {b.dtype} values; expected uint8 [{n}, {k_blocks}, {blob}]")
    codes = _unpack_fields(b.reshape(n * k_blocks, blob), bits, block_size).reshape(n, k_blocks * block_size)[:, :k]
    scale = np.asarray(scales, dtype=np.float32).reshape(n, k_blocks)
    if zero_points is None:
        zeros = np.full((n, k_blocks), 1 << (bits - 1), dtype=np.uint8)
    elif zero_points.dtype == np.uint8:
        zeros = _unpack_fields(zero_points.reshape(n, -1), bits, k_blocks)
    else:  # float zero points (an AWQ-style layout we never write)
        raise FormatError(f"MatMulNBits zero points of dtype {zero_points.dtype} are not integer codes")
    return Blocks(np.ascontiguousarray(codes), scale, np.ascontiguousarray(zeros), bits, block_size)


def differences(expected: Blocks, got: Blocks) -> list[str]:
    """What differs between two blocked weights (empty when codes, scales and zero points are identical)."""
    if expected.shape != got.shape or expected.bits != got.bits:
        return [f"shape/bits {expected.shape}/{expected.bits} vs {got.shape}/{got.bits}"]
    if expected.block_size != got.block_size:
        return [f"block size {expected.block_size} vs {got.block_size}"]
    problems = []
    for name in ("codes", "scales", "zero_points"):
        a, b = getattr(expected, name), getattr(got, name)
        if not np.array_equal(a, b):
            problems.append(f"{name}: {int((a != b).sum())} of {a.size} differ")
    return problems
