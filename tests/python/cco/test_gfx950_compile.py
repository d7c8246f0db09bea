"""The gfx950 FlyDSL kernel: its data path (host) and its compilation to gfx950 ISA (compile).

The compile tier needs flydsl and an ld.lld >= 18 (``kernels_fused.gfx950.toolchain``), no GPU:
nothing compiled here is ever launched. CI compiles a representative set; the full sweep is
``python -m kernels_fused.gfx950.isa --check-all``.
"""

import itertools
import os
import re

import numpy as np
import pytest
import torch

from cco.preshuffle import preshuffle_b
from kernels_fused.gfx950 import byte_layout as L
from kernels_fused.gfx950.kernel import compile_fused_gemm_scatter, slice_tile_origin


# --------------------------------------------------------------------------------------------------
# host: the byte mapping the kernel compiles, replayed on real data
# --------------------------------------------------------------------------------------------------
def _dma_half(flat_src: torch.Tensor, offsets_per_wave, k_base: int, half_bytes: int) -> torch.Tensor:
    """What the eight waves' LDS-DMA steps leave in one LDS half-tile."""
    lds = torch.full((half_bytes,), -1, dtype=torch.int16)
    for wave, per_lane in offsets_per_wave.items():
        for lane, offsets in enumerate(per_lane):
            for step, off in enumerate(offsets):
                dst = L.dma_lds_offset(wave, step, lane)
                lds[dst:dst + 16] = flat_src[k_base + off:k_base + off + 16].to(torch.int16)
    assert (lds >= 0).all(), "some LDS bytes of the half-tile were never written"
    return lds


@pytest.mark.parametrize("block_m,block_n", [(256, 256), (128, 256), (256, 128)], ids=lambda v: str(v))
def test_fragments_hold_the_rows_and_k_bytes_the_mfma_expects(block_m, block_n):
    """Guards the loader/reader arithmetic: every lane's 32-byte A and B fragments, read from the
    LDS image the DMA steps build (swizzled A, bpreshuffled B), are exactly A[row, 32g:32g+32] and
    B[col, 32g:32g+32] of the K tile, g = lane // 16 (the v_mfma_scale operand order)."""
    K, kt = 384, 1
    gen = torch.Generator().manual_seed(0)
    A = torch.randint(0, 256, (2 * block_m, K), dtype=torch.uint8, generator=gen)
    B = torch.randint(0, 256, (2 * block_n, K), dtype=torch.uint8, generator=gen)
    Bp = preshuffle_b(B).reshape(-1)
    row0, b_row0 = block_m, block_n  # the second tile in both directions
    half_m, half_n = block_m // 2, block_n // 2
    steps_a, steps_b = half_m // 64, half_n // 64
    n_a, n_b = block_m // 64, block_n // 128
    for h in (0, 1):
        lds_a = _dma_half(A.reshape(-1), {w: [L.a_dma_offsets(lane=l, wave=w, row0=row0 + h * half_m, K=K, steps=steps_a)
                                               for l in range(L.WAVE)] for w in range(L.N_WAVES)},
                          kt * L.BLOCK_K, half_m * L.BLOCK_K)
        lds_b = _dma_half(Bp, {w: [L.b_dma_offsets(lane=l, wave=w, group0=(b_row0 + h * half_n) // 16, K=K,
                                                   steps=steps_b) for l in range(L.WAVE)] for w in range(L.N_WAVES)},
                          kt * L.B_GROUP_BYTES, half_n * L.BLOCK_K)
        for wave in range(L.N_WAVES):
            wave_m, wave_n = wave // 4, wave % 4
            for lane in range(L.WAVE):
                g = lane // 16
                k_bytes = slice(kt * L.BLOCK_K + 32 * g, kt * L.BLOCK_K + 32 * g + 32)
                for i in range(n_a):
                    row = wave_m * n_a * 16 + i * 16 + lane % 16
                    lo, hi = L.a_read_offsets(lane=lane, row=row)
                    frag = torch.cat([lds_a[lo:lo + 16], lds_a[hi:hi + 16]])
                    assert torch.equal(frag, A[row0 + h * half_m + row, k_bytes].to(torch.int16)), (h, wave, lane, i)
                for j in range(n_b):
                    group = wave_n * n_b + j
                    lo, hi = L.b_read_offsets(lane=lane, group=group)
                    frag = torch.cat([lds_b[lo:lo + 16], lds_b[hi:hi + 16]])
                    col = b_row0 + h * half_n + group * 16 + lane % 16
                    assert torch.equal(frag, B[col, k_bytes].to(torch.int16)), (h, wave, lane, j)


