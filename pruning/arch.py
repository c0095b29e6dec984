"""Which decoders structured pruning can edit, and where their parts are.

One explicit table: a model type is here when its blocks are ``self_attn.{q,k,v,o}_proj`` +
``mlp.{gate,up,down}_proj`` + ``input_layernorm`` / ``post_attention_layernorm``, its config
describes the shapes with ``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
``num_key_value_heads``, ``head_dim`` and ``num_hidden_layers``, and transformers rebuilds the
same shapes from those values. Gemma is not here: it scales embeddings by sqrt(hidden_size) and
norms with 1 + weight, which hidden-channel pruning would change.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from compress.errors import CompressError

PRUNABLE_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class PrunableModel:
    """A supported causal LM and accessors for the parts pruning edits."""

    model: nn.Module

    @classmethod
    def of(cls, model: nn.Module) -> PrunableModel:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in PRUNABLE_TYPES:
            raise CompressError(
                f"structured pruning supports {', '.join(PRUNABLE_TYPES)} decoders, not '{model_type}' ({type(model).__name__}). "
                "To add one with the same block layout, add its model_type to PRUNABLE_TYPES in pruning/arch.py and a "
                "tiny-model test in tests/test_pruning.py."
            )
        return cls(model)

    @property
    def config(self):  # noqa: ANN201 - a transformers PretrainedConfig
        return self.model.config

    @property
    def base(self) -> nn.Module:
        return self.model.model

    @property
    def blocks(self) -> nn.ModuleList:
        return self.base.layers

    @property
    def final_norm(self) -> nn.Module:
        return self.base.norm

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def intermediate_size(self) -> int:
        return int(self.config.intermediate_size)

    @property
    def num_heads(self) -> int:
        return int(self.config.num_attention_heads)

    @property
    def kv_heads(self) -> int:
        return int(getattr(self.config, "num_key_value_heads", None) or self.num_heads)

    @property
    def head_dim(self) -> int:
        return int(getattr(self.config, "head_dim", None) or self.hidden_size // self.num_heads)

    @staticmethod
    def down_proj(block: nn.Module) -> nn.Linear:
        return block.mlp.down_proj

    @staticmethod
    def o_proj(block: nn.Module) -> nn.Linear:
        return block.self_attn.o_proj

    @staticmethod
    def block_norms(block: nn.Module) -> list[nn.Module]:
        return [block.input_layernorm, block.post_attention_layernorm]

    def shape(self) -> dict[str, int]:
        return {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": len(self.blocks),
        }
