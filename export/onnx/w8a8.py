"""W8A8 layers (``quantize: {method: w8a8}``) in the ONNX export: standard Q/DQ subgraphs that compute what
``W8A8Linear`` (quantizers/w8a8.py) computes, written into onnxruntime-genai's fp32 graph in place of each
recorded layer's float ``MatMul``, and read back.

For the input ``x`` [..., in] of a MatMul whose weight is a W8A8 record (int8 codes ``q_w`` [out, in], float
scales ``s_w`` [out], ``w = q_w · s_w``)::

    absmax = ReduceMax(Abs(x), axes=[-1], keepdims=1)         # per token
    s_x    = Where(absmax > 0, absmax / 127, 1)               # an all-zero row gets scale 1 (quantize_rows_int8)
    x_q    = QuantizeLinear(x / s_x, scale 1, zero point int8 0)   # round half to even, saturating
    y      = MatMul(DequantizeLinear(x_q, 1, 0), DequantizeLinear(W, s_w, axis=1)) · s_x

``W`` is the record's codes as an int8 initializer [in, out] (the MatMul's B layout) and ``s_w`` its scales in
float32 (the record's float16 values, exactly). ``|x / s_x| <= 127`` always (``s_x >= absmax / 127`` up to one
rounding, which cannot reach 127.5), so QuantizeLinear's saturation to [-128, 127] equals the quantizer's clamp
to [-127, 127]. Linears that read one tensor (gate and up; q/k/v are one fused MatMul) each quantize it with a chain of their own
(the same codes twice), which ONNX Runtime fuses into an integer GEMM each (``quantize_input_nodes``).

The activation scale is dynamic, so it is applied outside the Q/DQ pair (a Div before QuantizeLinear of scale 1,
a Mul after the MatMul); the pair itself has constant scales, the pattern a Q/DQ-aware runtime turns into an
integer GEMM. ONNX Runtime's CPU optimizer (level extended and above) fuses ``DequantizeLinear → MatMul ←
DequantizeLinear`` into ``MatMulIntegerToFloat`` (int8 x int8, int32 sums, times ``s_w``): the same integer
products as W8A8Linear's, scaled as ``(acc · s_w) · s_x`` where torch computes ``(acc · s_x) · s_w``, so outputs
agree to float32 rounding (docs/exports/onnx.md has the measured differences).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torch import nn

from compress.errors import FormatError
from compress.export.onnx import builder as ob
from compress.quantizers.core import QuantizedWeight
from compress.quantizers.llm_int8 import INT8_MAX, signed_codes

PRECISION = "w8a8"
NOT_EXACT = (
    "per-token int8 activations: float32 rounding differences between ONNX Runtime and torch (norms, attention) flip "
    "activation codes that sit on a rounding boundary, and each flip moves every later layer's inputs; the layers "
    "themselves are proven bit for bit, the whole model is held to same_weights_max_kl (docs/exports/onnx.md)"
)
BUILDER_PRECISION = "fp32"  # the builder's graph whose float MatMuls the Q/DQ subgraphs replace
CONSTANT_PREFIX = "w8a8"
ZERO_NAME, ONE_NAME, AXES_NAME = (f"{CONSTANT_PREFIX}.{n}" for n in ("zero", "one", "last_axis"))


def w8a8_layers(model: nn.Module, records: dict[str, QuantizedWeight]) -> list[str]:
    """The recorded layers whose module quantizes its input to int8 per token at run time (a w8a8 stage's)."""
    from compress.quantizers.w8a8 import W8A8Linear

    modules = dict(model.named_modules())  # a fused expert's record names no module: never W8A8
    return [name for name in records if isinstance(modules.get(name), W8A8Linear)]


def float_matmuls(model: Any) -> list[tuple[Any, tuple[str, ...]]]:
    """The builder's float MatMul nodes that compute Linear layers (the head's included), with their layer names."""
    found = []
    for node in model.graph.node:
        if node.op_type == "MatMul":
            names = ob.layer_names(node.name)
            if names is not None:
                found.append((node, names))
    return found


def _layer_weight(names: tuple[str, ...], records: dict[str, QuantizedWeight]) -> tuple[np.ndarray, np.ndarray]:
    """The int8 initializer [in, out] and float32 scales [out] of the layers one MatMul computes (fused rows concatenated)."""
    codes, scales = [], []
    for name in names:
        q, s = signed_codes(records[name])
        codes.append(q.numpy())
        scales.append(s.numpy())
    return np.ascontiguousarray(np.concatenate(codes).T), np.concatenate(scales)


def _constants() -> list[Any]:
    from onnx import numpy_helper

    values = {ZERO_NAME: np.array(0, np.float32), ONE_NAME: np.array(1, np.float32), AXES_NAME: np.array([-1], np.int64)}
    return [numpy_helper.from_array(v, k) for k, v in values.items()]


def quantize_input_nodes(x: str, prefix: str, name: str) -> tuple[list[Any], list[Any], str, str]:
    """Nodes that quantize ``x`` to int8 per token for the MatMul of layer(s) ``name``, and their initializers of
    their own: (nodes, initializers, the int8 codes, the per-token scale s_x). Each MatMul's chain has constants of
    its own (the 127, QuantizeLinear's scale 1 and zero point 0): ONNX Runtime's common-subexpression pass would
    merge identical chains reading one tensor (gate and up), and a Q/DQ pair with two consumers is not fused."""
    from onnx import numpy_helper

    int8_max, one, zero_point = f"{name}.input_int8_max", f"{name}.input_scale", f"{name}.input_zero_point"
    initializers = [
        numpy_helper.from_array(np.array(INT8_MAX, np.float32), int8_max),
        numpy_helper.from_array(np.array(1, np.float32), one),
        numpy_helper.from_array(np.array(0, np.int8), zero_point),
    ]
    from onnx import helper

    def out(step: str) -> str:
        return f"{prefix}/{step}/output_0"

    nodes = [
        helper.make_node("Abs", [x], [out("Abs")], name=f"{prefix}/Abs"),
        helper.make_node("ReduceMax", [out("Abs"), AXES_NAME], [out("ReduceMax")], name=f"{prefix}/ReduceMax", keepdims=1),
        helper.make_node("Div", [out("ReduceMax"), int8_max], [out("DivMax")], name=f"{prefix}/DivMax"),
        helper.make_node("Greater", [out("ReduceMax"), ZERO_NAME], [out("Greater")], name=f"{prefix}/Greater"),
        helper.make_node("Where", [out("Greater"), out("DivMax"), ONE_NAME], [out("Scale")], name=f"{prefix}/Scale"),
        helper.make_node("Div", [x, out("Scale")], [out("Div")], name=f"{prefix}/Div"),
        helper.make_node("QuantizeLinear", [out("Div"), one, zero_point], [out("QuantizeLinear")], name=f"{prefix}/QuantizeLinear"),
    ]
    return nodes, initializers, out("QuantizeLinear"), out("Scale")


def write_w8a8(model: Any, records: dict[str, QuantizedWeight]) -> int:
    """Replace every float MatMul that computes recorded layers with its Q/DQ subgraph (module docstring), in place.
    Returns the MatMul nodes written. A MatMul computing some recorded layers but not all is a FormatError."""
    from onnx import helper, numpy_helper

    graph = model.graph
    graph.initializer.extend(_constants())
    written = 0
    for node, names in float_matmuls(model):
        recorded = [n for n in names if n in records]
        if not recorded:
            continue
        if len(recorded) != len(names):
            raise FormatError(f"ONNX node {node.name} computes {', '.join(names)} in one MatMul; only {', '.join(recorded)} are W8A8")
        base = node.name.removesuffix("/MatMul")
        x, output, old_weight = node.input[0], node.output[0], node.input[1]
        at = list(graph.node).index(node)
        name = base.strip("/").replace("/", ".")
        new, constants, x_q, s_x = quantize_input_nodes(x, f"{base}/input_quant", name)
        x_scale, x_zero = constants[1].name, constants[2].name
        x_dq = f"{base}/input/DequantizeLinear/output_0"
        codes, scales = _layer_weight(names, records)
        weight, scale, weight_dq = f"{name}.weight_int8", f"{name}.weight_scale", f"{base}/weight/DequantizeLinear/output_0"
        graph.initializer.extend([*constants, numpy_helper.from_array(codes, weight), numpy_helper.from_array(scales, scale)])
        product = f"{base}/MatMul/unscaled_output"
        new += [
            helper.make_node("DequantizeLinear", [x_q, x_scale, x_zero], [x_dq], name=f"{base}/input/DequantizeLinear"),
            helper.make_node("DequantizeLinear", [weight, scale], [weight_dq], name=f"{base}/weight/DequantizeLinear", axis=1),
            helper.make_node("MatMul", [x_dq, weight_dq], [product], name=node.name),
            helper.make_node("Mul", [product, s_x], [output], name=f"{base}/input_scale/Mul"),
        ]
        graph.node.remove(node)
        for i, n in enumerate(new):
            graph.node.insert(at + i, n)
        if not any(old_weight in n.input for n in graph.node):  # a tied head's float table still feeds the embedding Gather
            graph.initializer.remove(next(t for t in graph.initializer if t.name == old_weight))
        written += 1
    return written


def _unit_quantizer(quantize: Any, inits: dict[str, Any]) -> bool:
    """A QuantizeLinear of scale 1 and int8 zero point 0 (the per-token scale is divided out before it)."""
    from onnx import numpy_helper

    if len(quantize.input) != 3 or not all(name in inits for name in quantize.input[1:]):
        return False
    scale, zero = (numpy_helper.to_array(inits[name]) for name in quantize.input[1:])
    return scale.dtype == np.float32 and float(scale) == 1.0 and zero.dtype == np.int8 and int(zero) == 0


def compare_w8a8(model: Any, records: dict[str, QuantizedWeight]) -> dict[str, Any]:
    """Read every W8A8 MatMul back from the graph: its weight must be a per-channel DequantizeLinear (axis 1) of an
    int8 initializer equal to the records' codes, with float32 scales equal to the records' scales, and its input
    the per-token QuantizeLinear / DequantizeLinear pair. Returns the counts and the problems found."""
    from onnx import numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    problems: list[str] = []
    covered: set[str] = set()
    nodes = 0
    for node, names in float_matmuls(model):
        recorded = [n for n in names if n in records]
        if not recorded:
            continue
        nodes += 1
        weight_dq, input_dq = producers.get(node.input[1]), producers.get(node.input[0])
        if weight_dq is None or weight_dq.op_type != "DequantizeLinear" or ob.attributes(weight_dq).get("axis") != 1:
            problems.append(f"{node.name}: its weight is not a per-channel DequantizeLinear (axis 1)")
            continue
        quantize = producers.get(input_dq.input[0]) if input_dq is not None and input_dq.op_type == "DequantizeLinear" else None
        if quantize is None or quantize.op_type != "QuantizeLinear" or not _unit_quantizer(quantize, inits):
            problems.append(f"{node.name}: its input is not quantized per token (QuantizeLinear of scale 1 -> DequantizeLinear)")
            continue
        want_codes, want_scales = _layer_weight(names, records) if len(recorded) == len(names) else (None, None)
        if want_codes is None:
            problems.append(f"{node.name}: computes {', '.join(names)}; only {', '.join(recorded)} are recorded")
            continue
        got_codes = numpy_helper.to_array(inits[weight_dq.input[0]])
        got_scales = numpy_helper.to_array(inits[weight_dq.input[1]])
        if got_codes.dtype != np.int8 or got_codes.shape != want_codes.shape:
            problems.append(f"{node.name}: weight {got_codes.dtype} {list(got_codes.shape)}, expected int8 {list(want_codes.shape)}")
        elif not np.array_equal(got_codes, want_codes):
            problems.append(f"{node.name}: codes: {int((got_codes != want_codes).sum())} of {got_codes.size} differ")
        if got_scales.dtype != np.float32 or not np.array_equal(got_scales, want_scales):
            problems.append(f"{node.name}: scales differ from the records' ({got_scales.dtype})")
        covered.update(names)
    for name in sorted(set(records) - covered):
        problems.append(f"{name}: recorded but no W8A8 MatMul holds it")
    return {"nodes": nodes, "layers": len(covered), "problems": problems}
