"""The op on NVIDIA GPUs: Triton GEMM, copy-engine and lsa transports, at the world torchrun starts.

The GPU checks run in rank processes started by torchrun; the pytest test launches them when the
machine has an NVIDIA GPU and is skipped (with the reason) elsewhere. One host test (no GPU)
replays the transport's submission order on in-order queues. Run the GPU part by hand with::

    torchrun --nproc-per-node 2 -m tests.python.cco.test_cuda_op
    torchrun --nproc-per-node 4 -m tests.python.cco.test_cuda_op --quant ptpc   # any world; per format

With two GPUs each rank has its own and the bytes cross the link. With one, both ranks share it
through a CUDA IPC window (``cco.window.IpcWindow``): the GPU time-slices the two processes, each
rank's copy engines still run beside its own kernels, and the checks below hold the protocol to the
same standard (removing the scatter's wait on the GEMM's counter, or the reduce's wait on the peer's
flag, fails them there too), but the run says nothing about speed.

Guards, per check:
- every quant x mode (gemm-only by the measured rule and forced to the own kernel, split, fused,
  fused with fp8 gather) x transport (dma, lsa, and auto switching between them; dma with each
  producer of the partial: the quant's measured pick ``DMA_PRODUCER``, the vendor GEMM per chunk,
  the fused Triton kernel; and dma with its alternatives: the own tiles reduced in the GEMM's
  epilogue, flags set by a stream write-value, two put lanes, chunks of unequal sizes, eight of
  them) against the fp32 reference sum: a wrong scale, tile order, chunk row range, counter
  release, pitched put or peer slot shows as element mismatches;
- ``self_test()`` passes, and fails with a silent transport (flags released, no bytes moved), so
  the self-test can catch the trap it exists for;
- 100 fused launches into NaN-poisoned outputs and NaN-poisoned recv/gather regions, inputs
  alternating between two sets: a chunk that is never copied, copied before its tiles are stored, or
  read before it lands leaves NaN or the other set's values;
- CUDA graph capture and 100 replays with the inputs changed between replays: a wait whose target
  does not hold on replay passes early and reads stale or NaN data;
- alternating M between calls of one op (chunk rows, counter targets and tile tables per M; with
  transport "auto" the calls also alternate between the lsa kernel and the copy engines);
- ``kernels_fused.hopper.vendor.takes_rows`` says exactly which row counts cuBLAS's blockwise recipe
  runs (correctly) and which it refuses: a rule that let a refused M through would fail the call;
  and it sends no K to cuBLAS where cuBLAS computes wrongly (it logs what cuBLAS returns at the K
  it does not send: 18 and 25 scale columns).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from cco import layout
from cco.cuda.dma import PRODUCER_STREAMS
from tests.python.cco.torchrun_checks import nvidia_gpus, run_rank_checks

M, N, K = 1000, 2048, 512  # M not a multiple of the 128-row tile on purpose
REPEATS = 100


@pytest.mark.cuda
@pytest.mark.skipif(nvidia_gpus() < 1, reason="needs an NVIDIA GPU (two ranks share one if there is only one); the CPU "
                    "path is covered by the host and multirank tests")
def test_cuda_op_world2_under_torchrun():
    run_rank_checks("tests.python.cco.test_cuda_op", "CUDA_OP_CHECKS PASSED")


def _drains(order_of, *, world: int, chunks: int) -> bool:
    """Replay every rank's side-stream submissions on ONE in-order hardware queue per rank (the worst
    multiplexing of streams onto queues) and report whether every step completes.

    A reduce of chunk c needs every peer's scatter of c to this rank, a gather of c this rank's
    reduce of c, an assemble of c every peer's gather of c; the GEMM has run."""
    queues = [list(order_of(chunks)) for _ in range(world)]
    done = [set() for _ in range(world)]
    needs = {
        "scatter": lambda r, c: True,
        "reduce": lambda r, c: all(("scatter", c) in done[p] for p in range(world) if p != r),
        "gather": lambda r, c: ("reduce", c) in done[r],
        "assemble": lambda r, c: all(("gather", c) in done[p] for p in range(world) if p != r),
    }
    progress = True
    while progress:
        progress = False
        for r in range(world):
            while queues[r] and needs[queues[r][0][0]](r, queues[r][0][1]):
                done[r].add(queues[r].pop(0))
                progress = True
    return not any(queues)


