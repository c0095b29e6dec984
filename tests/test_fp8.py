"""FP8 (E4M3) W8A8: the rounding, the scales, the Linear against a hand computation, the stage, the
recipe end to end with its compressed-tensors float-quantized export read back bit for bit, the
refusals at validation and the plan's sizes."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from compress.context import RunContext
from compress.progress import Reporter
from compress.quantizers.core import FP8_MAX
from compress.quantizers.fp8 import (
    E4M3,
    MIN_SCALE,
    RECORDS_FILE,
    FP8Linear,
    FP8Stage,
    FP8Weight,
    fp8_records,
    quantize_input,
    quantize_weight_fp8,
    to_e4m3,
    weight_scales,
)
from compress.quantizers.fp8_config import FP8Config
from compress.recipe import stage_model
from tests.helpers import recipe_text, run_cli, write_recipe

QUIET = Reporter(quiet=True)


# --------------------------------------------------------------------------- the math


def e4m3_values() -> torch.Tensor:
    """Every finite float8_e4m3fn value, ascending (the 254 bit patterns that are not NaN, -0 folded into 0)."""
    every = torch.arange(256, dtype=torch.uint8).view(E4M3).to(torch.float32)
    return torch.unique(every[torch.isfinite(every)])


def test_rounding_is_torch_cast_with_saturation() -> None:
    values = e4m3_values()
    assert values.numel() == 253 and float(values.max()) == FP8_MAX == torch.finfo(E4M3).max
    assert torch.equal(to_e4m3(values).to(torch.float32), values)  # representable values are kept
    # a midpoint between neighbours goes to the one whose bit pattern is even (round to nearest, ties to even)
    lo, hi = values[:-1], values[1:]
    mids = (lo + hi) / 2
    lo_bits, hi_bits = to_e4m3(lo).view(torch.uint8), to_e4m3(hi).view(torch.uint8)
    even = torch.where((lo_bits & 1) == 0, lo, hi)
    assert torch.equal(to_e4m3(mids).to(torch.float32), even)
    assert bool((lo_bits != hi_bits).all())
    # just off a midpoint: the nearer neighbour
    assert torch.equal(to_e4m3(mids + (hi - lo) / 8).to(torch.float32), hi)
    assert torch.equal(to_e4m3(mids - (hi - lo) / 8).to(torch.float32), lo)
    # beyond ±448 saturates (the clamp; torch 2.13's CPU cast saturates too), and agrees with torch's cast everywhere
    big = torch.tensor([448.5, 464.0, 480.0, 1e6, -1e6, -464.0])
    assert torch.equal(to_e4m3(big).to(torch.float32), torch.tensor([448.0, 448.0, 448.0, 448.0, -448.0, -448.0]))
    x = torch.randn(10000) * 100
    assert torch.equal(to_e4m3(x).view(torch.uint8), x.clamp(-FP8_MAX, FP8_MAX).to(E4M3).view(torch.uint8))


def test_channel_and_block_scales() -> None:
    torch.manual_seed(0)
    w = torch.randn(300, 200)
    w[7] = 0  # an all-zero row keeps the smallest scale and zero values
    channel = quantize_weight_fp8(w, "channel")
    assert channel.scale.shape == (300, 1) and channel.scale.dtype == torch.float32
    assert torch.equal(channel.scale[:, 0], (w.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE))
    assert float(channel.scale[7]) == float(torch.tensor(MIN_SCALE, dtype=torch.float32)) and not bool(
        channel.weight[7].to(torch.float32).any()
    )
    # the largest value of each row lands on ±448 exactly
    assert torch.equal(channel.weight.to(torch.float32).abs().amax(dim=1)[w.abs().amax(dim=1) > 0], torch.full((299,), FP8_MAX))
    block = quantize_weight_fp8(w, "block")
    assert block.scale.shape == (3, 2)  # ceil(300/128) x ceil(200/128): the last tiles are 44 x 72
    for i, j in [(0, 0), (2, 1), (1, 1)]:
        tile = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
        assert float(block.scale[i, j]) == float(tile.abs().max() / FP8_MAX)
    for record in (channel, block):  # 3 mantissa bits: an error of at most 1/16 of the value, or half the smallest subnormal step
        err = (record.dequantize() - w).abs()
        assert bool((err <= w.abs() / 16 + 2.0**-10 * float(record.scale.max())).all())
    assert torch.equal(weight_scales(w, "block"), block.scale)
    assert channel.bits_per_weight == 8 + 32 / 200 and block.bits_per_weight == 8 + 32 * 6 / (300 * 200)
    with pytest.raises(ValueError, match="block FP8 weight scales are float32"):
        FP8Weight(block.weight, channel.scale, "block")


def test_linear_equals_a_hand_computation() -> None:
    torch.manual_seed(1)
    linear = torch.nn.Linear(160, 48)
    x = torch.randn(2, 5, 160) * 3
    flat = x.reshape(-1, 160)
    for layout in ("channel", "block"):
        record = quantize_weight_fp8(linear.weight.detach(), layout)
        w = torch.empty(48, 160)
        for r in range(48):  # each weight times its own scale, one at a time
            for c in range(0, 160, 32):
                s = record.scale[r, 0] if layout == "channel" else record.scale[r // 128, c // 128]
                w[r, c : c + 32] = record.weight[r, c : c + 32].to(torch.float32) * s
        for activations in ("dynamic", None):
            layer = FP8Linear(linear, record, activations)
            if activations is None:
                xq = flat
            else:  # per token; under block weights per token and group of 128 inputs
                xq = torch.empty_like(flat)
                groups = [(0, 160)] if layout == "channel" else [(0, 128), (128, 160)]
                for t in range(flat.shape[0]):
                    for a, b in groups:
                        s = flat[t, a:b].abs().max() / FP8_MAX
                        xq[t, a:b] = (flat[t, a:b] / s).to(E4M3).to(torch.float32) * s
            expect = (xq @ w.t() + linear.bias).reshape(2, 5, 48)
            with torch.no_grad():
                assert torch.equal(layer(x), expect), (layout, activations)
                # a bfloat16 model: the weight it holds is rounded, so the layer dequantizes its record
                half = FP8Linear(copy.deepcopy(linear).to(torch.bfloat16), record, activations)
                assert torch.equal(half(x.to(torch.bfloat16)), half(x.to(torch.bfloat16).to(torch.float32)).to(torch.bfloat16))
                assert torch.equal(half(flat), xq @ w.t() + half.bias.to(torch.float32))
    # static: one scale for the layer
    record = quantize_weight_fp8(linear.weight.detach(), "channel", torch.tensor([0.02]))
    xq = to_e4m3(flat / 0.02).to(torch.float32) * 0.02
    assert torch.equal(quantize_input(flat, "static", "channel", record.input_scale), xq)
    assert float(xq.abs().max()) <= FP8_MAX * 0.02 + 1e-6  # inputs beyond 448 x scale saturate


def kernel_and_simulation(device: str, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's own FP8 GEMM (``torch._scaled_mm``, one float32 scale a token and an output channel) on
    ``device``, and the stage's simulation of it (``FP8Linear``, weights channel, activations dynamic),
    for the same record and input: a [64, 256] x [256, 96] product with a few large input channels."""
    torch.manual_seed(3)
    linear = torch.nn.Linear(256, 96, bias=False)
    x = torch.randn(64, 256)
    x[:, [7, 100]] *= 30
    record = quantize_weight_fp8(linear.weight.detach(), "channel")
    with torch.no_grad():
        simulated = FP8Linear(linear, record, "dynamic")(x)
    scale = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    a, w = to_e4m3(x / scale).to(device), record.weight.to(device)
    kernel = torch._scaled_mm(a, w.t(), scale_a=scale.to(device), scale_b=record.scale.reshape(1, -1).to(device), out_dtype=out_dtype)
    return kernel.float().cpu(), simulated


