// The MoE router of DeepSeek-V4 decode (src/ops/router/mod.rs is the launcher and states the contract).
//
// Two launches per routing of T tokens:
//  1. router_logits: logits[t, e] = sum_i gate[e, i] * x[t, i] (BF16 inputs, f32 accumulation). One CTA per
//     (expert, tile of kLogitTokens tokens); its 8 warps take the 256-element chunks of D round-robin (warp w:
//     chunks w, w + 8, ...), each lane 8 consecutive elements per chunk. Summation tree of one logit: per lane a
//     sequential f32 sum over its chunks (8 products each, in element order), a 5-level xor butterfly across the
//     warp, then the 8 warp sums added in warp order by one thread. BF16 x BF16 products are exact in f32, so an
//     FMA contraction of `acc + w * x` changes nothing. Tree depth (the error bound's n in the tests):
//     8 * ceil(chunks / 8) + 5 + 8 with chunks = D / 256.
//  2. router_select_group: one CTA of 1024 threads for the whole batch (decode T <= 64; the launcher allows up to
//     kMaxTokens). Phase 1, one warp per token: scores s_e = sqrt(softplus(logit)) (softplus(x) = x above 20, else
//     log1p(exp(x)), as the CPU model), selection (hash layers: the token's tid2eid row in table order; else the
//     top-6 of s_e + bias_e by value, the lower expert index first on equal values, a NaN as -inf, -0 as +0),
//     weights w_j = s_j / sum * route_scale with sum = s_0 + s_1 + ... + s_5 in selection order (f32, the CPU
//     model's order). Each chosen (token, expert) sets bit t of the expert's token mask in shared memory.
//     Phase 2: the rank of pair (t, j) in its expert = the set bits of that mask below t, so every expert's slots
//     are in token order (deterministic, no atomics on the order); token_rows[t, j] = e * capacity + rank, or -1
//     when rank >= capacity (the pair is dropped and counted). counts[e] = min(popcount, capacity).
//     Phase 3: every one of the E * capacity slots is written exactly once: the r-th set bit of expert e's mask
//     gives the token of slot (e, r), its weight the token's weight for e; empty slots get token -1, weight 0.
//     With a slot map (router_select_group_slots) phases 2 and 3 group by physical slot slot_of[e] instead, one
//     row per pair (two picks of one token on one slot are two rows); see select_group below.
// Both launches are PDL-launched (common/pdl.cuh): the logits CTAs load their gate rows and the selection CTA stages
// the bias and slot tables while the kernel before each still runs.
// Nothing shapes a launch from the result: grids come from T and E alone, so both launches replay in a graph.

#include <cuda_bf16.h>
#include <stdint.h>
#include "common/pdl.cuh"

namespace {

constexpr int kTopk = 6;
constexpr int kMaxExperts = 512;
constexpr int kLogitThreads = 256;
constexpr int kLogitWarps = kLogitThreads / 32;
constexpr int kLogitTokens = 8;
constexpr int kChunk = 256;  // D elements per warp pass: 32 lanes x 8 BF16 (one 16-byte load each)
// Gate chunks a logits warp loads before its PDL wait: all of them up to D = 8192 (Flash 2 a warp, Pro 4).
constexpr int kPreChunks = 4;
constexpr int kSelectThreads = 1024;
constexpr int kExpertsPerLane = kMaxExperts / 32;

__device__ __forceinline__ void unpack8(const uint4 v, float f[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // BF16 -> f32 is the 16 bits shifted up (exact).
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
  }
}

// sqrt(softplus(x)) with the CPU model's branch (src/model/numerics.rs softplus).
__device__ __forceinline__ float route_score(float x) {
  const float sp = x > 20.0f ? x : log1pf(expf(x));
  return sqrtf(sp);
}

// Order-preserving key of (value, expert): a larger value wins, then the lower expert index. NaN maps to -inf
// and -0 to +0 (the CPU compares with partial_cmp, where -0 == +0). Key 0 is below every real key.
__device__ __forceinline__ unsigned long long select_key(float v, int e) {
  if (v != v) v = -INFINITY;
  if (v == 0.0f) v = 0.0f;
  uint32_t b = __float_as_uint(v);
  b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return ((unsigned long long)b << 32) | (uint32_t)(0xFFFFFFFFu - (uint32_t)e);
}

}  // namespace

