"""ONNX Runtime GenAI: the MatMulNBits layout (matmulnbits.py), onnxruntime-genai's builder and
graph edits (builder.py), the export step and its verifier (export.py), the runtime (runtime.py),
encoder export (encoder.py, `compress export-encoder`), the latency runner (latency.py), the
planned size (plan.py), input checks (inputs.py) and the format's plugin object (plugin.py). Importing the package
imports nothing heavy.
"""
