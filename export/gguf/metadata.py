"""GGUF metadata: the hyperparameters llama.cpp needs for each architecture (with a family's own
keys, checked against what llama.cpp's graph computes), the tokenizer (built from tokenizer.json, or
copied from a source GGUF), and the file type, written through gguf-py's named writer methods and
keys (``gguf.Keys``).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
from torch import nn

from compress.errors import FormatError
from compress.export.parity import turn_end_id

METADATA_NAMESPACE = "compress"  # our own keys: compress.<key>
TOKENIZER_PREFIX = "tokenizer."  # every tokenizer key of a GGUF file (tokenizer.ggml.*, tokenizer.chat_template)
GGML_TOKENIZER_PREFIX = "tokenizer.ggml."  # the vocabulary, special ids (*_token_id) and add flags (add_*_token)

if TYPE_CHECKING:
    from compress.export.gguf.layout import GGUFArch


def gemma_keys(cfg: Any, arch_name: str) -> dict[str, Any]:
    """Gemma 2 / 3: llama.cpp scales queries by 1/sqrt(head_dim) (by 1/sqrt(hidden / heads) for the
    27B block counts, 46 and 62), caps attention logits always on gemma2 and never on gemma3, and
    reads each layer's sliding window from a per-layer pattern (written here from ``layer_types``)."""
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    big = int(cfg.num_hidden_layers) == {"gemma2": 46, "gemma3": 62}[arch_name]
    scale_dim = cfg.hidden_size // heads if big else head_dim
    scalar = getattr(cfg, "query_pre_attn_scalar", None)
    if scalar is not None and int(scalar) != scale_dim:
        raise FormatError(
            f"config query_pre_attn_scalar is {scalar}, but llama.cpp's {arch_name} scales queries by 1/sqrt({scale_dim}) "
            f"({'hidden_size / num_attention_heads' if big else 'head_dim'} at {cfg.num_hidden_layers} blocks): "
            "its file would compute a different attention"
        )
    if arch_name == "gemma2" and not getattr(cfg, "tie_word_embeddings", True):
        raise FormatError("config tie_word_embeddings is false: llama.cpp's gemma2 always uses the token embedding as its output")
    keys: dict[str, Any] = {}
    attn_cap = getattr(cfg, "attn_logit_softcapping", None)
    final_cap = getattr(cfg, "final_logit_softcapping", None)
    if arch_name == "gemma2":
        for key, value in (("attn_logit_softcapping", attn_cap), ("final_logit_softcapping", final_cap)):
            if not value:
                raise FormatError(f"config {key} is {value!r}: llama.cpp's gemma2 always soft-caps, so its file would differ")
        keys["add_attn_logit_softcapping"] = float(attn_cap)
    elif attn_cap:
        raise FormatError(f"config attn_logit_softcapping is {attn_cap}: llama.cpp's gemma3 does not cap attention logits")
    if final_cap:
        keys["add_final_logit_softcapping"] = float(final_cap)
    layer_types = list(getattr(cfg, "layer_types", None) or [])
    sliding = [t == "sliding_attention" for t in layer_types]
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise FormatError(f"config layer_types holds {unknown}: GGUF export writes sliding_attention and full_attention layers")
    if any(sliding):
        keys["add_sliding_window"] = int(cfg.sliding_window)
        keys["add_sliding_window_pattern"] = sliding
    elif arch_name == "gemma2":
        raise FormatError("config layer_types has no sliding_attention layer: llama.cpp's gemma2 always slides a window")
    return keys


def _rope(cfg: Any, layer_type: str = "full_attention") -> tuple[float, dict[str, Any]]:
    """(theta, rope parameters) of ``layer_type``'s layers: transformers keeps one set, or one per
    layer type (Gemma 3: ``full_attention`` and ``sliding_attention``)."""
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    if "full_attention" in params:
        params = dict(params.get(layer_type) or params["full_attention"])
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return float(theta), params


