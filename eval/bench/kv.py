"""`compress bench kv`: KV-cache schemes against the full-precision cache on one model.

For each scheme: measured cache bytes (data + scales + full-precision window) after decoding
``context`` tokens, against what an fp16 cache holds; KL divergence / top-1 / perplexity of
token-by-token decoding through the quantized cache against the full-precision forward; decode
speed (median of repeats) against transformers' DynamicCache in the same run; and a memory plan:
the longest context and largest batch that fit a device budget with and without the scheme.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from compress import streaming
from compress.eval.bench.quant import load_bench_inputs, write_results
from compress.eval.kv_eval import evaluate_kv
from compress.progress import Reporter
from compress.quantizers.kv_cache import KVCacheScheme, float_cache_bytes_per_token, kv_geometry, memory_plan
from compress.quantizers.kv_cache_config import KVCacheConfig
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
DEFAULT_SCHEMES = ("int8", "int4", "int2", "fp8")


def parse_scheme(text: str) -> tuple[str, KVCacheConfig]:
    """``int4`` (a preset) or ``int4:residual=64,group_size=32`` (a preset with overrides)."""
    import yaml

    name, _, rest = text.partition(":")
    if name not in PRESETS:
        raise ValueError(f"unknown KV scheme '{name}'; known: {', '.join(PRESETS)}")
    fields = dict(PRESETS[name])
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"'{item}' in '{text}': expected KEY=VALUE")
        fields[key.strip()] = yaml.safe_load(value)
    return text, KVCacheConfig(**fields, evaluate=None)


@torch.no_grad()
def decode_speed(model: torch.nn.Module, ids: torch.Tensor, new_cache: Any, tokens: int, repeats: int) -> float:
    """Median tokens/s of ``tokens`` greedy single-token steps after a prefill of ``ids`` [1, n]."""
    rates = []
    for _ in range(repeats):
        cache = new_cache()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(tokens):
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates)


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
        scheme = KVCacheScheme(cfg, scales, layers)
        start = time.perf_counter()
        found = evaluate_kv(model, scheme, evaluation.tokens, eval_cfg.min_context, torch.device("cpu"), progress=reporter.track)
        seconds = time.perf_counter() - start
        speed = decode_speed(model, prefill_ids, scheme.new_cache, decode_tokens, repeats)
        mem = found["memory"]
        per_token[name] = mem["bytes_per_token"]
        result["rows"].append(
            {
                "name": name,
                "describe": cfg.describe(),
                "config": cfg.model_dump(mode="json", exclude={"evaluate"}),
                "metrics": found["metrics"],
                "reference_metrics": found["reference_metrics"],
                "memory": mem,
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
    return result


def markdown_table(result: dict[str, Any]) -> str:
    ref = result["reference"]
    lines = [
        f"Context {result['context']:,} tokens; {result['threads']} threads; fp16 cache {ref['bytes_per_token']:,} bytes/token; "
        f"DynamicCache decode {ref['decode_tokens_per_s']:.1f} tokens/s (prefill {ref['decode']['prefill']}, median of {ref['decode']['repeats']}).",
        "",
        "| scheme | layout | bytes/token | vs fp16 | KL | top-1 | perplexity (float cache) | tokens | decode tokens/s (vs DynamicCache) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        m, mem = r["metrics"], r["memory"]
        lines.append(
            f"| {r['name']} | {r['describe']} | {mem['bytes_per_token']:,.1f} | {mem['compression_vs_fp16']:.2f}x | "
            f"{m['kl_divergence']:.5f} | {m['top1_agreement']:.2%} | {m['perplexity']:.3f} ({r['reference_metrics']['perplexity']:.3f}) | "
            f"{m['tokens_scored']:,} | "
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
