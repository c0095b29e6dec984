"""llama.cpp's own command-line tools (llama-quantize, llama-imatrix, llama-perplexity), built by
``scripts/build_llama_tools.py`` from the llama.cpp sources that the installed llama-cpp-python
vendors, so that they are the same llama.cpp as the one our verifier runs. Nothing here builds them."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

TOOLS = ("llama-quantize", "llama-imatrix", "llama-perplexity")


def tools_dir(version: str | None = None) -> Path:
    """Where the tools of a llama-cpp-python version are kept (default: the installed one)."""
    version = version or importlib.metadata.version("llama-cpp-python")
    root = Path(os.environ.get("COMPRESS_CACHE", Path.home() / ".cache" / "compress"))
    return root / "llama.cpp-tools" / version


def llama_tool(name: str) -> Path | None:
    """The built tool ``name`` for the installed llama-cpp-python, None when it is not built."""
    try:
        path = tools_dir() / name
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None
