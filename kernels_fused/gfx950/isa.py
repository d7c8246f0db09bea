"""Read the compiled gfx950 ISA of the fused GEMM and check it against the pipeline schedule.

The kernel's pipeline is emitted from :mod:`kernels_fused.pipeline.schedule`, and the happens-before checker
proves that schedule. This module closes the loop on the compiled code: it parses the final ISA,
splits the kernel body into *intervals* between ``s_barrier`` instructions, and checks

1. structure, against the schedule the kernel was compiled from: the same barriers (including the
   ones only one wave group executes, which sit in a branch), and in every interval exactly the
   global->LDS DMA loads (``buffer_load_dwordx4 ... lds``), the LDS reads (``ds_read*``) and the
   MFMAs the schedule puts there; an LDS read the compiler moved across a barrier shows here;
2. completion, against the compiled schedule itself (every drain it counts on at a barrier, the
   compiler's ``WaitVm`` before a scale consumer included, is in the ISA) and against a *reference*
   schedule (``shipped`` unless told otherwise: the one the happens-before checker proves): at every barrier, every DMA load the reference has drained by
   then (through ``wait_barrier(n)`` or a compiler wait it accounts for) must be drained in the
   ISA too, counting the ``s_waitcnt vmcnt`` values the ISA actually carries with every VM
   instruction it actually issues (scale and tile-table loads included); and where the reference
   has ``read_done_barrier()``, every LDS read issued before it must be retired
   (``s_waitcnt lgkmcnt``).

So ``upstream`` compiled the same way fails on its tail (``K-2 S1``: a bare barrier where the
reference drains the final tiles) and at S0 (no ``lgkmcnt(0)``), and ``shipped`` passes.

CLI::

    python -m kernels_fused.gfx950.isa --quant ptpc --tile 256x256 -k 256 [--fuse] [--variant upstream]
    python -m kernels_fused.gfx950.isa --check-all      # every variant; exit status 1 on any mismatch
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from dataclasses import dataclass, field

# --------------------------------------------------------------------------------------------------
# parsing
# --------------------------------------------------------------------------------------------------
_VM_LOAD = re.compile(r"^(buffer_load|global_load|flat_load|scratch_load|buffer_atomic|global_atomic|flat_atomic)")
_VM_STORE = re.compile(r"^(buffer_store|global_store|flat_store|scratch_store)")
_ATOMIC = re.compile(r"^(buffer_atomic|global_atomic|flat_atomic)_add")
_WAITCNT = re.compile(r"(vmcnt|lgkmcnt|expcnt)\((\d+)\)")


@dataclass(frozen=True)
class Instr:
    line: int  # 1-based line in the .s file
    op: str  # mnemonic
    text: str  # the whole instruction
    kind: str  # dma | vm | ds_read | lgkm | mfma | barrier | waitcnt | branch | other
    conditional: bool = False  # inside a forward branch (a barrier only one wave group runs)

    def counts(self) -> dict:
        return {k: int(v) for k, v in _WAITCNT.findall(self.text)}


def _kind(op: str, text: str) -> str:
    if op == "s_barrier":
        return "barrier"
    if op == "s_waitcnt":
        return "waitcnt"
    if op.startswith("buffer_load") and re.search(r"\blds\b", text):
        return "dma"
    if _VM_LOAD.match(op) or _VM_STORE.match(op):
        return "vm"  # gfx9: vmcnt counts loads, stores and atomics
    if op.startswith("ds_read"):
        return "ds_read"
    if op.startswith("ds_") or op.startswith("s_load") or op.startswith("s_buffer_load"):
        return "lgkm"
    if op.startswith("v_mfma"):
        return "mfma"
    if op.startswith("s_cbranch") or op == "s_branch":
        return "branch"
    return "other"


def kernel_body(isa: str) -> list[tuple[int, str]]:
    """(line number, text) of the kernel's code: from its entry label to ``s_endpgm``."""
    lines = isa.splitlines()
    start = next((i for i, ln in enumerate(lines) if re.match(r"^[A-Za-z_][\w.]*:\s*(;.*)?$", ln)
                  and not ln.startswith(".")), None)
    if start is None:
        raise ValueError("no kernel entry label in the ISA text")
    out = []
    for i in range(start + 1, len(lines)):
        text = lines[i].split(";", 1)[0].strip()
        if text:
            out.append((i + 1, text))
        if text == "s_endpgm":
            break
    return out


