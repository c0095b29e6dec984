"""Where compress keeps its caches (reference assets, converted models), and how a model source is named."""

from __future__ import annotations

import os
import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # a model source that names a hub repository (refused offline)
CONVERTED_MARKER = "compress-source.json"  # written last into a converted GGUF's cache directory


def cache_root() -> Path:
    """``$COMPRESS_CACHE``, else ``$XDG_CACHE_HOME/compress``, else ``~/.cache/compress``."""
    if os.environ.get("COMPRESS_CACHE"):
        return Path(os.environ["COMPRESS_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "compress"


def usable_cpus() -> int:
    """The CPUs this process may run on, the default thread count everywhere: its affinity mask where
    the OS keeps one (``taskset``, a container's cpuset, each pytest-xdist worker of the test suite),
    else ``os.cpu_count()``. More threads than usable CPUs make torch's OpenMP threads wait on each
    other many-fold."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