def _reduces_first(chunks):
    """The order that hung on the H200s: every reduce submitted before the puts."""
    return ([("reduce", c) for c in range(chunks)]
            + [step for c in range(chunks) for step in (("scatter", c), ("gather", c))]
            + [("assemble", c) for c in range(chunks)])


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("chunks", [1, 2, 4, 8])
def test_submission_order_cannot_deadlock_on_shared_queues(world, chunks):
    """Streams share a few hardware queues; a blocked wait holds what was submitted after it. The
    shipped order drains even with one queue per rank; the reduces-first order deadlocks there."""
    from cco.cuda.dma import submission_order

    def scatters_first(c):
        return submission_order(c, scatters_first=True)

    assert _drains(submission_order, world=world, chunks=chunks)
    assert _drains(scatters_first, world=world, chunks=chunks)
    assert not _drains(_reduces_first, world=world, chunks=chunks)
    for steps in (submission_order(chunks), scatters_first(chunks)):
        for phase in ("scatter", "reduce", "gather", "assemble"):  # every step exactly once
            assert sorted(c for p, c in steps if p == phase) == list(range(chunks))


@pytest.mark.parametrize("quant", layout.QUANTS)
@pytest.mark.parametrize("world", [2, 4, 8])
def test_fused_launch_runs_the_tuned_kernel_tile_over_whole_layout_tiles(quant, world):
    """The layout's m-tile is the fused kernel's per quant (blockscale's 64-row programs, three to an
    SM, were measured 1.3x faster than 128-row ones): the fused launch must run the tuned config
    itself, not the layout's 128 rows with the tuned warps, and each program must cover one layout
    tile or two side by side, so that every counter reaches its target exactly."""
    from cco.backends.cuda import CudaBackend, fused_config, fused_table
    from kernels_fused.hopper.gemm import default_config

    block_m, block_n = CudaBackend.tile(quant)
    cfg = layout.build_config(n=7168, k=2048, m_max=4096, world=world, quant=quant, block_m=block_m,
                              block_n=block_n)
    kernel, weight = fused_config(cfg)
    tuned = default_config(quant)
    assert (kernel.block_m, kernel.num_warps, kernel.num_stages) == (tuned.block_m, tuned.num_warps, tuned.num_stages)
    assert kernel.block_m == cfg.block_m and kernel.block_n == weight * cfg.block_n and weight in (1, 2)
    m = 1000  # not a whole number of tiles
    table = fused_table(cfg, m=m, rank=world - 1, dest_major=True, tile_weight=weight, device="cpu")
    plan = layout.plan_call(cfg, m=m, seq=1, rank=world - 1, counter_base=layout.zero_counters(world))
    added = {}
    for chunk, dest, row0, col0 in table.tolist():
        assert row0 % kernel.block_m == 0 and col0 % kernel.block_n == 0
        added[dest, chunk] = added.get((dest, chunk), 0) + weight
    assert added == {(d, c): plan.target(d, c) for d in range(world) for c in range(plan.chunks)}


def test_graph_cache_captures_at_the_second_sighting_and_keeps_the_recent():
    """Eager dma calls replay captured side work: never for a key seen once, from the second sighting
    on, and only the most recently used keys keep a graph (the GPU run counts real replays)."""
    from cco.cuda.dma import GraphCache

    cache = GraphCache(size=2, replays_per_capture=0)  # the capture budget: next test
    assert cache.lookup("a") == (None, False)  # first sighting: enqueue, no capture
    assert cache.lookup("a") == (None, True)  # second: capture now
    cache.store("a", "graph a")
    assert cache.lookup("a") == ("graph a", False)
    for key in ("b", "c"):
        cache.lookup(key)
        assert cache.lookup(key) == (None, True)
        cache.store(key, f"graph {key}")
    assert cache.lookup("a") == (None, False)  # evicted (least recently used), and seen afresh
    assert cache.lookup("c") == ("graph c", False) and cache.lookup("b") == ("graph b", False)
    for i in range(100):  # one-off keys are forgotten, not hoarded
        cache.lookup(("once", i))
    assert len(cache.seen) <= 4 * cache.size and len(cache.graphs) == 2


@pytest.mark.parametrize("keys", [4, 8, 12, 32])
def test_graph_cache_does_not_recapture_a_working_set_larger_than_itself(keys):
    """Keys cycling through the cache (a model's layers, each call a new ``out``): a working set that
    fits is captured once and then only replayed; one that does not must not evict and recapture
    graphs call after call (each capture costs far more host time than an eager call)."""
    from cco.cuda.dma import GraphCache

    cache = GraphCache(size=8, replays_per_capture=8)
    cycles = 50
    for _ in range(cycles):
        for k in range(keys):
            graph, capture = cache.lookup(k)
            if capture:
                cache.store(k, f"graph {k}")
    calls = cycles * keys
    if keys <= cache.size:
        assert cache.captures == keys and cache.replays == calls - 2 * keys
    else:
        assert cache.captures <= cache.size + cache.replays // 8 + 1
        assert cache.captures < calls // 8


