"""A failure of one rank's own work inside a collective call (an allocation that fails on that rank
alone, say a CUDA out-of-memory in the activation quantizer or in a trainable layer's weight
quantized for the call) fails that call on every rank and leaves the ranks in step: the calls
after it return what they would have returned.

Before, the failing rank raised before its call's first collective step, so its next call took that
step's place: on the fused path its op call took the seq its peers' call had, the two paired, and
the peer returned a result mixed from two calls, with no error (then every later call of the peer
waited for a partner that never came); on the unfused path the header agreed and the data
collective paired with the next call's. Now the rank takes the call's next collective step all the
same, as a refusal: the op's rejected call (``op.reject``), or the header carrying its error; where
the local work comes before a header, it runs first so the header can carry it.

Each case: two CPU ranks, four calls on inputs that differ call by call, their results recorded
once without a fault; then the same four calls with rank 1's local work failing once in the second:
the first call equals its record, the second raises on both ranks (rank 1 its own error, rank 0
``PeerRejectedError``), the third and fourth equal their records.
"""

from __future__ import annotations

import pytest
import torch

from cco.comm import check_outcomes, spawn

CALLS, FAULT_AT = 4, 1
DEADLINE_S = 2  # a wait that is not released (the defect) fails in 2 s


def _arm(comm, targets, ranks=(1,)):
    """``arm`` of :func:`test_cuda_nn.arm_local_fault` (a rank process: nothing to restore)."""
    from tests.python.cco.test_cuda_nn import arm_local_fault

    return arm_local_fault(comm, targets, ranks)[0]


def _layer_case(comm, kind, mode, what, ranks=(1,)):
    import cco.nn.column as column
    import cco.nn.linear as linear
    from cco.nn import ColumnParallelLinear, RowParallelLinear, WindowPool

    kw = dict(group=comm, m_max=16, mode=mode, deadline_s=DEADLINE_S, pool=WindowPool(), trainable=what == "weight")
    g = torch.Generator().manual_seed(7)
    if kind == "column, sequence parallel":
        layer = ColumnParallelLinear(256, 128, sequence_parallel=True, **kw)
        rows = 4  # this rank's tokens: 8 gathered
    else:
        layer = RowParallelLinear(128, 256, sequence_parallel=kind == "row, sequence parallel",
                                  **{**kw, "m_max": 8 if kind == "row, in pieces" else 16})
        rows = 8 if kind != "row, in pieces" else 20  # in pieces: 8 + 8 + 4
    w = torch.randn(layer.out_features, layer.in_features_per_rank, generator=g)
    layer.load_weight(w)
    xs = [torch.randn(rows, layer.in_features_per_rank, generator=torch.Generator().manual_seed(100 * i + comm.rank))
          for i in range(CALLS)]
    # the activations' quantizer, or (a trainable layer in training) the master weight's quantization
    arm = _arm(comm, [(layer, "_laid_out")] if what == "weight" else
               [(linear, "quantize_activation"), (column, "quantize_activation")], ranks)

    def call(i):
        with torch.no_grad():
            return (layer(xs[i]),)
    return _run(call, arm)


def _run(call, arm):
    """``call(i)``'s results without a fault, then with ``arm()`` before call ``FAULT_AT``: per call of
    the second pass, "same" (equal to the first pass's), "other" (a result, not the same) or the
    error's type."""
    record = [call(i) for i in range(CALLS)]
    got = []
    for i in range(CALLS):
        if i == FAULT_AT:
            arm()
        try:
            result = call(i)
            got.append("same" if all(torch.equal(a, b) for a, b in zip(result, record[i])) else "other")
        except Exception as err:  # noqa: BLE001 - the test reads the type
            got.append(type(err).__name__)
    return got


LAYER_CASES = ["row", "row, in pieces", "row, sequence parallel", "column, sequence parallel"]


def _expect(got, rank):
    fault = "LocalFault" if rank == 1 else "PeerRejectedError"
    return got == ["same", fault, "same", "same"]


