"""GGUF export: exact Q4_0 / Q4_1 / Q8_0 blocks from records, read back with gguf's own
dequantizer and loaded by transformers (``gguf_file=``); tokenizer metadata; clear refusals;
and, where llama-cpp-python is installed, the file run in llama.cpp (round trip, tokenizer
parity, llama.cpp's own quantizer, the pipeline's verifier).
"""

from __future__ import annotations

import copy
import json
import string
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import quants
from transformers import AutoModelForCausalLM, AutoTokenizer

from compress.errors import FormatError
from compress.export.gguf import runtime as gguf_runtime
from compress.export.gguf.check import check_gguf_records
from compress.export.gguf.config import GGUFExportConfig
from compress.export.gguf.layout import ARCHITECTURES, GGUFArch, architecture_of, permute_rows, plan_tensors, resolve_type
from compress.export.gguf.metadata import pre_tokenizer_name
from compress.export.gguf.plugin import GGUF_FILE
from compress.export.gguf.writer import write_gguf
from compress.export.parity import compare_tokenizers, parity_corpus, tokenization_mismatches
from compress.paths import usable_cpus
from tests.helpers import recipe_text, run_cli, write_recipe
from tests.test_formats import quantize, token_ids
from tests.tiny import perturb_norms, scale_weights, tiny_llama, tiny_model


def needs_llama_cpp(test):
    """A test that runs llama.cpp: marked runtime, skipped where llama-cpp-python is not installed."""
    skip = pytest.mark.skipif(not gguf_runtime.available(), reason="llama-cpp-python is not installed (pip install 'compress[gguf]')")
    return pytest.mark.runtime(skip(test))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def stored(path: Path) -> dict[str, object]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def field(path: Path, key: str):
    return gguf.GGUFReader(path).fields[key].contents()


# --------------------------------------------------------------------------- exact blocks


def m_rounding(record) -> float:
    """Bound on rounding m = -z·s to fp16 (half an ulp: 2^-11 relative; doubled for slack)."""
    return float((record.zero_point.float() * record.scale.float()).abs().max()) * 2**-10


EXACT_CASES = [
    ("q4_0", 4, 32, True, 128),
    ("q4_0", 4, 128, True, 160),  # a partial last group of 32
    ("q4_1", 4, 64, False, 128),
    ("q4_1", 4, 128, True, 128),  # symmetric records fit Q4_1 too (m = -8 s)
    ("q8_0", 8, 32, True, 128),
    ("q8_0", 3, 64, False, 128),  # |q - z| <= 7 fits int8
]


@pytest.mark.parametrize(("type_name", "bits", "group", "symmetric", "hidden"), EXACT_CASES)
def test_records_become_blocks_bit_exactly(tmp_path: Path, tokenizer, type_name, bits, group, symmetric, hidden) -> None:
    model = tiny_llama(len(tokenizer), hidden=hidden, intermediate=2 * hidden)
    records = quantize(model, bits, group, symmetric)
    path = tmp_path / "m.gguf"
    facts = write_gguf(path, model, tokenizer, records, type_name, float_type="f32")
    assert check_gguf_records(path, facts["plan"], records) == []
    assert facts["tensor_types"][f"{type_name} (record)"] == len(records) == 14
    tensors = stored(path)
    heads = {"q_proj": 4, "k_proj": 2}
    for name, record in records.items():
        t = tensors[facts["plan"].tensors[[p.hf_name for p in facts["plan"].tensors].index(name + ".weight")].gguf_name]
        assert t.tensor_type == gguf.GGMLQuantizationType[type_name.upper()]
        got = torch.from_numpy(quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(record.shape).copy())
        want = record.dequantize()
        kind = name.rsplit(".", 1)[1]
        if kind in heads:  # llama.cpp's rotary row order; undo it to compare with the record
            inverse = torch.argsort(permute_rows(torch.arange(record.shape[0]), heads[kind]))
            got = got[inverse]
        if type_name == "q4_1" and not symmetric:  # m = fp16(-z s): the one rounding Q4_1 adds
            assert (got - want).abs().max() <= m_rounding(record)
        else:
            assert torch.equal(got, want), name


@pytest.mark.parametrize(
    ("float_type", "hidden", "stored_as"),
    [("q4_k", 256, "q4_k"), ("q3_k", 256, "q3_k"), ("q4_k", 96, "q5_0"), ("q2_k", 96, "q4_0"), ("q5_1", 96, "q5_1"), ("q6_k", 96, "q8_0")],
)
def test_float_type_takes_any_block_type_with_its_fallback(tmp_path: Path, tokenizer, float_type: str, hidden: int, stored_as: str) -> None:
    """Matrices without a record (here the untied embedding and head) in any block type llama.cpp stores an
    embedding in: rounded on its grid with the quantizers' search (Q8_0: llama.cpp's reference rounding;
    a row a K-quant does not divide: its fallback), read back by gguf-py as those values."""
    from compress.quantizers.grid_search import grid_quantize
    from compress.schema.quantize import QuantScheme

    assert GGUFExportConfig(type="q4_0", float_type=float_type.upper()).float_type == float_type
    model = tiny_llama(len(tokenizer), hidden=hidden, intermediate=2 * hidden, tie=False)
    records = quantize(model, 4, 32, True)
    path = tmp_path / "m.gguf"
    write_gguf(path, model, tokenizer, records, "q4_0", float_type=float_type)
    tensors = stored(path)
    for gguf_name, weight in (("token_embd.weight", model.get_input_embeddings().weight), ("output.weight", model.lm_head.weight)):
        t = tensors[gguf_name]
        assert t.tensor_type == gguf.GGMLQuantizationType[stored_as.upper()]
        got = torch.from_numpy(quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(weight.shape).copy())
        if stored_as == "q8_0":  # llama.cpp's reference rounding, as before block types were allowed here
            want = torch.from_numpy(quants.dequantize(quants.quantize(weight.detach().numpy(), t.tensor_type), t.tensor_type))
        else:
            want = grid_quantize(weight.detach(), QuantScheme(gguf_type=stored_as)).dequantize()
        assert torch.equal(got, want.reshape(weight.shape))


