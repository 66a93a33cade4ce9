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

// ---- F16 weight fragments (the f16-operand decode mainloop; NVFP4 activations only) ---------------------------
// An e2m1 code s|e1 e0 m placed in the HIGH byte of an f16 as s at bit 7 and e1 e0 m at bits 3..1 is an f16 with
// exponent field e1 e0 and top mantissa bit m: 2^(e-15) * (1 + m/2) for e >= 1, and the subnormal m * 2^-15 for
// e = 0, i.e. exactly e2m1 * 2^-14 in both cases (e2m1: 2^(e-1) * (1 + m/2), and m * 0.5 for e = 0), with the low
// byte zero. So a whole f16 is one byte, and 4 codes become 4 such bytes with a few word-wide ops:
//   even nibbles 0, 2, 4, 6 (bits 8b..8b+3 of byte b): E = ((w & 0x07070707) << 1) | ((w & 0x08080808) << 4),
//   odd nibbles 1, 3, 5, 7 (bits 8b+4..8b+7): O = (w & 0x80808080) | ((w >> 3) & 0x0E0E0E0E),
// and an f16x2 wants its two bytes at byte positions 1 and 3: pair (2, 6) = E & 0xFF00FF00, pair (0, 4) = E's bytes 0
// and 2 moved up (byte_perm selector 0x2404: byte 1 <- E.b0, byte 3 <- E.b2, bytes 0 and 2 <- 0), likewise O for
// (1, 3) / (5, 7). Same pairing (i, i + 4) as e2m1_pair_to_bf16x2_tiny, so the fragment layout does not change.
// ~11 integer ops per 8 codes against 15 for the bf16 form (2 shifts + 2 masks per pair). The block scale then
// multiplies in f16 (scales_f16x2 below): e2m1 * s * 2^-14 exactly.
__device__ __forceinline__ void e2m1_word_to_f16x2_tiny(uint32_t w, uint32_t (&p)[4]) {
    const uint32_t e = ((w & 0x07070707u) << 1) | ((w & 0x08080808u) << 4);
    const uint32_t o = (w & 0x80808080u) | ((w >> 3) & 0x0E0E0E0Eu);
    p[0] = __byte_perm(e, 0u, 0x2404);
    p[1] = __byte_perm(o, 0u, 0x2404);
    p[2] = e & 0xFF00FF00u;
    p[3] = o & 0xFF00FF00u;
}

// Two e4m3 block scales (the low two bytes of `codes`) as f16x2, low byte -> low half: exact (e4m3 is a subset of
// f16). A tiny pair (e2m1 * 2^-14) times one of them, broadcast (f16x2_mul_lo / _hi: the h0/h1 operand selectors
// of HMUL2, no extra instruction), is e2m1 * s * 2^-14 exactly: a multiple of 2^-24 (e2m1 is a multiple of 0.5, e4m3
// of 2^-9) of at most 5 significant bits and at most 2688 * 2^-14 < 0.17, so exact in f16 down to its smallest
// subnormal 2^-24 (f16 arithmetic keeps subnormals; the PTX ftz modifier exists only for f32). The accumulators
// then hold sum * 2^-14, restored exactly in fp32.
__device__ __forceinline__ __half2 scales_f16x2(uint32_t codes) {
    const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(codes & 0xFFFFu), __NV_E4M3);
    return __half2(r);
}

__device__ __forceinline__ uint32_t f16x2_mul_lo(uint32_t a, __half2 s) {
    const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), __low2half2(s));
    return *reinterpret_cast<const uint32_t*>(&r);
}

__device__ __forceinline__ uint32_t f16x2_mul_hi(uint32_t a, __half2 s) {
    const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), __high2half2(s));
    return *reinterpret_cast<const uint32_t*>(&r);
}
