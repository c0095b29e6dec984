"""Quantizing on a llama.cpp block type's own grid (``gguf_type``) and exporting it exactly: each
type's records, packed into GGUF blocks and read back by gguf-py's dequantizer (llama.cpp's own
Python port), equal our records bit for bit; llama.cpp runs the files like our model; rows that
K-quant blocks do not divide get llama.cpp's fallback type; other formats refuse such records."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import quants
from pydantic import ValidationError
from transformers import AutoTokenizer

from compress.context import RunContext
from compress.errors import FormatError
from compress.export.gguf import runtime as gguf_runtime
from compress.export.gguf.blocks import PACKERS, ggml_type
from compress.export.gguf.check import check_gguf_records
from compress.export.gguf.config import GGUFExportConfig
from compress.export.gguf.layout import permute_rows, resolve_type
from compress.export.gguf.writer import write_gguf
from compress.paths import usable_cpus
from compress.progress import Reporter
from compress.quantizers.configs import AWQConfig, GPTQConfig, RTNConfig
from compress.quantizers.core import refuse_gguf_grids
from compress.quantizers.gptq import gptq_quantize
from compress.quantizers.grid_search import grid_quantize
from compress.quantizers.grids import GRID_NAMES, GRIDS
from compress.quantizers.rtn import RTNStage
from compress.schema.quantize import QuantScheme
from tests.helpers import recipe_text, run_cli, write_recipe
from tests.tiny import tiny_llama, tiny_model

QUIET = Reporter(quiet=True)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def rtn_records(model: torch.nn.Module, gguf_type: str) -> dict:
    ctx = RunContext(seed=0, device=torch.device("cpu"), tokenizer=None, reporter=QUIET, calibration=lambda: None)
    RTNStage(RTNConfig(gguf_type=gguf_type), "stages[0]").apply(model, ctx)
    return ctx.quantized


def weight_and_hessian(rows: int = 8, cols: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[0, 3] = 1.0  # an outlier: one sub-block's scale far above the others
    x = torch.randn(4 * cols, cols, generator=g) * torch.linspace(0.1, 3, cols)  # unequal input scales: GPTQ has work to do
    return w, 2 * x.T @ x / x.shape[0]


@pytest.mark.parametrize("type_name", GRID_NAMES)
@pytest.mark.parametrize("method", ["rtn", "gptq", "gptq_in_order"])
def test_records_on_each_grid_pack_into_blocks_that_gguf_reads_back_bit_exactly(type_name: str, method: str) -> None:
    w, h = weight_and_hessian()
    scheme = QuantScheme(gguf_type=type_name)
    if method == "rtn":
        record = grid_quantize(w, scheme)
    else:
        record = gptq_quantize(w, h, scheme, act_order=method == "gptq")[0]
    assert record.scheme.gguf_type == type_name
    blocks = PACKERS[type_name](record)
    grid = GRIDS[type_name]
    assert blocks.shape == (8, 512 // grid.block_weights * grid.block_bytes)
    got = quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name.upper()]).reshape(record.shape)
    want = record.dequantize().numpy()
    assert np.array_equal(got, want), f"{int((got != want).sum())} values differ"
    assert torch.equal(record.dequantize(), type(record).from_tensors(record.tensors("r"), "r", record.scheme).dequantize())


@pytest.mark.parametrize("type_name", GRID_NAMES)
def test_each_grids_encoding_takes_the_bytes_of_its_ggml_type(type_name: str) -> None:
    """A grid's block size and parameter encoding (quantizers/grids.py) give the block bytes of the
    ggml type the GGUF export maps it to, as gguf-py lists them."""
    grid = GRIDS[type_name]
    assert gguf.GGML_QUANT_SIZES[ggml_type(type_name)] == (grid.block_weights, grid.block_bytes)


@pytest.mark.parametrize("type_name", ["q4_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"])
def test_gptq_on_a_grid_beats_round_to_nearest_on_the_same_grid(type_name: str) -> None:
    """The error feedback sees the stored grid: GPTQ's records have a lower output error (tr E H Eᵀ)."""
    w, h = weight_and_hessian()
    scheme = QuantScheme(gguf_type=type_name)

    def output_error(record) -> float:
        e = w - record.dequantize()
        return float(torch.einsum("oi,ij,oj->", e, h, e))

    rtn, gptq = output_error(grid_quantize(w, scheme)), output_error(gptq_quantize(w, h, scheme)[0])
    assert gptq < 0.95 * rtn, (gptq, rtn)


