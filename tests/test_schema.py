"""The torch-free schema layer: `import compress` and `compress validate` load neither torch nor
transformers, and compress/schema imports nothing heavier than pydantic and PyYAML."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_DIR = ROOT / "compress" / "schema"
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
HEAVY = ("torch", "transformers")

# What a fresh interpreter reports: which heavy packages ended up in sys.modules.
_REPORT = f"import json, sys; print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r})))"


def _heavy_modules_after(code: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", code + "\n" + _REPORT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_compress_loads_no_torch() -> None:
    assert _heavy_modules_after("import compress, compress.schema") == []


def test_schema_modules_load_no_torch() -> None:
    modules = sorted(p.stem for p in SCHEMA_DIR.glob("*.py") if p.stem != "__init__")
    code = "import importlib\n" + "\n".join(f"importlib.import_module('compress.schema.{m}')" for m in modules)
    assert _heavy_modules_after(code) == []


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.name for p in RECIPES])
def test_validate_loads_no_torch(recipe: Path) -> None:
    """The `compress validate` command, run in-process, on every shipped recipe."""
    code = ("from compress.cli import app\n"
            f"try:\n    app(['validate', {str(recipe)!r}])\n"
            "except SystemExit as exc:\n    assert exc.code in (0, None), exc.code\n")
    assert _heavy_modules_after(code) == []


def test_schema_command_loads_no_torch() -> None:
    code = ("import contextlib, io\nfrom compress.cli import app\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n        app(['schema'])\n    except SystemExit as exc:\n        assert exc.code in (0, None), exc.code\n")
    assert _heavy_modules_after(code) == []


# --------------------------------------------------------------------------- layering


ALLOWED_COMPRESS = ("compress.schema", "compress.errors")


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports (at any depth, including inside functions), with its line."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against compress.schema
                base = "compress.schema" if node.level == 1 else "compress"
                found.append((node.lineno, f"{base}.{node.module}" if node.module else base))
            elif node.module:
                found.append((node.lineno, node.module))
    return found


def test_schema_package_imports_only_schema_errors_and_light_libraries() -> None:
    """schema <- core <- methods/exports <- eval <- cli: compress/schema is the bottom layer."""
    problems = []
    for path in sorted(SCHEMA_DIR.glob("*.py")):
        for line, module in _imports(path):
            top = module.split(".")[0]
            if top in HEAVY or top in ("numpy", "safetensors", "accelerate", "gguf"):
                problems.append(f"{path.relative_to(ROOT)}:{line}: imports {module}")
            elif top == "compress" and not any(module == a or module.startswith(a + ".") for a in ALLOWED_COMPRESS):
                problems.append(f"{path.relative_to(ROOT)}:{line}: imports {module} (only compress.schema.* and compress.errors)")
    assert not problems, "compress/schema must stay torch-free and import no other compress module:\n" + "\n".join(problems)


def test_errors_module_imports_nothing_from_compress() -> None:
    """compress.errors is the one module below the schema besides the schema itself."""
    assert [m for _, m in _imports(ROOT / "compress" / "errors.py") if m.split(".")[0] in ("compress", *HEAVY)] == []
