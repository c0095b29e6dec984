"""GGUF on llama.cpp in the latency worker (eval/latency.py): the runner and what the file alone
says about bytes read per token and parameters."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from compress.export.format import Runner


class LlamaCppRunner(Runner):
    max_batch = 1
    batch_note = "llama-cpp-python's Llama object decodes one sequence; batch > 1 is not measured"

    def __init__(self, path: Path, threads: int, context: int) -> None:
        from compress.export.gguf.runtime import LlamaCppModel

        self.runtime = LlamaCppModel(path, n_ctx=context, threads=threads, piece_tokens=min(context, 512))  # a prompt in one call
        self.size_bytes = path.stat().st_size
        self.weight_bytes, self.kv_bytes_per_position = gguf_bytes(path)

    def run(self, prompts: np.ndarray, steps: int) -> tuple[float, list[float]]:
        runtime = self.runtime
        prompt = prompts[0].tolist()
        times = []
        start = time.perf_counter()
        nxt = int(np.argmax(runtime.next_logits(prompt)))
        ttft = time.perf_counter() - start
        for step in range(steps - 1):
            start = time.perf_counter()
            nxt = int(np.argmax(runtime.next_logits([nxt], n_past=len(prompt) + step)))
            times.append(time.perf_counter() - start)
        return ttft, times


def gguf_bytes(path: Path) -> tuple[int, int]:
    """Weights a decode step reads (the token embedding counts only when it is also the output
    matrix, i.e. no ``output.weight``), and f16 KV-cache bytes per position (llama.cpp's default)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    weights = sum(sizes.values()) - (sizes.get("token_embd.weight", 0) if "output.weight" in sizes else 0)
    arch = bytes(reader.fields[gguf.Keys.General.ARCHITECTURE].parts[-1]).decode()

    keys = gguf.Keys

    def name(key: str) -> str:
        return key.format(arch=arch)  # gguf-py's key templates ({arch}.…) for this file's architecture

    def field_int(key: str) -> int:
        f = reader.fields[name(key)]
        return int(f.parts[f.data[0]][0])

    heads = field_int(keys.Attention.HEAD_COUNT)
    layers, width = field_int(keys.LLM.BLOCK_COUNT), field_int(keys.LLM.EMBEDDING_LENGTH)
    kv_heads = field_int(keys.Attention.HEAD_COUNT_KV) if name(keys.Attention.HEAD_COUNT_KV) in reader.fields else heads
    head_dim = field_int(keys.Attention.KEY_LENGTH) if name(keys.Attention.KEY_LENGTH) in reader.fields else width // heads
    return weights, 2 * layers * kv_heads * head_dim * 2


def parameter_count(path: Path) -> int:
    """GGUF tensor elements."""
    import gguf

    return sum(int(t.n_elements) for t in gguf.GGUFReader(str(path)).tensors)
