"""Faults every backend of the op must turn into errors on every live rank: never a hang, never a
returned wrong result. One module for the CPU ranks (``test_faults.py``, self-spawned) and the
CUDA ranks (``test_cuda_faults.py``, torchrun on one GPU), so both are held to the same words.

``run(comm, name, victim, ...)`` plays scenario ``name`` in one rank and returns that rank's
report: ``{"problems": [...], "seen": [...]}``. A problem is a broken promise in that rank's own
view (a call that returned a wrong result, raised the wrong error, raised too late, or a fresh op
that computes wrongly). The caller asserts that no rank reports one (a dead rank reports nothing).

Every call is followed by ``op.check()`` (a no-op on the CPU backend, where a call raises its own
errors; on CUDA the synchronisation point of asynchronous errors), and the pair counts as the
call. Promises, per scenario:

- ``bad-input``: rank b passes an operand the op rejects (b = every rank in turn, each with another
  kind of bad input), the others valid ones. Rank b raises its own TypeError / ValueError, every
  peer raises ``PeerRejectedError`` naming rank b and its reason; then a good call is correct on
  every rank (the ranks stayed in step). Then every rank passes a bad input: each raises its own
  error (on CUDA saying every peer rejected the call too: no rank waits out its deadline for a
  peer's stamp), and a good call is correct.
- ``m-mismatch``: the victim passes fewer rows (the same number of chunks). Every rank raises
  ``PeerMismatchError`` naming both Ms; then a good call is correct.
- ``m-mismatch-chunks``: the victim passes half the rows (fewer chunks, so peers wait for chunks it
  never sends). Every rank raises; then a good call (CPU) or a fresh op (CUDA) is correct.
- ``stalled``: the victim never makes call 2 (it sleeps past the deadline, then leaves the op).
  Every other rank raises ``CommTimeoutError`` naming the victim and seq 2; then a fresh op is
  correct on every rank.
- ``closed``: the victim closes its op after call 1 (``close()`` is local: a ``with`` block left on
  one rank alone) and makes no call 2. Every other rank raises ``CommTimeoutError`` naming the
  victim and saying that it closed its op after its call seq 1 (the note it left in the store);
  then a fresh op is correct on every rank.
- ``late``: the victim makes call 2 half a deadline late. Every rank's call 2 is correct.
- ``stalled-graph`` (CUDA only): every rank captures one call into a CUDA graph and replays it
  once (correct); then the victim stops replaying. The other ranks' next replay is released at the
  deadline: ``op.check()`` raises ``CommTimeoutError`` and the replay's output is NaN; the victim,
  back, finds its op failed too; then a fresh op is correct on every rank.
- ``stalled-read`` (GPU only): as ``stalled``, but the other ranks read call 2's output on the host
  (``out.cpu()``, a copy to pageable memory the host waits in) before any ``check()``: the read
  must return within the deadline + 2 s, with NaN in every row (the release cannot wait for its
  NaN fill while the driver holds the process's fills behind that copy: this rank's own columns
  are NaN by its reduce, the peers' columns of the dma path may hold stale bytes), and ``check()``
  then raises ``CommTimeoutError`` naming the victim.
- ``stalled-sync`` (GPU only): the same with ``torch.cuda.synchronize()`` (the whole device) before
  the read: it must return within the deadline + 2 s, all NaN.
- ``killed``: the victim's process exits in the middle of call 2. Every other rank raises
  ``CommTimeoutError`` naming the victim; then the survivors build a new communicator and op,
  which compute correctly.
- ``dropped``: the victim's scatter put of chunk 1 to the next rank is lost in call 2
  (``FaultPlan``). Every rank raises ``CommTimeoutError``; then a good call (CPU) or a fresh op
  (CUDA) is correct.

"Raises" means within ``deadline_s + RAISE_SLACK_S`` of the call's start.

``Setup(pattern=...)`` plays the same scenarios on the sequence-parallel ops (``test_sp_faults``):
the reduce-scatter (its reference is this rank's share of the sum) and the all-gather (``m``: rows
per rank; the lost put is one of the victim's input-row chunks; the killed victim dies before it
puts its rows, which would otherwise let the peers finish the call).
"""

from __future__ import annotations

import os
import secrets
import sys
import tempfile
import time

