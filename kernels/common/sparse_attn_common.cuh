// The pieces of sparse_attn decode that the FP8 kernels share: the entry constants, the decode arguments and
// their macro, the candidate resolution and tile range of a (sequence, split), the online-softmax state and the
// epilogue (row sums, the split partial, the finished BF16 output with sink and inverse RoPE), the 128B-swizzled
// wgmma layout with its P.V instruction, the raw-entry registers and their exact dequant, and the q quantization.
//
// Included by kernels/sparse_attn.cu (sparse_attn_decode_fp8, the BF16 baseline, the combines). The FP8 kernel
// writes its split partials through store_split_partial and finishes through finish_staged, so the combines merge
// its partials, and its unsplit output is the combine's formula on its own registers.
//
// Warp layout the epilogue assumes: 256 math threads = two warp groups wh = 0, 1 of 4 warps
// wm = 0..3; thread (wm, wh, lane) holds rows 16 wm + g and 16 wm + g + 8 (g = lane / 4) and the output dims
// 256 wh + 8 nt + 2 tq (+1) (tq = lane % 4, nt = 0..31) in WarpState::o, the m64n256 wgmma accumulator layout;
// warps wm and wm + 4 share rows, and row_sums joins them through pair barrier wm + 1 (ids 1..4, 64 threads).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "formats.cuh"
#include "kv_entry.cuh"
#include "wgmma.cuh"

namespace sa {

constexpr int kDim = 512;
constexpr int kNope = 448;
constexpr int kTiles = 7;
constexpr int kEntryBytes = 584;
constexpr int kRopeOffset = 448;
constexpr int kScaleOffset = 576;
constexpr int kBlockN = 64;        // candidates per KV tile
constexpr int kHeadsPerCta = 64;   // heads per CTA (head group)
constexpr int kThreads = 256;
constexpr float kAmaxFloor = 1e-4f;
constexpr float kLog2e = 1.4426950408889634f;
// 1/sqrt(512) * log2(e): scores go straight to the log2 domain used by exp2f.
constexpr float kScoreScaleLog2 = 0.044194173824159216f * 1.4426950408889634f;
constexpr int kRedBytes = 2 * kHeadsPerCta * 4;                  //   512

static_assert(kEntryBytes == mm::kKvEntryBytes && kRopeOffset == mm::kKvRopeOffset &&
                  kScaleOffset == mm::kKvScaleOffset && kAmaxFloor == mm::kKvAmaxFloor,
              "the entry constants of common/kv_entry.cuh");

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Barrier for the 64 threads of the two warps that own one 16-head block (ids 1..4; 0 is __syncthreads).
__device__ __forceinline__ void pair_barrier(int head_block) {
    asm volatile("bar.sync %0, 64;\n" ::"r"(head_block + 1) : "memory");
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// Two e4m3 codes (low byte first) times a power-of-two scale -> two BF16 (exact: e4m3 -> f16 -> f32 is exact,
// the pow2 multiply is exact, and the result has <= 4 significant bits).
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2_scaled(uint32_t two_codes, float scale) {
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_codes & 0xFFFFu), __NV_E4M3);
    float2 f = __half22float2(__half2(h));
    return pack_bf16x2(f.x * scale, f.y * scale);
}

using LaneQuant = mm::KvLaneQuant;

// ---------------------------------------------------------------------------------------------------------
// Decode attention: shared pieces
// ---------------------------------------------------------------------------------------------------------
struct DecodeArgs {
    const __nv_bfloat16* q;        // [B, H, 512], RoPE at the query position applied to dims 448..511
    const uint8_t* pool;           // [n_entries, 584] (FP8 path)
    const __nv_bfloat16* staging;  // [B, stride, 512] (BF16 path)
    int n_entries;
    const int* candidates;  // [B, stride] pool indices, -1 = invalid
    int stride;
    const int* lengths;    // [B]
    const int* positions;  // [B] query position t
    const float* sinks;    // [H] natural-log units
    const float* freqs;    // [32] the layer's RoPE frequencies
    int heads;
    int tiles_per_split;
    int n_splits;
    __nv_bfloat16* out;  // [B, H, 512] (n_splits == 1)
    float* part_o;       // [B, n_splits, H, 512] (n_splits > 1)
    float* part_lse;     // [B, n_splits, H], log2 units
};

