"""Our fp8 records against llm-compressor's FP8_DYNAMIC on the reference model: llm-compressor's
oneshot (QuantizationModifier, scheme FP8_DYNAMIC, lm_head ignored) saved compressed, its float8
weights and float32 scales read from the file, compared with our fp8 stage's records (weights:
channel) bit for bit. Both are round-to-nearest on absmax / 448 per row, with dynamic per-token inputs,
so identical records mean the same model in vLLM.

    python scripts/experiments/fp8_llmcompressor.py
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch


def main() -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from safetensors.torch import load_file

    from compress import streaming
    from compress.context import RunContext
    from compress.models import load_model
    from compress.progress import Reporter
    from compress.quantizers.fp8 import FP8Stage, fp8_records
    from compress.quantizers.fp8_config import FP8Config
    from compress.schema.recipe import ModelConfig

    quiet = Reporter(quiet=True)
    lm = load_model(ModelConfig(source="reference:smollm2-135m", dtype="float32"), Path.cwd(), quiet)
    model = streaming.materialize(lm.model)
    ours = copy.deepcopy(model)
    ctx = RunContext(seed=0, device=torch.device("cpu"), tokenizer=None, reporter=quiet, calibration=lambda: None)
    FP8Stage(FP8Config(), "stages[0]").apply(ours, ctx)
    records = fp8_records(ours)

    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, save_compressed=True)
        theirs = {}
        for path in sorted(Path(tmp).glob("*.safetensors")):
            theirs.update(load_file(str(path)))
    same_w = same_s = 0
    worst = 0
    for name, r in records.items():
        w, s = theirs[f"{name}.weight"], theirs[f"{name}.weight_scale"]
        same_w += torch.equal(w.view(torch.uint8), r.weight.view(torch.uint8))
        same_s += torch.equal(s.to(torch.float32).reshape(r.scale.shape), r.scale)
        worst = max(worst, int((w.view(torch.uint8) != r.weight.view(torch.uint8)).sum()))
    print(
        f"{len(records)} layers: float8 weights identical in {same_w}, scales identical in {same_s}; most differing weights in a layer: {worst}"
    )
    print(f"their scale dtype: {theirs[next(iter(records)) + '.weight_scale'].dtype}")


if __name__ == "__main__":
    main()
