// Lightning indexer (DSV4 §3.8): index-key writer, weighted-ReLU MQA logits on FP8 tensor cores, and a
// deadlock-free exact top-k. Plus the seeds' baseline (dequantize -> fp32 "einsum" -> full bitonic sort), the
// reference the targets are measured against. One file (one module, one cubin): the writer, logits, top-k and
// baseline share the key-cache layout, the order key and the wgmma / TMA helpers, and the launcher resolves every
// entry point from the family's module.
//
// Routed path (src/ops/indexer/mod.rs `logits` / `topk` / `run`):
//   Logits, FP8 keys: indexer_logits_fp8_n1 / _n2 = native wgmma e4m3 fed by a TMA + mbarrier ring ("FP8 logits"
//     below). MXFP4 keys: the e4m3 mma.sync kernels indexer_logits_mxfp4_n1 / _n2 ("MXFP4 logits").
//   Top-k, three launches: indexer_topk_hist (4096-bin histogram of the top 12 key bits) -> indexer_topk_select
//     (threshold select, many CTAs per row, one slot atomic per counter per CTA) -> indexer_topk_final (exact
//     final pass, 8..32 CTAs per row ranking by counting, one-CTA radix select + bitonic sort fallback for
//     threshold buckets above 4096 entries). For k <= 512 the same bodies through their PDL entry points (*_pdl,
//     "Top-k PDL entry points").
// Graph safety: no grid depends on num_valid. Grids are sized from capacities (the cache capacity, the score
// row length) and every kernel reads num_valid on the device, clamps it to 0..capacity (logits) or
// 0..score_stride (top-k), and skips the work past it: a CTA with no visible entry returns before its first
// barrier (histogram, select, MXFP4 logits, baselines), a persistent FP8-logits CTA skips empty tiles on both
// sides of its mbarrier ring, and the final pass's CTAs always take part in their row's arrival protocol.
// The writer reads its slots on the device and skips a slot outside the cache.
// Key-sequence map (the routed logits kernels' key_seq, null = identity): query sequence b scores the keys of
// cache sequence key_seq[b], so several query sequences (the engine's prefill chunk: C rows of one sequence, each
// with its own num_valid) can share one cache sequence; the launcher checks its length, the values must be valid
// sequences of the cache (the tensor maps cover only its planes).
// Budget at 1M context, batch 1 (262,144 keys, 34.6 MB): HBM floor 8.1 us at 4.25 TB/s; the top-k reads the
// 1 MB of scores twice (histogram, select) plus a few KB per row in the final pass.
//
// ---- Key cache (two planes per format, entry slot = b * capacity + j) -----------------------------------
//   FP8  : codes[slot][128] e4m3, scales[slot] fp32 (x = e4m3 * scale)               132 B / entry
//   MXFP4: codes[slot][64] e2m1 (dim 2i in the low nibble), scales[slot][4] ue8m0       68 B / entry
// Writer: one warp per key, lane l holds dims 4l..4l+3. 128-point Walsh-Hadamard = 7 butterfly stages
// (h = 1, 2 inside a lane; h = 4..64 across lanes with shfl_xor(h/4)), then * 1/sqrt(128) (0x3DB504F3).
// Every stage is an f32 add/sub of the same two values as the CPU loop (addition is commutative), and the
// quantizer uses __fdiv_rn, so the codes are bit-identical to src/ops/indexer/reference.rs.
//
// ---- Logits: score[row, j] = sum_h w[row,h] * relu(q[row,h] . k_j) ----------------------------------------
// q's per-token scale is folded into w by the caller (relu(s x) = s relu(x), s > 0). relu is fmaxf(x, 0)
// (NaN -> 0, same in the reference).
// MXFP4 logits (logits_mxfp4_body): mma.sync m16n8k32 e4m3 x e4m3 -> f32 with keys on M (16 per m-tile) and
// heads on N (8 per n-tile, 8 tiles). The dot product is a sum over the 128 dims, so any permutation of K applied
// to both A and B leaves it unchanged; k-step s must be exactly scale block s (dims 32s..32s+31) so its ue8m0
// scale can be applied to the k-step's partial product: lane t takes dims 32s + 8t .. +7 = one u32 of packed
// codes. e2m1 -> e4m3 is exact (a 16-entry byte LUT via __byte_perm + the sign bit), the block scale is applied
// in fp32 after each k-step's MMA (x = e2m1 * 2^e exactly; no range condition needed).
// q fragments live in shared memory in fragment order (one conflict-free 8-byte load per lane per (n-tile,
// k-step)). Epilogue per n-tile: relu and * w, accumulated per key in fp32; then the 4 lanes of a group are
// summed. Work split: a warp tile is 2 m-tiles = 32 keys (A fragments stay in 32 registers), a CTA of 8 warps
// covers 1024 keys; the q fragments are re-read from shared memory per (n-tile, k-step): 8 KB of lds per 4 KB
// of keys, well under the shared-memory bandwidth. 0 spills (ptxas), 2 CTAs/SM (next_n = 2: 168 registers,
// 1 CTA/SM).
//
// ---- Top-k (k <= 2048) ----------------------------------------------------------------------------------
// Total order: composite = (order_key(score) << 32) | ~index (u64; NaN -> -inf, -0 -> +0). The composite
// is unique per entry, so "the k largest composites" is exactly "score desc, lower index wins".
// Shared helpers (used by the fallback of indexer_topk_final): block_select = one CTA's
// MSB-first radix select over 64-bit composites (8-bit digits, at most 8 passes, early exit when the
// chosen bucket holds exactly the remaining count), block_collect = a ballot-compacted collection of the
// selected elements, sort_and_write = a bitonic sort of the chosen k and the final row write.
// Deadlock freedom: every __syncthreads() sits either in straight-line code or in a loop whose trip count
// is a function of block-uniform values only (pass < 8 with a break on a value read from shared memory
// after a barrier; bitonic size/stride from kpad); every per-element loop (trip counts that differ between
// threads) contains no barrier, and warp collectives inside them run over warp-uniform trip counts
// (base += blockDim, the element test is inside). No global lock, no inter-CTA wait.
#include <stdint.h>
#include "common/formats.cuh"
#include "common/index_key.cuh"
#include "common/pdl.cuh"
#include "common/topk_order.cuh"
#include "common/wgmma.cuh"

namespace {

constexpr int HEADS = 64;
constexpr int DIM = 128;
constexpr unsigned FULL = 0xffffffffu;

// ------------------------------------------------------------------------------------------------------------
// Key writer
// ------------------------------------------------------------------------------------------------------------

using mm::hadamard128_warp;  // kernels/common/hadamard.cuh

__device__ __forceinline__ bool load_raw_key(const float* __restrict__ raw, const int* __restrict__ slots, int n,
                                             int num_slots, int key, int lane, float v[4], int& slot) {
    if (key >= n) return false;
    slot = slots[key];
    if (slot < 0 || slot >= num_slots) return false;  // the launcher rejects these; never write out of range
    float4 x = reinterpret_cast<const float4*>(raw + (size_t)key * DIM)[lane];
    v[0] = x.x; v[1] = x.y; v[2] = x.z; v[3] = x.w;
    return true;
}

}  // namespace

// raw [n][128] f32 keys, slots[n] flat entry slots; writes codes[slot][128], scales[slot] (fp32).
extern "C" __global__ void __launch_bounds__(256) indexer_write_keys_fp8(const float* __restrict__ raw,
                                                                       const int* __restrict__ slots, int n,
                                                                       int num_slots, uint8_t* __restrict__ codes,
                                                                       float* __restrict__ scales) {
    const int lane = threadIdx.x & 31;
    const int key = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    float v[4];
    int slot;
    if (!load_raw_key(raw, slots, n, num_slots, key, lane, v, slot)) return;  // warp-uniform
    hadamard128_warp(v, lane);
    index_key::store_fp8(v, lane, codes, scales, slot);
}

// raw [n][128] f32 keys; writes codes[slot][64] packed e2m1 and scales[slot][4] ue8m0.
extern "C" __global__ void __launch_bounds__(256) indexer_write_keys_mxfp4(const float* __restrict__ raw,
                                                                         const int* __restrict__ slots, int n,
                                                                         int num_slots, uint8_t* __restrict__ codes,
                                                                         uint8_t* __restrict__ scales) {
    const int lane = threadIdx.x & 31;
    const int key = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    float v[4];
    int slot;
    if (!load_raw_key(raw, slots, n, num_slots, key, lane, v, slot)) return;
    hadamard128_warp(v, lane);
    index_key::store_mxfp4(v, lane, codes, scales, slot);
}

