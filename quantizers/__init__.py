"""Weight quantizers. Each method is one module with a config class, pure math, and one Stage.

``QUANTIZE_METHODS`` is the explicit registry the recipe schema and the pipeline use.
"""

from __future__ import annotations

from compress.quantizers.rtn import RTNConfig, RTNStage

# method name -> (config class, stage class)
QUANTIZE_METHODS = {
    "rtn": (RTNConfig, RTNStage),
}

# The recipe's `quantize:` value. Becomes a discriminated union on `method` as methods are added.
QuantizeConfig = RTNConfig
