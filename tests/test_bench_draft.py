"""`compress bench draft` on tiny models: a cut of a GGUF target is its first blocks copied byte for byte
and computes what those blocks compute; a draft equal to the target is always accepted; greedy
speculative output is the target's own with a draft that disagrees; the CLI writes its files and
refuses bad input with exit 2, naming the option."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from compress.eval.bench.draft import cut_gguf
from compress.eval.speculative import TorchDecoder, speculative, target_alone
from compress.export.gguf import runtime as gguf_runtime
from compress.export.gguf.writer import write_gguf
from tests.helpers import run_cli
from tests.test_gguf import needs_llama_cpp
from tests.tiny import scale_weights, tiny_model, train_tokenizer

BLOCKS = 3  # the tiny target's decoder blocks


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def target_model(tokenizer):
    """A random 3-block Llama with sharpened attention (what each block adds shows in the logits)."""
    return scale_weights(tiny_model("llama", vocab=len(tokenizer), layers=BLOCKS, seed=3), {"q_proj.weight": 6, "k_proj.weight": 6})


@pytest.fixture(scope="module")
def target_gguf(tmp_path_factory: pytest.TempPathFactory, target_model, tokenizer) -> Path:
    path = tmp_path_factory.mktemp("draft") / "target.gguf"
    write_gguf(path, target_model, tokenizer, {}, "f32")
    return path


def first_blocks(model, blocks: int):
    """A copy of ``model`` with only its first ``blocks`` decoder blocks (the final norm and head kept)."""
    cut = copy.deepcopy(model)
    cut.model.layers = cut.model.layers[:blocks]
    cut.config.num_hidden_layers = blocks
    return cut


def fields(reader: gguf.GGUFReader) -> dict[str, object]:
    return {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}


def test_cut_copies_the_first_blocks_byte_for_byte(tmp_path: Path, target_gguf: Path) -> None:
    cut = cut_gguf(target_gguf, tmp_path / "cut.gguf", 2)
    source, made = gguf.GGUFReader(target_gguf), gguf.GGUFReader(cut)
    kept = {t.name: t for t in source.tensors if not t.name.startswith("blk.2.")}
    assert [t.name for t in made.tensors] == list(kept)
    for t in made.tensors:
        assert t.tensor_type == kept[t.name].tensor_type and bytes(t.data) == bytes(kept[t.name].data), t.name
    want = fields(source)
    want["llama.block_count"] = 2
    assert fields(made) == want  # the tokenizer and every other key as they were
    assert not list(tmp_path.glob(".*partial"))


@needs_llama_cpp
def test_cut_computes_the_first_blocks_in_llama_cpp(tmp_path: Path, target_gguf: Path, target_model) -> None:
    """The cut file in llama.cpp gives the logits of the target's first 2 blocks (then its final norm and
    head) computed in transformers, and differs from the whole target's."""
    cut = cut_gguf(target_gguf, tmp_path / "cut.gguf", 2)
    ids = [5, 17, 42, 99, 7, 63, 120, 11]
    runtime = gguf_runtime.LlamaCppModel(cut, n_ctx=64, threads=1)
    try:
        got = runtime.decode(ids, 0, every_position=True).copy()
    finally:
        runtime.close()
    with torch.no_grad():
        want = first_blocks(target_model, 2)(torch.tensor([ids])).logits[0].numpy()
        whole = target_model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(got - want).max() < 1e-3
    assert np.abs(whole - want).max() > 0.1  # the third block changes the logits: the comparison can tell


def decoders(runtime: str, target_gguf: Path, target_model, draft_blocks: int, tmp_path: Path):
    """(target, draft) on ``runtime``: the draft is the target's first ``draft_blocks`` blocks (all: the target)."""
    if runtime == "torch":
        draft = target_model if draft_blocks == BLOCKS else first_blocks(target_model, draft_blocks)
        return TorchDecoder(target_model), TorchDecoder(draft)
    if not gguf_runtime.available():
        pytest.skip("llama-cpp-python is not installed (pip install 'compress[gguf]')")
    draft_path = target_gguf if draft_blocks == BLOCKS else cut_gguf(target_gguf, tmp_path / "cut.gguf", draft_blocks)
    return gguf_runtime.LlamaCppModel(target_gguf, n_ctx=128, threads=1), gguf_runtime.LlamaCppModel(draft_path, n_ctx=128, threads=1)


PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79], [27, 18, 28, 18, 28, 45, 90, 45]]


@pytest.mark.parametrize("runtime", ["torch", pytest.param("llama.cpp", marks=pytest.mark.runtime)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_draft_equal_to_the_target_is_always_accepted(
    tmp_path: Path, target_gguf: Path, target_model, runtime: str, temperature: float
) -> None:
    """Every round keeps all k proposals (k + 1 tokens per target pass), except the last, which keeps
    what room is left; the output is the target's own (greedy) / a full-length sample."""
    target, draft = decoders(runtime, target_gguf, target_model, BLOCKS, tmp_path)
    k, max_new = 3, 18
    for i, prompt in enumerate(PROMPTS):
        gen = speculative(target, draft, prompt, max_new, k, temperature, seed=i)
        assert len(gen.tokens) == max_new
        assert gen.accepted[:-1] == [k] * (len(gen.accepted) - 1)
        assert sum(a + 1 for a in gen.accepted) == max_new  # the last round: the room left
        assert gen.kept == gen.reached
        if temperature == 0:
            assert gen.tokens == target_alone(target, prompt, max_new).tokens


@pytest.mark.parametrize("runtime", ["torch", pytest.param("llama.cpp", marks=pytest.mark.runtime)])
def test_greedy_output_is_the_targets_with_a_draft_that_disagrees(tmp_path: Path, target_gguf: Path, target_model, runtime: str) -> None:
    target, draft = decoders(runtime, target_gguf, target_model, 1, tmp_path)
    rejected = 0
    for prompt in PROMPTS:
        gen = speculative(target, draft, prompt, 24, 4)
        assert gen.tokens == target_alone(target, prompt, 24).tokens
        rejected += sum(r - k for r, k in zip(gen.reached, gen.kept, strict=True))
    assert rejected > 0  # the one-block draft does disagree: the check is not vacuous


def bench_args(out: Path, target: Path | str, text_dir: Path, *extra: str) -> list[str]:
    return [
        "bench", "draft", "-o", out, "--target", target, "--evaluation", text_dir, "--prompts", "2", "--prompt-tokens", "16",
        "--max-new", "8", "--repeats", "1", "--threads", "1", "--k", "2,3", *extra,
    ]  # fmt: skip


@needs_llama_cpp
def test_cli_measures_file_and_cut_drafts_in_llama_cpp(tmp_path: Path, target_gguf: Path, text_dir: Path) -> None:
    out = tmp_path / "out"
    result = run_cli(bench_args(out, target_gguf, text_dir, "--drafts", str(target_gguf), "--cut", "1", "--temperatures", "0,0.8"))
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "results.json").read_text())
    assert (out / "speedup-vs-draft.png").stat().st_size > 0
    assert "| cut 1 of 3 blocks |" in (out / "results.md").read_text()
    assert not list((out / "files").glob("*.gguf"))  # the cut is not kept without --keep-files
    assert saved["target"]["blocks"] == BLOCKS and set(saved["target"]["verify_cost"]) == {"2", "3"}
    assert saved["llama_cpp"]["llama.cpp"] and saved["settings"]["prompt_tokens"] == 16
    names = [d["name"] for d in saved["drafts"]]
    assert names == [str(target_gguf), "cut 1 of 3 blocks"]
    cut = saved["drafts"][1]
    assert cut["kind"] == "cut" and cut["blocks"] == 1 and cut["decode_tokens_per_s"] > 0
    assert 0 < cut["size_share"] < 1 and 0 < cut["parameter_share"] < 1
    rows = saved["rows"]
    assert len(rows) == 2 * 2 * 2  # drafts x k x temperatures
    for r in rows:
        if r["draft"] == str(target_gguf):
            assert r["acceptance_rate"] == 1.0 and all(a == 1.0 for a in r["acceptance_by_position"])
        if r["mode"] == "greedy":
            assert r["greedy_identical"] == 2 and r["first_differences"] == []
    for draft in names:
        for t in (0.0, 0.8):
            cell = [r for r in rows if r["draft"] == draft and r["temperature"] == t]
            best = [r for r in cell if r["best"]]
            assert len(best) == 1 and best[0]["speedup"]["mean"] == max(r["speedup"]["mean"] for r in cell)


