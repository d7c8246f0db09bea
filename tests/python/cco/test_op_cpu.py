"""GemmAllReduceOp on the CPU backend with real rank processes over shared-memory windows."""

import itertools

import pytest
import torch

from cco import quant as q
from cco.comm import check_outcomes, spawn
from cco.op import GemmAllReduceOp
from cco.preshuffle import preshuffle_b
from cco.transport import FaultPlan, PeerMismatchError, SelfTestError

pytestmark = pytest.mark.multirank

MODES = ("fused", "split")
TRANSPORTS = ("dma", "lsa")
GATHERS = ("bf16", "fp8")
DEADLINE_S = 20.0  # generous: 8 ranks share 2 cores in CI


def operands(rank, m, n, k, quant, seed=0):
    p = q.random_problem(m, n, k, quant, seed=1000 * seed + rank)
    return p, preshuffle_b(p.b)


def reference(world, m, n, k, quant, seed=0):
    """all_reduce(reference_gemm) over the ranks: bf16 partials summed in fp32, rounded to bf16."""
    return sum(operands(r, m, n, k, quant, seed)[0].reference().float() for r in range(world)).to(torch.bfloat16)


def assert_close(out, ref, quant, gather):
    if gather == "fp8":
        assert q.rel_l2(out, ref) < q.REL_L2_TOL_FP8_GATHER
    else:
        assert q.rel_l2(out, ref) < q.REL_L2_TOL[quant]
        assert q.count_mismatches(out, ref) == 0


# --------------------------------------------------------------------------------------------------
def _every_combination(comm, quant, m, n, k, combos):
    p, b_pre = operands(comm.rank, m, n, k, quant)
    outs = {}
    for mode, transport, gather in combos:
        with GemmAllReduceOp(comm, n=n, k=k, m_max=m, quant=quant, mode=mode, transport=transport,
                             gather_dtype=gather, deadline_s=DEADLINE_S) as op:
            outs[(mode, transport, gather)] = op(p.a, b_pre, p.a_scale, p.b_scale)
    return outs


ALL = list(itertools.product(MODES, TRANSPORTS, GATHERS))
CASES = [pytest.param(w, quant, m, n, ALL, id=f"w{w}-{quant}-{m}x{n}x256")
         for w, m, n in ((2, 192, 512), (4, 130, 512)) for quant in q.QUANTS]
# world 8: tiny and few (8 ranks share the CI machine's 2 cores)
CASES += [pytest.param(8, "ptpc", 64, 256, [("fused", "dma", "bf16"), ("split", "lsa", "fp8")], id="w8-ptpc-64x256x256"),
          pytest.param(8, "blockscale", 100, 256, [("fused", "lsa", "bf16"), ("split", "dma", "bf16")], id="w8-blockscale-100x256x256"),
          pytest.param(8, "mxfp8", 64, 256, [("fused", "dma", "fp8")], id="w8-mxfp8-64x256x256")]


@pytest.mark.parametrize("world, quant, m, n, combos", CASES)
def test_matches_reference_and_is_identical_on_all_ranks(world, quant, m, n, combos):
    """Every quant x mode x transport x gather dtype against the fp32 reference; all ranks equal."""
    k = 256
    per_rank = check_outcomes(spawn(_every_combination, world=world, args=(quant, m, n, k, combos), timeout_s=240))
    ref = reference(world, m, n, k, quant)
    for combo in combos:
        outs = [r[combo] for r in per_rank]
        assert outs[0].shape == (m, n) and outs[0].dtype == torch.bfloat16
        for other in outs[1:]:
            assert torch.equal(other, outs[0]), combo
        assert_close(outs[0], ref, quant, combo[2])


# --------------------------------------------------------------------------------------------------
def _gemm_only(comm, quant, m, n, k):
    p, b_pre = operands(comm.rank, m, n, k, quant)
    with GemmAllReduceOp(comm, n=n, k=k, m_max=m, quant=quant, mode="gemm-only") as op:
        return op(p.a, b_pre, p.a_scale, p.b_scale), op.calls, _quiet_window(op)


