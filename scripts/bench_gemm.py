"""The GEMM alone on one GPU: gemm-only's GEMM, the own Triton kernels and the fused path's
producers against ``torch._scaled_mm`` (cuBLAS).

    python -m scripts.bench_gemm --quant ptpc -m 16384 -n 7168 -k 2048
    python -m scripts.bench_gemm --configs 128x256x3,128x256x4 --launch grid,ws,ticket,persistent
    python -m scripts.bench_gemm --quant blockscale --configs 128x128x3,64x128x3x4 --graph
    python -m scripts.bench_gemm --epilogue --graph
    python -m scripts.bench_gemm --quant ptpc,blockscale,mxfp8 -m 2048,4096,8192,16384,32768 --graph \
        --producer --json out.json --plot out.png
    python -m scripts.bench_gemm --from out.json,more.json --plot out.png    # the plot alone, no GPU

Default arms: the cuBLAS baseline(s), ``gemm-only`` (what mode gemm-only runs: the GEMM
``kernels_fused.hopper.gemm.PLAIN_RULE`` picks for the quant and M, the vendor one with the weight
prepared once as the CUDA backend keeps it) and ``triton`` (the own kernel, ``TRITON_PLAIN``).
``--producer`` times the fused copy-engine path's producers instead, each until every (dest,
chunk) counter of the call is released, on one GPU with the window local (the layout of rank 0 of
2, ``cco.backends.cuda``): ``kernel`` (the fused Triton launch, stores and release adds of every
tile), ``vendor xC`` (the vendor GEMM per row chunk into the row-major partial, each chunk's
counters released by stream write-values: ``cco.cuda.dma.CopyEngineSchedule.produce_by_chunks``,
C from ``--chunks``; the call's preamble included: counters zeroed, the (seq, M) stamp written;
``vendor xC 2 streams``: the chunk GEMMs dealt to two streams in turn, ``--producer-streams``),
``vendor xC GEMMs alone`` (the same calls without preamble or releases: what chunking costs) and
``vendor whole`` (the same GEMM in one call, the baseline). ``kernel`` is the launch alone. Ratios are
throughput against the baseline arm (``baseline`` in the JSON): cuBLAS fast accumulation for ptpc,
cuBLAS blockwise for blockscale, gemm-only's GEMM for mxfp8 (no cuBLAS recipe on Hopper);
``vendor whole`` with ``--producer``.

``--epilogue`` times the fused copy-engine launch instead (``fuse=True``, the CUDA backend's tile
table and config for rank 0 of 2, or each ``--configs`` entry with the layout's m-tile set to its
rows): ``fused stored`` stores every tile into the window's partial region; ``fused reduce-bf16`` /
``fused reduce-fp8`` reduce the own tiles in the epilogue (``kernels_fused.hopper.gemm.ReduceEpilogue``)
with the peer's chunks already flagged (zeros, so the own columns of ``out`` must equal the GEMM's),
which is what the epilogue costs the GEMM when it never waits.

Baseline arms: ``scaled_mm`` (cuBLAS: ptpc with default accumulation, blockscale with its blockwise
1x128 / 128x128 recipe; mxfp8 has no cuBLAS arm on Hopper) and ``scaled_mm-fast``
(``use_fast_accum=True``; ptpc only). Given ``--configs`` or ``--launch``, one Triton arm per
``--configs`` entry (``BMxBNxSTAGES[xWARPS]``, 8 warps unless given) and ``--launch`` style
(``GemmConfig.launch``: "grid" is the plain kernel, "ws" the persistent warp-specialized one;
"ticket" and "persistent" run the lsa kernel on a world of one, which shows what its tile walk
costs the GEMM; "cublas": the vendor GEMM); ``--configs default`` is the own kernel's plain config
(``TRITON_PLAIN``), launch included. Every arm's output is checked against the fp32 reference first
(``cco.bench.timing.gemm_mismatches``); a wrong arm posts no time, is listed as WRONG and the run
exits 1. Timing is ``cco.bench.timing.time_arms``
(arms alternate inside each pass, median over iterations, spread over passes; the ratio also pass by
pass, ``vs_baseline_paired``: its median and range over passes); each (quant, M)
ends in a line ``RESULT_JSON {...}``; ``--json`` writes them all in one file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch

from cco import quant as Q
from cco.bench.timing import (allreduce_mismatches, budget_terms, check_output_dirs, cublas_gemm, gemm_mismatches,
                              graphed, idle_check, per_pass_ratio, require_cuda, tflops, time_arms)


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integers") from None


def _quants(text: str) -> list[str]:
    quants = text.split(",")
    bad = [q for q in quants if q not in Q.QUANTS]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad} are not quant formats; pick from {', '.join(Q.QUANTS)}")
    return quants


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()).replace("``", ""))
    p.add_argument("--quant", type=_quants, default=["ptpc"], help="comma list of " + ", ".join(Q.QUANTS))
    p.add_argument("-m", type=_ints, default=[16384], help="comma list of row counts")
    p.add_argument("-n", type=int, default=7168)
    p.add_argument("-k", type=int, default=2048)
    p.add_argument("--configs", default="default", help="comma list of BMxBNxSTAGES, or 'default'")
    p.add_argument("--launch", default="default", help="comma list of grid, ws, ticket, persistent, cublas "
                   "(mxfp8); 'default': "
                   "each config's own")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rotate", type=int, default=3)
    p.add_argument("--epilogue", action="store_true", help="time the fused launch's epilogues (see above) instead "
                   "of the plain GEMM")
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replays (kernel time without the "
                   "host's launch cost) instead of eager calls")
    p.add_argument("--producer", action="store_true", help="time the fused path's producers (see above) instead "
                   "of the plain GEMM")
    p.add_argument("--chunks", type=_ints, default=[4, 8], help="--producer: row chunks of the vendor arms")
    p.add_argument("--producer-streams", type=_ints, default=[1, 2],
                   help="--producer: streams the vendor arms deal their chunk GEMMs to (CopyEngineSchedule."
                        "producer_streams), an arm each")
    p.add_argument("--json", help="write every (quant, M) result to this file")
    p.add_argument("--plot", help="write the ratios against the baseline per M to this PNG")
    p.add_argument("--from", dest="from_json", help="plot these --json files (comma list) instead of measuring")
    args = p.parse_args(argv)
    if args.from_json and not args.plot:
        p.error(f"--from {args.from_json} draws --plot from those files; pass --plot PNG (nothing to do without it)")
    if args.epilogue and args.producer:
        p.error("--epilogue and --producer time different arm sets; pick one")
    small = [f"{flag} {v}" for flag, vs in (("-m", args.m), ("-n", [args.n]), ("-k", [args.k])) for v in vs if v < 1]
    if small:
        p.error(f"{', '.join(small)}: sizes must be >= 1")
    if args.passes < 3 or args.iters < 1 or args.rotate < 1:
        p.error("--passes >= 3 (a spread needs them), --iters >= 1 and --rotate >= 1")
    from cco import layout
    from cco.cuda.dma import MAX_PRODUCER_STREAMS

    if not all(1 <= c <= layout.MAX_CHUNKS for c in args.chunks):
        p.error(f"--chunks {args.chunks}: each 1..{layout.MAX_CHUNKS}")
    if not all(1 <= s <= MAX_PRODUCER_STREAMS for s in args.producer_streams):
        p.error(f"--producer-streams {args.producer_streams}: each 1..{MAX_PRODUCER_STREAMS}")
    check_output_dirs(p, args, ("json", "plot"))
    return args


def triton_configs(spec: str, quant: str):
    from kernels_fused.hopper.gemm import TRITON_PLAIN, default_config

    if spec == "default":
        return [TRITON_PLAIN[quant]]
    configs = []
    for item in spec.split(","):
        try:
            bm, bn, stages, *warps = (int(x) for x in item.lower().split("x"))
            if len(warps) > 1:
                raise ValueError
        except ValueError:
            raise SystemExit(f"--configs: {item!r} is not BMxBNxSTAGES[xWARPS] (e.g. 128x256x3, 64x128x3x4)") from None
        # the quant's tile-kernel config with this tile (mxfp8 keeps its BLOCK_K of 64)
        configs.append(dataclasses.replace(default_config(quant), block_m=bm, block_n=bn, num_stages=stages,
                                           num_warps=warps[0] if warps else 8))
    return configs


def config_name(cfg) -> str:
    """``BMxBNxSTAGES``, with `` wWARPS`` where the config has other than 8 warps."""
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.num_stages}" + ("" if cfg.num_warps == 8 else f" w{cfg.num_warps}")


def epilogue_arms(args, sets, dev, kernel=None, *, stored_only=False):
    """The ``--epilogue`` arms: name -> (call(i), check(output of call(0), ref, dot_abs) -> bad elements).
    ``kernel``: a GemmConfig to launch instead of the backend's (the layout's m-tile follows its rows;
    the arms' names then carry it)."""
    from cco import layout
    from cco.backends.cuda import CudaBackend, fused_config, fused_table
    from kernels_fused.hopper.gemm import ReduceEpilogue, fp8_gemm

    world, rank = 2, 0
    block_m, block_n = CudaBackend.tile(args.quant) if kernel is None else (kernel.block_m, CudaBackend.block_n)
    cfg = layout.build_config(n=args.n, k=args.k, m_max=args.m, world=world, quant=args.quant,
                              block_m=block_m, block_n=block_n, chunks=args.layout_chunks)
    if kernel is None:
        gcfg, weight = fused_config(cfg)
    elif kernel.block_n in (block_n, 2 * block_n) and cfg.n_slice % kernel.block_n == 0:
        gcfg, weight = kernel, kernel.block_n // block_n
    else:
        raise SystemExit(f"--epilogue --configs: block_n={kernel.block_n} must be {block_n} or {2 * block_n} and "
                         f"divide the column slice {cfg.n_slice}")
    suffix = "" if kernel is None else f" {config_name(kernel)}"
    table = fused_table(cfg, m=args.m, rank=rank, dest_major=True, tile_weight=weight, device=dev)
    shape = (world, cfg.m_max_padded, cfg.n_slice)
    words = lambda n: torch.zeros(n, dtype=torch.int64, device=dev)  # noqa: E731
    partial, counters = torch.zeros(shape, dtype=torch.bfloat16, device=dev), words(world * layout.MAX_CHUNKS)
    flags = words(world * layout.MAX_CHUNKS)
    chunks = layout.call_chunks(cfg, args.m)
    flags[layout.counter_index(1, 0):layout.counter_index(1, chunks)] = 1  # the peer's chunks have landed
    own = slice(rank * cfg.n_slice, (rank + 1) * cfg.n_slice)

    def epilogue(fp8):
        return ReduceEpilogue(
            rank=rank, recv=torch.zeros(shape, dtype=torch.bfloat16, device=dev),
            gather=torch.zeros(shape, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device=dev),
            gather_scale=torch.zeros(world, cfg.m_max_padded, layout.gather_scale_cols(cfg.n_slice), device=dev)
            if fp8 else None, out=torch.zeros(args.m, args.n, dtype=torch.bfloat16, device=dev), scatter_flags=flags,
            scatter_m=words(world), stamp=words(1), status=words(1), ticket=words(1))

    def call(i, reduce=None):
        fp8_gemm(sets[i].a, sets[0].b, sets[i].a_scale, sets[0].b_scale, quant=args.quant, out=partial, fuse=True,
                 tile_table=table, counters=counters, tile_weight=weight, config=gcfg, reduce=reduce)
        return partial if reduce is None else reduce.out

    def stored_bad(out, ref, dot_abs):
        return gemm_mismatches(out.permute(1, 0, 2).reshape(cfg.m_max_padded, args.n)[:args.m], ref, dot_abs)

    arms = {f"fused stored{suffix}": (call, stored_bad)}
    for gather in () if stored_only else ("bf16", "fp8"):
        red = epilogue(gather == "fp8")
        arms[f"fused reduce-{gather}{suffix}"] = (
            lambda i, red=red: call(i, red),
            lambda out, ref, dot_abs, fp8=gather == "fp8": allreduce_mismatches(
                out[:, own], ref[:, own], ref[:, own].abs(), dot_abs[:, own], fp8_gather=fp8))
    return arms


