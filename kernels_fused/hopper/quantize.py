"""Activation quantizer in Triton: bf16 (or any float) ``x [M, K]`` -> e4m3 ``[M, K_pad]`` and its
scales in the layout the GEMM reads, in one kernel launch (``cco.quant.quantize_a`` in plain torch
takes several kernels and an fp32 copy of ``x``). Device code: ``kernels_fused.hopper.quantize_kernels``.

What it computes, per format (the same formulas as ``cco.quant.quantize_a``)::

    ptpc        scale[m] = max(amax(x[m, :]), tiny) / 448                   fp32 [M]
    blockscale  scale[m, g] = max(amax(x[m, 128g:128g+128]), tiny) / 448     fp32 [M, K/128], stride (1, M)
    mxfp8       scale[m, g] = 2**ceil(log2(max(amax(x[m, 32g:32g+32]), tiny) / 448))   e8m0 [M, K/32]
    q = e4m3(clamp(x / scale, -448, 448))

Rows ``M <= m < M_pad`` (``m_padded``: cuBLAS's blockwise GEMM takes row counts that are a multiple
of 4 only) are written as zero rows, so a caller pads the rows without a copy.
Columns ``K <= k < K_pad`` are written as zeros (their scales, for the group formats, are those of
an all-zero group): a weight padded with zero columns to ``K_pad`` at load then multiplies them to
nothing, so a K that is not a whole number of the GEMM's 128-wide K tiles costs no extra pass.

Bit for bit what ``quantize_a`` gives on the padded input on the CPU: divisions are IEEE
(``div_rn``; Triton's ``/`` is approximate on NVIDIA). On a CUDA tensor ``quantize_a`` itself differs
by up to one ulp of a scale: torch divides a CUDA tensor by a Python scalar as a multiply by the
scalar's reciprocal. The one other difference is mxfp8's exponent, taken exactly from the bits here, where torch's
``log2`` can round to an integer for a ratio within about one fp32 ulp above a power of two (the
group's largest value then saturates at 448 instead of rounding to it from below).

Runs wherever Triton runs: NVIDIA, and ROCm (gfx950's e4m3 is the OCP format, ``tl.float8e4nv``).
Each call shape's launch is kept (``kernels_fused.hopper.launch``): after its first call it goes
through the compiled kernel's launcher, not ``JITFunction.run`` (11-24 us less host time a call on an
H200 host, docs/decode.md).
"""

from __future__ import annotations

import functools
import os

import torch

from cco.quant import _TINY, E8M0, FP8, FP8_MAX, MX_GROUP, QUANTS, SCALE_BLOCK
from kernels_fused.hopper.launch import Kernel, keep

