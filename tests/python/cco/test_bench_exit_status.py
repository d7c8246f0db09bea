"""The benchmark scripts on the host: a failed check fails the run (exit status 1, the wrong arm named
in the table), a GPU-only script says so without a traceback, bad arguments and output paths are
refused before anything runs, predict_scaling writes no file unless asked, the launchers take a
process count only when given one, a flag the run would ignore is refused with the flag it needs or
contradicts, the plot tools say which input file is missing or wrong in one line, ``--help`` opens
with a whole sentence, and a plot's title names the pattern. Nothing here needs a GPU or times
anything."""

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
        needs = ["--sweep"] if (script, flag) == ("bench_gemm_ar", "--plot") else []  # (section 7)
        with pytest.raises(SystemExit) as exc:
            module.parse_args([flag, str(missing / "out.png"), *needs])  # (.png: a plot's suffix is checked too)
        assert exc.value.code == 2
        assert f"directory {missing} does not exist" in capsys.readouterr().err, flag
        assert getattr(module.parse_args([flag, str(tmp_path / "out.png"), *needs]), flag[2:].replace("-", "_"))
    module.parse_args([flags[0], "out.png"])  # the working directory: no directory part to check


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


# ---- 7. a flag the run would ignore is refused, naming the flag it needs or contradicts ---------------
IGNORED_FLAGS = [
    ("bench_gemm_ar", ["--plot", "x.png"], ("--plot", "--sweep")),
    ("bench_gemm_ar", ["--mode", "split", "--trace", "t.json", "--trace-arm", "fused"],
     ("--trace-arm fused", "--mode split")),
    ("bench_gemm_ar", ["--pattern", "ag", "--trace", "t.json", "--trace-arm", "fused-lsa"],
     ("--trace-arm fused-lsa", "--pattern ag")),
    ("bench_gemm_ar", ["--quant", "mxfp8", "--trace", "t.json", "--trace-arm", "scaled_mm"],  # not run for mxfp8
     ("--trace-arm scaled_mm", "--quant mxfp8")),
    ("bench_gemm_ar", ["--trace-arm", "fused"], ("--trace-arm", "--trace PATH")),
    ("bench_gemm_ar", ["--trace", "t.json", "--check-only"], ("--trace", "--check-only")),
    ("bench_gemm_ar", ["--sweep", "-m", "4096"], ("--sweep", "-m 4096")),
    ("bench_gemm_ar", ["--sweep", "-m", "16384"], ("--sweep", "-m 16384")),  # the default's value, said explicitly
    ("bench_decode", ["--model-only", "--per-call-only"], ("--model-only", "--per-call-only")),
    ("bench_decode", ["--plot", "p.png", "--per-call-only"], ("--plot", "--per-call-only")),
    ("bench_decode", ["--plot-per-call", "p.png", "--model-only"], ("--plot-per-call", "--model-only")),
    ("bench_decode", ["--profile", "--smoke"], ("--profile", "--smoke")),
    ("bench_sp_parts", ["--from", "sp.json"], ("--from sp.json", "--plot")),
    ("bench_sp_parts", ["--from", "a.json", "--compare", "a.json,b.json", "--plot", "x.png"], ("--from", "--compare")),
    ("bench_gemm", ["--from", "out.json"], ("--from out.json", "--plot")),
    ("predict_scaling", ["--check", "--json", "p.json"], ("--json p.json", "--check")),
    ("predict_scaling", ["--sensitivity", "--plot", "p.png"], ("--plot p.png", "--sensitivity")),
    ("shape_table", ["--m-max", "0"], ("--m-max 0", ">= 1")),
]


@pytest.mark.parametrize("script, argv, said", IGNORED_FLAGS)
def test_flags_the_run_would_ignore_are_argparse_errors(capsys, script, argv, said):
    import importlib

    module = importlib.import_module(f"scripts.{script}")
    with pytest.raises(SystemExit) as exc:
        getattr(module, "parse_args", module.main)(argv)  # (shape_table parses in main)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # (shape_table: no table of "unfused: m=0" verdicts)
    for words in said:
        assert words in captured.err, (words, captured.err)


