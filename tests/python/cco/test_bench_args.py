"""The gemm-ar benchmark's arm selection (host only): mori's names, the lsa arms, refusals."""

import pytest

from scripts.bench_gemm_ar import ARMS, select_arms


def test_all_and_mori_names():
    assert select_arms("all", "ptpc") == list(ARMS)
    assert select_arms("fused-sdma,fused-lsa,gemm-only", "ptpc") == ["fused", "fused-lsa", "gemm-only"]
    assert "scaled_mm" not in select_arms("all", "blockscale")  # cuBLAS has no blockscale arm


@pytest.mark.parametrize("mode", ["split-lsa", "fused-xyz"])
def test_unknown_or_unimplemented_arms_are_refused_with_the_reason(mode):
    with pytest.raises(SystemExit, match="split-sdma" if mode == "split-lsa" else "not an arm"):
        select_arms(mode, "ptpc")
