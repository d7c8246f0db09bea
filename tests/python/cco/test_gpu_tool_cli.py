"""The GPU benchmarks' and probes' command lines on a machine without a GPU: each refuses with one
line and a non-zero exit (not a traceback) where it needs an NVIDIA GPU or a launcher, ``--help``
prints the usage and exits 0 without running, a bad argument is an argparse error before anything
runs (the gfx950 compile script's before it compiles), tune_decode's ``--from`` and
predict_scaling's ``--plot``/``--variants``/``--json`` say what is wrong up front, and bench_eager
counts a wrong output against its exit status. Every script runs as ``python3 -m scripts.X`` in a
child process with CUDA hidden (``CUDA_VISIBLE_DEVICES=``), so a GPU machine sees the same: one
forked per run from a child that has imported torch once (``_FORK_SERVER``)."""

import json
import os
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TIMEOUT_S = 120
RANK_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")

# A script's start is mostly torch's import (~2 s; these tests start some 40): a child that has imported
# torch, with CUDA hidden, forks a process per script run, which runs the script as `python -m` does
# (runpy, `__main__`, its own argv, environment, stdout and stderr, its exit status; an uncaught
# exception printed and status 1, atexit handlers run) and dies within the run's bound (SIGALRM).
_FORK_SERVER = r"""
import atexit, json, os, runpy, signal, sys, traceback
import torch  # noqa: F401
for line in sys.stdin:
    run = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(run["timeout"])
            for fd, path in ((1, run["out"]), (2, run["err"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            os.environ.clear()
            os.environ.update(run["env"])
            sys.argv = ["-m", *run["argv"]]
            try:
                runpy.run_module("scripts." + run["script"], run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as e:
                if isinstance(e.code, int) or e.code is None:
                    code = e.code or 0
                else:  # a message: printed, status 1
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


def _child_env(env=None) -> dict:
    """A script run's environment: this one's with CUDA hidden and no launcher's rank variables,
    then ``env`` (which may set them)."""
    child = {key: value for key, value in os.environ.items() if key not in RANK_KEYS}
    return {**child, "CUDA_VISIBLE_DEVICES": "", **(env or {})}


@pytest.fixture(scope="module", autouse=True)
def _fork_server():
    global _SERVER
    _SERVER = subprocess.Popen([sys.executable, "-c", _FORK_SERVER], cwd=ROOT, env=_child_env(),
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    yield
    _SERVER.stdin.close()
    _SERVER.wait(timeout=30)


def _run(script, *argv, env=None, timeout=TIMEOUT_S):
    """``(returncode, stdout, stderr)`` of ``python3 -m scripts.<script> argv`` without a visible GPU
    (a process forked by the module's child, ``_FORK_SERVER``)."""
    with tempfile.TemporaryDirectory(prefix="cco-cli-") as d:
        out, err = os.path.join(d, "out"), os.path.join(d, "err")
        _SERVER.stdin.write(json.dumps({"script": script, "argv": list(map(str, argv)), "env": _child_env(env),
                                        "timeout": timeout, "out": out, "err": err}) + "\n")
        _SERVER.stdin.flush()
        said = _SERVER.stdout.readline()
        assert said, "the fork server died"
        rc = int(said)
        if rc == -14:  # SIGALRM: the run's bound
            pytest.fail(f"scripts.{script} {' '.join(map(str, argv))} still running after {timeout} s")
        return rc, *(open(path).read() if os.path.exists(path) else "" for path in (out, err))


@pytest.mark.parametrize("script, argv", [("probe_decode_host", ["--help"]), ("tune_decode", ["-m", "1,x"]),
                                          ("bench_quantize", [])])
def test_a_forked_run_is_what_python_m_gives(script, argv):
    """The fork server stands in for ``python3 -m scripts.X``: the same exit status, stdout and stderr
    (the usage's program name, an argparse error, a refusal without a GPU) as a process of its own."""
    done = subprocess.run([sys.executable, "-m", f"scripts.{script}", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=TIMEOUT_S, env=_child_env())
    assert _run(script, *argv) == (done.returncode, done.stdout, done.stderr)


def _one_line_error(rc, out, err, *said, code=None):
    """A refusal: non-zero exit (``code`` if given), no traceback, its last stderr line says ``said``."""
    assert rc != 0 and (code is None or rc == code), (rc, out, err)
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1] if err.strip() else ""
    for words in said:
        assert words in last, (words, err)


# ---- 1. a GPU benchmark or probe on a machine without one: one line, non-zero ----------------------------
@pytest.mark.parametrize("script, argv", [
    ("bench_eager", []), ("bench_quantize", []), ("tune_decode", []), ("probe_decode_rows", []),
    ("probe_producer_parts", []), ("probe_blockscale_rows", ["8b-o-tp1", "8", "bs.json"]),
    ("probe_mx_dot_scaled", ["8b-o-tp1", "8", "mx.json"]), ("probe_driver_holds", []),
    ("probe_eager_graph_bits", ["8b-o-tp1", "1,8", "bits.json"]), ("probe_decode_model_host", []),
    ("probe_decode_interleave", []), ("probe_mx_decode", ["8b-o-tp1", "8", "mx.json"])])
def test_a_gpu_tool_without_a_gpu_says_so_in_one_line(script, argv):
    rc, out, err = _run(script, *argv)
    _one_line_error(rc, out, err, f"{script}: needs a CUDA GPU")


def test_bench_link_needs_torchrun_and_gpus():
    rc, out, err = _run("bench_link")  # no launcher
    _one_line_error(rc, out, err, "bench_link: needs torchrun and an NVIDIA GPU per rank", "no torchrun ranks")
    rc, out, err = _run("bench_link", env={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"})  # torchrun, no GPU
    _one_line_error(rc, out, err, "bench_link: needs torchrun and an NVIDIA GPU per rank", "no CUDA GPU")


# ---- 2. --help: the usage, exit 0, nothing run ------------------------------------------------------------
@pytest.mark.parametrize("script", ["probe_driver_holds", "probe_blockscale_rows", "probe_mx_dot_scaled",
                                    "probe_decode_host", "profile_decode_mma", "probe_eager_graph_bits",
                                    "probe_mx_decode"])
def test_help_prints_the_usage_and_runs_nothing(script):
    rc, out, err = _run(script, "--help", timeout=60)
    assert rc == 0 and out.startswith("usage: ") and "needs" not in out + err and "RESULT" not in out, (rc, out, err)


def test_the_gfx950_compile_scripts_help_ends_its_sentence():
    rc, out, err = _run("compile_triton_gfx950", "--help", timeout=60)
    description = " ".join(out.split("\n\n")[1].split())
    assert rc == 0 and description.endswith("no GPU."), description


@pytest.mark.parametrize("script, argv, said", [
    ("probe_driver_holds", ["eager_copy", "cpu"], "a case is SHAPE BLOCK WORD"),
    ("probe_blockscale_rows", ["8b-up", "8", "bs.json"], "unknown shapes ['8b-up']"),
    ("probe_mx_dot_scaled", ["8b-o-tp1", "x", "mx.json"], "'x' is not a comma list of integers"),
    ("probe_decode_host", ["--rows", "8"], "unrecognized arguments: --rows 8"),
    ("probe_decode_split_k", ["--quant", "x", "8b-o-tp1", "8", "a.json"], "--quant x: pick from ptpc, blockscale"),
    ("probe_decode_split_k", ["--block-n", "64,x", "8b-o-tp1", "8", "a.json"], "'64,x' is not a comma list"),
    ("profile_decode_mma", ["--quant", "mxfp8"], "the MMA over quantized rows takes ptpc and blockscale"),
    ("profile_decode_mma", ["-m", "1,8"], "must be in 2..64"),
    ("probe_quantize_groups", ["--tiles", "8x100"], "must be powers of two"),
    ("probe_quantize_groups", ["--tiles", "8x64", "--quant", "blockscale"], "a multiple of 128"),
    ("probe_quantize_groups", ["-m", "8"], "pass --tiles"),
    ("probe_eager_graph_bits", ["--quant", "fp4", "8b-o-tp1", "8", "a.json"], "--quant fp4: pick from ptpc"),
    ("probe_eager_graph_bits", ["--layer", "mlp", "8b-o-tp1", "8", "a.json"], "invalid choice: 'mlp'"),
    ("probe_mx_decode", ["8b-up", "8", "a.json"], "unknown shapes ['8b-up']"),
    ("probe_mx_decode", ["--slices", "4,x", "8b-o-tp1", "8", "a.json"], "'4,x' is not a comma list")])
def test_the_probes_positionals_are_argparse_errors(script, argv, said):
    rc, out, err = _run(script, *argv, timeout=60)
    _one_line_error(rc, out, err, said, code=2)


# ---- 3. argument errors before anything runs --------------------------------------------------------------
@pytest.mark.parametrize("script, argv, said", [
    ("bench_eager", ["-m", "x"], "argument -m: 'x' is not a comma list of integers"),
    ("bench_eager", ["-m", "16,0"], "every value must be >= 1"),
    ("bench_eager", ["--json", "/nonexistent-dir/e.json"], "directory /nonexistent-dir does not exist"),
    ("bench_link", ["--cols", "100"], "--cols 100 must be a multiple of 256"),
    ("tune_decode", ["-m", "1,x"], "'1,x' is not a comma list of integers"),
    ("probe_blockscale_rows", ["8b-o-tp1", "8", "/nonexistent-dir/bs.json"], "directory /nonexistent-dir does not"),
    # the compile script (under TRITON_INTERPRET=1, which it refuses in check(): an error there, not
    # the argparse one, is what a parse-time check missing would show, and nothing gets compiled)
    ("compile_triton_gfx950", ["-m", "0"], "argument -m: '0': every value must be >= 1"),
    ("compile_triton_gfx950", ["-m", "x"], "argument -m: 'x' is not a comma list of integers"),
    ("compile_triton_gfx950", ["-m", "1", "--json", "/nonexistent-dir/x.json"],
     "--json /nonexistent-dir/x.json: directory /nonexistent-dir does not exist")])
def test_bad_arguments_are_one_argparse_line(script, argv, said):
    rc, out, err = _run(script, *argv, env={"TRITON_INTERPRET": "1"})
    _one_line_error(rc, out, err, said, code=2)
    assert out == ""


# ---- 4. tune_decode --from ------------------------------------------------------------------------------
def test_tune_decode_from_without_plot_is_refused(tmp_path):
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"rows": []}))
    rc, out, err = _run("tune_decode", "--from", run)
    _one_line_error(rc, out, err, f"--from {run} draws --plot", "pass --plot", code=2)


