"""Probes' kernels, not the library's: a captured decode call of 2..64 rows as one launch instead of two
(blockscale's MMA with the activation quantizer inside it; ptpc's quantizer and split MMA as two
phases of one cooperative launch, ``ptpc_split_one_kernel`` below).

The shipped captured call of 2..64 rows is two launches: the group quantizer (``quantize_groups_kernel``)
writes the e4m3 rows and their scales, then ``decode_mma_rows_kernel`` reads them, its K split over
programs. At small weights (Llama-3-8B's k/v_proj: 1-8 MB) the quantizer's launch and the dependency
between the two are a large part of the call. Here each MMA program quantizes the activation columns
of its own K slice as it reads them: blockscale's scale is per row and 128 columns, so a program
needs no other program's rows (ptpc's row amax over all of K would). The programs of every weight
block quantize the same columns of the rows again (the price of one launch: N / BLOCK_N times the
quantizer's work, the rows read from L2).

The bits are the two launches': each 128-column group's scale and e4m3 values as the quantizer
computes them (the same IEEE divisions, zeros skipped as at decode sizes), multiplied and scaled
in the same order as ``decode_kernels._mma_partial``, the slices summed as ``_mma_rows`` sums
them. One difference in the split's bookkeeping: without a quantizer launch nothing zeroes the
per-block counters before a call, so they are never reset: a call adds ``SPLIT`` to each block's
counter, and the program that takes it to a multiple of ``SPLIT`` is the block's last (counters
zeroed once, at the launch's creation; calls sharing them must not overlap, which a probe on one
stream guarantees and a library would have to, for graphs replayed on other streams too).

``scripts.probe_decode_split_k --inline`` times it beside the two launches of the same config.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_fused.hopper.decode_kernels import _finish_rows, _grid_wait
from kernels_fused.hopper.quantize_kernels import _div_rn, _to_e4m3, quantize_row_slice


@triton.jit
def _program_tile(block, s, K_SLICE, K_PAD, M, N, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """A split MMA program's share, as ``decode_kernels._mma_partial`` takes it: K columns ``[k_lo,
    k_hi)`` of slice ``s``, weight block ``block``'s rows ``cols`` (``n_ok``: below N), the MMA's
    ``ROWS`` columns ``rows`` (``r_ok``: below M)."""
    k_lo = s * K_SLICE
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, ROWS)
    return k_lo, tl.minimum(k_lo + K_SLICE, K_PAD), cols, cols < N, rows, rows < M


@triton.jit
def blockscale_inline_mma_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, cnt_ptr, part_ptr, M, N, K, K_PAD, K_SLICE, stride_x,
                                 stride_ws, tiny, fp8_max, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 ROWS: tl.constexpr, SPLIT: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """``out [M, N] = bf16(quant(x) @ dequant(w).T)`` for blockscale, program ``(n block, s)`` over K
    slice ``s``: x bf16 ``[M, K]`` (columns past K read as zeros), w e4m3 ``[>= N, K_PAD]``, ws its
    ``[N / 128, K_PAD / 128]`` fp32 scales (row stride ``stride_ws``)."""
    block = tl.program_id(0)
    s = tl.program_id(1)
    k_lo, k_hi, cols, n_ok, rows, r_ok = _program_tile(block, s, K_SLICE, K_PAD, M, N, BLOCK_N, ROWS)
    kk = tl.arange(0, 128)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K_PAD + kk[None, :]
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x + kk[None, :]
    ws_row = ws_ptr + (block * BLOCK_N // 128) * stride_ws
    acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        for j in tl.static_range(BLOCK_K // 128):
            kb = k0 + j * 128
            w = tl.load(w_rows + kb, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_rows + kb, mask=r_ok[:, None] & (kb + kk < K)[None, :], other=0.0).to(tl.float32)
            # the group quantizer's scale and bytes (quantize_groups_kernel, blockscale, zeros skipped)
            sa = _div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), tiny), tl.zeros((ROWS,), dtype=tl.float32) + fp8_max)
            q = _to_e4m3(tl.clamp(_div_rn(x, sa[:, None], True), -fp8_max, fp8_max), ROUND_IN_FP32)
            # (rows past M: q is zero, so the column is zero whatever its scale, as the two launches' is)
            acc += tl.dot(w, tl.trans(q)) * (sa * tl.load(ws_row + kb // 128))[None, :]
    _split_finish(acc, ws_ptr, ws_ptr, out_ptr, cnt_ptr, part_ptr, block, s, cols, n_ok, rows, r_ok, N, 1, BLOCK_N,
                  ROWS, SPLIT, True, ROUND_IN_FP32)


@triton.jit
def _split_finish(acc, sa_ptr, ws_ptr, out_ptr, cnt_ptr, part_ptr, block, s, cols, n_ok, rows, r_ok, N,
                  QUANT: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr,
                  NEVER_RESET: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """A program's partial ``acc`` of weight block ``block`` over K slice ``s``, finished as
    ``decode_kernels._mma_rows`` finishes it: stored to ``part``, counted in on the block's counter,
    and the last of the block's programs sums the partials in slice order and stores the output.
    ``NEVER_RESET``: the counters are never zeroed between calls (each call adds SPLIT), so the count
    that reaches a multiple of SPLIT (a power of two: the int32's wrap keeps the residue) is this
    call's last; else they are zeroed before each call and the count SPLIT - 1 is."""
    if SPLIT == 1:
        _finish_rows(acc, sa_ptr, ws_ptr, out_ptr, out_ptr, cols, n_ok, rows, r_ok, N, QUANT, False, ROUND_IN_FP32)
    else:
        tile = tl.arange(0, BLOCK_N)[:, None] * ROWS + rows[None, :]
        parts = part_ptr + block.to(tl.int64) * (SPLIT * BLOCK_N * ROWS)
        tl.store(parts + s * (BLOCK_N * ROWS) + tile, acc)
        tl.debug_barrier()  # every thread's partial stored before the count
        arrived = tl.atomic_add(cnt_ptr + block, 1, sem="acq_rel", scope="gpu")
        if NEVER_RESET:
            arrived = arrived & (SPLIT - 1)
        if arrived == SPLIT - 1:
            total = tl.load(parts + tile, cache_modifier=".cg")  # (L2: the other SMs' stores)
            for i in tl.static_range(1, SPLIT):
                total += tl.load(parts + i * (BLOCK_N * ROWS) + tile, cache_modifier=".cg")
            _finish_rows(total, sa_ptr, ws_ptr, out_ptr, out_ptr, cols, n_ok, rows, r_ok, N, QUANT, False,
                         ROUND_IN_FP32)


class InlineLaunch:
    """One call shape's launch of :func:`blockscale_inline_mma_kernel` at ``cfg`` = (BLOCK_N, BLOCK_K,
    SPLIT, warps, stages), as ``probe_decode_split_k`` names configs; its counters and partials are
    its own (zeroed once), so its calls must not overlap."""

    def __init__(self, m: int, k: int, k_padded: int, n: int, cfg: tuple, device):
        from kernels_fused.hopper import decode as D
        from kernels_fused.hopper.launch import Kernel
        from kernels_fused.hopper.quantize import _interpreting

        block_n, block_k, split, warps, stages = cfg
        if 128 % block_n or block_k % 128 or k_padded % block_k or split & (split - 1):
            raise ValueError(f"InlineLaunch: BLOCK_N={block_n} must divide 128, BLOCK_K={block_k} be a multiple of "
                             f"128 dividing K_PAD={k_padded}, SPLIT={split} a power of two")
        programs, rows = -(-n // block_n), D.mma_rows(m)
        self.sizes = (m, n, k, k_padded, -(-(k_padded // block_k) // split) * block_k)  # K_SLICE last
        self.consts = (block_n, block_k, rows, split, _interpreting())
        self.counters = torch.zeros(programs, dtype=torch.int32, device=device)
        self.parts = torch.empty(max(1, programs * split * block_n * rows), dtype=torch.float32, device=device)
        self.kernel = Kernel(blockscale_inline_mma_kernel, (programs, split), num_warps=warps, num_stages=stages)

    def __call__(self, x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        from cco.quant import _TINY, FP8_MAX

        self.kernel(out.get_device(), x, wq, ws, out, self.counters, self.parts, *self.sizes, x.stride(0),
                    ws.stride(0), _TINY, FP8_MAX, *self.consts)
        return out


# ---- ptpc: the quantizer and the split MMA as two phases of one cooperative launch, for a capture --------
#
# ptpc's scale is the row's amax over all of K, so no MMA program can quantize its own slice alone
# (blockscale's way above): the rows are quantized once by the whole grid, then every program waits
# for all (``decode_kernels._grid_wait``), then multiplies its weight block's K slice. The eager one
# launch (``decode_ptpc_kernel``) does that with a program per weight block, every slice in one
# program; a captured call takes the two launches instead (the quantizer, then the split MMA). Here
# the grid is the split MMA's (a program per block and slice), and each program loads its first
# weight tile before the wait (``PREFETCH``): the weight does not depend on the quantizer, so that
# read overlaps the quantizing phase, the wait and the launch's start. The counters of the split are
# zeroed in the first phase (program 0, before the wait that orders it ahead of every count).
@triton.jit
def ptpc_split_one_kernel(x_ptr, q_ptr, w_ptr, ws_ptr, out_ptr, sync_ptr, cnt_ptr, part_ptr, M, N, K, K_PAD,
                          K_SLICE, stride_x, tiny, fp8_max, SLICES, COUNTERS, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr, ROW_BLOCK: tl.constexpr,
                          SLICE_K: tl.constexpr, PHASES: tl.constexpr, PREFETCH: tl.constexpr,
                          ROUND_IN_FP32: tl.constexpr):
    """``out [M, N] = bf16(quant(x) @ dequant(w).T)`` for ptpc: program ``p`` is weight block ``p //
    SPLIT`` over K slice ``p % SPLIT`` (``K_SLICE`` columns). ``q`` holds the e4m3 rows ``[M, K_PAD]``
    then their fp32 scales. ``PHASES``: 3 both phases and the wait (the GPU); 1 or 2 one phase alone
    (two launches: Triton's interpreter runs programs in turn, so a wait with more than one program
    never ends there)."""
    sa_ptr = (q_ptr + M * K_PAD).to(tl.pointer_type(tl.float32), bitcast=True)
    pid = tl.program_id(0)
    block = pid // SPLIT
    s = pid % SPLIT
    k_lo, k_hi, cols, n_ok, rows, r_ok = _program_tile(block, s, K_SLICE, K_PAD, M, N, BLOCK_N, ROWS)
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K_PAD + kk[None, :]
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * K_PAD + kk[None, :]
    if PHASES != 2:
        gen = tl.atomic_add(sync_ptr + 1, 0, sem="relaxed", scope="gpu")
        if PREFETCH and PHASES == 3:
            w_first = tl.load(w_rows + k_lo, mask=n_ok[:, None] & (k_lo + kk < k_hi)[None, :], other=0.0)
        if SPLIT > 1:
            if pid == 0:
                c = tl.arange(0, 1024)
                for c0 in range(0, COUNTERS, 1024):
                    tl.store(cnt_ptr + c0 + c, tl.zeros((1024,), dtype=tl.int32), mask=c0 + c < COUNTERS)
        for item in range(pid, M * SLICES, tl.num_programs(0)):
            quantize_row_slice(x_ptr, q_ptr, sa_ptr, item // SLICES, item % SLICES, M, M, K, K_PAD, stride_x, tiny,
                               fp8_max, ROW_BLOCK, SLICE_K, True, ROUND_IN_FP32)
        if PHASES == 3:
            _grid_wait(sync_ptr, gen)
    if PHASES != 1:
        if not (PREFETCH and PHASES == 3):
            w_first = tl.load(w_rows + k_lo, mask=n_ok[:, None] & (k_lo + kk < k_hi)[None, :], other=0.0)
        # the split MMA's chain (decode_kernels._mma_partial, ptpc), its first tile the one read above
        # (an empty slice, K_PAD's last: its tiles read as zeros, a zero sum, as the chain's)
        q_first = tl.load(q_rows + k_lo, mask=r_ok[:, None] & (k_lo + kk < k_hi)[None, :], other=0.0)
        acc = tl.dot(w_first, tl.trans(q_first), tl.zeros((BLOCK_N, ROWS), dtype=tl.float32))
        for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
            w = tl.load(w_rows + k0, mask=n_ok[:, None], other=0.0)
            q = tl.load(q_rows + k0, mask=r_ok[:, None], other=0.0)
            acc = tl.dot(w, tl.trans(q), acc)
        _split_finish(acc, sa_ptr, ws_ptr, out_ptr, cnt_ptr, part_ptr, block, s, cols, n_ok, rows, r_ok, N, 0,
                      BLOCK_N, ROWS, SPLIT, False, ROUND_IN_FP32)


class PtpcOneLaunch:
    """One call shape's cooperative launch of :func:`ptpc_split_one_kernel` at ``cfg`` = (BLOCK_N,
    BLOCK_K, SPLIT, warps, stages); its scratch (rows, scales), wait counter, split counters and
    partials are its own, so its calls must not overlap. Raises ValueError where the grid (blocks x
    slices) is not resident at once (``decode.resident_programs``). ``device`` "cpu": Triton's
    interpreter, the two phases as two launches."""

    def __init__(self, m: int, k: int, k_padded: int, n: int, cfg: tuple, device, prefetch: bool = True):
        from kernels_fused.hopper import decode as D
        from kernels_fused.hopper.launch import Kernel
        from kernels_fused.hopper.quantize import _interpreting

        block_n, block_k, split, warps, stages = cfg
        dev = torch.device(device)
        blocks = -(-n // block_n)
        programs = blocks * split
        if dev.type == "cuda" and dev.index is None:  # "cuda": the current device (the probe's)
            dev = torch.device("cuda", torch.cuda.current_device())
        resident = D.resident_programs(dev.index if dev.type == "cuda" else -1)
        if dev.type == "cuda" and programs > resident:
            raise ValueError(f"PtpcOneLaunch: {programs} programs (blocks x slices) are more than the "
                             f"{resident} resident at once")
        if k_padded % block_k:
            raise ValueError(f"PtpcOneLaunch: BLOCK_K={block_k} must divide K_PAD={k_padded}")
        rows = D.mma_rows(m)
        slices, slice_k = D.one_slices(m, k_padded, programs)
        k_slice = -(-(k_padded // block_k) // split) * block_k
        self.cpu = dev.type != "cuda"
        self.m, self.k_padded = m, k_padded
        self.sizes = (m, n, k, k_padded, k_slice)
        self.counts = (slices, blocks)
        self.consts = (block_n, block_k, rows, split, min(D._pow2(k), D.ONE_ROW_BLOCK), slice_k)
        self.tail = (bool(prefetch), _interpreting())
        self.scratch = torch.empty(D.rows_and_scales(m, k_padded), dtype=D.FP8, device=dev)  # rows, then scales
        self.sync = torch.zeros(2, dtype=torch.int32, device=dev)
        self.counters = torch.zeros(blocks, dtype=torch.int32, device=dev)
        self.parts = torch.empty(max(1, programs * block_n * rows), dtype=torch.float32, device=dev)
        options = dict(num_warps=warps, num_stages=stages)
        if self.cpu:
            self.kernel = Kernel(ptpc_split_one_kernel, (programs,), **options)
        else:
            self.kernel = Kernel(ptpc_split_one_kernel, (programs,), launch_cooperative_grid=True, **options)

    def __call__(self, x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        from cco.quant import _TINY, FP8_MAX

        args = (x, self.scratch, wq, ws, out, self.sync, self.counters, self.parts, *self.sizes, x.stride(0), _TINY,
                FP8_MAX, *self.counts, *self.consts)
        for phases in ((1, 2) if self.cpu else (3,)):
            self.kernel(out.get_device(), *args, phases, *self.tail)
        return out