def test_q4_1_grid_keeps_the_float_minimum_that_integer_zero_points_cannot() -> None:
    """A group of all-positive weights: the integer-zero-point grid must include 0 and wastes levels;
    Q4_1's own grid starts at the fp16 minimum."""
    w = 3.0 + torch.rand(4, 64, generator=torch.Generator().manual_seed(1))
    plain = grid_quantize(w, QuantScheme(bits=4, group_size=32, symmetric=False))
    own = grid_quantize(w, QuantScheme(gguf_type="q4_1"))
    err = lambda r: float((w - r.dequantize()).abs().max())  # noqa: E731
    assert err(own) < err(plain) / 3  # steps of 1/15 instead of 4/15
    assert own.offset is not None and torch.equal(own.offset, own.offset.half().float())


@pytest.mark.parametrize("type_name", GRID_NAMES)
def test_gguf_file_of_grid_records_reads_back_bit_exactly(tmp_path: Path, tokenizer, type_name: str) -> None:
    model = tiny_llama(len(tokenizer), hidden=256, intermediate=512)
    records = rtn_records(model, type_name)
    path = tmp_path / "m.gguf"
    assert resolve_type("auto", records) == type_name
    facts = write_gguf(path, model, tokenizer, records, type_name, float_type="f32")
    assert check_gguf_records(path, facts["plan"], records) == []
    assert facts["tensor_types"] == {f"{type_name} (record)": 14, "f32 (float)": 6}
    assert facts["type_fallbacks"] == {}
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    heads = {"q_proj": 4, "k_proj": 2}
    for t in facts["plan"].tensors:
        module = t.hf_name.rsplit(".", 1)[0]
        if module not in records:
            continue
        record, data = records[module], stored[t.gguf_name]
        assert data.tensor_type == gguf.GGMLQuantizationType[type_name.upper()]
        got = torch.from_numpy(quants.dequantize(np.asarray(data.data), data.tensor_type).reshape(record.shape).copy())
        kind = module.rsplit(".", 1)[1]
        if kind in heads:  # llama.cpp's rotary row order; undo it to compare with the record
            got = got[torch.argsort(permute_rows(torch.arange(record.shape[0]), heads[kind]))]
        assert torch.equal(got, record.dequantize()), module


@pytest.mark.parametrize(("type_name", "fallback"), [("q4_k", "q5_0"), ("q5_k", "q5_1"), ("q6_k", "q8_0"), ("q3_k", "q4_0")])
def test_rows_k_quant_blocks_do_not_divide_get_llama_cpps_fallback_type(tmp_path: Path, tokenizer, type_name, fallback) -> None:
    """hidden 160 (the Q/K/V/gate/up rows) is no multiple of 256; intermediate 512 (down_proj's rows) is."""
    model = tiny_model("llama", seed=1, vocab=len(tokenizer), hidden=160, intermediate=512, heads=5, kv_heads=1, positions=256, tie=True)
    records = rtn_records(model, type_name)
    assert {r.scheme.gguf_type for n, r in records.items() if n.endswith("down_proj")} == {type_name}
    assert {r.scheme.gguf_type for n, r in records.items() if not n.endswith("down_proj")} == {fallback}
    path = tmp_path / "m.gguf"
    facts = write_gguf(path, model, tokenizer, records, resolve_type("auto", records), float_type="f32")
    assert check_gguf_records(path, facts["plan"], records) == []
    assert facts["tensor_types"][f"{type_name} (record)"] == 2 and facts["tensor_types"][f"{fallback} (record)"] == 12
    assert len(facts["type_fallbacks"]) == 12 and all(fallback.upper() in why for why in facts["type_fallbacks"].values())
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_down.weight"] == type_name.upper() and types["blk.0.attn_q.weight"] == fallback.upper()


def test_k_quant_export_refuses_records_on_another_grid(tmp_path: Path, tokenizer) -> None:
    model = tiny_llama(len(tokenizer), hidden=256, intermediate=512)
    records = rtn_records(model, "q4_1")
    with pytest.raises(FormatError, match="not on the Q4_K grid"):
        write_gguf(tmp_path / "m.gguf", model, tokenizer, records, "q4_k")


