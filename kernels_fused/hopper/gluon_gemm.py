"""blockscale's MMAs in Gluon (Triton's explicit-layout language): each K step's product kept in flight
while the previous one is scaled. Two kernels on one loop (:func:`_scaled_mma_loop`): the GEMM
(:func:`fp8_blockscale_gemm_kernel`) and the decode MMA over quantized rows
(:func:`decode_blockscale_mma_kernel`).

Why: the own blockscale kernels (``kernels.fp8_gemm_kernel``, ``decode_kernels.decode_mma_rows_kernel``)
scale each K step's product before adding it (``acc += dot(a, b) * scales``), so Triton waits for
each step's MMA to finish (``wgmma.wait_group 0``) before it issues the next one, and consecutive
MMAs never overlap: ~1.5x of cuBLAS's blockwise GEMM (docs/hopper_gemm.md, "Why the own blockscale
kernel runs ~1.5x of cuBLAS"), and the decode MMA's 1.28-1.48x of ``nn.Linear`` at 8B o_proj
(docs/decode.md). Gluon names the wait: here step k's MMA is issued into registers of its own,
then ``warpgroup_mma_wait(num_outstanding=1)`` waits only for step k - 1's, which is scaled and
added while step k runs (two products live beside the accumulator: 128x128 at 8 warps is 64 fp32
registers a thread each).

The GEMM's operands as the Triton kernels take them: ``a [M, K]`` e4m3 with ``a_scale [M, K / 128]``
(any strides), ``b [N, K]`` e4m3 K-major with ``b_scale [N / 128, K / 128]``; ``c [M, N]`` bf16. One
program per 128x128 output tile in grouped order; the tile leaves through a TMA store (rows past M
clipped by the descriptor).

Status: compiled for sm_90 with the GPU machines' Triton (3.6) and 3.9 (``python3 -m
scripts.probe_gluon_blockscale --compile-only``); on an H100 (2026-12-06) both are right (the fp32
product, equal bits on a repeat) and no faster than the Triton kernels they would replace: the GEMM
1.86-2.08x of cuBLAS against the own kernel's 1.72-1.90x, the decode MMA 5-20% slower than
``decode_gemm`` (docs/hopper_gemm.md, "That wait in Gluon"; docs/decode.md). So no launch path calls
them; imported only by ``scripts.probe_gluon_blockscale``, so nothing else needs Gluon.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

# the TMA copies' and the block barrier's names: Triton 3.6 (the GPU machines') has only these, later releases
# renamed them
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_block_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # (3.6's name; later ones call it barrier)
SCALE_BLOCK = gl.constexpr(128)  # blockscale's scale block along N and K: one weight scale per (tile, step)


@gluon.jit
def _scaled_mma_loop(x_desc, x_row, y_desc, y_row, first, steps, sx_ptr, sx_offs, sx_mask, sx_step, sy_ptr, sy_step,
                     acc_layout: gl.constexpr, SCALE_DIM: gl.constexpr, STAGES: gl.constexpr):
    """The fp32 ``[X, Y]`` sum over the 128-column groups ``g`` of ``first .. first + steps - 1`` (at
    least one) of ``x[:, g] @ y[:, g].T`` times the group's scales: ``sx[sx_offs + g * sx_step]``
    (where ``sx_mask``, else 0), a vector along dimension ``SCALE_DIM`` of the product, times the
    scalar ``sy[g * sy_step]``. ``x`` rows ``x_row..`` and ``y`` rows ``y_row..`` come through TMA into a
    ring of ``STAGES`` slots (group ``i`` of the walk in slot ``i % STAGES``, its ``i // STAGES``-th
    fill); each group's MMA is issued into registers of its own, and the wait that follows leaves it
    in flight while the previous group's product is scaled and added; a slot is loaded again once
    that wait has retired the MMA that read it."""
    X: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    Y: gl.constexpr = y_desc.block_type.shape[0]
    gl.static_assert(BLOCK_K == SCALE_BLOCK, "one scale group a step")
    x_ring = gl.allocate_shared_memory(x_desc.dtype, [STAGES, X, BLOCK_K], x_desc.layout)
    y_ring = gl.allocate_shared_memory(y_desc.dtype, [STAGES, Y, BLOCK_K], y_desc.layout)
    landed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(landed.index(i), count=1)
    fence_async_shared()  # the barriers' init before the copies that arrive on them
    tile_bytes: gl.constexpr = x_desc.block_type.nbytes + y_desc.block_type.nbytes
    for i in gl.static_range(STAGES):  # the walk's first STAGES groups, one a slot
        have = i < steps
        mbarrier.expect(landed.index(i), tile_bytes, pred=have)
        tma_load(x_desc, [x_row, (first + i) * BLOCK_K], landed.index(i), x_ring.index(i), pred=have)
        tma_load(y_desc, [y_row, (first + i) * BLOCK_K], landed.index(i), y_ring.index(i), pred=have)

    blank = gl.zeros((X, Y), gl.float32, acc_layout)  # the MMAs' unread accumulator input
    acc = gl.zeros((X, Y), gl.float32, acc_layout)
    mbarrier.wait(landed.index(0), 0)
    product = warpgroup_mma(x_ring.index(0), y_ring.index(0).permute((1, 0)), blank, use_acc=False, is_async=True)
    scale = gl.load(sx_ptr + sx_offs + first * sx_step, mask=sx_mask, other=0.0) * gl.load(sy_ptr + first * sy_step)
    for i in range(1, steps):
        slot = i % STAGES
        mbarrier.wait(landed.index(slot), (i // STAGES) & 1)
        nxt = warpgroup_mma(x_ring.index(slot), y_ring.index(slot).permute((1, 0)), blank, use_acc=False,
                            is_async=True)
        done = warpgroup_mma_wait(num_outstanding=1, deps=(product, ))  # group i - 1's, while group i's runs
        acc += done * (scale[:, None] if SCALE_DIM == 0 else scale[None, :])
        # group i - 1's slot is free now: group i + STAGES - 1 goes there (the ring's first fill held
        # groups 0..STAGES - 1, so group 1 loads group STAGES, and so on)
        ahead = i + STAGES - 1
        free = ahead % STAGES
        have = ahead < steps
        mbarrier.expect(landed.index(free), tile_bytes, pred=have)
        tma_load(x_desc, [x_row, (first + ahead) * BLOCK_K], landed.index(free), x_ring.index(free), pred=have)
        tma_load(y_desc, [y_row, (first + ahead) * BLOCK_K], landed.index(free), y_ring.index(free), pred=have)
        g = first + i
        scale = gl.load(sx_ptr + sx_offs + g * sx_step, mask=sx_mask, other=0.0) * gl.load(sy_ptr + g * sy_step)
        product = nxt
    done = warpgroup_mma_wait(num_outstanding=0, deps=(product, ))
    acc += done * (scale[:, None] if SCALE_DIM == 0 else scale[None, :])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(landed.index(i))
    return acc


@gluon.jit
def grouped_tile(tile, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """(first row, first column) of output tile ``tile`` in grouped order: ``GROUP_M`` tile rows walked
    column by column, so the programs running together share B tiles in L2."""
    tiles_m = gl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * gl.cdiv(N, BLOCK_N)
    first_m = (tile // per_group) * GROUP_M
    rows_in_group = gl.minimum(tiles_m - first_m, GROUP_M)
    m0 = (first_m + (tile % per_group) % rows_in_group) * BLOCK_M
    n0 = ((tile % per_group) // rows_in_group) * BLOCK_N
    return m0, n0


@gluon.jit
def fp8_blockscale_gemm_kernel(a_desc, b_desc, c_desc, as_ptr, bs_ptr, M, N, K,
                               stride_asm, stride_ask, stride_bsn, stride_bsk,
                               GROUP_M: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    gl.static_assert(BLOCK_N == SCALE_BLOCK, "one weight scale block per tile")

    m0, n0 = grouped_tile(gl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    # the accumulator's layout: warps stacked along M, one wgmma N of the whole tile
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    # rows past M: a zero scale (their A rows read as zeros too; the store clips them)
    acc = _scaled_mma_loop(a_desc, m0, b_desc, n0, 0, gl.cdiv(K, SCALE_BLOCK), as_ptr, rows * stride_asm, rows < M,
                           stride_ask, bs_ptr + (n0 // SCALE_BLOCK) * stride_bsn, stride_bsk, acc_layout, 0, STAGES)

    out = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    out.store(acc.to(c_desc.dtype))
    fence_async_shared()  # the tile's shared-memory stores before the TMA store reads them
    tma_store(c_desc, [m0, n0], out)
    tma.store_wait(0)


def descriptor(t, block, dtype):
    """The TMA descriptor of ``t`` the kernels take: ``block`` tiles in the default shared layout of
    Gluon ``dtype`` (the launchers', and the compile check's type of it)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, dtype))