def test_gemm_ar_fills_what_it_can_tell_was_not_given():
    """-m's default is filled after parsing (so --sweep can tell an explicit -m); --trace profiles
    fused where --mode runs it, else --mode's first arm; the quoted commands still parse."""
    from scripts.bench_gemm_ar import parse_args

    assert parse_args([]).m == 16384 and parse_args(["-m", "4096"]).m == 4096
    assert parse_args(["--sweep", "--plot", "sweep.png"]).plot == "sweep.png"
    assert parse_args(["--trace", "t.json"]).trace_arm == "fused"
    assert parse_args(["--pattern", "ag", "--mode", "split,nccl-fp8+scaled_mm", "--trace",
                       "t.json"]).trace_arm == "split"
    assert parse_args(["--graph", "--mode", "fused-fp8,fused", "--trace", "t.json", "--trace-arm",
                       "fused-fp8"]).trace_arm == "fused-fp8"  # docs/experiments.md
    assert parse_args(["--mode", "fused-sdma", "--trace", "t.json", "--trace-arm", "fused"]).trace_arm == "fused"
    assert parse_args(["--trace", "t.json"]).trace and parse_args([]).trace_arm is None
    with pytest.raises(SystemExit) as exc:  # an unknown --mode under --trace: still refused by name
        parse_args(["--mode", "fused-xyz", "--trace", "t.json"])
    assert exc.value.code == 2


def test_predict_scaling_prints_each_of_check_sensitivity_and_variants_asked_for(capsys):
    """``--check --sensitivity`` printed only the check (the first ``return``): each is now printed."""
    from scripts import predict_scaling

    predict_scaling.main(["--check", "--sensitivity", "--variants", "--worlds", "2", "-m", "16384"])
    out = capsys.readouterr().out
    check, sens, var = (out.find(s) for s in ("model vs measured", "W=8 [16384, 7168]", "fused-fp8 per copy-engine"))
    assert 0 <= check < sens < var, out
    assert "PREDICTED (not measured) gemm-ar" not in out  # the table: instead of it, as before


@pytest.mark.parametrize("argv", [
    ["--repeats", "3", "--calls", "20", "--profile", "--json", "decode.json", "--plot", "decode.png"],
    ["--per-call-only", "--shapes", "8b-down-tp1", "-m", "2,32", "--quant", "ptpc,blockscale,mxfp8", "--profile"],
    ["--model-only", "--batch", "16", "--quant", "ptpc", "--repeats", "3", "--profile"],
    ["--model-only", "--batch", "1,8,32", "--quant", "ptpc", "--json", "model.json", "--plot", "model.png"],
    ["--per-call-only", "--shapes", "8b-down-tp1,70b-down-tp1", "-m", "1,8,32,64", "--json", "per_call.json",
     "--plot-per-call", "per_call.png"]])
def test_decode_commands_the_docs_quote_still_parse(argv):
    """docs/decode.md's and docs/guide.md's commands: ``--profile`` without ``--json`` among them, so
    that one writes its tables to ``bench_decode_profile.txt`` / ``bench_decode_model_profile.txt``
    rather than being refused (or, as before, silently writing none)."""
    from scripts import bench_decode as B

    args = B.parse_args(argv)
    if args.profile:
        stem = os.path.splitext(args.json)[0] if args.json else "bench_decode"
        assert B.profile_path(args, "profile") == f"{stem}_profile.txt"
        assert B.profile_path(args, "model_profile") == f"{stem}_model_profile.txt"


def test_decode_profile_without_json_is_written_not_skipped(monkeypatch, tmp_path):
    """Both --profile sites used to need --json and skip silently without it: the per-call one now
    writes ``bench_decode_profile.txt`` (the main path, with the calls themselves stubbed: no GPU)."""
    from scripts import bench_decode as B

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stub")
    monkeypatch.setattr(B, "profile_calls", lambda args, comm, device, path: seen.append(path))
    monkeypatch.setattr(B, "per_call_runs", lambda *a, **k: [])
    monkeypatch.setattr(B, "launched_or_one_rank", lambda device: _OneRank())
    import kernels_fused.hopper.native as NV

    monkeypatch.setattr(NV, "ENABLED", False)
    monkeypatch.chdir(tmp_path)
    assert B.main(["--per-call-only", "--profile"]) == 0
    assert seen == ["bench_decode_profile.txt"]


