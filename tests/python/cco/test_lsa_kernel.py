"""The CUDA ``lsa`` kernel (GEMM, scatter, reduce, gather and assemble in one launch) on the CPU:
real rank processes over shared-memory windows, the kernel under Triton's interpreter.

What runs here is the whole protocol of ``fp8_gemm_lsa``: peers' tiles stored into the owner's
``recv`` and flagged with the call's stamp, own tiles waiting for every source, the fp32 reduce,
the bf16 / fp8 gather into every peer, the assemble of the peers' tiles into ``out``, consumed tile
flags, the reset ticket and the stamp check. Memory ordering between GPU programs is what only the H200 run shows
(``test_cuda_op.py``).
"""

from __future__ import annotations

import pytest
import torch

from cco import layout
from cco import quant as Q
from cco.comm import check_outcomes, spawn

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.multirank

M, K = 80, 256  # M is not a multiple of the 32-row tile
SLICE = 256  # columns per rank: two 128-wide kernel tiles (layout tiles 64 wide, merged in pairs)


def _run_rank(comm, quant, gather, stamp_skew, move_bytes, from_partial=False, launch="ticket", interleave=False,
              kept=False, rows_partial=None, m=M):
    """One rank's lsa call of ``m`` rows (a window of ``M``): the GEMM, or ``from_partial`` the window's
    planes, or with ``rows_partial`` an [m, N] partial of this rank: "pattern" (``_pattern``) or
    "mma" (the decode MMA over the rank's problem, ``RowsMma``, as ``CudaBackend._decode_lsa``
    computes it). Returns (out, flags left, status) and, with ``rows_partial``, the partial."""
    from triton.runtime.interpreter import InterpretedFunction

    from cco.cuda.kernels import STATUS_WORDS
    from cco.transport.base import stamp_seq_m
    from cco.window import open_window
    from kernels_fused.hopper.gemm import (GemmConfig, LsaWindow, fp8_gemm_lsa, lsa_launch, lsa_walk_rows, peer_deltas,
                                           tile_table_tensor)

    assert isinstance(triton.language.standard.zeros, InterpretedFunction), "rank process is not interpreting"
    rank, world = comm.rank, comm.world
    cfg = layout.build_config(n=SLICE * world, k=K, m_max=M, world=world, quant=quant, transport="lsa",
                              gather_dtype=gather, chunks=2, block_m=32, block_n=64)
    w = cfg.window
    window = open_window(comm=comm, layout=w)
    try:
        view = {name: window.tensor(getattr(w, name), rank=rank) for name in ("partial", "recv", "gather", "gather_scale")}
        view["recv"].fill_(float("nan"))
        if from_partial:  # the self test's input: a known partial per destination
            view["partial"].copy_(_pattern(rank, view["partial"].shape))
        if gather == "fp8":
            view["gather_scale"].fill_(float("nan"))
        else:
            view["gather"].fill_(float("nan"))
        comm.barrier()  # poisoned before any peer stores into it
        win = LsaWindow(partial=view["partial"], recv=view["recv"], gather=view["gather"],
                        gather_scale=view["gather_scale"] if gather == "fp8" else None,
                        tile_flags=window.tensor(w.tile_flags, rank=rank),
                        deltas=torch.tensor(peer_deltas([window.tensor(w.header, rank=p).data_ptr()
                                                         for p in range(world)], rank), dtype=torch.int64),
                        status=torch.zeros(STATUS_WORDS, dtype=torch.int64), ticket=torch.zeros(1, dtype=torch.int64))
        table = tile_table_tensor(lsa_walk_rows(cfg, m=m, rank=rank, width=2, interleave=interleave), device="cpu")
        p = Q.random_problem(m, cfg.n, K, quant, seed=rank)
        out = torch.full((m, cfg.n), float("nan"), dtype=torch.bfloat16)
        stamp = stamp_seq_m(1, m) + (stamp_skew if rank == 1 else 0)
        partial = None
        if rows_partial == "pattern":
            partial = _pattern(rank, (m, cfg.n))
        elif rows_partial == "mma":
            from kernels_fused.hopper.decode import RowsMma

            partial = torch.full((m, cfg.n), float("nan"), dtype=torch.bfloat16)
            RowsMma(quant, m, K, cfg.n, torch.device("cpu"))(p.a, p.a_scale, p.b, p.b_scale, partial)
        config = GemmConfig(block_m=32, block_n=128, num_warps=4, num_stages=1, launch=launch)
        if kept and partial is not None:  # lsa_partial_launch's kept call, as CudaBackend._decode_lsa runs it
            from kernels_fused.hopper.gemm import lsa_partial_launch

            lsa_partial_launch(partial, quant=quant, out=out, win=win, tile_table=table, rank=rank,
                               config=config)(partial, partial, out, stamp)
        elif kept:  # lsa_launch's kept call (LsaLaunch), as the CUDA backend's kept collective call runs it
            lsa_launch(p.a, p.b, p.a_scale, p.b_scale, quant=quant, out=out, win=win, tile_table=table, rank=rank,
                       config=config)(p.a, p.a_scale, out, stamp)
        else:
            fp8_gemm_lsa(p.a, p.b, p.a_scale, p.b_scale, quant=quant, out=out, win=win, tile_table=table, rank=rank,
                         stamp=stamp, config=config, move_bytes=move_bytes, from_partial=from_partial, partial=partial)
        comm.barrier()  # every rank's kernel has returned: all stores into this window are done
        flags_left = int(window.tensor(w.tile_flags, rank=rank).count_nonzero())
        assert win.ticket.item() == 0, "the last program did not reset the ticket"
        comm.barrier()  # no rank unmaps its window while a peer still reads it
        if rows_partial is not None:
            return out, flags_left, int(win.status[0].item()), partial
        return out, flags_left, int(win.status[0].item())
    finally:
        window.close()


