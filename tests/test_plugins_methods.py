"""The plugin tables of quantization methods and stage kinds (compress.plugins): a method added
by one module (tests/halfround.py) and one table entry runs end to end (validate, plan, run,
export, verify, gates), and a name missing from a table is a clear error, never a fall-through."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from compress.errors import CompressError
from compress.plugins import QUANT_METHODS, STAGE_KINDS
from compress.quantizers.configs import AWQConfig, GPTQConfig, LLMInt8Config, RTNConfig, W8A8Config
from compress.recipe import load_recipe, recipe_model, stage_model
from compress.schema.quantize import WeightQuantConfig
from tests.halfround import HALFROUND, HalfRoundConfig
from tests.helpers import recipe_text, run_cli, write_recipe

GATES = """\
  - name: kl
    metric: kl_divergence
    max: 0.01
  - name: ct-kl
    metric: kl_divergence
    artifact: ct
    max: 0.01
"""  # RTN at W4 g32 asym measures KL 0.00023 on the tiny model; halfround differs only at exact halves


def halfround_recipe(tmp_path: Path, model: Path, texts: Path) -> Path:
    text = recipe_text(model, texts, bits=4, group_size=32, symmetric=False, gates=GATES)
    text = text.replace("method: rtn\n", "method: halfround\n      shift: 0.5\n")
    text = text.replace("exports: []\n", "exports:\n  - format: compressed-tensors\n    name: ct\n")
    return write_recipe(tmp_path, text)


def test_tables_match_the_schema() -> None:
    """The recipe's stage keys are the stage kinds' table, and every built-in method's QuantMethod uses its config."""
    assert set(STAGE_KINDS) == set(stage_model().model_fields)
    assert all(name == entry.name for name, entry in {**QUANT_METHODS, **STAGE_KINDS}.items())
    builtin = {"rtn": RTNConfig, "gptq": GPTQConfig, "awq": AWQConfig, "llm_int8": LLMInt8Config, "w8a8": W8A8Config}
    for name, config in builtin.items():
        assert QUANT_METHODS[name].config is config and config.model_fields["method"].default == name
    assert sorted(QUANT_METHODS, key=lambda m: QUANT_METHODS[m].cost) == ["rtn", "llm_int8", "w8a8", "fp8", "fp4", "awq", "gptq"]
    assert all(issubclass(method.config, WeightQuantConfig) for method in [*QUANT_METHODS.values(), HALFROUND])


