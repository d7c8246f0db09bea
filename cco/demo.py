"""Fused fp8 GEMM + all-reduce on CPU ranks, checked against the fp32 reference.

    python3 -m cco.demo                              # spawns 2 local CPU ranks
    python3 -m cco.demo --world 4 --mode split-lsa --gather-dtype fp8
    torchrun --nproc-per-node 2 -m cco.demo          # ranks from torchrun
    mpiexec -n 2 python3 -m mpi4py -m cco.demo       # ranks from mpirun (mpi4py)

Every rank builds its own operands (seeded by rank), the op all-reduces the partial products, and
each rank checks the result against ``cco.quant.reference_gemm`` of every rank's operands summed
in fp32, and that all ranks hold the same bytes. Rank 0 prints what was checked and how long each
phase took (the slowest rank's time). Exit status 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time

import torch

from cco import layout
from cco import quant as q
from cco.comm import _MPI_RANK_VARS, _MPI_SIZE_VARS, Communicator, _first_env, check_outcomes, spawn
from cco.layout import GATHER_DTYPES, MODE_ALIASES, MODES, QUANTS, TRANSPORTS
from cco.op import GemmAllReduceOp
from cco.preshuffle import preshuffle_b

DEFAULT_SHAPE = dict(m=256, n=512, k=512)  # small enough for a 2-core CI machine, 4 chunks of 64 rows


def _operands(rank: int, opts, device="cpu"):
    p = q.random_problem(opts.m, opts.n, opts.k, opts.quant, seed=1000 + rank, device=device)
    return p, preshuffle_b(p.b)


def _check(out, problems, opts, *, reduced: bool) -> tuple[float, int]:
    """(relative L2 error, elements outside the error budget) of ``out`` against the fp32 sum of
    the problems' products. The budget (``cco.bench.timing``) is what bf16 partials and fp8
    tensor-core accumulation allow where a dot product cancels; a wrong tile misses it by O(|ref|)."""
    from cco.bench.timing import allreduce_mismatches, budget_terms, gemm_mismatches

    local, dot_abs = zip(*(budget_terms(p) for p in problems))
    ref = sum(p.reference().float() for p in problems).to(torch.bfloat16)
    if not reduced:
        return q.rel_l2(out, ref), gemm_mismatches(out, local[0], dot_abs[0])
    off = allreduce_mismatches(out, sum(local), sum(t.abs() for t in local), sum(dot_abs),
                               fp8_gather=opts.gather_dtype == "fp8")
    return q.rel_l2(out, ref), off


def run_rank(comm, opts) -> dict:
    """One rank's demo; returns its timings and checks (collective)."""
    times = {}
    t = time.perf_counter()
    op = GemmAllReduceOp(comm, n=opts.n, k=opts.k, m_max=opts.m, quant=opts.quant, mode=opts.mode,
                         transport=opts.transport, gather_dtype=opts.gather_dtype, chunks=opts.chunks,
                         deadline_s=opts.deadline)
    times["build op (window, backend)"] = time.perf_counter() - t
    with op:
        self_test = None
        if op.publishes:  # (gemm-only, or one rank: nothing moves, nothing to test)
            t = time.perf_counter()
            self_test = op.self_test()
            times["self_test"] = time.perf_counter() - t
        t = time.perf_counter()
        p, b_pre = _operands(comm.rank, opts, comm.device)
        times["operands (quantize, preshuffle)"] = time.perf_counter() - t
        calls = []
        for _ in range(opts.iters):
            t = time.perf_counter()
            out = op(p.a, b_pre, p.a_scale, p.b_scale)
            calls.append(time.perf_counter() - t)
        times[f"op call (first of {opts.iters})"] = calls[0]
        if opts.iters > 1:
            times[f"op call (median of next {opts.iters - 1})"] = statistics.median(calls[1:])
        t = time.perf_counter()
        ranks = range(comm.world) if op.mode != "gemm-only" else [comm.rank]
        out = out.cpu()
        rel, off = _check(out, [_operands(r, opts)[0] for r in ranks], opts, reduced=op.mode != "gemm-only")
        # the fp8 gather's looser budget only where something is gathered (gemm-only gathers nothing)
        fp8_gather = opts.gather_dtype == "fp8" and op.mode != "gemm-only"
        tol = q.REL_L2_TOL_FP8_GATHER if fp8_gather else q.REL_L2_TOL[opts.quant]
        digest = hashlib.sha256(out.view(torch.int16).numpy().tobytes()).hexdigest()[:16]
        digests = comm.all_gather_object(digest)
        times["reference check"] = time.perf_counter() - t
        summary = {"mode": op.mode, "transport": op.transport, "chunks": op.config.chunks, "calls": op.calls}
    return {"times": times, "rel_l2": rel, "tol": tol, "off": off, "digests": digests,
            "self_test": self_test, "summary": summary, "device": str(comm.device)}


