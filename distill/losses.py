"""Distillation losses: pure functions on tensors.

* :func:`kl_loss` — forward KL(teacher || student) of the next-token distributions at
  temperature ``T``, averaged over tokens and scaled by T² (so gradients keep their size when T
  changes, as in Hinton et al.).
* :func:`hidden_loss` — on mapped layers, the squared error between student and teacher hidden
  states relative to the teacher's squared norm (scale-free across layers), averaged over layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[..., vocab]`` logits -> scalar: T² · mean over positions of KL(p_teacher,T || p_student,T)."""
    vocab = student_logits.shape[-1]
    s = torch.log_softmax(student_logits.float().reshape(-1, vocab) / temperature, dim=-1)
    t = torch.log_softmax(teacher_logits.float().reshape(-1, vocab) / temperature, dim=-1)
    kl = torch.nn.functional.kl_div(s, t, log_target=True, reduction="batchmean")
    return kl * temperature**2


def hidden_loss(student: Sequence[torch.Tensor], teacher: Sequence[torch.Tensor], layer_map: Sequence[tuple[int, int]],
                channels: torch.Tensor | None = None) -> torch.Tensor:
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
