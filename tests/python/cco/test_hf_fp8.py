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
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from cco import quant as Q

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from cco.integrations import hf as cco_hf  # noqa: E402
from cco.integrations.fp8 import Fp8Checkpoint  # noqa: E402

WORLD = 2
M_MAX = 64
SPAWN_TIMEOUT_S = 240
FP8_TOL = 0.08  # logits against the bf16 dequantized model: fp8 activations in every o_proj and down_proj
FP8_ACTIVATION_BUDGET = 0.05  # one layer's product against x @ W.T: the activations' e4m3 rounding
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
FUSED = ("self_attn.o_proj", "mlp.down_proj")


def llama_config(intermediate: int):
    # head_dim 128 and 2 kv heads: every column-parallel shard is whole 128-row blocks too, which
    # transformers' own dequantization of a sharded block-scaled weight needs
    return transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=intermediate,
                                    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=128,
                                    max_position_embeddings=128, tie_word_embeddings=False)


def write_fp8_llama(path: str, *, intermediate: int = 512, seed: int = 0) -> None:
    """A random Llama saved with ``save_pretrained``, then every ``*_proj.weight`` rewritten as e4m3
    + ``weight_scale_inv`` (fp32 [ceil(N/128), ceil(K/128)]); embeddings, norms and lm_head stay bf16."""
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(llama_config(intermediate)).to(torch.bfloat16).save_pretrained(path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for key in [k for k in tensors if k.endswith("_proj.weight")]:
        w = tensors[key].float()
        n, k = w.shape
        nb, kb = -(-n // 128), -(-k // 128)
        # magnitudes that differ by block, so a scale read from the wrong block shows; fp32 values (a
        # checkpoint quantized from fp32 masters), so a block's scale is no bf16 value over 448 and
        # transformers' bf16 dequantization, quantized again, does not give the stored bytes back
        w = w * torch.exp2(torch.randint(-2, 3, (nb, kb), generator=g).float()).repeat_interleave(128, 0)[:n] \
            .repeat_interleave(128, 1)[:, :k] * (1 + 0.01 * torch.randn(n, k, generator=g))
        blocks = torch.nn.functional.pad(w, (0, kb * 128 - k, 0, nb * 128 - n)).view(nb, 128, kb, 128)
        scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / Q.FP8_MAX
        full = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        tensors[key] = (w / full).clamp(-Q.FP8_MAX, Q.FP8_MAX).to(Q.FP8)
        tensors[key[:-len("weight")] + "weight_scale_inv"] = scale
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = FP8_CONFIG
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def checkpoint_weight(tensors, key: str) -> torch.Tensor:
    """fp32 [N, K]: the stored e4m3 bytes times their block's scale (the format's definition)."""
    q, s = tensors[key], tensors[key[:-len("weight")] + "weight_scale_inv"]
    n, k = q.shape
    return q.float() * s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]


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


# ---- two ranks ------------------------------------------------------------------------------------
def _errors(fn) -> str:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test reads the type and message
        return f"{type(err).__name__}: {err}"
    return "no error"


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

    def load(plan):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                    distributed_config=DistributedConfig(tp_size=WORLD, tp_plan=plan))

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
    out["other_quant"] = _errors(lambda: cco_hf.fuse(model))
    model = AutoModelForCausalLM.from_pretrained(ragged, dtype=torch.bfloat16, distributed_config=DistributedConfig(
        tp_size=WORLD, tp_plan=cco_hf.tp_plan(ragged, m_max=M_MAX)))
    out["split_cuts_a_block"] = _errors(lambda: cco_hf.fuse(model))
    # one rank given another checkpoint (its o_proj has the same shape, other values): that rank's
    # check against the weight transformers loaded fails, and the group agrees before any layer is built
    model = load(cco_hf.tp_plan(llama_config(512), quant="blockscale", m_max=M_MAX))
    out["one_rank_wrong_checkpoint"] = _errors(lambda: cco_hf.fuse(model, checkpoint=path if comm.rank == 0 else ragged))
    out["in_step_after_errors"] = comm.all_gather_object(comm.rank)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from cco.comm import check_outcomes, spawn

    paths = {"fp8": str(tmp_path_factory.mktemp("fp8")), "ragged": str(tmp_path_factory.mktemp("ragged"))}
    write_fp8_llama(paths["fp8"])
    write_fp8_llama(paths["ragged"], intermediate=384, seed=1)  # down_proj K=384: 192 columns per rank
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
