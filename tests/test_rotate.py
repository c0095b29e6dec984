"""The ``rotate:`` stage (issue 55, item 4): function-preserving rotations of the residual stream and of the
value/output heads. Tolerance: a rotated float32 model's logits are the source's to 1e-5 of the largest
|logit| (measured: up to ~1e-6 on the tiny models, float32 rounding of the float64 products)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from compress.errors import CompressError
from compress.quantizers.rotate.config import HEAD_FAMILIES, RESIDUAL_FAMILIES, RotateConfig
from compress.quantizers.rotate.matrices import hadamard, random_orthogonal, randomized_hadamard
from compress.quantizers.rotate.stage import rotate_model
from tests.conftest import texts_of
from tests.helpers import run_cli, write_recipe
from tests.tiny import perturb_norms, scale_weights, tiny_config, tiny_model, tiny_source_dir

TOLERANCE = 1e-5
"""Largest |logit difference| allowed, relative to the source's largest |logit| (float32)."""

# Each family with what makes its rotation visible: uneven norms, q/k/v (and o, MLP) biases, tied and untied heads.
FAMILIES = {
    "llama": {"tie": True},
    "llama-untied-biases": {"tie": False, "attention_bias": True, "mlp_bias": True},
    "mistral": {},
    "qwen2": {"tie": True, "attention_bias": True},
    "qwen3": {"tie": True},
    "gemma2": {},
    "gemma3_text": {},
}


def _model(name: str) -> torch.nn.Module:
    """A tiny model of ``name`` (width 96 = 12 · 8, heads of 16) with norms perturbed and attention sharpened."""
    model = tiny_model(name.split("-")[0], hidden=96, head_dim=16, **FAMILIES[name])
    return scale_weights(perturb_norms(model, 0.3), {"q_proj.weight": 4.0, "k_proj.weight": 4.0})


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("n", [1, 2, 16, 24, 64, 96, 576, 896, 1536])
def test_the_hadamard_matrices_are_hadamard_and_their_randomized_form_orthogonal(n: int) -> None:
    found = hadamard(n)
    assert found is not None
    h, _ = found
    assert bool((h.abs() == 1).all()) and torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))
    q, _ = randomized_hadamard(n, torch.Generator().manual_seed(0))
    assert (q @ q.T - torch.eye(n, dtype=torch.float64)).abs().max() < 1e-12


def test_widths_without_a_construction_get_none_and_random_matrices_are_orthogonal_and_seeded() -> None:
    assert hadamard(92) is None and hadamard(3) is None  # 92 = 4 · 23: no Paley matrix of order 23, 46 or 92
    q = random_orthogonal(96, torch.Generator().manual_seed(1))
    assert (q @ q.T - torch.eye(96, dtype=torch.float64)).abs().max() < 1e-12
    assert torch.equal(q, random_orthogonal(96, torch.Generator().manual_seed(1)))
    assert not torch.equal(q, random_orthogonal(96, torch.Generator().manual_seed(2)))


