"""The GEMM alone on one GPU: the Triton fp8 kernel (``fuse=False``) against ``torch._scaled_mm``.

    python -m scripts.bench_gemm --quant ptpc -m 16384 -n 7168 -k 2048
    python -m scripts.bench_gemm --configs 128x256x3,128x256x4 --launch grid,ws,ticket,persistent
    python -m scripts.bench_gemm --quant blockscale --configs 128x128x3,64x128x3x4 --graph
    python -m scripts.bench_gemm --epilogue --graph

``--epilogue`` times the fused copy-engine launch instead (``fuse=True``, the CUDA backend's tile
table and config for rank 0 of 2, or each ``--configs`` entry with the layout's m-tile set to its
rows): ``fused stored`` stores every tile into the window's partial region; ``fused reduce-bf16`` /
``fused reduce-fp8`` reduce the own tiles in the epilogue (``kernels_fused.hopper.gemm.ReduceEpilogue``)
with the peer's chunks already flagged (zeros, so the own columns of ``out`` must equal the GEMM's),
which is what the epilogue costs the GEMM when it never waits.

Arms: ``scaled_mm`` (cuBLAS: ptpc with default accumulation, blockscale with its blockwise 1x128 /
128x128 recipe; mxfp8 has no cuBLAS arm on Hopper) and ``scaled_mm-fast`` (``use_fast_accum=True``;
ptpc only), then one Triton arm per ``--configs`` entry (``BMxBNxSTAGES[xWARPS]``, 8 warps unless
given) and ``--launch`` style (``GemmConfig.launch``: "grid" is the plain kernel, "ws" the persistent
warp-specialized one; "ticket" and "persistent" run the lsa kernel on a world of one, which shows
what its tile walk costs the GEMM; "cublas", mxfp8 only: cuBLAS's bf16 GEMM on the dequantized
operands, mxfp8's plain default). ``--configs default`` is the config ``fp8_gemm`` picks for
``fuse=False``, launch included. Every arm's output is checked against the fp32 reference first
(``cco.bench.timing.gemm_mismatches``); a wrong arm posts no time. Timing is ``cco.bench.timing.time_arms``
(arms alternate inside each pass, median over iterations, spread over passes); the last line is
``RESULT_JSON {...}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from cco import quant as Q
from cco.bench.timing import (allreduce_mismatches, budget_terms, cublas_gemm, gemm_mismatches, graphed, idle_check,
                           tflops, time_arms)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quant", default="ptpc", choices=Q.QUANTS)
    p.add_argument("-m", type=int, default=16384)
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
    return p.parse_args(argv)


def triton_configs(spec: str, quant: str):
    from kernels_fused.hopper.gemm import default_config

    if spec == "default":
        return [default_config(quant, plain=True)]
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


def epilogue_arms(args, sets, dev, kernel=None):
    """The ``--epilogue`` arms: name -> (call(i), check(output of call(0), ref, dot_abs) -> bad elements).
    ``kernel``: a GemmConfig to launch instead of the backend's (the layout's m-tile follows its rows;
    the arms' names then carry it)."""
    from cco import layout
    from cco.backends.cuda import CudaBackend, fused_config, fused_table
    from kernels_fused.hopper.gemm import ReduceEpilogue, fp8_gemm

    world, rank = 2, 0
    block_m, block_n = CudaBackend.tile(args.quant) if kernel is None else (kernel.block_m, CudaBackend.block_n)
    cfg = layout.build_config(n=args.n, k=args.k, m_max=args.m, world=world, quant=args.quant,
                              block_m=block_m, block_n=block_n)
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
    for gather in ("bf16", "fp8"):
        red = epilogue(gather == "fp8")
        arms[f"fused reduce-{gather}{suffix}"] = (
            lambda i, red=red: call(i, red),
            lambda out, ref, dot_abs, fp8=gather == "fp8": allreduce_mismatches(
                out[:, own], ref[:, own], ref[:, own].abs(), dot_abs[:, own], fp8_gather=fp8))
    return arms


def main(argv=None):
    args = parse_args(argv)
    from kernels_fused.hopper.gemm import fp8_gemm

    dev = torch.device("cuda", torch.cuda.current_device())
    sets = [Q.random_problem(args.m, args.n, args.k, args.quant, seed=i, device=dev) for i in range(args.rotate)]
    b, b_s = sets[0].b, sets[0].b_scale
    arms = {}
    checks = {}
    if args.epilogue:
        for kernel in [None] if args.configs == "default" else triton_configs(args.configs, args.quant):
            for name, (run, check) in epilogue_arms(args, sets, dev, kernel).items():
                arms[name], checks[name] = run, check
    for name, fast in () if args.epilogue else (("scaled_mm", False), ("scaled_mm-fast", True)):
        if fast and args.quant != "ptpc":
            continue  # blockscale's blockwise recipe has no fast-accumulation variant
        fn, why = cublas_gemm(args.quant, b, b_s, fast_accum=fast)
        if fn is None:
            print(f"no {name} arm: {why}")
            continue
        arms[name] = lambda i, fn=fn: fn(sets[i].a, sets[i].a_scale)
    launches = [x.strip() for x in args.launch.split(",")]
    if launches != ["default"] and not set(launches) <= {"grid", "ws", "ticket", "persistent", "cublas"}:
        raise SystemExit(f"--launch {args.launch!r}: pick from grid, ws, ticket, persistent, cublas (or default)")
    for cfg in [] if args.epilogue else triton_configs(args.configs, args.quant):
        for launch in ([cfg.launch] if launches == ["default"] else launches):
            cfg_l = dataclasses.replace(cfg, launch=launch)
            name = "cublas bf16 (dequantized)" if launch == "cublas" else f"triton {config_name(cfg)} {launch}"
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
    idle_before = idle_check()
    timed = graphed(arms, args.rotate)[0] if args.graph else arms
    timings = time_arms(timed, passes=args.passes, iters=args.iters, rotate=args.rotate)
    idle_after = idle_check()
    base = timings.get("scaled_mm")
    print(f"[{args.m}, {args.n}] K={args.k} {args.quant} on {torch.cuda.get_device_name()}, "
          f"{'graph replays' if args.graph else 'eager calls'}")
    rows = {}
    for name, t in timings.items():
        row = t.as_dict()
        row["tflops"] = round(tflops(args.m, args.n, args.k, t.median_us), 1)
        if base:
            row["throughput_vs_scaled_mm"] = round(base.median_us / t.median_us, 3)
        rows[name] = row
        ratio = f" | {row['throughput_vs_scaled_mm']:.3f}x scaled_mm" if base else ""
        print(f"  {name:32s} {t.median_us:8.1f} us (spread {100 * t.spread:4.1f}%) | {row['tflops']:7.1f} TFLOP/s{ratio}")
    payload = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": torch.cuda.get_device_name(),
               "m": args.m, "n": args.n, "k": args.k, "quant": args.quant, "graph": args.graph, "arms": rows, "bad_elements": checked,
               "idle_before": idle_before, "idle_after": idle_after}
    print("RESULT_JSON " + json.dumps(payload))


if __name__ == "__main__":
    main()
