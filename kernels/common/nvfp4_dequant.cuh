// NVFP4 -> BF16 dequantization primitives and the weight-stream loads of the MoE grouped GEMM kernels
// (kernels/moe_gemm.cu decode mainloops, kernels/moe_gemm_prefill.cu wgmma mainloops). One definition each.
#pragma once
#include <stdint.h>
#include "formats.cuh"

// 16-byte load of data read once (expert weights): ld.global.nc with L1::no_allocate, so the weight stream does not
// evict what L1 holds for reuse.
__device__ __forceinline__ uint4 ldg_stream(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// 2-byte read-only load (two adjacent e4m3 block scales), zero-extended.
__device__ __forceinline__ uint32_t ldg_u16(const void* p) {
    unsigned short v;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

// Nibbles i and i+4 of w -> bf16x2 (low half = nibble i, high half = nibble i+4), each equal to e2m1 * 2^-126:
// v = w << (12 - 4i) puts nibble i at bits 12..15 and nibble i+4 at bits 28..31; the sign goes to bit 15 (31), the
// 3 magnitude bits to bits 8..6 (24..22), i.e. the bf16 exponent LSBs and the top mantissa bit. Code 1 (0.5) becomes
// the bf16 subnormal 2^-127, codes >= 2 normals 2^-126 .. 1.5 * 2^-124 (the e2m1 values times 2^-126).
__device__ __forceinline__ uint32_t e2m1_pair_to_bf16x2_tiny(uint32_t w, int i) {
    const uint32_t v = w << (12 - 4 * i);
    return (v & 0x80008000u) | ((v >> 6) & 0x01C001C0u);
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// bf16(s_e4m3 * 2^117) broadcast to both halves (exact: 4 significant bits, 2^108 .. 448 * 2^117 < bf16 max).
// Times a tiny pair: e2m1 * s * 2^-9 exactly (<= 5 significant bits, inside the normal bf16 range).
__device__ __forceinline__ uint32_t scale_bf16x2(uint32_t code) {
    const float f = mm::e4m3_decode((uint8_t)code) * 0x1p117f;
    const uint32_t b = __float_as_uint(f) >> 16;  // exact: the low 16 bits are zero
    return b | (b << 16);
}
