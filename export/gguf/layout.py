"""The GGUF tensor layout: which tensor of the file each state-dict tensor becomes (llama.cpp's name,
block or float type, Q/K row permutation, fallbacks), from the architecture table and the records,
and the bytes each tensor takes in the file.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from compress.errors import FormatError
from compress.export.gguf.blocks import ggml_type, record_problem
from compress.export.gguf.config import GGUF_EXACT_TYPES, GGUF_FLOAT_TYPES, GGUF_FP4_TYPES
from compress.export.gguf.metadata import gemma_keys
from compress.quantizers.arch import ARCHITECTURES as QUANT_ARCHITECTURES
from compress.quantizers.core import QuantizedWeight
from compress.quantizers.fp4_config import FP4Scheme
from compress.quantizers.grids import GRIDS

MIX = "mix"  # the export's type when each record keeps the GGUF type of its own grid (a size budget's choice)


@dataclass(frozen=True)
class GGUFArch:
    name: str  # llama.cpp's architecture name
    permute_qk: bool  # llama.cpp's llama arch expects interleaved rotary rows in Q/K
    # The family's own keys (soft-capping, sliding windows) as {GGUFWriter method: value}, after checking
    # that llama.cpp's graph for the family computes what this config does (FormatError naming the key).
    family_keys: Callable[[Any, str], dict[str, Any]] | None = None
    # llama.cpp's graph for the family makes queries as wide as the hidden size (its qwen2 reads no head
    # width from the file), so a model whose heads x head_dim differs (heads or hidden channels pruned
    # apart) cannot be written as this family.
    queries_as_wide_as_hidden: bool = False


# transformers model_type -> llama.cpp architecture. Add an entry (and its test) to support more.
ARCHITECTURES: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", permute_qk=True),
    "mistral": GGUFArch("llama", permute_qk=True),
    "qwen2": GGUFArch("qwen2", permute_qk=False, queries_as_wide_as_hidden=True),
    "qwen3": GGUFArch("qwen3", permute_qk=False),
    "gemma2": GGUFArch("gemma2", permute_qk=False, family_keys=gemma_keys),
    "gemma3_text": GGUFArch("gemma3", permute_qk=False, family_keys=gemma_keys),
}


@dataclass
class TensorPlan:
    hf_name: str
    gguf_name: str
    type_name: str  # f32 | f16 | bf16 | a block type of GRIDS
    source: str  # "record" (exact), "requantized" (fallback from a record), "float"
    permute_heads: int | None = None  # Q/K row permutation with this many heads
    shape: tuple[int, ...] = ()  # the tensor's shape (rows, columns) as the state dict holds it
    offset: float = 0.0  # added to the values as written: the norm offset of quantizers/arch.py (Gemma's x_hat * (1 + w)), as llama.cpp computes x_hat * w
    record: str | None = None  # the record it holds, when not its own module's (token_embd holding a tied source's head)

    @property
    def record_name(self) -> str:
        return self.record or self.hf_name.rsplit(".", 1)[0]

    def info(self) -> tuple[tuple[int, ...], Any, int, Any]:
        """What the GGUF tensor-info table says of this tensor before its data is made: (shape as
        gguf-py's writer takes it, numpy dtype, bytes, ggml type or None for plain f32/f16)."""
        import gguf

        numel = int(np.prod(self.shape))
        if self.type_name == "f32":
            return self.shape, np.dtype(np.float32), numel * 4, None
        if self.type_name == "f16":
            return self.shape, np.dtype(np.float16), numel * 2, None
        raw = ggml_type(self.type_name)
        byte_shape = tuple(int(n) for n in gguf.quant_shape_to_byte_shape(self.shape, raw))
        return byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw


@dataclass
class GGUFPlan:
    arch: GGUFArch
    tensors: list[TensorPlan] = field(default_factory=list)
    fallbacks: dict[str, str] = field(default_factory=dict)  # record name -> why it fell back
    # record name -> the type llama.cpp's rule gives a row the export's K-quant blocks do not divide, and why
    type_fallbacks: dict[str, str] = field(default_factory=dict)
    family_keys: dict[str, Any] = field(default_factory=dict)  # GGUFArch.family_keys: {GGUFWriter method: value}

    @property
    def one_table(self) -> TensorPlan | None:
        """The token embedding written from the head's record (head_table), if the file has one table."""
        return next((t for t in self.tensors if t.record == HEAD_RECORD and t.hf_name != "lm_head.weight"), None)

    def counts(self) -> dict[str, int]:
        return dict(Counter(f"{t.type_name} ({t.source})" for t in self.tensors))


def architecture_of(model: nn.Module) -> GGUFArch:
    model_type = getattr(model.config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise FormatError(
            f"GGUF export does not know the architecture '{model_type}'; known: {', '.join(sorted(ARCHITECTURES))}. "
            "Add an entry to ARCHITECTURES in export/gguf/layout.py (llama.cpp's architecture name and whether Q/K rows are permuted) with a test"
        )
    arch = ARCHITECTURES[model_type]
    cfg = model.config
    heads = cfg.num_attention_heads
    width = heads * int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    if arch.queries_as_wide_as_hidden and width != cfg.hidden_size:
        raise FormatError(
            f"llama.cpp's {arch.name} makes queries as wide as the hidden size ({cfg.hidden_size}); this model's are "
            f"{heads} heads x {width // heads} = {width} wide (heads and hidden channels pruned apart), which no {arch.name} "
            f"GGUF can hold. Prune them together: hidden {{size: {width}}} with these heads, or heads down to "
            f"{cfg.hidden_size // (width // heads)} with this hidden size"
        )
    return arch


def tensor_names(model: nn.Module) -> Any:
    """gguf-py's map from the model's Hugging Face tensor names to llama.cpp's (``get_name``)."""
    import gguf

    arch = architecture_of(model)
    return gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch.name], model.config.num_hidden_layers)


