"""`compress bench gguf`: our GPTQ/AWQ records packed exactly into Q4_0/Q4_1 GGUF files against
llama.cpp's own quantizations of the same model, all measured in llama.cpp.

The reference is our F16 GGUF of the baseline, run in llama.cpp; every candidate is scored
against it on the same evaluation chunks (KL, top-1 agreement, perplexity), with its file size
and llama.cpp's single-stream decode speed (median of repeats). llama.cpp's candidates are made
by its quantizer from that F16 file, with the token embedding in the same type as ours
(``--embedding-type``), so Q4_0 against Q4_0 compares files of the same size; ``auto`` leaves it
to each: llama.cpp's own rule (an untied model's embedding at the file's base type), our
``float_type`` default, and a budget's own choice (``target.tables``).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import re
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compress.documents import library_versions
from compress.eval.bench.pairs import equal_bytes_pairs, pairs_table
from compress.eval.bench.plots import Series, plot_series
from compress.eval.bench.quant import Setting, load_bench_inputs, quantize_copy, write_results
from compress.eval.metrics import compare
from compress.export.gguf import runtime as gguf_runtime
from compress.export.gguf.check import check_gguf_records, stored_type_counts, stored_types, tensor_totals
from compress.export.gguf.config import GGUF_LLAMA_CPP_TYPES, GGUFExportConfig
from compress.export.gguf.inputs import is_gguf_file
from compress.export.gguf.tools import llama_imatrix, llama_quantize
from compress.export.gguf.writer import write_gguf
from compress.plugins import QUANT_METHODS
from compress.progress import Reporter
from compress.quantizers.grids import GRIDS, normalize_type
from compress.schema.recipe import DataConfig

LLAMA_CPP = "llama.cpp"
LLAMA_CPP_PURE = "llama.cpp-pure"
LLAMA_CPP_IMATRIX = "llama.cpp-imatrix"
LLAMA_CPP_SAME_MIX = "llama.cpp-same-mix"  # llama.cpp's quantizer on the types a mix of ours chose (a row of its own)
IMATRIX_FILE = "imatrix.llama.cpp.gguf"
EMBEDDING, OUTPUT = "token_embd.weight", "output.weight"  # llama.cpp's names of the tensors its quantizer types apart


@dataclass(frozen=True)
class Candidate:
    source: str  # a quantize method (ours), "llama.cpp" or "llama.cpp-pure"
    setting: Setting | None  # ours, on our integer grid
    type_name: str  # GGUF type: auto-resolved for ours, llama.cpp's for theirs
    gguf_type: str | None = None  # ours, on llama.cpp's grid of this type
    budget: str | None = None  # ours, a mix under a size budget: bits per weight ("3.9"), or a llama.cpp type whose file to match
    head: bool = False  # ours, the output head quantized too (ignore: []); a tied source's one table is its record
    head_type: str | None = None  # ours, the head quantized by a stage of its own on this GGUF type's grid (+head:q8_0)

    @property
    def llama_cpp(self) -> bool:
        return self.source in (LLAMA_CPP, LLAMA_CPP_PURE, LLAMA_CPP_IMATRIX)

    @classmethod
    def parse(cls, text: str) -> Candidate:
        """``gptq:W4g32s`` (ours; Q4_0 for symmetric, Q4_1 for asymmetric), ``gptq:Q4_K`` (ours on that
        type's own grid, packed exactly), ``gptq:mix@3.9`` / ``gptq:mix@q4_k_m`` (ours, a type per layer
        under a budget: bits per weight, or the size of llama.cpp's own file of that type), ``llama.cpp:q4_k_m``,
        ``llama.cpp-imatrix:q4_k_m`` (llama-quantize with llama-imatrix's matrix of the same calibration
        text; needs scripts/build_llama_tools.py) or ``llama.cpp-pure:q4_k`` (every tensor in that one
        type, as llama-quantize --pure; rows it cannot hold get its fallback). ``+head`` after one of ours
        (``gptq:W4g32s+head``) quantizes the output head too, in the same scheme; ``+head:TYPE``
        (``gptq:W4g32s+head:q8_0``) quantizes it by a second stage of the same method on that GGUF
        type's grid, which the file keeps (llama.cpp's Q4_0 gives the output Q8_0)."""
        body = text.strip()
        if "+head" in body:
            rest_, _, head_type = body.rpartition("+head")
            found = cls.parse(rest_)
            if found.llama_cpp or found.source == LLAMA_CPP_PURE or found.budget is not None:
                raise ValueError(f"candidate '{text}': +head follows one of our methods at a setting or a type (gptq:W4g32s+head)")
            if not head_type:
                return dataclasses.replace(found, head=True)
            name = str(normalize_type(head_type.removeprefix(":")))
            if not head_type.startswith(":") or name not in GRIDS:
                raise ValueError(f"candidate '{text}': +head:TYPE takes a GGUF type with a grid ({', '.join(GRIDS)}), e.g. +head:q8_0")
            return dataclasses.replace(found, head=True, head_type=name)
        source, sep, rest = body.partition(":")
        rest = str(normalize_type(rest))
        if not sep:
            raise ValueError(
                f"candidate '{text}': expected METHOD:SETTING (gptq:W4g32s), METHOD:TYPE (gptq:q4_k), llama.cpp:TYPE "
                "(llama.cpp:q4_k_m) or llama.cpp-pure:TYPE (llama.cpp-pure:q4_k)"
            )
        if source in (LLAMA_CPP, LLAMA_CPP_IMATRIX):
            if rest not in GGUF_LLAMA_CPP_TYPES:
                raise ValueError(f"candidate '{text}': llama.cpp type must be one of {', '.join(GGUF_LLAMA_CPP_TYPES)}")
            return cls(source, None, rest)
        if source == LLAMA_CPP_PURE:
            if rest not in GRIDS:
                raise ValueError(f"candidate '{text}': llama.cpp-pure type must be one of {', '.join(GRIDS)}")
            return cls(source, None, rest)
        if source not in QUANT_METHODS:
            raise ValueError(f"candidate '{text}': unknown method '{source}'; known: {', '.join(QUANT_METHODS)}")
        if rest in GRIDS:
            return cls(source, None, rest, gguf_type=rest)
        if rest.startswith("mix@"):
            budget = rest[4:]
            try:
                float(budget)
            except ValueError:
                if budget not in GGUF_LLAMA_CPP_TYPES:
                    raise ValueError(
                        f"candidate '{text}': mix@ takes bits per weight (mix@3.9) or a llama.cpp type whose file size to match "
                        f"({', '.join(GGUF_LLAMA_CPP_TYPES)})"
                    ) from None
            return cls(source, None, "mix", budget=budget)
        setting = Setting.parse(rest)
        if setting.bits != 4:
            raise ValueError(f"candidate '{text}': exact GGUF blocks here are 4-bit (Q4_0 / Q4_1)")
        return cls(source, setting, "q4_0" if setting.symmetric else "q4_1")

    @property
    def name(self) -> str:
        if self.source == LLAMA_CPP:
            return f"llama.cpp {self.type_name.upper()}"
        if self.source == LLAMA_CPP_IMATRIX:
            return f"llama.cpp {self.type_name.upper()} with its imatrix"
        if self.budget is not None:
            at = f"{self.budget} bits/weight" if self.budget[0].isdigit() else f"the size of llama.cpp's {self.budget.upper()}"
            return f"{self.source} mix at {at}"
        if self.source == LLAMA_CPP_PURE:
            return f"llama.cpp {self.type_name.upper()} (pure)"
        head = f", head {self.head_type.upper()}" if self.head_type else ", head too" if self.head else ""
        if self.gguf_type is not None:
            return f"{self.source} on the {self.type_name.upper()} grid -> {self.type_name.upper()}{head}"
        return f"{self.source} {self.setting.label} -> {self.type_name.upper()}{head}"


def decode_speed(runtime: gguf_runtime.LlamaCppModel, prompt: list[int], tokens: int, repeats: int) -> float:
    """Median tokens/s of ``tokens`` greedy one-token steps after ``prompt`` (the prompt's own
    processing is not timed; EOS does not stop it)."""
    rates = []
    for _ in range(repeats):
        made = runtime.greedy(prompt, tokens, stop_at_eos=False)
        rates.append(len(made) / runtime.last_decode_seconds)
    return statistics.median(rates)


EMBEDDING_AUTO = "auto"


def run_gguf_bench(
    model_source: str,
    data: DataConfig,
    candidates: list[Candidate],
    out_dir: Path,
    threads: int,
    embedding_type: str,
    reporter: Reporter,
    decode_tokens: int = 64,
    repeats: int = 3,
    keep_files: bool = False,
    same_mix: bool = True,
    dtype: str = "auto",
) -> dict[str, Any]:
    gguf_runtime.llama_cpp()  # fail before any work when the binding is missing
    embedding = None if embedding_type == EMBEDDING_AUTO else embedding_type  # auto: each tool's own choice
    lm, calibration, evaluation, eval_cfg = load_bench_inputs(model_source, data, threads, reporter, dtype)
    seq_len = int(evaluation.tokens.shape[1])
    files = out_dir / "files"
    files.mkdir(parents=True, exist_ok=True)
    f16 = files / "f16.gguf"
    tokenizer_from = lm.source_path if is_gguf_file(lm.source_path) else None  # a GGUF source's own tokenizer, as the export does
    with reporter.status("writing the F16 reference GGUF"):
        write_gguf(f16, lm.model, lm.tokenizer, {}, "f16", tokenizer_from=tokenizer_from)
    reference = gguf_runtime.LlamaCppModel(f16, n_ctx=max(seq_len, decode_tokens + 64), threads=threads)
    prompt = evaluation.tokens[0, :64].tolist()
    result: dict[str, Any] = {
        "model": {"source": model_source, "sha256": lm.facts["sha256"], "dtype": str(lm.model.dtype).removeprefix("torch.")},
        "reference": {
            "file": "f16.gguf",
            "size_bytes": f16.stat().st_size,
            "decode_tokens_per_s": round(decode_speed(reference, prompt, decode_tokens, repeats), 1),
        },
        "calibration": calibration.facts if calibration else None,
        "evaluation": evaluation.facts,
        "embedding_type": embedding_type,
        "threads": threads,
        "decode": {"prompt_tokens": len(prompt), "tokens": decode_tokens, "repeats": repeats, "statistic": "median"},
        "host": platform.platform(),
        "cpu_count": os.cpu_count(),
        "llama_cpp_python": library_versions()["llama_cpp_python"],
        "rows": [],
    }

    def score(path: Path, name: str) -> tuple[dict[str, Any], float]:
        """KL/top-1/perplexity of a file against the F16 reference in llama.cpp, and its decode speed."""
        runtime = gguf_runtime.LlamaCppModel(path, n_ctx=max(seq_len, decode_tokens + 64), threads=threads)
        try:
            metrics = compare(reference.forward, {name: runtime.forward}, evaluation.tokens, eval_cfg.min_context, progress=reporter.track)
            return metrics, decode_speed(runtime, prompt, decode_tokens, repeats)
        finally:
            runtime.close()

    sensitivity: dict[str, Any] = {}  # the budgets' per-layer measurement, made once for all of them
    try:
        for cand in candidates:
            reporter.info(f"[bold]{cand.name}[/]")
            path = files / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', cand.name.split(' ->')[0])}.{cand.type_name}.gguf"
            seconds = 0.0
            row: dict[str, Any] = {}
            budget = None
            if cand.source == LLAMA_CPP_IMATRIX:
                imatrix = files / IMATRIX_FILE
                if not imatrix.is_file():
                    with reporter.status("llama-imatrix on the calibration text"):
                        row["imatrix_command"] = llama_cpp_imatrix(f16, calibration, lm.tokenizer, imatrix, threads)
                with reporter.status(f"llama-quantize to {cand.type_name} with its imatrix"):
                    llama_quantize(f16, path, cand.type_name, threads, embedding, imatrix)
                exact = 0
            elif cand.llama_cpp:
                with reporter.status(f"llama.cpp quantizing to {cand.type_name}"):
                    gguf_runtime.quantize(
                        f16, path, cand.type_name, threads, token_embedding_type=embedding, pure=cand.source == LLAMA_CPP_PURE
                    )
                exact = 0
            else:
                if cand.budget is not None:
                    bits = budget_bits(cand.budget, f16, files, threads, embedding)
                    row["budget_bits_per_weight"] = round(bits, 4)
                    budget = GGUFExportConfig(name="bench", target={"bits_per_weight": bits}, float_type=embedding)
                measured = len(sensitivity)
                model, records, seconds = quantize_copy(
                    lm, calibration, cand.source, cand.setting, reporter, cand.gguf_type, budget, sensitivity, cand.head, cand.head_type
                )
                if budget is not None:  # the seconds of a later budget leave out the measurement it reused
                    row["sensitivity_reused"] = len(sensitivity) == measured  # no new measurement was kept
                facts = write_gguf(path, model, lm.tokenizer, records, cand.type_name, float_type=embedding, tokenizer_from=tokenizer_from)
                problems = check_gguf_records(path, facts["plan"], records)
                if problems:
                    raise RuntimeError(f"{cand.name}: GGUF read-back differs from the records: {problems[:3]}")
                exact = sum(1 for t in facts["plan"].tensors if t.source == "record")
                del model
            metrics, speed = score(path, cand.name)
            result["reference"]["metrics"] = metrics["baseline"]
            tensor_bytes, params = tensor_totals(path)
            if budget is not None and 8 * tensor_bytes / params > budget.target.bits_per_weight:
                raise RuntimeError(
                    f"{cand.name}: {8 * tensor_bytes / params:.4f} bits/weight, over its budget of {budget.target.bits_per_weight:.4f}"
                )
            result["rows"].append(
                {
                    **row,
                    "name": cand.name,
                    "source": cand.source,
                    "setting": cand.setting.label if cand.setting else cand.gguf_type,
                    "type": cand.type_name,
                    "pair_type": pair_type(cand),
                    "quantize_seconds": round(seconds, 1),
                    "records_exact": exact,
                    **file_facts(path, metrics[cand.name], speed),
                }
            )
            if budget is not None and same_mix:  # llama.cpp's quantizer on our choice of types: the speed reference
                mine = result["rows"][-1]
                theirs = files / f"same-mix.{path.name}"
                found = stored_types(path)
                types = {n: k for n, k in found.items() if k in GRIDS and n not in (EMBEDDING, OUTPUT)}
                main = Counter(types.values()).most_common(1)[0][0]
                name = f"llama.cpp at the type mix of {cand.name}"
                reporter.info(f"[bold]{name}[/]")
                with reporter.status(f"llama.cpp quantizing to our {len(types)} tensor types"):
                    gguf_runtime.quantize(
                        f16, theirs, main, threads, token_embedding_type=found[EMBEDDING], output_type=found.get(OUTPUT), tensor_types=types
                    )
                other, other_speed = score(theirs, name)
                same = {"name": name, "source": LLAMA_CPP_SAME_MIX, "setting": None, "type": "mix", "quantize_seconds": None}
                result["rows"].append({**same, "records_exact": 0, **file_facts(theirs, other[name], other_speed)})
                result["rows"][-1]["same_tensor_types"] = stored_types(theirs) == found
                if not result["rows"][-1]["same_tensor_types"]:
                    reporter.warn(f"{name}: llama.cpp did not write every tensor in our type (same_tensor_types: false)")
                mine["decode_vs_same_mix"] = round(speed / other_speed, 3)
                if not keep_files:
                    theirs.unlink()
            if not keep_files:
                path.unlink()
            result["pairs"] = gguf_pairs(result["rows"])
            write_results(out_dir, result, markdown_table(result))
            plot_kl_vs_size(result, out_dir / "kl-vs-size.png")
    finally:
        reference.close()
        if not keep_files:
            f16.unlink(missing_ok=True)
    return result


def pair_type(cand: Candidate) -> str | None:
    """The llama.cpp type whose file one of our candidates is compared with at equal bytes: its own
    type, or the type whose size its budget matches (mix@q4_k_m); None for llama.cpp's rows and
    budgets in bits per weight."""
    if cand.llama_cpp:
        return None
    if cand.budget is not None:
        return None if cand.budget[0].isdigit() else cand.budget
    return cand.type_name


def gguf_pairs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each of our rows against llama.cpp's own file of its type (plain llama.cpp first, else its
    --pure row): size, KL and decode ratios, a pair of sizes more than 2% apart flagged."""
    order = {LLAMA_CPP: 0, LLAMA_CPP_PURE: 1}
    theirs = sorted((r for r in rows if r["source"] in order), key=lambda r: order[r["source"]])
    ours = [r for r in rows if r.get("pair_type")]
    return equal_bytes_pairs(
        ours + theirs, lambda r: r.get("pair_type"), lambda r: r["type"] if r["source"] in order else None, "llama_cpp"
    )


