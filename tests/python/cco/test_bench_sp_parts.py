"""scripts/bench_sp_parts.py on the host: its arguments, the layer shapes it derives, and that the
arms it times issue the GEMM calls the CUDA backend's own call issues (streams and memory operations
are test_dma_schedule's recorders, the vendor GEMM torch's CPU one), so the benchmark cannot drift
from what the op runs. Nothing here times anything."""

from __future__ import annotations

import ctypes
import dataclasses
import json

import pytest
import torch

from cco import layout
from cco import quant as Q
from cco.cuda import dma
from scripts import bench_sp_parts as sp


def test_arguments_default_to_the_issues_sweep_and_refuse_what_cannot_run(capsys):
    args = sp.parse_args([])
    assert args.pattern == ["rs-rows", "ag"] and args.quant == list(Q.QUANTS)
    assert args.model == ["llama3-70b", "deepseek-v3"] and args.tp == [2, 4, 8] and args.m == [4096, 8192, 16384]
    assert args.passes >= 3 and args.json is None and args.plot is None
    args = sp.parse_args(["--pattern", "ag", "--quant", "mxfp8,ptpc", "--tp", "4", "-m", "8192", "--json", "x.json"])
    assert (args.pattern, args.quant, args.tp, args.m, args.json) == (["ag"], ["mxfp8", "ptpc"], [4], [8192], "x.json")
    for argv, said in ((["--pattern", "rs"], "rs-rows"), (["--quant", "fp4"], "blockscale"),
                       (["--model", "llama"], "llama3-70b"), (["--tp", "1"], "at least 2"),
                       (["-m", "4100", "--tp", "8"], "(4100, 8)"), (["-m", "0", "--tp", "2"], "(0, 2)"),
                       (["--passes", "2"], "--passes")):
        with pytest.raises(SystemExit):
            sp.parse_args(argv)
        assert said in capsys.readouterr().err, argv


@pytest.mark.parametrize("model, tp, rs, ag", [
    ("llama3-70b", 2, (8192, 14336), (28672, 8192)),
    ("llama3-70b", 8, (8192, 3584), (7168, 8192)),
    ("deepseek-v3", 4, (7168, 4608), (9216, 7168)),
    ("deepseek-v3", 8, (7168, 2304), (4608, 7168)),
])
def test_layer_shapes_are_the_mlps_per_rank_gemms(model, tp, rs, ag):
    """The reduce-scatter follows the row-parallel down projection (N = hidden, K = intermediate/TP),
    the all-gather feeds the column-parallel gate+up projection (N = 2 * intermediate/TP, K = hidden)."""
    assert sp.layer_shape("rs-rows", model, tp) == (*rs, "down")
    assert sp.layer_shape("ag", model, tp) == (*ag, "gate_up")


