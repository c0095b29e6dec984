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

Perplexity, KL divergence and top-1 agreement also get a 95% interval: a percentile bootstrap over
the evaluation sequences (each resample draws as many sequences as were scored, with replacement,
and recomputes the token-weighted metric; 1000 resamples, a fixed seed), since positions within a
sequence are not independent. Fewer than two sequences give no interval.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from compress import streaming

Forward = Callable[[torch.Tensor], Any]
"""Maps token ids [batch, seq] to logits [batch, seq, vocab] for one artifact on its runtime, or to
``Logits`` that make them a row and a chunk of positions at a time: a torch model's final
``HiddenStates`` and head, or a runtime's (llama.cpp's ``DecodedLogits``)."""


INTERVAL_LEVEL = 0.95
BOOTSTRAP_RESAMPLES = 1000
INTERVAL_METHOD = f"percentile bootstrap over sequences, {BOOTSTRAP_RESAMPLES} resamples"


class Scores(dict):
    """One artifact's metrics (name -> number, as before) and, in ``intervals``, the 95% interval of
    each metric that has one: name -> {lower, upper, level, method, samples}."""

    def __init__(self, metrics: dict[str, float | int], intervals: dict[str, dict[str, Any]] | None = None) -> None:
        super().__init__(metrics)
        self.intervals: dict[str, dict[str, Any]] = intervals or {}


