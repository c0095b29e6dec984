"""Structured pruning: importance scores from calibration activations (importance.py), slicing to a
smaller dense model (slicing.py), the supported decoders (arch.py) and the recipe stage (prune.py)."""
