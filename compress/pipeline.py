"""The pipeline: recipe -> model -> stages -> evaluation -> gates -> artifact directory."""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel

from compress import __version__
from compress.artifact import WEIGHTS_FORMAT, checksums, stored_as, write_model
from compress.context import RunContext, Stage, StageRecord
from compress.data import Chunks, DataPlan
from compress.distill.train import process_rank
from compress.errors import EXIT_GATE_FAILED, EXIT_OK, CompressError
from compress.eval.devices import LOCAL, get_profile, load_profiles
from compress.eval.gates import Evaluation, GateResult, evaluate_gates
from compress.eval.kv_eval import evaluate_kv
from compress.eval.latency import LatencySettings, Target, tree_size
from compress.eval.metrics import compare, torch_forward
from compress.eval.performance import Timed, baseline_timed, device_evaluations, measure_all, wanted_devices
from compress.eval.reports import write_reports
from compress.export.parity import VerifyInputs
from compress.export.registry import check_exports, gate_evaluations, report_entries, write_exports
from compress.export.specs import EXPORTS_DIR
from compress.fsutil import atomic_directory, check_target
from compress.models import load_model
from compress.plugins import EXPORT_FORMATS, STAGE_KINDS, quant_method, stage_kind
from compress.progress import Reporter
from compress.recipe import KV_CACHE_ARTIFACT, LoadedRecipe, ModelSpec, Recipe
from compress.schema.manifest import MANIFEST_VERSION, Manifest
from compress.schema.report import REPORT_VERSION, Report

VERSIONED_PACKAGES = ("torch", "transformers", "safetensors", "tokenizers", "numpy", "pydantic", "accelerate")  # + each export format's


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


def build_stages(recipe: Recipe) -> list[Stage]:
    """One Stage per recipe stage, built by its kind's spec (compress.plugins.STAGE_KINDS); a kind
    or quantization method missing from the tables is a CompressError naming the known ones."""
    return [stage_kind(spec.kind, f"stages[{i}]").build(spec.config, f"stages[{i}]") for i, spec in enumerate(recipe.stages)]


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise CompressError("compute.device is cuda, but torch sees no CUDA device; use cpu or auto")
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
    from compress.eval.plan_sizes import check_group_sizes, final_shape, model_shape

    try:
        shape = final_shape(recipe, model_shape(recipe.model, loaded.base_dir))
    except CompressError:
        return
    check_group_sizes(recipe, shape)


def work_dir_for(out_dir: Path) -> Path:
    """Resumable state of a run (training checkpoints) lives next to its artifact until it is written."""
    return out_dir.with_name(out_dir.name + ".work")


