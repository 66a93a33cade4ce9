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
// attn_candidates_topk: a CSA row's top-k and candidate row in one launch, from the indexer's scores (rows of at most
//   4,096 keys; the notes above the kernel), where the long-row path takes indexer_topk_* and attn_candidates.
#include <cuda_bf16.h>
#include <limits.h>
#include <stdint.h>

#include "common/topk_order.cuh"

constexpr int kAttnGlueThreads = 256;
// Candidate modes: 0 = the window only (sliding-window layers), kCandSelected = the window then the indexer's top-k
// (CSA), kCandAllVisible = the window then every visible compressed entry (HCA).
constexpr int kCandSelected = 1;
constexpr int kCandAllVisible = 2;

// Most sort_n / kAttnGlueThreads: the launcher refuses sort_n > kAttnGlueThreads * kSortPerThread (2048).
constexpr int kSortPerThread = 8;

// Ascending bitonic sort of s[0, n) (n a power of two, n <= kThreads * kPer) by a whole CTA of kThreads threads;
// s filled and a barrier passed before the call. Thread t owns elements i = t + kThreads j. The compare-exchange of
// stage (size, half) pairs i with i ^ half and keeps the smaller value iff (i & half == 0) == (i & size == 0). For
// half < 32 the two elements sit in lanes t and t ^ half of one warp with the same j, so those stages run in
// registers with shuffles and no barrier (every size up to 32 entirely; the last five stages of each larger size);
// the stages with half >= 32 go through shared memory, one barrier each. Lanes past n (only when n < 32) exchange
// among themselves: half < n keeps i and i ^ half on the same side of n. n = 512: 15 barriers instead of 45.
template <typename T>
__device__ __forceinline__ T bitonic_keep(T a, T b, int i, int size, int half) {
    return ((i & half) == 0) == ((i & size) == 0) ? min(a, b) : max(a, b);
}

