"""The blockscale MMAs in Gluon (``kernels_fused.hopper.gluon_gemm``: the GEMM and the decode MMA over
quantized rows), on the host: each compiles for sm_90 with the installed Triton within a Hopper SM's
budget (no spills, shared memory), and its K loop leaves one MMA in flight while it scales the
previous one (``wgmma.wait_group 1``), the overlap it exists for. Not run here (no GPU); ``scripts.probe_gluon_blockscale`` checks its
products and times it on one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import probe_gluon_blockscale as P

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper", reason="a Triton with Gluon's Hopper API")

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """``--compile-only``'s reports, in ``P.COMPILED``'s order, from a process of its own without
    Triton's interpreter: the test process runs Triton kernels in the interpreter (conftest), which
    patches Triton's tensor class while a kernel runs, and a compile in the same process met that
    patch (a CI run: ``'block_argument' object has no attribute 'dtype'``)."""
    out = tmp_path_factory.mktemp("gluon") / "compiled.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "scripts.probe_gluon_blockscale", "--compile-only", str(out)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())["reports"]


@pytest.mark.parametrize("case", range(len(P.COMPILED)),
                         ids=[f"{kernel}-{'-'.join(f'{k}{v}' for k, v in options.items())}"
                              for kernel, options in P.COMPILED])
def test_compiles_for_sm90_with_one_mma_in_flight(reports, case):
    report = reports[case]
    assert (report["kernel"], report["options"]) == P.COMPILED[case]
    assert P.compile_problems(report) == [], P.compile_problems(report)
    # the loop's wait leaves one; the last product's, none (the ping-pong: once a consumer)
    consumers = 2 if report["kernel"] == "pingpong" else 1
    assert P.loop_waits(report["ptx"]) == {0: consumers, 1: consumers}
    assert report["registers"] <= 255


def test_the_check_fails_a_kernel_that_waits_for_every_mma_or_spills(reports):
    report = reports[P.COMPILED.index(("gemm", dict(stages=4)))]
    waits_all = report["ptx"].replace("wgmma.wait_group.sync.aligned 1;", "wgmma.wait_group.sync.aligned 0;")
    serial = dict(report, ptx=waits_all)
    assert P.compile_problems(serial) == ["no wgmma.wait_group 1: every MMA is waited for before the next"]
    spilled = dict(report, local_bytes=64, shared_bytes=P.HOPPER_SHARED + 1)
    assert len(P.compile_problems(spilled)) == 2


def test_the_pingpong_check_fails_a_store_wait_without_its_barrier_and_unmoved_registers(reports):
    """The ping-pong GEMM exists for its partitions: without ``setmaxnreg`` the compiler did not split
    it. And a consumer writes its staging tile again after ``tma.store_wait``, which only the issuing
    thread waits on: both Tritons put a warpgroup barrier after it themselves, so the kernel cannot
    be broken here; the check is shown failing on its PTX with those barriers taken out."""
    import re

    report = reports[P.COMPILED.index(("pingpong", dict(stages=4)))]
    ptx = report["ptx"]
    assert P.pingpong_problems(ptx) == []
    racy = re.sub(r"(cp\.async\.bulk\.wait_group\.read\s+0;[^\n]*\n(?:\s*\.loc[^\n]*\n)?)\s*bar\.sync\s+\d+,\s*128;",
                  r"\1", ptx)
    assert racy != ptx
    assert sum("before any barrier" in why for why in P.pingpong_problems(racy)) == 2, P.pingpong_problems(racy)
    unsplit = re.sub(r"setmaxnreg\.[^;]*;", "", ptx)
    assert [why for why in P.pingpong_problems(unsplit) if "registers not moved" in why], P.pingpong_problems(unsplit)


def test_the_probe_needs_a_json_path_unless_it_only_compiles(capsys):
    with pytest.raises(SystemExit):
        P.parse_args(["-m", "4096"])
    assert "json" in capsys.readouterr().err
    assert P.parse_args(["--compile-only"]).compile_only
    for argv, says in ((["--decode", "8b-o", "x.json"], "not a shape"), (["--decode", "8b-o-tp1", "--rows", "1,8",
                                                                          "x.json"], "2..64 rows")):
        with pytest.raises(SystemExit):
            P.parse_args(argv)
        assert says in capsys.readouterr().err


def test_every_gluon_gemm_name_the_probe_calls_exists():
    """The probe reaches the kernels only on a GPU: a launcher it names that the module lost (as
    ``blockscale_gemm`` once was in a refactor, found by the first GPU run) fails here instead."""
    import inspect
    import re

    from kernels_fused.hopper import gluon_gemm

    names = set(re.findall(r"\bgluon_gemm\.(\w+)", inspect.getsource(P)))  # (not test_gluon_gemm.py)
    assert {"blockscale_gemm", "decode_blockscale_mma", "decode_scratch"} <= names, names
    assert [n for n in sorted(names) if not hasattr(gluon_gemm, n)] == []


def test_every_gluon_pingpong_name_the_probes_call_exists():
    """As above, for the ping-pong GEMM's probe and the compile check."""
    import inspect
    import re

    from kernels_fused.hopper import gluon_pingpong
    from scripts import probe_pingpong

    names = {n for mod in (P, probe_pingpong) for n in re.findall(r"\bgluon_pingpong\.(\w+)", inspect.getsource(mod))}
    assert {"ptpc_pingpong_gemm", "fp8_ptpc_pingpong_kernel", "MAXNREG"} <= names, names
    assert [n for n in sorted(names) if not hasattr(gluon_pingpong, n)] == []
    args = probe_pingpong.parse_args(["--tp", "8", "-m", "4096", "x.json"])
    assert (args.tp, args.m, args.stages, args.json) == ([8], [4096], [3, 4], "x.json")
