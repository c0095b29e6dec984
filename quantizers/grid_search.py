"""Quantization parameters on a llama.cpp block type's own grid (``scheme.gguf_type``): pure math
shared by RTN and GPTQ, so the values a quantizer rounds to are the values the GGUF file will hold.

The unit of parameters is the block whose scales are fixed together: a group for our plain schemes
and the legacy types (32 weights), a super-block of 256 weights for K-quants (its fp16 ``d`` and
``dmin`` depend on all its sub-blocks). ``GridParams.fix(u, weights)`` sets unit ``u`` from the
weights it covers: GPTQ calls it when its column loop reaches the unit (or up front with act-order),
RTN for every unit at once; both then round each weight to ``(code - zero) * scale + offset``.

Per type, the parameters a range gives (the stored values are exactly what llama.cpp reads):

* plain schemes and Q4_0 / Q5_0 / Q8_0: ``compute_qparams`` (core.py), as before;
* Q4_1 / Q5_1: ``m`` = the group's minimum rounded down to fp16, ``d`` = (max - m) / qmax rounded up;
* Q2_K / Q4_K / Q5_K: per sub-block the range [min(w, 0), max(w)]; ``d`` = the largest sub-block
  step / scale_levels and ``dmin`` = the largest -min / scale_levels, rounded up to fp16; integer
  sub-block scale and min = nearest multiple of ``d`` / ``dmin``;
* Q3_K / Q6_K: per sub-block the scale that maps the largest-magnitude weight onto the lowest
  code (-2**(bits-1), the grid's one extra level: llama.cpp's choice too), signed; ``d`` = the
  largest |scale| / scale_levels rounded up to fp16, integer sub-block scale = nearest multiple.

``fix`` tries each row's range at several shares (``CLIP``), refits each try's parameters to the codes
they give by (importance-weighted) least squares, and keeps per row the one with the smallest error.
K-quants also get each sub-block's own step search (``SUB_STEPS``, llama.cpp's way), whose nearest-fp16
``d`` / ``dmin`` find a source K-quant grid again (a model distributed as Q4_K_M).
"""

from __future__ import annotations

import torch

from compress.quantizers.core import QuantizedWeight, SuperBlocks, compute_qparams, scale_torch_dtype
from compress.schema.quantize import QuantScheme


def unit_width(scheme: QuantScheme, in_features: int) -> int:
    """Columns whose parameters are fixed together (a K-quant super-block, else a group)."""
    grid = scheme.block_grid
    return grid.block_weights if grid is not None and grid.k_quant else scheme.group_width(in_features)


def f16_up(x: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 value >= ``x`` (x >= 0; fp16 subnormals kept, as llama.cpp stores them), as float32."""
    stored = x.to(torch.float16)
    below = stored.to(torch.float32) < x
    stored = torch.where(below, torch.nextafter(stored, torch.full_like(stored, float("inf"))), stored)
    return stored.to(torch.float32)


def f16_down(x: torch.Tensor) -> torch.Tensor:
    """The largest fp16 value <= ``x``, as float32."""
    stored = x.to(torch.float16)
    above = stored.to(torch.float32) > x
    stored = torch.where(above, torch.nextafter(stored, torch.full_like(stored, float("-inf"))), stored)
    return stored.to(torch.float32)


CLIP = (1.0, 0.93, 0.86, 1.0333, 1.0667)
"""Each row's range is tried at these shares per unit on a GGUF grid (GridParams.fix), and each try
refit by least squares: a shrunk range rounds a few outliers coarsely for a finer step everywhere else;
a slightly widened one leaves the top code unused, which puts a coarser source grid's step within the
refit's reach (a Q4_1 grid in a Q5_1 block has 1/30 of the block's range as its step, not 1/31).
scripts/experiments/grid_refit.py measured this set against eight shrunk ranges with and without the refit."""


SUB_STEPS = (-1.0, -0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 0.75, 1.0)
"""The K-quant sub-block step search (GridParams._search_sub): each sub-block's range is divided into
qmax + f steps for each f here (the types with a minimum), or its largest-magnitude weight put f
beyond the lowest code (the signed ones), as llama.cpp's K-quant quantizers search (21 and 19 tries
of 0.1 there); empty turns the search off."""


def nonzero_divisor(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its zeros replaced by ones: a divisor for scales where a zero scale stores all-zero weights."""
    return torch.where(x == 0, torch.ones_like(x), x)


