"""The output head and the token embeddings of an int ONNX export: which of them the file holds as
blocks, where their records come from, and the graph edit that puts the embeddings into ONNX
Runtime's ``GatherBlockQuantized`` (com.microsoft).

The head is a MatMulNBits node like any decoder Linear: its record is the quantize stage's (GPTQ with
``ignore: []``) or, when the recipe left it float, rounded to nearest here in the records' scheme.
The embedding table is gathered, never multiplied, so calibration cannot weigh its rows: each row
is rounded to nearest in the same scheme. When the source ties the two, the file holds one table:
the gather reads the head's MatMulNBits blocks (``B`` reshaped to ``[vocab, blocks · blob]``, its
scales ``[vocab, blocks]`` and zero points ``[vocab, ⌈blocks · bits / 8⌉]``, shapes both ops accept),
so the embeddings are the head's record. Every table is proven like the decoder: unpacked from the
file and compared with its record, codes, scales and zero points.

``GatherBlockQuantized`` on uint8 data follows MatMulNBits' packing (low nibble first, default zero
point ``2**(bits−1)``); the hidden size is always whole blocks here, since the head's width is the
hidden size and the block size divides every record's width.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from compress.errors import FormatError
from compress.export.onnx import builder as ob
from compress.export.onnx import matmulnbits as mnb
from compress.quantizers.core import QuantizedWeight
from compress.quantizers.rtn import rtn_quantize
from compress.schema.quantize import QuantScheme

HEAD = ob.HEAD_LAYER
EMBEDDINGS = "embeddings"
GATHER_NODE = "/model/embed_tokens/GatherBlockQuantized"
TABLE_PREFIX = "model.embed_tokens.GatherBlockQuantized"


@dataclass
class Tables:
    """What the file holds for the head and the embeddings (None: float)."""

    head: QuantizedWeight | None = None
    embedding: QuantizedWeight | None = None
    shared: bool = False  # the gather reads the head's blocks (a tied source)
    block_size: int = 32  # the file's MatMulNBits / GatherBlockQuantized block size
    head_rounded_here: bool = False  # the head's record was made by the export, not the quantize stage
    facts: dict[str, Any] = field(default_factory=dict)


def export_scheme(records: dict[str, QuantizedWeight], bits: int, block_size: int) -> QuantScheme:
    """The scheme of a table rounded at export: the records' own when they share one (so a GPTQ
    checkpoint still holds one scheme and the builder can read it), else their bits, symmetry and
    scale precision in groups of the file's block size."""
    schemes = {r.scheme for r in records.values()}
    if len(schemes) == 1:
        return schemes.pop()
    symmetric = all(r.scheme.symmetric for r in records.values())
    scale_dtypes = {r.scheme.scale_dtype for r in records.values()}
    scale_dtype = scale_dtypes.pop() if len(scale_dtypes) == 1 else "float32"
    return QuantScheme(bits=bits, group_size=block_size, symmetric=symmetric, scale_dtype=scale_dtype)


def _weight(module: nn.Module) -> torch.Tensor:
    from compress import streaming

    with streaming.resident(module):
        return module.weight.detach().to(torch.float32).clone()


def _describe(record: QuantizedWeight, block_size: int) -> str:
    s = record.scheme
    return f"int{s.bits} block {block_size} {'sym' if s.symmetric else 'asym'}"


def check(records: dict[str, QuantizedWeight], float_tables: tuple[str, ...]) -> None:
    """Refuse a head that the quantize stage quantized and the export is asked to keep float."""
    if HEAD in float_tables and HEAD in records:
        raise FormatError(
            "keep_float lists lm_head and the quantize stage quantized it (ignore: []): keep the head in "
            "the quantize stage's ignore, or take lm_head out of keep_float"
        )


