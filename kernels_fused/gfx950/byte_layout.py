"""Byte arithmetic of the gfx950 kernel's data path: global -> LDS (DMA) -> MFMA fragments.

Pure integer functions, used by the FlyDSL stages (``stages``, where the arguments are DSL
integers) and by the host tests (plain ints), so the mapping the kernel compiles is the mapping the
tests replay on real data. See ``stages`` for the geometry in words.
"""

from kernels_fused.pipeline.schedule import BLOCK_K, MFMA_ROWS, WAVES as N_WAVES

WAVE = 64
DMA_LANE_BYTES = 16  # one buffer_load_dwordx4 ... lds: 16 bytes per lane
DMA_BYTES_PER_WAVE = WAVE * DMA_LANE_BYTES
DMA_BYTES_PER_STEP = N_WAVES * DMA_BYTES_PER_WAVE
ROWS_PER_DMA_STEP = DMA_BYTES_PER_STEP // BLOCK_K  # A rows one DMA step of all eight waves fills
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


def a_dma_step(*, half: int, half_rows: int, step: int, K: int) -> int:
    """What half ``half``, DMA step ``step`` adds to the A offsets of half 0, step 0 (the swizzle
    depends on the row mod 16, which a step of 64 rows or a half of 64 / 128 rows keeps)."""
    return (half * half_rows + step * ROWS_PER_DMA_STEP) * K


