"""AWQ: activation-aware weight quantization (Lin et al., 2023).

Per decoder block, for each mapping ``prev -> linears`` of the architecture table:

1. search per-input-channel scales ``s = x_mean^α / w_mean^(1-α)`` (α on a grid; without
   duo scaling ``s = x_mean^α``, or both families; no scaling is a candidate too), keeping the
   one whose fake-quantized ``(W·s)/s`` best reproduces the output of the linears' parent
   module (attention, MLP, or the Linear itself) on calibration sequences; each candidate is
   scored with its own clipping search (step 3) applied (``clip_in_search``, default on);
2. fold them in: ``prev``'s output channels are divided by ``s`` (a norm's weight, or a
   Linear's rows) and the linears' input columns multiplied by ``s`` — the float model computes
   the same function (tested);
3. search a clipping range per group (shrinking the group's max |w|) that minimizes each
   group's partial output error (not for q/k projections, whose errors the softmax amplifies);
4. round to nearest into QuantizedWeight records (asymmetric by default).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from compress.context import RunContext, StageRecord
from compress.quantizers.apply import install_record
from compress.quantizers.arch import Architecture, AWQMapping
from compress.quantizers.configs import AWQConfig
from compress.quantizers.core import compute_qparams, group_rows, quantize_codes
from compress.quantizers.rtn import rtn_quantize
from compress.quantizers.sequential import BlockJob, run_layerwise
from compress.schema.quantize import QuantScheme

NO_CLIP = ("q_proj", "k_proj")


# --------------------------------------------------------------------------- pure math


def fake_quantize(weight: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Round-to-nearest quantize-dequantize of ``weight`` [out, in] in float32."""
    groups = group_rows(weight, scheme)
    scale, zero = compute_qparams(groups, scheme)
    deq = (quantize_codes(groups, scale, zero, scheme) - zero.unsqueeze(-1)) * scale.unsqueeze(-1)
    return deq.reshape(weight.shape[0], -1)[:, : weight.shape[1]]


