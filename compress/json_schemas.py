"""The three documents compress reads and writes, their JSON Schemas, and where those are committed.

`compress schema [recipe|manifest|report]` prints one; docs/schemas/<name>.schema.json holds each
(a test fails when a committed file differs from the generated schema). To regenerate them:

    python -m compress.json_schemas docs/schemas
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from compress.recipe import recipe_model
from compress.schema.manifest import MANIFEST_VERSION, Manifest
from compress.schema.recipe import SCHEMA_VERSION
from compress.schema.report import REPORT_VERSION, Report

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

DOCUMENTS: dict[str, Callable[[], type[BaseModel]]] = {"recipe": recipe_model, "manifest": lambda: Manifest, "report": lambda: Report}
"""Document name -> the model it is validated against, as it is at the call (the recipe's is made from the
plugin tables, so this module sits with them, above the schema package: tests/test_layers.py)."""

VERSIONS: dict[str, int] = {"recipe": SCHEMA_VERSION, "manifest": MANIFEST_VERSION, "report": REPORT_VERSION}
"""Document name -> the version this release writes (recipe: the `version` it reads)."""

SCHEMA_DIR = Path("docs") / "schemas"
"""Where the generated schemas are committed, relative to the repository root."""

REGENERATE = "python -m compress.json_schemas docs/schemas"


def file_name(name: str) -> str:
    return f"{name}.schema.json"


def _drop_defaults(node: Any) -> Any:
    """Output documents have no defaults: drop pydantic's `"default": null` of optional keys."""
    if isinstance(node, dict):
        return {k: _drop_defaults(v) for k, v in node.items() if not (k == "default" and v is None and "title" in node)}
    if isinstance(node, list):
        return [_drop_defaults(v) for v in node]
    return node


def json_schema(name: str) -> dict[str, Any]:
    """The JSON Schema of document ``name`` (recipe, manifest or report)."""
    if name not in DOCUMENTS:
        raise KeyError(f"unknown document '{name}'; known: {', '.join(DOCUMENTS)}")
    schema = DOCUMENTS[name]().model_json_schema()
    if name == "recipe":  # as `compress schema` has always printed it
        return schema
    return {"$schema": JSON_SCHEMA_DIALECT, **_drop_defaults(schema)}


def render(name: str) -> str:
    """The schema as committed: two-space indented JSON and a final newline."""
    return json.dumps(json_schema(name), indent=2) + "\n"


def write_all(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name in DOCUMENTS:
        path = directory / file_name(name)
        path.write_text(render(name), encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":
    for written in write_all(Path(sys.argv[1] if len(sys.argv) > 1 else SCHEMA_DIR)):
        print(written)
