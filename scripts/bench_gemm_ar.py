"""gemm-ar benchmark: the fused fp8 GEMM + all-reduce against what a model runs today; launch it with
torchrun, one rank per GPU (each rank needs a CUDA GPU of its own; --check-only lets ranks share one)::

    torchrun --nproc-per-node 2 -m scripts.bench_gemm_ar --mode all --quant ptpc -m 16384 -n 7168 -k 2048
    torchrun --nproc-per-node 2 -m scripts.bench_gemm_ar --mode all --sweep --plot sweep.png

Arms (``--mode`` picks; ``all`` runs every one; mori's names are accepted: gemm-only, split-sdma,
fused-sdma, fused-lsa; split-lsa is refused, it is not implemented on CUDA). The op's arms name their
transport explicitly; the op's default, ``auto``, runs ``fused-lsa`` or ``fused`` by M:

    scaled_mm         torch._scaled_mm alone (cuBLAS: ptpc rowwise, blockscale blockwise; none for
                      mxfp8)                                                 -- GEMM reference
    gemm-only         the Triton GEMM alone (fuse=False)
    scaled_mm+nccl    torch._scaled_mm + NCCL all_reduce (mxfp8: gemm-only's GEMM + NCCL)
    symm_mem          torch symm-mem fused_scaled_matmul_reduce_scatter + NCCL all_gather (ptpc)
    split             GemmAllReduceOp(mode="split"): whole GEMM, then the copy-engine all-reduce
    fused             GemmAllReduceOp(mode="fused"): copy-engine puts on the GEMM's counters
    fused-fp8         GemmAllReduceOp(mode="fused", gather_dtype="fp8")
    fused-lsa         GemmAllReduceOp(mode="fused", transport="lsa"): one persistent kernel whose
                      epilogue stores into the owners, reduces and gathers
    fused-lsa-fp8     the same with gather_dtype="fp8"

Alternatives of the fused copy-engine path, named only in a comma list (not in ``all``):

    fused-chunk-major, fused-fp8-chunk-major
                      the fused GEMM walks the layout's (chunk, dest) order instead of every peer's
                      tiles first (``cco.backends.cuda.DMA_PEERS_FIRST``)
    fused-narrow-side, fused-fp8-narrow-side
                      the reduce and assemble kernels beside the GEMM run 32 programs striding the
                      rows (the bf16 assemble too, instead of the driver's pitched copy) rather than
                      one per row (``cco.cuda.dma.SIDE_PROGRAMS``)
    fused-reduce-in-gemm, fused-fp8-reduce-in-gemm
                      the own tiles wait for the peer's chunks and are reduced in the GEMM's
                      epilogue instead of by a kernel per chunk on a side stream
                      (``cco.backends.cuda.DMA_REDUCE_IN_GEMM``)
    fused-flag-write, fused-fp8-flag-write
                      a peer's flag is set by a stream write-value into its memory instead of an
                      8-byte copy queued behind the data (``cco.cuda.dma.FLAG_BY_COPY``)
    fused-two-lanes, fused-fp8-two-lanes
                      two put streams per peer take the copy steps in turn instead of one carrying
                      them all (``cco.cuda.dma.PUT_LANES``)
    fused-8-chunks, fused-fp8-8-chunks
                      8 row chunks per call whatever ``--chunks`` says
    fused-taper, fused-fp8-taper
                      8 row chunks, the first and last half as large as the others (``TAPER``), so
                      that the first put can start sooner and less follows the GEMM's last tile
    fused-taper-two-lanes, fused-fp8-taper-two-lanes
                      both of the above: eight steps per put stream leave more gaps to hide

Patterns (``--pattern``): ``ar`` (the default) times the all-reduce arms above; ``rs`` the GEMM +
reduce-scatter along tokens (``GemmReduceScatterOp(scatter_dim=0)``, rank r gets rows r*M/W..); ``ag``
the all-gather + GEMM of a column-parallel layer (``AllGatherGemmOp``: each rank passes M/W rows, the
output is [M, N]). Their arms (``all`` runs every one; split-sdma / fused-sdma are accepted)::

    rs: scaled_mm+nccl      cuBLAS (mxfp8: gemm-only's GEMM) + NCCL reduce_scatter_tensor
        symm_mem            torch symm-mem fused_scaled_matmul_reduce_scatter (ptpc)
        split, fused        GemmReduceScatterOp(mode=...) on the copy engines
    ag: nccl-fp8+scaled_mm  NCCL all_gather_into_tensor of the e4m3 rows and their scales + cuBLAS
        nccl-bf16+scaled_mm NCCL all-gather of bf16 rows, quantized after it (cco.quant) + cuBLAS
        symm_mem            torch symm-mem fused_all_gather_scaled_matmul (ptpc)
        split, fused        AllGatherGemmOp(mode=...) on the copy engines
        fused-per-chunk,    (by name only) fused with the consumer forced to a GEMM per chunk / per
        fused-per-peer,     peer / one over every peer's slots after the last wait (CudaBackend
        fused-merged        .consumer_rows, .consumer_merge; fused runs AG_CONSUMER_ROWS's groups,
                            merged where each peer's rows are one group)

``--check-only``: the self tests and the output checks, no timing; ranks that share a GPU may run it
(the arms NCCL refuses there are left out, saying so): how the commands are checked on one H200.

Before timing: every op runs ``self_test()`` (bytes really move), and every arm's output is checked
against the fp32 reference sum (relative L2 and element-wise), so a wrong or silent arm cannot post a
time: it is listed in the table (WRONG, or SELF TEST FAILED) and every rank exits 1 (``--check-only``
too). Timing is ``cco.bench.timing.time_arms`` (arms alternate inside each pass, >= 3 passes, median over
iterations, max over ranks, rotating input sets, idle check before and after). ``--graph`` times
CUDA-graph replays of each arm instead of eager calls. The last line is ``RESULT_JSON {...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if not __package__:  # run by path (python3 scripts/bench_gemm_ar.py): the repository root, which -m puts on
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # sys.path, holds scripts.*

import torch
import torch.distributed as dist

from cco import layout
from cco import quant as Q
from cco.bench.timing import (allreduce_mismatches, allreduce_terms, budget_terms, check_output_dirs, cublas_gemm,
                              gemm_mismatches, graphed, idle_check, override, require_a_gpu_per_rank, require_cuda,
                              tflops, time_arms)
from scripts._cli import DefaultsHelp
from scripts.bench_sp_parts import CONSUMERS

SWEEP_M = (2048, 4096, 8192, 16384, 32768)
# cuBLAS arms accumulate like the Triton ptpc kernel (fp8 tensor-core accumulation, no promotion)
FAST_ACCUM = True
ARMS = ("scaled_mm", "gemm-only", "scaled_mm+nccl", "symm_mem", "split", "fused", "fused-fp8", "fused-lsa",
        "fused-lsa-fp8")
TAPER = layout.TAPERED_CHUNKS  # the taper arms' relative chunk sizes
# arm -> (mode, transport, gather dtype, overrides): "chunks" is the op's chunk count (else --chunks), every
# other key a backend attribute (a dotted path, cco.bench.timing.override)
OP_ARMS = {"split": ("split", "dma", "bf16", {}), "fused": ("fused", "dma", "bf16", {}),
           "fused-fp8": ("fused", "dma", "fp8", {}), "fused-lsa": ("fused", "lsa", "bf16", {}),
           "fused-lsa-fp8": ("fused", "lsa", "fp8", {}),
           "fused-chunk-major": ("fused", "dma", "bf16", {"dma_peers_first": False}),
           "fused-fp8-chunk-major": ("fused", "dma", "fp8", {"dma_peers_first": False}),
           "fused-narrow-side": ("fused", "dma", "bf16", {"schedule.side_programs": 32}),
           "fused-fp8-narrow-side": ("fused", "dma", "fp8", {"schedule.side_programs": 32}),
           "fused-reduce-in-gemm": ("fused", "dma", "bf16", {"dma_reduce_in_gemm": True}),
           "fused-fp8-reduce-in-gemm": ("fused", "dma", "fp8", {"dma_reduce_in_gemm": True}),
           "fused-flag-write": ("fused", "dma", "bf16", {"schedule.flag_by_copy": False}),
           "fused-fp8-flag-write": ("fused", "dma", "fp8", {"schedule.flag_by_copy": False}),
           "fused-two-lanes": ("fused", "dma", "bf16", {"schedule.lanes": 2}),
           # the producer of the copy-engine path forced either way (cco.backends.cuda.DMA_PRODUCER)
           "fused-vendor": ("fused", "dma", "bf16", {"producer": "vendor"}),
           "fused-kernel": ("fused", "dma", "bf16", {"producer": "kernel"}),
           "fused-fp8-vendor": ("fused", "dma", "fp8", {"producer": "vendor"}),
           "fused-fp8-kernel": ("fused", "dma", "fp8", {"producer": "kernel"}),
           "fused-fp8-two-lanes": ("fused", "dma", "fp8", {"schedule.lanes": 2}),
           "fused-8-chunks": ("fused", "dma", "bf16", {"chunks": 8}),
           "fused-fp8-8-chunks": ("fused", "dma", "fp8", {"chunks": 8}),
           "fused-taper": ("fused", "dma", "bf16", {"chunks": TAPER}),
           "fused-fp8-taper": ("fused", "dma", "fp8", {"chunks": TAPER}),
           "fused-taper-two-lanes": ("fused", "dma", "bf16", {"chunks": TAPER, "schedule.lanes": 2}),
           "fused-fp8-taper-two-lanes": ("fused", "dma", "fp8", {"chunks": TAPER, "schedule.lanes": 2})}
ALTERNATIVES = tuple(name for name in OP_ARMS if name not in ARMS)  # named only in a comma list
MORI_NAMES = {"gemm-only": ("gemm-only",), "split-sdma": ("split",), "fused-sdma": ("fused",),
              "fused-lsa": ("fused-lsa",)}
# --pattern: the op's pattern (cco.layout.PATTERNS) and the arms of the sequence-parallel ones
PATTERNS = {"ar": "all-reduce", "rs": "reduce-scatter-rows", "ag": "all-gather"}
SP_ARMS = {"rs": ("scaled_mm+nccl", "symm_mem", "split", "fused"),
           "ag": ("nccl-fp8+scaled_mm", "nccl-bf16+scaled_mm", "symm_mem", "split", "fused")}
# named only in a comma list: the all-gather's consumer forced to a GEMM per chunk or per peer (both
# unmerged) or to one over every peer's slots: the one-GPU benchmark's forced consumers
# (scripts.bench_sp_parts.CONSUMERS; "fused" runs the rule: AG_CONSUMER_ROWS's groups, merged where
# each peer is one), the data for it on a link
SP_ALTERNATIVES = {"ag": {"fused-per-chunk": CONSUMERS["chunks"], "fused-per-peer": CONSUMERS["sources"],
                          "fused-merged": CONSUMERS["merged"]}}
NCCL_ARMS = ("scaled_mm+nccl", "symm_mem", "nccl-fp8+scaled_mm", "nccl-bf16+scaled_mm")  # not on a shared GPU


def description(doc: str) -> str:
    """The first paragraph of a module's docstring in one line: ``--help``'s description."""
    text = " ".join(doc.split("\n\n")[0].split()).replace("``", "")
    return text[:-2] + "." if text.endswith("::") else text


def mode_help() -> str:
    """``--mode``'s help, from the arm tables (ARMS, ALTERNATIVES, MORI_NAMES, SP_ARMS, SP_ALTERNATIVES)."""
    sp_names = "; ".join(f"--pattern {pattern}: {', '.join(arms)}"
                         + (f" (by name only: {', '.join(SP_ALTERNATIVES[pattern])})" if pattern in SP_ALTERNATIVES
                            else "") for pattern, arms in SP_ARMS.items())
    return (f"all (every arm of the pattern), baselines (its cuBLAS, NCCL and symm-mem arms), or a comma list of arms. "
            f"--pattern ar: {', '.join(ARMS)}; by name only: {', '.join(ALTERNATIVES)}; mori's names: "
            f"{', '.join(MORI_NAMES)}. {sp_names}; split-sdma and fused-sdma name split and fused there")


