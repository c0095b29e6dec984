"""Hostile and careless input: every probe exits 2 with a message naming the key or file, nothing
a user wrote is deleted, and an artifact altered after its run is never gated or published."""

from __future__ import annotations

import json
import os
import shutil
import tracemalloc
from pathlib import Path

import pytest

from compress.errors import ModelLoadError, RecipeError
from compress.fsutil import clean_stale_partials
from compress.inputs import check_json, check_safetensors
from compress.recipe import load_recipe
from tests.helpers import recipe_text, run_cli, write_recipe

pytestmark = pytest.mark.unit

MINIMAL = "version: 1\nmodel: {source: some/dir}\n"


def _bomb(levels: int = 9) -> str:
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]")
    return MINIMAL + "\n".join(lines) + "\n"


def test_alias_bomb_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    path = write_recipe(tmp_path, _bomb())  # 9**9 (387 million) strings once expanded
    tracemalloc.start()
    try:
        with pytest.raises(RecipeError, match="expands to more than 100,000 values"):
            load_recipe(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, f"peak {peak / 2**20:.1f} MiB"


def test_alias_bomb_through_the_cli_exits_2(tmp_path: Path) -> None:
    path = write_recipe(tmp_path, _bomb())
    for command in (["validate", path], ["plan", path], ["run", path, "-o", tmp_path / "out"]):
        result = run_cli(command)
        assert result.exit_code == 2 and "expands to more than" in result.output, (command, result.output)
    gates = write_recipe(tmp_path, _bomb().replace(MINIMAL, "gates: [{metric: kl_divergence, max: 1}]\n"), "gates.yaml")
    result = run_cli(["gate", tmp_path / "anything", "--gates", gates, "-o", tmp_path / "report"])
    assert result.exit_code == 2 and "expands to more than" in result.output, result.output


def test_a_few_anchors_still_work(tmp_path: Path) -> None:
    text = MINIMAL + "data:\n  calibration: &text {source: a.txt, samples: 2, seq_len: 64}\n  evaluation: *text\n"
    recipe = load_recipe(write_recipe(tmp_path, text)).recipe
    assert recipe.data.evaluation.samples == 2 and recipe.data.calibration.source == "a.txt"


@pytest.mark.parametrize(
    "text, message",
    [
        ("version: 1\x00\nmodel: {source: x}\n", r"recipe.yaml:1: control character '\\x00'"),
        ('version: 1\nmodel: {source: "a\\x01b"}\n', r"recipe.yaml:2: model.source holds the control character '\\x01'"),
        ('version: 1\nname: "\\0"\nmodel: {source: x}\n', r"name holds the control character '\\x00'"),
        ("version: 1\x1b[31m\n", "control character"),
        ("version: 1\nmodel: {source: x}\nx: " + "[" * 200 + "]" * 200 + "\n", "nested deeper than 64 levels"),
        (
            "version: 1\nmodel: {source: x}\nx:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 201)) + "  " * 201 + "v: 1\n",
            "nested deeper than 64 levels",
        ),
        ("version: 1\nmodel: {source: x}\nwhen: 2024-02-30\n", "a value cannot be read"),
        ("version: 1\nmodel: {source: x}\n? [a, b]\n: c\n", "not valid YAML"),
        ("version: 1\nmodel: {source: x}\nx: !!python/object:os.system {}\n", "not valid YAML"),
        ("- just\n- a list\n", "a recipe is a YAML mapping"),
        ("", "a recipe is a YAML mapping"),
        ("version: 1\n  bad: indent\n", "recipe.yaml:2: not valid YAML"),
    ],
)
def test_malformed_yaml_is_one_clear_error(tmp_path: Path, text: str, message: str) -> None:
    path = write_recipe(tmp_path, text)
    with pytest.raises(RecipeError, match=message):
        load_recipe(path)
    result = run_cli(["validate", path])
    assert result.exit_code == 2 and "Traceback" not in result.output and "unexpected failure" not in result.output


def test_huge_and_binary_recipe_files_are_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text(MINIMAL + "# " + "x" * (1 << 20) + "\n")
    with pytest.raises(RecipeError, match="at most 1,048,576 are read"):
        load_recipe(big)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"version: 1\n\xff\xfe\x00")
    with pytest.raises(RecipeError, match="not UTF-8"):
        load_recipe(binary)
    with pytest.raises(RecipeError, match="not a regular file"):
        load_recipe(tmp_path)


