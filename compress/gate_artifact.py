"""`compress gate`: evaluate an existing artifact against a gates file, without re-running
compression, for pipelines. Exit 0 all gates passed, 1 a gate failed, 2 bad input or error.

What can be gated:

* our artifact directory (manifest.json): ``compressed`` is its model (torch, dequantized records)
  and every export by its name (each on its format's runtime: GGUF on llama.cpp, ONNX on ONNX Runtime; checkpoint exports hold
  the same records and read the ``compressed`` evaluation). The baseline defaults to the run's
  model source, and the evaluation text to the run's (same holdout split);
* a file or folder an export format recognizes (its ExportFormat's ``recognizes``: a GGUF file for
  llama.cpp, an ONNX Runtime GenAI folder with genai_config.json) or a Hugging Face
  model folder (torch): gated as ``compressed``; accuracy gates need ``--baseline``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, field_validator, model_validator

from compress.data import DataPlan
from compress.errors import EXIT_GATE_FAILED, EXIT_OK, CompressError
from compress.eval.devices import LOCAL, get_profile, load_profiles
from compress.eval.gates import GateResult, evaluate_gates
from compress.eval.identity import with_build
from compress.eval.latency import LatencySettings, Target, load_torch_model
from compress.eval.metrics import Evaluation, compare, torch_forward
from compress.eval.moe_coverage import expert_coverage
from compress.eval.performance import Timed, baseline_timed, device_evaluations, measure_all, wanted_devices
from compress.export.format import TORCH_RUNTIME
from compress.fsutil import check_target, sha256_file, tree_size
from compress.inputs import check_model_directory
from compress.marker import GATE_REPORT as GATE_REPORT_KIND
from compress.marker import MANIFEST, write_marker
from compress.paths import usable_cpus
from compress.plugins import EXPORT_FORMATS, runtime_formats
from compress.progress import Reporter
from compress.recipe import format_validation_error, parse_yaml, validation_context
from compress.schema.base import Strict, not_a_bool
from compress.schema.devices import DeviceProfile
from compress.schema.manifest import GATE_LISTING_VERSION, GATE_REPORT, GateReportListing
from compress.schema.metrics import ACCURACY_METRICS, DEVICE_METRICS, LATENCY_METRICS
from compress.schema.recipe import DataConfig, GateConfig, LatencyConfig, ModelConfig, TargetConfig, TaskConfig, check_task_gates
from compress.schema.report import REPORT_VERSION
from compress.schema.yamlio import read_text
from compress.verify import check_artifact

DEFAULT_EVALUATION = {"source": "reference:shakespeare", "samples": 16, "seq_len": 512}


class GatesFile(Strict):
    """A gates file: the gates, and optionally the text, latency protocol and devices they need."""

    version: Literal[1] = Field(1, description="Gates file version; this release reads 1.")
    _version_is_a_number = field_validator("version", mode="before")(not_a_bool)
    data: DataConfig | None = Field(
        None, description="Evaluation text (default: the artifact's run's, else 16 x 512 tokens of Shakespeare)."
    )
    latency: LatencyConfig | None = None
    devices: list[DeviceProfile] = Field(default_factory=list)
    targets: list[TargetConfig] = Field(default_factory=list)
    tasks: list[TaskConfig] = Field(
        default_factory=list,
        description="Tasks (as a recipe's `tasks:`; a relative question file is read from the gates file's folder) that task gates name.",
    )
    gates: list[GateConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _latency_needed(self) -> GatesFile:
        timed = [i for i, g in enumerate(self.gates) if g.metric in LATENCY_METRICS]
        if timed and self.latency is None:
            raise ValueError(f"gates{timed} gate latency metrics and need a `latency:` block")
        check_task_gates(self.tasks, self.gates, "the gates file")
        return self


def load_gates_file(path: Path) -> GatesFile:
    from pydantic import ValidationError

    data, lines = parse_yaml(read_text(path, "gates file"), str(path))
    try:
        return GatesFile.model_validate(data, context=validation_context())  # device profiles' names from the table
    except ValidationError as exc:
        raise CompressError(format_validation_error(exc, lines, str(path), GatesFile, "gates file")) from None


@dataclass
class Subject:
    """The artifact under test: what each name is and how to time it."""

    kind: str  # artifact | hf | the export format of a bare file or folder
    timed: list[Timed]
    baseline_source: str | None
    data: dict[str, Any] | None  # the run's data config (artifact directories)
    base_dir: Path
    stand_ins: list[str]  # checkpoint exports that hold the compressed records
    stages: list[tuple[str, dict[str, Any]]] = dataclasses.field(default_factory=list)  # (label, summary) from the manifest
    seed: int = 0  # the run's recipe seed (tasks' few-shot draws), 0 for a bare file or folder


def inspect(path: Path) -> Subject:
    path = path.expanduser().resolve()
    for fmt in EXPORT_FORMATS.values():  # a bare file or folder of a format with a runtime of its own
        if fmt.input_kind is not None and fmt.recognizes(path):
            loaded = fmt.check_input(path)
            return Subject(fmt.name, [Timed("compressed", Target(fmt.runtime, str(loaded)))], None, None, Path.cwd(), [])
    if not path.is_dir():
        raise CompressError(f"{path}: not a compress artifact, {_bare_inputs()} or Hugging Face model folder")
    if (path / MANIFEST).is_file():
        manifest = check_artifact(path, advice="gates are checked only on the files the run wrote").manifest
        if manifest.get("kind") == GATE_REPORT:
            raise CompressError(f"{path} is a gate report, not an artifact; gate the artifact it names: {manifest.get('artifact', '?')}")
        try:
            expanded = manifest["recipe"]["expanded"]
            source, data, recipe_path = expanded["model"]["source"], expanded["data"], manifest["recipe"]["path"]
        except (KeyError, TypeError):
            raise CompressError(
                f"{path / MANIFEST}: not a manifest of this release (no recipe.expanded.model.source); run the recipe again"
            ) from None
        timed = [Timed("compressed", Target("torch", str(path)))]
        stand_ins = []
        for export in manifest.get("exports", []):
            fmt = EXPORT_FORMATS.get(export["format"])
            if fmt is None:
                raise CompressError(
                    f"{path / MANIFEST}: export {export['name']} has format '{export['format']}', which this release does not know"
                )
            if not fmt.own_runtime:
                stand_ins.append(export["name"])  # holds the compressed records: gated on the compressed evaluation
            elif (where := fmt.timed_path(path / export["path"], export)) is not None:
                timed.append(Timed(export["name"], Target(fmt.runtime, str(where[0]), where[1])))
        stages = [(s.get("label", f"stages[{i}]"), s.get("summary")) for i, s in enumerate(manifest.get("stages") or [])]
        seed = expanded.get("seed") if isinstance(expanded.get("seed"), int) else 0
        return Subject("artifact", timed, source, data, Path(recipe_path).expanduser().parent, stand_ins, stages, seed)
    if (path / "config.json").is_file():
        check_model_directory(path)
        return Subject("hf", [Timed("compressed", Target("torch", str(path)))], None, None, Path.cwd(), [])
    raise CompressError(f"{path}: not a compress artifact (manifest.json), {_bare_inputs()} or Hugging Face model folder (config.json)")


def _bare_inputs() -> str:
    """What ``compress gate`` takes besides artifacts and Hugging Face folders, for messages."""
    return ", ".join(fmt.input_kind for fmt in EXPORT_FORMATS.values() if fmt.input_kind is not None)


def check_report_directory(artifact: Path, output: Path, overwrite: bool) -> Path:
    """Refuse a report directory that is the artifact, inside it or holds it (writing it would
    change the artifact's files or replace it); otherwise check it as any output (writable; an
    existing one only with ``overwrite`` and when it is an output of ours, or empty)."""
    subject, target = artifact.expanduser().resolve(), output.expanduser().resolve()
    if target == subject or subject in target.parents:
        raise CompressError(
            f"-o {output}: the gate report would be written into the artifact {artifact} and change its files; "
            "choose a directory outside it (the default is ./gate-report)"
        )
    if target in subject.parents:
        raise CompressError(
            f"-o {output}: the gate report would replace a directory holding the artifact {artifact}; "
            "choose a directory outside it (the default is ./gate-report)"
        )
    return check_target(target, overwrite, GATE_REPORT_KIND)


def write_listing(directory: Path, artifact: Path) -> None:
    """The report directory's manifest.json (each file's SHA-256, so `compress verify` checks it) and,
    last, its marker."""
    files = {str(p.relative_to(directory)): sha256_file(p) for p in sorted(directory.rglob("*")) if p.is_file()}
    listing = {"schema_version": GATE_LISTING_VERSION, "kind": GATE_REPORT, "artifact": str(artifact), "files": files}
    GateReportListing.model_validate(listing)
    (directory / MANIFEST).write_text(json.dumps(listing, indent=2, sort_keys=True) + "\n")
    write_marker(directory, GATE_REPORT_KIND)


@dataclass
class GateRun:
    report: dict[str, Any]
    gates: list[GateResult]

    @property
    def exit_code(self) -> int:
        return EXIT_OK if all(g.passed for g in self.gates) else EXIT_GATE_FAILED


def run_gate(
    artifact: Path,
    gates_file: Path,
    baseline: str | None,
    device: str | None,
    devices_files: list[Path],
    threads: int | None,
    reporter: Reporter,
) -> GateRun:
    gates_cfg = load_gates_file(gates_file)
    # --device: the device of the gates that take one (latency and memory metrics) and name none
    gates = [
        g.model_copy(update={"device": device}) if device is not None and g.device is None and g.metric in DEVICE_METRICS else g
        for g in gates_cfg.gates
    ]
    subject = inspect(artifact)
    names = {t.name for t in subject.timed} | set(subject.stand_ins) | {"baseline"}
    for i, g in enumerate(gates):
        if g.artifact not in names:
            raise CompressError(f"{gates_file}: gates[{i}].artifact '{g.artifact}' is not in {artifact}; known: {', '.join(sorted(names))}")
    profiles = load_profiles(list(devices_files), [p.model_dump() for p in gates_cfg.devices])
    for g in gates:
        if g.device is not None and g.device != LOCAL:
            get_profile(profiles, g.device)  # an unknown name fails here, before any work, with the known names
    threads = threads or usable_cpus()
    torch.set_num_threads(threads)
    wanted = {g.artifact for g in gates} | ({"compressed"} if any(g.artifact in subject.stand_ins for g in gates) else set())
    started = time.perf_counter()
    needs_accuracy = sorted({g.metric for g in gates if g.metric in ACCURACY_METRICS and g.task is None})
    task_gates = [g for g in gates if g.task is not None]
    time_baseline = baseline_timed(gates_cfg.latency, gates)
    baseline_source = baseline or subject.baseline_source
    if baseline_source is None and (needs_accuracy or time_baseline or task_gates):
        why = (
            f"gates on {', '.join(needs_accuracy)}"
            if needs_accuracy
            else "task gates (they tokenize with the source model's tokenizer)"
            if task_gates
            else "latency gates relative to the baseline"
        )
        raise CompressError(f"{why} compare with the source model: pass --baseline MODEL (a model source as in a recipe)")
    lm = None
    if baseline_source is not None and (needs_accuracy or time_baseline or task_gates):
        from compress.models import load_model

        lm = load_model(ModelConfig(source=baseline_source), subject.base_dir, reporter)
    evaluations: list[Evaluation] = []
    eval_facts = None
    prompts = None
    if needs_accuracy:
        assert lm is not None
        evaluations, eval_facts, prompts = _accuracy(subject, wanted, lm, gates_cfg, threads, reporter)
    if task_gates:
        assert lm is not None
        evaluations += _tasks(subject, task_gates, lm, gates_cfg, gates_file.parent, threads, reporter)
    timed = [t for t in subject.timed if t.name in wanted]
    if time_baseline:
        from compress.steps.load import baseline_directory

        assert lm is not None
        timed.insert(0, Timed("baseline", Target("torch", baseline_directory(lm.facts))))
    host = None
    settings = None
    measured: list[Evaluation] = []
    if gates_cfg.latency is not None:
        lat = gates_cfg.latency
        settings = LatencySettings(lat.prompt_tokens, lat.output_tokens, tuple(lat.batch_sizes), lat.warmup, lat.repeats, threads)
        if prompts is None or prompts.shape[1] < lat.prompt_tokens:  # no evaluation text was tokenized: seeded random ids
            prompts = np.random.default_rng(0).integers(10, 256, size=(max(lat.batch_sizes), lat.prompt_tokens))
        measured, host = measure_all(timed, settings, prompts, reporter)
        evaluations += measured
    devices = wanted_devices(gates_cfg.latency, gates_cfg.targets, gates)
    if devices:
        evaluations += device_evaluations(profiles, devices, timed, measured, settings, _params(timed))
    compressed = [e for e in evaluations if e.artifact == "compressed" and e.kind in ("accuracy", "task")]
    evaluations += [dataclasses.replace(e, artifact=name) for name in subject.stand_ins for e in compressed]
    evaluations += expert_coverage(subject.stages, "cpu")  # an MoE artifact's calibration coverage, from its manifest
    results = evaluate_gates(gates, evaluations)
    report = {
        "schema_version": REPORT_VERSION,
        "recipe": "compress gate",
        "passed": all(g.passed for g in results),
        "evaluations": [with_build(e).to_json() for e in evaluations],
        "gates": [g.to_json() for g in results],
        "evaluation_data": eval_facts,
        "artifact": {
            "path": str(artifact),
            "kind": subject.kind,
            "baseline": baseline_source,
            "gates_file": str(gates_file),
            "seconds": round(time.perf_counter() - started, 3),
        },
    }
    if host is not None:
        report["host"] = host
    return GateRun(report, results)


def _open_forward(target: Any, seq_len: int, threads: int) -> tuple[Any, Any] | None:
    """An artifact's forward on its own runtime and what closes it (None for torch), or None for a runtime
    scored only by its export's verifier."""
    if target.runtime == TORCH_RUNTIME:
        return torch_forward(load_torch_model(Path(target.path), dtype=torch.float32), torch.device("cpu")), None
    return runtime_formats()[target.runtime].forward(Path(target.path), seq_len, threads)


