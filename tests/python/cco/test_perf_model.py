"""The cost model behind docs/SCALING.md (``cco.bench.perf_model``): its byte counts, floors and timeline
arithmetic, the calibration reproducing the 2-GPU figures it was fitted on (and the held-out ones
within the stated bound), and its agreement with the code it models (stream order, tile sizes).

Guards against: a byte formula off by the (W-1)/W factor, a simulator that moves bytes faster than
the link or lets the fused op beat its floor, a calibration that silently stops reproducing the
measurements, and a model that drifts from the transport's real submission order."""

import pytest

from cco.bench import perf_model as P

pytestmark = pytest.mark.host

MS = (2048, 3000, 4096, 8192, 16384, 32768)  # 3000: not a sweep point (interpolated GEMM, ragged chunks)
FITTED_TOLERANCE = 0.005  # fitted points are solved for: reproduced to bisection precision


@pytest.fixture(scope="module")
def cal():
    return P.calibrate()


# ---- bytes and floors -------------------------------------------------------------------------------
@pytest.mark.parametrize("world", P.WORLDS)
def test_link_bytes_bf16_is_two_w_minus_one_over_w_times_2mn(world):
    m, n = 16384, P.N
    assert P.link_bytes(m, n, world) == 2 * (world - 1) * 2 * m * n // world
    assert P.link_bytes(m, n, world) == pytest.approx(P.nccl_bytes(m, n, world), rel=1e-12)


def test_link_bytes_match_the_design_figure():
    # DESIGN.md: a 2-rank all-reduce of a 16384x7168 bf16 partial moves 235 MB per direction
    assert P.link_bytes(16384, 7168, 2) / 1e6 == pytest.approx(234.9, abs=0.05)


