"""Compare the measured metrics of two runs: a refactor must not change the numbers.

    python scripts/compare_metrics.py OLD NEW [--rel 1e-6]
    python scripts/compare_metrics.py ARTIFACT --save expected.json

OLD and NEW are each an artifact directory (its report.json), a report.json, or a file written
by --save. Compared: every metric of every evaluation that is not a timing (kinds accuracy,
kv_cache and memory; latency numbers change from run to run), keyed by artifact, runtime, device,
source, kind and metric name. Exit 0 when both have the same keys and every value agrees within
--rel (relative; 0 asks for identical numbers), 1 when they differ (each difference is printed),
2 on a file that cannot be read. Standard library only, so it runs against any checkout.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

COMPARED_KINDS = ("accuracy", "kv_cache", "memory")


def metrics_of(path: Path) -> dict[str, float | str]:
    """The comparable metrics of an artifact directory, a report.json or a --save file, by key."""
    file = path / "report.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SystemExit(f"error: {file}: cannot read it as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise SystemExit(f"error: {file}: expected a JSON object")
    if "metrics" in data and "evaluations" not in data:  # a --save file
        return dict(data["metrics"])
    out: dict[str, float | str] = {}
    for ev in data.get("evaluations", []):
        if ev.get("kind") not in COMPARED_KINDS:
            continue
        where = "/".join(str(ev.get(k)) for k in ("artifact", "runtime", "device", "source", "kind"))
        for name, value in (ev.get("metrics") or {}).items():
            out[f"{where}/{name}"] = value
    if not out:
        raise SystemExit(f"error: {file}: no {'/'.join(COMPARED_KINDS)} evaluations with metrics in it")
    return out


def _close(a: float | str, b: float | str, rel: float) -> bool:
    if isinstance(a, str) or isinstance(b, str):  # "nan", "inf", "-inf" as report.json writes them
        return a == b
    if a == b:
        return True
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= rel * max(abs(a), abs(b))


def differences(old: dict[str, float | str], new: dict[str, float | str], rel: float) -> list[str]:
    lines = [f"only in OLD: {k} = {old[k]}" for k in sorted(old.keys() - new.keys())]
    lines += [f"only in NEW: {k} = {new[k]}" for k in sorted(new.keys() - old.keys())]
    lines += [f"differs: {k}: {old[k]!r} -> {new[k]!r}" for k in sorted(old.keys() & new.keys()) if not _close(old[k], new[k], rel)]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path, nargs="?")
    parser.add_argument("--rel", type=float, default=0.0, help="relative tolerance (default 0: identical)")
    parser.add_argument("--save", type=Path, help="write OLD's comparable metrics to this file and stop")
    args = parser.parse_args(argv)
    try:
        old = metrics_of(args.old)
        if args.save:
            args.save.write_text(json.dumps({"metrics": old}, indent=1, sort_keys=True) + "\n")
            print(f"saved {len(old)} metrics of {args.old} to {args.save}")
            return 0
        if args.new is None:
            parser.error("give NEW, or --save")
        new = metrics_of(args.new)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            return 2
        raise
    diff = differences(old, new, args.rel)
    for line in diff:
        print(line)
    print(f"{len(old.keys() & new.keys())} metrics compared (relative tolerance {args.rel:g}): {'DIFFERENT' if diff else 'same'}")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