def report(results: list[dict], opts, launcher: str, bootstrap_s: float | None) -> bool:
    r0 = results[0]
    world = len(results)
    s = r0["summary"]
    print(f"cco demo: fp8 GEMM + all-reduce, launcher={launcher} world={world} device={r0['device']}")
    print(f"  per rank: a [{opts.m}, {opts.k}] x b [{opts.n}, {opts.k}], quant={opts.quant} mode={s['mode']} "
          f"transport={s['transport']} gather_dtype={opts.gather_dtype} chunks={s['chunks']}")
    if bootstrap_s is not None:
        print(f"  {'bootstrap (ranks + gloo group)':34s} {bootstrap_s * 1e3:9.1f} ms")
    for phase in r0["times"]:
        slowest = max(r["times"][phase] for r in results)
        print(f"  {phase:34s} {slowest * 1e3:9.3f} ms  (slowest rank)")  # us resolution: host time per call
    ok = True
    if r0["self_test"] is not None:
        st = r0["self_test"]
        print(f"  checked: self_test moved {st['scatter_bytes_received']} scatter bytes into each rank: {st['checked']}")
    what = "this rank's reference_gemm" if s["mode"] == "gemm-only" else f"sum over {world} ranks of reference_gemm"
    for rank, r in enumerate(results):
        good = r["rel_l2"] <= r["tol"] and r["off"] == 0
        ok &= good
        off = f", {r['off']} elements outside the error budget"
        print(f"  checked: rank {rank} output vs {what}: rel L2 {r['rel_l2']:.2e} (tol {r['tol']:.0e}){off}"
              f" -> {'ok' if good else 'FAIL'}")
    if s["mode"] != "gemm-only":
        same = all(len(set(r["digests"])) == 1 for r in results)
        ok &= same
        print(f"  checked: identical bytes on all {world} ranks (sha256 {r0['digests'][0]}) -> {'ok' if same else 'FAIL'}")
    print("PASS" if ok else "FAIL")
    return ok


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m cco.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2,
                   help="ranks to spawn when not under torchrun/mpirun (default: %(default)s)")
    p.add_argument("--shape", default="x".join(str(DEFAULT_SHAPE[d]) for d in "mnk"), metavar="MxNxK",
                   help="rows of a, rows of the weight, K per rank (default: %(default)s)")
    p.add_argument("--quant", choices=QUANTS, default="ptpc", help="the fp8 recipe (default: %(default)s)")
    p.add_argument("--mode", choices=sorted(set(MODES) | set(MODE_ALIASES)), default="fused",
                   help="the op's mode (default: %(default)s)")
    p.add_argument("--transport", choices=TRANSPORTS, default=None,
                   help="default: the backend's (auto on CUDA: lsa at small M, copy engines above; dma elsewhere)")
    p.add_argument("--gather-dtype", choices=GATHER_DTYPES, default="bf16",
                   help="dtype of the reduced slices the ranks gather (default: %(default)s)")
    p.add_argument("--chunks", type=int, default=None, metavar="N",
                   help=f"row chunks per call, an int in 1..{layout.MAX_CHUNKS} (default: the backend's)")
    p.add_argument("--iters", type=int, default=3, help="op calls timed, >= 1 (default: %(default)s)")
    p.add_argument("--deadline", type=float, default=30.0,
                   help="seconds a call may wait on peers, > 0 (default: %(default)s)")
    p.add_argument("--device", choices=("cpu", "auto"), default="cpu",
                   help="cpu: CPU ranks (default); auto: one GPU per local rank where there are GPUs")
    opts = p.parse_args(argv)
    # the op's own message offers a tuple of relative sizes or None, which this flag cannot pass: say what it takes
    if opts.chunks is not None and not 1 <= opts.chunks <= layout.MAX_CHUNKS:
        p.error(f"--chunks={opts.chunks} is not supported; pass an int in 1..{layout.MAX_CHUNKS}, or leave it out "
                f"for the backend's")
    try:
        opts.m, opts.n, opts.k = (int(v) for v in opts.shape.lower().split("x"))
    except ValueError:
        p.error(f"--shape={opts.shape!r} must look like 256x512x512 (M x N x K)")
    if opts.iters < 1:
        p.error(f"--iters={opts.iters} must be >= 1 (op calls timed)")
    if opts.world < 1:
        p.error(f"--world={opts.world} must be >= 1 (ranks to spawn)")
    if not opts.deadline > 0:
        p.error(f"--deadline={opts.deadline} must be > 0 seconds")
    if min(opts.m, opts.n, opts.k) < 1:
        p.error(f"--shape={opts.shape!r}: M, N and K must be >= 1")
    try:
        layout.check_call_options(transport=opts.transport, gather_dtype=opts.gather_dtype, chunks=opts.chunks)
    except ValueError as err:
        p.error(str(err))
    # what every rank would refuse, said once here rather than in a traceback per rank: the shape's
    # verdict for the CPU backend's tiles (a GPU backend has tiles of its own: its op says so there)
    world = _launcher_world() if _launched_externally() else opts.world
    if opts.device == "cpu" and world is not None:
        reason = layout.supports(opts.m, opts.n, opts.k, world, quant=opts.quant, mode=opts.mode,
                                 transport=opts.transport, gather_dtype=opts.gather_dtype, chunks=opts.chunks)
        if reason is not None:
            p.error(f"--shape {opts.m}x{opts.n}x{opts.k} at world {world}: {reason}")
    return opts


