"""What an export format is, as one object: the plugin object every export package (export/<format>/)
provides and compress/plugins.py lists in ``EXPORT_FORMATS``.

The rest of the code asks a format's plugin object every per-format question (recipe config, runtime,
check, write and verify, latency runner, sizes, plan, devices, model-card text, input checks)
and never branches on the format's name. This module and every ``plugin.py`` import neither torch
nor a runtime: implementations are imported inside the methods, so that reading the table stays
cheap (`import compress`, `compress validate`).

A format subclasses :class:`ExportFormat` and overrides what it does differently; the defaults
describe a format that is written and verified by its reader but has no runtime of its own to
time (a Hugging Face checkpoint: gates on it read the ``compressed`` evaluation).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any


def package_versions(packages: tuple[str, ...] | list[str]) -> dict[str, str]:
    """Installed version of each Python distribution, or "not installed"."""
    versions = {}
    for pkg in dict.fromkeys(packages):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = "not installed"
    return versions


if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np
    from pydantic import BaseModel

    from compress.eval.metrics import Evaluation
    from compress.export.parity import VerifyInputs
    from compress.progress import Reporter
    from compress.quantizers.kv_cache import KVCacheScheme

TORCH_RUNTIME = "torch"  # the in-memory model and Hugging Face folders, timed by eval/latency.py itself
HF_FORMAT = "hf"  # what a device profile calls the torch runtime's format

PlannedSize = tuple[int, float, str]
"""(bytes of the written artifact, bytes per cached K/V element at run time, how it was estimated)."""


class Runner:
    """One loaded artifact in a latency worker. ``run(prompts [b, p], steps)`` -> (ttft seconds,
    seconds of each decode step). A format's latency runner subclasses it."""

    max_batch: int | None = None  # None: any
    batch_note: str | None = None  # why larger batches are not measured, when max_batch is set
    weight_bytes: int = 0
    kv_bytes_per_position: int = 0
    size_bytes: int = 0

    def run(self, prompts: np.ndarray, steps: int) -> tuple[float, list[float]]:
        raise NotImplementedError


@dataclass(frozen=True)
class FileLayout:
    """What a format's file of one model holds besides the quantized Linears, for a size budget
    (quantizers/mix.py asks it through ``ExportFormat.file_layout``, never the writer itself)."""

    tensor_bytes: Callable[[str, tuple[int, ...]], int]
    """Bytes of one tensor of a grid (or float type) and shape as the file stores it, padding included."""
    fixed_bytes: int
    """Bytes of the tensors no quantize stage touches (embeddings, norms, a float head, biases)."""
    params: int
    """Parameters of every tensor in the file."""
    metadata_bytes: Callable[[], int]
    """Bytes of the file before its tensor data (header, metadata, tensor table), measured when called."""


