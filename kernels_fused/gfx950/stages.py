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
"""

from __future__ import annotations

import flydsl.expr as fx
from flydsl._mlir import ir
from flydsl._mlir.dialects import fly as _fly
from flydsl._mlir.dialects import llvm as _llvm
from flydsl._mlir.dialects.fly_rocdl import TargetAddressSpace
from flydsl.expr import const_expr, range_constexpr, rocdl
from flydsl.expr.typing import T
from flydsl.expr.typing import Vector as Vec

from .byte_layout import BLOCK_K, DMA_BYTES_PER_STEP, DMA_BYTES_PER_WAVE, MX_GROUP, a_read_offsets, b_read_offsets

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


def set_priority(level: int) -> None:
    rocdl.s_setprio(level)


# --------------------------------------------------------------------------------------------------
# global -> LDS
# --------------------------------------------------------------------------------------------------
def fp8_buffer(tensor):
    """A buffer-descriptor view of a 1-byte tensor, typed fp8, sized from the runtime extent."""
    t_i8 = fx.rocdl.make_buffer_tensor(tensor, max_size=False)
    it = fx.get_iter(t_i8)
    ptr_t = fx.PointerType.get(
        elem_ty=fx.Float8E4M3FN.ir_type,
        address_space=TargetAddressSpace.BufferDesc,
        alignment=fx.PointerType(it.type).alignment,
    )
    view = fx.Tensor(fx.make_view(fx.recast_iter(ptr_t, it), fx.get_layout(t_i8)))
    return fx.logical_divide(view, fx.make_layout(1, 1))


class HalfTileDMA:
    """Fills one LDS half-tile of one operand with ``steps`` LDS-DMA loads per wave.

    ``lane_offsets[s]`` is the lane's global byte offset for step ``s`` at K tile 0; the K tile
    moves through the instruction's scalar offset, so the per-lane addresses are computed once.
    """

    def __init__(self, *, src, lane_offsets, k_tile_bytes, wave_id):
        self.atom = fx.make_copy_atom(fx.rocdl.BufferCopyLDS128b(), 128)
        self.lds_ptr_t = fx.PointerType.get(fx.Float8E4M3FN.ir_type, 2, 512)
        self.src = src
        self.lane_offsets = lane_offsets
        self.k_tile_bytes = k_tile_bytes
        self.wave_id = wave_id

    @property
    def steps(self) -> int:
        return len(self.lane_offsets)

    def _lds_at(self, lds, step):
        # lane l's 16 bytes land at base + 16 l (the instruction's LDS addressing)
        base = fx.Int32(fx.ptrtoint(lds.ptr)) + fx.Int32(self.wave_id * DMA_BYTES_PER_WAVE + step * DMA_BYTES_PER_STEP)
        return fx.make_view(fx.inttoptr(self.lds_ptr_t, base), fx.make_layout(1, 1))

    def load(self, lds, k_tile: int) -> None:
        for s in range_constexpr(self.steps):
            src = fx.slice(self.src, (None, fx.Int32(self.lane_offsets[s])))
            fx.copy(self.atom, src, self._lds_at(lds, s), soffset=fx.Int32(k_tile * self.k_tile_bytes))


# --------------------------------------------------------------------------------------------------
# LDS -> registers
# --------------------------------------------------------------------------------------------------
def _lds_16_bytes(lds, offset):
    ptr = fx.add_offset(lds.ptr, fx.make_int_tuple(offset))
    return fx.make_view(fx.recast_iter(fx.Uint8, ptr), fx.make_layout(16, 1)).load().bitcast(fx.Int32)


class AReader:
    """A fragments of one wave: ``n_tiles`` 16-row MFMA tiles starting at row ``first_row``."""

    def __init__(self, *, lane, first_row, n_tiles):
        self.lane = lane
        self.first_row = first_row
        self.n_tiles = n_tiles

    def load(self, lds):
        frags = []
        for i in range_constexpr(self.n_tiles):
            lo, hi = a_read_offsets(lane=self.lane, row=self.first_row + i * 16 + self.lane % 16)
            frags.append(_lds_16_bytes(lds, lo).shuffle(_lds_16_bytes(lds, hi), list(range(8))))
        return frags


class BReader:
    """B fragments of one wave from the bpreshuffle half-tile: ``n_tiles`` 16-row groups."""

    def __init__(self, *, lane, first_group, n_tiles):
        self.lane = lane
        self.first_group = first_group
        self.n_tiles = n_tiles

    def load(self, lds):
        frags = []
        for i in range_constexpr(self.n_tiles):
            lo, hi = b_read_offsets(lane=self.lane, group=self.first_group + i)
            frags.append(_lds_16_bytes(lds, lo).shuffle(_lds_16_bytes(lds, hi), list(range(8))))
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
# small global reads and the epilogue
# --------------------------------------------------------------------------------------------------
class ScalarReader:
    """Per-lane reads of a small tensor (scales, the tile table) through a buffer descriptor."""

    _ATOMS = {32: "BufferCopy32b", 8: "BufferCopy8b"}

    def __init__(self, tensor, *, dtype, bits):
        self.view = fx.logical_divide(fx.rocdl.make_buffer_tensor(tensor, max_size=False), fx.make_layout(1, 1))
        self.atom1 = fx.make_copy_atom(getattr(fx.rocdl, self._ATOMS[bits])(), dtype)
        self.reg1 = fx.make_rmem_tensor(fx.make_layout(1, 1), dtype)
        if bits == 32:
            self.atom4 = fx.make_copy_atom(fx.rocdl.BufferCopy128b(), dtype)
            self.reg4 = fx.make_rmem_tensor(fx.make_layout(4, 1), dtype)

    def one(self, index):
        fx.copy(self.atom1, fx.slice(self.view, (None, fx.Int32(index))), self.reg1)
        return Vec(fx.memref_load_vec(self.reg1))[0]

    def four(self, index):
        """Elements index..index+3 (index a multiple of 4)."""
        fx.copy(self.atom4, fx.slice(self.view, (None, fx.Int32(index))), self.reg4)
        return Vec(fx.memref_load_vec(self.reg4))


class Bf16Store:
    """Stores a wave's 16x16 fp32 accumulator tiles as bf16 into row-major C [M, ldc]."""

    def __init__(self, C, *, lane, ldc):
        self.view = fx.logical_divide(fx.rocdl.make_buffer_tensor(C, max_size=False), fx.make_layout(1, 1))
        self.atom = fx.make_copy_atom(fx.rocdl.BufferCopy16b(), fx.BFloat16)
        self.reg = fx.make_rmem_tensor(fx.make_layout(1, 1), fx.BFloat16)
        self.lane = lane
        self.ldc = ldc

    def tile(self, values, row0, col0):
        """``values[e]`` is C[row0 + 4 (lane // 16) + e, col0 + lane % 16] (the MFMA C layout)."""
        row = row0 + (self.lane // 16) * 4
        col = col0 + self.lane % 16
        for e in range_constexpr(4):
            fx.memref_store_vec(Vec.filled(1, values[e].to(fx.BFloat16), fx.BFloat16), self.reg)
            fx.copy(self.atom, self.reg, fx.slice(self.view, (None, fx.Int32((row + e) * self.ldc + col))))


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
class NoMainLoopScales:
    """ptpc: nothing happens per K tile; the fp32 row scales are applied in the epilogue."""

    def for_tile(self, tile, k):
        return None


class BlockScales:
    """blockscale: A 1x128 (fp32 [M, K/128] column-major), B 128x128 (fp32 [N/128, K/128]).

    Per K tile, a quarter's MFMAs start from zero and the result is folded into the running
    accumulator with that tile's scales: acc += part * (sa[row] * sb). Lane ``l`` of a 16x16
    accumulator holds rows 4 (l // 16) .. +3 of its tile, so it needs four A scales per A tile
    (one 16-byte load: the column-major layout keeps them adjacent) and one B scale per B half
    (a 128-row B block never straddles a half: halves are 64 or 128 rows, aligned).
    """

    def __init__(self, *, A_scale, B_scale, lane, a_rows, b_rows, m, k_tiles):
        self.sa = ScalarReader(A_scale, dtype=fx.Float32, bits=32)
        self.sb = ScalarReader(B_scale, dtype=fx.Float32, bits=32)
        self.lane, self.a_rows, self.b_rows, self.m, self.k_tiles = lane, a_rows, b_rows, m, k_tiles

    def for_tile(self, tile, k):
        if tile[0] == "a":
            return [self.sa.four(k * self.m + row + (self.lane // 16) * 4) for row in self.a_rows[tile]]
        return self.sb.one((self.b_rows[tile] // 128) * self.k_tiles + k)

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
    instruction's scale operand order, matching the fragments' K order).
    """

    def __init__(self, *, A_scale, B_scale, lane, a_rows, b_rows, K):
        self.sa = ScalarReader(A_scale, dtype=fx.Uint8, bits=8)
        self.sb = ScalarReader(B_scale, dtype=fx.Uint8, bits=8)
        self.lane, self.a_rows, self.b_rows = lane, a_rows, b_rows
        self.groups = K // MX_GROUP

    def for_tile(self, tile, k):
        reader, rows = (self.sa, self.a_rows[tile]) if tile[0] == "a" else (self.sb, self.b_rows[tile])
        out = []
        for row in rows:
            byte = reader.one((row + self.lane % 16) * self.groups + k * (BLOCK_K // MX_GROUP) + self.lane // 16)
            out.append(fx.Int32(byte).ir_value())  # only byte 0 is read (op_sel 0): extension bits are moot
        return out
