"""The gemm-ar benchmark's arm selection (host only): mori's names, the lsa arms, refusals, how
the alternative arms switch backend knobs, and the refusal of ranks that share a GPU."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from scripts.bench_gemm_ar import ARMS, select_arms


def test_all_and_mori_names():
    assert select_arms("all", "ptpc") == list(ARMS)
    assert select_arms("fused-sdma,fused-lsa,gemm-only", "ptpc") == ["fused", "fused-lsa", "gemm-only"]
    assert "scaled_mm" in select_arms("all", "blockscale")  # cuBLAS's blockwise recipe
    assert "symm_mem" not in select_arms("all", "blockscale")  # symm-mem scales rows only
    assert "scaled_mm" not in select_arms("all", "mxfp8")  # cuBLAS has no e8m0 scaling on Hopper
    assert "scaled_mm+nccl" in select_arms("all", "mxfp8")  # (with gemm-only's GEMM)


@pytest.mark.parametrize("mode", ["split-lsa", "fused-xyz"])
def test_unknown_or_unimplemented_arms_are_refused_with_the_reason(mode):
    with pytest.raises(SystemExit, match="split-sdma" if mode == "split-lsa" else "not an arm"):
        select_arms(mode, "ptpc")


def test_override_sets_dotted_paths_and_refuses_unknown_knobs():
    """The alternative arms switch backend knobs by dotted path; a misspelt knob must not leave the
    arm silently running the default."""
    import types

    from cco.bench.timing import override

    backend = types.SimpleNamespace(dma_reduce_in_gemm=False, schedule=types.SimpleNamespace(flag_by_copy=True))
    override(backend, {"dma_reduce_in_gemm": True, "schedule.flag_by_copy": False})
    assert backend.dma_reduce_in_gemm is True and backend.schedule.flag_by_copy is False
    for bad in ("dma_reduce_in_gem", "schedule.flag_by_cpy"):
        with pytest.raises(AttributeError, match=bad):
            override(backend, {bad: True}, what="arm")


def test_every_alternative_arm_is_selectable_and_its_chunks_build():
    """An alternative arm named in a comma list runs; a "chunks" override is a valid op chunking."""
    from cco import layout
    from scripts.bench_gemm_ar import ALTERNATIVES, OP_ARMS

    assert select_arms(",".join(ALTERNATIVES), "ptpc") == list(ALTERNATIVES)
    assert {"fused-two-lanes", "fused-taper", "fused-8-chunks"} <= set(ALTERNATIVES)
    for name in ALTERNATIVES:
        overrides = OP_ARMS[name][3]
        assert overrides, f"{name} overrides nothing: it would time the default"
        if "chunks" in overrides:
            cfg = layout.build_config(n=7168, k=2048, m_max=16384, world=2, chunks=overrides["chunks"],
                                      block_m=128, block_n=128)
            assert layout.call_chunks(cfg, 16384) == len(layout.chunk_weights(cfg))


class _Comm:
    """A stand-in communicator whose ranks report ``keys`` (host, GPU uuid)."""

    def __init__(self, keys):
        import torch

        self.keys, self.world, self.device = keys, len(keys), torch.device("cuda", 0)

    def all_gather_object(self, _):
        return list(self.keys)


@pytest.mark.parametrize("keys, shared", [
    ([("h0", "gpu-a"), ("h0", "gpu-b")], False),
    ([("h0", "gpu-a"), ("h1", "gpu-a")], False),  # same uuid string on two hosts: distinct GPUs
    ([("h0", "gpu-a"), ("h0", "gpu-a")], True),
    ([("h0", "gpu-a"), ("h0", "gpu-b"), ("h0", "gpu-a")], True),
])
def test_ranks_sharing_a_gpu_are_found_and_refused_by_the_benchmarks(monkeypatch, keys, shared):
    """Ranks on one GPU get the IPC window (torch symmetric memory refuses them) and the benchmarks
    refuse to time them: their bytes never cross a link."""
    import types

    import torch

    from cco import window
    from cco.bench.timing import require_a_gpu_per_rank

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(uuid="unused"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    comm = _Comm(keys)
    assert window.ranks_share_a_device(comm) is shared
    if shared:
        with pytest.raises(SystemExit, match="ranks share a GPU"):
            require_a_gpu_per_rank(comm, "bench")
    else:
        require_a_gpu_per_rank(comm, "bench")


def test_gemm_bench_configs_take_warps_and_name_them():
    """``--configs BMxBNxSTAGES[xWARPS]``: the 4-warp blockscale tile must be expressible (8 warps
    otherwise), and its arm name must say so, or two configs would time under one name."""
    from scripts.bench_gemm import config_name, triton_configs

    eight, four = triton_configs("128x128x3,64x128x3x4", "blockscale")
    assert (eight.block_m, eight.block_n, eight.num_stages, eight.num_warps) == (128, 128, 3, 8)
    assert (four.block_m, four.block_n, four.num_stages, four.num_warps) == (64, 128, 3, 4)
    assert config_name(eight) == "128x128x3" and config_name(four) == "64x128x3 w4"
    for bad in ("128x128", "64x128x3x4x2", "big"):
        with pytest.raises(SystemExit, match="BMxBNxSTAGES"):
            triton_configs(bad, "ptpc")


def test_cublas_baseline_is_the_quants_gemm_or_names_why_not():
    """The cuBLAS arms compute the quant's GEMM (checked here where torch runs it: ptpc on the CPU;
    the benchmarks check every arm against the reference on the GPU before timing), and where cuBLAS
    has no recipe the arm is dropped with the reason rather than timing something else."""
    from cco import quant as Q
    from cco.bench.timing import budget_terms, cublas_gemm, gemm_mismatches

    p = Q.random_problem(256, 256, 512, "ptpc", seed=3)
    fn, why = cublas_gemm("ptpc", p.b, p.b_scale, fast_accum=False)
    assert why is None
    assert gemm_mismatches(fn(p.a, p.a_scale), *budget_terms(p)) == 0
    fn, why = cublas_gemm("mxfp8", p.b, p.b_scale)
    assert fn is None and "e8m0" in why
    p = Q.random_problem(256, 256, 512, "blockscale", seed=3)
    fn, why = cublas_gemm("blockscale", p.b, p.b_scale)
    if fn is None:  # CPU builds of torch have no blockwise recipe: the probe call must say so
        assert "blockwise" in why and torch.__version__ in why
    else:
        assert gemm_mismatches(fn(p.a, p.a_scale), *budget_terms(p)) == 0


def test_per_pass_ratio_pairs_the_arms_of_each_pass():
    """Two arms' ratio taken pass by pass: a pass in which the card ran slow for both arms moves it
    less than the ratio of the arms' medians over passes would move."""
    from cco.bench.timing import per_pass_ratio

    base, arm = [100.0, 100.0, 300.0], [110.0, 330.0, 330.0]  # pass 2: only the arm was slow
    assert per_pass_ratio(arm, base) == pytest.approx((1.1, 1.1, 3.3))
    assert per_pass_ratio([200.0, 220.0, 660.0], [100.0, 200.0, 300.0]) == pytest.approx((2.0, 1.1, 2.2))
    with pytest.raises(ValueError, match="passes"):
        per_pass_ratio([1.0, 2.0], [1.0])


