"""Latency of an artifact on its own runtime: time to first token, time per output token, decode
tokens/s, peak memory, and how much of the host's memory bandwidth a decoded token uses.

Every measurement runs in a fresh worker process (``python -m compress.eval.latency``), one per
artifact and runtime, so that

* the peak resident memory is the runtime's own (the parent holds torch models of its own),
* runtimes do not share thread pools or caches, and a crash in a native runtime is an error
  message rather than a dead pipeline.

Protocol, the same for every runtime: the prompt is ``prompt_tokens`` real tokens (rows of the
evaluation text when given; else seeded random ids below 256, which every byte-level vocabulary
has), then ``output_tokens`` greedy steps with no stop at end-of-text.
TTFT is the prompt's forward plus picking the first token; a decode step is one token's forward
plus picking the next one. ``warmup`` unmeasured runs, then ``repeats`` measured runs; medians and
90th percentiles are over runs (a run's time per token is the mean of its steps).

Bandwidth utilisation = bytes read per decoded token / time per token / the host's measured
bandwidth. Bytes read per token = the weights a decode step reads (lookup tables such as an
untied token embedding read one row and are left out) + the KV cache at the run's mean context.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from compress.errors import CompressError
from compress.export.format import TORCH_RUNTIME, Runner
from compress.fsutil import tree_size
from compress.inputs import SAFETENSORS_ITEMSIZE, check_safetensors
from compress.paths import usable_cpus
from compress.plugins import runtime_formats


def runtimes() -> tuple[str, ...]:
    """torch, then the runtime of every export format that has one of its own (compress.plugins)."""
    return (TORCH_RUNTIME, *runtime_formats())


@dataclass
class LatencySettings:
    prompt_tokens: int = 128
    output_tokens: int = 64
    batch_sizes: tuple[int, ...] = (1, 4)
    warmup: int = 1
    repeats: int = 5
    threads: int = field(default_factory=usable_cpus)


@dataclass
class Target:
    """What one worker measures: ``path`` is a GGUF file (llama.cpp), an ONNX Runtime GenAI
    directory (onnxruntime), a Hugging Face model directory (torch) or an engine directory (tensorrt)."""

    runtime: str
    path: str
    device: str = "cpu"


# --------------------------------------------------------------------------- the parent side


def measure(target: Target, settings: LatencySettings, prompts: np.ndarray, timeout_s: float = 1800) -> dict[str, Any]:
    """Run one worker process and return its result: per batch size, the medians and p90s, the
    peak RSS, the bytes read per token. ``prompts`` [rows, >= prompt_tokens] int token ids."""
    if target.runtime not in runtimes():
        raise CompressError(f"latency: unknown runtime '{target.runtime}'; known: {', '.join(runtimes())}")
    rows = max(settings.batch_sizes)
    if prompts.ndim != 2 or prompts.shape[1] < settings.prompt_tokens:
        raise CompressError(f"latency: prompts must be [rows, >= {settings.prompt_tokens}] token ids; got {tuple(prompts.shape)}")
    if prompts.shape[0] < rows:  # repeat rows to fill the largest batch
        prompts = np.concatenate([prompts] * (rows // prompts.shape[0] + 1))
    job = {
        "target": asdict(target),
        "settings": asdict(settings),
        "prompts": prompts[:rows, : settings.prompt_tokens].astype(np.int64).tolist(),
    }
    env = {**os.environ, "OMP_NUM_THREADS": str(settings.threads)}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "compress.eval.latency"],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
    except subprocess.TimeoutExpired:
        raise CompressError(f"latency: the {target.runtime} worker on {target.path} ran past {timeout_s:.0f} s") from None
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-8:])
        raise CompressError(f"latency: the {target.runtime} worker on {target.path} failed (exit {done.returncode}):\n{tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def latency_metrics(result: dict[str, Any], bandwidth_gbs: float | None) -> dict[str, float]:
    """The gateable metrics of a worker result (batch 1, plus the largest batch measured)."""
    one = result["batches"]["1"]
    metrics = {
        "ttft_ms": one["ttft_ms"],
        "ttft_ms_p90": one["ttft_ms_p90"],
        "tpot_ms": one["tpot_ms"],
        "tpot_ms_p90": one["tpot_ms_p90"],
        "decode_tokens_per_s": one["decode_tokens_per_s"],
        "peak_rss_mb": result["peak_rss_mb"],
        "size_mb": result["size_bytes"] / 2**20,
    }
    larger = [int(b) for b in result["batches"] if int(b) > 1]
    if larger:
        metrics["batch_decode_tokens_per_s"] = result["batches"][str(max(larger))]["decode_tokens_per_s"]
    if result.get("gpu_peak_mb") is not None:
        metrics["gpu_peak_mb"] = result["gpu_peak_mb"]
    if bandwidth_gbs:
        metrics["bandwidth_utilization"] = one["bytes_per_token"] / (one["tpot_ms"] / 1e3) / (bandwidth_gbs * 1e9)
    return metrics


# --------------------------------------------------------------------------- runners (in the worker)


class _TorchRunner(Runner):
    def __init__(self, path: Path, device: str, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self.torch, self.device = torch, torch.device(device)
        self.model = load_torch_model(path).to(self.device).eval()
        self.size_bytes = tree_size(model_folder(path))
        tied = self.model.get_input_embeddings().weight is self.model.get_output_embeddings().weight
        params = {id(p): p for p in self.model.parameters()}.values()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in params)
        if not tied:
            emb = self.model.get_input_embeddings().weight
            self.weight_bytes -= emb.numel() * emb.element_size()
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv_bytes_per_position = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * self.model.dtype.itemsize

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def run(self, prompts: np.ndarray, steps: int) -> tuple[float, list[float]]:
        torch = self.torch
        ids = torch.from_numpy(prompts).to(self.device)
        times = []
        with torch.inference_mode():
            self._sync()
            start = time.perf_counter()
            out = self.model(input_ids=ids, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            self._sync()
            ttft = time.perf_counter() - start
            cache = out.past_key_values
            for _ in range(steps - 1):
                start = time.perf_counter()
                out = self.model(input_ids=nxt, past_key_values=cache, use_cache=True)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                self._sync()
                times.append(time.perf_counter() - start)
                cache = out.past_key_values
        return ttft, times


def static_bytes(target: Target) -> tuple[int, int, int]:
    """(weights a decode step reads, KV bytes per position, size on disk) from the files alone,
    without loading a runtime: what the estimates for other devices use when nothing was timed."""
    path = Path(target.path)
    if target.runtime == TORCH_RUNTIME:
        return _torch_bytes(path)
    return runtime_formats()[target.runtime].static_bytes(path)


RECORD_SUFFIXES = (".weight_scale", ".weight_zero_point")  # a quantized layer's scales and zero points (its codes count as its weights)
# Tensors of a quantized layer in our artifact, in either weights layout (packed, with a float copy
# when it fell back to the records file; or the earlier unpacked records): none is a float weight.
QUANTIZED_LAYER_TENSORS = ("weight", "weight_codes", "weight_scale", "weight_zero_point", "weight_packed", "weight_shape")
FALLBACK_RECORDS = "fallback-records.safetensors"  # compress.artifact.RECORDS_FILE (this module stays torch-free)


def model_folder(path: Path) -> Path:
    """The Hugging Face folder of a torch target: model/ of our artifact directory, else the folder itself."""
    return path / "model" if (path / "manifest.json").is_file() else path


def quantized_shapes(path: Path) -> dict[str, tuple[int, int]]:
    """[out, in] of every quantized layer of our artifact directory (its manifest); {} for any other folder."""
    if not (path / "manifest.json").is_file():
        return {}
    layers = (json.loads((path / "manifest.json").read_text()).get("quantization") or {}).get("layers") or {}
    return {name: (int(info["shape"][0]), int(info["shape"][1])) for name, info in layers.items()}


def float_entries(path: Path) -> Iterator[tuple[str, int, str]]:
    """safetensors_entries of a torch target's folder less the quantized layers' tensors (our
    artifact: by the manifest's layers, whatever the layout; another folder: scales and zero points)."""
    layers = quantized_shapes(path)
    for key, numel, dtype in safetensors_entries(model_folder(path)):
        layer, _, suffix = key.rpartition(".")
        if (layer in layers and suffix in QUANTIZED_LAYER_TENSORS) or (not layers and key.endswith(RECORD_SUFFIXES)):
            continue
        yield key, numel, dtype


def load_torch_model(path: Path, dtype: Any = None) -> Any:
    """Our artifact directory (quantized layers dequantized: torch computes in float) or a Hugging
    Face folder (in ``dtype``, else transformers' default), in eval mode."""
    if (path / "manifest.json").is_file():
        from compress.artifact import load_artifact

        return load_artifact(path)[0]
    from compress.integrity import from_pretrained_checked

    return from_pretrained_checked(path, **({} if dtype is None else {"dtype": dtype})).eval()


def safetensors_entries(folder: Path) -> Iterator[tuple[str, int, str]]:
    """(name, element count, safetensors dtype) of every tensor in the folder's .safetensors files,
    from their checked headers (no tensor is read)."""
    for file in sorted(folder.glob("*.safetensors")):
        for key, entry in sorted(check_safetensors(file).items()):
            if key != "__metadata__":
                yield key, math.prod(entry["shape"]), entry["dtype"]


def _torch_bytes(path: Path) -> tuple[int, int, int]:
    """torch computes in the float dtype: every weight (a quantized layer counts its codes' count)
    at 4 bytes for our artifact (loaded as float32), else at the checkpoint's own dtype."""
    model_dir = model_folder(path)
    config = json.loads((model_dir / "config.json").read_text())
    total = sum(out_f * in_f * 4 for out_f, in_f in quantized_shapes(path).values())
    for key, numel, dtype in float_entries(path):
        itemsize = 4 if model_dir is not path else SAFETENSORS_ITEMSIZE.get(dtype, 4)
        untied_lookup = key.endswith("embed_tokens.weight") and not config.get("tie_word_embeddings", False)
        total += 0 if untied_lookup else numel * itemsize  # an untied embedding is a lookup: one row per token
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv = 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * 4
    fallback = path / FALLBACK_RECORDS if model_dir is not path else None
    return total, kv, tree_size(model_dir) + (fallback.stat().st_size if fallback is not None and fallback.is_file() else 0)


def parameter_count(target: Target) -> int | None:
    """Weights of the model in the files (for prefill compute estimates): safetensors shapes (a
    quantized layer counts its codes), GGUF tensor elements, ONNX initializers with each
    MatMulNBits counted as its K x N weights; None for a TensorRT engine."""
    path = Path(target.path)
    if target.runtime == TORCH_RUNTIME:
        return sum(numel for _, numel, _ in float_entries(path)) + sum(o * i for o, i in quantized_shapes(path).values())
    return runtime_formats()[target.runtime].parameter_count(path)


def _load(target: Target, settings: LatencySettings) -> Runner:
    path = Path(target.path)
    if target.runtime == TORCH_RUNTIME:
        return _TorchRunner(path, target.device, settings.threads)
    return runtime_formats()[target.runtime].runner(path, settings.threads, settings.prompt_tokens + settings.output_tokens)


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def _worker(job: dict[str, Any]) -> dict[str, Any]:
    from compress.eval.memory import PeakRSS

    target, settings = Target(**job["target"]), LatencySettings(**{**job["settings"], "batch_sizes": tuple(job["settings"]["batch_sizes"])})
    prompts = np.asarray(job["prompts"], dtype=np.int64)
    with PeakRSS() as rss:
        started = time.perf_counter()
        runner = _load(target, settings)
        load_s = time.perf_counter() - started
        batches: dict[str, Any] = {}
        skipped = {}
        context = settings.prompt_tokens + settings.output_tokens / 2  # mean context over the decode steps
        for batch in settings.batch_sizes:
            if runner.max_batch is not None and batch > runner.max_batch:
                skipped[str(batch)] = runner.batch_note or f"the runtime decodes at most {runner.max_batch}"
                continue
            rows = prompts[:batch]
            for _ in range(settings.warmup):
                runner.run(rows, settings.output_tokens)
            ttfts, tpots = [], []
            for _ in range(settings.repeats):
                ttft, steps = runner.run(rows, settings.output_tokens)
                ttfts.append(ttft * 1e3)
                tpots.append(float(np.mean(steps)) * 1e3)
            tpot = _percentile(tpots, 50)
            batches[str(batch)] = {
                "ttft_ms": _percentile(ttfts, 50),
                "ttft_ms_p90": _percentile(ttfts, 90),
                "tpot_ms": tpot,
                "tpot_ms_p90": _percentile(tpots, 90),
                "decode_tokens_per_s": batch * 1e3 / tpot,
                "bytes_per_token": runner.weight_bytes + batch * runner.kv_bytes_per_position * context,
                "ttft_runs_ms": ttfts,
                "tpot_runs_ms": tpots,
            }
    gpu_peak = None
    if target.device.startswith("cuda"):  # torch or a CUDA runtime
        import torch

        gpu_peak = torch.cuda.max_memory_allocated() / 2**20
    return {
        "batches": batches,
        "skipped_batches": skipped,
        "load_s": load_s,
        "peak_rss_mb": rss.peak_mb,
        "rss_before_load_mb": rss.start_mb,
        "gpu_peak_mb": gpu_peak,
        "size_bytes": runner.size_bytes,
        "weight_bytes_per_token": runner.weight_bytes,
        "kv_bytes_per_position": runner.kv_bytes_per_position,
    }


if __name__ == "__main__":
    result = _worker(json.loads(sys.stdin.read()))
    sys.stdout.write("\n" + json.dumps(result) + "\n")
