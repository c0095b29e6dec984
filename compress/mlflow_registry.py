"""Publishing artifacts to an MLflow model registry, pulling them back verified, and listing them.

Where: a tracking server by URI (``--uri``, recipe ``publish.uri``, or ``MLFLOW_TRACKING_URI``;
MLflow reads its credentials, e.g. ``MLFLOW_TRACKING_TOKEN`` or ``MLFLOW_TRACKING_USERNAME`` /
``MLFLOW_TRACKING_PASSWORD``, from the environment itself), else the embedded registry: a SQLite
database and a local artifact store in one directory, no server (``--store``, recipe
``publish.store``, ``$COMPRESS_REGISTRY``, else ``~/.local/share/compress/registry``).

A version holds the whole artifact directory (manifest, report, recipe, ``model/``, every export,
the JUnit/Markdown reports and plots) and a generated ``MODEL_CARD.md``, under the run artifact
path ``artifact/``. A publish goes in this order, so that no version is ever incomplete:

1. the artifact is checked against its manifest (every file's SHA-256; nothing missing or extra);
2. gates: refused when one failed, unless forced (then recorded on the version and in the card);
3. a version of the same name with the same content hash is returned as it is (idempotent);
4. the files are uploaded to a new MLflow run and the upload is checked (every path and size);
5. the version is created in one request carrying all its tags; only then are aliases set.

A publish killed before step 5 leaves a run and no version: ``compress registry list`` and the
next publish mark such runs FAILED once their process is gone. ``pull`` checks every file against
the manifest and the version's tags, so it accepts nothing incomplete or altered either.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compress.errors import EXIT_GATE_FAILED, ArtifactError, CompressError
from compress.fsutil import atomic_directory, check_target, sha256_file
from compress.marker import ARTIFACT, MANIFEST, MODEL_CARD, write_marker
from compress.model_card import gate_summary, model_card
from compress.progress import Reporter
from compress.schema.recipe import alias_problem
from compress.verify import Contents, check_artifact

EXPERIMENT = "compress-publish"  # the MLflow experiment holding one run per publish
ARTIFACT_PATH = "artifact"  # the run artifact folder a version's source points at
DATABASE = "mlflow.db"  # the embedded registry's SQLite file, in its directory
STALE_AFTER_S = 24 * 3600  # a publish started on another host this long ago without a version is taken as dead
_INSTALL = "publishing needs MLflow: pip install 'compress[registry]'"


class Tag:
    """Tag keys on versions (V), runs (R) and registered models (M); named once."""

    CONTENT = "compress.content_sha256"  # V R: digest over every file's path and SHA-256 (manifest.json included)
    MANIFEST = "compress.manifest_sha256"  # V
    CARD = "compress.model_card_sha256"  # V
    FILES = "compress.files"  # V: files in the artifact (model card not counted)
    SIZE = "compress.size_bytes"  # V
    BASE_MODEL = "compress.base_model"  # V R M: the source model as the recipe named it
    BASE_SHA = "compress.base_model_sha256"  # V R
    RECIPE_SHA = "compress.recipe_sha256"  # V R
    GATES = "compress.gates"  # V: passed | failed | none
    GATES_PASSED = "compress.gates_passed"  # V: "3/3"
    FORCED = "compress.forced"  # V: "true" when published with --force although a gate failed
    VERSION = "compress.version"  # V: the compress release that published it
    NAME = "compress.registered_model"  # R: the name the run publishes to
    HOST = "compress.publisher.host"  # R
    PID = "compress.publisher.pid"  # R
    STARTED = "compress.publisher.started"  # R: unix time
    FAILURE = "compress.failure"  # R: why the publish did not end in a version


class RegistryError(CompressError):
    """The registry could not be reached, or refused or failed a request."""


class PublishRefused(CompressError):
    """A gate failed and publishing was not forced (exit code 1, like a failed gate)."""

    exit_code = EXIT_GATE_FAILED
    label = "not published"


@dataclass(frozen=True)
class Location:
    tracking_uri: str
    registry_uri: str
    store: Path | None = None  # the embedded registry's directory; None for a server

    def describe(self) -> str:
        return f"embedded registry {self.store}" if self.store else f"MLflow at {self.tracking_uri}"

    @property
    def exists(self) -> bool:
        """False only for an embedded registry that nothing was published to yet."""
        return self.store is None or (self.store / DATABASE).is_file()


def default_store() -> Path:
    """``$COMPRESS_REGISTRY``, else ``$XDG_DATA_HOME/compress/registry``, else ``~/.local/share/compress/registry``."""
    if os.environ.get("COMPRESS_REGISTRY"):
        return Path(os.environ["COMPRESS_REGISTRY"]).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "share") / "compress" / "registry"


def resolve_location(uri: str | None = None, store: str | Path | None = None) -> Location:
    """An explicit URI, else an explicit store, else ``MLFLOW_TRACKING_URI``, else the default store."""
    if uri and store:
        raise RegistryError("give a tracking server URI or an embedded store directory, not both")
    uri = uri or (None if store else os.environ.get("MLFLOW_TRACKING_URI"))
    if uri:
        return Location(uri, os.environ.get("MLFLOW_REGISTRY_URI") or uri)
    directory = Path(store).expanduser().resolve() if store else default_store().resolve()
    database = f"sqlite:///{directory / DATABASE}"
    return Location(database, database, directory)


def artifact_name(contents: Contents) -> str:
    """The recipe's name, else the directory's."""
    return (contents.manifest.get("recipe", {}).get("expanded") or {}).get("name") or contents.root.resolve().name


@contextmanager
def _errors(location: Location) -> Iterator[None]:
    """MLflow's and the network's exceptions as RegistryErrors naming the registry."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as exc:
        hint = ""
        if "401" in exc.message or "403" in exc.message:
            hint = (
                " — the server wants credentials: set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or "
                "MLFLOW_TRACKING_TOKEN, in the environment (for a user allowed to write)"
            )
        raise RegistryError(f"{location.describe()}: {exc.message}{hint}") from None
    except OSError as exc:  # connection refused, DNS, disk
        raise RegistryError(f"{location.describe()}: {exc}") from None


