"""fp8 checkpoints through the Hugging Face path: transformers loads the model, the fused row-parallel
layers load their fp8 weights from the checkpoint as stored.

A tiny Llama whose every ``*_proj`` Linear ships DeepSeek-V3 style (e4m3 ``weight`` + fp32
``weight_scale_inv`` per 128x128 block, ``quantization_config`` ``fp8``), written with safetensors.
transformers 5.17 on CPU ranks dequantizes such a checkpoint to bf16 (it has no fp8 kernel there);
cco's layers read the e4m3 bytes and scales of their K shard instead (``Fp8Checkpoint``).

Two CPU ranks, one spawned world:
- ``tp_plan(path)``: the layers take the checkpoint's quant (blockscale), build at the first forward,
  hold exactly the checkpoint's shard (bytes and scales, ``torch.equal`` on the dequantized weight),
  multiply like ``x @ dequantize(W).T`` within the activations' fp8 budget, and the logits match the
  bf16 dequantized model within the fp8 budget;
- ``tp_plan(config)`` + ``fuse(model, checkpoint=path)``: the same weights;
- ``tp_plan(config)`` + ``fuse(model)`` (no checkpoint): the shard transformers dequantized,
  quantized again: close to, not equal to, the checkpoint's (what the checkpoint path avoids);
- refused on both ranks, which go on in step: a plan in another quant (ptpc) than the checkpoint's,
  a K split that cuts a scale block (intermediate 384: 192 columns per rank), and one rank reading a
  checkpoint whose shard is not the weight transformers loaded (that rank's error, its peer's
  PeerRejectedError: no rank left waiting in the layer's construction).

transformers' path on GPUs with fp8 (sm89+), on CPU ranks (``hf_models.fp8_linear_path``: its
quantizer passes as it does on sm89+, so every Linear becomes its ``FP8Linear`` holding e4m3 and
``weight_scale_inv``, both sharded along K by the row-wise plan; ``FP8Linear``'s fp8 kernels, which
cannot run on CPU, replaced by ``x @ dequantize(W).T``):
- the fused layers take the bytes and scales the modules hold, with the checkpoint (checked equal,
  scales included) and without it; the logits match the bf16 dequantized model;
- refused on both ranks: a checkpoint whose scales differ from the module's, a plan in another
  quant, a K split that cuts a scale block; one rank reading another checkpoint fails both.

On both paths, two more of the format's forms: DeepSeek-V3.1's power-of-two (``scale_fmt`` ue8m0)
block scales, held exactly in blockscale and in mxfp8; and one scale per weight (``weight_block_size``
None), which transformers 5.17 cannot load under any tensor-parallel plan: on the dequantizing path
``parallelize(model, checkpoint=path)`` of the model loaded whole holds it exactly (ptpc), on the fp8
path transformers' own column-wise style stops it (pinned, as docs/frameworks.md says).

compressed-tensors checkpoints (FP8 per tensor, FP8_DYNAMIC, FP8_BLOCK, MXFP8) loaded by ``from_pretrained`` with
transformers' compressed-tensors quantizer (needs the ``compressed-tensors`` package; skipped where it
is not installed): each fused layer holds the checkpoint's shard exactly and multiplies like
``x @ dequantize(W).T``, with the checkpoint and without it; a plan in another quant and a scheme cco
does not serve (float scales per 128 columns) are refused on both ranks.
"""

from __future__ import annotations

import os

import pytest
import torch

from cco import quant as Q

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from cco.integrations import hf as cco_hf  # noqa: E402
from cco.integrations.fp8 import Fp8Checkpoint  # noqa: E402

from tests.python.cco.errors import error_of  # noqa: E402
from tests.python.cco.hf_models import (  # noqa: E402
    CT_FORMATS,
    checkpoint_weight,
    ct_quantization_config,
    fp8_linear_path,
    write_ct_llama,
    write_fp8_llama,
)
from tests.python.cco.hf_models import fp8_llama_config as llama_config  # noqa: E402

WORLD = 2
M_MAX = 64
SPAWN_TIMEOUT_S = 240
FP8_TOL = 0.08  # logits against the bf16 dequantized model: fp8 activations in every o_proj and down_proj
FP8_ACTIVATION_BUDGET = 0.05  # one layer's product against x @ W.T: the activations' e4m3 rounding
FUSED = ("self_attn.o_proj", "mlp.down_proj")
try:
    import compressed_tensors  # noqa: F401

    NO_COMPRESSED_TENSORS = None