def test_float_type_outside_the_block_types_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"float_type[\s\S]*'q4_k'"):
        GGUFExportConfig(type="q4_0", float_type="iq2_xxs")


@pytest.mark.parametrize(("type_name", "symmetric"), [("q4_0", True), ("q4_1", False)])
def test_transformers_loads_our_gguf_with_the_same_weights_and_logits(tmp_path: Path, tokenizer, type_name, symmetric) -> None:
    model = tiny_llama(len(tokenizer))
    records = quantize(model, 4, 32, symmetric)
    write_gguf(tmp_path / "m.gguf", model, tokenizer, records, type_name, float_type="f32")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    theirs = dict(loaded.named_modules())
    for name, record in records.items():
        tol = 0.0 if symmetric else m_rounding(record)
        assert (theirs[name].weight - record.dequantize()).abs().max().item() <= tol, name
    ids = token_ids(len(tokenizer))
    with torch.no_grad():
        assert (loaded(ids).logits - model(ids).logits).abs().max().item() <= (1e-5 if symmetric else 1e-3)


# Qwen3: head_dim 128 as in the real models (transformers' GGUF reader ignores attention.key_length for qwen3 and assumes 128).
ARCH_EXTRA = {"llama": {}, "mistral": {"sliding_window": None}, "qwen2": {}, "qwen3": {"head_dim": 128}}


@pytest.mark.runtime
@pytest.mark.parametrize("model_type", list(ARCH_EXTRA))
def test_every_architecture_round_trips_through_transformers_and_llama_cpp(tmp_path: Path, tokenizer, model_type: str) -> None:
    """A tiny model of each supported architecture (Qwen2: q/k/v biases; Qwen3: q/k norms; llama and
    mistral: permuted Q/K rows) as exact Q4_0: transformers reads back the same weights and logits,
    and llama.cpp (when installed) computes the same function up to its 8-bit activations."""
    model = tiny_model(model_type, vocab=len(tokenizer), hidden=128, intermediate=256, positions=256, **ARCH_EXTRA[model_type])
    # sharpen the random attention so that a wrong row order or a missing bias/norm would show
    scale_weights(model, {"q_proj.weight": 8, "k_proj.weight": 8, "v_proj.weight": 4, "o_proj.weight": 4})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):  # Qwen2's q/k/v biases start at zero
                p.normal_(0, 0.5)
    records = quantize(model, 4, 32, True)
    facts = write_gguf(tmp_path / "m.gguf", model, tokenizer, records, "q4_0", float_type="f32")
    assert facts["architecture"] == ("llama" if model_type == "mistral" else model_type)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    ids = token_ids(len(tokenizer))
    with torch.no_grad():
        assert (loaded(ids).logits - model(ids).logits).abs().max().item() <= 1e-4
    if gguf_runtime.available():
        from compress.eval.metrics import compare, torch_forward

        runtime = gguf_runtime.LlamaCppModel(tmp_path / "m.gguf", n_ctx=64, threads=usable_cpus())
        try:
            same = compare(torch_forward(model, torch.device("cpu")), {"gguf": runtime.forward}, ids, 8)["gguf"]
        finally:
            runtime.close()
        assert same["kl_divergence"] < 1e-3 and same["top1_agreement"] > 0.85, same


# Gemma 3 with three blocks of mixed layer types (llama.cpp's default pattern would make all three
# sliding) and linear rope scaling on its full-attention layers only: each is a key the export writes.
GEMMA_EXTRA = {
    "gemma2": {},
    "gemma3_text": {
        "layers": 3,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    },
}


@needs_llama_cpp
@pytest.mark.parametrize("model_type", list(GEMMA_EXTRA))
def test_gemma2_and_gemma3_run_in_llama_cpp_as_our_model(tmp_path: Path, tokenizer, model_type: str) -> None:
    """A tiny Gemma 2 / Gemma 3 (norms perturbed, attention sharpened) as exact Q4_0: llama.cpp computes
    our model's function over 64 positions, four times the sliding window of 16. The bound (KL 1e-3)
    lies between the right file's KL (4e-5 / 2e-5) and each mistake it catches: a missing norm offset
    (0.035), every layer sliding (0.010), the sliding layers' rope base left at the full layers' (0.006).
    (transformers' GGUF reader is not a check here: it rebuilds query_pre_attn_scalar as its default 256, which the file does not hold.)"""
    from compress.eval.metrics import compare, torch_forward

    model = tiny_model(model_type, vocab=len(tokenizer), hidden=128, intermediate=256, positions=256, **GEMMA_EXTRA[model_type])
    scale_weights(model, {"q_proj.weight": 8, "k_proj.weight": 8, "v_proj.weight": 4, "o_proj.weight": 4})
    perturb_norms(model, 0.3)
    records = quantize(model, 4, 32, True)
    path = tmp_path / "m.gguf"
    facts = write_gguf(path, model, tokenizer, records, "q4_0", float_type="f32")
    arch = facts["architecture"]
    assert arch == model_type.removesuffix("_text") and facts["tensor_types"]["q4_0 (record)"] == len(records)
    sliding = [t == "sliding_attention" for t in model.config.layer_types]
    assert field(path, f"{arch}.attention.sliding_window") == 16 and field(path, f"{arch}.attention.sliding_window_pattern") == sliding
    norm = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_norm.weight")
    assert np.allclose(np.asarray(norm.data), model.model.layers[0].input_layernorm.weight.detach().numpy() + 1.0)
    if model_type == "gemma2":
        assert field(path, "gemma2.attn_logit_softcapping") == 50.0 and field(path, "gemma2.final_logit_softcapping") == 30.0
    else:
        assert field(path, "gemma3.rope.freq_base") == 1e6 and field(path, "gemma3.rope.freq_base_swa") == 1e4
        assert field(path, "gemma3.rope.scaling.factor") == 4.0
    ids = torch.randint(0, len(tokenizer), (2, 64), generator=torch.Generator().manual_seed(0))
    runtime = gguf_runtime.LlamaCppModel(path, n_ctx=64, threads=usable_cpus())
    try:
        same = compare(torch_forward(model, torch.device("cpu")), {"gguf": runtime.forward}, ids, 8)["gguf"]
    finally:
        runtime.close()
    assert same["kl_divergence"] < 1e-3, same


