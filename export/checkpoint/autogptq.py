"""AutoGPTQ / GPTQModel checkpoints (``quant_method: gptq``): writer of the v1 layout, reader of v1 and v2.

Layout of one quantized Linear ``<layer>`` with ``in`` inputs, ``out`` outputs and ``G`` groups
(AutoGPTQ ``qlinear_cuda_old.QuantLinear.pack`` / GPTQModel ``nn_modules/qlinear``):

* ``<layer>.qweight`` int32 [in*bits/32, out]: the unsigned codes of each output column packed
  along the INPUT dim as one little-endian bit stream (``packing.py``; 3-bit fields straddle words);
* ``<layer>.qzeros`` int32 [G, out*bits/32]: zero points packed along the OUTPUT dim; checkpoint
  format ``gptq`` (v1) stores ``zero - 1`` (readers add 1 back), ``gptq_v2`` stores ``zero``;
* ``<layer>.scales`` float16 [G, out];
* ``<layer>.g_idx`` int32 [in]: the group of each input column; ``i // group_size`` unless the
  checkpoint was quantized with act-order (``desc_act``);
* ``G = ceil(in / group_size)`` (``group_size: -1`` = one group per row), so a row may end in a
  partial group; symmetric (``sym: true``) means every zero point is ``2**(bits-1)``.

``w[o, i] = scales[g, o] * (code[i, o] - zero[g, o])`` with ``g = g_idx[i]``.

Limits of the writer: one scheme for the whole checkpoint (the config has one ``bits`` /
``group_size`` / ``sym``); bits 2, 3, 4, 8; float16 scales; ``in*bits`` and ``out*bits`` whole
32-bit words; every Linear except the output head quantized (GPTQ loaders convert all of them);
asymmetric zero points >= 1, because v1 stores ``zero - 1`` and a zero point of 0 would wrap.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress import __version__
from compress.errors import FormatError
from compress.export.checkpoint.hf_checkpoint import (
    QUANT_METHOD,
    ImportedRecords,
    build_record,
    layers_with,
    packed_tensors,
    scale_dtype_name,
    write_checkpoint,
)
from compress.export.packing import WORD_BITS, pack_int32, unpack_int32
from compress.quantizers.core import QuantizedWeight
from compress.quantizers.kv_cache import KVCacheScheme
from compress.schema.quantize import QuantScheme

METHOD = "gptq"
FORMAT_V1 = "gptq"
FORMAT_V2 = "gptq_v2"
ZERO_OFFSET = {FORMAT_V1: 1, FORMAT_V2: 0}  # stored = zero - offset
SUPPORTED_BITS = (2, 3, 4, 8)
PER_CHANNEL = -1
QUANTIZE_CONFIG_FILE = "quantize_config.json"  # AutoGPTQ's own copy of the config


class Key:
    QWEIGHT = "qweight"
    QZEROS = "qzeros"
    SCALES = "scales"
    G_IDX = "g_idx"
    BITS = "bits"
    GROUP_SIZE = "group_size"
    SYM = "sym"
    DESC_ACT = "desc_act"
    CHECKPOINT_FORMAT = "checkpoint_format"
    LM_HEAD = "lm_head"


# --------------------------------------------------------------------------- pure conversion


def group_index(in_features: int, scheme: QuantScheme) -> torch.Tensor:
    return (torch.arange(in_features) // scheme.group_width(in_features)).to(torch.int32)


def pack_record(record: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The record as v1 tensors keyed by suffix (``qweight``, ``qzeros``, ``scales``, ``g_idx``)."""
    s = record.scheme
    return {
        Key.QWEIGHT: pack_int32(record.codes.t(), s.bits, dim=0),
        Key.QZEROS: pack_int32(record.zero_point.t().to(torch.int32) - ZERO_OFFSET[FORMAT_V1], s.bits, dim=1),
        Key.SCALES: record.scale.t().contiguous(),
        Key.G_IDX: group_index(record.shape[1], s),
    }


