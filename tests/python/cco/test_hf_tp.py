"""cco's fused row-parallel styles inside transformers' and torch's tensor parallelism.

Host: the plan conversion per model family (which entries become cco's style, which stay the
model's), option and style-name rules, and that ``cco`` imports without transformers.

Two CPU ranks (gloo), all scenarios in one spawned world (importing transformers dominates the cost):
small random Llama (row-parallel biases on), Qwen2 (q/k/v bias), Qwen3, Mistral and a DeepSeek-V2
MLA model (a dense layer and an MoE layer) saved with ``save_pretrained`` and loaded with
``from_pretrained(distributed_config=DistributedConfig(tp_plan=cco plan))``, an already-loaded Llama
parallelized in place, and ``FusedRowwiseParallel`` under ``parallelize_module``. Each is checked
twice: within the fp8 budget of the unsharded bf16 model, and within bf16 rounding of the same model
with every fused layer's operands quantized per rank slice as the layer does (``emulate_fused``), a
check that sees what the fp8 budget would hide (a bias added on every rank, a rank's slice read from
the wrong columns). Greedy tokens must be identical on both ranks. Refused plans (a module that is not
a Linear, a shape that does not split) must raise on both ranks, which then go on in step.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch

from cco import quant as Q

transformers = pytest.importorskip("transformers")
from cco.integrations import hf as cco_hf  # noqa: E402
from cco.integrations.fused import FusedOptions  # noqa: E402
from examples.hf_generate import FP8_TOL, save_random_model  # noqa: E402
from tests.python.cco.errors import error_of  # noqa: E402
from tests.python.cco.hf_models import emulate_fused, emulated_row_parallel, family_config  # noqa: E402

EXACT_TOL = 1e-2  # rel. L2 against the emulated fused model: bf16 rounding of activations across 2 layers
WORLD = 2
M_MAX = 64
SPAWN_TIMEOUT_S = 240

# ---- host -----------------------------------------------------------------------------------------
ATTN, MLP = "model.layers.*.self_attn.o_proj", "model.layers.*.mlp.down_proj"
SHARED = "model.layers.*.mlp.shared_experts.down_proj"


@pytest.mark.host
@pytest.mark.parametrize("family,fused", [
    ("llama", {ATTN, MLP}), ("qwen2", {ATTN, MLP}), ("qwen3", {ATTN, MLP}), ("mistral", {ATTN, MLP}),
    ("deepseek_v2", {ATTN, MLP, SHARED}),
    ("deepseek_v3", {MLP, SHARED}),  # transformers 5.17 shards no DeepSeek-V3 attention
    ("gemma3", {ATTN, MLP}), ("olmo", {ATTN, MLP}), ("starcoder2", {ATTN, "model.layers.*.mlp.c_proj"}),
    ("mixtral", {ATTN}),  # every MLP is routed experts
    ("qwen3_moe", {ATTN, MLP}),  # the dense layers' down_proj (mlp_only_layers)
])
def test_plan_fuses_the_row_parallel_linears_and_keeps_the_rest(family, fused):
    config = family_config(family)
    plan = cco_hf.tp_plan(config, quant="blockscale", m_max=128)
    with torch.device("meta"):
        own = transformers.AutoModelForCausalLM.from_config(config).tp_plan
    name = cco_hf.style_name("rowwise", FusedOptions(quant="blockscale", m_max=128))
    assert plan.keys() == own.keys()
    assert {k for k, v in plan.items() if v == name} == fused
    assert {k: v for k, v in plan.items() if k not in fused} == {k: v for k, v in own.items() if k not in fused}
    if "model.layers.*.mlp.experts.down_proj" in own:  # a 3-D expert parameter, not a Linear: stays transformers'
        assert plan["model.layers.*.mlp.experts.down_proj"] == "rowwise"


@pytest.mark.host
def test_plan_refuses_a_model_with_no_row_parallel_linear():
    """Phi-3's plan gathers its packed outputs and splits the row-parallel input ("rowwise_split_input"):
    nothing there is cco's to fuse, and saying so beats returning the plan unchanged."""
    with pytest.raises(ValueError, match="nothing to fuse"):
        cco_hf.tp_plan(family_config("phi3"))


@pytest.mark.host
def test_options_are_checked_when_the_plan_is_built():
    with pytest.raises(ValueError, match="quant='fp4'"):
        cco_hf.tp_plan(family_config("llama"), quant="fp4")
    with pytest.raises(ValueError, match="m_max=0"):
        cco_hf.tp_plan(family_config("llama"), m_max=0)
    with pytest.raises(TypeError, match="source must be"):
        cco_hf.tp_plan(42)
    # the op's options too (before, each was taken, its style registered, and refused only when the
    # first layer was built: after every checkpoint shard had loaded)
    for option, value, says in (("transport", "nvlink", "transport='nvlink' is not supported"),
                                ("gather_dtype", "int8", "gather_dtype='int8' is not supported"),
                                ("chunks", 0, "chunks=0 is not supported"),
                                ("deadline_s", "soon", "deadline_s='soon' must be > 0 seconds")):
        with pytest.raises(ValueError, match=re.escape(f"FusedOptions: {says}")):
            cco_hf.tp_plan(family_config("llama"), **{option: value})


