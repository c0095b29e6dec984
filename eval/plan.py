"""`compress plan`: estimated memory, time, artifact sizes and device fit of a recipe, before any
heavy work. Reads the model's config only (config.json, or GGUF metadata) and builds the model on
torch's ``meta`` device (shapes, no weights) to count parameters and select quantized layers.

Every number here is an estimate, labelled so: order-of-magnitude guidance, never a measurement.
Stage times use throughputs measured on this project's reference machine (2 CPU cores, torch 2.13
CPU, 2 threads, SmolLM2-135M), scaled by parameters and tokens; a faster CPU or a GPU is quicker.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compress.errors import CompressError, ModelLoadError
from compress.eval.devices import LOCAL, DeviceProfile, estimate_latency, fit_check, get_profile, kv_bytes_per_token
from compress.recipe import LoadedRecipe, ModelSpec, Recipe

# Measured on the reference machine (README "Measured" sections, docs/bench/*.json, out/manifest.json).
REFERENCE = "rough numbers of this project's 2-core CPU (torch 2.13, 2 threads); other machines differ"
REF_PARAMS = 134_515_008  # SmolLM2-135M
CPU_FORWARD_FLOPS = 160e9  # quickstart evaluation: 2 models x 32 x 512 tokens in 54 s (2 x params FLOPs/token)
LOAD_BYTES_PER_S = 0.2e9  # the 538 MB float32 model (cached conversion) loaded in 2.7 s
RTN_WEIGHTS_PER_S = 1.0e8  # RTN: 106M weights in ~1.0 s
DISTILL_TOKENS_PER_S = {"bf16": 250.0, "fp32": 124.0}  # distillation training of the 135M model
TORCH_DECODE_TOKENS_PER_S = 18.0  # token-by-token torch decoding with a DynamicCache, 135M model, fp32
EXPORT_BUILD_S = 60.0  # writing and proving one export file of the 135M model, without scoring it (onnx.yaml: ~110 s per export)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# llama.cpp's bits per weight: exact block sizes, and its published averages for the K-quant mixes.
GGUF_BITS = {"f32": 32, "f16": 16, "bf16": 16, "q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0, "q5_0": 5.5, "q5_1": 6.0,
             "q2_k": 3.35, "q3_k_s": 3.5, "q3_k_m": 3.91, "q3_k_l": 4.27, "q4_k_s": 4.58, "q4_k_m": 4.89,
             "q5_k_s": 5.54, "q5_k_m": 5.69, "q6_k": 6.56, "iq4_nl": 4.5, "iq4_xs": 4.25}
GB = 1e9


@dataclass
class ModelShape:
    """A model's architecture without weights: its config and a meta-device instance."""

    config: Any  # transformers PretrainedConfig
    model: Any  # the model on torch's meta device (shapes only)
    params: int  # distinct parameters (a tied embedding counts once)
    origin: str  # where the config came from

    @property
    def text(self) -> Any:
        return self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config

    def frozen_params(self) -> int:
        """The embedding and output head: what `distill: train: blocks` leaves frozen."""
        emb, out = self.model.get_input_embeddings(), self.model.get_output_embeddings()
        return emb.weight.numel() + (out.weight.numel() if out is not None and out.weight is not emb.weight else 0)


# --------------------------------------------------------------------------- the model's shape


def model_shape(spec: ModelSpec, base_dir: Path) -> ModelShape:
    config, origin = source_config(spec, base_dir)
    return shape_of(config, spec.trust_remote_code, origin)


