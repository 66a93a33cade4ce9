// NVFP4 rows: quantize (per-row fp32 global scale, e4m3 scale per 16, software e2m1 rounding) and dequantize
// to BF16, plus the 16-byte copy kernel of the limits probe. The codec kernels are bit-exact twins of
// formats::nvfp4 on the CPU, so every code path of the device codecs in common/formats.cuh is checked against
// the Rust codecs on a real GPU (tests/nvfp4.rs). Launchers: src/ops/nvfp4/mod.rs.
//
// Layout (row-major): data [rows, cols/2] (low nibble = lower column), scales [rows, cols/16] e4m3,
// global_scale [rows] f32. cols % 16 == 0 (checked by the launcher).
//
// One CTA per row. Pass 1 reduces the row amax; pass 2 gives each thread whole 16-element blocks (two 32-byte
// reads of fp32 or one of bf16), so a block's scale, codes and 8 output bytes are produced by one thread.
#include "common/formats.cuh"

namespace {

constexpr int kThreads = 256;

template <typename T> __device__ __forceinline__ float load_f32(const T* p);
template <> __device__ __forceinline__ float load_f32<float>(const float* p) { return *p; }
template <> __device__ __forceinline__ float load_f32<__nv_bfloat16>(const __nv_bfloat16* p) { return __bfloat162float(*p); }

__device__ float block_max(float v, float* red) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < blockDim.x / 32 ? red[lane] : 0.f;
        for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
        if (lane == 0) red[0] = v;
    }
    __syncthreads();
    return red[0];
}

template <typename T>
__device__ void quantize_row(const T* __restrict__ x, int cols, uint8_t* __restrict__ data,
                             uint8_t* __restrict__ scales, float* __restrict__ gsa) {
    __shared__ float red[32];
    const int row = blockIdx.x;
    const T* xr = x + (size_t)row * cols;
    float amax = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) amax = fmaxf(amax, fabsf(load_f32(xr + c)));
    amax = block_max(amax, red);
    const float gs = mm::nvfp4_global_scale(amax);
    if (threadIdx.x == 0) gsa[row] = gs;
    const int nblocks = cols / 16;
    for (int b = threadIdx.x; b < nblocks; b += blockDim.x) {
        float v[16];
        float bmax = 0.f;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            v[i] = load_f32(xr + b * 16 + i);
            bmax = fmaxf(bmax, fabsf(v[i]));
        }
        const uint8_t s_code = mm::nvfp4_block_scale(bmax, gs);
        const float scale = __fmul_rn(mm::e4m3_decode(s_code), gs);
        uint32_t packed[2] = {0u, 0u};
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const uint32_t code = mm::nvfp4_element(v[i], scale);
            packed[i / 8] |= code << (4 * (i % 8));
        }
        scales[(size_t)row * nblocks + b] = s_code;
        uint2* out = reinterpret_cast<uint2*>(data + (size_t)row * (cols / 2) + b * 8);
        *out = make_uint2(packed[0], packed[1]);
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads) nvfp4_quantize_rows_f32(
    const float* __restrict__ x, int rows, int cols, uint8_t* __restrict__ data, uint8_t* __restrict__ scales,
    float* __restrict__ global_scale) {
    if (blockIdx.x < rows) quantize_row(x, cols, data, scales, global_scale);
}

extern "C" __global__ void __launch_bounds__(kThreads) nvfp4_quantize_rows_bf16(
    const __nv_bfloat16* __restrict__ x, int rows, int cols, uint8_t* __restrict__ data,
    uint8_t* __restrict__ scales, float* __restrict__ global_scale) {
    if (blockIdx.x < rows) quantize_row(x, cols, data, scales, global_scale);
}

// out[r, c] = bf16((e2m1 * s) * gs): e2m1 * e4m3 is exact in f32 (and in bf16), so the only rounding is the
// final one to bf16, the same as formats::nvfp4::dequantize_row_bf16. One thread per packed byte pair (4 values).
extern "C" __global__ void __launch_bounds__(kThreads) nvfp4_dequantize_rows_bf16(
    const uint8_t* __restrict__ data, const uint8_t* __restrict__ scales, const float* __restrict__ global_scale,
    int rows, int cols, __nv_bfloat16* __restrict__ out) {
    const size_t quads = (size_t)rows * cols / 4;
    for (size_t q = blockIdx.x * (size_t)blockDim.x + threadIdx.x; q < quads; q += (size_t)gridDim.x * blockDim.x) {
        const size_t e = q * 4;  // first element
        const int row = (int)(e / cols);
        const int col = (int)(e % cols);
        const float s = mm::e4m3_decode(scales[(size_t)row * (cols / 16) + col / 16]);
        const float gs = global_scale[row];
        const uint16_t two = *reinterpret_cast<const uint16_t*>(data + e / 2);
        __nv_bfloat16 r[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float v = __fmul_rn(__fmul_rn(mm::e2m1_decode((two >> (4 * i)) & 0xF), s), gs);
            r[i] = __float2bfloat16_rn(v);
        }
        *reinterpret_cast<uint2*>(out + e) = *reinterpret_cast<uint2*>(r);
    }
}

// Device-to-device copy with 16-byte accesses: the reference kernel of the limits probe's "copy" row beside
// cuMemcpyDtoD (bytes read + written).
extern "C" __global__ void __launch_bounds__(kThreads) copy_u128(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) dst[i] = src[i];
}
