"""Byte arithmetic of the gfx950 kernel's data path: global -> LDS (DMA) -> MFMA fragments.

Pure integer functions, used by the FlyDSL stages (``stages``, where the arguments are DSL
integers) and by the host tests (plain ints), so the mapping the kernel compiles is the mapping the
tests replay on real data. See ``stages`` for the geometry in words.
"""

from kernels_fused.pipeline.schedule import BLOCK_K, MFMA_ROWS, WAVES as N_WAVES

WAVE = 64
DMA_BYTES_PER_WAVE = WAVE * 16  # one buffer_load_dwordx4 ... lds: 16 bytes per lane
DMA_BYTES_PER_STEP = N_WAVES * DMA_BYTES_PER_WAVE
MX_GROUP = 32  # K bytes per lane of a 16x16x128 operand (and per e8m0 scale)
B_GROUP_BYTES = MFMA_ROWS * BLOCK_K  # one 16-row x 128-K piece of the bpreshuffle layout
B_SLICE_BYTES = MFMA_ROWS * 16  # one 16-row x 16-byte block inside it


def swizzle_col(row, col):
    """LDS column of A's (row, col): 16-byte granules XOR-ed with row bits 1..3 (an involution)."""
    return col ^ (((row % 16) // 2) * 16)


def dma_lds_offset(wave, step, lane):
    """LDS byte (within a half-tile) that lane ``lane`` of ``wave`` writes in DMA step ``step``."""
    return step * DMA_BYTES_PER_STEP + wave * DMA_BYTES_PER_WAVE + lane * 16


def a_dma_offsets(*, lane, wave, row0, K, steps):
    """Global byte offsets of row-major A [M, K] per DMA step (K tile 0); row0 = the half's first row.

    LDS row ``r`` (= 8 wave + lane // 8 + 64 step) column ``c`` holds A[row0 + r, swizzle_col(r, c)].
    """
    out = []
    for s in range(steps):
        row = lane // 8 + wave * 8 + s * 64
        out.append((row0 + row) * K + swizzle_col(row, (lane % 8) * 16))
    return out


def b_dma_offsets(*, lane, wave, group0, K, steps):
    """Global byte offsets of bpreshuffled B per DMA step (K tile 0); group0 = the half's first 16-row group.

    A 16-row group's 128-K piece is contiguous in the bpreshuffle layout (2 KiB), so LDS holds it
    verbatim: half-tile group ``j`` at ``j * 2 KiB``.
    """
    out = []
    for s in range(steps):
        group = group0 + s * (DMA_BYTES_PER_STEP // B_GROUP_BYTES) + wave // 2
        out.append(group * (K * MFMA_ROWS) + (wave % 2) * DMA_BYTES_PER_WAVE + lane * 16)
    return out


def a_read_offsets(*, lane, row):
    """The two 16-byte LDS reads of A row ``row`` for ``lane``: K bytes [32 (lane // 16), +32)."""
    k0 = (lane // 16) * MX_GROUP
    return row * BLOCK_K + swizzle_col(row, k0), row * BLOCK_K + swizzle_col(row, k0 + 16)


def b_read_offsets(*, lane, group):
    """The two 16-byte LDS reads of B group ``group``, row ``lane % 16``: K bytes [32 (lane // 16), +32)."""
    base = group * B_GROUP_BYTES + (lane % 16) * 16
    slice0 = (lane // 16) * 2  # 16-wide K slices 2g and 2g + 1
    return base + slice0 * B_SLICE_BYTES, base + (slice0 + 1) * B_SLICE_BYTES
