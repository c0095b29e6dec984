"""`compress bench quant`: RTN vs GPTQ vs AWQ on one model, same calibration and evaluation data.

Every candidate is quantized from the same baseline, timed, its peak memory sampled, and scored
right away against the baseline on evaluation text kept apart from the calibration text (see
compress.data). results.json and a Markdown table are rewritten after every candidate, so a
long run that is stopped keeps what it finished.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from compress import streaming
from compress.context import RunContext, SizeBudget
from compress.data import DataPlan
from compress.eval.memory import PeakRSS
from compress.eval.metrics import compare, torch_forward
from compress.models import load_model
from compress.plugins import export_format, method_streams, quant_method
from compress.progress import Reporter
from compress.schema.quantize import HEAD
from compress.schema.recipe import DataConfig, ModelConfig


@dataclass(frozen=True)
class Setting:
    bits: int
    group_size: int | None
    symmetric: bool

    @classmethod
    def parse(cls, text: str) -> Setting:
        """``W4g128s`` / ``W3g128a`` / ``W4pcs`` (per-channel)."""
        t = text.strip().lower()
        if not t.startswith("w") or t[-1] not in "sa":
            raise ValueError(f"setting '{text}': expected like W4g128s (sym) or W3g64a (asym), W4pcs for per-channel")
        body, sym = t[1:-1], t[-1] == "s"
        bits, _, group = body.partition("g") if "g" in body else (body.removesuffix("pc"), "", "")
        return cls(int(bits), int(group) if group else None, sym)

    @property
    def label(self) -> str:
        return f"W{self.bits} {'per-channel' if self.group_size is None else f'g{self.group_size}'} {'sym' if self.symmetric else 'asym'}"


def write_results(out_dir: Path, result: dict[str, Any], table: str) -> None:
    """results.json and results.md, rewritten after every candidate so a stopped run keeps what it measured."""
    (out_dir / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "results.md").write_text(table + "\n")


def quantize_copy(
    lm: Any,
    calibration: Any,
    method: str,
    setting: Setting | None,
    reporter: Reporter,
    gguf_type: str | None = None,
    budget: Any = None,
    sensitivity: dict[str, Any] | None = None,
    head: bool = False,
    head_type: str | None = None,
) -> tuple[Any, dict[str, Any], float]:
    """A deep copy of ``lm.model`` quantized by ``method`` at ``setting`` (or on llama.cpp's ``gguf_type``
    grid, or each layer on the type a GGUF export's size ``budget`` chooses: a GGUFExportConfig with a
    target) on the calibration chunks: (model, records, seconds). ``sensitivity``: a dict kept across
    calls on the same model, in which a budget's per-layer measurement is made once (RunContext.sensitivity).
    ``head``: the output head quantized too (``ignore: []``); with ``head_type``, by a second stage of
    the same method on that GGUF type's grid (``targets: [lm_head]``), as a recipe would chain it."""
    import time

    from compress.context import RunContext

    if calibration is None:
        raise ValueError(f"{method} needs calibration data")
    quant = quant_method(method)
    if budget is not None:
        config = quant.config(method=method, gguf_target=True)
    elif setting is None:
        config = quant.config(method=method, gguf_type=gguf_type)
    else:
        config = quant.config(method=method, bits=setting.bits, group_size=setting.group_size, symmetric=setting.symmetric)
    head_config = None
    if head_type is not None:
        head_config = quant.config(method=method, gguf_type=head_type, targets=[HEAD], ignore=[])
    elif head:
        config = type(config).model_validate({**config.model_dump(exclude_unset=True), "ignore": []})  # validated: AWQ refuses the head
    model = working_copy(lm.model, config)
    ctx = RunContext(seed=0, device=torch.device("cpu"), tokenizer=lm.tokenizer, reporter=reporter, calibration=lambda: calibration.tokens)
    ctx.size_budget = None if budget is None else SizeBudget(budget, export_format(budget.format))
    ctx.sensitivity = sensitivity
    started = time.perf_counter()
    quant.build(config, "bench").apply(model, ctx)
    if head_config is not None:
        quant.build(head_config, "bench-head").apply(model, ctx)
    return model, ctx.quantized, time.perf_counter() - started


def working_copy(model: Any, config: Any) -> Any:
    """A copy of the (streamed) source ``model`` for one candidate: read into memory first when the
    method's stage needs the whole model (``backend: llmcompressor``), as a recipe run does."""
    copied = copy.deepcopy(model)
    if streaming.is_streamed(copied) and not method_streams(config):
        streaming.materialize(copied)
    return copied


def load_bench_inputs(
    model_source: str, data: DataConfig, threads: int, reporter: Reporter, dtype: str = "auto"
) -> tuple[Any, Any, Any, Any]:
    """The model (computing in ``dtype``, a recipe's ``model.dtype``), calibration chunks (None without
    calibration data), evaluation chunks and evaluation config a benchmark runs on, with torch set to
    ``threads``."""
    torch.set_num_threads(threads)
    base_dir = Path.cwd()
    lm = load_model(ModelConfig(source=model_source, dtype=dtype), base_dir, reporter)
    plan = DataPlan.load(data, base_dir, reporter)
    evaluation = plan.chunks("evaluation", lm.tokenizer)
    calibration = plan.chunks("calibration", lm.tokenizer) if data.calibration else None
    assert data.evaluation is not None
    return lm, calibration, evaluation, data.evaluation


