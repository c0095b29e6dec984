"""compressed-tensors ``float-quantized`` checkpoints: FP8 (E4M3) weights and activations, the layout
vLLM loads (its ``CompressedTensorsW8A8Fp8`` scheme) and llm-compressor writes for its FP8,
FP8_DYNAMIC and FP8_BLOCK presets (compressed-tensors 0.19, ``quantization/quant_scheme.py``).

Layout of one FP8 Linear ``<layer>`` (quantizers/fp8.py's ``FP8Weight``, written as it is):

* ``<layer>.weight`` float8_e4m3fn [out, in];
* ``<layer>.weight_scale`` float32: [out, 1] (``strategy: channel``) or [ceil(out/128), ceil(in/128)]
  (``strategy: block``, ``block_structure: [128, 128]``);
* ``<layer>.input_scale`` float32 [1]: static activations only (``strategy: tensor``, ``dynamic: false``).

Dequantization is ``weight * weight_scale`` (each tile's scale over its tile); dynamic activations
(``strategy: token``, or ``group`` of 128 under block weights, ``dynamic: true``) have no stored scale.
``verify`` reads the file back, requires the stored tensors to equal the records bit for bit, and
requires compressed-tensors' own decompressor (``FloatQuantizationCompressor``, with the scheme it
parses from the written config) to give each record's dequantized weight bit for bit.
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
from compress.quantizers.fp8 import Activations, FP8Linear, FP8Weight, Layout, fp8_activations, fp8_records
from compress.quantizers.fp8_config import BLOCK
from compress.quantizers.kv_cache import KVCacheScheme

KIND = "FP8"
FLOAT_FORMAT = "float-quantized"
NAIVE_FORMAT = "naive-quantized"
"""Weight-only FP8 (``activations: null``): what compressed-tensors 0.19 infers for float8 weights without
input activations (its float-quantized compressor requires them; the naive one is the same code)."""
INPUT_ACTIVATIONS = "input_activations"
INPUT_SCALE = "input_scale"
EXACTNESS_CHECK = (
    "float8 weights, weight scales and input scales identical after reload; compressed-tensors' decompressor gives the records' weights"
)


def _args(strategy: str, dynamic: bool, **extra: Any) -> dict[str, Any]:
    """compressed-tensors ``QuantizationArgs`` of an 8-bit float tensor (symmetric, E4M3)."""
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": dynamic, "group_size": None, **extra}


def weight_args(layout: Layout) -> dict[str, Any]:
    """FP8_DYNAMIC's weights (channel) or FP8_BLOCK's (block, 128 x 128)."""
    return _args("channel", False) if layout == "channel" else _args("block", False, block_structure=[BLOCK, BLOCK])


def input_args(activations: Activations, layout: Layout) -> dict[str, Any] | None:
    """FP8's input activations (static: tensor), FP8_DYNAMIC's (dynamic, token) or FP8_BLOCK's (dynamic, group of 128)."""
    if activations is None:
        return None
    if activations == "static":
        return _args("tensor", False)
    return _args("token", True) if layout == "channel" else _args("group", True, group_size=BLOCK)


def quantization_config(model: nn.Module, records: dict[str, FP8Weight], activations: Activations) -> dict[str, Any]:
    """config.json ``quantization_config``: one group per weight layout, every other Linear in ``ignore``."""
    layouts = sorted({r.layout for r in records.values()})
    fmt = NAIVE_FORMAT if activations is None else FLOAT_FORMAT
    groups = {
        f"group_{i}": {
            Key.TARGETS: [LINEAR_TARGET] if len(layouts) == 1 else sorted(n for n, r in records.items() if r.layout == layout),
            Key.WEIGHTS: weight_args(layout),
            INPUT_ACTIVATIONS: input_args(activations, layout),
            "output_activations": None,
            Key.FORMAT: fmt,
        }
        for i, layout in enumerate(layouts)
    }
    return {
        QUANT_METHOD: METHOD,
        Key.FORMAT: fmt,
        Key.STATUS: STATUS_COMPRESSED,
        Key.GROUPS: groups,
        Key.IGNORE: [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in records],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def write(
    directory: Path, model: nn.Module, tokenizer: Any, records: dict[str, FP8Weight], activations: Activations, kv: KVCacheScheme | None
) -> dict[str, Any] | None:
    """Write the float-quantized HF directory (and the KV scheme's scales, as the pack-quantized writer
    does); returns what was carried of the KV scheme."""
    return write_grid_checkpoint(directory, model, tokenizer, records, quantization_config(model, records, activations), kv)


def holds(model: nn.Module) -> bool:
    """The model has FP8 layers (this module writes them)."""
    return any(isinstance(m, FP8Linear) for m in model.modules())


def grids(model: nn.Module) -> set[str]:
    """The float grids of the model's layers this module writes (BaseExportConfig.float_refusal's keys)."""
    return {"fp8"} if holds(model) else set()


def model_records(model: nn.Module) -> dict[str, FP8Weight]:
    return fp8_records(model)


def write_model(
    directory: Path, model: nn.Module, tokenizer: Any, records: dict[str, FP8Weight], kv: KVCacheScheme | None
) -> dict[str, Any] | None:
    """``write`` with the inputs' quantization of the model's FP8 layers."""
    return write(directory, model, tokenizer, records, fp8_activations(model), kv)


def verify(directory: Path, records: dict[str, FP8Weight]) -> list[str]:
    """Read the checkpoint back: the differences from ``records`` (empty when every tensor is identical
    and compressed-tensors' decompressor gives each record's dequantized weight)."""
    try:
        from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError:
        raise FormatError(
            "the fp8 compressed-tensors export is read back with compressed-tensors' own decompressor: pip install 'compressed-tensors==0.19.0'"
        ) from None
    config = QuantizationConfig.model_validate(read_config(directory)["quantization_config"])
    schemes = {r.layout: next(g for g in config.config_groups.values() if g.weights.strategy == r.layout) for r in records.values()}
    tensors = read_tensors(directory)
    problems: list[str] = []
    for name, record in records.items():
        mine = record.tensors(name)
        stored = {k: tensors.get(k) for k in mine}
        for key, t in mine.items():
            got = stored[key]
            if got is None or got.dtype != t.dtype or got.shape != t.shape or not torch.equal(got.view(torch.uint8), t.view(torch.uint8)):
                problems.append(f"{key}: not the record's {t.dtype} {list(t.shape)}")
        if f"{name}.{INPUT_SCALE}" in tensors and record.input_scale is None:
            problems.append(f"{name}.{INPUT_SCALE}: stored, and the record has none")
        if problems:
            continue
        state = {"weight": stored[f"{name}.weight"], "weight_scale": stored[f"{name}.weight_scale"]}
        theirs = FloatQuantizationCompressor.decompress(state, schemes[record.layout])["weight"]
        if theirs.dtype != torch.float32 or not torch.equal(theirs, record.dequantize()):
            problems.append(f"{name}: compressed-tensors dequantizes it to other values than the record's")
    return problems
