"""Load the recipe's model: a Hugging Face directory, a cached Hugging Face id, a GGUF file,
or a reference asset. Never downloads: hub ids resolve from the local cache only.

A file of an export format that can be a model source (a GGUF file: its ExportFormat's ``load_source``,
export/gguf/source.py) is loaded by that format; quantized checkpoints by our importers
(export/checkpoint/readers.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compress import assets
from compress.errors import AssetError, ModelLoadError
from compress.fsutil import sha256_files
from compress.inputs import check_model_directory
from compress.paths import HUB_ID
from compress.plugins import source_format
from compress.progress import Reporter
from compress.schema.recipe import ModelConfig

# No network for model files, ever: set before transformers / huggingface_hub are imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


@dataclass
class LoadedModel:
    model: Any  # transformers PreTrainedModel
    tokenizer: Any
    facts: dict[str, Any] = field(default_factory=dict)
    """For the manifest: source, kind, resolved path, sha256 of the weights, files."""
    quantized: dict[str, Any] = field(default_factory=dict)
    """QuantizedWeight records by layer name when the source was a quantized checkpoint
    (compressed-tensors, GPTQ, AWQ); the model holds their dequantized weights."""

    @property
    def source_path(self) -> Path | None:
        """The source's own file or folder on disk (a GGUF file, a Hugging Face directory), if known."""
        path = self.facts.get("path")
        return Path(path) if path else None


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_model(model_cfg: ModelConfig, base_dir: Path, reporter: Reporter | None = None) -> LoadedModel:
    reporter = reporter or Reporter()
    _quiet_transformers()
    source = model_cfg.source
    asset = assets.ensure_reference(source, "model", reporter)
    if asset is not None:
        if asset.hf_directory:
            loaded = from_hf_dir(asset.path, model_cfg, reporter, kind="huggingface-directory", source=source)
            changed = asset.changed(loaded.facts["files"])  # the digests the loader measured anyway
            if changed:
                raise AssetError(
                    f"{source}: {changed[0]} in {asset.path} changed since it was fetched (its SHA-256 is not the one in "
                    f"asset.json); run `compress assets fetch --force {asset.name}`"
                )
        else:
            file, fmt = next((f, fmt) for f in asset.files if (fmt := source_format(f)) is not None)
            loaded = fmt.load_source(file, model_cfg, reporter, from_hf_dir)
        loaded.facts.update(source=source, reference_asset=asset.meta["origin"], license=asset.meta["license"])
        return loaded
    path = Path(source).expanduser()
    if not path.is_absolute():
        path = base_dir / path
    if path.is_file() and (fmt := source_format(path)) is not None:
        return fmt.load_source(path, model_cfg, reporter, from_hf_dir)
    if path.is_file():
        raise ModelLoadError(f"model.source {source}: a file must be a .gguf; for Hugging Face models give the directory")
    if path.is_dir():
        return from_hf_dir(path, model_cfg, reporter, kind="huggingface-directory", source=source)
    if HUB_ID.fullmatch(source):
        return _from_hub_cache(source, model_cfg, reporter)
    raise ModelLoadError(
        f"model.source '{source}' is not a directory, a .gguf file, a reference:<name>, or a Hugging Face id (looked for {path})"
    )


def _from_hub_cache(repo_id: str, model_cfg: ModelConfig, reporter: Reporter) -> LoadedModel:
    from huggingface_hub import constants, snapshot_download

    cache_dir = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE  # read now, not at import
    try:
        local = Path(snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True))
    except Exception as exc:  # huggingface_hub raises several types for "not cached"
        raise ModelLoadError(
            f"'{repo_id}' is not in the local Hugging Face cache ({cache_dir}). compress never downloads "
            "models at run time: put the model in that cache on a connected machine, or give its directory."
        ) from exc
    return from_hf_dir(local, model_cfg, reporter, kind="huggingface-cache", source=repo_id)