def parse(isa: str) -> list[Instr]:
    """The kernel's instructions, with forward-branch regions marked ``conditional``.

    Every region between ``s_cbranch_* L`` and a later ``L:`` is conditional (the lag and close
    barriers, the counter bump of one thread); the pipeline itself has no branch (K is unrolled).
    """
    body = kernel_body(isa)
    out, open_targets = [], set()
    for line, text in body:
        if text.endswith(":"):
            open_targets.discard(text[:-1])
            continue
        if text.startswith("."):
            continue
        op = text.split()[0]
        kind = _kind(op, text)
        out.append(Instr(line=line, op=op, text=text, kind=kind, conditional=bool(open_targets)))
        if kind == "branch" and op.startswith("s_cbranch"):
            open_targets.add(text.split()[-1])
    return out


@dataclass(frozen=True)
class Resources:
    vgprs: int
    agprs: int
    sgprs: int
    vgpr_spills: int
    sgpr_spills: int
    lds_bytes: int
    scratch_bytes: int

    def line(self) -> str:
        return (f"VGPRs {self.vgprs} AGPRs {self.agprs} SGPRs {self.sgprs} spills v{self.vgpr_spills}/"
                f"s{self.sgpr_spills} LDS {self.lds_bytes} B scratch {self.scratch_bytes} B")


def resources(isa: str) -> Resources:
    def meta(key: str) -> int:
        m = re.search(rf"^[\s-]*\.{key}:\s+(\d+)", isa, re.M)
        if m is None:
            raise ValueError(f"metadata .{key} not found in the ISA")
        return int(m.group(1))

    return Resources(vgprs=meta("vgpr_count"), agprs=meta("agpr_count"), sgprs=meta("sgpr_count"),
                     vgpr_spills=meta("vgpr_spill_count"), sgpr_spills=meta("sgpr_spill_count"),
                     lds_bytes=meta("group_segment_fixed_size"), scratch_bytes=meta("private_segment_fixed_size"))


# --------------------------------------------------------------------------------------------------
# what the schedule says, per interval
# --------------------------------------------------------------------------------------------------
@dataclass
class Interval:
    """What happens between two barriers, and the barrier that ends it."""

    label: str  # the schedule phase of the closing barrier (ISA: its index)
    dma: int = 0
    ds_reads: int = 0
    mfmas: int = 0
    barrier: str = ""  # schedule: the event text; ISA: the instruction
    conditional: bool = False
    group: int | None = None
    dma_done: int = 0  # DMA loads (in issue order) that are guaranteed complete at the barrier
    reads_retired: bool = True  # every LDS read issued so far has retired at the barrier
    vm_drained: bool = False  # every VM operation issued so far (stores included) has completed
    needs_reads_retired: bool = False
    lines: tuple = ()


def _reads_per_event(schedule, half: str) -> int:
    g = schedule.geometry
    return 2 * (g.n_tiles_a if half[0] == "A" else g.n_tiles_b)  # two ds_read_b128 per MFMA tile


def _stage_reads_per_store(schedule) -> int:
    from .byte_layout import CStage

    g = schedule.geometry
    return CStage(n_a=g.n_tiles_a, n_b=g.n_tiles_b).stores


def _mfmas_per_event(schedule) -> int:
    g = schedule.geometry
    return g.n_tiles_a * g.n_tiles_b


class _VmTracker:
    """Which VM operations are guaranteed complete: vmcnt(n) means all but the youngest n."""

    def __init__(self):
        self.ops: list[bool] = []  # per VM op in issue order: is it a DMA load
        self.done = 0  # ops[:done] are complete

    def issue(self, dma: bool, n: int = 1):
        self.ops.extend([dma] * n)

    def wait(self, n: int):
        self.done = max(self.done, len(self.ops) - n)

    def dma_done(self) -> int:
        return sum(self.ops[: self.done])


