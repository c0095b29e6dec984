"""Publishing to an MLflow registry: a real `mlflow server` on loopback (SQLite backend, temporary
artifact root) started by these tests, and the embedded registry (no server).

Artifacts are real runs of the tiny model (RTN, with gates that pass or fail)."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import recipe_text, run_cli, write_recipe

pytest.importorskip("mlflow", reason="the registry tests need MLflow: pip install -e '.[registry]' (in dev)")
pytestmark = pytest.mark.runtime  # MLflow: a server or the embedded store

ROOT = Path(__file__).resolve().parents[1]
# RTN on the tiny model: KL 1e-6 (W8), 1.9e-5 (W6), 0.00039 (W4), 0.0017 (W3); top-1 agreement 100%.
PASSING = """\
  - metric: kl_divergence
    max: 0.01
"""
FAILING = """\
  - metric: kl_divergence
    max: 0.0
  - metric: top1_agreement
    min: 0.9
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(root: Path, *extra: str, env: dict[str, str] | None = None):
    """`mlflow server` on loopback: SQLite backend, artifacts proxied into a temporary folder.
    Returns (process, uri, log file)."""
    port = _free_port()
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination",
            str(root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "2",
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=root,
        env={**os.environ, **(env or {})},
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, uri, log
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            _stop_server(proc, log)
            pytest.fail(f"mlflow server did not start:\n{(root / 'server.log').read_text()[-3000:]}")
        time.sleep(0.5)


def _stop_server(proc: subprocess.Popen, log) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("mlflow-server")
    proc, uri, log = _start_server(root)
    yield {"uri": uri, "artifacts": root / "artifacts"}
    _stop_server(proc, log)


def _make(root: Path, model: Path, texts: Path, name: str, bits: int, gates: str, extra: str = "") -> Path:
    recipe = write_recipe(
        root, recipe_text(model, texts, bits=bits, gates=gates).replace("name: tiny-test", f"name: {name}") + extra, f"{name}.yaml"
    )
    result = run_cli(["run", recipe, "-o", root / name, "-q"])
    assert result.exit_code == (0 if gates is PASSING else 1), result.output
    return root / name


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, text_dir: Path) -> dict[str, Path]:
    """Four passing artifacts (RTN at 8, 6, 4 and 3 bits: different content) and one whose gate failed."""
    root = tmp_path_factory.mktemp("artifacts")
    made = {f"w{b}": _make(root, tiny_model_dir, text_dir, f"tiny-w{b}", b, PASSING) for b in (8, 6, 4, 3)}
    made["failing"] = _make(root, tiny_model_dir, text_dir, "tiny-failing", 4, FAILING)
    return made


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _same_tree(a: Path, b: Path) -> None:
    """Every file of ``a`` is in ``b`` byte for byte, and ``b`` has nothing else but the model card."""
    files_a = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    files_b = sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    assert files_b == sorted(files_a + ["MODEL_CARD.md"])
    _, mismatch, errors = filecmp.cmpfiles(a, b, files_a, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)


def test_publish_then_pull_gives_the_artifact_byte_for_byte_with_tags_and_a_card(server, artifacts, tmp_path: Path) -> None:
    art = artifacts["w4"]
    result = run_cli(["publish", art, "--name", "roundtrip", "--alias", "candidate", "--uri", server["uri"], "-q"])
    assert result.exit_code == 0, result.output
    assert "published roundtrip/1" in result.output and "@candidate" in result.output

    version = _client(server["uri"]).get_model_version_by_alias("roundtrip", "candidate")
    manifest = json.loads((art / "manifest.json").read_text())
    tags = version.tags
    assert version.status == "READY" and str(version.version) == "1"
    assert tags["compress.base_model_sha256"] == manifest["model"]["sha256"]
    assert tags["compress.recipe_sha256"] == manifest["recipe"]["sha256"]
    assert tags["compress.gates"] == "passed" and tags["compress.gates_passed"] == "1/1" and tags["compress.forced"] == "false"
    assert len(tags["compress.content_sha256"]) == 64

    for ref in ("roundtrip@candidate", "roundtrip/1", "models:/roundtrip/1"):
        target = tmp_path / ref.replace("/", "_").replace(":", "_").replace("@", "_")
        pulled = run_cli(["pull", ref, "-o", target, "--uri", server["uri"], "-q"])
        assert pulled.exit_code == 0, pulled.output
        _same_tree(art, target)
    card = (target / "MODEL_CARD.md").read_text()
    assert manifest["model"]["sha256"] in card and "| kl_divergence |" in card and "measured: torch on cpu" in card
    assert '"bits": 4' in card  # the expanded scheme

    # the registry list shows it, with its alias and gate status
    listing = run_cli(["registry", "list", "roundtrip", "--uri", server["uri"], "--json"])
    assert listing.exit_code == 0, listing.output
    model = json.loads(listing.output)["models"][0]
    assert model["aliases"] == {"candidate": "1"}
    assert model["versions"][0]["gates"] == "passed" and model["versions"][0]["ready"]


