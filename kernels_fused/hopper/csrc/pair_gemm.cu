// ptpc's fp8 GEMM for sm_90a with a CTA pair sharing the weight tile by TMA multicast:
//   out[M, N] (bf16) = (A[M, K] e4m3 @ B[N, K]^T e4m3) * a_scale[M] * b_scale[N]
//
// Why (docs/hopper_gemm.md, "ptpc's GEMM with a CTA pair sharing B"): at the sequence-parallel
// shapes the own Triton GEMMs run 1.00-1.20x of cuBLAS, and the Gluon ping-pong's ring alone took
// longer than cuBLAS's whole GEMM: the tiles' feed from L2 sets the pace of a 128x128 tile. cuBLAS
// pairs its CTAs in a cluster that loads a shared operand once for both. The GPU machines' Triton
// (3.6) cannot issue a multicast load, so this is CUDA C++ built by nvcc.
//
// Two arrangements, one persistent CTA per SM, clusters of PAIR CTAs along M (CTA r of the pair
// computes rows 128 (2 p + r) .. + 127 of the pair's row block p, against the same B columns):
// - ``cco_ptpc_gemm_pair``: a CTA's 128x256 tile split between two consumer warpgroups (rows 0-63
//   and 64-127, four m64n256k32 MMAs a 128-byte K step);
// - ``cco_ptpc_gemm_pair_pingpong``: a 128x128 tile a consumer warpgroup, the two taking the CTA's
//   tiles in turn so one's epilogue runs under the other's MMAs (cuBLAS's arrangement here).
// In both, warpgroup 0 is the loader (one thread): per K step it loads the CTA's own A tile and its
// half of the tile's B rows, multicast into the slot of both CTAs; a consumer leaves one step's MMAs
// in flight and releases the step before (its ``empty`` barrier in both CTAs: the peer writes half
// of the slot); the epilogue (row and column scales, bf16) is stored from registers while the loader
// runs ahead into the next tile. Both CTAs walk the same tiles, so their steps and barrier phases
// stay in step. ``full[s]`` completes when this CTA's bytes of the step landed (its A tile, both
// halves of B; the loader's expect_tx and the peer's bytes may come in either order).
//
// Status: right on an H100 and an H200 (``scripts.probe_pair_gemm``), 1.00-1.28x of cuBLAS for the
// ping-pong, a tie with the own Triton ws kernel; no launch path calls it.
#include <cstdint>
#include <cuda_bf16.h>

namespace {

constexpr int BM = 128;             // a CTA's tile rows (two consumer warpgroups of 64)
constexpr int BN = 256;             // the pair's shared tile columns
// CCO_BK: K bytes a step, 128 (one row of the 128-byte swizzle) or 64 (the 64-byte swizzle: half the
// step, so a slot is released twice as often); CCO_STAGES: the ring's depth.
#ifndef CCO_BK
#define CCO_BK 128
#endif
#ifndef CCO_STAGES
#define CCO_STAGES 4
#endif
constexpr int BK = CCO_BK;
constexpr int STAGES = CCO_STAGES;
static_assert(BK == 128 || BK == 64, "a step is one row of the 128- or 64-byte swizzle");
constexpr int THREADS = 384;        // loader warpgroup + two consumer warpgroups
// CCO_PAIR: CTAs a cluster sharing an operand's tile (2; 1 loads both tiles a CTA, for comparison).
// CCO_WIDE_STORES: 1 stores the epilogue in 16-byte pieces that fill whole 32-byte sectors (the
// quad of lanes holding a row's 8-column block trades its pairs over shuffles); 0 stores each
// thread's bf16 pairs as they sit in the accumulator (4 bytes a store, half sectors).
#ifndef CCO_PAIR
#define CCO_PAIR 2
#endif
#ifndef CCO_WIDE_STORES
#define CCO_WIDE_STORES 1
#endif
// CCO_EARLY_RELEASE: 1 waits for a step's MMAs before issuing the next step's and releases its slot
// then; 0 keeps one step's MMAs in flight and releases the step before (the shared tile only).
#ifndef CCO_EARLY_RELEASE
#define CCO_EARLY_RELEASE 0
#endif
// CCO_SHARE_A: 0 pairs the CTAs along M, sharing B's tile (each loads half of its rows); 1 pairs
// them along N, sharing A's (each loads half of the 128 rows, B's tile its own).
#ifndef CCO_SHARE_A
#define CCO_SHARE_A 0
#endif
// CCO_CLUSTER_ORDER: 1 gives the ring's waits acquire and its remote arrives release semantics at
// the cluster's scope; 0 (default) leaves both at the barrier's defaults. The consumers' reads of a
// slot are the MMAs' (retired by wgmma.wait_group before the arrive), and the loads are TMA's
// (ordered by the barrier's transaction count), so no other memory needs ordering.
#ifndef CCO_CLUSTER_ORDER
#define CCO_CLUSTER_ORDER 0
#endif
#if CCO_CLUSTER_ORDER
#define CCO_WAIT_ORDER ".acquire.cluster"
#define CCO_ARRIVE_ORDER ".release.cluster"
#else
#define CCO_WAIT_ORDER ""
#define CCO_ARRIVE_ORDER ""
#endif
constexpr int PAIR = CCO_PAIR;

struct alignas(64) TensorMap { uint64_t words[16]; };  // CUtensorMap, passed by value

__device__ __forceinline__ uint32_t cta_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ void cluster_barrier() {  // every thread of both CTAs
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

__device__ __forceinline__ void barrier_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ bool barrier_try_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity" CCO_WAIT_ORDER ".shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    return done;
}

__device__ __forceinline__ void barrier_wait(uint32_t bar, uint32_t parity) {
    while (!barrier_try_wait(bar, parity)) {
    }
}

__device__ __forceinline__ void barrier_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}

