// engine_attn: the glue of the engine's attention half that no op family writes (launcher and host twin:
// src/engine/attn.rs). The kernel reads positions and cache bases on the device, and its grid depends on the batch
// and the capacities only, so a captured step replays with new positions.
//
// attn_candidates: each row's candidate row for sparse_attn (host twin `LayerCacheLayout::row_candidate_rows`; the
//   tables are per row, `RowTables`: a decode batch's row b is sequence b, a prefill chunk's rows all one sequence):
//   row b = the window slots of positions max(0, t - W + 1) ..= t oldest first (window_base[b] + p mod R, R >= W the
//   ring length), then the compressed entries as pool indices compressed_base[b] + j:
//     mode 0 (sliding window): none;
//     mode 1 (CSA): the indexer's top-k row `selected[b * k ..]` (min(k, visible) indices in score order, then -1),
//              sorted ascending (the model sorts `compressed_sel`) by a bitonic sort of sort_n = next_pow2(k) ints in
//              shared memory, -1 sorted last as INT_MAX;
//     mode 2 (HCA): every visible entry j < (t + 1) / m;
//   then -1 up to the row stride; lengths[b] = the count (clamped to the stride). t < 0 (an idle slot): length 0, the
//   row all -1. Grid (batch), block 256, dynamic shared memory sort_n * 4 bytes (mode 1).
#include <cuda_bf16.h>
#include <limits.h>
#include <stdint.h>

constexpr int kAttnGlueThreads = 256;
// Candidate modes: 0 = the window only (sliding-window layers), kCandSelected = the window then the indexer's top-k
// (CSA), kCandAllVisible = the window then every visible compressed entry (HCA).
constexpr int kCandSelected = 1;
constexpr int kCandAllVisible = 2;

// Ascending bitonic sort of s[0, n) (n a power of two) by the whole CTA.
__device__ void bitonic_sort_ascending(int* s, int n) {
    for (int size = 2; size <= n; size <<= 1) {
        for (int half = size >> 1; half > 0; half >>= 1) {
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const int j = i ^ half;
                if (j > i) {
                    const bool up = (i & size) == 0;
                    const int a = s[i], c = s[j];
                    if ((a > c) == up) {
                        s[i] = c;
                        s[j] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
}

extern "C" __global__ void __launch_bounds__(kAttnGlueThreads)
    attn_candidates(const int* __restrict__ positions, const int* __restrict__ window_base, int window, int ring,
                    const int* __restrict__ compressed_base, int ratio, int mode, const int* __restrict__ selected,
                    int k, int sort_n, int* __restrict__ candidates, int stride, int* __restrict__ lengths) {
    extern __shared__ int sel[];  // sort_n ints (mode kCandSelected)
    __shared__ int n_selected;
    const int b = blockIdx.x;
    const int t = positions[b];
    int n_win = 0, n_comp = 0;
    if (t >= 0) {
        n_win = min(t + 1, window);
        if (mode == kCandAllVisible) n_comp = (t + 1) / ratio;
    }
    if (mode == kCandSelected) {  // uniform over the CTA: the barriers below are reached by every thread
        for (int i = threadIdx.x; i < sort_n; i += blockDim.x) {
            const int v = i < k ? selected[(long)b * k + i] : -1;
            sel[i] = v >= 0 ? v : INT_MAX;
        }
        if (threadIdx.x == 0) n_selected = 0;
        __syncthreads();
        bitonic_sort_ascending(sel, sort_n);
        // Sorted: the valid indices come first; the one thread at the boundary writes their count.
        for (int i = threadIdx.x; i < sort_n; i += blockDim.x) {
            if (sel[i] != INT_MAX && (i + 1 == sort_n || sel[i + 1] == INT_MAX)) n_selected = i + 1;
        }
        __syncthreads();
        if (t >= 0) n_comp = n_selected;
    }
    const int n = min(n_win + n_comp, stride);
    const int first = t + 1 - n_win;
    int* row = candidates + (long)b * stride;
    for (int i = threadIdx.x; i < stride; i += blockDim.x) {
        int c = -1;
        if (i < n) {
            if (i < n_win) {
                c = window_base[b] + (first + i) % ring;
            } else {
                const int j = i - n_win;
                c = compressed_base[b] + (mode == kCandSelected ? sel[j] : j);
            }
        }
        row[i] = c;
    }
    if (threadIdx.x == 0) lengths[b] = n;
}