def test_republishing_identical_content_returns_the_existing_version(server, artifacts) -> None:
    first = run_cli(["publish", artifacts["w8"], "--name", "idem", "--uri", server["uri"], "-q"])
    again = run_cli(["publish", artifacts["w8"], "--name", "idem", "--alias", "prod", "--uri", server["uri"], "-q"])
    other = run_cli(["publish", artifacts["w6"], "--name", "idem", "--uri", server["uri"], "-q"])
    assert first.exit_code == again.exit_code == other.exit_code == 0, (first.output, again.output, other.output)
    assert "published idem/1" in first.output
    assert "already published as idem/1" in again.output
    assert "published idem/2" in other.output
    client = _client(server["uri"])
    assert sorted(str(v.version) for v in client.search_model_versions("name='idem'")) == ["1", "2"]
    assert client.get_registered_model("idem").aliases == {"prod": "1"}  # an alias asked for on a republish is set


def test_a_failed_gate_blocks_publishing_unless_forced_and_forced_is_recorded(server, artifacts, tmp_path: Path) -> None:
    refused = run_cli(["publish", artifacts["failing"], "--name", "gated", "--uri", server["uri"], "-q"])
    assert refused.exit_code == 1, refused.output
    assert "not published" in refused.output and "1 of 2 gates failed" in refused.output and "--force" in refused.output
    assert not _client(server["uri"]).search_model_versions("name='gated'")

    forced = run_cli(["publish", artifacts["failing"], "--name", "gated", "--force", "--uri", server["uri"], "-q"])
    assert forced.exit_code == 0, forced.output
    assert "forced" in forced.output
    version = _client(server["uri"]).get_model_version("gated", "1")
    assert version.tags["compress.forced"] == "true" and version.tags["compress.gates"] == "failed"
    assert version.tags["compress.gates_passed"] == "1/2"
    pulled = run_cli(["pull", "gated/1", "-o", tmp_path / "gated", "--uri", server["uri"], "-q"])
    assert pulled.exit_code == 0 and "published with --force" in pulled.output
    assert "Published with `--force` although a gate failed" in (tmp_path / "gated" / "MODEL_CARD.md").read_text()


START_TOGETHER = textwrap.dedent("""
    import sys, time
    from compress.cli import main

    start_at = float(sys.argv.pop(1))
    while time.time() < start_at:  # every process is loaded before any publishes: the four really overlap
        time.sleep(0.005)
    main()
""")


@pytest.mark.parametrize("registry", ["server", "embedded"])
def test_four_processes_publishing_at_once_all_land_as_distinct_complete_versions(
    registry: str, request: pytest.FixtureRequest, artifacts, tmp_path: Path
) -> None:
    """On a server, and on one embedded registry (there publishes take turns on a file lock: SQLite
    and MLflow's first-use schema migration do not take concurrent writers)."""
    if registry == "server":
        uri = request.getfixturevalue("server")["uri"]
        where = ["--uri", uri]
    else:
        uri = f"sqlite:///{tmp_path / 'registry' / 'mlflow.db'}"
        where = ["--store", str(tmp_path / "registry")]
    names = ["w8", "w6", "w4", "w3"]
    start_at = str(time.time() + 10)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", START_TOGETHER, start_at, "publish", str(artifacts[n]), "--name", "concurrent", *where, "-q"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in names
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    versions = _client(uri).search_model_versions("name='concurrent'")
    assert sorted(int(v.version) for v in versions) == [1, 2, 3, 4]
    by_content = {v.tags["compress.content_sha256"]: str(v.version) for v in versions}
    assert len(by_content) == 4
    from compress.verify import check_artifact

    for n in names:
        target = tmp_path / n
        version = next(v for v in versions if v.tags["compress.content_sha256"] == check_artifact(artifacts[n]).content_sha256)
        pulled = run_cli(["pull", f"concurrent/{version.version}", "-o", target, *where, "-q"])
        assert pulled.exit_code == 0, pulled.output
        _same_tree(artifacts[n], target)


