"""Quantization primitives: error bounds, code ranges, partial groups, the record format."""

from __future__ import annotations

import pytest
import torch

from compress.quantizers.core import QuantizedWeight, sqnr_db
from compress.quantizers.rtn import rtn_quantize
from compress.quantizers.targets import select_linears
from compress.schema.patterns import matches
from compress.schema.quantize import QuantScheme

SCHEMES = [QuantScheme(bits=b, group_size=g, symmetric=s) for b in (2, 3, 4, 8) for g in (32, 64, 128, None) for s in (True, False)]


def weight(out_f: int = 48, in_f: int = 576, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_f, in_f, generator=g) * 0.02


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.describe())
def test_rtn_error_within_half_step(scheme: QuantScheme) -> None:
    w = weight()  # 576 columns: g128 ends in a partial group of 64
    rec = rtn_quantize(w, scheme)
    deq = rec.dequantize()
    g = scheme.group_width(w.shape[1])
    step = rec.scale.float().repeat_interleave(g, dim=1)[:, : w.shape[1]]
    err = (w - deq).abs()
    if scheme.symmetric:
        # The grid covers [-(2^(b-1)-1), 2^(b-1)-1] * scale, which spans the group's absmax.
        assert bool((err <= step / 2 + 1e-7).all()), float((err / step).max())
    else:
        # The integer zero point shifts the grid by < half a step, so the clamped ends can
        # lose up to one step; every interior value stays within half a step.
        assert bool((err <= step + 1e-7).all()), float((err / step).max())
        assert float((err <= step / 2 + 1e-7).float().mean()) > 0.97
    assert rec.codes.dtype == torch.uint8 and int(rec.codes.max()) <= scheme.qmax
    assert rec.scale.shape == (w.shape[0], scheme.n_groups(w.shape[1]))


def test_sqnr_grows_with_bits_and_shrinking_groups() -> None:
    w = weight(out_f=128)
    by_bits = [sqnr_db(w, rtn_quantize(w, QuantScheme(bits=b, group_size=128)).dequantize()) for b in (2, 3, 4, 6, 8)]
    assert by_bits == sorted(by_bits), by_bits
    assert by_bits[-1] > 40  # 8-bit on Gaussian weights: ~45 dB
    assert 16 < by_bits[2] < 24  # 4-bit g128 symmetric: ~19 dB
    by_group = [sqnr_db(w, rtn_quantize(w, QuantScheme(bits=4, group_size=g)).dequantize()) for g in (None, 128, 64, 32)]
    assert by_group == sorted(by_group), by_group


def test_asymmetric_beats_symmetric_on_skewed_weights() -> None:
    w = weight().abs() + 0.01  # all positive: symmetric wastes half its grid
    sym = sqnr_db(w, rtn_quantize(w, QuantScheme(bits=4, group_size=64, symmetric=True)).dequantize())
    asym = sqnr_db(w, rtn_quantize(w, QuantScheme(bits=4, group_size=64, symmetric=False)).dequantize())
    assert asym > sym + 3


def test_partial_last_group_is_its_own_group() -> None:
    w = weight()
    w[:, 512:] *= 100  # only the partial last group (64 wide) is large
    rec = rtn_quantize(w, QuantScheme(bits=4, group_size=128))
    assert rec.scale.shape[1] == 5
    ref = rtn_quantize(weight()[:, :512], QuantScheme(bits=4, group_size=128))
    assert torch.equal(rec.scale[:, :4], ref.scale)  # earlier groups unaffected by the last one
    assert torch.equal(rec.codes[:, :512], ref.codes)


def test_symmetric_zero_point_and_fp16_exact_scales() -> None:
    rec = rtn_quantize(weight(), QuantScheme(bits=4, group_size=32, symmetric=True))
    assert bool((rec.zero_point == 8).all())
    assert rec.scale.dtype == torch.float16
    rec32 = rtn_quantize(weight(), QuantScheme(bits=4, group_size=32, scale_dtype="float32"))
    assert rec32.scale.dtype == torch.float32


def test_zero_and_constant_rows_are_exact() -> None:
    w = torch.zeros(4, 64)
    w[1] = 0.5
    w[2] = -0.25
    for sym in (True, False):
        rec = rtn_quantize(w, QuantScheme(bits=4, group_size=32, symmetric=sym))
        deq = rec.dequantize()
        assert torch.isfinite(deq).all()
        assert torch.equal(deq[0], w[0]) and torch.equal(deq[3], w[3])  # all-zero rows stay exactly zero
        if sym:  # +absmax sits half a step above the top code: within half a step, by design
            half_step = rec.scale.float()[:, :1] / 2
            assert bool(((deq - w).abs() <= half_step + 1e-7).all())
        else:  # the range [min(x, 0), max(x, 0)] puts a constant exactly on the grid
            assert torch.allclose(deq, w, atol=1e-3), deq[:, 0]


def test_record_validation_and_tensor_round_trip() -> None:
    scheme = QuantScheme(bits=4, group_size=64, symmetric=False)
    rec = rtn_quantize(weight(8, 96), scheme)
    back = QuantizedWeight.from_tensors(rec.tensors("layer"), "layer", scheme)
    assert torch.equal(back.dequantize(), rec.dequantize())
    with pytest.raises(ValueError, match="scale must have shape"):
        QuantizedWeight(rec.codes, rec.scale[:, :1], rec.zero_point, scheme)
    with pytest.raises(ValueError, match="codes exceed"):
        QuantizedWeight(rec.codes + 16, rec.scale, rec.zero_point, scheme)
    with pytest.raises(ValueError, match="symmetric scheme"):
        QuantizedWeight(rec.codes, rec.scale, rec.zero_point, scheme.model_copy(update={"symmetric": True}))


def test_bits_per_weight_counts_scales() -> None:
    rec = rtn_quantize(weight(8, 128), QuantScheme(bits=4, group_size=32, symmetric=True))
    assert rec.bits_per_weight == pytest.approx(4 + 16 / 32)  # Q4_0's 4.5 bits
    rec = rtn_quantize(weight(8, 128), QuantScheme(bits=4, group_size=32, symmetric=False))
    assert rec.bits_per_weight == pytest.approx(4 + 20 / 32)


def test_scheme_rejects_bad_values() -> None:
    with pytest.raises(ValueError):
        QuantScheme(bits=9)
    with pytest.raises(ValueError):
        QuantScheme(bits=4, group_size=0)


def test_target_patterns() -> None:
    assert matches("model.layers.0.mlp.down_proj", "down_proj")
    assert matches("model.layers.0.mlp.down_proj", "mlp.*")
    assert matches("lm_head", "lm_head")
    assert not matches("model.layers.0.mlp.down_proj", "up_proj")
    assert matches("model.layers.10.self_attn.q_proj", r"re:model\.layers\.1\d\..*")
    assert not matches("model.layers.1.self_attn.q_proj", r"re:model\.layers\.1\d\..*")

    model = torch.nn.Sequential()
    model.add_module("a", torch.nn.Linear(4, 4))
    model.add_module("b", torch.nn.Linear(4, 4))
    chosen, unused = select_linears(model, ["*"], ["b", "nothing_like_this"])
    assert [n for n, _ in chosen] == ["a"]
    assert unused == ["nothing_like_this"]