def bootstrap_intervals(
    nll: np.ndarray, kl: np.ndarray, agree: np.ndarray, tokens: np.ndarray, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> dict[str, dict[str, Any]]:
    """95% percentile-bootstrap intervals of perplexity, KL divergence and top-1 agreement from
    per-sequence sums (NLL, KL, agreeing positions) and scored token counts; {} for < 2 sequences."""
    n = len(tokens)
    if n < 2:
        return {}
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    count = tokens[idx].sum(axis=1)
    draws = {
        "perplexity": np.exp(nll[idx].sum(axis=1) / count),
        "kl_divergence": kl[idx].sum(axis=1) / count,
        "top1_agreement": agree[idx].sum(axis=1) / count,
    }
    return {name: percentile_interval(values, n) for name, values in draws.items()}


def percentile_interval(draws: np.ndarray, samples: int, method: str = INTERVAL_METHOD) -> dict[str, Any]:
    """The 95% percentile interval of bootstrap ``draws`` of a metric over ``samples`` units (sequences, prompts)."""
    tail = (1 - INTERVAL_LEVEL) / 2 * 100
    return {
        "lower": float(np.percentile(draws, tail)),
        "upper": float(np.percentile(draws, 100 - tail)),
        "level": INTERVAL_LEVEL,
        "method": method,
        "samples": samples,
    }


@dataclass
class Accumulator:
    """Running sums for one artifact, overall and per sequence; ``result()`` turns them into Scores.
    A sequence may come in several pieces (``update`` per chunk of positions, then ``end_row``)."""

    nll_sum: float = 0.0
    agree: int = 0
    tokens: int = 0
    kl: list[torch.Tensor] = field(default_factory=list)
    rows_nll: list[float] = field(default_factory=list)
    rows_agree: list[int] = field(default_factory=list)
    rows_tokens: list[int] = field(default_factory=list)
    rows_kl: list[float] = field(default_factory=list)
    _row: list[float] = field(default_factory=lambda: [0.0, 0.0, 0, 0])  # nll, kl, agree, tokens of the open row

    def update(self, base_logp: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """``base_logp``/``logits`` [n, vocab] at n scored positions of the open sequence; ``targets`` [n]."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        nll = -logp.gather(-1, targets.to(logp.device).unsqueeze(-1)).squeeze(-1)
        kl = (base_logp.exp() * (base_logp - logp)).sum(-1).clamp_(min=0.0)
        agree = logp.argmax(-1) == base_logp.argmax(-1)
        del logp
        self.kl.append(kl.cpu())
        self.nll_sum += float(nll.double().sum())
        self.agree += int(agree.sum())
        self.tokens += int(targets.numel())
        row = self._row
        row[0] += float(nll.double().sum())
        row[1] += float(kl.double().sum())
        row[2] += int(agree.sum())
        row[3] += int(targets.numel())

    def end_row(self) -> None:
        nll, kl, agree, tokens = self._row
        self.rows_nll.append(nll)
        self.rows_kl.append(kl)
        self.rows_agree.append(agree)
        self.rows_tokens.append(tokens)
        self._row = [0.0, 0.0, 0, 0]

    def result(self) -> Scores:
        if self.tokens == 0:
            raise ValueError("no tokens were scored")
        kl = torch.cat(self.kl).double()
        metrics = {
            "perplexity": math.exp(self.nll_sum / self.tokens),
            "kl_divergence": float(kl.mean()),
            "kl_divergence_p99": float(np.quantile(kl.numpy(), 0.99)),
            "top1_agreement": self.agree / self.tokens,
            "tokens_scored": self.tokens,
        }
        per_row = [np.asarray(x, dtype=np.float64) for x in (self.rows_nll, self.rows_kl, self.rows_agree, self.rows_tokens)]
        return Scores(metrics, bootstrap_intervals(*per_row))


CHUNK_ELEMENTS = 2**23
"""Logits built at once while scoring: positions x vocabulary (8M floats, 32 MB a buffer), so the
per-batch vocabulary buffers stay bounded on large vocabularies (151,936 tokens: 55 positions)."""


class Logits:
    """The logits of a batch, made on demand: ``logits(row, positions)`` [positions, vocab], asked
    row by row in order; ``hold()`` brackets all the asks of one batch."""

    def logits(self, row: int, positions: slice) -> torch.Tensor:
        raise NotImplementedError

    def hold(self) -> Any:
        return contextlib.nullcontext()


class HiddenStates(Logits):
    """A model's final hidden states [batch, seq, hidden] and the head that turns some of them into
    logits: ``compare`` makes the logits a chunk of positions at a time instead of a whole batch of
    batch x seq x vocab floats."""

    def __init__(self, hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], hold: Callable[[], Any] | None = None) -> None:
        self.hidden, self.head, self._hold = hidden, head, hold

    def logits(self, row: int, positions: slice) -> torch.Tensor:
        # A 2-D slice: torch's CPU linear (2.13) on a 3-D view whose batch stride is not seq x hidden (a row
        # of a longer batch) takes a slow path that copies the whole head weight every call (docs/models-and-data.md).
        return self.head(self.hidden[row, positions])

    def full(self) -> torch.Tensor:
        """Every position's logits at once [batch, seq, vocab] (tests and small models; ``compare`` chunks)."""
        with self.hold():
            return self.head(self.hidden)

    def hold(self) -> Any:
        """A context that keeps the head's weights in memory while chunks are made (streamed heads)."""
        return self._hold() if self._hold is not None else contextlib.nullcontext()


def _logits(out: torch.Tensor | Logits, row: int, positions: slice) -> torch.Tensor:
    if isinstance(out, Logits):
        return out.logits(row, positions).float()
    return out[row, positions].float()


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
) -> dict[str, Scores]:
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
            outs = {"baseline": baseline(batch), **{name: forward(batch) for name, forward in candidates.items()}}
            with contextlib.ExitStack() as held:
                for out in outs.values():
                    if isinstance(out, Logits):
                        held.enter_context(out.hold())
                vocab = _logits(outs["baseline"], 0, slice(pos.start, pos.start + 1)).shape[-1]
                step = max(1, CHUNK_ELEMENTS // vocab)
                for row in range(int(batch.shape[0])):
                    for first in range(pos.start, pos.stop, step):
                        piece = slice(first, min(first + step, pos.stop))
                        targets = batch[row, piece.start + 1 : piece.stop + 1]
                        base_logits = _logits(outs["baseline"], row, piece)
                        base_logp = torch.log_softmax(base_logits, dim=-1)
                        accs["baseline"].update(base_logp, base_logits, targets)
                        del base_logits
                        for name in candidates:
                            accs[name].update(base_logp, _logits(outs[name], row, piece).to(base_logp.device), targets)
                    for acc in accs.values():
                        acc.end_row()
            del outs
    scores = {name: acc.result() for name, acc in accs.items()}
    base = scores["baseline"]  # its KL (0) and top-1 agreement (1) hold by definition: no interval
    base.intervals = {k: v for k, v in base.intervals.items() if k == "perplexity"}
    return scores


def torch_forward(model: torch.nn.Module, device: torch.device) -> Forward:
    """Forward function for an in-memory (or streamed) transformers causal LM: its final hidden
    states, and its output head (with Gemma 2's logit soft-capping) to make logits a few positions
    at a time."""

    def forward(ids: torch.Tensor) -> HiddenStates:
        return with_head(model, final_hidden(model, ids, device), device)

    return forward


def tables_forward(model: torch.nn.Module, device: torch.device, embedding: torch.Tensor | None, head: torch.Tensor | None) -> Forward:
    """``model``'s forward with another token-embedding table and/or output head (None: the model's
    own): an export's quantized tables, dequantized, for its same-weights check. The model is not
    changed; a scaled embedding (Gemma's ``embed_scale``) keeps its scale."""
    module = model.get_input_embeddings()
    dtype = module.weight.dtype
    scale = getattr(module, "embed_scale", None)

    def forward(ids: torch.Tensor) -> HiddenStates:
        if embedding is None:
            hidden = final_hidden(model, ids, device)
        else:
            embeds = torch.nn.functional.embedding(ids, embedding).to(device=device, dtype=dtype)
            if scale is not None:
                embeds = embeds * scale.to(device=device, dtype=dtype)
            hidden = model.base_model(inputs_embeds=embeds, use_cache=False).last_hidden_state
        if head is None:
            return with_head(model, hidden, device)
        weight = head.to(device)
        return HiddenStates(hidden, _soft_capped(model, lambda h: torch.nn.functional.linear(h, weight.to(h.dtype))))

    return forward


def final_hidden(model: torch.nn.Module, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The model's final hidden states (its last norm's output, the head's input) on ``ids``."""
    return model.base_model(input_ids=ids.to(device), use_cache=False).last_hidden_state


def with_head(model: torch.nn.Module, hidden: torch.Tensor, device: torch.device) -> HiddenStates:
    """``hidden`` with ``model``'s output head, held on ``device`` while a batch's chunks are made."""
    head = model.get_output_embeddings()
    return HiddenStates(hidden, output_head(model), lambda: streaming.resident(head, device))


def output_head(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The map from final hidden states to logits: the output embedding, then the model's logit
    soft-capping when its config has one (Gemma 2)."""
    head = model.get_output_embeddings()
    return _soft_capped(model, head)


def _soft_capped(model: torch.nn.Module, head: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    cap = getattr(model.config, "final_logit_softcapping", None)

    def apply(hidden: torch.Tensor) -> torch.Tensor:
        logits = head(hidden)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return apply


HEAD_SLICE_BYTES = 32 * 2**20
"""Bytes of a streamed output head read at a time by ``head_from_disk`` (Qwen2.5-1.5B's bf16 head:
10,922 of its 151,936 rows, 15 reads per chunk of positions)."""


def head_from_disk(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The model's output head computed from its stored weight, ``HEAD_SLICE_BYTES`` of rows at a time
    (plain reads, each slice freed before the next is read), so the head is never whole in memory;
    None when the head is not a streamed ``nn.Linear`` (an in-memory model: use ``output_head``).

    For comparisons that run beside a runtime's own copy of the model (the exports' verifiers): the
    logits of the resident head (bit for bit on Qwen2.5-1.5B's bf16 head; float32 matmuls over a
    narrower slice may round the last bit differently), at the cost of reading the head once per
    chunk of positions (the time it adds: docs/models-and-data.md, "Streamed, in bfloat16")."""
    head = model.get_output_embeddings()
    unit = streaming.unit_of(head) if head is not None else None
    if unit is None or type(head) is not torch.nn.Linear:
        return None
    weight = f"{unit.prefix}.weight"
    rows, cols = head.weight.shape
    step = max(1, HEAD_SLICE_BYTES // (cols * head.weight.element_size()))
    bias = None if head.bias is None else unit.store.read([f"{unit.prefix}.bias"])[f"{unit.prefix}.bias"].to(head.bias.dtype)

    def linear(hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor | None = None
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            w = unit.store.read_rows(weight, start, stop).to(device=hidden.device, dtype=head.weight.dtype)
            b = None if bias is None else bias[start:stop].to(hidden.device)
            part = torch.nn.functional.linear(hidden, w, b)
            del w
            if out is None:
                out = torch.empty(*hidden.shape[:-1], rows, dtype=part.dtype, device=part.device)
            out[..., start:stop] = part
        assert out is not None
        return out

    return _soft_capped(model, linear)


@dataclass
class Evaluation:
    """Metrics of one artifact, measured on one runtime and device."""

    artifact: str
    runtime: str
    device: str
    metrics: dict[str, float | int]
    source: str = "measured"  # or "estimated"
    details: dict[str, Any] | None = None
    kind: str = "accuracy"  # accuracy | latency | memory | kv_cache | calibration
    profile: str | None = None  # the device profile it stands for (None: this machine)
    intervals: dict[str, dict[str, Any]] | None = None  # metric -> {lower, upper, level, method, samples}
    build: dict[str, str] | None = None  # the runtime's build and the device that measured it (eval/identity.py)

    def __post_init__(self) -> None:
        if self.intervals is None and isinstance(self.metrics, Scores):  # scored by compare(): its intervals come along
            self.intervals = self.metrics.intervals
        if isinstance(self.metrics, Scores):
            self.metrics = dict(self.metrics)

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
        if self.intervals:
            out["intervals"] = self.intervals
        if self.build:
            out["build"] = self.build
        if self.details:
            out["details"] = self.details
        return out
