"""Checks of a GGUF file given as input (a model source, or a file handed to ``compress gate``): the
header, metadata and tensor table as the gguf package reads them, then the tensor table against the
architecture the metadata names (``check_tensor_table``: count, names, block numbers, shapes, types)
and every metadata number finite (compress.integrity: a model is the model on disk or an error)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compress.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"  # a GGUF file's first four bytes
EMBEDDING = "token_embd.weight"
OUTPUT = "output.weight"
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
UNIFORM_BLOCKS = frozenset(
    {"llama", "mistral", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "phi3", "gemma", "gemma2", "gemma3", "starcoder2"}
)
"""Architectures whose blocks all hold the same tensors: there, a tensor that some block lacks is missing."""
_FIX = "the file is incomplete or was written wrong: fetch or convert it again"


@dataclass(frozen=True)
class TableEntry:
    name: str
    ne: tuple[int, ...]  # GGUF's dimension order: ne[0] is the row length
    type_name: str
    block_elements: int  # elements per block of its type (1 for float types)


def is_gguf_file(path: Path | None) -> bool:
    """Whether ``path`` is a GGUF file (by its magic bytes)."""
    if path is None or not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def check_gguf(path: Path) -> None:
    """The GGUF header, metadata and tensor table, read by the gguf package (memory-mapped), and
    checked against the architecture (``check_tensor_table``)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (starts with {magic!r}, not {GGUF_MAGIC!r})")
    from gguf import GGML_QUANT_SIZES, GGUFReader, Keys

    try:
        reader = GGUFReader(path)
        metadata = {key: _scalar(field) for key, field in reader.fields.items() if not key.startswith("tokenizer.ggml.")}
        vocab = len(reader.fields[Keys.Tokenizer.LIST].data) if Keys.Tokenizer.LIST in reader.fields else None
        table = [
            TableEntry(t.name, tuple(int(d) for d in t.shape), t.tensor_type.name, GGML_QUANT_SIZES[t.tensor_type][0])
            for t in reader.tensors
        ]
    except Exception as exc:  # the reader raises ValueError, struct.error, IndexError … for a damaged file
        raise ModelLoadError(f"{path}: damaged or truncated GGUF file ({type(exc).__name__}: {exc})") from None
    from compress.integrity import non_finite

    for key, value in non_finite(metadata):
        raise ModelLoadError(f"{path}: metadata {key} is {value}; every number in a model's metadata must be finite ({_FIX})")
    check_tensor_table(path, metadata, vocab, table)


def _scalar(field: Any) -> Any:
    """A metadata field's value when it is one number or string; None for arrays (not checked here)."""
    if len(field.types) != 1:
        return None
    try:
        return field.contents()
    except Exception:  # a value the reader cannot decode: the tensor table decides
        return None


def check_tensor_table(path: Path, metadata: Mapping[str, Any], vocab: int | None, table: Sequence[TableEntry]) -> None:
    """A GGUF file's tensors against its architecture: at least one; the token embedding; blocks
    numbered 0 … ``{arch}.block_count`` - 1, each holding what the others hold (``UNIFORM_BLOCKS``);
    no zero-sized dimension; rows a whole number of their type's blocks; the embedding (and output
    head) as wide as ``{arch}.embedding_length`` and as long as the vocabulary."""
    from gguf import Keys

    arch = metadata.get(Keys.General.ARCHITECTURE)
    if not table:
        raise ModelLoadError(f"{path}: holds no tensors (its header says 0): a model without weights cannot be run; {_FIX}")
    names = {t.name: t for t in table}
    if EMBEDDING not in names:
        raise ModelLoadError(f"{path}: tensor {EMBEDDING} is missing (the token embedding every {arch or 'GGUF'} model needs); {_FIX}")
    for t in table:
        if any(d == 0 for d in t.ne):
            raise ModelLoadError(f"{path}: tensor {t.name} has a zero-sized dimension ({list(t.ne)}); {_FIX}")
        if t.ne and t.ne[0] % t.block_elements:
            raise ModelLoadError(
                f"{path}: tensor {t.name}: rows of {t.ne[0]} are not whole {t.type_name} blocks of {t.block_elements}; {_FIX}"
            )
    blocks: dict[int, set[str]] = {}
    for name in names:
        found = _BLOCK.match(name)
        if found:
            blocks.setdefault(int(found.group(1)), set()).add(found.group(2))
    count = metadata.get(Keys.LLM.BLOCK_COUNT.format(arch=arch))
    if isinstance(count, int):
        absent = sorted(set(range(count)) - set(blocks))
        beyond = sorted(set(blocks) - set(range(count)))
        if absent or beyond:
            which = f"no tensors of block {absent[0]} (blk.{absent[0]}.*)" if absent else f"block {beyond[0]} (blk.{beyond[0]}.*)"
            raise ModelLoadError(f"{path}: metadata {arch}.block_count is {count}, but the file holds {which}; {_FIX}")
    if arch in UNIFORM_BLOCKS:
        every = set().union(*blocks.values()) if blocks else set()
        for number in sorted(blocks):
            lacking = sorted(every - blocks[number])
            if lacking:
                raise ModelLoadError(f"{path}: tensor blk.{number}.{lacking[0]} is missing (the other blocks hold it); {_FIX}")
    width = metadata.get(Keys.LLM.EMBEDDING_LENGTH.format(arch=arch))
    for name in (EMBEDDING, OUTPUT):
        t = names.get(name)
        if t is None or len(t.ne) != 2:
            continue
        if isinstance(width, int) and t.ne[0] != width:
            raise ModelLoadError(f"{path}: tensor {name} rows are {t.ne[0]} wide, but {arch}.embedding_length is {width}; {_FIX}")
        if vocab is not None and t.ne[1] != vocab:
            raise ModelLoadError(
                f"{path}: tensor {name} has {t.ne[1]} rows, but the vocabulary (tokenizer.ggml.tokens) has {vocab}; {_FIX}"
            )
