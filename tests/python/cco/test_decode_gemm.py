"""The decode GEMM (``kernels_fused.hopper.decode``: activations quantized inside the GEMM's launch)
against the two-launch path it replaces: the activation quantizer's bytes, then
``cco.quant.reference_gemm`` rounded to bf16, plus the bias rounded again (the layer's ``out +=
bias``). Under Triton's interpreter here, where the fp32 reference and the kernel's fp32
accumulation agree bit for bit at these sizes; on the GPU ``test_cuda_nn.py`` holds it to one bf16
ulp (another accumulation order) at the decode shapes, and the compiled-kernel launch to
``JITFunction.run``'s bit for bit.

Guards: each quant's scale application (ptpc's row amax over all of K before the first step,
blockscale's per-block partial products, mxfp8's exponents on both operands), K padding (columns
past K read as zeros), N not a multiple of the program's block, rows past M, the bias, the launch
cache's key (another M, another alignment of x).
"""

from __future__ import annotations

import pytest
import torch

from cco import quant as Q

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from tests.python.cco.test_activation_quant import activations  # noqa: E402

INTERPRETED = isinstance(triton.language.standard.zeros, InterpretedFunction)
pytestmark = pytest.mark.skipif(not INTERPRETED, reason="the Triton kernel runs interpreted here only without a GPU "
                                "(test_cuda_nn.py checks it on the GPU)")

# (M, N, K, K_padded): one row (the one-row kernel); 2..16 rows (the rows kernel, or ptpc's MMA over
# quantized rows: every row in one program, 2, 4, 8 and 16 wide); 17 rows (past ROWS_MAX: ptpc's MMA
# 32 wide, the others' one-row kernel per row; 64 wide: test_ptpc_rows_quantized_once...); K padded by
# a tile; N past a program's block; K past one amax load (ROW_K)
SHAPES = [(1, 256, 256, 256), (3, 200, 300, 384), (4, 128, 1024, 1024), (2, 136, 640, 640), (1, 16, 5000, 5120),
          (5, 64, 256, 256), (16, 200, 300, 384), (17, 64, 128, 128), (8, 40, 2500, 2560)]


def weight(n: int, k: int, k_padded: int, quant: str, seed: int = 1):
    """A quantized [N_pad, K_pad] weight as the layers hold it: zero rows past N, zero columns past K."""
    g = torch.Generator().manual_seed(seed)
    n_padded = -(-n // 128) * 128
    w = torch.zeros(n_padded, k_padded)
    w[:n, :k] = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-4, 4, (n, 1), generator=g).float()) * 0.05
    return Q.quantize_b(w, quant)


def two_launches(x, wq, ws, quant, n, k_padded, bias=None):
    from kernels_fused.hopper.quantize import quantize_activation

    a, s = quantize_activation(x, quant, k_padded=k_padded)
    out = Q.reference_gemm(a, wq, s, ws, quant)[:, :n]
    return out if bias is None else out + bias