KILL_MIDWAY = textwrap.dedent("""
    import os, signal, sys
    from mlflow import MlflowClient
    from compress.mlflow_registry import publish, resolve_location

    real = MlflowClient.log_artifact
    calls = []

    def log_then_die(self, run_id, local_path, artifact_path=None):
        calls.append(local_path)
        if len(calls) == 3:  # two files are up, the third is not: the process dies like a kill -9
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, run_id, local_path, artifact_path)

    MlflowClient.log_artifact = log_then_die
    publish(sys.argv[1], name="killed", location=resolve_location(sys.argv[2]))
""")


def test_a_publish_killed_midway_leaves_no_version_and_is_shown_failed(server, artifacts, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", KILL_MIDWAY, str(artifacts["w3"]), server["uri"]], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    client = _client(server["uri"])
    assert not client.search_model_versions("name='killed'")
    refused = run_cli(["pull", "killed/1", "-o", tmp_path / "nothing", "--uri", server["uri"], "-q"])
    assert refused.exit_code == 2 and not (tmp_path / "nothing").exists()

    listing = run_cli(["registry", "list", "--uri", server["uri"], "--json"])
    assert listing.exit_code == 0, listing.output
    unfinished = [r for r in json.loads(listing.output)["unfinished_publishes"] if r["name"] == "killed"]
    assert len(unfinished) == 1 and unfinished[0]["status"] == "FAILED"
    assert "ended before creating a version" in unfinished[0]["reason"]

    again = run_cli(["publish", artifacts["w3"], "--name", "killed", "--uri", server["uri"], "-q"])
    assert again.exit_code == 0 and "published killed/1" in again.output, again.output
    assert run_cli(["pull", "killed/1", "-o", tmp_path / "now", "--uri", server["uri"], "-q"]).exit_code == 0


def test_pull_refuses_a_version_whose_stored_files_were_altered(server, artifacts, tmp_path: Path) -> None:
    assert run_cli(["publish", artifacts["w6"], "--name", "tampered", "--uri", server["uri"], "-q"]).exit_code == 0
    version = _client(server["uri"]).get_model_version("tampered", "1")
    stored = server["artifacts"] / version.source.removeprefix("mlflow-artifacts:/")
    (stored / "recipe.yaml").write_text((stored / "recipe.yaml").read_text() + "# edited in the store\n")
    result = run_cli(["pull", "tampered/1", "-o", tmp_path / "pulled", "--uri", server["uri"]])
    assert result.exit_code == 2
    assert "failed verification" in result.output and "recipe.yaml" in result.output
    assert not (tmp_path / "pulled").exists() and not list(tmp_path.glob(".pulled.partial-*"))


def test_publishing_an_artifact_changed_after_its_run_is_refused(artifacts, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(artifacts["w4"], copy)
    (copy / "notes.txt").write_text("added later\n")
    (copy / "recipe.yaml").write_text("changed\n")
    result = run_cli(["publish", copy, "--store", tmp_path / "registry", "-q"])
    assert result.exit_code == 2
    assert "changed since the run: recipe.yaml" in result.output and "not in the manifest: notes.txt" in result.output


def test_recipe_publish_block_uses_the_embedded_registry_and_skips_failed_runs(
    tiny_model_dir: Path, text_dir: Path, tmp_path: Path
) -> None:
    block = "publish:\n  name: from-recipe\n  aliases: [candidate]\n  store: registry\n"
    passing = _make(tmp_path, tiny_model_dir, text_dir, "pub-pass", 4, PASSING, block)
    assert (tmp_path / "registry" / "mlflow.db").is_file()
    pulled = run_cli(["pull", "from-recipe@candidate", "-o", tmp_path / "pulled", "--store", tmp_path / "registry", "-q"])
    assert pulled.exit_code == 0, pulled.output
    _same_tree(passing, tmp_path / "pulled")

    recipe = write_recipe(
        tmp_path, recipe_text(tiny_model_dir, text_dir, gates=FAILING) + block.replace("from-recipe", "from-failed"), "failing.yaml"
    )
    result = run_cli(["run", recipe, "-o", tmp_path / "failed", "-q"])
    assert result.exit_code == 1
    assert "not published" in result.output
    listing = json.loads(run_cli(["registry", "list", "--store", tmp_path / "registry", "--json"]).output)
    assert [m["name"] for m in listing["models"]] == ["from-recipe"]


def test_a_search_publishes_its_chosen_candidate(tiny_model_dir: Path, text_dir: Path, tmp_path: Path) -> None:
    from compress.verify import check_artifact

    block = "search:\n  variants:\n    stages.0.quantize.bits: [8, 4]\npublish:\n  name: searched\n  store: registry\n"
    recipe = write_recipe(tmp_path, recipe_text(tiny_model_dir, text_dir, gates=PASSING) + block, "search.yaml")
    result = run_cli(["run", recipe, "-o", tmp_path / "search", "-q"])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "search" / "report.json").read_text())
    chosen = tmp_path / "search" / report["search"]["chosen_path"]
    listing = json.loads(run_cli(["registry", "list", "--store", tmp_path / "registry", "--json"]).output)
    [version] = listing["models"][0]["versions"]
    assert version["content_sha256"] == check_artifact(chosen).content_sha256
    assert json.loads((chosen / "manifest.json").read_text())["recipe"]["expanded"]["stages"][0]["quantize"]["bits"] == 4
    whole = run_cli(["publish", tmp_path / "search", "--store", tmp_path / "registry"])
    assert whole.exit_code == 2 and "publish its chosen candidate" in whole.output