// Arrive on the barrier at this CTA's shared address ``bar`` in CTA ``cta`` of the cluster.
__device__ __forceinline__ void barrier_arrive_in(uint32_t bar, uint32_t cta) {
    asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
                 "mbarrier.arrive" CCO_ARRIVE_ORDER ".shared::cluster.b64 _, [remote];\n}\n"
                 :: "r"(bar), "r"(cta) : "memory");
}

// A 128x128-byte box of the tensor map at (column x, row y) into this CTA's ``dst``.
__device__ __forceinline__ void tma_load(uint32_t dst, const TensorMap& map, int x, int y, uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3}], [%4];"
                 :: "r"(dst), "l"(reinterpret_cast<uint64_t>(&map)), "r"(x), "r"(y), "r"(bar) : "memory");
}

// The same box into ``dst`` of every CTA in ``mask``, each completing its own barrier at ``bar``.
__device__ __forceinline__ void tma_load_multicast(uint32_t dst, const TensorMap& map, int x, int y, uint32_t bar,
                                                   uint16_t mask) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;"
                 :: "r"(dst), "l"(reinterpret_cast<uint64_t>(&map)), "r"(x), "r"(y), "r"(bar), "h"(mask)
                 : "memory");
}

// A K-major operand in shared memory with the BK-byte swizzle: rows of BK bytes, 8-row groups 8 BK
// bytes apart (the stride byte offset); the leading offset is unused by these swizzles. Mode 1 is the
// 128-byte swizzle, 2 the 64-byte one.
__device__ __forceinline__ uint64_t smem_descriptor(uint32_t addr) {
    constexpr uint64_t mode = BK == 128 ? 1 : 2;
    return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (static_cast<uint64_t>(8 * BK >> 4) << 32)
           | (mode << 62);
}

__device__ __forceinline__ void mma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void mma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void mma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }

// The accumulator's registers d[i .. i+7] as read-write operands of an MMA's inline asm, in order.
#define CCO_ACC8(d, i)                                                                                  \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]),         \
        "+f"(d[i + 6]), "+f"(d[i + 7])

// One m64n256k32 MMA of the warpgroup: d (its 64x256 fp32 tile, 128 registers a thread) +=
// A (64 rows x 32 K bytes, descriptor a) x B (256 rows x 32 K bytes, descriptor b)^T; accumulate = 0
// overwrites d (a tile's first MMA).
__device__ __forceinline__ void mma_64x256x32(float (&d)[128], uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred acc;\nsetp.ne.b32 acc, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, acc, 1, 1;\n}\n"
        : CCO_ACC8(d, 0), CCO_ACC8(d, 8), CCO_ACC8(d, 16), CCO_ACC8(d, 24), CCO_ACC8(d, 32), CCO_ACC8(d, 40),
          CCO_ACC8(d, 48), CCO_ACC8(d, 56), CCO_ACC8(d, 64), CCO_ACC8(d, 72), CCO_ACC8(d, 80), CCO_ACC8(d, 88),
          CCO_ACC8(d, 96), CCO_ACC8(d, 104), CCO_ACC8(d, 112), CCO_ACC8(d, 120)
        : "l"(a), "l"(b), "r"(accumulate));
}

