// engine_ffn: the glue of the engine's FFN half that no op family writes (launchers and host twins: src/engine/ffn.rs,
// `contiguous_grouping` / `contiguous_grouping_host`, `swiglu_fp8_rows`).
//
// ffn_contiguous_grouping: a prefill chunk's routing, from the router's masked grouping by physical slot to the
//   contiguous grouping moe_gemm's prefill mainloop reads (slot s owns rows [offsets[s], offsets[s + 1]), the rows
//   of a slot in the masked order: pair order, token then pick). One CTA of 1024 threads:
//   * c[s] = clamp(counts[s], 0, capacity); offsets[s] = c[0] + ... + c[s - 1] for s <= slots (offsets[slots] = the
//     owned rows, at most `pairs`);
//   * pair i < pairs: r = masked_rows[i]; r < 0 (a pair with no row) -> rows[i] = -1; else s = r / capacity,
//     k = r - s * capacity, and when k < c[s] (always, for a grouping the router wrote): rows[i] = offsets[s] + k and
//     weight[rows[i]] = masked_weight[r]; otherwise rows[i] = -1;
//   * weight[j] = 0 for offsets[slots] <= j < pairs (rows no slot owns).
//   Every owned row j < offsets[slots] is the image of exactly one pair (the router gives each pair its own row), so
//   every element of `weight` is written once. Grid 1, block 1024, static shared memory (slots <= 512).
#include <cuda_bf16.h>
#include <stdint.h>
#include "common/formats.cuh"
#include "common/swiglu_fp8.cuh"

constexpr int kGroupingThreads = 1024;
constexpr int kGroupingMaxSlots = 512;

extern "C" __global__ void __launch_bounds__(kGroupingThreads)
    ffn_contiguous_grouping(const int* __restrict__ counts, int slots, int capacity,
                            const int* __restrict__ masked_rows, const float* __restrict__ masked_weight, int pairs,
                            int* __restrict__ offsets, int* __restrict__ rows, float* __restrict__ weight) {
    __shared__ int c[kGroupingMaxSlots];
    __shared__ int off[kGroupingMaxSlots + 1];
    for (int s = threadIdx.x; s < slots; s += blockDim.x) c[s] = min(max(counts[s], 0), capacity);
    __syncthreads();
    // Exclusive prefix sums, one per thread (slots <= 512: at most 512 adds each).
    for (int s = threadIdx.x; s <= slots; s += blockDim.x) {
        int sum = 0;
        for (int t = 0; t < s; ++t) sum += c[t];
        off[s] = sum;
        offsets[s] = sum;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
        const int r = masked_rows[i];
        int out = -1;
        if (r >= 0) {
            const int s = r / capacity;
            const int k = r - s * capacity;
            if (s < slots && k < c[s] && off[s] + k < pairs) {
                out = off[s] + k;
                weight[out] = masked_weight[r];
            }
        }
        rows[i] = out;
    }
    for (int j = off[slots] + threadIdx.x; j < pairs; j += blockDim.x) weight[j] = 0.f;
}

// ffn_swiglu_fp8_rows: the shared expert's SwiGLU half after its two GEMMs (a prefill chunk's: w1 and w3 on the
//   tensor cores, `dense::fp8_linears`, BF16 g and u [rows, I]): h = bf16(silu(g') * u') with g' = min(g, L) and
//   u' = clamp(u, -L, L) when L > 0, written as FP8 1x128 rows (e4m3 codes [rows, I], ue8m0 scales [rows, I / 128]):
//   dense_swiglu's epilogue rule (common/swiglu_fp8.cuh, shared with kernels/dense.cu), so the GEMV's h bit for bit
//   whenever its g and u are. One warp per (row, 128-block): lane holds the elements lane + 32 i. Grid
//   ceil(rows * I / 128 / 8), block 256.

extern "C" __global__ void __launch_bounds__(256)
    ffn_swiglu_fp8_rows(const __nv_bfloat16* __restrict__ g, const __nv_bfloat16* __restrict__ u, int rows, int inter,
                        float limit, uint8_t* __restrict__ codes, uint8_t* __restrict__ scales) {
    const int lane = threadIdx.x & 31;
    const int blocks = inter / 128;
    const long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (w >= (long long)rows * blocks) return;  // warp-uniform
    const int row = (int)(w / blocks), blk = (int)(w % blocks);
    const size_t base = (size_t)row * inter + (size_t)blk * 128;
    float gv[4], uv[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        gv[i] = __bfloat162float(g[base + lane + 32 * i]);
        uv[i] = __bfloat162float(u[base + lane + 32 * i]);
    }
    swiglu_fp8_block_warp(gv, uv, limit, codes + base, scales + (size_t)row * blocks + blk);
}