def test_back_to_back_keeps_the_threads_cpu_time_apart_from_the_hosts_clock(monkeypatch):
    """``time_back_to_back``'s ``cpu_pass_us``: the calling thread's CPU time per call. An arm that
    waits off the CPU (a sleep: a busy host's descheduled thread) costs host-clock time but almost no
    CPU time; one that computes costs both. (CUDA's events stood in for: no GPU here.)"""
    import time

    from cco.bench import timing

    class Event:
        def __init__(self, **_):
            self.t = 0.0

        def record(self):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 1e3 * (end.t - self.t)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)

    def spin(s=0.004):
        t = time.thread_time()
        while time.thread_time() - t < s:
            pass

    t = timing.time_back_to_back({"sleep": lambda: time.sleep(0.004), "spin": spin}, calls=3, passes=3, warmup=0)
    for name in ("sleep", "spin"):
        assert len(t[name]["cpu_pass_us"]) == 3 and min(t[name]["host_pass_us"]) >= 3500
    assert max(t["sleep"]["cpu_pass_us"]) < 1500 and min(t["spin"]["cpu_pass_us"]) >= 3500


def test_sequence_parallel_patterns_select_their_own_arms():
    """``--pattern rs | ag``: their arms (mori's split-sdma / fused-sdma names too), symm-mem only for
    ptpc, and the all-reduce's arms refused by name rather than timed as something else."""
    from scripts.bench_gemm_ar import SP_ARMS

    for pattern in ("rs", "ag"):
        assert select_arms("all", "ptpc", pattern) == list(SP_ARMS[pattern])
        assert select_arms("split-sdma,fused-sdma", "blockscale", pattern) == ["split", "fused"]
        assert "symm_mem" not in select_arms("all", "mxfp8", pattern)
        assert "fused" not in select_arms("baselines", "ptpc", pattern)
        for bad in ("fused-lsa", "fused-fp8", "gemm-only"):
            with pytest.raises(SystemExit, match=f"not an arm of --pattern {pattern}"):
                select_arms(bad, "ptpc", pattern)
    # the all-gather consumer's forced ends: by name only, and only for ag
    assert select_arms("fused,fused-per-chunk,fused-per-peer,fused-merged", "ptpc", "ag") == [
        "fused", "fused-per-chunk", "fused-per-peer", "fused-merged"]
    assert not {"fused-per-chunk", "fused-per-peer", "fused-merged"} & set(select_arms("all", "ptpc", "ag"))
    with pytest.raises(SystemExit, match="not an arm of --pattern rs"):
        select_arms("fused-per-chunk", "ptpc", "rs")


