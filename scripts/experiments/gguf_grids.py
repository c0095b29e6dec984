"""GPTQ on a llama.cpp type's own grid against llama.cpp's own quantizer at that type, on the reference
model (SmolLM2-135M; another with --model), all scored in llama.cpp against our F16 GGUF. Two steps, so that each process
stays short on a small shared machine (``compress bench gguf`` does both in one run):

    python scripts/experiments/gguf_grids.py make -o DIR --candidate gptq:q4_k [--cal 32x512] [--threads 2]
    python scripts/experiments/gguf_grids.py make -o DIR --candidate llama.cpp-pure:q4_k
    python scripts/experiments/gguf_grids.py score -o DIR [--eval 16x512] [--threads 2]

``make`` writes ``DIR/f16.gguf`` (once) and one candidate file: ours (GPTQ/RTN records on the type's
grid, packed exactly and read back bit for bit with gguf-py) or llama.cpp's (``llama.cpp:TYPE``, its
mixes; ``llama.cpp-pure:TYPE``, every tensor in that one type, as ``llama-quantize --pure``); the token
embedding is Q8_0 in every file. ``score`` runs every file in DIR in llama.cpp on held-out evaluation
text (the calibration text's held-out part: the same DataPlan split as every benchmark), the files
named by --files (default all) in one pass, each to DIR/<file>.score.json, and writes DIR/results.json
and DIR/results.md from every score so far: file size, tensor types, KL vs F16, top-1 agreement, perplexity.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from compress.eval.bench.gguf import Candidate  # noqa: E402
from compress.eval.bench.quant import load_bench_inputs, quantize_copy  # noqa: E402
from compress.export.gguf import runtime as gguf_runtime  # noqa: E402
from compress.export.gguf.check import check_gguf_records, stored_type_counts  # noqa: E402
from compress.export.gguf.inputs import is_gguf_file  # noqa: E402
from compress.export.gguf.layout import resolve_type  # noqa: E402
from compress.export.gguf.writer import write_gguf  # noqa: E402
from compress.progress import Reporter  # noqa: E402
from compress.schema.recipe import DataConfig  # noqa: E402

EMBEDDING = "q8_0"
MODEL = "reference:smollm2-135m"
TEXT = "reference:shakespeare"


def shape(text: str) -> tuple[int, int]:
    samples, _, seq_len = text.partition("x")
    return int(samples), int(seq_len)


def data_config(cal: str, evaluation: str) -> DataConfig:
    (cs, cl), (es, el) = shape(cal), shape(evaluation)
    return DataConfig(calibration={"source": TEXT, "samples": cs, "seq_len": cl}, evaluation={"source": TEXT, "samples": es, "seq_len": el})


def file_name(cand: Candidate) -> str:
    return f"{cand.source}.{cand.type_name}.gguf"


def make(args: argparse.Namespace, reporter: Reporter) -> None:
    out: Path = args.output
    out.mkdir(parents=True, exist_ok=True)
    cand = Candidate.parse(args.candidate)
    lm, calibration, _, _ = load_bench_inputs(args.model, data_config(args.cal, "1x64"), args.threads, reporter)
    tokenizer_from = lm.source_path if is_gguf_file(lm.source_path) else None
    f16 = out / "f16.gguf"
    if not f16.is_file():
        write_gguf(f16, lm.model, lm.tokenizer, {}, "f16", tokenizer_from=tokenizer_from)
    path = out / file_name(cand)
    facts: dict = {"candidate": cand.name, "cal": args.cal}
    started = time.perf_counter()
    if cand.llama_cpp:
        gguf_runtime.quantize(f16, path, cand.type_name, args.threads, token_embedding_type=EMBEDDING, pure=cand.source == "llama.cpp-pure")
    else:
        model, records, _ = quantize_copy(lm, calibration, cand.source, cand.setting, reporter, cand.gguf_type)
        type_name = resolve_type("auto", records)
        written = write_gguf(path, model, lm.tokenizer, records, type_name, float_type=EMBEDDING, tokenizer_from=tokenizer_from)
        problems = check_gguf_records(path, written["plan"], records)
        if problems:
            raise SystemExit(f"{cand.name}: the file does not read back as the records: {problems[:3]}")
        facts["records_exact"] = sum(1 for t in written["plan"].tensors if t.source == "record")
        facts["type_fallbacks"] = len(written["type_fallbacks"])
    facts["seconds"] = round(time.perf_counter() - started, 1)
    (out / (path.name + ".json")).write_text(json.dumps(facts, indent=2) + "\n")
    reporter.info(f"wrote {path} ({path.stat().st_size / 2**20:.2f} MiB) in {facts['seconds']} s")


def score(args: argparse.Namespace, reporter: Reporter) -> None:
    from compress.documents import library_versions
    from compress.eval.metrics import compare

    out: Path = args.output
    lm, _, evaluation, eval_cfg = load_bench_inputs(args.model, data_config(args.cal, args.eval), args.threads, reporter)
    seq_len = int(evaluation.tokens.shape[1])
    reference = gguf_runtime.LlamaCppModel(out / "f16.gguf", n_ctx=seq_len, threads=args.threads)
    names = args.files.split(",") if args.files else [p.name for p in sorted(out.glob("*.gguf")) if p.name != "f16.gguf"]
    runtimes = {name: gguf_runtime.LlamaCppModel(out / name, n_ctx=seq_len, threads=args.threads) for name in names}
    try:  # one pass: the F16 reference runs once per chunk for every candidate
        metrics = compare(reference.forward, {n: r.forward for n, r in runtimes.items()}, evaluation.tokens, eval_cfg.min_context)
    finally:
        reference.close()
        for runtime in runtimes.values():
            runtime.close()
    for name in names:
        path = out / name
        row = {
            **json.loads((out / (name + ".json")).read_text()),
            "file": name,
            "size_bytes": path.stat().st_size,
            "tensor_types": stored_type_counts(path),
            "eval": args.eval,
            "metrics": metrics[name],
            "reference": metrics["baseline"],
        }
        (out / (name + ".score.json")).write_text(json.dumps(row, indent=2) + "\n")
        reporter.info(f"{name}: KL {row['metrics']['kl_divergence']:.4f}")
    rows = [json.loads(p.read_text()) for p in sorted(out.glob("*.score.json"))]
    result = {"model": args.model, "evaluation": evaluation.facts, "llama_cpp_python": library_versions()["llama_cpp_python"], "rows": rows}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["| candidate | file, MiB | tensor types | KL vs F16 | top-1 agreement | perplexity |", "|---|---|---|---|---|---|"]
    for r in rows:
        m = r["metrics"]
        types = ", ".join(f"{k.upper()} {v}" for k, v in sorted(r["tensor_types"].items(), key=lambda kv: -kv[1]))
        lines.append(
            f"| {r['candidate']} | {r['size_bytes'] / 2**20:.2f} | {types} | {m['kl_divergence']:.4f} | "
            f"{m['top1_agreement']:.2%} | {m['perplexity']:.2f} |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["make", "score"])
    parser.add_argument("-o", "--output", type=Path, required=True)
    parser.add_argument("--candidate", help="make: gptq:q4_k | rtn:q6_k | llama.cpp:q4_k_m | llama.cpp-pure:q4_k")
    parser.add_argument("--model", default=MODEL, help="the model (default: the reference model); the same for make and score")
    parser.add_argument("--cal", default="32x512", help="calibration chunks x tokens (the evaluation text is held out from it)")
    parser.add_argument("--eval", default="16x512", help="evaluation chunks x tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--files", help="score: comma-separated candidate files in DIR (default: all), scored in one pass")
    args = parser.parse_args()
    reporter = Reporter()
    if args.step == "make":
        make(args, reporter)
    else:
        score(args, reporter)


if __name__ == "__main__":
    main()