@pytest.mark.multirank
@pytest.mark.parametrize("what", ["quantizer", "weight"])
@pytest.mark.parametrize("mode", ["fused", "unfused"])
@pytest.mark.parametrize("kind", LAYER_CASES)
def test_a_layer_call_whose_local_work_fails_on_one_rank_fails_on_every_rank_and_the_next_is_right(kind, mode, what):
    """``what`` fails on rank 1: the activations' quantizer (inside the call), or a trainable layer's
    master weight quantized afresh for the call (in training: before the call's body)."""
    outs = check_outcomes(spawn(_layer_case, world=2, args=(kind, mode, what), timeout_s=120))
    for rank, got in enumerate(outs):
        assert _expect(got, rank), (kind, mode, what, rank, outs)


@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["fused", "unfused"])
def test_a_layer_call_whose_local_work_fails_on_every_rank_alike_fails_there_and_the_next_is_right(mode):
    """An out-of-memory that strikes every rank alike: each raises its own error (every rank takes
    part as a rejected call, or sends its header with its error), and the next call is right."""
    outs = check_outcomes(spawn(_layer_case, world=2, args=("row", mode, "quantizer", (0, 1)), timeout_s=120))
    for rank, got in enumerate(outs):
        assert got == ["same", "LocalFault", "same", "same"], (mode, rank, outs)


def _op_case(comm, pattern):
    from cco import layout
    from cco import quant as Q
    from cco.all_gather import AllGatherGemmOp
    from cco.op import GemmAllReduceOp
    from cco.preshuffle import preshuffle_b
    from cco.reduce_scatter import GemmReduceScatterOp

    m = 8
    cls, kw = {"all-reduce": (GemmAllReduceOp, {}), "reduce-scatter": (GemmReduceScatterOp, {"scatter_dim": 0}),
               "all-gather": (AllGatherGemmOp, {})}[pattern]
    op = cls(comm, n=256, k=256, m_max=16, deadline_s=DEADLINE_S, **kw)
    p = Q.random_problem(m, 256, 256, "ptpc", seed=3)
    b_pre = preshuffle_b(p.b)
    problems = [Q.random_problem(m, 256, 256, "ptpc", seed=10 * i + comm.rank) for i in range(CALLS)]
    # the op's own work between its checks and its collective: the output's allocation (its shape;
    # the all-gather's scales' form first)
    arm = _arm(comm, [(op, "_as_slot") if pattern == "all-gather" else (layout, "out_shape")])

    def call(i):
        return (op(problems[i].a, b_pre, problems[i].a_scale, p.b_scale),)
    try:
        return _run(call, arm)
    finally:
        op.close()


@pytest.mark.multirank
@pytest.mark.parametrize("pattern", ["all-reduce", "reduce-scatter", "all-gather"])
def test_an_op_call_that_fails_on_one_rank_before_its_collective_fails_on_every_rank(pattern):
    outs = check_outcomes(spawn(_op_case, world=2, args=(pattern,), timeout_s=120))
    for rank, got in enumerate(outs):
        assert _expect(got, rank), (pattern, rank, outs)


def _backward_case(comm, where, backward):
    import torch.nn.functional as F

    import cco.nn.column as column
    import cco.nn.sequence as sequence
    from cco.nn import ColumnParallelLinear, RowParallelLinear, WindowPool

    pool = WindowPool()
    kw = dict(group=comm, m_max=8, sequence_parallel=True, trainable=True, backward=backward,
              deadline_s=DEADLINE_S, pool=pool)
    col, row = ColumnParallelLinear(128, 128, **kw), RowParallelLinear(128, 128, **kw)
    col.load_weight(torch.randn(128, 128, generator=torch.Generator().manual_seed(1)))
    row.load_weight(torch.randn(128, 128, generator=torch.Generator().manual_seed(2)))
    xs = [torch.randn(4, 128, generator=torch.Generator().manual_seed(10 * i + comm.rank)) for i in range(CALLS)]
    if backward == "fp8":
        dual = (row if where == "row" else col)._dual
        assert dual is not None, "backward='fp8' fell back to bf16: nothing to test"
        arm = _arm(comm, [(dual, "weight")])  # the dual op's weight, laid out per backward
    else:  # the output of the layer's backward all-gather (allocated with the rank's own work)
        arm = _arm(comm, [(sequence if where == "row" else column, "gathered_rows")])

    def call(i):
        col.weight.grad = row.weight.grad = None  # (a failed backward may have left one accumulated)
        x = xs[i].clone().requires_grad_(True)
        y = row(F.silu(col(x)))
        y.float().sum().backward()
        return y.detach(), x.grad, col.weight.grad, row.weight.grad
    return _run(call, arm)


