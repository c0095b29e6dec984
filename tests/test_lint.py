"""ruff, configured in pyproject.toml ([tool.ruff]), finds nothing in the repository: no lint finding and nothing
to reformat. Fix a failure with `ruff check --fix . && ruff format .` (ruff is pinned in the dev extra)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINTED = ["."]  # every Python file in the repository (ruff skips .venv and what .gitignore lists)


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_finds_nothing(command: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", *command, *LINTED], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, (
        f"ruff {' '.join(command + LINTED)} (ruff is in the dev extra: pip install -e '.[dev]'):\n{proc.stdout}{proc.stderr}\n"
        f"fix with: ruff check --fix {' '.join(LINTED)} && ruff format {' '.join(LINTED)}"
    )
