"""AutoAWQ GEMM checkpoints (``quant_method: awq``, ``version: gemm``): reader.

Layout of one quantized Linear ``<layer>`` with ``in`` inputs, ``out`` outputs and groups of
``group_size`` inputs (AutoAWQ ``WQLinear_GEMM.from_linear``, 4 bits):

* ``<layer>.qweight`` int32 [in, out/8]: codes of each INPUT row packed along the OUTPUT dim,
  eight 4-bit fields per word, interleaved: field ``i`` (bits ``4i..4i+3``) of word ``c`` holds
  output column ``8c + AWQ_ORDER[i]`` with ``AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)``;
* ``<layer>.qzeros`` int32 [in/group_size, out/8]: zero points, packed and interleaved the same
  way, stored as they are (no offset);
* ``<layer>.scales`` float16 [in/group_size, out].

``w[o, i] = scales[g, o] * (code[i, o] - zero[g, o])`` with ``g = i // group_size``. GEMM
checkpoints are always asymmetric (``zero_point: true``) and 4-bit.
"""

from __future__ import annotations

from typing import Any

import torch

from compress.errors import FormatError
from compress.export.checkpoint.hf_checkpoint import ImportedRecords, build_record, layers_with, scale_dtype_name
from compress.export.packing import unpack_int32
from compress.quantizers.core import QuantizedWeight
from compress.schema.quantize import QuantScheme

METHOD = "awq"
GEMM = "gemm"
BITS = 4
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FIELDS_PER_WORD = len(AWQ_ORDER)


class Key:
    QWEIGHT = "qweight"
    QZEROS = "qzeros"
    SCALES = "scales"
    VERSION = "version"
    ZERO_POINT = "zero_point"
    # AutoAWQ's own quant_config.json spells some keys differently from config.json
    BITS = ("bits", "w_bit")
    GROUP_SIZE = ("group_size", "q_group_size")


def deinterleave(fields: torch.Tensor) -> torch.Tensor:
    """Fields [..., n] in AWQ storage order -> values [..., n] in column order (n a multiple of 8)."""
    inverse = [AWQ_ORDER.index(j) for j in range(FIELDS_PER_WORD)]
    blocks = fields.reshape(*fields.shape[:-1], -1, FIELDS_PER_WORD)
    return blocks[..., inverse].reshape(fields.shape)


def unpack_awq(words: torch.Tensor, columns: int) -> torch.Tensor:
    """[rows, columns/8] int32 words -> [rows, columns] 4-bit values in column order."""
    return deinterleave(unpack_int32(words, BITS, columns, dim=1))


def unpack_record(tensors: dict[str, torch.Tensor], group_size: int, where: str) -> QuantizedWeight:
    qweight, qzeros, scales = tensors[Key.QWEIGHT], tensors[Key.QZEROS], tensors[Key.SCALES]
    in_f, out_f = int(qweight.shape[0]), int(scales.shape[1])
    scheme = QuantScheme(bits=BITS, group_size=group_size, symmetric=False, scale_dtype=scale_dtype_name(scales, where))
    expect = (scheme.n_groups(in_f), out_f)
    if tuple(scales.shape) != expect or tuple(qzeros.shape) != (expect[0], out_f // FIELDS_PER_WORD) or out_f % FIELDS_PER_WORD:
        raise FormatError(
            f"{where}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales {tuple(scales.shape)} "
            f"do not fit {in_f} inputs x {out_f} outputs in groups of {group_size}"
        )
    codes = unpack_awq(qweight, out_f).t()
    zero = unpack_awq(qzeros, out_f).t()
    return build_record(codes, scales.t(), zero, scheme, where)


def _first(qcfg: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((qcfg[k] for k in keys if k in qcfg), None)


def read(qcfg: dict[str, Any], tensors: dict[str, torch.Tensor], where: str) -> ImportedRecords:
    """Records of every ``<layer>.qweight`` in an AutoAWQ GEMM checkpoint."""
    version = str(qcfg.get(Key.VERSION, GEMM)).lower()
    if version != GEMM:
        raise FormatError(f"{where}: AWQ version '{version}' has a kernel-specific layout; compress reads '{GEMM}' checkpoints")
    bits, group = _first(qcfg, Key.BITS), _first(qcfg, Key.GROUP_SIZE)
    if bits is not None and int(bits) != BITS:
        raise FormatError(f"{where}: AWQ GEMM checkpoints are {BITS}-bit, this one says {bits}")
    if not qcfg.get(Key.ZERO_POINT, True):
        raise FormatError(f"{where}: zero_point: false is not a GEMM layout compress reads (GEMM stores zero points)")
    if group is None or int(group) < 1:
        raise FormatError(f"{where}: AWQ config needs a positive group_size, got {group}")
    found = ImportedRecords(records={})
    for name in layers_with(tensors, Key.QWEIGHT):
        layer = {s: tensors.get(f"{name}.{s}") for s in (Key.QWEIGHT, Key.QZEROS, Key.SCALES)}
        if any(t is None for t in layer.values()):
            raise FormatError(f"{where}: layer {name} has qweight without qzeros and scales")
        found.records[name] = unpack_record(layer, int(group), f"{where}: layer {name}")
        found.consumed.update(f"{name}.{s}" for s in layer)
    found.facts = {"format": METHOD, "version": GEMM}
    return found
