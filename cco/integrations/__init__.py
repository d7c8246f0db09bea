"""cco's layers inside the frameworks' own tensor-parallel machinery.

- ``cco.integrations.hf``: Hugging Face transformers. The model's own ``tp_plan`` with its row-parallel
  styles swapped for cco's (``tp_plan``), loaded by ``from_pretrained`` (transformers reads each rank's
  shard from the checkpoint), or an already-loaded model parallelized in place (``parallelize``).
  Needs ``transformers`` (pinned in the ``hf`` extra) and ``accelerate``.
- ``cco.integrations.dtensor``: ``torch.distributed.tensor.parallel`` styles for ``parallelize_module``
  (``FusedRowwiseParallel``: the all-reduce, or the reduce-scatter of sequence parallelism;
  ``FusedColwiseParallel``: the all-gather of sequence parallelism), for models parallelized the
  torchtitan way.
- ``cco.integrations.fp8``: fp8 checkpoints as they ship (``Fp8Checkpoint``): the fused layers read their
  K shard's e4m3 bytes and scales from the safetensors files instead of the shard a framework dequantized.
- ``cco.integrations.fused``: what both share: the fused-layer options and the swap of a sharded
  ``nn.Linear`` for ``cco.nn.RowParallelLinear`` or ``cco.nn.ColumnParallelLinear``.

The frameworks shard the weights, load the shards and move DTensors; these modules add only the fused
layer. Nothing in ``cco`` imports this package, so ``cco`` imports without transformers.
"""
