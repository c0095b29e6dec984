"""Distillation repair: losses and schedule (losses.py), the training loop and processes (train.py),
checkpoints (checkpoint.py) and the recipe stage (distill.py)."""
