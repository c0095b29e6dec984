"""The tests' tiny models, built in one place.

Every model a test needs comes from :func:`tiny_model` (a random causal LM of any architecture the
pipeline supports, from a few shape arguments and a seed), optionally reshaped by :func:`scale_weights`
or :func:`perturb_norms`, or is written to a directory with a tokenizer trained on the test text
(:func:`tiny_llama_dir`, :func:`train_tiny`, :func:`tiny_bert_dir`). A test names its shape where it
builds the model; the numbers its assertions depend on (seeds, widths) stay with the test.

Defaults: 2 blocks of width 64 (MLP 128), 4 query heads over 2 KV heads, a 300-token vocabulary,
128 positions, the architecture's own default for tied embeddings (Llama, Qwen: untied; Gemma: tied);
Qwen3-MoE: 8 routed experts of MLP width 32, top-2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Per-architecture settings a tiny width needs: Gemma's and Qwen3's configs default to head_dim 256 / 128
# and Gemma's attention scale and sliding window to sizes far beyond a 128-position model.
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 16},
    "gemma3_text": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 16},
    "qwen3": {"head_dim": 16},
    # Qwen3-MoE: 8 routed experts of width 32, each token to 2 of them (its default is 128 experts of 768).
    "qwen3_moe": {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True},
}


def tiny_config(
    model_type: str = "llama",
    *,
    vocab: int = 300,
    hidden: int = 64,
    intermediate: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    positions: int = 128,
    tie: bool | None = None,
    **extra: Any,
):
    """A transformers config of ``model_type`` with these sizes; ``extra`` are further config fields."""
    from transformers import AutoConfig

    fields: dict[str, Any] = {**ARCH_DEFAULTS.get(model_type, {}), **extra}
    if head_dim is not None:
        fields["head_dim"] = head_dim
    if tie is not None:
        fields["tie_word_embeddings"] = tie
    return AutoConfig.for_model(
        model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
        **fields,
    )


def tiny_model(model_type: str = "llama", *, seed: int = 0, **shape: Any):
    """A random causal LM (eval mode, float32) of ``tiny_config(model_type, **shape)``, initialised after
    ``torch.manual_seed(seed)``: the same arguments give the same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **shape)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def scale_weights(model, factors: dict[str, float]):
    """Multiply every parameter whose name ends with a key of ``factors`` by its factor, in place; returns
    ``model``. Sharpening the random attention (q/k x 6-8) makes what the cache, the row order or a bias
    holds visible in the logits."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            for suffix, factor in factors.items():
                if name.endswith(suffix):
                    p.mul_(factor)
    return model


def perturb_norms(model, std: float = 0.3):
    """Add N(0, std) noise to every norm weight and bias, in place; returns ``model``. A random init's norms
    are all ones and its biases zero, so channel order and bias slicing would otherwise not show."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * std)
    return model


def train_tokenizer(texts: list[str], vocab: int = 400):
    """A byte-level BPE tokenizer (GPT-2 style, ``<|endoftext|>`` as EOS) trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


# The chat templates of the families' tokenizers, reduced to their turn markup (what a runtime must
# recognise: the token that ends a turn).
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_CHAT = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
GEMMA_CHAT = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# The pre-tokenizer regexes of Llama 3 (llama.cpp's llama-bpe: digits in runs of up to 3) and Qwen2 (single digits).
_LETTERS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
FAMILY_REGEX = {"llama3": _LETTERS + r"\p{N}{1,3}" + _REST, "qwen2": _LETTERS + r"\p{N}" + _REST}


def family_tokenizer(family: str, texts: list[str], vocab: int = 600):
    """A tokenizer built the way ``family``'s real one is, trained on ``texts``, with its special tokens
    and chat template: ``llama3`` (byte-level BPE after Llama 3's regex, ``<|eot_id|>``), ``qwen2`` (Qwen2's
    regex, ChatML, ``<|im_end|>`` as EOS) or ``gemma`` (transformers' GemmaTokenizer: SentencePiece-style
    BPE on "▁"-joined text with byte fallback and no prefix space, ``<end_of_turn>``)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if family == "gemma":
        from transformers import GemmaTokenizer

        specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        tok.normalizer = normalizers.Replace(" ", "▁")
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[*specials, *(f"<0x{b:02X}>" for b in range(256))])
        tok.train_from_iterator(texts, trainer)
        state = json.loads(tok.to_str())["model"]
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
        hf = GemmaTokenizer(vocab=state["vocab"], merges=merges, add_bos_token=True)
        hf.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
        hf.chat_template = GEMMA_CHAT
        return hf
    specials = {
        "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    }[family]
    tok = Tokenizer(models.BPE())
    split = pre_tokenizers.Split(Regex(FAMILY_REGEX[family]), behavior="isolated")
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    if family == "llama3":
        return PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token=specials[0],
            eos_token=specials[1],
            chat_template=LLAMA3_CHAT,
            additional_special_tokens=specials[2:],
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML,
        additional_special_tokens=["<|im_start|>"],
    )


