"""The model's shape and the expected sizes of a recipe's artifacts, for `compress plan`
(eval/plan/planner.py): from the model's config only (config.json, or GGUF metadata), with the model built
on torch's ``meta`` device (shapes, no weights). Sizes are estimates: exact block sizes for the
formats we pack, llama.cpp's published averages for its K-quant mixes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compress.distill.draft_config import DraftConfig
from compress.errors import CompressError, ModelLoadError
from compress.eval.plan.shapes import DTYPE_BYTES, ModelShape, Record, packed_bytes, shape_of
from compress.export.format import HF_FORMAT, TORCH_RUNTIME
from compress.export.gguf.config import GGUFExportConfig
from compress.export.gguf.plugin import GGUF
from compress.inputs import check_blocks_on_disk, check_json
from compress.integrity import check_config_values
from compress.plugins import EXPORT_FORMATS, stage_kind
from compress.pruning.plugin import pruned_shape
from compress.schema.metrics import DRAFT_ARTIFACT
from compress.schema.recipe import ModelConfig, Recipe

# --------------------------------------------------------------------------- the model's shape


def compute_dtype(model_cfg: ModelConfig, config: Any) -> str:
    """The recipe's ``model.dtype`` with ``auto`` resolved as the loader resolves it: the dtype the
    model's config records (bfloat16 for most Hugging Face models; float32 for a GGUF source, which
    is converted to float32), float32 when it records none."""
    if model_cfg.dtype != "auto":
        return model_cfg.dtype
    stored = str(getattr(config, "dtype", None) or "").removeprefix("torch.")
    return stored if stored in DTYPE_BYTES else "float32"


def model_shape(model_cfg: ModelConfig, base_dir: Path) -> ModelShape:
    config, origin = source_config(model_cfg, base_dir)
    return shape_of(config, model_cfg.trust_remote_code, origin)


def source_config(model_cfg: ModelConfig, base_dir: Path) -> tuple[Any, str]:
    """The model's transformers config, read without loading (or downloading) any weights."""
    from transformers import AutoConfig

    from compress import assets
    from compress.paths import HUB_ID
    from compress.plugins import source_format

    source = model_cfg.source
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
        if asset.hf_directory:
            return AutoConfig.from_pretrained(asset.path, local_files_only=True), f"{asset.path / 'config.json'} ({source})"
        file, fmt = next((f, fmt) for f in asset.files if (fmt := source_format(f)) is not None)
        return fmt.source_config(file, asset.meta["files"][file.name], source)
    path = Path(source).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if path.is_file() and (fmt := source_format(path)) is not None:
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
    check_config_values(check_json(path / "config.json"), path / "config.json")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code, local_files_only=True)
    except Exception as exc:  # transformers raises many types for a config it cannot use
        raise ModelLoadError(f"transformers could not read {path / 'config.json'}: {type(exc).__name__}: {str(exc)[:300]}") from None
    check_blocks_on_disk(path, getattr(config, "num_hidden_layers", None))
    return config, f"{path / 'config.json'}"


# --------------------------------------------------------------------------- sizes


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
    records: dict[str, Record] = {}
    for stage in recipe.stages:
        if stage_kind(stage.kind).quantizes_weights:
            scheme = _budget_scheme(recipe) if getattr(stage.config, "gguf_target", False) else stage.config.scheme()
            records.update(stage_records(shape, stage.config, scheme))
    return records


def stage_records(shape: ModelShape, config: Any, scheme: Any) -> dict[str, Record]:
    """The plan records of the Linear layers a weight-quantization ``config`` selects in ``shape``, on ``scheme``."""
    from compress.quantizers.targets import select_linears

    emb = shape.model.get_input_embeddings().weight
    chosen, _ = select_linears(shape.model, config.targets, config.ignore)
    return {name: Record(m.out_features, m.in_features, scheme, m.weight is emb) for name, m in chosen}


def _budget_scheme(recipe: Recipe) -> Any:
    """For the plan, the layers of a stage with ``gguf_target`` on one type: the candidate whose bits
    per weight are nearest the target's (q4_k for a size in MiB); the run chooses a type per layer."""
    from compress.quantizers.grids import GRIDS
    from compress.schema.quantize import QuantScheme

    target = recipe.gguf_budget().target
    want = target.bits_per_weight or GRIDS["q4_k"].bits_per_weight
    return QuantScheme(gguf_type=min(target.types, key=lambda t: abs(GRIDS[t].bits_per_weight - want)))