@pytest.mark.parametrize("world", P.WORLDS)
def test_fp8_gather_sends_one_byte_per_element_plus_group_scales(world):
    m, n = 4096, P.N
    scatter = (world - 1) * m * (n // world) * 2
    groups = -(-(n // world) // 128)  # one fp32 scale per row and 128 columns
    gather = (world - 1) * (m * (n // world) + 4 * m * groups)
    assert P.link_bytes(m, n, world, gather="fp8") == scatter + gather
    assert P.link_bytes(m, n, world, gather="fp8") < P.link_bytes(m, n, world)


def test_bytes_grow_with_world_toward_twice_the_partial():
    b = [P.link_bytes(16384, P.N, w) for w in P.WORLDS]
    assert b[0] < b[1] < b[2] < 2 * 2 * 16384 * P.N


@pytest.mark.parametrize("world", P.WORLDS)
@pytest.mark.parametrize("quant", P.QUANTS)
@pytest.mark.parametrize("gather", P.GATHERS)
def test_fused_never_beats_its_floor_nor_loses_to_split(cal, world, quant, gather):
    for m in MS:
        floor = P.fused_floor_us(m, world, quant=quant, gather=gather, cal=cal)
        link = P.link_bytes(m, P.N, world, gather=gather) / (cal.copy_gbs * 1e3)
        gemm = P.gemm_us(m, quant=quant, kernel="gemm-only", cal=cal)
        assert floor == pytest.approx(max(gemm, link))
        fused = P.fused_us(m, world, quant=quant, gather=gather, cal=cal)
        split = P.split_us(m, world, quant=quant, gather=gather, cal=cal)
        assert floor <= fused <= split, (m, floor, fused, split)
        assert split >= gemm + link  # split moves nothing before the GEMM ends


@pytest.mark.parametrize("world", P.WORLDS)
@pytest.mark.parametrize("chunks, lanes", [(1, 1), (4, 1), (8, 1), (4, 2), ((1, 2, 2, 1), 2)])
def test_simulated_link_moves_exactly_the_bytes_at_the_copy_rate(cal, world, chunks, lanes):
    for gather in P.GATHERS:
        for m in MS:
            tl = P.simulate(m, world, gather=gather, cal=cal, chunks=chunks, lanes=lanes)
            moved = tl.link_busy_us * cal.copy_gbs * 1e3
            assert moved == pytest.approx(P.link_bytes(m, P.N, world, gather=gather), rel=1e-6)


def test_a_second_lane_hides_the_step_latency_between_copies(cal):
    """Eight chunks on one put stream pay the step latency between every two copies; with two lanes
    one lane's latency runs while the other's copy moves, so the call gets faster, and more so the
    longer the latency (at zero latency a lane has nothing to hide)."""
    gains = []
    for lat in (0.0, 10.0, 30.0):
        c = cal.with_(step_latency_us=lat)
        one, two = (P.fused_us(16384, 2, cal=c, chunks=8, lanes=lanes) for lanes in (1, 2))
        gains.append(one - two)
    assert gains[1] > 0 and gains[2] > gains[1]
    assert abs(gains[0]) < gains[2]


def test_timeline_order(cal):
    gemm = P.gemm_us(16384, quant="ptpc", kernel="gemm-only", cal=cal)
    for world in P.WORLDS:
        tl = P.simulate(16384, world, cal=cal)
        assert list(tl.reduce_end) == sorted(tl.reduce_end)
        assert all(a > r for a, r in zip(tl.assemble_end, tl.reduce_end))
        assert tl.end == tl.assemble_end[-1]
        assert tl.gemm_end > gemm  # reduce and assemble kernels took SMs from the fused GEMM
        assert 0 < tl.first_put_start < tl.gemm_end  # the first put overlaps the GEMM
        split = P.simulate(16384, world, cal=cal, overlap=False)
        assert split.gemm_end == pytest.approx(gemm) and split.first_put_start == pytest.approx(gemm)


def test_first_slice_is_one_over_world_times_chunks_of_the_gemm(cal):
    """The walk order makes the first peer slice complete after 1/(W*C) of the GEMM (rounded up to
    the GEMM's wave); the put starts one step latency later."""
    for world in P.WORLDS:
        gemm = P.gemm_us(16384, quant="ptpc", kernel="gemm-only", cal=cal)
        wave = gemm / P.gemm_waves(16384, world, quant="ptpc")
        first = P.simulate(16384, world, cal=cal).first_put_start
        expect = gemm / (world * P.CHUNKS)
        assert expect <= first < expect + wave + 1e-6


# ---- monotonicity -----------------------------------------------------------------------------------
@pytest.mark.parametrize("quant", P.QUANTS)
def test_every_arm_grows_with_m(cal, quant):
    for world in P.WORLDS:
        preds = [P.predict(m, world, quant=quant, cal=cal) for m in MS]
        for attr in ("baseline_us", "split_us", "split_fp8_us", "fused_us", "fused_fp8_us", "floor_us"):
            values = [getattr(p, attr) for p in preds]
            assert values == sorted(values) and len(set(values)) == len(values), (attr, values)


def test_baseline_and_link_floor_grow_with_world(cal):
    for m in MS:
        base = [P.baseline_us(m, w, cal=cal) for w in P.WORLDS]
        link = [P.link_bytes(m, P.N, w) for w in P.WORLDS]
        assert base == sorted(base) and link == sorted(link)


def test_sensitivities_move_the_ratio_the_physical_way(cal):
    s = P.sensitivity(cal=cal)
    base_bf16, base_fp8 = s["as calibrated"]
    assert base_fp8 < base_bf16
    faster = next(v for k, v in s.items() if k.startswith("copy rate up to"))
    slower = next(v for k, v in s.items() if k.startswith("copy rate x0.75"))
    better_nccl = next(v for k, v in s.items() if k.startswith("NCCL bus bandwidth x1.2"))
    later = next(v for k, v in s.items() if k.startswith("step latency x2"))
    assert faster[0] < base_bf16 < slower[0]
    assert better_nccl[0] > base_bf16  # a faster baseline makes fusing pay less
    assert later[0] > base_bf16


# ---- calibration ------------------------------------------------------------------------------------
def test_calibration_reproduces_its_fitted_points(cal):
    fitted = [c for c in P.check_2gpu(cal) if c.fitted]
    assert {(c.arm, c.m) for c in fitted} == {("fused", m) for m in P.FUSED_FIT_M} | {
        ("scaled_mm+nccl", m) for m in P.NCCL_FIT_M}
    for c in fitted:
        assert abs(c.error) <= FITTED_TOLERANCE, c


def test_held_out_points_within_the_stated_bound(cal):
    held = [c for c in P.check_2gpu(cal) if not c.fitted]
    assert len(held) == 16  # split x5, fused-fp8 x5, fused x3, nccl x3
    worst = max(held, key=lambda c: abs(c.error))
    assert abs(worst.error) <= P.HELD_OUT_TOLERANCE, worst


def test_fitted_parameters_are_physical(cal):
    lo, hi = P.H200X2["copy_gbs_range"]
    assert lo <= cal.copy_gbs <= hi  # fitted on times, checked against the profile's copies
    assert cal.copy_gbs < P.NVLINK_GBS
    assert 0 < cal.step_latency_us < 50
    assert 0 < cal.nccl_alpha_us < 100 and 200 < cal.nccl_busbw_gbs < P.NVLINK_GBS


def test_calibration_refuses_measurements_it_cannot_reproduce():
    data = {**P.H200X2, "sweep": {m: dict(v) for m, v in P.H200X2["sweep"].items()}}
    data["sweep"][16384]["fused"] = 300.0  # faster than the GEMM alone: no rate and latency give it
    with pytest.raises(ValueError, match="calibrate"):
        P.calibrate(data)


def test_blockscale_gemm_uses_the_measured_factor_of_each_kernel(cal):
    """Blockscale's GEMMs are ptpc's of the same library times the one-GPU ratio: the Triton kernel's
    for the op's arms, cuBLAS's blockwise recipe for the baseline (as the benchmark runs it)."""
    for kernel, ratio in (("gemm-only", 578.7 / 411.3), ("scaled_mm", 391.0 / 318.7)):
        ptpc = P.gemm_us(16384, quant="ptpc", kernel=kernel, cal=cal)
        assert P.gemm_us(16384, quant="blockscale", kernel=kernel, cal=cal) == pytest.approx(ptpc * ratio)


def test_blockscale_waves_count_three_programs_per_sm():
    # 64x128 tiles, three resident per SM: 256 x 56 tiles at M = 16384 over 396 slots
    assert P.gemm_waves(16384, 2, quant="blockscale") == -(-(256 * 56) // (3 * P.H200_SMS))


def test_gemm_interpolates_between_measured_m(cal):
    a = P.gemm_us(8192, quant="ptpc", kernel="scaled_mm", cal=cal)
    b = P.gemm_us(16384, quant="ptpc", kernel="scaled_mm", cal=cal)
    assert P.gemm_us(12288, quant="ptpc", kernel="scaled_mm", cal=cal) == pytest.approx((a + b) / 2)


# ---- agreement with the code it models ---------------------------------------------------------------
def test_put_stream_order_is_the_transports():
    dma = pytest.importorskip("cco.cuda.dma")
    for chunks in range(1, 9):
        submitted = [s for s in dma.submission_order(chunks) if s[0] in ("scatter", "gather")]
        assert P.put_stream_order(chunks) == submitted


def test_tile_constants_are_the_kernels():
    cuda = pytest.importorskip("cco.backends.cuda")
    tg = pytest.importorskip("kernels_fused.hopper.gemm")
    for quant in P.QUANTS:
        assert (P.CUDA_BLOCK_M[quant], P.CUDA_BLOCK_N) == cuda.CudaBackend.tile(quant)
        assert P.TRITON_BLOCK_N[quant] == tg.default_config(quant).block_n


def test_ptpc_fused_tile_narrows_at_world_8():
    # 7168 / 8 = 896 = 7 x 128: two 128-wide layout tiles do not pair up, so the launch is 128 wide
    assert [P.fused_block_n("ptpc", w) for w in P.WORLDS] == [256, 256, 128]
    assert [P.fused_block_n("blockscale", w) for w in P.WORLDS] == [128, 128, 128]
    assert P.gemm_waves(16384, 8, quant="ptpc") == -(-(128 * 56) // P.H200_SMS)


# ---- boundary -------------------------------------------------------------------------------------
def test_rejects_what_it_does_not_model(cal):
    with pytest.raises(ValueError, match="quant='mxfp8'"):
        P.predict(16384, 8, quant="mxfp8", cal=cal)
    with pytest.raises(ValueError, match="m=65536"):
        P.fused_us(65536, 8, cal=cal)
    with pytest.raises(ValueError, match="world=16"):
        P.fused_us(16384, 16, cal=cal)
    with pytest.raises(ValueError, match="gather='fp16'"):
        P.link_bytes(16384, P.N, 8, gather="fp16")


# ---- the CLI --------------------------------------------------------------------------------------
def test_cli_prints_the_table_and_the_check(capsys):
    from scripts import predict_scaling

    predict_scaling.main(["--worlds", "8", "-m", "16384", "--no-plot"])
    out = capsys.readouterr().out
    assert "PREDICTED" in out
    rows = [line for line in out.splitlines() if line.lstrip().startswith("8 ")]
    assert len(rows) == len(P.QUANTS)
    predict_scaling.main(["--check"])
    out = capsys.readouterr().out
    assert out.count("held out") == 16 + 1 and out.count("fitted") == 4


def test_cli_prints_every_variant_with_the_model_s_own_figures(capsys):
    from scripts import predict_scaling

    predict_scaling.main(["--variants", "--worlds", "2", "-m", "16384"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.lstrip().startswith("2  16384")]
    assert len(rows) == len(predict_scaling.VARIANTS)
    cal = P.calibrate()
    for row, (_, chunks, lanes) in zip(rows, predict_scaling.VARIANTS):
        fused = float(row.split("|")[1].split()[0])
        assert fused == pytest.approx(P.fused_us(16384, 2, cal=cal, chunks=chunks, lanes=lanes), abs=0.05)


def test_cli_writes_the_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from scripts import predict_scaling

    path = tmp_path / "w8.png"
    predict_scaling.main(["--worlds", "8", "-m", "4096", "--plot", str(path)])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
