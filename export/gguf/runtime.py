"""llama.cpp, through the llama-cpp-python binding (extra ``gguf``): its own quantizer (K-quants
and the rest, made from our F16 file) and the runtime the GGUF verifier scores exports on.

Imported lazily: the binding is an optional, compiled dependency.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compress.errors import FormatError
from compress.eval.metrics import Logits
from compress.export.gguf.config import GGUF_LLAMA_CPP_TYPES

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


def library_build() -> dict[str, str]:
    """llama.cpp as the binding loads it: the llama library's version, the ggml library's (from its
    file name) and the CPU features and backends it was compiled with; empty when not installed."""
    if not available():
        return {}
    import llama_cpp.llama_cpp as capi

    lib = Path(capi.__file__).parent / "lib"
    ggml = sorted(p.name.split(".so.", 1)[1] for p in lib.glob("libggml-base.so.*.*"))
    return {
        "llama.cpp": capi.llama_version().decode(),
        "ggml": ggml[-1] if ggml else "unknown",
        "system_info": capi.llama_print_system_info().decode().strip().rstrip("|").strip(),
    }


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
    tensor_types: Mapping[str, str] | None = None,
) -> None:
    """llama.cpp's own quantizer: ``source`` (our F16/F32 GGUF) -> ``target`` in ``type_name``. ``pure``:
    every tensor in the one block type ``type_name`` (llama-quantize --pure; q2_k … q6_k as single types,
    not mixes), the token embedding in ``token_embedding_type``. ``tensor_types``: the type of each tensor
    so named (llama-quantize --tensor-type, one exact pattern per tensor), e.g. another file's whole mix;
    ``type_name`` is then the file's type, as a single type."""
    import gguf

    from compress.export.gguf.metadata import FILE_TYPES

    lib = llama_cpp()
    single = pure or tensor_types is not None
    offered = tuple(FILE_TYPES) if single else GGUF_LLAMA_CPP_TYPES
    if type_name not in offered:
        raise FormatError(f"llama.cpp type '{type_name}' is not offered{' pure' if pure else ''}; known: {', '.join(offered)}")
    params = lib.llama_model_quantize_default_params()
    params.ftype = int(gguf.LlamaFileType[FILE_TYPES[type_name] if single else f"MOSTLY_{type_name.upper()}"])
    params.pure = pure
    overrides = None
    if tensor_types is not None:  # an array ended by a null pattern; the patterns must outlive the call
        patterns = [(f"^{re.escape(name)}$".encode(), ggml_type_id(kind)) for name, kind in tensor_types.items()]
        overrides = (lib.llama_model_tensor_override * (len(patterns) + 1))(*patterns, (None, 0))
        params.tt_overrides = ctypes.cast(overrides, ctypes.POINTER(lib.llama_model_tensor_override))
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

    def special_ids(self) -> dict[str, int]:
        """The BOS, EOS and end-of-turn ids llama.cpp uses for this file (-1: none)."""
        return {"bos": int(self.llm.token_bos()), "eos": int(self.llm.token_eos()), "eot": int(self.llm._model.token_eot())}

    def close(self) -> None:
        self.llm.close()


PIECE_TOKENS = 128
"""Tokens llama.cpp decodes in one call when scoring (its batch and micro-batch). Its logits
buffers grow with the outputs of one call (tokens x vocab x 4 bytes, both its output buffer and
the graph's result: 78 MB each at 128 tokens and a 152k vocabulary), so a smaller piece keeps the
peak down at the same logits and about the same time a row (scripts/experiments/llama_pieces.py measures it)."""


