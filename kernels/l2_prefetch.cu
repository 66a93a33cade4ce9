// L2 prefetch of constant byte ranges (src/gpu/prefetch.rs is the launcher and states the contract).
//
// Why: at batch 1 a decode step alternates weight streams (the GEMVs, at the HBM's rate) with chains of latency-bound
// kernels (the attention's q / KV prep, indexer, candidates and sparse attention; the mHC finishes; the router)
// during which the memory system is nearly idle. Issued at the head of such a chain, the next GEMVs' weights move into
// L2 while the chain runs, and the GEMVs then stream them from L2.
//
// How: every thread issues `cp.async.bulk.prefetch.L2.global` (sm_90: the SM's bulk-copy unit fetches the bytes into
// L2 and nothing into the SM; no completion to wait for) for chunks of kChunk bytes: the ranges' chunks numbered in
// order (range 0's, then range 1's, ...), chunk g goes to thread g mod (grid threads), so every CTA's SM issues about
// the same bytes. A range's address is 16-byte aligned and its length is rounded down to 16 bytes (the
// launcher checks; the tail bytes are left to the reader), so no request passes the end of a range.
//
// PDL (common/pdl.cuh): it triggers at once, so its successor's CTAs become resident while it issues, and waits for
// its predecessor before it exits: it reads nothing any kernel writes, and "this grid complete" still implies "the
// grid before it complete" for the kernel after it. Prefetches are hints: they change no value any kernel reads.
#include <stdint.h>
#include "common/pdl.cuh"

namespace {
constexpr int kMaxRanges = 8;
constexpr uint64_t kChunk = 16384;
}  // namespace

// Plain data, by value: `count` ranges of `bytes[i]` bytes from `addr[i]` (a multiple of 16 each).
struct L2Ranges {
  unsigned long long addr[kMaxRanges];
  unsigned long long bytes[kMaxRanges];
  int count;
};

extern "C" __global__ void __launch_bounds__(32) l2_prefetch_ranges(const L2Ranges r) {
  pdl_trigger();
  const uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const uint64_t n = (uint64_t)gridDim.x * blockDim.x;
  // g: this thread's next chunk in the ranges' order; first: the number of the range i's first chunk.
  uint64_t g = t, first = 0;
  for (int i = 0; i < r.count && i < kMaxRanges; ++i) {
    const uint64_t bytes = r.bytes[i] & ~15ull;
    const uint64_t chunks = (bytes + kChunk - 1) / kChunk;
    for (; g < first + chunks; g += n) {
      const uint64_t off = (g - first) * kChunk;
      const uint32_t len = (uint32_t)(bytes - off < kChunk ? bytes - off : kChunk);
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(r.addr[i] + off), "r"(len) : "memory");
    }
    first += chunks;
  }
  pdl_wait();
}
