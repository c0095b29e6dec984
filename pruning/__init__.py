"""Structured pruning (MLP neurons, attention heads, embedding channels, layers).

Not implemented yet: tracked by the pruning-with-distillation-repair issue. The recipe schema
has no `prune` stage until it lands.
"""
