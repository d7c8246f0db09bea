"""The op's fault handling on NVIDIA GPUs, and what it costs the fused call.

Every scenario of ``fault_scenarios`` (bad input on each rank in turn, a one-sided M mismatch with
as many and with fewer chunks, a stalled, a closed, a late and a killed rank, a lost put; and on the GPU only
a rank that stops replaying a captured CUDA graph, and a stalled rank whose peer reads its output,
or synchronizes the device, before ``check()``: ``GPU_ONLY``) runs on two ranks,
once with the copy engines (``transport="dma"``) and once with the lsa kernel (``"lsa"``; the lost
put is a copy-engine fault, so that scenario takes the copy engines in both runs). The same promises
as on the CPU: every live rank raises within deadline + 2 s (here after ``op.check()``, the
synchronisation point of asynchronous errors), no rank returns a wrong result, no process hangs,
and a fresh op (and communicator, after a death) computes correctly in the same process.

The same scenarios play on the sequence-parallel ops (``--pattern reduce-scatter-rows |
reduce-scatter-cols | all-gather``; copy engines only: the CUDA backend refuses lsa for them), with
the rows ``PATTERN_ROWS`` gives: two chunks per slice, so a lost put of chunk 1 exists.

The ranks are started the way torchrun starts them (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``PORT``), by :func:`launch` rather than torchrun: torchrun stops every rank as soon
as one exits, which would end the survivor of the killed-rank scenario before its checks. With
one GPU both ranks share it (a CUDA IPC window). By hand::

    python3 -m tests.python.cco.test_cuda_faults --launch --transport dma
    python3 -m tests.python.cco.test_cuda_faults --launch --pattern all-gather
    python3 -m tests.python.cco.test_cuda_faults --launch --bench --json cost.json
    python3 -m tests.python.cco.test_cuda_faults --launch --scenario stalled-graph --scenario stalled-read \
        --scenario stalled-sync --timeout 120

The launcher prints only when its ranks are done: a rank still running at ``--timeout`` is killed,
after dumping every thread's stack 10 s earlier, and those stacks are printed with the failure (an
outer ``timeout`` shorter than ``--timeout`` kills the launcher and loses all of it).

``--bench`` measures the cost of the deadline machinery (``cco.cuda.watchdog``: the marks every call
writes, the watchdog thread): CUDA-graph replays of the fused call, the watched op against the same
op built unwatched (``CudaBackend.watched = False``), in alternating rounds of one run, on two ranks
sharing the GPU. The benchmark scripts refuse shared GPUs (timings there say nothing about the
link); this comparison only asks whether the two arms differ, which the sharing does not hide.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import pytest
import torch

N, K, M = 512, 256, 256  # two 128-row m-tiles: two chunks (and one chunk at M // 2)
DEADLINE_S = 5.0  # the default; the GPU suite passes --deadline 2 (a job then takes ~70 s, not ~90)
VICTIM = 1
JOB_TIMEOUT_S = 420  # a job that hangs is killed here, and fails
TRANSPORTS = ("dma", "lsa")
SP_PATTERNS = ("reduce-scatter-rows", "reduce-scatter-cols", "all-gather")
# rows per call (the all-gather: per rank): the reduce-scatter along rows has M/W rows per slice, so
# two 128-row chunks at world 2 need M = 512 (as test_sp_faults.py's ROWS at its tile)
PATTERN_ROWS = {"all-reduce": M, "reduce-scatter-rows": 2 * M, "reduce-scatter-cols": M, "all-gather": M}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() and not torch.version.hip else 0


# --------------------------------------------------------------------------------------------------
# the launcher (pytest side, and by hand)
# --------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], *, world: int = 2, timeout_s: float = JOB_TIMEOUT_S) -> list[dict]:
    """Start ``world`` ranks of this module with ``args`` as torchrun would; wait at most
    ``timeout_s`` (then kill them). Returns per rank: exit code (None: killed at the timeout),
    stdout, stderr."""
    port = _free_port()
    procs, files = [], []
    for rank in range(world):
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1",
               "CCO_STACKS_AFTER_S": str(max(1.0, timeout_s - 10)),  # a hung rank shows where it hangs
               "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.python.cco.test_cuda_faults", *args], cwd=ROOT,
                                      env=env, stdout=out, stderr=err))
        files.append((out, err))
    until = time.monotonic() + timeout_s
    results = []
    for p, (out, err) in zip(procs, files):
        try:
            rc = p.wait(timeout=max(1.0, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = None
        out.seek(0)
        err.seek(0)
        results.append({"rc": rc, "stdout": out.read(), "stderr": err.read()})
    return results


def reports(results: list[dict]) -> list[dict]:
    """The scenario reports the ranks printed (``REPORT {json}`` lines)."""
    return [json.loads(line[len("REPORT "):]) for r in results for line in r["stdout"].splitlines()
            if line.startswith("REPORT ")]


def job_problems(results: list[dict], scenarios) -> list[str]:
    """Every broken promise of one job: a rank's problems, a rank that hung or failed (the killed
    scenario's victim excepted), a scenario some rank did not report."""
    problems = []
    for rank, r in enumerate(results):
        if r["rc"] is None:
            problems.append(f"rank {rank} still ran after the job's timeout: "
                            f"{r['stdout'][-2000:]}{r['stderr'][-2000:]}")
        elif r["rc"] != 0 and not ("killed" in scenarios and rank == VICTIM and r["rc"] == 9):
            problems.append(f"rank {rank} exited with {r['rc']}: {r['stdout'][-2000:]}{r['stderr'][-3000:]}")
    got = reports(results)
    for rep in got:
        problems += [f"{rep['transport']} {rep['scenario']}: {p}" for p in rep["problems"]]
    for name in scenarios:
        ranks = {rep["rank"] for rep in got if rep["scenario"] == name}
        expected = {0} if name == "killed" else set(range(len(results)))
        if not expected <= ranks:
            problems.append(f"{name}: no report from ranks {sorted(expected - ranks)}")
    return problems