def _pattern(rank, shape):
    """Small integers: every sum is exact in bf16, so the check is bit-exact whatever the rounding."""
    g = torch.Generator().manual_seed(rank)
    return torch.randint(-64, 64, shape, generator=g).bfloat16()


def test_walk_holds_every_entry_once_and_waits_only_backwards():
    """Both walk orders list every scatter, reduce and assemble entry once, and every entry's
    dependency sits earlier in the peer's walk (the deadlock-freedom condition)."""
    from kernels_fused.hopper.gemm import lsa_walk_rows

    world = 3
    cfg = layout.build_config(n=SLICE * world, k=K, m_max=300, world=world, chunks=3, block_m=32, block_n=64)
    for interleave in (False, True):
        walks = {r: lsa_walk_rows(cfg, m=300, rank=r, width=2, interleave=interleave) for r in range(world)}
        pos = {r: {tuple(e): i for i, e in enumerate(w)} for r, w in walks.items()}
        for r, walk in walks.items():
            assert len(pos[r]) == len(walk)  # no entry twice
            kinds = {"scatter": 0, "reduce": 0, "assemble": 0}
            for i, (c, dest, r0, c0) in enumerate(walk):
                if dest >= world:  # assemble: needs the owner's reduce entry
                    kinds["assemble"] += 1
                    assert pos[dest - world][(c, dest - world, r0, c0)] < i
                elif dest == r:  # reduce: needs every source's scatter entry
                    kinds["reduce"] += 1
                    for src in range(world):
                        if src != r:
                            assert pos[src][(c, r, r0, c0)] < i
                else:
                    kinds["scatter"] += 1
            own = len(layout.tile_table(cfg, m=300, rank=r)) // world // 2
            assert kinds == {"scatter": (world - 1) * own, "reduce": own, "assemble": (world - 1) * own}


def _reference(world, quant):
    return sum(Q.random_problem(M, SLICE * world, K, quant, seed=r).reference().float() for r in range(world))


