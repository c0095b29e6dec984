"""GGUF for llama.cpp: block packing and unpacking (blocks.py), the tensor layout (layout.py), the
hyperparameter and tokenizer metadata (metadata.py), the writer (writer.py), the read-back check
(check.py), the export step and its verifier in llama.cpp (export.py), the llama-cpp-python
runtime (runtime.py), a GGUF file as model source (source.py), the latency runner (latency.py), the
planned size (plan.py), input checks (inputs.py) and the format's plugin object (plugin.py). Importing the package
imports nothing heavy.
"""
