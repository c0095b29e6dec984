"""Block-type grids: the one table of the grids our quantizers put codes on (torch-free), each by its
levels, block size and parameter encoding. A grid is a quantizer concept; an export that stores it
maps it to its own type id and packs it (export/gguf/ maps these to ggml's types).

Grids are named by the llama.cpp block type they match (``q4_k``), since that is what recipes write
(``gguf_type``); recipes may write llama.cpp's spelling (``Q4_K``), see :func:`normalize_type`. The
encodings (ggml-quants.h):

* blocks of 32 weights, an fp16 scale ``d`` each: q4_0 / q5_0 / q8_0 ``w = d·(q - z)`` with the
  fixed zero 8 / 16 / 0 (our symmetric convention); q4_1 / q5_1 ``w = d·q + m`` with an fp16 float
  minimum ``m``;
* super-blocks of 256 weights with an fp16 ``d`` (and ``dmin``) and quantized sub-block scales:
  q2_k (16 x 16, 4-bit scale and min), q3_k (16 x 16, 6-bit signed scale, ``w = d·s·(q - 4)``),
  q4_k / q5_k (8 x 32, 6-bit scale and min, ``w = d·s·q - dmin·m``), q6_k (16 x 16, 8-bit signed
  scale, ``w = d·s·(q - 32)``).

A row whose width is not a multiple of 256 cannot hold super-blocks; it is quantized on the grid
in ``fallback`` (llama.cpp's ``llama_tensor_get_type``: q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0;
q2_k and q3_k -> IQ4_NL there, a non-linear grid we do not quantize to, so ours fall back to q4_0,
the same 4.5 bits per weight, and the manifest says so).
"""

from __future__ import annotations

from dataclasses import dataclass

SUPER_BLOCK = 256  # weights per super-block (the K-quant grids)
FP16_BITS = 16  # a block's (or super-block's) stored scale d and float minimum are fp16


@dataclass(frozen=True)
class Grid:
    """One block-type grid: its levels, block size and how its parameters are encoded."""

    name: str  # the grid's name: llama.cpp's lower-case block type name
    bits: int  # bits per weight code
    group: int  # weights sharing one scale (the block, or a super-block's sub-block)
    symmetric: bool  # fixed zero point 2**(bits-1) and no minimum; else w = scale·q + min
    block_weights: int  # weights per block whose parameters are stored together (32, or a super-block)
    scale_bits: int = 0  # super-block grids: bits of each quantized sub-block scale (and of each min)
    signed_scales: bool = False  # super-block grids: sub-block scales may be negative (q3_k, q6_k)
    fallback: str | None = None  # the grid for rows that are not a multiple of block_weights
    fallback_note: str = ""  # where ours differs from llama.cpp's fallback

    @property
    def k_quant(self) -> bool:
        """Parameters in super-blocks: fp16 ``d`` (and ``dmin``) times integer sub-block scales (and mins)."""
        return self.block_weights == SUPER_BLOCK

    @property
    def float_min(self) -> bool:
        """w = scale·q + min with a float min per group (q4_1, q5_1, q2_k, q4_k, q5_k)."""
        return not self.symmetric

    @property
    def scale_levels(self) -> int:
        """Super-block grids: the largest quantized sub-block scale (and min) magnitude (0 otherwise)."""
        return 2 ** (self.scale_bits - self.signed_scales) - 1 if self.scale_bits else 0

    @property
    def scale_dtype(self) -> str:
        """How a record holds its scales: fp16 for 32-weight blocks (stored as they are), float32 for
        super-blocks (fp16 ``d`` times an integer sub-block scale, exact in float32)."""
        return "float32" if self.k_quant else "float16"

    @property
    def block_bits(self) -> int:
        """Bits one block stores: its codes, its fp16 ``d`` (and float minimum), and for super-blocks
        each sub-block's quantized scale (and min)."""
        params = FP16_BITS * (2 if self.float_min else 1)
        if self.k_quant:
            params += (self.block_weights // self.group) * self.scale_bits * (2 if self.float_min else 1)
        return self.bits * self.block_weights + params

    @property
    def block_bytes(self) -> int:
        return self.block_bits // 8

    @property
    def bits_per_weight(self) -> float:
        return self.block_bits / self.block_weights

    @property
    def family(self) -> tuple[str, ...]:
        """This grid and the fallback grids its rows may get."""
        return (self.name, *(GRIDS[self.fallback].family if self.fallback else ()))

    def for_width(self, in_features: int) -> Grid:
        """The grid a row of ``in_features`` weights is quantized on: this one, or its fallback."""
        if in_features % self.block_weights == 0 or self.fallback is None:
            return self
        return GRIDS[self.fallback].for_width(in_features)


_Q2_Q3_NOTE = (
    "llama.cpp's mixes write IQ4_NL there (4.5 bits/weight, a non-linear grid), its --pure Q2_K / Q3_K Q4_0; ours is Q4_0, the same size"
)

GRIDS: dict[str, Grid] = {
    g.name: g
    for g in (
        Grid("q4_0", 4, 32, True, 32),
        Grid("q4_1", 4, 32, False, 32),
        Grid("q5_0", 5, 32, True, 32),
        Grid("q5_1", 5, 32, False, 32),
        Grid("q8_0", 8, 32, True, 32),
        Grid("q2_k", 2, 16, False, SUPER_BLOCK, scale_bits=4, fallback="q4_0", fallback_note=_Q2_Q3_NOTE),
        Grid("q3_k", 3, 16, True, SUPER_BLOCK, scale_bits=6, signed_scales=True, fallback="q4_0", fallback_note=_Q2_Q3_NOTE),
        Grid("q4_k", 4, 32, False, SUPER_BLOCK, scale_bits=6, fallback="q5_0"),
        Grid("q5_k", 5, 32, False, SUPER_BLOCK, scale_bits=6, fallback="q5_1"),
        Grid("q6_k", 6, 16, True, SUPER_BLOCK, scale_bits=8, signed_scales=True, fallback="q8_0"),
    )
}
"""The grids our quantizers (rtn, gptq) put codes on; the GGUF export packs each into its block type exactly."""

GRID_NAMES = tuple(GRIDS)


def normalize_type(value: object) -> object:
    """llama.cpp's spellings (``Q4_K_M``, ``F16``, ``q4_k``) as our lower-case names; other values unchanged."""
    return value.strip().lower() if isinstance(value, str) else value


def llama_cpp_spelling(type_name: str) -> str:
    """A type the way llama.cpp writes it (``Q4_K_M``, ``F16``)."""
    return type_name.upper()
