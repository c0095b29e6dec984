"""Distillation repair: the losses and schedule, training that lowers the KL to the teacher on
held-apart text, checkpoints that resume after a SIGKILL to the same weights as an unbroken run,
two processes (accelerate, gloo) that train the same weights as one process with the same global
batch, keep_best returning the best evaluated weights, named teachers, and the errors."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from compress.distill.distill import layer_map
from compress.distill.losses import CosineSchedule, hidden_loss, kl_loss, lr_factor, topk_kl_loss, topk_log_probs
from tests.test_pruning import prune_recipe

ROOT = Path(__file__).resolve().parents[1]
PRUNE = "  - prune: {mlp: 0.25, heads: 0.5, hidden: {size: 64}, multiple_of: 8}\n"


def distill_stage(steps: int = 30, batch: int = 2, extra: str = "") -> str:
    return (
        f"  - distill: {{steps: {steps}, batch_size: {batch}, seq_len: 64, lr: 3.0e-3, warmup_steps: 2, "
        f"eval: {{every: 10, samples: 2}}{extra}}}\n"
    )


def run(recipe: Path, out: Path):
    from compress.pipeline import run_recipe
    from compress.progress import Reporter
    from compress.recipe import load_recipe

    return run_recipe(load_recipe(recipe), out, reporter=Reporter(quiet=True))


def cli(*args: str, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "compress", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


# ------------------------------------------------------------------ math


def test_kl_loss_is_forward_kl_scaled_by_t_squared():
    torch.manual_seed(0)
    s, t = torch.randn(2, 3, 11), torch.randn(2, 3, 11)
    assert float(kl_loss(t, t)) == pytest.approx(0.0, abs=1e-7)
    p = torch.softmax(t / 2, -1)
    manual = (p * (torch.log_softmax(t / 2, -1) - torch.log_softmax(s / 2, -1))).sum(-1).mean() * 4
    assert float(kl_loss(s, t, temperature=2.0)) == pytest.approx(float(manual), rel=1e-5)


def _plain_kl(s: torch.Tensor, t: torch.Tensor, temperature: float) -> torch.Tensor:
    """The textbook formulation, recorded by autograd end to end."""
    vocab = s.shape[-1]
    log_ps = torch.log_softmax(s.float().reshape(-1, vocab) / temperature, -1)
    log_pt = torch.log_softmax(t.float().reshape(-1, vocab) / temperature, -1)
    return torch.nn.functional.kl_div(log_ps, log_pt, log_target=True, reduction="batchmean") * temperature**2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_blockwise_kl_loss_has_the_value_and_gradient_of_the_plain_formulation(dtype, temperature, monkeypatch):
    import compress.distill.losses as losses

    monkeypatch.setattr(losses, "KL_ROWS", 7)  # 3 x 20 positions: several blocks and a partial last one
    torch.manual_seed(0)
    s0, t = (torch.randn(3, 20, 50) * 4).to(dtype), (torch.randn(3, 20, 50) * 4).to(dtype)
    s1, s2 = s0.clone().requires_grad_(True), s0.clone().requires_grad_(True)
    ours, plain = kl_loss(s1, t, temperature), _plain_kl(s2, t, temperature)
    assert ours.dtype == torch.float32
    assert float(ours.detach()) == pytest.approx(float(plain.detach()), rel=1e-5)
    (3 * ours).backward()
    (3 * plain).backward()
    assert s1.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2e-2 * float(s2.grad.abs().max())
    assert torch.allclose(s1.grad.float(), s2.grad.float(), atol=tol, rtol=0)
    assert float(s1.grad.abs().max()) > 1e-3  # a real gradient, not zeros


def test_kl_loss_sends_no_gradient_to_the_teacher():
    s, t = torch.randn(4, 9, requires_grad=True), torch.randn(4, 9, requires_grad=True)
    kl_loss(s, t).backward()
    assert t.grad is None and s.grad is not None


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_the_stored_teacher_loss_with_every_token_kept_is_the_live_kl(temperature):
    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 70, 50, generator=g, requires_grad=True)  # 210 positions: several blocks of KL_ROWS
    t = 2 * torch.randn(3, 70, 50, generator=g)
    live = kl_loss(s, t, temperature)
    (live_grad,) = torch.autograd.grad(live, s)
    values, indices, rest = topk_log_probs(t, 50, temperature)
    assert values.shape == indices.shape == (3, 70, 50) and rest.shape == (3, 70) and bool(torch.isneginf(rest).all())
    stored = topk_kl_loss(s, values, indices, rest, temperature)
    (stored_grad,) = torch.autograd.grad(stored, s)
    torch.testing.assert_close(stored, live, rtol=1e-6, atol=1e-7)  # float32 sums in another order
    torch.testing.assert_close(stored_grad, live_grad, rtol=1e-5, atol=1e-9)
    # k < vocabulary: the KL over the top k and one bucket for the rest, and its gradient, as autograd has them
    values, indices, rest = topk_log_probs(t, 7, temperature)
    assert bool((rest > float("-inf")).all())
    got = topk_kl_loss(s, values, indices, rest, temperature)
    (got_grad,) = torch.autograd.grad(got, s)
    log_ps = torch.log_softmax(s / temperature, -1)
    log_rs = torch.logsumexp(log_ps.scatter(-1, indices.long(), float("-inf")), -1)
    plain = ((values.exp() * (values - log_ps.gather(-1, indices.long()))).sum(-1) + rest.exp() * (rest - log_rs)).mean()
    plain = plain * temperature**2
    (plain_grad,) = torch.autograd.grad(plain, s)
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got_grad, plain_grad, rtol=1e-4, atol=1e-8)
    assert float(got) < float(live)  # the buckets merge the tail's outcomes: a coarser distribution, a smaller KL


def test_hidden_loss_maps_layers_and_channels():
    torch.manual_seed(0)
    teacher = [torch.randn(1, 4, 8) for _ in range(4)]
    channels = torch.tensor([0, 2, 5, 7])
    student = [teacher[0][..., channels], teacher[2][..., channels]]
    assert float(hidden_loss(student, teacher, [(0, 0), (1, 2)], channels)) == pytest.approx(0.0, abs=1e-7)
    assert float(hidden_loss(student, teacher, [(1, 3)], channels)) > 0.5


def test_layer_map_skips_a_pair_where_only_one_side_is_after_the_final_norm():
    assert layer_map([0, 1, 2, 3], 4) == [(1, 1), (2, 2), (3, 3), (4, 4)]
    assert layer_map([0, 2, 3], 4) == [(1, 1), (2, 3), (3, 4)]
    assert layer_map([0, 1, 2], 4) == [(1, 1), (2, 2)]  # the student's last block output is normed, the teacher's block 2 output is not


def test_schedule_warms_up_then_decays_to_the_final_ratio():
    f = [lr_factor(s, 4, 20, 0.1) for s in range(21)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0] and f[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[4:], f[5:], strict=False)) and f[20] == pytest.approx(0.1)  # pairs: f[4:] is one longer


def budget_trainer(steps: int, minutes: float, wall: float, eval_s: float, every: int, at: int, planned: int):
    from types import SimpleNamespace

    from compress.distill.config import DistillConfig
    from compress.distill.train import Processes

    config = DistillConfig(steps=steps, max_minutes=minutes, warmup_steps=2, eval={"every": every})
    state = SimpleNamespace(step=at, wall_seconds=wall, eval_seconds=eval_s, planned_steps=planned)
    return SimpleNamespace(config=config, state=state, procs=Processes(torch.device("cpu")), schedule=CosineSchedule(2, planned, 0.1))


def test_time_budget_plans_the_steps_that_fit_and_stops_before_passing_it():
    from compress.distill.train import Trainer

    # 60 s budget; after 3 steps (10 s used, one evaluation 4 s): (60 - 10 - 4) s left for steps of 2 s
    # plus an evaluation every 10 steps (0.4 s a step) -> 19 more steps
    t = budget_trainer(steps=500, minutes=1.0, wall=10.0, eval_s=4.0, every=10, at=3, planned=500)
    assert Trainer.replan(t, [2.5, 2.0, 1.9]) == 22 and t.state.planned_steps == t.schedule.total == 22
    assert t.schedule(21) == pytest.approx(0.1, abs=0.01)  # the decay now ends at the planned step
    t.state.step, t.state.wall_seconds = 2, 58.0
    assert Trainer.replan(t, [2.0] * 2) == 2  # before the plan, too: a step that cannot fit is not started
    # the configured steps are the ceiling
    t = budget_trainer(steps=8, minutes=1.0, wall=10.0, eval_s=4.0, every=0, at=3, planned=8)
    assert Trainer.replan(t, [1.0, 1.0, 1.0]) is None and t.state.planned_steps == 8
    # later steps ran slower than planned: end now when the next step would not fit
    t = budget_trainer(steps=500, minutes=1.0, wall=54.0, eval_s=4.0, every=0, at=15, planned=22)
    assert Trainer.replan(t, [2.0] * 12 + [3.0, 3.0, 3.0]) == 15 and t.state.planned_steps == 15
    t = budget_trainer(steps=500, minutes=1.0, wall=40.0, eval_s=4.0, every=0, at=15, planned=22)
    assert Trainer.replan(t, [2.0] * 15) is None  # on track: the plan stands
    t = budget_trainer(steps=500, minutes=1.0, wall=40.0, eval_s=10.0, every=5, at=15, planned=22)
    assert Trainer.replan(t, [2.0] * 15) == 15  # ... unless this step's evaluation leaves too little
    # every REPLAN_EVERY (10) steps the plan is fitted to the median of the last 10: steps got faster
    # after the first ones -> it grows; (60 - 30 - 4) s left at 1 s a step -> 26 more steps
    t = budget_trainer(steps=500, minutes=1.0, wall=30.0, eval_s=4.0, every=0, at=20, planned=22)
    assert Trainer.replan(t, [3.0] * 10 + [1.0] * 10) == 46 and t.schedule.total == 46
    t = budget_trainer(steps=30, minutes=1.0, wall=30.0, eval_s=4.0, every=0, at=20, planned=22)
    assert Trainer.replan(t, [3.0] * 10 + [1.0] * 10) == 30  # still capped by `steps`
    t = budget_trainer(steps=500, minutes=1.0, wall=40.0, eval_s=4.0, every=0, at=20, planned=30)
    assert Trainer.replan(t, [1.0] * 10 + [3.0] * 10) == 25  # slower: it shrinks, so the decay still ends in time
    t = budget_trainer(steps=500, minutes=1.0, wall=30.0, eval_s=4.0, every=0, at=21, planned=22)
    assert Trainer.replan(t, [3.0] * 10 + [1.0] * 11) is None  # between refits the plan stands
    t = budget_trainer(steps=500, minutes=None, wall=1e9, eval_s=4.0, every=0, at=15, planned=500)
    assert Trainer.replan(t, [2.0] * 15) is None  # no budget: exactly `steps`


def test_refit_solves_the_ridge_least_squares_of_each_pruned_down_projection():
    """MLP-only pruning: the student's activations on the teacher's inputs are the teacher's at the
    kept neurons, so the fit can be checked against an independent solve (lstsq of the stacked
    ridge system) on activations captured from the teacher."""
    import copy

    from compress.distill.refit import refit_down_proj
    from compress.pruning.arch import PrunableModel
    from compress.pruning.slicing import prune_mlp
    from tests.helpers import ridge_lstsq
    from tests.test_pruning import ids
    from tests.tiny import prunable_model

    teacher = prunable_model(layers=3)
    student = copy.deepcopy(teacher)
    keep = [torch.randperm(96, generator=torch.Generator().manual_seed(i))[:64].sort().values for i in range(3)]
    prune_mlp(PrunableModel.of(student), keep)
    before = [b.mlp.down_proj.weight.detach().clone() for b in student.model.layers]
    tokens = ids(batch=6, seq=32)
    acts, outs = {}, {}
    hooks = [
        b.mlp.down_proj.register_forward_pre_hook(lambda m, a, i=i: acts.setdefault(i, []).append(a[0]))
        for i, b in enumerate(teacher.model.layers)
    ]
    hooks += [
        b.mlp.register_forward_hook(lambda m, a, o, i=i: outs.setdefault(i, []).append(o)) for i, b in enumerate(teacher.model.layers)
    ]
    with torch.no_grad():
        teacher(input_ids=tokens, use_cache=False)
    for h in hooks:
        h.remove()
    report = refit_down_proj(student, teacher, tokens, [0, 1, 2], damp=0.1, batch_size=4, device=torch.device("cpu"), bf16=False)
    assert report.blocks == [0, 1, 2] and report.tokens == 6 * 32
    for i, block in enumerate(student.model.layers):
        a = torch.cat(acts[i]).reshape(-1, 96)[:, keep[i]].double()
        y = torch.cat(outs[i]).reshape(a.shape[0], -1).double()
        expected = ridge_lstsq(a, y, before[i], 0.1 * float((a * a).sum(0).mean()))
        torch.testing.assert_close(block.mlp.down_proj.weight.double(), expected, atol=1e-5, rtol=1e-4)

        def error(w, a=a, y=y):
            return float(((a @ w.detach().double().T - y) ** 2).mean())

        assert error(block.mlp.down_proj.weight) < 0.9 * error(before[i])
    # nothing to refit where the MLP kept its width: that block is left as it was
    same = copy.deepcopy(teacher)
    prune_mlp(PrunableModel.of(same), [torch.arange(96)] * 3)
    assert refit_down_proj(same, teacher, tokens, [0, 1, 2], 0.1, 4, torch.device("cpu"), False).blocks == []


# ------------------------------------------------------------------ training


def test_a_time_budget_ends_the_repair_in_time(trained_tiny_dir, text_dir, tmp_path):
    recipe = tmp_path / "r.yaml"
    budget = 0.2  # 12 seconds for thousands of steps
    recipe.write_text(
        prune_recipe(trained_tiny_dir, text_dir, PRUNE + distill_stage(5000, extra=f", max_minutes: {budget}, data: {{samples: 40}}"))
    )
    s = run(recipe, tmp_path / "out").manifest["stages"][1]["summary"]
    assert s["stopped_by"] == "max_minutes" and s["max_steps"] == 5000 and s["max_minutes"] == budget
    assert 3 <= s["steps"] < 5000 and s["tokens"] == s["steps"] * 2 * 64 and s["history"][-1]["step"] == s["steps"]
    assert s["loop_seconds"] <= budget * 60 + 3, s["loop_seconds"]  # 3 s: the spread of step times


def test_distillation_repairs_a_pruned_model_on_held_apart_text(trained_tiny_dir, text_dir, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(prune_recipe(trained_tiny_dir, text_dir, PRUNE + distill_stage(40, extra=", hidden_loss_weight: 0.5")))
    result = run(recipe, tmp_path / "out")
    s = result.manifest["stages"][1]["summary"]
    assert s["teacher"] == "the model before pruning" and s["hidden_loss_layers"] == 4
    assert s["tokens"] == 40 * 2 * 64 and s["processes"] == 1 and s["resumed_from_step"] is None
    assert [h["step"] for h in s["history"]] == [0, 10, 20, 30, 40]
    assert s["refit"] is None  # hidden channels were pruned: the least-squares refit does not run
    assert s["after"]["kl_divergence"] < 0.5 * s["before"]["kl_divergence"]
    # the pipeline's own evaluation (recipe evaluation text, against the loaded model) agrees it improved
    pruned_only = run_prune_only(trained_tiny_dir, text_dir, tmp_path)
    repaired = next(e for e in result.evaluations if e.artifact == "compressed").metrics["kl_divergence"]
    assert repaired < pruned_only
    assert not (tmp_path / "out.work").exists()


def test_cross_entropy_fine_tuning_under_a_token_budget(trained_tiny_dir, text_dir, tmp_path):
    """loss: ce trains on the text's next tokens, without running the teacher during the steps; max_tokens
    ends the run at the steps whose tokens fit (the cosine decay ends there) and says so."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(prune_recipe(trained_tiny_dir, text_dir, PRUNE + distill_stage(40, extra=", loss: ce, max_tokens: 2600")))
    result = run(recipe, tmp_path / "out")
    s = result.manifest["stages"][1]["summary"]
    assert s["stopped_by"] == "max_tokens" and s["max_tokens"] == 2600
    assert s["steps"] == 20 and s["tokens"] == 20 * 2 * 64 and s["history"][-1]["step"] == 20  # 2600 // 128
    assert s["training_data"]["chunks"] == 40  # only the chunks the budget reads
    losses = [h["loss"] for h in s["history"] if h["loss"] is not None]
    # the loss is the text's cross-entropy: its exp is near the student's perplexity on such text, not a KL near 0
    assert losses[-1] > 1.0 and s["history"][-1]["perplexity"] < 2 * math.exp(losses[-1])
    # the same steps under the KL loss train a different student (the loss changes the gradients)
    kl = tmp_path / "kl.yaml"
    kl.write_text(recipe.read_text().replace("loss: ce, ", ""))
    other = run(kl, tmp_path / "kl").manifest["stages"][1]["summary"]
    assert other["steps"] == 20 and other["after"]["kl_divergence"] != s["after"]["kl_divergence"]


