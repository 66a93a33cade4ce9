// Decode dense linears of DeepSeek-V4 (src/ops/dense/mod.rs is the launcher and states the contract):
// y[m, r] = sum_k W[r, k] * x[m, k] for M <= 64 activation rows, with the weight streamed once from HBM.
//
// Modes (one entry point per mode and token capacity 8/16/32/64 = kMT x 8):
//  * dense_fp8_m*:    W e4m3 + ue8m0 128x128 block scales, x e4m3 1x128 + ue8m0 scales (norm_quant's FP8 rows),
//                     y BF16. f16 tensor-core MMA: e4m3 -> f16 is exact (cvt e4m3x2 -> f16x2), products exact.
//  * dense_fp8_bf16x_m*: the grouped wo_a: W FP8 as above, x BF16 (not quantized), y BF16; one job per group.
//                     bf16 MMA; W e4m3 -> f16 (exact) -> bf16 by moving the bits (exact, identity below).
//  * dense_bf16_m*:   W BF16, x BF16, y f32 (the model's `matvec`); up to kMaxJobs weights sharing x per launch.
//  * dense_fp8_qx_m*: dense_fp8 on BF16 x, quantized to FP8 1x128 (norm_quant's rule) as the CTA stages its slice:
//                     the bits of quantize_bf16_rows + dense_fp8 without the quantizer's launch (wo_b of z).
//  * dense_fp8_normqx_m*: the same after an RMSNorm of each x row (weight and eps in the params): the bits of
//                     norm_quant's rmsnorm_fp8_bf16in + dense_fp8 (wq_b and the indexer's wq_b of qa).
//  * dense_swiglu_m*: the shared expert's w1 and w3 (FP8) on the same FP8 x in one pass; the epilogue rounds g, u
//                     to BF16, clamps (g <= L, -L <= u <= L), h = bf16(silu(g) * u), and writes h as FP8 1x128
//                     (codes + ue8m0 scales, the formats::fp8 rule), ready for dense_fp8 with w2.
//
// Work split: a CTA (8 warps) owns 128 rows of one job (= one weight scale row block) and a K slice of kc
// columns (split-K when rows alone give too few CTAs). Warp w owns rows 16w .. 16w+15 of the tile and streams them
// through a per-warp cp.async ring one step at a time: a step is the next 128-byte line of each of its 16 rows (per
// weight), so every request is a whole L2 line (kRingBytes per CTA: 4 steps of 2 KB per warp; the SwiGLU pair
// kRingBytesPair: 3 steps of 4 KB). The MMA side reads a step as two halves: in half hh, lane (g = lane/4,
// t = lane%4) takes 16-byte chunk 4hh + t of rows g and g+8. The CTA's x slice is staged once in shared memory as
// f16 (FP8 x, exact) or bf16, with its scales.
//
// K permutation identity: a dot product does not depend on the order of k, so the MMA's logical k index may map to
// any permutation of the physical k, as long as A (weight) and B (x) use the same one. MMA j of a half step takes,
// for lane (g, t), the 16-bit pairs 2j and 2j+1 of the lane's 16 bytes of that half: logical columns t*2+{0,1} <->
// physical t*L + 4j + {0,1}, logical 8+t*2+{0,1} <-> t*L + 4j + 2 + {0,1} (L = values per lane per half: 16 FP8 /
// 8 BF16); over j this is a bijection onto the half's 4L columns. The x fragment is read with the same mapping.
//
// PDL (common/pdl.cuh; the launcher always sets the attribute): a CTA issues the ring's first kStages - 1 weight
// steps and stages the weight scales, then waits for the previous kernel (pdl_wait) before it reads x or touches
// the partials, counters or y. A predecessor that triggers at its start (norms, quantizers, q / KV prep, router
// selection, attention) lets up to 48 KB a CTA of the weights (kStages - 1 = 3 of 4 steps of 2 KB a warp) arrive
// while it runs: for wq_b at M = 1 (32 MB on 256 CTAs) about 37% of the weight bytes. The CTA triggers its own
// successor once its last weight load is issued.
//
// Scales: FP8 weights are summed per 128-column block (one step) in a fresh f32 MMA accumulator, then added to the
// running f32 sum times sw * sx (powers of two: exact products). Split-K: each CTA writes its f32 partial sums to
// the caller's workspace; the last CTA of a tile to arrive (a release/acquire counter) adds the partials in split
// order 0, 1, ... (deterministic, whichever CTA is last) and resets the counter to 0 for the next call or graph
// replay.
//
// Bandwidth: at M = 1..8 the weight bytes dominate, and the loop is latency-bound, not issue-bound (Nsight Compute
// on the H100: 15% of issue slots busy, 0.3 eligible warps per scheduler). Whole-line requests are the lever: each
// request the SM tracks brings 128 useful bytes, not 64 (a ring of 64-byte row segments reached 48-63% of DRAM peak;
// the PERF-LOG has the comparison). At M = 64 the x slice (64 x kc f16), 8 token groups of MMAs per half step and
// the partials (splits x M x N f32, mostly L2) cost more.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "common/cp_async.cuh"
#include "common/formats.cuh"
#include "common/norm_row.cuh"
#include "common/pdl.cuh"
#include "common/swiglu_fp8.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = 8;
constexpr int kTileRows = 128;
constexpr int kMaxJobs = 16;
constexpr int kRingBytes = 65536;      // the per-CTA weight ring (one weight)
constexpr int kRingBytesPair = 98304;  // the SwiGLU pair's ring: 3 steps of w1 and w3 lines a warp

