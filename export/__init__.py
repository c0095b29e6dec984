"""Checkpoint formats and exporters: they pack the pipeline's `QuantizedWeight` records
(`RunContext.quantized`) into other runtimes' formats without re-quantizing, verify every
export by reading it back, and import such checkpoints as model sources.

* ``packing.py`` — the int32 bit packing the formats share (pure functions);
* ``compressed_tensors.py`` — compressed-tensors pack-quantized writer + reader;
* ``autogptq.py`` — AutoGPTQ/GPTQModel v1 writer, v1/v2 reader;
* ``autoawq.py`` — AutoAWQ GEMM reader;
* ``hf_checkpoint.py`` — the Hugging Face directory around them (config, tensors, float model);
* ``specs.py`` — the recipe's ``exports`` items (no torch import);
* ``registry.py`` — the explicit format registry and the pipeline/model-loader glue.

GGUF, ONNX and TensorRT exporters are tracked by their own issues.
"""