// logits [T, E] f32 = x [T, D] BF16 . gate [E, D]^T BF16. Grid (E, ceil(T / 8)), block 256. D % 256 == 0, x and
// gate 16-byte aligned (the launcher checks). PDL-launched (common/pdl.cuh): it triggers first (the selection's CTA
// stages its tables meanwhile), loads the first kPreChunks of its warp's gate chunks (weights: constant) into
// registers, then waits for the kernel before it (which wrote x). The chunks are summed in the same order either
// way, so the logits do not depend on where the wait falls.
extern "C" __global__ void __launch_bounds__(kLogitThreads) router_logits(
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ gate, int tokens, int experts,
    int dim, float* __restrict__ logits) {
  pdl_trigger();
  __shared__ float s_part[kLogitWarps][kLogitTokens];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int e = blockIdx.x;
  const int t0 = blockIdx.y * kLogitTokens;
  const int nt = min(kLogitTokens, tokens - t0);
  const int chunks = dim / kChunk;
  const __nv_bfloat16* wrow = gate + (size_t)e * dim;
  uint4 wpre[kPreChunks];
#pragma unroll
  for (int i = 0; i < kPreChunks; ++i) {
    const int c = warp + i * kLogitWarps;
    if (c < chunks) wpre[i] = *reinterpret_cast<const uint4*>(wrow + c * kChunk + lane * 8);
  }
  pdl_wait();
  float acc[kLogitTokens];
#pragma unroll
  for (int t = 0; t < kLogitTokens; ++t) acc[t] = 0.0f;
  // One chunk of the warp: 8 weights of the lane against the same 8 columns of each token, in element order.
  auto chunk = [&](const uint4 wv, const int c) {
    const int col = c * kChunk + lane * 8;
    float wf[8];
    unpack8(wv, wf);
#pragma unroll
    for (int t = 0; t < kLogitTokens; ++t) {
      if (t < nt) {
        float xf[8];
        unpack8(*reinterpret_cast<const uint4*>(x + (size_t)(t0 + t) * dim + col), xf);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[t] += wf[i] * xf[i];
      }
    }
  };
#pragma unroll
  for (int i = 0; i < kPreChunks; ++i) {
    const int c = warp + i * kLogitWarps;
    if (c < chunks) chunk(wpre[i], c);
  }
  for (int c = warp + kPreChunks * kLogitWarps; c < chunks; c += kLogitWarps)
    chunk(*reinterpret_cast<const uint4*>(wrow + c * kChunk + lane * 8), c);
#pragma unroll
  for (int t = 0; t < kLogitTokens; ++t) {
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) acc[t] += __shfl_xor_sync(0xFFFFFFFFu, acc[t], m);
  }
  if (lane == 0) {
#pragma unroll
    for (int t = 0; t < kLogitTokens; ++t) s_part[warp][t] = acc[t];
  }
  __syncthreads();
  if (threadIdx.x < nt) {
    const int t = threadIdx.x;
    float s = s_part[0][t];
#pragma unroll
    for (int w = 1; w < kLogitWarps; ++w) s += s_part[w][t];
    logits[(size_t)(t0 + t) * experts + e] = s;
  }
}

