"""What the runtime verifiers (llama.cpp, ONNX Runtime) share: their inputs, and whether a runtime's
tokenizer agrees with the Hugging Face one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

PARITY_TEXTS = (
    "Hello world! It's 2024-11-21, and the price is $1,234.56 (about 99.9%).",
    "def f(x):\n    return x ** 2  # squared\n\n\tTabs and   spaces,   trailing   ",
    "Ünïcödé: naïve café, 東京, Привет мир, emoji 🙂 and CJK 漢字.",
    "<|im_start|>user\nShall I compare thee to a summer's day?<|im_end|>",
)


@dataclass
class VerifyInputs:
    """What the verifier scores against: the torch baseline and the in-memory compressed model."""

    baseline: nn.Module
    compressed: nn.Module
    chunks: torch.Tensor | None  # evaluation chunks [n, seq_len]; None: no evaluation data in the recipe
    min_context: int
    threads: int


def tokenization_mismatches(
    encode: Callable[[str], list[int]], tokenizer: Any, texts: list[str], runtime: str = "llama.cpp", add_special_tokens: bool = False
) -> list[dict[str, Any]]:
    """Texts on which a runtime's tokenizer (``encode``) and the Hugging Face tokenizer disagree (with the first difference)."""
    bad = []
    for i, text in enumerate(texts):
        ours = encode(text)
        theirs = list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        if ours != theirs:
            at = next((k for k, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
            bad.append({"text": i, "position": at, runtime: ours[at : at + 5], "transformers": theirs[at : at + 5]})
    return bad
