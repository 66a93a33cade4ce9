// The L1 (W13) epilogue math of the MoE grouped GEMM, shared by the finish kernels of kernels/moe_gemm.cu and the
// fused SwiGLU prefill mainloop of kernels/moe_gemm_prefill.cu: one definition, so their h and NVFP4 bytes cannot
// drift apart (the GPU tests compare them bit for bit).
#pragma once
#include <stdint.h>
#include "formats.cuh"

// h of one column pair (the L1 epilogue): gate / up accumulators, the row's gsa, the column pair's gsb, the
// row's routing weight. One source for every L1 finish (pass 1, the rows kernel) and the fused SwiGLU prefill mainloop, so
// their h cannot drift apart.
// (ptxas contracts the `1.f +` with the last multiply of expf into one FFMA; the same expression in every caller.)
__device__ __forceinline__ float l1_swiglu_h(float accg, float accu, float sa, float scg, float scu, float rw) {
    float gte = accg * (sa * scg);
    float up = accu * (sa * scu);
    gte = fminf(gte, 10.f);
    up = fminf(fmaxf(up, -10.f), 10.f);
    const float silu = __fdiv_rn(gte, 1.f + expf(-gte));
    return __fmul_rn(__fmul_rn(silu, up), rw);
}

// NVFP4 quantization of chunk c = h elements 4c..4c+3 (x) of a row with global scale gs: the 4 lanes of the chunk's
// 16-block (lanes 4*(lane/4) + 0..3, all named in `mask`) share the block amax by two xor-shuffles; the lane with
// c % 4 == 0 stores the block scale byte, every lane its 2 code bytes (the rules are in the comment of
// moe_gemm_finish_l1_swiglu_nvfp4_q4 in kernels/moe_gemm.cu). One source for the q4 pass, the rows kernel and the fused
// prefill quant (kernels/moe_gemm_prefill.cu).
__device__ __forceinline__ void nvfp4_quant_chunk4(const float4 x, float gs, unsigned mask, int c,
                                                   uint8_t* __restrict__ codes_row, uint8_t* __restrict__ scales_row) {
    float bmax = fmaxf(fmaxf(0.f, fmaxf(fabsf(x.x), fabsf(x.y))), fmaxf(fabsf(x.z), fabsf(x.w)));
    bmax = fmaxf(bmax, __shfl_xor_sync(mask, bmax, 1));
    bmax = fmaxf(bmax, __shfl_xor_sync(mask, bmax, 2));
    const uint8_t sc = mm::nvfp4_block_scale(bmax, gs);
    const float scale = __fmul_rn(mm::e4m3_decode(sc), gs);
    if ((c & 3) == 0) scales_row[c >> 2] = sc;
    const uint32_t q = (uint32_t)mm::nvfp4_element(x.x, scale) | (uint32_t)mm::nvfp4_element(x.y, scale) << 4 |
                       (uint32_t)mm::nvfp4_element(x.z, scale) << 8 | (uint32_t)mm::nvfp4_element(x.w, scale) << 12;
    *reinterpret_cast<uint16_t*>(codes_row + 2 * c) = (uint16_t)q;
}

