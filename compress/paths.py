"""Where compress keeps its caches (reference assets, converted models)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$COMPRESS_CACHE``, else ``$XDG_CACHE_HOME/compress``, else ``~/.cache/compress``."""
    if os.environ.get("COMPRESS_CACHE"):
        return Path(os.environ["COMPRESS_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "compress"
