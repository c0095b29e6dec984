"""llama.cpp, through the llama-cpp-python binding (extra ``gguf``): its own quantizer (K-quants
and the rest, made from our F16 file) and the runtime the GGUF verifier scores exports on.

Imported lazily: the binding is an optional, compiled dependency.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compress.errors import FormatError
from compress.eval.metrics import RowLogits
from compress.export.specs import GGUF_LLAMA_CPP_TYPES

INSTALL_HINT = "pip install 'compress[gguf]' (llama-cpp-python builds from source: about 17 minutes on 2 cores the first time)"


def llama_cpp() -> Any:
    try:
        import llama_cpp as module
    except ImportError as exc:
        raise FormatError(f"llama.cpp (llama-cpp-python) is not installed: {INSTALL_HINT}") from exc
    return module


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """llama.cpp logs to fd 2 from C; hide it unless COMPRESS_LLAMA_LOG is set."""
    if os.environ.get("COMPRESS_LLAMA_LOG"):
        yield
        return
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def ggml_type_id(name: str) -> int:
    import gguf

    return int(gguf.GGMLQuantizationType[name.upper()])


def quantize(
    source: Path,
    target: Path,
    type_name: str,
    threads: int,
    token_embedding_type: str | None = None,
    output_type: str | None = None,
    pure: bool = False,
) -> None:
    """llama.cpp's own quantizer: ``source`` (our F16/F32 GGUF) -> ``target`` in ``type_name``. ``pure``:
    every tensor in the one block type ``type_name`` (llama-quantize --pure; q2_k … q6_k as single types,
    not mixes), the token embedding in ``token_embedding_type``."""
    import gguf

    from compress.export.gguf.file import FILE_TYPES

    lib = llama_cpp()
    offered = tuple(FILE_TYPES) if pure else GGUF_LLAMA_CPP_TYPES
    if type_name not in offered:
        raise FormatError(f"llama.cpp type '{type_name}' is not offered{' pure' if pure else ''}; known: {', '.join(offered)}")
    params = lib.llama_model_quantize_default_params()
    params.ftype = int(gguf.LlamaFileType[FILE_TYPES[type_name] if pure else f"MOSTLY_{type_name.upper()}"])
    params.pure = pure
    params.nthread = threads
    if token_embedding_type is not None:
        params.token_embedding_type = ggml_type_id(token_embedding_type)
    if output_type is not None:
        params.output_tensor_type = ggml_type_id(output_type)
    with _quiet_stderr():
        rc = lib.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if rc != 0 or not target.is_file():
        raise FormatError(f"llama.cpp's quantizer failed ({rc}) making {type_name} from {source}")


@contextlib.contextmanager
def _model_params(use_extra_bufts: bool) -> Iterator[None]:
    """``Llama()`` takes its model parameters from ``llama_model_default_params()`` and has no
    argument for ``use_extra_bufts``; set it there while the model loads."""
    import llama_cpp.llama_cpp as capi

    original = capi.llama_model_default_params

    def patched() -> Any:
        params = original()
        params.use_extra_bufts = use_extra_bufts
        return params

    capi.llama_model_default_params = patched
    try:
        yield
    finally:
        capi.llama_model_default_params = original


def extra_buffer_types() -> bool:
    """Whether llama.cpp may use its extra CPU buffer types (weight repacking, the AMX kernels).
    Off unless COMPRESS_LLAMA_EXTRA_BUFTS=1: a native build on a CPU that reports AMX crashes in
    ggml_backend_amx_mul_mat on quantized weights when the kernel does not grant AMX tile state
    (seen on this project's CI-like VMs); without them llama.cpp runs its portable SIMD kernels."""
    return os.environ.get("COMPRESS_LLAMA_EXTRA_BUFTS", "") == "1"


class LlamaCppVocab:
    """A GGUF file's tokenizer alone in llama.cpp (``vocab_only``: no weights are read): the
    tokenization a user of that file gets, special tokens in the text parsed as such."""

    def __init__(self, path: Path) -> None:
        lib = llama_cpp()
        with _quiet_stderr():
            try:
                self.llm = lib.Llama(model_path=str(path), vocab_only=True, verbose=False)
            except (ValueError, RuntimeError) as exc:
                raise FormatError(f"llama.cpp could not read the tokenizer of {path}: {exc}") from exc

    def tokenize(self, text: str) -> list[int]:
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True))

    def token_text(self, ids: list[int]) -> list[str]:
        return [self.llm.detokenize([i], special=True).decode("utf-8", errors="backslashreplace") for i in ids]

    def close(self) -> None:
        self.llm.close()


