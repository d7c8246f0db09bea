"""The reduce-scatter along rows' warp-specialized producer (``fp8_gemm_rows_ws_kernel``) releases
each tile with no barrier of its own: its order after the tile's TMA stores is Triton's lowering's
(``kernels_fused.hopper.ptx``). Here the host's Triton compiles it for sm_90 (no GPU needed) and
the check reads its PTX; the GPU suite (``test_cuda_sp.py``) checks the GPU machine's Triton the
same way. The check itself fails a PTX whose bulk wait is the ``.read`` form, or whose barrier is
missing."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels_fused.hopper.ptx import bulk_release_problem, release_path

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[3]

STORE = "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%rd1, {%r1, %r2, %r3}], [%r4];"
ORDERED = f"""
    {STORE}
    cp.async.bulk.commit_group;
    cp.async.bulk.wait_group 0;
    bar.sync 0;
    @%p1 red.global.gpu.release.add.u64 [%rd2+0], %rd3;
"""


def test_the_check_passes_a_release_after_the_full_wait_and_a_barrier():
    assert bulk_release_problem(ORDERED) is None
    assert release_path(ORDERED) == [[STORE.split(" [")[0], "cp.async.bulk.wait_group 0", "bar.sync 0",
                                      "red.global.gpu.release.add.u64"]]


@pytest.mark.parametrize("broken, words", [
    (ORDERED.replace("wait_group 0", "wait_group.read 0"), "no full bulk wait"),
    (ORDERED.replace("bar.sync 0;", ""), "no barrier between"),
    (ORDERED.replace("cp.async.bulk.wait_group 0;\n    bar.sync 0;", "bar.sync 0;\n    cp.async.bulk.wait_group 0;"),
     "no barrier between"),
    (ORDERED.replace(STORE, ""), "no release add follows"),
])
def test_the_check_fails_a_release_that_may_pass_its_stores(broken, words):
    assert words in (bulk_release_problem(broken) or "")


def test_the_hosts_triton_orders_every_release_after_its_stores():
    """In a process of its own, without the interpreter the test process runs kernels in."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "kernels_fused.hopper.ptx", "ptpc", "blockscale", "mxfp8"], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("every release follows a full bulk wait and a barrier") == 3, done.stdout
