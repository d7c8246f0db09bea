"""Simulated repeated launches of the 8-wave pipeline, checked element-wise.

    python -m kernels_fused.pipeline.simulate --variant upstream --quant ptpc --shape 4096x7168x256 \\
        --launches 12 --seed 0
    python -m kernels_fused.pipeline.simulate --sweep --shape 2048x7168x2048 --mfma-barriers off --launches 4

Each launch NaN-poisons the output, runs every workgroup of the grid through the latency model
(:mod:`kernels_fused.pipeline.simulator`) and counts elements more than 5% off the bf16-rounded fp32
reference. The last line is ``bad launches: X/N`` and the worst launch's wrong-element count.

``--sweep`` compares the loop counts 2A+B and A+B-1 (drained tail and read_done in both) while
single DMA loads run later and later (a growing latency tail), and prints the slack, in cycles, of
the reads that only elapsed time covers. A uniform latency increase is not the knob: the waves
stall on their waits as long as the loads are late, which leaves the slack where it was.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import numpy as np

from .cli_args import loop_count as _loop_count, onoff as _onoff, shape as _shape, tile as _tile
from .happens_before import check
from .schedule import QUANTS, VARIANTS, build_schedule
from .simulator import LatencyModel, read_slack_cycles, run_launches


def _site(read) -> str:
    """Where a read sits; the first loop step is told apart (it reads the prologue's loads)."""
    return "k=1" if read.section == "loop" and read.label.startswith("k=1 ") else read.section


def _model(args) -> LatencyModel:
    return replace(LatencyModel(), contention=args.contention, extra_latency=args.extra_latency,
                   fifo=not args.not_fifo, tail_scale=args.tail_scale)


def run(args) -> int:
    from cco.quant import random_problem

    m, n, k = args.shape
    bm, bn = args.tile
    sched = build_schedule(block_m=bm, block_n=bn, k=k, quant=args.quant, variant=args.variant,
                           loop_count=args.loop_count, tail=args.tail,
                           read_done_s0=args.read_done, mfma_barriers=args.mfma_barriers)
    problem = random_problem(m, n, k, args.quant, seed=args.seed)
    model = _model(args)
    print(f"{sched.name()}; shape {m}x{n}x{k}; {args.launches} launches, seed {args.seed}")
    results = run_launches(sched, problem, launches=args.launches, seed=args.seed, model=model)
    for i, r in enumerate(results):
        print(f"launch {i:2d}: {r.wrong:9d} wrong elements; {r.stale_workgroups:5d} workgroups "
              f"read stale rows ({r.stale_groups} row groups); {r.end_cycles:9.0f} cycles")
    sites = {}
    for r in results:
        for key, v in r.stale_sites.items():
            sites[key] = sites.get(key, 0) + v
    if sites:
        print("stale row groups by read site: "
              + ", ".join(f"{key} {v}" for key, v in sorted(sites.items())))
    bad = sum(r.wrong > 0 for r in results)
    worst = max(r.wrong for r in results)
    print(f"bad launches: {bad}/{len(results)}, worst launch {worst} wrong elements")
    return 1 if bad else 0


def sweep(args) -> int:
    from cco.quant import random_problem

    m, n, k = args.shape
    bm, bn = args.tile
    problem = random_problem(m, n, k, args.quant, seed=args.seed)
    counts = ("2A+B", "A+B-1")
    scheds = {c: build_schedule(block_m=bm, block_n=bn, k=k, quant=args.quant, variant="shipped",
                                loop_count=c, mfma_barriers=args.mfma_barriers)
              for c in counts}
    reports = {c: check(s) for c, s in scheds.items()}
    n_wg = (m // bm) * (n // bn)
    base = replace(_model(args), tail_scale=0.0)
    print(f"DMA latency sweep, {bm}x{bn} {args.quant} {m}x{n}x{k}, "
          f"mfma_barriers={scheds[counts[0]].policy.mfma_barriers}, contention {base.contention}, "
          f"extra latency {base.extra_latency:.0f}, {args.launches} launches per point")
    print("slack = how late one load may land before a read that no wait covers goes stale, in "
          "cycles, with deterministic latencies (min / 1st percentile / median over reads and "
          "workgroups):")
    for c, rep in reports.items():
        for what, reads in (("timing-only", rep.timing_only), ("unguarded", rep.unguarded)):
            if not reads:
                continue
            sl = read_slack_cycles(scheds[c], n_wg=n_wg, seed=args.seed, model=base, reads=reads)
            sites = ", ".join(sorted({f"{_site(r)}:{r.stage}:{r.half}" for r in reads}))
            print(f"  {c:>6} {len(reads):4d} {what:<11} reads ({sites}): slack {sl.min():.0f} / "
                  f"{np.percentile(sl, 1):.0f} / {np.median(sl):.0f}")
        if not rep.timing_only and not rep.unguarded:
            print(f"  {c:>6}    0 reads left to timing")
    print("latency spikes: each load is late by a Pareto tail of the given scale x "
          f"{base.dma_base:.0f} cycles (shape {base.tail_alpha})")
    print(f"{'tail':>6} {'p99 late':>9} " + " ".join(f"{c + ' bad':>10}" for c in counts)
          + "   stale rows at")
    totals = {c: 0 for c in counts}
    rng = np.random.default_rng(args.seed)
    for tail in args.tails:
        model = replace(base, tail_scale=tail)
        p99 = (np.percentile(rng.pareto(model.tail_alpha, 100000), 99) * tail * model.dma_base)
        cells, where = [], []
        for c in counts:
            res = run_launches(scheds[c], problem, launches=args.launches, seed=args.seed,
                               model=model, exact=False)
            bad = sum(r.wrong > 0 for r in res)
            totals[c] += bad
            cells.append(f"{f'{bad}/{len(res)}':>10}")
            sites = {}
            for r in res:
                for key, v in r.stale_sites.items():
                    sites[key] = sites.get(key, 0) + v
            if sites:
                where.append(f"{c}: " + ", ".join(f"{kk} {v}" for kk, v in sorted(sites.items())))
        print(f"{tail:>6.2f} {p99:>9.0f} " + " ".join(cells)
              + (f"   {'; '.join(where)}" if where else ""))
    print("bad launches: " + ", ".join(f"{c} {totals[c]}" for c in counts)
          + f" over {len(args.tails)} points")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernels_fused.pipeline.simulate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="shipped", choices=sorted(VARIANTS))
    ap.add_argument("--quant", default="ptpc", choices=QUANTS)
    ap.add_argument("--shape", type=_shape, default=(4096, 7168, 256), help="MxNxK")
    ap.add_argument("--tile", type=_tile, default=(256, 256), help="BLOCK_MxBLOCK_N")
    ap.add_argument("--launches", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mfma-barriers", type=_onoff, default=None, metavar="on|off")
    ap.add_argument("--loop-count", type=_loop_count, default=None)
    ap.add_argument("--tail", choices=("drained", "bare"), default=None)
    ap.add_argument("--read-done", type=_onoff, default=None, metavar="on|off")
    ap.add_argument("--contention", type=float, default=1.0,
                    help="multiplies the per-KiB DMA pipe time (bandwidth pressure)")
    ap.add_argument("--extra-latency", type=float, default=0.0, help="cycles added to every DMA")
    ap.add_argument("--not-fifo", action="store_true", help="LDS-DMA completion not FIFO")
    ap.add_argument("--tail-scale", type=float, default=LatencyModel().tail_scale,
                    help="size of the Pareto latency tail relative to the base latency (0: none)")
    ap.add_argument("--sweep", action="store_true", help="2A+B vs A+B-1 under rising DMA latency")
    ap.add_argument("--tails", type=float, nargs="+", default=[0.0, 0.2, 0.5, 1.0, 2.0, 4.0],
                    help="latency-tail scales for --sweep (how far single loads run late)")
    args = ap.parse_args(argv)
    if args.launches < 1:
        ap.error(f"--launches {args.launches}: must be >= 1")
    try:
        return sweep(args) if args.sweep else run(args)
    except ValueError as e:
        ap.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
