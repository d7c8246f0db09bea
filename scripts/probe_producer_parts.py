"""What each part of the vendor producer costs over the whole vendor GEMM (one NVIDIA GPU).

    python3 -m scripts.probe_producer_parts -m 8192,16384 --quant ptpc,blockscale --json parts.json

Why: the fused copy-engine path's vendor producer (``cco.cuda.dma.CopyEngineSchedule.produce_by_chunks``)
runs one cuBLAS call per row chunk, releases each chunk's counters after it and begins with a
preamble (counters zeroed, the call's stamp written). ``scripts/bench_gemm.py --producer`` times
the whole; this probe takes it apart, so a change to one part can be judged by what that part costs.

Arms, all CUDA-graph replays on the local window of rank 0 of 2 (``bench_gemm.local_window``), 4
chunks, time until the last work of the call is done, against ``whole`` (one cuBLAS call):
``g4`` the four chunk GEMMs back to back on one stream; ``+ zero,stamp`` / ``+ memset,stamp`` with
the preamble before them (the counters zeroed by a torch fill kernel or a driver memset);
``+ wv`` each chunk's counters released by stream write-values after its GEMM; ``+ kernel rel`` by
a one-warp kernel (release stores); ``+ batch`` by one batched memory operation per chunk
(``cuStreamBatchMemOp``); ``+ side wv`` by write-values on a stream of their own (an event per
chunk); ``2s``: the chunks dealt to two streams in turn (``PRODUCER_STREAMS``; ``full 2s (zero,stamp,wv)``
takes the steps the CUDA backend takes). Every arm's output
and counters are checked before it is timed. After each (quant, M), the GPU timeline of one replay
of ``full 1s`` (kernels and memory operations as the profiler sees them) is printed.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from scripts._cli import ints


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-m", type=ints, default="8192,16384", help="comma list of row counts")
    p.add_argument("--quant", default="ptpc,blockscale")
    p.add_argument("--passes", type=int, default=7)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    from cco.bench.timing import check_output_dirs

    check_output_dirs(p, args, ("json",))  # now, not after every arm has been timed
    return args


def _release_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def release(counters, pairs, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        idx = tl.load(pairs + 2 * offs, mask=mask, other=0)
        val = tl.load(pairs + 2 * offs + 1, mask=mask, other=0)
        tl.atomic_xchg(counters + idx, val, mask=mask, sem="release", scope="sys")

    return release


def _batch_write(stream: int, words) -> None:
    """One ``cuStreamBatchMemOp`` writing each ``(address, value)`` of ``words``."""
    from cco.cuda import memops

    d = memops._driver()
    ops = []
    for addr, value in words:
        op = d.CUstreamBatchMemOpParams()
        op.writeValue.operation = d.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_64
        op.writeValue.address = d.CUdeviceptr(addr)
        op.writeValue.value64 = d.cuuint64_t(value)
        op.writeValue.flags = d.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        ops.append(op)
    memops._check(d.cuStreamBatchMemOp(d.CUstream(stream), len(ops), ops, 0), "cuStreamBatchMemOp")


def arms_for(quant: str, m: int, dev, n: int = 7168, k: int = 2048):
    """name -> call(i), and the check of an arm's output; the schedule whose counters they release."""
    from cco import layout
    from cco import quant as Q
    from cco.backends.cuda import CudaBackend
    from cco.cuda import memops
    from cco.cuda.dma import CopyEngineSchedule
    from kernels_fused.hopper import vendor
    from scripts.bench_gemm import local_window

    sets = [Q.random_problem(m, n, k, quant, seed=i, device=dev) for i in range(2)]
    weight = vendor.prepare_weight(sets[0].b, sets[0].b_scale, quant)
    whole = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    block_m, block_n = CudaBackend.tile(quant)
    cfg = layout.build_config(n=n, k=k, m_max=m, world=2, quant=quant, block_m=block_m, block_n=block_n, chunks=4)
    window = local_window(cfg, dev)
    rows = window.tensor(cfg.window.partial, rank=0).view(cfg.m_max_padded, cfg.n)
    plan = layout.plan_call(cfg, m=m, seq=1, rank=0, counter_base=layout.zero_counters(2))
    sched = CopyEngineSchedule(config=cfg, window=window, device=dev)
    dests = layout.dest_order(0, 2)
    words = [[(sched._addr(sched.counters, layout.counter_index(d, c)), plan.slot_tiles(d, c)) for d in dests]
             for c in range(plan.chunks)]
    pairs = [torch.tensor([[layout.counter_index(d, c), plan.slot_tiles(d, c)] for d in dests], dtype=torch.int64,
                          device=dev).flatten() for c in range(plan.chunks)]
    side = [torch.cuda.Stream(device=dev) for _ in range(3)]
    events = [torch.cuda.Event() for _ in range(16)]
    release_kernel = _release_kernel()

    def release(how, stream, c):
        if how == "wv":
            for addr, value in words[c]:
                memops.write(stream.cuda_stream, addr, value)
        elif how == "kernel":
            release_kernel[(1,)](sched.counters, pairs[c], len(dests), BLOCK=8, num_warps=1)
        elif how == "batch":
            _batch_write(stream.cuda_stream, words[c])
        elif how == "side-wv":
            events[1 + c].record(stream)
            side[2].wait_event(events[1 + c])
            release("wv", side[2], c)

    def zero_stamp():
        sched.counters.zero_()
        sched.begin(plan)

    def memset_stamp():
        memops.fill(torch.cuda.current_stream().cuda_stream, sched.counters.data_ptr(), 0, sched.counters.numel() * 8)
        sched.begin(plan)

    def make(preamble, how, streams=1):
        def call(i):
            main = torch.cuda.current_stream()
            if preamble:
                preamble()
            run = vendor.row_chunks(sets[i].a, sets[i].a_scale, weight, out=rows, rows=plan.rows)
            mine = [main, *side[:streams - 1]]
            if streams > 1:
                events[0].record(main)
                for s in mine[1:]:
                    s.wait_event(events[0])
            for c in range(plan.chunks):
                s = mine[c % streams]
                with torch.cuda.stream(s):
                    run(c)
                    if how:
                        release(how, s, c)
            for j, s in enumerate(mine[1:]):
                events[8 + j].record(s)
                main.wait_event(events[8 + j])
            if how == "side-wv":
                events[12].record(side[2])
                main.wait_event(events[12])
            return rows
        return call

    arms = {"whole": lambda i: vendor.vendor_gemm(sets[i].a, sets[i].a_scale, weight, out=whole),
            "g4": make(None, None), "g4 + zero,stamp": make(zero_stamp, None),
            "g4 + memset,stamp": make(memset_stamp, None), "g4 + wv": make(None, "wv"),
            "g4 + kernel rel": make(None, "kernel"), "g4 + side wv": make(None, "side-wv"),
            "full 1s (zero,stamp,wv)": make(zero_stamp, "wv"), "g4 2s": make(None, None, 2),
            "g4 2s + wv": make(None, "wv", 2), "g4 2s + kernel rel": make(None, "kernel", 2),
            "full 2s (zero,stamp,wv)": make(zero_stamp, "wv", 2),
            "full 2s memset,kernel rel": make(memset_stamp, "kernel", 2),
            "g4 + batch": make(None, "batch"), "full 2s (zero,stamp,batch)": make(zero_stamp, "batch", 2)}
    return arms, sets, sched, plan


