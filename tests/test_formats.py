"""Checkpoint formats: exact packing, runtime loading, import, and the pipeline's exports.

Exactness means: a checkpoint written from our records reads back to identical codes, scales,
zero points and schemes, and a runtime that loads it computes with exactly our dequantized
weights (compressed-tensors through transformers: identical weights, logits within 1e-5 in fp32).
GPTQ and AWQ layouts are checked against independent implementations written here from the
format descriptions (AutoGPTQ's QuantLinear unpacking, AutoAWQ's WQLinear_GEMM packing).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from compress.context import RunContext
from compress.errors import CompressError, FormatError
from compress.export.checkpoint import autogptq, compressed_tensors
from compress.export.checkpoint.hf_checkpoint import records_identical, write_checkpoint
from compress.export.checkpoint.readers import read_records
from compress.export.packing import pack_int32, unpack_int32
from compress.fsutil import sha256_file
from compress.models import load_model
from compress.paths import usable_cpus
from compress.pipeline import run_recipe
from compress.progress import Reporter
from compress.quantizers.configs import RTNConfig
from compress.quantizers.core import QuantizedWeight
from compress.quantizers.rtn import RTNStage
from compress.recipe import load_recipe
from compress.schema.recipe import ModelConfig
from tests.helpers import recipe_text, run_cli, write_recipe
from tests.tiny import tiny_llama

QUIET = Reporter(quiet=True)
LOGITS_ATOL = 1e-5  # fp32; the weights are bit-identical, so only kernel-order noise could differ (observed: 0)


def quantize(model: torch.nn.Module, bits: int, group_size: int | None, symmetric: bool, **kw) -> dict[str, QuantizedWeight]:
    ctx = RunContext(seed=0, device=torch.device("cpu"), tokenizer=None, reporter=QUIET, calibration=lambda: None)
    RTNStage(RTNConfig(bits=bits, group_size=group_size, symmetric=symmetric, **kw), "stages[0]").apply(model, ctx)
    return ctx.quantized


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def token_ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))


# --------------------------------------------------------------------------- pure packing


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dim", [0, 1])
def test_packing_is_bit_identical_to_compressed_tensors(bits: int, dim: int) -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    for shape in [(5, 96), (7, 33), (64, 160)]:
        values = torch.randint(0, 2**bits, shape, generator=torch.Generator().manual_seed(bits))
        ours = pack_int32(values, bits, dim)
        theirs = pack_to_int32((values - 2 ** (bits - 1)).to(torch.int8), bits, packed_dim=dim)  # their signed input
        assert torch.equal(ours, theirs)
        assert torch.equal(unpack_int32(ours, bits, shape[dim], dim), values.to(torch.int32))


def _autogptq_pack_rows(intweight: list[list[int]], bits: int) -> list[list[int]]:
    """AutoGPTQ's QuantLinear.pack loop (uint32 words, rows = input features), for an independent check."""
    rows, cols = len(intweight), len(intweight[0])
    q = [[0] * cols for _ in range(rows // 32 * bits)]
    i = row = 0
    while row < len(q):
        for c in range(cols):
            if bits in (2, 4, 8):
                for j in range(32 // bits):
                    q[row][c] |= intweight[i + j][c] << (bits * j)
            else:  # 3 bits: 10 fields, one split field, 10, one split, 10 -> 32 fields in 3 words
                w = [intweight[i + j][c] for j in range(32)]
                for j in range(10):
                    q[row][c] |= w[j] << (3 * j)
                q[row][c] |= (w[10] << 30) & 0xFFFFFFFF
                q[row + 1][c] |= (w[10] >> 2) & 1
                for j in range(10):
                    q[row + 1][c] |= w[11 + j] << (3 * j + 1)
                q[row + 1][c] |= (w[21] << 31) & 0xFFFFFFFF
                q[row + 2][c] |= (w[21] >> 1) & 0x3
                for j in range(10):
                    q[row + 2][c] |= w[22 + j] << (3 * j + 2)
        i += 32 if bits == 3 else 32 // bits
        row += 3 if bits == 3 else 1
    return q


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_gptq_packing_matches_autogptq_loop(bits: int) -> None:
    values = torch.randint(0, 2**bits, (64, 5), generator=torch.Generator().manual_seed(bits))
    expected = torch.tensor(_autogptq_pack_rows(values.tolist(), bits), dtype=torch.int64)
    expected = torch.where(expected >= 2**31, expected - 2**32, expected).to(torch.int32)
    assert torch.equal(pack_int32(values, bits, dim=0), expected)


# --------------------------------------------------------------------------- compressed-tensors


CT_CASES = [
    (4, 32, True),
    (4, 32, False),
    (4, 64, True),
    (4, 64, False),
    (4, 128, True),
    (4, 128, False),
    (8, 32, False),
    (8, 64, True),
    (8, 128, False),
    (4, None, False),
    (8, None, True),
    (2, 64, False),
]


@pytest.mark.parametrize(("bits", "group", "symmetric"), CT_CASES)
def test_compressed_tensors_loads_in_transformers_with_identical_logits(tmp_path: Path, tokenizer, bits, group, symmetric) -> None:
    model = tiny_llama(len(tokenizer))
    records = quantize(model, bits, group, symmetric)
    out = tmp_path / "ct"
    compressed_tensors.write(out, model, tokenizer, records)

    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["format"], config["quantization_status"]) == (
        "compressed-tensors",
        "pack-quantized",
        "compressed",
    )
    weights = config["config_groups"]["group_0"]["weights"]
    assert weights["num_bits"] == bits and weights["symmetric"] == symmetric and weights["type"] == "int"
    assert (weights["strategy"], weights["group_size"]) == (("channel", None) if group is None else ("group", group))
    assert config["ignore"] == ["lm_head"]

    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = token_ids(len(tokenizer))
    with torch.no_grad():
        diff = (loaded(ids).logits - model(ids).logits).abs().max().item()
    assert diff <= LOGITS_ATOL, diff
    theirs = dict(loaded.named_modules())
    for name, record in records.items():
        assert torch.equal(theirs[name].weight, record.dequantize()), name
    assert records_identical(records, read_records(out).records) == []


def test_compressed_tensors_refuses_partial_groups_and_other_bit_widths(tmp_path: Path, tiny_model_dir: Path, tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()  # hidden 96: a group of 64 ends in 32
    records = quantize(model, 4, 64, False)
    with pytest.raises(FormatError) as err:
        compressed_tensors.write(tmp_path / "a", model, tokenizer, records)
    msg = str(err.value)
    assert "input features, not a multiple of group_size 64" in msg and "no partial last group" in msg
    assert "model.layers.0." in msg and "(e.g. 32)" in msg and "export gptq" in msg

    # Not an arbitrary rule: compressed-tensors itself cannot dequantize a partial group.
    tensors = {f"{n}.{s}": t for n, r in records.items() for s, t in compressed_tensors.pack_record(r).items()}
    write_checkpoint(tmp_path / "b", model, tokenizer, records, tensors.items(), compressed_tensors.quantization_config(model, records))
    partial = AutoModelForCausalLM.from_pretrained(tmp_path / "b")  # weights are decompressed at the first forward
    with pytest.raises(ValueError, match="divisble by the given group_size"), torch.no_grad():
        partial(token_ids(len(tokenizer)))

    three_bit = quantize(tiny_llama(len(tokenizer)), 3, 32, True)
    with pytest.raises(FormatError, match="3-bit codes .* Quantize with bits 2, 4 or 8, or export gptq"):
        compressed_tensors.check(model, three_bit)


def test_compressed_tensors_mixed_schemes_get_one_group_each(tmp_path: Path, tokenizer) -> None:
    model = tiny_llama(len(tokenizer), tie=False)
    records = quantize(model, 4, 32, False, targets=["self_attn.*"])
    ctx = RunContext(seed=0, device=torch.device("cpu"), tokenizer=None, reporter=QUIET, calibration=lambda: None)
    ctx.quantized.update(records)
    RTNStage(RTNConfig(bits=8, group_size=None, symmetric=True, targets=["mlp.*", "lm_head"], ignore=[]), "stages[1]").apply(model, ctx)
    compressed_tensors.write(tmp_path / "ct", model, tokenizer, ctx.quantized)
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert len(config["config_groups"]) == 2 and config["ignore"] == []
    assert "lm_head" in config["config_groups"]["group_1"]["targets"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32).eval()
    ids = token_ids(len(tokenizer))
    with torch.no_grad():
        assert (loaded(ids).logits - model(ids).logits).abs().max().item() <= LOGITS_ATOL
    assert records_identical(ctx.quantized, read_records(tmp_path / "ct").records) == []


# --------------------------------------------------------------------------- GPTQ


def _autogptq_dequantize(tensors: dict[str, torch.Tensor], name: str, bits: int) -> torch.Tensor:
    """AutoGPTQ's torch fallback (QuantLinear.forward without kernels), written independently:
    shift-and-mask unpacking with the v1 ``zeros + 1``, scales and zeros indexed by g_idx."""
    qweight, qzeros = tensors[f"{name}.qweight"].to(torch.int64) & 0xFFFFFFFF, tensors[f"{name}.qzeros"].to(torch.int64) & 0xFFFFFFFF
    scales, g_idx = tensors[f"{name}.scales"].float(), tensors[f"{name}.g_idx"].long()
    mask = 2**bits - 1

    def fields(words: torch.Tensor, dim: int) -> torch.Tensor:  # a bit stream read field by field
        words = words.movedim(dim, -1)
        n = words.shape[-1] * 32 // bits
        out = []
        for i in range(n):
            word, off = divmod(i * bits, 32)
            v = words[..., word] >> off
            if off + bits > 32:
                v = v | (words[..., word + 1] << (32 - off))
            out.append(v & mask)
        return torch.stack(out, -1).movedim(-1, dim)

    codes = fields(qweight, 0).float()  # [in, out]
    zeros = (fields(qzeros, 1) + 1).float()  # [groups, out]
    return (scales[g_idx] * (codes - zeros[g_idx])).t()


@pytest.mark.parametrize(
    ("bits", "group", "symmetric"),
    [(2, 32, False), (3, 64, True), (3, 32, False), (4, 32, True), (4, 128, False), (8, 64, False), (4, None, True), (8, None, False)],
)
def test_gptq_round_trip_and_independent_dequantization(tmp_path: Path, tokenizer, bits, group, symmetric) -> None:
    from safetensors.torch import load_file

    model = tiny_llama(len(tokenizer))
    records = quantize(model, bits, group, symmetric)
    if not symmetric:  # v1 cannot store a zero point of 0; RTN gives one only for an all-positive group
        assert all(int(r.zero_point.min()) >= 1 for r in records.values())
    autogptq.write(tmp_path / "gptq", model, tokenizer, records)
    config = json.loads((tmp_path / "gptq" / "config.json").read_text())["quantization_config"]
    assert config == {
        **config,
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group or -1,
        "desc_act": False,
        "sym": symmetric,
        "checkpoint_format": "gptq",
        "lm_head": False,
    }
    assert json.loads((tmp_path / "gptq" / "quantize_config.json").read_text())["bits"] == bits

    tensors = load_file(str(tmp_path / "gptq" / "model.safetensors"))
    q = tensors["model.layers.0.mlp.down_proj.qweight"]
    assert q.dtype == torch.int32 and tuple(q.shape) == (256 * bits // 32, 128)
    assert tensors["model.layers.0.mlp.down_proj.scales"].dtype == torch.float16
    for name, record in records.items():
        assert torch.equal(_autogptq_dequantize(tensors, name, bits), record.dequantize()), name
    assert records_identical(records, read_records(tmp_path / "gptq").records) == []


def test_gptq_stores_partial_groups(tmp_path: Path, tiny_model_dir: Path, tokenizer) -> None:
    from safetensors.torch import load_file

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()  # 96 inputs, groups of 64 -> 64 + 32
    records = quantize(model, 4, 64, False)
    autogptq.write(tmp_path / "g", model, tokenizer, records)
    tensors = load_file(str(tmp_path / "g" / "model.safetensors"))
    assert tuple(tensors["model.layers.0.self_attn.q_proj.scales"].shape) == (2, 96)
    for name, record in records.items():
        assert torch.equal(_autogptq_dequantize(tensors, name, 4), record.dequantize()), name
    assert records_identical(records, read_records(tmp_path / "g").records) == []


def test_gptq_writer_errors_name_the_problem(tokenizer) -> None:
    model = tiny_llama(len(tokenizer))
    records = quantize(model, 4, 32, False)
    name = "model.layers.0.mlp.up_proj"
    r = records[name]
    zero = r.zero_point.clone()
    zero[0, 0] = 0
    records[name] = QuantizedWeight(r.codes, r.scale, zero, r.scheme)
    with pytest.raises(FormatError, match=f"layer {name} has a zero point of 0.*stores zero - 1"):
        autogptq.check(model, records)
    partly = {n: rec for n, rec in records.items() if "mlp" not in n}
    with pytest.raises(FormatError, match="every Linear layer.*stay float"):
        autogptq.check(model, partly)
    mixed = {
        **quantize(tiny_llama(len(tokenizer)), 4, 64, False, targets=["mlp.*"]),
        **quantize(tiny_llama(len(tokenizer)), 4, 32, False, targets=["self_attn.*"]),
    }
    with pytest.raises(FormatError, match="one scheme, these records use 2: W4 g32 asym .*; W4 g64 asym"):
        autogptq.check(model, mixed)
    five = quantize(tiny_llama(len(tokenizer)), 5, 32, True)
    with pytest.raises(FormatError, match="5-bit codes; GPTQ checkpoints hold 2, 3, 4, 8 bits"):
        autogptq.check(model, five)
    bf16 = quantize(tiny_llama(len(tokenizer)), 4, 32, True, scale_dtype="bfloat16")
    with pytest.raises(FormatError, match="float16 scales, these are bfloat16"):
        autogptq.check(model, bf16)


def _save_hf(directory: Path, model: torch.nn.Module, tokenizer, qcfg: dict, tensors: dict[str, torch.Tensor]) -> None:
    """A third-party-style checkpoint: float tensors minus replaced weights, plus the given tensors."""
    directory.mkdir(parents=True)
    model.config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    cfg = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**cfg, "quantization_config": qcfg}))
    skip = {k.rsplit(".", 1)[0] + ".weight" for k in tensors}
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k not in skip and k != "lm_head.weight"}
    save_file({**state, **tensors}, str(directory / "model.safetensors"), metadata={"format": "pt"})


