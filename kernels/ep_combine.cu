// Expert parallelism's combine (docs/multi-gpu.md, src/ops/ep): the rank-ordered sum of the W ranks' f32 partials
// (each rank's routed sum from moe_gemm's L2 finish without its addend and rounding,
// moe_gemm_finish_l2_partial_rowwarps in kernels/moe_gemm.cu) with the shared expert's output.
//
// * ep_combine: out[i] = bf16( ((p_0[i] + p_1[i]) + ... + p_{W-1}[i]) + f32(shared[i]) ), the ranks ascending, each
//   add __fadd_rn, the shared expert's BF16 value added last (skipped when shared is null: no shared expert), one
//   round-to-nearest-even BF16 rounding. partials is [W, elems] (rank r's block at r * elems: what an all-gather of
//   every rank's [elems] partial leaves). The CPU twin is engine::ep::combine_partials. With W = 1 this is moe_gemm's
//   L2 epilogue with the shared expert as addend, bit for bit (y = p_0, then y + shared, then bf16).
#include <cuda_bf16.h>
#include <stdint.h>

extern "C" __global__ void __launch_bounds__(256) ep_combine(const float* __restrict__ partials, int world,
                                                             long long elems,
                                                             const __nv_bfloat16* __restrict__ shared,
                                                             __nv_bfloat16* __restrict__ out) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < elems; i += stride) {
        float y = partials[i];
        for (int r = 1; r < world; ++r) y = __fadd_rn(y, partials[(size_t)r * elems + i]);
        if (shared != nullptr) y = __fadd_rn(y, __bfloat162float(shared[i]));
        out[i] = __float2bfloat16_rn(y);
    }
}
