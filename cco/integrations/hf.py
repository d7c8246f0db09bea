"""Hugging Face transformers: a model's own tensor-parallel plan with its row-parallel layers fused.

Loading a checkpoint (transformers reads each rank's shard; every rank runs these lines)::

    from transformers import AutoModelForCausalLM, DistributedConfig
    from cco.integrations import hf as cco_hf

    plan = cco_hf.tp_plan(path, quant="ptpc", m_max=4096)        # the model's plan, "rowwise" -> cco
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                 distributed_config=DistributedConfig(tp_plan=plan))
    cco_hf.fuse(model)     # swap in the fused layers now (else the first forward does) and check
                           # the model was sharded (a rank that loaded it whole raises here)

A model already loaded whole on every rank, parallelized in place::

    cco_hf.parallelize(model, quant="ptpc", m_max=4096)

What transformers does, as with its own plan: builds the device mesh, shards every planned parameter
as a DTensor placeholder (``q/k/v``, ``gate/up`` column-wise; ``o_proj``/``down_proj`` row-wise), loads
each rank's shard from the safetensors checkpoint, and runs the column-parallel layers. What cco adds:
one style per set of options, registered in transformers' ``ALL_PARALLEL_STYLES`` (``FusedRowwise``),
that shards and loads exactly as transformers' ``RowwiseParallel`` (weight ``Shard(-1)``, bias
replicated) and replaces the module's forward. Unfused equivalent (transformers' "rowwise")::

    y = all_reduce(x_r @ W_r.T) + b               # x_r: this rank's slice, from the colwise layers

fused (``cco.nn.RowParallelLinear``: fp8 GEMM + all-reduce in one op, the bias added once after it).

``tp_plan`` converts the styles of ``FUSED_STYLES`` ("rowwise") where they name an ``nn.Linear``; every
other entry stays transformers' own. Families (transformers 5.17 plans):

- Llama, Mistral, Qwen2 (q/k/v bias: column-wise, untouched), Qwen3, Gemma3, Olmo, Starcoder2:
  ``o_proj`` and ``down_proj`` (``c_proj``) fused; a row-parallel bias (Llama's ``attention_bias`` /
  ``mlp_bias``) is added once, after the reduce.
- DeepSeek-V2-style MLA (``q_b_proj``/``kv_b_proj`` column-wise, ``kv_a_proj_with_mqa`` as
  transformers' ``mla_kv_a_proj``): ``o_proj``, the dense MLPs' and the shared experts' ``down_proj``
  fused. Routed experts (``mlp.experts.down_proj``, a 3-D parameter under ``moe_tp_experts``) are not
  Linears: they stay transformers' (no fused grouped GEMM here). DeepSeek-V3's 5.17 plan shards no
  attention, so only its MLPs are fused. Mixtral: ``o_proj`` only (all MLPs are experts).
- Phi-3 ("rowwise_split_input" after a gathered packed qkv): not converted; its plan replicates the
  row-parallel input, so a fused all-reduce would follow an all-gather that a column-parallel plan avoids.
- Sequence-parallel styles (reduce-scatter / all-gather along tokens): transformers 5.17 has no
  sequence-parallel plan for them to join (no model declares one; its registry has no sequence-sharded
  column-wise or row-wise entry): use the torch styles of ``cco.integrations.dtensor``.
  ``FUSED_STYLES`` is where they go once it has (docs/frameworks.md, "Sequence parallelism").

fp8 checkpoints: ``tp_plan(path)`` of a local folder whose config has an fp8 ``quantization_config``
(transformers' ``fp8``, compressed-tensors 8-bit float) takes the checkpoint's quant, and its fused
layers load their K shard's e4m3 bytes and scales from the files as stored
(:class:`cco.integrations.fp8.Fp8Checkpoint`), not the bf16 shard transformers dequantized (on CPU
ranks transformers 5.17 dequantizes the whole checkpoint). Where transformers keeps the weights in fp8
(its ``FP8Linear`` on sm89+ GPUs, compressed-tensors' Linear before the first forward), the fused
layers take the bytes and scales the modules hold, checked equal to the files' where the plan knows
them. ``fuse(model, checkpoint=path)`` does the same for a plan built without the folder. Limits:
docs/frameworks.md, "fp8 checkpoints".

The fused layers are built once the shards are loaded: by :func:`fuse` (``parallelize`` calls it), or
by each module's first forward (outside any torch.compile graph: ``torch.compiler.disable``; calling
``fuse`` first keeps that first compiled call free of graph breaks). Building is collective over the
tensor-parallel group; every rank swaps the same modules in the same order. The bf16 shard is dropped after the swap (the fp8 copy in
the layer is the weight): save checkpoints before fusing. The style names and hooks are those of
transformers 5.17 (pinned in the ``hf`` extra).
"""

