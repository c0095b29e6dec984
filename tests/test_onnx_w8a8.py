"""ONNX export of W8A8 (``quantize: {method: w8a8}``): each W8A8 layer becomes a standard Q/DQ subgraph
(per-token dynamic int8 activations, the record's int8 codes under a per-channel DequantizeLinear) in the
builder's fp32 graph. One layer's subgraph computes what W8A8Linear computes in ONNX Runtime (the same int8
codes of the input, outputs equal to float32 rounding); a recipe runs end to end into a file whose initializers
are the records bit for bit, verified in ONNX Runtime against the in-memory W8A8 model; weight-only precisions
and other mismatches are refused with exit 2 naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from compress.errors import FormatError
from compress.export.onnx import builder as ob
from compress.export.onnx import w8a8 as qdq
from compress.export.onnx.config import ONNXExportConfig
from compress.quantizers.llm_int8 import quantize_rows_int8, quantize_weight_int8, signed_codes
from compress.quantizers.w8a8 import W8A8Linear
from tests.helpers import run_cli
from tests.test_w8a8 import w8a8_recipe

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install 'compress[onnx]')")
pytestmark = pytest.mark.runtime

LAYER_RTOL = 1e-5
"""|ONNX Runtime − W8A8Linear| / max |W8A8Linear| on one layer: the int8 products are the same, ONNX Runtime's
fused MatMulIntegerToFloat scales them as (acc · s_w) · s_x where torch does (acc · s_x) · s_w (observed ~5e-7)."""
SAME_WEIGHTS_KL = 1e-6
"""Same-weights KL (nats/token) of the tiny model's w8a8 file in ONNX Runtime against the in-memory W8A8 model
(observed 6.5e-8, top-1 agreement 1: where float32 rounding differs, an activation code can flip by one)."""


def one_layer_graph(in_f: int, out_f: int, weight: np.ndarray) -> object:
    """A graph as the builder writes one Linear: ``y = MatMul(x, W [in, out])`` named like a decoder down_proj."""
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="/model/layers.0/mlp/down_proj/MatMul")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", in_f])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", out_f])],
        [numpy_helper.from_array(weight, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)], ir_version=10)


def test_one_layers_qdq_graph_computes_what_w8a8linear_computes(tmp_path: Path) -> None:
    import onnx
    import onnxruntime as ort

    torch.manual_seed(0)
    in_f, out_f = 160, 96
    linear = nn.Linear(in_f, out_f, bias=False)
    record = quantize_weight_int8(linear.weight)
    layer = W8A8Linear(linear, record, "torch")
    x = torch.randn(2, 7, in_f) * 3
    x[0, 2] = 0.0  # a row of zeros: scale 1, codes 0, output 0
    x[1, 4, 11] = 400.0  # one large outlier: the row's other features round to few codes
    halves = [(j % 20) - 10 + 0.5 for j in range(in_f - 1)]
    x[1, 5] = 0.0625 * torch.tensor([127.0, *halves])  # scale 0.0625 exactly, codes at exact halves: round half to even
    with torch.no_grad():
        want = layer(x).numpy()
    model = one_layer_graph(in_f, out_f, linear.weight.detach().numpy().T.copy())
    assert qdq.write_w8a8(model, {"model.layers.0.mlp.down_proj": record}) == 1
    onnx.checker.check_model(model, full_check=True)
    assert qdq.compare_w8a8(model, {"model.layers.0.mlp.down_proj": record})["problems"] == []
    assert {n.op_type for n in model.graph.node} >= {"QuantizeLinear", "DequantizeLinear", "MatMul"}
    assert not any(n.domain for n in model.graph.node)  # standard ONNX only
    assert "w" not in {t.name for t in model.graph.initializer}  # the float weight is gone
    # ONNX Runtime's optimizer (default level) fuses the Q/DQ pair and the MatMul into an integer GEMM
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    assert "MatMulIntegerToFloat" in {n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node}
    y = session.run(["y"], {"x": x.numpy()})[0]
    assert np.all(y[0, 2] == 0)
    assert np.abs(y - want).max() <= LAYER_RTOL * np.abs(want).max(), float(np.abs(y - want).max())
    # the activation codes, bit for bit (read as a second output, which leaves that session unfused)
    codes = next(n for n in model.graph.node if n.op_type == "QuantizeLinear").output[0]
    model.graph.output.append(onnx.helper.make_tensor_value_info(codes, onnx.TensorProto.INT8, None))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x_q = session.run([codes], {"x": x.numpy()})[0]
    want_q, _ = quantize_rows_int8(x.reshape(-1, in_f))
    assert np.array_equal(x_q.reshape(-1, in_f), want_q.numpy())


def test_fused_rows_and_a_changed_code_or_scale_are_read_back() -> None:
    """A fused q/k/v MatMul holds the three records' rows side by side; a changed code or scale is a problem."""
    from onnx import numpy_helper

    records = {f"model.layers.0.self_attn.{p}_proj": quantize_weight_int8(torch.randn(n, 32)) for p, n in (("q", 32), ("k", 16), ("v", 16))}
    model = one_layer_graph(32, 64, np.zeros((32, 64), np.float32))
    model.graph.node[0].name = "/model/layers.0/attn/qkv_proj/MatMul"
    assert qdq.write_w8a8(model, records) == 1
    assert qdq.compare_w8a8(model, records) == {"nodes": 1, "layers": 3, "problems": []}
    inits = {t.name: t for t in model.graph.initializer}
    codes = numpy_helper.to_array(inits["model.layers.0.attn.qkv_proj.weight_int8"])
    q, _ = signed_codes(records["model.layers.0.self_attn.k_proj"])
    assert codes.dtype == np.int8 and np.array_equal(codes[:, 32:48], q.numpy().T)
    for name, change in (("weight_int8", lambda a: a.__setitem__((0, 0), a[0, 0] ^ 1)), ("weight_scale", lambda a: a.__imul__(1.001))):
        tensor = inits[f"model.layers.0.attn.qkv_proj.{name}"]
        original = numpy_helper.to_array(tensor).copy()
        data = original.copy()
        change(data)
        tensor.CopyFrom(numpy_helper.from_array(data, tensor.name))
        problems = qdq.compare_w8a8(model, records)["problems"]
        assert len(problems) == 1 and ("codes: 1 of" in problems[0] or "scales differ" in problems[0]), problems
        tensor.CopyFrom(numpy_helper.from_array(original, tensor.name))
    partial = one_layer_graph(32, 64, np.zeros((32, 64), np.float32))
    partial.graph.node[0].name = "/model/layers.0/attn/qkv_proj/MatMul"
    with pytest.raises(FormatError, match="only model.layers.0.self_attn.q_proj are W8A8"):
        qdq.write_w8a8(partial, {"model.layers.0.self_attn.q_proj": records["model.layers.0.self_attn.q_proj"]})
    missing = qdq.compare_w8a8(one_layer_graph(32, 64, np.zeros((32, 64), np.float32)), records)["problems"]
    assert missing == [f"{n}: recorded but no W8A8 MatMul holds it" for n in sorted(records)]


