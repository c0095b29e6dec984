"""Distillation losses: pure functions on tensors.

* :func:`kl_loss` — forward KL(teacher || student) of the next-token distributions at
  temperature ``T``, averaged over tokens and scaled by T² (so gradients keep their size when T
  changes, as in Hinton et al.). It works through the positions a block of rows at a time and
  keeps its closed-form gradient, ``T · (softmax(s/T) - softmax(t/T)) / N``, instead of letting
  autograd record every full-vocabulary intermediate: about half the time of the plain
  formulation on a 49k vocabulary, with the same value and gradient (tests/test_distill.py).
* :func:`topk_log_probs` and :func:`topk_kl_loss` — the same KL against a *stored* teacher: per
  position the teacher's k most likely tokens (log-probs at temperature T and token ids) and the log
  of the probability left over the rest of the vocabulary, as one bucket. The loss is the KL over
  those k + 1 outcomes, ``Σ_K p_t (log p_t - log p_s) + r_t (log r_t - log r_s)`` with ``r`` the
  mass outside the top k, scaled by T²; its gradient is ``T · (p_s - q) / N`` where ``q`` is the
  teacher on the top k and the teacher's rest mass shared over the other tokens in the student's
  proportions. With k = vocabulary, r_t = 0 and it is :func:`kl_loss` exactly (up to float
  rounding; tests/test_distill.py). Only the student's logits are full-vocabulary.
* :func:`hidden_loss` — on mapped layers, the squared error between student and teacher hidden
  states relative to the teacher's squared norm (scale-free across layers), averaged over layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

KL_ROWS = 64  # positions per block of the KL loss: a few float32 [rows, vocab] temporaries stay small


class _ForwardKL(torch.autograd.Function):
    """T² · mean over rows of KL(softmax(t/T) || softmax(s/T)) for [rows, vocab] logits; the
    gradient for ``s`` is worked out block by block in the forward pass and kept in ``s``'s dtype."""

    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:  # type: ignore[override]
        rows = student.shape[0]
        grad = torch.empty_like(student) if ctx.needs_input_grad[0] else None
        total = torch.zeros((), dtype=torch.float64, device=student.device)
        for start in range(0, rows, KL_ROWS):
            s, t = student[start : start + KL_ROWS].float(), teacher[start : start + KL_ROWS].float()
            if temperature != 1.0:
                s, t = s / temperature, t / temperature
            log_pt, log_ps = torch.log_softmax(t, dim=-1), torch.log_softmax(s, dim=-1)
            p_t = log_pt.exp()
            total += (p_t * (log_pt - log_ps)).sum(dtype=torch.float64)
            if grad is not None:  # d(T² KL)/ds = T (p_s - p_t), per row
                grad[start : start + KL_ROWS] = log_ps.exp_().sub_(p_t).mul_(temperature / rows)
        ctx.save_for_backward(grad)
        return (total * temperature**2 / rows).float()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return (None if grad is None else grad * grad_out.to(grad.dtype)), None, None


def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[..., vocab]`` logits -> scalar: T² · mean over positions of KL(p_teacher,T || p_student,T).
    No gradient flows to the teacher's logits."""
    vocab = student_logits.shape[-1]
    return _ForwardKL.apply(student_logits.reshape(-1, vocab), teacher_logits.detach().reshape(-1, vocab), temperature)


