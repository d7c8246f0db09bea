"""Device code of the activation quantizer (host side: ``kernels_fused.hopper.quantize``).

Imported only when the quantizer runs, so ``import kernels_fused`` needs no triton.
"""

import triton
import triton.language as tl


@triton.jit
def _load_rows(x_ptr, rows, cols, M, K, stride_x):
    """fp32 [BLOCK_M, BLOCK_K] of x; rows past M and the zero-padded columns past K read 0."""
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    return tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _div_rn(x, y, SKIP_ZEROS: tl.constexpr = False):
    """IEEE ``x / y`` for ``y > 0``, broadcast (Triton's ``/`` divides approximately on NVIDIA: 2 ulp;
    torch rounds). ``SKIP_ZEROS``: a zero ``x`` is returned as it is (its sign too: the quotient's
    bits) without dividing. NVIDIA's IEEE division takes a slow path for a zero dividend, and the
    zeros a decode-sized call reads (rows past M, columns past K, padded tiles) made blockscale's
    group quantizer take 5.7-6.3 us instead of 2.5 at one row and at K = 1792 on an H200; at
    thousands of rows, where few values are zero, the selects made the ptpc and blockscale
    quantizers 1.1-1.8x slower (docs/decode.md), so large calls divide every value."""
    x, y = tl.broadcast(x, y)
    if SKIP_ZEROS:
        zero = x == 0.0
        return tl.where(zero, x, tl.div_rn(tl.where(zero, 1.0, x), y))
    return tl.div_rn(x, y)


