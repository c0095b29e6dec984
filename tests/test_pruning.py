"""Structured pruning: importance scores, exact slicing (checked against masking the same parts of
the unpruned model), config round-trips, targets and errors, the prune stage in a recipe."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from compress.errors import CompressError
from compress.pruning.arch import PrunableModel
from compress.pruning.config import PruneConfig, SizeTarget
from compress.pruning.importance import collect, cosine_distance, head_norms, top_indices
from compress.pruning.prune import resolve_sizes
from compress.pruning.slicing import drop_layers, prune_hidden, prune_kv_groups, prune_mlp
from tests.tiny import prunable_model

VOCAB = 128  # prunable_model's vocabulary


def ids(batch: int = 2, seq: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=x, use_cache=False).logits


# ------------------------------------------------------------------ slicing is exact


def test_mlp_slicing_equals_zeroing_the_removed_neurons():
    model = prunable_model()
    x = ids()
    keep = [torch.tensor(sorted(torch.randperm(96, generator=torch.Generator().manual_seed(i))[:64].tolist())) for i in range(4)]
    masked = copy.deepcopy(model)
    for block, k in zip(masked.model.layers, keep, strict=True):
        mask = torch.zeros(96)
        mask[k] = 1
        block.mlp.down_proj.register_forward_pre_hook(lambda _m, a, mask=mask: (a[0] * mask,))
    pm = PrunableModel.of(model)
    prune_mlp(pm, keep)
    assert model.config.intermediate_size == 64 and model.model.layers[0].mlp.down_proj.in_features == 64
    torch.testing.assert_close(logits(model, x), logits(masked, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_kv_group_slicing_equals_zeroing_the_group_heads(model_type):
    model = prunable_model(model_type)
    x = ids()
    keep = [torch.tensor([0]), torch.tensor([1]), torch.tensor([1]), torch.tensor([0])]
    masked = copy.deepcopy(model)
    for block, groups in zip(masked.model.layers, keep, strict=True):  # 4 query heads in 2 groups of 2, head_dim 16
        mask = torch.zeros(4, 16)
        for g in groups.tolist():
            mask[2 * g : 2 * g + 2] = 1
        flat = mask.reshape(-1)
        block.self_attn.o_proj.register_forward_pre_hook(lambda _m, a, mask=flat: (a[0] * mask,))
    pm = PrunableModel.of(model)
    prune_kv_groups(pm, keep)
    assert (model.config.num_attention_heads, model.config.num_key_value_heads, model.config.head_dim) == (2, 1, 16)
    torch.testing.assert_close(logits(model, x), logits(masked, x), atol=1e-5, rtol=1e-5)


def test_dropping_layers_equals_skipping_them_and_renumbers_the_cache():
    from compress.pruning.importance import _identity_hook

    model = prunable_model(layers=4)
    x = ids()
    skipped = copy.deepcopy(model)
    for i in (1, 2):
        skipped.model.layers[i].register_forward_hook(_identity_hook, with_kwargs=True)
    kept = drop_layers(PrunableModel.of(model), [1, 2])
    assert kept == [0, 3] and model.config.num_hidden_layers == 2
    assert [b.self_attn.layer_idx for b in model.model.layers] == [0, 1]
    torch.testing.assert_close(logits(model, x), logits(skipped, x), atol=1e-5, rtol=1e-5)
    out = model.generate(x[:1, :4], max_new_tokens=3, do_sample=False)  # a KV cache with the new layer count works
    assert out.shape == (1, 7)


@pytest.mark.parametrize("tie", [True, False])
def test_hidden_slicing_reaches_every_tensor_of_the_residual_stream(tie):
    # Keeping every channel in a shuffled order must compute exactly the same function: any
    # tensor that reads or writes the residual stream and was missed would scramble it.
    model = prunable_model(tie=tie)
    x = ids()
    before = logits(model, x)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(3))
    prune_hidden(PrunableModel.of(model), order)
    torch.testing.assert_close(logits(model, x), before, atol=1e-4, rtol=1e-4)
    if tie:
        assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_pruned_model_round_trips_save_and_from_pretrained(model_type, tmp_path):
    from transformers import AutoModelForCausalLM

    model = prunable_model(model_type)
    pm = PrunableModel.of(model)
    kept = drop_layers(pm, [3])
    prune_mlp(pm, [torch.arange(0, 96, 3)] * len(kept))
    prune_kv_groups(pm, [torch.tensor([1])] * len(kept))
    prune_hidden(pm, torch.arange(8, 56))
    x = ids()
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert (
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
        cfg["num_hidden_layers"],
    ) == (48, 32, 2, 1, 16, 3)
    torch.testing.assert_close(logits(again, x), logits(model, x), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ importance


def test_importance_ranks_a_dead_neuron_group_and_identity_block_last():
    model = prunable_model(layers=4)
    with torch.no_grad():
        model.model.layers[0].mlp.gate_proj.weight[5].zero_()  # neuron 5 of block 0 never fires
        model.model.layers[1].self_attn.v_proj.weight[16:32].zero_()  # KV group 1 of block 1 outputs zeros
        model.model.layers[2].self_attn.o_proj.weight.zero_()  # block 2 adds nothing to the residual stream
        model.model.layers[2].mlp.down_proj.weight.zero_()
    pm = PrunableModel.of(model)
    imp = collect(pm, [ids(seed=s) for s in range(3)], torch.device("cpu"), want_hidden=True, layer_metric="cosine")
    assert imp.tokens == 3 * 2 * 12
    assert float(imp.mlp[0][5]) == 0.0 and int(imp.mlp[0].argmin()) == 5
    assert int(imp.group_scores(1, 2).argmin()) == 1 and float(imp.group_scores(1, 2)[1]) == 0.0
    assert int(imp.layers_cosine.argmin()) == 2 and float(imp.layers_cosine[2]) < 1e-9
    assert imp.hidden.shape == (64,) and bool((imp.hidden > 0).all())
    kl = collect(pm, [ids()], torch.device("cpu"), want_hidden=False, layer_metric="kl").layers_kl
    assert int(kl.argmin()) == 2 and float(kl[2]) < 1e-9 and bool((kl[[0, 1, 3]] > 0).all())
    names = set(imp.tensors())
    assert {"mlp.layers.0", "heads.layers.3", "hidden", "layers.cosine"} <= names


def test_importance_on_a_streamed_model_equals_the_materialized_model_and_holds_one_block_at_a_time(tiny_model_dir):
    from compress import streaming
    from compress.models import load_model
    from compress.progress import Reporter
    from compress.schema.recipe import ModelConfig

    streamed = load_model(ModelConfig(source=str(tiny_model_dir)), Path("."), Reporter(quiet=True)).model
    loaded = streaming.materialize(copy.deepcopy(streamed))
    batches = [torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    held: list[int] = []

    def count_blocks(_m, _a):
        held.append(sum(any(p.device.type != "meta" for p in b.parameters()) for b in streamed.model.layers))

    hooks = [b.register_forward_pre_hook(count_blocks) for b in streamed.model.layers]
    cpu = torch.device("cpu")
    for metric in ("cosine", "kl"):
        got = collect(PrunableModel.of(streamed), batches, cpu, want_hidden=True, layer_metric=metric, want_gram=True)
        want = collect(PrunableModel.of(loaded), batches, cpu, want_hidden=True, layer_metric=metric, want_gram=True)
        assert got.tokens == want.tokens == 64
        pairs = [(got.hidden, want.hidden)]
        for name in ("mlp", "heads", "mlp_gram"):
            pairs += zip(getattr(got, name), getattr(want, name), strict=True)
        for a, b in pairs:
            assert torch.equal(a, b)  # the same weights and the same operations in the same order: exactly equal
        layer_scores = (got.layers_cosine, want.layers_cosine) if metric == "cosine" else (got.layers_kl, want.layers_kl)
        assert torch.equal(*layer_scores) and bool((layer_scores[0] > 0).all())
    for h in hooks:
        h.remove()
    assert held and max(held) == 1  # one decoder block in memory at a time, during every forward of the pass
    assert streaming.is_streamed(streamed) and all(p.device.type == "meta" for p in streamed.parameters())


@pytest.mark.parametrize("mlp_method", ["activation", "obs"])
def test_the_prune_stage_on_a_streamed_model_cuts_block_by_block_to_the_model_it_cuts_in_memory(trained_tiny_dir, tmp_path, mlp_method):
    import shutil

    from safetensors.torch import load_file, save_file

    from compress import streaming
    from compress.context import RunContext
    from compress.models import load_model
    from compress.progress import Reporter
    from compress.pruning.prune import PruneStage
    from compress.schema.recipe import ModelConfig

    # Block 1 made an identity (its attention and MLP outputs zero): the block cut goes first, so a
    # kept block after it moves to a new place whatever the trained model's other scores are.
    source = tmp_path / "model"
    shutil.copytree(trained_tiny_dir, source)
    tensors = load_file(source / "model.safetensors")
    for name, tensor in tensors.items():
        if name.startswith("model.layers.1.") and name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    quiet = Reporter(quiet=True)
    streamed = load_model(ModelConfig(source=str(source)), Path("."), quiet).model
    loaded = streaming.materialize(copy.deepcopy(streamed))
    calibration = torch.randint(0, 200, (8, 32), generator=torch.Generator().manual_seed(0))
    config = PruneConfig.model_validate(
        {"mlp": 0.25, "heads": 0.5, "layers": {"drop": 2}, "multiple_of": 8, "mlp_method": mlp_method, "obs_damp": 0.1}
    )
    held: list[int] = []
    original_resident = streaming.resident

    def counting_resident(module, *args, **kwargs):  # how many blocks are in memory while one is held to be cut
        held.append(sum(any(p.device.type != "meta" for p in b.parameters()) for b in streamed.model.layers))
        return original_resident(module, *args, **kwargs)

    records = {}
    for name, model in (("streamed", streamed), ("loaded", loaded)):
        ctx = RunContext(seed=0, device=torch.device("cpu"), tokenizer=None, reporter=quiet, calibration=lambda: calibration)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(streaming, "resident", counting_resident)
            records[name] = PruneStage(config, "stages[0]").apply(model, ctx).summary
    for r in records.values():
        r.get("obs", {}).pop("seconds", None)  # a timing
    assert records["streamed"] == records["loaded"]
    assert streaming.is_streamed(streamed) and all(p.device.type == "meta" for p in streamed.parameters())
    assert held and max(held) == 0  # no block in memory when the next is read: one block at a time
    assert 1 in records["streamed"]["dropped_layers"]  # so a kept block moved to a new place (renamed in the overlay)
    want = dict(loaded.state_dict())
    got = dict(streaming.tensors(streamed, keep_tied=True))
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    x = ids(seed=3) % 200
    assert torch.equal(logits(streamed, x), logits(loaded, x))
    assert streamed.config.to_dict() == loaded.config.to_dict()


def test_a_prune_stage_streams_unless_it_cuts_embedding_channels():
    from compress.plugins import stage_streams
    from compress.recipe import stage_model

    assert stage_streams(stage_model().model_validate({"prune": {"mlp": 0.25, "heads": 0.5, "layers": {"drop": 2}}}))
    assert not stage_streams(stage_model().model_validate({"prune": {"mlp": 0.25, "hidden": 0.25}}))


def test_score_math():
    x = torch.tensor([[3.0, 4.0, 0.0, 1.0]])  # two heads of dim 2
    assert head_norms(x, 2).tolist() == [[5.0, 1.0]]
    assert float(cosine_distance(torch.tensor([1.0, 0.0]), torch.tensor([2.0, 0.0]))) == pytest.approx(0.0)
    assert float(cosine_distance(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))) == pytest.approx(1.0)
    assert top_indices(torch.tensor([0.1, 0.9, 0.5, 0.9]), 2).tolist() == [1, 3]  # highest, returned in index order


def ridge_refit(a: torch.Tensor, weight: torch.Tensor, kept: torch.Tensor, damp: float) -> torch.Tensor:
    """The kept columns fitted to the full layer's output: min ||a_k Wᵀ - a W_fullᵀ||² + λ||W - W_k||², λ from all columns."""
    from tests.helpers import ridge_lstsq

    return ridge_lstsq(a[:, kept], a @ weight.T, weight[:, kept], damp * float((a * a).sum(0).mean()))


