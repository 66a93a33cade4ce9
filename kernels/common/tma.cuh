// TMA (cp.async.bulk.tensor) and mbarrier primitives shared by the Hopper kernels that stream tiles with the Tensor
// Memory Accelerator: the session-5 v6 decode mainloop (kernels/moe_gemm.cu) and the RS prefill mainloop with
// pre-permuted activations (kernels/moe_gemm_prefill.cu). Tensor maps are encoded on the host (src/gpu/tma.rs).
#pragma once
#include <stdint.h>

// A CUtensorMap (opaque 128 bytes, encoded on the host by cuTensorMapEncodeTiled), passed by value as a
// __grid_constant__ kernel parameter so that its generic address can be handed to the TMA.
struct __align__(64) TmaDesc {
    unsigned long long opaque[16];
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// Wait for the completion of the phase with parity `parity`; false after kMbarWaitLimitNs. A protocol bug must not
// hang a whole test or bench run, nor trap (a trap poisons the CUDA context of every test in the process): no
// legitimate wait here takes more than microseconds, so on a timeout the caller returns, the CTA's outputs stay
// unwritten (the tests compare against 0xFF-poisoned buffers) and every other thread of the CTA times out too.
constexpr unsigned long long kMbarWaitLimitNs = 2000000000ull;
__device__ __forceinline__ bool mbar_wait(uint64_t* bar, uint32_t parity) {
    const uint32_t a = smem_u32(bar);
    if (mbar_try_wait(a, parity)) return true;
    const unsigned long long t0 = global_ns();
    while (!mbar_try_wait(a, parity)) {
        if (global_ns() - t0 > kMbarWaitLimitNs) return false;
    }
    return true;
}
// 2D TMA tile copy global -> this CTA's shared memory at coordinates (x = inner, in elements; y = row); completion
// adds the box's bytes (out-of-bounds parts zero-filled and counted too) to the transaction count of `bar`.
__device__ __forceinline__ void tma_load_2d(void* dst, const TmaDesc* desc, int x, int y, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(desc)), "r"(x), "r"(y), "r"(smem_u32(bar))
        : "memory");
}

// 1D bulk copy global -> this CTA's shared memory of `bytes` bytes (both addresses 16-byte aligned, bytes a multiple
// of 16); completion adds `bytes` to the transaction count of `bar`.
__device__ __forceinline__ void bulk_load_1d(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}
