"""Peak memory of this process: over a block of work, sampled (``PeakRSS``: benchmarks and the latency
worker), and per phase of a run, from the kernel's high-water marks (``PhaseMemory``: report.json's
``memory`` section, with ``memory_section``)."""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc ``malloc_trim``), so that
    resident memory at the start of a measurement is what is live, not what an earlier candidate
    freed but the allocator kept (without this, later rows read as 0 MB extra)."""
    from compress.heap import return_to_os

    gc.collect()
    return_to_os()  # not glibc: the start reading may include freed memory


class PeakRSS:
    """Samples this process's resident memory every 20 ms. After the block: ``peak_mb``, and
    ``extra_mb`` = peak minus the memory in use when the block started."""

    def __init__(self) -> None:
        import psutil

        self._proc = psutil.Process()
        self._stop = threading.Event()
        _release_freed_memory()
        self.start_mb = self._proc.memory_info().rss / 2**20
        self.peak_mb = self.start_mb

    @property
    def extra_mb(self) -> float:
        return self.peak_mb - self.start_mb

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_mb = max(self.peak_mb, self._proc.memory_info().rss / 2**20)
            self._stop.wait(0.02)

    def __enter__(self) -> PeakRSS:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, self._proc.memory_info().rss / 2**20)


# ------------------------------------------------------------------------ peak memory per phase of a run

PROC_STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")
RESET_HIGH_WATER_MARK = "5"  # proc(5): writing 5 to clear_refs resets the process's peak RSS (VmHWM) to its current RSS
MIB = 2**20


def _high_water_mb() -> float | None:
    """The process's peak resident memory since the last reset (VmHWM), in MiB; None where unreadable."""
    try:
        for line in PROC_STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / MIB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reset_high_water() -> bool:
    try:
        CLEAR_REFS.write_text(RESET_HIGH_WATER_MARK)
    except OSError:
        return False
    return True


def maxrss_mb(children: bool = False) -> float:
    """getrusage's ru_maxrss in MiB: this process's peak so far, or (``children``) the largest peak of
    any child process it has waited for. 0.0 where the platform has no getrusage."""
    try:
        import resource
    except ImportError:  # not POSIX
        return 0.0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF)
    unit = 1 if sys.platform == "darwin" else 1024  # macOS counts bytes, Linux kilobytes
    return usage.ru_maxrss * unit / MIB


@dataclass
class _Open:
    """A phase that has started and not ended: its running peaks (what nested phases and readings
    taken inside it saw before their resets)."""

    key: str
    cuda: Any
    rss_mb: float = 0.0
    cuda_mb: float = 0.0


