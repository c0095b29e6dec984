"""A GGUF file as a model source. transformers dequantizes it once, and the result is cached as a
safetensors model directory (``<cache>/models/gguf-<sha256 prefix>``), so later runs load in
seconds. transformers refuses ``save_pretrained`` on a GGUF-loaded model, so its state dict is
copied into a model built from the same config first.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from compress.errors import ModelLoadError
from compress.export.gguf.inputs import check_gguf
from compress.fsutil import atomic_directory, sha256_file
from compress.paths import CONVERTED_MARKER, cache_root
from compress.progress import Reporter
from compress.schema.recipe import ModelSpec


def converted_dir(digest: str) -> Path:
    """Where the float safetensors copy of the GGUF file with this SHA-256 is cached."""
    return cache_root() / "models" / f"gguf-{digest[:16]}"


def source_config(path: Path, digest: str | None, source: str) -> tuple[Any, str]:
    """The model config of a GGUF source for ``compress plan``: the converted copy's config.json when
    it is cached (``digest`` known), else read from the GGUF metadata; ``source`` as the recipe names it."""
    from transformers import AutoConfig

    if digest is not None and (converted_dir(digest) / CONVERTED_MARKER).is_file():
        return AutoConfig.from_pretrained(
            converted_dir(digest), local_files_only=True
        ), f"config.json of the converted {source} ({converted_dir(digest)})"
    try:  # transformers reads the metadata with gguf.GGUFReader (memory-mapped; tensors are not loaded)
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name), f"GGUF metadata of {path}"
    except Exception as exc:  # the GGUF reader raises many types for a damaged file
        raise ModelLoadError(
            f"cannot read the model config from the GGUF metadata of {path}: {type(exc).__name__}: {str(exc)[:300]}"
        ) from None


def load_source(path: Path, spec: ModelSpec, reporter: Reporter, load_dir: Callable[..., Any]) -> Any:
    """A GGUF file as the model source: dequantized by transformers once, cached as float safetensors,
    and that folder loaded by ``load_dir`` (compress.models.from_hf_dir: handed in, since the model
    loader sits above the export formats). Returns its LoadedModel."""
    check_gguf(path)
    digest = sha256_file(path)
    converted = converted_dir(digest)
    if not (converted / CONVERTED_MARKER).is_file():
        with reporter.status(f"dequantizing {path.name} to a float32 safetensors model (once per file)"):
            _convert_gguf(path, converted, digest)
    loaded = load_dir(converted, spec.model_copy(update={"trust_remote_code": False}), reporter, "gguf", str(path))
    model = loaded.model
    if getattr(model.config, "quantization_config", None) is not None:
        # transformers records the GGUF origin as a quantization config and refuses save_pretrained;
        # the weights here are plain dequantized floats.
        del model.config.quantization_config
        model.hf_quantizer = None
    loaded.facts.update(kind="gguf", path=str(path), sha256=digest, files={path.name: digest}, converted_cache=str(converted))
    return loaded


def _convert_gguf(path: Path, target: Path, digest: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers' GGUF reader draws its own tqdm bar; ours (a status line) is shown instead.
    previous = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except Exception as exc:  # transformers' GGUF reader: OSError, ValueError, KeyError, RuntimeError, struct errors …
        raise ModelLoadError(f"transformers could not read {path}: {type(exc).__name__}: {str(exc)[:300]}") from None
    finally:
        if previous is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = previous
    model = AutoModelForCausalLM.from_config(gguf_model.config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    with atomic_directory(target, overwrite=True, owned=False) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / CONVERTED_MARKER).write_text(json.dumps({"gguf": str(path), "sha256": digest}, indent=2))
