"""Gates: thresholds on measured metrics that decide whether a run passes."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from compress.eval.devices import LOCAL
from compress.eval.metrics import Evaluation
from compress.schema.metrics import METRICS
from compress.schema.recipe import GateConfig


@dataclass
class GateResult:
    name: str
    metric: str
    artifact: str
    value: float | None
    on: str  # "value", or the end of the value's 95% interval compared: "lower_95", "upper_95"
    threshold: dict[str, float]  # {"kind", "value", "limit"}: limit is the resolved absolute bound
    passed: bool
    source: str  # "measured" or "estimated"
    runtime: str | None
    device: str | None
    message: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def evaluate_gates(gates: list[GateConfig], evaluations: list[Evaluation]) -> list[GateResult]:
    """Check each gate against the evaluation of its artifact, metric and device (relative gates
    compare with the baseline's value of the same metric)."""
    return [_check(gate, evaluations) for gate in gates]


def find_evaluation(
    evaluations: list[Evaluation], artifact: str, metric: str, device: str | None, task: str | None = None
) -> Evaluation | None:
    """The evaluation of ``artifact`` holding ``metric`` for the gate's device: ``None`` or
    ``local`` is this machine; a profile name matches evaluations made for that profile (measured
    here when this machine is it, else estimated). ``task``: the task evaluation of that name."""
    here = device in (None, LOCAL)
    for ev in evaluations:
        if task is not None and (ev.kind != "task" or (ev.details or {}).get("task") != task):
            continue
        if ev.artifact == artifact and metric in ev.metrics and (ev.profile is None if here else ev.profile == device):
            return ev
    return None


def _missing(
    base: dict[str, Any], threshold: dict[str, Any], ev: Evaluation | None, device: str | None, message: str, value: float | None = None
) -> GateResult:
    """A gate that fails because something it needs was not measured (``source: missing``)."""
    runtime = None if ev is None else ev.runtime
    return GateResult(
        **base, value=value, threshold=threshold, passed=False, source="missing", runtime=runtime, device=device, message=message
    )


def _check(gate: GateConfig, evaluations: list[Evaluation]) -> GateResult:
    kind, value_t = gate.threshold_kind, gate.threshold_value
    ev = find_evaluation(evaluations, gate.artifact, gate.metric, gate.device, gate.task)
    threshold: dict[str, Any] = {"kind": kind, "value": value_t}
    base = dict(name=gate.display_name, metric=gate.metric, artifact=gate.artifact, on=gate.on)
    if ev is None:
        where = f" on device '{gate.device}'" if gate.device not in (None, LOCAL) else ""
        where += f" on task '{gate.task}'" if gate.task else ""
        return _missing(base, threshold, None, gate.device, f"no measurement of {gate.metric} for artifact '{gate.artifact}'{where}")
    value = float(ev.metrics[gate.metric])
    what = gate.metric
    if gate.on != "value":
        interval = (ev.intervals or {}).get(gate.metric)
        if interval is None:
            return _missing(
                base,
                threshold,
                ev,
                ev.device,
                f"{gate.metric} of '{gate.artifact}' has no interval (it needs at least 2 evaluation sequences)",
            )
        value = float(interval["lower" if gate.on == "lower_95" else "upper"])
        what = f"{gate.metric} {gate.on} ({interval['level']:.0%} interval over {interval['samples']} samples)"
    if kind in ("max", "min"):
        limit = value_t
    else:
        reference_ev = find_evaluation(evaluations, "baseline", gate.metric, gate.device, gate.task)
        if reference_ev is None:
            return _missing(base, threshold, ev, ev.device, f"{kind} needs the baseline's {gate.metric}, which was not measured", value)
        reference = float(reference_ev.metrics[gate.metric])
        sign = 1 if kind.startswith("max_increase") else -1
        limit = reference * (1 + sign * value_t / 100) if kind.endswith("_pct") else reference + sign * value_t
        threshold["baseline"] = reference
    threshold["limit"] = limit
    upper = kind in ("max", "max_increase", "max_increase_pct")
    passed = not math.isnan(value) and (value <= limit if upper else value >= limit)
    relation = "<=" if upper else ">="
    message = f"{what} = {value:.6g} {'meets' if passed else 'violates'} {relation} {limit:.6g}"
    if METRICS[gate.metric].better == "higher" and upper or METRICS[gate.metric].better == "lower" and not upper:
        message += " (note: this bound runs against the metric's better direction)"
    return GateResult(
        **base, value=value, threshold=threshold, passed=passed, source=ev.source, runtime=ev.runtime, device=ev.device, message=message
    )
