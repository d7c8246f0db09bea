"""ptpc's GEMM with a CTA pair sharing the weight tile by TMA multicast (``kernels_fused.hopper.pair_gemm``,
CUDA C++ built by nvcc) against cuBLAS's row-wise ``_scaled_mm`` and the own warp-specialized Triton
GEMM, device time under graph replay, one GPU::

    python3 -m scripts.probe_pair_gemm --pattern rs-rows,ag --tp 4,8 -m 4096,16384 pair.json

Why: the own Triton GEMMs run 1.05-1.20x of cuBLAS at the sequence-parallel shapes and the tile
feed from L2 holds them (docs/hopper_gemm.md); cuBLAS shares an operand over a CTA pair by
multicast, which the GPU machines' Triton cannot issue. Whether the pair closes the gap, and
whether it is right, is what this measures.

Shapes: ``scripts.bench_sp_parts.layer_shape`` for each pattern (``rs-rows``: the reduce-scatter
producer's, N = hidden, K = intermediate / TP; ``ag``: the all-gather consumer's gate_up, N = 2 x
intermediate / TP, K = hidden). Arms: ``cuBLAS`` (fast accumulation), ``own ws 128x256x4`` (the
plain ptpc GEMM's launch), and for each ``--group`` (the walk's grouped rows) each build of
``VARIANT_ARGS``, labelled ``pairP kBKxS`` (P CTAs a cluster: 1 loads its whole B tile, so the pair
against it is what the multicast saves; BK bytes a K step, S stages), ``early`` where a step's
slot is released before the next step's issue, ``pp`` for the ping-pong (a 128x128 tile a
consumer warpgroup, taken in turn).
Every arm is checked against the fp32 product on sampled rows (a wrong arm posts no time; the exit
status counts wrong cells) and every build for equal bits on a repeat; then graphs of 3 calls, arms
alternating per pass, each arm's ratio to cuBLAS pass by pass (median and range; lower is better).
"""
from __future__ import annotations

import argparse
import sys

import torch


def parse_args(argv=None):
    from kernels_fused.hopper.pair_gemm import Variant
    from scripts._cli import DefaultsHelp
    from scripts.bench_sp_parts import MODELS, _list

    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()).replace("``", ""),
                                formatter_class=DefaultsHelp)
    p.add_argument("--pattern", type=_list(str, ("rs-rows", "ag")), default=["rs-rows", "ag"],
                   help="comma list of the GEMMs' patterns")
    p.add_argument("--model", type=_list(str, MODELS), default=list(MODELS), help="comma list of models")
    p.add_argument("--tp", type=_list(int, (2, 4, 8)), default=[4, 8], help="comma list of TP degrees")
    p.add_argument("-m", type=_list(int, None), default=[4096, 16384], help="comma list of token counts M")
    p.add_argument("--group", type=_list(int, None), default=[8], help="comma list of the walk's row groups")
    p.add_argument("--builds", type=_list(str, [label(Variant(**kw)) for kw in VARIANT_ARGS]),
                   default=None, help="comma list of the builds timed, by label (default: every build of VARIANT_ARGS)")
    p.add_argument("--passes", type=int, default=3, help="timing passes (arms alternate within each)")
    p.add_argument("--smoke", action="store_true",
                   help="first check every build at three shapes (one tile, a few tiles, a walk of several tiles a "
                        "cluster) and "
                        "stop with status 1 on a wrong one, before the sweep")
    p.add_argument("json", help="write the rows here (after every shape)")
    return p.parse_args(argv)


# The builds timed (kernels_fused.hopper.pair_gemm.Variant). The shared 128x256 tile: the pair at a
# 128-byte K step and 4 stages, releasing a step's slot before the next step's issue, at a 64-byte
# step and 8 stages (a slot released twice as often), and one CTA a cluster (no multicast). The
# ping-pong (128x128 a consumer): the pair at 6 and 7 stages, at a 64-byte step, one CTA alone, and
# the pair along N sharing A's tile (``share A``).
VARIANT_ARGS = (dict(), dict(early_release=True), dict(bk=64, stages=8), dict(bk=64, stages=8, early_release=True),
                dict(pair=1), dict(pingpong=True, stages=6), dict(pingpong=True, stages=7),
                dict(pingpong=True, bk=64, stages=12), dict(pingpong=True, pair=1, stages=6),
                dict(pingpong=True, stages=6, share_a=True))


