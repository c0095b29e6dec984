"""Exporters (GGUF, ONNX, TensorRT, compressed-tensors) and their verifiers.

Not implemented yet: tracked by the GGUF and ONNX/TensorRT issues. Until they land, the recipe
validator rejects any `exports` entry with a clear message. Exporters will pack the
`QuantizedWeight` records the pipeline keeps (`RunContext.quantized`) without re-quantizing.
"""
