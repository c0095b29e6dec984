"""`compress bench draft`: draft models for speculative decoding, measured against the target alone on
the runtime that would run the pair (compress/eval/speculative.py does the decoding).

The target is a GGUF file (run in llama.cpp) or a Hugging Face folder / ``reference:`` source (run in
transformers); every draft runs on the same runtime. Drafts are files or folders given by the user, or,
for a GGUF target, *cuts* of the target: a GGUF of its first N decoder blocks, every tensor copied as it
is (no re-quantization), the no-training baseline (early-exit self-speculation) that shows what a draft
of that size costs per token here.

Prompts are the first ``prompt_tokens`` tokens of ``prompts`` evaluation chunks (text held apart from
calibration text), tokenized with the target's tokenizer. For each draft x k x temperature: tokens and
accepted draft tokens per target pass, acceptance by position, speed-up over the target alone (with
95% intervals over prompts), and for greedy decoding the prompts whose output is the target's own.
Per draft: parameters, file size and its share of the target's, its own decode speed alone (median of
repeats) and its cost per token relative to the target's. Per target: the time of decoding k + 1
tokens in one call relative to one token at the prompt's context (what decides whether verifying k
proposals at once is nearly free on this machine).
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compress.errors import CompressError
from compress.eval.bench.plots import Series, plot_series
from compress.eval.bench.quant import write_results
from compress.eval.speculative import Decoder, batch_difference, prefill, sweep, target_alone
from compress.progress import Reporter

PLOT = "speedup-vs-draft.png"
BLOCK = re.compile(r"^blk\.(\d+)\.")  # llama.cpp's name of a decoder block's tensors
WEIGHT_SUFFIXES = (".safetensors", ".bin")  # a Hugging Face folder's weight files (its size)


# --------------------------------------------------------------------------- a cut of the target


def gguf_block_count(path: Path) -> int:
    """``<arch>.block_count`` of a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    return int(reader.fields[gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)].contents())


def check_cut(blocks: int, total: int) -> None:
    """A cut keeps at least one block and fewer than the target has; else an input error naming --cut."""
    if not 1 <= blocks < total:
        raise CompressError(f"--cut {blocks}: a cut keeps 1 to {total - 1} of the target's {total} blocks")


def cut_gguf(source: Path, target: Path, blocks: int) -> Path:
    """A GGUF of ``source``'s first ``blocks`` decoder blocks at ``target``: every tensor outside the
    blocks (token embedding, final norm, output head, ...) and those of blocks 0..blocks-1 copied byte
    for byte in their stored types, every metadata key (the tokenizer's too) copied, and
    ``<arch>.block_count`` set to ``blocks``. Written beside ``target`` and renamed when complete."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    check_cut(blocks, int(reader.fields[count_key].contents()))
    kept = [t for t in reader.tensors if (m := BLOCK.match(t.name)) is None or int(m.group(1)) < blocks]
    partial = target.with_name(f".{target.name}.partial")
    writer = gguf.GGUFWriter(partial, arch)  # writes general.architecture itself
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):  # the header's own counts
            continue
        if field.name == gguf.Keys.General.ALIGNMENT:
            writer.add_custom_alignment(int(field.contents()))
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = blocks if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub_type)
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data)
    writer.close()
    os.replace(partial, target)
    return target


# --------------------------------------------------------------------------- models on their runtime


@dataclass
class Model:
    """A target or draft loaded on its runtime, with the facts its row reports."""

    name: str
    decoder: Decoder
    facts: dict[str, Any]
    close: Callable[[], None]


class GGUFTokenizer:
    """A GGUF file's own tokenizer (llama.cpp's) in the shape compress.data's chunking calls:
    ``tokenizer(text, add_special_tokens=...)["input_ids"]`` (BOS only where the file asks for it)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        if not add_special_tokens:
            return {"input_ids": self.model.tokenize(text)}
        return {"input_ids": list(self.model.llm.tokenize(text.encode("utf-8"), add_bos=True, special=True))}