BUILD_PREFIXES = ("pair", "pp pair")  # what every build's label starts with (:func:`label`)


def label(v) -> str:
    """An arm's name for build ``v``: ``pair2 k128x4``, ``pp pair2 k128x6`` (the ping-pong), ``... early``,
    ``... narrow``, ``... cluster-order``, ``... share A``."""
    return (("pp " if v.pingpong else "") + f"pair{v.pair} k{v.bk}x{v.stages}" + (" early" if v.early_release else "")
            + ("" if v.wide_stores else " narrow") + (" cluster-order" if v.cluster_order else "")
            + (" share A" if v.share_a else ""))


def builds(labels=None) -> list:
    """The builds of ``VARIANT_ARGS`` named in ``labels`` (all where None), in that order."""
    from kernels_fused.hopper.pair_gemm import Variant

    every = [Variant(**kw) for kw in VARIANT_ARGS]
    return every if labels is None else [v for v in every if label(v) in labels]


def arms_of(p, groups, labels=None) -> dict:
    """Label -> a call writing its own ``out`` (made once: a graph allocates nothing): the baselines,
    then each build of ``labels`` (:func:`builds`) at each row group."""
    from kernels_fused.hopper.pair_gemm import ptpc_pair_gemm
    from scripts.probe_pingpong import baseline_arms, fresh_out

    arms = baseline_arms(p)
    for g in groups:
        for v in builds(labels):
            arms[f"{label(v)} g{g}"] = (lambda o=fresh_out(p), g=g, v=v: ptpc_pair_gemm(
                p.a, p.b, p.a_scale, p.b_scale, out=o, group=g, variant=v))
    return arms


SMOKE_SHAPES = ((256, 256, 128), (1024, 768, 1024), (4096, 7168, 2304))


def smoke(labels=None) -> int:
    """Wrong builds of ``labels`` (:func:`builds`) at ``SMOKE_SHAPES`` (random e4m3 operands, scales in
    [0.5, 1.5)), each checked against the fp32 product with the GEMM's error budget; one line per
    (shape, build)."""
    from cco.bench.timing import gemm_mismatches
    from kernels_fused.hopper.pair_gemm import ptpc_pair_gemm

    wrong = 0
    for m, n, k in SMOKE_SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(m, k, device="cuda", generator=g).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda", generator=g).to(torch.float8_e4m3fn)
        sa, sb = (torch.rand(x, device="cuda", generator=g) + 0.5 for x in (m, n))
        ref = (a.float() @ b.float().t()) * sa[:, None] * sb[None, :]
        dot = (a.float().abs() @ b.float().abs().t()) * sa[:, None] * sb[None, :]
        for v in builds(labels):
            bad = gemm_mismatches(ptpc_pair_gemm(a, b, sa, sb, variant=v), ref, dot)
            wrong += bool(bad)
            print(f"smoke [{m}, {n}, {k}] {label(v)}: {bad} elements outside the budget", flush=True)
    return wrong


def main(argv=None) -> int:
    args = parse_args(argv)
    from cco.bench.timing import require_cuda
    from scripts.probe_gluon_blockscale import gemm_table
    from scripts.probe_pingpong import same_bits_on_repeat

    require_cuda("probe_pair_gemm")
    if args.smoke and smoke(args.builds):
        return 1
    command = "python3 -m scripts.probe_pair_gemm " + " ".join(sys.argv[1:] if argv is None else argv)
    return 1 if gemm_table(args, command, "ptpc", lambda p: arms_of(p, args.group, args.builds),
                           checks=(lambda arms: same_bits_on_repeat(arms, prefix=BUILD_PREFIXES), ),
                           patterns=args.pattern) else 0


if __name__ == "__main__":
    sys.exit(main())
