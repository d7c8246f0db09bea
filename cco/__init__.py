"""cco: fused fp8 GEMM + all-reduce for tensor-parallel layers.

``out = all_reduce(a @ b.T)`` over the ranks of a communicator, with the all-reduce's scatter (and on
NVIDIA its reduce and gather) overlapped with the GEMM that produces it. See README.md.

What lives where:
- pure contracts, importable anywhere (the kernels use these and nothing else of ``cco``):
  ``layout`` (window regions, chunks, counter targets, tile walks), ``quant`` (formats, fp32
  reference), ``preshuffle`` (the weight layout), ``validate`` (input checks);
- the runtime: ``op`` (``GemmAllReduceOp`` and the call machinery of every pattern),
  ``reduce_scatter`` (``GemmReduceScatterOp``), ``all_gather`` (``AllGatherGemmOp``), ``comm``,
  ``window``, ``backends/`` (one executor per device), ``transport/`` (protocol words, deadlines,
  the CPU transports), ``cuda/`` (stream memory operations, the copy-engine schedule, reduce and
  gather kernels on CUDA and HIP), ``shapes``
  (what each backend runs fused: ``cco.supports``, a layer's padding), ``library`` (the ops in
  torch.library, for torch.compile and CUDA graphs);
- layers on the runtime: ``nn/`` (``RowParallelLinear``, ``ColumnParallelLinear``; nothing in the
  runtime imports it);
- tools apart from the runtime: ``bench/`` (timing, cost model), ``demo`` (the main job).

Exports are resolved lazily so ``import cco`` stays cheap and works without a GPU, FlyDSL, Triton or
an MPI runtime.
"""

from importlib import import_module

_EXPORTS = {
    "GemmAllReduceOp": "cco.op",
    "GemmReduceScatterOp": "cco.reduce_scatter",
    "AllGatherGemmOp": "cco.all_gather",
    "Communicator": "cco.comm",
    "spawn": "cco.comm",
    "supports": "cco.shapes",
    "RowParallelLinear": "cco.nn",
    "ColumnParallelLinear": "cco.nn",
    "FaultPlan": "cco.transport",
    "Drop": "cco.transport",
    "CommTimeoutError": "cco.transport.protocol",
    "PeerMismatchError": "cco.transport.protocol",
    "PeerRejectedError": "cco.transport.protocol",
    "ArgumentMismatchError": "cco.transport.protocol",
    "SelfTestError": "cco.transport.protocol",
    "preshuffle_b": "cco.preshuffle",
    "unshuffle_b": "cco.preshuffle",
    "random_problem": "cco.quant",
    "reference_gemm": "cco.quant",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'cco' has no attribute {name!r}")
