"""The decode GEMM: ``quantize(x) @ dequant(w).T`` for a few rows in one launch (device code:
``kernels_fused.hopper.decode_kernels``).

Unfused equivalent (``cco.nn`` layers at world 1, or the local GEMM of a column-parallel layer)::

    a, a_scale = quantize_activation(x, quant, k_padded=K_PAD)           # one launch
    out = vendor_gemm(a, a_scale, prepare_weight(w, w_scale, quant))[:, :N] (+ bias)   # one more (two with a bias)

At decode sizes (M of a few rows) both launches are tiny and the host's time to issue them is the
call's time in an eager model; cuBLAS's fp8 GEMMs there read the weight no faster than its bf16
GEMV reads twice the bytes (docs/decode.md). Here one Triton program per ``BLOCK_N`` output
features and activation row quantizes that row itself (the quantizer's bytes; ptpc first takes the
row's amax over K, re-read from L2 by every program) and streams its weight rows through CUDA-core
FMAs, so the call costs one launch and about the fp8 weight's read per row. Every row re-reads the
weight (from L2, mostly) and every program re-quantizes its row, so the kernel pays only for a few
rows: ``DECODE_MAX_M`` per quant. (A tensor-core version, 16-row tiles with the activations
quantized per program, ran 3-9x slower than the two launches on an H200: the per-program
quantization of 16 padded rows cost more than the weight's read; docs/decode.md.)

Calls of 2..``ROWS_MAX`` rows read the weight once for every row, one program per ``BLOCK_N``
weight rows on tensor cores. ptpc and blockscale (``QUANTIZED_ROWS``) quantize the rows first, in
the activation quantizer's launch, and then run the MMA over them, 16 to 64 rows wide (the weight
read at its bandwidth at every M: ``DECODE_MAX_M`` takes it up to 64 rows), with K split over
programs where the weight's blocks would leave SMs idle (``mma_split``; the split's counters
zeroed by the quantizer's launch in the call's scratch, ``MmaScratch``). A one-row call of these
quants takes the same two launches under a graph capture, the one-row kernel eagerly. In an eager call
whose grid fits the GPU at once (one program per SM) and whose weight is at most
``ONE_LAUNCH_MAX_BYTES`` both run as two phases of one cooperative launch with a grid-wide wait
between them (``decode_ptpc_kernel``): one launch and one allocation less on the host. Graph captures take the two launches (a replay costs the host nothing, and may run on any
stream beside another, where the wait's counter would be shared). With ``CCO_DECODE_BLOCKSCALE_CUBLAS=1``
blockscale's rows (``VENDOR_ROWS``, at a K that cuBLAS takes) are the layer's own two launches, the
quantizer's into rows padded to cuBLAS's multiple of 4 and cuBLAS's blockwise GEMM: here only so
that the C++ table takes the call whole, which saves its host time and not its device time. So are
mxfp8's rows where the caller
passes the weight's bf16 copy as ``w`` (the layers do, from the op's vendor GEMM): the quantizer's
launch, writing the rows quantized and dequantized to bf16, and cuBLAS's bf16 GEMM over the copy. The
C++ table makes these vendor GEMMs' calls itself (``KEPT_CALL``). mxfp8's 2..64 rows over its fp8
weight, where the caller vouches for the weight (``scales_checked``: the layers do for 2..``mx_rows_max``
rows, ``MX``), take the same quantizer's launch into bf16 rows and then ``mx_decode``'s CUDA C++
kernel, which dequantizes the e4m3 weight on its way to the tensor cores (half the copy's bytes).
The rows kernel, which quantizes the rows (padded to a power of two, repeated to the MMA's 16) in
every program, takes the rest (mxfp8's other rows over its fp8 weight): that costs more than the
weight's read.

The host side keeps, per call shape and device, the launches (``kernels_fused.hopper.launch``: the
compiled kernel's launcher called directly, most of a Triton launch's host cost saved). The key holds
everything Triton specializes on (the integer arguments' values, every pointer's dtype and 16-byte
alignment) and the device, so a kept launch is only reused where Triton would have picked the same
binary. Once a call shape has run here, its launches are handed to the C++ table
(``kernels_fused.hopper.native``), which takes the shape's later eager calls whole (key,
allocations, launches) in one call from Python; a call it does not take runs here.
"""

from __future__ import annotations

import functools
import os
import re
import warnings

import torch

from cco.quant import _TINY, FP8, FP8_MAX, QUANTS, SCALE_BLOCK
from kernels_fused.hopper import launch as launching, mx_decode, native, vendor
from kernels_fused.hopper.launch import Kernel, keep
from kernels_fused.hopper.quantize import (SPLIT_NUM_WARPS, _interpreting, _pow2, check_rows, empty_activation,
                                           launch_for, split_launch)

