"""Device profiles: what a deployment target holds, how fast it reads and computes, what runs on it.

Torch-free; loading profile files, measuring this machine and the roofline estimates live in
compress/eval/devices.py, which re-exports these names.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from compress.schema.base import Strict

Runtime = Literal["torch", "llama.cpp", "onnxruntime", "tensorrt"]
Format = Literal["hf", "gguf", "onnx", "tensorrt"]


class DeviceProfile(Strict):
    """One deployment target. Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="Short id used on the command line, e.g. h100-sxm.")
    description: str = Field(description="What the device is, for people.")
    kind: Literal["gpu", "cpu", "soc"] = Field(description="gpu: discrete accelerator; cpu; soc: CPU and GPU share one memory.")
    memory_gb: float = Field(gt=0, description="Memory the model's process can use, GB (shared RAM on SoCs).")
    bandwidth_gbs: float = Field(gt=0, description="Peak memory bandwidth, GB/s.")
    fp16_tflops: float = Field(gt=0, description="Dense peak FP16 TFLOPS, for prefill (compute) estimates; CPUs: a fair number.")
    runtimes: list[Runtime] = Field(min_length=1, description="Runtimes that run on it: torch, llama.cpp, onnxruntime, tensorrt.")
    formats: list[Format] = Field(min_length=1, description="Artifact formats those runtimes load: hf, gguf, onnx, tensorrt.")
    decode_efficiency: float = Field(0.6, gt=0, le=1, description="Share of peak bandwidth a batch-1 decoder reaches.")
    prefill_efficiency: float = Field(0.35, gt=0, le=1, description="Share of peak compute prefill reaches.")
    usable_memory_fraction: float = Field(0.9, gt=0, le=1, description="Share of memory_gb left for weights and KV cache.")
    source: str = Field(description="Where the numbers come from: 'vendor datasheet: ...' or 'measured on this machine: ...'.")
    identify: list[str] = Field(
        default_factory=list,
        description="Substrings of the GPU name (gpu profiles) or CPU model "
        "(others) that mean this machine is this device, so measurements here can stand for it.",
    )

    @property
    def usable_bytes(self) -> float:
        return self.memory_gb * 1e9 * self.usable_memory_fraction

    def supports(self, fmt: str, runtime: str) -> bool:
        return fmt in self.formats and runtime in self.runtimes