@pytest.mark.parametrize("kind", ["hadamard", "random"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_rotated_model_computes_the_same_logits(name: str, kind: str) -> None:
    model = _model(name)
    family = model.config.model_type
    before = _logits(model)
    source = {n: p.detach().clone() for n, p in model.named_parameters()}
    residual = family in RESIDUAL_FAMILIES
    summary = rotate_model(model, RotateConfig(kind=kind, residual=residual), "stages[0]", pytest.fail)
    after = _logits(model)
    assert (after - before).abs().max() <= TOLERANCE * before.abs().max()
    assert summary["heads"]["orthogonality_error"] < 1e-12
    assert summary["heads"]["matrix"].startswith("randomized Hadamard" if kind == "hadamard" else "random orthogonal")
    # The rotations moved the weights (a check that fails if a stage did nothing): v_proj's rows always,
    # and with the residual stream every Linear reading it and the embedding.
    layer = model.model.layers[0]
    assert not torch.allclose(layer.self_attn.v_proj.weight, source["model.layers.0.self_attn.v_proj.weight"], atol=1e-3)
    if residual:
        assert summary["residual"]["orthogonality_error"] < 1e-12
        assert summary["residual"]["untied_head"] == FAMILIES[name].get("tie", False)
        assert not torch.allclose(layer.self_attn.q_proj.weight, source["model.layers.0.self_attn.q_proj.weight"], atol=1e-3)
        assert not torch.allclose(model.model.embed_tokens.weight, source["model.embed_tokens.weight"], atol=1e-3)
        assert model.lm_head.weight is not model.model.embed_tokens.weight and not model.config.tie_word_embeddings
        assert all(bool((n.weight == 1).all()) for n in (layer.input_layernorm, layer.post_attention_layernorm, model.model.norm))
    else:  # heads only: the stream, its norms and the q/k projections are as they were
        assert torch.equal(layer.self_attn.q_proj.weight, source["model.layers.0.self_attn.q_proj.weight"])
        assert torch.equal(model.model.embed_tokens.weight, source["model.embed_tokens.weight"])


def test_the_same_seed_gives_the_same_rotation_and_another_seed_another() -> None:
    first, second, other = _model("llama"), _model("llama"), _model("llama")
    rotate_model(first, RotateConfig(), "stages[0]", pytest.fail)
    rotate_model(second, RotateConfig(), "stages[0]", pytest.fail)
    rotate_model(other, RotateConfig(seed=1), "stages[0]", pytest.fail)
    assert torch.equal(first.model.layers[0].mlp.up_proj.weight, second.model.layers[0].mlp.up_proj.weight)
    assert not torch.equal(first.model.layers[0].mlp.up_proj.weight, other.model.layers[0].mlp.up_proj.weight)


def test_a_width_without_a_hadamard_matrix_falls_back_to_random_and_says_so() -> None:
    model = tiny_model("llama", hidden=92, heads=2, kv_heads=1, head_dim=46)  # 92 = 4 · 23, 46 = 2 · 23
    before = _logits(model)
    said: list[str] = []
    summary = rotate_model(model, RotateConfig(kind="hadamard"), "stages[0]", said.append)
    assert (_logits(model) - before).abs().max() <= TOLERANCE * before.abs().max()
    assert summary["residual"]["matrix"] == "random orthogonal (no Hadamard matrix of order 92 is built here)"
    assert len(said) == 2 and said[0].startswith("stages[0].rotate: residual: kind hadamard, but random orthogonal")


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_a_residual_rotation_of_a_gemma_model_is_refused_naming_the_key(family: str) -> None:
    model = tiny_model(family)
    with pytest.raises(CompressError, match=r"stages\[1\]\.rotate\.residual: the residual stream of a .* post_feedforward_layernorm"):
        rotate_model(model, RotateConfig(), "stages[1]", pytest.fail)


def test_an_unknown_family_is_refused_naming_the_key() -> None:
    model = tiny_model("qwen3_moe")
    with pytest.raises(CompressError, match=r"stages\[0\]\.rotate: model type 'qwen3_moe' is not supported"):
        rotate_model(model, RotateConfig(residual=False), "stages[0]", pytest.fail)
    assert "qwen3_moe" not in HEAD_FAMILIES


def test_the_plan_counts_the_untied_head() -> None:
    from compress.eval.plan.shapes import shape_of
    from compress.quantizers.rotate.plugin import ROTATE

    tied = shape_of(tiny_config("llama", tie=True), origin="tiny")
    after = ROTATE.plan_shape(tied, RotateConfig())
    assert after.params == tied.params + 300 * 64 and not after.text.tie_word_embeddings
    assert ROTATE.plan_shape(tied, RotateConfig(residual=False)) is tied  # heads only: nothing to untie
    with pytest.raises(CompressError, match=r"^rotate\.residual: the residual stream of a gemma2 model"):
        ROTATE.plan_shape(shape_of(tiny_config("gemma2"), origin="tiny"), RotateConfig())


RECIPE = """\
version: 1
name: tiny-rotate
model:
  source: {model}
data:
  calibration:
    source: {texts}
    samples: 4
    seq_len: 64
  evaluation:
    source: {texts}
    samples: 4
    seq_len: 64
    min_context: 8
stages:
  - rotate:
{rotate}
{more}exports: {exports}
gates: []
"""


def _recipe(directory: Path, model: Path, texts: Path, rotate: str, more: str = "", exports: str = "[]") -> Path:
    body = "\n".join(f"      {line}" for line in rotate.splitlines())
    return write_recipe(directory, RECIPE.format(model=model, texts=texts, rotate=body, more=more, exports=exports))


@pytest.mark.parametrize(
    ("rotate", "message"),
    [
        ("kind: householder", "stages[0].rotate.kind"),
        ("residual: false\nheads: false", "stages[0].rotate: rotate needs residual: true, heads: true or both"),
        ("seed: -1", "stages[0].rotate.seed"),
    ],
)
def test_bad_rotate_config_is_refused_at_validation(
    tmp_path: Path, tiny_model_dir: Path, text_dir: Path, rotate: str, message: str
) -> None:
    result = run_cli(["validate", _recipe(tmp_path, tiny_model_dir, text_dir, rotate)])
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output


def test_rotate_after_quantize_is_refused_at_validation(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    recipe = _recipe(tmp_path, tiny_model_dir, text_dir, "kind: random")
    text = recipe.read_text().replace("stages:\n", "stages:\n  - quantize:\n      method: rtn\n      bits: 4\n")
    result = run_cli(["validate", write_recipe(tmp_path, text)])
    assert result.exit_code == 2
    assert "stages[1] (rotate) comes after stages[0] (quantize); rotate changes float weights" in result.output


def test_a_gemma_residual_rotation_exits_2_naming_the_key(tmp_path: Path, text_dir: Path) -> None:
    model = tiny_source_dir(tmp_path / "gemma2", texts_of(text_dir), "gemma2")
    recipe = _recipe(tmp_path, model, text_dir, "kind: hadamard")
    planned = run_cli(["plan", recipe])
    assert planned.exit_code == 2 and "rotate.residual: the residual stream of a gemma2 model cannot be rotated exactly" in planned.output
    result = run_cli(["run", recipe, "-o", tmp_path / "out"])
    assert result.exit_code == 2, result.output
    assert "stages[0].rotate.residual: the residual stream of a gemma2 model" in " ".join(result.output.split())
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_rotate_then_gptq_w4_exports_gguf_onnx_and_compressed_tensors(tmp_path: Path, onnx_model_dir: Path, text_dir: Path) -> None:
    """The stage composes: GPTQ W4 quantizes the rotated weights and every export writes and verifies them
    on its runtime (the tiny model's width 96 = Paley I 12 ⊗ Sylvester 8; tied, so its head is untied)."""
    exports = "\n  - format: gguf\n    name: q4\n  - format: onnx\n    name: int4\n  - format: compressed-tensors\n    name: ct"
    gptq = "  - quantize:\n      method: gptq\n      bits: 4\n      group_size: 32\n"
    recipe = _recipe(tmp_path, onnx_model_dir, text_dir, "kind: hadamard", gptq, exports)
    result = run_cli(["run", recipe, "-o", tmp_path / "out", "-q"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    rotate = manifest["stages"][0]
    assert rotate["kind"] == "rotate" and rotate["method"] == "hadamard"
    assert rotate["summary"]["residual"]["matrix"] == "randomized Hadamard (Paley I 12 ⊗ Sylvester 8)"
    assert rotate["summary"]["residual"]["untied_head"] is True
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    kl = {e["artifact"]: e["metrics"]["kl_divergence"] for e in report["evaluations"] if e["kind"] == "accuracy"}
    assert set(kl) >= {"compressed", "q4", "int4"} and max(kl.values()) < 0.01, kl
    config = json.loads((tmp_path / "out" / "model" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.parametrize("kind", ["hadamard", "random"])
def test_the_rotated_reference_model_computes_the_same_logits(smollm2, kind: str) -> None:
    """SmolLM2-135M (float32, width 576 = Paley II 36 ⊗ Sylvester 16, heads of 64, tied) rotated both ways."""
    import copy

    model = copy.deepcopy(smollm2.model)
    ids = torch.randint(0, model.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(ids).logits
    summary = rotate_model(model, RotateConfig(kind=kind), "stages[0]", pytest.fail)
    with torch.no_grad():
        after = model(ids).logits
    assert (after - before).abs().max() <= TOLERANCE * before.abs().max()
    assert summary["residual"]["untied_head"] is True and summary["heads"]["head_dim"] == 64