// ------------------------------------------------------------------------------------------------------------
// Logits
// ------------------------------------------------------------------------------------------------------------
namespace {

constexpr int LG_WARPS = 8;
constexpr int LG_MT = 2;                      // m-tiles of 16 keys per warp tile
constexpr int LG_WARP_KEYS = 16 * LG_MT;      // 64
constexpr int LG_CTA_KEYS = 1024;             // keys per CTA (each warp: 2 tiles)

__device__ __forceinline__ void mma_e4m3(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 4 e2m1 codes (nibbles of the low 16 bits of p, lowest first) -> 4 e4m3 bytes. Exact: every e2m1 value is
// an e4m3 value. LUT magnitudes {0,.5,1,1.5,2,3,4,6} = e4m3 {00,30,38,3C,40,44,48,4C}; bit 3 -> bit 7.
__device__ __forceinline__ uint32_t e2m1x4_to_e4m3x4(uint32_t p) {
    const uint32_t lut_lo = 0x3C383000u, lut_hi = 0x4C484440u;
    uint32_t mag = __byte_perm(lut_lo, lut_hi, p & 0x7777u);
    uint32_t sgn = ((p & 0x8u) << 4) | ((p & 0x80u) << 8) | ((p & 0x800u) << 12) | ((p & 0x8000u) << 16);
    return mag | sgn;
}

template <int NEXT_N>
__device__ __forceinline__ void logits_mxfp4_body(const uint8_t* __restrict__ q, const float* __restrict__ w,
                                                  const uint8_t* __restrict__ codes, const void* __restrict__ scales_v,
                                                  const int* __restrict__ num_valid,
                                                  const int* __restrict__ key_seq, int capacity,
                                                  float* __restrict__ scores, int score_stride) {
    __shared__ __align__(16) uint2 q_frag[NEXT_N][8][4][32];
    __shared__ __align__(16) float w_s[NEXT_N][HEADS];
    const int b = blockIdx.y;
    int n_seq = 0;
#pragma unroll
    for (int t = 0; t < NEXT_N; ++t) n_seq = max(n_seq, min(max(num_valid[b * NEXT_N + t], 0), capacity));
    const int cta_begin = blockIdx.x * LG_CTA_KEYS;
    if (cta_begin >= n_seq) return;  // block-uniform, before any barrier
    const int cta_end = min(cta_begin + LG_CTA_KEYS, n_seq);

    for (int e = threadIdx.x; e < NEXT_N * 8 * 4 * 32; e += blockDim.x) {
        const int ln = e & 31, s = (e >> 5) & 3, nt = (e >> 7) & 7, t = e >> 10;
        const int head = nt * 8 + (ln >> 2), tq = ln & 3;
        const int off = s * 32 + tq * 8;
        q_frag[t][nt][s][ln] =
            *reinterpret_cast<const uint2*>(q + ((size_t)(b * NEXT_N + t) * HEADS + head) * DIM + off);
    }
    for (int e = threadIdx.x; e < NEXT_N * HEADS; e += blockDim.x) w_s[e / HEADS][e % HEADS] = w[(size_t)b * NEXT_N * HEADS + e];
    __syncthreads();  // the only barrier of the kernel

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3;
    // The key sequence of query sequence b: key_seq[b] (several query sequences may share one), null = b.
    const size_t seq_slot0 = (size_t)(key_seq != nullptr ? key_seq[b] : b) * capacity;

    for (int tile = cta_begin + warp * LG_WARP_KEYS; tile < cta_end; tile += LG_WARPS * LG_WARP_KEYS) {
        uint32_t a[LG_MT][4][4];
        uint32_t sc4[LG_MT][2];  // the 4 ue8m0 codes of rows g and g+8
#pragma unroll
        for (int mt = 0; mt < LG_MT; ++mt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = tile + mt * 16 + g + half * 8;
                const bool ok = row < n_seq;
                const uint32_t* p = reinterpret_cast<const uint32_t*>(codes + (seq_slot0 + row) * (DIM / 2));
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    const uint32_t packed = ok ? __ldg(p + s * 4 + tq) : 0u;
                    a[mt][s][half] = e2m1x4_to_e4m3x4(packed & 0xFFFFu);
                    a[mt][s][2 + half] = e2m1x4_to_e4m3x4(packed >> 16);
                }
                sc4[mt][half] = ok ? __ldg(reinterpret_cast<const uint32_t*>(scales_v) + seq_slot0 + row) : 0u;
            }
        }

#pragma unroll 1
        for (int t = 0; t < NEXT_N; ++t) {
            float part[LG_MT][2];
#pragma unroll
            for (int mt = 0; mt < LG_MT; ++mt) part[mt][0] = part[mt][1] = 0.f;
#pragma unroll 1
            for (int nt = 0; nt < 8; ++nt) {
                uint2 bq[4];
#pragma unroll
                for (int s = 0; s < 4; ++s) bq[s] = q_frag[t][nt][s][lane];
                const float2 wv = *reinterpret_cast<const float2*>(&w_s[t][nt * 8 + 2 * tq]);
#pragma unroll
                for (int mt = 0; mt < LG_MT; ++mt) {
                    float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                    for (int s = 0; s < 4; ++s) {
                        float d[4] = {0.f, 0.f, 0.f, 0.f};
                        mma_e4m3(d, a[mt][s], bq[s].x, bq[s].y);
                        const float s0 = mm::ue8m0_decode((uint8_t)(sc4[mt][0] >> (8 * s)));
                        const float s1 = mm::ue8m0_decode((uint8_t)(sc4[mt][1] >> (8 * s)));
                        c[0] = fmaf(d[0], s0, c[0]);
                        c[1] = fmaf(d[1], s0, c[1]);
                        c[2] = fmaf(d[2], s1, c[2]);
                        c[3] = fmaf(d[3], s1, c[3]);
                    }
                    part[mt][0] = fmaf(wv.x, fmaxf(c[0], 0.f), part[mt][0]);
                    part[mt][0] = fmaf(wv.y, fmaxf(c[1], 0.f), part[mt][0]);
                    part[mt][1] = fmaf(wv.x, fmaxf(c[2], 0.f), part[mt][1]);
                    part[mt][1] = fmaf(wv.y, fmaxf(c[3], 0.f), part[mt][1]);
                }
            }
            float* out = scores + (size_t)(b * NEXT_N + t) * score_stride;
#pragma unroll
            for (int mt = 0; mt < LG_MT; ++mt) {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    float v = part[mt][half];
                    v += __shfl_xor_sync(FULL, v, 1);
                    v += __shfl_xor_sync(FULL, v, 2);
                    const int row = tile + mt * 16 + g + half * 8;
                    if (tq == half && row < n_seq) out[row] = v;
                }
            }
        }
    }
}

}  // namespace

// grid (ceil(capacity / 1024), batch), block 256; a CTA past its sequence's num_valid returns at once.
#define INDEXER_LOGITS_MXFP4_ENTRY(NAME, NEXT_N, MIN_BLOCKS)                                                    \
    extern "C" __global__ void __launch_bounds__(LG_WARPS * 32, MIN_BLOCKS)                                     \
        NAME(const uint8_t* __restrict__ q, const float* __restrict__ w, const uint8_t* __restrict__ codes,      \
             const void* __restrict__ scales, const int* __restrict__ num_valid,                                 \
             const int* __restrict__ key_seq, int capacity, float* __restrict__ scores, int score_stride) {      \
        logits_mxfp4_body<NEXT_N>(q, w, codes, scales, num_valid, key_seq, capacity, scores, score_stride);     \
    }

INDEXER_LOGITS_MXFP4_ENTRY(indexer_logits_mxfp4_n1, 1, 2)
// 2 query tokens x the e2m1 expansion need more than 128 registers: one CTA per SM, no spills.
INDEXER_LOGITS_MXFP4_ENTRY(indexer_logits_mxfp4_n2, 2, 1)

// ------------------------------------------------------------------------------------------------------------
// FP8 logits, the wgmma pieces (used by logits_tma_body, "FP8 logits" below): native Hopper FP8 wgmma on key
// tiles in shared memory.
//   * Tile = 64 keys x 128 B (8 KB) = the wgmma M. A CTA's consumers are one warpgroup (128 threads).
//   * Layout: the 128B-swizzled K-major wgmma layout: row r's 16-byte chunk c lands at r * 128 + ((c ^ (r & 7))
//     << 4) of a 1024-aligned tile (8-row groups 1024 B apart = SBO).
//   * q (e4m3 [NEXT_N * 64 heads][128], B operand, N = 64 heads per token) is stored once per sequence change
//     in the same swizzled layout; NEXT_N = 2 puts both tokens' heads on N = 128 (one m64n128k32 per k-step).
//   * wgmma.m64nNk32.f32.e4m3.e4m3, both operands from shared memory, K-major: k-step s (dims 32s..32s+31)
//     advances both descriptors' start address by 32 B (the swizzle is applied to the computed address, so
//     the XOR pattern above stays consistent). 4 k-steps per tile; products of two e4m3 values are exact,
//     the tensor core's FP8 accumulation keeps fewer than 24 bits (DeepSeek-V3 measured ~14 on H800), so
//     scores are NOT bit-identical to an fp32-accumulated dot product; the tests bound the difference against
//     the f64 reference.
//   * Epilogue: the accumulator fragment d[j * 4 + e] of thread (warp w, g = lane / 4, tq = lane % 4) is row
//     16w + g + 8 * (e >= 2), column j * 8 + 2 * tq + (e & 1) (column = t * 64 + head). Per row: sum over the
//     thread's 16 (per token) columns of w * relu (fmaxf: NaN -> 0), then 2 xor-shuffles over the quad,
//     * key scale (scale > 0 commutes with relu; a NaN scale gives NaN), stored for row < n_seq only.
namespace {

constexpr int LW_KEYS = 64;
constexpr int LW_TILE_BYTES = LW_KEYS * DIM;  // 8192

__device__ __forceinline__ uint32_t lw_smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// D[64 x 64] (+)= A[64 keys x 32] . B[64 heads x 32]^T, e4m3 x e4m3 -> f32; scale_d = 0 starts from zero.
__device__ __forceinline__ void wgmma_m64n64k32_e4m3(float (&d)[32], uint64_t da, uint64_t db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(scale_d));
}

// D[64 x 128] (+)= A[64 keys x 32] . B[128 (token, head) rows x 32]^T.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(scale_d));
}

template <int NEXT_N>
__device__ __forceinline__ int lw_seq_len(const int* __restrict__ num_valid, int b, int capacity) {
    int n_seq = 0;
#pragma unroll
    for (int t = 0; t < NEXT_N; ++t) n_seq = max(n_seq, min(max(num_valid[b * NEXT_N + t], 0), capacity));
    return n_seq;
}

}  // namespace