def main(argv=None):
    from cco import layout
    from cco.bench.timing import budget_terms, gemm_mismatches, graphed, per_pass_ratio, require_cuda, time_arms

    args = parse_args(argv)
    require_cuda("probe_producer_parts")  # after parsing: --help and argument errors need no GPU
    dev = torch.device("cuda", torch.cuda.current_device())
    results = []
    for quant in args.quant.split(","):
        for m in args.m:
            arms, sets, sched, plan = arms_for(quant, m, dev)
            ref, dot_abs = budget_terms(sets[0])
            for name, fn in list(arms.items()):
                sched.counters.zero_()
                try:
                    out = fn(0)
                    torch.cuda.synchronize()
                except RuntimeError as err:  # e.g. a driver without batched memory operations
                    print(f"{name}: {type(err).__name__}: {err}; not timed", flush=True)
                    arms.pop(name)
                    continue
                bad = gemm_mismatches(out[:m], ref, dot_abs)
                counted = sched.counters.view(2, layout.MAX_CHUNKS).tolist()
                if any(part in name for part in ("wv", "rel", "batch")):
                    bad += sum(counted[d][c] != plan.slot_tiles(d, c) for d in range(2) for c in range(plan.chunks))
                if bad:
                    print(f"{name}: {bad} bad elements or counters; not timed", flush=True)
                    arms.pop(name)
            del ref, dot_abs
            timed, eager = graphed(arms, 2)
            t = time_arms(timed, passes=args.passes, iters=args.iters, rotate=2)
            base = t["whole"]
            print(f"== {quant} M={m} (graph replays; eager: {eager})", flush=True)
            record = {"quant": quant, "m": m, "arms": {}}
            for name, a in t.items():
                paired = per_pass_ratio(a.pass_us, base.pass_us)[0]
                record["arms"][name] = {**a.as_dict(), "x_whole_per_pass": paired}
                print(f"  {name:30s} {a.median_us:8.1f} us  x{a.median_us / base.median_us:5.3f} (pass by pass "
                      f"x{paired:5.3f})  spread {100 * a.spread:4.1f}%", flush=True)
            results.append(record)
            _timeline(arms["full 1s (zero,stamp,wv)"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python3 -m scripts.probe_producer_parts " + " ".join(sys.argv[1:] if argv is None
                                                                                       else argv),
                       "device": torch.cuda.get_device_name(), "runs": results}, f, indent=1)


def _timeline(call) -> None:
    """The GPU timeline of one replay of ``call``, as the profiler sees it (kernels, memsets)."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call(0)
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    t0 = events[0].time_range.start if events else 0
    for e in events:
        print(f"    {e.time_range.start - t0:9.1f} .. {e.time_range.end - t0:9.1f} us  {e.name[:70]}")


if __name__ == "__main__":
    main()
