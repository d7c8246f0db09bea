"""Triton fp8 GEMM for NVIDIA Hopper: ``C[M, N] = dequant(A[M, K]) @ dequant(B[N, K]).T`` in bf16.

One kernel, two ways:

* ``fuse=False`` (the ``gemm-only`` mode): a plain GEMM writing a bf16 tensor, tiles walked in
  grouped order for L2 reuse.
* ``fuse=True`` (the fused modes): programs walk the layout's tile table (``cco.layout.tile_table``:
  (chunk, dest, m, n) order, dest rotated by rank), each tile goes to ``partial[dest]`` of the
  window, and after the tile's stores one thread adds to the tile's (dest, chunk) counter with
  release semantics at GPU scope::

      store C tile -> bar.sync (every thread's stores issued) -> atomic_add(counter, weight, release)

  A consumer that sees the counter at its target (a stream wait-value before a copy-engine put)
  sees the whole slice.

Operand tiles arrive through TMA descriptors (``GemmConfig.tma``); how each quant format is applied
(BLOCK_K = 128 everywhere; times are H200, 16384x7168x2048, docs/BENCHMARKS.md):

* ``ptpc``: one fp8 ``tl.dot`` chain, scaled once in the epilogue by ``a_s[m] * b_s[n]``. By default
  the chain accumulates in the tensor cores' fp8 accumulator (cuBLAS ``use_fast_accum=True``);
  ``precise_acc`` promotes into fp32 every K step instead (427 us -> 549 us).
* ``blockscale``: every K step's dot is scaled by ``a_s[m, kb] * b_s[n // 128, kb]`` and added to
  the fp32 accumulator (759 us: the per-step multiply-add serializes the MMA chain).
* ``mxfp8``: Hopper's tensor cores have no block-scaled fp8 MMA. Each K step multiplies the fp8
  tiles by their e8m0 group scales into bf16, which is exact (a 3-bit mantissa times a power of two
  fits bf16's 7 bits; only values below bf16's normal range, 2**-126, would round), and runs a bf16
  MMA with an fp32 accumulator. Cost: the bf16 MMA rate is half the fp8 one, plus the conversions
  and a register-to-shared copy of B every step: 1217 us, 2.9x ptpc. (Four 32-wide fp8 dots per
  step, each scaled into the accumulator, measured 6.1 ms.)

Triton is imported lazily: ``import kernels_fused`` works without it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from cco.quant import MX_GROUP, QUANTS, SCALE_BLOCK
from cco.validate import check_operands

QUANT_ID = {"ptpc": 0, "blockscale": 1, "mxfp8": 2}
COUNTER_DTYPE = torch.int32


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and pipelining of one launch."""

    block_m: int
    block_n: int
    block_k: int = 128
    group_m: int = 8  # tile rows walked together in gemm-only order (L2 reuse of B)
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = True  # operand tiles through TMA descriptors (Hopper's bulk tensor copies)
    # ptpc only. False: Hopper's fp8 wgmma accumulates the whole K chain with its short accumulator
    # mantissa (cuBLAS use_fast_accum=True; relL2 2.0e-3 vs 1.7e-3 at K=2048). True: promote into
    # fp32 every K step (max_num_imprecise_acc=BLOCK_K), measured 29% slower (549 vs 427 us at
    # 16384x7168x2048). blockscale and mxfp8 scale every K step, so they are always promoted.
    precise_acc: bool = False

    def tiles(self, m: int, n: int) -> tuple[int, int]:
        return -(-m // self.block_m), -(-n // self.block_n)


# Hopper defaults, measured on H200 at 16384x7168x2048 (docs/BENCHMARKS.md): ptpc 128x256, 3 stages
# (427 us; 4 stages 433, 256x128 446, pointer loads 432); blockscale adds a second accumulator for the
# per-step partial dot, so 128x128 (759 us; 128x256: 850 us); mxfp8 128x256 (1217 us; 128x128: 1567 us).
_HOPPER = {
    "ptpc": GemmConfig(block_m=128, block_n=256),
    "blockscale": GemmConfig(block_m=128, block_n=128),
    "mxfp8": GemmConfig(block_m=128, block_n=256),
}


def default_config(quant: str, *, interpret: bool = False) -> GemmConfig:
    """The launch config for ``quant``; under ``TRITON_INTERPRET=1`` small tiles keep the CPU run short."""
    if interpret:
        return GemmConfig(block_m=32, block_n=64, num_warps=4, num_stages=1)
    return _HOPPER[quant]


def tile_table_tensor(rows, *, device) -> torch.Tensor:
    """The layout's tile table (``cco.layout.tile_table_rows``: ``[chunk, dest, row0, col0]`` per tile,
    in write order) as the int32 [T, 4] tensor ``fuse=True`` walks."""
    table = torch.tensor(rows, dtype=torch.int32)
    assert table.dim() == 2 and table.shape[1] == 4, "tile table rows must be [chunk, dest, row0, col0]"
    return table.to(device)


def merge_tile_pairs(rows, *, layout_block_n: int) -> list[list[int]]:
    """Layout tile rows ``[chunk, dest, row0, col0]`` -> rows of a kernel tile twice as wide.

    The layout walks n innermost, so the partner of a tile at an even n-tile index is the next row;
    the merged tile keeps the pair's position in the order and counts for both (``tile_weight=2``)."""
    merged = []
    for i in range(0, len(rows), 2):
        first, second = rows[i], rows[i + 1]
        assert first[:3] == second[:3] and second[3] == first[3] + layout_block_n, "tiles do not pair up"
        assert (first[3] // layout_block_n) % 2 == 0, "pairs must start on an even n-tile"
        merged.append(list(first))
    return merged


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _fp8_gemm(
        # operands (TMA descriptors or raw pointers, see USE_TMA) ------------------------------------
        a_src, b_src, c_ptr, as_ptr, bs_ptr,
        # fused epilogue -----------------------------------------------------------------------------
        tile_ptr, counter_ptr,
        # shape and strides -------------------------------------------------------------------------
        M, N, K, stride_am, stride_bn, stride_cm, n_slice, dest_stride,
        stride_asm, stride_ask, stride_bsn, stride_bsk,
        # compile-time -------------------------------------------------------------------------------
        QUANT: tl.constexpr, FUSE: tl.constexpr, USE_TMA: tl.constexpr, MX_BF16: tl.constexpr,
        PRECISE_ACC: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        SCALE_BLOCK: tl.constexpr, MX_GROUP: tl.constexpr, MAX_CHUNKS: tl.constexpr, TILE_WEIGHT: tl.constexpr,
    ):
        pid = tl.program_id(0)
        if FUSE:
            # one row of the layout's tile table: (chunk, dest, row0, col0 within dest's column slice)
            chunk = tl.load(tile_ptr + pid * 4)
            dest = tl.load(tile_ptr + pid * 4 + 1)
            m0 = tl.load(tile_ptr + pid * 4 + 2)
            c0 = tl.load(tile_ptr + pid * 4 + 3)
            n0 = dest * n_slice + c0
            c_ptr += dest.to(tl.int64) * dest_stride  # partial[dest] is [rows, n_slice]
        else:
            tiles_m = tl.cdiv(M, BLOCK_M)
            tiles_n = tl.cdiv(N, BLOCK_N)
            per_group = GROUP_M * tiles_n
            first_m = (pid // per_group) * GROUP_M
            rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
            m0 = (first_m + (pid % per_group) % rows_in_group) * BLOCK_M
            n0 = ((pid % per_group) // rows_in_group) * BLOCK_N
            c0 = n0
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < M
        mask_n = offs_n < N
        # clamp instead of masking: rows past M / N only feed stores that are masked
        rows_a = tl.where(mask_m, offs_m, 0)
        rows_b = tl.where(mask_n, offs_n, 0)
        GROUPS: tl.constexpr = BLOCK_K // MX_GROUP

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k0 = kb * BLOCK_K
            if USE_TMA:
                a = a_src.load([m0, k0])  # [BLOCK_M, BLOCK_K], rows past M read as zeros
                b = b_src.load([n0, k0])  # [BLOCK_N, BLOCK_K], K-major as fp8 wgmma wants
            else:
                a = tl.load(a_src + rows_a[:, None] * stride_am + (k0 + offs_k)[None, :])
                b = tl.load(b_src + rows_b[:, None] * stride_bn + (k0 + offs_k)[None, :])
            if QUANT == 0:
                if PRECISE_ACC:  # promote the MMA chain into fp32 once per K step (slower, see GemmConfig)
                    acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
                else:
                    acc = tl.dot(a, tl.trans(b), acc)
            elif QUANT == 1:
                sa = tl.load(as_ptr + rows_a * stride_asm + kb * stride_ask)
                sb = tl.load(bs_ptr + (rows_b // SCALE_BLOCK) * stride_bsn + kb * stride_bsk)
                acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
            else:
                # no block-scaled fp8 MMA on Hopper: scale each 32-wide group into bf16 (exact: 3-bit
                # mantissa times a power of two) and run a bf16 MMA at half the fp8 rate
                groups = kb * GROUPS + tl.arange(0, GROUPS)
                ea = tl.load(as_ptr + rows_a[:, None] * stride_asm + groups[None, :] * stride_ask)
                eb = tl.load(bs_ptr + rows_b[:, None] * stride_bsn + groups[None, :] * stride_bsk)
                # e8m0 bits -> 2**(bits - 127) built exactly in the fp32 exponent field
                sa = (ea.to(tl.int32) << 23).to(tl.float32, bitcast=True)
                sb = (eb.to(tl.int32) << 23).to(tl.float32, bitcast=True)
                a3 = tl.reshape(a.to(tl.float32), (BLOCK_M, GROUPS, MX_GROUP)) * sa[:, :, None]
                b3 = tl.reshape(b.to(tl.float32), (BLOCK_N, GROUPS, MX_GROUP)) * sb[:, :, None]
                if MX_BF16:
                    a_bf = tl.reshape(a3, (BLOCK_M, BLOCK_K)).to(tl.bfloat16)
                    b_bf = tl.reshape(b3, (BLOCK_N, BLOCK_K)).to(tl.bfloat16)
                    acc = tl.dot(a_bf, tl.trans(b_bf), acc)
                else:  # Triton's CPU interpreter multiplies bf16 tiles as raw integers: fp32 there
                    a_f = tl.reshape(a3, (BLOCK_M, BLOCK_K))
                    b_f = tl.reshape(b3, (BLOCK_N, BLOCK_K))
                    acc = tl.dot(a_f, tl.trans(b_f), acc, input_precision="ieee")

        if QUANT == 0:
            sa = tl.load(as_ptr + rows_a * stride_asm)
            sb = tl.load(bs_ptr + rows_b * stride_bsn)
            acc = acc * (sa[:, None] * sb[None, :])

        offs_c = c0 + tl.arange(0, BLOCK_N)
        c_tile = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_c[None, :]
        tl.store(c_tile, acc.to(tl.bfloat16), mask=mask_m[:, None] & mask_n[None, :])
        if FUSE:
            tl.debug_barrier()  # every thread's tile stores are issued before the release below
            tl.atomic_add(counter_ptr + dest * MAX_CHUNKS + chunk, TILE_WEIGHT, sem="release", scope="gpu")

    return _fp8_gemm


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fp8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    quant: str,
    out: torch.Tensor | None = None,
    fuse: bool = False,
    tile_table: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    tile_weight: int = 1,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """``dequant(a) @ dequant(b).T`` in bf16, on the current CUDA stream.

    ``b`` is the weight [N, K] in plain row-major order (not the gfx950 bpreshuffle layout; undo it
    once at load time with ``cco.preshuffle.unshuffle_b``).

    * ``fuse=False``: writes ``out`` [M, N] (allocated when None) and returns it.
    * ``fuse=True``: ``out`` is the window's partial region [W, rows, N/W] (dest-major: partial[d]
      holds the columns rank d owns); ``tile_table`` is int32 [T, 4] from :func:`tile_table_tensor`
      and must cover every tile of the call once; ``counters`` is the window's int64
      [W * MAX_CHUNKS] counter region. Each program adds ``tile_weight`` to ``counters[dest, chunk]``
      after its tile is stored: 1 when ``config`` has the layout's tile, 2 when the kernel's tile is
      two layout tiles wide (the table then lists every other layout tile; see
      :func:`merge_tile_pairs`).
    """
    from cco.layout import MAX_CHUNKS

    fn = "fp8_gemm"
    shape = check_operands(a, b, a_scale, b_scale, quant=quant, fn=fn)
    m, n, k = shape.m, shape.n, shape.k
    cfg = config or default_config(quant, interpret=_interpreting())
    if fuse:
        if out is None or tile_table is None or counters is None:
            raise ValueError(f"{fn}: fuse=True needs out (the partial region), tile_table and counters")
        world = out.shape[0] if out.dim() == 3 else 0
        if out.dtype != torch.bfloat16 or world < 1 or out.shape[2] * world != n or out.shape[1] < m \
                or not out.is_contiguous():
            raise ValueError(
                f"{fn}: with fuse=True, out must be the contiguous bf16 partial region [W, rows >= {m}, "
                f"N/W] with W * N/W = {n}, got {out.dtype} {list(out.shape)}"
            )
        if tile_table.dtype != torch.int32 or tile_table.dim() != 2 or tile_table.shape[1] != 4:
            raise ValueError(f"{fn}: tile_table must be int32 [T, 4], got {tile_table.dtype} {list(tile_table.shape)}")
        if counters.dtype != torch.int64 or counters.numel() < world * MAX_CHUNKS:
            raise TypeError(f"{fn}: counters must be int64 with >= {world * MAX_CHUNKS} entries, got "
                            f"{counters.dtype} with {counters.numel()}")
        if out.shape[2] % cfg.block_n:
            raise ValueError(f"{fn}: block_n={cfg.block_n} must divide the column slice N/W={out.shape[2]}")
        grid = tile_table.shape[0]
        n_slice, dest_stride, stride_c = out.shape[2], out.stride(0), out.stride(1)
    else:
        if out is None:
            out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
        elif out.dtype != torch.bfloat16 or tuple(out.shape) != (m, n) or out.stride(1) != 1:
            raise ValueError(
                f"{fn}: out must be a bf16 [M={m}, N={n}] tensor with unit column stride, got "
                f"{out.dtype} {list(out.shape)} stride {out.stride()}; pass out=None to allocate one"
            )
        tiles_m, tiles_n = cfg.tiles(m, n)
        grid = tiles_m * tiles_n
        n_slice, dest_stride, stride_c = n, 0, out.stride(0)
        tile_table = counters = b  # never read when FUSE is off; any pointer will do

    if quant == "mxfp8":
        a_scale = a_scale.view(torch.uint8)
        b_scale = b_scale.view(torch.uint8)
    a_s_strides = (a_scale.stride(0), a_scale.stride(1) if a_scale.dim() == 2 else 0)
    b_s_strides = (b_scale.stride(0), b_scale.stride(1) if b_scale.dim() == 2 else 0)
    if cfg.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_src = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
        b_src = TensorDescriptor.from_tensor(b, [cfg.block_n, cfg.block_k])
    else:
        a_src, b_src = a, b
    _kernel()[(grid,)](
        a_src, b_src, out, a_scale, b_scale, tile_table, counters,
        m, n, k, a.stride(0), b.stride(0), stride_c, n_slice, dest_stride,
        *a_s_strides, *b_s_strides,
        QUANT=QUANT_ID[quant], FUSE=bool(fuse), USE_TMA=cfg.tma, MX_BF16=not _interpreting(),
        PRECISE_ACC=cfg.precise_acc,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        SCALE_BLOCK=SCALE_BLOCK, MX_GROUP=MX_GROUP, MAX_CHUNKS=MAX_CHUNKS, TILE_WEIGHT=int(tile_weight),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


__all__ = ["GemmConfig", "QUANTS", "default_config", "fp8_gemm", "merge_tile_pairs", "tile_table_tensor"]
