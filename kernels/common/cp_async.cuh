// cp.async (sm_80+) primitives shared by the cp.async-ring kernels (moe_gemm_prefill, mhc_mix_tc): 16-byte
// copies that bypass L1 (.cg), with zero fill, and the group commit / wait that pace a ring of stages.
#pragma once
#include <stdint.h>

// 16-byte cp.async with zero fill: src_bytes = 0 writes 16 zero bytes and reads nothing (rows past the end of a
// tile). dst is a shared-memory address (cvta'd), 16-byte aligned.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint32_t src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
