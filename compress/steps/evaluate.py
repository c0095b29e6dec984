"""Step 3: the source and the compressed model scored in memory with torch on the evaluation chunks,
and the compressed model decoding through its quantized KV cache when a stage set one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from compress.data import Chunks
from compress.eval.kv_eval import evaluate_kv
from compress.eval.metrics import Evaluation, Forward, Scores, compare
from compress.eval.moe_coverage import expert_coverage
from compress.progress import Reporter
from compress.quantizers.kv_cache_config import KV_CACHE_ARTIFACT
from compress.schema.recipe import Recipe
from compress.steps.load import Run, Source
from compress.steps.stages import Staged


@dataclass
class InMemory:
    """The in-memory evaluations (baseline, compressed, kv_cache) and the KV cache's report section."""

    evaluations: list[Evaluation] = field(default_factory=list)
    kv_cache: dict[str, Any] | None = None


def in_memory(run: Run, source: Source, staged: Staged) -> InMemory:
    found = InMemory()
    if source.eval_chunks is not None:
        with run.timed("evaluate_s"):
            compressed = staged.forward(run.device) if staged.changed else None
            found.evaluations += compare_models(
                source.baseline_forward, compressed, source.eval_chunks, run.recipe, run.device, run.reporter
            )
    found.evaluations += expert_coverage([(f"stages[{i}]", r.summary) for i, r in enumerate(staged.records)], run.device.type)
    if staged.ctx.kv_cache is not None:
        with run.timed("evaluate_kv_cache_s"):
            kv_eval, found.kv_cache = evaluate_kv_stage(run, source, staged)
            found.evaluations += kv_eval
    return found


def compare_models(
    baseline: Forward,
    compressed: Forward | None,
    chunks: Chunks,
    recipe: Recipe,
    device: torch.device,
    reporter: Reporter,
) -> list[Evaluation]:
    """The baseline (its forward: cached hidden states) and the compressed model (its forward) on
    the evaluation chunks, with torch on ``device``."""
    evaluation = recipe.data.evaluation
    assert evaluation is not None
    candidates = {"compressed": compressed} if compressed is not None else {}
    metrics = compare(baseline, candidates, chunks.tokens, evaluation.min_context, evaluation.batch_size, progress=reporter.track)
    if "compressed" not in metrics:  # no stages: the compressed model is the baseline
        metrics["compressed"] = Scores(metrics["baseline"], metrics["baseline"].intervals)
    details = {"chunks": int(chunks.tokens.shape[0]), "seq_len": evaluation.seq_len, "min_context": evaluation.min_context}
    return [
        Evaluation(artifact=name, runtime="torch", device=device.type, metrics=metrics[name], details=details)
        for name in ("baseline", "compressed")
    ]


def evaluate_kv_stage(run: Run, source: Source, staged: Staged) -> tuple[list[Evaluation], dict[str, Any]]:
    """Score the compressed model decoding through its quantized KV cache at long context, against
    its own full-precision forward; returns the ``kv_cache`` evaluation and the report section."""
    scheme = staged.ctx.kv_cache
    assert scheme is not None
    cfg = scheme.config
    section: dict[str, Any] = {
        "scheme": cfg.model_dump(mode="json", exclude={"evaluate"}),
        "describe": cfg.describe(),
        "runtimes": cfg.runtime_support(),
    }
    if cfg.evaluate is None:
        return [], section
    ev = cfg.evaluate
    evaluation = run.recipe.data.evaluation
    assert evaluation is not None  # the recipe schema requires data.evaluation for an evaluated kv_cache stage
    with run.reporter.status(f"tokenizing {ev.samples} x {ev.context} tokens of evaluation text for the KV cache"):
        chunks = source.data.chunks("evaluation", source.lm.tokenizer, samples=ev.samples, seq_len=ev.context)
    result = evaluate_kv(
        staged.model, scheme, chunks.tokens, evaluation.min_context, run.device, progress=run.reporter.track, tokenizer=source.lm.tokenizer
    )
    details = {
        "chunks": ev.samples,
        "seq_len": ev.context,
        "min_context": evaluation.min_context,
        **result["decoding"],
        "reference": "the compressed model's full-precision forward (a float cache)",
        "reference_perplexity": result["reference_metrics"]["perplexity"],
        "memory": result["memory"],
        **({"needles": result["needles"]} if result["needles"] else {}),
        "tokens_sha256": chunks.facts["tokens_sha256"],
    }
    section["memory"] = result["memory"]
    return [
        Evaluation(
            artifact=KV_CACHE_ARTIFACT, runtime="torch", device=run.device.type, metrics=result["metrics"], details=details, kind="kv_cache"
        )
    ], section
