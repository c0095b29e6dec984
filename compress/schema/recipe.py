"""Recipe schema v1: the models a recipe YAML is validated against (torch-free).

A recipe is data: where the model comes from, which text calibrates and evaluates it, the
ordered compression stages, the exports, and the gates that decide pass or fail. Reading the
file, ``--set`` overrides and error messages with lines are in compress/recipe.py.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from compress.schema.base import Seed, Source, Strict, not_a_bool
from compress.schema.devices import DeviceProfile
from compress.schema.exports import BaseExportConfig
from compress.schema.metrics import (
    DEVICE_METRICS,
    DRAFT_METRICS,
    INTERVAL_METRICS,
    KV_METRICS,
    LATENCY_METRICS,
    METRICS,
    TASK_METRICS,
    is_draft_artifact,
)
from compress.schema.quantize import WeightQuantConfig

SCHEMA_VERSION = 1
"""The recipe `version` this release reads (the one place it is defined)."""
IN_MEMORY_ARTIFACTS = ("baseline", "compressed")
THRESHOLD_KEYS = ("max", "min", "max_increase", "max_decrease", "max_increase_pct", "max_decrease_pct")
BASELINE_THRESHOLDS = ("max_increase", "max_decrease", "max_increase_pct", "max_decrease_pct")  # compared with the baseline's value
# Fields that hold filesystem paths; relative values resolve against the recipe's directory
# (or, for --set overrides, against the current directory).
PATH_FIELDS = ("model.source", "data.calibration.source", "data.evaluation.source")
TASK_SOURCE_FIELD = re.compile(r"tasks\.\d+\.source")  # each task's question file, a path field too
USABLE_CPUS = "usable_cpus"  # validation-context key: the CPUs this process may run on (compress.paths.usable_cpus)


def alias_problem(alias: str) -> str | None:
    """Why MLflow would refuse ``alias``, or None."""
    if not re.fullmatch(r"[A-Za-z0-9_\-]+", alias) or alias.lower() == "latest" or re.fullmatch(r"[vV]\d+", alias):
        return f"alias {alias!r} is not usable: letters, digits, '-' and '_' only, and not 'latest' or v<number> (MLflow reserves those)"
    return None


class ModelConfig(Strict):
    source: Source = Field(
        description="A Hugging Face model directory, a Hugging Face id already in the local cache, "
        "a .gguf file, or reference:<name> (see `compress assets list`)."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Compute dtype of the model. auto: the dtype its checkpoint stores (bfloat16 for most Hugging Face "
        "models; float32 for a GGUF source, whose dequantized grid float32 holds exactly, and for quantized checkpoints).",
    )
    trust_remote_code: bool = Field(False, description="Allow a model's own Python code to run (off by default).")
    allow_pickle: bool = Field(False, description="Allow pickle checkpoints (pytorch_model.bin): they can run arbitrary code when loaded.")


class TextConfig(Strict):
    source: Source = Field(description="A .txt/.md/.rst/.jsonl file, a directory of them, a glob, or reference:<name>.")
    samples: int = Field(ge=1, description="Number of token chunks.")
    seq_len: int = Field(ge=8, description="Tokens per chunk.")
    seed: Seed = Field(0, description="Seed for choosing which text becomes chunks.")
    text_field: str = Field("text", description="Field holding the text in .jsonl records.")


Severity = Literal["error", "warn", "off"]


class CalibrationChecks(Strict):
    """Sanity checks on the calibration text and on what it drives through the model
    (compress/calibration_checks.py). Each check is ``error`` (the run stops, exit 2), ``warn`` (a warning;
    the run goes on) or ``off``; every result goes into manifest.json under ``calibration.checks``."""

    tokens: Severity = Field(
        "error",
        description="GPTQ needs at least as many calibration tokens as the widest quantized layer has input "
        "columns; fewer leave its Hessian rank-deficient (only the dampening keeps it invertible).",
    )
    duplicates: Severity = Field("error", description="Near-duplicate chunks (shared token 8-grams) above max_duplicate_share.")
    max_duplicate_share: float = Field(
        0.1, ge=0, le=1, description="Largest share of chunks that may nearly repeat an earlier chunk (estimated Jaccard >= 0.5)."
    )
    padding: Severity = Field(
        "error", description="Special tokens (padding, BOS, EOS) or one repeated token making up more than max_padding_share."
    )
    max_padding_share: float = Field(
        0.5, gt=0, le=1, description="Largest share of calibration tokens that one token or the special tokens may take."
    )
    nonfinite: Severity = Field("error", description="NaN or infinite activations in any block's inputs or outputs during calibration.")
    layer_error: Severity = Field(
        "error",
        description="A layer whose relative quantization error is more than layer_error_ratio times the median of "
        "the same kind of layer (same name within its block, same bits per weight) in the stage.",
    )
    layer_error_ratio: float = Field(10.0, gt=1, description="How far above its kind's median a layer's relative error may go.")


class CalibrationConfig(TextConfig):
    """Text the compression stages learn from."""

    checks: CalibrationChecks = Field(default_factory=CalibrationChecks, description="Sanity checks on the calibration text.")


class EvaluationConfig(TextConfig):
    """Text every artifact is scored on; kept apart from calibration text."""

    min_context: int = Field(32, ge=1, description="Score only positions with at least this many tokens of context before them.")
    batch_size: int = Field(1, ge=1, description="Chunks per forward pass.")

    @model_validator(mode="after")
    def _context_fits(self) -> EvaluationConfig:
        if self.min_context >= self.seq_len:
            raise ValueError(f"min_context ({self.min_context}) must be smaller than seq_len ({self.seq_len})")
        return self


class DataConfig(Strict):
    calibration: CalibrationConfig | None = None
    evaluation: EvaluationConfig | None = None
    holdout: float = Field(
        0.2,
        gt=0,
        lt=1,
        description="Share of the text of documents used for both calibration and evaluation that is "
        "held out for evaluation only (split in ~4,000-character blocks).",
    )


# The keys of a stage (one optional field per stage kind, holding that kind's config model) come from the
# stage-kind table: compress.recipe.recipe_model subclasses StageConfig with them. This base has none.
class StageConfig(Strict):
    """One stage: a mapping with exactly one key naming the stage kind."""

    @model_validator(mode="after")
    def _exactly_one(self) -> StageConfig:
        kinds = [k for k in type(self).model_fields if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError(f"a stage names exactly one of: {', '.join(type(self).model_fields)} (got {len(kinds)})")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in type(self).model_fields if getattr(self, k) is not None)

    @property
    def config(self) -> BaseModel:
        return getattr(self, self.kind)


class GateConfig(Strict):
    name: str | None = Field(None, description="Shown in reports; defaults to artifact.metric.threshold.")
    metric: str = Field(description="One of: " + ", ".join(METRICS) + ".")
    artifact: str = Field(
        "compressed", description="Which artifact: baseline, compressed, kv_cache (with a kv_cache stage), or an export's name."
    )
    max: float | None = Field(None, description="Pass when value <= max.")
    min: float | None = Field(None, description="Pass when value >= min.")
    max_increase: float | None = Field(None, ge=0, description="Pass when value <= baseline + max_increase (in the metric's own units).")
    max_decrease: float | None = Field(
        None, ge=0, description="Pass when value >= baseline - max_decrease (in the metric's own units: points for a task's accuracy)."
    )
    max_increase_pct: float | None = Field(None, ge=0, description="Pass when value <= baseline * (1 + pct/100).")
    max_decrease_pct: float | None = Field(None, ge=0, description="Pass when value >= baseline * (1 - pct/100).")
    task: str | None = Field(None, description="The task (a `tasks` entry's name) whose accuracy or accuracy_norm the gate reads.")
    device: str | None = Field(
        None,
        description="Device profile the gate is for. Unset or `local`: measured on this machine. "
        "Another device: measured when this machine is that device, else estimated from its roofline "
        "and reported as `source: estimated`.",
    )
    on: Literal["value", "lower_95", "upper_95"] = Field(
        "value",
        description="What meets the threshold: the measured value, or the lower or upper end of its 95% interval "
        "(" + ", ".join(INTERVAL_METRICS) + "), e.g. `on: upper_95` with `max` passes only when the whole interval is below it.",
    )

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, v: str) -> str:
        if v not in METRICS:
            raise ValueError(f"unknown metric '{v}'; known: {', '.join(METRICS)}")
        return v

    @model_validator(mode="after")
    def _device_metrics(self) -> GateConfig:
        if self.device not in (None, "local") and self.metric not in DEVICE_METRICS:
            raise ValueError(
                f"{self.metric} is measured on the artifact's runtime here and does not depend on the device; "
                "device applies to latency and memory metrics"
            )
        return self

    @model_validator(mode="after")
    def _bound_has_an_interval(self) -> GateConfig:
        if self.on != "value" and self.metric not in INTERVAL_METRICS:
            raise ValueError(f"on: {self.on} needs an interval, which only {', '.join(INTERVAL_METRICS)} have; use on: value")
        return self

    @model_validator(mode="after")
    def _one_threshold(self) -> GateConfig:
        given = [k for k in THRESHOLD_KEYS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"a gate takes exactly one threshold of {', '.join(THRESHOLD_KEYS)} (got {given or 'none'})")
        if given[0] in BASELINE_THRESHOLDS:
            if given[0].endswith("_pct") and not METRICS[self.metric].relative:
                raise ValueError(f"{given[0]} compares with the baseline, which is not meaningful for {self.metric}; use max or min")
            if self.artifact == "baseline":
                raise ValueError(f"{given[0]} compares an artifact with the baseline; it cannot gate the baseline itself")
        return self

    @model_validator(mode="after")
    def _kv_metric(self) -> GateConfig:
        if self.metric in KV_METRICS and self.artifact != "kv_cache":
            raise ValueError(f"{self.metric} is measured on the kv_cache artifact (a kv_cache stage's evaluation); set artifact: kv_cache")
        return self

    @model_validator(mode="after")
    def _draft_metric(self) -> GateConfig:
        if self.metric in DRAFT_METRICS and not is_draft_artifact(self.artifact):
            raise ValueError(f"{self.metric} is measured on a draft stage's pair; set artifact: draft (torch) or draft-<gguf export>")
        return self

    @model_validator(mode="after")
    def _task_metric(self) -> GateConfig:
        if self.metric in TASK_METRICS and self.task is None:
            raise ValueError(f"{self.metric} is a task's; name the task (`task:`, a tasks entry's name)")
        if self.task is not None and self.metric not in TASK_METRICS:
            raise ValueError(f"task applies to the task metrics ({', '.join(TASK_METRICS)}), not to {self.metric}")
        return self

    @property
    def threshold_kind(self) -> str:
        return next(k for k in THRESHOLD_KEYS if getattr(self, k) is not None)

    @property
    def threshold_value(self) -> float:
        return float(getattr(self, self.threshold_kind))

    @property
    def display_name(self) -> str:
        device = f"@{self.device}" if self.device else ""
        bound = f".{self.on}" if self.on != "value" else ""
        task = f".{self.task}" if self.task else ""
        return self.name or f"{self.artifact}{task}.{self.metric}{bound}{device}.{self.threshold_kind}"


def check_task_gates(tasks: list[TaskConfig], gates: list[GateConfig], owner: str) -> None:
    """Task names are unique, and each task gate names one of ``tasks`` that scores its artifact and
    has its metric (a recipe's, or a gates file's for `compress gate`); ValueError naming the entry."""
    names = [t.name for t in tasks]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"task names must be unique; repeated: {', '.join(repeated)}")
    for i, gate in enumerate(gates):
        if gate.task is None:
            continue
        task = next((t for t in tasks if t.name == gate.task), None)
        if task is None:
            raise ValueError(f"gates[{i}].task '{gate.task}' is not a task of {owner}; known: {', '.join(names) or 'none (add `tasks:`)'}")
        if task.artifacts is not None and gate.artifact not in task.artifacts:
            raise ValueError(
                f"gates[{i}]: task '{gate.task}' does not score artifact '{gate.artifact}' (its artifacts: {', '.join(task.artifacts)})"
            )
        if gate.metric == "accuracy_norm" and task.kind != "multiple_choice":
            raise ValueError(f"gates[{i}]: accuracy_norm is a multiple_choice task's; '{gate.task}' is {task.kind}")


class TaskConfig(Strict):
    """A question set scored through lm-evaluation-harness on the baseline, the compressed model and
    each export on its own runtime (compress/eval/tasks.py). Accuracy is in percent, with lm-eval's
    standard error and its 95% interval."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$", description="The task's name in reports and in a gate's `task:`.")
    source: Source = Field(
        description="reference:mmlu (MMLU test questions, fetched offline with the assets), or a local "
        ".jsonl / .json (a list of objects) / .csv file of questions, relative to the recipe's directory."
    )
    kind: Literal["multiple_choice", "loglikelihood"] = Field(
        "multiple_choice",
        description="multiple_choice: the most likely choice must be the answer (accuracy, and accuracy_norm per "
        "character of the choice). loglikelihood: the continuation must be the greedy one (accuracy).",
    )
    format: Literal["letters", "cloze"] = Field(
        "letters",
        description="multiple_choice prompt: letters lists the choices as A. … and scores the letter (MMLU's "
        "form); cloze scores each choice's own text after the question.",
    )
    question_field: str = Field("question", description="Local files: the field holding the question (loglikelihood: the context).")
    choices_field: str | list[str] = Field(
        "choices",
        description="Local files, multiple_choice: one field holding the list of choices, or a list of fields, one per choice.",
    )
    answer_field: str = Field(
        "answer",
        description="Local files: the field holding the answer, as a 0-based index, a letter or the choice's text "
        "(loglikelihood: the continuation).",
    )
    subject_field: str | None = Field(
        None, description="Local files, multiple_choice: a field naming the subject, said in the prompt as MMLU does."
    )
    limit: int | None = Field(200, ge=1, description="Questions drawn (with seed) from the set; null: all of them.")
    seed: Seed = Field(0, description="Seed for drawing the questions and the few-shot examples.")
    num_fewshot: int = Field(0, ge=0, le=25, description="Solved examples before each question, drawn from the questions not evaluated.")
    artifacts: list[str] | None = Field(
        None,
        description="Artifacts to score: baseline, compressed and export names. Default: baseline, compressed "
        "and every export that runs on a runtime of its own (GGUF, ONNX; TensorRT where it can run).",
    )

    @model_validator(mode="after")
    def _fields_fit(self) -> TaskConfig:
        local = ("question_field", "choices_field", "answer_field", "subject_field")
        if self.source.startswith("reference:") and (given := [k for k in local if k in self.model_fields_set]):
            raise ValueError(f"{given[0]} maps the fields of a local file; {self.source} brings its own")
        if self.kind == "loglikelihood" and (
            given := [k for k in ("choices_field", "subject_field", "format") if k in self.model_fields_set]
        ):
            raise ValueError(f"{given[0]} applies to multiple_choice tasks")
        return self


