"""Calibrating the routed experts of a mixture-of-experts block, one expert matrix at a time.

transformers stores an MoE block's experts fused (compress/experts.py). For the time one block is
calibrated, :func:`experts_as_linears` swaps each fused-experts module for :class:`UnfusedExperts`, a
``ModuleList`` of per-expert MLPs whose ``gate_proj`` / ``up_proj`` / ``down_proj`` are ordinary
``nn.Linear`` layers over views of the fused slices (no copy) and whose forward routes exactly as the
fused one does. GPTQ and AWQ then see one Linear per expert matrix, named like
``model.layers.0.mlp.experts.3.down_proj``, and calibrate each on the tokens routed to that expert.
When the block is done, every expert's (quantized, dequantized) weights are written back into the
fused parameters and the fused module is put back.

Before calibrating, one pass over the block counts the routed tokens per expert (the router's
top-k choices on the calibration tokens; the pass stops at the experts). An expert with fewer than
``moe.min_tokens`` is calibrated on every token of its block (``under_min: all_tokens``: its Linears
see all tokens, its output still uses only its routed ones), or the run stops naming it
(``under_min: fail``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from compress.errors import CompressError
from compress.experts import PROJECTIONS, expert_weight, fused_experts, num_experts
from compress.quantizers.configs import ExpertCoverage, MoECalibration


class StopAtExperts(Exception):
    """Raised by :class:`UnfusedExperts` while counting: the routing is known, the rest of the block is not needed."""


class ExpertMLP(nn.Module):
    """One expert: ``down_proj(act(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act: nn.Module) -> None:
        super().__init__()
        self.gate_proj = _linear(gate)
        self.up_proj = _linear(up)
        self.down_proj = _linear(down)
        self.act_fn = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)  # a view of the fused slice
    return layer


class UnfusedExperts(nn.ModuleList):
    """A fused-experts module as one :class:`ExpertMLP` per expert, with the fused module's forward
    ``(hidden_states [T, hidden], top_k_index [T, k], top_k_weights [T, k])``.

    ``counting``: the forward adds the routed tokens per expert to ``counts`` and raises
    :class:`StopAtExperts`. ``all_tokens``: experts whose Linears see every token (their output still
    uses only their routed tokens).
    """

    def __init__(self, fused: nn.Module) -> None:
        super().__init__(ExpertMLP(*(expert_weight(fused, e, p) for p in PROJECTIONS), fused.act_fn) for e in range(num_experts(fused)))
        self.counts = torch.zeros(len(self), dtype=torch.long)
        self.top_k = 0
        self.counting = False
        self.all_tokens: set[int] = set()

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.counting:
            self.counts += torch.bincount(top_k_index.reshape(-1).cpu(), minlength=len(self))
            self.top_k = int(top_k_index.shape[-1])
            raise StopAtExperts
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self):
            token, slot = torch.where(top_k_index == e)
            if e in self.all_tokens:
                y = expert(hidden_states)[token]
            elif token.numel() == 0:
                continue
            else:
                y = expert(hidden_states[token])
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out

    def write_back(self, fused: nn.Module) -> None:
        """Copy every expert's current weights into the fused parameters."""
        with torch.no_grad():
            for e, expert in enumerate(self):
                for p in PROJECTIONS:
                    target = expert_weight(fused, e, p)
                    weight = getattr(expert, p).weight
                    if weight.data_ptr() != target.data_ptr():
                        target.copy_(weight.to(target.dtype))


