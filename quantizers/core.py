"""Quantization core: the QuantizedWeight record and pure grouping math (the scheme, QuantScheme, is
torch-free in compress.schema.quantize).

Every weight quantizer (RTN here; GPTQ and AWQ later) produces `QuantizedWeight` records in
one convention, and every exporter packs those records into its own format without
re-quantizing. The convention:

* codes are unsigned integers in ``[0, 2**bits - 1]``, stored unpacked (one uint8 per weight);
* ``w ≈ (code - zero_point) * scale`` per group of ``group_size`` consecutive input features
  of one output row (``group_size=None`` means one group per row: per-channel);
* symmetric schemes use the fixed zero point ``2**(bits-1)`` and ``scale = 2*absmax/(2**bits-1)``
  (so 4-bit symmetric is exactly llama.cpp's Q4_0 layout); asymmetric schemes use an integer
  zero point per group and a range that includes 0 (Q4_1 with ``m = -scale * zero_point``);
* scales are rounded up to ``scale_dtype`` (float16 by default) before the codes are computed
  with them, so formats that store fp16 scales carry the record exactly;
* a row whose width is not a multiple of ``group_size`` ends in a shorter, partial group.

Records on a block-type grid (``scheme.gguf_type``, quantizers/grids.py; rounded by
quantizers/grid_search.py) add what that grid's encoding stores: ``offset``, a float minimum per
group (``w = (code - zero_point) * scale + offset``; q4_1 / q5_1's fp16 ``m``, a K-quant's
``-dmin * m``), and for K-quant grids ``super_blocks``: the fp16 super-block scales ``d``, ``dmin``
and the integer sub-block scales and mins, of which ``scale`` and ``offset`` are the float32
products. Formats that do not pack such grids refuse such records (``QuantizedWeight.plain``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from compress.fsutil import scratch_dir
from compress.schema.quantize import QuantScheme

__all__ = [
    "QuantizedWeight",
    "SuperBlocks",
    "compute_qparams",
    "group_rows",
    "pack_record",
    "quantize_codes",
    "round_scale",
    "scale_torch_dtype",
    "sqnr_db",
]

_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def scale_torch_dtype(scheme: QuantScheme) -> torch.dtype:
    """The torch dtype of ``scheme.scale_dtype`` (kept here: the scheme itself is torch-free)."""
    return _TORCH_DTYPES[scheme.scale_dtype]


@dataclass
class SuperBlocks:
    """A K-quant record's stored scales: per super-block of 256 weights the fp16 ``d`` and ``dmin``
    [out, n_super], per sub-block the integer scale and min [out, n_groups] (int16; scales may be
    negative where the type stores them signed)."""

    d: torch.Tensor
    dmin: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    def named(self) -> dict[str, torch.Tensor]:
        return {"d": self.d, "dmin": self.dmin, "scales": self.scales, "mins": self.mins}

    def map(self, fn) -> SuperBlocks:  # noqa: ANN001 - a tensor -> tensor function
        return SuperBlocks(**{k: fn(v) for k, v in self.named().items()})


@dataclass
class QuantizedWeight:
    """A quantized weight matrix: unpacked codes plus per-group scale and zero point.

    Shapes: ``codes`` [out, in] uint8; ``scale`` [out, n_groups] in ``scheme.scale_dtype``;
    ``zero_point`` [out, n_groups] uint8.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    scheme: QuantScheme
    offset: torch.Tensor | None = None  # [out, n_groups] float32: the float minimum (float-minimum grids only)
    super_blocks: SuperBlocks | None = None  # K-quant grids only

    @property
    def plain(self) -> bool:
        """The record is ``(code - zero_point) * scale`` per group with nothing else stored (every
        format can hold it); False for float minimums and K-quant scales (only formats that pack those grids)."""
        return self.offset is None and self.super_blocks is None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    def validate(self) -> None:
        """Raise ValueError when shapes, dtypes or value ranges break the convention."""
        s = self.scheme
        if self.codes.dim() != 2 or self.codes.dtype != torch.uint8:
            raise ValueError(f"codes must be a 2-D uint8 tensor, got {self.codes.dtype} {tuple(self.codes.shape)}")
        out_f, in_f = self.shape
        expect = (out_f, s.n_groups(in_f))
        for name, t in (("scale", self.scale), ("zero_point", self.zero_point)):
            if tuple(t.shape) != expect:
                raise ValueError(f"{name} must have shape {expect} for codes {self.shape} and {s.describe()}, got {tuple(t.shape)}")
        if self.scale.dtype != scale_torch_dtype(s):
            raise ValueError(f"scale dtype must be {s.scale_dtype}, got {self.scale.dtype}")
        if self.zero_point.dtype != torch.uint8:
            raise ValueError(f"zero_point must be uint8, got {self.zero_point.dtype}")
        if self.codes.numel() and int(self.codes.max()) > s.qmax:
            raise ValueError(f"codes exceed {s.qmax} for {s.bits}-bit scheme")
        if self.zero_point.numel() and int(self.zero_point.max()) > s.qmax:
            raise ValueError(f"zero points exceed {s.qmax} for {s.bits}-bit scheme")
        if s.symmetric and bool((self.zero_point != s.symmetric_zero).any()):
            raise ValueError(f"symmetric scheme requires every zero point to be {s.symmetric_zero}")
        self._validate_grid()

    def _validate_grid(self) -> None:
        grid = self.scheme.block_grid
        if grid is None or not grid.float_min:
            if self.offset is not None:
                raise ValueError(f"only float-minimum GGUF grids carry an offset, not {self.scheme.describe()}")
        else:
            if self.offset is None or tuple(self.offset.shape) != tuple(self.scale.shape) or self.offset.dtype != torch.float32:
                raise ValueError(f"{self.scheme.describe()} records need a float32 offset shaped like the scales")
            if bool((self.zero_point != 0).any()):
                raise ValueError(f"{self.scheme.describe()} records keep their minimum in offset; zero points must be 0")
        if grid is None or not grid.k_quant:
            if self.super_blocks is not None:
                raise ValueError(f"only K-quant grids carry super-block scales, not {self.scheme.describe()}")
            return
        out_f, in_f = self.shape
        sb = self.super_blocks
        if sb is None or in_f % grid.block_weights:
            raise ValueError(f"{self.scheme.describe()} records need super_blocks and rows a multiple of {grid.block_weights}")
        per = grid.block_weights // grid.group
        if tuple(sb.d.shape) != (out_f, in_f // grid.block_weights) or sb.d.dtype != torch.float16 or sb.dmin.shape != sb.d.shape:
            raise ValueError(f"super-block d/dmin must be float16 [{out_f}, {in_f // grid.block_weights}]")
        d = sb.d.to(torch.float32).repeat_interleave(per, dim=1)
        if not torch.equal(self.scale, d * sb.scales.to(torch.float32)):
            raise ValueError(f"{self.scheme.describe()}: scale must equal d x the sub-block scales")
        if grid.float_min and not torch.equal(
            self.offset, -(sb.dmin.to(torch.float32).repeat_interleave(per, dim=1) * sb.mins.to(torch.float32))
        ):
            raise ValueError(f"{self.scheme.describe()}: offset must equal -dmin x the sub-block mins")

    def map_rows(self, fn) -> QuantizedWeight:  # noqa: ANN001 - a tensor -> tensor function on the row axis
        """The record with ``fn`` applied to every per-row tensor (device moves, row permutations)."""
        return QuantizedWeight(
            fn(self.codes),
            fn(self.scale),
            fn(self.zero_point),
            self.scheme,
            None if self.offset is None else fn(self.offset),
            None if self.super_blocks is None else self.super_blocks.map(fn),
        )

    def cpu(self) -> QuantizedWeight:
        return self.map_rows(lambda t: t.cpu())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Return the float weight ``(codes - zero_point) * scale`` with shape [out, in]."""
        out_f, in_f = self.shape
        g = self.scheme.group_width(in_f)
        scale = self.scale.to(torch.float32).repeat_interleave(g, dim=1)[:, :in_f]
        zero = self.zero_point.to(torch.float32).repeat_interleave(g, dim=1)[:, :in_f]
        w = (self.codes.to(torch.float32) - zero) * scale
        if self.offset is not None:  # one float32 addition, as llama.cpp's d·q + m
            w = w + self.offset.repeat_interleave(g, dim=1)[:, :in_f]
        return w.to(dtype)

    @property
    def bits_per_weight(self) -> float:
        """Storage cost per weight, including scales (and zero points when asymmetric)."""
        out_f, in_f = self.shape
        if self.scheme.block_grid is not None:
            return self.scheme.block_grid.bits_per_weight
        scale_bits = torch.finfo(scale_torch_dtype(self.scheme)).bits
        overhead = scale_bits + (0 if self.scheme.symmetric else self.scheme.bits)
        return self.scheme.bits + overhead * self.scheme.n_groups(in_f) / in_f

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The record as named tensors for a safetensors file (scheme goes to the manifest)."""
        out = {
            f"{prefix}.weight_codes": self.codes.contiguous(),
            f"{prefix}.weight_scale": self.scale.contiguous(),
            f"{prefix}.weight_zero_point": self.zero_point.contiguous(),
        }
        if self.offset is not None:
            out[f"{prefix}.weight_offset"] = self.offset.contiguous()
        if self.super_blocks is not None:
            out.update({f"{prefix}.weight_super_{k}": v.contiguous() for k, v in self.super_blocks.named().items()})
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str, scheme: QuantScheme) -> QuantizedWeight:
        sb = {k: tensors.get(f"{prefix}.weight_super_{k}") for k in ("d", "dmin", "scales", "mins")}
        return cls(
            codes=tensors[f"{prefix}.weight_codes"],
            scale=tensors[f"{prefix}.weight_scale"],
            zero_point=tensors[f"{prefix}.weight_zero_point"],
            scheme=scheme,
            offset=tensors.get(f"{prefix}.weight_offset"),
            super_blocks=SuperBlocks(**sb) if sb["d"] is not None else None,
        )


