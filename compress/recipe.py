"""Recipes: parsed from YAML, overridden with --set, validated strictly; errors name the key path and line.

The models (Recipe, GateConfig, ...) live in the torch-free compress.schema.recipe; the stage and
export items are the plugin tables' config models, put together here (``recipe_model``).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated, Any, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model

from compress.errors import RecipeError
from compress.paths import usable_cpus
from compress.plugins import EXPORT_FORMATS, QUANT_METHODS, STAGE_KINDS, device_names
from compress.schema.devices import DEVICE_FORMATS, DEVICE_RUNTIMES
from compress.schema.recipe import PATH_FIELDS, TASK_SOURCE_FIELD, USABLE_CPUS, Recipe, StageConfig
from compress.schema.yamlio import format_path, load_yaml, read_text

# --------------------------------------------------------------------------- loading


class LoadedRecipe(BaseModel):
    """A validated recipe plus where it came from (for path resolution and the manifest)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    recipe: Recipe
    path: Path
    text: str
    overrides: list[str]

    @property
    def base_dir(self) -> Path:
        return self.path.parent


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> LoadedRecipe:
    """Read, override and validate a recipe file. Raises RecipeError with key path and line."""
    path = Path(path)
    text = read_text(path, "recipe file", RecipeError)
    data, lines = parse_yaml(text, str(path))
    overrides = list(overrides or [])
    for item in overrides:
        apply_override(data, item, lines)
    return LoadedRecipe(recipe=validate(data, lines, str(path)), path=path.resolve(), text=text, overrides=overrides)


def parse_yaml(text: str, filename: str) -> tuple[dict[str, Any], dict[tuple, int]]:
    """Parse YAML into plain data and a map from key path to 1-based line number (bounded in
    size, depth and alias expansion: see compress.schema.yamlio)."""
    data, lines = load_yaml(text, filename, RecipeError)
    if not isinstance(data, dict):
        raise RecipeError(f"{filename}: a recipe is a YAML mapping (version, model, data, stages, exports, gates)")
    return data, lines


def apply_override(data: dict[str, Any], item: str, lines: dict[tuple, int]) -> None:
    """Apply ``key.path=value`` (value parsed as YAML) to the raw recipe data in place."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise RecipeError(f"--set {item!r}: expected key.path=value, e.g. --set stages.0.quantize.bits=8")
    parts: list[Any] = [int(p) if p.isascii() and p.isdigit() else p for p in key.strip().split(".")]
    if any(p == "" for p in parts):
        raise RecipeError(f"--set {item!r}: the key path has an empty part (two dots, or a dot at either end)")
    value, _ = load_yaml(raw, f"--set {item!r}", RecipeError) if raw.strip() else ("", {})
    if (
        (key.strip() in PATH_FIELDS or TASK_SOURCE_FIELD.fullmatch(key.strip()))
        and isinstance(value, str)
        and value.strip()  # an empty path is an error of the schema's, not the current directory
        and not value.startswith("reference:")
    ):
        candidate = Path(value).expanduser()
        if not candidate.is_absolute() and candidate.exists():
            value = str(candidate.resolve())
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        nxt = parts[depth + 1]
        if isinstance(node, list):
            if not isinstance(part, int) or part >= len(node):
                raise RecipeError(f"--set {item!r}: {format_path(tuple(parts[: depth + 1]))} is not an item of a list of {len(node)}")
            node = node[part]
        elif isinstance(node, dict):
            if part not in node or node[part] is None:
                node[part] = [] if isinstance(nxt, int) else {}
            node = node[part]
        else:
            raise RecipeError(f"--set {item!r}: {format_path(tuple(parts[:depth]))} is a value, not a mapping or list")
    last = parts[-1]
    if isinstance(node, list):
        if not isinstance(last, int) or last >= len(node):
            raise RecipeError(f"--set {item!r}: index {last} is outside a list of {len(node)}")
        node[last] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise RecipeError(f"--set {item!r}: {format_path(tuple(parts[:-1]))} is a value, not a mapping or list")
    lines[tuple(parts)] = -1  # marks "from --set"


# --------------------------------------------------------------------------- the recipe model, from the plugin tables


def recipe_model() -> type[Recipe]:
    """The model recipes are validated against: compress.schema.recipe.Recipe with its ``stages``
    items made from STAGE_KINDS (one optional key per kind; ``quantize:`` one of QUANT_METHODS'
    configs, chosen by ``method``) and its ``exports`` items from EXPORT_FORMATS (chosen by
    ``format``). Built from the tables as they are at the call (a test may add an entry), once per
    distinct contents."""
    return _models(*_tables())[1]


def stage_model() -> type[StageConfig]:
    """The model of one ``stages:`` item, from STAGE_KINDS and QUANT_METHODS (see ``recipe_model``)."""
    return _models(*_tables())[0]


def _tables() -> tuple[tuple, tuple, tuple]:
    methods = tuple((name, method.config) for name, method in QUANT_METHODS.items())
    kinds = tuple((name, kind.config, kind.quantizes_weights) for name, kind in STAGE_KINDS.items())
    formats = tuple((name, fmt.config) for name, fmt in EXPORT_FORMATS.items())
    return methods, kinds, formats


@functools.lru_cache(maxsize=16)
def _models(methods: tuple, kinds: tuple, formats: tuple) -> tuple[type[StageConfig], type[Recipe]]:
    quantize = _tagged_union(dict(methods), "method", _known_method)
    stage = create_model(
        "StageConfig",
        __base__=StageConfig,
        __doc__=StageConfig.__doc__,
        **{name: ((quantize if weights else config) | None, None) for name, config, weights in kinds},
    )
    export = _tagged_union(dict(formats), "format", _known_format)
    fields = Recipe.model_fields
    recipe = create_model(
        "Recipe",
        __base__=Recipe,
        stages=(list[stage], Field(default_factory=list, description=fields["stages"].description)),
        exports=(list[export], Field(default_factory=list, description=fields["exports"].description)),
    )
    return stage, recipe


def _tagged_union(configs: dict[str, type], tag: str, known: Any) -> Any:
    """One of ``configs`` (name -> config model), chosen by the value of its ``tag`` key; an unknown
    or missing name is refused by ``known`` with the names listed."""
    members = tuple(configs.values())
    check = BeforeValidator(lambda value: known(value, list(configs)))
    if len(members) == 1:
        return Annotated[members[0], check]
    return Annotated[Union[members], Field(discriminator=tag), check]  # noqa: UP007 - a union of a tuple of classes


def _known_method(value: Any, available: list[str]) -> Any:
    if isinstance(value, dict) and isinstance(value.get("method"), str) and value["method"] not in available:
        raise ValueError(f"unknown quantization method '{value['method']}'; known: {', '.join(available)}")
    return value


def _known_format(value: Any, available: list[str]) -> Any:
    if isinstance(value, dict) and "format" not in value:
        raise ValueError(f"an export names its format: format: {' | '.join(available)}")
    if isinstance(value, dict) and (not isinstance(value["format"], str) or value["format"] not in available):
        raise ValueError(f"export format '{value['format']}' is not available; available: {', '.join(available)}")
    return value


def validation_context() -> dict[str, Any]:
    """What validation needs from the plugin tables beyond the recipe model: the format and runtime
    names device profiles may list (the schema package never imports the tables). Recipes, device
    profile files and gates files are validated with it."""
    formats, runtimes = device_names()
    return {DEVICE_FORMATS: formats, DEVICE_RUNTIMES: runtimes, USABLE_CPUS: usable_cpus()}


def validate(data: dict[str, Any], lines: dict[tuple, int], filename: str) -> Recipe:
    """Validate raw recipe data against the plugin tables' recipe model (``recipe_model``)."""
    try:
        return recipe_model().model_validate(data, context=validation_context())
    except ValidationError as exc:
        raise RecipeError(format_validation_error(exc, lines, filename)) from None


