"""Importance of MLP neurons, attention heads (by KV group), embedding channels and whole
decoder blocks, from activations on calibration text (Minitron-style: one forward pass of the
unpruned model, every score read from what the model actually computes).

* MLP neuron ``j`` of a block: mean |a_j| of the gated activation ``act(gate(x)) * up(x)``
  that feeds ``down_proj`` (what the neuron contributes is ``a_j`` times a column of down_proj).
* Attention head: mean over tokens of the L2 norm of the head's output (its slice of the
  ``o_proj`` input). A KV group (one key/value head and the query heads that share it) scores
  the sum of its query heads; groups are kept or removed whole, so grouped-query attention stays
  consistent.
* Embedding channel: mean |y_c| of the outputs of every norm (each block's two norms and the
  final norm), summed over the norms; one score per channel for the whole model, since a
  channel is removed from the embedding, every norm and every block together.
* Block: ``cosine`` = mean over tokens of 1 - cos(block input, block output) (how much the
  block changes the residual stream; small means it can go); ``kl`` = the mean KL divergence of
  the model with that block skipped against the full model (one extra forward per block).

All math here is on tensors; :func:`collect` runs the model with hooks. On a streamed model
(compress/streaming.py) the pass reads one decoder block at a time: the hooks keep only the
per-block sums above (and, for ``kl``, one batch's reference log-probs), never a block's weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from compress.pruning.arch import PrunableModel


@dataclass
class Importance:
    """Scores of one unpruned model: higher means more important, everywhere."""

    mlp: list[torch.Tensor] = field(default_factory=list)  # per block: [intermediate]
    heads: list[torch.Tensor] = field(default_factory=list)  # per block: [num_attention_heads]
    hidden: torch.Tensor | None = None  # [hidden_size]
    layers_cosine: torch.Tensor | None = None  # [num_layers]: 1 - cos(in, out)
    layers_kl: torch.Tensor | None = None  # [num_layers]: KL when the block is skipped
    mlp_gram: list[torch.Tensor] = field(default_factory=list)  # per block, when asked: Σ aᵀa of the down_proj inputs (float64)
    tokens: int = 0

    def group_scores(self, layer: int, kv_heads: int) -> torch.Tensor:
        """Scores of the KV groups of ``layer``: the sum over each group's query heads."""
        return self.heads[layer].reshape(kv_heads, -1).sum(dim=1)

    def tensors(self) -> dict[str, torch.Tensor]:
        """For the artifact (safetensors): every score by a readable name."""
        out: dict[str, torch.Tensor] = {}
        for i, s in enumerate(self.mlp):
            out[f"mlp.layers.{i}"] = s
        for i, s in enumerate(self.heads):
            out[f"heads.layers.{i}"] = s
        if self.hidden is not None:
            out["hidden"] = self.hidden
        if self.layers_cosine is not None:
            out["layers.cosine"] = self.layers_cosine
        if self.layers_kl is not None:
            out["layers.kl"] = self.layers_kl
        return {k: v.float().contiguous().cpu() for k, v in out.items()}


