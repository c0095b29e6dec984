"""The recipe's ``exports:`` items: one config class per format, discriminated by ``format``.

Torch-free, so the recipe schema can import it cheaply. What each format *does* lives in its
package (export/<format>/) and its spec in compress.plugins.EXPORT_FORMATS.

The built-in formats form the discriminated union ``ExportConfig`` (and so the JSON Schema). A
format registered only in the table is known to validation through the validation context: the
recipe loader (compress/recipe.py) passes ``{EXPORT_CONFIGS: {name: config class}}`` from the
table, and an ``exports`` item whose ``format`` is not built in is validated by that config class.
This module never imports the table (the schema is the bottom layer).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializeAsAny,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)

from compress.schema.base import Strict
from compress.schema.gguf_types import GGUF_GRID_TYPES, normalize_type

COMPRESSED_TENSORS = "compressed-tensors"
GPTQ = "gptq"
GGUF = "gguf"
ONNX = "onnx"
TENSORRT = "tensorrt"
BUILTIN_FORMATS = (COMPRESSED_TENSORS, GPTQ, GGUF, ONNX, TENSORRT)  # the ExportConfig union; the table (compress.plugins) may add more
FORMATS_DOC = " | ".join(BUILTIN_FORMATS)
EXPORTS_DIR = "exports"
RESERVED_NAMES = ("baseline", "compressed")  # the in-memory artifacts gates already know
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
EXPORT_CONFIGS = "export_configs"  # validation-context key: {format name: config class} of every format in the table


class BaseExportConfig(Strict):
    own_runtime: ClassVar[bool] = False
    """Runs on a runtime of its own (verified and timed there; ``latency.artifacts`` may name it);
    False: a checkpoint holding the compressed records, gated on the ``compressed`` evaluation."""

    name: str | None = Field(
        None,
        description="Names the export in reports and gates and its folder exports/<name>/ in the artifact; "
        "defaults to the format; unique within the recipe.",
    )

    @model_validator(mode="after")
    def _default_name(self) -> BaseExportConfig:
        if self.name is None:
            self.name = self.format
        if not NAME_PATTERN.fullmatch(self.name):  # fullmatch: "$" alone would let a trailing newline through
            raise ValueError(f"export name {self.name!r} must be letters, digits, '.', '_' or '-' (it names a folder)")
        if self.name in RESERVED_NAMES:
            raise ValueError(f"export name '{self.name}' is reserved for the in-memory artifacts {', '.join(RESERVED_NAMES)}")
        return self


class CompressedTensorsExportConfig(BaseExportConfig):
    """compressed-tensors pack-quantized HF directory (transformers with compressed-tensors, vLLM)."""

    format: Literal["compressed-tensors"] = Field("compressed-tensors", description=FORMATS_DOC)


class GPTQExportConfig(BaseExportConfig):
    """AutoGPTQ v1 HF directory (GPTQModel, AutoGPTQ, transformers with optimum/gptqmodel, vLLM)."""

    format: Literal["gptq"] = Field("gptq", description=FORMATS_DOC)


GGUF_FLOAT_TYPES = ("f32", "f16", "bf16")
GGUF_EXACT_TYPES = GGUF_GRID_TYPES  # blocks our records map into exactly (K-quants: records on their grid)
GGUF_RECORD_TYPES = (*GGUF_FLOAT_TYPES, *GGUF_EXACT_TYPES)
# Types llama.cpp's quantizer also makes that were exported by it before our quantizers had their grids: without
# `quantizer:` they stay llama.cpp's unless the records lie on the type's grid (GGUFExportConfig.records_by_default).
GGUF_LLAMA_CPP_ONLY_BY_DEFAULT = ("q5_0", "q5_1", "q2_k", "q6_k")
# llama.cpp's file types made by its quantizer, by our lower-case names (gguf.LlamaFileType members).
GGUF_LLAMA_CPP_TYPES = (
    "q4_0",
    "q4_1",
    "q5_0",
    "q5_1",
    "q8_0",
    "q2_k",
    "q3_k_s",
    "q3_k_m",
    "q3_k_l",
    "q4_k_s",
    "q4_k_m",
    "q5_k_s",
    "q5_k_m",
    "q6_k",
    "iq4_nl",
    "iq4_xs",
    "f16",
    "bf16",
)
GGUFFloat = Literal["f32", "f16", "bf16", "q8_0"]


MIX_TYPES = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q8_0")
"""The types a budget chooses from by default: the K-quant ladder and Q8_0 (each row width maps to
the type or its fallback, compress/schema/gguf_types.py)."""


class GGUFTarget(Strict):
    """A size budget for a GGUF export: one block type per quantized tensor, chosen from measured
    sensitivity so that the file keeps within the budget (docs/exports/gguf.md, "Mixed precision")."""

    bits_per_weight: float | None = Field(
        None,
        gt=1,
        le=16,
        description="Average bits per weight of the whole file's tensors (all of them: embeddings, norms and the quantized "
        "matrices), as llama.cpp reports it (tensor bytes x 8 / parameters).",
    )
    size_mib: float | None = Field(None, gt=0, description="Largest file size in MiB (2**20 bytes), metadata included.")
    types: list[str] = Field(
        default_factory=lambda: list(MIX_TYPES),
        min_length=1,
        description="Block types a quantized tensor may get (llama.cpp's spellings accepted); a row width that a K-quant "
        "does not divide gets the type's fallback, as llama.cpp does.",
    )
    samples: int = Field(
        8,
        ge=1,
        description="Calibration chunks the sensitivity pass (one forward and one backward through the model, block by block) runs on.",
    )

    @field_validator("types", mode="before")
    @classmethod
    def _spellings(cls, v: object) -> object:
        return [normalize_type(t) for t in v] if isinstance(v, list) else v

    @model_validator(mode="after")
    def _one_budget(self) -> GGUFTarget:
        if (self.bits_per_weight is None) == (self.size_mib is None):
            raise ValueError("give exactly one of bits_per_weight and size_mib")
        unknown = [t for t in self.types if t not in GGUF_GRID_TYPES]
        if unknown:
            raise ValueError(f"types: {', '.join(unknown)} is not a block type our quantizers make; expected {', '.join(GGUF_GRID_TYPES)}")
        return self

    def describe(self) -> str:
        return f"{self.bits_per_weight:g} bits/weight" if self.bits_per_weight is not None else f"{self.size_mib:g} MiB"


class GGUFExportConfig(BaseExportConfig):
    """A GGUF file for llama.cpp (exports/<name>/model.gguf), verified in llama.cpp."""

    own_runtime: ClassVar[bool] = True

    format: Literal["gguf"] = Field("gguf", description=FORMATS_DOC)
    type: str = Field(
        "auto",
        description="Block type, in our or llama.cpp's spelling (q4_k, Q4_K_M, F16; any case). With quantizer records: auto "
        "(the records' gguf_type; else q4_0 for symmetric 4-bit records, q4_1 for other 4-bit, q8_0 for 8-bit symmetric, f16 "
        "without records), " + ", ".join(GGUF_EXACT_TYPES) + " (records packed exactly; K-quants from records quantized "
        "with that gguf_type, rows not a multiple of 256 in llama.cpp's fallback type), f32, f16, bf16. With quantizer "
        "llama.cpp: " + ", ".join(GGUF_LLAMA_CPP_TYPES) + " (llama.cpp re-quantizes our F16 file; the _S/_M/_L mixes only here).",
    )
    quantizer: Literal["records", "llama.cpp"] | None = Field(
        None,
        description="records: pack our records exactly; llama.cpp: llama.cpp's own quantizer from our F16 file. Default: "
        "records for auto, the float types, q4_0, q4_1, q8_0, q3_k, q4_k, q5_k; for q2_k, q5_0, q5_1, q6_k records when "
        "they lie on that type's grid (gguf_type), else llama.cpp; llama.cpp for the mixes (q4_k_m …).",
    )
    float_type: GGUFFloat | None = Field(
        None,
        description="Type of weight matrices without a record (embeddings, output head, layers left unquantized); "
        "default q8_0 for quantized types (as llama.cpp stores SmolLM-sized embeddings), else the type itself. "
        "With quantizer llama.cpp: the token-embedding type passed to its quantizer (default: its own choice).",
    )
    fallback: GGUFFloat | None = Field(
        None,
        description="Type for records that cannot become the block type exactly (3-bit, group size not a multiple of "
        "32, …); recorded per layer in the manifest. Default none: such records are an error.",
    )
    pre_tokenizer: str = Field("auto", description="llama.cpp pre-tokenizer name; auto recognizes it from tokenizer.json.")
    keep_float: list[Literal["embeddings"]] = Field(
        default_factory=list,
        description="With quantizer records, when the source ties the output head to the token embeddings and the "
        "quantize stage quantized the head (ignore: []): by default the file holds one table, token_embd from the head's "
        "record, which llama.cpp reads for both (as for every tied model). [embeddings] keeps the embedding table at "
        "float_type beside the head's output.weight instead: more bytes, less error.",
    )
    verify: bool = Field(
        True,
        description="Run the file in llama.cpp after writing it: tokenizer parity, metrics against the "
        "baseline on the evaluation chunks, and the same-weights check (needs the gguf extra).",
    )
    verify_samples: int | None = Field(None, ge=1, description="Evaluation chunks scored in llama.cpp; default all of them.")
    same_weights_max_kl: float = Field(
        0.02,
        gt=0,
        description="Largest KL (nats/token) allowed between llama.cpp on this file and our in-memory model with "
        "the same weights; llama.cpp quantizes activations internally, so it is small but not zero. A larger value is a layout bug.",
    )
    target: GGUFTarget | None = Field(
        None,
        description="A size budget ({bits_per_weight: 3.9} or {size_mib: 80}): each quantized tensor gets the block type "
        "a quantize stage with `gguf_target: true` chose for it from measured sensitivity, within the budget (type auto, "
        "quantizer records). The choice and the size reached go into the manifest.",
    )

    _quantizer_defaulted: bool = PrivateAttr(False)

    @field_validator("type", "float_type", "fallback", mode="before")
    @classmethod
    def _llama_cpp_spelling(cls, v: object) -> object:
        """llama.cpp's spellings (Q4_K_M, F16) are accepted in any case."""
        return normalize_type(v)

    @property
    def records_by_default(self) -> bool:
        """No quantizer was named and llama.cpp's quantizer also makes this type (q2_k, q5_0, q5_1,
        q6_k): the export packs the records when they lie on the type's grid, else uses llama.cpp's."""
        return self._quantizer_defaulted and self.type in GGUF_RECORD_TYPES

    @model_validator(mode="after")
    def _check_type(self) -> GGUFExportConfig:
        if self.quantizer is None:
            self._quantizer_defaulted = True
            ours = self.type == "auto" or (self.type in GGUF_RECORD_TYPES and self.type not in GGUF_LLAMA_CPP_ONLY_BY_DEFAULT)
            self.quantizer = "records" if ours else "llama.cpp"
        allowed = ("auto", *GGUF_RECORD_TYPES) if self.quantizer == "records" else GGUF_LLAMA_CPP_TYPES
        base, _, mix = self.type.rpartition("_")
        if self.quantizer == "records" and mix in ("s", "m", "l") and base in GGUF_EXACT_TYPES:
            raise ValueError(
                f"gguf type {self.type.upper()} is llama.cpp's per-tensor mix (its rule gives some tensors other types, "
                f"e.g. Q6_K for attn_v / ffn_down in Q4_K_M); quantizer records writes every record on one grid: use type "
                f"{base} with records quantized on gguf_type: {base}, or quantizer: llama.cpp to make the mix from our F16 file"
            )
        if self.type not in allowed:
            raise ValueError(f"gguf type '{self.type}' with quantizer {self.quantizer}: expected one of {', '.join(allowed)}")
        if self.quantizer == "llama.cpp" and self.fallback is not None:
            raise ValueError("fallback applies to quantizer records; llama.cpp's quantizer chooses its own types")
        if self.target is not None and (self.type != "auto" or self.quantizer != "records"):
            raise ValueError(
                f"target picks a type per tensor, and this export names type {self.type.upper()} with quantizer {self.quantizer}; "
                "leave type and quantizer out (auto, records)"
            )
        return self


