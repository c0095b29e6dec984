"""TensorRT-ready ONNX: standard ONNX operators only, quantized weights as explicit Q/DQ.

The graph is torch.onnx's (dynamo) export of a wrapper with explicit past/present tensors:

* inputs ``input_ids`` [batch, sequence], ``attention_mask`` [batch, total_sequence],
  ``position_ids`` [batch, sequence], ``past_key_values.{i}.key|value`` [batch, kv_heads, past_sequence, head_dim];
* outputs ``logits`` [batch, sequence, vocab] and ``present.{i}.key|value`` [batch, kv_heads, total_sequence, head_dim]
  (``total_sequence`` = ``past_sequence + sequence``; prefill feeds a past of length 0).

During the export every quantized Linear is stood in for by a ``MatMul(x, weight_t)`` with the
weight stored input-major ([in, out], the MatMul's B operand), so its initializer keeps a known
name. Afterwards that float initializer is replaced by a quantized one feeding a
``DequantizeLinear`` (opset 21) in front of the same MatMul:

* ``int4``: symmetric records with group size 64 or 128, exactly (``code - 8``), blocked DQ with
  ``axis=0`` (the input dimension) and ``block_size`` = group size, scales [n_groups, out], no zero
  point (TensorRT rejects zero points); a partial last block is allowed by the ONNX specification;
* ``int8``: symmetric 8-bit per-channel records, exactly (``code - 128``), per-axis DQ with
  ``axis=1`` (output channels of the [in, out] operand), scales [out];
* ``fp8``: requested with ``fp8=True``: float8 e4m3fn from the record's dequantized weight, per
  output channel scale ``absmax / 448``.

Records that none of these carries exactly (asymmetric, other group sizes or bit widths) go
through the declared ``fallback`` — ``symmetric`` (int4, block 64 for groups up to 64, else 128)
or ``int8`` (per-channel) — and each conversion is listed in the facts with the largest weight
change it made. Without a fallback they are a ``FormatError``.
"""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from compress import streaming
from compress.errors import FormatError
from compress.export.tensorrt.config import BATCH, PAST, SEQUENCE, TOTAL
from compress.paths import usable_cpus
from compress.quantizers.core import QuantizedWeight
from compress.schema.quantize import QuantScheme

OPSET = 21  # DequantizeLinear's block_size attribute and the INT4 type start at opset 21
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
STANDARD_DOMAINS = ("", "ai.onnx")
INT4_BLOCKS = (64, 128)
FALLBACKS = ("symmetric", "int8")
GRAPH_DTYPES = {"float32": torch.float32, "float16": torch.float16}
FP8_MAX = 448.0  # largest finite float8 e4m3fn

_WRAPPER = "lm"  # attribute holding the model inside the export wrapper: initializer names start with "lm."

Precision = Literal["int4", "int8", "fp8"]


# --------------------------------------------------------------------------- planning (pure)


@dataclass(frozen=True)
class LayerPlan:
    """What one quantized layer becomes in the graph; ``converted`` says why when it is not its record."""

    name: str
    precision: Precision
    record: QuantizedWeight  # the record the graph carries (the original, or the fallback's re-quantization)
    block: int | None = None  # int4 block size
    converted: str | None = None  # None: the original record, exactly
    max_abs_weight_error: float = 0.0

    def describe(self) -> str:
        return {"int4": f"int4 block {self.block}", "int8": "int8 per-channel", "fp8": "fp8 e4m3fn per-channel"}[self.precision]


def exact_precision(scheme: QuantScheme) -> Precision | None:
    """The Q/DQ form that carries a record of ``scheme`` exactly, or None."""
    if scheme.symmetric and scheme.bits == 4 and scheme.group_size in INT4_BLOCKS:
        return "int4"
    if scheme.symmetric and scheme.bits == 8 and scheme.group_size is None:
        return "int8"
    return None


