"""Device profiles, roofline latency estimates and the memory fit check.

A `DeviceProfile` says what a deployment target holds (memory usable by the model's process),
how fast it reads memory (peak bandwidth) and computes (dense FP16 peak), and which runtimes
and formats run on it. Profiles ship in ``devices.yaml`` next to this file (numbers from vendor
datasheets, each with its `source`); users add or replace profiles with their own YAML files
(a top-level ``devices:`` list). ``local`` describes this machine, measured.

Everything computed from a profile is an *estimate* (``source: "estimated"`` wherever it lands):

* decode (one step, batch B): ``max(memory, compute)`` with
  memory = (weight bytes + B × KV bytes per token × mean context) / (bandwidth × decode_efficiency),
  compute = 2 × params × B / (fp16_tflops × prefill_efficiency);
  small models on few CPU cores are compute-bound, large models on GPUs memory-bound;
* time to first token: ``max(2 × params × prompt × B / (fp16_tflops × prefill_efficiency),
  weight bytes / (bandwidth × decode_efficiency))`` (attention FLOPs are left out);
* fit: weights + KV cache at the context and batch (+ overhead) <= memory × usable_memory_fraction.

Units: GB = 1e9 bytes, GB/s = 1e9 bytes/s, TFLOPS = 1e12 FLOP/s. Cheap to import: torch and psutil
are imported inside the functions that measure.
"""

from __future__ import annotations

import difflib
import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from compress.errors import CompressError
from compress.export.format import HF_FORMAT, TORCH_RUNTIME
from compress.plugins import runtime_formats
from compress.recipe import validation_context
from compress.schema.devices import DeviceProfile
from compress.schema.yamlio import load_yaml, read_text

LOCAL = "local"
SHIPPED_PROFILES = Path(__file__).with_name("devices.yaml")


# --------------------------------------------------------------------------- loading


def load_profiles(paths: Sequence[Path | str] = (), extra: Sequence[dict[str, Any]] = ()) -> dict[str, DeviceProfile]:
    """The shipped profiles, then each file's, then ``extra`` dicts; a later profile with an
    earlier name replaces it. Errors name the file, line and key."""
    profiles = dict(_read_file(SHIPPED_PROFILES))
    for path in paths:
        profiles.update(_read_file(Path(path)))
    for i, item in enumerate(extra):
        profile = _validate(item, f"device profile extra[{i}]", {})
        profiles[profile.name] = profile
    return profiles


def get_profile(profiles: dict[str, DeviceProfile], name: str) -> DeviceProfile:
    """``profiles[name]``, or an error listing the known names (and the closest one)."""
    if name in profiles:
        return profiles[name]
    close = [n for n in profiles if n.startswith(name)] or difflib.get_close_matches(name, list(profiles), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise CompressError(
        f"unknown device '{name}'{hint}; known: {', '.join(profiles)}. "
        "Add your own with --devices-file (a YAML file with a top-level `devices:` list)."
    )


def _read_file(path: Path) -> dict[str, DeviceProfile]:
    data, all_lines = load_yaml(read_text(path, "device profiles"), str(path))
    if not isinstance(data, dict) or set(data) != {"devices"} or not isinstance(data["devices"], list):
        keys = sorted(map(str, data)) if isinstance(data, dict) else type(data).__name__
        raise CompressError(f"{path}: a device profile file is a mapping with one key, `devices:` (a list of profiles); got {keys}")
    out: dict[str, DeviceProfile] = {}
    for i, item in enumerate(data["devices"]):
        lines = {"": all_lines.get(("devices", i), 1)}
        if isinstance(item, dict):
            lines.update({str(k): all_lines[("devices", i, k)] for k in item if ("devices", i, k) in all_lines})
        name = item.get("name") if isinstance(item, dict) else None
        where = f"{path}:{lines['']}: devices[{i}]" + (f" ({name})" if name else "")
        profile = _validate(item, where, lines, path)
        if profile.name in out:
            raise CompressError(f"{where}: name '{profile.name}' repeats an earlier profile in the same file")
        out[profile.name] = profile
    return out


def _validate(item: Any, where: str, lines: dict[str, int], path: Path | None = None) -> DeviceProfile:
    if not isinstance(item, dict):
        raise CompressError(f"{where}: a device profile is a mapping of {', '.join(DeviceProfile.model_fields)}")
    try:
        return DeviceProfile.model_validate(item, context=validation_context())  # runtime and format names from the table
    except ValidationError as exc:
        problems = []
        for e in exc.errors():
            key = str(e["loc"][0]) if e["loc"] else ""
            at = f"{path}:{lines[key]}: " if path is not None and key in lines else ""
            if e["type"] == "extra_forbidden":
                close = difflib.get_close_matches(key, list(DeviceProfile.model_fields), n=1)
                msg = f"unknown key '{key}'" + (
                    f" (did you mean '{close[0]}'?)" if close else f" (allowed: {', '.join(DeviceProfile.model_fields)})"
                )
            elif e["type"] == "missing":
                msg = f"required key '{key}' is missing"
            else:
                msg = f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}"
            problems.append(f"  {at}{msg}")
        raise CompressError(f"{where} is not a valid device profile:\n" + "\n".join(problems)) from None


