"""The planned size of an ONNX export from the recipe alone (``compress plan``)."""

from __future__ import annotations

from typing import Any

from compress.export.format import PlannedSize
from compress.sizes import ModelShape, Record, builder_bytes, only_bits, packed_bytes


def planned_size(spec: Any, shape: ModelShape, records: dict[str, Record], dtype_bits: int) -> PlannedSize:
    float_bits = 32 if spec.device == "cpu" else 16
    precision = spec.precision
    if precision == "auto":
        precision = {4: "int4", 8: "int8"}.get(only_bits(records), "fp32") if records else "fp32"
    if precision in ("fp32", "fp16"):
        size = shape.params * (32 if precision == "fp32" else 16) // 8
        return size, float_bits / 8, f"every parameter at {precision}"
    bits, block = (4 if precision == "int4" else 8), spec.block_size or 32
    if spec.quantizer == "builder" or not records:
        size = builder_bytes(shape, bits, block, spec.symmetric, float_bits)
        return size, float_bits / 8, f"builder {precision} blocks of {block}; floats at {float_bits} bits"
    size = packed_bytes(shape, records, float_bits, code_bits=bits, scale_bits=float_bits)
    return size, float_bits / 8, f"MatMulNBits {precision}: codes + {float_bits}-bit scales per group; floats at {float_bits} bits"
