"""Distillation repair (teacher/student training after pruning).

Not implemented yet: tracked by the pruning-with-distillation-repair issue. The recipe schema
has no `distill` stage until it lands.
"""