@pytest.mark.parametrize("walk", ["ticket", "persistent", "ticket-interleaved"])
@pytest.mark.parametrize("gather", ["bf16", "fp8"])
@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"world{w}")
def test_lsa_kernel_all_reduces_on_every_rank(world, gather, walk):
    launch, _, interleaved = walk.partition("-")
    outcomes = spawn(_run_rank, world=world, args=("ptpc", gather, 0, True, False, launch, bool(interleaved)),
                     timeout_s=600)
    check_outcomes(outcomes)
    ref = _reference(world, "ptpc")
    results = [o.value for o in outcomes]
    for rank, (out, flags_left, status) in enumerate(results):
        assert status == 0, f"rank {rank} saw a stamp mismatch"
        assert flags_left == 0, f"rank {rank}: {flags_left} tile flags were not consumed by their waiter"
        tol = 2.0 * (Q.REL_L2_TOL_FP8_GATHER if gather == "fp8" else Q.REL_L2_TOL["ptpc"])  # interpreter truncates
        assert torch.isfinite(out.float()).all()
        assert Q.rel_l2(out, ref) < tol
        assert torch.equal(out, results[0][0]), f"rank {rank} differs from rank 0"  # identical bits everywhere


@pytest.mark.parametrize("quant", ["blockscale", "mxfp8"])
def test_lsa_kernel_other_quants(quant):
    outcomes = spawn(_run_rank, world=2, args=(quant, "bf16", 0, True), timeout_s=600)
    check_outcomes(outcomes)
    ref = _reference(2, quant)
    for out, *_ in (o.value for o in outcomes):
        assert Q.rel_l2(out, ref) < 2.0 * Q.REL_L2_TOL[quant]


@pytest.mark.parametrize("quant", ["ptpc", "mxfp8"])
def test_the_kept_lsa_call_all_reduces_as_fp8_gemm_lsa_does(quant):
    """The real kernel under the interpreter on two rank processes, called through ``lsa_launch``'s
    kept call: every rank's output the bits of ``fp8_gemm_lsa``'s, every tile flag consumed."""
    runs = [check_outcomes(spawn(_run_rank, world=2, args=(quant, "bf16", 0, True, False, "ticket", False, kept),
                                 timeout_s=600)) for kept in (False, True)]
    for rank, ((want, *_), (got, flags_left, status)) in enumerate(zip(*runs)):
        assert status == 0 and flags_left == 0, (rank, status, flags_left)
        assert torch.isfinite(got.float()).all() and torch.equal(got, want), f"rank {rank}: the kept call differs"


def test_lsa_kernel_reports_a_peer_stamp_mismatch():
    """Rank 1 runs the call with another (seq, M) stamp: each rank names the other in status, and
    no rank's output holds a number (the tiles of another call are NaN, never summed)."""
    outcomes = spawn(_run_rank, world=2, args=("ptpc", "bf16", 1, True), timeout_s=600)
    check_outcomes(outcomes)
    statuses = [o.value[2] for o in outcomes]
    assert statuses == [1 + 1, 1 + 0]
    for out, *_ in (o.value for o in outcomes):
        assert torch.isnan(out.float()).all()


def test_lsa_kernel_without_bytes_leaves_poison():
    """The silent-transport fault: flags are released but nothing is stored, and it shows: the
    poisoned recv and gather reach out (what the op's self test checks for)."""
    outcomes = spawn(_run_rank, world=2, args=("ptpc", "bf16", 0, False), timeout_s=600)
    check_outcomes(outcomes)
    for out, flags_left, status in (o.value for o in outcomes):
        assert flags_left == 0 and status == 0
        assert torch.isnan(out.float()).all()


def test_lsa_kernel_from_partial_is_the_self_tests_all_reduce():
    """``from_partial`` (what ``self_test`` runs): the window's partial tiles instead of the GEMM,
    through the same scatter, reduce and gather, for an M below the window's padded rows."""
    outcomes = spawn(_run_rank, world=2, args=("ptpc", "bf16", 0, True, True), timeout_s=600)
    check_outcomes(outcomes)
    rows = layout.padded_m(M, 32)
    total = sum(_pattern(r, (2, rows, SLICE)).float() for r in range(2))  # [dest, rows, n_slice]
    expect = total.permute(1, 0, 2).reshape(rows, 2 * SLICE)[:M].bfloat16()
    for out, flags_left, status in (o.value for o in outcomes):
        assert flags_left == 0 and status == 0
        assert torch.equal(out, expect)


