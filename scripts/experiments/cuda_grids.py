"""The parameter search on llama.cpp's grids (quantizers/grid_search.py: ranges and least-squares refit)
and GPTQ on those grids, run on a CUDA device against the same work on the CPU: for each type, the
share of codes that agree, the rounding error on each device, and whether the CUDA records pack into
GGUF blocks that gguf-py's dequantizer reads back bit for bit. CI has no GPU; run it where one is lent:

    python scripts/experiments/cuda_grids.py [--rows 512] [--cols 2048]

Prints one JSON line per type and method and exits 1 if a CUDA record does not read back exactly.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf import quants  # noqa: E402

from compress.export.gguf.blocks import PACKERS  # noqa: E402
from compress.quantizers.gptq import gptq_quantize  # noqa: E402
from compress.quantizers.grid_search import grid_quantize  # noqa: E402
from compress.quantizers.grids import GRID_NAMES  # noqa: E402
from compress.schema.quantize import QuantScheme  # noqa: E402


def timed(fn, device: str):
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--cols", type=int, default=2048)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(args.rows, args.cols, generator=g) * 0.02 + 0.002 * torch.randn(args.rows, 1, generator=g)
    w[::17, 3] = 0.3
    x = torch.randn(4 * args.cols, args.cols, generator=g) * torch.linspace(0.1, 3, args.cols)
    h = 2 * x.T @ x / x.shape[0]
    failed = False
    print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "shape": [args.rows, args.cols]}))
    for type_name in GRID_NAMES:
        scheme = QuantScheme(gguf_type=type_name)
        for method in ("rtn", "gptq"):
            found = {}
            for device in ("cpu", "cuda"):
                wd, hd = w.to(device), h.to(device)
                work = partial(grid_quantize, wd, scheme) if method == "rtn" else partial(gptq_quantize, wd, hd, scheme, act_order=True)
                record, seconds = timed(work, device)
                record = record if method == "rtn" else record[0]
                values = record.dequantize().float().cpu()
                err = (values - w) @ h @ (values - w).T if method == "gptq" else (values - w).square()
                found[device] = (record, seconds, float(err.trace() if method == "gptq" else err.sum()))
            cuda_record = found["cuda"][0]
            cpu_record = type(cuda_record).from_tensors({k: v.cpu() for k, v in cuda_record.tensors("r").items()}, "r", cuda_record.scheme)
            blocks = PACKERS[type_name](cpu_record)
            got = quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name.upper()]).reshape(cpu_record.shape)
            exact = bool(np.array_equal(got, cpu_record.dequantize().numpy()))
            failed |= not exact
            agree = float((found["cpu"][0].codes == cuda_record.codes.cpu()).float().mean())
            row = {
                "type": type_name,
                "method": method,
                "codes_agree": round(agree, 5),
                "error_cpu": found["cpu"][2],
                "error_cuda": found["cuda"][2],
                "seconds_cpu": round(found["cpu"][1], 3),
                "seconds_cuda": round(found["cuda"][1], 3),
                "cuda_blocks_read_back_exactly": exact,
            }
            print(json.dumps(row), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
