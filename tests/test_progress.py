"""Progress where stderr is not a terminal: rich draws a bar only when it ends, so each bar also writes
plain lines at most every COMPRESS_PROGRESS_EVERY seconds."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from compress.progress import Reporter
from tests.helpers import run_cli


def _reporter(terminal: bool) -> tuple[Reporter, io.StringIO]:
    out = io.StringIO()
    return Reporter(Console(file=out, force_terminal=terminal, width=120)), out


def test_a_bar_writes_plain_lines_in_a_log(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPRESS_PROGRESS_EVERY", "0")
    reporter, out = _reporter(terminal=False)
    assert list(reporter.track(range(4), "blocks")) == [0, 1, 2, 3]
    lines = [line for line in out.getvalue().splitlines() if line.startswith("  blocks:")]
    assert [line.split(",")[0] for line in lines] == ["  blocks: 1/4", "  blocks: 2/4", "  blocks: 3/4"]
    assert all("elapsed" in line for line in lines)
    with reporter.bar("training", total=3) as step:
        step("loss 2.5")
        step("loss 2.1")
        step("loss 2.0")
    lines = [line for line in out.getvalue().splitlines() if line.startswith("  training:")]
    assert len(lines) == 2 and lines[1].startswith("  training: 2/3") and lines[1].endswith("loss 2.1")


def test_the_lines_wait_for_the_interval_and_stay_off_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPRESS_PROGRESS_EVERY", "3600")
    reporter, out = _reporter(terminal=False)
    list(reporter.track(range(5), "blocks"))
    assert "  blocks: 1/5" not in out.getvalue() and "blocks" in out.getvalue()  # only rich's own final line
    monkeypatch.setenv("COMPRESS_PROGRESS_EVERY", "0")
    reporter, out = _reporter(terminal=True)
    list(reporter.track(range(5), "blocks"))
    assert "  blocks: 1/5" not in out.getvalue()
    reporter, out = _reporter(terminal=False)
    reporter.quiet = True
    list(reporter.track(range(5), "blocks"))
    assert out.getvalue() == ""


@pytest.mark.parametrize("value", ["soon", "-1", "nan", "inf"])
def test_a_bad_interval_is_refused_by_name(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPRESS_PROGRESS_EVERY", value)
    result = run_cli(["assets", "fetch", "smollm2-135m"])  # refused before anything is fetched
    assert result.exit_code == 2, result.output
    assert "COMPRESS_PROGRESS_EVERY" in result.output and repr(value) in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
