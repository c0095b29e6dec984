"""`compress plan`: estimated memory, time, artifact sizes and device fit of a recipe, before any
heavy work. Reads the model's config only (config.json, or GGUF metadata) and builds the model on
torch's ``meta`` device (shapes, no weights) to count parameters and select quantized layers.

Every number here is an estimate, labelled so: order-of-magnitude guidance, never a measurement.
Stage times use throughputs measured on this project's reference machine (2 CPU cores, torch 2.13
CPU, 2 threads, SmolLM2-135M), scaled by parameters and tokens; a faster CPU or a GPU is quicker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compress.errors import CompressError
from compress.eval.devices import LOCAL, estimate_latency, fit_check, get_profile, kv_bytes_per_token
from compress.eval.metrics import CHUNK_ELEMENTS, HEAD_SLICE_BYTES
from compress.eval.plan.artifacts import artifacts, check_group_sizes, compute_dtype, final_shape, model_shape, quantized_layers
from compress.eval.plan.estimates import (
    CPU_FORWARD_FLOPS,
    DISTILL_TOKENS_PER_S,
    EXPORT_BUILD_S,
    LIBRARY_BYTES,
    LOAD_BYTES_PER_S,
    REF_PARAMS,
    REFERENCE,
    RTN_WEIGHTS_PER_S,
    RUN_STATE_BYTES,
    TORCH_DECODE_TOKENS_PER_S,
    PlanStep,
    eval_bytes,
    largest_unit_bytes,
)
from compress.eval.plan.estimates import forward_s as _forward_s
from compress.eval.plan.shapes import DTYPE_BYTES, GB, ModelShape, Record
from compress.plugins import EXPORT_FORMATS, stage_kind, stage_streams
from compress.recipe import LoadedRecipe
from compress.schema.devices import DeviceProfile
from compress.schema.recipe import Recipe

# --------------------------------------------------------------------------- stages: memory and time


def stage_estimates(
    recipe: Recipe, shape: ModelShape, records: dict[str, Record], export_rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One row per step of the run: load, each stage, evaluation, each export (``export_rows``:
    the artifacts rows, which end with the exports in recipe order)."""
    dtype_name = compute_dtype(recipe.model, shape.config)
    dtype = DTYPE_BYTES[dtype_name]
    whole = shape.params * dtype
    unit = largest_unit_bytes(shape, dtype)
    cal = recipe.data.calibration
    rows = [
        {
            "step": "load model",
            "peak_memory_gb": (LIBRARY_BYTES + RUN_STATE_BYTES) / GB,
            "time_s": whole / LOAD_BYTES_PER_S,
            "basis": f"the libraries (~{LIBRARY_BYTES / GB:.1f} GB) and the run's state (~{RUN_STATE_BYTES / GB:.1f} GB): weights "
            f"stay on disk (the largest unit read later: {unit / GB:.2f} GB at {dtype_name}); reading the checkpoint's digest "
            f"at ~{LOAD_BYTES_PER_S / GB:.1f} GB/s",
        }
    ]

    def held_bytes(model: ModelShape, streamed: bool) -> float:
        """The libraries, the run's state, and one streamed unit or the whole model in memory."""
        return LIBRARY_BYTES + RUN_STATE_BYTES + (largest_unit_bytes(model, dtype) if streamed else model.params * dtype)

    cur = shape
    streamed = True  # the model streams until a stage that needs it whole reads it into memory
    for i, stage in enumerate(recipe.stages):
        cfg = stage.config
        label = f"stages[{i}] {stage.kind}" + (f" {cfg.method}" if hasattr(cfg, "method") else "")
        kind = stage_kind(stage.kind, f"stages[{i}]")  # each kind (and quantization method) holds its own formula
        streamed = streamed and stage_streams(stage)
        held = held_bytes(cur, streamed)
        step = PlanStep(cfg, cur, held, cal, kv_bytes_per_token(cur.config, dtype), records, dtype, streamed)
        est = kind.estimate(step)
        if kind.plan_shape is not None:
            cur = kind.plan_shape(cur, cfg)
        rows.append({"step": label, "peak_memory_gb": est.memory_bytes / GB, "time_s": est.seconds, "basis": est.basis})
    held = held_bytes(cur, streamed)
    where = "one streamed unit at a time" if streamed else "the compressed model in memory (a stage read it whole)"
    ev = recipe.data.evaluation
    if ev is not None:
        tokens = ev.samples * ev.seq_len
        models = 2 if recipe.stages else 1
        rows.append(
            {
                "step": "evaluate",
                "peak_memory_gb": (held + eval_bytes(cur, ev.batch_size, ev.seq_len, dtype)) / GB,
                "time_s": _forward_s(shape.params, tokens) + (_forward_s(cur.params, tokens) if recipe.stages else 0),
                "basis": f"the libraries, {where}, one batch's activations and hidden states, and logits a chunk of positions at "
                f"a time; {models} model(s) x {ev.samples} x {ev.seq_len} tokens at 2 x params FLOPs/token, ~{CPU_FORWARD_FLOPS / GB:.0f} GFLOPS",
            }
        )
    for export, art in zip(recipe.exports, export_rows[len(export_rows) - len(recipe.exports) :], strict=False):  # exports come last
        fmt = EXPORT_FORMATS[export.format]
        tokens = fmt.planned_verify_tokens(export, ev.samples if ev else 0, ev.seq_len if ev else 0)
        added, how = fmt.planned_memory_bytes(export, art["size_bytes"], cur, ev.seq_len if ev else 0)
        if tokens:  # the verifier scores the runtime against the baseline: logits a chunk of positions at a time
            added += 5 * CHUNK_ELEMENTS * 4
            how += ", and the scoring's logits a chunk of positions at a time"
        if streamed:  # written one unit at a time; verified with the heads read from disk by slices, no unit held
            peak = LIBRARY_BYTES + RUN_STATE_BYTES + max(largest_unit_bytes(cur, dtype), added + HEAD_SLICE_BYTES)
            how += " (the heads read from disk by slices: no unit beside the runtime)"
        else:
            peak = held + added
        rows.append(
            {
                "step": f"export {export.name} ({export.format})",
                "peak_memory_gb": peak / GB,
                "time_s": EXPORT_BUILD_S * cur.params / REF_PARAMS + _forward_s(cur.params, tokens),
                "basis": f"the libraries, {where}, and {how}; ~{EXPORT_BUILD_S:.0f} s "
                f"per 135M parameters to write and prove it + scoring {tokens:,} tokens on its runtime",
            }
        )
    return rows