def run_recipe(
    loaded: LoadedRecipe, out_dir: Path, overwrite: bool = False, reporter: Reporter | None = None, step_summary: bool = True
) -> RunResult:
    """Run a validated recipe end to end and write the artifact directory atomically.

    Under ``accelerate launch`` every process runs the stages up to the last distill stage
    (which trains in all of them); only the main process goes on, and the others return a
    result with no evaluations (``secondary``)."""
    recipe, base_dir = loaded.recipe, loaded.base_dir
    rank, world = process_rank()
    last_trained = max((i for i, st in enumerate(recipe.stages) if stage_kind(st.kind).trains), default=None)
    if world > 1 and last_trained is None:
        trained = ", ".join(name for name, spec in STAGE_KINDS.items() if spec.trains)
        raise CompressError(
            f"this run has {world} processes, but only {trained} stages train in several processes; "
            "run it as a single process (compress run …)"
        )
    reporter = Reporter(quiet=True) if rank > 0 else (reporter or Reporter())
    out_dir = Path(out_dir)
    check_target(out_dir, overwrite)  # before any heavy work; atomic_directory checks again at the end
    devices = [name for name in wanted_devices(recipe.latency, recipe.targets, recipe.gates) if name != LOCAL]
    if devices:  # an unknown device fails now, with the known names (profiles are read only when a run names a device)
        profiles = load_profiles(extra=[p.model_dump() for p in recipe.devices])
        for name in devices:
            get_profile(profiles, name)
    check_shapes_early(loaded)
    started = time.perf_counter()
    seed_everything(recipe.seed)
    threads = recipe.compute.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    device = resolve_device(recipe.compute.device)
    timings: dict[str, float] = {}

    t = time.perf_counter()
    lm = load_model(recipe.model, base_dir, reporter)
    baseline = lm.model  # stays on the CPU; layer-wise stages move one block at a time, evaluation moves whole models
    if baseline_timed(recipe.latency, recipe.gates):
        baseline_directory(lm.facts)  # fails now, before the stages, when the baseline cannot be timed
    timings["load_model_s"] = time.perf_counter() - t

    t = time.perf_counter()
    data = DataPlan.load(recipe.data, base_dir, reporter)
    eval_chunks = data.chunks("evaluation", lm.tokenizer) if recipe.data.evaluation else None
    timings["prepare_data_s"] = time.perf_counter() - t
    calibration: dict[str, Chunks] = {}

    def calibration_tokens() -> torch.Tensor:
        if "chunks" not in calibration:
            with reporter.status("tokenizing calibration text"):
                calibration["chunks"] = data.chunks("calibration", lm.tokenizer)
        return calibration["chunks"].tokens

    stages = build_stages(recipe)
    model = copy.deepcopy(baseline) if stages else baseline

    def load_teacher(source: str) -> torch.nn.Module:
        return load_model(ModelSpec(source=source, dtype=recipe.model.dtype), base_dir, reporter).model

    ctx = RunContext(
        seed=recipe.seed,
        device=device,
        tokenizer=lm.tokenizer,
        reporter=reporter,
        calibration=calibration_tokens,
        text=data.text_for(lm.tokenizer, base_dir, reporter),
        original=baseline,
        work_dir=work_dir_for(out_dir),
        load_teacher=load_teacher,
        run_id=hashlib.sha256(f"{recipe.sha256()}|{lm.facts.get('sha256')}".encode()).hexdigest(),
    )
    ctx.quantized.update(lm.quantized)  # layers of an imported quantized checkpoint are quantized already
    ctx.quantized_by.update(dict.fromkeys(lm.quantized, "model.source"))
    records: list[StageRecord] = []
    for i, stage in enumerate(stages):
        records.append(stage.apply(model, ctx))
        ctx.applied.append(recipe.stages[i].kind)
        if rank > 0 and i == last_trained:  # the main process evaluates, exports and writes
            return RunResult(out_dir, {}, {"secondary_process": rank}, [], [])
    ctx.teacher = ctx.mapping = None  # a pre-pruning copy is not needed past the stages
    check_exports(recipe.exports, model, ctx.quantized, eval_chunks is not None)  # before evaluation: fail fast on an impossible export

    evaluations: list[Evaluation] = []
    if eval_chunks is not None:
        t = time.perf_counter()
        evaluations = evaluate_in_memory(baseline, model if stages else None, eval_chunks, recipe, device, reporter)
        timings["evaluate_s"] = time.perf_counter() - t
    kv_report = None
    if ctx.kv_cache is not None:
        t = time.perf_counter()
        kv_eval, kv_report = evaluate_kv_stage(model, ctx, data, lm.tokenizer, recipe, device, reporter)
        evaluations += kv_eval
        timings["evaluate_kv_cache_s"] = time.perf_counter() - t

    manifest = build_manifest(loaded, lm.facts, baseline, data, eval_chunks, calibration.get("chunks"), records, ctx, device, threads)
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        with reporter.status(f"writing artifact {out_dir}"):
            ctx.quantized.update(write_model(tmp, model, lm.tokenizer, ctx.quantized))  # exports pack the records read back from model/
            (tmp / "recipe.yaml").write_text(loaded.text)
            write_stage_files(tmp, ctx.files)
        t = time.perf_counter()
        baseline.to("cpu")
        model.to("cpu")
        inputs = VerifyInputs(
            baseline,
            model,
            None if eval_chunks is None else eval_chunks.tokens,
            recipe.data.evaluation.min_context if recipe.data.evaluation else 1,
            threads,
        )
        exports, runtime_evaluations = write_exports(
            tmp / EXPORTS_DIR, recipe.exports, model, lm.tokenizer, ctx.quantized, reporter, inputs, ctx.kv_cache
        )
        if recipe.exports:
            timings["exports_s"] = time.perf_counter() - t
        for ev in runtime_evaluations:  # the deployable's size next to its accuracy (the KL-against-size plot)
            ev.metrics["size_mb"] = tree_size(tmp / EXPORTS_DIR / ev.artifact) / 2**20
        evaluations += runtime_evaluations
        host = None
        timed = timed_artifacts(recipe, tmp, exports, lm.facts, device.type)
        if recipe.latency is not None or wanted_devices(recipe.latency, recipe.targets, recipe.gates):
            write_document(tmp / "manifest.json", manifest, Manifest)  # the torch worker reads the quantized layers' schemes from it
            t = time.perf_counter()
            found, host = performance_evaluations(recipe, timed, eval_chunks, model, threads, reporter)
            evaluations += found
            timings["latency_s"] = time.perf_counter() - t
        gates = evaluate_gates(recipe.gates, gate_evaluations(evaluations, recipe.exports))
        report = build_report(recipe, evaluations, gates, eval_chunks)
        if host is not None:
            report["host"] = host
        note_not_carried(exports, records, ctx)
        report["exports"] = report_entries(exports, evaluations)
        if kv_report is not None:
            report["kv_cache"] = {**kv_report, "exports": {e["name"]: e.get("kv_cache") for e in exports}}
            manifest["kv_cache"] = report["kv_cache"]
        manifest["exports"] = exports
        with reporter.status(f"writing artifact {out_dir}"):
            write_document(tmp / "report.json", report, Report)
            write_reports(tmp, json_safe(report), suite=recipe.name or loaded.path.stem, step_summary=step_summary)
            timings["total_s"] = time.perf_counter() - started
            manifest["timings"] = {k: round(v, 3) for k, v in timings.items()}
            manifest["files"] = {k: v for k, v in checksums(tmp).items() if k != "manifest.json"}  # a latency run wrote an interim one
            write_document(tmp / "manifest.json", manifest, Manifest)
    remove_checkpoints(ctx.work_dir, [f"stages[{i}]" for i, st in enumerate(recipe.stages) if stage_kind(st.kind).keeps_checkpoints])
    return RunResult(out_dir, manifest, report, evaluations, gates)