# --------------------------------------------------------------------------------------------------
# host: the epilogue's bytes, replayed element by element against the direct-store epilogue it replaced
# --------------------------------------------------------------------------------------------------
def _workgroups(block_m, block_n, fuse, quant, pattern="all-reduce"):
    """(c_row_base, a_row0, c_row0, b_row0, c_col0, ldc, c_rows) of every workgroup of a small problem:
    gemm-only [2 BLOCK_M, 2 BLOCK_N]; fused: world 2, rank 1, two chunks, every row of cco.layout's
    tile table of ``pattern``, each tile's A and B rows offset by its slice's origin (the launcher's
    ``a_step``, ``b_step``: ``slice_origin`` of slice 1), its C rows within ``partial[dest]``."""
    from cco import layout

    if not fuse:
        m, n = 2 * block_m, 2 * block_n
        return [(0, r, r, c, c, n, m) for r in (0, block_m) for c in (0, block_n)]
    world = 2
    by_rows = layout.PATTERNS[pattern].owner_by == "rows"
    m, n = (2 * world * block_m, 2 * block_n) if by_rows else (2 * block_m, 2 * world * block_n)
    lay = layout.build_config(n=n, k=256, m_max=m, world=world, quant=quant, mode="fused", chunks=2,
                              block_m=block_m, block_n=block_n, pattern=pattern)
    rows = layout.tile_table_rows(layout.tile_table(lay, m=m, rank=1))
    assert {dest for _, dest, _, _ in rows} == {0, 1} and len({chunk for chunk, _, _, _ in rows}) == 2
    a_step, b_step = layout.slice_origin(lay, 1, layout.slice_rows(lay, m))
    out = []
    for _, dest, row0, col0 in rows:  # the kernel's own origin arithmetic (kernel._tile_origin)
        a_row0, b_row0, c_row0, c_col0 = slice_tile_origin(dest, row0, col0, a_step=a_step, b_step=b_step)
        out.append((dest * lay.m_max_padded, a_row0, c_row0, b_row0, c_col0, lay.n_slice, lay.m_max_padded))
    return out


def _put(image, index, values, what):
    """``image[:, index] = values`` where every index is new: nothing is written twice."""
    assert len(np.unique(index)) == len(index) and (image[:, index] == -1).all(), f"{what} written twice"
    image[:, index] = values


