// Shared device code of the RMSNorm row kernels (kernels/norm_quant.cu) and the mHC boundary's finish
// (kernels/mhc.cu): vector loads/stores of 8 values, warp/block reductions with a fixed order, and
// norm_quant_row, the RMSNorm + quantization of one row held in registers (NVFP4, FP8 1x128 or BF16 out).
//
// Rounding points (the CPU reference in src/ops/norm_quant/reference.rs has the same): rstd = 1/sqrt(ss/D+eps)
// with IEEE ops; t = x*rstd, y = w*t (fp32, no FMA), y -> BF16; the quantizers see the BF16 y. Only the fp32
// sum of squares has a reduction order different from the reference.
#pragma once
#include "formats.cuh"
#include "e2m1_thresholds.cuh"

namespace {

constexpr int CH = 4;         // 8-element chunks per thread
constexpr int MAX_WARPS = 32;

enum Kind { KIND_NVFP4 = 0, KIND_FP8 = 1, KIND_BF16 = 2 };

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

__device__ __forceinline__ void load8(const __nv_bfloat16* p, float v[8]) {
    uint4 r = __ldg(reinterpret_cast<const uint4*>(p));
    v[0] = bf16_lo(r.x); v[1] = bf16_hi(r.x); v[2] = bf16_lo(r.y); v[3] = bf16_hi(r.y);
    v[4] = bf16_lo(r.z); v[5] = bf16_hi(r.z); v[6] = bf16_lo(r.w); v[7] = bf16_hi(r.w);
}

__device__ __forceinline__ void load8(const float* p, float v[8]) {
    float4 a = __ldg(reinterpret_cast<const float4*>(p));
    float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // .x = lo (low half)
    return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ void store8_bf16(__nv_bfloat16* p, const float v[8]) {
    uint4 r;
    r.x = pack_bf16x2(v[0], v[1]); r.y = pack_bf16x2(v[2], v[3]);
    r.z = pack_bf16x2(v[4], v[5]); r.w = pack_bf16x2(v[6], v[7]);
    *reinterpret_cast<uint4*>(p) = r;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;  // xor butterfly: every lane adds the same two operands at each level -> identical results
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum, identical in every thread: warp trees, then warp partials summed in warp order.
__device__ float block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = 0.f;
    for (int w = 0; w < nw; ++w) s += red[w];
    __syncthreads();
    return s;
}

__device__ float block_max(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = 0.f;
    for (int w = 0; w < nw; ++w) s = fmaxf(s, red[w]);
    __syncthreads();
    return s;
}

// ---- division-free e2m1(fl(a / scale)) for one 16-block ------------------------------------------------------
// E2m1Thresholds, e2m1_thresholds, e2m1_thresholds_fma and e2m1_code_thr (with the identities that make them exact)
// live in common/e2m1_thresholds.cuh, shared with the MoE L1 finish (kernels/moe_gemm.cu). Define
// NQ_E2M1_BY_DIVISION to use the straightforward IEEE division + ladder instead.

// Row outputs (pointers already at this row).
struct RowOut {
    uint8_t* q;             // NVFP4: packed codes [D/2]; FP8: codes [D]
    uint8_t* scales;        // NVFP4: e4m3 [D/16]; FP8: ue8m0 [D/128]
    float* gsa;             // NVFP4: one f32
    __nv_bfloat16* bf;      // BF16: [D]
    float* rstd;            // one f32 (written by thread 0)
};

// The quantizers of norm_quant_row, over a row held in registers (v[k] = chunk tid + k*blockDim, zeros when
// invalid; the values are what gets encoded, BF16 values in every caller): ONE codec, shared by the row kernels
// (kernels/norm_quant.cu, through norm_quant_row) and the mHC finish's quantized copies of its BF16 output
// (kernels/mhc.cu). All threads of the block must call them; q / scales (/ gsa) point at this row.
// FP8 1x128: 128-block amax over a 16-lane half warp, ue8m0 scale, e4m3 codes (satfinite).
__device__ __forceinline__ void quant_row_fp8(const float (&v)[CH][8], int nchunks, uint8_t* q, uint8_t* scales) {
    const int tid = threadIdx.x, bd = blockDim.x;
#pragma unroll
    for (int k = 0; k < CH; ++k) {
        const int c = tid + k * bd;
        // A 128-block is chunks 16b..16b+15 = the 16 lanes of a half warp (bd % 32 == 0). All lanes call it
        // (invalid chunks are whole half warps: nchunks % 16 == 0).
        uint8_t sc;
        const uint2 codes = mm::fp8_chunk8_half_warp(v[k], sc);
        if (c < nchunks) {
            *reinterpret_cast<uint2*>(q + c * 8) = codes;
            if ((c & 15) == 0) scales[c >> 4] = sc;
        }
    }
}

// NVFP4 with a per-row global scale: row amax (block_max; uses red, whose previous use must have ended with a
// barrier) -> gs, 16-block amax over lanes (2i, 2i+1), e4m3 block scale, e2m1 codes (division-free thresholds).
__device__ __forceinline__ void quant_row_nvfp4(const float (&v)[CH][8], int nchunks, uint8_t* q, uint8_t* scales,
                                                float* gsa, float* red) {
    const int tid = threadIdx.x, bd = blockDim.x;
    float amax = 0.f;
#pragma unroll
    for (int k = 0; k < CH; ++k)
#pragma unroll
        for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[k][e]));
    const float amax_row = block_max(amax, red);
    const float gs = mm::nvfp4_global_scale(amax_row);
    if (tid == 0) *gsa = gs;
#pragma unroll
    for (int k = 0; k < CH; ++k) {
        const int c = tid + k * bd;
        float ab = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) ab = fmaxf(ab, fabsf(v[k][e]));
        ab = fmaxf(ab, __shfl_xor_sync(0xffffffffu, ab, 1));  // 16-block = chunks (2i, 2i+1)
        if (c < nchunks) {
            const uint8_t s = mm::nvfp4_block_scale(ab, gs);
            const float scale = __fmul_rn(mm::e4m3_decode(s), gs);
            uint32_t packed = 0;
#ifdef NQ_E2M1_BY_DIVISION
#pragma unroll
            for (int e = 0; e < 8; ++e) packed |= (uint32_t)mm::nvfp4_element(v[k][e], scale) << (4 * e);
#else
            if (scale != 0.f) {  // scale 0: every code is 0 (formats rule)
                const E2m1Thresholds thr = e2m1_thresholds(scale);
#pragma unroll
                for (int e = 0; e < 8; ++e) packed |= e2m1_code_thr(v[k][e], thr) << (4 * e);
            }
#endif
            *reinterpret_cast<uint32_t*>(q + c * 4) = packed;
            if ((c & 1) == 0) scales[c >> 1] = s;
        }
    }
}