// ------------------------------------------------------------------------------------------------------------
// Top-k
// ------------------------------------------------------------------------------------------------------------
namespace {

constexpr int TOPK_MAX_K = 2048;

// The order (order_key, key_to_score, composite) is common/topk_order.cuh's, shared with the engine's fused
// short-row top-k.
using topk_order::composite;
using topk_order::key_to_score;
using topk_order::order_key;

struct SelectShared {
    uint32_t hist[256];
    uint32_t warp_sums[32];
    uint32_t bucket, new_rem, bucket_count, count;
};

// Radix select over m unique composites: on return, exactly kk (1 <= kk <= m) elements satisfy
// (c >> shift) >= (prefix >> shift). Block-uniform control flow only; every thread must call it.
template <class Src>
__device__ void block_select(const Src& src, int m, int kk, SelectShared& sh, uint64_t& prefix_out, int& shift_out) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    uint64_t prefix = 0;
    uint32_t rem = (uint32_t)kk;
    int shift = 64;
    for (int pass = 0; pass < 8; ++pass) {  // uniform trip count; uniform break below
        const int sd = 56 - 8 * pass;
        for (int i = tid; i < 256; i += blockDim.x) sh.hist[i] = 0;
        __syncthreads();
        for (int base = 0; base < m; base += blockDim.x) {  // no barrier inside; warp-uniform trip count
            const int i = base + tid;
            uint32_t digit = 256;  // "not counted"
            if (i < m) {
                const uint64_t c = src.comp(i);
                if (pass == 0 || (c >> (sd + 8)) == (prefix >> (sd + 8))) digit = (uint32_t)(c >> sd) & 0xFFu;
            }
            // Warp-aggregated counting. Fast paths (votes only): the whole warp in one bucket (typical of
            // the first, exponent-heavy digits), or no lane still matching the prefix (typical of later
            // passes). Otherwise one atomic per distinct digit. All branches are warp-uniform.
            const uint32_t d0 = __shfl_sync(FULL, digit, 0);
            if (__all_sync(FULL, digit == d0)) {
                if (lane == 0 && d0 < 256) atomicAdd(&sh.hist[d0], 32u);
            } else if (__any_sync(FULL, digit < 256)) {
                const unsigned peers = __match_any_sync(FULL, digit);
                if (digit < 256 && lane == __ffs(peers) - 1) atomicAdd(&sh.hist[digit], (uint32_t)__popc(peers));
            }
        }
        __syncthreads();
        // Inclusive scan of the histogram from the top bucket down (threads 0..255 <-> buckets 255..0).
        const uint32_t v = tid < 256 ? sh.hist[255 - tid] : 0u;
        uint32_t incl = v;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const uint32_t y = __shfl_up_sync(FULL, incl, o);
            if (lane >= o) incl += y;
        }
        if (tid < 256 && lane == 31) sh.warp_sums[warp] = incl;
        __syncthreads();
        if (tid < 256) {
            for (int w2 = 0; w2 < warp; ++w2) incl += sh.warp_sums[w2];
            const uint32_t excl = incl - v;
            if (excl < rem && incl >= rem) {  // exactly one bucket: the one holding the rem-th largest
                sh.bucket = 255 - tid;
                sh.new_rem = rem - excl;
                sh.bucket_count = v;
            }
        }
        __syncthreads();
        prefix |= (uint64_t)sh.bucket << sd;
        rem = sh.new_rem;
        shift = sd;
        const bool done = sh.bucket_count == rem;
        __syncthreads();  // all reads of sh.* done before the next pass rewrites it
        if (done) break;
    }
    prefix_out = prefix;
    shift_out = shift;
}

// Ballot-compacted collection of the selected elements; emit(pos, composite) with pos in [0, kk).
template <class Src, class Emit>
__device__ void block_collect(const Src& src, int m, bool all, uint64_t prefix, int shift, SelectShared& sh,
                              Emit emit) {
    const int tid = threadIdx.x, lane = tid & 31;
    if (tid == 0) sh.count = 0;
    __syncthreads();
    const uint64_t thr = all ? 0 : (prefix >> shift);
    for (int base = 0; base < m; base += blockDim.x) {  // no barrier inside
        const int i = base + tid;
        bool sel = false;
        uint64_t c = 0;
        if (i < m) {
            c = src.comp(i);
            sel = all || (c >> shift) >= thr;
        }
        const unsigned ballot = __ballot_sync(FULL, sel);
        uint32_t wbase = 0;
        if (lane == 0 && ballot) wbase = atomicAdd(&sh.count, (uint32_t)__popc(ballot));
        wbase = __shfl_sync(FULL, wbase, 0);
        if (sel) emit(wbase + __popc(ballot & ((1u << lane) - 1u)), c);
    }
    __syncthreads();
}

// Sort buf[0..kk) descending (pads with 0 up to the next power of two) and write the final row.
__device__ void sort_and_write(uint64_t* buf, int kk, int k, int* __restrict__ out_idx, float* __restrict__ out_score) {
    int kpad = 1;
    while (kpad < kk) kpad <<= 1;  // kk is block-uniform, so is kpad
    for (int i = kk + threadIdx.x; i < kpad; i += blockDim.x) buf[i] = 0;
    __syncthreads();
    for (int size = 2; size <= kpad; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < kpad; i += blockDim.x) {  // no barrier inside
                const int j = i ^ stride;
                if (j > i) {
                    const uint64_t x = buf[i], y = buf[j];
                    const bool desc = (i & size) == 0;
                    if (desc ? (x < y) : (x > y)) {
                        buf[i] = y;
                        buf[j] = x;
                    }
                }
            }
            __syncthreads();
        }
    }
    for (int j = threadIdx.x; j < k; j += blockDim.x) {
        if (j < kk) {
            const uint64_t c = buf[j];
            out_idx[j] = (int)~(uint32_t)c;
            out_score[j] = key_to_score((uint32_t)(c >> 32));
        } else {
            out_idx[j] = -1;
            out_score[j] = -INFINITY;
        }
    }
}

__device__ __forceinline__ int row_valid(const int* num_valid, int row, int score_stride) {
    return min(max(num_valid[row], 0), score_stride);
}

}  // namespace

// ------------------------------------------------------------------------------------------------------------
// Top-k: histogram -> threshold select with many CTAs per row -> an exact final pass per row.
//
// Pass 1, indexer_topk_hist, grid (ceil(score_stride / TKS_SLICE), rows) x 512 threads: a shared-memory
//   histogram of bin = order_key(score) >> 20 (the top 12 bits: sign, 8 exponent bits, 3 mantissa bits)
//   over the CTA's slice, flushed with one global atomicAdd per non-empty bin into hist[row][4096].
// Pass 2, indexer_topk_select, same grid: every CTA reads hist[row] (16 KB, from L2) and recomputes the
//   threshold bin B (scan from the top bin down: the unique bin with excl(B) < kk <= incl(B), kk = min(k, n)).
//   Entries with bin > B are selected for sure (there are excl(B) < kk of them): their composites go to
//   above[row][slot < k]; entries with bin == B go to bucket[row][slot < bucket_stride] (there are hist[B] <= n
//   of them). Slots come from one atomic per counter per CTA ("Top-k pass 2" below).
// Pass 3, indexer_topk_final ("Top-k final pass" below): rem = kk - above_count entries are still to pick from
//   the threshold bucket. Selecting the rem largest composites of bucket B plus every entry of a higher bin is
//   exactly the kk largest composites of the row, because bin is a monotone function of the composite's top
//   12 bits. Its fallback for large buckets runs block_select over the bucket's composites straight from global
//   memory, then sorts the kk composites (bitonic) and writes them in the contract's order.
// Reset: the final pass zeroes hist, the counters and its arrival counters (its reset protocol), so the
//   buffers are zero again at the end of every call: graph replays and back-to-back calls need no memset. The
//   caller zeroes them once when it carves them, and again after a call interrupted between launches.
// Memory safety does not depend on the histogram being right: every slot is bounds-checked.
// Size of the threshold bucket: for scores with a smooth density f near the k-th largest value s_k, B holds
//   about n * f(s_k) * s_k / 8 entries (3 mantissa bits = bins 1/8 of an octave wide); for Gaussian-like
//   logits and k / n = 512 / 262144 that is a few hundred, far below the shared-memory capacity. Heavy ties
//   (all-equal rows) put the whole row in B: still exact, through the fallback.
// Deadlock freedom: pass 1 and 2 have barriers only in straight-line code after a block-uniform early
//   return (a slice at or past the row's num_valid); their per-element loops have compile-time trip counts
//   (TKS_PER_THREAD) and warp-uniform ballots; no CTA of pass 1 or 2 waits for another. The final pass calls
//   block_select / block_collect / sort_and_write (argument above) with block-uniform (m, kk) read from global
//   memory before its first barrier.
// ------------------------------------------------------------------------------------------------------------
namespace {

// TKS_*: the slice passes (histogram, select); TKF_*: the final pass.
constexpr int TKS_BITS = 12;
constexpr int TKS_BINS = 1 << TKS_BITS;  // 4096
constexpr int TKS_SHIFT = 32 - TKS_BITS;
constexpr int TKS_THREADS = 512;
constexpr int TKS_PER_THREAD = 8;
constexpr int TKS_SLICE = TKS_THREADS * TKS_PER_THREAD;  // 4096 entries per pass-1/pass-2 CTA
constexpr int TKS_BINS_PER_THREAD = TKS_BINS / TKS_THREADS;  // 8
static_assert(TKS_BINS_PER_THREAD == 8, "the threshold scan loads 8 bins per thread as two uint4");

struct GlobalCompSrc {
    const uint64_t* comps;
    __device__ __forceinline__ uint64_t comp(int i) const { return comps[i]; }
};

}  // namespace

// ------------------------------------------------------------------------------------------------------------
// Top-k PDL entry points (`TopkPath::Pdl`, routed for k <= 512; select and final: the plain kernels are the
// PDL = false instances of the same bodies; hist: a copy). Launched with the programmatic-stream-serialization
// attribute, a kernel may be scheduled while the previous kernel of the stream still runs; `griddepcontrol.wait` blocks
// until that kernel has COMPLETED and its memory operations are visible; `griddepcontrol.launch_dependents`
// lets the next PDL kernel be scheduled once every CTA of this grid issued it or exited. Without the attribute
// both are no-ops. Why: the plain chain costs ~14-17 us at every context, of which the three kernels take ~15 us
// at 1M (ncu); the rest is kernel boundaries, which PDL overlaps with the previous kernel's tail.
// Protocol (the whole correctness argument):
//   * Before its griddepcontrol.wait, a PDL kernel touches NO global memory (not even num_valid): only kernel
//     parameters, index math and its own shared memory. So whatever the previous kernel(s) write or read
//     (scores from the logits, hist, counters, above / bucket, and the final pass's zeroing of hist / counters /
//     arrivals) is ordered exactly as with plain stream order.
//   * Every CTA executes the wait before it exits (also the CTAs that return early), so "grid i complete"
//     implies "grid i-1 complete": the final pass's wait (select complete) also covers hist and the logits,
//     although it is launched as soon as select's CTAs trigger.
//   * hist and select trigger their dependents at their first instruction (correctness never depends on where:
//     the dependent's wait is for full completion). Their dependents are then resident and parked in the wait
//     when they finish. No deadlock: a grid is launched only after EVERY CTA of the previous grid issued the
//     trigger (is resident) or exited, so the parked CTAs never keep a CTA of an earlier grid from starting.
//   * The final pass waits first (its body's griddepcontrol.wait) and never triggers; whatever the engine runs
//     next (the next call's logits included) is launched plainly, so it starts only once the final pass has
//     completed: its zeroing of hist / counters / arrivals finishes before the next call's hist starts.
//   * hist's predecessor may be any kernel (top-k alone): hist waits before reading num_valid or scores.
//   * Every other entry point of this file is launched plainly; the cascade hist and select allow is bounded by
//     the chain (hist, select, final resident together) because the final pass does not trigger.
// ------------------------------------------------------------------------------------------------------------

