"""Progress bars and messages for long work (rich), on stderr so stdout stays clean.

Where stderr is not a terminal (a CI log, a pipeline step, ``2> run.log``) rich draws a bar only once,
when it ends; there each bar also writes a plain line (``description: 5/28, 0:03:12 elapsed, eta 0:14:00``)
at most every ``$COMPRESS_PROGRESS_EVERY`` seconds (60 unless set), so an hour-long step shows in the log
that it moves."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from compress.errors import CompressError

T = TypeVar("T")

_COLUMNS = (
    SpinnerColumn(),
    TextColumn("[bold]{task.description}"),
    BarColumn(),
    MofNCompleteColumn(),
    TimeElapsedColumn(),
    TextColumn("eta"),
    TimeRemainingColumn(),
)


class Reporter:
    """Shows progress and notes to a person; ``quiet=True`` shows only warnings."""

    def __init__(self, console: Console | None = None, quiet: bool = False) -> None:
        self.console = console or Console(stderr=True)
        self.quiet = quiet
        self.log_every = _log_every()  # seconds between a bar's plain lines where the console is not a terminal

    def track(self, items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
        if self.quiet:
            yield from items
            return
        with Progress(*_COLUMNS, console=self.console) as progress:
            task = progress.add_task(description, total=total if total is not None else _len(items))
            lines = self._log_lines(progress, task)
            for item in items:
                yield item
                progress.advance(task)
                lines()

    @contextmanager
    def bar(self, description: str, total: int, completed: int = 0) -> Iterator[Callable[..., None]]:
        """A progress bar advanced by hand: the yielded function moves it one step and shows
        ``info`` (e.g. the loss and tokens/s of a training step) next to it; ``total=`` sets a
        new end (a training run that re-plans its steps)."""
        if self.quiet:
            yield lambda info, total=None: None
            return
        with Progress(*_COLUMNS, TextColumn("{task.fields[info]}"), console=self.console) as progress:
            task = progress.add_task(description, total=total, completed=completed, info="")
            lines = self._log_lines(progress, task)

            def step(info: str, total: int | None = None) -> None:
                progress.update(task, advance=1, info=info, **({} if total is None else {"total": total}))
                lines()

            yield step

    @contextmanager
    def status(self, message: str) -> Iterator[None]:
        if self.quiet:
            yield
            return
        with self.console.status(message):
            yield
        self.console.print(f"[green]✓[/] {message}")

    def info(self, message: str) -> None:
        if not self.quiet:
            self.console.print(message)

    def warn(self, message: str) -> None:
        self.console.print(f"[yellow]warning:[/] {message}")

    def _log_lines(self, progress: Progress, task: TaskID) -> Callable[[], None]:
        """Called after each step of a bar: where the console is not a terminal, writes the bar's state as
        a plain line once ``log_every`` seconds have passed since the last (the end is rich's own line)."""
        if self.console.is_terminal:
            return lambda: None
        last = time.monotonic()

        def maybe() -> None:
            nonlocal last
            now = time.monotonic()
            if now - last < self.log_every:
                return
            state = next(t for t in progress.tasks if t.id == task)  # a copy of the task list: only once due
            if state.finished:
                return
            last = now
            parts = [f"{state.completed:g}/{state.total:g}" if state.total is not None else f"{state.completed:g}"]
            parts.append(f"{_clock(state.elapsed or 0.0)} elapsed")
            if state.time_remaining is not None:
                parts.append(f"eta {_clock(state.time_remaining)}")
            info = state.fields.get("info")
            progress.console.print(
                f"  {state.description}: {', '.join(parts)}" + (f"  {info}" if info else ""), markup=False, highlight=False
            )

        return maybe


def _log_every() -> float:
    text = os.environ.get("COMPRESS_PROGRESS_EVERY", "").strip()
    if not text:
        return 60.0
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise CompressError(f"COMPRESS_PROGRESS_EVERY: expected seconds between progress lines (a number >= 0); got {text!r}")
    return seconds


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _len(items: Iterable[object]) -> int | None:
    try:
        return len(items)  # type: ignore[arg-type]
    except TypeError:
        return None
