"""`compress bench kv`: KV-cache schemes against the full-precision cache on one model.

For each scheme: measured cache bytes (data + scales + full-precision window) after decoding
``context`` tokens, against what an fp16 cache holds; KL divergence / top-1 / perplexity of
decoding through the quantized or evicting cache (``step`` tokens a forward call, 1 = token by
token) against the full-precision forward; with eviction, the needle recall through the cache and
the bytes' peak and mean; decode speed (median of repeats) against transformers' DynamicCache in the
same run; a memory plan: the longest context and largest batch that fit a device budget with and
without the scheme; and a plot of KL against KV memory, one series per family (eviction alone,
quantization alone, both).
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from compress import streaming
from compress.eval.bench.plots import Series, plot_series
from compress.eval.bench.quant import load_bench_inputs, write_results
from compress.eval.kv_eval import evaluate_kv
from compress.progress import Reporter
from compress.quantizers.kv_cache import KVCacheScheme, float_cache_bytes_per_token, kv_geometry, memory_plan
from compress.quantizers.kv_cache_config import EvictConfig, KVCacheConfig
from compress.quantizers.kv_evict import EvictingKVCache, evicting_attention_on, fastgen_inputs, profile_summary
from compress.schema.recipe import DataConfig

# Named schemes for the benchmark (any other is given as a recipe-style override, see parse_scheme).
PRESETS: dict[str, dict[str, Any]] = {
    "int8": {"bits": 8, "key_axis": "token", "residual": 0},
    "int8-kivi": {"bits": 8},
    "int4": {"bits": 4, "residual": 128},
    "int2": {"bits": 2, "residual": 128, "group_size": 32},
    "fp8": {"format": "fp8", "bits": 8, "key_axis": "token", "residual": 0},
    "fp8-static": {"format": "fp8", "bits": 8, "key_axis": "token", "residual": 0, "static_scales": True},
    "int8-static": {"bits": 8, "key_axis": "token", "residual": 0, "static_scales": True},
}
PRESETS["float"] = {"format": "float"}  # eviction alone: give evict=POLICY
PRESETS["int4-token"] = {"bits": 4, "key_axis": "token", "residual": 0, "group_size": 32}  # every token quantized as it arrives
DEFAULT_SCHEMES = ("int8", "int4", "int2", "fp8")
EVICT_KEYS = {name for name in EvictConfig.model_fields if name != "policy"}


def parse_scheme(text: str, evaluate: dict[str, Any] | None = None) -> tuple[str, KVCacheConfig]:
    """``int4`` (a preset) or ``int4:residual=64,group_size=32`` (a preset with overrides);
    ``evict=POLICY`` and the eviction keys (budget, sink, window, recovery, ...) add eviction, e.g.
    ``float:evict=h2o,budget=512`` or ``int4:evict=window,budget=1024``. ``evaluate``: the
    KVEvalConfig fields the scheme is scored with (its checks against the context apply)."""
    import yaml

    name, _, rest = text.partition(":")
    if name not in PRESETS:
        raise ValueError(f"unknown KV scheme '{name}'; known: {', '.join(PRESETS)}")
    fields = dict(PRESETS[name])
    evict: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"'{item}' in '{text}': expected KEY=VALUE")
        key = key.strip()
        if key == "evict":
            evict["policy"] = value.strip()
        elif key in EVICT_KEYS:
            evict[key] = yaml.safe_load(value)
        else:
            fields[key] = yaml.safe_load(value)
    if evict and "policy" not in evict:
        raise ValueError(f"'{text}': {', '.join(sorted(evict))} set eviction options; name the policy with evict=POLICY")
    if evict:
        fields["evict"] = evict
    return text, KVCacheConfig(**fields, evaluate=evaluate)


def family(cfg: KVCacheConfig) -> str:
    """The plot's series: eviction alone, quantization alone, or both."""
    if cfg.evict is None:
        return "quantization"
    return "eviction" if cfg.format == "float" else "eviction + quantization"


@torch.no_grad()
def decode_speed(model: torch.nn.Module, ids: torch.Tensor, new_cache: Any, tokens: int, repeats: int) -> float:
    """Median tokens/s of ``tokens`` greedy single-token steps after a prefill of ``ids`` [1, n]
    (an evicting cache decodes under its own attention, eviction included in the time)."""
    rates = []
    for _ in range(repeats):
        cache = new_cache()
        evicting = isinstance(cache, EvictingKVCache)
        with evicting_attention_on(model, cache) if evicting else contextlib.nullcontext():
            nxt = _greedy_step(model, cache, ids)
            start = time.perf_counter()
            for _ in range(tokens):
                nxt = _greedy_step(model, cache, nxt)
            rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates)


