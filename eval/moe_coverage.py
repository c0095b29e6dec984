"""Mixture-of-experts calibration coverage as an evaluation gates can read.

The gptq / awq stages of an MoE model write ``summary.moe`` (quantizers/moe.py): routed calibration
tokens per block and expert, and how many experts got fewer than ``moe.min_tokens``. This turns the
stages' summaries into one ``kind: calibration`` evaluation of the ``compressed`` artifact, with the
metrics ``experts_under_min`` (summed over the stages) and ``min_expert_tokens`` (their minimum);
``compress run`` adds it after its stages, ``compress gate`` from an artifact's manifest.
"""

from __future__ import annotations

from typing import Any

from compress.eval.metrics import Evaluation


def expert_coverage(stages: list[tuple[str, dict[str, Any]]], device: str) -> list[Evaluation]:
    """The ``calibration`` evaluation of the stages' (label, summary) pairs; none when no stage has ``moe``."""
    moe = [(label, summary["moe"]) for label, summary in stages if isinstance(summary, dict) and "moe" in summary]
    if not moe:
        return []
    metrics = {
        "experts_under_min": float(sum(m["experts_under_min"] for _, m in moe)),
        "min_expert_tokens": float(min(m["min_expert_tokens"] for _, m in moe)),
    }
    details = {
        "stages": {label: {k: m[k] for k in ("min_tokens", "under_min", "experts", "experts_under_min")} for label, m in moe},
        "counted": "calibration tokens routed to each expert by its block's router (top-k), per quantize stage",
    }
    return [Evaluation(artifact="compressed", runtime="torch", device=device, metrics=metrics, details=details, kind="calibration")]
