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
from typing import Any

import torch

from compress.context import RunContext, StageRecord
from compress.errors import CompressError
from compress.quantizers.kv_cache_config import KVCacheConfig

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


def memory_plan(
    weights_bytes: int, per_token: dict[str, float], budget_gib: float, batch_context: int, overhead_gib: float = 0.0
) -> dict[str, dict[str, int]]:
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
    """What the kv_cache stage leaves for evaluation and export: the config, static scales, and with
    eviction the token tables and fastgen's per-head profile."""

    config: KVCacheConfig
    scales: dict[str, torch.Tensor] | None
    num_layers: int
    tables: Any = None  # compress.quantizers.kv_evict.TokenTables (fastgen)
    profile: dict[str, torch.Tensor] | None = None  # fastgen: policy / recovered / kept per layer and KV head

    def new_cache(self) -> Any:
        """A fresh cache for one generation: :class:`~compress.quantizers.kv_cache_store.QuantizedKVCache`,
        or :class:`~compress.quantizers.kv_evict.EvictingKVCache` with eviction."""
        if self.config.evict is not None:
            from compress.quantizers.kv_evict import EvictingKVCache

            policy = None if self.profile is None else self.profile["policy"]
            return EvictingKVCache(self.config, self.num_layers, self.tables, policy, self.scales)
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
            raise CompressError(
                f"{self.label}: this model has {', '.join(other)} layers; the quantized KV cache holds "
                "full-attention layers only (sliding-window and linear-attention caches are not supported yet)"
            )
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
        tables, profile = None, None
        if cfg.evict is not None and cfg.evict.policy == "fastgen":
            from compress.quantizers.kv_evict import profile_summary

            tables, profile = self._fastgen(model, ctx, layers, kv_heads)
            summary["fastgen_profile"] = profile_summary(profile)
        ctx.kv_cache = KVCacheScheme(cfg, scales, layers, tables, profile)
        return StageRecord(
            kind="kv_cache",
            method=f"{cfg.format}{cfg.bits}",
            config=cfg.model_dump(mode="json"),
            duration_s=time.perf_counter() - start,
            summary=summary,
        )

    def _fastgen(self, model: torch.nn.Module, ctx: RunContext, layers: int, kv_heads: int) -> tuple[Any, dict[str, torch.Tensor]]:
        """fastgen's token tables and per-head profile, stored in the artifact as PROFILE_FILE."""
        from compress.quantizers.kv_evict import PROFILE_FILE, fastgen_inputs

        ev = self.config.evict
        assert ev is not None
        calibration = ctx.calibration() if ev.profile is None else None
        try:
            tables, profile = fastgen_inputs(model, ctx.tokenizer, calibration, ev, (layers, kv_heads), ctx.device, ctx.reporter)
        except CompressError as e:
            raise CompressError(f"{self.label}: {e}") from None
        ctx.files[PROFILE_FILE] = {k: v.contiguous() for k, v in profile.items()}
        return tables, profile


def estimate_bytes_per_token(cfg: KVCacheConfig, layers: int, kv_heads: int, head_dim: int) -> float:
    """Average stored bytes per token once the window has been flushed (window excluded; eviction not
    counted: what it keeps depends on the context)."""
    if cfg.format == "float":
        return layers * kv_heads * 2 * head_dim * 2.0
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