def file_facts(path: Path, metrics: dict[str, Any], speed: float) -> dict[str, Any]:
    """A benchmark row's facts of its file: size, bits per weight, tensor types, metrics, decode speed."""
    tensor_bytes, params = tensor_totals(path)
    return {
        "bits_per_weight": round(8 * tensor_bytes / params, 4),
        "tensor_types": stored_type_counts(path),
        "size_bytes": path.stat().st_size,
        "decode_tokens_per_s": round(speed, 1),
        "metrics": metrics,
    }


def budget_bits(budget: str, f16: Path, files: Path, threads: int, embedding_type: str | None) -> float:
    """Bits per weight of a mix budget: the number given, or those of llama.cpp's own file of that type
    (made from the same F16 file with the same embedding type, measured, deleted)."""
    try:
        return float(budget)
    except ValueError:
        pass
    like = files / f"budget.{budget}.gguf"
    gguf_runtime.quantize(f16, like, budget, threads, token_embedding_type=embedding_type)
    try:
        tensor_bytes, params = tensor_totals(like)
    finally:
        like.unlink()
    return 8 * tensor_bytes / params


def llama_cpp_imatrix(f16: Path, calibration: Any, tokenizer: Any, out: Path, threads: int) -> str:
    """llama-imatrix's importance matrix of the F16 file over the calibration chunks (as text, which it
    tokenizes again in chunks of the same length); returns the command."""
    if calibration is None:
        raise ValueError("llama.cpp-imatrix candidates need calibration data")
    text = out.with_suffix(".txt")
    text.write_text("\n".join(tokenizer.decode(row) for row in calibration.tokens.tolist()))
    samples, seq_len = calibration.tokens.shape
    command = llama_imatrix(f16, text, out, int(seq_len), int(samples), threads)
    return " ".join(command)