@pytest.mark.parametrize(
    ("model_type", "config", "message"),
    [
        ("gemma2", {"query_pre_attn_scalar": 32}, "query_pre_attn_scalar is 32, but llama.cpp's gemma2 scales queries by 1/sqrt\\(16\\)"),
        ("gemma2", {"attn_logit_softcapping": None}, "attn_logit_softcapping is None: llama.cpp's gemma2 always soft-caps"),
        ("gemma2", {"tie_word_embeddings": False}, "tie_word_embeddings is false"),
        ("gemma3_text", {"attn_logit_softcapping": 50.0}, "llama.cpp's gemma3 does not cap attention logits"),
    ],
)
def test_gemma_configs_llama_cpp_would_compute_differently_are_refused(
    tmp_path: Path, tokenizer, model_type: str, config: dict, message: str
) -> None:
    model = tiny_model(model_type, vocab=len(tokenizer), hidden=64, intermediate=64, layers=2)
    for key, value in config.items():
        setattr(model.config, key, value)
    with pytest.raises(FormatError, match=message):
        write_gguf(tmp_path / "m.gguf", model, tokenizer, {}, "f16")
    assert not (tmp_path / "m.gguf").exists()


@needs_llama_cpp
@pytest.mark.parametrize(("family", "model_type"), [("llama3", "llama"), ("qwen2", "qwen2"), ("qwen2", "qwen3"), ("gemma", "gemma3_text")])
def test_each_familys_tokenizer_has_parity_in_llama_cpp(tmp_path: Path, text_dir: Path, family: str, model_type: str) -> None:
    """Each architecture family with a tokenizer built as its real one is (tests/tiny.py family_tokenizer),
    through the export's own check: 200 KB of mixed text and the chat template's specials tokenize the
    same in llama.cpp as in transformers, and llama.cpp's BOS / EOS / end-of-turn are the source's (the
    turn end read from the chat template; Gemma's <end_of_turn> is not its EOS)."""
    from compress.export.gguf.export import check_tokenizer
    from compress.export.parity import special_ids
    from tests.tiny import family_tokenizer

    hf = family_tokenizer(family, [p.read_text() for p in sorted(text_dir.glob("*.txt"))])
    model = tiny_model(model_type, vocab=len(hf), hidden=64, intermediate=64)
    path = tmp_path / "m.gguf"
    facts = write_gguf(path, model, hf, {}, "f16")
    turn_end = {"llama3": "<|eot_id|>", "qwen2": "<|im_end|>", "gemma": "<end_of_turn>"}[family]
    assert special_ids(hf)["eot"] == hf.convert_tokens_to_ids(turn_end) == facts["tokenizer"]["special_ids"]["eot"]
    assert facts["tokenizer"]["model"] == ("llama" if family == "gemma" else "gpt2")
    if family != "gemma":
        assert facts["tokenizer"]["pre"] == {"llama3": "llama-bpe", "qwen2": "qwen2"}[family]
    texts = [*parity_corpus(hf), hf.apply_chat_template([{"role": "user", "content": "Hi  there 🙂"}], tokenize=False)]
    parity = check_tokenizer(path, hf, texts, None, "m")
    assert parity["tokenizer_parity_bytes"] >= 200_000 and parity["tokenizer_special_ids"] == special_ids(hf)


@needs_llama_cpp
def test_pipeline_exports_a_gemma3_gguf_verified_in_llama_cpp(tmp_path: Path, text_dir: Path) -> None:
    """`compress run` on a Gemma 3 source (Gemma-style tokenizer, chat template): GPTQ W4 g32 records
    become Q4_0 blocks, and the export's own verification passes: tokenizer parity and special ids
    against the source's tokenizer, and llama.cpp's same-weights KL against our model."""
    from tests.tiny import tiny_source_dir

    source = tiny_source_dir(
        tmp_path / "gemma3", [p.read_text() for p in sorted(text_dir.glob("*.txt"))], "gemma3_text", "gemma", hidden=64
    )
    text = recipe_text(source, text_dir, bits=4, group_size=32, seq_len=48).replace("method: rtn", "method: gptq")
    text = text.replace("exports: []\n", "exports:\n  - name: q4\n    format: gguf\n    type: q4_0\n")
    out = tmp_path / "out"
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", out])
    assert result.exit_code == 0, result.output
    details = next(e for e in json.loads((out / "report.json").read_text())["evaluations"] if e["artifact"] == "q4")["details"]
    assert details["tokenizer_parity_bytes"] >= 200_000 and details["tokenizer_special_ids"] == {"bos": 2, "eos": 1, "eot": 6}
    assert details["same_weights_kl"] < 1e-3, details
    assert field(out / "exports" / "q4" / GGUF_FILE, "general.architecture") == "gemma3"


@pytest.mark.parametrize(("type_name", "atol"), [("f32", 1e-5), ("f16", 2e-2), ("bf16", 2e-1)])
def test_float_types_load_in_transformers(tmp_path: Path, tokenizer, type_name: str, atol: float) -> None:
    model = tiny_llama(len(tokenizer))
    facts = write_gguf(tmp_path / "m.gguf", model, tokenizer, {}, type_name)
    # 14 Linears + the embedding in the type; the 5 norms stay f32
    assert facts["tensor_types"][f"{type_name} (float)"] == (20 if type_name == "f32" else 15)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    ids = token_ids(len(tokenizer))
    with torch.no_grad():
        assert (loaded(ids).logits - model(ids).logits).abs().max().item() <= atol


