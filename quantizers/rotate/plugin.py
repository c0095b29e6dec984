"""The plugin object (StageKind) of the ``rotate:`` stage kind (compress.plugins.STAGE_KINDS): torch-free; the
stage (stage.py) is imported when a run builds it."""

from __future__ import annotations

from typing import Any

from compress.eval.plan.estimates import Estimate, PlanStep
from compress.plugin_types import StageKind
from compress.quantizers.rotate.config import RotateConfig, check_family, describe


def _build(config: Any, label: str) -> Any:
    from compress.quantizers.rotate.stage import RotateStage

    return RotateStage(config, label)


def _unties(shape: Any, config: RotateConfig) -> bool:
    """The stage gives a tied output head a table of its own (the final norm folds into the head only)."""
    return config.residual and bool(getattr(shape.text, "tie_word_embeddings", False))


ROTATE_FLOPS = 10e9
"""Float64 FLOPs per second the stage reaches, products and dtype conversions together: SmolLM2-135M (width
576, tied) rotated in 21 s and 33 s (hadamard, random) on the project's 2-core machine under load (the script in docs/rotate.md,
"Tolerance")."""


def _estimate(step: PlanStep) -> Estimate:
    cfg, t = step.config, step.shape.text
    check_family(cfg, getattr(t, "model_type", None), "")
    table = t.vocab_size * t.hidden_size
    untied = table if _unties(step.shape, cfg) else 0
    mem = step.held_bytes + untied * step.dtype_bytes + 2 * table * 8  # the untied head, the largest matrix and its product in float64
    width = t.hidden_size if cfg.residual else (getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads)
    basis = (
        "the model in memory" + (", its untied output head" if untied else "") + " and the largest matrix twice in float64; "
        f"every turned weight times a {width} x {width} matrix (2 x width FLOPs a weight) at ~{ROTATE_FLOPS / 1e9:.0f} GFLOPS in float64"
    )
    return Estimate(mem, 2 * (step.shape.params + untied) * width / ROTATE_FLOPS, basis)


def _plan_shape(shape: Any, config: RotateConfig) -> Any:
    """The shape after the stage: a tied output head becomes a table of its own (the same shape otherwise)."""
    check_family(config, getattr(shape.text, "model_type", None), "")
    if not _unties(shape, config):
        return shape
    data = shape.config.to_dict()
    data["tie_word_embeddings"] = False
    return shape.rebuilt(shape.config.__class__.from_dict(data), f"{shape.origin}, output head untied by rotate")


def _summary(stage: dict[str, Any], report: dict[str, Any]) -> str:
    return f"{stage['label']} rotate: {describe(stage['summary'])}; {stage['duration_s']:.1f}s"


ROTATE = StageKind(
    name="rotate",
    config=RotateConfig,
    build=_build,
    estimate=_estimate,
    summary=_summary,
    description="function-preserving rotations (QuaRot / SpinQuant): norms folded, residual stream and value/output heads "
    "turned by orthogonal matrices, folded into the weights",
    plan_shape=_plan_shape,
)