def _accuracy(
    subject: Subject, wanted: set[str], lm: Any, gates_cfg: GatesFile, threads: int, reporter: Reporter
) -> tuple[list[Evaluation], dict[str, Any], Any]:
    """The baseline and every wanted artifact on the evaluation text, each on its runtime."""
    if gates_cfg.data is not None:
        data_cfg = gates_cfg.data
    elif subject.data is not None and subject.data.get("evaluation"):
        data_cfg = DataConfig.model_validate(subject.data)
    else:
        data_cfg = DataConfig(evaluation=DEFAULT_EVALUATION)
    if data_cfg.evaluation is None:
        raise CompressError("the gates file's data has no evaluation text")
    chunks = DataPlan.load(data_cfg, subject.base_dir, reporter).chunks("evaluation", lm.tokenizer)
    cpu = torch.device("cpu")
    candidates: dict[str, Any] = {}
    closers = []
    details: dict[str, dict[str, Any]] = {}
    seq_len = int(chunks.tokens.shape[1])
    for item in subject.timed:
        if item.name not in wanted:
            continue
        target = item.target
        found = _open_forward(target, seq_len, threads)
        if found is None:
            continue  # a runtime scored only by its export's verifier (a TensorRT engine, on the GPU it was built for)
        candidates[item.name], close = found
        if close is not None:
            closers.append(close)
        details[item.name] = {"runtime": target.runtime, "path": target.path}
    min_context = data_cfg.evaluation.min_context
    try:
        metrics = compare(torch_forward(lm.model, cpu), candidates, chunks.tokens, min_context, progress=reporter.track)
    finally:
        for close in closers:
            close()
    info = {"chunks": int(chunks.tokens.shape[0]), "seq_len": seq_len, "min_context": min_context}
    evaluations = [Evaluation(artifact="baseline", runtime="torch", device="cpu", metrics=metrics["baseline"], details=info)]
    for name, d in details.items():
        if d["runtime"] != "torch":  # a deployable file or folder: its size goes next to its accuracy (the KL-against-size plot)
            metrics[name]["size_mb"] = tree_size(Path(d["path"])) / 2**20
        evaluations.append(Evaluation(artifact=name, runtime=d["runtime"], device="cpu", metrics=metrics[name], details={**info, **d}))
    facts = {k: chunks.facts[k] for k in ("source", "tokens_sha256", "samples", "seq_len")}
    return evaluations, facts, chunks.tokens.numpy()