__device__ __forceinline__ int resolve_candidate(const DecodeArgs& a, int b, int len, int j) {
    if (j >= len) return -1;
    const int idx = __ldg(a.candidates + (size_t)b * a.stride + j);
    return (idx >= 0 && idx < a.n_entries) ? idx : -1;
}

// Inverse RoPE of one interleaved pair at query position `pos`: (x + iy) * e^{-i pos f}.
// (c, s) = (cos, sin) of the pair's angle pos * freq; inverse_rope_pair computes them, the epilogue of
// sparse_attn_decode_fp8 (finish_staged) reads them from a per-CTA table (the same sincosf of the same product,
// so the same values), and both rotate through this one expression.
__device__ __forceinline__ void inverse_rope_rotate(float& x, float& y, float c, float s) {
    const float nx = x * c + y * s;
    const float ny = y * c - x * s;
    x = nx;
    y = ny;
}

__device__ __forceinline__ void inverse_rope_pair(float& x, float& y, int pos, float freq) {
    float s, c;
    sincosf(__fmul_rn(static_cast<float>(pos), freq), &s, &c);
    inverse_rope_rotate(x, y, c, s);
}

// Per-thread state of the online softmax and output (see the warp layout in the header comment).
struct WarpState {
    float o[32][4];   // O fragment: 32 n8-tiles of dims 256*wh + 8*nt; rows g (0,1) and g+8 (2,3)
    float m[2];       // running max (log2 units) of rows g, g+8
    float l[2];       // this lane's partial sum of exp2(s - m) of rows g, g+8
};


// Full row sums l[r] of rows row0 and row0 + 8 (the quad, then the other warp group's half through red_sum).
__device__ __forceinline__ void row_sums(const WarpState& st, float* red_sum, int wm, int wh, int g, int tq,
                                         float (&l)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] = st.l[r];
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    const int row0 = 16 * wm + g;
    if (tq == 0) {
        red_sum[wh * kHeadsPerCta + row0] = l[0];
        red_sum[wh * kHeadsPerCta + row0 + 8] = l[1];
    }
    pair_barrier(wm);
    l[0] += red_sum[(1 - wh) * kHeadsPerCta + row0];
    l[1] += red_sum[(1 - wh) * kHeadsPerCta + row0 + 8];
}

// Split partial of rows row0 (+8): O / l and lse = m + log2 l (f32), for the sparse_attn_combine_* kernels.
__device__ __forceinline__ void store_split_partial(const WarpState& st, const DecodeArgs& a, const float (&l)[2],
                                                    int b, int hg, int split, int row0, int wh, int tq) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int h = hg * kHeadsPerCta + row0 + 8 * r;
        const bool empty = (st.m[r] == -INFINITY);
        const float inv = empty ? 0.f : 1.f / l[r];
        const size_t prow = ((size_t)b * a.n_splits + split) * a.heads + h;
        float* orow = a.part_o + prow * kDim + 256 * wh;
#pragma unroll
        for (int nt = 0; nt < 32; ++nt)
            *reinterpret_cast<float2*>(orow + 8 * nt + 2 * tq) =
                make_float2(st.o[nt][2 * r] * inv, st.o[nt][2 * r + 1] * inv);
        if (wh == 0 && tq == 0) a.part_lse[prow] = empty ? -INFINITY : st.m[r] + log2f(l[r]);
    }
}