def connect(location: Location, create: bool = True) -> Any:
    """An MlflowClient for ``location``. The embedded store is created on first use when
    ``create``; otherwise a missing one is an error (pull) rather than a new empty registry."""
    try:
        from mlflow import MlflowClient
    except ImportError:
        raise RegistryError(_INSTALL) from None
    logging.getLogger("mlflow").setLevel(logging.WARNING)  # MLflow's info lines (run links, waits) are not ours to print
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # our own bars show the transfers
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # stdout is ours (`registry list --json`)
    if location.store is not None:
        if not create and not location.exists:
            raise RegistryError(
                f"no registry at {location.store}: nothing was published there yet (`compress publish` creates it; "
                "--store or $COMPRESS_REGISTRY choose another)"
            )
        location.store.mkdir(parents=True, exist_ok=True)
        if not location.exists:
            _create_store(location, MlflowClient)
    return MlflowClient(tracking_uri=location.tracking_uri, registry_uri=location.registry_uri)


def _create_store(location: Location, client_class: Any) -> None:
    """Create the embedded store's database under a temporary name, then rename it into place:
    MLflow creates and migrates a new SQLite database in many commits, and a publish killed between
    two of them left a database that MLflow then refused ("out-of-date database schema"). Runs
    under the publish lock (``_exclusive``), so a leftover temporary file is an abandoned attempt."""
    assert location.store is not None
    for stale in location.store.glob(f".{DATABASE}.creating-*"):
        stale.unlink(missing_ok=True)
    tmp = location.store / f".{DATABASE}.creating-{os.getpid()}-{time.time_ns()}"  # a new name each attempt: MLflow caches stores by URI
    uri = f"sqlite:///{tmp}"
    client_class(tracking_uri=uri, registry_uri=uri).search_registered_models(max_results=1)  # both stores' tables
    os.replace(tmp, location.store / DATABASE)


