"""The planned size of a GGUF export from the recipe alone (``compress plan``)."""

from __future__ import annotations

from typing import Any

from compress.eval.plan.shapes import ModelShape, Record, packed_bytes, uniform_bytes
from compress.export.format import PlannedSize
from compress.export.gguf.config import GGUF_FP4_TYPES
from compress.quantizers.grids import GRIDS

# llama.cpp's bits per weight: exact block sizes, and its published averages for the K-quant mixes.
GGUF_BITS = {
    "f32": 32,
    "f16": 16,
    "bf16": 16,
    "q8_0": 8.5,
    "q4_0": 4.5,
    "q4_1": 5.0,
    "q5_0": 5.5,
    "q5_1": 6.0,
    "q2_k": 3.35,
    "q3_k_s": 3.5,
    "q3_k_m": 3.91,
    "q3_k_l": 4.27,
    "q4_k_s": 4.58,
    "q4_k_m": 4.89,
    "q5_k_s": 5.54,
    "q5_k_m": 5.69,
    "q6_k": 6.56,
    "iq4_nl": 4.5,
    "iq4_xs": 4.25,
    "mxfp4": 4.25,
}


def planned_size(cfg: Any, shape: ModelShape, records: dict[str, Record], dtype_bits: int) -> PlannedSize:
    if cfg.target is not None:  # the budget is the size (the stage's choice fills it up to the budget)
        t = cfg.target
        size = t.bits_per_weight * shape.params / 8 if t.bits_per_weight is not None else t.size_mib * 2**20
        return size, 1.05, f"the target ({t.describe()}): a type per layer chosen to fill it"
    if cfg.quantizer == "llama.cpp":
        kind, float_type = cfg.type, cfg.float_type or "q8_0"  # llama.cpp picks the embedding's type itself; q8_0 assumed
        size = uniform_bytes(shape, GGUF_BITS[kind], _single_type_bits(float_type))
        return (
            size,
            2.0,
            (
                f"llama.cpp {kind} at ~{GGUF_BITS[kind]} bits/weight (its published average; rows "
                f"that are not a multiple of 256 fall back to larger types), embedding {float_type}"
            ),
        )
    kind = _gguf_type(cfg.type, records)
    float_type = cfg.float_type or ("q8_0" if kind.startswith("q") or kind in GGUF_FP4_TYPES else kind)  # as the writer
    bits = _single_type_bits(kind)
    size = packed_bytes(shape, records, _single_type_bits(float_type), code_bits=bits, scale_bits=0, zero_bits=0)
    return (
        size,
        2.0,
        f"records as {kind} blocks ({bits:g} bits/weight; K-quant rows not a multiple of 256: its fallback), other tensors {float_type}",
    )


def _single_type_bits(type_name: str) -> float:
    """Bits per weight of one block type (not a mix), or of a float type."""
    return GRIDS[type_name].bits_per_weight if type_name in GRIDS else GGUF_BITS[type_name]


def _gguf_type(type_name: str, records: dict[str, Record]) -> str:
    """The export's block type as the GGUF writer resolves it; an ``auto`` the writer would refuse
    (mixed schemes: the run asks for a type) is planned as f16."""
    from compress.errors import FormatError
    from compress.export.gguf.layout import resolve_type

    try:
        return resolve_type(type_name, records)  # type: ignore[arg-type]  # only .scheme is read
    except FormatError:
        return "f16"
