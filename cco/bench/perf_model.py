"""Cost model of the gemm-ar arms at world W, calibrated on the 2x H200 measurements of
docs/BENCHMARKS.md and docs/experiments.md: pure arithmetic (no torch), so it runs anywhere.

It predicts, per ``(M, world, quant, gather)`` at N = 7168, K = 2048 per rank:

    scaled_mm+nccl  = GEMM(M) + NCCL all_reduce(M, W)
    split           = GEMM(M), then the copy-engine all-reduce of ``cco.cuda.dma``
    fused           = the same transfers started by the GEMM's counters while it runs, the GEMM
                      walking the layout's (chunk, dest) order (the gfx950 kernel's; the CUDA
                      fused launch walks every peer's tiles first, which is not simulated)

**Physical assumptions** (each one is a way the predictions can be wrong; docs/SCALING.md):

1. The GEMM's time does not depend on W: K per rank is fixed, and each rank computes a full
   ``[M, N]`` partial. GEMM times are *measured inputs* (the 2-GPU sweep), not fitted.
2. Bytes each rank sends per direction: ``(W-1)/W x 2MN`` for the scatter plus the same for the
   gather, ``2(W-1)/W x 2MN`` in all for a bf16 partial (``link_bytes``); the fp8 gather sends one
   byte per element and one fp32 scale per row and 128 columns instead of two bytes.
3. One copy-engine rate per GPU and direction, shared equally by the copies in flight on the put
   streams (one per peer, or ``lanes`` per peer taking the copies in turn), capped by NVLink's
   450 GB/s per direction per GPU through NVSwitch: the rate seen with one peer is assumed to hold
   with seven.
4. Every step of the transport (a put, a reduce, an assemble) starts a fixed latency after its
   inputs are complete (stream waits on flags written by another stream or GPU, flag writes, copy
   setup). The latency holds neither the link nor the SMs: other peers' copies fill the link.
5. Reduce and assemble kernels are HBM-bound: their time is their bytes over a rate taken from the
   2-GPU profile. They take the SMs from the GEMM (at its wave boundaries) while they run, which is
   how the fused GEMM stretched from 395 to 537 us in the profile.
6. NCCL's all_reduce costs ``alpha + bus bytes / busbw``, ``alpha`` and ``busbw`` independent of W
   (bus bandwidth is defined so that an ideal ring keeps it constant as W grows).

**Calibration** (``calibrate()``; the inputs are ``H200X2``, each with its source). Four fitted
parameters, each solved so the model passes exactly through measured points of the 2-GPU sweep:
``copy_gbs`` and ``step_latency_us`` through the fused arm at M = 2048 and 16384 (the latency sets
small M, the rate large M); ``nccl_alpha_us`` and ``nccl_busbw_gbs`` through ``scaled_mm+nccl -
scaled_mm`` at M = 4096 and 16384. Taken as measured: the GEMM times, the reduce (41 us) and
assemble (37 us) kernels of the profile, and blockscale's GEMM times as ratios to ptpc's measured on
one H200 in one run: the Triton kernels (578.7 / 411.3 us) and cuBLAS (391.0 / 318.7 us).
Every other 2-GPU figure is held out (``check_2gpu``): split at every M, the fp8 gather at every M,
fused at 4096, 8192, 32768, NCCL at 2048, 8192, 32768; and the fitted copy rate must fall in the
range the profile's copies ran at (341-381 GB/s).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace

from cco import layout

N = 7168
K = 2048
WORLDS = (2, 4, 8)
# the layout's tile on CUDA (cco.backends.cuda.CudaBackend.tile): the m-tile is the chunk granularity
CUDA_BLOCK_M = {"ptpc": 128, "blockscale": 64}
CUDA_BLOCK_N = 128
CHUNKS = layout.DEFAULT_CHUNKS
H200_SMS = 132
# fused GEMM programs resident per SM (a wave is H200_SMS x this many tiles): blockscale's 64x128
# programs of one warp group run three to an SM (kernels_fused.hopper.gemm)
PROGRAMS_PER_SM = {"ptpc": 1, "blockscale": 3}
# block_n of the Triton kernel's Hopper launch (kernels_fused.hopper.gemm.default_config); the fused
# launch uses it only where it covers two whole layout tiles of a rank's slice (CudaBackend)
TRITON_BLOCK_N = {"ptpc": 256, "blockscale": 128}
NVLINK_GBS = 450.0  # H200 NVLink, per direction per GPU, to all peers through NVSwitch
QUANTS = ("ptpc", "blockscale")
GATHERS = ("bf16", "fp8")

# --------------------------------------------------------------------------------------------------
# what was measured (docs/BENCHMARKS.md and docs/experiments.md, 2x H200, 2026-11-30); times in us
# --------------------------------------------------------------------------------------------------
H200X2 = {
    # "Sweep over M" table, 19:26 UTC, --graph, ptpc, chunks = 4
    "sweep": {
        2048: {"scaled_mm": 50.4, "gemm-only": 62.4, "scaled_mm+nccl": 173.2, "split": 266.6, "fused": 219.6,
               "fused-fp8": 206.3},
        4096: {"scaled_mm": 87.7, "gemm-only": 106.4, "scaled_mm+nccl": 316.4, "split": 393.5, "fused": 307.8,
               "fused-fp8": 283.0},
        8192: {"scaled_mm": 165.0, "gemm-only": 205.7, "scaled_mm+nccl": 582.2, "split": 665.3, "fused": 492.9,
               "fused-fp8": 424.1},
        16384: {"scaled_mm": 325.9, "gemm-only": 395.0, "scaled_mm+nccl": 1115.0, "split": 1190.7, "fused": 856.8,
                "fused-fp8": 706.7},
        32768: {"scaled_mm": 653.3, "gemm-only": 777.6, "scaled_mm+nccl": 2142.2, "split": 2285.9, "fused": 1625.3,
                "fused-fp8": 1329.5},
    },
    # "Headline" table, 19:26 UTC, [16384, 7168] K=2048 ptpc
    "headline": {"m": 16384, "scaled_mm": 326.6, "gemm-only": 389.5, "scaled_mm+nccl": 1113.8, "split": 1208.8,
                 "fused": 856.9, "fused-fp8": 704.3},
    # the profile of one fused call (same run): reduce of one chunk (4096 rows x 3584 columns, W = 2)
    # and the assemble of the peer's columns of one chunk ("36-38 us each")
    "reduce_chunk_us": 41.0,
    "assemble_chunk_us": 37.0,
    "profile_chunk_rows": 4096,
    # the profile's peer copies: 29.4 MB in 77-86 us each
    "copy_gbs_range": (341.0, 381.0),
    # one H200, 16384x7168x2048, graph replays, 2026-12-01 20:00 UTC (docs/experiments.md, blockscale): the Triton
    # fused-launch kernels (blockscale 64x128 of 4 warps, ptpc 128x256 grid), and cuBLAS (blockwise
    # recipe; ptpc with fast accumulation, as the sweep's scaled_mm)
    "triton_blockscale_us": 578.7,
    "triton_ptpc_us": 411.3,
    "cublas_blockscale_us": 391.0,
    "cublas_ptpc_us": 318.7,
}
FUSED_FIT_M = (2048, 16384)  # sweep points the transport is fitted on (fused, bf16 gather)
NCCL_FIT_M = (4096, 16384)  # sweep points NCCL's line is fitted on (scaled_mm+nccl - scaled_mm)


# --------------------------------------------------------------------------------------------------
# bytes and floors
# --------------------------------------------------------------------------------------------------
def _check(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not modelled; pass one of {', '.join(map(str, allowed))}")


def slice_bytes(rows: int, n: int, world: int, *, dtype: str) -> int:
    """Bytes of one (peer, chunk) put: ``rows`` rows of one rank's N/W column slice; the fp8 gather
    also sends one fp32 scale per row and 128 columns."""
    n_slice = n // world
    return rows * n_slice * 2 if dtype == "bf16" else rows * n_slice + rows * layout.gather_scale_cols(n_slice) * 4


def link_bytes(m: int, n: int, world: int, *, gather: str = "bf16") -> int:
    """Bytes one rank sends (and, by symmetry, receives) per call: W-1 peers x (scatter + gather).
    For the bf16 gather this is ``2 (W-1)/W x 2 M N`` when W divides N."""
    _check("gather", gather, GATHERS)
    return (world - 1) * (slice_bytes(m, n, world, dtype="bf16") + slice_bytes(m, n, world, dtype=gather))


def nccl_bytes(m: int, n: int, world: int) -> float:
    """The bus bytes of a bf16 all_reduce of ``[m, n]``: ``2 (W-1)/W x 2 M N``."""
    return 2 * (world - 1) / world * 2 * m * n


def _us(nbytes: float, gbs: float) -> float:
    return nbytes / (gbs * 1e3)  # GB/s = 1e3 bytes per us


# --------------------------------------------------------------------------------------------------
# calibration
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Calibration:
    copy_gbs: float  # copy-engine rate per GPU and direction, all put streams together
    reduce_gbs: float  # bytes the reduce kernel reads + writes, per us x 1e-3
    assemble_gbs: float  # same for the assemble (pitched copy / dequant) of the peers' columns
    step_latency_us: float  # from a step's inputs being complete to its start (fitted)
    nccl_alpha_us: float  # NCCL all_reduce latency term (fitted)
    nccl_busbw_gbs: float  # NCCL all_reduce bus bandwidth (fitted)
    blockscale_factor: dict  # kernel -> blockscale GEMM time / ptpc GEMM time (measured)
    gemm_us: dict  # M -> {"scaled_mm": us, "gemm-only": us}: measured, independent of W

    def with_(self, **changes) -> Calibration:
        return replace(self, **changes)


def _reduce_bytes(rows: int, n: int, world: int, gather: str) -> int:
    """The reduce kernel of one chunk: reads the own partial and W-1 received slices, writes the
    reduced slice into ``gather`` (bf16, or e4m3 + scales) and into ``out``'s own columns."""
    n_slice = n // world
    return rows * n_slice * (2 * world + 2) + slice_bytes(rows, n, world, dtype=gather)


