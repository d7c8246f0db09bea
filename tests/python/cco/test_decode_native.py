"""The decode GEMM's C++ call path (``kernels_fused.hopper.native``) on the host: what can be shown
without a GPU. On the GPU ``test_cuda_nn.py::check_decode_native`` holds every call it takes to the
Python path's bytes (and each plan is checked there against the driver's own count and sizes of the
kernel's parameters).

Here: a plan replays the Python path's call (every pointer argument is the role of the tensor the
call passed, at its byte offset; every integer and float is the call's value, in the bits and width
the kernel's signature says; constexprs left out; Triton's two scratch pointers last), for each of
the decode GEMM's launch paths; the description refuses what the table cannot replay; and the
extension builds with torch's CPU headers alone and refuses a plan where there is no driver.
"""

from __future__ import annotations

import inspect
import struct
from types import SimpleNamespace

import pytest
import torch

from cco import quant as Q

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kernels_fused.hopper import decode as D  # noqa: E402
from kernels_fused.hopper import launch as L  # noqa: E402
from kernels_fused.hopper import native as NV  # noqa: E402
from kernels_fused.hopper.quantize import quantize_activation  # noqa: E402
from tests.python.cco.test_activation_quant import activations  # noqa: E402
from tests.python.cco.test_decode_gemm import weight  # noqa: E402

INTERPRETED = isinstance(triton.language.standard.zeros, InterpretedFunction)


def fake_compiled(kernel, args, **meta):
    """What Triton's compiled kernel tells the plan, for ``kernel``'s JIT function called with
    ``args``: the signature (constexprs as "constexpr", tensors as pointers, ints i32, floats fp32)
    and the launch metadata."""
    params = inspect.signature(kernel.fn.fn).parameters.values()  # the kernel's Python function
    signature = {}
    for p, a in zip(params, args):
        if p.annotation in (triton.language.constexpr, "tl.constexpr"):
            signature[p.name] = "constexpr"
        elif isinstance(a, torch.Tensor):
            signature[p.name] = "*fp8e4nv"
        elif isinstance(a, float):
            signature[p.name] = "fp32"
        else:
            signature[p.name] = "i32"
    metadata = dict(global_scratch_size=0, profile_scratch_size=0, num_ctas=1, launch_pdl=False,
                    num_warps=kernel.options.get("num_warps", 4), shared=1024,
                    launch_cooperative_grid=kernel.options.get("launch_cooperative_grid", False))
    metadata.update(meta)
    return SimpleNamespace(function=0x1234, src=SimpleNamespace(signature=signature),
                           metadata=SimpleNamespace(**metadata))


def recorded_calls(monkeypatch):
    """Each kernel launch of the decode path as ``(kernel, args)``, still launched."""
    calls = []
    real = L.Kernel.__call__

    def record(self, device, *args):
        calls.append((self, args))
        return real(self, device, *args)

    monkeypatch.setattr(L.Kernel, "__call__", record)
    return calls


def roles_of(args, *, x, w, w_scale, bias, out, scratch_role):
    """The (kind, value, offset) the table must pass for each argument of a Python-path launch."""
    want = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if a is x:
                want.append((NV.POINTER, NV.X, 0))
            elif a.data_ptr() == w.data_ptr():
                want.append((NV.POINTER, NV.W, 0))
            elif a.data_ptr() == w_scale.data_ptr():
                want.append((NV.POINTER, NV.SCALE, 0))
            elif a is out:  # without a bias the call passes out twice: first as the unused bias pointer
                first = (NV.POINTER, NV.BIAS_OR_OUT, 0) not in want
                want.append((NV.POINTER, NV.BIAS_OR_OUT if bias is None and first else NV.OUT, 0))
            elif bias is not None and a is bias:
                want.append((NV.POINTER, NV.BIAS_OR_OUT, 0))
            else:  # the call's own allocations: its scratch (rows, scales) or the wait's counter
                want.append(scratch_role(a))
        elif isinstance(a, float):
            want.append((NV.BITS32, struct.unpack("<I", struct.pack("<f", a))[0], 0))
        else:
            want.append((NV.BITS32, a & 0xFFFFFFFF, 0))
    return want


