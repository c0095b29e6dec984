"""Fused mixture-of-experts weights, named one matrix per expert.

transformers 5 stores the routed experts of an MoE block (Qwen3-MoE, Qwen2-MoE, Mixtral, ...) as
one module with two 3-D parameters rather than one ``nn.Linear`` per expert:

- ``gate_up_proj`` [num_experts, 2 * intermediate, hidden]: rows ``[:intermediate]`` are expert e's
  gate projection, rows ``[intermediate:]`` its up projection (the "concatenated" layout);
- ``down_proj`` [num_experts, hidden, intermediate].

compress names each expert matrix like the Linear it would be, ``<experts>.<e>.<projection>``:

=============================================  =============================================
record / layer name                            the checkpoint tensor it is a slice of
=============================================  =============================================
``model.layers.0.mlp.experts.3.gate_proj``     ``model.layers.0.mlp.experts.gate_up_proj[3, :I]``
``model.layers.0.mlp.experts.3.up_proj``       ``model.layers.0.mlp.experts.gate_up_proj[3, I:]``
``model.layers.0.mlp.experts.3.down_proj``     ``model.layers.0.mlp.experts.down_proj[3]``
=============================================  =============================================

(``I`` is the experts' intermediate size.) Each slice is ``[out_features, in_features]`` like a
Linear's weight. Only that layout (concatenated, not transposed, no bias, gated) is read; another is
an error that says so.
"""

from __future__ import annotations

import torch
from torch import nn

from compress.errors import CompressError

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def is_fused_experts(module: nn.Module) -> bool:
    """A module holding every expert's weights as 3-D ``gate_up_proj`` and ``down_proj`` parameters."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3 and down.dim() == 3


def check_layout(module: nn.Module, name: str) -> None:
    """Raise unless ``module`` stores its experts in the layout this module reads."""
    problems = [
        what
        for what, bad in (
            ("transposed weights", getattr(module, "is_transposed", False)),
            ("interleaved gate/up rows", not getattr(module, "is_concatenated", True)),
            ("biases", getattr(module, "has_bias", False)),
            ("no gate projection", not getattr(module, "has_gate", True)),
        )
        if bad
    ]
    if problems:
        raise CompressError(
            f"{name} ({type(module).__name__}) stores its experts with {', '.join(problems)}; compress reads fused experts "
            "as gate_up_proj [experts, 2 x intermediate, hidden] and down_proj [experts, hidden, intermediate] only "
            "(Qwen3-MoE's layout). Quantize this model with method: rtn, or keep the experts in `ignore`."
        )


def fused_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every fused-experts module of ``model`` and its name, in model order (layouts checked)."""
    found = [(n, m) for n, m in model.named_modules() if is_fused_experts(m)]
    for name, module in found:
        check_layout(module, name)
    return found


def num_experts(module: nn.Module) -> int:
    return int(module.down_proj.shape[0])


def expert_weight(module: nn.Module, index: int, projection: str) -> torch.Tensor:
    """Expert ``index``'s ``projection`` weight [out, in]: a view of the fused parameter (writes go through)."""
    inter = module.down_proj.shape[2]
    if projection == "gate_proj":
        return module.gate_up_proj.data[index, :inter]
    if projection == "up_proj":
        return module.gate_up_proj.data[index, inter:]
    if projection == "down_proj":
        return module.down_proj.data[index]
    raise KeyError(projection)


def expert_layer_names(name: str, module: nn.Module) -> list[str]:
    """The layer names of every expert matrix of the fused module ``name``."""
    return [f"{name}.{e}.{p}" for e in range(num_experts(module)) for p in PROJECTIONS]


def expert_view(model: nn.Module, name: str) -> torch.Tensor | None:
    """The slice of a fused parameter that the layer name ``<experts>.<e>.<projection>`` stands for,
    or None when ``name`` is not such a name."""
    parent, _, rest = name.rpartition(".")
    path, _, index = parent.rpartition(".")
    if rest not in PROJECTIONS or not index.isdigit():
        return None
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    if not is_fused_experts(module) or int(index) >= num_experts(module):
        return None
    return expert_weight(module, int(index), rest)
