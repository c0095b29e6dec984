"""Step 6: latency measured here (the recipe's ``latency`` block) on the artifact being written, its
exports and the baseline, and the estimates for the named devices."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from compress.data import Chunks
from compress.eval.devices import load_profiles
from compress.eval.latency import LatencySettings, Target
from compress.eval.metrics import Evaluation
from compress.eval.performance import Timed, baseline_timed, device_evaluations, measure_all, wanted_devices
from compress.plugins import EXPORT_FORMATS
from compress.progress import Reporter
from compress.schema.exports import EXPORTS_DIR
from compress.schema.recipe import Recipe
from compress.steps.exports import Exported
from compress.steps.load import Run, Source, baseline_directory
from compress.steps.stages import Staged


def wanted(recipe: Recipe) -> bool:
    """Whether the run measures or estimates anything: a latency block, or a named device."""
    return recipe.latency is not None or bool(wanted_devices(recipe.latency, recipe.targets, recipe.gates))


def measure(root: Path, run: Run, source: Source, staged: Staged, exported: Exported) -> tuple[list[Evaluation], dict[str, Any] | None]:
    """The latency and device evaluations, and the host the latency was measured on (None when
    nothing was measured here). The torch worker reads the quantized layers' schemes from the
    interim manifest.json the caller wrote under ``root``."""
    recipe = run.recipe
    timed = timed_artifacts(recipe, root, exported.entries, source.lm.facts, run.device.type)
    with run.timed("latency_s"):
        return performance_evaluations(recipe, timed, source.eval_chunks, staged.model, run.threads, run.reporter)


def timed_artifacts(
    recipe: Recipe, root: Path, exports: list[dict[str, Any]], model_facts: dict[str, Any], torch_device: str = "cpu"
) -> list[Timed]:
    """What the latency block times: compressed (torch, on the artifact being written), the
    runtime exports (llama.cpp on the GGUF file, ONNX Runtime GenAI on the ONNX folder, TensorRT on
    a built engine), and the baseline (torch, on the source model's float directory) when named or
    when a gate compares a latency metric with it."""
    latency = recipe.latency
    names = latency.artifacts if latency is not None and latency.artifacts is not None else None
    by_name = {e["name"]: e for e in exports}
    timed = []
    if baseline_timed(recipe.latency, recipe.gates):
        timed.append(Timed("baseline", Target("torch", baseline_directory(model_facts), torch_device)))
    if names is None or "compressed" in names:
        timed.append(Timed("compressed", Target("torch", str(root), torch_device)))
    for x in recipe.exports:
        if names is not None and x.name not in names:
            continue
        fmt = EXPORT_FORMATS[x.format]
        where = fmt.timed_path(root / EXPORTS_DIR / x.name, by_name[x.name])  # None: nothing of it to time here
        if where is not None:
            timed.append(Timed(x.name, Target(fmt.runtime, str(where[0]), where[1])))
    return timed


def performance_evaluations(
    recipe: Recipe, timed: list[Timed], eval_chunks: Chunks | None, model: torch.nn.Module, threads: int, reporter: Reporter
) -> tuple[list[Evaluation], dict[str, Any] | None]:
    """Latency measured here (the ``latency`` block) and the evaluations for named devices."""
    profiles = load_profiles(extra=[p.model_dump() for p in recipe.devices])
    latency = recipe.latency
    measured: list[Evaluation] = []
    host = None
    settings = None
    if latency is not None:
        settings = LatencySettings(
            latency.prompt_tokens, latency.output_tokens, tuple(latency.batch_sizes), latency.warmup, latency.repeats, threads
        )
        measured, host = measure_all(
            timed, settings, latency_prompts(eval_chunks, latency.prompt_tokens, max(latency.batch_sizes), recipe.seed), reporter
        )
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return measured + device_evaluations(
        profiles, wanted_devices(recipe.latency, recipe.targets, recipe.gates), timed, measured, settings, params
    ), host


def latency_prompts(chunks: Chunks | None, length: int, rows: int, seed: int) -> np.ndarray:
    """Prompts for the latency runs: the evaluation text's first tokens (real text), else seeded random ids."""
    if chunks is not None and chunks.tokens.shape[1] >= length:
        return chunks.tokens[:rows, :length].numpy()
    return np.random.default_rng(seed).integers(10, 256, size=(rows, length))