except ImportError as err:
    NO_COMPRESSED_TENSORS = (f"compressed-tensors is not installed ({err}); transformers 5.17 needs it to load "
                             f"compressed-tensors checkpoints (pip install cco[test])")


# ---- host -----------------------------------------------------------------------------------------
@pytest.mark.host
def test_the_plan_of_an_fp8_checkpoint_takes_its_quant_and_names_it(tmp_path):
    write_fp8_llama(str(tmp_path))
    plan = cco_hf.tp_plan(str(tmp_path), m_max=M_MAX)
    fused = {k: v for k, v in plan.items() if v.startswith("cco_")}
    assert set(fused) == {f"model.layers.*.{m}" for m in FUSED}
    style = transformers.distributed.tensor_parallel.ALL_PARALLEL_STYLES[next(iter(fused.values()))]
    assert style.options.quant == "blockscale" and style.checkpoint.folder == str(tmp_path)
    # from a config, no checkpoint is known: the default quant, and the layers quantize what transformers loads
    plain = cco_hf.tp_plan(llama_config(512), m_max=M_MAX)
    assert all("fp8:" not in v and "quant=ptpc" in v for v in plain.values() if v.startswith("cco_"))
    assert Fp8Checkpoint.of(str(tmp_path / "missing")) is None


@pytest.mark.host
def test_a_base_model_reads_its_task_models_checkpoint_keys(tmp_path):
    """``AutoModel`` (the base model) names its modules ``layers.0...`` where the checkpoint of the
    causal-LM holds ``model.layers.0...`` (transformers strips the prefix on load). Before, the
    fused layers' reader looked the base model's name up as it was and every rank raised "no
    tensor 'layers.0.self_attn.o_proj.weight'"; now a name that ends one key only is that key, and
    one that ends several is refused, naming them."""
    write_fp8_llama(str(tmp_path))
    ckpt = Fp8Checkpoint(str(tmp_path))
    full, base = "model.layers.0.self_attn.o_proj.weight", "layers.0.self_attn.o_proj.weight"
    a, b = ckpt.weight(full), ckpt.weight(base)
    assert torch.equal(a.qweight.view(torch.uint8), b.qweight.view(torch.uint8)) and torch.equal(a.scale, b.scale)
    with pytest.raises(ValueError, match=r"no tensor 'o_proj.weight' .*2 end with it: model.layers.0.self_attn.o_proj"):
        ckpt.weight("o_proj.weight")
    with pytest.raises(ValueError, match=r"no tensor 'layers.9.self_attn.o_proj.weight' in .* keys\); the fused"):
        ckpt.weight("layers.9.self_attn.o_proj.weight")


@pytest.mark.host
def test_deepseek_v4_has_no_row_parallel_linear_to_fuse_in_transformers_plan():
    """transformers 5.17 parallelizes DeepSeek-V4 by experts only (its plan has no row-wise Linear):
    the plan says there is nothing to fuse (its checkpoints load through ``load_checkpoint``)."""
    config = transformers.DeepseekV4Config(num_hidden_layers=1, hidden_size=256, vocab_size=512)
    with pytest.raises(ValueError, match=r"DeepseekV4ForCausalLM's plan has no rowwise style .*nothing to fuse"):
        cco_hf.tp_plan(config, m_max=M_MAX)


# ---- two ranks ------------------------------------------------------------------------------------
def _layer_checks(model, names, tensors, rank):
    """Per fused layer: its weight equal to the checkpoint's shard, its product against x @ W.T."""
    out = {}
    for name in names:
        layer = model.get_submodule(name).fused
        w = checkpoint_weight(tensors, f"{name}.weight")
        k = layer.in_features_per_rank
        x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
        with torch.no_grad():
            y = layer(x[:, rank * k:(rank + 1) * k])
        out[name] = {"quant": layer.quant, "exact": torch.equal(layer.dequantized_weight(), w[:, rank * k:(rank + 1) * k]),
                     "close": Q.rel_l2(layer.dequantized_weight(), w[:, rank * k:(rank + 1) * k]),
                     "product": Q.rel_l2(y, x.float() @ w.t())}
    return out


