"""The mpirun launch path: ranks started by mpiexec (MPICH from pip), bootstrapped over mpi4py."""

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multirank


def _mpiexec() -> str:
    path = shutil.which("mpiexec")
    if path is None:
        pytest.fail("mpiexec not found: install the test extra (pip install mpi4py mpich)")
    return path


@pytest.mark.parametrize("args", [
    ["--mode", "fused-sdma"],
    ["--mode", "split-lsa", "--gather-dtype", "fp8", "--quant", "blockscale"],
], ids=["fused-sdma", "split-lsa-fp8-blockscale"])
def test_mpiexec_runs_the_demo_on_two_ranks(args):
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    cmd = [_mpiexec(), "-n", "2", sys.executable, "-m", "cco.demo", "--shape", "64x256x256",
           "--iters", "2", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "launcher=mpirun world=2" in proc.stdout, proc.stdout
    assert proc.stdout.count("-> ok") == 3 and "PASS" in proc.stdout, proc.stdout


def test_a_launcher_whose_ranks_mpi_does_not_see_is_refused():
    """Open MPI's mpirun starting ranks whose mpi4py is built against another MPI (MPICH): each
    process is an MPI job of one rank. Simulated with Open MPI's variables for 2 ranks around one
    MPICH process. Before, the process ran the demo as a world of 1 and printed PASS; now it refuses."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2",
               OMPI_COMM_WORLD_LOCAL_RANK="0")
    proc = subprocess.run([sys.executable, "-m", "cco.demo", "--shape", "64x256x256", "--iters", "1"], env=env,
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "PASS" not in proc.stdout, out[-3000:]
    assert "the launcher started 2 ranks but MPI reports 1" in out, out[-3000:]
