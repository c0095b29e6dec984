"""FP4 (NVFP4, MXFP4) weights: the E2M1 rounding with its ties and saturation, each format's scales
against compressed-tensors' own observers, the packing against its packer, the record's round trip, the
Linear, the recipe end to end with its compressed-tensors export read back bit for bit, the refusals at
validation and the plan's sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from compress.context import RunContext
from compress.progress import Reporter
from compress.quantizers.fp4 import (
    E2M1_VALUES,
    E4M3,
    RECORDS_FILE,
    FP4Linear,
    FP4Stage,
    FP4Weight,
    e2m1_codes,
    e2m1_values,
    e8m0_to_float,
    fp4_records,
    mxfp4_exponents,
    pack,
    quantize_weight_fp4,
    unpack,
)
from compress.quantizers.fp4_config import FP4Config
from compress.recipe import stage_model
from tests.helpers import recipe_text, run_cli, write_recipe

QUIET = Reporter(quiet=True)
RTN = "      method: rtn\n      bits: 4\n      group_size: 64\n"


# --------------------------------------------------------------------------- the math


def test_e2m1_rounding_ties_to_even_and_saturates() -> None:
    values = torch.tensor(E2M1_VALUES)
    assert torch.equal(e2m1_values(e2m1_codes(values)), values)  # every value is kept
    assert torch.equal(e2m1_values(e2m1_codes(-values[1:])), -values[1:])
    # a midpoint goes to the neighbour with the even mantissa (0, 1, 2, 4: mantissa bit 0)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert torch.equal(e2m1_values(e2m1_codes(mids)), torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]))
    assert torch.equal(e2m1_values(e2m1_codes(-mids)), -torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]))
    # just off a midpoint: the nearer neighbour
    eps = 1e-3
    assert torch.equal(e2m1_values(e2m1_codes(mids + eps)), torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]))
    assert torch.equal(e2m1_values(e2m1_codes(mids - eps)), torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]))
    # beyond 6 saturates; the sign bit is the input's own (-0.0 and a small negative give code 8, -0)
    assert torch.equal(e2m1_values(e2m1_codes(torch.tensor([6.5, 100.0, -7.0, 1e30]))), torch.tensor([6.0, 6.0, -6.0, 6.0]))
    assert e2m1_codes(torch.tensor([-0.1, -0.0, 0.0])).tolist() == [8, 8, 0]
    # compressed-tensors' own rounding and packing agree everywhere
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 4
    codes = e2m1_codes(x)
    assert torch.equal(e2m1_values(codes), cast_to_fp4(x.clone()))
    assert torch.equal(pack(codes), pack_fp4_to_uint8(cast_to_fp4(x.clone())))
    assert torch.equal(unpack(pack(codes)), codes)
    assert torch.equal(unpack_fp4_from_uint8(pack(codes), 64, 96, dtype=torch.float32), e2m1_values(codes))


def _weight() -> torch.Tensor:
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    w[3] = 0  # an all-zero row: its groups get the smallest scale and zero values
    w[5, :16] *= 40  # an outlier group
    return w


def test_nvfp4_scales_are_llm_compressors() -> None:
    """The global and group scales compressed-tensors' observer path computes (generate_gparam, calculate_qparams)."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    w = _weight()
    record = quantize_weight_fp4(w, "nvfp4")
    args = PRESET_SCHEMES["NVFP4A16"]["weights"]
    g = generate_gparam(w.min(), w.max())
    groups = w.reshape(48, 8, 16)
    scale, _ = calculate_qparams(groups.amin(dim=2), groups.amax(dim=2), args, global_scale=g)
    assert torch.equal(record.global_scale, g) and float(g) == pytest.approx(448 * 6 / float(w.abs().max()))
    assert record.scale.dtype == E4M3 and torch.equal(record.scale.to(torch.float32), scale.to(torch.float32))
    assert float(record.scale[3, 0].to(torch.float32)) == 0.125 and not bool(record.codes()[3].bool().any())
    # the largest group's scale is 448: the tensor's largest value is ±6 x its scale
    assert float(record.scale.to(torch.float32).max()) == 448.0
    assert float(record.dequantize().abs().max()) == pytest.approx(float(w.abs().max()), rel=1e-6)
    assert record.bits_per_weight == 4.5 + 32 / (48 * 128)