def test_other_formats_refuse_records_only_gguf_can_hold() -> None:
    w, _ = weight_and_hessian()
    from compress.export.checkpoint.compressed_tensors import stored_scheme

    for type_name in ("q4_1", "q4_k", "q6_k"):
        record = grid_quantize(w, QuantScheme(gguf_type=type_name))
        with pytest.raises(FormatError, match="only GGUF stores"):
            refuse_gguf_grids({"layer": record}, "compressed-tensors")
        assert stored_scheme(record.scheme, record.shape) is None  # the artifact keeps it in its records file
    plain = grid_quantize(w, QuantScheme(gguf_type="q4_0"))  # Q4_0 is our symmetric 4-bit g32: every format holds it
    refuse_gguf_grids({"layer": plain}, "onnx")
    assert stored_scheme(plain.scheme, plain.shape) is not None


@pytest.mark.runtime
@pytest.mark.skipif(not gguf_runtime.available(), reason="llama-cpp-python is not installed")
@pytest.mark.parametrize("type_name", ["q4_1", "q4_k", "q6_k", "q3_k"])
def test_llama_cpp_runs_our_grid_records_like_our_model(tmp_path: Path, tiny_model_dir: Path, type_name: str) -> None:
    from compress.eval.metrics import compare, torch_forward

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = tiny_llama(len(tok), hidden=256, intermediate=512)
    with torch.no_grad():  # sharpen the random init's attention so that row order matters
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8)
    records = rtn_records(model, type_name)  # installs the dequantized records in the model
    path = tmp_path / "m.gguf"
    write_gguf(path, model, tok, records, type_name)
    runtime = gguf_runtime.LlamaCppModel(path, n_ctx=64, threads=usable_cpus())
    try:
        ids = torch.randint(0, len(tok), (2, 48), generator=torch.Generator().manual_seed(0))
        same = compare(torch_forward(model, torch.device("cpu")), {"gguf": runtime.forward}, ids, 8)["gguf"]
    finally:
        runtime.close()
    assert same["kl_divergence"] < 2e-3 and same["top1_agreement"] > 0.85, same


# --------------------------------------------------------------------------- recipe keys and spellings


def test_gguf_type_fixes_the_scheme_and_bad_values_name_the_key() -> None:
    config = GPTQConfig(gguf_type="Q4_K")
    assert (config.gguf_type, config.bits, config.group_size, config.symmetric, config.scale_dtype) == ("q4_k", 4, 32, False, "float32")
    assert config.scheme().for_width(576).gguf_type == "q5_0" and config.scheme().for_width(512).gguf_type == "q4_k"
    with pytest.raises(ValidationError, match="gguf_type 'q9_k': expected one of"):
        GPTQConfig(gguf_type="q9_k")
    with pytest.raises(ValidationError, match="fixes bits to 4"):
        RTNConfig(gguf_type="q4_k", bits=3)
    with pytest.raises(ValidationError, match="rtn and gptq"):
        AWQConfig(gguf_type="q4_k")
    with pytest.raises(ValidationError, match="backend: compress"):
        GPTQConfig(gguf_type="q4_k", backend="llmcompressor")


def test_cli_validate_refuses_a_bad_gguf_type_with_exit_2(tmp_path: Path) -> None:
    text = recipe_text("m", "t").replace("      bits: 4\n      group_size: 64\n      symmetric: true\n", "      gguf_type: {}\n")
    good = write_recipe(tmp_path, text.format("Q4_K"), "good.yaml")
    assert run_cli(["validate", good]).exit_code == 0, run_cli(["validate", good]).output
    result = run_cli(["validate", write_recipe(tmp_path, text.format("q4_x"), "bad.yaml")])
    assert result.exit_code == 2 and "gguf_type 'q4_x'" in result.output and "Traceback" not in result.output


def test_export_type_accepts_llama_cpp_spellings_and_names_what_a_mix_does() -> None:
    assert (GGUFExportConfig(type="Q4_K_M").type, GGUFExportConfig(type="Q4_K_M").quantizer) == ("q4_k_m", "llama.cpp")
    assert (GGUFExportConfig(type="F16").type, GGUFExportConfig(type="F16").quantizer) == ("f16", "records")
    assert (GGUFExportConfig(type="Q4_K").type, GGUFExportConfig(type="Q4_K").quantizer) == ("q4_k", "records")
    assert GGUFExportConfig(type="q4_0", float_type="Q8_0", fallback="F16").float_type == "q8_0"
    # A mix is llama.cpp's per-tensor rule: quantizer records cannot write it from one grid, and says what to do instead.
    with pytest.raises(ValidationError, match="Q4_K_M is llama.cpp's per-tensor mix.*use type q4_k"):
        GGUFExportConfig(type="q4_k_m", quantizer="records")


