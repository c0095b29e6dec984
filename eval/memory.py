"""Peak resident memory of this process over a block of work (benchmarks and the latency worker)."""

from __future__ import annotations

import ctypes
import gc
import threading


def _release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc ``malloc_trim``), so that
    resident memory at the start of a measurement is what is live, not what an earlier candidate
    freed but the allocator kept (without this, later rows read as 0 MB extra)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the start reading may include freed memory
        pass


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
