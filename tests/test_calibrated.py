"""GPTQ and AWQ: math properties, every architecture in the table, and the layer-wise pipeline."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from compress.context import RunContext
from compress.errors import CompressError
from compress.eval.metrics import compare, torch_forward
from compress.experts import expert_view
from compress.progress import Reporter
from compress.quantizers import gptq as gptq_module
from compress.quantizers.arch import ARCHITECTURES, architecture_of, decoder_blocks
from compress.quantizers.awq import AWQStage, fold_scales, search_clip, search_scales
from compress.quantizers.configs import AWQConfig, GPTQConfig, RTNConfig
from compress.quantizers.core import compute_qparams, group_rows, quantize_codes
from compress.quantizers.gptq import GPTQStage, accumulate_hessian, gptq_quantize, mirror_upper
from compress.quantizers.moe import unfused
from compress.quantizers.rtn import RTNStage, rtn_quantize
from compress.schema.quantize import QuantScheme
from tests.helpers import recipe_text, run_cli, write_recipe
from tests.tiny import tiny_model

QUIET = Reporter(quiet=True)
VOCAB = 300  # tiny_model's default vocabulary


def ctx_for(tokens: torch.Tensor) -> RunContext:
    return RunContext(seed=0, device=torch.device("cpu"), tokenizer=None, reporter=QUIET, calibration=lambda: tokens)


def tokens(n: int = 8, length: int = 48, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- math


def test_hessian_accumulates_in_batches() -> None:
    x = torch.randn(300, 16)
    h, n = torch.zeros(16, 16), 0
    for part in x.split(70):
        n = accumulate_hessian(h, n, part)
    assert n == 300
    assert torch.allclose(h, 2 * x.t() @ x / 300, atol=1e-5)


def test_upper_triangle_hessian_equals_the_full_one() -> None:
    strip = 24  # strips of 24 over 100 columns: a partial last one
    x = torch.randn(3, 50, 100, dtype=torch.bfloat16)
    full, upper, n, m = torch.zeros(100, 100), torch.zeros(100, 100), 0, 0
    for part in x:
        n = accumulate_hessian(full, n, part)
        m = accumulate_hessian(upper, m, part, upper_only=True, strip=strip)
    assert not torch.equal(upper, full)  # the lower triangle is left behind until mirrored
    torch.testing.assert_close(mirror_upper(upper, strip), full, rtol=1e-6, atol=1e-7)  # the same sums, blocked differently
    assert torch.equal(upper, upper.t())


def test_gptq_stage_shares_hessians_and_matches_each_linear_on_its_own() -> None:
    """q/k/v and gate/up take the same input tensor, so the stage accumulates one Hessian for each
    group (upper triangle only): the first block's records equal GPTQ on each linear's own Hessian."""
    base = tiny_model("llama", layers=2)
    cal = tokens(16, 48)
    block = decoder_blocks(base, architecture_of(base))[0]
    linears = {n: m for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)}
    hessians = {n: torch.zeros(m.in_features, m.in_features) for n, m in linears.items()}
    counts = dict.fromkeys(linears, 0)

    def hook(name: str):
        def fn(_module, args, _output):
            counts[name] = accumulate_hessian(hessians[name], counts[name], args[0])

        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in linears.items()]
    with torch.no_grad():
        for batch in cal.split(8):  # the stage's calibration batches (batch_size 8)
            base(batch)
    for handle in handles:
        handle.remove()
    config = GPTQConfig(bits=3, group_size=32)
    model = copy.deepcopy(base)
    ctx = ctx_for(cal)
    GPTQStage(config, "s", hessian_strip=16).apply(model, ctx)  # strips narrower than the 64-wide inputs
    prefix = next(n for n, m in model.named_modules() if m is decoder_blocks(model, architecture_of(model))[0]) + "."
    for name, module in linears.items():
        expected, _ = gptq_quantize(module.weight, hessians[name], config.scheme(), config.dampening, config.block_size, config.act_order)
        got = ctx.quantized[prefix + name]
        assert torch.equal(got.codes, expected.codes) and torch.equal(got.scale, expected.scale), name


def test_gptq_with_uncorrelated_inputs_equals_rtn() -> None:
    w = torch.randn(32, 96) * 0.05
    scheme = QuantScheme(bits=4, group_size=32, symmetric=False)
    for act_order in (False, True):  # no off-diagonal terms: nothing to compensate, in any column order
        record, _ = gptq_quantize(w, torch.eye(96), scheme, act_order=act_order)
        assert torch.equal(record.codes, rtn_quantize(w, scheme).codes)


def test_gptq_reduces_output_error_on_correlated_inputs() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g) * 0.05
    x = torch.randn(2048, 128, generator=g) @ torch.randn(128, 128, generator=g) / 11
    h = torch.zeros(128, 128)
    accumulate_hessian(h, 0, x)
    for scheme in (QuantScheme(bits=3, group_size=64), QuantScheme(bits=4, group_size=None, symmetric=False)):
        err = lambda rec: float((x @ (w - rec.dequantize()).t()).pow(2).mean())  # noqa: E731
        for act_order in (False, True):
            gptq, _ = gptq_quantize(w, h, scheme, act_order=act_order)
            assert err(gptq) < 0.75 * err(rtn_quantize(w, scheme)), (scheme.describe(), act_order)


def test_act_order_keeps_groups_static_and_contiguous() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 96, generator=g)
    x = torch.randn(512, 96, generator=g) * torch.linspace(0.1, 3, 96)
    h = torch.zeros(96, 96)
    accumulate_hessian(h, 0, x)
    scheme = QuantScheme(bits=4, group_size=32, symmetric=True)
    record, _ = gptq_quantize(w, h, scheme, act_order=True)
    for k in range(3):  # each group's parameters come from the original weights of that contiguous group
        scale, zero = compute_qparams(w[:, 32 * k : 32 * (k + 1)], scheme)
        assert torch.equal(record.scale[:, k].float(), scale)
    assert float((record.dequantize() - w).abs().max()) < 2 * float(record.scale.float().max())


@pytest.mark.parametrize("type_name", ["W3 g24 asym", "q4_1", "q4_k", "q6_k"])
def test_numpy_column_loop_is_torchs_bit_for_bit_and_sub_blocks_keep_the_sums(type_name: str) -> None:
    """On CPU the column loop runs on NumPy views; CUDA runs the same loop in torch. Both must give
    the same record bit for bit. Sub-blocks (errors sent eagerly within 16 columns, then to the
    rest of the block in one product) are the same sums as the one-level loop (a sub-block as wide
    as the block), rounded differently: nearly every code agrees (measured at least 99.8% on two threads and
    99.5% on one, where torch sums the products in another order; 80% when the sub-block product is dropped).
    5-column sub-blocks divide no unit (24, 32, 256 columns), so without act_order the units' starts split them."""
    g = torch.Generator().manual_seed(0)
    scheme = QuantScheme(bits=3, group_size=24, symmetric=False) if type_name.startswith("W3") else QuantScheme(gguf_type=type_name)
    w = torch.randn(40, 512, generator=g) * 0.05
    w[:3, :256] = 0.0  # all-zero units
    h = torch.zeros(512, 512)
    accumulate_hessian(h, 0, torch.randn(1024, 512, generator=g) @ torch.randn(512, 512, generator=g) / 23)
    for act_order in (False, True):
        records = {}
        for numpy, sub in ((True, 16), (False, 16), (True, 5), (False, 5), (True, 128)):
            records[numpy, sub], _ = gptq_quantize(w, h, scheme, act_order=act_order, sub_block=sub, numpy_columns=numpy)
        for sub in (16, 5):
            a, b = records[True, sub], records[False, sub]
            assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("codes", "scale", "zero_point")), (sub, act_order)
            assert (a.offset is None) == (b.offset is None) and (a.offset is None or torch.equal(a.offset, b.offset))
            assert (a.super_blocks is None) == (b.super_blocks is None)
            if a.super_blocks is not None:
                assert all(torch.equal(getattr(a.super_blocks, f), getattr(b.super_blocks, f)) for f in ("d", "dmin", "scales", "mins"))
            agree = (a.codes == records[True, 128].codes).float().mean()
            assert agree > 0.99, (sub, act_order, float(agree))
        record, width = records[True, 16], scheme.group_width(512)
        # With act_order the units are fixed from the original weights, before any error reaches
        # them; a llama.cpp grid stores an all-zero unit as zero scales (a plain scheme, a tiny one).
        if act_order and scheme.block_grid is not None:
            assert (record.scale[:3, : 256 // width] == 0).all()
            assert torch.equal(record.dequantize()[:3, :256], torch.zeros(3, 256))
            zero_points = record.zero_point[:3].repeat_interleave(width, dim=1)
            assert torch.equal(record.codes[:3, :256], zero_points[:, :256])


# --------------------------------------------------------------------------- architectures


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_awq_scale_folding_keeps_the_float_model(model_type: str) -> None:
    model = tiny_model(model_type)
    arch = architecture_of(model)
    ids = tokens(2, 24)
    with torch.no_grad():
        before = model(ids).logits
    folded = 0
    for block in decoder_blocks(model, arch):
        with unfused(block):  # an MoE block's experts as one Linear per expert matrix (a dense block: as it is)
            for mapping in arch.awq_mappings(block):
                prev = block.get_submodule(mapping.prev)
                linears = [block.get_submodule(n) for n in mapping.linears]
                if isinstance(prev, torch.nn.Linear) and prev.out_features != linears[0].in_features:
                    continue  # grouped-query attention: v_proj -> o_proj cannot be scaled
                s = torch.rand(linears[0].in_features, generator=torch.Generator().manual_seed(folded)) * 3 + 0.2
                fold_scales(prev, linears + [block.get_submodule(n) for n in mapping.scaled_too], s, arch.norm_offset)
                folded += 1
    with torch.no_grad():
        after = model(ids).logits
    assert folded >= 2 * 3
    assert torch.allclose(before, after, atol=1e-4, rtol=1e-4), float((before - after).abs().max())


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_methods_run_on_every_architecture(model_type: str, method: str) -> None:
    model = tiny_model(model_type)
    ctx = ctx_for(tokens())
    stage = (
        GPTQStage(GPTQConfig(bits=4, group_size=32), "stages[0]")
        if method == "gptq"
        else AWQStage(AWQConfig(bits=4, group_size=32), "stages[0]")
    )
    record = stage.apply(model, ctx)
    experts = model.config.num_experts * 3 if model_type == "qwen3_moe" else 0  # an MoE block: 3 matrices per expert, no MLP
    assert record.summary["layers_quantized"] == 2 * (7 - 3 * bool(experts) + experts)
    assert len(record.summary["blocks"]) == 2
    blocks = record.summary["blocks"]
    assert [b["block"] for b in blocks] == [0, 1] and all(b["peak_memory_mb"] > 0 for b in blocks)
    # each block's time (rounded to 1 ms) is part of the stage's own
    assert all(b["seconds"] > 0 for b in blocks) and sum(b["seconds"] for b in blocks) <= record.duration_s + 0.001, (
        blocks,
        record.duration_s,
    )
    for name, rec in ctx.quantized.items():
        weight = expert_view(model, name) if "experts" in name else model.get_submodule(name).weight
        assert torch.equal(weight, rec.dequantize(weight.dtype)), name
    with torch.no_grad():
        assert torch.isfinite(model(tokens(1, 16)).logits).all()


def test_unsupported_architecture_says_how_to_add_it() -> None:
    from transformers import OPTConfig, OPTForCausalLM

    model = OPTForCausalLM(
        OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=100, word_embed_proj_dim=32)
    )
    with pytest.raises(CompressError, match=r"does not know the architecture 'opt'.*quantizers/arch.py"):
        GPTQStage(GPTQConfig(bits=4, group_size=32), "stages[0]").apply(model, ctx_for(tokens()))


def test_layers_outside_blocks_are_refused() -> None:
    model = tiny_model("llama")
    model.model.projector = torch.nn.Linear(64, 64)  # neither in a block nor the output head (tests/test_head.py)
    with pytest.raises(CompressError, match="model.projector is outside them"):
        GPTQStage(GPTQConfig(bits=4, group_size=32, ignore=[]), "stages[0]").apply(model, ctx_for(tokens()))


@pytest.mark.parametrize(("out_f", "in_f", "group"), [(48, 96, 32), (40, 160, 64), (24, 96, None)])
def test_search_clip_equals_replaying_the_tokens(out_f: int, in_f: int, group: int | None) -> None:
    """The Gram-matrix error (Δwᵀ H Δw per group) picks the same bounds as replaying the tokens."""
    torch.manual_seed(0)
    w = torch.randn(out_f, in_f) * 0.05
    x = torch.randn(256, in_f) * torch.rand(in_f) * 3
    scheme = QuantScheme(bits=3, group_size=group, symmetric=True)
    wg = group_rows(w, scheme)
    n, g = wg.shape[1], wg.shape[2]
    xg = torch.nn.functional.pad(x, (0, n * g - in_f)).reshape(x.shape[0], n, g)
    reference = torch.einsum("ogk,tgk->ogt", wg, xg)
    org = wg.abs().amax(-1)
    errors = []
    for i in range(10):  # grid 20, max_shrink 0.5
        bound = org * (1 - i / 20)
        clipped = torch.maximum(torch.minimum(wg, bound.unsqueeze(-1)), -bound.unsqueeze(-1))
        scale, zero = compute_qparams(clipped, scheme)
        q = (quantize_codes(clipped, scale, zero, scheme) - zero.unsqueeze(-1)) * scale.unsqueeze(-1)
        errors.append((torch.einsum("ogk,tgk->ogt", q, xg) - reference).pow(2).mean(-1))
    expected = org * (1 - torch.stack(errors).argmin(0) / 20)
    assert torch.equal(search_clip(x, w, scheme, 20, 0.5), expected)
    assert torch.equal(search_clip(x, w, scheme, 20, 0.5, rows_per_step=7), expected)  # rows in chunks: the same bounds


@pytest.mark.runtime
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (CI has none; run where a GPU is lent)")
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_layerwise_calibration_on_cuda_matches_cpu(method: str) -> None:
    """The same stage with compute.device cuda: blocks visit the GPU one at a time and come back,
    per-block GPU peak memory is reported, and the codes agree with the CPU run (float order only)."""
    base = tiny_model("llama")
    cal = tokens(8, 48)
    found = {}
    for device in ("cpu", "cuda"):
        model = copy.deepcopy(base)
        ctx = RunContext(seed=0, device=torch.device(device), tokenizer=None, reporter=QUIET, calibration=lambda: cal)
        config = GPTQConfig(bits=4, group_size=32) if method == "gptq" else AWQConfig(bits=4, group_size=32)
        stage = GPTQStage(config, "s") if method == "gptq" else AWQStage(config, "s")
        record = stage.apply(model, ctx)
        assert {p.device.type for p in model.parameters()} == {"cpu"}
        if device == "cuda":
            assert all(b["peak_memory_mb"] > 0 for b in record.summary["blocks"]), record.summary
        found[device] = ctx.quantized
    agree = [float((found["cpu"][n].codes == found["cuda"][n].codes.cpu()).float().mean()) for n in found["cpu"]]
    assert min(agree) > 0.97, agree


# --------------------------------------------------------------------------- quality and pipeline


def test_gptq_and_awq_beat_rtn_on_a_tiny_model() -> None:
    base = tiny_model("llama", layers=3)
    cal, ev = tokens(16, 64, seed=1), tokens(8, 64, seed=2)
    candidates = {}
    for name, stage in {
        "rtn": RTNStage(RTNConfig(bits=3, group_size=32), "s"),
        "gptq": GPTQStage(GPTQConfig(bits=3, group_size=32), "s"),
        "awq": AWQStage(AWQConfig(bits=3, group_size=32, symmetric=True), "s"),
        "awq both": AWQStage(AWQConfig(bits=3, group_size=32, symmetric=True, duo_scaling="both"), "s"),
        "awq clip after search": AWQStage(AWQConfig(bits=3, group_size=32, symmetric=True, clip_in_search=False), "s"),
    }.items():
        model = copy.deepcopy(base)
        assert stage.apply(model, ctx_for(cal)).summary["layers_quantized"] == 3 * 7
        candidates[name] = torch_forward(model, torch.device("cpu"))
    kl = {k: m["kl_divergence"] for k, m in compare(torch_forward(base, torch.device("cpu")), candidates, ev, 8).items()}
    assert all(kl[name] < kl["rtn"] for name in candidates if name != "rtn"), kl


def test_calibrated_recipe_needs_calibration_data(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    text = recipe_text(tiny_model_dir, text_dir).replace("method: rtn", "method: gptq")
    text = text.replace(f"  calibration:\n    source: {text_dir}\n    samples: 4\n    seq_len: 64\n", "")
    result = run_cli(["validate", write_recipe(tmp_path, text)])
    assert result.exit_code == 2 and "stages[0] (quantize) needs data.calibration" in result.output


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_recipe_end_to_end(tmp_path: Path, tiny_model_dir: Path, text_dir: Path, method: str) -> None:
    text = recipe_text(tiny_model_dir, text_dir, bits=4, group_size=32).replace("method: rtn", f"method: {method}")
    out = tmp_path / "out"
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", out])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    stage = manifest["stages"][0]
    assert stage["method"] == method and stage["summary"]["calibration_tokens"] == 4 * 64
    assert len(stage["summary"]["blocks"]) == 2
    assert manifest["data"]["calibration"]["tokens_sha256"]
    assert manifest["recipe"]["expanded"]["stages"][0]["quantize"]["method"] == method
    report = json.loads((out / "report.json").read_text())
    assert report["evaluations"][1]["metrics"]["kl_divergence"] > 0


def test_awq_scale_search_covers_the_families_it_is_asked_for() -> None:
    g = torch.Generator().manual_seed(0)
    x_mean, weight = torch.rand(64, generator=g) + 0.1, torch.randn(16, 64, generator=g)
    scheme = QuantScheme(bits=4, group_size=32)
    target = x_mean.pow(0.5) / (x_mean.pow(0.5).max() * x_mean.pow(0.5).min()).sqrt()  # duo off, alpha 0.5
    loss_of = lambda s: float((s - target).abs().max())  # noqa: E731
    for duo, found in ((False, True), ("both", True), (True, False)):
        s, info = search_scales(x_mean, weight, scheme, 10, duo, loss_of)
        assert (info["loss"] < 1e-5) == found, (duo, info)
        if found:
            assert info["duo"] is False and info["alpha"] == 0.5 and torch.allclose(s, target)


def test_the_plan_counts_one_hessian_per_distinct_input() -> None:
    from compress.quantizers.plugin import distinct_inputs, hessian_products

    model = tiny_model("llama", layers=2)
    layers = {
        n: type("R", (), {"in_f": m.in_features})() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "layers" in n
    }
    inputs = distinct_inputs(layers)
    assert len(layers) == 14 and len(inputs) == 8  # per block: q/k/v, o, gate/up, down
    assert hessian_products(8960) == pytest.approx(0.556 * 8960**2, rel=1e-3) and hessian_products(512) == 512**2


@pytest.mark.parametrize("positive_definite", [True, False])
def test_the_inverse_factor_made_in_place_equals_torchs(positive_definite: bool) -> None:
    """On the CPU, GPTQ factors H, inverts and factors again in H's own memory (LAPACK through scipy);
    torch's linalg (the CUDA path) gives the same factor and the same dampening, also when H needs
    its dampening raised before it is positive definite."""
    g = torch.Generator().manual_seed(0)
    n = 2100  # wider than HESSIAN_STRIP: the restore after a failed factorization goes strip by strip
    x = torch.randn(4 * n, n, generator=g) * torch.linspace(0.1, 3, n)  # well conditioned: more samples than inputs
    h = x.t() @ x / x.shape[0]
    if not positive_definite:
        h[5, :], h[:, 5] = 0.0, 0.0
        h[5, 5] = -1.0  # positive definite only once the dampening reaches 1.0 x mean(diag H)
    expected_h, mean, damp, added = h.clone(), float(h.diagonal().mean()), 0.01, 0.0
    while True:
        expected_h.diagonal().add_((damp - added) * mean)
        added = damp
        chol, info = torch.linalg.cholesky_ex(expected_h)
        if int(info) == 0:
            break
        damp *= 10
    expected = torch.linalg.cholesky(torch.cholesky_inverse(chol), upper=True)
    memory = h.clone()
    got, used = gptq_module._inverse_cholesky([memory], 0.01)
    assert got.data_ptr() == memory.data_ptr()  # no second matrix
    assert used == pytest.approx(damp) and (used > 0.01) != positive_definite
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("n", "tile"), [(7, 3), (100, 16), (40, 64)])
def test_symmetric_permutation_in_place_equals_the_gather(n: int, tile: int) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(3 * n, n, generator=g)
    h = x.t() @ x
    h = (h + h.t()) / 2  # exactly symmetric, as the stage's Hessians are (mirror_upper)
    perm = torch.randperm(n, generator=g)
    want = h[perm[:, None], perm]
    got = gptq_module.permute_symmetric_(h, perm.tolist(), tile)
    assert got.data_ptr() == h.data_ptr() and torch.equal(got, want)