def _quiet_window(op) -> tuple:
    """(publishes, window bytes, what self_test raised) of an op that moves nothing."""
    try:
        op.self_test()
        refused = None
    except RuntimeError as err:
        refused = str(err)
    return op.publishes, op.config.window.nbytes, refused


def test_gemm_only_returns_the_local_partial():
    outs = check_outcomes(spawn(_gemm_only, world=2, args=("blockscale", 64, 256, 256), timeout_s=60))
    for rank, (out, calls, (publishes, nbytes, refused)) in enumerate(outs):
        assert calls == 0  # no collective happened
        assert torch.equal(out, operands(rank, 64, 256, 256, "blockscale")[0].reference())
        # no data planes mapped (m_max 64 x n 256: 96 KiB of them before), and no self test to run
        assert not publishes and nbytes < 16 << 10, nbytes
        assert refused is not None and "mode 'gemm-only' moves no data" in refused, refused


def _alone(comm, quant, m, n, k):
    p, b_pre = operands(comm.rank, m, n, k, quant)
    got = {}
    for mode, gather in (("fused", "bf16"), ("split", "fp8")):
        with GemmAllReduceOp(comm, n=n, k=k, m_max=m, quant=quant, mode=mode, gather_dtype=gather) as op:
            outs = [op(p.a, b_pre, p.a_scale, p.b_scale) for _ in range(2)]
            w = op.config.window
            untouched = all(not op.window.tensor(r, rank=0).view(torch.uint8).any() for r in (w.partial, w.counters))
            got[mode] = (outs, op.calls, untouched, _quiet_window(op))
    return got


def test_one_rank_runs_the_plain_gemm_and_leaves_the_window_alone():
    """World 1: the all-reduce is the identity; the call is the GEMM into ``out`` (exact, even with
    the fp8 gather asked for), counted as a call, with no window traffic."""
    (got,) = check_outcomes(spawn(_alone, world=1, args=("mxfp8", 64, 256, 256), timeout_s=60))
    ref = operands(0, 64, 256, 256, "mxfp8")[0].reference()
    for mode, (outs, calls, untouched, (publishes, nbytes, refused)) in got.items():
        assert calls == 2, mode
        assert untouched, f"{mode}: a world-1 call wrote the window"
        assert not publishes and nbytes < 16 << 10, (mode, nbytes)  # its words alone: no data planes
        assert refused is not None and "one rank (world 1) moves no data" in refused, (mode, refused)
        for out in outs:
            assert torch.equal(out, ref), mode


def _closed_op(comm):
    p, b_pre = operands(comm.rank, 64, 256, 256, "ptpc")
    op = GemmAllReduceOp(comm, n=256, k=256, m_max=64, deadline_s=DEADLINE_S)
    op(p.a, b_pre, p.a_scale, p.b_scale)
    op.check()
    op.close()
    op.close()  # idempotent
    got = {}
    for name, fn in (("call", lambda: op(p.a, b_pre, p.a_scale, p.b_scale)), ("check", op.check),
                     ("reject", lambda: op.reject(ValueError("x"))), ("self_test", op.self_test)):
        try:
            fn()
            got[name] = None
        except RuntimeError as err:
            got[name] = str(err)
    return got


def test_every_entry_of_a_closed_op_says_it_is_closed():
    """Before, ``check()`` after ``close()`` returned as if every call had passed; the other entries
    raised. Now each names the op as closed (local: a closed op takes part in no call)."""
    for got in check_outcomes(spawn(_closed_op, world=2, timeout_s=60)):
        assert all(msg is not None and "closed" in msg for msg in got.values()), got
        assert got["check"].startswith("GemmAllReduceOp.check: the op is closed"), got["check"]


# --------------------------------------------------------------------------------------------------
ALTERNATING_M = (64, 1, 130, 256, 17, 64, 200)


