"""What the side-by-side experiment scripts share (w8a8_smoothquant.py, rotate_w4.py): score one candidate
beside the float model on the evaluation sequences, and print the table of every candidate's KL
divergence, top-1 agreement and perplexity with their 95% bootstrap intervals. Not run on its own."""

from __future__ import annotations

from typing import Any

import torch

from compress.eval.metrics import compare, torch_forward


def interval(scores: Any, metric: str, digits: int) -> str:
    ci = scores.intervals.get(metric)
    value = f"{scores[metric]:.{digits}f}"
    return value if ci is None else f"{value} [{ci['lower']:.{digits}f}, {ci['upper']:.{digits}f}]"


def score(baseline: Any, name: str, model: torch.nn.Module, evaluation: Any, eval_cfg: Any, scores: dict[str, Any]) -> None:
    """Score ``model`` beside the float model's forward ``baseline``; its scores and the baseline's go into ``scores``."""
    found = compare(
        baseline, {name: torch_forward(model, torch.device("cpu"))}, evaluation.tokens, eval_cfg.min_context, eval_cfg.batch_size
    )
    scores[name], scores["baseline"] = found[name], found["baseline"]
    print(f"scored {name}: KL {interval(found[name], 'kl_divergence', 5)}", flush=True)


def print_table(
    source: str,
    calibration: Any,
    evaluation: Any,
    eval_cfg: Any,
    threads: int,
    scores: dict[str, Any],
    seconds: dict[str, float],
    step: str,
) -> None:
    """The Markdown table of every candidate in ``seconds`` (its ``step``'s time, in seconds), with the data it was scored on."""
    n, length = evaluation.tokens.shape
    print(f"\n{source}; calibration {calibration.tokens.shape[0]} x {calibration.tokens.shape[1]} tokens; ")
    print(f"evaluation {n} x {length} tokens (held apart), min_context {eval_cfg.min_context}; {threads} threads")
    print(f"float perplexity {interval(scores['baseline'], 'perplexity', 3)}\n")
    print(f"| candidate | KL divergence [95% interval] | top-1 agreement | perplexity | {step}, s |")
    print("|---|---|---|---|---|")
    for name, spent in seconds.items():
        s = scores[name]
        print(
            f"| {name} | {interval(s, 'kl_divergence', 5)} | {interval(s, 'top1_agreement', 4)} | {interval(s, 'perplexity', 3)} | {spent:.1f} |"
        )
