"""The TensorRT export format's plugin object, an ExportFormat (torch-free; implementations are imported by its methods)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compress.export.format import ExportFormat, PlannedSize, Runner
from compress.export.tensorrt.config import TensorRTExportConfig


@dataclass(frozen=True)
class TensorRTFormat(ExportFormat):
    """A TensorRT-ready Q/DQ ONNX checked on ONNX Runtime CPU, and an engine built from it where
    TensorRT and a GPU exist (verified and timed on that engine)."""

    def timed_path(self, folder: Path, entry: dict[str, Any]) -> tuple[Path, str] | None:
        if not (entry.get("engine") or {}).get("built"):
            return None  # no engine here (no TensorRT or GPU): its ONNX is timed by nothing, and the report says the engine was skipped
        return folder, "cuda"

    def runner(self, path: Path, threads: int, context: int) -> Runner:
        from compress.export.tensorrt.latency import TensorRTRunner

        return TensorRTRunner(path)

    def static_bytes(self, path: Path) -> tuple[int, int, int]:
        from compress.fsutil import tree_size

        size = tree_size(path)
        return size, 0, size

    def planned_size(self, cfg: Any, shape: Any, records: dict[str, Any], dtype_bits: int) -> PlannedSize:
        from compress.export.tensorrt.plan import planned_size

        return planned_size(cfg, shape, records, dtype_bits)

    def planned_verify_tokens(self, cfg: Any, samples: int, seq_len: int) -> int:
        return cfg.check_tokens


TENSORRT = TensorRTFormat(
    name="tensorrt",
    writer="compress.export.tensorrt.export",
    config=TensorRTExportConfig,
    runtime="tensorrt",
    description="TensorRT-ready ONNX (standard ops, weights as Q/DQ) checked on ONNX Runtime CPU, and an engine built where TensorRT and a GPU exist",
    intended_runtimes="TensorRT (the engine is built for the GPU it was built on; the ONNX rebuilds it elsewhere)",
    runtime_module="tensorrt",
    needs_cuda=True,
)