@pytest.mark.skipif(not INTERPRETED, reason="the decode path runs under Triton's interpreter here only without a GPU")
@pytest.mark.parametrize("quant, m, one", [("ptpc", 1, False), ("ptpc", 1, True), ("ptpc", 5, True),
                                           ("ptpc", 5, False), ("ptpc", 33, True), ("blockscale", 1, True),
                                           ("blockscale", 3, False), ("mxfp8", 1, False)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_plan_replays_the_python_call(monkeypatch, quant, m, one, with_bias):
    """Per launch path, the plan's parameters are the Python path's arguments as the table passes
    them: each tensor by its role (the scratch's rows at 0, their scales after ``M * K_PAD``, the
    split's counters and partials after them: ``decode.MmaScratch``), each number in its signature's
    bits, constexprs left out, two null scratch pointers last."""
    n, k = 64, 300  # one program of ptpc's MMA: the interpreter runs programs in turn, so one waits for no other
    k_padded = 384
    x = activations(m, k, seed=7)
    wq, ws = weight(n, k, k_padded, quant)
    bias = torch.randn(n).to(torch.bfloat16) if with_bias else None
    monkeypatch.setattr(D, "ONE_LAUNCH", one)
    monkeypatch.setattr(D, "CAPTURED_ROW_MIN_BYTES", 0)  # one row's captured path, at this small weight too
    D._LAUNCHES.clear()
    calls = recorded_calls(monkeypatch)
    out = D.decode_gemm(x, wq, ws, quant, n=n, bias=bias)
    (launch,) = D._LAUNCHES.values()
    # the eager path: ptpc's one launch (the interpreter's one program is resident), one row's kernel
    assert (launch.one is not None) == (quant == "ptpc" and m > 1 or quant in D.QUANTIZED_ROWS and m == 1)
    for kernel, args in calls:
        kernel.compiled = fake_compiled(kernel, args)
    def scratch_role(t):  # a view of the call's one scratch, at its offset there; or the wait's counter
        if any(t is sync for sync in D._SYNC.values()):
            return (NV.POINTER, NV.SYNC, 0)
        return (NV.POINTER, NV.SCRATCH, t.data_ptr() - t.untyped_storage().data_ptr())

    planned_one, planned_two, scratch_one, scratch_two = launch.plan(x.stride(0), ws.stride(0))
    planned = planned_one if one and launch.one is not None else planned_two
    assert len(planned) == len(calls) and planned
    for (kernel, args), described in zip(calls, planned):
        function, grid, threads, shared, cooperative, params = described
        keep = [a for a, p in zip(args, kernel.compiled.src.signature.values()) if p != "constexpr"]
        assert params[:-2] == roles_of(keep, x=x, w=wq, w_scale=ws, bias=bias, out=out, scratch_role=scratch_role)
        assert params[-2:] == [(NV.POINTER, NV.NULL, 0)] * 2
        assert grid == (*kernel.grid, 1, 1)[:3] and threads == 32 * kernel.options["num_warps"]
        assert (function, shared) == (0x1234, 1024) and cooperative == kernel.options.get("launch_cooperative_grid",
                                                                                          False)
    if one and launch.one is not None:
        assert scratch_one == (m * (k_padded + 4) if m > 1 else 0)  # (one row's kernel needs none)
        assert planned_two == []  # the two launches have not run yet
    elif launch.quantize is not None:
        assert scratch_two == launch.layout.bytes >= m * (k_padded + 4)
    else:
        assert scratch_two == 0
    D._LAUNCHES.clear()


@pytest.mark.skipif(not INTERPRETED, reason="the decode path runs under Triton's interpreter here only without a GPU")
def test_vendor_plan_is_the_quantizers_launch(monkeypatch):
    """blockscale's rows through cuBLAS (``decode.VENDOR_ROWS``): the Python path quantizes into rows
    padded to cuBLAS's multiple and M-major scales, then calls ``vendor_gemm`` on them; the plan is
    that quantizer launch alone (x by its role, the rows into the table's scratch, the scales into
    its A_SCALE, the call's M and padded rows in their bits), the cuBLAS call following it in C++.
    (The interpreter has no cuBLAS: the path is forced here and ``vendor_gemm`` recorded.)"""
    n, k, k_padded, m, padded = 64, 300, 512, 5, 8
    monkeypatch.setattr(D, "vendor_rows", lambda quant, rows, kp, device, dense=False: padded)
    gemms = []
    monkeypatch.setattr(D, "vendor_gemm", lambda q, sa, w, ws, bias, out, rows, cols: gemms.append((q, sa, rows, cols)))
    x = activations(m, k, seed=9)
    wq, ws = weight(n, k, k_padded, "blockscale")
    D._LAUNCHES.clear()
    calls = recorded_calls(monkeypatch)
    D.decode_gemm(x, wq, ws, "blockscale", n=n)
    (launch,) = D._LAUNCHES.values()
    ((kernel, args),), ((q, sa, rows, cols),) = calls, gemms
    assert launch.vendor == padded and launch.kernel is None and kernel is launch.quantize
    assert (q.shape, sa.shape, sa.stride(), rows, cols) == ((padded, k_padded), (padded, k_padded // 128), (1, padded),
                                                          m, n)
    want_q, want_sa = quantize_activation(x, "blockscale", k_padded=k_padded, m_padded=padded)  # the layer's bytes
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(sa, want_sa)
    kernel.compiled = fake_compiled(kernel, args)
    one, two, scratch_one, scratch_two = launch.plan(x.stride(0), ws.stride(0))
    assert one == [] and (scratch_one, scratch_two) == (0, 0) and len(two) == 1
    keep = [a for a, p in zip(args, kernel.compiled.src.signature.values()) if p != "constexpr"]

    def scratch_role(t):
        return (NV.POINTER, NV.SCRATCH if t.data_ptr() == q.data_ptr() else NV.A_SCALE, 0)

    params = two[0][5]
    assert params[:-2] == roles_of(keep, x=x, w=wq, w_scale=ws, bias=None, out=None, scratch_role=scratch_role)
    assert (NV.BITS32, m, 0) in params and (NV.BITS32, padded, 0) in params
    D._LAUNCHES.clear()


@pytest.mark.skipif(not INTERPRETED, reason="the decode path runs under Triton's interpreter here only without a GPU")
def test_dense_vendor_plan_is_the_dequantizing_quantizer(monkeypatch):
    """mxfp8's rows over the weight's bf16 copy (``decode.VENDOR_ROWS``): the Python path's one
    launch quantizes the rows and writes them dequantized to bf16 (the bytes of the activation
    quantizer, then ``vendor.mx_to_bf16``), then calls ``dense_gemm``; the plan is that launch (x by
    its role, the bf16 rows into the table's ROWS, no scales), the GEMM following in C++."""
    n, k, k_padded, m = 64, 300, 384, 5
    gemms = []
    real = D.dense_gemm
    monkeypatch.setattr(D, "dense_gemm", lambda a, w, bias, out, rows, cols: (gemms.append((a, w, rows, cols)),
                                                                             real(a, w, bias, out, rows, cols)))
    x = activations(m, k, seed=9)
    wq, ws = weight(n, k, k_padded, "mxfp8")
    dense = D.vendor.mx_to_bf16(wq, ws)
    D._LAUNCHES.clear()
    calls = recorded_calls(monkeypatch)
    D.decode_gemm(x, dense, ws, "mxfp8", n=n)
    (launch,) = D._LAUNCHES.values()
    ((quantize, q_args),) = calls
    ((a, w, rows, cols),) = gemms
    assert launch.vendor == m and quantize is launch.quantize and launch.kernel is None
    assert (a.shape, a.dtype, w.data_ptr(), rows, cols) == ((m, k_padded), torch.bfloat16, dense.data_ptr(), m, n)
    assert q_args[1] is a and q_args[2] is a  # the rows, and no scales (the kernel stores none)
    want_q, want_s = quantize_activation(x, "mxfp8", k_padded=k_padded)  # the layer's bytes, as bf16 rows
    assert torch.equal(a.view(torch.int16), D.vendor.mx_to_bf16(want_q, want_s).view(torch.int16))
    for kernel, args in calls:
        kernel.compiled = fake_compiled(kernel, args)
    one, two, scratch_one, scratch_two = launch.plan(x.stride(0), ws.stride(0))
    assert one == [] and (scratch_one, scratch_two) == (0, 0) and len(two) == 1
    (kernel, args), (planned,) = calls[0], two
    keep = [v for v, p in zip(args, kernel.compiled.src.signature.values()) if p != "constexpr"]
    assert planned[5][:-2] == roles_of(keep, x=x, w=dense, w_scale=ws, bias=None, out=None,
                                       scratch_role=lambda t: (NV.POINTER, NV.ROWS, 0))
    assert sum(p == (NV.POINTER, NV.ROWS, 0) for p in planned[5]) == 2
    D._LAUNCHES.clear()


def test_describe_refuses_what_the_table_cannot_replay():
    """A kernel that has not launched, one that needs Triton's scratch, a signature that does not
    match the arguments, an argument type the table has no width for: ValueError (the call shape
    stays on the Python path); a plain one is described with i64 and fp32 in their bits."""
    kernel = L.Kernel(None, (3,), num_warps=8)
    with pytest.raises(ValueError, match="not launched"):
        NV.describe(kernel, ())
    meta = dict(global_scratch_size=0, profile_scratch_size=0, num_ctas=1, launch_pdl=False, num_warps=8, shared=0,
                launch_cooperative_grid=True)
    sig = {"p": "*bf16", "n": "i64", "f": "fp32", "C": "constexpr"}
    kernel.compiled = SimpleNamespace(function=7, src=SimpleNamespace(signature=sig), metadata=SimpleNamespace(**meta))
    assert NV.describe(kernel, (NV.Pointer(NV.OUT, 16), 2**40, 1.5, 64)) == (
        7, (3, 1, 1), 256, 0, True,
        [(NV.POINTER, NV.OUT, 16), (NV.BITS64, 2**40, 0), (NV.BITS32, 0x3FC00000, 0), (NV.POINTER, NV.NULL, 0),
         (NV.POINTER, NV.NULL, 0)])
    with pytest.raises(ValueError, match="arguments"):
        NV.describe(kernel, (NV.Pointer(NV.OUT),))
    kernel.compiled.src.signature = {"p": "*bf16", "n": "fp16", "f": "fp32", "C": "constexpr"}
    with pytest.raises(ValueError, match="fp16"):
        NV.describe(kernel, (NV.Pointer(NV.OUT), 2, 1.5, 64))
    kernel.compiled.src.signature = sig
    kernel.compiled.metadata.global_scratch_size = 128
    with pytest.raises(ValueError, match="scratch"):
        NV.describe(kernel, (NV.Pointer(NV.OUT), 2, 1.5, 64))


@pytest.fixture(scope="module")
def extension():
    """The extension, built as a job's first CUDA decode call builds it (a separate process)."""
    if not NV.ENABLED:
        pytest.fail("CCO_DECODE_NATIVE=0 is set: this module tests the C++ call path")
    assert NV.start(wait=900), f"the C++ call path did not build: {NV.error()}"
    return NV.TABLE


def test_extension_builds_and_takes_no_host_call(extension):
    """The extension builds with torch's headers alone (no CUDA toolkit); its table takes no call
    whose x is not on a GPU (None: the Python path runs) and counts none."""
    x, wq, ws = activations(2, 256, seed=1), *weight(16, 256, 256, "ptpc")
    assert extension.run(x, wq, ws, None, 16, 0, True, True, 0) is None
    assert extension.taken() == 0 and extension.size() == 0


def test_extension_refuses_host_calls_and_unchecked_plans(extension):
    """A plan for a call whose x is not on a GPU is refused (ValueError, nothing kept); without
    libcuda (this machine: no GPU) no plan can be checked against its kernel's parameters, so the
    check raises and says why."""
    module = NV.build()
    launch = (0x1234, (1, 1, 1), 128, 0, False, [(NV.POINTER, NV.X, 0), (NV.POINTER, NV.NULL, 0)])
    x, wq, ws = activations(2, 256, seed=1), *weight(16, 256, 256, "ptpc")
    with pytest.raises(ValueError, match="cannot be planned"):
        extension.add(x, wq, ws, None, 16, 0, [launch], [], 0, 0, 0, 0, None)
    assert extension.size() == 0
    if module.driver_missing():  # (where there is a driver, the GPU suite checks every plan against it)
        with pytest.raises(RuntimeError, match="libcuda"):
            module.Table.param_sizes(0x1234)
    # cuBLASLt and cuBLAS are opened as the driver is; where one is missing a vendor plan keeps torch's
    # call (at::_scaled_mm, at::mm; the GPU suite's check_decode_vendor requires its kept call to run there)
    assert module.cublaslt_missing() in ("", "libcublasLt cannot be loaded")
    assert module.cublas_missing() in ("", "libcublas cannot be loaded", "libtorch_cuda.so is not loaded")
    assert extension.kept_taken() == 0 and extension.kept_error() == ""
