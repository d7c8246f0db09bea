"""Failures the op must turn into errors, never hangs and never wrong results: rejected inputs on
one rank, a mismatched M, lost transfers, dead, stalled and late ranks. Real rank processes; short
deadlines. The scenarios themselves (``fault_scenarios``) are shared with the CUDA test."""

import time

import pytest
import torch

import fault_scenarios
from cco import quant as q
from cco.comm import spawn
from cco.op import GemmAllReduceOp
from cco.preshuffle import preshuffle_b
from cco.transport import CommTimeoutError, Drop, FaultPlan

pytestmark = pytest.mark.multirank

DEADLINE_S = 3.0
SLACK_S = fault_scenarios.RAISE_SLACK_S  # every live rank raises within deadline + 2 s
N, K, M = 384, 256, 128  # N divisible by world 2, 3 and 4


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", fault_scenarios.SCENARIOS)
def test_every_live_rank_raises_in_time_and_a_fresh_op_computes(name, world):
    """Guards, per scenario (``fault_scenarios`` states each promise): a rank's rejected inputs
    that made its peers pair its next call with their current one (wrong results on every rank:
    relL2 ~1, and the ranks' call counts diverged for good); a rank that raised only after twice
    its deadline because it waited a deadline for a peer that never entered the call or had died;
    and, in every scenario, a returned wrong result, a hang (spawn's timeout) or a fresh op (or
    communicator, when a rank died) that does not compute correctly afterwards."""
    victim = world // 2
    setup = fault_scenarios.Setup(n=N, k=K, m=M, deadline_s=DEADLINE_S, device="cpu")
    outcomes = spawn(fault_scenarios.run, world=world, args=(name, victim, setup, "cpu"), timeout_s=120)
    for o in outcomes:
        if name == "killed" and o.rank == victim:
            assert o.error_type == "Died" and o.exitcode == 9, o
            continue
        assert o.ok, f"rank {o.rank}: {o.error_type}: {o.error}"
        assert not o.value["problems"], "\n".join(o.value["problems"] + o.value["seen"])


def operands(rank, seed=0):
    p = q.random_problem(M, N, K, "ptpc", seed=100 * seed + rank)
    return p, preshuffle_b(p.b)


def reference(world, seed=0):
    return sum(operands(r, seed)[0].reference().float() for r in range(world)).to(torch.bfloat16)


def _timed_call(op, rank, seed=0):
    p, b_pre = operands(rank, seed)
    t0 = time.monotonic()
    try:
        return "result", op(p.a, b_pre, p.a_scale, p.b_scale), time.monotonic() - t0
    except CommTimeoutError as err:
        return "CommTimeoutError", str(err), time.monotonic() - t0


def _lost_put(comm, mode, transport, drop):
    with GemmAllReduceOp(comm, n=N, k=K, m_max=M, mode=mode, transport=transport, chunks=2,
                         deadline_s=DEADLINE_S, faults=FaultPlan(drops=(drop,))) as op:
        calls = [_timed_call(op, comm.rank, seed) for seed in (1, 2, 3)]  # the drop hits seq 2
    return calls


@pytest.mark.parametrize("mode, transport", [("fused", "dma"), ("fused", "lsa"), ("split", "dma")])
def test_lost_scatter_put_raises_on_every_rank_and_op_recovers(mode, transport):
    """Guards: a reduce that sums a slot whose transfer never came (stale bytes from the last call)."""
    drop = Drop(phase="scatter", seq=2, src=1, dest=0, chunk=1)
    per_rank = [o.value for o in spawn(_lost_put, world=2, args=(mode, transport, drop), timeout_s=120)]
    assert all(v is not None for v in per_rank), per_rank
    for rank, calls in enumerate(per_rank):
        kind, value, _ = calls[0]
        assert kind == "result" and torch.equal(value, per_rank[0][0][1])
        kind, msg, seconds = calls[1]
        assert kind == "CommTimeoutError", (rank, kind)  # no rank returns a result for seq 2
        assert seconds < DEADLINE_S + SLACK_S
        if rank == 0:
            assert "rank 0: scatter of chunk 1 from rank 1, seq 2" in msg
        else:
            assert "rank 1: gather of chunk 1 from rank 0, seq 2" in msg
        kind, value, _ = calls[2]
        assert kind == "result", (rank, value)  # every rank failed the same call: the op is usable
        assert torch.equal(value, per_rank[0][2][1])
    assert q.count_mismatches(per_rank[0][2][1], reference(2, seed=3)) == 0
    assert q.count_mismatches(per_rank[0][0][1], reference(2, seed=1)) == 0


