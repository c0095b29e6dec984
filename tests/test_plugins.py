"""The export-format table (compress.plugins.EXPORT_FORMATS): a format registered through one
module and one table entry runs end to end, and no code outside a format's own package names a
format (it asks the format's plugin object, an ExportFormat)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from compress.model_card import model_card
from compress.plugins import EXPORT_FORMATS
from tests import fake_format
from tests.helpers import recipe_text, run_cli, write_recipe
from tests.test_layers import FOLDERS

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("compress", "eval", "quantizers", "pruning", "distill", "export")


# Where format names may be written: each format's own package (the folder of its plugin object's and its config's
# modules, from the table), the table itself, and the torch-free schema.
def _folder(module: str) -> str:
    """The repository folder of ``module``'s package (compress.export.gguf.plugin -> export/gguf/)."""
    package = module.rpartition(".")[0]
    for folder, name in sorted(FOLDERS.items(), key=lambda item: -len(item[1])):
        if package == name or package.startswith(name + "."):
            return folder + package[len(name) :].replace(".", "/") + "/"
    raise AssertionError(f"{module} is not in a source folder")


ALLOWED = (
    *sorted({_folder(m) for fmt in EXPORT_FORMATS.values() for m in (type(fmt).__module__, fmt.config.__module__)}),
    "compress/plugins.py",
    "compress/schema/",
)
# Names that mean something else there ("gptq" is also a quantization method), and CLI text: (file, name).
OTHER_MEANINGS = {
    ("quantizers/__init__.py", "gptq"),  # the quantization method table
    ("quantizers/gptq.py", "gptq"),  # the method's stage label
    ("quantizers/plugin.py", "gptq"),  # the GPTQ method (QUANT_METHODS)
    ("quantizers/configs.py", "gptq"),  # the GPTQ method's config
    ("quantizers/fp4_config.py", "gptq"),  # the fp4 method's `algorithm: gptq`
    ("quantizers/llmcompressor_backend.py", "gptq"),  # llm-compressor's modifier for the GPTQ method
    ("compress/search.py", "gptq"),  # the search's method cost order
    ("eval/plan/planner.py", "gptq"),  # the GPTQ method's time estimate
    ("compress/cli_bench.py", "gguf"),  # CLI text: the `compress bench gguf` command's name
    ("compress/cli_bench.py", "onnx"),  # CLI text: the `compress bench onnx` command's name
}