def test_onnx_precision_w8a8_configs() -> None:
    assert ONNXExportConfig(precision="w8a8").activation_refusal() is None and ONNXExportConfig().activation_refusal() is None
    assert "precision int8 cannot hold activation quantization" in ONNXExportConfig(precision="int8").activation_refusal()
    with pytest.raises(ValueError, match="keep_float does not apply to precision w8a8"):
        ONNXExportConfig(precision="w8a8", keep_float=["lm_head"])
    with pytest.raises(ValueError, match="w8a8 on cuda"):
        ONNXExportConfig(precision="w8a8", device="cuda")
    assert ob.layer_names("/model/layers.1/mlp/gate_proj/MatMul") == ("model.layers.1.mlp.gate_proj",)
    assert ob.layer_names("/lm_head/MatMul") == ("lm_head",)


def test_recipe_w8a8_exports_a_qdq_onnx_verified_in_onnx_runtime(tmp_path: Path, onnx_model_dir: Path, text_dir: Path) -> None:
    from onnx import numpy_helper

    from compress.artifact import load_artifact

    exports = "exports:\n  - format: onnx\n    name: qdq\n  - format: compressed-tensors\n"
    recipe = w8a8_recipe(tmp_path, onnx_model_dir, text_dir, "      method: w8a8\n      smoothing: {alpha: 0.5}\n", exports)
    out = tmp_path / "out"
    result = run_cli(["run", recipe, "-o", out, "-q"])
    assert result.exit_code == 0, result.output
    entry = json.loads((out / "manifest.json").read_text())["exports"][0]
    assert entry["precision"] == "w8a8" and entry["quantizer"] == "records" and entry["accuracy_level"] is None
    assert entry["records_exact"] == 14 and entry["nodes_written"] == 10  # 2 layers x (fused qkv, o, gate, up, down)
    assert entry["tables"] == {"lm_head": {"type": "float"}, "embeddings": {"type": "float"}}
    assert entry["ops"]["QuantizeLinear"] == 10 and entry["ops"]["DequantizeLinear"] == 20  # gate and up: a quantizer each
    assert "com.microsoft.MatMulNBits" not in entry["ops"] and entry["ops"]["MatMul"] == 11  # the float head too
    evals = {e["artifact"]: e for e in json.loads((out / "report.json").read_text())["evaluations"]}
    details = evals["qdq"]["details"]
    assert details["same_weights_kl"] < SAME_WEIGHTS_KL and details["same_weights_top1"] == 1.0, details
    assert details["level0_same_weights_kl"] == details["same_weights_kl"] and details["sample"]["decode_tokens"] > 0
    assert details["same_weights_note"].startswith("per-token int8 activations")  # held to same_weights_max_kl, not 1e-3
    onnx_kl, torch_kl = evals["qdq"]["metrics"]["kl_divergence"], evals["compressed"]["metrics"]["kl_divergence"]
    assert abs(onnx_kl - torch_kl) < 0.01 * torch_kl, (onnx_kl, torch_kl)  # observed 0.15%: the W8A8 error itself is tiny here
    # read the shipped file back with onnx: every layer's int8 initializer and scales are the artifact's records
    _, _, records = load_artifact(out)
    graph = ob.load(out / "exports" / "qdq")
    assert qdq.compare_w8a8(graph, records) == {"nodes": 10, "layers": 14, "problems": []}
    inits = {t.name: numpy_helper.to_array(t) for t in graph.graph.initializer}
    q, s = signed_codes(records["model.layers.1.mlp.down_proj"])
    assert np.array_equal(inits["model.layers.1.mlp.down_proj.weight_int8"], q.numpy().T)
    assert np.array_equal(inits["model.layers.1.mlp.down_proj.weight_scale"], s.numpy())
    assert not any(name.endswith("down_proj.MatMul.weight") for name in inits)  # no float copy of a W8A8 weight
    # ONNX Runtime's optimizer turns every W8A8 MatMul of the file into an integer GEMM
    import onnx
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(out / "exports" / "qdq" / "model.onnx"), options, providers=["CPUExecutionProvider"])
    fused = onnx.load(options.optimized_model_filepath, load_external_data=False)
    assert sum(n.op_type == "MatMulIntegerToFloat" for n in fused.graph.node) == 10