def source_config(spec: ModelSpec, base_dir: Path) -> tuple[Any, str]:
    """The model's transformers config, read without loading (or downloading) any weights."""
    from transformers import AutoConfig

    from compress import assets, models
    from compress.paths import cache_root

    source = spec.source
    name = assets.parse_reference(source)
    if name is not None:
        if name not in assets.ASSETS or assets.ASSETS[name].kind != "model":
            known = ", ".join(f"reference:{n}" for n, a in assets.ASSETS.items() if a.kind == "model")
            raise ModelLoadError(f"'{source}' is not a reference model; known: {known}")
        asset = assets.locate(name)
        if asset is None:
            raise ModelLoadError(f"model.source {source} is not in the cache; `compress plan` downloads nothing. "
                                 f"Run `compress assets fetch {name}` first.")
        gguf = next(f for f in asset.files if f.suffix == ".gguf")
        converted = cache_root() / "models" / f"gguf-{asset.meta['files'][gguf.name][:16]}"
        if (converted / models.CONVERTED_MARKER).is_file():
            return AutoConfig.from_pretrained(converted, local_files_only=True), f"config.json of the converted {source} ({converted})"
        return _gguf_config(gguf)
    path = Path(source).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_config(path)
    if not path.exists() and models.HUB_ID.match(source):
        from huggingface_hub import snapshot_download

        try:
            path = Path(snapshot_download(source, local_files_only=True))
        except Exception as exc:  # huggingface_hub raises several types for "not cached"
            raise ModelLoadError(f"'{source}' is not in the local Hugging Face cache; compress never downloads models") from exc
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model.source {source}: no config.json at {path} (give a Hugging Face directory, a .gguf file, "
                             "a cached Hugging Face id or reference:<name>)")
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=spec.trust_remote_code, local_files_only=True), f"{path / 'config.json'}"
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"transformers could not read {path / 'config.json'}: {exc}") from exc


def _gguf_config(path: Path) -> tuple[Any, str]:
    from transformers import AutoConfig

    try:  # transformers reads the metadata with gguf.GGUFReader (memory-mapped; tensors are not loaded)
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name), f"GGUF metadata of {path}"
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read the model config from the GGUF metadata of {path}: {exc}") from exc


def shape_of(config: Any, trust_remote_code: bool = False, origin: str = "") -> ModelShape:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = config.__class__.from_dict(config.to_dict())
    if hasattr(config, "quantization_config"):  # a quantized checkpoint: its float architecture is what we count
        del config.quantization_config
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"transformers cannot build a causal LM from this config ({origin}): {exc}") from exc
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return ModelShape(config, model, params, origin)


def pruned_shape(shape: ModelShape, prune: Any) -> ModelShape:
    """The shape a prune stage leaves (sizes resolved exactly as the stage does)."""
    from compress.pruning.arch import PrunableModel
    from compress.pruning.prune import resolve_sizes

    pm = PrunableModel.of(shape.model)
    sizes = resolve_sizes(prune, pm)
    heads = sizes.get("heads", pm.num_heads)
    layers = sizes.get("layers", len(pm.blocks))
    data = shape.config.to_dict()
    data.update(intermediate_size=sizes.get("mlp", pm.intermediate_size), hidden_size=sizes.get("hidden", pm.hidden_size),
                num_attention_heads=heads, num_key_value_heads=heads // (pm.num_heads // pm.kv_heads), head_dim=pm.head_dim,
                num_hidden_layers=layers)
    if isinstance(data.get("layer_types"), list):
        data["layer_types"] = data["layer_types"][:layers]
    return shape_of(shape.config.__class__.from_dict(data), False, f"{shape.origin}, pruned to {sizes}")


# --------------------------------------------------------------------------- sizes


@dataclass
class Record:
    """A quantized Linear as the plan sees it: shape, scheme, and whether its weight is the tied embedding."""

    out_f: int
    in_f: int
    scheme: Any  # QuantScheme
    tied: bool


def quantized_layers(recipe: Recipe, shape: ModelShape) -> dict[str, Record]:
    from compress.quantizers.targets import select_linears

    emb = shape.model.get_input_embeddings().weight
    records: dict[str, Record] = {}
    for stage in recipe.stages:
        if stage.kind == "quantize":
            chosen, _ = select_linears(shape.model, stage.config.targets, stage.config.ignore)
            for name, m in chosen:
                records[name] = Record(m.out_features, m.in_features, stage.config.scheme(), m.weight is emb)
    return records