class LlamaCppModel:
    """A GGUF file loaded in llama.cpp, with a ``Forward`` for the metrics and a tokenizer."""

    def __init__(self, path: Path, n_ctx: int, threads: int, cache_type: str | None = None) -> None:
        """``cache_type`` (``f16``, ``q8_0``, ``q4_0``, ...): store the KV cache in that llama.cpp type
        (keys and values), with flash attention, which llama.cpp needs for a quantized V cache.
        None: llama.cpp's defaults (f16 cache, flash attention off)."""
        lib = llama_cpp()
        self.path = path
        cache: dict[str, Any] = {}
        if cache_type is not None:
            ggml_type = getattr(lib, f"GGML_TYPE_{cache_type.upper()}", None)
            if ggml_type is None:
                raise FormatError(f"llama.cpp has no cache type '{cache_type}'")
            cache = {"type_k": int(ggml_type), "type_v": int(ggml_type), "flash_attn": True}
        # llama.cpp makes a context of at least 256 tokens, and llama-cpp-python sizes its logits
        # buffer by the n_ctx asked for; asking for 256 or more keeps the two in agreement.
        n_ctx = max(n_ctx, 256)
        with _quiet_stderr(), _model_params(extra_buffer_types()):
            try:
                self.llm = lib.Llama(
                    model_path=str(path),
                    n_ctx=n_ctx,
                    n_batch=n_ctx,
                    n_ubatch=n_ctx,
                    logits_all=True,
                    n_threads=threads,
                    n_threads_batch=threads,
                    verbose=False,
                    **cache,
                )
            except (ValueError, RuntimeError) as exc:
                raise FormatError(f"llama.cpp could not load {path}: {exc}") from exc
        self.n_ctx = n_ctx
        self.last_decode_seconds = 0.0

    def scores(self, ids: list[int]) -> np.ndarray:
        """Logits [len(ids), vocab] for one sequence, from an empty cache: a view of llama-cpp-python's
        own scores buffer, valid until the next evaluation (a row is n_vocab x 4 bytes a token)."""
        if len(ids) > self.n_ctx:
            raise FormatError(f"a sequence of {len(ids)} tokens exceeds the llama.cpp context of {self.n_ctx}")
        self.llm.reset()
        with _quiet_stderr():
            self.llm.eval(ids)
        return self.llm.scores[: len(ids)]

    def forward(self, ids: torch.Tensor) -> RowLogits:
        """``Forward``: token ids [batch, seq] -> logits made a row at a time, read from llama.cpp's
        buffer without copying (a 152k vocabulary makes a 512-token row 311 MB)."""
        return RowLogits(lambda row: torch.from_numpy(self.scores(ids[row].tolist())))

    def tokenize(self, text: str) -> list[int]:
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True))  # HF parses added tokens in text too

    def greedy(self, ids: list[int], max_tokens: int, stop_at_eos: bool = True) -> list[int]:
        """Greedy decoding after ``ids``, one token per llama.cpp call, within the context.
        ``last_decode_seconds`` is the time of the one-token steps (the prompt excluded)."""
        max_tokens = min(max_tokens, self.n_ctx - len(ids))
        if max_tokens < 1:
            raise FormatError(f"a prompt of {len(ids)} tokens leaves no room in the llama.cpp context of {self.n_ctx}")
        self.llm.reset()
        with _quiet_stderr():
            self.llm.eval(ids)
            out: list[int] = []
            started = time.perf_counter()
            for _ in range(max_tokens):
                nxt = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
                if stop_at_eos and nxt == self.llm.token_eos():
                    break
                out.append(nxt)
                self.llm.eval([nxt])
            self.last_decode_seconds = time.perf_counter() - started
        return out

    def generate(self, prompt: str, max_tokens: int = 48) -> str:
        """Greedy continuation of ``prompt`` (BOS added when the file says so), as text."""
        ids = list(self.llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=False))
        return self.llm.detokenize(self.greedy(ids, max_tokens)).decode("utf-8", errors="replace")

    def close(self) -> None:
        self.llm.close()