def b_dma_step(*, half: int, half_rows: int, step: int, K: int) -> int:
    """What half ``half``, DMA step ``step`` adds to the B offsets of half 0, step 0."""
    return (half * half_rows // MFMA_ROWS + step * (DMA_BYTES_PER_STEP // B_GROUP_BYTES)) * (K * MFMA_ROWS)


def a_read_offsets(*, lane, row):
    """The two 16-byte LDS reads of A row ``row`` for ``lane``: K bytes [32 (lane // 16), +32)."""
    k0 = (lane // 16) * MX_GROUP
    return row * BLOCK_K + swizzle_col(row, k0), row * BLOCK_K + swizzle_col(row, k0 + 16)


MFMA_TILE_BYTES = MFMA_ROWS * BLOCK_K  # one 16-row MFMA tile of a half-tile in LDS, A and B alike


def a_read_bases(*, lane, first_row):
    """:func:`a_read_offsets` of tile 0 when ``first_row`` (the wave's first row) is a multiple of 16:
    the swizzle then depends on ``lane % 16`` alone, so tile ``i`` is these plus ``i * MFMA_TILE_BYTES``
    (an immediate offset, no per-tile address register)."""
    return a_read_offsets(lane=lane, row=first_row + lane % MFMA_ROWS)


def b_read_bases(*, lane, first_group):
    """:func:`b_read_offsets` of tile 0; tile ``i`` is these plus ``i * MFMA_TILE_BYTES``."""
    return b_read_offsets(lane=lane, group=first_group)


def b_read_offsets(*, lane, group):
    """The two 16-byte LDS reads of B group ``group``, row ``lane % 16``: K bytes [32 (lane // 16), +32)."""
    base = group * B_GROUP_BYTES + (lane % 16) * 16
    slice0 = (lane // 16) * 2  # 16-wide K slices 2g and 2g + 1
    return base + slice0 * B_SLICE_BYTES, base + (slice0 + 1) * B_SLICE_BYTES


# --------------------------------------------------------------------------------------------------
# epilogue: C through a wave-private LDS stage, 16 bytes per lane per global store
# --------------------------------------------------------------------------------------------------
C_BYTES = 2  # bf16
C_VECTOR = 8  # bf16 per lane per global store: 16 bytes, buffer_store_dwordx4
C_GRANULE = C_VECTOR * C_BYTES
MFMA_C_ROWS = 4  # v_mfma 16x16: lane l holds rows 4 (l // 16) .. +3 of column l % 16


class CStage:
    """Where a wave's part of one C quarter sits in its LDS stage, and who stores it.

    A wave owns ``rows = 16 n_a`` rows x ``cols = 16 n_b`` columns of each quarter (its MFMA tiles).
    In registers lane ``l`` holds, per tile (i, j), the column ``16 j + l % 16`` of rows
    ``16 i + 4 (l // 16) + e`` (e = 0..3): column vectors. The store wants row vectors: 8
    consecutive bf16 (16 bytes) per lane. The stage turns one into the other. It is cut into
    16-byte *slots*, one per global store of one lane; slot ``T`` holds row segment
    ``(row, seg)`` = columns ``8 seg .. +7`` of a row, in the order

        T = (row % 4) * (rows / 4) * segs + (row // 4) * segs + seg        (segs = cols / 8)

    so store ``n`` of a quarter is lanes ``l`` = slots ``64 n + l``: ``segs`` consecutive lanes
    write one row's ``cols`` contiguous bytes. Slot ``T`` lives at 16-byte granule
    ``T ^ (bit 3 of T) << 1`` of the quarter's region: that XOR spreads the four row groups of one
    ``ds_write_b16`` (16 lanes each, 32 bytes) over 32 distinct banks, and permutes only within
    aligned 128-byte blocks, so eight consecutive lanes of a ``ds_read_b128`` still cover 32 banks.
    Regions: wave ``w``, quarter ``q`` at ``(4 w + q) * quarter_bytes``: the whole C tile in bf16,
    which fits in the A/B buffers (``BLOCK_M * BLOCK_N * 2 <= 2 (BLOCK_M + BLOCK_N) * 128``).
    """

    def __init__(self, *, n_a: int, n_b: int):
        self.n_a, self.n_b = n_a, n_b
        self.rows, self.cols = 16 * n_a, 16 * n_b
        self.segs = self.cols // C_VECTOR
        self.quarter_bytes = self.rows * self.cols * C_BYTES
        self.wave_bytes = 4 * self.quarter_bytes
        self.stores = self.rows * self.segs // 64  # global stores per quarter per wave
        self.row_step = 64 // (self.segs * (self.rows // 4))  # rows between a lane's store n and n + 1
        assert self.stores >= 1 and self.row_step >= 1

    # -- the layout
    def slot(self, row, seg):
        return (row % 4) * (self.rows // 4) * self.segs + (row // 4) * self.segs + seg

    def row_seg(self, slot):
        g, seg = divmod(slot, self.segs)
        e, g4 = divmod(g, self.rows // 4)
        return 4 * g4 + e, seg

    @staticmethod
    def granule(slot):
        return slot ^ (((slot >> 3) & 1) << 1)

    def offset(self, row, col):
        """Byte of (row, col) in the wave's quarter region."""
        return self.granule(self.slot(row, col // C_VECTOR)) * C_GRANULE + (col % C_VECTOR) * C_BYTES

    # -- what the kernel computes: a per-lane base plus a compile-time immediate
    def write_bases(self, lane, wave):
        """The two per-lane LDS bases of the ``ds_write_b16`` stores (see :meth:`write_imm`)."""
        g, h = lane // 16, (lane % 16) // C_VECTOR
        lane_granule = self.granule(self.slot(MFMA_C_ROWS * g, h))
        byte = (lane % C_VECTOR) * C_BYTES + wave * self.wave_bytes
        return (lane_granule * C_GRANULE + byte, (lane_granule ^ 2) * C_GRANULE + byte)

    def write_imm(self, quarter: int, i: int, j: int, e: int) -> tuple[int, int]:
        """(which base, immediate) of value ``e`` of tile (i, j): row 16 i + 4 g + e, column 16 j + l % 16.

        The slot splits into a compile-time part (e, i, j) and a lane part (g, h) on disjoint bits,
        so only bit 1 of the granule mixes them: the base is chosen by the compile-time part's bit 1.
        """
        c = self.granule(self.slot(16 * i + e, 2 * j))
        return (c >> 1) & 1, quarter * self.quarter_bytes + (c & ~2) * C_GRANULE

    def read_base(self, lane, wave):
        """Per-lane LDS byte of the ``ds_read_b128`` of store 0, quarter 0."""
        return self.granule(lane) * C_GRANULE + wave * self.wave_bytes

    def read_imm(self, quarter: int, n: int) -> int:
        return quarter * self.quarter_bytes + n * 64 * C_GRANULE  # granule(64 n + l) = 64 n + granule(l)

    def store_row_col(self, lane):
        """(row, column) in the wave's quarter that lane ``lane`` stores with store 0."""
        row, seg = self.row_seg(lane)
        return row, seg * C_VECTOR

    def store_lane_offset(self, lane, *, row0, col0, ldc):
        """Byte offset in C of lane ``lane``'s store 0 of quarter 0; (row0, col0) is the wave's origin."""
        row, col = self.store_row_col(lane)
        return ((row0 + row) * ldc + col0 + col) * C_BYTES

    def store_step_offset(self, n: int, *, row_offset: int, col_offset: int, ldc):
        """What store ``n`` of a quarter ``row_offset`` rows, ``col_offset`` columns away adds to it."""
        return (row_offset + n * self.row_step) * ldc * C_BYTES + col_offset * C_BYTES


# --------------------------------------------------------------------------------------------------
# scales: a per-lane byte offset plus a per-(half, tile) part the kernel adds as an immediate
# --------------------------------------------------------------------------------------------------
F32_BYTES = 4
BUFFER_IMM_MAX = 4095  # the 12-bit immediate offset of a buffer instruction


def row_scale_base(*, lane, row0):
    """ptpc / blockscale A: byte of the f32 scale of row ``row0 + 4 (lane // 16)`` (the first of the four
    accumulator rows lane ``lane`` holds in a 16-row tile starting at ``row0``)."""
    return (row0 + MFMA_C_ROWS * (lane // MFMA_ROWS)) * F32_BYTES


def col_scale_base(*, lane, col0):
    """ptpc B: byte of the f32 scale of column ``col0 + lane % 16`` (the column lane ``lane`` holds)."""
    return (col0 + lane % MFMA_ROWS) * F32_BYTES


def tile_scale_imm(*, half: int, half_rows: int, tile: int, bytes_per_row: int = F32_BYTES) -> int:
    """What half ``half``, MFMA tile ``tile`` adds to a scale base (rows ``half_rows`` per half)."""
    return (half * half_rows + MFMA_ROWS * tile) * bytes_per_row


def mx_scale_base(*, lane, row0, groups):
    """mxfp8: byte of the e8m0 scale of row ``row0 + lane % 16``, K group ``lane // 16`` (of K tile 0):
    the operand order of v_mfma_scale_f32_16x16x128_f8f6f4. ``groups`` = K / 32 per row."""
    return (row0 + lane % MFMA_ROWS) * groups + lane // MFMA_ROWS


def mx_scale_k_imm(k: int) -> int:
    """What K tile ``k`` adds to an mxfp8 scale offset: four 32-wide groups per tile."""
    return k * (BLOCK_K // MX_GROUP)