def local_window(cfg, dev):
    """Every rank's window of ``cfg`` in this process's memory, as rank 0 (``cco.window.Window``):
    a producer writes the own window as in a call; nothing is sent."""
    from cco.window import Window

    class LocalWindow(Window):
        def __init__(self):
            super().__init__(comm=argparse.Namespace(rank=0, world=cfg.world), layout=cfg.window)
            self._bytes = [torch.zeros(cfg.window.nbytes, dtype=torch.uint8, device=dev) for _ in range(cfg.world)]

        @property
        def device(self):
            return dev

        def _raw(self, rank):
            return self._bytes[rank]

        def _release(self):
            self._bytes = []

    return LocalWindow()


def producer_arms(args, sets, dev):
    """The ``--producer`` arms: name -> (call(i), check(output of call(0), ref, dot_abs) -> bad elements)."""
    from cco import layout
    from cco.backends.cuda import CudaBackend
    from cco.cuda.dma import CopyEngineSchedule
    from kernels_fused.hopper import vendor

    arms = {"kernel": epilogue_arms(args, sets, dev, stored_only=True)["fused stored"]}
    weight = vendor.prepare_weight(sets[0].b, sets[0].b_scale, args.quant)  # as the backend keeps it
    whole = torch.empty(args.m, args.n, dtype=torch.bfloat16, device=dev)
    arms["vendor whole"] = (lambda i: vendor.vendor_gemm(sets[i].a, sets[i].a_scale, weight, out=whole),
                            gemm_mismatches)
    block_m, block_n = CudaBackend.tile(args.quant)
    for chunks in args.chunks:
        cfg = layout.build_config(n=args.n, k=args.k, m_max=args.m, world=2, quant=args.quant, block_m=block_m,
                                  block_n=block_n, chunks=chunks)
        window = local_window(cfg, dev)
        rows = window.tensor(cfg.window.partial, rank=0).view(cfg.m_max_padded, cfg.n)
        plan = layout.plan_call(cfg, m=args.m, seq=1, rank=0, counter_base=layout.zero_counters(2))
        for streams in args.producer_streams:
            sched = CopyEngineSchedule(config=cfg, window=window, device=dev)
            sched.producer_streams = streams

            def call(i, sched=sched, rows=rows, plan=plan):
                sched.counters.zero_()  # as the backend does at each call's start
                sched.begin(plan)
                sched.produce_by_chunks(plan, vendor.row_chunks(sets[i].a, sets[i].a_scale, weight, out=rows,
                                                                rows=plan.rows))
                return rows

            def check(out, ref, dot_abs, sched=sched, plan=plan):
                torch.cuda.synchronize()
                counted = sched.counters.view(2, layout.MAX_CHUNKS).tolist()
                wrong = sum(counted[d][c] != plan.target(d, c) for d in range(2) for c in range(layout.MAX_CHUNKS))
                return gemm_mismatches(out[:args.m], ref, dot_abs) + wrong

            arms[f"vendor x{plan.chunks}" + ("" if streams == 1 else f" {streams} streams")] = (call, check)
        if chunks == args.chunks[0]:  # what the chunking alone costs: the same calls, nothing released

            def gemms(i, rows=rows, plan=plan):
                run = vendor.row_chunks(sets[i].a, sets[i].a_scale, weight, out=rows, rows=plan.rows)
                for c in range(plan.chunks):
                    run(c)
                return rows

            arms[f"vendor x{plan.chunks} GEMMs alone"] = (gemms, lambda out, ref, dot_abs: gemm_mismatches(
                out[:args.m], ref, dot_abs))
    return arms