enum Mode : int { kFp8 = 0, kFp8Bf16x = 1, kBf16 = 2, kSwiglu = 3, kFp8Qx = 4, kFp8NormQx = 5 };

// Mirrors ops::dense::DenseParams (#[repr(C)]): 768 bytes, passed as a __grid_constant__.
struct DenseParams {
    const uint8_t* w[kMaxJobs];        // job z's weight [n, k] (e4m3 codes or BF16); kSwiglu: w[0] = w1, w[1] = w3
    const uint8_t* w_scale[kMaxJobs];  // FP8: job z's ue8m0 scales [n/128, k/128]; kSwiglu: [0] w1, [1] w3
    void* y[kMaxJobs];                 // job z's output, element (m, r) at y + m*ldy[z] + r; kSwiglu: [0] codes, [1] scales
    const uint8_t* x;                  // e4m3 codes or BF16, [m, ldx]
    const uint8_t* x_scale;            // FP8 x: ue8m0 codes [m, ldx/128]; kFp8NormQx: the RMSNorm weight, BF16 [ldx]
    float* part;                       // split-K partial sums
    unsigned* count;                   // per-tile arrival counters, 0 between calls
    int n[kMaxJobs];                   // rows of job z
    int x_col[kMaxJobs];               // first column of x that job z reads
    int part_off[kMaxJobs];            // job z's partials start (floats)
    int count_off[kMaxJobs];           // job z's first tile counter
    int ldy[kMaxJobs];                 // job z's output row stride (elements); kSwiglu: ldy[0] for codes and scales
    int m, k, ldx, kc, splits;
    float scalar;                      // kSwiglu: the clamp limit L (<= 0: none); kFp8NormQx: the RMSNorm eps
    int reserved;
};
static_assert(sizeof(DenseParams) == 768, "DenseParams must match ops::dense::DenseParams");

