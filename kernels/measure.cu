// Measurement glue (src/gpu/timing.rs): kernels that prepare the GPU for a timed repetition, never timed themselves.
//
// l2_flush_read: reads `n` 16-byte words with L2-allocating loads (ld.global.cg) and keeps a running XOR, so the
// loads cannot be dropped; the only store is guarded by a comparison that no input makes true in practice (the
// flush buffer holds one repeated byte pattern, whose words XOR to zero). Run over a buffer of at least twice the
// L2 size right after that buffer was written, it leaves L2 holding clean lines: the dirty lines of the write (and
// of whatever ran before) are written back here, outside the timed events, instead of during the timed kernel's
// first misses. Grid-stride loop, any grid.
#include <stdint.h>

extern "C" __global__ void __launch_bounds__(256) l2_flush_read(const uint4* __restrict__ p, size_t n,
                                                                uint32_t* __restrict__ sink) {
    uint32_t acc = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const uint4 v = __ldcg(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9E3779B9u) *sink = acc;
}
