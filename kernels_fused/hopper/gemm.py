"""Triton fp8 GEMM for NVIDIA Hopper: ``C[M, N] = dequant(A[M, K]) @ dequant(B[N, K]).T`` in bf16.

Host side here, device code in ``kernels_fused.hopper.kernels``: one K loop (``_tile_acc``) shared
by three kernels. ``fp8_gemm`` (below) runs the plain and the tile-table ones; ``fp8_gemm_lsa`` runs
the ``lsa`` transport's whole fused all-reduce in one launch (its docstring has the protocol).

* ``fuse=False`` (the ``gemm-only`` mode): a plain GEMM writing a bf16 tensor. ``PLAIN_RULE`` picks
  per quant and M between the vendor GEMM (``launch="cublas"``, ``kernels_fused.hopper.vendor``),
  which it takes everywhere it was measured on H200, and the own kernels (``TRITON_PLAIN``): tiles
  walked in grouped order for L2 reuse, for ptpc by persistent warp-specialized programs with TMA
  stores (``"ws"``: 0.94x of cuBLAS with fast accumulation, where one program per tile, ``"grid"``,
  reached 0.84x), for blockscale and mxfp8 by one program per tile (there ``"ws"`` measured
  slower).
* ``fuse=True`` (the fused modes): programs walk a tile table (``cco.layout.tile_table``: the
  layout's tiles, every peer's before the own ones on CUDA), each tile goes to ``partial[dest]`` of the
  window, and after the tile's stores one thread adds to the tile's (dest, chunk) counter with
  release semantics at GPU scope::

      store C tile -> bar.sync (every thread's stores issued) -> atomic_add(counter, weight, release)

  A consumer that sees the counter at its target (a stream wait-value before a copy-engine put)
  sees the whole slice. With a :class:`ReduceEpilogue` an own tile is not stored: it waits for the
  peers' copies of its chunk, adds them and writes ``out`` and the gather buffer, then adds to its
  counter (programs claim tiles from a ticket, so the waits cannot deadlock).

Operand tiles arrive through TMA descriptors (``GemmConfig.tma``); how each quant format is applied
(BLOCK_K = 128 everywhere; times are H200, 16384x7168x2048, docs/BENCHMARKS.md):

* ``ptpc``: one fp8 ``tl.dot`` chain, scaled once in the epilogue by ``a_s[m] * b_s[n]``. By default
  the chain accumulates in the tensor cores' fp8 accumulator (cuBLAS ``use_fast_accum=True``);
  ``precise_acc`` promotes into fp32 every K step instead (427 us -> 549 us).
* ``blockscale``: every K step's dot is scaled by ``a_s[m, kb] * b_s[n // 128, kb]`` and added to
  the fp32 accumulator. Triton waits for each such dot before the multiply-add (a dot runs
  asynchronously only when its result feeds the next dot), so within a program the tensor cores
  idle while the add runs; small programs (64x128 tiles, one warp group, three per SM) let one
  program's MMAs run beside another's adds: 581 us against 752 us for 128x128 tiles of two warp
  groups (one per SM), 0.68x of cuBLAS's blockwise ``_scaled_mm`` (392 us); the fused launch 601
  against 824 us.
* ``mxfp8``: Hopper's tensor cores have no block-scaled fp8 MMA. Both operands are dequantized
  into bf16 first (``mx_to_bf16``: one pass, 31 us for A at 16384x2048), which is exact (a 3-bit
  mantissa times a power of two fits bf16's 7 bits; only values below bf16's normal range, 2**-126,
  would round), and the products of bf16 values are exact in the fp32 accumulator, so any bf16 GEMM
  with fp32 accumulation computes the same function. The plain GEMM then is cuBLAS's bf16 GEMM
  (``launch="cublas"``; its MMAs accumulate in fp32, though torch lets cuBLAS add split-K partials
  in bf16 unless ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction`` is False; the
  GEMM's error budget is checked either way): 629 us, both dequantizations included, where scaling
  the fp8 tiles into bf16 inside the Triton kernel every K step took 1225 us; the fused launch runs
  a bf16 MMA chain on the dequantized tiles: 761 us with 4 stages where the in-kernel scaling took
  1259 in the same run, 725 us with the 3 it ships with (a later run). The cost
  against ptpc: bf16 MMAs run at half the fp8 rate, and the dequantization adds a pass over A per
  call and one over B per weight (the CUDA backend keeps B's bf16 copy; ``fp8_gemm`` itself makes
  it every call).

The fp8 gather (``gather_dtype="fp8"``) carries one scale per row and ``cco.layout.GATHER_GROUP``
columns: an epilogue sees one tile, never a whole row. Triton is imported lazily: ``import
kernels_fused`` works without it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from cco.quant import QUANTS, SCALE_BLOCK
from cco.validate import GemmShape, check_operands
from kernels_fused.hopper.launch import Kernel, keep, specialization
from kernels_fused.hopper.vendor import (BLOCKWISE_KBLOCK_MULTIPLE, BLOCKWISE_ROW_MULTIPLE, VendorWeight, mx_to_bf16,
                                         prepare_weight, takes_rows, vendor_gemm)

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
    # how programs find their tiles: "grid" (one per tile, in the kernel's own order), "ws" (fuse=False
    # only: one persistent program per SM, warp-specialized, TMA-stored tiles; fp8_gemm_ws_kernel),
    # "ticket" (one per tile, claimed in the walk's order from a counter), "persistent" (one per SM,
    # striding the walk). fuse=False with "ticket"/"persistent" runs the lsa kernel on a world of one
    # (its epilogue then only writes out); the lsa kernel treats "grid" as "ticket". "cublas" (fuse=False):
    # the vendor GEMM (kernels_fused.hopper.vendor: torch._scaled_mm's row-wise or blockwise recipe;
    # mxfp8: cuBLAS's bf16 GEMM on the dequantized operands); the tile fields are unused, precise_acc
    # picks ptpc's accumulation.
    launch: str = "grid"

    def tiles(self, m: int, n: int) -> tuple[int, int]:
        return -(-m // self.block_m), -(-n // self.block_n)


# Hopper defaults of the tile-table kernels (fused, lsa), measured on H200 at 16384x7168x2048
# (docs/experiments.md): ptpc 128x256, 3 stages (427 us; 4 stages 433, 256x128 446, pointer loads 432);
# blockscale 64x128, 4 warps, 3 stages, so that three programs share an SM (581-594 us; 128x128 with 8
# warps 752-782, 64x128 with 2 / 4 stages 691-717 / 645-674, 128x64 699, 64x64 817; the same order at
# M = 2048, 4096 and 8192); mxfp8 (bf16 operands) 128x128, BLOCK_K 64, 3 stages (the fused launch
# 725 us; 4 / 5 stages 779 / 790, 128x256 with 3 / 4 stages 873 / 875).
_HOPPER = {
    "ptpc": GemmConfig(block_m=128, block_n=256),
    "blockscale": GemmConfig(block_m=64, block_n=128, num_warps=4),
    "mxfp8": GemmConfig(block_m=128, block_n=128, block_k=64),
}
# fuse=False, the own kernels: the persistent warp-specialized kernel where it measured faster than
# the grid one (ptpc; its halved TMA-store staging leaves shared memory for a fourth stage)
TRITON_PLAIN = {**_HOPPER, "ptpc": GemmConfig(block_m=128, block_n=256, num_stages=4, launch="ws")}
VENDOR = GemmConfig(block_m=128, block_n=128, launch="cublas")  # the tile fields are unused
# fuse=False (mode gemm-only, and every call at world 1): the fastest correct GEMM per quant and M on
# H200, own kernel or vendor, as ((largest M, config), ...), the last row taking every larger M.
# Measured at N=7168, K=2048, CUDA-graph replays, one run (scripts/bench_gemm.py, docs/hopper_gemm.md,
# docs/results/2026-12-02_gemm_only_h200.json), vendor / own kernel in us:
#   M      16        128       1024      2048       4096        8192        16384       32768
#   ptpc   16.3/18.4 15.7/19.1 27.6/29.0 45.0/53.0  85.0/89.4   166.4/176.7 328.0/348.7 653.3/696.7
#   block  15.3/15.9 15.6/15.7 32.5/47.3 54.4/82.3  104.0/152.5 202.6/296.2 398.8/585.6 792.3/1168.1
#   mxfp8  15.8/37.0 14.7/36.3 51.0/65.1 80.6/112.6 160.7/186.7 312.2/354.4 620.2/693.6 1394.0/1459.8
# (ptpc with fast accumulation, as the own kernel; mxfp8's own kernel dequantized B every call, the vendor
# GEMM keeps its bf16 copy). The vendor GEMM wins or ties everywhere; blockscale M % 4 != 0 takes the own
# kernel, and so does blockscale at a K of ceil(K/128) % 4 != 0 (vendor.takes_rows). The rule for another N, K or
# GPU is unmeasured.
PLAIN_RULE = {
    "ptpc": ((None, VENDOR),),
    "blockscale": ((None, VENDOR),),
    "mxfp8": ((None, VENDOR),),
}


def default_config(quant: str, *, plain: bool = False, m: int | None = None, k: int | None = None,
                   interpret: bool = False) -> GemmConfig:
    """The launch config for ``quant``: of the tile-table kernels, or with ``plain`` of the GEMM alone
    (``fuse=False``) for ``m`` rows of a product over ``k`` columns by ``PLAIN_RULE`` (None: its
    largest M; the own kernel where the vendor GEMM does not take ``m`` rows or ``k`` columns:
    ``vendor.takes_rows``); under ``TRITON_INTERPRET=1`` small tiles keep the CPU run short. ``m``
    needs ``k``: cuBLAS's blockwise recipe refuses some row counts and computes some K wrongly, so a
    rule asked without K could send a call to cuBLAS that it must not take."""
    if interpret:
        return GemmConfig(block_m=32, block_n=64, num_warps=4, num_stages=1)
    if not plain:
        return _HOPPER[quant]
    rows = PLAIN_RULE[quant]
    cfg = rows[-1][1]
    if m is not None:
        if k is None:
            raise ValueError(f"default_config: m={m} needs k (the product's columns): the vendor GEMM's rules "
                             f"depend on both")
        cfg = next(c for largest, c in rows if largest is None or m <= largest)
        if cfg.launch == "cublas" and not takes_rows(quant, m, k):
            return TRITON_PLAIN[quant]
    return cfg


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
def _kernels():
    """(plain/dma kernel, lsa kernel, warp-specialized plain kernel, its reduce-scatter-along-rows
    walk), imported on first use."""
    from kernels_fused.hopper import kernels as tk

    return tk.fp8_gemm_kernel, tk.fp8_gemm_lsa_kernel, tk.fp8_gemm_ws_kernel, tk.fp8_gemm_rows_ws_kernel


def _operands(a, b, a_scale, b_scale, *, quant: str, config: GemmConfig, b_dense=None):
    """The kernels' operand arguments: (A source, B source, A scale, B scale, strides), the sources
    TMA descriptors when ``config.tma``; mxfp8 operands dequantized to bf16 (:func:`mx_to_bf16`; the
    scale arguments are then unread), B from ``b_dense`` where the caller keeps that copy
    (:func:`check_dense_b`); strides are (A row, B row, A scale row / column, B scale row / column;
    0 for a 1-D scale)."""
    if quant == "mxfp8":
        a, b = mx_to_bf16(a, a_scale), (mx_to_bf16(b, b_scale) if b_dense is None else b_dense)
        a_scale, b_scale = a, b  # unread: any tensor will do
    strides = (a.stride(0), b.stride(0), a_scale.stride(0), a_scale.stride(1) if a_scale.dim() == 2 else 0,
               b_scale.stride(0), b_scale.stride(1) if b_scale.dim() == 2 else 0)
    if not config.tma:
        return a, b, a_scale, b_scale, strides
    from triton.tools.tensor_descriptor import TensorDescriptor

    return (TensorDescriptor.from_tensor(a, [config.block_m, config.block_k]),
            TensorDescriptor.from_tensor(b, [config.block_n, config.block_k]), a_scale, b_scale, strides)


def check_dense_b(b_dense, *, quant: str, n: int, k: int, fn: str) -> None:
    """``b_dense``: mxfp8's weight already dequantized to bf16 (``vendor.prepare_weight``'s copy,
    which the CUDA backend keeps per weight), so that a call does not dequantize the whole weight
    again (a read of the fp8 weight, a write and a read of [N, K] bf16, and an allocation per call).
    The caller vouches that it is ``b`` times ``b_scale``; its shape and layout are checked here."""
    if b_dense is None:
        return
    if quant != "mxfp8":
        raise ValueError(f"{fn}: b_dense is mxfp8's bf16 copy of the weight; quant={quant!r} reads b itself")
    if b_dense.dtype != torch.bfloat16 or tuple(b_dense.shape) != (n, k) or not b_dense.is_contiguous():
        raise ValueError(f"{fn}: b_dense must be the contiguous bf16 [N={n}, K={k}] copy of b, got "
                         f"{b_dense.dtype} {list(b_dense.shape)} stride {b_dense.stride()}")


def _shape(a: torch.Tensor, b: torch.Tensor) -> GemmShape:
    return GemmShape(a.shape[0], b.shape[0], a.shape[1])


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
    reduce: "ReduceEpilogue | None" = None,
    slice_rows: int | None = None,
    validated: bool = False,
    b_dense: torch.Tensor | None = None,
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
    * ``fuse=True, slice_rows=R`` (the reduce-scatter along rows): the slices are row blocks, dest
      d's the rows ``d*R .. d*R + R`` of the product, every column: ``out`` is [W, rows >= R, N]
      and a table row's ``row0`` counts within dest's block.
    * ``config.launch="ws"`` (``fuse=False`` only; the ptpc default, which falls back to the grid
      kernel for an ``out`` a TMA descriptor cannot address): persistent warp-specialized programs;
      "ticket" / "persistent" (``fuse=False`` only): the ``lsa`` kernel on a world of one walks the
      tiles in row-major order (see :class:`GemmConfig`).
    * ``reduce`` (``fuse=True`` only, :class:`ReduceEpilogue`): the own tiles are reduced in the
      epilogue instead of stored into ``partial[rank]``.
    * ``validated``: the caller has run ``cco.validate.check_operands`` on these operands (the op
      does, once per call; a second pass cost an eager call ~11 us of host time on an H200 host).
    * ``b_dense`` (mxfp8 only): ``b`` already dequantized to bf16 [N, K], read instead of ``b`` and
      ``b_scale`` (:func:`check_dense_b`).
    """
    from cco.layout import GATHER_GROUP, MAX_CHUNKS

    fn = "fp8_gemm"
    shape = _shape(a, b) if validated else check_operands(a, b, a_scale, b_scale, quant=quant, fn=fn)
    m, n, k = shape.m, shape.n, shape.k
    check_dense_b(b_dense, quant=quant, n=n, k=k, fn=fn)
    cfg = config or default_config(quant, plain=not fuse, m=m, k=k, interpret=_interpreting())
    if cfg.launch in ("ws", "cublas") and fuse:
        raise ValueError(f"{fn}: launch={cfg.launch!r} is the plain GEMM's; fuse=True walks a tile table "
                         f"(launch='grid')")
    if reduce is not None and not fuse:
        raise ValueError(f"{fn}: reduce (the own tiles' epilogue reduce) needs fuse=True")
    if slice_rows is not None and not fuse:
        raise ValueError(f"{fn}: slice_rows (row slices of a tile table) needs fuse=True")
    red = None
    if fuse:
        if out is None or tile_table is None or counters is None:
            raise ValueError(f"{fn}: fuse=True needs out (the partial region), tile_table and counters")
        if slice_rows is not None and reduce is not None:
            raise ValueError(f"{fn}: reduce (the all-reduce's own tiles) walks column slices, not slice_rows")
        world = _check_partial(out, counters, m=m, n=n, slice_rows=slice_rows, block_n=cfg.block_n, fn=fn)
        if tile_table.dtype != torch.int32 or tile_table.dim() != 2 or tile_table.shape[1] != 4:
            raise ValueError(f"{fn}: tile_table must be int32 [T, 4], got {tile_table.dtype} {list(tile_table.shape)}")
        grid = tile_table.shape[0]
        n_slice, dest_stride, stride_c = out.shape[2], out.stride(0), out.stride(1)
        # a slice's origin: (dest * row_step, dest * col_step); its rows stop at rows_out
        row_step, col_step, rows_out = (0, n_slice, m) if slice_rows is None else (slice_rows, 0, slice_rows)
        if reduce is not None:
            if reduce.gather_scale is not None and cfg.block_n % GATHER_GROUP:
                raise ValueError(f"{fn}: the fp8 gather's epilogue reduce needs block_n={cfg.block_n} to be a "
                                 f"multiple of {GATHER_GROUP} (one scale per row and {GATHER_GROUP} columns)")
            red = reduce.arguments(partial=out, m=m, tiles=grid, fn=fn)
    else:
        if out is None:
            out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
        elif out.dtype != torch.bfloat16 or tuple(out.shape) != (m, n) or out.stride(1) != 1:
            raise ValueError(
                f"{fn}: out must be a bf16 [M={m}, N={n}] tensor with unit column stride, got "
                f"{out.dtype} {list(out.shape)} stride {out.stride()}; pass out=None to allocate one"
            )
        if config is None and cfg.launch == "ws" and not tma_storable(out):
            cfg = default_config(quant)  # the default call takes any out: the grid kernel's pointer stores
        if cfg.launch == "cublas":
            if not takes_rows(quant, m, k):
                raise ValueError(f"{fn}: launch='cublas' with quant={quant!r} needs M % {BLOCKWISE_ROW_MULTIPLE} == 0 "
                                 f"and ceil(K/128) % {BLOCKWISE_KBLOCK_MULTIPLE} == 0 (cuBLAS's blockwise recipe "
                                 f"refuses M={m} or is not trusted at K={k}: vendor.takes_rows); pass config=None "
                                 f"(the own kernel then) or pad A's rows")
            weight = prepare_weight(b, b_scale, quant) if b_dense is None else VendorWeight(quant, b_dense.t(), None,
                                                                                              b_dense)
            return vendor_gemm(a, a_scale, weight, out=out, fast_accum=not cfg.precise_acc)
        tiles_m, tiles_n = cfg.tiles(m, n)
        grid = tiles_m * tiles_n
        if cfg.launch == "ws":
            _warp_specialized(a, b, a_scale, b_scale, quant=quant, out=out, config=cfg, tiles=grid, b_dense=b_dense)
            return out
        if cfg.launch != "grid":
            if n % cfg.block_n:
                raise ValueError(f"{fn}: launch={cfg.launch!r} needs block_n={cfg.block_n} to divide N={n}")
            _walked(a, b, a_scale, b_scale, quant=quant, out=out, config=cfg, b_dense=b_dense)
            return out
        n_slice, dest_stride, stride_c = n, 0, out.stride(0)
        row_step, col_step, rows_out = 0, 0, m
        tile_table = counters = b  # never read when FUSE is off; any pointer will do

    if red is None:  # unread without REDUCE
        red = (counters, 0) + (counters,) * 8 + (0, 0, 0)
        world, fp8_gather = 1, False
    else:
        world, fp8_gather = reduce.recv.shape[0], reduce.gather_scale is not None

    a_src, b_src, a_scale, b_scale, strides = _operands(a, b, a_scale, b_scale, quant=quant, config=cfg,
                                                        b_dense=b_dense)
    _kernels()[0][(grid,)](
        a_src, b_src, out, a_scale, b_scale, tile_table, counters, *red,
        m, n, k, strides[0], strides[1], stride_c, n_slice, dest_stride, row_step, col_step, rows_out, *strides[2:],
        QUANT=QUANT_ID[quant], FUSE=bool(fuse), REDUCE=reduce is not None, USE_TMA=cfg.tma,
        MX_BF16=not _interpreting(), PRECISE_ACC=cfg.precise_acc,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        SCALE_BLOCK=SCALE_BLOCK, MAX_CHUNKS=MAX_CHUNKS, TILE_WEIGHT=int(tile_weight),
        WORLD=world, FP8_GATHER=fp8_gather, GATHER_GROUP=GATHER_GROUP,
        EPILOGUE_PIECES=_epilogue_pieces(cfg.block_n, fp8_gather),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _check_partial(out, counters, *, m: int, n: int, slice_rows: int | None, block_n: int, fn: str) -> int:
    """A fused launch's partial region and counters (column slices: ``[W, rows >= M, N/W]``; row
    slices: ``[W, rows >= slice_rows, N]`` with ``W * slice_rows = M``); returns W."""
    from cco.layout import MAX_CHUNKS

    world = out.shape[0] if out.dim() == 3 else 0
    rows_min, cols = (m, n // world if world and n % world == 0 else -1) if slice_rows is None else (slice_rows, n)
    if out.dtype != torch.bfloat16 or world < 1 or out.shape[2] != cols or out.shape[1] < rows_min \
            or not out.is_contiguous() or (slice_rows is not None and (slice_rows < 1 or slice_rows * world != m)):
        raise ValueError(
            f"{fn}: with fuse=True, out must be the contiguous bf16 partial region [W, rows >= {m}, N/W] with "
            f"W * N/W = {n}, got {out.dtype} {list(out.shape)}" if slice_rows is None else
            f"{fn}: with fuse=True and slice_rows={slice_rows}, out must be the contiguous bf16 partial "
            f"region [W, rows >= slice_rows, N={n}] with W * slice_rows = M = {m}, got {out.dtype} "
            f"{list(out.shape)}")
    if counters.dtype != torch.int64 or counters.numel() < world * MAX_CHUNKS:
        raise TypeError(f"{fn}: counters must be int64 with >= {world * MAX_CHUNKS} entries, got "
                        f"{counters.dtype} with {counters.numel()}")
    if out.shape[2] % block_n:
        raise ValueError(f"{fn}: block_n={block_n} must divide the column slice N/W={out.shape[2]}")
    return world


def rows_chunk_map(chunk_tiles, *, device) -> torch.Tensor:
    """int32 ``[m-tiles of a slice]``: each m-tile's chunk (``cco.layout.chunk_tiles``: runs of
    m-tiles), what :func:`fp8_gemm_rows_ws` releases a tile's counter by."""
    return torch.tensor([c for c, (t0, t1) in enumerate(chunk_tiles) for _ in range(t0, t1)], dtype=torch.int32,
                        device=device)


def rows_ws_config(config: GemmConfig, quant: str) -> GemmConfig:
    """:func:`fp8_gemm_rows_ws`'s launch config from the fused launch's tile (``config``): the stage
    count of the plain GEMM's warp-specialized launch where ``quant`` takes it (``TRITON_PLAIN``: its
    tile leaves through TMA in halves, which leaves shared memory for a fourth stage)."""
    plain = TRITON_PLAIN[quant]
    return replace(config, num_stages=plain.num_stages if plain.launch == "ws" else config.num_stages)


def rows_ws_constants(config: GemmConfig, quant: str, *, world: int, tile_weight: int, programs: int,
                      interpret: bool, release_lag: bool = False) -> dict:
    """``fp8_gemm_rows_ws_kernel``'s compile-time arguments for a launch of ``config``: what
    :func:`fp8_gemm_rows_ws` launches with, and what ``kernels_fused.hopper.walk_ptx`` compiles on a
    host without a GPU, so that the checked kernel is the launched one."""
    from cco.layout import MAX_CHUNKS

    return dict(QUANT=QUANT_ID[quant], MX_BF16=not interpret, PRECISE_ACC=config.precise_acc,
                BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SCALE_BLOCK=SCALE_BLOCK,
                WORLD=world, MAX_CHUNKS=MAX_CHUNKS, TILE_WEIGHT=int(tile_weight), NUM_PROGS=programs,
                INTERPRET=interpret, RELEASE_LAG=bool(release_lag))


def fp8_gemm_rows_ws(a, b, a_scale, b_scale, *, quant: str, out: torch.Tensor, counters: torch.Tensor,
                     chunk_map: torch.Tensor, rank: int, slice_rows: int, tile_weight: int = 1,
                     config: GemmConfig | None = None, b_dense=None, release_lag: bool = False) -> torch.Tensor:
    """The reduce-scatter along rows' fused producer as one persistent warp-specialized launch
    (``fp8_gemm_rows_ws_kernel``): what ``fp8_gemm(fuse=True, slice_rows=slice_rows)`` writes and
    releases with the dest-major tile table of ``rank`` (``cco.layout.tile_table(dest_major=True)``),
    the walk computed instead of read. ``chunk_map``: :func:`rows_chunk_map` of the call's chunks;
    ``config``: the tile (the fused launch's, :func:`rows_ws_config`'s stages by default);
    ``release_lag``: each tile released one tile late (the kernel's RELEASE_LAG). The caller has
    validated the operands (``cco.validate.check_operands``), as the op does."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    fn = "fp8_gemm_rows_ws"
    shape = _shape(a, b)
    m, n, k = shape.m, shape.n, shape.k
    cfg = config or rows_ws_config(default_config(quant), quant)
    check_dense_b(b_dense, quant=quant, n=n, k=k, fn=fn)
    world = _check_partial(out, counters, m=m, n=n, slice_rows=slice_rows, block_n=cfg.block_n, fn=fn)
    tiles_m = -(-slice_rows // cfg.block_m)
    if not cfg.tma or chunk_map.dtype != torch.int32 or chunk_map.numel() != tiles_m or not 0 <= rank < world:
        raise ValueError(f"{fn}: needs config.tma, an int32 chunk_map of the slice's {tiles_m} m-tiles (got "
                         f"{chunk_map.dtype} {chunk_map.numel()}) and 0 <= rank={rank} < W={world}")
    a_src, b_src, a_scale, b_scale, strides = _operands(a, b, a_scale, b_scale, quant=quant, config=cfg,
                                                        b_dense=b_dense)
    # the slices' rows only: a slice's last m-tile is clipped at its end (no pad row written)
    c_desc = TensorDescriptor.from_tensor(out[:, :slice_rows], [1, cfg.block_m, cfg.block_n // 2])
    programs = min(persistent_programs(out.device), world * tiles_m * (n // cfg.block_n))
    args = (a_src, b_src, c_desc, a_scale, b_scale, chunk_map, counters, m, n, k, rank, slice_rows, tiles_m,
            *strides[2:])
    kwargs = dict(rows_ws_constants(cfg, quant, world=world, tile_weight=tile_weight, programs=programs,
                                    interpret=_interpreting(), release_lag=release_lag),
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    kernel = _kernels()[3]
    check_releases(kernel, (programs,), args, kwargs, out.device, fn=fn)
    kernel[(programs,)](*args, **kwargs)
    return out


class UnorderedReleases(RuntimeError):
    """The installed Triton's compile of the reduce-scatter along rows' walk does not order a
    tile's release after its stores (``kernels_fused.hopper.ptx``): the walk must not run there."""


# the verdict of ``kernels_fused.hopper.ptx.bulk_release_problem`` per (device, launch constants):
# one compile's PTX read per launch configuration in a process (None: ordered)
_RELEASE_VERDICTS: dict[tuple, str | None] = {}


def check_releases(kernel, grid, args, kwargs, device, *, fn: str) -> None:
    """Raise :class:`UnorderedReleases` before ``kernel`` (the walk) is launched where its compile
    (``kernel.warmup``: the launch's own, cached by Triton, so no second compile) releases a tile
    before its stores are written: Triton versions lower the stores and the add differently
    (3.6 needed the kernel's own barrier), and a Triton that is not the one the checks ran with
    must not race silently. Every rank of a job runs the same Triton, so every rank reaches the
    same verdict. Not under the interpreter (its stores are synchronous)."""
    if _interpreting():
        return
    key = (str(device), tuple(sorted(kwargs.items())))
    if key not in _RELEASE_VERDICTS:
        from kernels_fused.hopper.ptx import bulk_release_problem

        compiled = kernel.warmup(*args, grid=grid, **kwargs)
        compiled = compiled.result() if hasattr(compiled, "result") else compiled  # (an asynchronous compile)
        ptx = getattr(compiled, "asm", {}).get("ptx")
        _RELEASE_VERDICTS[key] = bulk_release_problem(ptx) if ptx else "Triton gave no PTX of it to read"
    if _RELEASE_VERDICTS[key] is not None:
        import triton

        raise UnorderedReleases(f"{fn}: Triton {triton.__version__}'s compile of the walk may release a tile "
                                f"before its stores are written ({_RELEASE_VERDICTS[key]}); use the grid launch")


def _epilogue_pieces(block_n: int, fp8_gather: bool) -> int:
    """Column pieces an own tile is reduced in (``_reduce_own_tile``): halves where each half
    holds whole fp8 scale groups."""
    from cco.layout import GATHER_GROUP

    half = block_n // 2
    return 2 if block_n % 2 == 0 and (not fp8_gather or half % GATHER_GROUP == 0) else 1


@dataclass(frozen=True)
class ReduceEpilogue:
    """What a ``fuse=True`` launch needs to reduce its own tiles in the epilogue (the ``dma``
    transport on CUDA, ``cco.cuda.dma``): this rank's window regions (``cco.layout`` names) and
    words. An own tile waits until ``scatter_flags[src, chunk]`` is set for every source, adds
    ``recv[src]``'s tile to its bf16-rounded partial in ``cco.layout.reduce_order``, stores the sum
    into ``out[:, rank's columns]`` and ``gather[rank]`` (e4m3 plus ``gather_scale[rank]`` for the
    fp8 gather), then adds to ``counters[rank, chunk]`` as every tile does. A source whose
    ``scatter_m`` stamp differs from ``stamp`` is recorded in ``status`` as ``1 + src``."""

    rank: int
    recv: torch.Tensor  # bf16 [W, rows, n_slice]
    gather: torch.Tensor  # bf16 | e4m3 [W, rows, n_slice]
    gather_scale: torch.Tensor | None  # fp32 [W, rows, n_slice / GATHER_GROUP] (fp8 gather)
    out: torch.Tensor  # bf16 [M, N], the caller's
    scatter_flags: torch.Tensor  # int64 [W * MAX_CHUNKS]
    scatter_m: torch.Tensor  # int64 [W]: each source's (seq, M) stamp
    stamp: torch.Tensor  # int64 [1]: this call's
    status: torch.Tensor  # int64 [1]
    ticket: torch.Tensor  # int64 [1], zero between launches

    def arguments(self, *, partial: torch.Tensor, m: int, tiles: int, fn: str) -> tuple:
        """The kernel's REDUCE arguments, after checking the regions against ``partial``."""
        if any(r.shape != partial.shape or r.stride() != partial.stride() for r in (self.recv, self.gather)):
            raise ValueError(f"{fn}: reduce.recv and reduce.gather must be shaped like the partial region "
                             f"{list(partial.shape)}, got {list(self.recv.shape)} and {list(self.gather.shape)}")
        n = partial.shape[0] * partial.shape[2]
        if self.out.dtype != torch.bfloat16 or tuple(self.out.shape) != (m, n) or self.out.stride(1) != 1:
            raise ValueError(f"{fn}: reduce.out must be bf16 [{m}, {n}] with unit "
                             f"column stride, got {self.out.dtype} {list(self.out.shape)}")
        gscale = self.gather if self.gather_scale is None else self.gather_scale
        return (self.ticket, tiles, self.recv, self.gather, gscale, self.out, self.scatter_flags, self.scatter_m,
                self.stamp, self.status, self.rank, self.out.stride(0),
                0 if self.gather_scale is None else self.gather_scale.stride(0))


def tma_storable(out: torch.Tensor) -> bool:
    """Whether a TMA descriptor can address ``out`` (bf16, unit column stride): 16-byte aligned base
    and row stride."""
    return out.stride(0) % 8 == 0 and out.data_ptr() % 16 == 0


def _warp_specialized(a, b, a_scale, b_scale, *, quant, out, config, tiles, b_dense=None) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not config.tma:
        raise ValueError("fp8_gemm: launch='ws' loads through TMA descriptors; it needs tma=True")
    if not tma_storable(out):
        raise ValueError(f"fp8_gemm: launch='ws' stores through TMA: out needs 16-byte aligned rows (row stride "
                         f"{out.stride(0)} elements at {out.data_ptr():#x}); pass a fresh out or launch='grid'")
    a_src, b_src, a_scale, b_scale, strides = _operands(a, b, a_scale, b_scale, quant=quant, config=config,
                                                        b_dense=b_dense)
    c_desc = TensorDescriptor.from_tensor(out, [config.block_m, config.block_n // 2])
    programs = min(persistent_programs(out.device), tiles)
    _kernels()[2][(programs,)](
        a_src, b_src, c_desc, a_scale, b_scale, out.shape[0], out.shape[1], a.shape[1], *strides[2:],
        QUANT=QUANT_ID[quant], MX_BF16=not _interpreting(), PRECISE_ACC=config.precise_acc,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        SCALE_BLOCK=SCALE_BLOCK, NUM_PROGS=programs,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


@functools.lru_cache(maxsize=16)
def _row_major_table(m: int, n: int, block_m: int, block_n: int, device: str) -> torch.Tensor:
    rows = [[0, 0, mt * block_m, nt * block_n] for mt in range(-(-m // block_m)) for nt in range(n // block_n)]
    return tile_table_tensor(rows, device=device)


@functools.lru_cache(maxsize=16)
def _world_of_one(m: int, n: int, device: str) -> "LsaWindow":
    """The lsa kernel's window on a world of one: nothing in it is read but the (reset) ticket."""
    def words():
        return torch.zeros(1, dtype=torch.int64, device=device)

    unused = torch.zeros(1, 1, 1, dtype=torch.bfloat16, device=device)
    return LsaWindow(partial=unused, recv=unused.expand(1, m, n), gather=unused, gather_scale=None,
                     tile_flags=torch.zeros(2, 1, 1, 1, dtype=torch.int64, device=device), deltas=words(),
                     status=words(), ticket=words())


def _walked(a, b, a_scale, b_scale, *, quant, out, config, b_dense=None) -> None:
    """Plain GEMM through the lsa kernel with a world of one (no peer, nothing to wait for)."""
    m, n = out.shape
    dev = str(out.device)
    fp8_gemm_lsa(a, b, a_scale, b_scale, quant=quant, out=out, win=_world_of_one(m, n, dev),
                 tile_table=_row_major_table(m, n, config.block_m, config.block_n, dev), rank=0, stamp=1,
                 config=config, b_dense=b_dense)


@dataclass(frozen=True)
class LsaWindow:
    """This rank's window regions as the ``lsa`` kernel reads them (``cco.layout`` names). A peer's
    copy of any region lies ``deltas[peer]`` bytes from the local one (int64 [W], 0 for the own
    rank): one symmetric allocation per rank, the same offsets everywhere."""

    partial: torch.Tensor  # bf16 [W, rows, n_slice] (read only by the self test)
    recv: torch.Tensor  # bf16 [W, rows, n_slice]
    gather: torch.Tensor  # bf16 | e4m3 [W, rows, n_slice]
    gather_scale: torch.Tensor | None  # fp32 [W, rows, n_slice / GATHER_GROUP] (fp8 gather)
    tile_flags: torch.Tensor  # int64 [2, W, m_tiles, n_tiles] (at least the kernel's tiles): scatter, gather
    deltas: torch.Tensor  # int64 [W], bytes
    status: torch.Tensor  # int64 [1]
    ticket: torch.Tensor  # int64 [1], zero between launches (launch="ticket"; local, one per op)

    @functools.cached_property
    def launch_args(self) -> tuple:
        """``(tensors, key)``: the window's arguments of the lsa kernel in their order (the ticket;
        partial, recv, gather, the gather scale (the gather itself for a bf16 gather), the scatter
        and gather flag planes, deltas, status) and what a kept launch keys them by
        (``launch.specialization``), made once: the window's regions are fixed for its life (a
        frozen dataclass), and keying ten tensors and slicing the flags anew cost every
        decode-sized call host time (docs/decode.md, "World 2, the profile again")."""
        tensors = (self.ticket, self.partial, self.recv, self.gather,
                   self.gather if self.gather_scale is None else self.gather_scale, self.tile_flags[0],
                   self.tile_flags[1], self.deltas, self.status)
        return tensors, specialization(tensors)


def lsa_walk_rows(cfg, *, m: int, rank: int, width: int, interleave: bool = False) -> list[list[int]]:
    """The ``lsa`` kernel's walk as ``[chunk, dest, row0, col0]`` rows of ``width`` layout tiles.

    Three kinds of entries per chunk: scatter (every peer's tiles), reduce (the own tiles) and
    assemble (``dest = W + owner``: one per tile of a peer owner's slice, in the order the owner
    reduces them). ``interleave=False`` walks all scatters, then all reduces, then all assembles
    (``cco.layout.tile_table(..., dest_major=True)`` order); ``interleave=True`` walks, for c =
    0, 1, ...: scatter c, reduce c - 1, assemble c - 2, so the link always carries both a scatter
    and a gather while the programs keep computing. Every entry waits only for peer entries that
    sit earlier in the peer's walk, which is what makes any claim order deadlock-free. On 2 H200 at
    16384x7168x2048 the phased walk measured 913 us and the interleaved one 974 us (docs/experiments.md)."""
    from cco import layout

    rows = layout.tile_table_rows(layout.tile_table(cfg, m=m, rank=rank, dest_major=True))
    if width == 2:
        rows = merge_tile_pairs(rows, layout_block_n=cfg.block_n)
    chunks = max(r[0] for r in rows) + 1
    owners = [d for d in layout.dest_order(rank, cfg.world) if d != rank]
    scatter = [[r for r in rows if r[0] == c and r[1] != rank] for c in range(chunks)]
    reduce = [[r for r in rows if r[0] == c and r[1] == rank] for c in range(chunks)]
    assemble = [[[c, cfg.world + o, r0, c0] for o in owners for _, _, r0, c0 in reduce[c]] for c in range(chunks)]
    if not interleave:
        return [r for phase in (scatter, reduce, assemble) for part in phase for r in part]
    walk = []
    for c in range(chunks + 2):
        for phase, lag in ((scatter, 0), (reduce, 1), (assemble, 2)):
            if 0 <= c - lag < chunks:
                walk += phase[c - lag]
    return walk


def peer_deltas(bases: list[int], rank: int) -> list[int]:
    """``LsaWindow.deltas`` from every rank's window base address: bytes from this rank's window,
    each a multiple of 256 (the kernel's vectorization hint relies on it; allocators align far more)."""
    deltas = [b - bases[rank] for b in bases]
    odd = [p for p, d in enumerate(deltas) if d % 256]
    if odd:
        raise ValueError(f"peer_deltas: the windows of ranks {odd} are not 256-byte aligned relative to rank {rank}")
    return deltas


def persistent_programs(device) -> int:
    """Programs of a persistent launch: one per multiprocessor (one under the interpreter, whose
    programs run one after another: a waiting program would never see a later one's tile)."""
    if _interpreting():
        return 1
    return _multiprocessors(device)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count  # ~6 us: not per launch


def fp8_gemm_lsa(a, b, a_scale, b_scale, *, quant: str, out: torch.Tensor, win: LsaWindow,
                 tile_table: torch.Tensor, rank: int, stamp: int, config: GemmConfig,
                 from_partial: bool = False, move_bytes: bool = True, validated: bool = False,
                 b_dense: torch.Tensor | None = None, partial: torch.Tensor | None = None) -> None:
    """The ``lsa`` fused launch: GEMM, scatter, reduce, gather and assemble in one kernel.

    Programs claim tiles per ``config.launch`` (:class:`GemmConfig`) along ``tile_table``
    (:func:`lsa_walk_rows`): every peer's tiles, then the own ones, then one assemble entry per
    tile of every peer's slice. A peer's tile is stored bf16 into ``recv[rank]`` of its owner, then
    ``tile_flags[0, rank, tile]`` there is set to ``stamp`` (release, system scope). An own tile
    waits for every source's flag (acquire; the waiter zeroes it, its only reader), adds the
    sources' tiles in fp32, writes the own columns of ``out``, stores the reduced tile into
    ``gather[rank]`` of every peer (bf16, or e4m3 with ``gather_scale``) and sets
    ``tile_flags[1, rank, tile]`` there. An assemble entry waits for that flag and writes the
    owner's tile into ``out``. A flag that is not ``stamp`` (another seq or M) is recorded in
    ``status`` as ``1 + src``.

    Deadlock freedom: scatter tiles wait for nothing, reduce tiles only for peers' scatter tiles,
    assemble tiles only for peers' reduce tiles; a program that waits holds a later entry of the
    walk than every earlier entry of its rank (tickets, or a persistent program's stride), so those
    are held by running programs. ``from_partial`` replaces the GEMM by the tiles found in
    ``partial``: the window's ``win.partial`` planes (None, the self test) or a bf16 ``[M, N]``
    product with unit column stride that the caller computed (a decode-sized call's GEMM on every
    multiprocessor: ``cco.backends.cuda``, ``DECODE_SPLIT_ROWS``; read only by this rank's own
    programs, so any local tensor); ``move_bytes=False`` releases flags without storing data (the
    silent-transport fault); ``validated``, ``b_dense``: as :func:`fp8_gemm`'s.
    """
    args, launch = _lsa_launch(a, b, a_scale, b_scale, quant=quant, out=out, win=win, tile_table=tile_table,
                               rank=rank, stamp=stamp, config=config, from_partial=from_partial,
                               move_bytes=move_bytes, validated=validated, b_dense=b_dense, partial=partial)
    launch(out.get_device(), *args)


def _lsa_launch(a, b, a_scale, b_scale, *, quant, out, win, tile_table, rank, stamp, config, from_partial,
                move_bytes, validated, b_dense, partial=None):
    """``(args, launch)`` of :func:`fp8_gemm_lsa`'s call: the kernel's arguments in order and the
    launch kept for them (``_LSA_LAUNCHES``)."""
    from cco.layout import GATHER_GROUP

    world, rows, n_slice = win.recv.shape
    n = world * n_slice
    if n_slice % config.block_n or config.block_n % GATHER_GROUP:
        raise ValueError(f"fp8_gemm_lsa: block_n={config.block_n} must divide N/W={n_slice} and be a multiple "
                         f"of {GATHER_GROUP}")
    if from_partial:
        m, k = out.shape[0], config.block_k
        if partial is None:  # the window's [W, rows, n_slice] planes
            partial, read = win.partial, (win.partial.stride(0), win.partial.stride(1))
        elif (partial.dtype != torch.bfloat16 or partial.dim() != 2 or tuple(partial.shape) != (m, n)
              or partial.stride(1) != 1 or partial.device != out.device):
            raise ValueError(f"fp8_gemm_lsa: partial must be bf16 [{m}, {n}] with unit column stride on "
                             f"{out.device}, got {partial.dtype} {list(partial.shape)} on {partial.device}")
        else:  # [M, N]: owner d's columns start at d * n_slice
            read = (n_slice, partial.stride(0))
        a_src = b_src = a_scale = b_scale = partial
        # the partial's (owner, row) strides travel as stride_am and stride_bn, which this mode does not read
        strides = (*read, 0, 0, 0, 0)
        use_tma = False
    else:
        shape = _shape(a, b) if validated else check_operands(a, b, a_scale, b_scale, quant=quant, fn="fp8_gemm_lsa")
        m, k = shape.m, shape.k
        if shape.n != n:
            raise ValueError(f"fp8_gemm_lsa: b has N={shape.n} rows but the window holds {world} x {n_slice} columns")
        check_dense_b(b_dense, quant=quant, n=shape.n, k=k, fn="fp8_gemm_lsa")
        a_src, b_src, a_scale, b_scale, strides = _operands(a, b, a_scale, b_scale, quant=quant, config=config,
                                                        b_dense=b_dense)
        use_tma = config.tma
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (m, n) or out.stride(1) != 1:
        raise ValueError(f"fp8_gemm_lsa: out must be bf16 [{m}, {n}] with unit column stride, got "
                         f"{out.dtype} {list(out.shape)}")
    fp8 = win.gather_scale is not None
    (ticket, win_partial, recv, gather, gscale, scatter_flags, gather_flags, deltas, status), fixed = win.launch_args
    n_tiles = tile_table.shape[0]
    programs = min(persistent_programs(out.device), n_tiles) if config.launch == "persistent" else 0
    args = (ticket, n_tiles, a_src, b_src, a_scale, b_scale, out, partial if from_partial else win_partial, recv,
            gather, gscale, scatter_flags,
            gather_flags, deltas, status, tile_table,
            rank, stamp, m, n, k, strides[0], strides[1], out.stride(0), n_slice,
            win.recv.stride(0), win.tile_flags.stride(1), gscale.stride(0) if fp8 else 0, *strides[2:],
            # the constexprs, in the kernel's order: QUANT, USE_TMA, MX_BF16, PRECISE_ACC, BLOCK_M, BLOCK_N,
            # BLOCK_K, SCALE_BLOCK, WORLD, FP8_GATHER, GATHER_GROUP, FROM_PARTIAL, MOVE_BYTES, NUM_PROGS
            QUANT_ID[quant], use_tma, not _interpreting(), config.precise_acc, config.block_m, config.block_n,
            config.block_k, SCALE_BLOCK, world, fp8, GATHER_GROUP, bool(from_partial), bool(move_bytes), programs)
    # the launch kept per what Triton specializes on (every argument but the stamp, new each call: the
    # kernel's do_not_specialize), the launch options and the device: a decode-sized call's host time
    # is mostly its launch (docs/decode.md, "World 2 and more"). The window's tensors are keyed once per
    # window (LsaWindow.launch_args); the call's own (operands, out, tile table) and every integer here.
    key = (fixed, specialization(args[_LSA_A:_LSA_OUT + 1] + (tile_table,)), n_tiles, rank, args[_LSA_STAMP + 1:],
           programs or n_tiles, config.num_warps, config.num_stages, out.get_device())
    launch = _LSA_LAUNCHES.get(key)
    if launch is None:
        launch = keep(_LSA_LAUNCHES, key, Kernel(_kernels()[1], (programs or n_tiles,), num_warps=config.num_warps,
                                                 num_stages=config.num_stages))
    return args, launch


class LsaLaunch:
    """:func:`fp8_gemm_lsa`'s call kept for one weight and one activation layout (its shapes,
    strides and dtypes: the caller keys it so, ``cco.op``'s kept launches), so that an eager
    decode-sized collective call does not rebuild ~45 arguments, check its operands, describe the
    weight for TMA and key the launch on every call (docs/decode.md, "World 2, the call's parts":
    ~130 us of host time a call on two ranks sharing a GPU). Per call it takes the new rows, their
    scales, ``out`` and the stamp; everything else (the weight's descriptor, made from an alias of
    its bytes so that holding it keeps no tensor object alive, the window, the tile table, every
    integer) is bound. A call whose tensors sit at another 16-byte alignment than the first call's
    (Triton specializes the kernel on it) is launched through ``JITFunction.run``, which compiles
    or finds the kernel for that alignment (``Kernel.run_jit``)."""

    __slots__ = ("args", "launch", "device", "quant", "a_block", "aligned")

    def __init__(self, args: tuple, launch, *, device: int, quant: str, a_block, aligned: tuple):
        self.args, self.launch, self.device, self.quant = list(args), launch, device, quant
        self.a_block, self.aligned = a_block, aligned
        self._drop_call()  # the example call's rows, scales and out: layout only, not held

    def _drop_call(self) -> None:
        """Hold none of a call's own tensors (rows, their scales, out) between calls."""
        args = self.args
        args[_LSA_A] = args[_LSA_A_SCALE] = args[_LSA_OUT] = None

    def __call__(self, a, a_scale, out, stamp: int) -> None:
        if self.quant == "mxfp8":  # the kernel takes bf16 rows (_operands); the scale argument is unread
            a = a_scale = mx_to_bf16(a, a_scale)
        aligned = (a.data_ptr() % 16, a_scale.data_ptr() % 16, out.data_ptr() % 16) == self.aligned
        args = self.args
        if self.a_block is not None:
            from triton.tools.tensor_descriptor import TensorDescriptor

            args[_LSA_A] = TensorDescriptor.from_tensor(a, self.a_block)
        else:
            args[_LSA_A] = a
        args[_LSA_A_SCALE], args[_LSA_OUT], args[_LSA_STAMP] = a_scale, out, stamp
        try:
            if aligned:
                self.launch(self.device, *args)
            else:
                self.launch.run_jit(self.device, *args)
        finally:
            self._drop_call()


def lsa_launch(a, b, a_scale, b_scale, *, quant: str, out: torch.Tensor, win: LsaWindow, tile_table: torch.Tensor,
               rank: int, config: GemmConfig, b_dense: torch.Tensor | None = None) -> LsaLaunch:
    """The :class:`LsaLaunch` of calls like ``fp8_gemm_lsa(a, b, a_scale, b_scale, ..., out=out)``
    (operands already validated by the caller; the weight ``b`` and its scales are bound, the
    rows, their scales and ``out`` only taken as examples of their layout)."""
    b, b_scale = b.detach(), b_scale.detach()  # aliases: the bytes, not the caller's tensor objects
    args, launch = _lsa_launch(a, b, a_scale, b_scale, quant=quant, out=out, win=win, tile_table=tile_table,
                               rank=rank, stamp=0, config=config, from_partial=False, move_bytes=True,
                               validated=True, b_dense=b_dense)
    a_arg = args[_LSA_A]
    aligned = (a_arg.base if config.tma else a_arg, args[_LSA_A_SCALE], out)
    return LsaLaunch(args, launch, device=out.get_device(), quant=quant,
                     a_block=[config.block_m, config.block_k] if config.tma else None,
                     aligned=tuple(t.data_ptr() % 16 for t in aligned))


def lsa_partial_launch(partial: torch.Tensor, *, quant: str, out: torch.Tensor, win: LsaWindow,
                       tile_table: torch.Tensor, rank: int, config: GemmConfig, move_bytes: bool = True) -> LsaLaunch:
    """The :class:`LsaLaunch` of calls like ``fp8_gemm_lsa(..., from_partial=True, partial=partial,
    out=out)`` (the transfers on a caller's [M, N] partial, which stays bound: call it as
    ``launch(partial, partial, out, stamp)``; ``out`` only taken as an example of its layout)."""
    args, launch = _lsa_launch(None, None, None, None, quant=quant, out=out, win=win, tile_table=tile_table,
                               rank=rank, stamp=0, config=config, from_partial=True, move_bytes=move_bytes,
                               validated=True, b_dense=None, partial=partial)
    return LsaLaunch(args, launch, device=out.get_device(), quant=quant, a_block=None,
                     aligned=tuple(t.data_ptr() % 16 for t in (partial, partial, out)))


# positions among fp8_gemm_lsa_kernel's arguments (_lsa_launch's ``args``) of what each call brings
_LSA_A, _LSA_A_SCALE, _LSA_OUT, _LSA_STAMP = 2, 4, 6, 17
_LSA_LAUNCHES: dict = {}  # fp8_gemm_lsa's kept launches (kernels_fused.hopper.launch), by call shape


__all__ = ["GemmConfig", "LsaLaunch", "LsaWindow", "QUANTS", "ReduceEpilogue", "default_config", "fp8_gemm",
           "fp8_gemm_lsa", "lsa_launch", "lsa_partial_launch", "merge_tile_pairs", "lsa_walk_rows", "peer_deltas", "persistent_programs",
           "tile_table_tensor"]
