"""The swap both integrations share: a row-parallel ``nn.Linear`` whose weight a framework has sharded
(a DTensor ``Shard(-1)`` on a 1-D mesh) becomes a :class:`cco.nn.RowParallelLinear` (``fuse_linear``;
with ``sequence_parallel=True`` its reduce ends in a reduce-scatter along tokens), and a
column-parallel one (weight and bias ``Shard(0)``) a sequence-parallel
:class:`cco.nn.ColumnParallelLinear` (``fuse_column_linear``: the all-gather of its tokens fused).

Unfused equivalent, what the framework's own row-wise style computes on every rank ``r``::

    y = all_reduce(x_r @ W_r.T) + b          # x_r: this rank's K slice; b, replicated, added once

The fused layer computes the same with ``x_r`` and ``W_r`` in fp8 (``FusedOptions.quant``) and the GEMM
fused with the all-reduce; its output is already reduced, so the framework's own reduce must not run
again. The framework has already loaded this rank's shard into ``weight`` (transformers from the
checkpoint, torch by ``distribute_tensor``); the swap quantizes that shard once, keeps the bias for
after the reduce, and drops the bf16 weight (the fp8 copy in the fused layer is the one the forward
reads; save a checkpoint before fusing, not after).

Contracts: building the fused layer is collective over the mesh's group (``RowParallelLinear``'s
constructor agrees on one verdict), so every rank swaps the same modules in the same order. The checks
here read only the module's global shape and the mesh size, the same on every rank: a refused module
is refused by every rank before any collective starts.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch.distributed.tensor import DTensor, Shard

from cco import quant as Q
from cco.nn import DEFAULT_POOL, ColumnParallelLinear, RowParallelLinear
from cco.nn import checkpoint as C
from cco.nn.linear import MODES
from cco.nn.parallel_linear import check_op_options
from cco.nn.sequence import check_backward
from cco.op import DEFAULT_DEADLINE_S

FUSED_CHILD = "fused"  # the child of a swapped nn.Linear that holds its RowParallelLinear


@dataclasses.dataclass(frozen=True)
class FusedOptions:
    """How the fused layers of a plan are built (``cco.nn.RowParallelLinear``'s options).

    quant: "ptpc" | "blockscale" | "mxfp8". m_max: tokens one fused call takes (sizes the window the
    layers of one shape share; longer calls run in pieces). mode: "fused" | "split" | "unfused".
    transport, gather_dtype, chunks, deadline_s: the op's (``cco.op.GemmAllReduceOp``).
    backward: the sequence-parallel layers' backward collective, "bf16" | "fp8" (``cco.nn.sequence``).
    """

    quant: str = "ptpc"
    m_max: int = 4096
    mode: str = "fused"
    transport: str | None = None
    gather_dtype: str = "bf16"
    chunks: int | tuple | None = None
    deadline_s: float = DEFAULT_DEADLINE_S
    backward: str = "bf16"

    def __post_init__(self):
        fn = "FusedOptions"
        Q.check_quant(self.quant, fn=fn)
        check_backward(self.backward, fn)
        if not isinstance(self.m_max, int) or isinstance(self.m_max, bool) or self.m_max < 1:
            raise ValueError(f"{fn}: m_max={self.m_max!r} must be a positive int (tokens one fused call takes)")
        if self.mode not in MODES:
            raise ValueError(f"{fn}: mode={self.mode!r} is not supported; pass one of {', '.join(MODES)}")
        if isinstance(self.chunks, list):  # a plan's options must hash: relative chunk sizes as a tuple
            object.__setattr__(self, "chunks", tuple(self.chunks))
        # here, not when the plan's first layer is built (after a checkpoint's every shard has loaded)
        check_op_options(fn, transport=self.transport, gather_dtype=self.gather_dtype, chunks=self.chunks,
                         deadline_s=self.deadline_s)

    def layer_kwargs(self) -> dict:
        return dataclasses.asdict(self)

    def row_kwargs(self, *, sequence_parallel: bool) -> dict:
        """The options ``RowParallelLinear`` takes: gather_dtype without sequence parallelism (the
        reduce-scatter gathers nothing), backward with it (the all-reduce's backward runs no
        collective); the layer refuses the other one set, so one options object serves both styles."""
        drop = "gather_dtype" if sequence_parallel else "backward"
        return {k: v for k, v in self.layer_kwargs().items() if k != drop}

    def column_kwargs(self) -> dict:
        """The options ``ColumnParallelLinear`` takes (it gathers the input in fp8: no gather_dtype)."""
        return {k: v for k, v in self.layer_kwargs().items() if k != "gather_dtype"}

    def tag(self) -> str:
        """A stable text of the options that differ from the defaults, quant and m_max always: the
        suffix of a registered style's name, the same on every rank for the same options."""
        default = FusedOptions()
        items = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                 if f.name in ("quant", "m_max") or getattr(self, f.name) != getattr(default, f.name)]
        return ",".join(items).replace(" ", "")


