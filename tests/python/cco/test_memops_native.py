"""The dma schedule's stream memory operations through the decode extension (``csrc/stream_memops.cpp``,
``cco.cuda.memops``) on the host: what can be shown without a GPU. On the GPU
``test_cuda_nn.py::check_memops_native`` writes, waits on and copies device words through them.

Here: ``memops.write`` / ``wait_geq`` / ``copy`` are the C++ functions once the extension is loaded
and the cuda-python ones before (and with ``CCO_MEMOPS_NATIVE=0``), with the arguments in the order
each driver call takes them; the C++ functions pass the stream, address, value and flags to the
driver's entry points in cuda.h's order and raise RuntimeError naming the call and the CUresult name
(a stand-in ``libcuda.so.1`` compiled here, in a process of its own); without a driver they raise
RuntimeError too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from cco.cuda import memops
from kernels_fused.hopper import native as NV

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(scope="module")
def extension():
    """The extension module, built as a job's first CUDA decode call builds it (a separate process)."""
    if not NV.ENABLED:
        pytest.fail("CCO_DECODE_NATIVE=0 is set: this module tests the C++ stream memory operations")
    assert NV.start(wait=900), f"the extension did not build: {NV.error()}"
    return NV.MODULE


class _Recorder:
    """A module with the extension's three functions, recording each call."""

    def __init__(self):
        self.calls = []
        for name in ("stream_write_value64", "stream_wait_value64_geq", "memcpy_async"):
            setattr(self, name, lambda *args, _name=name: self.calls.append((_name, *args)))


def _fake_driver(calls):
    """cuda-python's driver module as memops uses it: handles and words wrapped, each call recorded."""
    wrap = lambda kind: (lambda v: (kind, v))  # noqa: E731
    success = object()
    return SimpleNamespace(
        CUstream=wrap("stream"), CUdeviceptr=wrap("ptr"), cuuint64_t=wrap("u64"),
        CUresult=SimpleNamespace(CUDA_SUCCESS=success),
        CUstreamWaitValue_flags=SimpleNamespace(CU_STREAM_WAIT_VALUE_GEQ="GEQ"),
        CUstreamWriteValue_flags=SimpleNamespace(CU_STREAM_WRITE_VALUE_DEFAULT="DEFAULT"),
        cuStreamWaitValue64=lambda *a: calls.append(("cuStreamWaitValue64", *a)) or (success,),
        cuStreamWriteValue64=lambda *a: calls.append(("cuStreamWriteValue64", *a)) or (success,),
        cuMemcpyAsync=lambda *a: calls.append(("cuMemcpyAsync", *a)) or (success,))


@pytest.fixture
def routed(monkeypatch):
    """memops's three functions and native's loaded state restored after the test."""
    for name in ("write", "wait_geq", "copy"):
        monkeypatch.setattr(memops, name, getattr(memops, name))
    monkeypatch.setattr(NV, "MODULE", None)
    monkeypatch.setattr(NV, "_hooks", [])
    memops._route(None)  # as before a load (an earlier test module may have loaded the extension)


def _calls_of(stream=11, addr=0x7000, value=5, dst=0x9000, nbytes=64):
    memops.write(stream, addr, value)
    memops.wait_geq(stream, addr, value + 1)
    memops.copy(stream, dst, addr, nbytes)


def test_memops_route_to_the_extension_once_loaded(routed, monkeypatch):
    """Before the load: cuda-python, each call's arguments wrapped in the driver call's order. Once
    native publishes its module (the callback memops registered): the C++ functions, the same
    arguments in the same order. CCO_MEMOPS_NATIVE=0 (NATIVE off): cuda-python still."""
    driver_calls = []
    driver = _fake_driver(driver_calls)
    monkeypatch.setattr(memops, "_driver", lambda: driver)
    NV.on_load(memops._route)  # as memops's import registers it
    _calls_of()
    assert driver_calls == [
        ("cuStreamWriteValue64", ("stream", 11), ("ptr", 0x7000), ("u64", 5), "DEFAULT"),
        ("cuStreamWaitValue64", ("stream", 11), ("ptr", 0x7000), ("u64", 6), "GEQ"),
        ("cuMemcpyAsync", ("ptr", 0x9000), ("ptr", 0x7000), 64, ("stream", 11)),
    ]
    fake = _Recorder()
    NV._publish(fake)
    assert NV.MODULE is fake and NV._hooks == []
    driver_calls.clear()
    _calls_of()
    assert driver_calls == []
    assert fake.calls == [("stream_write_value64", 11, 0x7000, 5), ("stream_wait_value64_geq", 11, 0x7000, 6),
                          ("memcpy_async", 11, 0x9000, 0x7000, 64)]
    monkeypatch.setattr(memops, "NATIVE", False)
    fake.calls.clear()
    memops._route(fake)
    _calls_of()
    assert fake.calls == [] and [c[0] for c in driver_calls] == ["cuStreamWriteValue64", "cuStreamWaitValue64",
                                                                  "cuMemcpyAsync"]


def test_on_load_callbacks_run_once_each(routed):
    """Callbacks queued before the load run once at the load, one that raises warns and does not stop
    the next; one registered once the module is loaded runs at once (memops imported after the load)."""
    fake, seen = _Recorder(), []

    def broken(module):
        raise KeyError("stream_write_value64")

    NV.on_load(broken)
    NV.on_load(seen.append)
    with pytest.warns(RuntimeWarning, match="callback of the loaded extension failed.*stream_write_value64"):
        NV._publish(fake)
    assert seen == [fake] and NV._hooks == []
    NV.on_load(seen.append)
    assert seen == [fake, fake] and NV._hooks == []


