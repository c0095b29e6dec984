"""Round-to-nearest (RTN) weight quantization: no calibration data, one pass over each weight."""

from __future__ import annotations

import torch

from compress.quantizers.apply import quantize_each_layer
from compress.quantizers.configs import RTNConfig
from compress.quantizers.core import QuantizedWeight, compute_qparams, group_rows, pack_record, quantize_codes
from compress.quantizers.grid_search import grid_quantize
from compress.quantizers.mix import layer_schemes
from compress.schema.quantize import QuantScheme


def rtn_quantize(weight: torch.Tensor, scheme: QuantScheme) -> QuantizedWeight:
    """Quantize ``weight`` [out, in] to the nearest grid point of each group's min/max grid (on a
    llama.cpp type's own grid when ``scheme.gguf_type`` is set: grid_search.py)."""
    if scheme.gguf_type is not None:
        return grid_quantize(weight, scheme)
    groups = group_rows(weight, scheme)
    scale, zero = compute_qparams(groups, scheme)
    codes = quantize_codes(groups, scale, zero, scheme)
    return pack_record(codes, scale, zero, weight.shape[1], scheme)


class RTNStage:
    """The recipe step ``quantize: {method: rtn, ...}``."""

    def __init__(self, config: RTNConfig, label: str) -> None:
        self.config = config
        self.label = label

    def apply(self, model, ctx):  # noqa: ANN001 - see compress.context.Stage
        cfg, label = self.config, self.label
        return quantize_each_layer(model, ctx, cfg, label, rtn_quantize, lambda selected: layer_schemes(model, ctx, cfg, selected, label))
