"""A probe's kernel, not the library's: blockscale's decode MMA with the activation quantizer inside it.

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

from kernels_fused.hopper.decode_kernels import _finish_rows
from kernels_fused.hopper.quantize_kernels import _div_rn, _to_e4m3


@triton.jit
def blockscale_inline_mma_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, cnt_ptr, part_ptr, M, N, K, K_PAD, K_SLICE, stride_x,
                                 stride_ws, tiny, fp8_max, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 ROWS: tl.constexpr, SPLIT: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """``out [M, N] = bf16(quant(x) @ dequant(w).T)`` for blockscale, program ``(n block, s)`` over K
    slice ``s``: x bf16 ``[M, K]`` (columns past K read as zeros), w e4m3 ``[>= N, K_PAD]``, ws its
    ``[N / 128, K_PAD / 128]`` fp32 scales (row stride ``stride_ws``)."""
    block = tl.program_id(0)
    s = tl.program_id(1)
    k_lo = s * K_SLICE
    k_hi = tl.minimum(k_lo + K_SLICE, K_PAD)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < N
    rows = tl.arange(0, ROWS)
    r_ok = rows < M
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
    if SPLIT == 1:
        _finish_rows(acc, ws_ptr, ws_ptr, out_ptr, out_ptr, cols, n_ok, rows, r_ok, N, 1, False, ROUND_IN_FP32)
    else:
        tile = tl.arange(0, BLOCK_N)[:, None] * ROWS + rows[None, :]
        parts = part_ptr + block.to(tl.int64) * (SPLIT * BLOCK_N * ROWS)
        tl.store(parts + s * (BLOCK_N * ROWS) + tile, acc)
        tl.debug_barrier()  # every thread's partial stored before the count
        # never reset: the count that reaches a multiple of SPLIT (a power of two, so the int32's wrap
        # keeps the residue) is this call's last
        arrived = tl.atomic_add(cnt_ptr + block, 1, sem="acq_rel", scope="gpu")
        if (arrived & (SPLIT - 1)) == SPLIT - 1:
            total = tl.load(parts + tile, cache_modifier=".cg")
            for i in tl.static_range(1, SPLIT):
                total += tl.load(parts + i * (BLOCK_N * ROWS) + tile, cache_modifier=".cg")
            _finish_rows(total, ws_ptr, ws_ptr, out_ptr, out_ptr, cols, n_ok, rows, r_ok, N, 1, False,
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
