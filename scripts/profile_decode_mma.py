"""The decode MMA over quantized rows (``decode_kernels.decode_mma_rows_kernel``) under Nsight
Compute: where its time goes at a shape and row count, per quant (one NVIDIA GPU)::

    ncu --clock-control none --kernel-name regex:decode_mma_rows --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \\
        --section Occupancy --section LaunchStats --csv --page details \\
        python3 -m scripts.profile_decode_mma --shape 8b-o-tp1 -m 8,64 --quant ptpc,blockscale > mma.csv

This program only makes the calls: per (quant, M) ``--calls`` calls of the decode GEMM as a graph
capture takes them (the quantizer's launch, then the MMA's; the one launch and the C++ table off),
each on its own seeded weight, so that a profiler that replays one kernel sees a weight that the
call before did not leave in L2 (ncu also flushes the caches between its replays by default). It
prints, per call, which (quant, M) it is, so the profiler's rows can be matched in order.

Why: at Llama-3-8B o_proj (4096 x 4096) blockscale's MMA takes ~4 us more than ptpc's at 64 rows
over the same fp8 weight (docs/decode.md); timing variants did not say where (deeper pipelines,
other block shapes and Gluon with one MMA in flight all gave nothing). The counters do.
"""

from __future__ import annotations

import argparse
import os

import torch


def parse_args(argv=None):
    from scripts._cli import ints
    from scripts.tune_decode import SHAPES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("--shape", default="8b-o-tp1", choices=sorted(SHAPES), help="tune_decode's shape name")
    p.add_argument("-m", type=ints, default=[8, 64], help="comma list of row counts (2..64)")
    p.add_argument("--quant", default="ptpc,blockscale", help="comma list of ptpc, blockscale")
    p.add_argument("--calls", type=int, default=2, help="calls per (quant, M), each on its own weight")
    p.add_argument("--linear", action="store_true",
                   help="also, per M, the bf16 nn.Linear call the layer replaces (F.linear; each call on its own "
                        "bf16 weight): profile with no --kernel-name to see cuBLAS's kernel beside the MMA")
    a = p.parse_args(argv)
    a.quant = a.quant.split(",")
    bad = [q for q in a.quant if q not in ("ptpc", "blockscale")]
    if bad:
        p.error(f"--quant {bad}: the MMA over quantized rows takes ptpc and blockscale")
    if any(not 2 <= m <= 64 for m in a.m) or a.calls < 1:
        p.error(f"-m {a.m} must be in 2..64 and --calls {a.calls} >= 1")
    return a


def main(argv=None):
    args = parse_args(argv)
    from cco.bench.timing import require_cuda

    require_cuda("profile_decode_mma")
    os.environ["CCO_DECODE_ONE_LAUNCH"] = "0"
    from cco import quant as Q
    from kernels_fused.hopper import decode as D
    from kernels_fused.hopper import native as NV
    from scripts.tune_decode import shape_weight

    NV.ENABLED = False  # the Python path's two launches, as a capture takes them
    D.ONE_LAUNCH = False
    weights = [shape_weight(args.shape, "cuda", seed)[2] for seed in range(args.calls)]
    n, k = weights[0].shape
    if args.linear:
        dense = [w.to(torch.bfloat16) for w in weights]
        for m in args.m:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            torch.nn.functional.linear(x, dense[0])
            torch.cuda.synchronize()
            for i, w in enumerate(dense):
                print(f"call: {args.shape} nn.Linear bf16 M={m} weight {i}", flush=True)
                torch.nn.functional.linear(x, w)
            torch.cuda.synchronize()
    for quant in args.quant:
        quantized = [Q.quantize_b(w, quant) for w in weights]
        for m in args.m:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            D.decode_gemm(x, *quantized[0], quant, n=n)  # compiled before the profiled calls
            torch.cuda.synchronize()
            for i, (wq, ws) in enumerate(quantized):
                print(f"call: {args.shape} {quant} M={m} weight {i}", flush=True)
                D.decode_gemm(x, wq, ws, quant, n=n)
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
