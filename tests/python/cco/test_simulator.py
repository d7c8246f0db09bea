"""Seeded latency simulator of the 8-wave pipeline on real fp8 data.

``test_ptpc_tail_reads_complete_lds`` is the CPU analog of the hardware test of the same name
(seeds/001): 12 launches per shape into a NaN-poisoned output, element-wise against the
bf16-rounded fp32 reference; it must fail on ``upstream`` and pass on ``shipped``.
"""

from dataclasses import replace

import numpy as np
import pytest
import torch

from cco.quant import count_mismatches, random_problem
from kernels_fused.pipeline.happens_before import check
from kernels_fused.pipeline.schedule import LdsRead, build_schedule
from kernels_fused.pipeline.simulator import (PREV_WG, GemmData, LatencyModel, StaleRows, count_wrong,
                                     find_stale, run_launches, simulate_timing, stale_errors)

pytestmark = pytest.mark.host

LAUNCHES = 12


@pytest.fixture(scope="module")
def ptpc_4096x7168x256():
    return random_problem(4096, 7168, 256, "ptpc", seed=0)


def test_ptpc_tail_reads_complete_lds(ptpc_4096x7168x256):
    """seeds/001: ptpc 4096x7168x256 was wrong on 12/12 launches before the tail drain."""
    p = ptpc_4096x7168x256
    upstream = run_launches(build_schedule(k=256, variant="upstream"), p, launches=LAUNCHES,
                            seed=1, exact=False)
    assert sum(r.wrong > 0 for r in upstream) >= LAUNCHES // 2
    shipped = run_launches(build_schedule(k=256, variant="shipped"), p, launches=LAUNCHES, seed=1)
    assert [r.wrong for r in shipped] == [0] * LAUNCHES
    assert [r.stale_groups for r in shipped] == [0] * LAUNCHES


def test_shipped_is_clean_at_k512():
    p = random_problem(4096, 7168, 512, "ptpc", seed=2)
    res = run_launches(build_schedule(k=512, variant="shipped"), p, launches=LAUNCHES, seed=3)
    assert [r.wrong for r in res] == [0] * LAUNCHES


def test_upstream_corruption_is_row_bands_of_one_k_tile():
    """Hardware signature: whole 8-row groups (bands of 16-64 rows) off by one K tile."""
    p = random_problem(1024, 1024, 256, "ptpc", seed=4)
    sched = build_schedule(k=256, variant="upstream")
    data = GemmData(p, block_m=256, block_n=256)
    rng = np.random.default_rng(5)
    model = replace(LatencyModel(), extra_latency=3000.0)
    stale = find_stale(sched, simulate_timing(sched, n_wg=data.n_wg, model=model, rng=rng))
    assert stale
    for sr in stale:
        assert sr.content.min() >= PREV_WG and (sr.content != sr.ktile).all()
    err = torch.zeros(1024, 1024)
    stale_errors(sched, data, stale, err, prev_wg_of=lambda wg: (wg + 1) % data.n_wg)
    rows = (err != 0).any(dim=1).nonzero().flatten().tolist()
    assert rows and len(rows) % 8 == 0
    starts = {r - r % 8 for r in rows}
    assert all(set(range(s, s + 8)) <= set(rows) for s in starts)


@pytest.mark.parametrize("variant,mfma_barriers,fifo", [
    ("upstream", True, True), ("a+b-1", True, True), ("shipped", False, True),
    ("shipped-a+b-1", False, True), ("shipped", True, False),
])
def test_every_stale_read_is_one_the_checker_does_not_guarantee(variant, mfma_barriers, fifo):
    """The two models agree: latency can only break a read no completion wait covers."""
    sched = build_schedule(k=1024, variant=variant, mfma_barriers=mfma_barriers)
    report = check(sched, fifo=fifo)
    guaranteed = {(r.wave, r.label, r.half, r.ktile) for r in report.reads
                  if r.status == "guaranteed"}
    seen_stale = 0
    for extra in (0.0, 1500.0, 6000.0):
        model = LatencyModel(extra_latency=extra, fifo=fifo, tail_scale=1.0, tail_alpha=1.5)
        timing = simulate_timing(sched, n_wg=256, model=model, rng=np.random.default_rng(7))
        for sr in find_stale(sched, timing):
            phase, op = sched.wave_program(sr.wave)[sr.read_index]
            assert isinstance(op, LdsRead)
            if sr.content.max() <= sr.ktile:  # a late producer, not an early refill
                assert (sr.wave, phase.label, sr.half, sr.ktile) not in guaranteed
                seen_stale += 1
    if variant != "shipped" or not mfma_barriers or not fifo:
        assert seen_stale  # the racy configurations do go stale under this latency


def test_latency_sweep_breaks_2a_plus_b_s0_reads_but_not_a_plus_b_minus_1_steady_state():
    """Four-barrier structure: load latency spikes past the S0 reads' slack (~1000 cycles here)
    make 2A+B read stale B0/A0 rows in the steady-state loop (k >= 2); A+B-1 orders them by a
    wait. (A+B-1's k=1 reads depend on the prologue count; docs/SCHEDULE.md.) With the kernel's
    MFMA barriers neither count leaves a read to timing."""
    p = random_problem(1024, 2048, 1024, "ptpc", seed=8)
    model = LatencyModel(tail_scale=1.0)
    steady = {}
    for count in ("2A+B", "A+B-1"):
        sched = build_schedule(k=1024, loop_count=count, mfma_barriers=False)
        res = run_launches(sched, p, launches=4, seed=9, model=model, exact=False)
        steady[count] = sum(v for r in res for key, v in r.stale_sites.items()
                            if key.startswith("loop:S0") and not key.endswith("k=1"))
        if count == "2A+B":
            assert sum(r.wrong > 0 for r in res) >= 3
    assert steady["2A+B"] > 0 and steady["A+B-1"] == 0
    for count in ("2A+B", "A+B-1"):
        sched = build_schedule(k=1024, loop_count=count, mfma_barriers=True)
        res = run_launches(sched, p, launches=4, seed=9, model=model, exact=False)
        assert [r.wrong for r in res] == [0] * 4


