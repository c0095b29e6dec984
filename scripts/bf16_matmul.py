"""How much slower torch's bfloat16 Linear is than float32 on this CPU, forward and backward, at the
shapes our passes use (a block's MLP projection, the output head). On x86 CPUs without AVX512-BF16 or
AMX, bfloat16 GEMMs can fall to a far slower path; a bfloat16 source model (Qwen2.5-Coder-1.5B's
asset) then makes the GGUF budget's sensitivity pass and GPTQ many times slower than on a CPU that has
them. Prints the CPU's relevant flags, each shape's median seconds of ``--repeats`` runs and the ratio.

    python scripts/bf16_matmul.py [--rows 64] [--repeats 3] [--threads 2] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

SHAPES = {"mlp down_proj (8960 -> 1536)": (8960, 1536), "output head (1536 -> 151936)": (1536, 151936)}


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in flags if f.startswith(("avx", "amx")) or f in ("f16c", "fma"))


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64, help="tokens per matmul")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = {"torch": torch.__version__, "threads": args.threads, "rows": args.rows, "cpu_flags": cpu_flags(), "shapes": {}}
    for label, (n_in, n_out) in SHAPES.items():
        w32 = torch.randn(n_out, n_in) / n_in**0.5
        x32 = torch.randn(args.rows, n_in)
        row = {}
        for dtype in (torch.float32, torch.bfloat16):
            w, x = w32.to(dtype), x32.to(dtype).requires_grad_(True)

            def step(w: torch.Tensor = w, x: torch.Tensor = x) -> None:
                (g,) = torch.autograd.grad(torch.nn.functional.linear(x, w).float().square().sum(), x)

            row[str(dtype).removeprefix("torch.")] = round(timed(step, args.repeats), 4)
        row["bfloat16 / float32"] = round(row["bfloat16"] / row["float32"], 1)
        result["shapes"][label] = row
        print(f"{label}: float32 {row['float32']:.3f} s, bfloat16 {row['bfloat16']:.3f} s, {row['bfloat16 / float32']} x", flush=True)
    print("CPU flags:", " ".join(result["cpu_flags"]) or "(unknown)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