// The stages with half < 32 of every size from size_lo to size_hi (powers of two), on registers; s read before and
// written after, then one barrier.
template <typename T, int kThreads, int kPer>
__device__ void bitonic_warp_stages(T* s, int n, int size_lo, int size_hi) {
    T v[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
        const int i = threadIdx.x + j * kThreads;
        v[j] = i < n ? s[i] : T(0);
    }
    for (int size = size_lo; size <= size_hi; size <<= 1) {
        for (int half = min(size >> 1, 16); half > 0; half >>= 1) {
#pragma unroll
            for (int j = 0; j < kPer; ++j) {
                if (j * kThreads < n) {  // uniform over the CTA: every lane of the warp shuffles
                    const int i = threadIdx.x + j * kThreads;
                    v[j] = bitonic_keep(v[j], __shfl_xor_sync(0xFFFFFFFFu, v[j], half), i, size, half);
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
        const int i = threadIdx.x + j * kThreads;
        if (i < n) s[i] = v[j];
    }
    __syncthreads();
}

template <typename T, int kThreads, int kPer>
__device__ void bitonic_sort_ascending(T* s, int n) {
    bitonic_warp_stages<T, kThreads, kPer>(s, n, 2, min(n, 32));
    for (int size = 64; size <= n; size <<= 1) {
        for (int half = size >> 1; half >= 32; half >>= 1) {
            for (int i = threadIdx.x; i < n; i += kThreads) {
                const int j = i ^ half;
                if (j > i) {
                    const bool up = (i & size) == 0;
                    const T a = s[i], c = s[j];
                    if ((a > c) == up) {
                        s[i] = c;
                        s[j] = a;
                    }
                }
            }
            __syncthreads();
        }
        bitonic_warp_stages<T, kThreads, kPer>(s, n, size, size);
    }
}

// The window part and the tail of candidate row b (the first n_win and the entries past n, -1 there); the entries
// [n_win, n) are the compressed ones, written by the caller.
__device__ __forceinline__ void write_window_and_tail(int* row, int stride, int n_win, int n, int first, int base,
                                                      int ring) {
    for (int i = threadIdx.x; i < stride; i += blockDim.x) {
        if (i < n_win) {
            row[i] = base + (first + i) % ring;
        } else if (i >= n) {
            row[i] = -1;
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
        bitonic_sort_ascending<int, kAttnGlueThreads, kSortPerThread>(sel, sort_n);
        // Sorted: the valid indices come first; the one thread at the boundary writes their count.
        for (int i = threadIdx.x; i < sort_n; i += blockDim.x) {
            if (sel[i] != INT_MAX && (i + 1 == sort_n || sel[i + 1] == INT_MAX)) n_selected = i + 1;
        }
        __syncthreads();
        if (t >= 0) n_comp = n_selected;
    }
    const int n = min(n_win + n_comp, stride);
    int* row = candidates + (long)b * stride;
    write_window_and_tail(row, stride, n_win, n, t + 1 - n_win, t >= 0 ? window_base[b] : 0, ring);
    for (int i = n_win + threadIdx.x; i < n; i += blockDim.x) {
        const int j = i - n_win;
        row[i] = compressed_base[b] + (mode == kCandSelected ? sel[j] : j);
    }
    if (threadIdx.x == 0) lengths[b] = n;
}

// attn_candidates_topk: the CSA candidate row straight from the indexer's scores, for score rows of at most
// kTopkThreads * kTopkPerThread entries: one CTA per row b does what indexer_topk_{hist,select,final} + attn_candidates (mode
// kCandSelected) do in four launches, with the same outputs bit for bit:
//   * the top-k row: kk = min(k, nv) indices in composite order (score descending, the lower index first; NaN as
//     -inf, -0 as +0: common/topk_order.cuh), nv = num_valid[b] clamped to [0, score_stride], then -1; top_score the
//     key's score (key_to_score), -inf past kk;
//   * the candidate row: the window slots oldest first, then compressed_base[b] + the kk selected indices ascending
//     (t >= 0 only), then -1 up to the stride; lengths[b] the count clamped to the stride.
// How: the composites of the row's nv scores (0 past nv, below every real one) are sorted in shared memory,
// complemented so that an ascending bitonic sort puts the largest first (sort_n = next_pow2(score_stride)
// <= kTopkThreads * kTopkPerThread). Then the kk-th largest composite thr is the threshold: composites are unique,
// so exactly the kk entries with composite >= thr are selected, and each one's place in the ascending row is the
// number of selected entries of lower index: a block-wide prefix count over index order, one round per 1024
// entries (the thread owns entry tid + 1024 r in round r, as in the sort). No atomics: the outputs do not depend
// on scheduling.
// Grid (batch), block kTopkThreads, dynamic shared memory 8 * sort_n bytes. Launched plainly (as attn_candidates).
constexpr int kTopkThreads = 1024;
constexpr int kTopkPerThread = 4;
constexpr int kTopkWarps = kTopkThreads / 32;

extern "C" __global__ void __launch_bounds__(kTopkThreads)
    attn_candidates_topk(const int* __restrict__ positions, const int* __restrict__ window_base, int window,
                         int ring, const int* __restrict__ compressed_base, const float* __restrict__ scores,
                         int score_stride, const int* __restrict__ num_valid, int k, int sort_n,
                         int* __restrict__ top_idx, float* __restrict__ top_score, int* __restrict__ candidates,
                         int stride, int* __restrict__ lengths) {
    extern __shared__ unsigned long long keys[];  // sort_n complemented composites
    __shared__ int warp_count[kTopkWarps];
    const int b = blockIdx.x;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int t = positions[b];
    const int nv = min(max(num_valid[b], 0), score_stride);
    const float* row_scores = scores + (long)b * score_stride;
    unsigned long long mine[kTopkPerThread];  // the thread's own composites, entry tid + kTopkThreads r
#pragma unroll
    for (int r = 0; r < kTopkPerThread; ++r) {
        const int i = tid + r * kTopkThreads;
        mine[r] = i < nv ? topk_order::composite(topk_order::order_key(row_scores[i]), (uint32_t)i) : 0ull;
        if (i < sort_n) keys[i] = ~mine[r];
    }
    __syncthreads();
    bitonic_sort_ascending<unsigned long long, kTopkThreads, kTopkPerThread>(keys, sort_n);
    const int kk = min(k, nv);
    for (int j = tid; j < k; j += kTopkThreads) {
        if (j < kk) {
            const unsigned long long c = ~keys[j];
            top_idx[(long)b * k + j] = topk_order::composite_index(c);
            top_score[(long)b * k + j] = topk_order::key_to_score((uint32_t)(c >> 32));
        } else {
            top_idx[(long)b * k + j] = -1;
            top_score[(long)b * k + j] = -INFINITY;
        }
    }
    const int n_win = t >= 0 ? min(t + 1, window) : 0;
    const int n_comp = t >= 0 ? kk : 0;
    const int n = min(n_win + n_comp, stride);
    int* row = candidates + (long)b * stride;
    write_window_and_tail(row, stride, n_win, n, t + 1 - n_win, t >= 0 ? window_base[b] : 0, ring);
    if (tid == 0) lengths[b] = n;
    if (n_comp == 0) return;  // uniform over the CTA: no barrier follows for it
    const unsigned long long thr = ~keys[kk - 1];
    const int base = compressed_base[b];
    int before = 0;  // selected entries in the rounds before this one
    const int rounds = (nv + kTopkThreads - 1) / kTopkThreads;  // uniform over the CTA
#pragma unroll
    for (int r = 0; r < kTopkPerThread; ++r) {
        if (r >= rounds) break;
        const int i = tid + r * kTopkThreads;
        const bool sel = i < nv && mine[r] >= thr;
        const unsigned ballot = __ballot_sync(0xFFFFFFFFu, sel);
        if (lane == 0) warp_count[warp] = __popc(ballot);
        __syncthreads();
        int rank = before + __popc(ballot & ((1u << lane) - 1u));
        int total = 0;
        for (int w = 0; w < kTopkWarps; ++w) {  // broadcast reads
            const int c = warp_count[w];
            if (w < warp) rank += c;
            total += c;
        }
        const int pos = n_win + rank;
        if (sel && pos < n) row[pos] = base + i;
        before += total;
        __syncthreads();  // warp_count is rewritten by the next round
    }
}
