"""ONNX export for ONNX Runtime: MatMulNBits packing checked against ONNX Runtime's own kernel, the
builder run on tiny models (our GPTQ checkpoint handed over, or our records written into its
graph), the proof that the file holds the records, the verifier, and the KV-cache option."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from compress.errors import FormatError
from compress.export.onnx import builder as ob
from compress.export.onnx import matmulnbits as mnb
from compress.export.onnx import tables as tb
from compress.export.onnx.config import ONNXExportConfig
from compress.quantizers.core import QuantizedWeight
from compress.quantizers.rtn import rtn_quantize
from compress.schema.quantize import QuantScheme
from tests.helpers import recipe_text, run_cli, write_recipe

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install 'compress[onnx]')")
pytestmark = pytest.mark.runtime  # ONNX Runtime GenAI's builder and ONNX Runtime (the module needs them to be collected)


def record(out_f: int, in_f: int, bits: int, group: int | None, symmetric: bool, seed: int = 0) -> QuantizedWeight:
    weight = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed))
    return rtn_quantize(weight, QuantScheme(bits=bits, group_size=group, symmetric=symmetric))


def run_matmulnbits(x: np.ndarray, packed: dict[str, np.ndarray], n: int, k: int, bits: int, block: int) -> np.ndarray:
    """ONNX Runtime's own MatMulNBits kernel (accuracy level 0) on one node."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(packed["B"], "B"), numpy_helper.from_array(packed["scales"], "scales")]
    inputs = ["A", "B", "scales"]
    if "zero_points" in packed:
        inits.append(numpy_helper.from_array(packed["zero_points"], "zp"))
        inputs.append("zp")
    node = helper.make_node("MatMulNBits", inputs, ["Y"], domain="com.microsoft", K=k, N=n, bits=bits, block_size=block, accuracy_level=0)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [x.shape[0], n])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)], ir_version=10)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"A": x})[0]


@pytest.mark.parametrize(
    "bits,group,symmetric,in_f,block",
    [
        (4, 32, True, 96, 32),
        (4, 64, False, 96, 32),
        (4, 128, False, 576, 64),
        (4, None, False, 80, 16),
        (8, 32, True, 64, 32),
        (8, 64, False, 96, 32),
    ],
)
def test_records_pack_into_matmulnbits_that_onnx_runtime_computes_exactly(bits, group, symmetric, in_f, block) -> None:
    rec = record(40, in_f, bits, group, symmetric)
    blocks = mnb.record_blocks(rec, block)
    packed = mnb.pack(blocks, with_zero_points=not symmetric)
    back = mnb.unpack(packed["B"], packed["scales"], packed.get("zero_points"), 40, in_f, bits, block)
    assert mnb.differences(blocks, back) == []
    np.testing.assert_array_equal(back.dequantize(), rec.dequantize().numpy())
    x = np.random.default_rng(0).standard_normal((3, in_f)).astype(np.float32)
    y = run_matmulnbits(x, packed, 40, in_f, bits, block)
    np.testing.assert_allclose(y, x @ rec.dequantize().numpy().T, rtol=1e-5, atol=1e-4)


def test_blocks_that_cannot_hold_a_record_are_refused() -> None:
    rec = record(8, 96, 4, 48, True)
    assert mnb.common_block_size({"a": rec}) == 16
    with pytest.raises(FormatError, match="do not split into blocks of 32"):
        mnb.record_blocks(rec, 32)
    with pytest.raises(FormatError, match="no MatMulNBits block size"):
        mnb.common_block_size({"a": record(8, 40, 4, 40, True)})
    with pytest.raises(FormatError, match="4 or 8-bit codes"):
        mnb.record_blocks(record(8, 64, 3, 32, True), 32)
    assert mnb.common_block_size({"a": record(8, 576, 4, 128, True), "b": record(8, 1536, 4, 128, True)}) == 64