def plan_layer(
    name: str, record: QuantizedWeight, fallback: str | None, fp8: bool = False, dtype: torch.dtype = torch.float32
) -> LayerPlan:
    """Decide how ``record`` is written; re-quantizes (and measures the change) for fallbacks and fp8.
    ``dtype`` is the graph's float type, which fp8 scales are stored in."""
    from compress.quantizers.rtn import rtn_quantize

    scheme = record.scheme
    if fp8:
        weight = record.dequantize()
        return LayerPlan(
            name,
            "fp8",
            record,
            converted="fp8 requested",
            max_abs_weight_error=float((fp8_dequantize(*fp8_quantize(weight, dtype)) - weight).abs().max()),
        )
    precision = exact_precision(scheme)
    if precision is not None:
        return LayerPlan(name, precision, record, block=scheme.group_size if precision == "int4" else None)
    if fallback is None:
        raise FormatError(
            f"layer {name}: its {scheme.describe()} record has no exact TensorRT Q/DQ form (int4 needs "
            f"symmetric with group size {' or '.join(map(str, INT4_BLOCKS))}, int8 needs symmetric per-channel). "
            f"Declare a fallback ({' | '.join(FALLBACKS)}) to re-quantize such layers, or quantize with a supported scheme."
        )
    if fallback not in FALLBACKS:
        raise FormatError(f"unknown fallback '{fallback}': expected one of {', '.join(FALLBACKS)}")
    weight = record.dequantize()
    if fallback == "symmetric":
        block = 64 if scheme.group_size is not None and scheme.group_size <= 64 else 128
        new = rtn_quantize(weight, QuantScheme(bits=4, group_size=block, symmetric=True, scale_dtype=scheme.scale_dtype))
    else:
        block = None
        new = rtn_quantize(weight, QuantScheme(bits=8, group_size=None, symmetric=True, scale_dtype=scheme.scale_dtype))
    return LayerPlan(
        name,
        "int4" if block else "int8",
        new,
        block=block,
        converted=f"fallback {fallback}",
        max_abs_weight_error=float((new.dequantize() - weight).abs().max()),
    )


def fp8_quantize(weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row float8 e4m3fn: returns (values [out, in] float8, scale [out] in ``scale_dtype``)."""
    scale = (weight.abs().amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(scale_dtype).tiny).to(scale_dtype)
    values = (weight / scale.float().unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values, scale


def fp8_dequantize(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return values.float() * scale.float().unsqueeze(1)


def qdq_initializers(plan: LayerPlan, dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """(quantized weight [in, out], scale, DequantizeLinear attributes) for the MatMul's B operand."""
    import ml_dtypes

    np_dtype = np.float16 if dtype == torch.float16 else np.float32
    record = plan.record
    if plan.precision == "fp8":
        values, scale = fp8_quantize(record.dequantize(), dtype)
        q = values.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).T
        return np.ascontiguousarray(q), scale.numpy().astype(np_dtype), {"axis": 1}
    signed = (
        record.codes.to(torch.int16)
        - record.zero_point.to(torch.int16).repeat_interleave(record.scheme.group_width(record.shape[1]), dim=1)[:, : record.shape[1]]
    )
    scale = record.scale.to(torch.float32).numpy().astype(np_dtype)
    if plan.precision == "int4":
        q = signed.to(torch.int8).numpy().astype(ml_dtypes.int4).T
        return np.ascontiguousarray(q), np.ascontiguousarray(scale.T), {"axis": 0, "block_size": int(plan.block)}
    return np.ascontiguousarray(signed.to(torch.int8).numpy().T), np.ascontiguousarray(scale[:, 0]), {"axis": 1}


# --------------------------------------------------------------------------- the exported wrapper