@torch.no_grad()
def _rank_main(comm, paths):
    from transformers import AutoModelForCausalLM, DistributedConfig

    path, ragged = paths["fp8"], paths["ragged"]
    tensors = load_file(os.path.join(path, "model.safetensors"))
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()  # transformers dequantizes it
    out = {}

    def load_from(folder, plan):
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                                    distributed_config=DistributedConfig(tp_size=WORLD, tp_plan=plan))

    def load(plan):
        return load_from(path, plan)

    # the checkpoint's plan: the layers build at the first forward, from the fp8 checkpoint
    model = load(cco_hf.tp_plan(path, m_max=M_MAX))
    logits = model(ids).logits.float()
    names = [n for n, m in model.named_modules() if "fused" in m._modules]
    out["plan"] = {"names": names, "layers": _layer_checks(model, names, tensors, comm.rank),
                   "vs_bf16": Q.rel_l2(logits, ref(ids).logits.float()), "argmax": logits.argmax(-1).tolist()}
    # a plan from the config, the checkpoint given to fuse
    model = load(cco_hf.tp_plan(llama_config(512), quant="blockscale", m_max=M_MAX))
    names = cco_hf.fuse(model, checkpoint=path)
    out["fuse_checkpoint"] = {"names": names, "layers": _layer_checks(model, names, tensors, comm.rank)}
    # no checkpoint: transformers' dequantized shard, quantized again
    model = load(cco_hf.tp_plan(llama_config(512), quant="blockscale", m_max=M_MAX))
    names = cco_hf.fuse(model)
    out["requantized"] = {"layers": _layer_checks(model, names, tensors, comm.rank)}
    # refused on every rank
    model = load(cco_hf.tp_plan(path, quant="ptpc", m_max=M_MAX))
    out["other_quant"] = error_of(lambda: cco_hf.fuse(model))
    model = AutoModelForCausalLM.from_pretrained(ragged, dtype=torch.bfloat16, distributed_config=DistributedConfig(
        tp_size=WORLD, tp_plan=cco_hf.tp_plan(ragged, m_max=M_MAX)))
    out["split_cuts_a_block"] = error_of(lambda: cco_hf.fuse(model))
    # one rank given another checkpoint (its o_proj has the same shape, other values): that rank's
    # check against the weight transformers loaded fails, and the group agrees before any layer is built
    model = load(cco_hf.tp_plan(llama_config(512), quant="blockscale", m_max=M_MAX))
    out["one_rank_wrong_checkpoint"] = error_of(lambda: cco_hf.fuse(model, checkpoint=path if comm.rank == 0 else ragged))
    out["in_step_after_errors"] = comm.all_gather_object(comm.rank)
    out.update(_other_scales(comm, paths, load_from))
    return out


def _other_scales(comm, paths, load_from):
    """The DeepSeek-V3.1 (ue8m0) and per-tensor checkpoints, through whichever path transformers takes
    (``load_from(folder, plan)``): the ue8m0 one in the checkpoint's quant and, exactly, in mxfp8; the
    per-tensor one through ``parallelize`` of the model loaded whole, and (transformers' own limit)
    through a plan."""
    from transformers import AutoModelForCausalLM

    out = {}
    tensors = load_file(os.path.join(paths["ue8m0"], "model.safetensors"))
    for quant in ("blockscale", "mxfp8"):
        model = load_from(paths["ue8m0"], cco_hf.tp_plan(paths["ue8m0"], m_max=M_MAX,
                                                         **({"quant": quant} if quant == "mxfp8" else {})))
        met = _met(model.get_submodule("model.layers.0.mlp.down_proj"))
        names = cco_hf.fuse(model)
        out[f"ue8m0_{quant}"] = {"met": met, "names": names, "layers": _layer_checks(model, names, tensors, comm.rank)}
    path = paths["tensor"]
    tensors = load_file(os.path.join(path, "model.safetensors"))
    out["tensor_plan"] = error_of(lambda: load_from(path, cco_hf.tp_plan(path, m_max=M_MAX)))

    def whole():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        cco_hf.parallelize(model, checkpoint=path, m_max=M_MAX)
        names = [n for n, m in model.named_modules() if "fused" in m._modules]
        return {"names": names, "layers": _layer_checks(model, names, tensors, comm.rank)}
    try:
        out["tensor_parallelize"] = whole()
    except Exception as err:  # noqa: BLE001 - the test reads it (transformers' fp8 path: its own limit)
        out["tensor_parallelize"] = f"{type(err).__name__}: {err}"
    out["in_step_after_other_scales"] = comm.all_gather_object(comm.rank)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from cco.comm import check_outcomes, spawn

    paths = {k: str(tmp_path_factory.mktemp(k)) for k in ("fp8", "ragged", "ue8m0", "tensor")}
    write_fp8_llama(paths["fp8"])
    write_fp8_llama(paths["ragged"], intermediate=384, seed=1)  # down_proj K=384: 192 columns per rank
    write_fp8_llama(paths["ue8m0"], scales="ue8m0")
    write_fp8_llama(paths["tensor"], scales="tensor")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return check_outcomes(spawn(_rank_main, world=WORLD, args=(paths,), timeout_s=SPAWN_TIMEOUT_S))