def test_mxfp4_scales_are_compressed_tensors() -> None:
    """E8M0 exponents as compressed-tensors' generate_mx_scales makes them, and decoded exactly."""
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    w = _weight()
    w[7, :32] = torch.tensor([1.75 * 2**-3, 1.74 * 2**-3] + [0.0] * 30)  # a mantissa of 1.75 rounds up to the next power
    record = quantize_weight_fp4(w, "mxfp4")
    groups = w.reshape(48, 4, 32)
    args = PRESET_SCHEMES["MXFP4A16"]["weights"]
    scale, _ = calculate_qparams(groups.amin(dim=2), groups.amax(dim=2), args)  # float powers of two
    assert record.scale.dtype == torch.uint8 and torch.equal(e8m0_to_float(record.scale), scale.to(torch.float32))
    assert int(record.scale[7, 0]) == 127 - 2 - 2  # 1.75 * 2**-3 -> 2**-2 -> E = 127 - 2 - 2
    assert int(mxfp4_exponents(torch.tensor([1.74 * 2**-3]))) == 127 - 3 - 2
    assert int(record.scale[3, 0]) == 0 and float(e8m0_to_float(record.scale[3:4, :1])) == 2.0**-127
    assert torch.equal(
        e8m0_to_float(torch.arange(0, 255, dtype=torch.uint8)), decompress_mx_scale(torch.arange(0, 255, dtype=torch.uint8)).float()
    )
    assert record.bits_per_weight == 4.25


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_record_round_trip_and_error(fmt: str) -> None:
    w = _weight()
    record = quantize_weight_fp4(w, fmt)
    deq = record.dequantize()
    # each weight is its group's nearest E2M1 value: the error is at most half the widest step (2 x scale) of its group
    scales = record.group_scales().repeat_interleave(record.group, dim=1)
    assert bool(((deq - w).abs() <= scales + 1e-12).all())
    # a dequantized weight quantizes to itself (same codes, scales, values)
    again = quantize_weight_fp4(deq, fmt)
    assert torch.equal(again.packed, record.packed) and torch.equal(again.scale.view(torch.uint8), record.scale.view(torch.uint8))
    assert torch.equal(again.dequantize(), deq)
    # named tensors back to the same record
    back = FP4Weight.from_tensors(record.tensors("x"), "x", fmt)
    assert torch.equal(back.dequantize(), deq)
    with pytest.raises(ValueError, match="scales are"):
        FP4Weight(fmt, record.packed, record.scale[:, :1], record.global_scale)


def test_linear_equals_a_hand_computation() -> None:
    torch.manual_seed(2)
    linear = torch.nn.Linear(64, 24)
    x = torch.randn(2, 5, 64)
    for fmt in ("nvfp4", "mxfp4"):
        record = quantize_weight_fp4(linear.weight.detach(), fmt)
        w = torch.empty(24, 64)
        codes = record.codes()
        for r in range(24):  # each code's value times its group's scale, one at a time
            for c in range(64):
                v = E2M1_VALUES[int(codes[r, c]) & 7] * (-1 if int(codes[r, c]) & 8 else 1)
                g = c // record.group
                s = 2.0 ** (int(record.scale[r, g]) - 127) if fmt == "mxfp4" else record.scale[r, g].to(torch.float32) / record.global_scale
                w[r, c] = torch.tensor(v, dtype=torch.float32) * s
        assert torch.equal(record.dequantize(), w)
        layer = FP4Linear(linear, record)
        with torch.no_grad():
            assert torch.equal(layer(x), (x.reshape(-1, 64) @ w.t() + linear.bias).reshape(2, 5, 24))
            half = FP4Linear(linear.to(torch.bfloat16), record)  # a bfloat16 model's layer dequantizes its record
            assert torch.equal(half(x.reshape(-1, 64)), x.reshape(-1, 64) @ w.t() + half.bias.to(torch.float32))
            linear = linear.to(torch.float32)


def test_config_fixes_the_scheme() -> None:
    cfg = FP4Config()
    assert (cfg.format, cfg.bits, cfg.group_size, cfg.symmetric) == ("nvfp4", 4, 16, True)
    assert FP4Config(format="mxfp4").group_size == 32 and FP4Config(format="mxfp4", group_size=32).group_size == 32
    assert FP4Config().scheme().model_dump() == {
        "bits": 4,
        "group_size": 16,
        "symmetric": True,
        "scale_dtype": "float8_e4m3fn",
        "gguf_type": None,
    }
    stage = stage_model().model_validate({"quantize": {"method": "fp4", "format": "mxfp4"}})
    assert isinstance(stage.config, FP4Config)
    for bad, message in [
        ({"group_size": 32}, "format nvfp4 scales each 16 weights .got 32.; leave group_size out or use format mxfp4"),
        ({"format": "mxfp4", "group_size": 128}, "format mxfp4 scales each 32 weights"),
        ({"bits": 8}, "bits is 4"),
        ({"format": "fp4"}, "'nvfp4' or 'mxfp4'"),
        ({"gguf_type": "q4_0"}, "fp4 has its own E2M1 grid"),
        ({"symmetric": False}, "symmetric must be true"),
        ({"scale_dtype": "float32"}, "'float16'"),
    ]:
        with pytest.raises(ValidationError, match=message):
            stage_model().model_validate({"quantize": {"method": "fp4", **bad}})


# --------------------------------------------------------------------------- the stage and the pipeline


def test_stage_swaps_layers_and_keeps_records() -> None:
    from tests.tiny import tiny_model

    model = tiny_model(vocab=300, hidden=64, intermediate=128)
    ctx = RunContext(seed=0, device=torch.device("cpu"), tokenizer=None, reporter=QUIET, calibration=lambda: None)
    weights = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    record = FP4Stage(FP4Config(format="mxfp4"), "stages[0]").apply(model, ctx)
    assert not ctx.quantized and set(ctx.quantized_by) == set(record.layers) == set(weights)
    records = fp4_records(model)
    for name, w in weights.items():
        assert isinstance(model.get_submodule(name), FP4Linear)
        assert torch.equal(records[name].dequantize(), quantize_weight_fp4(w, "mxfp4").dequantize())
        assert record.layers[name]["bits_per_weight"] == 4.25
    assert ctx.files[RECORDS_FILE]["model.layers.0.mlp.down_proj.weight_scale"].dtype == torch.uint8
    with pytest.raises(Exception, match="already quantized"):
        FP4Stage(FP4Config(format="mxfp4"), "stages[1]").apply(model, ctx)


