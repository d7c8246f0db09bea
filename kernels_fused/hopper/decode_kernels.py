"""Device code of the decode GEMM (host side: ``kernels_fused.hopper.decode``).

One launch per call: each program quantizes one activation row itself (the bytes of the activation
quantizer, ``quantize_kernels``) and multiplies it by ``BLOCK_N`` rows of the fp8 weight, so at
decode sizes the call reads the weight in fp8 and the host issues one launch instead of the
quantizer's and the GEMM's. Imported only when the kernel runs, so ``import kernels_fused``
needs no triton.
"""

import triton
import triton.language as tl

from kernels_fused.hopper.quantize_kernels import _div_rn, _to_e4m3, quantize_row_slice

# (every division of an activation value here skips the zeros, _div_rn's SKIP_ZEROS: at decode
# sizes the padded rows and columns are many of the values read)


@triton.jit
def _to_bf16(v, ROUND_IN_FP32: tl.constexpr):
    """bf16 of fp32 ``v``, round to nearest even. Triton's CPU interpreter truncates: there
    (``ROUND_IN_FP32``) the rounding is done on the bits first (finite values)."""
    if ROUND_IN_FP32:
        bits = v.to(tl.int32, bitcast=True)
        v = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).to(tl.float32, bitcast=True)
    return v.to(tl.bfloat16)


