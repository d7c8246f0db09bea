"""``scripts/gpu_suite.sh`` (the NVIDIA GPU suite, which CI cannot run): its two parts, each sized for
one 10-minute call of a lent machine, run every module of the whole suite between them, none twice
but the C++ table's build, which each part needs first; a skipped name and an unknown part do what
they say. ``CCO_GPU_SUITE_LIST=1`` lists the modules a run would run and runs nothing (no GPU)."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _modules(**env) -> list[str]:
    done = subprocess.run(["bash", "scripts/gpu_suite.sh", "/nonexistent/logs"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "CCO_GPU_SUITE_LIST": "1", **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_the_two_parts_run_every_module_once_and_each_builds_first():
    whole = _modules()
    one, two = _modules(CCO_GPU_SUITE_PART="1"), _modules(CCO_GPU_SUITE_PART="2")
    assert whole[0] == one[0] == two[0] == "native_build" and len(set(whole)) == len(whole) == 10
    assert sorted(one[1:] + two[1:]) == sorted(whole[1:])  # each module in exactly one part
    assert {"cuda_nn", "cuda_op", "cuda_sp", "cuda_hf", "cuda_faults_ag"} <= set(whole)
    assert not Path("/nonexistent/logs").exists()  # listing makes no log folder


def test_skip_and_an_unknown_part():
    assert "cuda_hf" not in _modules(CCO_GPU_SUITE_SKIP="cuda_hf") and len(_modules(CCO_GPU_SUITE_SKIP="cuda_hf")) == 9
    done = subprocess.run(["bash", "scripts/gpu_suite.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "CCO_GPU_SUITE_LIST": "1", "CCO_GPU_SUITE_PART": "3"})
    assert done.returncode == 2 and "must be 1, 2 or all" in done.stderr


def test_help_and_a_host_without_a_gpu():
    """``--help`` was taken for LOG_DIR (every module then "FAILED in 0s"), and on a host without a
    GPU every module ran to a traceback, cuda_hf (which also runs on CPU ranks) to a pass: the
    script prints its usage, and refuses a host without CUDA before any module."""
    run = lambda *args, **env: subprocess.run(["bash", "scripts/gpu_suite.sh", *args], cwd=ROOT,  # noqa: E731
                                              capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    done = run("--help")
    assert done.returncode == 0 and "CCO_GPU_SUITE_PART=1" in done.stdout and "set -uo" not in done.stdout, done
    done = run("--verbose")
    assert done.returncode == 2 and "unknown option '--verbose'" in done.stderr, done
    done = run("/nonexistent/logs", CUDA_VISIBLE_DEVICES="")  # no GPU seen, whatever the host has
    assert done.returncode == 2 and "needs an NVIDIA GPU" in done.stderr, done
    assert "[gpu-suite]" not in done.stdout and not Path("/nonexistent/logs").exists(), done


def test_the_tree_digest_is_the_files_in_byte_order_whatever_the_locale():
    """The digest a run prints (``CCO_GPU_SUITE_TREE=1``: no GPU) is defined here independently: the
    sha1 of one ``sha1  path`` line a file, the files sorted by their paths' bytes. A digest over
    ``sort``'s order under the machine's locale differed between two machines with the same files
    (2026-12-06); the script sorts under ``LC_ALL=C``. (The locales this host has all sort by bytes,
    so a locale that orders otherwise cannot be tried here.)"""
    import hashlib

    def digest(**env) -> str:
        done = subprocess.run(["bash", "scripts/gpu_suite.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                              env={**os.environ, "CCO_GPU_SUITE_TREE": "1", **env})
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    files = sorted((p.relative_to(ROOT).as_posix() for top in ("cco", "kernels_fused", "tests/python", "scripts")
                    for p in (ROOT / top).rglob("*") if p.is_file() and p.suffix in (".py", ".cpp", ".cu", ".h", ".sh")),
                   key=lambda path: path.encode())
    lines = "".join(f"{hashlib.sha1((ROOT / f).read_bytes()).hexdigest()}  {f}\n" for f in files)
    want = hashlib.sha1(lines.encode()).hexdigest()[:12]
    assert digest() == digest(LC_ALL="C.UTF-8") == digest(LC_ALL="C") == want
    assert "kernels_fused/hopper/decode.py" in lines and "tests/python/cco/conftest.py" in lines
    assert "kernels_fused/hopper/csrc/mx_decode.cu" in lines  # a kernel the suite runs, built from its source


def test_resume_counts_what_passed_on_this_tree_and_runs_the_rest(tmp_path):
    """The suite over several calls (``CCO_GPU_SUITE_RESUME=1``): a module recorded as passed on this
    tree's digest is not run again and counts as passed; one that failed, a record of another tree,
    and the C++ build always run; a failure drops the module's record; ``CCO_GPU_SUITE_PACK`` packs
    the log folder; under ``CCO_GPU_SUITE_BUDGET`` a module starts only where what is left holds its
    typical time. The modules are a stand-in interpreter (``PYTHON``) that logs its arguments and
    fails where ``FAKE_FAIL`` names one, so the script's bookkeeping runs here without a GPU."""
    import tarfile

    fake, calls, logs = tmp_path / "python", tmp_path / "calls", tmp_path / "logs"
    fake.write_text('#!/bin/bash\necho "$*" >>"$FAKE_CALLS"\n'
                    '[[ "$*" == *test_cuda_sp* ]] && echo "CUDA_SP_SKIPPED a sub-check this host cannot run"\n'
                    'for f in $FAKE_FAIL; do [[ "$*" == *"$f"* ]] && exit 1; done\nexit 0\n')
    fake.chmod(0o755)

    def suite(fail: str = "", **env):
        calls.write_text("")
        done = subprocess.run(["bash", "scripts/gpu_suite.sh", str(logs)], cwd=ROOT, capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHON": str(fake), "FAKE_CALLS": str(calls),
                                                "FAKE_FAIL": fail, **env})
        ran = [line for line in calls.read_text().splitlines() if not line.startswith("-c ")]  # (the GPU check)
        return done, ran

    done, ran = suite("test_cuda_op")
    assert done.returncode == 1 and len(ran) == 10, (done.stdout, ran)
    tree = done.stdout.split("tree ")[1].split()[0]
    records = (logs / "passed.txt").read_text().splitlines()
    assert len(records) == 9 and all(r.split()[1] == tree for r in records) and not any("cuda_op " in r for r in records)

    done, ran = suite(CCO_GPU_SUITE_RESUME="1", CCO_GPU_SUITE_PACK=str(tmp_path / "suite.tgz"))
    assert done.returncode == 0, done.stdout
    assert len(ran) == 2 and "native" in ran[0] and "test_cuda_op" in ran[1], ran
    assert "10 passed (8 of them in an earlier run on this tree), 0 failed" in done.stdout
    assert "cuda_nn: passed earlier on this tree" in done.stdout
    assert any(line.startswith("cuda_sp ") and "passed earlier" in line and ", 1 skipped" in line
               for line in done.stdout.splitlines()), done.stdout  # the skips a module had stay in its line
    with tarfile.open(tmp_path / "suite.tgz") as packed:
        assert "logs/passed.txt" in packed.getnames() and "logs/cuda_op.log" in packed.getnames()

    done, ran = suite("test_cuda_nn")  # a failure drops its record: the next resume runs it again
    assert done.returncode == 1 and not any(r.startswith("cuda_nn ") for r in (logs / "passed.txt").read_text().splitlines())
    done, ran = suite(CCO_GPU_SUITE_RESUME="1")
    assert done.returncode == 0 and len(ran) == 2 and "test_cuda_nn" in ran[1], ran

    (logs / "passed.txt").write_text((logs / "passed.txt").read_text().replace(tree, "000000000000"))
    done, ran = suite(CCO_GPU_SUITE_RESUME="1")  # records of another tree count for nothing
    assert done.returncode == 0 and len(ran) == 10 and "earlier" not in done.stdout

    # a budget that holds some modules' typical time and not others': those start, the rest wait for
    # the next call (a module cut at the budget's end, as cuda_hf twice on 2026-12-06, wastes its time)
    (logs / "passed.txt").write_text("")
    done, ran = suite(CCO_GPU_SUITE_RESUME="1", CCO_GPU_SUITE_BUDGET="105")  # ~90 s left for each module
    assert done.returncode == 3, done.stdout  # cuda_nn (95 s), cuda_op (110 s), cuda_hf (130 s) not started
    skipped = {line.split()[0] for line in done.stdout.splitlines() if "not started: budget" in line}
    assert skipped == {"cuda_nn", "cuda_op", "cuda_hf"} and len(ran) == 7, (done.stdout, ran)
    assert "cuda_faults_ag" in (logs / "passed.txt").read_text()  # the last module still ran: it fits
    done, ran = suite(CCO_GPU_SUITE_RESUME="1")
    assert done.returncode == 0 and len(ran) == 4 and "10 passed (6 of them in an earlier run" in done.stdout, ran