REFIT_ROUNDS = 1
"""Least-squares refits of each range's parameters, and of the best of them, in GridParams.fix: each
fits the stored scales (and minimums) to the codes the current ones give (a K-quant's sub-blocks, then
its super-block ``d`` / ``dmin``) and keeps, per row, whichever rounds the weights with the smaller
error, as llama.cpp's own quantizer refits each block (``make_qkx``); 0 turns refitting off."""


def _extreme(x: torch.Tensor) -> torch.Tensor:
    """Along the last dimension, the value of largest magnitude (with its sign)."""
    return x.gather(-1, x.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)


def _f16(x: torch.Tensor) -> torch.Tensor:
    """The nearest fp16 value (as float32): what a least-squares ``d`` or minimum is stored as."""
    return x.clamp(-65504.0, 65504.0).to(torch.float16).to(torch.float32)


def _solve1(a: torch.Tensor, x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """argmin_s Σ w (s·a - x)² over the last dim (non-finite where every ``a`` is 0)."""
    wa = a if w is None else a * w
    return (wa * x).sum(dim=-1) / (wa * a).sum(dim=-1)


def _solve2(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, w: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """argmin_(s, t) Σ w (s·a + t·b - x)² over the last dim (non-finite where it is singular)."""
    wa, wb = (a, b) if w is None else (a * w, b * w)
    saa, sab, sbb = (wa * a).sum(dim=-1), (wa * b).sum(dim=-1), (wb * b).sum(dim=-1)
    sax, sbx = (wa * x).sum(dim=-1), (wb * x).sum(dim=-1)
    det = saa * sbb - sab * sab
    det = torch.where(det.abs() > 1e-12 * (saa * sbb).abs(), det, torch.zeros_like(det))
    return (sbb * sax - sab * sbx) / det, (saa * sbx - sab * sax) / det


class _Best:
    """Per row, the parameters of unit ``u`` whose rounding of ``x`` has had the smallest (weighted)
    squared error among those offered, and the codes they give."""

    def __init__(self, params: GridParams, u: int, groups: slice, x: torch.Tensor, k: torch.Tensor, w: torch.Tensor | None) -> None:
        self.params, self.u, self.groups, self.x, self.k, self.w = params, u, groups, x, k, w
        self.err: torch.Tensor | None = None
        self.kept: list[torch.Tensor] = []
        self.codes = torch.empty(0)

    def offer(self) -> torch.Tensor:
        """Score the unit's current parameters (kept per row where better); returns the codes they give."""
        codes, values = self.params.round(self.x, self.k)
        err = (values - self.x).square_()
        err = (err if self.w is None else err * self.w).sum(dim=-1)
        now = self.params._unit_params(self.u, self.groups)
        if self.err is None:
            self.err, self.kept, self.codes = err, now, codes
            return codes
        better = (err < self.err).unsqueeze(1)
        self.err = torch.minimum(err, self.err)
        self.kept = [torch.where(better, new, old) for new, old in zip(now, self.kept, strict=True)]
        self.codes = torch.where(better, codes, self.codes)
        return codes

    def restore(self) -> None:
        """Write the kept parameters back into the unit."""
        for target, value in zip(self.params._unit_params(self.u, self.groups, views=True), self.kept, strict=True):
            target.copy_(value)


class FixedScales:
    """A float grid's parameters for quantizers/gptq.py's column loop (``gptq_quantize``'s ``grid``: fp8, fp4), its
    scales fixed from the original weight before any column is rounded: ``GridParams``' attributes (``unit``, the
    columns one scale spans; the effective ``scale`` [out, in/unit], zero ``zero`` and ``offset``) with nothing to
    fix per unit. A subclass adds ``scheme``, value rounding (``nearest``, ``nearest_numpy``) and ``record``."""

    def __init__(self, scale: torch.Tensor, unit: int) -> None:
        self.scale, self.unit = scale, unit
        self.zero = torch.zeros_like(scale)
        self.offset = torch.zeros_like(scale)

    def fix_all(self, w: torch.Tensor, importance: torch.Tensor) -> None:
        """Nothing to do: the scales were fixed from the original weight."""

    def fix(self, index: int, w: torch.Tensor, importance: torch.Tensor) -> None:
        """Nothing to do: the scales were fixed from the original weight."""


class GridParams:
    """Every group's scale, zero point and offset of one weight [out, in], filled unit by unit."""

    def __init__(self, out_f: int, in_f: int, scheme: QuantScheme, device: torch.device, search: bool = True) -> None:
        self.scheme, self.in_f, self.search = scheme, in_f, search
        self.grid = scheme.block_grid
        self.unit = unit_width(scheme, in_f)
        self.per_unit = self.unit // scheme.group_width(in_f) if self.grid is not None and self.grid.k_quant else 1
        n = scheme.n_groups(in_f)
        self.scale = torch.zeros(out_f, n, dtype=torch.float32, device=device)
        self.zero = torch.zeros_like(self.scale)
        self.offset = torch.zeros_like(self.scale)
        self.k_quant = self.grid is not None and self.grid.k_quant
        if self.k_quant:
            units = in_f // self.unit
            self.d = torch.zeros(out_f, units, dtype=torch.float32, device=device)
            self.dmin = torch.zeros_like(self.d)
            self.sub_scales = torch.zeros_like(self.scale)
            self.sub_mins = torch.zeros_like(self.scale)

    @property
    def n_units(self) -> int:
        return -(-self.in_f // self.unit)

    def fix(self, u: int, weights: torch.Tensor, importance: torch.Tensor | None = None) -> None:
        """Set unit ``u``'s parameters from ``weights`` [out, columns of unit u] (``importance``: [columns]
        or [out, columns]). On a GGUF type's grid, each row's range is also tried shrunk and widened
        (``CLIP``), each try's parameters are refit to the codes they give by least squares
        (``REFIT_ROUNDS``), and per row the parameters whose rounding of the weights has the smallest
        squared error (weighted by ``importance``, e.g. GPTQ's Hessian diagonal) are kept; plain
        schemes keep the min/max range."""
        if self.grid is None or not self.search:
            self._fix_range(u, weights)
            return
        groups = slice(u * self.per_unit, (u + 1) * self.per_unit)
        start = u * self.unit
        k = torch.arange(start, start + weights.shape[1], device=weights.device) // self.scheme.group_width(self.in_f)
        kept = _Best(self, u, groups, weights, k, importance)
        refit = self._refit_sub if self.k_quant else self._refit_legacy
        for c in CLIP:
            self._fix_range(u, weights if c == 1.0 else weights * c)
            codes = kept.offer()
            for _ in range(REFIT_ROUNDS):
                refit(u, groups, weights, k, importance, codes)
                codes = kept.offer()
        if self.k_quant and SUB_STEPS:  # each sub-block's own step search, refit as the ranges are
            self._search_sub(u, groups, weights, importance)
            codes = kept.offer()
            for _ in range(REFIT_ROUNDS):
                self._refit_super(u, groups, weights, k, importance, codes)
                codes = kept.offer()
        kept.restore()
        for _ in range(REFIT_ROUNDS):  # once more from the best of all
            refit(u, groups, weights, k, importance, kept.codes)
            kept.offer()
            kept.restore()

    def _refit_legacy(self, u: int, groups: slice, x: torch.Tensor, k: torch.Tensor, w: torch.Tensor | None, q: torch.Tensor) -> None:
        """A legacy block's fp16 ``d`` (and Q4_1 / Q5_1's float minimum) by weighted least squares
        on the codes ``q`` the current parameters give (one group per unit)."""
        e = q - self.zero[:, k]
        if self.grid.float_min:
            d, m = _solve2(e, torch.ones_like(e), x, w)
            self.offset[:, u] = torch.where(torch.isfinite(m), _f16(m), self.offset[:, u])
        else:
            d = _solve1(e, x, w)
        self.scale[:, u] = torch.where(torch.isfinite(d), _f16(d.clamp(min=0)), self.scale[:, u])

    def _refit_super(self, u: int, groups: slice, x: torch.Tensor, k: torch.Tensor, w: torch.Tensor | None, q: torch.Tensor) -> None:
        """A K-quant super-block's fp16 ``d`` (and ``dmin``) by weighted least squares on the codes ``q``
        and integer sub-block scales (and mins) the current parameters give."""
        a = (q - self.zero[:, k]) * self.sub_scales[:, k]
        if self.grid.float_min:
            d, dmin = _solve2(a, -self.sub_mins[:, k], x, w)
            dmin = torch.where(torch.isfinite(dmin), _f16(dmin.clamp(min=0)), self.dmin[:, u])
        else:
            d, dmin = _solve1(a, x, w), self.dmin[:, u]
        d = torch.where(torch.isfinite(d), _f16(d if self.grid.signed_scales else d.clamp(min=0)), self.d[:, u])
        self._set_k(u, groups, d, dmin, self.sub_scales[:, groups], self.sub_mins[:, groups])

    def _refit_sub(self, u: int, groups: slice, x: torch.Tensor, k: torch.Tensor, w: torch.Tensor | None, q: torch.Tensor) -> None:
        """Each sub-block's float scale (and minimum) by weighted least squares on its codes ``q`` (those
        the current parameters give), then the super-block's ``d`` / ``dmin`` and integer sub-block
        values from them, as ``_fix_k`` does from a range, and the super-block refit on the codes those give."""
        out_f, n = x.shape[0], self.per_unit
        e = (q - self.zero[:, k]).reshape(out_f, n, -1)
        xs = x.reshape(out_f, n, -1)
        ws = None if w is None else w.reshape(*w.shape[:-1], n, -1)
        if self.grid.float_min:  # x = s·q - m with s >= 0, m >= 0
            s, o = _solve2(e, torch.ones_like(e), xs, ws)
            s, m = s.clamp(min=0), (-o).clamp(min=0)
            ok = torch.isfinite(s) & torch.isfinite(m)
            s = torch.where(ok, s, self.scale[:, groups])
            m = torch.where(ok, m, -self.offset[:, groups])
        else:  # x = s·(q - z), s signed
            s = _solve1(e, xs, ws)
            s = torch.where(torch.isfinite(s), s, self.scale[:, groups])
            m = None
        self._set_sub(u, groups, s, m, llama_rule=False)
        self._refit_super(u, groups, x, k, w, self.round(x, k)[0])

    def _set_sub(self, u: int, groups: slice, s: torch.Tensor, m: torch.Tensor | None, llama_rule: bool) -> None:
        """Unit ``u``'s super-block ``d`` (and ``dmin``) and integer sub-block scales (and mins) from
        float sub-block scales ``s`` [out, sub-blocks] (and mins ``m`` >= 0): ``d`` = the largest
        magnitude / scale_levels rounded up to fp16, each integer the nearest multiple. ``llama_rule``:
        llama.cpp's instead, ``d`` the nearest fp16, and signed scales' ``d`` = -(the largest-magnitude
        scale) / (scale_levels + 1), so that scale is stored as -(scale_levels + 1)."""
        levels = float(self.grid.scale_levels)
        to_f16 = _f16 if llama_rule else f16_up
        if m is not None:
            d, dmin = to_f16(s.amax(dim=-1) / levels), to_f16(m.amax(dim=-1) / levels)
            sc = torch.round(s / nonzero_divisor(d).unsqueeze(1)).clamp(0, levels)
            mn = torch.round(m / nonzero_divisor(dmin).unsqueeze(1)).clamp(0, levels)
        elif not llama_rule:
            d, dmin = to_f16(s.abs().amax(dim=-1) / levels), self.dmin[:, u]
            sc = torch.round(s / nonzero_divisor(d).unsqueeze(1)).clamp(-levels, levels)
            mn = self.sub_mins[:, groups]
        else:  # llama.cpp's signed rule: the largest-magnitude scale on the one extra level, -(levels + 1)
            d, dmin = to_f16(-_extreme(s) / (levels + 1)), self.dmin[:, u]
            sc = torch.round(s / nonzero_divisor(d).unsqueeze(1)).clamp(-levels - 1, levels)
            mn = self.sub_mins[:, groups]
        self._set_k(u, groups, d, dmin, sc, mn)

    def _search_sub(self, u: int, groups: slice, x: torch.Tensor, w: torch.Tensor | None) -> None:
        """Each sub-block's own float scale (and minimum) from a search over steps near its range's,
        each refit by least squares to the codes it gives, the best per sub-block kept (llama.cpp's
        ``make_qkx2_quants`` / ``make_qx_quants``); then ``d`` / ``dmin`` and the integer sub-block
        values from them, ``d`` the nearest fp16. A sub-block that sits on a source K-quant grid gets
        its exact codes at one of the steps, so its scale (and minimum) come back exactly, and the
        largest of them (the source's sub-block scale of scale_levels) gives the source's ``d``."""
        out_f, n, qmax = x.shape[0], self.per_unit, float(self.scheme.qmax)
        xs = x.reshape(out_f, n, -1)
        ws = None if w is None else w.reshape(*w.shape[:-1], n, -1).expand_as(xs)
        if self.grid.float_min:  # x = s·q - m, s >= 0, m >= 0; steps (max - min) / (qmax ± 1)
            lo = xs.amin(dim=-1, keepdim=True).clamp(max=0.0)
            span = xs.amax(dim=-1, keepdim=True) - lo

            def fit(f: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                q = torch.round((xs - lo) * ((qmax + f) / nonzero_divisor(span))).clamp(0, qmax)
                s, o = _solve2(q, torch.ones_like(q), xs, ws)
                s, m = s.clamp(min=0), (-o).clamp(min=0)
                q = torch.round((xs + m.unsqueeze(-1)) / nonzero_divisor(s).unsqueeze(-1)).clamp(0, qmax)
                return s, m, s.unsqueeze(-1) * q - m.unsqueeze(-1)

        else:  # x = s·(q - half), s signed; the extreme weight near the lowest code
            half = float(self.scheme.symmetric_zero)
            extreme = _extreme(xs).unsqueeze(-1)

            def fit(f: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                q = (torch.round(xs * (-(half + f) / nonzero_divisor(extreme))) + half).clamp(0, qmax)
                s = _solve1(q - half, xs, ws)
                q = (torch.round(xs / nonzero_divisor(s).unsqueeze(-1)) + half).clamp(0, qmax)
                return s, torch.zeros_like(s), s.unsqueeze(-1) * (q - half)

        best_err = torch.full(xs.shape[:-1], float("inf"), device=x.device)
        best_s, best_m = torch.zeros_like(best_err), torch.zeros_like(best_err)
        for f in SUB_STEPS:
            s, m, values = fit(f)
            err = (values - xs).square_()
            err = (err if ws is None else err * ws).sum(dim=-1)
            better = torch.isfinite(s) & torch.isfinite(m) & (err < best_err)
            best_err = torch.where(better, err, best_err)
            best_s, best_m = torch.where(better, s, best_s), torch.where(better, m, best_m)
        self._set_sub(u, groups, best_s, best_m if self.grid.float_min else None, llama_rule=True)

    def _set_k(self, u: int, groups: slice, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor) -> None:
        self.d[:, u], self.dmin[:, u] = d, dmin
        self.sub_scales[:, groups], self.sub_mins[:, groups] = sc, mn
        self.scale[:, groups] = d.unsqueeze(1) * sc
        if self.grid.float_min:
            self.offset[:, groups] = -(dmin.unsqueeze(1) * mn)

    def _unit_params(self, u: int, groups: slice, views: bool = False) -> list[torch.Tensor]:
        """Every stored parameter of unit ``u`` (views into this object's tensors, or copies)."""
        found = [self.scale[:, groups], self.zero[:, groups], self.offset[:, groups]]
        if self.k_quant:
            found += [self.d[:, u : u + 1], self.dmin[:, u : u + 1], self.sub_scales[:, groups], self.sub_mins[:, groups]]
        return found if views else [t.clone() for t in found]

    def _fix_range(self, u: int, weights: torch.Tensor) -> None:
        """Unit ``u``'s parameters from the min/max range of ``weights``."""
        groups = slice(u * self.per_unit, (u + 1) * self.per_unit)
        grid = self.grid
        if grid is None or (grid.symmetric and not grid.k_quant):
            self.scale[:, groups], self.zero[:, groups] = (t.unsqueeze(1) for t in compute_qparams(weights, self.scheme))
        elif not grid.k_quant:  # Q4_1 / Q5_1: fp16 d and float minimum m
            m = f16_down(weights.amin(dim=-1))
            self.offset[:, u] = m
            self.scale[:, u] = f16_up((weights.amax(dim=-1) - m).clamp(min=0) / self.scheme.qmax)
        else:
            self._fix_k(u, groups, weights.reshape(weights.shape[0], self.per_unit, -1))

    def _fix_k(self, u: int, groups: slice, sub: torch.Tensor) -> None:
        grid, levels = self.grid, float(self.grid.scale_levels)
        if grid.symmetric:  # Q3_K, Q6_K: signed sub-block scales, the extreme weight on the lowest code
            half = float(self.scheme.symmetric_zero)
            want = -_extreme(sub) / half
            d = f16_up(want.abs().amax(dim=-1) / levels)
            sc = torch.round(want / nonzero_divisor(d).unsqueeze(1)).clamp(-levels, levels)
            self.zero[:, groups] = half
            self._set_k(u, groups, d, self.dmin[:, u], sc, self.sub_mins[:, groups])
        else:  # Q2_K, Q4_K, Q5_K: unsigned sub-block scales and mins, w = d·sc·q - dmin·m
            lo = sub.amin(dim=-1).clamp(max=0.0)
            step = (sub.amax(dim=-1) - lo).clamp(min=0.0) / self.scheme.qmax
            d = f16_up(step.amax(dim=-1) / levels)
            dmin = f16_up((-lo).amax(dim=-1) / levels)
            sc = torch.round(step / nonzero_divisor(d).unsqueeze(1)).clamp(0, levels)
            mn = torch.round(-lo / nonzero_divisor(dmin).unsqueeze(1)).clamp(0, levels)
            self._set_k(u, groups, d, dmin, sc, mn)

    def fix_all(self, weight: torch.Tensor, importance: torch.Tensor | None = None) -> None:
        """Every unit's parameters from ``weight`` [out, in] (``importance`` [in], as in ``fix``). On a
        GGUF grid the units are independent, so they are searched at once: each unit of each row is a
        row of one [out x units, unit] problem (a loop over units costs far more in small operations)."""
        n, out_f = self.n_units, weight.shape[0]
        if self.grid is None or self.in_f % self.unit or n == 1:
            for u in range(n):
                cols = slice(u * self.unit, (u + 1) * self.unit)
                self.fix(u, weight[:, cols], None if importance is None else importance[cols])
            return
        flat = GridParams(out_f * n, self.unit, self.scheme, weight.device, self.search)
        if importance is not None:
            importance = importance.reshape(1, n, self.unit).expand(out_f, n, self.unit).reshape(out_f * n, self.unit)
        flat.fix(0, weight.reshape(out_f * n, self.unit), importance)
        names = ["scale", "zero", "offset"] + (["d", "dmin", "sub_scales", "sub_mins"] if self.k_quant else [])
        for name in names:
            getattr(self, name).copy_(getattr(flat, name).reshape(out_f, -1))

    def round(self, w: torch.Tensor, k: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes and dequantized values of ``w``: a column [out] in group ``k``, or columns [out, cols]
        in the groups ``k`` [cols]."""
        s, z, o = self.scale[:, k], self.zero[:, k], self.offset[:, k]
        q = torch.clamp(torch.round((w - o) / nonzero_divisor(s)) + z, 0, self.scheme.qmax)
        q = torch.where(s == 0, z.expand_as(q), q)
        return q, (q - z) * s + o

    def record(self, codes: torch.Tensor) -> QuantizedWeight:
        """The record of ``codes`` [out, in] (float holding integers) with these parameters."""
        scheme, grid = self.scheme, self.grid
        offset = self.offset.contiguous() if grid is not None and grid.float_min else None
        super_blocks = None
        if self.k_quant:
            super_blocks = SuperBlocks(
                self.d.to(torch.float16), self.dmin.to(torch.float16), self.sub_scales.to(torch.int16), self.sub_mins.to(torch.int16)
            )
        return QuantizedWeight(
            codes=codes.to(torch.uint8).contiguous(),
            scale=self.scale.to(scale_torch_dtype(scheme)).contiguous(),
            zero_point=self.zero.to(torch.uint8).contiguous(),
            scheme=scheme,
            offset=offset,
            super_blocks=super_blocks,
        )


def grid_quantize(weight: torch.Tensor, scheme: QuantScheme, search: bool = True) -> QuantizedWeight:
    """Round-to-nearest of ``weight`` [out, in] on ``scheme``'s grid (its fallback's where the row
    does not hold the type's blocks); ``search=False``: each unit's plain min/max range, not the best
    of the shrunk ones (CLIP)."""
    w = weight.detach().to(torch.float32)
    scheme = scheme.for_width(w.shape[1])
    params = GridParams(w.shape[0], w.shape[1], scheme, w.device, search)
    params.fix_all(w)
    group_of = torch.arange(w.shape[1], device=w.device) // scheme.group_width(w.shape[1])
    return params.record(params.round(w, group_of)[0])
