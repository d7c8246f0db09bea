"""Happens-before checker for the 8-wave pipeline schedule (``kernels_fused.pipeline.schedule``).

Model (one workgroup, 8 waves, each running its filtered view of the one program):

* A :class:`~kernels_fused.pipeline.schedule.LoadTile` is ``n_vm`` VM instructions per wave; instruction
  ``s`` of wave ``u`` writes rows ``s*64 + u*8 .. +8`` of the half-tile. Scale loads are VM
  instructions too. VM instructions retire in issue order per wave (``fifo=True``); with
  ``fifo=False`` (LDS-DMA completion not FIFO) only ``vmcnt(0)`` proves a particular one done.
* ``s_waitcnt vmcnt(n)`` (:class:`WaitBarrier`, compiler :class:`WaitVm`) blocks the issuing wave
  until at most ``n`` of its VM instructions are outstanding: with FIFO retirement every
  instruction but the last ``n`` issued is complete.
* Barriers pair by arrival count: the c-th barrier of every wave is one rendezvous. Everything a
  wave did before its c-th barrier happens before everything any wave does after its c-th barrier.
  The lag barrier makes the lagging group's c-th barrier one barrier earlier in program order. A
  wave that has ended no longer takes part (its whole stream precedes later generations).
* LDS reads retire under LGKM: at a ``read_done_barrier`` (``lgkmcnt(0)``) or, at the latest, at
  the compiler's ``lgkmcnt`` wait before the first MFMA that consumes the fragment.

Verdicts:

* Per LDS read and per source row group ``(loader wave, load step)``: *guaranteed* when a vmcnt
  wait of the loader that completes the instruction happens before the read (its own earlier wait,
  or a wait before the loader's c-th barrier with ``c <=`` the reader's barriers passed);
  otherwise its *slack* is the number of barrier generations between the loader issuing the
  instruction and the read. A read is *guaranteed* when all its sources are, *timing-only* when
  every other source matches a :class:`~kernels_fused.pipeline.schedule.TimingCover` the schedule declares
  and has at least its ``min_slack``, and *unguarded* otherwise.
* Per LDS overwrite (a load into a buffer): *ordered* when every read of the old contents of those
  rows has retired before a barrier the loader passed before issuing; else *timing-only* if
  declared, else *unordered*. The slack printed is the generations between the read's issue and
  the load's issue (an LDS read needs a few cycles, a DMA far more).
* Per epilogue stage write (:class:`~kernels_fused.pipeline.schedule.StageC`: C, as bf16, into
  the A/B buffers): *ordered* when every LDS read of every wave has retired and every DMA load of
  every wave has completed before it (same rules: the wave's own program order, or a barrier the
  writer passed), else *unordered*: the stage would overwrite operands still being read, or a late
  DMA would overwrite the stage.

``check(schedule) -> Report``; ``Report.ok`` is False on any unguarded read or unordered
overwrite. ``Report.explain(item)`` prints the event trace behind one verdict.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Optional

from .schedule import (HALVES, WAVES, WAVES_PER_GROUP, LdsRead, LoadTile, Mfma, ReadDoneBarrier,
                       ScaleLoad, Schedule, StageC, WaitBarrier, WaitVm)

INF = 10 ** 9


# --------------------------------------------------------------------------- per-wave trace


@dataclass
class _Vm:
    index: int  # issue order within the wave
    pos: int  # program position in the wave's stream
    issue_bar: int  # barriers passed when issued
    op: object
    step: int  # instruction within its LoadTile (-1 for scale loads)
    label: str
    phase: object = None
    done_pos: int = INF
    done_bar: int = INF
    done_by: str = ""


@dataclass
class _Read:
    pos: int
    bar: int  # barriers passed when issued
    op: LdsRead
    label: str
    section: str
    stage: str
    retire_pos: int = INF
    retire_bar: int = INF
    retired_by: str = ""


@dataclass
class _Wave:
    wave: int
    vms: list
    reads: list
    barrier_pos: list  # position of the c-th barrier (index c-1)
    barrier_label: list
    barrier_text: list
    loads: dict  # (half, ktile, step) -> _Vm
    stage_writes: list = field(default_factory=list)  # (position, barriers passed, label) per StageC


def _trace_wave(schedule: Schedule, wave: int, fifo: bool) -> _Wave:
    vms, reads, bpos, blabel, btext, loads, stage_writes = [], [], [], [], [], {}, []
    waits = []  # (pos, vmcnt, VM instructions issued before it, label, text)
    pending = {}  # fragment register -> its newest read not yet retired
    bars = 0
    stream = schedule.wave_program(wave)
    for pos, (phase, op) in enumerate(stream):
        if isinstance(op, LoadTile):
            for s in range(op.n_vm):
                vm = _Vm(index=len(vms), pos=pos, issue_bar=bars, op=op, step=s, label=phase.label,
                         phase=phase)
                vms.append(vm)
                loads[(op.half, op.ktile, s)] = vm
        elif isinstance(op, ScaleLoad):
            for _ in range(op.n_vm):
                vms.append(_Vm(index=len(vms), pos=pos, issue_bar=bars, op=op, step=-1,
                               label=phase.label))
        elif isinstance(op, LdsRead):
            rd = _Read(pos=pos, bar=bars, op=op, label=phase.label, section=phase.section,
                       stage=phase.stage)
            reads.append(rd)
            old = pending.get(op.frag)
            assert old is None, f"fragment {op.frag} overwritten before an MFMA consumed it"
            pending[op.frag] = rd
        elif isinstance(op, StageC):
            stage_writes.append((pos, bars, f"{phase.label} {op.text()}"))
        if isinstance(op, (WaitBarrier, WaitVm)):
            waits.append((pos, op.vmcnt, len(vms), phase.label, op.text()))
        if isinstance(op, ReadDoneBarrier):
            for frag, r in list(pending.items()):
                r.retire_pos, r.retired_by = pos, f"read_done_barrier at {phase.label}"
                del pending[frag]
        if isinstance(op, Mfma):
            # the compiler's lgkmcnt wait before the first MFMA that uses the fragment
            for frag in (op.a, op.b):
                r = pending.pop(frag, None)
                if r is not None:
                    r.retire_pos, r.retired_by = pos, f"lgkmcnt before mfma {op.acc} at {phase.label}"
        if op.is_barrier:
            bars += 1
            bpos.append(pos)
            blabel.append(phase.label)
            btext.append(op.text())

    def first_barrier_at_or_after(p: int) -> int:
        c = bisect.bisect_left(bpos, p)
        return c + 1 if c < len(bpos) else INF

    for pos, n, issued, label, text in waits:
        complete = issued - n if fifo else (issued if n == 0 else 0)
        for vm in vms[:complete]:
            if vm.done_pos == INF:
                vm.done_pos = pos
                vm.done_bar = first_barrier_at_or_after(pos)
                vm.done_by = f"{text} at {label}"
    for r in reads:
        r.retire_bar = first_barrier_at_or_after(r.retire_pos) if r.retire_pos < INF else INF
    return _Wave(wave=wave, vms=vms, reads=reads, barrier_pos=bpos, barrier_label=blabel,
                 barrier_text=btext, loads=loads, stage_writes=stage_writes)


# --------------------------------------------------------------------------- verdicts


@dataclass(frozen=True)
class SourceVerdict:
    loader_wave: int
    step: int
    guaranteed: bool
    slack: int  # barrier generations between the producer's issue and the read
    covered_by: str
    declared: Optional[object]  # the TimingCover that accepts it, if any


@dataclass(frozen=True)
class _Site:
    """Where an LDS access sits: the wave, its phase, and which half-tile of which K tile."""
    wave: int
    label: str
    section: str
    stage: str
    half: str
    ktile: int


@dataclass(frozen=True)
class ReadVerdict(_Site):
    frag: str
    status: str  # guaranteed | timing-only | unguarded
    sources: tuple

    @property
    def min_slack(self) -> Optional[int]:
        s = [x.slack for x in self.sources if not x.guaranteed]
        return min(s) if s else None

    def key(self) -> str:
        return f"wave {self.wave} {self.label} read {self.half}({self.ktile})"


@dataclass(frozen=True)
class OverwriteVerdict(_Site):
    step: int
    status: str  # ordered | timing-only | unordered
    unordered: tuple  # (reader wave, reader label, slack)

    @property
    def min_slack(self) -> Optional[int]:
        return min(s for _, _, s in self.unordered) if self.unordered else None

    def key(self) -> str:
        return f"wave {self.wave} {self.label} load {self.half}({self.ktile}) step {self.step}"


@dataclass(frozen=True)
class StageVerdict:
    """One wave's epilogue stage write into the A/B buffers, and what is not ordered before it."""

    wave: int
    label: str
    status: str  # ordered | unordered
    unordered: tuple  # (what, wave, label): an LDS read not retired or a DMA load not completed
    section: str = "epilogue"
    stage: str = "epilogue"
    half: str = "C"

    def key(self) -> str:
        return f"wave {self.wave} {self.label}"