# Calls of at most this many rows take the decode GEMM (the layers' rule, cco.nn.parallel_linear);
# more rows go to the quantizer + vendor GEMM. scripts/tune_decode.py on one H200 (2026-12-03,
# docs/decode.md), device us per call under graph replay against bf16 nn.Linear's: at M = 1 0.66-0.85x
# (8B down / o_proj, 70B down; every quant). At 2..16 rows the rows kernel (13:10 UTC run,
# docs/results/2026-12-03_decode_rows_kernel_h200.json), against the two launches it replaces: ptpc at
# M = 2 34.7 / 10.7 / 68.4 us against 39.2 / 14.3 / 102.6 (8B down, 8B o, 70B down), at M = 4 43.7 /
# 13.3 / 86.4 against 39.4 / 14.4 / 103.1, at M = 8 1.3-1.8x slower; blockscale and mxfp8 1.4-4.9x
# slower at every M (the per-step scaling and the weight's dequantization cost more than its read).
# Eagerly the layer's host time is 24 us a call through it against 82-131 us for two launches.
# ptpc then quantizes the rows once (QUANTIZED_ROWS; 13:40 UTC run,
# docs/results/2026-12-03_decode_quantized_rows_h200.json): 23.9-24.6 / 7.2-7.5 / 61.8-63.5 us at
# every M from 2 to 16 (0.72-0.82x of bf16 at 8B, 0.54x at 70B down), the layer's eager call 37-52
# us of host time against the two launches' 80-99 (and the rows kernel's 24): so ptpc up to 16 rows.
# The same MMA 32 and 64 rows wide (17:08 UTC run, docs/results/2026-12-03_decode_wide_mma_h200.json):
# at M = 16..64 24.5-28.8 / 7.2-9.3 / 63.5-68.3 us against the two launches' 39.1-42.1 / 14.4-14.8 /
# 76.6-83.0 (0.72-0.79x / 0.73-1.00x / 0.52-0.54x of bf16), the layer's eager call 41-54 us of host
# time against 78-96: so ptpc up to 64 rows (MMA_ROWS_MAX).
# blockscale takes 2..64 rows too, through its MMA over quantized rows (QUANTIZED_ROWS below; with
# CCO_DECODE_BLOCKSCALE_CUBLAS=1 through VENDOR_ROWS where cuBLAS takes the K: decode_max_m); so does
# mxfp8, whose calls then pass the weight's bf16 copy as ``w`` (the layers do: VENDOR_ROWS).
# Its own MMA over quantized rows (e8m0 scales per 32 columns on both operands) ran 2.2-2.8x of bf16's
# device time at 8B down and 2..16 rows, the two launches 1.1x (2026-12-04, docs/decode.md "mxfp8's
# rows over the fp8 weight"; reverted).
DECODE_MAX_M = {"ptpc": 64, "blockscale": 64, "mxfp8": 64}
# Per quant, the best M = 1 config of that run: BLOCK_N output features per program (one program per
# BLOCK_N and row: no split of K, so no second pass); BLOCK_K columns per step, in groups of the
# format's scale group (GROUP); warps. ROW_K: ptpc's amax load.
BLOCK_N = {"ptpc": 16, "blockscale": 16, "mxfp8": 8}
BLOCK_K = {"ptpc": 1024, "blockscale": 1024, "mxfp8": 1024}
GROUP = {"ptpc": SCALE_BLOCK, "blockscale": SCALE_BLOCK, "mxfp8": 32}
ROW_K = 4096
NUM_WARPS = {"ptpc": 8, "blockscale": 8, "mxfp8": 4}
NUM_STAGES = {"ptpc": 3, "blockscale": 3, "mxfp8": 3}
_QUANT_CODE = {"ptpc": 0, "blockscale": 1, "mxfp8": 2}
# Calls of 2..ROWS_MAX rows: the rows kernel (every row in one program, tensor cores; the weight
# read once for all rows). Per quant: BLOCK_N weight rows per program (blockscale: divides 128),
# BLOCK_K columns a step (blockscale: 128, one scale group), warps, stages: the best of the run above
# at most cells (tune_decode's configs for M > 1).
ROWS_MAX = 16
ROWS_BLOCK_N = {"ptpc": 64, "blockscale": 64, "mxfp8": 32}
ROWS_BLOCK_K = {"ptpc": 256, "blockscale": 256, "mxfp8": 256}
ROWS_WARPS = {"ptpc": 4, "blockscale": 4, "mxfp8": 4}
ROWS_STAGES = {"ptpc": 4, "blockscale": 3, "mxfp8": 4}
ROWS_ELEMENTS = 8192  # ptpc's amax load: [rows, ROW_K] with rows * ROW_K at most this
# Quants whose calls of 2..MMA_ROWS_MAX rows quantize the rows once (the activation quantizer's split-row
# launch, its bytes) and then run the MMA over them (decode_mma_rows_kernel): two launches, but the
# rows kernel's per-program quantization grows with the rows (scripts/probe_decode_rows.py).
# blockscale joined (2026-12-05): its MMA over quantized rows, a step of two 128-column scale groups
# and K split over programs (MMA_SPLIT), ran 0.67-0.78x of nn.Linear's device time at 8B down and
# 0.93-1.38x at 8B o, 8..64 rows, where the quantizer + cuBLAS ran 0.89-1.30x and 1.58-1.87x
# (scripts/probe_decode_split_k.py, one H200, docs/decode.md). CCO_DECODE_BLOCKSCALE_CUBLAS=1 keeps
# its rows on the quantizer + cuBLAS (VENDOR_ROWS) as before.
BLOCKSCALE_CUBLAS = os.environ.get("CCO_DECODE_BLOCKSCALE_CUBLAS", "0") == "1"
QUANTIZED_ROWS = {"ptpc"} if BLOCKSCALE_CUBLAS else {"ptpc", "blockscale"}
# Their calls of ROWS_MAX+1..MMA_ROWS_MAX rows run the same MMA, ROWS (a power of two) wide, with the
# WIDE_* config (BLOCK_N, BLOCK_K, warps, stages): the best of tune_decode's 8 configs past ROWS_MAX
# rows at 14 of the 15 cells of the 17:08 UTC run above (8B o at 48 rows took BLOCK_K 128, 9.3 us).
MMA_ROWS_MAX = 64
WIDE_BLOCK_N = {"ptpc": 64, "blockscale": 64}
WIDE_BLOCK_K = {"ptpc": 256, "blockscale": 256}
WIDE_WARPS = {"ptpc": 4, "blockscale": 4}
WIDE_STAGES = {"ptpc": 4, "blockscale": 3}
# The MMA's K split over programs (decode_mma_rows_kernel's SPLIT): a weight of N / BLOCK_N blocks
# (64 at Llama-3-8B's o and down, 4096 features) leaves SMs idle, so each block's K is split into the
# most slices, a power of two up to MMA_SPLIT[quant], that keep N / BLOCK_N * slices at most
# MMA_SPLIT_WAVES[quant] programs per SM, each slice at least two steps. The last program of a block
# to finish sums the partials in slice order (the bits independent of the order they finish in).
# One H200 (2026-12-05
# 14:40 UTC, scripts/probe_decode_split_k.py, docs/decode.md), device us under graph replay at 1..64
# rows: ptpc split 2 at 8B down 20.8-23.6 against 23.8-27.5 unsplit, 8B o equal, 70B down and 8B
# qkv (128 and 96 blocks) best unsplit; blockscale split 4 (two groups a step) at 8B down 21.8-28.6
# against 28.8-43.8 unsplit, 8B o 8.5-12.3 against 9.0-13.8, 70B down 63-89 against 67-120, 8B qkv
# 9.8-15.4 against 9.4-14.7. On an H100 (15:00 UTC, the same probe through decode._Launch) 4 slices
# lost to 2 at 96 and 128 blocks from 32 rows (8B qkv 16.1 / 19.9 against 12.4 / 15.7 us at 32 / 64
# rows, 70B down 100 / 108 against 95 / 103), so blockscale takes 4 up to two programs per SM.
# ptpc's cap went from 2 to 8 (2026-12-05 night, one H100, the same probe at 8B kv: 16 blocks, K 4096,
# 8 / 16 rows, BLOCK_K 256): split 2 6.39 / 6.52 us, 4 5.92 / 6.02, 8 5.97 / 6.02 against nn.Linear's
# 6.36 / 6.41; the waves bound keeps weights of more than 33 blocks where they were (8B o and down at 2).
# From MMA_SPLIT_WIDE_ROWS rows (the MMA's ROWS) on, ptpc's cap is MMA_SPLIT_WIDE's 4: a block's last
# program sums SPLIT partials of [BLOCK_N, ROWS] fp32, and at 8B kv (16 blocks) 8 slices of two steps
# lost to 4 from 32 rows. blockscale's cap went from 4 to 8 (its weights of 33 blocks or fewer: more
# take fewer slices by the waves bound), where its MMA, which waits for each scale group's product,
# gains from every slice. One H100, 2026-12-06, probe_decode_split_k --cold --block-n 64 --block-k
# 256 at 8B kv at TP 1 / 2 / 8 (16 / 8 / 2 blocks, K 4096), 2..64 rows, a weight a call: ptpc at 32 /
# 64 rows 4 slices 7.8 / 8.9, 6.5 / 7.8, 6.3 / 7.3 us against 8 slices' 8.2 / 10.0, 6.5 / 8.1, 6.4 /
# 7.8 (equal at 2..16 rows); blockscale 8 slices 6.8-9.5, 5.7-7.8, 5.5-7.6 us against 4 slices'
# 7.1-10.7, 5.8-8.9, 5.5-8.5 (the gap growing with the rows: 1.1 us at 64 rows at TP 1).
MMA_SPLIT = {"ptpc": 8, "blockscale": 8}
MMA_SPLIT_WIDE_ROWS = 32
MMA_SPLIT_WIDE = {"ptpc": 4, "blockscale": 8}
MMA_SPLIT_WAVES = {"ptpc": 1, "blockscale": 2}
# One row under a graph capture takes the quantizer + MMA where the fp8 weight has at least this many
# bytes, else the one-row kernel as eagerly: the quantizer's launch costs ~2 us of a replay, which a
# small weight's faster read does not win back (8B o_proj, 16.8 MB: 7.1 / 8.6 us against the one-row
# kernel's 6.8 / 7.6, ptpc / blockscale; 8B qkv, 25.2 MB: 7.8 / 9.9 against 10.3 / 12.6; one H100,
# 2026-12-05, docs/decode.md).
CAPTURED_ROW_MIN_BYTES = 20 << 20
# ptpc's 2..MMA_ROWS_MAX rows in one launch (decode_ptpc_kernel: the quantizer's items as a first
# phase of the MMA's grid, a grid-wide wait between), in eager calls whose grid is resident at once
# (at most one program per SM: N <= 64 * SMs) and whose weight is small (below). Its items are few and wide (``one_slices``): about one
# per program, at most ONE_SLICE_K columns, the row's amax ONE_ROW_BLOCK columns a load; each item is
# a chain of round trips to memory (the amax's loads, the slice's, its store), so a program that
# walks four items of four amax loads each (the split quantizer's slicing, 4096-column loads) took
# 17-21 us more than the two launches at 64 rows on an H200 (docs/decode.md). The bytes do not depend
# on the slicing.
ONE_ROW_BLOCK = 16384
ONE_SLICE_K = 16384
# ... and whose fp8 weight is at most this many bytes. The one launch saves the host 7-17 us a call
# and costs the device 0.5-6 us more than the two launches' kernels (the wait, the quantizing phase
# on N / 64 programs; tune_decode --host-only on one H200, 2026-12-03, docs/decode.md). Calls that
# read a bigger weight are bound by the device in an eager model (70B down, 235 MB: 60-66 us of
# device time against ~30-40 us of host time), where the one launch only adds; 8B down (59 MB:
# 23-28 us device, 25-50 us host) and smaller are bound by the host.
ONE_LAUNCH_MAX_BYTES = 64 << 20
# Quants whose calls of 2+ rows take the launches of the layer's general path, bit for bit, without
# its Python around them, so that the C++ table takes the call whole (its host time saved, not its
# device time). blockscale: the activation quantizer's launch into rows padded to cuBLAS's multiple
# (vendor.BLOCKWISE_ROW_MULTIPLE) and cuBLAS's blockwise GEMM; its own MMA over quantized rows was
# 1.1-1.9x slower on the device (docs/decode.md), its rows kernel 1.4-4.9x. mxfp8, where the caller
# passes the weight's bf16 copy as ``w`` (``vendor.VendorWeight.dense``: cuBLAS on Hopper has no e8m0
# scaling): the quantizer's launch writing the rows quantized and dequantized to bf16 (the bytes of the
# general path's quantizer and ``vendor.mx_to_bf16``, in one launch instead of two) and cuBLAS's bf16
# GEMM over the copy; over the fp8 weight its rows take the rows kernel.
VENDOR_ROWS = {"blockscale", "mxfp8"} if BLOCKSCALE_CUBLAS else {"mxfp8"}
# The C++ table makes their vendor GEMM's call itself (KEPT_CALL): blockscale's cuBLASLt call kept
# per call shape (LT_ROWS; torch rebuilds its descriptor and asks the heuristic on every _scaled_mm
# call), mxfp8's cublasGemmEx on torch's own handle with torch's arguments and flags (at::mm's
# dispatcher, checks and resize saved: 2-5 us of an eager call's host time on an H200, docs/decode.md).
LT_ROWS = {"blockscale"}
# False (``CCO_DECODE_ONE_LAUNCH=0``): ptpc's rows always take the two launches (read per call: a
# benchmark times both in the same passes; a job whose GPU share refuses cooperative launches may
# set it, although a refused launch already falls back by itself).
ONE_LAUNCH = os.environ.get("CCO_DECODE_ONE_LAUNCH", "1") != "0"
# False (``CCO_DECODE_KEPT_CALL=0``): a VENDOR_ROWS call through the C++ table calls torch's op as the
# Python path does (``at::_scaled_mm``, ``at::mm``), instead of its plan's kept call (read per call,
# so a benchmark may time both in the same passes; a shape planned while it is False keeps none).
KEPT_CALL = os.environ.get("CCO_DECODE_KEPT_CALL", "1") != "0"
# mxfp8's rows over its fp8 weight, where the caller vouches for the weight (``decode_gemm``'s
# ``scales_checked``: ``mx_decode.unsuited`` passed it, so its e8m0 scales are at most 2^7 and the
# kernel is loaded): the quantizer's launch writing the rows quantized and dequantized to bf16 (as
# VENDOR_ROWS's), then ``kernels_fused.hopper.mx_decode``'s CUDA C++ kernel, which reads the e4m3
# weight once (the bf16 copy is twice its bytes). The layers' rule (``mx_rows_max``): 2..MX_ROWS_MAX
# rows, 2..MX_NARROW_ROWS_MAX where K_pad < MX_WIDE_MIN_K; more rows read the copy. One H100,
# cold, quantizer + kernel against the copy's path (scripts/probe_mx_decode.py, 2026-12-07,
# docs/results/2026-12-07k_mx_decode_h100/): 0.64-0.84x against 1.02-1.13x of nn.Linear's device
# time at 2..16 rows over Llama-3-8B down / gate / o and 70B down; at 32 rows 0.75-0.81x (8B down,
# gate, 70B down) and 1.07 against 1.15 (8B o); at K 2048 (8B o at TP 2) 1.09-1.17x against 1.20 at
# 2..16 rows but 1.34 against 1.20 at 32; at 64 rows 1.11-1.56x against 1.03-1.15 everywhere.
# False (``CCO_DECODE_MX=0``; a layer reads it when it is made): the layers' mxfp8 rows read the bf16 copy.
MX = os.environ.get("CCO_DECODE_MX", "1") != "0"
MX_ROWS_MAX = 32
MX_NARROW_ROWS_MAX = 16
MX_WIDE_MIN_K = 4096
MX_CODE = 3  # the C++ table's quant code of these calls (their plans differ from mxfp8's others)


