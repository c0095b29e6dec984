"""Which build of which runtime, on which device, measured a number: every measured evaluation in
report.json carries it (``build``), so a number from one runtime version is never read as another's."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

from compress.eval.metrics import Evaluation
from compress.export.format import package_versions
from compress.plugins import EXPORT_FORMATS

TORCH_PACKAGES = ("torch", "transformers")
"""What the in-memory model's numbers depend on (the baseline, the compressed model, a checkpoint export's)."""


def device_name(device: str) -> str:
    """``cpu: <processor model>`` or ``cuda: <GPU name>``; the device string as given otherwise."""
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return f"cuda: {torch.cuda.get_device_name(torch.device(device))}"
        return device
    if device == "cpu":
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    return f"cpu: {line.split(':', 1)[1].strip()}"
        except OSError:
            pass
        return f"cpu: {platform.processor() or platform.machine()}"
    return device


@functools.cache
def runtime_build(runtime: str, device: str) -> dict[str, str]:
    """The runtime's build (its ExportFormat's ``runtime_build``; torch and transformers for the
    in-memory model) and the device, for the evaluation measured on them."""
    formats = [f for f in EXPORT_FORMATS.values() if f.runtime == runtime and f.own_runtime]
    # the in-memory model (torch) and formats without a runtime of their own run in torch + transformers
    build = formats[0].runtime_build() if formats else package_versions(TORCH_PACKAGES)
    return {"runtime": runtime, **build, "device": device_name(device)}


def with_build(evaluation: Evaluation) -> Evaluation:
    """``evaluation`` with the build that measured it (an estimate for a device profile has none)."""
    if evaluation.build is None and evaluation.source == "measured":
        evaluation.build = dict(runtime_build(evaluation.runtime, evaluation.device))
    return evaluation