template <int kMode>
struct Cfg {
    static constexpr bool kWFp8 = kMode != kBf16;
    // FP8 x on the f16 MMA path: read as FP8 rows, or (kFp8Qx) read as BF16 and quantized while staged.
    static constexpr bool kXFp8 = kMode == kFp8 || kMode == kSwiglu || kMode == kFp8Qx || kMode == kFp8NormQx;
    // x read as BF16 and turned into FP8 1x128 rows while staged (kFp8NormQx: after an RMSNorm of the row).
    static constexpr bool kXBf16Quantized = kMode == kFp8Qx || kMode == kFp8NormQx;
    static constexpr int kNW = kMode == kSwiglu ? 2 : 1;    // weights a warp streams
    // A step is one 128-byte line of each of the warp's 16 rows (per weight): 128 FP8 or 64 BF16 columns, consumed
    // as two halves of 4 lanes x 16 bytes a row.
    static constexpr int kStepK = kWFp8 ? 128 : 64;
    static constexpr int kHalfK = kStepK / 2;               // columns per half step (4 lanes x 16 bytes)
    static constexpr int kLaneK = kHalfK / 4;               // 16 FP8 or 8 BF16 values per lane per row per half
    static constexpr int kMmas = kHalfK / 16;               // MMAs (k16) per half step per token group
    static constexpr int kRing = kNW == 2 ? kRingBytesPair : kRingBytes;
    static constexpr int kWarpStage = 16 * 128 * kNW;        // one step of a warp: 16 rows x 128 bytes per weight
    static constexpr int kStages = kRing / (kWarps * kWarpStage);
    static constexpr int kWarpRing = kStages * kWarpStage;
    static constexpr int kXLaneBytes = kLaneK * 2;          // staged x is 16-bit: 32 or 16 bytes per lane per half
    // Row padding that makes the 8 token rows' LDS.128 of a quarter warp hit distinct banks.
    static constexpr int kXPad = kXLaneBytes == 32 ? 16 : 64;
};

__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two) {
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(two & 0xFFFFu), __NV_E4M3);
    return (uint32_t)h.x | ((uint32_t)h.y << 16);
}

// f16x2 holding e4m3 values -> bf16x2, exact: every nonzero e4m3 value is a normal f16 (exponent field E >= 6) whose
// mantissa has only its top 3 bits set, so (bits & 0x7fff) >> 3 is the bf16 with exponent field E and the same
// mantissa, i.e. the value times 2^-112; the sign is copied; multiplying by 2^112 is exact. Zero stays +-0.
__device__ __forceinline__ uint32_t f16x2_e4m3_to_bf16x2(uint32_t h) {
    uint32_t s = ((h & 0x7FFF7FFFu) >> 3) | (h & 0x80008000u);
    __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162*>(&s);
    v = __hmul2(v, __floats2bfloat162_rn(0x1p112f, 0x1p112f));
    return *reinterpret_cast<uint32_t*>(&v);
}

template <bool kF16>
__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    if constexpr (kF16) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
}

__device__ __forceinline__ uint4 lds128(const uint8_t* p) { return *reinterpret_cast<const uint4*>(p); }

