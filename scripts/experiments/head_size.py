"""What quantizing the output head buys in an int4 ONNX export of the reference model (SmolLM2-135M).

    python scripts/experiments/head_size.py [--cal 16x512] [--eval 16x512] [--threads 2] [-o head-size.json]

One GPTQ W4 g32 asym run with ``ignore: []`` quantizes the decoder and then the head (calibrated on
the final norm's output). Three exports are built from it, each proven to hold its records exactly:
every decoder Linear in MatMulNBits with the head and embeddings float (``keep_float: [lm_head,
embeddings]``, records without the head: the decoder records do not depend on the head, which is
quantized after the last block); the same plus the head's MatMulNBits (``keep_float: [embeddings]``:
the float table stays for the gather); and the default layout, where the gather reads the head's
blocks (one table). Each file is scored in ONNX Runtime (accuracy level 4) against the float torch
model on held-out Shakespeare (KL, top-1 agreement, perplexity).
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from compress.context import RunContext  # noqa: E402
from compress.eval.metrics import compare, torch_forward  # noqa: E402
from compress.export.onnx import export as onnx_export  # noqa: E402
from compress.export.onnx import runtime as rt  # noqa: E402
from compress.export.onnx.config import ONNXExportConfig  # noqa: E402
from compress.export.onnx.names import ONNX_FILE  # noqa: E402
from compress.models import load_model  # noqa: E402
from compress.progress import Reporter  # noqa: E402
from compress.quantizers.configs import GPTQConfig  # noqa: E402
from compress.quantizers.gptq import GPTQStage  # noqa: E402
from compress.schema.recipe import ModelConfig  # noqa: E402
from tests.conftest import reference_chunks  # noqa: E402

MIN_CONTEXT = 32
HEAD = "lm_head"


def size(text: str) -> tuple[int, int]:
    samples, seq_len = (int(x) for x in text.lower().split("x"))
    return samples, seq_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cal", type=size, default=(16, 512), help="calibration chunks, SAMPLESxSEQ_LEN")
    parser.add_argument("--eval", type=size, default=(16, 512), help="held-out evaluation chunks, SAMPLESxSEQ_LEN")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("-o", "--output", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()

    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    quiet = Reporter(quiet=True)
    cpu = torch.device("cpu")
    source = load_model(ModelConfig(source="reference:smollm2-135m"), ROOT, quiet)
    cal, ev = reference_chunks(source.tokenizer, args.cal, args.eval)
    baseline = torch_forward(source.model, cpu)

    model = copy.deepcopy(source.model)
    ctx = RunContext(seed=0, device=cpu, tokenizer=source.tokenizer, reporter=quiet, calibration=lambda: cal)
    t0 = time.perf_counter()
    GPTQStage(GPTQConfig(bits=4, group_size=32, symmetric=False, ignore=[]), "gptq").apply(model, ctx)
    gptq_seconds = time.perf_counter() - t0
    with_head = dict(ctx.quantized)
    head_float = copy.deepcopy(model)
    head_float.lm_head.weight = head_float.get_input_embeddings().weight  # tied again, as in the source
    candidates = {  # name: (model, records, keep_float)
        "GPTQ W4 g32 asym, lm_head float (ignore: [lm_head])": (
            head_float,
            {n: r for n, r in with_head.items() if n != HEAD},
            ["lm_head", "embeddings"],
        ),
        "GPTQ W4 g32 asym, lm_head GPTQ (ignore: [])": (model, with_head, ["embeddings"]),
        "GPTQ W4 g32 asym, lm_head GPTQ, one table for head and embeddings": (model, with_head, []),
    }
    rows = []
    with tempfile.TemporaryDirectory(prefix="head-size-") as tmp:
        for i, (name, (candidate, records, keep_float)) in enumerate(candidates.items()):
            directory = Path(tmp) / str(i)
            cfg = ONNXExportConfig(
                name=f"onnx{i}", precision="int4", quantizer="records", accuracy_level=4, verify=False, keep_float=keep_float
            )
            entry = onnx_export.write(directory, cfg, candidate, source.tokenizer, records)
            session = rt.OrtDecoder(directory / ONNX_FILE, args.threads)
            metrics = compare(baseline, {name: session.forward}, ev, MIN_CONTEXT)
            del session
            rows.append(
                {
                    "name": name,
                    "size_bytes": entry["size_bytes"],
                    "records_exact": entry["records_exact"],
                    "matmulnbits_nodes": entry["ops"].get("com.microsoft.MatMulNBits", 0),
                    "kl_divergence": metrics[name]["kl_divergence"],
                    "top1_agreement": metrics[name]["top1_agreement"],
                    "perplexity": metrics[name]["perplexity"],
                    "baseline_perplexity": metrics["baseline"]["perplexity"],
                }
            )
            shutil.rmtree(directory)
    result = {
        "model": "reference:smollm2-135m",
        "calibration": "x".join(map(str, args.cal)),
        "evaluation": "x".join(map(str, args.eval)),
        "scored_tokens": int(ev.shape[0] * (ev.shape[1] - MIN_CONTEXT)),  # positions min_context-1 .. seq_len-2 of each chunk
        "runtime": "onnxruntime (CPU, accuracy level 4)",
        "threads": args.threads,
        "gptq_seconds": round(gptq_seconds, 1),
        "seconds": round(time.perf_counter() - started, 1),
        "rows": rows,
    }
    print("| export | MB | MiB | records exact | KL | top-1 | perplexity |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['name']} | {r['size_bytes'] / 1e6:.1f} | {r['size_bytes'] / 2**20:.2f} | {r['records_exact']} | "
            f"{r['kl_divergence']:.4f} | {r['top1_agreement']:.2%} | {r['perplexity']:.2f} (float {r['baseline_perplexity']:.2f}) |"
        )
    print(
        f"calibration {result['calibration']}, evaluation {result['evaluation']}; GPTQ {result['gptq_seconds']} s, all {result['seconds']} s"
    )
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
