"""What the GPU link gives each way of moving a slice to a peer, with every rank pushing at once
(both directions busy, as in the all-reduce).

    torchrun --nproc-per-node 2 -m scripts.bench_link --rows 16384 --cols 3584
    torchrun --nproc-per-node 2 -m scripts.bench_link --graph

Arms, each moving a bf16 ``[rows, cols]`` slice from this rank's window into the next rank's:

    copy-engine     one ``cuMemcpyAsync`` (the ``dma`` transport's put)
    sm-flat         a Triton kernel, 1-D blocks of 8192 elements (best-case SM stores)
    sm-tile         a Triton kernel storing 128x256 tiles of a row-major slice (the ``lsa``
                    kernel's epilogue pattern)
    steps-1-lane    the slice in ``--steps`` row pieces, each moved as a step of the ``dma``
                    transport: a stream wait on a word (already set, as a completed counter), the
                    copy, an 8-byte copy setting a flag in the peer; all on one stream
    steps-2-lanes   the same steps dealt in turn to two streams (``cco.cuda.dma.PUT_LANES``)

``--graph`` times CUDA-graph replays of every arm (what the op's side work runs as) instead of
eager launches.

Timing is ``cco.bench.timing.time_arms`` (arms alternate, device rendezvous before each iteration,
max over ranks); the slice is checked bit-exact on the receiver first. Last line: ``RESULT_JSON``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

from cco import layout
from cco.bench.timing import graphed, idle_check, require_a_gpu_per_rank, time_arms


@triton.jit
def _push_flat(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _push_tile(src, dst, rows, cols, BM: tl.constexpr, BN: tl.constexpr):
    tiles_n = cols // BN
    m0 = (tl.program_id(0) // tiles_n) * BM
    n0 = (tl.program_id(0) % tiles_n) * BN
    r = m0 + tl.arange(0, BM)
    offs = r[:, None].to(tl.int64) * cols + (n0 + tl.arange(0, BN))[None, :]
    mask = (r < rows)[:, None]
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def main(argv=None):
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()).replace("``", ""))
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--cols", type=int, default=3584)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--steps", type=int, default=8, help="row pieces of the steps arms")
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replays instead of eager launches")
    args = p.parse_args(argv)
    if args.cols % 256:  # (at parse time: before ranks, windows and GPUs)
        p.error(f"--cols {args.cols} must be a multiple of 256 (the tile width)")
    if not 1 <= args.steps <= min(args.rows, layout.MAX_CHUNKS):
        p.error(f"--steps {args.steps} must be in 1..{min(args.rows, layout.MAX_CHUNKS)}")
    from cco.comm import _MPI_RANK_VARS, Communicator

    # after parsing (--help needs neither): ranks of a launcher (what Communicator.from_env reads), each
    # with a CUDA GPU, or one line why not rather than from_env's or the window's traceback
    launched = ("RANK" in os.environ and "WORLD_SIZE" in os.environ) or any(v in os.environ for v in _MPI_RANK_VARS)
    if not (launched and torch.cuda.is_available()):
        raise SystemExit(f"bench_link: needs torchrun and an NVIDIA GPU per rank ("
                         f"{'no CUDA GPU' if launched else 'no torchrun ranks'} here): "
                         f"torchrun --nproc-per-node 2 -m scripts.bench_link")
    from cco.cuda import memops
    from cco.window import open_window

    comm = Communicator.from_env()
    torch.cuda.set_device(comm.device)
    require_a_gpu_per_rank(comm, "bench_link")
    rank, world = comm.rank, comm.world
    w = layout.window_layout(world=world, m_max_padded=args.rows, n_slice=args.cols, gather_dtype="bf16")
    window = open_window(comm=comm, layout=w)
    peer = (rank + 1) % world
    src = window.tensor(w.partial, rank=rank)[peer]
    dst = window.tensor(w.recv, rank=peer)[rank]  # the peer's memory, mapped here
    src.copy_(torch.randn(src.shape, device=src.device).bfloat16())
    nbytes = src.numel() * src.element_size()

    def copy_engine(i):
        memops.copy(torch.cuda.current_stream().cuda_stream, dst.data_ptr(), src.data_ptr(), nbytes)

    def sm_flat(i):
        _push_flat[(triton.cdiv(src.numel(), 8192),)](src, dst, src.numel(), BLOCK=8192, num_warps=8)

    def sm_tile(i):
        _push_tile[(triton.cdiv(args.rows, 128) * (args.cols // 256),)](src, dst, args.rows, args.cols, BM=128, BN=256,
                                                                         num_warps=8)

    lanes = [torch.cuda.Stream() for _ in range(2)]
    ready = torch.ones(args.steps, dtype=torch.int64, device=src.device)  # the steps' counters, complete
    flag_set = torch.ones(1, dtype=torch.int64, device=src.device)
    peer_flags = window.words(w.scatter_flags, rank=peer)
    row_bytes = nbytes // args.rows

    def steps(n_lanes):
        def fn(i):
            main = torch.cuda.current_stream()
            for s in lanes[:n_lanes]:
                s.wait_stream(main)
            for c in range(args.steps):
                s = lanes[c % n_lanes].cuda_stream
                r0, r1 = c * args.rows // args.steps, (c + 1) * args.rows // args.steps
                memops.wait_geq(s, ready.data_ptr() + 8 * c, 1)
                memops.copy(s, dst.data_ptr() + r0 * row_bytes, src.data_ptr() + r0 * row_bytes, (r1 - r0) * row_bytes)
                memops.copy(s, peer_flags.data_ptr() + 8 * layout.counter_index(rank, c), flag_set.data_ptr(), 8)
            for s in lanes[:n_lanes]:
                main.wait_stream(s)
        return fn

    arms = {"copy-engine": copy_engine, "sm-flat": sm_flat, "sm-tile": sm_tile, "steps-1-lane": steps(1),
            "steps-2-lanes": steps(2)}
    mine = window.tensor(w.recv, rank=rank)[(rank - 1) % world]
    checks = {}
    for name, fn in arms.items():
        mine.zero_()
        torch.cuda.synchronize()
        comm.barrier()
        fn(0)
        torch.cuda.synchronize()
        comm.barrier()
        checks[name] = bool(torch.equal(mine, window.tensor(w.partial, rank=(rank - 1) % world)[rank]))
    # every rank checked what it received: an arm is right only where it was on every rank (and every
    # rank then exits with the same status)
    checks = {name: all(c[name] for c in comm.all_gather_object(checks)) for name in checks}
    if args.graph:
        arms, eager = graphed(arms, rotate=1)
        if eager:
            raise SystemExit(f"--graph: arms {eager} could not be captured")
    idle_before = idle_check()
    timings = time_arms(arms, passes=args.passes, iters=args.iters, rotate=1)
    idle_after = idle_check()
    rows = {}
    if rank == 0:
        print(f"push {nbytes / 1e6:.1f} MB to the next rank, all {world} ranks at once, {torch.cuda.get_device_name()}, "
              f"{'graph replays' if args.graph else 'eager'}")
    for name, t in timings.items():
        gbs = nbytes / (t.median_us * 1e-6) / 1e9
        rows[name] = {**t.as_dict(), "GB_per_s": round(gbs, 1), "bit_exact": checks[name]}
        if rank == 0:
            print(f"  {name:12s} {t.median_us:8.1f} us (spread {100 * t.spread:4.1f}%) {gbs:7.1f} GB/s "
                  f"{'ok' if checks[name] else 'WRONG BYTES'}")
    if rank == 0:
        command = f"torchrun --nproc-per-node {world} -m scripts.bench_link " + " ".join(
            sys.argv[1:] if argv is None else argv)
        print("RESULT_JSON " + json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                           "device": torch.cuda.get_device_name(), "command": command,
                                           "bytes": nbytes, "world": world, "graph": args.graph,
                                           "steps": args.steps, "arms": rows,
                                           "idle_before": idle_before, "idle_after": idle_after}))
    window.close()
    comm.close()
    wrong = [name for name, ok in checks.items() if not ok]
    if wrong:  # timings of arms that moved the wrong bytes say nothing: not a run to exit 0
        raise SystemExit(f"bench_link: wrong bytes on the receiver (not bit-exact) for {', '.join(wrong)}")


if __name__ == "__main__":
    main()