def schedule_intervals(schedule, *, wave: int | None = None) -> list[Interval]:
    """The schedule's barrier intervals (both groups' events when ``wave`` is None)."""
    from kernels_fused.pipeline import schedule as S

    out, cur, vm = [], Interval(label="start"), _VmTracker()
    for phase, ev in schedule.program():
        if wave is not None and not ev.runs_on(wave):
            continue
        if isinstance(ev, S.LoadTile):
            cur.dma += ev.n_vm
            vm.issue(True, ev.n_vm)
        elif isinstance(ev, S.ScaleLoad):
            vm.issue(False, ev.n_vm)
        elif isinstance(ev, S.WaitVm):
            vm.wait(ev.vmcnt)
        elif isinstance(ev, S.LdsRead):
            cur.ds_reads += _reads_per_event(schedule, ev.half)
        elif isinstance(ev, S.Mfma):
            cur.mfmas += _mfmas_per_event(schedule)
        elif isinstance(ev, S.StoreC):  # the staged quarter read back, 16 bytes per lane per store
            cur.ds_reads += _stage_reads_per_store(schedule)
        elif ev.is_barrier:
            if isinstance(ev, S.WaitBarrier):
                vm.wait(ev.vmcnt)
            cur.label = phase.label
            cur.barrier = ev.text()
            cur.group = ev.group
            cur.conditional = ev.group is not None
            cur.dma_done = vm.dma_done()
            cur.needs_reads_retired = isinstance(ev, S.ReadDoneBarrier)
            out.append(cur)
            cur = Interval(label="")
    cur.label = "end"
    out.append(cur)
    return out


def isa_intervals(instrs: list[Instr]) -> list[Interval]:
    """The ISA's barrier intervals with what its waits guarantee at each barrier."""
    out, cur, vm = [], Interval(label="#0"), _VmTracker()
    lgkm_outstanding = 0  # LGKM ops not yet known retired (LDS reads retire in order)
    lines = []
    for ins in instrs:
        lines.append(ins.line)
        if ins.kind == "dma":
            cur.dma += 1
            vm.issue(True)
        elif ins.kind == "vm":
            vm.issue(False)
        elif ins.kind == "ds_read":
            cur.ds_reads += 1
            lgkm_outstanding += 1
        elif ins.kind == "lgkm":
            lgkm_outstanding += 1
        elif ins.kind == "mfma":
            cur.mfmas += 1
        elif ins.kind == "waitcnt":
            c = ins.counts()
            if "vmcnt" in c:
                vm.wait(c["vmcnt"])
            if "lgkmcnt" in c:
                lgkm_outstanding = min(lgkm_outstanding, c["lgkmcnt"])
        elif ins.kind == "barrier":
            cur.barrier = f"line {ins.line}: s_barrier"
            cur.conditional = ins.conditional
            cur.dma_done = vm.dma_done()
            cur.reads_retired = lgkm_outstanding == 0
            cur.vm_drained = vm.done == len(vm.ops)
            cur.lines = (lines[0], ins.line)
            out.append(cur)
            cur, lines = Interval(label=f"#{len(out)}"), []
    cur.label = "end"
    out.append(cur)
    return out


# --------------------------------------------------------------------------------------------------
# the check
# --------------------------------------------------------------------------------------------------
@dataclass
class Report:
    name: str
    structure: list[str] = field(default_factory=list)  # mismatches against the compiled schedule
    completion: list[str] = field(default_factory=list)  # waits weaker than the reference's
    barriers: int = 0

    @property
    def ok(self) -> bool:
        return not self.structure and not self.completion

    def format(self) -> str:
        head = f"{'PASS' if self.ok else 'FAIL'} {self.name}: {self.barriers} barriers"
        return "\n".join([head] + [f"  structure: {m}" for m in self.structure]
                         + [f"  completion: {m}" for m in self.completion])


