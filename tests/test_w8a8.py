"""W8A8 int8 with SmoothQuant: the smoothing keeps the float function, the Linear is the integer
computation a W8A8 runtime does, and a recipe runs end to end into an int-quantized compressed-tensors
checkpoint that compressed-tensors' own decompressor reads back bit for bit."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from compress.context import RunContext
from compress.progress import Reporter
from compress.quantizers.configs import W8A8Config
from compress.quantizers.llm_int8 import collect_input_absmax, quantize_weight_int8
from compress.quantizers.targets import select_linears
from compress.quantizers.w8a8 import (
    W8A8Linear,
    W8A8Stage,
    kv_channel_index,
    smooth,
    smoothing_scales,
)
from tests.helpers import recipe_text, run_cli, write_recipe
from tests.tiny import perturb_norms, tiny_model

QUIET = Reporter(quiet=True)
SMOOTHED_LOGITS_ATOL = 1e-5
"""Largest |logit difference| between a smoothed float32 tiny model and its source: the rescaling is exact in
real arithmetic, float32 rounds each product once more (observed: below 1e-6 on logits of magnitude ~1)."""


def tokens(seed: int, rows: int = 4, length: int = 32) -> torch.Tensor:
    return torch.randint(0, 300, (rows, length), generator=torch.Generator().manual_seed(seed))


def outlier_model(model_type: str = "llama", **shape) -> nn.Module:
    """A tiny model with perturbed norms and two hidden features 20x larger after each input norm (outlier stand-ins)."""
    model = perturb_norms(tiny_model(model_type, **shape))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[[3, 17]] *= 20.0
    return model


# --------------------------------------------------------------------------- math


def test_smoothing_scales_follow_the_formula() -> None:
    x = torch.tensor([4.0, 1.0, 0.0, 9.0])
    w1 = torch.tensor([[1.0, -2.0, 3.0, 0.0], [0.5, 1.0, -1.0, 0.0]])
    w2 = torch.tensor([[-4.0, 0.5, 1.0, 0.0]])
    s = smoothing_scales(x, [w1, w2], 0.5)
    # column maxima over both weights: 4, 2, 3, 0; channels with no activation or no weight keep 1
    assert torch.allclose(s, torch.tensor([(4.0**0.5) / (4.0**0.5), 1.0 / 2.0**0.5, 1.0, 1.0]))
    assert torch.equal(smoothing_scales(x, [w1, w2], 0.0)[:2], torch.tensor([1 / 4.0, 1 / 2.0]))
    assert torch.equal(smoothing_scales(x, [w1, w2], 1.0)[:2], torch.tensor([4.0, 1.0]))


def test_kv_channel_index_maps_query_heads_to_their_value_head() -> None:
    # 4 query heads of 2 over 2 value heads: heads 0, 1 read value head 0; heads 2, 3 value head 1
    assert kv_channel_index(8, 4, 2).tolist() == [0, 1, 0, 1, 2, 3, 2, 3]
    with pytest.raises(ValueError, match="not heads of 3"):
        kv_channel_index(8, 4, 3)


def test_linear_equals_the_hand_integer_computation() -> None:
    """y = (q_x · q_wᵀ) s_x s_w + b with q_x = round(x / (absmax_row / 127)) and the record's codes, summed in int64."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 40)
    x = torch.randn(3, 7, 96) * 3
    record = quantize_weight_int8(linear.weight)
    layer = W8A8Linear(linear, record, "torch")
    with torch.no_grad():
        y = layer(x)
    flat = x.reshape(-1, 96)
    s_x = flat.abs().amax(dim=1) / 127
    q_x = torch.round(flat / s_x[:, None]).to(torch.int64)
    q_w = record.codes.to(torch.int64) - 128
    acc = q_x @ q_w.T  # exact integers
    s_w = record.scale[:, 0].to(torch.float32)
    expected = acc.to(torch.float32) * s_x[:, None] * s_w[None, :] + linear.bias
    assert torch.equal(y.reshape(-1, 40), expected)
    assert y.shape == (3, 7, 40) and y.dtype == torch.float32


