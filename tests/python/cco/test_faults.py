"""Failures the op must turn into errors, never hangs and never wrong results: lost transfers,
dead ranks, stalled ranks. Real rank processes; short deadlines."""

import os
import time

import pytest
import torch

from cco import quant as q
from cco.comm import spawn
from cco.op import GemmAllReduceOp
from cco.preshuffle import preshuffle_b
from cco.transport import CommTimeoutError, Drop, FaultPlan

pytestmark = pytest.mark.multirank

DEADLINE_S = 3.0
SLACK_S = 10.0  # scheduling noise of several ranks on 2 cores; a hang would take far longer
N, K, M = 384, 256, 128  # N divisible by world 2 and 3


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


def _dies_or_stalls(comm, victim, how):
    with GemmAllReduceOp(comm, n=N, k=K, m_max=M, deadline_s=DEADLINE_S) as op:
        first = _timed_call(op, comm.rank)
        if comm.rank == victim:
            if how == "dies":
                os._exit(3)
            time.sleep(DEADLINE_S + 2.0)  # stalls past the peers' deadline
        second = _timed_call(op, comm.rank, seed=1)
    return first, second


@pytest.mark.parametrize("how", ["dies", "stalls"])
def test_dead_or_stalled_rank_makes_the_others_raise_within_the_deadline(how):
    world, victim = 3, 2
    outcomes = spawn(_dies_or_stalls, world=world, args=(victim, how), timeout_s=120)
    if how == "dies":
        assert outcomes[victim].error_type == "Died" and outcomes[victim].exitcode == 3
    for o in outcomes:
        if o.rank == victim and how == "dies":
            continue
        assert o.ok, o.error
        first, second = o.value
        assert first[0] == "result"
        kind, msg, seconds = second
        assert kind == "CommTimeoutError", (o.rank, kind)
        assert seconds < DEADLINE_S + SLACK_S
        if o.rank != victim:
            assert "from rank 2" in msg or "rank 2" in msg, msg
        assert "seq 2" in msg, msg


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