ONNX_PRECISIONS = ("fp32", "fp16", "int8", "int4")
# what onnxruntime-genai's builder makes for each execution provider
ONNX_DEVICE_PRECISIONS = {"cpu": ("fp32", "int8", "int4"), "cuda": ("fp32", "fp16", "int8", "int4")}


class ONNXExportConfig(BaseExportConfig):
    """An ONNX model for ONNX Runtime / ONNX Runtime GenAI (exports/<name>/model.onnx + genai_config.json),
    made by onnxruntime-genai's model builder and verified in ONNX Runtime."""

    own_runtime: ClassVar[bool] = True

    format: Literal["onnx"] = Field("onnx", description=FORMATS_DOC)
    precision: Literal["auto", "fp32", "fp16", "int8", "int4"] = Field(
        "auto",
        description="Weight precision: int4 / int8 (MatMulNBits), fp32, fp16 (cuda). auto: int4 or int8 from the "
        "records' bits, fp32 without records.",
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="Execution provider the builder targets: cpu | cuda.")
    quantizer: Literal["records", "builder"] | None = Field(
        None,
        description="records: our codes and scales, proven equal in the file (the builder gets our GPTQ checkpoint; "
        "when it cannot read it exactly we write the MatMulNBits initializers ourselves). builder: the builder's own "
        "round-to-nearest quantizer on the float model (for comparison). Default: records when the model has records.",
    )
    block_size: Literal[16, 32, 64, 128, 256] | None = Field(
        None,
        description="MatMulNBits block size for quantizer builder (default 32, the builder's); with records it follows their group size.",
    )
    symmetric: bool = Field(True, description="Quantizer builder only: symmetric blocks (no zero points).")
    keep_float: list[Literal["lm_head", "embeddings"]] | None = Field(
        None,
        description="Tables an int export keeps in float. Default: as onnxruntime-genai's builder lays out its own int4 "
        "(the output head and the token embeddings quantized, one table for both when the source ties them) and its int8 "
        "(head quantized, embeddings float; keep_float: [] quantizes them too). A quantized head "
        "keeps its record (ignore: [] on the quantize stage) or is rounded to nearest at export in the records' scheme; "
        "the embeddings go into a GatherBlockQuantized that reads the head's blocks (tied) or a table of their own, "
        "proven like every other record. [lm_head, embeddings] keeps both float: more bytes, less error.",
    )
    accuracy_level: Literal[0, 1, 2, 3, 4] = Field(
        4,
        description="MatMulNBits accuracy_level shipped in the file: 4 (int8 activations, fastest on CPU, ~1e-2 logit "
        "error), 0 (float activations, exact). The exactness check always runs a level-0 copy.",
    )
    verify: bool = Field(
        True,
        description="Run the model in ONNX Runtime after writing it: tokenizer parity with ONNX Runtime "
        "GenAI, same-weights check, metrics against the baseline, a greedy sample (needs the onnx extra).",
    )
    verify_samples: int | None = Field(None, ge=1, description="Evaluation chunks scored in ONNX Runtime; default all of them.")
    same_weights_max_kl: float = Field(
        0.02,
        gt=0,
        description="Largest KL (nats/token) allowed between the shipped file in ONNX Runtime and our in-memory "
        "model with the same weights; accuracy_level 4 quantizes activations, so it is small but not zero.",
    )

    @model_validator(mode="after")
    def _check_precision(self) -> ONNXExportConfig:
        if self.precision != "auto" and self.precision not in ONNX_DEVICE_PRECISIONS[self.device]:
            raise ValueError(
                f"onnx precision {self.precision} on {self.device}: the builder makes "
                f"{', '.join(ONNX_DEVICE_PRECISIONS[self.device])} there"
            )
        if self.quantizer == "builder" and self.precision not in ("int4", "int8"):
            raise ValueError("quantizer builder needs precision int4 or int8")
        if self.block_size is not None and self.quantizer != "builder":
            raise ValueError("block_size applies to quantizer builder; with records the block size follows their group size")
        if self.keep_float is not None and len(set(self.keep_float)) != len(self.keep_float):
            raise ValueError(f"keep_float names a table twice: {self.keep_float}")
        return self

    def float_tables(self, precision: str) -> tuple[str, ...]:
        """The tables kept float in an export of ``precision``: keep_float, or the builder's own layout."""
        if precision not in ("int4", "int8"):
            return ("lm_head", "embeddings")
        if self.keep_float is not None:
            return tuple(self.keep_float)
        return () if precision == "int4" else ("embeddings",)