// hist [rows][4096] u32 (zero on entry). grid (ceil(max_n / 4096), rows), block 512.
extern "C" __global__ void __launch_bounds__(TKS_THREADS) indexer_topk_hist(const float* __restrict__ scores,
                                                                           int score_stride,
                                                                           const int* __restrict__ num_valid,
                                                                           uint32_t* __restrict__ hist) {
    __shared__ uint32_t h[TKS_BINS];
    const int row = blockIdx.y;
    const int n = row_valid(num_valid, row, score_stride);
    const int base = blockIdx.x * TKS_SLICE;
    if (base >= n) return;  // block-uniform, before any barrier
    for (int i = threadIdx.x; i < TKS_BINS; i += TKS_THREADS) h[i] = 0;
    const float* src = scores + (size_t)row * score_stride;
    float v[TKS_PER_THREAD];
#pragma unroll
    for (int r = 0; r < TKS_PER_THREAD; ++r) {  // all loads first: 8 in flight per thread
        const int i = base + r * TKS_THREADS + (int)threadIdx.x;
        v[r] = i < n ? src[i] : 0.f;
    }
    __syncthreads();  // h zeroed
#pragma unroll
    for (int r = 0; r < TKS_PER_THREAD; ++r) {
        const int i = base + r * TKS_THREADS + (int)threadIdx.x;
        if (i < n) atomicAdd(&h[order_key(v[r]) >> TKS_SHIFT], 1u);
    }
    __syncthreads();
    uint32_t* g = hist + (size_t)row * TKS_BINS;
    for (int i = threadIdx.x; i < TKS_BINS; i += TKS_THREADS) {
        const uint32_t c = h[i];
        if (c) atomicAdd(&g[i], c);
    }
}

// indexer_topk_hist for a PDL launch (see "Top-k PDL entry points"): the same code with the shared histogram
// zeroed before the wait (a separate copy rather than a template instance, which compiled the plain kernel to a
// register-renamed SASS).
extern "C" __global__ void __launch_bounds__(TKS_THREADS) indexer_topk_hist_pdl(const float* __restrict__ scores,
                                                                               int score_stride,
                                                                               const int* __restrict__ num_valid,
                                                                               uint32_t* __restrict__ hist) {
    __shared__ uint32_t h[TKS_BINS];
    pdl_trigger();
    for (int i = threadIdx.x; i < TKS_BINS; i += TKS_THREADS) h[i] = 0;  // shared memory only before the wait
    pdl_wait();  // before reading num_valid or scores, and before any return
    const int row = blockIdx.y;
    const int n = row_valid(num_valid, row, score_stride);
    const int base = blockIdx.x * TKS_SLICE;
    if (base >= n) return;  // block-uniform, before any barrier
    const float* src = scores + (size_t)row * score_stride;
    float v[TKS_PER_THREAD];
#pragma unroll
    for (int r = 0; r < TKS_PER_THREAD; ++r) {
        const int i = base + r * TKS_THREADS + (int)threadIdx.x;
        v[r] = i < n ? src[i] : 0.f;
    }
    __syncthreads();  // h zeroed
#pragma unroll
    for (int r = 0; r < TKS_PER_THREAD; ++r) {
        const int i = base + r * TKS_THREADS + (int)threadIdx.x;
        if (i < n) atomicAdd(&h[order_key(v[r]) >> TKS_SHIFT], 1u);
    }
    __syncthreads();
    uint32_t* g = hist + (size_t)row * TKS_BINS;
    for (int i = threadIdx.x; i < TKS_BINS; i += TKS_THREADS) {
        const uint32_t c = h[i];
        if (c) atomicAdd(&g[i], c);
    }
}
// ------------------------------------------------------------------------------------------------------------
// Top-k final pass, several CTAs per row (indexer_topk_final). Why several: one CTA ranking all chosen entries
// by counting is instruction-bound on the m^2 compares on ONE SM (~15 us at 1M / batch 1 / k 512). The ranks do
// not need one CTA: every chosen entry's output position is computable on its own. With a = #above-threshold
// entries (composites A[0..a), bin > B) and the threshold bucket's composites Bk[0..nb) (bin == B), rem = kk - a:
//     above entry c  -> position #{ A[j] > c }            (< a; every bucket entry is below every above entry)
//     bucket entry c -> position a + #{ Bk[j] > c }       if that rank is < rem (else not chosen)
//   All composites are unique (low word ~index), so each rank set is a permutation: every position
//   0..a+rem-1 is written exactly once (the identity model_rank_topk / model_mcta_topk in tests/indexer.rs
//   check on the CPU). This is exactly the contract's order.
// Grid (S, rows), S = gridDim.x >= TKF_MIN_SPLIT CTAs per row, TKF_THREADS threads. CTA s loads all of A and
//   Bk into shared memory (a <= k, nb <= TKF_BUCKET_CAP: a few KB from L2, written by pass 2 just before) and
//   ranks only its slice of each: above entries [s*ceil(a/S), ..), bucket entries [s*ceil(nb/S), ..). Work per
//   CTA ~ (a^2 + nb^2) / S compares. The j range is split so all threads work (rank_slice), partial counts
//   merged with shared-memory atomics. The -1 / -inf tail [a + rem, k) and the zeroing of hist[row] are split
//   over the S CTAs (grid-strided).
// Fallback: nb > TKF_BUCKET_CAP with rem > 0 (heavy ties, e.g. all-equal rows: the whole row is the bucket).
//   Block-uniform and identical in every CTA of the row (they read the same counters); CTA 0 runs the exact
//   radix select over the bucket straight from global memory (block_select / block_collect) and the bitonic
//   sort_and_write (which also writes the -1 / -inf tail); the other CTAs only zero their part of hist[row].
// Reset protocol (with S CTAs no CTA can know that the others have read the counters, so):
//   * hist[row]: read only by pass 2, which finished before this pass started (stream order), so any CTA
//     of this pass may zero any part of it: CTA s zeroes bins s*T + tid, step S*T.
//   * counters[row] (above, bucket): read by thread 0 of every CTA of the row, then an arrival
//     atom.add.release.gpu on arrivals[row] (release: the reads are ordered before it). The CTA whose arrival
//     returns S - 1 arrived last: all S - 1 other arrivals precede it in the atomic's order and, being
//     release RMWs on one location, synchronize with it once it executes fence.acq_rel (acquire pattern);
//     so every other CTA's counter reads happen before its zeroing of counters[row] and arrivals[row], done
//     at the end of its work (the atomic's result is only consumed there). No reader of either is left in
//     this pass; the next writer is pass 2 (counters) / this pass (arrivals) of the next call, which start
//     after this grid completed (stream order, also inside a CUDA graph). So hist, counters and arrivals are
//     zero at the end of every call: back-to-back calls and graph replays need no memset. Rows with n == 0
//     (passes 1-2 returned at once for them: hist and counters stay zero) take part in the protocol like every
//     row: the grid always covers every row, whatever the device num_valid.
//     The caller re-zeroes hist, counters and arrivals after a call interrupted between launches.
// Memory safety never depends on the counters being right: a, nb are clamped to kk and bucket_stride, every
//   position written is < a + rem <= kk <= k (above ranks are clamped to a - 1).
// Deadlock freedom: the only barriers are (1) one in straight-line code before any return, (2) the two of
//   the rank path in straight-line code after block-uniform returns (total == 0; fallback), (3) those inside
//   block_select / block_collect / sort_and_write, reached by CTA 0 under the block-uniform fallback
//   condition (argument under "Top-k"). rank_slice's per-thread loops contain no barrier and no warp
//   collective. The arrival counter is never waited on: no CTA waits for another.
namespace {

constexpr int TKF_THREADS = 512;
constexpr int TKF_MIN_SPLIT = 8;         // the launcher's lower bound on S; sizes the static rank arrays
constexpr int TKF_BUCKET_CAP = 4096;     // bucket composites ranked in shared memory (32 KB)
constexpr int TKF_RANK_A = TOPK_MAX_K / TKF_MIN_SPLIT;        // >= ceil(a / S)
constexpr int TKF_RANK_B = TKF_BUCKET_CAP / TKF_MIN_SPLIT;    // >= ceil(nb / S) on the rank path
static_assert(TKF_THREADS >= 256, "block_select scans 256 radix buckets with one thread each");

// rank[i] += #{ j < m : v[j] > v[e0 + i] } for i < cnt. Preconditions (the caller, before a barrier): rank[0..cnt)
// zero, v[0..m) written, v[m] == 0 when m is odd (0 is below every composite: order_key >= 0x007FFFFF, so the
// pad never counts), v 16-byte aligned, e0 + cnt <= m. Work items (i, split) cover all of [0, m) for each i;
// the split count is block-uniform. No barrier inside; the caller puts one after it before reading rank.
__device__ void rank_slice(const uint64_t* v, int m, int e0, int cnt, uint32_t* rank) {
    if (cnt <= 0) return;  // block-uniform
    const int nthr = blockDim.x;
    const int pairs = (m + 1) >> 1;  // >= 1 since m >= cnt >= 1
    const int splits = max(1, min(nthr / cnt, pairs));
    const int per = (pairs + splits - 1) / splits;
    const ulonglong2* v2 = reinterpret_cast<const ulonglong2*>(v);
    for (int w = threadIdx.x; w < cnt * splits; w += nthr) {  // per-thread trip count: no barrier inside
        const int i = w % cnt, s = w / cnt;
        const unsigned long long c = v[e0 + i];
        const int j0 = s * per, j1 = min(pairs, j0 + per);
        uint32_t c0 = 0, c1 = 0;
#pragma unroll 4
        for (int j = j0; j < j1; ++j) {
            const ulonglong2 p = v2[j];
            c0 += p.x > c ? 1u : 0u;
            c1 += p.y > c ? 1u : 0u;
        }
        if (c0 + c1) atomicAdd(&rank[i], c0 + c1);
    }
}

// Slots of the above / sort buffer in dynamic shared memory: next power of two >= k (the fallback's bitonic
// sort pads to it) + 2 (the odd-m pad at index a <= k; keeps the bucket buffer after it 16-byte aligned).
// The launcher computes the same (topk_final_smem_bytes in src/ops/indexer/mod.rs).
__device__ __forceinline__ int tkf_above_slots(int k) {
    int kpad = 2;  // at least 2: kpad + 2 must be even so the bucket buffer stays 16-byte aligned (k = 1)
    while (kpad < k) kpad <<= 1;
    return kpad + 2;
}

}  // namespace