def _greedy_step(model: torch.nn.Module, cache: Any, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(cache, EvictingKVCache):
        cache.set_tokens(ids)
    return model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)


def run_kv_bench(
    model_source: str,
    data: DataConfig,
    schemes: list[tuple[str, KVCacheConfig]],
    out_dir: Path,
    threads: int,
    reporter: Reporter,
    context: int,
    samples: int,
    decode_tokens: int,
    decode_prefill: int,
    repeats: int,
    budgets_gib: list[float],
) -> dict[str, Any]:
    from transformers import DynamicCache

    assert data.evaluation is not None
    long_data = data.model_copy(update={"evaluation": data.evaluation.model_copy(update={"samples": samples, "seq_len": context})})
    lm, calibration, evaluation, eval_cfg = load_bench_inputs(model_source, long_data, threads, reporter)
    model = streaming.materialize(lm.model).eval()  # decoding token by token: the model stays in memory
    layers, kv_heads, head_dim = kv_geometry(model.config)
    fp16_per_token = float_cache_bytes_per_token(model.config)
    prefill_ids = evaluation.tokens[:1, :decode_prefill]
    reference_speed = decode_speed(model, prefill_ids, lambda: DynamicCache(config=model.config), decode_tokens, repeats)
    weights_fp16 = sum(p.numel() for p in model.parameters()) * 2
    result: dict[str, Any] = {
        "model": {
            "source": model_source,
            "sha256": lm.facts["sha256"],
            "layers": layers,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "max_position_embeddings": getattr(model.config, "max_position_embeddings", None),
        },
        "evaluation": evaluation.facts,
        "context": context,
        "threads": threads,
        "host": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "reference": {
            "name": "fp16 cache (bytes) / model-dtype DynamicCache (accuracy, speed)",
            "bytes_per_token": fp16_per_token,
            "cache_bytes": fp16_per_token * context,
            "decode_tokens_per_s": reference_speed,
            "decode": {"prefill": decode_prefill, "tokens": decode_tokens, "repeats": repeats},
        },
        "rows": [],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    per_token = {"fp16": float(fp16_per_token)}
    for name, cfg in schemes:
        scales = None
        if cfg.static_scales:
            if calibration is None:
                raise ValueError(f"{name} calibrates static scales and needs calibration text")
            from compress.quantizers.kv_cache_store import calibrate_scales

            scales = calibrate_scales(model, calibration.tokens, cfg, torch.device("cpu"), reporter)
        tables, profile = None, None
        if cfg.evict is not None and cfg.evict.policy == "fastgen":
            cal = None if calibration is None else calibration.tokens
            tables, profile = fastgen_inputs(model, lm.tokenizer, cal, cfg.evict, (layers, kv_heads), torch.device("cpu"), reporter)
        scheme = KVCacheScheme(cfg, scales, layers, tables, profile)
        start = time.perf_counter()
        found = evaluate_kv(
            model, scheme, evaluation.tokens, eval_cfg.min_context, torch.device("cpu"), progress=reporter.track, tokenizer=lm.tokenizer
        )
        seconds = time.perf_counter() - start
        speed = decode_speed(model, prefill_ids, scheme.new_cache, decode_tokens, repeats)
        mem = found["memory"]
        per_token[name] = mem["bytes_per_token"]
        result["rows"].append(
            {
                "name": name,
                "family": family(cfg),
                "describe": cfg.describe(),
                "config": cfg.model_dump(mode="json", exclude={"evaluate"}),
                "decoding": found["decoding"],
                "metrics": found["metrics"],
                "intervals": found["metrics"].intervals,
                "reference_metrics": found["reference_metrics"],
                "memory": mem,
                **({"needles": found["needles"]} if found["needles"] else {}),
                **({"fastgen_profile": profile_summary(profile)} if profile else {}),
                "evaluate_seconds": round(seconds, 1),
                "decode_tokens_per_s": speed,
                "decode_speed_vs_reference": speed / reference_speed,
                "runtimes": cfg.runtime_support(),
            }
        )
        write_results(out_dir, result, markdown_table(result))
    result["memory_plan"] = {f"{b:g} GiB": memory_plan(weights_fp16, per_token, b, context) for b in budgets_gib}
    result["memory_plan_note"] = (
        f"fp16 weights ({weights_fp16 / 2**20:.1f} MiB) plus the cache; activations and runtime overhead "
        "not counted; contexts beyond the model's max_position_embeddings are capacity, not usable context"
    )
    write_results(out_dir, result, markdown_table(result))
    plot_kl_vs_memory(result, out_dir / "kl-vs-kv-memory.png")
    return result


FAMILY_MARKERS = (("quantization", "s-"), ("eviction", "o-"), ("eviction + quantization", "^-"))


def plot_kl_vs_memory(result: dict[str, Any], path: Path) -> Path | None:
    """KL against how many times less KV memory than fp16 each scheme holds at the context, one series per family."""
    rows = [r for r in result["rows"] if r["metrics"].get("kl_divergence", 0) > 0]
    if not rows:
        return None
    series = []
    for name, marker in FAMILY_MARKERS:
        mine = sorted((r for r in rows if r.get("family", "quantization") == name), key=lambda r: r["memory"]["compression_vs_fp16"])
        series.append(
            Series(name, marker, [r["memory"]["compression_vs_fp16"] for r in mine], [r["metrics"]["kl_divergence"] for r in mine])
        )
    notes = [(r["name"], r["memory"]["compression_vs_fp16"], r["metrics"]["kl_divergence"]) for r in rows]
    return plot_series(
        path,
        series,
        notes,
        f"times less KV memory than fp16 at {result['context']:,} tokens",
        "KL vs the float cache (nats/token)",
        f"{result['model']['source']}: KV-cache schemes, KL against memory",
        note_size=6,
        xscale={"value": "log", "base": 2},
        yscale={"value": "log"},
    )


def markdown_table(result: dict[str, Any]) -> str:
    ref = result["reference"]
    lines = [
        f"Context {result['context']:,} tokens; {result['threads']} threads; fp16 cache {ref['bytes_per_token']:,} bytes/token; "
        f"DynamicCache decode {ref['decode_tokens_per_s']:.1f} tokens/s (prefill {ref['decode']['prefill']}, median of {ref['decode']['repeats']}).",
        "",
        "| scheme | layout | bytes/token | vs fp16 (mean) | KL [95%] | top-1 | perplexity (float cache) | needles (float cache) | tokens | decode tokens/s (vs DynamicCache) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        m, mem = r["metrics"], r["memory"]
        kl = r.get("intervals", {}).get("kl_divergence")
        kl_text = f"{m['kl_divergence']:.5f}" + (f" [{kl['lower']:.5f}, {kl['upper']:.5f}]" if kl else "")
        mean = f" ({mem['mean_compression_vs_fp16']:.2f}x)" if "mean_compression_vs_fp16" in mem else ""
        needles = r.get("needles")
        needle_text = "—"
        if needles:
            needle_text = f"{needles['needle_recall']:.0%} ({needles['needle_recall_float_cache']:.0%}) of {needles['needles']}"
            if "needle_token_recall" in needles:
                needle_text += f"; tokens {needles['needle_token_recall']:.0%} ({needles['needle_token_recall_float_cache']:.0%})"
        lines.append(
            f"| {r['name']} | {r['describe']} | {mem['bytes_per_token']:,.1f} | {mem['compression_vs_fp16']:.2f}x{mean} | "
            f"{kl_text} | {m['top1_agreement']:.2%} | {m['perplexity']:.3f} ({r['reference_metrics']['perplexity']:.3f}) | "
            f"{needle_text} | {m['tokens_scored']:,} | "
            f"{r['decode_tokens_per_s']:.1f} ({r['decode_speed_vs_reference']:.2f}x) |"
        )
    plan = result.get("memory_plan")
    if plan:
        lines += [
            "",
            f"Memory plan ({result['memory_plan_note']}): longest context at batch 1 / largest batch at {result['context']:,} tokens.",
            "",
        ]
        names = list(next(iter(plan.values())))
        lines += ["| budget | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        batch_key = f"max_batch_at_{result['context']}"
        for budget, rows in plan.items():
            cells = [f"{v['max_context_batch1']:,} / {v[batch_key]:,}" for v in rows.values()]
            lines.append(f"| {budget} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
