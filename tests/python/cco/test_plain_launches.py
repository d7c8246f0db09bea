"""The op's kept plain launches (``cco.op._KeptLaunches``): an eager plain call (gemm-only, or one
rank) whose weight tensors and activation shapes passed the checks before skips them and calls the
launch the backend bound to the weight. Guards that nothing stale or unchecked gets through: a
weight changed in place, swapped under the same object (``.data =``) or replaced, a setting that
changes the launch (``plain_epoch``), and inputs the checks reject all take the full path. And the
kept launches are per weight: layers of one shape share an op and a model calls them in turn, so
each weight keeps its own launch (an op that kept only the last one missed on every call), and a
weight that dies takes its entry with it (a trainable layer quantizes a new weight every step)."""

import torch

from cco import quant as q
from cco.comm import check_outcomes, spawn
from cco.op import GemmAllReduceOp
from cco.preshuffle import preshuffle_b

M, N, K = 32, 256, 256


def _scenario(comm):
    p = q.random_problem(M, N, K, "ptpc", seed=3)
    b_pre, b_scale = preshuffle_b(p.b), p.b_scale.clone()
    seen = []  # one entry per launch the backend made
    with GemmAllReduceOp(comm, n=N, k=K, m_max=M) as op:
        backend = op._backend

        def plain_launcher(b, bs, m):  # the CPU backend has none: one that binds what it was given
            seen.append(m)
            bound_b, bound_bs = b.clone(), bs.clone()  # a launch computes from the weight it bound

            def launch(a, a_scale):
                return q.reference_gemm(a, _unshuffled(bound_b), a_scale, bound_bs, "ptpc")
            return launch

        backend.plain_launcher = plain_launcher

        def want(a=p.a, a_scale=p.a_scale, b=None, bs=None):
            return q.reference_gemm(a, p.b if b is None else b, a_scale, b_scale if bs is None else bs, "ptpc")

        results = {}
        out = [op(p.a, b_pre, p.a_scale, b_scale) for _ in range(3)]
        results["same weight: one launch made"] = (len(seen) == 1 and all(torch.equal(o, want()) for o in out))
        op(p.a[:16], b_pre, p.a_scale[:16], b_scale)
        results["another M: its own launch"] = seen[-1] == 16 and len(seen) == 2
        b_scale.mul_(2)  # in place: the version counter moves
        results["weight changed in place: a new launch"] = (torch.equal(op(p.a, b_pre, p.a_scale, b_scale),
                                                                        want(bs=b_scale)) and len(seen) == 3)
        results["weight changed in place: the other M's launch retired too"] = (
            torch.equal(op(p.a[:16], b_pre, p.a_scale[:16], b_scale), want(a=p.a[:16], a_scale=p.a_scale[:16],
                                                                            bs=b_scale)) and len(seen) == 4)
        b2 = p.b.clone()
        b2[0].zero_()
        b_pre.data = preshuffle_b(b2)  # same object, new bytes, no version bump
        results["weight swapped under the object: a new launch"] = (
            torch.equal(op(p.a, b_pre, p.a_scale, b_scale), want(b=b2, bs=b_scale)) and len(seen) == 5)
        other = preshuffle_b(p.b)
        results["another weight object: a new launch"] = (
            torch.equal(op(p.a, other, p.a_scale, b_scale), want(bs=b_scale)) and len(seen) == 6)
        backend.plain_epoch += 1
        op(p.a, other, p.a_scale, b_scale)
        results["plain_epoch moved: a new launch"] = len(seen) == 7
        errors = []
        for bad in (lambda: op(p.a.view(torch.uint8), other, p.a_scale, b_scale),  # a wrong dtype
                    lambda: op(torch.cat([p.a, p.a]), other, torch.cat([p.a_scale, p.a_scale]), b_scale),  # M > m_max
                    lambda: op(p.a, other, p.a_scale.to(torch.bfloat16), b_scale),
                    lambda: op(p.a.to("meta"), other, p.a_scale.to("meta"), b_scale)):  # another device
            try:
                bad()
                errors.append("returned")
            except (TypeError, ValueError) as err:
                errors.append(type(err).__name__)
        results["rejected inputs still rejected"] = errors == ["TypeError", "ValueError", "TypeError", "ValueError"]
        results["calls counted"] = op.calls == 3 + 1 + 1 + 1 + 1 + 1 + 1
    return results


