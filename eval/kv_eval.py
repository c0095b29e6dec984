"""Scoring a quantized KV cache by decoding through it.

The quantized cache only matters when past keys and values are read back from it, so the
candidate is run incrementally: a prefill of ``prefill`` tokens, then ``step`` tokens per
forward call with ``past_key_values`` carrying everything before them. The reference is the
same model's full-precision forward over the whole sequence (what a full-precision cache gives;
``test_kv_cache`` checks decoding through transformers' float DynamicCache matches it).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from typing import Any

import torch

from compress import streaming
from compress.errors import CompressError
from compress.eval.metrics import Forward, HiddenStates, compare, torch_forward, with_head
from compress.quantizers.kv_cache import KVCacheScheme, float_cache_bytes_per_token
from compress.quantizers.kv_cache_store import cache_bytes
from compress.quantizers.kv_evict import EvictingKVCache, evicting_attention_on


def cached_forward(
    model: torch.nn.Module,
    device: torch.device,
    new_cache: Callable[[], Any],
    step: int = 1,
    prefill: int = 0,
    on_done: Callable[[Any, int], None] | None = None,
    progress: Callable | None = None,
) -> Forward:
    """A Forward that decodes ``ids`` [batch, seq] through a fresh cache from ``new_cache()`` and
    returns every position's final hidden states with the model's head (the logits are made a chunk
    of positions at a time: a batch of 2,048-token rows would otherwise hold batch x 2,048 x vocab
    floats); ``on_done(cache, tokens, rows)`` sees the filled cache of each batch;
    ``progress(items, description, total)`` (a Reporter's ``track``) shows the decoding steps."""

    def forward(ids: torch.Tensor) -> HiddenStates:
        cache = new_cache()
        ids = ids.to(device)
        first = prefill or step
        starts = [0, *range(first, ids.shape[1], step)]
        if progress is not None:
            starts = progress(starts, f"decoding {ids.shape[1]:,} tokens through the KV cache", len(starts))
        outs = []
        evicting = isinstance(cache, EvictingKVCache)
        with evicting_attention_on(model, cache) if evicting else contextlib.nullcontext():
            for pos in starts:
                n = first if pos == 0 else step
                if evicting:
                    cache.set_tokens(ids[:, pos : pos + n])
                out = model.base_model(input_ids=ids[:, pos : pos + n], past_key_values=cache, use_cache=True)
                outs.append(out.last_hidden_state)
                if evicting:
                    cache.record()
        if on_done is not None:
            on_done(cache, ids.shape[1], ids.shape[0])
        return with_head(model, torch.cat(outs, dim=1), device)

    return forward


def needle_rows(tokenizer: Any, chunks: torch.Tensor, count: int, depth: float, seed: int = 0) -> tuple[torch.Tensor, list[slice]]:
    """``count`` rows of the chunks' length: a chunk's text with " The secret number is NNNNN." placed at
    ``depth`` of the context and " The secret number is NNNNN" ending the row; returns the rows and,
    per row, the positions of the answer's tokens (a model recalls it when each is its top-1)."""
    rng = random.Random(seed)
    length = chunks.shape[1]
    rows, answers = [], []
    for r in range(count):
        secret = rng.randrange(10_000, 100_000)

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        needle = encode(f" The secret number is {secret}.")
        question = encode(" The secret number is")
        asked = encode(f" The secret number is {secret}")
        if asked[: len(question)] != question:  # the number merged with the words before it: ask the whole sentence
            question = []
        answer = asked[len(question) :]
        filler = chunks[r % chunks.shape[0]].tolist()
        at = int(depth * length)
        room = length - len(needle) - len(asked)
        if room <= at:
            raise CompressError(
                f"kv_cache.evaluate.needles: a needle row needs more than {len(needle) + len(asked) + at} tokens; "
                f"evaluate.context is {length} (raise it, lower needle_depth, or set needles: 0)"
            )
        ids = filler[:at] + needle + filler[at:room] + asked
        rows.append(ids)
        answers.append(slice(length - len(answer), length))
    return torch.tensor(rows, dtype=chunks.dtype), answers


def recalled(out: HiddenStates, rows: torch.Tensor, answers: list[slice]) -> list[tuple[int, int]]:
    """Per row: (answer tokens that are the top-1 of the position before them, answer tokens)."""
    found = []
    with out.hold():
        for r, at in enumerate(answers):
            logits = out.logits(r, slice(at.start - 1, at.stop - 1))
            hits = (logits.argmax(-1).cpu() == rows[r, at]).sum()
            found.append((int(hits), at.stop - at.start))
    return found


def needle_recall(
    model: torch.nn.Module,
    scheme: KVCacheScheme,
    tokenizer: Any,
    chunks: torch.Tensor,
    device: torch.device,
    progress: Callable | None = None,
) -> dict[str, Any]:
    """needle_recall (needles whose every token is the top-1) and needle_token_recall (the share of the
    numbers' tokens that are) through the cache and through the float forward, on the same rows."""
    ev = scheme.config.evaluate
    assert ev is not None
    count = ev.needle_rows(scheme.config.evict is not None)
    rows, answers = needle_rows(tokenizer, chunks, count, ev.needle_depth)
    cached = cached_forward(model, device, scheme.new_cache, ev.step, ev.prefill, None, progress)
    full = torch_forward(model, device)
    through, reference = [], []
    for start in range(0, count, ev.batch):
        batch, at = rows[start : start + ev.batch], answers[start : start + ev.batch]
        through += recalled(cached(batch), batch, at)
        reference += recalled(full(batch), batch, at)
    return {
        "needle_recall": sum(hits == n for hits, n in through) / count,
        "needle_recall_float_cache": sum(hits == n for hits, n in reference) / count,
        "needle_token_recall": sum(hits for hits, _ in through) / sum(n for _, n in through),
        "needle_token_recall_float_cache": sum(hits for hits, _ in reference) / sum(n for _, n in reference),
        "needles": count,
        "needle_depth": ev.needle_depth,
        "needle_context": int(rows.shape[1]),
    }


def evaluate_kv(
    model: torch.nn.Module,
    scheme: KVCacheScheme,
    chunks: torch.Tensor,
    min_context: int,
    device: torch.device,
    progress: Callable | None = None,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """KL / top-1 / perplexity of decoding with the quantized cache against the full-precision
    forward of the same model (95% intervals over the sequences), plus the cache's measured bytes
    per sequence at the end of the sequences. ``batch`` sequences decode at once."""
    ev = scheme.config.evaluate
    step, prefill, batch = (ev.step, ev.prefill, ev.batch) if ev else (1, 0, 1)
    measured: list[dict[str, Any]] = []

    def done(cache: Any, tokens: int, rows: int) -> None:
        if isinstance(cache, EvictingKVCache):
            held, seen = cache.step.held, cache.step.seen
            measured.append(
                {
                    "total": int(held[-1]),
                    "quantized": 0,
                    "window": 0,
                    "tokens": tokens,
                    "peak": int(max(held)),
                    "mean_per_token": sum(h / n for h, n in zip(held, seen, strict=True)) / len(held),
                }
            )
            return
        measured.append({**{k: v // rows for k, v in cache_bytes(cache).items()}, "tokens": tokens})

    forward = cached_forward(model, device, scheme.new_cache, step, prefill, done, progress)
    streaming.to_device(model, device)
    found = compare(torch_forward(model, device), {"kv_cache": forward}, chunks, min_context, batch)
    metrics = found["kv_cache"]
    last = measured[-1]
    fp16 = float_cache_bytes_per_token(model.config) * last["tokens"]
    memory = {
        "context": last["tokens"],
        "cache_bytes": last["total"],
        "quantized_bytes": last["quantized"],
        "window_bytes": last["window"],
        "fp16_cache_bytes": fp16,
        "compression_vs_fp16": round(fp16 / last["total"], 4),
        "bytes_per_token": round(last["total"] / last["tokens"], 2),
    }
    if "peak" in last:  # an evicting cache: what it held after every step, per sequence (the mean over a batch)
        fp16_per_token = float_cache_bytes_per_token(model.config)
        memory.pop("quantized_bytes")
        memory.pop("window_bytes")
        memory["peak_cache_bytes"] = max(m["peak"] for m in measured)
        memory["mean_bytes_per_token"] = round(sum(m["mean_per_token"] for m in measured) / len(measured), 2)
        memory["mean_compression_vs_fp16"] = round(fp16_per_token / memory["mean_bytes_per_token"], 4)
    metrics["kv_bytes_per_token"] = memory["bytes_per_token"]
    metrics["kv_compression"] = memory["compression_vs_fp16"]
    needles = None
    if ev is not None and ev.needle_rows(scheme.config.evict is not None) and tokenizer is not None:
        needles = needle_recall(model, scheme, tokenizer, chunks, device, progress)
        metrics["needle_recall"] = needles["needle_recall"]
    decoding = {"step": step, "prefill": prefill}
    return {"metrics": metrics, "reference_metrics": found["baseline"], "memory": memory, "decoding": decoding, "needles": needles}