MAX_LATENCY_TOKENS = 1 << 20
"""The most prompt or output tokens a latency run may ask for (above every released model's context)."""
MAX_LATENCY_BATCH = 1024


class LatencyConfig(Strict):
    prompt_tokens: int = Field(
        128,
        ge=1,
        le=MAX_LATENCY_TOKENS,
        description="Prompt length for the time to first token (real evaluation-text tokens); prompt and output together "
        "must fit the model's context length.",
    )
    output_tokens: int = Field(64, ge=2, le=MAX_LATENCY_TOKENS, description="Greedy tokens decoded per run (no stop at end-of-text).")
    batch_sizes: list[int] = Field(
        [1, 4],
        min_length=1,
        description="Batch sizes to measure; 1 is required (the gated medians). "
        "A runtime that decodes one sequence (llama-cpp-python) skips the others and says so.",
    )
    warmup: int = Field(1, ge=0, le=100, description="Unmeasured runs before the measured ones.")
    repeats: int = Field(5, ge=1, le=1000, description="Measured runs; medians and p90 are over these.")
    artifacts: list[str] | None = Field(
        None,
        description="Artifacts to time: baseline and compressed (torch) and export names. "
        "Default: compressed and every GGUF, ONNX and TensorRT export, and the baseline "
        "when a gate compares a latency metric with it.",
    )

    @field_validator("batch_sizes")
    @classmethod
    def _has_one(cls, v: list[int]) -> list[int]:
        if 1 not in v or any(b < 1 for b in v):
            raise ValueError("batch_sizes are positive and include 1 (the gated latency is at batch 1)")
        if max(v) > MAX_LATENCY_BATCH:
            raise ValueError(f"batch size {max(v):,} is more than {MAX_LATENCY_BATCH:,}")
        return sorted(set(v))


