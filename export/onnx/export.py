"""The ``exports: [{format: onnx, ...}]`` step: onnxruntime-genai's model builder writes the graph
(MatMulNBits + GroupQueryAttention with a KV cache, and genai_config.json); for quantized models we
hand it our GPTQ checkpoint and then prove that every MatMulNBits node holds exactly our codes,
scales and zero points. When the builder cannot read the checkpoint (partial last groups, …) or
reads it differently, it builds the graph from the float model and we write the MatMulNBits
initializers ourselves, and prove them the same way. Then the verifier runs the file: tokenizer
parity with ONNX Runtime GenAI, a same-weights check (exact at accuracy level 0, and as shipped),
metrics against the torch baseline, and a greedy sample with its decode speed.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from compress.errors import FormatError
from compress.eval.metrics import Evaluation, compare, tables_forward
from compress.export.checkpoint import autogptq
from compress.export.checkpoint.hf_checkpoint import save_sharded
from compress.export.onnx import builder as ob
from compress.export.onnx import matmulnbits as mnb
from compress.export.onnx import tables as tb
from compress.export.onnx import w8a8 as qdq
from compress.export.onnx.config import W8A8_TABLES, ONNXExportConfig
from compress.export.onnx.names import ONNX_FILE
from compress.export.parity import SAME_WEIGHTS_CHUNKS, VerifyInputs, parity_corpus, special_ids, tokenization_mismatches
from compress.hf_model import float_tensors, write_config_and_tokenizer
from compress.progress import Reporter
from compress.quantizers.core import QuantizedWeight, refuse_gguf_grids
from compress.quantizers.kv_cache import KVCacheScheme, kv_geometry
from compress.streaming import compute_device

BUILDER_LOG = "builder.log"
LEVEL0_FILE = "model.level0.onnx"  # transient copy for the exactness check, removed after it
EXACT_MAX_KL = 1e-3  # level 0 computes in float: what is left is summation order
GENERATION_PROMPT = "The quick brown fox"
GENERATED_TOKENS = 32
INT_BITS = {"int4": 4, "int8": 8}
W8A8_CHECK = (
    "every W8A8 MatMul read back: int8 weight initializer equal to the record's codes, per-channel DequantizeLinear "
    "scales equal to the record's scales, input quantized per token (QuantizeLinear / DequantizeLinear)"
)
GQA_HEAD_MULTIPLE = 16  # ONNX Runtime's CPU GroupQueryAttention kernel


def resolve(cfg: ONNXExportConfig, records: dict[str, QuantizedWeight], model: nn.Module | None = None) -> tuple[str, str | None]:
    """(precision, quantizer) for this model: auto is w8a8 for a w8a8 stage's records (their modules quantize
    activations), else follows the records' bits."""
    precision = cfg.precision
    if precision == "auto" and model is not None and qdq.w8a8_layers(model, records):
        precision = qdq.PRECISION
    elif precision == "auto":
        bits = {r.scheme.bits for r in records.values()}
        if not records:
            precision = "fp32"
        elif bits in ({4}, {8}):
            precision = f"int{bits.pop()}"
        else:
            raise FormatError(
                f"precision auto: the records have {sorted(bits)} bits; MatMulNBits holds 4 or 8 bits, one per "
                "export (set precision: fp32 for a float export of the dequantized weights)"
            )
    if precision == qdq.PRECISION:
        return precision, "records"
    if precision not in INT_BITS:
        return precision, None
    return precision, cfg.quantizer or ("records" if records else "builder")


def check(cfg: ONNXExportConfig, model: nn.Module, records: dict[str, QuantizedWeight], has_eval: bool) -> None:
    """Fail fast (before evaluation) on an export that cannot be made."""
    ob.require()
    head_dim = kv_geometry(model.config)[2]
    if cfg.device == "cpu" and head_dim % GQA_HEAD_MULTIPLE:
        raise FormatError(
            f"ONNX Runtime's CPU GroupQueryAttention needs a head size that is a multiple of {GQA_HEAD_MULTIPLE}; "
            f"this model's is {head_dim}"
        )
    precision, quantizer = resolve(cfg, records, model)
    check_w8a8(cfg, model, records, precision)
    if quantizer == "records" and precision != qdq.PRECISION:
        refuse_gguf_grids(records, "onnx")
        if not records:
            raise FormatError("quantizer records: no layer is quantized; add a quantize stage or use quantizer: builder")
        bits = {r.scheme.bits for r in records.values()}
        if bits != {INT_BITS[precision]}:
            raise FormatError(f"precision {precision} holds {INT_BITS[precision]}-bit records; these have {sorted(bits)} bits")
        mnb.common_block_size(records)
        tb.check(records, cfg.float_tables(precision))
    if cfg.verify and not has_eval:
        raise FormatError(
            "verify: true scores the ONNX model on the evaluation chunks, and the recipe has no data.evaluation; "
            "add it, or set verify: false on the export"
        )


