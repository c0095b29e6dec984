"""Quantized Hugging Face checkpoints: compressed-tensors (compressed_tensors.py), AutoGPTQ
(autogptq.py), AutoAWQ import (autoawq.py), the directory helpers they share
(hf_checkpoint.py), the reader table and model-source import (readers.py), the export step
that writes and reads back (export.py), the planned sizes (plan.py) and the formats' plugin objects (plugin.py).
Importing the package imports nothing heavy.
"""
