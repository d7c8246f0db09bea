"""mxfp8's decode GEMM over its fp8 weight (``csrc/mx_decode.cu``, CUDA C++ built by nvcc:
``kernels_fused.hopper.cubin``): ``out [M, N] = x @ dequant(w, w_scale).T`` in bf16, for the call's
rows ``x`` already quantized and dequantized to bf16 (the activation quantizer's mxfp8 rows, as the
layers' decode path writes them), M <= 64.

Why: Hopper has no MMA with e8m0 scales, so the layers run mxfp8's 2..64 rows as cuBLAS's bf16 GEMM
over a bf16 copy of the weight: twice the bytes of the fp8 weight, and the call's cost at decode is
reading the weight (docs/decode.md: 1.01-1.16x of ``nn.Linear``'s device time, cold). This kernel
reads the e4m3 weight and its e8m0 scales once, dequantizing each byte to bf16 in registers on its
way to the tensor cores (the source's note has how, and why each value is the bf16 copy's).

Status: measured, on no launch path yet (``python3 -m scripts.probe_mx_decode``; docs/decode.md,
"mxfp8's rows over its fp8 weight in CUDA C++", which lists what the layers need first). Right on an
H100 at every cell; after the quantizer's launch, cold, 0.64-0.75x of ``nn.Linear``'s device time up
to 16 rows at Llama-3-8B down / gate and 70B down (the bf16 copy's path 1.02-1.09x), and slower than
that path at 64 rows.

Shapes: N a multiple of a block's weight rows (``block_rows``: 128 by default), K of 128 (a step),
1 <= M <= 64; the weight's e8m0 scales at most 134 (a factor of 2^7: the kernel's bf16 multiplier;
:func:`check_scales`, one wait for the device: once per weight, not per call).
``slices`` (1, 2, 4 or 8) splits K over the blocks of a cluster (default: about two blocks an SM),
which sums their partials in slice order through shared memory: the same bits on every call.
"""
from __future__ import annotations

import ctypes

import torch

from kernels_fused.hopper import cubin

SOURCE = cubin.source("mx_decode.cu")
TILES = 2       # m16 tiles of weight rows a warp: a block of 4 warps takes 64 * TILES rows
STEP = 128      # K elements a step
ROW_BYTES = STEP * 2 + 16  # an activation row of a step in shared memory
THREADS = 128
M_MAX = 64
MAX_SCALE = 134  # e8m0 byte: the bf16 multiplier 2^(e - 7) is normal up to it
TOKEN_TILES = (1, 2, 4, 8)  # the kernel's builds: token tiles of 8 rows
STAGES = 3     # the activation rows' shared-memory ring
PREFETCH = 2   # steps of weight in registers (the current one and the loads in flight)
SLICES = (1, 2, 4, 8)  # K slices of a row block: one cluster, its partials summed in shared memory


def defines(stages: int = STAGES, prefetch: int = PREFETCH, slices: int = 8, tiles: int = TILES) -> list[str]:
    return [f"-DCCO_STAGES={stages}", f"-DCCO_PREFETCH={prefetch}", f"-DCCO_SLICES={slices}", f"-DCCO_TILES={tiles}"]


def block_rows(tiles: int = TILES) -> int:
    """Weight rows a block takes (N must be a multiple)."""
    return 64 * tiles


def token_tiles(m: int) -> int:
    """The build that takes ``m`` rows: the fewest 8-row token tiles of TOKEN_TILES covering them."""
    return next(t for t in TOKEN_TILES if 8 * t >= m)


def shared_bytes(m: int, stages: int = STAGES, tiles: int = TILES) -> int:
    """The activation rows' stages, or the partial the cluster's sum keeps in the same memory
    (``kRedStride`` floats a token row), whichever is larger."""
    rows = token_tiles(m) * 8
    return max(stages * rows * ROW_BYTES, rows * (block_rows(tiles) + 4) * 4)


