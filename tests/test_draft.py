"""Draft models for speculative decoding: the decoding loop (eval/speculative.py) on exact bigram models,
and the ``draft`` stage (distill/draft.py, compress/steps/draft.py) end to end on the trained tiny model,
in torch and in llama.cpp."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from compress.eval.speculative import speculative, summarize, sweep, target_alone
from tests.helpers import run_cli
from tests.test_pruning import prune_recipe


class Bigram:
    """A decoder whose logits at a position depend on that position's token only (a bigram table), with
    a cache it keeps as a token list: exact, and cheap enough for thousands of draws."""

    def __init__(self, table: np.ndarray) -> None:
        self.table = table
        self.n_vocab = table.shape[0]
        self.cache: list[int] = []
        self.calls = 0

    def decode(self, ids: list[int], n_past: int, every_position: bool) -> np.ndarray:
        assert n_past <= len(self.cache), (n_past, len(self.cache))
        self.cache = self.cache[:n_past] + list(ids)
        self.calls += 1
        rows = self.table[ids]
        return rows if every_position else rows[-1:]


def tables(vocab: int = 12, noise: float = 0.6, sharp: float = 2.0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    target = rng.normal(size=(vocab, vocab)) * sharp
    return target, target + rng.normal(size=(vocab, vocab)) * noise


def test_a_draft_equal_to_the_target_is_always_accepted() -> None:
    target, _ = tables()
    for k in (1, 3, 5):
        gen = speculative(Bigram(target), Bigram(target.copy()), [1, 2, 3], 23, k)
        assert gen.tokens == target_alone(Bigram(target), [1, 2, 3], 23).tokens
        assert gen.kept == gen.reached and sum(gen.accepted) == 23 - len(gen.accepted)  # a round adds its k plus one
        assert all(a == k for a in gen.accepted[:-1])  # every full round keeps all k


def test_greedy_output_with_any_draft_is_the_targets_own() -> None:
    target, draft = tables(noise=2.0)
    for k in (1, 2, 4, 8):
        for prompt in ([0], [3, 1, 4], [5, 9, 2, 6]):
            t = Bigram(target)
            gen = speculative(t, Bigram(draft), prompt, 30, k)
            assert gen.tokens == target_alone(Bigram(target), prompt, 30).tokens
            assert len(gen.accepted) == t.calls - (len(prompt) > 1)  # one target call a round, after the prompt's
            assert 0 < sum(gen.kept) < sum(gen.reached)  # a noisy draft is right sometimes, not always


def test_speculative_sampling_draws_from_the_targets_distribution() -> None:
    """The first token drawn with the draft follows the target's softmax at the temperature (total
    variation < 0.03 over 6,000 draws; the draft's own distribution is 0.2 away)."""
    target, draft = tables(vocab=8, noise=1.5)
    temperature = 0.8
    want = np.exp(target[4] / temperature)
    want /= want.sum()
    q = np.exp(draft[4] / temperature)
    q /= q.sum()
    assert 0.5 * np.abs(q - want).sum() > 0.2
    for k in (1, 3):
        counts = np.zeros(8)
        for seed in range(6000):
            counts[speculative(Bigram(target), Bigram(draft), [4], 2, k, temperature, seed=seed).tokens[0]] += 1
        assert 0.5 * np.abs(counts / counts.sum() - want).sum() < 0.03, (k, counts / counts.sum(), want)


def test_summary_counts_acceptance_by_position_and_the_speedup() -> None:
    target, draft = tables(noise=1.0)
    prompts = [[1], [2, 3], [4, 5, 6]]
    rows = sweep(Bigram(target), {"noisy": Bigram(draft), "same": Bigram(target.copy())}, prompts, [2, 4], 16, [0.0, 1.0])
    assert [(r["draft"], r["k"], r["mode"]) for r in rows][:4] == [
        ("noisy", 2, "greedy"),
        ("noisy", 4, "greedy"),
        ("same", 2, "greedy"),
        ("same", 4, "greedy"),
    ]
    same = next(r for r in rows if r["draft"] == "same" and r["k"] == 4 and r["mode"] == "greedy")
    assert same["acceptance_rate"] == 1.0 and same["greedy_identical"] == 3 and same["first_differences"] == []
    assert same["tokens_per_pass"]["mean"] > 3.5  # 16 tokens in rounds of 5 (the last shorter)
    noisy = next(r for r in rows if r["draft"] == "noisy" and r["k"] == 4 and r["mode"] == "greedy")
    positions = noisy["acceptance_by_position"]
    assert len(positions) == 4 and all(p is None or 0 <= p <= 1 for p in positions)
    assert noisy["greedy_identical"] == 3 and noisy["speedup"]["samples"] == 3 and noisy["speedup"]["lower"] <= noisy["speedup"]["upper"]
    assert "greedy_identical" not in next(r for r in rows if r["mode"] == "sampled")
    with pytest.raises(Exception, match="k: the draft proposes at least one token"):
        speculative(Bigram(target), Bigram(draft), [1], 4, 0)
    with pytest.raises(Exception, match="vocabulary"):
        speculative(Bigram(target), Bigram(np.zeros((5, 5))), [1], 4, 2)
    assert (
        summarize([target_alone(Bigram(target), [1], 4)], [speculative(Bigram(target), Bigram(draft), [1], 4, 2)], 2, True)["prompts"] == 1
    )