@pytest.mark.multirank
@pytest.mark.parametrize("pattern", ["rs", "ag"])
def test_sequence_parallel_op_arms_pass_their_checks_on_cpu_ranks(pattern):
    """The benchmark's wiring of ``--pattern rs | ag`` (problem rows per rank, the reference of this
    rank's share or of every rank's rows, the op arms' self tests and output checks) on CPU ranks,
    where the ops run the CPU backend: a reference of the wrong rows, or an op fed the wrong rows,
    fails the check that gates timing on the GPU."""
    from cco.comm import check_outcomes, spawn

    for report in check_outcomes(spawn(_bench_check_rank, world=2, args=(pattern,), timeout_s=180)):
        assert report["correctness"] and all(r["ok"] for r in report["correctness"].values()), report
        assert all("error" not in t for t in report["self_test"].values()), report["self_test"]


def _bench_check_rank(comm, pattern):
    import types

    from scripts.bench_gemm_ar import run_shape, select_arms

    args = types.SimpleNamespace(n=256, k=256, quant="ptpc", pattern=pattern, rotate=2, chunks=3, check_only=True)
    arms = [a for a in select_arms("split-sdma,fused-sdma", "ptpc", pattern)]
    return run_shape(args, comm, 200, arms_wanted=arms, m_max=200)