@pytest.mark.runtime
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (CI has none; run where a GPU is lent)")
def test_cuda_layer_equals_the_cpu_layer() -> None:
    """On a GPU the int8 product runs in ``torch._int_mm`` (exact int32 sums), so the layer's output is the
    CPU layer's up to the float32 scaling's rounding."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 96)
    x = torch.randn(64, 256) * 3
    x[:, [3, 50]] *= 20
    layer = W8A8Linear(linear, quantize_weight_int8(linear.weight), "torch")
    with torch.no_grad():
        cpu = layer(x)
        gpu = copy.deepcopy(layer).cuda()(x.cuda()).cpu()
    assert torch.allclose(gpu, cpu, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- smoothing


@pytest.mark.parametrize(
    ("model_type", "kv_heads"),
    [("llama", 4), ("llama", 2), ("qwen2", 2), ("qwen3", 2), ("gemma2", 2)],  # MHA, GQA, biases, q/k norms, 1 + w norms
)
def test_smoothing_leaves_the_float_function_unchanged(model_type: str, kv_heads: int) -> None:
    base = outlier_model(model_type, kv_heads=kv_heads)
    model = copy.deepcopy(base)
    chosen = dict(select_linears(model, ["*"], ["lm_head"])[0])
    absmax = collect_input_absmax(model, chosen, tokens(1), 2, torch.device("cpu"), QUIET, "calibrating")
    smoothed, skipped = smooth(model, chosen, absmax, 0.5, "stages[0]")
    assert not skipped and len(smoothed) == 2 * 6  # q, k, v, o, gate, up of both blocks; down_proj is not smoothed
    assert "model.layers.0.mlp.down_proj" not in smoothed
    norm = model.model.layers[0].input_layernorm.weight
    assert not torch.allclose(norm, base.model.layers[0].input_layernorm.weight)  # the scales went somewhere
    ids = tokens(2, rows=2)
    with torch.no_grad():
        diff = (model(ids).logits - base(ids).logits).abs().max()
    assert diff < SMOOTHED_LOGITS_ATOL, float(diff)


def test_smoothquant_flattens_outliers_and_beats_plain_w8a8() -> None:
    base = outlier_model()
    kl, stages = {}, {}
    ids = tokens(3, rows=2)
    with torch.no_grad():
        ref = torch.log_softmax(base(ids).logits, -1)
    for name, cfg in {"plain": W8A8Config(smoothing=None), "smooth": W8A8Config()}.items():
        model = copy.deepcopy(base)
        ctx = RunContext(seed=0, device=torch.device("cpu"), tokenizer=None, reporter=QUIET, calibration=lambda: tokens(1))
        stages[name] = W8A8Stage(cfg, "stages[0]").apply(model, ctx)
        assert len(ctx.quantized) == 14 and isinstance(model.get_submodule("model.layers.0.self_attn.q_proj"), W8A8Linear)
        with torch.no_grad():
            out = torch.log_softmax(model(ids).logits, -1)
        kl[name] = float(torch.nn.functional.kl_div(out, ref, log_target=True, reduction="batchmean"))
    assert kl["smooth"] < 0.5 * kl["plain"], kl
    assert stages["plain"].summary["calibration_tokens"] == 0 and stages["plain"].summary["smoothing"] is None
    smoothing = stages["smooth"].summary["smoothing"]
    assert smoothing == {"alpha": 0.5, "layers": 12, "skipped": {}}
    assert stages["smooth"].layers["model.layers.0.self_attn.o_proj"]["smoothed_by"] == "model.layers.0.self_attn.v_proj"


def test_a_layer_quantized_by_an_earlier_stage_is_not_rescaled() -> None:
    """v_proj quantized by RTN first: w8a8 leaves its rows (its record) alone, so o_proj and q/k/v go unsmoothed."""
    from compress.quantizers.configs import RTNConfig
    from compress.quantizers.rtn import RTNStage

    model = outlier_model(kv_heads=2)
    ctx = RunContext(seed=0, device=torch.device("cpu"), tokenizer=None, reporter=QUIET, calibration=lambda: tokens(1))
    RTNStage(RTNConfig(bits=8, group_size=None, targets=["v_proj"]), "stages[0]").apply(model, ctx)
    record = W8A8Stage(W8A8Config(ignore=["lm_head", "v_proj"]), "stages[1]").apply(model, ctx)
    skipped = record.summary["smoothing"]["skipped"]
    assert skipped["model.layers.0.self_attn.v_proj"] == "not smoothed: it was quantized by an earlier stage"
    assert skipped["model.layers.0.input_layernorm"].startswith("not smoothed: not every Linear")
    assert record.summary["smoothing"]["layers"] == 2 * 2  # gate and up of both blocks
    for i in range(2):
        name = f"model.layers.{i}.self_attn.v_proj"
        assert torch.equal(model.get_submodule(name).weight, ctx.quantized[name].dequantize())


def test_unsupported_architecture_is_refused_naming_the_key() -> None:
    from compress.errors import CompressError

    model = tiny_model()
    model.config.model_type = "gpt_unknown"
    ctx = RunContext(seed=0, device=torch.device("cpu"), tokenizer=None, reporter=QUIET, calibration=lambda: tokens(1))
    with pytest.raises(CompressError, match=r"stages\[0\].quantize.smoothing: .*'gpt_unknown'.*smoothing: null"):
        W8A8Stage(W8A8Config(), "stages[0]").apply(model, ctx)


# --------------------------------------------------------------------------- the recipe, the export, the plan


def w8a8_recipe(tmp_path: Path, model_dir: Path, text_dir: Path, quantize: str, exports: str) -> Path:
    gates = (
        "  - {metric: kl_divergence, max: 0.05, artifact: compressed-tensors}\n"
        "  - {metric: top1_agreement, min: 0.8, artifact: compressed-tensors}\n"
        "  - {metric: perplexity, max_increase_pct: 10}"
    )
    text = recipe_text(model_dir, text_dir, bits=8, group_size=None, gates=gates)
    rtn_stage = "      method: rtn\n      bits: 8\n      group_size: null\n      symmetric: true\n"
    assert rtn_stage in text
    text = text.replace(rtn_stage, quantize).replace("exports: []\n", exports)
    return write_recipe(tmp_path, text)


def test_recipe_end_to_end_exports_int_quantized_w8a8_read_back_by_compressed_tensors(
    tmp_path: Path, tiny_model_dir: Path, text_dir: Path
) -> None:
    from compressed_tensors.compressors import IntQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from safetensors.torch import load_file

    from compress.artifact import load_artifact
    from compress.errors import FormatError
    from compress.export.checkpoint.readers import import_checkpoint

    recipe = w8a8_recipe(
        tmp_path,
        tiny_model_dir,
        text_dir,
        "      method: w8a8\n      smoothing: {alpha: 0.5}\n",
        "exports:\n  - format: compressed-tensors\n",
    )
    out = tmp_path / "out"
    result = run_cli(["run", recipe, "-o", out])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    stage = manifest["stages"][0]
    assert stage["method"] == "w8a8" and stage["summary"]["smoothing"]["layers"] == 12
    report = json.loads((out / "report.json").read_text())
    # the generic gates read the compressed evaluation for the export: it holds exactly the model evaluated
    assert [g["passed"] for g in report["gates"]] == [True, True, True], report["gates"]
    assert [g["metric"] for g in report["gates"]] == ["kl_divergence", "top1_agreement", "perplexity"]
    assert report["evaluations"][1]["metrics"]["kl_divergence"] < 0.05

    # the export: int-quantized W8A8 as llm-compressor's preset writes it
    folder = out / "exports" / "compressed-tensors"
    qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == "int-quantized" and list(qcfg["config_groups"]) == ["group_0"]
    parsed = QuantizationConfig.model_validate(qcfg)
    preset = QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES["W8A8"])
    group = parsed.config_groups["group_0"]
    assert group.weights == preset.weights and group.input_activations == preset.input_activations
    assert group.format == "int-quantized" and parsed.ignore == ["lm_head"]

    # read back with compressed-tensors' own decompressor: every layer bit for bit the record
    _, _, records = load_artifact(out)
    tensors = load_file(str(folder / "model.safetensors"))
    assert len(records) == 14
    for name, record in records.items():
        stored = {"weight": tensors[f"{name}.weight"], "weight_scale": tensors[f"{name}.weight_scale"]}
        assert stored["weight"].dtype == torch.int8 and stored["weight_scale"].dtype == torch.float16
        weight = IntQuantizationCompressor.decompress(stored, group)["weight"]
        assert torch.equal(weight, record.dequantize(torch.float16)), name
        assert torch.equal(stored["weight"].to(torch.int16) + 128, record.codes.to(torch.int16)), name
    # as a model source it is refused: a float model with weight records would not quantize the activations
    with pytest.raises(FormatError, match="quantize the input activations"):
        import_checkpoint(folder, torch.float32)
    # the smoothed norms are the checkpoint's: the in-memory model's, as written to model/
    model_norms = load_file(str(out / "model" / "model.safetensors"))
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(tensors[norm], model_norms[norm]) and not torch.all(tensors[norm] == 1.0)


def test_refusals_exit_2_naming_the_key(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    cases = {
        "      method: w8a8\n      smoothing: {alpha: 1.5}\n": "smoothing.alpha",
        "      method: w8a8\n      bits: 4\n": "bits must be 8",
        "      method: w8a8\n      group_size: 64\n": "group_size must be null",
    }
    for i, (quantize, message) in enumerate(cases.items()):
        path = w8a8_recipe(tmp_path, tiny_model_dir, text_dir, quantize, "exports: []\n")
        result = run_cli(["validate", path.rename(tmp_path / f"bad{i}.yaml")])
        assert result.exit_code == 2 and message in result.output, result.output
    for fmt in ("gguf\n    type: q8_0", "onnx\n    precision: int8", "gptq"):  # onnx holds w8a8 at precision w8a8 / auto
        path = w8a8_recipe(tmp_path, tiny_model_dir, text_dir, "      method: w8a8\n", f"exports:\n  - format: {fmt}\n")
        result = run_cli(["validate", path])
        name = fmt.split()[0]
        assert result.exit_code == 2, result.output
        assert f"exports[0] (format {name})" in result.output and "cannot hold activation quantization" in result.output


def test_plan_sizes_the_w8a8_checkpoint(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    """`compress plan`: the stage's row, and the export at int8 codes + one float16 scale per row, the rest float32."""
    from transformers import AutoModelForCausalLM

    recipe = w8a8_recipe(tmp_path, tiny_model_dir, text_dir, "      method: w8a8\n", "exports:\n  - format: compressed-tensors\n")
    out = tmp_path / "plan.json"
    result = run_cli(["plan", recipe, "--json", out])
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    step = next(s for s in plan["steps"] if s["step"] == "stages[0] quantize w8a8")
    assert "one forward over 256 calibration tokens" in step["basis"] and step["time_s"] > 0
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    linears = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    quantized = sum(m.weight.numel() for m in linears)
    expected = quantized + 2 * sum(m.out_features for m in linears) + 4 * (model.num_parameters() - quantized)
    row = next(a for a in plan["artifacts"] if a["artifact"] == "compressed-tensors")
    assert row["size_bytes"] == expected
