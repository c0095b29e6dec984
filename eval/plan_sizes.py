"""The model's shape and the expected sizes of a recipe's artifacts, for `compress plan`
(eval/plan.py): from the model's config only (config.json, or GGUF metadata), with the model built
on torch's ``meta`` device (shapes, no weights). Sizes are estimates: exact block sizes for the
formats we pack, llama.cpp's published averages for its K-quant mixes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compress.errors import CompressError, ModelLoadError
from compress.export.format import HF_FORMAT, TORCH_RUNTIME
from compress.inputs import check_json
from compress.plugins import EXPORT_FORMATS, stage_kind
from compress.recipe import ModelSpec, Recipe

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# llama.cpp's bits per weight: exact block sizes, and its published averages for the K-quant mixes.
GGUF_BITS = {
    "f32": 32,
    "f16": 16,
    "bf16": 16,
    "q8_0": 8.5,
    "q4_0": 4.5,
    "q4_1": 5.0,
    "q5_0": 5.5,
    "q5_1": 6.0,
    "q2_k": 3.35,
    "q3_k_s": 3.5,
    "q3_k_m": 3.91,
    "q3_k_l": 4.27,
    "q4_k_s": 4.58,
    "q4_k_m": 4.89,
    "q5_k_s": 5.54,
    "q5_k_m": 5.69,
    "q6_k": 6.56,
    "iq4_nl": 4.5,
    "iq4_xs": 4.25,
}
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

    def rebuilt(self, config: Any, origin: str) -> ModelShape:
        """The shape of ``config`` (a changed copy of this one's, e.g. by a stage's ``plan_shape``)."""
        return shape_of(config, False, origin)

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
    from compress.paths import HUB_ID

    source = spec.source
    name = assets.parse_reference(source)
    if name is not None:
        if name not in assets.ASSETS or assets.ASSETS[name].kind != "model":
            known = ", ".join(f"reference:{n}" for n, a in assets.ASSETS.items() if a.kind == "model")
            raise ModelLoadError(f"'{source}' is not a reference model; known: {known}")
        asset = assets.locate(name)
        if asset is None:
            raise ModelLoadError(
                f"model.source {source} is not in the cache; `compress plan` downloads nothing. Run `compress assets fetch {name}` first."
            )
        file, fmt = next((f, fmt) for f in asset.files if (fmt := models.source_format(f)) is not None)
        return fmt.source_config(file, asset.meta["files"][file.name], source)
    path = Path(source).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if path.is_file() and (fmt := models.source_format(path)) is not None:
        return fmt.source_config(path, None, source)
    if not path.exists() and HUB_ID.match(source):
        from huggingface_hub import snapshot_download

        try:
            path = Path(snapshot_download(source, local_files_only=True))
        except Exception as exc:  # huggingface_hub raises several types for "not cached"
            raise ModelLoadError(f"'{source}' is not in the local Hugging Face cache; compress never downloads models") from exc
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"model.source {source}: no config.json at {path} (give a Hugging Face directory, a .gguf file, "
            "a cached Hugging Face id or reference:<name>)"
        )
    check_json(path / "config.json")
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=spec.trust_remote_code, local_files_only=True), f"{path / 'config.json'}"
    except Exception as exc:  # transformers raises many types for a config it cannot use
        raise ModelLoadError(f"transformers could not read {path / 'config.json'}: {type(exc).__name__}: {str(exc)[:300]}") from None


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


# --------------------------------------------------------------------------- sizes


@dataclass
class Record:
    """A quantized Linear as the plan sees it: shape, scheme, and whether its weight is the tied embedding."""

    out_f: int
    in_f: int
    scheme: Any  # QuantScheme
    tied: bool


def final_shape(recipe: Recipe, shape: ModelShape) -> ModelShape:
    """The shape the recipe's stages leave (each kind's ``plan_shape``: prune changes it)."""
    for i, stage in enumerate(recipe.stages):
        kind = stage_kind(stage.kind, f"stages[{i}]")
        if kind.plan_shape is not None:
            shape = kind.plan_shape(shape, stage.config)
    return shape


def check_group_sizes(recipe: Recipe, shape: ModelShape) -> None:
    """Refuse a quantize stage whose group_size exceeds the widest input of the layers it
    quantizes (``shape``: the model as that stage sees it), before any weight is loaded."""
    from compress.quantizers.targets import select_linears

    for i, stage in enumerate(recipe.stages):
        group = getattr(stage.config, "group_size", None) if stage_kind(stage.kind).quantizes_weights else None
        if group is None:
            continue
        chosen, _ = select_linears(shape.model, stage.config.targets, stage.config.ignore)
        widest = max((m.in_features for _, m in chosen), default=None)
        if widest is not None and group > widest:
            raise CompressError(
                f"stages[{i}].quantize.group_size: {group} is wider than every layer it quantizes (the widest "
                f"input is {widest}); use a group size up to {widest}, or null for one scale per output row"
            )


def quantized_layers(recipe: Recipe, shape: ModelShape) -> dict[str, Record]:
    from compress.quantizers.targets import select_linears

    emb = shape.model.get_input_embeddings().weight
    records: dict[str, Record] = {}
    for stage in recipe.stages:
        if stage_kind(stage.kind).quantizes_weights:
            chosen, _ = select_linears(shape.model, stage.config.targets, stage.config.ignore)
            for name, m in chosen:
                records[name] = Record(m.out_features, m.in_features, stage.config.scheme(), m.weight is emb)
    return records


def packed_bytes(
    shape: ModelShape,
    records: dict[str, Record],
    float_bits: float,
    code_bits: float | None = None,
    scale_bits: float | None = None,
    zero_bits: float | None = None,
    group: int | None = None,
    zeros_always: bool = False,
    extra_bits_per_input: float = 0,
) -> int:
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
        rows.append(
            {
                "artifact": name,
                "format": fmt,
                "runtime": runtime,
                "size_bytes": size,
                "bits_per_param": round(8 * size / params, 3),
                "kv_bytes_per_element": kv_bytes,
                "basis": basis,
            }
        )

    add("baseline", "hf", "torch", source.params * dtype_bits // 8, dtype_bits / 8, f"every parameter at {recipe.model.dtype}")
    if not recipe.stages:
        return rows
    packed = packed_bytes(shape, records, dtype_bits)
    scheme_note = ", ".join(sorted({r.scheme.describe() for r in records.values()})) or "no quantized layers"
    add(
        "compressed",
        "hf",
        "torch",
        packed,
        dtype_bits / 8,
        f"{len(records)} quantized layers ({scheme_note}) packed: bits + scale bits / group (+ zero-point bits when asymmetric); "
        f"the rest at {recipe.model.dtype}",
    )
    kv = next((s.config for s in recipe.stages if stage_kind(s.kind).quantizes_kv_cache), None)
    if kv is not None and kv.evaluate is not None:
        add("kv_cache", "hf", "torch", packed, _kv_element_bytes(kv, shape), f"compressed weights; KV cache {kv.describe()}")
    for spec in recipe.exports:
        fmt = EXPORT_FORMATS[spec.format]
        # a checkpoint export is a Hugging Face folder timed on torch; the others run on their own runtime
        where = (fmt.name, fmt.runtime) if fmt.own_runtime else (HF_FORMAT, TORCH_RUNTIME)
        add(spec.name, *where, *fmt.planned_size(spec, shape, records, dtype_bits))
    return rows


def only_bits(records: dict[str, Record]) -> int | None:
    bits = {r.scheme.bits for r in records.values()}
    return bits.pop() if len(bits) == 1 else None


def _linear_weights(shape: ModelShape, with_lm_head: bool) -> int:
    """Weights of Linear layers that are not the tied embedding (and not the output head unless asked)."""
    from torch import nn

    emb = shape.model.get_input_embeddings().weight
    return sum(
        m.weight.numel()
        for n, m in shape.model.named_modules()
        if isinstance(m, nn.Linear) and m.weight is not emb and (with_lm_head or not n.endswith("lm_head"))
    )


def uniform_bytes(shape: ModelShape, linear_bits: float, other_bits: float) -> int:
    linear = _linear_weights(shape, with_lm_head=True)
    return int((linear * linear_bits + (shape.params - linear) * other_bits) / 8)


def builder_bytes(shape: ModelShape, bits: int, block: int, symmetric: bool, float_bits: int) -> int:
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
