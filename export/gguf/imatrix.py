"""llama.cpp's importance matrix, from our own calibration pass.

llama.cpp improves its quantizers with an *importance matrix*: for each weight matrix, how much each
input column matters, measured as the sum over calibration tokens of that input's square
(``llama-imatrix`` collects it, ``llama-quantize --imatrix`` weighs each column's rounding error by
it). GPTQ already accumulates ``H = 2/n · Σ x xᵀ`` for every Linear on the calibration tokens; its
diagonal times n/2 is exactly that sum (``RunContext.input_sums``), so a GPTQ run gets the importance
matrix of its own calibration text for free.

The file is llama.cpp's GGUF imatrix format (what ``llama-imatrix`` writes by default since 2025):
``general.type = imatrix``, ``imatrix.datasets`` (where the text came from), ``imatrix.chunk_size``
and ``imatrix.chunk_count``, and per weight, under llama.cpp's tensor name, ``<name>.in_sum2``
(float32, one value per input column) and ``<name>.counts`` (float32, the tokens summed). Weights
sorted by name, as llama.cpp writes them. Linears fed the same input (q/k/v, gate/up) get the same
sums, as in llama.cpp's own file. Read back by ``read_imatrix`` (gguf-py's reader) after writing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from compress.errors import FormatError

IMATRIX_FILE = "imatrix.gguf"
SUMS, COUNTS = ".in_sum2", ".counts"


def write_imatrix(
    path: Path, model: nn.Module, input_sums: dict[str, tuple[torch.Tensor, int]], datasets: list[str], chunk_size: int
) -> dict[str, Any]:
    """Write ``input_sums`` (module name -> (Σ x² per input column, tokens)) to ``path`` under
    llama.cpp's tensor names, read it back, and return its manifest facts. Modules llama.cpp has no
    single tensor for (the experts of a fused mixture-of-experts block, which it stores as one 3-D
    tensor), and those whose inputs a later stage made narrower or wider, are listed under
    ``not_written``; when that is all of them, no file is written."""
    import gguf

    from compress.export.gguf.layout import architecture_of, tensor_names

    names = tensor_names(model)
    entries: dict[str, tuple[np.ndarray, int]] = {}
    not_written = []
    for module, (sums, count) in input_sums.items():
        name = names.get_name(f"{module}.weight", try_suffixes=(".weight",))
        if name is None or name in entries or _width(model, module) != sums.numel():  # (a later stage changed its inputs)
            not_written.append(module)
            continue
        entries[name] = (sums.detach().to(torch.float32).cpu().numpy(), int(count))
    if not entries:  # nothing llama.cpp could use: no file, said in the manifest (the export itself stands)
        return {
            "file": None,
            "tensors": 0,
            "not_written": not_written,
            "why": "no calibrated layer has a tensor of its own in llama.cpp's map",
        }
    tokens = max(count for _, count in entries.values())
    writer = gguf.GGUFWriter(path, architecture_of(model).name)
    writer.add_type(gguf.GGUFType.IMATRIX)
    writer.add_array(gguf.Keys.IMatrix.DATASETS, datasets)
    writer.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, tokens // max(chunk_size, 1))
    writer.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, chunk_size)
    for name in sorted(entries):
        sums, count = entries[name]
        writer.add_tensor(name + SUMS, sums.reshape(1, -1))  # ggml shape [in, 1]: one matrix (no experts)
        writer.add_tensor(name + COUNTS, np.array([[count]], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    back, meta = read_imatrix(path)
    for name, (sums, count) in entries.items():
        got = back.get(name)
        if got is None or got[1] != count or not np.array_equal(got[0], sums):
            raise FormatError(f"{path}: reading the importance matrix back does not give {name}'s sums")
    return {
        "file": path.name,
        "tensors": len(entries),
        "tokens": tokens,
        "chunk_size": chunk_size,
        "datasets": meta["datasets"],
        "not_written": not_written,
    }


def _width(model: nn.Module, module: str) -> int | None:
    """The input width the exported model has for ``module`` now (None: it has no such Linear)."""
    try:
        return int(model.get_submodule(module).in_features)
    except AttributeError:
        return None


def read_imatrix(path: Path) -> tuple[dict[str, tuple[np.ndarray, float]], dict[str, Any]]:
    """An imatrix GGUF: tensor name -> (Σ x² per input column, tokens), and its metadata
    (``datasets``, ``chunk_size``, ``chunk_count``). A dense weight's entry (one matrix) only."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise FormatError(f"{path}: not a readable imatrix GGUF ({exc})") from exc

    def value(key: str) -> Any:
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    if value(gguf.Keys.General.TYPE) != gguf.GGUFType.IMATRIX:
        raise FormatError(f"{path}: general.type is {value(gguf.Keys.General.TYPE)!r}, not an importance matrix")
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    out: dict[str, tuple[np.ndarray, float]] = {}
    for key, data in tensors.items():
        if key.endswith(SUMS):
            name = key[: -len(SUMS)]
            counts = tensors.get(name + COUNTS)
            if counts is None or counts.size != 1:
                raise FormatError(f"{path}: {name} has sums but {'no' if counts is None else counts.size} counts (one matrix expected)")
            out[name] = (data.reshape(-1).astype(np.float32), float(counts.reshape(-1)[0]))
    meta = {
        "datasets": list(value(gguf.Keys.IMatrix.DATASETS) or []),
        "chunk_size": value(gguf.Keys.IMatrix.CHUNK_SIZE),
        "chunk_count": value(gguf.Keys.IMatrix.CHUNK_COUNT),
    }
    return out, meta
