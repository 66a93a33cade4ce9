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

// Most sort_n / kAttnGlueThreads: the launcher refuses sort_n > kAttnGlueThreads * kSortPerThread (2048).
constexpr int kSortPerThread = 8;

// Ascending bitonic sort of s[0, n) (n a power of two, n <= 2048) by the whole CTA; s filled and a barrier passed
// before the call. Thread t owns elements i = t + 256 j. The compare-exchange of stage (size, half) pairs i with
// i ^ half and keeps the smaller value iff (i & half == 0) == (i & size == 0). For half < 32 the two elements sit in
// lanes t and t ^ half of one warp with the same j, so those stages run in registers with shuffles and no barrier
// (every size up to 32 entirely; the last five stages of each larger size); the stages with half >= 32 go through
// shared memory, one barrier each. Lanes past n (only when n < 32) exchange among themselves: half < n keeps i and
// i ^ half on the same side of n. n = 512: 15 barriers instead of 45.
__device__ __forceinline__ int bitonic_keep(int a, int b, int i, int size, int half) {
    return ((i & half) == 0) == ((i & size) == 0) ? min(a, b) : max(a, b);
}

// The stages with half < 32 of every size from size_lo to size_hi (powers of two), on registers; s read before and
// written after, then one barrier.
__device__ void bitonic_warp_stages(int* s, int n, int size_lo, int size_hi) {
    int v[kSortPerThread];
#pragma unroll
    for (int j = 0; j < kSortPerThread; ++j) {
        const int i = threadIdx.x + j * kAttnGlueThreads;
        v[j] = i < n ? s[i] : 0;
    }
    for (int size = size_lo; size <= size_hi; size <<= 1) {
        for (int half = min(size >> 1, 16); half > 0; half >>= 1) {
#pragma unroll
            for (int j = 0; j < kSortPerThread; ++j) {
                if (j * kAttnGlueThreads < n) {  // uniform over the CTA: every lane of the warp shuffles
                    const int i = threadIdx.x + j * kAttnGlueThreads;
                    v[j] = bitonic_keep(v[j], __shfl_xor_sync(0xFFFFFFFFu, v[j], half), i, size, half);
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < kSortPerThread; ++j) {
        const int i = threadIdx.x + j * kAttnGlueThreads;
        if (i < n) s[i] = v[j];
    }
    __syncthreads();
}

__device__ void bitonic_sort_ascending(int* s, int n) {
    bitonic_warp_stages(s, n, 2, min(n, 32));
    for (int size = 64; size <= n; size <<= 1) {
        for (int half = size >> 1; half >= 32; half >>= 1) {
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
        bitonic_warp_stages(s, n, size, size);
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
