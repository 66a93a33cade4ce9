// Expert parallelism's two device pieces (docs/multi-gpu.md, src/ops/ep): the L2 finish that leaves a rank's routed
// sum in f32, and the rank-ordered combine of the W ranks' partials with the shared expert's output.
//
// * ep_finish_l2_partial: moe_gemm's L2 epilogue (kernels/moe_gemm.cu, moe_gemm_finish_l2_combine_*) without the
//   addend and without the BF16 rounding: out[tok, n] = y, the f32 routed sum of the token's rows in routing order.
//   The same fp32 operations in the same order as moe_gemm_finish_l2_combine_rowwarps (so bf16(out) is that kernel's
//   output without an addend, bit for bit, and out + addend then bf16 is its output with one):
//     - acc of a valid slot j (rows[tok, j] owned by an expert): 0.f plus its splits in split order (FADD);
//     - scale = __fmul_rn(sa_j, sb_j) (sa = gsa[row] for NVFP4 activations, 1 for BF16 ones);
//     - y = __fmaf_rn(acc_j, scale_j, y) for every slot j < round_up(topk, 8) in routing order from y = +0.0, an
//       invalid slot (no row, or a row past its expert's count: another rank's pair under expert parallelism, or
//       j >= topk) entering as fma(+0, +0, y), as in the rowwarps kernel's passes of 8 slots.
//   grid = (tokens, ceil(N / 256)), block 256, one column per thread (coalesced f32 loads of the partials).
// * ep_combine: out[i] = bf16( ((p_0[i] + p_1[i]) + ... + p_{W-1}[i]) + f32(shared[i]) ), the ranks ascending, each
//   add __fadd_rn, the shared expert's BF16 value added last (skipped when shared is null: no shared expert), one
//   round-to-nearest-even BF16 rounding. partials is [W, elems] (rank r's block at r * elems: what an all-gather of
//   every rank's [elems] partial leaves). The CPU twin is engine::ep::combine_partials. With W = 1 this is moe_gemm's
//   L2 epilogue with the shared expert as addend, bit for bit (y = p_0, then y + shared, then bf16).
#include <cuda_bf16.h>
#include <stdint.h>
#include "common/grouping.cuh"

namespace {
constexpr int kEpMaxTopk = 32;  // EP_MAX_TOPK in src/ops/ep/mod.rs
}

extern "C" __global__ void __launch_bounds__(256) ep_finish_l2_partial(
    const float* __restrict__ partial, int splits, const int* group, int capacity, int experts, int rows_total, int N,
    const float* __restrict__ gsa, const float* __restrict__ gsb, const int* __restrict__ token_rows, int topk,
    float* __restrict__ out) {
    __shared__ int s_row[kEpMaxTopk];
    __shared__ int s_exp[kEpMaxTopk];
    __shared__ float s_sa[kEpMaxTopk];
    const int tok = blockIdx.x;
    const Grouping grp{group, capacity, experts, rows_total};
    if ((int)threadIdx.x < kEpMaxTopk) {
        int row = -1, e = -1;
        if ((int)threadIdx.x < topk) {
            row = token_rows[(size_t)tok * topk + threadIdx.x];
            e = grp.expert_of_row(row);
        }
        s_row[threadIdx.x] = row;
        s_exp[threadIdx.x] = e;
        s_sa[threadIdx.x] = (gsa != nullptr && e >= 0) ? gsa[row] : 1.f;
    }
    __syncthreads();
    const int n = blockIdx.y * blockDim.x + threadIdx.x;
    if (n >= N) return;  // no barrier below
    const size_t split_stride = (size_t)rows_total * N;
    float y = 0.f;
    // Slots in whole passes of 8, as the rowwarps kernel walks them (its slots past topk enter as fma(+0, +0, y)
    // too: y + (+0), which only a y of -0.0 would notice).
    const int slots = (topk + 7) & ~7;
    for (int j = 0; j < slots; ++j) {
        float acc = 0.f, scale = 0.f;
        if (s_exp[j] >= 0) {
            const float* src = partial + (size_t)s_row[j] * N + n;
            for (int s = 0; s < splits; ++s) acc += src[(size_t)s * split_stride];
            scale = __fmul_rn(s_sa[j], gsb[(size_t)s_exp[j] * N + n]);
        }
        y = __fmaf_rn(acc, scale, y);
    }
    out[(size_t)tok * N + n] = y;
}

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
