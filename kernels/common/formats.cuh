// Device-side codecs, bit-exact twins of src/formats/*.rs (the tests compare them code for code).
//
// Rounding points use explicit _rn intrinsics (__fmul_rn, __fdiv_rn) so nvcc cannot contract them into an
// FMA or replace a division by a reciprocal: the CPU reference does one IEEE operation at each step.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace mm {

// ---- E2M1 (FP4) -------------------------------------------------------------------------------------------
// Round to nearest, ties to the even code, saturating at 6; NaN -> +6; sign kept for values rounding to 0.
// The thresholds are the midpoints of {0,.5,1,1.5,2,3,4,6}; `<=` where the code below is even (it wins the
// tie), `<` where it is odd. Same ladder as formats::e2m1::encode_rne. (sm_90 has no FP4 cvt instruction.)
__device__ __forceinline__ uint8_t e2m1_encode(float x) {
    float a = fabsf(x);
    uint8_t m = a <= 0.25f ? 0 : a < 0.75f ? 1 : a <= 1.25f ? 2 : a < 1.75f ? 3
              : a <= 2.5f ? 4 : a < 3.5f ? 5 : a <= 5.0f ? 6 : 7;
    bool neg = (__float_as_uint(x) >> 31) && !isnan(x);
    return neg ? (m | 8) : m;
}

__device__ __forceinline__ float e2m1_decode(uint8_t code) {
    // Bit trick (no local-memory table): with e = bits 2..1 and m = bit 0, a normal code (e > 0) is
    // (1 + m/2) * 2^(e-1), i.e. the f32 with exponent field e-1+127 and mantissa MSB m; e == 0 is m * 0.5.
    const uint32_t e = (code >> 1) & 3u, m = code & 1u;
    const float mag = e == 0 ? 0.5f * (float)m : __uint_as_float(((e + 126u) << 23) | (m << 22));
    return (code & 8) ? -mag : mag;
}

// ---- E4M3 (FP8, "FN") ----------------------------------------------------------------------------------------
// Round to nearest even, saturate finite values and Inf to +-448, NaN -> 0x7F: cvt.rn.satfinite.e4m3x2.f32.
__device__ __forceinline__ uint8_t e4m3_encode(float x) {
    return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ float e4m3_decode(uint8_t code) {
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)code, __NV_E4M3);
    return __half2float(__half(h));  // e4m3 -> f16 -> f32 is exact
}

// ---- UE8M0 -----------------------------------------------------------------------------------------------------
// 2^ceil(log2(amax / qmax)) as a biased exponent byte: exponent field of r = amax/qmax, +1 if any mantissa bit
// is set (exact for normal r). Same as formats::ue8m0::pow2_scale_for.
__device__ __forceinline__ uint8_t ue8m0_pow2_scale_for(float amax, float qmax) {
    uint32_t bits = __float_as_uint(__fdiv_rn(amax, qmax));
    uint32_t e = (bits >> 23) & 0xFF;
    e += (bits & 0x7FFFFF) != 0;
    e = e < 1 ? 1 : (e > 254 ? 254 : e);
    return (uint8_t)e;
}

__device__ __forceinline__ float ue8m0_decode(uint8_t code) {
    return code == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(((uint32_t)code) << 23);
}

// ---- FP8 1x128 of activation rows (formats::fp8::quantize_act_1x128) -----------------------------------------
// One 8-value chunk whose 128-block is the 16 chunks held by the 16 lanes of a half warp (all 32 lanes call it,
// converged): the block amax (fmaxf: order-free), the scale code sc = ue8m0 of max(amax, 1e-4) / 448 (AMAX_FLOOR),
// and the chunk's 8 codes cvt.rn.satfinite.e4m3 of v * 2^(127 - sc), packed low byte first (the inverse scale
// 2^(127 - sc) is code 254 - sc, exact: v * inv is the IEEE v / scale, one rounding). The one FP8 row rule of
// norm_quant's row kernels (common/norm_row.cuh) and of the GEMV that quantizes its x as it stages it (dense.cu).
__device__ __forceinline__ uint2 fp8_chunk8_half_warp(const float (&v)[8], uint8_t& sc) {
    float amax = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[e]));
#pragma unroll
    for (int off = 1; off < 16; off <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    sc = ue8m0_pow2_scale_for(fmaxf(amax, 1e-4f), 448.f);
    const float inv = ue8m0_decode((uint8_t)(254 - sc));
    uint32_t w4[4];
#pragma unroll
    for (int p = 0; p < 4; ++p)
        w4[p] = (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(v[2 * p] * inv, v[2 * p + 1] * inv), __NV_SATFINITE,
                                                   __NV_E4M3);
    return make_uint2(w4[0] | (w4[1] << 16), w4[2] | (w4[3] << 16));
}

// ---- NVFP4 quantization rule (formats::nvfp4::quantize_rows) ---------------------------------------------------
// Per row: gs = amax_row / 2688 (= 6 * 448), or 1 if the row is all zero. Per 16-block: s = e4m3(amax_b / (6*gs)),
// scale = s * gs, code = e2m1(x / scale) (0 if scale == 0). Dequant: (e2m1 * s) * gs, where e2m1 * s is exact.
__device__ __forceinline__ float nvfp4_global_scale(float amax_row) {
    return amax_row == 0.f ? 1.f : __fdiv_rn(amax_row, 2688.f);
}

__device__ __forceinline__ uint8_t nvfp4_block_scale(float amax_block, float gs) {
    return e4m3_encode(__fdiv_rn(amax_block, __fmul_rn(6.f, gs)));
}

__device__ __forceinline__ uint8_t nvfp4_element(float x, float scale) {
    return scale == 0.f ? (uint8_t)0 : e2m1_encode(__fdiv_rn(x, scale));
}

}  // namespace mm
