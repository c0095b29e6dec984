"""Atomic directory writes and file hashing.

A directory is built under a temporary name next to its target and renamed into place only
when complete, so a killed run leaves either nothing or a complete directory. Leftovers of
killed runs (``.NAME.partial-PID-*``) are removed by the next write to the same target.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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


def clean_stale_partials(target: Path) -> None:
    prefix = f".{target.name}.partial-"
    if not target.parent.is_dir():
        return
    for leftover in target.parent.glob(prefix + "*"):
        pid = leftover.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def check_target(target: Path, overwrite: bool) -> None:
    if target.exists() and not overwrite:
        raise ArtifactError(f"{target} already exists; choose another directory or pass --overwrite")


@contextmanager
def atomic_directory(target: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory; on success it replaces ``target`` in one rename."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_partials(target)
    check_target(target, overwrite)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-{os.getpid()}-", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():
        if not overwrite:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ArtifactError(f"{target} appeared while this run was writing; nothing was replaced")
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)