def default_slices(n: int, k: int, sms: int, tiles: int = TILES) -> int:
    """K slices (of SLICES) so that the grid is about two blocks an SM, each slice at least two steps."""
    want = 2 * sms / (n // block_rows(tiles))
    fits = [s for s in SLICES if s == 1 or k // STEP >= 2 * s]
    return min(fits, key=lambda s: (abs(s - want), s))


def check_scales(w_scale: torch.Tensor) -> None:
    """Raise ValueError where a weight's e8m0 scale exceeds what the kernel's multiplier takes."""
    top = int(w_scale.view(torch.uint8).max())
    if top > MAX_SCALE:
        raise ValueError(f"mx_decode takes e8m0 weight scales up to {MAX_SCALE} (2^{MAX_SCALE - 127}); this weight "
                         f"has {top}")


def mx_decode_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, *, out: torch.Tensor | None = None,
                   slices: int | None = None, stages: int = STAGES, prefetch: int = PREFETCH, tiles: int = TILES,
                   checked: bool = False) -> torch.Tensor:
    """``x [M, K]`` bf16 (row stride any, unit column stride), ``w [N, K]`` e4m3 and ``w_scale
    [N, K/32]`` e8m0, both contiguous -> ``out [M, N]`` bf16 (row stride any, unit column stride).
    ``checked``: the caller has run :func:`check_scales` on this weight."""
    m, k = x.shape
    n = w.shape[0]
    if stages < 2 or prefetch < 1 or tiles not in (1, 2):
        raise ValueError(f"mx_decode takes stages >= 2, prefetch >= 1 and tiles 1 or 2 (4 spills), not {stages}, "
                         f"{prefetch} and {tiles}")
    if not 1 <= m <= M_MAX:
        raise ValueError(f"mx_decode takes 1..{M_MAX} rows, not {m}")
    rows = block_rows(tiles)
    if n % rows or k % STEP or w.shape[1] != k:
        raise ValueError(f"mx_decode takes N % {rows} == 0 and K % {STEP} == 0; got x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)}")
    if x.dtype != torch.bfloat16 or w.dtype != torch.float8_e4m3fn or w_scale.element_size() != 1:
        raise ValueError(f"mx_decode takes bf16 rows, an e4m3 weight and e8m0 scales, not {x.dtype}, {w.dtype}, "
                         f"{w_scale.dtype}")
    if w_scale.shape != (n, k // 32) or not (w.is_contiguous() and w_scale.is_contiguous()):
        raise ValueError(f"mx_decode takes a contiguous weight and contiguous scales [{n}, {k // 32}], not "
                         f"{tuple(w_scale.shape)}")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16 or w.data_ptr() % 16 or w_scale.data_ptr() % 4:
        raise ValueError("mx_decode reads x in 16-byte pieces and the scales 4 bytes at a time: x's rows must "
                         "start 16-byte aligned, the weight 16-byte and the scales 4-byte aligned")
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    if out.shape != (m, n) or out.dtype != torch.bfloat16 or out.stride(1) != 1 or out.stride(0) % 2 \
            or out.data_ptr() % 4:
        raise ValueError(f"mx_decode writes a bf16 [{m}, {n}] output with unit column stride and 4-byte aligned rows, "
                         f"not {out.dtype} {tuple(out.shape)}")
    if not checked:
        check_scales(w_scale)
    if slices is None:
        slices = default_slices(n, k, torch.cuda.get_device_properties(x.device).multi_processor_count, tiles)
    if slices not in SLICES or (slices > 1 and k // STEP < 2 * slices):
        raise ValueError(f"mx_decode takes K slices of {SLICES} with two steps of {STEP} each at least; {slices} at "
                         f"K={k}")
    shared = shared_bytes(m, stages, tiles)
    name = f"cco_mx_decode_{token_tiles(m)}".encode()
    args = [ctypes.c_uint64(x.data_ptr()), ctypes.c_int(x.stride(0)), ctypes.c_uint64(w.data_ptr()),
            ctypes.c_uint64(w_scale.data_ptr()), ctypes.c_uint64(out.data_ptr()), ctypes.c_int(out.stride(0)),
            ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k)]
    stream = torch.cuda.current_stream(x.device).cuda_stream
    with torch.cuda.device(x.device):  # loaded into, and launched in, x's device's context
        fn = cubin.function(x.device.index, SOURCE, defines(stages, prefetch, slices, tiles), name, shared)
        cubin.launch(fn, (n // rows, slices, 1), THREADS, shared, stream, args)
    return out


def k_order(t: int, s: int, j: int) -> int:
    """The physical K offset, within a 64-wide block, of MMA step ``s``'s fragment element ``j`` (0, 1:
    logical k 2t, 2t+1; 2, 3: 2t+8, 2t+9) of lane column ``t``: the source's K order, for the host
    replay of its arithmetic."""
    return 16 * t + 4 * s + j


def bf16_pairs(word: int) -> tuple[int, int]:
    """The source's conversion of one 32-bit word of four e4m3 bytes into two bf16 pairs (bytes 0, 1
    and 2, 3), each value times 2^-120, on the host (plain integers)."""
    def placed(lo: int, hi: int) -> int:
        return (((word >> (8 * lo)) & 0xFF) << 8) | (((word >> (8 * hi)) & 0xFF) << 24)

    def convert(p: int) -> int:
        return ((p >> 4) & 0x07F007F0) | (p & 0x80008000)

    return convert(placed(0, 1)), convert(placed(2, 3))
