"""Atomic directory writes and file hashing.

A directory is built under a temporary name next to its target and renamed into place only
when complete, so a killed run leaves either nothing or a complete directory. Leftovers of
killed runs (``.NAME.partial-PID-*``) are removed by the next write to the same target, and a
directory a killed run was replacing (``.NAME.old-PID``) is put back when the target is missing.
``--overwrite`` replaces only an empty directory or one of ours (compress/marker.py: a marker we
write, and nothing in the directory it does not account for).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from compress.errors import ArtifactError
from compress.marker import MARKER, OutputKind, not_ours, write_marker

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def sha256_files(paths: list[Path], root: Path) -> tuple[str, dict[str, str]]:
    """Combined digest over ``paths`` (by relative name and content) and each file's digest."""
    files = {str(p.relative_to(root)): sha256_file(p) for p in sorted(paths)}
    return combined_digest(files), files


def combined_digest(files: dict[str, str]) -> str:
    """One digest over relative names and their SHA-256s, in the dict's order."""
    return hashlib.sha256("".join(f"{k}\0{v}\n" for k, v in files.items()).encode()).hexdigest()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _leftovers(target: Path, kind: str) -> list[Path]:
    """``.NAME.<kind>-PID…`` directories next to ``target`` whose process is gone and that this user
    owns: what a killed run of ours left. Anything else with a similar name is left alone."""
    prefix = f".{target.name}.{kind}-"
    if not target.parent.is_dir():
        return []
    found = []
    for path in target.parent.glob(glob.escape(prefix) + "*"):
        pid = path.name[len(prefix) :].split("-", 1)[0]
        try:
            mine = path.is_dir() and not path.is_symlink() and path.stat().st_uid == os.getuid()
        except OSError:
            continue
        if mine and pid.isdigit() and not _pid_alive(int(pid)):
            found.append(path)
    return sorted(found)


def clean_stale_partials(target: Path) -> None:
    """Undo what killed writes to ``target`` left behind: a replaced directory (``.NAME.old-PID``) comes
    back when the run died between the two renames and ``target`` is missing; half-written
    directories (``.NAME.partial-PID-*``) and stale replaced ones are removed."""
    for old in _leftovers(target, "old"):
        if not target.exists() and not target.is_symlink():
            os.replace(old, target)
        else:
            shutil.rmtree(old, ignore_errors=True)
    for leftover in _leftovers(target, "partial"):
        shutil.rmtree(leftover, ignore_errors=True)


REPORT = "report.json"


MAX_DOCUMENT = 256 << 20
"""The most bytes a JSON document of ours (manifest.json, report.json) is read from: an artifact of 10⁵
files has a manifest of ~10 MB; a larger one was not written by compress."""


