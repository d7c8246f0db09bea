"""Stages of the gfx950 8-wave fp8 GEMM, named by role. Import only inside a FlyDSL kernel build.

Geometry (all byte offsets; fp8 = 1 byte). A workgroup is 8 waves of 64 lanes. Each operand's
block tile is split in two half-tiles (rows), each half-tile is BLOCK_K = 128 bytes wide along K:

* A half-tile in LDS: ``HALF_M`` rows x 128 bytes, row-major, with a 16-byte XOR swizzle per row
  (column bits 4..6 ^= row bits 1..3) so the MFMA readers spread over the LDS banks;
* B half-tile in LDS: ``HALF_N / 16`` groups of 2 KiB, each the 16-row x 128-K piece of the
  bpreshuffle layout (``cco.preshuffle``): eight 256-byte blocks (one per 16-wide K slice) of
  16 rows x 16 bytes. In the global bpreshuffle tensor that piece is already contiguous, so the
  DMA copies it verbatim.

One ``buffer_load_dwordx4 ... lds`` moves 1 KiB per wave: lane ``l`` writes LDS bytes
``base + 16 l``. Step ``s`` of wave ``w`` fills LDS bytes ``[8 KiB s + 1 KiB w, +1 KiB)``; for A that
is rows ``8 w + l // 8 + 64 s`` (so row ``r`` of a step comes from wave ``(r % 64) // 8``).

MFMA operand order (v_mfma_*_16x16x128_f8f6f4): lane ``l`` holds row ``l % 16`` and the 32
consecutive K bytes ``[32 (l // 16), +32)`` of the K tile, as 8 dwords. That is the order the
e8m0 block scales of ``v_mfma_scale_f32_16x16x128_f8f6f4`` are defined on (one scale per lane =
per row and 32-wide K group), so every quant format uses the same readers.

Addresses: every global access is a raw buffer instruction whose offset is a per-lane register
formed once plus constants (the 12-bit immediate, or an add next to the instruction), and every
LDS access a per-lane register plus a 16-bit immediate; nothing re-derives an index per access.
The byte arithmetic lives in ``byte_layout`` (pure ints, replayed by the host tests).

Epilogue (``CEpilogue``): the accumulators hold column vectors (lane ``l``: rows ``4 (l // 16) ..
+3`` of column ``l % 16``); each wave writes its part of the C tile, as bf16, into its own region
of LDS (the A/B buffers, free by then) and reads it back as 16-byte row vectors, one
``buffer_store_dwordx4`` per lane and 16 rows: 16 stores per wave at 256x256 instead of 128
``buffer_store_short``, with no wait on them before the fused publish.
"""

from __future__ import annotations

import flydsl.expr as fx
from flydsl._mlir import ir
from flydsl._mlir.dialects import fly as _fly
from flydsl._mlir.dialects import llvm as _llvm
from flydsl._mlir.dialects import rocdl as _rocdl
from flydsl.expr import const_expr, range_constexpr, rocdl
from flydsl.expr.typing import T
from flydsl.expr.typing import Vector as Vec

from .byte_layout import (BUFFER_IMM_MAX, DMA_BYTES_PER_STEP, DMA_BYTES_PER_WAVE, DMA_LANE_BYTES, F32_BYTES, MFMA_TILE_BYTES,
                          MX_GROUP, col_scale_base, mx_scale_base, mx_scale_k_imm, row_scale_base, tile_scale_imm)

COUNTER_BYTES = 8  # cco.layout: counters are int64


# --------------------------------------------------------------------------------------------------
# raw inline-asm waits: the compiler cannot move memory operations across a side-effecting asm
# --------------------------------------------------------------------------------------------------
def _asm(text: str) -> None:
    _llvm.inline_asm(res=None, operands_=[], asm_string=text, constraints="", has_side_effects=True)


def wait_barrier(vmcnt: int) -> None:
    """``s_waitcnt vmcnt(n); s_barrier``: this wave's older global->LDS loads landed, then rendezvous."""
    _asm(f"s_waitcnt vmcnt({vmcnt})\ns_barrier")


def read_done_barrier() -> None:
    """``s_waitcnt lgkmcnt(0); s_barrier``: this wave's LDS reads retired, then rendezvous."""
    _asm("s_waitcnt lgkmcnt(0)\ns_barrier")


