"""How the rows AWQ's clipping search takes at once change its speed, and that they change nothing else.

    python scripts/experiments/awq_clip_rows.py

For SmolLM2-135M's three weight shapes (gate/up 1536 x 576, down 576 x 1536, attention 576 x 576),
random weights and 512 random tokens, W3 g128 symmetric (the real-model AWQ test's scheme): the best of
3 timings of `search_clip` at 64, 256 and 1024 rows a step and at the default, and whether each gives
bit for bit the bounds of 64 rows. Threads: 2.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compress.quantizers.awq import search_clip  # noqa: E402
from compress.schema.quantize import QuantScheme  # noqa: E402


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    scheme = QuantScheme(bits=3, group_size=128, symmetric=True)
    for out_f, in_f in ((1536, 576), (576, 1536), (576, 576)):
        w, x = torch.randn(out_f, in_f), torch.randn(512, in_f)
        reference = search_clip(x, w, scheme, 20, 0.5, rows_per_step=64)
        for rows in (64, 256, 1024, None):
            times = []
            for _ in range(3):
                started = time.perf_counter()
                bound = search_clip(x, w, scheme, 20, 0.5, rows_per_step=rows)
                times.append(time.perf_counter() - started)
            label = "default" if rows is None else str(rows)
            print(
                f"{out_f} x {in_f}: rows {label:>7}: {min(times) * 1000:6.1f} ms, same bounds as 64 rows: {torch.equal(bound, reference)}"
            )


if __name__ == "__main__":
    main()