def _check_linear(module, *, name: str, world: int, fn: str, split: str, what: str, keep: str) -> None:
    """Refuse a module the fused layer cannot stand in for, naming it and the fix: not an
    ``nn.Linear``, or its ``split`` dimension ("in_features": K, "out_features": N) does not divide
    over ``world``. Reads only global shapes and ``world``: every rank reaches the same verdict."""
    if not isinstance(module, torch.nn.Linear):
        raise TypeError(f"{fn}: {name!r} is a {type(module).__name__}, not a torch.nn.Linear; the fused {what} style "
                        f"replaces a Linear's GEMM and its collective. Keep the framework's own style for this "
                        f"module (e.g. {keep}), or name a Linear in the plan")
    size = getattr(module, split)
    if size % world:
        raise ValueError(f"{fn}: {name!r} has {split}={size}, which does not split evenly over {world} ranks (every "
                         f"rank's {'K' if split == 'in_features' else 'N'} slice must be the same size); use a "
                         f"tensor-parallel size that divides {size}, or keep the framework's own style for this module")


def check_mesh(mesh, fn: str) -> int:
    """The tensor-parallel size of ``mesh``, a 1-D ``DeviceMesh`` (a process group or a 2-D mesh are
    refused, naming how to get one)."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{fn}: the mesh must be a 1-D torch DeviceMesh, got a {type(mesh).__name__}; build one with "
                        f"torch.distributed.device_mesh.init_device_mesh(device_type, (tp_size,)), or from a process "
                        f"group with DeviceMesh.from_group(group, device_type)")
    if mesh.ndim != 1:
        raise ValueError(f"{fn}: the mesh has {mesh.ndim} dimensions; pass the 1-D tensor-parallel sub-mesh (e.g. "
                         f"mesh['tp'])")
    return mesh.size()


def check_row_parallel(module, *, name: str, world: int, fn: str, keep: str = "'rowwise'") -> None:
    """:func:`_check_linear` for the row-parallel layer (K split over the ranks); ``keep``: the
    framework's own style to name (transformers' "rowwise", torch's ``RowwiseParallel``)."""
    _check_linear(module, name=name, world=world, fn=fn, split="in_features", what="row-parallel", keep=keep)


def check_column_parallel(module, *, name: str, world: int, fn: str) -> None:
    """:func:`_check_linear` for the column-parallel layer (N split over the ranks)."""
    _check_linear(module, name=name, world=world, fn=fn, split="out_features", what="column-parallel",
                  keep="ColwiseParallel")


def fused_layer(module) -> RowParallelLinear | ColumnParallelLinear | None:
    """The fused layer a swapped module holds, or None."""
    layer = module._modules.get(FUSED_CHILD)
    return layer if isinstance(layer, (RowParallelLinear, ColumnParallelLinear)) else None