def _per_weight(comm):
    import gc

    p = q.random_problem(M, N, K, "ptpc", seed=4)
    seen = []
    with GemmAllReduceOp(comm, n=N, k=K, m_max=M) as op:
        backend = op._backend

        def plain_launcher(b, bs, m):
            seen.append(m)
            bound_b, bound_bs = b.clone(), bs.clone()

            def launch(a, a_scale):
                return q.reference_gemm(a, _unshuffled(bound_b), a_scale, bound_bs, "ptpc")
            return launch

        backend.plain_launcher = plain_launcher
        layers = [(preshuffle_b(p.b), p.b_scale * (i + 1)) for i in range(3)]  # three weights of one shape
        outs = [[op(p.a, b, p.a_scale, bs) for b, bs in layers] for _ in range(4)]  # a decode step's order, 4 times
        want = [q.reference_gemm(p.a, p.b, p.a_scale, p.b_scale * (i + 1), "ptpc") for i in range(3)]
        results = {"each weight keeps its launch": len(seen) == 3,
                   "each call its own weight's result": all(torch.equal(o[i], want[i]) for o in outs for i in range(3))}
        for _ in range(5):  # weights made and dropped, as a trainable layer's every step
            b, bs = preshuffle_b(p.b), p.b_scale.clone()
            op(p.a, b, p.a_scale, bs)
            del b, bs
        gc.collect()
        results["a dead weight's entry is dropped"] = len(op._launches.weights) == 3
        del layers
        gc.collect()
        results["every dead weight's entry is dropped"] = len(op._launches.weights) == 0
    return results


def test_each_weight_keeps_its_launch_while_it_lives():
    (got,) = check_outcomes(spawn(_per_weight, world=1, timeout_s=120))
    failed = [what for what, ok in got.items() if not ok]
    assert not failed, failed


def _unshuffled(b_pre):
    from cco.preshuffle import unshuffle_b
    return unshuffle_b(b_pre)


def test_kept_plain_launches_never_serve_a_stale_weight_or_unchecked_inputs():
    (got,) = check_outcomes(spawn(_scenario, world=1, timeout_s=120))
    failed = [what for what, ok in got.items() if not ok]
    assert not failed, failed


def _closure_objects(kept: dict, depth: int = 4) -> list:
    """What the kept launches of one weight (``_KeptLaunches`` entry's by-layout dict) reach through
    their closures, ``depth`` closures deep."""
    found, todo = [], [launch for *_, launch in kept.values()]
    for _ in range(depth):
        cells = [c.cell_contents for f in todo for c in (getattr(f, "__closure__", None) or ())]
        found += cells
        todo = [c for c in cells if callable(c)]
    return found