class LlamaCppModel:
    """A GGUF file loaded in llama.cpp, with a ``Forward`` for the metrics and a tokenizer."""

    def __init__(self, path: Path, n_ctx: int, threads: int, cache_type: str | None = None, piece_tokens: int = PIECE_TOKENS) -> None:
        """``cache_type`` (``f16``, ``q8_0``, ``q4_0``, ...): store the KV cache in that llama.cpp type
        (keys and values), with flash attention, which llama.cpp needs for a quantized V cache.
        None: llama.cpp's defaults (f16 cache, flash attention off). ``piece_tokens``: tokens per
        llama.cpp call (its batch and micro-batch; the latency runner decodes a prompt in one)."""
        lib = llama_cpp()
        self.path = path
        self.piece = piece_tokens
        cache: dict[str, Any] = {}
        if cache_type is not None:
            ggml_type = getattr(lib, f"GGML_TYPE_{cache_type.upper()}", None)
            if ggml_type is None:
                raise FormatError(f"llama.cpp has no cache type '{cache_type}'")
            cache = {"type_k": int(ggml_type), "type_v": int(ggml_type), "flash_attn": True}
        n_ctx = max(n_ctx, 256)  # llama.cpp makes a context of at least 256 tokens
        with _quiet_stderr(), _model_params(extra_buffer_types()):
            try:
                # logits_all=False: llama-cpp-python would otherwise copy every position's logits
                # into an n_ctx x vocab array of its own; the scores are read from llama.cpp's buffer.
                self.llm = lib.Llama(
                    model_path=str(path),
                    n_ctx=n_ctx,
                    n_batch=piece_tokens,
                    n_ubatch=piece_tokens,
                    logits_all=False,
                    n_threads=threads,
                    n_threads_batch=threads,
                    verbose=False,
                    **cache,
                )
            except (ValueError, RuntimeError) as exc:
                raise FormatError(f"llama.cpp could not load {path}: {exc}") from exc
        self.n_ctx = n_ctx
        self.n_vocab = int(self.llm.n_vocab())
        self.last_decode_seconds = 0.0

    def decode(self, ids: list[int], n_past: int, every_position: bool) -> np.ndarray:
        """Decode ``ids`` (at most ``piece_tokens``) after the ``n_past`` tokens in the cache; returns
        the logits of every position [len(ids), vocab], or of the last one [1, vocab]: a view of
        llama.cpp's own output buffer, valid until the next call. (It drives llama-cpp-python's batch
        and context objects as its own ``Llama.eval`` does, less the copy into ``Llama.scores``.)"""
        if n_past + len(ids) > self.n_ctx:
            raise FormatError(f"a sequence of {n_past + len(ids)} tokens exceeds the llama.cpp context of {self.n_ctx}")
        if not ids:
            raise FormatError("llama.cpp was given no tokens to decode")
        llm = self.llm
        llm._ctx.kv_cache_seq_rm(-1, n_past, -1)  # the cache keeps the first n_past positions (none: empty)
        llm._batch.set_batch(batch=ids, n_past=n_past, logits_all=every_position)
        with _quiet_stderr():
            llm._ctx.decode(llm._batch)
        rows = len(ids) if every_position else 1
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(rows, self.n_vocab))

    def next_logits(self, ids: list[int], n_past: int = 0) -> np.ndarray:
        """Logits [vocab] after ``ids`` (decoded a piece at a time after ``n_past`` cached tokens)."""
        if not ids:
            raise FormatError("llama.cpp was given no tokens to decode")
        for start in range(0, len(ids), self.piece):
            last = self.decode(ids[start : start + self.piece], n_past + start, every_position=False)
        return last[0]

    def forward(self, ids: torch.Tensor) -> DecodedLogits:
        """``Forward``: token ids [batch, seq] -> logits decoded a row and ``piece_tokens`` positions at
        a time as the metrics ask for them, read from llama.cpp's buffer without copying."""
        return DecodedLogits(self, ids)

    def tokenize(self, text: str) -> list[int]:
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True))  # HF parses added tokens in text too

    def greedy(self, ids: list[int], max_tokens: int, stop_at_eos: bool = True) -> list[int]:
        """Greedy decoding after ``ids``, one token per llama.cpp call, within the context.
        ``last_decode_seconds`` is the time of the one-token steps (the prompt excluded)."""
        max_tokens = min(max_tokens, self.n_ctx - len(ids))
        if max_tokens < 1:
            raise FormatError(f"a prompt of {len(ids)} tokens leaves no room in the llama.cpp context of {self.n_ctx}")
        logits = self.next_logits(ids)
        out: list[int] = []
        started = time.perf_counter()
        for _ in range(max_tokens):
            nxt = int(np.argmax(logits))
            if stop_at_eos and nxt == self.llm.token_eos():
                break
            out.append(nxt)
            logits = self.next_logits([nxt], n_past=len(ids) + len(out) - 1)
        self.last_decode_seconds = time.perf_counter() - started
        return out

    def generate(self, prompt: str, max_tokens: int = 48) -> str:
        """Greedy continuation of ``prompt`` (BOS added when the file says so), as text."""
        ids = list(self.llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=False))
        return self.llm.detokenize(self.greedy(ids, max_tokens)).decode("utf-8", errors="replace")

    def close(self) -> None:
        self.llm.close()


class DecodedLogits(Logits):
    """A batch's logits from llama.cpp, decoded as the metrics ask for them: row by row, and within
    a row ``piece_tokens`` positions at a time (the cache keeps the earlier ones). Positions are
    asked in increasing order within a row; asking for an earlier one decodes the row again."""

    def __init__(self, model: LlamaCppModel, ids: torch.Tensor) -> None:
        self.model, self.ids = model, ids
        self.row: int | None = None
        self.first = self.done = 0  # the current piece's logits hold positions first .. done - 1
        self.piece: np.ndarray | None = None

    def _next_piece(self, row: int, wanted: int) -> None:
        """Decode the next piece of ``row``; its logits are kept only when it reaches position
        ``wanted`` (a piece wholly before it only fills the cache: llama.cpp then makes one row of
        logits instead of a vocabulary-wide row per position, e.g. for a task's long prompt)."""
        tokens = self.ids[row, self.done : self.done + self.model.piece].tolist()
        if not tokens:
            raise IndexError(f"position {self.done} is past the row's {self.ids.shape[1]} tokens")
        every = self.done + len(tokens) > wanted
        out = self.model.decode(tokens, self.done, every_position=every)
        self.piece = out if every else None
        self.first, self.done = self.done, self.done + len(tokens)

    def logits(self, row: int, positions: slice) -> torch.Tensor:
        start, stop = positions.start or 0, positions.stop
        if start >= stop:
            return torch.empty(0, self.model.n_vocab)
        if row != self.row or start < self.first:
            self.row, self.first, self.done, self.piece = row, 0, 0, None
        parts = []
        while start < stop:
            while start >= self.done:
                self._next_piece(row, start)
            assert self.piece is not None
            end = min(stop, self.done)
            part = self.piece[start - self.first : end - self.first]
            parts.append(part if end == stop else part.copy())  # the next piece overwrites the buffer
            start = end
        return torch.from_numpy(parts[0] if len(parts) == 1 else np.concatenate(parts))