def _check_publish(instrs: list[Instr], got: list[Interval], report: Report) -> list[Interval]:
    """fuse=True: after the C stores, ``s_waitcnt vmcnt(0); s_barrier`` (every wave's stores have
    completed), then one thread's atomic add on the chunk counter. Returns the intervals without
    that barrier, for the structural match against the schedule (which ends at the stores)."""
    if len(got) < 2:
        report.structure.append("fused epilogue: no barrier at all")
        return got
    publish = got[-2]
    if not publish.vm_drained:
        report.completion.append(f"fused epilogue ({publish.barrier}): the C stores are not drained "
                                 f"(s_waitcnt vmcnt(0)) before the barrier that precedes the counter bump")
    barrier_line = publish.lines[1] if publish.lines else 0
    bumps = [i for i in instrs if i.line > barrier_line and _ATOMIC.match(i.op)]
    if len(bumps) != 1 or not bumps[0].conditional:
        report.structure.append(f"fused epilogue: expected one atomic add after line {barrier_line}, run by one "
                                f"thread (in a branch); found {[(b.line, b.op, b.conditional) for b in bumps]}")
    tail = got[-1]
    merged = Interval(label="end", dma=publish.dma + tail.dma, ds_reads=publish.ds_reads + tail.ds_reads,
                      mfmas=publish.mfmas + tail.mfmas)
    return got[:-2] + [merged]


def check(isa: str, schedule, *, reference=None, fused: bool = False, name: str = "") -> Report:
    """Match compiled ISA against ``schedule`` (structure) and ``reference`` (completion).

    ``fused``: the kernel was compiled with fuse=True; its publish step (not part of the pipeline
    schedule) is checked on its own: stores drained, barrier, one thread's counter bump."""
    reference = schedule if reference is None else reference
    report = Report(name=name or schedule.name())
    instrs = parse(isa)
    got = isa_intervals(instrs)
    want = schedule_intervals(schedule)
    report.barriers = len(got) - 1
    if fused:
        got = _check_publish(instrs, got, report)
    if len(got) != len(want):
        report.structure.append(f"{len(got) - 1} barriers in the ISA, the schedule has {len(want) - 1}")
        return report
    for i, (g, w) in enumerate(zip(got, want)):
        where = f"interval {i} (ends {w.label}: {w.barrier or 'end of kernel'}; ISA {g.barrier or 'end'})"
        for what in ("dma", "ds_reads", "mfmas"):
            if getattr(g, what) != getattr(w, what):
                report.structure.append(f"{where}: {what} {getattr(g, what)} in the ISA, schedule {getattr(w, what)}")
        if g.conditional != w.conditional:
            report.structure.append(f"{where}: barrier conditional={g.conditional}, schedule {w.conditional}")

    # completion against the compiled schedule itself: the drains it counts on at each barrier,
    # including the compiler's waits it models (WaitVm before a scale consumer), are in the ISA
    own_deficit = 0
    for i, (g, w) in enumerate(zip(got[:-1], want[:-1])):
        missing = max(0, w.dma_done - g.dma_done)
        if missing > own_deficit:
            report.completion.append(
                f"{w.label} ({w.barrier}, ISA {g.barrier}): the compiled schedule counts on {w.dma_done} DMA loads "
                f"drained here (its waits, compiler waits included), the ISA's waits guarantee only {g.dma_done}")
        own_deficit = missing
        if w.needs_reads_retired and not g.reads_retired:
            report.completion.append(f"{w.label} ({w.barrier}, ISA {g.barrier}): no s_waitcnt lgkmcnt retires the "
                                     f"LDS reads before this read_done_barrier")

    # completion against the reference, aligned by phase label and barrier ordinal within the phase
    ref = _by_phase(schedule_intervals(reference))
    mine = _by_phase(want)
    deficit = 0  # a drain missing at one barrier stays missing at the next ones: report where it starts
    for key, (idx, w) in mine.items():
        if key not in ref:
            continue  # a barrier the reference lacks (e.g. a group's close barrier): nothing to require
        r = ref[key][1]
        g = got[idx]
        missing = max(0, r.dma_done - g.dma_done)
        new_gap, deficit = missing > deficit, missing
        if new_gap:
            report.completion.append(
                f"{key[0]} barrier {key[1]} ({w.barrier}, ISA {g.barrier}): the reference ({r.barrier}) has "
                f"{r.dma_done} DMA loads drained here, the ISA's waits guarantee only {g.dma_done}")
        if r.needs_reads_retired and not g.reads_retired:
            report.completion.append(
                f"{key[0]} barrier {key[1]} ({w.barrier}, ISA {g.barrier}): the reference ({r.barrier}) retires "
                f"every LDS read before this barrier, the ISA has no s_waitcnt lgkmcnt covering them")
    return report