def timed_artifacts(
    recipe: Recipe, root: Path, exports: list[dict[str, Any]], model_facts: dict[str, Any], torch_device: str = "cpu"
) -> list[Timed]:
    """What the latency block times: compressed (torch, on the artifact being written), the
    runtime exports (llama.cpp on the GGUF file, ONNX Runtime GenAI on the ONNX folder, TensorRT on
    a built engine), and the baseline (torch, on the source model's float directory) when named or
    when a gate compares a latency metric with it."""
    spec = recipe.latency
    names = spec.artifacts if spec is not None and spec.artifacts is not None else None
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


def baseline_directory(model_facts: dict[str, Any]) -> str:
    """The source model as a float Hugging Face directory the torch worker can load."""
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


def performance_evaluations(
    recipe: Recipe, timed: list[Timed], eval_chunks: Chunks | None, model: torch.nn.Module, threads: int, reporter: Reporter
) -> tuple[list[Evaluation], dict[str, Any] | None]:
    """Latency measured here (the ``latency`` block) and the evaluations for named devices."""
    profiles = load_profiles(extra=[p.model_dump() for p in recipe.devices])
    spec = recipe.latency
    measured: list[Evaluation] = []
    host = None
    settings = None
    if spec is not None:
        settings = LatencySettings(spec.prompt_tokens, spec.output_tokens, tuple(spec.batch_sizes), spec.warmup, spec.repeats, threads)
        measured, host = measure_all(
            timed, settings, latency_prompts(eval_chunks, spec.prompt_tokens, max(spec.batch_sizes), recipe.seed), reporter
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


def remove_checkpoints(work_dir: Path, labels: list[str]) -> None:
    """Delete the training checkpoints of a run whose artifact is complete: only the stage folders
    this run writes, then the work directory if nothing else is in it."""
    for label in labels:
        shutil.rmtree(work_dir / label, ignore_errors=True)
    try:
        work_dir.rmdir()
    except OSError:  # absent, or holds something that is not ours
        pass


def write_stage_files(root: Path, files: dict[str, dict[str, torch.Tensor]]) -> None:
    from safetensors.torch import save_file

    for rel, tensors in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path))


