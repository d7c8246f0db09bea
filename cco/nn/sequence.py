"""Sequence parallelism along tokens for the layers (Megatron's convention): between the tensor-
parallel regions rank ``r`` of ``W`` keeps rows ``r*M/W .. (r+1)*M/W`` of the flattened activations;
the first dimension of a layer's input and output is the token dimension that is split.

The three patterns of a tensor-parallel block and what runs each, fused and unfused::

    layer                                    forward (fused op)            backward (dual)
    RowParallelLinear                        GEMM + all-reduce             none (grad_y replicated)
    RowParallelLinear(sequence_parallel)     GEMM + reduce-scatter (dim 0) all-gather of grad_y
    ColumnParallelLinear(sequence_parallel)  all-gather + GEMM             reduce-scatter of grad_x
    ColumnParallelLinear                     local GEMM                    none

The backward's collectives run unfused on the group, in bf16 (``cco.nn.collectives``): its
gradients keep bf16's range and precision (the fused ops take e4m3 operands, whose per-row scaling
would add fp8's few-percent error to every gradient), and the dual op of each layer would need its
own window. Every rank runs the same backward, so they run in the same order on every rank.

This module holds the row-parallel layer's sequence-parallel path (``cco.nn.linear`` calls it) and
what both layers share.
"""

from __future__ import annotations

import torch

from cco import quant as Q
from cco.nn.collectives import all_gather_rows, reduce_scatter_rows


def reduce_scatter_options(op_options: dict) -> tuple[type, dict, dict]:
    """(op class, its keywords, ``cco.shapes.layer_shape``'s keywords) of a row-parallel layer's
    reduce-scatter along tokens, from the all-reduce op's keywords."""
    from cco.reduce_scatter import GemmReduceScatterOp

    options = {k: v for k, v in op_options.items() if k != "gather_dtype"}  # nothing is gathered
    return GemmReduceScatterOp, {**options, "scatter_dim": 0}, {**options, "pattern": "reduce-scatter-rows"}


def check_token_rows(layer, x: torch.Tensor, fn: str, *, gathers: bool = False) -> None:
    """A sequence-parallel call's rows: the first dimension a multiple of the world (the
    reduce-scatter's input; ``gathers``: the all-gather's input is one rank's share, any count), at
    most ``m_max`` rows per call, gathered (a call in pieces would hand each rank rows of every
    piece, not its block). A rank whose input fails tells its peers (``op.reject``) before raising."""
    world, rows = layer.comm.world, x.shape[0] if x.dim() > 1 else 0
    total = x.numel() // max(x.shape[-1], 1) * (world if gathers else 1)
    err = None
    if x.dim() < 2:
        err = ValueError(f"{fn}: x must be [tokens, ..., features] with sequence_parallel=True, got {list(x.shape)}")
    elif rows % world and not gathers:
        err = ValueError(f"{fn}: x has {rows} tokens in its first dimension, not a multiple of the world "
                         f"({world}); every rank keeps tokens/world of them: pad the sequence to "
                         f"{-(-rows // world) * world}")
    elif total > layer.m_max:
        err = ValueError(f"{fn}: a call of {total} rows{' (gathered)' if gathers else ''} but the layer was built "
                         f"with m_max={layer.m_max}; a sequence-parallel call is not split, build the layer with "
                         f"m_max >= {total}")
    if err is not None:
        if layer.op is not None:
            layer.op.reject(err)
        raise err


def row_parallel_forward(layer, x, qweight, scale) -> torch.Tensor:
    """``RowParallelLinear.forward`` with ``sequence_parallel=True``."""
    check_token_rows(layer, x, "RowParallelLinear")
    return torch.ops.cco.sp_row_parallel_linear(x, qweight, scale, layer.bias, layer.weight, layer._handle,
                                                layer.out_features, layer.comm.world)


def row_parallel_body(layer, x, qweight, scale, bias, quantize) -> torch.Tensor:
    """``reduce_scatter(x_r @ W_r.T, dim=0) + bias``: bf16 ``[x.shape[0] / W, ..., out_features]``;
    ``quantize``: the layer's activation quantizer (``cco.nn.linear.quantize_activation``)."""
    world, n = layer.comm.world, layer.out_features
    x2 = x.reshape(-1, layer.in_features_per_rank)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    a, a_scale = quantize(x2, layer.quant, k_padded=layer.k_padded)
    if layer.op is not None:
        out = layer.op(a, qweight, a_scale, scale)
    else:
        partial = Q.reference_gemm(a, layer._row_major(qweight), a_scale, scale, layer.quant).float()
        out = reduce_scatter_rows(partial, layer._reduce_group, world).to(torch.bfloat16)
    out = out if layer.n_padded == n else out[:, :n].contiguous()
    if bias is not None:
        out += bias
    return out.view(x.shape[0] // world, *x.shape[1:-1], n)


def gather_output_grad(layer, grad: torch.Tensor) -> torch.Tensor:
    """The backward of the reduce-scatter along tokens: every rank's ``grad_y`` rows, in bf16."""
    world = layer.comm.world
    g = grad.reshape(-1, grad.shape[-1]).to(torch.bfloat16)
    return all_gather_rows(g, layer._reduce_group, world).view(grad.shape[0] * world, *grad.shape[1:])