def _tasks(
    subject: Subject, gates: list[GateConfig], lm: Any, gates_cfg: GatesFile, base_dir: Path, threads: int, reporter: Reporter
) -> list[Evaluation]:
    """The tasks the gates name, on every artifact they gate (a checkpoint export on the compressed
    model, whose records it holds) and on the baseline when a gate compares with it, each artifact
    on its own runtime: compress run's task scoring (compress/steps/tasks.py) on an existing artifact."""
    import tempfile

    from compress.eval.tasks import TASK_CONTEXT, load_task
    from compress.schema.recipe import BASELINE_THRESHOLDS
    from compress.steps.tasks import score_tasks

    names = {g.task for g in gates}
    tasks = [t for t in gates_cfg.tasks if t.name in names]
    with reporter.status(f"reading the questions of {len(tasks)} task(s)"):
        data = [load_task(t, base_dir, reporter) for t in tasks]
    wanted = {"compressed" if g.artifact in subject.stand_ins else g.artifact for g in gates}
    if any(g.threshold_kind in BASELINE_THRESHOLDS for g in gates):
        wanted.add("baseline")
    targets = {t.name: t.target for t in subject.timed}
    cpu = torch.device("cpu")
    evaluations: list[Evaluation] = []
    with tempfile.TemporaryDirectory(prefix="compress-gate-tasks-") as tmp:
        files = {d.name: d.write(Path(tmp) / "data") for d in data}
        for artifact in sorted(wanted, key=lambda n: (n != "baseline", n)):
            close = None
            if artifact == "baseline":
                forward, runtime = torch_forward(lm.model, cpu), TORCH_RUNTIME
            else:
                runtime = targets[artifact].runtime
                found = _open_forward(targets[artifact], TASK_CONTEXT, threads)
                if found is None:
                    reporter.warn(f"tasks: {artifact} has no runtime that scores log-likelihoods here; its task accuracy is not measured")
                    continue
                forward, close = found
            jobs = [(t, d) for t, d in zip(tasks, data, strict=True) if t.artifacts is None or artifact in t.artifacts]
            try:
                evaluations += score_tasks(
                    forward, jobs, files, Path(tmp) / "cache", lm.tokenizer, subject.seed, reporter.track, artifact, runtime, "cpu"
                )
            finally:
                if close is not None:
                    close()
    return evaluations


def _params(timed: list[Timed]) -> int:
    """Parameter count for prefill estimates, from the files of the first artifact that has one."""
    from compress.eval.latency import parameter_count

    for item in timed:
        if (count := parameter_count(item.target)) is not None:
            return count
    raise CompressError("estimates need a parameter count, and none of the artifacts' files gives one (a TensorRT engine alone)")
