"""Host cost of an eager call of GemmAllReduceOp.

    python3 -m scripts.bench_eager -m 16,128,1024,4096,16384 --json w1.json
    torchrun --nproc-per-node 2 -m scripts.bench_eager -m 16,128,1024,4096,16384 --json w2.json

World 1 (no launcher): per M, eager calls of the op (mode gemm-only, and mode fused, which at world 1
is the plain GEMM) against ``torch._scaled_mm`` as a model calls it (``cco.bench.timing.cublas_gemm``),
and ``op gemm-only, full path``: its kept launch dropped before every call (``cco.op._KeptLaunches``),
so every call pays the full checks and binds its launch anew (the cost the kept launches save, or more);
then the host time of each step of the op's plain call (validation with the operands' signature
already accepted and in full, the plan, the output, the backend's launch), each over repeated calls.

World W (torchrun): per M, the op's fused call (the default transport: on CUDA the lsa kernel up to
``cco.backends.cuda.LSA_AUTO_MAX_ELEMENTS``, the copy engines above) eager and as a replay of a CUDA
graph captured from the same call. Ranks may share a GPU (the time-sliced device time is the same
in both arms, so eager minus replay is the host's cost; the gemm-ar benchmark refuses such ranks
because their link timings say nothing).

Timing is ``cco.bench.timing.time_back_to_back``: ``--calls`` calls back to back per arm, the wall
time per call (CUDA events: whichever of host and device is behind) and the host's issue time per
call, median over passes, max over ranks; at world 1 also each arm's wall time over ``_scaled_mm``'s
pass by pass (median and range over passes: the host's speed drifts between passes). Every output
is checked against the fp32 reference first.
Each M ends in ``RESULT_JSON {...}``; ``--json`` writes them all.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

from cco import layout
from cco import quant as Q
from cco.bench.timing import allreduce_mismatches, allreduce_terms, budget_terms, cublas_gemm, gemm_mismatches
from cco.bench.timing import check_output_dirs, per_pass_ratio, require_cuda, time_back_to_back
from scripts._cli import ints

# world W: above this many output elements the eager call's output is checked against its graph replay's
# (bit for bit) instead of the fp32 reference summed over the ranks on the host
REFERENCE_MAX_ELEMENTS = 4096 * 7168


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quant", default="ptpc", choices=Q.QUANTS)
    p.add_argument("-m", type=ints, default=[16, 128, 1024, 4096, 16384], help="comma list of row counts")
    p.add_argument("-n", type=int, default=7168)
    p.add_argument("-k", type=int, default=2048)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--json", help="write every M's result to this file")
    args = p.parse_args(argv)
    check_output_dirs(p, args, ("json",))  # now, not after every M has been timed
    return args


def _host_us(fn, calls: int = 200) -> float:
    """Host time of one call of ``fn`` (mean over ``calls``, the device drained before and after)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    spent = time.perf_counter() - t0
    torch.cuda.synchronize()
    return round(1e6 * spent / calls, 2)


def world_one(args, comm) -> list[dict]:
    from cco.op import GemmAllReduceOp
    from cco.preshuffle import preshuffle_b

    runs = []
    for m in args.m:
        p = Q.random_problem(m, args.n, args.k, args.quant, seed=0, device=comm.device)
        b_pre = preshuffle_b(p.b)
        cublas, why = cublas_gemm(args.quant, p.b, p.b_scale, fast_accum=True)
        ops = {mode: GemmAllReduceOp(comm, n=args.n, k=args.k, m_max=m, quant=args.quant, mode=mode)
               for mode in ("gemm-only", "fused")}
        arms = {f"op {mode}": (lambda op=op: op(p.a, b_pre, p.a_scale, p.b_scale)) for mode, op in ops.items()}

        def full_path(op=ops["gemm-only"]):  # the call without its kept launch (cco.op._KeptLaunches)
            op._launches.clear()
            return op(p.a, b_pre, p.a_scale, p.b_scale)
        arms["op gemm-only, full path"] = full_path
        if cublas is not None:
            arms["_scaled_mm"] = lambda: cublas(p.a, p.a_scale)
        ref, dot_abs = budget_terms(p)
        bad = {name: gemm_mismatches(fn(), ref, dot_abs) for name, fn in arms.items()}
        del ref, dot_abs
        timed = time_back_to_back({n: f for n, f in arms.items() if not bad[n]}, calls=args.calls, passes=args.passes)
        op = ops["gemm-only"]
        backend = op._backend
        out = torch.empty(m, args.n, dtype=torch.bfloat16, device=comm.device)
        plan = op._plain_plan(m)
        steps = {
            "check, signature accepted": lambda: op._check(p.a, b_pre, p.a_scale, p.b_scale, "bench"),
            "check, full (cco.validate.check_operands and the op's)": lambda: (op._accepted.clear(),
                                                                               op._check(p.a, b_pre, p.a_scale,
                                                                                         p.b_scale, "bench")),
            "plan_call (a collective call's plan)": lambda: layout.plan_call(
                op.config, m=m, seq=1, rank=0, counter_base=layout.zero_counters(1)),
            "torch.empty (the output)": lambda: torch.empty(m, args.n, dtype=torch.bfloat16, device=comm.device),
            "backend.gemm (rule, weight, launch)": lambda: backend.gemm(p.a, b_pre, p.a_scale, p.b_scale, out=out,
                                                                        plan=plan),
        }
        if cublas is not None:
            steps["_scaled_mm as a model calls it"] = lambda: cublas(p.a, p.a_scale)
        host = {name: _host_us(fn) for name, fn in steps.items()}
        for o in ops.values():
            o.close()
        base = timed.get("_scaled_mm")
        # per arm, its wall time over _scaled_mm's pass by pass (the arms of a pass run back to back;
        # the host's speed drifts between passes by more than the arms differ): median, min, max
        ratios = {}
        for name, t in timed.items():
            if base and name != "_scaled_mm":
                ratios[name] = [round(x, 3) for x in per_pass_ratio(t["wall_pass_us"], base["wall_pass_us"])]
        record = {"m": m, "world": 1, "arms": timed, "bad_elements": bad, "host_steps_us": host,
                  "vs_scaled_mm_per_pass": ratios, "gemm_only_config": str(backend._plain_config(m)),
                  "baseline_missing": why}
        print(f"M={m}: " + " | ".join(f"{n} {t['wall_us']:.1f} us/call (host {t['host_us']:.1f})"
                                      for n, t in timed.items()))
        for name, (med, lo, hi) in ratios.items():
            print(f"  {name} / _scaled_mm, pass by pass: {med:.3f}x ({lo:.3f}-{hi:.3f})")
        print("  host steps (us): " + ", ".join(f"{k} {v}" for k, v in host.items()))
        print("RESULT_JSON " + json.dumps(record), flush=True)
        runs.append(record)
    return runs