def check_w8a8(cfg: ONNXExportConfig, model: nn.Module, records: dict[str, QuantizedWeight], precision: str) -> None:
    """A w8a8 export holds a w8a8 stage's layers and nothing else; those layers go nowhere else (a weight-only
    precision would run them on float activations: recipe validation refuses that, this catches the rest)."""
    w8a8 = qdq.w8a8_layers(model, records)
    if precision != qdq.PRECISION:
        if w8a8:
            raise FormatError(f"precision {precision}: {w8a8[0]} quantizes its activations (w8a8); set precision: w8a8 or auto")
        return
    if not w8a8:
        raise FormatError(
            "precision w8a8 holds a w8a8 quantize stage's layers, and this model has none; add the stage or set precision: auto"
        )
    others = sorted(set(records) - set(w8a8))
    if others:
        raise FormatError(f"precision w8a8: {others[0]} is quantized weight-only by another stage; a w8a8 export holds w8a8 layers only")
    if cfg.keep_float is not None:
        raise FormatError(W8A8_TABLES)


def builder_options(
    cfg: ONNXExportConfig,
    precision: str,
    quantizer: str | None,
    records: dict[str, QuantizedWeight],
    kv_options: dict[str, str],
    model_config: Any = None,
) -> dict[str, Any]:
    """The builder's --extra_options. With our records (the head's among them when the file quantizes
    it) the builder never quantizes anything itself: the embedding Gather stays float for
    tables.write_embeddings, and the head is a MatMulNBits node only when it has a record. The
    builder's own quantizer follows keep_float (its int8 has no quantized gather)."""
    options: dict[str, Any] = dict(kv_options)
    if precision in INT_BITS:
        if quantizer == "builder":
            floats = set(cfg.float_tables(precision)) | ({"embeddings"} if precision == "int8" else set())
            excluded = [n for n, t in ((ob.HEAD_NODE, "lm_head"), (ob.EMBEDDING_NODE, "embeddings")) if t in floats]
            if excluded:
                options["nodes_to_exclude"] = excluded
            if not cfg.symmetric and not floats and getattr(model_config, "tie_word_embeddings", False):
                # onnxruntime-genai 0.18's one table for a tied model reads the float weight's name when the blocks are
                # asymmetric, and ONNX Runtime refuses the file; unshared, the builder keeps the embedding table float
                options["shared_embeddings"] = False
            options.update(block_size=cfg.block_size or 32, is_symmetric=cfg.symmetric)
        else:
            head_quantized = ob.HEAD_LAYER in records
            options["nodes_to_exclude"] = [n for n in ob.FLOAT_NODES if not (head_quantized and n == ob.HEAD_NODE)]
            options["shared_embeddings"] = False  # a shared table is ours to write and prove (tables.py)
            options.update(block_size=mnb.common_block_size(records), is_symmetric=all(r.scheme.symmetric for r in records.values()))
    return options


def _save_float(directory: Path, model: nn.Module, tokenizer: Any) -> None:
    """The model as a float Hugging Face directory (quantized layers hold their dequantized records),
    written shard by shard (hf_checkpoint.SHARD_BYTES) as the streamed model's units are read."""
    write_config_and_tokenizer(directory, model, tokenizer)
    save_sharded(directory, float_tensors(model, {}))


def _fresh(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)


