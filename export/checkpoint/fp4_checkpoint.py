"""compressed-tensors ``nvfp4-pack-quantized`` and ``mxfp4-pack-quantized`` checkpoints: FP4 weights, the
layout llm-compressor writes for its NVFP4A16 and MXFP4A16 presets (compressed-tensors 0.19,
``quantization/quant_scheme.py``) and vLLM loads.

Layout of one FP4 Linear ``<layer>`` [out, in] (quantizers/fp4.py's ``FP4Weight``, written as it is):

* ``<layer>.weight_packed`` uint8 [out, in/2]: two E2M1 codes a byte, the even column in the low nibble;
* ``<layer>.weight_scale``: float8_e4m3fn [out, in/16] (nvfp4, ``strategy: tensor_group``) or uint8 E8M0
  exponents [out, in/32] (mxfp4, ``strategy: group``, ``scale_dtype: torch.uint8``);
* ``<layer>.weight_global_scale`` float32 [1]: nvfp4 only;
* ``<layer>.input_global_scale`` float32 [1]: nvfp4 W4A4 only (``activations: dynamic``), the calibrated
  global scale of the layer's inputs.

Dequantization is ``e2m1 * (weight_scale / weight_global_scale)`` (nvfp4) or ``e2m1 * 2 ** (E - 127)``
(mxfp4). W4A4 layers carry the ``input_activations`` args of llm-compressor's NVFP4 preset (E2M1 per 16,
``tensor_group``, ``dynamic: local``: group scales at run time over the stored ``input_global_scale``) or
its MXFP4 preset (E2M1 per 32, ``group``, ``dynamic: true``, E8M0 scales). ``verify`` reads the file back and requires (1) the stored tensors to equal the records bit for
bit, (2) compressed-tensors' own unpacking (``unpack_fp4_from_uint8``, in float32) to give the records'
E2M1 values and its scale decoding the records' float32 group scales, and (3) its decompressor
(``NVFP4PackedCompressor`` / ``MXFP4PackedCompressor`` with the scheme it parses from the written config),
which returns bfloat16, to give each record's dequantized weight rounded once to bfloat16 (exactly the
record for mxfp4, whose values bfloat16 holds); for W4A4, (4) the input args it parses to be the preset's and its
own input quantization (``forward_quantize`` with the stored ``input_global_scale``) to give, on a probe input,
exactly what the in-memory FP4Linear computes (``quantize_input_fp4``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.errors import FormatError
from compress.export.checkpoint.compressed_tensors import METHOD, STATUS_COMPRESSED, Key, write_grid_checkpoint
from compress.export.checkpoint.hf_checkpoint import QUANT_METHOD, read_config, read_tensors
from compress.quantizers.compressed_tensors_args import LINEAR_TARGET
from compress.quantizers.fp4 import (
    INPUT_GLOBAL_SCALE,
    FP4Linear,
    FP4Weight,
    e2m1_values,
    fp4_activations,
    fp4_records,
    fused_with,
    quantize_input_fp4,
)
from compress.quantizers.fp4_config import GROUP, Activations, Format
from compress.quantizers.kv_cache import KVCacheScheme

KIND = "FP4"
PACK_FORMAT = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}
STRATEGY = {"nvfp4": "tensor_group", "mxfp4": "group"}
SCALE_DTYPE = {"nvfp4": "torch.float8_e4m3fn", "mxfp4": "torch.uint8"}
GLOBAL_SCALE = "weight_global_scale"
EXACTNESS_CHECK = (
    "packed codes, group scales and global scales identical after reload; compressed-tensors' unpacking gives the records' "
    "values and scales, its decompressor their weights (at its bfloat16); W4A4: its input quantization gives ours on a probe input"
)
PRESET = {"nvfp4": "NVFP4", "mxfp4": "MXFP4"}
"""llm-compressor's W4A4 presets (compressed-tensors 0.19 ``PRESET_SCHEMES``), whose input args a W4A4 export writes."""