def _replay_epilogue(block_m, block_n, fuse, quant, *, staged, pattern="all-reduce"):
    """[3, elements]: per C element (flat index in the C tensor, or in the partial region) the source
    register, the A and B scale indices (ptpc; -1 elsewhere), and -1 for an element never written:
    the direct stores (``staged=False``: C[row, col] = bf16(acc[i, j][e] * sa * sb), one
    buffer_store_short per value) or the LDS stage and its 16-byte stores (``byte_layout.CStage`` and
    the scale offsets, composed as ``stages.CEpilogue`` / ``RowScales`` compose them). A register is
    numbered by (workgroup, wave, lane, quarter, i, j, e)."""
    n_a, n_b, half_m, half_n = block_m // 64, block_n // 128, block_m // 2, block_n // 2
    lane = np.arange(L.WAVE)
    stage = L.CStage(n_a=n_a, n_b=n_b)
    wgs = _workgroups(block_m, block_n, fuse, quant, pattern)
    size = max((c_row_base + c_rows) * ldc for c_row_base, *_, ldc, c_rows in wgs) + 2 * block_n
    out = np.full((3, size), -1, dtype=np.int64)
    for wg, (c_row_base, row0, c_row0, b_row0, c_col0, ldc, _) in enumerate(wgs):
        lds = np.full((3, L.N_WAVES * stage.wave_bytes // L.C_BYTES), -1, dtype=np.int64)  # the stage, per bf16
        for wave in range(L.N_WAVES):
            wave_m, wave_n = wave // 4, wave % 4
            a_row0, b_wave_row0 = row0 + wave_m * 16 * n_a, b_row0 + wave_n * 16 * n_b
            c_wave_row0 = c_row0 + wave_m * 16 * n_a  # the same tile rows within dest's plane
            for q, (rh, ch) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
                for i, j, e in itertools.product(range(n_a), range(n_b), range(4)):
                    reg = (((((wg * L.N_WAVES + wave) * L.WAVE + lane) * 4 + q) * n_a + i) * n_b + j) * 4 + e
                    if staged:  # the scales' per-lane bases plus the half and tile immediates
                        sa = (L.row_scale_base(lane=lane, row0=a_row0)
                              + L.tile_scale_imm(half=rh, half_rows=half_m, tile=i)) // L.F32_BYTES + e
                        sb = (L.col_scale_base(lane=lane, col0=b_wave_row0)
                              + L.tile_scale_imm(half=ch, half_rows=half_n, tile=j)) // L.F32_BYTES
                        b, imm = stage.write_imm(q, i, j, e)
                        addr = stage.write_bases(lane, wave)[b] + imm
                        assert (addr % L.C_BYTES == 0).all()
                        _put(lds, addr // L.C_BYTES, np.stack([reg, sa, sb]), "an LDS stage value")
                    else:  # the replaced epilogue: Bf16Store.tile and the scale reads of kernel._stages
                        sa = a_row0 + rh * half_m + 16 * i + (lane // 16) * 4 + e
                        sb = b_wave_row0 + ch * half_n + 16 * j + lane % 16
                        row = c_wave_row0 + rh * half_m + 16 * i + (lane // 16) * 4 + e
                        col = c_col0 + ch * half_n + wave_n * 16 * n_b + 16 * j + lane % 16
                        _put(out, (c_row_base + row) * ldc + col, np.stack([reg, sa, sb]), "a C element")
                if staged:  # the read-back, 16 bytes per lane, and the global stores of quarter q
                    voff0 = stage.store_lane_offset(lane, row0=c_row_base + c_wave_row0,
                                                    col0=c_col0 + wave_n * 16 * n_b, ldc=ldc)
                    for n in range(stage.stores):
                        src = (stage.read_base(lane, wave) + stage.read_imm(q, n)) // L.C_BYTES
                        voff = voff0 + stage.store_step_offset(n, row_offset=rh * half_m, col_offset=ch * half_n,
                                                               ldc=ldc)
                        # 16-byte aligned, and one store never straddles a row: bounds drop rows whole
                        assert (voff % L.C_GRANULE == 0).all() and ((voff // 2) % ldc + L.C_VECTOR <= ldc).all()
                        for k in range(L.C_VECTOR):
                            _put(out, voff // L.C_BYTES + k, lds[:, src + k], "a C element")
                            lds[:, src + k] = -2  # read back
        assert not staged or (lds == -2).all(), "staged values never stored, or stage slots never written"
    if quant != "ptpc":
        out[1:, out[0] >= 0] = -1  # blockscale and mxfp8 store the accumulators unscaled
    return out


@pytest.mark.parametrize("pattern", ["all-reduce", "reduce-scatter-rows"])
@pytest.mark.parametrize("block_m,block_n", [(256, 256), (128, 256), (256, 128)], ids=lambda v: str(v))
def test_fused_elements_come_from_their_slices_rows_of_a_and_b(block_m, block_n, pattern):
    """Guards the fused tile origin (``kernel._tile_origin``: A row ``dest * a_step + row0``, B row
    ``dest * b_step + col0``, C ``partial[dest][row0, col0]``) as the staged epilogue composes it:
    element [d, r, c] of the partial planes is scaled by A row ``r`` of slice d and B row (output
    column) ``c`` of slice d, i.e. it is this rank's product at slice d's ``slice_origin`` + (r, c),
    for slices by columns (the all-reduce's) and by rows (the reduce-scatter's along tokens); and
    every element of every plane is written once."""
    from cco import layout

    got = _replay_epilogue(block_m, block_n, True, "ptpc", staged=True, pattern=pattern)
    wgs = _workgroups(block_m, block_n, True, "ptpc", pattern)
    ldc, c_rows = wgs[0][5], wgs[0][6]
    flat = np.nonzero(got[0] >= 0)[0]
    assert len(flat) == 2 * c_rows * ldc  # both planes, whole
    dest, r, c = flat // (c_rows * ldc), (flat % (c_rows * ldc)) // ldc, flat % ldc
    world, by_rows = 2, pattern == "reduce-scatter-rows"
    lay = layout.build_config(n=ldc if by_rows else ldc * world, k=256, m_max=c_rows * world if by_rows else c_rows,
                              world=world, mode="fused", block_m=block_m, block_n=block_n, pattern=pattern)
    origin = np.array([layout.slice_origin(lay, d, c_rows) for d in range(world)])  # (a slice is c_rows here)
    assert np.array_equal(got[1, flat], origin[dest, 0] + r)  # A scale row = the product's row
    assert np.array_equal(got[2, flat], origin[dest, 1] + c)  # B scale row = the product's column


@pytest.mark.parametrize("quant", ["ptpc", "blockscale", "mxfp8"])
@pytest.mark.parametrize("fuse", [False, True], ids=["gemm", "fused"])
@pytest.mark.parametrize("block_m,block_n", [(256, 256), (128, 256), (256, 128)], ids=lambda v: str(v))
def test_staged_epilogue_writes_the_bytes_of_the_direct_one(block_m, block_n, fuse, quant):
    """Guards the epilogue's address arithmetic: through the LDS stage and its 16-byte stores every C
    element of every workgroup (gemm-only, and fused with cco.layout's tile table: dest planes,
    column slices) gets exactly the register, and (ptpc) the A and B scale indices, the direct
    per-value stores gave it, and nothing else is written. The value is bf16(acc * (sa * sb)) in the
    same fp32 order in both (kernel._stages.stage); blockscale and mxfp8 store bf16(acc)."""
    old = _replay_epilogue(block_m, block_n, fuse, quant, staged=False)
    new = _replay_epilogue(block_m, block_n, fuse, quant, staged=True)
    assert (new[0] >= 0).sum() == len(_workgroups(block_m, block_n, fuse, quant)) * block_m * block_n
    assert np.array_equal(new, old)


def test_the_stage_fits_the_operand_buffers_and_its_accesses_are_bank_conflict_free():
    """The C tile in bf16 fits in the A/B buffers it reuses; each ds_write_b16 (64 lanes, 2 bytes) and
    each group of 8 lanes of a ds_read_b128 touches 32 distinct 4-byte banks."""
    from kernels_fused.gfx950.kernel import TILES, kernel_config

    lane = np.arange(L.WAVE)
    for bm, bn in TILES:
        stage = L.CStage(n_a=bm // 64, n_b=bn // 128)
        assert L.N_WAVES * stage.wave_bytes == bm * bn * L.C_BYTES <= kernel_config(K=256, BLOCK_M=bm, BLOCK_N=bn).lds_bytes
        for q, i, j, e in itertools.product(range(4), range(stage.n_a), range(stage.n_b), range(4)):
            b, imm = stage.write_imm(q, i, j, e)
            words = (stage.write_bases(lane, 0)[b] + imm) // 4
            banks = {}
            for w in words:
                banks.setdefault(int(w) % 32, set()).add(int(w))
            assert max(len(v) for v in banks.values()) == 1, (bm, bn, q, i, j, e)
        for q, n in itertools.product(range(4), range(stage.stores)):
            words = (stage.read_base(lane, 0) + stage.read_imm(q, n)) // 4
            for g in range(0, L.WAVE, 8):
                assert len({(int(w) + d) % 32 for w in words[g:g + 8] for d in range(4)}) == 32


@pytest.mark.parametrize("block_m,block_n", [(256, 256), (128, 256), (256, 128)], ids=lambda v: str(v))
def test_kernel_offsets_are_the_replayed_ones(block_m, block_n):
    """The kernel forms its DMA offsets as one per-lane base plus a constant per half and step, and its
    fragment reads as two per-lane bases plus a constant per tile; these equal the offsets the
    fragment test above replays on data, for every lane, wave, half, step, tile and K."""
    lane = np.arange(L.WAVE)
    half_m, half_n = block_m // 2, block_n // 2
    steps_a, steps_b, n_a, n_b = half_m // 64, half_n // 64, block_m // 64, block_n // 128
    row0, b_row0 = 3 * block_m, 5 * block_n
    for K in (256, 384, 2048):
        for wave in range(L.N_WAVES):
            a_base = L.a_dma_offsets(lane=lane, wave=wave, row0=row0, K=K, steps=1)[0]
            b_base = L.b_dma_offsets(lane=lane, wave=wave, group0=b_row0 // 16, K=K, steps=1)[0]
            for h in (0, 1):
                want_a = L.a_dma_offsets(lane=lane, wave=wave, row0=row0 + h * half_m, K=K, steps=steps_a)
                want_b = L.b_dma_offsets(lane=lane, wave=wave, group0=(b_row0 + h * half_n) // 16, K=K, steps=steps_b)
                for s, want in enumerate(want_a):
                    assert (a_base + L.a_dma_step(half=h, half_rows=half_m, step=s, K=K) == want).all()
                for s, want in enumerate(want_b):
                    assert (b_base + L.b_dma_step(half=h, half_rows=half_n, step=s, K=K) == want).all()
    for wave in range(L.N_WAVES):
        first_row, first_group = (wave // 4) * n_a * 16, (wave % 4) * n_b
        a_lo, a_hi = L.a_read_bases(lane=lane, first_row=first_row)
        b_lo, b_hi = L.b_read_bases(lane=lane, first_group=first_group)
        for i in range(n_a):
            lo, hi = L.a_read_offsets(lane=lane, row=first_row + 16 * i + lane % 16)
            assert (a_lo + i * L.MFMA_TILE_BYTES == lo).all() and (a_hi + i * L.MFMA_TILE_BYTES == hi).all()
        for j in range(n_b):
            lo, hi = L.b_read_offsets(lane=lane, group=first_group + j)
            assert (b_lo + j * L.MFMA_TILE_BYTES == lo).all() and (b_hi + j * L.MFMA_TILE_BYTES == hi).all()


@pytest.mark.parametrize("block_m,block_n", [(256, 256), (128, 256), (256, 128)], ids=lambda v: str(v))
def test_main_loop_scale_offsets_are_the_indices_of_the_direct_reads(block_m, block_n):
    """blockscale's A scales and mxfp8's A and B scales are read from a per-lane base plus a constant
    per half, tile and K tile (``stages.BlockScales`` / ``MxScales``); for every lane, wave, half, tile
    and K tile these are the elements the kernel read before, index by index: blockscale A
    ``k * M + row + 4 (l // 16)`` (column-major [M, K/128]), mxfp8 ``(row + l % 16) * K/32 + 4 k + l // 16``."""
    lane = np.arange(L.WAVE)
    half_m, half_n, n_a, n_b = block_m // 2, block_n // 2, block_m // 64, block_n // 128
    m, row0, b_row0 = 4 * block_m + 100, block_m, 2 * block_n
    for K in (256, 1024, 8192):
        groups = K // L.MX_GROUP
        for wave in range(L.N_WAVES):
            a_row0 = row0 + (wave // 4) * 16 * n_a
            b_wave_row0 = b_row0 + (wave % 4) * 16 * n_b
            for k, h in itertools.product(range(0, K // L.BLOCK_K, 3), (0, 1)):
                for i in range(n_a):
                    row = a_row0 + h * half_m + 16 * i  # the tile's first row, as the kernel had it
                    got = (L.row_scale_base(lane=lane, row0=a_row0) + m * k * L.F32_BYTES
                           + L.tile_scale_imm(half=h, half_rows=half_m, tile=i))
                    assert (got == (k * m + row + (lane // 16) * 4) * L.F32_BYTES).all()
                    got = (L.mx_scale_base(lane=lane, row0=a_row0, groups=groups) + L.mx_scale_k_imm(k)
                           + L.tile_scale_imm(half=h, half_rows=half_m, tile=i, bytes_per_row=groups))
                    assert (got == (row + lane % 16) * groups + k * 4 + lane // 16).all()
                for j in range(n_b):
                    row = b_wave_row0 + h * half_n + 16 * j
                    got = (L.mx_scale_base(lane=lane, row0=b_wave_row0, groups=groups) + L.mx_scale_k_imm(k)
                           + L.tile_scale_imm(half=h, half_rows=half_n, tile=j, bytes_per_row=groups))
                    assert (got == (row + lane % 16) * groups + k * 4 + lane // 16).all()


def test_a_swizzle_is_an_involution_within_a_row():
    for row in range(32):
        cols = [L.swizzle_col(row, c) for c in range(0, 128, 16)]
        assert sorted(cols) == list(range(0, 128, 16))
        assert all(L.swizzle_col(row, L.swizzle_col(row, c)) == c for c in range(0, 128, 16))


@pytest.mark.parametrize("bad,match", [
    (dict(K=128), "K=128"), (dict(K=640 + 64), "K=704"), (dict(K=512, quant="fp8"), "quant='fp8'"),
    (dict(K=512, BLOCK_M=64), "64x256"), (dict(K=512, variant="fast"), "variant='fast'"),
], ids=["k128", "k-unaligned", "quant", "tile", "variant"])
def test_factory_rejects_what_it_cannot_build(bad, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        compile_fused_gemm_scatter(0, 2, **bad)


def test_launch_without_gfx950_raises_before_touching_a_device():
    """Calling a FlyDSL kernel without its device aborts the process; the launcher must refuse first."""
    from kernels_fused.gfx950.kernel import gfx950_device_reason

    if gfx950_device_reason() is None:
        pytest.skip("this machine has a gfx950 device; the refusal path is for machines without one")
    from cco.quant import quantize_a, quantize_b

    launch = compile_fused_gemm_scatter(0, 1, K=256, fuse=False)
    a, sa = quantize_a(torch.randn(256, 256), "ptpc")
    b, sb = quantize_b(torch.randn(256, 256), "ptpc")
    c = torch.empty(256, 256, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="needs a gfx950 device"):
        launch(a, preshuffle_b(b), c, sa, sb, 256, 256)


# --------------------------------------------------------------------------------------------------
# compile: FlyDSL -> gfx950 ISA on this CPU
# --------------------------------------------------------------------------------------------------
def _toolchain_reason():
    from kernels_fused.gfx950.toolchain import flydsl_available

    return flydsl_available()


needs_toolchain = pytest.mark.skipif(_toolchain_reason() is not None, reason=f"no gfx950 CPU compile: {_toolchain_reason()}")

# (quant, tile, K, fuse): every quant, every tile, both modes, K from the zero-iteration main loop up
REPRESENTATIVE = [
    ("ptpc", "256x256", 256, False),
    ("ptpc", "256x256", 512, True),
    ("ptpc", "128x256", 384, False),
    ("blockscale", "128x256", 512, True),
    ("blockscale", "256x128", 256, False),
    ("mxfp8", "256x128", 512, True),
    ("mxfp8", "256x256", 256, False),
]


def compiled(quant, tile, K, fuse, variant="shipped"):
    from kernels_fused.gfx950.isa import compiled as shared  # one compile per variant across the test tiers

    return shared(quant, tile, K, fuse, variant)


def _ids(p):
    quant, tile, K, fuse = p
    return f"{quant}-{tile}-k{K}-{'fused' if fuse else 'gemm'}"


@pytest.mark.compile
@needs_toolchain
@pytest.mark.parametrize("variant", REPRESENTATIVE, ids=[_ids(p) for p in REPRESENTATIVE])
def test_variant_compiles_for_gfx950_without_spills(variant):
    from kernels_fused.gfx950.isa import parse, resources

    cfg, isa = compiled(*variant)
    assert re.search(r"\.amdgcn_target \"amdgcn-amd-amdhsa-[a-z]*-gfx950\"", isa), "not a gfx950 code object"
    res = resources(isa)
    assert res.lds_bytes == cfg.lds_bytes
    assert (res.vgpr_spills, res.sgpr_spills, res.scratch_bytes) == (0, 0, 0), res.line()
    ops = [i.op for i in parse(isa)]
    mfma = "v_mfma_scale_f32_16x16x128_f8f6f4" if cfg.quant == "mxfp8" else "v_mfma_f32_16x16x128_f8f6f4"
    per_quarter = (cfg.BLOCK_M // 64) * (cfg.BLOCK_N // 128)
    assert ops.count(mfma) == cfg.k_tiles * 4 * per_quarter  # every K tile, four quarters
    assert not [o for o in ops if o.startswith("v_mfma") and o != mfma]
    assert ops.count("buffer_load_dwordx4") >= cfg.k_tiles * 2 * (cfg.steps_a + cfg.steps_b)


@pytest.mark.compile
@needs_toolchain
@pytest.mark.parametrize("variant", [p for p in REPRESENTATIVE if p[3]], ids=[_ids(p) for p in REPRESENTATIVE if p[3]])
def test_fused_epilogue_publishes_once_with_release_ordering(variant):
    """fuse=True: one 64-bit atomic add per workgroup, system-scope release (L2 written back
    first) and acquire (invalidate after), after the stores drain; fuse=False has no atomic."""
    from kernels_fused.gfx950.isa import parse

    cfg, isa = compiled(*variant)
    instrs = parse(isa)
    atomics = [i for i in instrs if "atomic" in i.op]
    assert [a.op for a in atomics] == ["global_atomic_add_x2"] and atomics[0].conditional
    after = [i.op for i in instrs if i.line > atomics[0].line]
    before = [i.op for i in instrs if i.line < atomics[0].line]
    assert "buffer_wbl2" in before[-4:], before[-4:]
    assert "buffer_inv" in after
    _, plain = compiled(variant[0], variant[1], variant[2], False)
    assert not [i for i in parse(plain) if "atomic" in i.op]


@pytest.mark.compile
@needs_toolchain
def test_compile_env_targets_gfx950_and_restores_the_environment(tmp_path, monkeypatch):
    from kernels_fused.gfx950.toolchain import compile_env

    monkeypatch.setenv("FLYDSL_GPU_ARCH", "gfx942")
    with compile_env(tmp_path) as d:
        assert os.environ["FLYDSL_GPU_ARCH"] == "gfx950" and os.environ["COMPILE_ONLY"] == "1"
        lld = os.path.join(os.environ["ROCM_PATH"], "llvm", "bin", "ld.lld")
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        assert os.path.islink(lld) and not os.path.abspath(os.environ["ROCM_PATH"]).startswith(repo)
        assert d == tmp_path
    assert os.environ["FLYDSL_GPU_ARCH"] == "gfx942"



# --------------------------------------------------------------------------------------------------
# host: the emitter is a walker of the schedule, nothing more
# --------------------------------------------------------------------------------------------------
class _Recorder:
    """Stands in for the FlyDSL stages; records what the emitter asks them to emit."""

    def __init__(self, trace, n_a=2, n_b=2):
        self.trace, self.n_a, self.n_b, self.steps = trace, n_a, n_b, None

    # parts
    def wait_barrier(self, n):
        self.trace.append(("wait_barrier", n))

    def read_done_barrier(self):
        self.trace.append(("read_done_barrier",))

    def bare_barrier(self):
        self.trace.append(("barrier",))

    def set_priority(self, level):
        self.trace.append(("prio", level))

    def zero_acc(self):
        return 0.0

    def pin(self, value):
        return value


def _emit_trace(schedule, quant):
    from kernels_fused.gfx950.kernel import PipelineEmitter, kernel_config, split_by_group

    g = schedule.geometry
    cfg = kernel_config(K=g.k, BLOCK_M=g.block_m, BLOCK_N=g.block_n, quant=quant, fuse=False)
    trace = []
    P = _Recorder(trace)

    class Dma:
        def __init__(self, half):
            self.half, self.steps = half, g.a_steps if half[0] == "a" else g.b_steps

        def load(self, lds, ktile):
            trace.append(("load", self.half, ktile, lds))

    class Reader:
        def __init__(self, op):
            self.op = op

        def load(self, lds):
            trace.append(("read", lds))
            return [lds]

    class Mfma:
        n_a, n_b = 1, 1

        def run(self, a, b, acc, **scales):
            trace.append(("mfma", a[0], b[0], bool(scales)))
            return acc

        def run_folded(self, a, b, acc, fold):
            trace.append(("mfma", a[0], b[0], "folded"))
            return acc

    class Scales:
        def for_tile(self, tile, k):
            trace.append(("scales", tile, k))
            return [None]

    lds = {h: (f"{h}.slot0", f"{h}.slot1") for h in ("a0", "a1", "b0", "b1")}
    emitter = PipelineEmitter(cfg=cfg, parts=P, lds=lds, dma={h: Dma(h) for h in lds},
                              readers={"a": Reader("a"), "b": Reader("b")}, mfma=Mfma(), scales=Scales(),
                              stage=lambda name, acc, a, b, scales: trace.append(("stage", name)),
                              store=lambda name, a, b: trace.append(("store", name)),
                              flush=lambda: trace.append(("flush",)))
    segments, groups = split_by_group([ev for _, ev in schedule.program()])
    for i, seg in enumerate(segments):
        emitter.run(seg)
        if i < len(groups):
            trace.append(("group_barrier", groups[i]))
    return trace


@pytest.mark.parametrize("variant", ["shipped", "upstream", "a+b-1"])
@pytest.mark.parametrize("quant,tile", [("ptpc", (256, 256)), ("blockscale", (128, 256)), ("mxfp8", (256, 128))],
                         ids=["ptpc", "blockscale", "mxfp8"])
@pytest.mark.parametrize("K", [256, 640])
def test_emitter_emits_exactly_the_schedule(variant, quant, tile, K):
    """Every schedule event becomes its code in program order (waits/barriers as asm, loads into
    slot ktile % 2, MFMAs on the fragments of the K tile they name, the C stage written before one
    flush and the read-back stores); nothing else is emitted."""
    from kernels_fused.pipeline import schedule as S

    sched = S.build_schedule(block_m=tile[0], block_n=tile[1], k=K, quant=quant, variant=variant)
    want, in_call, staged = [], False, False  # an MFMA call: s_setprio(1) ... s_setprio(0); s_barrier
    for _, ev in sched.program():
        if isinstance(ev, S.LoadTile):
            want.append(("load", ev.half.lower(), ev.ktile, f"{ev.half.lower()}.slot{ev.ktile % 2}"))
        elif isinstance(ev, S.LdsRead):
            want.append(("read", f"{ev.half.lower()}.slot{ev.ktile % 2}"))
        elif isinstance(ev, S.ScaleLoad):
            want.append(("scales", ev.half.lower(), ev.ktile))
        elif isinstance(ev, S.WaitBarrier):
            want.append(("wait_barrier", ev.vmcnt))
        elif isinstance(ev, S.ReadDoneBarrier):
            want.append(("read_done_barrier",))
        elif isinstance(ev, S.Barrier) and ev.group is not None:
            want.append(("group_barrier", ev.group))
        elif isinstance(ev, S.Barrier):
            if ev.kind == "mfma":
                want.append(("prio", 0))
                in_call = False
            want.append(("barrier",))
        elif isinstance(ev, S.Mfma):
            if not in_call:
                want.append(("prio", 1))
                in_call = True
            kind = {"ptpc": False, "mxfp8": True, "blockscale": "folded"}[quant]
            want.append(("mfma", f"{ev.a}.slot{ev.ktile % 2}", f"{ev.b}.slot{ev.ktile % 2}", kind))
        elif isinstance(ev, S.StageC):
            want.append(("stage", ev.acc))
            staged = True
        elif isinstance(ev, S.StoreC):
            if staged:  # the wave's stage writes land before its first read-back
                want.append(("flush",))
                staged = False
            want.append(("store", ev.acc))
        else:
            assert isinstance(ev, S.WaitVm), ev
    assert _emit_trace(sched, quant) == want


# --------------------------------------------------------------------------------------------------
# host: the C stage reuses the A/B buffers only once no wave reads them (happens-before checker)
# --------------------------------------------------------------------------------------------------
def _without_epilogue_barrier(sched):
    """``sched`` with the epilogue's barrier (close, or both groups' without close_lag) removed."""
    import dataclasses

    from kernels_fused.pipeline import schedule as S

    *head, epi = sched.phases
    ops = tuple(op for op in epi.ops if not (isinstance(op, S.Barrier) and op.kind in ("close", "epilogue")))
    assert len(ops) == len(epi.ops) - 1
    return dataclasses.replace(sched, phases=(*head, dataclasses.replace(epi, ops=ops)))


@pytest.mark.parametrize("variant", ["shipped", "upstream", "a+b-1"])
@pytest.mark.parametrize("tile", [(256, 256), (128, 256), (256, 128)], ids=lambda t: f"{t[0]}x{t[1]}")
def test_stage_writes_wait_for_every_wave_to_finish_reading(variant, tile):
    """Every wave's C stage writes (into LDS the A/B half-tiles occupied) are ordered after every LDS
    read and every DMA load of every wave, through the barrier pairing of both wave groups: the
    leading group's close barrier pairs with the lagging group's last MFMA barrier (or, without the
    close barrier, both groups pass an epilogue barrier). Without that barrier the leading group
    would stage over the final A1 the lagging group is still reading: the checker must say so."""
    from kernels_fused.pipeline import happens_before as H
    from kernels_fused.pipeline import schedule as S

    for K in (256, 640):
        sched = S.build_schedule(block_m=tile[0], block_n=tile[1], k=K, quant="ptpc", variant=variant)
        stages = H.check(sched).stages
        assert len(stages) == 4 * L.N_WAVES and all(st.status == "ordered" for st in stages)
        broken = H.check(_without_epilogue_barrier(sched))
        late = [st for st in broken.stages if st.status == "unordered"]
        assert late and not broken.ok
        assert {st.wave // 4 for st in late} == {0}  # the leading group writes early ...
        assert all(w // 4 == 1 and what.startswith("read A1") for st in late for what, w, _ in st.unordered)
        assert "is not ordered before it" in broken.explain(late[0])  # ... over the lagging group's reads
