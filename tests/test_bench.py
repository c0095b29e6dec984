"""`compress bench quant` on a tiny model: rows for every candidate, written as they finish."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from compress.eval.bench.quant import Setting, run_quant_bench
from compress.progress import Reporter
from compress.schema.recipe import DataConfig
from tests.helpers import run_cli


def test_setting_parse() -> None:
    assert Setting.parse("W4g128s") == Setting(4, 128, True)
    assert Setting.parse("w3g64a") == Setting(3, 64, False)
    assert Setting.parse("W8pcs") == Setting(8, None, True)
    with pytest.raises(ValueError, match="expected like W4g128s"):
        Setting.parse("4bit")


def test_bench_scores_every_candidate(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    data = DataConfig(
        calibration={"source": str(text_dir), "samples": 4, "seq_len": 64},
        evaluation={"source": str(text_dir), "samples": 4, "seq_len": 64, "min_context": 8},
    )
    started = time.perf_counter()
    result = run_quant_bench(str(tiny_model_dir), data, ["rtn", "gptq", "awq"], [Setting(3, 32, True)], tmp_path, 1, Reporter(quiet=True))
    wall_s = time.perf_counter() - started
    assert [r["method"] for r in result["rows"]] == ["rtn", "gptq", "awq"]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    for row in saved["rows"]:
        assert row["metrics"]["tokens_scored"] == 4 * (64 - 8)
    # each row times its own quantization (rounded to 0.01 s) inside the bench; GPTQ and AWQ calibrate, so take
    # measurably long (RTN on this model can round to 0.00)
    seconds = {row["method"]: row["seconds"] for row in saved["rows"]}
    assert seconds["gptq"] > 0 and seconds["awq"] > 0 and sum(seconds.values()) <= wall_s + 0.015, (seconds, wall_s)
    table = (tmp_path / "results.md").read_text()
    assert "| gptq | W3 g32 sym |" in table and "vs RTN" in table


def test_bench_cli_rejects_unknown_method(tmp_path: Path) -> None:
    result = run_cli(["bench", "quant", "-o", tmp_path, "--methods", "rtn,squeeze"])
    assert result.exit_code == 2 and "unknown method(s) squeeze" in result.output


def test_bench_cli_passes_method_options(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    out = tmp_path / "b"
    result = run_cli(
        [
            "bench",
            "quant",
            "-o",
            out,
            "--model",
            str(tiny_model_dir),
            "--calibration",
            str(text_dir),
            "--evaluation",
            str(text_dir),
            "--cal-samples",
            "4",
            "--cal-seq-len",
            "64",
            "--eval-samples",
            "2",
            "--eval-seq-len",
            "64",
            "--methods",
            "awq",
            "--settings",
            "W3g32s",
            "--threads",
            "1",
            "--option",
            "awq.duo_scaling=both",
            "--option",
            "awq.grid=4",
        ]
    )
    assert result.exit_code == 0, result.output
    row = json.loads((out / "results.json").read_text())["rows"][0]
    assert row["config"]["duo_scaling"] == "both" and row["config"]["grid"] == 4 and row["config"]["bits"] == 3


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("awq.nope=1", "nope"),
        ("gptq.bits=3", "bits comes from --settings"),
        ("awq.grid=1", "grid"),
        ("duo_scaling=true", "expected METHOD.KEY=VALUE"),
    ],
)
def test_bench_cli_rejects_bad_options(tmp_path: Path, option: str, message: str) -> None:
    result = run_cli(["bench", "quant", "-o", tmp_path, "--option", option])
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.runtime
def test_bench_scores_each_backend_side_by_side(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    """--backends compress,llmcompressor: gptq once per implementation on the same data, rtn once."""
    out = tmp_path / "b"
    data = ["--calibration", str(text_dir), "--evaluation", str(text_dir), "--cal-samples", "4", "--cal-seq-len", "64"]
    data += ["--eval-samples", "2", "--eval-seq-len", "64", "--threads", "1", "--model", str(tiny_model_dir)]
    args = ["bench", "quant", "-o", out, *data, "--methods", "rtn,gptq", "--settings", "W4g32s", "--backends", "compress,llmcompressor"]
    result = run_cli([*args, "--option", "gptq.act_order=false"])
    assert result.exit_code == 0, result.output
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["method"], r["backend"]) for r in rows] == [("rtn", None), ("gptq", "compress"), ("gptq", "llmcompressor")]
    assert [r["config"].get("backend") for r in rows] == [None, "compress", "llmcompressor"]
    assert all(not r["config"]["act_order"] for r in rows[1:])
    assert rows[1]["metrics"] != rows[2]["metrics"]  # two implementations, each scored
    assert "| gptq (llmcompressor) | W4 g32 sym |" in (out / "results.md").read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backends", "autogptq"], "--backends 'autogptq': expected a comma-separated list of compress, llmcompressor"),
        (["--backends", ","], "expected a comma-separated list"),
        (["--option", "gptq.backend=llmcompressor"], "choose implementations with --backends"),
    ],
)
def test_bench_cli_rejects_bad_backends(tmp_path: Path, args: list[str], message: str) -> None:
    result = run_cli(["bench", "quant", "-o", tmp_path, *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_bench_kv_cli_measures_every_scheme(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    out = tmp_path / "kv"
    result = run_cli(
        [
            "bench",
            "kv",
            "-o",
            out,
            "--model",
            str(tiny_model_dir),
            "--calibration",
            str(text_dir),
            "--evaluation",
            str(text_dir),
            "--cal-samples",
            "2",
            "--cal-seq-len",
            "64",
            "--context",
            "96",
            "--schemes",
            "int8;int4:residual=32;fp8-static",
            "--decode-tokens",
            "4",
            "--decode-prefill",
            "16",
            "--repeats",
            "1",
            "--memory-gib",
            "1",
            "--threads",
            "1",
        ]
    )
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "results.json").read_text())
    rows = {r["name"]: r for r in saved["rows"]}
    assert list(rows) == ["int8", "int4:residual=32", "fp8-static"]
    assert rows["int4:residual=32"]["config"]["residual"] == 32 and rows["fp8-static"]["config"]["static_scales"] is True
    for row in rows.values():
        assert row["metrics"]["tokens_scored"] == 96 - 32 and row["memory"]["context"] == 96 and row["decode_tokens_per_s"] > 0
    assert rows["int8"]["memory"]["compression_vs_fp16"] < rows["int4:residual=32"]["memory"]["compression_vs_fp16"]
    plan = saved["memory_plan"]["1 GiB"]
    assert plan["int4:residual=32"]["max_context_batch1"] > plan["fp16"]["max_context_batch1"] > 0
    assert "| int8 |" in (out / "results.md").read_text()


def test_bench_kv_cli_rejects_unknown_scheme(tmp_path: Path) -> None:
    result = run_cli(["bench", "kv", "-o", tmp_path, "--schemes", "int3"])
    assert result.exit_code == 2 and "unknown KV scheme 'int3'" in result.output


def test_bench_kv_cli_compares_eviction_quantization_and_both(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    out = tmp_path / "kv"
    schemes = "int4-token:group_size=8;float:evict=h2o,budget=48,window=8;int4-token:group_size=8,evict=window,budget=48;"
    schemes += "float:evict=fastgen,recovery=0.5,profile_context=32"
    args = ["--calibration", str(text_dir), "--evaluation", str(text_dir), "--cal-samples", "2", "--cal-seq-len", "64"]
    args += ["--context", "96", "--samples", "2", "--step", "4", "--needles", "1", "--schemes", schemes]
    args += ["--decode-tokens", "2", "--decode-prefill", "8", "--repeats", "1", "--memory-gib", "1", "--threads", "1"]
    result = run_cli(["bench", "kv", "-o", out, "--model", str(tiny_model_dir), *args])
    assert result.exit_code == 0, result.output
    rows = {r["name"].split(":")[0] + ":" + r["family"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert (
        list(rows) == ["int4-token:quantization", "float:eviction", "int4-token:eviction + quantization", "float:eviction"]
        or len(rows) == 3
    )
    saved = json.loads((out / "results.json").read_text())["rows"]
    h2o, both = saved[1], saved[2]
    assert h2o["memory"]["compression_vs_fp16"] == 2.0 and h2o["decoding"]["step"] == 4  # 48 of 96 tokens, float16
    assert both["memory"]["compression_vs_fp16"] == pytest.approx(2.0 * saved[0]["memory"]["compression_vs_fp16"])
    assert all(r["needles"]["needles"] == 1 for r in saved)  # --needles: every scheme, quantization alone too
    assert sum(saved[3]["fastgen_profile"]["heads_per_policy"].values()) == 2 * 2
    assert "intervals" in h2o and (out / "kl-vs-kv-memory.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("schemes", "message"),
    [("float:budget=8", "name the policy with evict=POLICY"), ("float:evict=h2o,budget=0", "budget"), ("float", "without evict")],
)
def test_bench_kv_cli_rejects_bad_eviction(tmp_path: Path, schemes: str, message: str) -> None:
    result = run_cli(["bench", "kv", "-o", tmp_path, "--schemes", schemes])
    assert result.exit_code == 2 and message in result.output, result.output


def test_bench_prune_cli_prunes_repairs_and_scores_both_texts(tmp_path: Path, trained_tiny_dir: Path, text_dir: Path) -> None:
    out = tmp_path / "prune"
    unseen = tmp_path / "unseen.txt"
    unseen.write_text((text_dir / "doc1.txt").read_text().upper())  # same words, other tokens: text the repair never saw
    (tmp_path / "other").mkdir()
    other = tmp_path / "other" / "unseen.txt"  # same file name: a second label
    other.write_text((text_dir / "doc2.txt").read_text().upper())
    result = run_cli(
        [
            "bench",
            "prune",
            "-o",
            out,
            "--model",
            str(trained_tiny_dir),
            "--calibration",
            str(text_dir),
            "--evaluation",
            str(text_dir),
            "--unseen",
            str(unseen),
            "--unseen",
            str(other),
            "--cal-samples",
            "4",
            "--cal-seq-len",
            "64",
            "--eval-samples",
            "2",
            "--eval-seq-len",
            "64",
            "--threads",
            "1",
            "--setting",
            "{mlp: 0.5, heads: 0.5, multiple_of: 8}",
            "--setting",
            "{layers: {drop: 2}}",
            "--setting",
            f"{{mlp: 0.75, mlp_method: obs, multiple_of: 8, data: {{source: {text_dir}, samples: 32}}}}",
            "--distill",
            "{steps: 20, batch_size: 2, seq_len: 64, lr: 2.0e-3, warmup_steps: 2, autocast: off}",
        ]
    )
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "results.json").read_text())
    rows = saved["rows"]
    assert [r["setting"] for r in rows] == [
        {"mlp": 0.5, "heads": 0.5, "multiple_of": 8},
        {"layers": {"drop": 2}},
        {"mlp": 0.75, "mlp_method": "obs", "multiple_of": 8, "data": {"source": str(text_dir), "samples": 32}},
    ]
    assert rows[0]["shape"]["intermediate_size"] == 80 and rows[1]["dropped_layers"] and rows[1]["shape"]["num_hidden_layers"] == 2
    for row in rows:
        assert row["tokens"] == 20 * 2 * 64 and row["parameters"] < saved["model"]["parameters"]
        assert set(row["pruned"]) == set(row["repaired"]) == {"held_out", "unseen", "unseen-2"}
        assert row["steps"] == 20 and row["stopped_by"] == "steps"
        if row is not rows[2]:  # obs leaves this tiny model almost unchanged, and 20 steps at lr 2e-3 raise its KL (below)
            assert row["repaired"]["held_out"]["kl_divergence"] < row["pruned"]["held_out"]["kl_divergence"]
        assert row["kl_gap_recovered"]["held_out"] == pytest.approx(
            1 - row["repaired"]["held_out"]["kl_divergence"] / row["pruned"]["held_out"]["kl_divergence"], abs=1e-4
        )
    assert set(saved["texts"]["unseen"]) == {"unseen", "unseen-2"}
    assert saved["texts"]["unseen"]["unseen-2"]["source"] == str(other)
    assert "| mlp 50%, heads 50%, multiple_of 8 |" in (out / "results.md").read_text()
    # the repair refits the narrowed MLPs' down projections first; dropping blocks leaves nothing to refit
    assert rows[0]["refit"]["blocks"] == [0, 1, 2, 3] and rows[1]["refit"] is None
    assert "mlp 50%, heads 50%, multiple_of 8: the refit took" in (out / "results.md").read_text()
    # obs: the pruning fitted the kept columns already (no refit); the activation choice's gap is reported beside its own.
    # Measured on held_out: activation choice 0.0587, obs 0.0004, obs + the 20 steps 0.0258.
    obs = rows[2]
    assert obs["refit"] is None and "pruned_by_activation" not in rows[0]
    for name in ("held_out", "unseen", "unseen-2"):
        assert obs["pruned"][name]["kl_divergence"] < 0.1 * obs["pruned_by_activation"][name]["kl_divergence"]
        assert obs["kl_gap_recovered_of_activation"][name] == pytest.approx(
            1 - obs["repaired"][name]["kl_divergence"] / obs["pruned_by_activation"][name]["kl_divergence"], abs=1e-4
        )
    assert (
        f"mlp 75%, mlp_method obs, data {{source: {text_dir}, samples: 32}}, multiple_of 8: the activation (Minitron) choice"
        in (out / "results.md").read_text()
    )


def test_bench_prune_repair_curves_from_the_same_pruned_model(tmp_path: Path, trained_tiny_dir: Path, text_dir: Path) -> None:
    """--repair: distillation, cross-entropy fine-tuning and a stored teacher from one pruned model, each evaluated
    every 4 steps under a token budget; KL against tokens tabulated and plotted."""
    out = tmp_path / "curves"
    args = ["bench", "prune", "-o", out, "--model", str(trained_tiny_dir), "--calibration", str(text_dir), "--evaluation", str(text_dir)]
    args += ["--unseen", "", "--cal-samples", "4", "--cal-seq-len", "64", "--eval-samples", "2", "--eval-seq-len", "64", "--threads", "1"]
    args += ["--setting", "{mlp: 0.5, multiple_of: 8}"]
    args += [
        "--distill",
        "{steps: 100, max_tokens: 1536, batch_size: 2, seq_len: 64, lr: 2.0e-3, warmup_steps: 2, autocast: off, eval: {every: 4, samples: 2}}",
    ]
    args += ["--repair", "{}", "--repair", "{loss: ce}", "--repair", "{stored_teacher: {top_k: 16}, refit: null}"]
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    row = json.loads((out / "results.json").read_text())["rows"][0]
    kl, ce, stored = row["repairs"]
    assert [r["repair"] for r in row["repairs"]] == ["{loss: kl}", "{loss: ce}", "{stored_teacher: {top_k: 16}, refit: null}"]
    assert (kl["loss"], ce["loss"], stored["stored_top_k"]) == ("kl", "ce", 16)
    for r in row["repairs"]:  # 1536 tokens of 2 x 64 per step: 12 steps, evaluated at 0, 4, 8, 12
        assert r["steps"] == 12 and r["tokens"] == 1536 and r["stopped_by"] == "max_tokens"
        assert [p["tokens"] for p in r["curve"] if not p["refit"]] == [0, 512, 1024, 1536]
        assert r["kl_gap_recovered"]["held_out"] == pytest.approx(
            1 - r["repaired"]["held_out"]["kl_divergence"] / row["pruned"]["held_out"]["kl_divergence"], abs=1e-4
        )
    # the same pruned model under each: the same starting point; the refit (on by default) is one more point at 0 tokens
    assert kl["curve"][0]["kl_divergence"] == ce["curve"][0]["kl_divergence"] == stored["curve"][0]["kl_divergence"]
    assert kl["curve"][1]["refit"] and kl["refit"]["blocks"] and stored["refit"] is None
    assert row["repaired"] == kl["repaired"] and kl["curve"][-1]["kl_divergence"] != ce["curve"][-1]["kl_divergence"]
    assert stored["stored_teacher"]["top_k"] == 16
    md = (out / "results.md").read_text()
    assert "| tokens | {loss: kl} | {loss: ce} | {stored_teacher: {top_k: 16}, refit: null} |" in md and "| 1,536 |" in md
    assert (out / "repair-curves.png").stat().st_size > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--setting", "{mlp: 2}"], "between 0 and 1"),
        (["--setting", "mlp"], "not a YAML mapping"),
        (["--distill", "{stepz: 3}"], "stepz"),
        (["--repair", "{loss: mse}"], "loss"),
        (["--repair", "{loss: ce, stored_teacher: {top_k: 8}}"], "loss ce trains on the text alone"),
        (["--repair", "[1"], "'[1'"),
        (["--device", "tpu"], "--device 'tpu': expected cpu, cuda or auto"),
        pytest.param(
            ["--device", "cuda"],
            "torch sees no CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA"),
        ),
    ],
)
def test_bench_prune_cli_rejects_bad_options(tmp_path: Path, args: list[str], message: str) -> None:
    result = run_cli(["bench", "prune", "-o", tmp_path, *args])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


@pytest.mark.runtime
def test_bench_gguf_computes_in_the_dtype_asked(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    """`--dtype` is a recipe's model.dtype for the bench (float32 where bfloat16 is slow on the CPU):
    results.json records the dtype the model computed in; a dtype it does not know is refused by name."""
    from tests.helpers import run_gguf_bench

    pytest.importorskip("llama_cpp")
    saved = run_gguf_bench(tmp_path / "bf16", tiny_model_dir, text_dir, "rtn:W4g32s", ("--dtype", "bfloat16"))
    assert saved["model"]["dtype"] == "bfloat16"
    assert saved["rows"][0]["records_exact"] > 0
    saved = run_gguf_bench(tmp_path / "auto", tiny_model_dir, text_dir, "rtn:W4g32s")
    assert saved["model"]["dtype"] == "float32"  # the tiny fixture stores float32
    result = run_cli(["bench", "gguf", "-o", tmp_path / "bad", "--model", str(tiny_model_dir), "--dtype", "fp8"])
    assert result.exit_code == 2 and "--dtype: expected one of auto, float32, bfloat16, float16; got 'fp8'" in result.output
    assert not (tmp_path / "bad").exists()