def _local_weight(weight, *, name: str, world: int, fn: str) -> torch.Tensor:
    if not isinstance(weight, DTensor):
        raise TypeError(f"{fn}: {name}.weight is a plain {type(weight).__name__}; the framework's tensor-parallel "
                        f"style must shard it first (a DTensor Shard(-1)): apply the style through "
                        f"parallelize_module or a transformers tp_plan rather than calling this directly")
    placements = tuple(weight.placements)
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim not in (1, -1):
        raise ValueError(f"{fn}: {name}.weight has placements {placements}; the fused row-parallel layer takes a "
                         f"weight sharded along its input features (Shard(-1)) on a 1-D mesh")
    local = weight.to_local()
    if tuple(local.shape) != (weight.shape[0], weight.shape[1] // world):
        raise ValueError(f"{fn}: {name}.weight's local shard is {list(local.shape)}, expected "
                         f"[{weight.shape[0]}, {weight.shape[1] // world}] for {world} ranks")
    return local


def _local_bias(bias, *, name: str, fn: str):
    if bias is None:
        return None
    if isinstance(bias, DTensor):
        if not all(p.is_replicate() for p in bias.placements):
            raise ValueError(f"{fn}: {name}.bias has placements {tuple(bias.placements)}; a row-parallel bias is "
                             f"replicated (added once, after the reduce)")
        return bias.to_local()
    return bias


@torch.no_grad()
def fuse_linear(module: torch.nn.Linear, *, group, world: int, options: FusedOptions, name: str,
                fn: str = "fuse_linear", fp8_shard=None, sequence_parallel: bool = False) -> RowParallelLinear:
    """Swap ``module``'s sharded GEMM + all-reduce for a fused :class:`RowParallelLinear` (held as the
    child ``fused``); idempotent. Collective over ``group`` (every rank, same modules, same order).
    ``sequence_parallel``: the layer ends in a reduce-scatter along its output's first dimension
    instead of the all-reduce.

    ``fp8_shard``: None (quantize the framework's float shard), or a callable taking this rank's K
    width and returning this rank's shard of the checkpoint's fp8 weight (``Fp8Weight``, in the
    options' quant) or None where the checkpoint stores this weight as floats. The fp8 shard is
    loaded as stored (``load_fp8``) after it is checked against the shard the framework loaded from
    the same checkpoint; the group agrees on the verdict first, so a rank that cannot read its shard
    makes every rank raise.

    A module that holds its weight in fp8 (transformers' ``FP8Linear`` on GPUs with fp8,
    compressed-tensors' compressed Linear: an e4m3 ``weight`` with ``weight_scale_inv`` or
    ``weight_scale`` beside it) gives the layer its own bytes and scales (:func:`held_fp8_shard`),
    converted to the options' quant where that is exact (:func:`convert_held_fp8`); with
    ``fp8_shard`` as well, both must be the same bytes and scales. Never quantized again."""
    done = fused_layer(module)
    if done is not None:
        return done
    fp8 = None
    if fp8_shard is None and not holds_fp8(module):
        check_row_parallel(module, name=name, world=world, fn=fn)
        w = _local_weight(module.weight, name=name, world=world, fn=fn)
    else:  # every rank reads its shard, then the group agrees on one verdict before anything collective
        # (the checks read this rank's bytes and scales: one rank's may fail where its peer's pass)
        error, source = None, None
        try:
            check_row_parallel(module, name=name, world=world, fn=fn)
            w = _local_weight(module.weight, name=name, world=world, fn=fn)
            held = held_fp8_shard(module, w, name=name, world=world, fn=fn)
            stored = fp8_shard(w.shape[1]) if fp8_shard is not None else None
            # the format, known from shapes, dtypes and keys alike on every rank, is set before the checks
            # of values (which may fail on one rank only): the agreement compares it, and a rank whose
            # check fails passes the same arguments as its peers, so its own error reaches them
            source = (held or stored).source if held is not None or stored is not None else None
            if held is not None:
                held = convert_held_fp8(held, options.quant, name=name, fn=fn)
                if stored is not None:
                    check_same_fp8(held, stored, name=name, fn=fn)
            elif stored is not None:
                check_fp8_shard(stored, w, name=name, fn=fn)
            fp8 = held if held is not None else stored
        except (TypeError, ValueError, OSError) as err:
            error = err
        DEFAULT_POOL.communicator(group).agree(fn, {"module": name, "fp8": source}, error=error)
    b = _local_bias(module.bias, name=name, fn=fn)
    layer = RowParallelLinear(w.shape[1], module.out_features, group=group, bias=b is not None,
                              sequence_parallel=sequence_parallel,
                              **options.row_kwargs(sequence_parallel=sequence_parallel))
    if fp8 is not None:
        layer.load_fp8(fp8.qweight, fp8.scale)  # the checkpoint's bytes and scales, as stored
    else:
        layer.load_weight(w)
    if b is not None:
        layer.bias.copy_(b)
    _hold(module, layer, name)
    for pname in (*SCALE_PARAMS, *ACTIVATION_SCALE_PARAMS):
        if module._parameters.get(pname) is not None:
            module._parameters[pname] = None
    return layer


def _hold(module, layer, name: str) -> None:
    """``layer`` becomes ``module``'s child ``fused`` and its weight from now on: the framework's
    shard and bias are dropped (they would only hold memory), and so is the module's place in a
    framework checkpoint (:func:`_refuse_state_dict`)."""
    module.add_module(FUSED_CHILD, layer)
    stands_in_for(layer, repr(name))
    module.weight = None
    module.bias = None
    module.register_state_dict_pre_hook(functools.partial(_refuse_state_dict, name=name))


def _refuse_state_dict(module, prefix, keep_vars, *, name: str) -> None:
    """A fused module in a state_dict would save this rank's fp8 shard under ``<name>.fused.*`` in
    place of ``<name>.weight``: a checkpoint no framework loads (``save_pretrained`` writes rank 0's
    shard alone, and a reload initializes the weight afresh). Refused, on every rank alike."""
    path = prefix[:-1]  # the module's name in the state_dict asked for
    raise RuntimeError(
        f"{path or name}: fused by cco (its weight is now this rank's fp8 shard in the child "
        f"'{prefix}{FUSED_CHILD}'), so a state_dict of the model (save_pretrained, torch.distributed.checkpoint) "
        f"would hold per-rank fp8 shards in place of '{prefix}weight', which the framework cannot load. Save "
        f"the model before fusing (before cco's fuse / parallelize / parallelize_module, or the first forward of "
        f"a tp_plan model); the fused layer's own per-rank state is "
        f"model.get_submodule({path!r}).{FUSED_CHILD}.state_dict()")


@torch.no_grad()
def fuse_column_linear(module: torch.nn.Linear, *, group, world: int, options: FusedOptions, name: str,
                       fn: str = "fuse_column_linear") -> ColumnParallelLinear:
    """Swap a column-parallel ``module`` (weight and bias sharded by the framework as ``Shard(0)``
    DTensors on a 1-D mesh) for a :class:`ColumnParallelLinear` with ``sequence_parallel=True`` (the
    all-gather of the input along tokens fused with the GEMM), held as the child ``fused``;
    idempotent. Collective over ``group``. The bf16 shard is dropped as in :func:`fuse_linear`."""
    done = fused_layer(module)
    if done is not None:
        return done
    check_column_parallel(module, name=name, world=world, fn=fn)
    weight, bias = module.weight, module.bias
    for pname, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if not isinstance(p, DTensor):
            raise TypeError(f"{fn}: {name}.{pname} is a plain {type(p).__name__}; the framework's column-parallel "
                            f"style must shard it first (a DTensor Shard(0)): apply the style through "
                            f"parallelize_module rather than calling this directly")
        if tuple(p.placements) != (Shard(0),):
            raise ValueError(f"{fn}: {name}.{pname} has placements {tuple(p.placements)}; the fused column-parallel "
                             f"layer takes it sharded along the output features (Shard(0)) on a 1-D mesh")
    w = weight.to_local()
    if tuple(w.shape) != (module.out_features // world, module.in_features):
        raise ValueError(f"{fn}: {name}.weight's local shard is {list(w.shape)}, expected "
                         f"[{module.out_features // world}, {module.in_features}] for {world} ranks")
    layer = ColumnParallelLinear(module.in_features, w.shape[0], group=group, bias=bias is not None,
                                 sequence_parallel=True, **options.column_kwargs())
    layer.load_weight(w)
    if bias is not None:
        layer.bias.copy_(bias.to_local())
    _hold(module, layer, name)
    return layer


# the framework's dequantized bf16 shard against the checkpoint's fp8 shard: equal up to one bf16 rounding
# (2**-9 relative per element) wherever both read the same columns of the same key
FP8_SHARD_MATCH_TOL = 1e-2


# the scale parameter a framework's fp8 Linear keeps beside its e4m3 weight: transformers' FP8Linear
# (weight_scale_inv), compressed-tensors' quantized Linear (weight_scale)
SCALE_PARAMS = ("weight_scale_inv", "weight_scale")
# static activation scales of those modules: not read (the fused layer quantizes its activations per call)
ACTIVATION_SCALE_PARAMS = ("activation_scale", "input_scale")


def holds_fp8(module) -> bool:
    """Whether ``module``'s weight is stored in one byte per element (fp8, or packed values the
    checks refuse), as a framework's fp8 Linear keeps it, rather than in a float dtype."""
    weight = module._parameters.get("weight")
    return weight is not None and weight.element_size() == 1


def _local_scale(scale, *, per_rank: int | None, rank: int) -> torch.Tensor:
    """This rank's part of a scale parameter: its DTensor shard, or, where the framework left it
    whole (replicated, or a plain tensor), the ``per_rank`` block columns of this rank's K shard
    (``per_rank`` None: a per-tensor or per-row scale, which covers every column)."""
    if isinstance(scale, DTensor):
        if not all(p.is_replicate() for p in scale.placements):
            return scale.to_local()
        scale = scale.to_local()
    if per_rank is None or scale.shape[-1] == per_rank:
        return scale
    return scale[..., rank * per_rank:(rank + 1) * per_rank]


def held_fp8_shard(module, local: torch.Tensor, *, name: str, world: int, fn: str) -> C.Fp8Weight | None:
    """This rank's K shard of the fp8 weight ``module`` holds (``local``: its weight's shard, e4m3),
    with the scale beside it, as stored (:func:`convert_held_fp8` converts it); None where the
    weight is a float one. The framework sharded both along K; the shard must be whole scale blocks
    (128 for block scales, 32 for mxfp8 groups) or it cut one, which the framework's own kernel
    would read wrongly too. Raises ValueError naming the module and the fix. Its verdict depends only
    on global shapes, dtypes and ``world``: the same on every rank."""
    if not holds_fp8(module):
        return None
    found = [p for p in SCALE_PARAMS if module._parameters.get(p) is not None]
    if local.dtype != Q.FP8 or len(found) != 1:
        what = (f"dtype {local.dtype}" if local.dtype != Q.FP8 else
                f"{'no' if not found else 'several'} scale parameters ({', '.join(found) or ', '.join(SCALE_PARAMS)})")
        raise ValueError(f"{fn}: {name} ({type(module).__name__}) holds a one-byte weight with {what}; the fused layer "
                         f"takes a float8_e4m3fn weight with one scale ({' or '.join(SCALE_PARAMS)}). Load the model "
                         f"dequantized (its quantization config's dequantize=True) or keep the framework's own style")
    key = found[0]
    scale = module._parameters[key]
    k = module.weight.shape[1]  # global
    k_local = local.shape[1]
    blocks = scale.shape[-1] if scale.dim() == 2 and scale.shape[-1] > 1 else 0  # scale columns along K
    block = {-(-k // Q.SCALE_BLOCK): Q.SCALE_BLOCK, -(-k // Q.MX_GROUP): Q.MX_GROUP}.get(blocks) if blocks else None
    if block is not None and k_local % block:
        raise ValueError(f"{fn}: {name}.weight has K={k}; the framework splits it into {world} shards of {k_local} "
                         f"columns, which cut its scale blocks of {block} ({key} {list(scale.shape)}). Use a "
                         f"tensor-parallel size whose K shard is a multiple of {block}, or keep the framework's own "
                         f"style for this module")
    weight = module.weight
    rank = weight.device_mesh.get_local_rank() if isinstance(weight, DTensor) else 0
    s = _local_scale(scale, per_rank=None if block is None else k_local // block, rank=rank)
    return C.read_fp8_weight({f"{name}.weight": local.detach().cpu(), f"{name}.{key}": s.detach().cpu()},
                             f"{name}.weight")


def convert_held_fp8(w: C.Fp8Weight, quant: str, *, name: str, fn: str) -> C.Fp8Weight:
    """``w`` in ``quant``'s scales where that is exact (``convert_fp8_weight``), else a ValueError
    naming the quant to plan with. Reads the scales' values: the verdict may differ by rank."""
    try:
        return C.convert_fp8_weight(w, quant)
    except ValueError as err:
        raise ValueError(f"{fn}: {name} holds a {w.source} fp8 weight ({w.quant} scales) and the fused layers were "
                         f"planned with quant={quant!r} ({err}); plan them with quant={w.quant!r}") from None


def check_same_fp8(held: C.Fp8Weight, stored: C.Fp8Weight, *, name: str, fn: str) -> None:
    """Refuse a checkpoint shard that is not the fp8 weight the framework loaded into the module:
    the same e4m3 bytes and the same scales, both in the layer's quant."""
    same = held.shape == stored.shape and held.scale.shape == stored.scale.shape and torch.equal(
        held.qweight.view(torch.uint8), stored.qweight.view(torch.uint8).to(held.qweight.device))
    if same:
        a, b = held.scale, stored.scale.to(held.scale.device)
        same = torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == Q.E8M0 else torch.equal(a, b)
    if not same:
        raise ValueError(f"{fn}: {name}: this rank's shard of the checkpoint's fp8 weight differs from the fp8 weight "
                         f"and scales the framework loaded ({held.source}); load the checkpoint the model was loaded "
                         f"from")


def check_fp8_shard(fp8: C.Fp8Weight, local: torch.Tensor, *, name: str, fn: str) -> None:
    """Refuse an fp8 shard that is not the weight the framework loaded for ``name`` (another key,
    other columns, a scale from the wrong block): the framework's float shard is its dequantization.
    (A module that holds fp8 is checked byte for byte instead: :func:`check_same_fp8`.)"""
    if tuple(fp8.shape) != tuple(local.shape):
        raise ValueError(f"{fn}: {name}: the checkpoint's fp8 shard is {list(fp8.shape)} but the framework's shard "
                         f"is {list(local.shape)}")
    if local.dtype.is_floating_point and local.element_size() > 1:
        ours, theirs = C.dequantize(fp8), local.float().cpu()
        err = ((ours - theirs).norm() / theirs.norm().clamp_min(1e-30)).item()
        if not err <= FP8_SHARD_MATCH_TOL:
            raise ValueError(f"{fn}: {name}: this rank's shard of the checkpoint's fp8 weight differs from the weight "
                             f"the framework loaded (rel. L2 {err:.2e} > {FP8_SHARD_MATCH_TOL}): not the same key or "
                             f"not the same columns; load the checkpoint the model was loaded from")


def run_fused(layer: RowParallelLinear, x_local: torch.Tensor) -> torch.Tensor:
    """The fused layer on this rank's K slice; the output (reduced, the same on every rank) in the
    input's dtype, as the Linear it stands in for returns it. An error of the call gets a note naming
    the module the layer stands in for (:func:`stands_in_for`): raised tens of frames inside a
    framework's forward, the layer's own words name only the layer."""
    try:
        y = layer(x_local)
    except Exception as err:
        where = layer.__dict__.get(_STANDS_IN_FOR)
        if where:
            err.add_note(f"(raised by the cco layer that stands in for {where}; its options, m_max={layer.m_max} "
                         f"among them, are the plan's style's)")
        raise
    return y if y.dtype == x_local.dtype else y.to(x_local.dtype)


_STANDS_IN_FOR = "_cco_stands_in_for"  # the fused layer's attribute: which module of the model it replaced


def stands_in_for(layer, what: str) -> None:
    """Record ``what`` (the module's path in the model, or what is known of it) on ``layer`` for
    :func:`run_fused`'s note."""
    layer.__dict__[_STANDS_IN_FOR] = what
