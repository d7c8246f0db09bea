"""mxfp8's decode GEMM over its fp8 weight (``kernels_fused.hopper.mx_decode``, CUDA C++) against the
layers' path and bf16 ``nn.Linear``, device time under graph replay, one GPU::

    python3 -m scripts.probe_mx_decode 8b-down-tp1,8b-o-tp1,70b-down-tp1 2,8,16,32,64 mx.json
    python3 -m scripts.probe_mx_decode --slices 4,8,16 --cold 8b-down-tp1 8,64 mx.json
    python3 -m scripts.probe_mx_decode --from mx.json --plot mx.png       # its picture, no GPU

Why: Hopper has no MMA with e8m0 scales, so mxfp8's 2..64 rows run the activation quantizer's launch
(rows quantized and dequantized to bf16) and cuBLAS's bf16 GEMM over a bf16 copy of the weight,
which cannot read fewer bytes than ``nn.Linear`` (1.01-1.16x of its device time, cold;
docs/decode.md). The kernel reads the fp8 weight and its scales instead. Arms, per (shape, M):
``nn.Linear bf16``; ``decode_gemm`` (the layers' call past ``decode.mx_rows_max`` rows: the
quantizer's launch and cuBLAS over the copy); ``quantizer + mx_decode`` (``decode_gemm`` over the fp8
weight with ``scales_checked``: the same quantizer launch, then the kernel's default build, as the
layers run up to ``mx_rows_max`` rows); and the kernel alone on the quantized rows,
``mx_decode s=default`` (its default slices, prefetch and tiles) and one arm per combination of
``--slices``, ``--prefetch`` and ``--tiles`` given (``s=``, ``p=``, ``t=`` in the label). Every arm
but ``nn.Linear`` is first checked against the fp32 product of the dequantized operands
(``gemm_mismatches``: none outside the fp8 GEMM's budget) and for equal bits on a repeat; a wrong
arm is dropped and listed. ``--cold`` also
times each arm as a graph whose calls are each on a weight of its own (10 seeded copies, as a
model's layers follow each other), in the same passes. Device us per call: median over
``--passes`` passes (arms alternating), with the fastest and slowest pass; ratios to ``nn.Linear``
(**lower is better**, the decode target is 0.8x).
"""
import itertools
import json
import sys
import time

import torch

from cco import quant as Q
from scripts._cli import drew_an_earlier_run, ints, shape_probe_args
from scripts.tune_decode import SHAPES, checked_arms, decode_panel, earlier_run, save_figure, shape_weight

GRAPH_CALLS = 10  # calls per captured graph (--cold: each on a weight of its own)
BASE = "nn.Linear bf16"
LAYERS = "decode_gemm"
CANDIDATE = "quantizer + mx_decode"


def parse_args(argv=None):
    def extra(p):
        p.add_argument("--slices", type=ints, default=[], help="comma list of K slice counts of more kernel-alone "
                       "arms (one arm always takes the kernel's default, about two blocks an SM)")
        p.add_argument("--prefetch", type=ints, default=[], help="comma list of the kernel's weight prefetch "
                       "depths (steps in registers) of more kernel-alone arms, at each slice count")
        p.add_argument("--tiles", type=ints, default=[], help="comma list of the kernel's m16 tiles a warp (1 or 2) "
                       "of more kernel-alone arms, at each slice count and prefetch depth")
        p.add_argument("--passes", type=int, default=5, help="timing passes, arms alternating (default 5)")
        p.add_argument("--cold", action="store_true",
                       help=f"each arm also timed as a graph whose {GRAPH_CALLS} calls are each on a weight of "
                            f"its own, in the same passes (us_cold)")

    args = shape_probe_args(__doc__, SHAPES, argv, extra=extra)
    if args.passes < 1:
        raise SystemExit("probe_mx_decode: --passes >= 1")
    return args


def timed(arms: dict, passes: int) -> dict:
    """Per arm ``[median, fastest pass, slowest pass]`` device us per call of a graph of GRAPH_CALLS calls."""
    from cco.bench.timing import time_arms
    from scripts.bench_decode import graph_timings

    return {a: [t.median_us / GRAPH_CALLS, t.min_us / GRAPH_CALLS, t.max_us / GRAPH_CALLS]
            for a, t in graph_timings(arms, GRAPH_CALLS, passes, time_arms).items()}