from __future__ import annotations

import logging
import os
from functools import partial

import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from transformers import AutoConfig, AutoModelForCausalLM, DistributedConfig, PretrainedConfig, PreTrainedModel
from transformers.distributed.tensor_parallel import (
    ALL_PARALLEL_STYLES,
    ParallelInterface,
    RowwiseParallel,
    apply_tensor_parallelism,
    replace_layer_number_by_wildcard,
)

from cco.integrations.fp8 import Fp8Checkpoint
from cco.integrations.fused import (FusedOptions, check_mesh, check_row_parallel, fuse_linear, fused_layer,
                                    run_fused)

TRANSFORMERS_VERSION = "5.17.0"  # the version whose style names and TensorParallelLayer hooks this module uses
_PENDING = "_cco_pending"  # set on a module by a cco style: (style, mesh) until its layer is built
_NAME = "_cco_name"  # the module's name in the model, for messages
log = logging.getLogger("cco.integrations")
if transformers.__version__ != TRANSFORMERS_VERSION:
    log.warning("cco.integrations.hf is tested with transformers %s, this is %s: its tensor-parallel style "
                "names and hooks may differ (pip install cco[hf] pins it)", TRANSFORMERS_VERSION,
                transformers.__version__)


def _hf_forward(style, module, mesh, *args, **kwargs):
    """The forward a cco style installs: transformers' row-wise input step, then the fused layer."""
    args, kwargs = style.transform_inputs_pre_forward(module, args, kwargs, mesh)  # this rank's Shard(-1) slice
    x = args[0].to_local() if isinstance(args[0], DTensor) else args[0]
    layer = fused_layer(module)
    if layer is None:  # the first forward after loading: build it (under torch.compile, a graph break)
        layer = _build(module)
    y = run_fused(layer, x)
    return y if style.use_local_output else DTensor.from_local(y, mesh, [Replicate()], run_check=False)


@torch.compiler.disable  # collective host work (the group agrees on a verdict): never traced
def _build(module, checkpoint: Fp8Checkpoint | None = None):
    style, mesh = module.__dict__[_PENDING]
    name = module.__dict__.get(_NAME, type(module).__name__)
    checkpoint = checkpoint or style.checkpoint
    fp8_shard = None
    if checkpoint is not None:  # this rank's K shard of the fp8 weight as stored, not the dequantized one
        rank, world = mesh.get_local_rank(), mesh.size()

        def fp8_shard(width):
            return checkpoint.row_parallel_shard(f"{name}.weight", quant=style.options.quant, rank=rank, world=world,
                                                 in_features_per_rank=width)
    layer = fuse_linear(module, group=mesh.get_group(), world=mesh.size(), options=style.options, name=name,
                        fn="FusedRowwise", fp8_shard=fp8_shard)
    del module.__dict__[_PENDING]
    return layer


class FusedRowwise(RowwiseParallel):
    """transformers' ``RowwiseParallel`` ("rowwise": input ``Shard(-1)``, output ``Replicate``) for an
    ``nn.Linear``, with the GEMM and the all-reduce fused in ``cco.nn.RowParallelLinear``.

    Sharding and loading are transformers' (``shard_param``: weight ``Shard(-1)``, bias ``Replicate``,
    as inherited; an fp8 module's block scales ``Shard(-1)`` with the weight, its scales without a K
    dimension ``Replicate``; the loader fills this rank's shard). ``validate_param`` refuses what the fused layer
    cannot stand in for, on every rank alike, before anything is loaded. ``install_forward`` replaces
    the module's forward with the fused one. ``checkpoint``: the fp8 checkpoint the fused layers read
    their weights from as stored (:class:`cco.integrations.fp8.Fp8Checkpoint`), or None."""

    def __init__(self, options: FusedOptions, checkpoint: Fp8Checkpoint | None = None):
        super().__init__(input_layouts=Shard(-1), output_layouts=Replicate(), use_local_output=True)
        self.options = options
        self.checkpoint = checkpoint

    def validate_param(self, module, param, mesh, parameter_name=None):
        name = (parameter_name or param).rpartition(".")[0] or type(module).__name__
        check_row_parallel(module, name=name, world=mesh.size(), fn="FusedRowwise")
        module.__dict__[_PENDING] = (self, mesh)
        module.__dict__[_NAME] = name

    def shard_param(self, module, param, mesh):
        meta = module._parameters.get(param)
        if meta is not None and param != "weight" and (meta.dim() < 2 or meta.shape[-1] == 1):
            # the bias, and a scale with no K dimension (FP8Linear's per-tensor weight_scale_inv [],
            # compressed-tensors' per-row weight_scale [N, 1], a static activation scale): it covers every
            # K column, so every rank loads all of it. RowwiseParallel's Shard(-1) would split its last
            # dimension, one column, over the ranks: one rank's shard would be empty.
            module._parameters[param] = torch.nn.Parameter(
                distribute_tensor(meta, mesh, [Replicate()], src_data_rank=None), requires_grad=meta.requires_grad)
            return
        super().shard_param(module, param, mesh)

    def install_forward(self, module, mesh):
        if _PENDING not in module.__dict__:  # no parameter went through validate_param: not a Linear, refused here
            check_row_parallel(module, name=type(module).__name__, world=mesh.size(), fn="FusedRowwise")
        module.forward = partial(_hf_forward, self, module, mesh)
        return module

    def __repr__(self):
        fp8 = "" if self.checkpoint is None else f", {self.checkpoint!r}"
        return f"FusedRowwise({self.options.tag()}{fp8})"