def cosine_distance(inputs: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """Per-token 1 - cos(input, output) over the last dimension, as float64 sums' terms."""
    return 1.0 - torch.nn.functional.cosine_similarity(inputs.double(), outputs.double(), dim=-1)


def head_norms(o_proj_input: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[tokens, heads]: L2 norm of each head's slice of the o_proj input."""
    x = o_proj_input.reshape(-1, o_proj_input.shape[-1] // head_dim, head_dim)
    return x.double().norm(dim=-1)


def collect(
    pm: PrunableModel,
    batches: Iterable[torch.Tensor],
    device: torch.device,
    want_hidden: bool,
    layer_metric: str | None,
    progress: Callable[..., Iterable] | None = None,
    want_gram: bool = False,
) -> Importance:
    """One pass over ``batches`` (token ids [b, seq]) with hooks; returns summed-then-averaged scores.

    ``layer_metric`` is None (no block scores), ``"cosine"`` (from the same pass) or ``"kl"``
    (one more pass per block, see :func:`skip_kl`). ``want_gram``: also sum each block's aᵀa of
    the down_proj inputs (for the structured-OBS selection, obs.py)."""
    model, blocks = pm.model, pm.blocks
    n = len(blocks)
    mlp_sum = [torch.zeros(pm.intermediate_size, dtype=torch.float64) for _ in range(n)]
    head_sum = [torch.zeros(pm.num_heads, dtype=torch.float64) for _ in range(n)]
    hidden_sum = torch.zeros(pm.hidden_size, dtype=torch.float64)
    cos_sum = torch.zeros(n, dtype=torch.float64)
    gram = [torch.zeros(pm.intermediate_size, pm.intermediate_size, dtype=torch.float64) for _ in range(n)] if want_gram else []
    handles = []

    def on_down(i: int) -> Callable:
        def hook(_m: nn.Module, args: tuple) -> None:
            a = args[0].detach().reshape(-1, args[0].shape[-1])
            mlp_sum[i] += a.abs().double().sum(0).cpu()
            if want_gram:
                a = a.float()
                gram[i] += (a.T @ a).double().cpu()  # float32 per batch, summed in float64

        return hook

    def on_o(i: int) -> Callable:
        def hook(_m: nn.Module, args: tuple) -> None:
            head_sum[i] += head_norms(args[0].detach(), pm.head_dim).sum(0).cpu()

        return hook

    def on_norm(_m: nn.Module, _args: tuple, out: torch.Tensor) -> None:
        hidden_sum.add_(out.detach().reshape(-1, out.shape[-1]).abs().double().sum(0).cpu())

    def on_block(i: int) -> Callable:
        def hook(_m: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor | tuple) -> None:
            x = args[0] if args else kwargs["hidden_states"]
            y = out[0] if isinstance(out, tuple) else out
            cos_sum[i] += cosine_distance(x.detach(), y.detach()).sum().cpu()

        return hook

    for i, block in enumerate(blocks):
        handles.append(pm.down_proj(block).register_forward_pre_hook(on_down(i)))
        handles.append(pm.o_proj(block).register_forward_pre_hook(on_o(i)))
        if layer_metric == "cosine":
            handles.append(block.register_forward_hook(on_block(i), with_kwargs=True))
        if want_hidden:
            for norm in pm.block_norms(block):
                handles.append(norm.register_forward_hook(on_norm))
    if want_hidden:
        handles.append(pm.final_norm.register_forward_hook(on_norm))
    tokens = 0
    batches = list(batches)
    try:
        with torch.inference_mode():
            for ids in progress(batches, "pruning: importance", len(batches)) if progress else batches:
                model.base_model(input_ids=ids.to(device), use_cache=False)  # every hook is before the head: no logits
                tokens += ids.numel()
    finally:
        for h in handles:
            h.remove()
    imp = Importance(mlp=[s / tokens for s in mlp_sum], heads=[s / tokens for s in head_sum], mlp_gram=gram, tokens=tokens)
    if want_hidden:
        imp.hidden = hidden_sum / tokens
    if layer_metric == "cosine":
        imp.layers_cosine = cos_sum / tokens
    elif layer_metric == "kl":
        imp.layers_kl = skip_kl(pm, batches, device, progress)
    return imp


def skip_kl(
    pm: PrunableModel, batches: list[torch.Tensor], device: torch.device, progress: Callable[..., Iterable] | None = None
) -> torch.Tensor:
    """[num_layers]: mean KL(full || model with block i skipped) over every token of ``batches``.

    Batch by batch: the full model's log-probs of one batch are held while every block is skipped
    in turn, so what stays in memory is one batch's [tokens, vocab], never all of them (a streamed
    model reads one block at a time in each forward). Each block's sum runs over the batches in
    order, so the scores are the same as block by block."""
    model = pm.model
    n = len(pm.blocks)
    totals, count = [0.0] * n, 0
    for ids in progress(batches, "pruning: block skip KL", len(batches)) if progress else batches:
        with torch.inference_mode():
            ref = torch.log_softmax(model(input_ids=ids.to(device), use_cache=False).logits.float(), -1).cpu()
        for i in range(n):
            handle = pm.blocks[i].register_forward_hook(_identity_hook, with_kwargs=True)
            try:
                with torch.inference_mode():
                    logp = torch.log_softmax(model(input_ids=ids.to(device), use_cache=False).logits.float(), -1).cpu()
            finally:
                handle.remove()
            totals[i] += float((ref.exp() * (ref - logp)).sum(-1).clamp(min=0).sum())
        count += ids.numel()
    return torch.tensor([t / count for t in totals], dtype=torch.float64)


def _identity_hook(_m: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor | tuple) -> torch.Tensor | tuple:
    """Makes a decoder block return its input: the block is skipped."""
    x = args[0] if args else kwargs["hidden_states"]
    return (x, *out[1:]) if isinstance(out, tuple) else x


def top_indices(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices of the ``keep`` highest scores, in ascending index order (ties: lower index first)."""
    order = sorted(range(scores.numel()), key=lambda j: (-float(scores[j]), j))
    return torch.tensor(sorted(order[:keep]), dtype=torch.long)