namespace {

// Arrival on the row's counter with release semantics (PTX atom.release.gpu: this thread's earlier memory
// operations, the counter reads, are ordered before it). Compiles to MEMBAR.ALL.GPU + ATOMG, lighter than
// __threadfence()'s MEMBAR.SC.GPU.
__device__ __forceinline__ uint32_t tkf_arrive_release(uint32_t* p) {
    uint32_t old;
    asm volatile("atom.release.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(p) : "memory");
    return old;
}
// Acquire side (PTX: a strong read, here the arrival atomic that returned S - 1, followed by fence.acq_rel is
// an acquire pattern): it synchronizes with every other CTA's release arrival (the atomics form one release
// sequence), so their counter reads happen before the zeroing stores that follow.
__device__ __forceinline__ void tkf_fence_acquire() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

// One CTA's share of a row (everything but the counter reset): called by every thread of the CTA, returns
// early only under block-uniform conditions. cnt_s holds the row's counters (read by thread 0 before).
// Thread 0 (which read the counters into cnt_s) arrives on *arrival right after the first barrier and
// returns the atomic's result in prior; warp 0 then takes no part in the global loads of the composites, so the
// atomic's round trip (ptxas aggregates it per warp and waits for it at once) overlaps the other warps' loads
// instead of adding to the time before the second barrier.
__device__ void tkf_row_part(int S, int s, int k, int kk, uint32_t* __restrict__ hist_row, const uint32_t* cnt_s,
                             uint32_t* arrival, uint32_t& prior, const unsigned long long* __restrict__ above_row,
                             const unsigned long long* __restrict__ bucket_row, int bucket_stride,
                             int* __restrict__ oi, float* __restrict__ os, uint64_t* A, uint64_t* Bk,
                             SelectShared& sh, uint32_t* rank_a, uint32_t* rank_b) {
    const int tid = threadIdx.x;
    for (int i = s * TKF_THREADS + tid; i < TKS_BINS; i += S * TKF_THREADS) hist_row[i] = 0;
    __syncthreads();  // cnt_s visible
    if (tid == 0) prior = tkf_arrive_release(arrival);  // thread 0's counter reads are ordered before it
    const int a = (int)min(cnt_s[0], (uint32_t)kk);
    const int nb = (int)min(cnt_s[1], (uint32_t)bucket_stride);
    const int rem = max(0, min(kk - a, nb));  // block-uniform; 0 when kk == 0
    const int total = a + rem;                // == kk with a consistent state

    if (rem > 0 && nb > TKF_BUCKET_CAP) {  // block-uniform fallback: CTA 0 alone, radix select + bitonic
        if (s != 0) return;
        for (int i = tid; i < a; i += TKF_THREADS) A[i] = above_row[i];
        const bool all = rem >= nb;
        uint64_t prefix = 0;
        int shift = 64;
        auto emit = [&](uint32_t pos, uint64_t cc) {
            if ((int)pos < rem) A[a + pos] = cc;
        };
        const GlobalCompSrc src{reinterpret_cast<const uint64_t*>(bucket_row)};
        if (!all) block_select(src, nb, rem, sh, prefix, shift);
        block_collect(src, nb, all, prefix, shift, sh, emit);
        sort_and_write(A, total, k, oi, os);  // starts with a barrier-protected fill; writes [0, k)
        return;
    }
    for (int j = total + s * TKF_THREADS + tid; j < k; j += S * TKF_THREADS) {
        oi[j] = -1;
        os[j] = -INFINITY;
    }
    if (total == 0) return;  // block-uniform: nothing to rank

    const int mb = rem > 0 ? nb : 0;  // bucket entries to rank (block-uniform; <= TKF_BUCKET_CAP here)
    if (tid >= 32) {  // warp-uniform: warp 0 waits on the arrival atomic meanwhile
        for (int i = tid - 32; i < a; i += TKF_THREADS - 32) A[i] = above_row[i];
        for (int i = tid - 32; i < mb; i += TKF_THREADS - 32) Bk[i] = bucket_row[i];
    }
    if (tid == 0) {
        A[a] = 0;  // pads for odd a / mb (a <= k < tkf_above_slots(k); mb <= TKF_BUCKET_CAP)
        Bk[mb] = 0;
    }
    const int per_a = (a + S - 1) / S, a0 = min(a, s * per_a), na = min(a, a0 + per_a) - a0;    // na <= TKF_RANK_A
    const int per_b = (mb + S - 1) / S, b0 = min(mb, s * per_b), nbs = min(mb, b0 + per_b) - b0;  // <= TKF_RANK_B
    for (int i = tid; i < na; i += TKF_THREADS) rank_a[i] = 0;
    for (int i = tid; i < nbs; i += TKF_THREADS) rank_b[i] = 0;
    __syncthreads();  // A, Bk, pads and zeroed ranks visible
    rank_slice(A, a, a0, na, rank_a);
    rank_slice(Bk, mb, b0, nbs, rank_b);
    __syncthreads();
    for (int i = tid; i < na; i += TKF_THREADS) {
        const uint64_t c = A[a0 + i];
        const uint32_t r = min(rank_a[i], (uint32_t)(a - 1));  // < a: unique composites
        oi[r] = (int)~(uint32_t)c;
        os[r] = key_to_score((uint32_t)(c >> 32));
    }
    for (int i = tid; i < nbs; i += TKF_THREADS) {
        const uint32_t r = rank_b[i];
        if (r < (uint32_t)rem) {
            const uint64_t c = Bk[b0 + i];
            oi[a + r] = (int)~(uint32_t)c;
            os[a + r] = key_to_score((uint32_t)(c >> 32));
        }
    }
}

}  // namespace

// grid (S, rows) with S >= TKF_MIN_SPLIT, block TKF_THREADS, dynamic smem = 8 * (tkf_above_slots(k) +
// TKF_BUCKET_CAP + 2). arrivals [rows] u32 (zero on entry and on exit, see the reset protocol).
// Thread 0 reads the counters, arrives after the first barrier (see tkf_row_part) and, if its CTA arrived last,
// zeroes them at the very end.
namespace {
// Body of indexer_topk_final (PDL = false) and indexer_topk_final_pdl.
template <bool PDL>
__device__ __forceinline__ void topk_final_body(
    int score_stride, const int* __restrict__ num_valid, int k, uint32_t* __restrict__ hist,
    uint32_t* __restrict__ counters, uint32_t* __restrict__ arrivals, const unsigned long long* __restrict__ above,
    const unsigned long long* __restrict__ bucket, int bucket_stride, int* __restrict__ out_idx,
    float* __restrict__ out_score) {
    extern __shared__ __align__(16) uint8_t smem_raw[];
    __shared__ SelectShared sh;
    __shared__ uint32_t rank_a[TKF_RANK_A];
    __shared__ uint32_t rank_b[TKF_RANK_B];
    __shared__ uint32_t cnt_s[2];
    // PDL: wait before the first global access (num_valid, counters, hist, above / bucket) and before any
    // return, so that every CTA waits (see "Top-k PDL entry points").
    if (PDL) pdl_wait();
    const int S = gridDim.x, s = blockIdx.x, row = blockIdx.y, tid = threadIdx.x;
    if (S < TKF_MIN_SPLIT) return;  // grid-uniform; the launcher never does this (outputs stay poisoned)
    uint64_t* const A = reinterpret_cast<uint64_t*>(smem_raw);  // above composites; the fallback's sort buffer
    uint64_t* const Bk = A + tkf_above_slots(k);                 // bucket composites (rank path)
    const int n = row_valid(num_valid, row, score_stride);
    uint32_t* cnt = counters + 2 * (size_t)row;
    uint32_t prior = 0;
    if (tid == 0) {
        cnt_s[0] = cnt[0];
        cnt_s[1] = cnt[1];
    }
    tkf_row_part(S, s, k, min(k, n), hist + (size_t)row * TKS_BINS, cnt_s, &arrivals[row], prior,
                 above + (size_t)row * k, bucket + (size_t)row * bucket_stride, bucket_stride,
                 out_idx + (size_t)row * k, out_score + (size_t)row * k, A, Bk, sh, rank_a, rank_b);
    if (tid == 0 && prior == (uint32_t)S - 1) {  // the row's last CTA to arrive
        tkf_fence_acquire();  // every other CTA's counter reads happened before: zero for the next call
        cnt[0] = 0;
        cnt[1] = 0;
        arrivals[row] = 0;
    }
}
}  // namespace

extern "C" __global__ void __launch_bounds__(TKF_THREADS) indexer_topk_final(
    int score_stride, const int* __restrict__ num_valid, int k, uint32_t* __restrict__ hist,
    uint32_t* __restrict__ counters, uint32_t* __restrict__ arrivals, const unsigned long long* __restrict__ above,
    const unsigned long long* __restrict__ bucket, int bucket_stride, int* __restrict__ out_idx,
    float* __restrict__ out_score) {
    topk_final_body<false>(score_stride, num_valid, k, hist, counters, arrivals, above, bucket, bucket_stride,
                            out_idx, out_score);
}
// indexer_topk_final for a PDL launch (see "Top-k PDL entry points"). Same launch shape and smem.
extern "C" __global__ void __launch_bounds__(TKF_THREADS) indexer_topk_final_pdl(
    int score_stride, const int* __restrict__ num_valid, int k, uint32_t* __restrict__ hist,
    uint32_t* __restrict__ counters, uint32_t* __restrict__ arrivals, const unsigned long long* __restrict__ above,
    const unsigned long long* __restrict__ bucket, int bucket_stride, int* __restrict__ out_idx,
    float* __restrict__ out_score) {
    topk_final_body<true>(score_stride, num_valid, k, hist, counters, arrivals, above, bucket, bucket_stride,
                           out_idx, out_score);
}

// ------------------------------------------------------------------------------------------------------------
// Top-k pass 2 with CTA-aggregated slot allocation (indexer_topk_select). Why aggregated: with one
// warp-aggregated atomic per (warp, step), at batch 16 / 64K context (16,384 entries per row, k 512) ~3% of the
// entries are above the threshold bin and a few % in it, so nearly every (warp, r) step does a global atomicAdd
// on the row's counters and waits for its result before the stores: up to 8 dependent L2 round trips per warp,
// all warps of the row's CTAs contending on two addresses (ncu: IPC 0.65, 0.23 eligible warps per scheduler).
// Here each CTA first counts its above / bucket entries per warp (ballot popcounts, registers only), thread 0
// scans the 16 warp totals and does ONE atomicAdd per counter for the whole CTA, and every warp then writes
// its entries at CTA base + warp offset + running in-warp prefix: one round trip per CTA. The slot order of
// above[] / bucket[] depends on the CTAs' atomic order; the final pass is order-independent (ranks by counting,
// radix select, bitonic sort), so the top-k output is deterministic.
// Deadlock freedom: the two extra barriers are in straight-line code after the block-uniform early return;
// the per-value loops have compile-time trip counts (ballots warp-uniform), no barrier inside.
namespace {
// Body of indexer_topk_select (PDL = false) and indexer_topk_select_pdl.
template <bool PDL>
__device__ __forceinline__ void topk_select_body(
    const float* __restrict__ scores, int score_stride, const int* __restrict__ num_valid, int k,
    const uint32_t* __restrict__ hist, uint32_t* __restrict__ counters, unsigned long long* __restrict__ above,
    unsigned long long* __restrict__ bucket, int bucket_stride) {
    __shared__ uint32_t warp_sums[TKS_THREADS / 32];
    __shared__ uint32_t warp_up[TKS_THREADS / 32], warp_eq[TKS_THREADS / 32];
    __shared__ uint32_t thr_bin, base_up, base_eq;
    if (PDL) {  // no global access before the wait (see "Top-k PDL entry points")
        pdl_trigger();
        pdl_wait();
    }
    const int row = blockIdx.y;
    const int n = row_valid(num_valid, row, score_stride);
    const int base = blockIdx.x * TKS_SLICE;
    if (base >= n) return;  // block-uniform, before any barrier
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const uint32_t kk = (uint32_t)min(k, n);  // >= 1 here

    const float* src = scores + (size_t)row * score_stride;
    float v[TKS_PER_THREAD];
#pragma unroll
    for (int r = 0; r < TKS_PER_THREAD; ++r) {
        const int i = base + r * TKS_THREADS + tid;
        v[r] = i < n ? src[i] : 0.f;
    }

    // Threshold bin (see "Top-k", pass 2).
    const uint4* g4 = reinterpret_cast<const uint4*>(hist + (size_t)row * TKS_BINS + (TKS_BINS - 8 - 8 * tid));
    const uint4 lo = g4[0], hi = g4[1];
    const uint32_t c[8] = {hi.w, hi.z, hi.y, hi.x, lo.w, lo.z, lo.y, lo.x};
    uint32_t own = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) own += c[j];
    uint32_t incl = own;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const uint32_t y = __shfl_up_sync(FULL, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == 31) warp_sums[warp] = incl;
    if (tid == 0) thr_bin = TKS_BINS;
    __syncthreads();
    for (int w2 = 0; w2 < warp; ++w2) incl += warp_sums[w2];  // no barrier inside
    const uint32_t excl = incl - own;
    if (excl < kk && incl >= kk) {
        uint32_t run = excl;
        int found = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            if (!found && run + c[j] >= kk) {
                thr_bin = (uint32_t)(TKS_BINS - 1 - (8 * tid + j));
                found = 1;
            }
            run += c[j];
        }
    }
    __syncthreads();
    const uint32_t B = thr_bin;