def evaluate_in_memory(
    baseline: torch.nn.Module,
    compressed: torch.nn.Module | None,
    chunks: Chunks,
    recipe: Recipe,
    device: torch.device,
    reporter: Reporter,
) -> list[Evaluation]:
    """Baseline and compressed model on the evaluation chunks, with torch on ``device``."""
    spec = recipe.data.evaluation
    assert spec is not None
    baseline.to(device)
    if compressed is not None:
        compressed.to(device)
    candidates = {"compressed": torch_forward(compressed, device)} if compressed is not None else {}
    metrics = compare(
        torch_forward(baseline, device), candidates, chunks.tokens, spec.min_context, spec.batch_size, progress=reporter.track
    )
    metrics.setdefault("compressed", dict(metrics["baseline"]))  # no stages: the compressed model is the baseline
    details = {"chunks": int(chunks.tokens.shape[0]), "seq_len": spec.seq_len, "min_context": spec.min_context}
    return [
        Evaluation(artifact=name, runtime="torch", device=device.type, metrics=metrics[name], details=details)
        for name in ("baseline", "compressed")
    ]


def note_not_carried(exports: list[dict[str, Any]], records: list[StageRecord], ctx: RunContext) -> None:
    """Say on every export what it does not carry of the quantization methods whose records it
    holds (a method spec's ``not_carried``: LLM.int8's activation quantization and decomposition,
    which no format holds; a GGUF's llama.cpp evaluation measures the cost)."""
    used = set(ctx.quantized_by.values())
    notes = [
        note
        for i, r in enumerate(records)
        if f"stages[{i}]" in used and stage_kind(r.kind).quantizes_weights and (note := quant_method(r.method).not_carried)
    ]
    if notes:
        for entry in exports:
            entry["not_carried"] = list(dict.fromkeys(notes))


def evaluate_kv_stage(
    model: torch.nn.Module, ctx: RunContext, data: DataPlan, tokenizer: Any, recipe: Recipe, device: torch.device, reporter: Reporter
) -> tuple[list[Evaluation], dict[str, Any]]:
    """Score the compressed model decoding through its quantized KV cache at long context, against
    its own full-precision forward; returns the ``kv_cache`` evaluation and the report section."""
    scheme = ctx.kv_cache
    assert scheme is not None
    cfg = scheme.config
    section: dict[str, Any] = {
        "scheme": cfg.model_dump(mode="json", exclude={"evaluate"}),
        "describe": cfg.describe(),
        "runtimes": cfg.runtime_support(),
    }
    if cfg.evaluate is None:
        return [], section
    ev = cfg.evaluate
    spec = recipe.data.evaluation
    assert spec is not None  # the recipe schema requires data.evaluation for an evaluated kv_cache stage
    with reporter.status(f"tokenizing {ev.samples} x {ev.context} tokens of evaluation text for the KV cache"):
        chunks = data.chunks("evaluation", tokenizer, samples=ev.samples, seq_len=ev.context)
    result = evaluate_kv(model, scheme, chunks.tokens, spec.min_context, device, progress=reporter.track)
    details = {
        "chunks": ev.samples,
        "seq_len": ev.context,
        "min_context": spec.min_context,
        **result["decoding"],
        "reference": "the compressed model's full-precision forward (a float cache)",
        "reference_perplexity": result["reference_metrics"]["perplexity"],
        "memory": result["memory"],
        "tokens_sha256": chunks.facts["tokens_sha256"],
    }
    section["memory"] = result["memory"]
    return [
        Evaluation(
            artifact=KV_CACHE_ARTIFACT, runtime="torch", device=device.type, metrics=result["metrics"], details=details, kind="kv_cache"
        )
    ], section


