"""blockscale's own GEMM with each K step's scales loaded one step ahead (``GemmConfig.prefetch_scales``:
``kernels._tile_acc``'s ``PREFETCH_SCALES``) against the same launch without, and cuBLAS's blockwise
GEMM, at the reduce-scatter producers' shapes, device time under graph replay, one GPU::

    python3 -m scripts.probe_scale_prefetch -m 4096,16384 prefetch.json
    python3 -m scripts.probe_scale_prefetch --model llama3-70b --tp 4 -m 8192 prefetch.json

Why: compiled for sm_90, the own blockscale K loop issues its step's 34 scale loads between the
tile wait and the step's MMA, and waits for each MMA before the next (docs/hopper_gemm.md, "Why the
own blockscale kernel runs ~1.5x of cuBLAS"); the reduce-scatter along rows runs this kernel as
its producer where it releases slices sooner than cuBLAS's chunks. Prefetching takes the loads'
latency out of the step; whether that is time is what this measures.

Shapes: the row-parallel down projection of Llama-3-70B and DeepSeek-V3's dense MLP
(``scripts.bench_sp_parts.layer_shape``, pattern ``rs-rows``) at each TP: N = hidden, K =
intermediate / TP; M the tokens. Arms per (shape, M): ``cuBLAS`` (where ``vendor.takes_rows``
trusts it), and per own config (``grid`` the tile-table kernel's default tile, ``ws`` the
warp-specialized plain kernel at two tiles) with and without ``prefetch``. Every arm is first
checked against the fp32 product of the dequantized operands on sampled rows
(``gemm_mismatches``), and each prefetching arm for the bits of its twin; a wrong arm posts no
time. Timing: ``bench_decode.graph_timings`` (a graph of 3 calls, the arms alternating per pass).
One line per (shape, M): each arm's median us and its ratio to the same config without prefetch,
pass by pass (median and range; lower is better).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from scripts.bench_sp_parts import MODELS, _list, check_rows, device_problems, layer_shape

# (label, GemmConfig fields) of the own kernel's configs timed: the tile-table kernel's blockscale tile
# (gemm._HOPPER) through the grid launch, and the ws launch at that tile and at 128x128 (8 warps)
OWN = (("grid 64x128", dict(block_m=64, block_n=128, num_warps=4, num_stages=3)),
       ("ws 64x128", dict(block_m=64, block_n=128, num_warps=4, num_stages=3, launch="ws")),
       ("ws 128x128", dict(block_m=128, block_n=128, num_warps=8, num_stages=4, launch="ws")))
GRAPH_CALLS = 3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()).replace("``", ""))
    p.add_argument("--model", type=_list(str, MODELS), default=list(MODELS), help="comma list of models")
    p.add_argument("--tp", type=_list(int, (2, 4, 8)), default=[4, 8], help="comma list of TP degrees")
    p.add_argument("-m", type=_list(int, None), default=[4096, 16384], help="comma list of token counts M")
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("json", help="write the rows here (after every shape)")
    args = p.parse_args(argv)
    where = os.path.dirname(args.json)
    if where and not os.path.isdir(where):
        p.error(f"json {args.json}: directory {where} does not exist")
    if any(m < 1 for m in args.m) or args.passes < 1:
        p.error("M and --passes must be >= 1")
    return args


def arms_of(p, quant: str = "blockscale") -> dict:
    """Label -> a call writing its own fresh ``out`` (each arm's, so the graphs do not share it)."""
    from kernels_fused.hopper import vendor
    from kernels_fused.hopper.gemm import GemmConfig, fp8_gemm

    m, n, k = p.a.shape[0], p.b.shape[0], p.a.shape[1]
    arms = {}
    if vendor.takes_rows(quant, m, k):  # (the weight prepared once, as the backends keep it)
        out, weight = torch.empty(m, n, dtype=torch.bfloat16, device=p.a.device), vendor.prepare_weight(p.b, p.b_scale,
                                                                                                        quant)
        arms["cuBLAS"] = lambda o=out: vendor.vendor_gemm(p.a, p.a_scale, weight, out=o)
    for label, fields in OWN:
        for prefetch in (False, True):
            cfg = GemmConfig(**fields, prefetch_scales=prefetch)
            out = torch.empty(m, n, dtype=torch.bfloat16, device=p.a.device)
            arms[label + (" prefetch" if prefetch else "")] = (
                lambda o=out, cfg=cfg: fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant=quant, out=o, config=cfg,
                                                validated=True))
    return arms