def test_q6_k_without_a_quantizer_packs_records_on_its_grid_else_asks_llama_cpp(tokenizer) -> None:
    from compress.export.gguf.export import with_records_quantizer

    cfg = GGUFExportConfig(type="Q6_K")
    model = tiny_llama(len(tokenizer), hidden=256, intermediate=512)
    assert with_records_quantizer(cfg, rtn_records(model, "q6_k")).quantizer == "records"
    assert with_records_quantizer(cfg, rtn_records(tiny_llama(len(tokenizer)), "q4_0")).quantizer == "llama.cpp"
    assert with_records_quantizer(GGUFExportConfig(type="q6_k", quantizer="llama.cpp"), rtn_records(model, "q6_k")).quantizer == "llama.cpp"


@pytest.mark.runtime
@pytest.mark.skipif(not gguf_runtime.available(), reason="llama-cpp-python is not installed")
def test_llama_cpp_pure_quantizer_makes_one_k_quant_type_and_the_bench_names_both_sides(tmp_path: Path, tokenizer) -> None:
    """`compress bench gguf` compares GPTQ on a type's grid with llama.cpp's own quantizer at that one type (--pure)."""
    from compress.eval.bench.gguf import Candidate

    model = tiny_llama(len(tokenizer), hidden=256, intermediate=512)
    f16 = tmp_path / "f16.gguf"
    write_gguf(f16, model, tokenizer, {}, "f16")
    out = tmp_path / "q4k.gguf"
    gguf_runtime.quantize(f16, out, "q4_k", threads=usable_cpus(), token_embedding_type="q8_0", pure=True)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors if t.name.startswith("blk.") and "norm" not in t.name}
    assert types and set(types.values()) == {"Q4_K"}
    with pytest.raises(FormatError, match="not offered pure"):
        gguf_runtime.quantize(f16, out, "q4_k_m", threads=usable_cpus(), pure=True)
    ours, theirs = Candidate.parse("gptq:Q4_K"), Candidate.parse("llama.cpp-pure:q4_k")
    assert (ours.gguf_type, ours.type_name, theirs.type_name) == ("q4_k", "q4_k", "q4_k") and theirs.llama_cpp and not ours.llama_cpp
    with pytest.raises(ValueError, match="llama.cpp-pure type must be one of"):
        Candidate.parse("llama.cpp-pure:q4_k_m")
    head = Candidate.parse("gptq:W4g32s+head")
    assert head.head and not ours.head and head.type_name == "q4_0" and head.name == "gptq W4 g32 sym -> Q4_0, head too"
    for bad in ("llama.cpp:q4_0+head", "gptq:mix@q4_0+head"):
        with pytest.raises(ValueError, match=r"\+head follows one of our methods"):
            Candidate.parse(bad)
    q8 = Candidate.parse("gptq:W4g32s+head:Q8_0")  # llama.cpp's spelling; the head on a grid of its own
    assert q8.head and q8.head_type == "q8_0" and q8.type_name == "q4_0" and q8.name == "gptq W4 g32 sym -> Q4_0, head Q8_0"
    for bad in ("gptq:W4g32s+head:q4_k_m", "gptq:W4g32s+headq8_0", "gptq:W4g32s+head:"):
        with pytest.raises(ValueError, match=r"\+head:TYPE takes a GGUF type with a grid"):
            Candidate.parse(bad)


def _run_on_grid(tmp_path: Path, text_dir: Path, stage: str, export: str) -> dict:
    """`compress run` on a tiny Llama (256 wide, MLP 320) with the quantize stage's keys ``stage`` and a
    GGUF export with ``export``'s keys (not verified); its manifest."""
    import json

    from tests.conftest import texts_of
    from tests.tiny import tiny_llama_dir

    model_dir = tiny_llama_dir(tmp_path / "m", texts_of(text_dir), hidden=256, intermediate=320)
    # 6 x 64 calibration tokens: at least down_proj's 320 input columns (the calibration check `tokens`)
    text = recipe_text(model_dir, text_dir, cal_samples=6).replace(
        "      method: rtn\n      bits: 4\n      group_size: 64\n      symmetric: true\n", stage
    )
    text = text.replace("exports: []\n", f"exports:\n  - format: gguf\n{export}    verify: false\n")
    out = tmp_path / "out"
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", out])
    assert result.exit_code == 0, result.output
    return json.loads((out / "manifest.json").read_text())


