"""After step 5: the recipe's tasks (lm-evaluation-harness) on the baseline, the compressed model and each
export on its own runtime, after the exports are written and verified."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from compress import streaming
from compress.eval.metrics import Evaluation, torch_forward
from compress.eval.tasks import TASK_CONTEXT, TaskData, interval, make_lm, run_task
from compress.export.format import package_versions
from compress.plugins import EXPORT_FORMATS
from compress.schema.exports import EXPORTS_DIR
from compress.schema.recipe import TaskConfig
from compress.steps.exports import Exported
from compress.steps.load import Run, Source, work_dir_for
from compress.steps.stages import Staged


def scored_artifacts(run: Run, task: TaskConfig) -> list[str]:
    """What a task scores: its ``artifacts``, or baseline, compressed and every export whose format
    has a runtime of its own."""
    if task.artifacts is not None:
        return list(task.artifacts)
    return ["baseline", "compressed", *(x.name for x in run.recipe.exports if EXPORT_FORMATS[x.format].own_runtime)]


def measure(root: Path, run: Run, source: Source, staged: Staged, exported: Exported) -> list[Evaluation]:
    """One ``task`` evaluation per task and artifact. Each artifact is opened once on its runtime and
    answers all the tasks that score it; an export its runtime cannot run here is reported as such.
    A checkpoint export (compressed-tensors, gptq) holds the compressed model's records: its gates
    read the compressed model's task numbers (export/recipe_exports.py's gate_evaluations)."""
    recipe = run.recipe
    if not recipe.tasks:
        return []
    runtimes = [x.name for x in recipe.exports if EXPORT_FORMATS[x.format].own_runtime]
    wanted = {
        name: [(task, data) for task, data in zip(recipe.tasks, source.tasks, strict=True) if name in scored_artifacts(run, task)]
        for name in ["baseline", "compressed", *runtimes]
    }
    entries = {e["name"]: e for e in exported.entries}
    scratch = work_dir_for(run.out_dir) / "tasks"
    files = {data.name: data.write(scratch / "data") for data in source.tasks}
    evaluations: list[Evaluation] = []
    with run.timed("tasks_s"):
        for artifact, jobs in wanted.items():
            if not jobs:
                continue
            opened = _open(root, run, source, staged, artifact, entries.get(artifact, {}))
            if opened is None:
                run.reporter.warn(f"tasks: {artifact} has no runtime that scores log-likelihoods here; its task accuracy is not measured")
                continue
            forward, close, runtime, device = opened
            try:
                evaluations += score_tasks(
                    forward, jobs, files, scratch / "cache", source.lm.tokenizer, recipe.seed, run.reporter.track, artifact, runtime, device
                )
            finally:
                if close is not None:
                    close()
    return evaluations


def score_tasks(
    forward: Callable[..., Any],
    jobs: list[tuple[TaskConfig, TaskData]],
    files: dict[str, dict[str, str]],
    cache_dir: Path,
    tokenizer: Any,
    seed: int,
    track: Callable[..., Any] | None,
    artifact: str,
    runtime: str,
    device: str,
) -> list[Evaluation]:
    """Each task of ``jobs`` answered by one artifact's ``forward`` (the source model's tokenizer
    encodes every prompt, so every artifact answers the same token ids): one ``task`` evaluation each.
    ``files``: each task's normalized question files (TaskData.write)."""
    prefix = next((i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id) if i is not None), 0)  # before an empty context; padding

    def encode(text: str) -> list[int]:
        return list(tokenizer(text)["input_ids"])

    evaluations = []
    for task, data in jobs:
        lm = make_lm(forward, encode, prefix, track, f"{task.name} on {artifact}")
        result = run_task(task, data, files[data.name], cache_dir, lm, seed)
        evaluations.append(_evaluation(artifact, runtime, device, task, data, result))
    return evaluations


def _open(
    root: Path, run: Run, source: Source, staged: Staged, artifact: str, entry: dict[str, Any]
) -> tuple[Callable[..., Any], Any, str, str] | None:
    """(forward, close, runtime, device) of one artifact; None when nothing here runs it (TensorRT
    without its runtime, an engine not built)."""
    if artifact in ("baseline", "compressed"):
        model = source.baseline if artifact == "baseline" else staged.model
        streaming.to_device(model, run.device)
        return torch_forward(model, run.device), None, "torch", run.device.type
    export = next(x for x in run.recipe.exports if x.name == artifact)
    fmt = EXPORT_FORMATS[export.format]
    where = fmt.timed_path(root / EXPORTS_DIR / artifact, entry)
    opened = None if where is None else fmt.forward(where[0], TASK_CONTEXT, run.threads)
    if where is None or opened is None:
        return None
    forward, close = opened
    return forward, close, fmt.runtime, where[1]


def _evaluation(artifact: str, runtime: str, device: str, task: TaskConfig, data: TaskData, result: Any) -> Evaluation:
    metrics: dict[str, float | int] = {"accuracy": result.accuracy, "questions": result.questions}
    intervals = {"accuracy": interval(result.accuracy, result.stderr, result.questions)}
    if result.stderr is not None:
        metrics["accuracy_stderr"] = result.stderr
    if result.accuracy_norm is not None:
        metrics["accuracy_norm"] = result.accuracy_norm
        intervals["accuracy_norm"] = interval(result.accuracy_norm, result.stderr_norm, result.questions)
        if result.stderr_norm is not None:
            metrics["accuracy_norm_stderr"] = result.stderr_norm
    metrics["questions_per_s"] = result.questions / result.seconds if result.seconds > 0 else 0.0
    details = {
        "task": task.name,
        "kind": task.kind,
        "format": task.format if task.kind == "multiple_choice" else None,
        "source": data.source,
        "questions_sha256": data.sha256,
        "num_fewshot": task.num_fewshot,
        "seconds": result.seconds,
        "forward_passes": result.passes,
        "truncated": result.truncated,
        "harness": "lm-evaluation-harness " + package_versions(["lm-eval"])["lm-eval"],
        "tokenizer": "the source model's (every artifact answers the same token ids)",
    }
    return Evaluation(
        artifact=artifact,
        runtime=runtime,
        device=device,
        metrics=metrics,
        details={k: v for k, v in details.items() if v is not None},
        kind="task",
        intervals={k: v for k, v in intervals.items() if v is not None} or None,
    )
