"""Helpers shared by the tests: generated text, recipes, the CLI, an independent ridge least-squares solve.
The tiny models are built in tests/tiny.py."""

from __future__ import annotations

import random
import textwrap
from pathlib import Path

from compress.paths import usable_cpus

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


def recipe_text(
    model: Path | str,
    texts: Path | str,
    bits: int = 4,
    group_size: int | None = 64,
    symmetric: bool = True,
    gates: str = "",
    samples: int = 6,
    seq_len: int = 64,
    extra_stage: str = "",
    cal_samples: int = 4,
) -> str:
    group = "null" if group_size is None else group_size
    return f"""\
version: 1
name: tiny-test
model:
  source: {model}
data:
  calibration:
    source: {texts}
    samples: {cal_samples}
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


def run_gguf_bench(out: Path, model_dir: Path, text_dir: Path, candidates: str, extra: tuple[str, ...] = ()) -> dict:
    """`compress bench gguf` on a tiny model with small data (4 x 64 calibration, 2 x 64 evaluation, 8
    decoded tokens, one repeat, 2 threads, then ``extra`` options); its results.json, after checking it
    exited 0."""
    import json

    args = ["bench", "gguf", "-o", out, "--model", str(model_dir), "--calibration", str(text_dir), "--evaluation", str(text_dir)]
    args += ["--cal-samples", "4", "--cal-seq-len", "64", "--eval-samples", "2", "--eval-seq-len", "64", "--repeats", "1"]
    args += ["--decode-tokens", "8", "--threads", str(usable_cpus()), "--candidates", candidates, *extra]
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    return json.loads((out / "results.json").read_text())


def run_cli(args: list[str]):
    """Invoke the CLI in-process; returns click's Result (exit_code, stdout, stderr, output)."""
    from typer.testing import CliRunner

    from compress.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def ridge_lstsq(a, y, w0, lam: float):
    """W = argmin ||a Wᵀ − y||² + lam ||W − w0||², solved independently of the code under test: lstsq of the
    stacked system [a; √lam I] Wᵀ = [y; √lam w0ᵀ] in float64."""
    import torch

    eye = torch.eye(a.shape[1], dtype=torch.float64)
    lhs = torch.cat([a.double(), float(lam) ** 0.5 * eye])
    rhs = torch.cat([y.double(), float(lam) ** 0.5 * w0.double().T])
    return torch.linalg.lstsq(lhs, rhs).solution.T
