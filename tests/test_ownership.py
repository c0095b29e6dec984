"""Issue 54, items 2 and 3: a directory is ours only by the marker we write (and nothing in it the
marker does not account for), every writing command refuses any other existing directory, and an
artifact is closed: its manifest is covered by the marker's digest and names nothing outside it,
no link and no special file. Each probe exits 2 naming the problem, and leaves every foreign
file as it was, byte for byte."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from compress.errors import ArtifactError
from compress.fsutil import check_target, claim_directory, claim_work_directory, remove_if_only_marked
from compress.marker import ARTIFACT, BENCH, GATE_REPORT, KINDS, MARKER, SEARCH, WORK, not_ours, write_marker
from compress.verify import check_artifact
from tests.helpers import recipe_text, run_cli, write_recipe

pytestmark = pytest.mark.unit

Tree = dict[str, bytes]


def snapshot(root: Path) -> Tree:
    """Every file under ``root`` with its bytes (links and special files by what they are)."""
    found: Tree = {}
    for here, _, files in os.walk(root):
        for name in files:
            path = Path(here) / name
            found[path.relative_to(root).as_posix()] = path.read_bytes() if path.is_file() else b"<special>"
    return found


def plant(root: Path, tree: Tree) -> Tree:
    for rel, data in tree.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return snapshot(root)


WEB_APP: Tree = {
    "manifest.json": json.dumps({"name": "my app", "files": {"index.html": "0" * 64, "static/app.js": "1" * 64}}).encode(),
    "index.html": b"<!doctype html><title>mine</title>\n",
    "static/app.js": b"console.log('mine')\n",
}
PROJECT: Tree = {
    "report.json": json.dumps({"search": {"candidates": [], "chosen": None}}).encode(),
    "candidates/thesis.tex": b"\\documentclass{article}\n",
    "candidates/00-bits-4/notes.md": b"my notes\n",
    "src/main.py": b"print('mine')\n",
}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, text_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("ownership")
    out = root / "artifact"
    result = run_cli(["run", write_recipe(root, recipe_text(tiny_model_dir, text_dir, samples=2, cal_samples=2)), "-o", out, "-q"])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def inputs(artifact: Path, tiny_model_dir: Path, text_dir: Path) -> dict[str, Path]:
    root = artifact.parent
    gates_body = "  - {metric: kl_divergence, max: 1}\n"
    search = recipe_text(tiny_model_dir, text_dir, gates=gates_body) + "search:\n  variants:\n    stages.0.quantize.bits: [8, 4]\n"
    gates = root / "gates.yaml"
    gates.write_text("gates:\n" + gates_body)
    return {"recipe": root / "recipe.yaml", "search": write_recipe(root, search, "search.yaml"), "gates": gates, "model": tiny_model_dir}


BENCHES = ("quant", "gguf", "onnx", "prune", "kv", "memory")  # and latency, which takes an artifact


def _bench(name: str) -> Callable[[dict[str, Path], Path, Path], list]:
    return lambda i, art, out: ["bench", name, "-o", out, "--model", i["model"]]


WRITERS: dict[str, Callable[[dict[str, Path], Path, Path], list]] = {
    "run": lambda i, art, out: ["run", i["recipe"], "-o", out],
    "search": lambda i, art, out: ["run", i["search"], "-o", out],
    "gate": lambda i, art, out: ["gate", art, "--gates", i["gates"], "-o", out],
    "pull": lambda i, art, out: ["pull", "mine@prod", "-o", out, "--store", art.parent / "registry"],
    **{f"bench {name}": _bench(name) for name in BENCHES},
    "bench latency": lambda i, art, out: ["bench", "latency", art, "-o", out],
    "export-encoder": lambda i, art, out: ["export-encoder", i["model"], "-o", out],
}
"""Every command that writes a directory, as its arguments with ``out`` as the directory."""
WRITES_ARTIFACTS = {"run", "pull"}  # may replace another artifact of ours with --overwrite


def foreign_dirs(artifact: Path, root: Path, command: str) -> dict[str, Path]:
    """Directories ``command`` must not replace: a web app with a manifest.json listing its files,
    a project with candidates/, an artifact of ours with a user's file added (its marker copied
    along), and for commands writing other kinds, an intact artifact."""
    made = {}
    for name, tree in (("web-app", WEB_APP), ("project", PROJECT)):
        made[name] = root / name
        plant(made[name], tree)
    made["artifact-with-notes"] = root / "artifact-with-notes"
    shutil.copytree(artifact, made["artifact-with-notes"])
    (made["artifact-with-notes"] / "notes.txt").write_text("mine\n")
    if command not in WRITES_ARTIFACTS:
        made["another-artifact"] = root / "another-artifact"
        shutil.copytree(artifact, made["another-artifact"])
    return made


@pytest.mark.parametrize("command", list(WRITERS))
def test_no_writing_command_replaces_a_directory_it_did_not_write(
    command: str, artifact: Path, inputs: dict[str, Path], tmp_path: Path
) -> None:
    for name, directory in foreign_dirs(artifact, tmp_path, command).items():
        before = snapshot(directory)
        for overwrite in ([], ["--overwrite"]):
            result = run_cli([*WRITERS[command](inputs, artifact, directory), *overwrite])
            assert result.exit_code == 2, (command, name, overwrite, result.output)
            assert "cannot be replaced" in result.output and "delete it yourself" in result.output, (command, name, result.output)
            assert "Traceback" not in result.output
            assert snapshot(directory) == before, (command, name, overwrite)
    if command in WRITES_ARTIFACTS:  # the added file is named
        assert "notes.txt" in run_cli([*WRITERS[command](inputs, artifact, tmp_path / "artifact-with-notes")]).output


def test_gate_replaces_only_a_gate_report_of_ours_and_only_with_overwrite(artifact: Path, inputs: dict[str, Path], tmp_path: Path) -> None:
    report = tmp_path / "report"
    report.mkdir()
    (report / "report.json").write_text("{}")
    shutil.copy(artifact / "manifest.json", report / "manifest.json")
    (report / MARKER).write_text(json.dumps({"compress_output": 1, "kind": "gate-report", "manifest_sha256": "0" * 64}))
    assert "not the one compress wrote" in (not_ours(report, GATE_REPORT) or "")  # a marker that does not hold its manifest
    write_marker(report, GATE_REPORT)
    assert not_ours(report, GATE_REPORT) is None
    refused = run_cli(["gate", artifact, "--gates", inputs["gates"], "-o", report])
    assert refused.exit_code == 2 and "already exists; pass --overwrite" in refused.output, refused.output
    assert "it is a gate report, not an artifact" in (not_ours(report, ARTIFACT) or "")


def test_check_target_rules(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert check_target(tmp_path / "empty", True, ARTIFACT) == (tmp_path / "empty").resolve()
    (tmp_path / "ours").mkdir()
    write_marker(tmp_path / "ours", BENCH)
    (tmp_path / "ours" / "results.json").write_text("{}")
    check_target(tmp_path / "ours", True, BENCH)
    with pytest.raises(ArtifactError, match="already exists; pass --overwrite"):
        check_target(tmp_path / "ours", False, BENCH)
    with pytest.raises(ArtifactError, match="it is a benchmark's results, not a recipe search"):
        check_target(tmp_path / "ours", True, SEARCH)
    (tmp_path / "ours" / "thesis.tex").write_text("mine")
    with pytest.raises(ArtifactError, match="holds files compress did not write there: thesis.tex"):
        check_target(tmp_path / "ours", True, BENCH)
    (tmp_path / "link").symlink_to(tmp_path / "ours")  # a link is followed: what it points at decides
    with pytest.raises(ArtifactError, match="cannot be replaced"):
        check_target(tmp_path / "link", True, BENCH)
    (tmp_path / "file").write_text("mine")
    with pytest.raises(ArtifactError, match="not a directory"):
        check_target(tmp_path / "file", True, BENCH)
    assert (tmp_path / "file").read_text() == "mine" and (tmp_path / "ours" / "thesis.tex").read_text() == "mine"


def test_a_search_resumes_only_a_search_of_ours_and_its_candidates_must_be_ours(tmp_path: Path) -> None:
    out = claim_directory(tmp_path / "s", SEARCH, overwrite=False, resume=True)
    (out / "report.json").write_text("{}")
    (out / "candidates" / ".00-x.partial-123-abc").mkdir(parents=True)  # a killed candidate's leftovers
    claim_work_directory(out / "candidates" / "00-x.work", WORK)
    (out / "candidates" / "00-x.work" / "stages[0]").mkdir()
    assert claim_directory(out, SEARCH, overwrite=False, resume=True) == out and (out / "report.json").is_file()
    (out / "candidates" / "00-x").mkdir()
    (out / "candidates" / "00-x" / "thesis.tex").write_text("mine")
    with pytest.raises(ArtifactError, match="candidates/00-x"):
        claim_directory(out, SEARCH, overwrite=True, resume=True)
    assert (out / "candidates" / "00-x" / "thesis.tex").read_text() == "mine"


def test_a_run_keeps_its_work_files_only_in_a_work_directory_of_its_own(inputs: dict[str, Path], tmp_path: Path) -> None:
    work = tmp_path / "out.work"
    before = plant(work, {"records/mine.txt": b"mine\n", "overlay/app.js": b"mine\n"})
    result = run_cli(["run", inputs["recipe"], "-o", tmp_path / "out"])
    assert result.exit_code == 2 and "would hold this run's work files, but it has no .compress-output marker" in result.output
    assert snapshot(work) == before and not (tmp_path / "out").exists()
    claim_work_directory(tmp_path / "ours.work", WORK)  # a killed run's: used again, and removed once nothing but the marker is left
    (tmp_path / "ours.work" / "stages[0]").mkdir()
    assert claim_work_directory(tmp_path / "ours.work", WORK) is None and (tmp_path / "ours.work" / "stages[0]").is_dir()
    (tmp_path / "ours.work" / "stages[0]").rmdir()
    remove_if_only_marked(tmp_path / "ours.work")
    assert not (tmp_path / "ours.work").exists()


NAMES = st.sampled_from(["manifest.json", "report.json", "candidates", "index.html", "results.json", "model", "plots", "src", "a.txt"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tree=st.dictionaries(st.lists(NAMES, min_size=1, max_size=3).map("/".join), st.binary(max_size=64), min_size=1, max_size=6),
    kind=st.sampled_from(sorted(KINDS)),
    copied_marker=st.booleans(),
)
def test_a_directory_without_our_marker_or_with_files_it_does_not_name_is_never_replaced(
    tree: dict[str, bytes], kind: str, copied_marker: bool, artifact: Path
) -> None:
    tree = {rel: data for rel, data in tree.items() if not any(rel.startswith(other + "/") for other in tree)}  # a file is no folder
    if copied_marker:  # the copied manifest takes its place
        tree = {rel: data for rel, data in tree.items() if rel.split("/")[0] != "manifest.json"}
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "theirs"
        before = plant(target, tree)
        if copied_marker:  # an artifact's marker and manifest copied in: the user's files are still not named by it
            named = set(json.loads((artifact / "manifest.json").read_text())["files"]) | {"manifest.json", MARKER}
            assume(any(rel not in named for rel in tree))
            for name in (MARKER, "manifest.json"):
                shutil.copy(artifact / name, target / name)
            before = snapshot(target)
        for overwrite in (False, True):
            with pytest.raises(ArtifactError, match="cannot be replaced"):
                claim_directory(target, KINDS[kind], overwrite, resume=True)
        assert snapshot(target) == before


# --- artifacts are closed -----------------------------------------------------------------------


@pytest.fixture()
def copy(artifact: Path, tmp_path: Path) -> Path:
    shutil.copytree(artifact, tmp_path / "copy")
    return tmp_path / "copy"


def edit_manifest(root: Path, change: Callable[[dict], None], remark: bool = False) -> None:
    """Change manifest.json; with ``remark``, write the marker anew (a forger who knows the format)."""
    manifest = json.loads((root / "manifest.json").read_text())
    change(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2))
    if remark:
        write_marker(root, ARTIFACT)


def _layer(m: dict) -> dict:
    return next(iter(m["quantization"]["layers"].values()))["scheme"]


EDITS: dict[str, Callable[[dict], None]] = {
    "source": lambda m: m["model"].update(source="/elsewhere/another-model"),
    "evaluation": lambda m: m["recipe"]["expanded"]["data"]["evaluation"].update(source="/elsewhere/other.txt"),
    "scheme": lambda m: _layer(m).update(bits=8),
    "weights_format": lambda m: m["quantization"].update(weights_format="compress-quantized-v1"),
    "exports": lambda m: m.update(exports=[{"name": "q4", "format": "gguf", "path": "exports/q4", "files": {}}]),
}
OUTSIDE_MESSAGE = "names paths outside the artifact"
FORGED: dict[str, tuple[Callable[[dict], None], str]] = {
    "export path ../outside": (lambda m: m.update(exports=[{"name": "q4", "format": "gguf", "path": "../outside/x"}]), OUTSIDE_MESSAGE),
    "absolute export path": (lambda m: m.update(exports=[{"name": "q4", "format": "gguf", "path": "/tmp/x"}]), OUTSIDE_MESSAGE),
    "export file a/../../x": (
        lambda m: m.update(exports=[{"name": "q4", "format": "gguf", "path": "exports", "files": {"a/../../x": "0"}}]),
        OUTSIDE_MESSAGE,
    ),
    "absolute file": (lambda m: m["files"].update({"/etc/passwd": "0" * 64}), OUTSIDE_MESSAGE),
    "exports not a list": (lambda m: m.update(exports="exports/q4"), "`exports` is not a list of export entries"),
}
"""Manifests edited with the marker written anew to match (a forger who knows the format): still refused."""


def refusals(root: Path, inputs: dict[str, Path]) -> dict[str, object]:
    """verify, gate and publish on ``root``: each must exit 2 before any work."""
    return {
        "verify": run_cli(["verify", root]),
        "gate": run_cli(["gate", root, "--gates", inputs["gates"], "-o", root.parent / "report", "-q"]),
        "publish": run_cli(["publish", root, "--store", root.parent / "registry", "-q"]),
    }


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_manifest_is_refused_by_verify_gate_and_publish(edit: str, copy: Path, inputs: dict[str, Path]) -> None:
    edit_manifest(copy, EDITS[edit])
    for command, result in refusals(copy, inputs).items():
        assert result.exit_code == 2, (command, result.output)
        assert "manifest.json is not the one compress wrote" in result.output and "Traceback" not in result.output, result.output
    assert not (copy.parent / "report").exists() and not (copy.parent / "registry").exists()


@pytest.mark.parametrize("edit", list(FORGED))
def test_a_path_outside_the_artifact_is_refused_even_with_a_forged_marker(edit: str, copy: Path, inputs: dict[str, Path]) -> None:
    change, expected = FORGED[edit]
    edit_manifest(copy, change, remark=True)
    for command, result in refusals(copy, inputs).items():
        assert result.exit_code == 2, (command, result.output)
        assert expected in result.output and "Traceback" not in result.output, (command, result.output)


def _symlink(root: Path) -> str:
    target = root / "recipe.yaml"
    shutil.copy(target, root.parent / "recipe-elsewhere.yaml")
    target.unlink()
    target.symlink_to(root.parent / "recipe-elsewhere.yaml")  # the same bytes, through a link
    return "links, not files: recipe.yaml"


def _fifo(root: Path) -> str:
    os.mkfifo(root / "model" / "pipe")
    return "special files (FIFOs, devices, sockets), not files: model/pipe"


def _linked_folder(root: Path) -> str:
    shutil.move(root / "model", root.parent / "model-elsewhere")
    (root / "model").symlink_to(root.parent / "model-elsewhere", target_is_directory=True)
    return "links, not files: model"


@pytest.mark.parametrize("make", [_symlink, _fifo, _linked_folder], ids=["symlink", "fifo", "linked-folder"])
def test_links_and_special_files_are_refused(make: Callable[[Path], str], copy: Path, inputs: dict[str, Path]) -> None:
    expected = make(copy)
    for command, result in refusals(copy, inputs).items():
        assert result.exit_code == 2 and expected in result.output, (command, result.output)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(at=st.floats(0, 1, exclude_max=True), byte=st.integers(0, 255))
def test_any_change_to_the_manifest_bytes_is_refused(at: float, byte: int, artifact: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "a"
        shutil.copytree(artifact, root)
        data = bytearray((root / "manifest.json").read_bytes())
        i = int(at * len(data))
        data[i] = byte if byte != data[i] else (byte + 1) % 256
        (root / "manifest.json").write_bytes(bytes(data))
        with pytest.raises(ArtifactError, match="manifest.json"):
            check_artifact(root)


def test_the_marker_binds_the_manifest_and_is_not_part_of_the_content(artifact: Path) -> None:
    contents = check_artifact(artifact)
    marker = json.loads((artifact / MARKER).read_text())
    assert marker == {"compress_output": 1, "kind": "artifact", "manifest_sha256": contents.files["manifest.json"]}
    assert MARKER not in contents.files and not_ours(artifact, ARTIFACT) is None
    assert not artifact.with_name("artifact.work").exists()  # the run's work directory went with its scratch