def build(
    directory: Path,
    cfg: ONNXExportConfig,
    model: nn.Module,
    tokenizer: Any,
    records: dict[str, QuantizedWeight],
    kv_options: dict[str, str],
) -> tuple[dict[str, Any], Any]:
    """Run the builder into ``directory`` and put our records into the graph. Returns how the weights got
    there and the graph, loaded with its weights for an int precision (the caller proves and saves it)."""
    precision, quantizer = resolve(cfg, records, model)
    options = builder_options(cfg, precision, quantizer, records, kv_options, model.config)
    log = directory.parent / f".{directory.name}.{BUILDER_LOG}"
    facts: dict[str, Any] = {"precision": precision, "device": cfg.device, "quantizer": quantizer, "builder_options": options}
    graph = None
    with tempfile.TemporaryDirectory(dir=directory.parent, prefix=f".{directory.name}.src-") as tmp:
        gptq, float_dir = Path(tmp) / "gptq", Path(tmp) / "float"
        if precision == qdq.PRECISION:
            _save_float(float_dir, model, tokenizer)
            _fresh(directory)
            ob.run_builder(float_dir, directory, qdq.BUILDER_PRECISION, cfg.device, options, log)
            graph = ob.load(directory)
            facts["nodes_written"] = qdq.write_w8a8(graph, records)
            facts["weights_written_by"] = (
                "compress: the builder's fp32 graph, each W8A8 layer's MatMul replaced by a Q/DQ subgraph of its record "
                "(int8 weights, per-token int8 activations)"
            )
        elif quantizer == "records":
            try:
                autogptq.write(gptq, model, tokenizer, records)
                _fresh(directory)
                ob.run_builder(gptq, directory, precision, cfg.device, options, log)
                graph = ob.load(directory)
                problems = ob.compare_records(graph, records)["problems"]
                if not problems:
                    facts["weights_written_by"] = "onnxruntime-genai's builder, from our GPTQ checkpoint (proven equal)"
                else:
                    facts["gptq_handoff"] = f"the builder read our GPTQ checkpoint differently: {problems[0]}"
            except FormatError as exc:
                facts["gptq_handoff"] = f"the builder could not take our GPTQ checkpoint: {str(exc).strip().splitlines()[-1][:300]}"
            if "weights_written_by" not in facts:
                _save_float(float_dir, model, tokenizer)
                _fresh(directory)
                ob.run_builder(float_dir, directory, precision, cfg.device, options, log)
                graph = ob.load(directory)
                facts["nodes_written"] = ob.write_records(graph, records)
                facts["weights_written_by"] = (
                    "compress: the builder's graph from the float model, our records packed into its MatMulNBits nodes"
                )
        else:
            _save_float(float_dir, model, tokenizer)
            _fresh(directory)
            ob.run_builder(float_dir, directory, precision, cfg.device, options, log)
            facts["weights_written_by"] = "onnxruntime-genai's builder" + (" (its own round-to-nearest quantizer)" if quantizer else "")
            if precision in INT_BITS:
                graph = ob.load(directory)
    shutil.move(str(log), directory / BUILDER_LOG)
    return facts, graph


def export(
    directory: Path,
    cfg: ONNXExportConfig,
    model: nn.Module,
    tokenizer: Any,
    records: dict[str, QuantizedWeight],
    inputs: VerifyInputs | None,
    reporter: Reporter,
    label: str,
    kv: KVCacheScheme | None = None,
) -> tuple[dict[str, Any], list[Evaluation]]:
    """Write, prove and verify one ONNX export; return its manifest entry and evaluations."""
    with reporter.status(f"{label} building ONNX with onnxruntime-genai's builder"):
        entry, tables = _write(directory, cfg, model, tokenizer, records, kv, label)
    evaluations: list[Evaluation] = []
    skipped = unverifiable(cfg)
    if cfg.verify and skipped:  # said in the manifest and report.json; a gate on the export fails as unmeasured
        entry["verification_skipped"] = skipped
    elif cfg.verify:
        assert inputs is not None
        evaluation = verify(
            directory, cfg, tokenizer, inputs, reporter, label, entry["precision"] in INT_BITS, tables, entry["precision"] != qdq.PRECISION
        )
        evaluations.append(evaluation)
        entry["verified"] = True
        entry["check"] += "; verified in ONNX Runtime (tokenizer parity, same-weights KL, metrics vs baseline, GenAI generation)"
    return entry, evaluations


def unverifiable(cfg: ONNXExportConfig) -> str | None:
    """Why this machine cannot run the export, or None: a CUDA build needs ONNX Runtime's CUDA provider."""
    import onnxruntime as ort

    if cfg.device == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
        return "built for CUDA and this onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu on a machine with an NVIDIA GPU)"
    return None