def test_the_refit_runs_before_training_after_mlp_pruning(trained_tiny_dir, text_dir, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        prune_recipe(
            trained_tiny_dir,
            text_dir,
            "  - prune: {mlp: 0.25}\n" + distill_stage(4, extra=", max_minutes: 5, refit: {samples: 16, damp: 0.05}, data: {samples: 24}"),
        )
    )
    s = run(recipe, tmp_path / "out").manifest["stages"][1]["summary"]
    assert [h["step"] for h in s["history"]] == [0, 0, 4]  # before, after the refit, at the end
    r = s["refit"]
    assert r["blocks"] == [0, 1, 2, 3] and r["tokens"] == 16 * 64 and r["damp"] == 0.05 and r["seconds"] > 0
    assert r["kl_divergence"] < 0.5 * s["before"]["kl_divergence"]  # measured: 0.0014 -> 0.0001
    assert s["loop_seconds"] >= r["seconds"]  # the refit counts in the time budget


def test_keep_best_returns_the_start_when_training_makes_the_student_worse(trained_tiny_dir, text_dir, tmp_path):
    """Structured OBS makes a 75% MLP cut of the trained tiny model almost free; 20 steps at a high
    learning rate then raise the held-apart KL. keep_best returns the weights from before the first
    step (those the prune stage wrote); keep_best: false, the last step's."""
    prune = "  - prune: {mlp: 0.75, mlp_method: obs}\n"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(prune_recipe(trained_tiny_dir, text_dir, prune))
    run(recipe, tmp_path / "pruned")
    summaries, weights = {}, {}
    for keep in ("true", "false"):
        recipe.write_text(
            prune_recipe(trained_tiny_dir, text_dir, prune + distill_stage(20, extra=f", checkpoint_every: 0, keep_best: {keep}"))
        )
        summaries[keep] = run(recipe, tmp_path / keep).manifest["stages"][1]["summary"]
        weights[keep] = load_file(str(tmp_path / keep / "model" / "model.safetensors"))
    kept, last = summaries["true"], summaries["false"]
    kls = [[h["kl_divergence"] for h in s["history"]] for s in (kept, last)]
    assert kls[0] == kls[1]  # the same training; only what it returns differs
    start, end = kept["history"][0], kept["history"][-1]
    assert end["step"] == 20 and end["kl_divergence"] > 2 * start["kl_divergence"], kept["history"]  # measured 0.0005 -> 0.0624 -> 0.0218
    assert kept["kept_step"] == 0 and kept["after"]["kl_divergence"] == start["kl_divergence"]
    assert last["kept_step"] == 20 and last["after"]["kl_divergence"] == end["kl_divergence"]
    pruned = load_file(str(tmp_path / "pruned" / "model" / "model.safetensors"))
    assert weights["true"].keys() == pruned.keys()
    for k in pruned:
        assert torch.equal(weights["true"][k], pruned[k]), k
    assert any(not torch.equal(weights["false"][k], pruned[k]) for k in pruned)


