"""gfx950 (MI355X) backend: the FlyDSL fp8 GEMM (``kernels_fused.gfx950.kernel``) and the SDMA ``dma``
transport over a torch symmetric-memory window.

What runs where, per call:

- ``gemm``: one FlyDSL launch, ``fuse=False``, writing ``out`` directly.
- ``fused``: one FlyDSL launch, ``fuse=True``: tiles into ``partial[dest]`` in the layout's
  (chunk, dest, m, n) order, one acq_rel add per tile on ``counters[dest, chunk]``; SDMA puts start
  on each (dest, chunk) as soon as its counter completes, while the GEMM still runs; reduce, gather
  and assemble follow chunk by chunk on side streams.
- ``split``: the same launch, then the same transfers gated on the whole GEMM (the baseline).

Shared with the NVIDIA backend (one source of truth, nothing restated here): the per-call stream
schedule (``cco.cuda.dma.CopyEngineSchedule``: submission order, consumed-word graph safety, the
Triton reduce/gather kernels of ``cco.cuda.kernels``), and the mode orchestration of
``cco.backends.cuda.CudaBackend`` (``fused``/``split``/``all_reduce_window``/``check``/``close``),
which this class inherits. What differs is the GEMM (FlyDSL, preshuffled weight read as is, so no
unshuffled copy is kept) and the stream memory operations: :class:`HipMemOps` reaches the SDMA
engines with ``hipMemcpyAsync`` between peer-mapped buffers, gated by ``hipStreamWaitValue64`` and
flagged by ``hipStreamWriteValue64`` (the ``hip-python`` package, imported on first use).

The schedule takes its memory operations as a ``memops`` object (``cco.cuda.memops`` on NVIDIA,
:class:`HipMemOps` here), so the transfers, their submission order and their graph safety are one
piece of code for both vendors.

Tile: the plain GEMM uses 256 x 256 for every quant where N allows it, else 256 x 128. Every tile
runs one workgroup per CU (its LDS, 96 or 128 KiB of MI355X's 160, and the kernel's two waves per
SIMD fix that), and since no quant spills at 256 x 256 any more (``python -m kernels_fused.gfx950.budget``,
docs/GFX950.md), the wider tile moves 1 byte of A and B per output element per K byte instead of 1.5
and pays its prologue and epilogue once per twice the work. The fused layout's tile stays 256 x 128:
its block_n must divide N/world, and 7168 / 8 = 896 is not a multiple of 256 (``tile`` does not see
the world). Both choices are untimed until MI355X runs exist; at an M whose 256 x 256 grid leaves CUs
idle (M = 256 at N = 7168: 28 tiles) the narrower tile may win.

Patterns (``cco.layout.PATTERNS``): every one, on the ``dma`` transport, through the call paths
inherited from :class:`CudaBackend` (one call machinery; the transport's steps per pattern are
``cco.cuda.dma``'s). Which FlyDSL launch each reaches:

- ``reduce-scatter-cols``: the all-reduce's fused launch. Its slices are the all-reduce's
  (N/W columns of every row), so the tile walk, counters, targets and partial planes are the same
  (``layout.tile_table``); the gather phase it lacks is the transport's, not the kernel's.
- ``reduce-scatter-rows``: the same fused launch on this pattern's tile table (a slice is M/W rows
  of every column: the launcher passes each slice's first A row and B row to the kernel), tiles into
  ``partial[dest]`` planes N wide (:meth:`_produce_rows`).
- ``all-gather``: SDMA puts of the own e4m3 rows and scales into every peer's slot, then one plain
  launch on the own rows and one per (chunk, source) as each lands (split: once all have landed,
  one over every row, or one per source where the slots hold pad rows): :meth:`_rows_gemm`.

No pattern compiles a kernel variant the all-reduce does not: the two (``fuse`` False / True) are
the ones the ISA conformance and budget sweeps check. Checked on the CPU only, never run on an
MI355X (docs/GFX950.md, "Sequence-parallel patterns").

Safety, as on CUDA (``cco.backends.cuda``): the schedule marks every call for the same watchdog
(``cco.cuda.watchdog``), which releases a call past its deadline through :class:`HipMemOps`; a
rejecting rank runs the call on NaN data (``CudaBackend.reject``); lost puts are injected on the SDMA
engines. Not covered: ``transport="lsa"`` needs the kernel's epilogue to store into the owner's
window (a per-destination peer base pointer), which the FlyDSL kernel does not have.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch

from cco import layout
from cco.backends.base import Backend
from cco.backends.cuda import CudaBackend, dense_block_scales

GEMM_BLOCK_M = 256  # the 8-wave kernel's rows per workgroup; also the layout's m-tile
GEMM_BLOCK_N = 128  # the fused layout's: divides N/world for N = 7168 up to 8 ranks (7168 / 8 = 896)
WIDE_BLOCK_N = 256  # the plain GEMM's (no slices) when N allows it, every quant
HIP_PACKAGE = "hip-python"


# --------------------------------------------------------------------------------------------------
# launch arguments: pure functions of the layout (unit-tested without a device)
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class FusedLaunchArgs:
    """What one ``fuse=True`` launch of call ``plan`` receives, and what the transport waits for."""

    block_m: int
    block_n: int
    tile_rows: tuple[tuple[int, int, int, int], ...]  # per workgroup: (chunk, dest, row0, col0 in dest's slice)
    partial_shape: tuple[int, int, int]  # C_or_window: [world, c_rows, c_ld]
    partial_offset: int  # bytes from the window start
    counters_offset: int
    counter_words: int  # the kernel's counters tensor: [world * MAX_CHUNKS] int64
    chunk_targets: tuple[tuple[int, ...], ...]  # [world][chunks]: counters[d, c] value that completes (d, c)

    @property
    def grid(self) -> int:
        return len(self.tile_rows)

    @property
    def c_rows(self) -> int:  # rows of one partial[dest] plane (m_max padded to block_m)
        return self.partial_shape[1]

    @property
    def c_ld(self) -> int:  # columns of one plane: N / world
        return self.partial_shape[2]


def fused_launch_args(cfg: layout.OpConfig, plan: layout.CallPlan) -> FusedLaunchArgs:
    """The fused launch of ``plan``. Counters are zeroed at each call's start (as on CUDA: a stream
    wait's value is baked into a captured graph), so a chunk completes at its per-call tile count."""
    w = cfg.window
    targets = tuple(tuple(plan.slot_tiles(d, c) for c in range(plan.chunks))
                    for d in range(cfg.world))
    return FusedLaunchArgs(
        block_m=cfg.block_m, block_n=cfg.block_n,
        tile_rows=tuple(tuple(r) for r in layout.tile_table_rows(plan.tiles)),
        partial_shape=tuple(w.partial.shape), partial_offset=w.partial.offset,
        counters_offset=w.counters.offset, counter_words=w.counters.shape[0] * w.counters.shape[1],
        chunk_targets=targets)


