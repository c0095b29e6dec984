"""Bounds on the work an input may ask for (issue 54, item 4) and the last inputs that ended in an
unexpected failure (item 5): each is refused quickly, with exit 2 and a message naming the key or
file, before any heavy work; an interrupt at any moment ends with exit 130 and no traceback."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compress import entry
from compress.errors import ArtifactError, DataError, ModelLoadError, RecipeError
from compress.fsutil import MAX_DOCUMENT
from compress.inputs import MAX_JSON, check_json
from compress.paths import usable_cpus
from compress.recipe import load_recipe
from compress.schema.patterns import (
    ATTEMPTS,
    MATCH_SECONDS,
    PROBE_NAMES,
    PROBE_SECONDS,
    PatternTimeout,
    check_pattern,
    matches,
    regex_match,
)
from compress.schema.recipe import MAX_CANDIDATES
from compress.verify import check_artifact
from tests.helpers import recipe_text, run_cli, write_recipe

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def _with(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


# --------------------------------------------------------------------------- targets / ignore patterns


@pytest.mark.parametrize("pattern", ["re:(.|.)*[XY]", "re:(a|a)*[bc]", r"re:(\w|\w)*[!?]"])
def test_a_backtracking_pattern_is_refused_at_validation(tmp_path: Path, tiny_model_dir: Path, text_dir: Path, pattern: str) -> None:
    text = _with(recipe_text(tiny_model_dir, text_dir), "      symmetric: true\n", f"      symmetric: true\n      targets: ['{pattern}']\n")
    path = write_recipe(tmp_path, text)
    for command in (["validate", path], ["plan", path], ["run", path, "-o", tmp_path / "out"]):
        started = time.monotonic()
        result = run_cli(command)
        assert result.exit_code == 2, (command, result.output)
        assert "stages[0].quantize.targets" in result.output and "backtracks" in result.output, result.output
        assert time.monotonic() - started < 30, command
    assert not (tmp_path / "out").exists()


def test_a_pattern_that_is_no_regular_expression_is_refused_with_its_key(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    text = _with(recipe_text(tiny_model_dir, text_dir), "      symmetric: true\n", "      symmetric: true\n      ignore: ['re:(lm_head']\n")
    with pytest.raises(RecipeError, match=r"stages\[0\]\.quantize\.ignore: 're:\(lm_head' is not a regular expression"):
        load_recipe(write_recipe(tmp_path, text))


def test_ordinary_patterns_still_select_layers() -> None:
    for pattern in (r"re:model\.layers\.\d+\.mlp\..*", "re:.*(q|k|v)_proj", "down_proj", "mlp.*", "lm_head"):
        assert check_pattern(pattern) is None, pattern
    assert matches("model.layers.10.mlp.up_proj", r"re:model\.layers\.\d+\.mlp\..*")
    assert not matches("model.layers.10.self_attn.o_proj", "re:.*(q|k|v)_proj")


def test_a_match_that_runs_over_its_bound_stops_with_the_pattern_named() -> None:
    name = "x" * 40 + "!"  # no probe name looks like this, so the pattern passed validation
    started = time.monotonic()
    with pytest.raises(PatternTimeout, match=r"'re:\(x\|x\)\*\[yz\]' took over"):
        regex_match("(x|x)*[yz]", name, what="targets pattern")
    assert time.monotonic() - started < ATTEMPTS * MATCH_SECONDS + 2


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet="ab.()|*+?\\dw[]^$_", max_size=14))
def test_checking_any_pattern_ends_in_bounded_time(expression: str) -> None:
    started = time.monotonic()
    problem = check_pattern("re:" + expression)
    assert problem is None or f"'re:{expression}'" in problem
    # compile plus one bounded match per probe name (regex checks its timeout every few hundred steps)
    assert time.monotonic() - started < 1 + len(PROBE_NAMES) * ATTEMPTS * PROBE_SECONDS * 2


# --------------------------------------------------------------------------- threads, search, latency


def test_more_threads_than_cpus_are_refused_with_the_key(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    text = recipe_text(tiny_model_dir, text_dir) + "compute: {threads: 100000}\n"
    result = run_cli(["validate", write_recipe(tmp_path, text)])
    assert result.exit_code == 2 and "compute.threads: 100,000 threads" in result.output, result.output
    assert f"may run on {usable_cpus()} CPU(s)" in result.output
    ok = recipe_text(tiny_model_dir, text_dir) + f"compute: {{threads: {usable_cpus()}}}\n"
    assert load_recipe(write_recipe(tmp_path, ok, "ok.yaml")).recipe.compute.threads == usable_cpus()


def _search(values: dict[str, int], limit: int | None = None) -> str:
    lines = ["search:", "  variants:"]
    for key, count in values.items():
        lines.append(f"    {key}: {list(range(1, count + 1))}")
    if limit is not None:
        lines.append(f"  max_candidates: {limit}")
    return "\n".join(lines) + "\n"


def test_a_search_of_too_many_candidates_is_refused_and_the_cap_can_be_raised(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    base = recipe_text(tiny_model_dir, text_dir, gates="  - {metric: perplexity, max: 100000}")
    huge = base + _search({"seed": 1400, "data.evaluation.samples": 100})
    started = time.monotonic()
    result = run_cli(["validate", write_recipe(tmp_path, huge)])
    assert result.exit_code == 2, result.output
    assert "140,000 candidates (1400 x 100), more than max_candidates (64)" in result.output and "search.max_candidates" in result.output
    assert time.monotonic() - started < 30
    over = base + _search({"seed": MAX_CANDIDATES + 1})
    with pytest.raises(RecipeError, match="more than max_candidates"):
        load_recipe(write_recipe(tmp_path, over, "over.yaml"))
    raised = base + _search({"seed": MAX_CANDIDATES + 1}, limit=MAX_CANDIDATES + 1)
    assert load_recipe(write_recipe(tmp_path, raised, "raised.yaml")).recipe.search.max_candidates == MAX_CANDIDATES + 1


@pytest.mark.parametrize(
    ("latency", "message"),
    [
        ("prompt_tokens: 2147483647", "latency.prompt_tokens"),
        ("output_tokens: 2147483647", "latency.output_tokens"),
        ("batch_sizes: [1, 2147483647]", "batch size 2,147,483,647 is more than 1,024"),
        ("repeats: 2147483647", "latency.repeats"),
        ("warmup: 2147483647", "latency.warmup"),
    ],
)
def test_latency_settings_beyond_any_use_are_refused(
    tmp_path: Path, tiny_model_dir: Path, text_dir: Path, latency: str, message: str
) -> None:
    text = recipe_text(tiny_model_dir, text_dir) + f"latency: {{{latency}}}\n"
    with pytest.raises(RecipeError, match=message):
        load_recipe(write_recipe(tmp_path, text))


def test_a_latency_run_longer_than_the_models_context_fails_before_the_stages(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    context = json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]
    text = recipe_text(tiny_model_dir, text_dir) + f"latency: {{prompt_tokens: {context}, artifacts: [compressed]}}\n"
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", tmp_path / "out"])
    assert result.exit_code == 2, result.output
    assert f"more than the model's context length ({context:,}, max_position_embeddings)" in result.output
    assert "quantizing" not in result.output and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- model dimensions, file sizes


def test_a_config_asking_for_a_billion_blocks_is_refused_at_once(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1_000_000_000}))
    path = write_recipe(tmp_path, recipe_text(model, text_dir))
    for command in (["plan", path], ["run", path, "-o", tmp_path / "out"]):
        started = time.monotonic()
        result = run_cli(command)
        assert result.exit_code == 2, (command, result.output)
        assert "num_hidden_layers is 1,000,000,000" in result.output and "hold 2 blocks" in result.output, result.output
        assert time.monotonic() - started < 60, command


def test_an_oversized_config_is_refused_before_it_is_read(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    with open(model / "config.json", "r+b") as f:  # sparse: the size without the bytes
        f.truncate(MAX_JSON + 1)
    with pytest.raises(ModelLoadError, match=rf"config.json: {MAX_JSON + 1:,} bytes, more than a model's config.json ever needs"):
        check_json(model / "config.json")
    result = run_cli(["run", write_recipe(tmp_path, recipe_text(model, text_dir)), "-o", tmp_path / "out"])
    assert result.exit_code == 2 and "ever needs" in result.output, result.output


def test_an_oversized_manifest_is_refused_before_it_is_read(tmp_path: Path) -> None:
    root = tmp_path / "artifact"
    root.mkdir()
    (root / "report.json").write_text("{}")
    with open(root / "manifest.json", "wb") as f:
        f.truncate(MAX_DOCUMENT + 1)
    with pytest.raises(ArtifactError, match=rf"manifest.json is {MAX_DOCUMENT + 1:,} bytes, more than compress ever writes"):
        check_artifact(root)


# --------------------------------------------------------------------------- nested JSON


def test_a_deeply_nested_jsonl_line_is_refused_with_its_line(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    data = tmp_path / "deep.jsonl"
    data.write_text('{"text": "fine"}\n{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    text = recipe_text(tiny_model_dir, text_dir).replace(f"source: {text_dir}", f"source: {data}", 1)
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", tmp_path / "out"])
    assert result.exit_code == 2, result.output
    assert f"{data}:2: JSON nested too deeply" in result.output.replace("\n", "")


def test_a_deeply_nested_task_line_is_refused_with_its_line(tmp_path: Path) -> None:
    from compress.eval.tasks import _read_rows

    data = tmp_path / "questions.jsonl"
    data.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(DataError, match=r"questions.jsonl:1: JSON nested too deeply"):
        list(_read_rows(data))


# --------------------------------------------------------------------------- interrupts


def test_an_interrupt_ends_with_130_whatever_the_command_had_decided() -> None:
    previous = signal.getsignal(signal.SIGINT)
    try:

        def interrupted() -> None:
            raise KeyboardInterrupt

        assert entry.run(interrupted) == entry.INTERRUPTED

        def finished() -> None:
            raise SystemExit(0)

        entry._State.interrupted = False
        assert entry.run(finished) == 0
        assert signal.getsignal(signal.SIGINT) is entry._exit_now  # from here a Ctrl-C exits 130 at once

        def aborted_by_click() -> None:  # click saw the interrupt, printed "Aborted!" and exits 1
            entry._State.interrupted = True
            raise SystemExit(1)

        assert entry.run(aborted_by_click) == entry.INTERRUPTED
    finally:
        entry._State.interrupted = False
        signal.signal(signal.SIGINT, previous)


def _interrupt_after(command: list[str], line: str, cwd: Path) -> tuple[int | None, str]:
    """Start ``python -m compress …``, send SIGINT the moment ``line`` appears on its stderr or stdout;
    returns (exit code, everything it wrote)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "compress", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=cwd,
        env={**os.environ, "COLUMNS": "200"},
    )
    seen = []
    assert process.stdout is not None
    for text in process.stdout:
        seen.append(text)
        if line in text:
            process.send_signal(signal.SIGINT)
            break
    seen.append(process.stdout.read())
    return process.wait(timeout=120), "".join(seen)


