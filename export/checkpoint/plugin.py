"""The checkpoint export formats' plugin objects (ExportFormat): compressed-tensors and AutoGPTQ Hugging Face directories
(torch-free; implementations are imported by the methods).

A checkpoint export holds exactly the records of the in-memory compressed model (its reader
proves it when it is written), so it has no runtime of its own to verify or time: gates on it
read the ``compressed`` evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compress.export.checkpoint.config import CompressedTensorsExportConfig, GPTQExportConfig
from compress.export.format import ExportFormat, PlannedSize


@dataclass(frozen=True)
class CheckpointFormat(ExportFormat):
    """A quantized Hugging Face checkpoint directory, written from the records and read back exactly."""

    size_estimate: str = "compressed_tensors_size"  # the function in export/checkpoint/plan.py

    def check(self, cfg: Any, model: Any, records: dict[str, Any], has_eval: bool) -> None:
        from compress.export.checkpoint import export

        export.check(cfg, model, records)

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
        from compress.export.checkpoint import export

        return export.export(directory, cfg, model, tokenizer, records, reporter, label, kv), []

    def static_bytes(self, path: Path) -> tuple[int, int, int]:
        raise NotImplementedError(f"{self.name} exports are timed as the compressed model (torch)")

    def planned_size(self, cfg: Any, shape: Any, records: dict[str, Any], dtype_bits: int) -> PlannedSize:
        from compress.export.checkpoint import plan

        return getattr(plan, self.size_estimate)(cfg, shape, records, dtype_bits)


COMPRESSED_TENSORS = CheckpointFormat(
    name="compressed-tensors",
    config=CompressedTensorsExportConfig,
    runtime="transformers",
    intended_runtimes="vLLM, transformers (compressed-tensors)",
    description="compressed-tensors pack-quantized Hugging Face folder, written from the records and read back exactly",
)
GPTQ = CheckpointFormat(
    name="gptq",
    config=GPTQExportConfig,
    runtime="transformers",
    intended_runtimes="transformers + GPTQModel, vLLM (GPTQ checkpoint format)",
    description="AutoGPTQ v1 Hugging Face folder, written from the records and read back exactly",
    size_estimate="gptq_size",
)