# --------------------------------------------------------------------------------------------------
# rank side (torchrun)
# --------------------------------------------------------------------------------------------------
def _reference_sum(prob):
    """All-reduce reference: (sum of fp32 partials, sum of |partials|, sum of |A| @ |B|.T), summed on
    the host so that it holds when the ranks share a GPU."""
    from cco.bench.timing import allreduce_terms, budget_terms

    return allreduce_terms(*budget_terms(prob), on_host=True)


def _check(out, ref, *, quant: str, fp8_gather: bool, what: str):
    """``ref``: (local fp32 GEMM, |A| @ |B|.T), or the all-reduce reference of ``_reference_sum``."""
    from cco import quant as Q
    from cco.bench.timing import allreduce_mismatches, gemm_mismatches

    tol = Q.REL_L2_TOL_FP8_GATHER if fp8_gather else Q.REL_L2_TOL[quant]
    if len(ref) == 3:
        ref, abs_sum, dot_abs_sum = ref
        bad = allreduce_mismatches(out, ref, abs_sum, dot_abs_sum, fp8_gather=fp8_gather)
    else:
        ref, dot_abs = ref
        bad = gemm_mismatches(out, ref, dot_abs)
    err = Q.rel_l2(out, ref)
    if not (err <= tol and bad == 0):
        raise AssertionError(f"{what}: rel_l2={err:.3e} (tol {tol:.1e}), {bad} bad elements")
    return err


# (mode, gather, transport) checked per quant; the bf16 fused arms also get the repeat, graph and M checks
ARMS = (("gemm-only", "bf16", None), ("gemm-only", "bf16", "own"), ("split", "bf16", "dma"),
        ("split", "bf16", "dma-vendor"), ("fused", "bf16", "dma"), ("fused", "fp8", "dma"),
        ("fused", "bf16", "dma-vendor"), ("fused", "fp8", "dma-vendor"), ("fused", "bf16", "dma-kernel"),
        ("fused", "bf16", "lsa"), ("fused", "fp8", "lsa"), ("fused", "bf16", "auto"),
        ("fused", "bf16", "dma-alt"), ("fused", "fp8", "dma-alt"), ("fused", "bf16", "dma-taper"),
        ("fused", "fp8", "dma-taper"))
# transport -> (real transport, backend overrides, op options). "own": gemm-only forced to the own
# Triton kernel (GemmConfig overrides the measured rule); "dma-vendor" / "dma-kernel": the copy engines
# with that producer whatever DMA_PRODUCER picks; "dma-alt": the copy engines with the other setting
# of each knob of cco.backends.cuda / cco.cuda.dma (the kernel producer, which alone can reduce in its
# epilogue), and chunks of unequal sizes; "dma-taper": the default knobs with two put lanes and the
# benchmark's taper (8 chunks), and the vendor producer on the other number of streams than the default
ALTERNATIVES = {"own": (None, {"gemm_config": "own"}, {}),
                "dma-vendor": ("dma", {"producer": "vendor"}, {}),
                "dma-kernel": ("dma", {"producer": "kernel"}, {}),
                "dma-alt": ("dma", {"producer": "kernel", "dma_reduce_in_gemm": True, "schedule.flag_by_copy": False,
                                    "schedule.lanes": 2}, {"chunks": (1, 2, 2, 1)}),
                "dma-taper": ("dma", {"schedule.lanes": 2, "producer": "vendor",
                                      "schedule.producer_streams": 1 if PRODUCER_STREAMS > 1 else 2},
                              {"chunks": layout.TAPERED_CHUNKS})}


def arm_name(mode, gather, transport) -> str:
    return f"{mode}-{gather}-{transport or 'none'}"
AUTO_LSA_ROWS = 256  # transport="auto" in this test: lsa up to 256 rows, copy engines above


def _problems(rank, quant, m, device, seeds=(0, 1)):
    from cco import quant as Q
    from cco.preshuffle import preshuffle_b

    probs = [Q.random_problem(m, N, K, quant, seed=100 * rank + s, device=device) for s in seeds]
    # one weight per rank (the op is built per weight); activations vary
    b, b_s = probs[0].b, probs[0].b_scale
    probs = [Q.Problem(quant, p.a, b, p.a_scale, b_s) for p in probs]
    return probs, preshuffle_b(b)


def _poison(op):
    w = op.config.window
    op.window.tensor(w.recv, rank=op.rank).fill_(float("nan"))
    op.window.tensor(w.gather, rank=op.rank).view(torch.uint8).fill_(0xFF)  # NaN in bf16 and in e4m3
    torch.cuda.synchronize()
    op.comm.barrier()


