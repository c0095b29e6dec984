"""Float reference models: the same function as a model distributed quantized, off every block grid.

Both real models this project measures on were distributed quantized, so their dequantized weights
sit on a grid (each 32-value block of SmolLM2's Linears holds ~13 distinct values) that a quantizer
can find again. Users bring float checkpoints. ``float_reference`` rewrites a Llama-family model
(llama, qwen2: RMSNorm, rotary attention, SiLU-gated MLP) into one with the same logits and no grid,
by transforms that preserve the function exactly in real arithmetic:

1. each block's two RMSNorm weights are folded into the Linears that read the normed stream
   (q/k/v; gate/up), the norms' weights set to 1;
2. per-channel scales, drawn log-uniform in [1/``spread``, ``spread``], move between v_proj's
   output channels and o_proj's matching input channels (attention is linear in V, per channel;
   with grouped-query attention one kv channel feeds every query head of its group), and between
   up_proj's output channels and down_proj's matching inputs (the MLP is linear in up);
3. ``untie``: the output head becomes a copy of the token embedding, the final norm is folded into
   it, and then the residual stream is rotated by an orthogonal matrix ``Q`` close to the identity
   (``expm(angle * A)``, A skew-symmetric with unit-variance entries scaled by 1/sqrt(width)): the
   embedding and every Linear writing the stream (o, down) are turned by ``Q``, every Linear reading
   it (q/k/v, gate/up, head) by its transpose. RMSNorm without weights commutes with a rotation.
   A rotation near the identity keeps the outlier channels that make quantization hard; a Haar-random
   one would remove them and flatter every method. With tied embeddings the final norm cannot be
   folded (the head is the embedding), so the tied reference keeps its embedding as distributed.

``grid_share`` measures what the issue asked to check: the share of 32-value blocks of a matrix that
sit on an affine grid of 4, 5 or 6 bits (also per 16-value half, as K-quants' sub-blocks do).
"""

from __future__ import annotations

import math
from typing import Any

from compress import rotation

__all__ = ["float_reference", "grid_share", "ongrid_blocks"]

FAMILIES = ("llama", "qwen2")


def float_reference(model: Any, *, untie: bool, seed: int = 0, spread: float = 2.0, angle: float = 0.25) -> dict[str, Any]:
    """Rewrite ``model`` (a float32 Llama-family causal LM, in place) as described above; returns
    what was done, for the asset's facts."""
    import torch

    config = model.config
    if config.model_type not in FAMILIES:
        raise ValueError(f"float references are made for {', '.join(FAMILIES)} models, not {config.model_type}")
    generator = torch.Generator().manual_seed(seed)
    log_spread = math.log(spread)

    def scales(n: int) -> torch.Tensor:
        return torch.exp((torch.rand(n, generator=generator, dtype=torch.float64) * 2 - 1) * log_spread)

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            rotation.fold_norm(layer.input_layernorm, (attn.q_proj, attn.k_proj, attn.v_proj))
            rotation.fold_norm(layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj))
            s = scales(kv_heads * head_dim)
            _scale_rows(attn.v_proj, s)
            per_query = s.view(kv_heads, 1, head_dim).expand(kv_heads, heads // kv_heads, head_dim).reshape(-1)
            _scale_columns(attn.o_proj, 1 / per_query)
            s = scales(mlp.up_proj.out_features)
            _scale_rows(mlp.up_proj, s)
            _scale_columns(mlp.down_proj, 1 / s)
        facts: dict[str, Any] = {"seed": seed, "channel_scale_spread": spread, "tied": not untie}
        if untie:
            rotation.untie(model)
            rotation.fold_norm(model.model.norm, (model.lm_head,))
            q = _near_identity_rotation(config.hidden_size, angle, generator)
            rotation.rotate_residual(model, q)
            facts["rotation_angle"] = angle
    return facts


def _scale_rows(linear: Any, s: Any) -> None:
    import torch

    linear.weight.copy_((linear.weight.to(torch.float64) * s[:, None]).to(linear.weight.dtype))
    if linear.bias is not None:
        linear.bias.copy_((linear.bias.to(torch.float64) * s).to(linear.bias.dtype))


def _scale_columns(linear: Any, s: Any) -> None:
    import torch

    linear.weight.copy_((linear.weight.to(torch.float64) * s[None, :]).to(linear.weight.dtype))


def _near_identity_rotation(width: int, angle: float, generator: Any) -> Any:
    import torch

    a = torch.randn(width, width, generator=generator, dtype=torch.float64) / math.sqrt(width)
    return torch.linalg.matrix_exp(angle * (a - a.T) / math.sqrt(2))


def ongrid_blocks(weight: Any, block: int, levels: int = 64, tolerance: float = 2e-3) -> Any:
    """Per ``block``-value block along the rows of ``weight`` (a 2-D float tensor; a partial last block
    is left out): True where the block sits on an affine grid of at most ``levels`` levels, every value
    ``low + j * step`` with j whole (to ``tolerance`` of a step). The step is found from the smallest
    gap between the block's distinct values, divided by 1 to 4 (a grid whose adjacent levels are not
    both used), so grids whose extremes are not at the block's minimum and maximum (K-quants) count."""
    import torch

    rows, cols = weight.shape
    usable = cols - cols % block
    w = weight[:, :usable].to(torch.float64).reshape(rows, usable // block, block)
    values = w.sort(dim=-1).values
    low, span = values[..., :1], values[..., -1:] - values[..., :1]
    gaps = values.diff(dim=-1)
    gaps = torch.where(gaps > span * 1e-9, gaps, torch.full_like(gaps, float("inf"))).amin(dim=-1, keepdim=True)
    found = span.squeeze(-1) == 0  # a constant block is on every grid
    for divisor in (1, 2, 3, 4):
        step = gaps / divisor
        j = (w - low) / step
        fits = ((j - j.round()).abs() <= tolerance).all(dim=-1) & (span / step <= levels - 1 + tolerance).squeeze(-1)
        found |= fits & torch.isfinite(step).squeeze(-1)
    return found


def grid_share(weight: Any) -> float:
    """The share of 32-value blocks of ``weight`` on a grid of at most 64 levels (6 bits; 4- and 5-bit grids
    included), whole or in both 16-value halves (K-quants' 6-bit sub-blocks)."""
    import torch

    rows, cols = weight.shape
    blocks = cols // 32
    if blocks == 0:
        return 0.0
    halves = ongrid_blocks(weight, 16)[:, : 2 * blocks].reshape(rows, blocks, 2).all(dim=-1)
    found = ongrid_blocks(weight, 32) | halves
    return float(found.to(torch.float64).mean())