# --------------------------------------------------------------------------- the plan


def _estimate(loaded: LoadedRecipe) -> tuple[ModelShape, ModelShape, dict[str, Record], list[dict[str, Any]], list[dict[str, Any]]]:
    """The model's shape before and after the stages, the quantized layers, the artifacts and the step rows."""
    recipe = loaded.recipe
    shape = model_shape(recipe.model, loaded.base_dir)
    final = final_shape(recipe, shape)
    check_group_sizes(recipe, final)
    records = quantized_layers(recipe, final)
    arts = artifacts(recipe, shape, final, records)
    return shape, final, records, arts, stage_estimates(recipe, shape, records, arts)


def run_estimate(loaded: LoadedRecipe) -> dict[str, Any]:
    """What `compress plan` predicts for a run of the recipe, from the model's config alone: peak
    host memory and time in total and for each phase of the run as ``compress run`` names them
    (load_model, stages, evaluate, exports: the peak of the phase's rows). The plan estimates host
    memory only (a CPU run), no device memory. Raises CompressError where `compress plan` would."""
    recipe = loaded.recipe
    steps = _estimate(loaded)[-1]
    n = len(recipe.stages)
    groups = {"load_model": steps[:1], "stages": steps[1 : 1 + n]}
    rest = steps[1 + n :]
    if recipe.data.evaluation is not None:
        groups["evaluate"], rest = rest[:1], rest[1:]
    groups["exports"] = rest
    return {
        "peak_memory_gb": max(r["peak_memory_gb"] for r in steps),
        "time_s": sum(r["time_s"] for r in steps),
        "phases": {phase: max(r["peak_memory_gb"] for r in rows) for phase, rows in groups.items() if rows},
    }


