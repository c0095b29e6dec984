"""Progress bars and messages for long work (rich), on stderr so stdout stays clean."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

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

    def track(self, items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
        if self.quiet:
            yield from items
            return
        with Progress(*_COLUMNS, console=self.console) as progress:
            task = progress.add_task(description, total=total if total is not None else _len(items))
            for item in items:
                yield item
                progress.advance(task)

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
            yield lambda info, total=None: progress.update(task, advance=1, info=info, **({} if total is None else {"total": total}))

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


def _len(items: Iterable[object]) -> int | None:
    try:
        return len(items)  # type: ignore[arg-type]
    except TypeError:
        return None