def expert_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Every expert matrix of ``model`` as a weightless (meta) Linear of its shape, for selecting layers by name."""
    found = []
    for name, fused in fused_experts(model):
        hidden, inter = fused.down_proj.shape[1], fused.down_proj.shape[2]
        shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
        for e in range(num_experts(fused)):
            for p in PROJECTIONS:
                out_f, in_f = shapes[p]
                found.append((f"{name}.{e}.{p}", nn.Linear(in_f, out_f, bias=False, device="meta")))
    return found


@contextmanager
def unfused(block: nn.Module, wanted: Callable[[str], bool] = lambda _rel: True) -> Iterator[list[tuple[str, UnfusedExperts]]]:
    """While inside: every fused-experts module of ``block`` (that ``wanted(name relative to block)``)
    is an :class:`UnfusedExperts` (yielded with its name); on the way out the experts' weights are
    written back into the fused parameters, which are put back."""
    swapped = []
    try:
        for rel, fused in fused_experts(block):
            if not wanted(rel):
                continue
            parent, _, attr = rel.rpartition(".")
            owner = block.get_submodule(parent) if parent else block
            module = UnfusedExperts(fused)
            setattr(owner, attr, module)
            swapped.append((rel, owner, attr, fused, module))
        yield [(rel, module) for rel, _, _, _, module in swapped]
    finally:
        for _, owner, attr, fused, module in reversed(swapped):
            module.write_back(fused)
            setattr(owner, attr, fused)


@contextmanager
def experts_as_linears(
    block: nn.Module,
    prefix: str,
    index: int,
    inputs: Any,
    settings: MoECalibration,
    label: str,
    coverage: list[dict[str, Any]],
    selected: Collection[str],
) -> Iterator[None]:
    """While inside: ``block``'s fused experts with a matrix in ``selected`` (full layer names) are
    unfused (one Linear per expert matrix), their routed tokens counted on ``inputs`` (a BlockInputs)
    and the ``settings`` rule applied; one :class:`ExpertCoverage` per experts module is appended to
    ``coverage``. A dense block, or one whose experts are all ignored, passes through."""
    stems = {n.rsplit(".", 2)[0] for n in selected if n.startswith(prefix)}  # <experts>.<e>.<projection> -> <experts>
    with unfused(block, lambda rel: prefix + rel in stems) as swapped:
        if swapped:
            _count(block, inputs, [module for _, module in swapped])
        for rel, module in swapped:
            counts = module.counts.tolist()
            under = [e for e, n in enumerate(counts) if n < settings.min_tokens]
            if under and settings.under_min == "fail":
                listed = ", ".join(f"{prefix}{rel}.{e} ({counts[e]} tokens)" for e in under[:8])
                more = f" and {len(under) - 8} more" if len(under) > 8 else ""
                raise CompressError(
                    f"{label}: moe.min_tokens is {settings.min_tokens}, and the router sends fewer calibration tokens to "
                    f"{len(under)} expert(s): {listed}{more}. Calibrate on more (or more varied) text (data.calibration), "
                    "lower moe.min_tokens, or set moe.under_min: all_tokens to calibrate those experts on every token."
                )
            module.all_tokens = set(under)
            coverage.append(
                ExpertCoverage(
                    block=index,
                    experts=prefix + rel,
                    tokens=inputs.tokens,
                    top_k=module.top_k,
                    tokens_per_expert=counts,
                    under_min=under,
                    calibrated_on_all_tokens=under,
                ).model_dump()
            )
        yield


def _count(block: nn.Module, inputs: Any, unfused: list[UnfusedExperts]) -> None:
    """One pass over the block's inputs that only records the routing (each call stops at the experts)."""
    for module in unfused:
        module.counting = True
    try:
        with torch.no_grad():
            for h, kw in zip(inputs.hidden, inputs.kwargs, strict=True):
                try:
                    block(h, **kw)
                except StopAtExperts:
                    pass
    finally:
        for module in unfused:
            module.counting = False


def calibration_rows(coverage: list[dict[str, Any]], name: str) -> int | None:
    """Rows an expert matrix ``name`` (``<experts>.<e>.<projection>``) is calibrated on, or None when it is no expert's."""
    for block in coverage:
        stem = block["experts"] + "."
        if name.startswith(stem):
            e = int(name[len(stem) :].split(".")[0])
            return block["tokens"] if e in block["calibrated_on_all_tokens"] else block["tokens_per_expert"][e]
    return None


def coverage_summary(coverage: list[dict[str, Any]], settings: MoECalibration) -> dict[str, Any]:
    """The stage record's ``summary.moe``: the rule, the per-block counts and the two gateable numbers."""
    counts = [n for block in coverage for n in block["tokens_per_expert"]]
    return {
        **settings.model_dump(mode="json"),
        "blocks": coverage,
        "experts": len(counts),
        "experts_under_min": sum(len(block["under_min"]) for block in coverage),
        "min_expert_tokens": min(counts),
    }
