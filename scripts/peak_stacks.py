"""Where a run's resident memory peaks: runs a `compress` command in this process and samples RSS
every few milliseconds; each time RSS rises to a new high, the main thread's Python stack is kept.
Prints the highs with the stack that reached them (frames from this repository only).

    python scripts/peak_stacks.py run recipes/qwen-1.5b-gptq.yaml -o out --overwrite

PEAK_TIMELINE=FILE also writes RSS and the innermost frames once a second. PEAK_TENSORS=1 also
lists, at each new high 256 MiB above the last listed, the live torch tensors and numpy arrays of
16 MiB or more (one line per storage): what Python holds, as against what the allocator keeps.

Used to find what holds memory in the phases `compress bench memory` measures (issue 27).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])
PAGE = os.sysconf("SC_PAGE_SIZE")
STEP = 32 * 2**20  # record a new high only when RSS grew by this much


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def frames(thread_id: int) -> list[str]:
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return []
    out = []
    for fs in traceback.extract_stack(frame):
        if fs.filename.startswith(REPO) and "peak_stacks" not in fs.filename:
            out.append(f"{Path(fs.filename).relative_to(REPO)}:{fs.lineno} {fs.name}")
    return out


def big_arrays(min_bytes: int = 16 * 2**20) -> list[str]:
    import gc

    import numpy as np
    import torch

    seen, out = set(), []
    with warnings.catch_warnings():  # isinstance on some modules' deprecated attributes warns
        warnings.simplefilter("ignore")
        arrays = [o for o in gc.get_objects() if isinstance(o, (torch.Tensor, np.ndarray))]
    for obj in arrays:
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
                storage = obj.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                what = f"torch {tuple(obj.shape)} {obj.dtype}"
            elif isinstance(obj, np.ndarray) and obj.base is None:
                key, size, what = obj.ctypes.data, obj.nbytes, f"numpy {obj.shape} {obj.dtype}"
            else:
                continue
        except Exception:  # tensors being freed, storages without data
            continue
        if size >= min_bytes and key not in seen:
            seen.add(key)
            out.append(f"{size / 2**20:8.0f} MiB  {what}")
    return sorted(out, reverse=True)


def main() -> int:
    highs: list[tuple[float, int, list[str]]] = []
    main_id = threading.get_ident()
    done = threading.Event()
    start = time.monotonic()

    timeline: list[tuple[float, int, list[str]]] = []

    want_tensors = bool(os.environ.get("PEAK_TENSORS"))

    def sample() -> None:
        top, last, listed = 0, 0.0, 0
        while not done.is_set():
            now = rss()
            if time.monotonic() - last > 1.0:
                last = time.monotonic()
                timeline.append((last - start, now, frames(main_id)[-3:]))
            if now > top + STEP:
                top = now
                stack = frames(main_id)
                if want_tensors and now > listed + 256 * 2**20:
                    listed = now
                    stack = [*stack, "live arrays:", *big_arrays()]
                highs.append((time.monotonic() - start, now, stack))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    from compress.cli import main as cli

    sys.argv = ["compress", *sys.argv[1:]]
    code = 0
    try:
        cli()
    except SystemExit as exc:
        code = int(exc.code or 0)
    finally:
        done.set()
        sampler.join()
    if os.environ.get("PEAK_TIMELINE"):
        with open(os.environ["PEAK_TIMELINE"], "w") as f:
            for at, size, stack in timeline:
                f.write(f"{at:8.1f} {size / 2**20:7.0f}  {' < '.join(reversed(stack))}\n")
    for at, size, stack in highs:
        print(f"\n{at:8.1f} s  {size / 2**20:8.0f} MiB")
        cut = stack.index("live arrays:") if "live arrays:" in stack else len(stack)
        for line in [*stack[:cut][-8:], *stack[cut:]]:
            print(f"      {line}")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