@pytest.mark.parametrize(("fmt", "preset"), [("nvfp4", "NVFP4A16"), ("mxfp4", "MXFP4A16")])
def test_recipe_runs_end_to_end_and_exports_pack_quantized_exactly(
    tmp_path: Path, tiny_model_dir: Path, text_dir: Path, fmt: str, preset: str
) -> None:
    """recipe -> fp4 stage -> artifact -> compressed-tensors {fmt}-pack-quantized, read back bit for bit by
    compressed-tensors' own decompressor; gates on the export are evaluated; `compress gate` rebuilds the layers."""
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from safetensors.torch import load_file

    gates = "  - {metric: kl_divergence, artifact: compressed-tensors, max: 0.5}\n  - {metric: top1_agreement, artifact: compressed-tensors, min: 0.5}\n"
    text = recipe_text(tiny_model_dir, text_dir, gates=gates).replace(RTN, f"      method: fp4\n      format: {fmt}\n")
    text = text.replace("exports: []\n", "exports:\n  - format: compressed-tensors\n")
    out = tmp_path / "out"
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", out])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    report = json.loads((out / "report.json").read_text())
    assert all(g["passed"] for g in report["gates"]), report["gates"]
    entry = manifest["exports"][0]
    assert entry["verified"] and entry["layers"] == 14
    qcfg = json.loads((out / "exports/compressed-tensors/config.json").read_text())["quantization_config"]
    assert qcfg["format"] == f"{fmt}-pack-quantized" and qcfg["ignore"] == ["lm_head"]
    parsed = QuantizationConfig.model_validate(qcfg).config_groups["group_0"]
    want = PRESET_SCHEMES[preset]["weights"]
    for key in ("num_bits", "type", "strategy", "dynamic", "symmetric", "group_size", "scale_dtype"):
        assert getattr(parsed.weights, key) == getattr(want, key), key
    assert parsed.input_activations is None
    assert infer_module_format(torch.nn.Linear, parsed).value == qcfg["format"]  # what compressed-tensors infers for the scheme
    tensors = load_file(str(out / "exports/compressed-tensors/model.safetensors"))
    records = load_file(str(out / RECORDS_FILE))
    compressor = NVFP4PackedCompressor if fmt == "nvfp4" else MXFP4PackedCompressor
    for name in manifest["stages"][0]["layers"]:
        keys = [k for k in records if k.startswith(f"{name}.")]
        assert sorted(keys) == sorted(k for k in tensors if k.startswith(f"{name}.")) and len(keys) == (3 if fmt == "nvfp4" else 2)
        for k in keys:
            assert tensors[k].dtype == records[k].dtype and torch.equal(tensors[k].view(torch.uint8), records[k].view(torch.uint8))
        record = FP4Weight.from_tensors(tensors, name, fmt)
        state = {k.removeprefix(f"{name}."): tensors[k] for k in keys}
        theirs = compressor.decompress(state, parsed)["weight"]
        assert theirs.dtype == torch.bfloat16 and torch.equal(theirs, record.dequantize().to(torch.bfloat16))
        if fmt == "mxfp4":  # power-of-two scales: bfloat16 holds the record's values exactly
            assert torch.equal(theirs.to(torch.float32), record.dequantize())
    # `compress gate` on the artifact rebuilds the FP4 layers from fp4/records.safetensors: the run's numbers again
    kl, run_kl = _gate_again(tmp_path, out, gates)
    assert kl["compressed-tensors"] == kl["compressed"] == pytest.approx(run_kl["compressed"], rel=1e-4, abs=1e-7)
    assert kl["compressed"] > 1e-5  # the FP4 model, not the float source


def _gate_again(tmp_path: Path, out: Path, gates: str) -> tuple[dict[str, float], dict[str, float]]:
    """`compress gate` on the artifact ``out`` with ``gates``: the KL by artifact it measures, and the run's."""
    gates_file = tmp_path / "gates.yaml"
    gates_file.write_text("gates:\n" + gates)
    result = run_cli(["gate", out, "--gates", gates_file, "-o", tmp_path / "gate", "-q"])
    assert result.exit_code == 0, result.output
    kls = []
    for report in (tmp_path / "gate" / "report.json", out / "report.json"):
        evaluations = json.loads(report.read_text())["evaluations"]
        kls.append({e["artifact"]: e["metrics"]["kl_divergence"] for e in evaluations if e["kind"] == "accuracy"})
    return kls[0], kls[1]


@pytest.mark.parametrize(
    ("export", "message"),
    [
        ("  - format: onnx\n", "format onnx cannot hold the fp4 .nvfp4. stage stages.0.: it holds integer weight codes only"),
        ("  - format: gptq\n", "format gptq cannot hold the fp4 .nvfp4. stage"),
        ("  - format: tensorrt\n", "format tensorrt cannot hold the fp4 .nvfp4. stage"),
    ],
)
def test_exports_that_cannot_hold_fp4_are_refused(tmp_path: Path, tiny_model_dir: Path, text_dir: Path, export: str, message: str) -> None:
    text = recipe_text(tiny_model_dir, text_dir).replace(RTN, "      method: fp4\n").replace("exports: []\n", "exports:\n" + export)
    result = run_cli(["validate", write_recipe(tmp_path, text)])
    assert result.exit_code == 2 and "exports[0]" in result.output and "Traceback" not in result.output, result.output
    assert __import__("re").search(message, " ".join(result.output.split())), result.output


