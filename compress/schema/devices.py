"""Device profiles: what a deployment target holds, how fast it reads and computes, what runs on it.

Torch-free; loading profile files, measuring this machine and the roofline estimates live in
compress/eval/devices.py, which imports these names from here.

The runtime and format names a profile may list are not fixed here: they are the names the export
formats in compress.plugins.EXPORT_FORMATS run under (``ExportFormat.device_names``: each format
with a runtime of its own, and the torch / hf pair of the in-memory model and Hugging Face
folders). Every loader validates with ``{DEVICE_RUNTIMES: [...], DEVICE_FORMATS: [...]}`` from the
table as validation context (compress.recipe.validation_context), as recipes do for export formats;
this module never imports the table (the schema is the bottom layer). Without that context (a
profile built in code) the names are not checked.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from compress.schema.base import Strict

DEVICE_RUNTIMES = "device_runtimes"  # validation-context key: the runtime names a profile may list
DEVICE_FORMATS = "device_formats"  # validation-context key: the format names a profile may list
_KNOWN = {"runtimes": (DEVICE_RUNTIMES, "runtime"), "formats": (DEVICE_FORMATS, "format")}


class DeviceProfile(Strict):
    """One deployment target. Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="Short id used on the command line, e.g. h100-sxm.")
    description: str = Field(description="What the device is, for people.")
    kind: Literal["gpu", "cpu", "soc"] = Field(description="gpu: discrete accelerator; cpu; soc: CPU and GPU share one memory.")
    memory_gb: float = Field(gt=0, description="Memory the model's process can use, GB (shared RAM on SoCs).")
    bandwidth_gbs: float = Field(gt=0, description="Peak memory bandwidth, GB/s.")
    fp16_tflops: float = Field(gt=0, description="Dense peak FP16 TFLOPS, for prefill (compute) estimates; CPUs: a fair number.")
    runtimes: list[str] = Field(
        min_length=1,
        description="Runtimes that run on it: torch (the in-memory model and Hugging Face folders) and the runtime of each "
        "export format with a runtime of its own (llama.cpp, onnxruntime, tensorrt, …; the field reference lists them).",
    )
    formats: list[str] | None = Field(
        None,
        min_length=1,
        description="Artifact formats those runtimes load: hf (Hugging Face folders, on torch) and each export format "
        "with a runtime of its own (gguf, onnx, tensorrt, …; the field reference lists them). Default: every format "
        "whose runtime is listed in runtimes.",
    )
    decode_efficiency: float = Field(0.6, gt=0, le=1, description="Share of peak bandwidth a batch-1 decoder reaches.")
    prefill_efficiency: float = Field(0.35, gt=0, le=1, description="Share of peak compute prefill reaches.")
    usable_memory_fraction: float = Field(0.9, gt=0, le=1, description="Share of memory_gb left for weights and KV cache.")
    source: str = Field(description="Where the numbers come from: 'vendor datasheet: ...' or 'measured on this machine: ...'.")
    identify: list[str] = Field(
        default_factory=list,
        description="Substrings of the GPU name (gpu profiles) or CPU model "
        "(others) that mean this machine is this device, so measurements here can stand for it.",
    )

    @field_validator("runtimes", "formats", mode="after")
    @classmethod
    def _registered_names(cls, value: list[str] | None, info: ValidationInfo) -> list[str] | None:
        """Each name must be one the export formats run under (from the validation context)."""
        key, what = _KNOWN[str(info.field_name)]
        known: Any = (info.context or {}).get(key)
        if known is None or value is None:
            return value
        unknown = [v for v in value if v not in known]
        if unknown:
            profile = info.data.get("name")
            names = ", ".join(f"'{u}'" for u in unknown)
            raise ValueError(
                f"device profile {f'{profile!r} ' if profile else ''}names unknown {what}{'s' if len(unknown) > 1 else ''} {names}; "
                f"known: {', '.join(known)} (the in-memory model's and those of the export formats in compress.plugins.EXPORT_FORMATS)"
            )
        return value

    @property
    def usable_bytes(self) -> float:
        return self.memory_gb * 1e9 * self.usable_memory_fraction

    def supports(self, fmt: str, runtime: str) -> bool:
        """Whether an artifact of format ``fmt`` on ``runtime`` runs here: its runtime is listed (and its
        format, when the profile lists formats)."""
        return (self.formats is None or fmt in self.formats) and runtime in self.runtimes
