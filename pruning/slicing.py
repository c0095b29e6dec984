"""Cut a supported decoder down to kept indices: a smaller dense model, config updated so that
transformers rebuilds exactly these shapes (``save_pretrained`` / ``from_pretrained`` round-trip).

Every function edits the model in place and replaces the Linear/Embedding/norm parameters it
touches by sliced copies; nothing here decides *what* to keep (see importance and the stage).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from compress.pruning.arch import PrunableModel


def slice_linear(linear: nn.Linear, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> nn.Linear:
    """A new Linear with only output ``rows`` and input ``cols`` (None keeps all)."""
    w = linear.weight.detach()
    if rows is not None:
        w = w.index_select(0, rows.to(w.device))
    if cols is not None:
        w = w.index_select(1, cols.to(w.device))
    out = nn.Linear(w.shape[1], w.shape[0], bias=linear.bias is not None, device=w.device, dtype=w.dtype)
    out.weight = nn.Parameter(w.clone(), requires_grad=linear.weight.requires_grad)
    if linear.bias is not None:
        b = linear.bias.detach()
        if rows is not None:
            b = b.index_select(0, rows.to(b.device))
        out.bias = nn.Parameter(b.clone(), requires_grad=linear.bias.requires_grad)
    return out


def _slice_param(module: nn.Module, name: str, index: torch.Tensor, dim: int) -> None:
    p = getattr(module, name)
    setattr(module, name, nn.Parameter(p.detach().index_select(dim, index.to(p.device)).clone(), requires_grad=p.requires_grad))


def prune_mlp(pm: PrunableModel, keep: Sequence[torch.Tensor]) -> None:
    """Keep neurons ``keep[i]`` (same count in every block) of block ``i``'s MLP."""
    sizes = {int(k.numel()) for k in keep}
    assert len(sizes) == 1 and len(keep) == len(pm.blocks), "one index set of one size per block"
    for block, idx in zip(pm.blocks, keep, strict=True):
        slice_block_mlp(block, idx)
    pm.config.intermediate_size = int(keep[0].numel())


def slice_block_mlp(block: nn.Module, idx: torch.Tensor) -> None:
    """Keep neurons ``idx`` of one block's MLP (the config is the caller's: ``prune_mlp``)."""
    mlp = block.mlp
    mlp.gate_proj = slice_linear(mlp.gate_proj, rows=idx)
    mlp.up_proj = slice_linear(mlp.up_proj, rows=idx)
    mlp.down_proj = slice_linear(mlp.down_proj, cols=idx)
    if hasattr(mlp, "intermediate_size"):  # informational attributes kept true
        mlp.intermediate_size = int(idx.numel())


def head_rows(heads: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Row indices of ``heads`` in a projection whose output is heads × head_dim."""
    return (heads.unsqueeze(1) * head_dim + torch.arange(head_dim)).reshape(-1)


def prune_kv_groups(pm: PrunableModel, keep: Sequence[torch.Tensor]) -> None:
    """Keep KV groups ``keep[i]`` of block ``i`` (same count everywhere): each kept key/value
    head with all the query heads that share it, so grouped-query attention stays consistent."""
    hd, per_group = pm.head_dim, pm.num_heads // pm.kv_heads
    for block, groups in zip(pm.blocks, keep, strict=True):
        slice_block_kv_groups(block, groups, hd, per_group)
    kv_groups_config(pm, int(keep[0].numel()), hd, per_group)


def slice_block_kv_groups(block: nn.Module, groups: torch.Tensor, head_dim: int, per_group: int) -> None:
    """Keep KV groups ``groups`` of one block's attention (the config: ``kv_groups_config``)."""
    attn = block.self_attn
    q_heads = (groups.unsqueeze(1) * per_group + torch.arange(per_group)).reshape(-1)
    q_rows, kv_rows = head_rows(q_heads, head_dim), head_rows(groups, head_dim)
    attn.q_proj = slice_linear(attn.q_proj, rows=q_rows)
    attn.k_proj = slice_linear(attn.k_proj, rows=kv_rows)
    attn.v_proj = slice_linear(attn.v_proj, rows=kv_rows)
    attn.o_proj = slice_linear(attn.o_proj, cols=q_rows)


def kv_groups_config(pm: PrunableModel, kept: int, head_dim: int, per_group: int) -> None:
    """The config after every block kept ``kept`` KV groups."""
    pm.config.head_dim = head_dim  # explicit: hidden_size / num_attention_heads no longer gives it
    pm.config.num_key_value_heads = kept
    pm.config.num_attention_heads = kept * per_group


def prune_hidden(pm: PrunableModel, keep: torch.Tensor) -> None:
    """Keep embedding channels ``keep`` everywhere: the embedding, every norm, the input columns
    of every Linear reading the residual stream, the output rows of every Linear writing it, and
    the output head."""
    model = pm.model
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is model.get_input_embeddings().weight
    emb = model.get_input_embeddings()
    new_emb = nn.Embedding(
        emb.num_embeddings, int(keep.numel()), padding_idx=emb.padding_idx, device=emb.weight.device, dtype=emb.weight.dtype
    )
    new_emb.weight = nn.Parameter(
        emb.weight.detach().index_select(1, keep.to(emb.weight.device)).clone(), requires_grad=emb.weight.requires_grad
    )
    model.set_input_embeddings(new_emb)
    for block in pm.blocks:
        attn, mlp = block.self_attn, block.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, slice_linear(getattr(attn, name), cols=keep))
        attn.o_proj = slice_linear(attn.o_proj, rows=keep)
        mlp.gate_proj = slice_linear(mlp.gate_proj, cols=keep)
        mlp.up_proj = slice_linear(mlp.up_proj, cols=keep)
        mlp.down_proj = slice_linear(mlp.down_proj, rows=keep)
        if hasattr(mlp, "hidden_size"):
            mlp.hidden_size = int(keep.numel())
        for norm in pm.block_norms(block):
            _slice_param(norm, "weight", keep, 0)
    _slice_param(pm.final_norm, "weight", keep, 0)
    pm.config.head_dim = pm.head_dim  # before hidden_size changes: it is no longer hidden_size / heads
    pm.config.hidden_size = int(keep.numel())
    if tied:
        model.tie_weights()
    else:
        model.set_output_embeddings(slice_linear(model.get_output_embeddings(), cols=keep))


def drop_layers(pm: PrunableModel, drop: Sequence[int]) -> list[int]:
    """Remove blocks ``drop``; returns the original indices of the blocks that stay. Layer
    indices (the KV cache's slots) and per-layer config lists are renumbered to match."""
    gone = set(drop)
    kept = [i for i in range(len(pm.blocks)) if i not in gone]
    pm.base.layers = nn.ModuleList([pm.blocks[i] for i in kept])
    for new, block in enumerate(pm.blocks):
        for owner in (block, block.self_attn):
            if hasattr(owner, "layer_idx"):
                owner.layer_idx = new
    config = pm.config
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [config.layer_types[i] for i in kept]
    config.num_hidden_layers = len(kept)
    return kept
