"""How much calibration text, and how many blocks, the real-model "GPTQ and AWQ beat RTN at W3" test needs.

    python scripts/experiments/calibration_margin.py 32x512 64x512 128x512
    python scripts/experiments/calibration_margin.py 8x256 --blocks 10 --eval 8x256

For each calibration size: W3 g128 symmetric RTN, GPTQ and AWQ on the reference model (SmolLM2-135M)
(every decoder block, or the first ``--blocks N``), KL against the float model on held-out tokens
(``--eval``, default 8 x 512), the ratio of each calibrated method's KL to RTN's, and the seconds each
method took.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from compress.context import RunContext  # noqa: E402
from compress.eval.metrics import compare, torch_forward  # noqa: E402
from compress.models import load_model  # noqa: E402
from compress.progress import Reporter  # noqa: E402
from compress.quantizers.awq import AWQStage  # noqa: E402
from compress.quantizers.configs import AWQConfig, GPTQConfig, RTNConfig  # noqa: E402
from compress.quantizers.gptq import GPTQStage  # noqa: E402
from compress.quantizers.rtn import RTNStage  # noqa: E402
from compress.schema.recipe import ModelConfig  # noqa: E402
from tests.conftest import reference_chunks  # noqa: E402


def main(sizes: list[str], blocks: int | None, evaluation: tuple[int, int], threads: int) -> None:
    torch.set_num_threads(threads)
    targets = ["*"] if blocks is None else [rf"re:model\.layers\.({'|'.join(map(str, range(blocks)))})\..*"]
    quiet = Reporter(quiet=True)
    source = load_model(ModelConfig(source="reference:smollm2-135m"), ROOT, quiet)
    cpu = torch.device("cpu")
    for size in sizes:
        samples, seq_len = (int(x) for x in size.split("x"))
        cal, ev = reference_chunks(source.tokenizer, (samples, seq_len), evaluation)
        stages = {
            "rtn": RTNStage(RTNConfig(bits=3, group_size=128, symmetric=True, targets=targets), "s"),
            "gptq": GPTQStage(GPTQConfig(bits=3, group_size=128, symmetric=True, targets=targets), "s"),
            "awq": AWQStage(AWQConfig(bits=3, group_size=128, symmetric=True, targets=targets), "s"),
        }
        candidates, seconds = {}, {}
        for name, stage in stages.items():
            model = copy.deepcopy(source.model)
            ctx = RunContext(seed=0, device=cpu, tokenizer=source.tokenizer, reporter=quiet, calibration=lambda cal=cal: cal)
            started = time.perf_counter()
            stage.apply(model, ctx)
            seconds[name] = time.perf_counter() - started
            candidates[name] = torch_forward(model, cpu)
        kl = {k: m["kl_divergence"] for k, m in compare(torch_forward(source.model, cpu), candidates, ev, 32).items()}
        print(
            f"calibration {size}: KL rtn {kl['rtn']:.4f} gptq {kl['gptq']:.4f} ({kl['gptq'] / kl['rtn']:.3f} of rtn) "
            f"awq {kl['awq']:.4f} ({kl['awq'] / kl['rtn']:.3f} of rtn); seconds " + " ".join(f"{k} {v:.0f}" for k, v in seconds.items()),
            flush=True,
        )


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", nargs="*", default=["32x512", "64x512", "128x512"], help="calibration SAMPLESxSEQ_LEN")
    parser.add_argument("--blocks", type=int, default=None, help="quantize only the first N decoder blocks")
    parser.add_argument("--eval", default="8x512", help="evaluation SAMPLESxSEQ_LEN")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    n, length = (int(x) for x in args.eval.split("x"))
    main(args.sizes, args.blocks, (n, length), args.threads)
