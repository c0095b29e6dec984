"""The recipe's ``draft:`` stage: a draft model for speculative decoding, made from the target.

Torch-free; the stage lives in compress/distill/draft.py, its files and measurements in
compress/steps/draft.py, the decoding loop in compress/eval/speculative.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from compress.distill.config import DistillConfig
from compress.export.gguf.config import GGUFExportConfig
from compress.pruning.config import PruneConfig
from compress.quantizers.configs import GPTQConfig, RTNConfig
from compress.schema.base import BaseStageConfig, Strict
from compress.schema.metrics import DRAFT_ARTIFACT, draft_artifact, is_draft_artifact


def gguf_exports(exports: list[Any]) -> list[Any]:
    """The recipe's GGUF exports: each is paired with the draft's GGUF in llama.cpp."""
    return [x for x in exports if isinstance(x, GGUFExportConfig)]


class DraftEval(Strict):
    """How the pair is measured: held-apart prompts decoded by the target alone and with the draft."""

    prompts: int = Field(16, ge=1, description="Prompts, one per data.evaluation chunk (the intervals are over prompts).")
    prompt_tokens: int = Field(128, ge=1, description="Tokens of each prompt: the start of an evaluation chunk.")
    max_new: int = Field(64, ge=1, description="Tokens generated after each prompt.")
    k: list[int] = Field([2, 4, 6, 8], min_length=1, description="Draft tokens proposed per target pass; each is measured.")
    temperatures: list[float] = Field(
        [0.0, 0.8],
        min_length=1,
        description="0: greedy (the output must equal the target's own greedy output); above 0: speculative sampling at that "
        "temperature. The gate metrics are read from greedy decoding at the best k.",
    )
    runtimes: list[Literal["torch", "llama.cpp"]] = Field(
        ["torch", "llama.cpp"],
        min_length=1,
        description="torch: the target and draft in memory; llama.cpp: each GGUF export of the target with the draft's GGUF "
        "(skipped, and said so, when the recipe exports no GGUF).",
    )

    @field_validator("k")
    @classmethod
    def _k(cls, v: list[int]) -> list[int]:
        bad = [k for k in v if not 1 <= k <= 32]
        if bad:
            raise ValueError(f"k: each is the number of draft tokens a round, from 1 to 32; got {bad}")
        return sorted(set(v))

    @model_validator(mode="after")
    def _prompt_holds_a_round(self) -> DraftEval:
        if self.prompt_tokens <= max(self.k) + 1:
            raise ValueError(
                f"prompt_tokens ({self.prompt_tokens}) must be longer than the largest k + 1 ({max(self.k) + 1}): the runtime's "
                "batched-vs-one-token logits are compared on the prompt's last k + 1 tokens"
            )
        return self

    @field_validator("temperatures")
    @classmethod
    def _temperatures(cls, v: list[float]) -> list[float]:
        bad = [t for t in v if not 0 <= t <= 2]
        if bad:
            raise ValueError(f"temperatures: each from 0 (greedy) to 2; got {bad}")
        return sorted(set(v))


class DraftConfig(BaseStageConfig):
    """`draft: {prune, distill, quantize, max_share, gguf, evaluate}`: a smaller model pruned from the
    target as the recipe leaves it, trained toward it, written beside it under ``draft/``."""

    prune: PruneConfig = Field(description="How the draft is cut from the target (blocks, hidden channels, heads, MLP neurons).")
    distill: DistillConfig | None = Field(
        None,
        description="Train the draft toward the target as the recipe leaves it (the compressed target: that is what it must "
        "agree with); its teacher is always that target. null: the pruned target untrained.",
    )
    quantize: Annotated[RTNConfig | GPTQConfig, Field(discriminator="method")] | None = Field(
        None,
        description="Quantize the draft after training (a quantize stage's config, method rtn or gptq: bits, group_size, ...); "
        "its GGUF then holds the records exactly. null: a float draft (float16 in its GGUF).",
    )
    max_share: float = Field(
        0.5, gt=0, lt=1, description="The draft may keep at most this share of the target's parameters (a larger one is refused)."
    )
    gguf: bool = Field(True, description="Write draft/draft.gguf (llama.cpp's speculative decoding, `--model-draft`).")
    evaluate: DraftEval | None = Field(default_factory=DraftEval, description="Measure acceptance and speed-up; null to skip.")

    @property
    def needs_calibration(self) -> bool:
        return True

    @field_validator("quantize")
    @classmethod
    def _no_budget(cls, v: Any) -> Any:
        if v is not None and v.gguf_target:
            raise ValueError("gguf_target: a draft has no size budget of its own")
        return v

    @model_validator(mode="after")
    def _no_nested_teacher(self) -> DraftConfig:
        if self.distill is not None and self.distill.teacher != "original":
            raise ValueError("distill.teacher: the draft's teacher is the target as the recipe leaves it; remove teacher")
        return self

    def recipe_artifacts(self, label: str, recipe: Any) -> set[str]:
        """One draft stage, the last one (the target must be final when the draft learns it); measuring
        needs data.evaluation long enough for the prompts; adds ``draft`` and ``draft-<gguf export>``,
        which gates compare with max or min (their baseline is the target alone, measured in the stage)."""
        drafts = [i for i, st in enumerate(recipe.stages) if isinstance(st.config, DraftConfig)]
        if len(drafts) > 1:
            raise ValueError(f"stages {drafts} are all draft stages; a recipe makes at most one draft")
        if drafts[0] != len(recipe.stages) - 1:
            raise ValueError(f"{label} (draft) must be the last stage: the draft learns the target as the recipe leaves it")
        if self.evaluate is None:
            return set()
        ev = recipe.data.evaluation
        if ev is None:
            raise ValueError(f"{label} (draft) measures acceptance on held-apart prompts and needs data.evaluation")
        if ev.seq_len < self.evaluate.prompt_tokens:
            raise ValueError(
                f"{label}.evaluate.prompt_tokens ({self.evaluate.prompt_tokens}) is longer than data.evaluation.seq_len ({ev.seq_len})"
            )
        for i, gate in enumerate(recipe.gates):
            if is_draft_artifact(gate.artifact) and gate.threshold_kind not in ("max", "min"):
                raise ValueError(f"gates[{i}]: draft metrics are measured against the target alone in the stage; use max or min")
        known = {DRAFT_ARTIFACT} if "torch" in self.evaluate.runtimes else set()
        if "llama.cpp" in self.evaluate.runtimes and self.gguf:
            known |= {draft_artifact(x.name) for x in gguf_exports(recipe.exports)}
        return known