@pytest.mark.parametrize("block", [1, 4])
def test_obs_cut_removes_a_redundant_neuron_first_and_refits_the_kept_columns(block):
    """A large neuron that another one duplicates costs nothing to remove when its twin takes over
    its column; the magnitude score would keep it. The updated columns are the ridge least-squares
    fit of the kept neurons to the full layer's output, whichever order the search removed them in."""
    from compress.pruning.obs import obs_cut

    g = torch.Generator().manual_seed(0)
    a = torch.randn(400, 12, generator=g, dtype=torch.float64)
    a[:, 3] = 3.0 * a[:, 7]  # neuron 3: the largest activations, and redundant
    a[:, 5] *= 0.2  # neuron 5: small, but nothing else carries it
    weight = torch.randn(6, 12, generator=g, dtype=torch.float64)
    cut = obs_cut(a.T @ a, weight.float(), keep=8, damp=1e-4, block=block)
    if block == 1:  # a block of removals is chosen on single-removal errors: both twins can go together
        assert int(cut.removed[0]) in (3, 7) and not (3 in cut.removed.tolist() and 7 in cut.removed.tolist())
    assert sorted(cut.kept.tolist() + cut.removed.tolist()) == list(range(12)) and cut.kept.tolist() == sorted(cut.kept.tolist())
    torch.testing.assert_close(cut.weight, ridge_refit(a, weight.float().double(), cut.kept, 1e-4), atol=1e-6, rtol=1e-6)
    w = weight.float().double()
    full = a @ w.T

    def error(kept: torch.Tensor, columns: torch.Tensor) -> float:
        return float((full - a[:, kept] @ columns.T).norm())

    assert error(cut.kept, cut.weight) < error(cut.kept, w[:, cut.kept])  # the update helps
    by_magnitude = top_indices(a.abs().mean(0), 8)
    assert 3 in by_magnitude.tolist()  # the activation criterion keeps both twins (measured 68.2 vs 56.7 with the same refit)
    if block == 1:
        assert error(cut.kept, cut.weight) < error(by_magnitude, ridge_refit(a, w, by_magnitude, 1e-4))
    with pytest.raises(ValueError, match="gram is"):
        obs_cut(torch.eye(5), weight, keep=4, damp=0.01)
    with pytest.raises(ValueError, match="keep must be"):
        obs_cut(a.T @ a, weight, keep=0, damp=0.01)