def test_a_checkpoint_keeps_the_best_weights_it_has_not_reached_again(tmp_path):
    from torch import nn

    from compress.distill import checkpoint as ckpt

    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    best = [torch.randn(2, 3), torch.randn(2)]
    state = ckpt.TrainState(
        step=10, history=[{"step": 0, "kl_divergence": 0.1}, {"step": 10, "kl_divergence": 0.3}], best=0, best_weights=best
    )
    path = ckpt.save(tmp_path, model, opt.state_dict(), sched, state, fingerprint="f")
    back = ckpt.load(path, model, opt, sched, fingerprint="f")
    assert back.best == 0 and len(back.best_weights) == 2
    for a, b in zip(back.best_weights, best, strict=True):
        assert torch.equal(a, b)
    state.best, state.best_weights = 1, None  # the newest weights are the best: nothing more is written
    path = ckpt.save(tmp_path, model, opt.state_dict(), sched, state, fingerprint="f")
    back = ckpt.load(path, model, opt, sched, fingerprint="f")
    assert back.best == 1 and back.best_weights is None and not (path / ckpt.BEST_FILE).exists()


def run_prune_only(model: Path, texts: Path, tmp_path: Path) -> float:
    recipe = tmp_path / "prune-only.yaml"
    recipe.write_text(prune_recipe(model, texts, PRUNE))
    return next(e for e in run(recipe, tmp_path / "prune-only").evaluations if e.artifact == "compressed").metrics["kl_divergence"]