@pytest.mark.skipif(not hasattr(torch, "_scaled_mm"), reason="this torch has no _scaled_mm")
def test_linear_is_what_torchs_fp8_gemm_computes_on_the_cpu() -> None:
    """The simulation is the runtime's product, not an approximation of it: torch's CPU FP8 GEMM gives
    the same float32 result (up to the order of the float32 sums: 1e-6 of the largest output)."""
    kernel, simulated = kernel_and_simulation("cpu", torch.float32)
    assert float((kernel - simulated).abs().max()) <= 1e-6 * float(simulated.abs().max())


@pytest.mark.runtime
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="no CUDA device with FP8 tensor cores (compute capability 8.9+; CI has none; run where a GPU is lent)",
)
def test_linear_is_what_the_cuda_fp8_gemm_computes() -> None:
    """On an FP8 GPU (Ada, Hopper, Blackwell) cuBLASLt's row-wise-scaled GEMM, bfloat16 out as vLLM's
    FP8 Linear returns, equals the simulation to bfloat16's rounding (2^-8 of the largest output,
    with the accumulation's order on top: 2^-7)."""
    kernel, simulated = kernel_and_simulation("cuda", torch.bfloat16)
    assert float((kernel - simulated).abs().max()) <= 2.0**-7 * float(simulated.abs().max())


