// Grouped row layout shared by the MoE GEMM kernels (the decode mainloop and the finish kernels).
#pragma once

namespace {

// Grouping. masked_capacity > 0: expert e owns rows [e*cap, e*cap + clamp(counts[e], 0, cap)).
// masked_capacity == 0: expert e owns rows [offsets[e], offsets[e+1]) clamped to [0, rows_total).
// Device-side counts/offsets are clamped so that a bad value can never index out of bounds.
struct Grouping {
    const int* group;  // counts[E] or offsets[E+1]
    int capacity;
    int experts;
    int rows_total;

    __device__ __forceinline__ void expert_rows(int e, int& start, int& count) const {
        if (capacity > 0) {
            start = e * capacity;
            count = min(max(group[e], 0), capacity);
        } else {
            int lo = min(max(group[e], 0), rows_total);
            int hi = min(max(group[e + 1], lo), rows_total);
            start = lo;
            count = hi - lo;
        }
    }
    // Which expert owns `row`, or -1 (padding slot / row outside every group).
    __device__ __forceinline__ int expert_of_row(int row) const {
        if (row < 0 || row >= rows_total) return -1;
        if (capacity > 0) {
            int e = row / capacity;
            if (e >= experts) return -1;
            return (row - e * capacity) < min(max(group[e], 0), capacity) ? e : -1;
        }
        // Largest e with offsets[e] <= row (offsets nondecreasing by contract), then check row < offsets[e+1].
        int lo = 0, hi = experts - 1;
        while (lo < hi) {
            int mid = (lo + hi + 1) >> 1;
            if (group[mid] <= row) lo = mid; else hi = mid - 1;
        }
        int s, c;
        expert_rows(lo, s, c);
        return (row >= s && row < s + c) ? lo : -1;
    }
};

}  // namespace