def _assemble_bytes(rows: int, n: int, world: int, gather: str) -> int:
    """The assemble of one chunk: the W-1 peers' gathered slices read, written into ``out`` as bf16."""
    return (world - 1) * (slice_bytes(rows, n, world, dtype=gather) + rows * (n // world) * 2)


def calibrate(data: dict = H200X2, *, n: int = N) -> Calibration:
    """The model's parameters from the 2-GPU measurements (see the module doc for which)."""
    rows, w2 = data["profile_chunk_rows"], 2
    sweep = data["sweep"]
    # NCCL: the line through two points of the sweep; the other M values are held out
    (m_lo, m_hi) = NCCL_FIT_M
    t_lo = sweep[m_lo]["scaled_mm+nccl"] - sweep[m_lo]["scaled_mm"]
    t_hi = sweep[m_hi]["scaled_mm+nccl"] - sweep[m_hi]["scaled_mm"]
    b_lo, b_hi = nccl_bytes(m_lo, n, w2), nccl_bytes(m_hi, n, w2)
    us_per_byte = (t_hi - t_lo) / (b_hi - b_lo)
    alpha = t_lo - b_lo * us_per_byte
    base = Calibration(
        copy_gbs=0.0,  # fitted below
        reduce_gbs=_reduce_bytes(rows, n, w2, "bf16") / data["reduce_chunk_us"] / 1e3,
        assemble_gbs=_assemble_bytes(rows, n, w2, "bf16") / data["assemble_chunk_us"] / 1e3,
        step_latency_us=0.0,
        nccl_alpha_us=alpha,
        nccl_busbw_gbs=1e-3 / us_per_byte,
        blockscale_factor={"gemm-only": data["triton_blockscale_us"] / data["triton_ptpc_us"],
                           "scaled_mm": data["cublas_blockscale_us"] / data["cublas_ptpc_us"]},
        gemm_us={m: {"scaled_mm": v["scaled_mm"], "gemm-only": v["gemm-only"]} for m, v in sweep.items()},
    )
    # the transport: copy rate and step latency such that the model gives the measured fused time at
    # the two ends of the fitted range (the latency dominates at small M, the rate at large M)
    m_small, m_large = FUSED_FIT_M

    def latency_for(rate):
        cal = base.with_(copy_gbs=rate)
        return _solve(lambda lat: fused_us(m_small, 2, cal=cal.with_(step_latency_us=lat), n=n)
                      - sweep[m_small]["fused"], lo=0.0, hi=100.0, what="step_latency_us")

    def large_m_error(rate):
        cal = base.with_(copy_gbs=rate, step_latency_us=latency_for(rate))
        return sweep[m_large]["fused"] - fused_us(m_large, 2, cal=cal, n=n)

    rate = _solve(large_m_error, lo=200.0, hi=NVLINK_GBS, tol=0.05, what="copy_gbs")
    return base.with_(copy_gbs=rate, step_latency_us=latency_for(rate))


def _solve(f, *, lo: float, hi: float, tol: float = 1e-3, what: str) -> float:
    """A sign change of ``f`` on [lo, hi] by bisection (``f(lo) <= 0 <= f(hi)`` required)."""
    f_lo, f_hi = f(lo), f(hi)
    if not f_lo <= 0 <= f_hi:
        raise ValueError(f"calibrate: no {what} in [{lo}, {hi}] reproduces the fitted points (residual "
                         f"{f_lo:.1f} .. {f_hi:.1f} us); check the measurements passed in")
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return 0.5 * (lo + hi)


# --------------------------------------------------------------------------------------------------
# the arms
# --------------------------------------------------------------------------------------------------
def gemm_us(m: int, *, quant: str, kernel: str, cal: Calibration) -> float:
    """GEMM time at M (``kernel``: "scaled_mm" = cuBLAS, "gemm-only" = the Triton kernel), linear
    between measured M values (the GEMM is linear in M once the grid fills the GPU). Blockscale:
    the same kernel's ptpc time x its measured blockscale factor (cuBLAS's blockwise recipe, the
    Triton blockscale kernel)."""
    _check("quant", quant, QUANTS)
    _check("kernel", kernel, ("scaled_mm", "gemm-only"))
    if quant == "blockscale":
        return gemm_us(m, quant="ptpc", kernel=kernel, cal=cal) * cal.blockscale_factor[kernel]
    ms = sorted(cal.gemm_us)
    if not ms[0] <= m <= ms[-1]:
        raise ValueError(f"m={m} is outside the measured GEMM range {ms[0]}..{ms[-1]}; the model does not "
                         f"extrapolate the GEMM, pass an M in that range")
    i = min(bisect.bisect_left(ms, m), len(ms) - 1)
    if ms[i] == m:
        return cal.gemm_us[m][kernel]
    m0, m1 = ms[i - 1], ms[i]
    t0, t1 = cal.gemm_us[m0][kernel], cal.gemm_us[m1][kernel]
    return t0 + (t1 - t0) * (m - m0) / (m1 - m0)


def nccl_allreduce_us(m: int, world: int, *, cal: Calibration, n: int = N) -> float:
    return cal.nccl_alpha_us + nccl_bytes(m, n, world) * 1e-3 / cal.nccl_busbw_gbs


def baseline_us(m: int, world: int, *, quant: str = "ptpc", cal: Calibration, n: int = N) -> float:
    """``scaled_mm+nccl``: cuBLAS (rowwise for ptpc, blockwise for blockscale), then NCCL all_reduce."""
    return gemm_us(m, quant=quant, kernel="scaled_mm", cal=cal) + nccl_allreduce_us(m, world, cal=cal, n=n)


def fused_floor_us(m: int, world: int, *, quant: str = "ptpc", gather: str = "bf16", cal: Calibration,
                   n: int = N) -> float:
    """What no fused op can beat: max(GEMM alone, bytes per direction / link rate)."""
    rate = min(cal.copy_gbs, NVLINK_GBS)
    return max(gemm_us(m, quant=quant, kernel="gemm-only", cal=cal), _us(link_bytes(m, n, world, gather=gather), rate))


def fused_us(m: int, world: int, *, quant: str = "ptpc", gather: str = "bf16", cal: Calibration,
             n: int = N, chunks: int = CHUNKS, lanes: int = 1) -> float:
    return simulate(m, world, quant=quant, gather=gather, cal=cal, n=n, chunks=chunks, overlap=True,
                    lanes=lanes).end


def split_us(m: int, world: int, *, quant: str = "ptpc", gather: str = "bf16", cal: Calibration,
             n: int = N, chunks: int = CHUNKS) -> float:
    return simulate(m, world, quant=quant, gather=gather, cal=cal, n=n, chunks=chunks, overlap=False).end


# --------------------------------------------------------------------------------------------------
# the transport's timeline (cco.cuda.dma): one rank, all ranks alike
# --------------------------------------------------------------------------------------------------
def fused_block_n(quant: str, world: int, *, n: int = N) -> int:
    """Tile width of the fused launch: the kernel's own width where two layout tiles pair up within
    a rank's slice, else the layout tile (at W = 8, N = 7168: 896 = 7 x 128, so ptpc runs 128 wide)."""
    base = TRITON_BLOCK_N[quant]
    layout_tiles = (n // world) // CUDA_BLOCK_N
    return base if base == 2 * CUDA_BLOCK_N and layout_tiles % 2 == 0 else CUDA_BLOCK_N


def gemm_waves(m: int, world: int, *, quant: str, n: int = N) -> int:
    """Waves of the fused GEMM launch: its tiles over the programs resident at once."""
    tiles = -(-m // CUDA_BLOCK_M[quant]) * (n // fused_block_n(quant, world, n=n))
    return -(-tiles // (H200_SMS * PROGRAMS_PER_SM[quant]))


def put_stream_order(chunks: int) -> list[tuple[str, int]]:
    """Copies on each peer's put stream: S0 S1 G0 S2 G1 ... G(C-1) (``cco.cuda.dma.submission_order``)."""
    order = [("scatter", 0)]
    for c in range(1, chunks):
        order += [("scatter", c), ("gather", c - 1)]
    return order + [("gather", chunks - 1)]


@dataclass(frozen=True)
class Timeline:
    end: float  # the call's end (everything joined)
    gemm_end: float  # the GEMM's last tile (later than its time alone when kernels took its SMs)
    first_put_start: float
    link_busy_us: float  # time with at least one copy moving bytes
    reduce_end: tuple[float, ...]
    assemble_end: tuple[float, ...]


def simulate(m: int, world: int, *, quant: str = "ptpc", gather: str = "bf16", cal: Calibration, n: int = N,
             chunks: int = CHUNKS, overlap: bool = True, lanes: int = 1, trace: list | None = None) -> Timeline:
    """Event simulation of one call on one rank. All ranks run the same timeline (the walk order only
    rotates which peer is served first), so what a rank receives arrives when what it sends leaves.

    Resources: the SMs, held by the GEMM except while reduce or assemble kernels run (those share the
    SMs among themselves); and the link, whose ``copy_gbs`` the copies in flight share equally. Every
    step (a put, a reduce, an assemble) starts ``step_latency_us`` after its inputs are complete.
    ``overlap=False`` is the split mode: every put waits for the whole GEMM. ``lanes``: put streams
    per peer taking the copies in turn (``cco.cuda.dma.put_lanes``): one lane's latency runs while
    another's copy moves. ``chunks``: a count or relative sizes (``cco.layout.chunk_tiles``).
    ``trace``, if given, gets ``(time, event)`` for every start and end."""
    _check("world", world, tuple(range(2, 9)))
    cfg = layout.build_config(n=n, k=K, m_max=m, world=world, block_m=CUDA_BLOCK_M[quant], chunks=chunks)
    rows = [r1 - r0 for r0, r1 in layout.chunk_rows(cfg, m)]
    per_slot = layout.tiles_per_slot(cfg, m)
    n_chunks = len(rows)
    t_gemm = gemm_us(m, quant=quant, kernel="gemm-only", cal=cal)
    # GEMM progress (us of GEMM work) at which slice (chunk c, j-th destination of the walk) is written
    total_tiles, done_tiles, ready_at = world * sum(per_slot), 0, {}
    for c in range(n_chunks):
        for j in range(world):
            done_tiles += per_slot[c]
            ready_at[(c, j)] = t_gemm * done_tiles / total_tiles
    # a side kernel takes the SMs only as the GEMM's tiles in flight retire: at wave boundaries
    wave = t_gemm / gemm_waves(m, world, quant=quant, n=n)
    ready_at = {key: min(t_gemm, math.ceil(v / wave - 1e-6) * wave) for key, v in ready_at.items()}
    rate = min(cal.copy_gbs, NVLINK_GBS) * 1e3  # bytes per us
    lat = cal.step_latency_us
    eps = 1e-9

    # stream (d, l): lane l of the d-th destination of the walk (the own slice is last), every
    # lanes-th copy of that destination's put order
    peers = [(d, lane) for d in range(world - 1) for lane in range(lanes)]
    queue = {(d, lane): put_stream_order(n_chunks)[lane::lanes] for d, lane in peers}
    starts_at = {}  # p -> time its head copy starts moving (in its latency)
    moving = {}  # p -> bytes left of its head copy
    kernels = {}  # "reduce" / "assemble" -> [chunk, us of whole-GPU work left]
    kernel_at = {}  # "reduce" / "assemble" -> time the stream's next kernel may start
    scatters, gathers = [0] * n_chunks, [0] * n_chunks  # copies done per chunk (all peers)
    reduced, assembled = {}, {}
    nxt = {"reduce": 0, "assemble": 0}
    t = progress = 0.0 if overlap else t_gemm
    gemm_end, first_put, link_busy = t_gemm, None, 0.0

    def gemm_wrote(c, j):
        return progress >= ready_at[(c, j)] - eps

    def at_wave_boundary():
        return progress >= t_gemm - eps or abs(progress - round(progress / wave) * wave) < 1e-6

    def inputs_ready(kind, c):
        if kind == "reduce":  # the own slice written and every peer's scatter of the chunk landed
            return gemm_wrote(c, world - 1) and scatters[c] == world - 1
        return gathers[c] == world - 1

    def kernel_us(kind, c):
        nbytes = (_reduce_bytes if kind == "reduce" else _assemble_bytes)(rows[c], n, world, gather)
        return _us(nbytes, cal.reduce_gbs if kind == "reduce" else cal.assemble_gbs)

    while True:
        # start what can start
        for p in peers:
            if p not in starts_at and p not in moving and queue[p]:
                phase, c = queue[p][0]
                if gemm_wrote(c, p[0]) if phase == "scatter" else c in reduced:
                    starts_at[p] = t + lat
                    first_put = t if first_put is None else first_put
        for kind in ("reduce", "assemble"):
            c = nxt[kind]
            if kind not in kernels and c < n_chunks:
                if kind not in kernel_at and inputs_ready(kind, c):
                    kernel_at[kind] = t + lat
                if kernel_at.get(kind, float("inf")) <= t + eps and (kernels or at_wave_boundary()):
                    kernels[kind] = [c, kernel_us(kind, c)]
                    _note(trace, t, f"{kind} {c} start")
                    del kernel_at[kind]
        if len(assembled) == n_chunks and progress >= t_gemm - eps:
            break
        # the next event
        events = [max(v - t, 0.0) for v in starts_at.values()]
        events += [v - t for v in kernel_at.values() if v > t + eps]  # else it waits for a wave boundary
        if kernels:
            events.append(min(left for _, left in kernels.values()) * len(kernels))
        elif progress < t_gemm - eps:
            events.append(min(t_gemm, (math.floor(progress / wave + 1e-6) + 1) * wave) - progress)
        if moving:
            events.append(min(moving.values()) * len(moving) / rate)
        assert events, "simulation stalled"  # every wait has a producer: a model bug, not an input
        dt = max(min(events), 0.0)
        # advance
        if kernels:
            for job in kernels.values():
                job[1] -= dt / len(kernels)
        elif progress < t_gemm - eps:
            progress = min(progress + dt, t_gemm)
            if progress >= t_gemm - eps:
                gemm_end = t + dt
                _note(trace, gemm_end, "gemm end")
        if moving:
            link_busy += dt
            moving = {p: left - dt * rate / len(moving) for p, left in moving.items()}
        t += dt
        # complete
        for kind, (c, left) in list(kernels.items()):
            if left <= eps:
                (reduced if kind == "reduce" else assembled)[c] = t
                _note(trace, t, f"{kind} {c} end")
                del kernels[kind]
                nxt[kind] += 1
        for p, when in list(starts_at.items()):
            if when <= t + eps:
                del starts_at[p]
                phase, c = queue[p][0]
                moving[p] = slice_bytes(rows[c], n, world, dtype="bf16" if phase == "scatter" else gather)
                _note(trace, t, f"{phase} {c} to peer {p[0]} start")
        for p, left in list(moving.items()):
            if left <= 1e-6:
                del moving[p]
                phase, c = queue[p].pop(0)
                (scatters if phase == "scatter" else gathers)[c] += 1
                _note(trace, t, f"{phase} {c} to peer {p[0]} end")
    return Timeline(end=t, gemm_end=gemm_end, first_put_start=first_put,
                    link_busy_us=link_busy, reduce_end=tuple(reduced[c] for c in range(n_chunks)),
                    assemble_end=tuple(assembled[c] for c in range(n_chunks)))


def _note(trace, t, what):
    if trace is not None:
        trace.append((round(t, 3), what))


# --------------------------------------------------------------------------------------------------
# predictions and the check against what was measured
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prediction:
    m: int
    world: int
    quant: str
    baseline_us: float  # scaled_mm+nccl (cuBLAS + NCCL, as the benchmark runs it)
    split_us: float
    split_fp8_us: float
    fused_us: float
    fused_fp8_us: float
    floor_us: float  # max(GEMM, link bytes / rate), bf16 gather
    floor_fp8_us: float

    @property
    def fused_ratio(self) -> float:
        return self.fused_us / self.baseline_us

    @property
    def fused_fp8_ratio(self) -> float:
        return self.fused_fp8_us / self.baseline_us


def predict(m: int, world: int, *, quant: str = "ptpc", cal: Calibration, n: int = N,
            chunks: int = CHUNKS) -> Prediction:
    _check("quant", quant, QUANTS)
    kw = dict(quant=quant, cal=cal, n=n)
    return Prediction(
        m=m, world=world, quant=quant, baseline_us=baseline_us(m, world, **kw),
        split_us=split_us(m, world, gather="bf16", chunks=chunks, **kw),
        split_fp8_us=split_us(m, world, gather="fp8", chunks=chunks, **kw),
        fused_us=fused_us(m, world, gather="bf16", chunks=chunks, **kw),
        fused_fp8_us=fused_us(m, world, gather="fp8", chunks=chunks, **kw),
        floor_us=fused_floor_us(m, world, gather="bf16", **kw),
        floor_fp8_us=fused_floor_us(m, world, gather="fp8", **kw))


@dataclass(frozen=True)
class Check:
    arm: str  # the benchmark's arm name
    m: int
    measured_us: float
    model_us: float
    fitted: bool  # a point the calibration passes through (else held out)

    @property
    def error(self) -> float:
        return self.model_us / self.measured_us - 1


def check_2gpu(cal: Calibration, data: dict = H200X2, *, n: int = N) -> list[Check]:
    """The model against every 2-GPU ptpc figure of the sweep, fitted points marked."""
    rows = []
    for m, meas in sorted(data["sweep"].items()):
        model = {
            "scaled_mm+nccl": baseline_us(m, 2, cal=cal, n=n),
            "split": split_us(m, 2, cal=cal, n=n),
            "fused": fused_us(m, 2, cal=cal, n=n),
            "fused-fp8": fused_us(m, 2, gather="fp8", cal=cal, n=n),
        }
        for arm, value in model.items():
            fitted = (arm == "fused" and m in FUSED_FIT_M) or (arm == "scaled_mm+nccl" and m in NCCL_FIT_M)
            rows.append(Check(arm, m, meas[arm], value, fitted))
    return rows


# the stated error bound of the model on held-out 2-GPU points (check_2gpu): the largest error seen
# at calibration time was 9.9 % (fused-fp8, M = 4096); the bound leaves room, not a target
HELD_OUT_TOLERANCE = 0.12

# AMD's published 8x MI355X figures at [16384, 7168] K=2048 ptpc (mori gemm_ar; DESIGN.md)
MI355X_W8 = {"baseline_us": 1419.5, "fused_us": 1114.5, "fused_fp8_us": 979.3}
TARGET_W8_RATIO = 0.70  # the target: fused <= 0.70x of scaled_mm + NCCL at W = 8, [16384, 7168] ptpc


def sensitivity(m: int = 16384, world: int = 8, *, quant: str = "ptpc", cal: Calibration) -> dict:
    """fused / baseline at one point when one assumption is off: name -> (bf16 ratio, fp8 ratio)."""
    # name -> (calibration of the op's arms, calibration of the baseline)
    cases = {
        "as calibrated": (cal, cal),
        "copy rate x0.75 (fewer copy engines per peer, NVSwitch contention)":
            (cal.with_(copy_gbs=cal.copy_gbs * 0.75), cal),
        "copy rate up to 450 GB/s (NVLink line rate)": (cal.with_(copy_gbs=NVLINK_GBS), cal),
        "step latency x2 (more streams, more waits per call)":
            (cal.with_(step_latency_us=2 * cal.step_latency_us), cal),
        "NCCL bus bandwidth x1.2 (another algorithm at W=8)":
            (cal, cal.with_(nccl_busbw_gbs=1.2 * cal.nccl_busbw_gbs)),
        "NCCL bus bandwidth x0.8": (cal, cal.with_(nccl_busbw_gbs=0.8 * cal.nccl_busbw_gbs)),
        "fused GEMM x1.2 (128-wide tiles at W=8)": (cal.with_(gemm_us=_scaled_triton(cal, 1.2)), cal),
    }
    out = {}
    for name, (op_cal, base_cal) in cases.items():
        base = baseline_us(m, world, quant=quant, cal=base_cal)
        out[name] = (fused_us(m, world, quant=quant, cal=op_cal) / base,
                     fused_us(m, world, quant=quant, gather="fp8", cal=op_cal) / base)
    return out


def _scaled_triton(cal: Calibration, factor: float) -> dict:
    """GEMM table with the Triton kernel's times scaled (cuBLAS unchanged)."""
    return {m: {"scaled_mm": t["scaled_mm"], "gemm-only": t["gemm-only"] * factor} for m, t in cal.gemm_us.items()}
