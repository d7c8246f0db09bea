"""CUDA C++ kernels of this folder (``csrc/*.cu``): built by nvcc into a cubin, loaded and launched
through the driver by ctypes.

Why no torch extension: the GPU machines reach no package registry and build nothing but what nvcc
compiles in a second; a cubin launched by ``cuLaunchKernel`` on torch's current stream needs no
Python binding, and a CUDA graph captures the launch like any other.

The build: ``nvcc -arch=sm_90a -cubin -O3`` once per source text and list of defines (each a
build's ``-D`` macros), cached under ``CCO_CUBIN_CACHE`` (default ``~/.cache/cco``), then
``cuModuleLoadData`` in the context of the operands' device.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess

CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def source(name: str) -> str:
    """The path of ``csrc/<name>``."""
    return os.path.join(CSRC, name)


def nvcc() -> str | None:
    """The nvcc that builds the kernels (PATH, then ``$CUDA_HOME/bin``), or None."""
    found = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    return found if os.path.exists(found) else None


def compile_cubin(src: str, defines: list[str], path: str, extra: tuple = ()) -> str:
    """Compile ``src`` with ``defines`` into the cubin ``path``; ptxas's report (``-v``) is the return
    value. Raises RuntimeError with nvcc's words where it fails (no cubin is left behind)."""
    compiler = nvcc()
    if compiler is None:
        raise RuntimeError(f"{os.path.basename(src)} needs nvcc (PATH or $CUDA_HOME/bin) to build its kernel")
    done = subprocess.run([compiler, "-arch=sm_90a", "-cubin", "-O3", "-Xptxas", "-v", *defines, *extra,
                           "-o", path, src], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"nvcc failed on {src} ({' '.join(defines)}):\n{done.stderr[-4000:]}")
    return done.stderr + done.stdout


def ptxas_report(src: str, defines: list[str], directory: str, extra: tuple = ()) -> dict:
    """Per kernel of ``src``'s build, ``{name: {registers, spill_stores, spill_loads}}`` (bytes of
    spills) as ptxas reports them, compiled into ``directory`` with nvcc's ``extra`` options."""
    stem = os.path.splitext(os.path.basename(src))[0]
    log = compile_cubin(src, defines, os.path.join(directory, stem + ".cubin"), extra)
    kernels = {}
    for block in re.split(r"ptxas info\s*: Compiling entry function ", log)[1:]:
        name = re.match(r"'(\w+)'", block)
        registers = re.search(r"Used (\d+) registers", block)
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block)
        if not (name and registers and spills):
            raise RuntimeError(f"no register or spill line in ptxas's report:\n{block[-2000:]}")
        kernels[name[1]] = {"registers": int(registers[1]), "spill_stores": int(spills[1]),
                            "spill_loads": int(spills[2])}
    if not kernels:
        raise RuntimeError(f"no entry function in ptxas's report:\n{log[-2000:]}")
    return kernels


def build(src: str, defines: list[str]) -> str:
    """The cubin path of ``src`` built with ``defines``, compiled once per source text and defines."""
    with open(src, "rb") as f:
        digest = hashlib.sha256(f.read() + " ".join(defines).encode()).hexdigest()[:16]
    cache = os.environ.get("CCO_CUBIN_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "cco"))
    os.makedirs(cache, exist_ok=True)
    cubin = os.path.join(cache, f"{os.path.splitext(os.path.basename(src))[0]}_{digest}.cubin")
    if not os.path.exists(cubin):
        tmp = f"{cubin}.{os.getpid()}"
        compile_cubin(src, defines, tmp)
        os.replace(tmp, cubin)
    return cubin


def check(result: int, what: str) -> None:
    if result:
        raise RuntimeError(f"{what} failed: CUresult {result}")


_driver = None
_modules: dict[tuple, ctypes.c_void_p] = {}  # (device, source, defines) -> its loaded cubin
_functions: dict[tuple, tuple[ctypes.c_void_p, int]] = {}  # (.., name) -> (kernel, its shared allowance)


def driver():
    """libcuda with the argument types of the calls made here."""
    global _driver
    if _driver is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuTensorMapEncodeTiled.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                               ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        lib.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
        lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
        lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        _driver = lib
    return _driver


def function(device: int, src: str, defines: list[str], name: bytes, shared: int) -> ctypes.c_void_p:
    """Kernel ``name`` of ``src``'s build, loaded into ``device``'s current context (the caller holds
    ``torch.cuda.device(device)``), allowed at least ``shared`` bytes of dynamic shared memory; kept.
    A build is loaded once per device, whichever of its kernels are asked for, and a kernel's
    allowance only grows (one handle serves every size asked)."""
    build_key = (device, src, tuple(defines))
    kept = _functions.get((*build_key, name))
    if kept is not None and kept[1] >= shared:
        return kept[0]
    lib = driver()
    if kept is None:
        module = _modules.get(build_key)
        if module is None:
            with open(build(src, defines), "rb") as f:
                image = f.read()
            module = ctypes.c_void_p()
            check(lib.cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData")
            _modules[build_key] = module
        fn = ctypes.c_void_p()
        check(lib.cuModuleGetFunction(ctypes.byref(fn), module, name), "cuModuleGetFunction")
    else:
        fn = kept[0]
    check(lib.cuFuncSetAttribute(fn, _MAX_DYNAMIC_SHARED, shared), "cuFuncSetAttribute")
    _functions[(*build_key, name)] = (fn, shared)
    return fn


def launch(fn: ctypes.c_void_p, grid: tuple[int, int, int], threads: int, shared: int, stream: int,
           args: list) -> None:
    """``cuLaunchKernel`` of ``fn`` on ``stream`` with ``args`` (ctypes values, in the kernel's order)."""
    params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in args])
    check(driver().cuLaunchKernel(fn, *grid, threads, 1, 1, shared, ctypes.c_void_p(stream), params, None),
          "cuLaunchKernel")