# rows per program and the K step. Per-token rows are walked twice (amax, then quantize) in 1024-wide
# steps; the group formats take one [8, 512] tile per program (8 KiB of bf16 either way; blockscale at
# decode sizes [8, 128]: GROUP_DECODE_BLOCK_K below). Untuned:
# docs/experiments.md ("The layer on the GPU, and the activation quantizer") times the kernel with
# them against quantize_a (mxfp8 at M = 16384, K = 2432: 33.6 us replayed in a graph, 3.5 TB/s),
# not other choices.
PTPC_BLOCK_M, PTPC_BLOCK_K = 4, 1024
GROUP_BLOCK_M, GROUP_BLOCK_K = 8, 512
# blockscale's calls of at most SKIP_ZEROS_MAX_M rows (decode) take one 128-column scale group a
# program: 8 rows of K 4096 were 8 programs of [8, 512], each rounding 32 IEEE divisions a thread in
# turn. Side by side under graph replay (one H100, 2026-12-06, scripts/probe_quantize_groups.py
# --tiles; every tile the same bytes): [8, 128] 1.68-1.94 us against 2.60-2.85 at K 4096 and 1..64
# rows, 1.78-2.60 against 2.59-3.26 at K 14336. mxfp8's [8, 512] was the best or within 0.1 us there.
GROUP_DECODE_BLOCK_K = 128
NUM_WARPS = 4
# Calls of at most PTPC_SPLIT_MAX_M rows split each row over programs (quantize_ptpc_split_kernel):
# the two-pass kernel runs one program per 4 rows, one SM walking them twice in 1024-wide steps.
# Measured on one H100 (2026-12-02, scripts/bench_quantize.py --graph, one call per replay, so ~10 us
# of each figure is the replay's own cost), split / two-pass us: M=1 K=14336 13.1 / 72.0, K=16384
# 20.4 / 82.0; M=64 17.6 / 28.4, 18.3 / 31.3; M=256 16.7 / 29.5, 16.2 / 33.9; at K=4096 equal from
# M=8 on (docs/decode.md). Above 256 rows the two-pass kernel stays, as timed before. A row's
# amax is read in one load of up to SPLIT_ROW_BLOCK columns; each program quantizes SLICE_K >=
# SPLIT_SLICE_MIN columns, with about SPLIT_PROGRAMS programs in all (every program re-reads its
# row's amax from L2, so more programs than SMs only adds L2 reads). docs/decode.md times it.
PTPC_SPLIT_MAX_M = 256
# Calls of at most this many rows skip dividing zeros (quantize_kernels._div_rn's SKIP_ZEROS): at
# decode sizes padded rows and columns are most of what a program reads, and NVIDIA's IEEE division
# of a zero takes its slow path (blockscale 5.7-6.3 us against 2.3-3.2 at 1..2 rows); at 4096 and
# 16384 rows the selects cost ptpc and blockscale 1.1-1.8x (H200, 2026-12-04, docs/decode.md).
SKIP_ZEROS_MAX_M = 64
SPLIT_ROW_BLOCK = 16384
SPLIT_SLICE_MIN = 1024
SPLIT_PROGRAMS = 256
SPLIT_NUM_WARPS = 8


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _kernels():
    from kernels_fused.hopper import quantize_kernels as qk

    return qk.quantize_ptpc_kernel, qk.quantize_groups_kernel, qk.quantize_ptpc_split_kernel


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def check_rows(x: torch.Tensor, fn: str) -> None:
    """Raise ValueError unless ``x`` is a float ``[M, K]`` tensor with unit column stride (the rows
    the quantizing kernels read)."""
    if x.dim() != 2 or x.stride(1) != 1 or not x.dtype.is_floating_point:
        raise ValueError(f"{fn}: x must be a float [M, K] tensor with unit column stride, got {x.dtype} "
                         f"{list(x.shape)} stride {x.stride()}; pass x.reshape(-1, K).contiguous()")


