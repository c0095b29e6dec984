"""`compress bench prune`: structured pruning and distillation repair on one model.

For every pruning setting (a ``prune:`` mapping), from the same loaded model: prune with the
recipe stage, score, repair with the recipe's ``distill`` stage (teacher: the unpruned model),
score again. Scores are against the unpruned model on texts the repair never trained on: the
held-out share of the evaluation source (data.holdout, kept apart from the training text) and any
number of other sources (``--unseen``, text of kinds the training text does not cover), each
named by its file or reference name. A setting with ``mlp_method: obs`` is also pruned the
default way (activation importance on data.calibration) and scored, so that its row reports the
share of that gap too: obs already closes part of the gap in pruning. results.json and results.md
are rewritten after every phase.
"""

from __future__ import annotations

import copy
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from compress import streaming
from compress.context import RunContext
from compress.data import DataPlan
from compress.distill.config import DistillConfig
from compress.distill.distill import DistillStage
from compress.eval.bench.quant import load_bench_inputs, write_results
from compress.eval.metrics import compare, torch_forward
from compress.progress import Reporter
from compress.pruning.config import PruneConfig
from compress.pruning.prune import PruneStage, parameters
from compress.schema.recipe import DataConfig, EvaluationConfig

DEFAULT_SETTINGS = ("{mlp: 0.25}", "{layers: {drop: 4}}")
# recipes/prune-distill.yaml's repair (a 14.5-minute training budget, at most 400 steps of 2 x 512 tokens, bf16
# autocast), trained on the calibration text; see docs/pruning.md.
DEFAULT_DISTILL = {
    "steps": 400,
    "max_minutes": 14.5,
    "batch_size": 2,
    "seq_len": 512,
    "lr": 3e-4,
    "warmup_steps": 10,
    "autocast": "bf16",
    "eval": {"every": 0, "samples": 4},
    "checkpoint_every": 0,
}


def text_label(source: str, taken: set[str]) -> str:
    """A short unique name for an evaluation source: its reference name or file name."""
    base = source.split(":", 1)[1] if source.startswith("reference:") else (Path(source).stem or source)
    label, n = base, 2
    while label in taken or label == "held_out":
        label, n = f"{base}-{n}", n + 1
    return label


def repair_label(override: dict[str, Any]) -> str:
    """A repair's name: its overrides of the bench's distill options ({} is plain distillation)."""
    return _flow(override) if override else "{loss: kl}"


