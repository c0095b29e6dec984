"""What the load-time finiteness check costs on the reference model (SmolLM2-135M).

    python scripts/experiments/integrity_overhead.py

Opens `reference:smollm2-135m` (run `compress assets fetch` first) as a run does, then reads every
tensor once from the safetensors copy, as a run's first pass does block by block, with the check
(`compress.integrity.check_finite`, on each tensor's first read) and without it: the best of 3 of each,
interleaved, on one thread. Also the time of `load_model` itself (headers, config and block checks).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from compress import integrity, streaming
from compress.models import load_model
from compress.progress import Reporter
from compress.schema.recipe import ModelConfig


def _skip(*args: object) -> None:
    return None


def main() -> None:
    torch.set_num_threads(1)
    opened = []
    for _ in range(3):
        started = time.perf_counter()
        lm = load_model(ModelConfig(source="reference:smollm2-135m"), Path.cwd(), Reporter(quiet=True))
        opened.append(time.perf_counter() - started)
    print(f"load_model: {min(opened):.2f} s (best of 3)")
    store = streaming.store_of(lm.model)
    times: dict[str, list[float]] = {"with": [], "without": []}
    values = 0
    for _ in range(3):
        for mode in ("without", "with"):
            streaming.check_finite = integrity.check_finite if mode == "with" else _skip
            store.verified.clear()
            started = time.perf_counter()
            values = sum(t.numel() for _, t in streaming.tensors(lm.model))
            times[mode].append(time.perf_counter() - started)
    streaming.check_finite = integrity.check_finite
    with_check, without = min(times["with"]), min(times["without"])
    print(
        f"every tensor read once ({values / 1e6:.1f} M values): {without:.3f} s without the check, {with_check:.3f} s with it "
        f"(+{with_check - without:.3f} s, once per run: a tensor read again is not checked again)"
    )


if __name__ == "__main__":
    main()
