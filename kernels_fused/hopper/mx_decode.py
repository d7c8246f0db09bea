"""mxfp8's decode GEMM over its fp8 weight (``csrc/mx_decode.cu``, CUDA C++ built by nvcc:
``kernels_fused.hopper.cubin``): ``out [M, N] = x @ dequant(w, w_scale).T`` in bf16, for the call's
rows ``x`` already quantized and dequantized to bf16 (the activation quantizer's mxfp8 rows, as the
layers' decode path writes them), M <= 64.

Why: Hopper has no MMA with e8m0 scales, so the layers run mxfp8's 2..64 rows as cuBLAS's bf16 GEMM
over a bf16 copy of the weight: twice the bytes of the fp8 weight, and the call's cost at decode is
reading the weight (docs/decode.md: 1.01-1.16x of ``nn.Linear``'s device time, cold). This kernel
reads the e4m3 weight and its e8m0 scales once, dequantizing each byte to bf16 in registers on its
way to the tensor cores (the source's note has how, and why each value is the bf16 copy's).

Where it runs: the layers' mxfp8 decode rows (``kernels_fused.hopper.decode``, ``MX_ROWS``: 2..32
rows, the activation quantizer's launch writing the rows in bf16, then this kernel), for a weight
that :func:`unsuited` passes; measured by ``python3 -m scripts.probe_mx_decode`` (docs/decode.md,
"mxfp8's rows over its fp8 weight in CUDA C++"). On an H100, after the quantizer's launch, cold,
0.64-0.75x of ``nn.Linear``'s device time up to 16 rows at Llama-3-8B down / gate and 70B down (the
bf16 copy's path 1.02-1.09x), and slower than that path at 64 rows.

Shapes: N a multiple of a block's weight rows (``block_rows``: 128 by default), K of 128 (a step),
1 <= M <= 64; the weight's e8m0 scales at most 134 (a factor of 2^7: the kernel's bf16 multiplier;
:func:`check_scales`, one wait for the device: once per weight, not per call).
``slices`` (1, 2, 4 or 8) splits K over the blocks of a cluster (default: about two blocks an SM),
which sums their partials in slice order through shared memory: the same bits on every call.
"""
from __future__ import annotations

import ctypes
import warnings

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
INT_ARGS = (1, 6, 7, 8, 9)  # the kernel's 32-bit integer parameters (Launch.args): the others are pointers


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


