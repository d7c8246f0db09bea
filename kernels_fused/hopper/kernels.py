"""Device code of the NVIDIA Triton GEMM (host side and formats: ``kernels_fused.hopper.gemm``).

``_tile_acc`` is the K loop every launch shares; ``fp8_gemm_ws_kernel`` is the plain GEMM (persistent,
warp-specialized), ``fp8_gemm_rows_ws_kernel`` the same walk as the reduce-scatter along rows'
producer; ``fp8_gemm_kernel`` writes a plain tensor or (the ``dma`` transport) the window's
partial region with a release add per tile; ``fp8_gemm_lsa_kernel`` is the persistent kernel of the
``lsa`` transport, whose epilogue scatters, reduces and gathers; ``mx_to_bf16_kernel`` dequantizes an
mxfp8 operand for them.
Imported only when a kernel is launched, so ``import kernels_fused`` needs no triton.
"""

import triton
import triton.language as tl


@triton.jit
def _tile_acc(
    a_src, b_src, as_ptr, bs_ptr, m0, n0, M, N, K, stride_am, stride_bn,
    stride_asm, stride_ask, stride_bsn, stride_bsk,
    QUANT: tl.constexpr, USE_TMA: tl.constexpr, MX_BF16: tl.constexpr, PRECISE_ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
):
    """The fp32 tile C[m0:m0+BLOCK_M, n0:n0+BLOCK_N], every scale applied: the K loop every
    launch shares."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # clamp instead of masking: rows past M / N only feed stores that are masked
    rows_a = tl.where(offs_m < M, offs_m, 0)
    rows_b = tl.where(offs_n < N, offs_n, 0)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = kb * BLOCK_K
        if USE_TMA:
            a = a_src.load([m0, k0])  # [BLOCK_M, BLOCK_K], rows past M read as zeros
            b = b_src.load([n0, k0])  # [BLOCK_N, BLOCK_K], K-major as fp8 wgmma wants
        else:
            a = tl.load(a_src + rows_a[:, None] * stride_am + (k0 + offs_k)[None, :])
            b = tl.load(b_src + rows_b[:, None] * stride_bn + (k0 + offs_k)[None, :])
        if QUANT == 0:
            if PRECISE_ACC:  # promote the MMA chain into fp32 once per K step (slower, see GemmConfig)
                acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
            else:
                acc = tl.dot(a, tl.trans(b), acc)
        elif QUANT == 1:
            sa = tl.load(as_ptr + rows_a * stride_asm + kb * stride_ask)
            sb = tl.load(bs_ptr + (rows_b // SCALE_BLOCK) * stride_bsn + kb * stride_bsk)
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
        elif MX_BF16:  # mxfp8: the operands arrive dequantized to bf16 (gemm._operands)
            acc = tl.dot(a, tl.trans(b), acc)
        else:  # Triton's CPU interpreter multiplies bf16 tiles as raw integers: fp32 there
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")

    if QUANT == 0:
        sa = tl.load(as_ptr + rows_a * stride_asm)
        sb = tl.load(bs_ptr + rows_b * stride_bsn)
        acc = acc * (sa[:, None] * sb[None, :])
    return acc

@triton.jit
def _grouped_tile(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Origin (m0, n0) of output tile ``tile`` in grouped order: GROUP_M tile rows walked column by
    column, so consecutive tiles share B tiles in L2."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (tile // per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    return (first_m + (tile % per_group) % rows_in_group) * BLOCK_M, ((tile % per_group) // rows_in_group) * BLOCK_N


@triton.jit
def _claim(ticket_ptr, n_tiles):
    """The next entry of a walk of ``n_tiles`` from a ticket counter; the last claimant resets the
    counter for the next launch."""
    t = tl.atomic_add(ticket_ptr, 1)
    if t == n_tiles - 1:
        tl.atomic_xchg(ticket_ptr, 0)
    return t


@triton.jit
def _bf16_halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile's left and right column halves in bf16: a TMA store of each stages half the tile
    (the shared memory that leaves the warp-specialized launches a fourth pipeline stage)."""
    left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
    return left.to(tl.bfloat16), right.to(tl.bfloat16)


