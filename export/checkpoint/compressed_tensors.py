"""compressed-tensors ``pack-quantized`` checkpoints (what vLLM and transformers load through the
``compressed-tensors`` package): writer, reader and the exact layout.

Layout of one quantized Linear ``<layer>`` (compressed-tensors 0.19,
``compressors/pack_quantized``; our packing is checked bit for bit against its ``pack_to_int32``
and our files are loaded by transformers in tests/test_formats.py):

* ``<layer>.weight_packed`` int32 [out, ceil(in*bits/32)]: compressed-tensors quantizes to the
  signed range [-2**(bits-1), 2**(bits-1)-1] and packs ``q + 2**(bits-1)``, which is exactly our
  unsigned code; packed densely along the input dim (``packing.py``);
* ``<layer>.weight_scale`` [out, n_groups] (per-channel: [out, 1]) in the records' scale dtype;
* ``<layer>.weight_zero_point``, asymmetric schemes only: int32 [ceil(out*bits/32), n_groups], the
  signed zero point offset back to unsigned (= our zero point), packed along the OUTPUT dim (0);
  symmetric schemes store none (signed zero 0 = our fixed ``2**(bits-1)``);
* ``<layer>.weight_shape`` int64 [2] = (out, in).

Dequantization is ``(q - zq) * scale`` with signed q and zq, equal to our ``(code - zero) * scale``.

Layers a ``w8a8`` stage quantized (their module declares ``input_activations``: dynamic per-token int8)
are written as compressed-tensors' ``int-quantized`` W8A8, the layout of llm-compressor's ``W8A8`` preset:
``<layer>.weight`` int8 [out, in] (the signed code ``q``), ``<layer>.weight_scale`` [out, 1], and the config
group's ``input_activations`` (int8, token, dynamic, symmetric), which vLLM runs as an int8 GEMM.
The artifact's own model/ holds their weights as pack-quantized (``write`` without ``activations``),
so that our reader imports it as weights; an exported int-quantized W8A8 checkpoint is read back exactly
(``read``) but refused as a model source (its activation quantization would be lost: readers.py).

Limits: compressed-tensors' group dequantization requires ``in_features % group_size == 0`` (it
has no partial last group); bits are 2, 4 or 8, the widths whose layout every release agrees on
(releases before the dense packer padded each word, so a 3-, 5-, 6- or 7-bit file would read
differently depending on the reader's version; vLLM's int kernels take 4 and 8).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.errors import CompressError, FormatError
from compress.export.checkpoint.hf_checkpoint import (
    QUANT_METHOD,
    ImportedRecords,
    build_record,
    layers_with,
    scale_dtype_name,
    write_checkpoint,
)
from compress.export.packing import pack_int32, unpack_int32
from compress.quantizers.compressed_tensors_args import LINEAR_TARGET, TOKEN_INT8_ACTIVATIONS, Strategy, weight_args
from compress.quantizers.core import QuantizedWeight
from compress.quantizers.kv_cache import KVCacheScheme
from compress.schema.patterns import regex_match
from compress.schema.quantize import QuantScheme

METHOD = "compressed-tensors"
PACK_FORMAT = "pack-quantized"
INT_FORMAT = "int-quantized"  # int8 weights stored as int8, with quantized input activations (W8A8)
MIXED_FORMAT = "mixed-precision"  # the checkpoint's format when its config groups use different ones
STATUS_COMPRESSED = "compressed"
SUPPORTED_BITS = (2, 4, 8)
REGEX_PREFIX = "re:"
KV_K_SCALE, KV_V_SCALE = "k_scale", "v_scale"  # per-attention-layer static KV scales, as vLLM loads them


class Key:
    """Per-layer tensor suffixes and config keys."""

    PACKED = "weight_packed"
    WEIGHT = "weight"  # int-quantized: the int8 codes themselves
    SCALE = "weight_scale"
    ZERO = "weight_zero_point"
    SHAPE = "weight_shape"
    G_IDX = "weight_g_idx"
    FORMAT = "format"
    STATUS = "quantization_status"
    GROUPS = "config_groups"
    IGNORE = "ignore"
    TARGETS = "targets"
    WEIGHTS = "weights"
    INPUTS = "input_activations"
    OUTPUTS = "output_activations"


# --------------------------------------------------------------------------- pure conversion


def pack_record(record: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The record as compressed-tensors tensors, keyed by suffix (``weight_packed``, ...)."""
    s = record.scheme
    out = {
        Key.PACKED: pack_int32(record.codes, s.bits, dim=1),
        Key.SCALE: record.scale.clone(),
        Key.SHAPE: torch.tensor(record.shape, dtype=torch.int64),
    }
    if not s.symmetric:
        out[Key.ZERO] = pack_int32(record.zero_point, s.bits, dim=0)
    return out