def test_hyperparameters_and_tokenizer_metadata(tmp_path: Path, tokenizer) -> None:
    model = tiny_llama(len(tokenizer))
    path = tmp_path / "m.gguf"
    facts = write_gguf(path, model, tokenizer, {}, "f16")
    assert field(path, "general.architecture") == "llama"
    assert field(path, "llama.attention.head_count") == 4 and field(path, "llama.attention.head_count_kv") == 2
    assert field(path, "llama.embedding_length") == 128 and field(path, "llama.block_count") == 2
    assert field(path, "llama.context_length") == 256 and field(path, "llama.rope.dimension_count") == 32
    assert field(path, "tokenizer.ggml.model") == "gpt2" and field(path, "tokenizer.ggml.pre") == "gpt-2"
    tokens = field(path, "tokenizer.ggml.tokens")
    assert tokens == [tokenizer.convert_ids_to_tokens(i) for i in range(len(tokenizer))]
    types = field(path, "tokenizer.ggml.token_type")
    assert types[0] == gguf.TokenType.CONTROL and set(types[1:]) == {gguf.TokenType.NORMAL}
    assert len(field(path, "tokenizer.ggml.merges")) == facts["tokenizer"]["merges"] > 0
    assert field(path, "tokenizer.ggml.eos_token_id") == tokenizer.eos_token_id
    assert "output.weight" not in stored(path)  # tied: llama.cpp reuses token_embd
    untied = tiny_llama(len(tokenizer), tie=False)
    write_gguf(tmp_path / "u.gguf", untied, tokenizer, {}, "f16")
    assert "output.weight" in stored(tmp_path / "u.gguf")


