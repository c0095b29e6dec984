"""W8A8 plain vs W8A8 SmoothQuant vs LLM.int8() (and FP8 W8A8 with ``--fp8``) on one model, on the same text.

    python scripts/experiments/w8a8_smoothquant.py                       # recipes/w8a8-smoothquant.yaml's model and data
    python scripts/experiments/w8a8_smoothquant.py --alphas 0.5,0.8 --threads 2
    python scripts/experiments/w8a8_smoothquant.py --fp8 --model reference:qwen2.5-coder-1.5b-float-untied \
        --samples 8 --calibration-samples 16                             # issue 55's Qwen rows
    python scripts/experiments/w8a8_smoothquant.py --fp8-only --model reference:smollm2-135m-float   # FP8 RTN vs GPTQ

The model and data (calibration text, and the evaluation text held apart from it) are those of
``recipes/w8a8-smoothquant.yaml``. Each candidate is quantized from the same float model by the stage a
recipe runs (``method: w8a8`` with ``smoothing: null`` and each alpha; ``method: llm_int8`` at threshold
6.0; ``--fp8``: ``method: fp8`` with channel and with block weights, dynamic inputs, each rounded to
nearest and with GPTQ on the E4M3 grid; ``--fp8-only``: those rows alone) and scored against
the float model on the same evaluation sequences: KL divergence, top-1 agreement and perplexity with
their 95% bootstrap intervals. One candidate is in memory at a time (a 1.5B model's float32 copy is
6 GB), each scored in a ``compare`` pass of its own beside the float model, whose perplexity is the
same in every pass. Prints a Markdown table.
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

from side_by_side import print_table, score, shortened_data  # noqa: E402  (this folder: the script's own)

from compress.context import RunContext  # noqa: E402
from compress.eval.bench.quant import load_bench_inputs, working_copy  # noqa: E402
from compress.eval.metrics import torch_forward  # noqa: E402
from compress.progress import Reporter  # noqa: E402
from compress.quantizers.configs import LLMInt8Config, SmoothingConfig, W8A8Config  # noqa: E402
from compress.quantizers.fp8 import FP8Stage  # noqa: E402
from compress.quantizers.fp8_config import FP8Config  # noqa: E402
from compress.quantizers.llm_int8 import LLMInt8Stage  # noqa: E402
from compress.quantizers.w8a8 import W8A8Stage  # noqa: E402
from compress.recipe import load_recipe  # noqa: E402

RECIPE = ROOT / "recipes" / "w8a8-smoothquant.yaml"


def stages(alphas: list[float], fp8: bool, fp8_only: bool, fp8_weights: list[str]) -> dict[str, object]:
    found: dict[str, object] = {}
    if fp8 or fp8_only:
        for weights in fp8_weights:
            for algorithm in ("rtn", "gptq"):
                config = FP8Config(weights=weights, activations="dynamic", algorithm=algorithm)
                found[f"FP8 W8A8, {weights} weights ({algorithm}), dynamic inputs"] = FP8Stage(config, "fp8")
    if fp8_only:
        return found
    found["W8A8 plain (smoothing: null)"] = W8A8Stage(W8A8Config(smoothing=None), "w8a8")
    for alpha in alphas:
        found[f"W8A8 SmoothQuant alpha {alpha:g}"] = W8A8Stage(W8A8Config(smoothing=SmoothingConfig(alpha=alpha)), "w8a8")
    found["LLM.int8() threshold 6.0"] = LLMInt8Stage(LLMInt8Config(threshold=6.0), "llm_int8")
    return found


def main(
    alphas: list[float],
    threads: int,
    fp8: bool,
    model: str | None,
    samples: int | None,
    calibration_samples: int | None,
    fp8_only: bool = False,
    fp8_weights: tuple[str, ...] = ("channel", "block"),
) -> None:
    recipe = load_recipe(RECIPE).recipe
    data = shortened_data(RECIPE, samples, calibration_samples)
    source = model or recipe.model.source
    reporter = Reporter(quiet=True)
    lm, calibration, evaluation, eval_cfg = load_bench_inputs(source, data, threads, reporter, recipe.model.dtype)
    cpu = torch.device("cpu")
    baseline = torch_forward(lm.model, cpu)
    scores, seconds = {}, {}
    for name, stage in stages(alphas, fp8, fp8_only, list(fp8_weights)).items():
        quantized = working_copy(lm.model, stage.config)  # read whole: no stage here streams
        ctx = RunContext(seed=0, device=cpu, tokenizer=lm.tokenizer, reporter=reporter, calibration=lambda: calibration.tokens)
        started = time.perf_counter()
        stage.apply(quantized, ctx)
        seconds[name] = time.perf_counter() - started
        print(f"quantized {name} in {seconds[name]:.1f} s", flush=True)
        score(baseline, name, quantized, evaluation, eval_cfg, scores)
        del quantized
    print_table(source, calibration, evaluation, eval_cfg, threads, scores, seconds, "quantize")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--alphas", default="0.5", help="Comma-separated SmoothQuant alphas, each a row.")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--fp8", action="store_true", help="Add FP8 W8A8 rows (channel and block weights, dynamic inputs; rtn and gptq each)."
    )
    parser.add_argument("--fp8-only", action="store_true", help="Only the FP8 rows (no int8 W8A8 or LLM.int8() rows).")
    parser.add_argument("--fp8-weights", default="channel,block", help="The FP8 rows' weight layouts (comma-separated).")
    parser.add_argument("--model", help="Another model source than the recipe's, e.g. reference:qwen2.5-coder-1.5b-float-untied.")
    parser.add_argument("--samples", type=int, help="Evaluation sequences (the recipe's: 32).")
    parser.add_argument("--calibration-samples", type=int, help="Calibration sequences (the recipe's: 32).")
    args = parser.parse_args()
    main(
        [float(a) for a in args.alphas.split(",")],
        args.threads,
        args.fp8,
        args.model,
        args.samples,
        args.calibration_samples,
        args.fp8_only,
        tuple(args.fp8_weights.split(",")),
    )