@triton.jit
def fp8_gemm_ws_kernel(
    a_src, b_src, c_desc, as_ptr, bs_ptr, M, N, K, stride_asm, stride_ask, stride_bsn, stride_bsk,
    QUANT: tl.constexpr, MX_BF16: tl.constexpr, PRECISE_ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SCALE_BLOCK: tl.constexpr, NUM_PROGS: tl.constexpr,
):
    """The plain GEMM (``launch="ws"``): NUM_PROGS persistent programs stride the grouped tile
    order; Triton splits the tile loop into a producer warp group issuing the TMA loads and consumer
    warp groups running the MMAs and the epilogue, so the next tile's loads overlap this tile's
    epilogue. The tile leaves through a TMA store in two halves (half the staging shared memory,
    which leaves room for a fourth pipeline stage)."""
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, NUM_PROGS, flatten=True, warp_specialize=True):
        m0, n0 = _grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = _tile_acc(a_src, b_src, as_ptr, bs_ptr, m0, n0, M, N, K, 0, 0,
                        stride_asm, stride_ask, stride_bsn, stride_bsk, QUANT, True, MX_BF16, PRECISE_ACC,
                        BLOCK_M, BLOCK_N, BLOCK_K, SCALE_BLOCK)
        left, right = _bf16_halves(acc, BLOCK_M, BLOCK_N)
        c_desc.store([m0, n0], left)
        c_desc.store([m0, n0 + BLOCK_N // 2], right)


@triton.jit
def _bulk_writes_done(x, INTERPRET: tl.constexpr):
    """``x``, once every thread's bulk (TMA) stores have written global memory: each thread's full
    ``cp.async.bulk.wait_group 0`` (the ``.read`` form only waits until the staging is read), then
    a barrier of the block, since a tile's store is issued by one elected thread per storing warp
    (two with Triton 3.6) and the release add by another. The barrier sits in the asm because a
    ``tl.debug_barrier`` in the persistent loop stops Triton from pipelining it (one stage); so
    the loop must run on every thread of the block, which ``kernels_fused.hopper.ptx`` checks (no
    warp-specialized partitions). (The interpreter's stores are synchronous.)"""
    if INTERPRET:
        return x
    return tl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tbar.sync 0;\n\tmov.u32 $0, $1;", "=r,r", [x],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _release_held(counter_ptr, held, TILE_WEIGHT: tl.constexpr, INTERPRET: tl.constexpr):
    """RELEASE_LAG's release of the tile whose counter word is ``held`` (-1: none), once every
    store issued before it has been written (``_bulk_writes_done``)."""
    word = _bulk_writes_done(held, INTERPRET)
    tl.atomic_add(counter_ptr + word, TILE_WEIGHT, mask=word >= 0, sem="release", scope="gpu")


@triton.jit
def fp8_gemm_rows_ws_kernel(
    a_src, b_src, c_desc, as_ptr, bs_ptr, chunk_ptr, counter_ptr, M, N, K, rank, slice_rows, tiles_m,
    stride_asm, stride_ask, stride_bsn, stride_bsk,
    QUANT: tl.constexpr, MX_BF16: tl.constexpr, PRECISE_ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    WORLD: tl.constexpr, MAX_CHUNKS: tl.constexpr, TILE_WEIGHT: tl.constexpr, NUM_PROGS: tl.constexpr,
    INTERPRET: tl.constexpr, RELEASE_LAG: tl.constexpr,
):
    """The reduce-scatter along rows' fused producer as the plain GEMM's persistent
    warp-specialized walk (``launch="ws"``): ``partial[dest][row] = (A @ B.T)[dest * slice_rows +
    row]`` for every dest, each tile released by an add of ``TILE_WEIGHT`` to
    ``counters[dest, chunk]``. The walk is the dest-major tile table's (``cco.layout.tile_table``):
    every peer's slice in ``dest_order`` and the own one last, within a slice the m-tiles in order
    (a chunk is a run of them: ``chunk_ptr[m-tile]``), within an m-tile the n-tiles; so tile ``t``'s
    coordinates are computed, not loaded. ``c_desc`` addresses the planes' first ``slice_rows``
    rows ``[W, slice_rows, N]``, so the TMA store clips a slice's last m-tile at its end.

    The release follows the tile's TMA stores: every thread waits for its own stores' writes, then
    the block meets at a barrier, then one thread adds (``_bulk_writes_done``;
    ``kernels_fused.hopper.ptx`` checks that order in the compiled PTX). Triton 3.6 issues the
    store from two threads and the add from a third, with no barrier of its own between them.

    RELEASE_LAG: a tile is released one tile late, once the program's next tile has been computed
    and before that tile's stores (the last tile after the loop). The same wait then finds the
    writes done, since they had the next tile's main loop to land, where without the lag the
    loop stalls on each tile's writes (Triton 3.6 leaves them in flight: its stores wait only for
    their staging to be read). A chunk's counter reaches its target up to one tile's main loop
    later. Every release still follows a full wait for every store issued before it."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_dest = tiles_m * tiles_n
    held = -1  # RELEASE_LAG: the counter word of the program's last stored tile, not yet released (-1: none)
    for tile in tl.range(tl.program_id(0), WORLD * per_dest, NUM_PROGS, flatten=True, warp_specialize=True):
        j = tile // per_dest
        r = tile - j * per_dest
        dest = (j + 1 + rank) % WORLD
        mt = r // tiles_n
        m0 = mt * BLOCK_M
        n0 = (r - mt * tiles_n) * BLOCK_N
        acc = _tile_acc(a_src, b_src, as_ptr, bs_ptr, dest * slice_rows + m0, n0, M, N, K, 0, 0,
                        stride_asm, stride_ask, stride_bsn, stride_bsk, QUANT, True, MX_BF16, PRECISE_ACC,
                        BLOCK_M, BLOCK_N, BLOCK_K, SCALE_BLOCK)
        left, right = _bf16_halves(acc, BLOCK_M, BLOCK_N)
        if RELEASE_LAG:  # the previous tile's writes, issued a main loop ago: released before this one's
            _release_held(counter_ptr, held, TILE_WEIGHT, INTERPRET)
        c_desc.store([dest, m0, n0], tl.reshape(left, (1, BLOCK_M, BLOCK_N // 2)))
        c_desc.store([dest, m0, n0 + BLOCK_N // 2], tl.reshape(right, (1, BLOCK_M, BLOCK_N // 2)))
        if RELEASE_LAG:
            held = dest * MAX_CHUNKS + tl.load(chunk_ptr + mt)
        else:
            chunk = _bulk_writes_done(tl.load(chunk_ptr + mt), INTERPRET)
            tl.atomic_add(counter_ptr + dest * MAX_CHUNKS + chunk, TILE_WEIGHT, sem="release", scope="gpu")
    if RELEASE_LAG:  # the program's last tile
        _release_held(counter_ptr, held, TILE_WEIGHT, INTERPRET)


@triton.jit
def fp8_gemm_kernel(
    # operands (TMA descriptors or raw pointers, see USE_TMA) ------------------------------------
    a_src, b_src, c_ptr, as_ptr, bs_ptr,
    # fused epilogue -----------------------------------------------------------------------------
    tile_ptr, counter_ptr,
    # own tiles reduced in the epilogue (REDUCE) -------------------------------------------------
    ticket_ptr, n_tiles, recv_ptr, gather_ptr, gscale_ptr, out_ptr, flag_ptr, scatter_m_ptr, stamp_ptr,
    status_ptr, rank, stride_out, scale_plane,
    # shape and strides -------------------------------------------------------------------------
    M, N, K, stride_am, stride_bn, stride_cm, n_slice, dest_stride, row_step, col_step, rows_out,
    stride_asm, stride_ask, stride_bsn, stride_bsk,
    # compile-time -------------------------------------------------------------------------------
    QUANT: tl.constexpr, FUSE: tl.constexpr, REDUCE: tl.constexpr, USE_TMA: tl.constexpr, MX_BF16: tl.constexpr,
    PRECISE_ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SCALE_BLOCK: tl.constexpr, MAX_CHUNKS: tl.constexpr, TILE_WEIGHT: tl.constexpr,
    WORLD: tl.constexpr, FP8_GATHER: tl.constexpr, GATHER_GROUP: tl.constexpr, EPILOGUE_PIECES: tl.constexpr,
):
    """FUSE: program t computes entry t of the tile table and stores it into ``partial[dest]``, or
    with REDUCE an own tile (dest = rank) is reduced here: it waits for every source's chunk in
    ``recv`` (``scatter_flags[src, chunk]``, set by the source's copy engine), adds it and writes
    ``out`` and ``gather[rank]``. Then the counter add releases the tile. REDUCE claims entries from
    a ticket counter (the last claimant resets it), so a waiting program knows every earlier entry is
    held by a running one; peer tiles never wait, and every rank's peer tiles of a chunk precede its
    own tiles of that chunk, so the waits always end.

    FUSE: a slice's origin in the product is ``(dest * row_step, dest * col_step)``: column slices
    (the all-reduce, the reduce-scatter along columns: ``row_step`` 0, ``col_step`` N/W) or row
    slices (the reduce-scatter along rows: ``row_step`` M/W, ``col_step`` 0), and a tile's rows
    within its slice stop at ``rows_out`` (M, or the slice's M/W rows: the last m-tile of a slice
    must not store the next slice's rows)."""
    pid = tl.program_id(0)
    if REDUCE:
        pid = _claim(ticket_ptr, n_tiles)
    if FUSE:
        # one row of the layout's tile table: (chunk, dest, row0, col0 within dest's slice)
        chunk = tl.load(tile_ptr + pid * 4)
        dest = tl.load(tile_ptr + pid * 4 + 1)
        # the hints keep the tile's stores vectorized (table entries are whole tiles)
        m0 = tl.multiple_of(tl.load(tile_ptr + pid * 4 + 2), BLOCK_M)
        c0 = tl.multiple_of(tl.load(tile_ptr + pid * 4 + 3), BLOCK_N)
        a_m0 = dest * row_step + m0  # the tile's first row of A
        n0 = dest * col_step + c0
        c_ptr += dest.to(tl.int64) * dest_stride  # partial[dest] is [rows, n_slice]
    else:
        m0, n0 = _grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        c0 = n0
        a_m0 = m0
    acc = _tile_acc(a_src, b_src, as_ptr, bs_ptr, a_m0, n0, M, N, K, stride_am, stride_bn,
                    stride_asm, stride_ask, stride_bsn, stride_bsk, QUANT, USE_TMA, MX_BF16, PRECISE_ACC,
                    BLOCK_M, BLOCK_N, BLOCK_K, SCALE_BLOCK)
    offs_m = m0 + tl.arange(0, BLOCK_M)  # within the slice (FUSE), else of the product
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_c = c0 + tl.arange(0, BLOCK_N)
    mask = (offs_m < rows_out)[:, None] & (offs_n < N)[None, :]
    local = offs_m[:, None].to(tl.int64) * stride_cm + offs_c[None, :]  # in a [rows, n_slice] plane (FUSE)
    if REDUCE:
        if dest == rank:
            _reduce_own_tile(acc, chunk, M, offs_m, c0, recv_ptr, gather_ptr, gscale_ptr, out_ptr, flag_ptr,
                             scatter_m_ptr, stamp_ptr, status_ptr, rank, n_slice, dest_stride, stride_out, scale_plane,
                             WORLD, FP8_GATHER, GATHER_GROUP, BLOCK_M, BLOCK_N, MAX_CHUNKS, EPILOGUE_PIECES)
        else:
            tl.store(c_ptr + local, acc.to(tl.bfloat16), mask=mask)
    else:  # (a branch of its own: Triton compiles a runtime if's both sides)
        tl.store(c_ptr + local, acc.to(tl.bfloat16), mask=mask)
    if FUSE:
        tl.debug_barrier()  # every thread's tile stores are issued before the release below
        tl.atomic_add(counter_ptr + dest * MAX_CHUNKS + chunk, TILE_WEIGHT, sem="release", scope="gpu")

@triton.jit
def _peer(ptr, delta_ptr, peer):
    """``ptr``'s counterpart in ``peer``'s window: ``delta[peer]`` bytes away, a multiple of 256
    (the hint keeps stores into it vectorized; ``LsaWindow`` checks the alignment)."""
    ELEM: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
    return ptr + tl.multiple_of(tl.load(delta_ptr + peer) // ELEM, 256 // ELEM)


@triton.jit
def _consume_flag(flag, stamp, status_ptr, src):
    """Wait until ``flag`` is set, zero it (it has one reader: graph replays stay valid) and record
    a source whose stamp names another call (seq, M) in ``status``. Returns whether it did: the
    tile is then NaN (its data belongs to another call, or to none: a released wait)."""
    seen = tl.atomic_xchg(flag, 0, sem="acquire", scope="sys")
    while seen == 0:
        seen = tl.atomic_xchg(flag, 0, sem="acquire", scope="sys")
    other = seen != stamp
    if other:
        tl.store(status_ptr, 1 + src)  # STATUS_PEER_M_MISMATCH + src
        tl.store(status_ptr + 1, seen)  # the stamp it carried (cco.cuda.kernels.STATUS_WORDS)
    return other


@triton.jit
def _quantize_gather(acc, gscale_ptr, delta_ptr, rank, scale_plane, offs_m, row_ok, c0, scale_cols,
                     WORLD: tl.constexpr, MOVE_BYTES: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                     LOCAL: tl.constexpr = False):
    """The fp8 gather of a reduced tile: (e4m3 payload, its dequantized value). One scale
    max|acc| / 448 per row and GROUP columns, found by masked row maxima (no reshape: the
    accumulator keeps its layout) and stored into ``gather_scale[rank]`` of every peer as found
    (``LOCAL``: of this rank, for a copy engine to carry)."""
    group = tl.arange(0, BLOCK_N)[None, :] // GROUP
    scale = tl.zeros_like(acc)
    for g in tl.static_range(BLOCK_N // GROUP):
        s = tl.maximum(tl.max(tl.where(group == g, tl.abs(acc), 0.0), axis=1), 1e-30) / 448.0  # quant.quantize_gather
        scale = tl.where(group == g, s[:, None], scale)
        if LOCAL:
            tl.store(gscale_ptr + rank * scale_plane + offs_m.to(tl.int64) * scale_cols + c0 // GROUP + g, s,
                     mask=row_ok)
        elif MOVE_BYTES:
            for j in tl.static_range(1, WORLD):
                peer = (rank + j) % WORLD
                tl.store(_peer(gscale_ptr, delta_ptr, peer) + rank * scale_plane + offs_m.to(tl.int64) * scale_cols
                         + c0 // GROUP + g, s, mask=row_ok)
    payload = (acc / scale).to(tl.float8e4nv)
    return payload, payload.to(tl.float32) * scale


@triton.jit
def _group_scales_load(ptr, offs_m, row_ok, c0, scale_cols, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """The per-element scales of a tile from its [rows, scale_cols] plane at ``ptr`` (what
    :func:`_quantize_gather` stored)."""
    group = tl.arange(0, BLOCK_N)[None, :] // GROUP
    scale = tl.zeros((offs_m.shape[0], BLOCK_N), dtype=tl.float32)
    for g in tl.static_range(BLOCK_N // GROUP):
        s = tl.load(ptr + offs_m.to(tl.int64) * scale_cols + c0 // GROUP + g, mask=row_ok, other=0.0,
                    cache_modifier=".cg")
        scale = tl.where(group == g, s[:, None], scale)
    return scale


@triton.jit
def _reduce_own_tile(acc, chunk, M, offs_m, c0, recv_ptr, gather_ptr, gscale_ptr, out_ptr, flag_ptr, scatter_m_ptr,
                     stamp_ptr, status_ptr, rank, n_slice, plane, stride_out, scale_plane,
                     WORLD: tl.constexpr, FP8_GATHER: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, MAX_CHUNKS: tl.constexpr, PIECES: tl.constexpr):
    """The fused dma launch's own tile: ``bf16(acc) + recv[src]`` for every source in the reduce
    order (the reduce kernel's sum, bit for bit), into ``out``'s own columns and ``gather[rank]``
    (bf16, or e4m3 with ``gather_scale[rank]``). A source's chunk is read once its copy engine set
    ``scatter_flags[src, chunk]``; the flag is not consumed here (every own tile of the chunk reads
    it): the side stream zeroes it once the chunk's counter shows every reader done. PIECES = 2
    works on the two column halves one after the other: a whole 128x256 tile's sum and
    quantization in registers spill."""
    plane = tl.cast(plane, tl.int64)  # [W, rows, n_slice] offsets pass 2**31 at large M
    stamp = tl.load(stamp_ptr)
    mismatch = rank < 0  # False
    for j in tl.static_range(1, WORLD):
        src = (rank + j) % WORLD
        flag = flag_ptr + src * MAX_CHUNKS + chunk
        # poll with plain loads (every own tile of the chunk watches this one word: atomics from all
        # of them saturate its L2 slice), then one acquire, and the barrier orders every thread's
        # later loads after it
        seen = tl.load(flag, volatile=True)
        while seen == 0:
            seen = tl.load(flag, volatile=True)
        tl.atomic_add(flag, 0, sem="acquire", scope="sys")
        tl.debug_barrier()
        peer_stamp = tl.load(scatter_m_ptr + src, cache_modifier=".cg")
        other = peer_stamp != stamp
        mismatch = mismatch | other
        if other:
            tl.store(status_ptr, 1 + src)  # STATUS_PEER_M_MISMATCH + src
            tl.store(status_ptr + 1, peer_stamp)
    acc = tl.where(mismatch, float("nan"), acc)  # another call's rows: NaN, as the reduce kernel
    part = acc.to(tl.bfloat16)  # the partial a split call stores: both modes give the same bits
    if PIECES == 2:
        lo, hi = tl.split(tl.permute(tl.reshape(part, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        _reduce_own_piece(lo, M, offs_m, c0, recv_ptr, gather_ptr, gscale_ptr, out_ptr, rank, n_slice, plane,
                          stride_out, scale_plane, WORLD, FP8_GATHER, GROUP, BLOCK_N // 2)
        _reduce_own_piece(hi, M, offs_m, c0 + BLOCK_N // 2, recv_ptr, gather_ptr, gscale_ptr, out_ptr, rank, n_slice,
                          plane, stride_out, scale_plane, WORLD, FP8_GATHER, GROUP, BLOCK_N // 2)
    else:
        _reduce_own_piece(part, M, offs_m, c0, recv_ptr, gather_ptr, gscale_ptr, out_ptr, rank, n_slice, plane,
                          stride_out, scale_plane, WORLD, FP8_GATHER, GROUP, BLOCK_N)


@triton.jit
def _reduce_own_piece(part, M, offs_m, c0, recv_ptr, gather_ptr, gscale_ptr, out_ptr, rank, n_slice, plane,
                      stride_out, scale_plane, WORLD: tl.constexpr, FP8_GATHER: tl.constexpr, GROUP: tl.constexpr,
                      WIDTH: tl.constexpr):
    """Columns [c0, c0 + WIDTH) of an own tile (``part``: its bf16 partial): see :func:`_reduce_own_tile`."""
    offs_c = c0 + tl.arange(0, WIDTH)
    local = offs_m[:, None].to(tl.int64) * n_slice + offs_c[None, :]
    mask = (offs_m < M)[:, None] & (offs_c < n_slice)[None, :]
    acc = part.to(tl.float32)
    for j in tl.static_range(1, WORLD):
        src = (rank + j) % WORLD
        acc += tl.load(recv_ptr + src * plane + local, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    gather = gather_ptr + rank * plane + local
    if FP8_GATHER:
        payload, _ = _quantize_gather(acc, gscale_ptr, gscale_ptr, rank, scale_plane, offs_m, offs_m < M, c0,
                                      n_slice // GROUP, WORLD, False, WIDTH, GROUP, True)
        tl.store(gather, payload, mask=mask)
        # the value peers reconstruct, from the stored tile: converting the e4m3 piece back in
        # registers (its layout comes from the column split) left columns unwritten in Triton 3.6 on H200
        tl.debug_barrier()
        q = tl.load(gather, mask=mask, other=0.0)
        value = q.to(tl.float32) * _group_scales_load(gscale_ptr + rank * scale_plane, offs_m, offs_m < M, c0,
                                                      n_slice // GROUP, WIDTH, GROUP)
    else:
        value = acc
        tl.store(gather, acc.to(tl.bfloat16), mask=mask)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_out + (rank * n_slice + offs_c)[None, :],
             value.to(tl.bfloat16), mask=mask)


@triton.jit(do_not_specialize=["stamp"])  # a new (seq, M) stamp every call: one compile
def fp8_gemm_lsa_kernel(
    ticket_ptr, n_tiles, a_src, b_src, as_ptr, bs_ptr, out_ptr, partial_ptr,
    recv_ptr, gather_ptr, gscale_ptr, scatter_flag_ptr, gather_flag_ptr, delta_ptr, status_ptr, tile_ptr,
    rank, stamp, M, N, K, stride_am, stride_bn, stride_out, n_slice, plane, flag_plane, scale_plane,
    stride_asm, stride_ask, stride_bsn, stride_bsk,
    QUANT: tl.constexpr, USE_TMA: tl.constexpr, MX_BF16: tl.constexpr, PRECISE_ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    WORLD: tl.constexpr, FP8_GATHER: tl.constexpr, GATHER_GROUP: tl.constexpr,
    FROM_PARTIAL: tl.constexpr, MOVE_BYTES: tl.constexpr,
    NUM_PROGS: tl.constexpr,
):
    """NUM_PROGS = 0: one program per entry, each claiming the next entry of the walk from a ticket
    counter, so a program that waits knows every earlier entry is held by a running program (the
    last claimant resets the counter for the next launch). NUM_PROGS > 0: that many persistent
    programs, program p walking entries p, p + NUM_PROGS, ...

    Entry ``t`` (table row ``[chunk, dest, row0, col0]``): dest a peer: GEMM tile scattered into the
    peer; dest this rank: GEMM tile reduced and gathered; dest = WORLD + owner: the owner's gathered
    tile assembled into ``out``."""
    plane = tl.cast(plane, tl.int64)  # [W, rows, n_slice] offsets pass 2**31 at large M
    if NUM_PROGS == 0:
        first = _claim(ticket_ptr, n_tiles)
        stop = first + 1
        step = 1
    else:
        first = tl.program_id(0)
        stop = n_tiles
        step = NUM_PROGS
    # window regions are [W, rows, n_slice] planes; a peer's copy of a region is at
    # local + delta[peer] bytes (one symmetric allocation per rank, the same offsets everywhere)
    tiles_n = n_slice // BLOCK_N
    scale_cols = n_slice // GATHER_GROUP
    for t in range(first, stop, step):
        dest = tl.load(tile_ptr + t * 4 + 1)
        m0 = tl.multiple_of(tl.load(tile_ptr + t * 4 + 2), BLOCK_M)  # hints: vectorized tile stores
        c0 = tl.multiple_of(tl.load(tile_ptr + t * 4 + 3), BLOCK_N)
        assemble = dest >= WORLD
        col = (dest % WORLD) * n_slice + c0  # global column of the tile
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_c = c0 + tl.arange(0, BLOCK_N)
        mask = (offs_m < M)[:, None]
        local = offs_m[:, None].to(tl.int64) * n_slice + offs_c[None, :]
        out_tile = out_ptr + offs_m[:, None].to(tl.int64) * stride_out + (col + tl.arange(0, BLOCK_N))[None, :]
        tile_id = (m0 // BLOCK_M) * tiles_n + c0 // BLOCK_N
        if FROM_PARTIAL:  # the transfers alone, on a partial computed before: the self test's pattern in the
            # window's planes, or a decode-sized call's product [M, N]; its (owner, row) strides come as
            # stride_am and stride_bn (the GEMM's operand strides, unread in this mode)
            acc = tl.load(partial_ptr + (dest % WORLD) * tl.cast(stride_am, tl.int64)
                          + offs_m[:, None].to(tl.int64) * stride_bn + offs_c[None, :],
                          mask=mask, other=0.0)  # unused if assemble
            acc = acc.to(tl.float32)
        else:  # an assemble tile runs the loop zero times (no GEMM nested in a branch: it stays pipelined)
            acc = _tile_acc(a_src, b_src, as_ptr, bs_ptr, m0, col, M, N, tl.where(assemble, 0, K), stride_am,
                            stride_bn, stride_asm, stride_ask, stride_bsn, stride_bsk, QUANT, USE_TMA,
                            MX_BF16, PRECISE_ACC, BLOCK_M, BLOCK_N, BLOCK_K, SCALE_BLOCK)
        if assemble:
            owner = dest - WORLD
            other = _consume_flag(gather_flag_ptr + owner * flag_plane + tile_id, stamp, status_ptr, owner)
            q = tl.load(gather_ptr + owner * plane + local, mask=mask, other=0.0, cache_modifier=".cg")
            value = q.to(tl.float32)
            if FP8_GATHER:
                value = value * _group_scales_load(gscale_ptr + owner * scale_plane, offs_m, offs_m < M, c0, scale_cols,
                                                   BLOCK_N, GATHER_GROUP)
            tl.store(out_tile, tl.where(other, float("nan"), value).to(tl.bfloat16), mask=mask)
        elif dest != rank:
            # scatter: the partial tile straight into recv[rank] of its owner, then its flag
            if MOVE_BYTES:
                tl.store(_peer(recv_ptr, delta_ptr, dest) + rank * plane + local, acc.to(tl.bfloat16), mask=mask)
            tl.debug_barrier()  # every thread's stores are issued before the release below
            tl.atomic_xchg(_peer(scatter_flag_ptr, delta_ptr, dest) + rank * flag_plane + tile_id, stamp,
                           sem="release", scope="sys")
        else:
            # reduce: each source's tile once its flag is up, added in fp32 in a fixed order (NaN
            # if a flag carried another call's stamp)
            other = rank < 0  # False
            for j in tl.static_range(1, WORLD):
                src = (rank + j) % WORLD
                other = other | _consume_flag(scatter_flag_ptr + src * flag_plane + tile_id, stamp, status_ptr, src)
                part = tl.load(recv_ptr + src * plane + local, mask=mask, other=0.0, cache_modifier=".cg")
                acc += part.to(tl.float32)
            acc = tl.where(other, float("nan"), acc)
            # gather: the reduced tile into out and into gather[rank] of every peer, then its flag there
            if FP8_GATHER:
                payload, value = _quantize_gather(acc, gscale_ptr, delta_ptr, rank, scale_plane, offs_m, offs_m < M,
                                                  c0, scale_cols, WORLD, MOVE_BYTES, BLOCK_N, GATHER_GROUP)
            else:
                value = acc
                payload = acc.to(tl.bfloat16)
            tl.store(out_tile, value.to(tl.bfloat16), mask=mask)
            for j in tl.static_range(1, WORLD):
                peer = (rank + j) % WORLD
                if MOVE_BYTES:
                    tl.store(_peer(gather_ptr, delta_ptr, peer) + rank * plane + local, payload, mask=mask)
            tl.debug_barrier()
            for j in tl.static_range(1, WORLD):
                peer = (rank + j) % WORLD
                tl.atomic_xchg(_peer(gather_flag_ptr, delta_ptr, peer) + rank * flag_plane + tile_id, stamp,
                               sem="release", scope="sys")


@triton.jit
def mx_to_bf16_kernel(x_ptr, e_ptr, y_ptr, n_groups, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """``y = x * 2**(e - 127)`` in bf16 for ``BLOCK`` consecutive groups of ``GROUP`` values, each
    group with its e8m0 byte (``x`` and ``e`` contiguous, so group g holds values [g*GROUP, ...))."""
    g = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = g < n_groups
    offs = g[:, None].to(tl.int64) * GROUP + tl.arange(0, GROUP)[None, :]
    x = tl.load(x_ptr + offs, mask=ok[:, None]).to(tl.float32)
    scale = (tl.load(e_ptr + g, mask=ok).to(tl.int32) << 23).to(tl.float32, bitcast=True)  # exact powers of two
    tl.store(y_ptr + offs, (x * scale[:, None]).to(tl.bfloat16), mask=ok[:, None])