def _by_phase(intervals: list[Interval]) -> dict:
    out, seen = {}, {}
    for i, iv in enumerate(intervals[:-1]):
        n = seen.get(iv.label, 0)
        seen[iv.label] = n + 1
        out[(iv.label, n if iv.group is None else f"group{iv.group}")] = (i, iv)
    return out


# --------------------------------------------------------------------------------------------------
# variants and the CLI
# --------------------------------------------------------------------------------------------------
TILE_CHOICES = ("256x256", "128x256", "256x128")
CHECK_ALL_K = (256, 384, 512, 1024)


def compile_variant(*, quant: str, tile: str, K: int, fuse: bool, variant: str = "shipped",
                    loop_count=None, mfma_barriers: bool = True, dump_dir=None):
    """(config, ISA text) of one variant, compiled for gfx950 on this machine."""
    from .kernel import compile_to_isa, kernel_config

    bm, bn = (int(x) for x in tile.split("x"))
    cfg = kernel_config(K=K, BLOCK_M=bm, BLOCK_N=bn, quant=quant, fuse=fuse, variant=variant,
                        loop_count=loop_count, mfma_barriers=mfma_barriers, fn="kernels_fused.gfx950.isa")
    if dump_dir is None:
        with tempfile.TemporaryDirectory(prefix="cco-isa-") as d:
            return cfg, compile_to_isa(cfg, dump_dir=d)
    return cfg, compile_to_isa(cfg, dump_dir=dump_dir)


# (quant, tile, K, fuse, variant, mfma_barriers) -> (config, ISA text): every argument in the key, so
# that a caller spelling a default out shares the compile of one that leaves it (the test tiers check
# the same variants several ways; a compile takes 1-25 s)
_COMPILED: dict = {}


def _key(quant: str, tile: str, K: int, fuse: bool, variant: str = "shipped", mfma_barriers: bool = True) -> tuple:
    return quant, tile, K, fuse, variant, mfma_barriers


def _compile(key: tuple):
    """:func:`compile_variant` of a memo key."""
    q, t, k, f, v, b = key
    return compile_variant(quant=q, tile=t, K=k, fuse=f, variant=v, mfma_barriers=b)


def compiled(quant: str, tile: str, K: int, fuse: bool, variant: str = "shipped", mfma_barriers: bool = True):
    """:func:`compile_variant`, memoized per process (:func:`precompile` fills the memo in parallel)."""
    key = _key(quant, tile, K, fuse, variant, mfma_barriers)
    if key not in _COMPILED:
        _COMPILED[key] = _compile(key)
    return _COMPILED[key]


def _compile_key(key: tuple):
    """A worker's compile: (config, ISA text), or None where it failed (the caller's own compile then
    raises the error where it is asked for)."""
    try:
        return _compile(key)
    except Exception:  # noqa: BLE001 - reported by the in-process compile of the caller that needs it
        return None


# a worker peaks at ~450 MB (blockscale 256x256, K 2048: its MLIR and LLVM state), so a many-core host
# does not get one per core
PRECOMPILE_WORKERS = 8