@dataclass
class PhaseMemory:
    """Peak resident memory (and peak CUDA memory where a phase runs on CUDA) of each phase of a run.

    On Linux each phase resets the process's peak-RSS high-water mark when it starts and reads it
    when it ends, so a phase's peak is its own; every reading taken before a reset is also folded
    into the phases still open (a nested phase) and into the run's overall peak, so nothing is lost
    between phases. Where the mark cannot be reset, each phase records the process's peak so far
    (``method`` says which). ``result`` adds the peak of the child processes waited for."""

    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    method: str = "vmhwm"
    overall_rss_mb: float = 0.0
    overall_cuda_mb: float | None = None
    _open: list[_Open] = field(default_factory=list)

    def __post_init__(self) -> None:
        """The run starts here: an earlier peak of the process (a previous run in it, as a search's
        candidates) is not this run's."""
        if not _reset_high_water():
            self.method = "ru_maxrss"

    def _reading(self, reset: bool) -> float:
        """The peak since the last reset, folded into every open phase and the overall peak; then reset."""
        value = _high_water_mb() if self.method == "vmhwm" else None
        if value is None or (reset and not _reset_high_water()):
            self.method = "ru_maxrss"
            value = max(value or 0.0, maxrss_mb())
        for item in self._open:
            item.rss_mb = max(item.rss_mb, value)
        self.overall_rss_mb = max(self.overall_rss_mb, value)
        return value

    def _cuda_reading(self, device: Any, reset: bool) -> float:
        import torch

        value = torch.cuda.max_memory_allocated(device) / MIB
        for item in self._open:
            if item.cuda is not None:
                item.cuda_mb = max(item.cuda_mb, value)
        self.overall_cuda_mb = max(self.overall_cuda_mb or 0.0, value)
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return value

    @contextmanager
    def phase(self, key: str, device: Any = None) -> Iterator[None]:
        """Measure the block as phase ``key`` (a ``torch.device``, when given and CUDA, adds its peak CUDA memory)."""
        cuda = device if getattr(device, "type", None) == "cuda" else None
        self._reading(reset=True)
        if cuda is not None:
            self._cuda_reading(cuda, reset=True)
        item = _Open(key, cuda)
        self._open.append(item)
        try:
            yield
        finally:
            self._open.pop()
            rss = max(item.rss_mb, self._reading(reset=False))
            entry = {"peak_rss_mb": round(rss, 1)}
            if cuda is not None:
                entry["peak_cuda_mb"] = round(max(item.cuda_mb, self._cuda_reading(cuda, reset=False)), 1)
            for parent in self._open:  # a nested phase's peak is its parent's too
                parent.rss_mb = max(parent.rss_mb, rss)
                if parent.cuda is not None and cuda is not None:
                    parent.cuda_mb = max(parent.cuda_mb, entry["peak_cuda_mb"])
            self.phases[key] = entry

    def result(self) -> dict[str, Any]:
        """Every phase's peak, the overall peak so far (phases and the time between them), and the
        largest peak of a child process (a latency worker, a runtime run out of process). The child
        peak is an upper bound: Linux starts a child's count in the copy of this process it begins
        as (fork, vfork), so every child reads at least this process's resident memory at its start."""
        self._reading(reset=False)
        out: dict[str, Any] = {
            "method": self.method,
            "phases": {k: dict(v) for k, v in self.phases.items()},
            "peak_rss_mb": round(self.overall_rss_mb, 1),
            "children_peak_rss_mb": round(maxrss_mb(children=True), 1),
        }
        if self.overall_cuda_mb is not None:
            out["peak_cuda_mb"] = round(self.overall_cuda_mb, 1)
        return out


def memory_section(meter: PhaseMemory, wall_s: float, predict: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """report.json's ``memory``: the measured peaks (``meter.result()``), the run's wall time so far,
    and what `compress plan` predicted for the same recipe (``predict``: compress.eval.plan.planner.run_estimate
    of the recipe), with measured / predicted per phase and in total. A prediction that cannot be
    computed (a source whose config the plan cannot read) is reported with its reason instead."""
    from compress.eval.plan.shapes import GB

    out = meter.result()
    out["wall_s"] = round(wall_s, 3)
    try:
        estimate = predict()
    except Exception as exc:  # the prediction only informs: a run never fails for it, the report says why it is missing
        out["predicted"] = {"error": f"compress plan could not estimate this recipe: {type(exc).__name__}: {str(exc)[:300]}"}
        return out
    rss_mb = estimate["peak_memory_gb"] * GB / MIB
    out["predicted"] = {
        "peak_rss_mb": round(rss_mb, 1),
        "peak_cuda_mb": None,  # compress plan estimates host memory (a CPU run) only
        "time_s": round(estimate["time_s"], 3),
    }
    out["measured_over_predicted"] = {
        k: round(measured / predicted, 3)
        for k, measured, predicted in (("peak_rss", out["peak_rss_mb"], rss_mb), ("time", wall_s, estimate["time_s"]))
        if predicted > 0
    }
    for phase, gb in estimate["phases"].items():
        entry = out["phases"].get(phase)
        if entry is not None and gb > 0:
            entry["predicted_rss_mb"] = round(gb * GB / MIB, 1)
            entry["measured_over_predicted"] = round(entry["peak_rss_mb"] / entry["predicted_rss_mb"], 3)
    return out