def plan(model: nn.Module, records: dict[str, QuantizedWeight], float_tables: tuple[str, ...], bits: int, block_size: int) -> Tables:
    """Which tables the file quantizes and their records. A head record from the quantize stage is
    used as it is; any other table is rounded to nearest in ``export_scheme``."""
    check(records, float_tables)
    tables = Tables(block_size=block_size)
    keep_head = HEAD in float_tables
    scheme = export_scheme(records, bits, block_size)
    head_module = model.get_output_embeddings()
    embed_module = model.get_input_embeddings()
    tied_source = bool(getattr(model.config, "tie_word_embeddings", False))
    if not keep_head and head_module is not None:
        if HEAD in records:
            tables.head = records[HEAD]
            tables.facts[HEAD] = {"type": _describe(records[HEAD], block_size), "record": "the quantize stage's"}
        else:
            tables.head, tables.head_rounded_here = rtn_quantize(_weight(head_module), scheme), True
            tables.facts[HEAD] = {"type": _describe(tables.head, block_size), "record": "rounded to nearest at export"}
    else:
        tables.facts[HEAD] = {"type": "float"}
    if EMBEDDINGS in float_tables:
        tables.facts[EMBEDDINGS] = {"type": "float"}
    elif tied_source and tables.head is not None:
        tables.embedding, tables.shared = tables.head, True
        tables.facts[EMBEDDINGS] = {
            "type": tables.facts[HEAD]["type"],
            "record": "the output head's (one table: the source ties them)",
        }
    else:
        tables.embedding = rtn_quantize(_weight(embed_module), scheme)
        tables.facts[EMBEDDINGS] = {"type": _describe(tables.embedding, block_size), "record": "rounded to nearest at export"}
    for name, record in ((HEAD, tables.head), (EMBEDDINGS, None if tables.shared else tables.embedding)):
        if record is not None:
            tables.facts[name]["bits_per_weight"] = round(record.bits_per_weight, 4)
    return tables


# --------------------------------------------------------------------------- graph edit


def _producer(graph: Any, output: str) -> Any | None:
    return next((n for n in graph.node if output in n.output), None)


def _head_node(model: Any) -> Any:
    node = next((n for n, names in ob.quantized_nodes(model) if names == (HEAD,)), None)
    if node is None:
        raise FormatError("the ONNX graph has no MatMulNBits node for lm_head to share with the embeddings")
    return node


def _remove_unused(graph: Any) -> None:
    """Drop nodes whose outputs nothing reads (the float gather's Transpose) and initializers no node reads."""
    outputs = {o.name for o in graph.output}
    while True:
        used = {i for n in graph.node for i in n.input} | outputs
        dead = [n for n in graph.node if not any(o in used for o in n.output)]
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
    used = {i for n in graph.node for i in n.input}
    for init in [t for t in graph.initializer if t.name not in used]:
        graph.initializer.remove(init)


def _as_2d(graph: Any, name: str, rows: int) -> None:
    """Reshape an initializer to [rows, -1] in place (the same bytes; MatMulNBits reads either shape)."""
    from onnx import numpy_helper

    init = next(t for t in graph.initializer if t.name == name)
    array = numpy_helper.to_array(init).reshape(rows, -1)
    init.CopyFrom(numpy_helper.from_array(array, name))