def blockscale_gemm(a, b, a_scale, b_scale, *, out=None, stages: int = 4, group_m: int = 8, num_warps: int = 8):
    """bf16 ``a @ b.T`` with blockscale's scales through :func:`fp8_blockscale_gemm_kernel` (into
    ``out [M, N]`` where given). Operands as ``kernels_fused.hopper.gemm.fp8_gemm`` takes them for
    blockscale (row-major ``b``); unchecked beyond what TMA needs (16-byte aligned rows)."""
    import torch

    m, k = a.shape
    n = b.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    tile = [SCALE_BLOCK.value, SCALE_BLOCK.value]
    descs = [descriptor(t, tile, dtype) for t, dtype in ((a, gl.float8e4nv), (b, gl.float8e4nv), (out, gl.bfloat16))]
    grid = (-(-m // tile[0]) * -(-n // tile[1]), )
    fp8_blockscale_gemm_kernel[grid](*descs, a_scale, b_scale, m, n, k, a_scale.stride(0), a_scale.stride(1),
                                     b_scale.stride(0), b_scale.stride(1), GROUP_M=group_m, STAGES=stages,
                                     num_warps=num_warps)
    return out


@gluon.jit
def _decode_finish(acc, cols, rows, bias_ptr, out_ptr, M, N, HAS_BIAS: gl.constexpr):
    """``acc [BLOCK_N, ROWS]`` (weight rows by activation rows) rounded to bf16, the bias added to the
    rounded product and rounded again (``out += bias``, as the Triton decode kernels), stored
    transposed into ``out [M, N]``."""
    out = acc.to(gl.bfloat16)
    if HAS_BIAS:
        bias = gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)
        out = (out.to(gl.float32) + bias[:, None]).to(gl.bfloat16)
    gl.store(out_ptr + rows[None, :] * N + cols[:, None], out, mask=(cols < N)[:, None] & (rows < M)[None, :])


@gluon.jit
def decode_blockscale_mma_kernel(w_desc, q_desc, sa_ptr, ws_ptr, bias_ptr, out_ptr, cnt_ptr, part_ptr,
                                 M, N, K_PAD, K_SLICE, stride_sa, stride_ws,
                                 HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr,
                                 num_warps: gl.constexpr):
    """blockscale's MMA over 2..64 rows quantized beforehand (the activation quantizer's e4m3 ``q
    [M, K_PAD]`` and its group-major scales ``sa``, ``stride_sa`` apart), as
    ``decode_kernels.decode_mma_rows_kernel`` computes it: program ``(n block, s)`` takes
    ``BLOCK_N`` (64) weight rows as the MMA's M side and slice ``s`` of ``SPLIT`` slices of K
    (``K_SLICE`` columns, none empty), the rows (``ROWS``, a power of two of 16..64; past M read as
    zeros by TMA) as its N side, through :func:`_scaled_mma_loop`. ``SPLIT`` > 1: each program
    stores its fp32 partial into ``part``, then counts itself in on ``cnt[block]``; the last to
    arrive sums the partials in slice order (the bits independent of which came last), sets the
    count back to zero for the next launch, and finishes."""
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    block = gl.program_id(0)
    s = gl.program_id(1)
    n0 = block * BLOCK_N
    first = s * (K_SLICE // SCALE_BLOCK)
    steps = gl.minimum(K_SLICE // SCALE_BLOCK, K_PAD // SCALE_BLOCK - first)  # >= 1: the host leaves none empty

    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, ROWS, 32])
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(0, acc_layout))
    cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    acc = _scaled_mma_loop(w_desc, n0, q_desc, 0, first, steps, sa_ptr, rows, rows < M, stride_sa,
                           ws_ptr + (n0 // SCALE_BLOCK) * stride_ws, 1, acc_layout, 1, STAGES)

    if SPLIT == 1:
        _decode_finish(acc, cols, rows, bias_ptr, out_ptr, M, N, HAS_BIAS)
    else:
        tile = (cols - n0)[:, None] * ROWS + rows[None, :]
        parts = part_ptr + block * (SPLIT * BLOCK_N * ROWS)
        gl.store(parts + s * (BLOCK_N * ROWS) + tile, acc)
        _block_barrier()  # every thread's partial stored before the count
        if gl.atomic_add(cnt_ptr + block, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            total = gl.load(parts + tile, cache_modifier=".cg")  # (L2: the other SMs' stores)
            for j in gl.static_range(1, SPLIT):
                total += gl.load(parts + j * (BLOCK_N * ROWS) + tile, cache_modifier=".cg")
            gl.store(cnt_ptr + block, 0)  # no program of this launch counts on it any more
            _decode_finish(total, cols, rows, bias_ptr, out_ptr, M, N, HAS_BIAS)


DECODE_BLOCK_N = 64  # weight rows a decode program takes: one warpgroup's MMA M side


def decode_scratch(m: int, n: int, split: int, device) -> dict:
    """``counters`` (int32, one per weight block, zero: each launch leaves them zero again) and
    ``parts`` (fp32, the split's partials) of :func:`decode_blockscale_mma` for ``m`` rows and ``n``
    features in at most ``split`` slices: made once and passed to every call of that shape."""
    import torch

    from kernels_fused.hopper.decode import mma_rows

    blocks = -(-n // DECODE_BLOCK_N)
    return {"counters": torch.zeros(blocks, dtype=torch.int32, device=device),
            "parts": torch.empty(blocks * split * DECODE_BLOCK_N * mma_rows(m) if split > 1 else 1,
                                 dtype=torch.float32, device=device)}


def decode_blockscale_mma(q, sa, w, ws, n: int, *, bias=None, split: int = 1, stages: int = 4, out=None,
                          counters=None, parts=None):
    """bf16 ``[M, n]``: blockscale's rows already quantized (``quantize_activation(x, "blockscale",
    k_padded=K_pad)``: ``q [M, K_pad]`` and ``sa``, its ``[M, K_pad / 128]`` view of group-major
    scales) times the fp8 weight ``w [N_pad, K_pad]`` with ``ws [N_pad / 128, K_pad / 128]``, through
    :func:`decode_blockscale_mma_kernel` with K in ``split`` slices (fewer where a slice would be
    empty). ``counters`` and ``parts``: :func:`decode_scratch`'s, made where not given."""
    import torch

    from kernels_fused.hopper.decode import mma_rows

    m, k_pad = q.shape
    if not 1 <= m <= 64 or k_pad % SCALE_BLOCK.value or sa.stride(0) != 1 or ws.stride(1) != 1:
        raise ValueError(f"decode_blockscale_mma: q [{m}, {k_pad}] needs 1..64 rows, K_pad a multiple of 128, sa "
                         f"group-major (its row stride 1, got {sa.stride(0)}) and ws's groups adjacent (stride "
                         f"{ws.stride(1)})")
    rows, block_n, groups = mma_rows(m), DECODE_BLOCK_N, k_pad // SCALE_BLOCK.value
    per_slice = -(-groups // max(1, min(split, groups)))
    split = -(-groups // per_slice)  # no slice left empty
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=q.device)
    if counters is None or parts is None:
        scratch = decode_scratch(m, n, split, q.device)
        counters = scratch["counters"] if counters is None else counters
        parts = scratch["parts"] if parts is None else parts
    decode_blockscale_mma_kernel[(-(-n // block_n), split)](
        descriptor(w, [block_n, SCALE_BLOCK.value], gl.float8e4nv),
        descriptor(q, [rows, SCALE_BLOCK.value], gl.float8e4nv),
        sa, ws, out if bias is None else bias, out, counters, parts, m, n, k_pad,
        per_slice * SCALE_BLOCK.value, sa.stride(1), ws.stride(0), HAS_BIAS=bias is not None, SPLIT=split,
        STAGES=stages, num_warps=4)
    return out
