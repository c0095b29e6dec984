"""Running an exported decoder: an ONNX Runtime session that scores whole sequences (empty past),
and ONNX Runtime GenAI for tokenization and generation. Imported lazily (the onnx extra)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compress.export.onnx.names import GENAI_CONFIG

_NUMPY = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
}  # a quantized KV cache's past tensors are int8 / uint8 / fp8


def _numpy_dtype(onnx_type: str) -> Any:
    if onnx_type == "tensor(float8e4m3fn)":
        import ml_dtypes

        return ml_dtypes.float8_e4m3fn
    if onnx_type not in _NUMPY:
        raise RuntimeError(f"an input of type {onnx_type}: the scorer feeds float, integer and fp8 tensors only")
    return _NUMPY[onnx_type]


class OrtDecoder:
    """A builder-made decoder in an ONNX Runtime session (CPU, or CUDA for a CUDA build):
    ``forward(ids [b, seq]) → logits [b, seq, vocab]`` with an empty past."""

    def __init__(self, path: Path, threads: int, device: str = "cpu") -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(str(path), options, providers=providers)
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        decoder = genai_config(path.parent)["model"]["decoder"]  # the cache's last dim may be symbolic in the graph
        self.kv_heads, self.head_size = int(decoder["num_key_value_heads"]), int(decoder["head_size"])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        batch, seq = ids.shape
        feeds: dict[str, np.ndarray] = {}
        for name, meta in self.inputs.items():
            dtype = _numpy_dtype(meta.type)
            if name == "input_ids":
                feeds[name] = ids.numpy().astype(dtype)
            elif name == "attention_mask":
                feeds[name] = np.ones((batch, seq), dtype=dtype)
            elif name == "position_ids":
                feeds[name] = np.broadcast_to(np.arange(seq, dtype=dtype), (batch, seq)).copy()
            elif name.startswith("past_key_values."):
                feeds[name] = np.zeros((batch, self.kv_heads, 0, self.head_size), dtype=dtype)
            else:
                raise RuntimeError(f"{name}: an input this scorer does not know how to feed")
        logits = self.session.run(["logits"], feeds)[0]
        return torch.from_numpy(np.asarray(logits, dtype=np.float32))


class GenAIModel:
    """The export in ONNX Runtime GenAI (its tokenizer, its generator), on ``threads`` CPU threads."""

    def __init__(self, directory: Path, threads: int) -> None:
        import onnxruntime_genai as og

        config = og.Config(str(directory))
        config.overlay(
            json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads, "inter_op_num_threads": 1}}}})
        )
        self._og = og
        self.model = og.Model(config)
        self.tokenizer = og.Tokenizer(self.model)

    def close(self) -> None:
        """Free the tokenizer before the model it belongs to (GenAI objects must not outlive their model)."""
        self.__dict__.pop("tokenizer", None)
        self.__dict__.pop("model", None)

    def __enter__(self) -> GenAIModel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text)]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(np.asarray(ids, dtype=np.int32))

    def greedy(self, ids: list[int], new_tokens: int) -> tuple[list[int], dict[str, float]]:
        """Greedy continuation of ``ids``; returns the new tokens and timings (prefill seconds, decode
        tokens/s over the tokens after the first)."""
        params = self._og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(ids) + new_tokens, do_sample=False)
        generator = self._og.Generator(self.model, params)
        start = time.perf_counter()
        generator.append_tokens(np.asarray(ids, dtype=np.int32))
        generator.generate_next_token()
        first = time.perf_counter()
        out = [int(generator.get_next_tokens()[0])]
        while not generator.is_done() and len(out) < new_tokens:
            generator.generate_next_token()
            out.append(int(generator.get_next_tokens()[0]))
        end = time.perf_counter()
        del generator, params  # before the model they were made from
        decode_s = end - first
        return out, {
            "time_to_first_token_s": first - start,
            "decode_tokens": len(out) - 1,
            "decode_tokens_per_s": (len(out) - 1) / decode_s if decode_s > 0 and len(out) > 1 else 0.0,
        }


def genai_config(directory: Path) -> dict[str, Any]:
    return json.loads((directory / GENAI_CONFIG).read_text())
