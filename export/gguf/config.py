"""The GGUF format's recipe config (``exports: [{format: gguf, ...}]``) and the type names it accepts:
torch-free, validated when the recipe is (compress validate)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from compress.quantizers.grids import GRID_NAMES, normalize_type
from compress.schema.base import Strict
from compress.schema.exports import FORMAT_DOC, BaseExportConfig
from compress.schema.quantize import SENSITIVITY_SAMPLES

GGUF = "gguf"
GGUF_FLOAT_TYPES = ("f32", "f16", "bf16")
GGUF_EXACT_TYPES = GRID_NAMES  # blocks our records map into exactly (K-quants: records on their grid)
GGUF_FP4_TYPES = ("mxfp4",)  # blocks an fp4 stage's records (quantizers/fp4.py) map into exactly, by their format
GGUF_RECORD_TYPES = (*GGUF_FLOAT_TYPES, *GGUF_EXACT_TYPES, *GGUF_FP4_TYPES)
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
GGUFMatrixType = Literal[(*GGUF_FLOAT_TYPES, *GGUF_EXACT_TYPES)]  # type: ignore[valid-type]  # a float type or any grid: what token_embd may be


MIX_TYPES = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q8_0")
"""The types a budget chooses from by default: the K-quant ladder and Q8_0 (each row width maps to
the type or its fallback, quantizers/grids.py)."""


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
        SENSITIVITY_SAMPLES,
        ge=1,
        description="Calibration chunks the sensitivity pass (one forward and one backward through the model, block by block) runs on.",
    )
    tables: bool = Field(
        True,
        description="The token embedding and an untied output head (a tied model's one table) take part in the budget like "
        "any layer: each gets the type of `types` (or its fallback) the estimate and the budget choose, rounded with the "
        "quantizers' parameter search and packed exactly. false: they keep float_type (Q8_0 by default) and count against "
        "the budget as they are.",
    )

    @field_validator("types", mode="before")
    @classmethod
    def _spellings(cls, v: object) -> object:
        return [normalize_type(t) for t in v] if isinstance(v, list) else v

    @model_validator(mode="after")
    def _one_budget(self) -> GGUFTarget:
        if (self.bits_per_weight is None) == (self.size_mib is None):
            raise ValueError("give exactly one of bits_per_weight and size_mib")
        unknown = [t for t in self.types if t not in GRID_NAMES]
        if unknown:
            raise ValueError(f"types: {', '.join(unknown)} is not a block type our quantizers make; expected {', '.join(GRID_NAMES)}")
        return self

    def describe(self) -> str:
        return f"{self.bits_per_weight:g} bits/weight" if self.bits_per_weight is not None else f"{self.size_mib:g} MiB"


class GGUFExportConfig(BaseExportConfig):
    """A GGUF file for llama.cpp (exports/<name>/model.gguf), verified in llama.cpp."""

    own_runtime: ClassVar[bool] = True
    float_refusals: ClassVar[dict[str, str | None]] = {
        "fp8": "llama.cpp has no FP8 (E4M3) tensor type, so a GGUF file cannot hold these weights",
        "mxfp4": None,  # packed exactly into MXFP4 blocks (export/gguf/blocks.py pack_mxfp4)
        "nvfp4": "GGUF's NVFP4 block (64 weights, four unsigned E4M3 scales of 16) has no float32 per-tensor global scale, "
        "so weights e2m1 x scale / global_scale are no NVFP4 block's values (the pinned llama.cpp reads such a scale only "
        "from per-tensor scale tensors of its own, which this export does not write); quantize with format: mxfp4 for GGUF",
    }

    format: Literal["gguf"] = Field("gguf", description=FORMAT_DOC)
    type: str = Field(
        "auto",
        description="Block type, in our or llama.cpp's spelling (q4_k, Q4_K_M, F16; any case). With quantizer records: auto "
        "(the records' gguf_type; else q4_0 for symmetric 4-bit records, q4_1 for other 4-bit, q8_0 for 8-bit symmetric, f16 "
        "without records), " + ", ".join(GGUF_EXACT_TYPES) + " (records packed exactly; K-quants from records quantized "
        "with that gguf_type, rows not a multiple of 256 in llama.cpp's fallback type), mxfp4 (an fp4 stage's format: mxfp4 "
        "records, exactly; auto picks it), f32, f16, bf16. With quantizer "
        "llama.cpp: " + ", ".join(GGUF_LLAMA_CPP_TYPES) + " (llama.cpp re-quantizes our F16 file; the _S/_M/_L mixes only here).",
    )
    quantizer: Literal["records", "llama.cpp"] | None = Field(
        None,
        description="records: pack our records exactly; llama.cpp: llama.cpp's own quantizer from our F16 file. Default: "
        "records for auto, the float types, q4_0, q4_1, q8_0, q3_k, q4_k, q5_k; for q2_k, q5_0, q5_1, q6_k records when "
        "they lie on that type's grid (gguf_type), else llama.cpp; llama.cpp for the mixes (q4_k_m …).",
    )
    float_type: GGUFMatrixType | None = Field(
        None,
        description="Type of weight matrices without a record (embeddings, output head, layers left unquantized): a float "
        "type or any block type (" + ", ".join(GGUF_EXACT_TYPES) + "; rounded with the quantizers' parameter search, "
        "Q8_0 and BF16 with llama.cpp's reference rounding; a row a K-quant does not divide gets its fallback, one no type "
        "divides F16); default q8_0 for quantized types (as llama.cpp stores SmolLM-sized embeddings), else the type "
        "itself. With quantizer llama.cpp: the token-embedding type passed to its quantizer (default: its own choice).",
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