@pytest.mark.parametrize("m, n, k, k_padded", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("quant", Q.QUANTS)
def test_decode_gemm_equals_quantizer_and_reference(quant, m, n, k, k_padded):
    from kernels_fused.hopper.decode import decode_gemm

    if quant == "mxfp8" and k == k_padded and k % Q.MX_GROUP:
        pytest.skip("mxfp8 needs whole 32-wide groups without padding")
    x = activations(m, k, seed=m + k).flip(1).contiguous()  # each row's outlier last: ptpc's amax must see all of K
    wq, ws = weight(n, k, k_padded, quant)
    got = decode_gemm(x, wq, ws, quant, n=n)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert_within_one_ulp(got, two_launches(x, wq, ws, quant, n, k_padded))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    assert torch.equal(decode_gemm(x, wq, ws, quant, n=n, bias=bias), got + bias)  # the layer's out += bias


def assert_within_one_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    """Every output within one bf16 ulp of the reference (its fp32 sum runs in another order: a sum
    near a rounding boundary may round the other way), and such flips rare."""
    ulp = (want.float().abs().clamp_min(2.0 ** -100).log2().floor() - 7).exp2()
    off = (got.float() - want.float()).abs() / ulp
    assert float(off.max()) <= 1.0, f"{float(off.max())} ulps off"
    assert int((off > 0).sum()) <= max(1, got.numel() // 200), f"{int((off > 0).sum())} of {got.numel()} differ"


def test_decode_gemm_rows_of_a_strided_view_and_the_launch_key():
    """Rows of a wider tensor (row stride > K, an offset start) and another M after the first: each
    call shape gets its own launch, and the product is the same as on a packed copy."""
    from kernels_fused.hopper import decode as D

    quant, n, k = "ptpc", 256, 384
    wq, ws = weight(n, k, k, quant)
    wide = activations(9, 2 * k, seed=3)
    view = wide[1:9, 8:8 + k]  # row stride 2K, start 1 row + 8 columns in
    got = D.decode_gemm(view, wq, ws, quant, n=n)
    assert torch.equal(got, D.decode_gemm(view.contiguous(), wq, ws, quant, n=n))
    assert torch.equal(D.decode_gemm(view[:1], wq, ws, quant, n=n), got[:1])
    keys = [key for key in D._LAUNCHES if key[1] == k and key[6] == wq.shape]
    assert len({(key[0], key[3], key[5]) for key in keys}) >= 3  # (M, row stride, x's alignment) apart


def test_decode_gemm_takes_leading_dimensions_as_rows():
    """x [B, S, K] (what a model's layer passes): packed, its rows are read in place; strided
    (leading dimensions transposed), it is reshaped first. Either way the output is [B, S, N] and
    equals the product of the flattened rows; a column stride other than 1 is refused even where a
    call of the same row stride was launched before (the launch key holds the column stride)."""
    from kernels_fused.hopper import decode as D

    quant, n, k = "blockscale", 128, 256
    wq, ws = weight(n, k, k, quant)
    x = activations(6, k, seed=5)
    flat = D.decode_gemm(x, wq, ws, quant, n=n)
    packed = D.decode_gemm(x.view(2, 3, k), wq, ws, quant, n=n)
    assert packed.shape == (2, 3, n) and torch.equal(packed.view(6, n), flat)
    strided = x.view(3, 2, k).transpose(0, 1)  # [2, 3, K], not packed
    got = D.decode_gemm(strided, wq, ws, quant, n=n)
    assert got.shape == (2, 3, n) and torch.equal(got, D.decode_gemm(strided.contiguous(), wq, ws, quant, n=n))
    wide = activations(6, 2 * k, seed=6)
    D.decode_gemm(wide[:, :k], wq, ws, quant, n=n)  # row stride 2K, columns packed: launched
    with pytest.raises(ValueError, match="unit column stride"):
        D.decode_gemm(wide[:, ::2], wq, ws, quant, n=n)  # row stride 2K too, every other column


@pytest.mark.parametrize("bad, match", [
    (dict(quant="int8"), "quant='int8'"),
    (dict(n=0), "n=0"),
    (dict(w=lambda wq: wq.float()), "contiguous row-major e4m3"),
    (dict(w=lambda wq: wq[:, :128]), "contiguous row-major e4m3"),
    (dict(bias=torch.zeros(3, dtype=torch.bfloat16)), "bias must be a contiguous"),
])
def test_decode_gemm_refuses_what_it_cannot_take(bad, match):
    from kernels_fused.hopper.decode import decode_gemm

    wq, ws = weight(128, 256, 256, "ptpc")
    x = activations(2, 256)
    kwargs = dict(quant="ptpc", n=128, bias=None)
    w = wq
    for key, value in bad.items():
        if key == "w":
            w = value(wq)
        else:
            kwargs[key] = value
    with pytest.raises(ValueError, match=match):
        decode_gemm(x, w, ws, kwargs.pop("quant"), **kwargs)


@pytest.mark.parametrize("m", [2, 5, 16, 33, 64])
def test_ptpc_rows_quantized_once_or_per_program_give_the_same_product(monkeypatch, m):
    """ptpc at 2..MMA_ROWS_MAX rows (``QUANTIZED_ROWS``): the quantizer's launch, then the MMA over its
    rows (16 and 64 wide: 33 rows with 31 masked, 64 with none); up to ROWS_MAX rows also with it off,
    the rows kernel quantizing in every program. Within one ulp of the two-launch reference, bias
    added as ``out += bias``. (Past ROWS_MAX with it off the one-row kernel runs per row, which the
    shape sweep above holds at 17 rows.)"""
    from kernels_fused.hopper import decode as D

    n, k, k_padded = 200, 700, 768
    x = activations(m, k, seed=m).flip(1).contiguous()
    wq, ws = weight(n, k, k_padded, "ptpc")
    want = two_launches(x, wq, ws, "ptpc", n, k_padded)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    for quantized in (True, False) if m <= D.ROWS_MAX else (True,):
        monkeypatch.setattr(D, "QUANTIZED_ROWS", {"ptpc"} if quantized else set())
        D._LAUNCHES.clear()
        got = D.decode_gemm(x, wq, ws, "ptpc", n=n)
        assert [launch.quantize is not None for launch in D._LAUNCHES.values()] == [quantized]
        assert_within_one_ulp(got, want)
        assert torch.equal(D.decode_gemm(x, wq, ws, "ptpc", n=n, bias=bias), got + bias)
    D._LAUNCHES.clear()


@pytest.mark.parametrize("m, n, k, k_padded", [(2, 64, 700, 768), (33, 40, 5000, 5120), (64, 64, 300, 384)],
                         ids=lambda v: str(v))
def test_ptpc_one_launch_equals_two_launches(monkeypatch, m, n, k, k_padded):
    """ptpc's 2..64 rows in one launch (``decode_ptpc_kernel``: the quantizer's items, the grid-wide
    wait, the MMA) where the grid is resident at once: under the interpreter one program (N <= 64),
    so the whole path runs here, the wait included: the product equal to the two launches' bit for
    bit, bias as ``out += bias``, and each call one generation of the stream's wait counter, its
    count back at zero. 5000 columns: more than one slice and amax load per row."""
    from kernels_fused.hopper import decode as D

    x = activations(m, k, seed=m).flip(1).contiguous()
    wq, ws = weight(n, k, k_padded, "ptpc")
    D._LAUNCHES.clear()
    D._SYNC.clear()
    got = D.decode_gemm(x, wq, ws, "ptpc", n=n)
    assert [launch.one is not None for launch in D._LAUNCHES.values()] == [True]
    bias = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    assert torch.equal(D.decode_gemm(x, wq, ws, "ptpc", n=n, bias=bias), got + bias)
    assert D._SYNC[(-1, 0)].tolist() == [0, 2]
    monkeypatch.setattr(D, "ONE_LAUNCH", False)  # the two launches
    assert torch.equal(D.decode_gemm(x, wq, ws, "ptpc", n=n), got)
    assert D._SYNC[(-1, 0)].tolist() == [0, 2]
    assert_within_one_ulp(got, two_launches(x, wq, ws, "ptpc", n, k_padded))
    D._LAUNCHES.clear()


@pytest.mark.parametrize("m, k, k_padded, split", [(5, 2500, 2560, 4), (3, 4000, 4096, 8), (2, 1100, 1152, 4)],
                         ids=lambda v: str(v))
def test_ptpc_one_launch_sums_k_as_the_captured_split_mma(monkeypatch, m, k, k_padded, split):
    """An eager call of ptpc's 2..64 rows (the one launch) and a captured one (the quantizer + the
    MMA split over K, programs of their own summing in slice order) give the same bits: the one
    launch's MMA phase sums the same K slices from zero and adds them in the same order. On a GPU of
    132 SMs (assumed here; under the interpreter the one launch's wait needs one program: N <= 64)
    the rule splits a weight of one block into ``split`` slices (1152 = 9 steps of 128: slices of
    3, 3, 3 and 0 steps). Fails with the one launch summing all of K in one chain (an eager call then
    differs from a captured one in ~20-40% of its outputs on the GPU: scripts/probe_eager_graph_bits.py)."""
    from kernels_fused.hopper import decode as D

    monkeypatch.setattr(D, "resident_programs", lambda device: 132)
    n = 64
    x = activations(m, k, seed=m + 40).flip(1).contiguous()
    wq, ws = weight(n, k, k_padded, "ptpc")
    D._LAUNCHES.clear()
    D._SYNC.clear()
    eager = D.decode_gemm(x, wq, ws, "ptpc", n=n)
    (launch,) = D._LAUNCHES.values()
    assert launch.one is not None and launch.kernel.grid == (1, split)
    assert D._SYNC[(-1, 0)].tolist() == [0, 1]  # the call took the one launch (one generation of its wait)
    monkeypatch.setattr(D, "ONE_LAUNCH", False)  # what a graph capture runs
    captured = D.decode_gemm(x, wq, ws, "ptpc", n=n)
    assert D._SYNC[(-1, 0)].tolist() == [0, 1]
    assert torch.equal(eager, captured), f"{int((eager != captured).sum())} of {eager.numel()} outputs differ"
    D._LAUNCHES.clear()


def test_ptpc_one_launch_phases_over_many_programs():
    """The one-launch kernel's two phases as two launches of a grid of several programs (what the
    interpreter can run: its programs run in turn, so the wait needs one program): phase 1 spreads
    the quantizer's (row, slice) items over the grid and writes the rows and then their scales in one
    scratch, phase 2 is the MMA over them. The scratch holds the split quantizer's bytes and the
    output the two launches' product bit for bit; a grid that is not resident at once takes the two
    launches in decode_gemm."""
    from kernels_fused.hopper import decode as D
    from kernels_fused.hopper import decode_kernels as dk
    from kernels_fused.hopper.quantize import quantize_activation

    m, n, k, k_padded = 5, 200, 2500, 2560
    x = activations(m, k, seed=9).flip(1).contiguous()
    wq, ws = weight(n, k, k_padded, "ptpc")
    D._LAUNCHES.clear()
    want = D.decode_gemm(x, wq, ws, "ptpc", n=n)
    assert [launch.one is None and launch.quantize is not None for launch in D._LAUNCHES.values()] == [True]
    q, sa = quantize_activation(x, "ptpc", k_padded=k_padded)
    scratch = torch.full((m * (k_padded + 4),), float("nan"), dtype=Q.FP8)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    sync = torch.zeros(2, dtype=torch.int32)
    slice_k = 1024
    grid = (-(-n // D.WIDE_BLOCK_N["ptpc"]),)
    for phase in (1, 2):
        dk.decode_ptpc_kernel[grid](x, scratch, wq, ws, out, out, sync, m, n, k, k_padded, k, Q._TINY, Q.FP8_MAX,
                                    -(-k_padded // slice_k), k_padded, False, D.WIDE_BLOCK_N["ptpc"], 256, 16, 1024,
                                    slice_k, phase, True, 1)
        if phase == 1:
            assert torch.equal(scratch[:m * k_padded].view(torch.uint8), q.reshape(-1).view(torch.uint8))
            assert torch.equal(scratch[m * k_padded:].view(torch.float32), sa)
    assert torch.equal(out, want)
    assert sync.tolist() == [0, 0]  # the phases alone never wait
    D._LAUNCHES.clear()


def test_ptpc_one_launch_rule(monkeypatch):
    """Which ptpc call shapes take the one launch: a grid resident at once (at most
    ``resident_programs``) and a weight of at most ``ONE_LAUNCH_MAX_BYTES`` (8B down's 59 MB: the
    host bounds the call; 70B down's 235 MB: the device does, where the one launch only adds). One
    row and the other quants never do."""
    from kernels_fused.hopper import decode as D

    monkeypatch.setattr(D, "resident_programs", lambda device: 132)  # an H200's SMs
    one = lambda m, n, k, quant="ptpc": D._Launch(m, k, k, n, quant, False, -1).one_args is not None  # noqa: E731
    assert one(8, 4096, 14336) and one(64, 4096, 4096) and one(2, 6144, 4096)
    assert not one(8, 8192, 28672)  # 70B down: the device bounds it
    assert not one(8, 16384, 2048)  # 256 programs: not resident at once
    assert not one(1, 4096, 14336) and not one(8, 4096, 14336, "blockscale")


@pytest.mark.parametrize("quant", ["ptpc", "blockscale"])
def test_one_row_eager_kernel_and_captured_mma(monkeypatch, quant):
    """One row of a quant whose rows are quantized once: an eager call takes the one-row kernel (one
    launch), a graph capture the quantizer's launch and the MMA over the row (faster on the device:
    a capture's host time is paid once), and so do eager calls with ``ONE_LAUNCH`` off. Both within
    one ulp of the two-launch reference; mxfp8's row keeps the one-row kernel under a capture too."""
    from kernels_fused.hopper import decode as D

    n, k, k_padded = 200, 700, 768
    monkeypatch.setattr(D, "CAPTURED_ROW_MIN_BYTES", n * k_padded)  # (a small weight here)
    x = activations(1, k, seed=4).flip(1).contiguous()
    wq, ws = weight(n, k, k_padded, quant)
    want = two_launches(x, wq, ws, quant, n, k_padded)
    D._LAUNCHES.clear()
    calls = []
    real = D.Kernel.__call__
    monkeypatch.setattr(D.Kernel, "__call__", lambda self, *a: (calls.append(self.fn.__name__), real(self, *a))[1])
    eager = D.decode_gemm(x, wq, ws, quant, n=n)
    (launch,) = D._LAUNCHES.values()
    assert launch.one_args is None and calls == ["decode_gemv_kernel"]
    assert_within_one_ulp(eager, want)
    capturing = [True]
    monkeypatch.setattr(D, "_capturing", lambda device: capturing[0])
    calls.clear()
    captured = D.decode_gemm(x, wq, ws, quant, n=n)
    quantizer = "quantize_ptpc_split_kernel" if quant == "ptpc" else "quantize_groups_kernel"
    assert calls == [quantizer, "decode_mma_rows_kernel"]
    assert_within_one_ulp(captured, want)
    capturing[0] = False
    monkeypatch.setattr(D, "ONE_LAUNCH", False)
    calls.clear()
    assert torch.equal(D.decode_gemm(x, wq, ws, quant, n=n), captured) and len(calls) == 2
    D._LAUNCHES.clear()
    xm, (wm, sm) = activations(1, 512, seed=4), weight(n, 512, 512, "mxfp8")
    capturing[0] = True
    calls.clear()
    D.decode_gemm(xm, wm, sm, "mxfp8", n=n)
    assert calls == ["decode_gemv_kernel"]
    D._LAUNCHES.clear()
    monkeypatch.setattr(D, "CAPTURED_ROW_MIN_BYTES", n * k_padded + 1)  # a weight under the bound: the kernel
    calls.clear()
    assert torch.equal(D.decode_gemm(x, wq, ws, quant, n=n), eager) and calls == ["decode_gemv_kernel"]
    D._LAUNCHES.clear()


@pytest.mark.parametrize("quant", ["ptpc", "blockscale"])
def test_probe_times_the_one_row_kernel_on_either_side_of_the_bound(monkeypatch, quant):
    """``probe_decode_split_k.one_row_kernel``: the one-row kernel an eager call runs, over the bound
    (beside the captured MMA) and under it (the launch's only kernel), its product the call's. It
    called the eager path alone before, which a launch under the bound does not have."""
    from kernels_fused.hopper import decode as D
    from scripts.probe_decode_split_k import one_row_kernel

    n, k = 200, 768
    x = activations(1, k, seed=5)
    wq, ws = weight(n, k, k, quant)
    for bound in (0, n * k + 1):
        monkeypatch.setattr(D, "CAPTURED_ROW_MIN_BYTES", bound)
        D._LAUNCHES.clear()
        want = D.decode_gemm(x, wq, ws, quant, n=n)
        (launch,) = D._LAUNCHES.values()
        assert (launch.one is None) == bool(bound)
        kernel = one_row_kernel(launch)
        assert kernel.fn.__name__ == "decode_gemv_kernel"
        out = torch.empty(1, n, dtype=torch.bfloat16)
        kernel(-1, *launch._row(x, wq, ws, out, out, x.stride(0), ws.stride(0)))
        assert torch.equal(out, want)
    D._LAUNCHES.clear()


def test_split_probe_configs_take_the_block_n_and_warps_asked_for():
    """``probe_decode_split_k --block-n/--warps``: every (BLOCK_N, BLOCK_K, SPLIT, warps) asked for where
    a slice keeps two K steps, each quant's stages; the defaults are the run's before the options."""
    from scripts.probe_decode_split_k import configs, parse_args

    args = parse_args(["--block-n", "64,128", "--warps", "4,8", "8b-o-tp1", "32,64", "bn.json"])
    assert (args.block_n, args.warps) == ([64, 128], [4, 8])
    got = list(configs("blockscale", 4096, args.block_n, args.warps))
    assert {(bn, w) for bn, _, _, w, _ in got} == {(64, 4), (64, 8), (128, 4), (128, 8)}
    assert {stages for *_, stages in got} == {3} and all(4096 // bk >= 2 * split for _, bk, split, _, _ in got)
    assert (64, 512, 4, 8, 3) in got and (64, 512, 8, 8, 3) not in got  # (8 slices of 512: one step each)
    default = parse_args(["8b-o-tp1", "8", "a.json"])
    assert not default.cold and parse_args(["--cold", "8b-o-tp1", "8", "a.json"]).cold
    deep = parse_args(["--stages", "4,6", "8b-o-tp1", "8", "a.json"])
    assert {st for *_, st in configs("blockscale", 4096, deep.block_n, deep.warps, deep.stages)} == {4, 6}
    narrow = parse_args(["--block-k", "128", "8b-o-tp1", "8", "a.json"])
    assert {bk for _, bk, *_ in configs("blockscale", 4096, narrow.block_n, narrow.warps, None, narrow.block_k)} == {128}
    many = parse_args(["--block-k", "128", "--splits", "8,16", "8b-kv-tp8", "8", "a.json"])
    assert default.splits == [1, 2, 4, 8] and many.splits == [8, 16]
    # 16 slices of 128 columns take 2 steps each at K 4096; 32 would take one, so it is not tried
    assert {s for _, _, s, _, _ in configs("blockscale", 4096, [64], [4], None, [128], [8, 16, 32])} == {8, 16}
    assert list(configs("ptpc", 1024, default.block_n, default.warps)) == [
        (32, 128, 1, 4, 4), (32, 128, 2, 4, 4), (32, 128, 4, 4, 4), (32, 256, 1, 4, 4), (32, 256, 2, 4, 4),
        (64, 128, 1, 4, 4), (64, 128, 2, 4, 4), (64, 128, 4, 4, 4), (64, 256, 1, 4, 4), (64, 256, 2, 4, 4)]


def test_split_probe_plot_draws_the_cold_times_and_the_best_of_each_slice_count(tmp_path):
    """``probe_decode_split_k --from RUN.json --plot``: a --cold run is drawn from its cold times,
    with 0.8x of nn.Linear's, each K-slice count's best config as a line of its own, and the best of
    the --inline arms (one launch) as another, which the slice counts' lines leave out, drawn at the
    cells where it was timed (an arm left out at a cell: not captured, other bits)."""
    pytest.importorskip("matplotlib")
    import json

    from scripts.probe_decode_split_k import plot

    def times(scale):
        return {"nn.Linear bf16": 10 * scale, "quantizer + cuBLAS": 20 * scale, "decode_gemm": 7 * scale,
                "64/256/4/4/3": 9 * scale, "64/128/4/4/3": 8 * scale, "64/256/16/4/3": 11 * scale,
                "inline: 64/256/4/4/3": 6 * scale, "inline: 64/128/4/4/3": 5 * scale}  # (--inline's arms)

    rows = [{"shape": "8b-kv-tp1", "n": 1024, "k": 4096, "m": m, "quant": "blockscale", "us": times(1),
             "us_cold": times(m)} for m in (2, 8)]
    # ptpc: its one launch left out at 8 rows (not captured, say): drawn where it was timed only
    ptpc = [{"shape": "8b-kv-tp1", "n": 1024, "k": 4096, "m": m, "quant": "ptpc", "us": times(1),
             "us_cold": times(m) if m == 2 else {a: v for a, v in times(m).items() if not a.startswith("inline")}}
            for m in (2, 8)]
    rows += ptpc
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"date": "d", "gpu": "g", "rows": rows}))
    fig = plot(str(run), str(tmp_path / "run.png"))
    lines = {line.get_label(): list(line.get_ydata()) for line in fig.axes[0].get_lines()}
    assert lines["nn.Linear bf16"] == [20, 80] and lines["0.8x nn.Linear (the target)"] == [16, 64]
    assert lines["blockscale: best config of 4 K slices"] == [16, 64]  # the better of the two 4-slice configs
    assert lines["blockscale: quantizer inside the MMA, best config (--inline)"] == [10, 40]  # not among those
    assert lines["blockscale: best config of 16 K slices"] == [22, 88]
    assert lines["ptpc: quantizer and MMA in one launch, best config (--inline)"] == [10]
    assert list(lines["ptpc: decode_gemm (the rule, captured)"]) == [14, 56]
    assert (tmp_path / "run.png").stat().st_size > 10_000


def test_model_host_probe_plot_draws_each_slot_per_arm(tmp_path):
    """``probe_decode_model_host --from RUN.json --plot``: a panel per (quant, batch), per arm a bar
    per linear slot (its host us per call in the model) and a dot for its call alone."""
    pytest.importorskip("matplotlib")
    import json

    from scripts.probe_decode_model_host import SLOTS, plot

    def run(arm, scale):
        return {"batch": 1, "arm": arm, "host_ms_per_token": 6.0 * scale, "timed_ms_per_token": 6.5 * scale,
                "linears_ms_per_token": 1.0, "rest_ms_per_token": 5.5 * scale,
                "slot_us_in_model": {n: 20.0 * scale + i for i, n in enumerate(SLOTS)},
                "slot_us_alone": {n: 10.0 * scale for n in SLOTS}}

    path = tmp_path / "host.json"
    path.write_text(json.dumps({"date": "d", "device": "g", "quant": "ptpc", "runs": [run("bf16", 1), run("row", 2)]}))
    fig = plot([str(path)], str(tmp_path / "host.png"))
    (ax,) = fig.axes
    heights = sorted(round(p.get_height(), 1) for p in ax.patches)
    assert heights == sorted([20.0 + i for i in range(7)] + [40.0 + i for i in range(7)])
    assert [list(line.get_ydata()) for line in ax.get_lines()] == [[10.0] * 7, [20.0] * 7]
    assert (tmp_path / "host.png").stat().st_size > 10_000


@pytest.mark.parametrize("m, n, k, k_padded, cfg", [(3, 200, 2000, 2048, (64, 256, 4, 4, 3)),
                                                    (17, 130, 1100, 1152, (32, 128, 4, 4, 3)),
                                                    (2, 64, 512, 512, (64, 256, 1, 4, 3)),
                                                    (40, 128, 4096, 4096, (64, 256, 8, 4, 3))], ids=lambda v: str(v))
@pytest.mark.parametrize("quant", ["blockscale", "ptpc"])
def test_probe_one_launch_gives_the_two_launches_bits(monkeypatch, quant, m, n, k, k_padded, cfg):
    """``scripts/inline_quant_mma.py``, probes' kernels that run a captured call of 2..64 rows as one
    launch: blockscale's MMA quantizing its own slice of the rows (``InlineLaunch``), ptpc's quantizer
    and split MMA as two phases of one cooperative launch, each program's first weight tile read
    before the wait (``PtpcOneLaunch``; under Triton's interpreter its phases run as two launches: a
    wait with more than one program never ends there; the probe checks the wait's bits on the GPU).
    Each gives the bits of the two launches at the same config (the quantizer, then the split MMA),
    K padded (1100 -> 1152: an empty slice), N past a block, 2..40 rows (16 and 64 wide), one slice
    and 4 / 8; and again on the next calls. blockscale's counters are never reset (each call adds
    SPLIT: the broken variant, a count compared with SPLIT - 1, leaves the second call's output
    unwritten: its NaNs stay); ptpc's are zeroed by its first phase (with that zeroing left out,
    likewise)."""
    from kernels_fused.hopper import decode as D
    from scripts.inline_quant_mma import InlineLaunch, PtpcOneLaunch
    from scripts.probe_decode_split_k import table_restorer, with_config

    monkeypatch.setattr(D, "resident_programs", lambda device: 132)
    monkeypatch.setattr(D, "ONE_LAUNCH", False)  # the two launches, as a capture takes them (ptpc's eager one
    x = activations(m, k, seed=m + 11)  # launch's wait, one program after another here, would never end)
    wq, ws = weight(n, k, k_padded, quant, seed=2)
    restore = table_restorer(D, [quant])
    try:
        with_config(D, quant, cfg)
        two = D._Launch(m, k, k_padded, n, quant, False, -1)
        assert two.kernel.grid == (-(-n // cfg[0]), cfg[2])
        want = torch.empty(m, n, dtype=torch.bfloat16)
        two(x, x.stride(0), wq, ws, None, want)
    finally:
        restore()
    assert_within_one_ulp(want, two_launches(x, wq, ws, quant, n, k_padded))
    one = (InlineLaunch if quant == "blockscale" else PtpcOneLaunch)(m, k, k_padded, n, cfg, "cpu")
    for call in range(3):  # blockscale's counters carry over from call to call; ptpc's are zeroed by each
        got = one(x, wq, ws, torch.full((m, n), float("nan"), dtype=torch.bfloat16))
        assert torch.equal(got, want), call
    if cfg[2] > 1:
        assert one.counters.tolist() == [3 * cfg[2] if quant == "blockscale" else cfg[2]] * len(one.counters)


def test_ptpc_one_launch_refused_falls_back_to_two():
    """A cooperative launch the driver refuses on the first call of a shape (a GPU share under MPS
    or green contexts: "too many blocks in cooperative launch") warns once and takes the two
    launches from then on, with the same product; any other error of the launch is raised."""
    from kernels_fused.hopper import decode as D

    m, n, k = 4, 64, 384
    x = activations(m, k, seed=4)
    wq, ws = weight(n, k, k, "ptpc")
    D._LAUNCHES.clear()
    want = D.decode_gemm(x, wq, ws, "ptpc", n=n)  # the one launch (one program under the interpreter)

    class Refused:
        fast = None

        def __init__(self, message):
            self.message = message

        def __call__(self, *args):
            raise RuntimeError(self.message)

    (launch,) = D._LAUNCHES.values()
    launch.one = Refused("Triton Error [CUDA]: too many blocks in cooperative launch")
    with pytest.warns(RuntimeWarning, match="refused"):
        got = D.decode_gemm(x, wq, ws, "ptpc", n=n)
    assert launch.one is None and torch.equal(got, want)
    D._LAUNCHES.clear()
    D.decode_gemm(x, wq, ws, "ptpc", n=n)
    (launch,) = D._LAUNCHES.values()
    launch.one = Refused("Triton Error [CUDA]: an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        D.decode_gemm(x, wq, ws, "ptpc", n=n)
    D._LAUNCHES.clear()


@pytest.mark.parametrize("cublas", [False, True], ids=["own MMA", "CCO_DECODE_BLOCKSCALE_CUBLAS"])
def test_vendor_rows_rule(monkeypatch, cublas):
    """blockscale's rows take its MMA over quantized rows (``QUANTIZED_ROWS``) at every K, and with
    ``CCO_DECODE_BLOCKSCALE_CUBLAS=1`` cuBLAS through the decode path (``VENDOR_ROWS``) where cuBLAS
    takes the K (a multiple of 4 scale blocks: 512 columns, not 384 or 2304), padded to its multiple
    of 4 rows; one row and the CPU (the interpreter has no cuBLAS) take a decode kernel. mxfp8's
    take it where the weight passed is its bf16 copy (``dense``), at every M and on the CPU too
    (torch's matmul). ptpc never does. The layers' rule follows: 64 rows where the decode path takes
    the K, one where it does not (mxfp8: the layers pass the copy)."""
    from kernels_fused.hopper import decode as D
    from kernels_fused.hopper import vendor

    if cublas:
        monkeypatch.setattr(D, "VENDOR_ROWS", {"blockscale", "mxfp8"})
        monkeypatch.setattr(D, "QUANTIZED_ROWS", {"ptpc"})
    assert [vendor.padded_rows(q, m) for q in ("ptpc", "blockscale", "mxfp8") for m in (1, 4, 5)] == [
        1, 4, 5, 4, 4, 8, 1, 4, 5]  # (the benchmarks pad with it too)
    assert [D.vendor_rows("blockscale", m, 512, 0) for m in (1, 2, 4, 5, 17, 64)] == (
        [0, 4, 4, 8, 20, 64] if cublas else [0] * 6)
    assert D.vendor_rows("blockscale", 5, 384, 0) == D.vendor_rows("blockscale", 5, 2304, 0) == 0
    assert D.vendor_rows("blockscale", 5, 512, -1) == 0
    assert D.vendor_rows("ptpc", 5, 512, 0) == D.vendor_rows("ptpc", 5, 512, 0, True) == 0
    assert D.vendor_rows("mxfp8", 5, 512, 0) == 0
    assert [D.vendor_rows("mxfp8", m, 512, d, True) for m, d in ((2, 0), (5, 0), (64, -1))] == [2, 5, 64]
    assert [D.decode_max_m("blockscale", k) for k in (384, 512, 2304, 14336)] == (
        [1, 64, 1, 64] if cublas else [64] * 4)
    assert (D.decode_max_m("ptpc", 384), D.decode_max_m("mxfp8", 512)) == (64, 64)
    assert D.rows_max("blockscale") == (D.ROWS_MAX if cublas else D.MMA_ROWS_MAX)


def test_mma_split_rule(monkeypatch):
    """The MMA's K split (``mma_split``): ptpc 2 where twice the weight's blocks fit one program per
    SM (Llama-3-8B's 64 blocks of 4096 features on 132 SMs; not 70B's 128 nor 8B qkv's 96), up to
    8 (4 from 32 rows wide) where a few blocks leave room (8B kv's 16); blockscale 4 where four times
    them fit two per SM (64 blocks), else 2 where twice them do (96 and 128 blocks; not gate+up's
    448), up to 8 at any width (8B kv); halved until each slice has two K steps; one SM (Triton's
    interpreter) never splits ptpc."""
    from kernels_fused.hopper import decode as D

    monkeypatch.setattr(D, "resident_programs", lambda device: 132)
    assert [D.mma_split("ptpc", p, 56, 0) for p in (64, 66, 67, 96, 128)] == [2, 2, 1, 1, 1]
    assert [D.mma_split("blockscale", p, 56, 0) for p in (64, 66, 67, 96, 128, 132, 133, 448)] == [
        4, 4, 2, 2, 2, 2, 1, 1]
    assert [D.mma_split("blockscale", 64, s, 0) for s in (8, 7, 4, 3, 1)] == [4, 2, 2, 1, 1]
    assert [D.mma_split("ptpc", 64, s, 0) for s in (4, 3)] == [2, 1]
    # 8B kv (16 blocks, 16 steps): ptpc 8 slices up to 16 rows wide, 4 from 32 (MMA_SPLIT_WIDE)
    assert [D.mma_split("ptpc", 16, 16, 0, rows) for rows in (16, 32, 64)] == [8, 4, 4]
    assert [D.mma_split("blockscale", 16, 16, 0, rows) for rows in (16, 32, 64)] == [8, 8, 8]
    monkeypatch.undo()
    assert D.mma_split("ptpc", 1, 56, -1) == 1


# the slices the rule gives (ptpc, blockscale): MMA_SPLIT's cap (8, 8) halved while a slice would take
# fewer than two steps of BLOCK_K 256 (128 where 256 does not divide K_PAD)
@pytest.mark.parametrize("m, n, k, k_padded, splits", [(2, 200, 2000, 2048, (4, 4)), (17, 200, 2000, 2048, (4, 4)),
                                                         (5, 130, 1100, 1152, (4, 4)), (3, 200, 4000, 4096, (8, 8))],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("quant", ["ptpc", "blockscale"])
def test_mma_rows_with_k_split(monkeypatch, quant, m, n, k, k_padded, splits):
    """The MMA over quantized rows with K split over programs (a GPU of 132 SMs assumed, so the
    rule splits a weight of 3 or 4 blocks into as many slices as its K steps allow: 4, and 8 at K
    4096): within one ulp of the two-launch reference at 16 and 32 rows wide, the bias as
    ``out += bias``, the same bits on a repeat, and the same product as the unsplit MMA to within its
    rounding. K 1152 is 9 steps of 128 (256 does not divide it), so the slices take 3, 3, 3 and 0
    steps (an empty slice counts in with a zero partial) and N 130 leaves a block of 2 features."""
    from kernels_fused.hopper import decode as D

    monkeypatch.setattr(D, "resident_programs", lambda device: 132)
    monkeypatch.setattr(D, "ONE_LAUNCH", False)  # (the interpreter cannot run the one launch's wait over 4 programs)
    x = activations(m, k, seed=m).flip(1).contiguous()
    wq, ws = weight(n, k, k_padded, quant)
    want = two_launches(x, wq, ws, quant, n, k_padded)
    D._LAUNCHES.clear()
    got = D.decode_gemm(x, wq, ws, quant, n=n)
    (launch,) = D._LAUNCHES.values()
    blocks = -(-n // 64)
    assert launch.kernel.grid == (blocks, splits[quant == "blockscale"]) and launch.layout.counter_words == 4
    assert_within_one_ulp(got, want)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    assert torch.equal(D.decode_gemm(x, wq, ws, quant, n=n, bias=bias), got + bias)
    assert torch.equal(D.decode_gemm(x, wq, ws, quant, n=n), got)
    monkeypatch.setattr(D, "MMA_SPLIT", {"ptpc": 1, "blockscale": 1})
    monkeypatch.setattr(D, "MMA_SPLIT_WIDE", {"ptpc": 1, "blockscale": 1})
    D._LAUNCHES.clear()
    unsplit = D.decode_gemm(x, wq, ws, quant, n=n)
    assert [launch.kernel.grid for launch in D._LAUNCHES.values()] == [(blocks, 1)]
    assert_within_one_ulp(got, unsplit)
    D._LAUNCHES.clear()


@pytest.mark.parametrize("zeroed", [True, False], ids=["quantizer zeroes", "broken: counters left"])
@pytest.mark.parametrize("quant", ["ptpc", "blockscale"])
def test_mma_split_counters_come_zeroed_from_the_quantizer(monkeypatch, quant, zeroed):
    """The split MMA's counters live in the call's scratch (``MmaScratch``), which the caching
    allocator hands out unwritten: the quantizer's launch zeroes them (``ZERO_WORDS``), so a scratch
    full of old bytes gives the product. Without the zeroing (the broken variant) no program of a
    block sees itself last and the output is never written (it keeps the NaNs put there)."""
    from kernels_fused.hopper import decode as D

    monkeypatch.setattr(D, "resident_programs", lambda device: 132)
    monkeypatch.setattr(D, "ONE_LAUNCH", False)
    m, n, k = 3, 200, 2048
    x = activations(m, k, seed=5)
    wq, ws = weight(n, k, k, quant)
    D._LAUNCHES.clear()
    want = D.decode_gemm(x, wq, ws, quant, n=n)
    (launch,) = D._LAUNCHES.values()
    assert launch.q_args[1][-1] == launch.layout.counter_words == 4  # (the quantizer's ZERO_WORDS)
    if not zeroed:
        launch.q_args = (launch.q_args[0], (*launch.q_args[1][:-1], 0))
    scale = ws.view(torch.uint8) if ws.element_size() == 1 else ws
    scratch = torch.full((launch.layout.bytes,), 0x55, dtype=torch.uint8)  # an old call's bytes
    q, sa, counters, parts = launch.layout.views(scratch)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    launch.quantize(-1, *launch._quantize(x, q, sa, x.stride(0)))
    launch.kernel(-1, *launch._mma(q, sa, wq, scale, out, out, counters, parts, scale.stride(0)))
    assert torch.equal(out, want) == zeroed
    assert bool(out.isnan().all()) != zeroed
    D._LAUNCHES.clear()


@pytest.mark.parametrize("m, n, k, k_padded", [(2, 64, 256, 256), (5, 200, 300, 384), (17, 136, 640, 640)],
                         ids=lambda v: str(v))
def test_mxfp8_rows_over_the_bf16_copy(m, n, k, k_padded):
    """mxfp8 with the weight's bf16 copy as ``w`` (``VENDOR_ROWS``): the layer's general path bit for
    bit, the activation quantizer's bytes and ``vendor.mx_to_bf16`` of them written by one launch
    (the quantizer's, dequantizing), the matmul over the copy (its ``[:, :n]`` share where N is
    padded), then ``+= bias``; the fp8 weight at the same M (up to ``ROWS_MAX``) takes the rows kernel
    (another key: the weight's dtype)."""
    from kernels_fused.hopper import decode as D
    from kernels_fused.hopper.quantize import quantize_activation
    from kernels_fused.hopper.vendor import mx_to_bf16

    x = activations(m, k, seed=m + 3)
    wq, ws = weight(n, k, k_padded, "mxfp8")
    dense = mx_to_bf16(wq, ws)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    a, s = quantize_activation(x, "mxfp8", k_padded=k_padded)
    want = torch.matmul(mx_to_bf16(a, s), dense.t())[:, :n].contiguous()
    want += bias
    D._LAUNCHES.clear()
    got = D.decode_gemm(x, dense, ws, "mxfp8", n=n, bias=bias)
    assert got.shape == (m, n) and torch.equal(got, want)
    (launch,) = D._LAUNCHES.values()
    assert launch.vendor == m and launch.kernel is None and launch.q_args[1][-2] is True  # (DEQUANTIZE)
    if m <= D.ROWS_MAX:  # (past it the one-row kernel, a program per row: test_decode_gemm_equals_quantizer_...)
        fp8 = D.decode_gemm(x, wq, ws, "mxfp8", n=n, bias=bias)  # the rows kernel: within the fp8 budget of the same
        assert len(D._LAUNCHES) == 2 and float((fp8.float() - want.float()).abs().max()) <= 0.02 * float(
            want.float().abs().max())
    with pytest.raises(ValueError, match="e4m3 .* got torch.bfloat16"):  # another quant's w must be e4m3
        D.decode_gemm(x, dense, ws, "ptpc", n=n)
    D._LAUNCHES.clear()


def test_lt_workspace_rule(monkeypatch):
    """The workspace bound the C++ table's kept cuBLASLt call offers the heuristic is torch's own
    (its pick depends on it, and the call must pick torch's algorithm to give its bits): 1 MiB by
    default on every GPU, ``CUBLASLT_WORKSPACE_SIZE`` (KiB) where set, capped at cuBLAS's workspace
    (32 MiB on Hopper, 8 MiB + 128 KiB on an older GPU, ``CUBLAS_WORKSPACE_CONFIG``'s pairs summed)
    while the two are unified, and not capped where they are not."""
    from kernels_fused.hopper import decode as D

    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    for name in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "TORCH_CUBLASLT_UNIFIED_WORKSPACE"):
        monkeypatch.delenv(name, raising=False)
    assert D.lt_workspace_bytes(0) == 1 << 20  # what torch 2.11 asked with on an H200
    capability[0] = (8, 0)
    assert D.lt_workspace_bytes(0) == 1 << 20
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "65536")  # more than an older GPU's cuBLAS workspace: capped
    assert D.lt_workspace_bytes(0) == (8 << 20) + (128 << 10)
    capability[0] = (9, 0)
    assert D.lt_workspace_bytes(0) == 32 << 20
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    assert D.lt_workspace_bytes(0) == (8 << 20) + (128 << 10)
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "2048")
    assert D.lt_workspace_bytes(0) == 2 << 20
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # 128 KiB of cuBLAS workspace caps the default too
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE")
    assert D.lt_workspace_bytes(0) == 128 << 10
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "0")
    assert D.lt_workspace_bytes(0) == 1 << 20
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "65536")
    assert D.lt_workspace_bytes(0) == 64 << 20


@pytest.mark.parametrize("m, n, k, k_padded", [(1, 200, 2000, 2048), (3, 200, 2000, 2048), (64, 64, 1024, 1024)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("quant", ["ptpc", "blockscale"])
def test_rows_mma_over_rows_quantized_elsewhere(monkeypatch, quant, m, n, k, k_padded):
    """``RowsMma``: the decode MMA over rows the activation quantizer wrote for someone else (a
    collective call's operands, ``cco.backends.cuda.DECODE_SPLIT_ROWS``), K split over programs (a
    GPU of 132 SMs assumed): within one ulp of the two-launch reference, the decode GEMM's own
    captured path bit for bit (the same MMA over the same bytes) from two rows on, and the same bits
    again on a second call into an output poisoned with NaN: each block's last slice sets its
    counter back to zero, so the one launch a call makes finds them zero (without that no program of
    a block sees itself last on the second call, which writes nothing: checked by hand, 2026-12-07,
    on the kernel without the reset)."""
    from kernels_fused.hopper import decode as D
    from kernels_fused.hopper.quantize import quantize_activation

    monkeypatch.setattr(D, "resident_programs", lambda device: 132)
    monkeypatch.setattr(D, "ONE_LAUNCH", False)  # decode_gemm's two launches, as a capture takes them
    x = activations(m, k, seed=m + 7)
    wq, ws = weight(n, k, k_padded, quant)
    a, sa = quantize_activation(x, quant, k_padded=k_padded)
    mma = D.RowsMma(quant, m, k_padded, n, torch.device("cpu"))
    split = mma.kernel.grid[1]
    assert split > 1, "the rule split no weight here: the counters go unchecked"
    outs = []
    for _ in range(2):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        mma(a, sa, wq, ws, out)
        outs.append(out)
        assert not bool(mma.counters.any())  # set back to zero by each block's last slice
    assert torch.equal(outs[0], outs[1])
    assert_within_one_ulp(outs[0], two_launches(x, wq, ws, quant, n, k_padded))
    if m > 1:
        D._LAUNCHES.clear()
        assert torch.equal(outs[0], D.decode_gemm(x, wq, ws, quant, n=n))
        D._LAUNCHES.clear()
    with pytest.raises(ValueError, match="RowsMma: mxfp8 rows of 2"):
        D.RowsMma("mxfp8", 2, k_padded, n, torch.device("cpu"))
    with pytest.raises(ValueError, match=f"rows of {D.MMA_ROWS_MAX + 1}"):
        D.RowsMma(quant, D.MMA_ROWS_MAX + 1, k_padded, n, torch.device("cpu"))


def test_world_gemm_probe_times_the_backends_lsa_tiles_and_draws_each_shape(tmp_path):
    """``probe_decode_world_gemm``: the lsa tiles it times are the CUDA backend's (``_init_lsa``: the
    layout's m-tile, ptpc's 256-column tile where the slice takes two layout tiles, blockscale's 128,
    the ticket launch), and ``--from RUN.json --plot`` draws a panel per shape from the cold times,
    an arm missing at a cell (found wrong there) left out of that cell only."""
    pytest.importorskip("matplotlib")
    import json

    from cco.backends.cuda import LSA_LAUNCH
    from scripts.probe_decode_world_gemm import lsa_config, plot

    ptpc, bs = lsa_config("ptpc", 4096, 2), lsa_config("blockscale", 4096, 8)
    assert (ptpc.block_m, ptpc.block_n, ptpc.launch) == (128, 256, LSA_LAUNCH)
    assert (bs.block_m, bs.block_n, bs.launch) == (64, 128, LSA_LAUNCH)
    assert lsa_config("ptpc", 128 * 3 * 2, 2).block_n == 128  # a slice of 3 layout tiles: not two wide

    def times(m, drop=()):
        t = {"nn.Linear bf16": 10.0 * m, "lsa GEMM": 20.0 * m, "decode GEMM": 6.0 * m, "decode GEMM + copy": 7.0 * m}
        return {a: v for a, v in t.items() if a not in drop}

    rows = [{"shape": s, "n": 4096, "k": 2048, "m": m, "quant": q, "us": times(1),
             "us_cold": times(m, ("lsa GEMM",) if (q, m) == ("blockscale", 8) else ())}
            for s in ("8b-o-tp2", "8b-down-tp2") for q in ("ptpc", "blockscale") for m in (1, 8)]
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"date": "d", "gpu": "g", "rows": rows}))
    fig = plot(str(run), str(tmp_path / "run.png"))
    assert len([ax for ax in fig.axes if ax.get_visible()]) == 2
    lines = {line.get_label(): list(line.get_ydata()) for line in fig.axes[1].get_lines()}
    assert lines["nn.Linear bf16"] == [10, 80] and lines["ptpc: lsa GEMM"] == [20, 160]
    assert lines["blockscale: lsa GEMM"] == [20] and lines["blockscale: decode GEMM + copy"] == [7, 56]
    assert (tmp_path / "run.png").stat().st_size > 10_000
