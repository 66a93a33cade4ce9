// Hopper (sm_90a) asynchronous-MMA primitives shared by the wgmma kernels (moe_gemm_prefill, sparse_attn, mhc_mix_tc).
// Only the ordering/fence instructions and the one shared-memory descriptor form both kernels use live here;
// each kernel keeps its own wgmma shape wrappers next to the code that sizes its fragments.
#pragma once
#include <stdint.h>

// Orders this thread's generic-proxy shared-memory writes (plain st.shared of a dequantized tile) before later
// async-proxy reads of the same bytes (wgmma operand fetch). Needed after every refill of a wgmma operand tile.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// wgmma.fence before the first wgmma that touches registers written by other instructions; commit closes a
// group; wait_group 0 waits for every committed group of this warpgroup.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

// Keeps the compiler from moving accumulator accesses across the async MMA boundary (the accumulators are
// owned by the tensor core between wgmma issue and wgmma.wait_group).
template <int R>
__device__ __forceinline__ void fence_acc(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Byte offset of (row, 16-byte chunk) inside such a tile: the SWIZZLE_128B image, chunk index XOR (row & 7)
// (mirrored on the host in src/ops/moe_gemm/prefill.rs).
__device__ __forceinline__ uint32_t sw128_offset(uint32_t row, uint32_t chunk) {
    return row * 128u + ((chunk ^ (row & 7u)) << 4);
}

// Descriptor of a 1024-byte-aligned, 128B-swizzled, K-major tile at shared address `addr`: rows of 128 bytes
// (64 BF16), 8-row groups 1024 bytes apart; the swizzle XORs the 16-byte chunk index with (row & 7).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4)  // bits 0-13: start address >> 4
           | ((uint64_t)1 << 16)              // bits 16-29: LBO (unused for swizzled K-major) = 1
           | ((uint64_t)(1024 >> 4) << 32)    // bits 32-45: SBO = 1024 B between 8-row groups
           | ((uint64_t)1 << 62);             // bits 62-63: 1 = 128B swizzle
}