def unpack_record(
    tensors: dict[str, torch.Tensor], bits: int, group_size: int | None, symmetric: bool, checkpoint_format: str, where: str
) -> QuantizedWeight:
    """A record from one layer's tensors (by suffix) and the checkpoint's scheme."""
    qweight, qzeros, scales = tensors[Key.QWEIGHT], tensors[Key.QZEROS], tensors[Key.SCALES]
    out_f = int(scales.shape[1])
    in_f = int(tensors[Key.G_IDX].numel()) if Key.G_IDX in tensors else int(qweight.shape[0]) * WORD_BITS // bits
    scheme = QuantScheme(bits=bits, group_size=group_size, symmetric=symmetric, scale_dtype=scale_dtype_name(scales, where))
    if tuple(scales.shape) != (scheme.n_groups(in_f), out_f):
        raise FormatError(
            f"{where}: scales have shape {tuple(scales.shape)}, expected {(scheme.n_groups(in_f), out_f)} "
            f"for {in_f} inputs in groups of {group_size or in_f}"
        )
    if Key.G_IDX in tensors and not torch.equal(tensors[Key.G_IDX].to(torch.int32), group_index(in_f, scheme)):
        raise FormatError(
            f"{where}: g_idx is not the contiguous arange(in) // group_size: the checkpoint was quantized with act-order "
            "(desc_act) and groups hold scattered input columns. Records keep groups of consecutive columns, and "
            "reordering the columns would change the model, so it cannot be imported exactly. Use a checkpoint made "
            "with desc_act=false (or static_groups=true), or load it with transformers as a float model."
        )
    codes = unpack_int32(qweight, bits, in_f, dim=0).t()
    zero = unpack_int32(qzeros, bits, out_f, dim=1).t() + ZERO_OFFSET[checkpoint_format]
    if int(zero.max()) > scheme.qmax:
        raise FormatError(
            f"{where}: a stored zero point of {scheme.qmax} means {scheme.qmax + 1} in {checkpoint_format}, outside "
            f"the {bits}-bit range (a v1 writer wrapped a zero point of 0); it cannot be imported exactly"
        )
    return build_record(codes, scales.t(), zero, scheme, where)


# --------------------------------------------------------------------------- writer


def _output_head(model: nn.Module) -> str | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return next((n for n, m in model.named_modules() if m is head), None) if head is not None else None


def check(model: nn.Module, records: dict[str, QuantizedWeight]) -> None:
    """Raise FormatError naming what a v1 GPTQ checkpoint cannot hold exactly."""
    schemes = {r.scheme for r in records.values()}
    if len(schemes) > 1:
        listed = "; ".join(sorted(s.describe() + f" ({s.scale_dtype})" for s in schemes))
        raise FormatError(
            f"gptq export: a GPTQ checkpoint has one scheme, these records use {len(schemes)}: {listed}. "
            "Quantize every layer with one scheme, or export compressed-tensors (one config group per scheme)."
        )
    scheme = next(iter(schemes))
    if scheme.bits not in SUPPORTED_BITS:
        raise FormatError(f"gptq export: {scheme.bits}-bit codes; GPTQ checkpoints hold {', '.join(map(str, SUPPORTED_BITS))} bits")
    if scheme.scale_dtype != "float16":
        raise FormatError(f"gptq export: GPTQ stores float16 scales, these are {scheme.scale_dtype}; quantize with scale_dtype: float16")
    head = _output_head(model)
    floats = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in records and n != head]
    if floats:
        raise FormatError(
            f"gptq export: GPTQ loaders quantize every Linear layer of the model, but {len(floats)} stay float "
            f"({', '.join(floats[:3])}); quantize them too, or export compressed-tensors, which lists float layers"
        )
    for name, rec in records.items():
        out_f, in_f = rec.shape
        for what, n in (("input", in_f), ("output", out_f)):
            if n * scheme.bits % WORD_BITS:
                raise FormatError(
                    f"gptq export: layer {name} has {n} {what} features; {n} x {scheme.bits} bits is not a whole "
                    f"number of 32-bit words, which GPTQ packing needs. Use another bit width or ignore the layer."
                )
        if not scheme.symmetric and bool((rec.zero_point == 0).any()):
            raise FormatError(
                f"gptq export: layer {name} has a zero point of 0, which GPTQ v1 (stores zero - 1) cannot hold; "
                "use symmetric: true, or export compressed-tensors"
            )


