"""How much each step of the parameter search on a llama.cpp type's grid (quantizers/grid_search.py)
lowers the rounding error of a real model's weights, and what it costs: for each type, round-to-nearest
of the Linear weights of a few blocks with the plain min/max range, with the earlier search over eight
shrunk ranges, with today's ranges (``CLIP``) each refit by least squares (``REFIT_ROUNDS``), and with
the K-quants' sub-block step search added (``SUB_STEPS``; no change for the legacy types).

    python scripts/experiments/grid_refit.py [--model reference:smollm2-135m] [--blocks 0,7,15,29] [--types q4_0,q5_1,q4_k]

Prints, per type, the squared error summed over the weights of the chosen blocks, relative to the
plain range's (the absolute sum where the plain range is exact: the source's own grid), and the seconds each took (torch threads as set by ``--threads``). Unweighted: RTN's
error; GPTQ weighs the same search by its Hessian diagonal.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

from compress.eval.bench.memory import model_directory  # noqa: E402
from compress.progress import Reporter  # noqa: E402
from compress.quantizers import grid_search  # noqa: E402
from compress.quantizers.grids import GRID_NAMES  # noqa: E402
from compress.schema.quantize import QuantScheme  # noqa: E402

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SETTINGS = {  # name: (CLIP, REFIT_ROUNDS, SUB_STEPS)
    "plain range": ((1.0,), 0, ()),
    "8 shrunk ranges": ((1.0, 0.97, 0.94, 0.91, 0.88, 0.85, 0.82, 0.79), 0, ()),  # the search before the refit (6b22e11)
    "ranges + refit": (grid_search.CLIP, grid_search.REFIT_ROUNDS, ()),  # before the K-quant sub-block search
    "+ sub-block steps": (grid_search.CLIP, grid_search.REFIT_ROUNDS, grid_search.SUB_STEPS),  # today's
}


def block_weights(model: str, blocks: list[int]) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for shard in sorted(model_directory(model, Reporter()).glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                parts = name.split(".")
                if name.endswith(".weight") and parts[-2] in LINEARS and int(parts[2]) in blocks:
                    found[name] = f.get_tensor(name).to(torch.float32)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="reference:smollm2-135m")
    ap.add_argument("--blocks", default="0,7,15,29")
    ap.add_argument("--types", default=",".join(GRID_NAMES))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    weights = block_weights(args.model, [int(b) for b in args.blocks.split(",")])
    print(f"{len(weights)} weights, {sum(w.numel() for w in weights.values()):,} parameters, {args.threads} threads")
    print(f"{'type':6} " + " ".join(f"{name:>24}" for name in SETTINGS))
    for type_name in args.types.split(","):
        scheme = QuantScheme(gguf_type=type_name)
        cells, base = [], None
        for clip, rounds, steps in SETTINGS.values():
            grid_search.CLIP, grid_search.REFIT_ROUNDS, grid_search.SUB_STEPS = clip, rounds, steps
            start, err = time.perf_counter(), 0.0
            for w in weights.values():
                err += float((grid_search.grid_quantize(w, scheme).dequantize().float() - w).square().sum())
            seconds = time.perf_counter() - start
            base = err if base is None else base
            cells.append(f"{err / base if base else err:8.4f}{' x' if base else '  '} {seconds:7.1f} s")
        print(f"{type_name:6} " + " ".join(f"{c:>24}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
