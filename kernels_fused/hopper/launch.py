"""Kept Triton launches: a kernel called again and again with the same argument shapes (the decode
GEMM, the activation quantizer) launched through the compiled kernel's own launcher instead of
``JITFunction.run``.

At decode sizes a Triton launch costs more host time than its kernel takes on the device, and most
of it is Python: ``JITFunction.run`` binds the arguments, builds its cache key from every argument's
type, value class and alignment, finds the compiled kernel, and its runner (``CompiledKernel[grid]``)
looks up the current device and stream and builds launch metadata for hooks. A :class:`Kernel` does
that once per call shape and device (its owner keys it by everything Triton specializes on: the
integer arguments' values, every pointer's dtype and 16-byte alignment, the device) and then calls
the launcher with the function handle, metadata and grid it found, reading only the stream per call
(a graph capture's, a side stream). It takes ``JITFunction.run`` again where a launch hook is set (a
profiler must see every launch), where the current device is not the kernel's, or with
``FAST_LAUNCH`` off (tests compare the two bit for bit: ``test_cuda_nn.py``, ``scripts/tune_decode.py``).
"""

from __future__ import annotations

import functools
import os

import torch

# The compiled kernel's launcher, called as ``CompiledKernel[grid]``'s runner calls it (Triton 3.2 to
# 3.9 pass it the same arguments); False (``CCO_FAST_LAUNCH=0``): every call through ``JITFunction.run``
# (read per call, so a benchmark or test may switch it between calls).
FAST_LAUNCH = os.environ.get("CCO_FAST_LAUNCH", "1") != "0"
# The most call shapes one owner keeps at once (:func:`keep`): a shape holds M's value where Triton
# specializes on it, so a server that prefills prompts of every length would add one per length; past
# this many the owner's launches start over (the next call of each shape goes through
# JITFunction.run once more, which compiles nothing new).
LAUNCHES_KEPT = 1024


def keep(launches: dict, key, launch, kept: int | None = None):
    """``launches[key] = launch`` (returned), ``launches`` first emptied where it holds ``kept``
    entries (default ``LAUNCHES_KEPT``): never grown without bound."""
    if len(launches) >= (LAUNCHES_KEPT if kept is None else kept):
        launches.clear()
    launches[key] = launch
    return launch


class Kernel:
    """One Triton kernel's launch for one call shape and device: the kernel, its grid and launch
    options, and after the first launch on the call's device the kept launcher and the compiled
    kernel it launches (``kernels_fused.hopper.native`` plans its launches from it)."""

    __slots__ = ("fn", "grid", "options", "fast", "compiled")

    def __init__(self, fn, grid, **options):
        self.fn, self.grid, self.options, self.fast, self.compiled = fn, grid, options, None, None

    def __call__(self, device: int, *args) -> None:
        """Launch on ``device`` (the index of the tensors' device; -1 on the CPU, Triton's
        interpreter) with all of the kernel's arguments in order, its constexprs included."""
        if self.fast is not None and FAST_LAUNCH and torch._C._cuda_getDevice() == device and not launch_hooks():
            self.fast(*args)
            return
        if device >= 0 and torch._C._cuda_getDevice() != device:  # load and launch on the tensors' device
            with torch.cuda.device(device):
                self.fn[self.grid](*args, **self.options)
            return
        compiled = self.fn[self.grid](*args, **self.options)
        if self.fast is None and FAST_LAUNCH and compiled is not None and hasattr(compiled, "packed_metadata"):
            self.fast = _launcher(compiled, (*self.grid, 1, 1)[:3], device)
            self.compiled = compiled

    def run_jit(self, device: int, *args) -> None:
        """Launch through ``JITFunction.run`` (which specializes on these very arguments), never
        the kept launcher: for a caller whose arguments may differ from the kept launch's in what
        Triton specializes on (a pointer's alignment)."""
        with torch.cuda.device(device):
            self.fn[self.grid](*args, **self.options)


def specialization(args, unspecialized=()) -> tuple:
    """A key of what Triton's ``JITFunction.run`` specializes a launch of ``args`` on, for an owner
    whose launches vary in every argument (the lsa kernel's): per argument, a tensor's dtype and
    16-byte alignment, a host tensor descriptor's base (dtype, alignment), shape, strides and block,
    an int's value (or, at the positions in ``unspecialized``, the kernel's ``do_not_specialize``
    arguments, only whether it takes 64 bits), anything else its value. Stricter than Triton's own
    key (an int's value, not its divisibility), never looser."""
    key = []
    for i, v in enumerate(args):
        if isinstance(v, torch.Tensor):
            key.append((v.dtype, v.data_ptr() % 16))
        elif type(v) is int and i in unspecialized:
            key.append(not -2**31 <= v < 2**31)
        elif hasattr(v, "block_shape"):  # triton.tools.tensor_descriptor.TensorDescriptor
            key.append((v.base.dtype, v.base.data_ptr() % 16, tuple(v.shape), tuple(v.strides), tuple(v.block_shape)))
        else:
            key.append(v)
    return tuple(key)


def _launcher(compiled, grid, device: int):
    """``compiled[grid]``'s runner without its per-call lookups: the stream is ``device``'s current
    one; no launch metadata and no hooks (the caller takes the runner's path where a hook is set)."""
    compiled[grid]  # loads the function on the current device (CompiledKernel._init_handles)
    run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    gx, gy, gz = grid
    stream = torch._C._cuda_getCurrentRawStream

    def launch(*args):
        run(gx, gy, gz, stream(device), function, packed, None, None, None, *args)

    return launch


@functools.cache
def _hook_holder():
    """Where the installed Triton keeps its launch hooks: ``knobs.runtime`` (Triton >= 3.4), else
    ``CompiledKernel``'s class attributes."""
    try:
        from triton import knobs
        return knobs.runtime
    except ImportError:
        from triton.compiler.compiler import CompiledKernel
        return CompiledKernel


def launch_hooks() -> bool:
    """Whether a Triton launch hook is set (a profiler's): None or an empty hook chain is none."""
    holder = _hook_holder()
    for hook in (getattr(holder, "launch_enter_hook", None), getattr(holder, "launch_exit_hook", None)):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


__all__ = ["FAST_LAUNCH", "LAUNCHES_KEPT", "Kernel", "keep", "launch_hooks", "specialization"]
