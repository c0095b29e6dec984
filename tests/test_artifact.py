"""The artifact's own weights: model/ is a compressed-tensors pack-quantized checkpoint that
transformers loads as it is, at the size the bits imply; the records read back from it are the
records written; layers pack-quantized cannot hold fall back to the internal record layout; and
artifacts of the earlier layout (compress-quantized-v1) are still read, verified and gated."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from compress.artifact import CHECKPOINT_FILE, LEGACY_WEIGHTS_FILE, LEGACY_WEIGHTS_FORMAT, RECORDS_FILE, WEIGHTS_FORMAT, load_artifact
from compress.context import RunContext
from compress.errors import ArtifactError, FormatError
from compress.export.checkpoint.compressed_tensors import merge_groups, split_groups, stored_scheme
from compress.export.checkpoint.hf_checkpoint import records_identical
from compress.hf_model import checksums, float_tensors, write_config_and_tokenizer
from compress.marker import ARTIFACT, MARKER, write_marker
from compress.pipeline import run_recipe
from compress.progress import Reporter
from compress.quantizers.configs import RTNConfig
from compress.quantizers.core import QuantizedWeight
from compress.quantizers.rtn import RTNStage
from compress.recipe import load_recipe
from compress.schema.quantize import QuantScheme
from tests.helpers import recipe_text, run_cli, write_recipe

# fp32 on both sides with bit-identical weights (asserted below): only kernel-order noise could differ
LOGITS_ATOL = 1e-5
PASSING = "  - name: kl\n    metric: kl_divergence\n    max: 10.0\n"


def expected_model(source: Path, bits: int, group_size: int | None, symmetric: bool):
    """The in-memory quantized model and its records, as the run's RTN stage makes them."""
    model = AutoModelForCausalLM.from_pretrained(source).eval()
    ctx = RunContext(seed=0, device=torch.device("cpu"), tokenizer=None, reporter=Reporter(quiet=True), calibration=lambda: None)
    RTNStage(RTNConfig(bits=bits, group_size=group_size, symmetric=symmetric), "stages[0]").apply(model, ctx)
    return model, ctx.quantized


def run(tmp_path: Path, source: Path, text_dir: Path, bits: int, group_size: int | None, symmetric: bool) -> Path:
    recipe = write_recipe(tmp_path, recipe_text(source, text_dir, bits=bits, group_size=group_size, symmetric=symmetric, gates=PASSING))
    out = tmp_path / "out"
    run_recipe(load_recipe(recipe), out, reporter=Reporter(quiet=True))
    return out


def logits_diff(out: Path, model: torch.nn.Module) -> float:
    loaded = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (loaded(ids).logits - model(ids).logits).abs().max().item()


