"""What the runtime verifiers (llama.cpp, ONNX Runtime) share: their inputs, the mixed text that
tokenizer parity is checked on, and whether a runtime's tokenizer agrees with the source's."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

PARITY_TEXTS = (
    "Hello world! It's 2024-11-21, and the price is $1,234.56 (about 99.9%).",
    "def f(x):\n    return x ** 2  # squared\n\n\tTabs and   spaces,   trailing   ",
    "Ünïcödé: naïve café, 東京, Привет мир, emoji 🙂 and CJK 漢字.",
    "<|im_start|>user\nShall I compare thee to a summer's day?<|im_end|>",
)


SAME_WEIGHTS_CHUNKS = 2
"""Evaluation rows an export's same-weights check scores (its runtime against the in-memory model
with the same weights); the evaluation keeps the compressed model's hidden states of these rows."""


@dataclass
class VerifyInputs:
    """What the verifier scores against: the baseline (its forward: the run's cached hidden states of
    the source, eval/baseline.py) and the in-memory compressed model (and its forward)."""

    baseline: Callable[[torch.Tensor], Any]
    compressed: nn.Module
    compressed_forward: Callable[[torch.Tensor], Any]
    """The compressed model's forward for the same-weights checks: the rows the evaluation already
    ran come back from memory (eval/baseline.py ``RememberedRows``)."""
    chunks: torch.Tensor | None  # evaluation chunks [n, seq_len]; None: no evaluation data in the recipe
    min_context: int
    threads: int
    source: Path | None = None
    """The source model's own file or folder (``model.source`` resolved): whose tokenizer is the truth
    an export's tokenizer must match (a GGUF source's own tokenizer, not transformers' rebuild of it)."""


# Pieces of the parity corpus, written for it: each category trips a different part of a
# tokenizer (pre-tokenizer splits, byte fallback, digit grouping, whitespace merging, added tokens).
_PROSE = (
    "The committee met on a grey Tuesday morning and, after some argument, agreed to postpone the vote.",
    "She didn't think it'd matter; they'll say we've gone too far, but I'm sure you're right.",
    "A quick brown fox jumps over the lazy dog -- twice, if the dog lets it.",
    '"Well," he said, "that\'s that." Then, quietly: \'Shall we go?\'',
    "Dr. Smith (Ph.D., M.Sc.) arrived at 9 a.m.; the meeting ran until noon... or later!",
)
_CODE = (
    "def mean(xs: list[float]) -> float:\n    if not xs:\n        raise ValueError('empty')\n    return sum(xs) / len(xs)\n",
    "for (int i = 0; i < n; ++i) {\n\tacc += a[i] * b[i];\n}\nreturn acc >> 3;\n",
    '{"name": "compress", "version": "0.1.0", "deps": ["torch>=2.4", "gguf"], "ok": true, "n": null}',
    "layers:\n  - name: q_proj\n    bits: 4   # group 128\n  - name: lm_head\n    bits: 8\n",
    "SELECT id, COUNT(*) AS n FROM runs WHERE kl <= 0.05 GROUP BY id ORDER BY n DESC;",
    "x = [i**2 for i in range(10) if i % 3 != 0]  # ==, !=, <=, >=, ->, :=, **=, //=\n",
)
_SCRIPTS = (
    "Καλημέρα κόσμε, τι κάνεις;",
    "Привет, мир! Как дела у тебя сегодня?",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "שלום עולם, מה שלומך?",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "你好，世界！今天天气很好。",
    "こんにちは世界、カタカナとひらがな。",
    "안녕하세요 세계, 반갑습니다.",
    "สวัสดีชาวโลก",
    "Ünïcödé: naïve café, façade, Øresund, Łódź, Ærø, straße.",
)
_EMOJI = ("🙂", "😂👍", "👩‍💻", "👨‍👩‍👧‍👦", "🇫🇷🇯🇵", "👍🏽", "❤️", "🧪⚗️", "✨🚀", "🏳️‍🌈")


def _numbers(rng: random.Random) -> str:
    y, m, d = rng.randint(1900, 2099), rng.randint(1, 12), rng.randint(1, 28)
    choices = (
        f"{rng.randint(0, 10 ** rng.randint(1, 12))}",
        f"{rng.uniform(-1e4, 1e4):.{rng.randint(1, 6)}f}",
        f"{rng.randint(1000, 10**9):,}",
        f"{y}-{m:02d}-{d:02d}",
        f"{d}/{m}/{y}",
        f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}",
        f"{rng.uniform(0, 100):.1f}%",
        f"0x{rng.getrandbits(32):08x}",
        f"+1 ({rng.randint(200, 999)}) {rng.randint(200, 999)}-{rng.randint(1000, 9999)}",
        f"v{rng.randint(0, 9)}.{rng.randint(0, 20)}.{rng.randint(0, 99)}",
        f"{rng.uniform(1e-9, 1e-3):.3e}",
    )
    return rng.choice(choices)