def bare_barrier() -> None:
    """A rendezvous that drains nothing (kept as asm so it stays where the schedule puts it)."""
    _asm("s_barrier")


def pin(value):
    """``value``, materialized at this point of the program (an empty side-effecting asm uses it)."""
    return _llvm.inline_asm(res=value.type, operands_=[value], asm_string="", constraints="=v,0",
                            has_side_effects=True)


def lane_id():
    """This lane's index in its wave, counted here (``v_mbcnt_lo/hi`` in asm: the compiler would turn
    the intrinsics back into the thread id and keep that register alive from the kernel's start)."""
    lane = _llvm.inline_asm(res=T.i32, operands_=[], asm_string="v_mbcnt_lo_u32_b32 $0, -1, 0\nv_mbcnt_hi_u32_b32 $0, -1, $0",
                            constraints="=v", has_side_effects=True)
    return fx.Int32(lane) & 63  # the mask tells the compiler the range: divisions by 16 become shifts


def wave_uniform(value):
    """``value`` (the same in every lane) moved to a scalar register (``v_readfirstlane_b32``)."""
    return fx.Int32(_rocdl.readfirstlane(T.i32, fx.Int32(value).ir_value()))


def set_priority(level: int) -> None:
    rocdl.s_setprio(level)


# --------------------------------------------------------------------------------------------------
# buffer access: raw buffer instructions, offsets a per-lane register plus constants
# --------------------------------------------------------------------------------------------------
def buffer_resource(tensor):
    """The raw buffer descriptor of a tensor, sized from its runtime extent (bounds-checked)."""
    return fx.rocdl.get_buffer_rsrc(fx.get_iter(fx.rocdl.make_buffer_tensor(tensor, max_size=False)))


def buffer_store_dwords(rsrc, voffset, data) -> None:
    """``buffer_store_dwordx4``: four i32 at byte ``voffset`` (past the descriptor's size: dropped)."""
    _rocdl.raw_ptr_buffer_store(Vec(data).ir_value(), rsrc, fx.Int32(voffset).ir_value(), fx.Int32(0).ir_value(),
                                aux=_i32_attr(0))


def buffer_load_lds(rsrc, *, lds, voffset, soffset: int) -> None:
    """``buffer_load_dwordx4 ... lds``: 16 bytes per lane from ``voffset + soffset`` to LDS ``lds + 16 lane``."""
    lds_ptr = _llvm.IntToPtrOp(ir.Type.parse("!llvm.ptr<3>"), fx.Int32(lds).ir_value()).result
    _rocdl.raw_ptr_buffer_load_lds(rsrc, lds_ptr, _i32(DMA_LANE_BYTES), fx.Int32(voffset).ir_value(), _i32(soffset),
                                   _i32(0), aux=_i32_attr(0))


def _i32(value: int):
    return fx.Int32(value).ir_value()


def _i32_attr(value: int):
    return ir.IntegerAttr.get(ir.IntegerType.get_signless(32), value)


def buffer_load(rsrc, voffset, *, dtype, count: int = 1, soffset=0):
    """``count`` values of ``dtype`` at byte ``voffset + soffset`` (``buffer_load_ubyte/dword/dwordx4``;
    past the descriptor's size: zeros; ``soffset``, wave-uniform, may not count in that check on every
    chip, so only offsets known in range go there). A scalar for ``count == 1``, else a vector."""
    ty = dtype.ir_type if count == 1 else ir.VectorType.get([count], dtype.ir_type)
    value = _rocdl.raw_ptr_buffer_load(ty, rsrc, fx.Int32(voffset).ir_value(), fx.Int32(soffset).ir_value(),
                                       aux=_i32_attr(0))
    return dtype(value) if count == 1 else Vec(value)


def tile_table_entry(tiles, index):
    """Row ``index`` of the int32 [n, 4] tile table, wave-uniform: ``s_buffer_load_dwordx4`` into SGPRs."""
    return fx.rocdl.s_buffer_load(fx.get_iter(fx.rocdl.make_buffer_tensor(tiles, max_size=False)), index * 4, count=4)