@needs_llama_cpp
def test_sentencepiece_style_tokenizer_parity_in_llama_cpp(tmp_path: Path, text_dir: Path) -> None:
    """A Llama-2-style tokenizer (byte-fallback BPE on "▁"-joined text, byte tokens <0xNN>) is
    written as llama.cpp's `llama` (SentencePiece) vocabulary and tokenizes the same in llama.cpp."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tok.train_from_iterator(
        [p.read_text() for p in sorted(text_dir.glob("*.txt"))], trainers.BpeTrainer(vocab_size=700, special_tokens=specials)
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    model = tiny_llama(len(hf))
    path = tmp_path / "spm.gguf"
    facts = write_gguf(path, model, hf, {}, "f16")
    assert facts["tokenizer"]["model"] == "llama" and field(path, "tokenizer.ggml.add_space_prefix") is True
    types = field(path, "tokenizer.ggml.token_type")
    assert types[3] == gguf.TokenType.BYTE and types[1] == gguf.TokenType.CONTROL
    runtime = gguf_runtime.LlamaCppModel(path, n_ctx=64, threads=usable_cpus())
    try:
        texts = ["The king speaks softly.", "  leading spaces and 1234 digits", "Ünïcödé bytes: 東京 🙂", "value\nreturn\tindex"]
        assert tokenization_mismatches(runtime.tokenize, hf, texts) == []
    finally:
        runtime.close()


def test_pre_tokenizer_recognition() -> None:
    smollm = {
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": True},
                {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
            ],
        }
    }
    assert pre_tokenizer_name(smollm) == "smollm"
    qwen2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    split = {"type": "Split", "pattern": {"Regex": qwen2}, "behavior": "Isolated", "invert": False}
    bl = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}
    assert pre_tokenizer_name({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, bl]}}) == "qwen2"
    with pytest.raises(FormatError, match="set `pre_tokenizer:` on the export"):
        pre_tokenizer_name({"pre_tokenizer": {"type": "Whitespace"}})


def test_records_that_cannot_map_exactly_fail_or_fall_back(tmp_path: Path, tokenizer) -> None:
    model = tiny_llama(len(tokenizer))
    records = quantize(model, 3, 64, True)
    with pytest.raises(FormatError, match=r"cannot become Q4_0 exactly: W3 g64 sym is not symmetric 4-bit.*fallback"):
        plan_tensors(model, records, "q4_0", None, None)
    path = tmp_path / "f.gguf"
    facts = write_gguf(path, model, tokenizer, records, "q4_0", fallback="q8_0")
    assert facts["tensor_types"]["q8_0 (record)"] == 14  # 3-bit codes fit Q8_0 exactly
    assert set(facts["fallbacks"]) == set(records) and check_gguf_records(path, facts["plan"], records) == []
    facts = write_gguf(path, model, tokenizer, records, "q4_0", fallback="f16")
    assert facts["tensor_types"]["f16 (fallback)"] == 14

    odd = tiny_llama(len(tokenizer), hidden=96, intermediate=192)
    with pytest.raises(FormatError, match="group size 48 is not a multiple of 32"):
        plan_tensors(odd, quantize(odd, 4, 48, True), "q4_0", None, None)
    assert resolve_type("auto", quantize(tiny_llama(len(tokenizer)), 4, 32, False)) == "q4_1"
    assert resolve_type("auto", {}) == "f16"

    model.config.model_type = "gpt_neox"
    with pytest.raises(FormatError, match="Add an entry to ARCHITECTURES in export/gguf/layout.py"):
        architecture_of(model)


def test_gguf_export_configs() -> None:
    assert GGUFExportConfig(type="q4_k_m").quantizer == "llama.cpp"
    assert GGUFExportConfig().quantizer == "records" and GGUFExportConfig(type="q4_0", quantizer="llama.cpp").type == "q4_0"
    with pytest.raises(ValueError, match="with quantizer records: expected one of auto, f32"):
        GGUFExportConfig(type="iq4_xs", quantizer="records")
    with pytest.raises(ValueError, match="Q4_K_M is llama.cpp's per-tensor mix"):
        GGUFExportConfig(type="q4_k_m", quantizer="records")
    with pytest.raises(ValueError, match="fallback applies to quantizer records"):
        GGUFExportConfig(type="q6_k", fallback="f16")


def run_tiny_recipe(tmp_path: Path, model_dir: Path, text_dir: Path, exports: str, gates: str, symmetric: bool):
    """`compress run` of an RTN W4 g32 recipe on the tiny model with these exports and gates."""
    text = recipe_text(model_dir, text_dir, bits=4, group_size=32, symmetric=symmetric, gates=gates).replace("exports: []\n", exports)
    out = tmp_path / "out"
    return run_cli(["run", write_recipe(tmp_path, text), "-o", out]), out


def test_pipeline_gguf_export_without_verification(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    exports = "exports:\n  - format: gguf\n    verify: false\n"
    gates = "  - metric: kl_divergence\n    artifact: gguf\n    max: 10\n"
    result, out = run_tiny_recipe(tmp_path, tiny_model_dir, text_dir, exports, gates, symmetric=False)
    assert result.exit_code == 1, result.output  # a gate on an unmeasured GGUF fails rather than read torch's numbers
    gate = json.loads((out / "report.json").read_text())["gates"][0]
    assert (gate["value"], gate["source"], gate["passed"]) == (None, "missing", False)
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["exports"][0]
    assert (entry["type"], entry["records_exact"], entry["verified"], entry["path"]) == ("q4_1", 14, False, "exports/gguf")
    assert manifest["files"]["exports/gguf/model.gguf"] == entry["files"]["model.gguf"]


# --------------------------------------------------------------------------- llama.cpp


@needs_llama_cpp
def test_llama_cpp_runs_our_q4_0_like_our_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    from compress.eval.metrics import compare, torch_forward

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # a random init's attention is nearly uniform and weak: sharpen and strengthen it so row order matters
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8)
            if name.endswith(("v_proj.weight", "o_proj.weight")):
                p.mul_(4)
    records = quantize(model, 4, 32, True)
    path = tmp_path / "m.gguf"
    write_gguf(path, model, tok, records, "q4_0")
    runtime = gguf_runtime.LlamaCppModel(path, n_ctx=64, threads=usable_cpus())
    try:
        assert tokenization_mismatches(runtime.tokenize, tok, ["Hello world! 1234 the king speaks."]) == []
        ids = torch.randint(0, len(tok), (2, 48), generator=torch.Generator().manual_seed(0))
        same = compare(torch_forward(model, torch.device("cpu")), {"gguf": runtime.forward}, ids, 8)["gguf"]
        assert same["kl_divergence"] < 1e-3 and same["top1_agreement"] > 0.85, same
        # Pieces wholly before the asked positions only fill llama.cpp's cache (no logits made): the same numbers.
        pieces = gguf_runtime.LlamaCppModel(path, n_ctx=64, threads=usable_cpus(), piece_tokens=16)
        try:
            tail = pieces.forward(ids).logits(1, slice(40, 48)).clone()
            whole = pieces.forward(ids).logits(1, slice(0, 48)).clone()
        finally:
            pieces.close()
        assert torch.allclose(tail, whole[40:48], atol=1e-5)
        # A wrong row order (Q/K left unpermuted) is caught by the same check.
        bad = tmp_path / "bad.gguf"
        ARCHITECTURES["llama"] = GGUFArch("llama", permute_qk=False)
        try:
            write_gguf(bad, model, tok, records, "q4_0")
        finally:
            ARCHITECTURES["llama"] = GGUFArch("llama", permute_qk=True)
    finally:
        runtime.close()
    wrong = gguf_runtime.LlamaCppModel(bad, n_ctx=64, threads=usable_cpus())
    try:
        broken = compare(torch_forward(model, torch.device("cpu")), {"gguf": wrong.forward}, ids, 8)["gguf"]
    finally:
        wrong.close()
    assert broken["kl_divergence"] > 100 * same["kl_divergence"] and broken["top1_agreement"] < 0.5, (same, broken)


@needs_llama_cpp
def test_llama_cpp_quantizer_makes_k_quants_from_our_f16(tmp_path: Path, tokenizer) -> None:
    model = tiny_llama(len(tokenizer), hidden=256, intermediate=512)
    f16 = tmp_path / "f16.gguf"
    write_gguf(f16, model, tokenizer, {}, "f16")
    out = tmp_path / "q4km.gguf"
    gguf_runtime.quantize(f16, out, "q4_k_m", threads=usable_cpus())
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert "Q4_K" in types.values() and out.stat().st_size < f16.stat().st_size
    with pytest.raises(FormatError, match="not offered"):
        gguf_runtime.quantize(f16, out, "q9_k", threads=usable_cpus())


@needs_llama_cpp
def test_pipeline_verifies_gguf_in_llama_cpp_and_gates_on_it(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    exports = "exports:\n  - format: gguf\n    name: q4\n  - format: gguf\n    name: k\n    type: q6_k\n"
    gates = "  - metric: kl_divergence\n    artifact: q4\n    max: 0.01\n  - metric: top1_agreement\n    artifact: k\n    min: 0.95\n"  # measured: 0.00031, 100%
    result, out = run_tiny_recipe(tmp_path, tiny_model_dir, text_dir, exports, gates, symmetric=True)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    evals = {e["artifact"]: e for e in report["evaluations"]}
    assert evals["q4"]["runtime"] == "llama.cpp" and evals["k"]["runtime"] == "llama.cpp"
    assert evals["q4"]["details"]["same_weights_kl"] < 0.02 and "same_weights_kl" not in evals["k"]["details"]
    assert evals["q4"]["details"]["sample"]["greedy"]
    assert [e["evaluated_as"] for e in report["exports"]] == ["q4", "k"]
    gates_by_artifact = {g["artifact"]: g for g in report["gates"]}
    assert gates_by_artifact["q4"]["value"] == evals["q4"]["metrics"]["kl_divergence"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert [e["type"] for e in manifest["exports"]] == ["q4_0", "q6_k"] and manifest["exports"][0]["records_exact"] == 14


# --------------------------------------------------------------------------- real model


@pytest.mark.real_model
def test_smollm2_tokenizer_is_the_reference_ggufs_own_and_tokenizes_200_kb_identically(tmp_path: Path, smollm2) -> None:
    """Our GGUF of SmolLM2 carries the source GGUF's own tokenizer, key for key (EOS = 2 `<|im_end|>`,
    pre-tokenizer `smollm`), and llama.cpp tokenizes 200 KB of mixed text with it exactly as with the
    source file. transformers' plain rebuild of that tokenizer has EOS 1 and GPT-2's pre-tokenizer and
    splits digits after whitespace differently; the source loader repairs it from the file's keys (what
    the artifact's tokenizer files and ONNX exports carry), and the repaired one tokenizes the corpus as
    llama.cpp does on the source file."""
    from compress.export.gguf.export import check_tokenizer

    source = Path(smollm2.facts["path"])
    path = tmp_path / "smol.gguf"
    facts = write_gguf(path, smollm2.model, smollm2.tokenizer, {}, "f16", tokenizer_from=source)
    assert facts["tokenizer"]["special_ids"]["eos"] == 2 and facts["tokenizer"]["pre"] == "smollm"
    ours, theirs = gguf.GGUFReader(path).fields, gguf.GGUFReader(source).fields
    tokenizer_keys = sorted(k for k in theirs if k.startswith("tokenizer."))
    assert sorted(k for k in ours if k.startswith("tokenizer.")) == tokenizer_keys
    for key in (
        *tokenizer_keys,
        "llama.context_length",
        "llama.rope.freq_base",
        "llama.attention.head_count_kv",
        "llama.attention.layer_norm_rms_epsilon",
        "llama.rope.dimension_count",
        "llama.feed_forward_length",
    ):
        assert ours[key].contents() == theirs[key].contents(), key
    texts = parity_corpus(smollm2.tokenizer)
    parity = check_tokenizer(path, smollm2.tokenizer, texts, source, "exports[0]")
    assert parity["tokenizer_parity_bytes"] >= 200_000 and parity["tokenizer_parity_texts"] == len(texts)
    plain = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    assert (plain.eos_token_id, smollm2.tokenizer.eos_token_id) == (1, 2)
    repair = smollm2.facts["tokenizer"]
    assert repair["parity"]["mismatched"] == 0 and repair["parity"]["bytes"] >= 200_000, repair
    assert any("smollm" in change for change in repair["changed"]), repair
    vocab = gguf_runtime.LlamaCppVocab(source)
    try:
        assert tokenization_mismatches(vocab.tokenize, smollm2.tokenizer, texts) == []
        mismatches = tokenization_mismatches(vocab.tokenize, plain, texts)
    finally:
        vocab.close()
    assert mismatches and {"llama.cpp tokens", "transformers tokens"} <= set(mismatches[0])


def test_a_gguf_sources_tokenizer_is_repaired_from_its_keys_and_a_stale_or_damaged_cache_is_converted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text_dir: Path
) -> None:
    """A GGUF source with the Qwen2 pre-tokenizer and ChatML (EOS <|im_end|>): transformers' rebuild is
    repaired to the file's pre-tokenizer and EOS, the repair is recorded in the model's facts, and a
    cache marker from before the repair, or a damaged one, makes the conversion run again."""
    from compress.models import load_model
    from compress.paths import CONVERTED_MARKER
    from compress.progress import Reporter
    from compress.schema.recipe import ModelConfig
    from tests.tiny import family_tokenizer

    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path / "cache"))
    hf = family_tokenizer("qwen2", [p.read_text() for p in sorted(text_dir.glob("*.txt"))])
    source = tmp_path / "src" / "qwen.gguf"
    source.parent.mkdir()
    write_gguf(source, tiny_model("qwen2", vocab=len(hf), hidden=64, intermediate=64), hf, {}, "f16")
    plain = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    loaded = load_model(ModelConfig(source=str(source)), tmp_path, Reporter(quiet=True))
    repaired = loaded.tokenizer
    assert pre_tokenizer_name(json.loads(repaired.backend_tokenizer.to_str())) == "qwen2"
    assert repaired.eos_token == "<|im_end|>" and loaded.facts["tokenizer"]["special_ids"]["eos_token_id"] == hf.eos_token_id
    texts = parity_corpus(hf)
    assert [repaired(t)["input_ids"] for t in texts] == [hf(t)["input_ids"] for t in texts]
    # transformers rebuilds Qwen2's regex but takes <|endoftext|> for EOS; the repair says what it changed
    assert plain.eos_token == "<|endoftext|>" and loaded.facts["tokenizer"]["changed"] == [
        "EOS set to the file's 2 '<|im_end|>' (was '<|endoftext|>')"
    ]
    if gguf_runtime.available():
        assert loaded.facts["tokenizer"]["parity"]["mismatched"] == 0
    marker = Path(loaded.facts["converted_cache"]) / CONVERTED_MARKER
    for stale in ('{"gguf": "x"}', "{not json"):
        marker.write_text(stale)
        again = load_model(ModelConfig(source=str(source)), tmp_path, Reporter(quiet=True))
        assert json.loads(marker.read_text())["tokenizer_repair"] >= 1 and again.tokenizer.eos_token == "<|im_end|>"


def test_parity_corpus_is_200_kb_of_every_kind_of_text_and_the_same_each_time() -> None:
    texts = parity_corpus()
    joined = "".join(texts)
    assert sum(len(t.encode()) for t in texts) >= 200_000 and max(len(t) for t in texts) < 4000
    assert texts == parity_corpus() and texts != parity_corpus(seed=1)
    for sample in ("def ", "Привет", "你好", "👩\u200d💻", "  \n", "%"):
        assert sample in joined, sample
    assert any(ch.isdigit() for ch in joined)


def test_compare_tokenizers_names_the_first_difference_with_both_token_strings() -> None:
    def ours(text: str) -> list[int]:
        return [ord(c) for c in text]

    def truth(text: str) -> list[int]:
        return [ord(c) if c != "b" else 0 for c in text]

    assert compare_tokenizers(ours, truth, ["aaa", "ccc"], ("export", "source")) == []
    found = compare_tokenizers(ours, truth, ["aaa", "xyab"], ("export", "source"), lambda ids: [chr(i) if i else "<0>" for i in ids])
    assert found == [{"text": 1, "position": 3, "export": [98], "source": [0], "export tokens": ["b"], "source tokens": ["<0>"]}]
    shorter = compare_tokenizers(ours, lambda t: ours(t)[:-1], ["abc"], ("export", "source"))
    assert shorter[0]["position"] == 2 and shorter[0]["source"] == []


def test_pipeline_gguf_export_checks_its_tokenizer_on_200_kb_against_the_source(
    tmp_path: Path, tiny_model_dir: Path, text_dir: Path
) -> None:
    text = recipe_text(tiny_model_dir, text_dir, bits=4, group_size=32).replace(
        "exports: []\n", "exports:\n  - name: q4\n    format: gguf\n    type: q4_0\n"
    )
    out = tmp_path / "out"
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", out])
    assert result.exit_code == 0, result.output
    details = next(e for e in json.loads((out / "report.json").read_text())["evaluations"] if e["artifact"] == "q4")["details"]
    assert details["tokenizer_parity_bytes"] >= 200_000 and details["tokenizer_truth"] == "the source's Hugging Face tokenizer"


def ours_against_llama_cpp(
    tmp_path: Path, source_model, tokenizer, stage, type_name: str, cal: torch.Tensor, ev: torch.Tensor, min_context: int = 32
) -> tuple[dict[str, float], str]:
    """Apply ``stage`` (GPTQ/AWQ) to a copy of ``source_model``, pack its records exactly as
    ``type_name``; make llama.cpp's own ``type_name`` from our F16 file (token embeddings Q8_0 in
    both, so the files are the same size); score both in llama.cpp against the F16 file on
    ``ev``. Returns the KLs {"ours", "theirs"} and a greedy sample of ours."""
    from compress.context import RunContext
    from compress.eval.metrics import compare
    from compress.progress import Reporter

    model = copy.deepcopy(source_model)
    ctx = RunContext(seed=0, device=torch.device("cpu"), tokenizer=tokenizer, reporter=Reporter(quiet=True), calibration=lambda: cal)
    stage.apply(model, ctx)
    ours, f16, theirs = tmp_path / "ours.gguf", tmp_path / "f16.gguf", tmp_path / "theirs.gguf"
    facts = write_gguf(ours, model, tokenizer, ctx.quantized, type_name, float_type="q8_0")
    assert check_gguf_records(ours, facts["plan"], ctx.quantized) == []
    assert facts["tensor_types"][f"{type_name} (record)"] == len(ctx.quantized)
    write_gguf(f16, source_model, tokenizer, {}, "f16")
    gguf_runtime.quantize(f16, theirs, type_name, threads=usable_cpus(), token_embedding_type="q8_0")
    assert ours.stat().st_size == theirs.stat().st_size
    n_ctx = max(256, ev.shape[1])
    runtimes = {
        name: gguf_runtime.LlamaCppModel(p, n_ctx=n_ctx, threads=usable_cpus())
        for name, p in (("f16", f16), ("ours", ours), ("theirs", theirs))
    }
    try:
        assert tokenization_mismatches(runtimes["ours"].tokenize, tokenizer, [tokenizer.decode(ev[0])]) == []
        kl = {
            k: m["kl_divergence"]
            for k, m in compare(
                runtimes["f16"].forward, {"ours": runtimes["ours"].forward, "theirs": runtimes["theirs"].forward}, ev, min_context
            ).items()
        }
        text = runtimes["ours"].generate("The capital of France is", 24)
    finally:
        for rt in runtimes.values():
            rt.close()
    return kl, text


@pytest.mark.real_model
@needs_llama_cpp
@pytest.mark.minutes(1.0)
def test_smollm2_gptq_q4_0_beats_llama_cpp_q4_0_at_the_same_size(tmp_path: Path, smollm2, shakespeare_chunks) -> None:
    """The issue's check, on reduced data (16 x 256 calibration, 8 x 256 held-out evaluation tokens):
    GPTQ W4 g32 symmetric packed exactly into Q4_0 has lower KL against our F16 GGUF, measured in
    llama.cpp, than llama.cpp's own Q4_0 of that F16 file, and the files are the same size."""
    from compress.quantizers.configs import GPTQConfig
    from compress.quantizers.gptq import GPTQStage

    cal, ev = shakespeare_chunks
    kl, text = ours_against_llama_cpp(
        tmp_path, smollm2.model, smollm2.tokenizer, GPTQStage(GPTQConfig(bits=4, group_size=32, symmetric=True), "s"), "q4_0", cal, ev
    )
    assert kl["ours"] < 0.8 * kl["theirs"], kl
    # words, not byte soup: "Paris." and "is:" are words (punctuation around a word is stripped before counting)
    assert sum(w.strip(string.punctuation).isalpha() for w in text.split()) >= 4, text


