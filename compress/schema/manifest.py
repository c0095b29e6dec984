"""manifest.json: what an artifact is and how it was made (recipe, hashes, versions, seed, stage
records, quantized layers' schemes, exports, file checksums).

`Manifest` describes exactly what a run writes (compress/steps/write.py); compress/documents.py validates the
manifest against it before writing, and docs/schemas/manifest.schema.json is generated from it
(`compress schema manifest`). A `compress gate -o` directory holds a shorter manifest.json,
`GateReportListing`. Readers (gate, verify, publish) keep reading artifacts as JSON, so artifacts
written by earlier releases stay readable.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field
from pydantic.json_schema import SkipJsonSchema

from compress.schema.quantize import QuantScheme
from compress.schema.report import Closed, Open

MANIFEST_VERSION = 1
"""manifest.json's schema_version (the one place it is defined)."""

GATE_LISTING_VERSION = 1
"""schema_version of a gate report directory's manifest.json."""

GATE_REPORT = "gate-report"  # manifest.json `kind` of a `compress gate -o` directory

Sha256 = str


class RecipeRecord(Closed):
    """The recipe the artifact was made from."""

    path: str = Field(description="The recipe file, resolved.")
    file_sha256: Sha256 = Field(description="SHA-256 of the file's text.")
    sha256: Sha256 = Field(description="SHA-256 of the validated recipe's canonical JSON (publish excluded).")
    overrides: list[str] = Field(description="--set overrides, in order.")
    expanded: dict[str, Any] = Field(description="The validated recipe with every default filled in (recipe.schema.json).")


class ModelRecord(Open):
    """The source model: what the loader found (source, files, hashes, quantization, ...) plus these."""

    dtype: str
    architecture: str = Field(description="The transformers model class.")
    parameters: int = Field(ge=0)


class DataRecord(Closed):
    holdout: float
    calibration: dict[str, Any] | None = Field(
        description="How the calibration chunks were made, and under `checks` the result of every calibration sanity "
        "check run (check, status, where, value, limit, detail); null: no calibration text."
    )
    evaluation: dict[str, Any] | None = Field(description="How the evaluation chunks were made (null: no evaluation text).")
    tasks: list[dict[str, Any]] | SkipJsonSchema[None] = Field(
        None,
        description="The recipe's task question sets (absent: no tasks): name, kind, source and its file's SHA-256, "
        "rows read, questions evaluated, few-shot pool, and the SHA-256 of the questions exactly as scored.",
    )


class ComputeRecord(Closed):
    device: str
    threads: int
    host: str
    cpu_count: int | None


class StageRecord(Closed):
    """What one stage did: its expanded config, its time and a summary."""

    label: str = Field(description="stages[i]")
    kind: str = Field(description="A stage kind: prune, distill, quantize, kv_cache, rotate or draft")
    method: str
    config: dict[str, Any]
    duration_s: float
    summary: dict[str, Any]
    layers: dict[str, dict[str, Any]] = Field(description="Per layer: what the stage did to it.")


class QuantizedLayer(Closed):
    scheme: QuantScheme
    shape: list[int] = Field(min_length=2, max_length=2, description="[out_features, in_features]")
    stage: str = Field(description="The stage that quantized it (stages[i]), or model.source for an imported checkpoint.")
    stored_as: Literal["compressed-tensors", "records"] | SkipJsonSchema[None] = Field(
        None,
        description="Where its record is: compressed-tensors (packed in model/model.safetensors) or records "
        "(fallback-records.safetensors, for schemes pack-quantized cannot hold). Absent in artifacts of weights_format "
        "compress-quantized-v1.",
    )


class Quantization(Closed):
    weights_format: str | SkipJsonSchema[None] = Field(
        None,
        description="Layout of the artifact's weights: compressed-tensors-v2 (model/ is a compressed-tensors "
        "pack-quantized checkpoint); absent: compress-quantized-v1 (model/weights.safetensors, records unpacked).",
    )
    layers: dict[str, QuantizedLayer] = Field(description="Every quantized Linear layer by module name.")


class ManifestExport(Open):
    """An export as written: its folder, its files' SHA-256 and its verification."""

    name: str
    format: str
    path: str | SkipJsonSchema[None] = None
    files: dict[str, Sha256] | SkipJsonSchema[None] = None


class Manifest(Closed):
    """manifest.json of an artifact directory."""

    model_config = Closed.model_config | {
        "title": "compress manifest.json",
        "json_schema_extra": {
            "description": 'What an artifact is and how it was made. Non-finite numbers are written as the strings "nan", "inf", "-inf".'
        },
    }

    schema_version: Literal[MANIFEST_VERSION] = Field(
        description=f"Version of this document's layout (MANIFEST_VERSION = {MANIFEST_VERSION})."
    )
    created_at: str = Field(description="UTC time, ISO 8601.")
    command: list[str] = Field(description="The command line.")
    recipe: RecipeRecord
    seed: int
    model: ModelRecord
    data: DataRecord
    compute: ComputeRecord
    versions: dict[str, str] = Field(description="Python, compress and library versions.")
    stages: list[StageRecord]
    quantization: Quantization
    kv_cache: dict[str, Any] | SkipJsonSchema[None] = Field(None, description="The KV cache stage's scheme, runtimes and memory.")
    draft: dict[str, Any] | SkipJsonSchema[None] = Field(
        None, description="A draft stage's draft: its folder and GGUF under draft/, its size and shape, the tokenizer files it shares."
    )
    exports: list[ManifestExport] | SkipJsonSchema[None] = None
    timings: dict[str, float] | SkipJsonSchema[None] = Field(None, description="Seconds per phase.")
    files: dict[str, Sha256] | SkipJsonSchema[None] = Field(
        None,
        description="Every file of the artifact but manifest.json and the .compress-output marker (which holds "
        "manifest.json's SHA-256) -> SHA-256, by a relative path inside the artifact (`compress verify` checks them).",
    )


class GateReportListing(Closed):
    """manifest.json of a `compress gate -o` directory: each file's SHA-256 (the marker, written after it, not listed)."""

    schema_version: Literal[GATE_LISTING_VERSION]
    kind: Literal["gate-report"]
    artifact: str
    files: dict[str, Sha256]
