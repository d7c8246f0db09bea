"""torch tensor-parallel styles for ``parallelize_module`` whose GEMM and collective run fused in cco.

    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from cco.integrations.dtensor import FusedRowwiseParallel

    parallelize_module(block, tp_mesh, {"w1": ColwiseParallel(), "w3": ColwiseParallel(),
                                        "w2": FusedRowwiseParallel(quant="ptpc", m_max=8192)})

``FusedRowwiseParallel`` is torch's ``RowwiseParallel`` for an ``nn.Linear`` with the fused layer in
place of ``F.linear`` + the output redistribution. Unfused equivalent (torch's own style)::

    y = all_reduce(x_r @ W_r.T) + b       # RowwiseParallel: Partial output -> Replicate, bias added once

torch does the DTensor work as it does for its own style: it shards the weight (``Shard(1)``, from
``src_data_rank``; bias ``Replicate``) and turns the input into a ``Shard(-1)`` DTensor (a plain tensor
is annotated with ``input_layouts``, a DTensor redistributed). The fused layer takes this rank's local
slice and returns the reduced output, which leaves as a ``Replicate`` DTensor, so torch's output step
has nothing left to reduce: with ``use_local_output`` (the default) the caller gets a plain tensor,
else the DTensor. Gradients flow to the input (the row-parallel backward needs no communication); the
weight is fp8 and frozen.

Only ``output_layouts=Replicate()`` (the all-reduce) is fused here; the sequence-parallel output
(``Shard(1)``, a reduce-scatter along tokens) needs the reduce-scatter layer and gets its own style.
"""

from __future__ import annotations

from functools import partial

from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import RowwiseParallel

from cco.integrations.fused import FusedOptions, check_row_parallel, fuse_linear, run_fused

_FN = "FusedRowwiseParallel"


def _forward(layer, mesh, x):
    """The swapped module's forward: torch's input step gave a ``Shard(-1)`` DTensor."""
    x_local = x.to_local() if isinstance(x, DTensor) else x
    return DTensor.from_local(run_fused(layer, x_local), mesh, [Replicate()], run_check=False)


class FusedRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for ``nn.Linear`` with the GEMM and the all-reduce fused (``cco.nn.RowParallelLinear``).

    Keyword arguments: ``quant``, ``m_max`` and the rest of :class:`cco.integrations.fused.FusedOptions`;
    ``input_layouts`` and ``use_local_output`` as torch's style. Applying it is collective over the
    mesh (the fused layer's constructor), as ``parallelize_module`` is.
    """

    def __init__(self, *, quant: str = "ptpc", m_max: int = 4096, input_layouts=None, output_layouts=None,
                 use_local_output: bool = True, **options):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        if self.output_layouts != (Replicate(),):
            raise ValueError(f"{_FN}: output_layouts={output_layouts!r} is not fused here; this style ends in an "
                             f"all-reduce (Replicate). Sequence parallelism (a reduce-scatter along tokens) needs its "
                             f"own style; use torch's RowwiseParallel(output_layouts=Shard(1)) meanwhile")
        self.options = FusedOptions(quant=quant, m_max=m_max, **options)

    def _apply(self, module, device_mesh):
        name = f"{type(module).__name__} under {_FN}"
        if device_mesh.ndim != 1:
            raise ValueError(f"{_FN}: the mesh has {device_mesh.ndim} dimensions; pass the 1-D tensor-parallel "
                             f"sub-mesh (e.g. mesh['tp'])")
        world = device_mesh.size()
        check_row_parallel(module, name=name, world=world, fn=_FN)  # before torch shards anything
        module = super()._apply(module, device_mesh)  # torch: shards W (Shard(1)) and b, installs the input/output steps
        layer = fuse_linear(module, group=device_mesh.get_group(), world=world, options=self.options, name=name,
                            fn=_FN)
        module.forward = partial(_forward, layer, device_mesh)
        return module

    def __repr__(self):
        return f"{_FN}({self.options.tag()}, input_layouts={self.input_layouts}, use_local_output={self.use_local_output})"