def world_many(args, comm) -> list[dict]:
    from cco.op import GemmAllReduceOp
    from cco.preshuffle import preshuffle_b
    from cco.window import ranks_share_a_device

    runs = []
    with GemmAllReduceOp(comm, n=args.n, k=args.k, m_max=max(args.m), quant=args.quant, mode="fused") as op:
        for m in args.m:
            p = Q.random_problem(m, args.n, args.k, args.quant, seed=10 * comm.rank, device=comm.device)
            b_pre = preshuffle_b(p.b)
            eager = lambda: op(p.a, b_pre, p.a_scale, p.b_scale)  # noqa: E731
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                eager()  # warm outside the capture: compile, tables, weight copies
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            comm.barrier()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = eager()
            torch.cuda.synchronize()
            comm.barrier()
            graph.replay()
            out = eager()
            torch.cuda.synchronize()
            if m * args.n <= REFERENCE_MAX_ELEMENTS:
                total, abs_sum, dot_abs_sum = allreduce_terms(*budget_terms(p), on_host=True)
                bad = {"op eager": allreduce_mismatches(out, total, abs_sum, dot_abs_sum, fp8_gather=False),
                       "op graph replay": allreduce_mismatches(captured, total, abs_sum, dot_abs_sum, fp8_gather=False)}
                del total, abs_sum, dot_abs_sum
            else:  # the host-side reference sum would take longer than the run: replay and eager must agree
                bad = {"op eager": int((~torch.isfinite(out.float())).sum()),
                       "op graph replay": int((captured != out).sum())}
            timed = time_back_to_back({"op eager": eager, "op graph replay": graph.replay}, calls=args.calls,
                                      passes=args.passes, barrier=comm.barrier, gather=comm.all_gather_object)
            path = "lsa" if op._backend.uses_lsa(m) else f"dma, producer {op._backend.producer}"
            record = {"m": m, "world": comm.world, "path": path, "shared_gpu": ranks_share_a_device(comm),
                      "arms": timed, "bad_elements": comm.all_gather_object(bad),
                      "eager_minus_replay_us": timed["op eager"]["wall_us"] - timed["op graph replay"]["wall_us"]}
            if comm.rank == 0:
                print(f"M={m} ({path}): eager {timed['op eager']['wall_us']:.1f} us/call (host "
                      f"{timed['op eager']['host_us']:.1f}), replay {timed['op graph replay']['wall_us']:.1f}; "
                      f"eager - replay {record['eager_minus_replay_us']:.1f} us", flush=True)
                print("RESULT_JSON " + json.dumps(record), flush=True)
            runs.append(record)
            del graph, captured
    return runs


def wrong_arms(runs: list[dict]) -> list[str]:
    """``M=m arm`` of every arm whose output failed its check (world W: on any rank); such an arm posts
    no time at world 1, and the run must not exit 0 over it."""
    wrong = []
    for r in runs:
        per_rank = r["bad_elements"] if isinstance(r["bad_elements"], list) else [r["bad_elements"]]
        wrong += [f"M={r['m']} {arm}" for arm in dict.fromkeys(a for bad in per_rank for a, n in bad.items() if n)]
    return wrong


def main(argv=None) -> int:
    args = parse_args(argv)
    require_cuda("bench_eager")  # after parsing: --help and argument errors need no GPU
    from cco.comm import Communicator

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        comm = Communicator.from_env()
    else:
        rendezvous = os.path.join(tempfile.mkdtemp(), "rendezvous")
        comm = Communicator(rank=0, world=1, init_method=f"file://{rendezvous}",
                            device=torch.device("cuda", torch.cuda.current_device()))
    with comm:
        runs = world_one(args, comm) if comm.world == 1 else world_many(args, comm)
        if args.json and comm.rank == 0:
            command = "python3 -m scripts.bench_eager " + " ".join(sys.argv[1:] if argv is None else argv)
            with open(args.json, "w") as f:
                json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "device": torch.cuda.get_device_name(), "quant": args.quant, "n": args.n, "k": args.k,
                           "command": command, "runs": runs}, f, indent=1)
    wrong = wrong_arms(runs)
    if wrong:  # every rank holds every rank's counts (world W) or its own (world 1): the same status on each
        print(f"bench_eager: outputs outside the fp8 error budget: {', '.join(wrong)}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