// The same for a 64x128 tile (64 registers a thread): the ping-pong's MMA, two a consumer a K slice.
__device__ __forceinline__ void mma_64x128x32(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred acc;\nsetp.ne.b32 acc, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, acc, 1, 1;\n}\n"
        : CCO_ACC8(d, 0), CCO_ACC8(d, 8), CCO_ACC8(d, 16), CCO_ACC8(d, 24), CCO_ACC8(d, 32), CCO_ACC8(d, 40),
          CCO_ACC8(d, 48), CCO_ACC8(d, 56)
        : "l"(a), "l"(b), "r"(accumulate));
}

// Cluster tile t of the grouped walk: its row block and column block (``group`` row blocks a group).
__device__ __forceinline__ void tile_of(int t, int row_blocks, int col_blocks, int group, int& rb, int& cb) {
    const int per_group = group * col_blocks;
    const int first = (t / per_group) * group;
    const int size = min(row_blocks - first, group);
    rb = first + (t % per_group) % size;
    cb = (t % per_group) / size;
}

// The tiles of a kernel whose CTA tile is BM x TN: the pair's tiles side by side along N (sharing
// A) or along M (sharing B), walked in the grouped order; ``origin`` gives this CTA's tile of
// cluster tile t.
template <int TN>
struct Walk {
    static constexpr int ROWS = CCO_SHARE_A ? BM : PAIR * BM, COLS = CCO_SHARE_A ? PAIR * TN : TN;
    int row_blocks, col_blocks, tiles, group;
    uint32_t rank;

    __device__ Walk(int M, int N, int group_, uint32_t rank_)
        : row_blocks(M / ROWS), col_blocks(N / COLS), tiles(M / ROWS * (N / COLS)), group(group_), rank(rank_) {}

    __device__ void origin(int t, int& m0, int& n0) const {
        int rb, cb;
        tile_of(t, row_blocks, col_blocks, group, rb, cb);
        m0 = rb * ROWS + (CCO_SHARE_A ? 0 : rank * BM);
        n0 = cb * COLS + (CCO_SHARE_A ? rank * TN : 0);
    }
};