class TargetConfig(Strict):
    device: str = Field(description="A device profile name (shipped, or in `devices`).")
    context: int | None = Field(None, ge=1, description="Tokens of KV cache for the fit check (default: latency prompt + output).")
    batch: int = Field(1, ge=1, description="Sequences decoded at once, for the fit check.")


MAX_CANDIDATES = 64
"""search.max_candidates by default: a search of more whole runs than this is a typo more often than a plan."""


class SearchConfig(Strict):
    variants: dict[str, list[Any]] = Field(
        min_length=1,
        description="Recipe key path (as for --set, e.g. stages.0.quantize.bits) -> values to try; every combination is a candidate.",
    )
    stop_at_first_pass: bool = Field(
        False, description="Stop at the first candidate that passes every gate (candidates run smallest expected size first)."
    )
    max_candidates: int = Field(
        MAX_CANDIDATES,
        ge=1,
        le=100_000,
        description="Most candidates (combinations of variants) a search may run; more are refused at validation. "
        "Raise it for a larger search on purpose (every candidate is a whole run).",
    )

    @field_validator("variants")
    @classmethod
    def _non_empty(cls, v: dict[str, list[Any]]) -> dict[str, list[Any]]:
        empty = [k for k, values in v.items() if not values]
        if empty:
            raise ValueError(f"no values to try for {', '.join(empty)}")
        return v

    @model_validator(mode="after")
    def _bounded(self) -> SearchConfig:
        count = math.prod(len(values) for values in self.variants.values())
        if count > self.max_candidates:
            sizes = " x ".join(str(len(values)) for values in self.variants.values())
            raise ValueError(
                f"variants make {count:,} candidates ({sizes}), more than max_candidates ({self.max_candidates:,}); "
                "try fewer values, or raise search.max_candidates"
            )
        return self