ALL_FUSED = [f"model.layers.{i}.{m}" for i in range(2) for m in FUSED]


@pytest.mark.multirank
@pytest.mark.parametrize("way", ["plan", "fuse_checkpoint"])
def test_fused_layers_hold_the_checkpoint_shard_and_multiply_like_it(ranks, way):
    for r in ranks:
        got = r[way]
        assert sorted(got["names"]) == sorted(ALL_FUSED), got["names"]
        for name, layer in got["layers"].items():
            assert layer["quant"] == "blockscale", (name, layer)
            assert layer["exact"], (way, name, layer)  # the stored bytes and scales, not a requantization
            assert layer["product"] < FP8_ACTIVATION_BUDGET, (way, name, layer)


@pytest.mark.multirank
def test_the_logits_match_the_dequantized_model(ranks):
    _logits_match_the_dequantized_model(ranks)


def _logits_match_the_dequantized_model(ranks):
    """Each rank's logits within the fp8 budget of the bf16 dequantized model, the same argmax on both."""
    for r in ranks:
        assert r["plan"]["vs_bf16"] < FP8_TOL, r["plan"]["vs_bf16"]
    assert ranks[0]["plan"]["argmax"] == ranks[1]["plan"]["argmax"]


@pytest.mark.multirank
def test_without_the_checkpoint_the_layers_requantize_what_transformers_dequantized(ranks):
    """The contrast the exact check above relies on: quantizing transformers' bf16 shard again
    gives a weight close to the checkpoint's, never equal to it."""
    for r in ranks:
        for name, layer in r["requantized"]["layers"].items():
            assert not layer["exact"] and layer["close"] < 0.01, (name, layer)


@pytest.mark.multirank
def test_refusals_name_the_fix_on_every_rank(ranks):
    for r in ranks:
        other, cut = r["other_quant"], r["split_cuts_a_block"]
        for word in ("quant='ptpc'", "quant='blockscale'", "deepseek-v3", "model.layers.0.self_attn.o_proj.weight"):
            assert word in other, (word, other)
        for word in ("model.layers.0.mlp.down_proj.weight", "K=384", "192 columns", "multiple of 128"):
            assert word in cut, (word, cut)
        assert r["in_step_after_errors"] == [0, 1]
    assert ranks[0]["other_quant"].split(":")[0] in ("ValueError", "PeerRejectedError")


@pytest.mark.multirank
def test_a_shard_that_one_rank_cannot_match_fails_every_rank(ranks):
    """Rank 1 reads another checkpoint: its fp8 shard differs from the weight transformers loaded, it
    raises, and rank 0 raises too (PeerRejectedError) instead of waiting in the layer's construction."""
    mine, peer = ranks[1]["one_rank_wrong_checkpoint"], ranks[0]["one_rank_wrong_checkpoint"]
    assert mine.startswith("ValueError") and "differs from the weight the framework loaded" in mine, mine
    assert peer.startswith("PeerRejectedError") and "rank 1" in peer, peer
    assert all(r["in_step_after_errors"] == [0, 1] for r in ranks)


