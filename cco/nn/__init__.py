"""Tensor-parallel layers on the fused ops: ``RowParallelLinear`` (``linear``), ``ColumnParallelLinear``
(``column``), their sequence-parallel paths (``sequence``, ``collectives``), the pool of ops (and
their windows) that layers of one shape family share (``pool``), and fp8 checkpoints read into the
layers' formats and sharded (``checkpoint``).

May import: the runtime (``cco.op``, ``cco.comm``, ``cco.library``, ``cco.shapes``), the kernels
(the activation quantizers of ``kernels_fused.hopper`` and ``kernels_fused.cpu``) and the pure
contracts. Nothing in the runtime imports this package.
"""

from cco.nn.checkpoint import (Fp8Weight, convert_fp8_weight, dequantize, read_fp8_weight, shard_fp8_weight,
                               shard_width)
from cco.nn.column import ColumnParallelLinear
from cco.nn.linear import RowParallelLinear
from cco.nn.parallel_linear import close_layers
from cco.nn.pool import DEFAULT_POOL, WindowPool

__all__ = ["DEFAULT_POOL", "ColumnParallelLinear", "Fp8Weight", "RowParallelLinear", "WindowPool",
           "close_layers", "convert_fp8_weight", "dequantize", "read_fp8_weight", "shard_fp8_weight", "shard_width"]