template <int BLOCKS>
__device__ __forceinline__ void store_rows(const float (&acc)[4 * BLOCKS], int row0, int col0, int N,
                                           const float* __restrict__ a_scale, const float* __restrict__ b_scale,
                                           __nv_bfloat16* __restrict__ out) {
    const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const int row = row0 + warp * 16 + lane / 4;
    const float sa0 = a_scale[row], sa1 = a_scale[row + 8];
    const int quad = lane % 4;
#if CCO_WIDE_STORES
    // Two 8-column blocks of the two rows are four 16-byte pieces, one a lane of the quad:
    // lane q takes piece q (row + 8 (q / 2), block i + q % 2). Piece p's pair r sits in lane r.
    const int piece_row = row + 8 * (quad / 2);
    __nv_bfloat16* piece_out = out + static_cast<size_t>(piece_row) * N + col0 + 8 * (quad % 2);
#pragma unroll
    for (int i = 0; i < BLOCKS; i += 2) {
        const float2 c0 = *reinterpret_cast<const float2*>(b_scale + col0 + 8 * i + 2 * quad);
        const float2 c1 = *reinterpret_cast<const float2*>(b_scale + col0 + 8 * i + 8 + 2 * quad);
        uint32_t mine[4];  // this lane's pair of each piece
        const __nv_bfloat162 p0 = __floats2bfloat162_rn(acc[4 * i] * sa0 * c0.x, acc[4 * i + 1] * sa0 * c0.y);
        const __nv_bfloat162 p1 = __floats2bfloat162_rn(acc[4 * i + 4] * sa0 * c1.x, acc[4 * i + 5] * sa0 * c1.y);
        const __nv_bfloat162 p2 = __floats2bfloat162_rn(acc[4 * i + 2] * sa1 * c0.x, acc[4 * i + 3] * sa1 * c0.y);
        const __nv_bfloat162 p3 = __floats2bfloat162_rn(acc[4 * i + 6] * sa1 * c1.x, acc[4 * i + 7] * sa1 * c1.y);
        mine[0] = *reinterpret_cast<const uint32_t*>(&p0);
        mine[1] = *reinterpret_cast<const uint32_t*>(&p1);
        mine[2] = *reinterpret_cast<const uint32_t*>(&p2);
        mine[3] = *reinterpret_cast<const uint32_t*>(&p3);
        // Round j: lane q receives from lane (q + j) % 4 that lane's pair of piece q, which the
        // sender holds as mine[(sender - j) % 4]; it is pair (q + j) % 4 of this lane's piece.
        uint32_t got[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int give = (quad - j) & 3;
            const uint32_t send = give == 0 ? mine[0] : give == 1 ? mine[1] : give == 2 ? mine[2] : mine[3];
            got[j] = __shfl_sync(0xffffffffu, send, (lane & ~3) | ((quad + j) & 3));
        }
        uint4 piece;  // pair r of the piece came in round (r - q) % 4
        const int r0 = (0 - quad) & 3, r1 = (1 - quad) & 3, r2 = (2 - quad) & 3, r3 = (3 - quad) & 3;
        piece.x = r0 == 0 ? got[0] : r0 == 1 ? got[1] : r0 == 2 ? got[2] : got[3];
        piece.y = r1 == 0 ? got[0] : r1 == 1 ? got[1] : r1 == 2 ? got[2] : got[3];
        piece.z = r2 == 0 ? got[0] : r2 == 1 ? got[1] : r2 == 2 ? got[2] : got[3];
        piece.w = r3 == 0 ? got[0] : r3 == 1 ? got[1] : r3 == 2 ? got[2] : got[3];
        *reinterpret_cast<uint4*>(piece_out + 8 * i) = piece;
    }
#else
    __nv_bfloat16* out0 = out + static_cast<size_t>(row) * N + col0 + 2 * quad;
    __nv_bfloat16* out1 = out0 + static_cast<size_t>(8) * N;
    const float* sb = b_scale + col0 + 2 * quad;
#pragma unroll
    for (int i = 0; i < BLOCKS; ++i) {
        const float2 cs = *reinterpret_cast<const float2*>(sb + 8 * i);
        *reinterpret_cast<__nv_bfloat162*>(out0 + 8 * i) =
            __floats2bfloat162_rn(acc[4 * i] * sa0 * cs.x, acc[4 * i + 1] * sa0 * cs.y);
        *reinterpret_cast<__nv_bfloat162*>(out1 + 8 * i) =
            __floats2bfloat162_rn(acc[4 * i + 2] * sa1 * cs.x, acc[4 * i + 3] * sa1 * cs.y);
    }
#endif
}

// The shared memory of a kernel whose CTA tile has TN columns: STAGES slots of (A: BM rows, B: TN
// rows) x BK bytes, 1024-byte aligned for the swizzle, then the ``full`` and ``empty`` barriers of
// each slot and ``extra`` barriers more. Thread 0 initializes them; every thread of the pair then
// meets at the cluster's barrier, so no multicast or remote arrive reaches a barrier not yet made.
template <int TN>
struct Ring {
    static constexpr int A = BM * BK, B = TN * BK, STEP = A + B;
    uint32_t a, b, full, empty, extra;

    __device__ explicit Ring(const uint8_t* shared_raw, uint32_t consumers_a_step, int extras) {
        const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(shared_raw));
        a = (raw + 1023) & ~1023u;
        b = a + STAGES * A;
        full = a + STAGES * STEP;
        empty = full + 8 * STAGES;
        extra = empty + 8 * STAGES;
        if (threadIdx.x == 0) {
            for (int s = 0; s < STAGES; ++s) {
                barrier_init(full + 8 * s, 1);
                barrier_init(empty + 8 * s, consumers_a_step * PAIR);  // every consumer of the step, both CTAs
            }
            for (int e = 0; e < extras; ++e) barrier_init(extra + 8 * e, 1);
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        cluster_barrier();
    }

    // Release slot s: its empty barrier in each CTA of the pair (the peer writes half of it).
    __device__ void release(int s) const {
        for (uint32_t c = 0; c < PAIR; ++c) barrier_arrive_in(empty + 8 * s, c);
    }
};

