"""A fake export format in one module, for tests/test_plugins.py: the quantized records as one .npz
file (codes, scales, zero points, and each layer's scheme as JSON), verified by reading the file
back and requiring the same records. Registering it takes this module and one table entry.

``NPZ`` is a checkpoint (no runtime of its own: gates on it read the compressed evaluation);
``NPZ_ON_NUMPY`` is the same format declared as running on a runtime of its own, "numpy", so that
device profiles may list its names (format npz, runtime numpy)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field

from compress.export.format import ExportFormat, PlannedSize
from compress.schema.exports import BaseExportConfig

NAME = "npz"
FILE = "records.npz"


class NPZExportConfig(BaseExportConfig):
    """The records as one NumPy .npz file."""

    format: Literal["npz"] = Field("npz", description="npz")
    compressed: bool = Field(False, description="np.savez_compressed rather than np.savez.")


class NPZOnNumpyExportConfig(NPZExportConfig):
    """The same file, loaded by numpy as a runtime of its own (device profiles name it: npz on numpy)."""

    own_runtime: ClassVar[bool] = True


def write_npz(path: Path, records: dict[str, Any], compressed: bool) -> None:
    arrays: dict[str, Any] = {}
    for i, (name, r) in enumerate(sorted(records.items())):
        arrays[f"{i}.codes"] = r.codes.cpu().numpy()
        arrays[f"{i}.scale"] = r.scale.cpu().float().numpy()  # float16 and bfloat16 widen to float32 exactly
        arrays[f"{i}.zero_point"] = r.zero_point.cpu().numpy()
        arrays[f"{i}.meta"] = json.dumps({"name": name, "scheme": r.scheme.model_dump()})
    (np.savez_compressed if compressed else np.savez)(path, **arrays)


def read_npz(path: Path) -> dict[str, Any]:
    import torch

    from compress.quantizers.core import QuantizedWeight
    from compress.schema.quantize import QuantScheme

    records = {}
    with np.load(path) as data:
        for i in range(len(data.files) // 4):
            meta = json.loads(str(data[f"{i}.meta"]))
            scheme = QuantScheme(**meta["scheme"])
            records[meta["name"]] = QuantizedWeight(
                codes=torch.from_numpy(data[f"{i}.codes"]),
                scale=torch.from_numpy(data[f"{i}.scale"]).to(getattr(torch, scheme.scale_dtype)),
                zero_point=torch.from_numpy(data[f"{i}.zero_point"]),
                scheme=scheme,
            )
    return records


@dataclass(frozen=True)
class NPZFormat(ExportFormat):
    def check(self, cfg: Any, model: Any, records: dict[str, Any], has_eval: bool) -> None:
        from compress.errors import FormatError

        if not records:
            raise FormatError("an npz export holds quantized layers, and no layer is quantized")

    def write(
        self,
        directory: Path,
        cfg: Any,
        model: Any,
        tokenizer: Any,
        records: dict[str, Any],
        inputs: Any,
        reporter: Any,
        label: str,
        kv: Any,
    ) -> tuple[dict[str, Any], list[Any]]:
        from compress.errors import FormatError
        from compress.export.checkpoint.hf_checkpoint import records_identical

        directory.mkdir(parents=True, exist_ok=True)
        write_npz(directory / FILE, records, cfg.compressed)
        problems = records_identical(records, read_npz(directory / FILE))
        if problems:
            raise FormatError(f"{label}: the npz file does not give the records back: {problems[:3]}")
        entry = {"name": cfg.name, "format": cfg.format, "path": None, "layers": len(records), "verified": True, "check": "npz reloaded"}
        return entry, []

    def describe_entry(self, entry: dict[str, Any]) -> str:
        return f"npz file of {entry['layers']} layers' records"

    def planned_size(self, cfg: Any, shape: Any, records: dict[str, Any], dtype_bits: int) -> PlannedSize:
        from compress.eval.plan.shapes import packed_bytes

        return packed_bytes(shape, records, dtype_bits), 2.0, "codes + float32 scales per group"


DESCRIPTION = "test format: the records as one NumPy .npz file, read back exactly"
NPZ = NPZFormat(name=NAME, config=NPZExportConfig, runtime="numpy", intended_runtimes="numpy.load (a test format)", description=DESCRIPTION)
NPZ_ON_NUMPY = NPZFormat(
    name=NAME, config=NPZOnNumpyExportConfig, runtime="numpy", intended_runtimes="numpy.load (a test format)", description=DESCRIPTION
)
