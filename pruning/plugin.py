"""The plugin object (StageKind) of the ``prune:`` stage kind (compress.plugins.STAGE_KINDS): torch-free; the stage
(prune.py) is imported when a run builds it."""

from __future__ import annotations

from typing import Any

from compress.eval.plan.estimates import Estimate, PlanStep, activation_bytes, forward_s
from compress.plugin_types import StageKind
from compress.pruning.config import PruneConfig


def _build(config: Any, label: str) -> Any:
    from compress.pruning.prune import PruneStage

    return PruneStage(config, label)


def _streams(config: Any) -> bool:
    """The importance pass and the cuts of blocks, MLP neurons and KV groups go one block at a time;
    embedding channels cross every unit (and a tied head), so cutting them reads the model whole."""
    return config.hidden is None


def _estimate(step: PlanStep) -> Estimate:
    cfg, cur = step.config, step.shape
    passes = 1 + (cur.text.num_hidden_layers if cfg.layers and cfg.layers.metric == "kl" else 0)
    mem = step.held_bytes + activation_bytes(cur, cfg.batch_size, step.cal_seq_len)
    basis = (
        f"{'one block' if _streams(cfg) else 'the model in memory (embedding channels are cut)'} + one forward of "
        f"{cfg.batch_size} x {step.cal_seq_len} tokens; "
        f"{passes} pass(es) over {step.cal_tokens:,} calibration tokens"
    )
    return Estimate(mem, passes * forward_s(cur.params, step.cal_tokens), basis)


def pruned_shape(shape: Any, prune: Any) -> Any:
    """The shape a prune stage leaves (sizes resolved exactly as the stage does); ``shape`` is a
    ``compress.eval.plan.shapes.ModelShape``, rebuilt on the meta device with the new sizes."""
    from compress.pruning.arch import PrunableModel
    from compress.pruning.prune import resolve_sizes

    pm = PrunableModel.of(shape.model)
    sizes = resolve_sizes(prune, pm)
    heads = sizes.get("heads", pm.num_heads)
    layers = sizes.get("layers", len(pm.blocks))
    data = shape.config.to_dict()
    data.update(
        intermediate_size=sizes.get("mlp", pm.intermediate_size),
        hidden_size=sizes.get("hidden", pm.hidden_size),
        num_attention_heads=heads,
        num_key_value_heads=heads // (pm.num_heads // pm.kv_heads),
        head_dim=pm.head_dim,
        num_hidden_layers=layers,
    )
    if isinstance(data.get("layer_types"), list):
        data["layer_types"] = data["layer_types"][:layers]
    return shape.rebuilt(shape.config.__class__.from_dict(data), f"{shape.origin}, pruned to {sizes}")


def _summary(stage: dict[str, Any], report: dict[str, Any]) -> str:
    s = stage["summary"]
    b, a = s["before"], s["after"]
    return (
        f"{stage['label']} prune: {b['parameters']:,} → {a['parameters']:,} parameters ({s['removed_parameters_pct']}% removed); "
        f"MLP {b['intermediate_size']} → {a['intermediate_size']}, heads {b['num_attention_heads']}/{b['num_key_value_heads']} → "
        f"{a['num_attention_heads']}/{a['num_key_value_heads']}, hidden {b['hidden_size']} → {a['hidden_size']}, "
        f"layers {b['num_hidden_layers']} → {a['num_hidden_layers']}; {stage['duration_s']:.1f}s"
    )


PRUNE = StageKind(
    name="prune",
    config=PruneConfig,
    build=_build,
    estimate=_estimate,
    summary=_summary,
    description="structured pruning (Minitron): importance from calibration activations, sliced to a smaller dense model",
    plan_shape=pruned_shape,
    streams=_streams,
)
