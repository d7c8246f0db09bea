"""``compile_fused_gemm_scatter``: the 8-wave a8w8 bpreshuffle fp8 GEMM for gfx950, in FlyDSL.

How the kernel works:

1. A workgroup of 512 threads (8 waves) computes one ``BLOCK_M x BLOCK_N`` output tile. Wave ``w``
   owns rows ``wave_m = w // 4`` and columns ``wave_n = w % 4`` of each quarter (c00, c01, c10, c11)
   of the tile; the quarters are the products of the A half-tiles (A0, A1) and B half-tiles (B0, B1).
2. Each half-tile has two LDS slots (double buffer): eight LDS half-tiles of 128 K bytes. All eight
   waves fill every half-tile with LDS-DMA loads (``buffer_load_dwordx4 ... lds``), ``A`` or ``B``
   instructions per wave (``A = BLOCK_M / 128``, ``B = BLOCK_N / 128``).
3. The pipeline is not written here: it is EMITTED by walking the program of
   :mod:`kernels_fused.pipeline.schedule` (prologue, main-loop phases S0..S3, the peeled steps K-2 and K-1),
   event by event: a load event issues one half-tile's DMA, a read event loads that half-tile's
   MFMA fragments, an mfma event runs one quarter, and the waits/barriers are inline asm
   (``s_waitcnt vmcnt(n); s_barrier`` etc.) so LLVM cannot move LDS reads across them. The lag
   barrier (``if wave_m == 1: s_barrier``) puts waves 4-7 one barrier behind waves 0-3.
4. Quant: ``ptpc`` applies the fp32 row scales of A and B in the epilogue. ``blockscale`` runs
   each MFMA from zero and folds it at once into its accumulator with that K tile's A (1x128) and
   B (128x128) scales, ``acc += part * sa * sb`` (four temporaries, no second accumulator set).
   ``mxfp8`` feeds the e8m0 scales to ``v_mfma_scale_f32_16x16x128_f8f6f4`` as operands (one per
   lane = row x 32-wide K group). Scale loads follow the schedule's per-half ``ScaleLoad`` events.
   Addresses are per-lane registers formed once plus immediates (``stages``), the tile origin a
   2-D grid position (``fuse=False``) or a scalar load of the tile table (``fuse=True``): the
   prologue divides nothing at run time.
5. Epilogue: ptpc's row scales are loaded once per tile, ahead of the close barrier; each wave
   writes its accumulators as bf16 into its own region of LDS (the A/B buffers: the close barrier
   pairs with the lagging group's last MFMA barrier, so no wave reads them any more) and stores
   them back as 16-byte row vectors (``byte_layout.CStage``: 16 ``buffer_store_dwordx4`` per wave
   at 256x256), waiting on none of them. With ``fuse=True`` the tile goes to the op's window region
   ``partial[dest, row, col]`` (``cco.layout``), then ``s_waitcnt vmcnt(0); s_barrier`` and one
   thread adds 1 to ``counters[dest, chunk]`` with acq_rel ordering at system scope. Counters are
   monotonic and never reset (graph replay safe: targets grow by a known amount per call,
   ``cco.layout.plan_call``); the transport watches them and moves a chunk when it is complete.
   Tiles are walked in ``cco.layout.tile_table`` order, (chunk, dest, m, n) with dest rotated by
   rank, read from an int32 table tensor indexed by the workgroup id. A tile's (row0, col0) lie
   within dest's slice, which starts at A row ``dest * a_step`` and B row ``dest * b_step`` (runtime
   arguments: ``(0, N/W)`` for slices by columns, the all-reduce's; ``(M/W, 0)`` for slices by rows,
   the reduce-scatter along tokens), so one kernel serves every pattern that scatters tiles.

Constraints: K >= 256 and K % 128 == 0 (fixed at compile time); N % BLOCK_N == 0 (the per-rank
slice for fuse=True); rows past M read zeros and their stores are dropped by the buffer bounds
(fuse=True: they land in the pad rows of dest's plane, which nothing moves; with slices by rows
the pad rows of a slice read the next slice's A rows, not zeros).
Tiles: 256x256, 128x256, 256x128.

Unfused equivalent: ``reference_gemm(A, unshuffle_b(B), A_scale, B_scale, quant)`` (``cco.quant``),
written to ``C`` (fuse=False) or to ``partial[dest]`` column slices (fuse=True).

The launcher runs only on a gfx950 device and raises elsewhere: a FlyDSL launch without the device
aborts the process. :func:`compile_to_isa` compiles any variant on any machine (nothing launched).
"""

# (no `from __future__ import annotations`: flyc reads the launcher annotations as types)

import contextlib
import io
from dataclasses import dataclass

from kernels_fused.pipeline import schedule as sched

from . import byte_layout as L

