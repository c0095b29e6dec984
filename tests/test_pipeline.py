"""End to end on a tiny random Llama: recipe -> RTN -> evaluation -> gates -> artifact."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from compress.artifact import load_artifact
from compress.context import RunContext
from compress.fsutil import sha256_file
from compress.hf_model import checksums
from compress.pipeline import run_recipe
from compress.progress import Reporter
from compress.quantizers.configs import RTNConfig
from compress.quantizers.rtn import RTNStage
from compress.recipe import load_recipe
from tests.helpers import recipe_text, run_cli, write_recipe

# Measured (W4 g64 on the tiny model): KL 0.00039, perplexity +0.15% over the baseline's.
PASSING = """\
  - name: kl
    metric: kl_divergence
    max: 0.01
  - metric: perplexity
    max_increase_pct: 5
"""


def test_run_writes_complete_artifact(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    recipe = write_recipe(tmp_path, recipe_text(tiny_model_dir, text_dir, bits=4, group_size=64, gates=PASSING))
    out = tmp_path / "out"
    started = time.perf_counter()
    result = run_cli(["run", recipe, "-o", out])
    wall_s = time.perf_counter() - started
    assert result.exit_code == 0, result.output
    assert "all gates passed" in result.stdout

    report = json.loads((out / "report.json").read_text())
    assert report["passed"] is True
    evals = {e["artifact"]: e for e in report["evaluations"]}
    assert set(evals) == {"baseline", "compressed"}
    for e in evals.values():
        assert (e["runtime"], e["device"], e["source"]) == ("torch", "cpu", "measured")
        assert set(e["metrics"]) == {"perplexity", "kl_divergence", "kl_divergence_p99", "top1_agreement", "tokens_scored"}
        assert e["metrics"]["tokens_scored"] == 6 * (64 - 8)
        # the build that measured it: torch and transformers as installed, the processor by name
        assert e["build"]["runtime"] == "torch" and e["build"]["device"].startswith("cpu: ")
        assert e["build"]["torch"] == importlib.metadata.version("torch")
        assert e["build"]["transformers"] == importlib.metadata.version("transformers")
    assert "### Runtime builds" in (out / "summary.md").read_text()
    assert evals["baseline"]["metrics"]["kl_divergence"] == 0.0
    assert evals["baseline"]["metrics"]["top1_agreement"] == 1.0
    assert evals["compressed"]["metrics"]["kl_divergence"] > 0
    gates = {g["name"]: g for g in report["gates"]}
    assert gates["kl"]["passed"] and gates["kl"]["source"] == "measured" and gates["kl"]["runtime"] == "torch"
    ppl_gate = gates["compressed.perplexity.max_increase_pct"]
    assert ppl_gate["threshold"]["limit"] == pytest.approx(evals["baseline"]["metrics"]["perplexity"] * 1.05)

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["recipe"]["expanded"]["stages"][0]["quantize"]["symmetric"] is True
    assert len(manifest["recipe"]["sha256"]) == 64
    assert manifest["model"]["sha256"] and manifest["model"]["kind"] == "huggingface-directory"
    assert manifest["data"]["evaluation"]["tokens_sha256"] and manifest["data"]["evaluation"]["seed"] == 0
    assert manifest["data"]["calibration"]["documents_sha256"]
    assert manifest["versions"]["torch"] and manifest["versions"]["transformers"]
    stage = manifest["stages"][0]
    assert stage["kind"] == "quantize"
    # seconds, timed inside the run: the stages ran after loading the model and the data and before evaluating
    timings = manifest["timings"]
    assert 0 < timings["total_s"] <= wall_s
    assert 0 < stage["duration_s"] <= timings["total_s"] - timings["load_model_s"] - timings["prepare_data_s"] - timings["evaluate_s"]
    assert stage["summary"]["layers_quantized"] == 2 * 7  # q k v o gate up down per layer; lm_head ignored
    layers = manifest["quantization"]["layers"]
    assert "lm_head" not in layers
    assert layers["model.layers.0.mlp.down_proj"]["scheme"] == {
        "bits": 4,
        "group_size": 64,
        "symmetric": True,
        "scale_dtype": "float16",
        "gguf_type": None,
    }
    for rel, digest in manifest["files"].items():
        assert sha256_file(out / rel) == digest
    assert set(manifest["files"]) == set(checksums(out)) - {"manifest.json", ".compress-output"}
    assert not list(tmp_path.glob(".out.partial-*"))

    # peak memory per phase: each phase the run timed, positive, none above the run's peak; the plan's prediction beside it
    memory = report["memory"]
    assert memory["method"] == "vmhwm"  # Linux: each phase's own peak
    assert set(memory["phases"]) == {k.removesuffix("_s") for k in timings} - {"total"}
    assert {"load_model", "prepare_data", "stages", "evaluate", "write_model"} <= set(memory["phases"])
    for phase in memory["phases"].values():
        assert 0 < phase["peak_rss_mb"] <= memory["peak_rss_mb"]
    assert 0 < memory["wall_s"] <= timings["total_s"]
    predicted = memory["predicted"]
    assert predicted["peak_rss_mb"] > 0 and predicted["time_s"] > 0 and predicted["peak_cuda_mb"] is None
    assert memory["measured_over_predicted"]["peak_rss"] == pytest.approx(memory["peak_rss_mb"] / predicted["peak_rss_mb"], rel=1e-2)
    assert memory["phases"]["stages"]["predicted_rss_mb"] > 0
    assert "### Peak memory per phase" in (out / "summary.md").read_text()


def test_artifact_reloads_to_the_same_model(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    recipe = write_recipe(tmp_path, recipe_text(tiny_model_dir, text_dir, bits=3, group_size=64, symmetric=False))
    out = tmp_path / "out"
    run_recipe(load_recipe(recipe), out, reporter=Reporter(quiet=True))

    expected = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ctx = RunContext(seed=0, device=torch.device("cpu"), tokenizer=None, reporter=Reporter(quiet=True), calibration=lambda: None)
    RTNStage(RTNConfig(bits=3, group_size=64, symmetric=False), "stages[0]").apply(expected, ctx)
    model, _, records = load_artifact(out)
    assert set(records) == set(ctx.quantized)
    for name, rec in records.items():
        assert torch.equal(rec.codes, ctx.quantized[name].codes)
    ids = torch.randint(0, expected.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected(ids).logits)


def test_kl_orders_by_bits(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    kls = []
    for bits in (8, 4, 2):
        recipe = write_recipe(tmp_path, recipe_text(tiny_model_dir, text_dir, bits=bits, group_size=None))
        result = run_recipe(load_recipe(recipe), tmp_path / f"w{bits}", reporter=Reporter(quiet=True))
        kls.append(result.report["evaluations"][1]["metrics"]["kl_divergence"])
    assert kls[0] < kls[1] < kls[2], kls
    assert kls[0] < 1e-3


def test_failing_gate_exits_1_and_still_writes_report(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    gates = "  - metric: top1_agreement\n    min: 0.9999\n  - metric: kl_divergence\n    max: 0.05\n"  # W2: top-1 99.4%, KL 0.008
    recipe = write_recipe(tmp_path, recipe_text(tiny_model_dir, text_dir, bits=2, group_size=None, gates=gates))
    result = run_cli(["run", recipe, "-o", tmp_path / "out"])
    assert result.exit_code == 1, result.output
    assert "a gate failed" in result.stdout
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["passed"] is False
    assert [g["passed"] for g in report["gates"]] == [False, True]


def test_existing_output_needs_overwrite(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    recipe = write_recipe(tmp_path, recipe_text(tiny_model_dir, text_dir))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run_cli(["run", recipe, "-o", out])
    assert result.exit_code == 2 and "already exists" in result.output
    assert (out / "keep.txt").read_text() == "mine"
    refused = run_cli(["run", recipe, "-o", out, "--overwrite"])  # not an output of ours: --overwrite does not delete it
    assert refused.exit_code == 2 and "cannot be replaced" in refused.output, refused.output
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()  # an empty directory may be written into
    assert run_cli(["run", recipe, "-o", out]).exit_code == 2  # still exists: needs --overwrite
    assert run_cli(["run", recipe, "-o", out, "--overwrite"]).exit_code == 0
    first = json.loads((out / "manifest.json").read_text())["created_at"]
    (out / "extra.txt").write_text("added later")  # a file of someone else's in an artifact of ours: kept
    refused = run_cli(["run", recipe, "-o", out, "--overwrite"])
    assert refused.exit_code == 2 and "compress did not write there: extra.txt" in refused.output, refused.output
    (out / "extra.txt").unlink()  # an artifact of ours is replaced whole by --overwrite
    assert run_cli(["run", recipe, "-o", out, "--overwrite"]).exit_code == 0
    assert (out / "manifest.json").is_file() and (out / ".compress-output").is_file()
    assert json.loads((out / "manifest.json").read_text())["created_at"] >= first


def test_failure_while_writing_leaves_nothing(
    tmp_path: Path, tiny_model_dir: Path, text_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import compress.steps.write as write_step

    def broken(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(write_step, "write_model", broken)
    recipe = write_recipe(tmp_path, recipe_text(tiny_model_dir, text_dir))
    with pytest.raises(OSError, match="simulated"):
        run_recipe(load_recipe(recipe), tmp_path / "out", reporter=Reporter(quiet=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


def test_tied_lm_head_is_untied_when_quantized(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    extra = "      ignore: []\n"
    text = recipe_text(tiny_model_dir, text_dir, bits=4, group_size=32).replace(
        "      symmetric: true\n", "      symmetric: true\n" + extra
    )
    recipe = write_recipe(tmp_path, text)
    result = run_recipe(load_recipe(recipe), tmp_path / "out", reporter=Reporter(quiet=True))
    layers = result.manifest["stages"][0]["layers"]
    assert layers["lm_head"]["untied_from"] == ["model.embed_tokens.weight"]
    model, _, records = load_artifact(tmp_path / "out")
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert torch.equal(model.model.embed_tokens.weight, original.model.embed_tokens.weight)  # embedding kept float
    assert torch.equal(model.lm_head.weight, records["lm_head"].dequantize())


def test_targets_and_ignore(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    text = recipe_text(tiny_model_dir, text_dir).replace(
        "      symmetric: true\n", "      symmetric: true\n      ignore: [lm_head, mlp.*]\n"
    )
    result = run_recipe(load_recipe(write_recipe(tmp_path, text)), tmp_path / "a", reporter=Reporter(quiet=True))
    assert sorted({n.rsplit(".", 1)[1] for n in result.manifest["quantization"]["layers"]}) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    text = recipe_text(tiny_model_dir, text_dir).replace(
        "      symmetric: true\n", "      symmetric: true\n      targets: [no_such_layer]\n"
    )
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", tmp_path / "b"])
    assert result.exit_code == 2 and "select no Linear layer" in result.output


def test_two_stages_cannot_quantize_one_layer_twice(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    extra = "  - quantize: {method: rtn, bits: 8, group_size: 32}\n"
    recipe = write_recipe(tmp_path, recipe_text(tiny_model_dir, text_dir, extra_stage=extra))
    result = run_cli(["run", recipe, "-o", tmp_path / "out"])
    assert result.exit_code == 2 and "already quantized by stages[0]" in result.output


def test_model_source_errors(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    # Missing model.
    result = run_cli(["run", write_recipe(tmp_path, recipe_text(tmp_path / "nope", text_dir)), "-o", tmp_path / "o1"])
    assert result.exit_code == 2 and "is not a directory, a .gguf file" in result.output
    # Hub id that is not in the local cache: refused, nothing downloaded.
    result = run_cli(["run", write_recipe(tmp_path, recipe_text("nobody/not-cached-model", text_dir)), "-o", tmp_path / "o2"])
    assert result.exit_code == 2 and "not in the local Hugging Face cache" in result.output
    # Pickle-only checkpoint: refused unless allowed.
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    torch.save(AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict(), pickled / "pytorch_model.bin")
    for f in [*tiny_model_dir.glob("tokenizer*"), tiny_model_dir / "config.json"]:
        shutil.copy(f, pickled)
    text = recipe_text(pickled, text_dir)
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", tmp_path / "o3"])
    assert result.exit_code == 2 and "only pickle checkpoints" in result.output
    text = text.replace(f"  source: {pickled}\n", f"  source: {pickled}\n  allow_pickle: true\n")
    assert run_cli(["run", write_recipe(tmp_path, text), "-o", tmp_path / "o4"]).exit_code == 0
    # Remote code: refused unless trusted.
    remote = tmp_path / "remote"
    shutil.copytree(tiny_model_dir, remote)
    config = json.loads((remote / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (remote / "config.json").write_text(json.dumps(config))
    result = run_cli(["run", write_recipe(tmp_path, recipe_text(remote, text_dir)), "-o", tmp_path / "o5"])
    assert result.exit_code == 2 and "trust_remote_code" in result.output


def test_hub_id_resolves_from_local_cache(tmp_path: Path, tiny_model_dir: Path, text_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = tmp_path / "hub"
    snapshot = hub / "models--acme--tiny" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_model_dir, snapshot)
    (hub / "models--acme--tiny" / "refs").mkdir()
    (hub / "models--acme--tiny" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    result = run_recipe(
        load_recipe(write_recipe(tmp_path, recipe_text("acme/tiny", text_dir))), tmp_path / "out", reporter=Reporter(quiet=True)
    )
    assert result.manifest["model"]["kind"] == "huggingface-cache"
    assert result.manifest["model"]["path"] == str(snapshot)


def test_default_threads_follow_the_cpu_affinity_and_a_cgroup_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every default thread count is compress.paths.usable_cpus(): the CPUs the process may run on (a command
    started under `taskset` or in a pinned test worker counts one CPU), and no more than a cgroup quota allows."""
    import os
    import subprocess
    import sys

    from compress import paths

    first = min(os.sched_getaffinity(0))
    pinned = f"import os; os.sched_setaffinity(0, {{{first}}}); from compress.paths import usable_cpus; print(usable_cpus())"
    assert subprocess.run([sys.executable, "-c", pinned], capture_output=True, text=True, check=True).stdout.strip() == "1"
    monkeypatch.setattr(paths.os, "sched_getaffinity", lambda _pid: set(range(8)))
    v2, v1_quota, v1_period = tmp_path / "cpu.max", tmp_path / "quota", tmp_path / "period"
    monkeypatch.setattr(paths, "CGROUP_CPU_FILES", ((str(v2), None), (str(v1_quota), str(v1_period))))
    assert paths.usable_cpus() == 8  # no quota files: the affinity
    v2.write_text("max 100000\n")
    assert paths.usable_cpus() == 8
    v2.write_text("250000 100000\n")  # 2.5 CPUs: 3 threads
    assert paths.usable_cpus() == 3
    v2.unlink()
    v1_quota.write_text("100000\n")
    v1_period.write_text("100000\n")
    assert paths.usable_cpus() == 1
    v1_quota.write_text("-1\n")
    assert paths.usable_cpus() == 8
    v1_quota.write_text("garbage\n")  # unreadable: no cap
    assert paths.usable_cpus() == 8
