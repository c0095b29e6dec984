"""The GGUF export format's plugin object, an ExportFormat (torch-free; implementations are imported by its methods)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compress.export.format import ExportFormat, FileLayout, PlannedSize, Runner
from compress.export.gguf.config import GGUFExportConfig
from compress.quantizers.grids import llama_cpp_spelling

SUFFIX = ".gguf"
GGUF_FILE = "model.gguf"  # the export's file in its folder


@dataclass(frozen=True)
class GGUFFormat(ExportFormat):
    """A GGUF file for llama.cpp, packed from the records, verified and timed in llama.cpp."""

    def runtime_build(self) -> dict[str, str]:
        """The binding's version (it vendors one llama.cpp commit; the library does not report the
        commit itself), the llama and ggml library versions and the CPU features llama.cpp was built with."""
        from compress.export.gguf.runtime import library_build

        return {**super().runtime_build(), **library_build()}

    def describe_entry(self, entry: dict[str, Any]) -> str:
        """'gguf Q4_1': the block type the file was written in, spelt as llama.cpp writes it."""
        return f"{self.name} {llama_cpp_spelling(entry['type'])}" if entry.get("type") else self.name

    def write_importance(
        self, directory: Path, model: Any, input_sums: dict[str, Any], datasets: list[str], chunk_size: int
    ) -> dict[str, Any] | None:
        """llama.cpp's importance matrix (``imatrix.gguf``, for ``llama-quantize --imatrix``)."""
        from compress.export.gguf.imatrix import IMATRIX_FILE, write_imatrix

        return write_imatrix(directory / IMATRIX_FILE, model, input_sums, datasets, chunk_size)

    def timed_path(self, folder: Path, entry: dict[str, Any]) -> tuple[Path, str] | None:
        return folder / GGUF_FILE, "cpu"

    def runner(self, path: Path, threads: int, context: int) -> Runner:
        from compress.export.gguf.latency import LlamaCppRunner

        return LlamaCppRunner(path, threads, context)

    def static_bytes(self, path: Path) -> tuple[int, int, int]:
        from compress.export.gguf.latency import gguf_bytes

        return (*gguf_bytes(path), path.stat().st_size)

    def parameter_count(self, path: Path) -> int | None:
        from compress.export.gguf.latency import parameter_count

        return parameter_count(path)

    def forward(self, path: Path, seq_len: int, threads: int) -> Any:
        from compress.export.gguf.runtime import LlamaCppModel

        runtime = LlamaCppModel(path, n_ctx=seq_len, threads=threads)
        return runtime.forward, runtime.close

    def recognizes(self, path: Path) -> bool:
        return path.is_file() and path.suffix == SUFFIX

    def check_input(self, path: Path) -> Path:
        from compress.export.gguf.inputs import check_gguf

        check_gguf(path)
        return path

    def load_source(self, path: Path, model_cfg: Any, reporter: Any, load_dir: Any) -> Any:
        from compress.export.gguf.source import load_source

        return load_source(path, model_cfg, reporter, load_dir)

    def source_config(self, path: Path, digest: str | None, source: str) -> tuple[Any, str]:
        from compress.export.gguf.source import source_config

        return source_config(path, digest, source)

    def planned_memory_bytes(self, cfg: Any, size_bytes: float, shape: Any, seq_len: int) -> tuple[float, str]:
        # Written a tensor at a time; llama.cpp maps the file and, scoring a piece of a row per call,
        # keeps that piece's logits twice (its output buffer and its graph's result).
        from compress.export.gguf.runtime import PIECE_TOKENS

        piece = min(max(seq_len, 1), PIECE_TOKENS)
        logits = 2 * piece * shape.text.vocab_size * 4
        basis = f"the file as llama.cpp maps it and the logits of {piece} tokens twice (float32)"
        if cfg.quantizer == "llama.cpp":  # our F16 file is what llama.cpp's quantizer reads
            return size_bytes + logits + 2 * shape.params, basis + ", and the F16 file its quantizer reads"
        return size_bytes + logits, basis

    def file_layout(self, cfg: Any, model: Any, tokenizer: Any, quantized: set[str]) -> FileLayout:
        from compress.export.gguf.writer import file_layout

        return file_layout(cfg, model, tokenizer, quantized)

    def planned_size(self, cfg: Any, shape: Any, records: dict[str, Any], dtype_bits: int) -> PlannedSize:
        from compress.export.gguf.plan import planned_size

        return planned_size(cfg, shape, records, dtype_bits)


GGUF = GGUFFormat(
    name="gguf",
    writer="compress.export.gguf.export",
    config=GGUFExportConfig,
    runtime="llama.cpp",
    intended_runtimes="llama.cpp (and tools built on it: Ollama, LM Studio, llama-cpp-python)",
    description="GGUF file with the records packed into exact blocks (or llama.cpp's own quantizer), verified and timed in llama.cpp",
    input_kind="GGUF file",
    packages=("gguf", "llama_cpp_python"),
    runtime_module="llama_cpp",
)