# Axis names of the TensorRT-ready graph's inputs and outputs (what its optimization profiles are keyed by).
BATCH, SEQUENCE, PAST, TOTAL = "batch", "sequence", "past_sequence", "total_sequence"


class DimRange(Strict):
    """Smallest, typical (what TensorRT tunes kernels for) and largest size of one dynamic axis."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min: int = Field(ge=0)
    opt: int = Field(ge=0)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> DimRange:
        if not self.min <= self.opt <= self.max:
            raise ValueError(f"expected min <= opt <= max, got min={self.min} opt={self.opt} max={self.max}")
        return self

    def __add__(self, other: DimRange) -> DimRange:
        return DimRange(min=self.min + other.min, opt=self.opt + other.opt, max=self.max + other.max)


class TensorRTConfig(Strict):
    """`tensorrt:` settings of an engine build."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch: DimRange = Field(DimRange(min=1, opt=1, max=4), description="Sequences per call.")
    sequence: DimRange = Field(
        DimRange(min=1, opt=128, max=1024), description="New tokens per call (prompt length in prefill, 1 when decoding)."
    )
    past: DimRange = Field(DimRange(min=0, opt=256, max=1024), description="Cached tokens before the call (0 in prefill).")
    workspace_mib: int = Field(4096, ge=64, description="Scratch memory TensorRT may use while building and running.")
    timing_cache: Path | None = Field(
        None,
        strict=False,  # a path is written as a string
        description="Kernel timing cache: loaded when the file exists, saved after the build (speeds up rebuilds). "
        "Default: timing.cache next to the engine.",
    )

    @model_validator(mode="after")
    def _sizes(self) -> TensorRTConfig:
        if self.batch.min < 1:
            raise ValueError("batch.min must be at least 1")
        if self.sequence.min < 1:
            raise ValueError("sequence.min must be at least 1 (every call feeds at least one token)")
        return self

    def axis_ranges(self) -> dict[str, DimRange]:
        """Range of every axis name the ONNX graph uses; total_sequence (the mask) is past + sequence."""
        return {BATCH: self.batch, SEQUENCE: self.sequence, PAST: self.past, TOTAL: self.past + self.sequence}