@pytest.mark.parametrize("source, quant, m, kept", [("pattern", "ptpc", M, False), ("mma", "ptpc", 24, False),
                                                    ("mma", "blockscale", 3, False), ("pattern", "ptpc", M, True),
                                                    ("mma", "blockscale", 3, True)], ids=lambda v: str(v))
def test_lsa_kernel_from_a_partial_of_rows(source, quant, m, kept):
    """``from_partial`` with an [M, N] partial of the caller's (what a decode-sized fused call runs
    after the decode MMA: ``CudaBackend._decode_lsa``), not the window's planes: every rank's output
    is the sum of the ranks' partials, own term first, rounded once (bit for bit), and every flag is
    consumed, and every rank holds the same bytes (each owner's columns as the owner rounded them),
    called as such or through its kept launch (``lsa_partial_launch``, the backend's).
    "mma" computes each rank's partial with ``RowsMma`` over its own problem, as the backend does;
    its sums are checked to one bf16 ulp (the interpreter rounds fp32 to bf16 by truncation)."""
    outcomes = spawn(_run_rank, world=2, args=(quant, "bf16", 0, True, True, "ticket", False, kept, source, m),
                     timeout_s=600)
    check_outcomes(outcomes)
    partials = [o.value[3] for o in outcomes]
    assert not any(bool(p.isnan().any()) for p in partials)
    exact = partials[0].float() + partials[1].float()
    outs = [o.value[0] for o in outcomes]
    assert torch.equal(outs[0], outs[1])
    for out, flags_left, status, _ in (o.value for o in outcomes):
        assert flags_left == 0 and status == 0
        if source == "pattern":  # small integers: every sum exact
            assert torch.equal(out, exact.bfloat16())
        else:
            ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(2 ** -100))) - 7)
            assert bool(((out.float() - exact).abs() <= ulp).all())


def _recorded_launches(monkeypatch, G) -> tuple[list, list]:
    """``(made, calls)``: ``G.Kernel`` replaced by a stand-in that records each launch made (its
    grid) and each call (``("kept", args)`` through the kept launcher, ``("jit", args)`` through
    ``JITFunction.run``) instead of compiling or launching; ``G``'s kept launches cleared."""
    made, calls = [], []

    class Launch:
        def __init__(self, fn, grid, **options):
            made.append(grid)

        def __call__(self, device, *args):
            calls.append(("kept", args))

        def run_jit(self, device, *args):
            calls.append(("jit", args))

    monkeypatch.setattr(G, "Kernel", Launch)
    G._LSA_LAUNCHES.clear()
    return made, calls


def _host_window(G, world: int):
    """An ``LsaWindow`` of ``world`` ranks in host memory, M rows of SLICE columns (never launched on)."""
    planes = [torch.zeros(world, M, SLICE, dtype=torch.bfloat16) for _ in range(3)]
    return G.LsaWindow(partial=planes[0], recv=planes[1], gather=planes[2], gather_scale=None,
                       tile_flags=torch.zeros(2, world, 3, 2, dtype=torch.int64),
                       deltas=torch.zeros(world, dtype=torch.int64), status=torch.zeros(1, dtype=torch.int64),
                       ticket=torch.zeros(1, dtype=torch.int64))