// The loader (one thread): every K step of every tile of this cluster's walk into the ring, in order.
// A: the CTA's own BM rows. B: the tile's TN rows; alone, in boxes of up to 128 rows; in a pair, this
// CTA's half multicast into the slot of both CTAs.
template <int TN>
__device__ void load_ring(const Ring<TN>& ring, const Walk<TN>& walk, const TensorMap& map_a, const TensorMap& map_b,
                          int cluster, int clusters, int steps) {
    constexpr bool SHARE_A = PAIR > 1 && CCO_SHARE_A, SHARE_B = PAIR > 1 && !CCO_SHARE_A;
    constexpr int B_ROWS = SHARE_B ? TN / PAIR : TN;  // B rows this CTA loads a step
    constexpr int B_BOX = B_ROWS < 128 ? B_ROWS : 128;
    constexpr uint16_t BOTH = (1 << PAIR) - 1;
    const uint32_t rank = walk.rank;
    int s = 0;
    uint32_t phase = 0;
    for (int t = cluster; t < walk.tiles; t += clusters) {
        int m0, n0;
        walk.origin(t, m0, n0);
        for (int k = 0; k < steps; ++k) {
            const uint32_t full = ring.full + 8 * s, a = ring.a + s * ring.A, b = ring.b + s * ring.B;
            barrier_wait(ring.empty + 8 * s, phase ^ 1);  // (a fresh barrier: its phase 1 counts as done)
            barrier_expect(full, ring.STEP);
            if (SHARE_A)  // this CTA's half of the pair's A rows, into both CTAs
                tma_load_multicast(a + rank * (ring.A / PAIR), map_a, k * BK, m0 + rank * (BM / PAIR), full, BOTH);
            else
                tma_load(a, map_a, k * BK, m0, full);
            if (SHARE_B)  // this CTA's half of the pair's B rows, into both CTAs
                tma_load_multicast(b + rank * (ring.B / PAIR), map_b, k * BK, n0 + rank * (TN / PAIR), full, BOTH);
            else
                for (int r = 0; r < TN; r += B_BOX) tma_load(b + r * BK, map_b, k * BK, n0 + r, full);
            if (++s == STAGES) {
                s = 0;
                phase ^= 1;
            }
        }
    }
}
}  // namespace

// M and N multiples of the pair's tiles side by side (Walk's ROWS and COLS), K of BK: the launcher
// refuses other shapes. Grid: a multiple of PAIR CTAs (the cluster is compile-time), THREADS threads.
// CCO_MIN_BLOCKS: blocks an SM the compile budgets registers for (1; the host test asks for 3, a
// budget of 56 registers a thread that ptxas refuses for the MMA's 128-register accumulator).
#ifndef CCO_MIN_BLOCKS
#define CCO_MIN_BLOCKS 1
#endif
extern "C" __global__ void __cluster_dims__(PAIR, 1, 1) __launch_bounds__(THREADS, CCO_MIN_BLOCKS)
cco_ptpc_gemm_pair(const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b,
                   const float* __restrict__ a_scale, const float* __restrict__ b_scale,
                   __nv_bfloat16* __restrict__ out, int M, int N, int K, int group) {
    extern __shared__ uint8_t shared_raw[];
    const Ring<BN> ring(shared_raw, 2, 0);
    const uint32_t rank = cta_rank();
    const int warpgroup = threadIdx.x / 128, thread = threadIdx.x % 128;
    const Walk<BN> walk(M, N, group, rank);
    const int steps = K / BK, cluster = blockIdx.x / PAIR, clusters = gridDim.x / PAIR;

    if (warpgroup == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (thread == 0)
            load_ring(ring, walk, map_a, map_b, cluster, clusters, steps);
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        const int half = warpgroup - 1;  // rows 64 * half .. + 63 of the CTA's tile
        float acc[128];
        int s = 0;
        uint32_t phase = 0;
        for (int t = cluster; t < walk.tiles; t += clusters) {
            int m0, n0;
            walk.origin(t, m0, n0);
#if !CCO_EARLY_RELEASE
            int held = -1;  // the slot whose MMAs are still in flight
#endif
            for (int k = 0; k < steps; ++k) {
                barrier_wait(ring.full + 8 * s, phase);
                mma_fence();
                const uint64_t a = smem_descriptor(ring.a + s * ring.A + half * 64 * BK);
                const uint64_t b = smem_descriptor(ring.b + s * ring.B);
#pragma unroll
                for (int j = 0; j < BK / 32; ++j)  // 32 K bytes a MMA: 2 in the descriptor's 16-byte units
                    mma_64x256x32(acc, a + 2 * j, b + 2 * j, k > 0 || j > 0);
                mma_commit();
#if CCO_EARLY_RELEASE
                // This step's MMAs retired before the next step's issue: the slot goes back a step
                // sooner, and the other consumer's MMAs keep the tensor cores busy meanwhile.
                mma_wait<0>();
                if (thread == 0)
                    ring.release(s);
#else
                if (held >= 0) {
                    mma_wait<1>();  // the previous step's MMAs retired: its slot may be refilled
                    if (thread == 0)
                        ring.release(held);
                }
                held = s;
#endif
                if (++s == STAGES) {
                    s = 0;
                    phase ^= 1;
                }
            }
#if !CCO_EARLY_RELEASE
            mma_wait<0>();
            if (thread == 0)
                ring.release(held);
#endif

            store_rows<BN / 8>(acc, m0 + half * 64, n0, N, a_scale, b_scale, out);
        }
    }
    cluster_barrier();  // no CTA leaves while its peer may still multicast into it or arrive on it
}