def test_lost_gather_put_is_detected_by_its_receiver():
    drop = Drop(phase="gather", seq=1, src=0, dest=1, chunk=0)
    per_rank = [o.value for o in spawn(_lost_put, world=2, args=("fused", "dma", drop), timeout_s=120)]
    kind0, value0, _ = per_rank[0][0]
    kind1, msg1, _ = per_rank[1][0]
    assert kind0 == "result"  # rank 0 received everything it needs
    assert q.count_mismatches(value0, reference(2, seed=1)) == 0
    assert kind1 == "CommTimeoutError" and "rank 1: gather of chunk 0 from rank 0, seq 1" in msg1
    assert all(calls[1][0] == "result" and calls[2][0] == "result" for calls in per_rank)


def _stale_flag_variant(comm, racy):
    """Call 1, then call 2 with new operands while rank 1 arrives late for call 2."""
    if racy:  # the variant a reset-free protocol must not be: "the flag is set" instead of ">= seq"
        from cco.backends.cpu import CpuBackend
        from cco.transport.protocol import wait_at_least

        def wait_flag_is_set(self, words, index, plan, deadline, what):
            wait_at_least(words, index, 1, deadline=deadline, what=what)

        CpuBackend._wait_flag = wait_flag_is_set
        CpuBackend._check_peer_m = lambda self, src, plan: None  # its (seq, M) stamp would catch chunk 0
    with GemmAllReduceOp(comm, n=N, k=K, m_max=M, deadline_s=DEADLINE_S + 5) as op:
        _timed_call(op, comm.rank, seed=1)
        if comm.rank == 1:
            time.sleep(1.0)
        return _timed_call(op, comm.rank, seed=2)


@pytest.mark.parametrize("racy", [True, False], ids=["flag-is-set", "flag-at-least-seq"])
def test_flags_from_an_earlier_call_never_complete_a_later_one(racy):
    """Guards: a completion word that is not compared against the call's seq. Without resets, the
    flags of call 1 are still set when call 2 starts; a waiter that only asks "is it set" reduces
    and gathers call 1's bytes from a late peer. The racy variant (also without the chunk-0 (seq, M)
    stamp check, which would otherwise stop it) must return wrong data here, the shipped protocol
    the right data."""
    values = [o.value for o in spawn(_stale_flag_variant, world=2, args=(racy,), timeout_s=120)]
    kind, out, _ = values[0]
    assert kind == "result"
    wrong = q.count_mismatches(out, reference(2, seed=2))
    if racy:
        assert wrong > 0  # rank 0 returned without waiting for rank 1's call 2
    else:
        assert wrong == 0 and torch.equal(out, values[1][1])


# --------------------------------------------------------------------------------------------------
# A failed call must be left by every rank before any rank's next call publishes. Each test below
# makes one rank slow at the moment that matters and runs the shipped protocol and the variant
# without the guard; the variant must show the failure, the protocol must not.
# --------------------------------------------------------------------------------------------------
def _without_leave_rendezvous():
    """The variant before the fix: a call publishes as soon as this rank starts it, and a failed
    call returns at once (no wait for peers to leave it)."""
    from cco import layout
    from cco.backends.cpu import CpuBackend

    def enter(self, seq, m):
        self._header[layout.HEADER_SEQ] = seq
        self._header[layout.HEADER_M] = m

    def leave_failed(self, seq, err):
        self._header[layout.HEADER_LEFT] = seq

    CpuBackend._enter = enter
    CpuBackend._leave_failed = leave_failed


def _mismatched_m_then_agree(comm):
    """Call 1 with M=64 on rank 1 and M=128 elsewhere, then call 2 with M=96 everywhere."""
    from cco.transport import PeerMismatchError

    def call(op, m, seed):
        p = q.random_problem(m, N, K, "ptpc", seed=100 * seed + comm.rank)
        try:
            return "result", op(p.a, preshuffle_b(p.b), p.a_scale, p.b_scale)
        except (PeerMismatchError, CommTimeoutError) as err:
            return type(err).__name__, str(err)

    with GemmAllReduceOp(comm, n=N, k=K, m_max=M, chunks=2, deadline_s=DEADLINE_S) as op:
        first = call(op, 64 if comm.rank == 1 else 128, seed=1)
        return first, call(op, 96, seed=2)