@dataclass
class Report:
    schedule: Schedule
    fifo: bool
    reads: list
    overwrites: list
    _waves: list = field(repr=False)
    stages: list = field(default_factory=list)  # StageVerdict per epilogue stage write

    @property
    def unguarded(self) -> list:
        return [r for r in self.reads if r.status == "unguarded"]

    @property
    def timing_only(self) -> list:
        return [r for r in self.reads if r.status == "timing-only"]

    @property
    def unordered(self) -> list:
        return ([o for o in self.overwrites if o.status == "unordered"]
                + [st for st in self.stages if st.status == "unordered"])

    @property
    def ok(self) -> bool:
        return not self.unguarded and not self.unordered

    def not_guaranteed(self) -> list:
        return [r for r in self.reads if r.status != "guaranteed"]

    def find_reads(self, *, section=None, stage=None, half=None, wave=None, status=None,
                   ktile=None) -> list:
        out = []
        for r in self.reads:
            if ((section is None or r.section == section) and (stage is None or r.stage == stage)
                    and (half is None or r.half == half) and (wave is None or r.wave == wave)
                    and (status is None or r.status == status)
                    and (ktile is None or r.ktile == ktile)):
                out.append(r)
        return out

    def explain(self, item) -> str:
        return _explain(self, item)