def test_a_method_registered_in_one_entry_runs_end_to_end(
    tmp_path: Path, tiny_model_dir: Path, text_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(QUANT_METHODS, "halfround", HALFROUND)
    recipe = halfround_recipe(tmp_path, tiny_model_dir, text_dir)

    loaded = load_recipe(recipe)
    config = loaded.recipe.stages[0].config
    assert isinstance(config, HalfRoundConfig) and config.shift == 0.5
    assert loaded.recipe.model_dump(mode="json")["stages"][0]["quantize"]["shift"] == 0.5
    result = run_cli(["validate", recipe])
    assert result.exit_code == 0, result.output

    plan_json = tmp_path / "plan.json"
    result = run_cli(["plan", recipe, "--device", "local", "--json", plan_json])
    assert result.exit_code == 0, result.output
    steps = {s["step"]: s for s in json.loads(plan_json.read_text())["steps"]}
    assert steps["stages[0] quantize halfround"]["basis"].startswith("halfround: ")

    out = tmp_path / "out"
    result = run_cli(["run", recipe, "-o", out])
    assert result.exit_code == 0, result.output
    assert "stages[0] quantize halfround: 14 layers" in result.stdout
    report = json.loads((out / "report.json").read_text())
    assert [(e["name"], e["format"], e["verified"]) for e in report["exports"]] == [("ct", "compressed-tensors", True)]
    assert report["exports"][0]["check"].startswith("records identical after reload")
    assert report["passed"] and all(g["passed"] for g in report["gates"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stages"][0]["method"] == "halfround" and manifest["stages"][0]["config"]["shift"] == 0.5
    assert manifest["recipe"]["expanded"]["stages"][0]["quantize"]["method"] == "halfround"
    layers = manifest["quantization"]["layers"]
    assert len(layers) == 14 and {info["stage"] for info in layers.values()} == {"stages[0]"}
    assert manifest["exports"][0]["verified"] and manifest["exports"][0]["layers"] == 14


def test_the_fake_method_rounds_halves_up() -> None:
    import torch

    from compress.quantizers.rtn import rtn_quantize
    from tests.halfround import halfround_quantize

    scheme = HalfRoundConfig(bits=4, group_size=None, symmetric=True).scheme()
    weight = torch.tensor([[-7.5, -4.5, 0.5, 2.5]])  # scale 2 * 7.5 / 15 = 1: every weight is an exact half
    assert halfround_quantize(weight, scheme).codes.tolist() == [[1, 4, 9, 11]]  # floor(w + 0.5) + 8: halves go up
    assert rtn_quantize(weight, scheme).codes.tolist() == [[0, 4, 8, 10]]  # torch.round: halves to even


def test_unregistered_method_is_a_validation_error(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    recipe = halfround_recipe(tmp_path, tiny_model_dir, text_dir)
    result = run_cli(["validate", recipe])
    assert result.exit_code == 2
    assert "stages[0].quantize: unknown quantization method 'halfround'; known: rtn, gptq, awq, llm_int8, w8a8, fp8" in result.output
    assert "Traceback" not in result.output


@contextmanager
def _removed(table: dict, name: str) -> Iterator[None]:
    """The table without ``name`` inside the block, then as it was, in its order (monkeypatch.delitem
    would put the entry back last, and the order shows in messages and in the generated reference)."""
    saved = dict(table)
    del table[name]
    try:
        yield
    finally:
        table.clear()
        table.update(saved)


def test_method_removed_from_the_table_is_unknown(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    from compress.steps.stages import build_stages

    recipe = write_recipe(tmp_path, recipe_text(tiny_model_dir, text_dir))
    loaded = load_recipe(recipe)
    with _removed(QUANT_METHODS, "rtn"):
        result = run_cli(["validate", recipe])
        assert result.exit_code == 2 and "unknown quantization method 'rtn'; known: gptq, awq, llm_int8" in result.output
        with pytest.raises(
            CompressError, match=r"stages\[0\]: quantization method 'rtn' is not registered in compress.plugins.QUANT_METHODS"
        ):
            build_stages(loaded.recipe)  # validated before the method left the table: the run still refuses it by name


def test_stage_kind_missing_from_the_table_is_an_error(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    from compress.steps.stages import build_stages

    recipe = write_recipe(tmp_path, recipe_text(tiny_model_dir, text_dir))
    loaded = load_recipe(recipe)
    with _removed(STAGE_KINDS, "quantize"):
        with pytest.raises(
            CompressError, match=r"stages\[0\]: stage kind 'quantize' is not registered .*; known: prune, distill, kv_cache, rotate, draft"
        ):
            build_stages(loaded.recipe)
        result = run_cli(["plan", recipe, "--device", "local"])  # the recipe's stage keys are the table's: refused on validation
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "stages[0].quantize: unknown key 'quantize' (allowed: prune, distill, kv_cache, rotate, draft)" in result.output, result.output


CAL = {"source": "t", "samples": 2, "seq_len": 16}
EVAL = {"source": "t", "samples": 2, "seq_len": 64, "min_context": 8}
RTN_STAGE = {"quantize": {"method": "rtn", "bits": 4}}


@pytest.mark.parametrize(
    ("data", "stages", "message"),
    [
        ({}, [{"prune": {"mlp": 0.25}}], "stages[0] (prune) needs data.calibration"),
        ({}, [{"distill": {"steps": 100}}], "stages[0] (distill) needs data.calibration (or its own distill.data.source)"),
        (
            {"calibration": CAL},
            [{"distill": {"steps": 100}}],
            "stages[0] (distill) scores the student on held-apart text and needs data.evaluation",
        ),
        (
            {"calibration": CAL, "evaluation": EVAL},
            [RTN_STAGE, {"distill": {"steps": 100}}],
            "stages[1] (distill) comes after stages[0] (quantize); distill changes float weights, so put it before quantization",
        ),
        (
            {"calibration": CAL, "evaluation": EVAL},
            [RTN_STAGE, {"prune": {"mlp": 0.25}}],
            "stages[1] (prune) comes after stages[0] (quantize); prune changes float weights, so put it before quantization",
        ),
        (
            {},
            [{"kv_cache": {"static_scales": True, "evaluate": None}}],
            "stages[0] (kv_cache) calibrates static scales and needs data.calibration",
        ),
        (
            {"calibration": CAL, "evaluation": EVAL},
            [{"kv_cache": {}}, {"kv_cache": {}}],
            "stages [0, 1] are all kv_cache stages; a recipe has at most one",
        ),
    ],
)
def test_stage_kind_rules_come_from_their_configs(data: dict, stages: list, message: str) -> None:
    """Recipe-level rules of each kind (data it needs, order, at most one) are asked of the stage's
    config (compress.schema.base.BaseStageConfig), with the messages they always had."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        recipe_model().model_validate({"version": 1, "model": {"source": "m"}, "data": data, "stages": stages})
    assert info.value.errors()[0]["msg"] == f"Value error, {message}"
