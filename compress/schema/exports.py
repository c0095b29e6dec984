"""What every ``exports:`` item of a recipe has: ``BaseExportConfig`` (its ``name``, and whether the format
runs on a runtime of its own), the base of each format's config.

Each format's own config lives in its package (export/<format>/config.py, torch-free) and is named by
its ExportFormat in compress.plugins.EXPORT_FORMATS; the recipe's ``exports`` items are the union of
those configs, chosen by ``format`` (compress.recipe.recipe_model builds it from the table). This
module never imports the table (the schema is the bottom layer).
"""

from __future__ import annotations

import re
from typing import ClassVar

from pydantic import (
    Field,
    model_validator,
)

from compress.schema.base import Strict

EXPORTS_DIR = "exports"
RESERVED_NAMES = ("baseline", "compressed")  # the in-memory artifacts gates already know
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
INTEGER_ONLY = "it holds integer weight codes only"
FORMAT_DOC = "The export format: a name in compress.plugins.EXPORT_FORMATS (the formats' table)."


class BaseExportConfig(Strict):
    own_runtime: ClassVar[bool] = False
    """Runs on a runtime of its own (verified and timed there; ``latency.artifacts`` may name it);
    False: a checkpoint holding the compressed records, gated on the ``compressed`` evaluation."""
    holds_activation_quantization: ClassVar[bool] = False
    """The format records int8 activation quantization (per-token dynamic scales) beside the weights, so a
    method that quantizes activations (``w8a8``) may export to it; the others refuse it at validation."""
    float_refusals: ClassVar[dict[str, str | None]] = {}
    """Why the format cannot hold the layers of a float-grid quantize stage, by the stage's grid (``fp8``:
    quantizers/fp8_config.py; ``nvfp4``, ``mxfp4``: quantizers/fp4_config.py), or None where it writes them;
    a grid not named is refused with INTEGER_ONLY. The recipe is refused naming the export."""

    def activation_refusal(self) -> str | None:
        """Why this export cannot hold int8 per-token activation quantization (a ``w8a8`` stage), or None; by default
        whether the format holds it at all (``holds_activation_quantization``). A format that holds it in some
        settings only (ONNX: precision w8a8) says so for its own settings."""
        if self.holds_activation_quantization:
            return None
        return f"a {self.format} export cannot hold activation quantization (it would run the int8 weights on float activations, another model)"

    @classmethod
    def float_refusal(cls, grid: str) -> str | None:
        """Why the format cannot hold layers on float grid ``grid`` (``float_refusals``), or None."""
        return cls.float_refusals.get(grid, INTEGER_ONLY)

    name: str | None = Field(
        None,
        description="Names the export in reports and gates and its folder exports/<name>/ in the artifact; "
        "defaults to the format; unique within the recipe.",
    )

    @model_validator(mode="after")
    def _default_name(self) -> BaseExportConfig:
        if self.name is None:
            self.name = self.format
        if not NAME_PATTERN.fullmatch(self.name):  # fullmatch: "$" alone would let a trailing newline through
            raise ValueError(f"export name {self.name!r} must be letters, digits, '.', '_' or '-' (it names a folder)")
        if self.name in RESERVED_NAMES:
            raise ValueError(f"export name '{self.name}' is reserved for the in-memory artifacts {', '.join(RESERVED_NAMES)}")
        return self
