"""`compress bench onnx`: int4 ONNX made from our GPTQ/AWQ records (proven to hold them exactly)
against onnxruntime-genai's builder quantizing the same float model itself at the same block size,
all run in ONNX Runtime.

The reference is the builder's fp32 ONNX of the baseline; every candidate is scored against it on
the same evaluation chunks in an ONNX Runtime session at the candidate's shipped accuracy level
(KL, top-1 agreement, perplexity), with its file size and ONNX Runtime GenAI's single-stream decode
speed (median of repeats). Every file has the builder's int4 layout unless ``keep_float`` says
otherwise: the output head and the token embeddings quantized too (one table for a tied model), so
the files compare at equal bytes. Each of our rows is paired with the builder's row of the same
block size and symmetry: the ratios of size, KL and decode speed, and a flag when the sizes differ
by more than ``SIZE_TOLERANCE``.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compress.documents import library_versions
from compress.eval.bench.gguf import candidate_rows, plot_kl_vs_size
from compress.eval.bench.pairs import equal_bytes_pairs, pairs_table
from compress.eval.bench.quant import Setting, load_bench_inputs, quantize_copy, write_results
from compress.eval.metrics import compare
from compress.export.onnx import export as onnx_export
from compress.export.onnx import runtime as rt
from compress.export.onnx.config import ONNXExportConfig
from compress.export.onnx.names import ONNX_FILE
from compress.plugins import QUANT_METHODS
from compress.progress import Reporter
from compress.schema.recipe import DataConfig

BUILDER = "builder"


@dataclass(frozen=True)
class Candidate:
    source: str  # a quantize method (ours) or "builder"
    setting: Setting
    head: bool = False  # ours: the output head through the method too (ignore: []), not rounded at export

    @classmethod
    def parse(cls, text: str) -> Candidate:
        """``gptq:W4g32a`` (ours, exact MatMulNBits; the head rounded at export), ``gptq:W4g32a+head`` (the head
        through GPTQ too) or ``builder:W4g32a`` (the builder's own round-to-nearest)."""
        body = text.strip()
        head = body.endswith("+head")
        source, sep, rest = body.removesuffix("+head").partition(":")
        if not sep:
            raise ValueError(f"candidate '{text}': expected METHOD:SETTING (gptq:W4g32a) or builder:SETTING (builder:W4g32a)")
        if source != BUILDER and source not in QUANT_METHODS:
            raise ValueError(f"candidate '{text}': unknown source '{source}'; known: {BUILDER}, {', '.join(QUANT_METHODS)}")
        setting = Setting.parse(rest)
        if setting.bits != 4 or setting.group_size not in (16, 32, 64, 128, 256):
            raise ValueError(f"candidate '{text}': int4 with a MatMulNBits block size (16, 32, 64, 128, 256)")
        if head and source == BUILDER:
            raise ValueError(f"candidate '{text}': +head follows one of our methods (gptq:W4g32s+head)")
        return cls(source, setting, head)

    @property
    def name(self) -> str:
        who = "builder RTN" if self.source == BUILDER else self.source
        return f"{who} {self.setting.label}" + (", head too" if self.head else "")

    def config(self, accuracy_level: int, keep_float: list[str] | None = None) -> ONNXExportConfig:
        s = self.setting
        common: dict[str, Any] = {"name": "candidate", "precision": "int4", "accuracy_level": accuracy_level, "verify": False}
        if self.source == BUILDER:
            return ONNXExportConfig(**common, quantizer=BUILDER, block_size=s.group_size, symmetric=s.symmetric, keep_float=keep_float)
        return ONNXExportConfig(**common, quantizer="records", keep_float=keep_float)


def decode_speed(directory: Path, prompt: list[int], tokens: int, repeats: int, threads: int) -> float:
    """Median ONNX Runtime GenAI decode tokens/s of ``tokens`` greedy steps after ``prompt`` (the first token,
    which includes the prompt, is not timed)."""
    rates = []
    with rt.GenAIModel(directory, threads) as model:
        for _ in range(repeats + 1):  # the first run warms the session up and is dropped
            _, timing = model.greedy(prompt, tokens + 1)
            rates.append(timing["decode_tokens_per_s"])
    return statistics.median(rates[1:])


def run_onnx_bench(
    model_source: str,
    data: DataConfig,
    candidates: list[Candidate],
    out_dir: Path,
    threads: int,
    reporter: Reporter,
    accuracy_level: int = 4,
    decode_tokens: int = 64,
    repeats: int = 3,
    keep_files: bool = False,
    keep_float: list[str] | None = None,
) -> dict[str, Any]:
    from compress.export.onnx.builder import require

    require()
    lm, calibration, evaluation, eval_cfg = load_bench_inputs(model_source, data, threads, reporter)
    files = out_dir / "files"
    files.mkdir(parents=True, exist_ok=True)
    fp32_dir = files / "fp32"
    with reporter.status("building the fp32 reference ONNX"):
        fp32 = onnx_export.write(fp32_dir, ONNXExportConfig(name="fp32", precision="fp32", verify=False), lm.model, lm.tokenizer, {})
    reference = rt.OrtDecoder(fp32_dir / ONNX_FILE, threads)
    prompt = evaluation.tokens[0, :64].tolist()
    result: dict[str, Any] = {
        "model": {"source": model_source, "sha256": lm.facts["sha256"]},
        "reference": {
            "file": "fp32 ONNX (onnxruntime-genai builder)",
            "size_bytes": fp32["size_bytes"],
            "decode_tokens_per_s": round(decode_speed(fp32_dir, prompt, decode_tokens, repeats, threads), 1),
        },
        "calibration": calibration.facts if calibration else None,
        "evaluation": evaluation.facts,
        "accuracy_level": accuracy_level,
        "keep_float": keep_float,
        "threads": threads,
        "decode": {
            "runtime": "onnxruntime-genai",
            "prompt_tokens": len(prompt),
            "tokens": decode_tokens,
            "repeats": repeats,
            "statistic": "median (after one warm-up run)",
        },
        "host": platform.platform(),
        "cpu_count": os.cpu_count(),
        "versions": {k: library_versions().get(k) for k in ("onnxruntime", "onnxruntime_genai", "torch")},
        "rows": [],
    }
    for cand in candidates:
        reporter.info(f"[bold]{cand.name}[/]")
        directory = files / cand.name.replace(" ", "_")
        seconds = 0.0
        model, records = lm.model, {}
        if cand.source != BUILDER:
            model, records, seconds = quantize_copy(lm, calibration, cand.source, cand.setting, reporter, head=cand.head)
        with reporter.status(f"building {cand.name} ONNX"):
            entry = onnx_export.write(directory, cand.config(accuracy_level, keep_float), model, lm.tokenizer, records)
        del model
        session = rt.OrtDecoder(directory / ONNX_FILE, threads)
        metrics = compare(reference.forward, {cand.name: session.forward}, evaluation.tokens, eval_cfg.min_context, progress=reporter.track)
        del session
        speed = decode_speed(directory, prompt, decode_tokens, repeats, threads)
        result["reference"]["metrics"] = metrics["baseline"]
        result["rows"].append(
            {
                "name": cand.name,
                "source": cand.source,
                "setting": cand.setting.label,
                "size_bytes": entry["size_bytes"],
                "records_exact": entry["records_exact"],
                "weights_written_by": entry["weights_written_by"],
                "tables": entry["tables"],
                "builder_options": entry["builder_options"],
                "quantize_seconds": round(seconds, 1),
                "decode_tokens_per_s": round(speed, 1),
                "metrics": metrics[cand.name],
            }
        )
        if not keep_files:
            shutil.rmtree(directory)
        result["pairs"] = pairs(result["rows"])
        write_results(out_dir, result, markdown_table(result))
    if not keep_files:
        shutil.rmtree(fp32_dir)
    plot_kl_vs_size(result, out_dir / "kl-vs-size.png", CHAINS, chain_of, "int4 ONNX files", "KL vs fp32 in ONNX Runtime (nats/token)")
    return result


CHAINS = (("ours", "o"), ("onnxruntime-genai's builder", "s"))


def chain_of(row: dict[str, Any]) -> str:
    return CHAINS[1][0] if row["source"] == BUILDER else CHAINS[0][0]


def pairs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each of our rows against the builder's row of the same setting: size, KL and decode ratios, and
    whether the sizes are within SIZE_TOLERANCE (an equal-bytes comparison)."""
    return equal_bytes_pairs(
        rows,
        lambda r: r["setting"] if r["source"] != BUILDER else None,
        lambda r: r["setting"] if r["source"] == BUILDER else None,
        "builder",
    )


def markdown_table(result: dict[str, Any]) -> str:
    ref = result["reference"]
    lines = [
        f"Reference: the builder's fp32 ONNX in ONNX Runtime ({ref['size_bytes'] / 2**20:.1f} MiB, "
        f"{ref['decode_tokens_per_s']:.1f} tokens/s); {ref.get('metrics', {}).get('tokens_scored', 0):,} scored tokens; "
        f"{result['threads']} threads; int4 at accuracy level {result['accuracy_level']}; "
        + (
            f"kept float: {', '.join(result['keep_float'])}."
            if result.get("keep_float")
            else "head and embeddings quantized (the builder's layout)."
        ),
        "",
        *candidate_rows(result["rows"], "KL vs fp32"),
    ]
    lines += pairs_table(result.get("pairs", []), "builder", "builder's")
    return "\n".join(lines)
