"""torch tensor-parallel styles for ``parallelize_module`` whose GEMM and collective run fused in cco.

    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module
    from cco.integrations.dtensor import FusedColwiseParallel, FusedRowwiseParallel

    # tensor parallel: the row-wise layer's GEMM + all-reduce fused
    parallelize_module(block, tp_mesh, {"w1": ColwiseParallel(), "w3": ColwiseParallel(),
                                        "w2": FusedRowwiseParallel(quant="ptpc", m_max=8192)})
    # sequence parallel: the all-gather + GEMM and the GEMM + reduce-scatter fused, torch's norms
    parallelize_module(block, tp_mesh, {"norm": SequenceParallel(),
                                        "w1": FusedColwiseParallel(input_layouts=Shard(1), m_max=8192),
                                        "w3": FusedColwiseParallel(input_layouts=Shard(1), m_max=8192),
                                        "w2": FusedRowwiseParallel(output_layouts=Shard(1), m_max=8192)})

Each style is torch's own (``ColwiseParallel`` / ``RowwiseParallel``) for an ``nn.Linear`` with a cco
layer in place of ``F.linear`` and the collective torch's output or input step would run. Unfused
equivalents (torch's styles; ``x_r``: this rank's shard as the input layout says)::

    FusedRowwiseParallel()                         y = all_reduce(x_r @ W_r.T) + b       -> Replicate
    FusedRowwiseParallel(output_layouts=Shard(s))  y_r = reduce_scatter_s(x_r @ W_r.T) + b  -> Shard(s)
    FusedColwiseParallel(input_layouts=Shard(s))   y_r = all_gather_s(x_r) @ W_r.T + b_r -> Shard(-1)

torch does the DTensor work as for its own styles: it shards the weight (row-wise ``Shard(1)``, bias
``Replicate``; column-wise weight and bias ``Shard(0)``; from ``src_data_rank``), annotates a plain
input with ``input_layouts`` (a DTensor in another layout is redistributed), and converts the output
to ``output_layouts`` (a no-op where the fused layer already returns that layout) and to a plain
tensor with ``use_local_output`` (the default). Gradients flow to the input (the weight is fp8 and
frozen); the sequence-parallel layers' backward runs the dual collective (``backward="bf16"``: torch
collectives in bf16; ``"fp8"``: the fused dual op, ``cco.nn.sequence``).

The token layout. torch shards ``[batch, seq, hidden]`` activations along ``seq`` (``Shard(1)``); cco's
sequence-parallel layers split the first dimension of the flattened tokens (rank ``r`` holds rows
``r*M/W ..``). The styles move the sequence dimension first (``movedim``, a view) and back after:

- ``batch == 1``, or the sequence dimension already first (``Shard(0)`` on ``[seq, hidden]`` or
  ``[seq, batch, hidden]``): no copy.
- ``batch > 1`` with ``Shard(1)``: the column-wise layer copies its input once into ``[seq, batch,
  K]`` order (the layer flattens it); its output goes back as a strided view of the ``[seq, batch,
  N_r]`` result, and elementwise ops keep that order, so the row-wise layer after it reads its input
  without a copy. The row-wise layer's output is a strided ``[batch, seq/W, N]`` view of its ``[seq/W,
  batch, N]`` result: no copy either. So an MLP costs one copy of its ``[batch, seq/W, hidden]`` input
  per column-wise layer; a row-wise layer whose input is in ``[batch, seq]`` memory order (an
  attention output) copies its ``[batch, seq, K/W]`` input once.

Limits: the sequence length must split evenly over the ranks (torch's uneven ``Shard`` is refused),
``seq * batch`` tokens of one call must fit ``m_max``, and a sequence-parallel call is one fused
call (not split). Every check reads global shapes only, so every rank reaches the same verdict.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from functools import partial

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from cco.integrations.fused import (FusedOptions, check_column_parallel, check_mesh, check_row_parallel,
                                    fuse_column_linear, fuse_linear, run_fused, stands_in_for)

_ROW, _COL = "FusedRowwiseParallel", "FusedColwiseParallel"


def _plan_path(module) -> str | None:
    """``module``'s path in the model given to ``parallelize_module``, or None where that cannot be
    told. torch hands a style's ``_apply`` the module alone; the outermost ``parallelize_module``
    frame on the stack holds the model (its ``module`` argument), whose ``named_modules`` name it.
    Read on the error path, and once per fused module for its calls' errors (a refusal that names
    "Linear" leaves a plan of many to search)."""
    frame, model = sys._getframe(1), None
    while frame is not None:
        if frame.f_code.co_name == "parallelize_module" and isinstance(frame.f_locals.get("module"), torch.nn.Module):
            model = frame.f_locals["module"]
        frame = frame.f_back
    if model is None:
        return None
    return next((name for name, m in model.named_modules() if m is module), None)


def _stands_in_for(layer, module, name: str) -> None:
    """The module's path in the model for the layer's call errors (``run_fused``'s note), read once
    per fused module while ``parallelize_module`` runs (:func:`_plan_path`: the model is on the stack
    only then)."""
    path = _plan_path(module)
    stands_in_for(layer, f"{path!r} ({name})" if path else repr(name))


@contextmanager
def _path_on_error(module):
    """An error of a style's ``_apply`` on ``module`` gets a note with the module's path in the model
    (:func:`_plan_path`), where it can be told."""
    try:
        yield
    except Exception as err:
        path = _plan_path(module)
        if path:  # ("": the model itself, which the error's own words already name)
            err.add_note(f"(the module {path!r} of the model passed to parallelize_module)")
        raise


def _token_dim(layer, placement: Shard, x: DTensor, world: int, fn: str, what: str) -> int:
    """:func:`_sequence_dim`, and where it refuses, this rank's share of the layer's collective call
    taken as a refused one first (the layer's ``_refuse_call``: the op's rejected call, or the unfused
    path's header): ``x``'s global shape is built from this rank's local shape
    (``from_local(run_check=False)``), so one rank's uneven tokens may fail here alone, and its peers
    must fail the same call rather than pair it with this rank's next one."""
    try:
        return _sequence_dim(placement, x, world, fn, what)
    except ValueError as err:
        layer._refuse_call(err)
        raise


def _sequence_dim(placement: Shard, x: DTensor, world: int, fn: str, what: str) -> int:
    """The token dimension ``placement`` shards in ``x``'s global shape, checked (that shape and
    ``world`` only)."""
    d = placement.dim + x.ndim if placement.dim < 0 else placement.dim
    if x.ndim < 2 or not 0 <= d < x.ndim - 1:
        raise ValueError(f"{fn}: {what}={placement!r} on an input of shape {list(x.shape)}: the sharded dimension must "
                         f"be a token dimension (not the features, the last one); use Shard(1) for [batch, seq, "
                         f"hidden] or Shard(0) for [seq, hidden]")
    if x.shape[d] % world:
        raise ValueError(f"{fn}: the sequence dimension {d} of the input {list(x.shape)} has {x.shape[d]} tokens, "
                         f"which does not split evenly over {world} ranks (cco's layers keep tokens/world per rank, "
                         f"torch's Shard would not); pad the sequence to {-(-x.shape[d] // world) * world}")
    return d


def _features_local(x):
    """This rank's slice of the features of ``x``: torch's input step annotates a plain tensor with
    ``input_layouts`` but passes a DTensor on as it is, so one in another layout (``Replicate``, a
    token ``Shard``) is redistributed here to ``Shard(-1)``, as torch's own row-wise style computes it."""
    if not isinstance(x, DTensor):
        return x
    if x.placements != (Shard(x.ndim - 1),) and x.placements != (Shard(-1),):
        x = x.redistribute(placements=[Shard(x.ndim - 1)])
    return x.to_local()


def _row_forward(layer, mesh, x):
    """The swapped module's forward: ``x`` this rank's K slice (:func:`_features_local`)."""
    return DTensor.from_local(run_fused(layer, _features_local(x)), mesh, [Replicate()], run_check=False)


def _row_sp_forward(layer, mesh, placement, x):
    """Row-wise into a sequence-sharded output: ``x`` a DTensor with every token (its K slice here)."""
    d = _token_dim(layer, placement, x, mesh.size(), _ROW, "output_layouts")
    x_local = _features_local(x).movedim(d, 0)  # tokens first: the layer reduce-scatters its first dimension
    y = run_fused(layer, x_local).movedim(0, d)  # this rank's tokens, back in the caller's order (a view)
    return DTensor.from_local(y, mesh, [Shard(d)], run_check=False)


def _col_sp_forward(layer, mesh, placement, x):
    """Column-wise from a sequence-sharded input: ``x`` is this rank's tokens (torch's input step
    annotated a plain tensor; a DTensor in another layout is redistributed here, as torch's does)."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [placement], run_check=False)
    d = _token_dim(layer, placement, x, mesh.size(), _COL, "input_layouts")
    if x.placements != (Shard(d),):
        x = x.redistribute(placements=[Shard(d)])
    y = run_fused(layer, x.to_local().movedim(d, 0)).movedim(0, d)  # every rank's tokens, this rank's N slice
    return DTensor.from_local(y, mesh, [Shard(y.ndim - 1)], run_check=False)


class FusedRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for ``nn.Linear`` with the GEMM and its collective fused: the all-reduce
    (``output_layouts=Replicate()``, the default; ``cco.nn.RowParallelLinear``) or, with
    ``output_layouts=Shard(s)`` (sequence parallelism), the reduce-scatter along the token dimension
    ``s`` (``RowParallelLinear(sequence_parallel=True)``).

    Keyword arguments: ``quant``, ``m_max`` and the rest of :class:`cco.integrations.fused.FusedOptions`;
    ``input_layouts``, ``output_layouts`` and ``use_local_output`` as torch's style. Applying it is
    collective over the mesh (the fused layer's constructor), as ``parallelize_module`` is.
    """

    def __init__(self, *, quant: str = "ptpc", m_max: int = 4096, input_layouts=None, output_layouts=None,
                 use_local_output: bool = True, **options):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        out = self.output_layouts[0]
        if not (out.is_replicate() or (isinstance(out, Shard) and out.dim != -1)):
            raise ValueError(f"{_ROW}: output_layouts={output_layouts!r} is not fused here; pass Replicate() (the "
                             f"all-reduce) or Shard(s) along a token dimension (the reduce-scatter of sequence "
                             f"parallelism, e.g. Shard(1) for [batch, seq, hidden]); a scatter along the features "
                             f"needs torch's RowwiseParallel")
        self.sequence_parallel = isinstance(out, Shard)
        self.options = FusedOptions(quant=quant, m_max=m_max, **options)

    def _apply(self, module, device_mesh):
        name = f"{type(module).__name__} under {_ROW}"
        with _path_on_error(module):
            world = check_mesh(device_mesh, _ROW)
            check_row_parallel(module, name=name, world=world, fn=_ROW, keep="RowwiseParallel")  # before torch shards
            # torch: shards W (Shard(1)) and b, installs the input/output steps
            module = super()._apply(module, device_mesh)
            layer = fuse_linear(module, group=device_mesh.get_group(), world=world, options=self.options, name=name,
                                fn=_ROW, sequence_parallel=self.sequence_parallel)
            _stands_in_for(layer, module, name)
        if self.sequence_parallel:
            module.forward = partial(_row_sp_forward, layer, device_mesh, self.output_layouts[0])
        else:
            module.forward = partial(_row_forward, layer, device_mesh)
        return module

    def __repr__(self):
        return (f"{_ROW}({self.options.tag()}, input_layouts={self.input_layouts}, output_layouts="
                f"{self.output_layouts}, use_local_output={self.use_local_output})")


class FusedColwiseParallel(ColwiseParallel):
    """``ColwiseParallel(input_layouts=Shard(s))`` for ``nn.Linear`` (sequence parallelism: the input
    is this rank's tokens along dimension ``s``) with the all-gather along tokens fused with the GEMM
    (``cco.nn.ColumnParallelLinear(sequence_parallel=True)``). The output is every rank's tokens,
    this rank's output features (``Shard(-1)``), converted to ``output_layouts`` by torch's step.

    A replicated input (torch's default) needs no collective before the GEMM: nothing to fuse, keep
    torch's ``ColwiseParallel`` there. Keyword arguments as :class:`FusedRowwiseParallel`.
    """

    def __init__(self, *, quant: str = "ptpc", m_max: int = 4096, input_layouts=None, output_layouts=None,
                 use_local_output: bool = True, **options):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        inp = self.input_layouts[0]
        if not isinstance(inp, Shard) or inp.dim == -1:
            raise ValueError(f"{_COL}: input_layouts={input_layouts!r} is not fused here; this style starts with the "
                             f"all-gather of a sequence-sharded input: pass Shard(s) along a token dimension (Shard(1) "
                             f"for [batch, seq, hidden]). A replicated input needs no collective: use torch's "
                             f"ColwiseParallel")
        # torch's input step only annotates the input: the fused layer gathers it (torch's would redistribute
        # to Replicate here, an all-gather of its own)
        self.desired_input_layouts = self.input_layouts
        self.options = FusedOptions(quant=quant, m_max=m_max, **options)

    def _apply(self, module, device_mesh):
        name = f"{type(module).__name__} under {_COL}"
        with _path_on_error(module):
            world = check_mesh(device_mesh, _COL)
            check_column_parallel(module, name=name, world=world, fn=_COL)  # before torch shards anything
            # torch: shards W and b (Shard(0)), installs the input/output steps
            module = super()._apply(module, device_mesh)
            layer = fuse_column_linear(module, group=device_mesh.get_group(), world=world, options=self.options,
                                       name=name, fn=_COL)
            _stands_in_for(layer, module, name)
        module.forward = partial(_col_sp_forward, layer, device_mesh, self.input_layouts[0])
        return module

    def __repr__(self):
        return (f"{_COL}({self.options.tag()}, input_layouts={self.input_layouts}, output_layouts="
                f"{self.output_layouts}, use_local_output={self.use_local_output})")
