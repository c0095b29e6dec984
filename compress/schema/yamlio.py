"""Reading YAML that someone else wrote: bounded in size, depth and expansion, never a traceback.

Recipes, gates files and device profiles all come through `load_yaml`. PyYAML itself shares
aliased nodes, but anything that walks the result (line maps, validation, JSON dumps) expands
every alias, so a "billion laughs" file of a few hundred bytes could take unbounded time and
memory. `load_yaml` walks the composed node graph once with a budget on the expanded node
count and the depth, refuses control characters, and turns every parser failure into a
`CompressError` subclass naming the file and line.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from compress.errors import CompressError

MAX_BYTES = 1 << 20
"""Largest YAML document read (1 MiB); recipes are a few KB."""
MAX_NODES = 100_000
"""Largest number of values the document may expand to, aliases counted at every use."""
MAX_DEPTH = 64
"""Deepest nesting of mappings and lists."""

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def read_text(path: Path, what: str, error: type[CompressError] = CompressError) -> str:
    """The UTF-8 text of ``path``, refusing non-files and anything over MAX_BYTES."""
    if not path.is_file():
        raise error(f"{what} not found (or not a regular file): {path}")
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise error(f"{path}: {what} is {size:,} bytes; at most {MAX_BYTES:,} are read")
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: {what} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None


class _KeysStayText(yaml.SafeLoader):
    """SafeLoader whose plain mapping keys spelled on/off/yes/no stay text: YAML 1.1 reads them as
    booleans, no key of ours is a boolean, and a gate's ``on:`` is a key."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag == "tag:yaml.org,2002:bool" and key_node.style is None:
                key_node.tag = "tag:yaml.org,2002:str"
        return super().construct_mapping(node, deep)


# YAML 1.1 (PyYAML) reads 1e9, 1.0e9 and 1e-4 as text (it wants a dot and a signed exponent); YAML 1.2,
# JSON and people read them as numbers. With strict types a text is no number, so read them as floats.
_KeysStayText.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"), list("-+0123456789.")
)


def load_yaml(text: str, filename: str, error: type[CompressError] = CompressError) -> tuple[Any, dict[tuple, int]]:
    """Parse ``text``; return the plain data and a map from key path to 1-based line number.

    Raises ``error`` (file:line and what is wrong) for invalid YAML, control characters, a
    document over MAX_BYTES, deeper than MAX_DEPTH or expanding to more than MAX_NODES values.
    """
    if len(text) > MAX_BYTES:
        raise error(f"{filename}: {len(text):,} characters; at most {MAX_BYTES:,} are read")
    if (bad := _CONTROL.search(text)) is not None:
        line = text.count("\n", 0, bad.start()) + 1
        raise error(f"{filename}:{line}: control character {bad.group()!r} (only tab and newline are allowed)")
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise error(f"{_where(exc, filename)}: not valid YAML: {_problem(exc)}") from None
    except RecursionError:
        raise error(f"{filename}: nested too deeply (at most {MAX_DEPTH} levels)") from None
    lines: dict[tuple, int] = {}
    if node is not None:
        lines[()] = node.start_mark.line + 1
        _walk(node, lines, filename, error)
    try:
        data = yaml.load(text, Loader=_KeysStayText)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise error(f"{_where(exc, filename)}: not valid YAML: {_problem(exc)}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # e.g. a date like 2024-02-30
        raise error(f"{filename}: a value cannot be read: {exc}") from None
    return data, lines


def _walk(root: yaml.Node, lines: dict[tuple, int], filename: str, error: type[CompressError]) -> None:
    """Record key lines, refuse repeated keys, and bound depth and expanded size (iteratively)."""
    stack: list[tuple[yaml.Node, tuple]] = [(root, ())]
    visited = 0
    while stack:
        node, path = stack.pop()
        visited += 1
        if visited > MAX_NODES:
            raise error(
                f"{filename}: the document expands to more than {MAX_NODES:,} values "
                "(nested YAML aliases?); write the values out or reuse fewer anchors"
            )
        if len(path) > MAX_DEPTH:
            raise error(f"{filename}:{node.start_mark.line + 1}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, value_node in node.value:
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else f"<{type(key_node).__name__}>"
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise error(f"{filename}:{line}: key '{format_path((*path, key))}' repeats the key on line {seen[key]}")
                seen[key] = line
                lines.setdefault((*path, key), line)
                stack.append((value_node, (*path, key)))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                lines.setdefault((*path, i), item.start_mark.line + 1)
                stack.append((item, (*path, i)))
        elif isinstance(node.value, str) and (bad := _CONTROL.search(node.value)) is not None:  # an escape such as "\0"
            raise error(
                f"{filename}:{node.start_mark.line + 1}: {format_path(path) or 'the document'} holds the control character {bad.group()!r}"
            )


def format_path(loc: tuple) -> str:
    """``('stages', 0, 'quantize')`` -> ``stages[0].quantize``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _where(exc: yaml.YAMLError, filename: str) -> str:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    if mark is None and hasattr(exc, "position") and hasattr(exc, "name"):  # ReaderError
        return filename
    return f"{filename}:{mark.line + 1}" if mark is not None else filename


def _problem(exc: yaml.YAMLError) -> str:
    return str(getattr(exc, "problem", None) or exc).strip()
