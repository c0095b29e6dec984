"""The planned size of an ONNX export from the recipe alone (``compress plan``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from compress.eval.plan.shapes import ModelShape, Record, linear_weights, only_bits, packed_bytes
from compress.export.format import PlannedSize


def planned_size(cfg: Any, shape: ModelShape, records: dict[str, Record], dtype_bits: int) -> PlannedSize:
    float_bits = 32 if cfg.device == "cpu" else 16
    precision = cfg.precision
    if precision == "auto":
        precision = {4: "int4", 8: "int8"}.get(only_bits(records), "fp32") if records else "fp32"
    if precision == "w8a8":  # export/onnx/w8a8.py: int8 codes + a float32 scale per row, head and embeddings as the stage left them
        size = packed_bytes(shape, records, float_bits, code_bits=8, scale_bits=32)
        return size, float_bits / 8, "Q/DQ int8 weights + float32 scale per row; activations int8 per token at run time; the rest float32"
    if precision in ("fp32", "fp16"):
        size = shape.params * (32 if precision == "fp32" else 16) // 8
        return size, float_bits / 8, f"every parameter at {precision}"
    bits, block = (4 if precision == "int4" else 8), cfg.block_size or 32
    floats = cfg.float_tables(precision)
    tables = (
        "head " + ("float" if "lm_head" in floats else "quantized") + ", embeddings " + ("float" if "embeddings" in floats else "quantized")
    )
    if cfg.quantizer == "builder" or not records:
        size = builder_bytes(shape, bits, block, cfg.symmetric, float_bits, floats)
        return size, float_bits / 8, f"builder {precision} blocks of {block}; {tables}; floats at {float_bits} bits"
    size = packed_bytes(shape, with_tables(shape, records, floats), float_bits, code_bits=bits, scale_bits=float_bits)
    return (
        size,
        float_bits / 8,
        f"MatMulNBits {precision}: codes + {float_bits}-bit scales per group; {tables}; floats at {float_bits} bits",
    )


def with_tables(shape: ModelShape, records: dict[str, Record], floats: tuple[str, ...]) -> dict[str, Record]:
    """The records plus the head and embedding tables the export quantizes (export/onnx/tables.py): the
    head in the records' scheme unless the stage quantized it; a tied source's embeddings are the
    head's table, an untied one's a table of their own."""
    emb = shape.model.get_input_embeddings().weight
    vocab, hidden = (int(n) for n in emb.shape)
    tied = bool(getattr(shape.text, "tie_word_embeddings", False))
    scheme = next(iter(records.values())).scheme
    out = dict(records)
    head_quantized = "lm_head" not in floats
    embeddings_quantized = "embeddings" not in floats
    if head_quantized:
        head = out.get("lm_head") or Record(vocab, hidden, scheme, tied)
        out["lm_head"] = dataclasses.replace(head, tied=tied and not embeddings_quantized)
    if embeddings_quantized and not (tied and head_quantized):  # beside a tied float head, the float table stays
        out["model.embed_tokens"] = Record(vocab, hidden, scheme, tied)
    return out


def builder_bytes(
    shape: ModelShape, bits: int, block: int, symmetric: bool, float_bits: int, floats: tuple[str, ...] = ("lm_head", "embeddings")
) -> int:
    """Bytes of onnxruntime-genai's own int file: every decoder Linear in blocks, the head and the token
    embeddings too unless ``floats`` names them (one table for a tied model when both are quantized)."""
    linear = linear_weights(shape, with_lm_head=False)
    emb = shape.model.get_input_embeddings().weight.numel()
    tied = bool(getattr(shape.text, "tie_word_embeddings", False))
    head, embeddings = "lm_head" not in floats, "embeddings" not in floats
    extra = 0  # a quantized copy beside the tied float table
    if tied and head and embeddings:
        linear += emb
    elif tied:
        extra = emb if head or embeddings else 0
    else:
        linear += (emb if head else 0) + (emb if embeddings else 0)
    per_weight = bits + (float_bits + (0 if symmetric else bits)) / block
    return int(((linear + extra) * per_weight + (shape.params - linear) * float_bits) / 8)
