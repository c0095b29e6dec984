"""The artifact directory: what a run leaves behind, and how to load its model back.

Layout (written atomically by the pipeline)::

    manifest.json          recipe, hashes, versions, seed, expanded schemes, stage records, file checksums
    report.json            evaluations and gate results (schema in the README)
    recipe.yaml            the recipe file as given
    model/                 a Hugging Face checkpoint that transformers (with compressed-tensors) and vLLM load as it is:
        config.json        the model's config with a compressed-tensors ``quantization_config``
                           (+ generation config and tokenizer files)
        model.safetensors  float tensors by their state-dict names and every quantized Linear packed as
                           compressed-tensors ``pack-quantized`` (export/checkpoint/compressed_tensors.py: the same writer
                           as the compressed-tensors export), at the size its bits imply
    fallback-records.safetensors
        only when some quantized layers have a scheme pack-quantized cannot hold (3, 5, 6 or 7 bits; a
        width that is no whole number of groups and shares no divisor of at least 32 with the group
        size): their records in the internal layout, ``<name>.weight_codes`` (uint8, one per weight),
        ``<name>.weight_scale``, ``<name>.weight_zero_point``. model.safetensors holds those layers'
        dequantized weights as float Linears (so model/ still loads and computes the same model).
        The experts of a fused mixture-of-experts block (compress/experts.py) are always stored here:
        pack-quantized targets Linear layers, and model.safetensors holds the fused ``gate_up_proj`` /
        ``down_proj`` parameters with every expert's dequantized weights.
    fp8/records.safetensors, fp4/records.safetensors
        only after a ``quantize: {method: fp8}`` stage: its FP8 records (float8 weights, float32 scales,
        static input scales; quantizers/fp8.py); after ``{method: fp4}``: its FP4 records (packed E2M1
        codes, group scales, NVFP4's global scale; quantizers/fp4.py). They are no QuantizedWeight
        records. model/ holds those layers' dequantized weights as float Linears; ``load_artifact``
        makes them FP8 / FP4 layers again.

manifest.json ``quantization`` names the layout (``weights_format``: WEIGHTS_FORMAT) and, per
quantized layer, its scheme and where it is stored (``stored_as``). The records read back from
these files are exactly the records written (codes, scales, zero points, schemes): a layer whose
groups were split to fit pack-quantized is merged back into its own scheme from the manifest.
``write_model`` reads them back and compares them before the run goes on, and the run's exports
pack the records read back.

Artifacts written before (``weights_format`` absent, LEGACY_WEIGHTS_FORMAT) hold everything in
model/weights.safetensors in the internal layout; they are still read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.errors import ArtifactError, CompressError
from compress.experts import expert_view
from compress.export.checkpoint.config import COMPRESSED_TENSORS
from compress.hf_model import assemble_model, float_tensors, write_config_and_tokenizer
from compress.inputs import check_json, check_model_directory, check_safetensors
from compress.quantizers.core import QuantizedWeight
from compress.schema.quantize import QuantScheme

MODEL_DIR = "model"
WEIGHTS_FORMAT = "compressed-tensors-v2"
"""manifest.json ``quantization.weights_format`` of artifacts written now: model/ is a pack-quantized checkpoint."""
CHECKPOINT_FILE = "model.safetensors"  # model/'s weights: hf_checkpoint.WEIGHTS_FILE (write_model asserts they agree)
RECORDS_FILE = "fallback-records.safetensors"  # at the artifact's root, so runtimes loading model/ never see it
RECORDS_FORMAT = "compress-records-v1"  # its safetensors metadata: the internal record layout
LEGACY_WEIGHTS_FORMAT = "compress-quantized-v1"
"""The layout before WEIGHTS_FORMAT: model/weights.safetensors with every record unpacked."""
LEGACY_WEIGHTS_FILE = "weights.safetensors"
RECORD_SUFFIXES = (".weight_codes", ".weight_scale", ".weight_zero_point")  # the internal record layout's tensors


class StoredAs:
    """manifest.json ``quantization.layers.<name>.stored_as``."""

    PACKED = COMPRESSED_TENSORS  # in model/model.safetensors, pack-quantized
    RECORDS = "records"  # in RECORDS_FILE, the internal layout


def stored_as(record: QuantizedWeight, fused_expert: bool = False) -> str:
    """Where write_model stores ``record``: packed in model/, or in the fallback records file (a scheme
    pack-quantized cannot hold, or a slice of a fused-experts parameter)."""
    from compress.export.checkpoint.compressed_tensors import stored_scheme

    return StoredAs.RECORDS if fused_expert or stored_scheme(record.scheme, record.shape) is None else StoredAs.PACKED


class _SplitRecords(Mapping):
    """``quantized`` as the compressed-tensors writer stores it (each record split into the groups
    pack-quantized holds), made one record at a time as the writer asks (records may wait on disk)."""

    def __init__(self, quantized: Mapping[str, QuantizedWeight], names: list[str]) -> None:
        self.quantized, self.names, self._set = quantized, names, set(names)

    def __contains__(self, name: object) -> bool:
        return name in self._set

    def __getitem__(self, name: str) -> QuantizedWeight:
        from compress.export.checkpoint import compressed_tensors

        if name not in self._set:
            raise KeyError(name)
        record = self.quantized[name].cpu()
        scheme = compressed_tensors.stored_scheme(record.scheme, record.shape)
        assert scheme is not None
        return compressed_tensors.split_groups(record, scheme)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def write_model(root: Path, model: nn.Module, tokenizer: Any, quantized: Mapping[str, QuantizedWeight]) -> None:
    """Write ``root/model/`` (config, tokenizer, weights: quantized layers packed by the
    compressed-tensors writer) and, when some layers cannot be packed, ``root/RECORDS_FILE``; then
    read every layer back, one at a time, and prove it identical to ``quantized`` (the exports pack
    ``quantized``, which is therefore what model/ holds). Records are handled one at a time: only
    the packed layers and the float tensors are in memory together, while the file is written."""
    from safetensors.torch import save_file

    from compress.export.checkpoint import compressed_tensors
    from compress.export.checkpoint.hf_checkpoint import WEIGHTS_FILE, save_sharded

    assert WEIGHTS_FILE == CHECKPOINT_FILE, "model/'s weights file is the one the checkpoint writer writes"

    packed: list[str] = []
    fallback: list[str] = []
    schemes: dict[str, QuantScheme] = {}
    for name, record in quantized.items():
        schemes[name] = record.scheme
        scheme = compressed_tensors.stored_scheme(record.scheme, record.shape)
        (fallback if scheme is None or expert_view(model, name) is not None else packed).append(name)
    directory = root / MODEL_DIR
    if packed:
        compressed_tensors.write(directory, model, tokenizer, _SplitRecords(quantized, packed))
    else:  # nothing to pack: a float checkpoint (fallback layers dequantized, as in the model)
        write_config_and_tokenizer(directory, model, tokenizer)
        save_sharded(directory, float_tensors(model, {}))
    if fallback:
        tensors = {k: v for name in fallback for k, v in quantized[name].cpu().tensors(name).items()}
        save_file(tensors, str(root / RECORDS_FILE), metadata={"format": RECORDS_FORMAT})
    problems = _verify_written(root, quantized, schemes, packed)
    if problems:  # a packing bug: the artifact is abandoned rather than written with other weights
        raise ArtifactError(f"{root / MODEL_DIR}: reading the weights back does not give the records written: {'; '.join(problems[:5])}")


def _verify_written(root: Path, quantized: Mapping[str, QuantizedWeight], schemes: dict[str, QuantScheme], packed: list[str]) -> list[str]:
    """Read each written layer back on its own (packed ones from model/, the rest from RECORDS_FILE)
    and compare it with its record: the differences, empty when every layer is identical."""
    from compress.export.checkpoint import compressed_tensors
    from compress.export.checkpoint.hf_checkpoint import records_identical, weight_files
    from compress.streaming import read_tensors, safetensors_header

    model_dir = root / MODEL_DIR
    where = f"{root}: {MODEL_DIR}/{CHECKPOINT_FILE}"
    problems: list[str] = []
    if packed:
        qcfg = check_json(model_dir / "config.json").get("quantization_config") or {}
        # Plain reads, a layer at a time: a memory-mapped file's pages would stay resident while it
        # is open, so reading every layer through one map grew with the model (1 GB for Qwen2.5-1.5B).
        where_is = {k: path for path in weight_files(model_dir) for k in safetensors_header(path)[0] if k != "__metadata__"}
        stored = {k.rsplit(".", 1)[0] for k in where_is if k.endswith(".weight_packed")}
        if stored != set(packed):
            return [f"packed layers differ: missing {sorted(set(packed) - stored)[:3]}, unexpected {sorted(stored - set(packed))[:3]}"]
        for name in packed:
            keys = [k for k in where_is if k.startswith(name + ".") and "." not in k[len(name) + 1 :]]
            layer: dict[str, torch.Tensor] = {}
            for path in {where_is[k] for k in keys}:
                layer.update(read_tensors(path, [k for k in keys if where_is[k] == path]))
            found = compressed_tensors.read(qcfg, layer, where).records[name]
            back = compressed_tensors.merge_groups(found, schemes[name], f"{where}: layer {name}")
            problems += records_identical({name: quantized[name]}, {name: back})
    rest = [name for name in schemes if name not in set(packed)]
    if rest:
        from safetensors.torch import load_file

        fallback = load_file(str(root / RECORDS_FILE))
        problems += records_identical(
            {n: quantized[n] for n in rest}, {n: QuantizedWeight.from_tensors(fallback, n, schemes[n]) for n in rest}
        )
    return problems


def load_artifact(directory: str | Path, dtype: torch.dtype | None = None) -> tuple[nn.Module, Any, dict[str, QuantizedWeight]]:
    """Rebuild the compressed model of an artifact directory (quantized layers dequantized) and
    return it with the tokenizer and the records read back from the files."""
    from transformers import AutoConfig, AutoTokenizer

    directory = Path(directory)
    model_dir = directory / MODEL_DIR
    if not (directory / "manifest.json").is_file() or not (model_dir / "config.json").is_file():
        raise ArtifactError(f"{directory} is not a compress artifact (needs manifest.json and {MODEL_DIR}/config.json)")
    dtype_name, schemes, fmt = _manifest_facts(directory)
    reader = READERS.get(fmt)
    if reader is None:
        raise ArtifactError(
            f"{directory}: its weights are stored as '{fmt}', which this release of compress does not read "
            f"(it reads {', '.join(READERS)}); re-create the artifact: compress run <recipe> -o {directory} --overwrite"
        )
    check_model_directory(model_dir)
    try:
        floats, records = reader(directory, schemes)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ArtifactError(
            f"{directory}: its manifest and weights do not fit together ({type(exc).__name__}: {str(exc)[:200]}); run the recipe again"
        ) from None
    except CompressError as exc:
        raise ArtifactError(f"{exc}; run the recipe again") from None
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if hasattr(config, "quantization_config"):  # records are dequantized here: a float model for transformers
        del config.quantization_config
    model = assemble_model(config, floats, records, dtype or getattr(torch, dtype_name), f"{directory}: {MODEL_DIR}/")
    _load_float_grid_layers(directory, model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return model, tokenizer, records


def _load_float_grid_layers(directory: Path, model: nn.Module) -> None:
    """FP8 and FP4 layers (quantizers/fp8.py, fp4.py) from the artifact's records files: model/ holds them as
    float Linears, the records file their codes and scales, the manifest the stage's config (format, inputs)."""
    from safetensors.torch import load_file

    from compress.quantizers import fp4, fp8

    for kind, records_file, load_layers in (("FP8", fp8.RECORDS_FILE, fp8.load_fp8_layers), ("FP4", fp4.RECORDS_FILE, fp4.load_fp4_layers)):
        path = directory / records_file
        if not path.is_file():
            continue
        check_safetensors(path)
        try:
            load_layers(model, load_file(str(path)), check_json(directory / "manifest.json").get("stages") or [])
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ArtifactError(
                f"{path}: its {kind} records do not fit the model and manifest ({type(exc).__name__}: {str(exc)[:200]}); "
                "run the recipe again"
            ) from None