@pytest.mark.cuda
@pytest.mark.skipif(_gpus() < 1, reason="needs an NVIDIA GPU (two ranks share one if there is only one); the CPU "
                    "backend's fault tests are test_faults.py")
@pytest.mark.parametrize("which", ["shared", "gpu-only"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_live_rank_raises_in_time_and_a_fresh_op_computes_on_cuda(transport, which):
    """Guards, on the device (each scenario's promise is in ``fault_scenarios``): a rank whose
    rejected inputs made its peer pair calls (wrong results); a stream wait or lsa spin with no
    deadline (the peer of a stalled, killed or mismatched rank, or of a lost put, hung in
    ``torch.cuda.synchronize()``); a mismatched M raised only by ``check()`` with a wrong output
    returned before it; a released call whose output looked good; a CUDA context or op that could
    not be rebuilt after a failure; a replayed graph or a host read of the output left waiting.
    The scenarios shared with the CPU and the GPU-only ones run as separate jobs, so that a hang in
    one set does not hide the other's results."""
    from tests.python.cco import fault_scenarios

    scenarios = fault_scenarios.SCENARIOS if which == "shared" else fault_scenarios.GPU_ONLY
    results = launch(["--transport", transport] + [a for s in scenarios for a in ("--scenario", s)])
    problems = job_problems(results, scenarios)
    assert not problems, "\n".join(problems)


@pytest.mark.cuda
@pytest.mark.skipif(_gpus() < 1, reason="needs an NVIDIA GPU (two ranks share one if there is only one); the CPU "
                    "backend's fault tests of these patterns are test_sp_faults.py")
@pytest.mark.parametrize("which", ["shared", "gpu-only"])
@pytest.mark.parametrize("pattern", SP_PATTERNS)
def test_sequence_parallel_ops_raise_in_time_and_a_fresh_op_computes_on_cuda(pattern, which):
    """The same guards for the reduce-scatter's and the all-gather's protocols on the copy engines:
    a rank that returns while its peer fails the call (a lost put: the end-of-call words), a GEMM
    on rows that never arrived (stale slots: the release's NaN fill and the stamp check), a
    mismatched M returned as numbers, a wait without a deadline on the call's stream."""
    from tests.python.cco import fault_scenarios

    scenarios = fault_scenarios.SCENARIOS if which == "shared" else fault_scenarios.GPU_ONLY
    results = launch(["--transport", "dma", "--pattern", pattern] + [a for s in scenarios for a in ("--scenario", s)])
    problems = job_problems(results, scenarios)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("quant", ["ptpc", "blockscale", "mxfp8"])
def test_a_rejecting_rank_sends_nan(quant):
    """The operands a rejecting rank runs its part of the call on (``CudaBackend._null_operands``)
    pass the op's validation in every quant format and multiply to NaN everywhere, so its peers
    compute NaN, never numbers (host logic and the fp32 reference; no GPU needed)."""
    from cco import layout
    from cco.backends.cuda import CudaBackend
    from cco.quant import reference_gemm
    from cco.validate import check_operands

    backend = object.__new__(CudaBackend)  # the host logic only: no streams, no window
    backend.config = layout.build_config(n=N, k=K, m_max=M, world=2, quant=quant, block_m=128, block_n=128)
    backend.device = torch.device("cpu")
    operands = backend._null_operands(M - 1)
    assert check_operands(*operands, quant=quant, fn="test").m == M - 1
    assert torch.isnan(reference_gemm(*operands, quant).float()).all()


# --------------------------------------------------------------------------------------------------
# rank side
# --------------------------------------------------------------------------------------------------
def _warm_up(comm, transport, pattern="all-reduce"):
    """Compile every kernel the scenarios launch (a first call's compile must not count against a
    peer's deadline): both transports' paths, every M the scenarios use."""
    from tests.python.cco import fault_scenarios

    m = PATTERN_ROWS[pattern]
    for t in dict.fromkeys((transport, "dma")):  # one order on every rank (a set's is per process)
        setup = fault_scenarios.Setup(n=N, k=K, m=m, deadline_s=300.0, device=comm.device, transport=t,
                                      pattern=pattern)
        with setup.op(comm) as op:
            for rows in (m, m - m // 4, m // 2):
                op(*setup.operands(comm.rank, 0, rows))
                op.check()


def rank_main(scenarios, transport, pattern="all-reduce", deadline_s=DEADLINE_S):
    from cco.comm import Communicator
    from tests.python.cco import fault_scenarios

    faulthandler.dump_traceback_later(float(os.environ.get("CCO_STACKS_AFTER_S", JOB_TIMEOUT_S)), exit=False)
    comm = Communicator.from_env()
    _warm_up(comm, transport, pattern)
    setup = fault_scenarios.Setup(n=N, k=K, m=PATTERN_ROWS[pattern], deadline_s=deadline_s, device=comm.device,
                                  transport=transport, pattern=pattern)
    for name in scenarios:  # "killed" last: it replaces the communicator
        print(f"rank {comm.rank}: scenario {name}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        report = fault_scenarios.run(comm, name, VICTIM, setup, "cuda")
        print("REPORT " + json.dumps({"rank": comm.rank, "scenario": name, "transport": transport, "pattern": pattern,
                                      "seconds": round(time.monotonic() - t0, 2), **report}), flush=True)
    if "killed" not in scenarios:
        comm.close()


# --------------------------------------------------------------------------------------------------
# cost of the deadline machinery
# --------------------------------------------------------------------------------------------------
BENCH_SHAPES = ((2048, "lsa"), (8192, "dma"))  # N = 7168, K = 2048, ptpc: each transport's range
BENCH_REPLAYS = 10  # graph replays per timed sample
BENCH_ROUNDS = 15  # samples per arm, arms alternating (and their order alternating) round by round


def _bench(json_path):
    from cco import quant as q
    from cco.backends.cuda import CudaBackend
    from cco.comm import Communicator
    from cco.op import GemmAllReduceOp
    from cco.preshuffle import preshuffle_b

    comm = Communicator.from_env()
    n, k, rows = 7168, 2048, []
    for m, transport in BENCH_SHAPES:
        p = q.random_problem(m, n, k, "ptpc", seed=comm.rank)
        operands = (p.a.to(comm.device), preshuffle_b(p.b).to(comm.device), p.a_scale.to(comm.device),
                    p.b_scale.to(comm.device))
        ops, graphs, outs = {}, {}, {}
        for arm in ("unwatched", "watched"):
            CudaBackend.watched = arm == "watched"
            try:
                ops[arm] = GemmAllReduceOp(comm, n=n, k=k, m_max=m, transport=transport)
            finally:
                CudaBackend.watched = True
        for arm, op in ops.items():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm (compile, the schedule's own captures) outside the capture
                for _ in range(3):
                    op(*operands)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            comm.barrier()
            graphs[arm] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[arm]):
                outs[arm] = op(*operands)
            torch.cuda.synchronize()
            comm.barrier()
        samples = {arm: [] for arm in ops}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for r in range(BENCH_ROUNDS):
            for arm in (("unwatched", "watched") if r % 2 == 0 else ("watched", "unwatched")):
                comm.barrier()
                start.record()
                for _ in range(BENCH_REPLAYS):
                    graphs[arm].replay()
                end.record()
                end.synchronize()
                samples[arm].append(start.elapsed_time(end) * 1000.0 / BENCH_REPLAYS)
        same = torch.equal(outs["watched"], outs["unwatched"]) and bool(torch.isfinite(outs["watched"].float()).all())
        for op in ops.values():
            op.check()
            op.close()
        per_rank = comm.all_gather_object(samples)
        # per round, the slower rank (a collective call ends when the last rank's does)
        rounds = {arm: [max(s[arm][i] for s in per_rank) for i in range(BENCH_ROUNDS)] for arm in samples}
        med = {arm: statistics.median(v) for arm, v in rounds.items()}
        rows.append({"m": m, "n": n, "k": k, "quant": "ptpc", "transport": transport,
                     "outputs_equal_and_finite": same,
                     **{f"{arm}_us_median": round(med[arm], 1) for arm in rounds},
                     **{f"{arm}_us_min_max": [round(min(v), 1), round(max(v), 1)] for arm, v in rounds.items()},
                     "watched_over_unwatched": round(med["watched"] / med["unwatched"], 4),
                     "samples_us": {arm: [round(x, 1) for x in v] for arm, v in rounds.items()}})
        if comm.rank == 0:
            print(f"BENCH m={m} {transport}: unwatched {med['unwatched']:.1f} us, watched {med['watched']:.1f} us "
                  f"({med['watched'] / med['unwatched']:.3f}x), outputs equal: {same}", flush=True)
    if comm.rank == 0 and json_path:
        with open(json_path, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "hardware": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "world": comm.world, "ranks_share_one_gpu": True,
                       "command": "python3 -m tests.python.cco.test_cuda_faults --launch --bench",
                       "what": "CUDA-graph replay of one fused call, watched (marks + watchdog) vs unwatched, "
                               f"{BENCH_REPLAYS} replays per sample, {BENCH_ROUNDS} alternating rounds, max over "
                               "ranks per round", "rows": rows}, f, indent=1)
    comm.close()


if __name__ == "__main__":
    from tests.python.cco import fault_scenarios

    ap = argparse.ArgumentParser(description="the CUDA fault scenarios (or the cost measurement) on two ranks")
    ap.add_argument("--launch", action="store_true", help="start the ranks (else: be one, started by --launch)")
    ap.add_argument("--transport", choices=TRANSPORTS, default="dma")
    ap.add_argument("--pattern", choices=("all-reduce",) + SP_PATTERNS, default="all-reduce",
                    help="the op the scenarios play on (cco.layout.PATTERNS)")
    ap.add_argument("--scenario", action="append", choices=fault_scenarios.GPU_SCENARIOS,
                    help="run only this scenario (repeatable; default: all, 'killed' last)")
    ap.add_argument("--bench", action="store_true", help="measure the watched against the unwatched fused call")
    ap.add_argument("--json", help="--bench: write the results here")
    ap.add_argument("--timeout", type=float, default=JOB_TIMEOUT_S, help="--launch: kill the ranks after this long")
    ap.add_argument("--deadline", type=float, default=DEADLINE_S,
                    help="the ops' deadline_s in the scenarios; each scenario waits about one to three deadlines")
    opts = ap.parse_args()
    if opts.deadline <= 0:
        ap.error(f"--deadline must be positive, got {opts.deadline}")
    chosen = [s for s in fault_scenarios.GPU_SCENARIOS if s in (opts.scenario or fault_scenarios.GPU_SCENARIOS)]
    if opts.launch:
        args = ["--bench"] + (["--json", os.path.abspath(opts.json)] if opts.json else []) if opts.bench else \
            ["--transport", opts.transport, "--pattern", opts.pattern, "--deadline", str(opts.deadline)] + \
            [a for s in chosen for a in ("--scenario", s)]
        results = launch(args, timeout_s=opts.timeout)
        for rep in reports(results):
            print(f"{rep.get('pattern', 'all-reduce')} {rep['transport']:4s} {rep['scenario']:18s} rank {rep['rank']}: "
                  f"{len(rep['problems'])} problems "
                  f"({rep['seconds']} s); " + "; ".join(rep["seen"]))
        problems = [] if opts.bench else job_problems(results, chosen)
        for r in results:
            if opts.bench or problems:
                print(r["stdout"][-3000:], r["stderr"][-3000:])
        print("\n".join(problems) or ("CUDA_FAULTS PASSED" if not opts.bench else "BENCH DONE"))
        sys.exit(1 if problems or any(r["rc"] not in (0,) for r in results) and opts.bench else 0)
    if opts.bench:
        _bench(opts.json)
    else:
        rank_main(chosen, opts.transport, opts.pattern, opts.deadline)