def test_the_partials_kept_launch_passes_what_fp8_gemm_lsa_passes(monkeypatch):
    """``lsa_partial_launch`` (``CudaBackend._decode_lsa``'s kept transfers): per call the same
    arguments, one by one, as ``fp8_gemm_lsa(from_partial=True, partial=...)`` with that call's
    ``out`` and stamp, the partial's (owner, row) strides among them; none of a call's tensors held
    after it; an ``out`` at another 16-byte alignment launched through ``JITFunction.run``. A
    partial of the wrong shape is refused by name."""
    from kernels_fused.hopper import gemm as G

    _, calls = _recorded_launches(monkeypatch, G)
    world, n = 2, 2 * SLICE
    win = _host_window(G, world)
    table = torch.zeros(4, 4, dtype=torch.int32)
    config = G.GemmConfig(block_m=32, block_n=128, num_warps=4, num_stages=1, tma=False)
    partial = torch.zeros(M, n, dtype=torch.bfloat16)
    buffer = torch.zeros(M * n + 8, dtype=torch.bfloat16)
    kept = G.lsa_partial_launch(partial, quant="ptpc", out=buffer[:M * n].view(M, n), win=win, tile_table=table,
                                rank=1, config=config)
    for stamp, offset in ((5, 0), (6, 0), (7, 1)):
        out = buffer[offset:offset + M * n].view(M, n)
        G.fp8_gemm_lsa(None, None, None, None, quant="ptpc", out=out, win=win, tile_table=table, rank=1, stamp=stamp,
                       config=config, from_partial=True, partial=partial)
        kept(partial, partial, out, stamp)
        (_, want), (how, got) = calls[-2:]
        assert len(got) == len(want) and all(g is w or g == w for g, w in zip(got, want))
        assert got[7] is partial and got[G._LSA_STAMP] == stamp and (got[21], got[22]) == (SLICE, n)
        assert how == ("jit" if offset else "kept")
        assert kept.args[2] is kept.args[4] is kept.args[6] is None
    with pytest.raises(ValueError, match=r"partial must be bf16 \[80, 512\]"):
        G.lsa_partial_launch(partial[:, :SLICE], quant="ptpc", out=buffer[:M * n].view(M, n), win=win,
                             tile_table=table, rank=1, config=config)
    G._LSA_LAUNCHES.clear()


def test_lsa_launch_is_kept_per_call_shape_with_the_windows_arguments_keyed_once(monkeypatch):
    """``fp8_gemm_lsa``'s kept launch: the window's ten tensor arguments are taken and keyed once per
    window (``LsaWindow.launch_args``, the same tensor objects on every call); a call that differs
    only in its stamp reuses the launch, one whose output lies at another 16-byte alignment (what
    Triton specializes on) or another window of other alignment gets a launch of its own."""
    from kernels_fused.hopper import gemm as G

    made, calls = [], []

    class Launch:  # stands in for launch.Kernel: records what would be compiled and launched
        def __init__(self, fn, grid, **options):
            made.append(grid)

        def __call__(self, device, *args):
            calls.append(args)

    monkeypatch.setattr(G, "Kernel", Launch)
    G._LSA_LAUNCHES.clear()
    world, rows = 2, M

    def window(offset=0):
        flags = torch.zeros(2 * world * 3 * 2 + offset, dtype=torch.int64)[offset:].view(2, world, 3, 2)
        return G.LsaWindow(partial=torch.zeros(world, rows, SLICE, dtype=torch.bfloat16),
                           recv=torch.zeros(world, rows, SLICE, dtype=torch.bfloat16),
                           gather=torch.zeros(world, rows, SLICE, dtype=torch.bfloat16), gather_scale=None,
                           tile_flags=flags, deltas=torch.zeros(world, dtype=torch.int64),
                           status=torch.zeros(1, dtype=torch.int64), ticket=torch.zeros(1, dtype=torch.int64))

    win = window()
    p = Q.random_problem(M, SLICE * world, K, "ptpc", seed=0)
    table = torch.zeros(4, 4, dtype=torch.int32)
    config = G.GemmConfig(block_m=32, block_n=128, num_warps=4, num_stages=1, tma=False)
    buffer = torch.zeros(M * SLICE * world + 8, dtype=torch.bfloat16)

    def call(stamp, win=win, offset=0):
        out = buffer[offset:offset + M * SLICE * world].view(M, SLICE * world)
        G.fp8_gemm_lsa(p.a, p.b, p.a_scale, p.b_scale, quant="ptpc", out=out, win=win, tile_table=table, rank=0,
                       stamp=stamp, config=config)

    call(5)
    call(6)
    assert len(made) == 1 and len(calls) == 2 and calls[0][G._LSA_STAMP] == 5 and calls[1][G._LSA_STAMP] == 6
    assert all(a is b for a, b in zip(calls[0][7:15], calls[1][7:15])) and calls[0][11] is win.launch_args[0][5]
    call(7, offset=1)  # out 2 bytes on: another alignment
    assert len(made) == 2
    call(8, win=window(offset=1))  # the flags 8 bytes on: another window's specialization
    call(9, win=window())  # another window of the same alignment: the same kernel
    assert len(made) == 3 and len(calls) == 5
    G._LSA_LAUNCHES.clear()


