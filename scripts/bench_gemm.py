"""The GEMM alone on one GPU: the Triton fp8 kernel (``fuse=False``) against ``torch._scaled_mm``.

    python -m scripts.bench_gemm --quant ptpc -m 16384 -n 7168 -k 2048
    python -m scripts.bench_gemm --configs 128x256x3,128x256x4 --launch grid,ws,ticket,persistent

Arms: ``scaled_mm`` (cuBLAS, default accumulation) and ``scaled_mm-fast`` (``use_fast_accum=True``;
ptpc only), then one Triton arm per ``--configs`` entry (``BMxBNxSTAGES``, 8 warps) and ``--launch``
style (``GemmConfig.launch``: "grid" is the plain kernel, "ws" the persistent warp-specialized one;
"ticket" and "persistent" run the lsa kernel on a world of one, which shows what its tile walk costs
the GEMM). ``--configs default`` is the config ``fp8_gemm`` picks for ``fuse=False``, launch
included. Every arm's output is checked against the fp32 reference first (``cco.benchmark.gemm_mismatches``); a wrong arm posts no time. Timing is
``cco.benchmark.time_arms`` (arms alternate inside each pass, median over iterations, spread over
passes); the last line is ``RESULT_JSON {...}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from cco import quant as Q
from cco.benchmark import budget_terms, gemm_mismatches, graphed, idle_check, tflops, time_arms


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quant", default="ptpc", choices=Q.QUANTS)
    p.add_argument("-m", type=int, default=16384)
    p.add_argument("-n", type=int, default=7168)
    p.add_argument("-k", type=int, default=2048)
    p.add_argument("--configs", default="default", help="comma list of BMxBNxSTAGES, or 'default'")
    p.add_argument("--launch", default="default", help="comma list of grid, ws, ticket, persistent; 'default': "
                   "each config's own")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rotate", type=int, default=3)
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replays (kernel time without the "
                   "host's launch cost) instead of eager calls")
    return p.parse_args(argv)


def triton_configs(spec: str, quant: str):
    from kernels_fused.triton_gemm import GemmConfig, default_config

    if spec == "default":
        return [default_config(quant, plain=True)]
    configs = []
    for item in spec.split(","):
        try:
            bm, bn, stages = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--configs: {item!r} is not BMxBNxSTAGES (e.g. 128x256x3)") from None
        configs.append(GemmConfig(block_m=bm, block_n=bn, num_stages=stages))
    return configs


def main(argv=None):
    args = parse_args(argv)
    from kernels_fused.triton_gemm import fp8_gemm

    dev = torch.device("cuda", torch.cuda.current_device())
    sets = [Q.random_problem(args.m, args.n, args.k, args.quant, seed=i, device=dev) for i in range(args.rotate)]
    b, b_s = sets[0].b, sets[0].b_scale
    arms = {}
    if args.quant == "ptpc":
        b_t, b_row = b.t(), b_s.reshape(1, -1).float()
        a_col = [p.a_scale.reshape(-1, 1).float() for p in sets]
        for name, fast in (("scaled_mm", False), ("scaled_mm-fast", True)):
            arms[name] = (lambda i, fast=fast: torch._scaled_mm(sets[i].a, b_t, scale_a=a_col[i], scale_b=b_row,
                                                                 out_dtype=torch.bfloat16, use_fast_accum=fast))
    launches = [x.strip() for x in args.launch.split(",")]
    if launches != ["default"] and not set(launches) <= {"grid", "ws", "ticket", "persistent"}:
        raise SystemExit(f"--launch {args.launch!r}: pick from grid, ws, ticket, persistent (or default)")
    for cfg in triton_configs(args.configs, args.quant):
        for launch in ([cfg.launch] if launches == ["default"] else launches):
            cfg_l = dataclasses.replace(cfg, launch=launch)
            name = f"triton {cfg.block_m}x{cfg.block_n}x{cfg.num_stages} {launch}"
            arms[name] = (lambda i, cfg_l=cfg_l: fp8_gemm(sets[i].a, b, sets[i].a_scale, b_s, quant=args.quant,
                                                           config=cfg_l))

    ref, dot_abs = budget_terms(sets[0])
    checked = {}
    for name in list(arms):
        bad = gemm_mismatches(arms[name](0), ref, dot_abs)
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
