"""Our fp4 stage against llm-compressor's NVFP4A16 / MXFP4A16 on one model, the same calibration and
evaluation text, side by side in one run.

    python scripts/experiments/fp4_llmcompressor.py                               # SmolLM2 float reference, NVFP4
    python scripts/experiments/fp4_llmcompressor.py --formats nvfp4,mxfp4 --samples 8 --calibration-samples 16
    python scripts/experiments/fp4_llmcompressor.py --model reference:qwen2.5-coder-1.5b-float-untied --algorithms rtn

For each format, four candidates from the same float model: our ``method: fp4`` with ``algorithm: rtn``
and ``algorithm: gptq`` (the stages a recipe runs), and llm-compressor 0.14's ``oneshot`` with
``QuantizationModifier(scheme="<FORMAT>A16")`` (round to nearest) and ``GPTQModifier(scheme=...)``
(GPTQ on the FP4 grid, static act order, dampening 0.01, block 128 as ours), both with ``lm_head``
ignored and fed our calibration chunks. llm-compressor's results are saved compressed
(``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized``), read from the file as our FP4 records, and run by
our FP4 layers: the model vLLM would load from that checkpoint (weight-only: its inputs stay float).
Printed: how many of llm-compressor's round-to-nearest layers equal ours byte for byte (codes, scales,
global scale) and in their dequantized values (the one byte difference seen: a weight that is exactly -0.0
in the source is code 8, -0, here and 0 in llm-compressor's file), and the table of KL divergence, top-1 agreement and perplexity against the float model
with 95% bootstrap intervals (scripts/experiments/side_by_side.py).
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from side_by_side import print_table, score, shortened_data  # noqa: E402  (this folder: the script's own)

from compress import streaming  # noqa: E402
from compress.context import RunContext  # noqa: E402
from compress.eval.bench.quant import load_bench_inputs, working_copy  # noqa: E402
from compress.eval.metrics import torch_forward  # noqa: E402
from compress.progress import Reporter  # noqa: E402
from compress.quantizers.apply import swap_module  # noqa: E402
from compress.quantizers.fp4 import FP4Linear, FP4Stage, FP4Weight, fp4_records  # noqa: E402
from compress.quantizers.fp4_config import FP4Config  # noqa: E402
from compress.quantizers.llmcompressor_backend import run_oneshot  # noqa: E402

RECIPE = ROOT / "recipes" / "w8a8-smoothquant.yaml"  # its data: calibration text, and evaluation text held apart from it


def llmcompressor_records(model: torch.nn.Module, tokens: torch.Tensor, ctx: RunContext, fmt: str, algorithm: str) -> dict[str, FP4Weight]:
    """llm-compressor's ``<FMT>A16`` records of ``model``'s Linears (lm_head ignored), read from its compressed save."""
    from llmcompressor.core import reset_session
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from safetensors.torch import load_file

    scheme = f"{fmt.upper()}A16"
    if algorithm == "rtn":
        modifier = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    else:
        modifier = GPTQModifier(targets="Linear", scheme=scheme, ignore=["lm_head"], dampening_frac=0.01, block_size=128, actorder="static")
    work = run_oneshot(streaming.materialize(model), tokens, ctx, [modifier], batch_size=8)  # oneshot needs real tensors
    with tempfile.TemporaryDirectory(prefix="compress-llmc-fp4-") as tmp:
        work.save_pretrained(tmp, save_compressed=True)
        tensors: dict[str, torch.Tensor] = {}
        for path in sorted(Path(tmp).glob("*.safetensors")):
            tensors.update(load_file(str(path)))
    del work
    reset_session()  # llm-compressor's session holds the model it compressed: a 1.5B model's float32 copy is 6 GB
    gc.collect()
    names = sorted(k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed"))
    return {name: FP4Weight.from_tensors(tensors, name, fmt) for name in names}


def with_records(model: torch.nn.Module, records: dict[str, FP4Weight]) -> torch.nn.Module:
    """A copy of the float ``model`` whose Linears ``records`` names compute with those records (FP4Linear)."""
    work = working_copy(model, FP4Config())
    for name, record in records.items():
        swap_module(work, name, FP4Linear(work.get_submodule(name), record))
    return work


def same_bytes(ours: dict[str, FP4Weight], theirs: dict[str, FP4Weight]) -> str:
    """How many of ``theirs``' layers equal ``ours`` byte for byte (codes, group scales, global scale)."""

    def equal(a: FP4Weight, b: FP4Weight) -> bool:
        same_global = (a.global_scale is None) == (b.global_scale is None) and (
            a.global_scale is None or torch.equal(a.global_scale.reshape(-1), b.global_scale.reshape(-1))
        )
        return torch.equal(a.packed, b.packed) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8)) and same_global

    same = sum(equal(ours[n], theirs[n]) for n in theirs if n in ours)
    # a weight that is exactly -0.0 in the source: code 8 (-0) here, 0 in llm-compressor's file; the same value
    values = sum(torch.equal(ours[n].dequantize(), theirs[n].dequantize()) for n in theirs if n in ours)
    return f"{same} of {len(theirs)} layers identical byte for byte, {values} in their dequantized values (ours: {len(ours)})"


