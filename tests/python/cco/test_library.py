"""cco's ops in torch.library: registration, fake kernels, handles, and torch.compile(fullgraph=True).

Guards: a function that calls the op and cannot be compiled whole (calling ``GemmAllReduceOp``
directly under ``fullgraph=True`` stops at ``time.monotonic`` inside ``__call__``), a fake kernel
whose shape or dtype differs from the real output (the compiler would plan the wrong buffers), a
handle that outlives its object and reaches another.
"""

from __future__ import annotations

import gc

import pytest
import torch

from cco import library
from cco import quant as Q
from cco.comm import check_outcomes, spawn
from cco.preshuffle import preshuffle_b


def test_ops_are_registered_with_their_schemas():
    assert "cco::gemm_all_reduce(Tensor a, Tensor b, Tensor a_scale, Tensor b_scale, SymInt handle) -> Tensor" in \
        str(torch.ops.cco.gemm_all_reduce.default._schema)
    schema = str(torch.ops.cco.row_parallel_linear.default._schema)
    assert "Tensor? bias" in schema and "Tensor? master_weight" in schema and "SymInt out_features" in schema


def test_fake_kernels_give_the_real_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(37, 256, dtype=Q.FP8)
        b = torch.empty(384, 256, dtype=Q.FP8)
        out = torch.ops.cco.gemm_all_reduce(a, b, torch.empty(37), torch.empty(384), 0)
        assert out.shape == (37, 384) and out.dtype == torch.bfloat16
        x = torch.empty(3, 5, 200, dtype=torch.float32)
        y = torch.ops.cco.row_parallel_linear(x, b, torch.empty(384), None, None, 0, 250)
        assert y.shape == (3, 5, 250) and y.dtype == torch.bfloat16 and y.is_contiguous()


def test_a_handle_dies_with_its_object():
    class Thing:
        pass

    thing = Thing()
    handle = library.register(thing)
    assert library.lookup(handle) is thing
    del thing
    gc.collect()
    with pytest.raises(RuntimeError, match=f"handle {handle} names no live op"):
        library.lookup(handle)
    other = Thing()
    again = library.register(other)
    assert again != handle  # never reused: a stale handle cannot reach a new object
    library.unregister(again)
    with pytest.raises(RuntimeError, match="names no live op"):
        library.lookup(again)


# --------------------------------------------------------------------------------------------------
def _compiled(comm, quant, m, n, k):
    from cco.op import GemmAllReduceOp

    p = Q.random_problem(m, n, k, quant, seed=comm.rank)
    b = preshuffle_b(p.b)
    with GemmAllReduceOp(comm, n=n, k=k, m_max=m) if quant == "ptpc" else \
            GemmAllReduceOp(comm, n=n, k=k, m_max=m, quant=quant) as op:
        direct = op(p.a, b, p.a_scale, p.b_scale)

        def step(a, a_scale):  # other torch work around the op, as in a model
            y = library.gemm_all_reduce(op, a, b, a_scale, p.b_scale)
            return torch.nn.functional.silu(y.float()).to(torch.bfloat16)

        compiled = torch.compile(step, fullgraph=True, backend="inductor")
        got = compiled(p.a, p.a_scale)
        half = compiled(p.a[: m // 2].contiguous(), p.a_scale[: m // 2].contiguous())  # another M
        calls = op.calls
    return direct, got, half, calls


@pytest.mark.multirank
def test_op_compiles_fullgraph_under_inductor_and_matches_the_eager_call():
    """Two CPU ranks: a function calling the op through ``torch.ops.cco.gemm_all_reduce`` compiles
    as one graph under inductor; its result is the eager op's, for two M, and each compiled call is
    one collective call of the op."""
    outs = check_outcomes(spawn(_compiled, world=2, args=("ptpc", 96, 256, 256), timeout_s=300))
    for direct, got, half, calls in outs:
        expect = torch.nn.functional.silu(direct.float()).to(torch.bfloat16)
        assert torch.equal(got, expect)
        assert torch.equal(half, expect[:48])
        assert calls == 3
    assert torch.equal(outs[0][1], outs[1][1])


def _opcheck(comm):
    from cco.nn import RowParallelLinear

    layer = RowParallelLinear(200, 250, group=comm, quant="blockscale", bias=True, m_max=8, trainable=True)
    layer.load_weight(torch.randn(250, 200, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(3, 5, 200, dtype=torch.bfloat16, requires_grad=True)
    weight, scale = layer.quantized_weight()
    # test_schema is left out: it probes inputs for mutation with arithmetic that fp8 tensors lack
    return torch.library.opcheck(
        torch.ops.cco.row_parallel_linear.default, (x, weight, scale, layer.bias, layer.weight, layer._handle, 250),
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.multirank
def test_layer_op_passes_torch_library_opcheck():
    """torch's own checks of a custom op: the fake kernel against the real one (shapes, strides,
    dtypes; padded N and K, M over two calls), the autograd registration, and AOT dispatch with
    dynamic shapes (what torch.compile runs, backward included)."""
    (result,) = check_outcomes(spawn(_opcheck, world=1, timeout_s=300))
    assert result == {name: "SUCCESS" for name in result} and len(result) == 3
