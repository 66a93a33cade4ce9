// mhc_mix_tc: the mHC boundary's 24-wide mix F.x (and the sum of squares x.x) on BF16 tensor cores, for
// prefill-sized token counts (mhc_pre's path from 128 tokens: mhc_pre_auto_path in src/ops/mhc/mod.rs). Under ncu at
// 8192 x 4096 this mix takes 82 us (69% of DRAM peak) where the FFMA mix mhc_mix_partial24_staged takes 751 us.
// Writes the same split-K partials [T][25][S] that the finish kernels of kernels/mhc.cu (mhc_pre_finish_*)
// reduce, with S = the K-split count chosen by the launcher (src/ops/mhc/mod.rs `tc_mix_splits`), not 4D/128.
// Its own translation unit: it shares no device code with kernels/mhc.cu (its wgmma / cp.async ring helpers come
// from common/), only the partials layout.
//
// Why: the FFMA mixes (mhc_mix_partial24_staged, mhc_unfused_gemv) do 24 FMAs per BF16 element of X plus F loads:
// at 65536 tokens x D 4096 that is 25.8 G FMA, >= 0.77 ms at the fp32 FMA peak before any load (7.6 ms for
// the whole fused boundary on the H200). Here the mix is a GEMM X [T x 4D] (BF16) x [f1; f2; f3]^T
// [4D x 72] (BF16) with fp32 accumulation: 155 GFLOP on tensor cores (~0.2 ms at the measured ~800 TFLOPS),
// so the kernel should be bound by reading X once (2.15 GB at 65536 x 4096, ~0.55 ms at 4 TB/s).
//
// Exactness (the weights side, made once at upload by `mix_fn_bf16_planes` on the host; tested on the CPU):
//   f1 = bf16_rn(F), f2 = bf16_rn(F - f1), f3 = bf16_rn(F - f1 - f2), and F = f1 + f2 + f3 EXACTLY for every
//   normal F with |F| >= 2^-100 (so for any real mix weight). Why: let F in [2^e, 2^(e+1)); F is a multiple of
//   ulp24 = 2^(e-23). f1 rounds F to 8 significant bits, so r1 = F - f1 is a multiple of 2^(e-23) with |r1| <=
//   half an 8-bit ulp = 2^(e-8): at most 16 significant bits, exact in fp32 (no rounding in the subtraction).
//   f2 rounds r1 to 8 bits, so r2 = r1 - f2 is again a multiple of 2^(e-23), |r2| <= 2^(e-16): at most 8
//   significant bits, exact in fp32 AND in BF16, so f3 = r2 and nothing is left over. (If f1 rounds up into the
//   next binade the bounds still hold: |r1| <= 2^(e-8).) BF16 has fp32's exponent range, so no plane overflows
//   below |F| = 2^127 (2 - 2^-8) (f1 would round to infinity above); only for |F| < ~2^-110 could f3 fall
//   below BF16's subnormal grid (2^-133) and lose bits, <= 2^-134 each.
// Exactness (the products): BF16 x BF16 has <= 16 significant bits, so every product of the tensor core is the
//   exact real product; the planes' three dots are sums of exact products, and dot_j = (acc3_j + acc2_j) + acc1_j
//   (fp32, smallest first) equals F_j . x up to the accumulation error of the tensor core (below) and two fp32
//   roundings. The accumulation is NOT IEEE fp32 summation: Hopper's wgmma adds each k16 block of products to
//   the accumulator as one fused block (products aligned to the largest exponent, low bits dropped). The tests
//   (tests/mhc.rs, tc_dot_bounds) bound this per k16 step by 20 x 2^-23 x (|accumulator| + sum |step's
//   products|) (17 for one 17-addend block: 16 alignments + 1 normalization) and check every dot against f64
//   under it; tc_dot_bounds_hold_for_emulated_tensor_cores checks the bound on a bit-level emulation.
// The sum of squares (column 24, the RMS of the residual) stays on the CUDA cores: each thread squares 32 of the
//   64 columns of a staged k-block (4 chains of 8 fma), adds the block's float to an fp64 accumulator (exact for
//   the ~1024 blocks of a split: no long fp32 chain), and one fp32 rounding at the end: ss relative error
//   <= ~12 x 2^-24, better than the FFMA kernels' (rho is checked to 8 ulp as before).
//
// Tiling: CTA = 128 tokens (two consumer warp groups, wgmma M = 64 each) x one K split of 4D (S splits on
//   grid.x, tile on grid.y); k-block = 64 columns (one 128-byte swizzle atom row). Per stage: X tile 128 rows x
//   128 B = 16 KB, F-plane tile 72 rows x 128 B = 9 KB (L2-resident: 2.4 MB at D 4096, read once per token tile),
//   both K-major with the 128B swizzle of kernels/moe_gemm_prefill.cu (byte (r, chunk c) at r*128 + ((c ^ (r&7))
//   << 4), tiles 1024-aligned, descriptor sw128_desc, +2 per k16 slice). 4 stages (100 KB) -> 2 CTAs per SM.
//   One wgmma m64n72k16 per slice and warp group: N = 72 = the three planes' 24 mixes (legal: N % 8 == 0).
// Pipeline (cp.async ring, one __syncthreads per k-block, no warp specialization; memory-bound by design):
//     cp.async.wait_group STAGES-2 (this thread's copies of block i landed); fence.proxy.async (cp.async writes
//     are generic-proxy writes; wgmma reads through the async proxy); __syncthreads (everyone's);
//     issue block i+STAGES-1 into the slot of block i-1 (its wgmma finished: every warp group waited on it
//     before the barrier); wgmma x 4 on block i; the sum of squares of block i from shared memory meanwhile;
//     wgmma.wait_group 0.
//   Tokens >= T are zero-filled (cp.async src-size 0) and never stored.
// Epilogue: accumulator fragment of m64nNk16 (PTX ISA): thread (warp w of the group, lane l) holds d[4j+{0,1}]
//   = row 16w + l/4, columns 8j + 2(l%4) + {0,1}, and d[4j+{2,3}] = row + 8. Column n = 24p + m (plane p, mix m)
//   and n + 24 = 8(j+3) + same offset: a thread holds all three planes of its mixes, so the combination is local.
#include "common/wgmma.cuh"
#include "common/cp_async.cuh"
#include <cuda_bf16.h>
#include <stdint.h>

