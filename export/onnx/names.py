"""The ONNX export's file names, named once (its plugin object, builder and latency runner read them)."""

ONNX_FILE = "model.onnx"
GENAI_CONFIG = "genai_config.json"
