"""Sequence parallelism along tokens for the layers (Megatron's convention): between the tensor-
parallel regions rank ``r`` of ``W`` keeps rows ``r*M/W .. (r+1)*M/W`` of the flattened activations;
the first dimension of a layer's input and output is the token dimension that is split.

The three patterns of a tensor-parallel block and what runs each, fused and unfused::

    layer                                    forward (fused op)            backward (dual)
    RowParallelLinear                        GEMM + all-reduce             none (grad_y replicated)
    RowParallelLinear(sequence_parallel)     GEMM + reduce-scatter (dim 0) all-gather of grad_y
    ColumnParallelLinear(sequence_parallel)  all-gather + GEMM             reduce-scatter of grad_x
    ColumnParallelLinear                     local GEMM                    none

The backward's collective, per layer (``backward=``):

- ``"bf16"`` (the default): unfused on the group, in bf16 (``cco.nn.collectives``): the gradients
  keep bf16's range and precision, no window is needed for the backward.
- ``"fp8"``: the dual pattern's fused op (:class:`DualGemm`): the gradient and the weight in e4m3
  with one scale per row (``BACKWARD_QUANT``; a gradient's range varies by token), so the
  gradients carry fp8's few-percent error (``tests/python/cco/test_nn_sequence.py``: within 0.1
  relative L2 of the unfused model's) and each layer family holds a second window. The fused ops
  take e4m3 operands only, hence no fused bf16 backward.

Every rank runs the same backward, so its collectives run in the same order on every rank.

This module holds the row-parallel layer's sequence-parallel path (``cco.nn.linear`` calls it) and
what both layers share.
"""

from __future__ import annotations

import torch

from cco import quant as Q
from cco.nn.collectives import (all_gather_rows, backward_step, flat_rows, gathered_rows, reduce_scatter_rows,
                                scattered_rows)
from cco.nn.pool import group_plan


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
        layer._refuse_call(err)
        raise err