def check(arms: dict, p, quant: str = "blockscale") -> dict:
    """Label -> why the arm is wrong (absent: right): sampled rows against the fp32 product, and each
    prefetching arm bit for bit against its twin."""
    from cco import quant as Q
    from cco.bench.timing import gemm_mismatches

    idx = check_rows(p.a.shape[0]).to(p.a.device)
    a = Q.dequantize_a(p.a, p.a_scale, quant)[idx]
    b = Q.dequantize_b(p.b, p.b_scale, quant)
    ref, dot_abs = a @ b.t(), a.abs() @ b.abs().t()
    outs, wrong = {}, {}
    for label, fn in arms.items():
        outs[label] = fn().clone()
        bad = gemm_mismatches(outs[label][idx], ref, dot_abs)
        if bad:
            wrong[label] = f"{bad} elements outside the budget"
    for label in outs:
        twin = label.removesuffix(" prefetch")
        if twin != label and not torch.equal(outs[label], outs[twin]):
            wrong[label] = wrong.get(label, "") + " bits differ from " + twin
    return wrong


def main(argv=None) -> int:
    args = parse_args(argv)
    from cco.bench.timing import per_pass_ratio, require_cuda, time_arms

    require_cuda("probe_scale_prefetch")
    from scripts.bench_decode import graph_timings

    dev = torch.device("cuda")
    rows, t0, failed = [], time.time(), 0
    for model in args.model:
        for tp in args.tp:
            n, k, _ = layer_shape("rs-rows", model, tp)
            for m in args.m:
                (p,) = device_problems(m, n, k, "blockscale", 1, dev)
                arms = arms_of(p)
                wrong = check(arms, p)
                for label, why in wrong.items():
                    print(f"{model} TP{tp} M={m} {label}: WRONG, {why}", flush=True)
                    del arms[label]
                t = graph_timings(arms, GRAPH_CALLS, args.passes, time_arms)
                row = {"model": model, "tp": tp, "m": m, "n": n, "k": k, "wrong": wrong,
                       "us": {a: v.median_us / GRAPH_CALLS for a, v in t.items()},
                       "pass_us": {a: [u / GRAPH_CALLS for u in v.pass_us] for a, v in t.items()}}
                ratios = {}
                for label in t:
                    twin = label.removesuffix(" prefetch")
                    if twin != label and twin in t:
                        ratios[label] = per_pass_ratio(t[label].pass_us, t[twin].pass_us)
                row["vs_unprefetched"] = ratios
                failed += not t
                print(f"[{time.time() - t0:.0f} s] {model} TP{tp} [{m}, {n}, {k}]: " + " | ".join(
                    f"{a} {row['us'][a]:.1f}" + (f" ({ratios[a][0]:.3f}x, {ratios[a][1]:.3f}-{ratios[a][2]:.3f})"
                                                  if a in ratios else "") for a in t), flush=True)
                rows.append(row)
                with open(args.json, "w") as f:
                    json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "command": "python3 -m scripts.probe_scale_prefetch "
                                          + " ".join(sys.argv[1:] if argv is None else argv),
                               "note": "device us per call, graph replay; vs_unprefetched: (median, min, max) "
                                       "over passes of prefetch / its twin, lower is better",
                               "rows": rows}, f, indent=1)
                del p, arms
                torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
