"""Quant formats: error bounds of quantize/dequantize, scale layouts, and the reference GEMM."""

import pytest
import torch

from cco import quant as Q

SHAPES = [(64, 256), (33, 512)]  # odd row count on purpose


def _data(rows, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g) * torch.exp2(torch.randint(-4, 5, (rows, 1), generator=g).float())


# e4m3 has 3 mantissa bits: relative rounding error <= 2**-4 per element; rms well below that.
RMS_BOUND = {"ptpc": 0.04, "blockscale": 0.04, "mxfp8": 0.04}


@pytest.mark.parametrize("quant", Q.QUANTS)
@pytest.mark.parametrize("rows,k", SHAPES, ids=lambda v: str(v))
def test_a_roundtrip_error_is_fp8_rounding(quant, rows, k):
    x = _data(rows, k, seed=rows + k)
    q, s = Q.quantize_a(x, quant)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    y = Q.dequantize_a(q, s, quant)
    assert 0 < Q.rel_l2(y, x) < RMS_BOUND[quant]
    # no element saturates beyond the fp8 rounding step of its own magnitude
    assert ((y - x).abs() <= x.abs() * 2**-3 + 1e-6 * x.abs().max()).float().mean() > 0.99


@pytest.mark.parametrize("quant", Q.QUANTS)
def test_b_roundtrip_error_is_fp8_rounding(quant):
    w = _data(256, 384, seed=7)
    q, s = Q.quantize_b(w, quant)
    y = Q.dequantize_b(q, s, quant)
    assert 0 < Q.rel_l2(y, w) < RMS_BOUND[quant]


def test_scale_shapes_and_layouts():
    m, n, k = 48, 256, 512
    a, w = _data(m, k, 1), _data(n, k, 2)
    _, s = Q.quantize_a(a, "ptpc")
    assert s.shape == (m,) and s.dtype == torch.float32
    _, s = Q.quantize_a(a, "blockscale")
    assert s.shape == (m, k // 128) and s.stride() == (1, m)  # column-major
    _, s = Q.quantize_b(w, "blockscale")
    assert s.shape == (n // 128, k // 128)
    _, s = Q.quantize_a(a, "mxfp8")
    assert s.shape == (m, k // 32) and s.dtype == torch.float8_e8m0fnu
    p = Q.e8m0_to_float(s)
    assert torch.equal(p, torch.exp2(torch.log2(p).round()))  # powers of two


def test_mxfp8_never_saturates():
    x = _data(16, 256, 3)
    q, s = Q.quantize_a(x, "mxfp8")
    assert q.float().abs().max() <= Q.FP8_MAX
    groups = x.view(16, 8, 32).abs().amax(2)
    # the chosen power of two is the smallest that fits: half of it would overflow
    assert (groups / (Q.e8m0_to_float(s) / 2) > Q.FP8_MAX).all()


def test_blockscale_b_scales_whole_128x128_blocks():
    w = _data(256, 256, 4)
    w[0:128, 0:128] *= 1000.0
    _, s = Q.quantize_b(w, "blockscale")
    assert s[0, 0] > 100 * s[0, 1] and s[0, 0] > 100 * s[1, 0]


@pytest.mark.parametrize("quant", Q.QUANTS)
def test_reference_gemm_matches_float64(quant):
    p = Q.random_problem(40, 256, 384, quant, seed=11)
    a64 = Q.dequantize_a(p.a, p.a_scale, quant).double()
    b64 = Q.dequantize_b(p.b, p.b_scale, quant).double()
    exact = a64 @ b64.t()
    ref = p.reference()
    assert ref.dtype == torch.bfloat16 and ref.shape == (40, 256)
    assert Q.rel_l2(ref, exact) < 3e-3  # one bf16 rounding
    assert Q.count_mismatches(ref, exact.to(torch.bfloat16), rel=0.01) == 0


def test_random_problem_is_seeded_and_nonzero():
    p1 = Q.random_problem(32, 128, 256, "ptpc", seed=5)
    p2 = Q.random_problem(32, 128, 256, "ptpc", seed=5)
    p3 = Q.random_problem(32, 128, 256, "ptpc", seed=6)
    assert torch.equal(p1.a.view(torch.uint8), p2.a.view(torch.uint8))
    assert not torch.equal(p1.a.view(torch.uint8), p3.a.view(torch.uint8))
    assert (p1.a.float() != 0).float().mean() > 0.9
    assert p1.reference().float().abs().mean() > 0


def test_count_mismatches_sees_one_bad_band():
    ref = torch.randn(256, 128).to(torch.bfloat16)
    out = ref.clone()
    assert Q.count_mismatches(out, ref) == 0
    out[16:32] = out[16:32].float() * 1.15  # a 16-row band off by 15%
    assert Q.count_mismatches(out, ref) >= 16 * 128 * 0.9
    out[0, 0] = float("nan")
    assert Q.count_mismatches(out, ref) >= 16 * 128 * 0.9 + 1


def test_unknown_quant_is_named():
    with pytest.raises(ValueError, match="quant='fp4'.*ptpc, blockscale, mxfp8"):
        Q.quantize_a(torch.randn(4, 256), "fp4")
