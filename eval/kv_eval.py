"""Scoring a quantized KV cache by decoding through it.

The quantized cache only matters when past keys and values are read back from it, so the
candidate is run incrementally: a prefill of ``prefill`` tokens, then ``step`` tokens per
forward call with ``past_key_values`` carrying everything before them. The reference is the
same model's full-precision forward over the whole sequence (what a full-precision cache gives;
``test_kv_cache`` checks decoding through transformers' float DynamicCache matches it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from compress import streaming
from compress.eval.metrics import Forward, HiddenStates, compare, torch_forward, with_head
from compress.quantizers.kv_cache import KVCacheScheme, float_cache_bytes_per_token
from compress.quantizers.kv_cache_store import cache_bytes


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
        for pos in starts:
            n = first if pos == 0 else step
            out = model.base_model(input_ids=ids[:, pos : pos + n], past_key_values=cache, use_cache=True)
            outs.append(out.last_hidden_state)
        if on_done is not None:
            on_done(cache, ids.shape[1], ids.shape[0])
        return with_head(model, torch.cat(outs, dim=1), device)

    return forward


def evaluate_kv(
    model: torch.nn.Module,
    scheme: KVCacheScheme,
    chunks: torch.Tensor,
    min_context: int,
    device: torch.device,
    progress: Callable | None = None,
) -> dict[str, Any]:
    """KL / top-1 / perplexity of decoding with the quantized cache against the full-precision
    forward of the same model (95% intervals over the sequences), plus the cache's measured bytes
    per sequence at the end of the sequences. ``batch`` sequences decode at once."""
    ev = scheme.config.evaluate
    step, prefill, batch = (ev.step, ev.prefill, ev.batch) if ev else (1, 0, 1)
    measured: list[dict[str, int]] = []

    def done(cache: Any, tokens: int, rows: int) -> None:
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
    return {"metrics": metrics, "reference_metrics": found["baseline"], "memory": memory, "decoding": {"step": step, "prefill": prefill}}
