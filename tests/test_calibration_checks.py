"""Calibration sanity checks (compress/calibration_checks.py): on the text, on what it drives through the
model, their severities (error / warn / off) and what the manifest records."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from compress.calibration_checks import (
    CalibrationChecker,
    check_text,
    dominant_tokens,
    layer_outliers,
    near_duplicates,
    relative_error,
)
from compress.context import RunContext
from compress.errors import DataError
from compress.progress import Reporter
from compress.quantizers.configs import GPTQConfig
from compress.quantizers.core import sqnr_db
from compress.quantizers.gptq import GPTQStage
from compress.schema.recipe import CalibrationChecks
from tests.helpers import run_cli, write_recipe
from tests.tiny import tiny_model

QUIET = Reporter(quiet=True)


def random_tokens(n: int, length: int, seed: int = 0, vocab: int = 50_000) -> torch.Tensor:
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))


def checker(**config) -> CalibrationChecker:
    return CalibrationChecker(CalibrationChecks(**config), QUIET)


def gptq_ctx(tokens: torch.Tensor, checks: CalibrationChecker, device: str = "cpu") -> RunContext:
    return RunContext(seed=0, device=torch.device(device), tokenizer=None, reporter=QUIET, calibration=lambda: tokens, checks=checks)


# --------------------------------------------------------------------------- the text


def test_near_duplicates_are_repeated_or_mostly_overlapping_chunks_only() -> None:
    tokens = random_tokens(64, 256)
    assert near_duplicates(tokens) == []  # distinct text: no pair comes near
    tokens[40] = tokens[3]  # an exact repeat
    tokens[50, :200] = tokens[7, 56:]  # the same text shifted by 56 tokens: 193 of 249 8-grams shared
    tokens[60, :100] = tokens[9, :100]  # 100 of 256 tokens shared: Jaccard 0.23, not a near duplicate
    found = {(i, j): sim for i, j, sim in near_duplicates(tokens)}
    assert set(found) == {(40, 3), (50, 7)}
    assert found[40, 3] == 1.0
    assert 0.5 <= found[50, 7] < 1.0


def test_dominant_tokens_are_the_special_ones_or_one_repeated_token() -> None:
    tokens = random_tokens(4, 100, vocab=1000) + 10
    assert dominant_tokens(tokens, [0, 1])[0] < 0.05
    tokens[:, 30:] = 0  # padding
    share, what = dominant_tokens(tokens, [0, 1])
    assert share == pytest.approx(0.7) and "special" in what
    tokens[:, 30:] = 5  # one ordinary token repeated (a run of separators)
    share, what = dominant_tokens(tokens, [0, 1])
    assert share == pytest.approx(0.7) and what == "token id 5"


def test_text_checks_fail_warn_or_skip_as_the_recipe_says() -> None:
    class Tokenizer:
        all_special_ids = [0]

    tokens = random_tokens(20, 64)
    tokens[10:] = tokens[:10]  # half the chunks repeat the other half
    with pytest.raises(DataError, match=r"10 of 20 chunks nearly repeat.*checks\.duplicates: warn"):
        check_text(checker(), tokens, Tokenizer())
    warned = checker(duplicates="warn")
    check_text(warned, tokens, Tokenizer())
    assert [(r["check"], r["status"]) for r in warned.facts()] == [("duplicates", "warned"), ("padding", "passed")]
    assert warned.facts()[0]["value"] == 0.5 and warned.facts()[1]["value"] < 0.01
    skipped = checker(duplicates="off", padding="off")
    check_text(skipped, tokens, Tokenizer())
    assert skipped.facts() == []
    tokens = random_tokens(20, 64)
    tokens[:, 16:] = 0
    with pytest.raises(DataError, match=r"special tokens .* make up 75\.0% of the calibration tokens \(limit 50%\)"):
        check_text(checker(), tokens, Tokenizer())


# --------------------------------------------------------------------------- the model


def test_relative_error_weighs_each_column_by_its_inputs() -> None:
    w = torch.randn(20_000, 16)  # more rows than one slice of ERROR_ROWS
    noisy = w + 0.01 * torch.randn_like(w)
    assert relative_error(w, noisy) == pytest.approx(10 ** (-sqnr_db(w, noisy) / 10), rel=1e-6)
    ones = relative_error(w, noisy, torch.ones(16))
    assert ones == pytest.approx(relative_error(w, noisy), rel=1e-9)  # equal weights change nothing
    hurt = w.clone()
    hurt[:, 0] = 0  # one column lost
    sums = torch.ones(16)
    sums[0] = 100.0  # ... the one whose input is large
    assert relative_error(w, hurt, sums) == pytest.approx(100 / 115, rel=0.05)
    assert relative_error(w, hurt) == pytest.approx(1 / 16, rel=0.05)


def test_layer_outliers_compare_layers_of_one_kind_and_bit_width() -> None:
    layers = {f"model.layers.{i}.mlp.down_proj": {"relative_error": 0.01, "bits_per_weight": 4.25} for i in range(5)}
    layers["model.layers.3.mlp.down_proj"]["relative_error"] = 0.2
    layers |= {f"model.layers.{i}.mlp.up_proj": {"relative_error": 0.01 * (i + 1), "bits_per_weight": 4.25} for i in range(5)}
    # a layer given fewer bits by a mix is compared with the layers of its own width only (too few here)
    layers |= {f"model.layers.{i}.self_attn.q_proj": {"relative_error": 0.01, "bits_per_weight": 4.25} for i in range(4)}
    layers["model.layers.4.self_attn.q_proj"] = {"relative_error": 0.5, "bits_per_weight": 2.625}
    found, compared = layer_outliers(layers, 10.0)
    assert found == [("model.layers.3.mlp.down_proj", 0.2, 0.01)]
    assert compared == 14
    assert layer_outliers(layers, 25.0)[0] == []
    # weights re-quantized onto the grid they came from: errors near zero, their ratios are noise
    exact = {f"model.layers.{i}.mlp.down_proj": {"relative_error": 1e-12 * (i + 1) ** 3, "bits_per_weight": 5.0} for i in range(5)}
    assert layer_outliers(exact, 10.0) == ([], 5)


def outlier_channels(model: torch.nn.Module, block: int) -> None:
    """Fold a factor of 1000 into 31 of the first 32 input channels of one block's attention: the same
    float model, but each q/k/v row's first group of 32 is now one normal weight beside 31 tiny ones
    that carry large inputs (the activation outliers AWQ and SmoothQuant exist for)."""
    layer = model.model.layers[block]
    with torch.no_grad():
        layer.input_layernorm.weight[:31] *= 1000
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.weight[:, :31] /= 1000


def test_a_layer_far_above_its_kinds_median_is_named() -> None:
    model = tiny_model(layers=4)
    outlier_channels(model, 2)
    tokens = random_tokens(8, 64, vocab=300)
    config = GPTQConfig(bits=4, group_size=32, symmetric=True)
    with pytest.raises(DataError, match=r"3 layer\(s\) quantize with a relative error above 10x .*model\.layers\.2\.self_attn\.[qkv]_proj"):
        GPTQStage(config, "stages[0]").apply(model, gptq_ctx(tokens, checker()))
    model = tiny_model(layers=4)
    outlier_channels(model, 2)
    warned = checker(layer_error="warn")
    record = GPTQStage(config, "stages[0]").apply(model, gptq_ctx(tokens, warned))
    errors = {name: info["relative_error"] for name, info in record.layers.items()}
    assert errors["model.layers.2.self_attn.q_proj"] > 10 * errors["model.layers.1.self_attn.q_proj"]
    result = {r["check"]: r for r in warned.facts()}
    assert result["layer_error"]["status"] == "warned" and result["layer_error"]["value"] > 10
    assert result["tokens"]["status"] == result["nonfinite"]["status"] == "passed"
    clean = checker()
    GPTQStage(config, "stages[0]").apply(tiny_model(layers=4), gptq_ctx(tokens, clean))
    assert {r["check"]: r["status"] for r in clean.facts()} == {"tokens": "passed", "nonfinite": "passed", "layer_error": "passed"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (CI has none; run where a GPU is lent)")
def test_checks_on_cuda_find_what_they_find_on_the_cpu() -> None:
    """compute.device cuda: blocks calibrate on the GPU; the outlier layers and the NaN are found there
    as on the CPU, and each layer's relative error agrees with the CPU's."""
    tokens = random_tokens(8, 64, vocab=300)
    config = GPTQConfig(bits=4, group_size=32, symmetric=True)
    errors = {}
    for device in ("cpu", "cuda"):
        model = tiny_model(layers=4)
        outlier_channels(model, 2)
        with pytest.raises(DataError, match=r"3 layer\(s\) quantize with a relative error above 10x .*model\.layers\.2\.self_attn"):
            GPTQStage(config, "stages[0]").apply(model, gptq_ctx(tokens, checker(), device))
        model = tiny_model(layers=4)
        outlier_channels(model, 2)
        record = GPTQStage(config, "stages[0]").apply(model, gptq_ctx(tokens, checker(layer_error="warn"), device))
        errors[device] = {name: info["relative_error"] for name, info in record.layers.items()}
        model = tiny_model()
        with torch.no_grad():
            model.model.embed_tokens.weight[int(tokens[2, 5])] = float("nan")
        with pytest.raises(DataError, match=r"input of the first decoder block"):
            GPTQStage(config, "stages[0]").apply(model, gptq_ctx(tokens, checker(), device))
    for name, cpu in errors["cpu"].items():
        assert errors["cuda"][name] == pytest.approx(cpu, rel=0.05), name


def test_nonfinite_activations_name_where_they_first_appear() -> None:
    tokens = random_tokens(4, 32, vocab=300)
    model = tiny_model()
    with torch.no_grad():
        model.model.embed_tokens.weight[int(tokens[2, 5])] = float("nan")
    hit = int((tokens == tokens[2, 5]).sum()) * 64  # every occurrence of the token, 64 wide
    with pytest.raises(DataError, match=rf"input of the first decoder block .* holds {hit} NaN or infinite values of 8,192"):
        GPTQStage(GPTQConfig(bits=4, group_size=32), "stages[0]").apply(model, gptq_ctx(tokens, checker()))
    model = tiny_model()
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight[0] = float("inf")
    only_block_0 = GPTQConfig(bits=4, group_size=32, ignore=["re:model\\.layers\\.1\\..*", "lm_head"])
    with pytest.raises(DataError, match=r"output of model\.layers\.1 \(not quantized\) holds"):
        GPTQStage(only_block_0, "stages[0]").apply(model, gptq_ctx(tokens, checker()))


def test_gptq_wants_as_many_tokens_as_the_widest_layer_has_columns() -> None:
    model = tiny_model()  # MLP width 128: down_proj has 128 input columns
    with pytest.raises(DataError, match=r"gptq sees 96 calibration tokens and model\.layers\.0\.mlp\.down_proj has 128 input columns"):
        GPTQStage(GPTQConfig(bits=4, group_size=32), "stages[0]").apply(model, gptq_ctx(random_tokens(3, 32, vocab=300), checker()))
    warned = checker(tokens="warn")
    GPTQStage(GPTQConfig(bits=4, group_size=32), "stages[0]").apply(model, gptq_ctx(random_tokens(3, 32, vocab=300), warned))
    assert warned.facts()[0] | {"detail": None} == {
        "check": "tokens",
        "status": "warned",
        "where": "stages[0]",
        "value": 96,
        "limit": 128,
        "detail": None,
    }


# --------------------------------------------------------------------------- a run


def dup_recipe(model: Path, calibration: Path, evaluation: Path, checks: str = "") -> str:
    return f"""\
