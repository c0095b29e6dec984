"""W8A8 plain vs W8A8 SmoothQuant vs LLM.int8() on one model, on the same text, scored in one pass.

    python scripts/experiments/w8a8_smoothquant.py                       # recipes/w8a8-smoothquant.yaml's model and data
    python scripts/experiments/w8a8_smoothquant.py --alphas 0.5,0.8 --threads 2

The model and data (calibration text, and the evaluation text held apart from it) are those of
``recipes/w8a8-smoothquant.yaml``. Each candidate is quantized from the same float model by the stage a
recipe runs (``method: w8a8`` with ``smoothing: null`` and each alpha; ``method: llm_int8`` at threshold
6.0) and scored against the float model in one ``compare`` pass: KL divergence, top-1 agreement and
perplexity with their 95% bootstrap intervals over the evaluation sequences. Prints a Markdown table.
(`compress bench quant` scores one configuration per method, so it cannot put plain and smoothed W8A8
side by side.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from compress.context import RunContext  # noqa: E402
from compress.eval.bench.quant import load_bench_inputs, working_copy  # noqa: E402
from compress.eval.metrics import compare, torch_forward  # noqa: E402
from compress.progress import Reporter  # noqa: E402
from compress.quantizers.configs import LLMInt8Config, SmoothingConfig, W8A8Config  # noqa: E402
from compress.quantizers.llm_int8 import LLMInt8Stage  # noqa: E402
from compress.quantizers.w8a8 import W8A8Stage  # noqa: E402
from compress.recipe import load_recipe  # noqa: E402

RECIPE = ROOT / "recipes" / "w8a8-smoothquant.yaml"


def stages(alphas: list[float]) -> dict[str, object]:
    found: dict[str, object] = {"W8A8 plain (smoothing: null)": W8A8Stage(W8A8Config(smoothing=None), "w8a8")}
    for alpha in alphas:
        found[f"W8A8 SmoothQuant alpha {alpha:g}"] = W8A8Stage(W8A8Config(smoothing=SmoothingConfig(alpha=alpha)), "w8a8")
    found["LLM.int8() threshold 6.0"] = LLMInt8Stage(LLMInt8Config(threshold=6.0), "llm_int8")
    return found


def interval(scores: dict, metric: str, digits: int) -> str:
    ci = scores.intervals.get(metric)
    value = f"{scores[metric]:.{digits}f}"
    return value if ci is None else f"{value} [{ci['lower']:.{digits}f}, {ci['upper']:.{digits}f}]"


def main(alphas: list[float], threads: int) -> None:
    recipe = load_recipe(RECIPE).recipe
    reporter = Reporter(quiet=True)
    lm, calibration, evaluation, eval_cfg = load_bench_inputs(recipe.model.source, recipe.data, threads, reporter, recipe.model.dtype)
    cpu = torch.device("cpu")
    candidates, seconds = {}, {}
    for name, stage in stages(alphas).items():
        model = working_copy(lm.model, stage.config)  # read whole: neither stage streams
        ctx = RunContext(seed=0, device=cpu, tokenizer=lm.tokenizer, reporter=reporter, calibration=lambda: calibration.tokens)
        started = time.perf_counter()
        stage.apply(model, ctx)
        seconds[name] = time.perf_counter() - started
        candidates[name] = torch_forward(model, cpu)
        print(f"quantized {name} in {seconds[name]:.1f} s", flush=True)
    scores = compare(torch_forward(lm.model, cpu), candidates, evaluation.tokens, eval_cfg.min_context, eval_cfg.batch_size)
    n, length = evaluation.tokens.shape
    print(f"\n{recipe.model.source}; calibration {calibration.tokens.shape[0]} x {calibration.tokens.shape[1]} tokens; ")
    print(f"evaluation {n} x {length} tokens (held apart), min_context {eval_cfg.min_context}; {threads} threads")
    print(f"float perplexity {interval(scores['baseline'], 'perplexity', 3)}\n")
    print("| candidate | KL divergence [95% interval] | top-1 agreement | perplexity | quantize, s |")
    print("|---|---|---|---|---|")
    for name in candidates:
        s = scores[name]
        print(
            f"| {name} | {interval(s, 'kl_divergence', 5)} | {interval(s, 'top1_agreement', 4)} | "
            f"{interval(s, 'perplexity', 3)} | {seconds[name]:.1f} |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--alphas", default="0.5", help="Comma-separated SmoothQuant alphas, each a row.")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    main([float(a) for a in args.alphas.split(",")], args.threads)
