"""GPTQ: quantize each Linear column by column, pushing each column's rounding error onto the
columns not yet quantized, weighted by the inverse Hessian of the layer's inputs
(Frantar et al., 2022). Pure math first (`accumulate_hessian`, `gptq_quantize`), the stage last.

Groups stay contiguous in the original column order, also with act-order: group scales and
zero points are computed up front from the original weights ("static groups"), then columns
are visited in order of decreasing Hessian diagonal. The records therefore map onto Q4_0/Q4_1
blocks and MatMulNBits without any reordering. On a llama.cpp type's grid (``scheme.gguf_type``,
grid_search.py) the unit of parameters is the type's block (a K-quant's super-block of 256), fixed to
its stored values (fp16 minimum, quantized sub-block scales) before the loop rounds its columns.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, NamedTuple

import numpy as np
import torch

from compress.calibration_checks import check_token_count
from compress.context import RunContext, StageRecord
from compress.quantizers.apply import install_record
from compress.quantizers.arch import Architecture
from compress.quantizers.configs import GPTQConfig
from compress.quantizers.core import one_cpu_thread
from compress.quantizers.grid_search import GridParams, nonzero_divisor
from compress.quantizers.mix import layer_schemes
from compress.quantizers.sequential import BlockJob, run_layerwise, select_block_linears
from compress.schema.quantize import QuantScheme

HESSIAN_STRIP = 1024
"""With ``upper_only``, inputs wider than this accumulate H a strip of rows at a time over its upper
triangle (H is symmetric): 56% of the products for the 8,960-wide down_proj, 78% at 1,536;
``mirror_upper`` fills the lower triangle before use."""


class _ColumnOps(NamedTuple):
    """The column loop's elementwise operations, on torch tensors or on NumPy views of them: the
    same float32 arithmetic (round half to even, clamp to [0, qmax]) either way."""

    view: Callable[[torch.Tensor], Any]
    round: Callable[[Any], Any]
    clamp: Callable[[Any, float], Any]
    outer: Callable[[Any, Any], Any]


_TORCH_OPS = _ColumnOps(lambda t: t, torch.round, lambda q, hi: q.clamp_(0.0, hi), torch.outer)
_NUMPY_OPS = _ColumnOps(torch.Tensor.numpy, np.rint, lambda q, hi: np.minimum(np.maximum(q, 0.0, out=q), hi, out=q), np.multiply.outer)


def accumulate_hessian(
    hessian: torch.Tensor, count: int, inputs: torch.Tensor, upper_only: bool = False, strip: int = HESSIAN_STRIP
) -> int:
    """Fold ``inputs`` [..., in] into the running ``H = 2/n · Σ x xᵀ`` (in place); returns the new n.
    ``upper_only``: only the upper triangle (and the diagonal strips of ``strip`` rows) is kept up to
    date; call ``mirror_upper`` with the same ``strip`` once the last inputs are in."""
    x = inputs.reshape(-1, inputs.shape[-1])
    new = count + x.shape[0]
    hessian.mul_(count / new)
    scale = (2.0 / new) ** 0.5
    # Scaled in place when the float32 copy is ours (bf16/fp16 inputs): one [tokens, in] buffer, not two.
    x = x.to(torch.float32).mul_(scale) if x.dtype != torch.float32 else x * scale
    width = x.shape[1]
    if not upper_only or width <= strip:
        hessian.addmm_(x.t(), x)
        return new
    for i in range(0, width, strip):
        hessian[i : i + strip, i:].addmm_(x[:, i : i + strip].t(), x[:, i:])
    return new


def input_square_sums(hessian: torch.Tensor, count: int) -> torch.Tensor:
    """Σ x² over the ``count`` tokens of each input column, from ``H = 2/n · Σ x xᵀ`` (float32, on the CPU)."""
    return (torch.diagonal(hessian).double() * (count / 2.0)).float().cpu()


def mirror_upper(hessian: torch.Tensor, strip: int = HESSIAN_STRIP) -> torch.Tensor:
    """Complete a Hessian accumulated with ``upper_only`` (in strips of ``strip`` rows): each strip's
    part left of its diagonal block is the transpose of the strips above it (in place; returns it)."""
    for i in range(strip, hessian.shape[0], strip):
        hessian[i : i + strip, :i] = hessian[:i, i : i + strip].t()
    return hessian


def _permute_rows_(m: torch.Tensor, perm: list[int]) -> None:
    """``m[:] = m[perm]`` in place, one row at a time along each cycle of the permutation."""
    seen = [False] * len(perm)
    for start in range(len(perm)):
        if seen[start] or perm[start] == start:
            continue
        first, i = m[start].clone(), start
        while True:
            seen[i] = True
            j = perm[i]
            if j == start:
                m[i] = first
                break
            m[i] = m[j]
            i = j


def permute_symmetric_(h: torch.Tensor, perm: list[int], tile: int = 512) -> torch.Tensor:
    """``h[perm][:, perm]`` of a symmetric ``h``, in its own memory: permute the rows (P H), transpose
    in place tile by tile (H Pᵀ, since H is symmetric), permute the rows again (P H Pᵀ). Returns h."""
    _permute_rows_(h, perm)
    n = h.shape[0]
    for i in range(0, n, tile):
        block = h[i : i + tile, i : i + tile]
        block.copy_(block.t().clone())
        for j in range(i + tile, n, tile):
            upper = h[i : i + tile, j : j + tile].clone()
            h[i : i + tile, j : j + tile] = h[j : j + tile, i : i + tile].t()
            h[j : j + tile, i : i + tile] = upper.t()
    _permute_rows_(h, perm)
    return h


def _inverse_cholesky(box: list[torch.Tensor], dampening: float) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of H⁻¹ after dampening; raises dampening tenfold until H is positive
    definite. Takes H out of ``box`` and dampens it in place: on the CPU the factor is made in H's own
    memory (one [in, in] matrix: 321 MB for an 8,960-wide down_proj), elsewhere at most two live
    at once."""
    h = box.pop()
    if h.device.type == "cpu":
        return _inverse_cholesky_in_place(h, dampening)
    mean_diag = float(torch.diag(h).mean())
    damp, added = dampening, 0.0
    for _ in range(5):
        h.diagonal().add_((damp - added) * mean_diag)  # H + damp * mean(diag H) * I, without the identity matrix
        added = damp
        chol, info = torch.linalg.cholesky_ex(h)
        if int(info) == 0:
            del h
            inverse = torch.cholesky_inverse(chol)
            del chol
            return torch.linalg.cholesky(inverse, upper=True), damp
        del chol
        damp *= 10
    raise torch.linalg.LinAlgError(f"Hessian is not positive definite even with dampening {damp / 10:g}")


