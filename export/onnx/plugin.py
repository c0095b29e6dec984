"""The ONNX export format's plugin object, an ExportFormat (torch-free; implementations are imported by its methods)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compress.export.format import ExportFormat, PlannedSize, Runner
from compress.export.onnx.config import ONNXExportConfig
from compress.export.onnx.names import GENAI_CONFIG, ONNX_FILE


@dataclass(frozen=True)
class ONNXFormat(ExportFormat):
    """An ONNX Runtime GenAI folder made by onnxruntime-genai's builder from the records,
    verified and timed in ONNX Runtime."""

    def runtime_build(self) -> dict[str, str]:
        """The packages' versions and ONNX Runtime's own build line (its git commit)."""
        build = super().runtime_build()
        try:
            import onnxruntime

            build["onnxruntime_build"] = onnxruntime.get_build_info()
        except ImportError:
            pass
        return build

    def describe_entry(self, entry: dict[str, Any]) -> str:
        """'onnx int4': the weight precision the builder made."""
        return f"{self.name} {entry['precision']}" if entry.get("precision") else self.name

    def timed_path(self, folder: Path, entry: dict[str, Any]) -> tuple[Path, str] | None:
        return folder, "cpu"

    def runner(self, path: Path, threads: int, context: int) -> Runner:
        from compress.export.onnx.latency import GenAIRunner

        return GenAIRunner(path, threads)

    def static_bytes(self, path: Path) -> tuple[int, int, int]:
        from compress.export.onnx.latency import onnx_bytes
        from compress.fsutil import tree_size

        return (*onnx_bytes(path), tree_size(path))

    def parameter_count(self, path: Path) -> int | None:
        from compress.export.onnx.latency import parameter_count

        return parameter_count(path)

    def forward(self, path: Path, seq_len: int, threads: int) -> Any:
        from compress.export.onnx.runtime import OrtDecoder

        return OrtDecoder(path / ONNX_FILE, threads).forward, None

    def recognizes(self, path: Path) -> bool:
        return path.is_dir() and (path / GENAI_CONFIG).is_file()

    def check_input(self, path: Path) -> Path:
        from compress.export.onnx.inputs import check_genai_folder

        check_genai_folder(path, GENAI_CONFIG)
        return path

    def planned_size(self, cfg: Any, shape: Any, records: dict[str, Any], dtype_bits: int) -> PlannedSize:
        from compress.export.onnx.plan import planned_size

        return planned_size(cfg, shape, records, dtype_bits)


ONNX = ONNXFormat(
    name="onnx",
    writer="compress.export.onnx.export",
    config=ONNXExportConfig,
    runtime="onnxruntime",
    intended_runtimes="ONNX Runtime / ONNX Runtime GenAI",
    description="ONNX Runtime GenAI folder made by its model builder, the records proven equal in MatMulNBits (W8A8: Q/DQ), verified and timed in ONNX Runtime",
    input_kind="ONNX folder (genai_config.json)",
    packages=("onnx", "onnxruntime", "onnxruntime_genai", "onnxscript"),
    runtime_module="onnxruntime",
)
