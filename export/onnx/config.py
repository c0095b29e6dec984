"""The ONNX format's recipe config (``exports: [{format: onnx, ...}]``): torch-free, validated when
the recipe is (compress validate)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from compress.schema.exports import FORMAT_DOC, BaseExportConfig

ONNX = "onnx"
ONNX_PRECISIONS = ("fp32", "fp16", "int8", "int4", "w8a8")
# what onnxruntime-genai's builder makes for each execution provider (w8a8: its fp32 graph with our Q/DQ layers)
ONNX_DEVICE_PRECISIONS = {"cpu": ("fp32", "int8", "int4", "w8a8"), "cuda": ("fp32", "fp16", "int8", "int4")}
W8A8 = "w8a8"
W8A8_TABLES = (
    "keep_float does not apply to precision w8a8: the file's head and embeddings are what the quantize stage left, as the "
    "in-memory model computes them (the head a W8A8 layer when the stage quantized it, ignore: [], else float; the "
    "embeddings float); leave keep_float out"
)


class ONNXExportConfig(BaseExportConfig):
    """An ONNX model for ONNX Runtime / ONNX Runtime GenAI (exports/<name>/model.onnx + genai_config.json),
    made by onnxruntime-genai's model builder and verified in ONNX Runtime."""

    own_runtime: ClassVar[bool] = True
    float_refusals: ClassVar[dict[str, str | None]] = {
        "fp8": "the ONNX export does not write float8 DequantizeLinear initializers yet (onnxruntime 1.32 does run a "
        "float8e4m3fn QuantizeLinear/DequantizeLinear/MatMul graph on the CPU: docs/fp8.md)"
    }

    format: Literal["onnx"] = Field("onnx", description=FORMAT_DOC)
    precision: Literal["auto", "fp32", "fp16", "int8", "int4", "w8a8"] = Field(
        "auto",
        description="Weight precision: int4 / int8 (MatMulNBits, float activations), fp32, fp16 (cuda), w8a8 (a w8a8 stage's "
        "int8 weights and per-token int8 activations as standard QuantizeLinear/DequantizeLinear + MatMul, cpu). auto: w8a8 "
        "for a w8a8 stage's records, else int4 or int8 from the records' bits, fp32 without records.",
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
        "proven like every other record. [lm_head, embeddings] keeps both float: more bytes, less error. Not for precision "
        "w8a8, whose tables are what the quantize stage left.",
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
        if self.precision == W8A8 and self.keep_float is not None:
            raise ValueError(W8A8_TABLES)
        return self

    def activation_refusal(self) -> str | None:
        """Precision w8a8 (and auto, which picks it for a w8a8 stage's records) holds int8 per-token activations;
        the other precisions are weight-only."""
        if self.precision in ("auto", W8A8) and self.quantizer != "builder":
            return None
        if self.quantizer == "builder":
            return "quantizer: builder rounds the float weights itself, weight-only; leave quantizer out (records)"
        return (
            f"precision {self.precision} cannot hold activation quantization (weight-only: it would run the int8 weights on "
            f"float activations, another model); set precision: w8a8 or auto"
        )

    def float_tables(self, precision: str) -> tuple[str, ...]:
        """The tables kept float in an export of ``precision``: keep_float, or the builder's own layout."""
        if precision not in ("int4", "int8"):
            return ("lm_head", "embeddings")
        if self.keep_float is not None:
            return tuple(self.keep_float)
        return () if precision == "int4" else ("embeddings",)