// Selection, weights and the masked grouping of T tokens (one CTA of 1024 threads). hash != 0: experts from
// tid2eid[token_ids[t] * 6 + j] (a token id outside [0, vocab), an entry outside [0, E) or a repeat of an earlier
// entry of the row routes that pair nowhere: expert -1, weight 0, counted in `dropped`); bias is then unused.
// Outputs: topk_experts / topk_weights [T, 6] (logical experts), token_rows [T, 6], counts [slots],
// row_token / row_weight [slots * capacity], dropped [1] (pairs with no row).
// kMapped == false (router_select_group): slots == experts, slot e = expert e; dynamic shared memory E * ceil(T / 32)
// 32-bit token masks (bit t of word (e, t / 32): token t chose e; a token chooses an expert at most once).
// kMapped == true (router_select_group_slots): pair (t, j) goes to slot slot_of[e_j]; two picks of one token may
// share a slot, so a slot gets one row per pair, in pair order (t, then j). Dynamic shared memory: slots * ceil(T / 32)
// 32-bit counters (word (s, w) = the pairs of tokens 32w .. 32w + 31 in slot s), then each slot's total [slots],
// then each pair's slot [T * 6] (-1: no slot), then the staged bias [E] and slot_of [E]. The rank of pair p in slot
// s = the counters of s's earlier words + the pairs of p's own 32-token word before p in slot s (at most 191
// shared-memory reads); the pair then writes its own row (row_token, row_weight), and the rows at or past a slot's
// count are written empty, so every row is written exactly once in O(rows + pairs) work. With slot_of the identity
// it writes what kMapped == false writes.
template <bool kMapped>
__device__ __forceinline__ void select_group(
    const float* __restrict__ logits, const float* __restrict__ bias, const int* __restrict__ token_ids,
    const int* __restrict__ tid2eid, int vocab, int hash, const int* __restrict__ slot_of, int slots, int tokens,
    int experts, int capacity, float route_scale, int* topk_experts, float* topk_weights,
    int* __restrict__ token_rows, int* __restrict__ counts, int* __restrict__ row_token,
    float* __restrict__ row_weight, int* __restrict__ dropped) {
  extern __shared__ uint32_t s_mask[];  // [slots][words]: token masks (identity) or pair counters (mapped)
  __shared__ int s_dropped;
  const int words = (tokens + 31) / 32;
  // Mapped only: each slot's total pairs [slots], then each pair's slot [tokens * 6] (after the counters).
  int* s_slot_total = reinterpret_cast<int*>(s_mask + slots * words);
  int* s_pair_slot = s_slot_total + slots;
  // The layer's constant tables, staged before the PDL wait: the selection bias [experts] (biased layers) and
  // (mapped) slot_of [experts].
  float* s_bias = reinterpret_cast<float*>(s_pair_slot + tokens * kTopk);
  int* s_slot_of = reinterpret_cast<int*>(s_bias + experts);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = threadIdx.x; i < slots * words; i += blockDim.x) s_mask[i] = 0u;
  if (threadIdx.x == 0) s_dropped = 0;
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    if (!hash) s_bias[e] = bias[e];
    if constexpr (kMapped) s_slot_of[e] = slot_of[e];
  }
  // Everything above reads weights and tables no kernel writes (common/pdl.cuh); the logits, token ids and every
  // output come after the wait. The trigger follows the tables' arrival: a PDL-launched successor (the shared
  // expert's GEMV, whose weight prefetch fills the memory queues) starts only once they are in shared memory.
  __syncthreads();
  pdl_trigger();
  pdl_wait();

  // Phase 1: one warp per token.
  for (int t = warp; t < tokens; t += blockDim.x / 32) {
    const float* lg = logits + (size_t)t * experts;
    int my_e = -1;  // lane j < 6: the j-th chosen expert
    if (hash) {
      if (lane < kTopk) {
        const int id = token_ids[t];
        if (id >= 0 && id < vocab) {
          const int e = tid2eid[(size_t)id * kTopk + lane];
          my_e = (e >= 0 && e < experts) ? e : -1;
        }
      }
      // A repeat of an earlier entry of the row is dropped (its rank would collide with the first).
      for (int j = 0; j < kTopk; ++j) {
        const int ej = __shfl_sync(0xFFFFFFFFu, my_e, j);
        if (lane > j && lane < kTopk && my_e == ej) my_e = -1;
      }
    } else {
      unsigned long long key[kExpertsPerLane];
#pragma unroll
      for (int i = 0; i < kExpertsPerLane; ++i) {
        const int e = lane + 32 * i;
        key[i] = e < experts ? select_key(route_score(lg[e]) + s_bias[e], e) : 0ull;
      }
      for (int j = 0; j < kTopk; ++j) {
        unsigned long long best = 0ull;
#pragma unroll
        for (int i = 0; i < kExpertsPerLane; ++i) best = key[i] > best ? key[i] : best;
#pragma unroll
        for (int m = 16; m >= 1; m >>= 1) {
          const unsigned long long o = __shfl_xor_sync(0xFFFFFFFFu, best, m);
          best = o > best ? o : best;
        }
        const int e = (int)(0xFFFFFFFFu - (uint32_t)(best & 0xFFFFFFFFull));
        // best == 0 only when fewer than 6 experts exist (the launcher refuses that).
        if (best != 0ull && (e & 31) == lane) {
#pragma unroll
          for (int i = 0; i < kExpertsPerLane; ++i)
            if (lane + 32 * i == e) key[i] = 0ull;
        }
        if (lane == j) my_e = best != 0ull ? e : -1;
      }
    }
    const float my_s = my_e >= 0 ? route_score(lg[my_e]) : 0.0f;
    float sum = 0.0f;
    for (int j = 0; j < kTopk; ++j) sum += __shfl_sync(0xFFFFFFFFu, my_s, j);
    if (lane < kTopk) {
      topk_experts[t * kTopk + lane] = my_e;
      topk_weights[t * kTopk + lane] = my_e >= 0 ? my_s / sum * route_scale : 0.0f;
      if constexpr (kMapped) {
        int s = my_e >= 0 ? s_slot_of[my_e] : -1;
        s = (s >= 0 && s < slots) ? s : -1;
        s_pair_slot[t * kTopk + lane] = s;
        if (s >= 0) atomicAdd(&s_mask[s * words + t / 32], 1u);
      } else {
        if (my_e >= 0) atomicOr(&s_mask[my_e * words + t / 32], 1u << (t % 32));
      }
    }
  }
  __syncthreads();

  if constexpr (kMapped) {
    // Phase 2: each slot's total and count.
    for (int s = threadIdx.x; s < slots; s += blockDim.x) {
      int n = 0;
      for (int w = 0; w < words; ++w) n += (int)s_mask[s * words + w];
      s_slot_total[s] = n;
      counts[s] = min(n, capacity);
    }
    // Phase 3a: the row of every pair; the pair writes that row (token, weight).
    for (int p = threadIdx.x; p < tokens * kTopk; p += blockDim.x) {
      const int s = s_pair_slot[p];
      int row = -1;
      if (s >= 0) {
        const int w0 = p / kTopk / 32;
        int rank = 0;
        for (int w = 0; w < w0; ++w) rank += (int)s_mask[s * words + w];
        for (int q = w0 * 32 * kTopk; q < p; ++q) rank += s_pair_slot[q] == s;
        row = rank < capacity ? s * capacity + rank : -1;
      }
      if (row < 0) {
        atomicAdd(&s_dropped, 1);
      } else {
        row_token[row] = p / kTopk;
        row_weight[row] = topk_weights[p];
      }
      token_rows[p] = row;
    }
    __syncthreads();  // s_slot_total (phase 2) is read below
    // Phase 3b: the rows no pair owns (rank >= the slot's count) are written empty.
    for (int i = threadIdx.x; i < slots * capacity; i += blockDim.x) {
      const int s = i / capacity;
      if (i - s * capacity >= min(s_slot_total[s], capacity)) {
        row_token[i] = -1;
        row_weight[i] = 0.0f;
      }
    }
  } else {
    // Phase 2: the row of every (token, k) pair and the per-expert counts.
    for (int p = threadIdx.x; p < tokens * kTopk; p += blockDim.x) {
      const int t = p / kTopk;
      const int e = topk_experts[p];
      int row = -1;
      if (e >= 0) {
        const uint32_t* m = s_mask + e * words;
        int rank = __popc(m[t / 32] & ((1u << (t % 32)) - 1u));
        for (int w = 0; w < t / 32; ++w) rank += __popc(m[w]);
        row = rank < capacity ? e * capacity + rank : -1;
      }
      if (row < 0) atomicAdd(&s_dropped, 1);
      token_rows[p] = row;
    }
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
      int n = 0;
      for (int w = 0; w < words; ++w) n += __popc(s_mask[e * words + w]);
      counts[e] = min(n, capacity);
    }

    // Phase 3: every slot, written once.
    for (int s = threadIdx.x; s < experts * capacity; s += blockDim.x) {
      const int e = s / capacity;
      int r = s - e * capacity;
      int tok = -1;
      for (int w = 0; w < words && tok < 0; ++w) {
        uint32_t m = s_mask[e * words + w];
        const int n = __popc(m);
        if (r < n) {
          for (; r > 0; --r) m &= m - 1u;  // clear the r lowest set bits
          tok = w * 32 + __ffs(m) - 1;
        } else {
          r -= n;
        }
      }
      float wgt = 0.0f;
      if (tok >= 0) {
        for (int j = 0; j < kTopk; ++j)
          if (topk_experts[tok * kTopk + j] == e) wgt = topk_weights[tok * kTopk + j];
      }
      row_token[s] = tok;
      row_weight[s] = wgt;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) dropped[0] = s_dropped;
}