// The RMSNorm factor of a row of D values whose sum of squares is ss: 1 / sqrt(ss / D + eps), IEEE ops.
__device__ __forceinline__ float rms_rstd(float ss, int D, float eps) {
    return __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)D), eps)));
}

// Two normalized values as one BF16 pair: bf16(w * (x * rstd)), each product rounded, one paired RNE conversion.
__device__ __forceinline__ uint32_t rms_apply_pair(float w0, float w1, float x0, float x1, float rstd) {
    return pack_bf16x2(__fmul_rn(w0, __fmul_rn(x0, rstd)), __fmul_rn(w1, __fmul_rn(x1, rstd)));
}

// RMSNorm (NORM) and quantization of one row held in registers: v[k] is chunk tid + k*blockDim (valid
// when < nchunks; invalid chunks hold zeros). All threads of the block must call this.
// WEARLY: load the weight before the sum-of-squares reduction (every caller passes true: its L2 latency then
// overlaps the reduction's barriers); false loads it after.
template <int KIND, bool NORM, bool WEARLY = true>
__device__ void norm_quant_row(float (&v)[CH][8], int nchunks, int D, const __nv_bfloat16* __restrict__ w,
                               float eps, const RowOut& o, float* red) {
    const int tid = threadIdx.x, bd = blockDim.x;
    if (NORM) {
        // The weight is loaded before the sum-of-squares reduction: its latency (an L2 round trip) then
        // overlaps the reduction's barriers instead of following them (16 registers of packed BF16).
        uint4 wraw[CH];
        auto load_w = [&]() {
#pragma unroll
            for (int k = 0; k < CH; ++k) {
                const int c = tid + k * bd;
                wraw[k] = c < nchunks ? __ldg(reinterpret_cast<const uint4*>(w + c * 8)) : make_uint4(0u, 0u, 0u, 0u);
            }
        };
        if (WEARLY) load_w();
        float ss = 0.f;
#pragma unroll
        for (int k = 0; k < CH; ++k)
#pragma unroll
            for (int e = 0; e < 8; ++e) ss = fmaf(v[k][e], v[k][e], ss);
        ss = block_sum(ss, red);
        const float rstd = rms_rstd(ss, D, eps);
        if (tid == 0 && o.rstd) *o.rstd = rstd;
        if (!WEARLY) load_w();
#pragma unroll
        for (int k = 0; k < CH; ++k) {
            const int c = tid + k * bd;
            if (c < nchunks) {
                const float wv[8] = {bf16_lo(wraw[k].x), bf16_hi(wraw[k].x), bf16_lo(wraw[k].y), bf16_hi(wraw[k].y),
                                     bf16_lo(wraw[k].z), bf16_hi(wraw[k].z), bf16_lo(wraw[k].w), bf16_hi(wraw[k].w)};
#pragma unroll
                for (int e = 0; e < 8; e += 2) {  // one paired RNE conversion per two values
                    const uint32_t pk = rms_apply_pair(wv[e], wv[e + 1], v[k][e], v[k][e + 1], rstd);
                    v[k][e] = bf16_lo(pk);
                    v[k][e + 1] = bf16_hi(pk);
                }
            }
        }
    }
    if (KIND == KIND_BF16) {
#pragma unroll
        for (int k = 0; k < CH; ++k) {
            const int c = tid + k * bd;
            if (c < nchunks) store8_bf16(o.bf + c * 8, v[k]);
        }
    } else if (KIND == KIND_FP8) {
        quant_row_fp8(v, nchunks, o.q, o.scales);
    } else {  // NVFP4
        quant_row_nvfp4(v, nchunks, o.q, o.scales, o.gsa, red);
    }
}
}  // namespace