def test_an_interrupt_during_a_run_exits_130_without_a_traceback(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    path = write_recipe(tmp_path, recipe_text(tiny_model_dir, text_dir))
    code, output = _interrupt_after(["run", str(path), "-o", str(tmp_path / "out")], "opening model", tmp_path)
    assert code == 130, output
    assert "Traceback" not in output and "interrupted" in output, output
    assert not (tmp_path / "out").exists()


def test_an_interrupt_after_the_last_line_exits_130_or_not_at_all(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    path = write_recipe(tmp_path, recipe_text(tiny_model_dir, text_dir))
    codes = []
    for _ in range(3):
        code, output = _interrupt_after(["validate", str(path)], "valid", tmp_path)
        assert "Traceback" not in output, output
        codes.append(code)
    assert set(codes) <= {0, 130}, codes  # 0: it had ended before the signal came


@pytest.mark.parametrize(
    "command",
    [
        ["bench", "quant", "--threads", "100000"],
        ["bench", "gguf", "--threads", "100000"],
        ["gate", "anything", "--gates", "gates.yaml", "--threads", "100000"],
        ["bench", "latency", "anything", "--prompt-tokens", "2147483647"],
        ["bench", "latency", "anything", "--repeats", "2147483647"],
    ],
)
def test_command_line_counts_beyond_the_machine_are_refused(command: list[str]) -> None:
    result = run_cli(command)
    assert result.exit_code == 2, result.output
    assert "Invalid value for" in result.output and "less than or equal to" in result.output, result.output