def _ue8m0_layers_are_exact(rank_outs, scale=None):
    """The DeepSeek-V3.1 checkpoint (power-of-two block scales): each fused layer holds exactly its
    shard in the checkpoint's quant (blockscale) and in mxfp8 (the exact conversion: each 128-block's
    power of two over its four 32-groups); ``scale``: what the style meets as ``weight_scale_inv``."""
    for r in rank_outs:
        for quant in ("blockscale", "mxfp8"):
            got = r[f"ue8m0_{quant}"]
            assert sorted(got["names"]) == sorted(ALL_FUSED), got["names"]
            if scale is not None:
                assert got["met"]["weight_scale_inv"] == scale, got["met"]
            for name, layer in got["layers"].items():
                assert layer["quant"] == quant and layer["exact"], (quant, name, layer)
                assert layer["product"] < FP8_ACTIVATION_BUDGET, (quant, name, layer)


@pytest.mark.multirank
def test_a_ue8m0_checkpoint_loads_exactly_in_blockscale_and_in_mxfp8(ranks):
    _ue8m0_layers_are_exact(ranks)


@pytest.mark.multirank
def test_a_per_tensor_checkpoint_loads_through_parallelize_not_through_a_plan(ranks):
    """``weight_block_size`` None (one ``weight_scale_inv []`` per weight): transformers 5.17 cannot load
    it under a tensor-parallel plan, cco's or its own (its loader slices the ``[]`` scale with the
    weight's placement: IndexError); loaded whole and then ``parallelize(model, checkpoint=path)``,
    every fused layer holds exactly its shard, in ptpc (the checkpoint's quant: a per-tensor scale is
    every row's), and the ranks stay in step."""
    for r in ranks:
        assert r["tensor_plan"].startswith("IndexError"), r["tensor_plan"]
        got = r["tensor_parallelize"]
        assert isinstance(got, dict), got
        assert sorted(got["names"]) == sorted(ALL_FUSED), got["names"]
        for name, layer in got["layers"].items():
            assert layer["quant"] == "ptpc" and layer["exact"], (name, layer)
            assert layer["product"] < FP8_ACTIVATION_BUDGET, (name, layer)
        assert r["in_step_after_other_scales"] == [0, 1]


# ---- transformers' path on GPUs with fp8: FP8Linear modules, on two CPU ranks ---------------------
def _met(module) -> dict:
    """What cco's style meets in a module: its type, and each parameter's dtype, global and local
    shape and placement."""
    out = {"type": type(module).__name__}
    for pname, p in module.named_parameters(recurse=False):
        local = p.to_local() if hasattr(p, "to_local") else p
        out[pname] = (str(p.dtype).removeprefix("torch."), list(p.shape), list(local.shape),
                      str(getattr(p, "placements", None)))
    return out


