"""Where FP8 W8A8's error on the reference model comes from: KL to the float model on held-out text of
FP8 weights alone (float inputs), of FP8 inputs everywhere, and of FP8 inputs everywhere but the
down_proj layers, for channel and block weights. Each FP8Linear computes as in a run (quantizers/fp8.py).

    python scripts/experiments/fp8_parts.py --samples 4
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch


def main() -> None:
    from compress import streaming
    from compress.context import RunContext
    from compress.data import DataPlan
    from compress.models import load_model
    from compress.progress import Reporter
    from compress.quantizers.fp8 import FP8Linear, FP8Stage
    from compress.quantizers.fp8_config import FP8Config
    from compress.schema.recipe import DataConfig, ModelConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()
    quiet = Reporter(quiet=True)
    lm = load_model(ModelConfig(source="reference:smollm2-135m", dtype="float32"), Path.cwd(), quiet)
    base = streaming.materialize(lm.model).eval()
    data = DataConfig(evaluation={"source": "reference:shakespeare", "samples": args.samples, "seq_len": args.seq_len})
    tokens = DataPlan.load(data, Path.cwd(), quiet).chunks("evaluation", lm.tokenizer).tokens
    with torch.no_grad():
        ref = torch.log_softmax(base(input_ids=tokens).logits.float(), -1)

    def kl(model: torch.nn.Module) -> float:
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=tokens).logits.float(), -1)
        return float((ref.exp() * (ref - logp)).sum(-1)[:, 32:].mean())  # tokens after the first 32, as min_context

    for weights in ("channel", "block"):
        model = copy.deepcopy(base)
        ctx = RunContext(seed=0, device=torch.device("cpu"), tokenizer=None, reporter=quiet, calibration=lambda: None)
        FP8Stage(FP8Config(weights=weights, activations="dynamic"), "stages[0]").apply(model, ctx)
        layers = [(n, m) for n, m in model.named_modules() if isinstance(m, FP8Linear)]
        found = {"W8A8 (dynamic inputs)": kl(model)}
        for _n, m in layers:
            m.activations = None
        found["weights only (float inputs)"] = kl(model)
        for n, m in layers:
            m.activations = None if n.endswith("down_proj") else "dynamic"
        found["W8A8 but float inputs to down_proj"] = kl(model)
        for what, value in found.items():
            print(f"{weights:8s} {what:40s} KL {value:.5f}")


if __name__ == "__main__":
    main()
