"""Speculative decoding, measured: a draft proposes ``k`` tokens, the target checks them in one pass.

Both models are *decoders*: ``decode(ids, n_past, every_position)`` runs ``ids`` after the first
``n_past`` tokens already in the model's cache (anything cached past them is dropped) and returns
the logits of every position, or of the last one. ``LlamaCppModel`` (export/gguf/runtime.py) is one;
:class:`TorchDecoder` wraps a transformers model. The loop is the same on both, so acceptance and
speed are measured on the runtime that will run the pair:

- each round the draft decodes the target's last token and proposes ``k`` tokens one at a time
  (greedy: its argmax; sampled: a draw from its distribution at the temperature);
- the target decodes its last token and the ``k`` proposals in one call, which gives its
  distribution at each of the ``k + 1`` positions;
- greedy: a proposal is kept while it equals the target's argmax, and the target's argmax at the
  first mismatch (or after all ``k``) is appended, so the output is the target's greedy output;
  sampled: proposal ``x`` is kept with probability ``min(1, p(x) / q(x))``, and at the first
  rejection a token is drawn from ``max(0, p - q)`` renormalised (speculative sampling, Leviathan
  et al. 2023; Chen et al. 2023), so the output is distributed as the target's own samples.

Counted per round ("target pass"): tokens accepted, and for each draft position 1..k whether it was
reached and kept. The mean tokens per target pass is ``1 + accepted``. Timed: the whole generation,
prompt processing excluded, against the target alone decoding one token per call on the same prompt.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from compress.errors import CompressError
from compress.eval.metrics import BOOTSTRAP_RESAMPLES, percentile_interval


class Decoder(Protocol):
    """What the loop needs of a model on its runtime."""

    n_vocab: int

    def decode(self, ids: list[int], n_past: int, every_position: bool) -> np.ndarray:
        """Logits [len(ids) or 1, vocab] of ``ids`` decoded after the cache's first ``n_past`` tokens."""
        ...


class TorchDecoder:
    """A transformers causal LM as a :class:`Decoder`: one DynamicCache, cropped to ``n_past``."""

    def __init__(self, model: Any) -> None:
        import torch
        from transformers import DynamicCache

        self.torch = torch
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.n_vocab = int(model.get_output_embeddings().weight.shape[0])
        self.cache = DynamicCache(config=model.config)
        self.new_cache = lambda: DynamicCache(config=model.config)

    def decode(self, ids: list[int], n_past: int, every_position: bool) -> np.ndarray:
        torch = self.torch
        if n_past == 0:
            self.cache = self.new_cache()
        elif self.cache.get_seq_length() > n_past:
            self.cache.crop(n_past - self.cache.get_seq_length())  # (a negative length: drop that many from the end)
        elif self.cache.get_seq_length() < n_past:
            raise CompressError(f"the torch decoder holds {self.cache.get_seq_length()} tokens, fewer than the {n_past} asked for")
        with torch.inference_mode():
            tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
            positions = torch.arange(n_past, n_past + len(ids), device=self.device)[None]
            out = self.model(
                input_ids=tokens, past_key_values=self.cache, use_cache=True, position_ids=positions, cache_position=positions[0]
            )
            logits = out.logits[0] if every_position else out.logits[0, -1:]
        return logits.float().cpu().numpy()


@dataclass
class Generation:
    """One prompt's generation: the tokens, the time, and (speculative) what each round accepted."""

    tokens: list[int]
    seconds: float
    accepted: list[int] = field(default_factory=list)
    """Draft tokens kept in each round (0..k); empty for the target alone."""
    reached: list[int] = field(default_factory=list)
    """Per draft position 1..k: rounds in which the position was checked (every earlier one kept)."""
    kept: list[int] = field(default_factory=list)
    """Per draft position 1..k: rounds in which it was kept."""
    margins: list[float] = field(default_factory=list)
    """The target alone: its top-1 logit minus its top-2 at each generated token (how near a tie each was)."""


def _softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    z = logits.astype(np.float64) / temperature
    z -= z.max()
    p = np.exp(z)
    return p / p.sum()


