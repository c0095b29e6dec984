"""The base of every configuration model: unknown keys, NaN, infinity and absurd integers are errors.

Recipes come from people and from other jobs in a pipeline. A value that no setting can use —
``seed: 1e30``, ``max: .nan``, ``group_size: 100000000000`` — must stop at validation with the
key's name, not later as an overflow or an out-of-memory error after the model has loaded.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

MAX_INT = 2**31 - 1
"""Largest integer any field accepts unless its own bound says less (chunk counts, widths, steps…)."""

SEED_MAX = 2**32 - 1
"""Seeds are unsigned 32-bit: numpy, Python and torch all accept them unchanged."""

Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]


def _too_large(value: Any) -> int | None:
    """The first integer in ``value`` (a scalar, or inside lists, tuples and dict values) beyond ±MAX_INT."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if abs(value) > MAX_INT else None
    if isinstance(value, (list, tuple)):
        items: Any = value
    elif isinstance(value, dict):
        items = value.values()
    else:
        return None
    for item in items:
        if (found := _too_large(item)) is not None:
            return found
    return None


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("is empty; name a file, a directory or reference:<name>")
    return value


Source = Annotated[str, AfterValidator(_not_blank)]
"""Where a model, text or task comes from: a path or a name, never empty (an empty one would mean the current directory)."""


def not_a_bool(value: Any) -> Any:
    """For a ``Literal`` of integers (a ``version``), which even strict mode matches to true (True == 1):
    use as ``field_validator(NAME, mode="before")(not_a_bool)``."""
    if isinstance(value, bool):
        raise ValueError(f"{str(value).lower()} is a boolean, not a version number")
    return value


class Strict(BaseModel):
    """Unknown keys are errors; values keep their type; floats must be finite; integers stay within ±MAX_INT.

    Strict types (pydantic's strict mode): a number field takes no bool (``seed: true``), an integer
    field no float (``bits: 4.0``) and no string (``group_size: "32"``), a bool field only true or
    false (not ``"yes"``), a string field no number. A float field still takes an integer
    (``max: 1``). A field that really takes infinity says so itself (``Field(allow_inf_nan=True)``);
    a path field takes a string (``Field(strict=False)``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _bounded_integers(cls, value: Any) -> Any:
        if (big := _too_large(value)) is not None:
            shown = str(big) if len(str(big)) <= 24 else f"an integer of {len(str(abs(big)))} digits"
            raise ValueError(f"{shown} is out of range (integers here are at most {MAX_INT:,} in size)")
        return value


class BaseStageConfig(Strict):
    """The base of a stage kind's config (the value under ``prune:``, ``quantize:``, ...): the rules
    the kind sets on the rest of the recipe, which ``Recipe`` checks by asking each stage's config
    (it never switches on kind names)."""

    calibration_hint: ClassVar[str] = ""
    """Appended to "needs data.calibration" when ``needs_calibration`` is true and the recipe has none."""
    needs_evaluation_to: ClassVar[str | None] = None
    """Why the stage needs data.evaluation, or None when it does not."""
    before_quantization: ClassVar[bool] = False
    """The stage changes float weights, so it must come before any stage that quantizes weights."""

    @property
    def needs_calibration(self) -> bool:
        """The stage reads data.calibration."""
        return False

    def recipe_artifacts(self, label: str, recipe: Any) -> set[str]:
        """Artifacts the stage adds that gates may name (``recipe``: the Recipe being validated);
        raises ValueError when the rest of the recipe cannot serve the stage."""
        return set()
