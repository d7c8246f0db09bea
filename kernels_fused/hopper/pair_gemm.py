"""ptpc's fp8 GEMM with a CTA pair sharing the weight tile by TMA multicast (``csrc/pair_gemm.cu``),
built by nvcc and launched through the driver.

Why it is CUDA C++: the GPU machines' Triton (3.6) cannot issue a multicast load, and the feed of the
tiles from L2 is what holds the own Triton GEMMs at 1.05-1.20x of cuBLAS at the reduce-scatter
producers' shapes (docs/hopper_gemm.md). cuBLAS's kernel there pairs its CTAs in a cluster; this
kernel does the same: the pair's CTAs compute adjacent row tiles against the same columns, and each
loads half of the tile's B rows into the ring of both (TMA multicast), so B is read once a pair.

Two arrangements (:class:`Variant`): the CTA's 128x256 tile shared by its two consumer
warpgroups, and a ping-pong of 128x128 tiles, one consumer warpgroup a tile (``pingpong``).

Status: a measurement, no launch path calls it. Right on an H100 and an H200 at every shape timed;
the ping-pong with the pair at 1.00-1.28x of cuBLAS at the sequence-parallel shapes of TP 8, a tie
with the own ws kernel (ahead at 5 of 8 cells in one run, 2 of 8 in another; docs/hopper_gemm.md,
``python3 -m scripts.probe_pair_gemm``). Shapes: M and N multiples of the pair's tiles side by side
(``Variant.cluster_tile``), K of the step (``Variant.bk``); other shapes raise ValueError.

The build: ``nvcc -arch=sm_90a -cubin`` once per source and :class:`Variant` (its fields but
``pingpong``, which picks the kernel, are the source's ``CCO_*`` macros), cached and loaded into the
operands' device's context by ``kernels_fused.hopper.cubin``. The launch: the two operands' tensor maps (``cuTensorMapEncodeTiled``:
``Variant.boxes`` rows, one K step's bytes wide, the step's swizzle) passed by value, the cluster
shape compiled into the kernel (``__cluster_dims__``), so a plain ``cuLaunchKernel`` on
torch's current stream launches it, and a CUDA graph captures it.
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from kernels_fused.hopper import cubin

SOURCE = cubin.source("pair_gemm.cu")
KERNELS = {False: b"cco_ptpc_gemm_pair", True: b"cco_ptpc_gemm_pair_pingpong"}  # by Variant.pingpong
THREADS = 384
BM, BOX_ROWS = 128, 128
GROUP = 8  # row blocks a group of the walk (the L2's reuse of B across rows)

_CU_TENSOR_MAP_UINT8, _L2_256B = 0, 3
_SWIZZLE = {128: 3, 64: 2}  # CU_TENSOR_MAP_SWIZZLE_128B / _64B, by the step's bytes


class Variant(NamedTuple):
    """One build of the kernel: the source's ``CCO_*`` macros, and which of its two kernels runs."""
    pair: int = 2                 # CTAs a cluster sharing B (1: each loads its whole B tile)
    wide_stores: bool = True      # the epilogue's 16-byte stores (False: 4 bytes a thread)
    cluster_order: bool = False   # the ring's waits/arrives ordered at the cluster's scope
    bk: int = 128                 # K bytes a step (128 or 64)
    stages: int = 4               # the ring's depth
    early_release: bool = False   # a step's MMAs retired before the next step's issue
    pingpong: bool = False        # 128x128 tiles a consumer warpgroup, taken in turn (else 128x256 shared)
    share_a: bool = False         # the pair along N sharing A's tile (else along M sharing B's)

    @property
    def cluster_tile(self) -> tuple[int, int]:
        """(rows, columns) of the pair's tiles side by side: along N where it shares A, else along M."""
        return (BM, self.pair * self.tile_n) if self.share_a else (self.pair * BM, self.tile_n)

    def boxes(self) -> tuple[int, int]:
        """Rows of a TMA box of A and of B: the shared operand's half in a pair, else the whole tile's
        rows, at most 128."""
        a = BM // self.pair if self.share_a else BM
        b = self.tile_n if self.share_a else self.tile_n // self.pair
        return a, min(b, BOX_ROWS)

    @property
    def tile_n(self) -> int:
        """Columns of a CTA's tile: 256 split between the consumers, or a ping-pong consumer's 128."""
        return 128 if self.pingpong else 256

    def defines(self) -> list[str]:
        return [f"-DCCO_PAIR={self.pair}", f"-DCCO_WIDE_STORES={int(self.wide_stores)}",
                f"-DCCO_CLUSTER_ORDER={int(self.cluster_order)}", f"-DCCO_BK={self.bk}",
                f"-DCCO_STAGES={self.stages}", f"-DCCO_EARLY_RELEASE={int(self.early_release)}",
                f"-DCCO_SHARE_A={int(self.share_a)}"]

    def shared(self) -> int:
        """Dynamic shared memory: the ring, its barriers (and the ping-pong's two turns), and the
        1024-byte alignment of the tiles."""
        return self.stages * (BM + self.tile_n) * self.bk + 8 * (2 * self.stages + 2 * self.pingpong) + 1024