def add_hyperparameters(writer: Any, model: nn.Module, arch: GGUFArch) -> None:

    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    writer.add_context_length(int(cfg.max_position_embeddings))
    writer.add_embedding_length(int(cfg.hidden_size))
    writer.add_block_count(int(cfg.num_hidden_layers))
    writer.add_feed_forward_length(int(cfg.intermediate_size))
    writer.add_head_count(int(heads))
    writer.add_head_count_kv(int(getattr(cfg, "num_key_value_heads", None) or heads))
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_vocab_size(int(cfg.vocab_size))
    writer.add_rope_dimension_count(int(head_dim))
    writer.add_key_length(int(head_dim))  # explicit: readers default to hidden / heads (transformers' qwen3 to 128)
    writer.add_value_length(int(head_dim))
    theta, params = _rope(cfg)
    writer.add_rope_freq_base(theta)
    if "sliding_attention" in (getattr(cfg, "rope_parameters", None) or {}):  # sliding layers' own rope (Gemma 3)
        swa_theta, swa = _rope(cfg, "sliding_attention")
        if swa.get("rope_type", "default") != "default":
            raise FormatError(f"sliding_attention rope_type '{swa['rope_type']}': llama.cpp scales only full-attention layers' rope")
        writer.add_rope_freq_base_swa(swa_theta)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", None):
        return
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(params["factor"]))
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(params["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(params.get("original_max_position_embeddings", cfg.max_position_embeddings)))
    else:
        raise FormatError(f"GGUF export does not write rope scaling '{kind}' yet (linear and yarn are supported)")


# llama.cpp pre-tokenizer names, recognized from the Hugging Face tokenizer.json `pre_tokenizer`.
# A signature is the tuple of its steps (see _pre_signature). Extend with a parity test.
_LETTERS_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST_REGEX = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PRE_TOKENIZERS: dict[tuple, str] = {
    (("bytelevel", True, False),): "gpt-2",
    (("digits", True), ("bytelevel", True, False)): "smollm",
    (("split", _LETTERS_REGEX + r"\p{N}{1,3}" + _REST_REGEX), ("bytelevel", False, False)): "llama-bpe",
    (("split", _LETTERS_REGEX + r"\p{N}" + _REST_REGEX), ("bytelevel", False, False)): "qwen2",
}


def _pre_signature(node: dict[str, Any] | None) -> tuple:
    if node is None:
        return ()
    kind = node.get("type")
    if kind == "Sequence":
        return tuple(step for child in node.get("pretokenizers", []) for step in _pre_signature(child))
    if kind == "ByteLevel":
        return (("bytelevel", bool(node.get("use_regex", True)), bool(node.get("add_prefix_space", False))),)
    if kind == "Digits":
        return (("digits", bool(node.get("individual_digits", False))),)
    if kind == "Split":
        pattern = node.get("pattern", {})
        return (("split", pattern.get("Regex", pattern.get("String"))),)
    return ((kind,),)


def pre_tokenizer_of(signature: tuple) -> Any:
    """The Hugging Face tokenizers pre-tokenizer with this signature (``_pre_signature``'s inverse)."""
    from tokenizers import Regex, pre_tokenizers

    steps = []
    for step in signature:
        if step[0] == "bytelevel":
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=step[2], use_regex=step[1]))
        elif step[0] == "digits":
            steps.append(pre_tokenizers.Digits(individual_digits=step[1]))
        elif step[0] == "split":
            steps.append(pre_tokenizers.Split(Regex(step[1]), behavior="isolated", invert=False))
        else:
            raise FormatError(f"no pre-tokenizer is made for the step {step}")
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


def pre_tokenizer_name(tokenizer_json: dict[str, Any], strict: bool = True) -> str | None:
    """llama.cpp's name for tokenizer.json's pre-tokenizer; unknown: FormatError (``strict``) or None."""
    signature = _pre_signature(tokenizer_json.get("pre_tokenizer"))
    if signature not in PRE_TOKENIZERS and not strict:
        return None
    if signature not in PRE_TOKENIZERS:
        raise FormatError(
            f"GGUF export does not recognize this tokenizer's pre-tokenizer {signature}; set `pre_tokenizer:` on the "
            f"export to llama.cpp's name for it (known here: {', '.join(sorted(set(PRE_TOKENIZERS.values())))})"
        )
    return PRE_TOKENIZERS[signature]


