"""ptpc's ping-pong GEMM in Gluon (``kernels_fused.hopper.gluon_pingpong``) against cuBLAS's row-wise
``_scaled_mm`` and the own warp-specialized Triton GEMM, at the reduce-scatter producers' shapes,
device time under graph replay, one GPU::

    python3 -m scripts.probe_pingpong --tp 4,8 -m 4096,16384 pingpong.json

Why: the reduce-scatter along rows' producer runs 1.18-1.22x of cuBLAS's whole GEMM at W 8, and the
own ws GEMM itself 1.07-1.17x there (docs/BENCHMARKS.md): each program stores a tile before its
next tile's MMAs start. The ping-pong overlaps one warpgroup's epilogue with the other's main loop.
Whether it is right on a GPU, and how far it gets against cuBLAS, is what this measures. On one
H100 (2026-12-07; docs/hopper_gemm.md has the table): right everywhere, 1.05-1.17x at 4 stages,
no better than the own ws kernel, so no launch path calls it. ``--stages 5`` (224 KiB of shared
memory) fits an H100 block and loses at 16384 tokens.

Shapes: ``scripts.bench_sp_parts.layer_shape("rs-rows", ...)`` (N = hidden, K = intermediate / TP).
Arms: ``cuBLAS`` (fast accumulation, as the own kernel accumulates), ``own ws 128x256x4`` (the
plain ptpc GEMM's launch, ``TRITON_PLAIN``), ``pingpong S stages``, and with ``--loads-only``
``ring only S stages``: the same walk's loads alone (no MMA, nothing written; never checked), whose
time against the GEMM's says whether the ring's pace or the MMAs hold it. Every other arm is checked
against the fp32 product on sampled rows (a wrong arm posts no time; the exit status counts wrong
cells) and the ping-pong for equal bits on a repeat; then ``bench_decode.graph_timings`` (graphs of
3 calls, arms alternating per pass). One line per (shape, M): each arm's us and its ratio to
cuBLAS pass by pass (median and range; lower is better). The host check of its compile:
``python3 -m scripts.probe_gluon_blockscale --compile-only``.
"""
from __future__ import annotations

import argparse
import sys
from functools import partial

import torch

RING_ONLY = "ring only"  # the label of the loads-only arms (timed, not checked: they compute nothing)


def parse_args(argv=None):
    from scripts._cli import DefaultsHelp
    from scripts.bench_sp_parts import MODELS, _list

    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()).replace("``", ""),
                                formatter_class=DefaultsHelp)
    p.add_argument("--model", type=_list(str, MODELS), default=list(MODELS), help="comma list of models")
    p.add_argument("--tp", type=_list(int, (2, 4, 8)), default=[4, 8], help="comma list of TP degrees")
    p.add_argument("-m", type=_list(int, None), default=[4096, 16384], help="comma list of token counts M")
    p.add_argument("--stages", type=_list(int, (2, 3, 4, 5)), default=[3, 4], help="the ring depths timed")
    p.add_argument("--passes", type=int, default=3, help="timing passes (arms alternate within each)")
    p.add_argument("--loads-only", action="store_true",
                   help="also time the ring alone at each depth (arms 'ring only S stages': the same walk's "
                        "loads taken and released as they land, no MMA, nothing written, so never checked)")
    p.add_argument("json", help="write the rows here (after every shape)")
    return p.parse_args(argv)


def fresh_out(p) -> torch.Tensor:
    """An output of problem ``p``'s shape, bf16, on its device."""
    return torch.empty(p.a.shape[0], p.b.shape[0], dtype=torch.bfloat16, device=p.a.device)


def baseline_arms(p) -> dict:
    """The arms every GEMM probe times against: ``cuBLAS`` (row-wise ``_scaled_mm``, fast
    accumulation, as the own kernels accumulate) and ``own ws 128x256x4`` (the plain ptpc GEMM's
    launch, ``TRITON_PLAIN``), each writing its own output (made once: a graph allocates nothing)."""
    from kernels_fused.hopper.gemm import TRITON_PLAIN, fp8_gemm

    b_t, sa, sb = p.b.t(), p.a_scale.reshape(-1, 1).float(), p.b_scale.reshape(1, -1).float()
    return {"cuBLAS": lambda: torch._scaled_mm(p.a, b_t, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                               use_fast_accum=True),
            "own ws 128x256x4": lambda o=fresh_out(p): fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant="ptpc", out=o,
                                                                config=TRITON_PLAIN["ptpc"], validated=True)}


def arms_of(p, stages, loads_only: bool = False) -> dict:
    """Label -> a call writing its own ``out`` (made once: a graph allocates nothing)."""
    from kernels_fused.hopper import gluon_pingpong

    fresh = partial(fresh_out, p)
    arms = baseline_arms(p)
    kinds = [("pingpong", False)] + ([(RING_ONLY, True)] if loads_only else [])
    for s in stages:
        for kind, loads in kinds:
            arms[f"{kind} {s} stages"] = (lambda o=fresh(), s=s, loads=loads: gluon_pingpong.ptpc_pingpong_gemm(
                p.a, p.b, p.a_scale.reshape(-1), p.b_scale.reshape(-1), out=o, stages=s, loads_only=loads))
    return arms


def same_bits_on_repeat(arms, prefix: str | tuple[str, ...] = "pingpong") -> dict:
    """Label -> why, for each arm whose label starts with ``prefix`` (or one of them) and whose second
    call gives other bits than its first."""
    wrong = {}
    for label in [a for a in arms if a.startswith(prefix)]:
        first = arms[label]().clone()
        if not torch.equal(first, arms[label]()):
            wrong[label] = "other bits on a repeat of the same call"
    return wrong


def main(argv=None) -> int:
    args = parse_args(argv)
    from cco.bench.timing import require_cuda
    from scripts.probe_gluon_blockscale import gemm_table

    require_cuda("probe_pingpong")
    command = "python3 -m scripts.probe_pingpong " + " ".join(sys.argv[1:] if argv is None else argv)
    return 1 if gemm_table(args, command, "ptpc", lambda p: arms_of(p, args.stages, args.loads_only),
                           checks=(same_bits_on_repeat, ), unchecked=RING_ONLY) else 0


if __name__ == "__main__":
    sys.exit(main())
