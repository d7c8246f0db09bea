"""The bpreshuffle weight layout: round trip, and the byte positions pinned on a small example."""

import pytest
import torch

from cco.preshuffle import preshuffle_b, unshuffle_b


def test_round_trip_random_fp8():
    b = (torch.randn(96, 384) * 50).to(torch.float8_e4m3fn)
    p = preshuffle_b(b)
    assert p.shape == b.shape and p.dtype == b.dtype
    assert not torch.equal(p.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(unshuffle_b(p).view(torch.uint8), b.view(torch.uint8))


def test_layout_pinned_on_a_hand_checked_example():
    # B[n, k] = byte (n * 64 + k) % 256 for N=32, K=64: two 16-row groups, two 32-wide K chunks.
    n_idx = torch.arange(32)[:, None]
    k_idx = torch.arange(64)[None, :]
    b = ((n_idx * 64 + k_idx) % 256).to(torch.uint8)
    flat = preshuffle_b(b).reshape(-1)
    # first block: rows 0..15, bytes k = 0..15 of each row, 16 bytes per row
    assert flat[:16].tolist() == list(range(16))  # row 0, k 0..15
    assert flat[16:32].tolist() == list(range(64, 80))  # row 1, k 0..15
    # second block of the first K chunk: rows 0..15, k = 16..31
    assert flat[256:272].tolist() == list(range(16, 32))
    # second K chunk of the first row group starts at byte 512: row 0, k = 32..47
    assert flat[512:528].tolist() == list(range(32, 48))
    # second row group (rows 16..31) starts after K/32 = 2 chunks of 512 bytes
    assert flat[1024:1040].tolist() == [(16 * 64 + k) % 256 for k in range(16)]


def test_formula_in_docstring_holds_everywhere():
    n, k = 48, 96
    b = torch.randint(0, 256, (n, k), dtype=torch.uint8)
    flat = preshuffle_b(b).reshape(-1)
    nn, kk = torch.meshgrid(torch.arange(n), torch.arange(k), indexing="ij")
    off = ((nn // 16) * (k // 32) + kk // 32) * 512 + ((kk % 32) // 16) * 256 + (nn % 16) * 16 + kk % 16
    assert torch.equal(flat[off], b)


@pytest.mark.parametrize("shape", [(17, 64), (32, 48)])
def test_untileable_shapes_are_rejected(shape):
    with pytest.raises(ValueError, match="not tileable"):
        preshuffle_b(torch.zeros(shape, dtype=torch.uint8))


def test_wide_dtype_rejected():
    with pytest.raises(TypeError, match="1-byte dtype"):
        preshuffle_b(torch.zeros(16, 32))
