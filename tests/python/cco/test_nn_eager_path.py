"""The layer's eager call path: an inference call that nothing traces runs the layer's body
directly; everything else goes through ``torch.ops.cco.row_parallel_linear``.

Guards: a fast path that changes the result (it must be the op's, bit for bit), that hides the op
from a tracer (a dispatch mode such as make_fx's or FakeTensorMode, torch.compile) or that drops the
gradient of a call autograd records; the zero rows the layer pads a blockscale call with leaking
into the output.
"""

from __future__ import annotations

import pytest
import torch

from cco import library
from cco.comm import check_outcomes, spawn

pytestmark = pytest.mark.multirank


def _paths(comm, column=False):
    from torch.utils._python_dispatch import TorchDispatchMode

    from cco.nn import ColumnParallelLinear, RowParallelLinear

    g = torch.Generator().manual_seed(0)
    layer = (ColumnParallelLinear if column else RowParallelLinear)(200, 96, group=comm, quant="ptpc", bias=True,
                                                                     m_max=8)
    op_name = "column_parallel_linear" if column else "row_parallel_linear"
    layer.load_weight(torch.randn(96, 200, generator=g))
    with torch.no_grad():
        layer.bias.copy_(torch.randn(96, generator=g))
    x = torch.randn(3, 200, generator=g).to(torch.bfloat16)
    entered = []
    real_lookup = library.lookup

    def counting_lookup(handle):  # the registered op finds the layer through its handle
        entered.append(handle)
        return real_lookup(handle)

    library.lookup = counting_lookup
    try:
        with torch.no_grad():
            fast = layer(x)
        fast_entries = len(entered)
        extra = (1,) if column else ()  # the column op's rows factor (1: no sequence parallelism)
        op = getattr(torch.ops.cco, op_name)(x, layer.qweight, layer.weight_scale, layer.bias, None, layer._handle, 96,
                                             *extra)
        op_entries = len(entered) - fast_entries

        seen = []

        class Recorder(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen.append(str(func))
                return func(*args, **(kwargs or {}))

        with torch.no_grad(), Recorder():
            recorded = layer(x)
        xg = x.clone().requires_grad_(True)
        before = len(entered)
        y = layer(xg)  # grad mode, an input that needs a gradient: the op and its autograd
        y.float().sum().backward()
        grad_entries = len(entered) - before
    finally:
        library.lookup = real_lookup
    return {"same": torch.equal(fast, op) and torch.equal(recorded, op), "fast_entries": fast_entries,
            "op_entries": op_entries, "recorded_op": any(f"cco.{op_name}" in s for s in seen),
            "grad_entries": grad_entries, "grad_finite": bool(xg.grad is not None and torch.isfinite(xg.grad).all()),
            "y_same": torch.equal(y.detach(), op), "decode": _decode_refused_off_gpu(layer, x)}


def _decode_refused_off_gpu(layer, x) -> str:
    """The decode GEMM is not offered on the CPU (decode_rows 0); a caller who sets decode_rows
    anyway gets a RuntimeError, not a wrong path."""
    if layer.decode_rows != 0 or layer._decode_gemm is not None:
        return f"offered on the CPU: decode_rows={layer.decode_rows}"
    layer.decode_rows = 4
    try:
        with torch.no_grad():
            layer(x)
    except RuntimeError as err:
        return "refused" if "decode GEMM runs only" in str(err) else f"another error: {err}"
    finally:
        layer.decode_rows = 0
    return "ran"


@pytest.mark.parametrize("column", [False, True], ids=["RowParallelLinear", "ColumnParallelLinear"])
def test_an_untraced_inference_call_skips_the_dispatcher_and_gives_the_ops_result(column):
    """No grad, nothing tracing: the body runs without the registered op (no handle lookup) and
    its output is the op's bit for bit; under a dispatch mode the op is what the mode sees; a call
    autograd records goes through the op (the body is entered once for the forward and once for the
    backward) and gets its gradient."""
    (r,) = check_outcomes(spawn(_paths, world=1, args=(column,), timeout_s=120))
    assert r["same"] and r["y_same"]
    assert r["decode"] == "refused"
    assert r["fast_entries"] == 0, "the untraced inference call went through the registered op"
    assert r["op_entries"] == 1
    assert r["recorded_op"], "a dispatch mode did not see torch.ops.cco.row_parallel_linear"
    assert r["grad_entries"] == 2 and r["grad_finite"]


def _padded_rows(comm):
    from cco.nn import RowParallelLinear

    g = torch.Generator().manual_seed(1)
    layer = RowParallelLinear(256, 128, group=comm, quant="blockscale", m_max=8)
    layer.load_weight(torch.randn(128, 256, generator=g))
    layer._row_multiple = 4  # what the layer sets on CUDA for cuBLAS's blockwise GEMM
    outs = {}
    with torch.no_grad():
        for m in (1, 3, 5, 7, 8):
            x = torch.randn(m, 256, generator=g).to(torch.bfloat16)
            padded = layer(x)
            layer._row_multiple = 1
            plain = layer(x)
            layer._row_multiple = 4
            outs[m] = (tuple(padded.shape), torch.equal(padded, plain))
    return outs


def test_blockscale_rows_padded_to_the_vendor_multiple_give_the_same_output():
    """A call padded with zero rows (to 4, or not at all past m_max) returns M rows, equal to the
    unpadded call's."""
    (outs,) = check_outcomes(spawn(_padded_rows, world=1, timeout_s=120))
    assert outs == {m: ((m, 128), True) for m in (1, 3, 5, 7, 8)}
