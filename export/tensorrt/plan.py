"""The planned size of a TensorRT export from the recipe alone (``compress plan``)."""

from __future__ import annotations

from typing import Any

from compress.eval.plan.shapes import ModelShape, Record, only_bits, packed_bytes
from compress.export.format import PlannedSize


def planned_size(cfg: Any, shape: ModelShape, records: dict[str, Record], dtype_bits: int) -> PlannedSize:
    float_bits = 16 if cfg.dtype == "float16" else 32
    if cfg.fp8:
        size = packed_bytes(shape, records, float_bits, code_bits=8, scale_bits=float_bits, zero_bits=0, group=10**9)
        basis = "fp8 e4m3 weights with per-channel scales"
    elif cfg.fallback == "int8" and any(not r.scheme.symmetric or r.scheme.bits != 4 for r in records.values()):
        size = packed_bytes(shape, records, float_bits, code_bits=8, scale_bits=float_bits, zero_bits=0, group=10**9)
        basis = "records without an exact Q/DQ form as int8 per-channel"
    else:
        size = packed_bytes(shape, records, float_bits, scale_bits=float_bits, zero_bits=0)
        basis = f"int{only_bits(records) or 4} Q/DQ blocks with {float_bits}-bit scales"
    return size, float_bits / 8, basis + f"; floats at {cfg.dtype}"
