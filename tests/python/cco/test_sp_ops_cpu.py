"""The sequence-parallel ops on the CPU backend (real rank processes over shared-memory windows):
``GemmReduceScatterOp`` (both scatter dims) and ``AllGatherGemmOp``, against the unfused
collectives of the fp32 reference.

Guards: a slice walked or owned by the wrong rank (rows vs columns), chunk rows or counter targets
computed for another M (alternating M, M not a multiple of the chunking), scales gathered in the
wrong layout (blockscale's column-major A scale), a gathered input that is not every rank's rows in
rank order, an M that is not a multiple of the world accepted, the self test passing a transport that
moves nothing, a rank whose M differs returning a result.
"""

import pytest
import torch

from cco import quant as q
from cco.all_gather import AllGatherGemmOp
from cco.comm import check_outcomes, spawn
from cco.preshuffle import preshuffle_b
from cco.reduce_scatter import GemmReduceScatterOp
from cco.transport import FaultPlan, PeerMismatchError, SelfTestError

pytestmark = pytest.mark.multirank

DEADLINE_S = 20.0
K = 256


def operands(rank, m, n, quant, seed=0):
    p = q.random_problem(m, n, K, quant, seed=1000 * seed + rank)
    return p, preshuffle_b(p.b)


def partial_sum(world, m, n, quant, seed=0):
    """sum_r reference_gemm(a_r, b_r): bf16 partials summed in fp32, rounded to bf16."""
    return sum(operands(r, m, n, quant, seed)[0].reference().float() for r in range(world)).to(torch.bfloat16)


def assert_close(out, ref, quant):
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert q.count_mismatches(out, ref) == 0 and q.rel_l2(out, ref) < q.REL_L2_TOL[quant]


# --------------------------------------------------------------------------------------------------
# GEMM + reduce-scatter
# --------------------------------------------------------------------------------------------------
RS_COMBOS = [("fused", "dma"), ("split", "lsa"), ("fused", "lsa")]
RS_MS = (128, 8, 200)  # 200: 3.1 m-tiles of 64 at dim 1, 100 rows (1.6 tiles) per rank at dim 0


def _reduce_scatter(comm, quant, n, combos):
    outs = {}
    for dim in (0, 1):
        for mode, transport in combos:
            with GemmReduceScatterOp(comm, n=n, k=K, m_max=256, scatter_dim=dim, quant=quant, mode=mode,
                                     transport=transport, chunks=3, deadline_s=DEADLINE_S) as op:
                for i, m in enumerate(RS_MS):  # alternating M on one op
                    m -= m % comm.world
                    p, b_pre = operands(comm.rank, m, n, quant, seed=i)
                    outs[(dim, mode, transport, i)] = op(p.a, b_pre, p.a_scale, p.b_scale)
    return outs


RS_CASES = [pytest.param(2, quant, RS_COMBOS, id=f"w2-{quant}") for quant in q.QUANTS]
RS_CASES += [pytest.param(4, "blockscale", RS_COMBOS[:2], id="w4-blockscale")]