def read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when it is missing, unreadable, larger than
    ``MAX_DOCUMENT`` or not an object."""
    try:
        if path.stat().st_size > MAX_DOCUMENT:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


NOT_OURS_ADVICE = (
    f"compress replaces (with --overwrite) only an empty directory or an output of the same kind that it wrote, marked by "
    f"its {MARKER} file and holding nothing else; nothing was changed: delete it yourself or choose another directory"
)


def check_target(target: Path, overwrite: bool, kind: OutputKind | None) -> Path:
    """Check, before any heavy work, that ``target`` can be written; return it resolved.

    Refused: the current directory or one holding it; an existing path that is not an empty
    directory or an output of ours of the same ``kind`` (`not_ours`; ``kind=None`` skips that
    check, for our own caches and scratch folders); any existing path without ``overwrite``; a
    parent that cannot be created or written. Leftovers of killed writes to the same target are cleaned up first."""
    shown = target
    target = Path(target).expanduser().resolve()
    cwd = Path.cwd().resolve()
    if target == cwd or target in cwd.parents:
        raise ArtifactError(
            f"{shown}: writing there would replace the current directory (or one holding it); choose a new directory, e.g. -o out"
        )
    clean_stale_partials(target)
    if target.exists() or target.is_symlink():  # resolved: a link was followed, a dangling one stays a link
        if not target.is_dir():
            raise ArtifactError(f"{shown} exists and is not a directory; choose another output")
        if kind is not None and (why := not_ours(target, kind)) is not None:
            raise ArtifactError(f"{shown} already exists and cannot be replaced: {why}; {NOT_OURS_ADVICE}")
        if not overwrite:
            raise ArtifactError(f"{shown} already exists; pass --overwrite to replace it, or choose another directory")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=f".{target.name}.partial-{os.getpid()}-probe-", dir=target.parent))
    except OSError as exc:
        raise ArtifactError(f"cannot write {shown}: {exc.strerror or exc} ({target.parent})") from None
    return target


def claim_directory(target: Path, kind: OutputKind, overwrite: bool, resume: bool = False) -> Path:
    """Make ``target`` ready for an output written in place (a search, a benchmark), marked as
    ``kind``; return it resolved. An existing directory follows `check_target`'s rule and, being
    ours, is replaced with ``overwrite``; with ``resume`` and no ``overwrite``, an output of ours of
    the same kind is kept as it is, to be continued."""
    target = Path(target)
    if resume and not overwrite and _marked(target, kind):
        return target.expanduser().resolve()
    resolved = check_target(target, overwrite, kind)
    if resolved.exists():  # ours (or empty) and --overwrite: start afresh
        shutil.rmtree(resolved)
    resolved.mkdir(parents=True)
    write_marker(resolved, kind)
    return resolved


def _marked(target: Path, kind: OutputKind) -> bool:
    """``target`` is a non-empty output of ours of ``kind``."""
    try:
        return target.is_dir() and any(target.iterdir()) and not_ours(target, kind) is None
    except OSError:
        return False


def claim_work_directory(target: Path, kind: OutputKind) -> None:
    """A folder a run keeps next to its output between attempts (its work directory): made and
    marked when missing, used as it is when empty or ours (a killed run resumes from it), refused
    otherwise, before any work."""
    if target.exists() or target.is_symlink():
        why = "it is not a directory" if target.is_symlink() or not target.is_dir() else not_ours(target, kind)
        if why is not None:
            raise ArtifactError(
                f"{target} would hold this run's work files, but {why}; nothing was changed: delete it yourself or choose another -o"
            )
    target.mkdir(parents=True, exist_ok=True)
    if not (target / MARKER).is_file():
        write_marker(target, kind)


def remove_if_only_marked(directory: Path) -> None:
    """Remove ``directory`` when nothing but its marker is left in it; anything else stays."""
    try:
        if [p.name for p in directory.iterdir()] == [MARKER]:
            (directory / MARKER).unlink()
        directory.rmdir()
    except OSError:  # absent, or holds something else
        pass


@contextmanager
def atomic_directory(target: Path, overwrite: bool, kind: OutputKind | None) -> Iterator[Path]:
    """Yield an empty temporary directory; on success it replaces ``target`` in one rename.

    ``target`` is checked as `check_target` does, before and again after the work (something may
    have appeared there meanwhile)."""
    target = check_target(Path(target), overwrite, kind)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-{os.getpid()}-", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():
        try:
            check_target(target, overwrite, kind)
        except ArtifactError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ArtifactError(f"{target} appeared or changed while this run was writing; nothing was replaced") from None
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)


def tree_size(path: Path) -> int:
    """Bytes on disk of a file, or of every file under a folder."""
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def scratch_dir(owner: object, root: Path | None, prefix: str) -> Path:
    """A new folder under ``root`` (made if missing; None: the system temp dir), removed with
    everything in it when ``owner`` is garbage-collected (or the process exits)."""
    import shutil
    import tempfile
    import weakref

    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    weakref.finalize(owner, shutil.rmtree, str(path), True)
    return path
