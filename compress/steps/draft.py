"""After the exports: a draft stage's draft written beside the target (``draft/``) and the pair measured
by speculative decoding on each runtime (compress/eval/speculative.py).

``draft/model/``: written as the target's ``model/`` is (compressed-tensors with a quantized draft's
records packed and read back identical, else float; transformers' assisted generation,
``assistant_model=``), with the target's tokenizer files, checked byte for byte against ``model/``'s. ``draft/draft.gguf``: the
draft for llama.cpp's speculative decoding (``--model-draft``), its quantized records packed exactly,
the tokenizer written as the target's GGUF export writes it; read back in llama.cpp, whose vocabulary
must be the target's.

Measured on held-apart prompts (the start of each evaluation chunk): the target alone, then the
target with the draft at each k and temperature, on torch (the models in memory) and on llama.cpp
(each GGUF export of the target with the draft's GGUF). The gate metrics are read from greedy
decoding at the k with the highest speed-up; every cell is in the evaluation's details.
"""

from __future__ import annotations

import filecmp
from pathlib import Path
from typing import Any

from compress import streaming
from compress.artifact import MODEL_DIR, write_model
from compress.distill.draft import Draft
from compress.distill.draft_config import gguf_exports
from compress.errors import CompressError, FormatError
from compress.eval.speculative import TorchDecoder, batch_difference, sweep, transformers_assisted
from compress.plugins import EXPORT_FORMATS
from compress.schema.exports import EXPORTS_DIR
from compress.schema.metrics import DRAFT_ARTIFACT, draft_artifact
from compress.steps.exports import Exported
from compress.steps.load import Run, Source
from compress.steps.stages import Staged

DRAFT_DIR = "draft"
DRAFT_GGUF = "draft.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model")


def write(root: Path, run: Run, source: Source, staged: Staged) -> dict[str, Any] | None:
    """Write the draft under ``root/draft/``; its manifest entry (None without a draft stage)."""
    draft = staged.ctx.draft
    if draft is None:
        return None
    folder = root / DRAFT_DIR
    tokenizer = source.lm.tokenizer
    with run.reporter.status(f"{draft.label} (draft): writing the draft to {folder}"):
        # as model/ is written: a quantized draft's records packed as compressed-tensors and read back identical
        write_model(folder, draft.model, tokenizer, draft.records)
        shared = _same_tokenizer_files(root / MODEL_DIR, folder / MODEL_DIR, draft.label)
        entry: dict[str, Any] = {
            "stage": draft.label,
            "model": f"{DRAFT_DIR}/{MODEL_DIR}",
            "tokenizer_files_identical": shared,
            **draft.facts,
        }
        if draft.config.gguf:
            entry["llama_cpp_file"] = _write_gguf(folder / DRAFT_GGUF, draft, tokenizer, source, run)
    return entry


def _same_tokenizer_files(target_dir: Path, draft_dir: Path, label: str) -> list[str]:
    """The tokenizer files both folders hold, each byte for byte the same; a difference is an error."""
    names = [n for n in TOKENIZER_FILES if (target_dir / n).is_file() or (draft_dir / n).is_file()]
    for name in names:
        a, b = target_dir / name, draft_dir / name
        if not (a.is_file() and b.is_file() and filecmp.cmp(a, b, shallow=False)):
            raise FormatError(f"{label} (draft): the draft's {name} differs from the target's; a draft must share its tokenizer")
    return names


def _write_gguf(path: Path, draft: Draft, tokenizer: Any, source: Source, run: Run) -> dict[str, Any]:
    from compress.export.gguf.check import check_gguf_records
    from compress.export.gguf.inputs import is_gguf_file
    from compress.export.gguf.layout import resolve_type
    from compress.export.gguf.runtime import LlamaCppVocab
    from compress.export.gguf.writer import write_gguf

    records = draft.records
    type_name = resolve_type("auto", records)
    tokenizer_from = source.lm.source_path if is_gguf_file(source.lm.source_path) else None
    facts = write_gguf(path, draft.model, tokenizer, records, type_name, "f16" if not records else None, tokenizer_from=tokenizer_from)
    if records:
        problems = check_gguf_records(path, facts["plan"], records)
        if problems:
            raise FormatError(f"{draft.label} (draft): reading {path.name} back does not give the records: {'; '.join(problems[:5])}")
    vocab = LlamaCppVocab(path)
    try:
        n_vocab = int(vocab.llm.n_vocab())
    finally:
        vocab.close()
    expected = draft.model.get_output_embeddings().weight.shape[0]
    if n_vocab != expected:
        raise FormatError(f"{draft.label} (draft): llama.cpp reads a vocabulary of {n_vocab} from {path.name}, the model has {expected}")
    return {
        "path": f"{DRAFT_DIR}/{DRAFT_GGUF}",
        "type": type_name,
        "records_exact": len(records),
        "bytes": path.stat().st_size,
        "tensor_types": facts["tensor_types"],
    }


# --------------------------------------------------------------------------- measuring the pair


