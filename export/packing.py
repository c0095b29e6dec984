"""Bit packing shared by the checkpoint formats: pure functions on integer tensors.

compressed-tensors ``pack-quantized``, AutoGPTQ/GPTQModel and AutoAWQ all store unsigned
``bits``-bit fields in int32 words as one little-endian bit stream: field ``i`` of a run along
the packed dimension occupies stream bits ``[i*bits, (i+1)*bits)``, where bit ``k`` of the
stream is bit ``k % 32`` (counted from the least significant) of word ``k // 32``. For 2, 4 and 8
bits that is ``32 // bits`` whole fields per word; for 3 bits (and 5, 6, 7) a field may straddle
two words (AutoGPTQ's 3-bit layout: 32 fields in 3 words, fields 10 and 21 split). The last
word of a run is zero-padded.

AutoAWQ additionally interleaves the eight 4-bit fields of a word; that permutation lives in
``checkpoint/autoawq.py``, on top of these functions.
"""

from __future__ import annotations

import math

import torch

WORD_BITS = 32
_WORD_MASK = (1 << WORD_BITS) - 1


def packed_length(count: int, bits: int) -> int:
    """int32 words needed for ``count`` fields of ``bits`` bits."""
    return math.ceil(count * bits / WORD_BITS)


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bit packing supports 1..8 bits per field, got {bits}")


def pack_int32(values: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Pack unsigned ``bits``-bit fields of ``values`` along ``dim`` into int32 words.

    ``values`` holds integers in ``[0, 2**bits)`` (any integer dtype). The result has the same
    shape except ``dim``, which becomes ``ceil(n * bits / 32)`` words.
    """
    _check_bits(bits)
    v = values.to(torch.int64)
    if v.numel() and (int(v.min()) < 0 or int(v.max()) >= 1 << bits):
        raise ValueError(f"values must lie in [0, {(1 << bits) - 1}] to pack into {bits} bits")
    v = v.movedim(dim, -1)
    n = v.shape[-1]
    n_words = packed_length(n, bits)
    start = torch.arange(n, dtype=torch.int64, device=v.device) * bits
    word, offset = start // WORD_BITS, start % WORD_BITS
    words = torch.zeros((*v.shape[:-1], n_words + 1), dtype=torch.int64, device=v.device)
    # Fields never overlap, so adding their shifted bits equals OR-ing them.
    words.index_add_(-1, word, (v << offset) & _WORD_MASK)
    spill = offset + bits > WORD_BITS
    if bool(spill.any()):
        words.index_add_(-1, word[spill] + 1, v[..., spill] >> (WORD_BITS - offset[spill]))
    words = words[..., :n_words]
    words = torch.where(words >= 1 << 31, words - (1 << WORD_BITS), words)  # two's complement int32
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def unpack_int32(words: torch.Tensor, bits: int, count: int, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: ``count`` unsigned fields along ``dim``, as int32."""
    _check_bits(bits)
    if words.dtype != torch.int32:
        raise ValueError(f"packed words must be int32, got {words.dtype}")
    w = words.to(torch.int64).movedim(dim, -1) & _WORD_MASK
    if w.shape[-1] < packed_length(count, bits):
        raise ValueError(f"{w.shape[-1]} words hold fewer than {count} fields of {bits} bits")
    w = torch.nn.functional.pad(w, (0, 1))  # a zero word for the spill of the last field
    start = torch.arange(count, dtype=torch.int64, device=w.device) * bits
    word, offset = start // WORD_BITS, start % WORD_BITS
    low = w.index_select(-1, word) >> offset
    high = (w.index_select(-1, word + 1) << (WORD_BITS - offset)) & _WORD_MASK
    fields = (low | high) & ((1 << bits) - 1)
    return fields.to(torch.int32).movedim(-1, dim).contiguous()
