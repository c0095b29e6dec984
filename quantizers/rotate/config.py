"""The recipe's ``rotate:`` stage (function-preserving rotations before quantization) and the families
it rotates exactly. Torch-free; the math is compress/rotation.py and matrices.py, the stage stage.py."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from compress.errors import CompressError
from compress.schema.base import BaseStageConfig, Seed

RESIDUAL_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
"""Model types whose residual stream the stage rotates: every norm on the stream is an RMSNorm whose
weight folds into the Linears reading it. Qwen3's q_norm / k_norm act inside the heads, on q and k,
which the residual rotation leaves as they were."""

HEAD_FAMILIES = (*RESIDUAL_FAMILIES, "gemma2", "gemma3_text")
"""Model types whose value/output heads the stage rotates (attention is linear in V in all of them)."""

_GEMMA_POST_NORMS = (
    "its post_attention_layernorm and post_feedforward_layernorm scale each block's output channel by channel before "
    "the residual add; a rotation of the stream does not commute with that scale, and the scale folds into no Linear "
    "(o_proj and down_proj feed the norm, which divides by their output's RMS), so no rotation but a signed "
    "permutation keeps the function"
)
NOT_ROTATABLE = {"gemma2": _GEMMA_POST_NORMS, "gemma3_text": _GEMMA_POST_NORMS}
"""Families whose value/output heads rotate but whose residual stream cannot be rotated exactly, and why."""


class RotateConfig(BaseStageConfig):
    """`rotate: {kind, residual, heads, seed}`."""

    before_quantization: ClassVar[bool] = True

    kind: Literal["hadamard", "random"] = Field(
        "hadamard",
        description="hadamard: a randomized Hadamard matrix (a ±1 diagonal times H / sqrt(n); for widths that are not a "
        "power of two, a Paley matrix ⊗ a Sylvester one, e.g. 576 = 36 · 16; a width none is built for gets a random "
        "one, said in the log and the manifest); random: Haar-random orthogonal (seeded QR of a Gaussian).",
    )
    residual: bool = Field(
        True,
        description="Rotate the residual stream (norm weights folded into the Linears that read them; a tied output head "
        "is untied). llama, mistral, qwen2, qwen3 only.",
    )
    heads: bool = Field(True, description="Rotate each block's value/output heads by a head_dim orthogonal matrix (one per block).")
    seed: Seed = Field(0, description="Seed of the random matrices and signs.")

    @model_validator(mode="after")
    def _something(self) -> RotateConfig:
        if not (self.residual or self.heads):
            raise ValueError("rotate needs residual: true, heads: true or both")
        return self


def check_family(config: RotateConfig, model_type: str | None, label: str) -> None:
    """Refuse a model the stage cannot rotate exactly: a CompressError naming the recipe key (under ``label``,
    the stage's place ``stages[0]``; `compress plan` has none)."""
    where = f"{label}.rotate" if label else "rotate"
    if model_type not in HEAD_FAMILIES:
        raise CompressError(
            f"{where}: model type '{model_type}' is not supported; the rotations are written for "
            f"{', '.join(HEAD_FAMILIES)} (residual stream: {', '.join(RESIDUAL_FAMILIES)})"
        )
    if config.residual and model_type not in RESIDUAL_FAMILIES:
        raise CompressError(
            f"{where}.residual: the residual stream of a {model_type} model cannot be rotated exactly: "
            f"{NOT_ROTATABLE[model_type]}. Set residual: false to rotate its value/output heads only."
        )


def describe(summary: dict[str, Any]) -> str:
    """One line for people from a rotate stage's manifest summary: what was rotated, by what."""
    parts = []
    if "residual" in summary:
        s = summary["residual"]
        parts.append(f"residual stream ({s['width']}) by a {s['matrix']}" + ("; output head untied" if s["untied_head"] else ""))
    if "heads" in summary:
        s = summary["heads"]
        parts.append(f"value/output heads ({s['head_dim']}) of {s['blocks']} blocks by a {s['matrix']} each")
    return "; ".join(parts)