def own_head_type(name: str, record: QuantizedWeight) -> str | None:
    """The GGUF type a head record keeps in a file of another type: the head quantized on a GGUF
    type's grid of its own (a stage of its own, ``targets: [lm_head]``, ``gguf_type: q8_0``), as
    llama.cpp's mixes give the output its own type (Q8_0, or Q6_K for rows of a multiple of 256)."""
    return record.scheme.gguf_type if name == HEAD_RECORD else None


def resolve_type(type_name: str, records: dict[str, QuantizedWeight]) -> str:
    """The block type of an exact export: ``auto`` picks from the records' schemes (a head on a
    GGUF grid of its own keeps its type and does not take part)."""
    if type_name != "auto":
        return type_name
    formats = {r.scheme.format for r in records.values() if isinstance(r.scheme, FP4Scheme)}
    if formats:  # an fp4 stage's records (or their plan): the block type of their format
        if len(formats) > 1 or any(not isinstance(r.scheme, FP4Scheme) for r in records.values()):
            raise FormatError("type: auto cannot pick one GGUF block type for FP4 records beside others; set type (and fallback)")
        return formats.pop()
    if any(own_head_type(n, r) for n, r in records.items()) and len(records) > 1:
        records = {n: r for n, r in records.items() if not own_head_type(n, r)}
    schemes = {(r.scheme.bits, r.scheme.symmetric) for r in records.values()}
    if not schemes:
        return "f16"
    grids = {r.scheme.gguf_type for r in records.values()}
    for name in grids - {None}:  # records on a type's grid (and its fallbacks'): that type
        if grids <= set(GRIDS[name].family):
            return name
    if None not in grids:  # every record on a grid of its own choosing (a size budget's mix): each its own type
        return MIX
    if schemes == {(4, True)}:
        return "q4_0"
    if {b for b, _ in schemes} == {4}:
        return "q4_1"
    if schemes == {(8, True)}:
        return "q8_0"
    raise FormatError(f"type: auto cannot pick one GGUF block type for the schemes {sorted(schemes)}; set type (and fallback)")


def head_table(model: nn.Module, records: dict[str, QuantizedWeight], share: bool = True) -> str | None:
    """The state-dict name of the token embedding when the file's one table is the head's record: the
    source ties them (config ``tie_word_embeddings``), the quantize stage quantized the head (and so
    untied it in memory) and not the embedding. llama.cpp then reads token_embd for both, as for every
    tied model. None otherwise, or when ``share`` is False (``keep_float: [embeddings]``)."""
    from compress.hf_model import embeddings_tied

    if not share or HEAD_RECORD not in records or embeddings_tied(model) or not getattr(model.config, "tie_word_embeddings", False):
        return None
    weight = model.get_input_embeddings().weight
    name = next(n for n, p in model.named_parameters() if p is weight)
    return None if name.removesuffix(".weight") in records else name


HEAD_RECORD = "lm_head"


