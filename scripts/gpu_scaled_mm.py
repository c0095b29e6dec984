"""FP8 and FP4 matrix products on a CUDA GPU with torch's own kernels, against bfloat16, and the check
that the FP8 stage's in-memory simulation (``compress.quantizers.fp8.fp8_linear``) is what the kernel
computes. For a lent GPU machine (scripts/gpu_checks.sh runs it); CI has no GPU.

For each weight shape (Qwen2.5-Coder-1.5B's q/o, gate/up and down projections, Llama-3-8B's gate/up and
down) and token count it times, as the median of ``--repeats`` replays of a CUDA graph of ``--calls``
back-to-back calls between two CUDA events (after warm-up; no Python launch overhead):

* ``bf16``: ``F.linear`` in bfloat16 (the baseline);
* ``fp8 rowwise``: ``torch._scaled_mm`` on E4M3 operands, a float32 scale per token and per output
  channel (the stage's ``weights: channel, activations: dynamic``), with and without fast accumulation;
  ``+ quant`` includes quantizing the bfloat16 input per token first (absmax, divide, cast), which a
  serving stack also pays;
* ``fp8 block``: ``F.scaled_mm`` with 1x128 input groups and 128x128 weight tiles (``weights: block``);
* ``nvfp4`` / ``mxfp4``: ``F.scaled_mm`` on packed E2M1 operands with 1x16 E4M3 / 1x32 E8M0 scales:
  Blackwell instructions; on another GPU what torch does (an error, or a crash) is recorded.

Agreement: for each FP8 layout the kernel's float32 (or bfloat16) output against ``fp8_linear`` on the
same record and input, as the largest difference relative to the output's largest magnitude.

    python scripts/gpu_scaled_mm.py [--json OUT.json] [--repeats 5] [--calls 20]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from compress.quantizers.fp8 import FP8Weight, absmax_scale, fp8_linear, quantize_weight_fp8, to_e4m3
from compress.quantizers.fp8_config import BLOCK

SHAPES = {
    "qwen2.5-1.5b q/o (1536 -> 1536)": (1536, 1536),
    "qwen2.5-1.5b gate/up (1536 -> 8960)": (1536, 8960),
    "qwen2.5-1.5b down (8960 -> 1536)": (8960, 1536),
    "llama-3-8b gate/up (4096 -> 14336)": (4096, 14336),
    "llama-3-8b down (14336 -> 4096)": (14336, 4096),
}
TOKENS = (1, 16, 128, 1024, 8192)


def timed(fn, repeats: int, calls: int) -> float:
    """Median seconds per call: ``repeats`` replays of a CUDA graph of ``calls`` back-to-back calls,
    timed between CUDA events, so Python's launch overhead (about 15 us a call) is not in it; on a CPU
    (a dry run of the script) the calls themselves."""
    for _ in range(3):
        fn()
    runs = []
    if not torch.cuda.is_available():
        for _ in range(repeats):
            start_s = time.perf_counter()
            for _ in range(calls):
                fn()
            runs.append((time.perf_counter() - start_s) / calls)
        return statistics.median(runs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) / 1000 / calls)
    return statistics.median(runs)


def per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [tokens, in] as E4M3 with one float32 scale a token (the stage's dynamic inputs)."""
    scale = absmax_scale(x.abs().amax(dim=1, keepdim=True))
    return to_e4m3(x.to(torch.float32) / scale), scale


