"""Encoder models (BERT-style feature extractors) to ONNX: torch.onnx export of the Hugging Face
encoder, ONNX Runtime's dynamic int8 quantization of its MatMul weights, and a check of both files
by the cosine similarity of their sentence embeddings (mean-pooled last hidden states, the way
sentence-transformers pools) against the torch model on sample texts.

``compress export-encoder SOURCE -o DIR`` drives it. Decoders go through ``format: onnx`` recipes
(onnxruntime-genai's builder); an encoder has no KV cache, so torch.onnx traces it directly.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compress.errors import FormatError
from compress.fsutil import atomic_directory
from compress.marker import ENCODER, write_marker
from compress.paths import usable_cpus

FLOAT_FILE = "model.onnx"
INT8_FILE = "model.int8.onnx"
REPORT_FILE = "encoder_report.json"
OPSET = 17
SAMPLE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.",
    "def mean(xs):\n    return sum(xs) / len(xs)",
    "ONNX Runtime runs the exported encoder on CPU with int8 weights.",
    "Prices rose 3.5% in 2024, the central bank said on Tuesday.",
    "Ünïcödé, café, 東京 and emoji 🙂 in one sentence.",
)


class _Encoder(torch.nn.Module):
    """(input_ids, attention_mask[, token_type_ids]) → last_hidden_state, for a stable export signature."""

    def __init__(self, model: torch.nn.Module, with_token_types: bool) -> None:
        super().__init__()
        self.model = model
        self.with_token_types = with_token_types

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        kwargs = {"token_type_ids": token_type_ids} if self.with_token_types else {}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state


def mean_pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Sentence embeddings: the mean of each sequence's unmasked token states."""
    m = mask[..., None].astype(np.float64)
    return (hidden.astype(np.float64) * m).sum(1) / np.maximum(m.sum(1), 1.0)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1) + 1e-12)


def load_encoder(source: str | Path) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    config = AutoConfig.from_pretrained(source)
    if (
        getattr(config, "is_decoder", False)
        or getattr(config, "is_encoder_decoder", False)
        or config.architectures
        and any(a.endswith("ForCausalLM") for a in config.architectures)
    ):
        raise FormatError(f"{source}: a decoder ({config.architectures}); export decoders with a recipe's `format: onnx`")
    # eager attention: the SDPA path builds its mask with Python-side checks that a trace freezes
    model = AutoModel.from_pretrained(source, dtype=torch.float32, attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(source)


def export_encoder(
    source: str | Path,
    out_dir: Path,
    texts: list[str] | None = None,
    int8: bool = True,
    min_cosine_fp32: float = 0.9999,
    min_cosine_int8: float = 0.99,
    threads: int | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Export, quantize and check; writes ``out_dir`` atomically (model.onnx, model.int8.onnx, tokenizer,
    config, encoder_report.json, the marker) and returns the report. Raises FormatError when a check
    fails. An existing ``out_dir`` is replaced only with ``overwrite`` and when compress wrote it."""
    with atomic_directory(Path(out_dir), overwrite, ENCODER) as tmp:
        report = _export(source, tmp, texts, int8, min_cosine_fp32, min_cosine_int8, threads)
        write_marker(tmp, ENCODER)
    return report


def _export(
    source: str | Path,
    tmp: Path,
    texts: list[str] | None,
    int8: bool,
    min_cosine_fp32: float,
    min_cosine_int8: float,
    threads: int | None,
) -> dict[str, Any]:
    """The export, its int8 copy and their checks, written into ``tmp``; the report."""
    import onnxruntime as ort

    model, tokenizer = load_encoder(source)
    texts = list(texts or SAMPLE_TEXTS)
    batch = tokenizer(texts, padding=True, truncation=True, max_length=128, return_tensors="pt")
    with_types = "token_type_ids" in batch
    names = ["input_ids", "attention_mask", *(["token_type_ids"] if with_types else [])]
    started = time.perf_counter()
    wrapper = _Encoder(model, with_types).eval()  # a fresh Module is in training mode: dropout would stay on
    args = tuple(batch[n] for n in names)
    axes = {n: {0: "batch", 1: "sequence"} for n in names} | {"last_hidden_state": {0: "batch", 1: "sequence"}}
    with torch.no_grad():
        torch.onnx.export(
            wrapper,
            args,
            str(tmp / FLOAT_FILE),
            input_names=names,
            output_names=["last_hidden_state"],
            dynamic_axes=axes,
            opset_version=OPSET,
            dynamo=False,
        )
    files = [FLOAT_FILE]
    if int8:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(str(tmp / FLOAT_FILE), str(tmp / INT8_FILE), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"])
        files.append(INT8_FILE)
    export_seconds = time.perf_counter() - started
    with torch.no_grad():
        reference = mean_pool(wrapper(*args).numpy(), batch["attention_mask"].numpy())
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or usable_cpus()
    feeds = {n: batch[n].numpy().astype(np.int64) for n in names}
    checks: dict[str, Any] = {}
    for name, minimum in ((FLOAT_FILE, min_cosine_fp32), (INT8_FILE, min_cosine_int8)):
        if name not in files:
            continue
        session = ort.InferenceSession(str(tmp / name), options, providers=["CPUExecutionProvider"])
        got = mean_pool(session.run(None, feeds)[0], batch["attention_mask"].numpy())
        sims = cosine(reference, got)
        checks[name] = {
            "min_cosine": float(sims.min()),
            "mean_cosine": float(sims.mean()),
            "required": minimum,
            "size_bytes": (tmp / name).stat().st_size,
        }
        if sims.min() < minimum:
            raise FormatError(
                f"{name}: sentence-embedding cosine similarity to the torch model is {sims.min():.5f} on one of "
                f"{len(texts)} texts, below the required {minimum}"
            )
    tokenizer.save_pretrained(tmp)
    model.config.save_pretrained(tmp)
    report = {
        "source": str(source),
        "architecture": (model.config.architectures or [type(model).__name__])[0],
        "opset": OPSET,
        "exporter": f"torch.onnx (TorchScript, torch {torch.__version__})",
        "inputs": names,
        "int8": "onnxruntime.quantization.quantize_dynamic: int8 MatMul weights (per tensor), activations quantized at run time"
        if int8
        else None,
        "texts": len(texts),
        "pooling": "mean over the attention mask",
        "checks": checks,
        "export_seconds": round(export_seconds, 1),
        "onnxruntime": ort.__version__,
    }
    (tmp / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report
