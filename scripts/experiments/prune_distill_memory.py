"""Peak memory and repair quality of pruning + distillation on SmolLM2-135M: a live teacher (in
memory beside the student) against a stored one (its top-k log-probs computed once, a block at a
time, and read from disk while training), and pruning alone. Each variant is one `compress run`
(a fresh process, so each peak is its own) of recipes/prune-distill-float.yaml cut to a few
minutes on 2 CPU cores; the table comes from each run's report.json (``memory``: peak RSS per
phase) and manifest.json (the distill stage's summary).

    python scripts/experiments/prune_distill_memory.py OUT_DIR [--steps 20] [--top-k 64] [--only live,stored,prune]

Numbers and the command that measured them: docs/pruning.md ("Memory").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "recipes" / "prune-distill-float.yaml"


def variant(name: str, steps: int, top_k: int) -> dict:
    recipe = yaml.safe_load(BASE.read_text())
    recipe["name"] = f"smollm2-prune-mlp25-{name}"
    recipe["data"]["calibration"]["samples"] = 32
    recipe["data"]["evaluation"]["samples"] = 8
    prune, distill = recipe["stages"]
    prune["prune"]["batch_size"] = 4
    if name == "prune":
        recipe["stages"] = [prune]
        return recipe
    d = distill["distill"]
    d.update(steps=steps, warmup_steps=min(10, steps // 3), refit=None, checkpoint_every=0, eval={"every": 0, "samples": 2})
    d["data"] = {"source": d["data"]["source"], "samples": steps * d["batch_size"]}
    if name == "stored":
        d["stored_teacher"] = {"top_k": top_k}
    return recipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--only", default="prune,live,stored")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.only.split(","):
        path = args.out / f"{name}.yaml"
        path.write_text(yaml.safe_dump(variant(name, args.steps, args.top_k), sort_keys=False))
        out = args.out / name
        cmd = [sys.executable, "-m", "compress", "run", str(path), "-o", str(out), "--overwrite", "--quiet"]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if done.returncode not in (0, 1):
            sys.exit(f"{name}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        report = json.loads((out / "report.json").read_text())
        manifest = json.loads((out / "manifest.json").read_text())
        memory = report["memory"]
        phases = {k: v["peak_rss_mb"] for k, v in memory["phases"].items()}
        compressed = next(e for e in report["evaluations"] if e["artifact"] == "compressed")["metrics"]
        distill = next((s["summary"] for s in manifest["stages"] if s["kind"] == "distill"), None)
        rows.append((name, memory["peak_rss_mb"], phases, compressed, distill))
    print("| variant | peak RSS MB | per phase (peak RSS MB) | KL | top-1 | ppl | distill KL before → after (held-apart) | train s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, peak, phases, m, d in rows:
        phase_text = ", ".join(f"{k} {v:.0f}" for k, v in phases.items())
        repair = "—" if d is None else f"{d['before']['kl_divergence']:.4f} → {d['after']['kl_divergence']:.4f}"
        seconds = "—" if d is None else f"{d['train_seconds']:.0f}"
        print(
            f"| {name} | {peak:.0f} | {phase_text} | {m['kl_divergence']:.4f} | {m['top1_agreement']:.2%} | "
            f"{m['perplexity']:.2f} | {repair} | {seconds} |"
        )
        if d is not None and d.get("stored_teacher"):
            print(f"<!-- stored teacher: {d['stored_teacher']} -->")


if __name__ == "__main__":
    main()