def mx_rows_max(k_padded: int) -> int:
    """The most rows of an mxfp8 call over ``k_padded`` columns that the layers run through
    ``mx_decode`` (``MX``); 0 where it is off."""
    if not MX:
        return 0
    return MX_ROWS_MAX if k_padded >= MX_WIDE_MIN_K else MX_NARROW_ROWS_MAX


def decode_max_m(quant: str, k_padded: int) -> int:
    """The layers' rule: calls of at most this many rows of ``quant`` over a weight of ``k_padded``
    columns take the decode GEMM. A ``VENDOR_ROWS`` quant whose K cuBLAS does not take
    (``vendor.takes_rows``) keeps one row: its rows would run the rows kernel."""
    if quant in VENDOR_ROWS and not vendor.takes_rows(quant, vendor.BLOCKWISE_ROW_MULTIPLE, k_padded):
        return 1
    return DECODE_MAX_M[quant]


def lt_workspace_bytes(device: int) -> int:
    """The workspace bound torch's own cuBLASLt call offers its heuristic on ``device``
    (``at::cuda::getCUDABlasLtWorkspaceSize``): the heuristic's pick depends on it, and the C++
    table's kept cuBLASLt call must pick torch's algorithm to give its bits. ``CUBLASLT_WORKSPACE_SIZE``
    (KiB) where set, else 1 MiB, capped at cuBLAS's workspace (``CUBLAS_WORKSPACE_CONFIG``'s
    ``:KiB:count`` pairs, else 32 MiB on Hopper and Blackwell, 8 MiB + 128 KiB before) while the two
    are unified (torch's default, ``TORCH_CUBLASLT_UNIFIED_WORKSPACE``). torch 2.11 asked with 1 MiB on
    an H200 (cuBLASLt's API log, docs/decode.md); a bound of 32 MiB picked another kernel at 32 and 64
    rows of K 14336. test_cuda_nn's check_decode_vendor holds the bits equal on the installed torch,
    and ``_same_bits`` guards each new plan against a torch whose rule moved."""
    major = torch.cuda.get_device_capability(device)[0]
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    pairs = re.findall(r":([0-9]+):([0-9]+)", config or "")
    cublas = (sum(int(size) * 1024 * int(count) for size, count in pairs) if pairs
              else 32 << 20 if major in (9, 10, 12) else (8 << 20) + (128 << 10))
    unified = os.environ.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1").strip().lower() not in ("0", "false", "off",
                                                                                            "no", "n")
    lt = os.environ.get("CUBLASLT_WORKSPACE_SIZE", "").strip()
    size = int(lt) * 1024 if lt.isdigit() else 1 << 20
    return min(size, cublas) if unified else size


