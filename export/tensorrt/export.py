"""The ``exports: [{format: tensorrt, ...}]`` step: the TensorRT-ready Q/DQ ONNX (``qdq.py``),
checked on ONNX Runtime CPU against the in-memory model, then a TensorRT engine (``engine.py``)
where TensorRT and an NVIDIA GPU exist. Without them the engine is skipped and the manifest and
report.json say why; a gate on the export then fails as unmeasured (never passes silently).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress import streaming
from compress.errors import FormatError
from compress.eval.metrics import Evaluation, compare
from compress.export.onnx import builder as onnx_builder
from compress.export.parity import VerifyInputs
from compress.export.tensorrt import engine as tensorrt
from compress.export.tensorrt import qdq as onnx_qdq
from compress.export.tensorrt.config import TensorRTExportConfig
from compress.progress import Reporter
from compress.quantizers.core import QuantizedWeight, refuse_gguf_grids
from compress.quantizers.kv_cache import KVCacheScheme


def check(cfg: TensorRTExportConfig, model: nn.Module, records: dict[str, QuantizedWeight], has_eval: bool) -> None:
    """Fail fast (before evaluation): onnx/onnxruntime/onnxscript present, every record has a Q/DQ form."""
    onnx_builder.require(("onnx", "onnxruntime", "onnxscript"), "the TensorRT-ready ONNX")
    refuse_gguf_grids(records, "tensorrt")
    if not cfg.fp8 and cfg.fallback is None:
        for name, record in records.items():
            if onnx_qdq.exact_precision(record.scheme) is None:
                onnx_qdq.plan_layer(name, record, None)  # raises the FormatError that explains the options
    if not has_eval:
        raise FormatError("the ONNX Runtime check runs evaluation text; the recipe has no data.evaluation")


def converted_model(model: nn.Module, plans: list[onnx_qdq.LayerPlan], dtype: torch.dtype) -> nn.Module | None:
    """A copy of the model holding what the graph holds, when a fallback or fp8 changed any layer (else None)."""
    changed = [p for p in plans if p.converted]
    if not changed:
        return None
    copy_ = copy.deepcopy(model)
    if streaming.is_streamed(copy_):  # its weights are changed in place below: read into memory
        streaming.materialize(copy_, "cpu")
    modules = dict(copy_.named_modules())
    with torch.no_grad():
        for p in changed:
            weight = modules[p.name].weight
            if p.precision == "fp8":
                new = onnx_qdq.fp8_dequantize(*onnx_qdq.fp8_quantize(p.record.dequantize(), dtype))
            else:
                new = p.record.dequantize()
            weight.copy_(new.to(weight.dtype))
    return copy_


def export(
    directory: Path,
    cfg: TensorRTExportConfig,
    model: nn.Module,
    tokenizer: Any,
    records: dict[str, QuantizedWeight],
    inputs: VerifyInputs | None,
    reporter: Reporter,
    label: str,
    kv: KVCacheScheme | None = None,
) -> tuple[dict[str, Any], list[Evaluation]]:
    assert inputs is not None and inputs.chunks is not None
    directory.mkdir(parents=True, exist_ok=True)
    dtype = onnx_qdq.GRAPH_DTYPES[cfg.dtype]
    plans = onnx_qdq.plan_layers(records, cfg.fallback, cfg.fp8, dtype)
    with reporter.status(f"{label} exporting the TensorRT-ready Q/DQ ONNX (torch.onnx dynamo)"):
        facts = onnx_qdq.write_qdq_onnx(directory, model, records, fallback=cfg.fallback, dtype=cfg.dtype, fp8=cfg.fp8, plans=plans)
    tokenizer.save_pretrained(directory)
    ids = inputs.chunks[:1, : cfg.check_tokens]
    with reporter.status(f"{label} checking the Q/DQ ONNX on ONNX Runtime CPU ({ids.shape[1]} tokens + 1 decode step)"):
        graph_model = converted_model(inputs.compressed, plans, dtype)
        check_result = onnx_qdq.check_qdq_onnx(directory, graph_model or inputs.compressed, ids)
        if graph_model is not None:  # what the declared fallbacks cost against the records
            facts["conversion_cost"] = onnx_qdq.check_qdq_onnx(directory, inputs.compressed, ids)
            del graph_model
    if check_result["kl_divergence"] > cfg.check_max_kl:
        raise FormatError(
            f"{label}: ONNX Runtime CPU on the Q/DQ ONNX differs from the model it should compute by KL "
            f"{check_result['kl_divergence']:.2e} > check_max_kl {cfg.check_max_kl}"
        )
    entry: dict[str, Any] = {
        "name": cfg.name,
        "format": "tensorrt",
        "path": None,  # set by recipe_exports.write_exports
        "onnx": facts,
        "layers": len(records),
        "onnx_check": check_result,
        "verified": True,
        "check": (
            f"Q/DQ ONNX (standard ops only) run on ONNX Runtime CPU: KL {check_result['kl_divergence']:.2e} against "
            "the model it holds" + (" (fallback-converted layers)" if "conversion_cost" in facts else "")
        ),
    }
    if kv is not None:
        entry["kv_cache"] = {
            "scheme": kv.config.describe(),
            "carried": False,
            "why": "the TensorRT-ready graph keeps its explicit past/present KV tensors in the graph's float type",
        }
    reason = tensorrt.tensorrt_unavailable_reason()
    if reason is not None:
        entry["engine"] = {"built": False, "skipped": reason}
        return entry, []
    with reporter.status(f"{label} building the TensorRT engine"):
        entry["engine"] = {"built": True, **tensorrt.build_engine(directory, directory, cfg.engine)}
    runner = tensorrt.EngineRunner(directory / tensorrt.ENGINE_FILE)
    chunks = inputs.chunks[: min(len(inputs.chunks), cfg.engine.batch.max)]
    with reporter.status(f"{label} scoring the evaluation chunks with the TensorRT engine"):
        metrics = compare(inputs.baseline, {"engine": engine_forward(runner)}, chunks, inputs.min_context)["engine"]
    return entry, [
        Evaluation(
            artifact=cfg.name,
            runtime="tensorrt",
            device=torch.cuda.get_device_name(0),
            metrics=metrics,
            details={"chunks": int(chunks.shape[0]), "seq_len": int(chunks.shape[1])},
        )
    ]


def engine_forward(runner: Any) -> Any:
    """``Forward`` for the engine: whole sequences with an empty past (the graph's explicit KV inputs)."""
    import numpy as np

    def forward(ids: torch.Tensor) -> torch.Tensor:
        batch, seq = ids.shape
        feeds: dict[str, Any] = {
            "input_ids": ids.numpy().astype(np.int64),
            "attention_mask": np.ones((batch, seq), np.int64),
            "position_ids": np.tile(np.arange(seq, dtype=np.int64), (batch, 1)),
        }
        for name in runner.inputs:
            if name.startswith("past_key_values."):
                shape = runner.engine.get_tensor_shape(name)  # [-1, kv_heads, -1, head_dim]
                feeds[name] = torch.zeros((batch, shape[1], 0, shape[3]), dtype=runner.dtypes[name])
        return runner(feeds)["logits"].float().cpu()

    return forward
