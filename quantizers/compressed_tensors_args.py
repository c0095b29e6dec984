"""A weight scheme in compressed-tensors' words (its ``QuantizationArgs``): what the llm-compressor
backend asks llm-compressor for, and what the compressed-tensors export writes in a checkpoint's
``quantization_config``. One mapping, so the two cannot drift apart. Torch-free."""

from __future__ import annotations

from typing import Any

from compress.schema.quantize import QuantScheme

LINEAR_TARGET = "Linear"  # a config group's target: every nn.Linear not ignored


class Strategy:
    GROUP = "group"
    CHANNEL = "channel"
    TENSOR = "tensor"
    TOKEN = "token"


def weight_args(scheme: QuantScheme) -> dict[str, Any]:
    """compressed-tensors ``QuantizationArgs`` (as a dict) for a weight scheme."""
    return {
        "num_bits": scheme.bits,
        "type": "int",
        "symmetric": scheme.symmetric,
        "strategy": Strategy.CHANNEL if scheme.group_size is None else Strategy.GROUP,
        "group_size": scheme.group_size,
        "dynamic": False,
        "actorder": None,
    }


TOKEN_INT8_ACTIVATIONS: dict[str, Any] = {
    "num_bits": 8,
    "type": "int",
    "symmetric": True,
    "strategy": Strategy.TOKEN,
    "group_size": None,
    "dynamic": True,
    "actorder": None,
}
"""Dynamic per-token symmetric int8 activations, the ``input_activations`` of compressed-tensors' W8A8 preset
(``PRESET_SCHEMES["W8A8"]``): what a w8a8 stage's layers compute with (quantizers/w8a8.py)."""
