"""TensorRT-ready ONNX (standard ops, Q/DQ weights) and the TensorRT engine builder.

The Q/DQ graph is run in ONNX Runtime (CPU, graph optimizations off so its own operators run):
a prefill with an empty past, then one decode step fed the prefill's ``present``, compared with
the in-memory torch model. Tolerances: fp32 graph with the records' exact weights, max abs logit
difference <= 1e-4 (observed ~4e-7) and KL <= 1e-8 nats/token; fp16 graph, <= 5e-3 (observed
~6e-4) and KL <= 1e-6. TensorRT needs a GPU: its profile logic is tested here as pure functions,
the build only where TensorRT and CUDA are present.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from pydantic import ValidationError
from torch import nn

from compress.errors import FormatError
from compress.export.tensorrt import config as S
from compress.export.tensorrt import engine as T
from compress.export.tensorrt import qdq as Q
from tests.test_formats import quantize
from tests.tiny import tiny_llama

VOCAB = 300
FP32_ATOL, FP32_KL = 1e-4, 1e-8
FP16_ATOL, FP16_KL = 5e-3, 1e-6
trt_reason = T.tensorrt_unavailable_reason()


def ids(batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))


def graph(directory: Path, weights: bool = False) -> onnx.GraphProto:
    return onnx.load(str(directory / Q.MODEL_FILE), load_external_data=weights).graph


def dequantize_nodes(g: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    """DequantizeLinear nodes by layer name."""
    return {n.input[0].removesuffix(".weight_quantized"): n for n in g.node if n.op_type == "DequantizeLinear"}


def attrs(node: onnx.NodeProto) -> dict[str, int]:
    return {a.name: a.i for a in node.attribute}


def with_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of ``model`` whose named Linear layers hold ``weights`` (what a converted graph computes)."""
    other = copy.deepcopy(model)
    modules = dict(other.named_modules())
    for name, w in weights.items():
        modules[name].weight = nn.Parameter(w.clone(), requires_grad=False)
    return other