def per_group(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [tokens, in] (in a multiple of 128) as E4M3 with one float32 scale per token and 128 inputs."""
    tokens, width = x.shape
    groups = x.to(torch.float32).reshape(tokens, width // BLOCK, BLOCK)
    scale = absmax_scale(groups.abs().amax(dim=2))
    return to_e4m3(groups / scale.unsqueeze(2)).reshape(tokens, width), scale


def rowwise(a, a_scale, record, fast: bool, out_dtype):
    return torch._scaled_mm(
        a, record.weight.t(), scale_a=a_scale, scale_b=record.scale.reshape(1, -1), out_dtype=out_dtype, use_fast_accum=fast
    )


def blockwise(a, a_scale, record, out_dtype):
    """1x128 input groups, 128x128 weight tiles: the input scales outer-dimension-major, the weight's
    [out/128, in/128] scale transposed (the layout torch's SM90 block kernel takes). The token count is
    padded to a multiple of 4, and the weight scales' column count too: torch asks for the [in/128, out/128]
    operand with in/128 rounded up to a multiple of 4 (72 x 12 for an 8,960-wide down_proj); padding
    never meets an input group."""
    tokens = a.shape[0]
    pad_m, pad_k = -tokens % 4, -record.scale.shape[1] % 4
    if pad_m:
        a = torch.cat([a, torch.zeros(pad_m, a.shape[1], dtype=a.dtype, device=a.device)])
        a_scale = F.pad(a_scale, (0, 0, 0, pad_m), value=1.0)
    w_scale = F.pad(record.scale, (0, pad_k), value=1.0)  # the padded columns meet no input group
    out = F.scaled_mm(
        a,
        record.weight.t(),
        a_scale.t().contiguous().t(),
        F.ScalingType.BlockWise1x128,
        w_scale.t(),
        F.ScalingType.BlockWise128x128,
        output_dtype=out_dtype,
    )
    return out[:tokens]


def agreement(kernel_out: torch.Tensor, simulated: torch.Tensor) -> float:
    """The largest |kernel - simulation|, relative to the simulation's largest magnitude."""
    return float((kernel_out.float() - simulated).abs().max() / simulated.abs().max())


def attempt(fn):
    try:
        return fn(), None
    except Exception as error:  # noqa: BLE001 - a kernel this GPU or torch lacks is a result to record
        return None, f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"


FP4_PROBE = """
import sys, torch, torch.nn.functional as F
name, group = sys.argv[1], int(sys.argv[2])
fp4 = torch.float4_e2m1fn_x2
scale_dtype = torch.float8_e4m3fn if name == "nvfp4" else torch.float8_e8m0fnu
recipe = F.ScalingType.BlockWise1x16 if name == "nvfp4" else F.ScalingType.BlockWise1x32
m, k, n = 128, 256, 128
a = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, device="cuda").view(fp4)
b = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda").view(fp4)
sa = torch.ones(m, k // group, device="cuda").to(scale_dtype)
sb = torch.ones(n, k // group, device="cuda").to(scale_dtype)
out = F.scaled_mm(a, b.t(), sa, recipe, sb, recipe, output_dtype=torch.bfloat16)
torch.cuda.synchronize()
print("ran", tuple(out.shape))
"""


def fp4_attempts() -> dict[str, str]:
    """Try an NVFP4 (1x16 E4M3 scales) and an MXFP4 (1x32 E8M0 scales) product of 128 x 256 x 128 packed
    operands, each in a process of its own: on a GPU without FP4 tensor cores torch may crash rather
    than raise (a Hopper run here ended in a segmentation fault), and the crash is the result."""
    out: dict[str, str] = {}
    for name, group in (("nvfp4", 16), ("mxfp4", 32)):
        done = subprocess.run([sys.executable, "-c", FP4_PROBE, name, str(group)], capture_output=True, text=True, timeout=120)
        lines = (done.stdout + done.stderr).strip().splitlines()
        out[name] = f"exit {done.returncode}: " + (lines[-1][:300] if lines else "no output")
    return out


def time_products(x: torch.Tensor, weight: torch.Tensor, channel: FP8Weight, block: FP8Weight, args) -> dict:
    """Seconds per call of each product on ``x`` (bfloat16 [tokens, in]), and each FP8 product's speed-up over bfloat16."""
    w16 = weight.to(torch.bfloat16)
    a, s = per_token(x)
    ab, sb = per_group(x)
    row: dict = {"bf16_s": timed(lambda: F.linear(x, w16), args.repeats, args.calls)}
    for key, fn in (
        ("fp8_rowwise_s", lambda: rowwise(a, s, channel, False, torch.bfloat16)),
        ("fp8_rowwise_fast_s", lambda: rowwise(a, s, channel, True, torch.bfloat16)),
        ("fp8_rowwise_with_quant_s", lambda: rowwise(*per_token(x), channel, False, torch.bfloat16)),
        ("fp8_block_s", lambda: blockwise(ab, sb, block, torch.bfloat16)),
    ):
        _, error = attempt(fn)
        row[key] = timed(fn, args.repeats, args.calls) if error is None else error
        if error is None:
            row[key.removesuffix("_s") + "_speedup"] = row["bf16_s"] / row[key]
    row["bf16_tflops"] = 2 * x.shape[0] * x.shape[1] * weight.shape[0] / row["bf16_s"] / 1e12
    return row


def check_agreement(x: torch.Tensor, channel: FP8Weight, block: FP8Weight) -> list[dict]:
    """Each FP8 layout's kernel output (float32 and bfloat16) against ``fp8_linear`` on the same record and input."""
    out = []
    for layout, record, kernel in (
        ("channel", channel, lambda dtype: rowwise(*per_token(x), channel, False, dtype)),
        ("block", block, lambda dtype: blockwise(*per_group(x), block, dtype)),
    ):
        simulated = fp8_linear(x, record, "dynamic", None)
        for out_dtype in (torch.float32, torch.bfloat16):
            got, error = attempt(lambda out_dtype=out_dtype, kernel=kernel: kernel(out_dtype))
            entry = {"layout": layout, "out_dtype": str(out_dtype).removeprefix("torch.")}
            entry.update({"max_relative_difference": agreement(got, simulated)} if error is None else {"error": error})
            out.append(entry)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script's own code (the shapes are small enough)")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    report: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "repeats": args.repeats,
        "calls": args.calls,
        "rows": [],
        "agreement": [],
    }
    for label, (width, out_f) in SHAPES.items():
        weight = torch.randn(out_f, width, device=device) * 0.02
        channel, block = quantize_weight_fp8(weight, "channel"), quantize_weight_fp8(weight, "block")
        for tokens in TOKENS:
            x = torch.randn(tokens, width, device=device).to(torch.bfloat16)
            row = {"shape": label, "in": width, "out": out_f, "tokens": tokens, **time_products(x, weight, channel, block, args)}
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
        x = torch.randn(64, width, device=device)  # the simulation against the kernel, on 64 tokens
        for entry in check_agreement(x, channel, block):
            report["agreement"].append({"shape": label, **entry})
            print(json.dumps(report["agreement"][-1]), flush=True)
    report["fp4"] = fp4_attempts() if device.type == "cuda" else {}
    print(json.dumps(report["fp4"]), flush=True)
    report["bf16_ulp"] = 2.0**-8
    report["note"] = "max_relative_difference is |kernel - simulation|.max() / |simulation|.max(); bfloat16 output rounds to 2**-8 relative"
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if not math.isfinite(sum(e.get("max_relative_difference", 0.0) for e in report["agreement"])):
        raise SystemExit("a kernel result is not finite")


if __name__ == "__main__":
    main()