def check(schedule: Schedule, *, fifo: bool = True) -> Report:
    """Sort every LDS read and overwrite of ``schedule`` into the verdicts above."""
    waves = [_trace_wave(schedule, w, fifo) for w in range(WAVES)]
    covers = schedule.timing_covers
    sources = {(h, w): schedule.read_sources(h, w) for h in HALVES for w in range(WAVES)}
    by_tile = [{} for _ in range(WAVES)]  # wave -> (half, ktile) -> reads
    for v in waves:
        for r in v.reads:
            by_tile[v.wave].setdefault((r.op.half, r.op.ktile), []).append(r)
    reads = []
    for v in waves:
        vgrp = v.wave // WAVES_PER_GROUP
        for r in v.reads:
            srcs = []
            for (u, s) in sources[(r.op.half, v.wave)]:
                vm = waves[u].loads.get((r.op.half, r.op.ktile, s))
                assert vm is not None, f"no producer for {r.op.half}({r.op.ktile}) step {s}"
                if u == v.wave:
                    ok = vm.done_pos < r.pos
                else:
                    ok = vm.done_bar <= r.bar
                slack = r.bar - vm.issue_bar
                declared = None
                if not ok:
                    for c in covers:
                        if c.matches(what="read", section=r.section, stage=r.stage, half=r.op.half,
                                     reader_group=vgrp, loader_group=u // WAVES_PER_GROUP):
                            declared = c
                            break
                srcs.append(SourceVerdict(loader_wave=u, step=s, guaranteed=ok, slack=slack,
                                          covered_by=vm.done_by if ok else "", declared=declared))
            bad = [x for x in srcs if not x.guaranteed]
            if not bad:
                status = "guaranteed"
            elif all(x.declared is not None and x.slack >= x.declared.min_slack for x in bad):
                status = "timing-only"
            else:
                status = "unguarded"
            reads.append(ReadVerdict(wave=v.wave, label=r.label, section=r.section, stage=r.stage,
                                     half=r.op.half, ktile=r.op.ktile, frag=r.op.frag,
                                     status=status, sources=tuple(srcs)))

    overwrites = []
    for u in waves:
        for (half, ktile, s), vm in u.loads.items():
            if ktile < 2:
                continue  # first use of the buffer: the previous workgroup has ended
            unordered = []
            for v in waves:
                if (u.wave, s) not in sources[(half, v.wave)]:
                    continue
                for r in by_tile[v.wave].get((half, ktile - 2), ()):
                    if v.wave == u.wave:
                        ok = r.retire_pos < vm.pos
                    else:
                        ok = r.retire_bar <= vm.issue_bar
                    if not ok:
                        unordered.append((v.wave, r.label, vm.issue_bar - r.bar))
            phase = vm.phase
            if not unordered:
                status = "ordered"
            else:
                declared = [c for c in schedule.timing_covers
                            if c.matches(what="overwrite", section=phase.section,
                                         stage=phase.stage, half=half, reader_group=-1,
                                         loader_group=-2)]
                ok_decl = declared and all(sl >= declared[0].min_slack for _, _, sl in unordered)
                status = "timing-only" if ok_decl else "unordered"
            overwrites.append(OverwriteVerdict(
                wave=u.wave, label=vm.label, section=phase.section, stage=phase.stage, half=half,
                ktile=ktile, step=s, status=status, unordered=tuple(unordered)))
    return Report(schedule=schedule, fifo=fifo, reads=reads, overwrites=overwrites, _waves=waves,
                  stages=_stage_verdicts(waves))


def _stage_verdicts(waves: list) -> list:
    """Every LDS read retired and every DMA load completed before each wave's stage writes."""
    out = []
    for u in waves:
        for pos, bar, label in u.stage_writes:
            late = []
            for v in waves:
                mine = v.wave == u.wave
                for r in v.reads:
                    if not (r.retire_pos < pos if mine else r.retire_bar <= bar):
                        late.append((f"read {r.op.half}({r.op.ktile})", v.wave, r.label))
                for vm in v.vms:
                    if isinstance(vm.op, LoadTile) and not (vm.done_pos < pos if mine else vm.done_bar <= bar):
                        late.append((f"load {vm.op.half}({vm.op.ktile})", v.wave, vm.label))
            out.append(StageVerdict(wave=u.wave, label=label, status="unordered" if late else "ordered",
                                    unordered=tuple(late)))
    return out


# --------------------------------------------------------------------------- explanation


def _barrier_line(report: Report, wave: int, c: int) -> str:
    w = report._waves[wave]
    if c > len(w.barrier_pos):
        return f"wave {wave} has no barrier #{c} (ended)"
    return f"wave {wave} barrier #{c} = {w.barrier_text[c - 1]} at {w.barrier_label[c - 1]}"


def _explain(report: Report, item) -> str:
    lines = [f"{report.schedule.name()}  (VM retirement {'FIFO' if report.fifo else 'not FIFO'})"]
    if isinstance(item, ReadVerdict):
        v = report._waves[item.wave]
        rd = next(r for r in v.reads if r.label == item.label and r.op.half == item.half
                  and r.op.ktile == item.ktile)
        lines.append(f"{item.key()}: {item.status}; reader has passed {rd.bar} barriers "
                     f"(last: {_barrier_line(report, item.wave, rd.bar) if rd.bar else 'none'})")
        detailed = set()  # print the full trace once per (loader group, step, verdict)
        for src in item.sources:
            u = report._waves[src.loader_wave]
            vm = u.loads[(item.half, item.ktile, src.step)]
            head = (f"  rows from wave {src.loader_wave} step {src.step}: issued at {vm.label} "
                    f"(vm #{vm.index}, after barrier #{vm.issue_bar})")
            if src.guaranteed:
                lines.append(f"{head}; completed by {vm.done_by}, "
                             f"before its barrier #{vm.done_bar}")
                continue
            lines.append(f"{head}; NOT covered, slack {src.slack} barrier phases")
            key = (src.loader_wave // 4, src.step)
            if key in detailed:
                continue
            detailed.add(key)
            if vm.done_pos < INF:
                lines.append(f"    first completing wait: {vm.done_by}, before its barrier "
                             f"#{vm.done_bar} > reader's {rd.bar}: "
                             f"{_barrier_line(report, src.loader_wave, vm.done_bar)}")
            else:
                lines.append("    no wait of the loader ever completes it")
            if rd.bar:
                lines.append(f"    reader's last barrier #{rd.bar} pairs with "
                             f"{_barrier_line(report, src.loader_wave, rd.bar)}")
            later = [w for w in _waits_after(report, src.loader_wave, vm.pos)]
            for text in later[:3]:
                lines.append(f"    loader wait after issue: {text}")
            if src.declared is not None:
                lines.append(f"    declared timing cover (min slack {src.declared.min_slack}): "
                             f"{src.declared.reason}")
        return "\n".join(lines)
    if isinstance(item, OverwriteVerdict):
        u = report._waves[item.wave]
        vm = u.loads[(item.half, item.ktile, item.step)]
        lines.append(f"{item.key()}: {item.status}; loader has passed {vm.issue_bar} barriers "
                     f"({_barrier_line(report, item.wave, vm.issue_bar) if vm.issue_bar else '-'})")
        for rw, rl, sl in item.unordered:
            rd = next(r for r in report._waves[rw].reads if r.label == rl and r.op.half == item.half)
            lines.append(f"  read of {item.half}({item.ktile - 2}) by wave {rw} at {rl} retires by "
                         f"{rd.retired_by}, before its barrier #{rd.retire_bar}: "
                         f"{_barrier_line(report, rw, rd.retire_bar)}; issue slack {sl}")
        return "\n".join(lines)
    if isinstance(item, StageVerdict):
        lines.append(f"{item.key()}: {item.status}; the writer has passed "
                     f"{_barrier_line(report, item.wave, _stage_bar(report, item))}")
        for what, w, label in item.unordered:
            lines.append(f"  {what} by wave {w} at {label} is not ordered before it")
        return "\n".join(lines)
    raise TypeError(f"explain: item must be a ReadVerdict, OverwriteVerdict or StageVerdict, got {type(item)}")


def _stage_bar(report: Report, item) -> int:
    return next(bar for _, bar, label in report._waves[item.wave].stage_writes if label == item.label)


def _waits_after(report: Report, wave: int, pos: int):
    stream = report.schedule.wave_program(wave)
    bars = 0
    for p, (phase, op) in enumerate(stream):
        if op.is_barrier:
            bars += 1
        if p > pos and isinstance(op, (WaitBarrier, WaitVm)):
            yield f"{op.text()} at {phase.label} (barrier #{bars if op.is_barrier else '-'})"


__all__ = ["check", "Report", "ReadVerdict", "OverwriteVerdict", "SourceVerdict", "StageVerdict"]