def plain_arms(args, sets, dev):
    """The default arms besides cuBLAS: name -> call(i)."""
    from kernels_fused.hopper import vendor
    from kernels_fused.hopper.gemm import TRITON_PLAIN, default_config, fp8_gemm

    b, b_s = sets[0].b, sets[0].b_scale
    arms = {}
    rule = default_config(args.quant, plain=True, m=args.m, k=args.k)  # k: cuBLAS's blockwise K rule too
    if rule.launch == "cublas":  # the CUDA backend's path: the weight prepared once
        weight = vendor.prepare_weight(b, b_s, args.quant)
        out = torch.empty(args.m, args.n, dtype=torch.bfloat16, device=dev)
        arms["gemm-only"] = lambda i: vendor.vendor_gemm(sets[i].a, sets[i].a_scale, weight, out=out,
                                                         fast_accum=not rule.precise_acc)
    else:
        arms["gemm-only"] = lambda i: fp8_gemm(sets[i].a, b, sets[i].a_scale, b_s, quant=args.quant, config=rule)
    own = TRITON_PLAIN[args.quant]
    arms["triton"] = lambda i: fp8_gemm(sets[i].a, b, sets[i].a_scale, b_s, quant=args.quant, config=own)
    return arms


def run_one(args, dev) -> dict:
    """Every arm at one (quant, M): checked, timed, printed; returns the result record."""
    from kernels_fused.hopper.gemm import fp8_gemm

    sets = [Q.random_problem(args.m, args.n, args.k, args.quant, seed=i, device=dev) for i in range(args.rotate)]
    b, b_s = sets[0].b, sets[0].b_scale
    arms, checks = {}, {}
    if args.epilogue or args.producer:
        kernels = [None] if args.configs == "default" or args.producer else triton_configs(args.configs, args.quant)
        for kernel in kernels:
            found = producer_arms(args, sets, dev) if args.producer else epilogue_arms(args, sets, dev, kernel)
            for name, (run, check) in found.items():
                arms[name], checks[name] = run, check
    for name, fast in () if args.epilogue or args.producer else (("scaled_mm", False), ("scaled_mm-fast", True)):
        if fast and args.quant != "ptpc":
            continue  # blockscale's blockwise recipe has no fast-accumulation variant
        fn, why = cublas_gemm(args.quant, b, b_s, fast_accum=fast)
        if fn is None:
            print(f"no {name} arm: {why}")
            continue
        arms[name] = lambda i, fn=fn: fn(sets[i].a, sets[i].a_scale)
    if not (args.epilogue or args.producer):
        arms.update(plain_arms(args, sets, dev))
    launches = [x.strip() for x in args.launch.split(",")]
    if launches != ["default"] and not set(launches) <= {"grid", "ws", "ticket", "persistent", "cublas"}:
        raise SystemExit(f"--launch {args.launch!r}: pick from grid, ws, ticket, persistent, cublas (or default)")
    extra = args.configs != "default" or launches != ["default"]
    for cfg in triton_configs(args.configs, args.quant) if extra and not (args.epilogue or args.producer) else []:
        for launch in ([cfg.launch] if launches == ["default"] else launches):
            cfg_l = dataclasses.replace(cfg, launch=launch)
            name = "cublas (vendor)" if launch == "cublas" else f"triton {config_name(cfg)} {launch}"
            arms[name] = (lambda i, cfg_l=cfg_l: fp8_gemm(sets[i].a, b, sets[i].a_scale, b_s, quant=args.quant,
                                                           config=cfg_l))

    ref, dot_abs = budget_terms(sets[0])
    checked = {}
    for name in list(arms):
        bad = checks.get(name, gemm_mismatches)(arms[name](0), ref, dot_abs)
        checked[name] = bad
        if bad:
            print(f"{name}: {bad} elements outside the GEMM budget; not timed")
            arms.pop(name)
    del ref, dot_abs
    timed = graphed(arms, args.rotate)[0] if args.graph else arms
    timings = time_arms(timed, passes=args.passes, iters=args.iters, rotate=args.rotate)
    baseline = next((n for n in ("vendor whole", "scaled_mm-fast", "scaled_mm", "gemm-only") if n in timings), None)
    base = timings.get(baseline)
    print(f"[{args.m}, {args.n}] K={args.k} {args.quant} on {torch.cuda.get_device_name()}, "
          f"{'graph replays' if args.graph else 'eager calls'}" + (f"; ratios against {baseline}" if base else ""))
    rows = {}
    for name, t in timings.items():
        row = t.as_dict()
        row["tflops"] = round(tflops(args.m, args.n, args.k, t.median_us), 1)
        ratio = ""
        if base:
            row["vs_baseline"] = round(base.median_us / t.median_us, 3)
            # the same ratio pass by pass (the arms of a pass run back to back): the card's clocks
            # drift between passes by more than the arms differ, and a pass's ratio cancels the drift
            med, lo, hi = per_pass_ratio(base.pass_us, t.pass_us)
            row["vs_baseline_paired"] = round(med, 3)
            row["vs_baseline_paired_range"] = [round(lo, 3), round(hi, 3)]
            ratio = f" | {row['vs_baseline']:.3f}x {baseline}, pass by pass {med:.3f}x ({lo:.3f}-{hi:.3f})"
        rows[name] = row
        print(f"  {name:32s} {t.median_us:8.1f} us (spread {100 * t.spread:4.1f}%) | {row['tflops']:7.1f} TFLOP/s{ratio}")
    for name, bad in checked.items():  # the dropped arms, in the table too: a wrong arm never vanishes
        if bad:
            print(f"  {name:32s} WRONG, not timed: {bad} elements outside the GEMM budget")
    payload = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": torch.cuda.get_device_name(),
               "m": args.m, "n": args.n, "k": args.k, "quant": args.quant, "graph": args.graph,
               "kind": "producer" if args.producer else "epilogue" if args.epilogue else "plain", "baseline": baseline,
               "arms": rows, "bad_elements": checked}
    print("RESULT_JSON " + json.dumps(payload), flush=True)
    return payload