def test_gptq_act_order_and_wrapped_zero_points_fail_clearly(tmp_path: Path, tokenizer) -> None:
    model = tiny_llama(len(tokenizer))
    records = quantize(model, 4, 32, True)
    tensors = {f"{n}.{s}": t for n, r in records.items() for s, t in autogptq.pack_record(r).items()}
    qcfg = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": True, "checkpoint_format": "gptq"}
    g_idx = tensors["model.layers.1.self_attn.o_proj.g_idx"]
    tensors["model.layers.1.self_attn.o_proj.g_idx"] = g_idx[torch.randperm(g_idx.numel(), generator=torch.Generator().manual_seed(0))]
    _save_hf(tmp_path / "actorder", model, tokenizer, qcfg, tensors)
    with pytest.raises(FormatError, match=r"o_proj: g_idx is not the contiguous.*act-order \(desc_act\).*desc_act=false"):
        load_model(ModelConfig(source=str(tmp_path / "actorder")), tmp_path, QUIET)

    tensors["model.layers.1.self_attn.o_proj.g_idx"] = g_idx
    tensors["model.layers.0.mlp.up_proj.qzeros"] = torch.full_like(tensors["model.layers.0.mlp.up_proj.qzeros"], -1)  # all 15s
    _save_hf(tmp_path / "wrapped", model, tokenizer, {**qcfg, "sym": False}, tensors)
    with pytest.raises(FormatError, match="up_proj: a stored zero point of 15 means 16"):
        read_records(tmp_path / "wrapped")