def precompile(variants, workers: int | None = None) -> None:
    """Compile the ``variants`` (argument tuples of :func:`compiled`) this process has not, into its
    memo, ``workers`` at a time (default: the CPUs, at most ``PRECOMPILE_WORKERS``) in processes of
    their own: one compile is one core's work, and a sweep of 70-odd is minutes on one."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    todo = [k for k in dict.fromkeys(_key(*v) for v in variants) if k not in _COMPILED]
    todo.sort(key=lambda k: -k[2])  # the longest K first: the last one to finish is a short one
    workers = min(len(todo), workers or min(os.cpu_count() or 1, PRECOMPILE_WORKERS))
    if workers < 2:
        for key in todo:
            compiled(*key)
        return
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for key, result in zip(todo, pool.map(_compile_key, todo)):
            if result is not None:
                _COMPILED[key] = result


def check_variant(*, quant: str, tile: str, K: int, fuse: bool, variant: str = "shipped",
                  reference: str = "shipped") -> tuple[Report, Resources]:
    from kernels_fused.pipeline.schedule import build_schedule

    cfg, isa = compile_variant(quant=quant, tile=tile, K=K, fuse=fuse, variant=variant)
    ref = build_schedule(block_m=cfg.BLOCK_M, block_n=cfg.BLOCK_N, k=K, quant=quant, variant=reference,
                         mfma_barriers=cfg.mfma_barriers)
    return check(isa, cfg.schedule(), reference=ref, fused=cfg.fuse, name=cfg.name), resources(isa)


def all_variants():
    for quant in ("ptpc", "blockscale", "mxfp8"):
        for tile in TILE_CHOICES:
            for K in CHECK_ALL_K:
                for fuse in (False, True):
                    yield quant, tile, K, fuse


def _parse_tile(s: str) -> str:
    if s not in TILE_CHOICES:
        raise argparse.ArgumentTypeError(f"--tile {s!r} is not supported; pass one of {', '.join(TILE_CHOICES)}")
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernels_fused.gfx950.isa", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quant", default="ptpc", choices=("ptpc", "blockscale", "mxfp8"))
    ap.add_argument("--tile", default="256x256", type=_parse_tile, help="BLOCK_MxBLOCK_N")
    ap.add_argument("-k", "--K", type=int, default=256, dest="K")
    ap.add_argument("--fuse", action="store_true", help="the fused epilogue (window stores + counter bump)")
    ap.add_argument("--variant", default="shipped", help="schedule variant the kernel is emitted from")
    ap.add_argument("--check", action="store_true", help="also run the conformance check on this variant")
    ap.add_argument("--check-all", action="store_true",
                    help="compile and check every quant x tile x K x fuse (shipped); exit 1 on any mismatch")
    ap.add_argument("--no-isa", action="store_true", help="print only the resource line (and the check)")
    ap.add_argument("--markdown", action="store_true", help="with --check-all: print the results as a markdown table")
    args = ap.parse_args(argv)

    from .toolchain import cli_unavailable

    if (status := cli_unavailable("kernels_fused.gfx950.isa")) is not None:
        return status

    if args.check_all:
        failed = 0
        if args.markdown:
            print("| quant | tile | K | mode | conformance | VGPRs | spilled VGPRs | scratch B | LDS B |")
            print("|---|---|---|---|---|---|---|---|---|")
        else:
            print(f"{'variant':<44} {'result':<6} resources")
        for quant, tile, K, fuse in all_variants():
            rep, res = check_variant(quant=quant, tile=tile, K=K, fuse=fuse)
            verdict = "PASS" if rep.ok else "FAIL"
            if args.markdown:
                print(f"| {quant} | {tile} | {K} | {'fused' if fuse else 'gemm-only'} | {verdict} | {res.vgprs} "
                      f"| {res.vgpr_spills} | {res.scratch_bytes} | {res.lds_bytes} |", flush=True)
            else:
                print(f"{rep.name:<44} {verdict:<6} {res.line()}", flush=True)
            if not rep.ok:
                failed += 1
                print(rep.format())
        # the negative control: the racy original must be caught
        rep, _ = check_variant(quant="ptpc", tile="256x256", K=256, fuse=False, variant="upstream")
        caught = not rep.ok
        print(f"negative control {rep.name}: {'caught' if caught else 'NOT CAUGHT'}")
        print(f"{failed} variant(s) failed")
        return 1 if failed or not caught else 0

    try:
        cfg, isa = compile_variant(quant=args.quant, tile=args.tile, K=args.K, fuse=args.fuse, variant=args.variant)
    except ValueError as err:
        ap.error(str(err))
    if not args.no_isa:
        print(isa)
    print(f"# {cfg.name}: {resources(isa).line()}")
    if args.check:
        from kernels_fused.pipeline.schedule import build_schedule

        ref = build_schedule(block_m=cfg.BLOCK_M, block_n=cfg.BLOCK_N, k=cfg.K, quant=cfg.quant, variant="shipped",
                             mfma_barriers=cfg.mfma_barriers)
        rep = check(isa, cfg.schedule(), reference=ref, fused=cfg.fuse, name=cfg.name)
        print(rep.format())
        return 0 if rep.ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