def _string_constants(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_no_format_name_outside_its_package() -> None:
    """Code outside export/<format>/, the table and the schema asks the ExportFormat; it never compares with a format's name."""
    names = set(EXPORT_FORMATS)
    found = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(ALLOWED):
                continue
            for line, value in _string_constants(path):
                if value in names and (rel, value) not in OTHER_MEANINGS:
                    found.append(f"{rel}:{line}: {value!r}")
    assert not found, "format names outside their packages (ask compress.plugins.EXPORT_FORMATS instead):\n" + "\n".join(found)


def test_every_format_is_consistent() -> None:
    """Each table entry's key is its ExportFormat's name and its config's ``format`` default."""
    for name, fmt in EXPORT_FORMATS.items():
        assert fmt.name == name and fmt.config.model_fields["format"].default == name
        assert fmt.runtime and fmt.intended_runtimes and fmt.description


@pytest.fixture()
def npz_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(EXPORT_FORMATS, fake_format.NAME, fake_format.NPZ)


def test_unknown_format_is_a_validation_error(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    text = recipe_text(tiny_model_dir, text_dir).replace("exports: []", "exports:\n  - {format: npz}")
    result = run_cli(["validate", write_recipe(tmp_path, text)])
    assert result.exit_code == 2 and "export format 'npz' is not available" in result.output, result.output


def test_a_format_registered_in_the_table_runs_end_to_end(
    npz_registered: None, tmp_path: Path, tiny_model_dir: Path, text_dir: Path
) -> None:
    """One module (tests/fake_format.py) and one table entry: the recipe validates, the run writes and
    verifies the export, reports it, and a gate on it reads the compressed evaluation."""
    gates = "  - {metric: kl_divergence, artifact: packed, max: 1.0}\n  - {metric: top1_agreement, artifact: packed, min: 0.0}"
    text = recipe_text(tiny_model_dir, text_dir, gates=gates).replace(
        "exports: []", "exports:\n  - {format: npz, name: packed, compressed: true}"
    )
    recipe = write_recipe(tmp_path, text)
    assert run_cli(["validate", recipe]).exit_code == 0
    planned = run_cli(["plan", recipe, "--json", tmp_path / "plan.json"])  # the format's size estimate
    assert planned.exit_code == 0, planned.output
    (size,) = [r for r in json.loads((tmp_path / "plan.json").read_text())["artifacts"] if r["artifact"] == "packed"]
    assert size["format"] == "hf" and size["basis"] == "codes + float32 scales per group" and size["size_bytes"] > 0
    result = run_cli(["run", recipe, "-o", tmp_path / "out", "-q"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    written = fake_format.read_npz(out / "exports" / "packed" / fake_format.FILE)
    manifest = json.loads((out / "manifest.json").read_text())
    (entry,) = manifest["exports"]
    assert entry["format"] == "npz" and entry["verified"] and entry["layers"] == len(written) > 0
    assert set(entry["files"]) == {fake_format.FILE}
    report = json.loads((out / "report.json").read_text())
    (reported,) = report["exports"]
    assert reported["name"] == "packed" and reported["verified"] and reported["evaluated_as"] == "compressed"
    gated = [g for g in report["gates"] if g["artifact"] == "packed"]
    assert len(gated) == 2 and all(g["passed"] for g in gated)
    assert manifest["recipe"]["expanded"]["exports"][0] == {"name": "packed", "format": "npz", "compressed": True}
    card = model_card(manifest, report, "demo", {})  # the format describes its export in the card
    assert f"| packed | npz file of {len(written)} layers' records | numpy.load (a test format) |" in card, card


def _device(name: str, runtimes: list[str], formats: list[str]) -> dict:
    return {
        "name": name,
        "description": "a made-up device",
        "kind": "cpu",
        "memory_gb": 4,
        "bandwidth_gbs": 20,
        "fp16_tflops": 0.5,
        "runtimes": runtimes,
        "formats": formats,
        "source": "made up for a test",
    }


def _with_devices(text: str, *devices: dict) -> str:
    return text.replace("exports: []", "exports:\n  - {format: npz, name: packed}") + f"devices: {json.dumps(list(devices))}\n"


def test_device_profiles_refuse_names_no_format_runs_as(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    """Device profiles list the format and runtime names of the table; a name nothing runs as is an
    error naming the profile, the key and the known names (in a recipe and in a profile file alike)."""
    from compress.errors import CompressError
    from compress.eval.devices import load_profiles
    from compress.gate_artifact import load_gates_file

    text = recipe_text(tiny_model_dir, text_dir) + f"devices: {json.dumps([_device('numpy-board', ['numpy'], ['hf'])])}\n"
    result = run_cli(["validate", write_recipe(tmp_path, text)])
    assert result.exit_code == 2, result.output
    flat = " ".join(result.output.split())
    assert "devices[0].runtimes: device profile 'numpy-board' names unknown runtime 'numpy'" in flat, result.output
    assert "known: torch, llama.cpp, onnxruntime, tensorrt" in flat, result.output
    with pytest.raises(CompressError) as exc:
        load_profiles(extra=[_device("box", ["torch"], ["npz", "gguf"])])
    assert "formats: device profile 'box' names unknown format 'npz'; known: hf, gguf, onnx, tensorrt" in str(exc.value)
    gates = tmp_path / "gates.yaml"
    gates.write_text(f"devices: {json.dumps([_device('numpy-board', ['numpy'], ['hf'])])}\ngates: [{{metric: kl_divergence, max: 1}}]\n")
    with pytest.raises(CompressError, match="devices\\[0\\].runtimes: device profile 'numpy-board' names unknown runtime 'numpy'"):
        load_gates_file(gates)


def test_a_registered_format_with_a_runtime_is_listed_by_device_profiles(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model_dir: Path, text_dir: Path
) -> None:
    """A format with a runtime of its own adds its format and runtime names (``ExportFormat.device_names``)
    to what a device profile may list, and `compress plan` asks each profile whether it runs the export."""
    monkeypatch.setitem(EXPORT_FORMATS, fake_format.NAME, fake_format.NPZ_ON_NUMPY)
    board, box = _device("numpy-board", ["numpy"], ["npz"]), _device("torch-box", ["torch"], ["hf"])
    recipe = write_recipe(tmp_path, _with_devices(recipe_text(tiny_model_dir, text_dir), board, box))
    assert run_cli(["validate", recipe]).exit_code == 0
    planned = run_cli(["plan", recipe, "--device", "numpy-board", "--device", "torch-box", "--json", tmp_path / "plan.json"])
    assert planned.exit_code == 0, planned.output
    rows = json.loads((tmp_path / "plan.json").read_text())["fit"]
    supported = {(r["device"], r["artifact"]): (r["format"], r["runtime"], r["supported"]) for r in rows}
    assert supported[("numpy-board", "packed")] == ("npz", "numpy", True)
    assert supported[("torch-box", "packed")] == ("npz", "numpy", False)
    assert supported[("numpy-board", "compressed")] == ("hf", "torch", False)
    assert supported[("torch-box", "compressed")] == ("hf", "torch", True)