def test_cli_measures_a_transformers_pair(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    out = tmp_path / "out"
    result = run_cli(bench_args(out, tiny_model_dir, text_dir, "--drafts", str(tiny_model_dir), "--temperatures", "0"))
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "results.json").read_text())
    assert saved["target"]["runtime"] == "transformers" and saved["drafts"][0]["size_share"] == 1.0
    assert [r["acceptance_rate"] for r in saved["rows"]] == [1.0, 1.0]
    assert [r["greedy_identical"] for r in saved["rows"]] == [2, 2]
    assert (out / "speedup-vs-draft.png").is_file()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--cut", "1", "--k", "0"), "--k '0'"),
        (("--cut", "1", "--k", "two"), "--k 'two'"),
        (("--cut", "0"), "--cut '0'"),
        (("--cut", "1", "--temperatures", "-1"), "--temperatures '-1'"),
        ((), "--drafts / --cut"),
        (("--drafts", "missing.gguf"), "--drafts missing.gguf: no such file"),
        (("--cut", "1,1"), "--cut '1,1'"),
    ],
)
def test_cli_refuses_bad_options(tmp_path: Path, target_gguf: Path, text_dir: Path, extra: tuple[str, ...], message: str) -> None:
    result = run_cli(bench_args(tmp_path / "out", target_gguf, text_dir, *extra))
    assert result.exit_code == 2 and message in result.output, result.output


def test_cli_refuses_a_missing_target_and_a_draft_on_another_runtime(
    tmp_path: Path, target_gguf: Path, tiny_model_dir: Path, text_dir: Path
) -> None:
    result = run_cli(bench_args(tmp_path / "a", tmp_path / "none.gguf", text_dir, "--cut", "1"))
    assert result.exit_code == 2 and "--target" in result.output and "no such file" in result.output, result.output
    result = run_cli(bench_args(tmp_path / "b", target_gguf, text_dir, "--drafts", str(tiny_model_dir)))
    assert result.exit_code == 2 and f"--drafts {tiny_model_dir}" in result.output, result.output
    result = run_cli(bench_args(tmp_path / "c", tiny_model_dir, text_dir, "--cut", "1"))
    assert result.exit_code == 2 and "--cut" in result.output and "GGUF target" in result.output, result.output
    result = run_cli(bench_args(tmp_path / "d", target_gguf, text_dir, "--drafts", f"{target_gguf},{target_gguf}"))
    assert result.exit_code == 2 and "--drafts" in result.output and "more than once" in result.output, result.output


@needs_llama_cpp
def test_cli_refuses_a_cut_of_every_block_and_a_draft_with_another_vocabulary(tmp_path: Path, target_gguf: Path, text_dir: Path) -> None:
    result = run_cli(bench_args(tmp_path / "a", target_gguf, text_dir, "--cut", "1,3"))
    assert result.exit_code == 2 and "--cut 3" in result.output, result.output
    texts = [p.read_text() for p in sorted(text_dir.glob("*.txt"))]
    other = train_tokenizer(texts, vocab=300)
    other_path = tmp_path / "other.gguf"
    write_gguf(other_path, tiny_model("llama", vocab=len(other)), other, {}, "f32")
    result = run_cli(bench_args(tmp_path / "b", target_gguf, text_dir, "--drafts", str(other_path)))
    assert result.exit_code == 2 and f"--drafts {other_path}" in result.output and "vocabulary" in result.output, result.output


def test_acceptance_needed_solves_the_cost_model() -> None:
    """The per-position acceptance a at which (1 - a^(k+1)) / (1 - a) tokens a round pay for a round's
    cost (verify + k x draft cost) times the goal; None when k + 1 tokens a round would not."""
    from compress.eval.bench.draft import acceptance_needed

    a = acceptance_needed(1.0, 0.0, 4, 1.5)  # free verification and a free draft: 1.5 tokens a round
    assert a is not None and abs(sum(a**i for i in range(5)) - 1.5) < 1e-3
    a = acceptance_needed(1.6, 0.1, 3, 1.5)
    assert a is not None and abs(sum(a**i for i in range(4)) - 1.5 * (1.6 + 0.3)) < 1e-3
    assert acceptance_needed(1.0, 0.0, 2, 1.0) == 0.0  # break-even with nothing accepted
    assert acceptance_needed(3.0, 0.1, 4, 1.5) is None  # 1.5 x 3.4 = 5.1 tokens a round: more than k + 1
