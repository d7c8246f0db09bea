"""Plot a gemm-ar sweep from its raw JSON (docs/results/*.json, written by ``scripts.bench_gemm_ar --sweep --json``).

One PNG, two panels sharing the M axis: the time of every arm (median of the pass medians, max over
ranks; the bar spans the pass medians' min..max), and each arm's ratio against the baseline arm
(``scaled_mm+nccl``, an all-gather sweep's ``nccl-fp8+scaled_mm``, unless ``--baseline`` says
otherwise). Reads only the JSON: no GPU, no torch.

    python3 -m scripts.plot_results docs/results/2026-11-30_sweep_h200x2.json \\
        --out docs/plots/sweep_graph_h200x2.png --mark fused-fp8@32768
    python3 -m scripts.plot_results docs/results/2026-11-30_eager_sweep_h200x2.json \\
        --out docs/plots/sweep_eager_h200x2.png

``--mark ARM@M`` draws that point hollow and labels it "not understood: see the page" (a figure the
page explains separately).
"""

from __future__ import annotations

import argparse
import json
import os

# one colour per mechanism; the fp8 gather of a mechanism is its dashed twin
STYLE = {
    "scaled_mm": dict(color="tab:purple", linestyle=":", marker="x"),
    "gemm-only": dict(color="tab:green", linestyle=":", marker="+"),
    "scaled_mm+nccl": dict(color="black", linestyle="-", marker="s", linewidth=2.2),
    "symm_mem": dict(color="tab:gray", linestyle="-", marker="v"),
    "split": dict(color="tab:brown", linestyle="-", marker="D"),
    "fused": dict(color="tab:blue", linestyle="-", marker="o"),
    "fused-fp8": dict(color="tab:blue", linestyle="--", marker="o"),
    "fused-lsa": dict(color="tab:orange", linestyle="-", marker="^"),
    "fused-lsa-fp8": dict(color="tab:orange", linestyle="--", marker="^"),
}
LABEL = {
    "scaled_mm": "scaled_mm (cuBLAS GEMM alone)",
    "gemm-only": "gemm-only (Triton GEMM alone)",
    "scaled_mm+nccl": "scaled_mm + NCCL (baseline)",
    "symm_mem": "symm_mem (torch)",
    "split": "split (GEMM, then copy-engine all-reduce)",
    "fused": "fused, copy engines",
    "fused-fp8": "fused, copy engines, fp8 gather",
    "fused-lsa": "fused, lsa (one kernel)",
    "fused-lsa-fp8": "fused, lsa, fp8 gather",
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()).replace("``", ""))
    p.add_argument("json", help="raw JSON of a gemm-ar sweep (a 'results' list, one entry per M)")
    p.add_argument("--out", required=True, help="PNG to write (or any file type matplotlib writes: .pdf, .svg, ...)")
    p.add_argument("--arms", default=None, help="comma list of arms to draw (default: every arm in the file)")
    p.add_argument("--baseline", default=None, help="arm the ratios are taken against (default: the run's "
                   "pattern's, " + ", ".join(f"{k} {v}" for k, v in BASELINES.items()) + ")")
    p.add_argument("--mark", action="append", default=[], metavar="ARM@M",
                   help="draw this point hollow and label it 'not understood: see the page' (a figure the page "
                        "explains separately; repeatable)")
    p.add_argument("--title", default=None, help="figure title (default: from the file)")
    args = p.parse_args(argv)
    check_plot_path(p, "--out", args.out)
    return args


def check_plot_path(p, flag: str, path: str) -> None:
    """At parse time, ``p.error`` for a plot path matplotlib would not write as asked: a directory (it
    would write a hidden ``.png`` inside it), or a suffix it has no format for (a traceback at the end)."""
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    if os.path.isdir(path) or path.endswith(os.sep):
        p.error(f"{flag} {path}: a directory; name the file to write (such as {os.path.join(path, 'plot.png')})")
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if suffix not in kinds:
        p.error(f"{flag} {path}: matplotlib writes no {('.' + suffix) if suffix else 'file without a suffix'}; "
                f"end it in one of {', '.join('.' + k for k in sorted(kinds))}")


def load_sweep(path):
    """(file dict, results sorted by M, arm names in file order); a file that is missing, not JSON or
    not a gemm-ar sweep is a one-line ``SystemExit`` naming it."""
    expected = "a bench_gemm_ar --json (an object whose 'results' are records with m and arms)"
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as err:
        raise SystemExit(f"plot_results: {path}: {err.strerror or err}; expected {expected}") from None
    except ValueError as err:
        raise SystemExit(f"plot_results: {path}: not JSON ({err}); expected {expected}") from None
    results = doc.get("results") if isinstance(doc, dict) else None
    if not isinstance(results, list) or not all(isinstance(r, dict) and "m" in r and isinstance(r.get("arms"), dict)
                                                for r in results):
        raise SystemExit(f"plot_results: {path}: not a gemm-ar sweep; expected {expected}")
    results = sorted(results, key=lambda r: r["m"])
    if not results:
        raise SystemExit(f"{path}: no results")
    for r in results:  # (the title reads them from every sweep's records: a one-line error, not a KeyError)
        missing = [key for key in ("quant", "n", "k", "world") if key not in r]
        if missing:
            raise SystemExit(f"plot_results: {path}: the record of M={r['m']} has no {', '.join(missing)}; "
                             f"expected {expected}")
    names = list(dict.fromkeys(name for r in results for name in r["arms"]))
    return doc, results, names