def vendor_rows(quant: str, m: int, k_padded: int, device: int, dense: bool = False) -> int:
    """Rows the quantizer writes for a call of ``m`` rows on ``device`` that takes the vendor GEMM
    (``VENDOR_ROWS``), 0 where it takes a decode kernel. blockscale: ``m`` padded with zero rows to
    cuBLAS's multiple, 0 at one row and on the CPU (Triton's interpreter: no blockwise GEMM). mxfp8:
    ``m`` where the weight is its bf16 copy (``dense``; torch's matmul on the CPU too), else 0."""
    if quant == "mxfp8":
        return m if dense else 0
    if quant not in VENDOR_ROWS or m < 2 or device < 0:
        return 0
    rows = vendor.padded_rows(quant, m)
    return rows if vendor.takes_rows(quant, rows, k_padded) else 0


def rows_max(quant: str) -> int:
    """The most rows one program of the decode GEMM takes for ``quant`` (past them: the one-row
    kernel, a program per row)."""
    return MMA_ROWS_MAX if quant in QUANTIZED_ROWS else ROWS_MAX


def tables(quant: str, m: int) -> tuple:
    """The config tables (BLOCK_N, BLOCK_K, warps, stages) of the kernel that takes ``m`` rows of
    ``quant``."""
    if 1 < m <= ROWS_MAX:
        return ROWS_BLOCK_N, ROWS_BLOCK_K, ROWS_WARPS, ROWS_STAGES
    if ROWS_MAX < m <= rows_max(quant):
        return WIDE_BLOCK_N, WIDE_BLOCK_K, WIDE_WARPS, WIDE_STAGES
    return BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES


@functools.cache
def _kernel(which: str):
    """The decode GEMM's device code: "row" (one program per row and feature block), "rows" (every
    row in one program, quantized there), "mma" (every row in one program, quantized before)."""
    from kernels_fused.hopper import decode_kernels as dk

    return {"row": dk.decode_gemv_kernel, "rows": dk.decode_rows_kernel, "mma": dk.decode_mma_rows_kernel,
            "one": dk.decode_ptpc_kernel}[which]


@functools.cache
def _quantize_kernel():
    from kernels_fused.hopper import quantize_kernels

    return quantize_kernels.quantize_ptpc_split_kernel


def block_k(quant: str, k_padded: int) -> int:
    """The K step of ``quant`` for a weight of ``k_padded`` columns (a multiple of 128): the
    format's step where it divides ``k_padded``, else the largest power of two times 128 that does."""
    step = BLOCK_K[quant]
    while k_padded % step:
        step //= 2
    return max(step, GROUP[quant])


def check_operands(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, quant: str, n: int,
                   bias: torch.Tensor | None) -> None:
    """Raise ValueError naming the argument that :func:`decode_gemm` cannot take."""
    fn = "decode_gemm"
    if quant not in QUANTS:
        raise ValueError(f"{fn}: quant={quant!r} is not supported; pass one of {', '.join(QUANTS)}")
    check_rows(x, fn)
    dense = quant == "mxfp8" and w.dtype == torch.bfloat16  # its bf16 copy (VENDOR_ROWS)
    if (w.dtype != FP8 and not dense) or w.dim() != 2 or not w.is_contiguous() or w.shape[1] % SCALE_BLOCK \
            or w.shape[1] < x.shape[1]:
        also = " (mxfp8: or its bf16 copy)" if quant == "mxfp8" else ""
        raise ValueError(f"{fn}: w must be a contiguous row-major e4m3 [N_pad, K_pad] weight{also} with K_pad a "
                         f"multiple of {SCALE_BLOCK} and >= K={x.shape[1]}, got {w.dtype} {list(w.shape)}")
    if not 0 < n <= w.shape[0]:
        raise ValueError(f"{fn}: n={n} must be in 1..{w.shape[0]} (the weight's rows)")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"{fn}: bias must be a contiguous [{n}] tensor, got {list(bias.shape)}")


def decode_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, quant: str, *, n: int,
                bias: torch.Tensor | None = None, scales_checked: bool = False) -> torch.Tensor:
    """bf16 ``[..., n]``: ``x [..., K]`` (``M`` rows in all) quantized as ``quant``
    (``kernels_fused.hopper.quantize``'s bytes, columns ``K..K_pad`` zero) times the first ``n`` rows
    of the fp8 weight ``w [N_pad, K_pad]`` (row-major, ``cco.quant``'s scales ``w_scale``), rounded to
    bf16, plus ``bias`` (rounded again, as ``out += bias``). mxfp8's ``w`` may be the weight's bf16
    copy instead (``mx_to_bf16(w, w_scale)``, ``vendor.VendorWeight.dense``; ``w_scale`` is then
    only checked): the layer's general path's bytes, the quantizer writing the rows dequantized to
    bf16, then cuBLAS's bf16 GEMM (``VENDOR_ROWS``). One launch (ptpc
    at 2..``MMA_ROWS_MAX`` rows two, the quantizer's and the MMA's, where the grid does not fit the
    GPU at once, the weight is over ``ONE_LAUNCH_MAX_BYTES``, ``ONE_LAUNCH`` is off, or under a graph
    capture; blockscale at 2+ rows the quantizer's and cuBLAS's, ``VENDOR_ROWS``); meant for ``M <=
    decode_max_m(quant, K_pad)`` rows (more run, slower than the vendor GEMM). ``scales_checked``
    (mxfp8 over its fp8 weight, on a GPU): the caller has found the weight suited to ``mx_decode``
    (``mx_decode.unsuited`` gave None for it), so its 2..``mx_decode.M_MAX`` rows take that kernel
    after the quantizer's launch (``MX``); else they take the Triton rows kernel. Operands are checked
    by :func:`check_operands` once per call shape (the key holds the column stride too); a shape's
    later calls go through ``native``'s C++ table where it is built."""
    code = MX_CODE if scales_checked and quant == "mxfp8" else _QUANT_CODE.get(quant, -1)  # (the table's key)
    table = native.TABLE
    if table is not None and native.ENABLED and launching.FAST_LAUNCH and not launching.launch_hooks():
        device = x.get_device()
        if device >= 0:  # the C++ table's call: None where it does not take it (native's module)
            try:
                out = table.run(x, w, w_scale, bias, n, code, ONE_LAUNCH, KEPT_CALL,
                                torch._C._cuda_getCurrentRawStream(device))
            except RuntimeError as err:  # its cooperative launch refused: the path below warns and plans anew
                if "cooperative" not in str(err):
                    raise
                out = None
            if out is not None:
                return out
    k = x.shape[-1]
    out = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16, device=x.device)
    if x.dim() == 2:
        m, row_stride = x.shape[0], x.stride(0)
    elif x.is_contiguous():  # the rows of [B, S, K] as they lie: no reshape on the host's path
        m, row_stride = x.numel() // k if k else 0, k
    else:
        x = x.reshape(-1, k)
        m, row_stride = x.shape[0], x.stride(0)
    if not m:
        return out
    key = (m, k, x.dtype, row_stride, x.stride(-1), x.data_ptr() % 16, w.shape, w.dtype, w.data_ptr() % 16,
           scales_checked, w_scale.stride(0), w_scale.data_ptr() % 16, n, quant,
           None if bias is None else (bias.dtype, bias.data_ptr() % 16),
           x.get_device())  # a compiled kernel is loaded on one device: a process may drive several
    launch = _LAUNCHES.get(key)
    if launch is None:  # bounded (launch.LAUNCHES_KEPT)
        check_operands(x.view(-1, k) if x.dim() != 2 else x, w, w_scale, quant, n, bias)
        # (the kernel adds a bf16 bias: another dtype's rows take the rows kernel, which reads any)
        mx = code == MX_CODE and key[-1] >= 0 and w.dtype == FP8 and (bias is None or bias.dtype == torch.bfloat16)
        launch = keep(_LAUNCHES, key, _Launch(m, k, w.shape[1], n, quant, bias is not None, key[-1],
                                              dense=w.dtype == torch.bfloat16, mx=mx, w=w, w_scale=w_scale))
    launch(x, row_stride, w, w_scale, bias, out)
    if key[-1] >= 0 and native.ENABLED:
        _plan(launch, x, row_stride, w, w_scale, bias, n, quant, code)
    return out