def test_config_fixes_the_scheme() -> None:
    cfg = FP8Config()
    assert (cfg.bits, cfg.group_size, cfg.scale_dtype, cfg.weights, cfg.activations, cfg.needs_calibration) == (
        8,
        None,
        "float32",
        "channel",
        "dynamic",
        False,
    )
    assert FP8Config(activations="static").needs_calibration
    stage = stage_model().model_validate({"quantize": {"method": "fp8", "weights": "block", "activations": None}})
    assert isinstance(stage.config, FP8Config)
    for bad, message in [
        ({"bits": 4}, "bits is 8"),
        ({"group_size": 128}, "takes no group_size"),
        ({"weights": "tensor"}, "'channel' or 'block'"),
        ({"weights": "block", "activations": "static"}, "weights: block goes with activations: dynamic"),
        ({"activations": "token"}, "'dynamic' or 'static'"),
        ({"gguf_type": "q8_0"}, "fp8 has its own E4M3 grid"),
        ({"scale_dtype": "float16"}, "'float32'"),
        ({"symmetric": False}, "symmetric must be true"),
    ]:
        with pytest.raises(ValidationError, match=message):
            stage_model().model_validate({"quantize": {"method": "fp8", **bad}})


# --------------------------------------------------------------------------- the stage and the pipeline


def test_stage_static_scales_and_records() -> None:
    from tests.tiny import tiny_model

    model = tiny_model(vocab=300, hidden=64, intermediate=128)
    tokens = torch.randint(0, 300, (4, 32), generator=torch.Generator().manual_seed(1))
    ctx = RunContext(seed=0, device=torch.device("cpu"), tokenizer=None, reporter=QUIET, calibration=lambda: tokens)
    seen: dict[str, float] = {}
    hooks = [
        m.register_forward_pre_hook(lambda mod, args, n=n: seen.__setitem__(n, max(seen.get(n, 0.0), float(args[0].abs().max()))))
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n != "lm_head"
    ]
    with torch.no_grad():
        model(input_ids=tokens)
    for h in hooks:
        h.remove()
    record = FP8Stage(FP8Config(activations="static", batch_size=2), "stages[0]").apply(model, ctx)
    assert record.summary["layers_quantized"] == 14 and record.summary["calibration_tokens"] == 4 * 32
    assert not ctx.quantized and set(ctx.quantized_by) == set(record.layers)
    q0 = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert isinstance(q0, FP8Linear) and not isinstance(model.get_submodule("lm_head"), FP8Linear)
    for name, layer in record.layers.items():  # the largest input over the calibration tokens / 448
        assert layer["input_scale"] == pytest.approx(seen[name] / FP8_MAX, rel=1e-6)
        assert layer["bits_per_weight"] == pytest.approx(8 + 32 / layer["shape"][1], abs=1e-4)
    stored = ctx.files[RECORDS_FILE]
    assert stored["model.layers.0.self_attn.q_proj.weight"].dtype == E4M3 and "model.layers.0.self_attn.q_proj.input_scale" in stored