def add_here(base, addend):
    """``base + addend`` computed at this point by an asm ``v_add_u32`` (``addend`` an int or a
    wave-uniform value): a sum the compiler cannot merge with other uses and keep live across
    the main loop (or fold into a 64-bit multiply-add holding a register pair)."""
    if isinstance(addend, int):
        if addend == 0:
            return base
        text, operands, constraints = f"v_add_u32 $0, {addend}, $1", [fx.Int32(base).ir_value()], "=v,v"
    else:
        text, constraints = "v_add_u32 $0, $2, $1", "=v,v,s"
        operands = [fx.Int32(base).ir_value(), fx.Int32(addend).ir_value()]
    return fx.Int32(_llvm.inline_asm(res=T.i32, operands_=operands, asm_string=text, constraints=constraints,
                                     has_side_effects=True))


def offset_here(base, const: int):
    """``base + const`` for a buffer load: the instruction's 12-bit immediate where it fits, else
    :func:`add_here` (each such offset would otherwise hold a register for the whole kernel)."""
    return base + const if const <= BUFFER_IMM_MAX else add_here(base, const)


# --------------------------------------------------------------------------------------------------
# global -> LDS
# --------------------------------------------------------------------------------------------------
class HalfTileDMA:
    """Fills one LDS half-tile of one operand with one LDS-DMA load per step and wave.

    The lane's global byte offset for step ``s`` at K tile 0 is ``base + steps[s]``: ``base`` carries
    the lane's row of the operand's first half (rows past the tensor fall outside the descriptor
    and read zeros) and ``steps[s]`` the half's and the step's rows. ``recompute``: that constant is
    added next to each load (:func:`add_here`, one VALU instruction), so one register per operand
    lives through the main loop instead of one per half and step; otherwise the sums are formed once
    and held (no VALU in the loop). The K tile moves through the instruction's scalar offset; the
    LDS destination is wave-uniform (M0): lane ``l`` writes ``lds + 16 l``.
    """

    def __init__(self, *, rsrc, base, steps, k_tile_bytes, wave_id, recompute: bool):
        self.rsrc, self.k_tile_bytes, self.wave_id = rsrc, k_tile_bytes, wave_id
        self.base, self.step_offsets, self.recompute = base, steps, recompute
        self.held = None if recompute else [base + c for c in steps]

    @property
    def steps(self) -> int:
        return len(self.step_offsets)

    def load(self, lds, k_tile: int) -> None:
        wave_base = lds_address(lds) + self.wave_id * DMA_BYTES_PER_WAVE
        for s in range_constexpr(self.steps):
            voffset = add_here(self.base, self.step_offsets[s]) if self.recompute else self.held[s]
            buffer_load_lds(self.rsrc, lds=wave_base + s * DMA_BYTES_PER_STEP, voffset=voffset,
                            soffset=k_tile * self.k_tile_bytes)


# --------------------------------------------------------------------------------------------------
# LDS -> registers
# --------------------------------------------------------------------------------------------------
def _lds_16_bytes(lds, offset):
    """``ds_read_b128`` at byte ``offset`` of LDS array ``lds`` (the pointer keeps its alias information)."""
    ptr = fx.add_offset(lds.ptr, fx.make_int_tuple(offset))
    return fx.make_view(fx.recast_iter(fx.Uint8, ptr), fx.make_layout(16, 1)).load().bitcast(fx.Int32)


_LDS_SPACE = 2  # FlyDSL's shared-memory address space


def lds_address(array):
    """The LDS byte address of an LDS array, as an i32."""
    return fx.Int32(fx.ptrtoint(array.ptr))


def _lds_pointer(dtype, address, alignment):
    return fx.inttoptr(fx.PointerType.get(dtype.ir_type, _LDS_SPACE, alignment), address)


def lds_store_bf16(address, value) -> None:
    """``ds_write_b16`` of one bf16 at LDS byte ``address``."""
    fx.ptr_store(value, _lds_pointer(fx.BFloat16, address, 2))


def lds_load_dwords(address):
    """``ds_read_b128``: the 16 bytes at LDS byte ``address`` as four i32 (the epilogue's stage: no DMA
    is in flight by then, so the compiler's conservative wait before it costs nothing)."""
    view = fx.make_view(_lds_pointer(fx.Uint8, address, 16), fx.make_layout(16, 1))
    return view.load().bitcast(fx.Int32)


