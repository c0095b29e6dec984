"""A Hugging Face model folder as compress writes and reads it: config and tokenizer files, the float
tensors beside quantized records, a model rebuilt from float tensors and records, and the folder's
SHA-256 checksums. Shared by the artifact (compress/artifact.py) and the checkpoint exports
(export/checkpoint/), so neither imports the other."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.errors import ArtifactError
from compress.experts import expert_view
from compress.fsutil import sha256_file
from compress.quantizers.core import QuantizedWeight


def embeddings_tied(model: nn.Module) -> bool:
    out = model.get_output_embeddings()
    return out is not None and out.weight is model.get_input_embeddings().weight


def write_config_and_tokenizer(
    directory: Path, model: nn.Module, tokenizer: Any, quantization_config: dict[str, Any] | None = None
) -> None:
    """Save the model's config (tie flag as the model has it now; ``quantization_config`` when
    given, else none), its generation config and the tokenizer files into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.tie_word_embeddings = embeddings_tied(model)
    if hasattr(config, "quantization_config"):  # an imported checkpoint's: the weights written now decide
        del config.quantization_config
    config.save_pretrained(directory)
    if quantization_config is not None:
        path = directory / "config.json"
        path.write_text(
            json.dumps({**json.loads(path.read_text()), "quantization_config": quantization_config}, indent=2, sort_keys=True) + "\n"
        )
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def float_tensors(model: nn.Module, quantized: Mapping[str, QuantizedWeight]) -> Iterator[tuple[str, torch.Tensor]]:
    """The state dict without the weights of quantized layers and without tied copies, as (name,
    tensor) pairs: a streamed model's tensors are read from its store one unit at a time."""
    from compress.streaming import tensors

    skip = {f"{name}.weight" for name in quantized}
    return ((name, t.contiguous().cpu()) for name, t in tensors(model) if name not in skip)


def checksums(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


def assemble_model(
    config: Any,
    floats: dict[str, torch.Tensor],
    records: dict[str, QuantizedWeight],
    dtype: torch.dtype,
    where: str,
    trust_remote_code: bool = False,
) -> nn.Module:
    """Build a model from ``config`` with the ``floats`` tensors and every record's dequantized
    weight installed; ``where`` names the weight source in errors. Returned in eval mode, frozen.
    Refused (compress.integrity): blocks the weights do not hold, a shape or dtype the config does not
    imply, a weight missing, a non-finite value."""
    from transformers import AutoModelForCausalLM

    from compress import integrity

    stored = {**integrity.in_memory(floats, where), **{f"{n}.weight": integrity.Stored(where, r.shape, "F32") for n, r in records.items()}}
    if isinstance(getattr(config, "num_hidden_layers", None), int):
        integrity.check_block_count(config.num_hidden_layers, stored, where)  # before building: a config's 10⁹ blocks are refused
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    needed = {name: (tuple(t.shape), t.is_floating_point()) for name, t in model.state_dict().items() if name in floats}
    integrity.check_stored(needed, stored, config.to_dict(), where)
    missing, unexpected = model.load_state_dict(floats, strict=False)
    if unexpected:
        raise ArtifactError(f"{where}: weights the model does not have: {unexpected[:5]}")
    modules = dict(model.named_modules())
    for name, record in records.items():
        module = modules.get(name)
        expert = expert_view(model, name) if module is None else None  # a slice of a fused-experts parameter
        if expert is not None and tuple(expert.shape) == record.shape:
            expert.copy_(record.dequantize(dtype))
            continue
        if module is None or tuple(module.weight.shape) != record.shape:
            found = "no such layer" if module is None else f"the model's layer is {tuple(module.weight.shape)}"
            raise ArtifactError(f"{where}: quantized layer {name} {record.shape} does not fit the model's config ({found})")
        module.weight = nn.Parameter(record.dequantize(dtype), requires_grad=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    still_missing = [
        k for k in missing if k.removesuffix(".weight") not in records and not (config.tie_word_embeddings and k == "lm_head.weight")
    ]
    if still_missing:
        raise ArtifactError(f"{where}: weights missing: {still_missing[:5]}")
    integrity.check_all_finite(model.state_dict().items(), where)
    return model.eval().requires_grad_(False)
