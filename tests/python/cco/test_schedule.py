"""The pinned 8-wave schedule as data: structure, row maps, variants and boundary validation.

Guards the single source of truth the FlyDSL emitter, the happens-before checker and the simulator
walk: a wrong barrier count or row map here silently changes every verdict downstream.
"""

import pytest

from kernels_fused.pipeline.schedule import (VARIANTS, Barrier, LdsRead, LoadTile, Mfma, ReadDoneBarrier,
                                    ScaleLoad, WaitBarrier, WaitVm, build_schedule, loader_of_row)

pytestmark = pytest.mark.host

TILES = [(256, 256), (128, 256), (256, 128)]
KS = [256, 384, 512, 1024]


def _barriers(sched, wave):
    return [op for _, op in sched.wave_program(wave) if op.is_barrier]


@pytest.mark.parametrize("bm,bn", TILES, ids=lambda v: str(v))
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("quant", ["ptpc", "blockscale", "mxfp8"])
def test_every_half_tile_loaded_once_per_k_tile_before_it_is_read(bm, bn, k, quant):
    s = build_schedule(block_m=bm, block_n=bn, k=k, quant=quant)
    g = s.geometry
    loads = [(op.half, op.ktile) for _, op in s.program() if isinstance(op, LoadTile)]
    assert sorted(loads) == sorted((h, t) for h in ("A0", "A1", "B0", "B1")
                                   for t in range(g.k_iters))
    for _, op in s.program():
        if isinstance(op, LoadTile):
            assert op.buf == op.ktile % 2 and op.k_offset == op.ktile * 128
            assert op.n_vm == (g.a_steps if op.half[0] == "A" else g.b_steps)
    seen = set()
    reads = []
    for _, op in s.wave_program(0):
        if isinstance(op, LoadTile):
            seen.add((op.half, op.ktile))
        if isinstance(op, LdsRead):
            assert (op.half, op.ktile) in seen, f"{op.text()} before its load was issued"
            reads.append((op.half, op.ktile))
    assert sorted(reads) == sorted(loads)  # every tile is read exactly once per wave
    mfmas = [op for _, op in s.program() if isinstance(op, Mfma)]
    assert len(mfmas) == 4 * g.k_iters