def _pick(logits: np.ndarray, temperature: float, rng: np.random.Generator | None) -> tuple[int, np.ndarray | None]:
    """The next token: argmax when greedy (``rng`` None), else a draw; with its distribution when sampled."""
    if rng is None:
        return int(np.argmax(logits)), None
    p = _softmax(logits, temperature)
    return int(rng.choice(len(p), p=p)), p


def target_alone(
    target: Decoder, prompt: Sequence[int], max_new: int, temperature: float = 0.0, seed: int = 0, stop: int | None = None
) -> Generation:
    """The target decoding one token per call (the baseline): greedy when ``temperature`` is 0. As in
    :func:`speculative`, the prompt's last token is decoded inside the timed part."""
    if not prompt:
        raise CompressError("decoding needs a prompt of at least one token")
    rng = None if temperature == 0 else np.random.default_rng(seed)
    seq = list(prompt)
    prefill(target, seq[:-1])
    out: list[int] = []
    started = time.perf_counter()
    logits = target.decode(seq[-1:], len(seq) - 1, every_position=False)[0]
    margins: list[float] = []
    while len(out) < max_new:
        tok, _ = _pick(logits, temperature, rng)
        out.append(tok)
        top2 = np.partition(logits, -2)[-2:]
        margins.append(float(top2[1] - top2[0]))
        if tok == stop or len(out) == max_new:
            break
        logits = target.decode([tok], len(seq) + len(out) - 1, every_position=False)[0]
    return Generation(out, time.perf_counter() - started, margins=margins)


def prefill(model: Decoder, ids: Sequence[int], piece: int = 128) -> None:
    """Decode ``ids`` into the model's empty cache, ``piece`` tokens a call (nothing when empty)."""
    ids = list(ids)
    for start in range(0, len(ids), piece):
        model.decode(ids[start : start + piece], start, every_position=False)


def speculative(
    target: Decoder,
    draft: Decoder,
    prompt: Sequence[int],
    max_new: int,
    k: int,
    temperature: float = 0.0,
    seed: int = 0,
    stop: int | None = None,
) -> Generation:
    """``max_new`` tokens after ``prompt`` with ``draft`` proposing ``k`` a round and ``target`` checking
    them; greedy when ``temperature`` is 0, else speculative sampling at that temperature."""
    if k < 1:
        raise CompressError(f"k: the draft proposes at least one token a round, got {k}")
    if draft.n_vocab != target.n_vocab:
        raise CompressError(f"the draft's vocabulary ({draft.n_vocab}) differs from the target's ({target.n_vocab})")
    if not prompt:
        raise CompressError("speculative decoding needs a prompt of at least one token")
    rng = None if temperature == 0 else np.random.default_rng(seed)
    seq = list(prompt)
    prefill(target, seq[:-1])  # both caches hold all but the prompt's last token
    prefill(draft, seq[:-1])
    t_done = d_done = len(seq) - 1  # tokens each model's cache holds validly (a prefix of seq)
    made: list[int] = []
    gen = Generation([], 0.0, reached=[0] * k, kept=[0] * k)
    started = time.perf_counter()
    while len(made) < max_new:
        room = min(k, max_new - len(made) - 1)  # proposals that can still be used (the round adds one more)
        proposals: list[int] = []
        q_rows: list[np.ndarray | None] = []
        if room > 0:
            logits = draft.decode(seq[d_done:], d_done, every_position=False)[0]
            d_done = len(seq)
            for i in range(room):
                tok, q = _pick(logits, temperature, rng)
                proposals.append(tok)
                q_rows.append(q)
                if tok == stop:
                    break
                if i + 1 < room:
                    logits = draft.decode([tok], d_done + i, every_position=False)[0]
            d_done += max(len(proposals) - 1, 0)  # the last proposal was never decoded by the draft
        rows = target.decode(seq[t_done:] + proposals, t_done, every_position=True)
        rows = rows[len(seq) - t_done - 1 :]  # the rows at seq's last token and at each proposal
        accepted = 0
        new: list[int] = []
        for i, tok in enumerate(proposals):
            gen.reached[i] += 1
            if rng is None:
                ok = int(np.argmax(rows[i])) == tok
            else:
                p = _softmax(rows[i], temperature)
                q = q_rows[i]
                assert q is not None
                ok = rng.random() < min(1.0, p[tok] / max(q[tok], 1e-300))
            if not ok:
                break
            gen.kept[i] += 1
            accepted += 1
            new.append(tok)
            if tok == stop:
                break
        if not new or new[-1] != stop:
            last = rows[accepted]
            if rng is None:
                fix = int(np.argmax(last))
            elif accepted < len(proposals):  # rejected: draw from the residual max(0, p - q)
                p = _softmax(last, temperature)
                q = q_rows[accepted]
                assert q is not None
                residual = np.maximum(p - q, 0.0)
                total = residual.sum()
                fix = int(rng.choice(len(p), p=residual / total)) if total > 0 else int(rng.choice(len(p), p=p))
            else:
                fix, _ = _pick(last, temperature, rng)
            new.append(fix)
        gen.accepted.append(accepted)
        t_done = len(seq) + accepted  # seq's last token and the kept proposals are in the target's cache
        d_done = min(d_done, t_done)
        seq += new
        made += new
        if stop is not None and stop in new:
            break
    gen.seconds = time.perf_counter() - started
    gen.tokens = made[:max_new] if stop is None or stop not in made else made[: made.index(stop) + 1]
    return gen


