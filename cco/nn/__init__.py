"""Tensor-parallel layers on the fused ops: ``RowParallelLinear`` (``linear``), ``ColumnParallelLinear``
(``column``), their sequence-parallel paths (``sequence``, ``collectives``), and the pool of ops
(and their windows) that layers of one shape family share (``pool``).

May import: the runtime (``cco.op``, ``cco.comm``, ``cco.library``, ``cco.shapes``), the kernels
(the activation quantizers of ``kernels_fused.hopper`` and ``kernels_fused.cpu``) and the pure
contracts. Nothing in the runtime imports this package.
"""

from cco.nn.column import ColumnParallelLinear
from cco.nn.linear import RowParallelLinear
from cco.nn.pool import DEFAULT_POOL, WindowPool

__all__ = ["DEFAULT_POOL", "ColumnParallelLinear", "RowParallelLinear", "WindowPool"]