__device__ __forceinline__ float bf16r(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

template <int kMode, int kMT>
__device__ __forceinline__ void dense_body(const DenseParams& p) {
    using C = Cfg<kMode>;
    constexpr int kNW = C::kNW;
    constexpr int kTok = kMT * 8;
    extern __shared__ __align__(16) uint8_t smem[];

    const int z = blockIdx.z, tile = blockIdx.x, split = blockIdx.y;
    const int n = p.n[z];
    if (tile * kTileRows >= n) return;  // whole CTA: a job shorter than the grid's widest
    const int K = p.k, M = p.m;
    const int k0 = split * p.kc;
    const int kc = min(p.kc, K - k0);
    const int nsteps = kc / C::kStepK;
    const int kblocks = (kc + 127) / 128;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int xstride = p.kc * 2 + C::kXPad;

    uint8_t* ring = smem;
    uint8_t* xs = smem + C::kRing;
    float* sxs = reinterpret_cast<float*>(xs + kTok * xstride);  // [kTok][p.kc/128] FP8 x scales
    float* sws = sxs + kTok * (p.kc / 128);                      // [kNW][p.kc/128] weight scales

    // The copy: a step of the warp is 16 rows x 128 bytes per weight, four cp.async rounds of 4 rows, each row a
    // whole 128-byte line read by 8 lanes (lane L: row 4i + L/8 of the warp's 16, 16-byte chunk L%8). In shared
    // memory row r's chunk c sits at r*128 + (c ^ 4(r & 1))*16: the compute side's LDS.128 of a quarter warp (rows
    // 2q and 2q+1, chunks 4hh + t) then hits 8 distinct bank groups. A lane reads chunks other lanes copied, so each
    // step waits for its own copies and then syncs the warp.
    constexpr int kEsize = C::kWFp8 ? 1 : 2;
    const int crow = lane >> 3, cchunk = lane & 7;
    const uint8_t* wrow[kNW][4];
#pragma unroll
    for (int v = 0; v < kNW; ++v) {
        const uint8_t* wb = p.w[kNW == 2 ? v : z];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = min(tile * kTileRows + warp * 16 + 4 * i + crow, n - 1);
            wrow[v][i] = wb + ((size_t)row * K + k0) * kEsize + cchunk * 16;
        }
    }
    const uint32_t ring_warp = (uint32_t)__cvta_generic_to_shared(ring + warp * C::kWarpRing);
    auto issue = [&](int s) {
        const uint32_t slot = ring_warp + (s % C::kStages) * C::kWarpStage;
#pragma unroll
        for (int v = 0; v < kNW; ++v)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = 4 * i + crow;
                cp_async16(slot + v * 2048 + r * 128 + ((cchunk ^ ((r & 1) << 2)) << 4), wrow[v][i] + (size_t)s * 128,
                           16);
            }
    };
