"""``cco.integrations`` on NVIDIA GPUs at Llama-3-8B layer dims, at the world torchrun starts.

    torchrun --nproc-per-node 2 -m tests.python.cco.test_cuda_hf                 # the GPU checks
    torchrun --nproc-per-node 2 -m tests.python.cco.test_cuda_hf --dims small    # a dry run (CPU ranks here)

The pytest test launches the first where there is an NVIDIA GPU and transformers, and is skipped
elsewhere (the CPU path is covered by test_hf_tp.py). Two ranks may share one GPU (the fused layers'
windows go through CUDA IPC); NCCL refuses two ranks on one device, so there the plan leaves
``lm_head`` whole on every rank (its "colwise_gather_output" all-gathers over NCCL) and the DTensor
check skips torch's own RowwiseParallel (an NCCL all-reduce) and compares with the emulated layer only.

Rank 0 saves a random Llama with Llama-3-8B layers (hidden 4096, intermediate 14336, 32 heads, 8 KV
heads; ``LAYERS`` layers, a small vocabulary; row-parallel biases on, so the bias path runs too) with
``save_pretrained``. A check's verdict is agreed by all ranks before any rank goes on. Guards, per quant:
- ``from_pretrained`` with the cco plan: prefill logits within the fp8 budget of the bf16 model and
  within ``EMULATED_TOL`` of the bf16 model whose o_proj/down_proj compute as the fused layers do;
- the same forward under ``torch.compile`` (inductor): within ``COMPILED_TOL`` of eager;
- greedy ``generate`` with the KV cache, eager (every quant) and with a compiled forward (ptpc):
  tokens identical on both ranks;
then the in-place path (``parallelize``) and ``FusedRowwiseParallel`` on the 8B down_proj shape,
eager and compiled; then a DeepSeek-style fp8 block checkpoint (a small Llama, every ``*_proj`` e4m3
+ ``weight_scale_inv`` per 128x128 block) through ``tp_plan(path)``: transformers keeps it in fp8 on
sm89+ (its ``FP8Linear`` modules), the fused layers must hold exactly the checkpoint's K shards and the
logits stay within the fp8 budget of the dequantized bf16 model (``check_fp8_checkpoint``); and
a static KV cache decode whose step is captured into a CUDA graph: the replays' greedy tokens equal
the eager steps' (``check_graph_decode``).

    torchrun --nproc-per-node 2 -m tests.python.cco.test_cuda_hf --only fp8_checkpoint   # that check alone
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from tests.python.cco.torchrun_checks import nvidia_gpus, run_rank_checks

DIMS = {  # Llama-3-8B's layer; "small" for a dry run of this module on CPU ranks
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, vocab_size=4096),
    "small": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  vocab_size=512),
}
LAYERS = 2
PROMPT = (2, 64)  # batch x tokens of the prefill
NEW_TOKENS = 8
GRAPH_TOKENS = 16  # decode steps of the static-cache check, eager and replayed
M_MAX = 512
# The model-level bounds are gross-error bounds. At Llama-3-8B dims this random 2-layer model amplifies
# bf16 rounding by itself: on an H200 (2026-12-02 19:57 UTC) its compiled logits differed from its eager
# ones by 0.054-0.059 rel. L2 with the same fused layers, eager vs the emulated fused model by 0.037-0.041
# and eager vs bf16 by 0.084-0.087, for every quant; the bounds first set from the small CPU dims (0.02,
# 0.03, 0.08) failed on that noise, not on a wrong layer. What they must catch are wiring errors: a
# wrong K shard or a bias added on every rank gave 0.28-0.96 (tests/python/cco/test_hf_tp.py's broken
# variants). The layer's own numerics are held tightly by check_dtensor_style (one layer, no model:
# 3.8e-3 vs the emulated layer, compiled == eager).
EMULATED_TOL = 0.15  # vs the emulated fused model
COMPILED_TOL = 0.15  # compiled vs eager
MODEL_FP8_TOL = 0.15  # vs the bf16 model
LAYER_EMULATED_TOL = 2e-2  # one fused layer vs its emulation: bf16 GEMMs on column slices vs whole
LAYER_COMPILED_TOL = 3e-2  # one fused layer, compiled vs eager


@pytest.mark.cuda
@pytest.mark.skipif(nvidia_gpus() < 1, reason="needs an NVIDIA GPU (two ranks share one if there is only one); the "
                    "CPU path is covered by test_hf_tp.py")
def test_cuda_hf_world2_under_torchrun():
    pytest.importorskip("transformers")
    run_rank_checks("tests.python.cco.test_cuda_hf", "CUDA_HF_CHECKS PASSED", timeout_s=1800)


# --------------------------------------------------------------------------------------------------
# rank side (torchrun)
# --------------------------------------------------------------------------------------------------
def _same_on_every_rank(value) -> bool:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return all(v == values[0] for v in values)


def _agree(what: str, errs: dict) -> None:
    """Raise on every rank if any rank's errors are over their tolerances (``{name: (err, tol)}``), so
    that no rank goes on into the next collective while a peer has left the check."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {k: v for k, v in errs.items() if not v[0] <= v[1]})
    bad = {f"rank {r}": b for r, b in enumerate(every) if b}
    if bad:
        raise AssertionError(f"{what}: rel L2 over the tolerance: {bad}")


