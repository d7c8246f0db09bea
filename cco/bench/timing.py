"""The one timing module: every benchmark number of the project is measured here.

Method (CUDA; see docs/BENCHMARKS.md for the figures):

1. Each arm is a callable ``fn(i)``; ``i`` picks one of ``rotate`` input sets, so consecutive
   iterations read different operands (cold L2 for inputs larger than a few MiB). An optional L2
   flush (a 2x-L2 buffer write, outside the timed region) covers inputs that would still fit.
2. Every timed iteration starts with a device-side rendezvous of all ranks (a one-element NCCL
   all-reduce on the same stream, outside the events), so a rank that is ahead does not time its
   wait for a late peer; then CUDA events bracket ``fn(i)`` on the current stream.
3. A pass runs every arm back to back (order rotated per pass, so no arm always runs first or
   after the same neighbour); ``passes >= 3``. Per arm and pass: the median over iterations, then
   the max over ranks (the op is as slow as its slowest rank). Reported: the median over passes and
   the spread (min..max of the pass medians). A ratio of two arms is also taken pass by pass
   (:func:`per_pass_ratio`): the card's clocks and the host's speed drift between passes by more
   than two arms differ, and the arms of one pass run back to back.
4. The device must be idle: :func:`idle_check` reads utilization and foreign processes through NVML
   before and after; a busy device is reported, never silently timed.

Eager calls as a model issues them (:func:`time_back_to_back`): N calls back to back per arm, CUDA
events around the run (wall time per call, whichever of host and device is behind), the host's
clock until the last call returns (the host's time per call) and the calling thread's CPU time over
the same span (what the calls cost the host itself: time the thread was not running, on a shared or
busy host, is left out); arms alternate per pass as above.

Nothing here asserts a speed; tests never import it for timing.
"""

from __future__ import annotations

import os
import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch


@dataclass(frozen=True)
class ArmTiming:
    """One arm's result in microseconds (max over ranks of per-pass medians)."""

    name: str
    median_us: float
    min_us: float  # fastest pass median
    max_us: float  # slowest pass median
    pass_us: tuple[float, ...] = field(default_factory=tuple)

    @property
    def spread(self) -> float:
        return (self.max_us - self.min_us) / self.median_us if self.median_us else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["spread"] = round(self.spread, 4)
        return d


def per_pass_ratio(numerator, denominator) -> tuple[float, float, float]:
    """``(median, min, max)`` over passes of ``numerator[p] / denominator[p]`` (two arms' per-pass
    figures, e.g. ``ArmTiming.pass_us``, in pass order)."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(f"per_pass_ratio: {len(numerator)} and {len(denominator)} passes; need the same, >= 1")
    ratios = [a / b for a, b in zip(numerator, denominator)]
    return statistics.median(ratios), min(ratios), max(ratios)


IDLE_SETTLE_S = 1.0  # NVML utilization is averaged over the last sample period (up to 1 s)


def idle_check(device: int | None = None) -> dict:
    """Utilization (%) and other processes on ``device`` via NVML; ``busy`` when either is non-zero.

    Waits for this process's own work and one NVML sample period first, so only foreign load shows.
    Returns ``{"available": False}`` where NVML is missing (the check is then reported as skipped)."""
    import os
    import time

    torch.cuda.synchronize()
    time.sleep(IDLE_SETTLE_S)

    index = torch.cuda.current_device() if device is None else device
    try:
        import pynvml

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        nvml_index = int(visible.split(",")[index]) if visible else index
        h = pynvml.nvmlDeviceGetHandleByIndex(nvml_index)
        util = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        others = [p.pid for p in procs if p.pid != os.getpid()]
    except Exception as err:  # NVML absent or not permitted: say so rather than guess
        return {"available": False, "reason": f"{type(err).__name__}: {err}"}
    return {"available": True, "util_pct": util, "other_pids": others, "busy": util > 5 or bool(others)}


def require_cuda(script: str) -> None:
    """Refuse, with one line rather than a traceback, to run a GPU-only benchmark where torch has no CUDA."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script}: needs a CUDA GPU (torch.cuda.is_available() is False); python -m cco.demo "
                         f"runs on the CPU")


def check_output_dirs(parser, args, flags) -> None:
    """At parse time, ``parser.error`` for an output path (``--json``, ``--plot``, ...: the
    attributes ``flags``) whose directory does not exist, which the run would find only at its end,
    with its results lost."""
    for flag in flags:
        where = os.path.dirname(getattr(args, flag) or "")
        if where and not os.path.isdir(where):
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: directory {where} does not exist")