def test_w8a8_onnx_refusals_exit_2_naming_the_key(tmp_path: Path, onnx_model_dir: Path, text_dir: Path) -> None:
    cases = {
        "  - format: onnx\n    precision: int8\n": "precision int8 cannot hold activation quantization",
        "  - format: onnx\n    precision: fp32\n": "precision fp32 cannot hold activation quantization",
        "  - format: onnx\n    quantizer: builder\n    precision: int8\n": "quantizer: builder rounds the float weights itself",
        "  - format: onnx\n    precision: w8a8\n    keep_float: [embeddings]\n": "keep_float does not apply to precision w8a8",
    }
    for i, (export, message) in enumerate(cases.items()):
        recipe = w8a8_recipe(tmp_path, onnx_model_dir, text_dir, "      method: w8a8\n", "exports:\n" + export)
        result = run_cli(["validate", recipe.rename(tmp_path / f"bad{i}.yaml")])
        assert result.exit_code == 2 and message in result.output and "exports[0]" in result.output, result.output
        assert "Traceback" not in result.output
    # precision w8a8 on a model without w8a8 layers: refused before any work
    recipe = w8a8_recipe(
        tmp_path,
        onnx_model_dir,
        text_dir,
        "      method: rtn\n      bits: 8\n      group_size: null\n",
        "exports:\n  - format: onnx\n    precision: w8a8\n  - format: compressed-tensors\n",
    )
    out = tmp_path / "out"
    result = run_cli(["run", recipe, "-o", out, "-q"])
    assert result.exit_code == 2 and "precision w8a8 holds a w8a8 quantize stage's layers" in result.output and not out.exists()
    assert "Traceback" not in result.output


def test_plan_sizes_the_w8a8_onnx(tmp_path: Path, onnx_model_dir: Path, text_dir: Path) -> None:
    """`compress plan`: precision w8a8 at int8 codes + one float32 scale per row, every other parameter float32."""
    from transformers import AutoModelForCausalLM

    exports = "exports:\n  - format: onnx\n    precision: w8a8\n  - format: compressed-tensors\n"
    recipe = w8a8_recipe(tmp_path, onnx_model_dir, text_dir, "      method: w8a8\n", exports)
    out = tmp_path / "plan.json"
    result = run_cli(["plan", recipe, "--json", out])
    assert result.exit_code == 0, result.output
    model = AutoModelForCausalLM.from_pretrained(onnx_model_dir)
    linears = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    quantized = sum(m.weight.numel() for m in linears)
    expected = quantized + 4 * sum(m.out_features for m in linears) + 4 * (model.num_parameters() - quantized)
    row = next(a for a in json.loads(out.read_text())["artifacts"] if a["artifact"] == "onnx")
    assert row["size_bytes"] == expected
