"""A TensorRT engine in the latency worker (eval/latency.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from compress.errors import CompressError
from compress.export.format import Runner


class TensorRTRunner(Runner):
    """An engine built by our TensorRT export (explicit ``past_key_values.*`` inputs and
    ``present.*`` outputs): the prompt with an empty past, then one token at a time."""

    def __init__(self, path: Path) -> None:
        import torch

        from compress.export.tensorrt.engine import EngineRunner

        plans = sorted(path.glob("*.plan")) if path.is_dir() else [path]
        if not plans:
            raise CompressError(f"latency: no TensorRT engine (*.plan) in {path}")
        self.torch, self.runner = torch, EngineRunner(plans[0])
        self.size_bytes = plans[0].stat().st_size
        self.weight_bytes = self.size_bytes  # an engine's weights are most of its file; stated as an approximation
        self.past = [n for n in self.runner.inputs if n.startswith("past_key_values.")]
        self.kv_bytes_per_position = sum(
            int(np.prod([d for i, d in enumerate(self.runner.engine.get_tensor_shape(n)) if i not in (0, 2)]))
            * self.runner.dtypes[n].itemsize
            for n in self.past
        )

    def _step(self, ids: Any, past: dict[str, Any], offset: int) -> tuple[Any, dict[str, Any]]:
        torch = self.torch
        batch, seq = ids.shape
        feeds = {
            "input_ids": ids,
            "attention_mask": torch.ones((batch, offset + seq), dtype=torch.int64),
            "position_ids": torch.arange(offset, offset + seq).repeat(batch, 1),
            **past,
        }
        out = self.runner(feeds)
        presents = {n: out[n.replace("past_key_values.", "present.")] for n in self.past}
        return out["logits"][:, -1].argmax(-1, keepdim=True).cpu(), presents

    def run(self, prompts: np.ndarray, steps: int) -> tuple[float, list[float]]:
        torch = self.torch
        batch, length = prompts.shape
        shape = {n: self.runner.engine.get_tensor_shape(n) for n in self.past}
        past = {n: torch.zeros((batch, shape[n][1], 0, shape[n][3]), dtype=self.runner.dtypes[n], device="cuda") for n in self.past}
        start = time.perf_counter()
        nxt, past = self._step(torch.from_numpy(prompts), past, 0)
        ttft = time.perf_counter() - start
        times = []
        for k in range(steps - 1):
            start = time.perf_counter()
            nxt, past = self._step(nxt, past, length + k)
            times.append(time.perf_counter() - start)
        return ttft, times
