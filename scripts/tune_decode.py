"""Tune and check the decode GEMM (``kernels_fused.hopper.decode``) on one NVIDIA GPU.

    python3 -m scripts.tune_decode --json tune.json --plot tune.png
    python3 -m scripts.tune_decode --from tune.json --plot tune.png      # the plot alone, no GPU

Per shape (``--shapes``: the decode-time linears of Llama-3-8B and -70B, row- and column-parallel
ones), M (``-m``) and quant: the device time per call under CUDA-graph replay (``--graph-calls``
calls per graph, ``cco.bench.timing.time_arms``) of every config of ``CONFIGS`` (``BLOCK_N``,
``BLOCK_K``, warps, stages), of bf16 ``nn.Linear`` (``F.linear``) and of the two-launch path it
replaces (the activation quantizer, then the op's vendor GEMM); the best config per (quant, M
range) is what ``decode.py``'s constants should hold. Before timing, every (shape, M, quant) is
checked against the fp32 product of the quantizer's operands (``cco.bench.timing.gemm_mismatches``:
no output outside the fp8 GEMM's error budget) and the kept launches (``kernels_fused.hopper.launch``)
against ``JITFunction.run``'s (bit for bit). ``--host`` adds the host us per eager call of
``F.linear``, the decode GEMM, and the layer (``RowParallelLinear``, world 1) with the decode GEMM
and with the two launches it replaces, each with the kept launches and through ``JITFunction.run``,
and for ptpc the decode GEMM's one launch against its two (``decode.ONE_LAUNCH``), at the first
shape, every M, with each layer arm's device time per eager call (the profiler's kernel time:
no launch gaps) (``host_costs``). ``--host-only``: that table alone, at every shape of ``--shapes``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time

import torch

from scripts._cli import ints

SHAPES = {  # name: (N, K)
    "8b-down-tp1": (4096, 14336), "8b-o-tp1": (4096, 4096), "8b-gateup-tp1": (28672, 4096),
    "8b-qkv-tp1": (6144, 4096), "8b-down-tp8": (4096, 1792), "70b-down-tp1": (8192, 28672),
    "70b-o-tp8": (8192, 1024),
    # transformers' Llama keeps q/k/v and gate/up as separate linears: the shapes its decode step calls
    "8b-gate-tp1": (14336, 4096), "8b-kv-tp1": (1024, 4096),
    # and its k/v_proj at TP 2 and 8 (column-parallel: the decode GEMM at any world), 8 and 2 blocks of 64
    "8b-kv-tp2": (512, 4096), "8b-kv-tp8": (128, 4096),
    # the row-parallel layers at TP 2 and 8 (o_proj, down_proj: K sharded), what a world >= 2 decode call runs
    "8b-o-tp2": (4096, 2048), "8b-down-tp2": (4096, 7168), "70b-o-tp2": (8192, 4096), "70b-down-tp2": (8192, 14336),
    "8b-o-tp8": (4096, 512), "70b-down-tp8": (8192, 3584),
}


def shape_weight(name: str, device, seed: int = 0) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """``(N, K, w, w_bf16)`` of the ``SHAPES`` entry ``name``: an fp32 weight of unit-variance rows
    over sqrt(K) on ``device`` (seeded: every run times the same weight) and its bf16 copy."""
    from scripts.bench_decode import seeded_weight

    n, k = SHAPES[name]
    w = seeded_weight(n, k, seed).to(device)
    return n, k, w, w.to(torch.bfloat16)


def configs(quant: str, m: int = 1):
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) tried for ``quant`` at ``m`` rows: the one-row
    kernel's, the rows kernel's (2..ROWS_MAX rows; blockscale steps one 128-column scale group), or
    the wide MMA's (ROWS_MAX+1..MMA_ROWS_MAX rows, quants that quantize the rows first)."""
    from kernels_fused.hopper import decode as D

    if D.ROWS_MAX < m <= D.rows_max(quant):
        return list(itertools.product((32, 64), (128, 256), (4, 8), (4,)))
    if 1 < m <= D.ROWS_MAX:
        return list(itertools.product((16, 32, 64), (128,) if quant == "blockscale" else (128, 256), (4,), (4,)))
    return list(itertools.product((8, 16, 32), (512, 1024), (4, 8), (3,)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("-m", type=ints, default="1,2,4,8")
    p.add_argument("--quant", default="ptpc,blockscale,mxfp8")
    p.add_argument("--graph-calls", type=int, default=10)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--host", action="store_true")
    p.add_argument("--host-only", action="store_true", help="only --host's table, at every shape of --shapes")
    p.add_argument("--json")
    p.add_argument("--plot", help="a PNG: each shape's device time over M, per quant, against bf16 and two launches")
    p.add_argument("--from", dest="from_json", help="plot a --json of an earlier run (no GPU; needs --plot)")
    a = p.parse_args(argv)
    if a.from_json and not a.plot:  # --from only draws: without --plot it would do nothing and exit 0
        p.error(f"--from {a.from_json} draws --plot from an earlier run's --json: pass --plot")
    from cco.bench.timing import check_output_dirs

    check_output_dirs(p, a, ("json", "plot"))  # now, not after the sweep
    a.shapes = a.shapes.split(",")
    a.quant = a.quant.split(",")
    a.host = a.host or a.host_only
    return a


def checked_arms(arms: dict, ref, dot_abs, where: str, unchecked=("nn.Linear bf16",)) -> tuple:
    """Each arm of a decode probe run twice before it is timed: ``(outputs, mismatches, wrong,
    errors)``. An arm that raises (a config that does not compile) is printed as ERROR, kept in
    ``errors`` and removed from ``arms``; one with outputs outside the fp8 GEMM's budget
    (``gemm_mismatches`` against the fp32 ``ref``) or other bits on its repeat is printed as WRONG,
    listed in ``wrong`` and removed. ``unchecked`` arms (the bf16 baseline) are only run. ``where``
    opens each printed line."""
    from cco.bench.timing import gemm_mismatches

    outs, bad, wrong, errors = {}, {}, [], {}
    for label, fn in list(arms.items()):
        try:
            got = fn().clone()
            again = fn().clone()
            torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001 - reported; the other arms still run
            errors[label] = f"{type(err).__name__}: {str(err)[:160]}"
            print(f"{where} {label}: ERROR {errors[label]}", flush=True)
            del arms[label]
            continue
        outs[label] = got
        if label in unchecked:
            continue
        bad[label] = gemm_mismatches(got, ref, dot_abs)
        if bad[label] or not torch.equal(got, again):
            wrong.append(label)
            print(f"{where} {label}: WRONG, {bad[label]} outside the budget, repeat equal {torch.equal(got, again)}",
                  flush=True)
            del arms[label]
    return outs, bad, wrong, errors


def graph_us(arms: dict, calls: int, passes: int) -> dict:
    """Device us per call of each arm: a CUDA graph of ``calls`` calls replayed (bench_decode's)."""
    from cco.bench.timing import time_arms
    from scripts.bench_decode import graph_device_us

    return graph_device_us(arms, argparse.Namespace(graph_calls=calls, passes=passes), time_arms)


def with_config(cfg, quant, m: int = 1):
    """Set ``decode.py``'s constants to ``cfg`` for ``quant`` (new launches only): the one-row
    kernel's at one row, the rows kernel's at more."""
    from kernels_fused.hopper import decode as D

    for table, value in zip(D.tables(quant, m), cfg):
        table[quant] = value
    D._LAUNCHES.clear()


def best_configs(rows: list) -> dict:
    """Per quant and kernel (``row``: one row; ``rows``: 2..ROWS_MAX; ``wide``: past it), the config
    timed at every cell (shape, M) of that kernel with the least geometric mean of its device time
    over bf16's: what ``decode.py``'s tables for it should hold."""
    from kernels_fused.hopper import decode as D

    ratios: dict = {}
    for r in rows:
        if "us" not in r:
            continue
        kernel = "row" if r["m"] == 1 else "rows" if r["m"] <= D.ROWS_MAX else "wide"
        for arm, us in r["us"].items():
            if arm.startswith("decode "):
                ratios.setdefault((r["quant"], kernel), {}).setdefault(arm[len("decode "):], []).append(
                    us / r["us"]["nn.Linear bf16"])
    best = {}
    for (quant, kernel), per in ratios.items():
        cells = max(len(v) for v in per.values())
        mean = {cfg: statistics.geometric_mean(v) for cfg, v in per.items() if len(v) == cells}
        cfg = min(mean, key=mean.get)
        best[f"{quant} {kernel}"] = {"config": cfg, "ratio": mean[cfg], "cells": cells}
    return best


def earlier_run(path: str, script: str) -> tuple[dict, list]:
    """``(run, rows)`` of a decode probe's ``--json`` at ``path`` (its ``--from``), or one line naming
    ``script`` and what is wrong (SystemExit) where the file is not such a run (rows of a shape each)."""
    try:
        with open(path) as f:
            run = json.load(f)
        rows = run["rows"]
        if not all(isinstance(r, dict) and "shape" in r for r in rows):
            raise ValueError("a row without its shape")
        return run, rows
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SystemExit(f"{script}: --from {path}: not this probe's JSON ({err})") from None


def decode_panel(ax, row: dict, cold: bool, fontsize: int = 10) -> None:
    """A decode probe's panel of one shape (``row``: one of its records): title, M on a log2 axis,
    device us per call from zero (cold: each call of the graph on its own weight), legend."""
    ax.set_title(f"{row['shape']} (N {row['n']}, K {row['k']})", fontsize=fontsize)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (rows of the call)")
    ax.set_ylabel(f"device us per call, graph replay{', cold' if cold else ''} (lower is better)",
                  fontsize=fontsize - 2)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=6)


def save_figure(fig, title: str, run: dict, png: str):
    """``fig`` titled ``title`` with the run's GPU and date, saved to ``png``; returned."""
    fig.suptitle(f"{title}, {run.get('gpu', '')}, {run.get('date', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    return fig


def plot(out: dict, path: str) -> None:
    """One panel per shape: device us per call over M (log-log) of bf16 ``F.linear``, and per quant
    the two launches (dashed) and the decode GEMM's best config (solid); lower is better."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in out["rows"] if "best_us" in r]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, max(1, len(shapes)), figsize=(6 * max(1, len(shapes)), 4.5), squeeze=False)
    colors = {"ptpc": "tab:blue", "blockscale": "tab:orange", "mxfp8": "tab:green"}
    for ax, shape in zip(axes[0], shapes):
        mine = [r for r in rows if r["shape"] == shape]
        bf16 = {}
        for r in mine:
            bf16.setdefault(r["m"], r["us"]["nn.Linear bf16"])
        ms = sorted(bf16)
        ax.plot(ms, [bf16[m] for m in ms], color="black", marker="o", label="nn.Linear bf16")
        for quant in dict.fromkeys(r["quant"] for r in mine):
            q = sorted((r for r in mine if r["quant"] == quant), key=lambda r: r["m"])
            ax.plot([r["m"] for r in q], [r["us"]["quantizer + vendor GEMM"] for r in q], color=colors.get(quant),
                    linestyle="--", marker="x", label=f"{quant}: quantizer + vendor GEMM")
            ax.plot([r["m"] for r in q], [r["best_us"] for r in q], color=colors.get(quant), marker="s",
                    label=f"{quant}: decode GEMM")
        r0 = mine[0]
        ax.set_title(f"{shape} (N {r0['n']}, K {r0['k']})", fontsize=10)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("M (rows of the call)")
        ax.set_ylabel("device us per call, graph replay (lower is better)")
        ax.legend(fontsize=7)
    fig.suptitle(f"decode GEMM, {out.get('gpu', '')}, {out.get('date', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def load_run(path: str) -> dict:
    """The ``--json`` of an earlier run, or one line why not (no file, not JSON, or not this script's:
    an object whose ``rows`` hold the plot's keys) rather than a traceback."""
    try:
        with open(path) as f:
            out = json.load(f)
    except (OSError, ValueError) as err:
        raise SystemExit(f"tune_decode: --from {path}: {err}") from None
    drawn = ("shape", "n", "k", "m", "quant", "us", "best_us")  # the keys plot reads of a timed row
    rows = out.get("rows") if isinstance(out, dict) else None
    if not isinstance(rows, list) or not all(
            isinstance(r, dict) and ("best_us" not in r or all(key in r for key in drawn)) for r in rows):
        what = "a dict without them" if isinstance(out, dict) else f"a {type(out).__name__}"
        raise SystemExit(f"tune_decode: --from {path}: not a tune_decode --json (an object with 'rows' of "
                         f"{', '.join(drawn)}), {what}")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:  # the plot of an earlier run (parse_args made sure --plot is given): no GPU
        plot(load_run(args.from_json), args.plot)
        return 0
    from cco.bench.timing import require_cuda

    require_cuda("tune_decode")  # after --from, which needs no GPU, and after parsing (--help)
    from cco import quant as Q
    from cco.bench.timing import gemm_mismatches
    from kernels_fused.hopper import decode as D
    from kernels_fused.hopper import native as NV
    from kernels_fused.hopper import vendor
    from kernels_fused.hopper.quantize import quantize_activation
    from scripts.bench_decode import slow_launches

    dev = torch.device("cuda")
    # the sweep runs the Python path's launches: the C++ table would replay a call shape's first
    # config whatever config is set (and leave no kept launch to time)
    every = (*D.tables("ptpc", 1), *D.tables("ptpc", 2), *D.tables("ptpc", D.MMA_ROWS_MAX))
    defaults = tuple(dict(table) for table in every)
    native_enabled, NV.ENABLED = NV.ENABLED, False
    try:
        out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": torch.cuda.get_device_name(),
               "command": "python3 -m scripts.tune_decode " + " ".join(sys.argv[1:] if argv is None else argv),
               "torch": torch.__version__, "rows": [], "checks": [], "host": {}}
        failures = 0
        for name in [] if args.host_only else args.shapes:
            n, k, w, w_bf16 = shape_weight(name, dev)
            for quant in args.quant:
                wq, ws = Q.quantize_b(w, quant)
                vw = vendor.prepare_weight(wq, ws, quant)
                for m in args.m:
                    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
                    # restore the defaults for the checks
                    for table, saved in zip(every, defaults):
                        table.update(saved)
                    D._LAUNCHES.clear()
                    a, s = quantize_activation(x, quant, k_padded=k)
                    ad, wd = Q.dequantize_a(a, s, quant), Q.dequantize_b(wq, ws, quant)
                    ref, dot_abs = ad @ wd.t(), ad.abs() @ wd.abs().t()
                    got = D.decode_gemm(x, wq, ws, quant, n=n)
                    got2 = D.decode_gemm(x, wq, ws, quant, n=n)  # through the kept launches
                    D._LAUNCHES.clear()
                    slow = slow_launches(lambda x=x, wq=wq, ws=ws, quant=quant: D.decode_gemm(x, wq, ws, quant, n=n))()
                    check = {"shape": name, "m": m, "quant": quant, "outside_budget": gemm_mismatches(got, ref, dot_abs),
                             "rel_l2": float((got.float() - ref).norm() / ref.norm()),
                             "fast_equals_jit": bool(torch.equal(got2, slow)), "repeat_equal": bool(torch.equal(got, got2))}
                    ok = check["outside_budget"] == 0 and check["fast_equals_jit"] and check["repeat_equal"]
                    failures += not ok
                    out["checks"].append(check)
                    print(("ok  " if ok else "BAD ") + json.dumps(check), flush=True)
                    arms = {"nn.Linear bf16": lambda: torch.nn.functional.linear(x, w_bf16)}
                    rows_v = vendor.padded_rows(quant, m)

                    def two_launches(x=x, quant=quant, rows_v=rows_v, vw=vw):
                        a, s = quantize_activation(x, quant, k_padded=k, m_padded=rows_v)
                        return vendor.vendor_gemm(a, s, vw)
                    arms["quantizer + vendor GEMM"] = two_launches
                    for cfg in configs(quant, m):
                        with_config(cfg, quant, m)
                        try:
                            D.decode_gemm(x, wq, ws, quant, n=n)
                            torch.cuda.synchronize()
                        except Exception as err:  # a config that does not compile (resources): recorded
                            out["rows"].append({"shape": name, "m": m, "quant": quant, "config": cfg,
                                                "error": f"{type(err).__name__}: {str(err)[:200]}"})
                            continue
                        launch = D._LAUNCHES[next(iter(D._LAUNCHES))]
                        arms[f"decode {cfg}"] = (lambda launch=launch, x=x, wq=wq, ws=ws, n=n, m=m: launch(
                            x, x.stride(0), wq, ws, None, torch.empty(m, n, dtype=torch.bfloat16, device=dev)))
                    timed = graph_us(arms, args.graph_calls, args.passes)
                    best = min((v, a) for a, v in timed.items() if a.startswith("decode"))
                    row = {"shape": name, "n": n, "k": k, "m": m, "quant": quant, "us": timed, "best": best[1],
                           "best_us": best[0]}
                    out["rows"].append(row)
                    base = timed["nn.Linear bf16"]
                    print(f"{name:14s} M={m:3d} {quant:10s} bf16 {base:6.1f} | two launches "
                          f"{timed['quantizer + vendor GEMM']:6.1f} | best decode {best[0]:6.1f} ({best[0] / base:.2f}x) "
                          f"{best[1]}", flush=True)
    finally:  # (also where the sweep raises: the caller's settings and the C++ path back)
        for table, saved in zip(every, defaults):
            table.update(saved)
        D._LAUNCHES.clear()
        NV.ENABLED = native_enabled
    out["best_configs"] = best_configs(out["rows"])
    for name, best in out["best_configs"].items():
        print(f"best {name}: {best['config']} ({best['ratio']:.3f}x of bf16, geometric mean over {best['cells']} "
              f"cells)", flush=True)
    if args.host:
        out["host"] = host_costs(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot:
        plot(out, args.plot)
    print(f"checks: {len(out['checks']) - failures} ok, {failures} bad", flush=True)
    return 1 if failures else 0


def host_costs(args) -> dict:
    """Host us per eager call (200 back to back, median of 5 passes) at the first shape (every shape
    with ``--host-only``) and every M of ``-m``: ``F.linear`` bf16; the decode GEMM, the layer
    (``RowParallelLinear``, world 1) with the decode GEMM taking every M (``decode_rows`` forced)
    and with it off (quantizer + vendor GEMM), each with the kept launches and through
    ``JITFunction.run`` (``FAST_LAUNCH`` off), and for ptpc's rows the layer with the two launches
    instead of the one (``decode.ONE_LAUNCH`` off), in the same passes; then each arm's device us
    per eager call (``device_us``)."""
    import os
    import tempfile

    from cco import quant as Q
    from cco.bench.timing import time_back_to_back
    from cco.comm import Communicator
    from cco.nn import RowParallelLinear
    from kernels_fused.hopper import decode as D
    from scripts.bench_decode import JIT_ARM, slow_launches, switched_off

    dev = torch.device("cuda", torch.cuda.current_device())
    res = {}
    rendezvous = os.path.join(tempfile.mkdtemp(), "rendezvous")
    comm = Communicator(rank=0, world=1, init_method=f"file://{rendezvous}", device=dev)
    for name in args.shapes if args.host_only else args.shapes[:1]:
        n, k = SHAPES[name]
        w = (torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16)
        for quant in args.quant:
            wq, ws = Q.quantize_b(w.float(), quant)
            layer = RowParallelLinear(k, n, group=comm, quant=quant, m_max=256)
            layer.load_weight(w)
            cell = res.setdefault(name, {}).setdefault(quant, {}) if args.host_only else res.setdefault(quant, {})
            for m in args.m:
                x = torch.randn(m, k, device=dev).to(torch.bfloat16)

                def with_rows(rows, layer=layer, x=x):
                    layer.decode_rows = rows
                    return layer(x)

                arms = {"F.linear bf16": lambda x=x: torch.nn.functional.linear(x, w)}
                for kept, how in ((lambda fn: fn, ""), (slow_launches, f" {JIT_ARM}")):  # kept launches on, then off
                    arms[f"decode_gemm{how}"] = kept(lambda wq=wq, ws=ws, quant=quant, x=x: D.decode_gemm(
                        x, wq, ws, quant, n=n))
                    arms[f"layer, decode GEMM{how}"] = kept(lambda m=m: with_rows(m))
                    arms[f"layer, two launches{how}"] = kept(lambda: with_rows(0))
                if quant in D.QUANTIZED_ROWS and 1 < m <= D.rows_max(quant):
                    arms["layer, decode GEMM, ONE_LAUNCH off"] = switched_off(lambda m=m: with_rows(m), D, "ONE_LAUNCH")
                with torch.no_grad():
                    t = time_back_to_back(arms, calls=200, passes=5)
                    device = {a: device_us(fn) for a, fn in arms.items() if JIT_ARM not in a}
                cell[m] = {a: {"host_us": v["host_us"], "wall_us": v["wall_us"], "device_us": device.get(a)}
                           for a, v in t.items()}
                print(f"host {name} {quant} M={m} " + json.dumps({a: round(v["host_us"], 1) for a, v in t.items()}) +
                      " device " + json.dumps({a: round(v, 1) for a, v in device.items()}), flush=True)
            layer.close()
    comm.close()
    return res


def device_us(fn, calls: int = 50) -> float:
    """Device us per eager call of ``fn``: the kernels' time the profiler records over ``calls``
    calls (CUPTI), divided by ``calls``; the gaps between launches are not in it."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls


if __name__ == "__main__":
    sys.exit(main())