def plan_tensors(
    model: nn.Module,
    records: dict[str, QuantizedWeight],
    type_name: str,
    float_type: str | None,
    fallback: str | None,
    share_head: bool = True,
) -> GGUFPlan:
    """Which GGUF tensor each state-dict tensor becomes, in which type, and why."""

    from compress.hf_model import embeddings_tied

    arch = architecture_of(model)
    cfg = model.config
    names = tensor_names(model)
    matrix_default = float_type or (type_name if type_name in GGUF_FLOAT_TYPES else "q8_0")
    plan = GGUFPlan(arch, family_keys=arch.family_keys(cfg, arch.name) if arch.family_keys else {})
    tied = embeddings_tied(model)
    shared = head_table(model, records, share_head)
    known = QUANT_ARCHITECTURES.get(getattr(cfg, "model_type", ""))
    norm_offset = known.norm_offset if known is not None else 0.0
    for hf_name, tensor in model.state_dict().items():
        if (tied or shared) and hf_name == "lm_head.weight":
            continue  # llama.cpp uses token_embd for the output when output.weight is absent
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise FormatError(f"no GGUF name for {hf_name} in llama.cpp's '{arch.name}' tensor map")
        module = hf_name.rsplit(".", 1)[0]
        shape = tuple(int(n) for n in tensor.shape)
        heads = None
        if arch.permute_qk and hf_name.endswith((".q_proj.weight", ".q_proj.bias")):
            heads = cfg.num_attention_heads
        elif arch.permute_qk and hf_name.endswith((".k_proj.weight", ".k_proj.bias")):
            heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        if hf_name == shared:  # one table: the head's record, read by llama.cpp as embeddings and as the output
            module = HEAD_RECORD
        if hf_name.endswith(".weight") and module in records:
            record = records[module]
            own = record.scheme.gguf_type if type_name == MIX else own_head_type(module, record)
            tensor_type = type_name if own is None or type_name in GGUF_FLOAT_TYPES else own
            if tensor_type == type_name and type_name in GRIDS and GRIDS[type_name].for_width(record.shape[1]).name != type_name:
                grid = GRIDS[type_name]
                tensor_type = grid.for_width(record.shape[1]).name
                plan.type_fallbacks[module] = (
                    f"rows of {record.shape[1]} are not a multiple of {grid.block_weights}: {tensor_type.upper()}, "
                    + (grid.fallback_note or "llama.cpp's fallback for " + type_name.upper())
                )
            exact_types = (*GGUF_EXACT_TYPES, *GGUF_FP4_TYPES)
            problem = record_problem(record, tensor_type) if tensor_type in exact_types else f"type {type_name} is a float type"
            if problem is None:
                plan.tensors.append(TensorPlan(hf_name, gguf_name, tensor_type, "record", heads, shape, record=module))
                continue
            if type_name in GGUF_FLOAT_TYPES:
                plan.tensors.append(TensorPlan(hf_name, gguf_name, type_name, "dequantized", heads, shape, record=module))
                continue
            if fallback is None:
                raise FormatError(
                    f"{module} ({record.scheme.describe()}) cannot become {type_name.upper()} exactly: {problem}. "
                    "Quantize it to a scheme that maps, or declare `fallback:` on the export (f16, bf16, f32 or q8_0)"
                )
            exact_fallback = fallback in GGUF_EXACT_TYPES and record_problem(record, fallback) is None
            plan.fallbacks[module] = problem
            plan.tensors.append(
                TensorPlan(hf_name, gguf_name, fallback, "record" if exact_fallback else "fallback", heads, shape, record=module)
            )
        elif tensor.dim() == 1:
            offset = norm_offset if hf_name.endswith("norm.weight") else 0.0
            plan.tensors.append(TensorPlan(hf_name, gguf_name, "f32", "float", heads, shape, offset))
        else:
            usable = matrix_default
            if usable in GRIDS:  # a block type: its fallback where a K-quant does not divide the row, F16 where none does
                grid = GRIDS[usable].for_width(tensor.shape[-1])
                usable = grid.name if tensor.shape[-1] % grid.block_weights == 0 else "f16"
            plan.tensors.append(TensorPlan(hf_name, gguf_name, usable, "float", heads, shape))
    return plan


def permute_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's half-split rotary rows -> llama.cpp's interleaved rows, per head (rows only)."""
    rows = t.shape[0]
    order = torch.arange(rows).reshape(heads, 2, rows // heads // 2).transpose(1, 2).reshape(-1)
    return t[order]


def permuted_record(record: QuantizedWeight, heads: int | None) -> QuantizedWeight:
    if heads is None:
        return record
    return record.map_rows(lambda t: permute_rows(t, heads))


ALIGNMENT = 32  # GGUF pads every tensor's data to this many bytes (gguf-py's default)


def tensor_bytes(type_name: str, shape: tuple[int, ...]) -> int:
    """Bytes of one tensor of ``shape`` stored as ``type_name`` in a GGUF file, with its padding."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[ggml_type(type_name)]
    n = math.prod(shape)
    return -(-(n // block * size) // ALIGNMENT) * ALIGNMENT