#pragma unroll
    for (int i = 0; i < C::kStages - 1; ++i) {
        if (i < nsteps) issue(i);
        cp_async_commit();
    }

    // The weight scales of this slice: constant data, so (with the ring's first stages above) staged before the wait.
    if constexpr (C::kWFp8) {
        const int kb_all = K / 128;
        for (int i = threadIdx.x; i < kNW * kblocks; i += kThreads) {
            const int v = i / kblocks, b = i % kblocks;
            const uint8_t* sb = p.w_scale[kNW == 2 ? v : z];
            sws[v * (p.kc / 128) + b] = mm::ue8m0_decode(sb[tile * kb_all + k0 / 128 + b]);
        }
    }
    // PDL: x, the partials and the counters may be the previous kernel's (common/pdl.cuh); nothing before this line
    // reads or writes anything but weights and shared memory.
    pdl_wait();

    // Stage x (zero rows past M) and its scales.
    if constexpr (C::kXBf16Quantized) {
        // kFp8NormQx: each row's RMSNorm factor first, computed exactly as norm_quant's row kernel computes it for
        // this row (rmsnorm_fp8_bf16in: norm_row.cuh's norm_quant_row over blockDim bd = row_block_threads(ldx)
        // threads), so that rstd, and from it every staged value, is that kernel's bit for bit: thread tid of the
        // row holds chunks c = tid + j * bd (j < CH = 4) of 8 values, sums their squares by fmaf in (j, element)
        // order from 0, each warp of bd reduces with warp_sum, and the warp sums are added in warp order from 0
        // (block_sum's order); then rms_rstd and rms_apply_pair, the functions norm_quant_row calls. Here warp w of the CTA plays warp
        // (w % nw) of rows w / nw, w / nw + 8 / nw, ... (a chunk past the row holds zeros there: skipping it
        // adds nothing). The whole row is read (L2), not only this CTA's slice.
        __shared__ float s_rstd[kTok];
        if constexpr (kMode == kFp8NormQx) {
            constexpr int kNormMaxWarps = 8;  // rows up to 8192 values: bd <= 256
            __shared__ float s_red[kTok][kNormMaxWarps];
            const int row_chunks = p.ldx / 8;
            const int bd = ((row_chunks + 3) / 4 + 31) / 32 * 32;
            const int nw = bd / 32;
            for (int task = warp; task < M * nw; task += kWarps) {
                const int m = task / nw, sw = task % nw;
                const int tid = sw * 32 + lane;
                float ss = 0.f;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int c = tid + j * bd;
                    if (c < row_chunks) {
                        const uint4 u = *reinterpret_cast<const uint4*>(p.x + ((size_t)m * p.ldx + c * 8) * 2);
                        const uint32_t w4[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const float lo = __uint_as_float(w4[e] << 16), hi = __uint_as_float(w4[e] & 0xFFFF0000u);
                            ss = fmaf(lo, lo, ss);
                            ss = fmaf(hi, hi, ss);
                        }
                    }
                }
                ss = warp_sum(ss);
                if (lane == 0) s_red[m][sw] = ss;
            }
            __syncthreads();
            if (threadIdx.x < M) {
                float sum = 0.f;
                for (int w = 0; w < nw; ++w) sum += s_red[threadIdx.x][w];
                s_rstd[threadIdx.x] = rms_rstd(sum, p.ldx, p.scalar);
            }
            __syncthreads();
        }
        // BF16 x quantized to FP8 1x128 here with norm_quant's own rule (mm::fp8_chunk8_half_warp, the function its
        // row kernels call). So the staged codes and scales are those
        // quantize_bf16_rows would have written, and the sums those of the FP8 mode on them, bit for bit. A
        // 128-block is 16 chunks of 8: 16 consecutive items, the lanes of a half warp (kc % 128 == 0 and the
        // stride kThreads keep the halves aligned; every warp runs the same trip count: kTok * kc / 8 is a
        // multiple of 32).
        const int chunks = kc / 8;
        for (int i = threadIdx.x; i < kTok * chunks; i += kThreads) {
            const int m = i / chunks, c = i % chunks;
            float v[8];
            if (m < M) {
                const int col = p.x_col[z] + k0 + c * 8;
                const uint4 u = *reinterpret_cast<const uint4*>(p.x + ((size_t)m * p.ldx + col) * 2);
                const uint32_t w4[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    v[2 * e] = __uint_as_float(w4[e] << 16);
                    v[2 * e + 1] = __uint_as_float(w4[e] & 0xFFFF0000u);
                }
                if constexpr (kMode == kFp8NormQx) {
                    // norm_quant_row: y = bf16(w * (x * rstd)), each product rounded, pairs rounded together.
                    const float rstd = s_rstd[m];
                    const uint4 wu = __ldg(reinterpret_cast<const uint4*>(p.x_scale + (size_t)col * 2));
                    const uint32_t ww[4] = {wu.x, wu.y, wu.z, wu.w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const uint32_t r = rms_apply_pair(bf16_lo(ww[e]), bf16_hi(ww[e]), v[2 * e], v[2 * e + 1], rstd);
                        v[2 * e] = bf16_lo(r);
                        v[2 * e + 1] = bf16_hi(r);
                    }
                }
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) v[e] = 0.f;
            }
            uint8_t sc;
            const uint2 codes = mm::fp8_chunk8_half_warp(v, sc);
            *reinterpret_cast<uint4*>(xs + m * xstride + c * 16) =
                make_uint4(e4m3x2_to_f16x2(codes.x), e4m3x2_to_f16x2(codes.x >> 16), e4m3x2_to_f16x2(codes.y),
                           e4m3x2_to_f16x2(codes.y >> 16));
            if ((c & 15) == 0) sxs[m * (p.kc / 128) + (c >> 4)] = m < M ? mm::ue8m0_decode(sc) : 0.f;
        }
    } else if constexpr (C::kXFp8) {
        const int chunks = kc / 16;
        for (int i = threadIdx.x; i < kTok * chunks; i += kThreads) {
            const int m = i / chunks, c = i % chunks;
            uint4 lo = make_uint4(0, 0, 0, 0), hi = lo;
            if (m < M) {
                const uint4 v = *reinterpret_cast<const uint4*>(p.x + (size_t)m * p.ldx + p.x_col[z] + k0 + c * 16);
                lo = make_uint4(e4m3x2_to_f16x2(v.x), e4m3x2_to_f16x2(v.x >> 16), e4m3x2_to_f16x2(v.y),
                                e4m3x2_to_f16x2(v.y >> 16));
                hi = make_uint4(e4m3x2_to_f16x2(v.z), e4m3x2_to_f16x2(v.z >> 16), e4m3x2_to_f16x2(v.w),
                                e4m3x2_to_f16x2(v.w >> 16));
            }
            uint4* dst = reinterpret_cast<uint4*>(xs + m * xstride + c * 32);
            dst[0] = lo;
            dst[1] = hi;
        }
        const int sx_ld = p.ldx / 128;
        for (int i = threadIdx.x; i < kTok * kblocks; i += kThreads) {
            const int m = i / kblocks, b = i % kblocks;
            sxs[m * (p.kc / 128) + b] =
                m < M ? mm::ue8m0_decode(p.x_scale[m * sx_ld + (p.x_col[z] + k0) / 128 + b]) : 0.f;
        }
    } else {
        const int chunks = kc / 8;
        for (int i = threadIdx.x; i < kTok * chunks; i += kThreads) {
            const int m = i / chunks, c = i % chunks;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (m < M)
                v = *reinterpret_cast<const uint4*>(p.x + ((size_t)m * p.ldx + p.x_col[z] + k0 + c * 8) * 2);
            *reinterpret_cast<uint4*>(xs + m * xstride + c * 16) = v;
        }
    }
    __syncthreads();

    float acc[kMT][kNW][4];
    float blk[kMT][kNW][4];