def _fused_into(op, prob, b_pre, out):
    """One collective call that writes a caller-poisoned ``out`` (the op allocates its own)."""
    op._collective(lambda plan: op._backend.fused(prob.a, b_pre, prob.a_scale, prob.b_scale, out=out, plan=plan),
                   prob.a.shape[0])


def rank_main(quants=None, arms=None):
    from cco import quant as Q
    from cco.bench.timing import budget_terms, override
    from cco.comm import Communicator
    from cco.op import GemmAllReduceOp
    from cco.transport import FaultPlan
    from cco.transport.protocol import SelfTestError

    comm = Communicator.from_env()
    torch.cuda.set_device(comm.device)
    rank, dev = comm.rank, comm.device
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    from cco.window import ranks_share_a_device

    log("the ranks share one GPU (IPC window): the protocol is checked, not the link" if ranks_share_a_device(comm)
        else "one GPU per rank (symmetric-memory window)")

    failures = []
    from cco.cuda.dma import current_stream
    for s in (None, torch.cuda.Stream(), torch.cuda.Stream(), None):  # the kept Stream objects follow the current one
        with torch.cuda.stream(s) if s is not None else contextlib.nullcontext():
            if current_stream() != torch.cuda.current_stream():
                failures.append(f"cco.cuda.dma.current_stream() is {current_stream()}, torch's "
                                f"{torch.cuda.current_stream()}")
    if "blockscale" in (quants or Q.QUANTS):
        try:
            _vendor_rows_rule(dev, log)
        except Exception as err:
            failures.append(f"blockscale vendor rows: {type(err).__name__}: {err}")
            log("FAIL", failures[-1])
    for quant in quants or Q.QUANTS:
        probs, b_pre = _problems(rank, quant, M, dev)
        refs = [_reference_sum(p) for p in probs]
        local = budget_terms(probs[0])
        for mode, gather, transport in ARMS:
            if arms and arm_name(mode, gather, transport) not in arms:
                continue
            fp8 = gather == "fp8"
            real, overrides, options = ALTERNATIVES.get(transport, (transport, {}, {}))
            if overrides.get("gemm_config") == "own":
                from kernels_fused.hopper.gemm import TRITON_PLAIN
                overrides = {"gemm_config": TRITON_PLAIN[quant]}
            with GemmAllReduceOp(comm, n=N, k=K, m_max=M, quant=quant, mode=mode, gather_dtype=gather,
                                 transport=real, **options) as op:
                if transport == "auto":  # alternating M then switches paths between calls
                    op._backend.lsa_max_elements = AUTO_LSA_ROWS * N
                override(op._backend, overrides, what=transport)
                p = probs[0]

                def first_call():
                    out = op(p.a, b_pre, p.a_scale, p.b_scale)
                    err = _check(out, local if mode == "gemm-only" else refs[0], quant=quant, fp8_gather=fp8,
                                 what=f"{quant} {mode} {gather}")
                    log(f"ok {quant:10s} {mode:9s} {transport} gather={gather}: rel_l2 {err:.2e}")
                checks = [first_call] if mode == "gemm-only" else [first_call, lambda: op.self_test()]
                if mode == "fused" and op._backend.uses_lsa(M):
                    checks.append(lambda: _kept_lsa_launch(op, probs, b_pre, log, quant, gather))
                if mode == "fused" and transport == "lsa" and quant in DECODE_SPLIT_QUANTS:
                    checks.append(lambda: _decode_split(op, probs, b_pre, log, quant, gather))
                if mode == "fused" and not fp8:
                    checks += [lambda: _repeat_poisoned(op, probs, b_pre, refs, log, quant),
                               lambda: _graph_replays(op, probs, b_pre, refs, log, quant),
                               lambda: _alternating_m(comm, op, quant, b_pre, probs, log)]
                for check in checks:  # keep going so one run reports every failing check
                    try:
                        check()
                    except Exception as err:
                        failures.append(f"{quant} {mode} {transport} {gather}: {type(err).__name__}: {err}")
                        log("FAIL", failures[-1])
                        torch.cuda.synchronize()
                        comm.barrier()
    # the self-test must fail when the transport moves nothing
    for transport in () if arms else ("dma", "lsa"):
        with GemmAllReduceOp(comm, n=N, k=K, m_max=M, mode="fused", transport=transport,
                             faults=FaultPlan(silent=True)) as op:
            try:
                op.self_test()
            except SelfTestError:
                log(f"ok self_test fails on a silent {transport} transport")
            except Exception as err:
                failures.append(f"silent {transport} transport: self_test raised {type(err).__name__}: {err}")
            else:
                failures.append(f"silent {transport} transport: self_test passed with a transport that moved no bytes")
    comm.barrier()
    if failures:
        raise SystemExit("CUDA_OP_CHECKS FAILED:\n" + "\n".join(failures))
    log("CUDA_OP_CHECKS PASSED")
    comm.close()