def artifacts(recipe: Recipe, source: ModelShape, shape: ModelShape, records: dict[str, Record]) -> list[dict[str, Any]]:
    """The run's artifacts (the baseline of shape ``source``, the others of ``shape``, after the
    stages) with format, runtime, estimated size and the KV-cache bytes per element they use."""
    dtype_name = compute_dtype(recipe.model, source.config)
    dtype_bits = 8 * DTYPE_BYTES[dtype_name]
    rows = []

    def add(
        name: str, fmt: str, runtime: str, size: int, kv_bytes: float, basis: str, kv_budget: int | None = None, params: int | None = None
    ) -> None:
        params = params or (source.params if name == "baseline" else shape.params)
        rows.append(
            {
                "artifact": name,
                "format": fmt,
                "runtime": runtime,
                "size_bytes": size,
                "bits_per_param": round(8 * size / params, 3),
                "kv_bytes_per_element": kv_bytes,
                **({"kv_budget_tokens": kv_budget} if kv_budget else {}),
                "basis": basis,
            }
        )

    add("baseline", HF_FORMAT, TORCH_RUNTIME, source.params * dtype_bits // 8, dtype_bits / 8, f"every parameter at {dtype_name}")
    if not recipe.stages:
        return rows
    packed = packed_bytes(shape, records, dtype_bits)
    scheme_note = ", ".join(sorted({r.scheme.describe() for r in records.values()})) or "no quantized layers"
    add(
        "compressed",
        HF_FORMAT,
        TORCH_RUNTIME,
        packed,
        dtype_bits / 8,
        f"{len(records)} quantized layers ({scheme_note}) packed: bits + scale bits / group (+ zero-point bits when asymmetric); "
        f"the rest at {dtype_name}",
    )
    kv = next((s.config for s in recipe.stages if stage_kind(s.kind).quantizes_kv_cache), None)
    if kv is not None and kv.evaluate is not None:
        budget = kv.evict.budget if kv.evict is not None else None
        note = (
            "; fastgen keeps what each head's profile needs: counted as a full cache" if kv.evict and kv.evict.policy == "fastgen" else ""
        )
        add(
            "kv_cache",
            HF_FORMAT,
            TORCH_RUNTIME,
            packed,
            _kv_element_bytes(kv, shape),
            f"compressed weights; KV cache {kv.describe()}{note}",
            budget,
        )
    for export in recipe.exports:
        fmt = EXPORT_FORMATS[export.format]
        # the (format, runtime) device profiles list for it: a checkpoint is a Hugging Face folder on torch
        add(export.name, *fmt.device_names, *fmt.planned_size(export, shape, records, dtype_bits))
    draft = next((s.config for s in recipe.stages if isinstance(s.config, DraftConfig)), None)
    if draft is not None:  # the draft's own file, sized as its format sizes an export of it
        small = pruned_shape(shape, draft.prune)
        draft_records = {} if draft.quantize is None else stage_records(small, draft.quantize, draft.quantize.scheme())
        if draft.gguf:
            where = GGUF.device_names
            size, kv_bytes, basis = GGUF.planned_size(GGUFExportConfig(name=DRAFT_ARTIFACT), small, draft_records, dtype_bits)
        else:  # draft/model alone, written as model/ is
            where = (HF_FORMAT, TORCH_RUNTIME)
            size, kv_bytes = packed_bytes(small, draft_records, dtype_bits), dtype_bits / 8
            basis = f"draft/model: records packed, the rest at {dtype_name}"
        share = f"the draft's {small.params:,} parameters ({small.params / shape.params:.1%} of the target's): "
        add(DRAFT_ARTIFACT, *where, int(size), kv_bytes, share + basis, params=small.params)
    return rows


def _kv_element_bytes(kv: Any, shape: ModelShape) -> float:
    """Bytes per cached K/V element of a kv_cache scheme: codes + fp16 scale (+ zero) per group."""
    if kv.format == "float":
        return 2.0
    if kv.static_scales:
        return kv.bits / 8
    head_dim = int(getattr(shape.text, "head_dim", None) or shape.text.hidden_size // shape.text.num_attention_heads)
    per_group = 2 if kv.is_symmetric else 4
    groups = [kv.residual if axis == "channel" else (kv.group_size or head_dim) for axis in (kv.key_axis, kv.value_axis)]
    return kv.bits / 8 + sum(per_group / g for g in groups) / 2