#pragma unroll
    for (int q = 0; q < kMT; ++q)
#pragma unroll
        for (int v = 0; v < kNW; ++v)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[q][v][i] = blk[q][v][i] = 0.f;

    const uint8_t* xlane = xs + g * xstride + t * C::kXLaneBytes;
    for (int s = 0; s < nsteps; ++s) {
        cp_async_wait<C::kStages - 2>();
        __syncwarp();  // every lane's copies of step s have landed; every lane's reads of step s - 1 are done
        // wv[v][hh][h]: the lane's 16 bytes of row g + 8h, chunk 4hh + t (columns hh * kHalfK + t * kLaneK ...).
        uint4 wv[kNW][2][2];
        const uint8_t* slot = ring + warp * C::kWarpRing + (s % C::kStages) * C::kWarpStage;
#pragma unroll
        for (int v = 0; v < kNW; ++v)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = g + 8 * h;
                    wv[v][hh][h] = lds128(slot + v * 2048 + r * 128 + (((4 * hh + t) ^ ((r & 1) << 2)) << 4));
                }
        // The slot refilled now was read into registers in the previous step (the __syncwarp above orders it).
        if (s + C::kStages - 1 < nsteps) issue(s + C::kStages - 1);
        cp_async_commit();

#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            // A fragments: pair word i of row h = values 2i, 2i+1 of the lane's 16 bytes of this half.
            uint32_t a[kNW][2][C::kLaneK / 2];
#pragma unroll
            for (int v = 0; v < kNW; ++v)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const uint32_t wd[4] = {wv[v][hh][h].x, wv[v][hh][h].y, wv[v][hh][h].z, wv[v][hh][h].w};
                    if constexpr (C::kWFp8) {
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            uint32_t lo = e4m3x2_to_f16x2(wd[i]), hi = e4m3x2_to_f16x2(wd[i] >> 16);
                            if constexpr (!C::kXFp8) {
                                lo = f16x2_e4m3_to_bf16x2(lo);
                                hi = f16x2_e4m3_to_bf16x2(hi);
                            }
                            a[v][h][2 * i] = lo;
                            a[v][h][2 * i + 1] = hi;
                        }
                    } else {
#pragma unroll
                        for (int i = 0; i < 4; ++i) a[v][h][i] = wd[i];
                    }
                }