def write(
    directory: Path,
    cfg: ONNXExportConfig,
    model: nn.Module,
    tokenizer: Any,
    records: dict[str, QuantizedWeight],
    kv: KVCacheScheme | None = None,
    label: str = "onnx",
) -> dict[str, Any]:
    """Build the export into ``directory``, prove it holds the records, set the shipped accuracy level and
    make its tokenizer.json readable by onnxruntime-extensions; returns the manifest entry."""
    return _write(directory, cfg, model, tokenizer, records, kv, label)[0]


def _write(
    directory: Path,
    cfg: ONNXExportConfig,
    model: nn.Module,
    tokenizer: Any,
    records: dict[str, QuantizedWeight],
    kv: KVCacheScheme | None,
    label: str,
) -> tuple[dict[str, Any], tb.Tables]:
    directory.mkdir(parents=True, exist_ok=True)
    scale_file = directory.parent / f".{directory.name}.{KV_SCALE_FILE}"
    kv_entry, kv_options = kv_cache_options(kv, model.config, scale_file, cfg.device)
    precision, quantizer = resolve(cfg, records, model)
    tables, file_records = tb.Tables(), records
    if precision == qdq.PRECISION:
        tables.facts = w8a8_tables(records)
    elif quantizer == "records":
        tables = tb.plan(model, records, cfg.float_tables(precision), INT_BITS[precision], mnb.common_block_size(records))
        if tables.head_rounded_here:  # handed over and proven like the others
            file_records = {**records, tb.HEAD: tables.head}
    facts, graph = build(directory, cfg, model, tokenizer, file_records, kv_options)
    if scale_file.exists():
        shutil.move(str(scale_file), directory / KV_SCALE_FILE)
    if graph is None:  # a float export: nothing to edit, the op counts need no weights
        graph = ob.load(directory, with_data=False)
    proof = None
    if facts["precision"] == qdq.PRECISION:
        proof = qdq.compare_w8a8(graph, records)
        if proof["problems"]:
            raise FormatError(f"{label}: the ONNX file does not hold the W8A8 records: {'; '.join(proof['problems'][:5])}")
        ob.save(graph, directory)
    elif facts["quantizer"] == "records":
        proof = ob.compare_records(graph, file_records)
        if proof["problems"]:  # a packing bug: never ship a file that does not hold the records
            raise FormatError(f"{label}: the ONNX file does not hold the records: {'; '.join(proof['problems'][:5])}")
    if facts["precision"] in INT_BITS:
        if proof is not None:
            ob.drop_default_zero_points(graph)  # absent zero points read as the default
            tb.write_embeddings(graph, tables)
            proof = ob.compare_records(graph, file_records)  # after every edit: what ships is what is proven
            problems = proof["problems"] + tb.compare_embeddings(graph, tables)
            if problems:
                raise FormatError(f"{label}: after the graph edits the ONNX file does not hold the records: {'; '.join(problems[:3])}")
        ob.set_accuracy_level(graph, cfg.accuracy_level)
        ob.save(graph, directory)
    files = [directory / ONNX_FILE, directory / ob.DATA_FILE]
    entry: dict[str, Any] = {
        "name": cfg.name,
        "format": "onnx",
        "path": None,  # set by recipe_exports.write_exports
        **facts,
        "accuracy_level": cfg.accuracy_level if facts["precision"] in INT_BITS else None,
        "layers": len(records),
        "records_exact": proof["layers"] if proof else 0,
        "tables": tables.facts or _builder_tables(graph, facts["precision"]),
        "ops": ob.op_counts(graph),
        "tokenizer_json_changes": ob.normalize_tokenizer(directory),
        "genai_config_changes": ob.align_generation_ids(directory, tokenizer),
        "size_bytes": sum(f.stat().st_size for f in files if f.exists()),
        "builder_version": _version("onnxruntime-genai"),
        "verified": False,
        "check": (
            W8A8_CHECK
            if facts["precision"] == qdq.PRECISION
            else "every MatMulNBits node unpacked and compared with the records: codes, scales and zero points identical"
            if proof
            else "written by onnxruntime-genai's builder"
        ),
    }
    if tables.embedding is not None:
        entry["check"] += f"; the embedding table in {tb.GATHER_NODE} compared with its record the same way"
    if kv_entry is not None:
        entry["kv_cache"] = kv_entry
    return entry, tables


def w8a8_tables(records: dict[str, QuantizedWeight]) -> dict[str, Any]:
    """A w8a8 file's head and embeddings: as the quantize stage left them."""
    head = {"type": "w8a8", "record": "the quantize stage's"} if tb.HEAD in records else {"type": "float"}
    return {tb.HEAD: head, tb.EMBEDDINGS: {"type": "float"}}