// The epilogue of the FP8 kernel (sparse_attn_decode_fp8): finish()'s values, bit for bit (the same operations on the same
// registers), in code that is small and stores whole 16-byte chunks. The epilogue runs once per warp; finish()'s
// unrolled form (an inlined sincosf and a branch per rope pair, 2 rows x 32 n-tiles) is ~7,900 straight-line SASS
// instructions, which at Pro batch 128 stall mostly on instruction fetch
// (results/h200/archive/profile/ncu-sparse_attn-session7-start-hot.txt). Here:
//   * cos / sin of the 32 rope pairs come from rope_cs, filled once per CTA in the prologue with the same
//     sincosf(__fmul_rn(pos, freq)) finish() evaluates per pair (every head shares the query position);
//   * the rope is one warp-uniform branch: rope dims 448..511 are n-tiles 24..31 of warp group 1 only
//     (dim = 256 wh + 8 nt + 2 tq >= 448 <=> wh = 1 and nt >= 24), pair index (dim - 448) / 2 = 4 (nt - 24) + tq;
//     x = o * inv is computed in place first, then rotated, then packed: finish()'s operations in finish()'s order;
//   * one split (the finished BF16 output): the fragments go to a staging image of the CTA's 64 output rows in shared
//     memory, then out as 16 whole, coalesced 16-byte chunks per thread (stored directly, the 64 scattered 4-byte
//     stores per thread held 7.2% of the Pro b128 samples in `lg`, the memory pipe's queue). Staging = the two
//     K = V tiles (vt, 2 x 64 KiB), free once every warp group has waited its last P.V, which the first
//     math_sync guarantees; row h's chunk c sits at chunk slot c ^ (h & 7) of its 1 KiB row, so the 8 rows a
//     warp instruction writes (g = h & 7) land in 8 different bank groups. a.n_splits is uniform over the CTA, so
//     every thread reaches both barriers;
//   * split partials are stored directly (store_split_partial): staging them through shared memory costs two more
//     barriers, which show at batch 1-4 where a CTA has one or two tiles (results/h200/archive/session7-ab);
//   * math_sync() is a barrier over the 256 threads that run it (tid 0..255): SyncCta (__syncthreads) where every
//     thread of the CTA runs the epilogue, a named barrier of 256 threads where a producer warp group does not.
struct SyncCta {
    __device__ __forceinline__ void operator()() const { __syncthreads(); }
};
template <class MathSync>
__device__ __forceinline__ void finish_staged(WarpState& st, const DecodeArgs& a, float* red_sum, const float2* rope_cs,
                                              uint8_t* stage, int b, int hg, int split, int wm, int wh, int g, int tq,
                                              int tid, const MathSync& math_sync) {
    float l[2];
    row_sums(st, red_sum, wm, wh, g, tq, l);
    const int row0 = 16 * wm + g;
    if (a.n_splits != 1) {
        store_split_partial(st, a, l, b, hg, split, row0, wh, tq);
        return;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int h = hg * kHeadsPerCta + row0 + 8 * r;
        const bool empty = (st.m[r] == -INFINITY);
        const float z = empty ? 1.f : l[r] + exp2f(a.sinks[h] * kLog2e - st.m[r]);
        const float inv = empty ? 0.f : 1.f / z;
#pragma unroll
        for (int nt = 0; nt < 32; ++nt) {
            st.o[nt][2 * r] *= inv;
            st.o[nt][2 * r + 1] *= inv;
        }
    }
    if (wh == 1) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float2 cs = rope_cs[4 * j + tq];
#pragma unroll
            for (int r = 0; r < 2; ++r) inverse_rope_rotate(st.o[24 + j][2 * r], st.o[24 + j][2 * r + 1], cs.x, cs.y);
        }
    }
    math_sync();  // every warp group's last P.V is complete: the vt tiles are free
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int h = row0 + 8 * r;  // h & 7 == g
        uint8_t* row = stage + h * 1024 + 4 * tq;
#pragma unroll
        for (int nt = 0; nt < 32; ++nt)  // dims 256 wh + 8 nt + 2 tq: chunk 32 wh + nt, bytes 4 tq
            *reinterpret_cast<uint32_t*>(row + (((32 * wh + nt) ^ g) << 4)) =
                pack_bf16x2(st.o[nt][2 * r], st.o[nt][2 * r + 1]);
    }
    math_sync();
    __nv_bfloat16* out = a.out + ((size_t)b * a.heads + hg * kHeadsPerCta) * kDim;
#pragma unroll 4
    for (int u = tid; u < kHeadsPerCta * 64; u += kThreads) {
        const int h = u >> 6, c = u & 63;
        *reinterpret_cast<uint4*>(out + h * kDim + 8 * c) =
            *reinterpret_cast<const uint4*>(stage + h * 1024 + ((c ^ (h & 7)) << 4));
    }
}

// Tile range of this CTA: split `split` covers tiles [split*tps, (split+1)*tps) of its sequence's list.
__device__ __forceinline__ void tile_range(const DecodeArgs& a, int b, int split, int& len, int& t_begin,
                                           int& n_it) {
    len = min(max(a.lengths[b], 0), a.stride);
    const int n_len_tiles = (len + kBlockN - 1) / kBlockN;
    t_begin = split * a.tiles_per_split;
    n_it = max(0, min(t_begin + a.tiles_per_split, n_len_tiles) - t_begin);
}