#pragma unroll
            for (int q = 0; q < kMT; ++q) {
                const uint8_t* xp = xlane + q * 8 * xstride + (s * C::kStepK + hh * C::kHalfK) * 2;
                uint32_t xw[C::kLaneK / 2];
                {
                    const uint4 x0 = lds128(xp);
                    xw[0] = x0.x, xw[1] = x0.y, xw[2] = x0.z, xw[3] = x0.w;
                    if constexpr (C::kLaneK == 16) {
                        const uint4 x1 = lds128(xp + 16);
                        xw[4] = x1.x, xw[5] = x1.y, xw[6] = x1.z, xw[7] = x1.w;
                    }
                }
#pragma unroll
                for (int j = 0; j < C::kMmas; ++j)
#pragma unroll
                    for (int v = 0; v < kNW; ++v) {
                        if constexpr (C::kWFp8)
                            mma16816<C::kXFp8>(blk[q][v], a[v][0][2 * j], a[v][1][2 * j], a[v][0][2 * j + 1],
                                               a[v][1][2 * j + 1], xw[2 * j], xw[2 * j + 1]);
                        else
                            mma16816<false>(acc[q][v], a[v][0][2 * j], a[v][1][2 * j], a[v][0][2 * j + 1],
                                            a[v][1][2 * j + 1], xw[2 * j], xw[2 * j + 1]);
                    }
            }
        }

        if constexpr (C::kWFp8) {
            // A step is one 128-column block (kc % 128 == 0): fold its sums in with the block's scales.
            const int kb = s;
#pragma unroll
            for (int v = 0; v < kNW; ++v) {
                const float sw = sws[v * (p.kc / 128) + kb];
#pragma unroll
                for (int q = 0; q < kMT; ++q) {
                    float f0 = sw, f1 = sw;
                    if constexpr (C::kXFp8) {
                        f0 = sw * sxs[(q * 8 + t * 2) * (p.kc / 128) + kb];
                        f1 = sw * sxs[(q * 8 + t * 2 + 1) * (p.kc / 128) + kb];
                    }
                    acc[q][v][0] = fmaf(blk[q][v][0], f0, acc[q][v][0]);
                    acc[q][v][1] = fmaf(blk[q][v][1], f1, acc[q][v][1]);
                    acc[q][v][2] = fmaf(blk[q][v][2], f0, acc[q][v][2]);
                    acc[q][v][3] = fmaf(blk[q][v][3], f1, acc[q][v][3]);
#pragma unroll
                    for (int i = 0; i < 4; ++i) blk[q][v][i] = 0.f;
                }
            }
        }
    }
    // Every weight load of this CTA is issued: a PDL-launched successor (the next GEMV) may start its prefetch.
    pdl_trigger();
    cp_async_wait<0>();
    __syncthreads();  // the ring is free: reused for the tile's sums

    // red[token][v * 128 + row in tile]: the tile's complete f32 sums.
    constexpr int kRed = kNW * kTileRows;
    float* red = reinterpret_cast<float*>(smem);
    __shared__ int s_last;
    if (p.splits == 1) {
#pragma unroll
        for (int q = 0; q < kMT; ++q)
#pragma unroll
            for (int v = 0; v < kNW; ++v)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int tok = q * 8 + t * 2 + (i & 1), r = warp * 16 + g + 8 * (i >> 1);
                    red[tok * kRed + v * kTileRows + r] = acc[q][v][i];
                }
        __syncthreads();
    } else {
        const int npad = (n + kTileRows - 1) / kTileRows * kTileRows;
        float* part = p.part + p.part_off[z];
#pragma unroll
        for (int q = 0; q < kMT; ++q)
#pragma unroll
            for (int v = 0; v < kNW; ++v)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int tok = q * 8 + t * 2 + (i & 1), r = warp * 16 + g + 8 * (i >> 1);
                    if (tok < M) part[((size_t)(split * M + tok) * kNW + v) * npad + tile * kTileRows + r] = acc[q][v][i];
                }
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) {
            const unsigned prev = atomicAdd(p.count + p.count_off[z] + tile, 1u);
            s_last = prev == (unsigned)(p.splits - 1);
        }
        __syncthreads();
        if (!s_last) return;
        __threadfence();
        for (int i = threadIdx.x; i < M * kRed; i += kThreads) {
            const int tok = i / kRed, vr = i % kRed, v = vr / kTileRows, r = vr % kTileRows;
            float sum = 0.f;
            for (int sp = 0; sp < p.splits; ++sp)
                sum += __ldcg(part + ((size_t)(sp * M + tok) * kNW + v) * npad + tile * kTileRows + r);
            red[tok * kRed + vr] = sum;
        }
        if (threadIdx.x == 0) p.count[p.count_off[z] + tile] = 0u;
        __syncthreads();
    }

    if constexpr (kMode == kSwiglu) {
        // One warp per token: lane covers rows lane + 32i of the tile (one FP8 block of h per token); the rule is
        // common/swiglu_fp8.cuh's (shared with the prefill chunk's glue kernel).
        for (int tok = warp; tok < M; tok += kWarps) {
            float g[4], u[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                g[i] = bf16r(red[tok * kRed + lane + 32 * i]);
                u[i] = bf16r(red[tok * kRed + kTileRows + lane + 32 * i]);
            }
            uint8_t* codes = static_cast<uint8_t*>(p.y[0]) + (size_t)tok * p.ldy[0] + tile * kTileRows;
            uint8_t* scale = static_cast<uint8_t*>(p.y[1]) + tok * (p.ldy[0] / 128) + tile;
            swiglu_fp8_block_warp(g, u, p.scalar, codes, scale);
        }
    } else {
        for (int i = threadIdx.x; i < M * kTileRows; i += kThreads) {
            const int tok = i / kTileRows, r = i % kTileRows, row = tile * kTileRows + r;
            if (row >= n) continue;
            const float v = red[tok * kRed + r];
            if constexpr (kMode == kBf16)
                static_cast<float*>(p.y[z])[(size_t)tok * p.ldy[z] + row] = v;
            else
                static_cast<__nv_bfloat16*>(p.y[z])[(size_t)tok * p.ldy[z] + row] = __float2bfloat16_rn(v);
        }
    }
}

}  // namespace

#define DENSE_ENTRY(name, mode, mt)                                                                  \
    extern "C" __global__ void __launch_bounds__(kThreads, 1) name(const __grid_constant__ DenseParams p) { \
        dense_body<mode, mt>(p);                                                                     \
    }
#define DENSE_ENTRIES(prefix, mode)     \
    DENSE_ENTRY(prefix##_m8, mode, 1)   \
    DENSE_ENTRY(prefix##_m16, mode, 2)  \
    DENSE_ENTRY(prefix##_m32, mode, 4)  \
    DENSE_ENTRY(prefix##_m64, mode, 8)

DENSE_ENTRIES(dense_fp8, kFp8)
DENSE_ENTRIES(dense_fp8_bf16x, kFp8Bf16x)
DENSE_ENTRIES(dense_bf16, kBf16)
DENSE_ENTRIES(dense_swiglu, kSwiglu)
DENSE_ENTRIES(dense_fp8_qx, kFp8Qx)
DENSE_ENTRIES(dense_fp8_normqx, kFp8NormQx)