class PublishConfig(Strict):
    name: str | None = Field(None, description="Registered model name (default: the recipe's name).")
    aliases: list[str] = Field(
        default_factory=list, description="Aliases set on the version once every file is uploaded, e.g. [candidate]."
    )
    uri: str | None = Field(None, description="MLflow tracking server URI (default: MLFLOW_TRACKING_URI, else the embedded registry).")
    store: str | None = Field(
        None,
        description="Embedded registry directory (SQLite + local files, no server), relative to the "
        "recipe's directory (default: $COMPRESS_REGISTRY, else ~/.local/share/compress/registry).",
    )
    force: bool = Field(False, description="Publish even when a gate failed (recorded on the version and in its model card).")

    @model_validator(mode="after")
    def _checks(self) -> PublishConfig:
        if self.uri and self.store:
            raise ValueError("publish: give uri (a tracking server) or store (the embedded registry), not both")
        for alias in self.aliases:
            if (problem := alias_problem(alias)) is not None:
                raise ValueError(f"publish.aliases: {problem}")
        return self


class ComputeConfig(Strict):
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto picks CUDA when available.")
    threads: int | None = Field(
        None,
        ge=1,
        description="CPU threads for torch (default: the cores this process may run on, its CPU affinity); "
        "at most those cores (more threads than cores make torch's threads wait on each other many-fold).",
    )

    @field_validator("threads")
    @classmethod
    def _at_most_the_usable_cpus(cls, threads: int | None, info: ValidationInfo) -> int | None:
        usable = (info.context or {}).get(USABLE_CPUS)
        if threads is not None and usable is not None and threads > usable:
            raise ValueError(f"{threads:,} threads, but this process may run on {usable} CPU(s); give at most {usable} or leave it out")
        return threads


