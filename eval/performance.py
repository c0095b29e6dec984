"""Latency and memory evaluations of a set of artifacts: measured on this machine (eval/latency.py,
one worker process per artifact and runtime), and estimated for every other device a gate or a
target names (eval/devices.py roofline and fit check), each evaluation saying which it is.

An estimate is never presented as a measurement: its ``source`` is ``estimated``, and a gate on
it reports ``source: estimated`` in report.json, JUnit and the Markdown summary.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Any

import numpy as np

from compress.eval import devices as dev
from compress.eval.latency import LatencySettings, Target, latency_metrics, measure, static_bytes
from compress.eval.metrics import Evaluation
from compress.progress import Reporter
from compress.schema.devices import DeviceProfile
from compress.schema.metrics import LATENCY_METRICS
from compress.schema.recipe import BASELINE_THRESHOLDS


@dataclass
class Timed:
    """One artifact to time: its name in gates and reports, and where its runtime finds it."""

    name: str
    target: Target


def this_machine_is(profile: DeviceProfile, cuda_name: str | None) -> bool:
    """Whether measurements here stand for ``profile``: its ``identify`` strings name this
    machine's GPU (for GPU profiles) or CPU model (others)."""
    here = (cuda_name if profile.kind == "gpu" else dev.cpu_model()) or ""
    return any(token.lower() in here.lower() for token in getattr(profile, "identify", []))


def cuda_device_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def measure_all(
    timed: list[Timed], settings: LatencySettings, prompts: np.ndarray, reporter: Reporter
) -> tuple[list[Evaluation], dict[str, Any]]:
    """Time every artifact on its runtime here; returns the latency evaluations and the host facts
    (memory bandwidth measured on each device the targets run on, threads, CPU/GPU names). Each
    artifact's bandwidth utilisation is against the memory its runtime reads: the GPU's for a
    CUDA target, else the CPU's."""
    devices = sorted({"cpu"} | {item.target.device for item in timed})
    with reporter.status("measuring this machine's memory bandwidth"):
        bandwidth = {d: dev.measure_bandwidth(d) for d in devices}
    gpu = cuda_device_name() if "cuda" in devices else None
    host = {
        "bandwidth_gbs": bandwidth["cpu"]["bandwidth_gbs"],
        "bandwidth": bandwidth,
        "cpu": dev.cpu_model(),
        "gpu": gpu,
        "threads": settings.threads,
        "platform": platform.platform(),
    }
    evaluations = []
    for item in timed:
        with reporter.status(
            f"timing {item.name} on {item.target.runtime} ({settings.repeats} runs x {settings.output_tokens} tokens, "
            f"prompt {settings.prompt_tokens})"
        ):
            result = measure(item.target, settings, prompts)
        gbs = bandwidth[item.target.device]["bandwidth_gbs"]
        details = {
            "prompt_tokens": settings.prompt_tokens,
            "output_tokens": settings.output_tokens,
            "warmup": settings.warmup,
            "repeats": settings.repeats,
            "threads": settings.threads,
            "batches": result["batches"],
            "skipped_batches": result["skipped_batches"],
            "load_s": result["load_s"],
            "rss_before_load_mb": result["rss_before_load_mb"],
            "weight_bytes_per_token": result["weight_bytes_per_token"],
            "kv_bytes_per_position": result["kv_bytes_per_position"],
            "size_bytes": result["size_bytes"],
            "bandwidth_gbs": gbs,
            "worker": "one fresh process per artifact and runtime",
        }
        device = gpu if item.target.device == "cuda" and gpu else item.target.device
        evaluations.append(
            Evaluation(
                artifact=item.name,
                runtime=item.target.runtime,
                device=device,
                kind="latency",
                metrics=latency_metrics(result, gbs),
                details=details,
            )
        )
    return evaluations, host


