"""llama.cpp's block types as quantization grids (torch-free): the constants a quantizer needs to put
its codes on a type's own grid, and the GGUF writer to pack them exactly.

Each type is named once here, by ggml's lower-case name (``q4_k``); recipes may write llama.cpp's
spelling (``Q4_K``), see :func:`normalize_type`. Layouts (ggml-quants.h):

* legacy blocks of 32 weights, an fp16 scale ``d`` each: Q4_0 / Q5_0 / Q8_0 ``w = d·(q - z)`` with
  the fixed zero 8 / 16 / 0 (our symmetric convention); Q4_1 / Q5_1 ``w = d·q + m`` with an fp16
  float minimum ``m``;
* K-quants, super-blocks of 256 weights with an fp16 ``d`` (and ``dmin``) and quantized sub-block
  scales: Q2_K (16 x 16, 4-bit scale and min), Q3_K (16 x 16, 6-bit signed scale, ``w = d·s·(q - 4)``),
  Q4_K / Q5_K (8 x 32, 6-bit scale and min, ``w = d·s·q - dmin·m``), Q6_K (16 x 16, int8 scale,
  ``w = d·s·(q - 32)``).

A row whose width is not a multiple of 256 cannot hold K-quant blocks; llama.cpp then writes the
type in ``fallback`` (``llama_tensor_get_type``: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0; Q2_K and
Q3_K -> IQ4_NL, a non-linear grid we do not quantize to, so our Q2_K / Q3_K fall back to Q4_0, the
same 4.5 bits per weight, and say so in the manifest).
"""

from __future__ import annotations

from dataclasses import dataclass

QK_K = 256  # weights per K-quant super-block
LEGACY_BLOCK = 32  # weights per legacy block


@dataclass(frozen=True)
class GGUFGrid:
    """One llama.cpp block type as a quantization grid."""

    name: str  # ggml's lower-case type name
    bits: int  # bits per weight code
    group: int  # weights sharing one scale (the block, or a K-quant's sub-block)
    symmetric: bool  # fixed zero point 2**(bits-1) and no minimum; else w = scale·q + min
    block_weights: int  # weights per stored block (32, or 256 for K-quants)
    block_bytes: int  # bytes per stored block
    scale_levels: int = 0  # K-quants: largest quantized sub-block scale (and min) magnitude
    signed_scales: bool = False  # K-quants: sub-block scales may be negative (Q3_K, Q6_K)
    fallback: str | None = None  # the type for rows that are not a multiple of block_weights
    fallback_note: str = ""  # where ours differs from llama.cpp's fallback

    @property
    def k_quant(self) -> bool:
        return self.block_weights == QK_K

    @property
    def float_min(self) -> bool:
        """w = scale·q + min with a float min per group (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K)."""
        return not self.symmetric

    @property
    def scale_dtype(self) -> str:
        """How a record holds its scales: fp16 for legacy types (stored as they are), float32 for
        K-quants (fp16 ``d`` times an integer sub-block scale, exact in float32)."""
        return "float32" if self.k_quant else "float16"

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_weights

    @property
    def family(self) -> tuple[str, ...]:
        """This type and the fallback types its rows may get."""
        return (self.name, *(GGUF_GRIDS[self.fallback].family if self.fallback else ()))

    def for_width(self, in_features: int) -> GGUFGrid:
        """The grid a row of ``in_features`` weights is stored on: this one, or its fallback."""
        if in_features % self.block_weights == 0 or self.fallback is None:
            return self
        return GGUF_GRIDS[self.fallback].for_width(in_features)


_Q2_Q3_NOTE = (
    "llama.cpp's mixes write IQ4_NL there (4.5 bits/weight, a non-linear grid), its --pure Q2_K / Q3_K Q4_0; ours is Q4_0, the same size"
)

GGUF_GRIDS: dict[str, GGUFGrid] = {
    g.name: g
    for g in (
        GGUFGrid("q4_0", 4, 32, True, 32, 18),
        GGUFGrid("q4_1", 4, 32, False, 32, 20),
        GGUFGrid("q5_0", 5, 32, True, 32, 22),
        GGUFGrid("q5_1", 5, 32, False, 32, 24),
        GGUFGrid("q8_0", 8, 32, True, 32, 34),
        GGUFGrid("q2_k", 2, 16, False, QK_K, 84, scale_levels=15, fallback="q4_0", fallback_note=_Q2_Q3_NOTE),
        GGUFGrid("q3_k", 3, 16, True, QK_K, 110, scale_levels=31, signed_scales=True, fallback="q4_0", fallback_note=_Q2_Q3_NOTE),
        GGUFGrid("q4_k", 4, 32, False, QK_K, 144, scale_levels=63, fallback="q5_0"),
        GGUFGrid("q5_k", 5, 32, False, QK_K, 176, scale_levels=63, fallback="q5_1"),
        GGUFGrid("q6_k", 6, 16, True, QK_K, 210, scale_levels=127, signed_scales=True, fallback="q8_0"),
    )
}
"""Block types our quantizers (rtn, gptq) put codes on, and the GGUF writer packs exactly."""

GGUF_GRID_TYPES = tuple(GGUF_GRIDS)


def normalize_type(value: object) -> object:
    """llama.cpp's spellings (``Q4_K_M``, ``F16``, ``q4_k``) as our lower-case names; other values unchanged."""
    return value.strip().lower() if isinstance(value, str) else value


def llama_cpp_spelling(type_name: str) -> str:
    """A type the way llama.cpp writes it (``Q4_K_M``, ``F16``)."""
    return type_name.upper()