def series(results, name, baseline):
    """Per M where the arm ran: (m, median, min, max, ratio to the baseline's median)."""
    rows = []
    for r in results:
        arm, base = r["arms"].get(name), r["arms"].get(baseline)
        if arm is None or base is None:
            continue
        if not base["median_us"] > 0:  # (a ratio against it has no meaning: said, not a ZeroDivisionError)
            raise SystemExit(f"plot_results: baseline {baseline} at M={r['m']} has median_us {base['median_us']}; "
                             f"a ratio needs a positive time (--baseline picks another arm)")
        rows.append((r["m"], arm["median_us"], arm["min_us"], arm["max_us"], arm["median_us"] / base["median_us"]))
    return rows


# --pattern of bench_gemm_ar -> (what the title calls the run, the default baseline arm)
PATTERN_TITLES = {"ar": "GEMM + all-reduce", "rs": "GEMM + reduce-scatter (rows)", "ag": "all-gather + GEMM"}
BASELINES = {"ar": "scaled_mm+nccl", "rs": "scaled_mm+nccl", "ag": "nccl-fp8+scaled_mm"}


def pattern_of(results) -> str:
    return results[0].get("pattern", "ar")  # (sweeps before --pattern are all-reduce ones)


def check_marks(marks, results, names, baseline):
    """Every ``(arm, M)`` of ``marks`` is a point the plot draws, or a ``SystemExit`` naming the arms
    and Ms there are."""
    for arm, m in sorted(marks):
        if not any(row[0] == m for row in (series(results, arm, baseline) if arm in names else ())):
            ms = sorted({r["m"] for r in results})
            raise SystemExit(f"--mark {arm}@{m}: no such point; the arms drawn are {', '.join(names)} and the Ms "
                             f"{', '.join(map(str, ms))}")


def parse_marks(marks):
    out = set()
    for mark in marks:
        arm, _, m = mark.rpartition("@")
        if not arm or not m.isdigit():
            raise SystemExit(f"--mark wants ARM@M, got {mark!r}")
        out.add((arm, int(m)))
    return out


def plot(doc, results, names, path, *, baseline, marks=(), title=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    r0 = results[0]
    mode = "CUDA graph replays" if r0.get("graph") else "eager calls"
    pattern = pattern_of(results)
    title = title or (f"fused fp8 {PATTERN_TITLES.get(pattern, pattern)} (--pattern {pattern}), {r0['quant']}, "
                      f"N={r0['n']} K={r0['k']}, world {r0['world']}, {mode}\n{doc.get('device', '')} "
                      f"x{r0['world']}, {doc.get('date', '')}")
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(13, 5.2))
    ms = [r["m"] for r in results]
    for name in names:
        rows = series(results, name, baseline)
        if not rows:
            continue
        style = dict(STYLE.get(name, dict(marker="o")))
        label = LABEL.get(name, name)
        m = [row[0] for row in rows]
        med = [row[1] for row in rows]
        err = [[row[1] - row[2] for row in rows], [row[3] - row[1] for row in rows]]
        ax_t.errorbar(m, med, yerr=err, capsize=3, markersize=5, label=label, **style)
        ax_r.plot(m, [row[4] for row in rows], markersize=5, label=label, **style)
        for (mark_arm, mark_m) in marks:
            if mark_arm != name:
                continue
            for row in rows:
                if row[0] == mark_m:
                    for ax, y in ((ax_t, row[1]), (ax_r, row[4])):
                        ax.plot([row[0]], [y], marker="o", markersize=13, markerfacecolor="none",
                                markeredgecolor="red", linestyle="none")
                    ax_r.annotate("not understood:\nsee the page", (row[0], row[4]), xytext=(0.97, 0.05),
                                  textcoords="axes fraction", color="red", fontsize=8, ha="right", va="bottom",
                                  arrowprops=dict(arrowstyle="->", color="red"))
    ax_r.axhline(1.0, color="black", linewidth=1)
    ax_r.text(ms[0], 1.0, " baseline", va="bottom", fontsize=8)
    for ax in (ax_t, ax_r):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms)
        ax.set_xticklabels([str(m) for m in ms])
        ax.set_xlabel("M (rows of the output)")
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_yscale("log")
    plain = FuncFormatter(lambda y, _pos: f"{y:g}")
    ax_t.yaxis.set_major_formatter(plain)
    ax_t.yaxis.set_minor_formatter(plain)
    ax_t.tick_params(axis="y", which="minor", labelsize=7)
    ax_t.set_ylabel("time per call (us): median of pass medians, max over ranks")
    ax_t.set_title("time (bars: min..max of the pass medians)", fontsize=10)
    ax_r.set_ylabel(f"time / {baseline} time (lower is better)")
    ax_r.set_title(f"ratio against {baseline}", fontsize=10)
    handles, labels = ax_r.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=9, frameon=False)
    fig.suptitle(title, fontsize=11)
    legend_rows = -(-len(handles) // 4)
    fig.tight_layout(rect=(0, 0.045 * legend_rows + 0.01, 1, 1))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    doc, results, names = load_sweep(args.json)
    if args.arms:
        wanted = args.arms.split(",")
        missing = [a for a in wanted if a not in names]
        if missing:
            raise SystemExit(f"{args.json}: no arm {', '.join(missing)} (has {', '.join(names)})")
        names = wanted
    baseline = args.baseline or BASELINES.get(pattern_of(results), "scaled_mm+nccl")
    if not any(baseline in r["arms"] for r in results):
        raise SystemExit(f"{args.json}: no baseline arm {baseline!r} (has {', '.join(names)}; --baseline picks one)")
    marks = parse_marks(args.mark)
    check_marks(marks, results, names, baseline)
    plot(doc, results, names, args.out, baseline=baseline, marks=marks, title=args.title)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