def tiny_llama(vocab: int, hidden: int = 128, intermediate: int = 256, tie: bool = True):
    """The export tests' random 2-block Llama (seed 1, 256 positions): widths 128 / 256 and KV width 64 are
    multiples of every group size they test."""
    return tiny_model("llama", seed=1, vocab=vocab, hidden=hidden, intermediate=intermediate, positions=256, tie=tie)


def prunable_model(model_type: str = "llama", layers: int = 4, tie: bool = True, seed: int = 0):
    """The pruning tests' random model: width 64, MLP 96, 4 heads of 16 over 2 KV heads, a 128-token
    vocabulary, norms perturbed (Qwen2 with its q/k/v biases, perturbed too)."""
    extra = {"attention_bias": True} if model_type == "qwen2" else {}
    model = tiny_model(model_type, seed=seed, vocab=128, hidden=64, intermediate=96, layers=layers, head_dim=16, tie=tie, **extra)
    return perturb_norms(model, 0.3)


def tiny_llama_dir(directory: Path, texts: list[str], *, tie: bool = True, hidden: int = 96, layers: int = 2, **shape: Any) -> Path:
    """A random Llama and its tokenizer (BPE trained on ``texts``) saved in ``directory``, as a model source for
    recipes. Hidden 96 with groups of 64 leaves a partial last group of 32; MLP 160; 512 positions."""
    tokenizer = train_tokenizer(texts)
    shape = {"intermediate": 160, "positions": 512, **shape}
    model = tiny_model("llama", vocab=len(tokenizer), hidden=hidden, layers=layers, tie=tie, **shape)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def tiny_moe_dir(directory: Path, texts: list[str], **shape: Any) -> Path:
    """A random Qwen3-MoE (2 blocks of width 64, 8 experts of width 32, top-2; ARCH_DEFAULTS) and its tokenizer
    (BPE trained on ``texts``) saved in ``directory``: the mixture-of-experts model source for recipes."""
    return tiny_source_dir(directory, texts, "qwen3_moe", **shape)


def tiny_source_dir(directory: Path, texts: list[str], model_type: str, family: str | None = None, **shape: Any) -> Path:
    """A random ``model_type`` (512 positions) and a tokenizer trained on ``texts`` (``family_tokenizer(family)``,
    or the GPT-2-style one) saved in ``directory``, as a model source for recipes."""
    tokenizer = family_tokenizer(family, texts) if family else train_tokenizer(texts)
    model = tiny_model(model_type, vocab=len(tokenizer), positions=512, **shape)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def train_tiny(source: Path, target: Path, texts: list[str], steps: int = 150, seq_len: int = 64) -> Path:
    """A copy of the tiny model at ``source`` trained briefly (next-token loss) on ``texts``, so that
    it predicts something: pruning a random model barely changes its near-uniform outputs, which
    leaves distillation nothing to repair."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source)
    ids = torch.tensor(tokenizer("\n\n".join(texts))["input_ids"])
    n = ids.numel() // seq_len
    chunks = ids[: n * seq_len].reshape(n, seq_len)
    g = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = chunks[torch.randint(0, n, (8,), generator=g)]
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval().save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def tiny_bert_dir(directory: Path, texts: list[str]) -> Path:
    """A random 2-block BERT encoder (width 64) and a WordPiece tokenizer trained on ``texts``, saved in
    ``directory``: the source for the encoder-export tests."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=300, special_tokens=special))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]"
    )
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        architectures=["BertModel"],
    )
    BertModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