def tool_chain(row: dict[str, Any]) -> str:
    """Which tool chain made a benchmark row: ours, llama.cpp, or llama.cpp with its importance matrix."""
    if row["source"] == LLAMA_CPP_IMATRIX:
        return "llama.cpp with its imatrix"
    if row["source"] == LLAMA_CPP_SAME_MIX:
        return "llama.cpp on our mix's types"
    return "llama.cpp" if row["source"] in (LLAMA_CPP, LLAMA_CPP_PURE) else "ours"


GGUF_CHAINS = (("ours", "o"), ("llama.cpp", "s"), ("llama.cpp with its imatrix", "^"), ("llama.cpp on our mix's types", "x"))


def plot_kl_vs_size(
    result: dict[str, Any],
    path: Path,
    chains: tuple[tuple[str, str], ...] = GGUF_CHAINS,
    chain_of: Callable[[dict[str, Any]], str] | None = None,
    files: str = "GGUF files",
    kl_label: str = "KL vs F16 in llama.cpp (nats/token)",
) -> Path | None:
    """KL against file size, one series per tool chain (a log scale for KL), each point named."""
    rows = [r for r in result["rows"] if r["metrics"].get("kl_divergence", 0) > 0]
    if not rows:
        return None
    series = []
    for chain, marker in chains:
        mine = sorted((r for r in rows if (chain_of or tool_chain)(r) == chain), key=lambda r: r["size_bytes"])
        series.append(Series(chain, marker, [r["size_bytes"] / 2**20 for r in mine], [r["metrics"]["kl_divergence"] for r in mine]))
    notes = []
    for r in rows:
        label = r["name"].replace("llama.cpp at the type mix of ", "")
        label = label.replace("gptq mix at the size of llama.cpp's ", "mix @ ").replace(" with its imatrix", " + imatrix")
        notes.append((label, r["size_bytes"] / 2**20, r["metrics"]["kl_divergence"]))
    title = f"{result['model']['source']}: {files}, KL against size"
    return plot_series(path, series, notes, "file size (MiB)", kl_label, title, yscale={"value": "log"})


