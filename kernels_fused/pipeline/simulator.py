"""Seeded latency simulator of the 8-wave pipeline on real fp8 data.

Runs a :class:`~kernels_fused.pipeline.schedule.Schedule` for every workgroup of a launch as discrete events
(vectorised over workgroups: the program is the same, only the sampled latencies differ):

* each wave issues its stream in order; a global->LDS instruction of a wave leaves through that
  wave's share of the CU memory pipe (``kib_cycles * contention`` per KiB, FIFO) and lands after
  ``dma_base + extra_latency`` plus a Pareto tail; with ``fifo`` a wave's loads land in issue order;
* ``s_waitcnt vmcnt(n)`` stalls the wave until at most ``n`` of its loads are outstanding;
  ``lgkmcnt`` waits (``read_done_barrier``, and the compiler's wait before the MFMA that consumes a
  fragment) stall until the LDS reads return;
* the c-th barrier of every wave is one rendezvous (release = last arrival), so the lag barrier
  makes the lagging group run one barrier behind, exactly as in the checker;
* an LDS read samples its rows ``lds_sample`` cycles after issue. A row group whose producing load
  has not landed yet returns what the buffer held before: the K tile two steps earlier, or, on the
  first use of a buffer, the final tile a previous workgroup left there. A row group whose next
  refill already landed returns the newer tile.

The output is never recomputed in full: the reference is computed once, and each launch adds, per
MFMA that consumed a stale fragment, ``deq(A_used) @ deq(B_used).T - deq(A) @ deq(B).T`` with the
scales of the correct K tile (scales live in registers, not LDS). The launch output starts as NaN,
every workgroup writes its tile, and :func:`cco.quant.count_mismatches` compares element-wise
(> 5% off the bf16-rounded fp32 reference).

Unfused equivalent: ``reference_gemm(a, b, a_scale, b_scale, quant)`` with some 8-row bands of one
K tile replaced by stale data, which is the corruption seen on hardware.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from .schedule import (BLOCK_K, WAVES, LdsRead, LoadTile, Mfma, ReadDoneBarrier, ScaleLoad,
                       Schedule, WaitBarrier, WaitVm)

SCALE_LOAD_FRACTION = 0.25  # a scale load moves <= 256 B per wave, a tile load 1 KiB
PREV_WG = -1  # content tag: data the previous workgroup left in the buffer
WG_BATCH = 16  # workgroups per error batch when only bad vs good matters


@dataclass(frozen=True, kw_only=True)
class LatencyModel:
    """Cycle costs of one workgroup; defaults are plausible gfx950 magnitudes, not measurements."""

    dma_base: float = 500.0  # unloaded global->LDS latency
    kib_cycles: float = 128.0  # cycles one wave's 1 KiB occupies its share of the CU memory pipe
    contention: float = 1.0  # multiplies kib_cycles: grid-wide bandwidth pressure
    burst: float = 3.0  # extra contention on prologue loads of the first round of workgroups
    tail_alpha: float = 3.0  # Pareto (Lomax) shape of the latency tail (smaller is heavier)
    tail_scale: float = 0.2  # tail size relative to dma_base
    launch_jitter: float = 0.2  # sigma of a per-launch lognormal factor on contention
    extra_latency: float = 0.0  # added to every DMA (the sweep's knob)
    mfma_cycles: float = 32.0  # one 16x16x128 fp8 MFMA
    lds_read_cycles: float = 128.0  # until a fragment read returns (LGKM)
    lds_sample: float = 32.0  # when after issue a read takes its rows
    barrier_cycles: float = 16.0
    issue_cycles: float = 4.0
    fifo: bool = True  # LDS-DMA completion in issue order per wave
    cus: int = 256  # workgroups resident at once (first round starts together)


@dataclass
class _WaveState:
    t: np.ndarray
    lands: list = field(default_factory=list)  # per VM instruction: land time [n_wg]
    issues: list = field(default_factory=list)
    q_free: Optional[np.ndarray] = None
    pending_reads: list = field(default_factory=list)
    frag_done: dict = field(default_factory=dict)  # fragment -> lgkm completion time
    cursor: int = 0


@dataclass
class Timing:
    """Per wave: VM instruction issue/land times and LDS read sample times, each [n_wg]."""

    n_wg: int
    vm_ops: list  # wave -> list of (op, step)
    lands: list  # wave -> [n_vm, n_wg]
    issues: list
    reads: list  # wave -> list of (read index in stream, LdsRead, sample [n_wg])
    end: np.ndarray  # [n_wg] cycle the workgroup finishes


def _is_prologue(phase) -> bool:
    return phase.section == "prologue"


def simulate_timing(schedule: Schedule, *, n_wg: int, model: LatencyModel,
                    rng: np.random.Generator) -> Timing:
    g = schedule.geometry
    n_mfma = g.n_tiles_a * g.n_tiles_b
    frag_instr = {"a": g.n_tiles_a * 2, "b": g.n_tiles_b * 2}  # ds_read_b128 per fragment
    launch = float(np.exp(rng.normal(0.0, model.launch_jitter))) if model.launch_jitter else 1.0
    first_round = (np.arange(n_wg) < model.cus)
    streams = [schedule.wave_program(w) for w in range(WAVES)]
    states = [_WaveState(t=np.zeros(n_wg)) for _ in range(WAVES)]
    vm_ops = [[] for _ in range(WAVES)]
    reads = [[] for _ in range(WAVES)]
    service_kib = model.kib_cycles * model.contention * launch

    def issue_vm(st: _WaveState, w: int, op, step, prologue: bool, fraction: float):
        service = service_kib * fraction
        if prologue:
            service = np.where(first_round, service * model.burst, service)
        if st.q_free is None:
            st.q_free = np.zeros(n_wg)
        st.q_free = np.maximum(st.q_free, st.t) + service
        tail = (rng.pareto(model.tail_alpha, n_wg) * model.tail_scale * model.dma_base
                if model.tail_scale else 0.0)
        land = st.q_free + model.dma_base + model.extra_latency + tail
        if model.fifo and st.lands:
            land = np.maximum(land, st.lands[-1])
        st.lands.append(land)
        st.issues.append(st.t.copy())
        vm_ops[w].append((op, step))
        st.t = st.t + model.issue_cycles

    def wait_vm(st: _WaveState, n: int):
        issued = len(st.lands)
        if issued <= n:
            return
        if model.fifo:
            st.t = np.maximum(st.t, st.lands[issued - n - 1])
        else:
            done = np.sort(np.stack(st.lands), axis=0)[issued - n - 1]
            st.t = np.maximum(st.t, done)

    def run_until_barrier(w: int) -> Optional[object]:
        """Advance wave ``w`` to its next barrier (performing its wait part); return the op."""
        st = states[w]
        stream = streams[w]
        while st.cursor < len(stream):
            phase, op = stream[st.cursor]
            idx = st.cursor
            st.cursor += 1
            if isinstance(op, LoadTile):
                for s in range(op.n_vm):
                    issue_vm(st, w, op, s, _is_prologue(phase), 1.0)
            elif isinstance(op, ScaleLoad):
                for _ in range(op.n_vm):
                    issue_vm(st, w, op, -1, _is_prologue(phase), SCALE_LOAD_FRACTION)
            elif isinstance(op, LdsRead):
                sample = st.t + model.lds_sample
                done = st.t + model.lds_read_cycles
                st.frag_done[op.frag] = done
                st.pending_reads.append(done)
                reads[w].append((idx, op, sample))
                st.t = st.t + model.issue_cycles * frag_instr[op.frag[0]]
            elif isinstance(op, WaitVm):
                wait_vm(st, op.vmcnt)
            elif isinstance(op, Mfma):
                for f in (op.a, op.b):
                    if f in st.frag_done:
                        st.t = np.maximum(st.t, st.frag_done.pop(f))
                st.t = st.t + n_mfma * model.mfma_cycles
            if op.is_barrier:
                if isinstance(op, WaitBarrier):
                    wait_vm(st, op.vmcnt)
                if isinstance(op, ReadDoneBarrier) and st.pending_reads:
                    st.t = np.maximum(st.t, np.max(np.stack(st.pending_reads), axis=0))
                    st.pending_reads = []
                return op
        return None

    active = set(range(WAVES))
    while active:
        arrived = {}
        for w in sorted(active):
            op = run_until_barrier(w)
            if op is None:
                active.discard(w)
            else:
                arrived[w] = states[w].t
        if not arrived:
            break
        release = np.max(np.stack(list(arrived.values())), axis=0) + model.barrier_cycles
        for w in arrived:
            states[w].t = release
    end = np.max(np.stack([s.t for s in states]), axis=0)
    return Timing(n_wg=n_wg, vm_ops=vm_ops,
                  lands=[np.stack(s.lands) if s.lands else np.zeros((0, n_wg)) for s in states],
                  issues=[np.stack(s.issues) if s.issues else np.zeros((0, n_wg)) for s in states],
                  reads=reads, end=end)


# --------------------------------------------------------------------------- stale reads


@dataclass(frozen=True)
class StaleRows:
    """One 8-row group of one wave's fragment read that returned another tile's data."""

    wave: int
    read_index: int  # position of the LdsRead in the wave's stream
    half: str
    ktile: int
    loader_wave: int
    step: int
    wgs: np.ndarray  # workgroups affected
    content: np.ndarray  # K tile the rows held instead (PREV_WG: the previous workgroup's)


def find_stale(schedule: Schedule, timing: Timing) -> list:
    """Every (read, source row group) whose sampled content is not the K tile it expects."""
    index = []
    for w in range(WAVES):
        pos = {}
        for i, (op, step) in enumerate(timing.vm_ops[w]):
            if isinstance(op, LoadTile):
                pos[(op.half, op.ktile, step)] = i
        index.append(pos)
    out = []
    for v in range(WAVES):
        for (idx, op, sample) in timing.reads[v]:
            for (u, s) in schedule.read_sources(op.half, v):
                p = index[u][(op.half, op.ktile, s)]
                land = timing.lands[u][p]
                content = np.full(timing.n_wg, op.ktile)
                late = land > sample
                if late.any():
                    older = op.ktile - 2
                    content = np.where(late, older if older >= 0 else PREV_WG, content)
                nxt = index[u].get((op.half, op.ktile + 2, s))
                if nxt is not None:
                    early = timing.lands[u][nxt] <= sample
                    content = np.where(early, op.ktile + 2, content)
                wrong = content != op.ktile
                if wrong.any():
                    wgs = np.nonzero(wrong)[0]
                    out.append(StaleRows(wave=v, read_index=idx, half=op.half, ktile=op.ktile,
                                         loader_wave=u, step=s, wgs=wgs, content=content[wgs]))
    return out


# --------------------------------------------------------------------------- data and errors


class GemmData:
    """fp8 operands in the layout the error terms need: raw values and per-32-column scales."""

    def __init__(self, problem, *, block_m: int, block_n: int):
        from cco.quant import MX_GROUP, SCALE_BLOCK, e8m0_to_float

        self.quant = problem.quant
        m, n, k = problem.shape
        self.m, self.n, self.k = m, n, k
        self.block_m, self.block_n = block_m, block_n
        self.a = problem.a.float()
        self.b = problem.b.float()
        groups = k // MX_GROUP
        if self.quant == "ptpc":
            sa = problem.a_scale.float().reshape(m, 1).expand(m, groups)
            sb = problem.b_scale.float().reshape(n, 1).expand(n, groups)
        elif self.quant == "blockscale":
            per = SCALE_BLOCK // MX_GROUP
            sa = problem.a_scale.float().repeat_interleave(per, dim=1)
            sb = (problem.b_scale.float().repeat_interleave(SCALE_BLOCK, dim=0)
                  .repeat_interleave(per, dim=1))
        else:
            sa = e8m0_to_float(problem.a_scale)
            sb = e8m0_to_float(problem.b_scale)
        per_tile = BLOCK_K // MX_GROUP
        self.k_iters = k // BLOCK_K
        # row (r, K tile t) at r * k_iters + t: one K tile of one row is one table row
        self.a2 = self.a.view(m * self.k_iters, BLOCK_K)
        self.b2 = self.b.view(n * self.k_iters, BLOCK_K)
        self.sa2 = sa.contiguous().view(m * self.k_iters, per_tile)
        self.sb2 = sb.contiguous().view(n * self.k_iters, per_tile)
        self.ref_fp32 = problem.reference_fp32()
        self.ref = self.ref_fp32.to(torch.bfloat16)
        self.grid_n = n // block_n
        self.n_wg = (m // block_m) * self.grid_n


def _mfma_feeders(schedule: Schedule, wave: int) -> dict:
    """read position -> [(mfma op, a read, b read)] for every MFMA that read feeds."""
    latest, by_read = {}, {}
    for i, (_, op) in enumerate(schedule.wave_program(wave)):
        if isinstance(op, LdsRead):
            latest[op.frag] = (i, op)
        elif isinstance(op, Mfma):
            ra, rb = latest[op.a], latest[op.b]
            by_read.setdefault(ra[0], []).append((op, ra, rb))
            if rb[0] != ra[0]:
                by_read.setdefault(rb[0], []).append((op, ra, rb))
    return by_read


def stale_errors(schedule: Schedule, data: GemmData, stale: list, out_err: torch.Tensor, *,
                 prev_wg_of, chunk: int = 1024, only_wgs=None) -> int:
    """Add to ``out_err`` [M, N] the fp32 error of every MFMA that consumed a stale fragment,
    ``deq(A_used) @ deq(B_used).T - deq(A) @ deq(B).T`` with the correct K tile's scales (scales
    sit in registers); return the number of workgroups affected."""
    g = schedule.geometry
    if not stale:
        return 0
    subs = {}  # (wave, read position, wg) -> {(loader_wave, step): content}
    for sr in stale:
        for wg, c in zip(sr.wgs.tolist(), sr.content.tolist()):
            if only_wgs is not None and wg not in only_wgs:
                continue
            subs.setdefault((sr.wave, sr.read_index, wg), {})[(sr.loader_wave, sr.step)] = c
    feeders = [_mfma_feeders(schedule, v) for v in range(WAVES)]
    items = {}
    for (v, ridx, wg) in subs:
        for op, ra, rb in feeders[v].get(ridx, ()):
            items[(wg, v, id(op))] = (wg, v, op, ra, rb)
    items = list(items.values())

    rows_of, groups_of = {}, {}
    for v in range(WAVES):
        for half in ("A0", "A1", "B0", "B1"):
            rows = np.array(schedule.rows_read(half, v))
            rows_of[(v, half)] = rows
            keys = [((r % 64) // 8, r // 64) for r in rows]
            groups_of[(v, half)] = {k: np.array([kk == k for kk in keys]) for k in set(keys)}

    def operand(wg, v, read, which):
        idx, op = read
        rows = rows_of[(v, op.half)]
        bm, bn = divmod(wg, data.grid_n)
        half_off = (g.block_m if which == "a" else g.block_n) // 2 * (op.half[1] == "1")
        tile_base = (bm * g.block_m if which == "a" else bn * g.block_n)
        local = half_off + rows  # rows inside the block tile
        src = tile_base + local
        tiles = np.full(len(rows), op.ktile)
        for key, c in subs.get((v, idx, wg), {}).items():
            mask = groups_of[(v, op.half)][key]
            if c == PREV_WG:
                pbm, pbn = divmod(prev_wg_of(wg), data.grid_n)
                pbase = pbm * g.block_m if which == "a" else pbn * g.block_n
                src = np.where(mask, pbase + local, src)
                last = g.k_iters - 1 if (g.k_iters - 1) % 2 == op.ktile % 2 else g.k_iters - 2
                tiles[mask] = last
            else:
                tiles[mask] = c
        return tile_base + local, local, src, tiles

    for start in range(0, len(items), chunk):
        part = items[start:start + chunk]
        cols = [[] for _ in range(6)]
        for wg, v, op, ra, rb in part:
            ta, _, sa, tla = operand(wg, v, ra, "a")
            tb, _, sb, tlb = operand(wg, v, rb, "b")
            for lst, x in zip(cols, (ta, sa, tla, tb, sb, tlb)):
                lst.append(x)
        ta, sa, tla, tb, sb, tlb = (torch.from_numpy(np.stack(c)) for c in cols)
        kt = torch.tensor([op.ktile for _, _, op, _, _ in part])[:, None]
        # whole 128-element K-tile rows gathered at once (embedding is the fast row gather)
        kti = data.k_iters

        def rows(table, r, t):
            return torch.embedding(table, (r * kti + t).reshape(-1))

        n_items = len(part)
        s_a = rows(data.sa2, ta, kt).view(n_items, -1, 4, 1)  # correct tile's scales
        s_b = rows(data.sb2, tb, kt).view(n_items, -1, 4, 1)
        da_used = (rows(data.a2, sa, tla).view(n_items, -1, 4, 32) * s_a).view(n_items, -1, BLOCK_K)
        db_used = (rows(data.b2, sb, tlb).view(n_items, -1, 4, 32) * s_b).view(n_items, -1, BLOCK_K)
        da_true = (rows(data.a2, ta, kt).view(n_items, -1, 4, 32) * s_a).view(n_items, -1, BLOCK_K)
        db_true = (rows(data.b2, tb, kt).view(n_items, -1, 4, 32) * s_b).view(n_items, -1, BLOCK_K)
        err = (torch.bmm(da_used, db_used.transpose(1, 2))
               - torch.bmm(da_true, db_true.transpose(1, 2)))
        flat = (ta[:, :, None] * out_err.shape[1] + tb[:, None, :]).reshape(-1)
        out_err.view(-1).index_add_(0, flat, err.reshape(-1))
    return len({wg for wg, *_ in items})


def count_wrong(out: torch.Tensor, ref: torch.Tensor, *, floor: float, rel: float = 0.05) -> int:
    """``cco.quant.count_mismatches`` evaluated only where ``out`` differs bitwise from ``ref``
    (elsewhere it counts nothing); ``floor`` is that function's ``rel * 0.1 * mean|ref|`` of the
    whole reference, computed once per problem."""
    diff = out != ref  # NaN != anything
    if not bool(diff.any()):
        return 0
    o = out[diff].float()
    r = ref[diff].float()
    bad = ~torch.isfinite(o) | ((o - r).abs() > rel * r.abs() + floor)
    return int(bad.sum())


# --------------------------------------------------------------------------- launches


@dataclass(frozen=True)
class LaunchResult:
    wrong: int  # elements > 5% off (or non-finite)
    stale_groups: int  # (workgroup, wave, read, row group) reads that returned another tile
    stale_workgroups: int  # workgroups with at least one such read
    stale_sites: dict  # "section:stage:half" (":k=1" for the first loop step) -> row groups
    dma_cycles: float  # mean issue-to-land time of the tile loads
    end_cycles: float  # median workgroup duration


def run_launches(schedule: Schedule, problem, *, launches: int, seed: int,
                 model: LatencyModel = LatencyModel(), exact: bool = True) -> list:
    """Simulate ``launches`` launches of ``schedule`` on ``problem``; one result per launch.

    ``exact=False`` stops counting a launch's wrong elements at the first batch of workgroups
    that has any (``wrong`` is then a lower bound, exact about zero vs non-zero).
    """
    g = schedule.geometry
    m, n, k = problem.shape
    if k != g.k:
        raise ValueError(f"run_launches: problem K={k} does not match the schedule's k={g.k}; "
                         "build the schedule with the problem's K")
    if m % g.block_m or n % g.block_n:
        raise ValueError(f"run_launches: shape {m}x{n} is not a multiple of the tile "
                         f"{g.block_m}x{g.block_n}; pick M, N multiples of the tile")
    data = GemmData(problem, block_m=g.block_m, block_n=g.block_n)
    rng = np.random.default_rng(seed)
    n_wg = data.n_wg

    def prev_wg_of(wg: int) -> int:
        return (wg - model.cus) % n_wg if n_wg > 1 else wg

    floor = 0.05 * 0.1 * float(data.ref.float().abs().mean())
    streams = [schedule.wave_program(w) for w in range(WAVES)]
    results = []
    for _ in range(launches):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)  # poison
        timing = simulate_timing(schedule, n_wg=n_wg, model=model, rng=rng)
        stale = find_stale(schedule, timing)
        err = torch.zeros(m, n)
        # every workgroup writes its tile: the reference where it read nothing stale
        out.copy_(data.ref)
        affected = sorted({wg for sr in stale for wg in sr.wgs.tolist()})
        wrong = 0
        step = len(affected) if exact else WG_BATCH
        for i in range(0, len(affected), max(step, 1)):
            batch = set(affected[i:i + step])
            stale_errors(schedule, data, stale, err, prev_wg_of=prev_wg_of, only_wgs=batch)
            hit = err != 0
            out[hit] = (data.ref_fp32[hit] + err[hit]).to(torch.bfloat16)
            err.zero_()
            if not exact:
                wrong += count_wrong(out[hit], data.ref[hit], floor=floor)
                out[hit] = data.ref[hit]  # counted; keep the next batch's count separate
                if wrong:
                    break
        if exact:
            wrong = count_wrong(out, data.ref, floor=floor)
        else:
            wrong += int(torch.isnan(out).sum())  # a tile nobody wrote
        bad_wgs = len(affected)
        sites = {}
        for sr in stale:
            phase = streams[sr.wave][sr.read_index][0]
            key = f"{phase.section}:{phase.stage}:{sr.half}"
            if phase.section == "loop" and phase.step == 1:
                key += ":k=1"
            sites[key] = sites.get(key, 0) + len(sr.wgs)
        results.append(LaunchResult(wrong=wrong, stale_groups=sum(len(s.wgs) for s in stale),
                                    stale_workgroups=bad_wgs, stale_sites=sites,
                                    dma_cycles=_mean_dma(timing),
                                    end_cycles=float(np.median(timing.end))))
    return results


def _mean_dma(timing: Timing) -> float:
    tot = cnt = 0.0
    for w in range(WAVES):
        for i, (op, _) in enumerate(timing.vm_ops[w]):
            if isinstance(op, LoadTile):
                tot += float((timing.lands[w][i] - timing.issues[w][i]).sum())
                cnt += timing.n_wg
    return tot / cnt if cnt else 0.0


def read_slack_cycles(schedule: Schedule, *, n_wg: int, seed: int, model: LatencyModel,
                      reads) -> np.ndarray:
    """Cycles between each listed read's sample and the landing of its producers (min over
    the read's non-guaranteed source rows), over ``n_wg`` sampled workgroups.

    ``reads``: :class:`~kernels_fused.pipeline.happens_before.ReadVerdict` items (usually the timing-only
    ones). How much extra DMA latency those reads tolerate before they go stale.
    """
    timing = simulate_timing(schedule, n_wg=n_wg, model=model, rng=np.random.default_rng(seed))
    index = []
    for w in range(WAVES):
        index.append({(op.half, op.ktile, st): i for i, (op, st) in enumerate(timing.vm_ops[w])
                      if isinstance(op, LoadTile)})
    slacks = []
    for rv in reads:
        for (idx, op, sample) in timing.reads[rv.wave]:
            if op.half != rv.half or op.ktile != rv.ktile:
                continue
            for src in rv.sources:
                if src.guaranteed:
                    continue
                land = timing.lands[src.loader_wave][index[src.loader_wave][(op.half, op.ktile,
                                                                              src.step)]]
                slacks.append(sample - land)
    return np.concatenate(slacks) if slacks else np.zeros(0)


__all__ = ["LatencyModel", "Timing", "StaleRows", "GemmData", "LaunchResult", "simulate_timing",
           "find_stale", "stale_errors", "count_wrong", "run_launches", "read_slack_cycles"]
