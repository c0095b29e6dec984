"""The recipe step ``draft: {...}``: a draft model for speculative decoding, made from the target.

The draft starts as a copy of the target as the recipe leaves it (the last stage: every earlier one has
run), is pruned (the ``prune:`` sub-config, on the calibration text), trained toward that target
(``distill:``; its teacher is the compressed target, since that is what the draft must agree with) and
optionally quantized (``quantize:``, rtn or gptq). The target is not changed. The draft is left in
``RunContext.draft``; compress/steps/draft.py writes it under ``draft/`` (a Hugging Face folder with the
target's tokenizer, and a GGUF) and measures the pair on each runtime.

The sub-steps are the prune, distill and quantize stages themselves, run on a context of their own: no
quantized records, files or KV-cache scheme of the target's leak into the draft, and the draft's records
stay its own.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from compress.context import RunContext, StageRecord
from compress.distill.distill import DistillStage
from compress.distill.draft_config import DraftConfig
from compress.errors import CompressError, FormatError
from compress.export.gguf.layout import architecture_of
from compress.pruning.prune import PruneStage, parameters
from compress.quantizers.plugin import GPTQ, RTN


@dataclass
class Draft:
    """The draft a ``draft`` stage made: the model (float weights, the records' values where quantized),
    its quantized records, and what the stage did."""

    model: nn.Module
    config: DraftConfig
    label: str
    records: dict[str, Any] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)


def shape_of(model: nn.Module) -> dict[str, int]:
    cfg = model.config
    return {
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
    }


class DraftStage:
    """The recipe step ``draft: {...}``."""

    def __init__(self, config: DraftConfig, label: str) -> None:
        self.config = config
        self.label = label

    def apply(self, model: nn.Module, ctx: RunContext) -> StageRecord:
        cfg, label = self.config, self.label
        started = time.perf_counter()
        if ctx.tokenizer is None:
            raise CompressError(f"{label} (draft): the model has no tokenizer; a draft proposes tokens of the target's tokenizer")
        target_params = parameters(model)
        draft = copy.deepcopy(model)
        sub = dataclasses.replace(
            ctx,
            quantized={},
            quantized_by={},
            kv_cache=None,
            original=model,  # the target as the recipe leaves it: the prune stage's "before", the distill stage's teacher
            applied=[],
            teacher=None,
            mapping=None,
            input_sums={},
            size_budget=None,
            files={},
            work_dir=ctx.work_dir / label if ctx.work_dir is not None else None,
            source_sha256=None,  # a stored teacher is this target's, not the source's
            sensitivity=None,
        )
        steps: dict[str, Any] = {}
        steps["prune"] = PruneStage(cfg.prune, f"{label}.prune").apply(draft, sub).to_json()
        draft_params = parameters(draft)
        if draft_params >= cfg.max_share * target_params:
            raise CompressError(
                f"{label}.prune: the draft keeps {draft_params:,} parameters, {draft_params / target_params:.0%} of the target's "
                f"{target_params:,}; {label}.max_share allows {cfg.max_share:.0%} (prune more: fewer layers, a narrower hidden or MLP)"
            )
        if cfg.gguf:  # before training: a draft llama.cpp cannot load is refused now, not after the distillation
            try:
                architecture_of(draft)
            except FormatError as exc:
                raise CompressError(f"{label}.prune: the draft cannot be written as GGUF (draft.gguf: true): {exc}") from None
        sub.applied.append("prune")
        if cfg.distill is not None:
            steps["distill"] = DistillStage(cfg.distill, f"{label}.distill").apply(draft, sub).to_json()
            sub.applied.append("distill")
        if cfg.quantize is not None:
            method = next(m for m in (RTN, GPTQ) if isinstance(cfg.quantize, m.config))
            steps["quantize"] = method.build(cfg.quantize, f"{label}.quantize").apply(draft, sub).to_json()
        draft.eval().requires_grad_(False)
        facts = {
            "target_parameters": target_params,
            "parameters": draft_params,
            "share": draft_params / target_params,
            "shape": shape_of(draft),
            "target_shape": shape_of(model),
            "quantized_layers": len(sub.quantized),
        }
        ctx.draft = Draft(draft, cfg, label, dict(sub.quantized), facts)
        for rel, tensors in sub.files.items():  # the sub-steps' files (importance scores) under draft/
            ctx.files[f"draft/{rel}"] = tensors
        return StageRecord(
            kind="draft",
            method="+".join(steps),
            config=cfg.model_dump(mode="json"),
            duration_s=time.perf_counter() - started,
            summary={**facts, "steps": {k: {"duration_s": v["duration_s"], "summary": v["summary"]} for k, v in steps.items()}},
        )