version: 1
name: calibration-checks
model:
  source: {model}
data:
  calibration:
    source: {calibration}
    samples: 64
    seq_len: 64
{checks}  evaluation:
    source: {evaluation}
    samples: 4
    seq_len: 64
    min_context: 8
stages:
  - quantize:
      method: gptq
      bits: 4
      group_size: 32
exports: []
"""


def test_a_run_on_repeated_calibration_text_stops_or_warns_and_the_manifest_says_so(
    tiny_model_dir: Path, text_dir: Path, tmp_path: Path
) -> None:
    files = sorted(text_dir.glob("*.txt"))
    calibration = tmp_path / "calibration"
    calibration.mkdir()
    document = files[0].read_text()[:3000]  # one block of data.py's ~4,000 characters
    for copy in range(4):  # one document saved four times: a common accident when folders are merged
        (calibration / f"copy{copy}.txt").write_text(document)
    evaluation = tmp_path / "evaluation"
    evaluation.mkdir()
    shutil.copy(files[1], evaluation / "eval.txt")
    recipe = write_recipe(tmp_path, dup_recipe(tiny_model_dir, calibration, evaluation))
    result = run_cli(["run", recipe, "-o", tmp_path / "out", "--quiet"])
    assert result.exit_code == 2, result.output
    assert "data.calibration:" in result.output and "chunks nearly repeat" in result.output
    assert "checks.duplicates: warn" in result.output
    assert not (tmp_path / "out").exists()

    warn = write_recipe(tmp_path, dup_recipe(tiny_model_dir, calibration, evaluation, "    checks:\n      duplicates: warn\n"), "warn.yaml")
    result = run_cli(["run", warn, "-o", tmp_path / "out", "--quiet"])
    assert result.exit_code == 0, result.output
    checks = json.loads((tmp_path / "out" / "manifest.json").read_text())["data"]["calibration"]["checks"]
    status = {c["check"]: c["status"] for c in checks}
    assert status == {"duplicates": "warned", "padding": "passed", "tokens": "passed", "nonfinite": "passed"}
    assert next(c for c in checks if c["check"] == "duplicates")["value"] > 0.1
