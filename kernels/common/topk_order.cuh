// The total order of the exact top-k (the lightning indexer's top-k in kernels/indexer.cu and the engine's fused
// short-row top-k in kernels/engine_attn.cu; CPU twin: src/ops/indexer/reference.rs).
// composite = (order_key(score) << 32) | ~index, a u64 unique per entry, so "the k largest composites" is exactly
// "score descending, the lower index first on equal scores". NaN ranks as -inf and -0 as +0.
// Every real composite is above 0 (order_key >= 0x007FFFFF), so 0 pads a row below all of its entries.
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

}  // namespace topk_order
