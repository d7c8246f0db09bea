// mxfp8's decode GEMM over its fp8 weight: out[M, n] (bf16) = x[M, K] (bf16) @ W.T (+ bias), where
// W[r, k] = w[r, k] (e4m3) * 2^(ws[r, k/32] - 127) (e8m0) for the weight's N rows (a multiple of a
// block's), of which the first n are stored, and x holds the call's rows already quantized and
// dequantized (the activation quantizer's bf16 rows, exact), M <= 64.
//
// Why: Hopper has no MMA that takes e8m0 scales, so mxfp8's rows otherwise run cuBLAS's bf16 GEMM
// over a bf16 copy of the weight, twice the bytes an fp8 weight needs; at decode sizes reading the
// weight is the call's whole cost. Here each weight byte is dequantized to bf16 in registers on its
// way to a bf16 MMA (mma.sync m16n8k16, the weight as the A operand: 16 weight rows by 8 tokens),
// so the call reads the fp8 weight and its scales once. Each weight value the MMA takes is the bf16
// copy's value, bit for bit: the exact dequantized value for scales from 2^-124 up, rounded to
// nearest even below (one rounding, as the copy's); the MMA then sums exact bf16 products in fp32.
//
// The conversion is integer work, not conversion instructions (fewer results a clock): an e4m3
// byte b placed at bits 8..15 of a 16-bit lane becomes the bf16 of b's value times 2^-120 by
// ((lane >> 4) & 0x07F0) | (lane & 0x8000) (sign kept, exponent and mantissa moved under bf16's;
// e4m3's subnormals land on bf16's subnormals with the same factor), two lanes an instruction.
// One bf16x2 FMA by 2^(e - 7) (e the group's e8m0 byte) then gives the copy's W. That multiplier is a
// normal bf16 for e <= 134 (a scale of at most 2^7); the launcher refuses weights with larger ones.
//
// K order: a dot product does not depend on the order of its terms, so A and B fragments may take
// any permutation of K as long as both take the same. Thread (g, t) of a warp (g = lane / 4,
// t = lane % 4) holds bytes [16t, 16t + 16) of its weight rows g and g + 8 within each 64-wide K
// block: one 16-byte load per row. MMA step s (0..3) of the block takes bytes 16t + 4s + (0, 1)
// as the fragment's logical k (2t, 2t + 1) and bytes 16t + 4s + (2, 3) as (2t + 8, 2t + 9); the
// B fragment takes the same physical k from the activation rows, 4 consecutive bf16 (8 bytes).
// Over t and s, 16t + 4s + j covers the block's 64 bytes once (host replay: tests/python/cco/
// test_mx_decode.py).
//
// Layout: a block of 4 warps takes 64 * CCO_TILES weight rows (CCO_TILES m16 tiles a warp) and one
// K slice; every warp reads the slice's activation rows from shared memory, filled by cp.async a
// 128-wide K step at a time (CCO_STAGES deep), rows padded to 272 bytes so that a fragment read is
// conflict-free.
// The weight streams through registers CCO_PREFETCH - 1 steps ahead of the MMAs. The CCO_SLICES K
// slices of a row block are one cluster, which sums its blocks' partials through shared memory
// (the end of mx_decode). A first build reduced through global memory (the last block of a row
// block summing fp32 partials): at 64 rows that round trip cost more than the weight's read.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace cg = cooperative_groups;

#ifndef CCO_STAGES
#define CCO_STAGES 3
#endif
#ifndef CCO_SLICES
#define CCO_SLICES 8  // K slices of a row block, one cluster (1, 2, 4 or 8)
#endif
#ifndef CCO_TILES
#define CCO_TILES 2  // m16 tiles of weight rows a warp (a block: 64 rows a tile)
#endif
#ifndef CCO_PREFETCH
#define CCO_PREFETCH 3  // steps of weight in registers: the current one and the loads in flight
#endif

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTiles = CCO_TILES;                // m16 tiles of weight rows a warp
constexpr int kRows = kWarps * kTiles * 16;      // weight rows a block
constexpr int kStep = 128;                       // K elements a step
constexpr int kRowBytes = kStep * 2 + 16;        // an activation row of a step in shared memory
constexpr int kRedStride = kRows + 4;            // a token's fp32 partial row (padded: conflict-free stores)

