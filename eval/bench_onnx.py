"""`compress bench onnx`: int4 ONNX made from our GPTQ/AWQ records (proven to hold them exactly)
against onnxruntime-genai's builder quantizing the same float model itself at the same block size,
all run in ONNX Runtime.

The reference is the builder's fp32 ONNX of the baseline; every candidate is scored against it on
the same evaluation chunks in an ONNX Runtime session at the candidate's shipped accuracy level
(KL, top-1 agreement, perplexity), with its file size and ONNX Runtime GenAI's single-stream decode
speed (median of repeats). Embeddings and the output head stay float in every file, so the files
differ only in the decoder's MatMulNBits weights.
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
from compress.eval.bench_gguf import candidate_rows
from compress.eval.bench_quant import Setting, load_bench_inputs, quantize_copy, write_results
from compress.eval.metrics import compare
from compress.export.onnx import export as onnx_export
from compress.export.onnx import runtime as rt
from compress.export.onnx.builder import ONNX_FILE
from compress.export.specs import ONNXExport
from compress.plugins import QUANT_METHODS
from compress.progress import Reporter
from compress.recipe import DataSpec

BUILDER = "builder"


@dataclass(frozen=True)
class Candidate:
    source: str  # a quantize method (ours) or "builder"
    setting: Setting

    @classmethod
    def parse(cls, text: str) -> Candidate:
        """``gptq:W4g32a`` (ours, exact MatMulNBits) or ``builder:W4g32a`` (the builder's own round-to-nearest)."""
        source, sep, rest = text.strip().partition(":")
        if not sep:
            raise ValueError(f"candidate '{text}': expected METHOD:SETTING (gptq:W4g32a) or builder:SETTING (builder:W4g32a)")
        if source != BUILDER and source not in QUANT_METHODS:
            raise ValueError(f"candidate '{text}': unknown source '{source}'; known: {BUILDER}, {', '.join(QUANT_METHODS)}")
        setting = Setting.parse(rest)
        if setting.bits != 4 or setting.group_size not in (16, 32, 64, 128, 256):
            raise ValueError(f"candidate '{text}': int4 with a MatMulNBits block size (16, 32, 64, 128, 256)")
        return cls(source, setting)

    @property
    def name(self) -> str:
        who = "builder RTN" if self.source == BUILDER else self.source
        return f"{who} {self.setting.label}"

    def spec(self, accuracy_level: int) -> ONNXExport:
        s = self.setting
        if self.source == BUILDER:
            return ONNXExport(
                name="candidate",
                precision="int4",
                quantizer=BUILDER,
                block_size=s.group_size,
                symmetric=s.symmetric,
                accuracy_level=accuracy_level,
                verify=False,
            )
        return ONNXExport(name="candidate", precision="int4", quantizer="records", accuracy_level=accuracy_level, verify=False)


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
    data: DataSpec,
    candidates: list[Candidate],
    out_dir: Path,
    threads: int,
    reporter: Reporter,
    accuracy_level: int = 4,
    decode_tokens: int = 64,
    repeats: int = 3,
    keep_files: bool = False,
) -> dict[str, Any]:
    from compress.export.onnx.builder import require

    require()
    lm, calibration, evaluation, spec = load_bench_inputs(model_source, data, threads, reporter)
    files = out_dir / "files"
    files.mkdir(parents=True, exist_ok=True)
    fp32_dir = files / "fp32"
    with reporter.status("building the fp32 reference ONNX"):
        fp32 = onnx_export.write(fp32_dir, ONNXExport(name="fp32", precision="fp32", verify=False), lm.model, lm.tokenizer, {})
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
            model, records, seconds = quantize_copy(lm, calibration, cand.source, cand.setting, reporter)
        with reporter.status(f"building {cand.name} ONNX"):
            entry = onnx_export.write(directory, cand.spec(accuracy_level), model, lm.tokenizer, records)
        del model
        session = rt.OrtDecoder(directory / ONNX_FILE, threads)
        metrics = compare(reference.forward, {cand.name: session.forward}, evaluation.tokens, spec.min_context, progress=reporter.track)
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
                "quantize_seconds": round(seconds, 1),
                "decode_tokens_per_s": round(speed, 1),
                "metrics": metrics[cand.name],
            }
        )
        if not keep_files:
            shutil.rmtree(directory)
        write_results(out_dir, result, markdown_table(result))
    if not keep_files:
        shutil.rmtree(fp32_dir)
    return result


def markdown_table(result: dict[str, Any]) -> str:
    ref = result["reference"]
    lines = [
        f"Reference: the builder's fp32 ONNX in ONNX Runtime ({ref['size_bytes'] / 2**20:.1f} MiB, "
        f"{ref['decode_tokens_per_s']:.1f} tokens/s); {ref.get('metrics', {}).get('tokens_scored', 0):,} scored tokens; "
        f"{result['threads']} threads; int4 at accuracy level {result['accuracy_level']}; embeddings and output head float.",
        "",
        *candidate_rows(result["rows"], "KL vs fp32"),
    ]
    return "\n".join(lines)
