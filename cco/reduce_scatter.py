"""GemmReduceScatterOp: fp8 GEMM + reduce-scatter of the partial products of tensor-parallel ranks.

Unfused equivalent, on every rank ``r`` of ``W``::

    partial = reference_gemm(a, unshuffle_b(b_pre), a_scale, b_scale, quant)   # bf16 [M, N]
    out = reduce_scatter(partial, op=SUM, dim=scatter_dim)[r]
    # scatter_dim=0 (tokens, Megatron's sequence parallelism): rows r*M/W..(r+1)*M/W -> bf16 [M/W, N]
    # scatter_dim=1: columns r*N/W..(r+1)*N/W                                         -> bf16 [M, N/W]

It is the all-reduce of :class:`cco.op.GemmAllReduceOp` without its gather phase: the GEMM walks
its tiles by the owner of each output slice (``cco.layout``: a slice is M/W rows of all N columns for
``scatter_dim=0``, all M rows of N/W columns for ``scatter_dim=1``), bumps the owner's (dest, chunk)
counter after each tile, and the transport puts a slice's chunk to its owner once its last tile is
written; the owner sums its own and the received slices in fp32 and rounds to bf16::

    GEMM     |c0:d1 d2 .. d0|c1:d1 d2 .. d0|c2 ...|
    scatter        |c0 -> owners |c1 -> owners |c2 ...|
    reduce                                     |c0 c1 c2 ...| -> out

Modes ``fused`` and ``split``, transports, deadlines, rejected calls, mismatched M, recovery, graph
safety and cleanup: the contracts of ``cco.op`` (one call machinery, :class:`cco.op.CollectiveGemmOp`).
With ``scatter_dim=0`` every call's M must be a multiple of the world (else a ValueError that says
how to pad); ``m_max`` is the whole M a call may pass. With one rank the reduce-scatter is the
identity and a call is the plain GEMM.
"""

from __future__ import annotations

import torch

from cco import layout
from cco.op import DEFAULT_DEADLINE_S, ScatterGemmOp

_FN = "GemmReduceScatterOp"


class GemmReduceScatterOp(ScatterGemmOp):
    """Fused fp8 GEMM + reduce-scatter over the ranks of ``comm``.

    Arguments (all but ``comm`` keyword-only): those of :class:`cco.op.GemmAllReduceOp` (``n``, ``k``,
    ``m_max``, ``quant``, ``mode`` "fused" | "split" or a mori arm name, ``transport``, ``chunks``,
    ``weight_layout``, ``deadline_s``, ``faults``) without ``gather_dtype`` (nothing is gathered), and
      scatter_dim: 0 (default): rank r keeps rows r*M/W..(r+1)*M/W (tokens; M a multiple of W);
                   1: rank r keeps columns r*N/W..(r+1)*N/W (N a multiple of W).
    """

    _FN = _FN

    def __init__(self, comm, *, n: int, k: int, m_max: int, scatter_dim: int = 0, quant: str = "ptpc",
                 mode: str = "fused", transport: str | None = None, chunks: int | tuple[int, ...] | None = None,
                 deadline_s: float = DEFAULT_DEADLINE_S, faults=None, weight_layout: str = "bpreshuffle"):
        error = None
        try:
            pattern = layout.reduce_scatter_pattern(scatter_dim)
        except ValueError as err:  # raised through the ranks' agreement on the arguments, as any refusal
            pattern, error = None, ValueError(f"{_FN}: {err}")
        self.scatter_dim = scatter_dim
        super().__init__(comm, pattern=pattern, faults=faults, error=error, arguments=dict(
            n=n, k=k, m_max=m_max, scatter_dim=scatter_dim, quant=quant, mode=mode, transport=transport,
            gather_dtype="bf16", chunks=chunks, deadline_s=deadline_s, weight_layout=weight_layout))

    def out_shape(self, m: int) -> tuple[int, int]:
        """The output shape of a call with ``m`` rows."""
        return layout.out_shape(self.config, m)

    def _repr_extra(self) -> str:
        return f", scatter_dim={self.scatter_dim}"