def test_every_default_shape_is_a_config_the_op_builds():
    """Each (pattern, quant, model, TP) of the default sweep is a config ``cco.op`` would build for the
    CUDA backend, and every M a call it takes (the GPU run must not stop on a refused shape)."""
    from cco.backends.cuda import lsa_max_elements

    args = sp.parse_args([])
    for pattern in args.pattern:
        for quant in args.quant:
            for model in args.model:
                for tp in args.tp:
                    n, k, _ = sp.layer_shape(pattern, model, tp)
                    cfg = sp.sp_config(pattern, quant, n, k, max(args.m), tp)
                    assert cfg.pattern == sp.PATTERNS[pattern] and cfg.world == tp
                    assert lsa_max_elements(cfg) == 0  # the copy-engine path, whose GEMMs the arms time
                    for m in args.m:
                        assert layout.call_rows_error(cfg, m if pattern == "rs-rows" else m // tp) is None


class _HostMemops:
    """test_dma_schedule's recorder that also does the writes, in host memory: the benchmark's check
    reads the counters they release."""

    def __init__(self, log):
        from tests.python.cco.test_dma_schedule import _Memops

        self.recorder = _Memops(log)

    def __getattr__(self, name):
        return getattr(self.recorder, name)

    def write(self, stream, addr, value):
        self.recorder.write(stream, addr, value)
        ctypes.c_int64.from_address(addr).value = value

    def fill(self, stream, dst, byte, nbytes):
        self.recorder.fill(stream, dst, byte, nbytes)
        ctypes.memset(dst, byte, nbytes)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("quant", ["ptpc", "blockscale", "mxfp8"])
@pytest.mark.parametrize("pattern", ["rs-rows", "ag"])
def test_arms_issue_the_backends_gemm_calls_and_pass_their_checks(monkeypatch, pattern, quant, world):
    """The pattern's arm issues exactly the vendor GEMM calls (operand bytes, rows, output address,
    accumulation, order) that the backend's own call issues on the same inputs: ``fused`` for the
    reduce-scatter along rows (its vendor producer; the kernel producer's arms, either launch, issue
    none, and the
    rule's arm what ``rows_producer`` picks), ``all_gather_gemm`` with the peers' rows in the window;
    ``whole`` is one GEMM of every row. Each arm's output passes the benchmark's check, and a peer's
    rows missing from the window fails it."""
    from cco.bench.timing import gemm_mismatches
    from kernels_fused.hopper import vendor
    from tests.python.cco.test_dma_schedule import RANK, _host_backend, _Log

    log = _Log()
    backend, sched = _host_backend(monkeypatch, log, pattern=sp.PATTERNS[pattern], quant=quant, world=world)
    backend.config = dataclasses.replace(backend.config, weight_layout="row-major")  # as sp_config builds it
    sched.memops = _HostMemops(log)
    cfg, cpu = backend.config, torch.device("cpu")
    m = cfg.m_max  # the tokens of the sequence: the rows before the scatter, or after the gather
    sets = [sp.rows_of(p, 0, m) for p in sp.device_problems(m, cfg.n, cfg.k, quant, 2, cpu)]
    calls = []
    real = vendor.vendor_gemm

    def recording(a, a_scale, weight, *, out=None, fast_accum=True):
        calls.append((_bytes(a), _bytes(a_scale), tuple(a.shape), out.data_ptr(), tuple(out.shape), fast_accum))
        return real(a, a_scale, weight, out=out, fast_accum=fast_accum)

    monkeypatch.setattr(vendor, "vendor_gemm", recording)
    arms = sp.sp_arms(pattern, backend, sets, m, cpu, streams=(1, 3))
    assert list(arms) == (["whole", pattern, f"{pattern} kernel", f"{pattern} vendor", f"{pattern} kernel-grid",
                           f"{pattern} kernel-ws", f"{pattern} kernel-ws-lag", f"{pattern} vendor chunks",
                           f"{pattern} vendor streams1",
                           f"{pattern} vendor streams3"]
                          if pattern == "rs-rows"
                          else ["whole", pattern, f"{pattern} chunks", f"{pattern} sources", f"{pattern} merged"])
    idx = sp.check_rows(m)
    ref, dot_abs = sp.sampled_terms(sets[0], idx)
    outputs, issued = {}, {}
    for name, (call, read) in arms.items():
        calls.clear()
        outputs[name] = call(0)
        got, wrong = read(outputs[name], idx)
        assert gemm_mismatches(got, ref, dot_abs) == 0 and wrong == 0, name
        issued[name] = list(calls)
        if name == "whole":
            assert [c[2:5:2] for c in calls] == [((m, cfg.k), (m, cfg.n))]
            whole_accum = calls[0][5]
    calls.clear()
    rows = m if pattern == "rs-rows" else m // world
    plan = layout.plan_call(cfg, m=rows, seq=1, rank=RANK, counter_base=layout.zero_counters(world))
    if pattern == "rs-rows":
        from cco.backends.cuda import rows_producer

        for kernel in ("kernel", "kernel-grid", "kernel-ws", "kernel-ws-lag"):  # one launch each, no vendor GEMM
            assert issued[f"{pattern} {kernel}"] == [], kernel
        assert len(issued[f"{pattern} vendor chunks"]) == world * plan.chunks  # a GEMM per (owner, chunk)
        assert issued[pattern] == issued[f"{pattern} {rows_producer(cfg, m)}"]
        arm_calls = issued[f"{pattern} vendor"]
        # the same GEMMs dealt to other streams (the call's own count restored after each)
        assert issued[f"{pattern} vendor streams1"] == issued[f"{pattern} vendor streams3"] == arm_calls
        assert sched.producer_streams == dma.PRODUCER_STREAMS
        backend.producer = "vendor"  # the backend's own call with the producer the arm compares
    else:
        arm_calls = issued[pattern]
        # the forced ends: a GEMM per peer chunk, a GEMM per peer, the peers' slots in one GEMM (rank 0:
        # they are one block); the rule's arm the backend's own: here merged (the call fills the slots
        # and each peer's rows are one group)
        assert len(issued[f"{pattern} chunks"]) == 1 + (world - 1) * plan.chunks
        assert len(issued[f"{pattern} sources"]) == world
        assert [c[2][0] for c in issued[f"{pattern} merged"]] == [rows, (world - 1) * rows]
        assert issued[pattern] == issued[f"{pattern} merged"] and rows == cfg.m_max_padded
        assert plan.chunks > 1 or world > 2  # at world 2 the two ends differ
    assert {c[5] for c in arm_calls} == {whole_accum}  # the baseline is the same GEMM recipe
    assert len(arm_calls) == sp.gemm_count(pattern, world, plan.rows, quant=quant, padded=pattern == "ag")
    assert isinstance(sched.memops, sp.NoPeers) == (pattern == "ag")
    if pattern == "ag":  # the op's call as it runs with peers (the recorder's waits pass)
        sched.memops = sched.memops.memops
    if pattern == "rs-rows":
        p = sets[0]
        backend.fused(p.a, p.b, p.a_scale, p.b_scale, out=torch.zeros(*layout.out_shape(cfg, m), dtype=torch.bfloat16),
                      plan=plan)
    else:
        own = sp.rows_of(sets[0], RANK * rows, (RANK + 1) * rows)
        backend.all_gather_gemm(own.a, own.b, own.a_scale, own.b_scale, out=outputs[pattern], plan=plan)
    assert arm_calls == calls

    if pattern == "ag":  # the check sees a peer's rows that never arrived
        backend._slots(1)[0].zero_()
        got, _ = arms[pattern][1](arms[pattern][0](0), idx)
        assert gemm_mismatches(got, ref, dot_abs) > 0


@pytest.mark.parametrize("landed", [False, True], ids=["no-peers", "flags-landed"])
def test_no_peers_drops_waits_and_copies_and_keeps_writes(landed):
    """The all-gather arm's memory operations: a wait for a peer's flag would hang one GPU and a
    put would time a copy to nobody; the own words' writes (stamp, flags zeroed) still run. With
    ``--flags-landed`` the waits run (on flags the benchmark set) and the puts stay dropped."""
    seen = []

    class Recorder:
        def __getattr__(self, name):
            return lambda *args, **kwargs: seen.append(name)

    ops = (sp.LandedPeers if landed else sp.NoPeers)(Recorder())
    ops.wait_geq(0, 8, 1)
    ops.wait_geq_kernel(None, 8, 1)
    ops.wait_block_kernel(None, None, 8, (0, 2), (0, 1), 0, 1)
    ops.copy(0, 8, 16, 8)
    ops.copy_2d(0, dst=8, dst_pitch=8, src=16, src_pitch=8, width=8, height=1)
    ops.write(0, 8, 0)
    ops.write_kernel(None, 8, 0)
    waits = ["wait_geq", "wait_geq_kernel", "wait_block_kernel"] if landed else []
    assert seen == waits + ["write", "write_kernel"]


def test_plot_from_json_writes_a_png(tmp_path):
    """``--from`` plots a run's JSON without a GPU (records without a ratio, failed shapes, skipped)."""
    runs = [{"pattern": pattern, "quant": quant, "model": "llama3-70b", "world": w, "m": m,
             "ratio": {"median": 1.05 + 0.01 * w, "min": 1.04, "max": 1.2}}
            for pattern in sp.PATTERNS for quant in ("ptpc", "mxfp8") for w in (2, 8) for m in (4096, 8192)]
    runs.append({"pattern": "ag", "quant": "blockscale", "model": "deepseek-v3", "world": 4, "m": 4096,
                 "error": "check failed"})
    data, png = tmp_path / "sp.json", tmp_path / "sp.png"
    data.write_text(json.dumps({"runs": runs}))
    sp.main(["--from", str(data), "--plot", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_draws_two_runs_cells_side_by_side(tmp_path, capsys):
    """``--compare BEFORE,AFTER --plot`` draws the cells both runs hold (a cell one run lacks, or a
    failed one, is left out) without a GPU; it needs exactly two files and a --plot."""
    def run(shift, extra=()):
        rows = [{"pattern": "ag", "quant": q, "model": "llama3-70b", "shape": f"llama3-70b gate_up TP{w} N=1 K=1",
                 "world": w, "m": m, "ratio": {"median": 1.1 - shift, "min": 1.0, "max": 1.2}}
                for q in ("ptpc", "mxfp8") for w in (4, 8) for m in (4096, 16384)]
        return {"runs": rows + list(extra)}
    before, after, png = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "cmp.png"
    before.write_text(json.dumps(run(0.0, [{"pattern": "ag", "quant": "blockscale", "error": "check failed"}])))
    after.write_text(json.dumps(run(0.05)))
    sp.main(["--compare", f"{before},{after}", "--plot", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for argv in (["--compare", str(before), "--plot", str(png)], ["--compare", f"{before},{after}"]):
        with pytest.raises(SystemExit):
            sp.parse_args(argv)
        assert "--compare" in capsys.readouterr().err


def test_measure_checks_and_records_every_shape_on_the_host(monkeypatch, capsys):
    """The sweep's driver end to end on the host (the backend of test_dma_schedule at small shapes,
    graph capture and timing replaced by one call of each arm and made-up pass times): one line per
    shape on stdout with the pass-by-pass ratio, progress on stderr, records that JSON takes; a shape
    whose arm fails its check is reported and not timed."""
    from cco.bench import timing
    from cco.cuda import dma
    from tests.python.cco.test_dma_schedule import _host_backend, _Log

    schedule_class = dma.CopyEngineSchedule
    built, logs = [], []

    def backend_for(cfg, dev):
        built.append((cfg.pattern, cfg.m_max))
        monkeypatch.setattr(dma, "CopyEngineSchedule", schedule_class)  # _host_backend leaves it patched
        backend, sched = _host_backend(monkeypatch, _Log(), pattern=cfg.pattern, quant=cfg.quant, world=cfg.world,
                                       m_max=cfg.m_max)
        backend.config = dataclasses.replace(backend.config, weight_layout="row-major")
        logs.append(_Log())
        sched.memops = _HostMemops(logs[-1])
        return backend

    def time_arms(arms, *, passes, iters, rotate, flush_l2):
        assert flush_l2 and passes >= 3
        for call in arms.values():
            call(0)
        slower = {"whole": 1.0}  # the pattern's arm 1.2x, 1.1x, 1.3x of whole, pass by pass
        return {name: timing.ArmTiming(name, 100.0 * slower.get(name, 1.2), 100.0, 130.0,
                                       tuple(100.0 * slower.get(name, r) for r in (1.2, 1.1, 1.3))) for name in arms}

    monkeypatch.setattr(sp, "layer_shape", lambda pattern, model, tp: (512 * tp, 256, "tiny"))
    monkeypatch.setattr(sp, "sp_backend", backend_for)
    monkeypatch.setattr(timing, "graphed", lambda arms, rotate: (arms, []))
    monkeypatch.setattr(timing, "time_arms", time_arms)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    args = sp.parse_args(["--quant", "ptpc", "--model", "llama3-70b", "--tp", "2", "-m", "256,512", "--passes", "3"])
    runs = sp.measure(args, torch.device("cpu"))
    out, err = capsys.readouterr()
    assert all("error" not in r for r in runs), [r.get("error") for r in runs]
    assert [(r["pattern"], r["m"]) for r in runs] == [("rs-rows", 256), ("rs-rows", 512), ("ag", 256), ("ag", 512)]
    # the all-gather's window per M, of M rows: its calls fill the slots, so the merged arm runs at every M
    assert built == [("reduce-scatter-rows", 512), ("all-gather", 256), ("all-gather", 512)]
    assert all(set(r["ratios"]) == {"ag chunks", "ag sources", "ag merged"} for r in runs if r["pattern"] == "ag")
    assert all(r["ratio"] == {"median": pytest.approx(1.2), "min": pytest.approx(1.1), "max": pytest.approx(1.3)}
               for r in runs)
    # the rows at these M are few per chunk: the reduce-scatter's rule takes the kernel producer, one
    # launch; the all-gather's consumer one GEMM for the own rows and one for the peer's chunks (together)
    assert [(r.get("producer"), r["gemms"]) for r in runs] == [
        ("kernel", 1) if r["pattern"] == "rs-rows" else (None, 2) for r in runs]
    assert sum("| 1.200x | 1.100-1.300" in line for line in out.splitlines()) == 4
    assert err.count("[") == 4 and "[4/4]" in err
    assert json.loads(json.dumps(runs))[0]["arms"]["whole"]["pass_us"] == [100.0] * 3

    real = sp.sp_arms  # an arm that writes the wrong rows is caught, and only that shape fails

    def wrong(pattern, backend, sets, m, dev, landed=False, streams=()):
        arms = real(pattern, backend, sets, m, dev, landed=landed, streams=streams)
        call, read = arms[pattern]
        arms[pattern] = (call, lambda got, idx: read(got, idx.flip(0)))
        return arms

    monkeypatch.setattr(sp, "sp_arms", wrong)
    runs = sp.measure(sp.parse_args(["--pattern", "ag", "--quant", "ptpc", "--model", "llama3-70b", "--tp", "2",
                                     "-m", "512", "--passes", "3"]), torch.device("cpu"))
    assert runs[0]["error"] == "check failed" and runs[0]["bad"]["ag"] > 0 and runs[0]["bad"]["whole"] == 0
    assert "not timed" in capsys.readouterr().out

    # --flags-landed: the peer's flags set before each call, the waits on them run (dropped otherwise)
    monkeypatch.setattr(sp, "sp_arms", real)
    for landed in (False, True):
        runs = sp.measure(sp.parse_args(["--pattern", "ag", "--quant", "ptpc", "--model", "llama3-70b", "--tp", "2",
                                         "-m", "512", "--passes", "3"] + ["--flags-landed"] * landed),
                          torch.device("cpu"))
        assert "error" not in runs[0]
        waits = [op for op in logs[-1].ops if op[1] in ("wait", "wait_block")]
        assert bool(waits) == landed, (landed, waits[:3])


def test_a_walk_the_installed_triton_may_race_is_the_grid_launch_or_refused_where_forced(monkeypatch):
    """Where ``RS_ROWS_KERNEL_LAUNCH`` takes the walk and the installed Triton's compile of it does
    not order its releases (``hopper_gemm.UnorderedReleases``, raised before the launch), the
    backend runs the grid launch, asks once, and computes the same slices and counters; a walk the
    caller forced (``rows_kernel_launch="ws"`` or ``"ws-lag"``) raises instead."""
    from cco.backends import cuda as cuda_backend
    from cco.bench.timing import gemm_mismatches
    from kernels_fused.hopper import gemm as hopper_gemm
    from tests.python.cco.test_dma_schedule import _host_backend, _Log

    backend, sched = _host_backend(monkeypatch, _Log(), pattern=sp.PATTERNS["rs-rows"], quant="ptpc", world=2)
    backend.config = dataclasses.replace(backend.config, weight_layout="row-major")
    cfg, cpu = backend.config, torch.device("cpu")
    m = cfg.m_max
    sets = [sp.rows_of(p, 0, m) for p in sp.device_problems(m, cfg.n, cfg.k, "ptpc", 1, cpu)]
    idx = sp.check_rows(m)
    ref, dot_abs = sp.sampled_terms(sets[0], idx)
    monkeypatch.setitem(cuda_backend.RS_ROWS_KERNEL_LAUNCH, "ptpc", "ws")
    asked = []

    def unordered(*args, **kwargs):
        asked.append(kwargs["rank"])
        raise hopper_gemm.UnorderedReleases("fp8_gemm_rows_ws: this Triton's walk may race (test)")

    monkeypatch.setattr(hopper_gemm, "fp8_gemm_rows_ws", unordered)
    arms = sp.sp_arms("rs-rows", backend, sets, m, cpu)
    call, read = arms["rs-rows kernel"]  # the kernel producer at the rule's launch
    for _ in range(2):
        got, wrong = read(call(0), idx)
        assert gemm_mismatches(got, ref, dot_abs) == 0 and wrong == 0
    assert len(asked) == 1  # then the grid launch without asking again
    for forced in ("rs-rows kernel-ws", "rs-rows kernel-ws-lag"):
        with pytest.raises(hopper_gemm.UnorderedReleases, match="may race"):
            arms[forced][0](0)
    assert len(asked) == 3