class _OneRank:
    rank, world = 0, 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---- 8. the plot tools' input files: a one-line SystemExit naming the file and what was expected ------
def _write(path, text):
    path.write_text(text)
    return str(path)


def test_plot_results_says_which_file_is_missing_or_wrong(tmp_path):
    from scripts import plot_results as P

    out = str(tmp_path / "o.png")
    missing = str(tmp_path / "missing.json")
    for argv, said in (
            ([missing], f"plot_results: {missing}: No such file or directory; expected a bench_gemm_ar --json"),
            ([os.path.join(ROOT, "README.md")], f"plot_results: {os.path.join(ROOT, 'README.md')}: not JSON "),
            ([_write(tmp_path / "list.json", "[1, 2]")], "list.json: not a gemm-ar sweep; expected a bench_gemm_ar"),
            ([_write(tmp_path / "runs.json", '{"runs": []}')], "runs.json: not a gemm-ar sweep")):
        with pytest.raises(SystemExit) as exc:
            P.main([*argv, "--out", out])
        assert isinstance(exc.value.code, str) and said in exc.value.code and "\n" not in exc.value.code, exc.value.code


def test_plot_results_refuses_a_mark_on_no_point(tmp_path):
    """``--mark ARM@M`` that matches nothing used to draw the plot without it: now an error naming the
    arms and the Ms there are."""
    pytest.importorskip("matplotlib")
    from scripts import plot_results as P

    sweep = os.path.join(ROOT, "docs", "results", "2026-11-30_sweep_h200x2.json")
    out = str(tmp_path / "o.png")
    for mark in ("fused-fp8@1234", "fused-xyz@32768"):
        with pytest.raises(SystemExit, match=rf"--mark {mark}: no such point; the arms drawn are .*fused-fp8.* and "
                                             r"the Ms 2048, 4096, 8192, 16384, 32768"):
            P.main([sweep, "--out", out, "--mark", mark])
    assert not os.path.exists(out)
    P.main([sweep, "--out", out, "--mark", "fused-fp8@32768"])  # docs/BENCHMARKS.md's
    assert os.path.getsize(out) > 10_000


@pytest.mark.parametrize("script, who", [("bench_gemm", "bench_gemm"), ("bench_sp_parts", "bench_sp_parts")])
def test_from_says_which_file_is_missing_or_of_another_layout(tmp_path, script, who):
    import importlib

    module = importlib.import_module(f"scripts.{script}")
    png = str(tmp_path / "x.png")
    missing = str(tmp_path / "missing.json")
    other = "2026-12-03_sp_parts_h200.json" if script == "bench_gemm" else "2026-12-02_gemm_only_h200.json"
    other = os.path.join(ROOT, "docs", "results", other)
    readme = os.path.join(ROOT, "README.md")
    for path, said in ((missing, f"{who}: --from {missing}: [Errno 2] No such file or directory"),
                       (readme, f"{who}: --from {readme}: Expecting value"),
                       (_write(tmp_path / "list.json", "[]"), f"--from {tmp_path / 'list.json'}: not a {who} --json"),
                       (os.path.join(ROOT, "docs", "results", "2026-11-30_sweep_h200x2.json"), f"not a {who} --json"),
                       (other, f"--from {other}: not a {who} --json (expected an object whose 'runs' are "
                               f"records with")):
        with pytest.raises(SystemExit) as exc:
            module.main(["--from", path, "--plot", png])
        assert isinstance(exc.value.code, str) and said in exc.value.code and "\n" not in exc.value.code, exc.value.code
    assert not os.path.exists(png)


def test_decode_from_says_when_the_json_is_not_an_object(tmp_path):
    from scripts import bench_decode as B

    with pytest.raises(SystemExit, match=r"--from .*list.json: not a bench_decode --json"):
        B.main(["--from", _write(tmp_path / "list.json", "[]"), "--plot", str(tmp_path / "x.png")])