// ---------------------------------------------------------------------------------------------------------
// The 128B-swizzled K-major wgmma layout of q, the K = V tile and P (the layout of kernels/moe_gemm_prefill.cu,
// verified there on the H200): 8 k-blocks of 64 dims, each 64 rows x 128 B (8 KiB, 1024-aligned); byte offset of
// (row r, global 16-byte chunk C in 0..64) = (C >> 3) * 8192 + r * 128 + (((C & 7) ^ (r & 7)) << 4). A Rust mirror
// (tests/sparse_attn.rs, `swizzle_layout_mirror`) checks it is a bijection and that the dequant and P address forms
// equal it. fence.proxy.async orders the generic-proxy stores of a tile before async-proxy wgmma reads of it.
// ---------------------------------------------------------------------------------------------------------
constexpr int kSwBlockBytes = 64 * 128;  // one k-block (64 dims) of 64 rows
constexpr int kSwTileBytes = 8 * kSwBlockBytes;  // 64 rows x 512 dims BF16

__device__ __forceinline__ uint32_t sw_off(int row, int chunk) {
    return (uint32_t)((chunk >> 3) * kSwBlockBytes + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

// ---------------------------------------------------------------------------------------------------------
// P.V on wgmma:
//   * P (64 heads x 64 entries, BF16) is written in the 128B-swizzled K-major layout (one 8 KiB block,
//     1024-aligned): byte offset of (head r, entry c) = r * 128 + (((c >> 3) ^ (r & 7)) << 4) + 2 (c & 7).
//   * Warp group wh computes O[64 heads, dims 256wh..256wh+255] += P . V with 4 x wgmma.m64n256k16
//     (K = 16 entries each). A = P (K-major, +32 B per K=16 slice, as for q; from shared memory). B = the K = V tile read N-major (imm-trans-b = 1): the same swizzled bytes serve as
//     the N-major 128B-swizzle canonical layout, with rows = K (entries, 128 B apart, 8-row groups SBO = 1024 B
//     apart; a K=16 slice is +2048 B) and 64-dim atoms along N LBO = 8192 B apart (the k-block stride). Descriptor
//     fields as in the PTX ISA matrix descriptor; for N-major swizzled layouts LBO is the stride between swizzle
//     atoms along N.
//   * The m64n256k16 accumulator fragment is the WarpState O layout (warp w of the group: heads 16w + l/4 (+8),
//     dims 256wh + 8nt + 2(l%4) (+1) in register 4nt + i), so the online-softmax rescale and finish are shared.
// ---------------------------------------------------------------------------------------------------------
constexpr int kPswBytes = 64 * 128;  // the swizzled P block: 64 heads x 64 entries BF16

// Descriptor of an N-major (MN-major) 128B-swizzled operand: start >> 4, LBO = 8192 B between 64-element atoms
// along N, SBO = 1024 B between 8-row groups along K, 128B swizzle.
__device__ __forceinline__ uint64_t sw128_desc_mn(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(kSwBlockBytes >> 4) << 16) |
           ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

__device__ __forceinline__ void fence_acc_o(float (&d)[32][4]) {
#pragma unroll
    for (int i = 0; i < 32; ++i)
        asm volatile("" : "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])::"memory");
}

// D(64 x 256, f32, the WarpState O layout) += A(64 x 16 bf16, K-major smem desc) * B(16 x 256 bf16, N-major smem
// desc): imm-trans-b = 1. d[nt][i] is accumulator register 4 nt + i (row 16 w + l/4 (+8), column 8 nt + 2 (l%4) (+1)).
__device__ __forceinline__ void wgmma_m64n256k16_tb(float (&d)[32][4], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]), "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]), "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]), "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]), "+f"(d[25][0]), "+f"(d[25][1]), "+f"(d[25][2]), "+f"(d[25][3]), "+f"(d[26][0]), "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]), "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), "+f"(d[27][3]), "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]), "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]), "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]), "+f"(d[31][0]), "+f"(d[31][1]), "+f"(d[31][2]), "+f"(d[31][3])
        : "l"(da), "l"(db), "r"(1));
}

