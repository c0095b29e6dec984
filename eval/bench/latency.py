"""`compress bench latency`: how repeatable the latency measurement is. Every runtime export of an
artifact (and its torch model) is timed in ``rounds`` independent rounds, each a fresh worker
process with its own warm-up and repeats (eval/latency.py); the table gives each round's medians
and the largest relative spread between rounds, the number a latency gate's margin must exceed."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

from compress.documents import library_versions
from compress.eval.bench.quant import write_results
from compress.eval.latency import LatencySettings
from compress.eval.performance import Timed, cuda_device_name, measure_all
from compress.gate_artifact import inspect
from compress.progress import Reporter

COMPARED = ("ttft_ms", "tpot_ms", "decode_tokens_per_s", "batch_decode_tokens_per_s")


def run_latency_bench(
    artifact: Path, runtimes: list[str] | None, settings: LatencySettings, rounds: int, out_dir: Path, reporter: Reporter
) -> dict[str, Any]:
    import numpy as np

    out_dir.mkdir(parents=True, exist_ok=True)
    subject = inspect(artifact)
    timed: list[Timed] = [t for t in subject.timed if runtimes is None or t.target.runtime in runtimes]
    prompts = np.random.default_rng(0).integers(10, 256, size=(max(settings.batch_sizes), settings.prompt_tokens))
    rows: dict[str, dict[str, Any]] = {t.name: {"runtime": t.target.runtime, "rounds": []} for t in timed}
    hosts = []
    for _ in range(rounds):
        evaluations, host = measure_all(timed, settings, prompts, reporter)
        hosts.append(host["bandwidth_gbs"])
        for ev in evaluations:
            rows[ev.artifact]["rounds"].append(ev.metrics)
    for row in rows.values():
        row["spread_pct"] = {
            k: 100 * (max(v) - min(v)) / min(v)
            for k in COMPARED
            if len(v := [m[k] for m in row["rounds"] if k in m]) == rounds and min(v) > 0
        }
        row["max_spread_pct"] = max(row["spread_pct"].values())
    result = {
        "artifact": str(artifact),
        "settings": settings.__dict__,
        "rounds": rounds,
        "host_bandwidth_gbs": hosts,
        "threads": settings.threads,
        "cpu": platform.processor(),
        "gpu": cuda_device_name(),
        "versions": library_versions(),
        "results": rows,
    }
    write_results(out_dir, result, markdown_table(result))
    return result


def markdown_table(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        f"Latency repeatability: {result['rounds']} rounds, each a fresh process ({s['warmup']} warm-up + {s['repeats']} runs, "
        f"prompt {s['prompt_tokens']}, {s['output_tokens']} tokens, {s['threads']} threads); host bandwidth "
        + ", ".join(f"{b:.1f}" for b in result["host_bandwidth_gbs"])
        + " GB/s",
        "",
        "| artifact | runtime | round | TTFT ms | TPOT ms | tok/s | batch tok/s | BW util |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in result["results"].items():
        for i, m in enumerate(row["rounds"]):
            batch = f"{m['batch_decode_tokens_per_s']:.1f}" if "batch_decode_tokens_per_s" in m else "—"
            util = f"{m['bandwidth_utilization']:.0%}" if "bandwidth_utilization" in m else "—"
            lines.append(
                f"| {name} | {row['runtime']} | {i + 1} | {m['ttft_ms']:.1f} | {m['tpot_ms']:.2f} | {m['decode_tokens_per_s']:.1f} | "
                f"{batch} | {util} |"
            )
        spread = ", ".join(f"{k} {v:.1f}%" for k, v in row["spread_pct"].items())
        lines.append(f"| {name} | {row['runtime']} | spread | {spread} (max {row['max_spread_pct']:.1f}%) | | | | |")
    return "\n".join(lines) + "\n"
