"""Mixed precision under a size budget (quantizers/mix.py): the GGUF export's `target:` picks a block
type per layer from measured sensitivity, a quantize stage with `gguf_target: true` quantizes each
layer on it, and the file keeps within the budget, packed exactly and verified in llama.cpp."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from compress.errors import CompressError
from compress.export.gguf.layout import tensor_bytes
from compress.quantizers.mix import LayerChoice, _hull, allocate, candidate_types
from tests.conftest import texts_of
from tests.helpers import recipe_text, run_cli, run_gguf_bench, write_recipe


def _layer(name: str, options: list[tuple[str, int, float]]) -> LayerChoice:
    return LayerChoice(name, (1, 1), options)


def test_candidates_are_the_types_a_row_can_hold_with_llama_cpps_fallbacks() -> None:
    assert candidate_types(512, ["q2_k", "q4_k", "q8_0"]) == ["q2_k", "q4_k", "q8_0"]
    # 576 wide: no K-quant block fits; q2_k -> q4_0, q4_k -> q5_0, q6_k -> q8_0 (deduplicated)
    assert candidate_types(576, ["q2_k", "q3_k", "q4_k", "q6_k", "q8_0"]) == ["q4_0", "q5_0", "q8_0"]
    assert candidate_types(100, ["q4_k", "q8_0"]) == []  # not even 32 divides it


def test_tensor_bytes_are_ggmls_block_sizes_padded_to_the_alignment() -> None:
    assert tensor_bytes("q4_k", (4, 256)) == 4 * 144
    assert tensor_bytes("q8_0", (1, 32)) == 64  # 34 bytes, padded to 32
    assert tensor_bytes("f32", (3,)) == 32


def test_the_fixed_part_counts_the_biases_of_the_quantized_layers() -> None:
    """Qwen2's q/k/v biases stay F32 beside their quantized weights: they count against the budget
    (missing them put a 1.5B file 0.001 bits/weight over its target)."""
    from compress.export.gguf.config import GGUFExportConfig
    from compress.export.gguf.plugin import GGUF
    from tests.tiny import prunable_model

    model = prunable_model("qwen2", layers=2)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    export = GGUFExportConfig(format="gguf", float_type="q8_0", target={"bits_per_weight": 4.0})
    layout = GGUF.file_layout(export, model, None, linears)
    fixed, params = layout.fixed_bytes, layout.params
    state = {n: t for n, t in model.state_dict().items() if n != "lm_head.weight"}  # tied: token_embd serves both
    assert params == sum(t.numel() for t in state.values())
    biases = [n for n in state if n.endswith("_proj.bias")]
    assert len(biases) == 6
    expected = sum(
        tensor_bytes("f32" if t.dim() == 1 else "q8_0", tuple(t.shape))
        for n, t in state.items()
        if not (n.endswith(".weight") and n[: -len(".weight")] in linears)
    )
    assert fixed == expected


def test_the_hull_drops_options_that_buy_less_per_byte_than_a_larger_one() -> None:
    options = [("a", 10, 1.0), ("b", 20, 0.9), ("c", 30, 0.1), ("d", 40, 0.2)]
    # b removes 0.1 for 10 bytes where c removes 0.9 for 20: b is below the line; d is worse than c
    assert _hull(options) == [0, 2]


def test_allocation_keeps_the_budget_and_spends_it_where_it_removes_the_most_error() -> None:
    sensitive = _layer("sensitive", [("q2", 100, 10.0), ("q4", 200, 1.0), ("q8", 400, 0.1)])
    robust = _layer("robust", [("q2", 100, 0.5), ("q4", 200, 0.1), ("q8", 400, 0.01)])
    used = allocate([sensitive, robust], 300)
    assert used == 300 and (sensitive.type, robust.type) == ("q4", "q2")
    used = allocate([sensitive, robust], 600)
    assert used == 600 and (sensitive.type, robust.type) == ("q8", "q4")
    # every assignment within 600 bytes, by brute force: none has a smaller total estimate
    best = min(a[2] + b[2] for a in sensitive.options for b in robust.options if a[1] + b[1] <= 600)
    assert sensitive.estimate + robust.estimate == pytest.approx(best)


def test_a_budget_below_the_smallest_types_is_an_error() -> None:
    with pytest.raises(CompressError, match="takes 200 bytes, over the 150"):
        allocate([_layer("a", [("q2", 100, 1.0)]), _layer("b", [("q2", 100, 1.0)])], 150)


def _mix_recipe(model_dir: Path, text_dir: Path, method: str, target: str, verify: str = "false") -> str:
    # 8 x 64 calibration tokens: as many as down_proj's 512 input columns (the calibration check `tokens`)
    text = recipe_text(model_dir, text_dir, cal_samples=8).replace(
        "      method: rtn\n      bits: 4\n      group_size: 64\n      symmetric: true\n",
        f"      method: {method}\n      gguf_target: true\n",
    )
    return text.replace("exports: []\n", f"exports:\n  - format: gguf\n    name: mix\n    target: {target}\n    verify: {verify}\n")


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory: pytest.TempPathFactory, text_dir: Path) -> Path:
    """A tiny llama whose widths K-quants divide (256 wide; MLP 512)."""
    from tests.tiny import tiny_llama_dir

    return tiny_llama_dir(tmp_path_factory.mktemp("wide") / "m", texts_of(text_dir), hidden=256, intermediate=512)


@pytest.mark.runtime
def test_a_budget_picks_several_types_keeps_within_it_and_packs_them_exactly(tmp_path: Path, wide_model_dir: Path, text_dir: Path) -> None:
    """`compress run`: GPTQ on the types a 4.0 bits/weight budget chose; the GGUF's tensors hold the
    records bit for bit, the file is at most 4.0 bits/weight, and the manifest records the choice."""
    out = tmp_path / "out"
    result = run_cli(
        ["run", write_recipe(tmp_path, _mix_recipe(wide_model_dir, text_dir, "gptq", "{bits_per_weight: 4.0}", "true")), "-o", out]
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    mix = manifest["stages"][0]["summary"]["gguf_mix"]
    assert len(mix["type_counts"]) > 1, mix["type_counts"]  # a mix, not one type
    assert mix["bits_per_weight"] <= 4.0 and mix["tensor_bytes"] <= mix["budget_bytes"]
    entry = manifest["exports"][0]
    # 14 Linears and the one table of this tied model (token_embd, from the head's record: target.tables)
    assert entry["type"] == "mix" and entry["records_exact"] == 15 and entry["verified"] and "one_table" in entry
    assert set(mix["table_records"]) == {"lm_head"} and mix["tables"] == {"tied": True, "names": ["lm_head"]}
    assert entry["target"]["bits_per_weight"] <= 4.0
    assert entry["target"]["tensor_bytes"] == mix["tensor_bytes"]  # the plan's bytes are the file's
    layers = manifest["quantization"]["layers"]
    for name, chosen in mix["layers"].items():
        assert (layers.get(name) or mix["table_records"][name]) is not None
        if name in layers:
            assert layers[name]["scheme"]["gguf_type"] == chosen["type"].lower()
        assert chosen["estimated_kl"] == chosen["options"][chosen["type"]]
    # of two layers of one shape, the one Q2_K would hurt most gets at least as many bits
    bits = {"Q2_K": 2.625, "Q3_K": 3.4375, "Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625, "Q8_0": 8.5}
    same = [n for n in mix["layers"] if n.endswith(("q_proj", "o_proj"))]
    worst = max(same, key=lambda n: mix["layers"][n]["options"]["Q2_K"])
    least = min(same, key=lambda n: mix["layers"][n]["options"]["Q2_K"])
    assert bits[mix["layers"][worst]["type"]] >= bits[mix["layers"][least]["type"]]


def test_a_size_in_mib_counts_the_files_metadata(tmp_path: Path, wide_model_dir: Path, text_dir: Path) -> None:
    out = tmp_path / "out"
    budget = 0.75  # MiB: the tiny model's tokenizer metadata is a sizeable share of it
    result = run_cli(["run", write_recipe(tmp_path, _mix_recipe(wide_model_dir, text_dir, "rtn", f"{{size_mib: {budget}}}")), "-o", out])
    assert result.exit_code == 0, result.output
    entry = json.loads((out / "manifest.json").read_text())["exports"][0]
    assert entry["target"]["file_bytes"] <= budget * 2**20
    assert entry["size_bytes"] == entry["target"]["file_bytes"]


def test_the_estimate_ranks_layers_as_the_measured_kl_does(wide_model_dir: Path, text_dir: Path) -> None:
    """The estimated ΔKL of quantizing one layer alone to Q2_K against the KL measured by doing it:
    the estimator's ranking of the layers agrees with the measurement (Spearman > 0.6)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compress.progress import Reporter
    from compress.quantizers.mix import measure
    from compress.quantizers.rtn import rtn_quantize
    from compress.schema.quantize import QuantScheme

    model = AutoModelForCausalLM.from_pretrained(wide_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(wide_model_dir)
    ids = tok("\n".join(texts_of(text_dir)), return_tensors="pt").input_ids[0]
    tokens = ids[: 8 * 64].reshape(8, 64)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    choices = measure(model, linears, ["q2_k"], tokens, 4, torch.device("cpu"), 0, Reporter(quiet=True), "test", tensor_bytes)
    estimated = {c.name: c.options[0][2] for c in choices}
    with torch.no_grad():
        base = torch.log_softmax(model(tokens).logits.float(), -1)
        measured = {}
        for name, module in linears.items():
            keep = module.weight.data.clone()
            module.weight.data = rtn_quantize(keep, QuantScheme(gguf_type="q2_k")).dequantize().to(keep.dtype)
            logp = torch.log_softmax(model(tokens).logits.float(), -1)
            measured[name] = float((base.exp() * (base - logp)).sum(-1).mean())
            module.weight.data = keep
    names = sorted(linears)
    rank = lambda d: torch.tensor([sorted(d.values()).index(d[n]) for n in names], dtype=torch.float)  # noqa: E731
    rho = float(torch.corrcoef(torch.stack([rank(estimated), rank(measured)]))[0, 1])
    assert rho > 0.6, (rho, estimated, measured)
    total_est, total_meas = sum(estimated.values()), sum(measured.values())
    assert 0.25 < total_est / total_meas < 4, (total_est, total_meas)  # the same scale (nats per token)


@pytest.fixture(scope="module")
def untied_model_dir(tmp_path_factory: pytest.TempPathFactory, text_dir: Path) -> Path:
    """The wide tiny llama with its output head apart from its token embedding."""
    from tests.tiny import tiny_llama_dir

    return tiny_llama_dir(tmp_path_factory.mktemp("untied") / "m", texts_of(text_dir), hidden=256, intermediate=512, tie=False)


@pytest.mark.runtime
def test_an_untied_models_embedding_and_head_take_part_in_the_budget(tmp_path: Path, untied_model_dir: Path, text_dir: Path) -> None:
    """At 3.0 bits/weight the untied model's two tables cannot stay at Q8_0 (the budget is below the
    smallest file that leaves them so: exit 2); with target.tables (the default) both get block types
    of their own, are packed exactly and the file runs in llama.cpp with the same weights."""
    fixed = _mix_recipe(untied_model_dir, text_dir, "rtn", "{bits_per_weight: 3.0, tables: false}")
    result = run_cli(["run", write_recipe(tmp_path, fixed, "fixed.yaml"), "-o", tmp_path / "fixed"])
    assert result.exit_code == 2 and "below the smallest file these types make" in result.output, result.output
    out = tmp_path / "out"
    result = run_cli(
        ["run", write_recipe(tmp_path, _mix_recipe(untied_model_dir, text_dir, "rtn", "{bits_per_weight: 3.0}", "true")), "-o", out]
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    mix = manifest["stages"][0]["summary"]["gguf_mix"]
    assert mix["tables"] == {"tied": False, "names": ["lm_head", "model.embed_tokens"]}
    assert mix["bits_per_weight"] <= 3.0 and mix["tensor_bytes"] <= mix["budget_bytes"]
    entry = manifest["exports"][0]
    assert entry["records_exact"] == 16 and entry["verified"] and "one_table" not in entry  # 14 Linears, the head, the embedding
    stored = entry["tensor_type_of"]
    for table, gguf_name in (("lm_head", "output.weight"), ("model.embed_tokens", "token_embd.weight")):
        assert stored[gguf_name] == mix["layers"][table]["type"].lower() != "q8_0"
        assert mix["table_records"][table]["bits_per_weight"] < 8.5
    assert entry["target"]["bits_per_weight"] <= 3.0


def test_tables_false_keeps_them_at_float_type(tmp_path: Path, wide_model_dir: Path, text_dir: Path) -> None:
    out = tmp_path / "out"
    recipe = _mix_recipe(wide_model_dir, text_dir, "rtn", "{bits_per_weight: 5.0, tables: false}")
    result = run_cli(["run", write_recipe(tmp_path, recipe), "-o", out])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    mix = manifest["stages"][0]["summary"]["gguf_mix"]
    assert mix["tables"] == "fixed at float_type" and "table_records" not in mix and "lm_head" not in mix["layers"]
    assert manifest["exports"][0]["tensor_type_of"]["token_embd.weight"] == "q8_0"


@pytest.mark.parametrize("tie", [True, False])
def test_the_tables_estimates_are_on_the_measured_scale(tie: bool, wide_model_dir: Path, untied_model_dir: Path, text_dir: Path) -> None:
    """Each table's estimated ΔKL of Q2_K against the KL measured by rounding that table alone (both
    of its uses for a tied model's one table): the same scale, as for the Linears."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compress.progress import Reporter
    from compress.quantizers.grid_search import grid_quantize
    from compress.quantizers.mix import budget_tables, measure
    from compress.schema.quantize import QuantScheme

    directory = wide_model_dir if tie else untied_model_dir
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(directory)("\n".join(texts_of(text_dir)), return_tensors="pt").input_ids[0]
    tokens = ids[: 8 * 64].reshape(8, 64)
    tables = budget_tables(model, set())
    assert tables.tied == tie and tables.names == (["lm_head"] if tie else ["lm_head", "model.embed_tokens"])
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    choices = measure(model, linears, ["q2_k"], tokens, 4, torch.device("cpu"), 0, Reporter(quiet=True), "t", tensor_bytes, tables)
    estimated = {c.name: c.options[0][2] for c in choices if c.name in tables.names}
    with torch.no_grad():
        base = torch.log_softmax(model(tokens).logits.float(), -1)
        for name, estimate in estimated.items():
            module = model.get_submodule(name)
            keep = module.weight.data.clone()
            module.weight.data = grid_quantize(keep, QuantScheme(gguf_type="q2_k")).dequantize().to(keep.dtype)  # tied: both uses
            logp = torch.log_softmax(model(tokens).logits.float(), -1)
            measured = float((base.exp() * (base - logp)).sum(-1).mean())
            module.weight.data = keep
            assert 0.5 < estimate / measured < 2, (name, estimate, measured)  # measured: 0.75 to 0.99


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.replace("      gguf_target: true\n", "      gguf_type: q4_k\n"), "add `gguf_target: true`"),
        (lambda t: t.replace("    target: {bits_per_weight: 4.0}\n", ""), "no export has one"),
        (lambda t: t.replace("    target:", "    type: q4_0\n    target:"), "leave type and quantizer out"),
        (lambda t: t.replace("{bits_per_weight: 4.0}", "{bits_per_weight: 4.0, size_mib: 3}"), "exactly one of"),
        (lambda t: t.replace("{bits_per_weight: 4.0}", "{bits_per_weight: 4.0, types: [q4_k, iq4_xs]}"), "iq4_xs"),
        (lambda t: t.replace("      gguf_target: true\n", "      gguf_target: true\n      gguf_type: q4_k\n"), "remove gguf_type"),
        (lambda t: t.replace("method: gptq", "method: awq"), "awq quantizes on its own integer grid"),
    ],
)
def test_bad_budgets_are_refused_naming_the_key(tmp_path: Path, wide_model_dir: Path, text_dir: Path, edit, message: str) -> None:
    text = edit(_mix_recipe(wide_model_dir, text_dir, "gptq", "{bits_per_weight: 4.0}"))
    result = run_cli(["validate", write_recipe(tmp_path, text)])
    assert result.exit_code == 2 and message in result.output, result.output


def test_a_budget_no_mix_can_reach_exits_2_with_the_smallest_size(tmp_path: Path, wide_model_dir: Path, text_dir: Path) -> None:
    result = run_cli(
        ["run", write_recipe(tmp_path, _mix_recipe(wide_model_dir, text_dir, "rtn", "{bits_per_weight: 1.5}")), "-o", tmp_path / "o"]
    )
    assert result.exit_code == 2, result.output
    assert "below the smallest file these types make" in result.output and "bits/weight" in result.output
    assert "Traceback" not in result.output


def test_the_pass_on_a_streamed_model_gives_the_estimates_of_the_model_in_memory(wide_model_dir: Path, text_dir: Path) -> None:
    """Block by block from disk (one block resident), the estimates are those of the loaded model."""
    from transformers import AutoTokenizer

    from compress import streaming
    from compress.models import load_model
    from compress.progress import Reporter
    from compress.quantizers.mix import measure
    from compress.schema.recipe import ModelConfig

    quiet = Reporter(quiet=True)
    streamed = load_model(ModelConfig(source=str(wide_model_dir)), Path("."), quiet).model
    assert streaming.is_streamed(streamed)
    loaded = streaming.materialize(load_model(ModelConfig(source=str(wide_model_dir)), Path("."), quiet).model)
    tok = AutoTokenizer.from_pretrained(wide_model_dir)
    tokens = tok("\n".join(texts_of(text_dir)), return_tensors="pt").input_ids[0][: 4 * 64].reshape(4, 64)

    def estimates(model: torch.nn.Module) -> dict[str, list[float]]:
        linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
        choices = measure(model, linears, ["q2_k", "q4_k"], tokens, 2, torch.device("cpu"), 0, quiet, "test", tensor_bytes)
        return {c.name: [o[2] for o in c.options] for c in choices}

    a, b = estimates(streamed), estimates(loaded)
    assert a.keys() == b.keys() and len(a) == 14
    for name in a:
        assert a[name] == pytest.approx(b[name], rel=1e-4), name
    assert not [n for n, p in streamed.named_parameters() if p.device.type != "meta" and ".layers." in n]  # no block left resident


def test_the_pass_on_every_kth_row_keeps_the_whole_weights_estimates_and_order(
    monkeypatch: pytest.MonkeyPatch, wide_model_dir: Path, text_dir: Path
) -> None:
    """SENSITIVITY_ROWS: scoring a type on every k-th row of a weight, scaled to the whole weight, gives
    estimates near those of every row (each within 2x here, with k from 8 to 32 on a tiny model's weights),
    and each layer's candidate types in the same order."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compress.progress import Reporter
    from compress.quantizers import mix

    model = AutoModelForCausalLM.from_pretrained(wide_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(wide_model_dir)
    tokens = tok("\n".join(texts_of(text_dir)), return_tensors="pt").input_ids[0][: 4 * 64].reshape(4, 64)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}

    def estimates() -> dict[str, dict[str, float]]:
        choices = mix.measure(
            model, linears, ["q2_k", "q4_k", "q8_0"], tokens, 2, torch.device("cpu"), 0, Reporter(quiet=True), "test", tensor_bytes
        )
        return {c.name: {o[0]: o[2] for o in c.options} for c in choices}

    monkeypatch.setattr(mix, "SENSITIVITY_ROWS", 1 << 30)  # every row
    every = estimates()
    monkeypatch.setattr(mix, "SENSITIVITY_ROWS", 16)
    assert min(mix._row_stride(m.out_features) for m in linears.values()) > 1
    sampled = estimates()
    assert every.keys() == sampled.keys()
    for name, costs in every.items():
        assert sorted(costs, key=costs.get) == sorted(sampled[name], key=sampled[name].get), name
        for type_name, cost in costs.items():
            assert cost / 2 < sampled[name][type_name] < cost * 2, (name, type_name, cost, sampled[name][type_name])


def test_a_kept_sensitivity_is_measured_once_and_handed_out_as_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    from compress.context import RunContext
    from compress.progress import Reporter
    from compress.quantizers import mix

    calls = []

    def fake_measure(model, selected, types, tokens, *rest):
        calls.append(list(types))
        return [mix.LayerChoice(n, (4, 32), [(t, 10 * (i + 1), 1.0 / (i + 1)) for i, t in enumerate(types)]) for n in selected]

    monkeypatch.setattr(mix, "measure", fake_measure)
    tokens = torch.arange(64).reshape(2, 32)
    kept: dict = {}
    ctx = RunContext(
        seed=0, device=torch.device("cpu"), tokenizer=None, reporter=Reporter(quiet=True), calibration=lambda: tokens, sensitivity=kept
    )
    selected = {"a": None, "b": None}
    first = mix.sensitivities(None, selected, ["q4_k", "q6_k"], tokens, 8, ctx, "t", tensor_bytes)
    mix.allocate(first, 40)
    second = mix.sensitivities(None, selected, ["q4_k", "q6_k"], tokens, 8, ctx, "t", tensor_bytes)
    assert len(calls) == 1 and [c.chosen for c in second] == [0, 0] and [c.chosen for c in first] == [1, 1]
    assert [c.options for c in second] == [c.options for c in first]
    mix.sensitivities(None, selected, ["q4_k", "q6_k"], tokens[:1], 8, ctx, "t", tensor_bytes)  # other text: measured again
    mix.sensitivities(
        None,
        selected,
        ["q4_k", "q6_k"],
        tokens,
        8,
        RunContext(seed=0, device=torch.device("cpu"), tokenizer=None, reporter=Reporter(quiet=True), calibration=lambda: tokens),
        "t",
        tensor_bytes,
    )
    assert len(calls) == 3  # and without a kept dict, every time


def test_bench_candidates_name_a_budget_by_bits_or_by_a_llama_cpp_file() -> None:
    from compress.eval.bench.gguf import Candidate

    bits, like, theirs = Candidate.parse("gptq:mix@3.9"), Candidate.parse("rtn:mix@Q4_K_M"), Candidate.parse("llama.cpp-imatrix:q4_k_m")
    assert (bits.budget, bits.type_name, like.budget) == ("3.9", "mix", "q4_k_m") and not bits.llama_cpp
    assert like.name == "rtn mix at the size of llama.cpp's Q4_K_M" and theirs.llama_cpp and "imatrix" in theirs.name
    with pytest.raises(ValueError, match="mix@ takes bits per weight"):
        Candidate.parse("gptq:mix@big")
    with pytest.raises(ValueError, match="llama.cpp type must be one of"):
        Candidate.parse("llama.cpp-imatrix:q9_k")


@pytest.mark.runtime
def test_bench_gguf_fills_llama_cpps_size_with_a_mix_and_plots_both(tmp_path: Path, wide_model_dir: Path, text_dir: Path) -> None:
    """`compress bench gguf`: a budget at the size of llama.cpp's own Q4_K_M of the same model makes a
    file of its bits per weight (to the byte's rounding), both scored in llama.cpp, plotted; llama.cpp's
    quantizer then makes a file of the same tensor types as each mix of ours, to decode beside it."""
    pytest.importorskip("llama_cpp")
    out = tmp_path / "bench"
    rows = {r["name"]: r for r in run_gguf_bench(out, wide_model_dir, text_dir, "llama.cpp:q4_k_m,gptq:mix@q4_k_m,rtn:mix@4.2")["rows"]}
    theirs, ours, four = rows["llama.cpp Q4_K_M"], rows["gptq mix at the size of llama.cpp's Q4_K_M"], rows["rtn mix at 4.2 bits/weight"]
    assert ours["budget_bits_per_weight"] == theirs["bits_per_weight"]
    # filled up to less than one step of the smallest layer (k_proj, 128 x 256, Q2_K -> Q3_K: 26,624 bits of
    # the file's ~1.28M parameters, 0.021 bits/weight); 14 Linears and the tied model's one table
    assert theirs["bits_per_weight"] - 0.021 < ours["bits_per_weight"] <= theirs["bits_per_weight"]
    assert four["bits_per_weight"] <= 4.2 and ours["records_exact"] == 15 and ours["metrics"]["kl_divergence"] > 0
    assert ours["sensitivity_reused"] is False and four["sensitivity_reused"] is True  # measured once, for the first budget
    # after each mix, llama.cpp's quantizer on the very tensor types it chose: the decode-speed reference
    same = rows["llama.cpp at the type mix of gptq mix at the size of llama.cpp's Q4_K_M"]
    assert same["same_tensor_types"] and same["tensor_types"] == ours["tensor_types"] and len(ours["tensor_types"]) > 2
    assert same["bits_per_weight"] == ours["bits_per_weight"] and ours["decode_vs_same_mix"] > 0
    assert "llama.cpp at the type mix of rtn mix at 4.2 bits/weight" in rows
    assert (out / "kl-vs-size.png").stat().st_size > 0
