"""Training checkpoints of a distillation stage: written atomically, the newest one kept, and a
fingerprint so a run never resumes from another run's state.

Layout of ``<work dir>/<stage label>/``::

    step-000050/student.safetensors   the student's weights (tied tensors once)
    step-000050/optimizer.pt          AdamW + scheduler state and the torch RNG state (tensors and numbers only)
    step-000050/state.json            step, tokens, seconds, eval history, fingerprint
    step-000050/best.safetensors      the trainable tensors at the best held-apart score so far, when that was
                                      an earlier evaluation than this step's (``keep_best``)
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.errors import CompressError

STATE_FILE = "state.json"
BEST_FILE = "best.safetensors"


@dataclass
class TrainState:
    """Where training stands; saved with every checkpoint."""

    step: int = 0
    tokens: int = 0
    seconds: float = 0.0  # in optimizer steps
    history: list[dict[str, Any]] = field(default_factory=list)
    resumed_from: int | None = None
    planned_steps: int | None = None  # where training ends: the configured steps, or fewer under a time budget
    wall_seconds: float = 0.0  # the training loop's wall-clock time: steps, evaluations and checkpoints
    eval_seconds: float = 0.0  # one held-apart evaluation (timed before the first step)
    best: int | None = None  # index in history of the lowest held-apart KL among the points keep_best may return to
    best_weights: list[torch.Tensor] | None = field(default=None, repr=False)  # the trainable tensors then, when not the current ones


def latest(directory: Path) -> Path | None:
    found = sorted(p for p in directory.glob("step-*") if (p / STATE_FILE).is_file()) if directory.is_dir() else []
    return found[-1] if found else None


def save(directory: Path, student: nn.Module, optimizer_state: dict[str, Any], scheduler: Any, state: TrainState, fingerprint: str) -> Path:
    """Write ``step-NNNNNN`` next to the old ones via a temporary name, then drop the older ones.
    ``optimizer_state``: the optimizer's state dict with whole tensors (Processes.optimizer_state)."""
    from safetensors.torch import save_file, save_model

    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step-{state.step:06d}"
    tmp = directory / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_model(student, str(tmp / "student.safetensors"))
    if state.best_weights is not None:
        save_file({str(i): t.contiguous() for i, t in enumerate(state.best_weights)}, str(tmp / BEST_FILE))
    torch.save({"optimizer": optimizer_state, "scheduler": scheduler.state_dict(), "rng": torch.get_rng_state()}, tmp / "optimizer.pt")
    payload = {
        "fingerprint": fingerprint,
        "step": state.step,
        "tokens": state.tokens,
        "seconds": state.seconds,
        "history": state.history,
        "planned_steps": state.planned_steps,
        "wall_seconds": state.wall_seconds,
        "eval_seconds": state.eval_seconds,
        "best": state.best,
    }
    (tmp / STATE_FILE).write_text(json.dumps(payload, indent=2) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in directory.glob("step-*"):
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load(path: Path, student: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, fingerprint: str) -> TrainState:
    """Restore ``student``, ``optimizer`` and ``scheduler`` from checkpoint ``path``."""
    from safetensors.torch import load_file, load_model

    payload = json.loads((path / STATE_FILE).read_text())
    if payload.get("fingerprint") != fingerprint:
        raise CompressError(
            f"{path} is a checkpoint of a different run (another recipe, stage or model shape). "
            f"Delete {path.parent} to start this stage over, or write this run to another output directory."
        )
    load_model(student, str(path / "student.safetensors"))
    extra = torch.load(path / "optimizer.pt", weights_only=True)
    optimizer.load_state_dict(extra["optimizer"])
    scheduler.load_state_dict(extra["scheduler"])
    torch.set_rng_state(extra["rng"])
    best_weights = None
    if (path / BEST_FILE).is_file():
        saved = load_file(str(path / BEST_FILE))
        best_weights = [saved[str(i)] for i in range(len(saved))]
    return TrainState(
        step=payload["step"],
        tokens=payload["tokens"],
        seconds=payload["seconds"],
        history=payload["history"],
        resumed_from=payload["step"],
        planned_steps=payload.get("planned_steps"),
        wall_seconds=payload.get("wall_seconds", 0.0),
        eval_seconds=payload.get("eval_seconds", 0.0),
        best=payload.get("best"),
        best_weights=best_weights,
    )
