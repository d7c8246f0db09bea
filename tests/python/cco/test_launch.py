"""A kept Triton launch (``kernels_fused.hopper.launch.Kernel``), on the host with a
stand-in for a Triton kernel: the first call goes through ``JITFunction.run`` and keeps the
compiled kernel's launcher; later calls pass that launcher what ``CompiledKernel[grid]``'s runner
would (grid, the current stream of the kernel's device, function, metadata, no hooks, the
arguments); a launch hook, a current device other than the kernel's, or ``FAST_LAUNCH`` off take
the slow path. On a GPU ``test_cuda_nn.py`` and ``scripts/tune_decode.py`` hold the kept launch's
output to ``JITFunction.run``'s bit for bit.

Guards: the stream read per call (a kept stream would launch a graph capture's kernels outside
it), the device in the launch (a process driving two GPUs), the hooks (a profiler would miss the
launches).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("triton")
from kernels_fused.hopper import launch as D  # noqa: E402


class FakeCompiled:
    """What ``JITFunction.run`` returns: the launcher (``run``), its function handle and metadata."""

    def __init__(self, log):
        self.log, self.function, self.packed_metadata, self.loaded = log, "fn-handle", "packed", 0

    def __getitem__(self, grid):  # CompiledKernel[grid]: loads the function, returns the runner
        self.loaded += 1
        return lambda *args: self.log.append(("runner", grid, args))

    def run(self, *launch):
        self.log.append(("run", launch))


class FakeJIT:
    """A ``@triton.jit`` function: ``fn[grid](*args, **options)`` compiles (once) and launches."""

    def __init__(self):
        self.log, self.compiled = [], None

    def __getitem__(self, grid):
        def jit_run(*args, **options):
            self.log.append(("jit", grid, args, options))
            self.compiled = self.compiled or FakeCompiled(self.log)
            return self.compiled
        return jit_run


@pytest.fixture
def gpu(monkeypatch):
    """The current device and each device's current stream, as torch would report them."""
    state = {"device": 0, "streams": {0: 1000, 1: 1001}, "entered": []}
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: state["device"], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: state["streams"][d], raising=False)

    @contextlib.contextmanager
    def device(d):
        state["entered"].append(d)
        yield

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(D, "FAST_LAUNCH", True)
    holder = type("Hooks", (), {"launch_enter_hook": None, "launch_exit_hook": None})
    monkeypatch.setattr(D, "_hook_holder", lambda: holder)
    state["hooks"] = holder
    return state


def test_kept_launch_passes_the_runners_arguments_with_the_current_stream(gpu):
    fn = FakeJIT()
    kernel = D.Kernel(fn, (4, 2), num_warps=8)
    kernel(0, "x", 1, 2)
    assert fn.log == [("jit", (4, 2), ("x", 1, 2), {"num_warps": 8})]
    assert fn.compiled.loaded == 1  # the function loaded once, on the first call
    fn.log.clear()
    kernel(0, "y", 3, 4)
    gpu["streams"][0] = 2000  # another current stream (a graph capture's, a side stream): read per call
    kernel(0, "z", 5, 6)
    assert fn.log == [("run", (4, 2, 1, 1000, "fn-handle", "packed", None, None, None, "y", 3, 4)),
                      ("run", (4, 2, 1, 2000, "fn-handle", "packed", None, None, None, "z", 5, 6))]