# --------------------------------------------------------------------------- AutoAWQ


def _autoawq_pack(intweight: torch.Tensor) -> torch.Tensor:
    """WQLinear_GEMM.from_linear's packing, from the format description: [rows, cols] 4-bit ->
    [rows, cols/8] int32, field i of word c holding column 8c + order[i]."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    rows, cols = intweight.shape
    packed = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for c in range(cols // 8):
        for i in range(8):
            packed[:, c] |= intweight[:, c * 8 + order[i]].to(torch.int64) << (i * 4)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def test_awq_gemm_checkpoint_imports_exactly(tmp_path: Path, tokenizer) -> None:
    model = tiny_llama(len(tokenizer))
    records = quantize(model, 4, 32, False)
    tensors = {}
    for name, r in records.items():
        tensors[f"{name}.qweight"] = _autoawq_pack(r.codes.t())  # [in, out/8]
        tensors[f"{name}.qzeros"] = _autoawq_pack(r.zero_point.t())  # [in/group, out/8]
        tensors[f"{name}.scales"] = r.scale.t().contiguous()  # [in/group, out]
    qcfg = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    _save_hf(tmp_path / "awq", model, tokenizer, qcfg, tensors)

    assert records_identical(records, read_records(tmp_path / "awq").records) == []
    loaded = load_model(ModelConfig(source=str(tmp_path / "awq")), tmp_path, QUIET)
    assert loaded.facts["quantized_checkpoint"]["format"] == "awq"
    assert records_identical(records, loaded.quantized) == []
    ids = token_ids(len(tokenizer))
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, model(ids).logits)

    _save_hf(tmp_path / "gemv", model, tokenizer, {**qcfg, "version": "gemv"}, tensors)
    with pytest.raises(FormatError, match="AWQ version 'gemv' has a kernel-specific layout"):
        read_records(tmp_path / "gemv")


# --------------------------------------------------------------------------- model source + pipeline


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq"])
def test_model_source_imports_quantized_checkpoints(tmp_path: Path, tokenizer, fmt: str) -> None:
    model = tiny_llama(len(tokenizer))
    records = quantize(model, 4, 32, False)
    writer = compressed_tensors.write if fmt == "compressed-tensors" else autogptq.write
    writer(tmp_path / "ckpt", model, tokenizer, records)
    loaded = load_model(ModelConfig(source=str(tmp_path / "ckpt")), tmp_path, QUIET)
    facts = loaded.facts["quantized_checkpoint"]
    assert facts["format"] == fmt and facts["layers"] == 14 and facts["schemes"] == {"W4 g32 asym (float16 scales)": 14}
    assert records_identical(records, loaded.quantized) == []
    assert not hasattr(loaded.model.config, "quantization_config")
    ids = token_ids(len(tokenizer))
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, model(ids).logits)


PASSING = """\
  - name: kl
    metric: kl_divergence
    max: 0.01
  - name: gptq-kl
    metric: kl_divergence
    artifact: gptq
    max: 0.01