@pytest.mark.parametrize("world, quant, combos", RS_CASES)
def test_reduce_scatter_is_the_reference_share_of_every_rank(world, quant, combos):
    """Both scatter dims, fused and split, dma and lsa, alternating M on one op: each rank's output
    is its share of the reference sum (rows r*M/W.. or columns r*N/W..), and the shares tile it."""
    n = 512
    per_rank = check_outcomes(spawn(_reduce_scatter, world=world, args=(quant, n, combos), timeout_s=240))
    for (dim, mode, transport, i), _ in per_rank[0].items():
        m = RS_MS[i] - RS_MS[i] % world
        ref = partial_sum(world, m, n, quant, seed=i)
        shares = [r[(dim, mode, transport, i)] for r in per_rank]
        assert shares[0].shape == ((m // world, n) if dim == 0 else (m, n // world)), (dim, shares[0].shape)
        assert_close(torch.cat(shares, dim=dim), ref, quant)


def _rs_rejects_m_not_multiple_of_world(comm):
    with GemmReduceScatterOp(comm, n=256, k=K, m_max=64, scatter_dim=0, deadline_s=DEADLINE_S) as op:
        p, b_pre = operands(comm.rank, 63, 256, "ptpc")
        try:
            op(p.a, b_pre, p.a_scale, p.b_scale)
            first = "returned"
        except ValueError as err:
            first = str(err)
        p, b_pre = operands(comm.rank, 64, 256, "ptpc")
        return first, op(p.a, b_pre, p.a_scale, p.b_scale), op.calls


def test_reduce_scatter_rows_rejects_m_not_a_multiple_of_world_and_stays_usable():
    per_rank = check_outcomes(spawn(_rs_rejects_m_not_multiple_of_world, world=2, timeout_s=60))
    for msg, out, calls in per_rank:
        assert "GemmReduceScatterOp.__call__" in msg and "M=63" in msg and "multiple of world=2" in msg, msg
        assert "M=64" in msg  # the fix: the padded M
        assert calls == 2  # the rejected call was a collective call on both ranks
    assert_close(torch.cat([r[1] for r in per_rank]), partial_sum(2, 64, 256, "ptpc"), "ptpc")


def test_constructor_errors_name_the_argument():
    with _NoComm() as comm:
        with pytest.raises(ValueError, match=r"GemmReduceScatterOp: scatter_dim=2 is not supported"):
            GemmReduceScatterOp(comm, n=256, k=K, m_max=64, scatter_dim=2)
        with pytest.raises(ValueError, match=r"GemmReduceScatterOp: mode='gemm-only'"):
            GemmReduceScatterOp(comm, n=256, k=K, m_max=64, mode="gemm-only")
        with pytest.raises(ValueError, match=r"AllGatherGemmOp: mode='gemm-only'"):
            AllGatherGemmOp(comm, n=256, k=K, m_max=64, mode="gemm-only")


class _NoComm:
    """Enough of a communicator for constructions that fail before a window is opened."""
    device, rank, world = torch.device("cpu"), 0, 2

    def agree(self, fn, arguments, *, error=None):  # the peers agree: this rank's own verdict stands
        if error is not None:
            raise error

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.mark.parametrize("pattern", ["reduce-scatter-rows", "reduce-scatter-cols", "all-gather"])
def test_gpu_backends_run_or_refuse_the_new_patterns_with_a_clear_error(pattern):
    """Both GPU backends run the pattern on their DMA engines (``dma``, which ``auto`` takes: CUDA's
    copy engines, gfx950's SDMA) and refuse the ``lsa`` transport at construction (``config_error``:
    the same verdict on every rank, naming the transport to pass)."""
    from cco import layout
    from cco.backends.cuda import CudaBackend
    from cco.backends.gfx950 import Gfx950Backend

    for backend in (CudaBackend, Gfx950Backend):
        def cfg(transport):
            block_m, block_n = backend.tile("ptpc")
            return layout.build_config(n=1024, k=K, m_max=512, world=2, pattern=pattern, block_m=block_m,
                                       block_n=block_n, transport=transport)

        for transport in ("dma", "auto"):
            assert backend.config_error(cfg(transport)) is None, (backend.name, transport)
        err = backend.config_error(cfg("lsa"))
        assert isinstance(err, NotImplementedError) and "transport='dma'" in str(err), (backend.name, err)


# --------------------------------------------------------------------------------------------------
# all-gather + GEMM
# --------------------------------------------------------------------------------------------------
AG_MS = (64, 5, 100, 1)  # rows per rank: whole tiles, fewer than a tile, 1.6 tiles, one row


def _all_gather(comm, quant, n, combos):
    outs = {}
    w_problem, b_pre = operands(comm.rank, 8, n, quant, seed=99)  # this rank's weight (column shard)
    for mode, transport in combos:
        with AllGatherGemmOp(comm, n=n, k=K, m_max=128 * comm.world, quant=quant, mode=mode, transport=transport,
                             chunks=3, deadline_s=DEADLINE_S) as op:
            for i, m in enumerate(AG_MS):
                p, _ = operands(comm.rank, m, n, quant, seed=i)
                got = op(p.a, b_pre, p.a_scale, w_problem.b_scale, return_a=(i == 2))
                if i == 2:  # fp8 tensors do not pickle: their bytes travel, with the scale's layout
                    out, a_all, s_all = got
                    got = (out, a_all.view(torch.uint8), s_all.contiguous().view(torch.uint8), s_all.shape,
                           s_all.stride())
                outs[(mode, transport, i)] = got
    return outs


AG_COMBOS = [("fused", "dma"), ("split", "dma"), ("fused", "lsa")]
AG_CASES = [pytest.param(2, quant, AG_COMBOS, id=f"w2-{quant}") for quant in q.QUANTS]
AG_CASES += [pytest.param(4, "blockscale", AG_COMBOS[:2], id="w4-blockscale")]


@pytest.mark.parametrize("world, quant, combos", AG_CASES)
def test_all_gather_gemm_is_the_gemm_of_every_ranks_rows(world, quant, combos):
    """Each rank's output is all_gather(a_r) @ W_r.T, rows in rank order; the gathered input it
    returns (``return_a``) is every rank's rows and scales in ``a_scale``'s layout."""
    n = 256
    per_rank = check_outcomes(spawn(_all_gather, world=world, args=(quant, n, combos), timeout_s=240))
    for rank, outs in enumerate(per_rank):
        w_problem, _ = operands(rank, 8, n, quant, seed=99)
        for (mode, transport, i), got in outs.items():
            m = AG_MS[i]
            parts = [operands(r, m, n, quant, seed=i)[0] for r in range(world)]
            a_all = torch.cat([p.a for p in parts])
            s_all = torch.cat([p.a_scale for p in parts])
            if quant == "blockscale":
                s_all = s_all.t().contiguous().t()
            ref = q.reference_gemm(a_all, w_problem.b, s_all, w_problem.b_scale, quant)
            if i == 2:
                got, a_bytes, s_bytes, s_shape, s_stride = got
                assert torch.equal(a_bytes, a_all.view(torch.uint8))
                assert s_shape == s_all.shape and s_stride == s_all.stride(), (s_stride, s_all.stride())
                assert torch.equal(s_bytes, s_all.contiguous().view(torch.uint8))
            assert got.shape == (world * m, n), (mode, transport, i, got.shape)
            assert_close(got, ref, quant)


def _ag_mismatch(comm):
    m = 40 if comm.rank == 1 else 64
    with AllGatherGemmOp(comm, n=256, k=K, m_max=256, chunks=2, deadline_s=DEADLINE_S) as op:
        p, b_pre = operands(comm.rank, m, 256, "ptpc")
        try:
            op(p.a, b_pre, p.a_scale, p.b_scale)
            first = ("returned", "")
        except PeerMismatchError as err:
            first = ("PeerMismatchError", str(err), getattr(err, "__notes__", []))
        p, b_pre = operands(comm.rank, 64, 256, "ptpc", seed=3)
        return first, op(p.a, b_pre, p.a_scale, p.b_scale)


def test_all_gather_rank_with_other_rows_gets_a_clear_error_then_op_recovers():
    per_rank = check_outcomes(spawn(_ag_mismatch, world=3, timeout_s=60))
    for (kind, msg, notes), after in per_rank:
        assert kind == "PeerMismatchError" and "M=40" in msg and "M=64" in msg, msg
        assert sum(n.startswith("(raised by AllGatherGemmOp(") for n in notes) == 1, notes  # the op, named once
    for rank, (_, after) in enumerate(per_rank):
        p = operands(rank, 64, 256, "ptpc", seed=3)[0]  # this rank's weight of the second call
        a_all = torch.cat([operands(r, 64, 256, "ptpc", seed=3)[0].a for r in range(3)])
        s_all = torch.cat([operands(r, 64, 256, "ptpc", seed=3)[0].a_scale for r in range(3)])
        assert_close(after, q.reference_gemm(a_all, p.b, s_all, p.b_scale, "ptpc"), "ptpc")


# --------------------------------------------------------------------------------------------------
# self tests: pass on a working transport, fail on a silent one
# --------------------------------------------------------------------------------------------------
def _self_test(comm, which, transport, silent):
    kw = dict(n=256, k=K, m_max=128, transport=transport, deadline_s=DEADLINE_S, faults=FaultPlan(silent=silent))
    op = (AllGatherGemmOp(comm, quant="blockscale", **kw) if which == "ag" else
          GemmReduceScatterOp(comm, scatter_dim=0 if which == "rs0" else 1, **kw))
    with op:
        try:
            return "passed", op.self_test()
        except SelfTestError as err:
            return "SelfTestError", str(err)


@pytest.mark.parametrize("which, transport", [("rs0", "dma"), ("rs1", "lsa"), ("ag", "dma"), ("ag", "lsa")])
def test_self_test_passes_on_a_working_transport_and_fails_on_a_silent_one(which, transport):
    world = 2
    working = check_outcomes(spawn(_self_test, world=world, args=(which, transport, False), timeout_s=60))
    for kind, rep in working:
        assert kind == "passed", rep
        assert "bit-exact" in rep["checked"]
        # the most rows a call may pass: a rank's share for the all-gather (m_max / W), m_max otherwise
        assert rep["m"] == (128 // world if which == "ag" else 128), rep
    silent = check_outcomes(spawn(_self_test, world=world, args=(which, transport, True), timeout_s=60))
    for kind, msg in silent:
        assert kind == "SelfTestError" and "did not arrive" in msg, msg


def _self_test_of_no_rows(comm, which):
    kw = dict(n=256, k=K, m_max=128, deadline_s=DEADLINE_S)
    op = AllGatherGemmOp(comm, **kw) if which == "ag" else GemmReduceScatterOp(comm, scatter_dim=0, **kw)
    with op:
        try:
            op.self_test(m=0)
        except ValueError as err:
            return str(err)
    return "no error"


@pytest.mark.parametrize("which, says", [("ag", "m=0 must be rows a call may pass: 1..64 rows per rank (m_max=128 "
                                                "gathered rows over world=2)"),
                                         ("rs0", "m=0 must be rows a call may pass: a multiple of world=2 from 2 to "
                                                 "m_max=128")])
def test_self_test_of_no_rows_names_the_pattern_s_row_counts(which, says):
    """Before, every pattern's message said 1..m_max (128): the all-gather takes 64 per rank, the
    reduce-scatter along rows only even counts."""
    for msg in check_outcomes(spawn(_self_test_of_no_rows, world=2, args=(which,), timeout_s=60)):
        assert says in msg, msg


# --------------------------------------------------------------------------------------------------
# what a direct caller passes: scale forms, a constructor argument on one rank, the library op, supports
def _gather_scales_in_every_form(comm):
    """The all-gather's output and returned input with the scale forms the checks accept (mxfp8's
    uint8 bits, ptpc's [M, 1]) on rank 1 only, against the canonical forms on both ranks."""
    from cco.quant import E8M0

    found = {}
    for quant, form in (("mxfp8", lambda s: s.view(torch.uint8)), ("ptpc", lambda s: s.view(-1, 1))):
        p, b_pre = operands(comm.rank, 16, 256, quant, seed=3)
        with AllGatherGemmOp(comm, n=256, k=K, m_max=64, quant=quant, chunks=2, deadline_s=DEADLINE_S) as op:
            ref, ref_a, ref_s = op(p.a, b_pre, p.a_scale, p.b_scale, return_a=True)
            scale = form(p.a_scale) if comm.rank == 1 else p.a_scale
            out, a_all, s_all = op(p.a, b_pre, scale, p.b_scale, return_a=True)
            plain = op(p.a, b_pre, scale, p.b_scale)
        canonical = s_all.view(E8M0) if quant == "mxfp8" and s_all.dtype == torch.uint8 else s_all.reshape(ref_s.shape)
        found[quant] = (torch.equal(out, ref), torch.equal(plain, ref), torch.equal(a_all.view(torch.uint8),
                        ref_a.view(torch.uint8)), torch.equal(canonical.view(torch.uint8) if quant == "mxfp8"
                                                              else canonical, ref_s.view(torch.uint8)
                                                              if quant == "mxfp8" else ref_s),
                        s_all.dtype == scale.dtype and s_all.dim() == scale.dim())
    return found


def test_the_all_gather_takes_every_scale_form_the_checks_accept():
    """Before, mxfp8's A scale passed as its uint8 bits (which the checks accept) was copied into
    the e8m0 window slot by value: every rank's output was wrong (relative error ~3e3) with no
    error; ptpc's [M, 1] scale failed the copy on that rank ("output with shape [16] doesn't match
    the broadcast shape") and its peer waited out its deadline. Now both are taken as views of the
    slot's form, and the returned scales come back in the form passed."""
    for rank, found in enumerate(check_outcomes(spawn(_gather_scales_in_every_form, world=2, timeout_s=120))):
        for quant, checks in found.items():
            assert all(checks), (rank, quant, checks)


def _scatter_dim_on_one_rank(comm):
    try:
        GemmReduceScatterOp(comm, n=256, k=K, m_max=64, scatter_dim=2 if comm.rank == 1 else 0,
                            deadline_s=DEADLINE_S).close()
        return "built"
    except Exception as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"


def test_a_scatter_dim_refused_on_one_rank_fails_the_construction_on_every_rank():
    """Before, the refusal of ``scatter_dim=2`` raised on rank 1 before the ranks' agreement on the
    arguments, and rank 0 waited in that agreement until rank 1's process ended (gloo's
    "Connection closed by peer"); now it goes through the agreement: both ranks raise naming it."""
    for o in spawn(_scatter_dim_on_one_rank, world=2, timeout_s=60):
        assert o.ok and o.value.startswith("ArgumentMismatchError: GemmReduceScatterOp:"), (o.rank, o.value, o.error)
        assert "scatter_dim = 0 on rank 0, 2 on rank 1" in o.value, o.value


def _library_op_of_another_pattern(comm):
    from cco import library

    p, b_pre = operands(0, 16, 256, "ptpc")
    with GemmReduceScatterOp(comm, n=256, k=K, m_max=64, deadline_s=DEADLINE_S) as op:
        try:
            library.gemm_all_reduce(op, p.a, b_pre, p.a_scale, p.b_scale)
            return "returned"
        except TypeError as err:
            return str(err)


def test_the_all_reduce_library_op_refuses_another_patterns_op():
    """Before, ``cco.library.gemm_all_reduce`` ran a reduce-scatter op (eager: its [M/W, N] output
    from an op named all-reduce; compiled: a fake kernel of [M, N] against it, an inductor assert
    naming no cco function, or with aot_eager a wrong shape silently)."""
    said = check_outcomes(spawn(_library_op_of_another_pattern, world=1, timeout_s=60))[0]
    assert said.startswith("cco.library.gemm_all_reduce: op must be a GemmAllReduceOp, got GemmReduceScatterOp")


def test_supports_answers_for_each_pattern_as_its_op_does():
    """Before, ``cco.supports`` said None for a reduce-scatter along rows of 33 rows at world 2 and
    an all-gather of 64 rows per rank with m_max=64 (each call raises), and refused the op's own
    ``scatter_dim`` keyword with a TypeError text."""
    import cco

    rows = cco.supports(33, 256, 256, 2, backend="cpu", pattern="reduce-scatter-rows")
    assert rows is not None and "M=33 rows, not a multiple of world=2" in rows, rows
    assert cco.supports(32, 256, 256, 2, backend="cpu", scatter_dim=0) is None
    assert "not a multiple of world=2" in cco.supports(33, 256, 256, 2, backend="cpu", scatter_dim=0)
    assert cco.supports(33, 256, 256, 2, backend="cpu", scatter_dim=1) is None
    assert "scatter_dim=3 is not supported" in cco.supports(32, 256, 256, 2, backend="cpu", scatter_dim=3)
    gather = cco.supports(64, 256, 256, 2, backend="cpu", pattern="all-gather", m_max=64)
    assert gather is not None and "at most 32 per rank" in gather, gather
    assert cco.supports(64, 256, 256, 2, backend="cpu", pattern="all-gather") is None  # m_max: every rank's rows
    assert "m_max=256" in cco.supports(300, 512, 256, 4, backend="cpu", m_max=256)


def _self_test_on_one_rank(comm):
    """The reduce-scatter's self test: rank 1 passes an m the op refuses; the ranks ask for
    different m; rank 1 calls it while rank 0 makes a call (deadline 3 s). Each rank's verdicts."""
    found = {}
    p, b_pre = operands(comm.rank, 32, 256, "ptpc")
    with GemmReduceScatterOp(comm, n=256, k=K, m_max=64, deadline_s=3) as op:
        for case, m in (("rank 1 refuses its m", 33 if comm.rank == 1 else 32),
                        ("the ranks ask for different m", 16 if comm.rank == 1 else 32)):
            try:
                op.self_test(m=m)
                found[case] = "passed"
            except Exception as err:
                found[case] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
        found["after"] = op.self_test(m=32)["m"]  # in step: the next test passes on both
    return found


def test_a_self_test_refused_on_one_rank_fails_on_every_rank():
    """Before, ``self_test(m=33)`` on one rank raised there at once and its peer waited in the
    test's barrier until that process ended (the group's timeout, or gloo's "Connection closed"),
    and ranks asking for different m ran different probes. Now the test's arguments are exchanged
    first (bounded by deadline_s): one rank's refusal is PeerRejectedError on its peers, different
    m is PeerMismatchError on every rank, and the next self test passes."""
    outs = check_outcomes(spawn(_self_test_on_one_rank, world=2, timeout_s=60))
    assert outs[1]["rank 1 refuses its m"].startswith("ValueError: GemmReduceScatterOp.self_test: m=33"), outs[1]
    assert outs[0]["rank 1 refuses its m"].startswith("PeerRejectedError: GemmReduceScatterOp.self_test: rank(s) [1]")
    for found in outs:
        assert found["the ranks ask for different m"].startswith("PeerMismatchError") and \
            "32 on rank 0, 16 on rank 1" in found["the ranks ask for different m"], found
        assert found["after"] == 32
