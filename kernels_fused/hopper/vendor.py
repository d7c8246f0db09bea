"""The vendor GEMM on Hopper: cuBLAS through torch, for every quant, whole or one call per row chunk.

Unfused equivalent: ``cco.quant.reference_gemm(a, b, a_scale, b_scale, quant)`` rounded to bf16.

* ``ptpc``: ``torch._scaled_mm`` with row-wise scales (A's as [M, 1], B's as [1, N]); fast
  accumulation unless asked for the precise one (the Triton kernel accumulates the same way by
  default: ``GemmConfig.precise_acc``).
* ``blockscale``: cuBLAS's blockwise recipe: A scaled per row and 128 columns ([M, K/128] M-major,
  as ``cco.quant`` keeps it), B per 128x128 block ([N/128, K/128], passed as the transpose the
  recipe reads for its [K, N] operand). torch wants the A scale's column stride to be the call's
  own row count, so calls on row chunks of a larger A read a packed copy of the scales: one gather
  per call for every chunk (:func:`chunk_scales`).
* ``mxfp8``: cuBLAS on Hopper has no e8m0 block scaling. Both operands are dequantized exactly to
  bf16 (:func:`mx_to_bf16`, why exact: ``kernels_fused.hopper.gemm``) and cuBLAS's bf16 GEMM runs
  on them. The weight's bf16 copy is made once per weight (:func:`prepare_weight`), so a call
  dequantizes only A.

:func:`prepare_weight` turns a weight into what every call passes; :func:`vendor_gemm` runs the whole
product; :func:`row_chunks` returns the chunk-granular producer of the fused copy-engine path
(``cco.backends.cuda``): call ``c`` computes rows ``rows[c]`` of the product, every column, into the
same rows of ``out``. Triton is imported only for mxfp8's dequantization.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from cco.quant import MX_GROUP
from kernels_fused.hopper.launch import Kernel, keep

PACK_INDEX_CACHE = 16  # blockscale scale-packing indices kept, one per (M, chunk rows)
# cuBLAS's blockwise recipe refused calls on M = 1, 2, 6, 66, 129 and 130 rows (CUBLAS_STATUS_NOT_SUPPORTED
# from its heuristic query; torch 2.11 + CUDA 13 on H200, 2026-12-02) and ran M = 4, 8, 12, 36, 68, 100,
# 132, 260, 1000 and 4096 correctly: it takes row counts that keep the M-major A scale's columns 16-byte
# aligned (M % 4 == 0; tests/python/cco/test_cuda_op.py checks this on every GPU run)
BLOCKWISE_ROW_MULTIPLE = 4
# cuBLAS's row-wise scaled fp8 GEMM (ptpc) refused an A scale vector that starts 12 bytes into its
# allocation (CUBLAS_STATUS_NOT_SUPPORTED; the reduce-scatter along rows at M = 6, world 2: the second
# rank's three rows, H200, 2026-12-03): a caller passing a slice of the scales copies it when its
# address is not a multiple of this
SCALE_ALIGNMENT = 16
# cuBLAS's blockwise recipe returned 74% of the sampled elements outside the fp8 budget at K = 2304 (18
# scale columns: N = 7168, M = 4096, whole and row-chunk calls alike; the own kernel's reference agreed
# with the other quants at that shape) and was right at K = 3584, 4608, 7168, 8192, 9216 and 14336 (28 to
# 112 scale columns; scripts/bench_sp_parts.py, H200, torch 2.11 + CUDA 13, 2026-12-03). The B scale
# reaches it as the transpose of the [N/128, K/128] scales, whose column stride K/128 is 16-byte aligned
# only for a multiple of 4 scale columns, like the A scale's row rule above. Until that cause is shown,
# such a K takes the own kernel (test_cuda_op.py records what cuBLAS returns there on every GPU run)
BLOCKWISE_KBLOCK_MULTIPLE = 4


def takes_rows(quant: str, rows, k: int) -> bool:
    """Whether the vendor GEMM of ``quant`` runs calls on each of ``rows`` (a row count, or the
    ``(r0, r1)`` ranges of :func:`row_chunks`) of a product over ``k`` columns; where it does not,
    the own kernel runs instead (``kernels_fused.hopper.gemm.default_config``, ``cco.backends.cuda``)."""
    if quant != "blockscale":
        return True
    if -(-k // 128) % BLOCKWISE_KBLOCK_MULTIPLE:
        return False
    counts = [rows] if isinstance(rows, int) else [r1 - r0 for r0, r1 in rows]
    return all(n % BLOCKWISE_ROW_MULTIPLE == 0 for n in counts)


def padded_rows(quant: str, m: int) -> int:
    """The rows a vendor GEMM of ``quant`` is called on for ``m`` rows of a product: blockscale's
    ``m`` rounded up to ``BLOCKWISE_ROW_MULTIPLE`` (the caller writes the extra rows as zeros and
    drops their output rows), every other quant's ``m``."""
    if quant != "blockscale":
        return m
    return -(-m // BLOCKWISE_ROW_MULTIPLE) * BLOCKWISE_ROW_MULTIPLE


def mx_to_bf16(x: torch.Tensor, scale: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """An mxfp8 operand ``x`` (e4m3 [R, K]) times its e8m0 group scales ([R, K/32]) as bf16 [R, K]:
    exact for every value at or above bf16's normal range (``kernels_fused.hopper.gemm``). One pass,
    into ``out`` (contiguous bf16 [R, K]) where given."""
    from kernels_fused.hopper import kernels as tk

    rows, k = x.shape
    if scale.shape != (rows, k // MX_GROUP):
        raise ValueError(f"mx_to_bf16: scale must be [{rows}, {k // MX_GROUP}] for x [{rows}, {k}], "
                         f"got {list(scale.shape)}")
    if out is not None and (out.shape != (rows, k) or out.dtype != torch.bfloat16 or not out.is_contiguous()):
        raise ValueError(f"mx_to_bf16: out must be a contiguous bf16 [{rows}, {k}] tensor, got {out.dtype} "
                         f"{list(out.shape)}")
    x, bits = x.contiguous(), scale.contiguous().view(torch.uint8)
    y = torch.empty(rows, k, dtype=torch.bfloat16, device=x.device) if out is None else out
    groups, device = x.numel() // MX_GROUP, x.get_device()
    if groups:
        # kept per what Triton specializes on (the group count's value, the pointers' alignment) and the
        # device: an eager decode call of mxfp8 pays a kept launch, not JITFunction.run (docs/decode.md)
        key = (groups, x.data_ptr() % 16, bits.data_ptr() % 16, y.data_ptr() % 16, device)
        launch = _MX_LAUNCHES.get(key)
        if launch is None:
            launch = keep(_MX_LAUNCHES, key, Kernel(tk.mx_to_bf16_kernel, (-(-groups // MX_BLOCK),)))
        launch(device, x, bits, y, groups, MX_GROUP, MX_BLOCK)
    return y


MX_BLOCK = 64  # groups per program of mx_to_bf16
_MX_LAUNCHES: dict = {}  # mx_to_bf16's kept launches (kernels_fused.hopper.launch), by call shape


@dataclass(frozen=True)
class VendorWeight:
    """A weight as every vendor call passes it, prepared once (:func:`prepare_weight`)."""

    quant: str
    b_t: torch.Tensor  # [K, N] column-major: the e4m3 weight transposed (a view), mxfp8's bf16 copy
    scale_b: torch.Tensor | None  # ptpc [1, N]; blockscale [K/128, N/128] (a view); mxfp8 None
    dense: torch.Tensor | None = None  # mxfp8: the bf16 copy [N, K] row-major (b_t is its transpose)


def prepare_weight(b: torch.Tensor, b_scale: torch.Tensor, quant: str, *,
                   into: VendorWeight | None = None) -> VendorWeight:
    """``b`` is the row-major weight [N, K] (not preshuffled) and ``b_scale`` its scales in
    ``quant``'s layout (``cco.quant``); mxfp8 dequantizes here, the others take views. ``into``: an
    earlier value for this weight, brought up to date in place where it is mxfp8's copy (its
    tensors stay the ones a CUDA graph may have captured), else replaced by views of ``b``."""
    if quant == "mxfp8":
        if into is not None and into.dense is not None and into.dense.shape == b.shape:
            mx_to_bf16(b, b_scale, out=into.dense)
            return into
        dense = mx_to_bf16(b, b_scale)
        return VendorWeight(quant, dense.t(), None, dense)
    if quant == "ptpc":
        return VendorWeight(quant, b.t(), b_scale.reshape(1, -1))
    if quant == "blockscale":
        return VendorWeight(quant, b.t(), b_scale.t())
    raise ValueError(f"prepare_weight: quant={quant!r} has no vendor GEMM; pass ptpc, blockscale or mxfp8")


def vendor_gemm(a: torch.Tensor, a_scale: torch.Tensor, weight: VendorWeight, *, out: torch.Tensor | None = None,
                fast_accum: bool = True) -> torch.Tensor:
    """``out[M, N] = dequant(a) @ dequant(b).T`` in bf16 through cuBLAS, on the current stream; returns
    ``out`` (contiguous bf16 [M, N]; None: cuBLAS's call allocates it). ``fast_accum``: ptpc's
    accumulation (the others ignore it). blockscale needs :func:`takes_rows`."""
    return bound_gemm(weight, fast_accum=fast_accum)(a, a_scale, out)


def bound_gemm(weight: VendorWeight, *, fast_accum: bool = True) -> Callable:
    """``fn(a, a_scale, out=None)``: :func:`vendor_gemm` with ``weight`` and ``fast_accum`` bound, so a
    caller that keeps it pays no per-call lookups (an eager call's host time)."""
    b_t, scale_b = weight.b_t, weight.scale_b
    if weight.quant == "mxfp8":
        def mxfp8(a, a_scale, out=None):
            return torch.matmul(mx_to_bf16(a, a_scale), b_t, out=out)
        return mxfp8
    if weight.quant == "ptpc":
        def ptpc(a, a_scale, out=None):
            return torch._scaled_mm(a, b_t, scale_a=a_scale.reshape(-1, 1), scale_b=scale_b, out_dtype=torch.bfloat16,
                                    use_fast_accum=fast_accum, out=out)
        return ptpc

    def blockscale(a, a_scale, out=None):
        return torch._scaled_mm(a, b_t, scale_a=a_scale, scale_b=scale_b, out_dtype=torch.bfloat16, out=out)
    return blockscale


def row_chunks(a: torch.Tensor, a_scale: torch.Tensor, weight: VendorWeight, *, out: torch.Tensor,
               rows, fast_accum: bool = True) -> Callable[[int], None]:
    """``fn(c)``: rows ``rows[c] = (r0, r1)`` of the product, every column, into ``out[r0:r1]`` (one
    cuBLAS call on the current stream). ``rows`` tile ``[0, M)`` in order (``cco.layout.chunk_rows``);
    ``out`` has at least M contiguous bf16 rows of N. What all chunks share (mxfp8's dequantized A,
    blockscale's packed scales) is made here, once per call."""
    if weight.quant == "mxfp8":
        a_bf16 = mx_to_bf16(a, a_scale)

        def mxfp8_rows(c):
            r0, r1 = rows[c]
            torch.matmul(a_bf16[r0:r1], weight.b_t, out=out[r0:r1])
        return mxfp8_rows
    if weight.quant == "ptpc":
        scale = a_scale.reshape(-1, 1)

        def ptpc_rows(c):
            r0, r1 = rows[c]
            torch._scaled_mm(a[r0:r1], weight.b_t, scale_a=scale[r0:r1], scale_b=weight.scale_b,
                             out_dtype=torch.bfloat16, use_fast_accum=fast_accum, out=out[r0:r1])
        return ptpc_rows
    scales = chunk_scales(a_scale, rows)

    def blockscale_rows(c):
        r0, r1 = rows[c]
        torch._scaled_mm(a[r0:r1], weight.b_t, scale_a=scales[c], scale_b=weight.scale_b,
                         out_dtype=torch.bfloat16, out=out[r0:r1])
    return blockscale_rows


def chunk_scales(a_scale: torch.Tensor, rows) -> list[torch.Tensor]:
    """blockscale: per chunk ``(r0, r1)`` of ``rows``, the A scales of its rows as the blockwise
    recipe takes them: [r1 - r0, K/128] with strides (1, r1 - r0). The M-major [M, K/128] scale of
    the whole A has column stride M, so the chunks' scales are gathered into one packed buffer
    (chunk c's block at r0 * K/128, itself M-major) by one index_select."""
    m, kb = a_scale.shape
    if len(rows) == 1:
        return [a_scale]
    packed = torch.index_select(a_scale.t().reshape(-1), 0, _pack_index(m, kb, tuple(rows), a_scale.device))
    return [packed[r0 * kb:r1 * kb].view(kb, r1 - r0).t() for r0, r1 in rows]


def _pack_index(m: int, kb: int, rows: tuple, device: torch.device) -> torch.Tensor:
    """Source positions (in the [K/128, M] row-major storage of an M-major scale) of the packed
    chunk scales. Built with device kernels and kept, except while a graph is being captured: the
    capture only records the kernels, so the tensor would hold its values only after a replay."""
    key = (m, kb, rows, str(device))
    index = _PACK_INDEX.get(key)
    if index is None:
        index = torch.cat([(torch.arange(kb, device=device)[:, None] * m
                            + torch.arange(r0, r1, device=device)[None, :]).reshape(-1) for r0, r1 in rows])
        if not (index.is_cuda and torch.cuda.is_current_stream_capturing()):
            _PACK_INDEX[key] = index
            while len(_PACK_INDEX) > PACK_INDEX_CACHE:
                _PACK_INDEX.pop(next(iter(_PACK_INDEX)))
    return index


_PACK_INDEX: dict = {}


__all__ = ["BLOCKWISE_KBLOCK_MULTIPLE", "BLOCKWISE_ROW_MULTIPLE", "VendorWeight", "chunk_scales", "mx_to_bf16",
           "padded_rows", "prepare_weight", "row_chunks", "takes_rows", "vendor_gemm"]