@needs_llama_cpp
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_asymmetric_records_as_q4_1_beat_llama_cpp_q4_1_on_a_model_off_its_grid(
    tmp_path: Path, trained_tiny_dir: Path, text_dir: Path, method: str
) -> None:
    """The Q4_1 half of the issue's check needs a model whose weights are not already a Q4_1 file
    (SmolLM2's are: llama.cpp's Q4_1 recovers them almost exactly). A tiny Llama trained from random
    weights is off every grid: GPTQ / AWQ W4 g32 asymmetric packed exactly into Q4_1 has lower KL
    against our F16 GGUF, in llama.cpp, than llama.cpp's own Q4_1 of that F16 file, at the same size.
    README "GGUF export" has the same comparison on a pruned and repaired SmolLM2."""
    from compress.quantizers.awq import AWQStage
    from compress.quantizers.configs import AWQConfig, GPTQConfig
    from compress.quantizers.gptq import GPTQStage

    model = AutoModelForCausalLM.from_pretrained(trained_tiny_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained_tiny_dir)
    docs = sorted(text_dir.glob("*.txt"))
    cal = token_chunks(tokenizer, "\n\n".join(p.read_text() for p in docs[:2]), 64, 32)
    ev = token_chunks(tokenizer, docs[2].read_text(), 128, 8)
    stage = (
        GPTQStage(GPTQConfig(bits=4, group_size=32, symmetric=False), "s")
        if method == "gptq"
        else AWQStage(AWQConfig(bits=4, group_size=32, symmetric=False), "s")
    )
    kl, _ = ours_against_llama_cpp(tmp_path, model, tokenizer, stage, "q4_1", cal, ev, min_context=8)
    assert kl["ours"] < 0.8 * kl["theirs"], kl


