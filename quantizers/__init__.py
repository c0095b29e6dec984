"""Weight quantizers. Each method is one module with a config class, pure math, and one Stage.

``QUANTIZE_METHODS`` is the explicit registry the recipe schema and the pipeline use.
"""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import Field

from compress.quantizers.awq import AWQConfig, AWQStage
from compress.quantizers.gptq import GPTQConfig, GPTQStage
from compress.quantizers.llm_int8 import LLMInt8Config, LLMInt8Stage
from compress.quantizers.rtn import RTNConfig, RTNStage

# method name -> (config class, stage class)
QUANTIZE_METHODS = {
    "rtn": (RTNConfig, RTNStage),
    "gptq": (GPTQConfig, GPTQStage),
    "awq": (AWQConfig, AWQStage),
    "llm_int8": (LLMInt8Config, LLMInt8Stage),
}

# The recipe's `quantize:` value, chosen by its `method`.
QuantizeConfig = Annotated[Union[RTNConfig, GPTQConfig, AWQConfig, LLMInt8Config], Field(discriminator="method")]