def weight_saliency(weight: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Mean over output rows of |w| normalized by its group's max |w|, per input channel."""
    groups = group_rows(weight, scheme).abs()
    normed = groups / groups.amax(dim=-1, keepdim=True).clamp(min=1e-12)
    return normed.reshape(weight.shape[0], -1)[:, : weight.shape[1]].mean(dim=0)


def search_scales(
    x_mean: torch.Tensor, weight: torch.Tensor, scheme: QuantScheme, grid: int, duo: bool | str, loss_of: Callable[[torch.Tensor], float]
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Best per-input-channel scale for ``weight`` [out, in] (the mapping's linears stacked).

    ``loss_of(s)`` measures the output error when the linears use ``quantize(W·s)/s``; the
    candidates are no scaling and ``grid`` exponents α in [0, 1) of each family ``duo`` asks for.
    """
    w_mean = weight_saliency(weight.to(torch.float32), scheme).clamp(min=1e-6)
    x_mean = x_mean.to(torch.float32).clamp(min=1e-6)
    best_s = torch.ones_like(x_mean)
    best_loss = base_loss = loss_of(best_s)
    best_alpha, best_duo = None, None
    for use_duo in (False, True) if duo == "both" else (bool(duo),):
        for r in range(grid):
            alpha = r / grid
            s = x_mean.pow(alpha) / w_mean.pow(1 - alpha) if use_duo else x_mean.pow(alpha)
            s = s.clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            loss = loss_of(s)
            if loss < best_loss:
                best_loss, best_s, best_alpha, best_duo = loss, s, alpha, use_duo
    return best_s, {"alpha": -1.0 if best_alpha is None else best_alpha, "duo": best_duo, "loss": best_loss, "loss_unscaled": base_loss}


# Rows of the weight searched at once: a chunk of about 2^19 weights (2 MB in float32 per temporary).
# Rows are independent, so the chunking changes only the speed: fewer, larger steps cut the loop's
# per-step overhead, which AWQ pays once per scale candidate (`python scripts/experiments/awq_clip_rows.py` times it).
CLIP_CHUNK_WEIGHTS = 1 << 19


def search_clip(
    x: torch.Tensor, weight: torch.Tensor, scheme: QuantScheme, grid: int, max_shrink: float, rows_per_step: int | None = None
) -> torch.Tensor:
    """Per-group clipping bound [out, n_groups] minimizing each group's partial output error.

    The error of a group is the mean over the tokens ``x`` [t, in] of ``(Δw · x_t)²`` over that
    group's inputs, computed as the quadratic form ``Δwᵀ H Δw`` with the group's Gram matrix
    ``H = Xᵀ X / t`` (the same number, at ``group/t`` of the cost of replaying the tokens).
    ``rows_per_step`` (default: ``CLIP_CHUNK_WEIGHTS`` weights' worth of rows, at least 64) sets only
    the temporaries' memory and the speed: each row is searched on its own (bounds bit-equal at 7, 64,
    256 and 1024 rows in tests/test_calibrated.py and scripts/experiments/awq_clip_rows.py).
    """
    x = x.to(device=weight.device, dtype=torch.float32)
    w_groups = group_rows(weight, scheme)  # [out, G, g]
    out_f, n_groups, g = w_groups.shape
    if rows_per_step is None:
        rows_per_step = max(64, CLIP_CHUNK_WEIGHTS // (n_groups * g))
    xg = torch.nn.functional.pad(x, (0, n_groups * g - x.shape[1])).reshape(x.shape[0], n_groups, g)
    gram = torch.einsum("tgk,tgl->gkl", xg, xg) / x.shape[0]  # [G, g, g]
    best = torch.empty(out_f, n_groups, dtype=torch.float32, device=weight.device)
    for r0 in range(0, out_f, rows_per_step):
        wg = w_groups[r0 : r0 + rows_per_step]
        org_max = wg.abs().amax(dim=-1)
        best_err = torch.full_like(org_max, float("inf"))
        best_max = org_max.clone()
        for i in range(int(max_shrink * grid)):
            max_val = org_max * (1 - i / grid)
            clipped = torch.maximum(torch.minimum(wg, max_val.unsqueeze(-1)), -max_val.unsqueeze(-1))
            scale, zero = compute_qparams(clipped, scheme)
            delta = (quantize_codes(clipped, scale, zero, scheme) - zero.unsqueeze(-1)) * scale.unsqueeze(-1) - wg
            err = (torch.einsum("ogk,gkl->ogl", delta, gram) * delta).sum(dim=-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max = torch.where(better, max_val, best_max)
        best[r0 : r0 + rows_per_step] = best_max
    return best


def apply_clip(weight: torch.Tensor, bound: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """``weight`` clamped to ``[-bound, bound]`` per group."""
    g = scheme.group_width(weight.shape[1])
    b = bound.repeat_interleave(g, dim=1)[:, : weight.shape[1]]
    return torch.maximum(torch.minimum(weight, b), -b)


def fold_scales(prev: nn.Module, linears: list[nn.Linear], s: torch.Tensor, norm_offset: float) -> None:
    """Divide ``prev``'s output channels by ``s`` and multiply the linears' input columns by ``s``."""
    with torch.no_grad():
        if isinstance(prev, nn.Linear):
            prev.weight.div_(s.to(prev.weight.dtype).unsqueeze(1))
            if prev.bias is not None:
                prev.bias.div_(s.to(prev.bias.dtype))
        elif getattr(prev, "weight", None) is not None and prev.weight.dim() == 1:  # RMSNorm / LayerNorm
            w = prev.weight
            w.copy_(((norm_offset + w.to(torch.float32)) / s - norm_offset).to(w.dtype))
            if getattr(prev, "bias", None) is not None:
                prev.bias.div_(s.to(prev.bias.dtype))
        else:
            raise TypeError(f"cannot fold AWQ scales into {type(prev).__name__}")
        for lin in linears:
            lin.weight.mul_(s.to(lin.weight.dtype).unsqueeze(0))


# --------------------------------------------------------------------------- the stage


class _InputSampler:
    """Forward hook on a Linear: per-channel mean |x| over all its rows, plus the rows ``keep`` names
    (sorted indices into every row it sees, in order: tokens, or an MoE expert's routed tokens)."""

    def __init__(self, keep: torch.Tensor) -> None:
        self.keep = keep
        self.offset = 0
        self.abs_sum: torch.Tensor | None = None
        self.count = 0
        self.samples: list[torch.Tensor] = []

    def __call__(self, _module: nn.Module, args: tuple, _output: torch.Tensor) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float32)
        total = x.abs().sum(dim=0)
        self.abs_sum = total if self.abs_sum is None else self.abs_sum + total
        self.count += x.shape[0]
        lo = self.offset
        picked = self.keep[(self.keep >= lo) & (self.keep < lo + x.shape[0])] - lo
        self.samples.append(x[picked.to(x.device)])
        self.offset += x.shape[0]

    @property
    def mean(self) -> torch.Tensor:
        assert self.abs_sum is not None
        return self.abs_sum / self.count

    @property
    def x(self) -> torch.Tensor:
        return torch.cat(self.samples)


class _ParentRecorder:
    """Forward hook (with kwargs) on a mapping's parent module: its inputs and output for whole
    sequences, until ``tokens`` tokens are recorded."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.seen = 0
        self.calls: list[tuple[tuple, dict[str, Any], torch.Tensor]] = []

    def __call__(self, _module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if self.seen >= self.tokens:
            return
        out = output[0] if isinstance(output, tuple) else output
        self.calls.append((tuple(a.detach() if torch.is_tensor(a) else a for a in args), dict(kwargs), out.detach()))
        self.seen += out.shape[0] * out.shape[1] if out.dim() == 3 else out.shape[0]

    def loss(self, parent: nn.Module) -> float:
        total, count = 0.0, 0
        with torch.no_grad():
            for args, kwargs, reference in self.calls:
                out = parent(*args, **kwargs)
                out = out[0] if isinstance(out, tuple) else out
                total += float((out.float() - reference.float()).pow(2).sum())
                count += reference.numel()
        return total / count


def _sample_plan(rows: int, n: int, seed: int) -> torch.Tensor:
    """``n`` of ``rows`` row indices (all when fewer), drawn with ``seed``, sorted."""
    return torch.randperm(rows, generator=torch.Generator().manual_seed(seed))[: min(n, rows)].sort().values


class AWQStage:
    """The recipe step ``quantize: {method: awq, ...}``: layer-wise over the decoder blocks. The weights' rounding is
    two methods, ``round_trip`` (the search's fake quantization) and ``install`` (the final rounding into a record);
    fp4's awq (quantizers/fp4.py) overrides both to search and round on the FP4 grid."""

    def __init__(self, config: AWQConfig, label: str) -> None:
        self.config = config
        self.label = label

    def round_trip(self, weight: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
        """The quantize-dequantize the scale search scores a candidate with (float32 [out, in])."""
        return fake_quantize(weight, scheme)

    def install(
        self, model: nn.Module, name: str, module: nn.Linear, weight: torch.Tensor, scheme: QuantScheme, ctx: RunContext
    ) -> dict[str, Any]:
        """Round the scaled (and clipped) float32 ``weight`` of Linear ``name`` and install the record; its summary."""
        return install_record(model, name, module, rtn_quantize(weight, scheme), ctx, self.label)

    def apply(self, model: nn.Module, ctx: RunContext) -> StageRecord:
        cfg = self.config
        if cfg.backend == "llmcompressor":
            from compress.quantizers.llmcompressor_backend import apply_llmcompressor

            return apply_llmcompressor(model, ctx, cfg, self.label)
        scheme = cfg.scheme()
        skipped: dict[str, str] = {}

        def process(job: BlockJob, arch: Architecture) -> None:
            mappings = []
            for mapping in arch.awq_mappings(job.block):
                reason = _mapping_problem(job, mapping)
                if reason:
                    skipped[f"{job.prefix}{mapping.prev}"] = reason
                else:
                    mappings.append(mapping)
            seed = ctx.seed * 1_000_003 + job.index
            samplers = {
                name: _InputSampler(_sample_plan(job.rows.get(name, job.inputs.tokens), cfg.clip_tokens, seed)) for name in job.linears
            }
            inputs = {m.inputs: _InputSampler(torch.empty(0, dtype=torch.long)) for m in mappings if m.inputs}  # mean |x| only
            parents = {m.parent: _ParentRecorder(cfg.search_tokens) for m in mappings}
            handles = [m.register_forward_hook(samplers[n]) for n, m in job.linears.items()]
            handles += [job.block.get_submodule(n).register_forward_hook(r) for n, r in inputs.items()]
            handles += [job.block.get_submodule(p).register_forward_hook(r, with_kwargs=True) for p, r in parents.items()]
            try:
                job.inputs.run(job.block, keep=False)
            finally:
                for handle in handles:
                    handle.remove()
            xs = {n: sampler.x for n, sampler in samplers.items()}
            scaled: dict[str, dict] = {}
            for mapping in mappings:
                linears = [job.linears[n] for n in mapping.linears]
                originals = [lin.weight.detach().clone() for lin in linears]
                parent = job.block.get_submodule(mapping.parent)

                def loss_of(s: torch.Tensor, mapping=mapping, linears=linears, originals=originals, parent=parent) -> float:
                    for name, lin, w0 in zip(mapping.linears, linears, originals, strict=True):
                        scaled_w = w0.float() * s
                        if cfg.clip_in_search and _clipped(name, cfg):
                            scaled_w = apply_clip(
                                scaled_w, search_clip(xs[name] / s, scaled_w, scheme, cfg.clip_grid, cfg.max_shrink), scheme
                            )
                        lin.weight.data = (self.round_trip(scaled_w, scheme) / s).to(w0.dtype)
                    return parents[mapping.parent].loss(parent)

                try:
                    x_mean = (inputs[mapping.inputs] if mapping.inputs else samplers[mapping.linears[0]]).mean
                    s, info = search_scales(x_mean, torch.cat(originals), scheme, cfg.grid, cfg.duo_scaling, loss_of)
                finally:
                    for lin, w0 in zip(linears, originals, strict=True):
                        lin.weight.data = w0
                readers = linears + [job.block.get_submodule(n) for n in mapping.scaled_too]  # the router reads x / s too
                fold_scales(job.block.get_submodule(mapping.prev), readers, s, arch.norm_offset)
                for n in mapping.linears:
                    xs[n] = xs[n] / s  # the linears now see inputs divided by s
                    scaled[n] = {
                        "awq_alpha": info["alpha"],
                        "awq_duo": info["duo"],
                        "awq_loss_ratio": round(info["loss"] / max(info["loss_unscaled"], 1e-30), 4),
                    }
            for name, module in job.linears.items():
                weight = module.weight.detach().to(torch.float32)
                info = dict(scaled.get(name, {"awq_alpha": None}))
                if _clipped(name, cfg):
                    bound = search_clip(xs[name], weight, scheme, cfg.clip_grid, cfg.max_shrink)
                    info["clipped_share"] = round(float((bound < group_rows(weight, scheme).abs().amax(-1)).float().mean()), 4)
                    weight = apply_clip(weight, bound, scheme)
                full = job.prefix + name
                job.layer_info[full] = {**self.install(model, full, module, weight, scheme, ctx), **info}

        record = run_layerwise(model, ctx, cfg, self.label, "awq", process, cfg.batch_size)
        record.summary["awq_mappings_skipped"] = skipped
        return record


def _clipped(name: str, cfg: AWQConfig) -> bool:
    return cfg.clip and not any(tag in name for tag in NO_CLIP)


def _mapping_problem(job: BlockJob, mapping: AWQMapping) -> str | None:
    missing = [n for n in mapping.linears if n not in job.linears]
    if missing:
        return f"not scaled: {', '.join(missing)} not selected for quantization"
    try:
        prev = job.block.get_submodule(mapping.prev)
    except AttributeError:
        return f"not scaled: the block has no {mapping.prev}"
    width = job.linears[mapping.linears[0]].in_features
    if isinstance(prev, nn.Linear) and prev.out_features != width:
        return f"not scaled: {mapping.prev} has {prev.out_features} outputs but the next layer takes {width} (grouped-query attention)"
    return None