def _launcher_world() -> int | None:
    """The ranks a launcher started (torchrun's WORLD_SIZE, or an MPI launcher's), None if it says none."""
    size = _first_env(("WORLD_SIZE", *_MPI_SIZE_VARS))
    return int(size) if size is not None and size.isdigit() else None


def _launched_externally() -> bool:
    return ("RANK" in os.environ and "WORLD_SIZE" in os.environ) or _first_env(_MPI_RANK_VARS) is not None


def _device(opts):
    return "cpu" if opts.device == "cpu" else None  # None: the communicator picks by local rank


def main(argv=None) -> int:
    opts = parse_args(argv)
    if _launched_externally():
        t = time.perf_counter()
        with Communicator.from_env(device=_device(opts)) as comm:
            bootstrap = time.perf_counter() - t
            result = run_rank(comm, opts)
            results = comm.all_gather_object(result)
            ok = report(results, opts, comm.launcher, bootstrap) if comm.rank == 0 else True
            ok = all(comm.all_gather_object(ok))
        return 0 if ok else 1
    t = time.perf_counter()
    results = check_outcomes(spawn(run_rank, world=opts.world, args=(opts,), device=_device(opts), timeout_s=600))
    total = time.perf_counter() - t
    ok = report(results, opts, "spawn", None)
    print(f"  {'total, including rank start-up':34s} {total * 1e3:9.1f} ms")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