# A style of a model's plan -> (the cco style kind it becomes, the class that builds it). The sequence-
# parallel styles join here, one line each, once transformers' plans have sequence-sharded column-wise
# and row-wise entries (5.17 has none; the layers are built by cco.integrations.fused, as the torch
# styles build them).
FUSED_STYLES = {"rowwise": ("rowwise", FusedRowwise)}


def style_name(kind: str, options: FusedOptions, checkpoint: Fp8Checkpoint | None = None) -> str:
    """The registry name of cco's ``kind`` style with ``options`` (and the fp8 checkpoint its layers
    read, by folder): the same on every rank for the same arguments."""
    fp8 = "" if checkpoint is None else f"<fp8:{checkpoint.folder}>"
    return f"cco_{kind}[{options.tag()}]{fp8}"


def register_style(kind: str, options: FusedOptions, checkpoint: Fp8Checkpoint | None = None) -> str:
    """Register cco's ``kind`` style with ``options`` in transformers' ``ALL_PARALLEL_STYLES`` (the
    class-wide mapping, seen by every model); idempotent. Returns its name for a tp_plan."""
    classes = {k: cls for k, cls in FUSED_STYLES.values()}
    if kind not in classes:
        raise ValueError(f"register_style: kind={kind!r} is not one of cco's styles {sorted(classes)}")
    name = style_name(kind, options, checkpoint)
    if name not in ALL_PARALLEL_STYLES:
        ParallelInterface.register(name, classes[kind](options, checkpoint))
    return name


def _skeleton(source, auto_class) -> PreTrainedModel:
    """The model to read the plan and module types from: ``source`` itself, or a meta-device instance
    of its config (no memory, no weights)."""
    if isinstance(source, PreTrainedModel):
        return source
    if isinstance(source, (str, os.PathLike)):
        source = AutoConfig.from_pretrained(source)
    if not isinstance(source, PretrainedConfig):
        raise TypeError(f"tp_plan: source must be a PreTrainedModel, a PretrainedConfig or a checkpoint path, got "
                        f"{type(source).__name__}")
    with torch.device("meta"):
        return auto_class.from_config(source)


def tp_plan(source, *, quant: str | None = None, m_max: int = 4096, auto_class=AutoModelForCausalLM,
            **options) -> dict[str, str]:
    """The model's own tensor-parallel plan with its row-parallel Linears on cco's fused style.

    ``source``: a checkpoint path, a config (``auto_class`` builds a meta-device skeleton to read its
    plan and module types) or a model. ``quant``, ``m_max`` and ``options``: the fused layers'
    (:class:`cco.integrations.fused.FusedOptions`); ``quant`` defaults to the checkpoint's fp8 format
    (DeepSeek block scales: "blockscale") where ``source`` is an fp8 checkpoint folder, else "ptpc".
    Registers the style it names. Pass the result as ``DistributedConfig(tp_plan=...)`` to
    ``from_pretrained``, or use :func:`parallelize`. Every entry whose style has no fused counterpart,
    or that names no Linear, is kept as the model declares it.

    fp8 checkpoints: where ``source`` is a local folder whose config has an fp8 ``quantization_config``
    (transformers' ``fp8``, compressed-tensors 8-bit float), the fused layers read their weights from
    its safetensors files as stored (:class:`cco.integrations.fp8.Fp8Checkpoint`) instead of
    quantizing the shard transformers dequantized; every other module is transformers' to load."""
    checkpoint = Fp8Checkpoint.of(source) if isinstance(source, (str, os.PathLike)) else None
    if quant is None:
        quant = checkpoint.quant if checkpoint is not None else "ptpc"
    fused = FusedOptions(quant=quant, m_max=m_max, **options)
    model = _skeleton(source, auto_class)
    plan = dict(model.tp_plan or {})
    if not plan:
        raise ValueError(f"tp_plan: {type(model).__name__} declares no tensor-parallel plan (base_model_tp_plan); "
                         f"cco's styles replace entries of a model's own plan")
    kinds: dict[str, list] = {}  # generic module name (layer numbers as *) -> its modules
    for name, module in model.named_modules():
        kinds.setdefault(replace_layer_number_by_wildcard(name), []).append(module)
    out, swapped = {}, 0
    for pattern, style in plan.items():
        counterpart = FUSED_STYLES.get(style)
        modules = kinds.get(pattern, [])
        if counterpart is not None and modules and all(isinstance(m, torch.nn.Linear) for m in modules):
            style = register_style(counterpart[0], fused, checkpoint)
            swapped += 1
        out[pattern] = style
    if not swapped:
        raise ValueError(f"tp_plan: {type(model).__name__}'s plan has no {'/'.join(FUSED_STYLES)} style on an "
                         f"nn.Linear ({plan}); nothing to fuse")
    return out