"""  # measured: KL 0.00023 (W4 g32 asym), 0 for the converted checkpoint against itself
EXPORTS = "exports:\n  - format: compressed-tensors\n    name: ct\n  - format: gptq\n"


def test_pipeline_writes_and_verifies_exports(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    text = recipe_text(tiny_model_dir, text_dir, bits=4, group_size=32, symmetric=False, gates=PASSING).replace("exports: []\n", EXPORTS)
    out = tmp_path / "out"
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", out])
    assert result.exit_code == 0, result.output

    report = json.loads((out / "report.json").read_text())
    assert [(e["name"], e["format"], e["verified"]) for e in report["exports"]] == [
        ("ct", "compressed-tensors", True),
        ("gptq", "gptq", True),
    ]
    assert all(e["check"].startswith("records identical after reload") and e["evaluated_as"] == "compressed" for e in report["exports"])
    gates = {g["name"]: g for g in report["gates"]}
    assert gates["gptq-kl"]["artifact"] == "gptq" and gates["gptq-kl"]["value"] == gates["kl"]["value"]
    assert {e["artifact"] for e in report["evaluations"]} == {"baseline", "compressed"}

    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["exports"]:
        assert entry["verified"] and entry["layers"] == 14 and "config.json" in entry["files"]
        for rel, digest in entry["files"].items():
            assert sha256_file(out / entry["path"] / rel) == digest
            assert manifest["files"][f"{entry['path']}/{rel}"] == digest
    assert manifest["exports"][0]["quantization_config"]["format"] == "pack-quantized"

    loaded = AutoModelForCausalLM.from_pretrained(out / "exports" / "ct", dtype=torch.float32).eval()
    from compress.artifact import load_artifact

    ours, _, _ = load_artifact(out)
    ids = token_ids(300)
    with torch.no_grad():
        assert (loaded(ids).logits - ours(ids).logits).abs().max().item() <= LOGITS_ATOL

    # The GPTQ export as a model source: imported, not re-quantized, and re-exported exactly.
    convert = recipe_text(out / "exports" / "gptq", text_dir, gates=PASSING.replace("gptq", "ct"))
    convert = convert.split("stages:")[0] + "exports:\n  - format: compressed-tensors\n    name: ct\ngates:" + convert.split("gates:")[1]
    out2 = tmp_path / "out2"
    run_recipe(load_recipe(write_recipe(tmp_path, convert, "convert.yaml")), out2, reporter=QUIET)
    m2 = json.loads((out2 / "manifest.json").read_text())
    assert m2["model"]["quantized_checkpoint"]["format"] == "gptq"
    assert {v["stage"] for v in m2["quantization"]["layers"].values()} == {"model.source"}
    assert records_identical(read_records(out / "exports" / "ct").records, read_records(out2 / "exports" / "ct").records) == []

    requant = recipe_text(out / "exports" / "gptq", text_dir)
    with pytest.raises(CompressError, match="already quantized by model.source"):
        run_recipe(load_recipe(write_recipe(tmp_path, requant, "requant.yaml")), tmp_path / "out3", reporter=QUIET)


def test_pipeline_rejects_an_impossible_export_before_evaluating(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    text = recipe_text(tiny_model_dir, text_dir, bits=4, group_size=64).replace("exports: []\n", EXPORTS)
    out = tmp_path / "out"
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", out])
    assert result.exit_code == 2
    assert "exports[0] (ct): compressed-tensors export: layer" in result.output and "partial last group" in result.output
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))

    no_stage = text.split("stages:")[0] + EXPORTS + "gates: []\n"
    result = run_cli(["run", write_recipe(tmp_path, no_stage, "nostage.yaml"), "-o", out])
    assert result.exit_code == 2 and "no layer is quantized" in result.output


@pytest.mark.parametrize(
    ("exports", "expected"),
    [
        ("  - format: gptq\n  - format: gptq\n", "export names must be unique; repeated: gptq"),
        ("  - format: openvino\n", "export format 'openvino' is not available; available: compressed-tensors, gptq, gguf, onnx, tensorrt"),
        ("  - name: x\n", "an export names its format"),
        ("  - format: gptq\n    nme: x\n", "exports[0].nme: unknown key 'nme' (did you mean 'name'?)"),
        ("  - format: gptq\n    name: baseline\n", "reserved"),
        ('  - format: gptq\n    name: "ok\\n"\n', "export name 'ok\\n' must be letters"),  # a trailing newline is no folder name
        ("  - format: gptq\n    name: ../up\n", "export name '../up' must be letters"),
    ],
)
def test_export_configs_are_validated(tmp_path: Path, tiny_model_dir: Path, text_dir: Path, exports: str, expected: str) -> None:
    text = recipe_text(tiny_model_dir, text_dir).replace("exports: []\n", "exports:\n" + exports)
    result = run_cli(["validate", write_recipe(tmp_path, text)])
    assert result.exit_code == 2 and expected in result.output, result.output


def test_gate_on_an_export_name_validates(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    text = recipe_text(tiny_model_dir, text_dir, gates=PASSING).replace("exports: []\n", EXPORTS)
    recipe = load_recipe(write_recipe(tmp_path, text)).recipe
    assert [x.name for x in recipe.exports] == ["ct", "gptq"]
    missing = recipe_text(tiny_model_dir, text_dir, gates=PASSING)
    result = run_cli(["validate", write_recipe(tmp_path, missing, "m.yaml")])
    assert result.exit_code == 2 and "gates[1].artifact 'gptq' is not an artifact" in result.output


# --------------------------------------------------------------------------- real model


@pytest.mark.real_model
def test_smollm2_compressed_tensors_export_loads_in_transformers(tmp_path: Path) -> None:
    """SmolLM2-135M (width 576 = 9 x 64): RTN W4 g64 asym -> compressed-tensors -> transformers, same logits."""
    torch.set_num_threads(usable_cpus())
    root = Path(__file__).resolve().parents[1]
    src = load_model(ModelConfig(source="reference:smollm2-135m"), root, QUIET)
    model = src.model
    records = quantize(model, 4, 64, False)
    assert len(records) == 30 * 7
    compressed_tensors.write(tmp_path / "ct", model, src.tokenizer, records)
    ids = src.tokenizer("To be, or not to be, that is the question:", return_tensors="pt").input_ids
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (loaded(ids).logits - model(ids).logits).abs().max().item()
    assert diff <= LOGITS_ATOL, diff
    assert records_identical(records, read_records(tmp_path / "ct").records) == []
    shutil.rmtree(tmp_path / "ct")
    autogptq.write(tmp_path / "gptq", model, src.tokenizer, records)
    assert records_identical(records, read_records(tmp_path / "gptq").records) == []