__device__ __forceinline__ uint4 load_stream(const uint8_t* p) {
  uint4 v;  // the weight is read once: keep it out of L1
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// two e4m3 bytes at bits 8..15 and 24..31 -> their bf16 pair, each times 2^-120
__device__ __forceinline__ uint32_t bf16_pair(uint32_t placed) {
  return ((placed >> 4) & 0x07F007F0u) | (placed & 0x80008000u);
}

__device__ __forceinline__ uint32_t scale_pair(uint32_t pair, uint32_t mult) {
  uint32_t out;  // pair * mult + (-0): exact for a power-of-two mult; subnormals kept (no .ftz on bf16)
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(pair), "r"(mult), "r"(0x80008000u));
  return out;
}

__device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                    uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool real) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(real ? 16 : 0));
}

// One step's weight of a thread: for each tile, rows g and g + 8, each two 16-byte pieces (K blocks
// 0 and 1 of the step), and per row the step's four e8m0 bytes.
struct Weights {
  uint4 bytes[kTiles][2][2];
  uint32_t scales[kTiles][2];
};

__device__ __forceinline__ void load_step(Weights& w, const uint8_t* rows, const uint8_t* scales, int k, int k0,
                                          int t) {
#pragma unroll
  for (int i = 0; i < kTiles; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = i * 16 + h * 8;  // rows g (h 0) and g + 8 (h 1) of tile i, from the thread's first
      w.bytes[i][h][0] = load_stream(rows + (size_t)row * k + k0 + 16 * t);
      w.bytes[i][h][1] = load_stream(rows + (size_t)row * k + k0 + 64 + 16 * t);
      w.scales[i][h] = load_u32(scales + (size_t)row * (k / 32) + k0 / 32);
    }
}

// a step: per 64-wide block, the tiles' A fragments (dequantized once), then every token tile's MMAs
template <int kTok>
__device__ __forceinline__ void compute_step(float (&acc)[kTiles][kTok][4], const Weights& w, const uint8_t* xs,
                                             int g, int t) {
#pragma unroll
  for (int blk = 0; blk < 2; ++blk) {
    uint32_t a[kTiles][4][4];  // [tile][step s][fragment register]
#pragma unroll
    for (int i = 0; i < kTiles; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t e = (w.scales[i][h] >> (8 * (2 * blk + t / 2))) & 0xFFu;  // this 16-byte piece's group
        const uint32_t m = (e + 120u) << 7;                                     // bf16 of 2^(e - 7)
        const uint32_t mult = m | (m << 16);
        const uint32_t words[4] = {w.bytes[i][h][blk].x, w.bytes[i][h][blk].y, w.bytes[i][h][blk].z,
                                   w.bytes[i][h][blk].w};
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          a[i][s][h] = scale_pair(bf16_pair(__byte_perm(words[s], 0, 0x1404)), mult);      // bytes 0, 1
          a[i][s][2 + h] = scale_pair(bf16_pair(__byte_perm(words[s], 0, 0x3424)), mult);  // bytes 2, 3
        }
      }
    uint32_t b[kTok][8];  // the token tiles' B fragments of the block, then the MMAs step by step
#pragma unroll
    for (int j = 0; j < kTok; ++j) {
      const uint8_t* row = xs + (j * 8 + g) * kRowBytes + blk * 128 + 32 * t;
      const uint4 lo = *reinterpret_cast<const uint4*>(row);
      const uint4 hi = *reinterpret_cast<const uint4*>(row + 16);
      b[j][0] = lo.x, b[j][1] = lo.y, b[j][2] = lo.z, b[j][3] = lo.w;
      b[j][4] = hi.x, b[j][5] = hi.y, b[j][6] = hi.z, b[j][7] = hi.w;
    }
#pragma unroll
    for (int s = 0; s < 4; ++s)  // (an accumulator's next MMA comes kTok * kTiles MMAs later)
#pragma unroll
      for (int j = 0; j < kTok; ++j)
#pragma unroll
        for (int i = 0; i < kTiles; ++i)
          mma(acc[i][j], a[i][s][0], a[i][s][1], a[i][s][2], a[i][s][3], b[j][2 * s], b[j][2 * s + 1]);
  }
}