def _manifest_facts(directory: Path) -> tuple[str, dict[str, QuantScheme], str]:
    """(model dtype, scheme of every quantized layer, weights format) from manifest.json."""
    manifest = check_json(directory / "manifest.json")
    try:
        quantization = manifest["quantization"]
        schemes = {name: QuantScheme(**info["scheme"]) for name, info in quantization["layers"].items()}
        return str(manifest["model"]["dtype"]), schemes, str(quantization.get("weights_format") or LEGACY_WEIGHTS_FORMAT)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ArtifactError(
            f"{directory / 'manifest.json'}: no readable quantization section ({type(exc).__name__}: {str(exc)[:200]}); run the recipe again"
        ) from None


Tensors = dict[str, torch.Tensor]


def _read_packed(directory: Path, schemes: dict[str, QuantScheme]) -> tuple[Tensors, dict[str, QuantizedWeight]]:
    """WEIGHTS_FORMAT: packed layers from model/ (merged back into their schemes), the others from RECORDS_FILE."""
    from safetensors.torch import load_file

    from compress.export.checkpoint import compressed_tensors
    from compress.export.checkpoint.hf_checkpoint import weight_files

    model_dir = directory / MODEL_DIR
    where = f"{directory}: {MODEL_DIR}/{CHECKPOINT_FILE}"
    tensors: Tensors = {}
    for path in weight_files(model_dir):
        tensors.update(load_file(str(path)))
    qcfg = check_json(model_dir / "config.json").get("quantization_config")
    records: dict[str, QuantizedWeight] = {}
    consumed: set[str] = set()
    if qcfg is not None:
        found = compressed_tensors.read(qcfg, tensors, where)
        consumed = found.consumed
        unlisted = sorted(set(found.records) - set(schemes))
        if unlisted:
            raise ArtifactError(f"{where}: packs layers the manifest does not list as quantized: {unlisted[:3]}")
        for name, stored in found.records.items():
            records[name] = compressed_tensors.merge_groups(stored, schemes[name], f"{where}: layer {name}")
    rest = [name for name in schemes if name not in records]
    if rest:
        path = directory / RECORDS_FILE
        if not path.is_file():
            raise ArtifactError(f"{directory}: quantized layers {rest[:3]} are neither packed in {MODEL_DIR}/ nor in {RECORDS_FILE}")
        check_safetensors(path)
        fallback = load_file(str(path))
        records.update({name: QuantizedWeight.from_tensors(fallback, name, schemes[name]) for name in rest})
    return {k: v for k, v in tensors.items() if k not in consumed}, records


def _read_legacy(directory: Path, schemes: dict[str, QuantScheme]) -> tuple[Tensors, dict[str, QuantizedWeight]]:
    """LEGACY_WEIGHTS_FORMAT: every record unpacked in model/weights.safetensors beside the float tensors."""
    from safetensors.torch import load_file

    path = directory / MODEL_DIR / LEGACY_WEIGHTS_FILE
    if not path.is_file():
        raise ArtifactError(f"{directory}: its manifest names no weights format and there is no {MODEL_DIR}/{LEGACY_WEIGHTS_FILE}")
    tensors = load_file(str(path))
    records = {name: QuantizedWeight.from_tensors(tensors, name, scheme) for name, scheme in schemes.items()}
    return {k: v for k, v in tensors.items() if not k.endswith(RECORD_SUFFIXES)}, records


READERS: dict[str, Callable[[Path, dict[str, QuantScheme]], tuple[Tensors, dict[str, QuantizedWeight]]]] = {
    WEIGHTS_FORMAT: _read_packed,
    LEGACY_WEIGHTS_FORMAT: _read_legacy,
}
"""How each weights format is read back into (float tensors, records)."""