@triton.jit
def _to_e4m3(v, ROUND_IN_FP32: tl.constexpr):
    """e4m3 of ``v`` (|v| <= 448), round to nearest even. ``ROUND_IN_FP32`` (Triton's CPU
    interpreter, whose conversion drops the carry when rounding up crosses a power of two: 124.4 came
    out as 64): round in fp32 first, so that the conversion only ever sees e4m3 values."""
    if ROUND_IN_FP32:
        bits = v.to(tl.int32, bitcast=True)
        # normal e4m3 (|v| >= 2**-6): keep 3 of fp32's 23 mantissa bits, ties to even
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
        normal = bits.to(tl.float32, bitcast=True)
        # subnormal e4m3: multiples of 2**-9, which is fp32's spacing between 2**14 and 2**15; the sign
        # bit put back as it was (a negative zero stays one, as the GPU's conversion keeps it)
        sign = (v.to(tl.int32, bitcast=True) >> 31) << 31
        sub = (((tl.abs(v) + 16384.0) - 16384.0).to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        v = tl.where(tl.abs(v) >= 0.015625, normal, sub)
    return v.to(tl.float8e4nv)


@triton.jit
def quantize_ptpc_kernel(x_ptr, q_ptr, s_ptr, M, M_OUT, K, K_PAD, stride_x, tiny, fp8_max,
                         BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SKIP_ZEROS: tl.constexpr,
                         ROUND_IN_FP32: tl.constexpr):
    """Per-token: one fp32 scale ``max(amax(row), tiny) / fp8_max`` per row, then the row divided by
    it (IEEE division, as torch divides), clamped and rounded to e4m3. Two passes over the row: the
    amax, then the quantization (the second pass reads from L2 at the row lengths of a layer).
    Rows ``M <= m < M_OUT`` read as zeros (the zero rows a caller pads to)."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # M * K may pass 2**31
    cols = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = _load_rows(x_ptr, rows, k0 + cols, M, K, stride_x)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    scale = _div_rn(tl.maximum(amax, tiny), tl.zeros_like(amax) + fp8_max)
    for k0 in range(0, K_PAD, BLOCK_K):
        x = _load_rows(x_ptr, rows, k0 + cols, M, K, stride_x)
        q = tl.clamp(_div_rn(x, scale[:, None], SKIP_ZEROS), -fp8_max, fp8_max)
        mask = (rows[:, None] < M_OUT) & ((k0 + cols)[None, :] < K_PAD)
        tl.store(q_ptr + rows[:, None] * K_PAD + (k0 + cols)[None, :], _to_e4m3(q, ROUND_IN_FP32), mask=mask)
    tl.store(s_ptr + rows, scale, mask=rows < M_OUT)


@triton.jit
def quantize_ptpc_split_kernel(x_ptr, q_ptr, s_ptr, M, M_OUT, K, K_PAD, stride_x, tiny, fp8_max,
                               ROW_BLOCK: tl.constexpr, SLICE_K: tl.constexpr, SKIP_ZEROS: tl.constexpr,
                               ROUND_IN_FP32: tl.constexpr, ZERO_WORDS: tl.constexpr = 0):
    """Per-token as :func:`quantize_ptpc_kernel` (the same bytes), each row split over programs:
    program ``(m, s)`` quantizes slice ``s`` of row ``m`` (:func:`quantize_row_slice`). So a
    decode-sized call (a few rows of up to 16384 columns) runs on ``M * K_PAD / SLICE_K`` SMs with
    one round trip to memory per load, instead of one program walking its rows twice in ``BLOCK_K``
    steps. ``ZERO_WORDS``: program (0, 0) also zeroes that many int32 words after the scales
    (:func:`zero_after_scales`)."""
    quantize_row_slice(x_ptr, q_ptr, s_ptr, tl.program_id(0), tl.program_id(1), M, M_OUT, K, K_PAD, stride_x, tiny,
                       fp8_max, ROW_BLOCK, SLICE_K, SKIP_ZEROS, ROUND_IN_FP32)
    zero_after_scales(s_ptr, M_OUT, ZERO_WORDS)


@triton.jit
def zero_after_scales(s_ptr, scales, ZERO_WORDS: tl.constexpr):
    """Program (0, 0) zeroes ``ZERO_WORDS`` (a power of two) int32 words after the ``scales`` fp32
    scales at ``s_ptr`` (16-byte aligned), from the next 16-byte boundary (``decode.MmaScratch``'s
    layout): the decode MMA's per-block counters, which its split programs count into after this
    launch (``decode_kernels._mma_rows``). So no launch of their own zeroes them, and a graph replay
    or another stream gets its own zeros with its own scratch."""
    if ZERO_WORDS > 0:
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            words = tl.arange(0, ZERO_WORDS)
            start = (s_ptr + (scales + 3) // 4 * 4).to(tl.pointer_type(tl.int32), bitcast=True)
            tl.store(start + words, tl.zeros_like(words))


@triton.jit
def quantize_row_slice(x_ptr, q_ptr, s_ptr, row, s, M, M_OUT, K, K_PAD, stride_x, tiny, fp8_max,
                       ROW_BLOCK: tl.constexpr, SLICE_K: tl.constexpr, SKIP_ZEROS: tl.constexpr,
                       ROUND_IN_FP32: tl.constexpr):
    """Columns ``[s * SLICE_K, (s + 1) * SLICE_K)`` of row ``row``, per-token: the amax of the whole
    row first (``ROW_BLOCK`` columns a load; a row's other slices read it again, from L2), then
    the slice divided by the row's scale, clamped and rounded; slice 0 stores the scale. Each value's
    bytes depend on its row's scale only, so any split of a row gives the bytes of
    :func:`quantize_ptpc_kernel`."""
    rows = (row + tl.arange(0, 1)).to(tl.int64)  # [1]: the shapes of quantize_ptpc_kernel
    cols = tl.arange(0, ROW_BLOCK)
    amax = tl.zeros((1,), dtype=tl.float32)
    for k0 in range(0, K, ROW_BLOCK):
        x = _load_rows(x_ptr, rows, k0 + cols, M, K, stride_x)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    scale = _div_rn(tl.maximum(amax, tiny), tl.zeros_like(amax) + fp8_max)
    mine = s * SLICE_K + tl.arange(0, SLICE_K)
    x = _load_rows(x_ptr, rows, mine, M, K, stride_x)
    q = tl.clamp(_div_rn(x, scale[:, None], SKIP_ZEROS), -fp8_max, fp8_max)
    mask = (rows[:, None] < M_OUT) & (mine[None, :] < K_PAD)
    tl.store(q_ptr + rows[:, None] * K_PAD + mine[None, :], _to_e4m3(q, ROUND_IN_FP32), mask=mask)
    if s == 0:
        tl.store(s_ptr + rows, scale, mask=rows < M_OUT)


@triton.jit
def quantize_groups_kernel(x_ptr, q_ptr, s_ptr, M, M_OUT, K, K_PAD, stride_x, tiny, fp8_max,
                           MX: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_K: tl.constexpr, SKIP_ZEROS: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
                           DEQUANTIZE: tl.constexpr = False, ZERO_WORDS: tl.constexpr = 0):
    """One scale per row and ``GROUP`` columns, one pass: a [BLOCK_M, BLOCK_K] tile seen as
    [BLOCK_M, BLOCK_K / GROUP, GROUP].

    blockscale (GROUP 128): fp32 ``max(amax, tiny) / fp8_max``, stored column-major ([M, K/128] with
    stride (1, M)), the layout the GEMM reads. mxfp8 (GROUP 32): the smallest power of two ``2**e``
    with ``amax / 2**e <= fp8_max``, ``e`` taken exactly from the bits of ``amax / fp8_max`` (no
    log2 approximation), stored as e8m0 bits ``e + 127`` row-major [M, K/32]; the values are
    multiplied by ``2**-e``, which is exact. Rows ``M <= m < M_OUT`` read as zeros.

    ``DEQUANTIZE`` (mxfp8): ``q_ptr`` takes bf16 ``[M_OUT, K_PAD]``, each e4m3 value times its
    group's ``2**(e8m0 - 127)`` as ``vendor.mx_to_bf16``'s kernel computes it from the stored bytes
    (the same bits), and no scale is stored: the rows a bf16 GEMM over the weight's bf16 copy reads
    (``kernels_fused.hopper.decode``), in one launch instead of the quantizer's and the
    dequantization's. ``ZERO_WORDS`` (blockscale): program (0, 0) also zeroes that many int32 words
    after the scales (:func:`zero_after_scales`)."""
    G: tl.constexpr = BLOCK_K // GROUP
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    k0 = tl.program_id(1) * BLOCK_K
    cols = k0 + tl.arange(0, BLOCK_K)
    x = tl.reshape(_load_rows(x_ptr, rows, cols, M, K, stride_x), (BLOCK_M, G, GROUP))
    amax = tl.max(tl.abs(x), axis=2)  # [BLOCK_M, G]
    ratio = _div_rn(tl.maximum(amax, tiny), tl.zeros_like(amax) + fp8_max)
    groups = k0 // GROUP + tl.arange(0, G)
    s_mask = (rows[:, None] < M_OUT) & (groups[None, :] < K_PAD // GROUP)
    if not MX:
        q = _div_rn(x, ratio[:, :, None], SKIP_ZEROS)
        tl.store(s_ptr + groups[None, :] * M_OUT + rows[:, None], ratio, mask=s_mask)
    else:
        bits = ratio.to(tl.int32, bitcast=True)
        # ceil(log2(ratio)) for a normal fp32 ratio (tiny / fp8_max keeps it normal)
        exp = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        inv = ((127 - exp) << 23).to(tl.float32, bitcast=True)  # 2**-exp
        q = x * inv[:, :, None]
        e8m0 = tl.minimum(tl.maximum(exp + 127, 0), 254).to(tl.uint8)
        if DEQUANTIZE:  # the group's power of two from its e8m0 byte, as mx_to_bf16_kernel reads it
            power = (e8m0.to(tl.int32) << 23).to(tl.float32, bitcast=True)
            q = _to_e4m3(tl.clamp(q, -fp8_max, fp8_max), ROUND_IN_FP32).to(tl.float32) * power[:, :, None]
        else:
            tl.store(s_ptr + rows[:, None] * (K_PAD // GROUP) + groups[None, :], e8m0, mask=s_mask)
    mask = (rows[:, None] < M_OUT) & (cols[None, :] < K_PAD)
    if DEQUANTIZE:
        tl.store(q_ptr + rows[:, None] * K_PAD + cols[None, :], tl.reshape(q, (BLOCK_M, BLOCK_K)).to(tl.bfloat16),
                 mask=mask)
    else:
        q = _to_e4m3(tl.reshape(tl.clamp(q, -fp8_max, fp8_max), (BLOCK_M, BLOCK_K)), ROUND_IN_FP32)
        tl.store(q_ptr + rows[:, None] * K_PAD + cols[None, :], q, mask=mask)
    if not MX:
        zero_after_scales(s_ptr, (K_PAD // GROUP) * M_OUT, ZERO_WORDS)