def test_obs_prune_stage_keeps_what_reproduces_each_mlp_and_records_its_choice(tiny_model_dir, text_dir, tmp_path):
    """mlp_method obs in a recipe: the pruned model's MLPs, fed the unpruned model's own hidden
    states, reproduce its MLP outputs on the calibration text better than the activation choice's
    do; the importance file holds the removal order, the manifest the method and its time."""
    from transformers import AutoModelForCausalLM

    from compress.artifact import load_artifact
    from compress.pipeline import run_recipe
    from compress.progress import Reporter
    from compress.recipe import load_recipe

    errors, hashes = {}, {}
    for method in ("activation", "obs"):
        recipe = tmp_path / f"{method}.yaml"
        data = f", data: {{source: {text_dir}, samples: 8}}" if method == "obs" else ""  # the same text by the other road
        recipe.write_text(prune_recipe(tiny_model_dir, text_dir, f"  - prune: {{mlp: 0.25, mlp_method: {method}, multiple_of: 8{data}}}\n"))
        result = run_recipe(load_recipe(recipe), tmp_path / method, reporter=Reporter(quiet=True))
        stage = result.manifest["stages"][0]
        importance = stage["summary"]["importance"]
        assert importance["mlp_method"] == method and stage["summary"]["after"]["intermediate_size"] == 120
        assert importance["calibration_tokens"] == 8 * 64 and importance["text"] == (str(text_dir) if data else "data.calibration")
        hashes[method] = importance["tokens_sha256"]
        scores = load_file(str(tmp_path / method / stage["summary"]["importance"]["file"]))
        if method == "obs":
            assert stage["method"] == "minitron+obs" and stage["summary"]["obs"]["damp"] == 0.01
            for i in range(2):
                removed, kept = scores[f"obs_removed.mlp.layers.{i}"], scores[f"kept.mlp.layers.{i}"]
                assert removed.shape == (40,) and sorted(removed.tolist() + kept.tolist()) == list(range(160))
        else:
            assert "obs" not in stage["summary"] and not any(k.startswith("obs_removed") for k in scores)
        pruned, tokenizer, _ = load_artifact(tmp_path / method)
        teacher = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        kept = [scores[f"kept.mlp.layers.{i}"] for i in range(2)]
        x = tokenizer((text_dir / "doc0.txt").read_text()[:2000], return_tensors="pt").input_ids[:, :64]
        inputs = []
        hooks = [b.mlp.register_forward_pre_hook(lambda _m, a, inputs=inputs: inputs.append(a[0])) for b in teacher.model.layers]
        with torch.no_grad():
            teacher(input_ids=x)
            for h in hooks:
                h.remove()
            errors[method] = sum(
                float((t.mlp(r) - p.mlp(r)).norm()) for t, p, r in zip(teacher.model.layers, pruned.model.layers, inputs, strict=True)
            )
        assert all(k.shape == (120,) for k in kept)
    assert hashes["obs"] == hashes["activation"]  # prune.data naming data.calibration's text gives the same chunks
    assert errors["obs"] < errors["activation"], errors  # measured 0.289 vs 0.308 (a random-init model: little redundancy)


