"""Which directories are ours: the ``.compress-output`` marker.

compress writes a marker into every directory it creates (an artifact, a pulled version, a gate
report, a recipe search, a benchmark's results, an exported encoder), last, and deletes or
replaces a directory only when it is empty or carries a valid marker and holds nothing its marker
does not account for. The marker is a small JSON object::

    {"compress_output": 1, "kind": "artifact", "manifest_sha256": "<SHA-256 of manifest.json>"}

``manifest_sha256`` (kinds with a manifest: artifact, gate report) binds the marker to the
manifest's exact bytes, so an edited manifest.json is refused by ``compress verify`` (and gate,
pull, publish); the manifest in turn lists every other file with its SHA-256. A kind without a
manifest names the top-level entries it may hold: fixed per kind for outputs written in place (a
search, a benchmark), or listed in the marker (``names``) for one written whole (an encoder).

What a marker proves: that compress wrote the directory, as far as an accident can tell. Nobody
writes this file name by chance, and a marker copied into another folder (with its manifest, say
an artifact unpacked into a project) does not make that folder ours: every file there must be one
the manifest or the kind names, or the folder is refused, naming the files. It is no signature:
whoever deliberately writes a marker and a manifest listing their files can have them replaced.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKER = ".compress-output"
MARKER_VERSION = 1
MANIFEST = "manifest.json"
MODEL_CARD = "MODEL_CARD.md"  # written by publish into a pulled version, not listed in its manifest
_MARKER_MAX_BYTES = 64 * 1024
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(partial-\d+-.*|old-\d+)$")  # what atomic writes leave beside their target


@dataclass(frozen=True)
class OutputKind:
    """One kind of directory compress writes, and what it may hold besides its marker."""

    name: str
    described: str  # for messages: "an artifact", ...
    manifest: bool = False  # bound to manifest.json, whose ``files`` name every other file
    names: tuple[str, ...] = ()  # without a manifest: top-level entries it may hold (``x*``: any name starting with x)
    nested: str | None = None  # a folder of outputs of their own (a search's candidates), each checked as one


ARTIFACT = OutputKind("artifact", "an artifact or pulled version", manifest=True)
GATE_REPORT = OutputKind("gate-report", "a gate report", manifest=True)
SEARCH = OutputKind("search", "a recipe search", names=("report.json", "summary.md", "junit.xml", "plots"), nested="candidates")
BENCH = OutputKind(
    "bench", "a benchmark's results", names=("results.json", "results.md", "files", "runs", "kl-vs-size.png", "repair-curves.png")
)
ENCODER = OutputKind("encoder", "an exported encoder")
WORK = OutputKind("work", "a run's work directory", names=("overlay", "records", "baseline", "tasks", "stages[*"))
KINDS = {kind.name: kind for kind in (ARTIFACT, GATE_REPORT, SEARCH, BENCH, ENCODER, WORK)}
"""Every kind by the name its marker records."""


def sha256_bytes(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def marker_content(root: Path, kind: OutputKind) -> dict[str, Any]:
    """The marker of ``root`` as it is now: bound to its manifest.json, or naming its top-level entries."""
    content: dict[str, Any] = {"compress_output": MARKER_VERSION, "kind": kind.name}
    if kind.manifest:
        content["manifest_sha256"] = sha256_bytes(root / MANIFEST)
    elif not kind.names:
        content["names"] = sorted(p.name for p in root.iterdir() if p.name != MARKER)
    return content


def write_marker(root: Path, kind: OutputKind) -> None:
    """Mark ``root`` as ours, last (a kind with a manifest: after manifest.json is final); in one
    rename, so a reader never sees half a marker."""
    tmp = root / f"{MARKER}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(marker_content(root, kind), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, root / MARKER)


def read_marker(root: Path) -> tuple[OutputKind, dict[str, Any]]:
    """The kind and content of ``root``'s marker; ValueError saying what is wrong with it."""
    path = root / MARKER
    if path.is_symlink() or not path.is_file():
        raise ValueError(f"it has no {MARKER} marker (compress writes one into every directory it creates)")
    if path.stat().st_size > _MARKER_MAX_BYTES:
        raise ValueError(f"its {MARKER} is larger than a marker compress writes")
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        raise ValueError(f"its {MARKER} is not the JSON compress writes") from None
    kind = KINDS.get(content.get("kind")) if isinstance(content, dict) else None
    if kind is None or content.get("compress_output") != MARKER_VERSION:
        raise ValueError(f"its {MARKER} names no kind of output this release of compress writes")
    if kind.manifest and content.get("manifest_sha256") != _manifest_digest(root):
        raise ValueError(f"its {MANIFEST} is not the one compress wrote with its {MARKER} (edited, replaced or missing)")
    names = content.get("names", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"its {MARKER} has a malformed `names` list")
    return kind, content