def _close(model) -> None:
    from cco.nn import RowParallelLinear

    for m in model.modules():
        if isinstance(m, RowParallelLinear):
            m.close()


@torch.no_grad()
def check_quant(ctx, quant, log):
    from cco import quant as Q
    from examples.hf_generate import load_tensor_parallel
    from tests.python.cco.hf_models import emulate_fused

    ref, ids = ctx["ref"](), ctx["ids"]
    ref_logits = ref(input_ids=ids, use_cache=False).logits.float()
    model, names = load_tensor_parallel(ctx["path"], quant=quant, m_max=M_MAX, shared_gpu=ctx["shared_gpu"])
    if len(names) != 2 * LAYERS:
        raise AssertionError(f"{quant}: fused {names}, expected o_proj and down_proj of {LAYERS} layers")
    eager = model(input_ids=ids, use_cache=False).logits.float()
    emulated = emulate_fused(ref, names, world=dist.get_world_size(), quant=quant)(input_ids=ids,
                                                                                   use_cache=False).logits.float()
    compiled = torch.compile(model.forward)(input_ids=ids, use_cache=False).logits.float()
    errs = {"eager vs bf16": (Q.rel_l2(eager, ref_logits), MODEL_FP8_TOL),
            "eager vs emulated": (Q.rel_l2(eager, emulated), EMULATED_TOL),
            "compiled vs bf16": (Q.rel_l2(compiled, ref_logits), MODEL_FP8_TOL),
            "compiled vs eager": (Q.rel_l2(compiled, eager), COMPILED_TOL)}
    _agree(quant, errs)
    greedy = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    tokens = model.generate(input_ids=ids, **greedy)[:, ids.shape[1]:].tolist()
    if not _same_on_every_rank(tokens):
        raise AssertionError(f"{quant}: eager greedy tokens differ between ranks")
    line = ", ".join(f"{k} {v[0]:.1e}" for k, v in errs.items())
    if quant == "ptpc":
        model.forward = torch.compile(model.forward, dynamic=True)
        compiled_tokens = model.generate(input_ids=ids, **greedy)[:, ids.shape[1]:].tolist()
        if not _same_on_every_rank(compiled_tokens):
            raise AssertionError(f"{quant}: compiled greedy tokens differ between ranks")
        line += f"; compiled generate: same tokens on every rank ({'=' if compiled_tokens == tokens else '!='} eager)"
    log(f"ok hf {quant:10s} rel L2 {line}; eager generate: same tokens on every rank")
    _close(model)
    del model, ref
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@torch.no_grad()
def check_in_place(ctx, log):
    from cco import quant as Q
    from cco.integrations import hf as cco_hf

    ref, ids = ctx["ref"](), ctx["ids"]
    ref_logits = ref(input_ids=ids, use_cache=False).logits.float()
    model = ctx["ref"]()
    if ctx["shared_gpu"]:  # parallelize() takes the model's whole plan; keep lm_head local (docstring)
        model._tp_plan.pop("lm_head", None)
    cco_hf.parallelize(model, quant="ptpc", m_max=M_MAX)
    err = Q.rel_l2(model(input_ids=ids, use_cache=False).logits.float(), ref_logits)
    _agree("in place", {"vs bf16": (err, MODEL_FP8_TOL)})
    log(f"ok hf in place (parallelize, ptpc): rel L2 {err:.1e} vs bf16")
    _close(model)