# ------------------------------------------------------------------ targets and errors


def test_targets_resolve_to_exportable_sizes():
    pm = PrunableModel.of(prunable_model())
    sizes = resolve_sizes(PruneConfig(mlp=0.25, heads=0.5, hidden=0.2, layers={"drop": 1}, multiple_of=16), pm)
    assert sizes == {"mlp": 64, "hidden": 48, "heads": 2, "layers": 3}  # 72 -> 64 and 51.2 -> 48 (multiples of 16); one group of 2 heads
    assert resolve_sizes(PruneConfig(mlp=SizeTarget(size=32), layers={"size": 2}, multiple_of=16), pm) == {"mlp": 32, "layers": 2}
    with pytest.raises(CompressError, match="not a multiple of 2"):
        resolve_sizes(PruneConfig(heads={"size": 3}), pm)
    with pytest.raises(CompressError, match="keeps 0 of 96"):
        resolve_sizes(PruneConfig(mlp=0.9, multiple_of=32), pm)
    with pytest.raises(CompressError, match="keeps 0 of 4 blocks"):
        resolve_sizes(PruneConfig(layers={"drop": 4}), pm)


def test_config_errors():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="between 0 and 1"):
        PruneConfig(mlp=1536)
    with pytest.raises(ValidationError, match="at least one of"):
        PruneConfig()
    with pytest.raises(ValidationError, match="exactly one of drop"):
        PruneConfig(layers={"drop": 2, "size": 3})
    with pytest.raises(ValidationError, match="mlp_method obs chooses MLP neurons"):
        PruneConfig(heads=0.5, mlp_method="obs")


