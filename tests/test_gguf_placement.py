"""scripts/gguf_placement.py: which blocks hold which type, and where two files differ."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gguf_placement.py"


def _write(path: Path, v_types: list[str]) -> Path:
    """A GGUF whose blk.N.attn_v.weight is F16 or F32 by ``v_types[N]``, beside an F32 norm per block."""
    w = GGUFWriter(path, "llama")
    for block, kind in enumerate(v_types):
        w.add_tensor(f"blk.{block}.attn_v.weight", np.ones((4, 32), dtype=np.float16 if kind == "F16" else np.float32))
        w.add_tensor(f"blk.{block}.attn_norm.weight", np.ones(32, dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_placement_and_differences(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.gguf", ["F16", "F32", "F16", "F32"])
    b = _write(tmp_path / "b.gguf", ["F16", "F16", "F16", "F32"])
    out = tmp_path / "p.json"
    done = subprocess.run([sys.executable, str(SCRIPT), a, b, "--json", out], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    info = result["files"][str(a)]
    assert info["counts"] == {"F32": 7, "F16": 2}
    assert info["placement"]["attn_v.weight"] == {"F16": [0, 2], "F32": [1, 3]}
    assert info["placement"]["attn_norm.weight"] == {"F32": [0, 1, 2, 3]}
    assert result["differs_from_first"] == {str(b): {"blk.1.attn_v.weight": ["F32", "F16"]}}
    assert "attn_v.weight: F16 in blocks [0, 2]; F32 in blocks [1, 3]" in done.stdout
    assert "attn_norm" not in done.stdout  # one type everywhere: nothing to place


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), tmp_path / "nope.gguf"], capture_output=True, text=True)
    assert done.returncode == 2
    assert "nope.gguf" in done.stderr and "Traceback" not in done.stderr