def token_chunks(tokenizer, text: str, seq_len: int, count: int) -> torch.Tensor:
    ids = torch.tensor(tokenizer(text)["input_ids"])
    assert ids.numel() >= seq_len * count, (ids.numel(), seq_len * count)
    return ids[: seq_len * count].reshape(count, seq_len)


@pytest.mark.real_model
@needs_llama_cpp
@pytest.mark.minutes(2.1)
def test_smollm2_recipe_exports_a_verified_gguf(tmp_path: Path) -> None:
    """recipes/gguf.yaml on reduced data (16 x 256 calibration, 4 x 512 evaluation tokens): GPTQ W4
    g32 sym -> exact Q4_0 and llama.cpp's Q4_K_M, both verified in llama.cpp (tokenizer parity;
    same-weights KL for the exact one), scored, and gated on their own llama.cpp evaluations."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "out"
    result = run_cli(
        [
            "run",
            root / "recipes" / "gguf.yaml",
            "-o",
            out,
            "-q",
            "--set",
            "data.evaluation.samples=4",
            "--set",
            "data.calibration.samples=16",
            "--set",
            "data.calibration.seq_len=256",
        ]
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    ev = {e["artifact"]: e for e in report["evaluations"]}["q4_0"]
    assert ev["runtime"] == "llama.cpp" and ev["details"]["same_weights_kl"] < 0.02
    torch_kl = {e["artifact"]: e for e in report["evaluations"]}["compressed"]["metrics"]["kl_divergence"]
    assert abs(ev["metrics"]["kl_divergence"] - torch_kl) < 0.25 * torch_kl  # llama.cpp runs the same weights
    assert {e["artifact"]: e for e in report["evaluations"]}["q4_k_m"]["runtime"] == "llama.cpp"
    assert all(g["passed"] for g in report["gates"]) and {g["artifact"] for g in report["gates"]} == {"q4_0"}
    manifest = json.loads((out / "manifest.json").read_text())
    assert [(e["type"], e["records_exact"]) for e in manifest["exports"]] == [("q4_0", 210), ("q4_k_m", 0)]
    assert "q4_k" in manifest["exports"][1]["tensor_types"]  # counted in the file llama.cpp wrote


def test_a_gemma_gguf_sources_tokenizer_gets_merges_from_the_files_scores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text_dir: Path
) -> None:
    """transformers rebuilds a Gemma GGUF's SentencePiece tokenizer as a Unigram on its scores (a BPE
    without merges once saved): Gemma 3 270M's file tokenized every parity text differently from
    llama.cpp. The source loader makes the BPE merges from the scores, as llama.cpp joins pieces, and
    the loaded tokenizer tokenizes as the one the file was written from."""
    from compress.models import load_model
    from compress.progress import Reporter
    from compress.schema.recipe import ModelConfig
    from tests.tiny import family_tokenizer

    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path / "cache"))
    hf = family_tokenizer("gemma", [p.read_text() for p in sorted(text_dir.glob("*.txt"))])
    source = tmp_path / "src" / "gemma.gguf"
    source.parent.mkdir()
    write_gguf(source, tiny_model("gemma3_text", vocab=len(hf), hidden=64, intermediate=64), hf, {}, "f16")
    texts = parity_corpus(hf)[:40]
    plain = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    assert [plain(t)["input_ids"] for t in texts] != [hf(t)["input_ids"] for t in texts]
    loaded = load_model(ModelConfig(source=str(source)), tmp_path, Reporter(quiet=True))
    assert [loaded.tokenizer(t)["input_ids"] for t in texts] == [hf(t)["input_ids"] for t in texts]
    assert any("BPE merges made from the file's" in change for change in loaded.facts["tokenizer"]["changed"])
    if gguf_runtime.available():
        assert loaded.facts["tokenizer"]["parity"]["mismatched"] == 0


def test_a_qwen2_whose_queries_are_not_as_wide_as_its_hidden_size_is_refused_for_llama_cpp() -> None:
    """llama.cpp's qwen2 graph makes queries n_embd wide (it loads no other width): heads and hidden
    channels pruned apart cannot be a qwen2 GGUF, and say so before anything is written; llama's can."""
    wide = tiny_model("qwen2", vocab=300, hidden=64, intermediate=128, positions=64, heads=4, kv_heads=1, head_dim=32)
    with pytest.raises(FormatError, match=r"queries as wide as the hidden size \(64\); this model's are 4 heads x 32 = 128 wide"):
        architecture_of(wide)
    assert (
        architecture_of(tiny_model("qwen2", vocab=300, hidden=64, intermediate=128, positions=64, heads=2, kv_heads=1, head_dim=32)).name
        == "qwen2"
    )
    assert (
        architecture_of(tiny_model("llama", vocab=300, hidden=64, intermediate=128, positions=64, heads=4, kv_heads=1, head_dim=32)).name
        == "llama"
    )