def nvcc() -> str | None:
    """The nvcc that builds the kernel, or None (``cubin.nvcc``)."""
    return cubin.nvcc()


def ptxas_report(variant: Variant, directory: str, extra: tuple = ()) -> dict:
    """``registers``, ``spill_stores`` and ``spill_loads`` (bytes) of ``variant``'s kernel as ptxas
    reports them, compiled into ``directory`` with nvcc's ``extra`` options."""
    report = cubin.ptxas_report(SOURCE, variant.defines(), directory, extra)
    return report[KERNELS[variant.pingpong].decode()]


def build(variant: Variant = Variant()) -> str:
    """The cubin path of ``variant``, compiled by nvcc once per source text and variant."""
    return cubin.build(SOURCE, variant.defines())


def tensor_map(t: torch.Tensor, bk: int, box_rows: int = BOX_ROWS) -> ctypes.Array:
    """A CUtensorMap (128 bytes) of the row-major one-byte matrix ``t`` in boxes of ``box_rows``
    rows x ``bk`` bytes with the ``bk``-byte swizzle."""
    rows, cols = t.shape
    raw = (ctypes.c_uint8 * 192)()  # the map's address must be 64-byte aligned: carve it from a larger buffer
    m = (ctypes.c_uint64 * 16).from_address((ctypes.addressof(raw) + 63) & ~63)
    m._keep = raw
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(t.stride(0))
    box = (ctypes.c_uint32 * 2)(bk, box_rows)
    unit = (ctypes.c_uint32 * 2)(1, 1)
    cubin.check(cubin.driver().cuTensorMapEncodeTiled(m, _CU_TENSOR_MAP_UINT8, 2, ctypes.c_void_p(t.data_ptr()), dims,
                                                      strides, box, unit, 0, _SWIZZLE[bk], _L2_256B, 0),
                "cuTensorMapEncodeTiled")
    return m


def ptpc_pair_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, *,
                   out: torch.Tensor | None = None, group: int = GROUP, clusters: int | None = None,
                   variant: Variant = Variant()) -> torch.Tensor:
    """``(a @ b.T) * a_scale[:, None] * b_scale[None, :]`` in bf16: ``a`` [M, K] and ``b`` [N, K]
    e4m3, the scales fp32 of M and N; ``clusters`` clusters of ``variant.pair`` CTAs (default: one
    CTA an SM). M and N multiples of ``variant.cluster_tile``, K of ``variant.bk``."""
    m, k = a.shape
    n = b.shape[0]
    if variant.pair not in (1, 2) or variant.bk not in _SWIZZLE:
        raise ValueError(f"pair_gemm: pair is 1 or 2 and bk 64 or 128, not {variant}")
    rows, cols = variant.cluster_tile
    if m % rows or n % cols or k % variant.bk or b.shape[1] != k:
        raise ValueError(f"pair_gemm takes M % {rows} == 0, N % {cols} == 0, K % {variant.bk} == 0; "
                         f"got [{m}, {n}, {k}]")
    if not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("pair_gemm takes contiguous row-major operands")
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        raise ValueError(f"pair_gemm takes e4m3 operands, not {a.dtype} and {b.dtype}")
    if a_scale.numel() != m or b_scale.numel() != n:
        raise ValueError(f"pair_gemm takes a scale per row of A ({m}) and of B ({n}), not {a_scale.numel()} and "
                         f"{b_scale.numel()}")
    if out is not None and (out.shape != (m, n) or out.dtype != torch.bfloat16 or not out.is_contiguous()):
        raise ValueError(f"pair_gemm writes a contiguous bf16 [{m}, {n}] output, not {out.dtype} {tuple(out.shape)}")
    if group < 1 or (clusters is not None and clusters < 1):
        raise ValueError(f"pair_gemm takes group >= 1 and clusters >= 1, not {group} and {clusters}")
    a_scale, b_scale = a_scale.reshape(-1).float().contiguous(), b_scale.reshape(-1).float().contiguous()
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    props = torch.cuda.get_device_properties(a.device)
    tiles = (m // rows) * (n // cols)
    clusters = min(tiles, clusters or props.multi_processor_count // variant.pair)
    a_rows, b_rows = variant.boxes()
    map_a = tensor_map(a.view(torch.uint8), variant.bk, a_rows)
    map_b = tensor_map(b.view(torch.uint8), variant.bk, b_rows)
    ptrs = [ctypes.c_uint64(t.data_ptr()) for t in (a_scale, b_scale, out)]
    ints = [ctypes.c_int(v) for v in (m, n, k, group)]
    stream = torch.cuda.current_stream(a.device).cuda_stream
    with torch.cuda.device(a.device):  # the module is loaded into, and launched in, a's device's context
        fn = cubin.function(a.device.index, SOURCE, variant.defines(), KERNELS[variant.pingpong], variant.shared())
        cubin.launch(fn, (variant.pair * clusters, 1, 1), THREADS, variant.shared(), stream,
                     [map_a, map_b] + ptrs + ints)
    return out