def test_pipeline_gptq_on_the_q4_k_grid_exports_an_exact_gguf_with_its_fallbacks_stated(tmp_path: Path, text_dir: Path) -> None:
    """`compress run`: GPTQ with gguf_type Q4_K, the records kept in the artifact's records file (model/
    cannot hold them), read back and packed exactly; down_proj's 320-wide rows become Q5_0, said in the manifest."""
    manifest = _run_on_grid(tmp_path, text_dir, "      method: gptq\n      gguf_type: Q4_K\n", "    type: Q4_K\n")
    entry = manifest["exports"][0]
    assert (entry["type"], entry["quantizer"], entry["records_exact"]) == ("q4_k", "records", 14)
    assert entry["tensor_types"]["q4_k (record)"] == 12 and entry["tensor_types"]["q5_0 (record)"] == 2
    assert sorted(entry["type_fallbacks"]) == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    layers = manifest["quantization"]["layers"]
    assert layers["model.layers.0.self_attn.q_proj"]["scheme"]["gguf_type"] == "q4_k"
    assert layers["model.layers.0.mlp.down_proj"]["scheme"]["gguf_type"] == "q5_0"
    assert layers["model.layers.0.self_attn.q_proj"]["stored_as"] == "records"


@pytest.mark.parametrize("type_name", ["f32", "f16", "bf16", "q8_0"])
def test_float_tensors_convert_a_piece_of_rows_at_a_time_to_the_same_bytes(monkeypatch: pytest.MonkeyPatch, type_name: str) -> None:
    from compress.export.gguf import blocks as gguf_blocks

    w = torch.randn(100, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    monkeypatch.setattr(gguf_blocks, "FLOAT_ROWS", 1000)
    whole = gguf_blocks.float_bytes(w, type_name)
    monkeypatch.setattr(gguf_blocks, "FLOAT_ROWS", 16)  # 7 pieces, the last one short
    pieces = gguf_blocks.float_bytes(w, type_name)
    assert pieces.shape == whole.shape and pieces.dtype == whole.dtype
    assert np.array_equal(pieces.view(np.uint8), whole.view(np.uint8))
    if type_name == "q8_0":
        assert np.array_equal(whole, quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType.Q8_0))


@pytest.mark.parametrize("type_name", ["q4_0", "q4_1", "q3_k", "q4_k", "q6_k"])
def test_the_range_search_rounds_no_row_worse_than_the_plain_range(monkeypatch: pytest.MonkeyPatch, type_name: str) -> None:
    """Each row's parameters come from the best of its shrunk ranges (grid_search.CLIP): per row, the
    rounding error is at most the plain min/max range's, and smaller overall on heavy-tailed weights."""
    from compress.quantizers import grid_search
    from compress.schema.quantize import QuantScheme

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 512, generator=gen) ** 3  # heavy tails: a few weights set the plain range
    scheme = QuantScheme(gguf_type=type_name)
    monkeypatch.setattr(grid_search, "REFIT_ROUNDS", 0)  # the range search alone (the refit's own test is below)
    monkeypatch.setattr(grid_search, "SUB_STEPS", ())  # and no sub-block search (its own test is below)

    def row_errors() -> torch.Tensor:
        return (grid_search.grid_quantize(w, scheme).dequantize().float() - w).square().sum(dim=1)

    searched = row_errors()
    monkeypatch.setattr(grid_search, "CLIP", (1.0,))
    plain = row_errors()
    assert bool((searched <= plain * (1 + 1e-6)).all())
    if type_name != "q6_k":  # 6 bits: fine enough that no shrunk range pays for its clipped outliers here
        assert float(searched.sum()) < float(plain.sum())


