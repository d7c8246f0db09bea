"""Stream memory operations and copy-engine copies through the CUDA driver (``cuda-bindings``).

These are the primitives of the ``dma`` transport: a stream waits on a word in device memory
(``cuStreamWaitValue64``, GEQ: ``(int64)(*addr - value) >= 0``), writes a word after all earlier work
of the stream (``cuStreamWriteValue64``, which orders the write after prior memory operations of
the stream), and copies bytes with the copy engines (``cuMemcpyAsync`` / ``cuMemcpy2DAsync``; peer
addresses of a symmetric window are ordinary unified addresses). All take an integer stream
handle (``torch.cuda.Stream.cuda_stream``) and integer device addresses, and are captured into a
CUDA graph like any other stream work. Every driver result is checked.

The window of ranks that share a GPU (``cco.window.IpcWindow``) is allocated and mapped here too, with
the driver's IPC calls.
"""

from __future__ import annotations

import functools
import sys


@functools.cache
def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:  # older cuda-python layout
        from cuda import cuda as driver  # type: ignore[no-redef]
    return driver


def _check(result, what: str):
    driver = _driver()
    err = result[0] if isinstance(result, tuple) else result
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise RuntimeError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return result[1:] if isinstance(result, tuple) and len(result) > 1 else None


def wait_geq(stream: int, addr: int, value: int) -> None:
    """Work enqueued on ``stream`` after this waits until the int64 at ``addr`` is >= ``value``."""
    d = _driver()
    _check(d.cuStreamWaitValue64(d.CUstream(stream), d.CUdeviceptr(addr), d.cuuint64_t(value),
                                 d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue64")


def write(stream: int, addr: int, value: int) -> None:
    """Write the int64 ``value`` to ``addr`` once every earlier operation of ``stream`` is done."""
    d = _driver()
    _check(d.cuStreamWriteValue64(d.CUstream(stream), d.CUdeviceptr(addr), d.cuuint64_t(value),
                                  d.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue64")


def copy(stream: int, dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` from ``src`` to ``dst`` on the copy engines (any mix of local and peer)."""
    if nbytes:
        d = _driver()
        _check(d.cuMemcpyAsync(d.CUdeviceptr(dst), d.CUdeviceptr(src), nbytes, d.CUstream(stream)), "cuMemcpyAsync")


def fill(stream: int, dst: int, byte: int, nbytes: int) -> None:
    """Set ``nbytes`` bytes at ``dst`` to ``byte`` (a memset: no copy, so nothing it waits for
    behind another thread's copy to pageable host memory, which holds the driver's copies)."""
    if nbytes:
        d = _driver()
        _check(d.cuMemsetD8Async(d.CUdeviceptr(dst), byte, nbytes, d.CUstream(stream)), "cuMemsetD8Async")


def copy_2d(stream: int, *, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int) -> None:
    """Copy ``height`` rows of ``width`` bytes between pitched buffers on the copy engines."""
    if not (width and height):
        return
    d = _driver()
    p = d.CUDA_MEMCPY2D()
    p.srcMemoryType = d.CUmemorytype.CU_MEMORYTYPE_DEVICE
    p.srcDevice = d.CUdeviceptr(src)
    p.srcPitch = src_pitch
    p.dstMemoryType = d.CUmemorytype.CU_MEMORYTYPE_DEVICE
    p.dstDevice = d.CUdeviceptr(dst)
    p.dstPitch = dst_pitch
    p.WidthInBytes = width
    p.Height = height
    _check(d.cuMemcpy2DAsync(p, d.CUstream(stream)), "cuMemcpy2DAsync")


def stream_create() -> int:
    """A stream of its own at the device's highest priority, not synchronizing with the legacy
    default stream (torch hands out streams from a pool of 32 it recycles, so two of its streams may
    be one). For work that must run beside streams that are blocked: ``cco.cuda.watchdog``."""
    d = _driver()
    _, greatest = _check(d.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
    (stream,) = _check(d.cuStreamCreateWithPriority(d.CUstream_flags.CU_STREAM_NON_BLOCKING, greatest),
                       "cuStreamCreateWithPriority")
    return int(stream)


def relax_capture_mode() -> None:
    """Let the calling thread make stream calls while another thread captures a CUDA graph in
    torch's default ("global") mode, which otherwise forbids them to every thread and invalidates
    the capture (``cco.cuda.watchdog``'s thread: its reads and releases run on streams of its own)."""
    d = _driver()
    _check(d.cuThreadExchangeStreamCaptureMode(d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
           "cuThreadExchangeStreamCaptureMode")


def stream_destroy(stream: int) -> None:
    d = _driver()
    _check(d.cuStreamDestroy(d.CUstream(stream)), "cuStreamDestroy")


def graph_launch(graph_exec: int, stream: int) -> None:
    """Launch an instantiated CUDA graph (``torch.cuda.CUDAGraph.raw_cuda_graph_exec()``) on
    ``stream``: what ``CUDAGraph.replay()`` does, without making ``stream`` current first (that
    switch costs ~17 us of host time, the launch ~3)."""
    d = _driver()
    _check(d.cuGraphLaunch(d.CUgraphExec(graph_exec), d.CUstream(stream)), "cuGraphLaunch")


def mem_alloc(nbytes: int) -> int:
    """``nbytes`` of device memory on the current context, outside torch's caching allocator (whose
    blocks share one allocation, and whose expandable segments have no IPC handle)."""
    d = _driver()
    (ptr,) = _check(d.cuMemAlloc(nbytes), "cuMemAlloc")
    return int(ptr)


def mem_free(ptr: int) -> None:
    d = _driver()
    _check(d.cuMemFree(d.CUdeviceptr(ptr)), "cuMemFree")


def ipc_export(ptr: int) -> bytes:
    """The IPC handle of an allocation made by :func:`mem_alloc`, as bytes another process can open."""
    d = _driver()
    (handle,) = _check(d.cuIpcGetMemHandle(d.CUdeviceptr(ptr)), "cuIpcGetMemHandle")
    return bytes(handle.reserved)


def ipc_open(handle: bytes) -> int:
    """Map another process's allocation (its :func:`ipc_export` bytes); the address it has here."""
    d = _driver()
    h = d.CUipcMemHandle()
    h.reserved = handle
    (ptr,) = _check(d.cuIpcOpenMemHandle(h, d.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                    "cuIpcOpenMemHandle")
    return int(ptr)


def ipc_close(ptr: int) -> None:
    d = _driver()
    _check(d.cuIpcCloseMemHandle(d.CUdeviceptr(ptr)), "cuIpcCloseMemHandle")


def supports_mem_ops(device_index: int) -> str | None:
    """``None`` when the device runs 64-bit stream memory operations, else why not."""
    d = _driver()
    try:
        _check(d.cuInit(0), "cuInit")
        (dev,) = _check(d.cuDeviceGet(device_index), "cuDeviceGet")
        (ok,) = _check(d.cuDeviceGetAttribute(
            d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev), "cuDeviceGetAttribute")
    except (RuntimeError, AttributeError) as err:
        return f"stream memory operations unavailable: {err}"
    return None if ok else "the device does not support 64-bit stream memory operations"


# --------------------------------------------------------------------------------------------------
# kernel variants: the same wait and write as one-warp Triton kernels, for drivers that refuse to
# capture stream memory operations into a CUDA graph (probed once by ``capture_supported``)
# --------------------------------------------------------------------------------------------------
@functools.cache
def _word_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _wait_kernel(ptr, value):
        seen = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
        while seen - value < 0:  # cyclic >=, as cuStreamWaitValue64 GEQ
            seen = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")

    @triton.jit
    def _write_kernel(ptr, value):
        tl.atomic_xchg(ptr, value, sem="release", scope="sys")

    return _wait_kernel, _write_kernel


def _word(addr: int):
    import torch

    class _Ptr:  # Triton accepts any object with data_ptr() and dtype
        dtype = torch.int64

        def data_ptr(self):
            return addr

    return _Ptr()


def wait_geq_kernel(stream, addr: int, value: int) -> None:
    """:func:`wait_geq` as a one-warp spin kernel on the current stream (``stream`` must be current)."""
    wait, _ = _word_kernels()
    wait[(1,)](_word(addr), value, num_warps=1)


def write_kernel(stream, addr: int, value: int) -> None:
    """:func:`write` as a one-warp kernel on the current stream (``stream`` must be current)."""
    _, write_ = _word_kernels()
    write_[(1,)](_word(addr), value, num_warps=1)


@functools.cache
def _block_wait_kernel():
    import triton
    import triton.language as tl

    # the block's bounds and the value are run-time values (one compiled kernel per row length)
    @triton.jit(do_not_specialize=["s0", "s1", "skip", "c0", "c1", "value"])
    def _wait_block_kernel(words, s0, s1, skip, c0, c1, value, ROW: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        s, c = i // ROW, i % ROW
        mask = (s >= s0) & (s < s1) & (s != skip) & (c >= c0) & (c < c1)
        seen = tl.atomic_add(words + i, 0, mask=mask, sem="acquire", scope="sys")
        short = tl.sum(tl.where(mask & (seen - value < 0), 1, 0))  # cyclic >=, as _wait_kernel's
        while short > 0:
            seen = tl.atomic_add(words + i, 0, mask=mask, sem="acquire", scope="sys")
            short = tl.sum(tl.where(mask & (seen - value < 0), 1, 0))

    return _wait_block_kernel


_block_waits: dict = {}  # (device index, row, block) -> its kept launch (kernels_fused.hopper.launch.Kernel)


def wait_block_kernel(stream, words, row: int, rows: tuple[int, int], cols: tuple[int, int], skip: int,
                      value: int) -> None:
    """Work enqueued on the current stream after this waits until every int64 word
    ``words[s * row + c]`` with ``s`` in ``rows`` but ``skip`` and ``c`` in ``cols`` (half-open
    ranges) is >= ``value``, as :func:`wait_geq_kernel` waits for one: one one-warp spin launch
    (``stream`` must be current) that polls the whole block, instead of a :func:`wait_geq` per word.
    A stream wait holds its stream ~1.6-1.9 us of device time even on a word already set, this launch
    ~1.1 us for 28 set words (graph replay on an H200, ``scripts/probe_stream_ops.py``); in an
    all-gather call at W = 8 it replaced 28 stream waits for 43-54 us less a call (``bench_sp_parts
    --flags-landed``, docs/BENCHMARKS.md), and it is kept (``kernels_fused.hopper.launch``: a few
    us of host time). Its first launch on a device compiles
    the kernel: make it outside any graph capture (``cco.cuda.dma`` does at construction)."""
    from kernels_fused.hopper.launch import Kernel

    device = words.device.index
    block = 1 << max(0, (words.numel() - 1).bit_length())
    key = (device, row, block)
    launch = _block_waits.get(key)
    if launch is None:
        launch = _block_waits[key] = Kernel(_block_wait_kernel(), (1,), num_warps=1)
    launch(device, words, rows[0], rows[1], skip, cols[0], cols[1], value, row, block)


def capture_probe(ops, device_index: int) -> bool:
    """Whether a graph captures and replays ``ops.write`` then ``ops.wait_geq`` on this device; ``ops``
    is this module or any object with the same functions (the ROCm backend's HIP memops)."""
    import torch

    word = torch.zeros(1, dtype=torch.int64, device=f"cuda:{device_index}")
    stream = torch.cuda.Stream(device=word.device)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            ops.write(stream.cuda_stream, word.data_ptr(), 1)
            ops.wait_geq(stream.cuda_stream, word.data_ptr(), 1)
        graph.replay()
        torch.cuda.synchronize(word.device)
        return int(word.item()) == 1
    except RuntimeError:
        torch.cuda.synchronize(word.device)
        return False


@functools.cache
def capture_supported(device_index: int) -> bool:
    """Whether stream memory operations can be captured into a CUDA graph on this device."""
    return capture_probe(sys.modules[__name__], device_index)