    // Ballots of every step (registers), per-warp totals.
    unsigned bu[TKS_PER_THREAD], be[TKS_PER_THREAD];
    uint32_t keys[TKS_PER_THREAD];
    uint32_t wu = 0, we = 0;
#pragma unroll
    for (int r = 0; r < TKS_PER_THREAD; ++r) {  // compile-time trip count: the ballots are warp-uniform
        const int i = base + r * TKS_THREADS + tid;
        keys[r] = order_key(v[r]);
        const uint32_t bin = keys[r] >> TKS_SHIFT;
        bu[r] = __ballot_sync(FULL, i < n && bin > B && B < TKS_BINS);
        be[r] = __ballot_sync(FULL, i < n && bin == B);
        wu += (uint32_t)__popc(bu[r]);
        we += (uint32_t)__popc(be[r]);
    }
    if (lane == 0) {
        warp_up[warp] = wu;
        warp_eq[warp] = we;
    }
    __syncthreads();
    if (tid == 0) {  // exclusive scan of the 16 warp totals, then one atomic per counter for the CTA
        uint32_t tu = 0, te = 0;
        for (int w2 = 0; w2 < TKS_THREADS / 32; ++w2) {
            const uint32_t u = warp_up[w2], e = warp_eq[w2];
            warp_up[w2] = tu;
            warp_eq[w2] = te;
            tu += u;
            te += e;
        }
        uint32_t* cnt = counters + 2 * (size_t)row;
        base_up = tu ? atomicAdd(&cnt[0], tu) : 0u;
        base_eq = te ? atomicAdd(&cnt[1], te) : 0u;
    }
    __syncthreads();
    uint32_t su = base_up + warp_up[warp], se = base_eq + warp_eq[warp];
    unsigned long long* above_row = above + (size_t)row * k;
    unsigned long long* bucket_row = bucket + (size_t)row * bucket_stride;
    const unsigned lanes_below = (1u << lane) - 1u;
#pragma unroll
    for (int r = 0; r < TKS_PER_THREAD; ++r) {
        const int i = base + r * TKS_THREADS + tid;
        if ((bu[r] >> lane) & 1u) {
            const uint32_t slot = su + __popc(bu[r] & lanes_below);
            if (slot < (uint32_t)k) above_row[slot] = composite(keys[r], (uint32_t)i);
        }
        if ((be[r] >> lane) & 1u) {
            const uint32_t slot = se + __popc(be[r] & lanes_below);
            if (slot < (uint32_t)bucket_stride) bucket_row[slot] = composite(keys[r], (uint32_t)i);
        }
        su += (uint32_t)__popc(bu[r]);
        se += (uint32_t)__popc(be[r]);
    }
}
}  // namespace

extern "C" __global__ void __launch_bounds__(TKS_THREADS) indexer_topk_select(
    const float* __restrict__ scores, int score_stride, const int* __restrict__ num_valid, int k,
    const uint32_t* __restrict__ hist, uint32_t* __restrict__ counters, unsigned long long* __restrict__ above,
    unsigned long long* __restrict__ bucket, int bucket_stride) {
    topk_select_body<false>(scores, score_stride, num_valid, k, hist, counters, above, bucket, bucket_stride);
}
// indexer_topk_select for a PDL launch (see "Top-k PDL entry points").
extern "C" __global__ void __launch_bounds__(TKS_THREADS) indexer_topk_select_pdl(
    const float* __restrict__ scores, int score_stride, const int* __restrict__ num_valid, int k,
    const uint32_t* __restrict__ hist, uint32_t* __restrict__ counters, unsigned long long* __restrict__ above,
    unsigned long long* __restrict__ bucket, int bucket_stride) {
    topk_select_body<true>(scores, score_stride, num_valid, k, hist, counters, above, bucket, bucket_stride);
}

// ------------------------------------------------------------------------------------------------------------
// Baseline: the seeds' path. Dequantize keys to fp32, fp32 "einsum" on CUDA cores, full bitonic sort.
// ------------------------------------------------------------------------------------------------------------

// out[(b * capacity + j) * 128 + d] = dequantized key, for j < n_seq(b). grid (ceil(capacity*128/256), batch).
extern "C" __global__ void indexer_baseline_dequant(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                                                    int fp4, const int* __restrict__ num_valid, int next_n, int capacity,
                                                    float* __restrict__ out) {
    const int b = blockIdx.y;
    const size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    int n_seq = 0;
    for (int t = 0; t < next_n; ++t) n_seq = max(n_seq, min(max(num_valid[b * next_n + t], 0), capacity));
    const size_t j = e / DIM, d = e % DIM;
    if (j >= (size_t)n_seq) return;
    const size_t slot = (size_t)b * capacity + j;
    float x;
    if (!fp4) {
        x = mm::e4m3_decode(codes[slot * DIM + d]) * reinterpret_cast<const float*>(scales)[slot];
    } else {
        const uint8_t byte = codes[slot * (DIM / 2) + d / 2];
        x = mm::e2m1_decode((d & 1) ? (byte >> 4) : (byte & 0xF)) * mm::ue8m0_decode(scales[slot * 4 + d / 32]);
    }
    out[slot * DIM + d] = x;
}

// scores[row][j] = sum_h w[row,h] relu(q[row,h] . k_j) in fp32. grid (ceil(capacity/64), batch), 256 threads,
// dynamic smem 64 KB: 64 keys x 128 and 64 heads x 128 fp32 tiles; thread (key quad, head quad) register tile.
extern "C" __global__ void __launch_bounds__(256) indexer_baseline_logits_f32(
    const uint8_t* __restrict__ q, const float* __restrict__ w, const float* __restrict__ keys,
    const int* __restrict__ num_valid, int next_n, int capacity, float* __restrict__ scores, int score_stride) {
    extern __shared__ __align__(16) float sm[];
    float* ks = sm;              // [64][129] padded
    float* qs = sm + 64 * 129;   // [64][129]
    __shared__ float red[16][64];
    const int b = blockIdx.y, tid = threadIdx.x;
    int n_seq = 0;
    for (int t = 0; t < next_n; ++t) n_seq = max(n_seq, min(max(num_valid[b * next_n + t], 0), capacity));
    const int j0 = blockIdx.x * 64;
    if (j0 >= n_seq) return;
    for (int e = tid; e < 64 * DIM; e += 256) {
        const int j = j0 + e / DIM;
        ks[(e / DIM) * 129 + e % DIM] = j < n_seq ? keys[((size_t)b * capacity + j) * DIM + e % DIM] : 0.f;
    }
    const int kq = tid % 16, hq = tid / 16;
    for (int t = 0; t < next_n; ++t) {
        const int row = b * next_n + t;
        __syncthreads();
        for (int e = tid; e < HEADS * DIM; e += 256)
            qs[(e / DIM) * 129 + e % DIM] = mm::e4m3_decode(q[(size_t)row * HEADS * DIM + e]);
        __syncthreads();
        float acc[4][4] = {};
        for (int d = 0; d < DIM; ++d) {
            float kv[4], qv[4];
            for (int i = 0; i < 4; ++i) kv[i] = ks[(kq * 4 + i) * 129 + d];
            for (int i = 0; i < 4; ++i) qv[i] = qs[(hq * 4 + i) * 129 + d];
            for (int i = 0; i < 4; ++i)
                for (int h = 0; h < 4; ++h) acc[i][h] = fmaf(kv[i], qv[h], acc[i][h]);
        }
        for (int i = 0; i < 4; ++i) {
            float s = 0.f;
            for (int h = 0; h < 4; ++h) s = fmaf(w[(size_t)row * HEADS + hq * 4 + h], fmaxf(acc[i][h], 0.f), s);
            red[hq][kq * 4 + i] = s;
        }
        __syncthreads();
        if (tid < 64) {
            float s = 0.f;
            for (int h = 0; h < 16; ++h) s += red[h][tid];
            const int j = j0 + tid;
            if (j < n_seq) scores[(size_t)row * score_stride + j] = s;
        }
    }
}

