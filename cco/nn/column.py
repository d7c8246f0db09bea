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
checkpoint shard; zero padding to the backend's shape, laid out once). Where the fused op cannot run
(``mode="unfused"``, a backend that refuses the shape or the pattern: every rank of the group alike)
the layer quantizes the same way and runs ``all_gather_into_tensor`` of the fp8 rows and scales on
the group, then the same GEMM.

Autograd (straight-through quantization; ``backward="bf16"`` runs the collectives unfused in bf16,
``"fp8"`` the fused GEMM + reduce-scatter on e4m3 gradients: ``cco.nn.sequence``)::

    grad_x_r = reduce_scatter(grad_y @ W_r, dim=0)      # sequence parallel; else grad_y @ W_r, no comm
    grad_W_r = grad_y.T @ all_gather(x_r, dim=0)         # trainable=True: a bf16 master weight
    grad_b_r = grad_y.sum(tokens)
"""

from __future__ import annotations

import logging

import torch

from cco import library, shapes
from cco import quant as Q
from cco.comm import Communicator
from cco.nn.collectives import all_gather_rows, reduce_scatter_rows
from cco.nn.linear import RowParallelLinear, quantize_activation
from cco.nn.pool import DEFAULT_POOL, WindowPool
from cco.nn.sequence import check_token_rows, make_dual
from cco.op import DEFAULT_DEADLINE_S, GemmAllReduceOp

log = logging.getLogger("cco.nn")
MODES = ("fused", "split", "unfused")
_FN = "ColumnParallelLinear"


class ColumnParallelLinear(torch.nn.Module):
    """Column-parallel linear layer: ``y_r = x @ W_r.T + b_r``, the input all-gathered along tokens
    first with ``sequence_parallel=True``.

    Arguments (all but the sizes keyword-only):
      in_features:   K, the layer's input features (every rank takes all of them).
      out_features_per_rank: N_r, this rank's output features (its rows of the weight).
      group, quant, bias, m_max, mode, transport, chunks, deadline_s, trainable, pool: as
                     :class:`cco.nn.RowParallelLinear` (``m_max``: the gathered tokens one call takes;
                     a sequence-parallel call is never split).
      sequence_parallel: the input is this rank's tokens (first dimension) and the output every
                     rank's, through the fused all-gather + GEMM (``cco.all_gather.AllGatherGemmOp``).
                     Without it the input is replicated and the GEMM local (the op's ``gemm-only``).
      backward:      with sequence_parallel: "bf16" (the reduce-scatter of grad_x unfused, in bf16) or
                     "fp8" (``GemmReduceScatterOp`` fuses it with grad_y @ W_r, e4m3 gradients).

    The weight is zero until :meth:`load_weight` or :meth:`load_fp8`.
    """

    def __init__(self, in_features: int, out_features_per_rank: int, *, group=None, quant: str = "ptpc",
                 bias: bool = False, m_max: int = 4096, mode: str = "fused", sequence_parallel: bool = False,
                 transport: str | None = None, chunks=None, deadline_s: float = DEFAULT_DEADLINE_S,
                 trainable: bool = False, pool: WindowPool | None = None, backward: str = "bf16"):
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features_per_rank", out_features_per_rank),
                            ("m_max", m_max)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{_FN}: {name}={value!r} must be a positive int")
        if mode not in MODES:
            raise ValueError(f"{_FN}: mode={mode!r} is not supported; pass one of {', '.join(MODES)}")
        Q.check_quant(quant, fn=_FN)
        # the names of RowParallelLinear's weight methods, which this layer shares: N and K of the shard
        self.out_features, self.in_features_per_rank = out_features_per_rank, in_features
        self.in_features, self.out_features_per_rank = in_features, out_features_per_rank
        self.quant, self.m_max, self.mode = quant, m_max, mode
        self.sequence_parallel = bool(sequence_parallel)
        self._pool = pool or DEFAULT_POOL
        self.comm = self._pool.communicator(group)
        self.device = self.comm.device
        self._reduce_group = self.comm.group if group is None or isinstance(group, Communicator) else group
        world = self.comm.world
        if self.sequence_parallel:
            from cco.all_gather import AllGatherGemmOp

            op_class, fused_mode = AllGatherGemmOp, "fused" if mode == "unfused" else mode
            op_options = dict(quant=quant, mode=fused_mode, transport=transport, chunks=chunks)
            shape_options = {**op_options, "pattern": "all-gather"}
        else:  # a local GEMM: the all-reduce op's plain GEMM, no communication
            op_class = GemmAllReduceOp
            op_options = shape_options = dict(quant=quant, mode="gemm-only")
        try:
            weight_layout = shapes.backend_class(device=self.device).weight_layouts[0]
        except ValueError:
            weight_layout = "row-major"
        plan = shapes.layer_shape(out_features_per_rank, in_features, world, m_max=m_max, device=self.device,
                                  weight_layout=weight_layout, **shape_options)
        reason = "mode='unfused' was asked for" if mode == "unfused" else plan.reason
        verdicts = self.comm.all_gather_object(reason)  # one verdict for the whole group
        refused = [f"rank {r}: {why}" for r, why in enumerate(verdicts) if why is not None]
        self.fallback_reason = None if not refused else (reason if len(set(verdicts)) == 1 else "; ".join(refused))
        self.shape = plan
        self.n_padded, self.k_padded = plan.n_padded, plan.k_padded
        self.op = None
        if self.fallback_reason is None:
            self.weight_layout = weight_layout
            self.op = self._pool.acquire(self.comm, op_class=op_class, n=self.n_padded, k=self.k_padded, m_max=m_max,
                                         deadline_s=deadline_s, weight_layout=weight_layout, **op_options)
        else:
            self.weight_layout = "row-major"
            log.warning("%s", f"{self._name()}: runs unfused: {self.fallback_reason}")
        w_q, w_s = self._zero_weight()
        self.register_buffer("qweight", w_q)
        self.register_buffer("weight_scale", w_s)
        self.bias = None
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(out_features_per_rank, dtype=torch.bfloat16, device=self.device))
        self.weight = None
        if trainable:
            self.weight = torch.nn.Parameter(torch.zeros(out_features_per_rank, in_features, dtype=torch.bfloat16,
                                                         device=self.device))
        # sequence parallel, backward="fp8": grad_y @ W_r fused with the reduce-scatter of grad_x
        self._dual = make_dual(self, backward, gathers=False, n=in_features, k=out_features_per_rank,
                               mode="fused" if mode == "unfused" else mode, transport=transport, chunks=chunks,
                               deadline_s=deadline_s, fn=_FN)
        self._handle = library.register(self)
        self._closed = False

    def _name(self) -> str:
        sp = ", sequence parallel" if self.sequence_parallel else ""
        return (f"{_FN}({self.in_features} -> {self.out_features_per_rank}, {self.quant}{sp}, rank "
                f"{self.comm.rank}/{self.comm.world})")

    # ---- weights: RowParallelLinear's (a [N, K] shard, padded, quantized and laid out once) -----------
    _SHARD = "[out_features_per_rank, in_features]"
    _zero_weight = RowParallelLinear._zero_weight
    _laid_out = RowParallelLinear._laid_out
    _arrange = RowParallelLinear._arrange
    _row_major = RowParallelLinear._row_major
    load_weight = RowParallelLinear.load_weight
    load_fp8 = RowParallelLinear.load_fp8
    _check_shape = RowParallelLinear._check_shape
    dequantized_weight = RowParallelLinear.dequantized_weight
    quantized_weight = RowParallelLinear.quantized_weight

    def train(self, mode: bool = True):
        super().train(mode)
        if not mode and self.weight is not None:  # eval(): the stored fp8 weight follows the master
            with torch.no_grad():
                q, s = self._laid_out(self.weight)
                self.qweight.copy_(q)
                self.weight_scale.copy_(s)
        return self

    # ---- forward ----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 ``[M, ..., out_features_per_rank]``: for this rank's tokens ``x [M/W, ...,
        in_features]`` with ``sequence_parallel=True`` (collective: every rank passes as many), else
        for the replicated ``x [M, ..., in_features]`` (local)."""
        if x.shape[-1] != self.in_features:
            err = ValueError(f"{_FN}: x has {x.shape[-1]} features in its last dimension but the layer takes "
                             f"in_features={self.in_features}")
            if self.op is not None and self.sequence_parallel:
                self.op.reject(err)
            raise err
        rows_factor = 1
        if self.sequence_parallel:
            check_token_rows(self, x, _FN, gathers=True)
            rows_factor = self.comm.world
        qweight, scale = self.quantized_weight()
        return torch.ops.cco.column_parallel_linear(x, qweight, scale, self.bias, self.weight, self._handle,
                                                    self.out_features_per_rank, rows_factor)

    def _cco_forward(self, x, qweight, scale, bias) -> torch.Tensor:
        """The body of ``torch.ops.cco.column_parallel_linear`` (real tensors, outside the compiler)."""
        if self._closed:
            raise RuntimeError(f"{self._name()}: the layer is closed; build a new one")
        n = self.out_features_per_rank
        factor = self.comm.world if self.sequence_parallel else 1
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        if x2.shape[0] == 0:
            out = torch.zeros(0, n, dtype=torch.bfloat16, device=x.device)
        elif self.sequence_parallel or x2.shape[0] <= self.m_max:
            out = self._rows(x2, qweight, scale)[:, :n]
        else:  # a local GEMM of more rows than one call takes: in pieces
            out = torch.cat([self._rows(x2[r0:r0 + self.m_max], qweight, scale)[:, :n]
                             for r0 in range(0, x2.shape[0], self.m_max)])
        out = out.contiguous()
        if bias is not None:
            out += bias
        return out.view(x.shape[0] * factor, *x.shape[1:-1], n)

    def _rows(self, x2, qweight, scale) -> torch.Tensor:
        a, a_scale = quantize_activation(x2, self.quant, k_padded=self.k_padded)
        if self.op is not None:
            return self.op(a, qweight, a_scale, scale)
        if self.sequence_parallel:  # unfused: the fp8 rows and their scales gathered on the group
            world = self.comm.world
            a = all_gather_rows(a, self._reduce_group, world)
            gathered = all_gather_rows(a_scale.contiguous(), self._reduce_group, world)
            a_scale = gathered.t().contiguous().t() if self.quant == "blockscale" else gathered
        return Q.reference_gemm(a, self._row_major(qweight), a_scale, scale, self.quant)

    def _cco_backward(self, grad, x, qweight, scale, *, input_grad: bool, weight_grad: bool, bias_grad: bool):
        """(grad_x, grad_master_weight, grad_bias) for ``grad`` of the output; sequence parallel:
        the reduce-scatter of grad_x and the all-gather of x along tokens (collective)."""
        world = self.comm.world if self.sequence_parallel else 1
        g = grad.reshape(-1, self.out_features_per_rank).to(torch.bfloat16)
        grad_x = grad_w = grad_b = None
        if input_grad and self._dual is not None:  # the GEMM + reduce-scatter, fused, e4m3 operands
            out = self._dual(g, self.dequantized_weight(qweight, scale), quantize_activation)
            grad_x = out[:, :self.in_features].reshape(x.shape).to(x.dtype)
        elif input_grad:
            w = self.dequantized_weight(qweight, scale).to(torch.bfloat16)
            full = g @ w  # [M, in_features]
            if self.sequence_parallel:
                full = reduce_scatter_rows(full.float(), self._reduce_group, world)
            grad_x = full.view(x.shape).to(x.dtype)
        if weight_grad:
            x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
            if self.sequence_parallel:
                x2 = all_gather_rows(x2, self._reduce_group, world)
            grad_w = g.t() @ x2
        if bias_grad:
            grad_b = g.float().sum(0)
        return grad_x, grad_w, grad_b

    # ---- lifetime ---------------------------------------------------------------------------------
    @property
    def window_bytes(self) -> int:
        return 0 if self.op is None else self.op.config.window.nbytes

    def close(self) -> None:
        """Release the shared op (the last layer of a family frees its window). Idempotent; local."""
        self._closed = True
        library.unregister(self._handle)
        if self._dual is not None:
            self._dual.close()
        if self.op is not None:
            self._pool.release(self.op)
            self.op = None

    def extra_repr(self) -> str:
        path = "fused" if self.fallback_reason is None else f"unfused ({self.fallback_reason})"
        return (f"in_features={self.in_features}, out_features_per_rank={self.out_features_per_rank}, "
                f"quant={self.quant!r}, sequence_parallel={self.sequence_parallel}, rank={self.comm.rank}/"
                f"{self.comm.world}, backend={self.shape.backend}, path={path}, bias={self.bias is not None}, "
                f"trainable={self.weight is not None}"
                + (f", padded {self.shape.padding}" if self.shape.padding else ""))