DEFAULT_M, DEFAULT_TRACE_ARM = 16384, "fused"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=description(__doc__), formatter_class=DefaultsHelp)
    p.add_argument("--mode", default="all", help=mode_help())
    p.add_argument("--quant", default="ptpc", choices=Q.QUANTS, help="the fp8 recipe")
    p.add_argument("--pattern", default="ar", choices=tuple(PATTERNS),
                   help="ar: GEMM + all-reduce; rs: GEMM + reduce-scatter along tokens; ag: all-gather + GEMM")
    p.add_argument("--check-only", action="store_true",
                   help="self tests and output checks only, no timing (ranks may share a GPU)")
    p.add_argument("-m", type=int, default=None,
                   help=f"the GEMM's M (default: {DEFAULT_M}; --sweep runs its own Ms, so not with it)")
    p.add_argument("-n", type=int, default=7168, help="the GEMM's N")
    p.add_argument("-k", type=int, default=2048, help="the GEMM's K")
    p.add_argument("--chunks", type=int, default=None,
                   help=f"row chunks per call (1..{layout.MAX_CHUNKS}; default: the backend's)")
    p.add_argument("--passes", type=int, default=3, help="timing passes (>= 3), the arms alternating in each")
    p.add_argument("--iters", type=int, default=20, help="timed calls per arm and pass")
    p.add_argument("--rotate", type=int, default=3, help="input sets cycled through (cold L2)")
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replays instead of eager calls")
    p.add_argument("--sweep", action="store_true", help=f"M in {SWEEP_M}")
    p.add_argument("--plot", default=None, help="PNG path for the --sweep plot (time vs M per arm); needs --sweep")
    p.add_argument("--json", default=None, help="also write the result JSON here (rank 0)")
    p.add_argument("--trace", default=None, help="chrome trace of 3 calls of --trace-arm (rank 0), after timing")
    p.add_argument("--trace-arm", default=None,
                   help=f"the arm --trace profiles, one of --mode's (default: {DEFAULT_TRACE_ARM} where --mode runs "
                        f"it, else --mode's first arm)")
    args = p.parse_args(argv)
    if args.sweep and args.m is not None:
        p.error(f"--sweep runs M in {SWEEP_M}: -m {args.m} would be ignored; pass one or the other")
    if args.m is None:
        args.m = DEFAULT_M
    if args.plot and not args.sweep:
        p.error("--plot draws the --sweep's time over M: pass --sweep with it (one M is the table)")
    if args.trace and args.check_only:
        p.error("--trace profiles timed calls, --check-only times none: pass one or the other")
    if args.trace_arm is not None and not args.trace:
        p.error(f"--trace-arm {args.trace_arm} names the arm --trace profiles: pass --trace PATH with it")
    small = [f"-{name} {getattr(args, name)}" for name in ("m", "n", "k") if getattr(args, name) < 1]
    if small:
        p.error(f"{', '.join(small)}: sizes must be >= 1")
    if args.passes < 3 or args.iters < 1 or args.rotate < 1:
        p.error("--passes >= 3 (a spread needs them), --iters >= 1 and --rotate >= 1")
    if args.chunks is not None and not 1 <= args.chunks <= layout.MAX_CHUNKS:
        p.error(f"--chunks {args.chunks}: pick 1..{layout.MAX_CHUNKS}")
    check_output_dirs(p, args, ("json", "plot", "trace"))
    if args.plot:  # (a suffix matplotlib cannot write would raise only after the whole sweep)
        from scripts.plot_results import check_plot_path

        check_plot_path(p, "--plot", args.plot)
    try:  # here, before main sets up the GPU and the communicator: a misspelt arm is a usage error on any host
        arms = select_arms(args.mode, args.quant, args.pattern)
    except SystemExit as err:
        p.error(str(err))
    if not arms:  # (select_arms drops symm_mem off ptpc and scaled_mm at mxfp8): a run that would time nothing
        p.error(f"--mode {args.mode} has no arm at --pattern {args.pattern} --quant {args.quant} (symm_mem runs "
                f"ptpc only, scaled_mm no mxfp8): pick another --mode or --quant")
    if args.trace:
        if args.trace_arm is None:
            args.trace_arm = DEFAULT_TRACE_ARM if DEFAULT_TRACE_ARM in arms else arms[0]
        elif args.trace_arm not in arms:
            p.error(f"--trace-arm {args.trace_arm} is not an arm this run times (--mode {args.mode} --pattern "
                    f"{args.pattern} --quant {args.quant}: {', '.join(arms) or 'none'})")
    return args


