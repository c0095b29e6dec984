"""Imports flow one way: schema <- core <- methods/exports <- eval <- app (docs/architecture.md, "Layers").

Every `import` and `from ... import` of a compress module in the source tree is read (at module level
and inside functions alike, since a function-level import is still a dependency); only imports under
`if TYPE_CHECKING:` are left out, since they never run. A module may import its own layer or a lower
one, never a higher one, and no two modules may import each other, directly or through a cycle.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def _setup_module() -> ModuleType:
    """setup.py (run by setuptools as __main__; imported here it only defines its names)."""
    spec = importlib.util.spec_from_file_location("setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SETUP = _setup_module()
# setup.py's PACKAGE_DIRS: one import namespace over sibling folders (folder -> package).
FOLDERS = {folder: package for package, folder in SETUP.PACKAGE_DIRS.items()}

SCHEMA, CORE, METHODS, EVAL, APP = range(5)
LAYER_NAMES = ("schema", "core", "methods/exports", "eval", "app")
# Modules whose layer is not their folder's: the errors every layer raises sit with the schema, and so
# does the torch-free table of block-type grids (the quantizers' own, which the recipe schema validates
# `gguf_type` against); the record type (QuantizedWeight) is a core type that lives beside the quantizers; the
# metric math and the Evaluation record are core, since every export's verifier and the repair loop
# score on them; `compress plan`'s model shapes, packed byte counts, throughputs and formulas
# (eval/plan/shapes.py, estimates.py) are core too, since every method's and format's plugin object answers the plan
# with them; the plugin tables (compress/plugins.py) gather the methods' and formats' plugin objects, and
# the recipe loader validates against those tables (and the documents' JSON Schemas, the recipe's among
# them, are generated from its model), so these sit with the methods and exports, as does
# the artifact (its model/ is written and read by the compressed-tensors format's own code); loading
# a model source (which reads quantized checkpoints through the export formats), the run's steps, the
# gate, the registry, search and the benchmarks drive whole runs and sit on top with the CLI.
OVERRIDES = {
    "compress.errors": SCHEMA,
    "compress.quantizers.grids": SCHEMA,
    "compress.plugins": METHODS,
    "compress.recipe": METHODS,
    "compress.json_schemas": METHODS,
    "compress.artifact": METHODS,
    "compress.documents": METHODS,
    "compress.quantizers.core": CORE,
    "compress.eval.metrics": CORE,
    "compress.eval.plan.shapes": CORE,
    "compress.eval.plan.estimates": CORE,
    "compress.pipeline": APP,
    "compress.gate_artifact": APP,
    "compress.mlflow_registry": APP,
    "compress.search": APP,
    "compress.model_card": APP,
    "compress.models": APP,
    "compress.cli": APP,
    "compress.cli_bench": APP,
    "compress.console": APP,
    "compress.__main__": APP,
    "compress.entry": APP,
}
FOLDER_LAYERS = {"compress.schema": SCHEMA, "compress.quantizers": METHODS, "compress.pruning": METHODS,
                 "compress.distill": METHODS, "compress.export": METHODS, "compress.eval": EVAL, "compress.steps": APP}  # fmt: skip


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            found[name] = path
    return found


def layer_of(module: str) -> int:
    if module in OVERRIDES:
        return OVERRIDES[module]
    if module.startswith("compress.eval.bench"):
        return APP  # benchmarks run whole pipelines
    for prefix, layer in FOLDER_LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return CORE


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_lines(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target not in known and "." in target:  # `from pkg import name`: the module pkg
                target = target.rpartition(".")[0]
            if target in known and target not in (name, "compress"):
                found.add((target, node.lineno))
    return found


def test_imports_go_down_the_layers_only() -> None:
    known = modules()
    upward = [
        f"{name} ({LAYER_NAMES[layer_of(name)]}) imports {target} ({LAYER_NAMES[layer_of(target)]}) at line {line}"
        for name, path in known.items()
        for target, line in sorted(imports_of(name, path, known))
        if layer_of(target) > layer_of(name)
    ]
    assert not upward, "imports against the layers (schema <- core <- methods/exports <- eval <- app):\n" + "\n".join(upward)


def test_no_module_imports_one_that_imports_it_back() -> None:
    known = modules()
    graph = {name: {target for target, _ in imports_of(name, path, known)} for name, path in known.items()}
    cycles = []
    for start in graph:  # a depth-first search for a path back to the start
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    cycles.append(" -> ".join([*trail, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*trail, nxt]))
    assert not cycles, "import cycles:\n" + "\n".join(sorted(set(cycles)))


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """The two checks above can fail: an upward import and a cycle in a made-up tree are found."""
    (tmp_path / "a.py").write_text("import compress.b\n")
    (tmp_path / "b.py").write_text("def f():\n    from compress import a\n")
    known = {"compress.a": tmp_path / "a.py", "compress.b": tmp_path / "b.py", "compress.eval.x": tmp_path / "a.py"}
    assert imports_of("compress.b", tmp_path / "b.py", known) == {("compress.a", 2)}
    assert (
        layer_of("compress.schema.recipe")
        < layer_of("compress.fsutil")
        < layer_of("compress.export.gguf")
        < layer_of("compress.eval.latency")
    )
    assert layer_of("compress.eval.latency") < layer_of("compress.cli")


def quantizer_imports_of_exports(known: dict[str, Path]) -> list[str]:
    """Imports of an export module (compress.export.*) by a quantizer module (compress.quantizers.*):
    the quantizers know grids, the exports map them to their files; what a method needs of a file (a
    size budget's bytes) it asks the ExportFormat, handed to it by the caller."""
    return [
        f"{name} imports {target} at line {line}"
        for name, path in known.items()
        if name.startswith("compress.quantizers.")
        for target, line in sorted(imports_of(name, path, known))
        if (target == "compress.export" or target.startswith("compress.export."))
    ]


def test_no_quantizer_imports_an_export() -> None:
    found = quantizer_imports_of_exports(modules())
    assert not found, "quantizers importing exports (ask the ExportFormat through the caller instead):\n" + "\n".join(found)


def test_the_checker_sees_a_quantizer_importing_an_export(tmp_path: Path) -> None:
    """The check above can fail: a made-up quantizer module that imports an export module inside a function is found."""
    (tmp_path / "q.py").write_text("def f():\n    from compress.export.gguf.layout import plan_tensors\n")
    (tmp_path / "layout.py").write_text("def plan_tensors():\n    pass\n")
    known = {"compress.quantizers.q": tmp_path / "q.py", "compress.export.gguf.layout": tmp_path / "layout.py"}
    assert quantizer_imports_of_exports(known) == ["compress.quantizers.q imports compress.export.gguf.layout at line 2"]


def test_every_package_folder_is_installed() -> None:
    """setup.py's package list names every folder with an __init__.py under the mapped folders, so a
    wheel (not only an editable install) holds every module."""
    listed = set(SETUP.packages())
    found = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert found == listed, f"missing from setup.py's packages: {sorted(found - listed)}; listed but absent: {sorted(listed - found)}"


def _defined_at_top(tree: ast.Module) -> tuple[set[str], set[str]]:
    """The names a module defines itself (def, class, assignment; under if/try too) and those it imports."""
    defined: set[str] = set()
    imported: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    defined.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                imported.update(alias.asname or alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])):
                    visit(block)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return defined, imported