@dataclass(frozen=True)
class ExportFormat:
    """One export format: its recipe key, config class and runtime, and the operations on it.

    ``own_runtime`` (from the config class, so that recipe validation knows it without this table)
    says whether the export is verified and timed on a runtime of its own (its gates read those
    numbers); otherwise it holds exactly the compressed records, proven by its reader, and gates on
    it read the ``compressed`` evaluation.
    """

    name: str  # the recipe's ``format:`` key
    config: type[BaseModel]  # the recipe's config class for it (export/<name>/config.py: a BaseExportConfig)
    runtime: str  # where it runs: llama.cpp | onnxruntime | tensorrt | transformers (a latency runtime when own_runtime)
    intended_runtimes: str  # model-card text: where people run it
    description: str  # one line for people: what the export is (the generated field reference lists it)
    runtime_module: str | None = None  # the Python module whose import means the runtime is installed (device profiles)
    needs_cuda: bool = False  # the runtime runs on a CUDA GPU only
    input_kind: str | None = None  # what ``compress gate`` takes of it as a bare input ("GGUF file"), None: nothing
    packages: tuple[str, ...] = ()  # Python distributions whose versions the manifest records
    writer: str | None = None
    """The module whose ``check(cfg, model, records, has_eval)`` and ``export(directory, cfg, model,
    tokenizer, records, inputs, reporter, label, kv)`` the default ``check`` and ``write`` call,
    imported only when a run uses them; None: the format overrides both (or writes nothing)."""

    def runtime_build(self) -> dict[str, str]:
        """What identifies the build of this format's runtime, for every number measured on it: the
        versions of its packages; a format whose runtime reports more of itself (a commit, the
        features it was compiled with) adds that."""
        return package_versions(self.packages or ((self.runtime_module,) if self.runtime_module else ()))

    @property
    def own_runtime(self) -> bool:
        return bool(getattr(self.config, "own_runtime", False))

    @property
    def device_names(self) -> tuple[str, str]:
        """(format, runtime) as a device profile lists them for this export to run there (``compress
        plan``'s support column): its own name and runtime when it has a runtime of its own, else
        a Hugging Face folder on torch (hf, torch). These are the names device profiles may use."""
        return (self.name, self.runtime) if self.own_runtime else (HF_FORMAT, TORCH_RUNTIME)

    # ------------------------------------------------------------------ the run

    def check(self, cfg: Any, model: Any, records: dict[str, Any], has_eval: bool) -> None:
        """Raise FormatError, before any heavy work, when the records cannot be written exactly."""
        if self.writer is not None:
            importlib.import_module(self.writer).check(cfg, model, records, has_eval)

    def write(
        self,
        directory: Path,
        cfg: Any,
        model: Any,
        tokenizer: Any,
        records: dict[str, Any],
        inputs: VerifyInputs | None,
        reporter: Reporter,
        label: str,
        kv: KVCacheScheme | None,
    ) -> tuple[dict[str, Any], list[Evaluation]]:
        """Write the export to ``directory`` and verify it; returns its manifest entry (without
        path and files) and the evaluations made on its runtime."""
        if self.writer is None:
            raise NotImplementedError(f"export format {self.name} has no writer")
        return importlib.import_module(self.writer).export(directory, cfg, model, tokenizer, records, inputs, reporter, label, kv)

    def write_importance(
        self, directory: Path, model: Any, input_sums: dict[str, Any], datasets: list[str], chunk_size: int
    ) -> dict[str, Any] | None:
        """Write what the run's calibration measured of each Linear's inputs (``RunContext.input_sums``)
        beside the export, in the form its runtime's own tools read; returns the manifest entry's
        ``importance`` facts, None when the format has no such file (the default)."""
        return None

    def describe_entry(self, entry: dict[str, Any]) -> str:
        """One export as people read it, from its manifest entry (the model card's format column):
        the format's name, and what the entry says of its kind where the format records one."""
        return self.name

    def timed_path(self, folder: Path, entry: dict[str, Any]) -> tuple[Path, str] | None:
        """What the latency block times of a written export and on which device ('cpu', 'cuda'),
        or None when nothing can be timed (no runtime of its own, or no engine was built)."""
        return None

    # ------------------------------------------------------------------ runtime (latency worker, gate)

    def runner(self, path: Path, threads: int, context: int) -> Runner:
        """A loaded artifact for the latency worker (imports the runtime)."""
        raise NotImplementedError(f"export format {self.name} has no latency runner")

    def static_bytes(self, path: Path) -> tuple[int, int, int]:
        """(weights a decode step reads, KV bytes per position, size on disk) from the files alone."""
        raise NotImplementedError(f"export format {self.name} has no size reader")

    def parameter_count(self, path: Path) -> int | None:
        """Weights in the files (for prefill compute estimates); None when the files do not say."""
        return None

    def forward(self, path: Path, seq_len: int, threads: int) -> tuple[Callable[..., Any], Callable[[], None] | None] | None:
        """(log-prob forward over token chunks, close) on the runtime for ``compress gate``'s
        accuracy metrics; None when this runtime is scored only by its export's verifier."""
        return None

    # ------------------------------------------------------------------ inputs (compress gate on a bare file or folder)

    def recognizes(self, path: Path) -> bool:
        """Whether a path given to ``compress gate`` is this format's file or folder."""
        return False

    def check_input(self, path: Path) -> Path:
        """Check an imported file or folder of this format (raises ModelLoadError); returns what its runtime loads."""
        raise NotImplementedError(f"export format {self.name} reads no input files")

    def load_source(self, path: Path, model_cfg: Any, reporter: Reporter, load_dir: Callable[..., Any]) -> Any:
        """A recognized file as the recipe's model source (``model.source``): a LoadedModel (compress/models.py).
        ``load_dir(directory, model_cfg, reporter, kind, source)`` is compress.models.from_hf_dir, handed in
        for a format that converts its file to a Hugging Face folder (the loader sits above the formats)."""
        raise NotImplementedError(f"export format {self.name} is not a model source")

    def source_config(self, path: Path, digest: str | None, source: str) -> tuple[Any, str]:
        """(transformers config, where it was read) of a recognized model source, for ``compress plan``
        without loading the weights; ``digest``: the file's SHA-256 when known (a cached conversion);
        ``source``: the recipe's ``model.source``, for messages."""
        raise NotImplementedError(f"export format {self.name} is not a model source")

    def file_layout(self, cfg: Any, model: Any, tokenizer: Any, quantized: set[str]) -> FileLayout:
        """What the export config ``cfg``'s file of ``model`` holds besides the Linears named in ``quantized``
        (whose grids a size budget chooses), and what each grid's tensor takes in it."""
        raise NotImplementedError(f"export format {self.name} has no size budget")

    # ------------------------------------------------------------------ plan

    def planned_size(self, cfg: Any, shape: Any, records: dict[str, Any], dtype_bits: int) -> PlannedSize:
        """The export's size from the config alone (eval/plan/artifacts.py: ``shape`` a ModelShape on the
        meta device, ``records`` the planned quantized layers)."""
        raise NotImplementedError(f"export format {self.name} has no size estimate")

    def planned_memory_bytes(self, cfg: Any, size_bytes: float, shape: Any, seq_len: int) -> tuple[float, str]:
        """What writing and verifying the export adds to the run's held memory (the libraries and a
        streamed unit), and how it is reckoned; by default the file twice (built, then loaded)."""
        return 2 * size_bytes, "the file twice (built in memory, then loaded by its runtime)"

    def planned_verify_tokens(self, cfg: Any, samples: int, seq_len: int) -> int:
        """Tokens its verifier scores on its runtime, for the plan's time estimate."""
        if not getattr(cfg, "verify", False):
            return 0
        return (getattr(cfg, "verify_samples", None) or samples) * seq_len
