"""The run's JSON documents (manifest.json, report.json, a search's results): checked against their
schema model, written as plain JSON, and the library versions every manifest and benchmark records."""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from compress import __version__
from compress.export.format import package_versions
from compress.plugins import EXPORT_FORMATS

VERSIONED_PACKAGES = ("torch", "transformers", "safetensors", "tokenizers", "numpy", "pydantic", "accelerate")  # + each export format's


def write_document(path: Path, obj: dict[str, Any], model: type[BaseModel]) -> None:
    """Write ``obj`` as plain JSON (json_safe) after checking it against its schema model (Manifest,
    Report): a document that does not match is a bug here, so this raises before anything is written."""
    safe = json_safe(obj)
    model.model_validate(safe)
    path.write_text(json.dumps(safe, indent=2, allow_nan=False) + "\n")


def json_safe(obj: Any) -> Any:
    """Plain-JSON copy of ``obj``: non-finite floats become the strings "inf", "-inf", "nan";
    paths and torch devices and dtypes become their names."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if obj != obj else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, Path) or type(obj).__module__ == "torch":  # torch.device, torch.dtype (torch itself is not imported here)
        return str(obj)
    return obj


def library_versions() -> dict[str, str]:
    """Python, compress and every library whose version can change a result (each export format's too)."""
    packages = [*VERSIONED_PACKAGES, *(pkg for fmt in EXPORT_FORMATS.values() for pkg in fmt.packages)]
    return {"python": platform.python_version(), "compress": __version__, **package_versions(packages)}