def test_memops_use_the_built_extension(extension):
    """The real build: memops's import registered its callback, so the three functions are the
    module's; without libcuda (this machine) each raises RuntimeError naming the call, not a crash."""
    assert (memops.write, memops.wait_geq, memops.copy) == (
        extension.stream_write_value64, extension.stream_wait_value64_geq, extension.memcpy_async)
    missing = extension.memops_missing()
    if missing:  # (where there is a driver, check_memops_native runs the calls on the GPU)
        assert missing == "libcuda.so.1 cannot be loaded"
        for call, what in ((lambda: memops.write(0, 0x1000, 1), "cuStreamWriteValue64"),
                           (lambda: memops.wait_geq(0, 0x1000, 1), "cuStreamWaitValue64"),
                           (lambda: memops.copy(0, 0x1000, 0x2000, 8), "cuMemcpyAsync")):
            with pytest.raises(RuntimeError, match=f"^{what} failed: libcuda.so.1 cannot be loaded$"):
                call()
    memops.copy(0, 0x1000, 0x2000, 0)  # no bytes: no driver call, as the cuda-python copy


# A stand-in driver: records each call's arguments; a value, address or size of 0xBAD fails with
# CUDA_ERROR_INVALID_VALUE (1), one of 0xB0B with a code cuGetErrorName does not know.
FAKE_CUDA = r"""
#include <stdint.h>
#include <stdio.h>
#include <string.h>
static char calls[4096];
const char* fake_calls(void) { return calls; }
static int result(uint64_t v) { return v == 0xBAD ? 1 : v == 0xB0B ? 999 : 0; }
int cuStreamWriteValue64_v2(void* s, uint64_t a, uint64_t v, unsigned f) {
  sprintf(calls + strlen(calls), "write %lu %lu %lu %u;", (unsigned long)(uintptr_t)s, (unsigned long)a,
          (unsigned long)v, f);
  return result(v);
}
int cuStreamWaitValue64_v2(void* s, uint64_t a, uint64_t v, unsigned f) {
  sprintf(calls + strlen(calls), "wait %lu %lu %lu %u;", (unsigned long)(uintptr_t)s, (unsigned long)a,
          (unsigned long)v, f);
  return result(v);
}
int cuMemcpyAsync(uint64_t d, uint64_t src, size_t n, void* s) {
  sprintf(calls + strlen(calls), "copy %lu %lu %lu %lu;", (unsigned long)d, (unsigned long)src, (unsigned long)n,
          (unsigned long)(uintptr_t)s);
  return result(n);
}
int cuGetErrorName(int r, const char** name) {
  if (r != 1) { *name = 0; return 1; }
  *name = "CUDA_ERROR_INVALID_VALUE";
  return 0;
}
"""

CHILD = """
import ctypes, json
from kernels_fused.hopper import native as NV
m = NV.build()
out = {"missing": m.memops_missing()}
m.stream_write_value64(11, 0x7000, 5)
m.stream_wait_value64_geq(12, 0x7008, 6)
m.memcpy_async(13, 0x9000, 0x7000, 64)
m.memcpy_async(13, 0x9000, 0x7000, 0)
errors = []
for call in (lambda: m.stream_write_value64(1, 2, 0xBAD), lambda: m.stream_wait_value64_geq(1, 2, 0xB0B),
             lambda: m.memcpy_async(1, 2, 3, 0xBAD)):
    try:
        call()
    except RuntimeError as err:
        errors.append(str(err))
out["errors"] = errors
lib = ctypes.CDLL("libcuda.so.1")  # the stand-in the extension opened (already loaded: the same one)
lib.fake_calls.restype = ctypes.c_char_p
out["calls"] = lib.fake_calls().decode()
print(json.dumps(out))
"""


def test_native_calls_reach_the_driver_in_its_order(extension, tmp_path):
    """Through a stand-in libcuda.so.1: each call reaches its ``_v2`` (or only) entry point with the
    stream, address, value and flag (0: CU_STREAM_WRITE_VALUE_DEFAULT, CU_STREAM_WAIT_VALUE_GEQ) in
    cuda.h's order, a copy of no bytes reaches none, and a failed result is a RuntimeError naming
    the call and cuGetErrorName's name (the code where the driver has no name for it)."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    assert compiler, "the extension built, so a C compiler is here"
    (tmp_path / "fake_cuda.c").write_text(FAKE_CUDA)
    subprocess.run([compiler, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(tmp_path / "libcuda.so.1"),
                    str(tmp_path / "fake_cuda.c")], check=True)
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, (str(tmp_path), os.environ.get(
        "LD_LIBRARY_PATH")))), "PYTHONPATH": os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH"))))}
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD)], env=env, capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout.strip().splitlines()[-1])
    assert out["missing"] == ""
    assert out["calls"].split(";")[:-1] == [
        f"write 11 {0x7000} 5 0", f"wait 12 {0x7008} 6 0", f"copy {0x9000} {0x7000} 64 13",
        f"write 1 2 {0xBAD} 0", f"wait 1 2 {0xB0B} 0", f"copy 2 3 {0xBAD} 1"]
    assert out["errors"] == ["cuStreamWriteValue64 failed: CUDA_ERROR_INVALID_VALUE",
                             "cuStreamWaitValue64 failed: CUresult 999",
                             "cuMemcpyAsync failed: CUDA_ERROR_INVALID_VALUE"]