def build_report(recipe: Recipe, evaluations: list[Evaluation], gates: list[GateResult], eval_chunks: Chunks | None) -> dict[str, Any]:
    return {
        "schema_version": REPORT_VERSION,
        "recipe": recipe.name,
        "passed": all(g.passed for g in gates),
        "evaluations": [e.to_json() for e in evaluations],
        "gates": [g.to_json() for g in gates],
        "evaluation_data": None
        if eval_chunks is None
        else {
            "source": eval_chunks.facts["source"],
            "tokens_sha256": eval_chunks.facts["tokens_sha256"],
            "samples": eval_chunks.facts["samples"],
            "seq_len": eval_chunks.facts["seq_len"],
        },
    }


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "compress": __version__}
    packages = [*VERSIONED_PACKAGES, *(pkg for fmt in EXPORT_FORMATS.values() for pkg in fmt.packages)]
    for pkg in dict.fromkeys(packages):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = "not installed"
    return versions


def build_manifest(
    loaded: LoadedRecipe,
    model_facts: dict[str, Any],
    baseline: torch.nn.Module,
    data: DataPlan,
    eval_chunks: Chunks | None,
    cal_chunks: Chunks | None,
    records: list[StageRecord],
    ctx: RunContext,
    device: torch.device,
    threads: int,
) -> dict[str, Any]:
    recipe = loaded.recipe
    return {
        "schema_version": MANIFEST_VERSION,
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": sys.argv,
        "recipe": {
            "path": str(loaded.path),
            "file_sha256": hashlib.sha256(loaded.text.encode()).hexdigest(),
            "sha256": recipe.sha256(),
            "overrides": loaded.overrides,
            "expanded": recipe.model_dump(mode="json"),
        },
        "seed": recipe.seed,
        "model": {
            **model_facts,
            "dtype": recipe.model.dtype,
            "architecture": type(baseline).__name__,
            "parameters": sum(p.numel() for p in baseline.parameters()),
        },
        "data": {
            "holdout": recipe.data.holdout,
            "calibration": cal_chunks.facts if cal_chunks else (data.calibration_source.describe if data.calibration_source else None),
            "evaluation": eval_chunks.facts if eval_chunks else None,
        },
        "compute": {"device": device.type, "threads": threads, "host": platform.platform(), "cpu_count": os.cpu_count()},
        "versions": library_versions(),
        "stages": [{"label": f"stages[{i}]", **r.to_json()} for i, r in enumerate(records)],
        "quantization": {
            "weights_format": WEIGHTS_FORMAT,
            "layers": {
                name: {
                    "scheme": rec.scheme.model_dump(mode="json"),
                    "shape": list(rec.shape),
                    "stage": ctx.quantized_by[name],
                    "stored_as": stored_as(rec),
                }
                for name, rec in ctx.quantized.items()
            },
        },
    }


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(json_safe(obj), indent=2, allow_nan=False) + "\n")


def write_document(path: Path, obj: dict[str, Any], model: type[BaseModel]) -> None:
    """Write ``obj`` as _write_json does, after checking it against its schema model (Manifest,
    Report): a document that does not match is a bug here, so this raises before anything is written."""
    safe = json_safe(obj)
    model.model_validate(safe)
    path.write_text(json.dumps(safe, indent=2, allow_nan=False) + "\n")


def json_safe(obj: Any) -> Any:
    """Plain-JSON copy of ``obj``: non-finite floats become the strings "inf", "-inf", "nan"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if obj != obj else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, (Path, torch.device, torch.dtype)):
        return str(obj)
    return obj
