// The shared expert's SwiGLU on one 128-element block, written as FP8 1x128: the one rule the decode GEMV's fused
// epilogue (kernels/dense.cu, dense_swiglu_*) and the prefill chunk's glue kernel (kernels/engine_ffn.cu,
// ffn_swiglu_fp8_rows) both apply, so a chunk's h equals the GEMV's bit for bit whenever their g and u do.
//
// One warp per block; lane holds elements lane + 32 i (i < 4). g and u are BF16 values (as f32). In this order:
// g' = min(g, L), u' = clamp(u, -L, L) when L > 0 (else unchanged); h = bf16(g' * (1 / (1 + exp(-g'))) * u') with
// each operation rounded separately (no FMA); the block's scale code sc = ue8m0 of max(amax(h), 1e-4) / 448 and
// codes e4m3(h / 2^sc) (the formats::fp8 rule, AMAX_FLOOR 1e-4). Lane 0 writes the scale code.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "formats.cuh"

__device__ __forceinline__ void swiglu_fp8_block_warp(const float (&g)[4], const float (&u)[4], float limit,
                                                      uint8_t* codes, uint8_t* scale_code) {
    constexpr float kAmaxFloor = 1e-4f;  // formats::fp8::AMAX_FLOOR
    const int lane = threadIdx.x & 31;
    float h[4];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float gv = g[i], uv = u[i];
        if (limit > 0.f) {
            gv = fminf(gv, limit);
            uv = fminf(fmaxf(uv, -limit), limit);
        }
        const float sig = __fdiv_rn(1.f, __fadd_rn(1.f, expf(-gv)));
        h[i] = __bfloat162float(__float2bfloat16_rn(__fmul_rn(__fmul_rn(gv, sig), uv)));
        amax = fmaxf(amax, fabsf(h[i]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const uint8_t sc = mm::ue8m0_pow2_scale_for(fmaxf(amax, kAmaxFloor), 448.f);
    const float scale = mm::ue8m0_decode(sc);
#pragma unroll
    for (int i = 0; i < 4; ++i) codes[lane + 32 * i] = mm::e4m3_encode(__fdiv_rn(h[i], scale));
    if (lane == 0) *scale_code = sc;
}
