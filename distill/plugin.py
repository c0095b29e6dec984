"""The plugin object (StageKind) of the ``distill:`` stage kind (compress.plugins.STAGE_KINDS): torch-free; the stage
(distill.py) is imported when a run builds it."""

from __future__ import annotations

from typing import Any

from compress.distill.config import DistillConfig
from compress.eval.plan.estimates import DISTILL_TOKENS_PER_S, REF_PARAMS, Estimate, PlanStep, training_bytes
from compress.plugin_types import StageKind


def _build(config: Any, label: str) -> Any:
    from compress.distill.distill import DistillStage

    return DistillStage(config, label)


def _estimate(step: PlanStep) -> Estimate:
    cfg, cur = step.config, step.shape
    bf16 = cfg.autocast == "bf16"
    trainable = cur.params - (cur.frozen_params() if cfg.train == "blocks" else 0)
    tokens = cfg.step_cap() * cfg.tokens_per_step()
    rate = DISTILL_TOKENS_PER_S["bf16" if bf16 else "fp32"] * REF_PARAMS / cur.params
    mem = step.held_bytes + 12 * trainable + training_bytes(cur, cfg.batch_size, cfg.seq_len, bf16)
    basis = (
        f"{'student (the teacher one block at a time: stored_teacher)' if cfg.stored_teacher else 'teacher + student'} + fp32 grads and AdamW moments of {trainable:,} trainable parameters + activations "
        f"of {cfg.batch_size} x {cfg.seq_len} tokens; {tokens:,} tokens at ~{rate:,.0f} tokens/s "
        f"({'bf16 autocast' if bf16 else 'float32'}, scaled from the 135M model)"
    )
    return Estimate(mem, tokens / rate, basis)


def _summary(stage: dict[str, Any], report: dict[str, Any]) -> str:
    s = stage["summary"]
    b, a = s["before"], s["after"]
    return (
        f"{stage['label']} distill: KL to the teacher {b['kl_divergence']:.4f} → {a['kl_divergence']:.4f}, top-1 "
        f"{b['top1_agreement']:.2%} → {a['top1_agreement']:.2%} (held-apart text); {s['steps']} steps, {s['tokens']:,} tokens, "
        f"{s['train_seconds']:.0f}s training, {s['processes']} process(es)"
        + (f", resumed at step {s['resumed_from_step']}" if s["resumed_from_step"] is not None else "")
        + (
            f"; the {s['max_minutes']:g}-minute budget ended it ({s['max_steps']} steps allowed)"
            if s.get("stopped_by") == "max_minutes"
            else ""
        )
    )


DISTILL = StageKind(
    name="distill",
    config=DistillConfig,
    build=_build,
    estimate=_estimate,
    summary=_summary,
    description="distillation repair: the student trained toward a teacher's logits (and hidden states) on calibration text",
    trains=True,
    keeps_checkpoints=True,
)