def test_bad_keys_exit_2_naming_the_key(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    base = recipe_text(tiny_model_dir, text_dir).replace(RTN, "      method: fp4\n")
    for extra, key in [("      group_size: 64\n", "group_size"), ("      format: nvfp8\n", "format"), ("      bits: 8\n", "bits")]:
        result = run_cli(["validate", write_recipe(tmp_path, base.replace("      method: fp4\n", "      method: fp4\n" + extra))])
        assert result.exit_code == 2 and key in result.output and "Traceback" not in result.output, result.output
    two = base.replace("stages:\n", "stages:\n  - quantize: {method: rtn, bits: 8, targets: [lm_head], ignore: []}\n")
    result = run_cli(["validate", write_recipe(tmp_path, two)])
    assert result.exit_code == 2 and "quantizes weights too" in result.output, result.output


def _quantized_weights(tiny_model_dir: Path) -> tuple[int, int]:
    """(weights, matrices) of the tiny model's Linear layers inside its decoder blocks (what fp4 quantizes by default)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]
    return layers * sum(o * n for o, n in shapes), layers * len(shapes)


@pytest.mark.parametrize(("fmt", "bits"), [("nvfp4", 4.5), ("mxfp4", 4.25)])
def test_plan_sizes_fp4(tmp_path: Path, tiny_model_dir: Path, text_dir: Path, fmt: str, bits: float) -> None:
    """compress plan: 4 bits a weight + an 8-bit scale a group (+ nvfp4's float32 a tensor), the rest at the model dtype."""
    text = recipe_text(tiny_model_dir, text_dir).replace(RTN, f"      method: fp4\n      format: {fmt}\n")
    text = text.replace("exports: []\n", "exports:\n  - format: compressed-tensors\n")
    result = run_cli(["plan", write_recipe(tmp_path, text), "--json", tmp_path / "plan.json"])
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "plan.json").read_text())
    ct = next(a for a in plan["artifacts"] if a["artifact"] == "compressed-tensors")
    quantized, matrices = _quantized_weights(tiny_model_dir)
    global_bits = 32 * matrices if fmt == "nvfp4" else 0
    assert ct["size_bytes"] == int((quantized * bits + global_bits + (plan["model"]["parameters"] - quantized) * 32) / 8)


# --------------------------------------------------------------------------- GGUF (MXFP4 blocks; NVFP4 refused)


def test_mxfp4_blocks_read_back_exactly_with_gguf_py() -> None:
    """pack_mxfp4's bytes, decoded by gguf-py's own MXFP4 dequantizer, are the record's values bit for bit
    (zero groups, E = 0's subnormal scale and saturated values included)."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from compress.export.gguf.blocks import pack_mxfp4, record_problem

    w = _weight()
    w[9] = 1e-39  # a subnormal group: E = 0
    record = quantize_weight_fp4(w, "mxfp4")
    assert int(record.scale[9, 0]) == 0
    data = pack_mxfp4(record)
    assert data.shape == (48, 4 * 17) and data.dtype == np.uint8
    got = quants.dequantize(data, GGMLQuantizationType.MXFP4).reshape(48, 128)
    assert np.array_equal(got, record.dequantize().numpy())
    assert record_problem(record, "mxfp4") is None
    assert "not Q4_0 blocks" in record_problem(record, "q4_0")
    assert "not MXFP4 blocks" in record_problem(quantize_weight_fp4(w, "nvfp4"), "mxfp4")


def test_mxfp4_recipe_exports_gguf_exactly_and_runs_in_llama_cpp(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    """fp4 mxfp4 -> GGUF (type auto: MXFP4 blocks), read back bit for bit with gguf-py, run in llama.cpp: the
    same-weights KL against the in-memory FP4 model passes."""
    pytest.importorskip("llama_cpp")
    text = recipe_text(tiny_model_dir, text_dir).replace(RTN, "      method: fp4\n      format: mxfp4\n")
    text = text.replace("exports: []\n", "exports:\n  - format: gguf\n")
    out = tmp_path / "out"
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", out])
    assert result.exit_code == 0, result.output
    entry = json.loads((out / "manifest.json").read_text())["exports"][0]
    assert entry["type"] == "mxfp4" and entry["records_exact"] == 14 and entry["verified"], entry
    assert entry["tensor_types"]["mxfp4 (record)"] == 14  # the plan, and the file as gguf-py reads it:
    assert sum(t == "mxfp4" for t in entry["tensor_type_of"].values()) == 14 and entry["tensor_type_of"]["blk.0.attn_q.weight"] == "mxfp4"
    assert "bit-exact" in entry["check"] and "same-weights KL" in entry["check"]


def test_nvfp4_gguf_is_refused_naming_the_export(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    text = (
        recipe_text(tiny_model_dir, text_dir).replace(RTN, "      method: fp4\n").replace("exports: []\n", "exports:\n  - format: gguf\n")
    )
    result = run_cli(["validate", write_recipe(tmp_path, text)])
    assert result.exit_code == 2 and "exports[0]" in result.output and "Traceback" not in result.output, result.output
    assert "NVFP4 block" in result.output and "global scale" in " ".join(result.output.split()), result.output


# --------------------------------------------------------------------------- GPTQ on the FP4 grid


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gptq_on_the_fp4_grid(fmt: str) -> None:
    """GPTQ with FP4Grid: scales fixed from the original weight (RTN's); an identity Hessian gives RTN's values;
    a real one lowers the output error below RTN's; the NumPy and torch column loops agree bit for bit."""
    from compress.quantizers.fp4 import FP4Grid
    from compress.quantizers.gptq import gptq_quantize

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 128, generator=gen) * 0.05
    x = torch.randn(512, 128, generator=gen) * torch.linspace(0.2, 3.0, 128)  # uneven input scales
    h = 2 * x.t() @ x / x.shape[0]
    rtn = quantize_weight_fp4(w, fmt)
    eye, _ = gptq_quantize(w, torch.eye(128), FP4Config(format=fmt).scheme(), dampening=1e-6, act_order=False, grid=FP4Grid(w, fmt))
    # the same values (the loop adds the zero point 0, so a rounded-away negative is code 0 there, 8 in RTN)
    assert torch.equal(eye.dequantize(), rtn.dequantize()) and torch.equal(eye.codes() & 7, rtn.codes() & 7)
    record, info = gptq_quantize(w, h, FP4Config(format=fmt).scheme(), grid=FP4Grid(w, fmt))
    assert torch.equal(record.scale.view(torch.uint8), rtn.scale.view(torch.uint8)) and info["gptq_loss"] > 0
    torch_loop, _ = gptq_quantize(w, h, FP4Config(format=fmt).scheme(), grid=FP4Grid(w, fmt), numpy_columns=False)
    assert torch.equal(torch_loop.packed, record.packed)
    err = lambda r: float(((x @ (r.dequantize() - w).t()) ** 2).sum())  # noqa: E731
    assert err(record) < 0.9 * err(rtn), (err(record), err(rtn))  # nvfp4: 164 against 195