def test_recipe_runs_end_to_end_and_exports_float_quantized_exactly(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    """recipe -> fp8 stage -> artifact -> compressed-tensors float-quantized, read back bit for bit by
    compressed-tensors' own decompressor; gates on the export (kl, top-1, perplexity) are evaluated."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from safetensors.torch import load_file

    gates = (
        "  - {metric: kl_divergence, artifact: compressed-tensors, max: 0.05}\n"
        "  - {metric: top1_agreement, artifact: compressed-tensors, min: 0.8}\n"
        "  - {metric: perplexity, artifact: compressed-tensors, max_increase_pct: 10}\n"
    )
    text = recipe_text(tiny_model_dir, text_dir, gates=gates)
    rtn = "      method: rtn\n      bits: 4\n      group_size: 64\n      symmetric: true\n"
    assert rtn in text
    # llm-compressor's presets: FP8_DYNAMIC's channel weights and per-token inputs; static inputs are FP8's per-tensor
    # ones (its FP8 preset also has per-tensor weights; vLLM runs channel weights with a static input scale too)
    for acts, preset in [("dynamic", "FP8_DYNAMIC"), ("static", "FP8")]:
        fp8 = text.replace(rtn, f"      method: fp8\n      weights: channel\n      activations: {acts}\n")
        fp8 = fp8.replace("exports: []\n", "exports:\n  - format: compressed-tensors\n")
        out = tmp_path / acts
        result = run_cli(["run", write_recipe(tmp_path, fp8, f"{acts}.yaml"), "-o", out])
        assert result.exit_code == 0, result.output
        manifest = json.loads((out / "manifest.json").read_text())
        report = json.loads((out / "report.json").read_text())
        assert [g["passed"] for g in report["gates"]] == [True, True, True], report["gates"]
        entry = manifest["exports"][0]
        assert entry["verified"] and entry["layers"] == 14
        qcfg = json.loads((out / "exports/compressed-tensors/config.json").read_text())["quantization_config"]
        assert qcfg["format"] == "float-quantized" and qcfg["ignore"] == ["lm_head"]
        group = qcfg["config_groups"]["group_0"]
        parsed = QuantizationConfig.model_validate(qcfg).config_groups["group_0"]
        for part in ("weights", "input_activations"):  # what llm-compressor's preset of the same scheme says
            want, got = PRESET_SCHEMES["FP8_DYNAMIC" if part == "weights" else preset][part], getattr(parsed, part)
            for key in ("num_bits", "type", "strategy", "dynamic", "symmetric", "group_size", "block_structure"):
                assert getattr(got, key) == getattr(want, key), (preset, part, key)
        assert group["format"] == "float-quantized"
        tensors = load_file(str(out / "exports/compressed-tensors/model.safetensors"))
        records = load_file(str(out / RECORDS_FILE))
        for name in manifest["stages"][0]["layers"]:
            w, s = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"]
            assert w.dtype == E4M3 and s.dtype == torch.float32 and s.shape == (w.shape[0], 1)
            assert torch.equal(w.view(torch.uint8), records[f"{name}.weight"].view(torch.uint8))
            assert torch.equal(s, records[f"{name}.weight_scale"])
            assert (f"{name}.input_scale" in tensors) == (acts == "static")
            if acts == "static":
                assert torch.equal(tensors[f"{name}.input_scale"], records[f"{name}.input_scale"])
            deq = FloatQuantizationCompressor.decompress({"weight": w, "weight_scale": s}, parsed)["weight"]
            assert torch.equal(deq, FP8Weight(w, s, "channel").dequantize())
        # `compress gate` on the artifact rebuilds the FP8 layers from fp8/records.safetensors: the run's numbers again
        gates_file = tmp_path / f"gates-{acts}.yaml"
        gates_file.write_text("gates:\n" + gates)
        result = run_cli(["gate", out, "--gates", gates_file, "-o", tmp_path / f"gate-{acts}", "-q"])
        assert result.exit_code == 0, result.output
        again = json.loads((tmp_path / f"gate-{acts}" / "report.json").read_text())
        kl = {e["artifact"]: e["metrics"]["kl_divergence"] for e in again["evaluations"] if e["kind"] == "accuracy"}
        run_kl = {e["artifact"]: e["metrics"]["kl_divergence"] for e in report["evaluations"] if e["kind"] == "accuracy"}
        assert kl["compressed-tensors"] == kl["compressed"] == pytest.approx(run_kl["compressed"], rel=1e-4, abs=1e-7)
        assert kl["compressed"] > 1e-5  # the FP8 model, not the float source


def test_block_weights_and_kv_cache_fp8_together(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    """Block weights (FP8_BLOCK's layout) and an FP8 KV cache in one recipe: the export carries both."""
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from safetensors.torch import load_file

    text = recipe_text(tiny_model_dir, text_dir)
    rtn = "      method: rtn\n      bits: 4\n      group_size: 64\n      symmetric: true\n"
    kv = "  - kv_cache:\n      format: fp8\n      static_scales: true\n      evaluate: {context: 96, samples: 1, step: 8}\n"
    text = text.replace(rtn, "      method: fp8\n      weights: block\n" + kv)
    text = text.replace("exports: []\n", "exports:\n  - format: compressed-tensors\n")
    out = tmp_path / "out"
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", out])
    assert result.exit_code == 0, result.output
    qcfg = json.loads((out / "exports/compressed-tensors/config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qcfg).config_groups["group_0"]
    for part in ("weights", "input_activations"):
        want, got = PRESET_SCHEMES["FP8_BLOCK"][part], getattr(parsed, part)
        for key in ("num_bits", "type", "strategy", "dynamic", "group_size", "block_structure"):
            assert getattr(got, key) == getattr(want, key), (part, key)
    assert qcfg["kv_cache_scheme"]["type"] == "float"
    tensors = load_file(str(out / "exports/compressed-tensors/model.safetensors"))
    w = tensors["model.layers.0.mlp.down_proj.weight"]
    assert tensors["model.layers.0.mlp.down_proj.weight_scale"].shape == (math.ceil(w.shape[0] / 128), math.ceil(w.shape[1] / 128))
    assert "model.layers.0.self_attn.k_scale" in tensors


@pytest.mark.parametrize(
    ("export", "message"),
    [
        ("  - format: gguf\n    type: q8_0\n", "format gguf cannot hold the fp8 stage stages.0.: llama.cpp has no FP8"),
        ("  - format: onnx\n", "format onnx cannot hold the fp8 stage"),
        ("  - format: gptq\n", "format gptq cannot hold the fp8 stage"),
    ],
)
def test_exports_that_cannot_hold_fp8_are_refused(tmp_path: Path, tiny_model_dir: Path, text_dir: Path, export: str, message: str) -> None:
    text = recipe_text(tiny_model_dir, text_dir).replace("      method: rtn\n      bits: 4\n      group_size: 64\n", "      method: fp8\n")
    text = text.replace("exports: []\n", "exports:\n" + export)
    result = run_cli(["validate", write_recipe(tmp_path, text)])
    assert result.exit_code == 2
    assert "exports[0]" in result.output and "Traceback" not in result.output
    assert __import__("re").search(message, " ".join(result.output.split())), result.output


def test_bad_keys_exit_2_naming_the_key(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    base = recipe_text(tiny_model_dir, text_dir).replace("      method: rtn\n      bits: 4\n      group_size: 64\n", "      method: fp8\n")
    for extra, key in [("      bits: 4\n", "bits"), ("      weights: layer\n", "weights"), ("      group_size: 64\n", "group_size")]:
        result = run_cli(["validate", write_recipe(tmp_path, base.replace("      method: fp8\n", "      method: fp8\n" + extra))])
        assert result.exit_code == 2 and key in result.output and "Traceback" not in result.output, result.output
    two = base.replace("exports: []\n", "").replace(
        "stages:\n", "stages:\n  - quantize: {method: rtn, bits: 8, targets: [lm_head], ignore: []}\n"
    )
    result = run_cli(["validate", write_recipe(tmp_path, two + "exports: []\n")])
    assert result.exit_code == 2 and "quantizes weights too" in result.output, result.output
    static = base.replace("      method: fp8\n", "      method: fp8\n      activations: static\n")
    static = static[: static.index("  calibration:")] + static[static.index("  evaluation:") :]
    result = run_cli(["validate", write_recipe(tmp_path, static)])
    assert result.exit_code == 2 and "needs data.calibration" in result.output, result.output


def test_plan_sizes_fp8(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    """compress plan: 8 bits a weight and a float32 scale a row for every fp8 layer, the rest at the model dtype."""
    text = recipe_text(tiny_model_dir, text_dir).replace("      method: rtn\n      bits: 4\n      group_size: 64\n", "      method: fp8\n")
    text = text.replace("exports: []\n", "exports:\n  - format: compressed-tensors\n")
    result = run_cli(["plan", write_recipe(tmp_path, text), "--json", tmp_path / "plan.json"])
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "plan.json").read_text())
    ct = next(a for a in plan["artifacts"] if a["artifact"] == "compressed-tensors")
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]
    quantized = layers * sum(o * n for o, n in shapes)
    fp8_bytes = layers * sum(o * n + 4 * o for o, n in shapes)
    assert ct["size_bytes"] == fp8_bytes + (plan["model"]["parameters"] - quantized) * 4


@pytest.mark.parametrize(("weights", "activations"), [("channel", "dynamic"), ("channel", "static"), ("block", "dynamic"), ("block", None)])
def test_config_format_is_what_compressed_tensors_infers(weights: str, activations: str | None) -> None:
    """Each config group's format is the one compressed-tensors 0.19 infers for its scheme (float-quantized
    with inputs, naive-quantized for weight-only FP8), and the group parses as its QuantizationScheme."""
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig

    from compress.export.checkpoint.fp8_checkpoint import quantization_config
    from tests.tiny import tiny_model

    model = tiny_model(vocab=300, hidden=64, intermediate=128)
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    ctx = RunContext(seed=0, device=torch.device("cpu"), tokenizer=None, reporter=QUIET, calibration=lambda: tokens)
    FP8Stage(FP8Config(weights=weights, activations=activations), "stages[0]").apply(model, ctx)
    qcfg = quantization_config(model, fp8_records(model), activations)
    scheme = QuantizationConfig.model_validate(qcfg).config_groups["group_0"]
    assert qcfg["format"] == qcfg["config_groups"]["group_0"]["format"] == infer_module_format(torch.nn.Linear, scheme).value
    assert (scheme.input_activations is None) == (activations is None)


# --------------------------------------------------------------------------- GPTQ on the E4M3 grid


def test_numpy_rounding_is_the_torch_cast() -> None:
    """The column loop's NumPy rounding gives what ``to_e4m3`` gives: every E4M3 value, every midpoint
    between neighbours (ties to even), values past ±448, subnormals, zeros and random magnitudes."""
    from compress.quantizers.fp8 import e4m3_nearest_numpy

    values = e4m3_values()
    mids = (values[1:] + values[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            values,
            mids,
            -mids,
            torch.tensor([0.0, -0.0, 449.0, -500.0, 1e6, 2.0**-10, -(2.0**-11)]),
            torch.randn(20000, generator=gen) * torch.logspace(-4, 3, 20000),
        ]
    )
    ours = torch.from_numpy(e4m3_nearest_numpy(x.numpy()))
    assert torch.equal(ours, to_e4m3(x).to(torch.float32))


@pytest.mark.parametrize("weights", ["channel", "block"])
def test_gptq_on_the_e4m3_grid(weights: str) -> None:
    """GPTQ with FP8Grid: the scales are RTN's; an identity Hessian gives RTN's record; a real one lowers the
    output error below RTN's; the NumPy and torch column loops agree bit for bit."""
    from compress.quantizers.fp8 import FP8Grid
    from compress.quantizers.gptq import gptq_quantize

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(150, 200, generator=gen) * 0.05  # ragged 128-tiles on both sides
    mixing = torch.eye(200) + 0.3 * torch.randn(200, 200, generator=gen) / 200**0.5  # correlated inputs, uneven scales
    x = torch.randn(1024, 200, generator=gen) @ mixing * torch.linspace(0.2, 3.0, 200)
    h = 2 * x.t() @ x / x.shape[0]
    cfg = FP8Config(weights=weights, algorithm="gptq")
    rtn = quantize_weight_fp8(w, weights)
    grid = FP8Grid(w, cfg, None)
    eye, _ = gptq_quantize(w, torch.eye(200), grid.for_scheme(cfg.scheme()), dampening=1e-6, act_order=False, grid=grid)
    assert torch.equal(eye.weight.view(torch.uint8), rtn.weight.view(torch.uint8)) and torch.equal(eye.scale, rtn.scale)
    record, info = gptq_quantize(w, h, grid.for_scheme(cfg.scheme()), grid=FP8Grid(w, cfg, None))
    assert torch.equal(record.scale, rtn.scale) and info["gptq_loss"] > 0
    torch_loop, _ = gptq_quantize(w, h, grid.for_scheme(cfg.scheme()), grid=FP8Grid(w, cfg, None), numpy_columns=False)
    assert torch.equal(torch_loop.weight.view(torch.uint8), record.weight.view(torch.uint8))
    err = lambda r: float(((x @ (r.dequantize() - w).t()) ** 2).sum())  # noqa: E731
    assert err(record) < 0.85 * err(rtn), (err(record), err(rtn))  # 0.76 of RTN's for both layouts


def test_gptq_stage_end_to_end(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    """`algorithm: gptq` calibrates, installs FP8 layers (static input scales from the float model first),
    exports float-quantized read back exactly, and the artifact reloads them (`compress gate`)."""
    text = recipe_text(tiny_model_dir, text_dir)
    rtn = "      method: rtn\n      bits: 4\n      group_size: 64\n      symmetric: true\n"
    text = text.replace(rtn, "      method: fp8\n      activations: static\n      algorithm: gptq\n")
    text = text.replace("exports: []\n", "exports:\n  - format: compressed-tensors\n")
    out = tmp_path / "out"
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", out])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    stage = manifest["stages"][0]
    assert stage["method"] == "fp8" and stage["summary"]["records_file"] == RECORDS_FILE and len(stage["layers"]) == 14
    assert all("gptq_loss" in layer and layer["input_scale"] > 0 for layer in stage["layers"].values())
    assert manifest["exports"][0]["verified"]
    gates_file = tmp_path / "gates.yaml"
    gates_file.write_text("gates:\n  - {metric: kl_divergence, artifact: compressed, max: 0.05}\n")
    result = run_cli(["gate", out, "--gates", gates_file, "-o", tmp_path / "gate", "-q"])
    assert result.exit_code == 0, result.output
    kl = lambda report: next(  # noqa: E731
        e["metrics"]["kl_divergence"] for e in json.loads(report.read_text())["evaluations"] if e["artifact"] == "compressed"
    )
    assert kl(tmp_path / "gate" / "report.json") == pytest.approx(kl(out / "report.json"), rel=1e-4, abs=1e-7)
    assert kl(out / "report.json") > 1e-5  # the FP8 model, not the float source
    no_cal = text[: text.index("  calibration:")] + text[text.index("  evaluation:") :]
    result = run_cli(["validate", write_recipe(tmp_path, no_cal.replace("activations: static", "activations: dynamic"), "nocal.yaml")])
    assert result.exit_code == 2 and "needs data.calibration" in result.output and "Hessian" in result.output, result.output