@pytest.mark.parametrize("text, said", [
    (None, "No such file or directory"), ("[]", "not a tune_decode --json"),
    ('{"gpu": "x"}', "not a tune_decode --json"), ('{"rows": [{"best_us": 3.0}]}', "not a tune_decode --json"),
    ("{not json", "Expecting property name")])
def test_tune_decode_from_a_file_that_is_not_a_run_is_one_line(tmp_path, text, said):
    path = tmp_path / "earlier.json"
    if text is not None:
        path.write_text(text)
    rc, out, err = _run("tune_decode", "--from", path, "--plot", tmp_path / "p.png")
    _one_line_error(rc, out, err, f"tune_decode: --from {path}", said, code=1)
    assert not (tmp_path / "p.png").exists()


# ---- 5. predict_scaling ---------------------------------------------------------------------------------
@pytest.mark.parametrize("script", ["probe_mx_decode", "probe_decode_split_k", "probe_decode_world_gemm"])
@pytest.mark.parametrize("text, said", [('{"rows": [{"m": 8}]}', "a row without its shape"),
                                        ("[]", "list indices must be integers")])
def test_a_decode_probes_from_a_file_that_is_not_its_run_is_one_line(tmp_path, script, text, said):
    path = tmp_path / "earlier.json"
    path.write_text(text)
    rc, out, err = _run(script, "--from", path, "--plot", tmp_path / "p.png")
    _one_line_error(rc, out, err, f"{script}: --from {path}: not this probe's JSON", said, code=1)
    assert not (tmp_path / "p.png").exists()