def split_launch(m: int, k: int, k_padded: int) -> tuple[tuple[int, int], int, int]:
    """``(grid, ROW_BLOCK, SLICE_K)`` of :func:`quantize_ptpc_split_kernel` for ``m`` rows."""
    slices = max(1, min(k_padded // SPLIT_SLICE_MIN, SPLIT_PROGRAMS // max(m, 1)))
    slice_k = _pow2(-(-k_padded // slices))
    return (m, -(-k_padded // slice_k)), min(_pow2(k), SPLIT_ROW_BLOCK), slice_k


def empty_activation(quant: str, m_out: int, k_padded: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantizer's outputs for ``m_out`` rows of ``k_padded`` columns, unwritten: e4m3 rows and the
    scales in ``quant``'s layout as the quantizer writes them (ptpc fp32 ``[m_out]``; blockscale fp32
    ``[m_out, k_padded/128]`` M-major, as cuBLAS's blockwise GEMM reads them; mxfp8 uint8 ``[m_out,
    k_padded/32]``)."""
    q = torch.empty(m_out, k_padded, dtype=FP8, device=device)
    if quant == "ptpc":
        return q, torch.empty(m_out, dtype=torch.float32, device=device)
    if quant == "blockscale":
        return q, torch.empty(k_padded // SCALE_BLOCK, m_out, dtype=torch.float32, device=device).t()  # column-major
    return q, torch.empty(m_out, k_padded // MX_GROUP, dtype=torch.uint8, device=device)


def quantize_activation(x: torch.Tensor, quant: str, *, k_padded: int | None = None, m_padded: int | None = None,
                        ptpc_split: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (row stride any, unit column stride) -> ``(q e4m3 [m_padded, k_padded], scale)``
    in the layout of ``quant`` (``cco.quant``) for ``m_padded`` rows, rows past M and columns past K
    zero. ``k_padded`` defaults to K and must be a multiple of 128 (the GEMM's K tile) when it
    differs from K; ``m_padded`` defaults to M. ``ptpc_split``: force (True) or forbid (False) the
    split-row ptpc kernel; None: ``PTPC_SPLIT_MAX_M`` decides."""
    fn = "quantize_activation"
    if quant not in QUANTS:
        raise ValueError(f"{fn}: quant={quant!r} is not supported; pass one of {', '.join(QUANTS)}")
    check_rows(x, fn)
    m, k = x.shape
    k_padded = k if k_padded is None else k_padded
    m_out = m if m_padded is None else m_padded
    if m_out < m:
        raise ValueError(f"{fn}: m_padded={m_padded} must be >= M={m}")
    group = {"ptpc": 1, "blockscale": SCALE_BLOCK, "mxfp8": MX_GROUP}[quant]
    if k_padded < k or k_padded % group or (k_padded != k and k_padded % SCALE_BLOCK):
        raise ValueError(f"{fn}: k_padded={k_padded} must be >= K={k}, a multiple of {group} for {quant}, and of "
                         f"{SCALE_BLOCK} when it pads")
    q, scale = empty_activation(quant, m_out, k_padded, x.device)
    if m_out:
        split = quant == "ptpc" and ((m_out <= PTPC_SPLIT_MAX_M) if ptpc_split is None else ptpc_split)
        # everything Triton specializes this launch on (x's dtype, the integers, the pointers' alignment)
        device = x.get_device()
        key = (quant, split, m, m_out, k, k_padded, x.stride(0), x.dtype, x.data_ptr() % 16, q.data_ptr() % 16,
               scale.data_ptr() % 16, device)
        launch = _LAUNCHES.get(key)
        if launch is None:  # bounded (launch.LAUNCHES_KEPT): a server's every prefill length is a shape
            launch = keep(_LAUNCHES, key, launch_for(quant, split, m_out, k, k_padded))
        kernel, consts = launch
        kernel(device, x, q, scale, m, m_out, k, k_padded, x.stride(0), _TINY, FP8_MAX, *consts)
    return q, scale.view(E8M0) if quant == "mxfp8" else scale


_LAUNCHES: dict = {}  # quantize_activation's kept launches (kernels_fused.hopper.launch), by call shape


def launch_for(quant: str, split: bool, m_out: int, k: int, k_padded: int, *,
               dequantize: bool = False) -> tuple[Kernel, tuple]:
    """The kernel that quantizes ``m_out`` rows as ``quant`` (``split``: ptpc's split-row kernel), with
    its constexprs in the kernel's order (``kernels_fused.hopper.decode`` launches it too).
    ``dequantize`` (mxfp8): the rows are written as bf16, quantized and dequantized
    (``quantize_groups_kernel``'s ``DEQUANTIZE``), and no scales. The split and group kernels' last
    constant, ``ZERO_WORDS``, is 0 here (the decode MMA's caller sets it: ``decode._Launch``)."""
    if dequantize and quant != "mxfp8":
        raise ValueError(f"launch_for: dequantize is mxfp8's (a bf16 GEMM over its rows), not {quant}'s")
    ptpc, groups, split_kernel = _kernels()
    skip = m_out <= SKIP_ZEROS_MAX_M
    if split:
        grid, row_block, slice_k = split_launch(m_out, k, k_padded)
        return Kernel(split_kernel, grid, num_warps=SPLIT_NUM_WARPS), (row_block, slice_k, skip, _interpreting(), 0)
    if quant == "ptpc":
        return (Kernel(ptpc, (-(-m_out // PTPC_BLOCK_M),), num_warps=NUM_WARPS),
                (PTPC_BLOCK_M, PTPC_BLOCK_K, skip, _interpreting()))
    block_m, block_k = group_tile(quant, m_out)
    grid = (-(-m_out // block_m), -(-k_padded // block_k))
    group = SCALE_BLOCK if quant == "blockscale" else MX_GROUP
    return (Kernel(groups, grid, num_warps=NUM_WARPS),
            (quant == "mxfp8", group, block_m, block_k, skip, _interpreting(), dequantize, 0))


def group_tile(quant: str, m_out: int) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_K)`` of the group quantizer's program for ``m_out`` rows of ``quant``.
    BLOCK_K is a whole number of groups of either format: a tile never splits a group."""
    if quant == "blockscale" and m_out <= SKIP_ZEROS_MAX_M:
        return GROUP_BLOCK_M, GROUP_DECODE_BLOCK_K
    return GROUP_BLOCK_M, GROUP_BLOCK_K
