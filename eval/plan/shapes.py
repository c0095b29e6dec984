"""A model's shape without its weights, and the byte counts of files holding quantized records:
what `compress plan` (eval/plan/artifacts.py) and each export format's size estimate (export/<format>/plan.py)
compute sizes from. Shapes come from the model's config only, with the model built on torch's ``meta``
device (shapes, no weights); torch and transformers are imported when a shape is built."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from compress.errors import ModelLoadError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GB = 1e9


@dataclass
class ModelShape:
    """A model's architecture without weights: its config and a meta-device instance."""

    config: Any  # transformers PretrainedConfig
    model: Any  # the model on torch's meta device (shapes only)
    params: int  # distinct parameters (a tied embedding counts once)
    origin: str  # where the config came from

    @property
    def text(self) -> Any:
        return self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config

    def rebuilt(self, config: Any, origin: str) -> ModelShape:
        """The shape of ``config`` (a changed copy of this one's, e.g. by a stage's ``plan_shape``)."""
        return shape_of(config, False, origin)

    def frozen_params(self) -> int:
        """The embedding and output head: what `distill: train: blocks` leaves frozen."""
        emb, out = self.model.get_input_embeddings(), self.model.get_output_embeddings()
        return emb.weight.numel() + (out.weight.numel() if out is not None and out.weight is not emb.weight else 0)


def shape_of(config: Any, trust_remote_code: bool = False, origin: str = "") -> ModelShape:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = config.__class__.from_dict(config.to_dict())
    if hasattr(config, "quantization_config"):  # a quantized checkpoint: its float architecture is what we count
        del config.quantization_config
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"transformers cannot build a causal LM from this config ({origin}): {exc}") from exc
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return ModelShape(config, model, params, origin)


@dataclass
class Record:
    """A quantized Linear as the plan sees it: shape, scheme, and whether its weight is the tied embedding."""

    out_f: int
    in_f: int
    scheme: Any  # QuantScheme
    tied: bool


def packed_bytes(
    shape: ModelShape,
    records: dict[str, Record],
    float_bits: float,
    code_bits: float | None = None,
    scale_bits: float | None = None,
    zero_bits: float | None = None,
    group: int | None = None,
    zeros_always: bool = False,
    extra_bits_per_input: float = 0,
) -> int:
    """Bytes of a file holding ``records`` as codes + per-group scales (+ zero points) and every
    other parameter at ``float_bits``. None: take the record's own bits / scale dtype / group;
    zero points cost the code bits for asymmetric records (all records with ``zeros_always``)."""
    total = 0.0
    quantized = 0
    for r in records.values():
        s = r.scheme
        g = group or s.group_width(r.in_f)
        zb = zero_bits if zero_bits is not None else (s.bits if zeros_always or not s.symmetric else 0)
        sb = scale_bits if scale_bits is not None else s.scale_bits
        total += r.out_f * r.in_f * (code_bits or s.bits) + r.out_f * math.ceil(r.in_f / g) * (sb + zb) + r.in_f * extra_bits_per_input
        total += s.tensor_scale_bits
        quantized += 0 if r.tied else r.out_f * r.in_f  # a tied weight still exists as the float embedding
    return int((total + (shape.params - quantized) * float_bits) / 8)


def only_bits(records: dict[str, Record]) -> int | None:
    bits = {r.scheme.bits for r in records.values()}
    return bits.pop() if len(bits) == 1 else None


def linear_weights(shape: ModelShape, with_lm_head: bool) -> int:
    """Weights of Linear layers that are not the tied embedding (and not the output head unless asked)."""
    from torch import nn

    emb = shape.model.get_input_embeddings().weight
    return sum(
        m.weight.numel()
        for n, m in shape.model.named_modules()
        if isinstance(m, nn.Linear) and m.weight is not emb and (with_lm_head or not n.endswith("lm_head"))
    )


def uniform_bytes(shape: ModelShape, linear_bits: float, other_bits: float) -> int:
    linear = linear_weights(shape, with_lm_head=True)
    return int((linear * linear_bits + (shape.params - linear) * other_bits) / 8)
