"""`compress plan`: estimated memory, time, artifact sizes and device fit of a recipe, before any
heavy work. Reads the model's config only (config.json, or GGUF metadata) and builds the model on
torch's ``meta`` device (shapes, no weights) to count parameters and select quantized layers.

Every number here is an estimate, labelled so: order-of-magnitude guidance, never a measurement.
Stage times use throughputs measured on this project's reference machine (2 CPU cores, torch 2.13
CPU, 2 threads, SmolLM2-135M), scaled by parameters and tokens; a faster CPU or a GPU is quicker.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from compress.errors import CompressError
from compress.eval.devices import LOCAL, DeviceProfile, estimate_latency, fit_check, get_profile, kv_bytes_per_token
from compress.eval.plan_sizes import (
    DTYPE_BYTES,
    GB,
    ModelShape,
    Record,
    artifacts,
    check_group_sizes,
    final_shape,
    model_shape,
    pruned_shape,
    quantized_layers,
)
from compress.plugins import EXPORT_FORMATS
from compress.recipe import LoadedRecipe, Recipe

# Measured on the reference machine (README "Measured" sections, docs/bench/*.json, out/manifest.json).
REFERENCE = "rough numbers of this project's 2-core CPU (torch 2.13, 2 threads); other machines differ"
REF_PARAMS = 134_515_008  # SmolLM2-135M
CPU_FORWARD_FLOPS = 160e9  # quickstart evaluation: 2 models x 32 x 512 tokens in 54 s (2 x params FLOPs/token)
LOAD_BYTES_PER_S = 0.2e9  # the 538 MB float32 model (cached conversion) loaded in 2.7 s
RTN_WEIGHTS_PER_S = 1.0e8  # RTN: 106M weights in ~1.0 s
DISTILL_TOKENS_PER_S = {"bf16": 250.0, "fp32": 124.0}  # distillation training of the 135M model
TORCH_DECODE_TOKENS_PER_S = 18.0  # token-by-token torch decoding with a DynamicCache, 135M model, fp32
EXPORT_BUILD_S = 60.0  # writing and proving one export file of the 135M model, without scoring it (onnx.yaml: ~110 s per export)


# --------------------------------------------------------------------------- stages: memory and time


def _forward_s(params: int, tokens: float) -> float:
    return 2 * params * tokens / CPU_FORWARD_FLOPS


def _activation_bytes(shape: ModelShape, batch: int, seq: int) -> float:
    """One inference forward pass of ``batch`` x ``seq`` tokens: one block's live tensors, its
    attention scores, and float32 logits + log-probabilities."""
    t = shape.text
    block = batch * seq * (4 * t.hidden_size + 3 * t.intermediate_size) * 4
    scores = batch * t.num_attention_heads * seq * seq * 4
    return block + scores + 2 * batch * seq * t.vocab_size * 4


def _training_bytes(shape: ModelShape, batch: int, seq: int, bf16: bool) -> float:
    """Activations kept for backward, s*b*h*(34 + 5*a*s/h) bytes per layer at 16 bits (Korthikanti
    et al. 2022; x2 in float32), plus teacher and student logits, log-probabilities and their gradient."""
    t = shape.text
    per_layer = seq * batch * t.hidden_size * (34 + 5 * t.num_attention_heads * seq / t.hidden_size)
    return t.num_hidden_layers * per_layer * (1 if bf16 else 2) + 4 * batch * seq * t.vocab_size * 4


def stage_estimates(
    recipe: Recipe, shape: ModelShape, records: dict[str, Record], export_rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One row per step of the run: load, each stage, evaluation, each export (``export_rows``:
    the artifacts rows, which end with the exports in recipe order)."""
    dtype = DTYPE_BYTES[recipe.model.dtype]
    base = shape.params * dtype  # the baseline stays in memory for the whole run
    cal = recipe.data.calibration
    cal_tokens = cal.samples * cal.seq_len if cal else 0
    copies = "baseline + working copy" if recipe.stages else "the model"
    rows = [
        {
            "step": "load model",
            "peak_memory_gb": (2 if recipe.stages else 1) * base / GB,
            "time_s": base / LOAD_BYTES_PER_S,
            "basis": f"{copies} at {recipe.model.dtype} ({shape.params:,} parameters); reading at ~{LOAD_BYTES_PER_S / GB:.1f} GB/s",
        }
    ]
    cur = shape
    for i, stage in enumerate(recipe.stages):
        cfg = stage.config
        label = f"stages[{i}] {stage.kind}" + (f" {cfg.method}" if hasattr(cfg, "method") else "")
        held = base + cur.params * dtype
        if stage.kind == "prune":
            passes = 1 + (cur.text.num_hidden_layers if cfg.layers and cfg.layers.metric == "kl" else 0)
            mem, secs = held + _activation_bytes(cur, cfg.batch_size, cal.seq_len), passes * _forward_s(cur.params, cal_tokens)
            basis = (
                f"baseline + working copy + one forward of {cfg.batch_size} x {cal.seq_len} tokens; "
                f"{passes} pass(es) over {cal_tokens:,} calibration tokens"
            )
            cur = pruned_shape(cur, cfg)
        elif stage.kind == "distill":
            bf16 = cfg.autocast == "bf16"
            trainable = cur.params - (cur.frozen_params() if cfg.train == "blocks" else 0)
            tokens = cfg.steps * cfg.batch_size * cfg.grad_accum * cfg.seq_len
            rate = DISTILL_TOKENS_PER_S["bf16" if bf16 else "fp32"] * REF_PARAMS / cur.params
            mem = held + 12 * trainable + _training_bytes(cur, cfg.batch_size, cfg.seq_len, bf16)
            secs = tokens / rate
            basis = (
                f"teacher (the baseline) + student + fp32 grads and AdamW moments of {trainable:,} trainable parameters + activations "
                f"of {cfg.batch_size} x {cfg.seq_len} tokens; {tokens:,} tokens at ~{rate:,.0f} tokens/s "
                f"({'bf16 autocast' if bf16 else 'float32'}, scaled from the 135M model)"
            )
        elif stage.kind == "quantize":
            selected = set(_selected(cur, cfg))
            mine = {n: r for n, r in records.items() if n in selected}
            weights = sum(r.out_f * r.in_f for r in mine.values())
            codes = weights  # one uint8 per weight, unpacked
            if cfg.method == "rtn":
                mem, secs = held + codes, weights / RTN_WEIGHTS_PER_S
                basis = f"baseline + working copy + uint8 codes of {weights:,} weights; ~{RTN_WEIGHTS_PER_S:.0e} weights/s"
            else:
                t = cur.text
                hidden_states = 2 * cal_tokens * t.hidden_size * 4
                hessians = sum(r.in_f**2 for n, r in mine.items() if re.search(r"\.0\.", n)) * 4  # the first block's Linears
                mem = held + codes + hidden_states + hessians + _activation_bytes(cur, cfg.batch_size, cal.seq_len) / 2
                block_linear = sum(r.in_f**2 for r in mine.values())
                if cfg.method == "gptq":
                    secs = _forward_s(weights, cal_tokens) + 2 * block_linear * cal_tokens / CPU_FORWARD_FLOPS
                    how = f"forward + Hessian accumulation (2 x in_features^2 per Linear per token) over {cal_tokens:,} calibration tokens"
                elif cfg.method == "awq":
                    secs = _forward_s(weights, cal_tokens) + 1.25 * cfg.grid * _forward_s(weights, cfg.search_tokens)
                    how = (
                        f"forward over {cal_tokens:,} calibration tokens + {cfg.grid} scale candidates x "
                        f"{cfg.search_tokens:,} search tokens (+25% clipping)"
                    )
                elif cfg.method == "llm_int8":  # one pass to find outlier columns, then rounding
                    secs = _forward_s(cur.params, cal_tokens) + weights / RTN_WEIGHTS_PER_S
                    how = f"one forward over {cal_tokens:,} calibration tokens, then rounding"
                else:
                    raise CompressError(f"{label}: compress plan has no estimate for quantize method '{cfg.method}'")
                basis = (
                    f"baseline + working copy + codes + block inputs/outputs of {cal_tokens:,} tokens (float32) + one block's "
                    f"Hessians; {how}"
                )
        elif stage.kind == "kv_cache":
            per_token = kv_bytes_per_token(cur.config, dtype)
            ev = cfg.evaluate
            mem = held + (2 * per_token * ev.context * ev.samples if ev else 0)
            rate = TORCH_DECODE_TOKENS_PER_S * REF_PARAMS / cur.params
            secs = (2 * ev.samples * ev.context / rate if ev else 0) + (_forward_s(cur.params, cal_tokens) if cfg.static_scales else 0)
            basis = (
                f"baseline + working copy + float and quantized caches at {ev.context if ev else 0} tokens; decoding "
                f"{ev.samples if ev else 0} x {ev.context if ev else 0} tokens token by token twice (float cache and quantized) "
                f"at ~{rate:.0f} tokens/s"
                if ev
                else "baseline + working copy; no evaluation through the cache"
            )
        else:
            raise CompressError(f"{label}: compress plan has no estimate for stage kind '{stage.kind}'")
        rows.append({"step": label, "peak_memory_gb": mem / GB, "time_s": secs, "basis": basis})
    ev = recipe.data.evaluation
    if ev is not None:
        tokens = ev.samples * ev.seq_len
        models = 2 if recipe.stages else 1
        rows.append(
            {
                "step": "evaluate",
                "peak_memory_gb": (base + cur.params * dtype + _activation_bytes(cur, ev.batch_size, ev.seq_len)) / GB,
                "time_s": _forward_s(shape.params, tokens) + (_forward_s(cur.params, tokens) if recipe.stages else 0),
                "basis": f"{models} model(s) x {ev.samples} x {ev.seq_len} tokens at 2 x params FLOPs/token, "
                f"~{CPU_FORWARD_FLOPS / GB:.0f} GFLOPS",
            }
        )
    for spec, art in zip(recipe.exports, export_rows[len(export_rows) - len(recipe.exports) :], strict=False):  # exports come last
        tokens = EXPORT_FORMATS[spec.format].planned_verify_tokens(spec, ev.samples if ev else 0, ev.seq_len if ev else 0)
        rows.append(
            {
                "step": f"export {spec.name} ({spec.format})",
                "peak_memory_gb": (base + cur.params * dtype + 2 * art["size_bytes"]) / GB,
                "time_s": EXPORT_BUILD_S * cur.params / REF_PARAMS + _forward_s(cur.params, tokens),
                "basis": f"baseline + working copy + the file twice (written, then loaded by its runtime); ~{EXPORT_BUILD_S:.0f} s "
                f"per 135M parameters to write and prove it + scoring {tokens:,} tokens on its runtime",
            }
        )
    return rows


def _selected(shape: ModelShape, cfg: Any) -> list[str]:
    from compress.quantizers.targets import select_linears

    return [n for n, _ in select_linears(shape.model, cfg.targets, cfg.ignore)[0]]


# --------------------------------------------------------------------------- the plan


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
    shape = model_shape(recipe.model, loaded.base_dir)
    final = final_shape(recipe, shape)
    check_group_sizes(recipe, final)
    records = quantized_layers(recipe, final)
    arts = artifacts(recipe, shape, final, records)
    steps = stage_estimates(recipe, shape, records, arts)
    fits = []
    for dev in chosen:
        ctx, n = _serving(recipe, dev.name, context, batch)
        prompt, output = (
            (recipe.latency.prompt_tokens, recipe.latency.output_tokens) if recipe.latency else (max(ctx // 2, 1), max(ctx - ctx // 2, 1))
        )
        for art in arts:
            s = shape if art["artifact"] == "baseline" else final
            per_token = kv_bytes_per_token(s.config, art["kv_bytes_per_element"])
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
            "dtype": recipe.model.dtype,
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