def quantization_config(model: nn.Module, records: dict[str, QuantizedWeight]) -> dict[str, Any]:
    scheme = next(iter(records.values())).scheme
    return {
        QUANT_METHOD: METHOD,
        Key.BITS: scheme.bits,
        Key.GROUP_SIZE: PER_CHANNEL if scheme.group_size is None else scheme.group_size,
        Key.DESC_ACT: False,
        Key.SYM: scheme.symmetric,
        "static_groups": False,
        "true_sequential": True,
        Key.CHECKPOINT_FORMAT: FORMAT_V1,
        Key.LM_HEAD: _output_head(model) in records,
        "meta": {"quantizer": [f"compress:{__version__}"]},
    }


def write(
    directory: Path, model: nn.Module, tokenizer: Any, records: dict[str, QuantizedWeight], kv: KVCacheScheme | None = None
) -> dict[str, Any] | None:
    """Write a v1 GPTQ HF directory (config.json ``quantization_config`` plus ``quantize_config.json``).
    The format has no KV-cache field: with a KV scheme, returns why it is not carried."""
    check(model, records)
    config = quantization_config(model, records)
    write_checkpoint(directory, model, tokenizer, records, packed_tensors(records, pack_record), config)
    (directory / QUANTIZE_CONFIG_FILE).write_text(json.dumps({**config, "model_file_base_name": "model"}, indent=2) + "\n")
    return None if kv is None else {"carried": False, "why": "the gptq checkpoint format has no KV-cache field"}


# --------------------------------------------------------------------------- reader


def read(qcfg: dict[str, Any], tensors: dict[str, torch.Tensor], where: str) -> ImportedRecords:
    """Records of every ``<layer>.qweight`` in a GPTQ v1 or v2 checkpoint."""
    bits = int(qcfg.get(Key.BITS, 0))
    if bits not in SUPPORTED_BITS:
        raise FormatError(f"{where}: gptq bits {qcfg.get(Key.BITS)}; compress reads {', '.join(map(str, SUPPORTED_BITS))}")
    fmt = qcfg.get(Key.CHECKPOINT_FORMAT) or FORMAT_V1
    if fmt not in ZERO_OFFSET:
        raise FormatError(
            f"{where}: checkpoint_format '{fmt}' is a kernel-specific layout; compress reads "
            f"{' and '.join(ZERO_OFFSET)} (convert it back with GPTQModel first)"
        )
    group = int(qcfg.get(Key.GROUP_SIZE, PER_CHANNEL))
    group_size = None if group == PER_CHANNEL else group
    symmetric = bool(qcfg.get(Key.SYM, True))
    found = ImportedRecords(records={})
    for name in layers_with(tensors, Key.QWEIGHT):
        layer = {s: tensors[f"{name}.{s}"] for s in (Key.QWEIGHT, Key.QZEROS, Key.SCALES, Key.G_IDX) if f"{name}.{s}" in tensors}
        if Key.QZEROS not in layer or Key.SCALES not in layer:
            raise FormatError(f"{where}: layer {name} has qweight without qzeros and scales")
        found.records[name] = unpack_record(layer, bits, group_size, symmetric, fmt, f"{where}: layer {name}")
        found.consumed.update(f"{name}.{s}" for s in layer)
    found.facts = {"format": METHOD, "checkpoint_format": fmt, "desc_act": bool(qcfg.get(Key.DESC_ACT, False))}
    return found
