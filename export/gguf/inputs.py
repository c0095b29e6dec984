"""Checks of a GGUF file given as input (a model source, or a file handed to ``compress gate``)."""

from __future__ import annotations

from pathlib import Path

from compress.errors import ModelLoadError
from compress.export.gguf.names import GGUF_MAGIC


def check_gguf(path: Path) -> None:
    """The GGUF header, metadata and tensor table, read by the gguf package (memory-mapped)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (starts with {magic!r}, not {GGUF_MAGIC!r})")
    from gguf import GGUFReader

    try:
        GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, struct.error, IndexError … for a damaged file
        raise ModelLoadError(f"{path}: damaged or truncated GGUF file ({type(exc).__name__}: {exc})") from None