def _plan(launch, x, row_stride, w, w_scale, bias, n, quant, code) -> None:
    """Hand the C++ table this call shape's launches where they changed since it last had them (a
    first call, a path's first launch), and start its build at a process's first CUDA call."""
    table = native.TABLE
    if table is None:
        native.start()
        return
    compiled = launch.compiled()
    if launch.planned == compiled:
        return
    launch.planned = compiled
    device = x.get_device()
    try:
        one, two, scratch_one, scratch_two = launch.plan(row_stride, w_scale.stride(0))
        # (a capture cannot compare the kept call's bits, below: its shape keeps torch's call)
        kept = launch.vendor and KEPT_CALL and not _capturing(device)
        kept_call = (lt_workspace_bytes(device) if quant in LT_ROWS else 1) if kept else 0
        add = functools.partial(table.add, x, w, w_scale, bias, n, code, one, two, scratch_one, scratch_two,
                                launch.vendor)
        launches = (launch.one, launch.quantize, launch.kernel)  # held by the plan: its kernels stay loaded
        add(kept_call, launches)
        if kept_call and not table.kept_error() and not _same_bits(table, x, w, w_scale, bias, n, quant, device):
            add(0, launches)  # torch's own call for this shape from now on
    except ValueError as err:  # a launch the table cannot replay (another Triton's ABI): stays here
        warnings.warn(f"decode_gemm: this call shape stays on the Python path ({err})", RuntimeWarning, stacklevel=3)


# Call shapes (M, K_pad, N) whose kept call gave other bits than torch's call on their first call
# (_same_bits): they keep torch's call. Bounded as the table's plans are.
KEPT_DIFFERED: dict = {}