import torch

from cco import quant as q
from cco.bench.timing import allreduce_mismatches, budget_terms
from cco.comm import Communicator
from cco.op import GemmAllReduceOp
from cco.preshuffle import preshuffle_b
from cco.transport import Drop, FaultPlan

RAISE_SLACK_S = 2.0  # the bound: every live rank raises within deadline + 2 s
# killed last: it replaces the communicator
SCENARIOS = ("bad-input", "m-mismatch", "m-mismatch-chunks", "stalled", "closed", "late", "dropped", "killed")
GPU_ONLY = ("stalled-graph", "stalled-read", "stalled-sync")  # a graph's replay, host waits: GPU backends only
GPU_SCENARIOS = SCENARIOS[:-1] + GPU_ONLY + ("killed",)
# on CUDA a call that passed its deadline leaves the op failed (its words may no longer be in step
# with the peers'): the next call raises at once and a fresh op takes over
RECOVERS_IN_PLACE = {"cpu": {"bad-input", "m-mismatch", "m-mismatch-chunks", "dropped"},
                     "cuda": {"bad-input", "m-mismatch"}}


class Setup:
    """Shapes, deadline and device of one run. A rank's weight is a function of the rank (an op is
    built per weight), its activations of (rank, seed)."""

    def __init__(self, *, n: int, k: int, m: int, deadline_s: float, device, transport=None, chunks=2,
                 pattern: str = "all-reduce", quant: str = "ptpc", mode: str = "fused"):
        self.n, self.k, self.m = n, k, m  # m: a call's rows (the all-gather: per rank)
        self.deadline_s = deadline_s
        self.device = torch.device(device)
        self.transport = transport
        self.chunks = chunks
        self.pattern = pattern  # cco.layout.PATTERNS: which op the scenarios play on
        self.quant, self.mode = quant, mode
        self.rank = 0  # the rank whose share the reference is (run() sets it)

    @property
    def op_name(self) -> str:
        names = {"all-gather": "AllGatherGemmOp", "all-reduce": "GemmAllReduceOp"}
        return names.get(self.pattern, "GemmReduceScatterOp")

    def op(self, comm, faults=None, transport=None):
        kw = dict(n=self.n, k=self.k, m_max=self.m, transport=transport or self.transport, chunks=self.chunks,
                  deadline_s=self.deadline_s, faults=faults, quant=self.quant, mode=self.mode)
        if self.pattern == "all-gather":
            from cco.all_gather import AllGatherGemmOp
            return AllGatherGemmOp(comm, **{**kw, "m_max": self.m * comm.world})
        if self.pattern.startswith("reduce-scatter"):
            from cco.reduce_scatter import GemmReduceScatterOp
            return GemmReduceScatterOp(comm, scatter_dim=0 if self.pattern.endswith("rows") else 1, **kw)
        return GemmAllReduceOp(comm, **kw)

    def problem(self, rank: int, seed: int, m: int | None = None):
        m = self.m if m is None else m
        act = q.random_problem(m, self.n, self.k, self.quant, seed=100 * seed + rank)
        weight = q.random_problem(m, self.n, self.k, self.quant, seed=100_000 + rank)
        return q.Problem(self.quant, act.a, weight.b, act.a_scale, weight.b_scale)

    def reference(self, ranks, seed: int, m: int | None = None) -> tuple[torch.Tensor, ...]:
        """all_reduce(reference_gemm) over ``ranks`` on the host, as ``allreduce_mismatches`` takes it:
        the fp32 sum of the partials, of their absolute values, and of |A| @ |B|.T."""
        if self.pattern == "all-gather":  # every rank's rows times this rank's weight, rows in rank order
            mine = self.problem(self.rank, seed, m)
            rows = [self.problem(r, seed, m) for r in ranks]
            terms = [budget_terms(q.Problem(self.quant, p.a, mine.b, p.a_scale, mine.b_scale)) for p in rows]
            return (torch.cat([t[0] for t in terms]), torch.cat([t[0].abs() for t in terms]),
                    torch.cat([t[1] for t in terms]))
        terms = [budget_terms(self.problem(r, seed, m)) for r in ranks]
        full = (sum(t[0] for t in terms), sum(t[0].abs() for t in terms), sum(t[1] for t in terms))
        world = len(ranks)
        if self.pattern == "reduce-scatter-rows":  # this rank's share of the sum
            rows = full[0].shape[0] // world
            return tuple(t[self.rank * rows:(self.rank + 1) * rows] for t in full)
        if self.pattern == "reduce-scatter-cols":
            cols = self.n // world
            return tuple(t[:, self.rank * cols:(self.rank + 1) * cols] for t in full)
        return full

    def operands(self, rank: int, seed: int, m: int | None = None):
        p = self.problem(rank, seed, m)
        dev = self.device
        return p.a.to(dev), preshuffle_b(p.b).to(dev), p.a_scale.to(dev), p.b_scale.to(dev)


