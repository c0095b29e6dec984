"""Does llama.cpp's quantizer gain as much from our importance matrix as from its own? On the reference
model (SmolLM2-135M), with llama.cpp's tools built from the sources the installed llama-cpp-python
vendors (``python scripts/build_llama_tools.py``):

    python scripts/experiments/imatrix_llama.py ours -o DIR [--cal 32x512]      # GPTQ's pass -> DIR/imatrix.ours.gguf
    python scripts/experiments/imatrix_llama.py theirs -o DIR [--cal 32x512]    # llama-imatrix -> DIR/imatrix.llama.cpp.gguf
    python scripts/experiments/imatrix_llama.py quantize -o DIR --type q3_k_m   # llama-quantize without / with each imatrix
    python scripts/experiments/gguf_grids.py score -o DIR --eval 16x512 --files FILES

``ours`` runs GPTQ (W4 g32 symmetric unless --setting) on the calibration chunks and writes the
importance matrix it accumulated (export/gguf/imatrix.py), as a ``compress run`` does beside its GGUF.
``theirs`` writes the same calibration chunks as text and runs ``llama-imatrix`` on DIR/f16.gguf over
them (it tokenizes the text again, in chunks of the same length). ``quantize`` runs ``llama-quantize``
on DIR/f16.gguf (made by either step, as `scripts/experiments/gguf_grids.py make` makes it) with the token
embedding in Q8_0: once without an importance matrix and once with each one found in DIR; each file
gets the .json facts that ``gguf_grids.py score`` reads. Scored there against the F16 file in
llama.cpp on held-out text.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gguf_grids, beside this script

from gguf_grids import EMBEDDING, MODEL, TEXT, data_config, shape  # noqa: E402

from compress.context import RunContext  # noqa: E402
from compress.eval.bench.gguf import llama_cpp_imatrix  # noqa: E402
from compress.eval.bench.quant import Setting, load_bench_inputs  # noqa: E402
from compress.export.gguf.imatrix import write_imatrix  # noqa: E402
from compress.export.gguf.inputs import is_gguf_file  # noqa: E402
from compress.export.gguf.tools import llama_quantize  # noqa: E402
from compress.export.gguf.writer import write_gguf  # noqa: E402
from compress.progress import Reporter  # noqa: E402
from compress.quantizers.configs import GPTQConfig  # noqa: E402
from compress.quantizers.gptq import GPTQStage  # noqa: E402

OURS, THEIRS = "imatrix.ours.gguf", "imatrix.llama.cpp.gguf"


def inputs(args: argparse.Namespace, reporter: Reporter):
    lm, calibration, _, _ = load_bench_inputs(MODEL, data_config(args.cal, "1x64"), args.threads, reporter)
    f16 = args.output / "f16.gguf"
    if not f16.is_file():
        tokenizer_from = lm.source_path if is_gguf_file(lm.source_path) else None
        write_gguf(f16, lm.model, lm.tokenizer, {}, "f16", tokenizer_from=tokenizer_from)
    return lm, calibration, f16


def ours(args: argparse.Namespace, reporter: Reporter) -> None:
    lm, calibration, _ = inputs(args, reporter)
    setting = Setting.parse(args.setting)
    model = copy.deepcopy(lm.model)
    ctx = RunContext(seed=0, device=torch.device("cpu"), tokenizer=lm.tokenizer, reporter=reporter, calibration=lambda: calibration.tokens)
    started = time.perf_counter()
    GPTQStage(GPTQConfig(bits=setting.bits, group_size=setting.group_size, symmetric=setting.symmetric), "imatrix").apply(model, ctx)
    facts = write_imatrix(args.output / OURS, model, ctx.input_sums, [TEXT], shape(args.cal)[1])
    facts.update(seconds=round(time.perf_counter() - started, 1), setting=args.setting)
    (args.output / (OURS + ".json")).write_text(json.dumps(facts, indent=2) + "\n")
    reporter.info(f"wrote {args.output / OURS}: {facts['tensors']} tensors, {facts['tokens']:,} tokens, {facts['seconds']} s")


def theirs(args: argparse.Namespace, reporter: Reporter) -> None:
    lm, calibration, f16 = inputs(args, reporter)
    started = time.perf_counter()
    command = llama_cpp_imatrix(f16, calibration, lm.tokenizer, args.output / THEIRS, args.threads)
    facts = {"command": command, "seconds": round(time.perf_counter() - started, 1)}
    (args.output / (THEIRS + ".json")).write_text(json.dumps(facts, indent=2) + "\n")


def quantize(args: argparse.Namespace, reporter: Reporter) -> None:
    f16 = args.output / "f16.gguf"
    if not f16.is_file():
        raise SystemExit(f"{f16} is missing: run the ours or theirs step first")
    variants = [("none", None)] + [
        (name, args.output / file) for name, file in (("ours", OURS), ("llama.cpp", THEIRS)) if (args.output / file).is_file()
    ]
    for name, matrix in variants:
        out = args.output / f"llama.cpp-imatrix-{name}.{args.type}.gguf"
        started = time.perf_counter()
        llama_quantize(f16, out, args.type, args.threads, EMBEDDING, matrix)
        label = "no importance matrix" if matrix is None else f"{'our' if name == 'ours' else 'its own'} importance matrix"
        facts = {
            "candidate": f"llama.cpp {args.type.upper()}, {label}",
            "cal": args.cal,
            "seconds": round(time.perf_counter() - started, 1),
        }
        (args.output / (out.name + ".json")).write_text(json.dumps(facts, indent=2) + "\n")
        reporter.info(f"wrote {out} ({out.stat().st_size / 2**20:.2f} MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["ours", "theirs", "quantize"])
    parser.add_argument("-o", "--output", type=Path, required=True)
    parser.add_argument("--cal", default="32x512", help="calibration chunks x tokens (the evaluation text is held out from it)")
    parser.add_argument("--setting", default="W4g32s", help="ours: the GPTQ setting whose pass measures the inputs")
    parser.add_argument("--type", default="q3_k_m", help="quantize: llama.cpp's type (a mix such as q3_k_m, or q2_k ...)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    reporter = Reporter()
    {"ours": ours, "theirs": theirs, "quantize": quantize}[args.step](args, reporter)


if __name__ == "__main__":
    main()
