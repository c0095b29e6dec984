"""llama.cpp's own command-line tools (llama-quantize, llama-imatrix, llama-perplexity), built by
``scripts/build_llama_tools.py`` from the llama.cpp sources that the installed llama-cpp-python
vendors, so that they are the same llama.cpp as the one our verifier runs. Nothing here builds them."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
from pathlib import Path

from compress.errors import CompressError

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


def require_tool(name: str) -> Path:
    """The built tool ``name``, or a CompressError saying how to build it."""
    path = llama_tool(name)
    if path is None:
        raise CompressError(
            f"llama.cpp's {name} is not built for this llama-cpp-python: run python scripts/build_llama_tools.py (about 45 minutes on 2 cores)"
        )
    return path


def llama_imatrix(f16: Path, text: Path, out: Path, seq_len: int, chunks: int, threads: int) -> list[str]:
    """llama.cpp's importance matrix of ``f16`` over ``text`` (``chunks`` of ``seq_len`` tokens, as
    llama-imatrix tokenizes it) written to ``out``; returns the command that ran."""
    # --no-repack: this machine's CPU reports AMX without granting it, and llama.cpp's AMX path then crashes (docs/exports/gguf.md)
    command = [str(require_tool("llama-imatrix")), "-m", str(f16), "-f", str(text), "-o", str(out)]
    command += ["-c", str(seq_len), "--chunks", str(chunks), "-t", str(threads), "--no-ppl", "--no-repack"]
    subprocess.run(command, check=True, capture_output=True)
    return command


def llama_quantize(
    f16: Path, out: Path, type_name: str, threads: int, embedding_type: str | None, imatrix: Path | None = None
) -> list[str]:
    """llama-quantize ``f16`` to ``type_name`` (a mix such as q4_k_m, or one type), with the token
    embedding in ``embedding_type`` and, when given, an importance matrix; returns the command."""
    command = [str(require_tool("llama-quantize"))] + (["--token-embedding-type", embedding_type] if embedding_type else [])
    if imatrix is not None:
        command += ["--imatrix", str(imatrix)]
    command += [str(f16), str(out), type_name.upper(), str(threads)]
    subprocess.run(command, check=True, capture_output=True)
    return command