@pytest.mark.multirank
@pytest.mark.parametrize("backward", ["fp8", "bf16"])
@pytest.mark.parametrize("where", ["row", "column"])
def test_a_backward_whose_local_work_fails_on_one_rank_fails_on_every_rank(where, backward):
    """A sequence-parallel block's backward, ``where``'s layer failing on rank 1: the fused dual
    op's operands (fp8), or the output of the unfused bf16 all-gather."""
    outs = check_outcomes(spawn(_backward_case, world=2, args=(where, backward), timeout_s=120))
    for rank, got in enumerate(outs):
        assert _expect(got, rank), (where, backward, rank, outs)


def _gpu_check_on_cpu(comm):
    from tests.python.cco import test_cuda_nn

    lines = []
    test_cuda_nn.check_local_failure(comm, lambda *words: lines.append(" ".join(map(str, words))))
    return lines


@pytest.mark.multirank
def test_the_gpu_suites_local_failure_check_runs_on_cpu_ranks():
    """``test_cuda_nn.check_local_failure`` (the GPU suite's case) on two CPU ranks: its own code runs
    and passes where the backend is the CPU's, so a failure of it on a GPU is the GPU path's."""
    for rank, lines in enumerate(check_outcomes(spawn(_gpu_check_on_cpu, world=2, timeout_s=120))):
        assert len(lines) == 2 and all(line.startswith("ok ") for line in lines), (rank, lines)


class _Notes:
    """``PeerNotes`` of a stand-in store: the ranks that posted a rejection of each seq."""

    def __init__(self, posted):
        self.posted_by, self.asked = posted, 0

    def posted(self, *, seq, rank):
        self.asked += 1
        return rank in self.posted_by.get(seq, ())


def _peer_m_of(monkeypatch, world, *, posted, stamps=None, spins=200):
    """``CudaBackend._peer_m(seq 5)`` on rank 0 of ``world`` with the window's words on the host (no
    GPU: a stand-in for the backend's attributes), ``posted``: seq -> the peers that posted a
    rejection; ``stamps``: rank -> the (seq, M) stamp found in ``scatter_m``. Its wait loop may spin
    ``spins`` times (its sleeps counted, not timed): a wait for a stamp that never comes fails."""
    from types import SimpleNamespace

    import cco.backends.cuda as cuda_backend

    words = torch.zeros(world, dtype=torch.int64)
    for rank, stamp in (stamps or {}).items():
        words[rank] = stamp
    tiles = torch.zeros(1, world, 4, dtype=torch.int64)
    window = SimpleNamespace(words=lambda region, rank: words, tensor=lambda region, rank: tiles)
    count = [0]

    def sleep(_):
        count[0] += 1
        if count[0] > spins:
            raise AssertionError(f"_peer_m waited {spins} spins for a stamp that never comes")
    monkeypatch.setattr(cuda_backend.time, "sleep", sleep)
    notes = _Notes(posted)
    fake = SimpleNamespace(config=SimpleNamespace(window=SimpleNamespace(scatter_m=None, tile_flags=None)),
                           window=window, rank=0, world=world, deadline_s=3600.0, notes=notes)
    return cuda_backend.CudaBackend._peer_m(fake, 5), notes