class FragmentReader:
    """MFMA fragments of one wave from one operand's half-tiles: ``n_tiles`` 16-row tiles.

    ``bases`` are the lane's two offsets (K bytes ``32 (l // 16)`` and ``+16``) of tile 0 in the
    ``anchor`` slot (``byte_layout.a_read_bases`` / ``b_read_bases``), pinned: the compiler keeps one
    register each and puts the slot's distance from the anchor and ``i * MFMA_TILE_BYTES`` in the
    instruction's offset (unpinned, it merged those constants into the lane arithmetic and held a
    register per slot and tile; spills at 256x256). Reads are addressed from the anchor array, not
    from a bare integer: from an integer address the compiler cannot tell an LDS read from the
    in-flight DMA writes and waits for every load (``s_waitcnt vmcnt(0)``) before it.
    """

    def __init__(self, *, anchor, bases, n_tiles):
        self.anchor = anchor
        self.bases = [fx.Int32(pin(fx.Int32(b).ir_value())) for b in bases]
        self.n_tiles = n_tiles

    def load(self, lds):
        slot = lds_address(lds) - lds_address(self.anchor)  # a compile-time constant
        frags = []
        for i in range_constexpr(self.n_tiles):
            lo, hi = (_lds_16_bytes(self.anchor, b + slot + i * MFMA_TILE_BYTES) for b in self.bases)
            frags.append(lo.shuffle(hi, list(range(8))))
        return frags


# --------------------------------------------------------------------------------------------------
# MFMA
# --------------------------------------------------------------------------------------------------
def zero_acc():
    return Vec.filled(4, 0.0, fx.Float32)


class Mfma:
    """One phase's MFMAs: every (A tile, B tile) pair of a wave, 16x16x128 fp8 each.

    ``scales`` (mxfp8) are per-tile i32 registers whose low byte is the lane's e8m0 scale; without
    them the unscaled instruction is used (ptpc, blockscale).
    """

    def __init__(self, *, n_a, n_b):
        self.n_a = n_a
        self.n_b = n_b
        self.atom = fx.make_mma_atom(fx.rocdl.cdna4.MFMA_Scale(16, 16, 128, fx.Float8E4M3FN))

    def idx(self, i, j):
        return i * self.n_b + j

    def _frag(self, value, n, dtype):
        f = fx.make_rmem_tensor(n, dtype)
        f.store(Vec(value))
        return f

    def pair(self, a, b, c):
        """One unscaled 16x16x128 MFMA: c + a x b."""
        cf = self._frag(c, 4, fx.Float32)
        fx.gemm(self.atom, cf, self._frag(a, 8, fx.Int32), self._frag(b, 8, fx.Int32), cf)
        return cf.load().ir_value()

    def run(self, a, b, acc, *, a_scales=None, b_scales=None):
        out = []
        for i in range_constexpr(self.n_a):
            for j in range_constexpr(self.n_b):
                c = acc[self.idx(i, j)]
                if const_expr(a_scales is None):
                    out.append(self.pair(a[i], b[j], c))
                else:
                    out.append(rocdl.mfma_scale_f32_16x16x128_f8f6f4(
                        T.f32x4,
                        [Vec(a[i]).ir_value(), Vec(b[j]).ir_value(), Vec(c).ir_value(), 0, 0,
                         0, a_scales[i], 0, b_scales[j]],
                    ))
        return out

    def run_folded(self, a, b, acc, fold):
        """blockscale: each MFMA from zero, folded into its accumulator at once (4 temporaries)."""
        zero = zero_acc()
        return [fold(acc[self.idx(i, j)], self.pair(a[i], b[j], zero), i, j)
                for i in range_constexpr(self.n_a) for j in range_constexpr(self.n_b)]