def pack_int_record(record: QuantizedWeight) -> dict[str, torch.Tensor]:
    """An 8-bit symmetric record as int-quantized tensors: the signed codes as int8 and the scales."""
    q = record.codes.to(torch.int16) - record.zero_point.to(torch.int16)
    return {Key.WEIGHT: q.to(torch.int8), Key.SCALE: record.scale.clone()}


def unpack_int_record(tensors: dict[str, torch.Tensor], weights: dict[str, Any], where: str) -> QuantizedWeight:
    """A record from one int-quantized layer's ``weight`` (int8) and ``weight_scale`` (per channel, symmetric)."""
    q, scale = tensors[Key.WEIGHT], tensors[Key.SCALE]
    if q.dtype != torch.int8 or q.dim() != 2 or weights.get("strategy") != Strategy.CHANNEL or not weights.get("symmetric", True):
        raise FormatError(f"{where}: int-quantized layers are read as int8 per-channel symmetric weights")
    if tuple(scale.shape) != (q.shape[0], 1):
        raise FormatError(f"{where}: {Key.SCALE} has shape {tuple(scale.shape)}, expected {(q.shape[0], 1)}")
    scheme = QuantScheme(bits=8, group_size=None, symmetric=True, scale_dtype=scale_dtype_name(scale, where))
    zero = torch.full((q.shape[0], 1), scheme.symmetric_zero, dtype=torch.int32)
    return build_record(q.to(torch.int32) + scheme.symmetric_zero, scale, zero, scheme, where)


def activation_args(model: nn.Module, records: dict[str, QuantizedWeight]) -> dict[str, dict[str, Any]]:
    """The ``input_activations`` each quantized layer's module declares (a w8a8 layer), by layer name."""
    found = {}
    for name in records:
        args = getattr(model.get_submodule(name), Key.INPUTS, None)
        if args is not None:
            found[name] = dict(args)
    return found


def unpack_record(tensors: dict[str, torch.Tensor], weights: dict[str, Any], where: str) -> QuantizedWeight:
    """A record from one layer's tensors (by suffix) and its config group's ``weights`` args."""
    bits, symmetric, strategy = int(weights["num_bits"]), bool(weights.get("symmetric", True)), weights.get("strategy")
    group = weights.get("group_size")
    out_f, in_f = (int(v) for v in tensors[Key.SHAPE].tolist())
    codes = unpack_int32(tensors[Key.PACKED], bits, in_f, dim=1)
    scale = tensors[Key.SCALE]
    if strategy == Strategy.GROUP:
        if not group or in_f % int(group):
            raise FormatError(f"{where}: {in_f} input features are not a whole number of groups of {group}")
        group_size: int | None = int(group)
    elif strategy in (Strategy.CHANNEL, Strategy.TENSOR):
        group_size = None
        scale = scale.reshape(-1, 1).expand(out_f, 1)  # a per-tensor scale is the same scale on every row
    else:
        raise FormatError(f"{where}: strategy '{strategy}' is not supported (group, channel and tensor are)")
    n_groups = math.ceil(in_f / (group_size or in_f))
    if tuple(scale.shape) != (out_f, n_groups):
        raise FormatError(f"{where}: {Key.SCALE} has shape {tuple(scale.shape)}, expected {(out_f, n_groups)}")
    offset = 2 ** (bits - 1)
    if symmetric:
        zero = torch.full((out_f, n_groups), offset, dtype=torch.int32)
    elif Key.ZERO not in tensors:
        raise FormatError(f"{where}: asymmetric scheme but no {Key.ZERO}")
    elif tensors[Key.ZERO].dtype == torch.int32:
        zero = unpack_int32(tensors[Key.ZERO], bits, out_f, dim=0).reshape(-1, n_groups).expand(out_f, n_groups)
    else:  # releases before zero-point packing stored signed int8 [out, n_groups] (or [1] per tensor)
        zero = (tensors[Key.ZERO].to(torch.int32) + offset).reshape(-1, n_groups).expand(out_f, n_groups)
    if Key.G_IDX in tensors:
        expected = torch.arange(in_f) // (group_size or in_f)
        if not torch.equal(tensors[Key.G_IDX].to(torch.int64).flatten(), expected):
            raise FormatError(
                f"{where}: {Key.G_IDX} assigns input columns to groups out of order (activation ordering); records keep "
                "groups of consecutive columns, and permuting the columns would change the model. Re-quantize without "
                "actorder=group, or load this checkpoint with transformers as a float model."
            )
    scheme = QuantScheme(bits=bits, group_size=group_size, symmetric=symmetric, scale_dtype=scale_dtype_name(scale, where))
    return build_record(codes, scale, zero, scheme, where)