def _inverse_cholesky_in_place(h: torch.Tensor, dampening: float) -> tuple[torch.Tensor, float]:
    """``_inverse_cholesky`` on the CPU in H's own memory, with LAPACK's potrf and potri (scipy),
    which work in place where torch's linalg allocates a second [in, in] matrix: factor, invert,
    factor again. H is symmetric, so its row-major memory is its column-major self; LAPACK's lower
    triangle is H's upper one here, the strictly lower part stays H until the end (restored from
    it, with the saved diagonal, when H is not positive definite and the dampening rises)."""
    from scipy.linalg import lapack

    n = h.shape[0]
    a = h.numpy().T  # Fortran order, the same memory
    potrf, potri = lapack.get_lapack_funcs(("potrf", "potri"), (a,))
    diag = h.diagonal().clone()
    mean_diag = float(diag.mean())
    damp = dampening
    for _ in range(5):
        h.diagonal().copy_(diag + damp * mean_diag)  # H + damp * mean(diag H) * I
        c, info = potrf(a, lower=1, overwrite_a=1, clean=0)
        if info == 0:
            c, info = potri(c, lower=1, overwrite_c=1)
            if info == 0:
                c, info = potrf(c, lower=1, overwrite_a=1, clean=1)
            if info != 0 or c.ctypes.data != a.ctypes.data:
                raise torch.linalg.LinAlgError(f"the inverse Hessian could not be factored in place (LAPACK info {info})")
            return h, damp  # row-major, the memory holds U with H^-1 = U^T U (upper; the rest zeroed)
        for i in range(0, n, HESSIAN_STRIP):  # restore the upper triangle from the untouched lower one:
            block = h[i : i + HESSIAN_STRIP, i : i + HESSIAN_STRIP]  # the diagonal blocks here,
            block.copy_(torch.tril(block, -1) + torch.tril(block, -1).t())
        mirror_upper(h.t())  # the rest as the lower triangle of the transpose
        damp *= 10
    raise torch.linalg.LinAlgError(f"Hessian is not positive definite even with dampening {damp / 10:g}")


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor | list[torch.Tensor],
    scheme: QuantScheme,
    dampening: float = 0.01,
    block_size: int = 128,
    act_order: bool = True,
    *,
    sub_block: int = 16,
    numpy_columns: bool = True,
    grid: Any = None,
) -> tuple[Any, dict[str, float]]:
    """Quantize ``weight`` [out, in] with GPTQ given its input Hessian [in, in]. A Hessian handed over
    in a one-element list (``[h]``) is taken out of it and overwritten, so no copy of it is kept
    (the stage's way: a down_proj Hessian is 321 MB); a bare tensor is left as it is.

    ``sub_block``: the columns whose rounding errors reach each other eagerly inside a block of
    ``block_size``, as in the two-level blocking of GPTQ's lazy batch updates. ``numpy_columns``: on
    CPU, run the column loop on NumPy views of the torch tensors (False: torch's own ops, which CUDA
    always uses). Both change speed, not the sums; scripts/experiments/gptq_columns.py times them.

    ``grid``: a grid of float values with its group scales fixed already (quantizers/fp4.py's ``FP4Grid``:
    ``GridParams``' attributes, ``nearest`` / ``nearest_numpy`` value rounding, ``record(values)``), which
    replaces the integer grid of ``scheme``; the result is its record."""
    box = hessian if isinstance(hessian, list) else [hessian.to(torch.float32).clone()]
    if isinstance(hessian, list) and box[0].dtype != torch.float32:
        box[0] = box[0].to(torch.float32)
    del hessian
    return _gptq(weight, box, scheme, dampening, block_size, act_order, sub_block, numpy_columns, grid)