# --------------------------------------------------------------------------- pure math


class RecordStore(MutableMapping):
    """Records by layer name, kept on disk (one safetensors file a layer in ``root``) rather than in
    memory: unpacked codes are a byte a weight, 1.3 GB for a 1.5B model's blocks. A record is read
    back when asked for; the folder is removed when the store is garbage-collected."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root
        self._dir: Path | None = None
        self._index: dict[str, tuple[Path, QuantScheme]] = {}
        self._count = 0

    def __setitem__(self, name: str, record: QuantizedWeight) -> None:
        from safetensors.torch import save_file

        if self._dir is None:
            self._dir = scratch_dir(self, self.root, "records-")
        path = self._dir / f"{self._count:06d}.safetensors"
        self._count += 1
        save_file(record.cpu().tensors("r"), str(path))
        self._index[name] = (path, record.scheme)

    def __getitem__(self, name: str) -> QuantizedWeight:
        from safetensors.torch import load_file

        path, scheme = self._index[name]
        return QuantizedWeight.from_tensors(load_file(str(path)), "r", scheme)

    def __delitem__(self, name: str) -> None:
        del self._index[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


def group_rows(weight: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """View ``weight`` [out, in] as [out, n_groups, group] in float32, zero-padding a partial last group.

    Zero padding is neutral for the statistics below because every group's range includes 0.
    """
    out_f, in_f = weight.shape
    g = scheme.group_width(in_f)
    n = scheme.n_groups(in_f)
    w = weight.detach().to(torch.float32)
    pad = n * g - in_f
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    return w.reshape(out_f, n, g)


def compute_qparams(groups: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point for each group of ``groups`` [..., group] (min/max, range includes 0).

    Returns ``scale`` (float32 holding values exactly representable in ``scheme.scale_dtype``)
    and ``zero_point`` (float32 holding integers in [0, qmax]), both shaped ``groups.shape[:-1]``.
    """
    qmax = scheme.qmax
    if scheme.symmetric:
        # All 2**bits levels: [-absmax, absmax] maps onto [-(qmax/2), qmax/2] around the fixed
        # zero point 2**(bits-1) (the GPTQ convention); the top code absorbs +absmax within half a step.
        absmax = groups.abs().amax(dim=-1)
        scale = 2 * absmax / qmax
        zero = torch.full_like(scale, float(scheme.symmetric_zero))
    else:
        lo = groups.amin(dim=-1).clamp(max=0.0)
        hi = groups.amax(dim=-1).clamp(min=0.0)
        scale = (hi - lo) / qmax
    scale = round_scale(scale, scheme)
    if not scheme.symmetric:
        zero = torch.clamp(torch.round(-lo / scale), 0, qmax)
    return scale, zero