class TensorRTExportConfig(BaseExportConfig):
    """A TensorRT-ready ONNX (standard ops, weights as explicit Q/DQ, explicit past/present KV tensors),
    checked on ONNX Runtime CPU, and a TensorRT engine built from it where TensorRT and a GPU exist."""

    own_runtime: ClassVar[bool] = True

    format: Literal["tensorrt"] = Field("tensorrt", description=FORMATS_DOC)
    dtype: Literal["float16", "float32"] = Field(
        "float16",
        description="Float type of the graph (activations, KV cache, logits, scales); TensorRT's int4 weight-only "
        "path runs with float16 activations.",
    )
    fallback: Literal["symmetric", "int8"] | None = Field(
        None,
        description="For records with no exact Q/DQ form (asymmetric, groups other than 64/128, other bits): symmetric "
        "(re-quantize to int4 blocks of 64/128) or int8 (per-channel); each converted layer is listed in the manifest with "
        "its largest weight change. Default none: such records are an error.",
    )
    fp8: bool = Field(False, description="Write every quantized layer as float8 e4m3fn with per-channel scales.")
    engine: TensorRTConfig = Field(
        default_factory=TensorRTConfig, description="Optimization profile, workspace and timing cache of the engine build."
    )
    check_tokens: int = Field(
        32,
        ge=2,
        description="Tokens of evaluation text the ONNX Runtime CPU check runs (prefill plus "
        "one decode step fed back through the explicit KV tensors).",
    )
    check_max_kl: float = Field(
        1e-3,
        gt=0,
        description="Largest KL (nats/token) allowed between ONNX Runtime CPU on the Q/DQ ONNX "
        "and our in-memory model (float16 graphs round activations).",
    )