@triton.jit
def decode_gemv_kernel(x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K, K_PAD, stride_x, stride_ws, tiny, fp8_max,
                       QUANT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr,
                       GS: tl.constexpr, ROW_K: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """``out[m, n] = bf16(dequant(quant(x))[m, :] @ dequant(w)[n, :]) (+ bias[n], rounded again)`` for
    the row ``m`` and the ``BLOCK_N`` features ``n`` of program ``(n block, m)``.

    ``x`` [M, K] any float (row stride ``stride_x``; columns ``K..K_PAD`` read as zeros, the weight's
    padding); ``w`` e4m3 [>= N, K_PAD] row-major; ``ws`` the weight's scales in ``cco.quant``'s layout
    (ptpc [N]; blockscale [N/128, K/128] with row stride ``stride_ws``; mxfp8 e8m0 bits [N, K/32]).
    A step reads ``G`` groups of ``GS`` columns (the format's scale group: blockscale 128, mxfp8 32;
    ptpc any): the row's ``[G, GS]`` and the weight's ``[BLOCK_N, G, GS]``, so every scale is a
    broadcast along the last axis and nothing is reshaped; ``G * GS`` divides ``K_PAD``. Blockscale:
    ``BLOCK_N`` divides 128 (a program's rows share their scale blocks).

    The row is quantized as ``kernels_fused.hopper.quantize`` quantizes it (ptpc: the row's amax
    over all of K first, ``ROW_K`` columns per load; the group formats per group, in the step that
    reads it; the same IEEE divisions and roundings) and dequantized as ``cco.quant.dequantize_a``
    does (e4m3 value times its scale, in fp32; blockscale folds the weight block's scale in too,
    ptpc applies both scales to the sum). CUDA-core FMAs in fp32 accumulate per lane across the
    steps, summed once at the end: at one row the weight's read is the cost, which tensor cores do
    not shorten."""
    row = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < N
    g_idx = tl.arange(0, G)
    k_in = g_idx[:, None] * GS + tl.arange(0, GS)[None, :]  # [G, GS]: a step's columns
    x_row = x_ptr + row * stride_x
    w_rows = w_ptr + cols.to(tl.int64)[:, None, None] * K_PAD + k_in[None, :, :]
    w_mask = n_ok[:, None, None]
    acc = tl.zeros((BLOCK_N, G, GS), dtype=tl.float32)
    if QUANT == 0:
        r = tl.arange(0, ROW_K)
        amax = tl.max(tl.abs(tl.load(x_row + r, mask=r < K, other=0.0).to(tl.float32)), axis=0)
        for k0 in range(ROW_K, K, ROW_K):
            v = tl.load(x_row + k0 + r, mask=k0 + r < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(v), axis=0))
        sa = tl.div_rn(tl.maximum(amax, tiny), fp8_max)
    for k0 in range(0, K_PAD, G * GS):
        x = tl.load(x_row + k0 + k_in, mask=k0 + k_in < K, other=0.0).to(tl.float32)  # [G, GS]
        if QUANT == 0:
            a = _to_e4m3(tl.clamp(_div_rn(x, sa, True), -fp8_max, fp8_max), ROUND_IN_FP32).to(tl.float32)
        elif QUANT == 1:
            s_g = _div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), tiny), tl.zeros((G,), dtype=tl.float32) + fp8_max)
            q = _to_e4m3(tl.clamp(_div_rn(x, s_g[:, None], True), -fp8_max, fp8_max), ROUND_IN_FP32).to(tl.float32)
            sb = tl.load(ws_ptr + (tl.program_id(0) * BLOCK_N // 128) * stride_ws + k0 // 128 + g_idx)
            a = q * s_g[:, None] * sb[:, None]
        else:
            ratio = _div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), tiny), tl.zeros((G,), dtype=tl.float32) + fp8_max)
            bits = ratio.to(tl.int32, bitcast=True)
            exp = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # ceil(log2(ratio))
            inv = ((127 - exp) << 23).to(tl.float32, bitcast=True)  # 2**-exp, exact
            up = ((127 + exp) << 23).to(tl.float32, bitcast=True)  # 2**exp: the dequantized value, exact
            q = _to_e4m3(tl.clamp(x * inv[:, None], -fp8_max, fp8_max), ROUND_IN_FP32).to(tl.float32)
            a = q * up[:, None]
        w = tl.load(w_rows + k0, mask=w_mask, other=0.0).to(tl.float32)  # [BLOCK_N, G, GS]
        if QUANT == 2:  # the weight's own e8m0 exponents, per feature and group: 2**(e - 127)
            e_w = tl.load(ws_ptr + cols[:, None] * (K_PAD // 32) + (k0 // 32 + g_idx)[None, :], mask=n_ok[:, None],
                          other=127).to(tl.int32)
            w = w * (e_w << 23).to(tl.float32, bitcast=True)[:, :, None]
        acc += w * a[None, :, :]
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    if QUANT == 0:
        out = out * sa * tl.load(ws_ptr + cols, mask=n_ok, other=0.0)
    out = _to_bf16(out, ROUND_IN_FP32)
    if HAS_BIAS:  # the layer's ``out += bias`` on the rounded product: rounded again
        out = _to_bf16(out.to(tl.float32) + tl.load(bias_ptr + cols, mask=n_ok, other=0.0).to(tl.float32),
                       ROUND_IN_FP32)
    tl.store(out_ptr + row * N + cols, out, mask=n_ok)


@triton.jit
def _rows16(v, ROWS: tl.constexpr):
    """``v`` [ROWS, ...] (ROWS a power of two <= 16) as [16, ...]: row j is v's row j % ROWS, so the
    MMA's 16 columns hold the real rows first and repeats after (never stored)."""
    if ROWS == 16:
        return v
    return tl.reshape(tl.broadcast_to(v[None, :, :], (16 // ROWS, ROWS, v.shape[1])), (16, v.shape[1]))


@triton.jit
def _rows16_1d(v, ROWS: tl.constexpr):
    """``_rows16`` of a [ROWS] vector."""
    if ROWS == 16:
        return v
    return tl.reshape(tl.broadcast_to(v[None, :], (16 // ROWS, ROWS)), (16,))


@triton.jit
def _mma_bf16(v, ROUND_IN_FP32: tl.constexpr):
    """fp32 ``v`` whose values bf16 holds exactly, as the MMA's bf16 operand. Triton's CPU interpreter
    multiplies bf16 tensors wrongly: there (``ROUND_IN_FP32``) the same values stay fp32."""
    if ROUND_IN_FP32:
        return v
    return v.to(tl.bfloat16)


@triton.jit
def decode_rows_kernel(x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K, K_PAD, stride_x, stride_ws, tiny, fp8_max,
                       QUANT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       ROWS: tl.constexpr, ROW_K: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """``decode_gemv_kernel``'s product for 2..16 rows: program ``n block`` takes every row (``M <=
    ROWS``, a power of two) and ``BLOCK_N`` weight rows, so the weight is read once for all of them.
    A step quantizes the rows' ``[ROWS, BLOCK_K]`` columns (the quantizer's bytes, as the one-row
    kernel does: ptpc's row amax over all of K first) and multiplies on tensor cores with the weight
    as the MMA's M side (``w [BLOCK_N, BLOCK_K] @ q.T [BLOCK_K, 16]``; the rows repeated to the MMA's
    least width of 16, ``_rows16``): ptpc an e4m3 MMA, both scales applied to the sum; blockscale
    (``BLOCK_K`` = 128, one scale group a step) an e4m3 MMA per step scaled by the row's and the
    weight block's scale; mxfp8 a bf16 MMA of both operands dequantized (e4m3 times a power of two:
    exact in bf16). Rounding of the output and the bias as ``decode_gemv_kernel``'s."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < N
    rows = tl.arange(0, ROWS)
    r_ok = rows < M
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K_PAD + kk[None, :]
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    if QUANT == 0:
        r = tl.arange(0, ROW_K)
        amax = tl.zeros((ROWS,), dtype=tl.float32)
        for k0 in range(0, K, ROW_K):
            v = tl.load(x_rows + k0 + r[None, :], mask=r_ok[:, None] & (k0 + r < K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(v.to(tl.float32)), axis=1))
        sa = tl.div_rn(tl.maximum(amax, tiny), tl.zeros((ROWS,), dtype=tl.float32) + fp8_max)
    for k0 in range(0, K_PAD, BLOCK_K):
        x = tl.load(x_rows + k0 + kk[None, :], mask=r_ok[:, None] & (k0 + kk < K)[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_rows + k0, mask=n_ok[:, None], other=0.0)  # e4m3 [BLOCK_N, BLOCK_K]
        if QUANT == 0:
            q = _to_e4m3(tl.clamp(_div_rn(x, sa[:, None], True), -fp8_max, fp8_max), ROUND_IN_FP32)
            acc = tl.dot(w, tl.trans(_rows16(q, ROWS)), acc)
        elif QUANT == 1:
            s_g = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), tiny), tl.zeros((ROWS,), dtype=tl.float32) + fp8_max)
            q = _to_e4m3(tl.clamp(_div_rn(x, s_g[:, None], True), -fp8_max, fp8_max), ROUND_IN_FP32)
            sb = tl.load(ws_ptr + (tl.program_id(0) * BLOCK_N // 128) * stride_ws + k0 // 128)
            acc += tl.dot(w, tl.trans(_rows16(q, ROWS))) * (_rows16_1d(s_g, ROWS) * sb)[None, :]
        else:
            x3 = tl.reshape(x, (ROWS, BLOCK_K // 32, 32))
            ratio = _div_rn(tl.maximum(tl.max(tl.abs(x3), axis=2), tiny), tl.zeros((ROWS, BLOCK_K // 32), dtype=tl.float32)
                            + fp8_max)
            bits = ratio.to(tl.int32, bitcast=True)
            exp = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # ceil(log2(ratio))
            inv = ((127 - exp) << 23).to(tl.float32, bitcast=True)  # 2**-exp, exact
            up = ((127 + exp) << 23).to(tl.float32, bitcast=True)  # 2**exp: the dequantized value, exact
            q = _to_e4m3(tl.clamp(x3 * inv[:, :, None], -fp8_max, fp8_max), ROUND_IN_FP32).to(tl.float32)
            a = _mma_bf16(tl.reshape(q * up[:, :, None], (ROWS, BLOCK_K)), ROUND_IN_FP32)
            e_w = tl.load(ws_ptr + cols[:, None] * (K_PAD // 32) + (k0 // 32 + tl.arange(0, BLOCK_K // 32))[None, :],
                          mask=n_ok[:, None], other=127).to(tl.int32)
            w3 = tl.reshape(w.to(tl.float32), (BLOCK_N, BLOCK_K // 32, 32)) * (e_w << 23).to(tl.float32,
                                                                                              bitcast=True)[:, :, None]
            acc = tl.dot(_mma_bf16(tl.reshape(w3, (BLOCK_N, BLOCK_K)), ROUND_IN_FP32), tl.trans(_rows16(a, ROWS)), acc)
    if QUANT == 0:
        acc = acc * _rows16_1d(sa, ROWS)[None, :] * tl.load(ws_ptr + cols, mask=n_ok, other=0.0)[:, None]
    out = _to_bf16(acc, ROUND_IN_FP32)
    if HAS_BIAS:
        out = _to_bf16(out.to(tl.float32) + tl.load(bias_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)[:, None],
                       ROUND_IN_FP32)
    j = tl.arange(0, 16)
    tl.store(out_ptr + j[None, :].to(tl.int64) * N + cols[:, None], out, mask=n_ok[:, None] & (j < M)[None, :])


@triton.jit
def decode_mma_rows_kernel(q_ptr, sa_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, cnt_ptr, part_ptr, M, N, K_PAD, K_SLICE,
                           stride_sa, stride_ws, QUANT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr,
                           ROUND_IN_FP32: tl.constexpr):
    """The product of 2..64 rows already quantized (the activation quantizer's e4m3 ``q [M, K_PAD]``
    and scales ``sa``: ptpc fp32 ``[M]``, blockscale fp32 ``[K_PAD / 128, M]`` with group stride
    ``stride_sa``): program ``(n block, s)`` takes ``BLOCK_N`` weight rows and slice ``s`` of
    ``SPLIT`` slices of K (:func:`_mma_rows`). Quantizing in every program instead
    (``decode_rows_kernel``) costs more than the weight's read from 4 rows on."""
    _mma_rows(q_ptr, sa_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, cnt_ptr, part_ptr, tl.program_id(0), tl.program_id(1),
              M, N, K_PAD, K_SLICE, stride_sa, stride_ws, QUANT, HAS_BIAS, BLOCK_N, BLOCK_K, ROWS, SPLIT,
              ROUND_IN_FP32)


@triton.jit
def _mma_rows(q_ptr, sa_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, cnt_ptr, part_ptr, block, s, M, N, K_PAD, K_SLICE,
              stride_sa, stride_ws, QUANT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """Weight rows ``[block * BLOCK_N, (block + 1) * BLOCK_N)`` over K columns ``[s * K_SLICE, (s + 1)
    * K_SLICE)``, read once and multiplied by every quantized row on tensor cores, the weight as the
    MMA's M side (``w [BLOCK_N, BLOCK_K] @ q.T [BLOCK_K, ROWS]``, ROWS a power of two >= M and >=
    16, the MMA's least width; rows past M read as zeros). ptpc (QUANT 0): one e4m3 MMA chain, both
    scales applied to the sum. blockscale (QUANT 1): a step's ``BLOCK_K / 128`` scale groups each
    its own MMA, scaled by the rows' and the weight block's scales (``BLOCK_N`` divides 128).

    ``SPLIT`` > 1 (a weight of few ``BLOCK_N`` blocks, which would leave most SMs idle): each
    program stores its fp32 partial to ``part`` (``SPLIT`` per n block), then counts itself in on
    the n block's int32 ``cnt`` (zero before the call); the last to arrive sums the partials in
    slice order, so the bits do not depend on which program came last, finishes as an unsplit
    program does, and sets the count back to zero: a caller that keeps its counters
    (``decode.RowsMma``) launches no zeroing before each call, one launch less an eager call (the
    next launch on the stream starts after this one has ended; the decode path's quantizer still
    zeroes its own scratch, which is new each call)."""
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < N
    rows = tl.arange(0, ROWS)
    r_ok = rows < M
    acc = _mma_partial(q_ptr, sa_ptr, w_ptr, ws_ptr, block, s, K_SLICE, M, N, K_PAD, stride_sa, stride_ws, QUANT,
                       BLOCK_N, BLOCK_K, ROWS)
    if SPLIT == 1:
        _finish_rows(acc, sa_ptr, ws_ptr, bias_ptr, out_ptr, cols, n_ok, rows, r_ok, N, QUANT, HAS_BIAS,
                     ROUND_IN_FP32)
    else:
        tile = tl.arange(0, BLOCK_N)[:, None] * ROWS + rows[None, :]
        parts = part_ptr + block.to(tl.int64) * (SPLIT * BLOCK_N * ROWS)
        tl.store(parts + s * (BLOCK_N * ROWS) + tile, acc)
        tl.debug_barrier()  # every thread's partial stored before the count
        if tl.atomic_add(cnt_ptr + block, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            total = tl.load(parts + tile, cache_modifier=".cg")  # (L2: the other SMs' stores)
            for j in tl.static_range(1, SPLIT):
                total += tl.load(parts + j * (BLOCK_N * ROWS) + tile, cache_modifier=".cg")
            _finish_rows(total, sa_ptr, ws_ptr, bias_ptr, out_ptr, cols, n_ok, rows, r_ok, N, QUANT, HAS_BIAS,
                         ROUND_IN_FP32)
            tl.atomic_xchg(cnt_ptr + block, 0, sem="relaxed", scope="gpu")  # every slice has arrived: no one
            # counts on this block again in this launch


@triton.jit
def _mma_partial(q_ptr, sa_ptr, w_ptr, ws_ptr, block, s, K_SLICE, M, N, K_PAD, stride_sa, stride_ws,
                 QUANT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """The fp32 ``[BLOCK_N, ROWS]`` sum over slice ``s`` of K (columns ``[s * K_SLICE, (s + 1) *
    K_SLICE)`` within ``K_PAD``) of weight block ``block`` times the quantized rows, from zero, in
    ``BLOCK_K`` steps (ptpc: unscaled; blockscale: each group scaled): one program of
    :func:`_mma_rows`. The one launch sums its program's slices with it in the split MMA's order, so
    an eager call and a captured one give the same bits."""
    k_lo = s * K_SLICE
    k_hi = tl.minimum(k_lo + K_SLICE, K_PAD)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < N
    rows = tl.arange(0, ROWS)
    r_ok = rows < M
    acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    kk = tl.arange(0, BLOCK_K if QUANT == 0 else 128)  # a tile's columns: ptpc's step, blockscale's scale group
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K_PAD + kk[None, :]
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * K_PAD + kk[None, :]
    if QUANT == 0:
        for k0 in range(k_lo, k_hi, BLOCK_K):
            w = tl.load(w_rows + k0, mask=n_ok[:, None], other=0.0)
            q = tl.load(q_rows + k0, mask=r_ok[:, None], other=0.0)
            acc = tl.dot(w, tl.trans(q), acc)
    else:
        ws_row = ws_ptr + (block * BLOCK_N // 128) * stride_ws
        for k0 in range(k_lo, k_hi, BLOCK_K):
            for j in tl.static_range(BLOCK_K // 128):  # the step's groups: BLOCK_K / 128 tiles in flight
                kb = k0 + j * 128
                w = tl.load(w_rows + kb, mask=n_ok[:, None], other=0.0)
                q = tl.load(q_rows + kb, mask=r_ok[:, None], other=0.0)
                sa = tl.load(sa_ptr + (kb // 128) * stride_sa + rows, mask=r_ok, other=0.0)
                acc += tl.dot(w, tl.trans(q)) * (sa * tl.load(ws_row + kb // 128))[None, :]
    return acc


@triton.jit
def _finish_rows(acc, sa_ptr, ws_ptr, bias_ptr, out_ptr, cols, n_ok, rows, r_ok, N, QUANT: tl.constexpr,
                 HAS_BIAS: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """``acc [BLOCK_N, ROWS]`` (ptpc: both scales still to apply) rounded to bf16, the bias added to
    the rounded product and rounded again, as ``decode_gemv_kernel`` does; rows past M not stored."""
    if QUANT == 0:
        acc = acc * tl.load(sa_ptr + rows, mask=r_ok, other=0.0)[None, :] * tl.load(ws_ptr + cols, mask=n_ok,
                                                                                    other=0.0)[:, None]
    out = _to_bf16(acc, ROUND_IN_FP32)
    if HAS_BIAS:
        out = _to_bf16(out.to(tl.float32) + tl.load(bias_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)[:, None],
                       ROUND_IN_FP32)
    tl.store(out_ptr + rows[None, :].to(tl.int64) * N + cols[:, None], out, mask=n_ok[:, None] & r_ok[None, :])


@triton.jit
def decode_ptpc_kernel(x_ptr, q_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, sync_ptr, M, N, K, K_PAD, stride_x, tiny,
                       fp8_max, SLICES, K_SLICE, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       ROWS: tl.constexpr, ROW_BLOCK: tl.constexpr, SLICE_K: tl.constexpr, PHASES: tl.constexpr,
                       ROUND_IN_FP32: tl.constexpr, SPLIT: tl.constexpr):
    """ptpc's 2..64 rows in one launch: the quantizer's split-row launch and the MMA over its rows
    (``decode_mma_rows_kernel``) as two phases of one grid of ``N / BLOCK_N`` programs, with a
    grid-wide wait between them.

    Phase 1 spreads the quantizer's ``M * SLICES`` items (row, ``SLICE_K`` columns:
    ``quantize_row_slice``, its bytes) over the programs and writes the e4m3 rows to ``q [M, K_PAD]``,
    their fp32 scales right after them (``q_ptr + M * K_PAD``, 4-byte aligned: K_PAD is a multiple of
    128), so the call allocates one scratch. Phase 2 is program ``n block``'s MMA (``_mma_partial``
    per slice, then ``_finish_rows``), which reads every program's rows, summed as the captured MMA (``decode_mma_rows_kernel``) sums
    them: ``SPLIT`` slices of ``K_SLICE`` columns, each from zero, added in slice order (one program
    does them all here), so an eager call gives a captured call's bits. Between them every program waits for all
    (:func:`_grid_wait`): the grid must be resident at once, so the host launches it cooperatively
    (at most one program per SM) and only where the grid fits. ``PHASES``: 3 both phases and the
    wait; 1 or 2 one phase alone (two launches: what a test runs under Triton's CPU interpreter,
    which runs programs one after another, so that a wait with more than one program never ends);
    0 both phases without the wait, the race the wait prevents (``test_cuda_nn`` shows it reads rows
    not yet written)."""
    sa_ptr = (q_ptr + M * K_PAD).to(tl.pointer_type(tl.float32), bitcast=True)
    if PHASES != 2:  # 0, 1, 3
        gen = tl.atomic_add(sync_ptr + 1, 0, sem="relaxed", scope="gpu")  # this call's generation, read before arriving
        for item in range(tl.program_id(0), M * SLICES, tl.num_programs(0)):
            quantize_row_slice(x_ptr, q_ptr, sa_ptr, item // SLICES, item % SLICES, M, M, K, K_PAD, stride_x, tiny,
                               fp8_max, ROW_BLOCK, SLICE_K, True, ROUND_IN_FP32)
        if PHASES == 3:
            _grid_wait(sync_ptr, gen)
    if PHASES != 1:
        block = tl.program_id(0)
        total = _mma_partial(q_ptr, sa_ptr, w_ptr, ws_ptr, block, 0, K_SLICE, M, N, K_PAD, 0, 0, 0, BLOCK_N, BLOCK_K,
                             ROWS)
        for j in tl.static_range(1, SPLIT):
            total += _mma_partial(q_ptr, sa_ptr, w_ptr, ws_ptr, block, j, K_SLICE, M, N, K_PAD, 0, 0, 0, BLOCK_N,
                                  BLOCK_K, ROWS)
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, ROWS)
        _finish_rows(total, sa_ptr, ws_ptr, bias_ptr, out_ptr, cols, cols < N, rows, rows < M, N, 0, HAS_BIAS,
                     ROUND_IN_FP32)


@triton.jit
def _grid_wait(sync_ptr, gen):
    """Return once every program of the grid has called this (a sense-reversing barrier on
    ``sync [count, generation]``, int32, zero before the first call): each program counts itself in;
    the last resets the count for the next call on this buffer and advances the generation; every
    program waits for the generation to pass ``gen`` (read at its start, before any program could have
    advanced it). The count's acquire-release chain carries every program's stores to the last one,
    and its release of the generation to every waiter's acquire; ``debug_barrier`` (the program's
    threads) puts all its threads' stores before its count, and its waiting before any thread's next
    load. Calls that share a buffer must not overlap (the host keeps one per stream)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_add(sync_ptr + 1, 1, sem="release", scope="gpu")
    seen = gen
    while seen == gen:
        seen = tl.atomic_add(sync_ptr + 1, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
