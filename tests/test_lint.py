"""ruff, configured in pyproject.toml ([tool.ruff]), finds nothing: no lint finding and nothing to reformat.

LINTED is the part of the tree held to it. Today that is tests/ only: the rest of the tree is formatted in one
commit at the end of the current refactoring (others are editing those files), and that commit widens LINTED to
["."] (every Python file in the repository; ruff skips .venv and what .gitignore lists).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINTED = ["tests"]  # widen to ["."] in the commit that runs `ruff check --fix . && ruff format .` on the whole tree


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_finds_nothing(command: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", *command, *LINTED], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, (
        f"ruff {' '.join(command + LINTED)} (ruff is in the dev extra: pip install -e '.[dev]'):\n{proc.stdout}{proc.stderr}\n"
        f"fix with: ruff check --fix {' '.join(LINTED)} && ruff format {' '.join(LINTED)}"
    )
