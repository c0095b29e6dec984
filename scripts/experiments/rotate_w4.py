"""W4 integer weights with and without a rotation first, on one model and the same text (issue 55, item 5:
QuaRot's claim is that the rotation closes most of round-to-nearest's gap).

    python scripts/experiments/rotate_w4.py --model reference:smollm2-135m-float --gptq
    python scripts/experiments/rotate_w4.py --model reference:qwen2.5-coder-1.5b-float-untied --samples 8

The data (calibration text, and the evaluation text held apart from it) are ``recipes/rotate-w4.yaml``'s.
Each candidate is a chain of recipe stages applied to a copy of the float model by the stages a recipe
runs (``rotate: {kind: hadamard}`` before ``quantize``), and scored against the float model on the
same evaluation sequences: KL divergence, top-1 agreement and perplexity with their 95% bootstrap
intervals. One candidate is in memory at a time. ``--gptq`` adds the GPTQ rows (calibrated: minutes
on a 135M model, about 40 on a 1.5B one). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from side_by_side import score_chains  # noqa: E402  (this folder: the script's own)

RECIPE = ROOT / "recipes" / "rotate-w4.yaml"
ROTATE = {"rotate": {"kind": "hadamard", "residual": True, "heads": True, "seed": 0}}


def candidates(group: int | None, gptq: bool) -> dict[str, list[dict]]:
    """Each candidate's recipe stages."""
    label = "per channel" if group is None else f"g{group}"
    found: dict[str, list[dict]] = {}
    for method in ("rtn", "gptq") if gptq else ("rtn",):
        quantize = {"quantize": {"method": method, "bits": 4, "group_size": group, "symmetric": True, "ignore": ["lm_head"]}}
        found[f"{method.upper()} W4 {label}"] = [quantize]
        found[f"hadamard rotation + {method.upper()} W4 {label}"] = [ROTATE, quantize]
    return found


def main(args: argparse.Namespace) -> None:
    groups = [None if g == "channel" else int(g) for g in args.groups.split(",")]
    chains = {"hadamard rotation alone (no quantization: its KL is the rotation's float32 rounding)": [ROTATE]} if args.check else {}
    chains.update({name: chain for group in groups for name, chain in candidates(group, args.gptq).items()})
    score_chains(args, RECIPE, chains)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="reference:smollm2-135m-float")
    parser.add_argument("--groups", default="128,channel", help="Comma-separated group sizes; 'channel': one scale per row.")
    parser.add_argument("--gptq", action="store_true", help="Add GPTQ rows (calibrated).")
    parser.add_argument("--samples", type=int, default=32, help="Evaluation sequences.")
    parser.add_argument("--calibration-samples", type=int, default=128, help="Calibration sequences (GPTQ).")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--check", action="store_true", help="First a row with the rotation alone: its KL must be ~0.")
    main(parser.parse_args())
