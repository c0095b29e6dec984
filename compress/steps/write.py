"""Steps 4 and 8: the artifact's own files (model/ in compressed-tensors, the recipe, the stages'
files) and, last, its documents: report.json, the JUnit/Markdown/plot reports, and manifest.json
with the checksum of every other file."""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from compress.artifact import WEIGHTS_FORMAT, stored_as, write_model
from compress.documents import json_safe, library_versions, write_document
from compress.eval.memory import memory_section
from compress.eval.plan.planner import run_estimate
from compress.eval.reports import write_reports
from compress.experts import expert_view
from compress.hf_model import checksums
from compress.marker import ARTIFACT, write_marker
from compress.schema.manifest import MANIFEST_VERSION, Manifest
from compress.schema.report import Report
from compress.steps.exports import Exported
from compress.steps.load import Run, Source
from compress.steps.stages import Staged


def build_manifest(run: Run, source: Source, staged: Staged) -> dict[str, Any]:
    """manifest.json's content as far as it is known before the artifact is written: the recipe as
    run, the source model, the data, the compute, the library versions, the stages and the quantized
    layers. The exports, timings and file checksums are added by ``write_documents``."""
    loaded, recipe, baseline, data = run.loaded, run.recipe, source.baseline, source.data
    cal_chunks, eval_chunks = source.calibration, source.eval_chunks
    ctx = staged.ctx
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
            **source.lm.facts,
            "dtype": str(baseline.dtype).removeprefix("torch."),  # the recipe's dtype, `auto` resolved
            "architecture": type(baseline).__name__,
            "parameters": sum(p.numel() for p in baseline.parameters()),
        },
        "data": {
            "holdout": recipe.data.holdout,
            "calibration": (
                {**cal_chunks.facts, "checks": source.checks.facts() if source.checks else []}
                if cal_chunks
                else (data.calibration_source.describe if data.calibration_source else None)
            ),
            "evaluation": eval_chunks.facts if eval_chunks else None,
            **({"tasks": [t.manifest() for t in source.tasks]} if source.tasks else {}),
        },
        "compute": {"device": run.device.type, "threads": run.threads, "host": platform.platform(), "cpu_count": os.cpu_count()},
        "versions": library_versions(),
        "stages": [{"label": f"stages[{i}]", **r.to_json()} for i, r in enumerate(staged.records)],
        "quantization": {
            "weights_format": WEIGHTS_FORMAT,
            "layers": {
                name: {
                    "scheme": rec.scheme.model_dump(mode="json"),
                    "shape": list(rec.shape),
                    "stage": ctx.quantized_by[name],
                    "stored_as": stored_as(rec, expert_view(staged.model, name) is not None),
                }
                for name, rec in ctx.quantized.items()
            },
        },
    }


def write_model_files(root: Path, run: Run, source: Source, staged: Staged) -> None:
    """model/ (the records packed as compressed-tensors, each read back and proven identical, so the
    exports pack what model/ holds), the recipe text as given, and the files the stages asked to keep."""
    with run.reporter.status(f"writing the compressed model to {run.out_dir}"):
        write_model(root, staged.model, source.lm.tokenizer, staged.ctx.quantized)  # read back and proven identical
        (root / "recipe.yaml").write_text(run.loaded.text)
        write_stage_files(root, staged.ctx.files)


def write_stage_files(root: Path, files: dict[str, dict[str, torch.Tensor]]) -> None:
    from safetensors.torch import save_file

    for rel, tensors in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path))


def write_interim_manifest(root: Path, manifest: dict[str, Any]) -> None:
    """manifest.json before the exports are known: the latency worker reads the quantized layers' schemes from it."""
    write_document(root / "manifest.json", manifest, Manifest)


def write_documents(root: Path, run: Run, manifest: dict[str, Any], report: dict[str, Any], exported: Exported, step_summary: bool) -> None:
    """report.json (with the run's peak memory per phase against `compress plan`'s prediction) and its
    JUnit/Markdown/plot renderings, then manifest.json, with the exports, the timings and the
    SHA-256 of every other file in the artifact, and last the marker holding the manifest's SHA-256."""
    recipe = run.recipe
    if "kv_cache" in report:
        manifest["kv_cache"] = report["kv_cache"]
    manifest["exports"] = exported.entries
    with run.reporter.status(f"writing the report and manifest to {run.out_dir}"):
        report["memory"] = memory_section(run.memory, time.perf_counter() - run.started, lambda: run_estimate(run.loaded))
        write_document(root / "report.json", report, Report)
        write_reports(root, json_safe(report), suite=recipe.name or run.loaded.path.stem, step_summary=step_summary)
        run.timings["total_s"] = time.perf_counter() - run.started
        manifest["timings"] = {k: round(v, 3) for k, v in run.timings.items()}
        manifest["files"] = {k: v for k, v in checksums(root).items() if k != "manifest.json"}  # a latency run wrote an interim one
        write_document(root / "manifest.json", manifest, Manifest)
        write_marker(root, ARTIFACT)
