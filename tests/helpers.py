"""Helpers shared by the tests: generated text, a tiny random Llama built from a config, recipes, the CLI,
an independent ridge least-squares solve."""

from __future__ import annotations

import random
import textwrap
from pathlib import Path

WORDS = (
    "the a of and to in is was that it for on with as by at from this be are or an which his her their "
    "king queen lord lady night day light dark sword crown river stone house field garden winter summer "
    "speaks walks holds gives takes finds keeps loses sees hears knows loves fears calls sends brings "
    "quickly slowly softly gravely truly never always often again soon here there where when why how "
    "function module value return class object string number list table index error result version"
).split()


def make_text(seed: int, paragraphs: int) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(paragraphs):
        sentences = []
        for _ in range(rng.randint(3, 7)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(5, 14))]
            sentences.append(" ".join(words).capitalize() + rng.choice([".", ".", "!", "?"]))
        out.append(textwrap.fill(" ".join(sentences), 72))
    return "\n\n".join(out) + "\n"


def build_tiny_llama(directory: Path, texts: list[str], tie: bool = True, hidden: int = 96, layers: int = 2) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden,  # 96: a group of 64 leaves a partial last group of 32
        intermediate_size=160,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def recipe_text(model: Path | str, texts: Path | str, bits: int = 4, group_size: int | None = 64, symmetric: bool = True,
                gates: str = "", samples: int = 6, seq_len: int = 64, extra_stage: str = "") -> str:
    group = "null" if group_size is None else group_size
    return f"""\
version: 1
name: tiny-test
model:
  source: {model}
data:
  calibration:
    source: {texts}
    samples: 4
    seq_len: {seq_len}
  evaluation:
    source: {texts}
    samples: {samples}
    seq_len: {seq_len}
    min_context: 8
stages:
  - quantize:
      method: rtn
      bits: {bits}
      group_size: {group}
      symmetric: {str(symmetric).lower()}
{extra_stage}exports: []
gates:
{gates or "  []"}
"""


def write_recipe(directory: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = directory / name
    path.write_text(text)
    return path


def run_cli(args: list[str]):
    """Invoke the CLI in-process; returns click's Result (exit_code, stdout, stderr, output)."""
    from typer.testing import CliRunner

    from compress.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


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


def ridge_lstsq(a, y, w0, lam: float):
    """W = argmin ||a Wᵀ − y||² + lam ||W − w0||², solved independently of the code under test: lstsq of the
    stacked system [a; √lam I] Wᵀ = [y; √lam w0ᵀ] in float64."""
    import torch

    eye = torch.eye(a.shape[1], dtype=torch.float64)
    lhs = torch.cat([a.double(), float(lam) ** 0.5 * eye])
    rhs = torch.cat([y.double(), float(lam) ** 0.5 * w0.double().T])
    return torch.linalg.lstsq(lhs, rhs).solution.T
