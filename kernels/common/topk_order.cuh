// The total order of the exact top-k (the lightning indexer's top-k in kernels/indexer.cu and the engine's fused
// short-row top-k in kernels/engine_attn.cu; CPU twin: src/ops/indexer/reference.rs).
// composite = (order_key(score) << 32) | ~index, a u64 unique per entry, so "the k largest composites" is exactly
// "score descending, the lower index first on equal scores". NaN ranks as -inf and -0 as +0.
// Every real composite is above 0 (order_key >= 0x007FFFFF), so 0 pads a row below all of its entries.
// block_select: one CTA's MSB-first radix select over unique composites (8-bit digits, warp-aggregated histogram
// counts, an early exit once the chosen bucket holds exactly the remaining count), read through a source with
// comp(i); the indexer's final-pass fallback reads them from global memory, the fused short-row top-k from shared.
#pragma once
#include <stdint.h>

namespace topk_order {

__device__ __forceinline__ uint32_t order_key(float s) {
    if (isnan(s)) s = -INFINITY;
    if (s == 0.f) s = 0.f;  // -0 ranks with +0
    const uint32_t b = __float_as_uint(s);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The score a key stands for (order_key's inverse on its image: NaN comes back as -inf, -0 as +0).
__device__ __forceinline__ float key_to_score(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

__device__ __forceinline__ uint64_t composite(uint32_t key, uint32_t idx) {
    return ((uint64_t)key << 32) | (uint32_t)~idx;
}

// The index a composite carries.
__device__ __forceinline__ int composite_index(uint64_t c) { return (int)~(uint32_t)c; }

constexpr unsigned kFull = 0xffffffffu;

struct SelectShared {
    uint32_t hist[256];
    uint32_t warp_sums[32];
    uint32_t bucket, new_rem, bucket_count, count;
};

// Radix select over m unique composites: on return, exactly kk (1 <= kk <= m) elements satisfy
// (c >> shift) >= (prefix >> shift). Block-uniform control flow only; every thread must call it.
template <class Src>
__device__ void block_select(const Src& src, int m, int kk, SelectShared& sh, uint64_t& prefix_out, int& shift_out) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    uint64_t prefix = 0;
    uint32_t rem = (uint32_t)kk;
    int shift = 64;
    for (int pass = 0; pass < 8; ++pass) {  // uniform trip count; uniform break below
        const int sd = 56 - 8 * pass;
        for (int i = tid; i < 256; i += blockDim.x) sh.hist[i] = 0;
        __syncthreads();
        for (int base = 0; base < m; base += blockDim.x) {  // no barrier inside; warp-uniform trip count
            const int i = base + tid;
            uint32_t digit = 256;  // "not counted"
            if (i < m) {
                const uint64_t c = src.comp(i);
                if (pass == 0 || (c >> (sd + 8)) == (prefix >> (sd + 8))) digit = (uint32_t)(c >> sd) & 0xFFu;
            }
            // Warp-aggregated counting. Fast paths (votes only): the whole warp in one bucket (typical of
            // the first, exponent-heavy digits), or no lane still matching the prefix (typical of later
            // passes). Otherwise one atomic per distinct digit. All branches are warp-uniform.
            const uint32_t d0 = __shfl_sync(kFull, digit, 0);
            if (__all_sync(kFull, digit == d0)) {
                if (lane == 0 && d0 < 256) atomicAdd(&sh.hist[d0], 32u);
            } else if (__any_sync(kFull, digit < 256)) {
                const unsigned peers = __match_any_sync(kFull, digit);
                if (digit < 256 && lane == __ffs(peers) - 1) atomicAdd(&sh.hist[digit], (uint32_t)__popc(peers));
            }
        }
        __syncthreads();
        // Inclusive scan of the histogram from the top bucket down (threads 0..255 <-> buckets 255..0).
        const uint32_t v = tid < 256 ? sh.hist[255 - tid] : 0u;
        uint32_t incl = v;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const uint32_t y = __shfl_up_sync(kFull, incl, o);
            if (lane >= o) incl += y;
        }
        if (tid < 256 && lane == 31) sh.warp_sums[warp] = incl;
        __syncthreads();
        if (tid < 256) {
            for (int w2 = 0; w2 < warp; ++w2) incl += sh.warp_sums[w2];
            const uint32_t excl = incl - v;
            if (excl < rem && incl >= rem) {  // exactly one bucket: the one holding the rem-th largest
                sh.bucket = 255 - tid;
                sh.new_rem = rem - excl;
                sh.bucket_count = v;
            }
        }
        __syncthreads();
        prefix |= (uint64_t)sh.bucket << sd;
        rem = sh.new_rem;
        shift = sd;
        const bool done = sh.bucket_count == rem;
        __syncthreads();  // all reads of sh.* done before the next pass rewrites it
        if (done) break;
    }
    prefix_out = prefix;
    shift_out = shift;
}

}  // namespace topk_order