def write_embeddings(model: Any, tables: Tables) -> None:
    """Replace the builder's float embedding Gather with a GatherBlockQuantized over the embedding's
    blocks (the head's, shared, or a table of its own)."""
    import onnx
    from onnx import numpy_helper

    if tables.embedding is None:
        return
    graph = model.graph
    gather = next((n for n in graph.node if n.name == ob.EMBEDDING_NODE), None)
    if gather is None or gather.op_type != "Gather":
        raise FormatError(f"the builder's graph has no float {ob.EMBEDDING_NODE} to quantize")
    output, ids = gather.output[0], gather.input[1]
    record = tables.embedding
    vocab, hidden = record.shape
    if tables.shared:
        head = _head_node(model)
        block_size, bits = int(ob.attributes(head)["block_size"]), int(ob.attributes(head)["bits"])
        _as_2d(graph, head.input[2], vocab)
        has_zeros = len(head.input) > 3 and bool(head.input[3])
        if has_zeros:
            _as_2d(graph, head.input[3], vocab)
        b, scales, zeros = head.input[1], head.input[2], head.input[3] if has_zeros else ""
    else:
        block_size, bits = tables.block_size, record.scheme.bits
        packed = mnb.pack(mnb.record_blocks(record, block_size), with_zero_points=False)
        b, scales = f"{TABLE_PREFIX}.B", f"{TABLE_PREFIX}.scales"
        k_blocks = packed["B"].shape[1]
        graph.initializer.append(numpy_helper.from_array(packed["B"].reshape(vocab, -1), b))  # already [vocab, blocks · blob]
        graph.initializer.append(numpy_helper.from_array(packed["scales"].reshape(vocab, k_blocks), scales))
        zeros = ""
        if "zero_points" in packed:
            zeros = f"{TABLE_PREFIX}.zero_points"
            graph.initializer.append(numpy_helper.from_array(packed["zero_points"].reshape(vocab, -1), zeros))
    if hidden % block_size:  # every record's width, the head's (= hidden) included, is whole blocks (common_block_size)
        raise FormatError(f"hidden size {hidden} is not a whole number of blocks of {block_size}")
    nodes, data = [], b
    if tables.shared:  # the head's B is [vocab, blocks, blob]: the gather reads it as [vocab, blocks · blob]
        shape_name, data = f"{TABLE_PREFIX}.shape", f"{TABLE_PREFIX}.data"
        graph.initializer.append(numpy_helper.from_array(np.array([vocab, hidden * bits // 8], dtype=np.int64), shape_name))
        nodes.append(onnx.helper.make_node("Reshape", [b, shape_name], [data], name="/model/embed_tokens/Reshape"))
    nodes.append(
        onnx.helper.make_node(
            "GatherBlockQuantized",
            [data, ids, scales, *([zeros] if zeros else [])],
            [output],
            name=GATHER_NODE,
            domain="com.microsoft",
            bits=bits,
            block_size=block_size,
            gather_axis=0,
            quantize_axis=1,
        )
    )
    at = list(graph.node).index(gather)
    graph.node.remove(gather)
    for i, node in enumerate(nodes):
        graph.node.insert(at + i, node)
    _remove_unused(graph)


def compare_embeddings(model: Any, tables: Tables) -> list[str]:
    """Unpack the GatherBlockQuantized table (through its Reshape) and compare it with the embedding's
    record; for a shared table, also that it reads the head node's own initializers."""
    from onnx import numpy_helper

    if tables.embedding is None:
        return []
    graph = model.graph
    gather = next((n for n in graph.node if n.name == GATHER_NODE), None)
    if gather is None:
        return [f"no {GATHER_NODE} node"]
    inits = {t.name: t for t in graph.initializer}
    reshape = _producer(graph, gather.input[0])
    data_name = reshape.input[0] if reshape is not None and reshape.op_type == "Reshape" else gather.input[0]
    problems = []
    if tables.shared:
        head = _head_node(model)
        want = [head.input[1], head.input[2], head.input[3] if len(head.input) > 3 else ""]
        got = [data_name, gather.input[2], gather.input[3] if len(gather.input) > 3 else ""]
        if want != got:
            problems.append(f"the shared table reads {got}, the head {want}")
    a = ob.attributes(gather)
    vocab, hidden = tables.embedding.shape

    def array(name: str) -> np.ndarray | None:
        return numpy_helper.to_array(inits[name]) if name else None

    got_blocks = mnb.unpack(
        array(data_name),
        array(gather.input[2]),
        array(gather.input[3] if len(gather.input) > 3 else ""),
        vocab,
        hidden,
        int(a["bits"]),
        int(a["block_size"]),
    )
    want_blocks = mnb.record_blocks(tables.embedding, int(a["block_size"]))
    return problems + [f"{GATHER_NODE}: {d}" for d in mnb.differences(want_blocks, got_blocks)]