def row_parallel_body(layer, x, qweight, scale, bias, quantize) -> torch.Tensor:
    """``reduce_scatter(x_r @ W_r.T, dim=0) + bias``: bf16 ``[x.shape[0] / W, ..., out_features]``;
    ``quantize``: the layer's activation quantizer (``cco.nn.linear.quantize_activation``)."""
    world, n, k = layer.comm.world, layer.out_features, layer.in_features_per_rank
    m = x.numel() // k
    if m == 0:  # agreed, as the other layers' calls of none (every rank's share of nothing is nothing)
        layer._agree_rows(0)
        return torch.zeros(x.shape[0] // world, *x.shape[1:-1], n, dtype=torch.bfloat16, device=x.device)
    # this rank's own work (flatten, quantize; unfused: the GEMM) before the call's collective step,
    # which carries a failure of it to every rank (_before_op, _agreed)
    if layer.op is not None:
        if not layer._loaded:
            layer._require_loaded()
        a, a_scale = layer._before_op(lambda: quantize(flat_rows(x, k), layer.quant, k_padded=layer.k_padded))
        out = layer.op(a, qweight, a_scale, scale, tag=layer._tag)
    else:
        def term():  # this rank's term of the reduce-scatter, and the reduce-scatter's output
            a, a_scale = quantize(flat_rows(x, k), layer.quant, k_padded=layer.k_padded)
            partial = Q.reference_gemm(a, layer._row_major(qweight), a_scale, scale, layer.quant).float()
            return partial, scattered_rows(partial, world)
        # unfused: the rows (and the weights) agreed before the reduce-scatter, whose sizes nobody checks
        partial, out = layer._agreed(term, m)
        out = reduce_scatter_rows(partial, layer._reduce_group, world, out).to(torch.bfloat16)
    out = out if layer.n_padded == n else out[:, :n].contiguous()
    if bias is not None:
        out += bias
    return out.view(x.shape[0] // world, *x.shape[1:-1], n)


def gather_output_grad(layer, grad: torch.Tensor, *, step: int) -> torch.Tensor:
    """The backward of the reduce-scatter along tokens: every rank's ``grad_y`` rows, in bf16, after
    the ranks agree on the call (``layer._agree_rows``, ``step`` its backward's: a peer that never
    runs its backward makes this rank raise after ``deadline_s``, not wait in the all-gather)."""
    world = layer.comm.world

    def own():  # this rank's rows in bf16, and the all-gather's output
        g = flat_rows(grad, grad.shape[-1]).to(torch.bfloat16)
        return g, gathered_rows(g, world)
    g, out = layer._agreed(own, grad.numel() // grad.shape[-1], step=step)
    return all_gather_rows(g, layer._reduce_group, world, out).view(grad.shape[0] * world, *grad.shape[1:])



# --------------------------------------------------------------------------------------------------
# backward="fp8": the dual pattern's fused op
# --------------------------------------------------------------------------------------------------
BACKWARDS = ("bf16", "fp8")
BACKWARD_QUANT = "ptpc"  # gradients: one scale per token row (a gradient's range varies by token) and
# per weight row; the blocks of blockscale / mxfp8 would add nothing a per-row scale misses here


def check_backward(backward: str, fn: str) -> None:
    if backward not in BACKWARDS:
        raise ValueError(f"{fn}: backward={backward!r} is not supported; pass 'bf16' (unfused bf16 collectives) "
                         f"or 'fp8' (the dual fused op on e4m3 gradients)")


class DualGemm:
    """The fused op of a sequence-parallel layer's backward: ``grad [rows, N] @ W [N, K]`` through
    the dual pattern's op (``op_class``: ``GemmReduceScatterOp`` for a column-parallel layer,
    ``AllGatherGemmOp`` for a row-parallel one), the gradient and the weight in e4m3 with per-row
    scales (``BACKWARD_QUANT``). The op's weight is ``W.T`` ([K, N]: n = the layer's K, k = its N),
    padded, quantized and laid out per backward call (a trainable weight changes every step).
    Construction is collective; where the op cannot run (``reason``), the layer's bf16 path runs on
    every rank alike."""

    def __init__(self, layer, *, op_class, pattern: str, n: int, k: int, options: dict, pool, deadline_s: float):
        comm = layer.comm
        self.n, self.k = n, k
        opts = {**options, "quant": BACKWARD_QUANT}
        plan, self.weight_layout, self.reason = group_plan(comm, n, k, m_max=layer.m_max, pattern=pattern, **opts)
        self.n_padded, self.k_padded = plan.n_padded, plan.k_padded
        self.op, self._pool, self._tag = None, pool, layer._tag  # (the layer's calls and its backward's alike)
        if self.reason is None:
            extra = {"scatter_dim": 0} if pattern == "reduce-scatter-rows" else {}
            self.op = pool.acquire(comm, op_class=op_class, fn=layer._FN, n=self.n_padded, k=self.k_padded,
                                   m_max=layer.m_max, deadline_s=deadline_s, weight_layout=self.weight_layout,
                                   **opts, **extra)

    def weight(self, w: torch.Tensor):
        """(e4m3 W.T laid out, its scale) from the forward's dequantized weight ``w [N, K]``."""
        from cco.preshuffle import preshuffle_b

        wt = torch.nn.functional.pad(w.t().float(), (0, self.k_padded - self.k, 0, self.n_padded - self.n))
        q, s = Q.quantize_b(wt, BACKWARD_QUANT)
        return (preshuffle_b(q) if self.weight_layout == "bpreshuffle" else q), s

    def __call__(self, grad2d: torch.Tensor, w: torch.Tensor, quantize, **kw):
        try:  # this rank's own work before the op call: where it fails, the rank takes part in the
            # call as a rejected one, and the ranks stay in step (as the layers' _before_op)
            a, a_scale = quantize(grad2d, BACKWARD_QUANT, k_padded=self.k_padded)
            b, b_scale = self.weight(w)
        except Exception as err:
            self.op.reject(err)
            raise
        return self.op(a, b, a_scale, b_scale, tag=self._tag, **kw)

    def close(self) -> None:
        if self.op is not None:
            self._pool.release(self.op)
            self.op = None


def row_parallel_fp8_backward(layer, grad, x, qweight, scale, *, input_grad, weight_grad, bias_grad, quantize):
    """``RowParallelLinear(sequence_parallel=True, backward="fp8")``: ``grad_x = all_gather(grad_y_r) @ W_r``
    through the fused all-gather + GEMM, which also returns the gathered e4m3 ``grad_y`` for the
    weight and bias gradients (dequantized to bf16)."""
    g_r = grad.reshape(-1, layer.out_features)
    # agreed first: the dual op may be the pool's op of another layer's forward (the same family),
    # whose next call a peer that skipped this backward would pair with this one (one step whatever
    # gradients are asked for: the dual call is the same); this rank's own work before it
    w = layer._agreed(lambda: layer.dequantized_weight(qweight, scale), g_r.shape[0],  # [N, K_r], fp32
                      step=backward_step(input_grad=True, weight_grad=True))
    out, g_q, g_s = layer._dual(g_r, w, quantize, return_a=True)
    g = Q.dequantize_a(g_q, g_s, BACKWARD_QUANT)[:, :layer.out_features].to(torch.bfloat16)  # every rank's grad_y
    grad_x = out[:, :layer.in_features_per_rank].reshape(x.shape).to(x.dtype) if input_grad else None
    grad_w = g.t() @ x.reshape(-1, layer.in_features_per_rank).to(torch.bfloat16) if weight_grad else None
    grad_b = g.float().sum(0) if bias_grad else None
    return grad_x, grad_w, grad_b


def make_dual(layer, backward: str, *, gathers: bool, n: int, k: int, mode: str, transport, chunks,
              deadline_s: float, fn: str):
    """The layer's :class:`DualGemm` for ``backward="fp8"`` (None for "bf16", and where the fused op
    cannot run: the layer's forward is unfused, or a backend refuses; every rank alike, logged).
    ``gathers``: the dual pattern is the all-gather (a row-parallel layer), else the reduce-scatter."""
    check_backward(backward, fn)
    if backward != "fp8" or not layer.sequence_parallel:
        return None
    if layer.op is None:  # the forward runs unfused on every rank: so does the backward
        return None
    from cco.all_gather import AllGatherGemmOp
    from cco.reduce_scatter import GemmReduceScatterOp

    dual = DualGemm(layer, op_class=AllGatherGemmOp if gathers else GemmReduceScatterOp,
                    pattern="all-gather" if gathers else "reduce-scatter-rows", n=n, k=k,
                    options=dict(mode=mode, transport=transport, chunks=chunks), pool=layer._pool,
                    deadline_s=deadline_s)
    if dual.reason is not None:
        import logging

        logging.getLogger("cco.nn").warning("%s", f"{fn}: backward='fp8' runs the bf16 collectives: {dual.reason}")
        return None
    return dual