// The identity grouping (slot = expert): slots == experts. Both selection kernels are PDL-launched after the logits
// (the tables staged, then the trigger, then the wait: see select_group); dynamic shared memory as for the mapped
// kernel below (the launcher computes one size for both).
extern "C" __global__ void __launch_bounds__(kSelectThreads) router_select_group(
    const float* __restrict__ logits, const float* __restrict__ bias, const int* __restrict__ token_ids,
    const int* __restrict__ tid2eid, int vocab, int hash, int tokens, int experts, int capacity,
    float route_scale, int* topk_experts, float* topk_weights, int* __restrict__ token_rows,
    int* __restrict__ counts, int* __restrict__ row_token, float* __restrict__ row_weight,
    int* __restrict__ dropped) {
  select_group<false>(logits, bias, token_ids, tid2eid, vocab, hash, nullptr, experts, tokens, experts, capacity,
                      route_scale, topk_experts, topk_weights, token_rows, counts, row_token, row_weight, dropped);
}

// The grouping by physical slot: slot_of [E] (values outside [0, slots) route the pair nowhere), counts [slots],
// row_token / row_weight [slots * capacity]; dynamic shared memory slots * ceil(T / 32) + slots + T * 6 + 2 E words.
extern "C" __global__ void __launch_bounds__(kSelectThreads) router_select_group_slots(
    const float* __restrict__ logits, const float* __restrict__ bias, const int* __restrict__ token_ids,
    const int* __restrict__ tid2eid, int vocab, int hash, const int* __restrict__ slot_of, int slots, int tokens,
    int experts, int capacity, float route_scale, int* topk_experts, float* topk_weights,
    int* __restrict__ token_rows, int* __restrict__ counts, int* __restrict__ row_token,
    float* __restrict__ row_weight, int* __restrict__ dropped) {
  select_group<true>(logits, bias, token_ids, tid2eid, vocab, hash, slot_of, slots, tokens, experts, capacity,
                     route_scale, topk_experts, topk_weights, token_rows, counts, row_token, row_weight, dropped);
}

