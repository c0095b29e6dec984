"""Load the recipe's model: a Hugging Face directory, a cached Hugging Face id, a GGUF file,
or a reference asset. Never downloads: hub ids resolve from the local cache only.

A file of an export format that can be a model source (a GGUF file: its spec's ``load_source``,
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
from compress.recipe import ModelSpec

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


def load_model(spec: ModelSpec, base_dir: Path, reporter: Reporter | None = None) -> LoadedModel:
    reporter = reporter or Reporter()
    _quiet_transformers()
    source = spec.source
    asset = assets.ensure_reference(source, "model", reporter)
    if asset is not None:
        if asset.hf_directory:
            loaded = from_hf_dir(asset.path, spec, reporter, kind="huggingface-directory", source=source)
            changed = asset.changed(loaded.facts["files"])  # the digests the loader measured anyway
            if changed:
                raise AssetError(
                    f"{source}: {changed[0]} in {asset.path} changed since it was fetched (its SHA-256 is not the one in "
                    f"asset.json); run `compress assets fetch --force {asset.name}`"
                )
        else:
            file, fmt = next((f, fmt) for f in asset.files if (fmt := source_format(f)) is not None)
            loaded = fmt.load_source(file, spec, reporter, from_hf_dir)
        loaded.facts.update(source=source, reference_asset=asset.meta["origin"], license=asset.meta["license"])
        return loaded
    path = Path(source).expanduser()
    if not path.is_absolute():
        path = base_dir / path
    if path.is_file() and (fmt := source_format(path)) is not None:
        return fmt.load_source(path, spec, reporter, from_hf_dir)
    if path.is_file():
        raise ModelLoadError(f"model.source {source}: a file must be a .gguf; for Hugging Face models give the directory")
    if path.is_dir():
        return from_hf_dir(path, spec, reporter, kind="huggingface-directory", source=source)
    if HUB_ID.match(source):
        return _from_hub_cache(source, spec, reporter)
    raise ModelLoadError(
        f"model.source '{source}' is not a directory, a .gguf file, a reference:<name>, or a Hugging Face id (looked for {path})"
    )


def _from_hub_cache(repo_id: str, spec: ModelSpec, reporter: Reporter) -> LoadedModel:
    from huggingface_hub import constants, snapshot_download

    cache_dir = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE  # read now, not at import
    try:
        local = Path(snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True))
    except Exception as exc:  # huggingface_hub raises several types for "not cached"
        raise ModelLoadError(
            f"'{repo_id}' is not in the local Hugging Face cache ({cache_dir}). compress never downloads "
            "models at run time: put the model in that cache on a connected machine, or give its directory."
        ) from exc
    return from_hf_dir(local, spec, reporter, kind="huggingface-cache", source=repo_id)


def from_hf_dir(path: Path, spec: ModelSpec, reporter: Reporter, kind: str, source: str) -> LoadedModel:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json; is it a Hugging Face model directory?")
    check_model_directory(path)  # damaged JSON or safetensors files: one line naming the file
    weights = sorted(path.glob("*.safetensors"))
    pickles = sorted(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if not weights and not pickles:
        raise ModelLoadError(f"{path} has no weight files (*.safetensors)")
    if not weights and not spec.allow_pickle:
        raise ModelLoadError(
            f"{path} holds only pickle checkpoints ({pickles[0].name}); loading pickle can run arbitrary code. "
            "Convert it to safetensors, or set model.allow_pickle: true if you trust its origin."
        )
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=spec.trust_remote_code, local_files_only=True)
    except Exception as exc:  # transformers raises many types for a config it cannot use
        raise ModelLoadError(f"{path / 'config.json'}: transformers cannot use it ({type(exc).__name__}: {str(exc)[:300]})") from None
    if getattr(config, "auto_map", None) and not spec.trust_remote_code:
        raise ModelLoadError(
            f"{path} ships its own Python code (auto_map in config.json). It is not run unless the recipe sets "
            "model.trust_remote_code: true."
        )
    from compress.export.checkpoint.readers import detect_format

    checkpoint_format = detect_format(path)
    if checkpoint_format is not None:
        return _from_quantized_dir(path, spec, reporter, kind, source, checkpoint_format.name)
    dtype = getattr(torch, spec.dtype)
    with reporter.status(f"loading model {source} ({spec.dtype})"):
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path,
                dtype=dtype,
                trust_remote_code=spec.trust_remote_code,
                use_safetensors=bool(weights),
                local_files_only=True,
            )
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=spec.trust_remote_code, local_files_only=True)
        except Exception as exc:  # OSError, ValueError, KeyError, safetensors' and tokenizers' own errors …
            raise ModelLoadError(f"transformers could not load {path}: {type(exc).__name__}: {str(exc)[:300]}") from None
    model.eval().requires_grad_(False)
    digest, files = sha256_files([*(weights or pickles), path / "config.json"], path)
    return LoadedModel(model, tokenizer, {"source": source, "kind": kind, "path": str(path), "sha256": digest, "files": files})


def _from_quantized_dir(path: Path, spec: ModelSpec, reporter: Reporter, kind: str, source: str, fmt: str) -> LoadedModel:
    """A quantized checkpoint through our importer: records plus their dequantized float model
    (never re-quantized, never through transformers' quantizer backends)."""
    import torch
    from transformers import AutoTokenizer

    from compress.export.checkpoint.readers import import_checkpoint

    with reporter.status(f"importing {fmt} checkpoint {source} (dequantizing its records, {spec.dtype})"):
        imported = import_checkpoint(path, getattr(torch, spec.dtype), spec.trust_remote_code)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=spec.trust_remote_code, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"transformers could not load the tokenizer of {path}: {exc}") from exc
    meta = [p for p in (path / "config.json", path / "quantize_config.json") if p.is_file()]
    digest, files = sha256_files([*sorted(path.glob("*.safetensors")), *meta], path)
    facts = {"source": source, "kind": kind, "path": str(path), "sha256": digest, "files": files, "quantized_checkpoint": imported.facts}
    return LoadedModel(imported.model, tokenizer, facts, quantized=imported.records)