def test_decode_profile_goes_to_the_file_it_names(tmp_path, monkeypatch):
    """``bench_decode --profile`` writes every profiled call's table into the file beside its JSON
    (``<json>_profile.txt``), whatever the calls are named (a loop variable once shadowed that path,
    and the tables went to a file named after the last call's path)."""
    import os
    import tempfile

    from cco.comm import Communicator
    from scripts import bench_decode as B

    monkeypatch.setattr(B, "shapes", lambda selection: {"tiny": (128, 256)})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.chdir(tmp_path)
    args = B.parse_args(["--per-call-only", "--shapes", "tiny", "-m", "1,3", "--quant", "ptpc", "--profile",
                         "--profile-calls", "2"])
    comm = Communicator(rank=0, world=1, init_method=f"file://{os.path.join(tempfile.mkdtemp(), 'rdv')}",
                        device=torch.device("cpu"))
    path = tmp_path / "run_profile.txt"
    try:
        B.profile_calls(args, comm, torch.device("cpu"), str(path))
    finally:
        comm.close()
    text = path.read_text()
    for name in ("nn.Linear bf16, M=1, world 1", "layer ptpc, M=3 (quantizer + op), world 1",
                 "torch.ops.cco.row_parallel_linear ptpc, M=1, world 1"):
        assert f"==== {name}, rank 0:" in text
    assert sorted(os.listdir(tmp_path)) == ["run_profile.txt"]  # nothing written beside it


def test_decode_jit_arms_switch_the_kept_launches_off_for_their_call_only():
    """``bench_decode --jit-arms``: each such arm runs its call with every Triton launch through
    ``JITFunction.run`` and leaves the kept launches on for the next arm, also when the call raises."""
    pytest.importorskip("triton")
    from kernels_fused.hopper import launch as L
    from scripts import bench_decode as B

    assert B.parse_args(["--jit-arms"]).jit_arms and not B.parse_args([]).jit_arms
    seen = []
    arm = B.slow_launches(lambda: seen.append(L.FAST_LAUNCH))
    arm()
    assert seen == [False] and L.FAST_LAUNCH

    def fails():
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError):
        B.slow_launches(fails)()
    assert L.FAST_LAUNCH


def test_decode_plots_redraw_from_a_runs_json(tmp_path):
    """``bench_decode --from <json> --plot-per-call <png> --plot <png>`` draws both plots of a GPU
    run on the host (the per-call one from the world-1 rows, which have nn.Linear's arm)."""
    pytest.importorskip("matplotlib")
    from scripts import bench_decode as B

    per_call = tmp_path / "per_call.png"
    model = tmp_path / "model.png"
    B.main(["--from", "docs/results/2026-12-03_decode_per_call_wide_h200.json", "--plot-per-call", str(per_call)])
    B.main(["--from", "docs/results/2026-12-03_decode_model_wide_h200.json", "--plot", str(model)])
    assert per_call.stat().st_size > 20_000 and model.stat().st_size > 20_000
    cold = tmp_path / "cold.png"  # a --cold run: its device panels draw both graphs' times
    B.main(["--from", "docs/results/2026-12-06c_decode_cold_h100/per_call_cold.json", "--plot-per-call", str(cold)])
    assert cold.stat().st_size > 20_000
    with pytest.raises(SystemExit, match="missing.json"):  # a JSON that is not there: said, not a silent pass
        B.main(["--from", str(tmp_path / "missing.json"), "--plot", str(model)])
    with pytest.raises(SystemExit, match="no model rows"):  # a per-call run has no model to draw
        B.main(["--from", "docs/results/2026-12-03_decode_per_call_wide_h200.json", "--plot", str(model)])