// The routed experts' activation gather: token rows of NVFP4 activations (codes [T, D/2], e4m3 block scales
// [T, D/16], per-row global scale [T], the layout of norm_quant's NVFP4 rows) copied to the rows of the masked
// grouping that moe_gemm's decode mainloop reads ([rows_total, ...] alike). One CTA per (token, pick) pair p:
// row = token_rows[p] (-1 or outside [0, rows_total): the pair got no row, nothing is written) takes token p / 6's
// row. Rows no pair owns are not written (the grouped GEMM reads only owned rows: the mainloop the first counts[s]
// rows of slot s, the finishes gsa of owned rows). Codes move as 16-byte words (D/2 bytes: D % 128 == 0 makes the
// row a multiple of 64 bytes), scales as 8-byte words (D/16 bytes, a multiple of 8); the launcher checks that
// every base address is 16-byte aligned. grid = T * 6 (from T alone: graph-safe), block = 128.
extern "C" __global__ void __launch_bounds__(128) router_gather_nvfp4_rows(
    const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales, const float* __restrict__ global,
    const int* __restrict__ token_rows, int rows_total, int D, uint8_t* __restrict__ row_codes,
    uint8_t* __restrict__ row_scales, float* __restrict__ row_global) {
  const int p = blockIdx.x;
  const int row = token_rows[p];
  if (row < 0 || row >= rows_total) return;
  const int t = p / kTopk;
  const uint4* src = reinterpret_cast<const uint4*>(codes + (size_t)t * (D / 2));
  uint4* dst = reinterpret_cast<uint4*>(row_codes + (size_t)row * (D / 2));
  for (int i = threadIdx.x; i < D / 32; i += blockDim.x) dst[i] = src[i];
  const uint2* ssrc = reinterpret_cast<const uint2*>(scales + (size_t)t * (D / 16));
  uint2* sdst = reinterpret_cast<uint2*>(row_scales + (size_t)row * (D / 16));
  for (int i = threadIdx.x; i < D / 128; i += blockDim.x) sdst[i] = ssrc[i];
  if (threadIdx.x == 0) row_global[row] = global[t];
}
