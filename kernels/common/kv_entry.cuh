// The DSV4 584-byte FP8 KV-cache entry written by one warp (formats::kv layout): [0,448) e4m3 nope codes in 7
// tiles of 64, [448,576) 64 BF16 rope dims, [576,583) 7 UE8M0 tile scales, [583] pad (0). Shared by
// kernels/sparse_attn.cu (kv_write_entries_*, and the q prologue's LaneQuant) and kernels/compressor.cu (the
// compressed entries). Entries are only 8-byte aligned (584 = 8 * 73), so every store is at most 8 bytes wide.
//
// One warp per 512-dim vector: lane l holds dims [16l, 16l+16). Lanes 0..27 cover the seven nope tiles (4 lanes
// per tile), lanes 28..31 the 64 rope dims. Same rule as formats::kv::encode_entry: scale code =
// ue8m0_pow2_scale_for(max(amax, 1e-4), 448), code = e4m3_rne(x / scale) with an IEEE division; rope dims are
// rounded to BF16 (nearest even).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "formats.cuh"

namespace kv_entry {

constexpr int kDim = 512;
constexpr int kNope = 448;
constexpr int kTiles = 7;
constexpr int kEntryBytes = 584;
constexpr int kRopeOffset = 448;
constexpr int kScaleOffset = 576;
constexpr float kAmaxFloor = 1e-4f;

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

struct LaneQuant {
    uint32_t codes[4];  // 16 e4m3 codes (lanes < 28)
    uint8_t scale_code;
    float scale;
};

__device__ __forceinline__ LaneQuant quantize_lane(const float (&x)[16], int lane) {
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(x[i]));
    // The 4 lanes of one tile are 4l..4l+3: xor 1 and 2 stay inside the group.
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    LaneQuant r;
    r.scale_code = mm::ue8m0_pow2_scale_for(fmaxf(amax, kAmaxFloor), 448.f);
    r.scale = mm::ue8m0_decode(r.scale_code);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        uint32_t v = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) v |= uint32_t(mm::e4m3_encode(__fdiv_rn(x[4 * w + i], r.scale))) << (8 * i);
        r.codes[w] = v;
    }
    (void)lane;
    return r;
}

// Quantize the warp's vector (lane l: dims 16l..16l+15 in x) and store it as entry `idx` of the pool. All 32
// lanes take part (the amax shuffles).
__device__ __forceinline__ void store_entry_warp(uint8_t* __restrict__ pool, int idx, const float (&x)[16],
                                                 int lane) {
    LaneQuant q = quantize_lane(x, lane);
    uint8_t* e = pool + (size_t)idx * kEntryBytes;
    if (lane < 28) {
        uint2* dst = reinterpret_cast<uint2*>(e + 16 * lane);
        dst[0] = make_uint2(q.codes[0], q.codes[1]);
        dst[1] = make_uint2(q.codes[2], q.codes[3]);
        if ((lane & 3) == 0) e[kScaleOffset + (lane >> 2)] = q.scale_code;
    } else {
        uint32_t w[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = pack_bf16x2(x[2 * i], x[2 * i + 1]);
        uint2* dst = reinterpret_cast<uint2*>(e + kRopeOffset + 32 * (lane - 28));
#pragma unroll
        for (int i = 0; i < 4; ++i) dst[i] = make_uint2(w[2 * i], w[2 * i + 1]);
        if (lane == 28) e[kEntryBytes - 1] = 0;  // pad byte
    }
}

}  // namespace kv_entry