@torch.no_grad()
def _fp8_linear_main(comm, paths):
    from transformers import AutoModelForCausalLM, DistributedConfig

    path = paths["fp8"]
    tensors = load_file(os.path.join(path, "model.safetensors"))
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))
    # the reference, outside the context: transformers dequantizes the whole checkpoint to bf16 (no GPU)
    ref_logits = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()(ids).logits.float()
    out = {}

    def load_from(folder, plan):
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                                    distributed_config=DistributedConfig(tp_size=WORLD, tp_plan=plan))

    def load(plan, folder=path):
        return load_from(folder, plan)

    def config_plan(quant="blockscale", intermediate=512):
        return cco_hf.tp_plan(llama_config(intermediate), quant=quant, m_max=M_MAX)

    with fp8_linear_path(reference_kernel=True):
        # the checkpoint's plan: the modules hold the fp8 weights and the plan knows the checkpoint
        model = load(cco_hf.tp_plan(path, m_max=M_MAX))
        out["met"] = {m: _met(model.get_submodule(f"model.layers.0.{m}")) for m in ("self_attn.o_proj",
                                                                                   "self_attn.q_proj")}
        logits = model(ids).logits.float()  # the fused layers build here; q/k/v, gate/up run as FP8Linear
        names = [n for n, m in model.named_modules() if "fused" in m._modules]
        o_proj = model.get_submodule("model.layers.0.self_attn.o_proj")
        out["plan"] = {"names": names, "layers": _layer_checks(model, names, tensors, comm.rank),
                       "vs_bf16": Q.rel_l2(logits, ref_logits), "argmax": logits.argmax(-1).tolist(),
                       "left": sorted(k for k, v in o_proj.named_parameters(recurse=False) if v is not None)}
        # no checkpoint known: the bytes and scales the modules hold, nothing else
        model = load(config_plan())
        names = cco_hf.fuse(model)
        out["held"] = {"names": names, "layers": _layer_checks(model, names, tensors, comm.rank)}
        # a checkpoint with the same bytes, other scales: not the weight the modules hold
        model = load(config_plan())
        out["other_scales"] = error_of(lambda: cco_hf.fuse(model, checkpoint=paths["scaled"]))
        # one rank given another checkpoint (its o_proj has the same shape, other values)
        model = load(config_plan())
        out["one_rank_wrong_checkpoint"] = error_of(
            lambda: cco_hf.fuse(model, checkpoint=path if comm.rank == 0 else paths["ragged"]))
        # a plan in another quant than the modules' block scales
        model = load(config_plan(quant="ptpc"))
        out["other_quant"] = error_of(lambda: cco_hf.fuse(model))
        # intermediate 384: transformers splits down_proj's K into 192 columns per rank, cutting a block
        model = load(config_plan(intermediate=384), folder=paths["ragged"])
        out["split_cuts_a_block"] = error_of(lambda: cco_hf.fuse(model))
        out["in_step_after_errors"] = comm.all_gather_object(comm.rank)
        out.update(_other_scales(comm, paths, load_from))
    return out


