"""The reduce-scatter along rows' persistent producer (``fp8_gemm_rows_ws_kernel``) releases each
tile after its TMA stores; that order is read in the PTX (``kernels_fused.hopper.ptx``), since
Triton versions lower the stores differently: 3.9 puts a barrier between the stores' wait and the
add, 3.6 (the GPU machines') does not, so the kernel's wait carries its own. Here the host's Triton
and the GPU machines' (``scripts/setup.sh`` puts it in ``.toolchain/triton-3.6``) compile it for
sm_90 (no GPU needed) and the check reads its PTX; with 3.6 the kernel without its barrier fails
the check. The GPU suite (``test_cuda_sp.py``) checks the GPU machine's Triton the same way. The
check itself fails a PTX whose bulk wait is the ``.read`` form, whose barrier is missing, or whose
kernel is split into warp-specialized partitions (the block-wide barrier would hang)."""

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
    ("\tsetmaxnreg.inc.sync.aligned.u32 240;" + ORDERED, "split into warp-specialized partitions"),
    (ORDERED + "\tbar.sync 1, 128;", "split into warp-specialized partitions"),
])
def test_the_check_fails_a_release_that_may_pass_its_stores(broken, words):
    assert words in (bulk_release_problem(broken) or "")


def test_the_hosts_triton_orders_every_release_after_its_stores():
    """In a process of its own, without the interpreter the test process runs kernels in."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "kernels_fused.hopper.walk_ptx", "ptpc", "blockscale", "mxfp8"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # each quant's walk as launched, and released a tile late
    assert done.stdout.count("every release follows a full bulk wait and a barrier") == 6, done.stdout


GPU_TRITON = ROOT / ".toolchain" / "triton-3.6"
# Run with the GPU machines' Triton: the kernel as it is, or (argument "without") with its wait's
# barrier taken out: ``_bulk_writes_done`` replaced before the compile, which reads the module's
# globals. One variant a process: Triton keeps a kernel's cache key from its first compile.
VARIANT = """
import sys
import triton, triton.language as tl
import kernels_fused.hopper.kernels as K
from kernels_fused.hopper.walk_ptx import bulk_release_problem, rows_ws_ptx_sm90

@triton.jit
def wait_only(x, INTERPRET: tl.constexpr):
    return tl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\\n\\tmov.u32 $0, $1;", "=r,r", [x],
                                     dtype=tl.int32, is_pure=False, pack=1)

if sys.argv[1] == "without":
    K._bulk_writes_done = wait_only
print("triton", triton.__version__)
print(sys.argv[1] + ":", bulk_release_problem(rows_ws_ptx_sm90("ptpc")))
print(sys.argv[1] + " lag:", bulk_release_problem(rows_ws_ptx_sm90("ptpc", release_lag=True)))
"""


def _gpu_triton_env(tmp_path) -> dict:
    """The environment of a process that compiles with the GPU machines' Triton (not under the
    interpreter, its own cache); the test is skipped where that Triton is not installed, and fails
    in CI, whose setup installs it."""
    if not (GPU_TRITON / "triton" / "__init__.py").is_file():
        if os.environ.get("CI"):
            pytest.fail(f"CI needs the GPU machines' Triton in {GPU_TRITON} (scripts/setup.sh installs it)")
        pytest.skip(f"no {GPU_TRITON} (scripts/setup.sh installs the GPU machines' Triton there)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(GPU_TRITON), str(ROOT)])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # (not the installed Triton's cache)
    return env


def test_the_gpu_machines_triton_needs_the_kernels_own_barrier(tmp_path):
    """Triton 3.6 issues a tile's store from two threads and its add from a third with no barrier
    between them: the kernel's own barrier is what orders the release (found on the GPU machine,
    2026-12-07, by the suite's check), in the walk as launched and in the walk that releases each
    tile one tile late."""
    env = _gpu_triton_env(tmp_path)
    script = tmp_path / "variant.py"  # (Triton reads a jit function's source from its file)
    script.write_text(VARIANT)
    said = {}
    for variant in ("as-is", "without"):
        done = subprocess.run([sys.executable, str(script), variant], env=env, cwd=ROOT, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "triton 3.6." in done.stdout, done.stdout
        said[variant], said[variant + " lag"] = done.stdout.splitlines()[-2:]
    assert said["as-is"] == "as-is: None" and said["as-is lag"] == "as-is lag: None", said
    for without in ("without", "without lag"):
        assert said[without].startswith(f"{without}: no barrier between the full bulk wait and the release"), said


class _Compiled:
    def __init__(self, ptx):
        self.asm = {"ptx": ptx}


class _Walk:
    """A stand-in for the walk's JIT function: its compile's PTX, and how often it was asked."""

    def __init__(self, ptx):
        self.ptx, self.warmups = ptx, 0

    def warmup(self, *args, grid, **kwargs):
        self.warmups += 1
        return _Compiled(self.ptx)


@pytest.mark.parametrize("ptx, refused", [(ORDERED, False), (ORDERED.replace("bar.sync 0;", ""), True)],
                         ids=["ordered", "no-barrier"])
def test_the_walk_is_refused_before_its_launch_where_its_compile_may_race(monkeypatch, ptx, refused):
    """``hopper_gemm.check_releases`` reads the launch's own compile (``warmup``) once per launch
    configuration and raises before the launch where a release may pass its stores; under the
    interpreter (synchronous stores) it reads nothing."""
    from kernels_fused.hopper import gemm as hopper_gemm

    monkeypatch.setattr(hopper_gemm, "_RELEASE_VERDICTS", {})
    monkeypatch.setattr(hopper_gemm, "_interpreting", lambda: False)

    def check(walk, kwargs, device="cuda:0"):
        hopper_gemm.check_releases(walk, (4,), (), kwargs, device, fn="fp8_gemm_rows_ws")

    walk, kwargs = _Walk(ptx), dict(WORLD=2, num_warps=8, num_stages=4)
    for _ in range(2):
        if refused:
            with pytest.raises(hopper_gemm.UnorderedReleases, match="no barrier between"):
                check(walk, kwargs)
        else:
            check(walk, kwargs)
    assert walk.warmups == 1  # one compile read per configuration
    if not refused:
        check(walk, dict(kwargs, WORLD=4))  # another configuration: its compile read too
        assert walk.warmups == 2
    monkeypatch.setattr(hopper_gemm, "_interpreting", lambda: True)
    racy = _Walk(ORDERED.replace("bar.sync 0;", ""))
    check(racy, kwargs, "cuda:1")  # the interpreter's stores are synchronous: nothing read, nothing refused
    assert racy.warmups == 0


def test_the_lsa_kernel_compiles_in_both_forms_with_the_gpu_machines_triton(tmp_path):
    """The lsa kernel compiles for sm_90 with the GPU machines' Triton (3.6) for ptpc and blockscale,
    with its GEMM and ``FROM_PARTIAL`` (the transfers on a partial computed before), bf16 and fp8
    gathers: the interpreter that runs it in the host tests does not type-check a ``constexpr``
    branch against the code after it, the compiler does (a name first bound in the partial's branch
    and bound again with another type further down passed every host test and failed the compile
    on the GPU, 2026-12-07; this compile fails it, shown)."""
    env = _gpu_triton_env(tmp_path)
    done = subprocess.run([sys.executable, "-m", "kernels_fused.hopper.lsa_ptx", "ptpc", "blockscale"], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count(": compiled (") == 8, done.stdout