def check_dtensor_style(ctx, log):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from cco import quant as Q
    from cco.integrations.dtensor import FusedRowwiseParallel
    from examples.hf_generate import FP8_TOL
    from tests.python.cco.hf_models import emulated_row_parallel

    dims, dev, world = ctx["dims"], ctx["device"], dist.get_world_size()
    hidden, inter = dims["hidden_size"], dims["intermediate_size"]
    g = torch.Generator().manual_seed(11)
    w1 = (torch.randn(inter, hidden, generator=g) * hidden ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(hidden, inter, generator=g) * inter ** -0.5).to(torch.bfloat16)
    x = torch.randn(*PROMPT, hidden, generator=g).to(torch.bfloat16).to(dev)
    mesh = init_device_mesh(dev.type, (world,))

    def block(row_style):
        m = torch.nn.Sequential(torch.nn.Linear(hidden, inter, bias=False), torch.nn.SiLU(),
                                torch.nn.Linear(inter, hidden, bias=False)).to(torch.bfloat16)
        with torch.no_grad():
            m[0].weight.copy_(w1), m[2].weight.copy_(w2)
        # every rank holds the same weights: each keeps its shard, no scatter (no NCCL between shared ranks)
        return parallelize_module(m.to(dev), mesh, {"0": ColwiseParallel(), "2": row_style}, src_data_rank=None)

    fused = block(FusedRowwiseParallel(quant="ptpc", m_max=M_MAX))
    with torch.no_grad():
        h = torch.nn.functional.silu(x @ w1.to(dev).t())
        emu = emulated_row_parallel(h, w2.to(dev), None, world=world, quant="ptpc")
        y = fused(x)
        yc = torch.compile(fused)(x)
    errs = {"eager vs emulated": (Q.rel_l2(y, emu), LAYER_EMULATED_TOL),
            "compiled vs eager": (Q.rel_l2(yc, y), LAYER_COMPILED_TOL)}
    if not ctx["shared_gpu"]:
        with torch.no_grad():
            errs["eager vs torch RowwiseParallel"] = (Q.rel_l2(y, block(RowwiseParallel())(x)), FP8_TOL)
    _agree(f"FusedRowwiseParallel [{inter} -> {hidden}]", errs)
    log(f"ok FusedRowwiseParallel {inter} -> {hidden}: " + ", ".join(f"{k} {v[0]:.1e}" for k, v in errs.items()))
    _close(fused)


@torch.no_grad()
def check_graph_decode(ctx, log):
    """The plan's model decoding with transformers' static KV cache (batch 1), one step captured into a
    CUDA graph and replayed: the replays' greedy tokens equal the eager steps' from the same state, on
    every rank (the fused layers' calls replayed, their waits and stamps per replay). CPU ranks run
    the eager steps only."""
    from examples.hf_generate import load_tensor_parallel
    from scripts.bench_decode import Decoder

    model, _ = load_tensor_parallel(ctx["path"], quant="ptpc", m_max=M_MAX, shared_gpu=ctx["shared_gpu"])
    dec = Decoder(model, batch=1, prompt=PROMPT[1], tokens=GRAPH_TOKENS, device=ctx["device"])
    dec.prefill()
    dec.mark()

    def decode(step):
        dec.rewind()
        ids = []
        for _ in range(GRAPH_TOKENS):
            step()
            ids.append(int(dec.ids[0, 0]))
        return ids

    eager = decode(dec.step)
    problems = [] if _same_on_every_rank(eager) else [f"eager static-cache tokens differ between ranks: {eager}"]
    graphed = None
    if ctx["device"].type == "cuda":
        graph = dec.capture()
        graphed = decode(graph.replay)
        if graphed != eager:
            problems.append(f"graph replays decoded {graphed}, the eager steps {eager}")
        del graph
    _agree_facts("static-cache decode", problems)
    log(f"ok hf static KV cache, {GRAPH_TOKENS} greedy steps (ptpc): eager tokens the same on every rank"
        + ("" if graphed is None else "; one captured step replayed: the same tokens"))
    _close(model)