def device_evaluations(
    profiles: dict[str, DeviceProfile],
    wanted: dict[str, tuple[int, int]],
    timed: list[Timed],
    measured: list[Evaluation],
    settings: LatencySettings | None,
    params: int,
) -> list[Evaluation]:
    """For each wanted device (name -> (context, batch) of its fit check) and each timed artifact
    whose format the device runs: a memory evaluation (fit check) and a latency evaluation —
    the measured one when this machine is that device, else a roofline estimate."""
    cuda_name = cuda_device_name()
    out: list[Evaluation] = []
    for name, (context, batch) in wanted.items():
        if name == dev.LOCAL:
            continue
        profile = dev.get_profile(profiles, name)
        here = this_machine_is(profile, cuda_name)
        for item in timed:
            runtime = item.target.runtime
            if runtime not in profile.runtimes:
                continue
            local = next((e for e in measured if e.artifact == item.name and e.runtime == runtime), None)
            weights, kv_per_pos, size = _bytes(item, local)
            fit = dev.fit_check(profile, weights, kv_per_pos, context, batch)
            basis = {
                "weight_bytes": weights,
                "kv_bytes_per_position": kv_per_pos,
                "size_bytes": size,
                **fit,
                "formula": "(weights + KV cache at context x batch) / (memory_gb x usable_memory_fraction)",
            }
            out.append(
                Evaluation(
                    artifact=item.name,
                    runtime=runtime,
                    device=name,
                    kind="memory",
                    source="estimated",
                    profile=name,
                    metrics={"memory_fraction": fit["memory_fraction"], "size_mb": size / 2**20},
                    details=basis,
                )
            )
            if settings is None:
                continue
            if here and local is not None:
                out.append(
                    Evaluation(
                        artifact=item.name,
                        runtime=runtime,
                        device=local.device,
                        kind="latency",
                        profile=name,
                        metrics=dict(local.metrics),
                        details={**(local.details or {}), "profile_identified_as": name},
                    )
                )
                continue
            est = dev.estimate_latency(profile, weights, kv_per_pos, params, settings.prompt_tokens, settings.output_tokens, 1)
            metrics = {k: est[k] for k in ("ttft_ms", "tpot_ms", "decode_tokens_per_s")}  # batch 1, as measured here
            batch = max(settings.batch_sizes)
            if batch > 1:
                metrics["batch_decode_tokens_per_s"] = dev.estimate_latency(
                    profile, weights, kv_per_pos, params, settings.prompt_tokens, settings.output_tokens, batch
                )["batch_decode_tokens_per_s"]
            out.append(
                Evaluation(
                    artifact=item.name,
                    runtime=runtime,
                    device=name,
                    kind="latency",
                    source="estimated",
                    profile=name,
                    metrics=metrics,
                    details={"assumptions": est["assumptions"], "roofline": True},
                )
            )
    return out


def _bytes(item: Timed, local: Evaluation | None) -> tuple[int, int, int]:
    if local is not None and local.details:
        d = local.details
        return int(d["weight_bytes_per_token"]), int(d["kv_bytes_per_position"]), int(d["size_bytes"])
    return static_bytes(item.target)


def baseline_timed(latency: Any, gates: list[Any]) -> bool:
    """Whether the baseline is timed too: named in ``latency.artifacts``, or (by default) when a
    gate asks a latency metric of it or compares one with it."""
    if latency is None:
        return False
    if latency.artifacts is not None:
        return "baseline" in latency.artifacts
    return any(g.metric in LATENCY_METRICS and (g.artifact == "baseline" or g.threshold_kind in BASELINE_THRESHOLDS) for g in gates)


def wanted_devices(latency: Any, targets: list[Any], gates: list[Any]) -> dict[str, tuple[int, int]]:
    """Devices to evaluate for (targets, and gates naming one), with the context and batch of their
    fit check: a target's own, else the latency run's prompt + output tokens (2048 without one), batch 1."""
    default_context = latency.prompt_tokens + latency.output_tokens if latency is not None else 2048
    wanted = {t.device: (t.context or default_context, t.batch) for t in targets}
    for gate in gates:
        if gate.device is not None and gate.device not in wanted:
            wanted[gate.device] = (default_context, 1)
    return wanted