# --------------------------------------------------------------------------- this machine


def measure_bandwidth(device: str = "cpu", size_mb: int = 256, repeats: int = 7) -> dict[str, Any]:
    """Memory bandwidth from ``dst.copy_(src)`` of a ``size_mb`` MiB buffer (torch's copy runs on
    all its threads); each copy reads and writes the buffer, so 2 × size bytes move per repeat."""
    import torch

    if size_mb < 1 or repeats < 1:
        raise CompressError(f"measure_bandwidth: size_mb and repeats must be >= 1 (got {size_mb}, {repeats})")
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise CompressError(f"measure_bandwidth: device '{device}' asked for, but torch sees no CUDA device")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n = size_mb * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32, device=device)  # written once, so every page is resident
    dst = torch.zeros(n, dtype=torch.float32, device=device)
    dst.copy_(src)  # warm-up
    rates = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        rates.append(2 * n * 4 / (time.perf_counter() - start) / 1e9)
    return {
        "bandwidth_gbs": statistics.median(rates),
        "best_gbs": max(rates),
        "repeats": repeats,
        "size_mb": size_mb,
        "threads": 1 if cuda else torch.get_num_threads(),
        "device": device,
        "method": f"torch copy_ of a {size_mb} MiB buffer, read+write counted",
    }


def measure_matmul_tflops(device: str = "cpu", size: int | None = None, repeats: int = 5) -> dict[str, Any]:
    """Dense matmul throughput: float32 on CPU (what CPU runtimes compute in), float16 on CUDA."""
    import torch

    cuda = device.startswith("cuda")
    size = size or (4096 if cuda else 1024)
    dtype = torch.float16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    a @ b  # warm-up
    rates = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        a @ b
        sync()
        rates.append(2 * size**3 / (time.perf_counter() - start) / 1e12)
    name = str(dtype).removeprefix("torch.")
    return {
        "tflops": statistics.median(rates),
        "best_tflops": max(rates),
        "repeats": repeats,
        "size": size,
        "dtype": name,
        "method": f"torch matmul of two {size}x{size} {name} matrices",
    }


def _importable(module: str) -> bool:
    try:
        __import__(module)
        return True
    except Exception:  # a broken optional install (missing shared library, ...) counts as absent
        return False


def local_profile(bandwidth_gbs: float | None = None, cuda: bool = False, fp16_tflops: float | None = None) -> DeviceProfile:
    """This machine, measured: memory (RAM, or the GPU's with ``cuda``), bandwidth and compute
    (measured unless given), and the runtimes whose Python modules import here."""
    import torch

    if cuda and not torch.cuda.is_available():
        raise CompressError("local_profile(cuda=True): torch sees no CUDA device on this machine")
    device = "cuda" if cuda else "cpu"
    notes = []
    if bandwidth_gbs is None:
        bw = measure_bandwidth(device)
        bandwidth_gbs = bw["bandwidth_gbs"]
        notes.append(f"bandwidth {bandwidth_gbs:.1f} GB/s ({bw['method']}, median of {bw['repeats']}, {bw['threads']} threads)")
    if fp16_tflops is None:
        mm = measure_matmul_tflops(device)
        fp16_tflops = mm["tflops"]
        notes.append(f"compute {fp16_tflops:.3f} TFLOPS ({mm['method']})")
    if cuda:
        props = torch.cuda.get_device_properties(0)
        memory_gb, description = props.total_memory / 1e9, f"this machine: {props.name}"
    else:
        memory_gb = _ram_bytes() / 1e9
        description = f"this machine: {cpu_model()}, {os.cpu_count()} cores"
    usable = [f for f in runtime_formats().values() if (cuda or not f.needs_cuda) and f.runtime_module and _importable(f.runtime_module)]
    runtimes = [TORCH_RUNTIME] + [f.runtime for f in usable]
    notes.append(f"memory {memory_gb:.1f} GB ({'GPU total' if cuda else 'RAM total'}); runtimes whose modules import here")
    return DeviceProfile(
        name=LOCAL,
        description=description,
        kind="gpu" if cuda else "cpu",
        memory_gb=round(memory_gb, 2),
        bandwidth_gbs=round(bandwidth_gbs, 2),
        fp16_tflops=round(fp16_tflops, 4),
        runtimes=runtimes,
        formats=[HF_FORMAT] + [f.name for f in usable],
        source="measured on this machine: " + "; ".join(notes),
    )


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or f"{platform.machine()} CPU"