@contextmanager
def _exclusive(location: Location, reporter: Reporter) -> Iterator[None]:
    """Publishes to one embedded registry take turns (a file lock in its directory): SQLite and
    MLflow's first-use schema migration do not take concurrent writers. A server needs no lock."""
    if location.store is None:
        yield
        return
    import fcntl

    location.store.mkdir(parents=True, exist_ok=True)
    with open(location.store / ".publish.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            with reporter.status(f"waiting for another publish to {location.store} to finish"):
                fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _error_code(exc: Exception) -> str:
    """MLflow's error code of an MlflowException (e.g. RESOURCE_ALREADY_EXISTS), else ""."""
    return getattr(exc, "error_code", "")


def _experiment_id(client: Any, location: Location) -> str:
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(EXPERIMENT)
    if found is not None:
        return found.experiment_id
    where = (location.store / "artifacts").as_uri() if location.store else None
    try:
        return client.create_experiment(EXPERIMENT, artifact_location=where)
    except MlflowException as exc:  # another publish created it first
        if _error_code(exc) != "RESOURCE_ALREADY_EXISTS" and client.get_experiment_by_name(EXPERIMENT) is None:
            raise
        return client.get_experiment_by_name(EXPERIMENT).experiment_id


def _check_name(name: str) -> None:
    if not name or "'" in name or "`" in name or name != name.strip():
        raise RegistryError(f"registered model name {name!r} is not usable: no quotes, backticks or surrounding spaces")


def _versions(client: Any, name: str, content: str | None = None) -> list[Any]:
    query = f"name='{name}'" + (f" and tags.`{Tag.CONTENT}`='{content}'" if content else "")
    return sorted(client.search_model_versions(query), key=lambda v: int(v.version))


def _ready(version: Any) -> bool:
    return version.status == "READY" and Tag.CONTENT in version.tags


# --- publishing -------------------------------------------------------------------------------


@dataclass
class Published:
    name: str
    version: str
    reused: bool
    aliases: list[str]
    content_sha256: str
    gates: str
    forced: bool
    location: str
    failed_runs_marked: list[str] = field(default_factory=list)


def _run_tags(contents: Contents, name: str) -> dict[str, str]:
    model = contents.manifest.get("model", {})
    return {
        Tag.NAME: name,
        Tag.CONTENT: contents.content_sha256,
        Tag.BASE_MODEL: str(model.get("source", "")),
        Tag.BASE_SHA: str(model.get("sha256", "")),
        Tag.RECIPE_SHA: str(contents.manifest.get("recipe", {}).get("sha256", "")),
        Tag.HOST: socket.gethostname(),
        Tag.PID: str(os.getpid()),
        Tag.STARTED: f"{time.time():.3f}",
    }


def _metrics(report: dict[str, Any]) -> dict[str, float]:
    """Measured evaluation values as run metrics (``<artifact>.<metric>``, device-qualified when
    not local), so MLflow's UI can compare versions."""
    found: dict[str, float] = {}
    for ev in report.get("evaluations") or []:
        if ev.get("source", "measured") != "measured":
            continue
        device = "" if ev.get("device") in (None, "cpu", "cuda", "local") else f"@{ev['device']}"
        for key, value in ev.get("metrics", {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                found.setdefault(f"{ev['artifact']}{device}.{key}".replace("@", "_at_"), float(value))
    return found


def _upload(client: Any, run_id: str, contents: Contents, card: Path, reporter: Reporter) -> None:
    total = sum(contents.sizes.values())
    items = [*contents.files, None]
    for rel in reporter.track(items, f"uploading {len(contents.files)} files ({total / 2**20:,.1f} MiB) and the model card"):
        if rel is None:
            client.log_artifact(run_id, str(card), ARTIFACT_PATH)
            continue
        parent = str(Path(rel).parent)
        client.log_artifact(run_id, str(contents.root / rel), ARTIFACT_PATH if parent == "." else f"{ARTIFACT_PATH}/{parent}")


def _listing(client: Any, run_id: str, path: str = ARTIFACT_PATH) -> dict[str, int | None]:
    found: dict[str, int | None] = {}
    for entry in client.list_artifacts(run_id, path):
        if entry.is_dir:
            found.update(_listing(client, run_id, entry.path))
        else:
            found[entry.path[len(ARTIFACT_PATH) + 1 :]] = entry.file_size
    return found


def _check_upload(client: Any, run_id: str, contents: Contents, card_size: int) -> None:
    expected = {**contents.sizes, MODEL_CARD: card_size}
    stored = _listing(client, run_id)
    wrong = sorted(rel for rel, size in expected.items() if rel not in stored or (stored[rel] is not None and stored[rel] != size))
    if wrong:
        raise RegistryError(
            f"the upload to run {run_id} is incomplete ({len(wrong)} file(s) missing or short, e.g. {wrong[0]}); "
            "no version was created — publish again"
        )


def _ensure_registered_model(client: Any, name: str, contents: Contents) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
        return
    except MlflowException as exc:
        if _error_code(exc) != "RESOURCE_DOES_NOT_EXIST":
            raise
    source = str(contents.manifest.get("model", {}).get("source", ""))
    try:
        client.create_registered_model(name, tags={Tag.BASE_MODEL: source}, description=f"Compressed from {source} by compress.")
    except MlflowException as exc:  # a concurrent publish created it first
        if _error_code(exc) != "RESOURCE_ALREADY_EXISTS":
            raise


def _set_aliases(client: Any, name: str, version: str, aliases: list[str]) -> None:
    for alias in aliases:
        client.set_registered_model_alias(name, alias, version)


def check_aliases(aliases: list[str]) -> None:
    for alias in aliases:
        if (problem := alias_problem(alias)) is not None:
            raise RegistryError(problem)


def publish(
    directory: str | Path,
    name: str | None = None,
    aliases: list[str] | None = None,
    force: bool = False,
    location: Location | None = None,
    reporter: Reporter | None = None,
) -> Published:
    """Publish an artifact directory as a registry version (see the module docstring for the order)."""
    reporter = reporter or Reporter(quiet=True)
    location = location or resolve_location()
    aliases = list(dict.fromkeys(aliases or []))
    check_aliases(aliases)
    with reporter.status(f"checking {directory} against its manifest"):
        contents = check_artifact(directory, advice="an artifact is published as its run wrote it: run the recipe again to change it")
    name = name or artifact_name(contents)
    _check_name(name)
    status, passed, total = gate_summary(contents.report)
    if status == "failed" and not force:
        failed = [g["name"] for g in contents.report["gates"] if not g.get("passed")]
        raise PublishRefused(
            f"{total - passed} of {total} gates failed in {contents.root / 'report.json'} "
            f"({', '.join(failed)}); fix the artifact, or pass --force to publish it marked as forced"
        )
    forced = force and status == "failed"
    with _exclusive(location, reporter):
        return _publish(contents, name, aliases, status, passed, total, forced, location, reporter)


def _publish(
    contents: Contents,
    name: str,
    aliases: list[str],
    status: str,
    passed: int,
    total: int,
    forced: bool,
    location: Location,
    reporter: Reporter,
) -> Published:
    client = connect(location)
    with _errors(location):
        marked = mark_abandoned(client)
        existing = [v for v in _versions(client, name, contents.content_sha256) if _ready(v)]
        if existing:
            version = existing[0]
            _set_aliases(client, name, str(version.version), aliases)
            return Published(
                name,
                str(version.version),
                True,
                aliases,
                contents.content_sha256,
                version.tags.get(Tag.GATES, status),
                version.tags.get(Tag.FORCED) == "true",
                location.describe(),
                marked,
            )
        run = client.create_run(
            _experiment_id(client, location), run_name=f"{name} {contents.content_sha256[:12]}", tags=_run_tags(contents, name)
        )
        run_id = run.info.run_id
        try:
            version = _publish_run(client, run, name, contents, status, passed, total, forced, aliases, reporter)
        except BaseException as exc:
            _fail_run(client, run_id, f"{type(exc).__name__}: {exc}")
            raise
        client.set_terminated(run_id, "FINISHED")
    return Published(name, version, False, aliases, contents.content_sha256, status, forced, location.describe(), marked)


def _publish_run(
    client: Any,
    run: Any,
    name: str,
    contents: Contents,
    status: str,
    passed: int,
    total: int,
    forced: bool,
    aliases: list[str],
    reporter: Reporter,
) -> str:
    run_id = run.info.run_id
    metrics = _metrics(contents.report)
    if metrics:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in sorted(metrics.items())])
    card_text = model_card(contents.manifest, contents.report, name, contents.sizes, forced)
    with tempfile.TemporaryDirectory(prefix="compress-card-") as tmp:
        card = Path(tmp) / MODEL_CARD
        card.write_text(card_text)
        _upload(client, run_id, contents, card, reporter)
        card_sha, card_size = sha256_file(card), card.stat().st_size
    _check_upload(client, run_id, contents, card_size)
    _ensure_registered_model(client, name, contents)
    model = contents.manifest.get("model", {})
    tags = {
        Tag.CONTENT: contents.content_sha256,
        Tag.MANIFEST: contents.files[MANIFEST],
        Tag.CARD: card_sha,
        Tag.FILES: str(len(contents.files)),
        Tag.SIZE: str(sum(contents.sizes.values())),
        Tag.BASE_MODEL: str(model.get("source", "")),
        Tag.BASE_SHA: str(model.get("sha256", "")),
        Tag.RECIPE_SHA: str(contents.manifest.get("recipe", {}).get("sha256", "")),
        Tag.GATES: status,
        Tag.GATES_PASSED: f"{passed}/{total}",
        Tag.FORCED: "true" if forced else "false",
        Tag.VERSION: str(contents.manifest.get("versions", {}).get("compress", "")),
    }
    description = (
        f"{status} gates ({passed}/{total})"
        + (", published with --force" if forced else "")
        + f"; compressed from {model.get('source', '?')}; content {contents.content_sha256[:16]}"
    )
    with reporter.status(f"registering a version of {name}"):
        created = client.create_model_version(
            name, source=f"{run.info.artifact_uri}/{ARTIFACT_PATH}", run_id=run_id, tags=tags, description=description
        )
        version = _settle_duplicates(client, name, contents.content_sha256, str(created.version))
        _set_aliases(client, name, version, aliases)
    return version


def _settle_duplicates(client: Any, name: str, content: str, version: str) -> str:
    """Two publishes of the same content at once both create a version: the lower number is kept,
    and this publish deletes its own when it is the higher."""
    same = [v for v in _versions(client, name, content) if _ready(v)]
    first = str(same[0].version) if same else version
    if int(first) < int(version):
        client.delete_model_version(name, version)
        return first
    return version


def _fail_run(client: Any, run_id: str, reason: str) -> None:
    try:
        client.set_tag(run_id, Tag.FAILURE, reason[:4000])
        client.set_terminated(run_id, "FAILED")
    except Exception:  # the registry may be what failed; the run then stays RUNNING and is marked by the next sweep
        pass


def _publisher_gone(tags: dict[str, str], now: float) -> str | None:
    """Why the process behind a RUNNING publish run is known to be gone, or None while it may be alive."""
    import psutil

    try:
        pid, started = int(tags.get(Tag.PID, "")), float(tags.get(Tag.STARTED, ""))
    except ValueError:
        return "the run has no publisher tags"
    if tags.get(Tag.HOST) == socket.gethostname():
        try:
            alive = psutil.Process(pid).create_time() <= started + 1
        except psutil.Error:
            alive = False
        return None if alive else f"publisher process {pid} on {tags.get(Tag.HOST)} ended before creating a version"
    if now - started > STALE_AFTER_S:
        return f"publisher on {tags.get(Tag.HOST)} started {(now - started) / 3600:.0f} h ago and created no version"
    return None


def mark_abandoned(client: Any) -> list[str]:
    """Mark FAILED every publish run whose process is gone without creating a version (killed
    midway). Returns their run ids."""
    found = client.get_experiment_by_name(EXPERIMENT)
    if found is None:
        return []
    marked, now = [], time.time()
    for run in client.search_runs([found.experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=1000):
        reason = _publisher_gone(run.data.tags, now)
        if reason is not None:
            _fail_run(client, run.info.run_id, reason)
            marked.append(run.info.run_id)
    return marked


# --- pulling ----------------------------------------------------------------------------------


def parse_ref(ref: str) -> tuple[str, str | None, str | None]:
    """``NAME@ALIAS`` or ``NAME/VERSION`` (a ``models:/`` prefix is accepted) -> (name, alias, version)."""
    text = ref.removeprefix("models:/")
    if "@" in text:
        name, alias = text.rsplit("@", 1)
        if name and alias:
            return name, alias, None
    elif "/" in text:
        name, version = text.rsplit("/", 1)
        if name and version.isdigit():
            return name, None, version
    raise RegistryError(f"{ref!r} names no version: give NAME@ALIAS (e.g. mymodel@candidate) or NAME/VERSION (e.g. mymodel/3)")


def _resolve(client: Any, ref: str) -> Any:
    from mlflow.exceptions import MlflowException

    name, alias, number = parse_ref(ref)
    try:
        return client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, number)
    except MlflowException as exc:
        if _error_code(exc) != "RESOURCE_DOES_NOT_EXIST" and "not found" not in exc.message.lower():
            raise
    try:
        model = client.get_registered_model(name)
    except MlflowException:
        raise RegistryError(f"no registered model named {name!r}; `compress registry list` shows what there is") from None
    known = ", ".join(f"@{a}" for a in sorted(model.aliases)) or "none"
    versions = ", ".join(str(v.version) for v in _versions(client, name)) or "none"
    raise RegistryError(f"{ref}: no such {'alias' if alias else 'version'} of {name} (aliases: {known}; versions: {versions})")


@dataclass
class Pulled:
    name: str
    version: str
    directory: Path
    files: int
    content_sha256: str
    gates: str
    forced: bool


def verify_pulled(directory: Path, tags: dict[str, str]) -> Contents:
    """Every pulled file against the manifest, and the manifest, card and content against the version's tags."""
    problems = []
    for rel, key in ((MANIFEST, Tag.MANIFEST), (MODEL_CARD, Tag.CARD)):
        path = directory / rel
        if not path.is_file():
            problems.append(f"{rel} is missing")
        elif sha256_file(path) != tags.get(key):
            problems.append(f"{rel} differs from the one published")
    if problems:
        raise RegistryError("; ".join(problems))
    try:
        contents = check_artifact(directory, advice="")
    except ArtifactError as exc:
        raise RegistryError(str(exc)) from None
    if contents.content_sha256 != tags.get(Tag.CONTENT):
        raise RegistryError("the files' combined digest differs from the version's content hash")
    return contents


def pull(
    ref: str, out_dir: str | Path, location: Location | None = None, overwrite: bool = False, reporter: Reporter | None = None
) -> Pulled:
    """Download a version into ``out_dir`` (atomically) and verify every file; nothing is left
    behind when a check fails."""
    reporter = reporter or Reporter(quiet=True)
    check_target(Path(out_dir), overwrite, ARTIFACT)  # before any download (atomic_directory checks again)
    location = location or resolve_location()
    client = connect(location, create=False)
    from mlflow.artifacts import download_artifacts

    with _errors(location):
        version = _resolve(client, ref)
        where = f"{version.name}/{version.version}"
        if version.status != "READY":
            raise RegistryError(f"{where} is {version.status}, not READY; it cannot be pulled")
        if Tag.CONTENT not in version.tags:
            raise RegistryError(f"{where} was not published by compress (no {Tag.CONTENT} tag), so its files cannot be verified")
        with atomic_directory(Path(out_dir), overwrite, ARTIFACT) as tmp:
            with reporter.status(f"downloading {where} ({int(version.tags.get(Tag.SIZE, 0)) / 2**20:,.1f} MiB)"):
                incoming = Path(
                    download_artifacts(artifact_uri=version.source, dst_path=str(tmp / ".incoming"), tracking_uri=location.tracking_uri)
                )
            for child in incoming.iterdir():
                child.rename(tmp / child.name)
            shutil.rmtree(tmp / ".incoming")
            if (tmp / MANIFEST).is_file():  # missing: verify_pulled says so
                write_marker(tmp, ARTIFACT)  # verify_pulled checks the manifest against the version's tag
            with reporter.status(f"verifying {where} against its manifest"):
                try:
                    contents = verify_pulled(tmp, version.tags)
                except RegistryError as exc:
                    raise RegistryError(f"{where} failed verification, nothing was written: {exc}") from None
    return Pulled(
        version.name,
        str(version.version),
        Path(out_dir),
        len(contents.files) + 1,
        contents.content_sha256,
        version.tags.get(Tag.GATES, "?"),
        version.tags.get(Tag.FORCED) == "true",
    )


# --- listing ----------------------------------------------------------------------------------


def list_registry(location: Location | None = None, name: str | None = None) -> dict[str, Any]:
    """Registered models with their versions, aliases and gate status, and the publishes that did
    not end in a version (failed, or still running). Marks abandoned publishes FAILED first."""
    location = location or resolve_location()
    if not location.exists:
        return {"location": location.describe(), "models": [], "unfinished_publishes": []}
    client = connect(location)
    with _errors(location):
        mark_abandoned(client)
        models = [client.get_registered_model(name)] if name else list(client.search_registered_models(max_results=1000))
        listed = []
        for model in sorted(models, key=lambda m: m.name):
            by_version: dict[str, list[str]] = {}
            for alias, number in (model.aliases or {}).items():
                by_version.setdefault(str(number), []).append(alias)
            versions = [
                {
                    "version": str(v.version),
                    "status": v.status,
                    "ready": _ready(v),
                    "aliases": sorted(by_version.get(str(v.version), [])),
                    "gates": v.tags.get(Tag.GATES, "unknown"),
                    "gates_passed": v.tags.get(Tag.GATES_PASSED),
                    "forced": v.tags.get(Tag.FORCED) == "true",
                    "content_sha256": v.tags.get(Tag.CONTENT),
                    "size_bytes": int(v.tags[Tag.SIZE]) if Tag.SIZE in v.tags else None,
                    "created": _iso(v.creation_timestamp),
                    "run_id": v.run_id,
                }
                for v in _versions(client, model.name)
            ]
            listed.append({"name": model.name, "aliases": {a: str(n) for a, n in (model.aliases or {}).items()}, "versions": versions})
        publishes = []
        found = client.get_experiment_by_name(EXPERIMENT)
        if found is not None:
            for run in client.search_runs([found.experiment_id], filter_string="attributes.status != 'FINISHED'", max_results=1000):
                target = run.data.tags.get(Tag.NAME)
                if name and target != name:
                    continue
                publishes.append(
                    {
                        "run_id": run.info.run_id,
                        "name": target,
                        "status": run.info.status,
                        "started": _iso(run.info.start_time),
                        "reason": run.data.tags.get(Tag.FAILURE, ""),
                    }
                )
    return {"location": location.describe(), "models": listed, "unfinished_publishes": publishes}


def _iso(millis: int | None) -> str | None:
    if not millis:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(millis / 1000))