QUANTS = ("ptpc", "blockscale", "mxfp8")
TILES = ((256, 256), (128, 256), (256, 128))
BLOCK_K = L.BLOCK_K
K_MIN = 256
WORKGROUP = 512
WAVES_PER_EU = 2  # 8 waves per workgroup, one workgroup per CU: 256 VGPRs per lane
# quants whose DMA offsets are re-added next to each load (one VALU each) rather than held in 2A+2B
# registers: their per-K-tile scales need those registers (blockscale 256x256 K=2048 held them and
# spilled 16 VGPRs, re-adding them spills none; ptpc holds them spill-free, with no VALU in its loop:
# python -m kernels_fused.gfx950.budget, 2026-12-02)
RECOMPUTED_DMA_OFFSETS = ("blockscale", "mxfp8")


@dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """The compile-time parameters of one kernel variant. Build with :func:`kernel_config`."""

    K: int
    BLOCK_M: int
    BLOCK_N: int
    quant: str
    fuse: bool
    variant: str  # a kernels_fused.pipeline.schedule.VARIANTS name
    loop_count: str | int | None  # None: the variant's main-loop count
    mfma_barriers: bool  # each MFMA call ends in a barrier (8 per K step) or not (4)

    @property
    def k_tiles(self) -> int:
        return self.K // BLOCK_K

    @property
    def steps_a(self) -> int:  # A = N_LDS_STEPS_A: DMA instructions per wave per A half-tile
        return (self.BLOCK_M // 2) // 64

    @property
    def steps_b(self) -> int:  # B = N_LDS_STEPS_B
        return (self.BLOCK_N // 2) // 64

    @property
    def lds_bytes(self) -> int:  # eight half-tiles of 128 K bytes
        return 2 * (self.BLOCK_M + self.BLOCK_N) * BLOCK_K

    @property
    def name(self) -> str:
        mode = "fused" if self.fuse else "gemm"
        count = "" if self.loop_count is None else f"_count{self.loop_count}"
        return f"{self.quant}_{self.BLOCK_M}x{self.BLOCK_N}_k{self.K}_{mode}_{self.variant}{count}"

    def schedule(self):
        """The schedule the kernel is emitted from (and the ISA is checked against)."""
        return sched.build_schedule(block_m=self.BLOCK_M, block_n=self.BLOCK_N, k=self.K, quant=self.quant,
                                    variant=self.variant, loop_count=self.loop_count,
                                    mfma_barriers=self.mfma_barriers)


def kernel_config(*, K: int, BLOCK_M: int = 256, BLOCK_N: int = 256, quant: str = "ptpc", fuse: bool = True,
                  variant: str = "shipped", loop_count: str | int | None = None, mfma_barriers: bool = True,
                  fn: str = "compile_fused_gemm_scatter") -> KernelConfig:
    """Validate and freeze a variant. Raises ValueError naming the argument and the fix."""
    if quant not in QUANTS:
        raise ValueError(f"{fn}: quant={quant!r} is not supported; pass one of {', '.join(QUANTS)}")
    if (BLOCK_M, BLOCK_N) not in TILES:
        allowed = ", ".join(f"{m}x{n}" for m, n in TILES)
        raise ValueError(f"{fn}: BLOCK_M x BLOCK_N = {BLOCK_M}x{BLOCK_N} is not supported; pass one of {allowed}")
    if not isinstance(K, int) or isinstance(K, bool) or K < K_MIN or K % BLOCK_K:
        raise ValueError(f"{fn}: K={K!r} is not supported; K must be >= {K_MIN} and a multiple of {BLOCK_K} "
                         f"(pad the reduction dimension with zeros)")
    if variant not in sched.VARIANTS:
        raise ValueError(f"{fn}: variant={variant!r} is unknown; pass one of {', '.join(sched.VARIANTS)}")
    if loop_count is not None and sched.VARIANTS[variant].loop_count == loop_count:
        loop_count = None  # the variant's own count: one name per kernel
    cfg = KernelConfig(K=K, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, quant=quant, fuse=bool(fuse), variant=variant,
                       loop_count=loop_count, mfma_barriers=bool(mfma_barriers))
    cfg.schedule()  # the schedule's own validation (loop_count) raises here, at the boundary
    return cfg


# --------------------------------------------------------------------------------------------------
# emitting the schedule
# --------------------------------------------------------------------------------------------------
QUARTER_HALVES = {"c00": ("a0", "b0"), "c01": ("a0", "b1"), "c10": ("a1", "b0"), "c11": ("a1", "b1")}


def split_by_group(events) -> tuple[list, list[int]]:
    """Cut the program at the events only one wave group runs (the lag and close barriers).

    Those become ``if wave_m == g: s_barrier`` in the kernel body (the one place with a branch);
    returns the segments between them and each cut's group.
    """
    segments, groups, current = [], [], []
    for ev in events:
        if ev.group is None:
            current.append(ev)
            continue
        assert type(ev).__name__ == "Barrier", f"only barriers may be group-specific, got {ev.text()}"
        segments.append(current)
        groups.append(ev.group)
        current = []
    segments.append(current)
    return segments, groups


class PipelineEmitter:
    """Walks schedule events inside the kernel trace; one method per event class.

    Holds the trace-time state: which K tile each register fragment holds (so an MFMA can assert
    that its A and B operands come from the same K tile), the scales loaded per operand and K
    tile, and the four accumulator sets.
    """

    def __init__(self, *, cfg, parts, lds, dma, readers, mfma, scales, stage, store, flush):
        self.cfg, self.P = cfg, parts
        self.lds, self.dma, self.readers, self.mfma = lds, dma, readers, mfma
        self.scales, self.stage, self.store, self.flush = scales, stage, store, flush
        self.staged = []  # quarters written to the LDS stage and not yet flushed
        self.frags = {}  # fragment name -> (ktile, registers)
        self.scale_regs = {}  # ("a0" | "a1" | "b0" | "b1", ktile) -> scale registers
        zero = parts.zero_acc()
        self.zero_set = [zero] * (mfma.n_a * mfma.n_b)
        self.acc = {q: list(self.zero_set) for q in QUARTER_HALVES}
        self.in_mfma_call = False

    def run(self, events) -> None:
        for ev in events:
            getattr(self, "_" + type(ev).__name__)(ev)

    # -- memory
    def _LoadTile(self, ev):
        dma = self.dma[ev.half.lower()]
        assert dma.steps == ev.n_vm, f"{ev.text()}: the loader issues {dma.steps} VM instructions"
        dma.load(self.lds[ev.half.lower()][ev.buf], ev.ktile)

    def _LdsRead(self, ev):
        reader = self.readers[ev.half[0].lower()]
        self.frags[ev.frag] = (ev.ktile, reader.load(self.lds[ev.half.lower()][ev.buf]))

    def _ScaleLoad(self, ev):
        assert ev.half, f"{ev.text()}: the emitter loads the scales of one named half-tile"
        tile = ev.half.lower()
        self.scale_regs[(tile, ev.ktile)] = self.scales.for_tile(tile, ev.ktile)

    def _WaitVm(self, ev):
        assert not ev.emitted, "an emitted WaitVm has no emitter yet"  # compiler-inserted: nothing to write

    def _StageC(self, ev):
        a_half, b_half = f"a{ev.row_half}", f"b{ev.col_half}"
        assert QUARTER_HALVES[ev.acc] == (a_half, b_half)
        self.stage(ev.acc, self.acc[ev.acc], a_half, b_half, self.scale_regs)
        self.staged.append(ev.acc)

    def _StoreC(self, ev):
        a_half, b_half = f"a{ev.row_half}", f"b{ev.col_half}"
        assert QUARTER_HALVES[ev.acc] == (a_half, b_half)
        if ev.acc in self.staged:  # the wave's own stage writes land before any lane reads them back
            self.flush()
            self.staged = []
        self.store(ev.acc, a_half, b_half)

    # -- waits and barriers (inline asm: LLVM keeps LDS reads on their side)
    def _WaitBarrier(self, ev):
        self.P.wait_barrier(ev.vmcnt)

    def _ReadDoneBarrier(self, ev):
        self.P.read_done_barrier()

    def _Barrier(self, ev):
        if ev.kind == "mfma":
            self.P.set_priority(0)
            self.in_mfma_call = False
        self.P.bare_barrier()

    # -- math
    def _Mfma(self, ev):
        (ka, a), (kb, b) = self.frags[ev.a], self.frags[ev.b]
        assert ka == kb == ev.ktile, f"{ev.text()}: fragments hold K tiles {ka} (A) and {kb} (B)"
        if self.cfg.mfma_barriers and not self.in_mfma_call:
            self.P.set_priority(1)  # MFMA bursts first while the other group reads LDS
            self.in_mfma_call = True
        # MFMAs are pure: nothing orders them against a barrier. With mfma_barriers=False instruction
        # selection moved them into neighbouring phases, which undoes the ping-pong between the wave
        # groups; pinning the accumulators before and after keeps each MFMA in its phase. With the
        # MFMA-call barriers they stay in place unpinned (the ISA check verifies it), and pins there
        # cost spills (ptpc 256x256 fused: 5-11 VGPRs), so they are left out.
        acc = self.acc[ev.acc]
        if not self.cfg.mfma_barriers:
            acc = [self.P.pin(v) for v in acc]
        a_half, b_half = QUARTER_HALVES[ev.acc]
        if self.cfg.quant == "mxfp8":
            sa, sb = self.scale_regs[(a_half, ev.ktile)], self.scale_regs[(b_half, ev.ktile)]
            self.acc[ev.acc] = self.mfma.run(a, b, acc, a_scales=sa, b_scales=sb)
        elif self.cfg.quant == "blockscale":
            sa, sb = self.scale_regs[(a_half, ev.ktile)], self.scale_regs[(b_half, ev.ktile)]
            self.acc[ev.acc] = self.mfma.run_folded(a, b, acc, lambda c, p, i, j: self.scales.fold(c, p, sa[i], sb))
        else:
            self.acc[ev.acc] = self.mfma.run(a, b, acc)
        if not self.cfg.mfma_barriers:
            self.acc[ev.acc] = [self.P.pin(v) for v in self.acc[ev.acc]]


# --------------------------------------------------------------------------------------------------
# the kernel
# --------------------------------------------------------------------------------------------------
def slice_tile_origin(dest, row0, col0, *, a_step, b_step):
    """(a_row0, b_row0, c_row0, c_col0) of the fused tile at ``(row0, col0)`` of dest's slice: A row
    ``dest * a_step + row0``, B row (output column) ``dest * b_step + col0``, stored at
    ``partial[dest][row0, col0]``. Plain arithmetic on ints or on the kernel's values, so the host
    replay of the epilogue (tests/python/cco/test_gfx950_compile.py) runs the kernel's own formula."""
    return dest * a_step + row0, dest * b_step + col0, row0, col0


def _tile_origin(cfg, P, fx, *, tiles, a_step, b_step):
    """(a_row0, b_row0, c_row0, c_col0, counter) of this workgroup's output tile: its first row of A,
    of B (an output column), and its place in C.

    fuse=False: the launch grid is [N / BLOCK_N, M tiles], dispatched x first, so the tiles run
    row-major with no division by the runtime tile count. fuse=True: row ``block_idx`` of the
    ``cco.layout.tile_table_rows`` table, [chunk, dest, row0, col0], both within dest's slice, which
    starts at A row ``dest * a_step`` and B row ``dest * b_step``: a slice by columns is (0, N/W),
    by rows (M/W, 0) (``GemmScatterLauncher``). C is ``partial[dest][row0, col0]`` either way.
    """
    if not cfg.fuse:
        row0, col0 = fx.block_idx.y * cfg.BLOCK_M, fx.block_idx.x * cfg.BLOCK_N
        return row0, col0, row0, col0, None
    from cco import layout as cco_layout

    entry = P.tile_table_entry(tiles, fx.block_idx.x)  # wave-uniform: one scalar load into SGPRs
    chunk, dest, row0, col0 = entry[0], entry[1], entry[2], entry[3]
    return (*slice_tile_origin(dest, row0, col0, a_step=a_step, b_step=b_step),
            (dest, chunk, cco_layout.MAX_CHUNKS))


def _stages(cfg, P, fx, *, A, B, C, A_scale, B_scale, tiles, c_m, c_n, c_ld, c_rows, a_step, b_step):
    """Every stage of the kernel, wired to the emitter. Runs at trace time inside the kernel."""
    HALF_M, HALF_N = cfg.BLOCK_M // 2, cfg.BLOCK_N // 2
    N_TILES_A, N_TILES_B = cfg.BLOCK_M // 64, cfg.BLOCK_N // 128  # 16-row MFMA tiles per wave per half
    tid = fx.thread_idx.x
    lane, wave_id = tid % 64, P.wave_uniform(tid // 64)
    wave_m, wave_n = wave_id // 4, wave_id % 4
    row0, b_row0, c_row0, c_col0, counter = _tile_origin(cfg, P, fx, tiles=tiles, a_step=a_step, b_step=b_step)

    smem = fx.SharedAllocator().allocate(_shared_storage(cfg, fx)).peek()
    lds = {"a0": (smem.a0_0, smem.a0_1), "a1": (smem.a1_0, smem.a1_1),
           "b0": (smem.b0_0, smem.b0_1), "b1": (smem.b1_0, smem.b1_1)}
    gA, gB = P.buffer_resource(A), P.buffer_resource(B)
    a_base = L.a_dma_offsets(lane=lane, wave=wave_id, row0=row0, K=cfg.K, steps=1)[0]
    b_base = L.b_dma_offsets(lane=lane, wave=wave_id, group0=b_row0 // L.MFMA_ROWS, K=cfg.K, steps=1)[0]
    dma = {}
    recompute = cfg.quant in RECOMPUTED_DMA_OFFSETS
    for h in (0, 1):
        dma[f"a{h}"] = P.HalfTileDMA(rsrc=gA, base=a_base, k_tile_bytes=BLOCK_K, wave_id=wave_id, recompute=recompute,
                                     steps=[L.a_dma_step(half=h, half_rows=HALF_M, step=s, K=cfg.K)
                                            for s in range(cfg.steps_a)])
        dma[f"b{h}"] = P.HalfTileDMA(rsrc=gB, base=b_base, k_tile_bytes=L.B_GROUP_BYTES, wave_id=wave_id,
                                     recompute=recompute, steps=[L.b_dma_step(half=h, half_rows=HALF_N, step=s, K=cfg.K)
                                                                 for s in range(cfg.steps_b)])
    readers = {"a": P.FragmentReader(anchor=smem.a0_0, n_tiles=N_TILES_A,
                                     bases=L.a_read_bases(lane=lane, first_row=wave_m * (N_TILES_A * 16))),
               "b": P.FragmentReader(anchor=smem.b0_0, n_tiles=N_TILES_B,
                                     bases=L.b_read_bases(lane=lane, first_group=wave_n * N_TILES_B))}
    built = {}  # the epilogue's pieces, made where the epilogue starts

    def epilogue_lane():
        """The lane id, counted afresh where the epilogue starts: values the epilogue computes from it
        cannot be merged with the prologue's and kept live (or spilled) across the main loop."""
        if "lane" not in built:
            built["lane"] = P.lane_id()
        return built["lane"]

    # this wave's first output row (A row) and column (B row) of quarter c00; the halves are offsets
    wave_rows = wave_m * (N_TILES_A * 16)
    a_row0 = row0 + wave_rows
    b_wave_row0 = b_row0 + wave_n * (N_TILES_B * 16)
    geometry = dict(half_m=HALF_M, half_n=HALF_N, n_a=N_TILES_A)
    if cfg.quant == "blockscale":
        scales = P.BlockScales(A_scale=A_scale, B_scale=B_scale, lane=lane, a_row0=a_row0, b_row0=b_row0, m=c_m,
                               k_tiles=cfg.k_tiles, **geometry)
    elif cfg.quant == "mxfp8":
        scales = P.MxScales(A_scale=A_scale, B_scale=B_scale, lane=lane, a_row0=a_row0, b_row0=b_wave_row0,
                            n_b=N_TILES_B, K=cfg.K, **geometry)
    else:
        scales = P.RowScales(A_scale=A_scale, B_scale=B_scale, lane=epilogue_lane, a_row0=a_row0,
                             b_row0=b_wave_row0, n_b=N_TILES_B, **geometry)

    # fuse=True: C is the window's partial region [world, c_rows, c_ld]; partial[dest] starts
    # dest * c_rows rows in (c_ld: the slice's columns, N/W or N). fuse=False: C is [M, N].
    c_row_base = counter[0] * c_rows if cfg.fuse else 0
    quarter_index = {q: n for n, q in enumerate(QUARTER_HALVES)}

    def epilogue():
        if "epilogue" not in built:
            built["epilogue"] = P.CEpilogue(
                C=C, lds_base=P.lds_address(smem.a0_0), layout=L.CStage(n_a=N_TILES_A, n_b=N_TILES_B),
                lane=epilogue_lane(), wave_id=wave_id, ldc=c_ld, row0=c_row_base + c_row0 + wave_rows,
                col0=c_col0 + wave_n * (N_TILES_B * 16))
        return built["epilogue"]

    def stage(acc_name, acc, a_half, b_half, scale_regs):
        tiles = acc
        if cfg.quant == "ptpc":  # acc * (sa * sb), per value: the fp32 order of the reference epilogue
            sa, sb = scale_regs[(a_half, sched.EPILOGUE)], scale_regs[(b_half, sched.EPILOGUE)]
            tiles = [fx.Vector(acc[i * N_TILES_B + j]) * (sa[i] * sb[j])
                     for i in range(N_TILES_A) for j in range(N_TILES_B)]
        epilogue().stage(quarter_index[acc_name], tiles)

    def store(acc_name, a_half, b_half):
        epilogue().store(quarter_index[acc_name], row_offset=int(a_half[1]) * HALF_M,
                         col_offset=int(b_half[1]) * HALF_N)

    emitter = PipelineEmitter(cfg=cfg, parts=P, lds=lds, dma=dma, readers=readers, mfma=P.Mfma(n_a=N_TILES_A, n_b=N_TILES_B),
                              scales=scales, stage=stage, store=store, flush=P.CEpilogue.flush)
    counter_index = None if counter is None else counter[0] * counter[2] + counter[1]
    return emitter, wave_m, tid, counter_index


def _shared_storage(cfg, fx):
    half_a, half_b = cfg.BLOCK_M // 2 * BLOCK_K, cfg.BLOCK_N // 2 * BLOCK_K

    @fx.struct
    class SharedStorage:  # two LDS slots per half-tile; slot = K tile % 2
        a0_0: fx.Array[fx.Float8E4M3FN, half_a, 16]
        a0_1: fx.Array[fx.Float8E4M3FN, half_a, 16]
        a1_0: fx.Array[fx.Float8E4M3FN, half_a, 16]
        a1_1: fx.Array[fx.Float8E4M3FN, half_a, 16]
        b0_0: fx.Array[fx.Float8E4M3FN, half_b, 16]
        b0_1: fx.Array[fx.Float8E4M3FN, half_b, 16]
        b1_0: fx.Array[fx.Float8E4M3FN, half_b, 16]
        b1_1: fx.Array[fx.Float8E4M3FN, half_b, 16]

    return SharedStorage


def build_kernel(cfg: KernelConfig):
    """The ``flyc.jit`` launcher of ``cfg``; see :func:`compile_fused_gemm_scatter` for its arguments."""
    import flydsl.compiler as flyc
    import flydsl.expr as fx
    from flydsl.expr import const_expr

    from . import stages as P

    segments, groups = split_by_group([ev for _, ev in cfg.schedule().program()])
    assert groups[0] == 1 and len(segments) in (2, 3), f"unexpected group barriers {groups}"
    has_close = len(groups) == 2
    close_group = groups[1] if has_close else 0
    fuse = cfg.fuse

    @flyc.kernel(known_block_size=[WORKGROUP, 1, 1])
    def fused_gemm_scatter(
        A: fx.Tensor, B: fx.Tensor, C: fx.Tensor, A_scale: fx.Tensor, B_scale: fx.Tensor,
        tiles: fx.Tensor, counters: fx.Tensor, c_m: fx.Int32, c_n: fx.Int32, c_ld: fx.Int32,
        c_rows: fx.Int32, a_step: fx.Int32, b_step: fx.Int32,
    ):
        emitter, wave_m, tid, counter_index = _stages(
            cfg, P, fx, A=A, B=B, C=C, A_scale=A_scale, B_scale=B_scale, tiles=tiles, c_m=c_m, c_n=c_n,
            c_ld=c_ld, c_rows=c_rows, a_step=a_step, b_step=b_step)
        emitter.run(segments[0])  # prologue loads
        if wave_m == 1:
            P.bare_barrier()  # lag: waves 4-7 run one barrier behind waves 0-3
        emitter.run(segments[1])  # main loop, peeled tail (and, without a close barrier, stores)
        if const_expr(has_close):
            if wave_m == close_group:
                P.bare_barrier()  # close: re-balance the barrier counts before the epilogue
            emitter.run(segments[2])  # C stores
        if const_expr(fuse):
            P.wait_barrier(0)  # every wave's C stores have completed ...
            if tid == 0:
                P.bump_counter(counters, counter_index)  # ... before one thread publishes the tile

    @flyc.jit
    def launch(
        A: fx.Tensor, B: fx.Tensor, C: fx.Tensor, A_scale: fx.Tensor, B_scale: fx.Tensor,
        tiles: fx.Tensor, counters: fx.Tensor, c_m: fx.Int32, c_n: fx.Int32, c_ld: fx.Int32,
        c_rows: fx.Int32, a_step: fx.Int32, b_step: fx.Int32, n_tiles: fx.Int32, stream: fx.Stream,
    ):
        if const_expr(fuse):
            grid = (n_tiles, 1, 1)
        else:
            grid = (c_n // cfg.BLOCK_N, (c_m + (cfg.BLOCK_M - 1)) // cfg.BLOCK_M, 1)
        fused_gemm_scatter(
            A, B, C, A_scale, B_scale, tiles, counters, c_m, c_n, c_ld, c_rows, a_step, b_step,
            value_attrs={"rocdl.waves_per_eu": WAVES_PER_EU, "rocdl.flat_work_group_size": f"{WORKGROUP},{WORKGROUP}"},
        ).launch(grid=grid, block=(WORKGROUP, 1, 1), stream=stream)

    return launch


# --------------------------------------------------------------------------------------------------
# compile to gfx950 ISA on any machine (no device needed, nothing is launched)
# --------------------------------------------------------------------------------------------------
def placeholder_args(cfg: KernelConfig, *, world: int = 2):
    """CPU tensors with the kernel's dtypes: flyc.compile reads types, never values or devices."""
    import torch

    m, n = 2 * cfg.BLOCK_M, 2 * cfg.BLOCK_N * world
    k = cfg.K
    A = torch.empty(m, k, dtype=torch.uint8)
    B = torch.empty(n, k, dtype=torch.uint8)
    if cfg.quant == "ptpc":
        sa, sb = torch.empty(m), torch.empty(n)
    elif cfg.quant == "blockscale":
        sa, sb = torch.empty(m * (k // BLOCK_K)), torch.empty((n // 128) * (k // BLOCK_K))
    else:
        sa, sb = torch.empty(m * (k // 32), dtype=torch.uint8), torch.empty(n * (k // 32), dtype=torch.uint8)
    C = torch.empty(world * m * (n // world) if cfg.fuse else m * n, dtype=torch.bfloat16)
    tiles = torch.zeros(64, 4, dtype=torch.int32)
    counters = torch.zeros(world * 8, dtype=torch.int64)
    c_ld = n // world if cfg.fuse else n
    return (A, B, C, sa, sb, tiles, counters, m, n, c_ld, m, 0, c_ld, 1, None)


def compile_to_isa(cfg: KernelConfig, *, dump_dir) -> str:
    """Compile ``cfg`` for gfx950 without a device and return the final ISA text."""
    import flydsl.compiler as flyc

    from .toolchain import compile_env, find_isa

    with compile_env(dump_dir) as d, contextlib.redirect_stdout(io.StringIO()):  # flydsl prints dump paths
        flyc.compile(build_kernel(cfg), *placeholder_args(cfg))
    return find_isa(d).read_text()


# --------------------------------------------------------------------------------------------------
# the public factory
# --------------------------------------------------------------------------------------------------
def gfx950_device_reason() -> str | None:
    """None when this process sees a gfx950 GPU; otherwise why not. Launches nothing."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if getattr(torch.version, "hip", None) is None:
        return f"torch {torch.__version__} is not a ROCm build"
    if not torch.cuda.is_available():
        return "no ROCm device is visible"
    arch = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
    if arch != "gfx950":
        return f"device 0 is {arch}, not gfx950 (MI350/MI355X)"
    return None


class GemmScatterLauncher:
    """A compiled variant and the host-side checks around it. Build with :func:`compile_fused_gemm_scatter`.

    ``launch(A, B_pre, C_or_window, A_scale, B_scale, m, n, counters=None, stream=None)``:

    * A: e4m3fn [m, K]; B_pre: e4m3fn [n, K] in the bpreshuffle layout (``cco.preshuffle``);
      A_scale / B_scale in the ``cco.quant`` layouts of ``quant``;
    * fuse=False: C_or_window is bf16 [m, n], written; counters is ignored;
    * fuse=True: C_or_window is the window's ``partial`` region, bf16 [world, m_max_padded, n_slice]
      (``partial[dest]`` gets this rank's product over dest's slice: its n / world columns, or for
      the reduce-scatter along rows its m / world rows of A, n_slice = n), counters the window's int64
      ``[world, MAX_CHUNKS]`` counters: each tile adds 1 to ``counters[dest, chunk]`` after its
      stores (``cco.layout.plan_call`` gives the cumulative targets; nothing is ever reset).
    * stream: a torch stream (default: the current one).
    """

    def __init__(self, *, cfg: KernelConfig, rank: int, world: int, chunks: int | tuple[int, ...] | None,
                 pattern: str = "all-reduce"):
        self.cfg, self.rank, self.world, self.chunks, self.pattern = cfg, rank, world, chunks, pattern
        self._kernel = None
        self._tiles = {}  # (m, n, m_max_padded) -> int32 tile table on the device
        # fuse=False: the (tiles, counters) arguments the kernel never reads, per device, made once:
        # the row-block producers launch it W x C times per call, each new pair was two fills
        self._unused = {}
        self._layouts = {}  # (n, c_rows) -> the op's cco.layout config

    def _layout(self, *, n: int, c_rows: int):
        """The op's ``cco.layout`` config for planes of ``c_rows`` rows (m_max_padded): its tile
        walk, slice width and slice origins are the launch's. Built once per (n, c_rows): an eager
        call pays its host time."""
        from cco import layout

        key = (n, c_rows)
        if key not in self._layouts:
            by_rows = layout.PATTERNS[self.pattern].owner_by == "rows"
            self._layouts[key] = layout.build_config(
                n=n, k=self.cfg.K, m_max=c_rows * self.world if by_rows else c_rows,
                world=self.world, quant=self.cfg.quant, mode="fused", chunks=self.chunks, block_m=self.cfg.BLOCK_M,
                block_n=self.cfg.BLOCK_N, pattern=self.pattern)
        return self._layouts[key]

    def _tile_table(self, *, m: int, n: int, c_rows: int, device):
        import torch

        from cco import layout

        key = (m, n, c_rows)
        if key not in self._tiles:
            rows = layout.tile_table_rows(layout.tile_table(self._layout(n=n, c_rows=c_rows), m=m, rank=self.rank))
            self._tiles[key] = torch.tensor(rows, dtype=torch.int32, device=device)
        return self._tiles[key]

    def __call__(self, A, B_pre, C_or_window, A_scale, B_scale, m, n, counters=None, stream=None):
        import torch

        from cco.validate import check_operands

        fn = "compile_fused_gemm_scatter(...)(launch)"
        cfg = self.cfg
        shape = check_operands(A, B_pre, A_scale, B_scale, quant=cfg.quant, fn=fn)
        if (shape.m, shape.n, shape.k) != (m, n, cfg.K):
            raise ValueError(f"{fn}: m={m}, n={n} with K={cfg.K} compiled do not match the operands "
                             f"[{shape.m}, {shape.k}] x [{shape.n}, {shape.k}]; pass m=A.shape[0], n=B_pre.shape[0] "
                             f"and compile for K=A.shape[1]")
        why = gfx950_device_reason()
        if why is not None:
            raise RuntimeError(f"{fn}: needs a gfx950 device ({why}); the kernel is compile-only here "
                               f"(python -m kernels_fused.gfx950.isa)")
        if cfg.fuse:
            from cco import layout

            lay = self._layout(n=n, c_rows=C_or_window.shape[1]) if C_or_window.dim() == 3 else None
            if lay is None or tuple(C_or_window.shape) != (self.world, lay.m_max_padded, lay.n_slice):
                slice_is = "n" if layout.PATTERNS[self.pattern].owner_by == "rows" else f"n/world={n // self.world}"
                raise ValueError(f"{fn}: C_or_window shape {tuple(C_or_window.shape)} is not the {self.pattern} "
                                 f"partial region [world={self.world}, m_max_padded, {slice_is}]; pass "
                                 f"window.tensor(layout.partial, rank=rank)")
            why = layout.call_rows_error(lay, m)
            if why is not None:
                raise ValueError(f"{fn}: {why}")
            if counters is None or counters.dtype != torch.int64:
                raise TypeError(f"{fn}: counters={None if counters is None else counters.dtype} must be the "
                                f"window's int64 counters region; pass window.tensor(layout.counters, rank=rank)")
            c_rows, c_ld = lay.m_max_padded, lay.n_slice
            # where slice 1 starts in the product: each owner's step in A rows and in B rows
            a_step, b_step = layout.slice_origin(lay, 1, layout.slice_rows(lay, m))
            tiles = self._tile_table(m=m, n=n, c_rows=c_rows, device=A.device)
        else:
            if tuple(C_or_window.shape) != (m, n) or C_or_window.dtype != torch.bfloat16:
                raise ValueError(f"{fn}: C_or_window is {C_or_window.dtype} {tuple(C_or_window.shape)}; fuse=False "
                                 f"writes a bf16 [m, n] = [{m}, {n}] tensor")
            if n % cfg.BLOCK_N:
                raise ValueError(f"{fn}: n={n} is not a multiple of BLOCK_N={cfg.BLOCK_N}; pad N or compile "
                                 f"with a BLOCK_N that divides it")
            c_rows, c_ld, a_step, b_step = m, n, 0, 0
            if A.device not in self._unused:
                self._unused[A.device] = (torch.zeros(1, 4, dtype=torch.int32, device=A.device),
                                          torch.zeros(1, dtype=torch.int64, device=A.device))
            tiles, counters = self._unused[A.device]
        if cfg.quant == "blockscale":
            a_s = A_scale.t().reshape(-1)  # column-major [M, K/128]: K block-major memory
        else:
            a_s = A_scale.reshape(-1)
        b_s = B_scale.reshape(-1)
        if cfg.quant == "mxfp8":
            a_s, b_s = a_s.view(torch.uint8), b_s.view(torch.uint8)
        if self._kernel is None:
            self._kernel = build_kernel(cfg)
        stream = torch.cuda.current_stream() if stream is None else stream
        self._kernel(A.view(torch.uint8), B_pre.view(torch.uint8), C_or_window.reshape(-1), a_s, b_s, tiles,
                     counters.reshape(-1), m, n, c_ld, c_rows, a_step, b_step, tiles.shape[0], stream)
        return C_or_window


def fused_pattern_reason(pattern: str) -> str | None:
    """None when the ``fuse=True`` kernel produces ``pattern``'s slices (``cco.layout.PATTERNS``),
    else why not. A tile's slice starts at A row ``dest * a_step`` and B row ``dest * b_step``
    (runtime arguments: ``slice_origin`` of slice 1), so one kernel makes slices by columns (the
    all-reduce's and the column reduce-scatter's) and by rows (the reduce-scatter along rows); the
    all-gather publishes no tile."""
    from cco import layout

    spec = layout.PATTERNS.get(pattern)
    if spec is None:
        return f"pattern={pattern!r} is unknown; pass one of {', '.join(layout.PATTERNS)}"
    if not spec.scatter:
        return f"the {pattern} pattern publishes no GEMM tile (its transfers precede the GEMM): use fuse=False"
    return None


def compile_fused_gemm_scatter(rank: int, world: int, *, K: int, BLOCK_M: int = 256, BLOCK_N: int = 256,
                               quant: str = "ptpc", fuse: bool = True, chunks: int | tuple[int, ...] | None = None,
                               loop_count: str | int | None = None, variant: str = "shipped",
                               mfma_barriers: bool = True, pattern: str = "all-reduce") -> GemmScatterLauncher:
    """The gfx950 kernel for one (K, tile, quant, mode), emitted from the ``variant`` schedule.

    Unfused equivalent (fuse=False): ``C = reference_gemm(A, unshuffle_b(B_pre), A_scale, B_scale,
    quant)``; fuse=True writes the same values into ``partial[dest]`` and publishes each tile on
    ``counters[dest, chunk]``. ``loop_count`` overrides the variant's main-loop vmcnt ("min(2A+B,A+2B)", "2A+B",
    "A+B-1" or an int; None keeps the variant's: min(2A+B, A+2B) for ``shipped``). Compilation happens on the first launch; on a machine without gfx950 use
    :func:`compile_to_isa` instead (a launch there raises before touching the device).
    ``pattern`` (fuse=True): the op's ``cco.layout.PATTERNS`` key, whose tile table the launcher
    walks and whose slice origins it passes; any pattern with a scatter (:func:`fused_pattern_reason`).
    It is not a compile-time parameter: every such pattern runs the same kernel.
    """
    fn = "compile_fused_gemm_scatter"
    for arg, value in (("rank", rank), ("world", world)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{fn}: {arg}={value!r} must be a non-negative int")
    if world < 1 or rank >= world:
        raise ValueError(f"{fn}: rank={rank} world={world}: need 0 <= rank < world")
    from cco import layout

    why = fused_pattern_reason(pattern)
    if why is not None and (fuse or pattern not in layout.PATTERNS):  # fuse=False: any pattern's row blocks
        raise ValueError(f"{fn}: {why}")
    cfg = kernel_config(K=K, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, quant=quant, fuse=fuse, variant=variant,
                        loop_count=loop_count, mfma_barriers=mfma_barriers, fn=fn)
    return GemmScatterLauncher(cfg=cfg, rank=rank, world=world, chunks=chunks, pattern=pattern)