def _alternating_m(comm, mode, transport, chunks):
    n, k = 384, 256  # world 3: 128 columns per rank
    outs = []
    with GemmAllReduceOp(comm, n=n, k=k, m_max=256, mode=mode, transport=transport, chunks=chunks,
                         deadline_s=DEADLINE_S) as op:
        for i, m in enumerate(ALTERNATING_M):
            p, b_pre = operands(comm.rank, m, n, k, "ptpc", seed=i)
            assert op.padded_m(m) == op.pad_rows(m) + m and op.padded_m(m) % 64 == 0
            outs.append(op(p.a, b_pre, p.a_scale, p.b_scale))
    return outs


@pytest.mark.parametrize("mode, transport, chunks", [("fused", "dma", 3), ("split-lsa", None, 3),
                                                     ("fused", "dma", (1, 3, 1))])
def test_alternating_m_including_small_m(mode, transport, chunks):
    """Guards: counter targets or chunk rows computed for the previous call's M (and with chunks of
    unequal sizes)."""
    world = 3
    per_rank = check_outcomes(spawn(_alternating_m, world=world, args=(mode, transport, chunks), timeout_s=120))
    for i, m in enumerate(ALTERNATING_M):
        ref = reference(world, m, 384, 256, "ptpc", seed=i)
        for outs in per_rank:
            assert torch.equal(outs[i], per_rank[0][i])
        assert_close(per_rank[0][i], ref, "ptpc", "bf16")


# --------------------------------------------------------------------------------------------------
CALLS = 50