// comps[row][i] = composite of score i for i < n(row), 0 (sorts last) up to npad. grid (ceil(npad/256), rows).
extern "C" __global__ void indexer_baseline_sort_init(const float* __restrict__ scores, int score_stride,
                                                      const int* __restrict__ num_valid, int npad,
                                                      unsigned long long* __restrict__ comps) {
    const int row = blockIdx.y;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= npad) return;
    const int n = row_valid(num_valid, row, score_stride);
    comps[(size_t)row * npad + i] =
        i < n ? composite(order_key(scores[(size_t)row * score_stride + i]), (uint32_t)i) : 0ull;
}

// One bitonic compare-exchange step (size, stride) over every row, descending. grid (ceil(npad/2/256), rows).
extern "C" __global__ void indexer_baseline_bitonic_step(unsigned long long* __restrict__ comps, int npad, int size,
                                                         int stride) {
    const int row = blockIdx.y;
    const int p = blockIdx.x * blockDim.x + threadIdx.x;  // pair index
    if (p >= npad / 2) return;
    const int i = (p / stride) * 2 * stride + (p % stride);
    const int j = i + stride;
    unsigned long long* c = comps + (size_t)row * npad;
    const unsigned long long x = c[i], y = c[j];
    const bool desc = (i & size) == 0;
    if (desc ? (x < y) : (x > y)) {
        c[i] = y;
        c[j] = x;
    }
}

// First k of each sorted row -> indices/scores, -1/-inf past min(k, n). grid (ceil(k/256), rows).
extern "C" __global__ void indexer_baseline_sort_gather(const unsigned long long* __restrict__ comps, int npad,
                                                        int score_stride, const int* __restrict__ num_valid, int k,
                                                        int* __restrict__ out_idx, float* __restrict__ out_score) {
    const int row = blockIdx.y;
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= k) return;
    const int n = row_valid(num_valid, row, score_stride);
    if (j < min(k, n)) {
        const unsigned long long c = comps[(size_t)row * npad + j];
        out_idx[(size_t)row * k + j] = (int)~(uint32_t)c;
        out_score[(size_t)row * k + j] = key_to_score((uint32_t)(c >> 32));
    } else {
        out_idx[(size_t)row * k + j] = -1;
        out_score[(size_t)row * k + j] = -INFINITY;
    }
}

