"""The docs match the code: the README's commands, the manual (docs/, mkdocs.yml), its recipe
reference and the field list generated from the schema, and the packaging."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from compress.recipe import recipe_model, stage_model

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
# The recipe reference: the annotated YAML examples of every recipe key (docs/recipes.md).
RECIPES = (DOCS / "recipes.md").read_text()


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def _yaml_blocks(text: str) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", text, flags=re.S)


def test_ci_runs_the_readme_test_command() -> None:
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    test_command = ci_lines[-1]
    assert test_command.endswith("pytest")
    assert any(block.strip() == test_command for block in _bash_blocks(README))


def test_readme_main_command_runs_the_quickstart() -> None:
    assert any(
        "compress run recipes/quickstart.yaml -o out" in block and "pip install torch==2.13.0" in block for block in _bash_blocks(README)
    )


def test_readme_is_the_short_front_door() -> None:
    lines = len(README.splitlines())
    assert lines < 300, f"README.md has {lines} lines; keep it under 300 and move the details into docs/"


def test_readme_links_exist() -> None:
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def _field_names(model: type) -> set[str]:
    import typing

    from pydantic import BaseModel

    names: set[str] = set()
    for name, field in model.model_fields.items():
        names.add(name)
        stack = [field.annotation]
        while stack:
            ann = stack.pop()
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                names |= _field_names(ann)
            stack.extend(typing.get_args(ann))
    return names


def test_recipe_reference_documents_every_field() -> None:
    keys = {k for block in _yaml_blocks(RECIPES) for k in re.findall(r"^\s*-?\s*([a-z_0-9]+):", block, flags=re.M)}
    missing = _field_names(recipe_model()) - keys
    assert not missing, f"docs/recipes.md (the recipe reference) lacks: {sorted(missing)}"


def test_import_compress_is_cheap() -> None:
    code = "import sys, compress; print(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_recipe_reference_is_a_valid_recipe(tmp_path: Path) -> None:
    from compress.recipe import load_recipe

    (tmp_path / "r.yaml").write_text(_yaml_blocks(RECIPES)[0])
    recipe = load_recipe(tmp_path / "r.yaml").recipe
    assert [g.threshold_kind for g in recipe.gates] == ["max", "max", "min", "max_increase_pct", "max_decrease_pct", "max_decrease"]
    assert [g.on for g in recipe.gates] == ["value", "upper_95", "value", "value", "value", "value"]


def test_recipe_reference_tasks_example_validates() -> None:
    import yaml

    from compress.schema.recipe import GateConfig, TaskConfig

    block = next(yaml.safe_load(b) for b in _yaml_blocks(RECIPES) if b.startswith("tasks:"))
    tasks = [TaskConfig.model_validate(t) for t in block["tasks"]]
    assert [t.source for t in tasks] == ["reference:mmlu", "quiz.csv"] and tasks[1].choices_field == ["a", "b", "c", "d"]
    gates = [GateConfig.model_validate(g) for g in block["gates"]]
    assert [(g.task, g.threshold_kind) for g in gates] == [("mmlu", "max_decrease"), (None, "max_increase")]


def test_recipe_reference_calibrated_method_examples_validate() -> None:
    import yaml

    blocks = _yaml_blocks(RECIPES)
    stages = yaml.safe_load(blocks[1])["stages"]
    assert [stage_model().model_validate(s).config.method for s in stages] == ["gptq", "awq"]
    kv, int8 = (yaml.safe_load(b)["stages"][0] for b in blocks[2:4])
    assert stage_model().model_validate(kv).kind == "kv_cache" and stage_model().model_validate(int8).config.method == "llm_int8"


def test_recipe_reference_prune_and_distill_example_validates() -> None:
    import yaml

    block = next(b for b in _yaml_blocks(RECIPES) if "- prune:" in b)
    assert [stage_model().model_validate(s).kind for s in yaml.safe_load(block)["stages"]] == ["prune", "distill"]


def _nav_pages(nav: list) -> list[str]:
    pages = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        pages.extend(_nav_pages(value) if isinstance(value, list) else [value])
    return pages


def test_every_page_in_nav_exists_and_every_page_is_in_nav() -> None:
    import yaml

    pages = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    missing = [p for p in pages if not (DOCS / p).is_file()]
    assert not missing, f"mkdocs.yml nav names pages that do not exist under docs/: {missing}"
    on_disk = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    left_out = [p for p in on_disk if p not in pages]
    assert not left_out, f"docs/ pages missing from the nav in mkdocs.yml: {left_out}"


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip('mkdocs-material is not installed (pip install -e ".[docs]"; the dev extra includes it)')
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    assert (tmp_path / "site" / "reference" / "recipe-fields" / "index.html").is_file()


def _reference_generator():
    spec = importlib.util.spec_from_file_location("gen_recipe_reference", DOCS / "gen_recipe_reference.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(gen)
    finally:
        del sys.modules[spec.name]
    return gen


def test_recipe_field_reference_is_fresh() -> None:
    committed = (DOCS / "reference" / "recipe-fields.md").read_text(encoding="utf-8")
    assert _reference_generator().render() == committed, "docs/reference/recipe-fields.md is stale: run python docs/gen_recipe_reference.py"


def test_recipe_field_reference_lists_the_plugin_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference lists every registered method, stage kind and export format (one line each, from
    the plugin object's description) and the device profile names, generated from the tables themselves."""
    from compress.plugins import EXPORT_FORMATS, QUANT_METHODS, STAGE_KINDS
    from tests.fake_format import DESCRIPTION, NPZ_ON_NUMPY
    from tests.halfround import HALFROUND

    committed = (DOCS / "reference" / "recipe-fields.md").read_text(encoding="utf-8")
    for table in (QUANT_METHODS, STAGE_KINDS, EXPORT_FORMATS):
        for name, entry in table.items():
            assert entry.description and f"- `{name}`: {entry.description}" in committed, name
    monkeypatch.setitem(QUANT_METHODS, "halfround", HALFROUND)
    monkeypatch.setitem(EXPORT_FORMATS, "npz", NPZ_ON_NUMPY)
    text = _reference_generator().render()
    assert f"- `halfround`: {HALFROUND.description}\n" in text
    assert f"- `npz`: {DESCRIPTION} (device profiles: format `npz`, runtime `numpy`)\n" in text
    assert "- `devices[].runtimes`: `torch`, `llama.cpp`, `onnxruntime`, `tensorrt`, `numpy`\n" in text
    assert "- `devices[].formats`: `hf`, `gguf`, `onnx`, `tensorrt`, `npz`\n" in text
