// Rotary position embedding of DeepSeek-V4 on the device: the rotation of one interleaved pair (x[2i], x[2i+1])
// by +pos * f_i (or -pos * f_i for the inverse applied to attention outputs), f_i the layer's frequency
// (model::numerics::RopeTable::freqs: theta^(-2i/d), YaRN-blended on the compressed layers).
//
// Contract (bit-identical to RopeTable::apply on the CPU): the angle is formed in f64 (pos * f_i, f_i in f64),
// its cos and sin are rounded to f32, then x0' = x0*c - x1*s and x1' = x0*s + x1*c with each product and each
// sum rounded separately in f32 (no FMA contraction: __fmul_rn / __fsub_rn / __fadd_rn). The f64 angle matters
// at long context: at position 2^20 an f32 angle is off by up to 2^-5 rad on the fastest pair.
// CUDA's f64 sin/cos are within 1 ulp of the f64 result, like the host's libm; after rounding to f32 the two
// agree except where the f64 value lies within 1 f64 ulp of an f32 rounding boundary (not seen in the tests).
#pragma once

namespace mm {

__device__ __forceinline__ void rope_rotate_pair(float& x0, float& x1, long long pos, double freq, bool inverse) {
    double ang = static_cast<double>(pos) * freq;
    if (inverse) ang = -ang;
    double sd, cd;
    sincos(ang, &sd, &cd);
    const float s = static_cast<float>(sd), c = static_cast<float>(cd);
    const float a = x0, b = x1;
    x0 = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    x1 = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
}

}  // namespace mm