def check_shapes(m: int, w: torch.Tensor, w_scale: torch.Tensor, n: int, tiles: int = TILES) -> None:
    """Raise ValueError where the weight ``w [N, K]`` (e4m3, contiguous), its scales ``w_scale
    [N, K/32]`` (e8m0) or ``m`` rows of which the first ``n`` features are stored are not what the
    kernel takes."""
    big, k = w.shape
    if not 1 <= m <= M_MAX:
        raise ValueError(f"mx_decode takes 1..{M_MAX} rows, not {m}")
    if big % block_rows(tiles) or k % STEP:
        raise ValueError(f"mx_decode takes a weight of N % {block_rows(tiles)} == 0 rows and K % {STEP} == 0 "
                         f"columns, not {tuple(w.shape)}")
    if not 1 <= n <= big:
        raise ValueError(f"mx_decode stores 1..{big} (the weight's rows) features, not {n}")
    if w.dtype != torch.float8_e4m3fn or w_scale.element_size() != 1:
        raise ValueError(f"mx_decode takes an e4m3 weight and e8m0 scales, not {w.dtype} and {w_scale.dtype}")
    if w_scale.shape != (big, k // 32) or not (w.is_contiguous() and w_scale.is_contiguous()):
        raise ValueError(f"mx_decode takes a contiguous weight and contiguous scales [{big}, {k // 32}], not "
                         f"{tuple(w_scale.shape)}")
    if w.data_ptr() % 16 or w_scale.data_ptr() % 4:
        raise ValueError("mx_decode reads the weight in 16-byte pieces and its scales 4 bytes at a time: they must "
                         "start so aligned")


class Launch:
    """The kernel's launch for ``m`` rows over a weight of ``n_padded`` x ``k`` storing ``n`` features
    on ``device`` (an index), loaded here (its first use builds it: nvcc, about 3 s once per
    machine; ``kernels_fused.hopper.cubin``). :meth:`args` lays a call's operands out in the
    kernel's order, so that the decode path's C++ table (``native.describe_function``) replays the
    same launch with its own pointers. ``slices``: K slices, default :func:`default_slices`."""

    __slots__ = ("fn", "grid", "shared", "ints", "defines", "name", "device")

    def __init__(self, device: int, m: int, n: int, n_padded: int, k: int, *, slices: int | None = None,
                 stages: int = STAGES, prefetch: int = PREFETCH, tiles: int = TILES):
        if stages < 2 or prefetch < 1 or tiles not in (1, 2):
            raise ValueError(f"mx_decode takes stages >= 2, prefetch >= 1 and tiles 1 or 2 (4 spills), not {stages}, "
                             f"{prefetch} and {tiles}")
        if slices is None:
            slices = default_slices(n_padded, k, torch.cuda.get_device_properties(device).multi_processor_count,
                                    tiles)
        if slices not in SLICES or (slices > 1 and k // STEP < 2 * slices):
            raise ValueError(f"mx_decode takes K slices of {SLICES} with two steps of {STEP} each at least; {slices} "
                             f"at K={k}")
        self.grid = (n_padded // block_rows(tiles), slices, 1)
        self.shared = shared_bytes(m, stages, tiles)
        self.ints = (m, n, k)
        self.defines = defines(stages, prefetch, slices, tiles)
        self.name = f"cco_mx_decode_{token_tiles(m)}".encode()
        self.device = device
        with torch.cuda.device(device):  # loaded into the device's context
            self.fn = cubin.function(device, SOURCE, self.defines, self.name, self.shared)

    @property
    def compiled(self) -> int:
        """The loaded function's handle (the decode path's plans take it as Triton's compiled kernels)."""
        return self.fn.value

    def args(self, x, ldx: int, w, w_scale, bias, out, ldo: int) -> list:
        """The kernel's arguments in order: the rows, their row stride, the weight, its scales, the
        bias (0: none), the output and its row stride, then M, n and K."""
        return [x, ldx, w, w_scale, bias, out, ldo, *self.ints]

    def __call__(self, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                 out: torch.Tensor, stream: int) -> None:
        values = self.args(x.data_ptr(), x.stride(0), w.data_ptr(), w_scale.data_ptr(),
                           0 if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0))
        args = [ctypes.c_int(v) if i in INT_ARGS else ctypes.c_uint64(v) for i, v in enumerate(values)]
        if torch._C._cuda_getDevice() == self.device:
            cubin.launch(self.fn, self.grid, THREADS, self.shared, stream, args)
            return
        with torch.cuda.device(self.device):  # the driver launches in the current context: the kernel's device's
            cubin.launch(self.fn, self.grid, THREADS, self.shared, stream, args)


def mx_decode_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, *, n: int | None = None,
                   bias: torch.Tensor | None = None, out: torch.Tensor | None = None, slices: int | None = None,
                   stages: int = STAGES, prefetch: int = PREFETCH, tiles: int = TILES,
                   checked: bool = False) -> torch.Tensor:
    """``x [M, K]`` bf16 (row stride any, unit column stride), ``w [N, K]`` e4m3 and ``w_scale
    [N, K/32]`` e8m0, both contiguous -> ``out [M, n]`` bf16 (row stride any, unit column stride;
    ``n`` default N): the first ``n`` features of the product, plus ``bias [n]`` (bf16, rounded
    again as ``out += bias``). ``checked``: the caller has run :func:`check_scales` on this weight."""
    m, k = x.shape
    n = w.shape[0] if n is None else n
    check_shapes(m, w, w_scale, n, tiles)
    if x.dtype != torch.bfloat16 or w.shape[1] != k:
        raise ValueError(f"mx_decode takes bf16 rows of the weight's K, not {x.dtype} {tuple(x.shape)} against "
                         f"{tuple(w.shape)}")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        raise ValueError("mx_decode reads x in 16-byte pieces: its rows must start 16-byte aligned")
    if bias is not None and (bias.shape != (n,) or bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        raise ValueError(f"mx_decode adds a contiguous bf16 [{n}] bias, not {bias.dtype} {tuple(bias.shape)}")
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    if out.shape != (m, n) or out.dtype != torch.bfloat16 or out.stride(1) != 1:
        raise ValueError(f"mx_decode writes a bf16 [{m}, {n}] output with unit column stride, not {out.dtype} "
                         f"{tuple(out.shape)}")
    if not checked:
        check_scales(w_scale)
    launch = Launch(x.device.index, m, n, w.shape[0], k, slices=slices, stages=stages, prefetch=prefetch, tiles=tiles)
    launch(x, w, w_scale, bias, out, torch.cuda.current_stream(x.device).cuda_stream)
    return out


def unsuited(w: torch.Tensor, w_scale: torch.Tensor) -> str | None:
    """Why the decode path cannot run this mxfp8 weight's rows through the kernel, or None where it
    can: then its scales passed :func:`check_scales` and its build is loaded for every row count.
    A device other than Hopper's sm_90, no nvcc, a shape it does not take, scales over
    ``MAX_SCALE``, a build that fails (warned), or a CUDA graph capture in progress (the scales'
    check waits for the device): the caller keeps the weight's bf16 copy then."""
    if not w.is_cuda or torch.cuda.get_device_capability(w.device) != (9, 0):
        return "not an sm_90 GPU"
    if cubin.nvcc() is None:
        return "no nvcc"
    try:
        check_shapes(1, w, w_scale, w.shape[0])
    except ValueError as err:
        return str(err)
    with torch.cuda.device(w.device):  # (the weight's device's current stream)
        capturing = torch.cuda.is_current_stream_capturing()
    if capturing:
        return "a CUDA graph capture is in progress (the scales' check waits for the device)"
    try:
        check_scales(w_scale)
    except ValueError as err:
        return str(err)
    return unloaded(w.device.index, w.shape[0], w.shape[1])


def unloaded(device: int, n: int, k: int) -> str | None:
    """Load the kernel of every row count for a weight of ``n`` x ``k`` on ``device`` (so that no
    driver call but the launch happens under a later capture); why it could not be, or None. A
    failed nvcc or driver call (RuntimeError) and a cache folder that cannot be written
    (``CCO_CUBIN_CACHE``, default under ``~``: OSError) are warned and said, not raised: the caller
    reads the weight's bf16 copy instead."""
    try:
        for tiles in TOKEN_TILES:
            Launch(device, 8 * tiles, n, n, k)
    except (RuntimeError, OSError) as err:
        warnings.warn(f"mx_decode could not be built or loaded ({type(err).__name__}: {err}); mxfp8's decode rows "
                      f"read the weight's bf16 copy", RuntimeWarning, stacklevel=3)
        return f"the build failed: {type(err).__name__}: {err}"
    return None


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