def test_every_name_is_imported_from_the_module_that_defines_it() -> None:
    """No module re-exports another's names under a second path: a `from compress.X import name` (source,
    tests, scripts, docs) names the module that defines ``name`` (or a submodule of X), no `import *`
    of a compress module, and an ``__all__`` lists only names its module defines."""
    known = modules()
    defined = {name: _defined_at_top(ast.parse(path.read_text(), filename=str(path)))[0] for name, path in known.items()}
    files = [p for folder in (*FOLDERS, "tests", "scripts", "docs") for p in sorted((ROOT / folder).rglob("*.py"))]
    problems = []
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in known):
                continue
            for alias in node.names:
                if alias.name == "*":
                    problems.append(f"{where}:{node.lineno}: from {node.module} import *")
                elif alias.name not in defined[node.module] and f"{node.module}.{alias.name}" not in known:
                    problems.append(f"{where}:{node.lineno}: {alias.name} is not defined in {node.module} (import it from where it is)")
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                own = _defined_at_top(tree)[0]
                problems.extend(
                    f"{where}:{node.lineno}: __all__ lists {item.value}, which the module does not define"
                    for item in ast.walk(node.value)
                    if isinstance(item, ast.Constant) and isinstance(item.value, str) and item.value not in own
                )
    assert not problems, "re-exports (docs/architecture.md, Layers):\n" + "\n".join(problems)


def test_the_reexport_check_sees_one() -> None:
    """The check above can fail: a name a module only imports is not one it defines."""
    tree = ast.parse("from compress.schema.quantize import QuantScheme\nfrom x import *\nLIMIT = 3\ndef f(): pass\n")
    assert _defined_at_top(tree) == ({"LIMIT", "f"}, {"QuantScheme", "*"})
