"""TensorRT engines from the Q/DQ ONNX (``export/tensorrt/qdq.py``): build, describe, run.

* ``TensorRTConfig`` (in ``export/tensorrt/config.py``) — the optimization profile (min/opt/max of batch, sequence and
  past length), workspace limit and timing cache; validated at construction.
* ``profile_shapes`` — pure: the (min, opt, max) shape of every network input from its axis
  names (``batch``, ``sequence``, ``past_sequence``, ``total_sequence`` = past + sequence).
* ``build_engine`` — strongly typed network (precisions come from the ONNX graph's own types and
  Q/DQ nodes; TensorRT 11 removed the FP16/INT8/FP8 builder flags, so none is ever set), parsed
  from the file so external data next to it is found; writes ``engine.plan`` and ``engine.json``.
* ``EngineRunner`` — deserializes a plan and runs it on torch CUDA tensors.

TensorRT is imported inside the functions: it needs an NVIDIA GPU and is an optional install.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compress.errors import FormatError
from compress.export.tensorrt.config import TensorRTConfig
from compress.export.tensorrt.qdq import MODEL_FILE
from compress.fsutil import sha256_file

ENGINE_FILE = "engine.plan"
ENGINE_INFO_FILE = "engine.json"
TIMING_CACHE_FILE = "timing.cache"
INSTALL_HINT = "pip install tensorrt (needs an NVIDIA GPU)"

Shape = tuple[int, ...]


# --------------------------------------------------------------------------- pure shape logic


def onnx_input_axes(path: Path) -> dict[str, list[int | str]]:
    """Each graph input's axes: an int for a fixed size, the axis name for a dynamic one (no weights loaded)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {i.name for i in graph.initializer}
    axes = {}
    for value in graph.input:
        if value.name in initializers:
            continue
        axes[value.name] = [d.dim_param if d.dim_param else int(d.dim_value) for d in value.type.tensor_type.shape.dim]
    return axes


def profile_shapes(inputs: dict[str, list[int | str]], config: TensorRTConfig) -> dict[str, tuple[Shape, Shape, Shape]]:
    """(min, opt, max) shape of every input, from its axis names and the config's ranges."""
    ranges = config.axis_ranges()
    shapes = {}
    for name, axes in inputs.items():
        picked: list[tuple[int, int, int]] = []
        for i, axis in enumerate(axes):
            if isinstance(axis, int) and axis > 0:
                picked.append((axis, axis, axis))
            elif isinstance(axis, str) and axis in ranges:
                r = ranges[axis]
                picked.append((r.min, r.opt, r.max))
            else:
                raise FormatError(f"input {name} axis {i} is '{axis}': expected a fixed size or one of {', '.join(ranges)}")
        shapes[name] = tuple(tuple(p[k] for p in picked) for k in range(3))  # type: ignore[assignment]
    return shapes


# --------------------------------------------------------------------------- availability


