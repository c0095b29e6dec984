"""Structured optimal brain surgeon for MLP neurons (the selection ZipLM and SlimGPT make): which
neurons to remove so that the kept ones, with their down-projection columns updated, stand in for
them best; and that update.

With a = the gated activations feeding ``down_proj`` (the inputs of its columns) on calibration
text, G = Σ aᵀa and H = G + λI (λ = damp · mean(diag G)), removing the columns R of the weight W
and updating the kept ones optimally changes the block's output by the least possible

    E(R) = tr(W_R (H⁻¹_RR)⁻¹ W_Rᵀ)      (the squared output error summed over the calibration tokens,
                                          plus λ times the squared weight change),

and the updated weight is W − W_R (H⁻¹_RR)⁻¹ H⁻¹_R,: — the same weight as the ridge least-squares
refit of the kept columns towards their old values (distill/refit.py on this text, with the
teacher's own MLP output as the target). The greedy search removes, ``block`` at a time, the
neurons of smallest single-removal error ‖W_:,j‖² / H⁻¹_jj, then updates W and H⁻¹ (a rank-
``block`` downdate, so H is inverted once per layer).

A neuron whose output the others can reproduce goes first, whatever its magnitude; the magnitude
criterion (importance.py) keeps a neuron for being large even when it is redundant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ObsCut:
    kept: torch.Tensor  # [keep] indices of the kept neurons, ascending
    weight: torch.Tensor  # [out, keep] the updated down-projection columns of the kept neurons (float64, CPU)
    removed: torch.Tensor  # [d - keep] indices in the order the search removed them


def obs_cut(gram: torch.Tensor, weight: torch.Tensor, keep: int, damp: float, block: int = 8) -> ObsCut:
    """Choose ``keep`` of the d columns of ``weight`` ([out, d]) given ``gram`` ([d, d], Σ aᵀa over
    the calibration tokens) and update them; see the module docstring. Computes in float64."""
    d = weight.shape[1]
    if gram.shape != (d, d):
        raise ValueError(f"gram is {tuple(gram.shape)}, the weight has {d} columns")
    if not 0 < keep <= d:
        raise ValueError(f"keep must be in 1..{d}, got {keep}")
    h = gram.double().clone()
    h.diagonal().add_(damp * float(h.diagonal().mean()))
    try:
        chol = torch.linalg.cholesky(h)
    except torch.linalg.LinAlgError:
        raise ValueError("the activations' Gram matrix plus damping is not positive definite; raise damp") from None
    hinv = torch.cholesky_inverse(chol)
    w = weight.detach().double().cpu().clone()  # the model may sit on a GPU; the Gram sums are on the CPU
    alive = torch.ones(d, dtype=torch.bool)
    removed: list[int] = []
    while len(removed) < d - keep:
        score = (w * w).sum(0) / hinv.diagonal()
        score[~alive] = float("inf")
        take = min(block, d - keep - len(removed))
        s = torch.topk(score, take, largest=False).indices
        hs = hinv[s]  # [take, d]: rows of H⁻¹ for the removed set (H⁻¹ is symmetric)
        solve = torch.linalg.solve(hs[:, s], hs)  # (H⁻¹_SS)⁻¹ H⁻¹_S,:
        w -= w[:, s] @ solve
        hinv -= hs.T @ solve
        w[:, s] = 0.0
        hinv[s, :] = 0.0
        hinv[:, s] = 0.0
        hinv[s, s] = 1.0  # dead columns: finite diagonal, never chosen again (score inf)
        alive[s] = False
        removed += s.tolist()
    kept = alive.nonzero().squeeze(1)
    return ObsCut(kept=kept, weight=w[:, kept], removed=torch.tensor(removed, dtype=torch.long))
