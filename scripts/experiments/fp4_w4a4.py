"""FP4 W4A4 (NVFP4 and MXFP4 inputs) with and without a rotation first, and NVFP4 weight-only AWQ against RTN and
GPTQ, on one model and the same text (issue 55, items 2 and 5).

    python scripts/experiments/fp4_w4a4.py --model reference:smollm2-135m-float --samples 8
    python scripts/experiments/fp4_w4a4.py --model reference:qwen2.5-coder-1.5b-float-untied --samples 8

The data (calibration text, and the evaluation text held apart from it) are ``recipes/nvfp4-w4a4.yaml``'s,
16 x 512 calibration tokens by default. Each candidate is a chain of recipe stages applied to a copy of the float
model by the stages a recipe runs (``rotate: {kind: hadamard}`` before ``quantize: {method: fp4, ...}``), and
scored against the float model on the same evaluation sequences: KL divergence, top-1 agreement and perplexity
with their 95% bootstrap intervals (scripts/experiments/side_by_side.py). One candidate is in memory at a time;
each is printed as it is scored. ``--only`` picks candidates by a substring of their names. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from side_by_side import score_chains  # noqa: E402  (this folder: the script's own)

RECIPE = ROOT / "recipes" / "nvfp4-w4a4.yaml"
ROTATE = {"rotate": {"kind": "hadamard", "residual": True, "heads": True, "seed": 0}}


def fp4(fmt: str, algorithm: str, activations: str | None) -> dict:
    return {"quantize": {"method": "fp4", "format": fmt, "algorithm": algorithm, "activations": activations, "ignore": ["lm_head"]}}


def candidates() -> dict[str, list[dict]]:
    """Each candidate's recipe stages: W4A4 with and without the rotation, then weight-only by algorithm (NVFP4: rtn,
    awq, gptq, and rtn after the rotation; MXFP4: rtn, gptq)."""
    found: dict[str, list[dict]] = {}
    for fmt, algorithm in (("nvfp4", "rtn"), ("nvfp4", "gptq"), ("mxfp4", "rtn")):
        name = f"{fmt.upper()} W4A4 {algorithm.upper()}"
        found[name] = [fp4(fmt, algorithm, "dynamic")]
        found[f"hadamard rotation + {name}"] = [ROTATE, fp4(fmt, algorithm, "dynamic")]
    for algorithm in ("rtn", "awq", "gptq"):
        found[f"NVFP4 W4A16 {algorithm.upper()}"] = [fp4("nvfp4", algorithm, None)]
    for algorithm in ("rtn", "gptq"):
        found[f"MXFP4 W4A16 {algorithm.upper()}"] = [fp4("mxfp4", algorithm, None)]
    found["hadamard rotation + NVFP4 W4A16 RTN"] = [ROTATE, fp4("nvfp4", "rtn", None)]  # the rotation's effect on the weights alone
    return found


def main(args: argparse.Namespace) -> None:
    chains = {name: chain for name, chain in candidates().items() if not args.only or any(o in name for o in args.only.split(","))}
    score_chains(args, RECIPE, chains)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="reference:smollm2-135m-float")
    parser.add_argument("--samples", type=int, default=32, help="Evaluation sequences.")
    parser.add_argument("--calibration-samples", type=int, default=16, help="Calibration sequences (GPTQ, AWQ, NVFP4 input scales).")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default="", help="Comma-separated substrings: run only the candidates whose names contain one.")
    main(parser.parse_args())
