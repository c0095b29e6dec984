"""The QuantMethod of ``quantize: {method: fp8}`` (quantizers/fp8.py). Torch-free: the stage is
imported when a run builds it; its plan formula sits here, the shared numbers in compress.eval.plan.estimates.

`compress plan` sizes an fp8 layer from its config's scheme (8 bits a weight and one float32 scale a
row: ``FP8Config.scheme()``); block scales are fewer (one a 128 x 128 tile), so the plan overstates a
block layer by at most 4 bytes a row.
"""

from __future__ import annotations

from typing import Any

from compress.eval.plan.estimates import RTN_WEIGHTS_PER_S, Estimate, PlanStep, forward_s
from compress.plugin_types import QuantMethod
from compress.quantizers.fp8_config import FP8Config
from compress.quantizers.plugin import GPTQ, calibrated_estimate, layer_weights


def _fp8_stage() -> type:
    from compress.quantizers.fp8 import FP8Stage

    return FP8Stage


def _fp8_estimate(step: PlanStep, layers: dict[str, Any]) -> Estimate:
    if step.config.uses_gptq:  # the same Hessians, solves and column loop as method gptq (static input scales: one forward more)
        return GPTQ.estimate(step, layers)
    weights = layer_weights(layers)
    rounding = weights / RTN_WEIGHTS_PER_S
    if step.config.activations == "static":  # one forward to find each layer's input absmax, then rounding
        seconds = forward_s(step.shape.params, step.cal_tokens) + rounding
        how = f"one forward over {step.cal_tokens:,} calibration tokens, then rounding"
        return calibrated_estimate(step, layers, seconds, how, 0, "one absmax per input feature")
    widest = max((r.out_f * r.in_f for r in layers.values()), default=0)
    return Estimate(
        step.held_bytes + weights + 8 * widest,  # every layer's float8 weight kept; the largest layer's float32 work copies
        rounding,
        f"the libraries + the model + a byte a quantized weight (the float8 weights the layers keep) + the largest layer's "
        f"float32 copies; ~{RTN_WEIGHTS_PER_S:.0e} weights/s",
    )


FP8 = QuantMethod(
    name="fp8",
    config=FP8Config,
    load_stage=_fp8_stage,
    estimate=_fp8_estimate,
    cost=1,
    description="FP8 E4M3 weights (per-row or 128x128-block float32 scales), rounded to nearest or with GPTQ's error feedback on "
    "the E4M3 grid, and FP8 inputs scaled per token or per layer (W8A8)",
)