def _whitespace(rng: random.Random) -> str:
    return rng.choice((" " * rng.randint(2, 9), "\t" * rng.randint(1, 3), "\n" * rng.randint(1, 4), "\r\n", " \n ", "\t \n", "   "))


def parity_corpus(tokenizer: Any = None, min_bytes: int = 200_000, seed: int = 0) -> list[str]:
    """At least ``min_bytes`` of mixed text in pieces of at most about 2 KB: prose, code, numbers and
    dates, whitespace runs, non-Latin scripts, emoji, and, when ``tokenizer`` is given, its special
    tokens and its chat template rendered on a short conversation. Deterministic for a seed."""
    rng = random.Random(seed)
    specials: list[str] = []
    pieces = list(PARITY_TEXTS)
    if tokenizer is not None:
        specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if t]
        if getattr(tokenizer, "chat_template", None):
            messages = [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is 2 + 2?  Answer in one word 🙂"},
                {"role": "assistant", "content": "Four."},
            ]
            try:
                pieces.append(tokenizer.apply_chat_template(messages, tokenize=False))
            except Exception:  # a template that wants other roles or variables: its special tokens are still used below
                pass
    kinds: list[Callable[[], str]] = [
        lambda: rng.choice(_PROSE),
        lambda: rng.choice(_CODE),
        lambda: rng.choice(_SCRIPTS),
        lambda: rng.choice(_EMOJI),
        lambda: _numbers(rng),
        lambda: _whitespace(rng),
    ]
    if specials:
        kinds.append(lambda: rng.choice(specials))
    total = sum(len(p.encode()) for p in pieces)
    while total < min_bytes:
        parts: list[str] = []
        length, target = 0, rng.randint(200, 2000)
        while length < target:
            parts += [rng.choice(kinds)(), rng.choice((" ", " ", " ", "", "\n", ", ", ". "))]
            length += len(parts[-2]) + len(parts[-1])
        piece = "".join(parts)
        pieces.append(piece)
        total += len(piece.encode())
    return pieces


def compare_tokenizers(
    ours: Callable[[str], list[int]],
    truth: Callable[[str], list[int]],
    texts: list[str],
    names: tuple[str, str],
    token_text: Callable[[list[int]], list[str]] | None = None,
) -> list[dict[str, Any]]:
    """The texts on which ``ours`` and ``truth`` tokenize differently, each with its first differing
    position, the next few ids of each side under ``names`` and, with ``token_text``, their strings."""
    bad = []
    for i, text in enumerate(texts):
        a, b = ours(text), truth(text)
        if a != b:
            at = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            found: dict[str, Any] = {"text": i, "position": at, names[0]: a[at : at + 5], names[1]: b[at : at + 5]}
            if token_text is not None:
                found[f"{names[0]} tokens"] = token_text(a[at : at + 5])
                found[f"{names[1]} tokens"] = token_text(b[at : at + 5])
            bad.append(found)
    return bad


def tokenization_mismatches(
    encode: Callable[[str], list[int]], tokenizer: Any, texts: list[str], runtime: str = "llama.cpp", add_special_tokens: bool = False
) -> list[dict[str, Any]]:
    """Texts on which a runtime's tokenizer (``encode``) and the Hugging Face tokenizer disagree (with the first difference)."""

    def hf(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    return compare_tokenizers(encode, hf, texts, (runtime, "transformers"), tokenizer.convert_ids_to_tokens)


TURN_PROBE = "\u00a4turn\u00a4"  # a message text no chat template adds or changes


def turn_end_id(tokenizer: Any) -> int | None:
    """The special token that closes an assistant turn in the tokenizer's chat template (ChatML's
    ``<|im_end|>``, Gemma's ``<end_of_turn>``, Llama 3's ``<|eot_id|>``): the first special token rendered
    after an assistant message. A runtime that does not know it as end-of-turn never stops a chat
    reply. None without a chat template, or when the template closes turns with plain text."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": TURN_PROBE}]
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # a template that wants other roles or variables: no turn end can be read from it
        return None
    after = rendered.split(TURN_PROBE, 1)[1] if TURN_PROBE in rendered else ""
    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if t]
    specials += [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special]
    first = min(((after.find(t), -len(t), t) for t in set(specials) if t in after), default=None)
    if first is None:
        return None
    return int(tokenizer.convert_tokens_to_ids(first[2]))


def special_ids(tokenizer: Any) -> dict[str, int]:
    """The Hugging Face tokenizer's BOS, EOS and end-of-turn ids, those it has."""
    found = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "eot": turn_end_id(tokenizer)}
    return {k: int(v) for k, v in found.items() if v is not None}