# --------------------------------------------------------------------------- the stage, end to end


def draft_recipe(model: Path, texts: Path, draft: str, exports: str = "[]", gates: str = "[]", extra_stage: str = "") -> str:
    """The prune tests' recipe (8 x 64 calibration, 4 x 64 evaluation) with an RTN W4 target and a draft stage."""
    return prune_recipe(
        model, texts, f"  - quantize: {{method: rtn, bits: 4, group_size: 32}}\n{extra_stage}  - draft:\n{draft}", exports, gates
    )


DRAFT = """\
      prune: {layers: {size: 2}, multiple_of: 8}
      max_share: 0.6
      evaluate: {prompts: 3, prompt_tokens: 16, max_new: 20, k: [2, 4], temperatures: [0]}
"""
TRAINED = DRAFT + "      distill: {steps: 20, batch_size: 2, seq_len: 64, lr: 3.0e-3, warmup_steps: 2, eval: {every: 10, samples: 2}}\n"


def run(recipe: Path, out: Path):
    from compress.pipeline import run_recipe
    from compress.progress import Reporter
    from compress.recipe import load_recipe

    return run_recipe(load_recipe(recipe), out, reporter=Reporter(quiet=True))


def draft_evaluations(result) -> dict[str, dict]:
    return {e.artifact: e for e in result.evaluations if e.kind == "draft"}


def test_a_draft_stage_writes_a_distilled_quantized_draft_beside_the_target_and_measures_it_in_llama_cpp(
    trained_tiny_dir: Path, text_dir: Path, tmp_path: Path
) -> None:
    import gguf

    from compress.export.gguf import runtime as gguf_runtime

    if not gguf_runtime.available():
        pytest.skip("llama-cpp-python is not installed (pip install 'compress[gguf]')")
    recipe = tmp_path / "r.yaml"
    quantized = TRAINED + "      quantize: {method: rtn, bits: 8, group_size: 32}\n"
    gates = "[{artifact: draft, metric: draft_greedy_identical, min: 1.0}, {artifact: draft-gguf, metric: draft_acceptance, min: 0.5}]"
    recipe.write_text(draft_recipe(trained_tiny_dir, text_dir, quantized, "[{format: gguf, type: q4_0, name: gguf}]", gates))
    result = run(recipe, tmp_path / "out")
    out = tmp_path / "out"
    entry = result.manifest["draft"]
    assert entry["shape"]["num_hidden_layers"] == 2 and entry["target_shape"]["num_hidden_layers"] == 4
    assert entry["tokenizer_files_identical"] and entry["quantized_layers"] == 14 and entry["llama_cpp_file"]["records_exact"] == 14
    assert (out / "draft/model/model.safetensors").is_file() and (out / "draft/draft.gguf").is_file()
    manifest_files = json.loads((out / "manifest.json").read_text())["files"]
    assert "draft/draft.gguf" in manifest_files and "draft/model/tokenizer.json" in manifest_files  # checksummed like every file
    reader = gguf.GGUFReader(out / "draft/draft.gguf")
    assert int(reader.fields["llama.block_count"].parts[-1][0]) == 2
    stage = result.manifest["stages"][1]
    assert stage["kind"] == "draft" and stage["method"] == "prune+distill+quantize"
    distilled = stage["summary"]["steps"]["distill"]["summary"]
    assert distilled["after"]["kl_divergence"] < distilled["before"]["kl_divergence"]
    found = draft_evaluations(result)
    assert set(found) == {"draft", "draft-gguf"} and found["draft-gguf"].runtime == "llama.cpp"
    for e in found.values():
        assert e.metrics["draft_greedy_identical"] == 1.0  # greedy with the draft is the target's own output
        assert e.metrics["best_k"] in (2, 4) and len(e.details["cells"]) == 2
        assert e.intervals["speculative_speedup"]["samples"] == 3
    assert found["draft-gguf"].metrics["draft_acceptance"] > 0.5 and result.passed
    summary = (out / "summary.md").read_text()
    assert "### Speculative decoding" in summary and "draft-gguf" in summary
    # `compress plan` sizes the draft's GGUF from the config alone, within 10% of the file written
    assert run_cli(["plan", recipe, "--json", tmp_path / "plan.json"]).exit_code == 0
    [planned] = [a for a in json.loads((tmp_path / "plan.json").read_text())["artifacts"] if a["artifact"] == "draft"]
    assert abs(planned["size_bytes"] / entry["llama_cpp_file"]["bytes"] - 1) < 0.1, (planned, entry["llama_cpp_file"])
    # the target's records are the recipe's quantize stage's alone: the draft's stay in the draft
    assert {layer["stage"] for layer in result.manifest["quantization"]["layers"].values()} == {"stages[0]"}


