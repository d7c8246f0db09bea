"""The Triton kernels of the gfx950 paths compiled for gfx950 on the host (``scripts.compile_triton_gfx950``):
every launch a decode call builds, and the copy-engine schedule's reduce, dequant, stamp check and
memory-operation kernels, compile for ``GPUTarget("hip", "gfx950", 64)`` without VGPR spills or
scratch, within a CU's LDS, and the decode's tensor-core kernels issue gfx950's fp8 MFMA. Nothing
is launched (no AMD GPU here). The compiles run in a child process without ``TRITON_INTERPRET``
(this suite's conftest sets it, and under it Triton compiles nothing)."""

import json
import os
import subprocess
import sys

import pytest

if os.environ.get("CI"):  # CI must compile these: a Triton without its AMD backend is an error there
    import triton.backends.amd  # noqa: F401
else:
    pytest.importorskip("triton.backends.amd", reason="needs Triton's AMD backend (the compile to gfx950 ISA)")

from scripts import compile_triton_gfx950 as C  # noqa: E402

pytestmark = pytest.mark.compile


def _run(tmp_path, *argv) -> tuple[int, list[dict], str]:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    out = tmp_path / "gfx950.json"
    done = subprocess.run([sys.executable, "-m", "scripts.compile_triton_gfx950", *argv, "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, json.loads(out.read_text())["results"] if out.exists() else [], done.stdout + done.stderr


def test_every_decode_and_transport_launch_compiles_for_gfx950_within_its_budget(tmp_path):
    """One row (the one-row GEMM), 8 rows (ptpc's one launch and its two: quantizer + MMA; blockscale's
    quantizer + MMA; the rows kernel of mxfp8 over the fp8 weight) and 64 (the MMA 64 wide) at
    Llama-3-8B down_proj's shape (64 weight blocks on 256 CUs: the MMA's K split), every quant, and the
    activation quantizer's launches; every transport case."""
    rc, rows, said = _run(tmp_path, "-m", "1,8,64", "--shapes", "8b-down")
    assert rc == 0 and rows and [r for r in rows if r["faults"]] == [], said
    transport = {r["kernel"] for r in rows if r["shape"] == "transport"}
    assert transport == {"_reduce", "_dequant", "_check", "_wait_kernel", "_write_kernel", "_wait_block_kernel"}
    kernels = {(r["quant"], r["m"], r["kernel"]) for r in rows}
    assert {("ptpc", 1, "decode_gemv_kernel"), ("ptpc", 8, "decode_ptpc_kernel"),
            ("ptpc", 8, "quantize_ptpc_split_kernel"), ("ptpc", 64, "decode_mma_rows_kernel"),
            ("blockscale", 8, "decode_mma_rows_kernel"), ("blockscale", 64, "decode_mma_rows_kernel"),
            ("blockscale", 8, "quantize_groups_kernel"), ("mxfp8", 8, "decode_rows_kernel"),
            ("mxfp8", 1, "quantize_groups_kernel")} <= kernels
    mma = [r for r in rows if r["kernel"] in C.MMA_KERNELS and r["quant"] != "mxfp8"]
    assert mma and all(r["fp8_mfma"] > 0 for r in mma)


def test_the_check_fails_a_launch_over_the_lds(tmp_path):
    """ptpc's 64-row MMA with five pipeline stages, one more than the layer's (165 KB of LDS where a CU
    holds 160; a real compile), fails the check, and the script's exit status says so."""
    rc, rows, said = _run(tmp_path, "--part", "decode", "--quant", "ptpc", "-m", "64", "--shapes", "8b-down",
                          "--mma-stages", "5")
    over = [r for r in rows if r.get("kernel") == "decode_mma_rows_kernel"]
    assert rc == 1 and over and over[0]["lds"] > C.LDS_BYTES, said
    assert any("LDS" in f for f in over[0]["faults"])


def test_the_checks_counts():
    """A spill, scratch, or an MMA kernel that issued no fp8 MFMA fails; the one-row GEMM multiplies on
    FMAs by design, mxfp8's rows kernel on a bf16 MFMA."""
    good = {"quant": "ptpc", "kernel": "decode_mma_rows_kernel", "vgpr_spills": 0, "scratch": 0, "lds": 1024,
            "fp8_mfma": 8, "mfma": 8}
    assert C.faults(good) == []
    assert C.faults({**good, "vgpr_spills": 3}) == ["3 VGPR spills"]
    assert C.faults({**good, "scratch": 64}) == ["64 bytes of scratch"]
    assert C.faults({**good, "lds": C.LDS_BYTES + 1}) == [f"{C.LDS_BYTES + 1} bytes of LDS > {C.LDS_BYTES}"]
    assert C.faults({**good, "fp8_mfma": 0, "mfma": 0}) == ["no fp8 MFMA: the MMA fell back to FMAs"]
    assert C.faults({**good, "kernel": "decode_gemv_kernel", "fp8_mfma": 0, "mfma": 0}) == []
    assert C.faults({**good, "quant": "mxfp8", "kernel": "decode_rows_kernel", "fp8_mfma": 0, "mfma": 4}) == []


def test_the_script_refuses_the_interpreter_and_unknown_names(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        C.check(["ptpc"], [1], {"8b-o": C.SHAPES["8b-o"]})
    for bad in (["--shapes", "8b-up"], ["--part", "gemm"]):
        with pytest.raises(SystemExit):
            C.main(bad)
        assert bad[1] in capsys.readouterr().err