def test_gptq_stage_end_to_end(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    """`algorithm: gptq` calibrates, installs FP4 layers, and its artifact reloads them (`compress gate`)."""
    text = recipe_text(tiny_model_dir, text_dir).replace(RTN, "      method: fp4\n      format: nvfp4\n      algorithm: gptq\n")
    text = text.replace("exports: []\n", "exports:\n  - format: compressed-tensors\n")
    out = tmp_path / "out"
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", out])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    stage = manifest["stages"][0]
    assert stage["method"] == "fp4" and stage["summary"]["records_file"] == RECORDS_FILE and len(stage["layers"]) == 14
    assert all("gptq_loss" in layer for layer in stage["layers"].values())
    assert manifest["exports"][0]["verified"]
    no_cal = text[: text.index("  calibration:")] + text[text.index("  evaluation:") :]
    result = run_cli(["validate", write_recipe(tmp_path, no_cal, "nocal.yaml")])
    assert result.exit_code == 2 and "needs data.calibration" in result.output, result.output


def test_plan_sizes_mxfp4_gguf(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    """compress plan: a GGUF export of mxfp4 records is MXFP4 blocks (4.25 bits a weight), the other matrices Q8_0 as written."""
    text = recipe_text(tiny_model_dir, text_dir).replace(RTN, "      method: fp4\n      format: mxfp4\n")
    text = text.replace("exports: []\n", "exports:\n  - format: gguf\n")
    result = run_cli(["plan", write_recipe(tmp_path, text), "--json", tmp_path / "plan.json"])
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "plan.json").read_text())
    gguf = next(a for a in plan["artifacts"] if a["artifact"] == "gguf")
    quantized, _ = _quantized_weights(tiny_model_dir)
    assert "mxfp4" in gguf["basis"] and "q8_0" in gguf["basis"], gguf
    assert gguf["size_bytes"] == int((quantized * 4.25 + (plan["model"]["parameters"] - quantized) * 8.5) / 8)


# --------------------------------------------------------------------------- W4A4: FP4 inputs


def _ct_input_quantization(x: torch.Tensor, fmt: str, global_scale: torch.Tensor | None) -> torch.Tensor:
    """compressed-tensors' own input quantization of llm-compressor's NVFP4 / MXFP4 preset (forward_quantize)."""
    from types import SimpleNamespace

    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    module = SimpleNamespace(quantization_status=QuantizationStatus.COMPRESSED, input_global_scale=global_scale)
    return forward_quantize(module, x.clone(), "input", PRESET_SCHEMES[fmt.upper()]["input_activations"])


def test_nvfp4_input_rounding_groups_ties_zero_groups_and_saturation() -> None:
    """Inputs per 16 over a global scale of 64: a group whose absmax is 6 gets the E4M3 scale 64 (effective 1), so its
    values round as E2M1 itself (ties to even); an all-zero group gets 0.125 and stays 0; a group whose scale would pass
    448 is clamped there and its largest values saturate at 6 x 448 / 64 = 42."""
    from compress.quantizers.fp4 import quantize_input_fp4

    g = torch.tensor([64.0])
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
    x = torch.zeros(2, 48)
    x[0, :16] = torch.tensor(ties + [-t for t in ties])
    x[0, 32:48] = torch.linspace(-84.0, 84.0, 16)  # absmax 84: scale 84 / 6 x 64 = 896 -> 448
    x[1, 16:32] = torch.full((16,), 3.0)  # one group, every value the absmax: scale 32, effective 0.5, value 3
    got = quantize_input_fp4(x, "nvfp4", g)
    rounded = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    assert got[0, :16].tolist() == rounded + [-r for r in rounded]
    assert got[0, 16:32].abs().sum() == 0 and got[1, :16].abs().sum() == 0  # zero groups
    assert got[0, 32] == -42.0 and got[0, 47] == 42.0  # saturated at ±6 x 7
    assert torch.equal(got[1, 16:32], x[1, 16:32])
    assert torch.equal(got, _ct_input_quantization(x, "nvfp4", g))  # compressed-tensors' own NVFP4 input path
    wide = torch.randn(64, 128, generator=torch.Generator().manual_seed(5)) * torch.logspace(-3, 1, 128)
    assert torch.equal(quantize_input_fp4(wide, "nvfp4", g), _ct_input_quantization(wide, "nvfp4", g))


