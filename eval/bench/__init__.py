"""`compress bench`: one module per benchmark (quant, gguf, onnx, kv, prune, memory, latency); each runs whole
pipelines on one model and writes results.json and a Markdown table."""