def _manifest_digest(root: Path) -> str | None:
    path = root / MANIFEST
    return sha256_bytes(path) if path.is_file() and not path.is_symlink() else None


def not_ours(directory: Path, kind: OutputKind) -> str | None:
    """None when ``directory`` is empty or an output of ours of ``kind`` holding only what its marker
    accounts for; otherwise why not, for a message. Only non-directory entries count: folders are containers."""
    try:
        if not any(directory.iterdir()):
            return None
        found, content = read_marker(directory)
        foreign = _foreign(directory, found, content)
    except ValueError as exc:
        return str(exc)
    except OSError as exc:
        return f"it cannot be read ({exc.strerror or exc})"
    if found != kind:
        return f"it is {found.described}, not {kind.described}"
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        return f"it is marked as {found.described} but holds files compress did not write there: {', '.join(foreign[:5])}{more}"
    return None


def _foreign(root: Path, kind: OutputKind, content: dict[str, Any]) -> list[str]:
    """Relative paths under ``root`` its kind and marker do not account for."""
    if kind.manifest:
        listed = _manifest_files(root)
        return [rel for rel in entries(root) if rel not in listed]
    allowed = {MARKER, *content.get("names", []), *(n for n in kind.names if not n.endswith("*"))}
    prefixes = tuple(n[:-1] for n in kind.names if n.endswith("*"))
    foreign = []
    for rel in entries(root):
        top = rel.split("/", 1)[0]
        if top != kind.nested and top not in allowed and not top.startswith(prefixes):
            foreign.append(rel)
    if kind.nested and (root / kind.nested).is_dir():
        foreign += _foreign_nested(root, kind.nested)
    return foreign


def _foreign_nested(root: Path, nested: str) -> list[str]:
    """Entries of a folder of outputs that are neither outputs of ours nor what a killed write of one left."""
    foreign = []
    for child in sorted((root / nested).iterdir()):
        rel = f"{nested}/{child.name}"
        if child.is_dir() and not child.is_symlink() and (_LEFTOVER.match(child.name) or _ours_of_any_kind(child)):
            continue
        foreign.append(rel)
    return foreign


def _ours_of_any_kind(directory: Path) -> bool:
    """An output of ours (an artifact, a killed run's work directory, ...) holding only what its marker accounts for."""
    try:
        kind, _ = read_marker(directory)
    except (ValueError, OSError):
        return not any(directory.iterdir())
    return not_ours(directory, kind) is None


def _manifest_files(root: Path) -> set[str]:
    manifest = json.loads((root / MANIFEST).read_text(encoding="utf-8"))  # read_marker checked it is the one we wrote
    files = manifest.get("files") if isinstance(manifest, dict) else None
    return {MANIFEST, MARKER, MODEL_CARD} | (set(files) if isinstance(files, dict) else set())


def entries(root: Path) -> list[str]:
    """Every non-directory entry under ``root`` (links and special files included, links not followed), relative."""
    found = []
    for here, dirs, files in os.walk(root):
        base = Path(here)
        links = [d for d in dirs if (base / d).is_symlink()]
        dirs[:] = [d for d in dirs if d not in links]
        found += [(base / name).relative_to(root).as_posix() for name in (*files, *links)]
    return sorted(found)
