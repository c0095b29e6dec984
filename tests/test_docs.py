"""The docs match the code: the README's commands, its recipe reference, and the packaging."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from compress.recipe import Recipe

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def test_ci_runs_the_readme_test_command() -> None:
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    test_command = ci_lines[-1]
    assert test_command.endswith("pytest")
    assert any(block.strip() == test_command for block in _bash_blocks(README))


def test_readme_main_command_runs_the_quickstart() -> None:
    assert any(
        "compress run recipes/quickstart.yaml -o out" in block and "pip install torch==2.13.0" in block for block in _bash_blocks(README)
    )


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
    section = README.split("## Recipe reference", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    keys = {k for block in blocks for k in re.findall(r"^\s*-?\s*([a-z_0-9]+):", block, flags=re.M)}
    missing = _field_names(Recipe) - keys
    assert not missing, f"README recipe reference lacks: {sorted(missing)}"


def test_import_compress_is_cheap() -> None:
    code = "import sys, compress; print(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_readme_recipe_reference_is_a_valid_recipe(tmp_path: Path) -> None:
    from compress.recipe import load_recipe

    block = README.split("## Recipe reference", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    (tmp_path / "r.yaml").write_text(block)
    recipe = load_recipe(tmp_path / "r.yaml").recipe
    assert [g.threshold_kind for g in recipe.gates] == ["max", "min", "max_increase_pct", "max_decrease_pct"]


def test_readme_calibrated_method_examples_validate() -> None:
    import yaml

    from compress.recipe import StageSpec

    section = README.split("## Recipe reference", 1)[1].split("\n## ", 1)[0]
    stages = yaml.safe_load(re.findall(r"```yaml\n(.*?)```", section, flags=re.S)[1])["stages"]
    assert [StageSpec.model_validate(s).config.method for s in stages] == ["gptq", "awq"]
    blocks = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    kv, int8 = (yaml.safe_load(b)["stages"][0] for b in blocks[2:4])
    assert StageSpec.model_validate(kv).kind == "kv_cache" and StageSpec.model_validate(int8).config.method == "llm_int8"


def test_readme_prune_and_distill_example_validates() -> None:
    import yaml

    from compress.recipe import StageSpec

    section = README.split("## Recipe reference", 1)[1].split("\n## ", 1)[0]
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", section, flags=re.S) if "- prune:" in b)
    assert [StageSpec.model_validate(s).kind for s in yaml.safe_load(block)["stages"]] == ["prune", "distill"]