def _agree_facts(what: str, problems: list[str]) -> None:
    """Raise on every rank if any rank found a problem, naming each rank's."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, problems)
    bad = {f"rank {r}": p for r, p in enumerate(every) if p}
    if bad:
        raise AssertionError(f"{what}: {bad}")


@torch.no_grad()
def check_fp8_checkpoint(ctx, log):
    """A DeepSeek-style fp8 checkpoint (``quantization_config`` fp8, 128x128 ``weight_scale_inv``)
    loaded with ``tp_plan(path)``. On sm89+ transformers keeps it in fp8: every Linear becomes its
    ``FP8Linear`` (e4m3 ``weight`` and ``weight_scale_inv``, both sharded along K by the row-wise
    plan); the fused layers take those bytes and scales, checked equal to the checkpoint's.
    Guards: the modules are FP8Linear with e4m3 weights before fusing (the GPU path was taken); each
    fused layer's weight equals the checkpoint's K shard exactly; the logits are within
    ``MODEL_FP8_TOL`` of the model transformers dequantizes to bf16 (``dequantize=True``).

    q/k/v and gate/up stay transformers' FP8Linear and run its fp8 kernel, which transformers fetches
    from the Hugging Face Hub (the ``kernels`` package). Where it cannot be loaded (no package, no
    network) they run ``x @ dequantize(W).T`` instead, and the log line says so; on CPU ranks (a dry
    run) transformers is also made to take its sm89+ path (``hf_models.fp8_linear_path``)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, DistributedConfig, FineGrainedFP8Config

    from cco import quant as Q
    from cco.integrations import hf as cco_hf
    from tests.python.cco.hf_models import (checkpoint_weight, fp8_kernel_error, fp8_linear_path, fp8_llama_config,
                                            write_fp8_llama)

    dev, rank = ctx["device"], dist.get_rank()
    path = os.path.join(ctx["path"], "fp8-checkpoint")  # removed with the folder
    if rank == 0:
        write_fp8_llama(path)
    dist.barrier()
    ids = torch.randint(0, fp8_llama_config().vocab_size, PROMPT, generator=torch.Generator().manual_seed(2)).to(dev)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                               quantization_config=FineGrainedFP8Config(dequantize=True))
    ref_logits = ref.to(dev).eval()(input_ids=ids, use_cache=False).logits.float()
    del ref
    why = [fp8_kernel_error() if dev.type == "cuda" else "CPU ranks"]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, why[0])
    kernel_missing = next((w for w in every if w), None)  # one choice for every rank
    with fp8_linear_path(as_on_sm89=dev.type != "cuda", reference_kernel=kernel_missing is not None):
        plan = cco_hf.tp_plan(path, m_max=M_MAX)
        if ctx["shared_gpu"]:  # NCCL refuses two ranks on one GPU (module docstring)
            plan.pop("lm_head", None)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                     distributed_config=DistributedConfig(tp_plan=plan))
        problems = []
        for name in (f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.o_proj", "mlp.down_proj")):
            mod = model.get_submodule(name)
            if type(mod).__name__ != "FP8Linear" or mod.weight.dtype != Q.FP8:
                problems.append(f"{name} is a {type(mod).__name__} with a {mod.weight.dtype} weight, not transformers' "
                                f"FP8Linear with e4m3: the fp8 path was not taken")
        names = cco_hf.fuse(model)
        tensors = load_file(os.path.join(path, "model.safetensors"))
        for name in names:
            layer = model.get_submodule(name).fused
            k = layer.in_features_per_rank
            want = checkpoint_weight(tensors, f"{name}.weight")[:, rank * k:(rank + 1) * k]
            if not torch.equal(layer.dequantized_weight().float().cpu(), want):
                problems.append(f"{name}: the fused layer's weight is not the checkpoint's K shard")
        if len(names) != 4:
            problems.append(f"fused {names}, expected o_proj and down_proj of 2 layers")
        logits = model(input_ids=ids, use_cache=False).logits.float()
    _agree_facts("fp8 checkpoint", problems)
    err = Q.rel_l2(logits, ref_logits)
    _agree("fp8 checkpoint", {"vs dequantized bf16": (err, MODEL_FP8_TOL)})
    kernel = "FP8Linear's kernel" if kernel_missing is None else f"x @ dequantize(W).T for FP8Linear ({kernel_missing})"
    log(f"ok hf fp8 checkpoint (FP8Linear modules, blockscale): {len(names)} fused layers hold the checkpoint's "
        f"shards exactly; rel L2 {err:.1e} vs the dequantized bf16 model; q/k/v, gate/up: {kernel}")
    _close(model)


CHECKS = ("in_place", "dtensor", "graph_decode", "fp8_checkpoint")  # besides one per quant


def rank_main(argv=None):
    from cco import quant as Q
    from examples.hf_generate import save_random_model, tiny_llama_config

    opts = _parse(argv)
    world = int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        os.environ["LOCAL_RANK"] = str(local)  # transformers places a rank on cuda:LOCAL_RANK: the GPU it has
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    shared_gpu = device.type == "cuda" and torch.cuda.device_count() < world
    log(f"dims {opts.dims}, {LAYERS} layers, world {world}, device {device.type}"
        + (", ranks share a GPU" if shared_gpu else ""))
    folder = [tempfile.mkdtemp(prefix="cco-cuda-hf-") if rank == 0 else None]
    if rank == 0:
        save_random_model(tiny_llama_config(num_hidden_layers=LAYERS, **DIMS[opts.dims]), folder[0])
    dist.broadcast_object_list(folder, src=0)

    def reference():
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(folder[0], dtype=torch.bfloat16).to(device).eval()

    ids = torch.randint(0, DIMS[opts.dims]["vocab_size"], PROMPT, generator=torch.Generator().manual_seed(1))
    ctx = {"path": folder[0], "ref": reference, "ids": ids.to(device), "shared_gpu": shared_gpu, "device": device,
           "dims": DIMS[opts.dims]}
    named = {**{q: lambda q=q: check_quant(ctx, q, log) for q in Q.QUANTS},
             "in_place": lambda: check_in_place(ctx, log), "dtensor": lambda: check_dtensor_style(ctx, log),
             "graph_decode": lambda: check_graph_decode(ctx, log),
             "fp8_checkpoint": lambda: check_fp8_checkpoint(ctx, log)}
    failures = []
    for name in opts.only or named:  # keep going so one run reports every failing check
        t0 = time.monotonic()
        try:
            named[name]()
        except Exception as err:
            failures.append(f"{type(err).__name__}: {err}")
            log("FAIL", failures[-1])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dist.barrier()
        log(f"check {name}: {time.monotonic() - t0:.1f} s")  # the suite must fit one device call
    if rank == 0:
        shutil.rmtree(folder[0], ignore_errors=True)
    if failures:
        raise SystemExit("CUDA_HF_CHECKS FAILED:\n" + "\n".join(failures))
    log("CUDA_HF_CHECKS PASSED")
    dist.destroy_process_group()


def _quants():
    from cco import quant as Q

    return Q.QUANTS


def _parse(argv):
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node 2 -m tests.python.cco.test_cuda_hf")
    p.add_argument("--dims", choices=sorted(DIMS), default="llama3-8b")
    p.add_argument("--only", nargs="+", choices=[*_quants(), *CHECKS], help="run these checks only (default: all)")
    return p.parse_args(argv)


if __name__ == "__main__":
    rank_main()
