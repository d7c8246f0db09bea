"""The gfx950 kernel on a real MI350/MI355X: one GPU, no communicator.

Skipped on every machine without a gfx950 device, with the probe's reason. The probe only reads
device properties; nothing is compiled or launched without the device (a FlyDSL launch there
aborts the process).

The tail test is the guard of the race in the source text: the peeled step K-2 pre-read the final
B0/A0 before any wait covered their DMA, so ptpc 4096x7168x256 was wrong on 12/12 launches. Each
shape is launched 12 times into a NaN-poisoned output and every launch is compared element-wise
(> 5% off against the bf16-rounded fp32 reference): the corruption can sit near the fp8 floor,
where a relative-L2 gate misses it.

The epilogue stages C through LDS and stores 16 bytes per lane: every quant on every tile (256x256
is the plain GEMM's tile for every quant), an M that ends inside a tile (rows past M must be
dropped whole, nothing written past C: a canary after it), and the fused mode, whose window
slices must hold the plain GEMM's bits exactly.
"""

import pytest
import torch

from cco.preshuffle import preshuffle_b
from cco.quant import REL_L2_TOL, count_mismatches, random_problem, rel_l2
from kernels_fused.gfx950.kernel import compile_fused_gemm_scatter, gfx950_device_reason

_WHY = gfx950_device_reason()
pytestmark = [pytest.mark.gfx950, pytest.mark.skipif(_WHY is not None, reason=f"needs a gfx950 device: {_WHY}")]

LAUNCHES = 12
TAIL_SHAPES = [pytest.param(4096, 7168, 256, id="4096x7168x256"), pytest.param(16384, 7168, 512, id="16384x7168x512")]
TILES = {"ptpc": (256, 256), "blockscale": (256, 256), "mxfp8": (256, 256)}  # gfx950 backend's gemm_tile
ALL_TILES = [pytest.param((256, 256), id="256x256"), pytest.param((128, 256), id="128x256"),
             pytest.param((256, 128), id="256x128")]
QUANTS = ["ptpc", "blockscale", "mxfp8"]


CANARY = 1234.5  # what the memory after C holds: a store past C's last row would change it


def _run(quant, m, n, k, *, launches, seed=0, tile=None):
    """Per launch, the count of wrong elements; plus the last output and the reference. C is the
    head of a larger buffer whose tail holds ``CANARY``: any store past C fails the call."""
    bm, bn = tile or TILES[quant]
    p = random_problem(m, n, k, quant, seed=seed, device="cuda")
    ref = p.reference()
    launch = compile_fused_gemm_scatter(0, 1, K=k, BLOCK_M=bm, BLOCK_N=bn, quant=quant, fuse=False)
    b_pre = preshuffle_b(p.b)
    buf = torch.empty((m + bm) * n, dtype=torch.bfloat16, device="cuda")
    out = buf[:m * n].view(m, n)
    bad = []
    for _ in range(launches):
        buf.fill_(CANARY)
        out.fill_(float("nan"))
        launch(p.a, b_pre, out, p.a_scale, p.b_scale, m, n)
        torch.cuda.synchronize()
        bad.append(count_mismatches(out, ref))
        assert bool((buf[m * n:] == CANARY).all()), "the epilogue wrote past the end of C"
    return bad, out, ref


@pytest.mark.parametrize("tile", ALL_TILES)
@pytest.mark.parametrize("quant", QUANTS)
def test_every_quant_and_tile_matches_an_fp32_reference(quant, tile):
    bad, out, ref = _run(quant, 2048, 7168, 1024, launches=1, tile=tile)
    assert bad == [0]
    assert rel_l2(out, ref) < REL_L2_TOL[quant]


@pytest.mark.parametrize("tile", ALL_TILES)
@pytest.mark.parametrize("quant", QUANTS)
def test_rows_past_m_are_dropped_by_the_16_byte_stores(quant, tile):
    """M ends inside the last tile: its 16-byte row stores past M fall outside C's descriptor and
    must be dropped whole (the canary after C stays), the rows before M written."""
    bad, out, ref = _run(quant, 2048 + 100, 7168, 512, launches=1, tile=tile)
    assert bad == [0]