def _registered(info: ValidationInfo) -> dict[str, type[BaseExportConfig]]:
    """The formats the table registers beyond the built-in ones (from the validation context)."""
    configs = (info.context or {}).get(EXPORT_CONFIGS) or {}
    return {name: cls for name, cls in configs.items() if name not in BUILTIN_FORMATS}


def _known_format(value: Any, info: ValidationInfo) -> Any:
    available = [*BUILTIN_FORMATS, *_registered(info)]
    if isinstance(value, dict) and "format" not in value:
        raise ValueError(f"an export names its format: format: {' | '.join(available)}")
    if isinstance(value, dict) and (not isinstance(value["format"], str) or value["format"] not in available):
        raise ValueError(f"export format '{value['format']}' is not available; available: {', '.join(available)}")
    return value


def _table_format(value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
    """An item of a format registered only in the table: validated by its config class from the context."""
    registered = _registered(info)
    if isinstance(value, dict) and isinstance(value.get("format"), str) and value["format"] in registered:
        return registered[value["format"]].model_validate(value, context=info.context)
    if isinstance(value, tuple(registered.values())):
        return value
    return handler(value)


ExportConfig = Annotated[
    CompressedTensorsExportConfig | GPTQExportConfig | GGUFExportConfig | ONNXExportConfig | TensorRTExportConfig,
    Field(discriminator="format"),
    BeforeValidator(_known_format),
    WrapValidator(_table_format),
    SerializeAsAny(),  # an item of a registered format dumps as its own class
]
