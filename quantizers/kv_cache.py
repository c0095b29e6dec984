"""KV-cache quantization: a transformers Cache that really stores keys and values quantized.

Layout (KIVI, Liu et al. 2024): keys are quantized **per channel** — one scale per head
channel over a block of ``residual`` consecutive tokens, because a few key channels carry
large magnitudes for every token — and values **per token** (groups of ``group_size`` channels
of one token). The most recent tokens stay in a full-precision window of up to ``residual``
tokens; when the window fills, its tokens are quantized as one block and appended to the
quantized store. Nothing else is kept: every attention call dequantizes the stored blocks
(there is no float shadow copy), so the bytes counted by :func:`cache_bytes` are the bytes the
cache holds.

Formats: ``int`` with 8, 4 or 2 bits (codes packed 1, 2 or 4 to a byte; asymmetric scale + min
in fp16 below 8 bits, symmetric absmax below 127 at 8 bits) and ``fp8`` (e4m3, one fp16 scale
per group). With ``static_scales`` the scales are calibrated once per layer and KV head
(absmax over the calibration text) and nothing per token is stored — the form vLLM,
TensorRT-LLM and ONNX Runtime GenAI consume.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from compress.context import RunContext, StageRecord
from compress.errors import CompressError
from compress.schema.base import Strict

FP8_MAX = 448.0  # largest finite float8_e4m3fn

# What each runtime's own KV cache can hold, by (format, bits): llama.cpp cache types
# (`--cache-type-k/-v`, llama_context_params.type_k/type_v) and vLLM's kv_cache_dtype.
LLAMA_CPP_CACHE_TYPES = {("int", 8): "q8_0", ("int", 4): "q4_0"}
VLLM_CACHE_DTYPES = {("fp8", 8): "fp8_e4m3"}


class KVEvalConfig(Strict):
    """How the stage scores the quantized cache: incremental decoding at long context."""

    model_config = ConfigDict(extra="forbid")

    context: int = Field(2048, ge=16, description="Tokens of context per evaluation sequence (taken from data.evaluation's text).")
    samples: int = Field(1, ge=1, description="Evaluation sequences.")
    step: int = Field(1, ge=1, description="Tokens fed per decoding step after the prefill (1 = token by token).")
    prefill: int = Field(0, ge=0, description="Tokens fed in the first step (0 = start decoding from the first token).")


class KVCacheConfig(Strict):
    """`kv_cache: {bits, format, key_axis, value_axis, group_size, residual, static_scales, ...}`."""

    model_config = ConfigDict(extra="forbid")

    bits: Literal[8, 4, 2] = Field(8, description="Bits per stored key/value element (fp8 format: 8).")
    format: Literal["int", "fp8"] = Field("int", description="int: integer codes with scales; fp8: float8 e4m3 with scales.")
    key_axis: Literal["channel", "token"] = Field(
        "channel", description="channel: one scale per head channel over a block of `residual` tokens (KIVI); token: per token."
    )
    value_axis: Literal["token", "channel"] = Field("token", description="token: per-token groups of `group_size` channels (KIVI); channel: like keys.")
    group_size: int | None = Field(None, ge=1, description="Channels per per-token group; null = the whole head.")
    residual: int = Field(128, ge=0, description="Most recent tokens kept in full precision; also the token block of per-channel groups.")
    residual_dtype: Literal["float16", "bfloat16", "model"] = Field("float16", description="Storage dtype of the full-precision window.")
    symmetric: bool | None = Field(None, description="Symmetric codes (absmax) or asymmetric (min/max); null: symmetric at 8 bits only.")
    static_scales: bool = Field(False, description="Calibrate one scale per layer and KV head on the calibration text instead of storing scales.")
    calibration_samples: int | None = Field(None, ge=1, description="Calibration chunks for static scales (default: all).")
    evaluate: KVEvalConfig | None = Field(
        default_factory=KVEvalConfig, description="Long-context evaluation through the cache; null to skip."
    )

    @model_validator(mode="after")
    def _consistent(self) -> KVCacheConfig:
        if self.format == "fp8" and self.bits != 8:
            raise ValueError("format fp8 stores 8 bits; set bits: 8")
        if self.residual % 4:
            raise ValueError("residual must be a multiple of 4 (2-bit codes pack 4 tokens to a byte in per-channel blocks)")
        if self.residual == 0 and "channel" in (self.key_axis, self.value_axis):
            raise ValueError("per-channel groups span a block of `residual` tokens; set residual > 0 or use axis: token")
        if self.static_scales and (self.bits < 8 and self.format == "int"):
            raise ValueError("static scales are one number per layer and head; below 8 bits use dynamic scales (static_scales: false)")
        if self.static_scales and self.symmetric is False:
            raise ValueError("static scales are symmetric (absmax); drop `symmetric: false`")
        return self

    @property
    def is_symmetric(self) -> bool:
        if self.format == "fp8" or self.static_scales:
            return True
        return self.bits == 8 if self.symmetric is None else self.symmetric

    def describe(self) -> str:
        kind = "fp8 e4m3" if self.format == "fp8" else f"int{self.bits} {'sym' if self.is_symmetric else 'asym'}"
        scales = "static scales" if self.static_scales else f"K per {self.key_axis}, V per {self.value_axis}"
        return f"{kind}, {scales}, residual {self.residual}"

    def runtime_support(self) -> dict[str, dict[str, Any]]:
        """What each deployment runtime can hold of this scheme (for the manifest and report)."""
        key = (self.format, self.bits)
        out: dict[str, dict[str, Any]] = {}
        cache_type = LLAMA_CPP_CACHE_TYPES.get(key)
        if cache_type:
            out["llama.cpp"] = {"supported": True, "type_k": cache_type, "type_v": cache_type,
                                "note": f"llama.cpp quantizes the cache itself in {cache_type} blocks of 32 per token; its numbers differ from this scheme's"}
        else:
            out["llama.cpp"] = {"supported": False, "why": f"llama.cpp has no {self.format}{self.bits} cache type (it has f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1)"}
        vllm = VLLM_CACHE_DTYPES.get(key)
        if vllm and self.static_scales:
            out["vllm"] = {"supported": True, "kv_cache_dtype": vllm, "scales": "per-layer k_scale/v_scale in the compressed-tensors checkpoint"}
        elif vllm:
            out["vllm"] = {"supported": True, "kv_cache_dtype": vllm, "note": "dynamic scales: vLLM computes its own per-tensor scales"}
        else:
            out["vllm"] = {"supported": False, "why": "vLLM quantizes the KV cache to fp8 only"}
        if self.static_scales and key in (("int", 8), ("fp8", 8)):
            scheme = f"{'int8' if self.format == 'int' else 'fp8'}_per_channel"
            out["onnxruntime-genai"] = {"supported": True, "kv_cache_quant_scheme": scheme,
                                        "scales": "per-layer, per-KV-head scales repeated over each head's channels (kv_cache_scales.json)",
                                        **({"note": "fp8: CUDA only in onnxruntime 1.31"} if self.format == "fp8" else {})}
        else:
            out["onnxruntime-genai"] = {"supported": False, "why": "ONNX Runtime GenAI's CPU/CUDA attention takes static per-tensor or "
                                        "per-channel scales (static_scales: true, int8 or fp8); per-token scales need CUDA paged attention"}
        return out


# --------------------------------------------------------------------------- geometry and planning


def text_config(config: Any) -> Any:
    """The text part of a transformers config (the config itself for text-only models)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def kv_geometry(config: Any) -> tuple[int, int, int]:
    """(decoder layers, KV heads, head_dim) of a transformers text config."""
    cfg = text_config(config)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim


def float_cache_bytes_per_token(config: Any, bytes_per_element: int = 2) -> int:
    """Bytes per token of an unquantized cache (fp16 by default): K and V of every layer."""
    layers, kv_heads, head_dim = kv_geometry(config)
    return 2 * layers * kv_heads * head_dim * bytes_per_element


def memory_plan(weights_bytes: int, per_token: dict[str, float], budget_gib: float, batch_context: int, overhead_gib: float = 0.0) -> dict[str, dict[str, int]]:
    """For each cache kind (bytes per token), the longest context at batch 1 and the largest batch
    at ``batch_context`` tokens that fit in ``budget_gib`` next to the weights (activations and
    runtime overhead are left to ``overhead_gib``)."""
    free = budget_gib * 2**30 - weights_bytes - overhead_gib * 2**30
    out = {}
    for name, bpt in per_token.items():
        tokens = max(0, int(free // bpt)) if free > 0 else 0
        out[name] = {"max_context_batch1": tokens, f"max_batch_at_{batch_context}": tokens // batch_context}
    return out


# --------------------------------------------------------------------------- the stage


@dataclass
class KVCacheScheme:
    """What the kv_cache stage leaves for evaluation and export: the config and static scales."""

    config: KVCacheConfig
    scales: dict[str, torch.Tensor] | None
    num_layers: int

    def new_cache(self) -> Any:
        """A fresh :class:`~compress.quantizers.kv_cache_store.QuantizedKVCache` for one generation."""
        from compress.quantizers.kv_cache_store import QuantizedKVCache

        return QuantizedKVCache(self.config, self.num_layers, self.scales)


class KVCacheStage:
    """The recipe step ``kv_cache: {...}``: calibrates static scales when asked and hands the
    scheme to evaluation (incremental decoding through the quantized cache) and the exporters."""

    def __init__(self, config: KVCacheConfig, label: str) -> None:
        self.config = config
        self.label = label

    def apply(self, model: torch.nn.Module, ctx: RunContext) -> StageRecord:
        start = time.perf_counter()
        if ctx.kv_cache is not None:
            raise CompressError(f"{self.label}: the recipe has two kv_cache stages; keep one")
        cfg = self.config
        layers, kv_heads, head_dim = kv_geometry(model.config)
        other = sorted({t for t in getattr(text_config(model.config), "layer_types", None) or [] if t != "full_attention"})
        if other:
            raise CompressError(f"{self.label}: this model has {', '.join(other)} layers; the quantized KV cache holds "
                                "full-attention layers only (sliding-window and linear-attention caches are not supported yet)")
        if cfg.group_size and head_dim % cfg.group_size:
            raise CompressError(f"{self.label}: group_size {cfg.group_size} does not divide this model's head_dim {head_dim}")
        scales = None
        summary: dict[str, Any] = {"scheme": cfg.describe(), "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim}
        if cfg.static_scales:
            tokens = ctx.calibration()
            if cfg.calibration_samples:
                tokens = tokens[: cfg.calibration_samples]
            from compress.quantizers.kv_cache_store import calibrate_scales

            scales = calibrate_scales(model, tokens, cfg, ctx.device, ctx.reporter)
            summary["calibration_tokens"] = int(tokens.numel())
            summary["k_scale_range"] = [float(scales["k_scale"].min()), float(scales["k_scale"].max())]
            summary["v_scale_range"] = [float(scales["v_scale"].min()), float(scales["v_scale"].max())]
        summary["bytes_per_token_estimate"] = round(estimate_bytes_per_token(cfg, layers, kv_heads, head_dim), 2)
        summary["fp16_bytes_per_token"] = float_cache_bytes_per_token(model.config)
        summary["runtimes"] = cfg.runtime_support()
        ctx.kv_cache = KVCacheScheme(cfg, scales, layers)
        return StageRecord(kind="kv_cache", method=f"{cfg.format}{cfg.bits}", config=cfg.model_dump(mode="json"),
                           duration_s=time.perf_counter() - start, summary=summary)


def estimate_bytes_per_token(cfg: KVCacheConfig, layers: int, kv_heads: int, head_dim: int) -> float:
    """Average stored bytes per token once the window has been flushed (window excluded)."""
    data = head_dim * cfg.bits / 8
    per = {}
    for name, axis in (("k", cfg.key_axis), ("v", cfg.value_axis)):
        params = 0 if cfg.static_scales else (1 if cfg.is_symmetric else 2)
        if axis == "channel":
            meta = params * 2 * head_dim / cfg.residual
        else:
            meta = params * 2 * math.ceil(head_dim / (cfg.group_size or head_dim))
        per[name] = data + meta
    return layers * kv_heads * (per["k"] + per["v"])