def _ram_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:  # psutil comes with accelerate; this is the POSIX fallback
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


# --------------------------------------------------------------------------- estimates (pure)


def kv_bytes_per_token(config: Any, bytes_per_element: float = 2.0) -> int:
    """KV-cache bytes one token adds: 2 (K and V) × layers × KV heads × head_dim × bytes."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return int(round(2 * int(config.num_hidden_layers) * kv_heads * head_dim * bytes_per_element))


def estimate_latency(
    profile: DeviceProfile, weight_bytes: int, kv_bytes_per_token: int, params: int, prompt_tokens: int, output_tokens: int, batch: int = 1
) -> dict[str, Any]:
    """Roofline time to first token and time per output token (formulas in the module docstring)."""
    if min(prompt_tokens, output_tokens, batch) < 1 or min(weight_bytes, params) <= 0 or kv_bytes_per_token < 0:
        raise CompressError("estimate_latency: prompt_tokens, output_tokens, batch, weight_bytes and params must be positive")
    bandwidth = profile.bandwidth_gbs * 1e9 * profile.decode_efficiency  # bytes/s
    flops = profile.fp16_tflops * 1e12 * profile.prefill_efficiency  # FLOP/s
    mean_context = prompt_tokens + output_tokens / 2  # cached tokens at the average decode step
    step_bytes = weight_bytes + batch * kv_bytes_per_token * mean_context
    decode_memory_s, decode_compute_s = step_bytes / bandwidth, 2 * params * batch / flops
    prefill_compute_s, prefill_memory_s = 2 * params * prompt_tokens * batch / flops, weight_bytes / bandwidth
    tpot_s, ttft_s = max(decode_memory_s, decode_compute_s), max(prefill_compute_s, prefill_memory_s)
    return {
        "ttft_ms": ttft_s * 1e3,
        "tpot_ms": tpot_s * 1e3,
        "decode_tokens_per_s": 1 / tpot_s,
        "batch_decode_tokens_per_s": batch / tpot_s,
        "assumptions": {
            "device": profile.name,
            "device_source": profile.source,
            "bandwidth_gbs": profile.bandwidth_gbs,
            "decode_efficiency": profile.decode_efficiency,
            "fp16_tflops": profile.fp16_tflops,
            "prefill_efficiency": profile.prefill_efficiency,
            "weight_bytes": weight_bytes,
            "kv_bytes_per_token": kv_bytes_per_token,
            "params": params,
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "batch": batch,
            "mean_context": mean_context,
            "decode_bound": "memory" if decode_memory_s >= decode_compute_s else "compute",
            "prefill_bound": "compute" if prefill_compute_s >= prefill_memory_s else "memory",
            "formula": "tpot = max((weight_bytes + batch*kv_bytes_per_token*mean_context) / (bandwidth*decode_efficiency), "
            "2*params*batch / (fp16_tflops*prefill_efficiency)); ttft = max(2*params*prompt_tokens*batch / "
            "(fp16_tflops*prefill_efficiency), weight_bytes / (bandwidth*decode_efficiency)); "
            "mean_context = prompt_tokens + output_tokens/2; attention FLOPs and runtime overheads left out",
        },
    }


def fit_check(
    profile: DeviceProfile, weight_bytes: int, kv_bytes_per_token: int, context: int, batch: int, overhead_bytes: int = 0
) -> dict[str, Any]:
    """Whether weights + a full KV cache (context × batch tokens) + overhead fit the usable memory."""
    kv = kv_bytes_per_token * context * batch
    required = weight_bytes + kv + overhead_bytes
    usable = profile.usable_bytes
    return {
        "required_gb": required / 1e9,
        "usable_gb": usable / 1e9,
        "memory_fraction": required / usable,
        "fits": required <= usable,
        "context": context,
        "batch": batch,
        "weights_gb": weight_bytes / 1e9,
        "kv_cache_gb": kv / 1e9,
        "overhead_gb": overhead_bytes / 1e9,
    }
