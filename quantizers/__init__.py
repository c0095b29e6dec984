"""Weight quantizers. Each method is one module with a config class, pure math, and one Stage.

``QUANTIZE_METHODS`` is the explicit registry the pipeline uses (method name -> config, stage); the
recipe schema validates with the torch-free configs in compress.schema.quantize.
"""

from __future__ import annotations

from compress.quantizers.awq import AWQStage
from compress.quantizers.gptq import GPTQStage
from compress.quantizers.llm_int8 import LLMInt8Stage
from compress.quantizers.rtn import RTNStage
from compress.schema.quantize import AWQConfig, GPTQConfig, LLMInt8Config, QuantizeConfig, RTNConfig

__all__ = ["QUANTIZE_METHODS", "QuantizeConfig"]

# method name -> (config class, stage class)
QUANTIZE_METHODS = {
    "rtn": (RTNConfig, RTNStage),
    "gptq": (GPTQConfig, GPTQStage),
    "awq": (AWQConfig, AWQStage),
    "llm_int8": (LLMInt8Config, LLMInt8Stage),
}
# The recipe's `quantize:` value (chosen by its `method`) is compress.schema.quantize.QuantizeConfig.