@pytest.mark.host
def test_one_registered_style_per_set_of_options():
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    a = cco_hf.register_style("rowwise", FusedOptions(quant="ptpc", m_max=256))
    assert cco_hf.register_style("rowwise", FusedOptions(quant="ptpc", m_max=256)) == a
    b = cco_hf.register_style("rowwise", FusedOptions(quant="ptpc", m_max=512, gather_dtype="fp8"))
    assert a != b and "gather_dtype=fp8" in b
    assert ALL_PARALLEL_STYLES[a].options == FusedOptions(quant="ptpc", m_max=256)
    assert isinstance(ALL_PARALLEL_STYLES[b], cco_hf.FusedRowwise)
    with pytest.raises(ValueError, match="kind='colwise_sp'"):
        cco_hf.register_style("colwise_sp", FusedOptions())


@pytest.mark.host
def test_cco_imports_without_transformers():
    """Only ``cco.integrations.hf`` needs transformers; the rest imports with it blocked."""
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import cco, cco.nn, cco.integrations, cco.integrations.fused, cco.integrations.dtensor\n"
            "try:\n    import cco.integrations.hf\nexcept ImportError:\n    print('hf needs transformers')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "hf needs transformers"


# ---- two ranks ------------------------------------------------------------------------------------
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "deepseek_v2")
QUANT_OF = {"llama": "ptpc", "qwen2": "blockscale", "qwen3": "ptpc", "mistral": "mxfp8", "deepseek_v2": "ptpc"}


@torch.no_grad()
def _loaded_model_checks(comm, ckpts):
    from transformers import AutoModelForCausalLM, DistributedConfig

    out = {}
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))
    for family in FAMILIES:
        path, quant = ckpts[family], QUANT_OF[family]
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        ref_logits = ref(ids).logits.float()
        plan = cco_hf.tp_plan(path, quant=quant, m_max=M_MAX)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                     distributed_config=DistributedConfig(tp_size=WORLD, tp_plan=plan))
        # qwen2 builds its fused layers in its first forward, compiled (dynamo only: inductor is slow
        # here); the others through fuse()
        compiled_equal = None
        if family == "qwen2":
            first = torch.compile(model.forward, backend="eager")(input_ids=ids).logits.float()
            names = [n for n, m in model.named_modules() if "fused" in m._modules]
        else:
            names = cco_hf.fuse(model)
        logits = model(ids).logits.float()
        if family == "qwen2":
            compiled_equal = torch.equal(first, logits)
        emu_logits = emulate_fused(ref, names, world=WORLD, quant=quant)(ids).logits.float()
        tokens = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        out[family] = {"fused": names, "vs_bf16": Q.rel_l2(logits, ref_logits), "vs_emulated": Q.rel_l2(logits, emu_logits),
                       "tokens": tokens.tolist(), "compiled_equal": compiled_equal, "weights_left": [n for n in names
                                                                   if model.get_submodule(n).weight is not None]}
    # an already-loaded model, parallelized in place
    path = ckpts["llama"]
    whole = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ref_logits = ref(ids).logits.float()
    cco_hf.parallelize(whole, quant="ptpc", m_max=M_MAX)
    names = [n for n, m in whole.named_modules() if "fused" in m._modules]
    emu = emulate_fused(ref, names, world=WORLD, quant="ptpc")(ids).logits.float()
    logits = whole(ids).logits.float()
    out["in_place"] = {"fused": names, "vs_bf16": Q.rel_l2(logits, ref_logits), "vs_emulated": Q.rel_l2(logits, emu),
                       "tp_size": whole.tp_size, "again": error_of(lambda: cco_hf.parallelize(whole))}
    # a fused model's checkpoint would hold per-rank fp8 shards where the framework's weights were
    target = tempfile.mkdtemp()
    out["saved_after_fusing"] = (error_of(lambda: whole.save_pretrained(target)),
                                 error_of(lambda: whole.state_dict()), sorted(os.listdir(target)))
    # refused plans: both ranks raise before any collective, then go on in step
    bad = dict(cco_hf.tp_plan(path, m_max=M_MAX))
    bad["model.norm"] = cco_hf.style_name("rowwise", FusedOptions(m_max=M_MAX))
    out["plan_names_a_norm"] = error_of(lambda: AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, distributed_config=DistributedConfig(tp_size=WORLD, tp_plan=bad)))
    out["fuse_without_plan"] = error_of(lambda: cco_hf.fuse(ref))
    out["in_step_after_errors"] = comm.all_gather_object(comm.rank)
    return out


