"""Weight quantizers. Each method is one module with pure math and one Stage; its config model
and its spec (compress.plugin_types.MethodSpec, in the torch-free quantizers/specs.py) are
registered by one entry of ``compress.plugins.QUANT_METHODS``.

``QUANTIZE_METHODS`` is that table under its older name (method name -> MethodSpec). Importing
this package imports no torch.
"""

from __future__ import annotations

from typing import Any

from compress.schema.quantize import QuantizeConfig

__all__ = ["QUANTIZE_METHODS", "QuantizeConfig"]


def __getattr__(name: str) -> Any:
    if name == "QUANTIZE_METHODS":  # read lazily: compress.plugins imports this package's specs
        from compress.plugins import QUANT_METHODS

        return QUANT_METHODS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