def _slow_stamp_reader(comm, racy):
    """Rank 0 reads rank 1's chunk-0 (seq, M) stamp of call 1 late: only once rank 1 has published
    call 2's chunk 0 to it, or 2 s have passed."""
    from cco import layout
    from cco.backends.cpu import CpuBackend

    if racy:
        _without_leave_rendezvous()
    if comm.rank == 0:
        check = CpuBackend._check_peer_m

        def late_check(self, src, plan):
            if plan.seq == 1 and src == 1:
                until = time.monotonic() + 2.0
                while int(self._scatter_flags[layout.counter_index(1, 0)]) < 2 and time.monotonic() < until:
                    time.sleep(0.01)
            check(self, src, plan)

        CpuBackend._check_peer_m = late_check
    return _mismatched_m_then_agree(comm)


def _late_copier(comm, racy):
    """Rank 0's copier engine is busy for 1 s when call 1 starts, so rank 0 finds the mismatched M
    (rank 1's stamp) while its own chunk-0 put is still queued."""
    import concurrent.futures as cf

    from cco.transport.dma import DmaTransport

    if comm.rank == 0:
        begin = DmaTransport.begin

        def busy_begin(self, plan, deadline):
            if plan.seq == 1:
                self._engine.submit(time.sleep, 1.0)
            begin(self, plan, deadline)

        DmaTransport.begin = busy_begin
        if racy:  # the variant before the fix: abort drops queued puts
            def abort(self):
                self._cancel.set()
                for job in self._jobs:
                    job.cancel()
                cf.wait(self._jobs)
                self._jobs = []

            DmaTransport.abort = abort
    return _mismatched_m_then_agree(comm)


def _expect_clear_mismatch_then_recovery(per_rank):
    for rank, ((kind, msg), _) in enumerate(per_rank):
        assert kind == "PeerMismatchError", (rank, msg)
        assert "M=64" in msg and "M=128" in msg, (rank, msg)
    p = [q.random_problem(96, N, K, "ptpc", seed=200 + r) for r in range(3)]
    ref = sum(x.reference().float() for x in p).to(torch.bfloat16)
    for rank, (_, (kind, out)) in enumerate(per_rank):
        assert kind == "result", (rank, out)
        assert q.count_mismatches(out, ref) == 0


@pytest.mark.parametrize("racy", [True, False], ids=["publish-at-once", "leave-together"])
def test_a_rank_that_fails_first_does_not_overwrite_what_a_slow_peer_still_reads(racy):
    """Guards: the rank with the other M raises, starts its next call and overwrites its chunk-0
    (seq, M) stamp before a slower peer read it; that peer then reports a seq-2 stamp (or a timeout)
    instead of the two Ms. With the leave rendezvous every rank names both Ms and call 2 works."""
    per_rank = [o.value for o in spawn(_slow_stamp_reader, world=3, args=(racy,), timeout_s=120)]
    assert all(v is not None for v in per_rank), per_rank
    if racy:
        kind, msg = per_rank[0][0]
        assert not (kind == "PeerMismatchError" and "M=64" in msg), msg  # the stamp was overwritten
    else:
        _expect_clear_mismatch_then_recovery(per_rank)


@pytest.mark.parametrize("racy", [True, False], ids=["abort-drops-queued-puts", "abort-sends-complete-chunks"])
def test_a_failing_rank_still_delivers_its_complete_chunks(racy):
    """Guards: abort() cancelling a queued copier job. The rank that found the mismatch first never
    sent its chunk 0, so a third rank waited for it until its deadline and saw a timeout, not the
    mismatched M."""
    per_rank = [o.value for o in spawn(_late_copier, world=3, args=(racy,), timeout_s=120)]
    assert all(v is not None for v in per_rank), per_rank
    if racy:
        kind, msg = per_rank[2][0]
        assert kind == "CommTimeoutError" and "from rank 0, seq 1" in msg, (kind, msg)
    else:
        _expect_clear_mismatch_then_recovery(per_rank)


def _late_leaver(comm, racy):
    """Call 1 loses rank 0's gather put to rank 1 (rank 0 returns, rank 1 times out); rank 1 is then
    descheduled for 1.5 s before it leaves call 1. Calls 2 and 3 follow on both ranks."""
    from cco.backends.cpu import CpuBackend

    if racy:
        _without_leave_rendezvous()
    if comm.rank == 1:
        leave_failed = CpuBackend._leave_failed

        def slow_leave(self, seq, err):
            time.sleep(1.5)
            leave_failed(self, seq, err)

        CpuBackend._leave_failed = slow_leave
    drop = Drop(phase="gather", seq=1, src=0, dest=1, chunk=0)
    with GemmAllReduceOp(comm, n=N, k=K, m_max=M, chunks=2, deadline_s=DEADLINE_S,
                         faults=FaultPlan(drops=(drop,))) as op:
        return [_timed_call(op, comm.rank, seed)[:2] for seed in (1, 2, 3)]


