"""The ``compress`` command's entry point: an interrupt (Ctrl-C, SIGINT) at any moment, from the
first import to the last line of output, ends the process with exit 130 and one line, never a
traceback and never the exit code of a result the user did not wait for.

Nothing heavy is imported at module level here, so that the handler is in place before the CLI's
imports (typer, rich, pydantic, later torch) start. While a command runs, SIGINT raises
KeyboardInterrupt as Python's own handler does (so ``finally`` blocks and atomic writes clean up;
compress.cli's ``guarded`` turns it into exit 130); once the command has returned or exited, a
SIGINT ends the process at once with 130, and from the last flush of its output to the exit it is
held back (the process ends with its result).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

INTERRUPTED = 130
_MESSAGE = "interrupted\n"


class _State:
    interrupted = False


def _raise_interrupt(signum: int, frame: Any) -> None:
    _State.interrupted = True
    raise KeyboardInterrupt


def _exit_now(signum: int, frame: Any) -> None:
    try:
        sys.stderr.write(_MESSAGE)
        sys.stderr.flush()
    finally:
        os._exit(INTERRUPTED)


def run(cli_main: Any = None) -> int | str | None:
    """Run the CLI (``compress.cli.main`` unless given) with the interrupt rules above; return its
    exit code (a SystemExit's code, or None when it returned)."""
    signal.signal(signal.SIGINT, _raise_interrupt)
    code: int | str | None = None
    try:
        if cli_main is None:
            from compress.cli import main as cli_main
        cli_main()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, _exit_now)
        sys.stderr.write(_MESSAGE)
        code = INTERRUPTED
    except SystemExit as exc:
        signal.signal(signal.SIGINT, _exit_now)
        code = exc.code
    signal.signal(signal.SIGINT, _exit_now)  # from here to the end of the process
    if _State.interrupted and code != INTERRUPTED:  # click turns an interrupt it sees (while parsing) into exit 1
        sys.stderr.write(_MESSAGE)
        code = INTERRUPTED
    return code


def main() -> None:
    code = run()
    sys.stdout.flush()
    sys.stderr.flush()
    # The interpreter's shutdown puts SIGINT's default action back (death by signal, exit -2): from the
    # last line to the exit an interrupt is held back instead, and the process ends with its result.
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    sys.exit(code)
