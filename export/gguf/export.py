"""The ``exports: [{format: gguf, ...}]`` step: write the file (exactly from the records, or
through llama.cpp's quantizer from our F16 file), read the records back, then verify the file in
llama.cpp: tokenizer parity with the Hugging Face tokenizer, accuracy against the torch
baseline on the evaluation chunks, a same-weights check against the in-memory model, and a
short greedy generation.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.errors import FormatError
from compress.eval.metrics import Evaluation, compare, tables_forward
from compress.export.gguf import runtime as gguf_runtime
from compress.export.gguf.check import check_gguf_records, stored_type_counts, stored_types, tensor_totals
from compress.export.gguf.config import GGUFExportConfig
from compress.export.gguf.inputs import is_gguf_file
from compress.export.gguf.layout import HEAD_RECORD, architecture_of, plan_tensors, resolve_type
from compress.export.gguf.metadata import tokenizer_metadata
from compress.export.gguf.plugin import GGUF_FILE
from compress.export.gguf.writer import write_gguf
from compress.export.parity import (
    SAME_WEIGHTS_CHUNKS,
    VerifyInputs,
    compare_tokenizers,
    parity_corpus,
    special_ids,
    tokenization_mismatches,
)
from compress.progress import Reporter
from compress.quantizers.core import QuantizedWeight
from compress.quantizers.grids import GRIDS
from compress.quantizers.kv_cache import KVCacheScheme
from compress.streaming import compute_device

GENERATION_PROMPT = "The quick brown fox"


def with_records_quantizer(cfg: GGUFExportConfig, records: dict[str, QuantizedWeight]) -> GGUFExportConfig:
    """The config with quantizer records where none was named for a type llama.cpp's quantizer also
    makes (q2_k, q5_0, q5_1, q6_k) and every record lies on that type's grid (or its fallback's)."""
    if cfg.quantizer != "llama.cpp" or not cfg.records_by_default or not records:
        return cfg
    grid = GRIDS[cfg.type]
    if all(r.scheme.gguf_type == grid.for_width(r.shape[1]).name for r in records.values()):
        return cfg.model_copy(update={"quantizer": "records"})
    return cfg


def with_fp4_records(model: nn.Module, records: dict[str, QuantizedWeight]) -> dict[str, Any]:
    """The records and the records of the model's FP4 layers (quantizers/fp4.py keeps them in its FP4Linear
    layers, not in RunContext.quantized), which MXFP4 blocks hold exactly."""
    from compress.quantizers.fp4 import fp4_records

    return {**records, **fp4_records(model)}


def check(cfg: GGUFExportConfig, model: nn.Module, records: dict[str, QuantizedWeight], has_eval: bool) -> None:
    """Fail fast (before evaluation) on an export that cannot be made."""
    records = with_fp4_records(model, records)
    cfg = with_records_quantizer(cfg, records)
    architecture_of(model)
    if cfg.quantizer == "records":
        plan_tensors(model, records, resolve_type(cfg.type, records), cfg.float_type, cfg.fallback, not cfg.keep_float)
    if cfg.verify:
        gguf_runtime.llama_cpp()
        if not has_eval:
            raise FormatError(
                "verify: true scores the GGUF on the evaluation chunks, and the recipe has no data.evaluation; "
                "add it, or set verify: false on the export"
            )


def export(
    directory: Path,
    cfg: GGUFExportConfig,
    model: nn.Module,
    tokenizer: Any,
    records: dict[str, QuantizedWeight],
    inputs: VerifyInputs,
    reporter: Reporter,
    label: str,
    kv: KVCacheScheme | None = None,
) -> tuple[dict[str, Any], list[Evaluation]]:
    """Write, read back and verify one GGUF export; return its manifest entry and evaluations.
    With a KV-cache scheme, the matching llama.cpp cache types go into ``compress.kv_cache.*`` metadata."""
    records = with_fp4_records(model, records)
    cfg = with_records_quantizer(cfg, records)
    directory.mkdir(parents=True, exist_ok=True)
    kv_hint = kv_cache_hint(kv)
    metadata = {f"kv_cache.{k}": v for k, v in kv_hint.items()} if kv_hint else None
    path = directory / GGUF_FILE
    source_gguf = inputs.source if is_gguf_file(inputs.source) else None  # its tokenizer is the truth
    with reporter.status(f"{label} writing GGUF ({cfg.type}, quantizer {cfg.quantizer})"):
        if cfg.quantizer == "records":
            type_name = resolve_type(cfg.type, records)
            facts = write_gguf(
                path,
                model,
                tokenizer,
                records,
                type_name,
                cfg.float_type,
                cfg.fallback,
                cfg.pre_tokenizer,
                metadata,
                source_gguf,
                share_head=not cfg.keep_float,
            )
            problems = check_gguf_records(path, facts["plan"], records)
            if problems:
                raise FormatError(f"{label}: reading the GGUF back does not give the records: {'; '.join(problems[:5])}")
            exact = sum(1 for t in facts["plan"].tensors if t.source == "record")
            shared = facts["plan"].one_table
        else:
            type_name, shared = cfg.type, None
            with tempfile.TemporaryDirectory(dir=directory) as tmp:
                f16 = Path(tmp) / "f16.gguf"
                facts = write_gguf(f16, model, tokenizer, records, "f16", None, None, cfg.pre_tokenizer, metadata, source_gguf)
                gguf_runtime.quantize(f16, path, cfg.type, inputs.threads, token_embedding_type=cfg.float_type)
            exact = 0
            facts["tensor_types"] = stored_type_counts(path)  # what llama.cpp chose, not our F16 input
    facts.pop("plan")
    entry: dict[str, Any] = {
        "name": cfg.name,
        "format": "gguf",
        "path": None,  # set by recipe_exports.write_exports
        "type": type_name,
        "quantizer": cfg.quantizer,
        "layers": len(records),
        "records_exact": exact,
        "fallbacks": facts["fallbacks"],
        "type_fallbacks": facts["type_fallbacks"],
        "tensor_types": facts["tensor_types"],
        "tensor_type_of": stored_types(path),  # every tensor, as llama.cpp will read it
        "tokenizer": facts["tokenizer"],
        "architecture": facts["architecture"],
        "size_bytes": path.stat().st_size,
        "verified": False,
        "check": "records read back bit-exact with gguf's dequantizer" if exact else "written by llama.cpp's quantizer",
    }
    if shared is not None:
        entry["one_table"] = (
            f"{shared.gguf_name} holds the head's record ({shared.type_name.upper()}); no output.weight: llama.cpp reads it for both"
        )
    if kv_hint is not None:
        entry["kv_cache"] = kv_hint
    if cfg.target is not None:
        entry["target"] = check_target(path, cfg, label)
    evaluations: list[Evaluation] = []
    if cfg.verify:
        # a shared table: the file's embeddings are the head's record, the in-memory model's are float
        embedding = records[HEAD_RECORD].dequantize() if shared is not None else None
        evaluation = verify(
            path,
            cfg,
            tokenizer,
            inputs,
            reporter,
            label,
            same_weights=cfg.quantizer == "records",
            source_gguf=source_gguf,
            embedding=embedding,
        )
        if kv_hint is not None and kv_hint["carried"]:
            kv_hint["measured_in_llama_cpp"] = verify_kv_cache(path, kv_hint["type_k"], inputs, reporter, label)
        evaluations.append(evaluation)
        entry["verified"] = True
        entry["check"] += "; verified in llama.cpp (tokenizer parity, same-weights KL, metrics vs baseline)"
    return entry, evaluations


def check_target(path: Path, cfg: GGUFExportConfig, label: str) -> dict[str, Any]:
    """The written file against the export's size budget: its tensor bytes, bits per weight (tensor
    bytes x 8 / parameters, as llama.cpp reports them) and file size; over the budget is an error."""
    target = cfg.target
    assert target is not None
    tensor_bytes, params = tensor_totals(path)
    size = path.stat().st_size
    reached = {
        "requested": target.model_dump(mode="json", exclude={"types", "samples"}),
        "bits_per_weight": round(8 * tensor_bytes / params, 4),
        "tensor_bytes": tensor_bytes,
        "file_bytes": size,
        "parameters": params,
    }
    over = 8 * tensor_bytes / params > target.bits_per_weight if target.bits_per_weight is not None else size > target.size_mib * 2**20
    if over:
        raise FormatError(
            f"{label}: the GGUF file is over its target ({target.describe()}): {reached['bits_per_weight']} bits/weight, "
            f"{size / 2**20:.2f} MiB. Were the records quantized by a stage with gguf_target: true for this export?"
        )
    return reached


KV_CACHE_CHUNKS = 4  # evaluation chunks the llama.cpp KV-cache check scores


def kv_cache_hint(kv: KVCacheScheme | None) -> dict[str, Any] | None:
    """The llama.cpp cache types matching a KV scheme (``type_k``/``type_v``), or why there are none."""
    if kv is None:
        return None
    llama = kv.config.runtime_support()["llama.cpp"]
    hint: dict[str, Any] = {"scheme": kv.config.describe(), "carried": llama["supported"]}
    if llama["supported"]:
        hint.update(type_k=llama["type_k"], type_v=llama["type_v"])
    else:
        hint["why"] = llama["why"]
    return hint


def verify_kv_cache(path: Path, cache_type: str, inputs: VerifyInputs, reporter: Reporter, label: str) -> dict[str, Any]:
    """The GGUF in llama.cpp with its KV cache stored as ``cache_type`` against the same file with an
    f16 cache (both with flash attention), on up to KV_CACHE_CHUNKS evaluation chunks. llama.cpp
    writes each batch's keys and values into the cache before attending, so a whole-chunk
    evaluation reads them back quantized."""
    assert inputs.chunks is not None
    chunks = inputs.chunks[:KV_CACHE_CHUNKS]
    n_ctx = int(chunks.shape[1])
    reference = gguf_runtime.LlamaCppModel(path, n_ctx=n_ctx, threads=inputs.threads, cache_type="f16")
    try:
        quantized = gguf_runtime.LlamaCppModel(path, n_ctx=n_ctx, threads=inputs.threads, cache_type=cache_type)
    except FormatError as exc:  # e.g. a head size that is not a multiple of the cache type's block
        reference.close()
        return {"type_k": cache_type, "type_v": cache_type, "measured": False, "why": f"llama.cpp refused the cache type: {exc}"}
    try:
        with reporter.status(f"{label} KV cache {cache_type} in llama.cpp ({chunks.shape[0]} chunks)"):
            metrics = compare(reference.forward, {"kv": quantized.forward}, chunks, inputs.min_context)["kv"]
    finally:
        reference.close()
        quantized.close()
    return {
        "type_k": cache_type,
        "type_v": cache_type,
        "measured": True,
        "reference": "the same GGUF with an f16 cache",
        "chunks": int(chunks.shape[0]),
        "seq_len": n_ctx,
        **metrics,
    }


def check_tokenizer(path: Path, tokenizer: Any, texts: list[str], source_gguf: Path | None, label: str) -> dict[str, Any]:
    """llama.cpp on the exported file tokenizes ``texts`` exactly as the source's own tokenizer does:
    the source GGUF's in llama.cpp when the source is a GGUF (and its special ids, pre-tokenizer
    and chat template are the same keys), else the source's tokenizer.json in transformers.
    Raises FormatError naming the first difference; returns the facts for the report."""
    ours = gguf_runtime.LlamaCppVocab(path)
    checked_ids: dict[str, int] = {}
    try:
        if source_gguf is not None:
            truth = gguf_runtime.LlamaCppVocab(source_gguf)
            try:
                mismatches = compare_tokenizers(ours.tokenize, truth.tokenize, texts, ("export", "source"), truth.token_text)
            finally:
                truth.close()
            want, got = tokenizer_metadata(source_gguf), tokenizer_metadata(path)
            differ = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
            if differ:
                raise FormatError(
                    f"{label}: the GGUF's tokenizer settings differ from the source GGUF's: "
                    + "; ".join(f"{k}: {got.get(k)!r} (source {want.get(k)!r})" for k in differ[:5])
                )
            truth_name = f"the source GGUF's tokenizer ({source_gguf.name}) in llama.cpp"
        else:
            mismatches = tokenization_mismatches(ours.tokenize, tokenizer, texts)
            truth_name = "the source's Hugging Face tokenizer"
            checked_ids, got_ids = special_ids(tokenizer), ours.special_ids()
            differ = [k for k in checked_ids if got_ids[k] != checked_ids[k]]
            if differ:
                raise FormatError(
                    f"{label}: llama.cpp reads other special tokens from the GGUF than the source's tokenizer has: "
                    + "; ".join(
                        f"{k} {got_ids[k]} (source {checked_ids[k]} {tokenizer.convert_ids_to_tokens(checked_ids[k])!r})" for k in differ
                    )
                )
    finally:
        ours.close()
    if mismatches:
        raise FormatError(
            f"{label}: llama.cpp tokenizes {len(mismatches)} of {len(texts)} parity texts differently from "
            f"{truth_name} (first: {mismatches[0]}); set pre_tokenizer: on the export if the recognized one is wrong"
        )
    return {
        "tokenizer_parity_texts": len(texts),
        "tokenizer_parity_bytes": sum(len(t.encode()) for t in texts),
        "tokenizer_truth": truth_name,
        **({"tokenizer_special_ids": checked_ids} if checked_ids else {}),
    }


def verify(
    path: Path,
    cfg: GGUFExportConfig,
    tokenizer: Any,
    inputs: VerifyInputs,
    reporter: Reporter,
    label: str,
    same_weights: bool,
    source_gguf: Path | None = None,
    embedding: torch.Tensor | None = None,
) -> Evaluation:
    assert inputs.chunks is not None
    chunks = inputs.chunks if cfg.verify_samples is None else inputs.chunks[: cfg.verify_samples]
    with reporter.status(f"{label} tokenizer parity in llama.cpp"):
        texts = [*parity_corpus(tokenizer), *(tokenizer.decode(row[:128]) for row in chunks[:4])]
        parity = check_tokenizer(path, tokenizer, texts, source_gguf, label)
    runtime = gguf_runtime.LlamaCppModel(path, n_ctx=int(chunks.shape[1]), threads=inputs.threads)
    try:
        details: dict[str, Any] = {
            "file": path.name,
            "size_bytes": path.stat().st_size,
            "chunks": int(chunks.shape[0]),
            "seq_len": int(chunks.shape[1]),
            "min_context": inputs.min_context,
            **parity,
        }
        if same_weights:
            sub = chunks[:SAME_WEIGHTS_CHUNKS]
            with reporter.status(f"{label} same-weights check in llama.cpp ({sub.shape[0]} chunks)"):
                reference = inputs.compressed_forward
                if embedding is not None:
                    reference = tables_forward(inputs.compressed, compute_device(inputs.compressed), embedding, None)
                got = compare(reference, {"gguf": runtime.forward}, sub, inputs.min_context)
            kl = float(got["gguf"]["kl_divergence"])
            details["same_weights_kl"] = kl
            details["same_weights_top1"] = float(got["gguf"]["top1_agreement"])
            if kl > cfg.same_weights_max_kl:
                raise FormatError(
                    f"{label}: llama.cpp on the GGUF differs from our model with the same weights by KL {kl:.4f} "
                    f"> same_weights_max_kl {cfg.same_weights_max_kl}: a layout bug, or set the tolerance higher"
                )
        metrics = compare(
            inputs.baseline,
            {"gguf": runtime.forward},
            chunks,
            inputs.min_context,
            progress=reporter.track,
        )["gguf"]
        details["sample"] = {"prompt": GENERATION_PROMPT, "greedy": runtime.generate(GENERATION_PROMPT)}
    finally:
        runtime.close()
    return Evaluation(artifact=cfg.name, runtime="llama.cpp", device="cpu", metrics=metrics, details=details)
