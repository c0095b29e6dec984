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
    else ``os.cpu_count()``; fewer where a cgroup CPU quota allows less (a container's ``--cpus``, a
    Kubernetes CPU limit). More threads than usable CPUs make torch's OpenMP threads wait on each
    other many-fold."""
    try:
        cpus = len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(cpus, quota)) if quota else cpus


# cgroup v2: "QUOTA PERIOD" (or "max PERIOD") in one file; then v1: the quota (-1 for none) and the period.
CGROUP_CPU_FILES = (
    ("/sys/fs/cgroup/cpu.max", None),
    ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"),
)


def _cgroup_cpu_quota() -> int | None:
    """CPUs a cgroup quota allows (rounded up), or None where there is none or it cannot be read."""
    for quota_file, period_file in CGROUP_CPU_FILES:
        try:
            fields = Path(quota_file).read_text().split()
            quota, period = fields[0], fields[1] if period_file is None else Path(period_file).read_text().strip()
            if quota in ("max", "-1"):
                return None
            return -(-int(quota) // int(period))
        except (OSError, ValueError, IndexError):
            continue
    return None