# --------------------------------------------------------------------------- writer


def check(model: nn.Module, records: dict[str, QuantizedWeight]) -> None:
    """Raise FormatError naming the layers that pack-quantized cannot hold exactly."""
    bad_bits = sorted(n for n, r in records.items() if r.scheme.bits not in SUPPORTED_BITS)
    if bad_bits:
        bits = records[bad_bits[0]].scheme.bits
        raise FormatError(
            f"compressed-tensors export: {len(bad_bits)} layer(s) use {bits}-bit codes ({', '.join(bad_bits[:3])}); "
            f"pack-quantized is written for {', '.join(map(str, SUPPORTED_BITS))} bits. Quantize with bits 2, 4 or 8, "
            "or export gptq (2, 3, 4, 8 bits)."
        )
    partial = sorted(n for n, r in records.items() if r.scheme.group_size is not None and r.shape[1] % r.scheme.group_size)
    if partial:
        first = records[partial[0]]
        g = first.scheme.group_size
        fit = math.gcd(g, *(records[n].shape[1] for n in partial))
        raise FormatError(
            f"compressed-tensors export: layer {partial[0]} has {first.shape[1]} input features, not a multiple of "
            f"group_size {g} ({len(partial)} layer(s) like this: {', '.join(partial[:3])}); compressed-tensors has no "
            f"partial last group. Use a group_size that divides every quantized layer's width (e.g. {fit}), "
            "group_size: null (per-channel), ignore those layers, or export gptq, which stores partial groups."
        )


def check_activations(records: dict[str, QuantizedWeight], activations: dict[str, dict[str, Any]]) -> None:
    """Raise FormatError unless every layer with quantized activations is the int-quantized W8A8 layout."""
    for name, args in activations.items():
        s = records[name].scheme
        if args != TOKEN_INT8_ACTIVATIONS or (s.bits, s.group_size, s.symmetric, s.block_grid) != (8, None, True, None):
            raise FormatError(
                f"compressed-tensors export: layer {name} quantizes its activations as {args} with {s.describe()} weights; "
                "int-quantized is written for int8 per-channel symmetric weights with dynamic per-token int8 activations"
            )