def run_prune_bench(
    model_source: str,
    data: DataConfig,
    unseen: list[str],
    settings: list[PruneConfig],
    distill: DistillConfig,
    out_dir: Path,
    threads: int,
    reporter: Reporter,
    repairs: list[tuple[dict[str, Any], DistillConfig]] | None = None,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """``repairs``: (overrides, config) of each repair to run from the same pruned model; default the
    one ``distill``. The first is the row's ``repaired``; every one has its curve in ``repairs``.
    ``device``: where the stages and the scoring compute (default the CPU); the models wait on the CPU
    between them, as in a recipe run."""
    repairs = repairs or [({}, distill)]
    device = device or torch.device("cpu")
    lm, calibration, evaluation, eval_cfg = load_bench_inputs(model_source, data, threads, reporter)
    streaming.materialize(lm.model, "cpu")  # pruning and training need the whole model in memory
    plan = DataPlan.load(data, Path.cwd(), reporter)
    texts = {"held_out": evaluation.tokens}
    unseen_facts = {}
    for source in unseen:
        other = EvaluationConfig(source=source, samples=eval_cfg.samples, seq_len=eval_cfg.seq_len, min_context=eval_cfg.min_context)
        chunks = DataPlan.load(DataConfig(evaluation=other), Path.cwd(), reporter).chunks("evaluation", lm.tokenizer)
        label = text_label(source, set(texts))
        texts[label], unseen_facts[label] = chunks.tokens, chunks.facts
    baseline = torch_forward(lm.model, device)

    def score(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
        out = {}
        for m in (lm.model, model):  # both on the device while scored, then back to the CPU
            m.to(device)
        for name, tokens in texts.items():
            metrics = compare(
                baseline, {"m": torch_forward(model, device)}, tokens, eval_cfg.min_context, eval_cfg.batch_size, progress=reporter.track
            )
            out[name] = {**metrics["m"], "baseline_perplexity": metrics["baseline"]["perplexity"]}
        for m in (lm.model, model):
            m.to("cpu")
        return out

    result: dict[str, Any] = {
        "model": {"source": model_source, "sha256": lm.facts["sha256"], "parameters": parameters(lm.model)},
        "training_text": distill.data.source or (calibration.facts["source"] if calibration else None),
        "texts": {"held_out": evaluation.facts, "unseen": unseen_facts},
        "distill": distill.model_dump(mode="json"),
        "threads": threads,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "host": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "rows": [],
    }
    out_dir.mkdir(parents=True, exist_ok=True)

    def context() -> RunContext:
        return RunContext(
            seed=0,
            device=device,
            tokenizer=lm.tokenizer,
            reporter=reporter,
            calibration=lambda: calibration.tokens,
            text=plan.text_for(lm.tokenizer, Path.cwd(), reporter),
            original=lm.model,
        )

    for config in settings:
        label = config.model_dump_json(exclude_defaults=True)
        reporter.info(f"[bold]prune {label}[/]")
        row: dict[str, Any] = {"setting": config.model_dump(mode="json", exclude_defaults=True)}
        result["rows"].append(row)
        model = copy.deepcopy(lm.model)
        ctx = context()
        t0 = time.perf_counter()
        record = PruneStage(config, "prune").apply(model, ctx)
        ctx.applied.append("prune")
        row.update(
            prune_seconds=round(time.perf_counter() - t0, 1),
            parameters=parameters(model),
            shape=record.summary["after"],
            dropped_layers=record.summary["dropped_layers"],
            pruned=score(model),
        )
        if config.mlp_method != "activation":  # the gap the activation (Minitron) choice on data.calibration opens, for comparison
            reference = copy.deepcopy(lm.model)
            PruneStage(config.model_copy(update={"mlp_method": "activation", "data": None}), "prune").apply(reference, context())
            row["pruned_by_activation"] = score(reference)
            del reference
        write_results(out_dir, result, markdown_table(result))
        row["repairs"] = []
        pruned_model = model
        for n, (override, cfg) in enumerate(repairs):
            model = pruned_model if n == len(repairs) - 1 else copy.deepcopy(pruned_model)  # the last repair takes the original
            reporter.info(f"[bold]repair {repair_label(override)}[/]")
            t0 = time.perf_counter()
            record = DistillStage(cfg, "distill").apply(model, ctx)
            s = record.summary
            done = {
                "repair": repair_label(override),
                "overrides": override,
                "loss": cfg.loss,
                "stored_top_k": None if cfg.stored_teacher is None else cfg.stored_teacher.top_k,
                "repair_seconds": round(time.perf_counter() - t0, 1),
                "train_seconds": s["train_seconds"],
                "steps": s["steps"],
                "stopped_by": s["stopped_by"],
                "tokens": s["tokens"],
                "tokens_per_second": s["tokens_per_second"],
                "refit": s["refit"],
                "stored_teacher": s["stored_teacher"],
                # the stage's own held-apart evaluations (eval.samples chunks of data.evaluation) against the unpruned model
                "curve": [
                    {"tokens": h["tokens"], "step": h["step"], "refit": "refit" in h, "loss": h["loss"]}
                    | {k: h[k] for k in ("kl_divergence", "top1_agreement", "perplexity")}
                    for h in s["history"]
                ],
                "kept_step": s["kept_step"],
                "repaired": score(model),
            }
            done["kl_gap_recovered"] = gap_recovered(row["pruned"], done["repaired"])
            row["repairs"].append(done)
            if n == 0:
                keys = ("repair_seconds", "train_seconds", "steps", "stopped_by", "tokens", "tokens_per_second", "refit", "repaired")
                row.update({k: done[k] for k in (*keys, "kl_gap_recovered")})
                if "pruned_by_activation" in row:
                    row["kl_gap_recovered_of_activation"] = gap_recovered(row["pruned_by_activation"], done["repaired"])
            write_results(out_dir, result, markdown_table(result))
            if n < len(repairs) - 1:
                del model
        del pruned_model, ctx
    if any(has_curves(r) for r in result["rows"]):
        plot_repair_curves(result, out_dir / "repair-curves.png")
        write_results(out_dir, result, markdown_table(result))
    return result


def recovery(point: dict[str, Any], before: dict[str, Any]) -> float | None:
    """The share of the KL gap ``before`` (the pruned model, the stage's step 0) that ``point`` closed."""
    gap = before["kl_divergence"]
    return 1 - point["kl_divergence"] / gap if gap > 0 else None


def gap_recovered(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Per text, the share of ``before``'s KL gap that ``after`` closed (4 decimals; None without a gap)."""
    shares = {name: recovery(after[name], b) for name, b in before.items()}
    return {name: None if r is None else round(r, 4) for name, r in shares.items()}


def has_curves(row: dict[str, Any]) -> bool:
    """The row has repair curves to show: several repairs, or one evaluated during training too."""
    reps = row.get("repairs", [])
    return len(reps) > 1 or (len(reps) == 1 and len(reps[0]["curve"]) > 2)


def plot_repair_curves(result: dict[str, Any], path: Path) -> Path | None:
    """Held-apart KL to the unpruned model against training tokens, one line per repair, one panel per setting."""
    from compress.eval.reports import pyplot, save_figure

    rows = [r for r in result["rows"] if r.get("repairs")]
    if not rows:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(rows), figsize=(6.5 * len(rows), 4.5), squeeze=False)
    try:
        for ax, r in zip(axes[0], rows, strict=True):
            for rep in r["repairs"]:  # from the pruned model at 0 tokens (then the refit's point, at 0 too, where it ran)
                ax.plot([p["tokens"] for p in rep["curve"]], [p["kl_divergence"] for p in rep["curve"]], "o-", ms=3, label=rep["repair"])
            before = r["repairs"][0]["curve"][0]["kl_divergence"]
            ax.axhline(before, color="grey", ls="--", lw=1, label="pruned, no repair")
            ax.set_yscale("log")
            ax.set_xlabel("training tokens")
            ax.set_ylabel("held-apart KL to the unpruned model (nats/token)")
            ax.set_title(_setting(r["setting"]), fontsize=9)
            ax.grid(True, alpha=0.3, which="both")
            ax.legend(fontsize=7)
        fig.suptitle(f"{result['model']['source']}: repair against training tokens", fontsize=10)
        return save_figure(fig, path)
    finally:
        plt.close(fig)


def curve_table(result: dict[str, Any]) -> list[str]:
    """Per setting with several repairs or evaluations: KL (and share of the gap recovered) at each token count."""
    lines: list[str] = []
    for r in result["rows"]:
        if not has_curves(r):
            continue
        reps = r["repairs"]
        before = reps[0]["curve"][0]
        lines += [
            "",
            f"{_setting(r['setting'])}: held-apart KL to the unpruned model during each repair ({result['distill']['eval']['samples']} "
            f"chunks of the evaluation text; pruned: {before['kl_divergence']:.4f}); in brackets the share of that gap recovered.",
            "",
            "| tokens | " + " | ".join(rep["repair"] for rep in reps) + " |",
            "|---|" + "---|" * len(reps),
        ]
        points = sorted({(p["tokens"], p["refit"]) for rep in reps for p in rep["curve"] if p["step"] > 0 or p["refit"]})
        for tokens, refit in points:
            cells = []
            for rep in reps:
                p = next((p for p in rep["curve"] if p["tokens"] == tokens and p["refit"] == refit and (p["step"] > 0 or refit)), None)
                rec = None if p is None else recovery(p, before)
                cells.append(
                    "…" if p is None else f"{p['kl_divergence']:.4f} ({rec:.1%})" if rec is not None else f"{p['kl_divergence']:.4f}"
                )
            lines.append(f"| {tokens:,}{' (refit)' if refit else ''} | " + " | ".join(cells) + " |")
        lines.append("| tokens/s | " + " | ".join(f"{rep['tokens_per_second'] or 0:,.0f}" for rep in reps) + " |")
    return lines


def markdown_table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['model']['source']}: {result['model']['parameters']:,} parameters; {result['threads']} threads"
        + (f" on {result['device']}" if result.get("device", "cpu") != "cpu" else "")
        + "; "
        f"repair: up to {result['distill']['steps']} steps"
        + (f" within {result['distill']['max_minutes']:g} minutes" if result["distill"].get("max_minutes") else "")
        + f" of {result['distill']['batch_size']} x {result['distill']['seq_len']} tokens "
        f"of {result['training_text']}, lr {result['distill']['lr']:g}, autocast {result['distill']['autocast']}"
        + (
            f", after a least-squares refit of the pruned down projections on {result['distill']['refit']['samples']} of its chunks"
            if any(r.get("refit") for r in result["rows"])
            else ""
        )
        + ".",
        "",
        "| setting | parameters | text | KL pruned | KL repaired | gap recovered | top-1 pruned → repaired | "
        "perplexity base / pruned / repaired | repair time, s | tokens |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        for name in r.get("pruned", {}):
            p, q = r["pruned"][name], r.get("repaired", {}).get(name)
            rec = r.get("kl_gap_recovered", {}).get(name)
            lines.append(
                f"| {_setting(r['setting'])} | {r['parameters']:,} | {name} | {p['kl_divergence']:.4f} | "
                f"{q['kl_divergence']:.4f} | {rec:.1%} | {p['top1_agreement']:.2%} → {q['top1_agreement']:.2%} | "
                f"{p['baseline_perplexity']:.2f} / {p['perplexity']:.2f} / {q['perplexity']:.2f} | {r['repair_seconds']:.0f} | {r['tokens']:,} |"
                if q
                else f"| {_setting(r['setting'])} | {r['parameters']:,} | {name} | {p['kl_divergence']:.4f} | … | … | "
                f"{p['top1_agreement']:.2%} | {p['baseline_perplexity']:.2f} / {p['perplexity']:.2f} / … | … | … |"
            )
    lines += curve_table(result)
    for r in result["rows"]:
        if r.get("pruned_by_activation"):
            shares = r.get("kl_gap_recovered_of_activation", {})
            lines.append(
                f"\n{_setting(r['setting'])}: the activation (Minitron) choice of as many neurons (from data.calibration, no "
                "update) opens a KL of "
                + ", ".join(
                    f"{p['kl_divergence']:.4f} ({name}"
                    + (f"; the repaired model is {shares[name]:.1%} below it)" if shares.get(name) is not None else ")")
                    for name, p in r["pruned_by_activation"].items()
                )
                + "."
            )
        if r.get("refit"):
            f = r["refit"]
            lines.append(
                f"\n{_setting(r['setting'])}: the refit took {f['seconds']:.0f} s of the repair ({f['tokens']:,} tokens, "
                f"{len(f['blocks'])} blocks); the distill stage's own held-apart KL after it: {f['kl_divergence']:.4f}."
            )
    return "\n".join(lines)


def _setting(s: dict[str, Any]) -> str:
    parts = []
    for k, v in s.items():
        parts.append(f"{k} {v:.0%}" if isinstance(v, float) and k in ("mlp", "heads", "hidden") else f"{k} {_flow(v)}")
    return ", ".join(parts)


def _flow(v: Any) -> str:
    """A value as YAML flow style, unquoted: {source: [a, b], samples: 64}."""
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_flow(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_flow(x) for x in v) + "]"
    if v is None or isinstance(v, bool):
        return {None: "null", True: "true", False: "false"}[v]
    return str(v)