def _dtensor_checks(comm):
    """A two-layer MLP under ``parallelize_module``: torch's ColwiseParallel then the fused row-wise
    style, against the same block under torch's own RowwiseParallel."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from cco.integrations.dtensor import FusedRowwiseParallel

    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(7)
    w1, w2, b2 = torch.randn(384, 128) / 128 ** 0.5, torch.randn(96, 384) / 384 ** 0.5, torch.randn(96) * 0.3

    def block():
        m = torch.nn.Sequential(torch.nn.Linear(128, 384, bias=False), torch.nn.ReLU(), torch.nn.Linear(384, 96))
        with torch.no_grad():
            m[0].weight.copy_(w1), m[2].weight.copy_(w2), m[2].bias.copy_(b2)
        return m.to(torch.bfloat16)

    x = torch.randn(3, 10, 128, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    out = {}
    for local in (True, False):
        fused = parallelize_module(block(), mesh, {"0": ColwiseParallel(),
                                                   "2": FusedRowwiseParallel(m_max=M_MAX, use_local_output=local)})
        torch_own = parallelize_module(block(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel(use_local_output=local)})
        xg = x.clone().requires_grad_(True)
        y = fused(xg)
        y_torch = torch_own(x)
        kind, kind_torch = (("DTensor", tuple(t.placements)) if isinstance(t, DTensor) else ("Tensor", None)
                            for t in (y, y_torch))  # torch's plain output may be an AsyncCollectiveTensor
        yl = y.to_local() if isinstance(y, DTensor) else y
        yl.float().square().mean().backward()
        ref_x = x.clone().requires_grad_(True)
        ref = block()
        ref(ref_x).float().square().mean().backward()
        h = torch.relu(x @ w1.to(torch.bfloat16).t())
        emu = emulated_row_parallel(h, w2.to(torch.bfloat16), b2.to(torch.bfloat16), world=WORLD, quant="ptpc")
        yt = y_torch.to_local() if isinstance(y_torch, DTensor) else y_torch
        out[f"local={local}"] = {"kind": kind, "kind_torch": kind_torch, "vs_torch": Q.rel_l2(yl.detach(), yt.detach()),
                                 "vs_emulated": Q.rel_l2(yl.detach(), emu), "grad_x": Q.rel_l2(xg.grad, ref_x.grad),
                                 "weight_dropped": fused[2].weight is None}
    # a DTensor input, sharded on the last dimension already (the colwise layer's DTensor output)
    h = torch.relu(x @ w1.to(torch.bfloat16).t())
    row = parallelize_module(block()[2], mesh, FusedRowwiseParallel(m_max=M_MAX, use_local_output=False))
    y = row(distribute_tensor(h, mesh, [Shard(-1)]))
    emu = emulated_row_parallel(h, w2.to(torch.bfloat16), b2.to(torch.bfloat16), world=WORLD, quant="ptpc")
    out["dtensor_in"] = {"placements": tuple(y.placements), "vs_emulated": Q.rel_l2(y.to_local(), emu)}
    # a replicated plain input (input_layouts=Replicate()): torch slices it, the layer fuses the rest
    row = parallelize_module(block()[2], mesh, FusedRowwiseParallel(m_max=M_MAX, input_layouts=Replicate()))
    out["replicated_in"] = {"vs_emulated": Q.rel_l2(row(h), emu)}
    out["state_dict_after_fusing"] = error_of(lambda: row.state_dict())
    out["not_a_linear"] = error_of(lambda: parallelize_module(torch.nn.LayerNorm(128), mesh, FusedRowwiseParallel()))
    out["uneven"] = error_of(lambda: parallelize_module(torch.nn.Linear(129, 64), mesh, FusedRowwiseParallel()))
    out["feature_scatter_output"] = error_of(lambda: FusedRowwiseParallel(output_layouts=Shard(-1)))
    out["in_step_after_errors"] = comm.all_gather_object(comm.rank)
    return out


def _rank_main(comm, ckpts):
    return {"hf": _loaded_model_checks(comm, ckpts), "dtensor": _dtensor_checks(comm)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from cco.comm import check_outcomes, spawn

    ckpts = {}
    for i, family in enumerate(FAMILIES):
        ckpts[family] = str(tmp_path_factory.mktemp(family))
        save_random_model(family_config(family), ckpts[family], seed=i)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return check_outcomes(spawn(_rank_main, world=WORLD, args=(ckpts,), timeout_s=SPAWN_TIMEOUT_S))


@pytest.mark.multirank
@pytest.mark.parametrize("family", FAMILIES)
def test_from_pretrained_with_the_cco_plan(ranks, family):
    expected = {"llama": 4, "qwen2": 4, "qwen3": 4, "mistral": 4, "deepseek_v2": 4}[family]
    for r in ranks:
        got = r["hf"][family]
        assert len(got["fused"]) == expected, got["fused"]
        assert got["weights_left"] == []  # the bf16 shard is dropped once the fp8 layer holds it
        assert got["vs_bf16"] <= FP8_TOL, got
        assert got["vs_emulated"] <= EXACT_TOL, got
        assert got["compiled_equal"] is (True if family == "qwen2" else None)  # built lazily inside torch.compile
    assert ranks[0]["hf"][family]["tokens"] == ranks[1]["hf"][family]["tokens"]


@pytest.mark.multirank
def test_deepseek_v2_fuses_attention_dense_and_shared_expert_but_not_routed_experts(ranks):
    assert sorted(ranks[0]["hf"]["deepseek_v2"]["fused"]) == [
        "model.layers.0.mlp.down_proj", "model.layers.0.self_attn.o_proj",
        "model.layers.1.mlp.shared_experts.down_proj", "model.layers.1.self_attn.o_proj"]


@pytest.mark.multirank
def test_an_already_loaded_model_parallelized_in_place(ranks):
    for r in ranks:
        got = r["hf"]["in_place"]
        assert len(got["fused"]) == 4 and got["tp_size"] == WORLD
        assert got["vs_bf16"] <= FP8_TOL and got["vs_emulated"] <= EXACT_TOL, got
        assert got["again"].startswith("ValueError: parallelize: the model is already distributed"), got["again"]


@pytest.mark.multirank
def test_refused_plans_raise_on_every_rank_and_the_ranks_stay_in_step(ranks):
    for r in ranks:
        hf, dt = r["hf"], r["dtensor"]
        assert hf["plan_names_a_norm"].startswith("TypeError: FusedRowwise: 'model.norm' is a LlamaRMSNorm, not a "
                                                  "torch.nn.Linear"), hf["plan_names_a_norm"]
        assert hf["fuse_without_plan"].startswith("ValueError: fuse: no module"), hf["fuse_without_plan"]
        # a model transformers did not shard (its tp_size None: no plan, or ranks without WORLD_SIZE) says so
        assert "did not shard this model: its tp_size is None" in hf["fuse_without_plan"], hf["fuse_without_plan"]
        assert dt["not_a_linear"].startswith("TypeError: FusedRowwiseParallel: 'LayerNorm under"), dt["not_a_linear"]
        assert "in_features=129, which does not split evenly over 2 ranks" in dt["uneven"], dt["uneven"]
        assert dt["feature_scatter_output"].startswith("ValueError: FusedRowwiseParallel: output_layouts=Shard(dim=-1)")
        assert hf["in_step_after_errors"] == dt["in_step_after_errors"] == [0, 1]


@pytest.mark.multirank
def test_parallelize_module_style_matches_torchs_rowwise_and_its_dtensor_contract(ranks):
    for r in ranks:
        dt = r["dtensor"]
        for local in (True, False):
            got = dt[f"local={local}"]
            assert got["kind"] == got["kind_torch"], got  # Tensor, or DTensor (Replicate(),) as torch's style
            assert got["vs_torch"] <= FP8_TOL and got["vs_emulated"] <= EXACT_TOL, got
            assert got["grad_x"] <= FP8_TOL, got  # input gradient through both layers, no extra reduce
            assert got["weight_dropped"]
        assert dt["dtensor_in"]["placements"] == (torch.distributed.tensor.Replicate(),)
        assert dt["dtensor_in"]["vs_emulated"] <= EXACT_TOL and dt["replicated_in"]["vs_emulated"] <= EXACT_TOL, dt


@pytest.mark.multirank
def test_a_fused_model_refuses_a_checkpoint_the_framework_could_not_load(ranks):
    """Before: ``save_pretrained`` after fusing wrote rank 0's padded fp8 shard under
    ``...down_proj.fused.qweight`` and no ``down_proj.weight``; a reload initialized those weights
    afresh (transformers' load report: MISSING / UNEXPECTED) and its logits were off by 1.4 (relative)."""
    for r in ranks:
        save, state_dict, written = r["hf"]["saved_after_fusing"]
        for err in (save, state_dict):
            assert err.startswith("RuntimeError: model.layers.0.self_attn.o_proj: fused by cco") \
                and "Save the model before fusing" in err, err
        assert not any(name.endswith(".safetensors") for name in written), written
        assert r["dtensor"]["state_dict_after_fusing"].startswith(
            "RuntimeError: Linear under FusedRowwiseParallel: fused by cco"), r["dtensor"]["state_dict_after_fusing"]
