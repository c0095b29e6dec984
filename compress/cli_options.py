"""The command-line options several `compress` commands share (compress/cli.py, compress/cli_bench.py)."""

from __future__ import annotations

import typer

from compress.paths import usable_cpus

THREADS = usable_cpus()  # every --threads default: the CPUs this process may run on

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