def test_a_launch_hook_or_another_device_or_fast_launch_off_takes_the_slow_path(gpu, monkeypatch):
    fn = FakeJIT()
    kernel = D.Kernel(fn, (3,))
    kernel(0, "a")
    fn.log.clear()
    gpu["hooks"].launch_enter_hook = lambda *a: None  # a profiler's hook: it must see the launch
    kernel(0, "b")
    gpu["hooks"].launch_enter_hook = type("Chain", (), {"calls": []})()  # an empty hook chain is no hook
    kernel(0, "c")
    assert fn.log == [("jit", (3,), ("b",), {}), ("run", (3, 1, 1, 1000, "fn-handle", "packed", None, None, None, "c"))]
    fn.log.clear()
    gpu["device"] = 1  # the current device is not the tensors' (0): launched under the tensors' device
    kernel(0, "d")
    assert fn.log == [("jit", (3,), ("d",), {})] and gpu["entered"] == [0]
    gpu["device"] = 0
    monkeypatch.setattr(D, "FAST_LAUNCH", False)  # read per call: a kept launch is not taken either
    kernel(0, "e")
    fresh = D.Kernel(FakeJIT(), (3,))
    fresh(0, "f")
    fresh(0, "g")
    assert fn.log[-1] == ("jit", (3,), ("e",), {})
    assert [entry[0] for entry in fresh.fn.log] == ["jit", "jit"]


def test_a_kept_launch_stays_on_its_device(gpu):
    """A kernel first launched for device 1 launches on device 1's stream, never device 0's."""
    fn = FakeJIT()
    gpu["device"] = 1
    kernel = D.Kernel(fn, (2,))
    kernel(1, "a")
    kernel(1, "b")
    assert fn.log[-1] == ("run", (2, 1, 1, 1001, "fn-handle", "packed", None, None, None, "b"))


def test_specialization_keys_what_triton_specializes_on():
    """``launch.specialization``: a tensor's dtype and 16-byte alignment, a tensor descriptor's
    base, shape, strides and block, an int's value and a constexpr's value change the key; a
    tensor's address within its alignment, and an unspecialized int's value within 32 bits, do not
    (the lsa kernel's stamp, new every call: a key that held it would never be found again)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    buf = torch.zeros(64, dtype=torch.float32)
    base = (buf[:16], 7, 123456789, True)  # tensor, int, an unspecialized int, a constexpr
    key = D.specialization(base, unspecialized=(2,))
    assert D.specialization((buf[4:20], 7, 99, True), unspecialized=(2,)) == key  # 16 bytes on, another stamp
    assert D.specialization((buf[1:17], 7, 99, True), unspecialized=(2,)) != key  # 4 bytes on: alignment
    assert D.specialization((buf[:16].to(torch.float16), 7, 99, True), unspecialized=(2,)) != key
    assert D.specialization((buf[:16], 8, 99, True), unspecialized=(2,)) != key
    assert D.specialization((buf[:16], 7, 2**40, True), unspecialized=(2,)) != key  # the stamp takes 64 bits
    assert D.specialization((buf[:16], 7, 99, False), unspecialized=(2,)) != key
    assert D.specialization(base) != key  # specialized, the stamp's value is in the key

    x = torch.zeros(64, 64, dtype=torch.float16)
    desc = TensorDescriptor.from_tensor(x, [16, 32])
    same = D.specialization((TensorDescriptor.from_tensor(x.clone(), [16, 32]),))
    assert D.specialization((desc,)) == same
    assert D.specialization((TensorDescriptor.from_tensor(x, [16, 16]),)) != same
    assert D.specialization((TensorDescriptor.from_tensor(x[:32], [16, 32]),)) != same


def test_the_lsa_launch_skips_the_stamp_by_its_position():
    """``fp8_gemm_lsa`` keeps its launch by every argument but the stamp, found by position: the
    position is the kernel's ``stamp`` argument, which the kernel does not specialize on."""
    from kernels_fused.hopper import gemm
    from kernels_fused.hopper import kernels as tk

    fn = tk.fp8_gemm_lsa_kernel
    assert fn.arg_names[gemm._LSA_STAMP] == "stamp"
    # (the interpreter's function keeps the decorator's arguments in .kwargs, a JITFunction as attributes)
    unspecialized = fn.kwargs["do_not_specialize"] if hasattr(fn, "kwargs") else fn.do_not_specialize
    assert "stamp" in unspecialized or gemm._LSA_STAMP in unspecialized
