"""One run, start to end: recipe -> model -> stages -> evaluation -> exports -> tasks -> gates -> artifact.

Each step is a module of compress/steps/ with one job; this file only puts them in order. The
artifact directory is built next to its target and renamed into place when complete, so a run that
fails or is killed leaves nothing, or the previous artifact when overwriting.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compress.errors import EXIT_GATE_FAILED, EXIT_OK
from compress.eval.gates import GateResult
from compress.eval.metrics import Evaluation
from compress.fsutil import atomic_directory
from compress.marker import ARTIFACT
from compress.progress import Reporter
from compress.recipe import LoadedRecipe
from compress.steps import draft, evaluate, exports, load, performance, report, stages, tasks, write


@dataclass
class RunResult:
    out_dir: Path
    manifest: dict[str, Any]
    report: dict[str, Any]
    evaluations: list[Evaluation]
    gates: list[GateResult]

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.passed else EXIT_GATE_FAILED


def run_recipe(
    loaded: LoadedRecipe, out_dir: Path, overwrite: bool = False, reporter: Reporter | None = None, step_summary: bool = True
) -> RunResult:
    """Run a validated recipe end to end and write the artifact directory atomically.

    Under ``accelerate launch`` every process runs the stages up to the last distill stage
    (which trains in all of them); only the main process goes on, and the others return a
    result with no evaluations (``secondary_process``)."""
    run = load.prepare(loaded, out_dir, overwrite, reporter)  # everything the recipe alone can fail on
    try:
        return _run(run, loaded, overwrite, step_summary)
    finally:
        stages.remove_scratch(run)  # the stages' changed weights, records, cached baseline: done or failed


def _run(run: load.Run, loaded: LoadedRecipe, overwrite: bool, step_summary: bool) -> RunResult:
    source = load.load(run)  # the source model (the baseline), tokenizer, data
    with run.timed("stages_s"):
        staged = stages.apply(run, source)  # prune, quantize, distill, … on a copy
    if staged is None:
        return RunResult(run.out_dir, {}, {"secondary_process": run.rank}, [], [])
    exports.check(run, source, staged)  # an export that cannot hold the records fails before the evaluation
    in_memory = evaluate.in_memory(run, source, staged)  # baseline and compressed with torch
    evaluations = list(in_memory.evaluations)
    manifest = write.build_manifest(run, source, staged)
    with atomic_directory(run.out_dir, overwrite, ARTIFACT) as root:
        with run.timed("write_model_s"):
            write.write_model_files(root, run, source, staged)
        exported = exports.write(root, run, source, staged)  # each export verified on its own runtime
        evaluations += exported.evaluations
        drafted = draft.write(root, run, source, staged)  # a draft stage's draft beside the target (draft/)
        evaluations += draft.measure(root, run, source, staged, exported, drafted)  # the pair on each runtime
        if drafted is not None:
            manifest["draft"] = drafted
        evaluations += tasks.measure(root, run, source, staged, exported)  # lm-eval tasks on each artifact's runtime
        host = None
        if performance.wanted(run.recipe):
            write.write_interim_manifest(root, manifest)
            measured, host = performance.measure(root, run, source, staged, exported)
            evaluations += measured
        gates = report.check_gates(run.recipe, evaluations)
        document = report.build_report(run.recipe, evaluations, gates, source.eval_chunks, exported, in_memory, host)
        write.write_documents(root, run, manifest, document, exported, step_summary)
    stages.remove_checkpoints(run)
    return RunResult(run.out_dir, manifest, document, evaluations, gates)