def format_validation_error(
    exc: ValidationError, lines: dict[tuple, int], filename: str, root: type[BaseModel] | None = None, what: str = "recipe"
) -> str:
    messages = []
    for err in exc.errors():
        loc, parent = _resolve_loc(tuple(err["loc"]), root or recipe_model())
        line = _line_for(loc, lines)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown key '{loc[-1]}'" + _did_you_mean(str(loc[-1]), parent)
        elif err["type"] == "missing":
            msg = "required key is missing"
        key = format_path(loc) or f"({what})"
        where = "--set" if line == -1 else f"{filename}:{line}"
        messages.append(f"{where}: {key}: {msg}")
    head = f"{what} {filename} is not valid ({len(messages)} problem{'s' if len(messages) != 1 else ''}):"
    return "\n".join([head, *("  " + m for m in messages)])


def _did_you_mean(key: str, parent: type[BaseModel] | None) -> str:
    import difflib

    allowed = list(parent.model_fields) if parent is not None else []
    close = difflib.get_close_matches(key, allowed, n=1)
    return f" (did you mean '{close[0]}'?)" if close else (f" (allowed: {', '.join(allowed)})" if allowed else "")


def _resolve_loc(loc: tuple, root: type[BaseModel]) -> tuple[tuple, type[BaseModel] | None]:
    """Drop discriminated-union tags (``quantize.rtn.bits`` -> ``quantize.bits``) from a pydantic
    error location by walking the schema from ``root``; also return the schema object holding the last key."""
    clean: list[Any] = []
    ann: Any = root
    parent: type[BaseModel] | None = None
    for part in loc:
        if isinstance(part, int):
            clean.append(part)
            continue
        members = _models_in(ann)
        owner = next((m for m in members if part in m.model_fields), None)
        if owner is not None:
            clean.append(part)
            parent, ann = owner, owner.model_fields[part].annotation
            continue
        tagged = [m for m in members if part in {str(f.default) for f in m.model_fields.values() if f.default is not None}]
        if len(members) > 1 and tagged:  # a union tag: not a key in the YAML
            ann = tagged[0]
            continue
        clean.append(part)
        parent = members[0] if len(members) == 1 else None
        ann = None
    return tuple(clean), parent


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """BaseModel classes inside an annotation (through Optional, list, Union, Annotated)."""
    import typing

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found.extend(m for m in _models_in(arg) if m not in found)
    return found


def _line_for(loc: tuple, lines: dict[tuple, int]) -> int:
    for n in range(len(loc), -1, -1):
        if loc[:n] in lines:
            return lines[loc[:n]]
    return lines.get((), 1)


def json_schema() -> dict[str, Any]:
    return recipe_model().model_json_schema()
