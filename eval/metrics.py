"""Accuracy metrics of a model against the unmodified (baseline) model, over evaluation chunks, and the
``Evaluation`` record every measurement is reported as.

The metric math is below the exports and the repair loop in the layers (their verifiers score on it),
so this module imports only torch, numpy and the schema.

For every chunk, position ``t`` predicts token ``t+1``. Only targets with at least
``min_context`` tokens before them are scored, so every scored prediction has a real
context prefix; every metric set reports how many tokens it scored.

* perplexity: ``exp(mean NLL)`` of the true next token;
* kl_divergence: mean over scored positions of ``KL(P_baseline || P_model)`` in nats;
* kl_divergence_p99: its 99th percentile over positions (tail damage the mean hides);
* top1_agreement: share of positions where both models' most likely token is the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from compress.schema.metrics import ACCURACY_METRICS, DEVICE_METRICS, LATENCY_METRICS, METRICS, MetricInfo  # noqa: F401 - re-exported

Forward = Callable[[torch.Tensor], torch.Tensor]
"""Maps token ids [batch, seq] to logits [batch, seq, vocab] for one artifact on its runtime."""


@dataclass
class Accumulator:
    """Running sums for one artifact; ``result()`` turns them into the metrics dict."""

    nll_sum: float = 0.0
    agree: int = 0
    tokens: int = 0
    kl: list[torch.Tensor] = field(default_factory=list)

    def update(self, base_logp: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """``base_logp``/``logits`` [n, vocab] at scored positions; ``targets`` [n]."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        self.nll_sum += float(-logp.gather(-1, targets.unsqueeze(-1)).sum())
        kl = (base_logp.exp() * (base_logp - logp)).sum(-1).clamp_(min=0.0)
        self.kl.append(kl.cpu())
        self.agree += int((logp.argmax(-1) == base_logp.argmax(-1)).sum())
        self.tokens += int(targets.numel())

    def result(self) -> dict[str, float | int]:
        if self.tokens == 0:
            raise ValueError("no tokens were scored")
        kl = torch.cat(self.kl).double()
        return {
            "perplexity": math.exp(self.nll_sum / self.tokens),
            "kl_divergence": float(kl.mean()),
            "kl_divergence_p99": float(np.quantile(kl.numpy(), 0.99)),
            "top1_agreement": self.agree / self.tokens,
            "tokens_scored": self.tokens,
        }


def scored_positions(seq_len: int, min_context: int) -> slice:
    """Logit positions whose next-token target has at least ``min_context`` tokens before it."""
    return slice(min_context - 1, seq_len - 1)


def compare(
    baseline: Forward,
    candidates: dict[str, Forward],
    chunks: torch.Tensor,
    min_context: int,
    batch_size: int = 1,
    progress: Callable[[Iterable[int], str, int], Iterable[int]] | None = None,
) -> dict[str, dict[str, float | int]]:
    """Score the baseline and every candidate on ``chunks`` [n, seq_len] in one pass.

    Each batch runs through the baseline once and then through each candidate, so only one
    batch of logits per model is alive at a time. Returns metrics per name, with the baseline
    under ``"baseline"`` (its KL is 0 and top-1 agreement 1 by definition).
    """
    n, seq_len = chunks.shape
    pos = scored_positions(seq_len, min_context)
    accs = {"baseline": Accumulator(), **{name: Accumulator() for name in candidates}}
    starts = range(0, n, batch_size)
    if progress is not None:
        starts = progress(starts, "evaluating", len(starts))
    with torch.inference_mode():
        for start in starts:
            batch = chunks[start : start + batch_size]
            targets = batch[:, pos.start + 1 : pos.stop + 1].reshape(-1)
            base_logits = baseline(batch)[:, pos].float()
            vocab = base_logits.shape[-1]
            base_logp = torch.log_softmax(base_logits.reshape(-1, vocab), dim=-1)
            accs["baseline"].update(base_logp, base_logits.reshape(-1, vocab), targets)
            for name, forward in candidates.items():
                logits = forward(batch)[:, pos].float().reshape(-1, vocab)
                accs[name].update(base_logp, logits, targets)
    return {name: acc.result() for name, acc in accs.items()}


def torch_forward(model: torch.nn.Module, device: torch.device) -> Forward:
    """Forward function for an in-memory transformers causal LM."""

    def forward(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids.to(device), use_cache=False).logits.cpu()

    return forward


@dataclass
class Evaluation:
    """Metrics of one artifact, measured on one runtime and device."""

    artifact: str
    runtime: str
    device: str
    metrics: dict[str, float | int]
    source: str = "measured"  # or "estimated"
    details: dict[str, Any] | None = None
    kind: str = "accuracy"  # accuracy | latency | memory | kv_cache
    profile: str | None = None  # the device profile it stands for (None: this machine)

    def to_json(self) -> dict[str, Any]:
        out = {
            "artifact": self.artifact,
            "runtime": self.runtime,
            "device": self.device,
            "source": self.source,
            "kind": self.kind,
            "metrics": self.metrics,
        }
        if self.profile is not None:
            out["profile"] = self.profile
        if self.details:
            out["details"] = self.details
        return out
