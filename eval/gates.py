"""Gates: thresholds on measured metrics that decide whether a run passes."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from compress.eval.metrics import METRICS
from compress.recipe import GateSpec


@dataclass
class Evaluation:
    """Metrics of one artifact, measured on one runtime and device."""

    artifact: str
    runtime: str
    device: str
    metrics: dict[str, float | int]
    source: str = "measured"  # or "estimated"
    details: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"artifact": self.artifact, "runtime": self.runtime, "device": self.device, "source": self.source, "metrics": self.metrics}
        if self.details:
            out["details"] = self.details
        return out


@dataclass
class GateResult:
    name: str
    metric: str
    artifact: str
    value: float | None
    threshold: dict[str, float]  # {"kind", "value", "limit"}: limit is the resolved absolute bound
    passed: bool
    source: str  # "measured" or "estimated"
    runtime: str | None
    device: str | None
    message: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def evaluate_gates(specs: list[GateSpec], evaluations: dict[str, Evaluation]) -> list[GateResult]:
    """Check each gate against the evaluation of its artifact (relative gates use the baseline)."""
    return [_check(spec, evaluations) for spec in specs]


def _check(spec: GateSpec, evaluations: dict[str, Evaluation]) -> GateResult:
    kind, value_t = spec.threshold_kind, spec.threshold_value
    ev = evaluations.get(spec.artifact)
    threshold: dict[str, Any] = {"kind": kind, "value": value_t}
    base = dict(name=spec.display_name, metric=spec.metric, artifact=spec.artifact)
    if ev is None or spec.metric not in ev.metrics:
        return GateResult(**base, value=None, threshold=threshold, passed=False, source="missing", runtime=None, device=None,
                          message=f"no measurement of {spec.metric} for artifact '{spec.artifact}'")
    value = float(ev.metrics[spec.metric])
    if kind in ("max", "min"):
        limit = value_t
    else:
        reference = float(evaluations["baseline"].metrics[spec.metric])
        sign = 1 if kind == "max_increase_pct" else -1
        limit = reference * (1 + sign * value_t / 100)
        threshold["baseline"] = reference
    threshold["limit"] = limit
    upper = kind in ("max", "max_increase_pct")
    passed = not math.isnan(value) and (value <= limit if upper else value >= limit)
    relation = "<=" if upper else ">="
    message = f"{spec.metric} = {value:.6g} {'meets' if passed else 'violates'} {relation} {limit:.6g}"
    if METRICS[spec.metric].better == "higher" and upper or METRICS[spec.metric].better == "lower" and not upper:
        message += " (note: this bound runs against the metric's better direction)"
    return GateResult(**base, value=value, threshold=threshold, passed=passed, source=ev.source,
                      runtime=ev.runtime, device=ev.device, message=message)
