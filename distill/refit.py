"""The closed-form first phase of a distillation repair: each pruned MLP's down projection is
fitted by least squares so that the student's MLP, fed the teacher's own hidden states, gives the
teacher's MLP output.

A block whose MLP lost neurons can still express much of what the removed part did: the kept
neurons' activations correlate with the removed ones. For student block j matched to teacher
block t, with r the teacher's residual stream entering t's MLP, a = the student's gated
activations on r (its own norm, gate and up projections) and y = teacher block t's MLP output,
the new down projection is

    W = argmin ||a Wᵀ − y||² + λ ||W − W₀||²,   λ = damp · mean(diag(aᵀa))

(ridge towards the pruned weights W₀), solved from the sums aᵀa and aᵀy over the samples in one
forward pass of the teacher. Only the teacher's inputs are used, never the student's own
(drifted) ones: a fit that also corrects the upstream drift matched the calibration text's
domain and made other text worse. This is the local reconstruction ZipLM and SlimGPT make part
of pruning; here it is part of the repair, so the gap pruning opened is measured before it.

It needs the teacher's hidden channels, so the stage runs it only when they were not pruned. On
the trained 4-block tiny Llama of the tests, with 25% of the MLP neurons pruned, the fit took the
KL to the teacher from 0.0014 to 0.0001 (MLP alone) and from 0.450 to 0.447 (heads halved too);
done on the kept channels after pruning 96 to 64 channels it raised it (0.29 -> 0.36, and 0.52 ->
0.61 with heads halved): that student's own hidden states are far from the teacher's."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from compress.errors import CompressError
from compress.pruning.arch import PrunableModel


@dataclass
class RefitReport:
    blocks: list[int]  # student blocks whose down projection was refitted
    tokens: int
    seconds: float


def refit_targets(student: nn.Module, teacher: nn.Module, layers: list[int]) -> list[int]:
    """Student blocks whose MLP differs in shape from its teacher block's (nothing to refit elsewhere)."""
    sp, tp = PrunableModel.of(student), PrunableModel.of(teacher)
    return [j for j, t in enumerate(layers) if sp.down_proj(sp.blocks[j]).weight.shape != tp.down_proj(tp.blocks[t]).weight.shape]


def refit_down_proj(
    student: nn.Module,
    teacher: nn.Module,
    tokens: torch.Tensor,
    layers: list[int],
    damp: float,
    batch_size: int,
    device: torch.device,
    bf16: bool,
    progress: Callable[..., Iterable] | None = None,
) -> RefitReport:
    """Refit the down projections of :func:`refit_targets` in place (see the module docstring).
    ``layers[j]``: the teacher block of student block j (both with the same hidden channels);
    ``tokens``: [samples, seq] token ids."""
    started = time.perf_counter()
    sp, tp = PrunableModel.of(student), PrunableModel.of(teacher)
    if sp.hidden_size != tp.hidden_size:
        raise CompressError(f"the least-squares refit needs the teacher's hidden size ({tp.hidden_size}); the student has {sp.hidden_size}")
    targets = refit_targets(student, teacher, layers)
    if not targets:
        return RefitReport([], 0, 0.0)
    width = {j: sp.down_proj(sp.blocks[j]).in_features for j in targets}
    gram = {j: torch.zeros(width[j], width[j], dtype=torch.float64) for j in targets}
    cross = {j: torch.zeros(width[j], sp.hidden_size, dtype=torch.float64) for j in targets}
    residual: dict[int, torch.Tensor] = {}
    handles = []

    def on_residual(j: int) -> Callable:
        def hook(_m: nn.Module, args: tuple) -> None:
            residual[j] = args[0]

        return hook

    def on_mlp(j: int) -> Callable:
        block = sp.blocks[j]
        down = sp.down_proj(block)

        def hook(_m: nn.Module, _args: tuple, out: torch.Tensor) -> None:
            seen = []
            grab = down.register_forward_pre_hook(lambda _d, a: seen.append(a[0]))
            try:
                block.mlp(sp.block_norms(block)[1](residual.pop(j)))
            finally:
                grab.remove()
            with torch.autocast(device.type, enabled=False):  # the sums in float32 (the forward may run in bf16)
                a = seen[0].reshape(-1, width[j]).float()
                y = out.reshape(a.shape[0], -1).float()
                if down.bias is not None:
                    y = y - down.bias.float()
                gram[j] += (a.T @ a).double().cpu()
                cross[j] += (a.T @ y).double().cpu()

        return hook

    for j in targets:
        t_block = tp.blocks[layers[j]]
        handles.append(tp.block_norms(t_block)[1].register_forward_pre_hook(on_residual(j)))
        handles.append(t_block.mlp.register_forward_hook(on_mlp(j)))
    batches = list(tokens.split(batch_size))
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            for ids in progress(batches, "distill: least-squares refit", len(batches)) if progress else batches:
                tp.base(input_ids=ids.to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        for j in targets:
            weight = sp.down_proj(sp.blocks[j]).weight
            w0 = weight.detach().double().cpu()
            lam = damp * gram[j].diagonal().mean()
            eye = torch.eye(width[j], dtype=torch.float64)
            solved = torch.linalg.solve(gram[j] + lam * eye, cross[j] + lam * w0.T).T
            weight.copy_(solved.to(weight.dtype))
    return RefitReport(targets, int(tokens.numel()), time.perf_counter() - started)