def test_distill_without_prune_uses_the_loaded_model_and_a_named_teacher(trained_tiny_dir, text_dir, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(prune_recipe(trained_tiny_dir, text_dir, distill_stage(3, extra=", train: all, autocast: bf16")))
    s = run(recipe, tmp_path / "a").manifest["stages"][0]["summary"]
    assert s["teacher"] == "the model as loaded" and s["before"]["kl_divergence"] == pytest.approx(0.0, abs=1e-6)
    # the student starts as its teacher: the KL's gradient is exactly zero, so three steps leave it there
    assert s["autocast"] == "bf16" and s["steps"] == 3 and s["tokens"] == 3 * 2 * 64
    assert s["after"]["kl_divergence"] == pytest.approx(0.0, abs=1e-4)
    sources = [str(text_dir / "doc2.txt"), str(text_dir)]  # another file, and the recipe's own source
    own_text = f", teacher: {trained_tiny_dir}, data: {{source: [{sources[0]}, {sources[1]}], samples: 5}}"
    recipe.write_text(prune_recipe(trained_tiny_dir, text_dir, PRUNE + distill_stage(3, extra=own_text)))
    s = run(recipe, tmp_path / "b").manifest["stages"][1]["summary"]
    assert s["teacher"] == str(trained_tiny_dir)
    assert s["training_data"] == {"source": sources, "chunks": 5, "seq_len": 64, "epochs": 1.2}


def test_distill_recipe_errors(trained_tiny_dir, text_dir, tmp_path):
    from compress.errors import CompressError, RecipeError
    from compress.recipe import load_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text(prune_recipe(trained_tiny_dir, text_dir, "  - quantize: {method: rtn, bits: 4, group_size: 32}\n" + distill_stage()))
    with pytest.raises(RecipeError, match=r"stages\[1\] \(distill\) comes after stages\[0\] \(quantize\)"):
        load_recipe(recipe)
    text = prune_recipe(trained_tiny_dir, text_dir, distill_stage()).replace("  evaluation:", "  #")
    recipe.write_text(text)
    with pytest.raises(RecipeError, match="needs data.evaluation"):
        load_recipe(recipe)
    recipe.write_text(prune_recipe(trained_tiny_dir, text_dir, distill_stage().replace("warmup_steps: 2", "warmup_steps: 40")))
    with pytest.raises(RecipeError, match="warmup_steps \\(40\\) must be fewer than steps \\(30\\)"):
        load_recipe(recipe)
    recipe.write_text(
        prune_recipe(trained_tiny_dir, text_dir, PRUNE + distill_stage(3, extra=f", hidden_loss_weight: 1.0, teacher: {trained_tiny_dir}"))
    )
    with pytest.raises(CompressError, match="hidden_loss_weight needs to know which teacher layer"):
        run(recipe, tmp_path / "c")
    # the refit runs by default where the mapping is known; asked for explicitly without one, it is an error
    recipe.write_text(
        prune_recipe(trained_tiny_dir, text_dir, PRUNE + distill_stage(3, extra=f", refit: {{samples: 4}}, teacher: {trained_tiny_dir}"))
    )
    with pytest.raises(CompressError, match="refit needs to know which teacher block"):
        run(recipe, tmp_path / "d")
    recipe.write_text(prune_recipe(trained_tiny_dir, text_dir, PRUNE + distill_stage(3, extra=", refit: {samples: 4}")))
    with pytest.raises(CompressError, match="no longer has once hidden channels are pruned"):
        run(recipe, tmp_path / "e")
    for extra, key in (
        (", loss: ce, stored_teacher: {top_k: 8}", "remove stored_teacher"),
        (", loss: ce, hidden_loss_weight: 0.5", "remove hidden_loss_weight"),
    ):
        recipe.write_text(prune_recipe(trained_tiny_dir, text_dir, PRUNE + distill_stage(3, extra=extra)))
        with pytest.raises(RecipeError, match=f"loss ce trains on the text alone.*{key}"):
            load_recipe(recipe)


def test_a_stored_teacher_trains_like_the_live_one_and_its_logits_are_reused_then_recomputed_for_new_data(
    trained_tiny_dir, text_dir, tmp_path, monkeypatch
):
    from compress.steps import exports

    recipe = tmp_path / "r.yaml"
    common = ", refit: null, checkpoint_every: 0, keep_best: false, data: {samples: 6}"
    recipe.write_text(prune_recipe(trained_tiny_dir, text_dir, PRUNE + distill_stage(6, extra=common)))
    live = run(recipe, tmp_path / "live").manifest["stages"][1]["summary"]
    assert live["stored_teacher"] is None
    stored_recipe = distill_stage(6, extra=common + ", stored_teacher: {top_k: 100000}")  # every token: the live KL
    recipe.write_text(prune_recipe(trained_tiny_dir, text_dir, PRUNE + stored_recipe))

    def fail(*_a, **_k):
        raise RuntimeError("stopped after the stages")

    monkeypatch.setattr(exports, "check", fail)  # a run that fails after training keeps its work folder
    with pytest.raises(RuntimeError, match="stopped after the stages"):
        run(recipe, tmp_path / "out")
    stored_files = list((tmp_path / "out.work" / "stages[1]" / "teacher").glob("*/*.safetensors"))
    assert len(stored_files) == 6  # one file per training chunk
    monkeypatch.undo()
    s = run(recipe, tmp_path / "out").manifest["stages"][1]["summary"]
    t = s["stored_teacher"]
    assert t["chunks_computed"] == 0 and t["chunks_reused"] == 6 and t["top_k"] == 400  # capped at the vocabulary
    assert not (tmp_path / "out.work").exists()  # removed with the checkpoints once the artifact is complete
    # the stored teacher with every token is the live teacher: the same training, up to float rounding
    for key in ("before", "after"):
        assert s[key]["kl_divergence"] == pytest.approx(live[key]["kl_divergence"], rel=1e-3)
    assert s["after"]["kl_divergence"] < s["before"]["kl_divergence"]
    recipe.write_text(recipe.read_text().replace("data: {samples: 6}", "data: {samples: 6, seed: 1}"))  # other chunks
    t = run(recipe, tmp_path / "other").manifest["stages"][1]["summary"]["stored_teacher"]
    assert t["chunks_computed"] == 6 and t["chunks_reused"] == 0


def test_a_stored_teacher_with_a_hidden_state_loss_or_refit_is_refused_with_exit_2(trained_tiny_dir, text_dir, tmp_path):
    recipe = tmp_path / "r.yaml"
    for extra, named in (
        (", hidden_loss_weight: 0.5", "hidden_loss_weight (0.5)"),
        (", refit: {samples: 4}", "refit"),
    ):
        recipe.write_text(prune_recipe(trained_tiny_dir, text_dir, PRUNE + distill_stage(3, extra=", stored_teacher: {top_k: 8}" + extra)))
        proc = cli("run", str(recipe), "-o", str(tmp_path / "out"))
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 2, out
        assert "stored_teacher" in out and named in out and "need a live teacher" in out and "Traceback" not in out


def test_gradient_accumulation_equals_the_larger_batch(trained_tiny_dir, text_dir, tmp_path):
    """Two micro-batches of 1 per step see the same chunks as one batch of 2 and, with equal token
    counts, average to the same gradient: the trained weights agree."""
    weights = {}
    for name, extra in (("big", ""), ("accum", ", grad_accum: 2")):
        recipe = tmp_path / f"{name}.yaml"
        stage = distill_stage(5, batch=2 if name == "big" else 1, extra=extra + ", checkpoint_every: 0")
        recipe.write_text(prune_recipe(trained_tiny_dir, text_dir, PRUNE + stage))
        result = run(recipe, tmp_path / name)
        assert result.manifest["stages"][1]["summary"]["tokens"] == 5 * 2 * 64
        weights[name] = load_file(str(tmp_path / name / "model" / "model.safetensors"))
    for k, v in weights["big"].items():
        torch.testing.assert_close(weights["accum"][k], v, atol=2e-5, rtol=1e-4, msg=k)


# ------------------------------------------------------------------ checkpoints


def checkpoint_recipe(model: Path, texts: Path, tmp_path: Path, steps: int) -> Path:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        prune_recipe(model, texts, PRUNE + distill_stage(steps, extra=", checkpoint_every: 10, data: {samples: 40}")).replace(
            "version: 1\n", "version: 1\ncompute: {threads: 1}\n"
        )
    )
    return recipe