def _collective(comm):
    """Two ranks: an op whose backend keeps a bound launch for fused calls (a stand-in for the CUDA
    backend's lsa ``fused_launcher``, over the CPU backend's own ``fused``) beside one that has none,
    the same calls on both, inputs changing call by call."""
    import gc

    from cco.transport.protocol import PeerRejectedError

    def problem(seed, m=M):
        p = q.random_problem(m, N, K, "ptpc", seed=100 * seed + comm.rank)
        return p.a, p.a_scale

    w = q.random_problem(M, N, K, "ptpc", seed=7 + comm.rank)
    b_pre, b_scale = preshuffle_b(w.b), w.b_scale.clone()
    made, ran = [], []
    results = {}
    with GemmAllReduceOp(comm, n=N, k=K, m_max=M, deadline_s=20) as kept_op, \
            GemmAllReduceOp(comm, n=N, k=K, m_max=M, deadline_s=20) as plain_op:
        backend = kept_op._backend

        def fused_launcher(a, b, a_scale, bs, *, out):
            made.append(a.shape[0])
            bound_b, bound_bs = b.clone(), bs.clone()  # a kept launch computes from the weight it bound

            def run(a, a_scale, out, plan):
                ran.append(plan.seq)
                backend.fused(a, bound_b, a_scale, bound_bs, out=out, plan=plan)
            return run

        backend.fused_launcher = fused_launcher
        backend.keeps_fused = lambda m: True  # (the CPU backend's own: never, as plain_op's)

        def both(a, a_scale, b=b_pre, bs=b_scale):
            return kept_op(a, b, a_scale, bs), plain_op(a, b, a_scale, bs)

        pairs = [both(*problem(s)) for s in range(5)]
        results["a weight that came back keeps a launch, at its second call"] = made == [M]
        results["the kept launch runs the call that made it and those after it"] = ran == [2, 3, 4, 5]
        results["kept calls return the bits of unkept ones"] = all(torch.equal(x, y) for x, y in pairs)
        results["kept calls count their seq"] = kept_op.calls == plain_op.calls == 5
        pairs = [both(*problem(10 + s, m=16)) for s in range(3)]  # another M: its own launch
        results["another M keeps its own launch, at its first call"] = made == [M, 16] and len(ran) == 4 + 3
        results["and returns the bits of unkept calls"] = all(torch.equal(x, y) for x, y in pairs)
        # a peer's bad input while this rank's call takes its kept launch (no checks here): every rank fails
        # that call, this one with PeerRejectedError, and the next call is right again
        a, a_scale = problem(20)
        got = []
        for op in (kept_op, plain_op):
            try:
                op(a.view(torch.uint8) if comm.rank == 1 else a, b_pre, a_scale, b_scale)
                got.append("returned")
            except (TypeError, PeerRejectedError) as err:
                got.append(type(err).__name__)
        want = "TypeError" if comm.rank == 1 else "PeerRejectedError"
        results["a peer's rejected call fails the kept call"] = got == [want, want]
        results["the kept launch ran it on the rank that took it"] = len(ran) == (8 if comm.rank == 0 else 7)
        x, y = both(*problem(21))
        results["the call after it is right"] = torch.equal(x, y) and kept_op.calls == plain_op.calls
        b_scale.mul_(2)  # the weight changed in place: not kept until it comes back unchanged
        pairs = [both(*problem(30 + s)) for s in range(3)]
        results["a changed weight keeps a new launch at its second call"] = made == [M, 16, M]
        results["computed from the changed weight"] = all(torch.equal(x, y) for x, y in pairs)
        for _ in range(4):  # a weight quantized afresh for each call (a trainable layer's) keeps no launch
            b, bs = preshuffle_b(w.b), w.b_scale.clone()
            both(*problem(40), b=b, bs=bs)
            del b, bs
        gc.collect()
        results["a weight used once keeps no launch"] = made == [M, 16, M]
        results["an op whose backend keeps no fused launch remembers no weight"] = not plain_op._launches.weights
        results["a kept launch holds its op weakly (no cycle through the op's launches)"] = not any(
            obj is kept_op for obj in _closure_objects(next(iter(kept_op._launches.weights.values()))[1]))
    return results


def test_a_kept_collective_launch_runs_the_calls_machinery_and_the_same_bits():
    """The op's kept collective launch (``CollectiveGemmOp._kept_collective``: the CUDA backend's
    bound lsa call at world >= 2, ``docs/decode.md``): made for a weight that comes back, it returns
    the bits of the unkept path call by call, counts its seq, fails a call a peer rejected (on the
    rank that skipped the checks) and serves nothing stale (a weight changed in place)."""
    outs = check_outcomes(spawn(_collective, world=2, timeout_s=180))
    for rank, got in enumerate(outs):
        failed = [what for what, ok in got.items() if not ok]
        assert not failed, (rank, failed)