def test_stale_error_matches_a_recomputed_gemm():
    """The incremental error equals the GEMM recomputed with the substituted rows (mxfp8: the
    correct tile's per-32 scales applied to the stale bytes)."""
    p = random_problem(256, 256, 512, "mxfp8", seed=10)
    sched = build_schedule(k=512, quant="mxfp8")
    data = GemmData(p, block_m=256, block_n=256)
    # wave 5 (wave_m 1, wave_n 1) read A0 of K tile 3 but got K tile 1 in rows 72..79
    read_index = next(i for i, (_, op) in enumerate(sched.wave_program(5))
                      if isinstance(op, LdsRead) and op.half == "A0" and op.ktile == 3)
    sr = StaleRows(wave=5, read_index=read_index, half="A0", ktile=3, loader_wave=1, step=1,
                   wgs=np.array([0]), content=np.array([1]))
    err = torch.zeros(256, 256)
    stale_errors(sched, data, [sr], err, prev_wg_of=lambda wg: wg)
    a = p.a.float().clone()
    rows = list(range(72, 80))
    a[rows, 384:512] = a[rows, 128:256]  # stale bytes, still scaled with tile 3's scales
    from cco.quant import e8m0_to_float
    sa = e8m0_to_float(p.a_scale).repeat_interleave(32, dim=1)
    sb = e8m0_to_float(p.b_scale).repeat_interleave(32, dim=1)
    cols = list(range(32, 64)) + list(range(160, 192))  # wave_n 1 in B0 and in B1
    want = torch.zeros(256, 256)
    da = (a * sa)[rows, 384:512] - (p.a.float() * sa)[rows, 384:512]
    want[72:80][:, cols] = da @ (p.b.float() * sb)[cols, 384:512].t()
    assert torch.allclose(err, want, rtol=1e-5, atol=1e-3)
    assert err[72:80][:, cols].abs().max() > 0 and err[:72].abs().max() == 0


def test_count_wrong_agrees_with_count_mismatches():
    g = torch.Generator().manual_seed(11)
    ref = (torch.randn(64, 96, generator=g) * 10).to(torch.bfloat16)
    out = ref.clone()
    out[3, :8] = (ref[3, :8].float() * 1.2).to(torch.bfloat16)
    out[10, 5] = float("nan")
    out[20, 20] = (ref[20, 20].float() * 1.01).to(torch.bfloat16)  # within 5%
    floor = 0.05 * 0.1 * float(ref.float().abs().mean())
    n = count_mismatches(out, ref)
    assert count_wrong(out, ref, floor=floor) == n and n >= 2  # the NaN and some of row 3
    assert count_wrong(ref.clone(), ref, floor=floor) == 0


def test_runs_are_seeded():
    p = random_problem(1024, 1024, 256, "ptpc", seed=12)
    sched = build_schedule(k=256, variant="upstream")
    a = run_launches(sched, p, launches=3, seed=13)
    b = run_launches(sched, p, launches=3, seed=13)
    assert [r.wrong for r in a] == [r.wrong for r in b]
    assert [r.stale_groups for r in a] == [r.stale_groups for r in b]


def test_problem_shape_is_validated():
    p = random_problem(256, 256, 512, "ptpc", seed=14)
    with pytest.raises(ValueError, match="run_launches: problem K=512"):
        run_launches(build_schedule(k=256), p, launches=1, seed=0)


def test_simulate_cli_prints_bad_launches_last(capsys):
    from kernels_fused.pipeline.simulate import main

    rc = main(["--variant", "upstream", "--shape", "512x512x256", "--launches", "3", "--seed", "0"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("bad launches: ") and "/3, worst launch " in last
    bad = int(last.split("bad launches: ")[1].split("/")[0])
    assert rc == (1 if bad else 0)
    assert main(["--variant", "shipped", "--shape", "512x512x256", "--launches", "2"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "bad launches: 0/2, worst launch 0 wrong elements")


def test_a_gt_b_tile_races_on_a1_for_ptpc_and_count_a_plus_2b_fixes_it():
    """docs/SCHEDULE.md 4.5: at 256x128 (A=2 > B=1) the shipped 2A+B leaves A1(k)'s second
    load step uncovered before S2 under ptpc; the simulator reads stale A1 rows there, and a
    loop count of A+2B (=4) or the mxfp8 scale waits remove it."""
    p = random_problem(1024, 1024, 2048, "ptpc", seed=15)
    racy = run_launches(build_schedule(block_m=256, block_n=128, k=2048, quant="ptpc", loop_count="2A+B"), p,
                        launches=4, seed=0, exact=False)
    assert sum(r.wrong > 0 for r in racy) >= 2
    assert {k.rsplit(":k=1", 1)[0] for r in racy for k in r.stale_sites} == {"loop:S2:A1"}
    fixed = run_launches(build_schedule(block_m=256, block_n=128, k=2048, quant="ptpc"), p,
                         launches=4, seed=0)  # shipped: count min(2A+B, A+2B) = 4
    assert [r.wrong for r in fixed] == [0] * 4
