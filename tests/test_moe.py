"""Mixture-of-experts (Qwen3-MoE) quantization with every expert calibrated: one record per expert matrix,
routed tokens counted, the min-tokens rule, the coverage in the manifest and a gate on it (quantizers/moe.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from compress.artifact import load_artifact
from compress.context import RunContext
from compress.errors import CompressError
from compress.eval.gates import evaluate_gates
from compress.eval.moe_coverage import expert_coverage
from compress.experts import PROJECTIONS, expert_view
from compress.progress import Reporter
from compress.quantizers.awq import AWQStage
from compress.quantizers.configs import AWQConfig, GPTQConfig
from compress.quantizers.gptq import GPTQStage, accumulate_hessian, gptq_quantize
from compress.quantizers.moe import unfused
from compress.schema.recipe import GateConfig
from tests.helpers import recipe_text, run_cli, write_recipe
from tests.tiny import tiny_model

EXPERTS, TOP_K = 8, 2  # tests/tiny.py ARCH_DEFAULTS["qwen3_moe"]


def ctx_for(tokens: torch.Tensor) -> RunContext:
    return RunContext(seed=0, device=torch.device("cpu"), tokenizer=None, reporter=Reporter(quiet=True), calibration=lambda: tokens)


def calibration(n: int = 8, length: int = 48) -> torch.Tensor:
    return torch.randint(0, 300, (n, length), generator=torch.Generator().manual_seed(1))


def stage(method: str, **moe):
    cfg = {"bits": 4, "group_size": 32, **({"moe": moe} if moe else {})}
    return GPTQStage(GPTQConfig(**cfg), "stages[0]") if method == "gptq" else AWQStage(AWQConfig(**cfg), "stages[0]")


def never_route(model, block: int, expert: int) -> None:
    """Make block ``block``'s router never choose ``expert`` (its logit -inf before the top-k)."""
    router = model.model.layers[block].mlp.gate
    original = router.forward

    def forward(hidden_states):
        logits, _, _ = original(hidden_states)
        logits = logits.clone()
        logits[:, expert] = float("-inf")
        top, index = torch.topk(logits.softmax(-1, dtype=torch.float), router.top_k, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        return logits, top.to(logits.dtype), index

    router.forward = forward


def routed_counts(model, tokens: torch.Tensor, block: int) -> list[int]:
    """Tokens per expert chosen by block ``block``'s router of the float model, read off the router's own output."""
    counts = torch.zeros(EXPERTS, dtype=torch.long)

    def hook(_module, _args, output):
        counts.add_(torch.bincount(output[2].reshape(-1), minlength=EXPERTS))

    handle = model.model.layers[block].mlp.gate.register_forward_hook(hook)
    with torch.no_grad():
        model(input_ids=tokens)
    handle.remove()
    return counts.tolist()


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_every_expert_matrix_is_quantized_and_written_back(method: str) -> None:
    model, tokens = tiny_model("qwen3_moe"), calibration()
    expected_block0 = routed_counts(model, tokens, 0)  # block 0 sees the float embeddings in calibration too
    ctx = ctx_for(tokens)
    record = stage(method).apply(model, ctx)
    experts = {f"model.layers.{b}.mlp.experts.{e}.{p}" for b in range(2) for e in range(EXPERTS) for p in PROJECTIONS}
    assert experts <= set(ctx.quantized) and len(ctx.quantized) == len(experts) + 2 * 4  # + q/k/v/o per block
    for name in experts:  # the fused parameters hold exactly each record's dequantized weights
        assert torch.equal(expert_view(model, name), ctx.quantized[name].dequantize(torch.float32)), name
        assert record.layers[name]["calibration_tokens"] > 0
    moe = record.summary["moe"]
    assert [b["block"] for b in moe["blocks"]] == [0, 1]
    for block in moe["blocks"]:
        assert block["tokens"] == tokens.numel() and block["top_k"] == TOP_K
        assert sum(block["tokens_per_expert"]) == tokens.numel() * TOP_K
    assert moe["blocks"][0]["tokens_per_expert"] == expected_block0
    assert moe["min_expert_tokens"] == min(n for b in moe["blocks"] for n in b["tokens_per_expert"])
    assert moe["experts"] == 2 * EXPERTS and moe["experts_under_min"] == sum(len(b["under_min"]) for b in moe["blocks"])
    with torch.no_grad():
        assert torch.isfinite(model(tokens[:1]).logits).all()


def test_an_unrouted_expert_is_calibrated_on_all_tokens() -> None:
    tokens = calibration()
    model = tiny_model("qwen3_moe")
    never_route(model, 0, 3)
    w0 = expert_view(model, "model.layers.0.mlp.experts.3.gate_proj").clone()
    inputs = []  # what block 0's MoE module receives: every calibration token (GPTQ collects before it rounds)
    handle = model.model.layers[0].mlp.register_forward_hook(lambda _m, args, _o: inputs.append(args[0].detach()))
    with torch.no_grad():
        model(input_ids=tokens)
    handle.remove()
    ctx = ctx_for(tokens)
    record = stage("gptq").apply(model, ctx)
    block0 = record.summary["moe"]["blocks"][0]
    assert block0["tokens_per_expert"][3] == 0 and 3 in block0["under_min"] and 3 in block0["calibrated_on_all_tokens"]
    name = "model.layers.0.mlp.experts.3.gate_proj"
    assert record.layers[name]["calibration_tokens"] == tokens.numel()
    h = torch.zeros(w0.shape[1], w0.shape[1])
    accumulate_hessian(h, 0, inputs[0])
    cfg = GPTQConfig(bits=4, group_size=32)
    expected, _ = gptq_quantize(w0, h, cfg.scheme(), cfg.dampening, cfg.block_size, cfg.act_order)
    assert torch.equal(ctx.quantized[name].codes, expected.codes)  # GPTQ on the Hessian of all tokens


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_under_min_fail_names_the_experts(method: str) -> None:
    model = tiny_model("qwen3_moe")
    never_route(model, 0, 5)
    with pytest.raises(CompressError, match=r"moe.min_tokens is 1.*1 expert\(s\): model.layers.0.mlp.experts.5 \(0 tokens\)"):
        stage(method, min_tokens=1, under_min="fail").apply(model, ctx_for(calibration()))


def test_min_tokens_rule_counts_the_experts_below_it() -> None:
    tokens = calibration()
    record = stage("gptq", min_tokens=10_000).apply(tiny_model("qwen3_moe"), ctx_for(tokens))  # more than any expert gets
    moe = record.summary["moe"]
    assert moe["experts_under_min"] == 2 * EXPERTS and moe["min_tokens"] == 10_000 and moe["under_min"] == "all_tokens"
    assert all(info["calibration_tokens"] == tokens.numel() for name, info in record.layers.items() if ".experts." in name)


def test_a_gate_reads_the_expert_coverage() -> None:
    model = tiny_model("qwen3_moe")
    never_route(model, 1, 2)
    record = stage("gptq").apply(model, ctx_for(calibration()))
    [evaluation] = expert_coverage([("stages[0]", record.summary)], "cpu")
    assert evaluation.kind == "calibration" and evaluation.metrics["experts_under_min"] >= 1
    assert evaluation.metrics["min_expert_tokens"] == 0
    gates = [
        GateConfig(metric="experts_under_min", max=0),
        GateConfig(metric="experts_under_min", max=2 * EXPERTS),
        GateConfig(metric="min_expert_tokens", min=1),
    ]
    assert [g.passed for g in evaluate_gates(gates, [evaluation])] == [False, True, False]
    dense = stage("gptq").apply(tiny_model("llama"), ctx_for(calibration()))
    assert expert_coverage([("stages[0]", dense.summary)], "cpu") == []  # a dense model: no coverage to gate


def test_moe_recipe_end_to_end(tmp_path: Path, tiny_moe_model_dir: Path, text_dir: Path) -> None:
    gates = "  - {metric: experts_under_min, max: 0}\n  - {metric: min_expert_tokens, min: 1}\n"
    text = recipe_text(tiny_moe_model_dir, text_dir, group_size=32, gates=gates).replace("method: rtn", "method: awq")
    out = tmp_path / "out"
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", out])
    manifest = json.loads((out / "manifest.json").read_text())
    moe = manifest["stages"][0]["summary"]["moe"]
    assert moe["experts_under_min"] > 0  # 4 x 64 tokens x top-2 over 8 experts: about 64 each, some fewer (min_tokens 64)
    assert result.exit_code == 1, result.output  # the first gate fails, the second passes
    report = json.loads((out / "report.json").read_text())
    assert [g["passed"] for g in report["gates"]] == [False, True]
    layers = manifest["quantization"]["layers"]
    assert layers["model.layers.1.mlp.experts.7.down_proj"]["stored_as"] == "records"
    model, _, records = load_artifact(out)  # the records read back into the fused parameters
    for name in [n for n in records if ".experts." in n]:
        assert torch.equal(expert_view(model, name), records[name].dequantize(torch.float32)), name
    gates = tmp_path / "gates.yaml"  # compress gate reads the coverage from the artifact's manifest
    gates.write_text("gates:\n  - {metric: experts_under_min, max: 1000}\n  - {metric: min_expert_tokens, min: 100000}\n")
    gated = run_cli(["gate", out, "--gates", gates, "-o", tmp_path / "r", "-q"])
    assert gated.exit_code == 1, gated.output
    assert [g["passed"] for g in json.loads((tmp_path / "r" / "report.json").read_text())["gates"]] == [True, False]


def test_exports_refuse_moe_records(tmp_path: Path, tiny_moe_model_dir: Path, text_dir: Path) -> None:
    text = recipe_text(tiny_moe_model_dir, text_dir, group_size=32).replace("method: rtn", "method: gptq")
    text = text.replace("exports: []", "exports:\n  - {format: gguf, name: q4, type: q4_0}")
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", tmp_path / "out"])
    assert result.exit_code == 2 and "exports[0] (q4): the gguf export cannot carry the quantized experts" in result.output
    assert "Traceback" not in result.output


def test_unfused_experts_compute_what_the_fused_ones_do() -> None:
    model = tiny_model("qwen3_moe")
    mlp = model.model.layers[0].mlp
    fused = mlp.experts
    x = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = mlp(x)
    with unfused(model.model.layers[0]) as [(name, experts)]:
        experts.all_tokens = {0, 3}  # their Linears see every token; the output still mixes only the routed ones
        with torch.no_grad():
            got = mlp(x)
        assert name == "mlp.experts" and mlp.experts is experts and len(experts) == EXPERTS
    assert torch.allclose(got, reference, atol=1e-6, rtol=1e-5), float((got - reference).abs().max())
    assert mlp.experts is fused


def test_ignored_experts_are_neither_unfused_nor_counted() -> None:
    model = tiny_model("qwen3_moe")
    never_route(model, 0, 5)  # under_min: fail would stop the run if these experts were calibrated
    ctx = ctx_for(calibration())
    cfg = GPTQConfig(bits=4, group_size=32, ignore=["lm_head", "re:.*experts.*"], moe={"min_tokens": 1, "under_min": "fail"})
    record = GPTQStage(cfg, "stages[0]").apply(model, ctx)
    assert "moe" not in record.summary and not any(".experts." in n for n in ctx.quantized)
    assert record.summary["layers_quantized"] == 2 * 4  # attention only


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_dense_blocks_of_an_moe_model_are_quantized_as_dense(method: str) -> None:
    model = tiny_model("qwen3_moe", mlp_only_layers=[1])  # block 1 has a plain MLP (gate/up/down Linears)
    ctx = ctx_for(calibration())
    record = stage(method).apply(model, ctx)
    assert [b["block"] for b in record.summary["moe"]["blocks"]] == [0]
    assert {"model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"} <= set(ctx.quantized)
    assert len(ctx.quantized) == 4 + 3 * EXPERTS + 7
    if method == "awq":  # the dense block's MLP mappings ran (norm -> gate/up scaled, not skipped)
        assert record.layers["model.layers.1.mlp.gate_proj"]["awq_alpha"] is not None
        assert record.layers["model.layers.0.mlp.experts.0.gate_proj"]["awq_alpha"] is not None


def test_awq_calibrates_an_unrouted_expert_on_all_tokens() -> None:
    tokens = calibration()
    model = tiny_model("qwen3_moe")
    never_route(model, 0, 3)
    ctx = ctx_for(tokens)
    record = stage("awq").apply(model, ctx)
    assert record.summary["moe"]["blocks"][0]["calibrated_on_all_tokens"] == [3]
    for p in PROJECTIONS:
        name = f"model.layers.0.mlp.experts.3.{p}"
        assert record.layers[name]["calibration_tokens"] == tokens.numel()
        assert torch.equal(expert_view(model, name), ctx.quantized[name].dequantize(torch.float32))
    assert record.layers["model.layers.0.mlp.experts.3.down_proj"]["awq_alpha"] is not None  # its up -> down mapping ran
