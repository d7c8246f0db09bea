"""``ColumnParallelLinear``: the tensor-parallel layer whose weight is split along its output
features, with the all-gather of sequence parallelism fused into its GEMM.

Unfused equivalent, on every rank ``r`` of the group (``W_r`` its ``[out_features_per_rank,
in_features]`` weight shard)::

    sequence_parallel=False:  y_r = x @ W_r.T + b_r                       # x replicated, no communication
    sequence_parallel=True:   y_r = all_gather(x_r, dim=0) @ W_r.T + b_r  # x_r: this rank's tokens

computed as the op computes it: ``x`` and ``W_r`` in fp8 (``quant``), the product in fp32 rounded to
bf16. With ``sequence_parallel=True`` the input is this rank's ``[M/W, ..., in_features]`` tokens
(Megatron's convention: rank r holds rows r*M/W..(r+1)*M/W) and the output ``[M, ...,
out_features_per_rank]``; the rows travel in fp8 with their scales (``cco.all_gather``), and the GEMM
consumes each rank's rows as they land.

Weights: as ``RowParallelLinear`` (``load_weight`` from a bf16/fp32 shard, ``load_fp8`` from an fp8
checkpoint shard, ``load_checkpoint`` from the whole fp8 checkpoint weight, sharded along N; zero
padding to the backend's shape, laid out once; the shared part lives in ``cco.nn.parallel_linear``).
Where the fused op cannot run (``mode="unfused"``, a backend that refuses the shape or the pattern:
every rank of the group alike) the layer quantizes the same way and runs ``all_gather_into_tensor``
of the fp8 rows and scales on the group, then the same GEMM.

Autograd (straight-through quantization; ``backward="bf16"`` runs the collectives unfused in bf16,
``"fp8"`` the fused GEMM + reduce-scatter on e4m3 gradients: ``cco.nn.sequence``)::

    grad_x_r = reduce_scatter(grad_y @ W_r, dim=0)      # sequence parallel
    grad_x   = all_reduce(grad_y @ W_r)                  # else: x is every rank's, so is its gradient
    grad_W_r = grad_y.T @ all_gather(x_r, dim=0)         # trainable=True: a bf16 master weight
    grad_b_r = grad_y.sum(tokens)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cco import quant as Q
from cco.nn.collectives import (all_gather_rows, backward_step, flat_rows, gathered_rows, reduce_scatter_rows,
                                scattered_rows)
from cco.nn.parallel_linear import _ParallelLinear, quantize_activation
from cco.nn.pool import WindowPool
from cco.nn.sequence import check_token_rows
from cco.op import DEFAULT_DEADLINE_S, GemmAllReduceOp

_FN = "ColumnParallelLinear"


class ColumnParallelLinear(_ParallelLinear):
    """Column-parallel linear layer: ``y_r = x @ W_r.T + b_r``, the input all-gathered along tokens
    first with ``sequence_parallel=True``.

    Arguments (all but the sizes keyword-only):
      in_features:   K, the layer's input features (every rank takes all of them).
      out_features_per_rank: N_r, this rank's output features (its rows of the weight).
      group, cpu_group, quant, bias, m_max, mode, transport, chunks, deadline_s, trainable, pool: as
                     :class:`cco.nn.RowParallelLinear` (``m_max``: the gathered tokens one call takes,
                     at least the group's size; a sequence-parallel call is never split).
      sequence_parallel: the input is this rank's tokens (first dimension) and the output every
                     rank's, through the fused all-gather + GEMM (``cco.all_gather.AllGatherGemmOp``).
                     Without it the input is replicated and the GEMM local (the op's ``gemm-only``).
      backward:      with sequence_parallel: "bf16" (the reduce-scatter of grad_x unfused, in bf16) or
                     "fp8" (``GemmReduceScatterOp`` fuses it with grad_y @ W_r, e4m3 gradients).
                     Without sequence_parallel the all-reduce of grad_x runs in bf16: "fp8" is refused.

    The weight is blank until :meth:`load_weight`, :meth:`load_fp8`, :meth:`load_checkpoint` or
    ``load_state_dict``: a call before that raises (it would return zeros); with
    ``sequence_parallel=True`` on every rank of the group, the next call running once every rank
    has loaded; without it (a local GEMM) on the blank rank alone. Construction is collective over
    the group: ranks with different arguments all raise ``ArgumentMismatchError``.

    fp8 checkpoints (:meth:`load_checkpoint`): as :class:`cco.nn.RowParallelLinear`'s, the whole
    ``[N, in_features]`` weight sharded along N instead, in whole scale blocks: build the layer with
    ``out_features_per_rank = cco.nn.shard_width(w, world=world, dim=0)``. The last rank's shard
    may be shorter: it is padded with zero rows, and that rank's output ends in as many zero columns
    (every rank returns ``out_features_per_rank``; the gathered output's features past N are zeros:
    drop them, ``[..., :N]``).
    """

    _FN = _FN
    _SHARD = "[out_features_per_rank, in_features]"  # the weight shard's dimensions, for errors
    _SHARD_DIM, _PER_RANK, _WHOLE = 0, "out_features_per_rank", "in_features"  # checkpoints shard N
    _DUAL_GATHERS = False  # backward="fp8": grad_y @ W_r fused with the reduce-scatter of grad_x
    _COLLECTIVE_WITHOUT_SP = False  # a local GEMM: no collective without sequence parallelism
    _UNFUSED = ("GEMM", "all_gather + GEMM")

    def __init__(self, in_features: int, out_features_per_rank: int, *, group=None, quant: str = "ptpc",
                 bias: bool = False, m_max: int = 4096, mode: str = "fused", sequence_parallel: bool = False,
                 transport: str | None = None, chunks=None, deadline_s: float = DEFAULT_DEADLINE_S,
                 trainable: bool = False, pool: WindowPool | None = None, backward: str = "bf16", cpu_group=None):
        super().__init__()
        if sequence_parallel:
            from cco.all_gather import AllGatherGemmOp

            op_class = AllGatherGemmOp
            op_options = dict(quant=quant, mode="fused" if mode == "unfused" else mode, transport=transport,
                              chunks=chunks)
            shape_options = {**op_options, "pattern": "all-gather"}
        else:  # a local GEMM: the all-reduce op's plain GEMM, no communication
            op_class = GemmAllReduceOp
            op_options = shape_options = dict(quant=quant, mode="gemm-only")
        self._build(n=out_features_per_rank, k=in_features,
                    sizes=dict(in_features=in_features, out_features_per_rank=out_features_per_rank, m_max=m_max),
                    arguments=dict(in_features=in_features, out_features_per_rank=out_features_per_rank, quant=quant,
                                   bias=bias, m_max=m_max, mode=mode, sequence_parallel=sequence_parallel,
                                   transport=transport, chunks=chunks, deadline_s=deadline_s, trainable=trainable,
                                   backward=backward),
                    group=group, cpu_group=cpu_group, quant=quant, bias=bias, m_max=m_max, mode=mode,
                    transport=transport, chunks=chunks, deadline_s=deadline_s, trainable=trainable, pool=pool,
                    sequence_parallel=sequence_parallel, backward=backward, op_class=op_class, op_options=op_options,
                    shape_options=shape_options)
        # the layer's own names of the shard's sizes (the base's out_features / in_features_per_rank: N, K)
        self.in_features, self.out_features_per_rank = in_features, out_features_per_rank

    def _repr_sizes(self) -> str:
        return f"in_features={self.in_features}, out_features_per_rank={self.out_features_per_rank}"

    # ---- forward ----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 ``[M, ..., out_features_per_rank]``: for this rank's tokens ``x [M/W, ...,
        in_features]`` with ``sequence_parallel=True`` (collective: every rank passes as many), else
        for the replicated ``x [M, ..., in_features]`` (local)."""
        if self._decode_call(x):  # as RowParallelLinear's: an eager call of a few rows, one launch
            return self._decode(x, *self.quantized_weight(), self._parameters.get("bias"))
        self._check_before_op(x)  # as RowParallelLinear's
        qweight, scale = self._own_work(x, self.quantized_weight)  # as RowParallelLinear's
        if self._eager(x):  # as RowParallelLinear's: an untraced inference call runs the body directly
            self._check_call(x)
            return self._cco_forward(x, qweight, scale, self.bias)
        return torch.ops.cco.column_parallel_linear(x, qweight, scale, self.bias, self.weight, self._handle,
                                                    self.out_features_per_rank,
                                                    self.comm.world if self.sequence_parallel else 1)

    def _check_call(self, x) -> None:
        self._check_input(x, features=self.in_features, name="in_features", hint="",
                          collective=self.sequence_parallel)
        if self.sequence_parallel:
            check_token_rows(self, x, _FN, gathers=True)

    def _cco_forward(self, x, qweight, scale, bias) -> torch.Tensor:
        """The body of ``torch.ops.cco.column_parallel_linear`` (real tensors, outside the compiler)."""
        self._check_open()
        n, m = self.out_features_per_rank, x.numel() // self.in_features
        if 0 < m <= self.decode_rows:  # the local GEMM of a few rows: the decode GEMM, one launch
            return self._decode(flat_rows(x, self.in_features), qweight, scale, bias).view(*x.shape[:-1], n)
        if m == 0:
            if self.sequence_parallel:  # collective: a call of no rows, agreed (a peer with rows fails it)
                self._agree_rows(0)
            out = torch.zeros(0, n, dtype=torch.bfloat16, device=x.device)
        elif self.sequence_parallel or m <= self.m_max:  # the rows flattened in the call's own work (_rows)
            out = self._rows(x, qweight, scale)[:, :n]
        else:  # a local GEMM of more rows than one call takes: in pieces
            x2 = flat_rows(x, self.in_features)
            out = torch.cat([self._rows(x2[r0:r0 + self.m_max], qweight, scale)[:, :n]
                             for r0 in range(0, m, self.m_max)])
        out = out.contiguous()
        if bias is not None:
            out += bias
        # sequence parallel: every rank's tokens; else the input's leading shape (a 1-D x gives [n])
        lead = (x.shape[0] * self.comm.world, *x.shape[1:-1]) if self.sequence_parallel else x.shape[:-1]
        return out.view(*lead, n)

    def _rows(self, x, qweight, scale) -> torch.Tensor:
        """bf16 [M, n_padded] for ``x [..., K]`` (its rows, flattened here): a collective call with
        ``sequence_parallel`` (M every rank's rows), else the local GEMM. This rank's own work
        (flatten, quantize) runs before the call's collective step, which carries a failure of it to
        every rank (:meth:`_before_op`, :meth:`_agreed`)."""
        k = self.in_features

        def quantized():
            return quantize_activation(flat_rows(x, k), self.quant, k_padded=self.k_padded)
        if self.op is None and self.sequence_parallel:
            world = self.comm.world

            def sent():  # the rows and their scales as they travel (contiguous), and the gathers' outputs
                a, a_scale = quantized()
                a_scale = a_scale.contiguous()
                return a, a_scale, gathered_rows(a, world), gathered_rows(a_scale, world)
            # unfused: the rows (and the weights) agreed before the all-gather, whose sizes nobody checks;
            # then the fp8 rows and their scales gathered on the group
            a, a_scale, rows_out, scales_out = self._agreed(sent, x.numel() // k)
            a = all_gather_rows(a, self._reduce_group, world, rows_out)
            gathered = all_gather_rows(a_scale, self._reduce_group, world, scales_out)
            a_scale = gathered.t().contiguous().t() if self.quant == "blockscale" else gathered
            return Q.reference_gemm(a, self._row_major(qweight), a_scale, scale, self.quant)
        if not self._loaded:
            self._require_loaded()
        if self.op is not None:
            a, a_scale = self._before_op(quantized)
            return self.op(a, qweight, a_scale, scale, tag=self._tag)
        a, a_scale = quantized()  # the local GEMM
        return Q.reference_gemm(a, self._row_major(qweight), a_scale, scale, self.quant)

    def _cco_backward(self, grad, x, qweight, scale, *, input_grad: bool, weight_grad: bool, bias_grad: bool):
        """(grad_x, grad_master_weight, grad_bias) for ``grad`` of the output; sequence parallel:
        the reduce-scatter of grad_x and the all-gather of x along tokens (collective). Without it
        the input is replicated (every rank's copy feeds every rank's columns), so its gradient is
        the sum of every rank's ``grad_y_r @ W_r``: an all-reduce, as Megatron's column-parallel
        layer and torch's ``ColwiseParallel`` (a Replicate input's Partial gradient) give it; the
        weight's and the bias's stay local."""
        world, sp, dual = self.comm.world, self.sequence_parallel, self._dual if input_grad else None

        def own():
            """This rank's own work before the backward's collectives: the gradient in bf16, the weight
            for the fused dual op, or this rank's term of grad_x (fp32: summed in fp32); x's rows; the
            collectives' outputs."""
            g = flat_rows(grad, self.out_features_per_rank).to(torch.bfloat16)
            w = self.dequantized_weight(qweight, scale) if dual is not None else None
            term = (g @ self.dequantized_weight(qweight, scale).to(torch.bfloat16)).float() \
                if input_grad and dual is None else None  # [M, in_features]
            x2 = flat_rows(x, self.in_features).to(torch.bfloat16) if weight_grad else None
            return (g, w, term, scattered_rows(term, world) if sp and term is not None else None,
                    x2, gathered_rows(x2, world) if sp and x2 is not None else None)
        if world > 1 and (input_grad or (sp and weight_grad)):
            # collectives below, back to back: the ranks agree first, this rank's own work before that
            # (a failure of it travels in the header: _agreed)
            g, w, term, term_out, x2, x2_out = self._agreed(
                own, grad.numel() // self.out_features_per_rank,
                step=backward_step(input_grad=input_grad, weight_grad=weight_grad and sp))
        else:
            g, w, term, term_out, x2, x2_out = own()
        if dual is not None:  # the GEMM + reduce-scatter, fused, e4m3 operands
            term = dual(g, w, quantize_activation)[:, :self.in_features]
        elif input_grad and sp:
            term = reduce_scatter_rows(term, self._reduce_group, world, term_out)
        elif input_grad and world > 1:  # the replicated input's gradient: every rank's term, summed in fp32
            dist.all_reduce(term, group=self._reduce_group)
        if weight_grad and sp:
            x2 = all_gather_rows(x2, self._reduce_group, world, x2_out)
        grad_x = term.reshape(x.shape).to(x.dtype) if input_grad else None
        grad_w = g.t() @ x2 if weight_grad else None
        grad_b = g.float().sum(0) if bias_grad else None
        return grad_x, grad_w, grad_b
