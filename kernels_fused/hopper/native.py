"""The decode GEMM's eager calls in C++ (``csrc/decode_calls.cpp``): what remains of a decode-sized
call's host time after the kept launches (``kernels_fused.hopper.launch``) is Python around them:
the launch key, the output and scratch allocations, the launcher's argument parsing, about 10-20 us
a call on an H200's host (docs/decode.md). The C++ table replays, per call shape, the launches the
Python path (``kernels_fused.hopper.decode``) found: one call computes the key, allocates, packs the
arguments and launches through the driver.

How it stays the Python path's launch, bit for bit:

- A plan is written from the Python path's own launch (its compiled kernels, grid, warps, shared
  memory, cooperative flag) and its own argument tuples with the tensors replaced by
  :class:`Pointer` roles, after that path ran once for the call shape; the integer and float
  arguments are the call shape's (the key holds every value Triton specialized on).
- The parameters are packed as Triton's launcher packs them (the non-constexpr arguments in order,
  then Triton's two scratch pointers, null: these kernels use none), and the table checks each plan
  against the function's parameters as the driver reports them (``cuFuncGetParamInfo``): a count or
  size that disagrees refuses the plan, and the call stays on the Python path.
- The MMA over quantized rows (ptpc, blockscale): the quantizer's launch and the MMA's, the call's
  one scratch holding the rows, their scales and the K split's counters and partials at the
  offsets of ``decode.MmaScratch``. One row of these quants: the one-row kernel as the eager path,
  the two launches as the captured one.
- blockscale's rows through cuBLAS (``decode.VENDOR_ROWS``, with ``CCO_DECODE_BLOCKSCALE_CUBLAS=1``):
  the plan is the quantizer's launch,
  after which the table calls ``at::_scaled_mm`` (or its kept cuBLASLt call; and the copy and bias
  add) as ``decode.vendor_gemm`` does, on the same tensors. mxfp8's rows over the weight's bf16
  copy: the quantizer's launch writing the rows dequantized to bf16 (``ROWS``), then cuBLAS's bf16
  GEMM as ``decode.dense_gemm`` calls it (``cublasGemmEx`` on torch's handle as ``at::mm`` calls it,
  or ``at::mm`` itself). A kept call whose first call gives other bits than torch's op is not kept
  (``decode._same_bits``).
- mxfp8's rows over its fp8 weight (``decode.MX_ROWS``): the quantizer's launch writing the rows in
  bf16 into the scratch, then ``mx_decode``'s CUDA C++ kernel (:func:`describe_function`) over them.
- A call the table does not take returns None and runs the Python path: no plan for its key yet,
  the current device not x's, a graph capture where the plan has no two-launch path yet, a launch
  hook set (a profiler), ``ENABLED`` or ``launch.FAST_LAUNCH`` off.

It is built at a process's first CUDA decode call by a separate process (``python -m
kernels_fused.hopper.native --build``: torch's C++ extension build, ~20-60 s once per machine,
cached under ``TORCH_EXTENSIONS_DIR``), which a background thread waits for before it loads the
build; calls take the Python path until then. A separate process, because a build cut off half way
(a job that exits first, a killed rank) would leave torch's build lock behind and no process on the
machine would build it again; the builder finishes in its own session whatever happens to the job. It needs a C++ compiler and ninja, but no CUDA toolkit (the driver is
opened with dlopen, the stream comes from the caller); where the build fails, a warning says why
and every call keeps the Python path. ``CCO_DECODE_NATIVE=0`` switches it off.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
import warnings

# False (``CCO_DECODE_NATIVE=0``): no build, every call on the Python path (read per call, so a
# benchmark or test may switch it between calls).
ENABLED = os.environ.get("CCO_DECODE_NATIVE", "1") != "0"
# The most call shapes the table keeps (the kept launches' bound, launch.LAUNCHES_KEPT) and the
# most (device, stream) wait counters (decode.SYNC_KEPT).
PLANS_KEPT = 1024
SYNC_KEPT = 64
NAME = "cco_decode_calls"
SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "decode_calls.cpp")

# The built extension's Table once loaded (None before, and where the build failed).
TABLE = None
_started = False
_error: str | None = None
_done = threading.Event()

# The C++ table's parameter kinds and pointer roles (csrc/decode_calls.cpp, Kind and Role).
POINTER, BITS32, BITS64 = 0, 1, 2
X, W, SCALE, BIAS_OR_OUT, OUT, SCRATCH, SYNC, NULL, A_SCALE, ROWS = range(10)


class Pointer:
    """A pointer argument of a planned launch: the call's tensor of ``role`` (``X`` ... ``SYNC``),
    ``offset`` bytes past its start."""

    __slots__ = ("role", "offset")

    def __init__(self, role: int, offset: int = 0):
        self.role, self.offset = role, offset


def build():
    """The extension module, built (or loaded from torch's extension cache)."""
    from torch.utils.cpp_extension import load

    return load(name=NAME, sources=[SOURCE], extra_cflags=["-O2"], extra_ldflags=["-ldl"], verbose=False)


def start(wait: float | None = None) -> bool:
    """Build and load the table on a background thread, once per process (no-op where ``ENABLED``
    is off); with ``wait`` seconds, wait that long for it. Whether the table is loaded."""
    global _started
    if ENABLED and not _started:
        _started = True
        threading.Thread(target=_load, name="cco-decode-native-build", daemon=True).start()
    if wait is not None and _started:  # (nothing to wait for where no build was started)
        _done.wait(wait)
    return TABLE is not None


def error() -> str | None:
    """Why the table could not be built or loaded (None where it was, or is still building)."""
    return _error


def _load() -> None:
    global TABLE, _error
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # imports this module
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
        built = subprocess.run([sys.executable, "-m", __name__, "--build"], capture_output=True, text=True, env=env,
                               start_new_session=True)  # finishes the build whatever happens to this process
        if built.returncode:
            raise RuntimeError((built.stderr or built.stdout).strip()[-2000:])
        TABLE = build().Table(PLANS_KEPT, SYNC_KEPT)  # built: torch's cache check and the import
    except Exception as err:  # no compiler, no ninja, a read-only cache: the Python path stays
        _error = f"{type(err).__name__}: {err}"
        warnings.warn(f"decode_gemm: the C++ call path could not be built ({_error}); decode calls take the "
                      f"Python path (CCO_DECODE_NATIVE=0 skips the build)", RuntimeWarning, stacklevel=1)
    finally:
        _done.set()


def describe(kernel, args) -> tuple:
    """One planned launch of ``kernel`` (a ``launch.Kernel`` that has launched, so it holds its
    compiled kernel) with ``args`` in the kernel's order (:class:`Pointer` for every tensor):
    ``(function, grid, threads, shared bytes, cooperative, [(kind, value, offset), ...])``.
    Raises ValueError for a launch the table cannot replay."""
    compiled = kernel.compiled
    if compiled is None:
        raise ValueError("the kernel has not launched yet")
    meta = compiled.metadata
    if (getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0)
            or getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_pdl", False)):
        raise ValueError("the kernel needs Triton's scratch, clusters or PDL")
    types = list(compiled.src.signature.values())
    if len(types) != len(args):
        raise ValueError(f"the kernel takes {len(types)} arguments, the plan gives {len(args)}")
    params = []
    for arg, kind in zip(args, types):
        if kind == "constexpr":  # compiled in (Triton's launcher passes none of them)
            continue
        if isinstance(arg, Pointer) and kind.startswith("*"):
            params.append((POINTER, arg.role, arg.offset))
        elif kind == "i32" and type(arg) is int:
            params.append((BITS32, arg & 0xFFFFFFFF, 0))
        elif kind in ("i64", "u64") and type(arg) is int:
            params.append((BITS64, arg, 0))
        elif kind == "fp32" and isinstance(arg, float):
            params.append((BITS32, struct.unpack("<I", struct.pack("<f", arg))[0], 0))
        else:
            raise ValueError(f"an argument of type {kind} ({type(arg).__name__}) is not planned")
    params += [(POINTER, NULL, 0), (POINTER, NULL, 0)]  # Triton's global and profile scratch
    grid = (*kernel.grid, 1, 1)[:3]
    return (compiled.function, grid, meta.num_warps * 32, meta.shared, bool(meta.launch_cooperative_grid), params)


def describe_function(function: int, grid: tuple, threads: int, shared: int, args) -> tuple:
    """One planned launch of a CUDA C++ kernel (``kernels_fused.hopper.cubin``: no Triton scratch
    pointers; its cluster shape compiled in) in :func:`describe`'s form: ``args`` in the kernel's
    order, a :class:`Pointer` for every pointer and an int for every 32-bit integer."""
    params = []
    for arg in args:
        if isinstance(arg, Pointer):
            params.append((POINTER, arg.role, arg.offset))
        elif type(arg) is int:
            params.append((BITS32, arg & 0xFFFFFFFF, 0))
        else:
            raise ValueError(f"an argument of type {type(arg).__name__} is not planned")
    return (function, (*grid, 1, 1)[:3], threads, shared, False, params)


__all__ = ["ENABLED", "Pointer", "TABLE", "build", "describe", "describe_function", "error", "start"]


if __name__ == "__main__":
    if sys.argv[1:] != ["--build"]:
        raise SystemExit("usage: python -m kernels_fused.hopper.native --build")
    module = build()
    print(f"{NAME}: built and loaded ({module.__file__})")
