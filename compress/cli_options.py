"""The command-line options several `compress` commands share (compress/cli.py, compress/cli_bench.py)."""

from __future__ import annotations

import typer

from compress.paths import usable_cpus

THREADS = usable_cpus()  # every --threads default, and its most: the CPUs this process may run on


def threads_option(default: int | None, help_text: str) -> typer.models.OptionInfo:
    """--threads: at least 1, at most the usable CPUs (more make torch's threads wait on each other; a
    count beyond any machine ended in a panic of a Rust thread pool), else exit 2 naming the range."""
    return typer.Option(default, min=1, max=THREADS, help=f"{help_text} At most {THREADS} here (the CPUs this process may use).")


OVERWRITE_OPTION = typer.Option(
    False,
    "--overwrite",
    help="Replace the output directory if it exists and compress wrote it (its .compress-output marker); never another directory.",
)
SET_OPTION = typer.Option(
    None,
    "--set",
    metavar="KEY.PATH=VALUE",
    help="Override a recipe value, e.g. --set stages.0.quantize.bits=8 (repeatable; VALUE is YAML).",
)