def markdown_table(result: dict[str, Any]) -> str:
    ref = result["reference"]
    lines = [
        f"Reference: our F16 GGUF in llama.cpp ({ref['size_bytes'] / 2**20:.1f} MiB, {ref['decode_tokens_per_s']:.1f} tokens/s); "
        f"{ref.get('metrics', {}).get('tokens_scored', 0):,} scored tokens; {result['threads']} threads; "
        f"embeddings {result['embedding_type']}.",
        "",
        *candidate_rows(result["rows"], "KL vs F16"),
        *pairs_table(result.get("pairs", []), "llama_cpp", "llama.cpp's"),
    ]
    return "\n".join(lines)


def candidate_rows(rows: list[dict[str, Any]], kl_label: str) -> list[str]:
    """Markdown header and one row per file-format candidate (size, KL, top-1, perplexity, decode speed, quantize time)."""
    lines = [
        f"| candidate | file, MiB | bits/weight | {kl_label} | top-1 agreement | perplexity | decode tokens/s | quantize, s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r["metrics"]
        bits = f"{r['bits_per_weight']:.3f}" if "bits_per_weight" in r else "—"
        lines.append(
            f"| {r['name']} | {r['size_bytes'] / 2**20:.2f} | {bits} | {m['kl_divergence']:.4f} | {m['top1_agreement']:.2%} | "
            f"{m['perplexity']:.2f} | {r['decode_tokens_per_s']:.1f} | {r['quantize_seconds'] or '—'} |"
        )
    return lines


if __name__ == "__main__":  # python -m compress.eval.bench.gguf RESULTS.json PLOT.png: the plot of a saved run
    import json
    import sys

    plot_kl_vs_size(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