# ---- 9. --help opens with a whole sentence; defaults shown --------------------------------------------
@pytest.mark.parametrize("script", ["bench_gemm_ar", "bench_decode", "bench_gemm", "bench_sp_parts", "predict_scaling",
                                    "plot_results", "shape_table", "profile_decode_call", "bench_link"])
def test_help_opens_with_a_whole_sentence(capsys, script):
    import importlib

    module = importlib.import_module(f"scripts.{script}")
    with pytest.raises(SystemExit) as exc:
        getattr(module, "parse_args", module.main)(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    description = " ".join(text.split("\n\n")[1].split())  # usage, then the description
    assert description.endswith((".", ":")) and not description.endswith("::"), description
    assert "``" not in description


def test_gemm_ar_and_decode_help_show_defaults_and_gemm_ar_every_arm(capsys, monkeypatch):
    from scripts import bench_decode, bench_gemm_ar
    from scripts.bench_gemm_ar import ALTERNATIVES, ARMS, MORI_NAMES, SP_ALTERNATIVES, SP_ARMS

    monkeypatch.setenv("COLUMNS", "10000")  # one line per option: the wrapper splits arm names at "-"
    with pytest.raises(SystemExit):
        bench_gemm_ar.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "(default: 7168)" in text and "(default: 16384;" in text and "(default: None)" not in text
    mode = next(line for line in text.splitlines() if line.lstrip().startswith("--mode MODE"))
    for arm in (*ARMS, *ALTERNATIVES, *MORI_NAMES, *(a for arms in SP_ARMS.values() for a in arms),
                *(a for arms in SP_ALTERNATIVES.values() for a in arms)):
        assert arm in mode, arm
    with pytest.raises(SystemExit):
        bench_decode.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 128256)" in text and "(default: None)" not in text


# ---- 10. a plot's title names the pattern ----------------------------------------------------------------
def test_gemm_ar_plot_title_names_the_pattern():
    from scripts.bench_gemm_ar import plot_title

    res = {"n": 7168, "k": 2048, "quant": "ptpc", "world": 2}
    assert plot_title({**res, "pattern": "ar"}).startswith("GEMM + all-reduce (--pattern ar) N=7168 K=2048 ptpc")
    assert plot_title({**res, "pattern": "rs"}).startswith("GEMM + reduce-scatter (rows) (--pattern rs)")
    assert plot_title({**res, "pattern": "ag"}).startswith("all-gather + GEMM (--pattern ag)")
    assert "all-reduce" not in plot_title({**res, "pattern": "ag"})


@pytest.mark.parametrize("pattern, said, baseline", [
    ("ar", "fused fp8 GEMM + all-reduce (--pattern ar)", "scaled_mm+nccl"),
    ("rs", "fused fp8 GEMM + reduce-scatter (rows) (--pattern rs)", "scaled_mm+nccl"),
    ("ag", "fused fp8 all-gather + GEMM (--pattern ag)", "nccl-fp8+scaled_mm"),
    (None, "fused fp8 GEMM + all-reduce (--pattern ar)", "scaled_mm+nccl")])  # a sweep from before --pattern
def test_plot_results_title_and_baseline_follow_the_pattern(tmp_path, monkeypatch, pattern, said, baseline):
    import json

    from scripts import plot_results as P

    arm = {"median_us": 100.0, "min_us": 99.0, "max_us": 101.0}
    results = [{"m": m, "n": 7168, "k": 2048, "quant": "ptpc", "world": 2, "graph": True,
                **({"pattern": pattern} if pattern else {}), "arms": {baseline: arm, "fused": arm}}
               for m in (4096, 8192)]
    path = _write(tmp_path / "sweep.json", json.dumps({"device": "H200", "results": results}))
    drawn, real_plot = {}, P.plot
    monkeypatch.setattr(P, "plot", lambda doc, results, names, out, **kw: drawn.update(kw, results=results))
    P.main([path, "--out", str(tmp_path / "o.png")])
    assert drawn["baseline"] == baseline
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = []
    monkeypatch.setattr(plt.Figure, "suptitle", lambda self, t, **kw: titles.append(t))
    real_plot({"device": "H200"}, drawn["results"], ["fused"], str(tmp_path / "o.png"), baseline=baseline)
    assert titles and titles[0].startswith(said), titles