def require_a_gpu_per_rank(comm, what: str) -> None:
    """Refuse to time ranks that share a GPU: their bytes never cross a link, the GPU time-slices the
    processes, and NCCL (a baseline) refuses them."""
    from cco.window import ranks_share_a_device

    if ranks_share_a_device(comm):
        raise SystemExit(f"{what}: ranks share a GPU ({torch.cuda.device_count()} visible for {comm.world} ranks); "
                         f"timings need one GPU per rank (tests/python/cco/test_cuda_op.py checks correctness on "
                         f"a shared GPU)")


def _rendezvous(group) -> None:
    import torch.distributed as dist

    if group is not None or (dist.is_available() and dist.is_initialized()):
        token = torch.ones(1, device="cuda")
        dist.all_reduce(token, group=group)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _max_over_ranks(values: list[float], group) -> list[float]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return values
    t = torch.tensor(values, dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


class _L2Flush:
    def __init__(self, enabled: bool):
        self.buf = None
        if enabled:
            l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
            self.buf = torch.empty(2 * l2 // 4, dtype=torch.int32, device="cuda")

    def __call__(self):
        if self.buf is not None:
            self.buf.zero_()


def time_arms(
    arms: dict[str, Callable[[int], object]],
    *,
    passes: int = 3,
    iters: int = 20,
    warmup: int = 3,
    rotate: int = 4,
    flush_l2: bool = False,
    group=None,
    on_pass: Callable[[int], None] | None = None,
) -> dict[str, ArmTiming]:
    """Time every arm with the method of this module; returns ``{name: ArmTiming}`` (same on every
    rank). All ranks must call it with the same arms in the same order."""
    if passes < 3:
        raise ValueError(f"time_arms: passes={passes} is too few for a spread; pass passes >= 3")
    if iters < 1 or rotate < 1 or warmup < 0:
        raise ValueError(f"time_arms: iters={iters}, rotate={rotate} must be >= 1 and warmup={warmup} >= 0")
    names = list(arms)
    if not names:
        return {}
    flush = _L2Flush(flush_l2)
    for name in names:  # compile, allocate, fill caches of host-side plans
        for i in range(warmup):
            arms[name](i % rotate)
    torch.cuda.synchronize()
    per_pass: dict[str, list[float]] = {name: [] for name in names}
    start = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for p in range(passes):
        order = names[p % len(names):] + names[: p % len(names)]
        medians = []
        for name in order:
            fn = arms[name]
            for it in range(iters):
                flush()
                _rendezvous(group)
                start[it].record()
                fn(it % rotate)
                end[it].record()
            torch.cuda.synchronize()
            medians.append(1e3 * statistics.median(s.elapsed_time(e) for s, e in zip(start, end)))
        for name, value in zip(order, _max_over_ranks(medians, group)):
            per_pass[name].append(value)
        if on_pass is not None:
            on_pass(p)
    return {
        name: ArmTiming(name=name, median_us=statistics.median(v), min_us=min(v), max_us=max(v), pass_us=tuple(v))
        for name, v in per_pass.items()
    }


def time_back_to_back(arms: dict[str, Callable[[], object]], *, calls: int = 50, passes: int = 5, warmup: int = 3,
                      barrier: Callable[[], None] | None = None,
                      gather: Callable[[object], list] | None = None) -> dict[str, dict]:
    """Eager calls as a model makes them: per arm, ``calls`` calls back to back, bracketed by CUDA
    events (so the wall time per call, whichever of host and device is behind) and by the host's
    clock until the last call returns (the host's issue time per call). Arms alternate per pass
    (order rotated); each figure is the median over passes with its min..max; ``barrier`` starts
    every arm's run on all ranks together, ``gather`` (an all-gather of a Python object) takes the
    max over ranks. Returns ``{name: {"wall_us", "host_us", "wall_pass_us", "host_pass_us",
    "cpu_pass_us"}}``, the last the calling thread's CPU time per call in each pass (this rank's own)."""
    import time as _time

    if passes < 3 or calls < 1:
        raise ValueError(f"time_back_to_back: passes={passes} must be >= 3 and calls={calls} >= 1")
    names = list(arms)
    for name in names:
        for _ in range(warmup):
            arms[name]()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    wall: dict[str, list[float]] = {n: [] for n in names}
    host: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for p in range(passes):
        for name in names[p % len(names):] + names[:p % len(names)]:
            fn = arms[name]
            if barrier is not None:
                barrier()
            start.record()
            t0, c0 = _time.perf_counter(), _time.thread_time()
            for _ in range(calls):
                fn()
            issued, used = _time.perf_counter() - t0, _time.thread_time() - c0
            end.record()
            end.synchronize()
            w, h = 1e3 * start.elapsed_time(end) / calls, 1e6 * issued / calls
            if gather is not None:
                w, h = (max(v) for v in zip(*gather((w, h))))
            wall[name].append(w)
            host[name].append(h)
            cpu[name].append(1e6 * used / calls)
    return {n: {"wall_us": statistics.median(wall[n]), "host_us": statistics.median(host[n]),
                "wall_pass_us": wall[n], "host_pass_us": host[n], "cpu_pass_us": cpu[n]} for n in names}


def graphed(arms, rotate):
    """Capture each arm once per input set; replaying returns the captured output. An arm that cannot
    be captured stays eager and is listed in the second return value."""
    out, eager = {}, []
    for name, fn in arms.items():
        graphs, results = [], []
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(rotate):
                fn(i)  # warm: compile, allocate, cache
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        try:
            for i in range(rotate):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    results.append(fn(i))
                graphs.append(g)
            torch.cuda.synchronize()
        except Exception as err:  # e.g. an op that synchronizes inside
            print(f"rank {_rank()}: arm {name} cannot be captured ({type(err).__name__}: {err}); timing it eager",
                  file=sys.stderr)
            torch.cuda.synchronize()
            out[name], graphs, results = fn, None, None
            eager.append(name)
            continue

        def replay(i, graphs=graphs, results=results):
            graphs[i].replay()
            return results[i]
        out[name] = replay
    return out, eager


# Element-wise error budgets of the output checks (see gemm_mismatches / allreduce_mismatches).
BF16_ULPS = 2.0**-7  # two bf16 ulps (8-bit mantissa) of a value
FP8_MMA_ACC = 2.0**-9  # fp8 tensor-core accumulation: relative to sum_k |a_k b_k| (short accumulator mantissa)


def override(obj, overrides: dict, *, what: str = "override") -> None:
    """Set ``obj``'s attributes named by dotted paths (``{"schedule.flag_by_copy": False}``): how the
    benchmark's and the GPU test's alternative arms switch a backend's knobs. A path that names no
    existing attribute raises, so a misspelt knob cannot leave an arm running the default."""
    for path, value in overrides.items():
        owner, attr = obj, path
        while "." in attr:
            head, attr = attr.split(".", 1)
            owner = getattr(owner, head)
        if not hasattr(owner, attr):
            raise AttributeError(f"{what}: {type(obj).__name__} has no {path}")
        setattr(owner, attr, value)


def cublas_gemm(quant: str, b: torch.Tensor, b_scale: torch.Tensor, *, fast_accum: bool = True):
    """``fn(a, a_scale) -> bf16 [M, N]``: ``quant``'s GEMM through ``torch._scaled_mm`` (cuBLAS) as a
    model calls it today, the weight's arguments prepared once; ``(None, why)`` where there is none.

    ptpc: row-wise scales, ``use_fast_accum`` as given (fast accumulation is how the Triton kernel
    accumulates by default). blockscale: cuBLAS's blockwise recipe, A scaled per row and 128 columns
    ([M, K/128], M-major, as ``cco.quant`` keeps it), B per 128x128 block. mxfp8: none before
    Blackwell (cuBLAS has no e8m0 block scaling on Hopper). A torch without the blockwise recipe is
    found by one small call, so an arm is dropped with the reason instead of failing mid-run."""
    b_t = b.t()  # [K, N] column-major
    if quant == "ptpc":
        b_row = b_scale.reshape(1, -1).float()
        return (lambda a, a_scale: torch._scaled_mm(a, b_t, scale_a=a_scale.reshape(-1, 1).float(), scale_b=b_row,
                                                    out_dtype=torch.bfloat16, use_fast_accum=fast_accum)), None
    if quant != "blockscale":
        return None, f"cuBLAS has no {quant} recipe on this GPU (no e8m0 block scaling before Blackwell)"
    b_blocks = b_scale.t()  # cuBLAS reads B's [N/128, K/128] blocks as the transpose of its [K, N] operand's

    def fn(a, a_scale):
        return torch._scaled_mm(a, b_t, scale_a=a_scale, scale_b=b_blocks, out_dtype=torch.bfloat16)

    try:
        fn(torch.zeros(128, b.shape[1], dtype=b.dtype, device=b.device),
           torch.ones(b.shape[1] // 128, 128, device=b.device).t())
    except (RuntimeError, NotImplementedError, ValueError) as err:
        return None, f"torch {torch.__version__} has no blockwise _scaled_mm here: {str(err).splitlines()[0]}"
    return fn, None


def budget_terms(problem) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A @ B.T, |A| @ |B|.T)`` in fp32 of a :class:`cco.quant.Problem`'s dequantized operands: the
    reference and the cancellation term that :func:`gemm_mismatches` and :func:`allreduce_mismatches`
    take (summed over ranks for the latter)."""
    from cco import quant as Q

    a = Q.dequantize_a(problem.a, problem.a_scale, problem.quant)
    b = Q.dequantize_b(problem.b, problem.b_scale, problem.quant)
    return a @ b.t(), a.abs() @ b.abs().t()


def allreduce_terms(local: torch.Tensor, dot_abs: torch.Tensor, group=None, *,
                    on_host: bool = False) -> tuple[torch.Tensor, ...]:
    """What :func:`allreduce_mismatches` takes, from this rank's :func:`budget_terms` (collective over
    ``group``): the sums over ranks of the fp32 partials, of their absolute values and of ``dot_abs``.
    ``on_host``: reduce copies on the CPU (gloo), for ranks that share a GPU, which NCCL refuses."""
    import torch.distributed as dist

    terms = (local, local.abs(), dot_abs)
    terms = tuple(t.to("cpu" if on_host else t.device, copy=True) for t in terms)
    for t in terms:
        dist.all_reduce(t, group=group)
    return tuple(t.to(local.device) for t in terms)


def gemm_mismatches(out: torch.Tensor, ref: torch.Tensor, dot_abs: torch.Tensor) -> int:
    """Elements of a bf16 GEMM output outside its error budget against the fp32 ``ref``.

    ``dot_abs`` is ``|A| @ |B|.T`` (dequantized): where the dot product cancels, the tensor cores'
    accumulation error is relative to it, not to ``ref`` (cuBLAS shows the same). Budget: two bf16 ulps
    of ``ref`` plus ``FP8_MMA_ACC * dot_abs``. A wrong tile, scale or stale K block misses by O(|ref|);
    for random data |ref| ~ dot_abs / sqrt(K), far above the budget."""
    out, ref = out.float(), ref.float()
    bound = BF16_ULPS * ref.abs() + FP8_MMA_ACC * dot_abs
    return int((~torch.isfinite(out) | ((out - ref).abs() > bound)).sum())


def allreduce_mismatches(out: torch.Tensor, ref: torch.Tensor, abs_sum: torch.Tensor, dot_abs_sum: torch.Tensor,
                         *, fp8_gather: bool) -> int:
    """Elements of an all-reduced bf16 ``out`` outside what bf16 partials allow.

    ``ref``: the fp32 sum of the ranks' fp32 partials; ``abs_sum``: the sum of their absolute values;
    ``dot_abs_sum``: the sum over ranks of ``|A_r| @ |B_r|.T``. Any all-reduce of bf16 partials (NCCL's
    included) carries one bf16 rounding of every partial, so where partials cancel the error is
    relative to ``abs_sum``: the budget is two bf16 ulps of ``abs_sum + |ref|`` plus each partial's
    GEMM budget. The fp8 gather adds one e4m3 rounding of the reduced value: 2**-4 |ref| plus the
    subnormal spacing of its row scale.
    """
    out, ref = out.float(), ref.float()
    bound = BF16_ULPS * (abs_sum + ref.abs()) + FP8_MMA_ACC * dot_abs_sum
    if fp8_gather:
        row_scale = ref.abs().amax(dim=1, keepdim=True) / 448.0
        bound = bound + 2.0**-4 * ref.abs() + 2.0**-9 * row_scale
    bad = ~torch.isfinite(out) | ((out - ref).abs() > bound)
    return int(bad.sum())


def tflops(m: int, n: int, k: int, us: float) -> float:
    return 2.0 * m * n * k / (us * 1e-6) / 1e12


__all__ = ["ArmTiming", "allreduce_mismatches", "allreduce_terms", "budget_terms", "gemm_mismatches", "idle_check",
           "require_a_gpu_per_rank", "time_arms", "time_back_to_back", "tflops"]