@pytest.fixture(scope="module")
def fp8_linear_ranks(tmp_path_factory):
    from cco.comm import check_outcomes, spawn

    paths = {k: str(tmp_path_factory.mktemp(f"fp8linear-{k}")) for k in ("fp8", "ragged", "scaled", "ue8m0", "tensor")}
    write_fp8_llama(paths["fp8"])
    write_fp8_llama(paths["ragged"], intermediate=384, seed=1)
    write_fp8_llama(paths["ue8m0"], scales="ue8m0")
    write_fp8_llama(paths["tensor"], scales="tensor")
    # the same bytes as "fp8", layer 0's o_proj scales doubled
    write_fp8_llama(paths["scaled"])
    tensors = load_file(os.path.join(paths["scaled"], "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"] *= 2
    save_file(tensors, os.path.join(paths["scaled"], "model.safetensors"), metadata={"format": "pt"})
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return check_outcomes(spawn(_fp8_linear_main, world=WORLD, args=(paths,), timeout_s=SPAWN_TIMEOUT_S))


@pytest.mark.multirank
def test_fp8_linear_modules_are_what_the_style_meets(fp8_linear_ranks):
    """On GPUs with fp8, transformers swaps every Linear for its FP8Linear (an nn.Linear subclass) and
    the row-wise plan shards both its e4m3 weight and its weight_scale_inv along K."""
    for rank, r in enumerate(fp8_linear_ranks):
        o, q = r["met"]["self_attn.o_proj"], r["met"]["self_attn.q_proj"]
        assert o["type"] == q["type"] == "FP8Linear", r["met"]
        assert o["weight"] == ("float8_e4m3fn", [256, 256], [256, 128], "(Shard(dim=1),)"), o
        assert o["weight_scale_inv"] == ("float32", [2, 2], [2, 1], "(Shard(dim=1),)"), o
        assert q["weight"][:3] == ("float8_e4m3fn", [256, 256], [128, 256]), q


@pytest.mark.multirank
@pytest.mark.parametrize("way", ["plan", "held"])
def test_fused_layers_take_the_fp8_weights_the_modules_hold(fp8_linear_ranks, way):
    """With the checkpoint (checked equal) and without it, each fused layer holds exactly the
    checkpoint's shard: never quantized again (quantizing the module's e4m3 values as floats, as a
    float shard would be, loses the block scales: the weight is off by their factor)."""
    for r in fp8_linear_ranks:
        got = r[way]
        assert sorted(got["names"]) == sorted(ALL_FUSED), got["names"]
        for name, layer in got["layers"].items():
            assert layer["quant"] == "blockscale", (way, name, layer)
            assert layer["exact"], (way, name, layer)
            assert layer["product"] < FP8_ACTIVATION_BUDGET, (way, name, layer)
    # the fused module keeps no copy of the framework's weight or scales
    assert all(r["plan"]["left"] == [] for r in fp8_linear_ranks), [r["plan"]["left"] for r in fp8_linear_ranks]


@pytest.mark.multirank
def test_fp8_linear_model_logits_match_the_dequantized_model(fp8_linear_ranks):
    _logits_match_the_dequantized_model(fp8_linear_ranks)


@pytest.mark.multirank
def test_fp8_linear_refusals_on_every_rank(fp8_linear_ranks):
    for r in fp8_linear_ranks:
        scales, other, cut = r["other_scales"], r["other_quant"], r["split_cuts_a_block"]
        # same bytes, other scales: both ranks hold the original scales and refuse the checkpoint
        assert scales.startswith("ValueError") and "differs from the fp8 weight and scales" in scales, scales
        assert "model.layers.0.self_attn.o_proj" in scales, scales
        # o_proj's K shard is one block column (its scales, per row there, convert to ptpc exactly);
        # down_proj's two vary along K
        for word in ("quant='ptpc'", "quant='blockscale'", "deepseek-v3", "model.layers.0.mlp.down_proj"):
            assert word in other, (word, other)
        assert other.startswith("ValueError"), other
        for word in ("model.layers.0.mlp.down_proj.weight", "K=384", "192 columns", "multiple of 128"):
            assert word in cut, (word, cut)
        assert r["in_step_after_errors"] == [0, 1]
    mine, peer = (fp8_linear_ranks[1]["one_rank_wrong_checkpoint"],
                  fp8_linear_ranks[0]["one_rank_wrong_checkpoint"])
    assert mine.startswith("ValueError") and "differs from the fp8 weight and scales" in mine, mine
    assert peer.startswith("PeerRejectedError") and "rank 1" in peer, peer


@pytest.mark.multirank
def test_fp8_linear_ue8m0_checkpoint_layers_take_its_e8m0_scales_exactly(fp8_linear_ranks):
    """transformers keeps a ue8m0 checkpoint's scales as ``float8_e8m0fnu`` in its FP8Linear."""
    _ue8m0_layers_are_exact(fp8_linear_ranks, scale=("float8_e8m0fnu", [2, 4], [2, 2], "(Shard(dim=1),)"))


@pytest.mark.multirank
def test_fp8_linear_per_tensor_checkpoint_stops_in_transformers_own_sharding(fp8_linear_ranks):
    """On transformers' fp8 path a per-tensor checkpoint loads neither through a plan nor through
    ``parallelize``: its column-wise style shards the FP8Linear modules' ``[]`` scale (torch's
    ``Shard`` of a 0-d tensor) before cco's layers are reached (docs/frameworks.md says so)."""
    for r in fp8_linear_ranks:
        for way in ("tensor_plan", "tensor_parallelize"):
            got = r[way]
            assert isinstance(got, str) and got.startswith("AssertionError") and "dim() > 0" in got, (way, got)
        assert r["in_step_after_other_scales"] == [0, 1]


# ---- compressed-tensors checkpoints through from_pretrained, on two CPU ranks ---------------------
@torch.no_grad()
def _ct_main(comm, paths):
    from transformers import AutoModelForCausalLM, DistributedConfig

    def load(folder, plan):
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                                    distributed_config=DistributedConfig(tp_size=WORLD, tp_plan=plan))

    out = {}
    for scheme in CT_FORMATS:
        path = paths[scheme]
        tensors = load_file(os.path.join(path, "model.safetensors"))
        plan = cco_hf.tp_plan(path, m_max=M_MAX)
        model = load(path, plan)
        met = _met(model.get_submodule("model.layers.0.mlp.down_proj"))
        names = cco_hf.fuse(model)
        # the forward's layers only: transformers 5.17 with compressed-tensors 0.20 cannot run this model's
        # forward under any tp_plan (docs/frameworks.md)
        quant = model.get_submodule(names[0]).fused.quant
        out[scheme] = {"met": met, "names": names, "quant": quant,
                       "layers": _layer_checks(model, names, tensors, comm.rank)}
        # no checkpoint: the e4m3 weight and weight_scale the modules hold
        model = load(path, cco_hf.tp_plan(llama_config(), quant=quant, m_max=M_MAX))
        names = cco_hf.fuse(model)
        out[scheme]["held"] = {"names": names, "layers": _layer_checks(model, names, tensors, comm.rank)}
    # FP8_BLOCK's bf16 block scales are no powers of two: no exact mxfp8 form
    model = load(paths["FP8_BLOCK"], cco_hf.tp_plan(paths["FP8_BLOCK"], quant="mxfp8", m_max=M_MAX))
    out["other_quant"] = error_of(lambda: cco_hf.fuse(model))
    out["group128"] = error_of(lambda: cco_hf.tp_plan(paths["GROUP128"], m_max=M_MAX))
    out["in_step_after_errors"] = comm.all_gather_object(comm.rank)
    return out