def plan_recipe(
    loaded: LoadedRecipe, devices: dict[str, DeviceProfile], targets: list[str], context: int | None = None, batch: int | None = None
) -> dict[str, Any]:
    """Estimates for one recipe: per-step memory and time, artifact sizes, and the fit of each
    artifact on each target device. ``targets`` empty: ``local`` (when in ``devices``) and the
    recipe's `targets:`, or every device when it has none. ``context``/``batch`` given: for every
    device; else a recipe target's own, else data.evaluation.seq_len (2048 without it) and 1."""
    recipe = loaded.recipe
    if (batch is not None and batch < 1) or (context is not None and context < 1):
        raise CompressError(f"--context and --batch must be positive (got context {context}, batch {batch})")
    if not targets:
        named = [t.device for t in recipe.targets]
        targets = ([LOCAL] if LOCAL in devices and LOCAL not in named else []) + named if named else list(devices)
    chosen = [get_profile(devices, n) for n in dict.fromkeys(targets)]
    shape, final, records, arts, steps = _estimate(loaded)
    fits = []
    for dev in chosen:
        ctx, n = _serving(recipe, dev.name, context, batch)
        prompt, output = (
            (recipe.latency.prompt_tokens, recipe.latency.output_tokens) if recipe.latency else (max(ctx // 2, 1), max(ctx - ctx // 2, 1))
        )
        for art in arts:
            s = shape if art["artifact"] == "baseline" else final
            per_token = kv_bytes_per_token(s.config, art["kv_bytes_per_element"])
            if art.get("kv_budget_tokens"):  # eviction: a head never holds more than its budget, whatever the context
                per_token = int(round(per_token * min(1.0, art["kv_budget_tokens"] / ctx)))
            fit = fit_check(dev, art["size_bytes"], per_token, ctx, n)
            lat = estimate_latency(dev, art["size_bytes"], per_token, s.params, prompt, output, n)
            fits.append(
                {
                    "device": dev.name,
                    "artifact": art["artifact"],
                    "format": art["format"],
                    "runtime": art["runtime"],
                    "size_mb": art["size_bytes"] / 2**20,
                    "kv_bytes_per_token": per_token,
                    **fit,
                    "supported": dev.supports(art["format"], art["runtime"]),
                    "prompt_tokens": prompt,
                    "output_tokens": output,
                    "ttft_ms": lat["ttft_ms"],
                    "decode_tokens_per_s": lat["decode_tokens_per_s"],
                    "batch_decode_tokens_per_s": lat["batch_decode_tokens_per_s"],
                    "decode_bound": lat["assumptions"]["decode_bound"],
                }
            )
    peak = max(r["peak_memory_gb"] for r in steps)
    local = devices.get(LOCAL)
    return {
        "source": "estimated",
        "recipe": {"name": recipe.name, "path": str(loaded.path)},
        "model": {
            "source": recipe.model.source,
            "config": shape.origin,
            "architecture": type(shape.model).__name__,
            "parameters": shape.params,
            "parameters_after_stages": final.params,
            "dtype": compute_dtype(recipe.model, shape.config),
            "quantized_layers": len(records),
        },
        "steps": steps,
        "total": {
            "time_s": sum(r["time_s"] for r in steps),
            "peak_memory_gb": peak,
            "fits_this_machine": None if local is None else peak * GB <= local.usable_bytes,
        },
        "artifacts": arts,
        "fit": fits,
        "devices": {d.name: d.model_dump() for d in chosen},
        "assumptions": {
            "times": REFERENCE,
            "cpu_forward_gflops": CPU_FORWARD_FLOPS / GB,
            "load_gb_per_s": LOAD_BYTES_PER_S / GB,
            "rtn_weights_per_s": RTN_WEIGHTS_PER_S,
            "distill_tokens_per_s_135m": DISTILL_TOKENS_PER_S,
            "torch_decode_tokens_per_s_135m": TORCH_DECODE_TOKENS_PER_S,
            "export_build_s_135m": EXPORT_BUILD_S,
            "fit": "weights + KV cache (context x batch tokens) <= memory_gb x usable_memory_fraction; activations and runtime "
            "buffers are not counted (usable_memory_fraction leaves room for them)",
            "latency": "roofline (eval/devices.py) at each row's prompt_tokens and output_tokens (the recipe's latency block, "
            "else half the context each)",
        },
    }


def _serving(recipe: Recipe, device: str, context: int | None, batch: int | None) -> tuple[int, int]:
    """(context, batch) of a device's fit check: the command line's, else the recipe target's, else defaults."""
    target = next((t for t in recipe.targets if t.device == device), None)
    default = recipe.data.evaluation.seq_len if recipe.data.evaluation else 2048
    if target is not None and target.context is None and recipe.latency is not None:
        default = recipe.latency.prompt_tokens + recipe.latency.output_tokens
    return (context or (target.context if target and target.context else default), batch or (target.batch if target else 1))


# --------------------------------------------------------------------------- output


def tables(plan: dict[str, Any]) -> list[Any]:
    """The plan as rich tables (steps, artifacts, device fit), every title saying estimated."""
    from rich import box
    from rich.table import Table

    def table(title: str, columns: list[tuple[str, str]]) -> Table:
        t = Table(title=f"estimated: {title}", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
        for name, justify in columns:
            t.add_column(name, justify=justify, no_wrap=name not in ("basis", "device"), overflow="fold")
        return t

    m = plan["model"]
    steps = table(
        f"{plan['recipe']['name'] or 'recipe'}: {m['architecture']}, {m['parameters']:,} parameters ({m['dtype']})",
        [("step", "left"), ("peak memory", "right"), ("time", "right"), ("basis", "left")],
    )
    for r in plan["steps"]:
        steps.add_row(r["step"], f"{r['peak_memory_gb']:.2f} GB", _duration(r["time_s"]), r["basis"])
    total = plan["total"]
    here = {None: "", True: "; fits this machine", False: "; [red]more than this machine's usable memory[/]"}[total["fits_this_machine"]]
    steps.add_row(
        "[bold]total[/]", f"{total['peak_memory_gb']:.2f} GB", _duration(total["time_s"]), "peak of the steps, sum of the times" + here
    )
    arts = table(
        "artifacts", [("artifact", "left"), ("format/runtime", "left"), ("size", "right"), ("bits/param", "right"), ("basis", "left")]
    )
    for a in plan["artifacts"]:
        arts.add_row(
            a["artifact"], f"{a['format']}/{a['runtime']}", f"{a['size_bytes'] / 2**20:,.1f} MiB", f"{a['bits_per_param']:.2f}", a["basis"]
        )
    fit = table(
        "fit: weights + KV cache at context x batch vs usable memory (GB); runs: the device runs the artifact's "
        "format and runtime; tok/s: roofline decode speed per sequence",
        [
            ("device", "left"),
            ("artifact", "left"),
            ("MiB", "right"),
            ("ctx x b", "right"),
            ("GB need/usable", "right"),
            ("fits", "left"),
            ("runs", "left"),
            ("tok/s", "right"),
        ],
    )
    for r in plan["fit"]:
        fit.add_row(
            r["device"],
            r["artifact"],
            f"{r['size_mb']:,.1f}",
            f"{r['context']:,}x{r['batch']}",
            f"{r['required_gb']:.3g}/{r['usable_gb']:.3g}",
            "[green]yes[/]" if r["fits"] else "[red]no[/]",
            "yes" if r["supported"] else "[yellow]no[/]",
            f"{r['decode_tokens_per_s']:,.0f}",
        )
    return [steps, arts, fit]


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s" if seconds >= 1 else f"{seconds:.1f} s"
    return f"{seconds / 60:.0f} min" if seconds < 3600 else f"{seconds / 3600:.1f} h"


def write_plan(path: Path, plan: dict[str, Any]) -> None:
    """Write the plan as JSON atomically (a temporary file next to it, then a rename)."""
    import json
    import os
    import tempfile

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(plan, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        raise CompressError(f"cannot write the plan to {path}: {exc}") from None