# The ``stages`` and ``exports`` items are the plugin tables' config models: recipes are validated against
# compress.recipe.recipe_model(), this class with those two fields made from compress.plugins (the schema
# package never imports the tables).
class Recipe(Strict):
    version: Literal[SCHEMA_VERSION] = Field(description="Recipe schema version; this release reads version 1.")
    _version_is_a_number = field_validator("version", mode="before")(not_a_bool)
    name: str | None = Field(None, description="A label for reports and the manifest.")
    seed: Seed = Field(0, description="Global seed (torch, Python, numpy) for reproducible runs.")
    model: ModelConfig
    data: DataConfig = Field(default_factory=DataConfig)
    compute: ComputeConfig = Field(default_factory=ComputeConfig)
    stages: list[StageConfig] = Field(default_factory=list, description="Applied in order.")
    exports: list[BaseExportConfig] = Field(
        default_factory=list,
        description="Checkpoints of the quantized weights, packed exactly (compressed-tensors, gptq); "
        "each is written to exports/<name>/ in the artifact and verified by reloading it.",
    )
    latency: LatencyConfig | None = Field(None, description="Time the artifacts on their runtimes (each in a fresh process).")
    devices: list[DeviceProfile] = Field(
        default_factory=list, description="Device profiles of your own (added to, or replacing, the shipped ones)."
    )
    targets: list[TargetConfig] = Field(
        default_factory=list, description="Devices to check fit and estimate latency for, with the context and batch they must serve."
    )
    tasks: list[TaskConfig] = Field(
        default_factory=list,
        description="Task accuracy through lm-evaluation-harness on every artifact's own runtime (see the manual, docs/tasks.md).",
    )
    gates: list[GateConfig] = Field(default_factory=list)
    search: SearchConfig | None = Field(
        None,
        description="Try every combination of these values and keep the smallest artifact "
        "passing every gate (see the manual, docs/search-and-plan.md).",
    )
    publish: PublishConfig | None = Field(
        None,
        description="Publish the artifact to a model registry (MLflow) when every gate "
        "passed (see the manual, docs/registry.md). Not part of the recipe's hash: where an artifact is "
        "published does not change it.",
    )

    @model_validator(mode="after")
    def _cross_checks(self) -> Recipe:
        if any(g.metric not in TASK_METRICS for g in self.gates) and self.data.evaluation is None:
            raise ValueError("gates need data.evaluation: there is no text to measure them on")
        export_names = [x.name for x in self.exports]
        repeated = sorted({n for n in export_names if export_names.count(n) > 1})
        if repeated:
            raise ValueError(f"export names must be unique; repeated: {', '.join(repeated)} (give each a `name`)")
        # Exports hold exactly the compressed model's records (verified when written), so gates on
        # an export read the `compressed` evaluation; see docs/exports/checkpoints.md.
        known = set(IN_MEMORY_ARTIFACTS) | set(export_names)
        for i, stage in enumerate(self.stages):  # each kind's config says what it needs and adds (kv_cache: its artifact)
            known |= stage.config.recipe_artifacts(f"stages[{i}]", self)
        for i, gate in enumerate(self.gates):
            if gate.artifact not in known:
                raise ValueError(
                    f"gates[{i}].artifact '{gate.artifact}' is not an artifact of this recipe; known: {', '.join(sorted(known))}"
                )
        self._check_tasks(known)
        if self.search is not None and not self.gates:
            raise ValueError("search picks the smallest artifact passing every gate, and this recipe has no gates")
        latency_metrics = [i for i, g in enumerate(self.gates) if g.metric in LATENCY_METRICS]
        if latency_metrics and self.latency is None:
            raise ValueError(f"gates{latency_metrics} gate latency metrics and need a `latency:` block (what to time, how)")
        for i, gate in enumerate(self.gates):
            if gate.metric == "memory_fraction" and gate.device is None:
                raise ValueError(f"gates[{i}]: memory_fraction is a fit check on a named device; set gates[{i}].device")
        if self.latency is not None:
            timeable = {"baseline", "compressed"} | {x.name for x in self.exports if x.own_runtime}
            for name in self.latency.artifacts or []:
                if name not in timeable:
                    raise ValueError(f"latency.artifacts: '{name}' is not timeable here; known: {', '.join(sorted(timeable))}")
            relative = [i for i, g in enumerate(self.gates) if g.metric in LATENCY_METRICS and g.threshold_kind in BASELINE_THRESHOLDS]
            if relative and self.latency.artifacts is not None and "baseline" not in self.latency.artifacts:
                raise ValueError(f"gates{relative} compare latency with the baseline; add baseline to latency.artifacts")
        names = [g.display_name for g in self.gates]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"gate names must be unique; repeated: {', '.join(dupes)} (give each a `name`)")
        self._check_gguf_target()
        for i, stage in enumerate(self.stages):
            cfg = stage.config
            if cfg.needs_calibration and self.data.calibration is None:
                raise ValueError(f"stages[{i}] ({stage.kind}) needs data.calibration{cfg.calibration_hint}")
            if cfg.needs_evaluation_to and self.data.evaluation is None:
                raise ValueError(f"stages[{i}] ({stage.kind}) {cfg.needs_evaluation_to} and needs data.evaluation")
            if cfg.before_quantization:
                quantize = [j for j, st in enumerate(self.stages[:i]) if isinstance(st.config, WeightQuantConfig)]
                if quantize:
                    raise ValueError(
                        f"stages[{i}] ({stage.kind}) comes after stages[{quantize[0]}] ({self.stages[quantize[0]].kind}); "
                        f"{stage.kind} changes float weights, so put it before quantization"
                    )
        return self

    def _check_tasks(self, known: set[str]) -> None:
        for i, task in enumerate(self.tasks):
            for name in task.artifacts or []:
                if name not in known:
                    raise ValueError(f"tasks[{i}].artifacts: '{name}' is not an artifact of this recipe; known: {', '.join(sorted(known))}")
        check_task_gates(self.tasks, self.gates, "this recipe")

    def _check_gguf_target(self) -> None:
        """A GGUF export's size budget and the quantize stage that quantizes each layer on the type it picks go together."""
        chooser = [f"stages[{i}]" for i, st in enumerate(self.stages) if getattr(st.config, "gguf_target", False)]
        targets = [x.name for x in self.exports if getattr(x, "target", None) is not None]
        if chooser and not targets:
            raise ValueError(f"{chooser[0]}: gguf_target: true takes its budget from a GGUF export's `target:`, and no export has one")
        if targets and not chooser:
            raise ValueError(
                f"export '{targets[0]}': target picks a block type per layer for a quantize stage to quantize on; "
                "add `gguf_target: true` to a gptq or rtn quantize stage"
            )
        if len(chooser) > 1 or len(targets) > 1:
            raise ValueError(
                f"one size budget per recipe: stages {', '.join(chooser)} set gguf_target and exports {', '.join(targets)} set target"
            )

    def gguf_budget(self) -> Any:
        """The GGUF export with a size budget (``target:``), or None."""
        return next((x for x in self.exports if getattr(x, "target", None) is not None), None)

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json", exclude={"publish"}), sort_keys=True, separators=(",", ":"))

    def sha256(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()
