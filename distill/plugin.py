"""The plugin object (StageKind) of the ``distill:`` stage kind (compress.plugins.STAGE_KINDS): torch-free; the stage
(distill.py) is imported when a run builds it."""

from __future__ import annotations

from typing import Any

from compress.distill.config import DistillConfig
from compress.distill.draft_config import DraftConfig
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


def _build_draft(config: Any, label: str) -> Any:
    from compress.distill.draft import DraftStage

    return DraftStage(config, label)


def _estimate_draft(step: PlanStep) -> Estimate:
    """The target stays in memory; the draft is a copy of it, pruned (one importance pass over the
    calibration text), then trained as a distill stage on the draft's shape with the target teaching."""
    from dataclasses import replace

    from compress.pruning.plugin import PRUNE, pruned_shape

    cfg = step.config
    small = pruned_shape(step.shape, cfg.prune)
    prune = PRUNE.estimate(replace(step, config=cfg.prune, held_bytes=step.held_bytes + step.shape.params * step.dtype_bytes))
    mem, seconds = prune.memory_bytes, prune.seconds
    basis = f"the target + a copy pruned to {small.params:,} parameters ({small.params / step.shape.params:.0%}): {prune.basis}"
    if cfg.distill is not None:
        held = step.held_bytes + small.params * step.dtype_bytes
        train = _estimate(replace(step, config=cfg.distill, shape=small, held_bytes=held))
        mem, seconds = max(mem, train.memory_bytes), seconds + train.seconds
        basis += f"; then {train.basis}"
    return Estimate(mem, seconds, basis)


def _summary_draft(stage: dict[str, Any], report: dict[str, Any]) -> str:
    s = stage["summary"]
    shape = s["shape"]
    line = (
        f"{stage['label']} draft: {s['parameters']:,} parameters ({s['share']:.1%} of the target's {s['target_parameters']:,}); "
        f"{shape['num_hidden_layers']} blocks, hidden {shape['hidden_size']}, MLP {shape['intermediate_size']}"
    )
    distilled = s["steps"].get("distill")
    if distilled:
        d = distilled["summary"]
        line += f"; KL to the target {d['before']['kl_divergence']:.4f} → {d['after']['kl_divergence']:.4f}"
    return line + f"; {stage['duration_s']:.0f}s"


DRAFT = StageKind(
    name="draft",
    config=DraftConfig,
    build=_build_draft,
    estimate=_estimate_draft,
    summary=_summary_draft,
    description="a draft model for speculative decoding: the target pruned, trained toward the target, written beside it",
    trains=True,
    keeps_checkpoints=True,
)
