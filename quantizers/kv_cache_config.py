"""The recipe's ``kv_cache:`` stage: how keys and values are stored, and how the stage scores them.

Torch-free; the quantized cache, its math and the stage live in compress/quantizers/kv_cache.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from compress.schema.base import BaseStageConfig, Strict

# What each runtime's own KV cache can hold, by (format, bits): llama.cpp cache types
# (`--cache-type-k/-v`, llama_context_params.type_k/type_v) and vLLM's kv_cache_dtype.
LLAMA_CPP_CACHE_TYPES = {("int", 8): "q8_0", ("int", 4): "q4_0"}
VLLM_CACHE_DTYPES = {("fp8", 8): "fp8_e4m3"}
KV_CACHE_ARTIFACT = "kv_cache"  # the compressed model decoding through its quantized KV cache (a kv_cache stage)


class KVEvalConfig(Strict):
    """How the stage scores the quantized cache: incremental decoding at long context."""

    model_config = ConfigDict(extra="forbid")

    context: int = Field(2048, ge=16, description="Tokens of context per evaluation sequence (taken from data.evaluation's text).")
    samples: int = Field(
        32,
        ge=1,
        description="Evaluation sequences: the metrics' 95% intervals are over sequences, so one sequence gives none "
        "and a few give wide ones (32 by default).",
    )
    batch: int = Field(8, ge=1, description="Sequences decoded through the cache at once.")
    step: int = Field(1, ge=1, description="Tokens fed per decoding step after the prefill (1 = token by token).")
    prefill: int = Field(0, ge=0, description="Tokens fed in the first step (0 = start decoding from the first token).")
    needles: int | None = Field(
        None,
        ge=0,
        description="Needle-in-a-haystack rows: a number placed early in an evaluation sequence and asked for at its end, "
        "scored through the cache and through the float forward (needle_recall). null: 8 with evict, 0 without.",
    )
    needle_depth: float = Field(0.1, ge=0, lt=0.9, description="Where the needle goes, as a share of the context.")

    def needle_rows(self, evicting: bool) -> int:
        return (8 if evicting else 0) if self.needles is None else self.needles


EVICT_POLICIES = ("window", "h2o", "snapkv", "fastgen")


class EvictConfig(Strict):
    """`kv_cache.evict: {policy, budget, sink, window, ...}`: which cached tokens each KV head keeps."""

    model_config = ConfigDict(extra="forbid")

    policy: Literal["window", "h2o", "snapkv", "fastgen"] = Field(
        description="window: the first `sink` tokens and the most recent ones (StreamingLLM); h2o: the tokens that received the "
        "most attention so far (heavy hitters) plus the recent `window`; snapkv: the tokens the most recent ~`observe` queries "
        "attend to, max-pooled over `pool` neighbours, plus the recent `window`; fastgen: a policy per KV head profiled on the "
        "calibration text (FastGen): the cheapest of special, +punctuation, +frequent, +local, full that recovers `recovery` "
        "of the head's attention."
    )
    budget: int | None = Field(
        None,
        ge=1,
        description="Tokens each KV head keeps (window, h2o, snapkv): the cache never holds more, so at a context of C tokens it "
        "holds budget/C of a full cache. fastgen has no fixed budget (its knob is `recovery`).",
    )
    sink: int = Field(4, ge=0, description="The first tokens of the sequence, always kept (attention sinks; fastgen's 'special' tokens).")
    window: int = Field(32, ge=0, description="The most recent tokens, always kept by h2o and snapkv.")
    observe: int = Field(32, ge=1, description="snapkv: the queries whose attention scores the cached tokens (an exponential window).")
    pool: int = Field(7, ge=1, description="snapkv: max-pooling width over neighbouring kept tokens (odd).")
    recovery: float = Field(
        0.95, gt=0, le=1, description="fastgen: share of each head's attention its policy must keep (the paper's threshold T)."
    )
    local: float = Field(0.3, gt=0, le=1, description="fastgen: the local window, as a share of the tokens seen.")
    frequent: float = Field(0.3, gt=0, le=1, description="fastgen: the heavy hitters kept, as a share of the tokens seen.")
    profile_samples: int = Field(4, ge=1, description="fastgen: calibration sequences the per-head profile is measured on.")
    profile_context: int = Field(1024, ge=16, le=8192, description="fastgen: tokens per profiling sequence.")
    profile: str | None = Field(
        None,
        description="fastgen: reuse a stored profile (an artifact folder or its kv_cache/evict_profile.safetensors) instead of "
        "profiling; it is checked against the model's layers and KV heads.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> EvictConfig:
        if self.policy == "fastgen":
            if self.budget is not None:
                raise ValueError("evict.budget: fastgen keeps what each head's profile needs; set evict.recovery instead of a budget")
        elif self.budget is None:
            raise ValueError(f"evict.budget: the {self.policy} policy keeps a fixed number of tokens per KV head; set evict.budget")
        elif self.policy != "window" and self.sink + self.window >= self.budget:
            raise ValueError(
                f"evict.budget {self.budget} leaves no room for the {self.policy} policy's chosen tokens next to "
                f"sink {self.sink} + window {self.window}; raise the budget or lower sink/window"
            )
        elif self.sink >= self.budget:
            raise ValueError(f"evict.sink {self.sink} fills the whole budget {self.budget}")
        if self.pool % 2 == 0:
            raise ValueError(f"evict.pool {self.pool} must be odd (a window centred on each token)")
        if self.profile is not None and self.policy != "fastgen":
            raise ValueError("evict.profile is a fastgen per-head profile; the other policies need none")
        return self

    def describe(self) -> str:
        if self.policy == "fastgen":
            return f"fastgen eviction (recovery {self.recovery:g}, local {self.local:g}, frequent {self.frequent:g}, sink {self.sink})"
        extra = "" if self.policy == "window" else f", window {self.window}"
        return f"{self.policy} eviction to {self.budget} tokens per KV head (sink {self.sink}{extra})"


class KVCacheConfig(BaseStageConfig):
    """`kv_cache: {bits, format, key_axis, value_axis, group_size, residual, static_scales, evict, ...}`."""

    model_config = ConfigDict(extra="forbid")

    bits: Literal[16, 8, 4, 2] = Field(8, description="Bits per stored key/value element (fp8 format: 8; float format: 16).")
    format: Literal["int", "fp8", "float"] = Field(
        "int",
        description="int: integer codes with scales; fp8: float8 e4m3 with scales; float: unquantized float16 "
        "(with `evict`: eviction alone).",
    )
    key_axis: Literal["channel", "token"] = Field(
        "channel", description="channel: one scale per head channel over a block of `residual` tokens (KIVI); token: per token."
    )
    value_axis: Literal["token", "channel"] = Field(
        "token", description="token: per-token groups of `group_size` channels (KIVI); channel: like keys."
    )
    group_size: int | None = Field(None, ge=1, description="Channels per per-token group; null = the whole head.")
    residual: int = Field(128, ge=0, description="Most recent tokens kept in full precision; also the token block of per-channel groups.")
    residual_dtype: Literal["float16", "bfloat16", "model"] = Field("float16", description="Storage dtype of the full-precision window.")
    symmetric: bool | None = Field(None, description="Symmetric codes (absmax) or asymmetric (min/max); null: symmetric at 8 bits only.")
    static_scales: bool = Field(
        False, description="Calibrate one scale per layer and KV head on the calibration text instead of storing scales."
    )
    calibration_samples: int | None = Field(None, ge=1, description="Calibration chunks for static scales (default: all).")
    evict: EvictConfig | None = Field(
        None, description="Evict cached tokens (a policy per KV head) beside or instead of quantizing them; null keeps every token."
    )
    evaluate: KVEvalConfig | None = Field(
        default_factory=KVEvalConfig, description="Long-context evaluation through the cache; null to skip."
    )

    def recipe_artifacts(self, label: str, recipe: Any) -> set[str]:
        """At most one kv_cache stage; static scales need data.calibration; evaluating through the
        cache needs data.evaluation and adds the ``kv_cache`` artifact, which gates compare with
        max or min only."""
        kv_stages = [i for i, st in enumerate(recipe.stages) if isinstance(st.config, KVCacheConfig)]
        if len(kv_stages) > 1:
            raise ValueError(f"stages {kv_stages} are all kv_cache stages; a recipe has at most one")
        if self.static_scales and recipe.data.calibration is None:
            raise ValueError(f"{label} (kv_cache) calibrates static scales and needs data.calibration")
        ev = self.evict
        if ev is not None and ev.policy == "fastgen" and ev.profile is None and recipe.data.calibration is None:
            raise ValueError(f"{label} (kv_cache) profiles fastgen's per-head policies on data.calibration; add it or set evict.profile")
        if self.evaluate is None:
            return set()
        if recipe.data.evaluation is None:
            raise ValueError(f"{label} (kv_cache) evaluates through the cache and needs data.evaluation (or set kv_cache.evaluate: null)")
        for i, gate in enumerate(recipe.gates):
            if gate.artifact == KV_CACHE_ARTIFACT and gate.threshold_kind.startswith("max_"):
                raise ValueError(
                    f"gates[{i}]: kv_cache metrics are measured at the kv_cache stage's context against the "
                    f"compressed model's float cache, not against the baseline; use max or min, not {gate.threshold_kind}"
                )
        return {KV_CACHE_ARTIFACT}

    @model_validator(mode="before")
    @classmethod
    def _float_bits(cls, data: Any) -> Any:
        """`format: float` alone means float16 (bits 16)."""
        if isinstance(data, dict) and data.get("format") == "float" and "bits" not in data:
            return {**data, "bits": 16}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> KVCacheConfig:
        if self.format == "fp8" and self.bits != 8:
            raise ValueError("format fp8 stores 8 bits; set bits: 8")
        if (self.format == "float") != (self.bits == 16):
            raise ValueError("bits 16 is the float format (unquantized float16): set format: float and bits: 16 together")
        if self.format == "float" and self.evict is None:
            raise ValueError("format float stores the cache unquantized; without evict this stage changes nothing (set evict)")
        if self.format == "float" and self.static_scales:
            raise ValueError("format float has no scales; drop static_scales")
        if self.evict is not None:
            self._check_evict(self.evict)
        if self.residual % 4:
            raise ValueError("residual must be a multiple of 4 (2-bit codes pack 4 tokens to a byte in per-channel blocks)")
        if self.residual == 0 and "channel" in (self.key_axis, self.value_axis):
            raise ValueError("per-channel groups span a block of `residual` tokens; set residual > 0 or use axis: token")
        if self.static_scales and (self.bits < 8 and self.format == "int"):
            raise ValueError("static scales are one number per layer and head; below 8 bits use dynamic scales (static_scales: false)")
        if self.static_scales and self.symmetric is False:
            raise ValueError("static scales are symmetric (absmax); drop `symmetric: false`")
        return self

    def _check_evict(self, ev: EvictConfig) -> None:
        if self.format != "float" and ev.budget is not None and self.residual and ev.budget <= ev.sink + self.residual:
            raise ValueError(
                f"evict.budget {ev.budget} must exceed sink {ev.sink} + residual {self.residual}: the full-precision window "
                "(up to `residual` tokens) is never evicted and counts against the budget"
            )
        context = self.evaluate.context if self.evaluate else None
        if context is not None:
            if ev.budget is not None and ev.budget >= context:
                raise ValueError(
                    f"evict.budget {ev.budget} >= evaluate.context {context}: nothing would be evicted; lower the budget or raise the context"
                )
            if ev.window >= context:
                raise ValueError(f"evict.window {ev.window} >= evaluate.context {context}: the window alone would keep every token")
            if ev.sink >= context:
                raise ValueError(f"evict.sink {ev.sink} >= evaluate.context {context}: the sink alone would keep every token")

    @property
    def is_symmetric(self) -> bool:
        if self.format == "fp8" or self.static_scales:
            return True
        return self.bits == 8 if self.symmetric is None else self.symmetric

    def describe(self) -> str:
        evict = f", {self.evict.describe()}" if self.evict else ""
        if self.format == "float":
            return f"float16{evict}"
        kind = "fp8 e4m3" if self.format == "fp8" else f"int{self.bits} {'sym' if self.is_symmetric else 'asym'}"
        scales = "static scales" if self.static_scales else f"K per {self.key_axis}, V per {self.value_axis}"
        return f"{kind}, {scales}, residual {self.residual}{evict}"

    def runtime_support(self) -> dict[str, dict[str, Any]]:
        """What each deployment runtime can hold of this scheme (for the manifest and report)."""
        out = self._quantization_support()
        if self.evict is not None:
            for name, entry in out.items():
                entry["eviction"] = {
                    "supported": False,
                    "why": f"{name} has no per-head eviction policy in its cache: the {self.evict.policy} policy runs in the torch "
                    "path here and is a measured recommendation for serving stacks that implement it",
                }
        return out

    def _quantization_support(self) -> dict[str, dict[str, Any]]:
        key = (self.format, self.bits)
        out: dict[str, dict[str, Any]] = {}
        if self.format == "float":
            for name in ("llama.cpp", "vllm", "onnxruntime-genai"):
                out[name] = {"supported": True, "note": "float16 keys and values: the runtime's default cache"}
            out["llama.cpp"].update(type_k="f16", type_v="f16")
            return out
        cache_type = LLAMA_CPP_CACHE_TYPES.get(key)
        if cache_type:
            out["llama.cpp"] = {
                "supported": True,
                "type_k": cache_type,
                "type_v": cache_type,
                "note": f"llama.cpp quantizes the cache itself in {cache_type} blocks of 32 per token; its numbers differ from this scheme's",
            }
        else:
            out["llama.cpp"] = {
                "supported": False,
                "why": f"llama.cpp has no {self.format}{self.bits} cache type (it has f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1)",
            }
        vllm = VLLM_CACHE_DTYPES.get(key)
        if vllm and self.static_scales:
            out["vllm"] = {
                "supported": True,
                "kv_cache_dtype": vllm,
                "scales": "per-layer k_scale/v_scale in the compressed-tensors checkpoint",
            }
        elif vllm:
            out["vllm"] = {"supported": True, "kv_cache_dtype": vllm, "note": "dynamic scales: vLLM computes its own per-tensor scales"}
        else:
            out["vllm"] = {"supported": False, "why": "vLLM quantizes the KV cache to fp8 only"}
        if self.static_scales and key in (("int", 8), ("fp8", 8)):
            scheme = f"{'int8' if self.format == 'int' else 'fp8'}_per_channel"
            out["onnxruntime-genai"] = {
                "supported": True,
                "kv_cache_quant_scheme": scheme,
                "scales": "per-layer, per-KV-head scales repeated over each head's channels (kv_cache_scales.json)",
                **({"note": "fp8: CUDA only in onnxruntime 1.31"} if self.format == "fp8" else {}),
            }
        else:
            out["onnxruntime-genai"] = {
                "supported": False,
                "why": "ONNX Runtime GenAI's CPU/CUDA attention takes static per-tensor or "
                "per-channel scales (static_scales: true, int8 or fp8); per-token scales need CUDA paged attention",
            }
        return out
