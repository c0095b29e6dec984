"""Run recipes with two installs of compress (before and after a change) and compare their numbers.

    python scripts/same_numbers.py --before OLD/.venv/bin/compress --after .venv/bin/compress -o DIR
    python scripts/same_numbers.py ... --recipe recipes/onnx.yaml --recipe recipes/search.yaml
    python scripts/same_numbers.py ... --full        # the recipes as written, not shortened

A refactor must leave every recipe's report metrics as they were (issue 52, "numbers do not change").
Each recipe runs once per install, one after the other (never both at once: two runs on a 2-core
machine slow each other, and a distillation with a time budget would then take fewer steps), into
DIR/<recipe>/before and DIR/<recipe>/after; then scripts/compare_metrics.py compares the pair
(every accuracy, KV-cache and memory metric; timings are left out).

By default the long recipes are shortened with --set overrides that keep every stage and export
(fewer calibration, evaluation and training samples, a distillation bounded by steps rather than
minutes, which would make the step count depend on the machine's load): SHORTER lists them. The
same overrides go to both installs, so the two runs are alike in everything but the code.

Exit 0 when every recipe gave the same numbers, 1 when one differed, 2 when a run failed.
An install is any `compress` executable: a second checkout needs its own virtual environment,
since an editable install maps to the folder it was made from.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Overrides that shorten a recipe without dropping a stage or an export (same for both installs).
SHORTER: dict[str, list[str]] = {
    "prune-distill.yaml": [
        "stages.1.distill.steps=8",
        "stages.1.distill.warmup_steps=2",
        "stages.1.distill.max_minutes=null",
        "stages.1.distill.eval.every=4",
        "stages.1.distill.checkpoint_every=4",
        "data.calibration.samples=16",
        "data.evaluation.samples=4",
    ],
    "prune-distill-float.yaml": [
        "stages.1.distill.steps=8",
        "stages.1.distill.warmup_steps=2",
        "stages.1.distill.eval.every=4",
        "data.calibration.samples=16",
    ],
    "qwen-1.5b-gptq.yaml": ["data.calibration.samples=18", "data.evaluation.samples=2"],  # 18 x 512 > 8,960 down_proj columns
    "qwen-1.5b-rtn.yaml": ["data.evaluation.samples=2"],
    "qwen-1.5b-prune-distill.yaml": ["data.calibration.samples=8", "data.evaluation.samples=2", "stages.1.distill.steps=4"],
    "kv-cache.yaml": ["stages.0.kv_cache.evaluate.samples=8", "stages.0.kv_cache.evaluate.context=512"],
    "tasks-mmlu.yaml": ["data.calibration.samples=32", "data.evaluation.samples=8"],
    "onnx.yaml": ["data.calibration.samples=32", "data.evaluation.samples=8"],
    "gguf-budget.yaml": ["data.evaluation.samples=8"],
    "llm-int8.yaml": ["data.calibration.samples=8", "data.evaluation.samples=8"],
    "latency-gates.yaml": ["data.evaluation.samples=8"],
    "search.yaml": ["data.evaluation.samples=4"],
    "kv-evict.yaml": ["stages.0.kv_cache.evaluate.samples=8", "stages.0.kv_cache.evaluate.step=16", "stages.0.kv_cache.evaluate.needles=2"],
}


def run_one(compress: str, recipe: Path, out: Path, overrides: list[str], log: Path) -> tuple[int, float]:
    """One `compress run` of the recipe into out; its output goes to log. Returns (exit code, seconds).
    It runs in out's parent folder, not here: the workers a run starts with `python -m compress...`
    (latency, multi-process distillation) put their working directory first on sys.path, so in a
    checkout they would import that checkout's compress/ instead of the install's."""
    out = out.resolve()
    cmd = [compress, "run", str(recipe.resolve()), "-o", str(out), "--overwrite", "--quiet"]
    for item in overrides:
        cmd += ["--set", item]
    start = time.perf_counter()
    with log.open("w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, check=False, cwd=out.parent).returncode
    return rc, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the `compress` executable of the install before the change")
    parser.add_argument("--after", required=True, help="the `compress` executable of the install after the change")
    parser.add_argument("-o", "--output", required=True, type=Path, help="folder for the runs and their logs")
    parser.add_argument("--recipe", action="append", type=Path, help="a recipe (repeatable; default: every recipes/*.yaml)")
    parser.add_argument("--full", action="store_true", help="run the recipes as written (no SHORTER overrides)")
    parser.add_argument("--rel", default="0", help="relative tolerance for compare_metrics.py (default 0: identical)")
    parser.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more override for every recipe, both installs (repeatable), e.g. model.source=a cut copy of the model",
    )
    args = parser.parse_args()
    recipes = args.recipe or sorted((ROOT / "recipes").glob("*.yaml"))
    worst = 0
    for recipe in recipes:
        overrides = ([] if args.full else SHORTER.get(recipe.name, [])) + args.extra
        where = args.output / recipe.stem
        where.mkdir(parents=True, exist_ok=True)
        codes = {}
        for side, exe in (("before", args.before), ("after", args.after)):
            rc, seconds = run_one(exe, recipe, where / side, overrides, where / f"{side}.log")
            codes[side] = rc
            print(f"{recipe.name} {side}: exit {rc} in {seconds:.0f} s", flush=True)
        if codes["before"] != codes["after"] or codes["before"] not in (0, 1):
            print(f"{recipe.name}: exit codes {codes} (see {where}/*.log)", flush=True)
            worst = 2
            continue
        cmp = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "compare_metrics.py"), str(where / "before"), str(where / "after"), "--rel", args.rel],
            capture_output=True,
            text=True,
            check=False,
        )
        (where / "compare.txt").write_text(cmp.stdout + cmp.stderr)
        print(f"{recipe.name}: {cmp.stdout.strip().splitlines()[-1] if cmp.stdout.strip() else cmp.stderr.strip()}", flush=True)
        worst = max(worst, cmp.returncode)
    return worst


if __name__ == "__main__":
    sys.exit(main())