def test_mxfp4_input_rounding_groups_ties_zero_groups() -> None:
    """Inputs per 32, each group's E8M0 scale from its own absmax (the weights' OCP rule): absmax 6 gives 2**0."""
    from compress.quantizers.fp4 import quantize_input_fp4

    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
    x = torch.zeros(1, 96)
    x[0, :8] = torch.tensor(ties)
    x[0, 64:72] = torch.tensor(ties) * 2.0**-20  # the same ties 20 octaves down
    got = quantize_input_fp4(x, "mxfp4", None)
    rounded = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0])
    assert torch.equal(got[0, :8], rounded) and torch.equal(got[0, 64:72], rounded * 2.0**-20)
    assert got[0, 32:64].abs().sum() == 0  # a zero group (E = 0) stays 0
    assert torch.equal(got, _ct_input_quantization(x, "mxfp4", None))
    wide = torch.randn(64, 128, generator=torch.Generator().manual_seed(6)) * torch.logspace(-3, 1, 128)
    assert torch.equal(quantize_input_fp4(wide, "mxfp4", None), _ct_input_quantization(wide, "mxfp4", None))


def test_w4a4_linear_equals_a_hand_computation() -> None:
    """The W4A4 layer: compressed-tensors' input quantization, then the product with the record's weight, bias in float32."""
    torch.manual_seed(7)
    linear = torch.nn.Linear(64, 24)
    x = torch.randn(3, 64) * 3
    for fmt, g in (("nvfp4", torch.tensor([448 * 6 / 10.0])), ("mxfp4", None)):
        record = quantize_weight_fp4(linear.weight.detach(), fmt)
        layer = FP4Linear(linear, record)
        layer.quantize_inputs(g)
        with torch.no_grad():
            want = _ct_input_quantization(x, fmt, g) @ record.dequantize().t() + linear.bias
            assert torch.equal(layer(x), want)
            assert not torch.equal(want, x @ record.dequantize().t() + linear.bias)  # the inputs were rounded
        kept = layer.record
        assert (kept.input_global_scale is None) == (fmt == "mxfp4")
        assert sorted(kept.tensors("l")) == sorted(
            ["l.weight_packed", "l.weight_scale"] + (["l.weight_global_scale", "l.input_global_scale"] if g is not None else [])
        )
    with pytest.raises(ValueError, match="needs its calibrated input global scale"):
        FP4Linear(linear, quantize_weight_fp4(linear.weight.detach(), "nvfp4")).quantize_inputs(None)


def test_input_global_scales_are_calibrated_as_llm_compressor() -> None:
    """nvfp4 W4A4: each layer's input global scale is generate_gparam(min, max) over every calibration input the layer
    receives in the model with FP4 weights (llm-compressor's static_minmax observer); mxfp4 calibrates nothing."""
    from compressed_tensors.quantization.utils.helpers import generate_gparam

    from tests.tiny import tiny_model

    tokens = torch.randint(0, 300, (6, 24), generator=torch.Generator().manual_seed(8))
    models = {}
    for acts in (None, "dynamic"):
        model = tiny_model(vocab=300, hidden=64, intermediate=128)
        ctx = RunContext(seed=0, device=torch.device("cpu"), tokenizer=None, reporter=QUIET, calibration=lambda: tokens)
        record = FP4Stage(FP4Config(activations=acts, batch_size=4), "stages[0]").apply(model, ctx)
        models[acts] = (model, record)
    weight_only, _ = models[None]
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [
        m.register_forward_pre_hook(lambda mod, args, n=n: seen.setdefault(n, []).append(args[0].detach()))
        for n, m in weight_only.named_modules()
        if isinstance(m, FP4Linear)
    ]
    with torch.no_grad():
        weight_only(input_ids=tokens)
    for h in hooks:
        h.remove()
    w4a4, record = models["dynamic"]
    assert record.summary["input_calibration_tokens"] == 6 * 24 and "calibrated float32 global scale" in record.summary["activations"]
    for name, xs in seen.items():
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs])
        layer = w4a4.get_submodule(name)
        assert layer.activations == "dynamic" and torch.equal(layer.input_global_scale, generate_gparam(x.min(), x.max()))
        assert record.layers[name]["input_global_scale"] == float(layer.input_global_scale)
        assert torch.equal(layer.weight_packed, weight_only.get_submodule(name).weight_packed)  # the same weights
    assert FP4Config(activations="dynamic").needs_calibration and not FP4Config(format="mxfp4", activations="dynamic").needs_calibration


