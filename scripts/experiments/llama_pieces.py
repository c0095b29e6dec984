"""Memory and time of scoring a GGUF in llama.cpp by pieces of a row: for each piece size, a fresh
process loads the file, decodes ROWS rows of SEQ tokens a piece at a time reading every position's
logits (as the verifier does), and reports resident memory after loading and at its peak, and the
median seconds a row.

    python scripts/experiments/llama_pieces.py OUT/exports/q4_0/model.gguf --pieces 32 64 128 512 --threads 2

Informs ``PIECE_TOKENS`` in export/gguf/runtime.py (issue 27: llama.cpp's logits buffers at a
152k vocabulary).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def child(path: str, piece: int, threads: int, rows: int, seq: int) -> None:
    import torch

    from compress.export.gguf.runtime import LlamaCppModel

    model = LlamaCppModel(path, n_ctx=seq, threads=threads, piece_tokens=piece)
    loaded = rss_mib()
    ids = torch.randint(0, model.n_vocab, (rows, seq), generator=torch.Generator().manual_seed(0))
    times, peak, checksum = [], loaded, 0.0
    out = model.forward(ids)
    for row in range(rows):
        start = time.perf_counter()
        for first in range(0, seq - 1, 55):  # the verifier's chunks at a 152k vocabulary
            logits = out.logits(row, slice(first, min(first + 55, seq - 1)))
            checksum += float(logits[:, 0].sum())
            peak = max(peak, rss_mib())
        times.append(time.perf_counter() - start)
    print(
        json.dumps(
            {
                "piece": piece,
                "loaded_mib": round(loaded),
                "peak_mib": round(peak),
                "row_s": round(statistics.median(times), 3),
                "checksum": checksum,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("gguf")
    parser.add_argument("--pieces", type=int, nargs="+", default=[32, 64, 128, 512])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=3)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--child", type=int)
    args = parser.parse_args()
    if args.child:
        child(args.gguf, args.child, args.threads, args.rows, args.seq)
        return
    print(f"{args.gguf}: {args.rows} rows x {args.seq} tokens, {args.threads} threads")
    print("| piece | RSS loaded, MiB | RSS peak, MiB | s a row | logits checksum |")
    print("|---|---|---|---|---|")
    for piece in args.pieces:
        cmd = [
            sys.executable,
            __file__,
            args.gguf,
            "--child",
            str(piece),
            "--threads",
            str(args.threads),
            "--rows",
            str(args.rows),
            "--seq",
            str(args.seq),
        ]
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        print(f"| {piece} | {r['loaded_mib']} | {r['peak_mib']} | {r['row_s']} | {r['checksum']:.4f} |")


if __name__ == "__main__":
    main()