def weight_args(fmt: Format) -> dict[str, Any]:
    """NVFP4A16's or MXFP4A16's weights (compressed-tensors ``QuantizationArgs``)."""
    return {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "group_size": GROUP[fmt],
        "strategy": STRATEGY[fmt],
        "dynamic": False,
        "scale_dtype": SCALE_DTYPE[fmt],
    }


def input_args(fmt: Format, activations: Activations) -> dict[str, Any] | None:
    """NVFP4's or MXFP4's input activations (W4A4), None for weight-only: E2M1 groups with dynamic scales (nvfp4:
    ``dynamic: local``, the group scales at run time over the stored static ``input_global_scale``, calibrated by
    the ``static_minmax`` observer)."""
    if activations is None:
        return None
    if fmt == "nvfp4":
        return {**weight_args(fmt), "dynamic": "local", "observer": "static_minmax"}
    return {**weight_args(fmt), "dynamic": True}


def quantization_config(model: nn.Module, records: dict[str, FP4Weight], activations: Activations = None) -> dict[str, Any]:
    """config.json ``quantization_config``: one group (one format a stage), every other Linear in ``ignore``."""
    formats = {r.format for r in records.values()}
    if len(formats) != 1:
        raise FormatError(f"an FP4 checkpoint holds one format, and the records have {sorted(formats)}")
    fmt = formats.pop()
    check_fused_global_scales(records)
    group = {
        Key.TARGETS: [LINEAR_TARGET],
        Key.WEIGHTS: weight_args(fmt),
        Key.INPUTS: input_args(fmt, activations),
        "output_activations": None,
        Key.FORMAT: PACK_FORMAT[fmt],
    }
    return {
        QUANT_METHOD: METHOD,
        Key.FORMAT: PACK_FORMAT[fmt],
        Key.STATUS: STATUS_COMPRESSED,
        Key.GROUPS: {"group_0": group},
        Key.IGNORE: [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in records],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def check_fused_global_scales(records: dict[str, FP4Weight]) -> None:
    """Refuse NVFP4 records whose fused layers (quantizers/fp4.py ``FUSED_SIBLINGS``: q/k/v, gate/up) have
    different global scales: vLLM loads one global scale for a fused weight (the shards' largest), so it would
    dequantize the other shards wrongly. The fp4 stage gives them one; records made otherwise are refused."""
    for name, record in records.items():
        for other in fused_with(name, records):
            theirs = records[other].global_scale
            if record.global_scale is not None and theirs is not None and not torch.equal(record.global_scale, theirs):
                raise FormatError(
                    f"{name} and {other} are one fused weight in vLLM, which keeps one NVFP4 global scale for it, and their "
                    f"records have two ({float(record.global_scale):g} and {float(theirs):g}); quantize them with the fp4 "
                    "stage, which gives the layers a runtime fuses one global scale"
                )


def holds(model: nn.Module) -> bool:
    """The model has FP4 layers (this module writes them)."""
    return any(isinstance(m, FP4Linear) for m in model.modules())


def grids(model: nn.Module) -> set[str]:
    """The float grids (formats) of the model's FP4 layers (BaseExportConfig.float_refusal's keys)."""
    return {m.format for m in model.modules() if isinstance(m, FP4Linear)}


def model_records(model: nn.Module) -> dict[str, FP4Weight]:
    return fp4_records(model)


def write_model(
    directory: Path, model: nn.Module, tokenizer: Any, records: dict[str, FP4Weight], kv: KVCacheScheme | None
) -> dict[str, Any] | None:
    """Write the pack-quantized HF directory (and the KV scheme's scales, as the int writer does); returns
    what was carried of the KV scheme."""
    return write_grid_checkpoint(directory, model, tokenizer, records, quantization_config(model, records, fp4_activations(model)), kv)


def _identical(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def verify(directory: Path, records: dict[str, FP4Weight]) -> list[str]:
    """Read the checkpoint back: the differences from ``records`` (empty when every tensor is identical and
    compressed-tensors' own unpacking and decompressor give each record's values, scales and weight)."""
    try:
        from compressed_tensors.compressors.mx_utils import decompress_mx_scale
        from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
        from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
        from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError:
        raise FormatError(
            "the fp4 compressed-tensors export is read back with compressed-tensors' own decompressor: pip install 'compressed-tensors==0.19.0'"
        ) from None
    scheme = QuantizationConfig.model_validate(read_config(directory)["quantization_config"]).config_groups["group_0"]
    tensors = read_tensors(directory)
    problems: list[str] = []
    for name, record in records.items():
        mine = record.tensors(name)
        problems += [f"{key}: not the record's {t.dtype} {list(t.shape)}" for key, t in mine.items() if not _identical(tensors.get(key), t)]
        for key, kept in ((GLOBAL_SCALE, record.global_scale), (INPUT_GLOBAL_SCALE, record.input_global_scale)):
            if f"{name}.{key}" in tensors and kept is None:
                problems.append(f"{name}.{key}: stored, and the record has none")
        if problems:
            continue
        rows, cols = record.shape
        values = unpack_fp4_from_uint8(tensors[f"{name}.{Key.PACKED}"], rows, cols, dtype=torch.float32)
        scale = tensors[f"{name}.{Key.SCALE}"]
        if record.global_scale is None:
            scales = decompress_mx_scale(scale).to(torch.float32)
        else:
            scales = scale.to(torch.float32) / tensors[f"{name}.{GLOBAL_SCALE}"]
        if not torch.equal(values, e2m1_values(record.codes())) or not torch.equal(scales, record.group_scales()):
            problems.append(f"{name}: compressed-tensors unpacks other values or scales than the record's")
            continue
        compressor = NVFP4PackedCompressor if record.format == "nvfp4" else MXFP4PackedCompressor
        weights = {k.removeprefix(f"{name}."): tensors[k] for k in mine if not k.endswith(INPUT_GLOBAL_SCALE)}
        theirs = compressor.decompress(weights, scheme)["weight"]
        if not torch.equal(theirs, record.dequantize().to(theirs.dtype)):
            problems.append(f"{name}: compressed-tensors dequantizes it to other values than the record's")
        elif scheme.input_activations is not None:
            problems += _input_problems(name, record, scheme.input_activations, tensors.get(f"{name}.{INPUT_GLOBAL_SCALE}"))
    return problems


def _input_problems(name: str, record: FP4Weight, args: Any, input_global_scale: torch.Tensor | None) -> list[str]:
    """A W4A4 layer's input args as the preset's, and compressed-tensors' input quantization (its ``forward_quantize``
    with the stored input global scale) equal to ``quantize_input_fp4`` on a probe input spanning several octaves."""
    from types import SimpleNamespace

    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    want = PRESET_SCHEMES[PRESET[record.format]]["input_activations"]
    keys = ("num_bits", "type", "strategy", "dynamic", "symmetric", "group_size", "scale_dtype")
    if any(getattr(args, k) != getattr(want, k) for k in keys):
        return [f"{name}: the input activations' args are not llm-compressor's {PRESET[record.format]} preset's"]
    cols = record.shape[1]
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn(4, cols, generator=gen) * torch.logspace(-2, 1, cols).roll(cols // 3)
    module = SimpleNamespace(quantization_status=QuantizationStatus.COMPRESSED, input_global_scale=input_global_scale)
    theirs = forward_quantize(module, probe.clone(), "input", args)
    if not torch.equal(theirs, quantize_input_fp4(probe, record.format, record.input_global_scale)):
        return [f"{name}: compressed-tensors quantizes the inputs to other values than the FP4 layer does"]
    return []