def main(
    model: str | None, formats: list[str], threads: int, samples: int | None, calibration_samples: int | None, algorithms: list[str]
) -> None:
    data = shortened_data(RECIPE, samples, calibration_samples)
    source = model or "reference:smollm2-135m-float"
    reporter = Reporter(quiet=True)
    lm, calibration, evaluation, eval_cfg = load_bench_inputs(source, data, threads, reporter, "float32")
    cpu = torch.device("cpu")
    baseline = torch_forward(lm.model, cpu)
    ctx_of = lambda: RunContext(seed=0, device=cpu, tokenizer=lm.tokenizer, reporter=reporter, calibration=lambda: calibration.tokens)  # noqa: E731
    scores: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    for fmt in formats:
        ours_rtn: dict[str, FP4Weight] = {}
        for algorithm in algorithms:
            name = f"compress fp4 {fmt} {algorithm}"
            work = working_copy(lm.model, FP4Config(format=fmt, algorithm=algorithm))
            started = time.perf_counter()
            FP4Stage(FP4Config(format=fmt, algorithm=algorithm), "fp4").apply(work, ctx_of())
            seconds[name] = time.perf_counter() - started
            if algorithm == "rtn":
                ours_rtn = fp4_records(work)
            score(baseline, name, work, evaluation, eval_cfg, scores)
            del work

            name = f"llm-compressor {fmt.upper()}A16 {algorithm}"
            started = time.perf_counter()
            theirs = llmcompressor_records(lm.model, calibration.tokens, ctx_of(), fmt, algorithm)
            seconds[name] = time.perf_counter() - started
            if algorithm == "rtn":
                print(f"{fmt} round to nearest, llm-compressor against compress: {same_bytes(ours_rtn, theirs)}", flush=True)
            work = with_records(lm.model, theirs)
            score(baseline, name, work, evaluation, eval_cfg, scores)
            del work
    print_table(source, calibration, evaluation, eval_cfg, threads, scores, seconds, "quantize")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="Model source (default reference:smollm2-135m-float, the float reference).")
    parser.add_argument("--formats", default="nvfp4", help="Comma-separated: nvfp4, mxfp4.")
    parser.add_argument("--algorithms", default="rtn,gptq", help="Comma-separated: rtn, gptq (each run by both tools).")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--samples", type=int, help="Evaluation sequences (recipes/w8a8-smoothquant.yaml's by default).")
    parser.add_argument("--calibration-samples", type=int, help="Calibration sequences (recipes/w8a8-smoothquant.yaml's by default).")
    args = parser.parse_args()
    main(args.model, args.formats.split(","), args.threads, args.samples, args.calibration_samples, args.algorithms.split(","))
