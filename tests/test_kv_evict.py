"""KV-cache eviction: the evicting cache against the float and quantized caches, each policy's
choice, fastgen's profile and its stored form, the needle rows, and the recipe stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from compress.errors import CompressError
from compress.eval.kv_eval import cached_forward, evaluate_kv, needle_rows
from compress.eval.metrics import torch_forward
from compress.quantizers.kv_cache import KVCacheScheme
from compress.quantizers.kv_cache_config import KVCacheConfig
from compress.quantizers.kv_cache_store import QuantizedKVCache
from compress.quantizers.kv_evict import (
    FASTGEN_POLICIES,
    PROFILE_FILE,
    PUNCT,
    SPECIAL,
    EvictingKVLayer,
    StepTokens,
    TokenTables,
    entry_bytes,
    evicting_attention_on,
    load_profile,
    profile_heads,
    token_tables,
)
from tests.helpers import recipe_text, run_cli, write_recipe
from tests.test_kv_cache import CPU, ids, tiny

LAYERS = 2


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def rows(n: int = 2, length: int = 128) -> torch.Tensor:
    return torch.cat([ids(length, seed) for seed in range(n)])


def decode(model: torch.nn.Module, cfg: KVCacheConfig, x: torch.Tensor, step: int = 1, **scheme) -> torch.Tensor:
    return cached_forward(model, CPU, KVCacheScheme(cfg, None, LAYERS, **scheme).new_cache, step)(x).full()


def float_evict(policy: str = "h2o", budget: int | None = 48, **fields) -> KVCacheConfig:
    return KVCacheConfig(format="float", evict={"policy": policy, "budget": budget, **fields}, evaluate=None)


# --------------------------------------------------------------------------- the cache against the caches without eviction


def test_a_budget_covering_the_context_decodes_like_a_float16_cache() -> None:
    model, x = tiny(), rows()
    full = torch_forward(model, CPU)(x).full()
    out = decode(model, float_evict("window", budget=x.shape[1]), x)
    assert (out - full).abs().max() < 2e-3  # float16 keys and values, nothing evicted
    evicted = decode(model, float_evict("window", budget=32), x)
    assert (evicted - full).abs().max() > 0.05  # the tiny model's sharpened attention sees the eviction


@pytest.mark.parametrize(
    "fields",
    [
        {"bits": 4, "key_axis": "token", "residual": 0, "group_size": 16},
        {"bits": 4, "residual": 32},  # KIVI: keys per channel over blocks of 32 tokens, a float16 window
        {"bits": 2, "residual": 16, "group_size": 16},
    ],
)
def test_with_nothing_evicted_it_decodes_exactly_like_the_quantized_cache(fields: dict) -> None:
    model, x = tiny(), rows()
    quantized = KVCacheConfig(**fields, evaluate=None)
    both = KVCacheConfig(**fields, evict={"policy": "window", "budget": x.shape[1] + 64}, evaluate=None)
    reference = cached_forward(model, CPU, lambda: QuantizedKVCache(quantized, LAYERS), 1)(x).full()
    assert torch.allclose(decode(model, both, x), reference, atol=1e-4)  # eager against sdpa attention: float32 rounding


@pytest.mark.parametrize("policy", ["window", "h2o", "snapkv"])
def test_each_kv_head_keeps_the_budget_with_its_sink_and_counts_the_bytes(policy: str) -> None:
    model, x = tiny(), rows(length=100)
    cfg = float_evict(policy, budget=40, sink=2, window=8)
    cache = KVCacheScheme(cfg, None, LAYERS).new_cache()
    cached_forward(model, CPU, lambda: cache, 1)(x)
    per_token = entry_bytes(cfg, 32)[0]
    for layer in cache.layers:
        assert torch.equal(layer.kept_tokens(), torch.full((2, 2), 40))  # batch x KV heads (GQA: 4 query heads share 2)
        kept = layer.s_pos.masked_fill(~layer.s_valid, -1)
        for head in kept.flatten(0, 1):
            positions = set(head.tolist()) - {-1}
            assert {0, 1} <= positions  # the sink
            if policy != "window":
                assert set(range(92, 100)) <= positions  # the recent window
        if policy == "window":
            assert set(kept[0, 0].tolist()) == {0, 1, *range(62, 100)}
        assert torch.equal(layer.held_bytes(), torch.full((2,), 2 * 40 * per_token, dtype=torch.float64))
    assert cache.step.held[-1] == LAYERS * 2 * 40 * per_token and max(cache.step.held) == cache.step.held[-1]
    assert cache.step.seen == list(range(1, 101))


def test_heavy_hitters_keep_the_tokens_that_received_the_most_attention() -> None:
    cfg = float_evict("h2o", budget=6, sink=1, window=2)
    layer = EvictingKVLayer(cfg, None, StepTokens())
    k = torch.randn(1, 1, 10, 4)
    layer.update(k, k.clone())
    # attention received so far: token 5 and 3 most, then 7; sink 0 and recent 8, 9 are kept anyway
    received = torch.tensor([0.0, 0.1, 0.0, 0.9, 0.2, 1.5, 0.0, 0.5, 0.0, 0.0])
    layer.observe(received.view(1, 1, 10))
    kept = set(layer.s_pos[layer.s_valid].tolist())
    assert kept == {0, 3, 5, 7, 8, 9}


def test_snapkv_pools_scores_over_neighbours() -> None:
    cfg = float_evict("snapkv", budget=4, sink=0, window=1, pool=3)
    layer = EvictingKVLayer(cfg, None, StepTokens())
    k = torch.randn(1, 1, 8, 4)
    layer.update(k, k.clone())
    layer.observe(torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]).view(1, 1, 8))
    assert set(layer.s_pos[layer.s_valid].tolist()) == {3, 4, 5, 7}  # token 4 and, pooled, its neighbours; 7 is recent


def test_the_cache_refuses_an_attention_that_does_not_report_back() -> None:
    model, x = tiny(), rows(length=8)
    cache = KVCacheScheme(float_evict(budget=7, window=1, sink=1), None, LAYERS).new_cache()
    with pytest.raises(CompressError, match="evicting_attention_on"):
        model(input_ids=x, past_key_values=cache, use_cache=True)  # sdpa: the cache never hears what was attended


def test_the_evicting_attention_without_a_cache_is_the_models_own() -> None:
    model, x = tiny(), rows()
    reference = model(input_ids=x).logits
    with evicting_attention_on(model):
        assert torch.allclose(model(input_ids=x).logits, reference, atol=1e-5)
    assert model.config._attn_implementation != "compress_evict"


def test_decoding_several_tokens_a_step_masks_the_new_tokens_causally() -> None:
    model, x = tiny(), rows()
    full = torch_forward(model, CPU)(x).full()
    assert (decode(model, float_evict("window", budget=x.shape[1]), x, step=16) - full).abs().max() < 2e-3


# --------------------------------------------------------------------------- fastgen


def test_token_tables_flag_special_and_punctuation_tokens(tokenizer) -> None:
    tables = token_tables(tokenizer, len(tokenizer))
    for i in tokenizer.all_special_ids:
        assert tables.flags[i] & SPECIAL
    period = tokenizer.convert_tokens_to_ids(".")
    word = tokenizer.encode("the", add_special_tokens=False)[0]
    assert tables.flags[period] & PUNCT and not tables.flags[word] & PUNCT


def test_fastgen_profile_chooses_cheaper_policies_as_the_threshold_falls() -> None:
    model, x = tiny(), rows(2, 64)
    tables = TokenTables(torch.zeros(256, dtype=torch.uint8))
    strict = profile_heads(model, x, KVCacheConfig(format="float", evict={"policy": "fastgen", "recovery": 1.0}).evict, tables, CPU, (2, 2))
    loose = profile_heads(model, x, KVCacheConfig(format="float", evict={"policy": "fastgen", "recovery": 0.3}).evict, tables, CPU, (2, 2))
    assert strict["policy"].shape == (LAYERS, 2)  # one policy per KV head
    assert bool((strict["policy"] == len(FASTGEN_POLICIES) - 1).all())  # only 'full' keeps all of a head's attention
    assert bool((loose["policy"] < strict["policy"]).any()) and bool((loose["kept"] < 1).all())
    assert bool((loose["recovered"] >= 0.3).all())


def test_a_fastgen_cache_follows_each_heads_policy() -> None:
    model, x = tiny(), rows(1, 96)
    flags = torch.zeros(256, dtype=torch.uint8)
    flags[x[0, 40]] = PUNCT
    tables = TokenTables(flags)
    cfg = KVCacheConfig(format="float", evict={"policy": "fastgen", "sink": 2, "local": 0.25, "frequent": 0.1}, evaluate=None)
    profile = {"policy": torch.tensor([[0, 1], [3, 4]], dtype=torch.int8)}  # special | special+punct ; +frequent+local | full
    cache = KVCacheScheme(cfg, None, LAYERS, tables, profile).new_cache()
    cached_forward(model, CPU, lambda: cache, 1)(x)
    kept = [[set(layer.s_pos[0, h][layer.s_valid[0, h]].tolist()) for h in range(2)] for layer in cache.layers]
    punct = {int(i) for i in torch.nonzero(flags[x[0]] > 0)}
    assert kept[0][0] == {0, 1}
    assert kept[0][1] == {0, 1} | punct
    assert set(range(72, 96)) <= kept[1][0] and len(kept[1][0]) < 96  # the local quarter, then heavy hitters
    assert kept[1][1] == set(range(96))


def test_a_stored_profile_is_checked_when_loaded(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    good = {"policy": torch.zeros(2, 3, dtype=torch.int8), "recovered": torch.ones(2, 3), "kept": torch.full((2, 3), 0.5)}
    save_file(good, str(tmp_path / "p.safetensors"))
    assert torch.equal(load_profile(tmp_path / "p.safetensors", 2, 3)["policy"], good["policy"])
    with pytest.raises(CompressError, match=r"this model has 4 layers x 3 KV heads"):
        load_profile(tmp_path / "p.safetensors", 4, 3)
    save_file({**good, "policy": torch.full((2, 3), 9, dtype=torch.int8)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(CompressError, match="policy indices outside"):
        load_profile(tmp_path / "bad.safetensors", 2, 3)
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CompressError, match="not a readable safetensors file"):
        load_profile(tmp_path / "junk.safetensors", 2, 3)
    with pytest.raises(CompressError, match=f"an artifact folder with {PROFILE_FILE}"):
        load_profile(tmp_path, 2, 3)


# --------------------------------------------------------------------------- evaluation


def test_evaluation_reports_the_bytes_held_at_the_end_their_peak_and_mean() -> None:
    model, x = tiny(), rows(2, 96)
    cfg = KVCacheConfig(format="float", evict={"policy": "h2o", "budget": 48, "window": 8}, evaluate={"context": 96, "samples": 2})
    found = evaluate_kv(model, KVCacheScheme(cfg, None, LAYERS), x, 8, CPU)
    mem, metrics = found["memory"], found["metrics"]
    assert mem["compression_vs_fp16"] == 2.0 and metrics["kv_compression"] == 2.0  # 48 of 96 tokens, float16
    assert metrics["kv_bytes_per_token"] == mem["bytes_per_token"] == 2 * LAYERS * 2 * 32 * 2 / 2
    assert mem["peak_cache_bytes"] == mem["cache_bytes"]  # the budget is reached and held
    assert 1.0 < mem["mean_compression_vs_fp16"] < 2.0  # early tokens: nothing evicted yet
    assert metrics["kl_divergence"] > 0


def test_needle_rows_place_the_number_early_and_ask_for_it_at_the_end(tokenizer) -> None:
    chunks = torch.tensor([tokenizer.encode("word " * 200, add_special_tokens=False)[:128]] * 2)
    made, answers = needle_rows(tokenizer, chunks, 3, depth=0.25)
    assert made.shape == (3, 128)
    for row, at in zip(made, answers, strict=True):
        text = tokenizer.decode(row)
        number = tokenizer.decode(row[at]).strip()
        assert number.isdigit() and len(number) == 5 and text.endswith(f"The secret number is {number}")
        assert text.index(f"The secret number is {number}.") < len(text) // 2
    with pytest.raises(CompressError, match="kv_cache.evaluate.needles: a needle row needs more than"):
        needle_rows(tokenizer, chunks[:, :24], 1, depth=0.25)


# --------------------------------------------------------------------------- the recipe stage

EVICT_STAGE = """\
  - kv_cache:
      format: float
      evict: {evict}
      evaluate: {{context: 96, samples: 2, batch: 2, step: 4, needles: 2, needle_depth: 0.2}}