def test_decode_model_ratios_pass_by_pass(tmp_path, capsys):
    """``pass_ratios``: an arm's time over bf16's of the same batch, mode and pass, so a host that
    slows down over the run (here 2x in the last pass) divides out, where a ratio of medians over
    passes does not; an arm or mode bf16 lacks gets none. ``--from <json>`` without a plot prints
    the table with them; a JSON without model times is refused, saying so."""
    from scripts import bench_decode as B

    def arm(batch, name, eager, graph=None):
        modes = {"eager": B.summary([1e3 * t for t in eager], 1)}
        if graph:
            modes["graph"] = B.summary([1e3 * t for t in graph], 1)
        return {"batch": batch, "arm": name, "modes": modes}

    runs = [arm(1, "bf16", [10, 10, 20], [2, 2, 2]), arm(1, "cco ptpc", [9, 12, 18], [1.5, 1.5, 1.6]),
            arm(8, "cco ptpc", [5, 5, 5]), {"batch": 1, "arm": "failed", "error": "RuntimeError: x"}]
    B.pass_ratios(runs)
    vs = runs[1]["modes"]["eager"]["vs_bf16"]
    assert vs == {"median": 0.9, "min": 0.9, "max": 1.2}  # 9/10, 12/10, 18/20
    assert runs[1]["modes"]["eager"]["ms_per_token"] / runs[0]["modes"]["eager"]["ms_per_token"] == 1.2
    assert runs[1]["modes"]["graph"]["vs_bf16"]["median"] == 0.75
    assert "vs_bf16" not in runs[0]["modes"]["eager"] and "vs_bf16" not in runs[2]["modes"]["eager"]
    line = B.model_line(runs[1])
    assert "0.90x of bf16 (0.90..1.20)" in line and "0.75x of bf16" in line
    assert "ERROR RuntimeError: x" in B.model_line(runs[3])

    path = tmp_path / "model.json"
    for r in runs:
        for t in r.get("modes", {}).values():
            t.pop("vs_bf16", None)
    path.write_text(json.dumps({"model": {"runs": runs}}))
    assert B.main(["--from", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and "0.90x of bf16 (0.90..1.20)" in out[1]
    path.write_text(json.dumps({"per_call": []}))
    with pytest.raises(SystemExit, match="no model rows with times"):
        B.main(["--from", str(path)])


def test_decode_model_timing_gives_each_arm_its_threads_cpu_time():
    """``time_decode``: each arm's eager passes as wall time and as the issuing thread's CPU time
    (``CPU_MODE``), both per token, each with its pass-by-pass ratio to bf16 (``pass_ratios``); no
    graph mode for arms without a captured step. (The timing itself stood in for: no GPU here.)"""
    from types import SimpleNamespace

    from scripts import bench_decode as B

    canned = {"bf16": {"wall_pass_us": [20e3, 20e3, 40e3], "host_pass_us": [20e3] * 3, "cpu_pass_us": [10e3] * 3},
              "cco ptpc": {"wall_pass_us": [22e3, 30e3, 40e3], "host_pass_us": [21e3] * 3, "cpu_pass_us": [9e3] * 3}}

    def timed(steps, **_):
        assert set(steps) == set(canned)
        return {arm: canned[arm] for arm in steps}

    model = SimpleNamespace(_cco_rowwise=[], _cco_colwise=[])
    args = SimpleNamespace(tokens=2, repeats=3, python_arms=False, kept_arms=False)
    out = B.time_decode(model, None, {"bf16": ([], None), "cco ptpc": ([], None)}, args, timed)
    runs = [{"batch": 1, "arm": arm, "modes": modes} for arm, modes in out.items()]
    B.pass_ratios(runs)
    cpu, eager = out["cco ptpc"][B.CPU_MODE], out["cco ptpc"]["eager"]
    assert cpu["ms_per_token"] == 4.5 and cpu["vs_bf16"]["median"] == pytest.approx(0.9)
    assert eager["ms_per_token"] == 15.0 and eager["vs_bf16"]["median"] == pytest.approx(1.1)
    assert eager["host_ms_per_token"] == 10.5 and "graph" not in out["bf16"]
    assert "eager thread CPU 4.50 ms/token" in B.model_line(runs[1])


def test_decode_model_profile_writes_one_table_per_arm(tmp_path, monkeypatch):
    """``bench_decode --model-only --profile``: one cProfile table per built arm (its linears put in
    first), headed by the batch, the arm and the host us per step, appended to the file it names;
    the model's own linears back in place after it."""
    from scripts import bench_decode as B

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    put, restored = [], []
    monkeypatch.setattr(B, "put", lambda model, made: put.append(list(made)))
    monkeypatch.setattr(B, "swapped", lambda model, make: restored.append(make))

    class Dec:
        batch, steps = 2, 0

        def rewind(self):
            pass

        def step(self):
            self.steps += 1
            torch.ones(4).sum()

    dec, path = Dec(), tmp_path / "m_model_profile.txt"
    args = B.parse_args(["--model-only", "--tokens", "3", "--profile"])
    B.profile_model(None, dec, {"bf16": ([], None), "cco ptpc": (["layer"], None)}, args, str(path))
    text = path.read_text()
    assert "==== batch 2, bf16: " in text and "==== batch 2, cco ptpc: " in text and "us/step" in text
    assert put == [[], ["layer"]] and restored == [None] and dec.steps == 2 * (1 + 3)


def test_profile_decode_call_writes_each_ranks_profile(tmp_path):
    """``scripts/profile_decode_call.py`` at world 1 on the CPU: the three measurements' line (back to
    back, idle queue, the profile) printed and written with the profile's tables of the layer's
    functions; sizes below 1 are refused."""
    from scripts import profile_decode_call as P

    out = tmp_path / "prof"
    P.main(["--quant", "ptpc", "-n", "64", "-k", "128", "-m", "2", "--calls", "3", "--out", str(out)])
    text = (out / "rank0.txt").read_text()
    assert text.startswith("rank 0/1 ptpc N=64 K=128 M=2: back to back host")
    assert "idle queue: median" in text and "cumulative" in text and "cco/nn/linear.py" in text
    # --parts: every arm timed, the layer's path function by function, and every wrapper undone after
    import json

    from cco import op as op_module
    before = op_module.ScatterGemmOp.__call__
    P.main(["--quant", "ptpc", "-n", "64", "-k", "128", "-m", "2", "--calls", "3", "--out", str(out), "--parts"])
    parts = json.loads((out / "parts_rank0.json").read_text())
    assert set(parts["arms"]) >= {"nn.Linear", "quantizer", "layer", "layer, its parts timed"}
    assert all(v["p10"] <= v["median"] <= v["p90"] for v in parts["arms"].values())
    assert parts["timed"]["quantize_activation"][1] == 1 and "plan_call" not in parts["timed"]  # world 1: no plan
    assert op_module.ScatterGemmOp.__call__ is before
    assert "inside the layer's call" in (out / "rank0.txt").read_text()
    with pytest.raises(SystemExit, match="must be >= 1"):
        P.main(["-m", "0"])


def test_decode_cold_graphs_call_each_weight_in_turn(monkeypatch, capsys):
    """``bench_decode --cold``: a graph's calls go to the arm's callables in turn (call ``j`` to the
    ``j % len``-th: each of 10 calls on its own weight), a single callable every call as before;
    ``--cold`` is refused at world >= 2, which times no graph."""
    from scripts import bench_decode as B

    fns = [lambda i=i: i for i in range(3)]
    assert [f() for f in B.graph_calls_of(fns, 7)] == [0, 1, 2, 0, 1, 2, 0]
    one = fns[0]
    assert B.graph_calls_of(one, 4) == [one] * 4
    with pytest.raises(ValueError, match="each must be >= 1"):
        B.graph_calls_of([], 4)
    assert B.parse_args(["--cold"]).cold and not B.parse_args([]).cold
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exc:
        B.parse_args(["--per-call-only", "--cold"])
    assert exc.value.code == 2 and "--cold times graph replays" in capsys.readouterr().err


_COLD_RUN = r"""
import sys, torch
from scripts import bench_decode as B
import cco.bench.timing as T
outs = {}
def total(out):  # (the quantizer's arm gives its rows and scales)
    return (out[0] if isinstance(out, tuple) else out).float().sum().item()
def graphs(arms, args, time_arms):  # each graph's calls made once, in the order a capture makes them
    for name, fns in arms.items():
        outs[name] = [total(fn()) for fn in B.graph_calls_of(fns, args.graph_calls)]
    return {name: 1.0 for name in arms}
B.graph_device_us = graphs
T.time_back_to_back = lambda arms, **kw: {name: {"host_us": 1.0, "wall_us": 1.0} for name in arms}
args = B.parse_args(["--per-call-only", "--shapes", "8b-o-tp8", "-m", "8", "--quant", "ptpc", "--graph-calls", "3"]
                    + sys.argv[1:])
comm = B.launched_or_one_rank(torch.device("cpu"))
rows = []
with comm:
    B.per_call_runs(args, comm, torch.device("cpu"), into=rows)
print(repr((sorted(rows[0]), rows[0].get("graph_weights_cold"), outs)))
"""


@pytest.mark.parametrize("cold", [False, True])
def test_decode_cold_graphs_read_a_weight_a_call(cold):
    """``bench_decode --cold`` (per-call table, world 1, on the CPU with the timings stubbed): each
    arm's one-weight graph makes its calls on one weight (the same output each call), and with
    ``--cold`` also a graph whose ``--graph-calls`` calls are each on their own weight (outputs all
    different), recorded as ``graph_us_cold`` with ``graph_weights_cold``; without it, no cold
    graph is made or recorded."""
    import ast

    from scripts.bench_decode import COLD

    root = pathlib.Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-c", _COLD_RUN, *(["--cold"] if cold else [])], capture_output=True,
                          text=True, timeout=240, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]
    keys, weights, outs = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    for arm in ("nn.Linear bf16", "cco ptpc", "cco ptpc: op"):
        assert len(outs[arm]) == 3 and len(set(outs[arm])) == 1, (arm, outs[arm])  # one weight
        if cold:
            assert len(set(outs[arm + COLD])) == 3, (arm, outs[arm + COLD])  # a weight a call
    assert ("graph_us_cold" in keys, weights) == ((True, 3) if cold else (False, None))
    assert cold or not any(name.endswith(COLD) for name in outs)  # no cold graph made without --cold


def test_profile_decode_call_alternates_the_world2_gemms(tmp_path):
    """``profile_decode_call --alternate-split`` times the layer's call with its GEMM forced on the
    decode MMA and forced on the lsa kernel's own, alternating per pass, and restores the rule after
    each arm; it refuses a run where the decode MMA arm took no call (a timing of the wrong path)
    and a layer whose calls cannot take it, and at world 1 (no collective call) before anything."""
    import types

    from scripts import profile_decode_call as P

    class Backend:
        decode_split = None

        def __init__(self):
            self.real = []

        def _decode_lsa(self, *a):
            self.real.append(a)

    backend = Backend()
    seen = []

    class Layer:
        quant, op = "ptpc", types.SimpleNamespace(_backend=backend)

        def _rows_for(self, m):
            return m

        def __call__(self, x):
            seen.append(backend.decode_split)
            if backend.decode_split:
                backend._decode_lsa("a", "plan")

    comm = types.SimpleNamespace(world=2, barrier=lambda: None)
    layer, x = Layer(), torch.zeros(8, 4)
    found = P.alternate(layer, x, comm, 3, 2, lambda: None, *P._alternatives(layer, x, comm, "split"))
    assert list(found["passes"]) == ["decode MMA + lsa transfers", "lsa kernel"]
    assert all(len(v) == 2 for v in found["passes"].values())
    assert set(seen) == {True, False} and backend.decode_split is None and "_decode_lsa" not in vars(backend)
    assert len(backend.real) == seen.count(True)
    # the split arm's calls not reaching the decode MMA: refused, not timed as if they had
    Layer.__call__ = lambda self, x: None
    with pytest.raises(SystemExit, match="no call took the decode MMA"):
        P.alternate(layer, x, comm, 3, 1, lambda: None, *P._alternatives(layer, x, comm, "split"))
    layer.quant = "mxfp8"
    with pytest.raises(SystemExit, match="mxfp8 calls of 8 rows cannot take the decode MMA"):
        P._alternatives(layer, x, comm, "split")
    with pytest.raises(SystemExit, match="--alternate-split needs the fused layer at world >= 2"):
        P.main(["--quant", "ptpc", "-n", "64", "-k", "128", "-m", "2", "--calls", "2", "--out", str(tmp_path),
                "--alternate-split", "1"])
