"""The console: the two consoles (results on stdout, progress and errors on stderr), errors printed
for people instead of tracebacks (:func:`guarded`), and a run's, a gate's and a search's results as the
Markdown summary that eval/reports.py writes to summary.md, rendered for the terminal; registry
listings and publishes as tables and lines of their own."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import click
import typer
from rich import box
from rich.console import Console
from rich.markdown import Markdown
from rich.markup import escape
from rich.table import Table

from compress.errors import EXIT_ERROR, CompressError

out = Console()
err = Console(stderr=True)


def print_markdown(text: str) -> None:
    """Markdown on stdout: drawn (tables, emphasis) on a terminal; as it is where stdout is a log or a
    pipe, whose readers (a CI log, a script) get summary.md's own text, not tables cut to 80 columns."""
    if out.is_terminal:
        out.print(Markdown(text))
    else:
        out.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True, end="")


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Print CompressErrors for people (no traceback) and exit 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CompressError as exc:  # some say what they are and exit otherwise (a refused publish: 1, like a failed gate)
            label = getattr(exc, "label", "error")
            err.print(f"[bold red]{label}:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(getattr(exc, "exit_code", EXIT_ERROR)) from None
        except KeyboardInterrupt:
            err.print("[bold red]interrupted[/]: nothing was written (partial output is removed on the next run)")
            raise typer.Exit(130) from None
        except (typer.Exit, typer.Abort, click.exceptions.Exit, click.exceptions.ClickException, click.exceptions.Abort):
            raise
        except Exception as exc:  # a crash must not read as a failed gate (exit 1) in a pipeline
            if _out_of_space(exc):  # the machine's state, not a bug (safetensors' Rust writer says it in its message)
                err.print(
                    f"[bold red]error:[/] no space left on the device while writing: {escape(str(exc))[:300]}; free some "
                    "(the output folder, the scratch space under TMPDIR) and run again (partial output is removed on the next run)",
                    highlight=False,
                    soft_wrap=True,
                )
                raise typer.Exit(EXIT_ERROR) from None
            where = _save_traceback(exc)
            err.print(
                f"[bold red]error:[/] unexpected failure: {escape(type(exc).__name__)}: {escape(str(exc))[:500]} "
                f"(a bug in compress: please report it with the traceback in {where})",
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(EXIT_ERROR) from None

    return wrapper


def _out_of_space(exc: BaseException) -> bool:
    """A full disk or quota, raised as an OSError or (by a library written in Rust or C++) as its own error type."""
    import errno

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen) or "Disk quota exceeded" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _save_traceback(exc: BaseException) -> str:
    """Write ``exc``'s traceback to a file in the temporary directory; its path (or where it went instead)."""
    import tempfile
    import traceback

    text = "".join(traceback.format_exception(exc))
    if os.environ.get("COMPRESS_TRACEBACK") == "1":  # for developers: on stderr as well
        sys.stderr.write(text)
    try:
        fd, path = tempfile.mkstemp(prefix="compress-crash-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return path
    except OSError:
        sys.stderr.write(text)
        return "stderr above"


def print_summary(report: dict[str, Any], manifest: dict[str, Any]) -> None:
    """A run's results: each stage's line (its StageKind says it), the report, and what an export could not do here."""
    from compress.plugins import stage_kind

    for stage in manifest["stages"]:
        out.print(stage_kind(stage["kind"], stage["label"]).summary(stage, report))
    print_report(report)
    for entry in report.get("exports", []):  # what an export could not do here, said where people look
        for key, what in (("engine", "TensorRT engine"), ("verification_skipped", "verification")):
            reason = entry.get(key)
            reason = reason.get("skipped") if isinstance(reason, dict) else reason
            if reason:
                out.print(f"[yellow]exports {entry['name']}: {what} skipped[/]: {escape(reason)}")


def print_report(report: dict[str, Any]) -> None:
    """The report's Markdown summary (summary.md: gates, accuracy, latency measured and estimated, ...), then the verdict."""
    from compress.eval.reports import markdown_summary

    print_markdown(markdown_summary(report))
    if report["gates"]:
        out.print("[green]all gates passed[/]" if report["passed"] else "[red]a gate failed[/]")


def print_published(p: Any) -> None:
    state = "already published as" if p.reused else "published"
    forced = " [red](forced: a gate failed)[/]" if p.forced else ""
    aliases = f", aliases {', '.join('@' + a for a in p.aliases)}" if p.aliases else ""
    out.print(
        f"[green]{state}[/] [bold]{escape(p.name)}/{p.version}[/]{aliases} — gates {p.gates}{forced}, content "
        f"{p.content_sha256[:16]}… ({escape(p.location)})",
        highlight=False,
    )
    if p.failed_runs_marked:
        out.print(f"marked {len(p.failed_runs_marked)} abandoned publish run(s) failed (their process was gone)")


def print_registry(listing: dict[str, Any]) -> None:
    out.print(listing["location"], highlight=False)
    if not listing["models"]:
        out.print("no registered models")
    for model in listing["models"]:
        table = Table(title=model["name"], box=box.SIMPLE_HEAD, title_justify="left")
        for col in ("version", "aliases", "gates", "state", "size MiB", "content", "created"):
            table.add_column(col)
        for v in model["versions"]:
            gates = v["gates"] + (f" {v['gates_passed']}" if v["gates_passed"] else "") + (" [red]forced[/]" if v["forced"] else "")
            state = "[green]ready[/]" if v["ready"] else f"[red]{v['status'].lower()}[/]"
            size = f"{v['size_bytes'] / 2**20:,.1f}" if v["size_bytes"] is not None else "–"
            table.add_row(
                v["version"],
                ", ".join("@" + a for a in v["aliases"]),
                gates,
                state,
                size,
                (v["content_sha256"] or "")[:12],
                v["created"] or "",
            )
        out.print(table)
    if listing["unfinished_publishes"]:
        table = Table(title="publishes that created no version", box=box.SIMPLE_HEAD, title_justify="left")
        for col in ("name", "run", "status", "started", "why"):
            table.add_column(col)
        for run in listing["unfinished_publishes"]:
            status = "[red]failed[/]" if run["status"] == "FAILED" else run["status"].lower()
            table.add_row(run["name"] or "?", run["run_id"][:12], status, run["started"] or "", run["reason"])
        out.print(table)


def print_search(report: dict[str, Any]) -> None:
    """The search's candidates as the report's Markdown summary shows them, then the one chosen."""
    from compress.eval.reports import search_lines

    search = report["search"]
    print_markdown("\n".join(search_lines(search)))
    if search["chosen"]:
        out.print(f"chosen: [bold]{search['chosen']}[/] ({search['chosen_path']}), the smallest artifact passing every gate")
    else:
        out.print("[red]no candidate passed every gate[/]")
