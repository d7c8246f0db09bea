"""cco's ops in torch.library, so a model that calls them traces under ``torch.compile(fullgraph=True)``
(inductor included) and CUDA graph capture, as vLLM's and SGLang's custom collectives do.

Four ops; each is opaque to the compiler (it sees the fake kernel: output shape and dtype only) and
finds its Python object (a :class:`cco.op.GemmAllReduceOp`, a ``cco.nn`` layer) through an integer
handle, which the graph keeps as a constant::

    torch.ops.cco.gemm_all_reduce(a, b, a_scale, b_scale, handle) -> bf16 [M, N]
        the op's __call__: unfused equivalent all_reduce(reference_gemm(a, w, a_scale, b_scale))
    torch.ops.cco.row_parallel_linear(x, weight, weight_scale, bias, master_weight, handle, out_features)
        -> bf16 [..., out_features]: a ``cco.nn.RowParallelLinear`` forward (quantize x, the op, bias),
        differentiable (the backward is the layer's and needs no communication)
    torch.ops.cco.sp_row_parallel_linear(x, weight, weight_scale, bias, master_weight, handle, out_features,
                                         world) -> bf16 [x.shape[0] / world, ..., out_features]
        ``RowParallelLinear(sequence_parallel=True)``: reduce_scatter(x_r @ W_r.T, dim=0) + bias;
        its backward all-gathers grad_y
    torch.ops.cco.column_parallel_linear(x, weight, weight_scale, bias, master_weight, handle, out_features,
                                         rows_factor) -> bf16 [x.shape[0] * rows_factor, ..., out_features]
        ``ColumnParallelLinear``: all_gather(x_r, dim=0) @ W_r.T + bias (rows_factor = world), or the
        local x @ W_r.T + bias (rows_factor = 1); its backward reduce-scatters grad_x

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
    was built with ``weight_layout="row-major"``). ``op`` is a ``GemmAllReduceOp``: the op's fake
    kernel gives the all-reduce's ``[M, N]`` (the other patterns' outputs have other shapes; their
    traceable way in is the ``cco.nn`` layers)."""
    from cco.op import GemmAllReduceOp

    if not isinstance(op, GemmAllReduceOp):
        raise TypeError(f"cco.library.gemm_all_reduce: op must be a GemmAllReduceOp, got {type(op).__name__}; a "
                        f"reduce-scatter or all-gather op is traced through cco.nn.RowParallelLinear / "
                        f"ColumnParallelLinear(sequence_parallel=True), or called directly (eager)")
    return torch.ops.cco.gemm_all_reduce(a, b, a_scale, b_scale, op_handle(op))


# --------------------------------------------------------------------------------------------------
# torch.ops.cco.row_parallel_linear (cco.nn layers: ``_op_forward`` / ``_cco_backward``)
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("cco::row_parallel_linear", mutates_args=())
def _row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: Optional[torch.Tensor], master_weight: Optional[torch.Tensor], handle: int,
                         out_features: int) -> torch.Tensor:
    return lookup(handle)._op_forward(x, weight, weight_scale, bias)


def _lead(x: torch.Tensor) -> tuple:
    """``x``'s dimensions but the last: the fake kernels' output shape for any input, a bad one too
    (0-d: none). A traced layer call is checked when its op runs (``_op_forward``), not while traced:
    a fake kernel that raised would fail the trace on one rank while its peers call the op."""
    return tuple(x.shape[:-1])


def _rows(x: torch.Tensor) -> tuple:
    lead = _lead(x)
    return (lead[0] if lead else 0), lead[1:]


@_row_parallel_linear.register_fake
def _(x, weight, weight_scale, bias, master_weight, handle, out_features):
    return x.new_empty((*_lead(x), out_features), dtype=torch.bfloat16)


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