def test_builder_node_names_map_to_layers() -> None:
    assert ob.layer_names("/model/layers.3/attn/qkv_proj/MatMulNBits") == tuple(f"model.layers.3.self_attn.{p}_proj" for p in "qkv")
    assert ob.layer_names("/model/layers.0/mlp/down_proj/MatMul_Q4") == ("model.layers.0.mlp.down_proj",)
    assert ob.layer_names("/lm_head/MatMul_Q4") == ob.layer_names("/lm_head/MatMulNBits") == ("lm_head",)  # a quantized head
    assert ob.layer_names("/model/embed_tokens/Gather") is None
    with pytest.raises(FormatError, match="unknown projection"):
        ob.layer_names("/model/layers.0/attn/mystery_proj/MatMulNBits")


def test_onnx_export_configs() -> None:
    assert ONNXExportConfig().precision == "auto" and ONNXExportConfig().accuracy_level == 4
    with pytest.raises(ValueError, match="fp16 on cpu"):
        ONNXExportConfig(precision="fp16")
    with pytest.raises(ValueError, match="quantizer builder needs precision int4 or int8"):
        ONNXExportConfig(quantizer="builder", precision="fp32")
    with pytest.raises(ValueError, match="block_size applies to quantizer builder"):
        ONNXExportConfig(block_size=64)


def test_tokenizer_json_is_made_plain_byte_level(tmp_path: Path, tiny_model_dir: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    data = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    data["model"]["byte_fallback"] = True
    data["decoder"] = {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}, data["decoder"]]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    before = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert ob.normalize_tokenizer(tmp_path) == ["model.byte_fallback → false", "decoder Sequence → ByteLevel"]
    after = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = AutoTokenizer.from_pretrained(tiny_model_dir).decode(list(range(60)))
    assert before.encode(text).ids == after.encode(text).ids and after.decode(after.encode(text).ids) == before.decode(
        before.encode(text).ids
    )
    assert ob.normalize_tokenizer(tmp_path) == []


def test_smollms_digits_pre_tokenizer_is_rewritten_as_two_splits_with_the_same_tokens(tmp_path: Path) -> None:
    """SmolLM's Digits + ByteLevel pre-tokenizer (which onnxruntime-extensions applies in the wrong
    order) becomes a Split on digits and a Split on GPT-2's regex: the same ids in Hugging Face
    tokenizers on the 200 KB parity corpus and on non-ASCII numerals, for a vocabulary trained on that
    corpus (whitespace runs are tokens there); GPT-2's regex alone would differ."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from compress.export.parity import parity_corpus

    texts = [*parity_corpus(), "x  \u0663\u0664 and  \u00b2  \u00bd \u216b  \u3007 \uff15\uff16 end", "1  2\t\t3 a1b 22c     7"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=800, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    before = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert ob.normalize_tokenizer(tmp_path)[-1].startswith("pre_tokenizer Digits + ByteLevel(regex) → Split(digits)")
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    assert [p["type"] for p in data["pre_tokenizer"]["pretokenizers"]] == ["Split", "Split", "ByteLevel"]
    after = Tokenizer.from_str(json.dumps(data))
    assert [before.encode(t).ids for t in texts] == [after.encode(t).ids for t in texts]
    data["pre_tokenizer"]["pretokenizers"].pop(0)  # GPT-2's regex without the digits split: not the same function
    regex_only = Tokenizer.from_str(json.dumps(data))
    assert sum(before.encode(t).ids != regex_only.encode(t).ids for t in texts) > 10
    assert ob.normalize_tokenizer(tmp_path) == []


def test_genai_config_stops_at_the_sources_eos_and_end_of_turn(tmp_path: Path, text_dir: Path) -> None:
    """Gemma's EOS is <eos> but a chat turn ends at <end_of_turn>: both become stop ids of
    genai_config.json, and its BOS the source's; a config that has them is left as it is."""
    from tests.tiny import family_tokenizer

    hf = family_tokenizer("gemma", [p.read_text() for p in sorted(text_dir.glob("*.txt"))])
    (tmp_path / "genai_config.json").write_text(json.dumps({"model": {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}}))
    changed = ob.align_generation_ids(tmp_path, hf)
    assert changed == ["eos_token_id + 6 (the source's end of turn)", "bos_token_id 0 → 2"]
    model = json.loads((tmp_path / "genai_config.json").read_text())["model"]
    assert model["eos_token_id"] == [1, 6] and model["bos_token_id"] == 2 and model["pad_token_id"] == 0
    assert ob.align_generation_ids(tmp_path, hf) == []


