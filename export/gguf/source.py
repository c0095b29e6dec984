"""A GGUF file as a model source. transformers dequantizes it once, and the result is cached as a
safetensors model directory (``<cache>/models/gguf-<sha256 prefix>``), so later runs load in
seconds. transformers refuses ``save_pretrained`` on a GGUF-loaded model, so its tensors are
handed to a model skeleton built from the same config on the meta device (no second copy).
``convert`` is the same conversion into any folder and dtype; the reference assets use it
(compress/assets.py: a model delivered as GGUF, kept as a bfloat16 Hugging Face folder).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from compress.errors import ModelLoadError
from compress.export.gguf.inputs import check_gguf
from compress.fsutil import atomic_directory, sha256_file
from compress.paths import CONVERTED_MARKER, cache_root
from compress.progress import Reporter
from compress.schema.recipe import ModelConfig


def converted_dir(digest: str) -> Path:
    """Where the float safetensors copy of the GGUF file with this SHA-256 is cached."""
    return cache_root() / "models" / f"gguf-{digest[:16]}"


def source_config(path: Path, digest: str | None, source: str) -> tuple[Any, str]:
    """The model config of a GGUF source for ``compress plan``: the converted copy's config.json when
    it is cached (``digest`` known), else read from the GGUF metadata; ``source`` as the recipe names it."""
    from transformers import AutoConfig

    if digest is not None and (converted_dir(digest) / CONVERTED_MARKER).is_file():
        return AutoConfig.from_pretrained(
            converted_dir(digest), local_files_only=True
        ), f"config.json of the converted {source} ({converted_dir(digest)})"
    check_gguf(path)  # the tensor table against the metadata first: a block_count of 10⁹ never reaches transformers
    try:  # transformers reads the metadata with gguf.GGUFReader (memory-mapped; tensors are not loaded)
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name), f"GGUF metadata of {path}"
    except Exception as exc:  # the GGUF reader raises many types for a damaged file
        raise ModelLoadError(
            f"cannot read the model config from the GGUF metadata of {path}: {type(exc).__name__}: {str(exc)[:300]}"
        ) from None


def load_source(path: Path, model_cfg: ModelConfig, reporter: Reporter, load_dir: Callable[..., Any]) -> Any:
    """A GGUF file as the model source: dequantized by transformers once, cached as float safetensors,
    and that folder loaded by ``load_dir`` (compress.models.from_hf_dir: handed in, since the model
    loader sits above the export formats). Returns its LoadedModel."""
    check_gguf(path)
    digest = sha256_file(path)
    converted = converted_dir(digest)
    marker = converted / CONVERTED_MARKER
    if _marker(marker).get("tokenizer_repair") != TOKENIZER_REPAIR:  # not converted yet, or by another repair
        with atomic_directory(converted, overwrite=True, kind=None) as tmp:
            repair = convert(path, tmp, "float32", False, reporter)
            (tmp / CONVERTED_MARKER).write_text(
                json.dumps({"gguf": str(path), "sha256": digest, "tokenizer_repair": TOKENIZER_REPAIR, "tokenizer": repair}, indent=2)
            )
    loaded = load_dir(converted, model_cfg.model_copy(update={"trust_remote_code": False}), reporter, "gguf", str(path))
    model = loaded.model
    if getattr(model.config, "quantization_config", None) is not None:
        # transformers records the GGUF origin as a quantization config and refuses save_pretrained;
        # the weights here are plain dequantized floats.
        del model.config.quantization_config
        model.hf_quantizer = None
    tokenizer_facts = _marker(marker).get("tokenizer")
    loaded.facts.update(
        kind="gguf", path=str(path), sha256=digest, files={path.name: digest}, converted_cache=str(converted), tokenizer=tokenizer_facts
    )
    return loaded


def _marker(path: Path) -> dict[str, Any]:
    """The converted cache's marker; {} when missing or unreadable (the conversion is then made again)."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def convert(path: Path, directory: Path, dtype: str, tie_embeddings: bool, reporter: Reporter) -> dict[str, Any]:
    """Write the model of the GGUF file ``path`` into ``directory`` as a Hugging Face folder (config.json,
    generation config, tokenizer files, safetensors) of ``dtype`` weights, dequantized by transformers.

    ``tie_embeddings``: the GGUF stores the head (``output.weight``) beside the token embedding though
    the model ties them (the Q4_K_M file of Qwen2.5-Coder-1.5B: embedding Q4_K, head Q6_K): keep the head's matrix
    for both and write a tied model. Peak memory: the dequantized model in ``dtype``, the GGUF's mapped
    pages and one tensor in float32 (transformers dequantizes tensor by tensor and casts each at once).
    Returns what ``repair_tokenizer`` changed in transformers' rebuild of the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from compress.integrity import from_pretrained_checked

    # transformers draws its own tqdm bars; ours (status lines) are shown instead. Its GGUF reader's bar
    # (plain tqdm) obeys TQDM_DISABLE only when tqdm was not imported yet, so it may still show.
    hf_logging.disable_progress_bar()
    previous = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    try:
        with reporter.status(f"reading the tokenizer of {path.name}"):
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        with reporter.status(f"dequantizing {path.name} to {dtype} (once per file)"):
            # refused: a tensor the architecture needs and the file lacks (never initialised at random), a non-finite value
            gguf_model = from_pretrained_checked(path.parent, path, gguf_file=path.name, dtype=getattr(torch, dtype))
    except ModelLoadError:
        raise
    except Exception as exc:  # transformers' GGUF reader: OSError, ValueError, KeyError, RuntimeError, struct errors …
        raise ModelLoadError(f"transformers could not read {path}: {type(exc).__name__}: {str(exc)[:300]}") from None
    finally:
        if previous is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = previous
    with reporter.status(f"checking the tokenizer against {path.name}'s own"):
        repair = repair_tokenizer(tokenizer, path)
        repair["parity"] = source_parity(tokenizer, path, reporter)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):  # the GGUF origin, not a quantization of the weights written here
        del config.quantization_config
    tensors = gguf_model.state_dict()
    if tie_embeddings:
        names = {id(p): n for n, p in gguf_model.named_parameters(remove_duplicate=False)}
        head = names[id(gguf_model.get_output_embeddings().weight)]
        embedding = names[id(gguf_model.get_input_embeddings().weight)]
        tensors[embedding] = tensors[head]
        config.tie_word_embeddings = True
    with torch.device("meta"):  # a skeleton: the dequantized tensors are assigned, not copied
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(tensors, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = gguf_model.generation_config
    for key in ("bos", "eos"):  # the generation config transformers rebuilt carries the same wrong ids
        if f"{key}_token_id" in repair.get("special_ids", {}):
            setattr(model.generation_config, f"{key}_token_id", repair["special_ids"][f"{key}_token_id"])
    with reporter.status(f"writing the {dtype} safetensors model"):
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return repair


TOKENIZER_REPAIR = 2
"""The version of ``repair_tokenizer``: a cached conversion made by another version is made again."""


def repair_tokenizer(tokenizer: Any, path: Path) -> dict[str, Any]:
    """Make transformers' rebuild of a GGUF file's tokenizer the file's own, in place: transformers
    gives every byte-level BPE file GPT-2's pre-tokenizer and reads BOS/EOS from its own defaults
    (SmolLM2's Q4_1 file says pre-tokenizer ``smollm``, single digits, and EOS 2 ``<|im_end|>``; the
    rebuild split digits GPT-2's way and ended text at 1 ``<|im_start|>``). The pre-tokenizer is set from
    ``tokenizer.ggml.pre`` (the names export/gguf/metadata.py knows), BOS/EOS from the file's ids. Returns
    what changed and what could not be (an unknown pre-tokenizer name is left as transformers made it)."""
    import gguf

    from compress.export.gguf.metadata import PRE_TOKENIZERS, pre_tokenizer_name, pre_tokenizer_of

    fields = gguf.GGUFReader(path).fields

    def value(key: str) -> Any:
        return fields[key].contents() if key in fields else None

    facts: dict[str, Any] = {"model": value(gguf.Keys.Tokenizer.MODEL), "changed": [], "special_ids": {}}
    pre = value(gguf.Keys.Tokenizer.PRE)
    if facts["model"] == "gpt2" and pre is not None:
        backend = tokenizer.backend_tokenizer
        before = json.loads(backend.to_str()).get("pre_tokenizer")
        known = {name: signature for signature, name in PRE_TOKENIZERS.items()}
        if pre not in known:
            facts["unrepaired"] = f"pre-tokenizer '{pre}' is not among {sorted(known)}: left as transformers made it"
        elif pre_tokenizer_name({"pre_tokenizer": before}, strict=False) != pre:
            backend.pre_tokenizer = pre_tokenizer_of(known[pre])
            facts["changed"].append(f"pre-tokenizer set to the file's '{pre}'")
    if facts["model"] == "llama" and gguf.Keys.Tokenizer.SCORES in fields:
        _repair_sentencepiece(tokenizer, value, facts)
    n_vocab = len(tokenizer)
    for key, field in (("bos", gguf.Keys.Tokenizer.BOS_ID), ("eos", gguf.Keys.Tokenizer.EOS_ID)):
        token_id = value(field)
        if token_id is None or not 0 <= int(token_id) < n_vocab:
            continue
        facts["special_ids"][f"{key}_token_id"] = int(token_id)
        text = tokenizer.convert_ids_to_tokens(int(token_id))
        if getattr(tokenizer, f"{key}_token_id") != int(token_id):
            facts["changed"].append(f"{key.upper()} set to the file's {token_id} {text!r} (was {getattr(tokenizer, f'{key}_token')!r})")
            setattr(tokenizer, f"{key}_token", text)
    for key in ("bos", "eos") if facts["model"] == "llama" else ():  # the flags of a SentencePiece file
        add = value(gguf.Keys.Tokenizer.ADD_BOS if key == "bos" else gguf.Keys.Tokenizer.ADD_EOS)
        if add is not None and bool(getattr(tokenizer, f"add_{key}_token", False)) != bool(add):
            setattr(tokenizer, f"add_{key}_token", bool(add))
            facts["changed"].append(f"add_{key}_token set to the file's {bool(add)}")
    return facts


def _repair_sentencepiece(tokenizer: Any, value: Callable[[str], Any], facts: dict[str, Any]) -> None:
    """A SentencePiece file (``tokenizer.ggml.model`` ``llama``) rebuilt without BPE merges (Gemma's): the
    merges made from the file's scores (``spm_bpe``), its control tokens as special tokens and its
    user-defined ones as added tokens, as llama.cpp matches both in the text before joining pieces."""
    import gguf
    from tokenizers import AddedToken

    backend = tokenizer.backend_tokenizer
    model = json.loads(backend.to_str())["model"]
    if model.get("type") == "BPE" and model.get("merges"):
        return
    tokens, scores = value(gguf.Keys.Tokenizer.LIST), value(gguf.Keys.Tokenizer.SCORES)
    types = value(gguf.Keys.Tokenizer.TOKEN_TYPE)
    backend.model = spm_bpe(tokens, scores, types, model)
    kinds = {gguf.TokenType.CONTROL: True, gguf.TokenType.USER_DEFINED: False}
    for kind, special in kinds.items():
        found = [AddedToken(t, normalized=False, special=special) for t, k in zip(tokens, types, strict=True) if k == kind]
        tokenizer.add_tokens(found, special_tokens=special)
    facts["changed"].append(
        f"BPE merges made from the file's {len(tokens)} token scores (the rebuild had none); its control and "
        "user-defined tokens matched first"
    )


def spm_bpe(tokens: list[str], scores: list[float], types: list[int], rebuilt: dict[str, Any]) -> Any:
    """The BPE model of a SentencePiece vocabulary (``tokenizer.ggml.model`` ``llama``: tokens, scores,
    token types), as llama.cpp tokenizes with it: two adjacent pieces join when their join is a token,
    the join with the highest score first. Every split of a token into two tokens is a merge, ranked by
    the joined token's score (control, unknown, byte and user-defined tokens are never joined). transformers 5 rebuilds
    Gemma's GGUF tokenizer as a Unigram on those scores, which saved and loaded again is a BPE without
    merges (Gemma 3 270M's file: every text of the parity corpus tokenized differently, "▁w or ld" for
    "▁world"; once saved, every word split into characters). ``rebuilt``: the rebuild's model JSON,
    whose unknown token, byte fallback and fuse_unk are kept where it has them."""
    import gguf
    from tokenizers.models import BPE

    ids = {token: i for i, token in enumerate(tokens)}
    never = {gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN, gguf.TokenType.BYTE, gguf.TokenType.USER_DEFINED}
    ranked = []
    for i, token in enumerate(tokens):
        if types[i] in never:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, ids[left], left, right))
    ranked.sort()
    return BPE(
        vocab=ids,
        merges=[(left, right) for *_, left, right in ranked],
        unk_token=rebuilt.get("unk_token") or (tokens[rebuilt["unk_id"]] if rebuilt.get("unk_id") is not None else None),
        byte_fallback=bool(rebuilt.get("byte_fallback", True)),
        fuse_unk=bool(rebuilt.get("fuse_unk", True)),
    )


def source_parity(tokenizer: Any, path: Path, reporter: Reporter) -> dict[str, Any] | None:
    """The repaired tokenizer against the GGUF file's own in llama.cpp on the parity corpus (200 KB of
    mixed text, export/parity.py), when llama-cpp-python is installed (None otherwise). A difference
    is a warning naming the first one: the GGUF export checks itself against the file, but the
    artifact's tokenizer files and an ONNX export carry this tokenizer."""
    from compress.export.gguf import runtime as gguf_runtime
    from compress.export.parity import parity_corpus, tokenization_mismatches

    if not gguf_runtime.available():
        return None
    texts = parity_corpus(tokenizer)
    vocab = gguf_runtime.LlamaCppVocab(path)
    try:
        mismatches = tokenization_mismatches(vocab.tokenize, tokenizer, texts)
    finally:
        vocab.close()
    if mismatches:
        reporter.warn(
            f"the tokenizer rebuilt from {path.name} tokenizes {len(mismatches)} of {len(texts)} parity texts differently "
            f"from the file's own in llama.cpp (first: {mismatches[0]}); ONNX exports and the artifact's tokenizer carry the rebuild"
        )
    return {"texts": len(texts), "bytes": sum(len(t.encode()) for t in texts), "mismatched": len(mismatches)}
