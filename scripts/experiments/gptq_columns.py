"""GPTQ's column loop on CPU: as it was (torch's own ops, every column's error sent at once to the
rest of its 128-column block) against NumPy views with sub-blocks of 16 columns (``gptq_quantize``'s
``numpy_columns`` and ``sub_block``). Per layer:
time, whether NumPy and torch give the same record bit for bit at the same sub-blocks, and the share
of codes equal to the one-level loop's (the sums are the same, their float rounding not). SmolLM2's and
Qwen2.5-1.5B's layer shapes, Hessians from random activations; medians of repeats.

    OMP_NUM_THREADS=2 python scripts/experiments/gptq_columns.py --repeats 3
    OMP_NUM_THREADS=2 python scripts/experiments/gptq_columns.py --reference   # the whole stage on SmolLM2-135M

Run with nothing else busy: one other process on 2 cores slows torch many-fold.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from compress.quantizers import gptq
from compress.quantizers.configs import GPTQConfig
from compress.schema.quantize import QuantScheme

SHAPES = {
    "SmolLM2 q_proj": (576, 576),
    "SmolLM2 up_proj": (1536, 576),
    "SmolLM2 down_proj": (576, 1536),
    "Qwen2.5-1.5B q_proj": (1536, 1536),
}
SUB_BLOCK = 16  # gptq_quantize's default
SCHEMES = {
    "W4 g64 sym": QuantScheme(bits=4, group_size=64, symmetric=True),
    "Q4_K": QuantScheme(gguf_type="q4_k"),
}


def reference_stage(repeats: int) -> None:
    """The GPTQ stage (W4 g64 sym, act_order) on the reference model with 16 x 256 calibration
    tokens, both loops: wall time and the share of the 210 layers' codes they agree on."""
    from pathlib import Path

    from compress import streaming
    from compress.context import RunContext
    from compress.data import DataPlan
    from compress.models import load_model
    from compress.progress import Reporter
    from compress.schema.recipe import DataConfig, ModelConfig

    root, quiet = Path(__file__).resolve().parents[2], Reporter(quiet=True)
    lm = load_model(ModelConfig(source="reference:smollm2-135m"), root, quiet)
    lm.model = streaming.materialize(lm.model)
    data = DataConfig(calibration={"source": "reference:shakespeare", "samples": 16, "seq_len": 256})
    cal = DataPlan.load(data, root, quiet).chunks("calibration", lm.tokenizer).tokens
    times, codes = {}, {}
    for _ in range(repeats):
        for variant, (numpy, size) in {"before": (False, 128), "now": (True, SUB_BLOCK)}.items():
            model = copy.deepcopy(lm.model)
            ctx = RunContext(seed=0, device=torch.device("cpu"), tokenizer=lm.tokenizer, reporter=quiet, calibration=lambda: cal)
            start = time.perf_counter()
            gptq.GPTQStage(GPTQConfig(bits=4, group_size=64), "s", sub_block=size, numpy_columns=numpy).apply(model, ctx)
            times.setdefault(variant, []).append(time.perf_counter() - start)
            codes[variant] = [m.weight.detach().clone() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    same = sum(int((a == b).sum()) for a, b in zip(codes["before"], codes["now"], strict=True))
    total = sum(a.numel() for a in codes["now"])
    before, now = statistics.median(times["before"]), statistics.median(times["now"])
    print(f"GPTQ stage, SmolLM2-135M, W4 g64 sym, 16 x 256 tokens, threads {torch.get_num_threads()}, medians of {repeats}")
    print(f"before {before:.1f} s, now {now:.1f} s, before / now {before / now:.2f}; equal weights {same / total:.5f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--reference", action="store_true", help="time the whole stage on the reference model")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.reference:
        reference_stage(args.repeats)
        return
    print(f"threads {torch.get_num_threads()}, {args.tokens} tokens, act_order, medians of {args.repeats}")
    print("| layer | [out, in] | grid | before, s | now, s | before / now | NumPy = torch | codes as before |")
    print("|---|---|---|---|---|---|---|---|")
    variants = {"before": (False, 128), "now": (True, SUB_BLOCK), "torch": (False, SUB_BLOCK)}
    for name, (out_f, in_f) in SHAPES.items():
        w = torch.randn(out_f, in_f) * 0.02
        h = torch.zeros(in_f, in_f)
        gptq.accumulate_hessian(h, 0, torch.randn(args.tokens, in_f))
        for grid, scheme in SCHEMES.items():
            times: dict[str, list[float]] = {v: [] for v in variants}
            records = {}
            for _ in range(args.repeats):
                for variant, (numpy, size) in variants.items():
                    start = time.perf_counter()
                    records[variant], _ = gptq.gptq_quantize(w, h, scheme, sub_block=size, numpy_columns=numpy)
                    times[variant].append(time.perf_counter() - start)
            fields = ("codes", "scale", "zero_point")
            same = all(torch.equal(getattr(records["now"], f), getattr(records["torch"], f)) for f in fields)
            kept = (records["now"].codes == records["before"].codes).double().mean().item()
            before, now = statistics.median(times["before"]), statistics.median(times["now"])
            print(f"| {name} | [{out_f}, {in_f}] | {grid} | {before:.2f} | {now:.2f} | {before / now:.2f} | {same} | {kept:.5f} |")


if __name__ == "__main__":
    main()
