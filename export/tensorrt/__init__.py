"""TensorRT: the TensorRT-ready Q/DQ ONNX (qdq.py), the engine builder and runner (engine.py), the
export step (export.py), the latency runner (latency.py), the planned size (plan.py) and the
format's plugin object (plugin.py). Importing the package imports nothing heavy.
"""
