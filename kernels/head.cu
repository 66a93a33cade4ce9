// head: the model's two ends around the layer stack on the device (launchers: src/ops/head/mod.rs).
//
// head_embed: token ids -> the 4 mHC residual streams. X [T, 4, D] BF16 stream-major (the layout every mHC kernel
// reads, kernels/mhc.cu): X[t][s][:] = embed.weight[ids[t]][:] for s = 0..3 (the CPU model's `Model::embed`,
// `row.repeat(hc_mult)`: a copy, no arithmetic). The ids live on the device (the sampler writes the next step's ids
// there, kernels/sampler.cu), so the launcher never reads them:
//   - ids[t] < 0 marks an empty row: X[t] is written with zeros (finite, so the mHC kernels that follow stay finite);
//   - ids[t] >= vocab writes nothing to X[t] and ORs HEAD_ERR_OOV_ID into *error (sticky: the caller clears it).
// Grid (T, ceil(D / 8 / 256)), block 256: thread = one 16-byte chunk (8 BF16) of the row, stored to the 4 streams.
//
// The final hc_head + RMSNorm (norm.weight) that feeds the LM head is mhc's (mhc_mix_partial4 + mhc_head_finish_bf16,
// src/ops/mhc `hc_head`): the same math, reused through the head launcher `final_norm`.
#include <cuda_bf16.h>
#include <stdint.h>

constexpr uint32_t HEAD_ERR_OOV_ID = 1u;  // an id >= vocab was seen (src/ops/head ERR_OOV_ID)

extern "C" __global__ void __launch_bounds__(256) head_embed(const int* __restrict__ ids, int T,
                                                            const __nv_bfloat16* __restrict__ table, int vocab,
                                                            int D, __nv_bfloat16* __restrict__ X,
                                                            uint32_t* __restrict__ error) {
    const int t = blockIdx.x;
    if (t >= T) return;
    const int chunk = blockIdx.y * blockDim.x + threadIdx.x;  // 8 BF16 per chunk
    const int id = __ldg(ids + t);
    if (id >= vocab) {
        if (chunk == 0) atomicOr(error, HEAD_ERR_OOV_ID);
        return;
    }
    if (chunk * 8 >= D) return;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (id >= 0) v = __ldg(reinterpret_cast<const uint4*>(table + (long)id * D) + chunk);
    uint4* row = reinterpret_cast<uint4*>(X + (long)t * 4 * D);
    const int chunks = D / 8;
#pragma unroll
    for (int s = 0; s < 4; ++s) row[s * chunks + chunk] = v;
}
