"""The GGUF read-back check: every exactly packed record read back from the written file with
gguf-py's own dequantizer and compared with the record's values, and what the file holds (its
tensors' types, bytes and parameters) as gguf-py reads it.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from compress.errors import FormatError
from compress.export.gguf.blocks import plain_values
from compress.export.gguf.layout import GGUFPlan, TensorPlan, permuted_record
from compress.quantizers.core import QuantizedWeight


def tensor_totals(path: Path) -> tuple[int, int]:
    """A GGUF file's tensor data bytes and parameter count (llama.cpp's bits per weight: bytes x 8 / parameters)."""
    import gguf

    tensors = gguf.GGUFReader(str(path)).tensors
    return sum(int(t.n_bytes) for t in tensors), sum(int(t.n_elements) for t in tensors)


def stored_types(path: Path) -> dict[str, str]:
    """The type of every tensor of a GGUF file (lower-case ggml names), by tensor name."""
    import gguf

    return {t.name: t.tensor_type.name.lower() for t in gguf.GGUFReader(path).tensors}


def stored_type_counts(path: Path) -> dict[str, int]:
    """Tensor types in a GGUF file, counted (lower-case ggml names)."""
    return dict(Counter(stored_types(path).values()))


def check_gguf_records(path: Path, plan: GGUFPlan, records: dict[str, QuantizedWeight]) -> list[str]:
    """Read the file back with gguf's own dequantizer and compare every exactly packed record
    with the record's values (Q4_1: with ``m`` rounded to fp16, as stored). Returns problems."""
    import gguf
    from gguf import quants

    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    problems = []
    with open(path, "rb") as f:
        for t in plan.tensors:
            if t.source != "record":
                continue
            stored = by_name.get(t.gguf_name)
            if stored is None:
                problems.append(f"{t.gguf_name} missing")
                continue
            record = permuted_record(records[t.record_name].cpu(), t.permute_heads)
            got = quants.dequantize(_read_data(f, stored), stored.tensor_type).reshape(record.shape)
            problems += _differences(t, record, got)
    return problems


def _read_data(f: Any, stored: Any) -> np.ndarray:
    """A tensor's bytes read from the open file into fresh memory, shaped as the reader's memory-mapped
    view (reading every tensor through the map kept the whole file resident until the check ended)."""
    raw = np.empty(stored.data.shape, dtype=stored.data.dtype)
    f.seek(int(stored.data_offset))
    if f.readinto(memoryview(raw).cast("B")) != raw.nbytes:
        raise FormatError(f"{stored.name}: the file ends inside its data")
    return raw


def _differences(t: TensorPlan, record: QuantizedWeight, got: np.ndarray) -> list[str]:
    """How the values llama.cpp's own dequantization reads back (``got``) differ from the record's."""
    problems: list[str] = []
    if not record.plain:  # on the type's own grid: the record's values exactly
        want = record.dequantize().numpy()
        if not np.array_equal(got, want):
            problems.append(f"{t.gguf_name}: {int((got != want).sum())} values differ from the record")
        return problems
    want = plain_values(record, t.type_name)
    if not np.array_equal(got, want):
        problems.append(f"{t.gguf_name}: {int((got != want).sum())} values differ from the record")
    return problems