def gemm_tile(*, n: int, quant: str) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the plain GEMM: 256x256 when N allows, else 256x128, for every quant (no
    variant spills at 256x256 since the budget sweep of docs/GFX950.md; ``quant`` is kept for callers
    and for a format that would need another tile)."""
    from kernels_fused.gfx950.kernel import QUANTS  # pure module: imports no flydsl

    if quant not in QUANTS:
        raise ValueError(f"gemm_tile: quant={quant!r} is not supported; pass one of {', '.join(QUANTS)}")
    if n % WIDE_BLOCK_N == 0:
        return GEMM_BLOCK_M, WIDE_BLOCK_N
    return GEMM_BLOCK_M, GEMM_BLOCK_N


def gemm_grid(*, m: int, n: int, block_m: int, block_n: int) -> int:
    """Workgroups of the plain GEMM: whole m-tiles times n-tiles (rows past M are masked)."""
    assert n % block_n == 0, f"n={n} is not a multiple of block_n={block_n}"
    return -(-m // block_m) * (n // block_n)


def kernel_tile_reason(*, block_m: int, block_n: int) -> str | None:
    """``None`` when the FlyDSL kernel compiles a ``block_m x block_n`` tile, else why not."""
    from kernels_fused.gfx950.kernel import TILES  # pure module: imports no flydsl

    if (block_m, block_n) in TILES:
        return None
    return (f"tile {block_m}x{block_n} is not one the gfx950 kernel compiles "
            f"({', '.join(f'{m}x{n}' for m, n in TILES)})")


# --------------------------------------------------------------------------------------------------
# stream memory operations on ROCm
# --------------------------------------------------------------------------------------------------
class MemOps(Protocol):
    """What the copy-engine schedule needs from a device runtime. ``cco.cuda.memops`` (the module)
    is the CUDA implementation, :class:`HipMemOps` the ROCm one. Streams are integer handles
    (``torch.cuda.Stream.cuda_stream``), addresses integer device pointers (peer ones included)."""

    def wait_geq(self, stream: int, addr: int, value: int) -> None: ...

    def write(self, stream: int, addr: int, value: int) -> None: ...

    def copy(self, stream: int, dst: int, src: int, nbytes: int) -> None: ...

    def copy_2d(self, stream: int, *, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int,
                height: int) -> None: ...

    def fill(self, stream: int, dst: int, byte: int, nbytes: int) -> None: ...

    def capture_supported(self, device_index: int) -> bool: ...

    def wait_geq_kernel(self, stream, addr: int, value: int) -> None: ...

    def write_kernel(self, stream, addr: int, value: int) -> None: ...

    def wait_block_kernel(self, stream, words, row: int, rows: tuple[int, int], cols: tuple[int, int], skip: int,
                          value: int) -> None: ...


@functools.cache
def _hip():
    try:
        from hip import hip
    except ImportError as err:
        raise ImportError(
            f"Gfx950Backend: the SDMA transport needs the {HIP_PACKAGE} package (`from hip import hip`); "
            f"install the release matching the ROCm runtime, e.g. pip install {HIP_PACKAGE}~=6.4") from err
    return hip


def _check(result, what: str):
    """hip-python returns ``(hipError_t, *outputs)``; raise on an error, else return the outputs."""
    hip = _hip()
    err, *outputs = result if isinstance(result, tuple) else (result,)
    if err != hip.hipError_t.hipSuccess:
        raise RuntimeError(f"{what} failed: {err}")
    return outputs


class HipMemOps:
    """:class:`MemOps` through the HIP runtime (``hip-python``).

    - ``wait_geq``: ``hipStreamWaitValue64(..., hipStreamWaitValueGte, all-ones mask)``; HIP compares
      unsigned (``*addr >= value``), the same as CUDA's cyclic GEQ for the counts and seqs used here
      (both grow from 0 and stay far below 2**63).
    - ``write``: ``hipStreamWriteValue64``: performed after all earlier work of the stream.
    - ``copy``: ``hipMemcpyAsync`` with ``hipMemcpyDeviceToDeviceNoCU``: the SDMA engines, never a
      blit kernel that would take CUs from the GEMM.
    - ``copy_2d``: ``hipMemcpy2DAsync`` device to device (local pitched assemble copy; the runtime
      may use a blit kernel, as the CUDA driver does).
    - ``fill``: ``hipMemsetD8Async`` (the watchdog's NaN fills: no copy from host memory).
    - the spin/store kernel fallbacks and the block wait are the Triton kernels of ``cco.cuda.memops``
      (device-neutral).

    Nothing is imported until the first call.
    """

    def wait_geq(self, stream: int, addr: int, value: int) -> None:
        hip = _hip()
        _check(hip.hipStreamWaitValue64(stream, addr, value, hip.hipStreamWaitValueGte, 0xFFFF_FFFF_FFFF_FFFF),
               "hipStreamWaitValue64")

    def write(self, stream: int, addr: int, value: int) -> None:
        _check(_hip().hipStreamWriteValue64(stream, addr, value, 0), "hipStreamWriteValue64")

    def copy(self, stream: int, dst: int, src: int, nbytes: int) -> None:
        if nbytes:
            hip = _hip()
            _check(hip.hipMemcpyAsync(dst, src, nbytes, hip.hipMemcpyKind.hipMemcpyDeviceToDeviceNoCU, stream),
                   "hipMemcpyAsync")

    def copy_2d(self, stream: int, *, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int,
                height: int) -> None:
        if width and height:
            hip = _hip()
            _check(hip.hipMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height,
                                        hip.hipMemcpyKind.hipMemcpyDeviceToDevice, stream), "hipMemcpy2DAsync")

    def fill(self, stream: int, dst: int, byte: int, nbytes: int) -> None:
        if nbytes:
            _check(_hip().hipMemsetD8Async(dst, byte, nbytes, stream), "hipMemsetD8Async")

    def copy_host(self, stream: int, dst: int, src: int, nbytes: int) -> None:
        """A copy between pinned host and device memory (the watchdog's reads and NaN fills)."""
        if nbytes:
            hip = _hip()
            _check(hip.hipMemcpyAsync(dst, src, nbytes, hip.hipMemcpyKind.hipMemcpyDefault, stream), "hipMemcpyAsync")

    def wait_geq_kernel(self, stream, addr: int, value: int) -> None:
        from cco.cuda import memops

        memops.wait_geq_kernel(stream, addr, value)

    def write_kernel(self, stream, addr: int, value: int) -> None:
        from cco.cuda import memops

        memops.write_kernel(stream, addr, value)

    def wait_block_kernel(self, stream, words, row: int, rows: tuple[int, int], cols: tuple[int, int], skip: int,
                          value: int) -> None:
        from cco.cuda import memops

        memops.wait_block_kernel(stream, words, row, rows, cols, skip, value)

    def supported(self, device_index: int) -> str | None:
        """``None`` when the device runs 64-bit stream waits, else why not."""
        hip = _hip()
        try:
            (ok,) = _check(hip.hipDeviceGetAttribute(
                hip.hipDeviceAttribute_t.hipDeviceAttributeCanUseStreamWaitValue, device_index),
                "hipDeviceGetAttribute")
        except (RuntimeError, AttributeError) as err:
            return f"stream memory operations unavailable: {err}"
        return None if ok else "the device does not support stream wait-value operations"

    def capture_supported(self, device_index: int) -> bool:
        """Whether a HIP graph captures and replays a stream write and wait on this device (probed once)."""
        return _capture_supported(self, device_index)


@functools.cache
def _capture_supported(memops: HipMemOps, device_index: int) -> bool:
    from cco.cuda.memops import capture_probe  # imports no driver binding by itself

    return capture_probe(memops, device_index)


def copy_engine_schedule():
    """The shared copy-engine schedule class (a seam the host tests replace with a recorder)."""
    from cco.cuda.dma import CopyEngineSchedule

    return CopyEngineSchedule


# --------------------------------------------------------------------------------------------------
# the backend
# --------------------------------------------------------------------------------------------------
def gfx950_reason(device) -> str | None:
    """``None`` when ``device`` is a ROCm gfx950 GPU, else why not. Compiles and launches nothing."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"Gfx950Backend runs on a ROCm gfx950 (MI355X) device, not {device}"
    if getattr(torch.version, "hip", None) is None:
        return (f"Gfx950Backend runs on a ROCm gfx950 (MI355X) device; {device} is an NVIDIA device "
                f"(torch {torch.__version__} is not a ROCm build): use CudaBackend")
    arch = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
    if arch != "gfx950":
        return f"Gfx950Backend runs on gfx950 (MI355X); {device} is {arch}"
    return None


class Gfx950Backend(CudaBackend):
    """The op's executor on MI355X. Inherits ``fused``, ``split``, ``all_reduce_window``, ``check``
    and ``close`` from :class:`CudaBackend` (device-neutral: torch streams and events, the shared
    schedule); replaces device probing, construction and the GEMM launches."""

    name = "gfx950"
    block_m = GEMM_BLOCK_M
    block_n = GEMM_BLOCK_N
    default_transport = "dma"
    dma_peers_first = False  # the FlyDSL kernel writes the schedule's (chunk, dest) order
    dma_reduce_in_gemm = False  # and stores its own tiles for the reduce kernel
    weight_layouts = ("bpreshuffle",)  # the FlyDSL kernel reads b_pre as is
    # every pattern, through CudaBackend's call paths; the FlyDSL launches they reach are the two
    # compiled variants the conformance sweep checks (module note, "Patterns")
    patterns = tuple(layout.PATTERNS)

    @classmethod
    def tile(cls, quant: str) -> tuple[int, int]:
        """The FlyDSL kernel's 256x128 for every quant (not CudaBackend's Triton tiles, which it
        would otherwise inherit and then refuse in __init__)."""
        return cls.block_m, cls.block_n

    @classmethod
    def supports_device(cls, device):
        why = gfx950_reason(device)
        if why is not None:
            return why
        for module, package in (("flydsl", "flydsl"), ("triton", "triton")):
            try:
                __import__(module)
            except ImportError:
                return f"Gfx950Backend needs {package} (pip install {package})"
        return None

    @classmethod
    def config_error(cls, cfg):
        err = super(CudaBackend, cls).config_error(cfg)  # Backend's: CudaBackend's refusals are the Triton kernels'
        if err is not None:
            return err
        if cfg.transport not in ("dma", "auto"):
            return NotImplementedError(
                f"transport={cfg.transport!r} needs the FlyDSL epilogue to store into the owner's window (a peer "
                f"base pointer per destination), which it does not have; pass transport='dma'")
        why = kernel_tile_reason(block_m=cfg.block_m, block_n=cfg.block_n)
        return None if why is None else ValueError(f"the layout's {why}")

    def __init__(self, **kw):
        Backend.__init__(self, **kw)  # CudaBackend.__init__ builds the Triton GEMM configs: not ours
        self.schedule = None
        why = self.supports_device(self.window.device)
        if why is not None:
            raise RuntimeError(f"Gfx950Backend: {why}; nothing was compiled or launched")
        cfg = self.config
        drops = self._take_window()
        faults = self.faults
        self._launchers = {}
        self._args: dict[int, FusedLaunchArgs] = {}
        if cfg.publishes:  # (gemm-only, one rank: the plain GEMM writes out, no planes)
            schedule_cls = copy_engine_schedule()
            memops = HipMemOps()
            why = memops.supported(self.device.index or 0)
            if why is not None:
                raise RuntimeError(f"Gfx950Backend: {why}")
            self.schedule = schedule_cls(
                config=cfg, window=self.window, device=self.device,
                silent=bool(faults is not None and faults.silent), memops=memops, marks=self._marks(), drops=drops)
            self.schedule.load_kernels((self.partial,))  # the FlyDSL kernel writes the window's planes
        self._watch(memops if self.schedule is not None else None)

    # ---- the FlyDSL launches -------------------------------------------------------------------------
    def _launcher(self, *, fuse: bool, block_m: int, block_n: int):
        key = (fuse, block_m, block_n)
        if key not in self._launchers:
            from kernels_fused.gfx950.kernel import compile_fused_gemm_scatter

            cfg = self.config
            # compiles on its first launch; the launcher refuses to run off gfx950 (and a fused
            # launcher refuses a pattern whose slices its tile origin does not produce)
            self._launchers[key] = compile_fused_gemm_scatter(
                self.rank, self.world, K=cfg.k, BLOCK_M=block_m, BLOCK_N=block_n, quant=cfg.quant, fuse=fuse,
                chunks=cfg.chunks, pattern=cfg.pattern if fuse else "all-reduce")
        return self._launchers[key]

    def _stream(self):
        """The current stream of the op's device (None off a GPU: the launcher refuses before using it)."""
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def plain_launcher(self, b_pre, b_scale, m):
        """None: the op's plain calls (``gemm-only``, one rank) go through :meth:`gemm_out` and the
        FlyDSL launch; CudaBackend's is its cuBLAS path, whose per-M configs this class never builds."""
        return None

    def gemm(self, a, b_pre, a_scale, b_scale, *, out, plan):
        cfg = self.config
        block_m, block_n = gemm_tile(n=cfg.n, quant=cfg.quant)
        launch = self._launcher(fuse=False, block_m=block_m, block_n=block_n)
        launch(a, b_pre, out, a_scale, b_scale, plan.m, cfg.n, stream=self._stream())

    def _rows_gemm(self, b_pre, b_scale):
        """``gemm(a, a_scale, out)``: ``out = a @ B.T`` for a block of rows (rows of A, or of a window
        slot of gathered rows) on the current stream: the plain FlyDSL launch (``fuse=False``, the
        plain GEMM's tile), which :meth:`CudaBackend.all_gather_gemm` calls per source and chunk. A
        blockscale scale block whose column stride is not its row count (rows of the ``[K/128, rows]``
        slot, or of a longer A scale) is repacked: the kernel reads ``[K/128, rows]`` dense (its
        launcher checks the stride)."""
        quant, n = self.config.quant, self.config.n
        block_m, block_n = gemm_tile(n=n, quant=quant)
        launch = self._launcher(fuse=False, block_m=block_m, block_n=block_n)

        def gemm(a, a_scale, out):
            rows = a.shape[0]
            if rows == 0:
                return
            a_scale = dense_block_scales(quant, a_scale, rows)
            # the stream current at the call, not at this closure's making: the callers of a row
            # GEMM (CudaBackend's, with the schedule) pick the stream it goes to
            launch(a, b_pre, out, a_scale, b_scale, rows, n, stream=self._stream())

        return gemm

    def _produce_rows(self, a, b_pre, a_scale, b_scale, plan):
        """The reduce-scatter along rows: the same fused launch (its tiles start at A row
        ``dest * M/W`` and B row 0, the launcher passes the slice origins), walking this pattern's
        tile table, instead of CudaBackend's vendor GEMM per group of a dest's chunks."""
        self._fused_gemm(a, b_pre, a_scale, b_scale, plan)
        return self.partial

    def _fused_args(self, plan) -> FusedLaunchArgs:
        """Per M (tile walk and per-call targets depend on M alone), checked once against the window."""
        args = self._args.get(plan.m)
        if args is None:
            args = fused_launch_args(self.config, plan)
            assert tuple(self.partial.shape) == args.partial_shape and self.counters.numel() == args.counter_words
            assert args.chunk_targets == tuple(tuple(self.schedule._tiles(plan, d, c) for c in range(plan.chunks))
                                               for d in range(self.world)), "kernel and transport disagree on targets"
            self._args[plan.m] = args
        return args

    def _fused_gemm(self, a, b_pre, a_scale, b_scale, plan, *, reduce_into=None) -> None:
        assert reduce_into is None, "the FlyDSL kernel has no epilogue reduce (dma_reduce_in_gemm is False)"
        cfg = self.config
        if self.schedule is None:  # gemm-only or one rank: no transport was built
            raise RuntimeError(f"Gfx950Backend: the op was built with mode={cfg.mode!r} at world {cfg.world}; "
                               f"it has no transport")
        args = self._fused_args(plan)
        self.counters.zero_()  # consumed words, zeroed at the call's start (see cco.cuda.dma)
        self.schedule.begin(plan)
        launch = self._launcher(fuse=True, block_m=args.block_m, block_n=args.block_n)
        launch(a, b_pre, self.partial, a_scale, b_scale, plan.m, cfg.n, counters=self.counters,
               stream=self._stream())

    def all_reduce_window(self, *, out, plan):
        if self.schedule is None:
            raise RuntimeError(f"Gfx950Backend: the op was built with mode={self.config.mode!r} at world "
                               f"{self.config.world}; it has no transport")
        super().all_reduce_window(out=out, plan=plan)

    def check(self) -> None:
        if self.schedule is not None:
            super().check()

    def close(self):
        self._launchers = {}
        super().close()
