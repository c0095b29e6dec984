"""The metrics a gate may name: what each means, which way is better, whether a % change makes sense.

Torch-free; computing them lives in compress/eval/metrics.py (accuracy) and compress/eval/latency.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MetricInfo:
    description: str
    better: str  # "lower" or "higher"
    relative: bool  # whether "% change vs the baseline" thresholds make sense


METRICS: dict[str, MetricInfo] = {
    "perplexity": MetricInfo("exp of the mean negative log-likelihood of the next token", "lower", True),
    "kl_divergence": MetricInfo("mean KL(baseline || model) per scored token, nats", "lower", False),
    "kl_divergence_p99": MetricInfo("99th percentile of per-token KL(baseline || model), nats", "lower", False),
    "top1_agreement": MetricInfo("share of tokens where the model's top-1 equals the baseline's", "higher", False),
    # Latency and memory (eval/latency.py), measured on the artifact's runtime, or estimated for a
    # device profile that is not this machine (eval/devices.py); medians over repeats at batch 1.
    "ttft_ms": MetricInfo("time to first token for the stated prompt length, ms (median)", "lower", True),
    "ttft_ms_p90": MetricInfo("90th percentile of the time to first token, ms", "lower", True),
    "tpot_ms": MetricInfo("time per output token while decoding, ms (median)", "lower", True),
    "tpot_ms_p90": MetricInfo("90th percentile of the time per output token, ms", "lower", True),
    "decode_tokens_per_s": MetricInfo("decoded tokens per second at batch 1 (median)", "higher", True),
    "batch_decode_tokens_per_s": MetricInfo("decoded tokens per second summed over the batch, at the stated batch size", "higher", True),
    "peak_rss_mb": MetricInfo("peak resident memory of the process while the runtime ran, MiB", "lower", True),
    "gpu_peak_mb": MetricInfo("peak GPU memory allocated while the runtime ran, MiB", "lower", True),
    "size_mb": MetricInfo("artifact size on disk, MiB", "lower", True),
    "bandwidth_utilization": MetricInfo("bytes read per decoded token / time per token / memory bandwidth", "higher", False),
    "memory_fraction": MetricInfo("weights + KV cache at the target context and batch / the device's usable memory", "lower", False),
    # Calibration coverage of mixture-of-experts models (quantizers/moe.py), over every gptq / awq stage.
    "experts_under_min": MetricInfo(
        "MoE experts the router sent fewer calibration tokens than their stage's moe.min_tokens", "lower", False
    ),
    "min_expert_tokens": MetricInfo("fewest calibration tokens the router sent to any MoE expert", "higher", False),
    # The kv_cache stage's cache (quantizers/kv_cache*.py, kv_evict.py), measured by decoding through it (eval/kv_eval.py).
    "kv_bytes_per_token": MetricInfo("KV-cache bytes held per token of context at the end of the evaluation sequences", "lower", False),
    "kv_compression": MetricInfo("times less KV-cache memory than a float16 cache holds for the same tokens", "higher", False),
    "needle_recall": MetricInfo(
        "share of needles (a number placed early in the context) whose every token is the top-1 when asked for at the end",
        "higher",
        False,
    ),
    # A draft stage's target + draft pair (distill/draft.py), measured by speculative decoding against the
    # target alone on held-apart prompts (eval/speculative.py); greedy decoding at the best k.
    "draft_acceptance": MetricInfo("draft tokens the target accepts per target pass (mean, greedy, at the best k)", "higher", False),
    "speculative_speedup": MetricInfo(
        "decode speed of the target with the draft / the target alone on the same runtime (greedy, at the best k)", "higher", False
    ),
    "draft_greedy_identical": MetricInfo(
        "share of prompts whose greedy output with the draft equals the target's own, token for token (the worst k)", "higher", False
    ),
    # Task accuracy through lm-evaluation-harness (eval/tasks.py), per task (a gate names it with `task:`).
    "accuracy": MetricInfo("share of a task's questions answered right, percent (lm-eval's acc)", "higher", True),
    "accuracy_norm": MetricInfo(
        "share answered right when each choice's log-likelihood is divided by its length in characters, percent (lm-eval's acc_norm)",
        "higher",
        True,
    ),
}
ACCURACY_METRICS = ("perplexity", "kl_divergence", "kl_divergence_p99", "top1_agreement")
LATENCY_METRICS = (
    "ttft_ms",
    "ttft_ms_p90",
    "tpot_ms",
    "tpot_ms_p90",
    "decode_tokens_per_s",
    "batch_decode_tokens_per_s",
    "peak_rss_mb",
    "gpu_peak_mb",
    "bandwidth_utilization",
)
CALIBRATION_METRICS = ("experts_under_min", "min_expert_tokens")  # of the compressed model, from its stage records
TASK_METRICS = ("accuracy", "accuracy_norm")
KV_METRICS = ("kv_bytes_per_token", "kv_compression", "needle_recall")  # of the kv_cache artifact only
DRAFT_METRICS = ("draft_acceptance", "speculative_speedup", "draft_greedy_identical")  # of the draft artifacts only
DRAFT_ARTIFACT = "draft"
"""A draft stage's target and draft decoding together in torch (the models as the run leaves them in memory)."""
DRAFT_RUNTIME_PREFIX = "draft-"
"""``draft-<export>``: the pair on an export's runtime (a GGUF export and the draft's GGUF in llama.cpp)."""


def draft_artifact(export_name: str) -> str:
    """The artifact name of the target's export ``export_name`` decoding with the draft on its runtime."""
    return f"{DRAFT_RUNTIME_PREFIX}{export_name}"


def is_draft_artifact(name: str) -> bool:
    """Whether a gate's artifact is a draft stage's pair (torch or an export's runtime)."""
    return name == DRAFT_ARTIFACT or name.startswith(DRAFT_RUNTIME_PREFIX)


INTERVAL_METRICS = (
    "perplexity",
    "kl_divergence",
    "top1_agreement",
    *TASK_METRICS,
    "draft_acceptance",
    "speculative_speedup",
)  # with a 95% interval (compress/eval/metrics.py)
GATE_BOUNDS = ("value", "lower_95", "upper_95")  # what a gate compares: the value, or an end of its interval
DEVICE_METRICS = (*LATENCY_METRICS, "memory_fraction", "size_mb")  # the metrics a gate may ask of a named device