def add_tokenizer(writer: Any, tokenizer: Any, n_vocab: int, pre_tokenizer: str) -> dict[str, Any]:
    """BPE (``gpt2``) or SentencePiece-style byte-fallback BPE (``llama``) vocabularies from the
    fast tokenizer's tokenizer.json, plus special ids, add-bos/eos and the chat template."""

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        tj = json.loads((Path(tmp) / "tokenizer.json").read_text())
        special = gguf.SpecialVocab(tmp, load_merges=True, n_vocab=n_vocab)
    model = tj["model"]
    if model.get("type") != "BPE":
        raise FormatError(f"GGUF export writes BPE tokenizers; this one is {model.get('type')}")
    byte_level = any(step[0] == "bytelevel" for step in _pre_signature(tj.get("pre_tokenizer")))
    spm = not byte_level and bool(model.get("byte_fallback"))
    if not byte_level and not spm:
        raise FormatError(
            "GGUF export writes byte-level BPE (gpt2) and byte-fallback BPE (SentencePiece-style llama) tokenizers; "
            "this tokenizer is neither"
        )
    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["id"]: t for t in tj.get("added_tokens", [])}
    for tid, tok in added.items():
        vocab.setdefault(tok["content"], tid)
    by_id = {i: t for t, i in vocab.items()}
    tokens, types, scores = [], [], []
    for i in range(n_vocab):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(text)
            if spm and text.startswith("<0x") and len(text) == 6:
                types.append(gguf.TokenType.BYTE)
            elif i in added:
                types.append(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
            else:
                types.append(gguf.TokenType.NORMAL)
        scores.append(-float(i))
    if spm:
        writer.add_tokenizer_model("llama")
        writer.add_token_scores(scores)
        writer.add_add_space_prefix("Prepend" in json.dumps(tj.get("normalizer")) or "Metaspace" in json.dumps(tj.get("pre_tokenizer")))
        pre = "default"
    else:
        writer.add_tokenizer_model("gpt2")
        pre = pre_tokenizer if pre_tokenizer != "auto" else pre_tokenizer_name(tj)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if spm:
        special.merges = []  # SentencePiece merges come from the scores
    # What the Hugging Face tokenizer does, written explicitly (llama.cpp's defaults differ by vocabulary type).
    probe = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    special.add_special_token["bos"] = tokenizer.bos_token_id is not None and probe[:1] == [tokenizer.bos_token_id]
    special.add_special_token["eos"] = tokenizer.eos_token_id is not None and probe[-1:] == [tokenizer.eos_token_id]
    special.add_to_gguf(writer, quiet=True)
    ids = dict(special.special_token_ids)
    eot = turn_end_id(tokenizer)  # written, not left to llama.cpp's guess from the token's text
    if eot is not None:
        writer.add_eot_token_id(eot)
        ids["eot"] = eot
    return {
        "model": "llama" if spm else "gpt2",
        "pre": pre,
        "tokens": len(tokens),
        "merges": len(special.merges),
        "special_ids": ids,
        "add_special": dict(special.add_special_token),
        "chat_template": special.chat_template is not None,
    }


def copy_tokenizer(writer: Any, source: Path, n_vocab: int, pre_tokenizer: str) -> dict[str, Any]:
    """The source GGUF's own tokenizer, copied key for key (vocabulary, token types, merges or
    scores, special ids, add-BOS/EOS, pre-tokenizer, chat template): what llama.cpp already runs for
    that model, rather than transformers' rebuild of it, which can differ (SmolLM2: EOS and
    pre-tokenizer). ``pre_tokenizer`` other than ``auto`` replaces the source's."""

    fields = {k: f for k, f in gguf.GGUFReader(source).fields.items() if k.startswith(TOKENIZER_PREFIX)}
    tokens = fields.get(gguf.Keys.Tokenizer.LIST)
    if tokens is None:
        raise FormatError(f"the source {source} has no tokenizer (no tokenizer.ggml.tokens); a GGUF export needs one")
    if len(tokens.data) != n_vocab:
        raise FormatError(f"the source {source} has {len(tokens.data)} tokens and the model {n_vocab} embeddings; they must match")
    for key, entry in fields.items():
        if key == gguf.Keys.Tokenizer.PRE and pre_tokenizer != "auto":
            continue
        vtype = entry.types[0]
        writer.add_key_value(key, entry.contents(), vtype, entry.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    if pre_tokenizer != "auto":
        writer.add_tokenizer_pre(pre_tokenizer)

    def value(key: str) -> Any:
        return fields[key].contents() if key in fields else None

    return {
        "from": f"source GGUF {source.name}",
        "model": value(gguf.Keys.Tokenizer.MODEL),
        "pre": pre_tokenizer if pre_tokenizer != "auto" else value(gguf.Keys.Tokenizer.PRE),
        "tokens": len(tokens.data),
        "merges": len(fields[gguf.Keys.Tokenizer.MERGES].data) if gguf.Keys.Tokenizer.MERGES in fields else 0,
        "special_ids": {
            k.removeprefix(GGML_TOKENIZER_PREFIX).removesuffix("_token_id"): value(k) for k in fields if k.endswith("_token_id")
        },
        "add_special": {
            k.removeprefix(GGML_TOKENIZER_PREFIX + "add_").removesuffix("_token"): value(k)
            for k in fields
            if k.startswith(GGML_TOKENIZER_PREFIX + "add_") and k.endswith("_token")
        },
        "chat_template": gguf.Keys.Tokenizer.CHAT_TEMPLATE in fields,
    }


def tokenizer_metadata(path: Path) -> dict[str, Any]:
    """The scalar tokenizer keys of a GGUF file (special ids, add-BOS/EOS, model, pre-tokenizer, chat template)."""

    return {
        k: f.contents()
        for k, f in gguf.GGUFReader(path).fields.items()
        if k.startswith(TOKENIZER_PREFIX) and f.types and f.types[0] != gguf.GGUFValueType.ARRAY
    }


# The file type llama.cpp records for a file mostly of one block type (K-quants: the _S mix, the one
# whose tensors are mostly that type; metadata only, readers go by each tensor's own type).
FILE_TYPES = {
    "f32": "ALL_F32",
    "f16": "MOSTLY_F16",
    "bf16": "MOSTLY_BF16",
    "q8_0": "MOSTLY_Q8_0",
    "q4_0": "MOSTLY_Q4_0",
    "q4_1": "MOSTLY_Q4_1",
    "q5_0": "MOSTLY_Q5_0",
    "q5_1": "MOSTLY_Q5_1",
    "q2_k": "MOSTLY_Q2_K",
    "q3_k": "MOSTLY_Q3_K_S",
    "q4_k": "MOSTLY_Q4_K_S",
    "q5_k": "MOSTLY_Q5_K_S",
    "q6_k": "MOSTLY_Q6_K",
    "mxfp4": "MOSTLY_MXFP4_MOE",  # llama.cpp's one MXFP4 file type (general.file_type only labels the file)
}


def file_type(type_name: str) -> Any:

    return gguf.LlamaFileType[FILE_TYPES[type_name]]
