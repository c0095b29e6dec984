"""The GGUF writer: the header, metadata and tensor table first, then each tensor's bytes as the
layout plans them (records packed, float tensors streamed a unit at a time), and what a size budget
needs of the file (``file_layout``: its fixed tensors' bytes and the bytes before the tensor data).
"""

from __future__ import annotations

import json
import math
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.errors import FormatError
from compress.export.format import FileLayout
from compress.export.gguf.blocks import PACKERS, float_bytes
from compress.export.gguf.layout import MIX, GGUFPlan, permute_rows, permuted_record, plan_tensors, tensor_bytes
from compress.export.gguf.metadata import METADATA_NAMESPACE, add_hyperparameters, add_tokenizer, copy_tokenizer, file_type
from compress.quantizers.core import QuantizedWeight
from compress.streaming import tensors


def write_gguf(
    path: Path,
    model: nn.Module,
    tokenizer: Any,
    records: dict[str, QuantizedWeight],
    type_name: str,
    float_type: str | None = None,
    fallback: str | None = None,
    pre_tokenizer: str = "auto",
    extra_metadata: dict[str, Any] | None = None,
    tokenizer_from: Path | None = None,
    share_head: bool = True,
) -> dict[str, Any]:
    """Write ``model`` (records packed exactly where ``type_name`` allows) to ``path``; return facts.
    ``tokenizer_from``: a GGUF source whose tokenizer is copied as it is (else it is built from
    ``tokenizer``'s tokenizer.json)."""
    plan = plan_tensors(model, records, type_name, float_type, fallback, share_head)
    writer, tok_facts = _write_header(path, model, tokenizer, plan, type_name, pre_tokenizer, extra_metadata, tokenizer_from)
    floats = {t.hf_name for t in plan.tensors if t.source not in ("record", "dequantized", "fallback")}
    # The plan follows the state dict's order; the float tensors are read one streamed unit at a time.
    streamed = ((name, tensor) for name, tensor in tensors(model, keep_tied=True) if name in floats)
    pending = dict.fromkeys(floats)
    for t in plan.tensors:
        module = t.record_name
        if t.hf_name in floats:
            while pending.get(t.hf_name) is None:
                name, tensor = next(streamed)
                pending[name] = tensor
        if t.source == "record":
            data = PACKERS[t.type_name](permuted_record(records[module].cpu(), t.permute_heads))
        else:
            tensor = records[module].dequantize() if t.source in ("dequantized", "fallback") else pending.pop(t.hf_name)
            if t.permute_heads is not None:
                tensor = permute_rows(tensor, t.permute_heads)
            if t.offset:
                tensor = tensor.to(torch.float32) + t.offset
            data = float_bytes(tensor, t.type_name)
            del tensor
        expected = t.info()[2]
        if data.nbytes != expected:  # a packer and the tensor table disagree: our bug, caught before the file is used
            raise FormatError(f"{t.hf_name}: {data.nbytes} bytes made for GGUF {t.type_name}, the tensor table says {expected}")
        writer.write_tensor_data(data)
        del data
    writer.close()
    return {
        "architecture": plan.arch.name,
        "type": type_name,
        "tensor_types": plan.counts(),
        "fallbacks": plan.fallbacks,
        "type_fallbacks": plan.type_fallbacks,
        "tokenizer": tok_facts,
        "plan": plan,
    }


def _write_header(
    path: Path,
    model: nn.Module,
    tokenizer: Any,
    plan: GGUFPlan,
    type_name: str,
    pre_tokenizer: str,
    extra_metadata: dict[str, Any] | None,
    tokenizer_from: Path | None,
) -> tuple[Any, dict[str, Any]]:
    """Open the GGUF writer and write everything before the tensor data: the header, the metadata
    (hyperparameters, tokenizer, ``extra_metadata``) and the tensor table from the plan's shapes and
    types (two passes, so that only one tensor's bytes are in memory at a time)."""
    import gguf

    writer = gguf.GGUFWriter(path, plan.arch.name)
    writer.add_name(str(getattr(model.config, "_name_or_path", "") or plan.arch.name))
    add_hyperparameters(writer, model, plan.arch)
    for method, value in plan.family_keys.items():
        getattr(writer, method)(value)
    if type_name == MIX:  # general.file_type is only shown by llama.cpp: the type holding the most weights names a mix
        weights: Counter[str] = Counter()
        for t in plan.tensors:
            if t.source == "record":
                weights[t.type_name] += math.prod(t.shape)
        type_name = weights.most_common(1)[0][0] if weights else "q8_0"
    writer.add_file_type(file_type(type_name))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    n_vocab = int(model.config.vocab_size)
    if tokenizer_from is not None:
        tok_facts = copy_tokenizer(writer, tokenizer_from, n_vocab, pre_tokenizer)
    else:
        tok_facts = add_tokenizer(writer, tokenizer, n_vocab, pre_tokenizer)
    for key, value in (extra_metadata or {}).items():
        writer.add_string(f"{METADATA_NAMESPACE}.{key}", value if isinstance(value, str) else json.dumps(value, sort_keys=True))
    for t in plan.tensors:
        info_shape, dtype, nbytes, raw = t.info()
        writer.add_tensor_info(t.gguf_name, info_shape, dtype, nbytes, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    return writer, tok_facts


def write_metadata_only(path: Path, model: nn.Module, tokenizer: Any, pre_tokenizer: str = "auto") -> int:
    """Bytes a GGUF file of ``model`` holds before its tensor data (what a size budget leaves out
    for the tensors), measured by writing that part alone to ``path``."""
    plan = plan_tensors(model, {}, "q8_0", None, None)  # names and shapes; types do not change the table's size
    writer, _ = _write_header(path, model, tokenizer, plan, "q8_0", pre_tokenizer, None, None)
    writer.close()
    return path.stat().st_size


def file_layout(cfg: Any, model: nn.Module, tokenizer: Any, quantized: set[str]) -> FileLayout:
    """What a GGUF file of ``model`` holds besides the Linears in ``quantized`` (a size budget's
    choice): the tensors no quantize stage touches (embeddings, norms, a float head, in the types
    ``plan_tensors`` gives them), every tensor's parameters and the bytes before the tensor data."""
    plan = plan_tensors(model, {}, "q8_0", cfg.float_type, None)
    weights = {f"{name}.weight" for name in quantized}  # a quantized Linear's bias stays F32 in the file
    fixed = sum(tensor_bytes(t.type_name, t.shape) for t in plan.tensors if t.hf_name not in weights)
    params = sum(math.prod(t.shape) for t in plan.tensors)

    def metadata_bytes() -> int:
        with tempfile.TemporaryDirectory() as tmp:
            return write_metadata_only(Path(tmp) / "meta.gguf", model, tokenizer)

    return FileLayout(tensor_bytes, fixed, params, metadata_bytes)