def test_recipe_publish_block_is_validated_and_not_part_of_the_recipe_hash(tiny_model_dir: Path, text_dir: Path, tmp_path: Path) -> None:
    from compress.errors import RecipeError
    from compress.recipe import load_recipe

    base = recipe_text(tiny_model_dir, text_dir)
    plain = load_recipe(write_recipe(tmp_path, base, "plain.yaml"))
    with_publish = load_recipe(write_recipe(tmp_path, base + "publish:\n  aliases: [candidate]\n", "pub.yaml"))
    assert plain.recipe.sha256() == with_publish.recipe.sha256()
    with pytest.raises(RecipeError, match="latest"):
        load_recipe(write_recipe(tmp_path, base + "publish:\n  aliases: [latest]\n", "bad.yaml"))
    with pytest.raises(RecipeError, match="not both"):
        load_recipe(write_recipe(tmp_path, base + "publish:\n  uri: http://x\n  store: reg\n", "both.yaml"))


def test_bad_references_and_unknown_versions_say_what_exists(artifacts, tmp_path: Path) -> None:
    store = tmp_path / "registry"
    assert run_cli(["publish", artifacts["w8"], "--name", "known", "--alias", "candidate", "--store", store, "-q"]).exit_code == 0
    for ref, expected in (
        ("known", "NAME@ALIAS"),
        ("known/x", "NAME/VERSION"),
        ("known@prod", "aliases: @candidate; versions: 1"),
        ("known/7", "versions: 1"),
        ("unknown@candidate", "no registered model named 'unknown'"),
    ):
        result = run_cli(["pull", ref, "-o", tmp_path / "out", "--store", store])
        assert result.exit_code == 2 and expected in result.output, (ref, result.output)
    nowhere = run_cli(["pull", "known@candidate", "-o", tmp_path / "out", "--store", tmp_path / "no-registry"])
    assert nowhere.exit_code == 2 and "no registry at" in nowhere.output and not (tmp_path / "no-registry").exists()
    bad_alias = run_cli(["publish", artifacts["w8"], "--alias", "v2", "--store", store])
    assert bad_alias.exit_code == 2 and "reserves" in bad_alias.output


