"""Decode speed of two GGUF files in llama.cpp, measured in turns (A, B, A, B, …) so that whatever else
the machine does in the meantime weighs on both alike: the median tokens/s of each and the median of
the per-round ratios A / B. For the issue's target "decode within 5% of llama.cpp's own file of the same
type mix": ``compress bench gguf --keep-files`` leaves ours and llama.cpp's file of our mix's tensor types
(``same-mix.*``) under OUT/files.

    python scripts/decode_pair.py OUT/files/gptq_mix_….mix.gguf OUT/files/same-mix.gptq_mix_….mix.gguf \
        [--rounds 15] [--tokens 64] [--threads 2]

Both files stay loaded; each round decodes ``--tokens`` greedy steps after the same 64-token prompt
(the prompt's own processing is not timed), as `compress bench gguf` does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compress.export.gguf.runtime import LlamaCppModel  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    models = [LlamaCppModel(p, n_ctx=64 + args.tokens + 8, threads=args.threads) for p in (args.a, args.b)]
    prompt = list(range(100, 164))
    for m in models:  # warm-up: pages in, repacked weights built
        m.greedy(prompt, 8, stop_at_eos=False)
    rates: list[list[float]] = [[], []]
    for _ in range(args.rounds):
        for i, m in enumerate(models):
            made = m.greedy(prompt, args.tokens, stop_at_eos=False)
            rates[i].append(len(made) / m.last_decode_seconds)
    for m in models:
        m.close()
    ratios = [a / b for a, b in zip(*rates, strict=True)]
    print(
        json.dumps(
            {
                "a": str(args.a),
                "b": str(args.b),
                "threads": args.threads,
                "rounds": args.rounds,
                "tokens": args.tokens,
                "a_tokens_per_s": round(statistics.median(rates[0]), 1),
                "b_tokens_per_s": round(statistics.median(rates[1]), 1),
                "ratio_median": round(statistics.median(ratios), 3),
                "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
