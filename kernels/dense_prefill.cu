// Glue of the FP8 dense linear through cuBLASLt's block-scaled GEMM (src/ops/dense/prefill.rs is the launcher
// and states the contract).
//
// dense_prefill_act_scales_f32: the 1x128 activation scales as norm_quant's FP8 path writes them (ue8m0 codes,
// row-major [m, L] with L = K / 128) -> the f32 tensor cuBLASLt's CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F reads
// for its B operand (the activations): "N-major with shape N x L", i.e. [L, m_pad] with the token index
// contiguous, m_pad = m rounded up to the multiple of 4 the block-scaled modes require. Rows m..m_pad (padding
// tokens) get scale 0. One thread per output element: the writes are coalesced, the reads stride by L bytes
// (the tensor is m * L bytes, 1/128 of the activation codes).
//
// The conversion is exact: code c is 2^(c - 127) (code 0: 2^-127, an f32 subnormal), code 0xFF is NaN, the same
// values as formats::ue8m0::decode.

#include <stdint.h>

#include "common/formats.cuh"

extern "C" __global__ void dense_prefill_act_scales_f32(const uint8_t* __restrict__ codes, float* __restrict__ out,
                                                        int m, int m_pad, int k_blocks) {
    const long long total = (long long)m_pad * k_blocks;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int kb = (int)(i / m_pad);
        const int row = (int)(i - (long long)kb * m_pad);
        float s = 0.0f;
        if (row < m) {
            const uint8_t c = codes[(long long)row * k_blocks + kb];
            s = c == 0xFF ? __uint_as_float(0x7FC00000u) : mm::ue8m0_decode(c);
        }
        out[i] = s;
    }
}
