"""Step 1: check what can be checked before any weight is read, then load the source model and the data."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compress.calibration_checks import CalibrationChecker, check_text
from compress.data import Chunks, DataPlan
from compress.distill.train import process_rank
from compress.errors import CompressError, RecipeError
from compress.eval.baseline import CachedBaseline
from compress.eval.devices import LOCAL, get_profile, load_profiles
from compress.eval.memory import PhaseMemory
from compress.eval.performance import baseline_timed, wanted_devices
from compress.fsutil import check_target, claim_work_directory
from compress.marker import ARTIFACT, WORK
from compress.models import LoadedModel, load_model
from compress.paths import usable_cpus
from compress.plugins import STAGE_KINDS, stage_kind
from compress.progress import Reporter
from compress.recipe import LoadedRecipe
from compress.schema.recipe import ModelConfig, Recipe


@dataclass
class Run:
    """What every step of one run reads: the recipe, where the artifact goes, how progress is shown,
    the compute settings fixed before any weight is read, and the seconds each step took."""

    loaded: LoadedRecipe
    out_dir: Path
    overwrite: bool
    reporter: Reporter
    rank: int
    world: int
    device: torch.device
    threads: int
    started: float = field(default_factory=time.perf_counter)
    timings: dict[str, float] = field(default_factory=dict)
    memory: PhaseMemory = field(default_factory=PhaseMemory)

    @property
    def recipe(self) -> Recipe:
        return self.loaded.recipe

    @property
    def base_dir(self) -> Path:
        return self.loaded.base_dir

    @contextmanager
    def timed(self, key: str, record: bool = True) -> Iterator[None]:
        """Time the block into ``timings[key]`` (the manifest's timings) and measure its peak memory
        (report.json's ``memory``, phase ``key`` without ``_s``) when ``record``."""
        if not record:
            yield
            return
        t = time.perf_counter()
        with self.memory.phase(key.removesuffix("_s"), self.device):
            yield
        self.timings[key] = time.perf_counter() - t


@dataclass
class Source:
    """The source model (the baseline: it stays on the CPU and is never changed), its tokenizer and
    facts, the data plan, the evaluation chunks, and the calibration chunks once a stage asks."""

    lm: LoadedModel
    data: DataPlan
    eval_chunks: Chunks | None
    reporter: Reporter
    baseline_forward: CachedBaseline
    """The baseline's side of every comparison: its final hidden states, computed once per row (eval/baseline.py)."""
    calibration: Chunks | None = None
    checks: CalibrationChecker | None = None
    """The recipe's calibration sanity checks (compress/calibration_checks.py): the text's when it is
    tokenized, the model's by the calibrated quantizers; None without a data.calibration section."""
    tasks: list[Any] = field(default_factory=list)
    """The recipe's task question sets, read and checked before any stage runs (compress/eval/tasks.py's TaskData)."""

    @property
    def baseline(self) -> torch.nn.Module:
        return self.lm.model

    def calibration_tokens(self) -> torch.Tensor:
        """The calibration text, tokenized the first time a stage asks for it."""
        if self.calibration is None:
            with self.reporter.status("tokenizing calibration text"):
                self.calibration = self.data.chunks("calibration", self.lm.tokenizer)
            if self.checks is not None:
                with self.reporter.status("checking the calibration text (near duplicates, padding)"):
                    check_text(self.checks, self.calibration.tokens, self.lm.tokenizer)
        return self.calibration.tokens


def work_dir_for(out_dir: Path) -> Path:
    """A run's scratch and resumable state (training checkpoints, the stages' changed weights, the
    baseline's cached hidden states) lives next to its artifact until it is written."""
    return out_dir.with_name(out_dir.name + ".work")


def resolve_device(name: str, key: str = "compute.device") -> torch.device:
    """``name`` (cpu, cuda or auto) as a torch device; ``key`` names the setting in the error."""
    if name == "cuda" and not torch.cuda.is_available():
        raise CompressError(f"{key} is cuda, but torch sees no CUDA device; use cpu or auto")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def check_shapes_early(loaded: LoadedRecipe) -> None:
    """Settings that cannot fit the model (a group wider than every layer) fail before any weight
    is read, from the model's config alone; a source whose config cannot be read that way is
    checked by the stage itself once loaded."""
    recipe = loaded.recipe
    if not any(stage_kind(st.kind).quantizes_weights and getattr(st.config, "group_size", None) for st in recipe.stages):
        return
    from compress.eval.plan.artifacts import check_group_sizes, final_shape, model_shape

    try:
        shape = final_shape(recipe, model_shape(recipe.model, loaded.base_dir))
    except CompressError:
        return
    check_group_sizes(recipe, shape)


def prepare(loaded: LoadedRecipe, out_dir: Path, overwrite: bool, reporter: Reporter | None) -> Run:
    """Everything that can fail from the recipe alone fails here, before any heavy work: a run in
    several processes without a training stage, an existing output, an unknown device, a group
    wider than every layer. Then the seed, the thread count and the device are fixed."""
    recipe = loaded.recipe
    rank, world = process_rank()
    if world > 1 and not any(stage_kind(st.kind).trains for st in recipe.stages):
        trained = ", ".join(name for name, kind in STAGE_KINDS.items() if kind.trains)
        raise CompressError(
            f"this run has {world} processes, but only {trained} stages train in several processes; "
            "run it as a single process (compress run …)"
        )
    reporter = Reporter(quiet=True) if rank > 0 else (reporter or Reporter())
    out_dir = Path(out_dir)
    check_target(out_dir, overwrite, ARTIFACT)  # atomic_directory checks again at the end
    devices = [name for name in wanted_devices(recipe.latency, recipe.targets, recipe.gates) if name != LOCAL]
    if devices:  # profiles are read only when a run names a device
        profiles = load_profiles(extra=[p.model_dump() for p in recipe.devices])
        for name in devices:
            get_profile(profiles, name)
    check_shapes_early(loaded)
    run = Run(
        loaded,
        out_dir,
        overwrite,
        reporter,
        rank,
        world,
        resolve_device(recipe.compute.device),
        recipe.compute.threads or usable_cpus(),
    )
    claim_work_directory(work_dir_for(out_dir), WORK)  # last: a run that fails here leaves nothing behind
    seed_everything(recipe.seed)
    torch.set_num_threads(run.threads)
    return run


def load(run: Run) -> Source:
    """The source model and tokenizer, the data plan and the evaluation chunks."""
    recipe = run.recipe
    with run.timed("load_model_s"):
        lm = load_model(recipe.model, run.base_dir, run.reporter)
        check_latency_fits(recipe, lm.model.config)
        if baseline_timed(recipe.latency, recipe.gates):
            baseline_directory(lm.facts)  # fails now, before the stages, when the baseline cannot be timed
    with run.timed("prepare_data_s"):
        data = DataPlan.load(recipe.data, run.base_dir, run.reporter)
        eval_chunks = data.chunks("evaluation", lm.tokenizer) if recipe.data.evaluation else None
    cached = CachedBaseline(lm.model, run.device, work_dir_for(run.out_dir) / "baseline", lm.facts.get("sha256"))
    checks = CalibrationChecker(recipe.data.calibration.checks, run.reporter) if recipe.data.calibration else None
    tasks = []
    if recipe.tasks:  # a bad question file fails here, before the stages
        from compress.eval.tasks import load_task

        with run.reporter.status(f"reading the questions of {len(recipe.tasks)} task(s)"):
            tasks = [load_task(task, run.base_dir, run.reporter) for task in recipe.tasks]
    return Source(lm, data, eval_chunks, run.reporter, cached, checks=checks, tasks=tasks)


def check_latency_fits(recipe: Recipe, config: Any) -> None:
    """The latency block's prompt and output tokens within the model's context length (before the stages)."""
    latency = recipe.latency
    context = getattr(getattr(config, "text_config", None) or config, "max_position_embeddings", None)
    if latency is not None and isinstance(context, int) and latency.prompt_tokens + latency.output_tokens > context:
        raise RecipeError(
            f"latency: prompt_tokens + output_tokens = {latency.prompt_tokens + latency.output_tokens:,}, more than the model's "
            f"context length ({context:,}, max_position_embeddings); give fewer"
        )


def baseline_directory(model_facts: dict[str, Any]) -> str:
    """The source model as a float Hugging Face directory the torch worker can load (to time it)."""
    if model_facts.get("converted_cache"):  # a GGUF source, converted once to float
        return str(model_facts["converted_cache"])
    path = model_facts.get("path")
    if path and (Path(path) / "config.json").is_file() and not model_facts.get("quantized_checkpoint"):
        return str(path)
    raise CompressError(
        f"latency: the baseline ({model_facts.get('source')}) is not a float Hugging Face directory the torch "
        "worker can load; time the compressed model and the exports only (latency.artifacts), and use max/min "
        "thresholds rather than ones relative to the baseline"
    )


def load_teacher(run: Run, source: str) -> torch.nn.Module:
    """A distillation teacher other than the source model, in the recipe's dtype."""
    return load_model(ModelConfig(source=source, dtype=run.recipe.model.dtype), run.base_dir, run.reporter).model
