"""Export formats: they pack the pipeline's `QuantizedWeight` records (`RunContext.quantized`)
into other runtimes' formats without re-quantizing, verify every export (read back, and run on
its runtime where it has one), and import such files as model sources.

One package per format, each with its plugin object, an ExportFormat (``plugin.py``), registered in
compress.plugins.EXPORT_FORMATS:

* ``gguf/`` — GGUF for llama.cpp;
* ``onnx/`` — ONNX Runtime GenAI (onnxruntime-genai's builder, MatMulNBits);
* ``tensorrt/`` — the TensorRT-ready Q/DQ ONNX and its engine;
* ``checkpoint/`` — Hugging Face checkpoints: compressed-tensors, AutoGPTQ (write + read),
  AutoAWQ (read), and the directory helpers they share.

Shared: ``format.py`` (the plugin object's base class ``ExportFormat`` and the latency ``Runner``),
``recipe_exports.py`` (the pipeline's check / write / report / gate glue), ``parity.py`` (the runtime
verifiers' inputs), ``packing.py`` (int32 bit packing). Each format's recipe config (no torch)
is its package's ``config.py``, on the base in compress/schema/exports.py.
"""
