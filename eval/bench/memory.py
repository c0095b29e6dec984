"""`compress bench memory`: peak memory and time of `compress run` on a model and on a copy of it cut
to a few blocks, for RTN and GPTQ.

Each measurement is a fresh process: the bench writes a recipe (W4 g128 symmetric weights, the
output head kept in float, no exports, no gates) and runs ``compress run`` on it in a subprocess,
then reads the run's own measurements: report.json's ``memory`` (peak RSS per phase and in total)
and manifest.json's timings and stage summary (seconds per block). The parent never loads a model,
so the child's peak is the run's alone. The cut copy is a Hugging Face folder with the first
``blocks`` decoder blocks (see ``cut_blocks``): if the run's memory does not grow with depth, the
full model and the cut copy peak at about the same RSS.

results.json and results.md are rewritten after every run, so a stopped bench keeps its rows.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from compress.errors import CompressError
from compress.fsutil import atomic_directory
from compress.progress import Reporter
from compress.quantizers.plugin import GPTQ, RTN

MIB = 2**20
DEFAULT_METHODS = (RTN.name, GPTQ.name)  # the quantization methods (GPTQ is also an export format's name)
SCHEME = {"bits": 4, "group_size": 128, "symmetric": True}
"""The weights every run quantizes to (as `compress bench quant`'s W4g128s), the output head kept in float."""
TARGET_RATIO = 1.15
"""Issue 27's target: the full model's peak RSS at most 15% above the cut copy's, for the same recipe."""
BLOCK_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
"""A decoder block's tensors: ``model.layers.<i>.`` (Llama, Qwen, Mistral, Gemma, ...)."""
NOT_COPIED = ("config.json", "model.safetensors.index.json")  # rewritten for the cut copy
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
COPY_CHUNK = 64 * MIB


# ------------------------------------------------------------------------------ the cut copy


def checkpoint_bytes(directory: Path) -> int:
    """Bytes of the folder's *.safetensors files (the checkpoint the run reads)."""
    return sum(p.stat().st_size for p in Path(directory).glob("*.safetensors"))


def cut_blocks(source: Path, target: Path, blocks: int) -> dict[str, Any]:
    """Write ``target``: the Hugging Face folder ``source`` with only its first ``blocks`` decoder blocks.

    config.json says ``num_hidden_layers: blocks`` (and keeps as many ``layer_types``); the weights are
    the source's tensors outside the blocks (embeddings, final norm, the head when it is stored: a tied
    head stays tied) and those of blocks 0 .. blocks-1, copied byte for byte from each source file's
    data section in slices of at most 64 MiB, so the copy never holds a tensor, let alone the model.
    Every other file (tokenizer, generation config, chat template) is copied as it is. Returns what
    was kept: {"blocks", "source_blocks", "tensors", "bytes"}."""
    from compress.inputs import check_json, check_safetensors, safetensors_data_start

    source, target = Path(source), Path(target)
    config = check_json(source / "config.json")
    have = config.get("num_hidden_layers")
    if not isinstance(have, int):
        raise CompressError(
            f"{source / 'config.json'}: no num_hidden_layers; cutting blocks needs a decoder with its layers at the top level"
        )
    if not 1 <= blocks <= have:
        raise CompressError(f"--cut-blocks {blocks}: the model at {source} has {have} blocks; give 1 to {have}")
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise CompressError(f"{source} has no *.safetensors files to cut")
    config["num_hidden_layers"] = blocks
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:blocks]
    kept: list[tuple[Path, int, str, dict[str, Any]]] = []
    for path in files:
        header = check_safetensors(path)
        start = safetensors_data_start(path.stat().st_size, header)
        for name, entry in header.items():
            match = BLOCK_INDEX.search(name)
            if name != "__metadata__" and (match is None or int(match.group(1)) < blocks):
                kept.append((path, start, name, entry))
    with atomic_directory(target, overwrite=True, kind=None) as tmp:  # a scratch copy in our benchmark's folder
        for item in sorted(source.iterdir()):
            if item.is_file() and item.name not in NOT_COPIED and not item.name.endswith(WEIGHT_SUFFIXES):
                shutil.copy2(item, tmp / item.name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        total = _write_safetensors(tmp / "model.safetensors", kept)
    return {"blocks": blocks, "source_blocks": have, "tensors": len(kept), "bytes": total}


def _write_safetensors(path: Path, tensors: list[tuple[Path, int, str, dict[str, Any]]]) -> int:
    """A safetensors file of ``tensors`` (source file, where its data section starts, name, its header
    entry), each tensor's bytes copied from its source file in slices: 8-byte little-endian header
    length, the JSON header (padded with spaces to a multiple of 8), then the data in header order."""
    header: dict[str, Any] = {}
    offset = 0
    for _, _, name, entry in tensors:
        size = entry["data_offsets"][1] - entry["data_offsets"][0]
        header[name] = {"dtype": entry["dtype"], "shape": entry["shape"], "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    sources: dict[Path, Any] = {}
    try:
        with open(path, "wb") as out:
            out.write(len(raw).to_bytes(8, "little"))
            out.write(raw)
            for src, start, _, entry in tensors:
                if src not in sources:
                    sources[src] = open(src, "rb")  # noqa: SIM115 - closed below, one handle per source file
                f = sources[src]
                begin, end = entry["data_offsets"]
                f.seek(start + begin)
                left = end - begin
                while left:
                    chunk = f.read(min(left, COPY_CHUNK))
                    if not chunk:
                        raise CompressError(f"{src}: ends inside tensor data (truncated file)")
                    out.write(chunk)
                    left -= len(chunk)
    finally:
        for f in sources.values():
            f.close()
    return 8 + len(raw) + offset


# ---------------------------------------------------------------------------- the model folder


def model_directory(source: str, reporter: Reporter) -> Path:
    """The Hugging Face folder of a model source: a folder as given, a reference model's folder (a
    reference GGUF: its cached float conversion, made once here if missing), or a cached hub id."""
    from compress import assets
    from compress.paths import CONVERTED_MARKER, HUB_ID

    asset = assets.ensure_reference(source, "model", reporter)
    if asset is not None:
        if asset.hf_directory:
            return asset.path
        from compress.export.gguf.source import converted_dir
        from compress.plugins import source_format

        gguf = next(f for f in asset.files if source_format(f) is not None)
        folder = converted_dir(asset.meta["files"][gguf.name])
        if not (folder / CONVERTED_MARKER).is_file():  # converted on first load, as every run would
            from compress.models import load_model
            from compress.schema.recipe import ModelConfig

            load_model(ModelConfig(source=source), Path.cwd(), reporter)
        return folder
    path = Path(source).expanduser()
    if (path / "config.json").is_file():
        return path
    if HUB_ID.match(source):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(source, local_files_only=True))
        except Exception as exc:  # huggingface_hub raises several types for "not cached"
            raise CompressError(f"--model {source}: not in the local Hugging Face cache; compress never downloads models") from exc
    raise CompressError(f"--model {source}: not a Hugging Face folder (no config.json), a reference:<name> or a cached hub id")


# ----------------------------------------------------------------------------------- the runs


def recipe_yaml(model_dir: Path, method: str, data: dict[str, Any], threads: int) -> str:
    """The recipe each measurement runs: ``method`` at W4 g128 symmetric in the checkpoint's own dtype,
    the head in float, no exports."""
    import yaml

    recipe = {
        "version": 1,
        "name": f"bench-memory-{method}",
        "seed": 0,
        "model": {"source": str(model_dir), "dtype": "auto"},  # the checkpoint's own dtype, as every recipe's default
        "data": data,
        "compute": {"device": "cpu", "threads": threads},
        "stages": [{"quantize": {"method": method, **SCHEME, "ignore": ["lm_head"]}}],
        "exports": [],
        "gates": [],
    }
    return yaml.safe_dump(recipe, sort_keys=False)


def run_once(recipe: Path, out: Path, sets: list[str], log: Path) -> tuple[dict[str, Any], dict[str, Any], float, float]:
    """`compress run RECIPE` in a fresh process, its output in ``log``: (report.json, manifest.json,
    wall seconds, the process's peak RSS in MiB as the kernel counted it, from wait4)."""
    command = [sys.executable, "-m", "compress", "run", str(recipe), "-o", str(out), "-q", "--overwrite"]
    for item in sets:
        command += ["--set", item]
    started = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        raise CompressError(f"compress run {recipe} exited {proc.returncode} (output in {log}): " + " | ".join(tail))
    report = json.loads((out / "report.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    return report, manifest, wall, usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024) / MIB


def row_of(
    model: str, blocks: int, method: str, size: int, report: dict[str, Any], manifest: dict[str, Any], wall: float, peak: float
) -> dict[str, Any]:
    memory = report.get("memory") or {}
    stage = (manifest.get("stages") or [{}])[0]
    per_block = stage.get("summary", {}).get("blocks")
    if per_block:
        seconds_per_block, basis = sum(b["seconds"] for b in per_block) / len(per_block), "blocks"
    else:  # a stage that does not record blocks (RTN layer by layer): its time over the blocks
        seconds_per_block, basis = stage.get("duration_s", 0.0) / blocks, "stage/blocks"
    return {
        "model": model,
        "blocks": blocks,
        "method": method,
        "checkpoint_bytes": size,
        "peak_rss_mb": memory.get("peak_rss_mb"),
        "peak_rss_over_checkpoint": None if not size or memory.get("peak_rss_mb") is None else memory["peak_rss_mb"] * MIB / size,
        "phases": {k: v["peak_rss_mb"] for k, v in memory.get("phases", {}).items()},
        "process_peak_rss_mb": round(peak, 1),
        "predicted_rss_mb": (memory.get("predicted") or {}).get("peak_rss_mb"),
        "seconds_per_block": round(seconds_per_block, 3),
        "seconds_per_block_from": basis,
        "stage_s": stage.get("duration_s"),
        "run_s": (manifest.get("timings") or {}).get("total_s"),
        "wall_s": round(wall, 1),
    }


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Method -> the full model's peak RSS over the cut copy's."""
    out = {}
    for method in dict.fromkeys(r["method"] for r in rows):
        full = [r for r in rows if r["method"] == method and r["variant"] == "full"]
        cut = [r for r in rows if r["method"] == method and r["variant"] == "cut"]
        if full and cut and cut[0]["peak_rss_mb"]:
            out[method] = round(full[0]["peak_rss_mb"] / cut[0]["peak_rss_mb"], 3)
    return out


def run_memory_bench(
    model: str,
    data: Any,
    methods: list[str],
    cut: int,
    out_dir: Path,
    threads: int,
    reporter: Reporter,
    sets: list[str] | None = None,
    keep_files: bool = False,
) -> dict[str, Any]:
    """Each method on the model and on its copy cut to ``cut`` blocks, a fresh `compress run` each."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    full_dir = model_directory(model, reporter)
    full_blocks = json.loads((full_dir / "config.json").read_text()).get("num_hidden_layers")
    cut_dir = out_dir / "files" / f"cut-{cut}"
    with reporter.status(f"writing the copy cut to {cut} blocks: {cut_dir}"):
        cut_facts = cut_blocks(full_dir, cut_dir, cut)
    data_json = data.model_dump(mode="json", exclude_none=True)
    result: dict[str, Any] = {
        "model": {"source": model, "directory": str(full_dir), "blocks": full_blocks},
        "cut": cut_facts,
        "scheme": SCHEME,
        "data": data_json,
        "threads": threads,
        "sets": sets or [],
        "host": platform.platform(),
        "cpu_count": os.cpu_count(),
        "target_ratio": TARGET_RATIO,
        "rows": [],
        "ratios": {},
    }
    variants = (("full", full_dir, full_blocks), ("cut", cut_dir, cut))
    try:
        for method in methods:
            for variant, folder, blocks in variants:
                name = f"{variant}-{method}"
                reporter.info(
                    f"[bold]{method}[/] on {'the model' if variant == 'full' else f'the copy cut to {cut} blocks'} ({blocks} blocks)"
                )
                runs = out_dir / "runs" / name
                runs.mkdir(parents=True, exist_ok=True)
                recipe = runs / "recipe.yaml"
                recipe.write_text(recipe_yaml(folder, method, data_json, threads))
                artifact = out_dir / "files" / f"artifact-{name}"
                with reporter.status(f"compress run {recipe} (a fresh process)"):
                    report, manifest, wall, peak = run_once(recipe, artifact, sets or [], runs / "run.log")
                for doc in ("report.json", "manifest.json", "summary.md"):
                    shutil.copy2(artifact / doc, runs / doc)
                if not keep_files:
                    shutil.rmtree(artifact, ignore_errors=True)
                row = row_of(
                    model if variant == "full" else f"{model} cut to {cut}",
                    blocks,
                    method,
                    checkpoint_bytes(folder),
                    report,
                    manifest,
                    wall,
                    peak,
                )
                result["rows"].append({"variant": variant, **row})
                result["ratios"] = ratios(result["rows"])
                write_results(out_dir, result)
    finally:
        if not keep_files:
            shutil.rmtree(out_dir / "files", ignore_errors=True)
    return result


def write_results(out_dir: Path, result: dict[str, Any]) -> None:
    """results.json and results.md, rewritten after every run so a stopped bench keeps what it measured."""
    (out_dir / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "results.md").write_text(markdown_table(result) + "\n")


def markdown_table(result: dict[str, Any]) -> str:
    rows = result["rows"]
    phases = list(dict.fromkeys(p for r in rows for p in r["phases"] if p in ("load_model", "stages", "evaluate", "write_model")))
    lines = [
        f"W{SCHEME['bits']} g{SCHEME['group_size']} symmetric, head in float; {result['threads']} threads; each row a fresh "
        "`compress run` (peak RSS: report.json's memory section; MiB).",
        "",
        "| model | blocks | method | checkpoint, MiB | peak RSS | peak / checkpoint | "
        + " | ".join(f"{p} peak" for p in phases)
        + " | s/block | run, s |",
        "|---|---|---|---|---|---|" + "---|" * len(phases) + "---|---|",
    ]
    for r in rows:
        per_block = f"{r['seconds_per_block']:.2f}" + ("" if r["seconds_per_block_from"] == "blocks" else "*")
        over = "—" if r["peak_rss_over_checkpoint"] is None else f"{r['peak_rss_over_checkpoint']:.2f}"
        cells = [f"{r['phases'].get(p, 0):,.0f}" if p in r["phases"] else "—" for p in phases]
        lines.append(
            f"| {r['model']} | {r['blocks']} | {r['method']} | {r['checkpoint_bytes'] / MIB:,.1f} | {r['peak_rss_mb']:,.0f} | {over} | "
            + " | ".join(cells)
            + f" | {per_block} | {r['run_s']:.1f} |"
        )
    if any(r["seconds_per_block_from"] != "blocks" for r in rows):
        lines += ["", "\\* the stage's seconds over the blocks (the stage records no per-block times)."]
    if result["ratios"]:
        lines += [
            "",
            "Peak RSS, full model / cut copy: "
            + ", ".join(f"{m} {v:.2f}" for m, v in result["ratios"].items())
            + f" (issue 27's target: at most {result['target_ratio']:.2f}).",
        ]
    return "\n".join(lines)