class Report:
    def __init__(self, rank: int):
        self.rank = rank
        self.problems: list[str] = []
        self.seen: list[str] = []

    def expect(self, ok: bool, what: str) -> None:
        if not ok:
            self.problems.append(f"rank {self.rank}: {what}")

    def as_dict(self) -> dict:
        return {"problems": self.problems, "seen": self.seen}


def attempt(op, operands):
    """One call and ``op.check()``: ("result", bf16 out on the host, s) or (error type, message, s)."""
    t0 = time.monotonic()
    try:
        out = op(*operands)
    except Exception as err:
        return _failed(err, t0)
    return attempt_check(op, out, t0)


def attempt_check(op, out, t0=None):
    """``op.check()`` after a call or a replay that wrote ``out``: as :func:`attempt`, the seconds
    counted from ``t0`` (default: now)."""
    t0 = time.monotonic() if t0 is None else t0
    try:
        op.check()
        return "result", out.cpu(), time.monotonic() - t0
    except Exception as err:
        return _failed(err, t0)


def _failed(err, t0):
    return type(err).__name__, f"{err}" + "".join(f"\n{n}" for n in getattr(err, "__notes__", ())), \
        time.monotonic() - t0


def _wrong(out, ref) -> int:
    """Elements of ``out`` outside the error budget of an all-reduce of bf16 partials (NaN counts)."""
    return allreduce_mismatches(out, *ref, fp8_gather=False)


def _expect_correct(report, outcome, ref, what):
    kind, value, _ = outcome
    report.expect(kind == "result", f"{what}: raised {kind}: {str(value)[:600]}")
    if kind == "result":
        bad = _wrong(value, ref)
        nan = int(torch.isnan(value.float()).sum())
        report.expect(bad == 0, f"{what}: returned a wrong result ({bad} elements off the reference, {nan} NaN)")


def _expect_raise(report, outcome, setup, what, kinds, words=()):
    kind, value, seconds = outcome
    report.seen.append(f"{what}: {kind} after {seconds:.2f} s")
    if kind == "result":
        report.problems.append(f"rank {report.rank}: {what}: returned instead of raising")
        return
    report.expect(kind in kinds, f"{what}: raised {kind}, expected one of {kinds}: {value[:600]}")
    for word in words:
        report.expect(word in value, f"{what}: the {kind} does not say {word!r}: {value[:600]}")
    bound = setup.deadline_s + RAISE_SLACK_S
    report.expect(seconds <= bound, f"{what}: raised after {seconds:.2f} s, more than deadline + "
                                    f"{RAISE_SLACK_S} s = {bound:.1f} s")


def _next_call(comm, op, setup, report, name, backend, seed, what):
    """The call after a failed one: correct where the op recovers in place, else (a CUDA op whose
    call passed its deadline) an error or a correct result, never a wrong one."""
    outcome = attempt(op, setup.operands(comm.rank, seed))
    ref = setup.reference(range(comm.world), seed)
    if name in RECOVERS_IN_PLACE[backend]:
        _expect_correct(report, outcome, ref, what)
    else:
        report.seen.append(f"{what}: {outcome[0]}")
        report.expect(outcome[0] != "result" or _wrong(outcome[1], ref) == 0, f"{what}: returned a wrong result")


def _fresh_op_is_correct(comm, setup, report, seed=9, what="a fresh op"):
    setup.rank = comm.rank  # the survivors of "killed" are renumbered
    with setup.op(comm) as op:
        _expect_correct(report, attempt(op, setup.operands(comm.rank, seed)), setup.reference(range(comm.world), seed),
                        what)