def select_arms(mode: str, quant: str, pattern: str = "ar") -> list[str]:
    if pattern != "ar":
        return _select_sp_arms(mode, quant, pattern)
    if mode == "all":
        arms = list(ARMS)
    elif mode == "baselines":
        arms = ["scaled_mm", "scaled_mm+nccl", "symm_mem"]
    else:
        arms = []
        for part in mode.split(","):
            part = part.strip()
            if part == "split-lsa":
                raise SystemExit("--mode split-lsa: split with the lsa transport is not implemented on CUDA; "
                                 "use split-sdma")
            if part in MORI_NAMES:
                arms.extend(MORI_NAMES[part])
            elif part in ARMS or part in ALTERNATIVES:
                arms.append(part)
            else:
                names = dict.fromkeys(("all", "baselines", *ARMS, *ALTERNATIVES, *MORI_NAMES))  # (each once)
                raise SystemExit(f"--mode {part!r} is not an arm; pick from {', '.join(names)}")
    if quant != "ptpc":  # symm-mem's fused scaled matmul scales rows only
        arms = [a for a in arms if a != "symm_mem"]
    if quant == "mxfp8":  # cuBLAS has no e8m0 block scaling on Hopper (cco.bench.timing.cublas_gemm)
        arms = [a for a in arms if a != "scaled_mm"]
    return list(dict.fromkeys(arms))


