"""What docs/contributing.md promises: a new quantization method or export format is one module (or
package) and one entry in its table in compress.plugins, nothing else. The method (tests/halfround.py)
and the format (tests/fake_format.py) are added here by exactly that: one ``monkeypatch.setitem`` of
the table each. Recipe validation, the JSON Schema, `compress plan` and a whole `compress run` on the
tiny model then know them; with the entries gone, the same recipe is refused with the known names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compress.plugins import EXPORT_FORMATS, QUANT_METHODS
from tests import fake_format
from tests.halfround import HALFROUND, halfround_quantize
from tests.helpers import recipe_text, run_cli, write_recipe

GATES = "  - {metric: kl_divergence, artifact: packed, max: 1.0}"


def _recipe(tmp_path: Path, model: Path, texts: Path, method: str = "halfround", fmt: str = "npz") -> Path:
    text = recipe_text(model, texts, bits=4, group_size=32, symmetric=False, gates=GATES)
    text = text.replace("method: rtn\n", f"method: {method}\n      shift: 0.5\n")
    return write_recipe(tmp_path, text.replace("exports: []\n", f"exports:\n  - {{format: {fmt}, name: packed}}\n"))


@pytest.fixture()
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The two changes: one table entry for the method, one for the format."""
    monkeypatch.setitem(QUANT_METHODS, HALFROUND.name, HALFROUND)
    monkeypatch.setitem(EXPORT_FORMATS, fake_format.NAME, fake_format.NPZ)


def test_unregistered_names_are_refused_with_the_known_ones(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    result = run_cli(["validate", _recipe(tmp_path, tiny_model_dir, text_dir)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    flat = " ".join(result.output.split())
    assert "stages[0].quantize: unknown quantization method 'halfround'; known: rtn, gptq, awq, llm_int8, w8a8, fp8" in flat, flat
    assert "exports[0]: export format 'npz' is not available; available: compressed-tensors, gptq, gguf, onnx, tensorrt" in flat


def test_a_new_method_and_format_run_end_to_end(registered: None, tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    recipe = _recipe(tmp_path, tiny_model_dir, text_dir)
    assert run_cli(["validate", recipe]).exit_code == 0

    # a misspelt name is refused with the table's names, the new ones among them
    for method, fmt, expected in [
        ("halfroud", "npz", "unknown quantization method 'halfroud'; known: rtn, gptq, awq, llm_int8, w8a8, fp8, fp4, halfround"),
        ("halfround", "nzp", "export format 'nzp' is not available; available: compressed-tensors, gptq, gguf, onnx, tensorrt, npz"),
    ]:
        result = run_cli(["validate", _recipe(tmp_path, tiny_model_dir, text_dir, method, fmt)])
        assert result.exit_code == 2 and expected in " ".join(result.output.split()), result.output

    # the recipe's JSON Schema is made from the tables too
    result = run_cli(["schema", "recipe"])
    assert result.exit_code == 0
    defs = json.loads(result.stdout)["$defs"]
    assert defs["HalfRoundConfig"]["properties"]["method"]["const"] == "halfround"
    assert defs["NPZExportConfig"]["properties"]["format"]["const"] == "npz"

    recipe = _recipe(tmp_path, tiny_model_dir, text_dir)
    planned = run_cli(["plan", recipe, "--device", "local", "--json", tmp_path / "plan.json"])
    assert planned.exit_code == 0, planned.output
    steps = {s["step"]: s for s in json.loads((tmp_path / "plan.json").read_text())["steps"]}
    assert steps["stages[0] quantize halfround"]["basis"].startswith("halfround: ")

    out = tmp_path / "out"
    result = run_cli(["run", recipe, "-o", out, "-q"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stages"][0]["method"] == "halfround" and manifest["stages"][0]["config"]["shift"] == 0.5
    (entry,) = manifest["exports"]
    assert entry["format"] == "npz" and entry["verified"] and entry["layers"] == len(manifest["quantization"]["layers"]) == 14
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] and [g["artifact"] for g in report["gates"]] == ["packed"]

    # the file holds the new method's codes: floor(w / scale + shift) on RTN's grid, layer by layer
    import torch
    from safetensors.torch import load_file

    written = fake_format.read_npz(out / "exports" / "packed" / fake_format.FILE)
    weights = {}
    for path in sorted(tiny_model_dir.glob("*.safetensors")):
        weights.update(load_file(path))
    name = "model.layers.0.mlp.down_proj"
    record = written[name]
    expected = halfround_quantize(weights[name + ".weight"].float(), record.scheme, 0.5)
    assert torch.equal(record.codes, expected.codes) and torch.equal(record.scale, expected.scale)