// ---------------------------------------------------------------------------------------------------------
// Raw entries in registers and their exact dequant into the swizzled BF16 tile. Thread (e, q) (entry e of the
// tile, quarter q in 0..3) loads exactly the 8-byte chunks its dequant converts: 14 nope chunks, the scale word,
// 4 rope words = 19 x 8 B (entries are only 8-byte aligned). It writes chunk q + 4((i & 1) ^ (e & 1)) of k-block
// i >> 1, so the two entries of a quarter-warp hit disjoint bank quartets; the rope dims (chunks 56..63) are
// copied. An invalid candidate (idx < 0) gives zero codes and scale code 0: K = V = 0, never NaN.
// ---------------------------------------------------------------------------------------------------------
struct RawRegs {
    uint2 nope[14];  // chunk 8 (i >> 1) + q + 4 ((i & 1) ^ (e & 1)) of the entry (the order dequant_regs writes)
    uint2 sc;        // bytes 576..583: the 7 UE8M0 scales + pad
    uint2 rope[4];   // rope 16-byte chunks q (words 0, 1) and q + 4 (words 2, 3)
};

__device__ __forceinline__ void load_raw_regs(RawRegs& r, const uint8_t* __restrict__ pool, int idx, int q, int odd) {
    if (idx >= 0) {
        const uint8_t* src = pool + (size_t)idx * kEntryBytes;
#pragma unroll
        for (int i = 0; i < 14; ++i)
            r.nope[i] = __ldg(reinterpret_cast<const uint2*>(src + 8 * (8 * (i >> 1) + q + 4 * ((i & 1) ^ odd))));
        r.sc = __ldg(reinterpret_cast<const uint2*>(src + kScaleOffset));
#pragma unroll
        for (int j = 0; j < 4; ++j)
            r.rope[j] = __ldg(reinterpret_cast<const uint2*>(src + kRopeOffset + 16 * q + 8 * (j & 1) + 64 * (j >> 1)));
    } else {  // zero codes and scale code 0: K = V = 0, never NaN (the score is masked anyway)
#pragma unroll
        for (int i = 0; i < 14; ++i) r.nope[i] = make_uint2(0u, 0u);
        r.sc = make_uint2(0u, 0u);
#pragma unroll
        for (int j = 0; j < 4; ++j) r.rope[j] = make_uint2(0u, 0u);
    }
}

__device__ __forceinline__ void dequant_regs(const RawRegs& r, uint8_t* vt, int e, int q, int odd) {
    float scale[kTiles];
#pragma unroll
    for (int t = 0; t < kTiles; ++t)
        scale[t] = mm::ue8m0_decode(static_cast<uint8_t>(((t < 4 ? r.sc.x : r.sc.y) >> (8 * (t & 3))) & 0xFFu));
#pragma unroll
    for (int i = 0; i < 14; ++i) {
        const int c = 8 * (i >> 1) + q + 4 * ((i & 1) ^ odd);
        const uint2 w = r.nope[i];
        const float s = scale[i >> 1];
        uint4 o;
        o.x = e4m3x2_to_bf16x2_scaled(w.x, s);
        o.y = e4m3x2_to_bf16x2_scaled(w.x >> 16, s);
        o.z = e4m3x2_to_bf16x2_scaled(w.y, s);
        o.w = e4m3x2_to_bf16x2_scaled(w.y >> 16, s);
        *reinterpret_cast<uint4*>(vt + sw_off(e, c)) = o;
    }
    *reinterpret_cast<uint4*>(vt + sw_off(e, 56 + q)) = make_uint4(r.rope[0].x, r.rope[0].y, r.rope[1].x, r.rope[1].y);
    *reinterpret_cast<uint4*>(vt + sw_off(e, 60 + q)) = make_uint4(r.rope[2].x, r.rope[2].y, r.rope[3].x, r.rope[3].y);
}

// =============================================================================================================
// The FP8 q prologue: the same values bit for bit as quantizing like a KV entry (mm::kv_quantize_lane), cheaper:
//   * q codes by multiplication: e4m3(x / s) with s = 2^(c-127) the UE8M0 scale (code c in 1..254, from
//     ue8m0_pow2_scale_for) equals e4m3(x * 2^(127-c)): x / 2^k and x * 2^-k are the same real number, and both
//     IEEE operations round it once to nearest-even (no FTZ in this build), so the f32 inputs of the e4m3
//     conversion are identical, also when they are subnormal. 2^(127-c) is exact for every c in 1..254
//     (biased exponent 254 - c; c = 254 gives the subnormal 2^-127 = ue8m0_decode(0)). This removes one IEEE
//     division (MUFU.RCP + Newton steps + the slow-path check) per q element: 16 per lane per head, ~half of the
//     prologue's instructions. Exhaustive CPU mirror: tests/sparse_attn.rs `pow2_division_equals_reciprocal_product`.
//   * tile 0's raw loads issued before the q prologue (see the body).
// =============================================================================================================
__device__ __forceinline__ LaneQuant quantize_lane_pow2_mul(const float (&x)[16]) {
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(x[i]));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    LaneQuant r;
    r.scale_code = mm::ue8m0_pow2_scale_for(fmaxf(amax, kAmaxFloor), 448.f);
    r.scale = mm::ue8m0_decode(r.scale_code);
    const float inv_scale = mm::ue8m0_decode(static_cast<uint8_t>(254 - r.scale_code));  // 2^(127 - c), exact
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        uint32_t v = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) v |= uint32_t(mm::e4m3_encode(__fmul_rn(x[4 * w + i], inv_scale))) << (8 * i);
        r.codes[w] = v;
    }
    return r;
}

