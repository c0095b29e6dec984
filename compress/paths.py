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
