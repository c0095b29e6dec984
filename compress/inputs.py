"""Checks of model files before a library reads them: one line naming the file and what is wrong.

Libraries report a truncated or mislabelled file with their own exception types and messages
(a Rust panic text, a struct error, a KeyError on a missing field), often deep in a traceback.
These checks read only headers and small JSON files, so they are cheap, and they run first:

* ``*.safetensors``: the 8-byte header length, the JSON header, every tensor's dtype, shape and
  byte range, and that the data section is as long as the header says (a truncated copy fails);
* ``config.json``, ``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``:
  valid UTF-8 JSON objects (config.json with a ``model_type``, finite numbers and positive sizes:
  ``compress.integrity.check_config_values``);
* an export format's own files (a GGUF file, an ONNX model): its ExportFormat's ``check_input``
  (export/<format>/inputs.py), found through compress.plugins.EXPORT_FORMATS.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from compress import integrity
from compress.errors import ModelLoadError
from compress.integrity import check_config_values

SAFETENSORS_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
MAX_JSON = 16 << 20
"""The most bytes a model directory's JSON file (config.json …) may have: the largest real ones are under 1 MB."""
JSON_CAPS = {"tokenizer.json": 512 << 20}  # the largest published vocabularies' tokenizer.json are ~35 MB
JSON_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "quantize_config.json",
    "genai_config.json",
)


def check_safetensors(path: Path) -> dict[str, Any]:
    """The header of a .safetensors file, after checking it against the file's size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelLoadError(f"{path}: not a safetensors file ({size} bytes: no header)")
            (length,) = struct.unpack("<Q", head)
            if length > min(MAX_HEADER, size - 8):
                raise ModelLoadError(f"{path}: not a safetensors file, or truncated (header of {length:,} bytes in a file of {size:,})")
            raw = f.read(length)
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ModelLoadError(f"{path}: the safetensors header is not valid JSON (corrupt file)") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: the safetensors header is not a JSON object (corrupt file)")
    data = size - 8 - length
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise ModelLoadError(f"{path}: tensor {name!r}: its header entry is not {{dtype, shape, data_offsets}}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in SAFETENSORS_ITEMSIZE:
            raise ModelLoadError(f"{path}: tensor {name!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ModelLoadError(f"{path}: tensor {name!r}: shape {shape!r} is not a list of sizes")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise ModelLoadError(f"{path}: tensor {name!r}: data_offsets {offsets!r} are not [begin, end]")
        expected = math.prod(shape) * SAFETENSORS_ITEMSIZE[dtype]
        if offsets[1] - offsets[0] != expected:
            raise ModelLoadError(
                f"{path}: tensor {name!r}: {offsets[1] - offsets[0]:,} bytes for a {dtype} tensor of shape {shape} ({expected:,} bytes)"
            )
        if offsets[1] > data:
            raise ModelLoadError(f"{path}: truncated: tensor {name!r} ends at byte {offsets[1]:,} of a data section of {data:,}")
        spans.append((offsets[0], offsets[1], name))
    position = 0
    for begin, end, name in sorted(spans):  # the format's rule: tensors tile the data section, no gaps or overlaps
        if begin != position:
            raise ModelLoadError(
                f"{path}: tensor {name!r} starts at byte {begin:,}, expected {position:,} (overlapping or missing data: corrupt file)"
            )
        position = end
    if position != data:
        raise ModelLoadError(f"{path}: {data - position:,} bytes after the last tensor (corrupt file, or a different format)")
    return header


def safetensors_data_start(size: int, header: dict[str, Any]) -> int:
    """Where the data section of a safetensors file of ``size`` bytes starts, from its header as
    ``check_safetensors`` returned it: the tensors tile the data section, which ends the file."""
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    return size - max(ends, default=0)


def check_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or ModelLoadError naming it and the line of the problem; a file above its
    size cap (``JSON_CAPS``) is refused before it is read."""
    cap = JSON_CAPS.get(path.name, MAX_JSON)
    try:
        size = path.stat().st_size
        if size > cap:
            raise ModelLoadError(
                f"{path}: {size:,} bytes, more than a model's {path.name} ever needs (at most {cap:,}); is it the right file, and complete?"
            )
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except RecursionError:
        raise ModelLoadError(f"{path}: JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def check_model_directory(path: Path) -> None:
    """Every JSON file and safetensors header of a Hugging Face model directory."""
    for name in JSON_FILES:
        if (path / name).is_file():
            data = check_json(path / name)
            if name == "config.json" and not isinstance(data.get("model_type"), str):
                raise ModelLoadError(f"{path / name}: no model_type; is this a Hugging Face model's config?")
            if name == "config.json":
                check_config_values(data, path / name)
    for file in sorted(path.glob("*.safetensors")):
        check_safetensors(file)


def check_blocks_on_disk(directory: Path, layers: Any) -> None:
    """A Hugging Face directory's ``num_hidden_layers`` against the blocks its safetensors files
    hold, from their headers alone: run before any model is built from the config (building 10⁹
    blocks, even on the meta device, would never end)."""
    weights = sorted(directory.glob("*.safetensors"))
    if weights and isinstance(layers, int) and not isinstance(layers, bool):
        integrity.check_block_count(
            layers, integrity.stored_entries({file: check_safetensors(file) for file in weights}), directory / "config.json"
        )