def topk_log_probs(teacher_logits: torch.Tensor, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[..., vocab]`` logits -> (values [..., k] float32: log-probs at ``temperature`` of the k most
    likely tokens, indices [..., k] int32, rest [...] float32: log of the probability of every other
    token, -inf when k covers the vocabulary). k is capped at the vocabulary."""
    vocab = teacher_logits.shape[-1]
    k = min(k, vocab)
    flat = teacher_logits.detach().reshape(-1, vocab)
    values, indices, rest = [], [], []
    for start in range(0, flat.shape[0], KL_ROWS):
        logp = torch.log_softmax(flat[start : start + KL_ROWS].float() / temperature, dim=-1)
        top = torch.topk(logp, k, dim=-1)
        values.append(top.values)
        indices.append(top.indices.to(torch.int32))
        rest.append(torch.logsumexp(logp.scatter(-1, top.indices, float("-inf")), dim=-1))
    shape = teacher_logits.shape[:-1]
    return torch.cat(values).reshape(*shape, k), torch.cat(indices).reshape(*shape, k), torch.cat(rest).reshape(shape)


class _TopKKL(torch.autograd.Function):
    """T² · mean over rows of the KL over (top k, rest) between a stored teacher and the student's
    ``[rows, vocab]`` logits; the gradient is worked out block by block in the forward pass."""

    @staticmethod
    def forward(
        ctx, student: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, rest: torch.Tensor, temperature: float
    ) -> torch.Tensor:  # type: ignore[override]
        rows = student.shape[0]
        grad = torch.empty_like(student) if ctx.needs_input_grad[0] else None
        total = torch.zeros((), dtype=torch.float64, device=student.device)
        for start in range(0, rows, KL_ROWS):
            end = start + KL_ROWS
            s = student[start:end].float()
            if temperature != 1.0:
                s = s / temperature
            log_ps = torch.log_softmax(s, dim=-1)
            idx = indices[start:end].long()
            log_pt, log_rt = values[start:end].float(), rest[start:end].float()
            log_ps_k = log_ps.gather(-1, idx)
            outside = log_ps.scatter(-1, idx, float("-inf"))
            log_rs = torch.logsumexp(outside, dim=-1)
            p_t, r_t = log_pt.exp(), log_rt.exp()
            term_rest = torch.where(r_t > 0, r_t * (log_rt - log_rs), torch.zeros_like(r_t))
            total += (p_t * (log_pt - log_ps_k)).sum(dtype=torch.float64) + term_rest.sum(dtype=torch.float64)
            if grad is not None:  # d(T² KL)/ds = T (p_s - q): q = p_t on the top k, r_t · p_s / r_s elsewhere
                share = torch.where(r_t > 0, (log_rt - log_rs).exp(), torch.zeros_like(r_t))
                g = log_ps.exp() - outside.exp() * share.unsqueeze(-1)
                g.scatter_add_(-1, idx, -p_t)
                grad[start:end] = g.mul_(temperature / rows)
        ctx.save_for_backward(grad)
        return (total * temperature**2 / rows).float()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return (None if grad is None else grad * grad_out.to(grad.dtype)), None, None, None, None


def topk_kl_loss(
    student_logits: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, rest: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``[..., vocab]`` student logits and a stored teacher (:func:`topk_log_probs` at the same
    ``temperature``) -> scalar: T² · mean over positions of the KL over the top k and the rest."""
    vocab, k = student_logits.shape[-1], values.shape[-1]
    return _TopKKL.apply(student_logits.reshape(-1, vocab), values.reshape(-1, k), indices.reshape(-1, k), rest.reshape(-1), temperature)


def hidden_loss(
    student: Sequence[torch.Tensor],
    teacher: Sequence[torch.Tensor],
    layer_map: Sequence[tuple[int, int]],
    channels: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over ``layer_map`` pairs ``(student_index, teacher_index)`` of
    ``|h_s - h_t[..., channels]|² / |h_t[..., channels]|²`` (``channels`` maps student channels
    to teacher channels when the embedding was pruned)."""
    terms = []
    for s_i, t_i in layer_map:
        hs, ht = student[s_i].float(), teacher[t_i].float()
        if channels is not None:
            ht = ht.index_select(-1, channels.to(ht.device))
        terms.append((hs - ht).pow(2).sum() / ht.pow(2).sum().clamp(min=1e-12))
    return torch.stack(terms).mean()


def lr_factor(step: int, warmup: int, total: int, final_ratio: float) -> float:
    """Learning-rate multiplier at optimizer step ``step`` (0-based): linear warmup over
    ``warmup`` steps, then cosine decay from 1 to ``final_ratio`` at ``total``."""
    import math

    if step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return final_ratio + (1 - final_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class CosineSchedule:
    """:func:`lr_factor` as a ``LambdaLR`` function whose ``total`` can be set again while training
    runs (a time budget plans how many steps fit; the decay then ends at that step)."""

    warmup: int
    total: int
    final_ratio: float

    def __call__(self, step: int) -> float:
        return lr_factor(step, self.warmup, self.total, self.final_ratio)
