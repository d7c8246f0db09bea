"""The benchmark scripts on the host: a failed check fails the run (exit status 1, the wrong arm named
in the table), a GPU-only script says so without a traceback, bad arguments and output paths are
refused before anything runs, predict_scaling writes no file unless asked, and the launchers take a
process count only when given one. Nothing here needs a GPU or times anything."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


# ---- 1. a failed check fails the run --------------------------------------------------------------
def _gemm_ar_record(ok=True, self_test=None):
    correctness = {"split": {"rel_l2": 1e-3, "bad_elements": 0, "ok": True},
                   "fused": {"rel_l2": 0.5 if not ok else 1e-3, "bad_elements": 0 if ok else 77, "ok": ok}}
    arms = {"split": {"median_us": 100.0, "min_us": 99.0, "max_us": 101.0, "pass_us": (100.0,), "spread": 0.02}}
    if ok:
        arms["fused"] = dict(arms["split"])
    return {"m": 4096, "n": 7168, "k": 2048, "quant": "ptpc", "pattern": "ar", "world": 2, "graph": False,
            "chunks": "backend default", "arms": arms, "correctness": correctness,
            "dropped_for_wrong_output": [] if ok else ["fused"], "self_test": self_test or {"split": {}, "fused": {}}}


class _Comm:
    """Two ranks, the other of which reports ``other``."""

    world = 2

    def __init__(self, other):
        self.other = other

    def all_gather_object(self, mine):
        return [mine, self.other]


def test_gemm_ar_a_wrong_arm_is_named_in_the_table_and_fails_the_run():
    from scripts.bench_gemm_ar import exit_status, failures, print_table

    good, wrong = _gemm_ar_record(), _gemm_ar_record(ok=False)
    assert failures([good]) == [] and exit_status(None, [good]) == 0
    assert exit_status(None, [good, wrong]) == 1 and "fused" in failures([wrong])[0]
    out = io.StringIO()
    print_table(wrong, file=out)
    assert "fused" in out.getvalue() and "WRONG, not timed: rel L2 5.00e-01, 77 elements off" in out.getvalue()
    broken = _gemm_ar_record(self_test={"split": {}, "fused": {"error": "SelfTestError: no bytes moved"}})
    broken["correctness"].pop("fused")  # (an arm whose bytes did not move is neither checked nor timed)
    broken["arms"].pop("fused")
    assert exit_status(None, [broken]) == 1
    out = io.StringIO()
    print_table(broken, file=out)
    assert "SELF TEST FAILED (not timed): SelfTestError: no bytes moved" in out.getvalue()
    # --check-only: WRONG and a failed self test both fail the run; printed as before
    check = {**wrong, "check_only": True, "arms": {}}
    assert exit_status(None, [check]) == 1
    out = io.StringIO()
    print_table({**broken, "check_only": True, "arms": {}}, file=out)
    assert "SELF TEST FAILED, not checked" in out.getvalue()


def test_gemm_ar_every_rank_exits_with_the_verdict_of_all():
    """A check fails on one rank only (each rank checks its own output): every rank exits 1."""
    from scripts.bench_gemm_ar import exit_status

    assert exit_status(_Comm(other=True), [_gemm_ar_record()]) == 1
    assert exit_status(_Comm(other=False), [_gemm_ar_record()]) == 0
    assert exit_status(_Comm(other=False), [_gemm_ar_record(ok=False)]) == 1


def test_sp_parts_and_gemm_count_what_posted_no_time():
    from scripts import bench_gemm, bench_sp_parts

    label = {"pattern": "ag", "quant": "ptpc", "shape": "llama3-70b gate_up TP2 N=28672 K=8192", "m": 4096}
    assert bench_sp_parts.failures([{**label, "ratio": {}}]) == []
    assert "check failed" in bench_sp_parts.failures([{**label, "ratio": {}}, {**label, "error": "check failed"}])[0]
    rec = {"quant": "ptpc", "m": 4096, "bad_elements": {"scaled_mm": 0, "triton": 0}}
    assert bench_gemm.failures([rec]) == []
    assert bench_gemm.failures([rec, {**rec, "bad_elements": {"triton": 3}}]) == [
        "ptpc M=4096 triton: 3 elements outside the GEMM budget"]


def test_decode_smoke_exits_1_when_an_arm_fails(monkeypatch, tmp_path, capsys):
    from scripts import bench_decode as B

    runs = [{"batch": 1, "arm": "bf16", "ok": True}, {"batch": 1, "arm": "cco ptpc", "error": "RuntimeError: boom"},
            {"batch": 1, "arm": "cco mxfp8", "ok": False}]
    assert B.smoke_failures(runs[:1]) == []
    assert B.smoke_failures(runs) == ["batch 1 cco ptpc: RuntimeError: boom", "batch 1 cco mxfp8: non-finite logits"]
    monkeypatch.setattr(B, "model_runs", lambda args, comm, device: list(runs))
    monkeypatch.chdir(tmp_path)
    assert B.main(["--smoke", "--batch", "1", "--json", "smoke.json"]) == 1
    assert "FAILED" in capsys.readouterr().err and (tmp_path / "smoke.json").exists()  # the JSON first
    monkeypatch.setattr(B, "model_runs", lambda args, comm, device: runs[:1])
    assert B.main(["--smoke", "--batch", "1"]) == 0


# ---- 2. GPU-only scripts say so ---------------------------------------------------------------------
def test_require_cuda_says_what_is_missing(monkeypatch):
    from cco.bench.timing import require_cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=r"^bench_x: needs a CUDA GPU \(torch.cuda.is_available\(\) is False\); "
                                         r"python -m cco.demo runs on the CPU$"):
        require_cuda("bench_x")


@pytest.mark.parametrize("script, argv", [("bench_gemm_ar", ["--check-only"]), ("bench_gemm", []),
                                          ("bench_sp_parts", []), ("bench_decode", [])])
def test_gpu_only_mains_refuse_a_host_without_cuda(monkeypatch, script, argv):
    import importlib

    module = importlib.import_module(f"scripts.{script}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=f"{script}: needs a CUDA GPU"):
        module.main(argv)


# ---- 3, 4. arguments and output paths refused up front ----------------------------------------------
BAD_ARGS = [
    ("bench_gemm_ar", ["-m", "0"], "sizes must be >= 1"),
    ("bench_gemm_ar", ["-k", "-1"], "sizes must be >= 1"),
    ("bench_gemm_ar", ["--passes", "2"], "--passes >= 3"),
    ("bench_gemm_ar", ["--iters", "0"], "--iters >= 1"),
    ("bench_gemm_ar", ["--rotate", "0"], "--rotate >= 1"),
    ("bench_gemm_ar", ["--chunks", "9"], "--chunks 9"),
    ("bench_gemm_ar", ["--chunks", "0"], "--chunks 0"),
    ("bench_gemm", ["-m", "4096,0"], "sizes must be >= 1"),
    ("bench_gemm", ["-n", "0"], "sizes must be >= 1"),
    ("bench_gemm", ["--passes", "1"], "--passes >= 3"),
    ("bench_gemm", ["--rotate", "0"], "--rotate >= 1"),
    ("bench_gemm", ["--chunks", "4,9"], "--chunks"),
    ("bench_gemm", ["--producer-streams", "0"], "--producer-streams"),
    ("bench_decode", ["--quant", "bogus"], "bogus"),
    ("bench_decode", ["--batch", "1,x"], "comma list of integers"),
    ("bench_decode", ["-m", "0,8"], ">= 1"),
    ("bench_decode", ["--tokens", "0"], "--tokens 0"),
    ("bench_decode", ["--passes", "2"], "--passes 2"),
]


@pytest.mark.parametrize("script, argv, said", BAD_ARGS)
def test_bad_arguments_are_argparse_errors(capsys, script, argv, said):
    import importlib

    module = importlib.import_module(f"scripts.{script}")
    with pytest.raises(SystemExit) as exc:
        module.parse_args(argv)
    assert exc.value.code == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize("script, flags", [
    ("bench_gemm_ar", ("--json", "--plot", "--trace")), ("bench_gemm", ("--json", "--plot")),
    ("bench_sp_parts", ("--json", "--plot")), ("bench_decode", ("--json", "--plot", "--plot-per-call")),
    ("predict_scaling", ("--json", "--plot"))])
def test_an_output_path_in_a_missing_directory_is_refused_up_front(capsys, tmp_path, script, flags):
    import importlib

    module = importlib.import_module(f"scripts.{script}")
    missing = tmp_path / "nope"
    for flag in flags:
        with pytest.raises(SystemExit) as exc:
            module.parse_args([flag, str(missing / "out.x")])
        assert exc.value.code == 2
        assert f"directory {missing} does not exist" in capsys.readouterr().err, flag
        assert getattr(module.parse_args([flag, str(tmp_path / "out.x")]), flag[2:].replace("-", "_"))
    module.parse_args([flags[0], "out.x"])  # the working directory: no directory part to check


# ---- 5. predict_scaling writes nothing unless asked ---------------------------------------------------
def test_predict_scaling_writes_no_file_without_plot(tmp_path, monkeypatch, capsys):
    from scripts import predict_scaling

    monkeypatch.chdir(tmp_path)
    predict_scaling.main(["--worlds", "8", "-m", "16384"])
    assert "PREDICTED" in capsys.readouterr().out
    assert os.listdir(tmp_path) == []


# ---- 6. the launchers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("script, env", [("launch_torchrun.sh", "PYTHON"), ("launch_mpirun.sh", "MPIEXEC")])
def test_launchers_take_a_count_only_when_given_one(tmp_path, script, env):
    path = os.path.join(ROOT, "scripts", script)
    stub = tmp_path / "show"  # prints the command line the launcher would exec
    stub.write_text('#!/bin/sh\nprintf "%s|" "$@"\n')
    stub.chmod(0o755)
    for flag in ("-h", "--help"):
        done = subprocess.run(["bash", path, flag], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0 and done.stdout.startswith(f"usage: scripts/{script} [NP"), done

    def launched(*argv):
        run = subprocess.run(["bash", path, *argv], capture_output=True, text=True, timeout=30,
                             env={**os.environ, env: str(stub)})
        assert run.returncode == 0, run
        return run.stdout

    count = "--nproc-per-node|{}|" if env == "PYTHON" else "-n|{}|"
    assert count.format(2) in launched("--mode", "fused") and "cco.demo|--mode|fused|" in launched("--mode", "fused")
    assert count.format(4) in launched("4", "--mode", "fused")
    assert count.format(2) in launched() and "cco.demo|0|" in launched("0")  # 0 is no count: the demo's