# the bad inputs of "bad-input": (name, operands -> bad operands, a word of the error message)
BAD_INPUTS = (
    ("a is uint8", lambda a, b, sa, sb: (a.view(torch.uint8), b, sa, sb), "uint8"),
    ("M > m_max", lambda a, b, sa, sb: (torch.cat([a, a]), b, torch.cat([sa, sa]), sb), "m_max"),
    ("a_scale is bf16", lambda a, b, sa, sb: (a, b, sa.to(torch.bfloat16), sb), "a_scale"),
)


def _bad_input(comm, setup, report, backend):
    rank, world = comm.rank, comm.world
    with setup.op(comm) as op:
        for bad in range(world):
            seq, seed = 2 * bad + 1, bad + 1
            name, spoil, word = BAD_INPUTS[bad % len(BAD_INPUTS)]
            operands = setup.operands(rank, seed)
            outcome = attempt(op, spoil(*operands) if rank == bad else operands)
            what = f"call {seq}, rank {bad} passes bad input ({name})"
            if rank == bad:
                _expect_raise(report, outcome, setup, what, ("TypeError", "ValueError"),
                              (f"{setup.op_name}.__call__", word))
            else:
                _expect_raise(report, outcome, setup, what, ("PeerRejectedError",),
                              (f"rank {bad} rejected", f"seq {seq}", word))
            _expect_correct(report, attempt(op, setup.operands(rank, seed + 10)),
                            setup.reference(range(world), seed + 10), f"good call {seq + 1} after it")
        # every rank alike: each its own error; on CUDA, without waiting out the deadline for a peer's
        # stamp that no rank sends (each rank sees its peers' posted rejections: its note says so)
        seq = 2 * world + 1
        name, spoil, word = BAD_INPUTS[0]
        what = f"call {seq}, every rank passes bad input ({name})"
        words = ("every peer rejected call seq", "too") if backend == "cuda" else ()
        _expect_raise(report, attempt(op, spoil(*setup.operands(rank, 50))), setup, what, ("TypeError", "ValueError"),
                      (f"{setup.op_name}.__call__", word, *words))
        _expect_correct(report, attempt(op, setup.operands(rank, 51)), setup.reference(range(world), 51),
                        f"good call {seq + 1} after it")
        calls = comm.all_gather_object(op.calls)
        report.expect(len(set(calls)) == 1, f"the ranks' call counts diverged: {calls}")


def _m_mismatch(comm, setup, report, name, backend, victim, m_other):
    rank = comm.rank
    with setup.op(comm) as op:
        outcome = attempt(op, setup.operands(rank, 1, m_other if rank == victim else None))
        what = f"call 1, rank {victim} passes M={m_other}"
        if name in RECOVERS_IN_PLACE[backend]:
            _expect_raise(report, outcome, setup, what, ("PeerMismatchError",), (f"M={m_other}", f"M={setup.m}"))
        else:  # CUDA, fewer chunks: a wait passes its deadline (and the peer's next call may be consumed by it)
            _expect_raise(report, outcome, setup, what, ("PeerMismatchError", "CommTimeoutError"))
        _next_call(comm, op, setup, report, name, backend, 2, "good call 2 after it")
    _fresh_op_is_correct(comm, setup, report)