def plot(path: str, png: str):
    """One panel per shape: device us per call over M (cold where the run has it), ``nn.Linear`` and
    0.8x of it, the layers' path, the quantizer + kernel; lower is better. Returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run, rows = earlier_run(path, "probe_mx_decode")
    key = "us_cold" if all("us_cold" in r for r in rows) else "us"
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4.4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        mine = sorted((r for r in rows if r["shape"] == shape), key=lambda r: r["m"])
        ms = [r["m"] for r in mine]
        ax.plot(ms, [r[key][BASE][0] for r in mine], color="black", marker="o", label=BASE)
        ax.plot(ms, [0.8 * r[key][BASE][0] for r in mine], color="gray", linestyle="--", linewidth=0.8,
                label="0.8x nn.Linear (the target)")
        for arm, style in ((LAYERS, dict(color="tab:green", marker="x", linestyle="--")),
                           (CANDIDATE, dict(color="tab:purple", marker="s"))):
            have = [(r["m"], r[key][arm]) for r in mine if arm in r[key]]
            if have:
                x, t = zip(*have)
                ax.errorbar(x, [v[0] for v in t], yerr=[[v[0] - v[1] for v in t], [v[2] - v[0] for v in t]],
                            label=arm if arm != LAYERS else "decode_gemm (the layers' mxfp8 path today)", **style)
        decode_panel(ax, mine[0], key == "us_cold")
    return save_figure(fig, "mxfp8 decode over the fp8 weight", run, png)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if drew_an_earlier_run(argv, "probe_mx_decode", plot):
        return
    args = parse_args(argv)
    from cco.bench.timing import require_cuda

    require_cuda("probe_mx_decode")
    from kernels_fused.hopper import decode as D
    from kernels_fused.hopper import mx_decode as X
    from kernels_fused.hopper import native as NV
    from kernels_fused.hopper import vendor
    from kernels_fused.hopper.quantize import quantize_activation
    from scripts.bench_decode import COLD

    NV.ENABLED = False  # the Python path's launches, as a graph captures them
    dev = torch.device("cuda", torch.cuda.current_device())
    out_rows, t0 = [], time.time()
    for name in args.shapes:
        n, k, w, w_bf16 = shape_weight(name, dev)
        copies = []
        for seed in range(GRAPH_CALLS if args.cold else 1):  # --cold: a weight a call (seeds 1..)
            w_i, w_bf16_i = (w, w_bf16) if seed == 0 else shape_weight(name, dev, seed)[2:]
            wq_i, ws_i = Q.quantize_b(w_i, "mxfp8")
            X.check_scales(ws_i)
            copies.append((w_bf16_i, wq_i, ws_i, vendor.prepare_weight(wq_i, ws_i, "mxfp8").dense))
        wd = Q.dequantize_b(copies[0][1], copies[0][2], "mxfp8")
        for m in args.m:
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            q, sa = quantize_activation(x, "mxfp8", k_padded=k)
            ad = Q.dequantize_a(q, sa, "mxfp8")
            ref, dot_abs = ad @ wd.t(), ad.abs() @ wd.abs().t()
            launch = D._Launch(m, k, k, n, "mxfp8", False, dev.index, dense=True)
            rows_bf16 = torch.empty(launch.q_args[0][1], k, dtype=torch.bfloat16, device=dev)
            launch.quantize(dev.index, *launch._quantize(x, rows_bf16, rows_bf16, x.stride(0)))
            torch.cuda.synchronize()

            def arms_of(w_bf16, wq, ws, dense, x=x, m=m, rows=rows_bf16):
                out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
                arms = {BASE: lambda: torch.nn.functional.linear(x, w_bf16),
                        LAYERS: lambda: D.decode_gemm(x, dense, ws, "mxfp8", n=n),
                        CANDIDATE: lambda: D.decode_gemm(x, wq, ws, "mxfp8", n=n, scales_checked=True)}
                for s, p, tl in itertools.product([None, *args.slices],
                                                  [X.PREFETCH, *(p for p in args.prefetch if p != X.PREFETCH)],
                                                  [X.TILES, *(t for t in args.tiles if t != X.TILES)]):
                    label = (f"mx_decode s={s or 'default'}" + (f" p={p}" if p != X.PREFETCH else "")
                             + (f" t={tl}" if tl != X.TILES else ""))
                    arms[label] = lambda s=s, p=p, tl=tl: X.mx_decode_gemm(rows[:m], wq, ws, out=out, slices=s,
                                                                          prefetch=p, tiles=tl, checked=True)
                return arms

            arms = arms_of(*copies[0])
            _, bad, wrong, errors = checked_arms(arms, ref, dot_abs, f"{name} M={m}")
            cold = [arms_of(*c) for c in copies[1:]]
            for c in cold:  # (an arm dropped as wrong or failing is dropped from every copy)
                for a in list(c):
                    if a not in arms:
                        del c[a]
            both = timed({**arms, **{a + COLD: [fn] + [c[a] for c in cold] for a, fn in arms.items() if cold}},
                         args.passes)
            t = {a: v for a, v in both.items() if not a.endswith(COLD)}
            t_cold = {a.removesuffix(COLD): v for a, v in both.items() if a.endswith(COLD)}
            for label, times in (("", t), (" cold", t_cold)):
                if times:
                    base = times[BASE][0]
                    print(f"[{time.time() - t0:.0f} s] {name} M={m}{label}: " + " | ".join(
                        f"{a} {v[0]:.1f} ({v[1]:.1f}..{v[2]:.1f}; {v[0] / base:.2f}x)" for a, v in times.items()),
                        flush=True)
            out_rows.append({"shape": name, "n": n, "k": k, "m": m, "us": t, **({"us_cold": t_cold} if t_cold else {}),
                             "cold_weights": len(copies), "outside_budget": bad, "wrong": wrong, "errors": errors,
                             "default_slices": X.default_slices(n, k, torch.cuda.get_device_properties(dev)
                                                                .multi_processor_count)})
            with open(args.json, "w") as f:  # after every cell: a run cut short keeps what it timed
                json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "command": "python3 -m scripts.probe_mx_decode " + " ".join(argv),
                           "units": "device us per call: [median, fastest pass, slowest pass]",
                           "rows": out_rows}, f, indent=1)
    if any(r["wrong"] or r["errors"] for r in out_rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