def round_scale(scale: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Round scales up to the storage dtype (never shrinking the range the grid covers);
    zero scales (all-zero groups) become the smallest normal number."""
    dtype = scale_torch_dtype(scheme)
    scale = scale.clamp(min=torch.finfo(dtype).tiny)
    stored = scale.to(dtype)
    below = stored.to(torch.float32) < scale
    stored = torch.where(below, torch.nextafter(stored, torch.full_like(stored, float("inf"))), stored)
    return stored.to(torch.float32)


def quantize_codes(groups: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Round-to-nearest codes for ``groups`` [..., group] given per-group ``scale`` and ``zero``."""
    q = torch.round(groups / scale.unsqueeze(-1)) + zero.unsqueeze(-1)
    return q.clamp_(0, scheme.qmax)


def pack_record(
    codes_grouped: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, in_features: int, scheme: QuantScheme
) -> QuantizedWeight:
    """Build a QuantizedWeight from grouped float codes [out, n_groups, group] and per-group params."""
    out_f = codes_grouped.shape[0]
    codes = codes_grouped.reshape(out_f, -1)[:, :in_features].to(torch.uint8)
    return QuantizedWeight(
        codes=codes.contiguous(),
        scale=scale.to(scale_torch_dtype(scheme)).contiguous(),
        zero_point=zero.to(torch.uint8).contiguous(),
        scheme=scheme,
    )


def refuse_gguf_grids(records: Mapping[str, QuantizedWeight], fmt: str) -> None:
    """Raise FormatError when a record carries what only GGUF stores (a float minimum, K-quant scales)."""
    from compress.errors import FormatError

    bad = sorted(n for n, r in records.items() if not r.plain)
    if bad:
        scheme = records[bad[0]].scheme.describe()
        raise FormatError(
            f"{fmt} export: {len(bad)} layer(s) ({', '.join(bad[:3])}) are quantized on llama.cpp's {scheme}, whose float "
            f"minimums / quantized sub-block scales only GGUF stores; export them as gguf, or quantize without gguf_type "
            f"(or with gguf_type q4_0 / q5_0 / q8_0, which are plain symmetric grids) for {fmt}"
        )


SQNR_CHUNK = 2**20
"""Values summed in float64 at a time by ``sqnr_db``: a whole 1536 x 8960 weight in float64 is 110 MB
a copy, and the difference and its square would make two more (they set the GPTQ stage's peak on
the 1.5B model)."""


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (inf when exact), summed in float64 a chunk at a time."""
    ref, app = reference.detach().reshape(-1), approx.detach().reshape(-1)
    signal = noise = 0.0
    for start in range(0, ref.numel(), SQNR_CHUNK):
        r = ref[start : start + SQNR_CHUNK].to(torch.float64)
        noise += float((r - app[start : start + SQNR_CHUNK].to(torch.float64)).pow(2).sum())
        signal += float(r.pow(2).sum())
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


@contextmanager
def one_cpu_thread() -> Iterator[None]:
    """The column loop is thousands of tiny ops: extra CPU threads only add synchronization
    (scripts/experiments/gptq_threads.py times it)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


FP8_MAX = 448.0  # largest finite float8_e4m3fn (torch.finfo(torch.float8_e4m3fn).max)
