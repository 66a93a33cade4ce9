// The 584-byte FP8 KV cache entry (formats::kv layout, dsv4-architecture §4.2), written by one warp per 512-dim
// vector: the window-KV writers of kernels/sparse_attn.cu (kv_write_entries_*) and kernels/qkv_prep.cu
// (qkv_prep_kv_entries) share this code.
//
// Entry: [0,448) e4m3 nope codes in 7 tiles of 64, [448,576) the 64 rope dims as BF16 (little-endian), [576,583)
// the 7 UE8M0 tile scales, [583] pad = 0. Entries are only 8-byte aligned (584 = 8 * 73): every store is 8 bytes
// wide or narrower.
//
// Lane l holds dims [16l, 16l+16). Lanes 0..27 cover the seven nope tiles (4 lanes per tile), lanes 28..31 the
// 64 rope dims. Same rule as formats::kv::encode_entry (= fp8_sim per 64 on the nope dims): scale code =
// ue8m0_pow2_scale_for(max(amax, 1e-4), 448), code = e4m3_rne(x / scale) with an IEEE division; rope dims
// rounded to BF16 (RNE).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "formats.cuh"

namespace mm {

constexpr int kKvEntryBytes = 584;
constexpr int kKvRopeOffset = 448;
constexpr int kKvScaleOffset = 576;
constexpr float kKvAmaxFloor = 1e-4f;

struct KvLaneQuant {
    uint32_t codes[4];  // 16 e4m3 codes (lanes < 28)
    uint8_t scale_code;
    float scale;
};

// The lane's 16 codes and its tile's scale. All 32 lanes must call it (tile amax by shuffles).
__device__ __forceinline__ KvLaneQuant kv_quantize_lane(const float (&x)[16]) {
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(x[i]));
    // The 4 lanes of one tile are 4l..4l+3: xor 1 and 2 stay inside the group.
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    KvLaneQuant r;
    r.scale_code = ue8m0_pow2_scale_for(fmaxf(amax, kKvAmaxFloor), 448.f);
    r.scale = ue8m0_decode(r.scale_code);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        uint32_t v = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) v |= uint32_t(e4m3_encode(__fdiv_rn(x[4 * w + i], r.scale))) << (8 * i);
        r.codes[w] = v;
    }
    return r;
}

__device__ __forceinline__ uint32_t kv_pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo (low half)
    return *reinterpret_cast<uint32_t*>(&v);
}

// Stores lane `lane`'s part of the entry at `e` (quantized with kv_quantize_lane as `q`).
__device__ __forceinline__ void kv_entry_store_lane(uint8_t* e, const KvLaneQuant& q, const float (&x)[16],
                                                    int lane) {
    if (lane < 28) {
        uint2* dst = reinterpret_cast<uint2*>(e + 16 * lane);
        dst[0] = make_uint2(q.codes[0], q.codes[1]);
        dst[1] = make_uint2(q.codes[2], q.codes[3]);
        if ((lane & 3) == 0) e[kKvScaleOffset + (lane >> 2)] = q.scale_code;
    } else {
        uint32_t w[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = kv_pack_bf16x2(x[2 * i], x[2 * i + 1]);
        uint2* dst = reinterpret_cast<uint2*>(e + kKvRopeOffset + 32 * (lane - 28));
#pragma unroll
        for (int i = 0; i < 4; ++i) dst[i] = make_uint2(w[2 * i], w[2 * i + 1]);
        if (lane == 28) e[kKvEntryBytes - 1] = 0;  // pad byte
    }
}

// Quantize the warp's vector (lane l: dims [16l, 16l+16) in x) and store it as entry `idx` of `pool`. All 32
// lanes take part (the tile amax shuffles).
__device__ __forceinline__ void kv_entry_store_warp(uint8_t* pool, int idx, const float (&x)[16], int lane) {
    const KvLaneQuant q = kv_quantize_lane(x);
    kv_entry_store_lane(pool + (size_t)idx * kKvEntryBytes, q, x, lane);
}

}  // namespace mm