def test_unsupported_architecture_is_refused_with_what_to_do():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(CompressError, match="supports llama, mistral, qwen2, qwen3.*PRUNABLE_TYPES"):
        PrunableModel.of(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)))


def test_recipe_refuses_prune_after_quantize(tiny_model_dir, text_dir, tmp_path):
    from compress.errors import RecipeError
    from compress.recipe import load_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        prune_recipe(
            tiny_model_dir, text_dir, "  - quantize: {method: rtn, bits: 4, group_size: 32}\n  - prune: {mlp: 0.25, multiple_of: 8}\n"
        )
    )
    with pytest.raises(RecipeError, match=r"stages\[1\] \(prune\) comes after stages\[0\] \(quantize\)"):
        load_recipe(recipe)
    recipe.write_text(prune_recipe(tiny_model_dir, text_dir, "  - prune: {mlp: 0.25, hiden: 0.5}\n"))
    with pytest.raises(RecipeError, match="unknown key 'hiden' \\(did you mean 'hidden'"):
        load_recipe(recipe)


def prune_recipe(model: Path, texts: Path, stages: str, exports: str = "[]", gates: str = "[]") -> str:
    return f"""\
version: 1
model: {{source: {model}}}
data:
  calibration: {{source: {texts}, samples: 8, seq_len: 64}}
  evaluation: {{source: {texts}, samples: 4, seq_len: 64, min_context: 8}}
stages:
{stages}exports: {exports}
gates: {gates}
"""


