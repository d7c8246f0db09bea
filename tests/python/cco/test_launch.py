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