namespace {

constexpr int kThreads = 256;               // two consumer warp groups
constexpr int kTileTokens = 128;            // wgmma M = 64 per warp group
constexpr int kBlockK = 64;                 // columns of 4D per k-block (one 128 B swizzle row)
constexpr int kMix = 24;                    // mixes of a sub-layer boundary
constexpr int kPlaneRows = 3 * kMix;        // 72: wgmma N
constexpr int kStages = 4;
constexpr int kXTileBytes = kTileTokens * 128;        // 16384
constexpr int kFTileBytes = kPlaneRows * 128;         // 9216 = 9 x 1024
constexpr int kStageBytes = kXTileBytes + kFTileBytes;  // 25600 = 25 x 1024 (keeps every tile 1024-aligned)
static_assert(kStageBytes % 1024 == 0, "tiles must stay 1024-byte aligned for the 128B swizzle");


// D(64 x 72, fp32) += A(64 x 16, bf16, smem desc) * B(72 x 16, bf16, smem desc)^T; both K-major (trans 0),
// scale-d 1 (accumulate), scales a/b 1.
__device__ __forceinline__ void wgmma_m64n72k16(float (&d)[36], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n72k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
        "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35}, %36, %37, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35])
        : "l"(da), "l"(db), "r"(1));
}

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

// Sum of squares of one 16-byte chunk (8 BF16) as an fma chain onto acc.
__device__ __forceinline__ float sq8(uint4 r, float acc) {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float lo = bf16_lo(w[i]), hi = bf16_hi(w[i]);
        acc = fmaf(lo, lo, acc);
        acc = fmaf(hi, hi, acc);
    }
    return acc;
}

}  // namespace