def _vendor_rows_rule(device, log):
    from cco import quant as Q
    from cco.bench.timing import budget_terms, gemm_mismatches
    from kernels_fused.hopper import vendor

    def cublas_wrong(p):
        """Elements of cuBLAS's blockwise product outside the fp8 budget, or "refused" where it
        raises CUBLAS_STATUS_NOT_SUPPORTED (any other error propagates)."""
        try:
            out = vendor.vendor_gemm(p.a, p.a_scale, vendor.prepare_weight(p.b, p.b_scale, "blockscale"))
            return gemm_mismatches(out, *budget_terms(p))
        except RuntimeError as err:
            if "NOT_SUPPORTED" not in str(err):
                raise
            return "refused"

    for m in (1, 2, 4, 6, 8, 12, 36, 66, 68, 100, 129, 130, 132, 260, 1000):
        ran = cublas_wrong(Q.random_problem(m, 2048, 512, "blockscale", seed=1, device=device)) == 0
        torch.cuda.synchronize()
        if ran != vendor.takes_rows("blockscale", m, 512):
            raise AssertionError(f"cuBLAS's blockwise recipe {'ran' if ran else 'refused'} M={m}, vendor.takes_rows "
                                 f"says {vendor.takes_rows('blockscale', m, 512)}")
    log("ok blockscale vendor.takes_rows matches what cuBLAS's blockwise recipe runs (M = 1 .. 1000)")
    # K: the rule sends no K to cuBLAS where it computes wrongly, and the GEMM the library picks for
    # such a K (fp8_gemm's default) is right; what cuBLAS returns at the K it is not sent is logged
    from kernels_fused.hopper import gemm as hopper_gemm

    seen = []
    for k in (2048, 2304, 2560, 3072, 3200):  # 16, 18, 20, 24, 25 scale columns
        p = Q.random_problem(256, 7168, k, "blockscale", seed=2, device=device)
        wrong = cublas_wrong(p)
        picked = gemm_mismatches(hopper_gemm.fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant="blockscale"),
                                 *budget_terms(p))
        torch.cuda.synchronize()
        taken = vendor.takes_rows("blockscale", 256, k)
        seen.append(f"K={k}: cuBLAS {wrong} wrong ({'taken' if taken else 'not taken'}), picked GEMM {picked} wrong")
        if taken and wrong != 0:
            raise AssertionError(f"vendor.takes_rows sends K={k} to cuBLAS's blockwise recipe, which got {wrong} "
                                 f"elements outside the budget")
        if picked:
            raise AssertionError(f"fp8_gemm's default GEMM at blockscale K={k}: {picked} elements outside the budget")
    log("ok blockscale vendor.takes_rows by K: " + "; ".join(seen))


def _kept_lsa_launch(op, probs, b_pre, log, quant, gather):
    """The lsa call's kept launches, bit for bit, every rank switching alike (the calls are
    collective): the op's kept collective call (``CollectiveGemmOp._kept_collective`` around the
    backend's ``LsaLaunch``, made and taken from a weight's second call on) against the call's whole Python
    path (checks, plan, ``fp8_gemm_lsa``); the kernel's kept launcher (``kernels_fused.hopper.launch``)
    against ``JITFunction.run``'s; and a call whose scales sit off the kept launch's 16-byte
    alignment (``LsaLaunch`` takes ``JITFunction.run`` there)."""
    from kernels_fused.hopper import launch as L

    p = probs[1]
    kept = [op(p.a, b_pre, p.a_scale, p.b_scale) for _ in range(3)]  # the third through the kept call at the latest
    if op._launches.launch_for(p.a, b_pre, p.a_scale, p.b_scale) is None:
        raise AssertionError(f"{quant} lsa gather={gather}: no kept collective call after three calls of one weight")
    L.FAST_LAUNCH = False
    try:
        slow = op(p.a, b_pre, p.a_scale, p.b_scale)
    finally:
        L.FAST_LAUNCH = True
    op._backend.keeps_fused = lambda m: False  # the call's whole Python path: no launch kept or run
    try:
        whole = op._call(p.a, b_pre, p.a_scale, p.b_scale, op._reduce_call)
    finally:
        del op._backend.keeps_fused
    buffer = torch.empty(p.a_scale.untyped_storage().nbytes() // p.a_scale.element_size() + 1,
                         dtype=p.a_scale.dtype, device=p.a_scale.device)
    shifted = buffer.as_strided(p.a_scale.shape, p.a_scale.stride(), storage_offset=1).copy_(p.a_scale)
    moved = op(p.a, b_pre, shifted, p.b_scale)
    arms = {"kept launcher": kept[2], "JITFunction.run": slow, "scales off alignment": moved, "first": kept[0]}
    differ = [name for name, out in arms.items() if not torch.equal(out, whole)]
    if differ:
        raise AssertionError(f"{quant} lsa gather={gather}: {differ} differ from the call's whole Python path")
    log(f"ok {quant:10s} lsa gather={gather}: the kept collective call == the Python path == JITFunction.run == "
        f"scales off alignment, bit for bit")