# --------------------------------------------------------------------------------------------------
# the epilogue
# --------------------------------------------------------------------------------------------------
class CEpilogue:
    """The C tile through the wave's LDS stage (``byte_layout.CStage``) to 16-byte global stores.

    ``stage`` writes a quarter's bf16 values where the layout puts them (``ds_write_b16``, one per
    value, a per-lane base plus an immediate); ``store`` reads 16 bytes per lane back
    (``ds_read_b128``) and writes them with one ``buffer_store_dwordx4``. The stage is the wave's
    own region, so only the wave's own LDS writes must land before its reads: ``flush`` waits on
    them (``s_waitcnt lgkmcnt(0)``, an asm statement the compiler moves no LDS access across).
    The A/B buffers under the stage must be free: the schedule's epilogue barrier and the
    happens-before checker see to that.
    """

    def __init__(self, *, C, lds_base, layout, lane, wave_id, ldc, row0, col0):
        self.layout, self.ldc = layout, ldc
        self.rsrc = buffer_resource(C)
        self.write_bases = [lds_base + b for b in layout.write_bases(lane, wave_id)]
        self.read_base = lds_base + layout.read_base(lane, wave_id)
        self.voffset = layout.store_lane_offset(lane, row0=row0, col0=col0, ldc=ldc)

    def stage(self, quarter: int, tiles) -> None:
        """``tiles[i * n_b + j]``: the four fp32 values of MFMA tile (i, j), ready to round to bf16."""
        lay = self.layout
        for i in range_constexpr(lay.n_a):
            for j in range_constexpr(lay.n_b):
                vals = Vec(tiles[i * lay.n_b + j]).to(fx.BFloat16)
                for e in range_constexpr(4):
                    b, imm = lay.write_imm(quarter, i, j, e)
                    lds_store_bf16(self.write_bases[b] + imm, vals[e])

    @staticmethod
    def flush() -> None:
        _asm("s_waitcnt lgkmcnt(0)")

    def store(self, quarter: int, *, row_offset: int, col_offset: int) -> None:
        """Quarter ``quarter``, ``row_offset`` / ``col_offset`` rows / columns from quarter 0's origin."""
        lay = self.layout
        for n in range_constexpr(lay.stores):
            data = lds_load_dwords(self.read_base + lay.read_imm(quarter, n))
            step = lay.store_step_offset(n, row_offset=row_offset, col_offset=col_offset, ldc=self.ldc)
            buffer_store_dwords(self.rsrc, self.voffset + step, data)


def bump_counter(counters, index) -> None:
    """``counters[index] += 1`` on the int64 counters, acq_rel at system scope.

    Release: this thread's (and, through the preceding ``wait_barrier(0)``, the workgroup's)
    C stores are visible before the new count; peers' transports and DMA engines read it.
    """
    ptr_t = ir.Type.parse("!llvm.ptr<1>")
    raw = counters.ir_value() if hasattr(counters, "ir_value") and not isinstance(counters, ir.Value) else counters
    base = _llvm.PtrToIntOp(T.i64, _fly.extract_aligned_pointer_as_index(ptr_t, raw)).result
    off = (fx.Int64(index) * fx.Int64(COUNTER_BYTES)).ir_value()
    ptr = _llvm.IntToPtrOp(ptr_t, _llvm.AddOp(base, off, _llvm.IntegerOverflowFlags(0)).result).result
    _llvm.AtomicRMWOp(_llvm.AtomicBinOp.add, ptr, fx.Int64(1).ir_value(), _llvm.AtomicOrdering.acq_rel,
                      alignment=COUNTER_BYTES)


# --------------------------------------------------------------------------------------------------
# quant formats: where the scales enter
# --------------------------------------------------------------------------------------------------
class RowScales:
    """ptpc: fp32 row scales of A ([M]) and B ([N]), applied once, in the epilogue.

    Per A half, lane ``l`` needs the scales of its accumulator rows ``16 i + 4 (l // 16) .. +3`` of
    every tile (one 16-byte load each); per B half, the scale of its column ``16 j + l % 16`` (one
    dword). One per-lane base per operand; the half and tile are immediates.
    """

    def __init__(self, *, A_scale, B_scale, lane, a_row0, b_row0, half_m, half_n, n_a, n_b):
        self.sa, self.sb = buffer_resource(A_scale), buffer_resource(B_scale)
        self.lane, self.a_row0, self.b_row0 = lane, a_row0, b_row0
        self.half_m, self.half_n, self.n_a, self.n_b = half_m, half_n, n_a, n_b

    def for_tile(self, tile, k):
        lane, h = self.lane(), int(tile[1])
        if tile[0] == "a":
            base = row_scale_base(lane=lane, row0=self.a_row0)
            return [buffer_load(self.sa, base + tile_scale_imm(half=h, half_rows=self.half_m, tile=i),
                                dtype=fx.Float32, count=4) for i in range_constexpr(self.n_a)]
        base = col_scale_base(lane=lane, col0=self.b_row0)
        return [buffer_load(self.sb, base + tile_scale_imm(half=h, half_rows=self.half_n, tile=j), dtype=fx.Float32)
                for j in range_constexpr(self.n_b)]


