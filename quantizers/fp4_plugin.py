"""The QuantMethod of ``quantize: {method: fp4}`` (quantizers/fp4.py). Torch-free: the stage is imported
when a run builds it; its plan formula sits here, the shared numbers in compress.eval.plan.estimates.

`compress plan` sizes an fp4 layer from its config's scheme (``FP4Config.scheme()``: 4 bits a weight, an
8-bit scale a group of 16 (nvfp4) or 32 (mxfp4), and nvfp4's float32 per tensor): 4.5 and 4.25 bits a weight.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from compress.eval.plan.estimates import RTN_WEIGHTS_PER_S, Estimate, PlanStep, forward_s
from compress.plugin_types import QuantMethod
from compress.quantizers.fp4_config import FP4Config
from compress.quantizers.plugin import AWQ, GPTQ, layer_weights


def _fp4_stage() -> type:
    from compress.quantizers.fp4 import FP4Stage

    return FP4Stage


def _fp4_estimate(step: PlanStep, layers: dict[str, Any]) -> Estimate:
    estimate = _fp4_weights_estimate(step, layers)
    if not step.config.calibrates_inputs:
        return estimate
    # nvfp4 W4A4: one more forward over the calibration tokens for each layer's input absmax
    seconds = estimate.seconds + forward_s(step.shape.params, step.cal_tokens)
    how = f"{estimate.basis}; + one forward over {step.cal_tokens:,} calibration tokens (the input global scales)"
    return Estimate(estimate.memory_bytes, seconds, how)


def _fp4_weights_estimate(step: PlanStep, layers: dict[str, Any]) -> Estimate:
    if step.config.uses_gptq:  # the same Hessians, solves and column loop as method gptq
        return GPTQ.estimate(step, layers)
    if step.config.algorithm == "awq":  # AWQ's search, without its clipping
        return AWQ.estimate(replace(step, config=step.config.awq()), layers)
    weights = layer_weights(layers)
    widest = max((r.out_f * r.in_f for r in layers.values()), default=0)
    return Estimate(
        step.held_bytes + weights + 8 * widest,  # every layer's packed codes and scales kept; the largest layer's float32 work copies
        weights / RTN_WEIGHTS_PER_S,
        f"the libraries + the model + about a byte a quantized weight (the codes, scales and dequantized weight the layers "
        f"keep) + the largest layer's float32 copies; ~{RTN_WEIGHTS_PER_S:.0e} weights/s",
    )


FP4 = QuantMethod(
    name="fp4",
    config=FP4Config,
    load_stage=_fp4_stage,
    estimate=_fp4_estimate,
    cost=1,
    description="NVFP4 (E2M1, float8 E4M3 scale per 16, float32 per tensor) or MXFP4 (E2M1, E8M0 scale per 32) weights, "
    "rounded to nearest, with GPTQ's error feedback on the FP4 grid or after AWQ's scales; optionally FP4 inputs (W4A4)",
)
