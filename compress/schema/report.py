"""report.json: evaluations, gate results and exports of one `compress run`, `compress gate` or search.

These models describe exactly what the writers put in report.json (compress/steps/report.py,
compress/gate_artifact.py, compress/search.py); each validates its report against `Report` before writing
it, and docs/schemas/report.schema.json is generated from them (`compress schema report`).
Numbers that are not finite are written as the strings "nan", "inf" and "-inf".
Open-ended parts (metrics, details, host facts, device fits, the KV cache section) take any keys.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat
from pydantic.json_schema import SkipJsonSchema
from typing_extensions import TypeAliasType

REPORT_VERSION = 5
"""report.json's schema_version (the one place it is defined)."""

SOURCES = ("measured", "estimated")  # where an evaluation's numbers came from
GATE_SOURCES = (*SOURCES, "missing")  # a gate can also find no measurement at all
EVALUATION_KINDS = ("accuracy", "latency", "memory", "kv_cache", "calibration", "task", "draft")
THRESHOLD_KINDS = (
    "max",
    "min",
    "max_increase",
    "max_decrease",
    "max_increase_pct",
    "max_decrease_pct",
)  # compress.schema.recipe.THRESHOLD_KEYS
NON_FINITE = ("nan", "inf", "-inf")  # how compress.documents.json_safe writes non-finite floats

Number = TypeAliasType("Number", StrictFloat | Literal["nan", "inf", "-inf"])
"""A JSON number, or one of the strings "nan", "inf", "-inf" for a value that is not finite."""

Metrics = TypeAliasType("Metrics", dict[str, Number])
"""Metric name -> value; see compress.schema.metrics.METRICS (evaluations also count tokens_scored)."""

Source = Literal["measured", "estimated"]
GateSource = Literal["measured", "estimated", "missing"]
EvaluationKind = Literal["accuracy", "latency", "memory", "kv_cache", "calibration", "task", "draft"]
ThresholdKind = Literal["max", "min", "max_increase", "max_decrease", "max_increase_pct", "max_decrease_pct"]
GateBound = Literal["value", "lower_95", "upper_95"]


class Closed(BaseModel):
    """An object with exactly these keys."""

    model_config = ConfigDict(extra="forbid")


class Open(BaseModel):
    """An object with these keys and possibly others."""

    model_config = ConfigDict(extra="allow")


class Interval(Closed):
    """A metric's confidence interval."""

    lower: Number
    upper: Number
    level: float = Field(description="Coverage, e.g. 0.95.")
    method: str = Field(description="How it was computed, e.g. a percentile bootstrap over the evaluation sequences.")
    samples: int = Field(description="The number of independent samples it rests on (sequences, questions).")


class Evaluation(Closed):
    """Metrics of one artifact, measured on one runtime and device (or estimated for a device profile)."""

    artifact: str = Field(description="baseline, compressed, kv_cache, or an export's name.")
    runtime: str = Field(description="torch, llama.cpp, onnxruntime, tensorrt, ...")
    device: str = Field(description="The device it ran on (cpu, cuda) or the profile it was estimated for.")
    source: Source
    kind: EvaluationKind
    metrics: Metrics
    profile: str | None | SkipJsonSchema[None] = Field(
        None, description="the device profile the evaluation stands for (absent: this machine)"
    )
    intervals: dict[str, Interval] | SkipJsonSchema[None] = Field(
        None, description="Metric name -> its 95% interval (perplexity, KL divergence and top-1 agreement of an accuracy evaluation)."
    )
    build: dict[str, str] | SkipJsonSchema[None] = Field(
        None,
        description="The runtime build and device that measured it: `runtime`, its packages' versions (llama.cpp: the "
        "llama and ggml library versions and compiled CPU features; ONNX Runtime: its build line with the git commit), "
        "`device` (cpu: the processor model; cuda: the GPU). Absent for estimates.",
    )
    details: dict[str, Any] | SkipJsonSchema[None] = Field(None, description="How it was measured (open-ended).")


class Threshold(Closed):
    kind: ThresholdKind
    value: Number = Field(
        description="The threshold as the gate states it (a % for the _pct kinds, a difference for max_increase / max_decrease)."
    )
    limit: Number | SkipJsonSchema[None] = Field(None, description="The resolved absolute bound (absent when nothing was measured).")
    baseline: Number | SkipJsonSchema[None] = Field(None, description="The baseline's value, for the kinds compared with it.")


class GateResult(Closed):
    """One gate: the value found for its artifact, metric and device, the bound, and the verdict."""

    name: str
    metric: str
    artifact: str
    value: Number | None = Field(description="null: no measurement (the gate fails).")
    on: GateBound = Field("value", description="What was compared with the bound: the value, or its interval's lower or upper end.")
    threshold: Threshold
    passed: bool
    source: GateSource
    runtime: str | None
    device: str | None
    message: str


class EvaluationData(Closed):
    """The evaluation text every artifact was scored on."""

    source: str
    tokens_sha256: str = Field(pattern="^[0-9a-f]{64}$")
    samples: int = Field(ge=0)
    seq_len: int = Field(ge=0)