def fuse(model: torch.nn.Module, *, checkpoint=None) -> list[str]:
    """Build the fused layer of every module under a cco style whose shards are loaded, now rather
    than at its first forward. Collective over the tensor-parallel group. Returns the names of the
    modules swapped by this call.

    ``checkpoint``: a local fp8 checkpoint folder (or :class:`cco.integrations.fp8.Fp8Checkpoint`) the
    fused layers read their fp8 weights from as stored, for a plan built without one (from a config,
    or :func:`parallelize`); default: the one ``tp_plan(path)`` found, else quantize the float shards."""
    if checkpoint is not None and not isinstance(checkpoint, Fp8Checkpoint):
        checkpoint = Fp8Checkpoint(checkpoint)
    pending = [(name, m) for name, m in model.named_modules() if _PENDING in m.__dict__]
    if not pending and not any(fused_layer(m) is not None for m in model.modules()):
        tp = getattr(model, "tp_size", None)
        unsharded = "" if tp not in (None, 1) else (
            f" (transformers did not shard this model: its tp_size is {tp}; it takes the size from the launcher's "
            f"WORLD_SIZE, which torchrun sets, or from DistributedConfig(tp_plan=..., tp_size=N): a plan on ranks "
            f"started otherwise loads the whole model on every rank)")
        raise ValueError("fuse: no module of this model is under a cco style; load it with "
                         "distributed_config=DistributedConfig(tp_plan=cco.integrations.hf.tp_plan(...)) or call "
                         "cco.integrations.hf.parallelize(model, ...)" + unsharded)
    for _, module in pending:
        _build(module, checkpoint)
    return [name for name, _ in pending]


def parallelize(model: PreTrainedModel, *, quant: str | None = None, m_max: int = 4096, mesh=None,
                checkpoint=None, **options):
    """Tensor-parallelize a model loaded whole on every rank, in place, with the fused row-parallel
    layers; returns ``model``. Every rank must hold the same weights (the same checkpoint): each keeps
    its own shard of them, no bytes move (transformers' ``apply_tensor_parallelism`` with
    ``distribute_tensor(src_data_rank=None)``). ``mesh``: a 1-D tensor-parallel ``DeviceMesh``
    (default: the whole world, on the model's device type). ``checkpoint``: as :func:`fuse`'s (an fp8
    checkpoint folder the fused layers read their weights from as stored). Collective."""
    fn = "parallelize"
    if not dist.is_initialized():
        raise RuntimeError(f"{fn}: torch.distributed is not initialized; call dist.init_process_group first "
                           f"(torchrun: backend 'gloo' on CPUs, 'cpu:gloo,cuda:nccl' on GPUs)")
    if getattr(model, "_device_mesh", None) is not None:
        raise ValueError(f"{fn}: the model is already distributed (parallelize ran on it, or it was loaded with a "
                         f"distributed_config, whose plan decides): parallelize a model once, or pass "
                         f"cco_hf.tp_plan(...) to from_pretrained instead")
    if checkpoint is not None and not isinstance(checkpoint, Fp8Checkpoint):
        checkpoint = Fp8Checkpoint(checkpoint)
    if quant is None:  # the checkpoint's fp8 format where it has one, as tp_plan(path) does
        quant = checkpoint.quant if checkpoint is not None and checkpoint.quant else "ptpc"
    plan = tp_plan(model, quant=quant, m_max=m_max, **options)
    if mesh is None:
        device_type = next(model.parameters()).device.type
        mesh = torch.distributed.device_mesh.init_device_mesh(device_type, (dist.get_world_size(),))
    check_mesh(mesh, fn)
    model.tp_plan = plan
    apply_tensor_parallelism(model, mesh)
    # what from_pretrained records for a distributed model (generate sizes a static cache by _tp_size)
    model._device_mesh, model._tp_size = mesh, mesh.size()
    model.config.distributed_config = DistributedConfig(tp_size=mesh.size(), tp_plan=plan)
    fuse(model, checkpoint=checkpoint)
    return model