// ------------------------------------------------------------------------------------------------------------
// FP8 logits (indexer_logits_fp8_n1 / _n2): the wgmma pieces above fed by the Tensor Memory Accelerator through
// a ring of full/empty mbarriers. Why a ring: with copies issued by every thread in rounds (cp.async), each
// round ends in wait_group 0 + proxy fence + __syncthreads and a CTA's copy stream stops at every round
// boundary (ncu: the cp.async wait, the round barrier and the wgmma wait are the top stalls). Here a producer
// thread runs up to STAGES tiles ahead and nothing block-wide sits in the loop.
//   * Block = 4 consumer warps (one warpgroup: wgmma + epilogue) + 1 producer warp (lane 0 issues copies,
//     lanes 1..31 exit at once). 3 CTAs per SM; a persistent grid in which each CTA walks a CONTIGUOUS range of
//     the flattened (sequence, tile) list of the whole capacity (so q changes rarely). Tiles past a sequence's
//     num_valid are skipped (see "Tail"); their share of a CTA's range costs one num_valid load each.
//   * Key tile = one 2D tensor-map copy (cp.async.bulk.tensor, box 128 B x 64 rows of the [batch * capacity][128]
//     u8 code plane, CU_TENSOR_MAP_SWIZZLE_128B): the TMA writes row r's 16-byte chunk c at r * 128 +
//     ((c ^ (r & 7)) << 4) of the 1024-aligned stage, exactly the wgmma layout above.
//     The 64 fp32 key scales = one 1D tensor-map copy (box 68 of the [batch * capacity] f32 plane) that starts
//     at slot0 & ~3, not at slot0: the TMA faults with an illegal-instruction error unless the global address of
//     a box's first element is 16-byte aligned (capacity 4097 makes slot0 = b * 4097 + key0
//     odd). With the 16-aligned plane base, 4 * (slot0 & ~3) keeps the box start 16-byte aligned; the stage's
//     scale of row r is element (slot0 & 3) + r of the box, and (slot0 & 3) + 63 <= 66 < 68 keeps every row
//     inside it. The box is 272 bytes (a multiple of 16, as the TMA requires); stages are 384 bytes apart (the
//     TMA destination must be 128-byte aligned).
//   * Tail: rows key0 + r >= n_seq of a tile are still copied; while they are inside the plane (slot <
//     batch * capacity) they are allocated cache bytes of this or the next sequence, past the plane's end the TMA
//     fills zeros. Either way they only reach accumulator rows that are never stored (row m of D depends on row m
//     of A only). The TMA never reads outside the tensor map's extent, so no over-read of the allocation.
//     Every copy credits its full box (8192 + 272 bytes) to the barrier's transaction count, filled or not.
//   * Tiles with key0 >= n_seq (past the sequence's device num_valid) are skipped by producer and consumers
//     alike, except a CTA's first item (i = 0), which is always copied and consumed: that lets the producer
//     issue the first copy before its num_valid load returns (one DRAM latency less at the start of every CTA).
//     The copy is in bounds (the item list covers the capacity: key0 < capacity, so the box starts inside the
//     plane), and the
//     consumers' store predicate (key0 + r < n_seq) writes nothing for it. Both sides walk the same item list
//     and evaluate the same predicate (i > 0 && key0 >= n_seq) on the same num_valid values, so their sequence
//     of used stages (the "fill" counter below) is identical.
// mbarrier phase protocol (stage s = fill % STAGES, pass p = fill / STAGES, per non-empty tile `fill`):
//   full[s]  (count 1): the producer's arrive.expect_tx(8464) + the two copies' complete_tx complete phase p;
//            consumers wait with parity p & 1. The TMA's writes are visible to every thread that observed the
//            phase completion (including the async-proxy wgmma reads issued after the wait).
//   empty[s] (count 4): after its wgmma.wait_group 0 (this warp's part of the stage's wgmma reads done) and the
//            lds of the two key scales, each consumer warp's lane 0 arrives once (after __syncwarp) -> phase p
//            completes when all 4 warps released pass p. Before pass p >= 1 of stage s the producer waits on
//            empty[s] with parity (p - 1) & 1, i.e. for the release of pass p - 1.
//   The producer can be at most STAGES fills ahead of the slowest consumer warp, and a consumer cannot pass a
//   full barrier the producer has not armed, so no barrier is ever more than one phase ahead of its waiter: the
//   parity test is unambiguous. Every fill is consumed (consumers walk all fills), so no copy is in flight when
//   the CTA exits. Barriers are initialised by thread 0, made visible with fence.mbarrier_init + __syncthreads
//   (the only block-wide barrier; all 160 threads execute it before the roles split).
// q / w: loaded by the consumers on each sequence change, between two named barriers over the 128
// consumer threads (bar 1): the first makes sure every warp's previous wgmma (which read q) has completed, the
// second publishes the generic stores (after fence.proxy.async) to the wgmma. The branch is uniform over the
// consumers (a function of the item), and the producer never takes part in bar 1.
// ------------------------------------------------------------------------------------------------------------
namespace {

constexpr int LT_CONSUMERS = 128;                // one warpgroup
constexpr int LT_THREADS = LT_CONSUMERS + 32;    // + the producer warp
constexpr int LT_SCALE_BOX = LW_KEYS + 4;                 // scale box: 64 rows + up to 3 of alignment slack
constexpr int LT_SCALE_STAGE_BYTES = 384;                 // 272-byte box rounded up to 128 (TMA destination)
constexpr int LT_TX_BYTES = LW_TILE_BYTES + LT_SCALE_BOX * 4;  // 8464 credited per fill
static_assert(LT_SCALE_BOX * 4 % 16 == 0 && LT_SCALE_BOX * 4 <= LT_SCALE_STAGE_BYTES &&
                  LT_SCALE_STAGE_BYTES % 128 == 0 && 3 + LW_KEYS <= LT_SCALE_BOX,
              "scale box: 16-byte multiple, fits its 128-aligned stage, covers rows (slot0 & 3) .. + 63");

// A CUtensorMap as a kernel parameter (128 opaque bytes, 64-byte aligned; passed __grid_constant__ so the TMA
// can read it from parameter space).
struct alignas(64) LtTensorMap {
    unsigned long long opaque[16];
};

// Dynamic shared memory (base rounded up to 1024 B in the kernel; the launcher's size includes the 1 KB slack):
//   keys [STAGES][64][128] swizzled | q [NEXT_N * 64][128] swizzled | key scales [STAGES][96] f32 (68 used) |
//   full [STAGES] u64 | empty [STAGES] u64.
template <int NEXT_N, int STAGES>
__host__ __device__ constexpr int lt_smem_bytes() {
    return 1024 + STAGES * (LW_TILE_BYTES + LT_SCALE_STAGE_BYTES) + NEXT_N * HEADS * DIM + 2 * STAGES * 8;
}

__device__ __forceinline__ void lt_mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void lt_mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void lt_mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Spins until the phase with parity `parity` of the barrier has completed.
__device__ __forceinline__ void lt_mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}
// L2 policy "evict first" for the key-code stream: each code byte is read once per call, so the codes should
// leave L2 before the scores this kernel writes (read back by the top-k right after). A hint only.
__device__ __forceinline__ uint64_t lt_evict_first_policy() {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}
// 2D tensor copy of the box at (c0, c1) into shared memory at dst, with L2 policy `policy`; completes the box's
// bytes on bar.
__device__ __forceinline__ void lt_tma_2d(uint32_t dst, const LtTensorMap* map, int c0, int c1, uint32_t bar,
                                          uint64_t policy) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "l"(policy)
        : "memory");
}
__device__ __forceinline__ void lt_tma_1d(uint32_t dst, const LtTensorMap* map, int c0, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2}], [%3];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void lt_prefetch_map(const LtTensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
__device__ __forceinline__ void lt_consumer_bar() { asm volatile("bar.sync 1, %0;\n" ::"n"(LT_CONSUMERS) : "memory"); }

template <int NEXT_N, int STAGES>
__device__ __forceinline__ void logits_tma_body(const LtTensorMap* codes_map, const LtTensorMap* scales_map,
                                                const uint8_t* __restrict__ q, const float* __restrict__ w,
                                                const int* __restrict__ num_valid,
                                                const int* __restrict__ key_seq, int capacity,
                                                float* __restrict__ scores, int score_stride, int tiles_per_seq,
                                                int total_tiles) {
    constexpr int NACC = NEXT_N * 32;
    extern __shared__ uint8_t lt_smem_raw[];
    const uint32_t raw_addr = lw_smem_addr(lt_smem_raw);
    const uint32_t base = (raw_addr + 1023u) & ~1023u;
    const uint32_t keys_s = base;
    const uint32_t q_s = keys_s + STAGES * LW_TILE_BYTES;
    const uint32_t scale_s = q_s + NEXT_N * HEADS * DIM;
    const uint32_t full_s = scale_s + STAGES * LT_SCALE_STAGE_BYTES;  // 8-byte aligned (everything above is)
    const uint32_t empty_s = full_s + STAGES * 8;
    const float* scale_gen = reinterpret_cast<const float*>(lt_smem_raw + (scale_s - raw_addr));
    uint8_t* q_gen = lt_smem_raw + (q_s - raw_addr);

    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
    const int per_cta = (total_tiles + (int)gridDim.x - 1) / (int)gridDim.x;
    const int item0 = (int)blockIdx.x * per_cta;
    const int n_items = max(0, min(per_cta, total_tiles - item0));

    if (tid == 0) {
#pragma unroll 1
        for (int s = 0; s < STAGES; ++s) {
            lt_mbar_init(full_s + 8 * s, 1);
            lt_mbar_init(empty_s + 8 * s, LT_CONSUMERS / 32);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        fence_proxy_async();
    }
    __syncthreads();  // the only block-wide barrier

    if (warp == LT_CONSUMERS / 32) {
        // ---- producer ----
        if (lane != 0) return;
        lt_prefetch_map(codes_map);
        lt_prefetch_map(scales_map);
        const uint64_t codes_policy = lt_evict_first_policy();
        int stage = 0, pass = 0;
#pragma unroll 1
        for (int i = 0; i < n_items; ++i) {
            const int item = item0 + i;
            const int b = item / tiles_per_seq, key0 = (item - b * tiles_per_seq) * LW_KEYS;
            // Skipped by the consumers too; item 0 is never skipped (no wait for num_valid before the first copy).
            if (i > 0 && key0 >= lw_seq_len<NEXT_N>(num_valid, b, capacity)) continue;
            if (pass > 0) lt_mbar_wait(empty_s + 8 * stage, (uint32_t)(pass - 1) & 1u);
            const uint32_t full = full_s + 8 * stage;
            lt_mbar_arrive_expect_tx(full, LT_TX_BYTES);
            // The key sequence of query sequence b (key_seq[b], null = b): < the cache's sequences, so
            // slot0 < cache batch * capacity <= INT_MAX (launcher).
            const int kb = key_seq != nullptr ? key_seq[b] : b;
            const int slot0 = kb * capacity + key0;
            lt_tma_2d(keys_s + stage * LW_TILE_BYTES, codes_map, 0, slot0, full, codes_policy);
            // Box start aligned down to 4 floats = 16 bytes (see the header: the TMA faults otherwise).
            lt_tma_1d(scale_s + stage * LT_SCALE_STAGE_BYTES, scales_map, slot0 & ~3, full);
            if (++stage == STAGES) {
                stage = 0;
                ++pass;
            }
        }
        return;
    }

    // ---- consumers (warps 0..3) ----
    float wreg[NEXT_N][8][2];
    int cur_b = -1;
    const uint64_t q_desc = sw128_desc(q_s);
    int stage = 0, pass = 0;
#pragma unroll 1
    for (int i = 0; i < n_items; ++i) {
        const int item = item0 + i;
        const int b = item / tiles_per_seq, key0 = (item - b * tiles_per_seq) * LW_KEYS;
        const int n_seq = lw_seq_len<NEXT_N>(num_valid, b, capacity);
        if (i > 0 && key0 >= n_seq) continue;  // uniform over the consumers; the producer skips it too

        if (b != cur_b) {  // uniform over the consumers: (re)load q and w of sequence b
            cur_b = b;
            lt_consumer_bar();  // every warp's wgmma that read the old q has completed
            for (int c = tid; c < NEXT_N * HEADS * 8; c += LT_CONSUMERS) {
                const int r = c >> 3, ch = c & 7;  // r = t * 64 + head
                const uint4 v = *reinterpret_cast<const uint4*>(q + ((size_t)b * NEXT_N * HEADS + r) * DIM + ch * 16);
                *reinterpret_cast<uint4*>(q_gen + r * DIM + ((ch ^ (r & 7)) << 4)) = v;
            }
#pragma unroll
            for (int t = 0; t < NEXT_N; ++t) {
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float2 wv = *reinterpret_cast<const float2*>(w + ((size_t)b * NEXT_N + t) * HEADS + j * 8 + 2 * tq);
                    wreg[t][j][0] = wv.x;
                    wreg[t][j][1] = wv.y;
                }
            }
            fence_proxy_async();  // q's generic stores -> the wgmma's async-proxy reads
            lt_consumer_bar();
        }

        lt_mbar_wait(full_s + 8 * stage, (uint32_t)pass & 1u);
        const uint64_t a_desc = sw128_desc(keys_s + stage * LW_TILE_BYTES);
        float acc[NACC];
#pragma unroll
        for (int e = 0; e < NACC; ++e) acc[e] = 0.f;
        wgmma_fence();
#pragma unroll
        for (int s = 0; s < DIM / 32; ++s) {
            if constexpr (NEXT_N == 1) {
                wgmma_m64n64k32_e4m3(*reinterpret_cast<float(*)[32]>(acc), a_desc + 2 * s, q_desc + 2 * s, s);
            } else {
                wgmma_m64n128k32_e4m3(*reinterpret_cast<float(*)[64]>(acc), a_desc + 2 * s, q_desc + 2 * s, s);
            }
        }
        wgmma_commit();
        wgmma_wait_all();
        fence_acc(acc);

        const int r0 = warp * 16 + g;  // this thread's rows: r0 (e < 2) and r0 + 8 (e >= 2)
        float row_scale[2];
        // Row r's scale is element (slot0 & 3) + r of the stage's box (the box starts at slot0 & ~3).
        const int kb = key_seq != nullptr ? key_seq[b] : b;
        const int scale0 = stage * (LT_SCALE_STAGE_BYTES / 4) + ((kb * capacity + key0) & 3);
        row_scale[0] = scale_gen[scale0 + r0];
        row_scale[1] = scale_gen[scale0 + r0 + 8];
        __syncwarp();
        if (lane == 0) lt_mbar_arrive(empty_s + 8 * stage);  // this warp is done with the stage
        if (++stage == STAGES) {
            stage = 0;
            ++pass;
        }

#pragma unroll
        for (int t = 0; t < NEXT_N; ++t) {
            float part[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float* d = acc + (t * 8 + j) * 4;
                part[0][0] = fmaf(wreg[t][j][0], fmaxf(d[0], 0.f), part[0][0]);
                part[0][1] = fmaf(wreg[t][j][1], fmaxf(d[1], 0.f), part[0][1]);
                part[1][0] = fmaf(wreg[t][j][0], fmaxf(d[2], 0.f), part[1][0]);
                part[1][1] = fmaf(wreg[t][j][1], fmaxf(d[3], 0.f), part[1][1]);
            }
            float* out = scores + ((size_t)b * NEXT_N + t) * score_stride;
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                float v = part[hh][0] + part[hh][1];
                v += __shfl_xor_sync(FULL, v, 1);
                v += __shfl_xor_sync(FULL, v, 2);
                const int r = r0 + hh * 8;
                if (tq == hh && key0 + r < n_seq) out[key0 + r] = v * row_scale[hh];
            }
        }
    }
}

}  // namespace

// FP8 logits (see logits_tma_body). grid = persistent CTAs (<= 3 per SM), block LT_THREADS = 160, dynamic smem
// lt_smem_bytes<NEXT_N, STAGES>(). codes_map: 2D u8 tensor map {128, batch * capacity}, row stride 128 B, box
// {128, 64}, 128B swizzle; scales_map: 1D f32 tensor map {batch * capacity}, box {68} (16-byte aligned bases).
// tiles_per_seq = ceil(capacity / 64), total_tiles = batch * tiles_per_seq (the item list of the whole capacity of
// every query sequence; batch = the query sequences, key_seq maps each to its cache sequence).
#define INDEXER_LOGITS_TMA_ENTRY(NAME, NEXT_N, STAGES)                                                          \
    extern "C" __global__ void __launch_bounds__(LT_THREADS, 3)                                                 \
        NAME(const __grid_constant__ LtTensorMap codes_map, const __grid_constant__ LtTensorMap scales_map,      \
             const uint8_t* __restrict__ q, const float* __restrict__ w, const int* __restrict__ num_valid,      \
             const int* __restrict__ key_seq, int capacity, float* __restrict__ scores, int score_stride,        \
             int tiles_per_seq, int total_tiles) {                                                               \
        logits_tma_body<NEXT_N, STAGES>(&codes_map, &scales_map, q, w, num_valid, key_seq, capacity, scores,    \
                                        score_stride, tiles_per_seq, total_tiles);                               \
    }

// Stages: 3 CTAs x lt_smem_bytes must fit 228 KB per SM with 1 KB reserved per CTA: next_n 1 with 7 stages =
// 69,360 B, next_n 2 with 6 stages = 68,960 B (8 stages / 7 stages would not fit).
INDEXER_LOGITS_TMA_ENTRY(indexer_logits_fp8_n1, 1, 7)
INDEXER_LOGITS_TMA_ENTRY(indexer_logits_fp8_n2, 2, 6)
