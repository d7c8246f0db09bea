"""Each arm of ``scripts.probe_pingpong`` called twice at given producer shapes, for Nsight Compute
to read the hardware counters of its kernels (one GPU)::

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        -k 'regex:pingpong|fp8_gemm_ws|nvjet|gemm_pair' --csv --page details \\
        python3 -m scripts.ncu_pingpong --model deepseek-v3 --tp 8 -m 4096 > ncu.csv

Why: the probe's times say the ping-pong ties the own ws kernel and that its ring alone
(``--loads-only``) takes about cuBLAS's whole time (docs/hopper_gemm.md); the counters say where the
bytes come from (L2 hit rate, L2 and DRAM throughput) and how busy the tensor cores are. The arms
run in the order cuBLAS, own ws, ping-pong, ring only, then each build of the CTA pair GEMM
(``scripts.probe_pair_gemm``), each twice (the first call compiles a kernel; the profiler reads
both, the second is the one to read); ``--arms`` keeps those whose label a regular expression
finds. Nothing is timed or checked here (the probes check them)."""
from __future__ import annotations

import argparse
import re
import sys

import torch


def main(argv=None) -> int:
    from scripts._cli import DefaultsHelp
    from scripts.bench_sp_parts import MODELS, _list, device_problems, layer_shape
    from scripts.probe_pair_gemm import arms_of as pair_arms
    from scripts.probe_pingpong import arms_of

    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()), formatter_class=DefaultsHelp)
    p.add_argument("--model", type=_list(str, MODELS), default=["deepseek-v3"], help="comma list of models")
    p.add_argument("--tp", type=_list(int, (2, 4, 8)), default=[8], help="comma list of TP degrees")
    p.add_argument("-m", type=_list(int, None), default=[4096], help="comma list of token counts M")
    p.add_argument("--stages", type=int, default=4, help="the ping-pong's ring depth")
    p.add_argument("--arms", default=None, help="a regular expression: only the arms whose label it finds run")
    args = p.parse_args(argv)
    from cco.bench.timing import require_cuda

    require_cuda("ncu_pingpong")
    for model in args.model:
        for tp in args.tp:
            n, k, _ = layer_shape("rs-rows", model, tp)
            for m in args.m:
                (prob,) = device_problems(m, n, k, "ptpc", 1, torch.device("cuda"))
                arms = arms_of(prob, [args.stages], loads_only=True)
                arms.update((a, fn) for a, fn in pair_arms(prob, [8]).items() if a not in arms)
                for label, fn in arms.items():
                    if args.arms and not re.search(args.arms, label):
                        continue
                    fn()  # (compiles; the profiler's filter takes both calls: the second is the one to read)
                    torch.cuda.synchronize()
                    fn()
                    torch.cuda.synchronize()
                    print(f"{model} TP{tp} [{m}, {n}, {k}]: {label}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
