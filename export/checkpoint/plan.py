"""The planned size of a checkpoint export from the recipe alone (``compress plan``)."""

from __future__ import annotations

from typing import Any

from compress.eval.plan.shapes import ModelShape, Record, packed_bytes
from compress.export.format import PlannedSize


def compressed_tensors_size(cfg: Any, shape: ModelShape, records: dict[str, Record], dtype_bits: int) -> PlannedSize:
    return packed_bytes(shape, records, dtype_bits), 2.0, "codes + scales (+ zero points) per group; the rest at the model dtype"


def gptq_size(cfg: Any, shape: ModelShape, records: dict[str, Record], dtype_bits: int) -> PlannedSize:
    size = packed_bytes(shape, records, dtype_bits, scale_bits=16, zeros_always=True, extra_bits_per_input=32)
    return size, 2.0, "codes + float16 scales + zero points (always stored) per group + int32 g_idx; the rest at the model dtype"
