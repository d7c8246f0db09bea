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
from dataclasses import asdict, dataclass

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
    vm_loads: int = 0  # global/buffer loads into registers (scales, tile table)
    ds_read: int = 0
    ds_write: int = 0
    barriers: int = 0
    scratch: int = 0  # spill traffic
    stores: int = 0  # global stores
    store_bytes: tuple = ()  # the distinct per-lane widths of those stores, in bytes
    full_drains: int = 0  # s_waitcnt vmcnt(0)
    store_waits: int = 0  # vmcnt waits that force at least one global store to complete


def _region(instrs: list[Instr]) -> Region:
    c = dict(instructions=len(instrs), valu=0, salu=0, mfma=0, dma=0, vm_loads=0, ds_read=0, ds_write=0,
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
            c["vm_loads"] += 1
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
