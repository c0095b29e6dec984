"""The recipe step ``rotate: {kind, residual, heads, seed}``: function-preserving rotations before
quantization (QuaRot, SpinQuant), folded into the weights so every later stage and export reads an
ordinary model of the same architecture.

``residual``: every RMSNorm weight on the residual stream is folded into the Linears that read the
normed stream (a block's input norm into q/k/v, its post-attention norm into gate/up, the final norm
into the output head; a tied head is untied first: the embedding cannot carry the final norm), then
the stream is turned by one orthogonal matrix Q of the model's width (compress.rotation.rotate_residual).
``heads``: each block's value/output heads are turned by one orthogonal matrix of head_dim.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from compress.context import RunContext, StageRecord
from compress.errors import CompressError
from compress.hf_model import embeddings_tied
from compress.quantizers.rotate.config import RotateConfig, check_family, describe
from compress.quantizers.rotate.matrices import random_orthogonal, randomized_hadamard
from compress.rotation import fold_norm, rotate_heads, rotate_residual, untie


class RotateStage:
    """The recipe step ``rotate: {...}``."""

    def __init__(self, config: RotateConfig, label: str) -> None:
        self.config = config
        self.label = label

    def apply(self, model: torch.nn.Module, ctx: RunContext) -> StageRecord:
        started = time.perf_counter()
        if ctx.quantized:
            raise CompressError(
                f"{self.label} (rotate): the model already has quantized layers ({next(iter(ctx.quantized))} …); "
                "a rotation changes float weights: rotate before quantizing, from a float source"
            )
        summary = rotate_model(model, self.config, self.label, ctx.reporter.warn)
        ctx.reporter.info(f"{self.label} (rotate): {describe(summary)}")
        return StageRecord("rotate", self.config.kind, self.config.model_dump(mode="json"), time.perf_counter() - started, summary)


def rotate_model(model: torch.nn.Module, config: RotateConfig, label: str, warn: Callable[[str], None]) -> dict[str, Any]:
    """Rotate ``model`` (an in-memory causal LM of a family ``check_family`` accepts) in place as
    ``config`` says; returns what was done, for the manifest (each matrix, its largest |Q Qᵀ − I|)."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    check_family(config, getattr(text, "model_type", None), label)
    generator = torch.Generator().manual_seed(config.seed)
    blocks = model.model.layers
    summary: dict[str, Any] = {}
    with torch.no_grad():
        if config.residual:
            tied = embeddings_tied(model)
            for layer in blocks:
                attn, mlp = layer.self_attn, layer.mlp
                fold_norm(layer.input_layernorm, (attn.q_proj, attn.k_proj, attn.v_proj))
                fold_norm(layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj))
            if tied:
                untie(model)
            fold_norm(model.model.norm, (model.lm_head,))
            q, how = _matrix(config.kind, text.hidden_size, generator)
            rotate_residual(model, q)
            summary["residual"] = {"width": text.hidden_size, "matrix": how, "orthogonality_error": _error(q), "untied_head": tied}
        if config.heads:
            head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
            errors, how = [], ""
            for layer in blocks:
                r, how = _matrix(config.kind, head_dim, generator)
                rotate_heads(layer.self_attn.v_proj, layer.self_attn.o_proj, r, text.num_key_value_heads)
                errors.append(_error(r))
            summary["heads"] = {"head_dim": head_dim, "blocks": len(blocks), "matrix": how, "orthogonality_error": max(errors)}
    for part, done in summary.items():
        if config.kind == "hadamard" and not done["matrix"].startswith("randomized Hadamard"):
            warn(f"{label}.rotate: {part}: kind hadamard, but {done['matrix']}: a random orthogonal matrix is used instead")
    return summary


def _matrix(kind: str, n: int, generator: torch.Generator) -> tuple[torch.Tensor, str]:
    """The orthogonal matrix of ``kind`` and order ``n`` (float64) and what it is; a Hadamard order
    matrices.py cannot build gives a random orthogonal matrix, said in the text."""
    found = randomized_hadamard(n, generator) if kind == "hadamard" else None
    if found is not None:
        return found[0], f"randomized Hadamard ({found[1]})"
    return random_orthogonal(n, generator), "random orthogonal" + (
        f" (no Hadamard matrix of order {n} is built here)" if kind == "hadamard" else ""
    )


def _error(q: torch.Tensor) -> float:
    return float((q @ q.T - torch.eye(q.shape[0], dtype=q.dtype)).abs().max())