def payload_bytes(path: Path) -> int:
    """A safetensors file's tensor bytes (its size less the 8-byte length and the JSON header)."""
    with open(path, "rb") as f:
        (header,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - header


def packed_bytes(record: QuantizedWeight) -> int:
    """What the bits imply for one pack-quantized layer: codes at bits/8 per weight (int32 words),
    fp16 scales per stored group, zero points at bits each (int32 words), the 2-element shape."""
    scheme = stored_scheme(record.scheme, record.shape)
    assert scheme is not None
    out_f, in_f = record.shape
    groups = scheme.n_groups(in_f)
    codes = out_f * -(-in_f * scheme.bits // 32) * 4
    zeros = 0 if scheme.symmetric else -(-out_f * scheme.bits // 32) * 4 * groups
    return codes + out_f * groups * record.scale.element_size() + zeros + 2 * 8


@pytest.mark.parametrize(
    ("bits", "group", "width", "stored"),
    [(4, 128, 576, 64), (4, 128, 512, 128), (8, 64, 96, 32), (4, None, 96, None), (4, 80, 96, "none"), (3, 32, 64, "none")],
)
def test_stored_scheme_splits_partial_groups_exactly_or_falls_back(bits, group, width, stored) -> None:
    scheme = QuantScheme(bits=bits, group_size=group, symmetric=False)
    found = stored_scheme(scheme, (8, width))
    if stored == "none":
        assert found is None
        return
    assert found is not None and found.group_size == stored and found.model_copy(update={"group_size": group}) == scheme
    g = torch.Generator().manual_seed(0)
    n = scheme.n_groups(width)
    record = QuantizedWeight(
        codes=torch.randint(0, 2**bits, (8, width), generator=g, dtype=torch.uint8),
        scale=torch.rand(8, n, generator=g).to(torch.float16),
        zero_point=torch.randint(0, 2**bits, (8, n), generator=g, dtype=torch.uint8),
        scheme=scheme,
    )
    split = split_groups(record, found)
    assert torch.equal(split.dequantize(), record.dequantize())  # the same weights
    assert records_identical({"w": record}, {"w": merge_groups(split, scheme, "w")}) == []
    if found != scheme:  # pieces of one group that disagree are not a split of this scheme
        split.scale[0, 1] += 1
        with pytest.raises(FormatError, match="different scales"):
            merge_groups(split, scheme, "w")


def test_model_dir_is_written_shard_by_shard_and_every_reader_takes_the_shards(
    tmp_path: Path, tiny_model_dir: Path, text_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Shards of at most 64 KB: the tiny model's tensors spread over many files, as a 1.5B model's
    # do over 512 MB ones; only one shard is held while writing.
    from compress.export.checkpoint import hf_checkpoint

    monkeypatch.setattr(hf_checkpoint, "SHARD_BYTES", 64 * 1024)
    out = run(tmp_path, tiny_model_dir, text_dir, bits=4, group_size=32, symmetric=True)
    model, expected = expected_model(tiny_model_dir, 4, 32, True)
    model_dir = out / "model"
    index = json.loads((model_dir / hf_checkpoint.INDEX_FILE).read_text())
    files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    assert len(files) > 2 and not (model_dir / CHECKPOINT_FILE).exists()
    assert sorted(set(index["weight_map"].values())) == files
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    sizes = [payload_bytes(model_dir / f) for f in files]
    largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
    assert max(sizes) <= max(64 * 1024, largest) and index["metadata"]["total_size"] == sum(sizes)
    assert not list(model_dir.glob(".shard-*"))

    # transformers loads the sharded folder; our reader gives back the records exactly
    assert logits_diff(out, model) <= LOGITS_ATOL
    _, _, records = load_artifact(out)
    assert records_identical(expected, records) == []


def test_save_sharded_refuses_a_tensor_name_twice(tmp_path: Path) -> None:
    from compress.export.checkpoint.hf_checkpoint import save_sharded

    with pytest.raises(FormatError, match="two tensors named a.weight"):
        save_sharded(tmp_path, [("a.weight", torch.zeros(2)), ("b.weight", torch.zeros(2)), ("a.weight", torch.ones(2))])


def test_model_dir_is_compressed_tensors_at_the_packed_size_and_reads_back_exactly(
    tmp_path: Path, tiny_model_dir: Path, text_dir: Path
) -> None:
    # hidden 96 and MLP 160 with groups of 64 end in partial groups of 32: stored as groups of 32
    out = run(tmp_path, tiny_model_dir, text_dir, bits=4, group_size=64, symmetric=False)
    model, expected = expected_model(tiny_model_dir, 4, 64, False)

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["quantization"]["weights_format"] == WEIGHTS_FORMAT
    assert {info["stored_as"] for info in manifest["quantization"]["layers"].values()} == {"compressed-tensors"}
    assert not (out / RECORDS_FILE).exists() and not (out / "model" / LEGACY_WEIGHTS_FILE).exists()
    qcfg = json.loads((out / "model" / "config.json").read_text())["quantization_config"]
    assert (qcfg["quant_method"], qcfg["format"]) == ("compressed-tensors", "pack-quantized")
    assert {g["weights"]["group_size"] for g in qcfg["config_groups"].values()} == {32}

    # transformers (with compressed-tensors) loads model/ as it is and computes the in-memory model
    assert logits_diff(out, model) <= LOGITS_ATOL

    # records read back: codes, scales, zero points and schemes as written (groups of 64 again)
    _, _, records = load_artifact(out)
    assert records_identical(expected, records) == []
    assert {r.scheme.group_size for r in records.values()} == {64}

    # the size the bits imply: packed layers + float tensors, nothing else (the header aside)
    floats = sum(t.numel() * t.element_size() for _, t in float_tensors(model, expected))
    implied = floats + sum(packed_bytes(r) for r in expected.values())
    weights = out / "model" / CHECKPOINT_FILE
    assert payload_bytes(weights) == implied
    with safe_open(str(weights), "pt") as f:
        assert weights.stat().st_size - implied <= 8 + 200 * len(f.keys())  # the header: a name, dtype, shape, offsets per tensor
    unpacked = floats + sum(r.codes.numel() + r.scale.numel() * 2 + r.zero_point.numel() for r in expected.values())
    codes_saved = sum(r.codes.numel() for r in expected.values()) // 2
    assert unpacked - implied > 0.9 * codes_saved  # half of the one-byte-per-code layout's code bytes are gone


def test_layers_pack_quantized_cannot_hold_fall_back_to_records(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    # groups of 80: widths 96 (q k v o gate up) share only 16 with it, too narrow to split into; 160 (down) is whole groups
    out = run(tmp_path, tiny_model_dir, text_dir, bits=4, group_size=80, symmetric=True)
    model, expected = expected_model(tiny_model_dir, 4, 80, True)

    layers = json.loads((out / "manifest.json").read_text())["quantization"]["layers"]
    stored = {name: info["stored_as"] for name, info in layers.items()}
    assert {n for n, s in stored.items() if s == "compressed-tensors"} == {n for n in expected if n.endswith("down_proj")}
    assert {n for n, s in stored.items() if s == "records"} == {n for n in expected if not n.endswith("down_proj")}
    assert (out / RECORDS_FILE).is_file()
    qcfg = json.loads((out / "model" / "config.json").read_text())["quantization_config"]
    assert {n for n in qcfg["ignore"] if n != "lm_head"} == {n for n, s in stored.items() if s == "records"}

    assert logits_diff(out, model) <= LOGITS_ATOL  # fallback layers are float Linears there, dequantized
    _, _, records = load_artifact(out)
    assert records_identical(expected, records) == []


def test_a_scheme_with_no_packed_layer_writes_a_float_checkpoint_and_records(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    out = run(tmp_path, tiny_model_dir, text_dir, bits=3, group_size=32, symmetric=False)
    model, expected = expected_model(tiny_model_dir, 3, 32, False)
    assert "quantization_config" not in json.loads((out / "model" / "config.json").read_text())
    assert logits_diff(out, model) <= LOGITS_ATOL
    _, _, records = load_artifact(out)
    assert records_identical(expected, records) == []


def write_legacy_layout(out: Path) -> None:
    """Rewrite a new artifact in the layout of compress-quantized-v1 (model/weights.safetensors with
    the records unpacked; no weights_format, no stored_as), as the writer of that release did."""
    from safetensors.torch import save_file

    model, tokenizer, records = load_artifact(out)
    for path in (out / "model").iterdir():
        path.unlink()
    (out / RECORDS_FILE).unlink(missing_ok=True)
    write_config_and_tokenizer(out / "model", model, tokenizer)
    tensors = dict(float_tensors(model, records))
    for name, record in records.items():
        tensors.update(record.tensors(name))
    save_file(tensors, str(out / "model" / LEGACY_WEIGHTS_FILE), metadata={"format": LEGACY_WEIGHTS_FORMAT})
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["quantization"]["weights_format"]
    for info in manifest["quantization"]["layers"].values():
        del info["stored_as"]
    manifest["files"] = {k: v for k, v in checksums(out).items() if k not in ("manifest.json", MARKER)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    write_marker(out, ARTIFACT)


def compressed_kl(directory: Path) -> list[float]:
    evaluations = json.loads((directory / "report.json").read_text())["evaluations"]
    return [e["metrics"]["kl_divergence"] for e in evaluations if e["artifact"] == "compressed" and e["kind"] == "accuracy"]


def test_an_artifact_of_the_earlier_layout_is_read_verified_and_gated(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    out = run(tmp_path, tiny_model_dir, text_dir, bits=4, group_size=32, symmetric=False)
    _, expected = expected_model(tiny_model_dir, 4, 32, False)
    write_legacy_layout(out)
    assert not (out / "model" / CHECKPOINT_FILE).exists()

    _, _, records = load_artifact(out)
    assert records_identical(expected, records) == []
    verified = run_cli(["verify", out])
    assert verified.exit_code == 0, verified.output
    gates = tmp_path / "gates.yaml"
    gates.write_text("gates:\n  - {metric: kl_divergence, artifact: compressed, max: 10}\n")
    gated = run_cli(["gate", out, "--gates", gates, "-o", tmp_path / "gate", "-q"])
    assert gated.exit_code == 0, gated.output
    (kl,) = compressed_kl(tmp_path / "gate")
    (run_kl,) = compressed_kl(out)
    assert kl == pytest.approx(run_kl, rel=1e-4, abs=1e-7)  # the same records, text and baseline: the same number


def test_an_unknown_weights_format_is_refused_with_how_to_recreate(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    out = run(tmp_path, tiny_model_dir, text_dir, bits=4, group_size=32, symmetric=True)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["quantization"]["weights_format"] = "compressed-tensors-v9"
    (out / "manifest.json").write_text(json.dumps(manifest))
    write_marker(out, ARTIFACT)  # as a later release would write it
    with pytest.raises(ArtifactError, match=r"compressed-tensors-v9.*compress run <recipe> -o .* --overwrite"):
        load_artifact(out)
    gates = tmp_path / "gates.yaml"
    gates.write_text("gates:\n  - {metric: kl_divergence, artifact: compressed, max: 10}\n")
    gated = run_cli(["gate", out, "--gates", gates, "-o", tmp_path / "gate", "-q"])
    assert gated.exit_code == 2, gated.output
    assert "--overwrite" in gated.output and "Traceback" not in gated.output


@pytest.mark.parametrize("text", ["", "{", '{"weight_map": 3}', "[1, 2]"])
def test_a_corrupt_safetensors_index_is_a_format_error_naming_the_file(tmp_path: Path, text: str) -> None:
    from compress.export.checkpoint.hf_checkpoint import INDEX_FILE, weight_files

    (tmp_path / INDEX_FILE).write_text(text)
    with pytest.raises(FormatError, match=INDEX_FILE):
        weight_files(tmp_path)


def test_our_safetensors_writer_reads_back_with_safetensors_itself(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    from compress.export.checkpoint.hf_checkpoint import write_safetensors
    from compress.inputs import check_safetensors

    g = torch.Generator().manual_seed(0)
    tensors = {
        "w.bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "w.f32": torch.randn(3, 4, generator=g).t(),  # not contiguous
        "w.f16": torch.randn(9, generator=g).half(),
        "codes": torch.randint(-8, 8, (4, 3), generator=g, dtype=torch.int8),
        "packed": torch.randint(0, 2**31 - 1, (2, 6), generator=g, dtype=torch.int32),
        "shape": torch.tensor([4096, 1536]),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "fp8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
    }
    path = tmp_path / "x.safetensors"
    write_safetensors(path, tensors, {"format": "pt"})
    check_safetensors(path)
    back = load_file(str(path))
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert (
            torch.equal(back[name].view(torch.uint8), t.contiguous().view(torch.uint8))
            if t.dtype == torch.float8_e4m3fn
            else torch.equal(back[name], t)
        ), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert header_len % 8 == 0  # the data section starts 8-byte aligned
