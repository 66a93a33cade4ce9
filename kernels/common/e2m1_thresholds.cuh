// Division-free exact e2m1 encoding of fl(y / scale) for one block scale: 7 thresholds per scale, then 3 compares
// per element. Used by the norm_quant NVFP4 kernels (kernels/norm_quant.cu) and the MoE L1 finish
// FinishL1Kernel::RowsThr (kernels/moe_gemm.cu, nvfp4_quant_chunk4_thr). One definition each.
#pragma once
#include <stdint.h>

// ---- division-free e2m1(fl(a / scale)) for one 16-block ------------------------------------------------------
// The reference encodes code = e2m1_ladder(fl(y / scale)). The ladder compares q = fl(y/scale) with
// t in {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5}: `q > t` for t in {0.25, 1.25, 2.5, 5} and `q >= t` for t in
// {0.75, 1.75, 3.5}. Identities used (scale > 0 finite, a = |y| finite, round-to-nearest-even division):
//  * fl(a/s) > t  <=>  a/s > t + ulp(t)/2 (the midpoint to t's successor; at a tie fl rounds to t, whose last
//    mantissa bit is 0). fl(a/s) >= t <=> a/s >= t - ulp(t)/2 (none of 0.75, 1.75, 3.5 is a power of two, so
//    ulp below t = ulp(t); a tie again rounds to the even t).
//  * a/s > M <=> a > M*s, and M*s is exact in f64 (M has 25 significant bits, s at most 24: 49 <= 53).
//  * For an f32 a and a real P: a > P <=> a > RD32(P) <=> a >= nextup(RD32(P)); a >= P <=> a >= RU32(P).
// So with B_i as below, code magnitude = #{i : a >= B_i}, found by a 3-level binary search (B is ascending).
// tests/norm_quant.rs emulates this exact computation on the CPU against formats::e2m1 (near-threshold cases
// included).
struct E2m1Thresholds {
    float b[7];
};

__device__ __forceinline__ float nextup_pos(float x) { return __uint_as_float(__float_as_uint(x) + 1u); }

__device__ __forceinline__ E2m1Thresholds e2m1_thresholds(float scale) {
    const double s = (double)scale;
    E2m1Thresholds t;
    t.b[0] = nextup_pos(__double2float_rd(__dmul_rn(s, 0.25 + 0x1p-26)));
    t.b[1] = __double2float_ru(__dmul_rn(s, 0.75 - 0x1p-25));
    t.b[2] = nextup_pos(__double2float_rd(__dmul_rn(s, 1.25 + 0x1p-24)));
    t.b[3] = __double2float_ru(__dmul_rn(s, 1.75 - 0x1p-24));
    t.b[4] = nextup_pos(__double2float_rd(__dmul_rn(s, 2.5 + 0x1p-23)));
    t.b[5] = __double2float_ru(__dmul_rn(s, 3.5 - 0x1p-23));
    t.b[6] = nextup_pos(__double2float_rd(__dmul_rn(s, 5.0 + 0x1p-22)));
    return t;
}

// Code of y (sign in bit 3, kept for -0 like formats::e2m1). Requires scale != 0.
__device__ __forceinline__ uint32_t e2m1_code_thr(float y, const E2m1Thresholds& t) {
    const float a = fabsf(y);
    const bool p2 = a >= t.b[3];
    const bool p1 = a >= (p2 ? t.b[5] : t.b[1]);
    const bool p0 = a >= (p2 ? (p1 ? t.b[6] : t.b[4]) : (p1 ? t.b[2] : t.b[0]));
    const uint32_t m = (p2 ? 4u : 0u) | (p1 ? 2u : 0u) | (p0 ? 1u : 0u);
    return m | ((__float_as_uint(y) >> 28) & 8u);
}

// The thresholds of e2m1_thresholds without FP64 (norm_quant v4p / v6 and the MoE RowsThr finish; the session-2 v3
// norm_quant kernel first used and GPU-verified this form): e2m1_thresholds returns RD32/RU32 of the exact product
// s*M, M = t +- 2^-k (t in {0.25, ..., 5}, exact in f32). With h = s * 2^-k, exact in f32 while s * 2^-26 stays
// normal, s*M = s*t + h exactly, and one FMA rounds that exact sum once in the requested direction:
// __fmaf_rd(s, t, h) = RD32(s*M), __fmaf_ru(s, t, -h) = RU32(s*M): the same bits, with 5 FMUL + 7 FFMA instead of
// 7 DMUL + 8 F64 conversions (a quarter-rate pipe).
// Valid for 2^-100 <= s <= 2^100 (every h normal, no overflow): e2m1_thresholds_fma_in_range requires it (its
// caller has checked), e2m1_thresholds_fma takes the FP64 form otherwise (incl. non-finite s).
// Mirrored and compared with the FP64 form on the CPU (reference.rs packed_e2m1_mirror::thresholds_fma).
__device__ __forceinline__ E2m1Thresholds e2m1_thresholds_fma_in_range(float scale) {
    const float h26 = __fmul_rn(scale, 0x1p-26f), h25 = __fmul_rn(scale, 0x1p-25f);
    const float h24 = __fmul_rn(scale, 0x1p-24f), h23 = __fmul_rn(scale, 0x1p-23f);
    const float h22 = __fmul_rn(scale, 0x1p-22f);
    E2m1Thresholds t;
    t.b[0] = nextup_pos(__fmaf_rd(scale, 0.25f, h26));
    t.b[1] = __fmaf_ru(scale, 0.75f, -h25);
    t.b[2] = nextup_pos(__fmaf_rd(scale, 1.25f, h24));
    t.b[3] = __fmaf_ru(scale, 1.75f, -h24);
    t.b[4] = nextup_pos(__fmaf_rd(scale, 2.5f, h23));
    t.b[5] = __fmaf_ru(scale, 3.5f, -h23);
    t.b[6] = nextup_pos(__fmaf_rd(scale, 5.0f, h22));
    return t;
}

__device__ __forceinline__ bool e2m1_thresholds_fma_scale_in_range(float scale) {
    return scale >= 0x1p-100f && scale <= 0x1p100f;  // false for NaN
}

__device__ __forceinline__ E2m1Thresholds e2m1_thresholds_fma(float scale) {
    if (!e2m1_thresholds_fma_scale_in_range(scale)) return e2m1_thresholds(scale);
    return e2m1_thresholds_fma_in_range(scale);
}