// The q prologue of the FP8 kernels, in two steps so that a kernel can issue other loads between them. Warp w of
// the 8 math warps owns heads 8w..8w+7 of the CTA's head group; lane l holds dims 16l..16l+15 of each.
// load_q_rows: the raw BF16 q rows (no dependency on anything, issued first).
__device__ __forceinline__ void load_q_rows(uint4 (&raw)[8][2], const DecodeArgs& a, int b, int hg, int warp, int lane) {
#pragma unroll
    for (int hh = 0; hh < 8; ++hh) {
        const __nv_bfloat16* src = a.q + ((size_t)b * a.heads + hg * kHeadsPerCta + 8 * warp + hh) * kDim + 16 * lane;
        raw[hh][0] = *reinterpret_cast<const uint4*>(src);
        raw[hh][1] = *reinterpret_cast<const uint4*>(src + 8);
    }
}

// store_q_image: q quantized per (head, 64-tile) like a KV entry (quantize_lane_pow2_mul: UE8M0 scale, e4m3 codes),
// held as the exact BF16 values codes x scale (nope dims, lanes 0..27) and the BF16 rope dims as given (lanes
// 28..31), stored in the swizzled layout at qsw (generic-proxy stores: the caller fences before wgmma reads them).
__device__ __forceinline__ void store_q_image(const uint4 (&raw)[8][2], uint8_t* qsw, int warp, int lane) {
#pragma unroll
    for (int hh = 0; hh < 8; ++hh) {
        const int hrow = 8 * warp + hh;
        uint4* dst0 = reinterpret_cast<uint4*>(qsw + sw_off(hrow, 2 * lane));
        uint4* dst1 = reinterpret_cast<uint4*>(qsw + sw_off(hrow, 2 * lane + 1));
        const uint32_t wv[8] = {raw[hh][0].x, raw[hh][0].y, raw[hh][0].z, raw[hh][0].w,
                                raw[hh][1].x, raw[hh][1].y, raw[hh][1].z, raw[hh][1].w};
        float x[16];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            x[2 * i] = __uint_as_float(wv[i] << 16);
            x[2 * i + 1] = __uint_as_float(wv[i] & 0xFFFF0000u);
        }
        const LaneQuant lq = quantize_lane_pow2_mul(x);
        if (lane < 28) {
            uint32_t o[8];
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                o[2 * w] = e4m3x2_to_bf16x2_scaled(lq.codes[w], lq.scale);
                o[2 * w + 1] = e4m3x2_to_bf16x2_scaled(lq.codes[w] >> 16, lq.scale);
            }
            *dst0 = make_uint4(o[0], o[1], o[2], o[3]);
            *dst1 = make_uint4(o[4], o[5], o[6], o[7]);
        } else {
            *dst0 = raw[hh][0];
            *dst1 = raw[hh][1];
        }
    }
}

}  // namespace sa

// The argument list of every decode-attention entry point (the Rust launcher `launch_attention` passes it).
#define SA_DECODE_PARAMS                                                                                        \
    const __nv_bfloat16 *q, const uint8_t *pool, const __nv_bfloat16 *staging, int n_entries,                   \
        const int *candidates, int stride, const int *lengths, const int *positions, const float *sinks,        \
        const float *freqs, int heads, int tiles_per_split, int n_splits, __nv_bfloat16 *out, float *part_o,    \
        float *part_lse
#define SA_DECODE_ARGS                                                                                           \
    sa::DecodeArgs {                                                                                             \
        q, pool, staging, n_entries, candidates, stride, lengths, positions, sinks, freqs, heads, tiles_per_split, \
            n_splits, out, part_o, part_lse                                                                      \
    }