def test_prune_stage_in_a_recipe_writes_scores_and_a_loadable_smaller_model(tiny_model_dir, text_dir, tmp_path):
    from compress.artifact import load_artifact
    from compress.pipeline import run_recipe
    from compress.progress import Reporter
    from compress.recipe import load_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text(prune_recipe(tiny_model_dir, text_dir, "  - prune: {mlp: 0.25, heads: 0.5, hidden: {size: 64}, multiple_of: 8}\n"))
    result = run_recipe(load_recipe(recipe), tmp_path / "out", reporter=Reporter(quiet=True))
    stage = result.manifest["stages"][0]
    assert stage["kind"] == "prune"
    assert stage["summary"]["after"] | {"parameters": 0} == {
        "hidden_size": 64,
        "intermediate_size": 120,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 24,
        "num_hidden_layers": 2,
        "parameters": 0,
    }
    assert stage["summary"]["after"]["parameters"] < stage["summary"]["before"]["parameters"]
    scores = load_file(str(tmp_path / "out" / stage["summary"]["importance"]["file"]))
    assert scores["mlp.layers.0"].shape == (160,) and scores["kept.mlp.layers.1"].shape == (120,) and scores["kept.hidden"].shape == (64,)
    assert "pruning/stages[0].safetensors" in result.manifest["files"]
    model, _, _ = load_artifact(tmp_path / "out")
    assert model.config.hidden_size == 64 and model.model.layers[0].mlp.down_proj.in_features == 120
    compressed = next(e for e in result.evaluations if e.artifact == "compressed")
    assert compressed.metrics["kl_divergence"] > 0
    assert not (tmp_path / "out.work").exists()