@pytest.mark.parametrize("mfma_barriers,per_step", [(True, 8), (False, 4)])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_barrier_structure_and_the_lag(mfma_barriers, per_step, variant):
    s = build_schedule(k=1024, variant=variant, mfma_barriers=mfma_barriers)
    loop = [op for ph, op in s.program() if ph.section == "loop" and op.is_barrier]
    assert len(loop) == per_step * (s.geometry.k_iters - 2)
    lead, lag = _barriers(s, 0), _barriers(s, 4)
    # the lagging group's one extra barrier is the prologue's lag barrier ...
    assert [b for b in lag if isinstance(b, Barrier) and b.kind == "lag"] and not [
        b for b in lead if isinstance(b, Barrier) and b.kind == "lag"]
    # ... and the epilogue's close barrier (leading group only) balances it when enabled
    assert len(lead) + (0 if s.policy.close_lag else 1) == len(lag)
    for w in range(8):
        assert len(_barriers(s, w)) == len(_barriers(s, 4 * (w // 4)))


def test_named_variants_are_the_issue_policies():
    pol = {n: (p.loop_count, p.tail, p.read_done_s0) for n, p in VARIANTS.items()}
    assert pol == {"shipped": ("min(2A+B,A+2B)", "drained", True), "upstream": ("2A+B", "bare", False),
                   "a+b-1": ("A+B-1", "bare", False),
                   "shipped-a+b-1": ("A+B-1", "drained", True)}
    assert all(p.mfma_barriers for p in VARIANTS.values())  # the kernel's mfma.call barrier


@pytest.mark.parametrize("bm,bn,count", [(256, 256, 6), (128, 256, 4), (256, 128, 4)])  # 256x128: A+2B < 2A+B
def test_loop_count_values(bm, bn, count):
    s = build_schedule(block_m=bm, block_n=bn, k=1024)
    assert s.loop_count_value == count
    waits = {op.vmcnt for ph, op in s.program() if ph.section == "loop" and isinstance(op, WaitBarrier)}
    assert waits == {count}
    a, b = s.geometry.a_steps, s.geometry.b_steps
    assert build_schedule(block_m=bm, block_n=bn, k=1024, loop_count="A+B-1").loop_count_value == a + b - 1
    assert build_schedule(block_m=bm, block_n=bn, k=1024, loop_count=3).loop_count_value == 3


def test_drained_tail_waits_before_the_final_a1_is_issued():
    for variant, want in (("shipped", WaitBarrier), ("upstream", Barrier)):
        s = build_schedule(k=512, variant=variant)
        k2 = [op for ph, op in s.program() if ph.section == "tail_k2"]
        sync = [op for op in k2 if op.is_barrier and not (isinstance(op, Barrier) and op.kind == "mfma")]
        assert isinstance(sync[1], want)  # the S1 stage barrier
        if want is WaitBarrier:
            assert sync[1].vmcnt == 0
        final_a1 = next(i for i, op in enumerate(k2) if isinstance(op, LoadTile))
        assert k2.index(sync[1]) < final_a1
        k1 = [op for ph, op in s.program() if ph.section == "tail_k1"]
        assert isinstance(next(op for op in k1 if op.is_barrier), WaitBarrier)


def test_read_done_replaces_the_s0_barrier_only_in_the_loop():
    s = build_schedule(k=1024, variant="shipped")
    s0 = [op for ph, op in s.program() if op.is_barrier and ph.stage == "S0"
          and not (isinstance(op, Barrier) and op.kind == "mfma")]
    kinds = [(type(op).__name__) for op in s0]
    assert kinds.count("ReadDoneBarrier") == s.geometry.k_iters - 2
    assert not any(isinstance(op, ReadDoneBarrier) for _, op in build_schedule(
        k=1024, variant="upstream").program())


def test_row_maps_match_the_g2s_and_s2r_layout():
    # row r of a 64-row load step comes from wave (r % 64) // 8
    assert [loader_of_row(r) for r in (0, 7, 8, 63, 64, 127)] == [
        (0, 0), (0, 0), (1, 0), (7, 0), (0, 1), (7, 1)]
    s = build_schedule(block_m=256, block_n=256, k=256)
    for w in range(8):
        for s_ in range(2):
            assert all(loader_of_row(r) == (w, s_) for r in s.rows_loaded("A0", w, s_))
    # wave_m picks A rows, wave_n picks B rows; each half is partitioned
    assert list(s.rows_read("A0", 0)) == list(range(0, 64))
    assert list(s.rows_read("A0", 5)) == list(range(64, 128))
    assert list(s.rows_read("B0", 5)) == list(range(32, 64))
    # the reviewer's point: leading waves wave_n 1 and 3 read B0 rows the lagging group loaded
    lag_b0 = {w for w in range(4) if any(u >= 4 for u, _ in s.read_sources("B0", w))}
    assert lag_b0 == {1, 3}
    # ... and at BLOCK_M=256 leading A0 step 0 includes lagging rows; at 128 it does not
    assert {u for u, st in s.read_sources("A0", 0) if st == 0} == set(range(8))
    s128 = build_schedule(block_m=128, block_n=256, k=256)
    assert {u for u, _ in s128.read_sources("A0", 0)} == {0, 1, 2, 3}


@pytest.mark.parametrize("quant,has", [("ptpc", False), ("blockscale", True), ("mxfp8", True)])
def test_scale_loads_per_half_where_first_consumed(quant, has):
    s = build_schedule(block_m=256, block_n=128, k=512, quant=quant)
    scales = [(ph.section, ph.stage, op.half) for ph, op in s.program()
              if isinstance(op, ScaleLoad) and ph.section != "epilogue"]  # ptpc's row scales load there
    waits = [op for _, op in s.program() if isinstance(op, WaitVm)]
    assert bool(scales) == has and bool(waits) == has
    if has:
        per_step = {(st, h) for _, st, h in scales}
        assert per_step == {("S0", "A0"), ("S0", "B0"), ("S1", "B1"), ("S2", "A1")}
        assert len(scales) == 4 * s.geometry.k_iters
        assert all(not w.emitted for w in waits)


def test_format_shows_both_groups_with_their_barrier_counts():
    text = build_schedule(k=256).format()
    lines = text.splitlines()
    assert "leading (waves 0-3)" in lines[2] and "lagging (waves 4-7)" in lines[2]
    lag = next(l for l in lines if "(lag)" in l)
    assert lag.split("s_barrier (lag)")[0].strip().endswith("#1") and "prologue" in lag
    first_wait = next(l for l in lines if "wait_barrier" in l)
    assert "#1   wait_barrier" in first_wait and "#2   wait_barrier" in first_wait


@pytest.mark.parametrize("kwargs,arg", [
    (dict(k=128), "k"), (dict(k=300), "k"), (dict(k=512, quant="fp8"), "quant"),
    (dict(k=512, block_m=64), "block_m"), (dict(k=512, block_n=512), "block_n"),
    (dict(k=512, variant="fixed"), "variant"), (dict(k=512, tail="drain"), "tail"),
    (dict(k=512, loop_count="2B"), "loop_count"), (dict(k=512, loop_count=-1), "loop_count"),
    (dict(k=512, mfma_barriers=1), "mfma_barriers"),
])
def test_invalid_arguments_name_the_argument_and_the_fix(kwargs, arg):
    with pytest.raises(ValueError) as e:
        build_schedule(**kwargs)
    msg = str(e.value)
    assert msg.startswith("build_schedule:") and f"{arg}=" in msg and "allowed" in msg