class _InputMajorLinear(nn.Module):
    """Stand-in for a quantized Linear during export: ``x @ weight_t (+ bias)``, one initializer named ``weight_t``."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(linear.weight.detach().t(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.weight_t)
        return y if self.bias is None else y + self.bias


class PastPresentLM(nn.Module):
    """A causal LM with the KV cache as explicit tensors: (ids, mask, positions, past...) -> (logits, present...)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        setattr(self, _WRAPPER, model)
        self.n_layers = int(text_config(model).num_hidden_layers)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, past: list[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        from transformers import DynamicCache

        model = getattr(self, _WRAPPER)
        cache = DynamicCache(config=model.config)
        for i in range(self.n_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=cache, use_cache=True)
        present = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        return (out.logits, *present)


def text_config(model: nn.Module) -> Any:
    return model.config.get_text_config(decoder=True)


def kv_shape(model: nn.Module) -> tuple[int, int]:
    """(kv_heads, head_dim) of the model's attention layers."""
    cfg = text_config(model)
    heads = int(cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return int(getattr(cfg, "num_key_value_heads", None) or heads), int(head_dim)


def io_names(n_layers: int) -> tuple[list[str], list[str]]:
    kv = [(i, k) for i in range(n_layers) for k in ("key", "value")]
    return (
        ["input_ids", "attention_mask", "position_ids", *(f"past_key_values.{i}.{k}" for i, k in kv)],
        ["logits", *(f"present.{i}.{k}" for i, k in kv)],
    )


@contextlib.contextmanager
def _stand_ins(model: nn.Module, names: list[str]) -> Iterator[None]:
    """Swap the named Linear modules for `_InputMajorLinear` (and eval mode) while exporting; restore after."""
    modules = dict(model.named_modules())
    swapped = []
    was_training = model.training
    try:
        for name in names:
            linear = modules.get(name)
            if not isinstance(linear, nn.Linear):
                raise FormatError(f"record {name}: the model has no Linear layer of that name")
            parent, _, child = name.rpartition(".")
            setattr(modules[parent] if parent else model, child, _InputMajorLinear(linear))
            swapped.append((modules[parent] if parent else model, child, linear))
        model.eval()
        yield
    finally:
        for parent, child, linear in reversed(swapped):
            setattr(parent, child, linear)
        model.train(was_training)


def export_program(model: nn.Module, quantized: list[str]) -> Any:
    """torch.onnx (dynamo) export of ``PastPresentLM(model)`` at opset 21; returns the ONNXProgram.

    dynamo=True handles the transformers cache and mask code here, so there is no fallback to the
    TorchScript exporter. Example sizes are distinct and >= 2 so torch.export keeps every axis symbolic.
    """
    kv_heads, head_dim = kv_shape(model)
    wrapper = PastPresentLM(model)
    batch, seq, past = 3, 7, 5
    device = streaming.compute_device(model)
    dtype = next(model.parameters()).dtype
    vocab = int(text_config(model).vocab_size)
    args = (
        torch.randint(0, vocab, (batch, seq), device=device),
        torch.ones(batch, past + seq, dtype=torch.int64, device=device),
        torch.arange(past, past + seq, device=device).expand(batch, seq),
        [torch.zeros(batch, kv_heads, past, head_dim, dtype=dtype, device=device) for _ in range(2 * wrapper.n_layers)],
    )
    dim = torch.export.Dim
    b, s, p, t = dim(BATCH), dim(SEQUENCE), dim(PAST), dim(TOTAL)
    shapes = ({0: b, 1: s}, {0: b, 1: t}, {0: b, 1: s}, [{0: b, 2: p}] * (2 * wrapper.n_layers))
    inputs, outputs = io_names(wrapper.n_layers)
    with _stand_ins(model, quantized), warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # axis-renaming notes and transformers deprecations
        return torch.onnx.export(
            wrapper,
            args,
            None,
            dynamo=True,
            dynamic_shapes=shapes,
            input_names=inputs,
            output_names=outputs,
            opset_version=OPSET,
            verbose=False,
        )


# --------------------------------------------------------------------------- graph surgery


def insert_dequantize(graph: Any, plan: LayerPlan, dtype: torch.dtype) -> None:
    """Replace the plan's float ``weight_t`` initializer by quantized weight + scale -> DequantizeLinear."""
    import onnx_ir as ir

    old_name = f"{_WRAPPER}.{plan.name}.weight_t"
    old = graph.initializers.get(old_name)
    if old is None:
        raise FormatError(f"layer {plan.name}: initializer {old_name} is missing from the exported graph")
    uses = list(old.uses())
    if len(uses) != 1 or uses[0].node.op_type != "MatMul":
        raise FormatError(f"layer {plan.name}: expected {old_name} to feed one MatMul, found {[u.node.op_type for u in uses]}")
    q, scale, attrs = qdq_initializers(plan, dtype)
    expected = tuple(reversed(plan.record.shape))
    if tuple(q.shape) != expected or tuple(old.shape) != expected:
        raise FormatError(f"layer {plan.name}: weight shape {tuple(old.shape)} in the graph, {expected} in the record")
    q_value = ir.Value(name=f"{plan.name}.weight_quantized", const_value=ir.Tensor(q, name=f"{plan.name}.weight_quantized"))
    s_value = ir.Value(name=f"{plan.name}.weight_scale", const_value=ir.Tensor(scale, name=f"{plan.name}.weight_scale"))
    graph.initializers.pop(old_name)
    graph.register_initializer(q_value)
    graph.register_initializer(s_value)
    node = ir.node("DequantizeLinear", inputs=[q_value, s_value], attributes=attrs, name=f"{plan.name}.weight_dequantize")
    node.outputs[0].name = f"{plan.name}.weight"
    ir.convenience.replace_all_uses_with(old, node.outputs[0])
    graph.insert_before(uses[0].node, node)


def tidy_graph(model: Any) -> None:
    """Drop the wrapper prefix from float initializers, name present's length axis ``total_sequence``,
    and drop the exporter's per-node debug metadata (FX node text and stack traces, ~2 KB a node)."""
    import onnx_ir as ir

    for node in model.graph:
        node.metadata_props.clear()
    prefix = f"{_WRAPPER}."
    for name in [n for n in model.graph.initializers if n.startswith(prefix)]:
        if name[len(prefix) :] not in model.graph.initializers:
            model.graph.initializers[name].name = name[len(prefix) :]
    total = {f"{PAST} + {SEQUENCE}", f"{SEQUENCE} + {PAST}"}
    for value in model.graph.outputs:
        if value.shape is not None:
            value.shape = ir.Shape([TOTAL if str(d) in total else d for d in value.shape])


def axes_of(values: Any) -> dict[str, list[int | str]]:
    return {v.name: [d if isinstance(d, int) else str(d) for d in v.shape] for v in values}


def plan_layers(
    records: dict[str, QuantizedWeight], fallback: str | None, fp8: bool = False, dtype: torch.dtype = torch.float32
) -> list[LayerPlan]:
    """Every record's plan, in name order (re-quantizing for fallbacks and fp8 happens here, once)."""
    return [plan_layer(name, r.cpu(), fallback, fp8, dtype) for name, r in sorted(records.items())]


def write_qdq_onnx(
    directory: Path,
    model: nn.Module,
    records: dict[str, QuantizedWeight],
    *,
    fallback: str | None,
    dtype: str = "float32",
    fp8: bool = False,
    plans: list[LayerPlan] | None = None,
) -> dict[str, Any]:
    """Write ``directory/model.onnx`` (+ ``model.onnx.data``): the model with Q/DQ weights; return manifest facts.

    ``model`` is the in-memory model (its quantized layers may hold the dequantized records; their
    float values are not used). ``dtype`` is the graph's float type (activations, KV cache, logits, scales).
    ``plans``: what :func:`plan_layers` returns for these arguments, when the caller already has them.
    """
    import onnx_ir as ir

    if dtype not in GRAPH_DTYPES:
        raise FormatError(f"onnx dtype '{dtype}': expected one of {', '.join(GRAPH_DTYPES)}")
    torch_dtype = GRAPH_DTYPES[dtype]
    if plans is None:
        plans = plan_layers(records, fallback, fp8, torch_dtype)  # errors before exporting
    if streaming.is_streamed(model):  # torch.export traces the whole model: a copy read into memory (peak: the float model)
        source = streaming.materialize(copy.deepcopy(model), "cpu").to(torch_dtype)
    else:
        source = model if next(model.parameters()).dtype == torch_dtype else copy.deepcopy(model).to(torch_dtype)
    program = export_program(source, [p.name for p in plans])
    for plan in plans:
        insert_dequantize(program.model.graph, plan, torch_dtype)
    tidy_graph(program.model)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".onnx-qdq-", dir=directory) as tmp:  # files appear complete or not at all
        ir.save(program.model, Path(tmp) / MODEL_FILE, external_data=DATA_FILE)
        for name in (DATA_FILE, MODEL_FILE):
            if (Path(tmp) / name).exists():
                os.replace(Path(tmp) / name, directory / name)
    graph = program.model.graph
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    by_precision = Counter(p.describe() for p in plans)
    by_precision["float (no record)"] = len(set(linears) - set(records))
    return {
        "format": "onnx-qdq",
        "opset": OPSET,
        "dtype": dtype,
        "exporter": f"torch.onnx dynamo (torch {torch.__version__})",
        "inputs": axes_of(graph.inputs),
        "outputs": axes_of(graph.outputs),
        "ops": dict(sorted(Counter(n.op_type for n in graph).items())),
        "domains": sorted({n.domain or "" for n in graph}),
        "layers_by_precision": dict(by_precision),
        "layers": {p.name: p.describe() for p in plans},
        "fallbacks": [
            {
                "layer": p.name,
                "scheme": records[p.name].scheme.describe(),
                "became": p.describe(),
                "why": p.converted,
                "max_abs_weight_error": p.max_abs_weight_error,
            }
            for p in plans
            if p.converted
        ],
        "partial_blocks": [p.name for p in plans if p.block and p.record.shape[1] % p.block],
        "scales_rounded": [
            p.name
            for p in plans
            if p.precision != "fp8"  # record scales the graph's dtype cannot hold exactly
            and not torch.equal(p.record.scale.to(torch_dtype).float(), p.record.scale.float())
        ],
        "files": {name: (directory / name).stat().st_size for name in (MODEL_FILE, DATA_FILE) if (directory / name).exists()},
    }


# --------------------------------------------------------------------------- verification


def non_standard_ops(path: Path) -> list[str]:
    """Nodes (op_type@domain) outside the standard ONNX domain; empty for a TensorRT-ready graph."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return sorted({f"{n.op_type}@{n.domain}" for n in graph.node if n.domain not in STANDARD_DOMAINS})


def check_qdq_onnx(directory: Path, model: nn.Module, input_ids: torch.Tensor) -> dict[str, Any]:
    """Run ``model.onnx`` in ONNX Runtime (CPU): prefill ``input_ids`` with an empty past, then one
    greedy decode step feeding ``present`` back as past; compare with ``model`` in torch (float32,
    the whole sequence recomputed without a cache). Returns max abs logit difference, mean KL
    (torch || onnx, nats/token) and top-1 agreement over all prefill and decode positions.

    Graph optimizations are off so ONNX Runtime runs the file's own operators: its default fusion
    of DequantizeLinear+MatMul into MatMulNBits quantizes activations to int8 (~1e-4 logit error).
    """
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise FormatError("onnxruntime is not installed: pip install onnxruntime") from exc
    path = Path(directory) / MODEL_FILE
    foreign = non_standard_ops(path)
    if foreign:
        raise FormatError(f"{path}: non-standard operators {foreign}; TensorRT accepts only standard ONNX ops")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = usable_cpus()
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    kinds = {i.name: i for i in session.get_inputs()}
    float_np = np.float16 if kinds["past_key_values.0.key"].type == "tensor(float16)" else np.float32
    ids = input_ids.cpu().to(torch.int64).numpy()
    batch, seq = ids.shape
    feeds = {
        "input_ids": ids,
        "attention_mask": np.ones((batch, seq), np.int64),
        "position_ids": np.tile(np.arange(seq, dtype=np.int64), (batch, 1)),
    }
    for name, value in kinds.items():
        if name.startswith("past_key_values."):
            feeds[name] = np.zeros((batch, value.shape[1], 0, value.shape[3]), float_np)
    out_names = [o.name for o in session.get_outputs()]
    prefill = dict(zip(out_names, session.run(None, feeds), strict=True))
    next_ids = prefill["logits"][:, -1].argmax(-1).astype(np.int64)[:, None]
    step = {
        "input_ids": next_ids,
        "attention_mask": np.ones((batch, seq + 1), np.int64),
        "position_ids": np.full((batch, 1), seq, np.int64),
    }
    for name in kinds:
        if name.startswith("past_key_values."):
            step[name] = prefill[name.replace("past_key_values.", "present.")]
    decode = dict(zip(out_names, session.run(None, step), strict=True))
    with torch.no_grad():
        full = torch.cat([input_ids.cpu(), torch.from_numpy(next_ids)], dim=1).to(streaming.compute_device(model))
        ref = model(input_ids=full, use_cache=False).logits.float().cpu()
    got = torch.cat([torch.from_numpy(prefill["logits"]), torch.from_numpy(decode["logits"])], dim=1).float()
    return {
        **logit_parity(ref, got),
        "prefill_max_abs_diff": float((ref[:, :seq] - got[:, :seq]).abs().max()),
        "decode_max_abs_diff": float((ref[:, seq:] - got[:, seq:]).abs().max()),
        "present_length": int(decode["present.0.key"].shape[2]),
        "runtime": f"onnxruntime {ort.__version__} CPU",
        "non_standard_ops": foreign,
    }


def logit_parity(reference: torch.Tensor, candidate: torch.Tensor) -> dict[str, float | int]:
    """Max abs difference, mean KL(reference || candidate) in nats/token, top-1 agreement; logits [..., vocab]."""
    vocab = reference.shape[-1]
    ref = torch.log_softmax(reference.reshape(-1, vocab).double(), dim=-1)
    cand = torch.log_softmax(candidate.reshape(-1, vocab).double(), dim=-1)
    kl = (ref.exp() * (ref - cand)).sum(-1).clamp(min=0)
    return {
        "max_abs_diff": float((reference - candidate).abs().max()),
        "kl_divergence": float(kl.mean()),
        "top1_agreement": float((ref.argmax(-1) == cand.argmax(-1)).double().mean()),
        "tokens": int(ref.shape[0]),
    }