"""


def evict_recipe(model_dir: Path, text_dir: Path, evict: str, gates: str = "") -> str:
    return recipe_text(model_dir, text_dir, bits=4, group_size=32, gates=gates, extra_stage=EVICT_STAGE.format(evict=evict))


def test_recipe_with_fastgen_stores_its_profile_and_a_second_run_reuses_it(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    gates = (
        "  - {artifact: kv_cache, metric: kv_compression, min: 1.0}\n"
        "  - {artifact: kv_cache, metric: needle_recall, min: 0}\n"
        "  - {artifact: kv_cache, metric: kv_bytes_per_token, max: 1.0}\n"
    )
    out = tmp_path / "out"
    evict = "{policy: fastgen, recovery: 0.5, profile_context: 32}"
    result = run_cli(["run", write_recipe(tmp_path, evict_recipe(tiny_model_dir, text_dir, evict, gates)), "-o", out])
    assert result.exit_code == 1, result.output  # the bytes gate fails: the cache holds far more than a byte per token
    report = json.loads((out / "report.json").read_text())
    kv = next(e for e in report["evaluations"] if e["artifact"] == "kv_cache")
    assert {"kv_compression", "kv_bytes_per_token", "needle_recall"} <= set(kv["metrics"])
    assert kv["details"]["needles"]["needles"] == 2 and kv["details"]["memory"]["context"] == 96
    needles = kv["details"]["needles"]
    assert 0 <= needles["needle_token_recall"] <= 1 and needles["needle_recall"] <= needles["needle_token_recall"]
    assert [g["passed"] for g in report["gates"]] == [True, True, False]
    manifest = json.loads((out / "manifest.json").read_text())
    assert PROFILE_FILE in manifest["files"]
    profile = manifest["stages"][1]["summary"]["fastgen_profile"]
    assert sum(profile["heads_per_policy"].values()) == 2 * 2
    assert report["kv_cache"]["runtimes"]["llama.cpp"]["eviction"]["supported"] is False
    again = tmp_path / "again"
    reuse = f"{{policy: fastgen, profile: {out}}}"
    result = run_cli(["run", write_recipe(tmp_path, evict_recipe(tiny_model_dir, text_dir, reuse)), "-o", again])
    assert result.exit_code == 0, result.output
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(again / PROFILE_FILE))["policy"], load_file(str(out / PROFILE_FILE))["policy"])


@pytest.mark.parametrize(
    ("evict", "message"),
    [
        ("{policy: h2o, budget: 0}", "evict.budget"),
        ("{policy: h2o}", "the h2o policy keeps a fixed number of tokens per KV head; set evict.budget"),
        ("{policy: window, budget: 500}", "evict.budget 500 >= evaluate.context 96"),
        ("{policy: h2o, budget: 64, window: 200}", "evict.budget 64 leaves no room"),
        ("{policy: window, budget: 64, window: 200}", "evict.window 200 >= evaluate.context 96"),
        ("{policy: lru, budget: 8}", "evict.policy"),
        ("{policy: fastgen, budget: 8}", "set evict.recovery instead of a budget"),
        ("{policy: h2o, budget: 40, pool: 4}", "evict.pool 4 must be odd"),
    ],
)
def test_eviction_errors_name_the_key(tmp_path: Path, tiny_model_dir: Path, text_dir: Path, evict: str, message: str) -> None:
    result = run_cli(["validate", write_recipe(tmp_path, evict_recipe(tiny_model_dir, text_dir, evict))])
    assert result.exit_code == 2 and message in result.output, result.output


def test_config_refuses_a_float_cache_without_eviction_and_a_budget_inside_the_window() -> None:
    with pytest.raises(ValidationError, match="without evict this stage changes nothing"):
        KVCacheConfig(format="float")
    with pytest.raises(ValidationError, match="set format: float and bits: 16 together"):
        KVCacheConfig(bits=16, evict={"policy": "window", "budget": 8})
    with pytest.raises(ValidationError, match="must exceed sink 4 \\+ residual 128"):
        KVCacheConfig(bits=4, evict={"policy": "window", "budget": 100})
    assert KVCacheConfig(format="float", evict={"policy": "window", "budget": 8}).bits == 16


def test_a_stored_profile_of_another_model_is_refused_by_the_run(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    from safetensors.torch import save_file

    bad = tmp_path / "other.safetensors"
    save_file({"policy": torch.zeros(5, 1, dtype=torch.int8), "recovered": torch.ones(5, 1), "kept": torch.ones(5, 1)}, str(bad))
    evict = f"{{policy: fastgen, profile: {bad}}}"
    result = run_cli(["run", write_recipe(tmp_path, evict_recipe(tiny_model_dir, text_dir, evict)), "-o", tmp_path / "out"])
    assert result.exit_code == 2 and "this model has 2 layers x 2 KV heads" in result.output, result.output
    assert "Traceback" not in result.output


def test_plan_counts_the_evicted_cache_at_the_serving_context(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    from compress.eval.plan.planner import plan_recipe
    from compress.recipe import load_recipe
    from tests.test_devices import profile

    devices = {"test": profile(runtimes=["torch"], formats=["hf"])}
    path = write_recipe(tmp_path, evict_recipe(tiny_model_dir, text_dir, "{policy: h2o, budget: 48, window: 8}"))
    fit = {r["artifact"]: r for r in plan_recipe(load_recipe(path), devices, [], context=192)["fit"]}
    full = 2 * 2 * 2 * 24 * 2  # 2 layers, 2 KV heads, head_dim 24, float16
    assert fit["compressed"]["kv_bytes_per_token"] == 2 * full  # the float32 model's own cache
    assert fit["kv_cache"]["kv_bytes_per_token"] == full * 48 // 192  # 48 tokens a head, whatever the context