def _builder_tables(graph: Any, precision: str) -> dict[str, Any]:
    """The head and embeddings of a file whose weights are the builder's (float, or its own quantizer),
    as its graph has them: a MatMulNBits head, a GatherBlockQuantized embedding lookup."""
    quantized = {
        tb.HEAD: any(names == (tb.HEAD,) for _, names in ob.quantized_nodes(graph)),
        tb.EMBEDDINGS: any(n.op_type == "GatherBlockQuantized" for n in graph.graph.node),
    }
    return {name: {"type": f"{precision} (the builder's own quantizer)" if q else "float"} for name, q in quantized.items()}


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


# --------------------------------------------------------------------------- KV cache


KV_SCHEMES = {("int", 8): "int8", ("int", 4): "int4", ("fp8", 8): "fp8"}
KV_SCALE_FILE = "kv_cache_scales.json"


def kv_cache_options(
    kv: KVCacheScheme | None, config: Any, scale_file: Path, device: str = "cpu"
) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """The builder's kv_cache_quant_scheme / kv_cache_scale_file for a KV scheme, or why it is not carried.
    ONNX Runtime's CPU GroupQueryAttention quantizes the cache with static scales per tensor or per
    channel; our static per-(layer, KV head) scales become per-channel scales (each head's scale over its
    head_dim channels). Dynamic schemes (per-token or per-group scales computed as tokens arrive, a
    full-precision window) have no ONNX Runtime GenAI equivalent on CPU."""
    if kv is None:
        return None, {}
    cfg = kv.config
    entry: dict[str, Any] = {"scheme": cfg.describe()}
    prefix = KV_SCHEMES.get((cfg.format, cfg.bits))
    why = None
    if prefix is None:
        why = f"ONNX Runtime GenAI quantizes the KV cache to int8, int4 or fp8; not {cfg.format}{cfg.bits}"
    elif prefix == "fp8" and device == "cpu":
        why = "ONNX Runtime's CPU GroupQueryAttention has no fp8 KV cache (onnxruntime 1.31 runs it on CUDA only)"
    elif not cfg.static_scales or kv.scales is None:
        why = (
            "dynamic scales (per token or per group, computed as tokens arrive) have no ONNX Runtime GenAI equivalent on CPU: "
            "its GroupQueryAttention needs static per-tensor or per-channel scales (set static_scales: true)"
        )
    if why:
        return {**entry, "carried": False, "why": why}, {}
    head_dim = kv_geometry(config)[2]
    k, v = kv.scales["k_scale"].float(), kv.scales["v_scale"].float()  # [layers, kv_heads]
    per_channel = {"k_scales": k.repeat_interleave(head_dim, dim=1).tolist(), "v_scales": v.repeat_interleave(head_dim, dim=1).tolist()}
    scale_file.write_text(json.dumps({"scales": per_channel}))
    scheme = f"{prefix}_per_channel"
    entry.update(
        carried=True,
        kv_cache_quant_scheme=scheme,
        scale_file=KV_SCALE_FILE,
        note="our static per-(layer, KV head) scales, repeated over each head's channels",
    )
    return entry, {"kv_cache_quant_scheme": scheme, "kv_cache_scale_file": str(scale_file)}


# --------------------------------------------------------------------------- verifier