def tensorrt_unavailable_reason() -> str | None:
    """Why an engine cannot be built here, or None when TensorRT and a CUDA GPU are both present."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return f"tensorrt is not installed: {INSTALL_HINT}"
    if not torch.cuda.is_available():
        return "no CUDA GPU: torch.cuda.is_available() is False"
    return None


def _require_tensorrt() -> Any:
    reason = tensorrt_unavailable_reason()
    if reason is not None:
        raise FormatError(f"cannot build a TensorRT engine: {reason}")
    import tensorrt as trt

    return trt


# --------------------------------------------------------------------------- building


def _write_atomic(path: Path, data: bytes | memoryview) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_engine(onnx_dir: Path, directory: Path, config: TensorRTConfig) -> dict[str, Any]:
    """Build ``directory/engine.plan`` from ``onnx_dir/model.onnx`` (+ its external data); return the facts
    also written to ``directory/engine.json``. Raises FormatError saying why when TensorRT cannot run here."""
    trt = _require_tensorrt()
    onnx_path = Path(onnx_dir) / MODEL_FILE
    if not onnx_path.exists():
        raise FormatError(f"{onnx_path} does not exist: write the Q/DQ ONNX first")
    shapes = profile_shapes(onnx_input_axes(onnx_path), config)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cache_path = config.timing_cache or directory / TIMING_CACHE_FILE

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise FormatError(f"TensorRT could not parse {onnx_path}: " + "; ".join(errors[:5]))
    network_inputs = [network.get_input(i).name for i in range(network.num_inputs)]
    missing = sorted(set(network_inputs) - set(shapes))
    if missing:
        raise FormatError(f"{onnx_path}: network inputs {missing} have no axis names in the ONNX graph")

    builder_config = builder.create_builder_config()
    builder_config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, config.workspace_mib << 20)
    cache_loaded = cache_path.exists()
    cache = builder_config.create_timing_cache(cache_path.read_bytes() if cache_loaded else b"")
    builder_config.set_timing_cache(cache, ignore_mismatch=False)
    profile = builder.create_optimization_profile()
    for name in network_inputs:
        profile.set_shape(name, *shapes[name])
    builder_config.add_optimization_profile(profile)

    start = time.perf_counter()
    plan = builder.build_serialized_network(network, builder_config)
    seconds = time.perf_counter() - start
    if plan is None:
        raise FormatError(f"TensorRT failed to build an engine from {onnx_path} (see the TensorRT log above)")
    _write_atomic(directory / ENGINE_FILE, memoryview(plan))
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(cache_path, memoryview(builder_config.get_timing_cache().serialize()))
    facts = {
        "engine": ENGINE_FILE,
        "engine_bytes": (directory / ENGINE_FILE).stat().st_size,
        "engine_sha256": sha256_file(directory / ENGINE_FILE),
        "onnx": str(onnx_path),
        "tensorrt_version": trt.__version__,
        "device": torch.cuda.get_device_name(),
        "strongly_typed": True,
        "build_seconds": round(seconds, 3),
        "workspace_mib": config.workspace_mib,
        "timing_cache": {"path": str(cache_path), "loaded": cache_loaded},
        "profiles": [
            {name: {"min": list(s[0]), "opt": list(s[1]), "max": list(s[2])} for name, s in shapes.items() if name in network_inputs}
        ],
    }
    _write_atomic(directory / ENGINE_INFO_FILE, (json.dumps(facts, indent=2) + "\n").encode())
    return facts


# --------------------------------------------------------------------------- running


_TORCH_DTYPES = {
    "FLOAT": torch.float32,
    "HALF": torch.float16,
    "BF16": torch.bfloat16,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "INT8": torch.int8,
    "UINT8": torch.uint8,
    "BOOL": torch.bool,
    "FP8": torch.float8_e4m3fn,
}


def torch_dtype(trt: Any, dtype: Any) -> torch.dtype:
    """The torch dtype of a TensorRT I/O tensor type (by member name: older releases lack some members)."""
    for name, torch_type in _TORCH_DTYPES.items():
        if getattr(trt.DataType, name, None) == dtype:
            return torch_type
    raise FormatError(f"engine tensor type {dtype} has no torch equivalent")


class EngineRunner:
    """Runs a built engine: ``runner(inputs) -> outputs`` with torch CUDA tensors as device memory."""

    def __init__(self, plan_path: Path, device: int = 0) -> None:
        trt = _require_tensorrt()
        self._trt = trt
        self.device = torch.device("cuda", device)
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(Path(plan_path).read_bytes())
        if self.engine is None:
            raise FormatError(f"TensorRT could not deserialize {plan_path} (built by another TensorRT version or GPU?)")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        is_input = {n: self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT for n in names}
        self.inputs = [n for n in names if is_input[n]]
        self.outputs = [n for n in names if not is_input[n]]
        self.dtypes = {n: torch_dtype(trt, self.engine.get_tensor_dtype(n)) for n in names}

    def __call__(self, inputs: dict[str, np.ndarray | torch.Tensor]) -> dict[str, torch.Tensor]:
        missing = sorted(set(self.inputs) - set(inputs))
        if missing:
            raise FormatError(f"engine inputs missing: {missing}")
        keep = []  # device buffers must outlive the launch
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream(self.device)
            for name in self.inputs:
                value = inputs[name]
                tensor = torch.from_numpy(np.ascontiguousarray(value)) if isinstance(value, np.ndarray) else value
                tensor = tensor.to(self.device, self.dtypes[name]).contiguous()
                keep.append(tensor)
                if not self.context.set_input_shape(name, tuple(tensor.shape)):
                    raise FormatError(f"input {name} shape {tuple(tensor.shape)} is outside the engine's profile")
                self.context.set_tensor_address(name, self._address(tensor, keep))
            outputs = {}
            for name in self.outputs:
                shape = tuple(self.context.get_tensor_shape(name))
                outputs[name] = torch.empty(shape, dtype=self.dtypes[name], device=self.device)
                self.context.set_tensor_address(name, self._address(outputs[name], keep))
            if not self.context.execute_async_v3(stream.cuda_stream):
                raise FormatError("TensorRT execution failed (see the TensorRT log above)")
            stream.synchronize()
        return outputs

    def _address(self, tensor: torch.Tensor, keep: list[torch.Tensor]) -> int:
        """A valid device address even for an empty tensor (a prefill's zero-length past)."""
        if tensor.numel():
            return tensor.data_ptr()
        stub = torch.empty(1, dtype=torch.uint8, device=self.device)
        keep.append(stub)
        return stub.data_ptr()
