"""How far apart the relative quantization errors of layers of one kind are on real models: what the
calibration check ``layer_error`` (compress/calibration_checks.py) compares, and the data behind its default
limit of 10x the kind's median.

    python scripts/experiments/layer_errors.py                                   # SmolLM2, GPTQ W4 g128 / W3 g128 / W4 g32 asym
    python scripts/experiments/layer_errors.py --model reference:qwen2.5-coder-1.5b --cal 16x512 --schemes w4g128

For each scheme: GPTQ and AWQ on the model with the calibration chunks, then per kind of layer (its
name without the block index) the median relative error (weighted by the calibration's Σx² per
input column for GPTQ) and the largest layer's ratio to it. Prints one table per scheme.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from compress.calibration_checks import layer_kind  # noqa: E402
from compress.context import RunContext  # noqa: E402
from compress.models import load_model  # noqa: E402
from compress.progress import Reporter  # noqa: E402
from compress.quantizers.awq import AWQStage  # noqa: E402
from compress.quantizers.configs import AWQConfig, GPTQConfig  # noqa: E402
from compress.quantizers.gptq import GPTQStage  # noqa: E402
from compress.schema.recipe import ModelConfig  # noqa: E402
from tests.conftest import reference_chunks  # noqa: E402

SCHEMES = {
    "w4g128": {"bits": 4, "group_size": 128, "symmetric": True},
    "w3g128": {"bits": 3, "group_size": 128, "symmetric": True},
    "w4g32a": {"bits": 4, "group_size": 32, "symmetric": False},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="reference:smollm2-135m")
    parser.add_argument("--cal", default="32x512", help="calibration samples x seq_len")
    parser.add_argument("--schemes", default="w4g128,w3g128,w4g32a", help=",".join(SCHEMES))
    parser.add_argument("--methods", default="gptq,awq")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet = Reporter(quiet=True)
    source = load_model(ModelConfig(source=args.model), ROOT, quiet)
    samples, seq_len = (int(x) for x in args.cal.split("x"))
    cal, _ = reference_chunks(source.tokenizer, (samples, seq_len), (1, 64))
    cpu = torch.device("cpu")
    stages = {"gptq": (GPTQStage, GPTQConfig), "awq": (AWQStage, AWQConfig)}
    for scheme in args.schemes.split(","):
        for method in args.methods.split(","):
            stage_cls, config_cls = stages[method]
            model = copy.deepcopy(source.model)
            ctx = RunContext(seed=0, device=cpu, tokenizer=source.tokenizer, reporter=quiet, calibration=lambda: cal)
            record = stage_cls(config_cls(**SCHEMES[scheme]), "s").apply(model, ctx)
            kinds: dict[str, list[tuple[str, float]]] = {}
            for name, info in record.layers.items():
                kinds.setdefault(layer_kind(name), []).append((name, info["relative_error"]))
            print(f"\n{args.model} {method} {scheme}, calibration {args.cal}")
            print("| kind | layers | median | largest | largest / median | smallest / median |")
            print("|---|---|---|---|---|---|")
            for kind, members in kinds.items():
                errors = [e for _, e in members]
                median = statistics.median(errors)
                worst = max(members, key=lambda m: m[1])
                print(
                    f"| {kind} | {len(errors)} | {median:.4g} | {worst[0].split('.')[2]}: {worst[1]:.4g} | "
                    f"{worst[1] / median:.2f} | {min(errors) / median:.2f} |",
                    flush=True,
                )
            del model


if __name__ == "__main__":
    main()