@pytest.fixture(scope="module")
def int4_export(tmp_path_factory: pytest.TempPathFactory):
    """Attention at int4 block 128, MLP at int4 block 64 (hidden 128, intermediate 256), fp32 graph."""
    model = tiny_llama(VOCAB)
    records = quantize(model, 4, 128, True, targets=["self_attn.*"]) | quantize(model, 4, 64, True, targets=["mlp.*"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    directory = tmp_path_factory.mktemp("int4")
    facts = Q.write_qdq_onnx(directory, model, records, fallback=None)
    return directory, model, records, facts, before


# --------------------------------------------------------------------------- exact Q/DQ graphs


@pytest.mark.runtime
def test_int4_blocks_match_torch_in_prefill_and_decode(int4_export) -> None:
    directory, model, _, facts, before = int4_export
    got = Q.check_qdq_onnx(directory, model, ids())
    assert got["max_abs_diff"] <= FP32_ATOL and got["kl_divergence"] <= FP32_KL and got["top1_agreement"] == 1.0, got
    assert got["decode_max_abs_diff"] <= FP32_ATOL and got["present_length"] == 13 and got["tokens"] == 26
    assert facts["layers_by_precision"] == {"int4 block 128": 8, "int4 block 64": 6, "float (no record)": 1}
    assert facts["fallbacks"] == [] and facts["partial_blocks"] == [] and facts["opset"] == 21
    assert facts["ops"]["DequantizeLinear"] == 14 and facts["domains"] == [""]
    assert Q.non_standard_ops(directory / Q.MODEL_FILE) == []
    assert facts["inputs"]["attention_mask"] == ["batch", "total_sequence"]
    assert facts["inputs"]["past_key_values.1.value"] == ["batch", 2, "past_sequence", 32]
    assert facts["outputs"]["present.0.key"] == ["batch", 2, "total_sequence", 32]
    assert facts["outputs"]["logits"] == ["batch", "sequence", VOCAB]
    assert set(facts["files"]) == {Q.MODEL_FILE, Q.DATA_FILE}
    # the caller's model is untouched: its Linear layers are back, with the same weights
    assert all(type(m) is nn.Linear for n, m in model.named_modules() if n.endswith("_proj"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_int4_initializers_are_the_records_codes_and_scales(int4_export) -> None:
    directory, _, records, _, _ = int4_export
    g = graph(directory, weights=True)
    assert [(o.domain, o.version) for o in onnx.load(str(directory / Q.MODEL_FILE), load_external_data=False).opset_import] == [("", 21)]
    inits = {i.name: i for i in g.initializer}
    nodes = dequantize_nodes(g)
    assert set(nodes) == set(records)
    for name, record in records.items():
        assert attrs(nodes[name]) == {"axis": 0, "block_size": record.scheme.group_size}
        assert len(nodes[name].input) == 2  # no zero point
        q, scale = inits[f"{name}.weight_quantized"], inits[f"{name}.weight_scale"]
        assert q.data_type == onnx.TensorProto.INT4 and scale.data_type == onnx.TensorProto.FLOAT
        codes = numpy_helper.to_array(q).astype(np.int16)
        assert np.array_equal(codes, (record.codes.to(torch.int16) - 8).numpy().T), name
        assert np.array_equal(numpy_helper.to_array(scale), record.scale.float().numpy().T), name
    stored = onnx.load(str(directory / Q.MODEL_FILE), load_external_data=False).graph.initializer
    assert any(i.data_location == onnx.TensorProto.EXTERNAL for i in stored)


@pytest.mark.runtime
def test_partial_block_and_int8_per_channel(tmp_path: Path) -> None:
    """Hidden 96 with block 64 ends every attention row in a partial block of 32; the MLP is int8 per-channel."""
    model = tiny_llama(VOCAB, hidden=96, intermediate=160)
    records = quantize(model, 4, 64, True, targets=["self_attn.*"]) | quantize(model, 8, None, True, targets=["mlp.*"])
    facts = Q.write_qdq_onnx(tmp_path, model, records, fallback=None)
    assert facts["layers_by_precision"] == {"int4 block 64": 8, "int8 per-channel": 6, "float (no record)": 1}
    assert len(facts["partial_blocks"]) == 8 and all(n.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) for n in facts["partial_blocks"])
    got = Q.check_qdq_onnx(tmp_path, model, ids())
    assert got["max_abs_diff"] <= FP32_ATOL and got["kl_divergence"] <= FP32_KL and got["top1_agreement"] == 1.0, got
    g = graph(tmp_path, weights=True)
    inits = {i.name: i for i in g.initializer}
    for name, node in dequantize_nodes(g).items():
        record = records[name]
        q = inits[f"{name}.weight_quantized"]
        if record.scheme.bits == 8:
            assert attrs(node) == {"axis": 1} and q.data_type == onnx.TensorProto.INT8
            assert np.array_equal(numpy_helper.to_array(q), (record.codes.to(torch.int16) - 128).numpy().T)
            assert list(inits[f"{name}.weight_scale"].dims) == [record.shape[0]]
        else:
            assert list(inits[f"{name}.weight_scale"].dims) == [2, record.shape[0]]  # ceil(96 / 64) blocks


# --------------------------------------------------------------------------- conversions


def test_asymmetric_records_without_a_fallback_are_an_error(tmp_path: Path) -> None:
    model = tiny_llama(VOCAB)
    records = quantize(model, 4, 64, False)
    with pytest.raises(FormatError, match=r"model\.layers\.0\.mlp\.down_proj: its W4 g64 asym record .*fallback"):
        Q.write_qdq_onnx(tmp_path / "x", model, records, fallback=None)
    assert not (tmp_path / "x").exists()
    with pytest.raises(FormatError, match="unknown fallback 'fp16'"):
        Q.write_qdq_onnx(tmp_path / "x", model, records, fallback="fp16")
    with pytest.raises(FormatError, match="onnx dtype 'bfloat16'"):
        Q.write_qdq_onnx(tmp_path / "x", model, records, fallback="int8", dtype="bfloat16")


@pytest.mark.runtime
@pytest.mark.parametrize(("fallback", "became", "max_kl"), [("symmetric", "int4 block 64", 5e-3), ("int8", "int8 per-channel", 1e-4)])
def test_fallbacks_are_recorded_and_the_graph_computes_them_exactly(tmp_path: Path, fallback: str, became: str, max_kl: float) -> None:
    model = tiny_llama(VOCAB)
    records = quantize(model, 4, 32, False)
    facts = Q.write_qdq_onnx(tmp_path, model, records, fallback=fallback)
    assert facts["layers_by_precision"] == {became: 14, "float (no record)": 1}
    assert {f["layer"] for f in facts["fallbacks"]} == set(records)
    for f in facts["fallbacks"]:
        assert f["scheme"] == "W4 g32 asym" and f["became"] == became and f["why"] == f"fallback {fallback}"
        assert 0 < f["max_abs_weight_error"] < 0.05, f
    plans = {name: Q.plan_layer(name, r, fallback) for name, r in records.items()}
    assert all(plans[f["layer"]].max_abs_weight_error == f["max_abs_weight_error"] for f in facts["fallbacks"])
    # against the model with the records it was given: the conversion's damage, measured
    got = Q.check_qdq_onnx(tmp_path, model, ids())
    assert got["kl_divergence"] <= max_kl and got["top1_agreement"] >= 0.9, got
    # against the converted weights: the graph is exact
    converted = with_weights(model, {n: p.record.dequantize() for n, p in plans.items()})
    exact = Q.check_qdq_onnx(tmp_path, converted, ids())
    assert exact["max_abs_diff"] <= FP32_ATOL and exact["top1_agreement"] == 1.0, exact


@pytest.mark.runtime
def test_float16_graph_is_close(tmp_path: Path) -> None:
    model = tiny_llama(VOCAB)
    records = quantize(model, 4, 128, True)
    facts = Q.write_qdq_onnx(tmp_path, model, records, fallback=None, dtype="float16")
    assert facts["dtype"] == "float16" and facts["domains"] == [""]
    assert next(model.parameters()).dtype == torch.float32  # exported from a float16 copy
    got = Q.check_qdq_onnx(tmp_path, model, ids())
    assert got["max_abs_diff"] <= FP16_ATOL and got["kl_divergence"] <= FP16_KL and got["top1_agreement"] == 1.0, got
    g = graph(tmp_path)
    kinds = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output]}
    assert kinds["past_key_values.0.key"] == kinds["present.1.value"] == kinds["logits"] == onnx.TensorProto.FLOAT16
    assert all(i.data_type == onnx.TensorProto.FLOAT16 for i in g.initializer if i.name.endswith(".weight_scale"))


@pytest.mark.runtime
def test_fp8_weights_when_requested(tmp_path: Path) -> None:
    model = tiny_llama(VOCAB)
    records = quantize(model, 4, 64, True)
    facts = Q.write_qdq_onnx(tmp_path, model, records, fallback=None, fp8=True)
    assert facts["layers_by_precision"] == {"fp8 e4m3fn per-channel": 14, "float (no record)": 1}
    assert all(f["why"] == "fp8 requested" for f in facts["fallbacks"]) and len(facts["fallbacks"]) == 14
    g = graph(tmp_path)
    assert {i.data_type for i in g.initializer if i.name.endswith(".weight_quantized")} == {onnx.TensorProto.FLOAT8E4M3FN}
    assert {tuple(attrs(n).items()) for n in dequantize_nodes(g).values()} == {(("axis", 1),)}
    fp8 = {n: Q.fp8_dequantize(*Q.fp8_quantize(r.dequantize())) for n, r in records.items()}
    exact = Q.check_qdq_onnx(tmp_path, with_weights(model, fp8), ids())
    assert exact["max_abs_diff"] <= FP32_ATOL and exact["top1_agreement"] == 1.0, exact
    got = Q.check_qdq_onnx(tmp_path, model, ids())
    assert got["kl_divergence"] <= 1e-4, got


@pytest.mark.runtime
def test_check_refuses_contrib_operators(tmp_path: Path) -> None:
    from onnx import helper

    node = helper.make_node("FusedMatMul", ["a", "b"], ["y"], domain="com.microsoft")
    g = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [2, 2]) for n in "ab"],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 2])],
    )
    onnx.save(
        helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]),
        str(tmp_path / Q.MODEL_FILE),
    )
    assert Q.non_standard_ops(tmp_path / Q.MODEL_FILE) == ["FusedMatMul@com.microsoft"]
    with pytest.raises(FormatError, match="non-standard operators"):
        Q.check_qdq_onnx(tmp_path, tiny_llama(VOCAB), ids())