def packed_bytes(shape: ModelShape, records: dict[str, Record], float_bits: float, code_bits: float | None = None,
                 scale_bits: float | None = None, zero_bits: float | None = None, group: int | None = None,
                 zeros_always: bool = False, extra_bits_per_input: float = 0) -> int:
    """Bytes of a file holding ``records`` as codes + per-group scales (+ zero points) and every
    other parameter at ``float_bits``. None: take the record's own bits / scale dtype / group;
    zero points cost the code bits for asymmetric records (all records with ``zeros_always``)."""
    total = 0.0
    quantized = 0
    for r in records.values():
        s = r.scheme
        g = group or s.group_width(r.in_f)
        zb = zero_bits if zero_bits is not None else (s.bits if zeros_always or not s.symmetric else 0)
        sb = scale_bits if scale_bits is not None else (32 if s.scale_dtype == "float32" else 16)
        total += r.out_f * r.in_f * (code_bits or s.bits) + r.out_f * math.ceil(r.in_f / g) * (sb + zb) + r.in_f * extra_bits_per_input
        quantized += 0 if r.tied else r.out_f * r.in_f  # a tied weight still exists as the float embedding
    return int((total + (shape.params - quantized) * float_bits) / 8)


def artifacts(recipe: Recipe, source: ModelShape, shape: ModelShape, records: dict[str, Record]) -> list[dict[str, Any]]:
    """The run's artifacts (the baseline of shape ``source``, the others of ``shape``, after the
    stages) with format, runtime, estimated size and the KV-cache bytes per element they use."""
    dtype_bits = 8 * DTYPE_BYTES[recipe.model.dtype]
    rows = []

    def add(name: str, fmt: str, runtime: str, size: int, kv_bytes: float, basis: str) -> None:
        params = source.params if name == "baseline" else shape.params
        rows.append({"artifact": name, "format": fmt, "runtime": runtime, "size_bytes": size, "bits_per_param": round(8 * size / params, 3),
                     "kv_bytes_per_element": kv_bytes, "basis": basis})

    add("baseline", "hf", "torch", source.params * dtype_bits // 8, dtype_bits / 8, f"every parameter at {recipe.model.dtype}")
    if not recipe.stages:
        return rows
    packed = packed_bytes(shape, records, dtype_bits)
    scheme_note = ", ".join(sorted({r.scheme.describe() for r in records.values()})) or "no quantized layers"
    add("compressed", "hf", "torch", packed, dtype_bits / 8,
        f"{len(records)} quantized layers ({scheme_note}) packed: bits + scale bits / group (+ zero-point bits when asymmetric); "
        f"the rest at {recipe.model.dtype}")
    kv = next((s.config for s in recipe.stages if s.kind == "kv_cache"), None)
    if kv is not None and kv.evaluate is not None:
        add("kv_cache", "hf", "torch", packed, _kv_element_bytes(kv, shape), f"compressed weights; KV cache {kv.describe()}")
    for spec in recipe.exports:
        add(spec.name, *_export_size(spec, shape, records, dtype_bits))
    return rows


def _export_size(spec: Any, shape: ModelShape, records: dict[str, Record], dtype_bits: int) -> tuple[str, str, int, float, str]:
    fmt = spec.format
    if fmt in ("compressed-tensors", "gptq"):
        if fmt == "gptq":
            size = packed_bytes(shape, records, dtype_bits, scale_bits=16, zeros_always=True, extra_bits_per_input=32)
            basis = "codes + float16 scales + zero points (always stored) per group + int32 g_idx; the rest at the model dtype"
        else:
            size, basis = packed_bytes(shape, records, dtype_bits), "codes + scales (+ zero points) per group; the rest at the model dtype"
        return "hf", "torch", size, 2.0, basis
    if fmt == "gguf":
        if spec.quantizer == "llama.cpp":
            kind, float_type = spec.type, spec.float_type or "q8_0"  # llama.cpp picks the embedding's type itself; q8_0 assumed
            size = _uniform_bytes(shape, GGUF_BITS[kind], GGUF_BITS[float_type])
            return "gguf", "llama.cpp", size, 2.0, (f"llama.cpp {kind} at ~{GGUF_BITS[kind]} bits/weight (its published average; rows "
                                                    f"that are not a multiple of 256 fall back to larger types), embedding {float_type}")
        kind = _gguf_type(spec.type, records)
        float_type = spec.float_type or ("q8_0" if kind.startswith("q") else kind)
        size = packed_bytes(shape, records, GGUF_BITS[float_type], code_bits=GGUF_BITS[kind], scale_bits=0, zero_bits=0)
        return "gguf", "llama.cpp", size, 2.0, f"records as {kind} blocks ({GGUF_BITS[kind]} bits/weight), other tensors {float_type}"
    if fmt == "onnx":
        float_bits = 32 if spec.device == "cpu" else 16
        precision = spec.precision
        if precision == "auto":
            precision = {4: "int4", 8: "int8"}.get(_only_bits(records), "fp32") if records else "fp32"
        if precision in ("fp32", "fp16"):
            size = shape.params * (32 if precision == "fp32" else 16) // 8
            return "onnx", "onnxruntime", size, float_bits / 8, f"every parameter at {precision}"
        bits, block = (4 if precision == "int4" else 8), spec.block_size or 32
        if spec.quantizer == "builder" or not records:
            size = _builder_bytes(shape, bits, block, spec.symmetric, float_bits)
            return "onnx", "onnxruntime", size, float_bits / 8, f"builder {precision} blocks of {block}; floats at {float_bits} bits"
        size = packed_bytes(shape, records, float_bits, code_bits=bits, scale_bits=float_bits)
        basis = f"MatMulNBits {precision}: codes + {float_bits}-bit scales per group; floats at {float_bits} bits"
        return "onnx", "onnxruntime", size, float_bits / 8, basis
    float_bits = 16 if spec.dtype == "float16" else 32  # tensorrt
    if spec.fp8:
        size = packed_bytes(shape, records, float_bits, code_bits=8, scale_bits=float_bits, zero_bits=0, group=10**9)
        basis = "fp8 e4m3 weights with per-channel scales"
    elif spec.fallback == "int8" and any(not r.scheme.symmetric or r.scheme.bits != 4 for r in records.values()):
        size = packed_bytes(shape, records, float_bits, code_bits=8, scale_bits=float_bits, zero_bits=0, group=10**9)
        basis = "records without an exact Q/DQ form as int8 per-channel"
    else:
        size = packed_bytes(shape, records, float_bits, scale_bits=float_bits, zero_bits=0)
        basis = f"int{_only_bits(records) or 4} Q/DQ blocks with {float_bits}-bit scales"
    return "tensorrt", "tensorrt", size, float_bits / 8, basis + f"; floats at {spec.dtype}"


def _only_bits(records: dict[str, Record]) -> int | None:
    bits = {r.scheme.bits for r in records.values()}
    return bits.pop() if len(bits) == 1 else None


def _linear_weights(shape: ModelShape, with_lm_head: bool) -> int:
    """Weights of Linear layers that are not the tied embedding (and not the output head unless asked)."""
    from torch import nn

    emb = shape.model.get_input_embeddings().weight
    return sum(m.weight.numel() for n, m in shape.model.named_modules()
               if isinstance(m, nn.Linear) and m.weight is not emb and (with_lm_head or not n.endswith("lm_head")))


def _uniform_bytes(shape: ModelShape, linear_bits: float, other_bits: float) -> int:
    linear = _linear_weights(shape, with_lm_head=True)
    return int((linear * linear_bits + (shape.params - linear) * other_bits) / 8)


def _builder_bytes(shape: ModelShape, bits: int, block: int, symmetric: bool, float_bits: int) -> int:
    linear = _linear_weights(shape, with_lm_head=False)
    per_weight = bits + (float_bits + (0 if symmetric else bits)) / block
    return int((linear * per_weight + (shape.params - linear) * float_bits) / 8)


def _kv_element_bytes(kv: Any, shape: ModelShape) -> float:
    """Bytes per cached K/V element of a kv_cache scheme: codes + fp16 scale (+ zero) per group."""
    if kv.static_scales:
        return kv.bits / 8
    head_dim = int(getattr(shape.text, "head_dim", None) or shape.text.hidden_size // shape.text.num_attention_heads)
    per_group = 2 if kv.is_symmetric else 4
    groups = [kv.residual if axis == "channel" else (kv.group_size or head_dim) for axis in (kv.key_axis, kv.value_axis)]
    return kv.bits / 8 + sum(per_group / g for g in groups) / 2


# --------------------------------------------------------------------------- stages: memory and time


def _forward_s(params: int, tokens: float) -> float:
    return 2 * params * tokens / CPU_FORWARD_FLOPS


def _activation_bytes(shape: ModelShape, batch: int, seq: int) -> float:
    """One inference forward pass of ``batch`` x ``seq`` tokens: one block's live tensors, its
    attention scores, and float32 logits + log-probabilities."""
    t = shape.text
    block = batch * seq * (4 * t.hidden_size + 3 * t.intermediate_size) * 4
    scores = batch * t.num_attention_heads * seq * seq * 4
    return block + scores + 2 * batch * seq * t.vocab_size * 4


def _training_bytes(shape: ModelShape, batch: int, seq: int, bf16: bool) -> float:
    """Activations kept for backward, s*b*h*(34 + 5*a*s/h) bytes per layer at 16 bits (Korthikanti
    et al. 2022; x2 in float32), plus teacher and student logits, log-probabilities and their gradient."""
    t = shape.text
    per_layer = seq * batch * t.hidden_size * (34 + 5 * t.num_attention_heads * seq / t.hidden_size)
    return t.num_hidden_layers * per_layer * (1 if bf16 else 2) + 4 * batch * seq * t.vocab_size * 4


def stage_estimates(recipe: Recipe, shape: ModelShape, records: dict[str, Record],
                    export_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step of the run: load, each stage, evaluation, each export (``export_rows``:
    the artifacts rows, which end with the exports in recipe order)."""
    dtype = DTYPE_BYTES[recipe.model.dtype]
    base = shape.params * dtype  # the baseline stays in memory for the whole run
    cal = recipe.data.calibration
    cal_tokens = cal.samples * cal.seq_len if cal else 0
    copies = "baseline + working copy" if recipe.stages else "the model"
    rows = [{"step": "load model", "peak_memory_gb": (2 if recipe.stages else 1) * base / GB, "time_s": base / LOAD_BYTES_PER_S,
             "basis": f"{copies} at {recipe.model.dtype} ({shape.params:,} parameters); reading at ~{LOAD_BYTES_PER_S / GB:.1f} GB/s"}]
    cur = shape
    for i, stage in enumerate(recipe.stages):
        cfg = stage.config
        label = f"stages[{i}] {stage.kind}" + (f" {cfg.method}" if hasattr(cfg, "method") else "")
        held = base + cur.params * dtype
        if stage.kind == "prune":
            passes = 1 + (cur.text.num_hidden_layers if cfg.layers and cfg.layers.metric == "kl" else 0)
            mem, secs = held + _activation_bytes(cur, cfg.batch_size, cal.seq_len), passes * _forward_s(cur.params, cal_tokens)
            basis = (f"baseline + working copy + one forward of {cfg.batch_size} x {cal.seq_len} tokens; "
                     f"{passes} pass(es) over {cal_tokens:,} calibration tokens")
            cur = pruned_shape(cur, cfg)
        elif stage.kind == "distill":
            bf16 = cfg.autocast == "bf16"
            trainable = cur.params - (cur.frozen_params() if cfg.train == "blocks" else 0)
            tokens = cfg.steps * cfg.batch_size * cfg.grad_accum * cfg.seq_len
            rate = DISTILL_TOKENS_PER_S["bf16" if bf16 else "fp32"] * REF_PARAMS / cur.params
            mem = held + 12 * trainable + _training_bytes(cur, cfg.batch_size, cfg.seq_len, bf16)
            secs = tokens / rate
            basis = (f"teacher (the baseline) + student + fp32 grads and AdamW moments of {trainable:,} trainable parameters + activations "
                     f"of {cfg.batch_size} x {cfg.seq_len} tokens; {tokens:,} tokens at ~{rate:,.0f} tokens/s "
                     f"({'bf16 autocast' if bf16 else 'float32'}, scaled from the 135M model)")
        elif stage.kind == "quantize":
            selected = set(_selected(cur, cfg))
            mine = {n: r for n, r in records.items() if n in selected}
            weights = sum(r.out_f * r.in_f for r in mine.values())
            codes = weights  # one uint8 per weight, unpacked
            if cfg.method == "rtn":
                mem, secs = held + codes, weights / RTN_WEIGHTS_PER_S
                basis = f"baseline + working copy + uint8 codes of {weights:,} weights; ~{RTN_WEIGHTS_PER_S:.0e} weights/s"
            else:
                t = cur.text
                hidden_states = 2 * cal_tokens * t.hidden_size * 4
                hessians = sum(r.in_f**2 for n, r in mine.items() if re.search(r"\.0\.", n)) * 4  # the first block's Linears
                mem = held + codes + hidden_states + hessians + _activation_bytes(cur, cfg.batch_size, cal.seq_len) / 2
                block_linear = sum(r.in_f**2 for r in mine.values())
                if cfg.method == "gptq":
                    secs = _forward_s(weights, cal_tokens) + 2 * block_linear * cal_tokens / CPU_FORWARD_FLOPS
                    how = f"forward + Hessian accumulation (2 x in_features^2 per Linear per token) over {cal_tokens:,} calibration tokens"
                elif cfg.method == "awq":
                    secs = _forward_s(weights, cal_tokens) + 1.25 * cfg.grid * _forward_s(weights, cfg.search_tokens)
                    how = (f"forward over {cal_tokens:,} calibration tokens + {cfg.grid} scale candidates x "
                           f"{cfg.search_tokens:,} search tokens (+25% clipping)")
                else:  # llm_int8: one pass to find outlier columns, then rounding
                    secs = _forward_s(cur.params, cal_tokens) + weights / RTN_WEIGHTS_PER_S
                    how = f"one forward over {cal_tokens:,} calibration tokens, then rounding"
                basis = (f"baseline + working copy + codes + block inputs/outputs of {cal_tokens:,} tokens (float32) + one block's "
                         f"Hessians; {how}")
        else:  # kv_cache
            per_token = kv_bytes_per_token(cur.config, dtype)
            ev = cfg.evaluate
            mem = held + (2 * per_token * ev.context * ev.samples if ev else 0)
            rate = TORCH_DECODE_TOKENS_PER_S * REF_PARAMS / cur.params
            secs = (2 * ev.samples * ev.context / rate if ev else 0) + (_forward_s(cur.params, cal_tokens) if cfg.static_scales else 0)
            basis = (f"baseline + working copy + float and quantized caches at {ev.context if ev else 0} tokens; decoding "
                     f"{ev.samples if ev else 0} x {ev.context if ev else 0} tokens token by token twice (float cache and quantized) "
                     f"at ~{rate:.0f} tokens/s" if ev else "baseline + working copy; no evaluation through the cache")
        rows.append({"step": label, "peak_memory_gb": mem / GB, "time_s": secs, "basis": basis})
    ev = recipe.data.evaluation
    if ev is not None:
        tokens = ev.samples * ev.seq_len
        models = 2 if recipe.stages else 1
        rows.append({"step": "evaluate", "peak_memory_gb": (base + cur.params * dtype + _activation_bytes(cur, ev.batch_size, ev.seq_len)) / GB,
                     "time_s": _forward_s(shape.params, tokens) + (_forward_s(cur.params, tokens) if recipe.stages else 0),
                     "basis": f"{models} model(s) x {ev.samples} x {ev.seq_len} tokens at 2 x params FLOPs/token, "
                              f"~{CPU_FORWARD_FLOPS / GB:.0f} GFLOPS"})
    for spec, art in zip(recipe.exports, export_rows[len(export_rows) - len(recipe.exports):]):  # exports come last
        verify = getattr(spec, "verify", False) and ev is not None
        tokens = (getattr(spec, "verify_samples", None) or (ev.samples if ev else 0)) * (ev.seq_len if ev else 0) if verify else 0
        if spec.format == "tensorrt":
            tokens = spec.check_tokens
        rows.append({"step": f"export {spec.name} ({spec.format})",
                     "peak_memory_gb": (base + cur.params * dtype + 2 * art["size_bytes"]) / GB,
                     "time_s": EXPORT_BUILD_S * cur.params / REF_PARAMS + _forward_s(cur.params, tokens),
                     "basis": f"baseline + working copy + the file twice (written, then loaded by its runtime); ~{EXPORT_BUILD_S:.0f} s "
                              f"per 135M parameters to write and prove it + scoring {tokens:,} tokens on its runtime"})
    return rows


def _selected(shape: ModelShape, cfg: Any) -> list[str]:
    from compress.quantizers.targets import select_linears

    return [n for n, _ in select_linears(shape.model, cfg.targets, cfg.ignore)[0]]


# --------------------------------------------------------------------------- the plan


def plan_recipe(loaded: LoadedRecipe, devices: dict[str, DeviceProfile], targets: list[str], context: int | None = None,
                batch: int | None = None) -> dict[str, Any]:
    """Estimates for one recipe: per-step memory and time, artifact sizes, and the fit of each
    artifact on each target device. ``targets`` empty: ``local`` (when in ``devices``) and the
    recipe's `targets:`, or every device when it has none. ``context``/``batch`` given: for every
    device; else a recipe target's own, else data.evaluation.seq_len (2048 without it) and 1."""
    recipe = loaded.recipe
    if (batch is not None and batch < 1) or (context is not None and context < 1):
        raise CompressError(f"--context and --batch must be positive (got context {context}, batch {batch})")
    if not targets:
        named = [t.device for t in recipe.targets]
        targets = ([LOCAL] if LOCAL in devices and LOCAL not in named else []) + named if named else list(devices)
    chosen = [get_profile(devices, n) for n in dict.fromkeys(targets)]
    shape = model_shape(recipe.model, loaded.base_dir)
    final = shape
    for stage in recipe.stages:
        if stage.kind == "prune":
            final = pruned_shape(final, stage.config)
    records = quantized_layers(recipe, final)
    arts = artifacts(recipe, shape, final, records)
    steps = stage_estimates(recipe, shape, records, arts)
    fits = []
    for dev in chosen:
        ctx, n = _serving(recipe, dev.name, context, batch)
        prompt, output = (recipe.latency.prompt_tokens, recipe.latency.output_tokens) if recipe.latency else (max(ctx // 2, 1), max(ctx - ctx // 2, 1))
        for art in arts:
            s = shape if art["artifact"] == "baseline" else final
            per_token = kv_bytes_per_token(s.config, art["kv_bytes_per_element"])
            fit = fit_check(dev, art["size_bytes"], per_token, ctx, n)
            lat = estimate_latency(dev, art["size_bytes"], per_token, s.params, prompt, output, n)
            fits.append({"device": dev.name, "artifact": art["artifact"], "format": art["format"], "runtime": art["runtime"],
                         "size_mb": art["size_bytes"] / 2**20, "kv_bytes_per_token": per_token, **fit,
                         "supported": dev.supports(art["format"], art["runtime"]), "prompt_tokens": prompt, "output_tokens": output,
                         "ttft_ms": lat["ttft_ms"], "decode_tokens_per_s": lat["decode_tokens_per_s"],
                         "batch_decode_tokens_per_s": lat["batch_decode_tokens_per_s"], "decode_bound": lat["assumptions"]["decode_bound"]})
    peak = max(r["peak_memory_gb"] for r in steps)
    local = devices.get(LOCAL)
    return {
        "source": "estimated",
        "recipe": {"name": recipe.name, "path": str(loaded.path)},
        "model": {"source": recipe.model.source, "config": shape.origin, "architecture": type(shape.model).__name__,
                  "parameters": shape.params, "parameters_after_stages": final.params, "dtype": recipe.model.dtype,
                  "quantized_layers": len(records)},
        "steps": steps,
        "total": {"time_s": sum(r["time_s"] for r in steps), "peak_memory_gb": peak,
                  "fits_this_machine": None if local is None else peak * GB <= local.usable_bytes},
        "artifacts": arts,
        "fit": fits,
        "devices": {d.name: d.model_dump() for d in chosen},
        "assumptions": {
            "times": REFERENCE, "cpu_forward_gflops": CPU_FORWARD_FLOPS / GB, "load_gb_per_s": LOAD_BYTES_PER_S / GB,
            "rtn_weights_per_s": RTN_WEIGHTS_PER_S, "distill_tokens_per_s_135m": DISTILL_TOKENS_PER_S,
            "torch_decode_tokens_per_s_135m": TORCH_DECODE_TOKENS_PER_S, "export_build_s_135m": EXPORT_BUILD_S,
            "fit": "weights + KV cache (context x batch tokens) <= memory_gb x usable_memory_fraction; activations and runtime "
                   "buffers are not counted (usable_memory_fraction leaves room for them)",
            "latency": "roofline (eval/devices.py) at each row's prompt_tokens and output_tokens (the recipe's latency block, "
                       "else half the context each)",
        },
    }


def _serving(recipe: Recipe, device: str, context: int | None, batch: int | None) -> tuple[int, int]:
    """(context, batch) of a device's fit check: the command line's, else the recipe target's, else defaults."""
    target = next((t for t in recipe.targets if t.device == device), None)
    default = recipe.data.evaluation.seq_len if recipe.data.evaluation else 2048
    if target is not None and target.context is None and recipe.latency is not None:
        default = recipe.latency.prompt_tokens + recipe.latency.output_tokens
    return (context or (target.context if target and target.context else default),
            batch or (target.batch if target else 1))


# --------------------------------------------------------------------------- output


def tables(plan: dict[str, Any]) -> list[Any]:
    """The plan as rich tables (steps, artifacts, device fit), every title saying estimated."""
    from rich import box
    from rich.table import Table

    def table(title: str, columns: list[tuple[str, str]]) -> Table:
        t = Table(title=f"estimated: {title}", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
        for name, justify in columns:
            t.add_column(name, justify=justify, no_wrap=name not in ("basis", "device"), overflow="fold")
        return t

    m = plan["model"]
    steps = table(f"{plan['recipe']['name'] or 'recipe'}: {m['architecture']}, {m['parameters']:,} parameters ({m['dtype']})",
                  [("step", "left"), ("peak memory", "right"), ("time", "right"), ("basis", "left")])
    for r in plan["steps"]:
        steps.add_row(r["step"], f"{r['peak_memory_gb']:.2f} GB", _duration(r["time_s"]), r["basis"])
    total = plan["total"]
    here = {None: "", True: "; fits this machine", False: "; [red]more than this machine's usable memory[/]"}[total["fits_this_machine"]]
    steps.add_row("[bold]total[/]", f"{total['peak_memory_gb']:.2f} GB", _duration(total["time_s"]), "peak of the steps, sum of the times" + here)
    arts = table("artifacts", [("artifact", "left"), ("format/runtime", "left"), ("size", "right"), ("bits/param", "right"), ("basis", "left")])
    for a in plan["artifacts"]:
        arts.add_row(a["artifact"], f"{a['format']}/{a['runtime']}", f"{a['size_bytes'] / 2**20:,.1f} MiB", f"{a['bits_per_param']:.2f}", a["basis"])
    fit = table("fit: weights + KV cache at context x batch vs usable memory (GB); runs: the device runs the artifact's "
                "format and runtime; tok/s: roofline decode speed per sequence",
                [("device", "left"), ("artifact", "left"), ("MiB", "right"), ("ctx x b", "right"), ("GB need/usable", "right"),
                 ("fits", "left"), ("runs", "left"), ("tok/s", "right")])
    for r in plan["fit"]:
        fit.add_row(r["device"], r["artifact"], f"{r['size_mb']:,.1f}", f"{r['context']:,}x{r['batch']}",
                    f"{r['required_gb']:.3g}/{r['usable_gb']:.3g}", "[green]yes[/]" if r["fits"] else "[red]no[/]",
                    "yes" if r["supported"] else "[yellow]no[/]", f"{r['decode_tokens_per_s']:,.0f}")
    return [steps, arts, fit]


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s" if seconds >= 1 else f"{seconds:.1f} s"
    return f"{seconds / 60:.0f} min" if seconds < 3600 else f"{seconds / 3600:.1f} h"


def write_plan(path: Path, plan: dict[str, Any]) -> None:
    """Write the plan as JSON atomically (a temporary file next to it, then a rename)."""
    import json
    import os
    import tempfile

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(plan, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        raise CompressError(f"cannot write the plan to {path}: {exc}") from None


def _gguf_type(spec_type: str, records: dict[str, Record]) -> str:
    """The export's block type as the GGUF writer resolves it; an ``auto`` the writer would refuse
    (mixed schemes: the run asks for a type) is planned as f16."""
    from compress.errors import FormatError
    from compress.export.gguf import resolve_type

    try:
        return resolve_type(spec_type, records)  # type: ignore[arg-type]  # only .scheme is read
    except FormatError:
        return "f16"
