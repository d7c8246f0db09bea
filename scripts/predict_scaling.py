"""Predicted gemm-ar times at world 2, 4 and 8 from the cost model ``cco.bench.perf_model`` (calibrated on
the 2x H200 measurements of docs/BENCHMARKS.md and docs/experiments.md). These are predictions, not measurements.

    python -m scripts.predict_scaling                      # the table
    python -m scripts.predict_scaling --plot docs/predicted_scaling_w8.png   # and the W=8 plot
    python -m scripts.predict_scaling --check              # the model against the 2-GPU figures
    python -m scripts.predict_scaling --sensitivity        # W=8 [16384, 7168] ratio if an assumption is off
    python -m scripts.predict_scaling --worlds 8 -m 16384
    python -m scripts.predict_scaling --variants --worlds 2 -m 16384   # put lanes x chunk sizes

The table: one row per (world, quant, M); times in us; ratios against ``scaled_mm+nccl`` (cuBLAS,
for blockscale its blockwise recipe, + NCCL, as ``scripts/bench_gemm_ar.py`` runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from cco import layout
from cco.bench import perf_model as P

SWEEP_M = (2048, 4096, 8192, 16384, 32768)
# (label, chunks, put lanes): the copy-engine variants scripts/bench_gemm_ar.py has arms for
VARIANTS = (("4 chunks", 4, 1), ("8 chunks", 8, 1), ("taper", layout.TAPERED_CHUNKS, 1), ("two lanes", 4, 2),
            ("8 chunks, two lanes", 8, 2), ("taper, two lanes", layout.TAPERED_CHUNKS, 2))
# what matplotlib's savefig writes (its default canvas), by the --plot path's extension: anything else
# would fail in savefig, after the table has been printed


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()).replace("``", ""))
    p.add_argument("-m", type=int, nargs="+", default=list(SWEEP_M), help="M values (within 2048..32768)")
    p.add_argument("--worlds", type=int, nargs="+", default=list(P.WORLDS), help="world sizes (2..8, dividing N)")
    p.add_argument("--quant", nargs="+", default=list(P.QUANTS), choices=P.QUANTS)
    p.add_argument("--plot", default=None, help="PNG of predicted time vs M per arm at W=8 (none unless given; "
                   "the docs' is docs/predicted_scaling_w8.png)")
    p.add_argument("--no-plot", action="store_true", help="no plot even with --plot (the default draws none)")
    p.add_argument("--check", action="store_true",
                   help="print the model against the 2-GPU measurements instead of the table")
    p.add_argument("--sensitivity", action="store_true",
                   help="print the W=8 ratio under changed assumptions instead of the table")
    p.add_argument("--variants", action="store_true",
                   help="print fused and fused-fp8 per put-lane count and chunk sizes instead of the table (ptpc; "
                        "-m and --worlds pick the rows). --check, --sensitivity and --variants combine: each "
                        "printed, in that order")
    p.add_argument("--json", default=None, help="also write the predictions here")
    args = p.parse_args(argv)
    instead = [f"--{flag}" for flag in ("check", "sensitivity", "variants") if getattr(args, flag)]
    written = [f"--{flag} {getattr(args, flag)}" for flag in ("json", "plot") if getattr(args, flag)]
    if instead and written:
        p.error(f"{', '.join(written)} write the table's predictions, which {' and '.join(instead)} print instead "
                f"of: pass one or the other")
    from cco.bench.timing import check_output_dirs

    check_output_dirs(p, args, ("json", "plot"))
    if args.plot and not args.no_plot:  # (a suffix savefig cannot write would fail after the table)
        from scripts.plot_results import check_plot_path

        check_plot_path(p, "--plot", args.plot)
    return args


def print_predictions(preds, cal, file=None):
    file = file or sys.stdout
    print(f"PREDICTED (not measured) gemm-ar, N={P.N} K={P.K} per rank, chunks={P.CHUNKS}; model calibrated on "
          f"2x H200: copy {cal.copy_gbs:.1f} GB/s, step latency {cal.step_latency_us:.1f} us, NCCL "
          f"{cal.nccl_busbw_gbs:.1f} GB/s + {cal.nccl_alpha_us:.1f} us", file=file)
    head = (f"{'W':>2} {'quant':10s} {'M':>6} | {'scaled_mm+nccl':>14} {'split':>8} {'split-fp8':>9} "
            f"{'fused':>8} {'fused-fp8':>9} | {'fused':>6} {'fp8':>6} | {'floor':>7} {'floor-fp8':>9}")
    print(head, file=file)
    print("-" * len(head), file=file)
    for p in preds:
        print(f"{p.world:>2} {p.quant:10s} {p.m:>6} | {p.baseline_us:14.1f} {p.split_us:8.1f} {p.split_fp8_us:9.1f} "
              f"{p.fused_us:8.1f} {p.fused_fp8_us:9.1f} | {p.fused_ratio:5.3f}x {p.fused_fp8_ratio:5.3f}x | "
              f"{p.floor_us:7.1f} {p.floor_fp8_us:9.1f}", file=file)


def print_check(cal, file=None):
    file = file or sys.stdout
    print("model vs measured, 2x H200, N=7168 K=2048 ptpc (docs/experiments.md, sweep of 2026-11-30 19:26 UTC)", file=file)
    print(f"{'arm':15s} {'M':>6} {'measured':>9} {'model':>9} {'error':>7}  role", file=file)
    for c in P.check_2gpu(cal):
        role = "fitted" if c.fitted else "held out"
        print(f"{c.arm:15s} {c.m:>6} {c.measured_us:9.1f} {c.model_us:9.1f} {100 * c.error:+6.1f}%  {role}", file=file)
    held = [abs(c.error) for c in P.check_2gpu(cal) if not c.fitted]
    print(f"held out: {len(held)} points, max |error| {100 * max(held):.1f}%, mean {100 * sum(held) / len(held):.1f}%",
          file=file)


def print_sensitivity(cal, file=None):
    file = file or sys.stdout
    print("W=8 [16384, 7168] K=2048 ptpc, predicted fused / scaled_mm+nccl (target <= "
          f"{P.TARGET_W8_RATIO:.2f}x; 8x MI355X measured {P.MI355X_W8['fused_us'] / P.MI355X_W8['baseline_us']:.2f}x, "
          f"{P.MI355X_W8['fused_fp8_us'] / P.MI355X_W8['baseline_us']:.2f}x with the fp8 gather)", file=file)
    for name, (bf16, fp8) in P.sensitivity(cal=cal).items():
        print(f"  {name:68s} {bf16:5.3f}x  fp8 gather {fp8:5.3f}x", file=file)


def variant_rows(cal, worlds, ms) -> list[tuple]:
    """``(W, M, variant, fused us, fused-fp8 us, scaled_mm+nccl us)`` per world, M and variant; a
    ValueError for an M or world the model does not cover."""
    rows = []
    for w in worlds:
        for m in ms:
            base = P.baseline_us(m, w, cal=cal)
            for label, chunks, lanes in VARIANTS:
                bf16, fp8 = (P.fused_us(m, w, gather=g, cal=cal, chunks=chunks, lanes=lanes) for g in P.GATHERS)
                rows.append((w, m, label, bf16, fp8, base))
    return rows


def print_variants(cal, worlds, ms, file=None, rows=None):
    file = file or sys.stdout
    # every row first (``rows``: computed by the caller), so a bad -m or --worlds is an error before the header
    rows = variant_rows(cal, worlds, ms) if rows is None else rows
    print("PREDICTED (not measured) fused / fused-fp8 per copy-engine variant (lanes: put streams per peer), "
          "ptpc; ratios against scaled_mm+nccl. The model walks the layout's chunk-major order (the CUDA "
          "launch computes every peer's tiles first) and was calibrated with one lane and 4 chunks", file=file)
    head = f"{'W':>2} {'M':>6} {'variant':22s} | {'fused':>8} {'fused-fp8':>9} | {'fused':>6} {'fp8':>6}"
    print(head, file=file)
    print("-" * len(head), file=file)
    for w, m, label, bf16, fp8, base in rows:
        print(f"{w:>2} {m:>6} {label:22s} | {bf16:8.1f} {fp8:9.1f} | {bf16 / base:5.3f}x {fp8 / base:5.3f}x", file=file)


def plot(cal, path, *, world=8, ms=SWEEP_M):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(P.QUANTS), figsize=(11, 4.5), sharey=True)
    for ax, quant in zip(axes, P.QUANTS):
        preds = [P.predict(m, world, quant=quant, cal=cal) for m in ms]
        for label, attr, style in (("scaled_mm+nccl", "baseline_us", "o-"),
                                   ("split", "split_us", "s-"), ("fused", "fused_us", "^-"),
                                   ("fused-fp8", "fused_fp8_us", "v-"), ("floor, bf16 gather", "floor_us", "k--"),
                                   ("floor, fp8 gather", "floor_fp8_us", "k:")):
            ax.plot(ms, [getattr(p, attr) for p in preds], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("M (rows)")
        ax.set_title(f"{quant}, W={world}: PREDICTED")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("time (us), cost model")
    fig.suptitle(f"gemm-ar N={P.N} K={P.K}, {world}x H200 predicted from 2x H200 measurements (cco.bench.perf_model)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    cal = P.calibrate()
    if args.check or args.sensitivity or args.variants:  # instead of the table; each one asked for, in turn
        try:  # the variants' rows before anything is printed: a bad -m or --worlds is the only output
            rows = variant_rows(cal, args.worlds, args.m) if args.variants else None
        except ValueError as err:
            raise SystemExit(f"predict_scaling: {err}") from None
        if args.check:
            print_check(cal)
        if args.sensitivity:
            print_sensitivity(cal)
        if args.variants:
            print_variants(cal, args.worlds, args.m, rows=rows)
        return
    try:
        preds = [P.predict(m, w, quant=q, cal=cal) for w in args.worlds for q in args.quant for m in args.m]
    except ValueError as err:
        raise SystemExit(f"predict_scaling: {err}") from None
    print_predictions(preds, cal)
    if args.json:  # an object saying what the numbers are (the cost model's, not measurements) and how made
        command = "python -m scripts.predict_scaling " + " ".join(sys.argv[1:] if argv is None else argv)
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": command,
                       "kind": "predicted", "rows": [{**p.__dict__, "fused_ratio": p.fused_ratio,
                                                      "fused_fp8_ratio": p.fused_fp8_ratio} for p in preds]},
                      f, indent=1)
    if args.plot and not args.no_plot:
        plot(cal, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