@pytest.mark.parametrize("quant", ["ptpc", "blockscale", "mxfp8"])
@pytest.mark.parametrize("tma", [False, True])
def test_a_kept_lsa_call_launches_what_fp8_gemm_lsa_launches(monkeypatch, quant, tma):
    """``lsa_launch``'s kept call (``LsaLaunch``: the weight, window, tile table and every integer
    bound once) launches, call by call, the arguments ``fp8_gemm_lsa`` launches for the same rows,
    scales, output and stamp: the same kernel, each argument the same (a tensor the same bytes at
    the same address, mxfp8's dequantized rows the same values, a TMA descriptor of the same bytes,
    shape, strides and block); it holds none of a call's tensors after it; a call whose scales sit
    at another 16-byte alignment than the first call's goes through ``JITFunction.run``
    (``Kernel.run_jit``), which specializes on it."""
    from kernels_fused.hopper import gemm as G

    made, calls = _recorded_launches(monkeypatch, G)
    world = 2
    win = _host_window(G, world)
    table = torch.zeros(4, 4, dtype=torch.int32)
    config = G.GemmConfig(block_m=32, block_n=128, num_warps=4, num_stages=1, tma=tma)
    weight = Q.random_problem(M, SLICE * world, K, quant, seed=0)
    b_dense = G.mx_to_bf16(weight.b, weight.b_scale) if quant == "mxfp8" else None

    def same(x, y) -> bool:
        if isinstance(x, torch.Tensor):  # (bytes compared: fp8 has no equal on the CPU)
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and \
                x.stride() == y.stride() and (quant == "mxfp8" or x.data_ptr() == y.data_ptr()) and \
                torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        if hasattr(x, "block_shape"):
            return (same(x.base, y.base) and list(x.shape) == list(y.shape) and list(x.strides) == list(y.strides)
                    and list(x.block_shape) == list(y.block_shape))
        return type(x) is type(y) and x == y

    kept = None
    for seed, stamp in ((1, 5), (2, 6), (3, 7)):
        p = Q.random_problem(M, SLICE * world, K, quant, seed=seed)
        a_scale = p.a_scale
        if seed == 3:  # the scales one element on (4 bytes; mxfp8's 1): another alignment than the kept launch's
            buffer = torch.empty(a_scale.untyped_storage().nbytes() // a_scale.element_size() + 1, dtype=a_scale.dtype)
            a_scale = buffer.as_strided(a_scale.shape, a_scale.stride(), storage_offset=1).copy_(a_scale)
        out = torch.empty(M, SLICE * world, dtype=torch.bfloat16)
        G.fp8_gemm_lsa(p.a, weight.b, a_scale, weight.b_scale, quant=quant, out=out, win=win, tile_table=table,
                       rank=1, stamp=stamp, config=config, validated=True, b_dense=b_dense)
        if kept is None:
            kept = G.lsa_launch(p.a, weight.b, a_scale, weight.b_scale, quant=quant, out=out, win=win,
                                tile_table=table, rank=1, config=config, b_dense=b_dense)
        kept(p.a, a_scale, out, stamp)
        (_, want), (how, got) = calls[-2:]
        assert how == ("jit" if seed == 3 and quant != "mxfp8" else "kept"), (seed, how)
        assert len(got) == len(want)
        bad = [i for i, (x, y) in enumerate(zip(want, got)) if not same(x, y)]
        assert not bad, f"arguments {bad} differ from fp8_gemm_lsa's (call {seed})"
        assert kept.args[2] is None and kept.args[4] is None and kept.args[6] is None
    assert len(made) == (2 if quant != "mxfp8" else 1)  # fp8_gemm_lsa's own launch for the other alignment
    G._LSA_LAUNCHES.clear()