DECODE_SPLIT_QUANTS = ("ptpc", "blockscale")  # cco.backends.cuda.DECODE_SPLIT_ROWS' quants


def _decode_split(op, probs, b_pre, log, quant, gather):
    """Decode-sized fused lsa calls as the decode MMA into an [M, N] partial and the lsa kernel's
    transfers on it (``DECODE_SPLIT_ROWS``; ``CudaBackend._decode_lsa``), at 1, 8 and 64 rows: eager
    with the path forced, against the reference; eager with the lsa kernel's own GEMM forced, too;
    then the path forced under a capture (taken through the op's kept collective call, which the
    eager calls made), replayed 20 times with the inputs alternating and out, recv, gather and the
    partial region poisoned with NaN before each replay: bit for bit the forced eager call of the
    same input (the same kernels over the same bytes); and the rule's pick eagerly (``DECODE_SPLIT``:
    on by default, the decode MMA; ``CCO_DECODE_SPLIT=0``, the lsa kernel's GEMM). A spy counts the
    calls that took the path."""
    from cco import quant as Q
    from cco.backends import cuda as C

    backend, fp8 = op._backend, gather == "fp8"
    taken = []
    real = backend._decode_lsa
    backend._decode_lsa = lambda *a, **k: (taken.append(a[-1].m), real(*a, **k))[1]
    try:
        for m in (1, 8, 64):
            inputs = []
            for p in probs:
                a, a_s = p.a[:m], p.a_scale[:m]
                if quant == "blockscale":  # column-major [M, K/128] slice keeps stride (1, M_full): re-layout
                    a_s = a_s.t().contiguous().t()
                inputs.append((a, a_s, _reference_sum(Q.Problem(quant, a, p.b, a_s, p.b_scale))))
            eager = {}
            for split in (True, False):
                backend.decode_split = split
                for j, (a, a_s, ref) in enumerate(inputs):
                    for _ in range(2):  # the second call of the weight through the kept collective call
                        out = op(a, b_pre, a_s, probs[0].b_scale)
                    _check(out, ref, quant=quant, fp8_gather=fp8, what=f"{quant} lsa {gather} M={m} split={split}")
                    if split:
                        eager[j] = out
            if taken.count(m) != 2 * len(inputs):
                raise AssertionError(f"{quant} lsa {gather} M={m}: {taken.count(m)} calls took the decode MMA, "
                                     f"{2 * len(inputs)} forced")
            backend.decode_split = None  # the rule
            op(inputs[0][0], b_pre, inputs[0][1], probs[0].b_scale)
            if taken.count(m) != 2 * len(inputs) + C.DECODE_SPLIT:
                raise AssertionError(f"{quant} lsa {gather} M={m}: DECODE_SPLIT={C.DECODE_SPLIT}, yet the rule's "
                                     f"call {'did not take' if C.DECODE_SPLIT else 'took'} the decode MMA")
            taken.clear()
            backend.decode_split = True
            static = [t.clone() for t in inputs[0][:2]]
            g, out = _captured(op, static, b_pre, probs[0].b_scale)
            if taken.count(m) != 1:
                raise AssertionError(f"{quant} lsa {gather} M={m}: the captured call did not take the decode MMA")
            for i in range(20):
                j = i % 2
                static[0].copy_(inputs[j][0])
                static[1].copy_(inputs[j][1])
                out.fill_(float("nan"))
                backend.partial.fill_(float("nan"))
                _poison(op)
                g.replay()
                torch.cuda.synchronize()
                if not torch.equal(out, eager[j]):
                    bad = int((out != eager[j]).sum())
                    raise AssertionError(f"{quant} lsa {gather} M={m}: replay {i} differs from the eager decode MMA "
                                         f"call in {bad} of {out.numel()} elements")
            del g
            torch.cuda.synchronize()
            op.comm.barrier()
    finally:
        del backend._decode_lsa
        backend.decode_split = None
    log(f"ok {quant:10s} lsa gather={gather}: the decode MMA + the lsa kernel's transfers at 1, 8, 64 rows (eager "
        f"forced, the lsa GEMM forced, 20 poisoned replays of its capture == eager, bit for bit; the rule's pick "
        f"with DECODE_SPLIT={C.DECODE_SPLIT})")


