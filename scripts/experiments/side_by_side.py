"""What the side-by-side experiment scripts share (w8a8_smoothquant.py, rotate_w4.py, fp4_w4a4.py): score one
candidate beside the float model on the evaluation sequences, run candidates that are chains of recipe stages,
and print the table of every candidate's KL divergence, top-1 agreement and perplexity with their 95% bootstrap
intervals. Not run on its own."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import torch

from compress import streaming
from compress.context import RunContext
from compress.eval.bench.quant import load_bench_inputs
from compress.eval.metrics import compare, torch_forward
from compress.plugins import stage_kind
from compress.progress import Reporter
from compress.recipe import load_recipe, stage_model


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


def shortened_data(recipe: Path, samples: int | None, calibration_samples: int | None) -> Any:
    """``recipe``'s ``data`` with ``samples`` evaluation and ``calibration_samples`` calibration sequences (None: the recipe's)."""
    data = load_recipe(recipe).recipe.data
    if samples is not None:
        data = data.model_copy(update={"evaluation": data.evaluation.model_copy(update={"samples": samples})})
    if calibration_samples is not None:
        data = data.model_copy(update={"calibration": data.calibration.model_copy(update={"samples": calibration_samples})})
    return data


def score_chains(args: Any, recipe: Path, chains: dict[str, list[dict]]) -> None:
    """Load ``args.model`` and ``recipe``'s data (``args.samples`` evaluation and ``args.calibration_samples``
    calibration sequences), apply each candidate's chain of recipe stages to a copy of the float model as a recipe
    runs them, score it beside the float model (one candidate in memory at a time) and print the table."""
    data = shortened_data(recipe, args.samples, args.calibration_samples)
    reporter = Reporter(quiet=True)
    lm, calibration, evaluation, eval_cfg = load_bench_inputs(args.model, data, args.threads, reporter, "float32")
    cpu = torch.device("cpu")
    baseline = torch_forward(lm.model, cpu)
    scores, seconds = {}, {}
    for name, chain in chains.items():
        model = copy.deepcopy(lm.model)
        if streaming.is_streamed(model):
            streaming.materialize(model)
        ctx = RunContext(
            seed=0, device=cpu, tokenizer=lm.tokenizer, reporter=reporter, calibration=lambda: calibration.tokens, original=lm.model
        )
        started = time.perf_counter()
        for i, item in enumerate(chain):
            stage = stage_model().model_validate(item)
            stage_kind(stage.kind, f"stages[{i}]").build(stage.config, f"stages[{i}]").apply(model, ctx)
        seconds[name] = time.perf_counter() - started
        score(baseline, name, model, evaluation, eval_cfg, scores)
        del model
    print_table(args.model, calibration, evaluation, eval_cfg, args.threads, scores, seconds, "stages")