def load_gguf(path: Path, name: str, n_ctx: int, threads: int) -> Model:
    from compress.export.gguf import runtime as gguf_runtime
    from compress.export.gguf.check import tensor_totals
    from compress.fsutil import sha256_file

    model = gguf_runtime.LlamaCppModel(path, n_ctx=n_ctx, threads=threads)
    _, params = tensor_totals(path)
    facts = {"path": str(path), "sha256": sha256_file(path), "parameters": params, "size_bytes": path.stat().st_size}
    return Model(name, model, facts, model.close)


def load_torch(source: str, name: str, reporter: Reporter) -> tuple[Model, Any]:
    """A transformers model held in memory (decoding token by token) and its tokenizer."""
    from compress import streaming
    from compress.eval.speculative import TorchDecoder
    from compress.models import load_model
    from compress.schema.recipe import ModelConfig

    lm = load_model(ModelConfig(source=source), Path.cwd(), reporter)
    model = streaming.materialize(lm.model).eval()
    path = lm.source_path
    if path is not None and path.is_dir():
        size = sum(p.stat().st_size for p in path.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
    else:
        size = path.stat().st_size if path is not None else None
    facts = {
        "path": str(path) if path else source,
        "sha256": lm.facts.get("sha256"),
        "parameters": sum(p.numel() for p in model.parameters()),
        "size_bytes": size,
    }
    return Model(name, TorchDecoder(model), facts, lambda: None), lm.tokenizer


def is_gguf(source: str) -> bool:
    from compress.export.gguf.inputs import is_gguf_file

    return is_gguf_file(Path(source).expanduser())


def check_source(source: str, option: str) -> None:
    """A file or folder on disk, or a reference model; else an input error naming ``option``."""
    if not source.startswith("reference:") and not Path(source).expanduser().exists():
        raise CompressError(f"{option} {source}: no such file or folder")


# --------------------------------------------------------------------------- timing


def decode_speed(decoder: Decoder, prompt: list[int], tokens: int, repeats: int) -> float:
    """Median tokens/s of the model alone decoding ``tokens`` greedy tokens after ``prompt``, one per call."""
    rates = []
    for _ in range(repeats):
        gen = target_alone(decoder, prompt, tokens)
        rates.append(len(gen.tokens) / gen.seconds)
    return statistics.median(rates)


def verify_cost(decoder: Decoder, prompt: list[int], ks: list[int], repeats: int) -> dict[str, float]:
    """Per k: the median time of decoding k + 1 tokens in one call over that of one token, both after
    ``prompt`` is in the cache (each call drops what the previous one added). About 1: checking k
    proposals costs the target no more than one token; about k + 1: no better than one at a time."""
    prefill(decoder, prompt)
    ids = [prompt[i % len(prompt)] for i in range(max(ks) + 1)]

    def seconds(n: int) -> float:
        decoder.decode(ids[:n], len(prompt), every_position=True)  # warm-up
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            decoder.decode(ids[:n], len(prompt), every_position=True)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    one = seconds(1)
    return {str(k): round(seconds(k + 1) / one, 3) for k in ks}


# --------------------------------------------------------------------------- the bench


def run_draft_bench(
    target_source: str,
    draft_sources: list[str],
    cuts: list[int],
    evaluation: str,
    out_dir: Path,
    threads: int,
    reporter: Reporter,
    ks: list[int],
    temperatures: list[float],
    prompts: int,
    prompt_tokens: int,
    max_new: int,
    repeats: int,
    keep_files: bool = False,
) -> dict[str, Any]:
    """Every draft (``draft_sources``, then a cut of the target per entry of ``cuts``) x k x temperature
    against the target alone; results.json, results.md and the plot in ``out_dir``."""
    import torch

    from compress.data import DataPlan
    from compress.documents import library_versions
    from compress.export.gguf import runtime as gguf_runtime
    from compress.schema.recipe import DataConfig

    check_source(target_source, "--target")
    for d in draft_sources:
        check_source(d, "--drafts")
    gguf_target = is_gguf(target_source)
    for d in draft_sources:
        if is_gguf(d) != gguf_target:
            want = (
                "a GGUF file (the target runs in llama.cpp)" if gguf_target else "a Hugging Face folder (the target runs in transformers)"
            )
            raise CompressError(f"--drafts {d}: a draft runs on the target's runtime, so it must be {want}")
    if cuts and not gguf_target:
        raise CompressError("--cut: cuts are made from a GGUF target; give --target a .gguf file")
    twice = sorted({d for d in draft_sources if draft_sources.count(d) > 1})
    if twice:
        raise CompressError(f"--drafts {', '.join(twice)}: given more than once")
    n_ctx = prompt_tokens + max_new + max(ks) + 8
    files = out_dir / "files"
    made: list[Path] = []
    models: list[Model] = []
    torch.set_num_threads(threads)
    try:
        if gguf_target:
            gguf_runtime.llama_cpp()  # fail before any work when the binding is missing
            path = Path(target_source).expanduser()
            total = gguf_block_count(path)
            for n in cuts:
                check_cut(n, total)
            target = load_gguf(path, "target", n_ctx, threads)
            models.append(target)
            tokenizer: Any = GGUFTokenizer(target.decoder)
            target.facts["blocks"] = total
            for d in draft_sources:
                models.append(load_gguf(Path(d).expanduser(), d, n_ctx, threads))
                models[-1].facts["kind"] = "file"
            if cuts:
                files.mkdir(parents=True, exist_ok=True)
            for n in cuts:
                with reporter.status(f"cutting the target to its first {n} blocks"):
                    made.append(cut_gguf(path, files / f"cut-{n}.gguf", n))
                models.append(load_gguf(made[-1], f"cut {n} of {total} blocks", n_ctx, threads))
                models[-1].facts.update(kind="cut", blocks=n)
        else:
            target, tokenizer = load_torch(target_source, "target", reporter)
            models.append(target)
            for d in draft_sources:
                models.append(load_torch(d, d, reporter)[0])
                models[-1].facts["kind"] = "folder"
        drafts = models[1:]
        for d in drafts:
            if d.decoder.n_vocab != target.decoder.n_vocab:
                raise CompressError(
                    f"--drafts {d.name}: its vocabulary ({d.decoder.n_vocab:,} tokens) differs from the target's "
                    f"({target.decoder.n_vocab:,}); a draft must share the target's tokenizer"
                )
        data = DataConfig(evaluation={"source": evaluation, "samples": prompts, "seq_len": prompt_tokens, "min_context": 1})
        chunks = DataPlan.load(data, Path.cwd(), reporter).chunks("evaluation", tokenizer)
        prompt_ids = chunks.tokens.tolist()

        with reporter.status("timing the target and each draft alone"):
            target.facts["decode_tokens_per_s"] = round(decode_speed(target.decoder, prompt_ids[0], max_new, repeats), 2)
            target.facts["verify_cost"] = verify_cost(target.decoder, prompt_ids[0], ks, repeats)
            target.facts["batched_logit_difference"] = batch_difference(target.decoder, prompt_ids[0], max(ks) + 1)
            for d in drafts:
                d.facts["decode_tokens_per_s"] = round(decode_speed(d.decoder, prompt_ids[0], max_new, repeats), 2)
                d.facts["cost_vs_target"] = round(target.facts["decode_tokens_per_s"] / d.facts["decode_tokens_per_s"], 4)
                d.facts["parameter_share"] = round(d.facts["parameters"] / target.facts["parameters"], 4)
                if d.facts["size_bytes"] and target.facts["size_bytes"]:
                    d.facts["size_share"] = round(d.facts["size_bytes"] / target.facts["size_bytes"], 4)
                d.facts["acceptance_needed"] = {
                    str(k): {
                        f"{goal:g}x": acceptance_needed(target.facts["verify_cost"][str(k)], d.facts["cost_vs_target"], k, goal)
                        for goal in SPEEDUP_GOALS
                    }
                    for k in ks
                }
        result: dict[str, Any] = {
            "target": {"source": target_source, "runtime": "llama.cpp" if gguf_target else "transformers", **target.facts},
            "drafts": [{"name": d.name, **d.facts} for d in drafts],
            "settings": {
                "k": ks,
                "temperatures": temperatures,
                "prompts": prompts,
                "prompt_tokens": prompt_tokens,
                "max_new": max_new,
                "repeats": repeats,
                "stop": None,
            },
            "evaluation": chunks.facts,
            "threads": threads,
            "host": platform.platform(),
            "cpu_count": os.cpu_count(),
            "llama_cpp": gguf_runtime.library_build() if gguf_target else None,
            "libraries": library_versions(),
            "rows": [],
        }
        out_dir.mkdir(parents=True, exist_ok=True)
        write_results(out_dir, result, markdown_table(result))
        for temperature in temperatures:  # one sweep a temperature (the target alone decoded once for each): a stopped run keeps those done
            found = sweep(
                target.decoder,
                {d.name: d.decoder for d in drafts},
                prompt_ids,
                ks,
                max_new,
                [temperature],
                stop=None,
                track=lambda cell: reporter.info(cell),
            )
            result["rows"] = mark_best(result["rows"] + found)
            write_results(out_dir, result, markdown_table(result))
            plot_speedup(result, out_dir / PLOT)
        return result
    finally:
        for m in models:
            m.close()
        if not keep_files:
            for p in made:
                p.unlink(missing_ok=True)


SPEEDUP_GOALS = (1.0, 1.5)


def acceptance_needed(verify: float, cost: float, k: int, goal: float) -> float | None:
    """The per-position acceptance a draft needs for a speed-up of ``goal`` at ``k``, from the costs alone:
    a round costs the target ``verify`` (its k + 1-token call over one token) plus ``k`` draft steps of
    ``cost`` target steps each, and yields (1 - a^(k+1)) / (1 - a) tokens when every position is kept with
    probability a. None when even a = 1 (k + 1 tokens a round) falls short."""
    need = goal * (verify + k * cost)
    if need > k + 1:
        return None
    low, high = 0.0, 1.0
    for _ in range(60):  # tokens a round grow with a: bisect
        mid = (low + high) / 2
        if sum(mid**i for i in range(k + 1)) < need:
            low = mid
        else:
            high = mid
    return round(high, 3)


def mark_best(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``best: true`` on the row of the highest speed-up of each draft and temperature."""
    best: dict[tuple[str, float], dict[str, Any]] = {}
    for r in rows:
        r["best"] = False
        key = (r["draft"], r["temperature"])
        if key not in best or r["speedup"]["mean"] > best[key]["speedup"]["mean"]:
            best[key] = r
    for r in best.values():
        r["best"] = True
    return rows


def _interval(found: dict[str, Any], digits: int = 2) -> str:
    text = f"{found['mean']:.{digits}f}"
    if "lower" in found:
        text += f" [{found['lower']:.{digits}f}, {found['upper']:.{digits}f}]"
    return text


def _share(draft: dict[str, Any]) -> float:
    """A draft's size as a share of the target's (its parameters' share where the size is unknown)."""
    return draft.get("size_share", draft["parameter_share"])


def markdown_table(result: dict[str, Any]) -> str:
    t, s = result["target"], result["settings"]
    cost = ", ".join(f"k={k}: {v:.2f}x" for k, v in t.get("verify_cost", {}).items())
    lines = [
        f"Target {t['source']} in {t['runtime']} ({t['parameters']:,} parameters, {(t['size_bytes'] or 0) / 2**20:.1f} MiB, "
        f"{t.get('decode_tokens_per_s', 0):.1f} tokens/s alone); {s['prompts']} prompts of {s['prompt_tokens']} tokens, "
        f"{s['max_new']} new tokens each; {result['threads']} threads.",
        f"Target's time to verify k + 1 tokens in one call / one token: {cost or '—'}.",
        _batch_line(t.get("batched_logit_difference")),
        "",
        "| draft | parameters (share) | file, MiB (share) | decode tokens/s alone | cost vs target | "
        "acceptance needed for 1x / 1.5x, by k |",
        "|---|---|---|---|---|---|",
    ]
    for d in result["drafts"]:
        size = f"{d['size_bytes'] / 2**20:.1f} ({d['size_share']:.1%})" if "size_share" in d else "—"
        needed = "; ".join(
            f"k={k}: " + " / ".join("—" if a is None else f"{a:.2f}" for a in goals.values())
            for k, goals in d.get("acceptance_needed", {}).items()
        )
        lines.append(
            f"| {d['name']} | {d['parameters']:,} ({d['parameter_share']:.1%}) | {size} | "
            f"{d.get('decode_tokens_per_s', 0):.1f} | {d.get('cost_vs_target', 0):.3f} | {needed or '—'} |"
        )
    lines += [
        "",
        "| draft | k | temperature | tokens / target pass [95%] | accepted / pass [95%] | acceptance by position | "
        "speed-up [95%] | tokens/s (target alone) | greedy identical (first differences) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        positions = " ".join("—" if a is None else f"{a:.2f}" for a in r["acceptance_by_position"])
        speedup = _interval(r["speedup"]) + "x" + (" **best**" if r.get("best") else "")
        identical = "—"
        if "greedy_identical" in r:
            firsts = ", ".join(str(i) for i in r["first_differences"])
            margins = ", ".join(f"{m:.3f}" for m in r.get("first_difference_margins", []))
            identical = f"{r['greedy_identical']}/{r['prompts']}" + (f" (at {firsts}; top-2 margins {margins})" if firsts else "")
        lines.append(
            f"| {r['draft']} | {r['k']} | {r['temperature']:g} | {_interval(r['tokens_per_pass'])} | "
            f"{_interval(r['accepted_per_pass'])} | {positions} | {speedup} | "
            f"{r['tokens_per_s']['mean']:.1f} ({r['target_tokens_per_s']['mean']:.1f}) | {identical} |"
        )
    return "\n".join(lines)


def _batch_line(found: dict[str, Any] | None) -> str:
    if not found:
        return ""
    return (
        f"Its logits for {found['positions']} tokens decoded in one call differ from one call each by up to {found['max']:.4f} "
        f"(mean {found['mean']:.5f}): greedy outputs can part where its top two logits are closer."
    )


def plot_speedup(result: dict[str, Any], path: Path) -> Path | None:
    """Greedy speed-up against each draft's size share of the target, one line per k, a dashed line at 1."""
    shares = {d["name"]: _share(d) for d in result["drafts"]}
    rows = [r for r in result["rows"] if r["mode"] == "greedy"]
    if not rows:
        return None
    series = []
    for k in sorted({r["k"] for r in rows}):
        mine = sorted((r for r in rows if r["k"] == k), key=lambda r: shares[r["draft"]])
        series.append(Series(f"k = {k}", "o-", [shares[r["draft"]] for r in mine], [r["speedup"]["mean"] for r in mine]))
    first_k = min(r["k"] for r in rows)
    notes = [(r["draft"], shares[r["draft"]], r["speedup"]["mean"]) for r in rows if r["k"] == first_k]
    return plot_series(
        path,
        series,
        notes,
        "draft size / target size",
        "speed-up over the target alone (greedy)",
        f"{result['target']['source']}: speculative decoding in {result['target']['runtime']}",
        reference_y=1.0,
    )
