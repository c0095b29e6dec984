"""Layer-name patterns (``targets`` / ``ignore``): globs, or regular expressions behind ``re:``,
matched with a bound on the time any one match may take.

A regular expression with nested repetition (``re:(.|.)*X``) can backtrack for minutes on one
module name. Python's ``re`` has no time limit, so expressions run on the ``regex`` engine (the
same syntax as ``re`` for these patterns), whose matches take a timeout:

- at validation, each expression is compiled and tried on module names of the supported
  architectures; one that needs more than ``PROBE_SECONDS`` on any of them is refused, naming it;
- at run time every match is bounded by ``MATCH_SECONDS``; running over is a ``PatternTimeout``
  (a CompressError) naming the pattern and the module name, never an endless run.

The bounds are wall-clock time, which a busy machine stretches, so a match counts as over its bound
only when it overruns ``ATTEMPTS`` times in a row.
"""

from __future__ import annotations

import fnmatch
from functools import lru_cache
from typing import Any

import regex

from compress.errors import CompressError

__all__ = ["ATTEMPTS", "MATCH_SECONDS", "PROBE_NAMES", "PROBE_SECONDS", "PatternTimeout", "check_pattern", "matches", "regex_match"]

REGEX_PREFIX = "re:"
PROBE_SECONDS = 0.05
MATCH_SECONDS = 0.5
ATTEMPTS = 3  # a match is over its bound only when it overruns this many times in a row
# Module names a pattern is tried on at validation: the supported architectures' Linear layers, a deep
# mixture-of-experts name, and a long name of one repeated character (where nested repeats blow up).
PROBE_NAMES = (
    "lm_head",
    "model.embed_tokens",
    "model.layers.0.self_attn.q_proj",
    "model.layers.27.mlp.down_proj",
    "model.layers.127.block_sparse_moe.experts.255.w2",
    "model.language_model.layers.61.mlp.experts.127.gate_up_proj",
    "transformer.h.11.attn.c_attn",
    "a" * 48,
)


class PatternTimeout(CompressError):
    """A ``re:`` pattern took longer than its bound to match one module name."""


_NOT_A_REGEX = (regex.error, ValueError, OverflowError, RecursionError)  # what compiling a bad expression raises
_OVERRUN = object()  # _bounded_match's answer when every attempt ran over its bound


@lru_cache(maxsize=256)
def _compiled(expression: str) -> regex.Pattern:
    return regex.compile(expression, flags=regex.VERSION0)


def check_pattern(pattern: str) -> str | None:
    """Why ``pattern`` cannot be used (a message without the key), or None when it can.

    Globs always can. A ``re:`` expression must compile and match each of ``PROBE_NAMES`` within
    ``PROBE_SECONDS``.
    """
    if not pattern.startswith(REGEX_PREFIX):
        return None
    expression = pattern[len(REGEX_PREFIX) :]
    try:
        compiled = _compiled(expression)
    except _NOT_A_REGEX as exc:
        return f"'{pattern}' is not a regular expression: {exc}"
    for name in PROBE_NAMES:
        if _bounded_match(compiled, name, PROBE_SECONDS, whole=True) is _OVERRUN:
            return (
                f"'{pattern}' takes over {PROBE_SECONDS * 1000:.0f} ms to match the module name '{name}' "
                "(nested repetition such as (a|a)* or (a+)+ backtracks); write it without repeating a group "
                "that can match the same text in more than one way"
            )
    return None


def regex_match(expression: str, name: str, *, whole: bool = True, what: str = "pattern") -> bool:
    """``expression`` matches ``name`` (the whole name, or its start when ``whole`` is false), within
    ``MATCH_SECONDS``; running over raises PatternTimeout naming ``what``."""
    try:
        compiled = _compiled(expression)
    except _NOT_A_REGEX as exc:
        raise CompressError(f"{what} 're:{expression}' is not a regular expression: {exc}") from None
    found = _bounded_match(compiled, name, MATCH_SECONDS, whole)
    if found is _OVERRUN:
        raise PatternTimeout(
            f"{what} 're:{expression}' took over {MATCH_SECONDS} s to match the module name '{name}'; rewrite it without nested repetition"
        )
    return found is not None


def _bounded_match(compiled: regex.Pattern, name: str, seconds: float, whole: bool) -> Any:
    """The match of ``name`` (or None), or ``_OVERRUN`` when it ran over ``seconds`` ``ATTEMPTS`` times in a
    row. The timeout is wall-clock time, so one overrun may be this process waiting for a CPU on a busy
    machine; a backtracking pattern overruns every time."""
    match = compiled.fullmatch if whole else compiled.match
    for _ in range(ATTEMPTS):
        try:
            return match(name, timeout=seconds)
        except TimeoutError:
            continue
    return _OVERRUN


def matches(name: str, pattern: str) -> bool:
    """True when ``pattern`` selects the module ``name``.

    ``re:<regex>`` must match the whole name; any other pattern is a glob that matches the whole
    name or its trailing dotted components (``down_proj`` matches ``model.layers.0.mlp.down_proj``).
    """
    if pattern.startswith(REGEX_PREFIX):
        return regex_match(pattern[len(REGEX_PREFIX) :], name)
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)
