"""The planned size of a GGUF export from the recipe alone (``compress plan``)."""

from __future__ import annotations

from typing import Any

from compress.eval.plan_sizes import GGUF_BITS, ModelShape, Record, packed_bytes, uniform_bytes
from compress.export.format import PlannedSize


def planned_size(spec: Any, shape: ModelShape, records: dict[str, Record], dtype_bits: int) -> PlannedSize:
    if spec.quantizer == "llama.cpp":
        kind, float_type = spec.type, spec.float_type or "q8_0"  # llama.cpp picks the embedding's type itself; q8_0 assumed
        size = uniform_bytes(shape, GGUF_BITS[kind], GGUF_BITS[float_type])
        return (
            size,
            2.0,
            (
                f"llama.cpp {kind} at ~{GGUF_BITS[kind]} bits/weight (its published average; rows "
                f"that are not a multiple of 256 fall back to larger types), embedding {float_type}"
            ),
        )
    kind = _gguf_type(spec.type, records)
    float_type = spec.float_type or ("q8_0" if kind.startswith("q") else kind)
    size = packed_bytes(shape, records, GGUF_BITS[float_type], code_bits=GGUF_BITS[kind], scale_bits=0, zero_bits=0)
    return size, 2.0, f"records as {kind} blocks ({GGUF_BITS[kind]} bits/weight), other tensors {float_type}"


def _gguf_type(spec_type: str, records: dict[str, Record]) -> str:
    """The export's block type as the GGUF writer resolves it; an ``auto`` the writer would refuse
    (mixed schemes: the run asks for a type) is planned as f16."""
    from compress.errors import FormatError
    from compress.export.gguf.file import resolve_type

    try:
        return resolve_type(spec_type, records)  # type: ignore[arg-type]  # only .scheme is read
    except FormatError:
        return "f16"