def _repeat_poisoned(op, probs, b_pre, refs, log, quant):
    schedule = op._backend.schedule
    replays = schedule.replays
    bad_total = 0
    for i in range(REPEATS):
        j = i % 2
        out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=op.comm.device)
        _poison(op)
        _fused_into(op, probs[j], b_pre, out)
        torch.cuda.synchronize()
        bad = int((~torch.isfinite(out.float())).sum()) + _bad(out, refs[j])
        bad_total += bad
        if bad:
            raise AssertionError(f"{quant} fused launch {i}: {bad} bad elements")
    op._backend.check()
    replays = schedule.replays - replays
    if not op._backend.uses_lsa(M) and replays < REPEATS // 2:
        # out is freed every iteration, so the allocator hands back its block: the key repeats
        raise AssertionError(f"{quant}: only {replays} of {REPEATS} fused launches replayed captured side work")
    log(f"ok {quant:10s} {REPEATS} fused launches into NaN-poisoned out/recv/gather: 0 bad elements "
        f"({replays} replayed captured side work)")


def _bad(out, ref):
    from cco.bench.timing import allreduce_mismatches

    total, abs_sum, dot_abs_sum = ref
    return allreduce_mismatches(out, total, abs_sum, dot_abs_sum, fp8_gather=False)


def _captured(op, static, b_pre, b_scale):
    """``(graph, out)``: one call of ``op`` on the rows and scales ``static`` captured, every rank
    capturing between the same two barriers (the call is collective)."""
    torch.cuda.synchronize()
    op.comm.barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = op(static[0], b_pre, static[1], b_scale)
    torch.cuda.synchronize()
    op.comm.barrier()
    return g, out


