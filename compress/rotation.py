"""Function-preserving rewrites of a Llama-family decoder's weights (llama, mistral, qwen2, qwen3: RMSNorm,
rotary attention, SiLU-gated MLP), shared by the float references (compress/float_reference.py) and the
``rotate:`` stage (quantizers/rotate/). Each holds exactly in real arithmetic; every product is computed
in float64 and stored in the parameter's dtype.

- ``fold_norm``: an RMSNorm's weight goes into the Linears that read its output.
- ``untie``: the output head gets a copy of the token embedding of its own.
- ``rotate_residual``: the residual stream x becomes x @ Q for an orthogonal Q. RMSNorm without a weight
  commutes with it (the mean square of x @ Q is x's), so with every norm folded first the embedding and
  the Linears writing the stream turn by Q and the Linears reading it by Q's transpose.
- ``rotate_heads``: attention is linear in V per head, so each KV head's values may be turned by an
  orthogonal R (v_proj's rows) and turned back where o_proj reads them (its columns of every query head
  the KV head serves).
"""

from __future__ import annotations

from typing import Any

__all__ = ["fold_norm", "rotate_heads", "rotate_residual", "untie"]


def fold_norm(norm: Any, readers: tuple[Any, ...]) -> None:
    """Multiply each Linear of ``readers`` column-wise by ``norm``'s weight, then make the weight 1."""
    import torch

    weight = norm.weight.detach().to(torch.float64)
    for linear in readers:
        linear.weight.copy_((linear.weight.to(torch.float64) * weight).to(linear.weight.dtype))
    norm.weight.fill_(1.0)


def untie(model: Any) -> None:
    """Give the output head a copy of the token embedding (a new Parameter), and say so in the config."""
    import torch

    embedding = model.model.embed_tokens.weight
    model.lm_head.weight = torch.nn.Parameter(embedding.detach().clone())
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False


def rotate_residual(model: Any, q: Any) -> None:
    """The residual stream x becomes x @ q (``q`` float64, orthogonal): writers W -> q^T W (their biases
    b -> b q), readers W -> W q, the embedding E -> E q. Every norm on the stream must be folded first
    and the head untied from the embedding."""
    import torch

    def turn(param: Any, left: bool) -> None:
        w = param.to(torch.float64)
        param.copy_((q.T @ w if left else w @ q).to(param.dtype))

    turn(model.model.embed_tokens.weight, left=False)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for reader in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            turn(reader.weight, left=False)
        for writer in (attn.o_proj, mlp.down_proj):
            turn(writer.weight, left=True)
            if writer.bias is not None:
                writer.bias.copy_((writer.bias.to(torch.float64) @ q).to(writer.bias.dtype))
    turn(model.lm_head.weight, left=False)


def rotate_heads(v_proj: Any, o_proj: Any, r: Any, kv_heads: int) -> None:
    """Each KV head's values v become v @ ``r`` (``r`` float64 [head_dim, head_dim], orthogonal): v_proj's
    rows of the head (and its bias) turn by r^T, and o_proj's columns of every query head reading it
    (``heads / kv_heads`` consecutive heads, grouped-query attention) by r, so o_proj's output is unchanged."""
    import torch

    head_dim = r.shape[0]
    w = v_proj.weight.to(torch.float64).reshape(kv_heads, head_dim, -1)
    v_proj.weight.copy_(torch.einsum("dk,hdi->hki", r, w).reshape(v_proj.weight.shape).to(v_proj.weight.dtype))
    if v_proj.bias is not None:
        b = v_proj.bias.to(torch.float64).reshape(kv_heads, head_dim)
        v_proj.bias.copy_((b @ r).reshape(-1).to(v_proj.bias.dtype))
    out = o_proj.weight.to(torch.float64)
    heads = out.shape[1] // head_dim
    o_proj.weight.copy_((out.reshape(out.shape[0], heads, head_dim) @ r).reshape(out.shape).to(o_proj.weight.dtype))