def _repeated_calls(comm, transport):
    n, k, m = 256, 256, 96  # 2 chunks of one 64-row tile; n_slice 128 = one 128-wide tile
    p0, b_pre = operands(comm.rank, m, n, k, "ptpc", seed=0)
    p7, _ = operands(comm.rank, m, n, k, "ptpc", seed=7)
    a, a_scale = p0.a.clone(), p0.a_scale.clone()
    history, outs = [], []
    with GemmAllReduceOp(comm, n=n, k=k, m_max=128, transport=transport, chunks=2, deadline_s=DEADLINE_S) as op:
        w = op.config.window
        for i in range(CALLS):
            if i == CALLS // 2:  # operands change in place (same storage): the op must use the new values
                a.copy_(p7.a)
                a_scale.copy_(p7.a_scale)
            outs.append(op(a, b_pre, a_scale, p0.b_scale))
            history.append((op.window.words(w.counters, rank=comm.rank).clone(),
                            op.window.words(w.scatter_flags, rank=comm.rank).clone(),
                            op.window.words(w.gather_flags, rank=comm.rank).clone()))
    return history, outs


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fifty_calls_counters_monotonic_and_results_stable(transport):
    """Guards: counters or flags reset between calls (graph replay would pass a wait early or hang),
    and results cached across calls whose operands changed in place."""
    world = 2
    per_rank = check_outcomes(spawn(_repeated_calls, world=world, args=(transport,), timeout_s=120))
    for rank, (history, outs) in enumerate(per_rank):
        for i, (counters, scatter, gather) in enumerate(history):
            seq = i + 1  # one tile per (dest, chunk) per call: the counters count calls here
            assert counters.view(world, 8)[:, :2].eq(seq).all() and counters.view(world, 8)[:, 2:].eq(0).all()
            # the peer may already have scattered its next call (it needs nothing more from us for that)
            peer_flags = scatter.view(world, 8)[1 - rank, :2]
            assert (peer_flags >= seq).all() and (peer_flags <= seq + 1).all()
            # ... but it cannot gather its next call before our next scatter
            assert gather.view(world, 8)[:, :2].eq(seq).all()
        for (c0, s0, g0), (c1, s1, g1) in zip(history, history[1:]):
            assert (c1 >= c0).all() and (s1 >= s0).all() and (g1 >= g0).all()  # never reset
        assert all(torch.equal(o, outs[0]) for o in outs[: CALLS // 2])
        assert all(torch.equal(o, outs[-1]) for o in outs[CALLS // 2:])
        assert torch.equal(outs[-1], per_rank[0][1][-1])
    first = reference(world, 96, 256, 256, "ptpc", seed=0)
    changed = sum(q.reference_gemm(operands(r, 96, 256, 256, "ptpc", seed=7)[0].a, operands(r, 96, 256, 256, "ptpc")[0].b,
                                   operands(r, 96, 256, 256, "ptpc", seed=7)[0].a_scale,
                                   operands(r, 96, 256, 256, "ptpc")[0].b_scale, "ptpc").float()
                  for r in range(world)).to(torch.bfloat16)
    assert_close(per_rank[0][1][0], first, "ptpc", "bf16")
    assert_close(per_rank[0][1][-1], changed, "ptpc", "bf16")


# --------------------------------------------------------------------------------------------------
def _bad_inputs(comm):
    n, k, m = 256, 256, 64
    p, b_pre = operands(comm.rank, m, n, k, "blockscale")
    errors = []
    with GemmAllReduceOp(comm, n=n, k=k, m_max=128, quant="blockscale", deadline_s=DEADLINE_S) as op:
        good = op(p.a, b_pre, p.a_scale, p.b_scale)
        bad_calls = [
            ("a fnuz", lambda: op(p.a.float().to(torch.float8_e4m3fnuz), b_pre, p.a_scale, p.b_scale)),
            ("a bf16", lambda: op(p.a.float().to(torch.bfloat16), b_pre, p.a_scale, p.b_scale)),
            ("row-major scale", lambda: op(p.a, b_pre, p.a_scale.contiguous(), p.b_scale)),
            ("M > m_max", lambda: op(torch.cat([p.a] * 3), b_pre, torch.cat([p.a_scale] * 3).t().contiguous().t(), p.b_scale)),
            ("other N", lambda: op(p.a, b_pre[:128], p.a_scale, p.b_scale[:1])),
            ("K mismatch", lambda: op(p.a[:, :128].contiguous(), b_pre, p.a_scale[:, :1], p.b_scale)),
        ]
        for name, call in bad_calls:
            try:
                call()
                errors.append((name, None, ""))
            except (TypeError, ValueError) as err:
                errors.append((name, type(err).__name__, str(err)))
        calls_after_rejections = op.calls
        again = op(p.a, b_pre, p.a_scale, p.b_scale)
    return good, again, errors, calls_after_rejections


def test_bad_inputs_rejected_cleanly_and_op_stays_usable():
    """Guards: a rejected call that left a half-published call behind. Every rank rejects the same
    inputs here; a rejected call is still a collective call (it consumes a seq on every rank: a
    one-sided rejection is ``fault_scenarios``' "bad-input"), so the ranks stay in step."""
    per_rank = check_outcomes(spawn(_bad_inputs, world=2, timeout_s=60))
    expect = {"a fnuz": ["float8_e4m3fnuz", "a"], "a bf16": ["float8_e4m3fn"],
              "row-major scale": ["column-major", "a_scale"], "M > m_max": ["M=192", "m_max=128"],
              "other N": ["N=128", "n=256"], "K mismatch": ["K"]}
    for good, again, errors, calls in per_rank:
        assert torch.equal(good, again)
        assert calls == 1 + len(errors)  # each rejection was a call, on both ranks
        for name, kind, msg in errors:
            assert kind is not None, f"{name} was accepted"
            assert "GemmAllReduceOp.__call__" in msg, msg
            for word in expect[name]:
                assert word in msg, (name, msg)


def _m_mismatch(comm):
    n, k = 384, 256
    m = 64 if comm.rank == 1 else 128  # rank 1 disagrees
    with GemmAllReduceOp(comm, n=n, k=k, m_max=128, chunks=2, deadline_s=DEADLINE_S) as op:
        p, b_pre = operands(comm.rank, m, n, k, "ptpc")
        try:
            op(p.a, b_pre, p.a_scale, p.b_scale)
            first = ("returned", "")
        except PeerMismatchError as err:
            first = ("PeerMismatchError", str(err), getattr(err, "__notes__", []))
        p, b_pre = operands(comm.rank, 96, n, k, "ptpc")
        return first, op(p.a, b_pre, p.a_scale, p.b_scale)


def test_rank_with_other_m_gets_a_clear_error_then_op_recovers():
    world = 3
    per_rank = check_outcomes(spawn(_m_mismatch, world=world, timeout_s=60))
    for rank, ((kind, msg, notes), after) in enumerate(per_rank):
        assert kind == "PeerMismatchError", (rank, msg)
        assert "M=64" in msg and "M=128" in msg and "same number of rows" in msg
        # the transport's error names ranks and the step; a note names the op (a job holds several)
        named = [n for n in notes if n.startswith("(raised by GemmAllReduceOp(")]
        assert len(named) == 1 and f"rank={rank}/3, n=384, k=256, m_max=128" in named[0] and "seq 1" in named[0], \
            notes
        assert torch.equal(after, per_rank[0][1])
    assert_close(per_rank[0][1], reference(world, 96, 384, 256, "ptpc"), "ptpc", "bf16")


def _tag_mismatch(comm):
    """One op, three calls of the same operands: rank 1 with tag 4 against tag 3 (two callers of
    one op: the layers of a family), rank 1 with a tag out of range, then both with tag 3."""
    n, k = 384, 256
    found = []
    with GemmAllReduceOp(comm, n=n, k=k, m_max=128, chunks=2, deadline_s=DEADLINE_S) as op:
        p, b_pre = operands(comm.rank, 64, n, k, "ptpc")
        for tag in (4 if comm.rank == 1 else 3, 256 if comm.rank == 1 else 3):
            try:
                op(p.a, b_pre, p.a_scale, p.b_scale, tag=tag)
                found.append(("returned", ""))
            except Exception as err:
                found.append((type(err).__name__, str(err).splitlines()[0]))
        return found, op(p.a, b_pre, p.a_scale, p.b_scale, tag=3)


def test_calls_of_one_op_with_other_tags_fail_on_every_rank():
    """Guards: a call's stamp carried (seq, M) only, so two callers sharing one op (cco.nn's layers
    of one shape) on different ranks paired their calls and returned a sum of two products. The
    tag is stamped too: every rank raises PeerMismatchError naming both tags; a tag out of range is
    a rejected input (ValueError here, PeerRejectedError on the peer); the next call is right."""
    per_rank = check_outcomes(spawn(_tag_mismatch, world=2, timeout_s=60))
    for rank, (found, after) in enumerate(per_rank):
        (kind, msg), (bad_kind, bad_msg) = found
        assert kind == "PeerMismatchError" and "layer #3" in msg and "layer #4" in msg, (rank, msg)
        if rank == 1:
            assert bad_kind == "ValueError" and "tag=256 must be an int in 0..255" in bad_msg, bad_msg
        else:
            assert bad_kind == "PeerRejectedError" and "rank 1" in bad_msg, bad_msg
        assert torch.equal(after, per_rank[0][1])
    assert_close(per_rank[0][1], reference(2, 64, 384, 256, "ptpc"), "ptpc", "bf16")


# --------------------------------------------------------------------------------------------------
def _self_test(comm, transport, gather, silent):
    with GemmAllReduceOp(comm, n=384, k=256, m_max=96, transport=transport, gather_dtype=gather,
                         deadline_s=DEADLINE_S, faults=FaultPlan(silent=silent)) as op:
        try:
            return "passed", op.self_test()
        except SelfTestError as err:
            return "SelfTestError", str(err)


@pytest.mark.parametrize("gather", GATHERS)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_self_test_passes_on_a_working_transport_and_fails_on_a_silent_one(transport, gather):
    """Guards the mori trap: a transport built without DMA support signals but moves nothing and
    benchmarks fast. The same self_test must pass on the real transport and fail on the silent one."""
    world = 3
    working = check_outcomes(spawn(_self_test, world=world, args=(transport, gather, False), timeout_s=60))
    bf16_bytes = 2
    assert all(kind == "passed" and rep["scatter_bytes_received"] == (world - 1) * 96 * 128 * bf16_bytes
               and [r["m"] for r in rep["runs"]] == [96]  # one transfer path on the CPU: one run
               for kind, rep in working), working
    silent = check_outcomes(spawn(_self_test, world=world, args=(transport, gather, True), timeout_s=60))
    for kind, msg in silent:
        assert kind == "SelfTestError"
        assert "did not arrive" in msg and "rank 0" in msg


def _self_test_with_a_stalled_peer(comm):
    """Rank 1 stalls for 4 deadlines between the test's agreement and its barrier (a peer stuck in
    its own work); each rank's error and how long after the test's start it came."""
    import time

    with GemmAllReduceOp(comm, n=256, k=256, m_max=32, deadline_s=2.0) as op:
        if comm.rank == 1:
            prepare = op._probe_prepare

            def stalled(m, seq):
                time.sleep(4 * op.deadline_s)
                prepare(m, seq)
            op._probe_prepare = stalled
        start = time.monotonic()
        try:
            op.self_test(m=32)
            return "passed", time.monotonic() - start
        except Exception as err:
            return type(err).__name__, time.monotonic() - start


def test_a_self_test_with_a_stalled_peer_fails_within_its_deadline():
    """Before, the test's barrier (and its verdict exchange) waited for the group's own timeout (30
    minutes for gloo): the rank whose peer stalled there passed once the peer came back, 8 s later,
    and would have hung for good behind a peer stuck for good. Now both are bounded by deadline_s:
    the waiting rank raises CommTimeoutError within deadline + 2 s, and the stalled one, back,
    fails too (its peer is no longer in the test)."""
    (kind0, t0), (kind1, _) = check_outcomes(spawn(_self_test_with_a_stalled_peer, world=2, timeout_s=90))
    assert kind0 == "CommTimeoutError" and t0 < 2.0 + 2.0, (kind0, t0)
    assert kind1 != "passed", kind1


def _across_the_stamp_seq_limit(comm, transport):
    """An op whose calls so far number 2**31 - 3 (a serving job's op after ~days of decode: 80
    layers of one family at 30 steps/s make 2**31 calls in ~10 days), then five calls, each with
    other rows, one of them with a peer's other M: every call's result, or its error."""
    from cco import layout

    n, k, start = 384, 256, 2**31 - 3
    found = []
    with GemmAllReduceOp(comm, n=n, k=k, m_max=128, chunks=2, transport=transport, deadline_s=DEADLINE_S) as op:
        op._seq = start  # the calls before, as if made (nothing else of them is in the window)
        op._backend._header[layout.HEADER_LEFT] = start
        comm.barrier()
        for m in (32, 64, 96, 64, 128):
            p, b_pre = operands(comm.rank, m if (m, comm.rank) != (96, 1) else 64, n, k, "ptpc")
            try:
                found.append((m, op(p.a, b_pre, p.a_scale, p.b_scale)))
            except Exception as err:
                found.append((m, f"{type(err).__name__}: {str(err).splitlines()[0]}"))
        return found, op.calls


@pytest.mark.parametrize("transport", ["dma", "lsa"])
def test_calls_past_the_stamps_seq_range_stay_right(transport):
    """Guards: a call's stamp held its seq in the int64 word's upper 32 bits, so call 2**31 of one
    op made a word past int64 (the CPU window refused it with an overflow; on CUDA the stamp
    became negative and the host read of a peer's stamp no longer matched its call). The stamp now
    holds the seq cycled through 1 .. 2**31 - 1 (peers compare calls a few apart at most): calls
    across the limit are right, and a mismatch there is still every rank's error."""
    per_rank = check_outcomes(spawn(_across_the_stamp_seq_limit, world=2, args=(transport,), timeout_s=90))
    for rank, (found, calls) in enumerate(per_rank):
        assert calls == 2**31 + 2, calls
        for (m, got), (_, other) in zip(found, per_rank[1 - rank][0]):
            if m == 96:
                assert isinstance(got, str) and got.startswith("PeerMismatchError") and "M=64" in got, (rank, got)
                continue
            assert isinstance(got, torch.Tensor), (rank, m, got)
            assert torch.equal(got, other)
            assert_close(got, reference(2, m, 384, 256, "ptpc"), "ptpc", "bf16")
