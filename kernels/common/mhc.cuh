// Device helpers of the mHC boundary, copied VERBATIM (same operations, same rounding points) from
// kernels/norm_quant.cu so kernels/mhc_boundary.cu can be an A/B candidate without touching the measured
// norm_quant code. The integrator deduplicates after the A/B (norm_quant.cu would then include this header).
// Every function here must stay bit-for-bit the operation sequence of its norm_quant.cu twin: the new
// finish kernel is tested bit-identical against the current mhc_pre path.
#pragma once
#include "formats.cuh"

namespace mhc {

enum Kind { KIND_NVFP4 = 0, KIND_FP8 = 1, KIND_BF16 = 2 };

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // .x = lo (low half)
    return *reinterpret_cast<uint32_t*>(&h);
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

// ---- exact division-free e2m1 codes (norm_quant.cu e2m1_thresholds / e2m1_code_thr; the identities are
// written there and proven by the CPU mirror test in tests/norm_quant.rs) ----------------------------------------
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

__device__ __forceinline__ uint32_t e2m1_code_thr(float y, const E2m1Thresholds& t) {
    const float a = fabsf(y);
    const bool p2 = a >= t.b[3];
    const bool p1 = a >= (p2 ? t.b[5] : t.b[1]);
    const bool p0 = a >= (p2 ? (p1 ? t.b[6] : t.b[4]) : (p1 ? t.b[2] : t.b[0]));
    const uint32_t m = (p2 ? 4u : 0u) | (p1 ? 2u : 0u) | (p0 ? 1u : 0u);
    return m | ((__float_as_uint(y) >> 28) & 8u);
}

// ---- mHC scalar pieces (norm_quant.cu sigmoid_f / mix_logit) ----------------------------------------
__device__ __forceinline__ float sigmoid_f(float z) { return __fdiv_rn(1.f, __fadd_rn(1.f, expf(-z))); }

__device__ __forceinline__ float mix_logit(float rho, float dot, float s, float b) {
    return __fadd_rn(__fmul_rn(__fmul_rn(rho, dot), s), b);
}

// ---- programmatic dependent launch (norm_quant.cu griddep_*; semantics written there) --------------------------
__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void griddep_launch_dependents() {
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

}  // namespace mhc