# --------------------------------------------------------------------------- a sweep and its numbers


PROMPT_INTERVALS = f"percentile bootstrap over prompts, {BOOTSTRAP_RESAMPLES} resamples"


def ratio_interval(numerators: Sequence[float], denominators: Sequence[float], seed: int = 0) -> dict[str, Any]:
    """sum(numerators) / sum(denominators) as ``mean``, with its 95% bootstrap interval over the pairs
    (prompts) beside it when there are two or more: an Evaluation interval plus the ``mean``."""
    num, den = np.asarray(numerators, dtype=np.float64), np.asarray(denominators, dtype=np.float64)
    found: dict[str, Any] = {"mean": float(num.sum() / den.sum()) if len(num) else float("nan"), "samples": len(num)}
    if len(num) >= 2:
        idx = np.random.default_rng(seed).integers(0, len(num), size=(BOOTSTRAP_RESAMPLES, len(num)))
        found.update(percentile_interval(num[idx].sum(axis=1) / den[idx].sum(axis=1), len(num), PROMPT_INTERVALS))
    return found


def summarize(alone: list[Generation], paired: list[Generation], k: int, greedy: bool) -> dict[str, Any]:
    """One (draft, k, mode) cell: acceptance (tokens per target pass, per position), speed-up over the
    target alone on the same prompts (total time ratio, interval over prompts), and for greedy
    decoding how many prompts gave the target's own tokens."""
    rounds = [len(g.accepted) for g in paired]
    per_pass = ratio_interval([len(g.tokens) for g in paired], rounds)
    reached = np.sum([g.reached for g in paired], axis=0)
    kept = np.sum([g.kept for g in paired], axis=0)
    accepted_mean = ratio_interval([sum(g.accepted) for g in paired], rounds)
    speedup = ratio_interval([a.seconds / max(len(a.tokens), 1) for a in alone], [p.seconds / max(len(p.tokens), 1) for p in paired])
    row: dict[str, Any] = {
        "k": k,
        "mode": "greedy" if greedy else "sampled",
        "tokens_per_pass": per_pass,
        "accepted_per_pass": accepted_mean,
        "acceptance_by_position": [float(kk / r) if r else None for kk, r in zip(kept.tolist(), reached.tolist(), strict=True)],
        "acceptance_rate": float(kept.sum() / reached.sum()) if reached.sum() else None,
        "speedup": speedup,
        "tokens_per_s": ratio_interval([len(p.tokens) for p in paired], [p.seconds for p in paired]),
        "target_tokens_per_s": ratio_interval([len(a.tokens) for a in alone], [a.seconds for a in alone]),
        "prompts": len(paired),
        "tokens": int(sum(len(p.tokens) for p in paired)),
    }
    if greedy:
        same = [a.tokens == p.tokens for a, p in zip(alone, paired, strict=True)]
        diverged = [_first_difference(a.tokens, p.tokens) for a, p in zip(alone, paired, strict=True)]
        row["greedy_identical"] = int(sum(same))
        row["first_differences"] = [d for d in diverged if d is not None]
        # how near a tie the target alone was where each output first differed: a runtime that computes
        # a batch of tokens slightly differently from one token at a time flips only near-ties
        row["first_difference_margins"] = [
            round(a.margins[d], 4) for a, d in zip(alone, diverged, strict=True) if d is not None and d < len(a.margins)
        ]
    return row


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def sweep(
    target: Decoder,
    drafts: dict[str, Decoder],
    prompts: list[list[int]],
    ks: list[int],
    max_new: int,
    temperatures: list[float],
    stop: int | None = None,
    track: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Every (draft, k, temperature) cell over ``prompts``; the target alone is decoded once per prompt
    and temperature. ``track`` is called after each cell with a line saying what it measured."""
    rows = []
    for temperature in temperatures:
        alone = [target_alone(target, p, max_new, temperature, seed=i, stop=stop) for i, p in enumerate(prompts)]
        for name, draft in drafts.items():
            for k in ks:
                paired = [speculative(target, draft, p, max_new, k, temperature, seed=i, stop=stop) for i, p in enumerate(prompts)]
                row = summarize(alone, paired, k, temperature == 0)
                rows.append({"draft": name, "temperature": temperature, **row})
                if track is not None:
                    track(
                        f"{name} k={k} t={temperature:g}: {row['tokens_per_pass']['mean']:.2f} tokens a pass, "
                        f"speed-up {row['speedup']['mean']:.2f}x"
                    )
    return rows


def transformers_assisted(target: Any, draft: Any, prompts: list[list[int]], max_new: int, k: int) -> dict[str, Any]:
    """transformers' own assisted generation, as its users call it: ``target.generate(ids,
    assistant_model=draft)``, greedy, ``k`` draft tokens a round (constant schedule, no confidence
    cut-off), against ``target.generate(ids)`` alone on the same prompts, each timed whole (prompt
    included). Returns the speed-up (interval over prompts) and the prompts whose outputs are equal."""
    import torch

    config = draft.generation_config
    saved = (config.num_assistant_tokens, config.num_assistant_tokens_schedule, config.assistant_confidence_threshold)
    config.num_assistant_tokens, config.num_assistant_tokens_schedule, config.assistant_confidence_threshold = k, "constant", 0.0
    device = next(target.parameters()).device
    pad = target.generation_config.pad_token_id
    if pad is None:
        pad = target.generation_config.eos_token_id
        pad = pad[0] if isinstance(pad, list) else pad
    alone, paired, same = [], [], 0
    try:
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            kwargs = {"max_new_tokens": max_new, "min_new_tokens": max_new, "do_sample": False, "pad_token_id": pad}
            kwargs["attention_mask"] = torch.ones_like(ids)
            with torch.inference_mode():
                started = time.perf_counter()
                a = target.generate(ids, **kwargs)
                middle = time.perf_counter()
                b = target.generate(ids, assistant_model=draft, **kwargs)
                ended = time.perf_counter()
            alone.append(middle - started)
            paired.append(ended - middle)
            same += a[0, len(prompt) :].tolist() == b[0, len(prompt) :].tolist()
    finally:
        config.num_assistant_tokens, config.num_assistant_tokens_schedule, config.assistant_confidence_threshold = saved
    return {
        "engine": "transformers generate(assistant_model=)",
        "k": k,
        "mode": "greedy",
        "speedup": ratio_interval(alone, paired),
        "greedy_identical": same,
        "prompts": len(prompts),
    }


def batch_difference(model: Decoder, prompt: Sequence[int], tokens: int) -> dict[str, float]:
    """How differently the runtime computes ``tokens`` positions in one call and one call each, after
    ``prompt``: the largest and the mean absolute logit difference. Verification decodes a batch and
    the target alone one token at a time, so greedy outputs can part where the target's top two logits
    are closer than this (llama.cpp's CPU kernels for a batch are not its one-token kernels)."""
    ids = list(prompt)
    if len(ids) <= tokens:
        raise CompressError(f"a prompt of {len(ids)} tokens is too short to compare {tokens} positions")
    head, tail = ids[:-tokens], ids[-tokens:]
    prefill(model, head)
    batched = np.array(model.decode(tail, len(head), every_position=True))
    single = np.array([np.array(model.decode([t], len(head) + i, every_position=False)[0]) for i, t in enumerate(tail)])
    diff = np.abs(batched - single)
    return {"positions": tokens, "max": float(diff.max()), "mean": float(diff.mean())}
