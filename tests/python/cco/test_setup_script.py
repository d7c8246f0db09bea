"""``scripts/setup.sh`` says in one line what happened when PyTorch's CPU wheel index is unreachable,
instead of passing on pip's ~35 retry and ignored-location warnings, and still shows pip's errors
when an install fails.

The script runs for real, with ``PYTHON`` pointing at a stand-in interpreter: ``-c`` code fails
until the stand-in pip has "installed" torch, and ``-m pip install`` prints what pip prints in the
case under test. A stand-in ``ld.lld-19`` on PATH keeps apt-get out of it.

Guard: the script of before (pip's warnings passed through to the terminal) fails
``test_unreachable_cpu_index_is_one_line_naming_the_wheel`` (35 WARNING lines in its output).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.host

ROOT = Path(__file__).resolve().parents[3]
WHEEL = "/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
DEPS = ("filelock", "typing-extensions", "sympy", "networkx", "jinja2", "fsspec", "mpmath", "markupsafe",
        "setuptools", "torch", "numpy", "pyyaml", "packaging", "triton", "tqdm", "pytest", "mpi4py")

# What pip prints (stderr) for one package when --index-url cannot be reached and pip's configuration
# also names a local index that lacks the package: two warnings per package.
_UNREACHABLE_WARNINGS = "".join(
    f"WARNING: Location 'file:///opt/pypi/simple/{d}/' is ignored: it is neither a file nor a directory.\n"
    f"WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None)) after connection "
    f"broken by 'NewConnectionError(\"Failed to establish a new connection: [Errno -2] Name or service not "
    f"known\")': /whl/cpu/{d}/\n" for d in DEPS)

_STAND_IN = textwrap.dedent('''\
    #!{python}
    """A stand-in interpreter for setup.sh: case {case!r}."""
    import os, sys
    installed = os.path.join({state!r}, "torch-installed")
    case, warnings, wheel = {case!r}, {warnings!r}, {wheel!r}
    args = sys.argv[1:]
    if args[:1] == ["-c"]:
        if not os.path.exists(installed):
            sys.exit(1)
        print("[setup] torch 2.13.0+cpu (CUDA build: False)" if "version.cuda" in args[1] else "[setup] ok")
        sys.exit(0)
    assert args[:3] == ["-m", "pip", "install"], args
    if "-e" in args:                                   # the package and its test extras
        print("Successfully installed cco-0.1.0")
        sys.exit(0)
    if "--target" in args:                             # the GPU machines' Triton into .toolchain/
        print("Successfully installed triton-3.6.0")
        sys.exit(0)
    cpu_index = "--index-url" in args
    if case == "reachable":
        print("Downloading https://download.pytorch.org/whl/cpu/torch-2.13.0%2Bcpu-cp311-cp311-linux_x86_64.whl (190 MB)")
    elif case == "unreachable-find-links" and cpu_index:
        sys.stderr.write(warnings)
        print("Processing " + wheel)
    else:                                              # "broken": no torch anywhere
        if cpu_index:
            sys.stderr.write(warnings)
        sys.stderr.write("ERROR: Could not find a version that satisfies the requirement torch==2.13.0\\n"
                         "ERROR: No matching distribution found for torch==2.13.0\\n")
        sys.exit(1)
    print("Successfully installed torch-2.13.0+cpu")
    open(installed, "w").close()
    ''')


def _run_setup(tmp_path: Path, case: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python-stand-in"
    python.write_text(_STAND_IN.format(python=sys.executable, case=case, state=str(tmp_path),
                                       warnings=_UNREACHABLE_WARNINGS, wheel=WHEEL))
    lld = bin_dir / "ld.lld-19"
    lld.write_text("#!/bin/sh\nexit 0\n")
    for f in (python, lld):
        f.chmod(0o755)
    env = dict(os.environ, PYTHON=str(python), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               TMPDIR=str(tmp_path))
    return subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], env=env, capture_output=True,
                          text=True, timeout=60)


def test_unreachable_cpu_index_is_one_line_naming_the_wheel(tmp_path):
    proc = _run_setup(tmp_path, "unreachable-find-links")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "WARNING" not in out, out
    said = [line for line in out.splitlines() if "unreachable" in line]
    assert len(said) == 1, out
    assert "https://download.pytorch.org/whl/cpu unreachable" in said[0] and WHEEL in said[0], said[0]
    assert "[setup] ok" in out, out


def test_reachable_cpu_index_says_nothing_more(tmp_path):
    proc = _run_setup(tmp_path, "reachable")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "unreachable" not in out and "WARNING" not in out, out
    assert "[setup] ok" in out, out


def test_failed_install_shows_pip_error_and_stops(tmp_path):
    """Both sources fail: pip's error reaches the terminal and the script exits non-zero before
    installing the package."""
    proc = _run_setup(tmp_path, "broken")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "unreachable and no torch==2.13.0 elsewhere" in out, out
    assert "ERROR: No matching distribution found for torch==2.13.0" in proc.stderr, out
    assert "installing cco" not in out, out