@pytest.mark.runtime
def test_pruned_and_repaired_model_goes_through_gptq_to_gguf_and_onnx_in_one_recipe(text_dir, tmp_path):
    """The whole point of pruning: the smaller dense model is an ordinary model for the rest of the
    pipeline. Pruned on every axis, repaired, GPTQ W4, exported exactly to GGUF (run in llama.cpp)
    and ONNX (run in ONNX Runtime), gated on both runtimes' measurements."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (extra gguf) runs the GGUF export")
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai (extra onnx) builds the ONNX export")
    from tests.tiny import tiny_llama_dir, train_tiny

    texts = [p.read_text() for p in sorted(text_dir.glob("*.txt"))]
    model = train_tiny(tiny_llama_dir(tmp_path / "random", texts, hidden=128, layers=4), tmp_path / "h128", texts, steps=60)
    stages = (
        "  - prune: {mlp: 0.25, heads: 0.5, hidden: 0.25, layers: {drop: 1}}\n"
        "  - distill: {steps: 8, batch_size: 2, seq_len: 64, lr: 2.0e-3, warmup_steps: 2, eval: {every: 0, samples: 2}}\n"
        "  - quantize: {method: gptq, bits: 4, group_size: 32, symmetric: true}\n"
    )
    exports = "\n  - {format: gguf, name: gguf}\n  - {format: onnx, name: onnx}"
    gates = "\n  - {metric: kl_divergence, artifact: gguf, max: 0.1}\n  - {metric: kl_divergence, artifact: onnx, max: 0.1}"  # measured: 0.016 each
    recipe = tmp_path / "r.yaml"
    recipe.write_text(prune_recipe(model, text_dir, stages, exports, gates))
    result = run_recipe_quiet(recipe, tmp_path / "out")
    assert result.exit_code == 0, result.report["gates"]
    after = result.manifest["stages"][0]["summary"]["after"]
    assert (after["hidden_size"], after["intermediate_size"], after["num_attention_heads"], after["num_hidden_layers"]) == (96, 96, 2, 3)
    runtimes = {e.artifact: e.runtime for e in result.evaluations}
    assert runtimes["gguf"] == "llama.cpp" and runtimes["onnx"] == "onnxruntime"
    entries = {e["name"]: e for e in result.manifest["exports"]}
    # every quantized Linear (q, k, v, o, gate, up, down) of the 3 kept blocks, proven equal to the GPTQ records, and the head
    # rounded at export (its blocks the embedding table too: the builder's int4 layout)
    assert entries["onnx"]["records_exact"] == 3 * 7 + 1 and entries["onnx"]["ops"]["com.microsoft.GatherBlockQuantized"] == 1
    gguf = next(e for e in result.evaluations if e.artifact == "gguf").metrics
    torch_kl = next(e for e in result.evaluations if e.artifact == "compressed").metrics["kl_divergence"]
    assert abs(gguf["kl_divergence"] - torch_kl) < 0.05 * max(torch_kl, 0.01) + 0.01


def run_recipe_quiet(recipe: Path, out: Path):
    from compress.pipeline import run_recipe
    from compress.progress import Reporter
    from compress.recipe import load_recipe

    return run_recipe(load_recipe(recipe), out, reporter=Reporter(quiet=True))


# ------------------------------------------------------------------ the reference model


@pytest.mark.real_model
@pytest.mark.minutes(1.1)
def test_smollm2_activation_importance_beats_random_neurons_and_the_pruned_model_round_trips(smollm2, shakespeare_chunks, tmp_path):
    """25% of SmolLM2's MLP neurons removed by activation importance damages it much less than the
    same count chosen at random (the score carries information), structured OBS on the same kind of
    text damages it less still, and the smaller model saves and loads back through transformers with
    the same outputs."""
    from transformers import AutoModelForCausalLM

    from compress.context import RunContext
    from compress.eval.metrics import compare, torch_forward
    from compress.progress import Reporter
    from compress.pruning.prune import PruneStage, parameters

    calibration, evaluation = shakespeare_chunks
    base = smollm2.model
    ctx = RunContext(
        seed=0,
        device=torch.device("cpu"),
        tokenizer=smollm2.tokenizer,
        reporter=Reporter(quiet=True),
        calibration=lambda: calibration[:8],
        original=base,
    )
    pruned = copy.deepcopy(base)
    record = PruneStage(PruneConfig(mlp=0.25), "stages[0]").apply(pruned, ctx)
    assert record.summary["after"]["intermediate_size"] == 1152 and parameters(pruned) == 134_515_008 - 30 * 3 * 576 * 384
    assert ctx.teacher is base  # the first stage: the loaded model itself teaches a distill stage
    rand = copy.deepcopy(base)
    g = torch.Generator().manual_seed(0)
    prune_mlp(PrunableModel.of(rand), [torch.sort(torch.randperm(1536, generator=g)[:1152]).values for _ in range(30)])
    obs = copy.deepcopy(base)  # structured OBS on the same text (all 16 chunks: 4,096 tokens for 1,536 neurons a block)
    ctx.calibration = lambda: calibration
    record = PruneStage(PruneConfig(mlp=0.25, mlp_method="obs"), "stages[0]").apply(obs, ctx)
    assert record.method == "minitron+obs" and record.summary["obs"]["seconds"] > 0 and parameters(obs) == parameters(pruned)
    kept = ctx.mapping.mlp[0]
    assert not torch.equal(obs.model.layers[0].mlp.down_proj.weight, base.model.layers[0].mlp.down_proj.weight[:, kept])
    kl = compare(
        torch_forward(base, torch.device("cpu")),
        {
            "importance": torch_forward(pruned, torch.device("cpu")),
            "random": torch_forward(rand, torch.device("cpu")),
            "obs": torch_forward(obs, torch.device("cpu")),
        },
        evaluation[:4],
        min_context=32,
    )
    assert kl["importance"]["kl_divergence"] < 0.6 * kl["random"]["kl_divergence"], kl  # measured 0.724 vs 3.389
    assert kl["obs"]["kl_divergence"] < 0.8 * kl["importance"]["kl_divergence"], kl  # in-domain text: OBS fits it
    pruned.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(logits(again, evaluation[:1, :64]), logits(pruned, evaluation[:1, :64]), atol=1e-4, rtol=1e-4)


@pytest.mark.real_model
def test_smollm2_block_importance_drops_four_blocks(smollm2, shakespeare_chunks):
    from compress.context import RunContext
    from compress.progress import Reporter
    from compress.pruning.prune import PruneStage

    calibration, _ = shakespeare_chunks
    model = copy.deepcopy(smollm2.model)
    ctx = RunContext(
        seed=0,
        device=torch.device("cpu"),
        tokenizer=smollm2.tokenizer,
        reporter=Reporter(quiet=True),
        calibration=lambda: calibration[:4],
        original=smollm2.model,
    )
    record = PruneStage(PruneConfig(layers={"drop": 4}), "stages[0]").apply(model, ctx)
    dropped = record.summary["dropped_layers"]
    scores = ctx.files["pruning/stages[0].safetensors"]["layers.cosine"]
    assert len(dropped) == 4 and model.config.num_hidden_layers == 26 and len(model.model.layers) == 26
    assert sorted(dropped) == sorted(torch.argsort(scores)[:4].tolist())  # the four blocks that change the residual stream least
    assert 0 not in dropped  # the first block rewrites the embedding: never the least important
    out = model.generate(calibration[:1, :16], max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 20)