def from_hf_dir(path: Path, model_cfg: ModelConfig, reporter: Reporter, kind: str, source: str) -> LoadedModel:
    from transformers import AutoConfig, AutoTokenizer

    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json; is it a Hugging Face model directory?")
    check_model_directory(path)  # damaged JSON or safetensors files: one line naming the file
    weights = sorted(path.glob("*.safetensors"))
    pickles = sorted(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if not weights and not pickles:
        raise ModelLoadError(f"{path} has no weight files (*.safetensors)")
    if not weights and not model_cfg.allow_pickle:
        raise ModelLoadError(
            f"{path} holds only pickle checkpoints ({pickles[0].name}); loading pickle can run arbitrary code. "
            "Convert it to safetensors, or set model.allow_pickle: true if you trust its origin."
        )
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code, local_files_only=True)
    except Exception as exc:  # transformers raises many types for a config it cannot use
        raise ModelLoadError(f"{path / 'config.json'}: transformers cannot use it ({type(exc).__name__}: {str(exc)[:300]})") from None
    if getattr(config, "auto_map", None) and not model_cfg.trust_remote_code:
        raise ModelLoadError(
            f"{path} ships its own Python code (auto_map in config.json). It is not run unless the recipe sets "
            "model.trust_remote_code: true."
        )
    from compress.export.checkpoint.readers import detect_format

    checkpoint_format = detect_format(path)
    if checkpoint_format is not None:
        return _from_quantized_dir(path, model_cfg, reporter, kind, source, checkpoint_format.name)
    with reporter.status(f"opening model {source} (weights stay on disk; one block at a time is read)"):
        try:
            model, how = open_streamed(path, config, model_cfg, weights)
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code, local_files_only=True)
        except ModelLoadError:
            raise
        except Exception as exc:  # OSError, ValueError, KeyError, safetensors' and tokenizers' own errors …
            raise ModelLoadError(f"transformers could not load {path}: {type(exc).__name__}: {str(exc)[:300]}") from None
    model.eval().requires_grad_(False)
    digest, files = sha256_files([*(weights or pickles), path / "config.json"], path)
    facts = {
        "source": source,
        "kind": kind,
        "path": str(path),
        "sha256": digest,
        "files": files,
        "dtype": str(model.dtype).removeprefix("torch."),
        "streamed": how,
    }
    return LoadedModel(model, tokenizer, facts)


def stored_dtype(weights: list[Path]) -> str:
    """The dtype the checkpoint's floating-point tensors are stored in (the first one found)."""
    from compress.streaming import safetensors_header

    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    for file in weights:
        for key, entry in safetensors_header(file)[0].items():
            if key != "__metadata__" and entry["dtype"] in names:
                return names[entry["dtype"]]
    return "float32"


def blocks_name(model: Any) -> str:
    """The name of the model's list of decoder blocks (``model.layers``): the module list of num_hidden_layers entries."""
    from torch import nn

    n_blocks = getattr(model.config, "num_hidden_layers", None)
    blocks = next((name for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n_blocks and len(m) > 0), None)
    if blocks is None:
        raise ModelLoadError(f"cannot find the {n_blocks} decoder blocks of this {type(model).__name__} to stream them")
    return blocks


def stream_units(model: Any) -> list[str]:
    """The modules that are read from disk one at a time: every decoder block, and every module
    outside the blocks that holds weights of its own (token embedding, final norm, output head)."""
    n_blocks = getattr(model.config, "num_hidden_layers", None)
    blocks = blocks_name(model)
    inside = blocks + "."
    found = [f"{blocks}.{i}" for i in range(n_blocks)]
    for name, m in model.named_modules():
        if name.startswith(inside) or name == blocks:
            continue
        if any(p is not None for p in m._parameters.values()):
            found.append(name)
    return found


