// The lightning indexer's key cache entries written by one warp (formats::indexer_key; kernels/indexer.cu's key
// writers and kernels/compressor.cu's indexer compressor share them). Two planes per format:
//   FP8  : codes[slot][128] e4m3, scales[slot] fp32 (x = e4m3 * scale)               132 B / entry
//   MXFP4: codes[slot][64] e2m1 (dim 2i in the low nibble), scales[slot][4] ue8m0       68 B / entry
// One warp per key, lane l holds dims 4l..4l+3 in v[0..3].
// 128-point Walsh-Hadamard = 7 butterfly stages (h = 1, 2 inside a lane; h = 4..64 across lanes with
// shfl_xor(h/4)), then * 1/sqrt(128) (0x3DB504F3). Every stage is an f32 add/sub of the same two values as the CPU
// loop (model::numerics::hadamard_inplace; addition is commutative), and the quantizers use __fdiv_rn, so the
// codes are bit-identical to the CPU codecs.
#pragma once
#include <stdint.h>

#include "formats.cuh"
#include "hadamard.cuh"

namespace index_key {

constexpr int kDim = 128;
constexpr unsigned kFull = 0xffffffffu;

// The key's Hadamard is mm::hadamard128_warp (common/hadamard.cuh), in the same lane layout.
using mm::hadamard128_warp;

// FP8 entry: scale = max(amax, 1e-4) / 448 (a plain f32), code = e4m3_rne(x / scale).
__device__ __forceinline__ void store_fp8(const float v[4], int lane, uint8_t* __restrict__ codes,
                                          float* __restrict__ scales, int slot) {
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, m));
    const float scale = __fdiv_rn(fmaxf(amax, 1e-4f), 448.f);
    uint32_t word = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) word |= (uint32_t)mm::e4m3_encode(__fdiv_rn(v[i], scale)) << (8 * i);
    reinterpret_cast<uint32_t*>(codes + (size_t)slot * kDim)[lane] = word;
    if (lane == 0) scales[slot] = scale;
}

// DSV4 FP4 rule per 32 dims (8 consecutive lanes): scale code = ue8m0_pow2_scale_for(max(amax, 6 * 2^-126), 6),
// e[i] = e2m1_rne(v[i] / 2^e). Returns the lane's four codes and its block's scale code.
__device__ __forceinline__ void mxfp4_quantize(const float v[4], uint32_t e[4], uint8_t& sc) {
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int m = 4; m >= 1; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, m));
    const float floor = __uint_as_float(0x01C00000u);  // 6 * 2^-126, DSV4's FP4 amax floor
    sc = mm::ue8m0_pow2_scale_for(fmaxf(amax, floor), 6.f);
    const float s = mm::ue8m0_decode(sc);
#pragma unroll
    for (int i = 0; i < 4; ++i) e[i] = mm::e2m1_encode(__fdiv_rn(v[i], s));
}

// MXFP4 entry: the FP4 rule's codes and scales.
__device__ __forceinline__ void store_mxfp4(const float v[4], int lane, uint8_t* __restrict__ codes,
                                            uint8_t* __restrict__ scales, int slot) {
    uint32_t e[4];
    uint8_t sc;
    mxfp4_quantize(v, e, sc);
    const uint16_t packed = (uint16_t)(e[0] | (e[1] << 4) | (e[2] << 8) | (e[3] << 12));
    reinterpret_cast<uint16_t*>(codes + (size_t)slot * (kDim / 2))[lane] = packed;
    if ((lane & 7) == 0) scales[(size_t)slot * 4 + lane / 8] = sc;
}

}  // namespace index_key