# --------------------------------------------------------------------------- TensorRT (pure parts)


def test_tensorrt_config_is_validated() -> None:
    assert S.TensorRTConfig().past.min == 0
    with pytest.raises(ValidationError, match="min <= opt <= max"):
        S.DimRange(min=4, opt=2, max=8)
    with pytest.raises(ValidationError, match="sequence.min must be at least 1"):
        S.TensorRTConfig(sequence={"min": 0, "opt": 1, "max": 8})
    with pytest.raises(ValidationError, match="batch.min"):
        S.TensorRTConfig(batch={"min": 0, "opt": 1, "max": 8})
    with pytest.raises(ValidationError, match="workspace_gib"):
        S.TensorRTConfig(workspace_gib=2)


def test_profile_shapes_for_the_exported_inputs(int4_export) -> None:
    directory = int4_export[0]
    config = S.TensorRTConfig(
        batch={"min": 1, "opt": 2, "max": 4}, sequence={"min": 1, "opt": 64, "max": 256}, past={"min": 0, "opt": 192, "max": 768}
    )
    axes = T.onnx_input_axes(directory / Q.MODEL_FILE)
    assert list(axes) == Q.io_names(2)[0]
    shapes = T.profile_shapes(axes, config)
    assert shapes["input_ids"] == shapes["position_ids"] == ((1, 1), (2, 64), (4, 256))
    assert shapes["attention_mask"] == ((1, 1), (2, 256), (4, 1024))  # past + sequence
    for i in range(2):
        assert shapes[f"past_key_values.{i}.key"] == ((1, 2, 0, 32), (2, 2, 192, 32), (4, 2, 768, 32))
    with pytest.raises(FormatError, match="input x axis 1 is 'tokens'"):
        T.profile_shapes({"x": ["batch", "tokens"]}, config)


