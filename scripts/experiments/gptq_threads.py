"""How GPTQ's time on CPU splits with threads: the whole solve on one thread (as before) against
one thread for the column loop only, the factorization and the block updates on every thread.
Layers of Qwen2.5-Coder-1.5B's shapes, Hessians from random activations; medians of repeats.

    OMP_NUM_THREADS=2 python scripts/experiments/gptq_threads.py --repeats 3

Run with nothing else busy: one other process on 2 cores slows torch many-fold.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from compress.quantizers.core import one_cpu_thread
from compress.quantizers.gptq import accumulate_hessian, gptq_quantize
from compress.schema.quantize import QuantScheme

SHAPES = {"q_proj": (1536, 1536), "up_proj": (8960, 1536), "down_proj": (1536, 8960)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    torch.manual_seed(0)
    scheme = QuantScheme(bits=4, group_size=128, symmetric=True)
    print(f"threads {torch.get_num_threads()}, {args.tokens} tokens, W4 g128, medians of {args.repeats}")
    print("| layer | [out, in] | one thread, s | column loop on one thread, s | ratio |")
    print("|---|---|---|---|---|")
    for name, (out_f, in_f) in SHAPES.items():
        w = torch.randn(out_f, in_f) * 0.02
        h = torch.zeros(in_f, in_f)
        accumulate_hessian(h, 0, torch.randn(args.tokens, in_f))
        times = {"one": [], "split": []}
        for _ in range(args.repeats):
            for mode in times:
                start = time.perf_counter()
                if mode == "one":
                    with one_cpu_thread():
                        gptq_quantize(w, h, scheme)
                else:
                    gptq_quantize(w, h, scheme)
                times[mode].append(time.perf_counter() - start)
        one, split = statistics.median(times["one"]), statistics.median(times["split"])
        print(f"| {name} | [{out_f}, {in_f}] | {one:.2f} | {split:.2f} | {one / split:.2f} |")


if __name__ == "__main__":
    main()