def verify(
    directory: Path,
    cfg: ONNXExportConfig,
    tokenizer: Any,
    inputs: VerifyInputs,
    reporter: Reporter,
    label: str,
    quantized: bool,
    tables: tb.Tables | None = None,
    exact: bool = True,
) -> Evaluation:
    """``exact``: the file computes our model up to float summation order, so its same-weights KL must be below
    EXACT_MAX_KL. Not for w8a8: its per-token int8 activations turn float32 rounding differences into code flips
    that cascade through the layers (qdq.NOT_EXACT), so only ``same_weights_max_kl`` applies."""
    from compress.export.onnx import runtime as rt

    assert inputs.chunks is not None
    chunks = inputs.chunks if cfg.verify_samples is None else inputs.chunks[: cfg.verify_samples]
    details: dict[str, Any] = {
        "file": ONNX_FILE,
        "chunks": int(chunks.shape[0]),
        "seq_len": int(chunks.shape[1]),
        "min_context": inputs.min_context,
        "accuracy_level": cfg.accuracy_level if quantized else None,
    }
    texts = [*parity_corpus(tokenizer), *(tokenizer.decode(row[:128]) for row in chunks[:4])]
    with rt.GenAIModel(directory, inputs.threads) as genai:
        mismatches = tokenization_mismatches(genai.encode, tokenizer, texts, "onnxruntime-genai", add_special_tokens=True)
        if not mismatches:
            prompt = genai.encode(GENERATION_PROMPT)
            new, timing = genai.greedy(prompt, GENERATED_TOKENS)
            details["sample"] = {"prompt": GENERATION_PROMPT, "greedy": genai.decode(new), **timing}
    if mismatches:
        raise FormatError(
            f"{label}: ONNX Runtime GenAI tokenizes {len(mismatches)} of {len(texts)} sample texts differently "
            f"from the Hugging Face tokenizer (first: {mismatches[0]})"
        )
    details["tokenizer_parity_texts"] = len(texts)
    details["tokenizer_parity_bytes"] = sum(len(t.encode()) for t in texts)
    stops = rt.genai_config(directory)["model"].get("eos_token_id")
    stops = stops if isinstance(stops, list) else [stops]
    want = special_ids(tokenizer)
    missing = [f"{k} {want[k]}" for k in ("eos", "eot") if k in want and want[k] not in stops]
    if missing:
        raise FormatError(f"{label}: ONNX Runtime GenAI stops generating at {stops}, not at the source's {', '.join(missing)}")
    details["tokenizer_special_ids"], details["generation_stop_ids"] = want, stops
    reference = inputs.compressed_forward
    if tables is not None and (tables.embedding is not None or tables.head_rounded_here):
        # the file's head / embeddings differ from the in-memory model's: the same weights are the model with the file's tables
        reference = tables_forward(
            inputs.compressed,
            compute_device(inputs.compressed),
            None if tables.embedding is None else tables.embedding.dequantize(),
            None if tables.head is None else tables.head.dequantize(),
        )
    sub = chunks[:SAME_WEIGHTS_CHUNKS]
    session = rt.OrtDecoder(directory / ONNX_FILE, inputs.threads, cfg.device)
    candidates = {"shipped": session.forward}
    level0 = directory / LEVEL0_FILE if quantized and cfg.accuracy_level != 0 else None
    try:
        if level0 is not None:  # the same file computing in float: initializers stay in model.onnx.data, which it references
            import onnx

            graph = ob.load(directory, with_data=False)
            ob.set_accuracy_level(graph, 0)
            onnx.save_model(graph, str(level0))
            candidates["level0"] = rt.OrtDecoder(level0, inputs.threads, cfg.device).forward
        with reporter.status(
            f"{label} same-weights check in ONNX Runtime ({sub.shape[0]} chunks"
            + (", as shipped and at accuracy level 0)" if level0 else ")")
        ):
            got = compare(reference, candidates, sub, inputs.min_context)  # one torch pass serves both sessions
    finally:
        if level0 is not None:
            level0.unlink(missing_ok=True)
    details["same_weights_kl"] = float(got["shipped"]["kl_divergence"])
    details["same_weights_top1"] = float(got["shipped"]["top1_agreement"])
    if "level0" in got:
        details["level0_same_weights_kl"] = float(got["level0"]["kl_divergence"])
        details["level0_same_weights_top1"] = float(got["level0"]["top1_agreement"])
    else:  # the shipped file already computes in float
        details["level0_same_weights_kl"] = details["same_weights_kl"]
    if not exact:
        details["same_weights_note"] = qdq.NOT_EXACT
    elif details["level0_same_weights_kl"] > EXACT_MAX_KL:
        raise FormatError(
            f"{label}: ONNX Runtime at accuracy level 0 differs from our model with the same weights by KL "
            f"{details['level0_same_weights_kl']:.2e} > {EXACT_MAX_KL}: the graph does not compute our model"
        )
    if details["same_weights_kl"] > cfg.same_weights_max_kl:
        raise FormatError(
            f"{label}: ONNX Runtime (accuracy level {cfg.accuracy_level}) differs from our model with the same "
            f"weights by KL {details['same_weights_kl']:.4f} > same_weights_max_kl {cfg.same_weights_max_kl}"
        )
    metrics = compare(inputs.baseline, {"onnx": session.forward}, chunks, inputs.min_context, progress=reporter.track)["onnx"]
    return Evaluation(artifact=cfg.name, runtime="onnxruntime", device=cfg.device, metrics=metrics, details=details)