@pytest.mark.host
def test_a_cuda_rank_that_rejects_does_not_wait_for_peers_that_rejected_the_call_too(monkeypatch):
    """Where every rank rejects a call (a bad input, or an out-of-memory, on every rank alike), no
    rank runs it, so no stamp comes: each rank's ``reject`` waited out ``deadline_s`` (60 s by default)
    for one. Now the peers' posted rejections end the wait; a peer that did not reject is still
    waited for, and its M taken."""
    from cco.transport.base import REJECTED_M, stamp_seq_m

    m, notes = _peer_m_of(monkeypatch, 4, posted={5: {1, 2, 3}})
    assert m == REJECTED_M and notes.asked >= 3
    m, _ = _peer_m_of(monkeypatch, 2, posted={}, stamps={1: stamp_seq_m(5, REJECTED_M)})  # its stamp says so
    assert m == REJECTED_M
    m, _ = _peer_m_of(monkeypatch, 4, posted={5: {1, 3}}, stamps={2: stamp_seq_m(5, 96)})
    assert m == 96
    with pytest.raises(AssertionError, match="waited 200 spins"):  # a peer that rejected another call
        _peer_m_of(monkeypatch, 2, posted={4: {1}})


@pytest.mark.host
def test_rejection_notes_say_whether_a_rank_posted_without_waiting():
    from types import SimpleNamespace

    import torch.distributed as dist

    from cco.transport.reasons import PeerNotes

    notes = PeerNotes(SimpleNamespace(store=dist.HashStore()), "op")
    assert not notes.posted(seq=3, rank=1)
    notes.post(seq=3, rank=1, reason="RuntimeError: out of memory")
    assert notes.posted(seq=3, rank=1) and not notes.posted(seq=3, rank=0) and not notes.posted(seq=4, rank=1)


@pytest.mark.host
def test_closed_notes_name_the_peers_that_closed_before_the_call_and_never_hold_the_caller():
    """A timeout's note on closed peers (``note_closed_peers``): it names a peer that closed its op
    before this rank's call, not one that closed after it (a survivor closing the op a dead peer
    failed), adds itself once to an error raised again, and returns within its bound where the
    store's reads hang (a store served by a dead rank): the fault bound is deadline + 2 s."""
    import threading
    import time
    from types import SimpleNamespace

    import torch.distributed as dist

    from cco.transport.protocol import CommTimeoutError
    from cco.transport.reasons import PeerNotes, note_closed_peers
    from cco.transport.store import STORE_CALL_S

    notes = PeerNotes(SimpleNamespace(store=dist.HashStore()), "op")
    notes.post_closed(rank=1, seq=3)
    notes.post_closed(rank=2, seq=5)
    err = CommTimeoutError("rank 0: waited")
    note_closed_peers(err, notes, rank=0, world=4, seq=5, what="GemmAllReduceOp")
    assert err.__notes__ == ["rank 1 closed its GemmAllReduceOp (close()) after its call seq 3, so rank 0's calls "
                             "since cannot complete: close the op on every rank together (or none)"]
    note_closed_peers(err, notes, rank=0, world=4, seq=6, what="GemmAllReduceOp")  # the same error, raised again
    assert len(err.__notes__) == 1
    other = ValueError("not a timeout")
    note_closed_peers(other, notes, rank=0, world=4, seq=6, what="GemmAllReduceOp")
    assert not getattr(other, "__notes__", None)

    release = threading.Event()

    class HangingStore:  # every read waits, as a client of a store whose server died may
        def check(self, keys):
            release.wait(30)
            return True

        def get(self, key):
            return b"1"

    hung = CommTimeoutError("rank 0: waited")
    t0 = time.monotonic()
    note_closed_peers(hung, PeerNotes(SimpleNamespace(store=HangingStore()), "op"), rank=0, world=2, seq=2,
                      what="GemmAllReduceOp")
    took = time.monotonic() - t0
    release.set()
    assert took < 2 * STORE_CALL_S, took
    assert not getattr(hung, "__notes__", None)
