"""The plugin objects of the quantizers: one QuantMethod per weight-quantization method (rtn.py, gptq.py,
awq.py, llm_int8.py, w8a8.py) and the two stage kinds this package runs (``quantize:`` and ``kv_cache:``).

Torch-free (the stage classes are imported when a run builds its stages), so the tables in
compress.plugins can be read by `compress validate` and `compress plan` without torch. Each
method's plan formula sits next to its QuantMethod; the shared numbers are in compress.eval.plan.estimates.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from compress.eval.plan.estimates import (
    CPU_FORWARD_FLOPS,
    REF_PARAMS,
    RTN_WEIGHTS_PER_S,
    TORCH_DECODE_TOKENS_PER_S,
    Estimate,
    PlanStep,
    block_bytes,
    block_weight_bytes,
    forward_s,
    largest_unit_bytes,
)
from compress.plugin_types import QuantMethod, StageKind
from compress.quantizers.configs import AWQConfig, GPTQConfig, LLMInt8Config, RTNConfig, W8A8Config
from compress.quantizers.kv_cache_config import KVCacheConfig
from compress.schema.quantize import SENSITIVITY_SAMPLES, WeightQuantConfig

# --------------------------------------------------------------------------- shared plan formulas


def layer_weights(layers: dict[str, Any]) -> int:
    return sum(r.out_f * r.in_f for r in layers.values())


_SHARED_INPUT = re.compile(r"(q_proj|k_proj|v_proj|gate_proj|up_proj)$")


def distinct_inputs(layers: dict[str, Any]) -> dict[str, int]:
    """The distinct inputs of the Linears, with their widths: Linears fed the same tensor (q/k/v, an
    MLP's or expert's gate/up) share one; GPTQ keeps a Hessian per distinct input (quantizers/gptq.py)
    and AWQ searches one scale per distinct input."""
    found: dict[str, int] = {}
    for name, r in layers.items():
        m = _SHARED_INPUT.search(name)
        key = name[: m.start()] + ("qkv" if m.group(1) in ("q_proj", "k_proj", "v_proj") else "gate_up") if m else name
        found[key] = r.in_f
    return found


def hessian_products(width: int) -> float:
    """Multiply-adds per token to accumulate a Hessian of ``width`` inputs: its upper triangle by
    strips of rows past HESSIAN_STRIP columns, the whole matrix below."""
    from compress.quantizers.gptq import HESSIAN_STRIP

    if width <= HESSIAN_STRIP:
        return float(width * width)
    return sum(min(HESSIAN_STRIP, width - i) * (width - i) for i in range(0, width, HESSIAN_STRIP))


def _first_block(layers: dict[str, Any]) -> dict[str, Any]:
    return {n: r for n, r in layers.items() if re.search(r"\.0\.", n)}


def calibrated_estimate(step: PlanStep, layers: dict[str, Any], seconds: float, how: str, kept: float, kept_what: str) -> Estimate:
    """Memory of a layer-wise calibrated method: block inputs and outputs of every calibration token
    at the compute dtype, what the method keeps of one block while it works (``kept``: GPTQ's
    Hessians, AWQ's sampled inputs), and a calibration batch's forward (the block's live tensors and
    a float32 copy of the widest Linear's input). The records wait on disk
    (compress.quantizers.core.RecordStore); no logits are made."""
    t = step.shape.text
    cal_tokens = step.cal_tokens
    batch = step.config.batch_size
    hidden_states = 2 * cal_tokens * t.hidden_size * step.dtype_bytes
    widest = max((r.in_f for r in _first_block(layers).values()), default=0)
    forward = block_bytes(step.shape, batch, step.cal_seq_len, step.dtype_bytes) + batch * step.cal_seq_len * widest * 4
    work = hidden_states + kept + forward
    if step.streamed:  # one block at a time; the embedding (the largest unit) only while the first inputs are captured
        unit = largest_unit_bytes(step.shape, step.dtype_bytes)
        mem = step.held_bytes - unit + max(block_weight_bytes(step.shape, step.dtype_bytes) + work, unit + hidden_states / 2)
    else:
        mem = step.held_bytes + work
    basis = f"the libraries + one unit + block inputs/outputs of {cal_tokens:,} tokens + {kept_what} + a batch's forward; {how}"
    return Estimate(mem, seconds, basis)


def _streams_unless_llmcompressor(config: Any) -> bool:
    """Our layer-wise driver streams; the llmcompressor backend needs the model whole in memory."""
    return config.backend != "llmcompressor"


# --------------------------------------------------------------------------- rtn


def _rtn_stage() -> type:
    from compress.quantizers.rtn import RTNStage

    return RTNStage


def _rtn_estimate(step: PlanStep, layers: dict[str, Any]) -> Estimate:
    weights = layer_weights(layers)
    widest = max((r.out_f * r.in_f for r in layers.values()), default=0)
    return Estimate(
        step.held_bytes + 6 * widest,  # the largest layer's float32 work copy and uint8 codes
        weights / RTN_WEIGHTS_PER_S,
        f"the libraries + one unit + the largest layer's float32 copy and codes (records wait on disk); ~{RTN_WEIGHTS_PER_S:.0e} weights/s",
    )


RTN = QuantMethod(
    name="rtn",
    config=RTNConfig,
    load_stage=_rtn_stage,
    estimate=_rtn_estimate,
    streams=True,
    cost=0,
    description="round-to-nearest on each group's min/max grid, no calibration data",
)


# --------------------------------------------------------------------------- gptq


def _gptq_stage() -> type:
    from compress.quantizers.gptq import GPTQStage

    return GPTQStage


def _gptq_estimate(step: PlanStep, layers: dict[str, Any]) -> Estimate:
    weights = layer_weights(layers)
    products = sum(hessian_products(w) for w in distinct_inputs(layers).values())
    seconds = forward_s(weights, step.cal_tokens) + 2 * products * step.cal_tokens / CPU_FORWARD_FLOPS
    how = (
        f"forward + Hessian accumulation (2 x in_features^2 per distinct input per token, the upper triangle "
        f"of wide ones) over {step.cal_tokens:,} calibration tokens"
    )
    # one block's Hessians in float32 (all accumulated in one pass); the solves factor, invert and permute each
    # in its own memory (on the CPU; elsewhere a second [in, in] matrix on the device)
    hessians = sum(w**2 for w in distinct_inputs(_first_block(layers)).values()) * 4
    return calibrated_estimate(step, layers, seconds, how, hessians, "one block's Hessians")


GPTQ = QuantMethod(
    name="gptq",
    config=GPTQConfig,
    load_stage=_gptq_stage,
    estimate=_gptq_estimate,
    streams=_streams_unless_llmcompressor,
    cost=3,
    description="GPTQ, column by column, each rounding error pushed onto the columns not yet quantized through the inverse Hessian of the inputs",
)


# --------------------------------------------------------------------------- awq


def _awq_stage() -> type:
    from compress.quantizers.awq import AWQStage

    return AWQStage


def _awq_estimate(step: PlanStep, layers: dict[str, Any]) -> Estimate:
    cfg, weights = step.config, layer_weights(layers)
    seconds = forward_s(weights, step.cal_tokens) + 1.25 * cfg.grid * forward_s(weights, cfg.search_tokens)
    how = (
        f"forward over {step.cal_tokens:,} calibration tokens + {cfg.grid} scale candidates x "
        f"{cfg.search_tokens:,} search tokens (+25% clipping)"
    )
    # one block's sampled inputs: search_tokens per distinct input (the scale search), clip_tokens per Linear (the clipping)
    first = _first_block(layers)
    search = cfg.search_tokens * sum(distinct_inputs(first).values())
    clip = cfg.clip_tokens * sum(r.in_f for r in first.values())
    samples = (search + clip) * step.dtype_bytes
    return calibrated_estimate(step, layers, seconds, how, samples, "one block's sampled inputs for its searches")


AWQ = QuantMethod(
    name="awq",
    config=AWQConfig,
    load_stage=_awq_stage,
    estimate=_awq_estimate,
    streams=_streams_unless_llmcompressor,
    cost=2,
    description="AWQ, activation-aware per-input-channel scales folded into the previous layer, then a clipping search per group",
)


# --------------------------------------------------------------------------- llm_int8


def _llm_int8_stage() -> type:
    from compress.quantizers.llm_int8 import LLMInt8Stage

    return LLMInt8Stage


def _llm_int8_records_only() -> Any:
    from compress.quantizers.llm_int8 import records_only

    return records_only


def _llm_int8_estimate(step: PlanStep, layers: dict[str, Any]) -> Estimate:
    # one pass to find outlier columns, then rounding
    seconds = forward_s(step.shape.params, step.cal_tokens) + layer_weights(layers) / RTN_WEIGHTS_PER_S
    how = f"one forward over {step.cal_tokens:,} calibration tokens, then rounding"
    return calibrated_estimate(step, layers, seconds, how, 0, "per-column maxima")  # one vector per Linear


LLM_INT8 = QuantMethod(
    name="llm_int8",
    config=LLMInt8Config,
    load_stage=_llm_int8_stage,
    estimate=_llm_int8_estimate,
    cost=1,
    description="LLM.int8(), int8 weights and activations with the outlier input features computed in float",
    not_carried=(
        "LLM.int8 int8 activations and outlier decomposition: the export holds the plain int8 weight records; "
        "its runtime computes with them and its own activations"
    ),
    load_records_only=_llm_int8_records_only,
)


# --------------------------------------------------------------------------- w8a8


def _w8a8_stage() -> type:
    from compress.quantizers.w8a8 import W8A8Stage

    return W8A8Stage


def _w8a8_estimate(step: PlanStep, layers: dict[str, Any]) -> Estimate:
    # with smoothing, LLM.int8's: one pass for the per-channel input maxima, then rounding
    if step.config.smoothing is not None:
        return _llm_int8_estimate(step, layers)
    seconds = layer_weights(layers) / RTN_WEIGHTS_PER_S
    return Estimate(step.held_bytes, seconds, f"rounding only (smoothing: null); ~{RTN_WEIGHTS_PER_S:.0e} weights/s")


W8A8 = QuantMethod(
    name="w8a8",
    config=W8A8Config,
    load_stage=_w8a8_stage,
    estimate=_w8a8_estimate,
    cost=1,
    description="W8A8 int8: per-channel int8 weights and dynamic per-token int8 activations, after SmoothQuant's "
    "scale migration (smoothing: {alpha}) unless smoothing: null",
)


# --------------------------------------------------------------------------- the quantize stage kind


def _quantize_summary(stage: dict[str, Any], report: dict[str, Any]) -> str:
    s = stage["summary"]
    return (
        f"{stage['label']} quantize {stage['method']}: {s['layers_quantized']} layers, {s['params_quantized']:,} weights, "
        f"{s['bits_per_weight']} bits/weight, SQNR mean {s['sqnr_db_mean']} dB (min {s['sqnr_db_min']}), {stage['duration_s']:.1f}s"
        + (
            f", {s['calibration_tokens']:,} calibration tokens, peak memory {s['peak_memory_mb']:,.0f} MB"
            if "calibration_tokens" in s
            else ""
        )
    )


def _with_sensitivity(step: PlanStep, layers: dict[str, Any], est: Estimate) -> Estimate:
    """A stage with ``gguf_target`` first runs the sensitivity pass (quantizers/mix.py): a forward and a
    backward over the sensitivity chunks (about 3 forwards), keeping every block's input for them, and
    one block's float32 Fisher matrices while it is resident."""
    t = step.shape.text
    tokens = SENSITIVITY_SAMPLES * step.cal_seq_len
    inputs = t.num_hidden_layers * tokens * t.hidden_size * step.dtype_bytes
    fisher = sum(r.out_f * r.in_f for r in _first_block(layers).values()) * 4
    forward = block_bytes(step.shape, SENSITIVITY_SAMPLES, step.cal_seq_len, step.dtype_bytes)
    memory = step.held_bytes + inputs + fisher + 2 * forward
    seconds = 3 * forward_s(step.shape.params, tokens)
    basis = f"{est.basis}; first the sensitivity pass: every block's input for {tokens:,} tokens, one block's Fisher matrices, ~3 forwards"
    return Estimate(max(est.memory_bytes, memory), est.seconds + seconds, basis)


def quantize_kind(method: Callable[..., QuantMethod]) -> StageKind:
    """The ``quantize:`` stage kind, which hands each stage to its method's QuantMethod. ``method(name, label)``
    is compress.plugins.quant_method (the table sits above this module, so it is handed in)."""

    def build(config: Any, label: str) -> Any:
        return method(config.method, label).build(config, label)

    def estimate(step: PlanStep) -> Estimate:
        from compress.quantizers.targets import select_linears

        cfg = step.config
        selected = {n for n, _ in select_linears(step.shape.model, cfg.targets, cfg.ignore)[0]}
        layers = {n: r for n, r in step.records.items() if n in selected}
        est = method(cfg.method).estimate(step, layers)
        return _with_sensitivity(step, layers, est) if getattr(cfg, "gguf_target", False) else est

    return StageKind(
        name="quantize",
        config=WeightQuantConfig,  # each method's own subclass, from QUANT_METHODS (compress.recipe builds the union)
        build=build,
        estimate=estimate,
        summary=_quantize_summary,
        description="weight quantization of the selected Linear layers",
        quantizes_weights=True,
        streams=True,  # when its method streams (QuantMethod.streams)
    )


# --------------------------------------------------------------------------- the kv_cache stage kind


def _build_kv_cache(config: Any, label: str) -> Any:
    from compress.quantizers.kv_cache import KVCacheStage

    return KVCacheStage(config, label)


def _kv_cache_estimate(step: PlanStep) -> Estimate:
    cfg, cur = step.config, step.shape
    ev = cfg.evaluate
    mem = step.held_bytes + (2 * step.kv_bytes_per_token * ev.context * min(ev.samples, ev.batch) if ev else 0)  # one batch's caches
    rate = TORCH_DECODE_TOKENS_PER_S * REF_PARAMS / cur.params
    secs = (2 * ev.samples * ev.context / rate if ev else 0) + (forward_s(cur.params, step.cal_tokens) if cfg.static_scales else 0)
    basis = (
        f"baseline + working copy + float and quantized caches of {min(ev.samples, ev.batch) if ev else 0} sequence(s) at "
        f"{ev.context if ev else 0} tokens; decoding "
        f"{ev.samples if ev else 0} x {ev.context if ev else 0} tokens token by token twice (float cache and quantized) "
        f"at ~{rate:.0f} tokens/s"
        if ev
        else "baseline + working copy; no evaluation through the cache"
    )
    return Estimate(mem, secs, basis)


def _kv_cache_summary(stage: dict[str, Any], report: dict[str, Any]) -> str:
    mem = (report.get("kv_cache") or {}).get("memory")
    measured = (
        (
            f"; measured {mem['bytes_per_token']:,.0f} bytes/token at {mem['context']:,} tokens, "
            f"{mem['compression_vs_fp16']:.2f}x less than fp16 ({mem['fp16_cache_bytes'] / mem['context']:,.0f})"
        )
        if mem
        else ""
    )
    return f"{stage['label']} kv_cache: {stage['summary']['scheme']}{measured}"


KV_CACHE = StageKind(
    name="kv_cache",
    config=KVCacheConfig,
    build=_build_kv_cache,
    estimate=_kv_cache_estimate,
    summary=_kv_cache_summary,
    description="KV-cache quantization while decoding (evaluated through the cache; the scheme is recorded for the exports)",
    quantizes_kv_cache=True,
)
