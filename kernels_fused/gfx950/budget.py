"""Static ISA budget of the gfx950 kernel: what one compiled variant spends where, and its limits.

:func:`profile` reads any 8-wave fp8 GEMM of this pipeline family from its final ISA alone (no
schedule needed, so the same counts apply to an upstream FlyDSL build) and splits it in three:

* **prologue**: every instruction before the first ``ds_read`` (argument loads, index arithmetic,
  the first two K tiles' DMA issue and their waits);
* **one main-loop iteration**: the middle K step of the unrolled loop, the instructions between the
  ``2 + 8 k``-th and the ``2 + 8 (k + 1)``-th unconditional ``s_barrier`` (two prologue waits, then
  eight barriers per K step: four stage barriers and four MFMA-call barriers);
* **epilogue**: every instruction after the last MFMA (C stores, their scales, the fused publish).

:func:`check` compares a profile of our kernel with the limits of :func:`limits` (the schedule's
per-step counts, the epilogue's store count and width, full drains, spills, VGPRs, LDS bytes) and
returns one line per violated limit, so a regression fails a test (``tests/python/cco/
test_gfx950_budget.py``). ``python -m kernels_fused.gfx950.budget`` prints the table of a sweep.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass

from .isa import Instr, parse, resources

PROLOGUE_WAIT_BARRIERS = 2  # wait_barrier(A+B) and wait_barrier(A+2B): the prologue's unconditional barriers
BARRIERS_PER_STEP = 8  # four stage barriers and four MFMA-call barriers per K step
VGPR_LIMIT = 256  # architectural VGPRs per lane at 2 waves per SIMD (8 waves, one workgroup per CU)

_STORE = re.compile(r"^(buffer|global|flat)_store_(byte|short|dwordx2|dwordx3|dwordx4|dword|b8|b16|b32|b64|b96|b128)$")
_STORE_BYTES = {"byte": 1, "b8": 1, "short": 2, "b16": 2, "dword": 4, "b32": 4, "dwordx2": 8, "b64": 8,
                "dwordx3": 12, "b96": 12, "dwordx4": 16, "b128": 16}


def store_bytes(ins: Instr) -> int | None:
    """Bytes each lane writes with this global store (None: not a global store)."""
    m = _STORE.match(ins.op)
    return None if m is None else _STORE_BYTES[m.group(2)]


@dataclass(frozen=True)
class Region:
    """Instruction counts of one stretch of the kernel."""

    instructions: int = 0
    valu: int = 0  # v_* other than MFMA
    salu: int = 0  # s_* other than waits, barriers, branches and s_nop
    mfma: int = 0
    dma: int = 0  # buffer_load_dwordx4 ... lds
    vm_loads: int = 0  # global/buffer loads into registers (scales)
    atomics: int = 0  # the fused publish
    ds_read: int = 0
    ds_write: int = 0
    barriers: int = 0
    scratch: int = 0  # spill traffic
    stores: int = 0  # global stores
    store_bytes: tuple = ()  # the distinct per-lane widths of those stores, in bytes
    full_drains: int = 0  # s_waitcnt vmcnt(0)
    store_waits: int = 0  # vmcnt waits that force at least one global store to complete


def _region(instrs: list[Instr]) -> Region:
    c = dict(instructions=len(instrs), valu=0, salu=0, mfma=0, dma=0, vm_loads=0, atomics=0, ds_read=0, ds_write=0,
             barriers=0, scratch=0, stores=0, full_drains=0, store_waits=0)
    widths = set()
    vm = []  # per outstanding VM op in issue order: is it a store
    for ins in instrs:
        op = ins.op
        width = store_bytes(ins)
        if op.startswith("scratch_"):
            c["scratch"] += 1
            vm.append(False)
        elif width is not None:
            c["stores"] += 1
            widths.add(width)
            vm.append(True)
        elif ins.kind == "dma":
            c["dma"] += 1
            vm.append(False)
        elif ins.kind == "vm":
            c["atomics" if "atomic" in op else "vm_loads"] += 1
            vm.append(False)
        elif ins.kind == "ds_read":
            c["ds_read"] += 1
        elif op.startswith("ds_write"):
            c["ds_write"] += 1
        elif ins.kind == "mfma":
            c["mfma"] += 1
        elif ins.kind == "barrier":
            c["barriers"] += 1
        elif ins.kind == "waitcnt" and "vmcnt" in ins.counts():
            n = ins.counts()["vmcnt"]
            c["full_drains"] += n == 0
            done = vm[: max(0, len(vm) - n)]
            c["store_waits"] += any(done)
            vm = vm[len(done):]
        elif op.startswith("v_"):
            c["valu"] += 1
        elif op.startswith("s_") and op != "s_nop" and ins.kind not in ("branch", "waitcnt"):
            c["salu"] += 1
    return Region(store_bytes=tuple(sorted(widths)), **c)


@dataclass(frozen=True)
class Profile:
    """The three regions of one compiled kernel and its resources."""

    total: int
    prologue: Region
    iteration: Region | None  # None: the main loop never runs (K = 256)
    epilogue: Region
    loop_scratch: int  # spill instructions anywhere between the first and the last MFMA
    vgprs: int
    vgpr_spills: int
    scratch_bytes: int
    lds_bytes: int

    def row(self) -> dict:
        """A flat dict of the headline counts (the columns of the comparison tables)."""
        it = self.iteration or Region()
        return {"instructions": self.total, "prologue": self.prologue.instructions,
                "prologue VALU": self.prologue.valu,
                "iteration": it.instructions, "iteration MFMA": it.mfma, "iteration DMA": it.dma,
                "iteration ds_read": it.ds_read, "iteration barriers": it.barriers,
                "iteration VALU": it.valu, "loop scratch ops": self.loop_scratch,
                "epilogue": self.epilogue.instructions, "epilogue stores": self.epilogue.stores,
                "store bytes/lane": "/".join(map(str, self.epilogue.store_bytes)) or "-",
                "epilogue scale loads": self.epilogue.vm_loads,
                "full drains": self.epilogue.full_drains, "store waits": self.epilogue.store_waits,
                "epilogue ds_write": self.epilogue.ds_write, "epilogue ds_read": self.epilogue.ds_read,
                "VGPRs": self.vgprs, "spilled VGPRs": self.vgpr_spills, "scratch B": self.scratch_bytes,
                "LDS B": self.lds_bytes}


def profile(isa: str, *, k_tiles: int) -> Profile:
    """Split the kernel in ``isa`` (``k_tiles`` = K / 128 K steps) into its regions and count them."""
    instrs = parse(isa)
    res = resources(isa)
    first_read = next(i for i, x in enumerate(instrs) if x.kind == "ds_read")
    mfmas = [i for i, x in enumerate(instrs) if x.kind == "mfma"]
    first_mfma, last_mfma = mfmas[0], mfmas[-1]
    iteration = None
    if k_tiles >= 3:  # the main loop runs k_tiles - 2 times; take its middle step
        bars = [i for i, x in enumerate(instrs) if x.kind == "barrier" and not x.conditional]
        k = (k_tiles - 2) // 2
        lo = bars[PROLOGUE_WAIT_BARRIERS + BARRIERS_PER_STEP * k - 1]
        hi = bars[PROLOGUE_WAIT_BARRIERS + BARRIERS_PER_STEP * (k + 1) - 1]
        iteration = _region(instrs[lo + 1:hi + 1])
    return Profile(total=len(instrs), prologue=_region(instrs[:first_read]), iteration=iteration,
                   epilogue=_region(instrs[last_mfma + 1:]),
                   loop_scratch=sum(x.op.startswith("scratch_") for x in instrs[first_mfma:last_mfma]),
                   vgprs=res.vgprs, vgpr_spills=res.vgpr_spills, scratch_bytes=res.scratch_bytes,
                   lds_bytes=res.lds_bytes)


# --------------------------------------------------------------------------------------------------
# limits: what every variant of our kernel must stay within
# --------------------------------------------------------------------------------------------------
PROLOGUE_LIMIT = 240  # instructions; measured max 185 (2026-12-02 sweep), upstream 287, this kernel before 360-390
VALU_PER_MFMA = 8  # blockscale's fold is 6 VALU per MFMA (sa * sb, * part, + acc); the rest is scheduling slack


@dataclass(frozen=True)
class Limits:
    """The budget of one variant. ``None``: not limited."""

    iteration_mfma: int  # exactly the schedule's, per K step
    iteration_dma: int  # exactly
    iteration_ds_read: int  # exactly
    iteration_barriers: int  # exactly
    iteration_full_drains: int  # at most: no s_waitcnt vmcnt(0) inside a K step
    iteration_valu: int  # at most
    prologue: int  # at most, instructions
    epilogue_stores: int  # at most, per wave
    store_bytes: int  # every store writes this many bytes per lane
    store_waits: int  # at most: vmcnt waits that force a C store to complete (the fused publish: 1)
    epilogue_scale_loads: int  # at most
    vgprs: int  # at most
    vgpr_spills: int  # at most
    scratch_bytes: int  # at most
    lds_bytes: int  # exactly


def limits(cfg) -> Limits:
    """The budget of ``cfg`` (a ``kernel.KernelConfig``), from its schedule and stage layout."""
    from kernels_fused.pipeline import schedule as S

    from .byte_layout import CStage, C_GRANULE

    sched = cfg.schedule()
    g = sched.geometry
    step = [op for ph, op in sched.program() if ph.section == "loop" and ph.step == 0]
    mfmas = sum(g.n_tiles_a * g.n_tiles_b for op in step if isinstance(op, S.Mfma))
    scale_loads = sum(op.n_vm for op in step if isinstance(op, S.ScaleLoad))
    dma = sum(op.n_vm for op in step if isinstance(op, S.LoadTile))
    valu = {"ptpc": 0,  # as upstream: every address is formed before the loop
            "mxfp8": scale_loads + dma,  # at most one add per scale load and per DMA load
            "blockscale": VALU_PER_MFMA * mfmas + scale_loads + dma}[cfg.quant]
    stage = CStage(n_a=g.n_tiles_a, n_b=g.n_tiles_b)
    return Limits(
        iteration_mfma=mfmas, iteration_dma=dma,
        iteration_ds_read=sum(2 * (g.n_tiles_a if op.half[0] == "A" else g.n_tiles_b)
                              for op in step if isinstance(op, S.LdsRead)),
        iteration_barriers=sum(op.is_barrier for op in step), iteration_full_drains=0, iteration_valu=valu,
        prologue=PROLOGUE_LIMIT, epilogue_stores=4 * stage.stores, store_bytes=C_GRANULE,
        store_waits=1 if cfg.fuse else 0,
        epilogue_scale_loads=sum(g.epilogue_scale_vm(h) for h in S.HALVES), vgprs=VGPR_LIMIT, vgpr_spills=0,
        scratch_bytes=0, lds_bytes=cfg.lds_bytes)


def check(prof: Profile, lim: Limits) -> list[str]:
    """One line per limit ``prof`` violates (empty: within budget)."""
    bad = []

    def want(what, got, limit, exact=False):
        if (got != limit) if exact else (got > limit):
            bad.append(f"{what}: {got}, {'must be' if exact else 'limit'} {limit}")

    it = prof.iteration
    if it is not None:
        want("MFMA per K step", it.mfma, lim.iteration_mfma, exact=True)
        want("DMA loads per K step", it.dma, lim.iteration_dma, exact=True)
        want("ds_read per K step", it.ds_read, lim.iteration_ds_read, exact=True)
        want("barriers per K step", it.barriers, lim.iteration_barriers, exact=True)
        want("s_waitcnt vmcnt(0) in a K step", it.full_drains, lim.iteration_full_drains)
        want("VALU per K step", it.valu, lim.iteration_valu)
        want("spill instructions in the main loop", prof.loop_scratch, 0)
    want("prologue instructions", prof.prologue.instructions, lim.prologue)
    ep = prof.epilogue
    want("epilogue stores per wave", ep.stores, lim.epilogue_stores)
    if ep.store_bytes != (lim.store_bytes,):
        bad.append(f"store bytes per lane: {'/'.join(map(str, ep.store_bytes))}, must be {lim.store_bytes}")
    want("waits on C stores", ep.store_waits, lim.store_waits)
    want("epilogue scale loads", ep.vm_loads, lim.epilogue_scale_loads)
    want("VGPRs", prof.vgprs, lim.vgprs)
    want("spilled VGPRs", prof.vgpr_spills, lim.vgpr_spills)
    want("scratch bytes", prof.scratch_bytes, lim.scratch_bytes)
    want("LDS bytes", prof.lds_bytes, lim.lds_bytes, exact=True)
    return bad


# --------------------------------------------------------------------------------------------------
# the sweep
# --------------------------------------------------------------------------------------------------
SWEEP_K = (256, 384, 512, 1024, 2048, 8192)
SWEEP_QUANTS = ("ptpc", "blockscale", "mxfp8")
SWEEP_TILES = ("256x256", "128x256", "256x128")
COLUMNS = ("prologue", "iteration", "iteration VALU", "epilogue", "epilogue stores", "store bytes/lane",
           "store waits", "full drains", "VGPRs", "spilled VGPRs", "scratch B")


def budget_variant(args) -> tuple:
    """(quant, tile, K, fuse) -> (the same, profile row, violations): compiles one variant."""
    from .isa import compile_variant

    quant, tile, K, fuse = args
    cfg, isa = compile_variant(quant=quant, tile=tile, K=K, fuse=fuse)
    prof = profile(isa, k_tiles=cfg.k_tiles)
    return args, prof.row(), check(prof, limits(cfg))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernels_fused.gfx950.budget",
                                 description="Compile variants for gfx950 and check each against its ISA budget.")
    ap.add_argument("--quant", nargs="+", default=SWEEP_QUANTS, choices=SWEEP_QUANTS)
    ap.add_argument("--tile", nargs="+", default=SWEEP_TILES, choices=SWEEP_TILES)
    ap.add_argument("-k", "--K", nargs="+", type=int, default=SWEEP_K, dest="K")
    ap.add_argument("--mode", nargs="+", default=("gemm-only", "fused"), choices=("gemm-only", "fused"))
    ap.add_argument("--jobs", type=int, default=2, help="compiles in parallel (processes)")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = ap.parse_args(argv)

    from .toolchain import cli_unavailable

    if (status := cli_unavailable("kernels_fused.gfx950.budget")) is not None:
        return status
    jobs = [(q, t, k, m == "fused") for q in args.quant for t in args.tile for k in args.K for m in args.mode]
    sep = " | " if args.markdown else "  "
    head = ["quant", "tile", "K", "mode", "budget", *COLUMNS]
    print(("| " + sep.join(head) + " |") if args.markdown else sep.join(head))
    if args.markdown:
        print("|" + "---|" * len(head))
    failed = 0
    with _pool(args.jobs) as pool:
        for (quant, tile, K, fuse), row, bad in pool.map(budget_variant, jobs):
            cells = [quant, tile, str(K), "fused" if fuse else "gemm-only", "FAIL" if bad else "PASS",
                     *(str(row[c]) for c in COLUMNS)]
            print(("| " + sep.join(cells) + " |") if args.markdown else sep.join(cells), flush=True)
            for line in bad:
                print(f"    over budget: {line}")
            failed += bool(bad)
    print(f"{failed} of {len(jobs)} variant(s) over budget")
    return 1 if failed else 0


def _pool(jobs: int):
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(max_workers=max(1, jobs))


if __name__ == "__main__":
    sys.exit(main())
