"""Device profiles, roofline estimates, the fit check, and `compress plan` (eval/devices.py, eval/plan/)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from compress.errors import CompressError
from compress.eval.devices import (
    LOCAL,
    estimate_latency,
    fit_check,
    get_profile,
    kv_bytes_per_token,
    load_profiles,
    local_profile,
    measure_bandwidth,
)
from compress.schema.devices import DeviceProfile
from tests.conftest import ROOT
from tests.helpers import recipe_text, run_cli, write_recipe

SHIPPED = (
    "h100-sxm",
    "h200",
    "a100-80gb",
    "a100-40gb",
    "l4",
    "a10g",
    "jetson-orin-nano-8gb",
    "jetson-agx-orin-64gb",
    "raspberry-pi-5-8gb",
    "apple-m2",
    "apple-m3-max",
)


def profile(**kw) -> DeviceProfile:
    base = dict(
        name="test",
        description="a test device",
        kind="gpu",
        memory_gb=10,
        bandwidth_gbs=100,
        fp16_tflops=10,
        runtimes=["torch"],
        formats=["hf"],
        decode_efficiency=0.5,
        prefill_efficiency=0.5,
        usable_memory_fraction=0.9,
        source="made up for a test",
    )
    return DeviceProfile(**{**base, **kw})


def test_shipped_profiles_load_with_their_datasheet_numbers() -> None:
    profiles = load_profiles()
    assert list(profiles) == list(SHIPPED)
    assert all(p.source.startswith("vendor datasheet") for p in profiles.values())
    h100, pi = profiles["h100-sxm"], profiles["raspberry-pi-5-8gb"]
    assert (h100.memory_gb, h100.bandwidth_gbs, h100.decode_efficiency) == (80, 3350, 0.6)
    assert (profiles["h200"].memory_gb, profiles["h200"].bandwidth_gbs) == (141, 4800)
    assert pi.bandwidth_gbs == pytest.approx(4267e6 * 4 / 1e9, rel=0.01)  # LPDDR4X-4267 on a 32-bit bus
    assert set(pi.runtimes) == {"llama.cpp", "onnxruntime"} and not pi.supports("hf", "torch") and pi.supports("gguf", "llama.cpp")
    assert all("tensorrt" not in profiles[n].runtimes for n in ("apple-m2", "apple-m3-max"))


def test_user_file_overrides_a_shipped_profile_and_adds_its_own(tmp_path: Path) -> None:
    f = tmp_path / "mine.yaml"
    f.write_text("""devices:
  - name: h100-sxm
    description: an H100 with a lower clock
    kind: gpu
    memory_gb: 80
    bandwidth_gbs: 3000
    fp16_tflops: 900
    runtimes: [torch]
    formats: [hf]
    source: measured on our cluster
  - name: edge-box
    description: our edge box
    kind: soc
    memory_gb: 4
    bandwidth_gbs: 34
    fp16_tflops: 1
    runtimes: [llama.cpp]
    formats: [gguf]
    source: vendor datasheet