# --------------------------------------------------------------------------------------------------
# sequence parallelism: torch.ops.cco.sp_row_parallel_linear, torch.ops.cco.column_parallel_linear
# (cco.nn layers: ``_op_forward`` / ``_cco_backward``; the backward runs the dual collective)
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("cco::sp_row_parallel_linear", mutates_args=())
def _sp_row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            bias: Optional[torch.Tensor], master_weight: Optional[torch.Tensor], handle: int,
                            out_features: int, world: int) -> torch.Tensor:
    """``cco.nn.RowParallelLinear(sequence_parallel=True)``: this rank's ``[x.shape[0] / world, ...,
    out_features]`` rows of ``reduce_scatter(x_r @ W_r.T, dim=0) + bias``."""
    return lookup(handle)._op_forward(x, weight, weight_scale, bias)


@_sp_row_parallel_linear.register_fake
def _(x, weight, weight_scale, bias, master_weight, handle, out_features, world):
    rows, inner = _rows(x)
    return x.new_empty((rows // world, *inner, out_features), dtype=torch.bfloat16)


@torch.library.custom_op("cco::column_parallel_linear", mutates_args=())
def _column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            bias: Optional[torch.Tensor], master_weight: Optional[torch.Tensor], handle: int,
                            out_features: int, rows_factor: int) -> torch.Tensor:
    """``cco.nn.ColumnParallelLinear``: ``[x.shape[0] * rows_factor, ..., out_features]``, ``rows_factor``
    the world with sequence parallelism (the input rows are all-gathered), else 1."""
    return lookup(handle)._op_forward(x, weight, weight_scale, bias)


@_column_parallel_linear.register_fake
def _(x, weight, weight_scale, bias, master_weight, handle, out_features, rows_factor):
    if rows_factor == 1:  # the local GEMM: any leading shape, a 1-D x too
        return x.new_empty((*_lead(x), out_features), dtype=torch.bfloat16)
    rows, inner = _rows(x)
    return x.new_empty((rows * rows_factor, *inner, out_features), dtype=torch.bfloat16)


def _setup_sp_context(ctx, inputs, output):
    x, weight, weight_scale, bias, master_weight, handle = inputs[:6]
    ctx.save_for_backward(x, weight, weight_scale)
    ctx.handle = handle
    ctx.bias_dtype = None if bias is None else bias.dtype


@torch.library.custom_op("cco::layer_backward", mutates_args=())
def _layer_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    handle: int, input_grad: bool, weight_grad: bool,
                    bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sequence-parallel layer's ``_cco_backward`` as one opaque op: its collectives (on a process
    group) stay out of the compiled backward graph. Gradients not asked for come back empty."""
    grads = lookup(handle)._cco_backward(grad, x, weight, weight_scale, input_grad=input_grad,
                                         weight_grad=weight_grad, bias_grad=bias_grad)
    return tuple(x.new_empty(0) if g is None else g.contiguous() for g in grads)


@_layer_backward.register_fake
def _(grad, x, weight, weight_scale, handle, input_grad, weight_grad, bias_grad):
    layer = lookup(handle)
    return (x.new_empty(x.shape if input_grad else (0,)),
            x.new_empty((layer.out_features, layer.in_features_per_rank) if weight_grad else (0,),
                        dtype=torch.bfloat16),
            x.new_empty((layer.out_features,) if bias_grad else (0,), dtype=torch.float32))


def _sp_backward(ctx, grad):
    """The layer's ``_cco_backward`` (collective where the layer is sequence parallel: every rank
    runs the same backward graph, so its collectives run in the same order everywhere)."""
    x, weight, weight_scale = ctx.saved_tensors
    needs = ctx.needs_input_grad
    grad_x, grad_master, grad_bias = torch.ops.cco.layer_backward(grad, x, weight, weight_scale, ctx.handle,
                                                                  needs[0], needs[4], needs[3])
    grad_x = grad_x if needs[0] else None
    grad_master = grad_master if needs[4] else None
    grad_bias = grad_bias.to(ctx.bias_dtype) if needs[3] else None
    return grad_x, None, None, grad_bias, grad_master, None, None, None


torch.library.register_autograd("cco::sp_row_parallel_linear", _sp_backward, setup_context=_setup_sp_context)
torch.library.register_autograd("cco::column_parallel_linear", _sp_backward, setup_context=_setup_sp_context)
