"""Sequence-parallel layers on NVIDIA GPUs, at the world torchrun starts: ``ColumnParallelLinear(
sequence_parallel=True)`` -> silu -> ``RowParallelLinear(sequence_parallel=True)``.

    torchrun --nproc-per-node 2 -m tests.python.cco.test_cuda_sp                              # the GPU checks
    torchrun --nproc-per-node 2 -m tests.python.cco.test_cuda_sp --device cpu --dims small    # a dry run, CPU ranks

The CUDA backend runs the all-reduce pattern only: it refuses the all-gather and the reduce-scatter
along tokens, so both layers run unfused on every rank (the fp8 rows and scales gathered with
``all_gather_into_tensor`` on uint8, the fp32 partials summed with ``reduce_scatter_tensor``, both on
the layer's group: NCCL). The dry run makes the CPU backend refuse the same patterns
(``CpuBackend.patterns``), so the same unfused path runs on gloo; it has no CUDA graphs.

Guards, per quant (ptpc, blockscale, mxfp8), trainable layers, ``backward="bf16"``:
- the verdict: each layer's ``fallback_reason`` names the backend's refusal of its pattern and is
  the same on every rank; no op, no window (a rank that went fused would wait on its peer forever);
- forward and backward eager: ``h``, ``y`` element-wise within ``Q.count_mismatches`` of the unfused
  model that quantizes as the layers do (test_nn_sequence.py's reference, silu between), the
  gradients (input, both weights, the column bias) within ``GRAD_TOL`` of its straight-through ones;
  outputs and gradients within ``FP8_TOL`` of the plain bf16 model (no quantization): a gather in
  the wrong rank order, a scatter of another rank's rows, a backward that misses a rank's share;
- ``torch.compile(fullgraph=True)`` forward and backward: the eager values (see ``COMPILED_TOL``);
- the compiled forward captured in a CUDA graph, replayed with changing inputs into a NaN-poisoned
  output: the bytes of the compiled forward outside the graph, within ``count_mismatches`` of eager.

Two ranks on one GPU: NCCL refuses two ranks on one device ("Duplicate GPU detected"), and gloo
carries no CUDA tensors for all_gather / reduce_scatter (torch.distributed's backend table), so the
unfused path cannot run there. The module then probes one NCCL all-gather; where it fails, only the
verdicts run and every NCCL check prints ``CUDA_SP_SKIPPED`` with the probe's error: those checks
need one GPU per rank (two GPUs).
"""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.python.cco.torchrun_checks import nvidia_gpus, run_rank_checks

DIMS = {  # tokens S x batch B, hidden H (K of the column, N of the row: not whole 128 tiles), intermediate I
    "gpu": dict(S=64, B=4, H=1000, I=1536),
    "small": dict(S=8, B=3, H=200, I=512),
}
REPLAYS = 6
GRAD_TOL = 2e-2  # test_nn_sequence.py's bound for backward="bf16": bf16 rounding of the backward's products
FP8_TOL = 0.1  # test_nn_sequence.py's fp8 budget: e4m3 operands against the plain bf16 model
# compiled vs eager: inductor quantizes the trainable master weight and computes silu in its own
# kernels, so a value may land on the neighbouring e4m3 one; held to the eager path's bounds, not bytes
COMPILED_TOL = 1e-2


@pytest.mark.cuda
@pytest.mark.skipif(nvidia_gpus() < 1, reason="needs an NVIDIA GPU (the NCCL checks need one per rank); the CPU "
                    "path is covered by test_nn_sequence.py and test_cuda_sp_dry_run_on_cpu_ranks")
def test_cuda_sp_world2_under_torchrun():
    out = run_rank_checks("tests.python.cco.test_cuda_sp", "CUDA_SP_CHECKS PASSED")
    skipped = [line.strip() for line in out.splitlines() if "CUDA_SP_SKIPPED" in line]
    if skipped:  # the verdicts passed; the rest could not run here: say so, do not count it as passed
        pytest.skip("; ".join(skipped))


@pytest.mark.multirank
def test_cuda_sp_dry_run_on_cpu_ranks():
    """The module's checks on 2 CPU ranks (the CPU backend refusing the patterns as CUDA's does):
    the code paths of the GPU run, but the CUDA graph sub-check, on gloo."""
    from cco.comm import check_outcomes, spawn

    per_rank = check_outcomes(spawn(_spawned_rank, world=2, args=("small", ("ptpc",)), timeout_s=240))
    failures, skipped = per_rank[0]
    assert failures == [], failures
    assert [s for s in skipped if "CUDA graph" not in s] == [], skipped


