"""Property-based fuzzing of everything a pipeline feeds us: recipes (valid ones mutated: wrong
types, out-of-range numbers, unknown keys, YAML junk, unicode, huge values, aliases) through
`compress validate` and `compress plan`, and damaged weight and config files through the input
checks. The property: never a traceback; every failure exits 2 with a message that names the
file or the key path.

About 1,100 cases run by default (CI); set COMPRESS_FUZZ_SCALE=10 for ten times as many."""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compress.errors import CompressError
from compress.inputs import check_json, check_safetensors
from tests.helpers import recipe_text, run_cli

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
SCALE = max(1, int(os.environ.get("COMPRESS_FUZZ_SCALE", "1")))
BASES = [yaml.safe_load(p.read_text()) for p in sorted((ROOT / "recipes").glob("*.yaml"))]
FUZZ = settings(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None)

junk_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(
        [
            "",
            "reference:nope",
            "../../etc/passwd",
            "\u202e\u0000",
            "🤖" * 20,
            "9" * 400,
            "gptq",
            "q4_k_m",
            "compressed",
            "kl_divergence",
            "*",
            "re:(",
            "~/x",
            "/dev/zero",
        ]
    ),
)
junk_values = st.recursive(
    junk_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8
)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


def _set(node: Any, path: tuple, value: Any, delete: bool = False) -> Any:
    if not path:
        return value
    parent = node
    for part in path[:-1]:
        parent = parent[part]
    if delete and isinstance(parent, dict):
        del parent[path[-1]]
    elif delete and isinstance(parent, list):
        parent.pop(path[-1])
    else:
        parent[path[-1]] = value
    return node


@st.composite
def mutated_recipe(draw: st.DrawFn) -> str:
    """YAML text of a shipped recipe with one to three mutations, or mangled text."""
    data = copy.deepcopy(draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(data)
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["replace", "replace", "delete", "unknown-key", "wrap"]))
        if action == "delete" and path:
            data = _set(data, path, None, delete=True)
        elif action == "unknown-key" and isinstance(data, dict):
            target = data
            for part in path:
                target = target[part]
            if isinstance(target, dict):
                target[draw(st.text(min_size=1, max_size=12))] = draw(junk_values)
        elif action == "wrap":
            value = data
            for part in path:
                value = value[part]
            data = _set(data, path, [value])
        else:
            data = _set(data, path, draw(junk_values))
    text = yaml.safe_dump(data, allow_unicode=True, sort_keys=False)
    mangle = draw(st.sampled_from(["none", "none", "none", "insert", "truncate", "alias"]))
    if mangle == "insert":
        at = draw(st.integers(0, len(text)))
        text = (
            text[:at]
            + draw(
                st.sampled_from(
                    [
                        "\x00",
                        ":",
                        "- ",
                        "{",
                        "]",
                        "&a",
                        "*a",
                        "\t",
                        "!!binary x",
                        "'",
                        '"',
                        "\n  x: 1\n",
                        "? ",
                        "|-\n",
                        "%YAML 1.1\n---\n",
                        "\x85",
                        "\ufeff",
                    ]
                )
            )
            + text[at:]
        )
    elif mangle == "truncate":
        text = text[: draw(st.integers(0, len(text)))]
    elif mangle == "alias":
        depth = draw(st.integers(2, 8))
        lines = ['z0: &z0 ["a", "b", "c", "d", "e", "f", "g", "h"]']
        lines += [f"z{i}: &z{i} [{', '.join([f'*z{i - 1}'] * 8)}]" for i in range(1, depth)]
        text += "\n".join(lines) + "\n"
    return text


def _check_cli(result, path: Path) -> None:
    assert result.exit_code in (0, 2), result.output
    assert "Traceback" not in result.output and "unexpected failure" not in result.output, result.output
    if result.exit_code == 2:
        assert path.name in result.output or "--set" in result.output, result.output