def _select_sp_arms(mode: str, quant: str, pattern: str) -> list[str]:
    """The arms of ``--pattern rs | ag`` (``SP_ARMS``) that ``--mode`` names."""
    allowed = SP_ARMS[pattern]
    if mode == "all":
        arms = list(allowed)
    elif mode == "baselines":
        arms = [a for a in allowed if a not in ("split", "fused")]
    else:
        arms = []
        for part in (p.strip() for p in mode.split(",")):
            names = {"split-sdma": "split", "fused-sdma": "fused"}
            part = names.get(part, part)
            if part not in allowed and part not in SP_ALTERNATIVES.get(pattern, {}):
                raise SystemExit(f"--mode {part!r} is not an arm of --pattern {pattern}; pick from all, baselines, "
                                 f"{', '.join((*allowed, *SP_ALTERNATIVES.get(pattern, {})))}, split-sdma, fused-sdma")
            arms.append(part)
    if quant != "ptpc":  # symm-mem's fused scaled matmuls scale rows only
        arms = [a for a in arms if a != "symm_mem"]
    return list(dict.fromkeys(arms))


class Problem:
    """Per rank: ``rotate`` activation sets and one weight, on the GPU, plus the fp32 all-reduced
    reference of set 0."""

    def __init__(self, m, n, k, quant, *, rank, rotate, device, pattern="ar", world=1, group=None):
        self.m, self.n, self.k, self.quant, self.pattern = m, n, k, quant, pattern
        self.rank, self.world, self.group = rank, world, group
        rows = m // world if pattern == "ag" else m  # the all-gather: this rank's share of the rows
        self.sets = []
        for i in range(rotate):
            p = Q.random_problem(rows, n, k, quant, seed=1000 * rank + i, device=device)
            self.sets.append(p)
        from cco.preshuffle import preshuffle_b

        self.b = self.sets[0].b
        self.b_scale = self.sets[0].b_scale
        self.b_pre = preshuffle_b(self.b)
        self.b_t = self.b.t()  # [K, N] column-major, for symm-mem's fused scaled matmul (ptpc)
        self.a_scale_col = [p.a_scale.reshape(rows, 1).float() for p in self.sets] if quant == "ptpc" else None
        # the all-gather's bf16 baseline gathers the rows in bf16 (the anchors' wire format)
        self.a_bf16 = [Q.dequantize_a(p.a, p.a_scale, quant).to(torch.bfloat16) for p in self.sets] \
            if pattern == "ag" else None
        self.b_scale_row = self.b_scale.reshape(1, n).float() if quant == "ptpc" else None
        # cuBLAS's GEMM for this quant (None where it has none: the baseline then runs gemm-only's GEMM)
        self.cublas, self.no_cublas = cublas_gemm(quant, self.b, self.b_scale, fast_accum=FAST_ACCUM)

    def a(self, i):
        return self.sets[i].a, self.sets[i].a_scale

    def reference(self) -> dict[str, torch.Tensor]:
        """For input set 0: the local fp32 partial and ``|A| @ |B|.T``, and their all-reduced
        counterparts (sum of partials, sum of |partials|, sum of ``|A| @ |B|.T``). ``rs``: the
        all-reduced ones of this rank's rows; ``ag``: the local ones of every rank's rows (gathered
        on the host: gloo, so ranks sharing a GPU can check too). Reductions over the ranks run on
        the host (gloo) for the same reason."""
        p = self.sets[0]
        if self.pattern == "ag":
            a = Q.dequantize_a(p.a, p.a_scale, self.quant).cpu()
            every = [torch.empty_like(a) for _ in range(self.world)]
            dist.all_gather(every, a, group=self.group)
            a, b = torch.cat(every).to(p.a.device), Q.dequantize_b(p.b, p.b_scale, self.quant)
            return {"local": a @ b.t(), "dot_abs": a.abs() @ b.abs().t()}
        local, dot_abs = budget_terms(p)  # full fp32 (torch's default precision; TF32 stays off)
        sp = self.pattern != "ar"  # (the all-reduce's reference keeps its device reduction)
        total, abs_sum, dot_abs_sum = allreduce_terms(local, dot_abs, self.group if sp else None, on_host=sp)
        ref = {"local": local, "dot_abs": dot_abs, "total": total, "abs_sum": abs_sum, "dot_abs_sum": dot_abs_sum}
        if self.pattern == "rs":
            rows = slice(self.rank * self.m // self.world, (self.rank + 1) * self.m // self.world)
            ref.update({key: ref[key][rows] for key in ("total", "abs_sum", "dot_abs_sum")})
        return ref


def build_arms(names, prob: Problem, comm, *, chunks, m_max):
    """name -> fn(i) returning the output tensor; plus the ops (for self_test and close)."""
    from cco.op import GemmAllReduceOp
    from kernels_fused.hopper.gemm import fp8_gemm

    if prob.pattern != "ar":
        return build_sp_arms(names, prob, comm, chunks=chunks, m_max=m_max)
    arms, ops = {}, {}
    group = dist.group.WORLD
    quant = prob.quant

    def scaled_mm(i):
        return prob.cublas(*prob.a(i))

    def triton_gemm(i):
        a, a_s = prob.a(i)
        return fp8_gemm(a, prob.b, a_s, prob.b_scale, quant=quant)

    for name in names:
        if name == "scaled_mm":
            if prob.cublas is None:
                print(f"no scaled_mm arm: {prob.no_cublas}")
                continue
            arms[name] = scaled_mm
        elif name == "gemm-only":
            arms[name] = triton_gemm
        elif name == "scaled_mm+nccl":
            local = triton_gemm if prob.cublas is None else scaled_mm

            def fn(i, local=local):
                out = local(i)
                dist.all_reduce(out, group=group)
                return out
            arms[name] = fn
        elif name == "symm_mem":
            import torch.distributed._symmetric_memory as symm_mem

            gname = group.group_name
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(gname)
            m, n, world = prob.m, prob.n, comm.world

            def fn(i, gname=gname, m=m, n=n, world=world):
                a, _ = prob.a(i)
                rs = torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter(
                    a, prob.b_t, prob.a_scale_col[i], prob.b_scale_row, "sum", 0, 0, gname, [m, n],
                    out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM)
                out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
                dist.all_gather_into_tensor(out, rs, group=group)
                return out
            arms[name] = fn
        elif name in OP_ARMS:
            mode, transport, gather, overrides = OP_ARMS[name]
            overrides = dict(overrides)
            op = GemmAllReduceOp(comm, n=prob.n, k=prob.k, m_max=m_max, quant=quant, mode=mode, transport=transport,
                                 gather_dtype=gather, chunks=overrides.pop("chunks", chunks))
            override(op._backend, overrides, what=name)
            ops[name] = op
            arms[name] = _op_arm(op, prob)
    return arms, ops


def _op_arm(op, prob):
    """The arm that calls ``op`` on the problem's i-th activations and its weight."""
    def fn(i):
        a, a_s = prob.a(i)
        return op(a, prob.b_pre, a_s, prob.b_scale)
    return fn


def build_sp_arms(names, prob: Problem, comm, *, chunks, m_max):
    """``build_arms`` for ``--pattern rs | ag`` (``SP_ARMS``): the op arms build
    ``GemmReduceScatterOp(scatter_dim=0)`` / ``AllGatherGemmOp`` on the copy engines."""
    from cco.all_gather import AllGatherGemmOp
    from cco.nn.collectives import all_gather_rows
    from cco.reduce_scatter import GemmReduceScatterOp
    from kernels_fused.hopper.gemm import fp8_gemm

    arms, ops = {}, {}
    group, world, quant, m, n = dist.group.WORLD, comm.world, prob.quant, prob.m, prob.n

    def local_gemm(a, a_s):  # cuBLAS where it has the quant, else the own kernel (as scaled_mm+nccl does)
        return prob.cublas(a, a_s) if prob.cublas is not None else fp8_gemm(a, prob.b, a_s, prob.b_scale, quant=quant)

    def gather_scales(a_s):  # blockscale's column-major scale travels row-major and is laid back
        every = all_gather_rows(a_s.contiguous(), group, world)
        return every.t().contiguous().t() if quant == "blockscale" else every

    for name in names:
        if name == "scaled_mm+nccl":  # rs
            def fn(i):
                full = local_gemm(*prob.a(i))
                out = torch.empty(m // world, n, dtype=full.dtype, device=full.device)
                dist.reduce_scatter_tensor(out, full, group=group)
                return out
        elif name == "nccl-fp8+scaled_mm":
            def fn(i):
                a, a_s = prob.a(i)
                return local_gemm(all_gather_rows(a, group, world), gather_scales(a_s))
        elif name == "nccl-bf16+scaled_mm":
            def fn(i):
                a, a_s = Q.quantize_a(all_gather_rows(prob.a_bf16[i], group, world).float(), quant)
                return local_gemm(a, a_s)
        elif name == "symm_mem":
            import torch.distributed._symmetric_memory as symm_mem

            gname = group.group_name
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(gname)
            if prob.pattern == "rs":
                def fn(i, gname=gname):
                    return torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter(
                        prob.sets[i].a, prob.b_t, prob.a_scale_col[i], prob.b_scale_row, "sum", 0, 0, gname, [m, n],
                        out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM)
            else:
                def fn(i, gname=gname):
                    _, outs = torch.ops.symm_mem.fused_all_gather_scaled_matmul(
                        prob.sets[i].a, [prob.b_t], prob.a_scale_col[i], [prob.b_scale_row], 0, gname, [None], [None],
                        [torch.bfloat16], [FAST_ACCUM])
                    return outs[0]
        else:  # split, fused (and the consumer's alternatives): the op
            consumer = SP_ALTERNATIVES.get(prob.pattern, {}).get(name)
            kw = dict(n=n, k=prob.k, m_max=m_max, quant=quant, mode="fused" if consumer else name, transport="dma",
                      chunks=chunks)
            op = GemmReduceScatterOp(comm, scatter_dim=0, **kw) if prob.pattern == "rs" else AllGatherGemmOp(comm, **kw)
            if consumer:
                override(op._backend, consumer, what=name)
            ops[name] = op
            fn = _op_arm(op, prob)
        arms[name] = fn
    return arms, ops


def check_arms(arms, prob: Problem, *, rank) -> dict:
    """Each arm's output for input set 0 against the fp32 reference: element-wise (the budgets of
    :func:`cco.bench.timing.gemm_mismatches` and :func:`cco.bench.timing.allreduce_mismatches`) and
    relative L2."""
    ref = prob.reference()
    report = {}
    for name, fn in arms.items():
        out = fn(0)
        if out.is_cuda:  # (CPU ranks check the op arms' wiring: tests/python/cco/test_bench_args.py)
            torch.cuda.synchronize()
        fp8 = prob.pattern == "ar" and name in OP_ARMS and OP_ARMS[name][2] == "fp8"
        if name == "nccl-bf16+scaled_mm":  # requantized after the gather: other e4m3 values, 5% element-wise
            err, bad = Q.rel_l2(out, ref["local"]), Q.count_mismatches(out, ref["local"])
        elif name in ("scaled_mm", "gemm-only") or prob.pattern == "ag":
            err, bad = Q.rel_l2(out, ref["local"]), gemm_mismatches(out, ref["local"], ref["dot_abs"])
        else:
            err = Q.rel_l2(out, ref["total"])
            bad = allreduce_mismatches(out, ref["total"], ref["abs_sum"], ref["dot_abs_sum"], fp8_gather=fp8)
        tol = Q.REL_L2_TOL_FP8_GATHER if fp8 else Q.REL_L2_TOL[prob.quant]
        report[name] = {"rel_l2": err, "bad_elements": bad, "ok": bool(err <= tol and bad == 0)}
    del ref
    return report


def run_shape(args, comm, m, *, arms_wanted, m_max, progress=None) -> dict:
    rank = comm.rank
    prob = Problem(m, args.n, args.k, args.quant, rank=rank, rotate=args.rotate, device=comm.device,
                   pattern=args.pattern, world=comm.world, group=comm.group)
    arms, ops = build_arms(arms_wanted, prob, comm, chunks=args.chunks, m_max=m_max)
    from cco.transport.protocol import SelfTestError

    self_tests = {}
    call_rows = m // comm.world if args.pattern == "ag" else m  # what one call of the op passes
    for name, op in list(ops.items()):
        if not op.publishes:  # gemm-only, or one rank: no bytes move, so there is no self test
            continue
        try:
            self_tests[name] = op.self_test(m=call_rows)
        except SelfTestError as err:  # bytes did not move: this arm may not post a time
            self_tests[name] = {"error": str(err)}
            arms.pop(name)
        except Exception as err:  # the self-test itself broke; the output check below still gates
            self_tests[name] = {"error": f"{type(err).__name__}: {err}"}
    correctness = check_arms(arms, prob, rank=rank)
    failed = [n for n, r in correctness.items() if not r["ok"]]
    if failed:
        for n in failed:
            arms.pop(n)
    if args.check_only:
        for op in ops.values():
            op.close()
        return {"m": m, "n": args.n, "k": args.k, "quant": args.quant, "pattern": args.pattern, "world": comm.world,
                "check_only": True, "arms": {}, "correctness": correctness, "dropped_for_wrong_output": failed,
                "self_test": self_tests}
    timed, eager_arms = graphed(arms, args.rotate) if args.graph else (arms, list(arms))
    idle_before = idle_check()
    timings = time_arms(timed, passes=args.passes, iters=args.iters, rotate=args.rotate,
                        on_pass=(lambda p: progress(p)) if progress else None)
    idle_after = idle_check()
    if args.trace and args.trace_arm in timed:
        trace(timed[args.trace_arm], args.trace, rank=rank)
    elif args.trace and rank == 0:  # (parse_args took it from --mode's arms: its check or self test failed)
        print(f"--trace: {args.trace_arm} posted no time at M={m}; no trace written", file=sys.stderr)
    for op in ops.values():
        op.close()
    baseline_gemm = "fp8_gemm" if prob.cublas is None else "cublas"  # what scaled_mm+nccl's GEMM was
    del timed, arms, prob
    torch.cuda.empty_cache()
    base = "scaled_mm+nccl" if "scaled_mm+nccl" in timings else None
    gemm_ref = "scaled_mm" if "scaled_mm" in timings else None
    rows = {}
    for name, t in timings.items():
        row = t.as_dict()
        if name in ("scaled_mm", "gemm-only"):
            row["tflops"] = round(tflops(m, args.n, args.k, t.median_us), 1)
        if base:
            row["x_split_baseline"] = round(t.median_us / timings[base].median_us, 3)
        if gemm_ref and name == "gemm-only":
            row["throughput_vs_scaled_mm"] = round(timings[gemm_ref].median_us / t.median_us, 3)
        if name in ops:
            row["chunks"] = ops[name].config.chunks
        rows[name] = row
    return {"m": m, "n": args.n, "k": args.k, "quant": args.quant, "pattern": args.pattern, "world": comm.world,
            "graph": args.graph,
            "eager_arms": eager_arms, "baseline_gemm": baseline_gemm,
            "chunks": args.chunks or "backend default", "arms": rows, "correctness": correctness,
            "dropped_for_wrong_output": failed, "self_test": self_tests,
            "idle_before": idle_before, "idle_after": idle_after}


def trace(fn, path, *, rank):
    """Profile three calls of ``fn`` (kernels and copies on every stream) into a chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    token = torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for i in range(3):
            dist.all_reduce(token)  # device-side rendezvous, as in the timed loop
            fn(i % 2)
        torch.cuda.synchronize()
    if rank == 0:
        prof.export_chrome_trace(path)


def print_table(res, file=sys.stdout):
    if res.get("check_only"):
        print(f"[{res['m']}, {res['n']}] K={res['k']} {res['quant']} --pattern {res['pattern']} world={res['world']} "
              f"check only", file=file)
        for name, r in res["correctness"].items():
            test = res["self_test"].get(name, {})
            print(f"  {name:20s} {'ok' if r['ok'] else 'WRONG'}: rel L2 {r['rel_l2']:.2e}, {r['bad_elements']} "
                  f"elements off{'; self test: ' + test.get('error', 'passed') if name in res['self_test'] else ''}",
                  file=file)
        for name, test in res["self_test"].items():  # (an arm whose bytes did not move is not checked)
            if name not in res["correctness"] and "error" in test:
                print(f"  {name:20s} SELF TEST FAILED, not checked: {test.get('error', '?')}", file=file)
        return
    print(f"[{res['m']}, {res['n']}] K={res['k']} {res['quant']} --pattern {res.get('pattern', 'ar')} "
          f"world={res['world']} {'graph' if res['graph'] else 'eager'} chunks={res['chunks']}", file=file)
    for name, r in res["arms"].items():
        extra = f" | {r['tflops']:7.1f} TFLOP/s" if "tflops" in r else ""
        ratio = f" | {r['x_split_baseline']:.3f}x scaled_mm+nccl" if "x_split_baseline" in r else ""
        print(f"  {name:16s} {r['median_us']:9.1f} us (spread {100 * r['spread']:4.1f}%){extra}{ratio}", file=file)
    for name in res.get("dropped_for_wrong_output", ()):
        r = res["correctness"][name]
        print(f"  {name:16s} WRONG, not timed: rel L2 {r['rel_l2']:.2e}, {r['bad_elements']} elements off", file=file)
    for name, test in res.get("self_test", {}).items():
        if "error" in test:
            timed = "timed" if name in res["arms"] else "not timed"
            print(f"  {name:16s} SELF TEST FAILED ({timed}): {test['error']}", file=file)


def failures(results) -> list[str]:
    """Every arm whose output check or self test failed in ``results`` (``run_shape``'s records):
    ``"M=<m> <arm>: <what>"``; empty when every check passed."""
    out = []
    for res in results:
        for name, r in res.get("correctness", {}).items():
            if not r["ok"]:
                out.append(f"M={res['m']} {name}: wrong output (rel L2 {r['rel_l2']:.2e}, {r['bad_elements']} "
                           f"elements off)")
        for name, test in res.get("self_test", {}).items():
            if "error" in test:
                out.append(f"M={res['m']} {name}: self test failed: {test['error']}")
    return out


def exit_status(comm, results) -> int:
    """1 where any rank saw an arm fail its check or self test (each rank checks its own output), else
    0: the same status on every rank, so a launcher reports the job as one."""
    failed = bool(failures(results))
    if comm is not None and comm.world > 1:
        failed = any(comm.all_gather_object(failed))
    return 1 if failed else 0


# --pattern -> what a plot's title calls the run
PATTERN_TITLES = {"ar": "GEMM + all-reduce", "rs": "GEMM + reduce-scatter (rows)", "ag": "all-gather + GEMM"}


def plot_title(res: dict) -> str:
    """The --sweep plot's title: the pattern (an rs or ag run is no all-reduce), shape, quant, world."""
    pattern = res.get("pattern", "ar")
    return (f"{PATTERN_TITLES.get(pattern, pattern)} (--pattern {pattern}) N={res['n']} K={res['k']} {res['quant']} "
            f"world={res['world']}")


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(dict.fromkeys(n for r in results for n in r["arms"]))
    for name in names:
        pts = [(r["m"], r["arms"][name]["median_us"]) for r in results if name in r["arms"]]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    r0 = results[0]
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("M (rows)")
    ax.set_ylabel("time (us), median over passes, max over ranks")
    ax.set_title(plot_title(r0))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def launch_command(argv=None) -> str:
    """The command line as launched, as far as Python can tell: under torchrun (which sets
    ``LOCAL_WORLD_SIZE`` and ``WORLD_SIZE``) ``torchrun --nproc-per-node W [--nnodes N]``, else
    ``python3``, then ``-m scripts.bench_gemm_ar`` and the arguments: a JSON's way to rerun it."""
    head = "python3"
    if "LOCAL_WORLD_SIZE" in os.environ and "WORLD_SIZE" in os.environ:
        local, world = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
        head = f"torchrun --nproc-per-node {local}" + (f" --nnodes {world // local}" if world > local else "")
    return f"{head} -m scripts.bench_gemm_ar " + " ".join(sys.argv[1:] if argv is None else argv)


class _PassLines:
    """``--sweep``'s progress where tqdm is not installed: a line per timed pass on stderr, flushed (so a
    log read while the sweep runs shows it)."""

    def __init__(self, total: int):
        self.total, self.done = total, 0

    def update(self, n: int = 1) -> None:
        self.done += n
        print(f"sweep: {self.done}/{self.total} passes", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def sweep_progress(total: int):
    """Rank 0's ``--sweep`` progress bar: tqdm's, else ``_PassLines``. tqdm is in the [bench] extra, not
    [nvidia]: an ImportError on rank 0 alone, after the communicator is up, would leave its peers waiting in
    a collective."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _PassLines(total)
    return tqdm(total=total, desc="sweep", unit="pass", file=sys.stderr)


def main(argv=None) -> int:
    args = parse_args(argv)
    from cco.comm import Communicator

    require_cuda("bench_gemm_ar")  # (run_shape's checks run on CPU ranks in tests; main times on GPUs)
    comm = Communicator.from_env()
    if comm.device.type != "cuda":
        comm.close()
        raise SystemExit(f"bench_gemm_ar: rank {comm.rank} got device {comm.device}; the benchmark needs a CUDA "
                         f"GPU per rank")
    torch.cuda.set_device(comm.device)
    arms_wanted = select_arms(args.mode, args.quant, args.pattern)
    if not args.check_only:
        require_a_gpu_per_rank(comm, "bench_gemm_ar")
    else:
        from cco.window import ranks_share_a_device

        if ranks_share_a_device(comm):
            left_out = [a for a in arms_wanted if a in NCCL_ARMS]
            arms_wanted = [a for a in arms_wanted if a not in NCCL_ARMS]
            if left_out and comm.rank == 0:
                print(f"ranks share a GPU: NCCL refuses them, so {', '.join(left_out)} are left out")
    ms = SWEEP_M if args.sweep else (args.m,)
    if args.pattern != "ar" and any(m % comm.world for m in ms):
        raise SystemExit(f"bench_gemm_ar: --pattern {args.pattern} splits M over the ranks: pass -m a multiple of "
                         f"world={comm.world}")
    results = []
    bar = sweep_progress(len(ms) * args.passes) if args.sweep and comm.rank == 0 else None
    for m in ms:
        res = run_shape(args, comm, m, arms_wanted=arms_wanted, m_max=m,
                        progress=(lambda p: bar.update(1)) if bar else None)
        results.append(res)
        if comm.rank == 0:
            print_table(res)
            sys.stdout.flush()
    if bar:
        bar.close()
    if comm.rank == 0:
        payload = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "command": launch_command(argv), "results": results,
                   **({"plot": args.plot} if args.plot else {})}  # (parse_args: --plot only with --sweep)
        # the JSON and its RESULT_JSON line first: a plot that fails still leaves the sweep's numbers
        if args.json:
            with open(args.json, "w") as f:
                json.dump(payload, f, indent=1)
        print("RESULT_JSON " + json.dumps(payload), flush=True)
        if args.plot:
            plot(results, args.plot)
    status = exit_status(comm, results)  # (a collective: every rank calls it)
    if status and comm.rank == 0:
        print("bench_gemm_ar: FAILED: " + ("; ".join(failures(results)) or "a check failed on another rank"),
              file=sys.stderr)
    comm.barrier()
    comm.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
