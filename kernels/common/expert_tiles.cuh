// Work-item order of the grouped MoE GEMM kernels (moe_gemm decode mainloop, moe_gemm_prefill): experts in
// order, each split into ceil(rows / tile) token tiles. One CTA-wide exclusive scan turns per-expert tile
// counts into the first work item of each expert.
#pragma once

// Thread t holds the tile counts of experts 2t and 2t+1 (`tiles0`, `tiles1`; 0 past the last expert), so a
// CTA of kThreads threads covers up to 2 * kThreads experts. Writes s_tile_prefix[e] = tiles of experts < e for
// e in 0..=E (s_tile_prefix[E] = all tiles) and leaves the CTA synchronized. s_warp_sum holds kThreads / 32
// ints. Inclusive warp scan by shuffles, then each warp adds the totals of the warps before it.
template <int kThreads>
__device__ __forceinline__ void expert_tile_prefix(int tiles0, int tiles1, int E, int* s_warp_sum,
                                                   int* s_tile_prefix) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int incl = tiles0 + tiles1;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
    }
    if (lane == 31) s_warp_sum[warp] = incl;
    __syncthreads();
    int warp_base = 0;
    for (int w2 = 0; w2 < warp; ++w2) warp_base += s_warp_sum[w2];
    const int excl = warp_base + incl - tiles0 - tiles1;
    if (2 * tid <= E) s_tile_prefix[2 * tid] = excl;
    if (2 * tid + 1 <= E) s_tile_prefix[2 * tid + 1] = excl + tiles0;
    if (tid == kThreads - 1) s_tile_prefix[E] = warp_base + incl;
    __syncthreads();
}