def quantization_config(
    model: nn.Module, records: dict[str, QuantizedWeight], activations: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """config.json ``quantization_config``: one config group per scheme (and activation scheme: layers in
    ``activations`` are int-quantized W8A8); float Linears in ``ignore``."""
    activations = activations or {}
    by_scheme: dict[str, tuple[QuantScheme, dict[str, Any] | None, list[str]]] = {}
    for name, rec in records.items():
        inputs = activations.get(name)
        key = repr((sorted(weight_args(rec.scheme).items()), sorted((inputs or {}).items())))
        by_scheme.setdefault(key, (rec.scheme, inputs, []))[2].append(name)
    single = len(by_scheme) == 1
    groups = {
        f"group_{i}": {
            Key.TARGETS: [LINEAR_TARGET] if single else sorted(names),
            Key.WEIGHTS: weight_args(scheme),
            Key.INPUTS: inputs,
            Key.OUTPUTS: None,
            Key.FORMAT: PACK_FORMAT if inputs is None else INT_FORMAT,
        }
        for i, (scheme, inputs, names) in enumerate(by_scheme.values())
    }
    formats = {g[Key.FORMAT] for g in groups.values()}
    floats = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in records]
    return {
        QUANT_METHOD: METHOD,
        Key.FORMAT: formats.pop() if len(formats) == 1 else MIXED_FORMAT,
        Key.STATUS: STATUS_COMPRESSED,
        Key.GROUPS: groups,
        Key.IGNORE: floats,
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def write_grid_checkpoint(
    directory: Path, model: nn.Module, tokenizer: Any, records: dict[str, Any], qcfg: dict[str, Any], kv: KVCacheScheme | None
) -> dict[str, Any] | None:
    """The HF directory of a float-grid model (FP8, FP4: each record's ``tensors(name)``) under the
    ``quantization_config`` ``qcfg``, with the KV scheme's static scales when it has them; returns what
    was carried of the KV scheme (None without one)."""
    carried, kv_tensors = None, {}
    if kv is not None:
        qcfg["kv_cache_scheme"], kv_tensors, carried = kv_cache_tensors(model, kv)
    layers = ((k, t) for name, r in records.items() for k, t in r.tensors(name).items())
    write_checkpoint(directory, model, tokenizer, records, [*layers, *kv_tensors.items()], qcfg)
    return carried


def kv_cache_tensors(model: nn.Module, kv: KVCacheScheme) -> tuple[dict[str, Any] | None, dict[str, torch.Tensor], dict[str, Any]]:
    """``kv_cache_scheme`` and per-layer ``<attention>.k_scale``/``v_scale`` for a KV scheme with static
    scales (what vLLM reads); per-head scales become their layer maximum (compressed-tensors' tensor
    strategy). Returns (scheme or None, tensors, what was carried for the manifest)."""
    cfg = kv.config
    if not cfg.static_scales or kv.scales is None:
        return (
            None,
            {},
            {
                "carried": False,
                "why": "compressed-tensors carries static KV scales only (kv_cache.static_scales: true); "
                "with dynamic scales the runtime quantizes the cache itself",
            },
        )
    attn = [n for n, m in model.named_modules() if n.endswith("self_attn")]
    if len(attn) != kv.num_layers:
        return None, {}, {"carried": False, "why": f"found {len(attn)} self_attn modules for {kv.num_layers} cache layers"}
    tensors = {}
    for i, name in enumerate(attn):
        tensors[f"{name}.{KV_K_SCALE}"] = kv.scales["k_scale"][i].max().reshape(1).float()
        tensors[f"{name}.{KV_V_SCALE}"] = kv.scales["v_scale"][i].max().reshape(1).float()
    scheme = {
        "num_bits": 8,
        "type": "float" if cfg.format == "fp8" else "int",
        "strategy": "tensor",
        "dynamic": False,
        "symmetric": True,
        "group_size": None,
    }
    return (
        scheme,
        tensors,
        {
            "carried": True,
            "kv_cache_scheme": scheme,
            "layers": len(attn),
            "note": "one k_scale and v_scale per layer (the maximum of its per-head scales)",
        },
    )


def write(
    directory: Path,
    model: nn.Module,
    tokenizer: Any,
    records: dict[str, QuantizedWeight],
    kv: KVCacheScheme | None = None,
    activations: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any] | None:
    """Write a pack-quantized HF directory that transformers (with compressed-tensors) and vLLM load, the
    layers in ``activations`` int-quantized W8A8; with a KV scheme, also its ``kv_cache_scheme`` and
    scales. Returns what was carried of the KV scheme."""
    check(model, records)
    activations = activations or {}
    check_activations(records, activations)
    qcfg = quantization_config(model, records, activations)
    carried = None
    kv_tensors: dict[str, torch.Tensor] = {}
    if kv is not None:
        qcfg["kv_cache_scheme"], kv_tensors, carried = kv_cache_tensors(model, kv)

    def pack(name: str) -> dict[str, torch.Tensor]:
        return (pack_int_record if name in activations else pack_record)(records[name])

    layers = ((f"{name}.{suffix}", t) for name in records for suffix, t in pack(name).items())
    write_checkpoint(directory, model, tokenizer, records, itertools.chain(layers, kv_tensors.items()), qcfg)
    return carried


def write_export(
    directory: Path, model: nn.Module, tokenizer: Any, records: dict[str, QuantizedWeight], kv: KVCacheScheme | None = None
) -> dict[str, Any] | None:
    """The ``compressed-tensors`` export: ``write`` with the activation quantization the model's layers declare."""
    return write(directory, model, tokenizer, records, kv, activation_args(model, records))


def check_export(model: nn.Module, records: dict[str, QuantizedWeight]) -> None:
    check(model, records)
    check_activations(records, activation_args(model, records))


# --------------------------------------------------------------------------- reader


def read(qcfg: dict[str, Any], tensors: dict[str, torch.Tensor], where: str) -> ImportedRecords:
    """Records of every ``<layer>.weight_packed`` in a pack-quantized checkpoint, and of every int8
    ``<layer>.weight`` of an int-quantized W8A8 group (its input activations in ``facts``)."""
    status = qcfg.get(Key.STATUS)
    if status != STATUS_COMPRESSED:
        raise FormatError(f"{where}: quantization_status is '{status}'; only '{STATUS_COMPRESSED}' checkpoints hold packed weights")
    groups = qcfg.get(Key.GROUPS) or {}
    for gname, group in groups.items():
        fmt = group.get(Key.FORMAT) or qcfg.get(Key.FORMAT)
        if fmt not in (PACK_FORMAT, INT_FORMAT):
            raise FormatError(f"{where}: config group {gname} has format '{fmt}'; compress reads '{PACK_FORMAT}' and '{INT_FORMAT}'")
        weights = group.get(Key.WEIGHTS) or {}
        if weights.get("type", "int") != "int" or int(weights.get("num_bits", 0)) not in SUPPORTED_BITS:
            raise FormatError(
                f"{where}: config group {gname} stores {weights.get('type')} {weights.get('num_bits')}-bit weights; "
                f"compress reads int weights of {', '.join(map(str, SUPPORTED_BITS))} bits"
            )
        inputs = group.get(Key.INPUTS)
        if group.get(Key.OUTPUTS) or (inputs and (fmt != INT_FORMAT or _token_int8(inputs) is None)):
            raise FormatError(
                f"{where}: config group {gname} quantizes activations other than an int-quantized group's dynamic "
                "per-token int8 inputs, which compress does not read"
            )
    found = ImportedRecords(records={})
    int_groups = {g for g, group in groups.items() if (group.get(Key.FORMAT) or qcfg.get(Key.FORMAT)) == INT_FORMAT}
    for name in layers_with(tensors, Key.SCALE) if int_groups else []:
        if f"{name}.{Key.PACKED}" in tensors:
            continue
        label = f"{where}: layer {name}"
        group = groups[_group_of(name, groups, label)]
        if group not in (groups[g] for g in int_groups) or f"{name}.{Key.WEIGHT}" not in tensors:
            raise FormatError(f"{label}: {Key.SCALE} without {Key.PACKED} outside an {INT_FORMAT} group")
        layer = {s: tensors[f"{name}.{s}"] for s in (Key.WEIGHT, Key.SCALE)}
        found.records[name] = unpack_int_record(layer, group[Key.WEIGHTS], label)
        found.consumed.update(f"{name}.{s}" for s in layer)
    for name in layers_with(tensors, Key.PACKED):
        label = f"{where}: layer {name}"
        weights = groups[_group_of(name, groups, label)][Key.WEIGHTS]
        layer = {s: tensors[f"{name}.{s}"] for s in (Key.PACKED, Key.SCALE, Key.ZERO, Key.SHAPE, Key.G_IDX) if f"{name}.{s}" in tensors}
        if Key.SHAPE not in layer or Key.SCALE not in layer:
            raise FormatError(f"{label}: {Key.PACKED} without {Key.SHAPE} and {Key.SCALE}")
        found.records[name] = unpack_record(layer, weights, label)
        found.consumed.update(f"{name}.{s}" for s in layer)
    kv_scales = [k for k in tensors if k.endswith((f".{KV_K_SCALE}", f".{KV_V_SCALE}"))]
    found.consumed.update(kv_scales)  # KV-cache scales are runtime metadata, not model parameters
    found.facts = {
        "format": METHOD,
        "pack_format": PACK_FORMAT,
        "config_groups": sorted(groups),
        "input_activations": {g: groups[g][Key.INPUTS] for g in sorted(groups) if groups[g].get(Key.INPUTS)},
        "kv_cache_scheme": qcfg.get("kv_cache_scheme"),
        "kv_cache_scales": len(kv_scales),
    }
    return found


def _token_int8(args: dict[str, Any]) -> dict[str, Any] | None:
    """``args`` when they are dynamic per-token symmetric int8 (the W8A8 preset's input activations), else None."""
    keys = ("num_bits", "type", "symmetric", "strategy", "dynamic")
    return args if all(args.get(k) == TOKEN_INT8_ACTIVATIONS[k] for k in keys) else None


def _target_matches(expression: str, name: str, where: str) -> bool:
    """A config group's ``re:`` target matches the start of ``name`` (compressed-tensors' rule), in bounded time."""
    try:
        return regex_match(expression, name, whole=False, what=f"{where}: config group target")
    except CompressError as exc:
        raise FormatError(str(exc)) from None


def _group_of(name: str, groups: dict[str, Any], where: str) -> str:
    """The config group whose targets match layer ``name``: exact name, then ``re:``, then class ``Linear``."""
    ranked = []
    for gname, group in groups.items():
        for target in group.get(Key.TARGETS, []):
            if not isinstance(target, str):
                raise FormatError(f"{where}: config group '{gname}' has a target that is not a string: {target!r}")
            if target == name:
                ranked.append((0, gname))
            elif target.startswith(REGEX_PREFIX) and _target_matches(target[len(REGEX_PREFIX) :], name, where):
                ranked.append((1, gname))
            elif target == LINEAR_TARGET:  # layers with weight_packed are Linear layers
                ranked.append((2, gname))
    if not ranked:
        raise FormatError(f"{where}: has packed weights but no config group targets it")
    best = min(r for r, _ in ranked)
    chosen = sorted({g for r, g in ranked if r == best})
    if len(chosen) > 1:
        raise FormatError(f"{where}: config groups {', '.join(chosen)} all target it; which scheme applies is ambiguous")
    return chosen[0]


# --------------------------------------------------------------------------- the artifact's own weights
# The artifact's model/ is a pack-quantized checkpoint written by ``write`` above. A layer whose
# width is not a whole number of groups is stored with the largest group width that divides both
# (every group split into equal pieces that repeat its scale and zero point): the same weights,
# exactly, in a layout compressed-tensors reads. Reading it back merges the pieces into the
# record's own scheme, which the artifact's manifest holds.

MIN_STORED_GROUP = 32
"""The narrowest group a layer is split into to be stored; narrower pieces (a width and group size
sharing only a small divisor) would cost more in scales than the internal record layout saves."""


def stored_scheme(scheme: QuantScheme, shape: tuple[int, int]) -> QuantScheme | None:
    """The scheme a record of ``scheme`` and ``shape`` is stored with in pack-quantized exactly
    (itself, or its groups split into equal pieces), or None when pack-quantized cannot hold it
    (nor a GGUF grid's float minimum or K-quant scales: those records stay in the records file)."""
    grid = scheme.block_grid
    if scheme.bits not in SUPPORTED_BITS or (grid is not None and (grid.float_min or grid.k_quant)):
        return None
    if grid is not None:  # Q4_0 / Q8_0: plain symmetric records, stored as such (the manifest keeps the grid's name)
        scheme = scheme.model_copy(update={"gguf_type": None})
    in_f = shape[1]
    if scheme.group_size is None or in_f % scheme.group_size == 0:
        return scheme
    piece = math.gcd(scheme.group_size, in_f)
    return scheme.model_copy(update={"group_size": piece}) if piece >= MIN_STORED_GROUP else None


def split_groups(record: QuantizedWeight, scheme: QuantScheme) -> QuantizedWeight:
    """``record`` with its groups split into ``scheme``'s narrower ones (scales and zero points
    repeated): the same dequantized weight."""
    if scheme == record.scheme:
        return record
    in_f = record.shape[1]
    width = record.scheme.group_width(in_f)
    index = torch.arange(scheme.n_groups(in_f)) * scheme.group_width(in_f) // width  # the group each piece came from
    return QuantizedWeight(record.codes, record.scale[:, index].contiguous(), record.zero_point[:, index].contiguous(), scheme)


def merge_groups(stored: QuantizedWeight, scheme: QuantScheme, where: str) -> QuantizedWeight:
    """The record of ``scheme`` that ``stored`` was split from (inverse of :func:`split_groups`);
    FormatError when ``stored`` is not such a split (pieces of one group disagree)."""
    if stored.scheme == scheme:
        return stored
    in_f = stored.shape[1]
    if stored_scheme(scheme, stored.shape) != stored.scheme:
        raise FormatError(
            f"{where}: stored as {stored.scheme.describe()} ({stored.scheme.scale_dtype} scales), which is not how "
            f"{scheme.describe()} ({scheme.scale_dtype} scales) is stored"
        )
    first = torch.arange(scheme.n_groups(in_f)) * scheme.group_width(in_f) // stored.scheme.group_width(in_f)
    merged = build_record(stored.codes, stored.scale[:, first], stored.zero_point[:, first], scheme, where)
    again = split_groups(merged, stored.scheme)
    if not (torch.equal(again.scale, stored.scale) and torch.equal(again.zero_point, stored.zero_point)):
        raise FormatError(f"{where}: the pieces of a group of {scheme.group_size} have different scales or zero points")
    return merged