""")
    profiles = load_profiles([f])
    assert profiles["h100-sxm"].bandwidth_gbs == 3000 and profiles["edge-box"].memory_gb == 4
    assert len(profiles) == len(SHIPPED) + 1
    extra = {**profiles["edge-box"].model_dump(), "memory_gb": 8}
    assert load_profiles([f], [extra])["edge-box"].memory_gb == 8  # dicts come last and win


def test_bad_key_names_the_key_file_and_line(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(
        "devices:\n  - name: box\n    description: x\n    kind: cpu\n    memory_gb: 4\n    bandwith_gbs: 10\n"
        "    fp16_tflops: 1\n    runtimes: [torch]\n    formats: [hf]\n    source: s\n"
    )
    with pytest.raises(CompressError) as exc:
        load_profiles([f])
    msg = str(exc.value)
    assert f"{f}:6: unknown key 'bandwith_gbs' (did you mean 'bandwidth_gbs'?)" in msg
    assert "required key 'bandwidth_gbs' is missing" in msg and "devices[0] (box)" in msg
    f.write_text("device:\n  - name: box\n")
    with pytest.raises(CompressError, match="one key, `devices:`"):
        load_profiles([f])
    with pytest.raises(CompressError, match=r"(?s)extra\[0\].*kind: Input should be"):
        load_profiles(extra=[{**profile().model_dump(), "kind": "tpu"}])


def test_unknown_device_lists_the_known_names() -> None:
    with pytest.raises(CompressError) as exc:
        get_profile(load_profiles(), "h100")
    msg = str(exc.value)
    assert "unknown device 'h100' (did you mean 'h100-sxm'?)" in msg and all(n in msg for n in SHIPPED)


def test_kv_bytes_per_token_of_a_tiny_llama() -> None:
    from tests.tiny import tiny_config

    config = tiny_config(hidden=96, heads=4, kv_heads=2, layers=3)
    assert kv_bytes_per_token(config) == 2 * 3 * 2 * 24 * 2  # K and V x layers x KV heads x head_dim 96/4 x fp16
    assert kv_bytes_per_token(config, 1.0) == 2 * 3 * 2 * 24
    config.head_dim = 32  # an explicit head_dim wins over hidden / heads
    assert kv_bytes_per_token(config, 4.0) == 2 * 3 * 2 * 32 * 4


def test_estimate_latency_memory_bound_by_hand() -> None:
    p = profile()  # 100 GB/s x 0.5 = 50e9 B/s; 10 TFLOPS x 0.5 = 5e12 FLOP/s
    est = estimate_latency(
        p, weight_bytes=10**9, kv_bytes_per_token=10**5, params=5 * 10**8, prompt_tokens=1000, output_tokens=200, batch=2
    )
    # decode: (1e9 + 2 x 1e5 x (1000 + 200/2)) / 50e9 = 24.4 ms (compute: 2 x 5e8 x 2 / 5e12 = 0.2 ms)
    assert est["tpot_ms"] == pytest.approx(24.4)
    assert est["decode_tokens_per_s"] == pytest.approx(1000 / 24.4)
    assert est["batch_decode_tokens_per_s"] == pytest.approx(2000 / 24.4)
    # prefill: compute 2 x 5e8 x 1000 x 2 / 5e12 = 400 ms > weights once 1e9 / 50e9 = 20 ms
    assert est["ttft_ms"] == pytest.approx(400.0)
    a = est["assumptions"]
    assert (a["decode_bound"], a["prefill_bound"], a["mean_context"]) == ("memory", "compute", 1100)
    assert a["decode_efficiency"] == 0.5 and "formula" in a


def test_estimate_latency_compute_bound_by_hand() -> None:
    est = estimate_latency(profile(), weight_bytes=10**6, kv_bytes_per_token=0, params=5 * 10**8, prompt_tokens=1, output_tokens=1)
    assert est["tpot_ms"] == pytest.approx(0.2)  # 2 x 5e8 / 5e12 s > 1e6 / 50e9 s
    assert est["ttft_ms"] == pytest.approx(0.2) and est["assumptions"]["decode_bound"] == "compute"
    with pytest.raises(CompressError):
        estimate_latency(profile(), 10**6, 0, 10**6, 0, 1)


def test_fit_check_boundary() -> None:
    p = profile()  # 10 GB x 0.9 = 9e9 usable bytes
    at_limit = fit_check(p, weight_bytes=8 * 10**9, kv_bytes_per_token=1000, context=10**6, batch=1)  # 8e9 + 1e9
    assert at_limit["fits"] and at_limit["memory_fraction"] == pytest.approx(1.0) and at_limit["usable_gb"] == pytest.approx(9.0)
    over = fit_check(p, weight_bytes=8 * 10**9, kv_bytes_per_token=1000, context=10**6 + 1, batch=1)
    assert not over["fits"] and over["memory_fraction"] > 1
    batched = fit_check(p, weight_bytes=8 * 10**9, kv_bytes_per_token=1000, context=10**6 // 2, batch=2, overhead_bytes=1)
    assert not batched["fits"] and batched["kv_cache_gb"] == pytest.approx(1.0)


def test_measure_bandwidth_and_local_profile() -> None:
    bw = measure_bandwidth(size_mb=32, repeats=3)
    assert math.isfinite(bw["bandwidth_gbs"]) and 0 < bw["bandwidth_gbs"] <= bw["best_gbs"]
    assert bw["repeats"] == 3 and "read+write counted" in bw["method"]
    local = local_profile(bandwidth_gbs=12.5, fp16_tflops=0.1)  # given numbers: nothing measured
    assert local.name == LOCAL and local.bandwidth_gbs == 12.5 and local.memory_gb > 0
    assert "torch" in local.runtimes and "hf" in local.formats and local.source.startswith("measured on this machine")


# --------------------------------------------------------------------------- compress plan


def test_plan_of_a_tiny_model_sizes_follow_the_bits(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    from compress.eval.plan.planner import plan_recipe
    from compress.recipe import load_recipe

    devices = {"test": profile(runtimes=["torch", "llama.cpp"], formats=["hf", "gguf"])}
    plans = {}
    for bits in (4, 8):
        path = write_recipe(tmp_path, recipe_text(tiny_model_dir, text_dir, bits=bits, group_size=32), f"r{bits}.yaml")
        plans[bits] = plan_recipe(load_recipe(path, ["exports=[{format: gguf, verify: false}]"]), devices, [], context=64)
    sizes = {bits: {a["artifact"]: a["size_bytes"] for a in p["artifacts"]} for bits, p in plans.items()}
    assert sizes[4]["compressed"] < sizes[8]["compressed"] < sizes[8]["baseline"]
    assert sizes[4]["gguf"] < sizes[8]["gguf"]  # auto: q4_0 (4.5 bits/weight) vs q8_0 (8.5)
    p = plans[4]
    assert p["source"] == "estimated" and [s["step"] for s in p["steps"]] == [
        "load model",
        "stages[0] quantize rtn",
        "evaluate",
        "export gguf (gguf)",
    ]
    assert all(s["peak_memory_gb"] > 0 and s["time_s"] > 0 and s["basis"] for s in p["steps"])
    fit = {r["artifact"]: r for r in p["fit"]}
    assert set(fit) == {"baseline", "compressed", "gguf"} and all(r["fits"] and r["supported"] for r in fit.values())
    assert fit["gguf"]["kv_bytes_per_token"] == 2 * 2 * 2 * 24 * 2  # 2 layers, 2 KV heads, head_dim 24, fp16


def test_plan_follows_a_prune_stage(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    from transformers import LlamaConfig

    from compress.eval.plan.planner import plan_recipe
    from compress.eval.plan.shapes import shape_of
    from compress.recipe import load_recipe

    text = recipe_text(tiny_model_dir, text_dir).replace("stages:\n", "stages:\n  - prune: {mlp: 0.5, multiple_of: 16}\n")
    p = plan_recipe(load_recipe(write_recipe(tmp_path, text)), {"test": profile()}, ["test"])
    config = LlamaConfig.from_pretrained(tiny_model_dir)
    config.intermediate_size = 80  # 160 x (1 - 0.5), a multiple of 16
    assert p["model"]["parameters_after_stages"] == shape_of(config).params < p["model"]["parameters"]
    assert [s["step"] for s in p["steps"]][1:3] == ["stages[0] prune", "stages[1] quantize rtn"]


def test_cli_plan_quickstart(tmp_path: Path) -> None:
    from compress import assets

    if assets.locate("smollm2-135m") is None:
        pytest.skip("reference model not fetched (compress assets fetch smollm2-135m)")
    out = tmp_path / "plan.json"
    result = run_cli(["plan", ROOT / "recipes" / "quickstart.yaml", "--json", out])
    assert result.exit_code == 0, result.output
    for text in ("estimated", "load model", "stages[0] quantize rtn", "evaluate", "total"):
        assert text in result.stdout
    plan = json.loads(out.read_text())
    assert {r["device"] for r in plan["fit"]} == {LOCAL, *SHIPPED}
    assert plan["model"]["parameters"] == 134_515_008 and {(r["context"], r["batch"]) for r in plan["fit"]} == {(512, 1)}
    shown = result.stdout.replace("…", "")
    assert all(name[:8] in shown for name in (LOCAL, *SHIPPED))  # the table may shorten long names


def test_cli_plan_bad_input_exits_2(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    recipe = write_recipe(tmp_path, recipe_text(tiny_model_dir, text_dir))
    result = run_cli(["plan", recipe, "--device", "rpi5"])
    assert result.exit_code == 2 and "unknown device 'rpi5'" in result.output and "raspberry-pi-5-8gb" in result.output
    bad = tmp_path / "devices.yaml"
    bad.write_text("devices:\n  - {name: x, colour: red}\n")
    result = run_cli(["plan", recipe, "--devices-file", bad, "--device", "l4"])
    assert result.exit_code == 2 and "unknown key 'colour'" in result.output
    result = run_cli(["plan", recipe, "--device", "l4", "--context", "4096", "--batch", "8"])
    assert result.exit_code == 0 and "4,096x8" in result.stdout


def test_plan_uses_the_recipe_targets_and_devices(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    from compress.eval.plan.planner import plan_recipe
    from compress.recipe import load_recipe

    own = profile(name="my-board", runtimes=["llama.cpp"], formats=["gguf"]).model_dump()
    overrides = [f"devices=[{json.dumps(own)}]", "targets=[{device: my-board, context: 1000, batch: 3}, {device: l4}]"]
    loaded = load_recipe(write_recipe(tmp_path, recipe_text(tiny_model_dir, text_dir)), overrides)
    devices = load_profiles(extra=[d.model_dump() for d in loaded.recipe.devices])
    plan = plan_recipe(loaded, devices, [])
    assert [(r["device"], r["context"], r["batch"]) for r in plan["fit"] if r["artifact"] == "baseline"] == [
        ("my-board", 1000, 3),
        ("l4", 64, 1),
    ]  # l4 names no context: data.evaluation.seq_len
    assert not any(r["supported"] for r in plan["fit"] if r["device"] == "my-board")  # hf/torch does not run there
    plan = plan_recipe(loaded, devices, ["h200"], context=10, batch=2)  # the command line wins
    assert {(r["device"], r["context"], r["batch"]) for r in plan["fit"]} == {("h200", 10, 2)}


def test_cli_plan_does_not_fetch_the_reference_model(cache_dir: Path) -> None:
    result = run_cli(["plan", ROOT / "recipes" / "quickstart.yaml", "--device", "l4"])
    assert result.exit_code == 2 and "compress assets fetch smollm2-135m" in result.output
    assert not (cache_dir / "assets").exists()
