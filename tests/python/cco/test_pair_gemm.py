"""The CTA pair GEMM (``kernels_fused.hopper.pair_gemm``, CUDA C++), on the host: every build the probe
times compiles for sm_90a within a Hopper SM's budget (no spills, the 384 threads' register share,
its shared memory), and the launcher refuses shapes the kernel does not cover before it touches a
GPU. Not run here (no GPU): ``scripts.probe_pair_gemm`` checks its products against the fp32
product and times it."""

import pytest
import torch

from kernels_fused.hopper import pair_gemm as G
from scripts.probe_pair_gemm import BUILD_PREFIXES, VARIANT_ARGS, builds, label

HOPPER_SHARED = 227 * 1024  # the most dynamic shared memory one block may take on sm_90
VARIANTS = [G.Variant(**kw) for kw in VARIANT_ARGS]

needs_nvcc = pytest.mark.skipif(G.nvcc() is None, reason="nvcc builds this kernel (the GPU machines have it)")


@needs_nvcc
@pytest.mark.parametrize("variant", VARIANTS, ids=[label(v) for v in VARIANTS])
def test_every_timed_build_compiles_without_spills(variant, tmp_path):
    report = G.ptxas_report(variant, str(tmp_path))
    assert report["spill_stores"] == report["spill_loads"] == 0, report
    assert report["registers"] <= 65536 // G.THREADS, report  # (setmaxnreg moves them between warpgroups)
    assert variant.shared() <= HOPPER_SHARED


@needs_nvcc
def test_a_build_that_cannot_fit_its_registers_raises_with_ptxas_words(tmp_path):
    """Budgeted for three blocks an SM (56 registers a thread), the MMA's 128-register accumulator
    cannot compile: the build raises with ptxas's reason instead of leaving a cubin behind."""
    with pytest.raises(RuntimeError, match="Insufficient registers"):
        G.ptxas_report(G.Variant(), str(tmp_path), extra=("-DCCO_MIN_BLOCKS=3", ))
    assert not (tmp_path / "pair_gemm.cubin").exists()


@pytest.mark.parametrize("variant, m, n, k", [
    (G.Variant(), 128, 256, 256), (G.Variant(), 256, 128, 256), (G.Variant(), 256, 256, 96),
    (G.Variant(), 4096, 4608 + 128, 7168), (G.Variant(pingpong=True), 128, 128, 128),
    (G.Variant(pingpong=True, share_a=True), 128, 128, 128), (G.Variant(bk=64), 256, 256, 96)])
def test_shapes_outside_the_tiles_are_refused_before_any_launch(variant, m, n, k):
    a = torch.zeros(m, k, dtype=torch.float8_e4m3fn)
    b = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="pair_gemm takes"):
        G.ptpc_pair_gemm(a, b, torch.ones(m), torch.ones(n), variant=variant)


def test_the_pair_tiles_and_boxes_follow_the_shared_operand():
    pp = G.Variant(pingpong=True)
    assert (pp.cluster_tile, pp.boxes()) == ((256, 128), (128, 64))
    assert (pp._replace(share_a=True).cluster_tile, pp._replace(share_a=True).boxes()) == ((128, 256), (64, 128))
    assert (pp._replace(pair=1).cluster_tile, pp._replace(pair=1).boxes()) == ((128, 128), (128, 128))
    shared = G.Variant()
    assert (shared.cluster_tile, shared.boxes()) == ((256, 256), (128, 128))
    along_n = shared._replace(share_a=True)
    assert (along_n.cluster_tile, along_n.boxes()) == ((128, 512), (64, 128))


def test_the_probes_repeat_check_reaches_every_build():
    """The probe checks each build for equal bits on a repeat by its label's start: every build's
    label must start with one of the prefixes it passes (the ping-pong's ``pp`` labels once escaped)."""
    assert all(label(v).startswith(BUILD_PREFIXES) for v in builds())


def test_bad_operands_are_refused_with_what_was_given():
    e4m3 = torch.float8_e4m3fn
    a, b = torch.zeros(256, 256, dtype=e4m3), torch.zeros(256, 256, dtype=e4m3)
    one = torch.ones(256)
    cases = [((a.to(torch.bfloat16), b, one, one), {}, "e4m3 operands"),
             ((a, b, torch.ones(128), one), {}, "a scale per row"),
             ((a, b, one, one), dict(out=torch.empty(256, 256)), "bf16"),
             ((a, b, one, one), dict(out=torch.empty(256, 128, dtype=torch.bfloat16)), "256, 256"),
             ((a, b, one, one), dict(group=0), "group >= 1"),
             ((a.t(), b, one, one), {}, "contiguous")]
    for args, kwargs, words in cases:
        with pytest.raises(ValueError, match=words):
            G.ptpc_pair_gemm(*args, **kwargs)


def test_unknown_builds_are_refused():
    a, b = torch.zeros(256, 256, dtype=torch.float8_e4m3fn), torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    for bad in (G.Variant(pair=4), G.Variant(bk=32)):
        with pytest.raises(ValueError, match="pair is 1 or 2"):
            G.ptpc_pair_gemm(a, b, torch.ones(256), torch.ones(256), variant=bad)


def test_the_ring_fits_and_grows_with_its_depth():
    assert G.Variant().shared() == 4 * (128 + 256) * 128 + 64 + 1024
    assert G.Variant(bk=64, stages=9).shared() <= HOPPER_SHARED < G.Variant(bk=128, stages=5).shared()