// One output element: the product rounded to bf16, then, with a bias, that plus the bias rounded again
// (torch's ``out += bias`` on bf16: the layers' general path); the weight's padded features (col >= n)
// are not stored, so the call's own [m, n] output is written directly.
__device__ __forceinline__ void put(__nv_bfloat16* out, int ldo, const __nv_bfloat16* bias, int n, int tok, int col,
                                    float v) {
  if (col >= n) return;
  __nv_bfloat16 r = __float2bfloat16_rn(v);
  if (bias != nullptr) r = __float2bfloat16_rn(__bfloat162float(r) + __bfloat162float(bias[col]));
  out[(size_t)tok * ldo + col] = r;
}

template <int kTok>
__device__ void mx_decode(const __nv_bfloat16* __restrict__ x, int ldx, const uint8_t* __restrict__ w,
                          const uint8_t* __restrict__ ws, const __nv_bfloat16* __restrict__ bias,
                          __nv_bfloat16* __restrict__ out, int ldo, int m, int n, int k) {
  extern __shared__ __align__(128) uint8_t smem[];
  constexpr int kStageBytes = kTok * 8 * kRowBytes;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.x * kRows;
  const int slices = CCO_SLICES, slice = blockIdx.y;  // (the grid's y is one cluster of the slices)
  const int steps = k / kStep;
  const int s0 = (int)((long)steps * slice / slices), s1 = (int)((long)steps * (slice + 1) / slices);
  const int count = s1 - s0;

  const uint8_t* rows = w + (size_t)(n0 + warp * kTiles * 16 + g) * k;
  const uint8_t* scales = ws + (size_t)(n0 + warp * kTiles * 16 + g) * (k / 32);
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(smem);

  auto fill = [&](int step, int stage) {  // the step's activation rows into a stage (pad rows zero)
    for (int c = tid; c < kTok * 8 * 16; c += kThreads) {
      const int r = c / 16, piece = c % 16;
      const bool real = r < m;
      const __nv_bfloat16* src = x + (size_t)(real ? r : 0) * ldx + (size_t)step * kStep + piece * 8;
      cp_async16(base + stage * kStageBytes + r * kRowBytes + piece * 16, src, real);
    }
  };

  float acc[kTiles][kTok][4];
#pragma unroll
  for (int i = 0; i < kTiles; ++i)
#pragma unroll
    for (int j = 0; j < kTok; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;

#pragma unroll
  for (int p = 0; p < CCO_STAGES - 1; ++p) {
    if (p < count) fill(s0 + p, p);
    asm volatile("cp.async.commit_group;");
  }
  // the weight: CCO_PREFETCH steps in registers, the next ones' loads issued before a step's MMAs
  Weights ring[CCO_PREFETCH];
#pragma unroll
  for (int p = 0; p < CCO_PREFETCH - 1; ++p)
    if (p < count) load_step(ring[p], rows, scales, k, (s0 + p) * kStep, t);
  for (int i0 = 0; i0 < count; i0 += CCO_PREFETCH) {
#pragma unroll
    for (int d = 0; d < CCO_PREFETCH; ++d) {  // (unrolled: the ring's indices are constants)
      const int i = i0 + d;
      if (i >= count) break;
      asm volatile("cp.async.wait_group %0;" ::"n"(CCO_STAGES - 2));
      __syncthreads();  // step i's rows are in, and every warp is done with the stage refilled below
      if (i + CCO_STAGES - 1 < count) fill(s0 + i + CCO_STAGES - 1, (i + CCO_STAGES - 1) % CCO_STAGES);
      asm volatile("cp.async.commit_group;");
      if (i + CCO_PREFETCH - 1 < count)
        load_step(ring[(d + CCO_PREFETCH - 1) % CCO_PREFETCH], rows, scales, k, (s0 + i + CCO_PREFETCH - 1) * kStep, t);
      compute_step<kTok>(acc, ring[d], smem + (i % CCO_STAGES) * kStageBytes, g, t);
    }
  }
  asm volatile("cp.async.wait_group 0;");

  // C fragment: c0, c1 at weight row g, tokens 2t, 2t + 1; c2, c3 at row g + 8
  auto each = [&](auto&& put) {
#pragma unroll
    for (int i = 0; i < kTiles; ++i)
#pragma unroll
      for (int j = 0; j < kTok; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int col = n0 + warp * kTiles * 16 + i * 16 + g + (c / 2) * 8, tok = j * 8 + 2 * t + (c % 2);
          if (tok < m) put(tok, col, acc[i][j][c]);
        }
  };
  if (CCO_SLICES == 1) {
    each([&](int tok, int col, float v) { put(out, ldo, bias, n, tok, col, v); });
    return;
  }
  // The slices of a row block are one cluster: each block leaves its partial in its own shared
  // memory (the stages are free now), and block r of the cluster sums outputs r, r + S, ... of the
  // row block over the cluster's blocks in slice order, reading their shared memory (DSMEM): no
  // partial goes through global memory, and every call gives the same bits.
  float* red = reinterpret_cast<float*>(smem);  // [tokens][kRedStride]
  __syncthreads();  // every warp is done with the stages
  each([&](int tok, int col, float v) { red[tok * kRedStride + (col - n0)] = v; });
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every block's partial is in
  const float* parts[CCO_SLICES];
#pragma unroll
  for (int sl = 0; sl < CCO_SLICES; ++sl) parts[sl] = cluster.map_shared_rank(red, sl);
  for (int q = slice * kThreads + tid; q < m * (kRows / 4); q += CCO_SLICES * kThreads) {
    const int tok = q / (kRows / 4), col = 4 * (q % (kRows / 4));
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int sl = 0; sl < CCO_SLICES; ++sl) {
      const float4 v = *reinterpret_cast<const float4*>(parts[sl] + tok * kRedStride + col);
      sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
    }
    put(out, ldo, bias, n, tok, n0 + col, sum.x);
    put(out, ldo, bias, n, tok, n0 + col + 1, sum.y);
    put(out, ldo, bias, n, tok, n0 + col + 2, sum.z);
    put(out, ldo, bias, n, tok, n0 + col + 3, sum.w);
  }
  cluster.sync();  // no block leaves while another still reads its shared memory
}

}  // namespace

#define CCO_MX_DECODE(TOK)                                                                                  \
  extern "C" __global__ void __launch_bounds__(kThreads) __cluster_dims__(1, CCO_SLICES, 1)               \
      cco_mx_decode_##TOK(const __nv_bfloat16* x, int ldx, const uint8_t* w, const uint8_t* ws,           \
                          const __nv_bfloat16* bias, __nv_bfloat16* out, int ldo, int m, int n, int k) {  \
    mx_decode<TOK>(x, ldx, w, ws, bias, out, ldo, m, n, k);                                               \
  }

CCO_MX_DECODE(1)
CCO_MX_DECODE(2)
CCO_MX_DECODE(4)
CCO_MX_DECODE(8)
