"""Recipe validation: errors name the key path and the YAML line; the CLI exits 2 without a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from compress.errors import RecipeError
from compress.recipe import load_recipe
from tests.helpers import run_cli, write_recipe

ROOT = Path(__file__).resolve().parents[1]

GOOD = """\
version: 1
model:
  source: some/model
data:
  evaluation:
    source: texts/
    samples: 4
    seq_len: 64
stages:
  - quantize:
      method: rtn
      bits: 4
      group_size: 128
gates:
  - metric: kl_divergence
    max: 0.1
"""


def error_of(tmp_path: Path, text: str, overrides: list[str] | None = None) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe(write_recipe(tmp_path, text), overrides)
    return str(info.value)


def test_quickstart_is_valid() -> None:
    loaded = load_recipe(ROOT / "recipes" / "quickstart.yaml")
    q = loaded.recipe.stages[0].quantize
    assert (q.method, q.bits, q.group_size, q.symmetric) == ("rtn", 4, 128, False)
    assert loaded.recipe.gates


def test_good_recipe_defaults_are_expanded(tmp_path: Path) -> None:
    r = load_recipe(write_recipe(tmp_path, GOOD)).recipe
    assert r.stages[0].quantize.symmetric is True
    assert r.stages[0].quantize.ignore == ["lm_head"]
    assert r.gates[0].artifact == "compressed"
    assert r.data.evaluation.min_context == 32
    assert len(r.sha256()) == 64


def test_misspelled_key_names_key_and_line(tmp_path: Path) -> None:
    msg = error_of(tmp_path, GOOD.replace("      group_size: 128", "      group_sise: 128"))
    assert "recipe.yaml:13: stages[0].quantize.group_sise: unknown key 'group_sise' (did you mean 'group_size'?)" in msg


def test_misspelled_top_level_and_stage_kind(tmp_path: Path) -> None:
    msg = error_of(tmp_path, GOOD.replace("gates:", "gatez:").replace("  - quantize:", "  - quantise:"))
    assert ":10: stages[0].quantise: unknown key" in msg
    assert ":14: gatez: unknown key 'gatez' (did you mean 'gates'?)" in msg


def test_wrong_type_and_range(tmp_path: Path) -> None:
    msg = error_of(tmp_path, GOOD.replace("samples: 4", "samples: many").replace("bits: 4", "bits: 9"))
    assert ":7: data.evaluation.samples: Input should be a valid integer" in msg
    assert ":12: stages[0].quantize.bits: Input should be less than or equal to 8" in msg


def test_missing_key_points_at_parent(tmp_path: Path) -> None:
    msg = error_of(tmp_path, GOOD.replace("  source: some/model\n", "  dtype: float32\n"))
    assert ":2: model.source: required key is missing" in msg


def test_duplicate_key(tmp_path: Path) -> None:
    msg = error_of(tmp_path, GOOD.replace("      bits: 4\n", "      bits: 4\n      bits: 8\n"))
    assert "recipe.yaml:13: key 'stages[0].quantize.bits' repeats the key on line 12" in msg


def test_invalid_yaml_names_line(tmp_path: Path) -> None:
    msg = error_of(tmp_path, GOOD.replace("    max: 0.1", "    max: [0.1"))
    assert "not valid YAML" in msg and "recipe.yaml:" in msg


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (("metric: kl_divergence", "metric: kld"), "unknown metric 'kld'"),
        (("    max: 0.1", "    max: 0.1\n    min: 0.0"), "exactly one threshold"),
        (("    max: 0.1", "    max_increase_pct: 10"), "not meaningful for kl_divergence"),
        (("  - metric: kl_divergence", "  - metric: kl_divergence\n    artifact: gguf"), "gates[0].artifact 'gguf' is not an artifact"),
        (("gates:", "exports:\n  - format: openvino\ngates:"), "export format 'openvino' is not available"),
        (
            ("gates:", "exports:\n  - format: gguf\n    type: q4_k_m\n    quantizer: records\ngates:"),
            "gguf type Q4_K_M is llama.cpp's per-tensor mix",
        ),
        (("version: 1", "version: 2"), "version: Input should be 1"),
        (("      group_size: 128", "      group_size: 0"), "group_size must be a positive integer"),
    ],
)
def test_semantic_errors(tmp_path: Path, change: tuple[str, str], expected: str) -> None:
    assert expected in error_of(tmp_path, GOOD.replace(*change))


def test_gates_need_evaluation_data(tmp_path: Path) -> None:
    text = GOOD.split("data:")[0] + "stages:" + GOOD.split("stages:")[1]
    assert "gates need data.evaluation" in error_of(tmp_path, text)


def test_overrides(tmp_path: Path) -> None:
    p = write_recipe(tmp_path, GOOD)
    r = load_recipe(p, ["stages.0.quantize.bits=8", "stages.0.quantize.group_size=null", "gates.0.max=0.5", "name=x y"]).recipe
    q = r.stages[0].quantize
    assert (q.bits, q.group_size, r.gates[0].max, r.name) == (8, None, 0.5, "x y")
    msg = error_of(tmp_path, GOOD, ["stages.0.quantize.bits=eight"])
    assert "--set: stages[0].quantize.bits: Input should be a valid integer" in msg
    with pytest.raises(RecipeError, match="outside a list of 1"):
        load_recipe(p, ["stages.3=foo"])
    with pytest.raises(RecipeError, match="expected key.path=value"):
        load_recipe(p, ["stages.0.quantize.bits"])


@pytest.mark.parametrize(
    ("override", "where", "expected"),
    [
        ("seed=true", "seed", "valid integer"),
        ("data.evaluation.samples=true", "data.evaluation.samples", "valid integer"),
        ("stages.0.quantize.bits=4.0", "stages[0].quantize.bits", "valid integer"),
        ("stages.0.quantize.group_size='32'", "stages[0].quantize.group_size", "valid integer"),
        ("stages.0.quantize.symmetric=yes_please", "stages[0].quantize.symmetric", "valid boolean"),
        ("stages.0.quantize.symmetric='true'", "stages[0].quantize.symmetric", "valid boolean"),
        ("stages.0.quantize.symmetric=1", "stages[0].quantize.symmetric", "valid boolean"),
        ("version=true", "version", "true is a boolean"),
        ("model.source=7", "model.source", "valid string"),
        ("model.source=", "model.source", "is empty"),
        ("data.evaluation.source=' '", "data.evaluation.source", "is empty"),
    ],
)
def test_values_keep_their_types(tmp_path: Path, override: str, where: str, expected: str) -> None:
    """Strict types, as the docs promise: no bool for a number, no float or string for an integer, no
    string or number for a bool, no number for a string (compress/schema/base.py)."""
    result = run_cli(["validate", write_recipe(tmp_path, GOOD), "--set", override])
    assert result.exit_code == 2 and where in result.output and expected in result.output, result.output
    assert "Traceback" not in result.output


def test_a_float_key_still_takes_an_integer_and_exponents_are_numbers(tmp_path: Path) -> None:
    assert load_recipe(write_recipe(tmp_path, GOOD), ["gates.0.max=1"]).recipe.gates[0].max == 1.0
    # YAML 1.1 reads 1e-3 and 1.0e9 as text; with strict types they would be refused, so they are read as numbers
    assert load_recipe(write_recipe(tmp_path, GOOD), ["gates.0.max=1e-3"]).recipe.gates[0].max == 1e-3
    in_file = write_recipe(tmp_path, GOOD.replace("max: 0.1", "max: 1.0e9"), "exp.yaml")
    assert load_recipe(in_file).recipe.gates[0].max == 1e9


def test_gates_file_version_is_1_and_not_a_boolean(tmp_path: Path) -> None:
    from compress.errors import CompressError
    from compress.gate_artifact import load_gates_file

    for version, expected in (("true", "true is a boolean"), ("2", "Input should be 1")):
        path = tmp_path / f"gates-{version}.yaml"
        path.write_text(f"version: {version}\ngates:\n  - metric: kl_divergence\n    max: 0.1\n")
        with pytest.raises(CompressError, match=expected):
            load_gates_file(path)
    path.write_text("version: 1\ngates:\n  - metric: kl_divergence\n    max: 0.1\n")
    assert load_gates_file(path).version == 1


def test_cli_validate_exit_codes(tmp_path: Path) -> None:
    good = write_recipe(tmp_path, GOOD)
    assert run_cli(["validate", good]).exit_code == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD.replace("bits: 4", "bitz: 4"))
    result = run_cli(["validate", bad])
    assert result.exit_code == 2
    assert "stages[0].quantize.bitz" in result.output and "bad.yaml:12" in result.output
    assert run_cli(["validate", tmp_path / "missing.yaml"]).exit_code == 2


def test_cli_run_bad_recipe_exits_2_without_traceback(tmp_path: Path) -> None:
    """The real console script, as a user runs it."""
    bad = write_recipe(tmp_path, GOOD.replace("seq_len: 64", "seq_lenn: 64"))
    proc = subprocess.run(
        [sys.executable, "-m", "compress", "run", str(bad), "-o", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "data.evaluation.seq_lenn: unknown key" in proc.stderr and "recipe.yaml:8" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "out").exists()


def test_schema_command_prints_json_schema() -> None:
    result = run_cli(["schema"])
    assert result.exit_code == 0
    schema = json.loads(result.stdout)
    assert {"version", "model", "data", "stages", "exports", "gates"} <= set(schema["properties"])