def test_distillation_makes_the_draft_agree_with_the_target_more_often(trained_tiny_dir: Path, text_dir: Path, tmp_path: Path) -> None:
    """The same pruned draft, untrained and distilled from the quantized target: more tokens accepted a
    pass in torch, and greedy output unchanged for both."""
    accepted = {}
    for name, draft in (("pruned", DRAFT), ("distilled", TRAINED)):
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text(draft_recipe(trained_tiny_dir, text_dir, draft.replace("k: [2, 4]", "k: [3]") + "      gguf: false\n"))
        result = run(recipe, tmp_path / name)
        e = draft_evaluations(result)["draft"]
        assert e.metrics["draft_greedy_identical"] == 1.0 and not (tmp_path / name / "draft/draft.gguf").exists()
        [assisted] = e.details["transformers_generate"]  # transformers' own generate(assistant_model=) on the same prompts
        assert assisted["k"] == 3 and assisted["greedy_identical"] == assisted["prompts"] == 3
        accepted[name] = np.mean([c["accepted_per_pass"]["mean"] for c in e.details["cells"]])
    assert accepted["distilled"] > accepted["pruned"] + 0.3, accepted


@pytest.mark.parametrize(
    ("draft", "extra_stage", "gates", "message"),
    [
        (DRAFT.replace("k: [2, 4]", "k: [0]"), "", "[]", "k: each is the number of draft tokens"),
        (DRAFT.replace("temperatures: [0]", "temperatures: [-1]"), "", "[]", "temperatures"),
        (DRAFT.replace("max_share: 0.6", "max_share: 1.5"), "", "[]", "max_share"),
        (
            DRAFT.replace("prompt_tokens: 16", "prompt_tokens: 4"),
            "",
            "[]",
            "evaluate: .*prompt_tokens \\(4\\) must be longer than the largest k \\+ 1 \\(5\\)",
        ),
        (
            DRAFT.replace("prompt_tokens: 16", "prompt_tokens: 100"),
            "",
            "[]",
            "prompt_tokens \\(100\\) is longer than data.evaluation.seq_len",
        ),
        (DRAFT + "      quantize: {method: awq, bits: 4}\n", "", "[]", "draft.quantize: Input tag 'awq' .* expected tags: 'rtn', 'gptq'"),
        (DRAFT + "      quantize: {bits: 4}\n", "", "[]", "draft.quantize: Unable to extract tag using discriminator 'method'"),
        (DRAFT, "", "[{artifact: compressed, metric: draft_acceptance, min: 1}]", "draft_acceptance is measured on a draft stage's pair"),
        (DRAFT, "", "[{artifact: draft, metric: speculative_speedup, max_decrease: 0.1}]", "use max or min"),
        (DRAFT, "", "[{artifact: draft-gguf, metric: draft_acceptance, min: 1}]", "draft-gguf' is not an artifact"),
    ],
)
def test_bad_draft_recipes_exit_2_naming_the_key(
    trained_tiny_dir: Path, text_dir: Path, tmp_path: Path, draft: str, extra_stage: str, gates: str, message: str
) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(draft_recipe(trained_tiny_dir, text_dir, draft, gates=gates, extra_stage=extra_stage))
    result = run_cli(["validate", recipe])
    assert result.exit_code == 2, result.output
    assert __import__("re").search(message, result.output), result.output


def test_a_draft_that_is_not_the_last_stage_or_too_large_is_refused(trained_tiny_dir: Path, text_dir: Path, tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    text = draft_recipe(trained_tiny_dir, text_dir, DRAFT).replace("exports: []", "  - quantize: {method: rtn, bits: 8}\nexports: []")
    recipe.write_text(text.replace("  - quantize: {method: rtn, bits: 4, group_size: 32}\n", ""))
    result = run_cli(["validate", recipe])
    assert result.exit_code == 2 and "must be the last stage" in result.output, result.output
    recipe.write_text(draft_recipe(trained_tiny_dir, text_dir, DRAFT.replace("size: 2", "size: 4")))
    result = run_cli(["run", recipe, "-o", tmp_path / "out"])
    assert result.exit_code == 2, result.output
    assert "stages[1].max_share allows 60%" in result.output and not (tmp_path / "out").exists()