def test_head_sizes_onnx_runtime_cannot_run_are_refused(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    result, out = run_export(tmp_path, tiny_model_dir, text_dir, "  - format: onnx\n")
    assert result.exit_code == 2 and "head size that is a multiple of 16" in result.output and not out.exists()


def run_export(
    tmp_path: Path,
    model_dir: Path,
    text_dir: Path,
    export: str,
    group: int | None = 32,
    symmetric: bool = False,
    gates: str = "",
    bits: int = 4,
):
    text = recipe_text(model_dir, text_dir, bits=bits, group_size=group, symmetric=symmetric, gates=gates)
    text = text.replace("exports: []\n", "exports:\n" + export)
    out = tmp_path / "out"
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", out, "-q"])
    return result, out


def entry_and_eval(out: Path) -> tuple[dict, dict]:
    manifest = json.loads((out / "manifest.json").read_text())
    report = json.loads((out / "report.json").read_text())
    return manifest["exports"][0], {e["artifact"]: e for e in report["evaluations"]}


def test_gptq_checkpoint_handed_to_the_builder_is_proven_exact_and_verified(tmp_path: Path, onnx_model_dir: Path, text_dir: Path) -> None:
    gates = "  - metric: kl_divergence\n    artifact: onnx\n    max: 0.01\n"  # measured: 0.00022
    result, out = run_export(tmp_path, onnx_model_dir, text_dir, "  - format: onnx\n", gates=gates)
    assert result.exit_code == 0, result.output
    entry, evals = entry_and_eval(out)
    # 14 decoder records and the head, rounded at export: int4's default layout is the builder's (head and embeddings quantized)
    assert entry["precision"] == "int4" and entry["quantizer"] == "records" and entry["records_exact"] == 15
    assert entry["weights_written_by"].startswith("onnxruntime-genai's builder, from our GPTQ checkpoint")
    assert entry["ops"]["com.microsoft.MatMulNBits"] == 11  # 2 layers × (fused qkv, o, gate, up, down) + the head
    assert entry["ops"]["com.microsoft.GatherBlockQuantized"] == 1  # the tied source's one table, read by both
    assert entry["tables"]["lm_head"]["record"] == "rounded to nearest at export"
    assert entry["tables"]["embeddings"]["record"].startswith("the output head's")
    details = evals["onnx"]["details"]
    assert evals["onnx"]["runtime"] == "onnxruntime" and details["level0_same_weights_kl"] < 1e-5
    assert details["same_weights_kl"] < 0.02 and details["tokenizer_parity_bytes"] >= 200_000 and details["sample"]["decode_tokens"] > 0
    assert details["tokenizer_special_ids"]["eos"] in details["generation_stop_ids"]
    report = json.loads((out / "report.json").read_text())
    assert report["gates"][0]["value"] == evals["onnx"]["metrics"]["kl_divergence"]
    # the artifact on disk holds the records: unpack it again from the file (the head's record made again from model/)
    graph = ob.load(out / "exports" / "onnx")
    records, tables = file_records(out)
    assert ob.compare_records(graph, records)["problems"] == [] and tb.compare_embeddings(graph, tables) == []
    # the one table both read: changing a code of the head changes the embeddings too, and the proof sees it
    head = next(n for n, names in ob.quantized_nodes(graph) if names == ("lm_head",))
    flip_first_code(graph, head.input[1])
    assert len(ob.compare_records(graph, records)["problems"]) == 1 and len(tb.compare_embeddings(graph, tables)) == 1


def planned_sizes(tmp_path: Path, model_dir: Path, text_dir: Path, exports: str) -> dict[str, int]:
    """`compress plan`'s size of each export of the run_export recipe with ``exports``."""
    text = recipe_text(model_dir, text_dir, bits=4, group_size=32, symmetric=False).replace("exports: []\n", "exports:\n" + exports)
    plan_file = tmp_path / "plan.json"
    result = run_cli(["plan", write_recipe(tmp_path, text), "--json", plan_file])
    assert result.exit_code == 0, result.output
    return {a["artifact"]: a["size_bytes"] for a in json.loads(plan_file.read_text())["artifacts"]}


def file_records(out: Path) -> tuple[dict, tb.Tables]:
    """The records an int4 ONNX export of ``out`` holds: the artifact's, and the head's, rounded again from model/."""
    from compress.artifact import load_artifact

    model, _, records = load_artifact(out)
    tables = tb.plan(model, records, (), 4, 32)
    return {**records, "lm_head": tables.head}, tables


def flip_first_code(graph, name: str) -> None:
    from onnx import numpy_helper

    tensor = next(t for t in graph.graph.initializer if t.name == name)
    data = numpy_helper.to_array(tensor).copy()
    data.flat[0] ^= 0x01  # one 4-bit code off by one
    tensor.CopyFrom(numpy_helper.from_array(data, tensor.name))


def test_partial_groups_are_written_into_the_builders_graph(tmp_path: Path, onnx_model_dir: Path, text_dir: Path) -> None:
    # hidden 96 with groups of 64: the builder cannot read the GPTQ checkpoint's partial last group
    result, out = run_export(tmp_path, onnx_model_dir, text_dir, "  - format: onnx\n    accuracy_level: 0\n", group=64)
    assert result.exit_code == 0, result.output
    entry, evals = entry_and_eval(out)
    assert "could not take our GPTQ checkpoint" in entry["gptq_handoff"] and entry["nodes_written"] == 11
    assert entry["builder_options"]["block_size"] == 32 and entry["records_exact"] == 15
    details = evals["onnx"]["details"]
    assert details["same_weights_kl"] == details["level0_same_weights_kl"] < 1e-5


def test_a_changed_code_in_the_file_is_caught(tmp_path: Path, onnx_model_dir: Path, text_dir: Path) -> None:
    result, out = run_export(tmp_path, onnx_model_dir, text_dir, "  - format: onnx\n    verify: false\n")
    assert result.exit_code == 0, result.output
    records, _ = file_records(out)
    graph = ob.load(out / "exports" / "onnx")
    node = next(n for n, names in ob.quantized_nodes(graph) if names)
    flip_first_code(graph, node.input[1])
    problems = ob.compare_records(graph, records)["problems"]
    assert len(problems) == 1 and "codes: 1 of" in problems[0]


def test_builder_quantizer_and_float_exports(tmp_path: Path, onnx_model_dir: Path, text_dir: Path) -> None:
    export = (
        "  - format: onnx\n    name: rtn\n    quantizer: builder\n    precision: int4\n    block_size: 32\n"
        "  - format: onnx\n    name: f32\n    precision: fp32\n"
    )
    result, out = run_export(tmp_path, onnx_model_dir, text_dir, export)
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    rtn, f32 = manifest["exports"]
    assert rtn["records_exact"] == 0 and "its own round-to-nearest" in rtn["weights_written_by"]
    assert f32["precision"] == "fp32" and "com.microsoft.MatMulNBits" not in f32["ops"]
    evals = {e["artifact"]: e for e in json.loads((out / "report.json").read_text())["evaluations"]}
    # the float export holds the dequantized records: it computes our compressed model
    assert evals["f32"]["details"]["same_weights_kl"] < 1e-5
    assert abs(evals["f32"]["metrics"]["kl_divergence"] - evals["compressed"]["metrics"]["kl_divergence"]) < 1e-3


def test_records_of_other_bits_are_refused_before_any_work(tmp_path: Path, onnx_model_dir: Path, text_dir: Path) -> None:
    result, out = run_export(tmp_path, onnx_model_dir, text_dir, "  - format: onnx\n", bits=3)
    assert result.exit_code == 2 and "MatMulNBits holds 4 or 8 bits" in result.output and not out.exists()


def test_kv_cache_static_scales_become_the_builders_per_channel_scale_file(tmp_path: Path) -> None:
    from compress.export.onnx.export import kv_cache_options
    from compress.quantizers.kv_cache import KVCacheScheme
    from compress.quantizers.kv_cache_config import KVCacheConfig
    from tests.tiny import tiny_config

    config = tiny_config(hidden=96, heads=4, kv_heads=2, layers=2)
    scales = {"k_scale": torch.tensor([[0.1, 0.2], [0.3, 0.4]]), "v_scale": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}
    static = KVCacheScheme(KVCacheConfig(bits=8, static_scales=True, symmetric=True), scales, 2)
    entry, options = kv_cache_options(static, config, tmp_path / "s.json")
    assert entry["carried"] and options["kv_cache_quant_scheme"] == "int8_per_channel"
    written = json.loads((tmp_path / "s.json").read_text())["scales"]
    assert len(written["k_scales"][1]) == 2 * 24 and written["k_scales"][1][:24] == pytest.approx([0.3] * 24)
    assert written["v_scales"][0][24:] == pytest.approx([2.0] * 24)
    dynamic = KVCacheScheme(KVCacheConfig(bits=4), None, 2)
    entry, options = kv_cache_options(dynamic, config, tmp_path / "d.json")
    assert not entry["carried"] and "static_scales: true" in entry["why"] and options == {}


@pytest.mark.parametrize("fmt,bits,scheme", [("int", 8, "int8_per_channel"), ("fp8", 8, None)])  # static scales: 8 bits only
def test_kv_cache_stage_with_static_scales_is_carried_into_onnx(
    tmp_path: Path, onnx_model_dir: Path, text_dir: Path, fmt: str, bits: int, scheme: str | None
) -> None:
    stage = (
        f"  - kv_cache:\n      bits: {bits}\n      format: {fmt}\n      key_axis: token\n      residual: 0\n      static_scales: true\n"
        "      evaluate: {context: 64, samples: 1, step: 8}\n"
    )
    text = recipe_text(onnx_model_dir, text_dir, bits=4, group_size=32, symmetric=True, extra_stage=stage)
    text = text.replace("exports: []\n", "exports:\n  - format: onnx\n")
    out = tmp_path / "out"
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", out, "-q"])
    assert result.exit_code == 0, result.output
    entry, evals = entry_and_eval(out)
    if scheme is None:  # fp8: ONNX Runtime's CPU attention has no fp8 cache; said, not silently dropped
        assert not entry["kv_cache"]["carried"] and "CUDA only" in entry["kv_cache"]["why"]
    else:
        assert entry["kv_cache"]["carried"] and entry["kv_cache"]["kv_cache_quant_scheme"] == scheme
        assert (out / "exports" / "onnx" / "kv_cache_scales.json").is_file()
    details = evals["onnx"]["details"]
    assert details["sample"]["decode_tokens"] > 0 and details["level0_same_weights_kl"] < 0.05, details


@pytest.mark.real_model
@pytest.mark.minutes(5.4)
def test_smollm2_recipe_exports_a_verified_int4_onnx_and_a_checked_tensorrt_graph(tmp_path: Path) -> None:
    """recipes/onnx.yaml on reduced data (16 x 256 calibration, 4 x 512 evaluation tokens): GPTQ W4 g128 sym
    -> int4 ONNX whose MatMulNBits hold exactly the records (SmolLM2's partial last groups: written by us
    into the builder's graph), verified and gated in ONNX Runtime; and the TensorRT Q/DQ graph checked on
    ONNX Runtime CPU against the in-memory model."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "out"
    result = run_cli(
        [
            "run",
            root / "recipes" / "onnx.yaml",
            "-o",
            out,
            "-q",
            "--set",
            "data.evaluation.samples=4",
            "--set",
            "data.calibration.samples=16",
            "--set",
            "data.calibration.seq_len=256",
        ]
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    evals = {e["artifact"]: e for e in report["evaluations"]}
    onnx_eval, torch_kl = evals["int4"], evals["compressed"]["metrics"]["kl_divergence"]
    assert onnx_eval["runtime"] == "onnxruntime" and onnx_eval["details"]["level0_same_weights_kl"] < 1e-5
    assert abs(onnx_eval["metrics"]["kl_divergence"] - torch_kl) < 0.1 * torch_kl  # ONNX Runtime runs the same weights
    assert all(g["passed"] for g in report["gates"]) and {g["artifact"] for g in report["gates"]} == {"int4"}
    onnx_entry, trt = json.loads((out / "manifest.json").read_text())["exports"]
    assert onnx_entry["records_exact"] == 210 and onnx_entry["builder_options"]["block_size"] == 64
    assert onnx_entry["tables"] == {"lm_head": {"type": "float"}, "embeddings": {"type": "float"}}  # the recipe's keep_float
    assert trt["onnx"]["layers_by_precision"]["int4 block 128"] == 210 and trt["onnx"]["fallbacks"] == []
    assert trt["onnx"]["domains"] == [""] and trt["onnx_check"]["kl_divergence"] < 1e-3 and trt["onnx_check"]["top1_agreement"] > 0.95


def test_symmetric_records_ship_without_zero_points(tmp_path: Path, onnx_model_dir: Path, text_dir: Path) -> None:
    # GPTQ checkpoints always store zero points; for symmetric records they are all 8 and are dropped (same weights)
    result, out = run_export(tmp_path, onnx_model_dir, text_dir, "  - format: onnx\n    verify: false\n", symmetric=True)
    assert result.exit_code == 0, result.output
    entry = json.loads((out / "manifest.json").read_text())["exports"][0]
    assert entry["weights_written_by"].startswith("onnxruntime-genai's builder") and entry["records_exact"] == 15
    graph = ob.load(out / "exports" / "onnx")
    assert all(len(node.input) == 3 for node, names in ob.quantized_nodes(graph) if names)


def test_llm_int8_records_become_an_exact_int8_onnx(tmp_path: Path, onnx_model_dir: Path, text_dir: Path) -> None:
    text = recipe_text(onnx_model_dir, text_dir, bits=8, group_size=None)
    text = text.replace(
        "      method: rtn\n      bits: 8\n      group_size: null\n      symmetric: true\n",
        "      method: llm_int8\n      threshold: 6.0\n",
    )
    exports = "  - format: onnx\n    accuracy_level: 0\n  - format: onnx\n    name: all8\n    accuracy_level: 0\n    keep_float: []\n"
    text = text.replace("exports: []\n", "exports:\n" + exports)
    out = tmp_path / "out"
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", out, "-q"])
    assert result.exit_code == 0, result.output
    entry, evals = entry_and_eval(out)
    assert entry["precision"] == "int8" and entry["records_exact"] == 15 and entry["not_carried"]  # the decomposition is not
    assert evals["onnx"]["details"]["level0_same_weights_kl"] < 1e-5  # the plain int8 weights, exactly
    # int8's default is the builder's (head quantized, embeddings float); keep_float: [] puts them in an 8-bit gather
    assert entry["tables"]["embeddings"] == {"type": "float"} and "com.microsoft.GatherBlockQuantized" not in entry["ops"]
    all8 = json.loads((out / "manifest.json").read_text())["exports"][1]
    assert all8["ops"]["com.microsoft.GatherBlockQuantized"] == 1 and all8["tables"]["embeddings"]["type"].startswith("int8")
    assert evals["all8"]["details"]["level0_same_weights_kl"] < 1e-5


def test_bench_onnx_scores_ours_and_the_builders(tmp_path: Path, onnx_model_dir: Path, text_dir: Path) -> None:
    out = tmp_path / "bench"
    result = run_cli(
        [
            "bench",
            "onnx",
            "-o",
            out,
            "--model",
            str(onnx_model_dir),
            "--calibration",
            str(text_dir),
            "--evaluation",
            str(text_dir),
            "--cal-samples",
            "4",
            "--cal-seq-len",
            "64",
            "--eval-samples",
            "2",
            "--eval-seq-len",
            "64",
            "--candidates",
            "rtn:W4g32s+head,builder:W4g32s,rtn:W4g32a,builder:W4g32a",
            "--decode-tokens",
            "4",
            "--repeats",
            "1",
            "--threads",
            "1",
        ]
    )
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "results.json").read_text())
    ours, theirs, ours_asym, theirs_asym = saved["rows"]
    # the builder's int4 layout in both: 14 decoder records + the head (through the method with +head, else rounded at
    # export), its blocks the embedding table too
    assert ours["records_exact"] == 15 and theirs["records_exact"] == 0 and ours["name"] == "rtn W4 g32 sym, head too"
    assert ours["tables"]["lm_head"]["record"] == "the quantize stage's" and ours["tables"]["embeddings"]["record"].startswith(
        "the output head's"
    )
    assert ours_asym["tables"]["lm_head"]["record"] == "rounded to nearest at export"
    assert theirs["tables"] == {
        "lm_head": {"type": "int4 (the builder's own quantizer)"},
        "embeddings": {"type": "int4 (the builder's own quantizer)"},
    }
    assert 0 < ours["metrics"]["kl_divergence"] and ours["decode_tokens_per_s"] > 0 and theirs["decode_tokens_per_s"] > 0
    # symmetric: one shared table in both files, equal bytes; asymmetric: the builder's shared table is broken in
    # onnxruntime-genai 0.18, so it keeps the embedding table float, and the pair is flagged
    sym, asym = saved["pairs"]
    assert sym["equal_bytes"] and sym["size_ratio"] == pytest.approx(1, abs=0.02) and theirs["size_bytes"] > 0
    assert theirs_asym["builder_options"]["shared_embeddings"] is False and not asym["equal_bytes"] and asym["size_ratio"] < 0.98
    assert theirs_asym["tables"]["embeddings"] == {"type": "float"}
    assert ours_asym["size_bytes"] > ours["size_bytes"]  # the zero points
    text = (out / "results.md").read_text()
    assert "| rtn W4 g32 asym |" in text and "sizes differ by more than 2%" in text and not (out / "files" / "fp32").exists()
    assert (out / "kl-vs-size.png").stat().st_size > 0
    bad = run_cli(["bench", "onnx", "-o", out, "--candidates", "builder:W3g32a"])
    assert bad.exit_code == 2 and "int4 with a MatMulNBits block size" in bad.output
    bad = run_cli(["bench", "onnx", "-o", out, "--candidates", "builder:W4g32s+head"])
    assert bad.exit_code == 2 and "+head follows one of our methods" in bad.output
    bad = run_cli(["bench", "onnx", "-o", out, "--keep-float", "head"])
    assert bad.exit_code == 2 and "expected lm_head or embeddings" in bad.output


def test_an_untied_sources_embeddings_get_a_table_of_their_own_and_keep_float_keeps_both(
    tmp_path: Path, text_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from compress.artifact import load_artifact
    from tests.conftest import texts_of
    from tests.tiny import tiny_llama_dir

    model_dir = tiny_llama_dir(tmp_path_factory.mktemp("untied") / "m", texts_of(text_dir), tie=False, heads=6, head_dim=16)
    exports = "  - format: onnx\n    name: q\n  - format: onnx\n    name: f\n    keep_float: [lm_head, embeddings]\n    verify: false\n"
    result, out = run_export(tmp_path, model_dir, text_dir, exports)
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    q, f = manifest["exports"]
    assert q["records_exact"] == 15 and q["ops"]["com.microsoft.GatherBlockQuantized"] == 1 and q["ops"]["com.microsoft.MatMulNBits"] == 11
    assert q["tables"]["embeddings"]["record"] == "rounded to nearest at export" and q["tables"]["embeddings"]["bits_per_weight"] > 4
    evals = {e["artifact"]: e for e in json.loads((out / "report.json").read_text())["evaluations"]}
    assert evals["q"]["details"]["level0_same_weights_kl"] < 1e-5  # ONNX Runtime gathers the rows our record holds
    model, _, records = load_artifact(out)
    tables = tb.plan(model, records, (), 4, 32)
    assert not tables.shared and tables.embedding is not tables.head
    graph = ob.load(out / "exports" / "q")
    assert tb.compare_embeddings(graph, tables) == [] and ob.compare_records(graph, {**records, "lm_head": tables.head})["problems"] == []
    gather = next(n for n in graph.graph.node if n.op_type == "GatherBlockQuantized")
    flip_first_code(graph, gather.input[0])  # a table of its own: an initializer [vocab, blocks · blob], no Reshape
    assert len(tb.compare_embeddings(graph, tables)) == 1
    from compress.export.onnx.latency import onnx_bytes, parameter_count

    # the same parameters stored two ways; a decode step reads the quantized head, never the lookup table
    assert parameter_count(out / "exports" / "q") == parameter_count(out / "exports" / "f")
    assert onnx_bytes(out / "exports" / "q")[0] < q["size_bytes"] - tables.embedding.codes.numel() // 2
    # compress plan knows the layout: what quantizing the tables saves, within 3% (the graph's own bytes, rotary caches
    # and names, which the plan leaves out, are most of a tiny model's file and the same in both)
    planned = planned_sizes(tmp_path, model_dir, text_dir, exports)
    assert planned["f"] - planned["q"] == pytest.approx(f["size_bytes"] - q["size_bytes"], rel=0.03)
    # keep_float: the decoder's records only, a float head and a float Gather
    assert f["records_exact"] == 14 and "com.microsoft.GatherBlockQuantized" not in f["ops"] and f["ops"]["com.microsoft.MatMulNBits"] == 10
    assert f["tables"] == {"lm_head": {"type": "float"}, "embeddings": {"type": "float"}} and f["size_bytes"] > 2 * q["size_bytes"] / 3


def test_keep_float_is_checked(tmp_path: Path, onnx_model_dir: Path, text_dir: Path) -> None:
    with pytest.raises(ValueError, match="names a table twice"):
        ONNXExportConfig(name="x", keep_float=["lm_head", "lm_head"])
    with pytest.raises(ValueError, match="keep_float"):
        ONNXExportConfig(name="x", keep_float=["head"])
    assert ONNXExportConfig(name="x").float_tables("int4") == () and ONNXExportConfig(name="x").float_tables("int8") == ("embeddings",)
    assert ONNXExportConfig(name="x", keep_float=[]).float_tables("int8") == () and ONNXExportConfig(name="x").float_tables("fp32")
    # the quantize stage quantized the head and the export is asked to keep it float: refused before any work
    text = recipe_text(onnx_model_dir, text_dir, group_size=32).replace("method: rtn", "method: rtn\n      ignore: []")
    text = text.replace("exports: []\n", "exports:\n  - format: onnx\n    keep_float: [lm_head]\n")
    out = tmp_path / "out"
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", out, "-q"])
    assert result.exit_code == 2 and "keep_float lists lm_head and the quantize stage quantized it" in result.output
    assert "Traceback" not in result.output
