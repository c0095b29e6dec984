"""A quantization method that exists only for tests/test_plugins_methods.py: "halfround", RTN's
min/max grid with codes ``floor(w / scale + shift) + zero`` (round half up at the default shift),
in one module (config, math, stage, QuantMethod) registered by one entry of compress.plugins.QUANT_METHODS."""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from compress.eval.plan.estimates import Estimate, PlanStep
from compress.plugin_types import QuantMethod
from compress.quantizers.apply import quantize_each_layer
from compress.quantizers.core import QuantizedWeight, compute_qparams, group_rows, pack_record
from compress.schema.quantize import QuantScheme, WeightQuantConfig


class HalfRoundConfig(WeightQuantConfig):
    """`quantize: {method: halfround, bits, group_size, symmetric, shift, targets, ignore}`."""

    method: Literal["halfround"] = "halfround"
    shift: float = Field(0.5, ge=0, lt=1, description="Added before flooring: 0.5 rounds halves up, 0 truncates.")

    @property
    def needs_calibration(self) -> bool:
        return False


def halfround_quantize(weight: torch.Tensor, scheme: QuantScheme, shift: float = 0.5) -> QuantizedWeight:
    groups = group_rows(weight, scheme)
    scale, zero = compute_qparams(groups, scheme)
    codes = (torch.floor(groups / scale.unsqueeze(-1) + shift) + zero.unsqueeze(-1)).clamp_(0, scheme.qmax)
    return pack_record(codes, scale, zero, weight.shape[1], scheme)


class HalfRoundStage:
    def __init__(self, config: HalfRoundConfig, label: str) -> None:
        self.config = config
        self.label = label

    def apply(self, model, ctx):  # noqa: ANN001 - see compress.context.Stage
        return quantize_each_layer(model, ctx, self.config, self.label, lambda w, s: halfround_quantize(w, s, self.config.shift))


def _estimate(step: PlanStep, layers: dict[str, Any]) -> Estimate:
    weights = sum(r.out_f * r.in_f for r in layers.values())
    return Estimate(step.held_bytes + weights, weights / 1e8, f"halfround: {weights:,} weights at ~1e8 weights/s")


HALFROUND = QuantMethod(
    name="halfround",
    config=HalfRoundConfig,
    load_stage=lambda: HalfRoundStage,
    estimate=_estimate,
    cost=0,
    description="test method: floor(w / scale + shift) on RTN's grid",
)