DEFAULT_BACKEND = "compress"


def backend_choices() -> tuple[str, ...]:
    """The values of the calibrated methods' ``backend`` option (read from the recipe schema)."""
    from typing import get_args

    from compress.quantizers.configs import GPTQConfig

    return get_args(GPTQConfig.model_fields["backend"].annotation)


def candidates(methods: list[str], backends: list[str]) -> list[tuple[str, str | None]]:
    """(method, backend) pairs in order: a method with a ``backend`` option once per backend, any other
    method once (backend None)."""
    pairs: list[tuple[str, str | None]] = []
    for method in methods:
        has_backend = "backend" in quant_method(method).config.model_fields
        pairs += [(method, b) for b in backends] if has_backend else [(method, None)]
    return pairs


def method_label(method: str, backend: str | None) -> str:
    """``gptq``, or ``gptq (llmcompressor)`` for a backend other than ours."""
    return method if backend in (None, DEFAULT_BACKEND) else f"{method} ({backend})"


def run_quant_bench(
    model_source: str,
    data: DataConfig,
    methods: list[str],
    settings: list[Setting],
    out_dir: Path,
    threads: int,
    reporter: Reporter,
    method_options: dict[str, dict[str, Any]] | None = None,
    backends: list[str] | None = None,
) -> dict[str, Any]:
    """Every method at every setting; a method with a ``backend`` option (gptq, awq) once per entry of
    ``backends`` (default: ours alone), so two implementations are scored side by side on the same data."""
    device = torch.device("cpu")
    lm, calibration, evaluation, eval_cfg = load_bench_inputs(model_source, data, threads, reporter)
    baseline = torch_forward(lm.model, device)
    result: dict[str, Any] = {
        "model": {"source": model_source, "sha256": lm.facts["sha256"]},
        "baseline": None,
        "calibration": calibration.facts if calibration else None,
        "evaluation": evaluation.facts,
        "threads": threads,
        "host": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "rows": [],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    for setting in settings:
        for method, backend in candidates(methods, backends or [DEFAULT_BACKEND]):
            quant = quant_method(method)
            options = dict((method_options or {}).get(method, {}))
            if backend is not None:
                options["backend"] = backend
            config = quant.config(method=method, bits=setting.bits, group_size=setting.group_size, symmetric=setting.symmetric, **options)
            if getattr(config, "needs_calibration", False) and calibration is None:
                raise ValueError(f"{method} needs calibration data")
            name = f"{method_label(method, backend)} {setting.label}"
            reporter.info(f"[bold]{name}[/]")
            model = working_copy(lm.model, config)
            ctx = RunContext(seed=0, device=device, tokenizer=lm.tokenizer, reporter=reporter, calibration=lambda: calibration.tokens)  # type: ignore[union-attr]
            with PeakRSS() as mem:
                t0 = time.perf_counter()
                record = quant.build(config, "bench").apply(model, ctx)
                seconds = time.perf_counter() - t0
            # Score right away (the baseline is re-run each time) and write, so a stopped run keeps its rows.
            metrics = compare(
                baseline,
                {name: torch_forward(model, device)},
                evaluation.tokens,
                eval_cfg.min_context,
                eval_cfg.batch_size,
                progress=reporter.track,
            )
            del model
            result["baseline"] = metrics["baseline"]
            result["rows"].append(
                {
                    "name": name,
                    "method": method,
                    "backend": backend,
                    "setting": setting.label,
                    "seconds": round(seconds, 2),
                    "peak_extra_mb": round(mem.extra_mb),
                    "bits_per_weight": record.summary["bits_per_weight"],
                    "config": config.model_dump(mode="json"),
                    "metrics": metrics[name],
                }
            )
            write_results(out_dir, result, markdown_table(result))
    return result


def markdown_table(result: dict[str, Any]) -> str:
    b = result["baseline"]
    lines = [
        f"Baseline perplexity {b['perplexity']:.3f}; {b['tokens_scored']:,} scored tokens; {result['threads']} threads.",
        "",
        "| method | setting | KL divergence | vs RTN | top-1 agreement | perplexity | time, s | peak extra memory, MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rtn = {r["setting"]: r["metrics"]["kl_divergence"] for r in result["rows"] if r["method"] == "rtn"}
    for r in result["rows"]:
        m = r["metrics"]
        ref = rtn.get(r["setting"])
        versus = "—" if r["method"] == "rtn" or ref is None else f"{(m['kl_divergence'] / ref - 1):+.1%}"
        lines.append(
            f"| {method_label(r['method'], r.get('backend'))} | {r['setting']} | {m['kl_divergence']:.4f} | {versus} | {m['top1_agreement']:.2%} | "
            f"{m['perplexity']:.2f} | {r['seconds']:.1f} | {r['peak_extra_mb']:,} |"
        )
    return "\n".join(lines)
