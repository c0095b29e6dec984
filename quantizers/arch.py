"""Per-architecture facts the calibrated quantizers need: where the decoder blocks are, and
which operations AWQ may rescale. One explicit table; an unsupported architecture is an error
that says how to add an entry.

An AWQ mapping ``prev -> linears`` says: the output of ``prev`` (a norm, or a Linear) is the
input of every Linear in ``linears`` and of nothing else, with no nonlinearity in between, so
scaling ``prev``'s output channels by ``1/s`` and the linears' input columns by ``s`` leaves the
float model unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from compress.errors import CompressError


@dataclass(frozen=True)
class AWQMapping:
    prev: str  # module name relative to the block
    linears: tuple[str, ...]  # module names relative to the block
    parent: str  # the module whose output the scale search compares (attention, MLP, or the Linear)
    inputs: str | None = None  # the module whose input is the mapping's input on every token (default: linears[0])
    scaled_too: tuple[str, ...] = ()  # modules that also read prev's output and are not quantized (an MoE router)


@dataclass(frozen=True)
class MoELayout:
    """Where a mixture-of-experts block keeps its parts (relative to the decoder block)."""

    experts: str  # the fused experts (compress/experts.py), one Linear per expert matrix while calibrating
    router: str  # the router: a weight [experts, hidden] read by F.linear, kept float
    norm: str  # the norm whose output feeds the router and every expert
    parent: str  # the MoE module whose output the norm mapping's scale search compares


@dataclass(frozen=True)
class Architecture:
    name: str
    blocks: str  # dotted path of the ModuleList of decoder blocks
    awq: tuple[AWQMapping, ...]
    norm_offset: float = 0.0
    """RMSNorm computes ``x_hat * (norm_offset + weight)`` (Gemma uses 1 + weight)."""
    final_norm: str = "model.norm"
    """Dotted path of the norm between the last block and the output head: the head's input is its output."""
    moe: MoELayout | None = None
    """Mixture-of-experts blocks (quantizers/moe.py); blocks without ``moe.experts`` use ``awq`` as dense ones."""

    def awq_mappings(self, block: nn.Module) -> tuple[AWQMapping, ...]:
        """The AWQ mappings of ``block``: ``awq``, or for an MoE block (its experts unfused into a ModuleList)
        the attention mappings, the norm -> every expert's gate/up (the router's columns scaled too,
        unquantized), and each expert's up -> down."""
        experts = _get(block, self.moe.experts) if self.moe else None
        if self.moe is None or not isinstance(experts, nn.ModuleList):
            return self.awq
        moe, n = self.moe, len(experts)
        gate_up = tuple(f"{moe.experts}.{e}.{p}" for e in range(n) for p in ("gate_proj", "up_proj"))
        return (
            _ATTN,
            _V_O,
            AWQMapping(moe.norm, gate_up, moe.parent, inputs=moe.router, scaled_too=(moe.router,)),
            *(
                AWQMapping(f"{moe.experts}.{e}.up_proj", (f"{moe.experts}.{e}.down_proj",), f"{moe.experts}.{e}.down_proj")
                for e in range(n)
            ),
        )


_ATTN = AWQMapping("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn")
_V_O = AWQMapping("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj")
_UP_DOWN = AWQMapping("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj")
_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")

LLAMA_LIKE = (_ATTN, _V_O, AWQMapping("post_attention_layernorm", _GATE_UP, "mlp"), _UP_DOWN)
# Gemma 2/3 norm the attention output before the residual (post_attention_layernorm) and feed
# the MLP from pre_feedforward_layernorm.
GEMMA_LIKE = (_ATTN, _V_O, AWQMapping("pre_feedforward_layernorm", _GATE_UP, "mlp"), _UP_DOWN)

ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", "model.layers", LLAMA_LIKE),
    "mistral": Architecture("mistral", "model.layers", LLAMA_LIKE),
    "qwen2": Architecture("qwen2", "model.layers", LLAMA_LIKE),
    "qwen3": Architecture("qwen3", "model.layers", LLAMA_LIKE),
    # Qwen3-MoE: fused routed experts, no shared expert; blocks in mlp_only_layers are dense (LLAMA_LIKE).
    "qwen3_moe": Architecture(
        "qwen3_moe", "model.layers", LLAMA_LIKE, moe=MoELayout("mlp.experts", "mlp.gate", "post_attention_layernorm", "mlp")
    ),
    "gemma2": Architecture("gemma2", "model.layers", GEMMA_LIKE, norm_offset=1.0),
    "gemma3_text": Architecture("gemma3_text", "model.layers", GEMMA_LIKE, norm_offset=1.0),
}


def architecture_of(model: nn.Module) -> Architecture:
    model_type = getattr(model.config, "model_type", None)
    arch = ARCHITECTURES.get(model_type)
    if arch is None:
        raise CompressError(
            f"calibrated quantization does not know the architecture '{model_type}' ({type(model).__name__}). "
            f"Supported: {', '.join(ARCHITECTURES)}. To add it, put an entry in ARCHITECTURES in "
            "quantizers/arch.py: the dotted path of its decoder-block ModuleList and its AWQ mappings "
            "(norm -> the Linears it feeds), following the llama entry; then add a tiny-model test in "
            "tests/test_calibrated.py. Until then, use method: rtn."
        )
    return arch


def _get(block: nn.Module, path: str) -> nn.Module | None:
    try:
        return block.get_submodule(path)
    except AttributeError:
        return None


def submodule(model: nn.Module, path: str) -> nn.Module:
    module: nn.Module = model
    for part in path.split("."):
        module = getattr(module, part)
    return module


def output_head(model: nn.Module) -> tuple[str, nn.Linear] | None:
    """The output head (the Linear that computes the logits) and its module name, or None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        return None
    return next(((n, m) for n, m in model.named_modules() if m is head), None)


def decoder_blocks(model: nn.Module, arch: Architecture) -> nn.ModuleList:
    module = submodule(model, arch.blocks)
    if not isinstance(module, nn.ModuleList):
        raise CompressError(f"{arch.blocks} of {type(model).__name__} is not a ModuleList; fix its entry in quantizers/arch.py")
    return module