@pytest.mark.parametrize("racy", [True, False], ids=["deadline-from-own-start", "deadline-from-peers-entry"])
def test_a_peer_still_failing_the_previous_call_does_not_time_out_the_next(racy):
    """Guards: a rank that returned call 1 starts call 2's deadline while its peer is still timing
    out call 1, so call 2 expires before the peer arrives and the ranks fall out of step. Call 2's
    deadline must start once every peer has left call 1."""
    per_rank = [o.value for o in spawn(_late_leaver, world=2, args=(racy,), timeout_s=120)]
    assert all(v is not None for v in per_rank), per_rank
    assert per_rank[0][0][0] == "result" and per_rank[1][0][0] == "CommTimeoutError"
    if racy:
        assert per_rank[0][1][0] == "CommTimeoutError", per_rank[0][1]
    else:
        for seed in (2, 3):
            outs = [calls[seed - 1] for calls in per_rank]
            assert all(kind == "result" for kind, _ in outs), outs
            assert torch.equal(outs[0][1], outs[1][1])
            assert q.count_mismatches(outs[0][1], reference(2, seed=seed)) == 0


def _wait_at_least_reading_first(words, index, target, *, deadline, what, cancelled=None):
    """The variant before the fix: the word is loaded before the stop conditions are sampled, so a
    cancel that arrives after a stale load ends the wait although the word has reached its target."""
    from cco.transport.protocol import CommTimeoutError as Timeout

    while True:
        value = int(words[index])
        if value >= target:
            return value
        if deadline.left() <= 0:
            raise Timeout(f"{what}: waited {deadline.seconds:.3g} s for value >= {target}, last saw {value}")
        if cancelled is not None and cancelled():
            raise Timeout(f"{what}: wait cancelled because the call already failed")
        time.sleep(20e-6)


class _LoadThenStall:
    """Counter words whose first load by the copier stalls the copier until its call is cancelled:
    the copier is descheduled right after loading a counter below target, while the producer writes
    the rest of the tiles, finds the mismatched M and aborts."""

    def __init__(self, words, cancel):
        self._words, self._cancel, self._stalled = words, cancel, False

    def __setitem__(self, index, value):
        self._words[index] = value

    def __getitem__(self, index):
        value = self._words[index].clone()
        if not self._stalled:
            # the load happened before any tile of call 1 was published (counters start at 0), and
            # the copier is descheduled until the producer has finished, found the mismatch, aborted
            self._stalled = True
            value = torch.zeros_like(value)
            self._cancel.wait(timeout=10.0)
        return value


def _copier_loads_then_call_fails(comm, racy):
    """Rank 1 (M=64, one chunk) finds rank 2's M=128 stamp and aborts while its copier holds a
    counter value loaded before the tiles of chunk 0 were written."""
    from cco.transport import dma

    if racy:
        dma.wait_at_least = _wait_at_least_reading_first
    if comm.rank == 1:
        begin = dma.DmaTransport.begin

        def begin_with_stale_load(self, plan, deadline):
            if plan.seq == 1:
                self._counters = _LoadThenStall(self.window.words(self.config.window.counters, rank=self.rank),
                                                self._cancel)
            else:
                self._counters = self.window.words(self.config.window.counters, rank=self.rank)
            begin(self, plan, deadline)

        dma.DmaTransport.begin = begin_with_stale_load
    return _mismatched_m_then_agree(comm)


@pytest.mark.parametrize("racy", [True, False], ids=["load-then-check-cancel", "check-cancel-then-load"])
def test_a_chunk_completed_before_the_abort_is_still_sent(racy):
    """Guards: the copier's wait loaded the counter, then saw the abort and gave up, although the
    producer had completed the chunk in between; its chunk-0 (seq, M) stamp never left, so both
    peers timed out instead of naming the two Ms (and then missed call 2 as well)."""
    per_rank = [o.value for o in spawn(_copier_loads_then_call_fails, world=3, args=(racy,), timeout_s=120)]
    assert all(v is not None for v in per_rank), per_rank
    if racy:
        # the stale load belongs to one destination's put (0 or 2, whichever the copier read first);
        # that peer never receives rank 1's chunk 0 and times out instead of naming the Ms
        firsts = [per_rank[rank][0] for rank in (0, 2)]
        assert any(kind == "CommTimeoutError" and "scatter of chunk 0 from rank 1, seq 1" in msg
                   for kind, msg in firsts), firsts
    else:
        _expect_clear_mismatch_then_recovery(per_rank)