@given(text=mutated_recipe())
@settings(FUZZ, max_examples=800 * SCALE)
def test_validate_never_crashes(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "recipe.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    _check_cli(run_cli(["validate", path]), path)


@given(
    override=st.tuples(
        st.sampled_from(
            [
                "seed",
                "stages.0.quantize.bits",
                "stages.0.quantize.group_size",
                "data.holdout",
                "data.evaluation.samples",
                "gates.0.max",
                "stages.9.x",
                "model",
                "a..b",
                "stages.0",
                "exports.0.format",
                "compute.threads",
                "stages.0.quantize.scale_dtype",
            ]
        ),
        st.text(max_size=30),
    )
)
@settings(FUZZ, max_examples=150 * SCALE)
def test_set_overrides_never_crash(tmp_path_factory: pytest.TempPathFactory, override: tuple[str, str]) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "recipe.yaml"
    shutil.copy(ROOT / "recipes" / "quickstart.yaml", path)
    _check_cli(run_cli(["validate", path, "--set", f"{override[0]}={override[1]}"]), path)


@pytest.fixture(scope="module")
def plan_base(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, text_dir: Path) -> dict:
    gates = "  - metric: kl_divergence\n    max: 1\n"
    return yaml.safe_load(recipe_text(tiny_model_dir, text_dir, gates=gates))


@given(
    edits=st.lists(
        st.tuples(
            st.sampled_from(
                [
                    "stages.0.quantize.bits",
                    "stages.0.quantize.group_size",
                    "stages.0.quantize.method",
                    "stages.0.quantize.targets",
                    "stages.0.quantize.ignore",
                    "data.evaluation.seq_len",
                    "data.evaluation.samples",
                    "model.dtype",
                    "seed",
                ]
            ),
            junk_values,
        ),
        min_size=1,
        max_size=2,
    )
)
@settings(FUZZ, max_examples=40 * SCALE)
def test_plan_never_crashes(tmp_path_factory: pytest.TempPathFactory, plan_base: dict, edits: list) -> None:
    data = copy.deepcopy(plan_base)
    for key, value in edits:
        parts = [int(p) if p.isdigit() else p for p in key.split(".")]
        data = _set(data, tuple(parts), value)
    path = tmp_path_factory.mktemp("fuzz") / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    _check_cli(run_cli(["plan", path, "--device", "h100-sxm"]), path)


@pytest.fixture(scope="module")
def weights_bytes(tiny_model_dir: Path) -> bytes:
    return next(tiny_model_dir.glob("*.safetensors")).read_bytes()


@given(
    cut=st.integers(0, 10**9), flips=st.lists(st.tuples(st.integers(0, 10**9), st.integers(1, 255)), max_size=4), header_only=st.booleans()
)
@settings(FUZZ, max_examples=150 * SCALE)
def test_damaged_safetensors_are_named_or_load(
    tmp_path_factory: pytest.TempPathFactory, weights_bytes: bytes, cut: int, flips: list, header_only: bool
) -> None:
    """check_safetensors either names the file and the problem, or the library loads every tensor."""
    from safetensors.torch import load_file

    data = bytearray(weights_bytes)
    limit = 8 + int.from_bytes(data[:8], "little") if header_only else len(data)
    for where, xor in flips:
        data[where % limit] ^= xor
    data = data[: len(data) - cut % (len(data) + 1)] if cut % 3 == 0 else data
    path = tmp_path_factory.mktemp("fuzz") / "model.safetensors"
    path.write_bytes(bytes(data))
    try:
        check_safetensors(path)
    except CompressError as exc:
        assert str(path) in str(exc)
        return
    load_file(str(path))


@given(
    which=st.integers(0, 10**6),
    damage=st.sampled_from(["remove", "nan", "inf", "transpose", "relabel"]),
    where=st.integers(0, 10**9),
)
@settings(FUZZ, max_examples=25 * SCALE)
def test_a_damaged_tensor_is_named_at_load(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, weights_bytes: bytes, which: int, damage: str, where: int
) -> None:
    """One tensor of the tiny checkpoint, drawn at random, removed, given a NaN or an infinity at a random
    place, its header shape reversed, or its header dtype relabelled: loading it (and reading every
    tensor once, as a run does block by block) fails with a ModelLoadError naming the file and the tensor."""
    from safetensors.torch import load_file, save_file

    from compress import streaming
    from compress.errors import ModelLoadError
    from compress.models import load_model
    from compress.progress import Reporter
    from compress.schema.recipe import ModelConfig

    model = tmp_path_factory.mktemp("fuzz") / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    tensors = load_file(str(weights))
    names = sorted(name for name, t in tensors.items() if damage != "transpose" or (t.dim() == 2 and t.shape[0] != t.shape[1]))
    name = names[which % len(names)]
    if damage in ("transpose", "relabel"):
        length = int.from_bytes(weights_bytes[:8], "little")
        header = json.loads(weights_bytes[8 : 8 + length])
        header[name]["shape" if damage == "transpose" else "dtype"] = header[name]["shape"][::-1] if damage == "transpose" else "I32"
        weights.write_bytes(
            weights_bytes[:8] + json.dumps(header, separators=(",", ":")).encode().ljust(length) + weights_bytes[8 + length :]
        )
    else:
        if damage == "remove":
            del tensors[name]
        else:
            tensors[name].view(-1)[where % tensors[name].numel()] = float(damage)
        save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as refused:
        loaded = load_model(ModelConfig(source=str(model)), model.parent, Reporter(quiet=True))
        for _ in streaming.tensors(loaded.model):
            pass
    assert str(weights) in str(refused.value) and name in str(refused.value), str(refused.value)


@given(
    text=st.one_of(
        st.text(max_size=200),
        st.builds(lambda d: json.dumps(d)[: 10**6], junk_values),
        st.binary(max_size=100).map(lambda b: b.decode("latin-1")),
    )
)
@settings(FUZZ, max_examples=100 * SCALE)
def test_damaged_json_is_named(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "config.json"
    path.write_text(text, encoding="utf-8")
    try:
        assert isinstance(check_json(path), dict)
    except CompressError as exc:
        assert str(path) in str(exc)