def measure(root: Path, run: Run, source: Source, staged: Staged, exported: Exported, written: dict[str, Any] | None) -> list[Any]:
    """The ``draft`` evaluations: the pair in torch, and each GGUF export of the target with the
    draft's GGUF in llama.cpp (skipped, with a warning, when there is none)."""
    from compress.eval.metrics import Evaluation

    draft = staged.ctx.draft
    if draft is None or draft.config.evaluate is None:
        return []
    cfg = draft.config.evaluate
    if source.eval_chunks is None:
        raise CompressError(f"{draft.label} (draft): no evaluation text to take prompts from")
    rows = source.eval_chunks.tokens
    prompts = [rows[i, : cfg.prompt_tokens].tolist() for i in range(min(cfg.prompts, rows.shape[0]))]
    if len(prompts) < cfg.prompts:
        run.reporter.warn(f"{draft.label} (draft): {len(prompts)} evaluation chunks give {len(prompts)} prompts of the {cfg.prompts} asked")
    context = cfg.prompt_tokens + cfg.max_new + max(cfg.k) + 2
    found: list[Evaluation] = []
    if "torch" in cfg.runtimes:
        streaming.to_device(staged.model, run.device)
        draft.model.to(run.device)
        with run.timed("draft_torch_s"):
            cells = _sweep(TorchDecoder(staged.model), TorchDecoder(draft.model), prompts, cfg, run, f"{draft.label} torch")
            with run.reporter.status(f"{draft.label} (draft): transformers' assisted generation at k = {', '.join(map(str, cfg.k))}"):
                assisted = [transformers_assisted(staged.model, draft.model, prompts, cfg.max_new, k) for k in cfg.k]
        evaluation = _evaluation(DRAFT_ARTIFACT, "torch", run.device.type, cells, draft)
        evaluation.details["transformers_generate"] = assisted
        found.append(evaluation)
        draft.model.to("cpu")
    if "llama.cpp" in cfg.runtimes:
        found += _llama_cpp(root, run, exported, draft, written, prompts, context, cfg)
    return found


def _llama_cpp(
    root: Path, run: Run, exported: Exported, draft: Draft, written: dict[str, Any] | None, prompts: list[list[int]], context: int, cfg: Any
) -> list[Any]:
    from compress.export.gguf.runtime import LlamaCppModel

    gguf_path = root / written["llama_cpp_file"]["path"] if written and "llama_cpp_file" in written else None
    entries = {e["name"]: e for e in exported.entries}
    targets = gguf_exports(run.recipe.exports)
    if gguf_path is None or not targets:
        run.reporter.warn(
            f"{draft.label} (draft): no GGUF export of the target (or draft.gguf: false); the pair is not measured in llama.cpp"
        )
        return []
    found = []
    for export in targets:
        fmt = EXPORT_FORMATS[export.format]
        where = fmt.timed_path(root / EXPORTS_DIR / export.name, entries.get(export.name, {}))
        if where is None:
            continue
        target = LlamaCppModel(where[0], n_ctx=context, threads=run.threads, piece_tokens=128)
        small = LlamaCppModel(gguf_path, n_ctx=context, threads=run.threads, piece_tokens=128)
        try:
            if small.n_vocab != target.n_vocab:
                raise CompressError(
                    f"{draft.label} (draft): the draft's vocabulary ({small.n_vocab}) differs from export {export.name}'s ({target.n_vocab})"
                )
            with run.timed(f"draft_{export.name}_s"):
                cells = _sweep(target, small, prompts, cfg, run, f"{draft.label} llama.cpp ({export.name})")
                noise = batch_difference(target, prompts[0], max(cfg.k) + 1)
        finally:
            small.close()
            target.close()
        evaluation = _evaluation(draft_artifact(export.name), "llama.cpp", where[1], cells, draft)
        evaluation.details["batched_logit_difference"] = noise
        found.append(evaluation)
    return found


def _sweep(target: Any, draft: Any, prompts: list[list[int]], cfg: Any, run: Run, what: str) -> list[dict[str, Any]]:
    cells = len(cfg.k) * len(cfg.temperatures)
    with run.reporter.bar(f"{what}: speculative decoding", total=cells) as step:
        return sweep(target, {"draft": draft}, prompts, cfg.k, cfg.max_new, cfg.temperatures, track=step)


def best_greedy(cells: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The greedy cell with the highest speed-up (None without greedy cells)."""
    greedy = [c for c in cells if c["mode"] == "greedy"]
    return max(greedy, key=lambda c: c["speedup"]["mean"]) if greedy else None


def _interval(found: dict[str, Any]) -> dict[str, Any] | None:
    """A ratio_interval's Evaluation interval (without its ``mean``), or None for a single prompt."""
    return {k: v for k, v in found.items() if k != "mean"} if "lower" in found else None


def _evaluation(artifact: str, runtime: str, device: str, cells: list[dict[str, Any]], draft: Draft) -> Any:
    from compress.eval.metrics import Evaluation

    best = best_greedy(cells)
    metrics: dict[str, float | int] = {}
    intervals: dict[str, dict[str, Any]] = {}
    if best is not None:
        metrics = {
            "draft_acceptance": best["accepted_per_pass"]["mean"],
            "speculative_speedup": best["speedup"]["mean"],
            "draft_greedy_identical": min(c["greedy_identical"] / c["prompts"] for c in cells if c["mode"] == "greedy"),
            "best_k": best["k"],
            "tokens_per_pass": best["tokens_per_pass"]["mean"],
            "draft_parameters": draft.facts["parameters"],
            "draft_share": draft.facts["share"],
        }
        for name, key in (("draft_acceptance", "accepted_per_pass"), ("speculative_speedup", "speedup")):
            if (iv := _interval(best[key])) is not None:
                intervals[name] = iv
    return Evaluation(
        artifact=artifact,
        runtime=runtime,
        device=device,
        metrics=metrics,
        details={"cells": cells, "stage": draft.label},
        kind="draft",
        intervals=intervals or None,
    )
