"""cco's ops in torch.library, so a model that calls them traces under ``torch.compile(fullgraph=True)``
(inductor included) and CUDA graph capture, as vLLM's and SGLang's custom collectives do.

Two ops; each is opaque to the compiler (it sees the fake kernel: output shape and dtype only) and
finds its Python object (a :class:`cco.op.GemmAllReduceOp`, a ``cco.nn`` layer) through an integer
handle, which the graph keeps as a constant::

    torch.ops.cco.gemm_all_reduce(a, b, a_scale, b_scale, handle) -> bf16 [M, N]
        the op's __call__: unfused equivalent all_reduce(reference_gemm(a, w, a_scale, b_scale))
    torch.ops.cco.row_parallel_linear(x, weight, weight_scale, bias, master_weight, handle, out_features)
        -> bf16 [..., out_features]: a ``cco.nn.RowParallelLinear`` forward (quantize x, the op, bias),
        differentiable (the backward is the layer's and needs no communication)

Use :func:`gemm_all_reduce` for the first (it registers the op on first use); layers call the
second themselves. Contracts of the compiled form:
- Collective order: every rank runs the same compiled graph, so the ops run in the same order on
  every rank (the compiler may move an op only past work it does not depend on, the same way on
  every rank). Nothing in an op returns to Python between calls, so ``time.monotonic`` and the op's
  call counter stay out of the traced code.
- Outputs are fresh tensors (never a view of an input or of the window).
- A handle lives as long as its object: a deleted object's handle raises ``RuntimeError`` naming
  the handle, never reaches another object.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch

_handles: dict[int, weakref.ref] = {}
_counter = itertools.count(1)
_op_handles: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def register(obj) -> int:
    """A new handle for ``obj`` (held weakly: the caller keeps ``obj`` alive)."""
    handle = next(_counter)
    _handles[handle] = weakref.ref(obj)
    return handle


def unregister(handle: int) -> None:
    _handles.pop(handle, None)


def lookup(handle: int):
    """The object behind ``handle``; RuntimeError when it was unregistered or deleted."""
    ref = _handles.get(handle)
    obj = ref() if ref is not None else None
    if obj is None:
        raise RuntimeError(f"cco.library: handle {handle} names no live op or layer (closed or deleted); "
                           f"rebuild it, and recompile a function that captured the old one")
    return obj


@torch.compiler.assume_constant_result
def op_handle(op) -> int:
    """The handle of a :class:`cco.op.GemmAllReduceOp`, registered on first use. Under torch.compile
    it runs for real while the function is traced and its result enters the graph as a constant
    (traced, its registration would be replayed as a side effect and the weak reference lost)."""
    handle = _op_handles.get(op)
    if handle is None:
        handle = _op_handles[op] = register(op)
    return handle


# --------------------------------------------------------------------------------------------------
# torch.ops.cco.gemm_all_reduce
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("cco::gemm_all_reduce", mutates_args=())
def _gemm_all_reduce(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                     handle: int) -> torch.Tensor:
    return lookup(handle)(a, b, a_scale, b_scale)


@_gemm_all_reduce.register_fake
def _(a, b, a_scale, b_scale, handle):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.bfloat16)


def gemm_all_reduce(op, a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """``op(a, b, a_scale, b_scale)`` through ``torch.ops.cco.gemm_all_reduce``: the same result, and
    traceable by ``torch.compile``. ``b`` is in ``op``'s weight layout (``bpreshuffle`` unless the op
    was built with ``weight_layout="row-major"``)."""
    return torch.ops.cco.gemm_all_reduce(a, b, a_scale, b_scale, op_handle(op))


# --------------------------------------------------------------------------------------------------
# torch.ops.cco.row_parallel_linear (cco.nn layers: ``_cco_forward`` / ``_cco_backward``)
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("cco::row_parallel_linear", mutates_args=())
def _row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: Optional[torch.Tensor], master_weight: Optional[torch.Tensor], handle: int,
                         out_features: int) -> torch.Tensor:
    return lookup(handle)._cco_forward(x, weight, weight_scale, bias)


@_row_parallel_linear.register_fake
def _(x, weight, weight_scale, bias, master_weight, handle, out_features):
    return x.new_empty((*x.shape[:-1], out_features), dtype=torch.bfloat16)


def _setup_context(ctx, inputs, output):
    x, weight, weight_scale, bias, master_weight, handle, out_features = inputs
    ctx.save_for_backward(x, weight, weight_scale)
    ctx.handle = handle
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, grad):
    x, weight, weight_scale = ctx.saved_tensors
    needs = ctx.needs_input_grad
    grad_x, grad_master, grad_bias = lookup(ctx.handle)._cco_backward(
        grad, x, weight, weight_scale, input_grad=needs[0], weight_grad=needs[4], bias_grad=needs[3])
    if grad_bias is not None:
        grad_bias = grad_bias.to(ctx.bias_dtype)
    return grad_x, None, None, grad_bias, grad_master, None, None


torch.library.register_autograd("cco::row_parallel_linear", _backward, setup_context=_setup_context)
