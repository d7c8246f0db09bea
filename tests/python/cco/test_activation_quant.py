"""The layer's activation quantizers against ``cco.quant.quantize_a``: the Triton kernel (under
Triton's interpreter here; bit for bit on the GPU in ``test_cuda_nn.py``) and the CPU's torch one.

Guards: a wrong scale layout (blockscale's column-major [M, K/128], mxfp8's e8m0 bits), a zero K
padding that is not zero or shifts its scale groups, rows past a program's block, the fp8 rounding
(ties to even, values that round up across a power of two, e4m3 subnormals).
"""

from __future__ import annotations

import pytest
import torch

from cco import quant as Q
from kernels_fused.cpu.quantize import quantize_activation as cpu_quantize

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

INTERPRETED = isinstance(triton.language.standard.zeros, InterpretedFunction)

# (M, K, K_padded): M past one program's rows, K not a multiple of the groups, padding by one tile;
# 64 and 65 rows: the last call of blockscale's decode tile and the first of its wide one (group_tile)
SHAPES = [(5, 256, 256), (9, 300, 384), (3, 1000, 1024), (1, 64, 256), (17, 2368, 2432), (64, 640, 640),
          (65, 600, 640)]


def activations(m: int, k: int, seed: int = 0, dtype=torch.bfloat16) -> torch.Tensor:
    """Rows and 32-column groups of very different magnitude, and a few outliers, so that small
    values land in e4m3's subnormal range and many values round up across a power of two."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-8, 8, (m, 1), generator=g).float())
    groups = -(-k // 32)
    x = x * torch.exp2(torch.randint(-6, 6, (1, groups), generator=g).float()).repeat_interleave(32, dim=1)[:, :k]
    x[:, 0] *= 300.0  # an outlier per row: ptpc puts the rest of the row near the subnormals
    return x.to(dtype)


def reference(x: torch.Tensor, quant: str, k_padded: int):
    return Q.quantize_a(torch.nn.functional.pad(x.float(), (0, k_padded - x.shape[1])), quant)


def assert_same_bytes(got, want, quant: str):
    (q, s), (rq, rs) = got, want
    assert q.dtype == Q.FP8 and q.shape == rq.shape and q.is_contiguous()
    bad = int((q.view(torch.uint8) != rq.view(torch.uint8)).sum())
    assert bad == 0, f"{bad} of {q.numel()} e4m3 values differ"
    assert s.dtype == rs.dtype and s.shape == rs.shape
    if quant == "blockscale" and s.shape[0] > 1:
        assert s.stride() == (1, s.shape[0]), "blockscale A scales must be column-major"
    assert torch.equal(s.view(torch.uint8) if quant == "mxfp8" else s, rs.view(torch.uint8) if quant == "mxfp8" else rs)


@pytest.mark.skipif(not INTERPRETED, reason="the Triton kernel runs interpreted here only without a GPU "
                    "(test_cuda_nn.py checks it on the GPU)")
@pytest.mark.parametrize("m, k, k_padded", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("quant", Q.QUANTS)
def test_triton_quantizer_gives_quantize_a_bytes(quant, m, k, k_padded):
    from kernels_fused.hopper.quantize import quantize_activation

    if quant == "mxfp8" and k == k_padded and k % Q.MX_GROUP:
        pytest.skip("mxfp8 needs whole 32-wide groups without padding")
    x = activations(m, k)
    assert_same_bytes(quantize_activation(x, quant, k_padded=k_padded), reference(x, quant, k_padded), quant)


@pytest.mark.skipif(not INTERPRETED, reason="interpreted Triton only (see above)")
def test_triton_quantizer_reads_a_row_strided_view_and_fp32():
    """The layer passes ``x.reshape(-1, K)`` views: a row stride larger than K must be honoured."""
    from kernels_fused.hopper.quantize import quantize_activation

    wide = activations(6, 512, seed=3, dtype=torch.float32)
    x = wide[:, :384]
    assert x.stride() == (512, 1)
    assert_same_bytes(quantize_activation(x, "ptpc", k_padded=512), reference(x, "ptpc", 512), "ptpc")


@pytest.mark.skipif(not INTERPRETED, reason="interpreted Triton only (see above)")
def test_mxfp8_exponent_is_the_exact_ceiling_of_log2():
    """A group whose amax / 448 lies one fp32 ulp above 2**-10: the scale must be 2**-9, so no value
    saturates (torch's log2 rounds that ratio to exactly -10; quantize_a then clamps the amax)."""
    from kernels_fused.hopper.quantize import quantize_activation

    ratio = torch.tensor(2.0**-10, dtype=torch.float32)
    amax = (torch.nextafter(ratio, torch.tensor(1.0)) * 448).item()
    x = torch.full((1, 32), 0.25, dtype=torch.float32)
    x[0, 5] = amax
    q, s = quantize_activation(x, "mxfp8")
    assert Q.e8m0_to_float(s).item() == 2.0**-9
    back = Q.dequantize_a(q, s, "mxfp8")
    assert abs(back[0, 5].item() - amax) <= amax * 2.0**-4  # rounded, not clamped to 448 * 2**-10


@pytest.mark.skipif(not INTERPRETED, reason="interpreted Triton only (see above)")
@pytest.mark.parametrize("quant, split", [("ptpc", False), ("ptpc", True), ("blockscale", False), ("mxfp8", False)])
@pytest.mark.parametrize("skip", [True, False], ids=["zeros-skipped", "zeros-divided"])
def test_zeros_keep_their_bytes(quant, split, skip, monkeypatch):
    """Zeros and negative zeros among the values, a zero 128-column group, a zero row: each must give
    ``quantize_a``'s bytes, sign bit too, whether the call skips dividing zeros (``_div_rn``'s
    SKIP_ZEROS: decode-sized calls) or divides them (large calls)."""
    from kernels_fused.hopper import quantize as hq
    from kernels_fused.hopper.quantize import quantize_activation

    monkeypatch.setattr(hq, "SKIP_ZEROS_MAX_M", 64 if skip else 0)
    monkeypatch.setattr(hq, "_LAUNCHES", {})  # (its launches are kept by call shape, not by this rule)
    x = activations(5, 384, seed=9, dtype=torch.float32)
    x[0, ::7], x[1, 1::5] = 0.0, -0.0
    x[2, 128:256] = -0.0
    x[3] = 0.0
    want = reference(x, quant, 512)
    assert int((want[0].view(torch.uint8) == 0x80).sum()) > 0  # negative zeros are in the reference's bytes
    assert_same_bytes(quantize_activation(x, quant, k_padded=512, ptpc_split=split), want, quant)


@pytest.mark.skipif(not INTERPRETED, reason="interpreted Triton only (see above)")
@pytest.mark.parametrize("quant", Q.QUANTS)
def test_triton_quantizer_no_rows(quant):
    from kernels_fused.hopper.quantize import quantize_activation

    q, s = quantize_activation(torch.zeros(0, 256, dtype=torch.bfloat16), quant, k_padded=256)
    assert q.shape == (0, 256) and s.shape[0] == 0


@pytest.mark.parametrize("m, k, k_padded", SHAPES[:3], ids=lambda v: str(v))
@pytest.mark.parametrize("quant", Q.QUANTS)
def test_cpu_quantizer_pads_with_zero_columns(quant, m, k, k_padded):
    x = activations(m, k, seed=1)
    q, s = cpu_quantize(x, quant, k_padded=k_padded)
    assert_same_bytes((q, s), reference(x, quant, k_padded), quant)
    assert not q[:, k:].view(torch.uint8).any()


def test_quantizer_rejects_a_padding_that_is_not_a_k_tile():
    from kernels_fused.hopper.quantize import quantize_activation

    with pytest.raises(ValueError, match="k_padded=300"):
        quantize_activation(torch.zeros(2, 256), "ptpc", k_padded=300)
    with pytest.raises(ValueError, match="unit column stride"):
        quantize_activation(torch.zeros(4, 256).t(), "ptpc")


# (M, K, K_padded) for the split-row ptpc kernel: one slice per row, several, a row longer than one
# amax load (SPLIT_ROW_BLOCK lowered to 256 below), and a padded K whose last slice is partial
SPLIT_SHAPES = [(1, 256, 256), (3, 1000, 1024), (2, 2368, 2432), (8, 4096, 4096)]


@pytest.mark.skipif(not INTERPRETED, reason="interpreted Triton only (see above)")
@pytest.mark.parametrize("m, k, k_padded", SPLIT_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("row_block", [None, 256], ids=["row-in-one-load", "row-in-steps"])
def test_split_row_ptpc_kernel_gives_quantize_a_bytes(m, k, k_padded, row_block, monkeypatch):
    """The decode-sized ptpc kernel (each row over several programs): the same bytes as the two-pass
    kernel and quantize_a, whether a row's amax takes one load or several, and the scale stored once."""
    from kernels_fused.hopper import quantize as hq

    monkeypatch.setattr(hq, "_LAUNCHES", {})  # (kept launches are keyed by call shape, not by these rules)
    monkeypatch.setattr(hq, "SPLIT_SLICE_MIN", 256)  # several programs per row at these small K
    if row_block is not None:
        monkeypatch.setattr(hq, "SPLIT_ROW_BLOCK", row_block)
    grid, _, slice_k = hq.split_launch(m, k, k_padded)
    assert grid[1] > 1 or k_padded <= 256, f"the case must split its rows, got grid {grid}"
    x = activations(m, k, seed=4)
    want = reference(x, "ptpc", k_padded)
    assert_same_bytes(hq.quantize_activation(x, "ptpc", k_padded=k_padded, ptpc_split=True), want, "ptpc")
    assert_same_bytes(hq.quantize_activation(x, "ptpc", k_padded=k_padded, ptpc_split=False), want, "ptpc")


@pytest.mark.skipif(not INTERPRETED, reason="interpreted Triton only (see above)")
@pytest.mark.parametrize("quant,split", [("ptpc", True)] + [(q, False) for q in Q.QUANTS],
                         ids=["ptpc-split-rows"] + [f"{q}-row-blocks" for q in Q.QUANTS])
def test_padded_rows_are_zero_rows(quant, split):
    """``m_padded``: the rows past M are what quantize_a gives for zero rows (cuBLAS's blockwise GEMM
    takes row counts that are a multiple of 4; the layer pads decode calls so), in the scale layout
    of m_padded rows (blockscale's column stride is m_padded)."""
    from kernels_fused.hopper.quantize import quantize_activation

    x = activations(5, 300, seed=5)
    padded = torch.cat([x, torch.zeros(3, 300, dtype=x.dtype)])
    got = quantize_activation(x, quant, k_padded=384, m_padded=8, ptpc_split=split if quant == "ptpc" else None)
    assert_same_bytes(got, reference(padded, quant, 384), quant)
    with pytest.raises(ValueError, match="m_padded=4"):
        quantize_activation(x, quant, k_padded=384, m_padded=4)


def test_kept_launches_are_bounded(monkeypatch):
    """More call shapes than ``LAUNCHES_KEPT`` (a server's every prefill length) start the cache of
    kept launches over instead of growing it; the bytes stay those of ``quantize_a``."""
    from kernels_fused.hopper import launch as L
    from kernels_fused.hopper import quantize as QK

    monkeypatch.setattr(L, "LAUNCHES_KEPT", 3)
    QK._LAUNCHES.clear()
    for m in range(1, 8):
        x = activations(m, 256, seed=m)
        q, s = QK.quantize_activation(x, "ptpc")
        rq, rs = Q.quantize_a(x.float(), "ptpc")
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
        assert len(QK._LAUNCHES) <= 3
    assert len(QK._LAUNCHES) == 1  # three shapes, over again at the 4th and the 7th
