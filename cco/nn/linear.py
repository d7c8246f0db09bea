"""``RowParallelLinear``: the tensor-parallel layer that ends in an all-reduce, on the fused op.

Unfused equivalent, on every rank ``r`` of the group (``x_r`` this rank's K slice of the input,
``W_r`` its ``[out_features, in_features_per_rank]`` weight shard)::

    y = all_reduce(x_r @ W_r.T) + bias                 # bf16 [..., out_features], the same on every rank

computed as the op computes it: ``x_r`` and ``W_r`` in fp8 (``quant``), each rank's partial product
in fp32 rounded to bf16, the partials summed in fp32, rounded to bf16.

What the layer does once, at load (``load_weight`` from a bf16/fp32 shard, ``load_fp8`` from an fp8
checkpoint shard with its scales): pads the shard with zeros to the shape the backend runs
(``cco.shapes.layer_shape``: per-rank columns a whole number of the backend's tiles, K whole 128-wide
tiles), quantizes it, and lays it out in the order the backend's kernel reads (``bpreshuffle`` for the
gfx950 kernel and the CPU reference, row-major for the Triton kernels). Per call: flattens the
leading dimensions, quantizes the activations on their device in one kernel that also writes the
zero K padding (Triton on GPUs, torch on the CPU), runs the op (calls of more than ``m_max`` rows in
pieces of ``m_max``), drops the padded output columns, adds the bias. blockscale calls on NVIDIA are
quantized into zero rows up to a multiple of 4 (what cuBLAS's blockwise GEMM takes; the output keeps
the caller's rows). An eager inference call that nothing traces (:func:`untraced`, no gradient to
record) runs this body directly; everything else goes through ``torch.ops.cco.row_parallel_linear``.

Where the fused op cannot run (a backend that refuses the shape even padded, a device it does not
run on, ``mode="unfused"``), the layer runs the unfused equivalent above (a GEMM of the same
quantized operands, then ``torch.distributed.all_reduce`` on the group), says why in ``repr`` and in
a warning of the ``cco.nn`` logger, and every rank of the group takes the same path.

Autograd (training): without sequence parallelism the backward needs no communication. The output
is replicated, so each rank already holds the whole ``grad_y``; with straight-through quantization::

    grad_x_r = grad_y @ W_r          # W_r: the weight the forward used, dequantized to bf16
    grad_W_r = grad_y.T @ x_r        # only with trainable=True: a bf16 master weight
    grad_bias = grad_y.sum(leading)  # the same on every rank

in bf16 matmuls (fp32 accumulation). With ``sequence_parallel=True`` each rank holds only its rows
of ``grad_y``, and ``grad_x_r = all_gather(grad_y_r, dim=0) @ W_r`` (``backward=``: the all-gather in
bf16, or fused in fp8; ``cco.nn.sequence``). A trainable layer requantizes its master weight in every
training forward; ``eval()`` refreshes the stored fp8 weight from it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cco import quant as Q
from cco import shapes  # noqa: F401  (cco.nn.linear.shapes: the planner the layers call, as before the base)
from cco.nn import sequence
from cco.nn.collectives import backward_step, flat_rows
from cco.nn.parallel_linear import MODES, _ParallelLinear, quantize_activation, untraced
from cco.nn.pool import WindowPool
from cco.op import DEFAULT_DEADLINE_S, GemmAllReduceOp

__all__ = ["MODES", "RowParallelLinear", "quantize_activation", "untraced"]
_FN = "RowParallelLinear"


class RowParallelLinear(_ParallelLinear):
    """Row-parallel linear layer: ``y = all_reduce(x_shard @ W_shard.T) + bias`` through cco.

    Arguments (all but the sizes keyword-only):
      in_features_per_rank: K of this rank's input slice and weight shard.
      out_features:  N, the layer's output features (every rank returns all of them).
      group:         a torch.distributed group (the tensor-parallel group; None: the world) or a
                     :class:`cco.comm.Communicator`. Construction is collective over it.
      cpu_group:     a gloo group of the same ranks, for the bootstrap where ``group``'s backend
                     carries no CPU tensors (an NCCL-only group: ``Communicator.from_group``); the
                     unfused path's collectives still run on ``group``.
      quant:         "ptpc" | "blockscale" | "mxfp8" (``cco.quant``).
      bias:          add a bf16 bias of ``out_features`` after the all-reduce.
      m_max:         rows (tokens) one op call takes; sizes the shared window. Calls with more rows
                     run in pieces of ``m_max``. Sequence parallel: every rank's tokens, at least
                     the group's size (a smaller one is refused: no call would fit); a call is never
                     split (more rows are refused on every rank).
      mode:          "fused" | "split" (the op's modes) | "unfused" (GEMM + all_reduce, the fallback).
      transport, gather_dtype, chunks, deadline_s: the op's (``cco.op.GemmAllReduceOp``);
                     ``gather_dtype`` other than "bf16" is refused with sequence_parallel (the
                     reduce-scatter gathers no output).
      trainable:     keep a bf16 master weight (a Parameter) and compute its gradient.
      pool:          the :class:`cco.nn.WindowPool` whose ops this layer shares (default: the process's).
      backward:      with sequence_parallel: "bf16" (the all-gather of grad_y unfused, in bf16) or "fp8"
                     (fused into grad_y @ W_r by ``AllGatherGemmOp``, e4m3 gradients); ``cco.nn.sequence``.
                     Without sequence_parallel the backward runs no collective: "fp8" is refused.
      sequence_parallel: return this rank's rows ``r*M/W..(r+1)*M/W`` of the output (``[M/W, ...,
                     out_features]``, the first input dimension the tokens) through the fused
                     reduce-scatter (``cco.reduce_scatter``) instead of every row; ``cco.nn.sequence``.

    The weight is blank until :meth:`load_weight`, :meth:`load_fp8`, :meth:`load_checkpoint` or
    ``load_state_dict``: a call before that raises on every rank (it would return zeros).

    fp8 checkpoints (:meth:`load_checkpoint`, ``cco.nn.checkpoint``): the whole weight as it ships,
    ``<prefix>.weight`` e4m3 ``[out_features, K]`` with its scale beside it: DeepSeek-V3
    ``weight_scale_inv`` (fp32 128x128 blocks, power-of-two ones too) and V4 ``scale`` (e8m0) load
    into a ``quant="blockscale"`` layer; compressed-tensors ``weight_scale`` per tensor or per row
    (FP8, FP8_DYNAMIC) into ``"ptpc"``, 128x128 (FP8_BLOCK) into ``"blockscale"``, uint8 ``[N, K/32]``
    (MXFP8) into ``"mxfp8"``. Another quant only where the scales convert exactly (power-of-two block
    scales into mxfp8, a per-tensor scale into blockscale); anything else raises, naming the quant to build
    (or ``requantize=True``, lossy). Each rank takes whole scale blocks of K: build the layer with
    ``in_features_per_rank = cco.nn.shard_width(w, world=world, dim=1)``, ``ceil(K / world)``
    wherever that is whole blocks; the last rank's shard may be shorter, padded with zeros (its
    input's missing columns must be zeros too). ``float8_e4m3fnuz`` is refused.
    """

    _FN = _FN
    _SHARD = "[out_features, in_features_per_rank]"  # the weight shard's dimensions, for errors
    _SHARD_DIM, _PER_RANK, _WHOLE = 1, "in_features_per_rank", "out_features"  # checkpoints shard K
    _DUAL_GATHERS = True  # backward="fp8": the all-gather of grad_y fused into grad_y @ W_r
    _COLLECTIVE_WITHOUT_SP = True  # every call all-reduces
    _UNFUSED = ("GEMM + all_reduce", "GEMM + reduce_scatter")

    def __init__(self, in_features_per_rank: int, out_features: int, *, group=None, quant: str = "ptpc",
                 bias: bool = False, m_max: int = 4096, mode: str = "fused", transport: str | None = None,
                 gather_dtype: str = "bf16", chunks=None, deadline_s: float = DEFAULT_DEADLINE_S,
                 trainable: bool = False, pool: WindowPool | None = None, sequence_parallel: bool = False,
                 backward: str = "bf16", cpu_group=None):
        super().__init__()
        op_options = dict(quant=quant, mode="fused" if mode == "unfused" else mode, transport=transport,
                          gather_dtype=gather_dtype, chunks=chunks)
        op_class, shape_options = GemmAllReduceOp, op_options
        if sequence_parallel:
            op_class, op_options, shape_options = sequence.reduce_scatter_options(op_options)
        self._build(n=out_features, k=in_features_per_rank,
                    sizes=dict(in_features_per_rank=in_features_per_rank, out_features=out_features, m_max=m_max),
                    arguments=dict(in_features_per_rank=in_features_per_rank, out_features=out_features, quant=quant,
                                   bias=bias, m_max=m_max, mode=mode, transport=transport, gather_dtype=gather_dtype,
                                   chunks=chunks, deadline_s=deadline_s, trainable=trainable,
                                   sequence_parallel=sequence_parallel, backward=backward),
                    group=group, cpu_group=cpu_group, quant=quant, bias=bias, m_max=m_max, mode=mode,
                    transport=transport, chunks=chunks, deadline_s=deadline_s, trainable=trainable, pool=pool,
                    sequence_parallel=sequence_parallel, backward=backward, op_class=op_class, op_options=op_options,
                    shape_options=shape_options)
        self._row_multiple = 1  # rows a call is padded to a multiple of (zero rows, see _rows)
        if (self.op is not None and quant == "blockscale" and not self.sequence_parallel
                and self.device.type == "cuda" and not getattr(torch.version, "hip", None)):
            from kernels_fused.hopper.vendor import BLOCKWISE_ROW_MULTIPLE
            self._row_multiple = BLOCKWISE_ROW_MULTIPLE

    def _repr_sizes(self) -> str:
        return f"in_features_per_rank={self.in_features_per_rank}, out_features={self.out_features}"

    # ---- forward ----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 ``[..., out_features]``, the same on every rank of the group, for this rank's input
        slice ``x [..., in_features_per_rank]`` (any float dtype); with ``sequence_parallel=True``
        this rank's rows of it, ``[M/W, ..., out_features]`` (M: the first dimension, the tokens).
        Collective: every rank calls it with the same leading shape, on the layer's device."""
        if self._decode_call(x):  # bias: nn.Module's lookup costs a decode call a microsecond
            return self._decode(x, *self.quantized_weight(), self._parameters.get("bias"))
        self._check_before_op(x)
        qweight, scale = self._own_work(x, self.quantized_weight)
        # the body checks x where it runs (_check_call): here, or in the registered op (_op_forward)
        if self.sequence_parallel:
            return torch.ops.cco.sp_row_parallel_linear(x, qweight, scale, self.bias, self.weight, self._handle,
                                                        self.out_features, self.comm.world)
        if self._eager(x):
            self._check_call(x)
            return self._cco_forward(x, qweight, scale, self.bias)
        return torch.ops.cco.row_parallel_linear(x, qweight, scale, self.bias, self.weight, self._handle,
                                                 self.out_features)

    def _starts_with_header(self, m: int) -> bool:
        # and a forward in pieces (its rows agreed first, _cco_forward)
        return super()._starts_with_header(m) or (not self.sequence_parallel and m > self.m_max)

    def _check_call(self, x) -> None:
        self._check_input(x, features=self.in_features_per_rank, name="in_features_per_rank",
                          hint="; pass this rank's slice of the input", collective=True)
        if self.sequence_parallel:
            sequence.check_token_rows(self, x, _FN)

    def _cco_forward(self, x, qweight, scale, bias) -> torch.Tensor:
        """The body of ``torch.ops.cco.row_parallel_linear`` (real tensors, outside the compiler)."""
        self._check_open()
        if self.sequence_parallel:
            return sequence.row_parallel_body(self, x, qweight, scale, bias, quantize_activation)
        lead, n = x.shape[:-1], self.out_features
        m = x.numel() // self.in_features_per_rank
        if 0 < m <= self.decode_rows:  # one rank, a few rows (traced, or a gradient recorded): one launch
            return self._decode(flat_rows(x, self.in_features_per_rank), qweight, scale, bias).view(*lead, n)
        if m <= self.m_max and m > 0:  # the rows flattened in the call's own work (_rows)
            out = self._rows(x, qweight, scale)
            out = out if self.n_padded == n else out[:, :n].contiguous()
        else:  # no rows (every rank alike, agreed: nothing to reduce), or more than one call takes
            # this rank's own work, before the call's first collective step (its header), which carries a failure
            x2, out = self._own_work(x, lambda: (flat_rows(x, self.in_features_per_rank),
                                                 torch.empty(m, n, dtype=torch.bfloat16, device=x.device)))
            if m == 0 or self.op is not None:
                # agreed first (the unfused pieces carry the total in their own headers): the op's
                # stamps compare each piece's rows only, and pieces of one size in forwards of
                # different sizes would pair; a prefill-sized forward pays one small exchange
                self._agree_rows(min(m, self.m_max), total=m)
            for r0 in range(0, m, self.m_max):
                out[r0:r0 + self.m_max] = self._rows(x2[r0:r0 + self.m_max], qweight, scale, total=m)[:, :n]
        if bias is not None:
            out += bias
        return out.view(*lead, n)

    def _rows(self, x, qweight, scale, total: int | None = None) -> torch.Tensor:
        """bf16 [rows, n_padded] for ``x [..., K]`` (its rows, flattened here): one collective call
        (``total``: the forward's rows, where it runs in pieces). This rank's own work (flatten,
        quantize; unfused: the GEMM) runs before the call's collective step, which carries a failure
        of it to every rank (:meth:`_before_op`, :meth:`_agreed`)."""
        k = self.in_features_per_rank
        m = x.numel() // k
        if self.op is None:
            def term():  # this rank's term of the all-reduce
                a, a_scale = quantize_activation(flat_rows(x, k), self.quant, k_padded=self.k_padded)
                return Q.reference_gemm(a, self._row_major(qweight), a_scale, scale, self.quant).float()
            # unfused: the rows (and the weights) agreed before the all-reduce, whose sizes nobody checks
            partial = self._agreed(term, m, total=total)
            dist.all_reduce(partial, group=self._reduce_group)
            return partial.to(torch.bfloat16)
        if not self._loaded:
            self._require_loaded()
        # cuBLAS's blockwise GEMM takes a multiple of 4 rows only: quantize into zero rows up to one
        # (no copy; every rank pads alike) rather than fall back to the own kernel at decode sizes
        rows = self._rows_for(m)
        a, a_scale = self._before_op(lambda: quantize_activation(flat_rows(x, k), self.quant, k_padded=self.k_padded,
                                                                 m_padded=rows))
        out = self.op(a, qweight, a_scale, scale, tag=self._tag)
        return out if rows == m else out[:m]

    def _rows_for(self, m: int) -> int:
        """Rows the op runs for a call of ``m`` rows: ``m`` padded with zero rows to a multiple of
        ``_row_multiple`` while that stays within ``m_max``."""
        rows = -(-m // self._row_multiple) * self._row_multiple
        return rows if rows <= self.m_max else m

    def _cco_backward(self, grad, x, qweight, scale, *, input_grad: bool, weight_grad: bool, bias_grad: bool):
        """(grad_x, grad_master_weight, grad_bias) for ``grad`` of the output: no communication
        (sequence parallel: the all-gather of ``grad`` along tokens first, ``cco.nn.sequence``)."""
        if self._dual is not None:
            return sequence.row_parallel_fp8_backward(self, grad, x, qweight, scale, input_grad=input_grad,
                                                      weight_grad=weight_grad, bias_grad=bias_grad,
                                                      quantize=quantize_activation)
        if self.sequence_parallel:
            grad = sequence.gather_output_grad(self, grad, step=backward_step(input_grad=input_grad,
                                                                              weight_grad=weight_grad))
        g = grad.reshape(-1, self.out_features).to(torch.bfloat16)
        grad_x = grad_w = grad_b = None
        if input_grad:
            w = self.dequantized_weight(qweight, scale).to(torch.bfloat16)
            grad_x = (g @ w).view(x.shape).to(x.dtype)
        if weight_grad:
            grad_w = g.t() @ x.reshape(-1, self.in_features_per_rank).to(torch.bfloat16)
        if bias_grad:
            grad_b = g.float().sum(0)
        return grad_x, grad_w, grad_b
