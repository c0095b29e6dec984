"""Errors meant for people: each says what was wrong, where, and what to do.

Every `CompressError` maps to exit code 2 on the command line and is printed without a
traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_GATE_FAILED = 1
EXIT_ERROR = 2


class CompressError(Exception):
    """A problem with the input or the environment that the user can fix."""


class RecipeError(CompressError):
    """The recipe (or a --set override) is not valid."""


class AssetError(CompressError):
    """A reference asset could not be fetched, located or verified."""


class ModelLoadError(CompressError):
    """The model source could not be resolved or loaded."""


class DataError(CompressError):
    """A text source could not be read or does not hold enough text."""


class ArtifactError(CompressError):
    """The output directory or an existing artifact is not usable."""


class FormatError(CompressError):
    """Quantized weights cannot be written to, or read from, a checkpoint format."""
