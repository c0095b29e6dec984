"""Atomic directory writes and file hashing.

A directory is built under a temporary name next to its target and renamed into place only
when complete, so a killed run leaves either nothing or a complete directory. Leftovers of
killed runs (``.NAME.partial-PID-*``) are removed by the next write to the same target, and a
directory a killed run was replacing (``.NAME.old-PID``) is put back when the target is missing.
``--overwrite`` replaces only an empty directory or one we wrote (`written_by_us`).
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


MANIFEST = "manifest.json"
REPORT = "report.json"


def read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def written_by_us(directory: Path) -> bool:
    """An empty directory, or one of ours: a manifest.json listing its files (an artifact, a pulled
    version, a gate report), or a recipe search (report.json with a `search` entry)."""
    try:
        if not any(directory.iterdir()):
            return True
    except OSError:
        return False
    manifest = read_json_object(directory / MANIFEST)
    if manifest is not None and isinstance(manifest.get("files"), dict):
        return True
    report = read_json_object(directory / REPORT)
    return report is not None and isinstance(report.get("search"), dict)


def check_target(target: Path, overwrite: bool, owned: bool = True) -> Path:
    """Check, before any heavy work, that ``target`` can be written; return it resolved.

    Refused: the current directory or one holding it; an existing path without ``overwrite``;
    with ``overwrite``, anything but an empty directory or one of ours (``owned=False`` skips that
    check, for our own caches); a parent that cannot be created or written. Leftovers of killed
    writes to the same target are cleaned up first."""
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
        if not overwrite:
            raise ArtifactError(f"{shown} already exists; choose another directory or pass --overwrite")
        if owned and not written_by_us(target):
            raise ArtifactError(
                f"{shown} holds files that are not a compress output (no readable {MANIFEST}); --overwrite "
                "replaces only an artifact, pulled version, gate report or search of ours, or an empty directory"
            )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=f".{target.name}.partial-{os.getpid()}-probe-", dir=target.parent))
    except OSError as exc:
        raise ArtifactError(f"cannot write {shown}: {exc.strerror or exc} ({target.parent})") from None
    return target


@contextmanager
def atomic_directory(target: Path, overwrite: bool = False, owned: bool = True) -> Iterator[Path]:
    """Yield an empty temporary directory; on success it replaces ``target`` in one rename.

    ``target`` is checked as `check_target` does, before and again after the work (something may
    have appeared there meanwhile)."""
    target = check_target(Path(target), overwrite, owned)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-{os.getpid()}-", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():
        try:
            check_target(target, overwrite, owned)
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