def _gptq(
    weight: torch.Tensor,
    box: list[torch.Tensor],
    scheme: QuantScheme,
    dampening: float,
    block_size: int,
    act_order: bool,
    sub_block: int,
    numpy_columns: bool,
    grid: Any = None,
) -> tuple[Any, dict[str, float]]:
    w = weight.detach().to(torch.float32).clone()
    h = box.pop()
    out_f, in_f = w.shape
    scheme = scheme.for_width(in_f)
    g = scheme.group_width(in_f)
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    # Each unit's (group's; a K-quant super-block's) parameters are fixed to the values the record
    # (and a GGUF file) holds before any of its columns is rounded: the error feedback sees that grid.
    params = GridParams(out_f, in_f, scheme, w.device) if grid is None else grid
    unit = params.unit
    importance = torch.diag(h).clone()  # the columns' weight in each unit's range search (a GGUF grid's)
    if act_order:  # static groups from the original weights, then columns by decreasing diag(H)
        params.fix_all(w, importance)
        perm = torch.argsort(torch.diag(h), descending=True)
    else:
        perm = torch.arange(in_f, device=w.device)
    if act_order:
        w = w[:, perm]
        h = permute_symmetric_(h, perm.tolist())  # in place: a gather would be a second [in, in] matrix
    group_of = (perm // g).tolist()
    box.append(h)
    del h
    hinv, used_damp = _inverse_cholesky(box, dampening)

    # Transposed, a weight column is a contiguous row: the column loop's reads and writes stay in
    # cache lines of their own.
    wt = w.t().contiguous()
    del w
    codes_t = torch.empty(in_f, out_f, dtype=torch.float32, device=wt.device)
    loss = torch.zeros(out_f, dtype=torch.float32, device=wt.device)
    group_t = torch.tensor(group_of, device=wt.device)
    # The factorization above and each block's update below are large products that use every
    # thread; the column loop is thousands of tiny ops, which run on one CPU thread, in NumPy on CPU
    # (views of the same memory, the same float32 operations: bit for bit torch's result at a fraction
    # of its cost per call; scripts/experiments/gptq_columns.py).
    cpu = wt.device.type == "cpu"
    columns = one_cpu_thread if cpu else nullcontext
    ops = _NUMPY_OPS if cpu and numpy_columns else _TORCH_OPS
    if grid is not None:  # a float grid: q is the nearest of its values (no zero point, nothing to clamp)
        ops = ops._replace(round=grid.nearest_numpy if ops is _NUMPY_OPS else grid.nearest, clamp=lambda q, _hi: q)
    view, qmax = ops.view, float(params.scheme.qmax)
    wt_x, codes_x, hinv_x = view(wt), view(codes_t), view(hinv)
    err_buffer, diff_buffer = (torch.empty(min(block_size, in_f), out_f, device=wt.device) for _ in range(2))
    for i1 in range(0, in_f, block_size):
        i2 = min(i1 + block_size, in_f)
        w1, w1_x, hinv1 = wt[i1:i2], wt_x[i1:i2], hinv_x[i1:i2, i1:i2]
        err1, diff1 = err_buffer[: i2 - i1], diff_buffer[: i2 - i1]  # every row is written below
        err1_x, diff1_x = view(err1), view(diff1)
        # Within the block, each column's error goes eagerly only to the rest of its sub-block, and each
        # sub-block's to the block's later columns in one product: the same sums as updating every later
        # column of the block at once, at a fraction of the memory traffic. Without act_order each
        # unit starts a sub-block, so its parameters come from weights that hold every earlier update.
        starts = sorted({*range(0, i2 - i1, sub_block), *(c - i1 for c in range(-(-i1 // unit) * unit, i2, unit) if not act_order)})
        with columns():
            for a, b in zip(starts, [*starts[1:], i2 - i1], strict=True):
                col = i1 + a
                if not act_order and col % unit == 0:  # first column of a unit: params from the current weights
                    end = min(col + unit, in_f)  # (columns past this block have not had its updates yet)
                    params.fix(col // unit, wt[col:end].t(), importance[col:end])
                ks = group_t[col : i1 + b]  # the sub-block's parameters, gathered once, a column a row
                s, z, o = (p[:, ks].t().contiguous() for p in (params.scale, params.zero, params.offset))
                s_x, z_x, o_x, safe_x = view(s), view(z), view(o), view(nonzero_divisor(s))
                for i in range(a, b):
                    j = i - a
                    col_w = w1_x[i]
                    q = ops.clamp(ops.round((col_w - o_x[j]) / safe_x[j]) + z_x[j], qmax)
                    codes_x[i1 + i] = q  # (a zero scale's code becomes its zero point after the loop)
                    diff = col_w - ((q - z_x[j]) * s_x[j] + o_x[j])
                    err = diff / hinv1[i, i]
                    w1_x[i:b] -= ops.outer(hinv1[i, i:b], err)
                    err1_x[i], diff1_x[i] = err, diff
                w1[b:] -= hinv[i1 + a : i1 + b, i1 + b : i2].t() @ err1[a:b]
        loss += (diff1**2 / torch.diagonal(hinv[i1:i2, i1:i2]).unsqueeze(1) ** 2 / 2).sum(dim=0)
        wt[i2:] -= hinv[i1:i2, i2:].t() @ err1
    zero_scale = params.scale[:, group_t] == 0
    codes = torch.where(zero_scale, params.zero[:, group_t], codes_t.t())

    inverse = torch.argsort(perm)
    record = params.record(codes[:, inverse])
    return record, {"gptq_loss": float(loss.sum()), "dampening": used_damp}


class GPTQStage:
    """The recipe step ``quantize: {method: gptq, ...}``: layer-wise over the decoder blocks. A method on
    another grid overrides ``quantize_layer`` (quantizers/fp4.py)."""

    def __init__(
        self, config: GPTQConfig, label: str, *, sub_block: int = 16, numpy_columns: bool = True, hessian_strip: int = HESSIAN_STRIP
    ) -> None:
        self.config = config
        self.label = label
        self.sub_block = sub_block  # gptq_quantize's column-loop tunables (speed only)
        self.numpy_columns = numpy_columns
        self.hessian_strip = hessian_strip  # rows per strip of the shared Hessians' upper triangle (memory/speed only)

    def quantize_layer(
        self, model: torch.nn.Module, ctx: RunContext, name: str, module: torch.nn.Linear, box: list[torch.Tensor], scheme: QuantScheme
    ) -> dict[str, Any]:
        """Quantize layer ``name`` with its Hessian (in ``box``, emptied) and install its record; its summary."""
        record, info = self.solve(module.weight, box, scheme)
        return {**install_record(model, name, module, record, ctx, self.label), **{k: round(v, 6) for k, v in info.items()}}

    def solve(self, weight: torch.Tensor, box: list[torch.Tensor], scheme: QuantScheme, grid: Any = None) -> tuple[Any, dict[str, float]]:
        """``gptq_quantize`` with this stage's settings (``grid``: a float grid, see there)."""
        cfg = self.config
        return gptq_quantize(
            weight,
            box,
            scheme,
            cfg.dampening,
            cfg.block_size,
            cfg.act_order,
            sub_block=self.sub_block,
            numpy_columns=self.numpy_columns,
            grid=grid,
        )

    def apply(self, model: torch.nn.Module, ctx: RunContext) -> StageRecord:
        cfg = self.config
        if cfg.backend == "llmcompressor":
            from compress.quantizers.llmcompressor_backend import apply_llmcompressor

            return apply_llmcompressor(model, ctx, cfg, self.label)
        selected, _ = select_block_linears(model, cfg, self.label, "gptq", quantizes_head=True)
        columns = {name: int(module.in_features) for name, module in selected.items()}
        check_token_count(ctx.checks, int(ctx.calibration().numel()), columns, self.label, "gptq")
        scheme_of, mix = layer_schemes(model, ctx, cfg, selected, self.label)

        def process(job: BlockJob, arch: Architecture) -> None:
            hessians: dict[str, torch.Tensor] = {}
            counts = dict.fromkeys(job.linears, 0)
            # Linears fed the very same input tensor (q/k/v, gate/up) share one Hessian: the first
            # one's, seen in the first forward, which the others alias.
            alias: dict[str, str] = {}
            last: list = [None, None]  # the input tensor and the name of the last linear that took it

            def hook(name: str):
                def fn(_module, args, _output):
                    x = args[0]
                    if name in alias:
                        return
                    if name not in hessians:
                        if last[0] is x:
                            alias[name] = last[1]
                            return
                        hessians[name] = torch.zeros(x.shape[-1], x.shape[-1], device=ctx.device)
                    last[0], last[1] = x, name
                    counts[name] = accumulate_hessian(hessians[name], counts[name], x.detach(), upper_only=True, strip=self.hessian_strip)

                return fn

            handles = [m.register_forward_hook(hook(n)) for n, m in job.linears.items()]
            try:
                job.inputs.run(job.block, keep=False)
            finally:
                last.clear()
                for handle in handles:
                    handle.remove()
            for owner in hessians:  # (no loop variable left holding the last Hessian through its solve)
                mirror_upper(hessians[owner], self.hessian_strip)
            owners = {name: alias.get(name, name) for name in job.linears}
            # H = 2/n Σ x xᵀ: its diagonal is 2/n Σ x², llama.cpp's importance (once per input; q/k/v share it)
            sums = {owner: (input_square_sums(h, counts[owner]), counts[owner]) for owner, h in hessians.items()}
            ctx.input_sums.update({job.prefix + name: sums[owner] for name, owner in owners.items() if owner in sums})
            left = Counter(owners.values())
            for name, module in job.linears.items():
                owner = owners[name]
                left[owner] -= 1
                # Handed over in a list that gptq_quantize empties: no name here keeps it alive.
                if owner not in hessians:  # no calibration tokens reached it (an expert routing skipped)
                    box = [torch.zeros(module.in_features, module.in_features, device=ctx.device)]
                else:  # the last linear sharing a Hessian takes it, the others a copy
                    box = [hessians[owner].clone() if left[owner] else hessians.pop(owner)]
                full = job.prefix + name
                job.layer_info[full] = self.quantize_layer(model, ctx, full, module, box, scheme_of(full))

        extra = {"gguf_mix": mix} if mix else None
        return run_layerwise(model, ctx, cfg, self.label, "gptq", process, cfg.batch_size, extra, quantizes_head=True)
