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
    code = (
        "from compress.cli import app\n"
        f"try:\n    app(['validate', {str(recipe)!r}])\n"
        "except SystemExit as exc:\n    assert exc.code in (0, None), exc.code\n"
    )
    assert _heavy_modules_after(code) == []


def test_schema_command_loads_no_torch() -> None:
    code = (
        "import contextlib, io\nfrom compress.cli import app\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n        app(['schema'])\n    except SystemExit as exc:\n        assert exc.code in (0, None), exc.code\n"
    )
    assert _heavy_modules_after(code) == []


# --------------------------------------------------------------------------- layering


# The quantizers' grid table (quantizers/grids.py) is the one module outside the package the schema reads: recipes
# name grids (gguf_type), and the table is the quantizers' own. It is checked by the same rules as the schema's files.
ALLOWED_COMPRESS = ("compress.schema", "compress.errors", "compress.quantizers.grids")
GRID_TABLE = ROOT / "quantizers" / "grids.py"


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
    for path in [*sorted(SCHEMA_DIR.glob("*.py")), GRID_TABLE]:
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


# --------------------------------------------------------------------------- generated JSON Schemas


@pytest.mark.parametrize("name", ["recipe", "manifest", "report"])
def test_committed_schema_is_generated(name: str) -> None:
    from compress.json_schemas import REGENERATE, SCHEMA_DIR, file_name, render

    committed = ROOT / SCHEMA_DIR / file_name(name)
    assert committed.is_file(), f"{committed} is missing; regenerate with: {REGENERATE}"
    assert committed.read_text(encoding="utf-8") == render(name), (
        f"{committed.relative_to(ROOT)} differs from the schema generated from compress.schema; regenerate with: {REGENERATE}"
    )


def test_legacy_report_schema_path_is_the_generated_schema() -> None:
    """README and users' CI point at docs/report.schema.json: it is the same generated file."""
    from compress.json_schemas import REGENERATE, render

    assert (ROOT / "docs" / "report.schema.json").read_text(encoding="utf-8") == render("report"), (
        f"docs/report.schema.json differs from the generated report schema; regenerate with: {REGENERATE} "
        "&& cp docs/schemas/report.schema.json docs/report.schema.json"
    )


@pytest.mark.parametrize("name", ["recipe", "manifest", "report"])
def test_schema_command_prints_each_document(name: str) -> None:
    from compress.json_schemas import render
    from tests.helpers import run_cli

    result = run_cli(["schema", name])
    assert result.exit_code == 0, result.output
    assert result.stdout == render(name)


def test_schema_command_defaults_to_the_recipe_and_refuses_unknown_documents() -> None:
    from compress.json_schemas import render
    from tests.helpers import run_cli

    assert run_cli(["schema"]).stdout == render("recipe")
    result = run_cli(["schema", "manifests"])
    assert result.exit_code == 2 and "recipe, manifest, report" in result.output


def test_one_version_constant_per_document() -> None:
    from compress.json_schemas import VERSIONS, json_schema

    for name, version in VERSIONS.items():
        key = "version" if name == "recipe" else "schema_version"
        assert json_schema(name)["properties"][key]["const"] == version


def test_report_literals_match_their_constants() -> None:
    import typing

    from compress.schema import recipe, report

    assert typing.get_args(report.Source) == report.SOURCES
    assert typing.get_args(report.GateSource) == report.GATE_SOURCES
    assert typing.get_args(report.EvaluationKind) == report.EVALUATION_KINDS
    assert typing.get_args(report.ThresholdKind) == report.THRESHOLD_KINDS == recipe.THRESHOLD_KEYS


def test_writers_use_the_schema_version_constants() -> None:
    """No writer spells a schema_version number itself (one constant per document, in compress/schema)."""
    import re

    pattern = re.compile(r"[\"']schema_version[\"']\s*:\s*\d")
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for d in ("compress", "eval", "export", "quantizers", "pruning", "distill")
        for p in sorted((ROOT / d).rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []


def test_manifest_and_report_models_accept_what_the_writers_build() -> None:
    """A hand-built report like the pipeline's (non-finite numbers as strings) and a gate listing validate;
    unknown top-level keys and wrong versions do not."""
    from pydantic import ValidationError

    from compress.schema.manifest import GateReportListing
    from compress.schema.report import REPORT_VERSION, Report

    report = {
        "schema_version": REPORT_VERSION,
        "recipe": None,
        "passed": False,
        "evaluations": [
            {
                "artifact": "compressed",
                "runtime": "torch",
                "device": "cpu",
                "source": "measured",
                "kind": "accuracy",
                "metrics": {"perplexity": "inf", "tokens_scored": 10},
            }
        ],
        "gates": [
            {
                "name": "g",
                "metric": "perplexity",
                "artifact": "compressed",
                "value": "nan",
                "threshold": {"kind": "max", "value": 20.0, "limit": 20.0},
                "passed": False,
                "source": "measured",
                "runtime": "torch",
                "device": "cpu",
                "message": "m",
            }
        ],
        "evaluation_data": None,
        "exports": [{"name": "gguf", "format": "gguf", "evaluated_as": None, "engine": {}}],
    }
    Report.model_validate(report)
    for bad in ({**report, "surprise": 1}, {**report, "schema_version": REPORT_VERSION + 1}):
        with pytest.raises(ValidationError):
            Report.model_validate(bad)
    GateReportListing.model_validate({"schema_version": 1, "kind": "gate-report", "artifact": "a", "files": {"report.json": "0" * 64}})