@pytest.mark.parametrize(("fmt", "preset"), [("nvfp4", "NVFP4"), ("mxfp4", "MXFP4")])
def test_w4a4_recipe_exports_the_input_args_and_global_scales_exactly(
    tmp_path: Path, tiny_model_dir: Path, text_dir: Path, fmt: str, preset: str
) -> None:
    """recipe -> fp4 W4A4 -> compressed-tensors with llm-compressor's NVFP4 / MXFP4 input_activations and (nvfp4) each
    layer's input_global_scale, read back bit for bit; `compress gate` rebuilds the W4A4 layers (the same KL)."""
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from safetensors.torch import load_file

    gates = "  - {metric: kl_divergence, artifact: compressed-tensors, max: 2.0}\n"
    text = recipe_text(tiny_model_dir, text_dir, gates=gates).replace(
        RTN, f"      method: fp4\n      format: {fmt}\n      activations: dynamic\n"
    )
    text = text.replace("exports: []\n", "exports:\n  - format: compressed-tensors\n")
    out = tmp_path / "out"
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", out])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["exports"][0]["verified"] and "probe input" in manifest["exports"][0]["check"], manifest["exports"][0]
    qcfg = json.loads((out / "exports/compressed-tensors/config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qcfg).config_groups["group_0"]
    want = PRESET_SCHEMES[preset]
    for part in ("weights", "input_activations"):
        for key in ("num_bits", "type", "strategy", "dynamic", "symmetric", "group_size", "scale_dtype"):
            assert getattr(getattr(parsed, part), key) == getattr(want[part], key), (part, key)
    assert infer_module_format(torch.nn.Linear, parsed).value == qcfg["format"] == f"{fmt}-pack-quantized"
    tensors = load_file(str(out / "exports/compressed-tensors/model.safetensors"))
    records = load_file(str(out / RECORDS_FILE))
    layers = manifest["stages"][0]["layers"]
    inputs = sorted(k for k in tensors if k.endswith(".input_global_scale"))
    assert inputs == (sorted(f"{n}.input_global_scale" for n in layers) if fmt == "nvfp4" else [])
    for k in inputs:
        assert tensors[k].dtype == torch.float32 and torch.equal(tensors[k], records[k])
        assert float(tensors[k]) == layers[k.removesuffix(".input_global_scale")]["input_global_scale"]
    kl, run_kl = _gate_again(tmp_path, out, gates)
    assert kl["compressed"] == pytest.approx(run_kl["compressed"], rel=1e-4, abs=1e-7)


@pytest.mark.parametrize(
    ("fmt", "export", "message"),
    [
        ("mxfp4", "  - format: gguf\n", "format gguf cannot hold the FP4 activation quantization of stages.0."),
        ("nvfp4", "  - format: onnx\n", "format onnx cannot hold the fp4 .nvfp4. stage"),
    ],
)
def test_w4a4_on_an_export_that_cannot_hold_it_exits_2_naming_the_export(
    tmp_path: Path, tiny_model_dir: Path, text_dir: Path, fmt: str, export: str, message: str
) -> None:
    stage = f"      method: fp4\n      format: {fmt}\n      activations: dynamic\n"
    text = recipe_text(tiny_model_dir, text_dir).replace(RTN, stage).replace("exports: []\n", "exports:\n" + export)
    result = run_cli(["validate", write_recipe(tmp_path, text)])
    assert result.exit_code == 2 and "exports[0]" in result.output and "Traceback" not in result.output, result.output
    assert __import__("re").search(message, " ".join(result.output.split())), result.output
    bad = recipe_text(tiny_model_dir, text_dir).replace(RTN, "      method: fp4\n      activations: static\n")
    result = run_cli(["validate", write_recipe(tmp_path, bad, "bad.yaml")])
    assert result.exit_code == 2 and "activations" in result.output and "Traceback" not in result.output, result.output


def test_rotate_then_w4a4_runs_end_to_end(tmp_path: Path, onnx_model_dir: Path, text_dir: Path) -> None:
    """rotate (hadamard) before an NVFP4 W4A4 GPTQ stage: the rotated weights are quantized, the input global scales
    calibrated on the rotated model, and the compressed-tensors export verifies exactly."""
    text = recipe_text(onnx_model_dir, text_dir).replace(
        RTN, "      method: fp4\n      format: nvfp4\n      activations: dynamic\n      algorithm: gptq\n"
    )
    text = text.replace("stages:\n", "stages:\n  - rotate: {kind: hadamard}\n").replace(
        "exports: []\n", "exports:\n  - format: compressed-tensors\n"
    )
    out = tmp_path / "out"
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", out, "-q"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    rotate, fp4 = manifest["stages"]
    assert rotate["kind"] == "rotate" and fp4["method"] == "fp4" and manifest["exports"][0]["verified"]
    assert all(layer["input_global_scale"] > 0 and "gptq_loss" in layer for layer in fp4["layers"].values())


def test_awq_on_fp4_end_to_end(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    """`algorithm: awq`: AWQ's scale search with FP4 rounding, folded into the norms, the layers FP4; every searched
    scale does no worse than no scaling on its own calibration loss, and the export reads back exactly."""
    text = recipe_text(tiny_model_dir, text_dir).replace(
        RTN, "      method: fp4\n      format: nvfp4\n      algorithm: awq\n      awq_grid: 4\n"
    )
    text = text.replace("exports: []\n", "exports:\n  - format: compressed-tensors\n")
    out = tmp_path / "out"
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", out, "-q"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    stage = manifest["stages"][0]
    assert stage["method"] == "fp4" and len(stage["layers"]) == 14 and manifest["exports"][0]["verified"]
    scaled = [layer for layer in stage["layers"].values() if layer.get("awq_alpha") is not None]
    assert scaled and all(layer["awq_loss_ratio"] <= 1.0 for layer in scaled)
    assert all(layer["bits_per_weight"] > 4.5 for layer in stage["layers"].values())
    no_cal = text[: text.index("  calibration:")] + text[text.index("  evaluation:") :]
    result = run_cli(["validate", write_recipe(tmp_path, no_cal, "nocal.yaml")])
    assert result.exit_code == 2 and "needs data.calibration" in result.output, result.output


def test_plan_of_w4a4_sizes_as_weight_only_and_adds_the_input_calibration(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    """compress plan: FP4 inputs change no stored size (the plan leaves out nvfp4's 4-byte input_global_scale a layer);
    nvfp4's calibration forward adds time, mxfp4's dynamic inputs none."""
    plans = {}
    for fmt, acts in (("nvfp4", "null"), ("nvfp4", "dynamic"), ("mxfp4", "null"), ("mxfp4", "dynamic")):
        text = recipe_text(tiny_model_dir, text_dir).replace(RTN, f"      method: fp4\n      format: {fmt}\n      activations: {acts}\n")
        text = text.replace("exports: []\n", "exports:\n  - format: compressed-tensors\n")
        result = run_cli(["plan", write_recipe(tmp_path, text), "--json", tmp_path / "plan.json"])
        assert result.exit_code == 0, result.output
        plans[fmt, acts] = json.loads((tmp_path / "plan.json").read_text())
    for fmt in ("nvfp4", "mxfp4"):
        size = {
            a: next(x for x in plans[fmt, a]["artifacts"] if x["artifact"] == "compressed-tensors")["size_bytes"]
            for a in ("null", "dynamic")
        }
        assert size["null"] == size["dynamic"]
    stage = {k: next(s for s in p["steps"] if s["step"].startswith("stages[0]")) for k, p in plans.items()}
    assert "input global scales" in stage["nvfp4", "dynamic"]["basis"]
    assert stage["nvfp4", "dynamic"]["time_s"] > stage["nvfp4", "null"]["time_s"]
    assert stage["mxfp4", "dynamic"] == stage["mxfp4", "null"]


# --------------------------------------------------------------------------- one global scale for fused layers


@pytest.mark.parametrize("algorithm", ["rtn", "gptq", "awq"])
def test_layers_a_runtime_fuses_share_one_nvfp4_global_scale(algorithm: str) -> None:
    """q/k/v and gate/up (vLLM's qkv_proj and gate_up_proj, which keep one global scale) get one NVFP4 global
    scale: 448·6 / the largest |w| of the set, as llm-compressor fuses them; o_proj and down_proj keep their own;
    each layer's group scales and codes are those of RTN under that global scale."""
    from compress.quantizers.fp4 import nvfp4_global_scale
    from tests.tiny import tiny_model

    model = tiny_model(vocab=300, hidden=64, intermediate=128)
    weights = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    calibration = torch.randint(0, 300, (4, 32), generator=torch.Generator().manual_seed(0))
    ctx = RunContext(seed=0, device=torch.device("cpu"), tokenizer=None, reporter=QUIET, calibration=lambda: calibration)
    FP4Stage(FP4Config(format="nvfp4", algorithm=algorithm), "stages[0]").apply(model, ctx)
    records = fp4_records(model)
    for block in ("model.layers.0", "model.layers.1"):
        for fused in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            names = [f"{block}.{n}" for n in fused]
            if algorithm == "awq":  # read from the weights after AWQ's scales are folded: one value, not the source's
                assert len({float(records[n].global_scale) for n in names}) == 1, names
                continue
            shared = nvfp4_global_scale(max(weights[n].abs().amax() for n in names))
            assert all(torch.equal(records[n].global_scale, shared) for n in names), [float(records[n].global_scale) for n in names]
            if algorithm == "rtn":
                assert all(torch.equal(records[n].packed, quantize_weight_fp4(weights[n], "nvfp4", shared).packed) for n in names)
        for alone in ("self_attn.o_proj", "mlp.down_proj") if algorithm != "awq" else ():  # (awq scales these too)
            own = quantize_weight_fp4(weights[f"{block}.{alone}"], "nvfp4").global_scale
            assert torch.equal(records[f"{block}.{alone}"].global_scale, own)
    assert len({float(records[f"model.layers.0.self_attn.{n}"].global_scale) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}) == 2


def test_export_refuses_fused_layers_with_two_global_scales() -> None:
    """Records whose q/k/v carry their own global scales (what vLLM would misread) are refused at export, naming both layers."""
    from compress.errors import FormatError
    from compress.export.checkpoint.fp4_checkpoint import check_fused_global_scales

    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(32, 64, generator=gen), torch.randn(32, 64, generator=gen) * 3
    records = {
        "m.layers.0.self_attn.q_proj": quantize_weight_fp4(q, "nvfp4"),
        "m.layers.0.self_attn.k_proj": quantize_weight_fp4(k, "nvfp4"),
    }
    with pytest.raises(FormatError, match="q_proj and m.layers.0.self_attn.k_proj are one fused weight"):
        check_fused_global_scales(records)
    shared = records["m.layers.0.self_attn.k_proj"].global_scale
    check_fused_global_scales({**records, "m.layers.0.self_attn.q_proj": quantize_weight_fp4(q, "nvfp4", shared)})  # one scale: accepted
    check_fused_global_scales(
        {
            "m.layers.0.self_attn.q_proj": records["m.layers.0.self_attn.q_proj"],
            "m.layers.0.self_attn.o_proj": records["m.layers.0.self_attn.k_proj"],
        }
    )
