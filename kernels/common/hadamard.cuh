// The 128-point orthonormal Walsh-Hadamard transform of one warp's vector (the indexer keys in kernels/indexer.cu,
// the indexer queries in kernels/qkv_prep.cu). Bit-identical contract with model::numerics::hadamard_inplace
// (natural / Sylvester order, f32 butterfly, then a multiply by the f32 value of 1/sqrt(128)).
//
// Layout: lane l holds x[4l..4l+3] in v[0..3]. Butterfly stages h = 1, 2 run inside the lane; stages h = 4 .. 64
// pair lane l with lane l ^ (h/4) through one shuffle each. At every stage the lower partner computes a + b and
// the upper one a - b with a the lower element, exactly the CPU's (x[j], x[j+h]) -> (a + b, a - b), each sum a
// separate IEEE rounding (__fadd_rn / __fsub_rn: no contraction).
#pragma once

namespace mm {

__device__ __forceinline__ void hadamard128_warp(float v[4], int lane) {
    float a0 = __fadd_rn(v[0], v[1]), a1 = __fsub_rn(v[0], v[1]);
    float a2 = __fadd_rn(v[2], v[3]), a3 = __fsub_rn(v[2], v[3]);
    v[0] = __fadd_rn(a0, a2);
    v[2] = __fsub_rn(a0, a2);
    v[1] = __fadd_rn(a1, a3);
    v[3] = __fsub_rn(a1, a3);
#pragma unroll
    for (int m = 1; m <= 16; m <<= 1) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float p = __shfl_xor_sync(0xffffffffu, v[i], m);
            v[i] = (lane & m) ? __fsub_rn(p, v[i]) : __fadd_rn(v[i], p);
        }
    }
    const float s = __uint_as_float(0x3DB504F3u);  // 1/sqrt(128) in f32 (= 1.0f / sqrtf(128.0f))
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = __fmul_rn(v[i], s);
}

}  // namespace mm
