"""compress: recipe-driven LLM compression and export, gated on measurements.

Importing this package is cheap on purpose: heavy backends (torch, transformers, llama.cpp,
ONNX Runtime, ...) are imported by the modules that need them.
"""

__version__ = "0.1.0"
