"""CPU reference tile kernel: the fused kernel's tile walk and epilogue protocol, computed with torch.

For each tile of ``plan.tiles`` (the layout's (chunk, dest, m, n) walk, identical to the GPU
kernels'):

1. ``C[rows, cols] = dequant(A)[rows] @ dequant(B)[cols].T`` in fp32, rounded to bf16;
2. store the tile into ``destination(dest)`` (the own window's ``partial[dest]``, or for ``lsa`` the
   owner's ``recv[rank]``);
3. ``counters[dest, chunk] += 1`` after the store (the GPU epilogue's ``s_waitcnt vmcnt(0);
   s_barrier`` then one acq_rel atomic add); the tile that brings the counter to its target calls
   ``on_chunk_complete(dest, chunk)``.

Unfused equivalent: ``reference_gemm(a, unshuffle_b(b_pre), a_scale, b_scale, quant)``; the tiles
use the same fp32 math, so results differ from it only by summation order inside fp32.

``run_chunks`` is the other producer the protocol allows (the CUDA backend's vendor GEMM, one call
per chunk of rows): each chunk's rows of the whole product, every column, stored into the partial
region read row-major (``cco.layout.partial_strides``), then every (dest, chunk) counter of the chunk
raised by the tiles its slot holds.
"""

from __future__ import annotations

from typing import Callable

import torch

from cco import layout
from cco.preshuffle import unshuffle_b
from cco.quant import dequantize_a, dequantize_b


def dequantized_operands(a, b_pre, a_scale, b_scale, quant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``A [M, K]`` and ``B [N, K]`` (B un-preshuffled). Recomputed every call: operands may
    change between calls while keeping their storage."""
    return dequantize_a(a, a_scale, quant), dequantize_b(unshuffle_b(b_pre), b_scale, quant)


def run_tiles(a_f32: torch.Tensor, b_f32: torch.Tensor, *, config: layout.OpConfig, plan: layout.CallPlan,
              destination: Callable[[int], torch.Tensor], counters: torch.Tensor | None = None,
              on_chunk_complete: Callable[[int, int], None] | None = None) -> None:
    """Compute every tile of ``plan`` in walk order and run the epilogue protocol.

    ``destination(dest)`` is a ``[rows >= slice rows, n_slice]`` bf16 view receiving dest's slice;
    ``counters`` the own window's flat int64 counter words (None: a plain GEMM, no protocol)."""
    bm, bn = config.block_m, config.block_n
    for tile in plan.tiles:
        r0, r1 = tile.row0, min(tile.row0 + bm, plan.slice_m)
        row, col = plan.origins[tile.dest]  # where dest's slice starts in the [M, N] product
        c = a_f32[row + r0:row + r1] @ b_f32[col + tile.col0: col + tile.col0 + bn].t()
        destination(tile.dest)[r0:r1, tile.col0: tile.col0 + bn] = c.to(torch.bfloat16)
        if counters is None:
            continue
        index = layout.counter_index(tile.dest, tile.chunk)
        value = int(counters[index]) + 1  # single producer per rank: a plain add is atomic here
        counters[index] = value
        if value == plan.target(tile.dest, tile.chunk) and on_chunk_complete is not None and tile.dest != plan.rank:
            on_chunk_complete(tile.dest, tile.chunk)


def run_chunks(a_f32: torch.Tensor, b_f32: torch.Tensor, *, config: layout.OpConfig, plan: layout.CallPlan,
               partial_rows: torch.Tensor, counters: torch.Tensor,
               on_chunk_complete: Callable[[int, int], None] | None = None) -> None:
    """The producer of whole chunks: for each chunk in order, ``C[rows] = A[rows] @ B.T`` (fp32,
    rounded to bf16) into ``partial_rows`` (``[rows >= M, N]``), then, in dest order (own slice
    last), ``counters[dest, chunk] += plan.slot_tiles(dest, chunk)``: the counter goes straight to
    its target, after every row of the slot is stored, and ``on_chunk_complete(dest, chunk)`` runs
    for each peer dest."""
    for chunk, (r0, r1) in enumerate(plan.rows):
        partial_rows[r0:r1] = (a_f32[r0:r1] @ b_f32.t()).to(torch.bfloat16)
        for dest in layout.dest_order(plan.rank, config.world):
            index = layout.counter_index(dest, chunk)
            counters[index] = int(counters[index]) + plan.slot_tiles(dest, chunk)  # single producer per rank
            if dest != plan.rank and on_chunk_complete is not None:
                on_chunk_complete(dest, chunk)


def run_arriving_tiles(rows_of: Callable[[int, int], torch.Tensor], b_f32: torch.Tensor, *, config: layout.OpConfig,
                       plan: layout.CallPlan, out: torch.Tensor) -> None:
    """The all-gather's GEMM: every tile of ``plan`` in walk order (the own rows first, then each
    peer's chunk as it lands), ``out[src rows] = rows @ B.T`` (fp32, rounded to bf16).
    ``rows_of(src, chunk)`` returns the fp32 rows ``[r0, r1)`` of that chunk of src's input once they
    are there (it waits for their arrival flag); it is asked once per (src, chunk), when the walk
    reaches it."""
    bm, bn = config.block_m, config.block_n
    current, a_f32 = None, None
    for tile in plan.tiles:
        if (tile.dest, tile.chunk) != current:
            current = (tile.dest, tile.chunk)
            a_f32 = rows_of(tile.dest, tile.chunk)
            chunk_r0 = plan.rows[tile.chunk][0]
        r0, r1 = tile.row0, min(tile.row0 + bm, plan.slice_m)
        row = plan.origins[tile.dest][0]
        c = a_f32[r0 - chunk_r0:r1 - chunk_r0] @ b_f32[tile.col0:tile.col0 + bn].t()
        out[row + r0:row + r1, tile.col0:tile.col0 + bn] = c.to(torch.bfloat16)