@pytest.mark.parametrize("m,n,k", TAIL_SHAPES)
def test_ptpc_tail_reads_complete_lds(m, n, k):
    bad, _, _ = _run("ptpc", m, n, k, launches=LAUNCHES)
    assert bad == [0] * LAUNCHES, f"wrong elements per launch: {bad}"


@pytest.mark.parametrize("m,n,k", TAIL_SHAPES)
def test_blockscale_tail_reads_complete_lds(m, n, k):
    bad, _, _ = _run("blockscale", m, n, k, launches=LAUNCHES)
    assert bad == [0] * LAUNCHES, f"wrong elements per launch: {bad}"


@pytest.mark.parametrize("m,n,k", TAIL_SHAPES)
def test_mxfp8_tail_reads_complete_lds(m, n, k):
    bad, _, _ = _run("mxfp8", m, n, k, launches=LAUNCHES)
    assert bad == [0] * LAUNCHES, f"wrong elements per launch: {bad}"


@pytest.mark.parametrize("pattern", ["all-reduce", "reduce-scatter-rows"])
@pytest.mark.parametrize("tile", [pytest.param((256, 256), id="256x256"), pytest.param((256, 128), id="256x128")])
@pytest.mark.parametrize("quant", QUANTS)
def test_fused_writes_partial_slices_and_bumps_each_counter_by_its_tile_count(quant, tile, pattern):
    """fuse=True on one GPU with world=2 addressing: partial[dest] holds dest's slice of the product
    (its column slice, or for the reduce-scatter along rows its M/W rows of every column), bit for
    bit what the plain GEMM writes there (the same staged epilogue, another destination), and
    counters[dest, chunk] grow by the tile counts of cco.layout (twice over two calls: never reset)."""
    from cco import layout

    world, rank, m, n, k = 2, 1, 2048, 7168, 512
    bm, bn = tile
    p = random_problem(m, n, k, quant, seed=3, device="cuda")
    lay = layout.build_config(n=n, k=k, m_max=m, world=world, quant=quant, mode="fused", chunks=4,
                              block_m=bm, block_n=bn, pattern=pattern)
    launch = compile_fused_gemm_scatter(rank, world, K=k, BLOCK_M=bm, BLOCK_N=bn, quant=quant, fuse=True, chunks=4,
                                        pattern=pattern)
    partial = torch.full((world, lay.m_max_padded, lay.n_slice), float("nan"), dtype=torch.bfloat16, device="cuda")
    counters = torch.zeros(world, layout.MAX_CHUNKS, dtype=torch.int64, device="cuda")
    b_pre = preshuffle_b(p.b)
    base = layout.zero_counters(world)
    for seq in (1, 2):
        plan = layout.plan_call(lay, m=m, seq=seq, rank=rank, counter_base=base)
        launch(p.a, b_pre, partial, p.a_scale, p.b_scale, m, n, counters)
        torch.cuda.synchronize()
        assert counters.cpu().tolist() == [list(r) for r in plan.counter_targets]
        base = plan.counter_targets
    plain = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    compile_fused_gemm_scatter(0, 1, K=k, BLOCK_M=bm, BLOCK_N=bn, quant=quant, fuse=False)(
        p.a, b_pre, plain, p.a_scale, p.b_scale, m, n)
    torch.cuda.synchronize()
    ref = p.reference()
    rows = layout.slice_rows(lay, m)
    for dest in range(world):
        r0, c0 = layout.slice_origin(lay, dest, rows)
        got = partial[dest, :rows]
        assert count_mismatches(got, ref[r0:r0 + rows, c0:c0 + lay.n_slice]) == 0
        assert torch.equal(got, plain[r0:r0 + rows, c0:c0 + lay.n_slice])