def open_streamed(path: Path, config: Any, model_cfg: ModelConfig, weights: list[Path]) -> tuple[Any, str]:
    """The model built on the meta device (no weights in memory) and streamed from its safetensors
    files, in ``model_cfg.dtype`` (``auto``: the dtype the checkpoint stores). A checkpoint whose tensor
    names are not the model's (one transformers converts while loading) is loaded whole once and
    written to the run's overlay, and streamed from there. Returns the model and how it was opened."""
    import torch

    from compress import integrity, streaming

    dtype = getattr(torch, stored_dtype(weights) if model_cfg.dtype == "auto" else model_cfg.dtype)
    if not weights:  # pickle checkpoints (allow_pickle): no memory map; loaded whole, then streamed from the overlay
        return _spilled(path, config, model_cfg, dtype, weights), "loaded whole (pickle checkpoint), streamed from the work directory"
    config_path = path / "config.json"
    stored = integrity.stored_entries({file: streaming.safetensors_header(file)[0] for file in weights})
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int):
        integrity.check_block_count(layers, stored, config_path)  # before building: 10⁹ blocks are refused at once
    model = skeleton(config, dtype, model_cfg.trust_remote_code, config_path)
    if isinstance(layers, int):
        integrity.check_block_count(layers, stored, config_path, blocks_name(model))
    source = {key: (entry.file, key) for key, entry in stored.items()}
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    needed: dict[str, tuple[tuple[int, ...], bool]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        first = first_name.setdefault(id(t), name)
        if first != name and first in source and name not in source:  # a tied copy (lm_head.weight is the embedding)
            aliases[name] = first
        else:
            needed[name] = (tuple(t.shape), t.is_floating_point())
    absent = integrity.missing(needed, source)
    if absent and set(source) <= set(needed) | set(aliases):  # nothing stored under other names: truly missing
        integrity.refuse_missing(absent, _weights_where(weights), config_path)
    if absent:
        return _spilled(path, config, model_cfg, dtype, weights), (
            f"loaded whole once (the checkpoint names its tensors differently, e.g. {absent[0]}), streamed from the work directory"
        )
    integrity.check_stored(needed, stored, config.to_dict(), config_path)
    stamps = {file: (file.stat().st_size, file.stat().st_mtime_ns) for file in weights}
    streaming.attach(model, streaming.TensorStore(source, aliases, stamps=stamps), stream_units(model), torch.device("cpu"))
    return model, "streamed from the checkpoint"


def skeleton(config: Any, dtype: Any, trust_remote_code: bool, config_path: Path) -> Any:
    """The model ``config`` describes, built on the meta device (shapes and dtypes, no memory), ties made, frozen."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    try:
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers and the model's own code raise many types for sizes that do not fit
        raise ModelLoadError(f"{config_path}: no model can be built from it ({type(exc).__name__}: {str(exc)[:300]})") from None
    model.tie_weights()  # built on meta the ties are not made (accelerate's init_empty_weights); made here
    return model.eval().requires_grad_(False)


def _weights_where(weights: list[Path]) -> str:
    """The weight files, for messages: the file, or how many files in which folder."""
    return str(weights[0]) if len(weights) == 1 else f"the {len(weights)} weight files in {weights[0].parent}"


def _spilled(path: Path, config: Any, model_cfg: ModelConfig, dtype: Any, weights: list[Path]) -> Any:
    """Load through transformers (which renames and converts tensors as the model needs), then write
    every unit to an overlay and stream from it."""
    import torch

    from compress import integrity, streaming

    model = integrity.from_pretrained_checked(
        path, dtype=dtype, trust_remote_code=model_cfg.trust_remote_code, use_safetensors=bool(weights), local_files_only=True
    )
    model.eval().requires_grad_(False)
    store = streaming.TensorStore({})
    streaming.attach(model, store, stream_units(model), torch.device("cpu"))
    for _, unit in streaming.units(model):
        streaming.save(unit)
    for _, unit in streaming.units(model):  # after every save: a tied weight belongs to two units
        streaming.drop(unit)
    return model


def _from_quantized_dir(path: Path, model_cfg: ModelConfig, reporter: Reporter, kind: str, source: str, fmt: str) -> LoadedModel:
    """A quantized checkpoint through our importer: records plus their dequantized float model
    (never re-quantized, never through transformers' quantizer backends)."""
    import torch
    from transformers import AutoTokenizer

    from compress.export.checkpoint.readers import import_checkpoint

    dtype = "float32" if model_cfg.dtype == "auto" else model_cfg.dtype  # the records' dequantized values, exactly
    with reporter.status(f"importing {fmt} checkpoint {source} (dequantizing its records, {dtype})"):
        imported = import_checkpoint(path, getattr(torch, dtype), model_cfg.trust_remote_code)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"transformers could not load the tokenizer of {path}: {exc}") from exc
    meta = [p for p in (path / "config.json", path / "quantize_config.json") if p.is_file()]
    digest, files = sha256_files([*sorted(path.glob("*.safetensors")), *meta], path)
    facts = {"source": source, "kind": kind, "path": str(path), "sha256": digest, "files": files, "quantized_checkpoint": imported.facts}
    return LoadedModel(imported.model, tokenizer, facts, quantized=imported.records)