// grid (S, ceil(T / 128)), block 256, dynamic smem kStages * kStageBytes + 1024 (alignment slack).
// X [T, 4D] BF16 (token-major, the [T, 4, D] residual streams), Fp [72, 4D] BF16 (planes f1; f2; f3 of the
// [24, 4D] mix weights), part [T, 25, S] f32: part[t][m][s] = F_m . x_t over split s's columns (m < 24), and
// part[t][24][s] = the sum of squares there. Requires 4D % (64 S) == 0 (checked by the launcher).
extern "C" __global__ void __launch_bounds__(kThreads, 2)
    mhc_mix_tc_partial24(const __nv_bfloat16* __restrict__ X, const __nv_bfloat16* __restrict__ Fp,
                         float* __restrict__ part, int T, int D4) {
    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
    const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31;
    const int S = gridDim.x, s = blockIdx.x;
    const int t0 = blockIdx.y * kTileTokens;
    const int nblocks = D4 / kBlockK / S;  // k-blocks of this split
    const int k_first = s * nblocks * kBlockK;

    auto issue = [&](int i) {
        if (i < nblocks) {
            const uint32_t xs = smem_base + (i % kStages) * kStageBytes, fs = xs + kXTileBytes;
            const int k0 = k_first + i * kBlockK;
#pragma unroll
            for (int q = 0; q < kTileTokens * 8 / kThreads; ++q) {  // 4 x 16 B of X per thread
                const int idx = tid + q * kThreads, r = idx >> 3, c = idx & 7;
                const bool ok = t0 + r < T;
                const __nv_bfloat16* src = X + (size_t)(ok ? t0 + r : 0) * D4 + k0 + c * 8;
                cp_async16(xs + sw128_offset(r, c), src, ok ? 16 : 0);
            }
            for (int idx = tid; idx < kPlaneRows * 8; idx += kThreads) {  // 2-3 x 16 B of the planes
                const int r = idx >> 3, c = idx & 7;
                cp_async16(fs + sw128_offset(r, c), Fp + (size_t)r * D4 + k0 + c * 8, 16);
            }
        }
        cp_async_commit();  // empty groups past the end keep the wait_group count uniform
    };

    float d[36];
#pragma unroll
    for (int i = 0; i < 36; ++i) d[i] = 0.f;
    double ss = 0.0;  // this thread's sum of squares: row tid/2, columns 32 (tid&1) .. +32 of every k-block
    const int sq_row = tid >> 1, sq_half = tid & 1;

#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) issue(i);

    for (int i = 0; i < nblocks; ++i) {
        cp_async_wait<kStages - 2>();
        fence_proxy_async();
        __syncthreads();
        issue(i + kStages - 1);  // into the slot of block i - 1, whose wgmma every warp group has waited for
        const uint32_t xs = smem_base + (i % kStages) * kStageBytes;
        const uint64_t da = sw128_desc(xs + wg * (64 * 128)), db = sw128_desc(xs + kXTileBytes);
        fence_acc(d);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBlockK / 16; ++kk) {
            // +32 bytes per K = 16 slice = +2 in the 16-byte units of the start-address field.
            wgmma_m64n72k16(d, da + 2 * kk, db + 2 * kk);
        }
        wgmma_commit();
        {
            const uint8_t* xt = smem + (i % kStages) * kStageBytes;
            float a[4];
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const uint4 v = *reinterpret_cast<const uint4*>(xt + sw128_offset(sq_row, sq_half * 4 + c));
                a[c] = sq8(v, 0.f);
            }
            ss += (double)((a[0] + a[1]) + (a[2] + a[3]));
        }
        wgmma_wait_all();
        fence_acc(d);
    }

    // Sum of squares: the two halves of the row (lanes 2k, 2k+1) in fp64, one rounding to fp32.
    ss += __shfl_xor_sync(0xffffffffu, ss, 1);
    const long Sl = S;
    if (sq_half == 0 && t0 + sq_row < T) part[((long)(t0 + sq_row) * 25 + 24) * Sl + s] = (float)ss;

    // Mixes: rows r and r + 8 of this warp group's 64; j in 0..3 are the plane-1 columns 8j + 2(l%4) + e.
    const int wl = (tid & 127) >> 5;
    const int r_lo = t0 + wg * 64 + wl * 16 + (lane >> 2);
#pragma unroll
    for (int j = 0; j < 3; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // h = 0: row r_lo (d[4j + e]), 1: row r_lo + 8 (d[4j + 2 + e])
            const int t = r_lo + 8 * h;
            if (t >= T) continue;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int m = 8 * j + 2 * (lane & 3) + e;
                const int o = 4 * j + 2 * h + e;
                // smallest first: (acc3 + acc2) + acc1 (columns m + 48, m + 24, m: fragment offsets +24, +12).
                const float dot = (d[o + 24] + d[o + 12]) + d[o];
                part[((long)t * 25 + m) * Sl + s] = dot;
            }
        }
    }
}