class ExportEntry(Open):
    """An export's verification, and the evaluation that stands for it."""

    name: str
    format: str
    path: str | None = None
    verified: bool | None = None
    check: Any = None
    evaluated_as: str | None = None


class Host(Open):
    """This machine, as the latency measurements saw it."""

    bandwidth_gbs: Number | SkipJsonSchema[None] = None


class DeviceEntry(Open):
    fit: dict[str, Any] | SkipJsonSchema[None] = None


class SearchCandidate(Open):
    """One candidate of a recipe search."""

    name: str
    overrides: list[str] | SkipJsonSchema[None] = None
    size_mb: Number | None = None
    passed: bool | None = None
    metrics: Metrics | SkipJsonSchema[None] = None
    status: str | SkipJsonSchema[None] = None
    source: Source | SkipJsonSchema[None] = None


class Search(Open):
    """A recipe search: every candidate, and the smallest one passing every gate."""

    candidates: list[SearchCandidate]
    chosen: str | None


class PhaseMemory(Closed):
    """Peak memory of one phase of a run."""

    peak_rss_mb: Number = Field(description="Peak resident memory of the process during the phase, MiB (see the section's method).")
    peak_cuda_mb: Number | SkipJsonSchema[None] = Field(
        None, description="Peak CUDA memory allocated by torch during the phase, MiB (phases on a CUDA device only)."
    )
    predicted_rss_mb: Number | SkipJsonSchema[None] = Field(
        None, description="`compress plan`'s estimate of the phase's peak memory (the peak of its rows), MiB."
    )
    measured_over_predicted: Number | SkipJsonSchema[None] = Field(None, description="peak_rss_mb / predicted_rss_mb.")


class MemoryPrediction(Closed):
    """What `compress plan` predicts for the same recipe, from the model's config alone."""

    peak_rss_mb: Number | SkipJsonSchema[None] = Field(None, description="Peak host memory, MiB.")
    peak_cuda_mb: Number | None | SkipJsonSchema[None] = Field(None, description="Peak device memory, MiB (null: not predicted).")
    time_s: Number | SkipJsonSchema[None] = Field(None, description="Wall time, seconds.")
    error: str | SkipJsonSchema[None] = Field(None, description="Why there is no prediction (the plan could not be computed).")


class RunMemory(Closed):
    """Peak memory of `compress run`, per phase and in total, against `compress plan`'s prediction."""

    method: Literal["vmhwm", "ru_maxrss"] = Field(
        description="vmhwm: each phase's own peak (VmHWM of /proc/self/status, reset when the phase starts); "
        "ru_maxrss: the process's peak so far at the end of each phase (where the peak cannot be reset)."
    )
    phases: dict[str, PhaseMemory] = Field(
        description="Phase (load_model, prepare_data, stages, evaluate, write_model, exports, ...) -> peaks."
    )
    peak_rss_mb: Number = Field(description="Peak resident memory of the run's process, MiB, up to the writing of report.json.")
    peak_cuda_mb: Number | SkipJsonSchema[None] = Field(None, description="Peak CUDA memory over the phases on a CUDA device, MiB.")
    children_peak_rss_mb: Number = Field(
        description="The largest peak resident memory of a child process the run waited for (latency workers, runtimes), MiB; "
        "0 if none. An upper bound: Linux counts a child's peak from before it starts its program, while it still shares "
        "the run's memory, so every child reads at least the run's resident memory when it was started."
    )
    wall_s: Number = Field(description="Seconds from the start of the run to the writing of report.json.")
    predicted: MemoryPrediction
    measured_over_predicted: dict[str, Number] | SkipJsonSchema[None] = Field(
        None, description="peak_rss: peak_rss_mb / predicted peak; time: wall_s / predicted time."
    )


class Report(Closed):
    """report.json."""

    model_config = ConfigDict(
        extra="forbid",
        title="compress report.json",
        json_schema_extra={
            "description": "Evaluations, gate results and exports of one `compress run` or `compress gate`. "
            'Non-finite numbers are written as the strings "nan", "inf", "-inf".'
        },
    )

    schema_version: Literal[REPORT_VERSION] = Field(description=f"Version of this document's layout (REPORT_VERSION = {REPORT_VERSION}).")
    recipe: str | None = Field(description='recipe name (null when unnamed), or "compress gate"')
    passed: bool = Field(description="every gate passed")
    evaluations: list[Evaluation]
    gates: list[GateResult]
    evaluation_data: EvaluationData | None
    exports: list[ExportEntry] | SkipJsonSchema[None] = None
    host: Host | SkipJsonSchema[None] = None
    devices: dict[str, DeviceEntry] | SkipJsonSchema[None] = None
    search: Search | SkipJsonSchema[None] = None
    kv_cache: dict[str, Any] | SkipJsonSchema[None] = None
    artifact: dict[str, Any] | SkipJsonSchema[None] = Field(
        None, description="compress gate: the artifact under test, its kind, baseline and gates file"
    )
    memory: RunMemory | SkipJsonSchema[None] = Field(
        None, description="compress run: peak memory per phase and in total, against compress plan's prediction (version 4)"
    )
