"""Check the 8-wave pipeline schedule over tiles x quant modes x K with the happens-before model.

    python -m kernels_fused.pipeline.verify                      # shipped, full table, exit 1 on a failure
    python -m kernels_fused.pipeline.verify --variant upstream --explain
    python -m kernels_fused.pipeline.verify --mfma-barriers off  # the four-barrier structure
    python -m kernels_fused.pipeline.verify --print --tile 256x256 --quant ptpc --k 256

A row fails when an LDS read is neither guaranteed nor a declared timing cover with enough slack,
or an LDS overwrite is not ordered after the reads of the old contents.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from .cli_args import loop_count as _loop_count, onoff as _onoff, tile as _parse_tile
from .happens_before import Report, check
from .schedule import QUANTS, VARIANTS, build_schedule

TILES = ("256x256", "128x256", "256x128")
KS = (256, 384, 512, 1024, 2048, 8192)


def _groups(items, key) -> list:
    """First item of each distinct key, in order."""
    seen, out = set(), []
    for it in items:
        k = key(it)
        if k not in seen:
            seen.add(k)
            out.append(it)
    return out


def summarize(report: Report) -> dict:
    reads = Counter(r.status for r in report.reads)
    timing = [r.min_slack for r in report.timing_only]
    unguarded = _groups(report.unguarded, lambda r: (r.section, r.stage, r.half))
    unordered = _groups(report.unordered, lambda o: (o.section, o.stage, o.half))
    return {
        "guaranteed": reads.get("guaranteed", 0),
        "timing": reads.get("timing-only", 0),
        "timing_min_slack": min(timing) if timing else None,
        "unguarded": reads.get("unguarded", 0),
        "unguarded_where": ", ".join(f"{r.section}:{r.stage}:{r.half}" for r in unguarded),
        "unordered": len(report.unordered),
        "unordered_where": ", ".join(f"{o.section}:{o.stage}:{o.half}" for o in unordered),
        "ok": report.ok,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernels_fused.pipeline.verify", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="shipped", choices=sorted(VARIANTS))
    ap.add_argument("--mfma-barriers", type=_onoff, default=None, metavar="on|off",
                    help="MFMA calls end in s_barrier (8 per step, on) or not (4, off); "
                         "default: the variant's (on)")
    ap.add_argument("--loop-count", type=_loop_count, default=None, help="min(2A+B,A+2B), 2A+B, A+B-1 or an int")
    ap.add_argument("--tail", choices=("drained", "bare"), default=None)
    ap.add_argument("--read-done", type=_onoff, default=None, metavar="on|off")
    ap.add_argument("--not-fifo", action="store_true",
                    help="LDS-DMA completion not FIFO: only vmcnt(0) proves a load done")
    ap.add_argument("--tile", type=_parse_tile, action="append", default=None,
                    help=f"repeatable; default {' '.join(TILES)}")
    ap.add_argument("--quant", choices=QUANTS, action="append", default=None)
    ap.add_argument("--k", type=int, action="append", default=None)
    ap.add_argument("--explain", action="store_true",
                    help="print the event trace behind the first verdict of each kind per row")
    ap.add_argument("--print", dest="print_schedule", action="store_true",
                    help="print each schedule, both wave groups side by side, and stop")
    args = ap.parse_args(argv)

    tiles = args.tile or [_parse_tile(t) for t in TILES]
    quants = args.quant or list(QUANTS)
    ks = args.k or list(KS)
    overrides = dict(loop_count=args.loop_count, tail=args.tail, read_done_s0=args.read_done,
                     mfma_barriers=args.mfma_barriers)

    try:
        schedules = [build_schedule(block_m=m, block_n=n, k=k, quant=q, variant=args.variant,
                                    **overrides)
                     for (m, n) in tiles for q in quants for k in ks]
    except ValueError as e:
        ap.error(str(e))

    if args.print_schedule:
        for s in schedules:
            print(s.format())
            print()
        return 0

    first = schedules[0]
    print(f"variant {args.variant}: {first.policy.describe()}; VM retirement "
          f"{'not FIFO' if args.not_fifo else 'FIFO'}")
    head = (f"{'tile':<8} {'quant':<10} {'K':>5} {'count':>5} {'guar':>5} {'timing':>6} "
            f"{'slack':>5} {'ungrd':>5} {'WAR':>4}  verdict")
    print(head)
    print("-" * len(head))
    failed = 0
    for s in schedules:
        r = check(s, fifo=not args.not_fifo)
        row = summarize(r)
        g = s.geometry
        slack = "-" if row["timing_min_slack"] is None else str(row["timing_min_slack"])
        verdict = "ok" if row["ok"] else "FAIL"
        where = "; ".join(x for x in (row["unguarded_where"] and f"unguarded {row['unguarded_where']}",
                                      row["unordered_where"] and f"unordered {row['unordered_where']}") if x)
        print(f"{g.label():<8} {g.quant:<10} {g.k:>5} {s.loop_count_value:>5} {row['guaranteed']:>5} "
              f"{row['timing']:>6} {slack:>5} {row['unguarded']:>5} {row['unordered']:>4}  "
              f"{verdict}{'  ' + where if where else ''}")
        failed += not row["ok"]
        if args.explain:
            items = (_groups(r.unguarded, lambda x: (x.section, x.stage, x.half))
                     + _groups(r.timing_only, lambda x: (x.section, x.stage, x.half))
                     + _groups(r.unordered, lambda x: (x.section, x.stage, x.half)))
            for it in items:
                print()
                print(r.explain(it))
            if items:
                print()
    print(f"{failed} of {len(schedules)} rows failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
