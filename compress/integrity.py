"""Load-time integrity of a model source (ARCHITECTURE.md rule 15): the model on disk, or an error.

Small pure checks that every loader calls, so a model is never run with a weight it does not have:

* ``check_config_values``: every number in a model config is finite, and its sizes (hidden_size,
  vocab_size, num_hidden_layers, the head counts …) are whole numbers above 0;
* ``check_block_count``: the config's num_hidden_layers is not more than the numbered blocks the
  weights hold (before a model is built from the config: a config asking for 10⁹ blocks is refused
  at once), and no stored block lies beyond it;
* ``check_stored``: every tensor the model built from the config needs is stored (a tied output head
  only where the config ties it), with the shape the config implies and a dtype of its kind;
  ``refuse_missing`` says which one is not, and what config key is likely wrong;
* ``check_finite`` / ``check_all_finite``: no NaN or infinity in a floating-point tensor, checked as
  the tensor is first read (a streamed model: one block at a time, never a second pass).

``from_pretrained_checked`` is transformers' whole load with these checks, for the paths that need one.

The callers: compress/models.py (Hugging Face folders, GGUF copies, quantized checkpoints, whole
loads through transformers), compress/streaming.py (finiteness as tensors are read),
compress/hf_model.py (an artifact's model, rebuilt for ``compress gate``) and export/gguf/inputs.py
(a GGUF file's own tensor table). Every refusal is a ModelLoadError naming the file and the tensor or key.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compress.errors import ModelLoadError

SIZE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
"""Config sizes that must be whole numbers above 0 where present (at the top and in ``text_config``)."""
HEAD_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim")
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
"""safetensors dtypes a floating-point weight may be stored in (other dtypes need a quantized checkpoint's importer)."""
INT_DTYPES = frozenset({"I64", "I32", "I16", "I8", "U8", "BOOL"})
_BLOCK = re.compile(r"^(.*?)\.(\d+)\.")
_FIX = "repair or replace the model files (a complete download, or the config.json that came with these weights)"


@dataclass(frozen=True)
class Stored:
    """A tensor as a weights file's header describes it."""

    file: Path | str
    shape: tuple[int, ...]
    dtype: str  # the safetensors dtype name: F32, BF16, I32 …


def non_finite(node: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """(key path, value) of every NaN or infinite number in a JSON-like value."""
    if isinstance(node, float) and not math.isfinite(node):
        yield prefix or "(the value)", node
    elif isinstance(node, Mapping):
        for key, value in node.items():
            yield from non_finite(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from non_finite(value, f"{prefix}[{i}]")


def check_config_values(config: Mapping[str, Any], path: Path) -> None:
    """Refuse a config with a non-finite number anywhere, or a size that is not a whole number above 0."""
    for key, value in non_finite(config):
        raise ModelLoadError(f"{path}: {key} is {value}; every number in a model config must be finite ({_FIX})")
    scopes = [("", config)] + ([("text_config.", config["text_config"])] if isinstance(config.get("text_config"), Mapping) else [])
    for scope, sizes in scopes:
        for key in SIZE_KEYS:
            value = sizes.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ModelLoadError(f"{path}: {scope}{key} is {value!r}; it must be a whole number above 0 ({_FIX})")


def block_indices(names: Iterable[str]) -> dict[str, set[int]]:
    """Numbered groups of tensor names: prefix (``model.layers``) -> the block numbers stored under it."""
    groups: dict[str, set[int]] = {}
    for name in names:
        found = _BLOCK.match(name)
        if found:
            groups.setdefault(found.group(1), set()).add(int(found.group(2)))
    return groups


def check_block_count(layers: int, stored: Mapping[str, Stored], config_path: Path | str, blocks: str | None = None) -> None:
    """The config's ``num_hidden_layers`` against the blocks the weights hold: not more than any
    numbered group holds (``blocks`` None: before a model is built), and, with the model's block list
    ``blocks`` known, no stored block at or beyond it."""
    groups = block_indices(stored)
    if blocks is None:
        most = max((len(found) for found in groups.values()), default=0)
        if layers > most and groups:
            prefix = max(groups, key=lambda p: len(groups[p]))
            raise ModelLoadError(
                f"{config_path}: num_hidden_layers is {layers:,}, but the weights ({_files(stored)}) hold {most} blocks "
                f"({prefix}.0 … {prefix}.{max(groups[prefix])}); a model is never run with blocks it does not have: {_FIX}"
            )
        return
    beyond = sorted(i for i in groups.get(blocks, ()) if i >= layers)
    if beyond:
        name = next(k for k in sorted(stored) if k.startswith(f"{blocks}.{beyond[0]}."))
        raise ModelLoadError(
            f"{config_path}: num_hidden_layers is {layers}, but {stored[name].file} holds block {beyond[0]} ({name}): "
            f"the weights have {layers + len(beyond)} or more blocks; {_FIX}"
        )


def missing(needed: Iterable[str], stored: Mapping[str, Any]) -> list[str]:
    """The needed tensor names the weights do not hold, in the model's order."""
    return [name for name in needed if name not in stored]


def refuse_missing(absent: list[str], where: str, config_path: Path | str) -> None:
    """Raise for tensors the model needs and the weights (``where``: their files) lack."""
    if not absent:
        return
    more = f" (and {len(absent) - 1} more: {', '.join(absent[1:4])}{' …' if len(absent) > 4 else ''})" if len(absent) > 1 else ""
    tied = (
        "; if the output head shares the token embedding, config.json must say tie_word_embeddings: true" if "lm_head" in absent[0] else ""
    )
    raise ModelLoadError(
        f"{where}: tensor {absent[0]} is missing{more}; the model {config_path} describes needs it, "
        f"and nothing is ever initialised at random{tied}; {_FIX}"
    )


def check_stored(
    needed: Mapping[str, tuple[tuple[int, ...], bool]], stored: Mapping[str, Stored], config: Mapping[str, Any], config_path: Path | str
) -> None:
    """Every needed tensor (name -> (shape, floating point)) as stored: the same shape, and a dtype of its
    kind (a floating-point weight stored as F32/F16/BF16/F64). Names not stored are ``missing``'s business."""
    for name, (shape, floating) in needed.items():
        entry = stored.get(name)
        if entry is None:
            continue
        if tuple(entry.shape) != tuple(shape):
            raise ModelLoadError(
                f"{entry.file}: tensor {name} is stored as {list(entry.shape)}, but {config_path} implies {list(shape)}: "
                f"the config disagrees with the weights (check {', '.join(suspects(name, shape, entry.shape, config))}); {_FIX}"
            )
        allowed = FLOAT_DTYPES if floating else INT_DTYPES
        if entry.dtype not in allowed:
            kind = "floating-point" if floating else "integer"
            raise ModelLoadError(
                f"{entry.file}: tensor {name} is stored as {entry.dtype}, not a {kind} dtype ({', '.join(sorted(allowed))}): "
                f"the header's dtype does not describe a {kind} weight (a damaged or mislabelled file); {_FIX}"
            )


def suspects(name: str, expected: tuple[int, ...], found: tuple[int, ...], config: Mapping[str, Any]) -> list[str]:
    """The config keys most likely behind a shape mismatch: those whose value is an expected size that
    differs from the stored one, else the head counts for an attention tensor, else every size key."""
    sizes = {key: config.get(key) for key in SIZE_KEYS if isinstance(config.get(key), int)}
    differing = {e for e, f in zip(expected, found, strict=False) if e != f} if len(expected) == len(found) else set(expected)
    named = [f"{key} ({value})" for key, value in sizes.items() if value in differing]
    if named:
        return named
    if "attn" in name or "attention" in name:
        return [f"{key} ({sizes[key]})" for key in HEAD_KEYS if key in sizes] or ["num_attention_heads"]
    return [f"{key} ({value})" for key, value in sizes.items()] or ["the config's sizes"]


def stored_entries(headers: Mapping[Path, Mapping[str, Any]]) -> dict[str, Stored]:
    """Tensor name -> Stored from safetensors headers (file -> header, as compress.inputs.check_safetensors returns)."""
    return {
        key: Stored(file, tuple(entry["shape"]), entry["dtype"])
        for file, header in headers.items()
        for key, entry in header.items()
        if key != "__metadata__"
    }


_STORED_NAMES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
                 "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}  # fmt: skip


def in_memory(tensors: Mapping[str, Any], where: Path | str) -> dict[str, Stored]:
    """Tensor name -> Stored for tensors already read (``where`` names their source)."""
    return {
        name: Stored(where, tuple(t.shape), _STORED_NAMES.get(str(t.dtype).removeprefix("torch."), str(t.dtype)))
        for name, t in tensors.items()
    }


def _files(stored: Mapping[str, Stored]) -> str:
    files = sorted({str(s.file) for s in stored.values()})
    return files[0] if len(files) == 1 else f"{len(files)} files in {Path(files[0]).parent}"


def check_finite(tensor: Any, name: str, where: Path | str) -> None:
    """Refuse a floating-point tensor holding NaN or infinity. One read of the tensor (a float sum, which
    a single non-finite value makes non-finite); only when the sum is not finite are the values counted,
    so a sum that merely overflows is not refused."""
    import torch

    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    total = tensor.sum(dtype=torch.float64 if tensor.dtype == torch.float64 else torch.float32)
    if bool(torch.isfinite(total)):
        return
    bad = int((~torch.isfinite(tensor)).sum())
    if bad:
        kinds = "NaN" if bool(torch.isnan(tensor).any()) else "infinite"
        raise ModelLoadError(
            f"{where}: tensor {name} holds {bad:,} {kinds} value(s) of {tensor.numel():,}; a model with non-finite weights "
            f"computes NaN, so it is refused ({_FIX})"
        )


def check_all_finite(tensors: Iterable[tuple[str, Any]], where: Path | str) -> None:
    """``check_finite`` for every (name, tensor) pair of a model held in memory."""
    for name, tensor in tensors:
        check_finite(tensor, name, where)


def from_pretrained_checked(path: Path, where: Path | str | None = None, **kwargs: Any) -> Any:
    """transformers' ``AutoModelForCausalLM.from_pretrained(path, **kwargs)`` (a whole load, for a checkpoint
    whose tensor names transformers converts, a GGUF file, a folder ``compress gate`` times), refusing
    what transformers would initialise at random and any non-finite weight; ``where`` names the source
    in messages (default: ``path``)."""
    from transformers import AutoModelForCausalLM

    where = where or path
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kwargs)
    refuse_missing(sorted(info.get("missing_keys") or ()), str(where), Path(path) / "config.json" if where == path else Path(where))
    check_all_finite(model.state_dict().items(), where)
    return model