def _graph_replays(op, probs, b_pre, refs, log, quant):
    static = [t.clone() for t in (probs[0].a, probs[0].a_scale)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        op(static[0], b_pre, static[1], probs[0].b_scale)  # warm outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g, out = _captured(op, static, b_pre, probs[0].b_scale)
    for i in range(REPEATS):
        j = i % 2
        static[0].copy_(probs[j].a)
        static[1].copy_(probs[j].a_scale)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        bad = _bad(out, refs[j])
        if bad:
            raise AssertionError(f"{quant} graph replay {i}: {bad} bad elements")
    log(f"ok {quant:10s} CUDA graph captured, {REPEATS} replays with changing inputs: 0 bad elements")
    # eager calls after replays still agree (words consumed, not left behind by the replays)
    out = op(probs[1].a, b_pre, probs[1].a_scale, probs[1].b_scale)
    if _bad(out, refs[1]):
        raise AssertionError(f"{quant}: eager call after graph replays is wrong")


def _alternating_m(comm, op, quant, b_pre, probs, log):
    for m in (M, 256, 1, M, 129, 640, M):
        p = probs[m % 2]
        a, a_s = p.a[:m], p.a_scale[:m]
        if quant == "blockscale":  # column-major [M, K/128] slice keeps stride (1, M_full): re-layout
            a_s = a_s.t().contiguous().t()
        ref = _reference_sum(type(p)(quant, a, p.b, a_s, p.b_scale))
        out = op(a, b_pre, a_s, p.b_scale)
        if _bad(out, ref):
            raise AssertionError(f"{quant}: alternating M, call with M={m} is wrong")
    log(f"ok {quant:10s} alternating M (1000, 256, 1, 1000, 129, 640, 1000)")


if __name__ == "__main__":
    import argparse

    from cco.quant import QUANTS

    ap = argparse.ArgumentParser(description="the GPU checks of this module, on the ranks torchrun starts")
    ap.add_argument("--quant", action="append", choices=QUANTS,
                    help="run only this quant format (repeatable; default: all): 4 ranks on one GPU "
                         "take more than 5 minutes per format")
    ap.add_argument("--arm", action="append", choices=[arm_name(*a) for a in ARMS],
                    help="run only this arm, MODE-GATHER-TRANSPORT (repeatable; default: every arm and the "
                         "silent-transport checks)")
    args = ap.parse_args()
    rank_main(args.quant, args.arm)


def test_auto_transport_picks_lsa_below_the_threshold_and_self_tests_both_paths():
    """transport="auto": which calls take the lsa kernel, and the rows the self test runs so that
    both paths are proven (host logic of the CUDA backend; no GPU needed)."""
    from cco import layout
    from cco.backends.cuda import CudaBackend, lsa_max_elements

    def backend(m_max, transport, gather="bf16", mode="fused"):
        be = object.__new__(CudaBackend)  # the host logic only: no streams, no window
        be.config = layout.build_config(n=7168, k=2048, m_max=m_max, world=2, transport=transport,
                                        gather_dtype=gather, mode=mode, block_m=128, block_n=128)
        be.lsa_max_elements = lsa_max_elements(be.config)
        return be

    auto = backend(16384, "auto")
    assert [auto.uses_lsa(m) for m in (1, 2048, 8192, 8193, 16384)] == [True, True, True, False, False]
    assert auto.path_rows() == [16384, 8192]
    assert backend(16384, "auto", "fp8").path_rows() == [16384, 2048]
    assert backend(4096, "auto").path_rows() == [4096]  # every call takes lsa: one path
    assert backend(16384, "dma").path_rows() == [16384] and not backend(16384, "dma").uses_lsa(1)
    assert backend(16384, "lsa").path_rows() == [16384] and backend(16384, "lsa").uses_lsa(16384)
    assert not backend(16384, "auto", mode="split").uses_lsa(1)  # split runs the copy engines only


def test_dma_producer_rule_reads_its_table(monkeypatch):
    """``DMA_PRODUCER`` (the producer of a dma call per quant and M, measured): the first row whose
    largest M covers the call's M, the last row for every larger M; every quant has a row for every M."""
    from cco.backends import cuda

    monkeypatch.setattr(cuda, "DMA_PRODUCER", {**cuda.DMA_PRODUCER, "ptpc": ((4096, "kernel"), (None, "vendor"))})
    assert [cuda.dma_producer("ptpc", m) for m in (1, 4096, 4097, 32768)] == ["kernel", "kernel", "vendor", "vendor"]
    for quant in layout.QUANTS:
        rows = cuda.DMA_PRODUCER[quant]
        bounds = [largest for largest, _ in rows[:-1]]
        assert rows[-1][0] is None and bounds == sorted(bounds) and {p for _, p in rows} <= set(cuda.PRODUCERS)


def test_decode_split_rule(monkeypatch):
    """``CudaBackend.splits_decode``: on by default (``DECODE_SPLIT``; ``CCO_DECODE_SPLIT=0`` turns it
    off, any other value leaves it on: a fresh interpreter each); on, ptpc and blockscale calls
    of up to ``DECODE_SPLIT_ROWS`` rows whose rows are contiguous and whose scales lie as the
    activation quantizer writes them (blockscale: [M, K/128] with stride (1, M)) and whose K is a
    multiple of 128; the backend's ``decode_split`` forces it either way within what the decode MMA
    takes (1..MMA_ROWS_MAX rows); mxfp8 never."""
    import os
    import subprocess
    import sys
    import types

    from cco.backends import cuda as C
    from kernels_fused.hopper.decode import MMA_ROWS_MAX

    def default(value):  # DECODE_SPLIT as an interpreter with CCO_DECODE_SPLIT=value (None: unset) reads it
        env = {k: v for k, v in os.environ.items() if k != "CCO_DECODE_SPLIT"}
        if value is not None:
            env["CCO_DECODE_SPLIT"] = value
        return subprocess.run([sys.executable, "-c", "import cco.backends.cuda as C; print(C.DECODE_SPLIT)"],
                              env=env, capture_output=True, text=True, check=True, timeout=120).stdout.strip()

    assert [default(v) for v in (None, "0", "1", "yes")] == ["True", "False", "True", "True"]

    backend = C.CudaBackend.__new__(C.CudaBackend)  # (the rule reads the config and the switches only)

    def takes(quant, m, *, k=256, on=False, force=None, scale_layout="quantizer"):
        monkeypatch.setattr(C, "DECODE_SPLIT", on)
        backend.config, backend.decode_split = types.SimpleNamespace(quant=quant, k=k), force
        groups = max(1, k // 128)
        if quant == "ptpc":
            scales = torch.zeros(m)
        else:
            scales = torch.zeros(groups, m).t() if scale_layout == "quantizer" else torch.zeros(m, groups)
        return backend.splits_decode(torch.zeros(m, k), scales, m)

    for quant in ("ptpc", "blockscale"):
        assert not takes(quant, 8) and takes(quant, 8, on=True) and takes(quant, 8, force=True)
        assert not takes(quant, 8, on=True, force=False)
        assert takes(quant, C.DECODE_SPLIT_ROWS[quant], on=True)
        assert not takes(quant, C.DECODE_SPLIT_ROWS[quant] + 1, on=True)
        assert not takes(quant, MMA_ROWS_MAX + 1, force=True)
        assert not takes(quant, 8, k=200, force=True)
    assert not takes("blockscale", 8, k=512, force=True, scale_layout="row-major")
    assert not takes("mxfp8", 8, on=True) and not takes("mxfp8", 8, force=True)