class BlockScales:
    """blockscale: A 1x128 (fp32 [M, K/128] column-major), B 128x128 (fp32 [N/128, K/128]).

    Per K tile, a quarter's MFMAs start from zero and the result is folded into the running
    accumulator with that tile's scales: acc += part * (sa[row] * sb). Lane ``l`` of a 16x16
    accumulator holds rows 4 (l // 16) .. +3 of its tile, so it needs four A scales per A tile
    (one 16-byte load: the column-major layout keeps them adjacent) and one B scale per B half
    (a 128-row B block never straddles a half: halves are 64 or 128 rows, aligned; the offset is
    wave-uniform). K tile ``k`` adds ``k * M`` scales (a scalar); half and tile are immediates.
    """

    def __init__(self, *, A_scale, B_scale, lane, a_row0, b_row0, half_m, half_n, n_a, m, k_tiles):
        self.sa, self.sb = buffer_resource(A_scale), buffer_resource(B_scale)
        self.a_base = row_scale_base(lane=lane, row0=a_row0)
        self.b_row0, self.half_m, self.half_n, self.n_a = b_row0, half_m, half_n, n_a
        self.m, self.k_tiles = m, k_tiles

    def for_tile(self, tile, k):
        h = int(tile[1])
        if tile[0] == "a":  # rows past M must fall outside the descriptor: the K column is in the register
            base = add_here(self.a_base, self.m * (k * F32_BYTES))
            return [buffer_load(self.sa, base + tile_scale_imm(half=h, half_rows=self.half_m, tile=i), dtype=fx.Float32,
                                count=4) for i in range_constexpr(self.n_a)]
        block = (self.b_row0 + h * self.half_n) // 128  # always in range: N % 128 == 0, k < K / 128
        return buffer_load(self.sb, 0, soffset=(block * self.k_tiles + k) * F32_BYTES, dtype=fx.Float32)

    @staticmethod
    def fold(acc, part, sa, sb):
        """acc + part * (sa[e] * sb): one 16x16 tile's four values, computed here.

        The empty asm pins the sum in place: without it LLVM sinks every fold to the epilogue and
        keeps all the per-K-tile MFMA results alive, which spills.
        """
        return pin((Vec(acc) + Vec(part) * (sa * sb)).ir_value())


class MxScales:
    """mxfp8: e8m0 [rows, K/32] scales as operands of v_mfma_scale_f32_16x16x128_f8f6f4.

    Lane ``l`` supplies the scale of row ``l % 16`` and K group ``4 k + l // 16`` of its tile (the
    instruction's scale operand order, matching the fragments' K order). One per-lane base per
    operand; the tile's rows and the K tile are a constant offset (an immediate up to 4095 bytes,
    else an add next to the load: see :func:`offset_here`).
    """

    def __init__(self, *, A_scale, B_scale, lane, a_row0, b_row0, half_m, half_n, n_a, n_b, K):
        self.sa, self.sb = buffer_resource(A_scale), buffer_resource(B_scale)
        self.groups = K // MX_GROUP
        self.a_base = mx_scale_base(lane=lane, row0=a_row0, groups=self.groups)
        self.b_base = mx_scale_base(lane=lane, row0=b_row0, groups=self.groups)
        self.half_m, self.half_n, self.n_a, self.n_b = half_m, half_n, n_a, n_b

    def for_tile(self, tile, k):
        h = int(tile[1])
        rsrc, base, half_rows, n = ((self.sa, self.a_base, self.half_m, self.n_a) if tile[0] == "a"
                                    else (self.sb, self.b_base, self.half_n, self.n_b))
        out = []
        for i in range_constexpr(n):
            const = tile_scale_imm(half=h, half_rows=half_rows, tile=i, bytes_per_row=self.groups) + mx_scale_k_imm(k)
            byte = buffer_load(rsrc, offset_here(base, const), dtype=fx.Uint8)
            out.append(fx.Int32(byte).ir_value())  # only byte 0 is read (op_sel 0): extension bits are moot
        return out