def test_a_killed_run_resumes_from_its_checkpoint_to_the_same_weights(trained_tiny_dir, text_dir, tmp_path):
    steps = 400
    recipe = checkpoint_recipe(trained_tiny_dir, text_dir, tmp_path, steps)
    out = tmp_path / "out"
    proc = cli("run", str(recipe), "-o", str(out), "-q")
    deadline = time.time() + 120
    while not list((tmp_path / "out.work").glob("*/step-*/state.json")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed: " + proc.communicate()[0]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = json.loads(next((tmp_path / "out.work").glob("*/step-*/state.json")).read_text())["step"]
    assert 0 < killed_at < steps and not out.exists()

    again = cli("run", str(recipe), "-o", str(out), "-q")
    log, _ = again.communicate(timeout=300)
    assert again.returncode == 0, log
    manifest = json.loads((out / "manifest.json").read_text())
    s = manifest["stages"][1]["summary"]
    assert s["resumed_from_step"] >= killed_at and s["tokens"] == steps * 2 * 64
    assert "resumed at step" in " ".join(log.split()) and not (tmp_path / "out.work").exists()

    unbroken = cli("run", str(recipe), "-o", str(tmp_path / "unbroken"), "-q")
    log, _ = unbroken.communicate(timeout=300)
    assert unbroken.returncode == 0, log
    a, b = load_file(str(out / "model" / "model.safetensors")), load_file(str(tmp_path / "unbroken" / "model" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5, msg=k)


def test_a_checkpoint_of_another_run_is_refused(trained_tiny_dir, text_dir, tmp_path):
    from torch import nn

    from compress.distill import checkpoint as ckpt
    from compress.errors import CompressError
    from compress.fsutil import claim_work_directory
    from compress.marker import WORK

    recipe = checkpoint_recipe(trained_tiny_dir, text_dir, tmp_path, 12)
    claim_work_directory(tmp_path / "out.work", WORK)  # the work directory of another run of compress to this output
    work = tmp_path / "out.work" / "stages[1]"
    model = nn.Linear(2, 2)  # a checkpoint left by some other run under this output's work directory
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ckpt.save(work, model, opt.state_dict(), sched, ckpt.TrainState(step=10), fingerprint="another run")
    with pytest.raises(CompressError, match="checkpoint of a different run"):
        run(recipe, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ several processes


@pytest.mark.runtime
def test_two_cpu_processes_train_the_same_weights_as_one_with_the_same_global_batch(trained_tiny_dir, text_dir, tmp_path):
    one = tmp_path / "one.yaml"
    one.write_text(
        prune_recipe(trained_tiny_dir, text_dir, PRUNE + distill_stage(6, batch=4, extra=", checkpoint_every: 0")).replace(
            "version: 1\n", "version: 1\ncompute: {threads: 1}\n"
        )
    )
    two = tmp_path / "two.yaml"
    two.write_text(one.read_text().replace("batch_size: 4", "batch_size: 2"))
    single = cli("run", str(one), "-o", str(tmp_path / "one"), "-q")
    log, _ = single.communicate(timeout=300)
    assert single.returncode == 0, log
    accelerate = Path(sys.executable).with_name("accelerate")
    proc = subprocess.run(
        [
            str(accelerate),
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "-m",
            "compress",
            "run",
            str(two),
            "-o",
            str(tmp_path / "two"),
            "-q",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads((tmp_path / "two" / "manifest.json").read_text())["stages"][1]["summary"]
    assert s["processes"] == 2 and s["tokens"] == 6 * 2 * 2 * 64
    a = load_file(str(tmp_path / "one" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "two" / "model" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=2e-5, rtol=1e-4, msg=k)
    pruned = run_prune_weights(trained_tiny_dir, text_dir, tmp_path)
    changed = sum(not torch.equal(pruned[k], a[k]) for k in a)
    assert changed > 0  # training moved the weights (the comparison above is not of two untrained copies)


def launch(recipe: Path, out: Path, *flags: str, **kw) -> subprocess.Popen:
    """``accelerate launch`` of ``compress run`` in 2 CPU processes (gloo), with accelerate's ``flags``."""
    accelerate = Path(sys.executable).with_name("accelerate")
    args = [str(accelerate), "launch", *flags, "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"]
    args += ["--dynamo_backend", "no", "-m", "compress", "run", str(recipe), "-o", str(out), "-q"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, **kw)


FSDP = ("--use_fsdp", "--fsdp_version", "2")


@pytest.mark.runtime
@pytest.mark.minutes(0.9)
def test_fsdp_in_two_cpu_processes_trains_as_one_process_and_resumes_after_a_kill(trained_tiny_dir, text_dir, tmp_path):
    """accelerate's --use_fsdp: the student sharded over 2 gloo processes (FSDP2, a unit per block), killed
    after a checkpoint and started again; the same weights and the same loss curve as one process with
    the same global batch."""
    steps, extra = 40, ", checkpoint_every: 5, data: {samples: 40}"
    stage = distill_stage(steps, batch=4, extra=extra).replace("every: 10", "every: 5")
    one = tmp_path / "one.yaml"
    one.write_text(prune_recipe(trained_tiny_dir, text_dir, PRUNE + stage).replace("version: 1\n", "version: 1\ncompute: {threads: 1}\n"))
    two = tmp_path / "two.yaml"
    two.write_text(one.read_text().replace("batch_size: 4", "batch_size: 2"))
    single = cli("run", str(one), "-o", str(tmp_path / "one"), "-q")
    log, _ = single.communicate(timeout=300)
    assert single.returncode == 0, log

    out = tmp_path / "two"
    proc = launch(two, out, *FSDP)
    deadline = time.time() + 300
    while not list((tmp_path / "two.work").glob("*/step-*/state.json")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed: " + proc.communicate()[0]
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]  # the launcher and both processes
    for p in tree:
        p.kill()
    psutil.wait_procs(tree, timeout=30)
    proc.wait()
    killed_at = json.loads(next((tmp_path / "two.work").glob("*/step-*/state.json")).read_text())["step"]
    assert 0 < killed_at < steps and not out.exists()
    again = launch(two, out, *FSDP)
    log, _ = again.communicate(timeout=600)
    assert again.returncode == 0, log

    a_run = json.loads((tmp_path / "one" / "manifest.json").read_text())["stages"][1]["summary"]
    b_run = json.loads((out / "manifest.json").read_text())["stages"][1]["summary"]
    assert b_run["processes"] == 2 and b_run["parallel"] == "FSDP" and a_run["parallel"] == "one process"
    assert b_run["resumed_from_step"] >= killed_at and b_run["tokens"] == a_run["tokens"] == steps * 4 * 64
    # the loss and the held-apart KL at every evaluation: the same curve (the sums differ only in order)
    a_curve = [(p["step"], p["loss"], p["kl_divergence"]) for p in a_run["history"]]
    b_curve = [(p["step"], p["loss"], p["kl_divergence"]) for p in b_run["history"]]
    assert [p[0] for p in a_curve] == [p[0] for p in b_curve] and len(a_curve) > 5
    for (_, la, ka), (_, lb, kb) in zip(a_curve, b_curve, strict=True):
        assert (la is None) == (lb is None) and kb == pytest.approx(ka, rel=1e-3, abs=1e-5)
        if la is not None:
            assert lb == pytest.approx(la, rel=1e-3)
    a = load_file(str(tmp_path / "one" / "model" / "model.safetensors"))
    b = load_file(str(out / "model" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-4, rtol=1e-3, msg=k)


def run_prune_weights(model: Path, texts: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    recipe = tmp_path / "p.yaml"
    recipe.write_text(prune_recipe(model, texts, PRUNE))
    run(recipe, tmp_path / "p")
    return load_file(str(tmp_path / "p" / "model" / "model.safetensors"))


@pytest.mark.runtime
@pytest.mark.real_model
@pytest.mark.minutes(4.3)
def test_smollm2_prune_distill_recipe_exports_a_gguf_that_runs_in_llama_cpp(tmp_path):
    """recipes/prune-distill.yaml on reduced data and a short repair (refit, then 10 steps of 2 x 256 tokens at lr 1e-4):
    pruned, repaired (KL to the teacher falls on held-apart text), GPTQ W4 g32 asym, exported exactly to
    Q4_1 GGUF, run and scored in llama.cpp and gated."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (extra gguf) runs the GGUF export")
    from tests.helpers import run_cli

    out = tmp_path / "out"
    result = run_cli(
        [
            "run",
            ROOT / "recipes" / "prune-distill.yaml",
            "-o",
            out,
            "-q",
            "--set",
            "data.calibration.samples=16",
            "--set",
            "data.calibration.seq_len=256",
            "--set",
            "data.evaluation.samples=4",
            "--set",
            "stages.1.distill.steps=10",
            "--set",
            "stages.1.distill.max_minutes=null",
            "--set",
            "stages.1.distill.warmup_steps=2",
            "--set",
            "stages.1.distill.batch_size=2",
            "--set",
            "stages.1.distill.seq_len=256",
            "--set",
            "stages.1.distill.lr=1.0e-4",
            "--set",
            "stages.1.distill.eval.every=0",
            "--set",
            "stages.1.distill.autocast=off",
            "--set",
            "gates.0.max=2",
            "--set",
            "gates.1.max=2",
            "--set",
            "gates.2.min=0.3",
            # the int4 ONNX export of the same codes runs in test_onnx's recipe test (and after pruning, on the tiny
            # model in test_pruning): here the GGUF alone, gated twice
            "--set",
            "exports=[{format: gguf, name: q4_1, type: q4_1}]",
            "--set",
            "gates.1.artifact=q4_1",
        ]
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    prune, distill = manifest["stages"][0]["summary"], manifest["stages"][1]["summary"]
    assert prune["after"]["intermediate_size"] == 1152
    assert distill["after"]["kl_divergence"] < distill["before"]["kl_divergence"] and distill["tokens"] == 10 * 2 * 256
    # the least-squares refit ran first, on the 20 training chunks the 10 steps of 2 read, and already lowered the KL
    assert len(distill["refit"]["blocks"]) == 30 and distill["refit"]["tokens"] == 20 * 256
    assert distill["refit"]["kl_divergence"] < distill["before"]["kl_divergence"]
    assert distill["after"]["kl_divergence"] < distill["refit"]["kl_divergence"]  # and the 10 steps lowered it further
    entries = {e["name"]: e for e in manifest["exports"]}
    assert list(entries) == ["q4_1"] and entries["q4_1"]["records_exact"] == 210
    report = json.loads((out / "report.json").read_text())
    evals = {e["artifact"]: e for e in report["evaluations"]}
    assert evals["q4_1"]["runtime"] == "llama.cpp"
    assert evals["q4_1"]["details"]["same_weights_kl"] < 0.02
    assert abs(evals["q4_1"]["metrics"]["kl_divergence"] - evals["compressed"]["metrics"]["kl_divergence"]) < 0.1