@pytest.mark.parametrize("type_name", GRID_NAMES)
@pytest.mark.parametrize("weighted", [False, True])
def test_the_least_squares_refit_rounds_no_row_worse_and_the_whole_weight_better(
    monkeypatch: pytest.MonkeyPatch, type_name: str, weighted: bool
) -> None:
    """After the range search, each unit's stored scales (and minimums) are refit to their codes by
    (weighted) least squares (grid_search.REFIT_ROUNDS): per row the error is at most the search's alone,
    and smaller over the whole weight on every type; the refit records stay exact (the test above)."""
    from compress.quantizers import grid_search

    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 512, generator=gen) * 0.02 + 0.003 * torch.randn(64, 1, generator=gen)  # rows off centre: minimums matter
    w[::7, 5] = 0.2  # a few outliers
    importance = torch.rand(512, generator=gen) * 4 + 0.1 if weighted else None
    scheme = QuantScheme(gguf_type=type_name)
    monkeypatch.setattr(grid_search, "SUB_STEPS", ())  # the ranges' refit alone (the sub-block search's test is above)

    def row_errors() -> torch.Tensor:
        params = grid_search.GridParams(64, 512, scheme, w.device)
        params.fix_all(w, importance)
        _, values = params.round(w, torch.arange(512) // scheme.group_width(512))
        err = (values - w).square()
        return (err if importance is None else err * importance).sum(dim=1)

    refit = row_errors()
    monkeypatch.setattr(grid_search, "REFIT_ROUNDS", 0)
    searched = row_errors()
    assert bool((refit <= searched).all())
    assert float(refit.sum()) < 0.995 * float(searched.sum())


@pytest.mark.parametrize("type_name", ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"])
def test_the_sub_block_search_finds_a_source_k_quant_grid_again(monkeypatch: pytest.MonkeyPatch, type_name: str) -> None:
    """Weights dequantized from a K-quant file made as llama.cpp makes them (the largest sub-block scale
    on scale_levels, or on -(scale_levels + 1) where scales are signed; every sub-block using its lowest
    and highest code) round back to themselves: the sub-block step search (grid_search.SUB_STEPS) finds
    each sub-block's codes (or, signed, their mirror image), hence its scale and ``d``. Without it, the range search and the refit do
    not where sub-blocks of one super-block span different numbers of codes
    (the real case: Qwen2.5-Coder-1.5B, distributed as Q4_K_M; scripts/experiments/rounding_choice.py). Stored
    in bfloat16 (as that model's checkpoint is), the weights are rounded as closely as the source grid
    holds them."""
    from compress.quantizers import grid_search

    gen = torch.Generator().manual_seed(3)
    scheme = QuantScheme(gguf_type=type_name)
    rows, in_f = 32, 512
    src = grid_search.GridParams(rows, in_f, scheme, torch.device("cpu"))
    grid, qmax, levels = src.grid, scheme.qmax, src.grid.scale_levels
    subs = in_f // grid.group
    codes = torch.randint(0, qmax + 1, (rows, subs, grid.group), generator=gen).float()
    codes[..., 0], codes[..., 1] = 0, qmax  # even sub-blocks span every code,
    odd = codes[:, 1::2]  # odd ones one fewer, as llama.cpp's step search often leaves them
    if grid.signed_scales:  # (the extreme weight a level in from the lowest code)
        odd.clamp_(min=1)[..., 0] = 1
    else:  # (the highest code unused)
        odd.clamp_(max=qmax - 1)[..., 1] = qmax - 1
    for u in range(src.n_units):
        groups = slice(u * src.per_unit, (u + 1) * src.per_unit)
        d = (torch.rand(rows, generator=gen) * 1e-3 + 1e-4).half().float()
        if grid.signed_scales:
            sc = torch.randint(-levels, levels + 1, (rows, src.per_unit), generator=gen).float()
            sc[:, 0] = -levels - 1
            src._set_k(u, groups, d, src.dmin[:, u], sc, src.sub_mins[:, groups])
            src.zero[:, groups] = float(scheme.symmetric_zero)
        else:
            sc = torch.randint(1, levels + 1, (rows, src.per_unit), generator=gen).float()
            mn = torch.randint(0, levels + 1, (rows, src.per_unit), generator=gen).float()
            sc[:, 0], mn[:, 1] = levels, levels
            dmin = (torch.rand(rows, generator=gen) * 1e-3 + 1e-4).half().float()
            src._set_k(u, groups, d, dmin, sc, mn)
    source_codes = codes.reshape(rows, in_f)
    w = src.record(source_codes).dequantize().float()

    def again(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        record = grid_search.grid_quantize(weight, scheme)
        return record.codes.float(), record.dequantize().float()

    assert float((again(w)[1] - w).abs().max()) <= 1e-6 * float(w.abs().max())
    stored = w.bfloat16().float()  # off the grid by bfloat16's rounding: rounded as close as the source grid is
    assert float((again(stored)[1] - stored).square().sum()) <= 1.15 * float((w - stored).square().sum())
    monkeypatch.setattr(grid_search, "SUB_STEPS", ())
    assert float((again(w)[1] - w).square().sum()) > 1e-6 * float(w.square().sum())
    assert float((again(stored)[1] - stored).square().sum()) > 2 * float((w - stored).square().sum())


@pytest.mark.parametrize("type_name", GRID_NAMES)
def test_all_units_searched_at_once_give_the_parameters_of_the_search_unit_by_unit(type_name: str) -> None:
    """GridParams.fix_all searches every unit of every row as one problem; GPTQ's column loop calls
    fix unit by unit. Both give the same parameters, bit for bit, weighted or not."""
    from compress.quantizers.grid_search import GridParams

    w, h = weight_and_hessian(rows=16)
    scheme = QuantScheme(gguf_type=type_name)
    for importance in (None, torch.diagonal(h)):
        together, alone = GridParams(16, 512, scheme, w.device), GridParams(16, 512, scheme, w.device)
        together.fix_all(w, importance)
        for u in range(alone.n_units):
            cols = slice(u * alone.unit, (u + 1) * alone.unit)
            alone.fix(u, w[:, cols], None if importance is None else importance[cols])
        names = ["scale", "zero", "offset"] + (["d", "dmin", "sub_scales", "sub_mins"] if together.k_quant else [])
        for name in names:
            assert torch.equal(getattr(together, name), getattr(alone, name)), name


def test_pipeline_records_on_the_q4_0_grid_are_packed_in_model_and_come_back_on_their_grid(tmp_path: Path, text_dir: Path) -> None:
    """Q4_0 / Q8_0 grid records are plain symmetric records: model/ packs them (compressed-tensors has no
    grid name), the manifest keeps the grid, and reading the artifact back gives the records on it."""
    manifest = _run_on_grid(tmp_path, text_dir, "      method: rtn\n      gguf_type: Q4_0\n", "")
    layer = manifest["quantization"]["layers"]["model.layers.0.self_attn.q_proj"]
    assert layer["scheme"]["gguf_type"] == "q4_0" and layer["stored_as"] == "compressed-tensors"
    entry = manifest["exports"][0]
    assert (entry["type"], entry["records_exact"]) == ("q4_0", 14)


@pytest.mark.runtime
def test_bench_gguf_head_on_q8_0_has_llama_cpps_q4_0_layout(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    """`+head:q8_0`: GPTQ's head on the type llama.cpp's Q4_0 gives a tied model's one table; the file has
    llama.cpp's own Q4_0 layout tensor for tensor, so its size is llama.cpp's to the byte of metadata."""
    from tests.helpers import run_gguf_bench

    pytest.importorskip("llama_cpp")
    out = tmp_path / "bench"
    saved = run_gguf_bench(out, tiny_model_dir, text_dir, "llama.cpp:q4_0,gptq:W4g32s+head:q8_0")
    rows = {r["name"]: r for r in saved["rows"]}
    theirs, ours = rows["llama.cpp Q4_0"], rows["gptq W4 g32 sym -> Q4_0, head Q8_0"]
    assert ours["tensor_types"] == theirs["tensor_types"] and ours["records_exact"] == 15
    assert abs(ours["size_bytes"] - theirs["size_bytes"]) < 0.001 * theirs["size_bytes"]
    # the equal-bytes pair: ours against llama.cpp's file of its type, ratios of size, KL and decode speed
    (pair,) = saved["pairs"]
    assert pair["ours"] == ours["name"] and pair["llama_cpp"] == theirs["name"] and pair["equal_bytes"]
    assert pair["kl_ratio"] == pytest.approx(ours["metrics"]["kl_divergence"] / theirs["metrics"]["kl_divergence"], rel=1e-3)
    assert "| gptq W4 g32 sym -> Q4_0, head Q8_0 | llama.cpp Q4_0 | 1.0000 |" in (out / "results.md").read_text()