def _spawned_rank(comm, dims, compile_quants):
    return run_checks(comm, DIMS[dims], lambda *a: None, compile_quants=compile_quants)


# --------------------------------------------------------------------------------------------------
# rank side
# --------------------------------------------------------------------------------------------------
def problem(d, seed=0):
    """x [S, B, H], w1 [I, H], b1 [I], w2 [H, I], grad_y [S, B, H]: bf16 values (the trainable
    layers quantize their bf16 master weights)."""
    g = torch.Generator().manual_seed(seed)
    S, B, H, I = d["S"], d["B"], d["H"], d["I"]
    x = torch.randn(S, B, H, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(I, H, generator=g) * H ** -0.5).to(torch.bfloat16)
    b1 = (torch.randn(I, generator=g) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(H, I, generator=g) * I ** -0.5).to(torch.bfloat16)
    grad_y = torch.randn(S, B, H, generator=g).to(torch.bfloat16)
    return x, w1, b1, w2, grad_y


def quantized_gemm(a, w, quant):
    """``a [M, K] @ w [N, K].T`` as the layers compute it: both quantized (K padded to whole tiles), the
    product in fp32 rounded to bf16."""
    from cco import layout
    from cco import quant as Q

    k, n = layout.padded_k(a.shape[1]), -(-w.shape[0] // 128) * 128  # blockscale's weight: whole 128-row blocks
    aq, a_s = Q.quantize_a(torch.nn.functional.pad(a.float(), (0, k - a.shape[1])), quant)
    bq, b_s = Q.quantize_b(torch.nn.functional.pad(w.float(), (0, k - w.shape[1], 0, n - w.shape[0])), quant)
    return Q.reference_gemm(aq, bq, a_s, b_s, quant)[:, :w.shape[0]]


def expected_reason(backend: str, pattern: str) -> str:
    return f"{backend}: the {backend} backend does not run the {pattern} pattern"


def _agree(comm, what: str, errors: list[str]) -> None:
    """Every rank's errors on every rank: one verdict, raised everywhere (a rank that went on alone
    would wait in the next check's collectives)."""
    every = comm.all_gather_object(errors)
    lines = [f"rank {r}: {e}" for r, errs in enumerate(every) for e in errs]
    if lines:
        raise AssertionError(f"{what}: " + "; ".join(lines))


def build_block(ctx, quant):
    """(column, row) of this rank, weights loaded, and the verdict checked."""
    from cco.nn import ColumnParallelLinear, RowParallelLinear

    comm, d = ctx["comm"], ctx["dims"]
    world, rank = comm.world, comm.rank
    _, w1, b1, w2, _ = problem(d)
    i = d["I"] // world
    col = ColumnParallelLinear(d["H"], i, group=comm, quant=quant, m_max=d["S"] * d["B"], sequence_parallel=True,
                               trainable=True, bias=True, backward="bf16")
    row = RowParallelLinear(i, d["H"], group=comm, quant=quant, m_max=d["S"] * d["B"], sequence_parallel=True,
                            trainable=True, backward="bf16")
    col.load_weight(w1[rank * i:(rank + 1) * i].to(comm.device))
    row.load_weight(w2[:, rank * i:(rank + 1) * i].to(comm.device))
    with torch.no_grad():
        col.bias.copy_(b1[rank * i:(rank + 1) * i].to(comm.device))
    errors = []
    for layer, pattern in ((col, "all-gather"), (row, "reduce-scatter-rows")):
        want = expected_reason(ctx["backend"], pattern)
        reason = layer.fallback_reason or ""
        if layer.op is not None or not reason.startswith(want) or "path=unfused" not in repr(layer):
            errors.append(f"{type(layer).__name__} {quant}: expected the unfused path for '{want}', got op "
                          f"{layer.op!r}, fallback_reason {layer.fallback_reason!r}")
        if layer._dual is not None:
            errors.append(f"{type(layer).__name__} {quant}: a fused backward op on an unfused layer")
    reasons = comm.all_gather_object((col.fallback_reason, row.fallback_reason))
    if len(set(reasons)) != 1:
        errors.append(f"{quant}: the ranks' fallback reasons differ: {reasons}")
    try:
        _agree(comm, f"verdict {quant}", errors)
    except AssertionError:
        col.close()
        row.close()
        raise
    return col, row


def check_verdicts(ctx, log):
    from cco import quant as Q

    for quant in Q.QUANTS:
        col, row = build_block(ctx, quant)
        log(f"ok verdict {quant:10s}: both layers unfused on every rank: {col.fallback_reason.split(' (')[0]} / "
            f"{row.fallback_reason.split(' (')[0]}")
        col.close()
        row.close()


def _run(col, row, fn, x_r, gy_r):
    """h, y and the gradients of ``(y * grad_y).sum()`` through ``fn``, detached, on the host."""
    col.zero_grad(set_to_none=True)
    row.zero_grad(set_to_none=True)
    x = x_r.clone().requires_grad_(True)
    h, y = fn(x)
    (y.float() * gy_r.float()).sum().backward()
    out = dict(h=h, y=y, grad_x=x.grad, grad_w1=col.weight.grad, grad_b1=col.bias.grad, grad_w2=row.weight.grad)
    return {k: v.detach().float().cpu() for k, v in out.items()}


def references(ctx, quant, hs, w1qs, w2qs):
    """This rank's share of the two unfused models, on the host, from every rank's ``h`` (so the next
    layer's quantization sees the values the ranks computed) and dequantized weights:
    ``quantized`` quantizes as the layers do (gradients straight through, dequantized weights);
    ``bf16`` is the plain model of the bf16 weights."""
    comm, d = ctx["comm"], ctx["dims"]
    world, rank = comm.world, comm.rank
    S, B, H = d["S"], d["B"], d["H"]
    x, w1, b1, w2, gy = problem(d)
    x2, gy2 = x.reshape(-1, H).float(), gy.reshape(-1, H).float()
    i, rows = d["I"] // world, slice(rank * S // world * B, (rank + 1) * S // world * B)
    w1_r, b1_r = w1[rank * i:(rank + 1) * i], b1[rank * i:(rank + 1) * i]

    def silu_grad(h):
        s = torch.sigmoid(h)
        return s * (1 + h * (1 - s))

    hs = [h.reshape(-1, i) for h in hs]
    acts = [torch.nn.functional.silu(h).to(torch.bfloat16) for h in hs]
    y = sum(quantized_gemm(a, w2[:, s * i:(s + 1) * i], quant).float() for s, a in enumerate(acts))
    dh = [(gy2 @ w2qs[s]) * silu_grad(hs[s]) for s in range(world)]
    quantized = dict(
        h=(quantized_gemm(x2, w1_r, quant).float() + b1_r.float()).to(torch.bfloat16).float(),
        y=y.to(torch.bfloat16).float()[rows],
        grad_x=sum(dh[s] @ w1qs[s] for s in range(world))[rows],
        grad_w1=dh[rank].t() @ x2, grad_b1=dh[rank].sum(0), grad_w2=gy2.t() @ acts[rank].float())
    hb = [x2 @ w1[s * i:(s + 1) * i].float().t() + b1[s * i:(s + 1) * i].float() for s in range(world)]
    ab = [torch.nn.functional.silu(h) for h in hb]
    dhb = [(gy2 @ w2[:, s * i:(s + 1) * i].float()) * silu_grad(hb[s]) for s in range(world)]
    bf16 = dict(h=hb[rank], y=sum(ab[s] @ w2[:, s * i:(s + 1) * i].float().t() for s in range(world))[rows],
                grad_x=sum(dhb[s] @ w1[s * i:(s + 1) * i].float() for s in range(world))[rows],
                grad_w1=dhb[rank].t() @ x2, grad_b1=dhb[rank].sum(0), grad_w2=gy2.t() @ ab[rank])
    return quantized, bf16


def _errors(name, got, quantized, bf16) -> list[str]:
    from cco import quant as Q

    errors = []
    for key in ("h", "y"):
        bad = Q.count_mismatches(got[key].reshape(quantized[key].shape), quantized[key])
        if bad:
            errors.append(f"{name} {key}: {bad} elements off the unfused model that quantizes as the layers do")
    for key in ("grad_x", "grad_w1", "grad_b1", "grad_w2"):
        err = Q.rel_l2(got[key].reshape(quantized[key].shape), quantized[key])
        if not err < GRAD_TOL:
            errors.append(f"{name} {key}: rel L2 {err:.2e} off the unfused model's (bound {GRAD_TOL})")
    for key in bf16:
        err = Q.rel_l2(got[key].reshape(bf16[key].shape), bf16[key])
        if not err < FP8_TOL:
            errors.append(f"{name} {key}: rel L2 {err:.2e} off the bf16 model's (fp8 budget {FP8_TOL})")
    return errors


def check_block(ctx, quant, log, *, compiled: bool):
    """Forward and backward, eager (and compiled), then the CUDA graph of the compiled forward."""
    col, row = build_block(ctx, quant)

    def block(x):
        h = col(x)
        return h, row(torch.nn.functional.silu(h))

    try:
        _block_body(ctx, quant, log, col, row, block, compiled)
    finally:
        col.close()
        row.close()


def _block_body(ctx, quant, log, col, row, block, compiled):
    from cco import quant as Q

    comm, d, dev = ctx["comm"], ctx["dims"], ctx["comm"].device
    world, rank, S = comm.world, comm.rank, d["S"]
    x, _, _, _, gy = problem(d)
    mine = slice(rank * S // world, (rank + 1) * S // world)
    x_r, gy_r = x[mine].to(dev), gy[mine].to(dev)
    results = {"eager": _run(col, row, block, x_r, gy_r)}
    if compiled:
        results["compiled"] = _run(col, row, torch.compile(block, fullgraph=True), x_r, gy_r)
    every = comm.all_gather_object(results["eager"]["h"])
    qw = comm.all_gather_object((col.dequantized_weight(*col.quantized_weight()).cpu(),
                                 row.dequantized_weight(*row.quantized_weight()).cpu()))
    quantized, bf16 = references(ctx, quant, every, [w[0] for w in qw], [w[1] for w in qw])
    errors = []
    for name, got in results.items():
        errors += _errors(f"{quant} {name}", got, quantized, bf16)
    if compiled:
        c, e = results["compiled"], results["eager"]
        for key in ("h", "y"):
            if Q.count_mismatches(c[key], e[key]):
                errors.append(f"{quant} compiled {key}: {Q.count_mismatches(c[key], e[key])} elements off eager")
        for key in ("grad_x", "grad_w1", "grad_b1", "grad_w2"):
            if not Q.rel_l2(c[key], e[key]) < COMPILED_TOL:
                errors.append(f"{quant} compiled {key}: rel L2 {Q.rel_l2(c[key], e[key]):.2e} off eager")
    _agree(comm, f"block {quant}", errors)
    e = results["eager"]
    err = {k: Q.rel_l2(e[k].reshape(quantized[k].shape), quantized[k]) for k in ("grad_x", "grad_w1", "grad_w2")}
    log(f"ok block {quant:10s} eager{' + compiled' if compiled else ''}: h, y within the element budget; "
        f"grads vs unfused rel L2 x {err['grad_x']:.1e}, w1 {err['grad_w1']:.1e}, w2 {err['grad_w2']:.1e}; "
        f"y vs bf16 model rel L2 {Q.rel_l2(e['y'].reshape(bf16['y'].shape), bf16['y']):.1e}")
    if compiled:
        ctx["graph"](ctx, quant, block, col, row, log)


def check_graph(ctx, quant, block, col, row, log):
    """The compiled forward captured in a CUDA graph, replayed with changing inputs."""
    from cco import quant as Q

    comm, d, dev = ctx["comm"], ctx["dims"], ctx["comm"].device
    world, rank, S = comm.world, comm.rank, d["S"]
    mine = slice(rank * S // world, (rank + 1) * S // world)
    xs = [problem(d, seed)[0][mine].to(dev) for seed in (1, 2)]
    col.eval()
    row.eval()  # the stored fp8 weights: no master to requantize in the graph

    def forward(x):
        return block(x)[1]

    compiled = torch.compile(forward, fullgraph=True)
    with torch.no_grad():
        eager = [forward(x).clone() for x in xs]
        outside = [compiled(x).clone() for x in xs]
        static = xs[0].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            compiled(static)  # warm outside the capture (NCCL's communicator exists before it)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        comm.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = compiled(static)
        torch.cuda.synchronize()
        comm.barrier()
        errors = []
        for i in range(REPLAYS):
            static.copy_(xs[i % 2])
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            if not torch.equal(out, outside[i % 2]):
                errors.append(f"replay {i}: differs from the compiled forward outside the graph")
            elif Q.count_mismatches(out, eager[i % 2]):
                errors.append(f"replay {i}: {Q.count_mismatches(out, eager[i % 2])} elements off eager")
    _agree(comm, f"CUDA graph {quant}", errors)
    log(f"ok CUDA graph {quant:10s}: compiled forward captured (NCCL all-gather + reduce-scatter inside), "
        f"{REPLAYS} replays with changing inputs into a NaN-poisoned output == compiled bytes, eager's values")


def probe_nccl(comm) -> str | None:
    """None where the unfused path's collectives run on the device's tensors (one uint8 all-gather on
    the communicator's group), else why not, the same on every rank."""
    import torch.distributed as dist

    why = None
    try:
        x = torch.full((4,), comm.rank, dtype=torch.uint8, device=comm.device)
        out = torch.empty(4 * comm.world, dtype=torch.uint8, device=comm.device)
        dist.all_gather_into_tensor(out, x, group=comm.group)
        torch.cuda.synchronize()
        if out.cpu().tolist() != [r for r in range(comm.world) for _ in range(4)]:
            why = f"the probe all-gather returned {out.cpu().tolist()}"
    except Exception as err:  # NCCL refuses two ranks on one device at its init
        why = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
    every = comm.all_gather_object(why)
    return next((w for w in every if w is not None), None)


def run_checks(comm, dims: dict, log, *, compile_quants=None) -> tuple[list[str], list[str]]:
    """Every check on this rank: (failures, skipped sub-checks with why), the same on every rank.
    ``compile_quants``: the quants whose block also runs compiled (None: all)."""
    from cco import quant as Q
    from cco.backends.cpu import CpuBackend

    ctx = {"comm": comm, "dims": dims, "backend": comm.device.type, "graph": check_graph}
    skipped = []
    if comm.device.type == "cpu":  # the dry run: refuse the patterns as the CUDA backend does
        CpuBackend.patterns = ("all-reduce",)
        ctx["graph"] = lambda *a: None
        skipped.append("CUDA graph: no CUDA graphs on CPU ranks")
        if compile_quants is None or "mxfp8" in compile_quants:
            # a trainable mxfp8 layer's compiled forward quantizes its weight to e8m0 scales in inductor
            compile_quants = [q for q in (compile_quants or Q.QUANTS) if q != "mxfp8"]
            skipped.append("block mxfp8 compiled: inductor's C++ (CPU) codegen has no float8_e8m0fnu")
    nccl = None
    if comm.device.type == "cuda":
        from cco.window import ranks_share_a_device

        shared = ranks_share_a_device(comm)
        log("the ranks share one GPU" if shared else "one GPU per rank")
        if shared:
            nccl = probe_nccl(comm)
    checks = [("verdicts", lambda: check_verdicts(ctx, log))]
    for quant in Q.QUANTS:
        compiled = compile_quants is None or quant in compile_quants
        checks.append((f"block {quant}", lambda q=quant, c=compiled: check_block(ctx, q, log, compiled=c)))
    failures = []
    for name, check in checks:  # keep going so one run reports every failing check
        if nccl is not None and name != "verdicts":
            skipped.append(f"{name}: the unfused collectives cannot run with two ranks on one GPU (NCCL: {nccl}; "
                           f"gloo carries no CUDA all_gather/reduce_scatter): needs one GPU per rank")
            continue
        try:
            check()
        except Exception as err:
            failures.append(f"{name}: {type(err).__name__}: {err}")
            log("FAIL", failures[-1])
        if comm.device.type == "cuda":
            torch.cuda.synchronize()
        comm.barrier()
    return failures, skipped


def rank_main(argv=None):
    from cco.comm import Communicator

    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node 2 -m tests.python.cco.test_cuda_sp")
    p.add_argument("--dims", choices=sorted(DIMS), default="gpu")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    opts = p.parse_args(argv)
    comm = Communicator.from_env(device="cpu" if opts.device == "cpu" else None)
    if opts.device == "cuda" and comm.device.type != "cuda":
        raise SystemExit(f"test_cuda_sp: no CUDA device here ({comm.device}); pass --device cpu --dims small")
    log = (lambda *a: print(*a, flush=True)) if comm.rank == 0 else (lambda *a: None)
    log(f"dims {opts.dims} {DIMS[opts.dims]}, world {comm.world}, device {comm.device.type}")
    failures, skipped = run_checks(comm, DIMS[opts.dims], log)
    for why in skipped:
        log(f"CUDA_SP_SKIPPED {why}")
    if failures:
        raise SystemExit("CUDA_SP_CHECKS FAILED:\n" + "\n".join(failures))
    log("CUDA_SP_CHECKS PASSED" + (f" ({len(skipped)} sub-checks skipped, above)" if skipped else ""))
    comm.close()


if __name__ == "__main__":
    rank_main()
