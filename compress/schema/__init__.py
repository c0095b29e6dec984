"""The torch-free schema layer: base model, bounded numeric types and the safe YAML reader.

Nothing here imports torch or transformers, so `compress validate` and everything that only
reads recipes, gates files and device profiles stays cheap.
"""