@pytest.mark.runtime
@pytest.mark.skipif(trt_reason is None, reason="TensorRT and a GPU are present: the refusal cannot be observed")
def test_build_engine_says_why_it_cannot_run(int4_export, tmp_path: Path) -> None:
    assert trt_reason.startswith(("tensorrt is not installed", "no CUDA GPU"))
    with pytest.raises(FormatError, match="cannot build a TensorRT engine: " + trt_reason.split(":")[0]):
        T.build_engine(int4_export[0], tmp_path, S.TensorRTConfig())
    assert not (tmp_path / T.ENGINE_FILE).exists()


@pytest.mark.runtime
@pytest.mark.skipif(trt_reason is not None, reason=trt_reason or "")
def test_tensorrt_engine_builds_and_decodes(tmp_path: Path) -> None:
    """fp16 graph (TensorRT's int4 weight-only path wants fp16/bf16 activations); engine vs the torch model."""
    model = tiny_llama(VOCAB)
    records = quantize(model, 4, 128, True)
    Q.write_qdq_onnx(tmp_path / "onnx", model, records, fallback=None, dtype="float16")
    config = S.TensorRTConfig(sequence={"min": 1, "opt": 16, "max": 64}, past={"min": 0, "opt": 16, "max": 64}, workspace_mib=1024)
    facts = T.build_engine(tmp_path / "onnx", tmp_path / "engine", config)
    assert (tmp_path / "engine" / T.ENGINE_FILE).stat().st_size == facts["engine_bytes"] > 0
    assert facts["timing_cache"]["loaded"] is False and Path(facts["timing_cache"]["path"]).exists()
    runner = T.EngineRunner(tmp_path / "engine" / T.ENGINE_FILE)
    x = ids()
    batch, seq = x.shape
    feeds = {
        "input_ids": x,
        "attention_mask": torch.ones(batch, seq, dtype=torch.int64),
        "position_ids": torch.arange(seq).expand(batch, seq),
    }
    feeds |= {n: torch.zeros(batch, 2, 0, 32, dtype=torch.float16) for n in runner.inputs if n.startswith("past_")}
    out = runner(feeds)
    step = {
        "input_ids": out["logits"][:, -1:].argmax(-1).cpu(),
        "attention_mask": torch.ones(batch, seq + 1, dtype=torch.int64),
        "position_ids": torch.full((batch, 1), seq),
    }
    step |= {n: out[n.replace("past_key_values.", "present.")] for n in runner.inputs if n.startswith("past_")}
    decode = runner(step)
    with torch.no_grad():
        ref = model(torch.cat([x, step["input_ids"]], dim=1)).logits
    got = torch.cat([out["logits"], decode["logits"]], dim=1).float().cpu()
    parity = Q.logit_parity(ref, got)
    assert parity["kl_divergence"] <= 1e-4 and parity["top1_agreement"] >= 0.95, parity


@pytest.mark.runtime
def test_pipeline_tensorrt_export_checks_the_qdq_onnx_and_says_why_no_engine(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    from tests.helpers import recipe_text, run_cli, write_recipe

    gates = "  - metric: kl_divergence\n    artifact: trt\n    max: 10\n"
    text = recipe_text(tiny_model_dir, text_dir, bits=4, group_size=64, symmetric=False, gates=gates).replace(
        "exports: []\n", "exports:\n  - format: tensorrt\n    name: trt\n    dtype: float32\n    fallback: symmetric\n"
    )
    out = tmp_path / "out"
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", out, "-q"])
    entry = json.loads((out / "manifest.json").read_text())["exports"][0]
    report = json.loads((out / "report.json").read_text())
    assert entry["onnx"]["domains"] == [""] and entry["onnx_check"]["kl_divergence"] < 1e-6
    assert len(entry["onnx"]["fallbacks"]) == 14 and entry["onnx"]["conversion_cost"]["kl_divergence"] > 0
    reason = T.tensorrt_unavailable_reason()
    if reason is not None:  # no engine: said in the manifest and report.json, and a gate on it fails as unmeasured
        assert entry["engine"] == {"built": False, "skipped": reason} and report["exports"][0]["engine"]["skipped"] == reason
        assert report["exports"][0]["evaluated_as"] is None and "trt: TensorRT engine skipped" in result.output
        assert result.exit_code == 1 and report["gates"][0]["source"] == "missing", result.output
    else:
        assert result.exit_code == 0 and entry["engine"]["built"], result.output
