"""What the checkpoint formats share: a Hugging Face model directory whose config.json carries
a ``quantization_config`` and whose safetensors hold float tensors plus per-layer packed tensors.

Writers give the format's per-layer tensors and config; readers give back ``QuantizedWeight``
records plus the names of the tensors they consumed, and the float model is assembled here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.errors import FormatError
from compress.hf_model import assemble_model, float_tensors, write_config_and_tokenizer
from compress.quantizers.core import QuantizedWeight
from compress.schema.quantize import QuantScheme

CONFIG_FILE = "config.json"
QUANTIZATION_CONFIG = "quantization_config"
QUANT_METHOD = "quant_method"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's tensor -> file map (Hugging Face's layout)
SHARD_BYTES = 512 * 2**20
"""The most tensor bytes per safetensors file a writer holds before writing it: checkpoints are
written shard by shard, so writing one costs at most a shard of memory, not the model; a tensor
larger than this (a big vocabulary's embedding) is a shard alone."""
SAFETENSORS_METADATA = {"format": "pt"}  # transformers refuses safetensors files without it
SCALE_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclass
class ImportedRecords:
    """What a format's reader found: records by layer name, the tensors it consumed, and facts."""

    records: dict[str, QuantizedWeight]
    consumed: set[str] = field(default_factory=set)
    facts: dict[str, Any] = field(default_factory=dict)


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file written from the tensors' own memory: the 8-byte header length, the JSON
    header (padded with spaces to 8 bytes), then each tensor's bytes in header order. safetensors'
    ``save_file`` first copies every tensor into a bytes object, twice a shard's memory; the file is
    the same format, read back by safetensors itself (tests) and transformers. A dtype outside the
    table goes through ``save_file``."""
    if any(t.dtype not in _SAFETENSORS_DTYPES for t in tensors.values()):
        from safetensors.torch import save_file

        save_file(dict(tensors), str(path), metadata=metadata)
        return
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))


def save_sharded(directory: Path, tensors: Iterable[tuple[str, torch.Tensor]], shard_bytes: int | None = None) -> list[str]:
    """Write ``tensors`` as they come into safetensors files of at most ``shard_bytes`` each: one
    file is WEIGHTS_FILE, several are ``model-0000i-of-0000n.safetensors`` with INDEX_FILE, as
    transformers writes them. Only one shard's tensors are held at a time. Returns the file names."""
    limit = SHARD_BYTES if shard_bytes is None else shard_bytes
    shards: list[list[str]] = []
    current: dict[str, torch.Tensor] = {}
    held = total = 0
    seen: set[str] = set()

    def flush() -> None:
        write_safetensors(directory / f".shard-{len(shards):05d}.safetensors", current, SAFETENSORS_METADATA)
        shards.append(list(current))
        current.clear()

    for name, tensor in tensors:
        if name in seen:
            raise FormatError(f"{directory}: two tensors named {name} (packed tensors would overwrite model tensors)")
        seen.add(name)
        size = tensor.numel() * tensor.element_size()
        if current and held + size > limit:
            flush()
            held = 0
        current[name] = tensor.contiguous().cpu()
        held += size
        total += size
    if current or not shards:
        flush()
    if len(shards) == 1:
        (directory / ".shard-00000.safetensors").rename(directory / WEIGHTS_FILE)
        return [WEIGHTS_FILE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for i, name in enumerate(names):
        (directory / f".shard-{i:05d}.safetensors").rename(directory / name)
    weight_map = {tensor: names[i] for i, keys in enumerate(shards) for tensor in keys}
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return names


def weight_files(directory: Path) -> list[Path]:
    """A checkpoint's safetensors files: those INDEX_FILE names (a sharded checkpoint), else WEIGHTS_FILE."""
    index = directory / INDEX_FILE
    if not index.is_file():
        return [directory / WEIGHTS_FILE]
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FormatError(f"{index}: not a safetensors index (a JSON object with a weight_map): {exc}") from exc


def packed_tensors(
    records: Mapping[str, QuantizedWeight], pack: Callable[[QuantizedWeight], dict[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each record's tensors as a format's ``pack`` makes them (``<layer>.<suffix>``), a record at a time."""
    for name in records:
        for suffix, tensor in pack(records[name]).items():
            yield f"{name}.{suffix}", tensor


def write_checkpoint(
    directory: Path,
    model: nn.Module,
    tokenizer: Any,
    records: Mapping[str, QuantizedWeight],
    layer_tensors: Iterable[tuple[str, torch.Tensor]],
    quantization_config: dict[str, Any],
) -> None:
    """A loadable HF directory: config (with ``quantization_config``), tokenizer, safetensors written
    shard by shard: the float tensors (read a streamed unit at a time), then ``layer_tensors`` as the
    format's writer makes them, a layer at a time."""
    write_config_and_tokenizer(directory, model, tokenizer, quantization_config)

    def every() -> Iterator[tuple[str, torch.Tensor]]:
        yield from float_tensors(model, records)
        yield from layer_tensors

    save_sharded(directory, every())


def read_config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise FormatError(f"cannot read {path}: {exc}") from exc


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``directory`` (sharded checkpoints too)."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FormatError(f"{directory} has no *.safetensors files; quantized checkpoints are read from safetensors only")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def layers_with(tensors: dict[str, torch.Tensor], suffix: str) -> list[str]:
    """Layer names that have a tensor ``<layer>.<suffix>``."""
    tail = "." + suffix
    return sorted(k[: -len(tail)] for k in tensors if k.endswith(tail))


def scale_dtype_name(scale: torch.Tensor, where: str) -> str:
    if scale.dtype not in SCALE_DTYPES:
        raise FormatError(f"{where}: scales are {scale.dtype}; records hold float16, bfloat16 or float32 scales")
    return SCALE_DTYPES[scale.dtype]


def build_record(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, scheme: QuantScheme, where: str) -> QuantizedWeight:
    """A record from decoded tensors; a convention violation becomes a FormatError naming the layer."""
    try:
        return QuantizedWeight(
            codes=codes.to(torch.uint8).contiguous(), scale=scale.contiguous(), zero_point=zero.to(torch.uint8).contiguous(), scheme=scheme
        )
    except ValueError as exc:
        raise FormatError(f"{where}: {exc}") from None


def import_float_model(
    directory: Path, tensors: dict[str, torch.Tensor], found: ImportedRecords, dtype: torch.dtype, trust_remote_code: bool = False
) -> nn.Module:
    """The float model of a quantized checkpoint: non-quantized tensors as stored, quantized
    layers dequantized from their records (never re-quantized)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code, local_files_only=True)
    if hasattr(config, QUANTIZATION_CONFIG):  # the float model is not a quantized one for transformers
        del config.quantization_config
    floats = {k: v for k, v in tensors.items() if k not in found.consumed}
    return assemble_model(config, floats, found.records, dtype, str(directory), trust_remote_code)


def _same_extras(a: QuantizedWeight, b: QuantizedWeight) -> bool:
    """The GGUF-grid parts of two records (float minimum, K-quant super-block scales) are identical."""
    ta, tb = a.tensors("r"), b.tensors("r")
    return ta.keys() == tb.keys() and all(torch.equal(ta[k].cpu(), tb[k].cpu()) for k in ta)


def records_identical(expected: dict[str, QuantizedWeight], actual: dict[str, QuantizedWeight]) -> list[str]:
    """Differences between two record sets (empty when codes, scales, zero points and schemes match exactly)."""
    problems = []
    if set(expected) != set(actual):
        missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
        problems.append(f"layers differ: missing {missing[:3]}, unexpected {extra[:3]}")
    for name in sorted(set(expected) & set(actual)):
        a, b = expected[name], actual[name]
        if a.scheme != b.scheme:
            problems.append(
                f"{name}: scheme {a.scheme.describe()} ({a.scheme.scale_dtype}) became {b.scheme.describe()} ({b.scheme.scale_dtype})"
            )
        elif not torch.equal(a.codes.cpu(), b.codes.cpu()):
            problems.append(f"{name}: codes differ")
        elif not torch.equal(a.scale.cpu(), b.scale.cpu()):
            problems.append(f"{name}: scales differ")
        elif not torch.equal(a.zero_point.cpu(), b.zero_point.cpu()):
            problems.append(f"{name}: zero points differ")
        elif not _same_extras(a, b):
            problems.append(f"{name}: offsets or super-block scales differ")
    return problems