def _same_bits(table, x, w, w_scale, bias, n, quant, device) -> bool:
    """Whether a new vendor plan's kept call gives torch's bits on this call's rows: both run once
    through the table and are compared (one wait for the device, once per call shape). At
    Llama-3-8B's and -70B's down_proj with 32 and 64 rows blockscale's two differed on an H200
    (2026-12-04) while ``lt_workspace_bytes`` gave 32 MiB and torch 2.11 asked with 1 MiB: the
    heuristic picks by the bound (docs/decode.md, "The kept cuBLASLt call's bits"). The rule now
    gives torch's bound, and mxfp8's call is torch's own on torch's handle; this guards a torch whose
    calls move (another BLAS library preferred, another rule). Where they differ the shape keeps
    torch's call."""
    stream = torch._C._cuda_getCurrentRawStream(device)
    kept = table.run(x, w, w_scale, bias, n, _QUANT_CODE[quant], False, True, stream)
    theirs = table.run(x, w, w_scale, bias, n, _QUANT_CODE[quant], False, False, stream)
    same = kept is not None and theirs is not None and torch.equal(kept, theirs)
    if not same:
        keep(KEPT_DIFFERED, (x.numel() // x.shape[-1], w.shape[1], n), True, native.PLANS_KEPT)
    return same


_LAUNCHES: dict = {}
# Per (device, stream): the grid-wide wait's [count, generation] of ptpc's one-launch calls (int32,
# zeroed once). Calls on one stream never overlap, calls on two streams never share one; graph
# captures take the two launches (a graph may be replayed on any stream, beside another).
_SYNC: dict = {}
SYNC_KEPT = 64


def _sync(device: int, where: torch.device) -> torch.Tensor:
    """The wait's counter of ``device``'s (its object: ``where``) current stream."""
    stream = torch._C._cuda_getCurrentRawStream(device) if device >= 0 else 0
    sync = _SYNC.get((device, stream))
    if sync is None:
        sync = keep(_SYNC, (device, stream), torch.zeros(2, dtype=torch.int32, device=where), SYNC_KEPT)
    return sync


def mma_rows(m: int) -> int:
    """The MMA over ``m`` quantized rows' width (its ``ROWS``): a power of two, at least 16, the MMA's
    least N."""
    return max(16, _pow2(m))


def resident_programs(device: int) -> int:
    """How many programs of one launch are resident at once for certain: one per SM on a GPU (a kernel
    that compiles fits one program per SM), one under Triton's interpreter (it runs them in turn)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device >= 0 else 1


def one_slices(m: int, k_padded: int, programs: int) -> tuple[int, int]:
    """``(SLICES, SLICE_K)`` of ``decode_ptpc_kernel``'s quantizing phase: each of the ``m`` rows cut
    into about ``programs / m`` slices (one item per program), a power of two columns wide, at most
    ``ONE_SLICE_K``, at least 128."""
    slice_k = min(max(_pow2(-(-k_padded // max(1, programs // m))), SCALE_BLOCK), ONE_SLICE_K)
    return -(-k_padded // slice_k), slice_k


def mma_split(quant: str, programs: int, steps: int, device: int, rows: int = 16) -> int:
    """The MMA's K slices per weight block for a weight of ``programs`` blocks and ``steps`` K steps
    on ``device``, the MMA ``rows`` wide (its ``ROWS``): ``MMA_SPLIT`` (from ``MMA_SPLIT_WIDE_ROWS``
    rows ``MMA_SPLIT_WIDE``), halved while the grid would exceed ``MMA_SPLIT_WAVES`` programs per
    SM (one SM under Triton's interpreter: ``resident_programs``) or a slice would have fewer than
    two steps."""
    cap = (MMA_SPLIT_WIDE if rows >= MMA_SPLIT_WIDE_ROWS else MMA_SPLIT)[quant]
    split, most = cap, MMA_SPLIT_WAVES[quant] * resident_programs(device)
    while split > 1 and (programs * split > most or steps < 2 * split):
        split //= 2
    return split


class MmaScratch:
    """Byte offsets of the MMA over quantized rows' one scratch: the e4m3 rows ``[M, K_PAD]``, their
    fp32 scales (ptpc ``[M]``, blockscale ``[K_PAD / 128, M]``: the quantizer's layout, each group's
    rows adjacent), the split's int32 counters (one per weight block, a power of two of them: the
    quantizer zeroes them), its fp32 partials (``SPLIT`` of ``[BLOCK_N, ROWS]`` per block), each
    start 16-byte aligned (Triton specializes on it)."""

    __slots__ = ("m", "k_padded", "quant", "scales", "counters", "counter_words", "parts", "part_floats", "bytes")

    def __init__(self, quant: str, m: int, k_padded: int, programs: int, split: int, block_n: int, rows: int):
        up = lambda v: -(-v // 16) * 16  # noqa: E731
        self.m, self.k_padded, self.quant = m, k_padded, quant
        self.scales = up(m * k_padded)
        # (where the quantizer zeroes them: zero_after_scales, the scales' end rounded up to 16 bytes)
        self.counters = self.scales + up(4 * m * (k_padded // SCALE_BLOCK if quant == "blockscale" else 1))
        self.counter_words = _pow2(programs) if split > 1 else 0
        self.parts = up(self.counters + 4 * max(1, self.counter_words))
        self.part_floats = programs * split * block_n * rows if split > 1 else 0
        self.bytes = self.parts + 4 * max(1, self.part_floats)

    def views(self, scratch: torch.Tensor) -> tuple:
        """``(q, sa, counters, parts)`` over ``scratch`` (uint8, ``bytes`` long); where there is no
        split the last two are 4-byte views the kernel never reads."""
        m, k = self.m, self.k_padded
        q = scratch[:m * k].view(FP8).view(m, k)
        groups = k // SCALE_BLOCK if self.quant == "blockscale" else 1
        sa = scratch[self.scales:self.scales + 4 * m * groups].view(torch.float32)
        if self.quant == "blockscale":
            sa = sa.view(groups, m).t()  # [M, K_PAD / 128], M-major as the quantizer writes it
        counters = scratch[self.counters:self.counters + 4 * max(1, self.counter_words)].view(torch.int32)
        parts = scratch[self.parts:self.parts + 4 * max(1, self.part_floats)].view(torch.float32)
        return q, sa, counters, parts


def _capturing(device: int) -> bool:
    return device >= 0 and torch._C._cuda_isCurrentStreamCapturing()


def rows_and_scales(rows: int, k_padded: int) -> int:
    """Bytes of ptpc's quantized rows in one scratch: the e4m3 rows, then their fp32 scales (16-byte
    aligned: ``k_padded`` is a multiple of 128)."""
    return rows * (k_padded + 4)


def into_out(out, m: int, n: int, q_rows: int, n_padded: int, bias, gemm) -> None:
    """What :func:`vendor_gemm` and :func:`dense_gemm` share: ``gemm(full)`` writes the vendor GEMM's
    whole product [q_rows, n_padded] into ``full``, which is the call's own ``out`` [m, n] where the
    shapes agree, else a new tensor whose share ``[:m, :n]`` is copied out (zero rows padded for
    cuBLAS, the weight's padded features); then ``out += bias`` (the C++ table's ``into_out``)."""
    rows = out.view(m, n)
    whole = q_rows == m and n_padded == n
    full = rows if whole else torch.empty(q_rows, n_padded, dtype=torch.bfloat16, device=out.device)
    gemm(full)
    if not whole:
        rows.copy_(full[:m, :n])
    if bias is not None:
        out += bias


def vendor_gemm(q, sa, w, w_scale, bias, out, m: int, n: int) -> None:
    """``out [..., n] = (q @ dequant(w).T)[:m, :n] (+ bias)`` by cuBLAS's blockwise GEMM, as the layer's
    general path computes it (``vendor.bound_gemm``, then ``out += bias``); the C++ table makes the
    same calls (``csrc/decode_calls.cpp``, ``vendor_gemm``)."""
    into_out(out, m, n, q.shape[0], w.shape[0], bias, lambda full: torch._scaled_mm(
        q, w.t(), scale_a=sa, scale_b=w_scale.t(), out_dtype=torch.bfloat16, out=full))


def dense_gemm(a, w, bias, out, m: int, n: int) -> None:
    """``out [..., n] = (a @ w.T)[:, :n] (+ bias)``: mxfp8's rows ``a`` dequantized to bf16 [m, K_pad]
    times the weight's bf16 copy ``w`` [N_pad, K_pad] by cuBLAS's bf16 GEMM, as the layer's general
    path computes it (``vendor.bound_gemm``, its ``[:, :n]`` share, then ``out += bias``); the C++
    table makes the same calls (``csrc/decode_calls.cpp``, ``dense_gemm``)."""
    into_out(out, m, n, a.shape[0], w.shape[0], bias, lambda full: torch.matmul(a, w.t(), out=full))


def _block(quant: str, m: int, k_padded: int) -> tuple:
    """``(BLOCK_N, BLOCK_K, launch options)`` of the kernel that takes ``m`` rows of ``quant`` over
    ``k_padded`` columns (``tables``; BLOCK_K halved until it divides ``k_padded``)."""
    table_n, table_k, table_warps, table_stages = tables(quant, max(m, 2))
    block_n = table_n[quant]
    if quant == "blockscale" and SCALE_BLOCK % block_n:  # a program's rows share one weight scale block
        raise ValueError(f"decode_gemm: BLOCK_N={block_n} must divide {SCALE_BLOCK} for blockscale")
    step = table_k[quant]
    if quant == "blockscale" and quant not in QUANTIZED_ROWS:  # the rows kernel: one scale group a step
        step = SCALE_BLOCK
    while k_padded % step:  # (a power of two times 128 that divides it: 128 does)
        step //= 2
    return block_n, step, dict(num_warps=table_warps[quant], num_stages=table_stages[quant])


def _mma(quant: str, m: int, k_padded: int, n: int, has_bias: bool, device: int) -> tuple:
    """``(kernel, layout, ints, consts)`` of the MMA over ``m`` quantized rows of a ``QUANTIZED_ROWS``
    quant: its launch (a program per weight block and K slice), its scratch (``MmaScratch``) and its
    integer arguments and constants in the kernel's order: M, N, K_PAD, K_SLICE, scale stride
    (blockscale's rows: M), then QUANT, HAS_BIAS, BLOCK_N, BLOCK_K, ROWS, SPLIT, ROUND_IN_FP32."""
    block_n, step, options = _block(quant, m, k_padded)
    programs = -(-n // block_n)
    split = mma_split(quant, programs, k_padded // step, device, mma_rows(m))
    layout = MmaScratch(quant, m, k_padded, programs, split, block_n, mma_rows(m))
    ints = (m, n, k_padded, -(-(k_padded // step) // split) * step, m if quant == "blockscale" else 0)
    consts = (_QUANT_CODE[quant], has_bias, block_n, step, mma_rows(m), split, _interpreting())
    return Kernel(_kernel("mma"), (programs, split), **options), layout, ints, consts


class RowsMma:
    """The decode MMA over ``m`` rows quantized elsewhere (the e4m3 rows ``[m, K_PAD]``, contiguous,
    and their scales in the activation quantizer's layout: ptpc fp32 ``[m]``, blockscale fp32
    ``[K_PAD / 128, m]`` storage), for a caller that holds them already: a collective call of a
    few rows computes its partial so on every multiprocessor before the lsa kernel moves it
    (``cco.backends.cuda.DECODE_SPLIT_ROWS``). ptpc and blockscale (``QUANTIZED_ROWS``), 1..
    ``MMA_ROWS_MAX`` rows. It keeps its split's counters and partials (one launch at a time: the
    caller's stream orders its calls); the counters start at zero and each block's last slice
    sets its count back to zero (``decode_mma_rows_kernel``), so a call is the MMA's one launch."""

    __slots__ = ("kernel", "ints", "consts", "counters", "parts")

    def __init__(self, quant: str, m: int, k_padded: int, n: int, device: torch.device):
        if quant not in QUANTIZED_ROWS or not 1 <= m <= MMA_ROWS_MAX:
            raise ValueError(f"RowsMma: {quant} rows of {m}: the MMA over quantized rows takes "
                             f"{sorted(QUANTIZED_ROWS)} at 1..{MMA_ROWS_MAX} rows")
        index = device.index if device.type == "cuda" else -1
        self.kernel, layout, self.ints, self.consts = _mma(quant, m, k_padded, n, False, index)
        self.counters = torch.zeros(max(1, layout.counter_words), dtype=torch.int32, device=device)
        self.parts = torch.empty(max(1, layout.part_floats), dtype=torch.float32, device=device)

    def __call__(self, q: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                 out: torch.Tensor) -> None:
        """``out [m, N] = (q @ dequant(w).T)`` in bf16 (``w [N_pad, K_PAD]`` row-major e4m3, ``w_scale``
        in ``cco.quant``'s layout; ``out`` contiguous)."""
        self.kernel(out.get_device(), q, sa, w, w_scale, out, out, self.counters, self.parts, *self.ints,
                    w_scale.stride(0), *self.consts)


class _Launch:
    """One call shape's launches: the kernel that takes ``m`` rows (the one-row kernel per row, the
    rows kernel, or, for ``QUANTIZED_ROWS``, the quantizer's launch then the MMA over its rows, in
    one launch where the grid is resident at once), the integer arguments and the constants.
    ``one`` is the eager path where it differs from the two launches a capture takes (ptpc's one
    launch; one row of a ``QUANTIZED_ROWS`` quant: the one-row kernel, its arguments ``row_args``);
    ``layout`` the MMA's scratch (``MmaScratch``). ``mx``: mxfp8's rows over its fp8 weight ``w``
    (scales ``w_scale``) take the quantizer's launch into bf16 rows, then ``mx_decode``'s kernel
    (``MX``; the caller vouched for the weight), whose launch is ``kernel``."""

    __slots__ = ("kernel", "quantize", "q_args", "ints", "consts", "one", "one_args", "where", "planned", "vendor",
                 "quant", "layout", "row_args", "mx", "has_bias")

    def __init__(self, m: int, k: int, k_padded: int, n: int, quant: str, has_bias: bool, device: int, *,
                 dense: bool = False, mx: bool = False, w: torch.Tensor | None = None,
                 w_scale: torch.Tensor | None = None):
        self.quantize = self.q_args = self.one = self.one_args = self.planned = self.kernel = self.layout = None
        self.row_args = None
        self.has_bias = has_bias
        self.mx = False
        self.where = torch.device("cuda", device) if device >= 0 else torch.device("cpu")  # the scratch's device
        self.ints = (m, n, k, k_padded)
        self.quant = quant
        self.vendor = vendor_rows(quant, m, k_padded, device, dense)
        if self.vendor:  # the quantizer's launch (the layer's, into zero-padded rows), then cuBLAS; mxfp8's
            # quantizer writes the rows dequantized to bf16 (the bytes of the quantizer, then mx_to_bf16)
            self.quantize, consts = launch_for(quant, False, self.vendor, k, k_padded, dequantize=quant == "mxfp8")
            self.q_args = ((m, self.vendor, k, k_padded), consts)
            return
        if mx and 1 < m <= mx_decode.M_MAX:  # the rows in bf16 (as VENDOR_ROWS's), then mx_decode over the fp8 weight
            mx_decode.check_shapes(m, w, w_scale, n)
            self.quantize, consts = launch_for(quant, False, m, k, k_padded, dequantize=True)
            self.q_args = ((m, m, k, k_padded), consts)
            self.kernel = mx_decode.Launch(device, m, n, w.shape[0], k_padded)
            self.mx = True
            return
        if not 1 < m <= rows_max(quant):  # the one-row kernel, a program per row and feature block
            group = GROUP[quant]
            # its M, N, K, K_PAD and QUANT, HAS_BIAS, BLOCK_N, G, GS, ROW_K, ROUND_IN_FP32: its constexprs, in order
            self.row_args = ((m, n, k, k_padded), (_QUANT_CODE[quant], has_bias, BLOCK_N[quant],
                                                   block_k(quant, k_padded) // group, group, min(ROW_K, _pow2(k)),
                                                   _interpreting()))
            row = Kernel(_kernel("row"), (-(-n // BLOCK_N[quant]), m), num_warps=NUM_WARPS[quant],
                         num_stages=NUM_STAGES[quant])
            if m != 1 or quant not in QUANTIZED_ROWS or n * k_padded < CAPTURED_ROW_MIN_BYTES:
                self.kernel = row
                return
            # One row of a quant whose rows are quantized once: eager calls take the one-row kernel (one
            # launch: the host's cost bounds an eager call), a graph capture the quantizer's launch and
            # the MMA over the row, which read the weight faster (under graph replay at 1 row, ptpc 20.8 /
            # 61.7 / 7.1 us against 25.3 / 87.8 / 10.1 at 8B down, 70B down, 8B qkv; blockscale 21.8 /
            # 63.2 / 9.4 against 28.2 / 98.9 / 12.7; one H200, scripts/probe_decode_split_k.py,
            # docs/decode.md). A weight under CAPTURED_ROW_MIN_BYTES (8B o) took the branch above.
            self.one = row
        block_n, step, options = _block(quant, m, k_padded)
        if quant in QUANTIZED_ROWS:
            self.kernel, self.layout, self.ints, self.consts = _mma(quant, m, k_padded, n, has_bias, device)
            programs, split = self.kernel.grid
            zero_words = self.layout.counter_words  # (0 without a split: nothing to zero)
            if quant == "ptpc":  # the quantizer's ROW_BLOCK, SLICE_K, SKIP_ZEROS, ROUND_IN_FP32, ZERO_WORDS
                grid, row_block, slice_k = split_launch(m, k, k_padded)
                self.quantize = Kernel(_quantize_kernel(), grid, num_warps=SPLIT_NUM_WARPS)
                consts = (row_block, slice_k, True, _interpreting(), zero_words)
            else:  # blockscale: the group quantizer's constants, its ZERO_WORDS last
                self.quantize, consts = launch_for(quant, False, m, k, k_padded)
                consts = (*consts[:-1], zero_words)
            # the quantizer's M, M_OUT, K, K_PAD (then x's row stride, tiny, fp8_max, its constants)
            self.q_args = ((m, m, k, k_padded), consts)
            if quant == "ptpc" and m > 1 and programs <= resident_programs(device) \
                    and n * k_padded <= ONE_LAUNCH_MAX_BYTES:
                slices, slice_k = one_slices(m, k_padded, programs)
                # (the MMA's K_SLICE and SPLIT too: its phase sums K as the captured MMA does, the same bits)
                self.one_args = ((m, n, k, k_padded), (slices, self.ints[3]),  # the MMA's HAS_BIAS, BLOCK_N,
                                 (*self.consts[1:5], min(_pow2(k), ONE_ROW_BLOCK), slice_k, 3, _interpreting(),
                                  split))  # BLOCK_K, ROWS, then the quantizer's ROW_BLOCK, SLICE_K, ...
                self.one = Kernel(_kernel("one"), (programs, 1), launch_cooperative_grid=True, **options)
            return
        # QUANT, HAS_BIAS, BLOCK_N, BLOCK_K, ROWS, ROW_K, ROUND_IN_FP32: the rows kernel's constexprs, laid
        # out as the one-row kernel's arguments are (both launch through _row)
        width = _pow2(m)
        self.row_args = (self.ints, (_QUANT_CODE[quant], has_bias, block_n, min(step, k_padded), width,
                                     min(ROWS_ELEMENTS // width, _pow2(k)), _interpreting()))
        self.kernel = Kernel(_kernel("rows"), (-(-n // block_n), 1), **options)

    def __call__(self, x, row_stride, w, w_scale, bias, out) -> None:
        scale = w_scale.view(torch.uint8) if w_scale.element_size() == 1 else w_scale
        b = out if bias is None else bias  # an unused pointer where there is no bias
        device = out.get_device()
        if self.one is not None and ONE_LAUNCH and not _capturing(device):
            if self.one_args is None:  # one row, eager: the one-row kernel
                self.one(device, *self._row(x, w, scale, b, out, row_stride, scale.stride(0)))
                return
            scratch = torch.empty(self.scratch_one(), dtype=FP8, device=self.where)  # rows, then scales
            try:
                self.one(device, *self._one(x, scratch, w, scale, b, out, _sync(device, self.where), row_stride))
                return
            except RuntimeError as err:  # a cooperative launch refused (an SM share: MPS, green contexts)
                if self.one.fast is not None or "cooperative" not in str(err).lower():
                    raise
                warnings.warn(f"decode_gemm: ptpc's one-launch decode GEMM was refused ({err}); this call shape "
                              f"takes two launches from now on", RuntimeWarning, stacklevel=4)
                self.one = None
        if self.quantize is not None:  # the rows quantized once (new tensors: safe on any stream), then the GEMM
            sizes = self.q_args[0]  # (M, M_OUT, K, K_PAD)
            if self.mx:  # the rows in bf16, then mx_decode's kernel over the fp8 weight into out (+ bias)
                a = torch.empty(sizes[1], sizes[3], dtype=torch.bfloat16, device=self.where)
                self.quantize(device, *self._quantize(x, a, a, row_stride))  # (no scales stored)
                self.kernel(a, w, w_scale, bias, out.view(sizes[0], self.ints[1]),
                            torch._C._cuda_getCurrentRawStream(device))
                return
            if self.vendor and self.quant == "mxfp8":  # the rows in bf16, then cuBLAS over w's bf16 copy
                a = torch.empty(sizes[1], sizes[3], dtype=torch.bfloat16, device=self.where)
                self.quantize(device, *self._quantize(x, a, a, row_stride))  # (no scales stored)
                dense_gemm(a, w, bias, out, sizes[0], self.ints[1])
                return
            if self.vendor:  # (blockscale's scales M-major, as cuBLAS reads them)
                q, sa = empty_activation(self.quant, sizes[1], sizes[3], self.where)
                self.quantize(device, *self._quantize(x, q, sa, row_stride))
                vendor_gemm(q, sa, w, w_scale, bias, out, sizes[0], self.ints[1])
                return
            q, sa, counters, parts = self.layout.views(torch.empty(self.layout.bytes, dtype=torch.uint8,
                                                                   device=self.where))
            self.quantize(device, *self._quantize(x, q, sa, row_stride))
            self.kernel(device, *self._mma(q, sa, w, scale, b, out, counters, parts, scale.stride(0)))
            return
        self.kernel(device, *self._row(x, w, scale, b, out, row_stride, scale.stride(0)))

    # The kernels' arguments in their order, from the call's tensors (or native.Pointer roles: plan).
    def _one(self, x, scratch, w, scale, b, out, sync, row_stride) -> tuple:
        sizes, ints, consts = self.one_args  # (M, N, K, K_PAD), (the quantizer's slices a row, the MMA's K_SLICE),
        return (x, scratch, w, scale, b, out, sync, *sizes, row_stride, _TINY, FP8_MAX, *ints, *consts)  # constants

    def _quantize(self, x, q, sa, row_stride) -> tuple:
        sizes, consts = self.q_args  # (M, M_OUT, K, K_PAD), the quantizer's constants
        return (x, q, sa, *sizes, row_stride, _TINY, FP8_MAX, *consts)

    def _mma(self, q, sa, w, scale, b, out, counters, parts, scale_stride) -> tuple:
        return (q, sa, w, scale, b, out, counters, parts, *self.ints, scale_stride, *self.consts)

    def _row(self, x, w, scale, b, out, row_stride, scale_stride) -> tuple:
        ints, consts = self.row_args
        return (x, w, scale, b, out, *ints, row_stride, scale_stride, _TINY, FP8_MAX, *consts)

    def scratch_one(self) -> int:
        """Bytes of the one launch's scratch (its sizes: (M, N, K, K_PAD)); none for one row's kernel."""
        if self.one_args is None:
            return 0
        sizes = self.one_args[0]
        return rows_and_scales(sizes[0], sizes[3])

    def compiled(self) -> tuple:
        """Which of the launches have compiled kernels (a plan holds those)."""
        return tuple(k is not None and k.compiled is not None for k in (self.one, self.quantize, self.kernel))

    def plan(self, row_stride: int, scale_stride: int) -> tuple:
        """This call shape's launches for ``native``'s table: (one, two, scratch bytes of each); a
        path whose kernels have not launched yet is left empty (its calls run here, then plan)."""
        from kernels_fused.hopper import native as nv

        P = nv.Pointer
        x, w, scale, b, out = P(nv.X), P(nv.W), P(nv.SCALE), P(nv.BIAS_OR_OUT), P(nv.OUT)
        one, two, scratch_two = [], [], 0
        if self.one is not None and self.one.compiled is not None:
            one = [nv.describe(self.one, self._row(x, w, scale, b, out, row_stride, scale_stride)
                               if self.one_args is None else
                               self._one(x, P(nv.SCRATCH), w, scale, b, out, P(nv.SYNC), row_stride))]
        if self.vendor:  # the quantizer into the table's own q and scales (mxfp8: its bf16 rows); cuBLAS's
            q, sa = (P(nv.ROWS), P(nv.ROWS)) if self.quant == "mxfp8" else (P(nv.SCRATCH), P(nv.A_SCALE))
            if self.quantize.compiled is not None:  # call follows them there
                two = [nv.describe(self.quantize, self._quantize(x, q, sa, row_stride))]
        elif self.mx:  # the rows in bf16 in the scratch, then mx_decode's kernel over them
            sizes, mx = self.q_args[0], self.kernel
            if self.quantize.compiled is not None:
                rows = P(nv.SCRATCH)
                two = [nv.describe(self.quantize, self._quantize(x, rows, rows, row_stride)),
                       nv.describe_function(mx.compiled, mx.grid, mx_decode.THREADS, mx.shared,
                                            mx.args(rows, sizes[3], w, scale, b if self.has_bias else P(nv.NULL),
                                                    out, self.ints[1]))]
                scratch_two = sizes[1] * sizes[3] * 2
        elif self.quantize is not None:  # the rows, their scales, the counters and partials in one scratch
            lay = self.layout
            q, sa, counters, parts = (P(nv.SCRATCH, offset) for offset in (0, lay.scales, lay.counters, lay.parts))
            if self.quantize.compiled is not None and self.kernel.compiled is not None:
                two = [nv.describe(self.quantize, self._quantize(x, q, sa, row_stride)),
                       nv.describe(self.kernel, self._mma(q, sa, w, scale, b, out, counters, parts, scale_stride))]
                scratch_two = lay.bytes
        elif self.kernel.compiled is not None:
            two = [nv.describe(self.kernel, self._row(x, w, scale, b, out, row_stride, scale_stride))]
        return one, two, self.scratch_one() if one else 0, scratch_two

__all__ = ["DECODE_MAX_M", "KEPT_CALL", "LT_ROWS", "MX", "MX_ROWS_MAX", "RowsMma", "VENDOR_ROWS", "block_k", "check_operands", "decode_gemm", "decode_max_m",
           "lt_workspace_bytes", "mx_rows_max", "resident_programs", "rows_max", "tables", "vendor_rows"]
