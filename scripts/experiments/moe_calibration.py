"""Time and accuracy of GPTQ / AWQ on a random Qwen3-MoE, experts calibrated on their routed tokens
or on every token (docs/quantization.md, "Mixture of experts").

    python scripts/experiments/moe_calibration.py [--experts 32] [--top-k 4] [--hidden 256] [--layers 4]
        [--cal 32x128] [--eval 16x128] [--threads 2] [-o moe-calibration.json]

No Qwen3-MoE checkpoint is in the reference assets, so the model is random (seed 0, the tests' tiny
shape scaled up) and the text is random token ids (calibration and evaluation drawn apart). For each
method, two stages: ``moe.min_tokens: 1`` (every expert on its routed tokens; none is below 1 here,
as the coverage shows) and ``moe.min_tokens`` above any expert's count (every expert on all tokens,
what ``under_min: all_tokens`` does to the experts below it). Each is scored against the float model
(KL, top-1 agreement) on the evaluation tokens; the stage's seconds and coverage are printed too.
Numbers from a random model say how the machinery behaves, not what a trained MoE will get.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from compress.context import RunContext  # noqa: E402
from compress.eval.metrics import compare, torch_forward  # noqa: E402
from compress.progress import Reporter  # noqa: E402
from compress.quantizers.awq import AWQStage  # noqa: E402
from compress.quantizers.configs import AWQConfig, GPTQConfig  # noqa: E402
from compress.quantizers.gptq import GPTQStage  # noqa: E402
from tests.tiny import tiny_model  # noqa: E402


def shape(text: str) -> tuple[int, int]:
    n, length = text.split("x")
    return int(n), int(length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--cal", default="32x128")
    parser.add_argument("--eval", default="16x128")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("-o", "--output", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    vocab = 1000
    base = tiny_model(
        "qwen3_moe",
        vocab=vocab,
        hidden=args.hidden,
        intermediate=2 * args.hidden,
        layers=args.layers,
        heads=8,
        kv_heads=4,
        head_dim=args.hidden // 8,
        positions=512,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.hidden // 2,
    )
    g = torch.Generator().manual_seed(1)
    cal = torch.randint(0, vocab, shape(args.cal), generator=g)
    ev = torch.randint(0, vocab, shape(args.eval), generator=g)
    cpu = torch.device("cpu")
    rows = []
    for method, stage_of in (
        ("gptq", lambda moe: GPTQStage(GPTQConfig(bits=4, group_size=64, moe=moe), "stages[0]")),
        ("awq", lambda moe: AWQStage(AWQConfig(bits=4, group_size=64, moe=moe), "stages[0]")),
    ):
        for label, min_tokens in (("routed", 1), ("all_tokens", cal.numel() * args.top_k + 1)):
            model = copy.deepcopy(base)
            ctx = RunContext(seed=0, device=cpu, tokenizer=None, reporter=Reporter(quiet=True), calibration=lambda: cal)
            start = time.perf_counter()
            record = stage_of({"min_tokens": min_tokens, "under_min": "all_tokens"}).apply(model, ctx)
            seconds = time.perf_counter() - start
            scores = compare(torch_forward(base, cpu), {"q": torch_forward(model, cpu)}, ev, min_context=8, batch_size=4)["q"]
            moe = record.summary["moe"]
            row = {
                "method": method,
                "experts_calibrated_on": label,
                "seconds": round(seconds, 1),
                "kl_divergence": round(scores["kl_divergence"], 5),
                "top1_agreement": round(scores["top1_agreement"], 4),
                "layers_quantized": record.summary["layers_quantized"],
                "experts_under_min": moe["experts_under_min"],
                "min_expert_tokens": moe["min_expert_tokens"],
                "max_expert_tokens": max(n for b in moe["blocks"] for n in b["tokens_per_expert"]),
            }
            rows.append(row)
            print(json.dumps(row))
    if args.output:
        args.output.write_text(json.dumps({"args": vars(args) | {"output": str(args.output)}, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