@pytest.mark.parametrize(
    "override, message",
    [
        ("seed=99999999999999999999999", "seed: Input should be less than or equal to 4294967295"),
        ("seed=-1", "seed: Input should be greater than or equal to 0"),
        ("data.evaluation.samples=10000000000", "data.evaluation.samples: 10000000000 is out of range"),
        ("stages.0.quantize.group_size=100000000000000", "group_size: 100000000000000 is out of range"),
        ("gates.0.max=.nan", "gates[0].max: Input should be a finite number"),
        ("gates.0.max=.inf", "gates[0].max: Input should be a finite number"),
        ("data.holdout=.nan", "data.holdout: Input should be a finite number"),
        ("stages.0.quantize.bits=1e400", "stages[0].quantize.bits"),
        ("stages.²=1", "stages"),
        ("stages..bits=1", "empty part"),
    ],
)
def test_numbers_out_of_range_fail_validation(tmp_path: Path, override: str, message: str) -> None:
    gates = "  - metric: kl_divergence\n    max: 1\n"
    path = write_recipe(tmp_path, recipe_text("some/dir", "texts", gates=gates))
    with pytest.raises(RecipeError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        load_recipe(path, [override])


def test_llm_int8_keeps_an_infinite_threshold(tmp_path: Path) -> None:
    text = MINIMAL + "stages:\n  - quantize: {method: llm_int8, threshold: .inf}\n"
    assert load_recipe(write_recipe(tmp_path, text)).recipe.stages[0].config.threshold == float("inf")
    with pytest.raises(RecipeError, match="threshold"):
        load_recipe(write_recipe(tmp_path, text.replace(".inf", ".nan")))


def _never_load(monkeypatch: pytest.MonkeyPatch) -> None:
    import compress.steps.load

    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded although the run should have stopped before")

    monkeypatch.setattr(compress.steps.load, "load_model", fail)


def test_group_wider_than_every_layer_fails_before_loading(
    tmp_path: Path, tiny_model_dir: Path, text_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_recipe(tmp_path, recipe_text(tiny_model_dir, text_dir, group_size=100_000_000))
    planned = run_cli(["plan", path, "--device", "h100-sxm"])
    assert planned.exit_code == 2 and "stages[0].quantize.group_size: 100000000 is wider than every layer" in planned.output
    _never_load(monkeypatch)
    result = run_cli(["run", path, "-o", tmp_path / "out"])
    assert result.exit_code == 2 and "the widest input is" in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_output_problems_fail_before_loading(tmp_path: Path, tiny_model_dir: Path, text_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_recipe(tmp_path, recipe_text(tiny_model_dir, text_dir))
    _never_load(monkeypatch)
    (tmp_path / "a-file").write_text("mine")
    unwritable = run_cli(["run", path, "-o", tmp_path / "a-file" / "out"])  # the parent is a file: cannot be created
    assert unwritable.exit_code == 2 and "cannot write" in unwritable.output, unwritable.output
    not_dir = run_cli(["run", path, "-o", tmp_path / "a-file", "--overwrite"])
    assert not_dir.exit_code == 2 and "is not a directory" in not_dir.output
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    exists = run_cli(["run", path, "-o", tmp_path / "taken"])
    assert exists.exit_code == 2 and "already exists" in exists.output
    refused = run_cli(["run", path, "-o", tmp_path / "taken", "--overwrite"])
    assert refused.exit_code == 2 and "cannot be replaced" in refused.output
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine" and (tmp_path / "a-file").read_text() == "mine"
    monkeypatch.chdir(tmp_path / "taken")
    for target in (".", "..", str(tmp_path)):
        here = run_cli(["run", path, "-o", target, "--overwrite"])
        assert here.exit_code == 2 and "current directory" in here.output, (target, here.output)
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"


def test_leftovers_of_killed_writes_are_cleaned_and_a_replaced_artifact_restored(tmp_path: Path) -> None:
    dead = 2**22 + 12345  # above Linux's default pid_max: no such process
    target = tmp_path / "out"
    old = tmp_path / f".out.old-{dead}"
    old.mkdir()
    (old / "manifest.json").write_text('{"files": {}}')
    partial = tmp_path / f".out.partial-{dead}-x1y2"
    partial.mkdir()
    (partial / "half.bin").write_bytes(b"\0" * 10)
    alive = tmp_path / f".out.partial-{os.getpid()}-abcd"  # a write in progress (this process): left alone
    alive.mkdir()
    lookalike = tmp_path / ".out.partial-notapid"  # not a name we create: left alone
    lookalike.mkdir()
    clean_stale_partials(target)
    assert (target / "manifest.json").is_file() and not old.exists()  # the killed run had moved it aside: it is back
    assert not partial.exists() and alive.is_dir() and lookalike.is_dir()
    old.mkdir()  # a stale replaced copy while the target exists: removed
    clean_stale_partials(target)
    assert not old.exists() and (target / "manifest.json").is_file()


@pytest.fixture()
def artifact(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> Path:
    gates = "  - metric: kl_divergence\n    max: 100\n"
    recipe = write_recipe(tmp_path, recipe_text(tiny_model_dir, text_dir, gates=gates, samples=2))
    result = run_cli(["run", recipe, "-o", tmp_path / "art"])
    assert result.exit_code == 0, result.output
    gates_file = tmp_path / "gates.yaml"
    gates_file.write_text(
        "gates:\n" + gates + "data:\n  evaluation: {source: " + str(text_dir) + ", samples: 2, seq_len: 64, min_context: 8}\n"
    )
    return tmp_path / "art"


def test_verify_gate_and_publish_refuse_an_altered_artifact(artifact: Path, tmp_path: Path) -> None:
    ok = run_cli(["verify", artifact])
    assert ok.exit_code == 0 and "verified" in ok.output and "files" in ok.output
    gates = tmp_path / "gates.yaml"
    assert run_cli(["gate", artifact, "--gates", gates, "-o", tmp_path / "report"]).exit_code == 0
    reported = run_cli(["verify", tmp_path / "report"])  # a gate report lists its own files
    assert reported.exit_code == 0, reported.output
    again = run_cli(["gate", artifact, "--gates", gates, "-o", tmp_path / "report"])
    assert again.exit_code == 2 and "already exists; pass --overwrite" in again.output, again.output
    assert run_cli(["gate", artifact, "--gates", gates, "-o", tmp_path / "report", "--overwrite"]).exit_code == 0  # replaces its report

    weights = artifact / "model" / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # one bit of one weight
    for command in (
        ["verify", artifact],
        ["gate", artifact, "--gates", gates, "-o", tmp_path / "report2"],
        ["publish", artifact, "--store", tmp_path / "registry"],
    ):
        result = run_cli(command)
        assert result.exit_code == 2, (command, result.output)
        assert "changed since the run: model/model.safetensors" in result.output, (command, result.output)
    assert not (tmp_path / "report2").exists() and not (tmp_path / "registry" / "mlflow.db").exists()

    weights.write_bytes(original)
    shutil.copy(weights, artifact / "model" / "extra.safetensors")
    result = run_cli(["verify", artifact])
    assert result.exit_code == 2 and "not in the manifest: model/extra.safetensors" in result.output
    (artifact / "model" / "extra.safetensors").unlink()
    (artifact / "report.json").unlink()
    assert run_cli(["verify", artifact]).exit_code == 2


def test_gate_report_cannot_go_into_or_around_the_artifact(artifact: Path, tmp_path: Path) -> None:
    before = {p: p.read_bytes() for p in artifact.rglob("*") if p.is_file()}
    gates = tmp_path / "gates.yaml"
    for target, words in ((artifact, "into the artifact"), (artifact / "reports", "into the artifact"), (tmp_path, "holding the artifact")):
        result = run_cli(["gate", artifact, "--gates", gates, "-o", target])
        assert result.exit_code == 2 and words in result.output, (target, result.output)
    assert {p: p.read_bytes() for p in artifact.rglob("*") if p.is_file()} == before
    assert run_cli(["verify", artifact]).exit_code == 0


def test_gate_refuses_a_damaged_baseline_or_model_folder(artifact: Path, tmp_path: Path, tiny_model_dir: Path) -> None:
    """`compress gate` opens models too: a --baseline, or a Hugging Face folder gated on its own, with a
    tensor removed is refused naming it (it was once run with the weight initialised at random)."""
    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_model_dir, damaged)
    _retensor(damaged / "model.safetensors", lambda t: t.pop(DOWN))
    latency = tmp_path / "latency.yaml"
    latency.write_text(
        "gates:\n  - metric: decode_tokens_per_s\n    min: 0.001\nlatency: {prompt_tokens: 8, output_tokens: 2, repeats: 1, warmup: 0}\n"
    )
    for command in (
        ["gate", artifact, "--gates", tmp_path / "gates.yaml", "--baseline", damaged, "-o", tmp_path / "r1"],
        ["gate", damaged, "--gates", latency, "-o", tmp_path / "r2"],
    ):
        output = " ".join(_one_line_error(run_cli(command)).split())
        assert str(damaged) in output and f"tensor {DOWN} is missing" in output, (command, output)


def _one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "unexpected failure" not in result.output, result.output
    return result.output


def _rewrite_header(weights: Path, change) -> None:
    """Edit a safetensors file's JSON header in place (``change(header)``), keeping its length."""
    data = weights.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    change(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= length, "the edited header must fit in the old one"
    weights.write_bytes(data[:8] + raw.ljust(length) + data[8 + length :])


def _retensor(weights: Path, change) -> None:
    """Rewrite a safetensors file with ``change(tensors)`` applied (a consistent file: header and bytes agree)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(weights))
    change(tensors)
    save_file(tensors, str(weights), metadata={"format": "pt"})


def _set_config(model: Path, **values) -> None:
    config = json.loads((model / "config.json").read_text())
    config.update(values)
    (model / "config.json").write_text(json.dumps(config))  # allow_nan: NaN is written as the bare NaN Python's json reads


DOWN = "model.layers.1.mlp.down_proj.weight"
# damage -> (what it does to a copy of the tiny model's folder, the words the error must hold besides the file's name)
DAMAGE = {
    "truncate-weights": (lambda m, w: w.write_bytes(w.read_bytes()[: w.stat().st_size // 2]), ["truncated"]),
    "header-garbage": (lambda m, w: w.write_bytes(w.read_bytes()[:8] + b"{not json" + w.read_bytes()[17:]), ["not valid JSON"]),
    "bad-dtype": (lambda m, w: _rewrite_header(w, lambda h: h[DOWN].update(dtype="Q9")), [DOWN, "Q9"]),
    "config-garbage": (lambda m, w: (m / "config.json").write_text('{"model_type": "llama", '), ["config.json"]),
    "config-not-object": (lambda m, w: (m / "config.json").write_text("[1, 2]"), ["config.json"]),
    "tokenizer-garbage": (lambda m, w: (m / "tokenizer.json").write_bytes(b"\x00\x01garbage"), ["tokenizer.json"]),
    "empty-weights": (lambda m, w: w.write_bytes(b""), []),
    # issue 54: never a model with a weight it does not have, or one the config does not describe
    "removed-tensor": (lambda m, w: _retensor(w, lambda t: t.pop(DOWN)), [DOWN, "missing", "initialised at random"]),
    "extra-config-layers": (lambda m, w: _set_config(m, num_hidden_layers=4), ["config.json", "num_hidden_layers is 4", "2 blocks"]),
    "fewer-config-layers": (lambda m, w: _set_config(m, num_hidden_layers=1), ["config.json", "num_hidden_layers is 1", "model.layers.1."]),
    "wrong-hidden-size": (lambda m, w: _set_config(m, hidden_size=128), ["config.json", "model.embed_tokens.weight", "hidden_size (128)"]),
    "wrong-vocab": (lambda m, w: _set_config(m, vocab_size=500), ["config.json", "model.embed_tokens.weight", "vocab_size (500)"]),
    "wrong-heads": (lambda m, w: _set_config(m, num_attention_heads=8), ["config.json", "self_attn", "num_attention_heads (8)"]),
    "untied-head": (lambda m, w: _set_config(m, tie_word_embeddings=False), ["lm_head.weight", "tie_word_embeddings"]),
    "header-shape": (lambda m, w: _rewrite_header(w, lambda h: h[DOWN].update(shape=h[DOWN]["shape"][::-1])), [DOWN, "[160, 96]"]),
    "header-dtype": (lambda m, w: _rewrite_header(w, lambda h: h[DOWN].update(dtype="I32")), [DOWN, "I32", "floating-point"]),
    "zero-sized-tensor": (lambda m, w: _retensor(w, lambda t: t.update({DOWN: t[DOWN][:0]})), [DOWN, "[0, 160]"]),
    "zero-sized-config": (lambda m, w: _set_config(m, intermediate_size=0), ["config.json", "intermediate_size is 0"]),
    "nan-weight": (lambda m, w: _retensor(w, lambda t: t[DOWN].view(-1).__setitem__(7, float("nan"))), [DOWN, "NaN"]),
    "inf-weight": (lambda m, w: _retensor(w, lambda t: t[DOWN].view(-1).__setitem__(0, float("-inf"))), [DOWN, "infinite"]),
    "nan-rms-norm-eps": (lambda m, w: _set_config(m, rms_norm_eps=float("nan")), ["config.json", "rms_norm_eps is nan"]),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_corrupt_model_directory_is_named(tmp_path: Path, tiny_model_dir: Path, text_dir: Path, damage: str) -> None:
    """Every damage class exits 2 with one line naming the file and the tensor or key: never a model run
    with a weight initialised at random, with blocks it does not have, or with non-finite values."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = next(model.glob("*.safetensors"))
    change, words = DAMAGE[damage]
    change(model, weights)
    path = write_recipe(tmp_path, recipe_text(model, text_dir))
    output = " ".join(_one_line_error(run_cli(["run", path, "-o", tmp_path / "out"])).split())  # rich wraps long lines
    named = (
        "tokenizer.json"
        if damage == "tokenizer-garbage"
        else ("config.json" if damage.startswith("config") or "config.json" in words else weights.name)
    )
    for expected in [named, *words]:
        assert expected in output, (expected, output)
    assert not (tmp_path / "out").exists()


def test_safetensors_checks_match_the_library(tmp_path: Path, tiny_model_dir: Path) -> None:
    from safetensors.torch import load_file

    weights = next(tiny_model_dir.glob("*.safetensors"))
    header = check_safetensors(weights)
    assert set(load_file(str(weights))) == set(header) - {"__metadata__"}
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(weights.read_bytes()[:-3])
    with pytest.raises(ModelLoadError, match="truncated"):
        check_safetensors(cut)
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        bad = tmp_path / "c.json"
        bad.write_text('{"a": ')
        check_json(bad)


def test_corrupt_gguf_and_onnx_are_named(tmp_path: Path, tiny_model_dir: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    gates = tmp_path / "gates.yaml"
    gates.write_text("gates:\n  - metric: decode_tokens_per_s\n    min: 1\nlatency: {}\n")
    output = _one_line_error(run_cli(["gate", gguf, "--gates", gates, "-o", tmp_path / "r1"]))
    assert "m.gguf: damaged or truncated GGUF file" in output, output
    not_gguf = tmp_path / "n.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 zip, not gguf")
    assert "not a GGUF file" in _one_line_error(run_cli(["gate", not_gguf, "--gates", gates, "-o", tmp_path / "r2"]))
    pytest.importorskip("onnx")
    folder = tmp_path / "onnx"
    folder.mkdir()
    (folder / "genai_config.json").write_text("{}")
    (folder / "model.onnx").write_bytes(b"\x08\x07garbage protobuf \xff\xff")
    output = _one_line_error(run_cli(["gate", folder, "--gates", gates, "-o", tmp_path / "r3"]))
    assert "model.onnx: not a readable ONNX model" in output, output


def _copy_gguf(source: Path, target: Path, keep, values: dict | None = None) -> None:
    """A GGUF file with ``source``'s metadata (``values`` replacing some) and the tensors ``keep(name)``
    accepts (as float32)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            value = (values or {}).get(key, field.contents())
            writer.add_key_value(key, value, field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None)
    for tensor in reader.tensors:
        if keep(tensor.name):
            writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compress.export.gguf.writer import write_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir), {}, "f32")
    return path


@pytest.mark.parametrize(
    ("keep", "words"),
    [
        (lambda name: False, "holds no tensors"),
        (lambda name: name != "blk.1.ffn_down.weight", "tensor blk.1.ffn_down.weight is missing"),
        (lambda name: not name.startswith("blk.1."), "block_count is 2, but the file holds no tensors of block 1"),
    ],
    ids=["no-tensors", "missing-tensor", "missing-block"],
)
def test_incomplete_gguf_is_refused_as_source_and_by_gate(
    tmp_path: Path, tiny_gguf: Path, text_dir: Path, cache_dir: Path, keep, words: str
) -> None:
    """A GGUF whose tensor table does not hold what its architecture needs: exit 2 naming the file and
    the tensor, as a recipe's source and as `compress gate`'s input (even for a gate that loads nothing)."""
    damaged = tmp_path / "damaged.gguf"
    _copy_gguf(tiny_gguf, damaged, keep)
    _refused_as_source_and_by_gate(tmp_path, damaged, text_dir, words)


def test_gguf_with_a_nan_in_its_metadata_is_refused(tmp_path: Path, tiny_gguf: Path, text_dir: Path, cache_dir: Path) -> None:
    damaged = tmp_path / "damaged.gguf"
    _copy_gguf(tiny_gguf, damaged, lambda name: True, {"llama.attention.layer_norm_rms_epsilon": float("nan")})
    _refused_as_source_and_by_gate(tmp_path, damaged, text_dir, "metadata llama.attention.layer_norm_rms_epsilon is nan")


def _refused_as_source_and_by_gate(tmp_path: Path, damaged: Path, text_dir: Path, words: str) -> None:
    recipe = write_recipe(tmp_path, recipe_text(damaged, text_dir))
    gates = tmp_path / "gates.yaml"
    gates.write_text("gates:\n  - metric: decode_tokens_per_s\n    min: 1\nlatency: {}\n")
    for command in (["run", recipe, "-o", tmp_path / "out"], ["gate", damaged, "--gates", gates, "-o", tmp_path / "report"]):
        output = " ".join(_one_line_error(run_cli(command)).split())
        assert "damaged.gguf" in output and words in output, (command, output)
    assert not (tmp_path / "out").exists() and not (tmp_path / "report").exists()


def test_integrity_checks_are_pure_and_exact() -> None:
    """The checks without a model: a float sum that overflows is not a non-finite weight; a shape
    mismatch names the config key whose value it is; a config size must be a whole number above 0."""
    import torch

    from compress import integrity

    integrity.check_finite(torch.full((4,), 3e38), "big", "f")  # sums to infinity in float32, every value finite
    with pytest.raises(ModelLoadError, match=r"f: tensor w holds 1 infinite"):
        integrity.check_finite(torch.tensor([1.0, float("inf")], dtype=torch.bfloat16), "w", "f")
    config = {"hidden_size": 64, "vocab_size": 300, "num_attention_heads": 4}
    assert integrity.suspects("model.embed_tokens.weight", (300, 64), (300, 96), config) == ["hidden_size (64)"]
    assert integrity.suspects("model.layers.0.self_attn.k_proj.weight", (32, 64), (48, 64), config) == ["num_attention_heads (4)"]
    for bad in (True, 0, -1, 2.5, "4"):
        with pytest.raises(ModelLoadError, match="num_attention_heads"):
            integrity.check_config_values({**config, "num_attention_heads": bad}, Path("config.json"))
    with pytest.raises(ModelLoadError, match=r"rope_scaling.factor is inf"):
        integrity.check_config_values({**config, "rope_scaling": {"factor": float("inf")}}, Path("config.json"))


def test_an_unexpected_failure_is_one_line_with_the_traceback_in_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import compress.recipe

    def boom(*args, **kwargs):
        raise ZeroDivisionError("simulated bug")

    monkeypatch.setattr(compress.recipe, "load_recipe", boom)
    result = run_cli(["validate", write_recipe(tmp_path, MINIMAL)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "unexpected failure: ZeroDivisionError: simulated bug" in result.output
    saved = Path(result.output.split("traceback in ")[1].split(")")[0].strip())
    assert "Traceback" in saved.read_text() and "simulated bug" in saved.read_text()
    saved.unlink()


@pytest.mark.parametrize(
    "failure",
    [OSError(28, "No space left on device"), RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")],
)
def test_a_full_disk_is_an_error_that_says_so_not_a_bug(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: Exception) -> None:
    import compress.recipe

    def full(*args, **kwargs):
        raise failure

    monkeypatch.setattr(compress.recipe, "load_recipe", full)
    result = run_cli(["validate", write_recipe(tmp_path, MINIMAL)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "no space left on the device while writing" in result.output and "a bug in compress" not in result.output