def test_location_order_uri_then_store_then_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from compress.errors import CompressError
    from compress.mlflow_registry import resolve_location

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env:5000")
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    assert resolve_location("http://given:1").tracking_uri == "http://given:1"
    assert resolve_location(store=tmp_path).store == tmp_path.resolve()
    assert resolve_location().tracking_uri == "http://env:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.setenv("COMPRESS_REGISTRY", str(tmp_path / "reg"))
    loc = resolve_location()
    assert loc.store == (tmp_path / "reg").resolve() and loc.tracking_uri == f"sqlite:///{tmp_path.resolve() / 'reg' / 'mlflow.db'}"
    with pytest.raises(CompressError, match="not both"):
        resolve_location("http://x", tmp_path)


def test_credentials_come_from_the_environment(artifacts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server with MLflow's basic-auth app: without credentials the publish fails with exit 2 and
    MLflow's refusal; with MLFLOW_TRACKING_USERNAME / _PASSWORD in the environment it lands."""
    pytest.importorskip("flask_wtf", reason="MLflow's basic-auth server needs Flask-WTF (in dev)")
    proc, uri, log = _start_server(
        tmp_path,
        "--app-name",
        "basic-auth",
        env={"MLFLOW_AUTH_ADMIN_PASSWORD": "s3cret-for-tests", "MLFLOW_FLASK_SERVER_SECRET_KEY": "tests-only"},
    )
    try:
        monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
        monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
        refused = run_cli(["publish", artifacts["w8"], "--name", "authed", "--uri", uri, "-q"])
        assert refused.exit_code == 2 and uri in refused.output and "401" in refused.output, refused.output
        assert "MLFLOW_TRACKING_USERNAME" in refused.output
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret-for-tests")
        published = run_cli(["publish", artifacts["w8"], "--name", "authed", "--uri", uri, "-q"])
        assert published.exit_code == 0 and "published authed/1" in published.output, published.output
        assert "s3cret" not in published.output
        assert run_cli(["pull", "authed/1", "-o", tmp_path / "pulled", "--uri", uri, "-q"]).exit_code == 0
        _same_tree(artifacts["w8"], tmp_path / "pulled")
    finally:
        _stop_server(proc, log)


@pytest.mark.real_model
@pytest.mark.xdist_group("quickstart")
@pytest.mark.minutes(1.3)
def test_quickstart_artifact_publishes_to_the_embedded_registry_and_pulls_back(tmp_path: Path, quickstart_artifact: Path) -> None:
    """The README's two commands on the real quickstart artifact (SmolLM2, shorter evaluation)."""
    env = {**os.environ, "COMPRESS_REGISTRY": str(tmp_path / "registry")}
    published = subprocess.run(
        [sys.executable, "-m", "compress", "publish", str(quickstart_artifact), "--alias", "candidate", "-q"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert published.returncode == 0, published.stderr[-3000:]
    assert "published quickstart-smollm2-rtn-w4g128-asym/1" in " ".join(published.stdout.split())
    pulled = subprocess.run(
        [sys.executable, "-m", "compress", "pull", "quickstart-smollm2-rtn-w4g128-asym@candidate", "-o", str(tmp_path / "pulled"), "-q"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert pulled.returncode == 0, pulled.stderr[-3000:]
    _same_tree(quickstart_artifact, tmp_path / "pulled")
    assert "Apache-2.0" in (tmp_path / "pulled" / "MODEL_CARD.md").read_text()


def test_model_card_says_where_each_gate_was_measured_and_what_each_export_is_for() -> None:
    from compress.model_card import model_card

    manifest = {
        "recipe": {"sha256": "r" * 64, "expanded": {"name": "demo"}},
        "seed": 3,
        "versions": {"compress": "0.1.0", "torch": "2.13"},
        "model": {"source": "reference:smollm2-135m", "sha256": "b" * 64, "license": "Apache-2.0", "parameters": 134515008},
        "stages": [
            {
                "label": "stages[0]",
                "kind": "quantize",
                "method": "gptq",
                "config": {"bits": 4, "group_size": 32},
                "summary": {"layers_quantized": 210, "bits_per_weight": 4.625},
            }
        ],
        "data": {
            "evaluation": {"source": "reference:shakespeare", "tokens_sha256": "e" * 64},
            "calibration": {"source": "my-texts/", "documents_sha256": "c" * 64},
        },
        "exports": [{"name": "q4", "format": "gguf", "path": "exports/q4", "type": "q4_1", "verified": True}],
    }
    report = {
        "gates": [
            {
                "name": "kl",
                "metric": "kl_divergence",
                "artifact": "q4",
                "value": 0.27,
                "threshold": {"kind": "max", "value": 0.35},
                "passed": True,
                "source": "measured",
                "runtime": "llama.cpp",
                "device": "cpu",
            },
            {
                "name": "pi5",
                "metric": "decode_tokens_per_s",
                "artifact": "q4",
                "value": 101.7,
                "threshold": {"kind": "min", "value": 200},
                "passed": False,
                "source": "estimated",
                "runtime": "llama.cpp",
                "device": "raspberry-pi-5-8gb",
            },
        ],
        "evaluations": [
            {
                "artifact": "q4",
                "kind": "latency",
                "runtime": "llama.cpp",
                "device": "cpu",
                "source": "measured",
                "metrics": {"decode_tokens_per_s": 80.7, "ttft_ms": 537.0},
            }
        ],
    }
    sizes = {"model/model.safetensors": 3 * 2**20, "exports/q4/model.gguf": 2**20, "report.json": 100}
    card = model_card(manifest, report, "demo", sizes, forced=True)
    assert "| kl | q4 | kl_divergence | 0.27 | max 0.35 | PASS | measured: llama.cpp on cpu |" in card
    assert "| pi5 | q4 | decode_tokens_per_s | 101.7 | min 200 | FAIL | estimated for raspberry-pi-5-8gb (llama.cpp) |" in card
    assert "**Published with `--force` although a gate failed.**" in card and "1 of 2 gates passed." in card
    assert "| q4 | gguf Q4_1 | llama.cpp" in card and "| 1.0 | 1 | yes |" in card and "| 3.0 | 1 | –" in card
    assert "decode tok/s 80.7; TTFT ms 537" in card
    assert "Public domain (Project Gutenberg texts)" in card and "not recorded (your own text" in card
    assert '"group_size": 32' in card and "bits_per_weight 4.625" in card and "134,515,008" in card
    assert model_card(manifest, report, "demo", sizes, forced=True) == card  # deterministic


def test_an_embedded_registry_killed_while_mlflow_creates_it_is_created_again(artifacts, tmp_path: Path, monkeypatch) -> None:
    """MLflow creates and migrates a new SQLite database in many commits; a publish killed between two
    of them left a database MLflow refused on the next command ("out-of-date database schema", once
    in CI's kill test). The database is made under a temporary name and renamed into place: a
    publish that dies while MLflow migrates it leaves no registry database, and the next one works."""
    import mlflow.store.db.utils as mlflow_db

    from compress.mlflow_registry import DATABASE

    store = tmp_path / "registry"
    real_upgrade = mlflow_db._upgrade_db

    def dies_midway(engine):  # the tables of the first migrations exist, the later ones never ran
        raise KeyboardInterrupt("killed during MLflow's schema migration")

    monkeypatch.setattr(mlflow_db, "_upgrade_db", dies_midway)
    died = run_cli(["publish", artifacts["w4"], "--store", store, "--name", "mid", "-q"])
    assert died.exit_code != 0 and not (store / DATABASE).exists(), died.output
    monkeypatch.setattr(mlflow_db, "_upgrade_db", real_upgrade)
    again = run_cli(["publish", artifacts["w4"], "--store", store, "--name", "mid", "-q"])
    assert again.exit_code == 0, again.output
    assert not list(store.glob(f".{DATABASE}.creating-*"))  # the abandoned attempt is gone
    listing = run_cli(["registry", "list", "--store", store, "--json"])
    assert [m["name"] for m in json.loads(listing.output)["models"]] == ["mid"]