// The ping-pong arrangement of the same pair (cuBLAS's at these shapes: 128x128 tiles, one consumer
// warpgroup a tile). The two consumers take the CTA's tiles in turn (tile j of the walk to consumer
// j % 2), each holding a whole 128x128 tile (two m64n128 MMAs a K slice, 128 registers a thread),
// so one consumer's epilogue runs while the other's MMAs keep the tensor cores busy. ``turn[c]``
// hands the ring to consumer c: the other consumer arrives on it once it has issued its tile's last
// MMAs, so the two main loops take the ring's steps strictly in order (a consumer never waits on a
// slot a lap ahead, where the barrier's parity would repeat). The shared operand's 128 rows are
// loaded 64 by each CTA (its tensor map has 64-row boxes); ``empty[s]`` takes one arrive from the
// step's consumer in each CTA. Shapes as above, with 128-column CTA tiles.
constexpr int PP_TN = 128;

extern "C" __global__ void __cluster_dims__(PAIR, 1, 1) __launch_bounds__(THREADS, CCO_MIN_BLOCKS)
cco_ptpc_gemm_pair_pingpong(const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b,
                            const float* __restrict__ a_scale, const float* __restrict__ b_scale,
                            __nv_bfloat16* __restrict__ out, int M, int N, int K, int group) {
    extern __shared__ uint8_t shared_raw[];
    const Ring<PP_TN> ring(shared_raw, 1, 2);  // the extra barriers: turn[0], turn[1]
    const uint32_t turn = ring.extra;
    const uint32_t rank = cta_rank();
    const int warpgroup = threadIdx.x / 128, thread = threadIdx.x % 128;
    const Walk<PP_TN> walk(M, N, group, rank);
    const int steps = K / BK, cluster = blockIdx.x / PAIR, clusters = gridDim.x / PAIR;

    if (warpgroup == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (thread == 0)
            load_ring(ring, walk, map_a, map_b, cluster, clusters, steps);
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        const int me = warpgroup - 1;
        float acc0[64], acc1[64];  // rows 0-63 and 64-127 of the consumer's tile
        for (int j = me;; j += 2) {
            const int t = cluster + j * clusters;
            if (t >= walk.tiles)
                break;
            int m0, n0;
            walk.origin(t, m0, n0);
            if (j > 0)
                barrier_wait(turn + 8 * me, ((j - 1) / 2) & 1);  // the other consumer issued tile j - 1
            int held = -1;
            for (int k = 0; k < steps; ++k) {
                const int g = j * steps + k, s = g % STAGES;
                barrier_wait(ring.full + 8 * s, (g / STAGES) & 1);
                mma_fence();
                const uint64_t a = smem_descriptor(ring.a + s * ring.A);
                const uint64_t b = smem_descriptor(ring.b + s * ring.B);
                constexpr uint64_t half_rows = 64 * BK >> 4;  // rows 64.. of A: the descriptor's 16-byte units
#pragma unroll
                for (int x = 0; x < BK / 32; ++x) {
                    mma_64x128x32(acc0, a + 2 * x, b + 2 * x, k > 0 || x > 0);
                    mma_64x128x32(acc1, a + half_rows + 2 * x, b + 2 * x, k > 0 || x > 0);
                }
                mma_commit();
                if (held >= 0) {
                    mma_wait<1>();
                    if (thread == 0)
                        ring.release(held);
                }
                held = s;
            }
            if (thread == 0)
                barrier_arrive_in(turn + 8 * (1 - me), rank);  // the ring is the other consumer's
            mma_wait<0>();
            if (thread == 0)
                ring.release(held);
            store_rows<PP_TN / 8>(acc0, m0, n0, N, a_scale, b_scale, out);
            store_rows<PP_TN / 8>(acc1, m0 + 64, n0, N, a_scale, b_scale, out);
        }
    }
    cluster_barrier();
}