@pytest.fixture(scope="module")
def ct_ranks(tmp_path_factory):
    if NO_COMPRESSED_TENSORS:
        pytest.skip(NO_COMPRESSED_TENSORS)
    from cco.comm import check_outcomes, spawn

    paths = {}
    for scheme in CT_FORMATS:
        paths[scheme] = str(tmp_path_factory.mktemp(f"ct-{scheme}"))
        write_ct_llama(paths[scheme], scheme)
    paths["GROUP128"] = str(tmp_path_factory.mktemp("ct-group128"))
    write_ct_llama(paths["GROUP128"], "GROUP128", quantization_config=ct_quantization_config(
        "FP8_BLOCK", strategy="group", group_size=128, block_structure=None))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return check_outcomes(spawn(_ct_main, world=WORLD, args=(paths,), timeout_s=SPAWN_TIMEOUT_S))


CT_SCALES = {  # scheme -> (cco quant, down_proj's weight_scale as transformers loads it: dtype, global, local)
    "FP8": ("ptpc", ("bfloat16", [1], [1], "(Replicate(),)")),
    "FP8_DYNAMIC": ("ptpc", ("bfloat16", [256, 1], [256, 1], "(Replicate(),)")),
    "FP8_BLOCK": ("blockscale", ("bfloat16", [2, 4], [2, 2], "(Shard(dim=1),)")),
    "MXFP8": ("mxfp8", ("uint8", [256, 16], [256, 8], "(Shard(dim=1),)")),
}


@pytest.mark.multirank
@pytest.mark.parametrize("scheme", sorted(CT_FORMATS))
def test_compressed_tensors_checkpoint_layers_hold_its_shard(ct_ranks, scheme):
    """transformers' compressed-tensors quantizer leaves each Linear's e4m3 weight and weight_scale
    in it; cco's style replicates a per-row scale (transformers' row-wise Shard(-1) would leave one
    rank an empty [N, 0] one) and shards block and group scales along K with the weight. Each fused
    layer holds exactly the checkpoint's shard, read with the checkpoint and without it."""
    quant, scale = CT_SCALES[scheme]
    for r in ct_ranks:
        got = r[scheme]
        assert got["met"]["weight"][:3] == ("float8_e4m3fn", [256, 512], [256, 256]), got["met"]
        assert got["met"]["weight_scale"] == scale, got["met"]
        if scheme == "FP8":  # its static activation scale, per tensor: replicated too (transformers' own
            # row-wise style would leave rank 1 an empty [0] one), and not read (quantized per call)
            assert got["met"]["input_scale"] == ("bfloat16", [1], [1], "(Replicate(),)"), got["met"]
        assert got["quant"] == quant, got["quant"]
        for way in (got, got["held"]):
            assert sorted(way["names"]) == sorted(ALL_FUSED), way["names"]
            for name, layer in way["layers"].items():
                assert layer["quant"] == quant and layer["exact"], (scheme, name, layer)
                assert layer["product"] < FP8_ACTIVATION_BUDGET, (scheme, name, layer)


@pytest.mark.multirank
def test_compressed_tensors_refusals_on_every_rank(ct_ranks):
    for r in ct_ranks:
        other, group = r["other_quant"], r["group128"]
        assert other.startswith("ValueError") and "quant='mxfp8'" in other and "quant='blockscale'" in other, other
        assert group.startswith("ValueError") and "group_size=128 is not served" in group, group
        assert r["in_step_after_errors"] == [0, 1]
