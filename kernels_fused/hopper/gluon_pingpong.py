"""ptpc's fp8 GEMM in Gluon as a persistent ping-pong: a TMA loader warp and two consumer warpgroups
that take a program's tiles in turn, so one consumer's epilogue (scales, bf16, the TMA store) runs
while the other's main loop keeps the tensor cores busy.

Why: at the reduce-scatter producers' short K (DeepSeek-V3 and Llama-3-70B at TP 8: K 2304-3584)
the own warp-specialized Triton GEMM runs 1.07-1.17x of cuBLAS (docs/BENCHMARKS.md), and the
producer built on it 1.18-1.22x against the 1.1 target: each program stores a tile before its next
tile's MMAs start. Neither Triton release the GPU machines run splits that loop into partitions for
sm_90 (no ``setmaxnreg``), and the Gluon blockscale kernel's one-MMA-in-flight wait did not buy the
overlap (``gluon_gemm``'s note). Ping-pong is the arrangement vendor Hopper GEMMs use for it.

Arrangement (``fp8_ptpc_pingpong_kernel``; 128x128 tiles, K steps of 128):
- the loader warp walks the program's tiles (``tile = pid + j * programs``, grouped order) and each
  tile's K steps into a ring of ``STAGES`` (A, B) slots: step ``g`` of the walk in slot
  ``g % STAGES``, loaded once ``empty[slot]`` says the MMA that read its previous fill retired;
- consumer ``c`` (the default partition is consumer 0, a worker warpgroup consumer 1) takes the
  program's tiles ``j = 2t + c``; its main loop waits ``ready[slot]`` per step, issues the MMA and
  releases the previous step's slot once ``wgmma.wait_group 1`` retired it;
- ``order``: consumer c's main loop for tile j starts only once the other consumer has retired
  tile j - 1's MMAs, so the two main loops take the ring's steps strictly in turn (a consumer never
  waits on a slot a whole lap ahead, where a barrier's phase parity would repeat), and each epilogue
  runs under the other's main loop;
- the epilogue: ``acc * a_scale[row] * b_scale[col]`` to bf16, into the consumer's own staging tile,
  stored by TMA (rows and columns past the output clipped); the staging tile is reused once the
  previous store has read it (the issuing thread's bulk wait, then the warpgroup's barrier, which
  Triton 3.6 and 3.9 put there themselves).

Registers: 12 warps (two consumer warpgroups, the loader's rounded to one), ``maxnreg`` 168, the
consumers raised to 232 (a 128x128 fp32 accumulator is 128 a thread), the loader lowered to 40.

Status: compiled for sm_90 on the host with Triton 3.6 and 3.9 (``python3 -m
scripts.probe_gluon_blockscale --compile-only``: no spills, 196856 bytes of shared memory at 4
stages, ``setmaxnreg`` per partition, one MMA left in flight). Run on one H100 (2026-12-07,
``python3 -m scripts.probe_pingpong``): right (the fp32 product, equal bits on a repeat) at every
producer shape and ring depth, but at 4 stages 1.05-1.17x of cuBLAS, no better than the own ws
kernel (ahead at 16384 tokens, behind at 4096): the 128x128 tile reads a third more a flop than
the own kernel's 128x256, and the Gluon of the GPU machines' Triton has no multicast load to share
an operand over a CTA pair (docs/hopper_gemm.md, the ping-pong's section). Its ring alone
(``LOADS_ONLY``: the loads, no MMA) takes 0.89-1.07x of cuBLAS's whole GEMM at 4096 tokens, so no
overlap on this tile gets clear of cuBLAS. No launch path calls it.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from kernels_fused.hopper.gluon_gemm import descriptor, grouped_tile, tma_load, tma_store

GROUP_M = gl.constexpr(8)  # grouped_tile's tile rows a group


@gluon.jit
def _loader(a_desc, b_desc, c_desc, a_ring, b_ring, c_stage, ready, empty, order, as_ptr, bs_ptr, M, N, K):
    """One warp: every tile of this program in order, every K step of each into the ring."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_ring.type.shape[0]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    steps = gl.cdiv(K, BLOCK_K)
    g = 0
    for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
        m0, n0 = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        for kk in range(steps):
            slot = g % STAGES
            mbarrier.wait(empty.index(slot), ((g // STAGES) & 1) ^ 1)  # (a fresh barrier: phase 1 complete)
            mbarrier.expect(ready.index(slot), nbytes)
            tma_load(a_desc, [m0, kk * BLOCK_K], ready.index(slot), a_ring.index(slot))
            tma_load(b_desc, [n0, kk * BLOCK_K], ready.index(slot), b_ring.index(slot))
            g += 1


@gluon.jit
def _consumer(a_desc, b_desc, c_desc, a_ring, b_ring, c_stage, ready, empty, order, as_ptr, bs_ptr, M, N, K,
              PARITY: gl.constexpr):
    """One warpgroup: the program's tiles 2t + PARITY. Its main loop starts once the other consumer's
    has retired its last MMA (``order``), so the two main loops take the ring's steps in turn and
    this one's epilogue runs under the other's main loop."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_ring.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    steps = gl.cdiv(K, BLOCK_K)
    mine = order.index(PARITY)
    other = order.index(1 - PARITY)
    out = c_stage.index(PARITY)
    t = 0
    for tile in range(gl.program_id(0) + PARITY * gl.num_programs(0), tiles, 2 * gl.num_programs(0)):
        m0, n0 = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        j = 2 * t + PARITY  # the program's j-th tile: its steps are the ring's j * steps ..
        if j > 0:  # the other consumer retired the previous tile's MMAs
            mbarrier.wait(mine, ((j - 1) // 2) & 1)
        g = j * steps
        acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, acc_layout)
        for kk in range(steps):
            g2 = g + kk
            slot = g2 % STAGES
            mbarrier.wait(ready.index(slot), (g2 // STAGES) & 1)
            acc = warpgroup_mma(a_ring.index(slot), b_ring.index(slot).permute((1, 0)), acc, use_acc=kk > 0,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # step kk - 1's MMA is done
            mbarrier.arrive(empty.index((g2 + STAGES - 1) % STAGES), count=1, pred=kk > 0)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((g + steps - 1) % STAGES), count=1)
        mbarrier.arrive(other, count=1)  # the other consumer's next main loop may start

        rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        sa = gl.load(as_ptr + rows, mask=rows < M, other=0.0)
        sb = gl.load(bs_ptr + cols, mask=cols < N, other=0.0)
        res = (acc * sa[:, None] * sb[None, :]).to(c_desc.dtype)
        # this consumer's previous tile has left its staging: the issuing thread's wait, which both
        # Tritons follow with the warpgroup's barrier (probe_gluon_blockscale.pingpong_problems checks)
        tma.store_wait(0)
        out.store(res)
        fence_async_shared()
        tma_store(c_desc, [m0, n0], out)
        t += 1
    tma.store_wait(0)


@gluon.jit
def _consumer_0(a_desc, b_desc, c_desc, a_ring, b_ring, c_stage, ready, empty, order, as_ptr, bs_ptr, M, N, K):
    _consumer(a_desc, b_desc, c_desc, a_ring, b_ring, c_stage, ready, empty, order, as_ptr, bs_ptr, M, N, K, 0)


@gluon.jit
def _consumer_1(a_desc, b_desc, c_desc, a_ring, b_ring, c_stage, ready, empty, order, as_ptr, bs_ptr, M, N, K):
    _consumer(a_desc, b_desc, c_desc, a_ring, b_ring, c_stage, ready, empty, order, as_ptr, bs_ptr, M, N, K, 1)


@gluon.jit
def _taker(a_desc, b_desc, c_desc, a_ring, b_ring, c_stage, ready, empty, order, as_ptr, bs_ptr, M, N, K,
           PARITY: gl.constexpr):
    """A measurement's consumer (``LOADS_ONLY``): :func:`_consumer`'s tiles, steps and turns, each
    fill released as it lands, no MMA and nothing stored: the ring's own pace."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_ring.type.shape[0]
    tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    steps = gl.cdiv(K, BLOCK_K)
    t = 0
    for tile in range(gl.program_id(0) + PARITY * gl.num_programs(0), tiles, 2 * gl.num_programs(0)):
        j = 2 * t + PARITY
        if j > 0:
            mbarrier.wait(order.index(PARITY), ((j - 1) // 2) & 1)
        for kk in range(steps):
            g = j * steps + kk
            mbarrier.wait(ready.index(g % STAGES), (g // STAGES) & 1)
            mbarrier.arrive(empty.index(g % STAGES), count=1)
        mbarrier.arrive(order.index(1 - PARITY), count=1)
        t += 1


@gluon.jit
def _taker_0(a_desc, b_desc, c_desc, a_ring, b_ring, c_stage, ready, empty, order, as_ptr, bs_ptr, M, N, K):
    _taker(a_desc, b_desc, c_desc, a_ring, b_ring, c_stage, ready, empty, order, as_ptr, bs_ptr, M, N, K, 0)


@gluon.jit
def _taker_1(a_desc, b_desc, c_desc, a_ring, b_ring, c_stage, ready, empty, order, as_ptr, bs_ptr, M, N, K):
    _taker(a_desc, b_desc, c_desc, a_ring, b_ring, c_stage, ready, empty, order, as_ptr, bs_ptr, M, N, K, 1)


@gluon.jit
def fp8_ptpc_pingpong_kernel(a_desc, b_desc, c_desc, as_ptr, bs_ptr, M, N, K,
                             STAGES: gl.constexpr, num_warps: gl.constexpr, LOADS_ONLY: gl.constexpr = False):
    gl.static_assert(num_warps == 4, "the default partition is consumer 0: one warpgroup")
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_stage = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(order.index(i), count=1)
    fence_async_shared()
    args = (a_desc, b_desc, c_desc, a_ring, b_ring, c_stage, ready, empty, order, as_ptr, bs_ptr, M, N, K)
    # LOADS_ONLY, a measurement of the ring alone, takes partitions of its own (_taker's) rather than
    # a flag through _consumer_0/1: with the flag passed there, Triton 3.6 compiles the GEMM itself
    # differently (one more warpgroup barrier, 16 more bytes of shared memory); this way its PTX is
    # the same as without LOADS_ONLY, with 3.6 and 3.9
    if LOADS_ONLY:
        gl.warp_specialize([
            (_taker_0, args),
            (_taker_1, args),
            (_loader, args),
        ], [4, 1], [232, 40])
    else:
        gl.warp_specialize([
            (_consumer_0, args),
            (_consumer_1, args),
            (_loader, args),
        ], [4, 1], [232, 40])


MAXNREG = 168  # registers a thread at launch: 12 warps x 168 fills the SM's 64K; setmaxnreg then moves them


def ptpc_pingpong_gemm(a, b, a_scale, b_scale, *, out=None, stages: int = 4, loads_only: bool = False):
    """bf16 ``(a @ b.T) * a_scale[:, None] * b_scale[None, :]`` through :func:`fp8_ptpc_pingpong_kernel`
    (into ``out [M, N]`` where given): ``a [M, K]`` and ``b [N, K]`` e4m3 row-major (16-byte aligned
    rows, as TMA needs), ``a_scale [M]`` and ``b_scale [N]`` fp32. One program per SM (fewer where
    there are fewer tiles). Unchecked beyond that: a probe's launcher (``scripts.probe_pingpong``).
    ``loads_only``: a measurement of the ring alone (:func:`_taker`): the same walk's loads taken and
    released as they land, no MMA, nothing written (``out`` left as it was)."""
    import torch

    m, k = a.shape
    n = b.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    tile = [128, 128]
    descs = [descriptor(t, tile, dtype) for t, dtype in ((a, gl.float8e4nv), (b, gl.float8e4nv), (out, gl.bfloat16))]
    tiles = -(-m // tile[0]) * -(-n // tile[1])
    grid = (min(torch.cuda.get_device_properties(a.device).multi_processor_count, tiles), )
    fp8_ptpc_pingpong_kernel[grid](*descs, a_scale, b_scale, m, n, k, STAGES=stages, num_warps=4, maxnreg=MAXNREG,
                                   LOADS_ONLY=loads_only)
    return out