def run(comm, name: str, victim: int, setup: Setup, backend: str) -> dict:
    """Play scenario ``name`` (see the module doc) in this rank; ``backend``: "cpu" or "cuda"."""
    report = Report(comm.rank)
    setup.rank = comm.rank
    rank, world, d = comm.rank, comm.world, setup.deadline_s
    peers = [r for r in range(world) if r != victim]
    if name == "bad-input":
        _bad_input(comm, setup, report, backend)
    elif name in ("m-mismatch", "m-mismatch-chunks"):
        # as many chunks: 3/4 of two m-tiles still fill two; fewer chunks: half the rows, one m-tile
        _m_mismatch(comm, setup, report, name, backend, victim, setup.m - setup.m // 4 if name == "m-mismatch"
                    else setup.m // 2)
    elif name == "closed":
        with setup.op(comm) as op:
            _expect_correct(report, attempt(op, setup.operands(rank, 1)), setup.reference(range(world), 1), "call 1")
            if rank == victim:
                op.close()
                time.sleep(d + RAISE_SLACK_S + 0.5)  # the fresh op's construction after the peers' call 2
            else:
                _expect_raise(report, attempt(op, setup.operands(rank, 2)), setup,
                              f"call 2, rank {victim} closed its op after call 1", ("CommTimeoutError",),
                              (f"rank {victim} closed its {setup.op_name} (close()) after its call seq 1",))
        _fresh_op_is_correct(comm, setup, report)
    elif name in ("stalled", "late"):
        with setup.op(comm) as op:
            _expect_correct(report, attempt(op, setup.operands(rank, 1)), setup.reference(range(world), 1), "call 1")
            if rank == victim:
                time.sleep(d + RAISE_SLACK_S + 0.5 if name == "stalled" else d / 2)
            if name == "late":
                _expect_correct(report, attempt(op, setup.operands(rank, 2)), setup.reference(range(world), 2),
                                f"call 2, rank {victim} half a deadline late")
            elif rank != victim:
                _expect_raise(report, attempt(op, setup.operands(rank, 2)), setup,
                              f"call 2, rank {victim} never calls", ("CommTimeoutError",), (f"rank {victim}", "seq 2"))
        _fresh_op_is_correct(comm, setup, report)
    elif name in GPU_ONLY:
        if backend == "cpu":
            raise ValueError(f"scenario {name!r}: GPU backends only")
        if name == "stalled-graph":
            _stalled_graph(comm, setup, report, victim)
        else:
            _stalled_host_wait(comm, setup, report, victim, name)
        _fresh_op_is_correct(comm, setup, report)
    elif name == "killed":
        rendezvous = comm.broadcast_object(secrets.token_hex(8) if rank == 0 else None)
        with setup.op(comm) as op:
            _expect_correct(report, attempt(op, setup.operands(rank, 1)), setup.reference(range(world), 1), "call 1")
            if rank == victim:
                operands = setup.operands(rank, 2)  # before the busy kernel: their host copies would queue behind it
                die_in_call(op, backend, setup.pattern)
                op(*operands)
                os._exit(9)  # CUDA: the call is in flight on the device
            _expect_raise(report, attempt(op, setup.operands(rank, 2)), setup,
                          f"call 2, rank {victim} killed in it", ("CommTimeoutError",), (f"rank {victim}",))
            print(f"rank {rank}: killed: call 2 raised; closing the op", file=sys.stderr, flush=True)
        print(f"rank {rank}: killed: closing the communicator", file=sys.stderr, flush=True)
        comm.close()  # the process group has a dead member: the survivors build their own
        path = os.path.join(tempfile.gettempdir(), f"cco-survivors-{rendezvous}")
        with Communicator(rank=peers.index(rank), world=len(peers), init_method=f"file://{path}",
                          device=comm.device, timeout_s=60) as survivors:
            _fresh_op_is_correct(survivors, setup, report, what="a fresh op among the survivors")
    elif name == "dropped":
        dest = (victim + 1) % world
        drop = FaultPlan(drops=(Drop(phase="scatter", seq=2, src=victim, dest=dest, chunk=1),))
        # a lost put is a copy-engine fault on CUDA (the lsa kernel stores its tiles itself)
        with setup.op(comm, faults=drop, transport="dma" if backend == "cuda" else None) as op:
            _expect_correct(report, attempt(op, setup.operands(rank, 1)), setup.reference(range(world), 1), "call 1")
            words = (f"rank {victim}", "seq 2") if rank == dest else ("seq 2",)
            _expect_raise(report, attempt(op, setup.operands(rank, 2)), setup,
                          f"call 2, rank {victim}'s put of chunk 1 to rank {dest} lost", ("CommTimeoutError",), words)
            _next_call(comm, op, setup, report, name, backend, 3, "call 3 after it")
        _fresh_op_is_correct(comm, setup, report)
    else:
        raise ValueError(f"scenario {name!r}: pass one of {', '.join(SCENARIOS)}")
    return report.as_dict()


def _stalled_graph(comm, setup, report, victim):
    rank, d = comm.rank, setup.deadline_s
    with setup.op(comm) as op:
        static = setup.operands(rank, 1)
        op(*static)  # warm: the capture must not be a first call
        op.check()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = op(*static)
        comm.barrier()
        graph.replay()
        outcome = attempt_check(op, out)
        _expect_correct(report, outcome, setup.reference(range(comm.world), 1), "replay 1")
        comm.barrier()
        what = f"replay 2, rank {victim} never replays"
        if rank == victim:
            time.sleep(d + RAISE_SLACK_S + 0.5)
            outcome = attempt_check(op, out)
            report.seen.append(f"{what}: back, its check(): {outcome[0]}")
            report.expect(outcome[0] == "CommTimeoutError", f"{what}: the victim's op is not failed: {outcome[0]}")
        else:
            t0 = time.monotonic()
            graph.replay()
            _expect_raise(report, attempt_check(op, out, t0), setup, what, ("CommTimeoutError",))
            nan = int(torch.isnan(out.float()).sum())
            report.expect(nan == out.numel(), f"{what}: the released replay's output has {out.numel() - nan} "
                                              f"elements that are not NaN")
        del graph
        comm.barrier()


def _synchronize_then_read(out):
    torch.cuda.synchronize(out.device)
    return out.cpu()


# the host waits a caller makes on a stuck call's output before op.check(): a copy to pageable host
# memory (the host waits in the driver until the call ends; the release's NaN fill cannot land
# before: NaN in every row only), the whole device's synchronize (all NaN)
HOST_WAITS = {"stalled-read": ("its output read before check()", lambda out: out.cpu(), False),
              "stalled-sync": ("torch.cuda.synchronize() before check()", _synchronize_then_read, True)}


def _stalled_host_wait(comm, setup, report, victim, name):
    rank, d = comm.rank, setup.deadline_s
    wait_is, host_wait, all_nan = HOST_WAITS[name]
    with setup.op(comm) as op:
        _expect_correct(report, attempt(op, setup.operands(rank, 1)), setup.reference(range(comm.world), 1), "call 1")
        what = f"call 2, rank {victim} never calls, {wait_is}"
        if rank == victim:
            time.sleep(d + RAISE_SLACK_S + 0.5)
        else:
            t0 = time.monotonic()
            out = op(*setup.operands(rank, 2))
            host = host_wait(out)
            seconds = time.monotonic() - t0
            isnan = torch.isnan(host.float())
            nan, rows = int(isnan.sum()), int(isnan.any(dim=1).sum())
            report.seen.append(f"{what}: it returned after {seconds:.2f} s, {nan} of {host.numel()} NaN, "
                               f"{rows} of {host.shape[0]} rows with NaN")
            report.expect(seconds <= d + RAISE_SLACK_S, f"{what}: it took {seconds:.2f} s")
            if all_nan:
                report.expect(nan == host.numel(), f"{what}: the released call's output has {host.numel() - nan} "
                                                   f"elements that are not NaN")
            else:
                report.expect(rows == host.shape[0], f"{what}: {host.shape[0] - rows} rows of the released call's "
                                                     f"output have no NaN")
            _expect_raise(report, attempt_check(op, out), setup, what, ("CommTimeoutError",), (f"rank {victim}",))
        comm.barrier()


DEVICE_BUSY_CYCLES = 20_000_000_000  # ~10 s of a ~2 GHz GPU clock: longer than any deadline here


# the CPU backend's step a dying rank never finishes, per pattern: after its tiles, before it
# reduces; the all-gather's before its rows are put (put rows would let the peers finish the call)
DIE_AT = {"all-reduce": "_reduce_gather_assemble", "reduce-scatter-rows": "_reduce_into",
          "reduce-scatter-cols": "_reduce_into", "all-gather": "_put_inputs"}


def die_in_call(op, backend: str, pattern: str = "all-reduce") -> None:
    """Make this rank's process exit in the middle of its next call: on the CPU once the call has
    entered (its header says so) and before it reduces (``DIE_AT``); on CUDA the caller exits right
    after the call was issued, with its work still queued on the device (behind a busy kernel: a
    call whose work finished before the exit would simply have succeeded)."""
    if backend != "cpu":
        torch.cuda._sleep(DEVICE_BUSY_CYCLES)
        return
    from cco.backends.cpu import CpuBackend

    def exit_in_call(self, *args):
        os._exit(9)

    setattr(op._backend, DIE_AT[pattern], exit_in_call.__get__(op._backend, CpuBackend))