def test_predict_scaling_refuses_a_plot_it_cannot_write_before_the_table(tmp_path):
    rc, out, err = _run("predict_scaling", "--worlds", "8", "-m", "16384", "--plot", tmp_path / "ps.txt")
    _one_line_error(rc, out, err, "--plot", "ps.txt", "png")
    assert out == "" and not (tmp_path / "ps.txt").exists()


@pytest.mark.parametrize("argv, said", [(["--variants", "-m", "99", "--worlds", "2"], "m=99"),
                                        (["--variants", "--worlds", "3", "-m", "16384"], "world=3"),
                                        (["--check", "--variants", "-m", "99"], "m=99")])
def test_predict_scaling_variants_check_m_and_worlds_before_printing(argv, said):
    rc, out, err = _run("predict_scaling", *argv)
    _one_line_error(rc, out, err, "predict_scaling: ", said)
    assert out == ""


def test_predict_scaling_json_says_the_numbers_are_predictions(tmp_path):
    path = tmp_path / "p.json"
    rc, out, err = _run("predict_scaling", "--worlds", "8", "-m", "16384", "--json", path)
    assert rc == 0, err
    written = json.loads(path.read_text())
    assert isinstance(written, dict) and written["kind"] == "predicted" and written["date"]
    assert written["command"].endswith(f"predict_scaling --worlds 8 -m 16384 --json {path}")
    assert [(r["world"], r["m"]) for r in written["rows"]] == [(8, 16384)] * 2
    assert {"fused_ratio", "fused_fp8_ratio", "baseline_us", "quant"} <= set(written["rows"][0])


# ---- 6. bench_eager: a wrong output is a failed run ------------------------------------------------------
def test_bench_eager_names_the_arms_whose_outputs_failed_their_check():
    sys.path.insert(0, ROOT)
    try:
        from scripts.bench_eager import wrong_arms
    finally:
        sys.path.remove(ROOT)
    world_one = [{"m": 16, "bad_elements": {"op fused": 0, "_scaled_mm": 0}},
                 {"m": 128, "bad_elements": {"op fused": 3, "op gemm-only": 0}}]
    assert wrong_arms(world_one) == ["M=128 op fused"]
    world_two = [{"m": 16, "bad_elements": [{"op eager": 0, "op graph replay": 0},
                                            {"op eager": 0, "op graph replay": 2}]}]  # one dict per rank
    assert wrong_arms(world_two) == ["M=16 op graph replay"]
    assert wrong_arms(world_one[:1]) == []