def plot(runs: list[dict], path: str) -> None:
    """A row of panels per kind of run (plain, producer, ...), a column per quant: each arm's throughput
    against the run's baseline over M (pass by pass where the run has it: median and range)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({r["kind"] for r in runs}, key=["plain", "producer", "epilogue"].index)
    quants = [q for q in Q.QUANTS if any(r["quant"] == q for r in runs)]
    fig, axes = plt.subplots(len(kinds), len(quants), figsize=(5 * len(quants), 3.8 * len(kinds)), squeeze=False)
    for row, kind in enumerate(kinds):
        for ax, quant in zip(axes[row], quants):
            mine = sorted((r for r in runs if (r["kind"], r["quant"]) == (kind, quant)), key=lambda r: r["m"])
            if not mine:
                ax.set_visible(False)
                continue
            names = [n for n in mine[0]["arms"] if all("vs_baseline" in r["arms"].get(n, {}) for r in mine)]
            for name in names:  # the pass-by-pass ratio and its range where the run has it
                rows = [r["arms"][name] for r in mine]
                y = [a.get("vs_baseline_paired", a["vs_baseline"]) for a in rows]
                spans = [a.get("vs_baseline_paired_range", [v, v]) for v, a in zip(y, rows)]
                ax.errorbar([r["m"] for r in mine], y, yerr=[[v - lo for v, (lo, _) in zip(y, spans)],
                                                             [hi - v for v, (_, hi) in zip(y, spans)]],
                            marker="o", capsize=2, label=name)
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("M (N=%d, K=%d)" % (mine[0]["n"], mine[0]["k"]))
            ax.set_ylabel(f"throughput vs {mine[0]['baseline']}")
            what = "producer: until every counter is released" if kind == "producer" else f"{kind} GEMM"
            ax.set_title(f"{quant}, {what}", fontsize=10)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def runs_from_json(paths: str, *, who: str = "bench_gemm", keys=("kind", "quant", "m", "arms")) -> list[dict]:
    """The records of the ``--json`` files ``paths`` (a comma list), in order: ``--from``'s input. A
    file that is missing, not JSON, or not ``who``'s ``--json`` (an object whose "runs" are records
    with ``keys``) is a one-line ``SystemExit`` naming it."""
    runs = []
    for path in paths.split(","):
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as err:
            raise SystemExit(f"{who}: --from {path}: {err}") from None
        records = doc.get("runs") if isinstance(doc, dict) else None
        if not isinstance(records, list) or not all(isinstance(r, dict) and all(k in r for k in keys)
                                                    for r in records):
            raise SystemExit(f"{who}: --from {path}: not a {who} --json (expected an object whose 'runs' are "
                             f"records with {', '.join(keys)})")
        runs += records
    return runs


def failures(runs: list[dict]) -> list[str]:
    """Every arm of ``runs`` (``run_one``'s records) whose output check failed: ``"<quant> M=<m> <arm>: ..."``."""
    return [f"{r['quant']} M={r['m']} {name}: {bad} elements outside the GEMM budget"
            for r in runs for name, bad in r.get("bad_elements", {}).items() if bad]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        plot(runs_from_json(args.from_json), args.plot)  # (parse_args: --from needs --plot)
        return 0
    require_cuda("bench_gemm")
    dev = torch.device("cuda", torch.cuda.current_device())
    idle_before = idle_check()  # the device idle around the whole sweep (each check waits ~1 s)
    runs = []
    for quant in args.quant:
        for m in args.m:
            runs.append(run_one(argparse.Namespace(**{**vars(args), "quant": quant, "m": m, "layout_chunks": None}),
                                dev))
    idle_after = idle_check()
    print(f"idle before: {idle_before}; after: {idle_after}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python3 -m scripts.bench_gemm " + " ".join(sys.argv[1:] if argv is None else argv),
                       "idle_before": idle_before, "idle_after": idle_after, "runs": runs}, f, indent=1)
    if args.plot:
        plot(runs, args.plot)
    failed = failures(runs)
    if failed:  # after the JSON and the plot: what was measured is kept, the run still fails
        print("bench_gemm: FAILED, not timed: " + "; ".join(failed), file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
