"""The 16x16 "bpreshuffle" weight layout of the 8-wave fp8 GEMM, and its inverse.

For each 16-row group of B [N, K] and each 32-byte K chunk, the chunk is stored as two blocks of
16 rows x 16 bytes, one after the other (the half K chunk 0..15 first, then 16..31)::

    B[n, k] lives at  ((n // 16) * (K // 32) + k // 32) * 512       # 16-row group, K chunk
                      + ((k % 32) // 16) * 256                      # which 16-byte half
                      + (n % 16) * 16 + k % 16                      # row in the block, byte

so one 64-lane ``buffer_load_dwordx4`` reads a whole 16x16 block, each lane 16 contiguous bytes of one row,
which is the operand order of a 16x16x128 MFMA without any LDS transpose.
"""

from __future__ import annotations

import torch

ROWS = 16  # rows of one block (the MFMA's N)
BYTES = 16  # bytes of one row in one block (one dwordx4)
K_CHUNK = 2 * BYTES  # two blocks per 32-wide K chunk
# The bytes of the two layouts cannot be told apart, so the functions that make a weight in one
# layout leave its name on the tensor object (``preshuffle_b``: "bpreshuffle"; ``unshuffle_b`` and
# ``cco.quant.quantize_b``: "row-major"), and the op refuses a marked weight of the other layout. A
# tensor made any other way (``.to(device)``, loaded from disk) carries no mark and cannot be checked.
LAYOUT_MARK = "_cco_weight_layout"


def mark_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t``, marked as a weight in ``layout`` ("bpreshuffle" or "row-major")."""
    setattr(t, LAYOUT_MARK, layout)
    return t


def _check(b: torch.Tensor, fn: str) -> None:
    if b.dim() != 2:
        raise ValueError(f"{fn}: expects a 2-D [N, K] tensor, got shape {tuple(b.shape)}")
    if b.element_size() != 1:
        raise TypeError(f"{fn}: expects a 1-byte dtype (float8_e4m3fn), got {b.dtype}")
    n, k = b.shape
    if n % ROWS or k % K_CHUNK:
        raise ValueError(
            f"{fn}: shape {tuple(b.shape)} is not tileable; N must be a multiple of {ROWS} "
            f"and K a multiple of {K_CHUNK}"
        )


def preshuffle_b(b: torch.Tensor) -> torch.Tensor:
    """[N, K] row-major -> [N, K] tensor whose memory is in the bpreshuffle order."""
    _check(b, "preshuffle_b")
    n, k = b.shape
    blocks = b.reshape(n // ROWS, ROWS, k // K_CHUNK, 2, BYTES)
    return mark_layout(blocks.permute(0, 2, 3, 1, 4).contiguous().view(n, k), "bpreshuffle")


def unshuffle_b(b_pre: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`preshuffle_b`; into ``out`` (contiguous, ``b_pre``'s shape and dtype) where
    given: a kept row-major copy that a CUDA graph may read stays the same tensor when its weight
    is written (``cco.backends.cuda``)."""
    _check(b_pre, "unshuffle_b")
    n, k = b_pre.shape
    rows = b_pre.contiguous().view(n // ROWS, k // K_CHUNK, 2, ROWS, BYTES).permute(0, 3, 1, 2, 4)
    if out is None:
        return mark_layout(rows.contiguous().view(n, k), "row-major")
    if out.shape != b_pre.shape or out.dtype != b_pre.dtype or not out.is_contiguous():
        raise ValueError(f"unshuffle_b: out must be a contiguous {b_pre.dtype} {list(b_pre.shape)} tensor, got "
                         f"{out.dtype} {list(out.shape)} stride {out.stride()}")
    out.view(n // ROWS, ROWS, k // K_CHUNK, 2, BYTES).copy_(rows)
    return mark_layout(out, "row-major")
