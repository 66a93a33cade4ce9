// NVFP4 MoE grouped GEMM for Hopper (sm_90a): D[m, n] = gsa[m] * gsb[e, n] * sum_k A[m, k] * B[e, n, k].
//
// Design (see src/ops/moe_gemm/mod.rs for the launcher contract, docs/numerics.md for the numerics)
// ---------------------------------------------------------------------------------------------
// * Hopper has no FP4 tensor cores. An NVFP4 element e2m1 * s_e4m3 has at most 5 significant bits and lies in
//   [2^-10, 2688], so it is exact in BF16. We dequantize weights in registers to BF16 (block scale included) and
//   feed `mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32`; fp32 accumulation makes the result differ from the exact
//   sum only by summation order. The fp32 global scales gsa[m] (per activation row) and gsb[e, n] (per weight
//   row) are constant along K and are applied once, in the finish kernels.
// * Swap-AB: weight rows are the MMA M dimension (16 per warp, 128 per CTA), tokens are the MMA N dimension
//   (8 per n-tile, NT n-tiles per CTA), so one decode token costs an 8-wide MMA, not a 64-row tile.
// * Weights stream once from HBM with 16-byte `ld.global.nc.L1::no_allocate` loads straight into registers
//   (no shared-memory round trip), one stage (512 K) ahead of the math (register double buffer).
//   Per warp and 128-K chunk a lane loads 16 B of row g and 16 B of row g+8 (g = lane/4) at byte offset 16*(lane%4):
//   each 64-byte row segment is read whole, so every 32-byte sector fetched is fully used (no swizzle needed).
// * K permutation (free: a dot product does not care about the order of K as long as both operands agree).
//   Lane t of a quad owns the 32 contiguous K elements [32t, 32t+32) of each 128-K chunk, i.e. two whole NVFP4
//   blocks. Within each 8-element group x0..x7 (one 32-bit word of codes) the MMA k-slot pairs are
//   (x0,x4),(x1,x5),(x2,x6),(x3,x7): that pairing lets one shift+mask turn nibbles i and i+4 of a word into a
//   bf16x2 (below). The activations are stored in shared memory in the same permuted order.
// * Dequant of nibble pair (i, i+4) of word w: v = w << (12 - 4i) puts nibble i at bits 12..15 and nibble i+4 at
//   bits 28..31; (v & 0x80008000) | ((v >> 6) & 0x01C001C0) is the bf16x2 whose halves equal e2m1 * 2^-126
//   (sign to bit 15, the 3 magnitude bits to the exponent/mantissa bits 8..6; code 1 (0.5) is the bf16
//   subnormal 2^-127, codes >= 2 are normal). One `mul.rn.bf16x2` by (s_e4m3 * 2^117) then gives
//   e2m1 * s * 2^-9 exactly (<= 5 significant bits, 2^-19 .. 5.25 is inside the normal bf16 range; 2^117 keeps
//   s * 2^117 <= 448 * 2^117 below the bf16 maximum). The factor 2^9 is restored exactly when the fp32
//   accumulator is stored. Cost: 4 integer ops + 1 HMUL2 per 2 weights.
// * Activations (A) are staged per 512-K stage into shared memory as BF16 (NVFP4 A is dequantized exactly to
//   e2m1 * s_a; gsa stays for the epilogue). The 16-byte unit of (token, chunk c, lane t, word j) sits at
//   unit token*64 + c*16 + 4t + (j ^ ((t & 2) | (token & 1))): the XOR makes the 8 lanes of each
//   shared-memory phase hit 8 different 16-byte bank groups (conflict-free ld.shared.v4).
// * Persistent grid: every CTA scans the per-expert counts (masked) or offsets (contiguous) into a shared prefix
//   of token tiles, then walks work items (expert token tile, 128-row n tile, K split) with stride gridDim.x.
//   Masked layout: counts live on the device, the launch shape is fixed -> a decode step is graph-capturable.
// * Split-K for small token counts (more items to fill 132 SMs): each split writes fp32 partial sums to a
//   workspace part[split][row][n]; the finish kernels add the splits in a fixed order (deterministic, no
//   atomics) and apply the epilogue: plain BF16, L1 SwiGLU + routing weight + NVFP4 quant, or L2 per-token
//   combine over the top-k experts in routing order.
//
// * Decode mainloop (moe_gemm_decode_{bf16,f16}_operands_nt*, entry points below; prefill shapes go to the wgmma
//   kernel of moe_gemm_prefill.cu): reads the weights' tiling (one contiguous block per 256-row tile and 128-K
//   stage, made at upload). The activation tile of the NEXT 512-K step is copied raw with cp.async into shared
//   memory while the current step computes, then converted smem -> smem; the weights wait in ONE register stage
//   that is refilled chunk by chunk as the compute consumes it, so the 1- and 2-token-tile entries fit 80
//   registers and run 3 CTAs per SM (the launcher's grid is 3 x SMs for them). ptxas issues the next stage's
//   weight loads at the end of a stage, so their lead is short: what limits the loop at decode sizes is latency
//   and issue (Nsight Compute at Flash L1 64 tokens: DRAM ~67%, issue ~59%), not HBM bandwidth.
// * Finish kernels: the split sums in fixed split order, then the epilogue.
//   - moe_gemm_finish_bf16: one CTA per row, plain BF16 output.
//   - moe_gemm_finish_l1_per_row (decode): one CTA per row; pass 1 (split sums, SwiGLU, row amax), then an NVFP4
//     pass with 4 elements per thread; padding rows of the masked layout are written directly (no barrier).
//   - moe_gemm_finish_l1_rows_kc* (prefill): persistent CTAs over contiguous row ranges, a per-thread cp.async
//     ring of the next rows' partials, h in registers, 8 elements of a 16-block per thread and the division-free
//     e2m1 encoder. Bit-identical to the per-row finish (shared l1_swiglu_h and quantization rules).
//   - moe_gemm_finish_l2_combine_{rowwarps,cols2,cols2_tok}: the per-token combine in routing order; which
//     one runs is FinishL2Kernel::for_tokens (all bit-identical); an optional BF16 addend (the shared expert) is
//     added to the routed f32 sum before the one BF16 rounding.
//
// Rounding points: products exact (bf16 x bf16 of exact values), fp32 accumulation (tensor-core order),
// split partials added in split order in fp32, scale = gsa * gsb (fp32), out = acc * scale (fp32), then the
// epilogue's own points (bf16 RNE; or SwiGLU in fp32 and the NVFP4 rule of common/formats.cuh).
#include "common/formats.cuh"
#include "common/expert_tiles.cuh"
#include "common/nvfp4_dequant.cuh"
#include "common/e2m1_thresholds.cuh"
#include "common/grouping.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = 8;
constexpr int kBlockN = kWarps * 16;   // weight rows per CTA
constexpr int kChunkK = 128;           // K per lane-quad load (lane owns 32)
constexpr int kChunksPerStage = 4;
constexpr int kStageK = kChunkK * kChunksPerStage;  // 512
constexpr int kMaxExperts = 512;

struct WChunk {
    uint4 row_lo;      // row g: 32 e2m1 codes
    uint4 row_hi;      // row g+8
    uint32_t scales;   // bytes: row g block 2t, row g block 2t+1, row g+8 block 2t, row g+8 block 2t+1
};

// Value of an e2m1 code without a lookup table (a dynamically indexed local array would live in local memory):
// m = code & 7; m < 2 -> 0.5 * m, else 2^((m >> 1) - 1) * (1 + (m & 1) / 2), built from its fp32 bits.
__device__ __forceinline__ float e2m1_value(uint32_t code) {
    const uint32_t m = code & 7;
    const float mag = m < 2 ? 0.5f * (float)m : __uint_as_float((((m >> 1) + 126u) << 23) | ((m & 1u) << 22));
    return (code & 8) ? -mag : mag;
}

// D += A . B on m16n8k16 fragments, fp32 accumulation; A and B bf16, or f16 with kHalf.
#define MOE_MMA_16816(T)                                                                                            \
    "mma.sync.aligned.m16n8k16.row.col.f32." T "." T ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
template <bool kHalf = false>
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
    if constexpr (kHalf)
        asm volatile(MOE_MMA_16816("f16")
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm volatile(MOE_MMA_16816("bf16")
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#undef MOE_MMA_16816

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    // Values here are exact in bf16 (e2m1 * e4m3), so RNE is exact.
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// pack_bf16x2, or with kHalf f16 (e2m1 * e4m3 values lie in [2^-10, 2688] with <= 5 significant bits, exact
// in f16 too).
template <bool kHalf = false>
__device__ __forceinline__ uint32_t pack_x2(float lo, float hi) {
    if constexpr (kHalf) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    } else {
        return pack_bf16x2(lo, hi);
    }
}

// Byte distance between the 128-K chunks of one weight row in the weights' tiling (kernels/moe_gemm_prefill.cu,
// moe_gemm_prefill_tile_weights_rs: one 18 KiB block per (256-row tile, 128-K stage), codes of tile row r at 64 r,
// its 8 scale bytes at 16384 + 8 r), for codes and scales alike.
constexpr int kTiledBlock = 18432;

__device__ __forceinline__ void load_stage(WChunk (&w)[kChunksPerStage], const uint8_t* codes, const uint8_t* scales,
                                           size_t codes_8rows, size_t scales_8rows) {
#pragma unroll
    for (int c = 0; c < kChunksPerStage; ++c) {
        w[c].row_lo = ldg_stream(codes + c * kTiledBlock);
        w[c].row_hi = ldg_stream(codes + codes_8rows + c * kTiledBlock);
        w[c].scales = ldg_u16(scales + c * kTiledBlock) | (ldg_u16(scales + scales_8rows + c * kTiledBlock) << 16);
    }
}


}  // namespace

// ---- Activations through cp.async ----------------------------------------------------------------------------
// Loading each step's activation tile from global memory between two barriers would pay a full memory latency per
// 512-K step with no math in flight. Instead the raw activation tile of the NEXT step is copied into a
// shared "raw" buffer with cp.async (no registers held) right before the current step computes, so that copy
// overlaps the math like the weight prefetch does. At the start of a step the raw tile is converted smem -> smem
// into the permuted, swizzled BF16 layout described in the header.
// Raw layout per step: BF16 A: [TN][512] bf16 (1 KB per token). NVFP4 A: codes [TN][256 B], then scales
// [TN][32 B] at byte TN * 256. The buffer is sized for BF16 (TN * 1 KB); tokens >= ntok are not copied (their
// BF16 is written as zero by the conversion). Alignment: K % 512 == 0 and kbase % 512 == 0 make every source
// address a multiple of 16 bytes (row * K * 2, row * K / 2, row * K / 16 and the k offsets are), given
// 16-byte-aligned base pointers (device allocations are 256-byte aligned).
namespace {

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

template <int TN>
__device__ __forceinline__ void copy_raw_activations(uint8_t* raw, const void* act, const uint8_t* act_scales,
                                                     int act_is_nvfp4, int K, int row0, int ntok, int kbase) {
    if (!act_is_nvfp4) {
        for (int q = threadIdx.x; q < TN * 64; q += kThreads) {  // 64 x 16 B per token
            const int token = q >> 6, ch = q & 63;
            if (token < ntok)
                cp_async_16(raw + token * 1024 + ch * 16,
                            reinterpret_cast<const uint8_t*>(act) + ((size_t)(row0 + token) * K + kbase) * 2 + ch * 16);
        }
    } else {
        for (int q = threadIdx.x; q < TN * 18; q += kThreads) {  // 16 x 16 B of codes + 2 x 16 B of scales per token
            if (q < TN * 16) {
                const int token = q >> 4, ch = q & 15;
                if (token < ntok)
                    cp_async_16(raw + token * 256 + ch * 16, reinterpret_cast<const uint8_t*>(act) +
                                                                 (size_t)(row0 + token) * (K / 2) + kbase / 2 + ch * 16);
            } else {
                const int token = (q - TN * 16) >> 1, ch = q & 1;
                if (token < ntok)
                    cp_async_16(raw + TN * 256 + token * 32 + ch * 16,
                                act_scales + (size_t)(row0 + token) * (K / 16) + kbase / 16 + ch * 16);
            }
        }
    }
    cp_async_commit();
}

// Raw tile -> permuted, swizzled BF16 in s_act: the permuted, swizzled layout of the header (zeros for tokens >= ntok).
// kHalf (NVFP4 A only: the launcher refuses BF16 A): the same values as f16.
template <int TN, bool kHalf = false>
__device__ __forceinline__ void convert_raw_activations(uint4* s_act, const uint8_t* raw, int act_is_nvfp4, int ntok) {
    for (int q = threadIdx.x; q < TN * 64; q += kThreads) {
        const int token = q >> 6, grp = q & 63;
        const int c = grp >> 4, t = (grp >> 2) & 3, j = grp & 3;
        uint4 out = make_uint4(0, 0, 0, 0);
        if (token < ntok) {
            if (!kHalf && !act_is_nvfp4) {
                const uint4 r = reinterpret_cast<const uint4*>(raw)[token * 64 + grp];
                out.x = __byte_perm(r.x, r.z, 0x5410);  // (x0, x4)
                out.y = __byte_perm(r.x, r.z, 0x7632);  // (x1, x5)
                out.z = __byte_perm(r.y, r.w, 0x5410);  // (x2, x6)
                out.w = __byte_perm(r.y, r.w, 0x7632);  // (x3, x7)
            } else {
                const uint32_t codes = reinterpret_cast<const uint32_t*>(raw)[token * 64 + grp];
                const float s = mm::e4m3_decode(raw[TN * 256 + token * 32 + (grp >> 1)]);
                float x[8];
#pragma unroll
                for (int i = 0; i < 8; ++i) x[i] = e2m1_value(codes >> (4 * i)) * s;  // exact
                out.x = pack_x2<kHalf>(x[0], x[4]);
                out.y = pack_x2<kHalf>(x[1], x[5]);
                out.z = pack_x2<kHalf>(x[2], x[6]);
                out.w = pack_x2<kHalf>(x[3], x[7]);
            }
        }
        s_act[token * 64 + c * 16 + t * 4 + (j ^ ((t & 2) | (token & 1)))] = out;
    }
}


}  // namespace

// ------------------------------------------------------------------------------------------------ decode mainloop
// Where the next stage's weights wait: two register stages (wbuf[2][4], 72 registers, the whole next stage issued at
// the top of a step) would hold the 1- and 2-token tiles to 2 CTAs per SM; this loop keeps ONE
// register stage and, inside the compute, re-issues chunk c's load for the next stage as soon as chunk c has been
// dequantized (its registers are dead then). The next stage still has a full step of latency to land, but the
// buffer costs 36 registers instead of 72, which lets the 1- and 2-token-tile entries run 3 CTAs (24 warps) per
// SM instead of 2 (ncu round 1: nt1 v2 = 118 registers, occupancy limited to 25% by registers).
namespace {
// kHalf: weights dequantized to f16 with e2m1_word_to_f16x2_tiny and scales_f16x2 (e2m1 * s * 2^-14) and f16
// MMAs; the activations in s_act are f16 then. Same fragments, pairing and mma order.
template <int NT, bool kHalf = false>
__device__ __forceinline__ void compute_stage_rolling(float (&acc)[NT][4], WChunk (&w)[kChunksPerStage],
                                                      const uint4* s_act, int g, int t, bool load_next,
                                                      const uint8_t* next_codes, const uint8_t* next_scales,
                                                      size_t codes_8rows, size_t scales_8rows) {
#pragma unroll
    for (int c = 0; c < kChunksPerStage; ++c) {
        // bf16: each scale converted and broadcast; f16: the two scales of a row as one f16x2 (h_lo: row g, blocks
        // 2t / 2t + 1; h_hi: row g + 8), broadcast by the multiply's operand selector.
        uint32_t s_lo0 = 0, s_lo1 = 0, s_hi0 = 0, s_hi1 = 0;
        __half2 h_lo, h_hi;
        if constexpr (kHalf) {
            h_lo = scales_f16x2(w[c].scales);
            h_hi = scales_f16x2(w[c].scales >> 16);
        } else {
            s_lo0 = scale_bf16x2(w[c].scales & 0xFF), s_lo1 = scale_bf16x2((w[c].scales >> 8) & 0xFF);
            s_hi0 = scale_bf16x2((w[c].scales >> 16) & 0xFF), s_hi1 = scale_bf16x2(w[c].scales >> 24);
        }
        const uint32_t lo[4] = {w[c].row_lo.x, w[c].row_lo.y, w[c].row_lo.z, w[c].row_lo.w};
        const uint32_t hi[4] = {w[c].row_hi.x, w[c].row_hi.y, w[c].row_hi.z, w[c].row_hi.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint32_t sl = j < 2 ? s_lo0 : s_lo1, sh = j < 2 ? s_hi0 : s_hi1;
            uint32_t pl[4], ph[4];
            if constexpr (kHalf) {
                e2m1_word_to_f16x2_tiny(lo[j], pl);
                e2m1_word_to_f16x2_tiny(hi[j], ph);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    pl[i] = j < 2 ? f16x2_mul_lo(pl[i], h_lo) : f16x2_mul_hi(pl[i], h_lo);
                    ph[i] = j < 2 ? f16x2_mul_lo(ph[i], h_hi) : f16x2_mul_hi(ph[i], h_hi);
                }
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    pl[i] = bf16x2_mul(e2m1_pair_to_bf16x2_tiny(lo[j], i), sl);
                    ph[i] = bf16x2_mul(e2m1_pair_to_bf16x2_tiny(hi[j], i), sh);
                }
            }
            const int unit = c * 16 + t * 4 + (j ^ ((t & 2) | (g & 1)));
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const uint4 b = s_act[(nt * 8 + g) * 64 + unit];
                mma_16816<kHalf>(acc[nt], pl[0], ph[0], pl[1], ph[1], b.x, b.y);
                mma_16816<kHalf>(acc[nt], pl[2], ph[2], pl[3], ph[3], b.z, b.w);
            }
        }
        // Chunk c has been consumed: refill its slot with chunk c of the next stage (the addresses load_stage
        // would use). Issued after the j loop so the old and new chunk are never live together.
        if (load_next) {
            w[c].row_lo = ldg_stream(next_codes + c * kTiledBlock);
            w[c].row_hi = ldg_stream(next_codes + codes_8rows + c * kTiledBlock);
            w[c].scales = ldg_u16(next_scales + c * kTiledBlock) |
                          (ldg_u16(next_scales + scales_8rows + c * kTiledBlock) << 16);
        }
    }
}

// w_tiled: the weights' tiling (codes and block scales, see kTiledBlock; N % 256 == 0).
// kHalf: f16 operands (compute_stage_rolling); the accumulators hold sum * 2^-14 instead of sum * 2^-9.
template <int NT, bool kHalf = false>
__device__ __forceinline__ void decode_body(const uint8_t* __restrict__ w_tiled, int N, int K,
                                            const void* __restrict__ act, const uint8_t* __restrict__ act_scales,
                                            int act_is_nvfp4, Grouping grp, float* __restrict__ partial,
                                            int splits) {
    constexpr int TN = NT * 8;
    extern __shared__ uint4 s_dyn[];  // s_act (TN * 64 units of 16 B), then the raw tile (TN * 1024 B)
    uint4* s_act = s_dyn;
    uint8_t* s_raw = reinterpret_cast<uint8_t*>(s_dyn + TN * 64);
    __shared__ int s_tile_prefix[kMaxExperts + 1];
    __shared__ int s_warp_sum[kWarps];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int E = grp.experts;

    // Exclusive prefix of token tiles per expert (the work-item order).
    int tiles0 = 0, tiles1 = 0;
    {
        int s, c;
        if (2 * tid < E) { grp.expert_rows(2 * tid, s, c); tiles0 = (c + TN - 1) / TN; }
        if (2 * tid + 1 < E) { grp.expert_rows(2 * tid + 1, s, c); tiles1 = (c + TN - 1) / TN; }
    }
    expert_tile_prefix<kThreads>(tiles0, tiles1, E, s_warp_sum, s_tile_prefix);

    const int n_tiles = N / kBlockN;
    const long long items = (long long)s_tile_prefix[E] * n_tiles * splits;
    const int k_split = K / splits;
    const int stages = k_split / kStageK;

    struct ItemPos {
        int row0, ntok, split, n;
        const uint8_t* codes;
        const uint8_t* scales;
    };
    auto locate = [&](long long item) {
        ItemPos p;
        p.split = (int)(item % splits);
        const long long rest = item / splits;
        const int n_tile = (int)(rest % n_tiles);
        const int et = (int)(rest / n_tiles);
        int lo = 0, hi = E - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (s_tile_prefix[mid] <= et) lo = mid; else hi = mid - 1;
        }
        int start, count;
        grp.expert_rows(lo, start, count);
        const int tile = et - s_tile_prefix[lo];
        p.row0 = start + tile * TN;
        p.ntok = min(TN, count - tile * TN);
        const int kbase = p.split * k_split;
        p.n = n_tile * kBlockN + warp * 16 + g;
        const size_t wrow = (size_t)lo * N + p.n;
        // Block of (256-row tile wrow / 256, 128-K stage kbase / 128); row wrow % 256 inside it (N % 256 == 0).
        const uint8_t* blk = w_tiled + ((wrow / 256) * (size_t)(K / kChunkK) + kbase / kChunkK) * kTiledBlock;
        p.codes = blk + (wrow % 256) * 64 + 16 * t;
        p.scales = blk + 16384 + (wrow % 256) * 8 + 2 * t;
        return p;
    };

    long long item = blockIdx.x;
    if (item >= items) return;
    ItemPos cur = locate(item);
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    WChunk wbuf[kChunksPerStage];
    copy_raw_activations<TN>(s_raw, act, act_scales, act_is_nvfp4, K, cur.row0, cur.ntok, cur.split * k_split);
    // Rows g and g + 8: 8 rows apart (plain: 8 row pitches; tiled: 8 x 64 code / 8 x 8 scale bytes in the block).
    const size_t codes_8rows = 8 * 64, scales_8rows = 8 * 8;
    // A 512-K stage: 4 chunks further (plain: 256 code / 32 scale bytes; tiled: 4 blocks).
    constexpr int kStageCodes = kChunksPerStage * kTiledBlock;
    constexpr int kStageScales = kChunksPerStage * kTiledBlock;
    load_stage(wbuf, cur.codes, cur.scales, codes_8rows, scales_8rows);
    int st = 0;
    for (;;) {
        const bool last_stage = st + 1 == stages;
        const long long next_item = last_stage ? item + gridDim.x : item;
        const bool has_next = next_item < items;
        ItemPos nxt = cur;
        if (last_stage && has_next) nxt = locate(next_item);
        const int next_st = last_stage ? 0 : st + 1;
        cp_async_wait_all();  // this thread's copies of this step's raw tile have landed
        __syncthreads();      // ... everyone's; and the previous step's reads of s_act are done
        convert_raw_activations<TN, kHalf>(s_act, s_raw, act_is_nvfp4, cur.ntok);
        __syncthreads();      // s_act complete; s_raw free
        if (has_next)         // the next step's raw tile streams in while this step computes
            copy_raw_activations<TN>(s_raw, act, act_scales, act_is_nvfp4, K, nxt.row0, nxt.ntok,
                                     nxt.split * k_split + next_st * kStageK);
        compute_stage_rolling<NT, kHalf>(acc, wbuf, s_act, g, t, has_next, nxt.codes + next_st * kStageCodes,
                                          nxt.scales + next_st * kStageScales, codes_8rows, scales_8rows);

        if (last_stage) {
            constexpr float kRestore = kHalf ? 16384.f : 512.f;  // exact: the accumulators hold sum * 2^-14 / 2^-9
            float* out = partial + (size_t)cur.split * grp.rows_total * N;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int tk = nt * 8 + 2 * t;
                if (tk < cur.ntok) {
                    out[(size_t)(cur.row0 + tk) * N + cur.n] = acc[nt][0] * kRestore;
                    out[(size_t)(cur.row0 + tk) * N + cur.n + 8] = acc[nt][2] * kRestore;
                }
                if (tk + 1 < cur.ntok) {
                    out[(size_t)(cur.row0 + tk + 1) * N + cur.n] = acc[nt][1] * kRestore;
                    out[(size_t)(cur.row0 + tk + 1) * N + cur.n + 8] = acc[nt][3] * kRestore;
                }
                acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
            }
            if (!has_next) break;
        }
        item = next_item;
        cur = nxt;
        st = next_st;
    }
}
}  // namespace

// Entry points: moe_gemm_decode_<OPERANDS>_nt<NT> on the weights' tiling (DeviceExpertWeights::tiled; w_codes = the
// tiled blocks, w_scales unused (null); N % 256 == 0): a warp's 8 rows of a 128-K chunk are 512 contiguous bytes.
// * bf16_operands: BF16 weight fragments and activations; either activation format.
// * f16_operands: f16 weight fragments built by e2m1_word_to_f16x2_tiny (~11 integer ops per 8 codes instead of
//   15), the two block scales of a row as one exact e4m3x2 -> f16x2 (broadcast by HMUL2's operand selector), f16
//   MMAs; NVFP4 activations only (their values are exact in f16; BF16 activations are not). The products are the
//   same exact values scaled by 2^-14 instead of 2^-9 and the mma order is the same: bit-identical partials to
//   bf16_operands (GPU test). Why: the BF16-operand loop is bound in the SM (issue slots and the ALU pipe), not by
//   HBM, at every decode size; f16 operands take a 512-K stage (nt1) from 770 to 563 SASS instructions.
// 1- and 2-token tiles: 3 CTAs per SM (<= 80 registers); the launcher's grid for them is 3 x SMs.
#define MOE_GEMM_DECODE_ENTRY(OPERANDS, HALF, NT, MINB)                                                               \
    extern "C" __global__ void __launch_bounds__(kThreads, MINB) moe_gemm_decode_##OPERANDS##_nt##NT(                 \
        const uint8_t* __restrict__ w_codes, const uint8_t* __restrict__ w_scales, int N, int K,                     \
        const void* __restrict__ act, const uint8_t* __restrict__ act_scales, int act_is_nvfp4, const int* group,  \
        int capacity, int experts, int rows_total, float* __restrict__ partial, int splits) {                       \
        Grouping grp{group, capacity, experts, rows_total};                                                          \
        decode_body<NT, HALF>(w_codes, N, K, act, act_scales, act_is_nvfp4, grp, partial, splits);                  \
    }

MOE_GEMM_DECODE_ENTRY(bf16_operands, false, 1, 3)
MOE_GEMM_DECODE_ENTRY(bf16_operands, false, 2, 3)
MOE_GEMM_DECODE_ENTRY(bf16_operands, false, 4, 1)
MOE_GEMM_DECODE_ENTRY(bf16_operands, false, 8, 1)
MOE_GEMM_DECODE_ENTRY(f16_operands, true, 1, 3)
MOE_GEMM_DECODE_ENTRY(f16_operands, true, 2, 3)
MOE_GEMM_DECODE_ENTRY(f16_operands, true, 4, 1)
MOE_GEMM_DECODE_ENTRY(f16_operands, true, 8, 1)

namespace {
__device__ __forceinline__ float reduce_splits(const float* partial, int splits, int rows_total, int N, int row, int n) {
    float acc = 0.f;
    for (int s = 0; s < splits; ++s) acc += partial[((size_t)s * rows_total + row) * N + n];  // fixed order
    return acc;
}

__device__ __forceinline__ float block_max(float v, float* s_red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if ((threadIdx.x & 31) == 0) s_red[threadIdx.x >> 5] = v;
    __syncthreads();
    float m = 0.f;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) m = fmaxf(m, s_red[w]);
    __syncthreads();
    return m;
}
}  // namespace

// Plain epilogue: out[row, n] = bf16(acc * (gsa[row] * gsb[e, n])); rows owned by no expert are written as 0.
// grid = rows_total, block = 256. gsa may be null (BF16 A: gsa = 1).
extern "C" __global__ void __launch_bounds__(kThreads) moe_gemm_finish_bf16(
    const float* __restrict__ partial, int splits, const int* group, int capacity, int experts, int rows_total, int N,
    const float* __restrict__ gsa, const float* __restrict__ gsb, __nv_bfloat16* __restrict__ out) {
    Grouping grp{group, capacity, experts, rows_total};
    const int row = blockIdx.x;
    const int e = grp.expert_of_row(row);
    const float sa = (gsa != nullptr && e >= 0) ? gsa[row] : 1.f;
    for (int n = threadIdx.x; n < N; n += blockDim.x) {
        float v = 0.f;
        if (e >= 0) v = reduce_splits(partial, splits, rows_total, N, row, n) * (sa * gsb[(size_t)e * N + n]);
        out[(size_t)row * N + n] = __float2bfloat16_rn(v);
    }
}

// ---- Finish kernels (column-parallel) ---------------------------------------------------------------------------
// Why column-parallel: one CTA per token for the L2 combine would be 1-2 CTAs at 1-2 decode tokens walking 4096
// columns x 6 rows x splits with a dependent chain of global loads per column. Here the split loads of all rows are independent
// and issued together, and the columns are spread over many CTAs.

// Split sums of 4 consecutive gate columns [n, n+4) and the matching up columns [I+n, I+n+4) (float4 loads;
// N % 4 == 0, n % 4 == 0). The loads of up to 4 splits x 2 column groups are predicated in one basic block so they
// are in flight together (one memory round trip for splits <= 4). Per lane the order is that of reduce_splits:
// acc = 0 + p0 + p1 + ... (fixed split order; a missing split is skipped, never added as 0, so -0 stays -0).
__device__ __forceinline__ void reduce_splits4_gate_up(const float* partial, int splits, int rows_total, int N, int I,
                                                       int row, int n, float4& ag, float4& au) {
    constexpr int kSplitsPerPass = 4;
    ag = make_float4(0.f, 0.f, 0.f, 0.f);
    au = ag;
    for (int s0 = 0; s0 < splits; s0 += kSplitsPerPass) {
        float4 pg[kSplitsPerPass], pu[kSplitsPerPass];
#pragma unroll
        for (int v = 0; v < kSplitsPerPass; ++v) {
            const float* base = partial + ((size_t)(s0 + v) * rows_total + row) * N + n;
            const bool ok = s0 + v < splits;
            pg[v] = ok ? *reinterpret_cast<const float4*>(base) : make_float4(0.f, 0.f, 0.f, 0.f);
            pu[v] = ok ? *reinterpret_cast<const float4*>(base + I) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int v = 0; v < kSplitsPerPass; ++v) {
            if (s0 + v < splits) {
                ag.x += pg[v].x; ag.y += pg[v].y; ag.z += pg[v].z; ag.w += pg[v].w;
                au.x += pu[v].x; au.y += pu[v].y; au.z += pu[v].z; au.w += pu[v].w;
            }
        }
    }
}

// Number of threads of every L1 finish block (launcher: FINISH_L1_THREADS), i.e. 16 warps.
constexpr int kFinishL1Threads = 512;

// block_max for the L1 finish candidates (FinishL1Kernel::PadOneBarrier): same value, one barrier instead of two,
// the 16 warp slots read as 4 float4 and reduced as a tree. Requirements / identities:
// * blockDim.x == kFinishL1Threads (16 warps, all slots written); s_red 16-byte aligned.
// * the trailing barrier of block_max only protects s_red against a later reuse; the L1 finish writes s_red once
//   (before the barrier here) and never again, and s_h is written before that same barrier, so dropping it
//   changes no value any thread reads.
// * every slot is a non-NaN value >= +0 (each thread's amax starts at 0.f, fmaxf(a, NaN) = a, and only fabsf
//   values enter), so the maximum of the 16 slots and 0 is one well-defined float: block_max's serial
//   fmaxf chain from 0 and this tree give the same bits.
__device__ __forceinline__ float block_max_l1_one_barrier(float v, float* s_red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if ((threadIdx.x & 31) == 0) s_red[threadIdx.x >> 5] = v;
    __syncthreads();
    const float4* r = reinterpret_cast<const float4*>(s_red);
    const float4 a = r[0], b = r[1], c = r[2], d = r[3];
    static_assert(kFinishL1Threads / 32 == 16, "4 float4 slots");
    const float ab = fmaxf(fmaxf(fmaxf(a.x, a.y), fmaxf(a.z, a.w)), fmaxf(fmaxf(b.x, b.y), fmaxf(b.z, b.w)));
    const float cd = fmaxf(fmaxf(fmaxf(c.x, c.y), fmaxf(c.z, c.w)), fmaxf(fmaxf(d.x, d.y), fmaxf(d.z, d.w)));
    return fmaxf(0.f, fmaxf(ab, cd));
}

// h of one column pair (the L1 epilogue below): gate / up accumulators, the row's gsa, the column pair's gsb, the
// row's routing weight. One source for every L1 finish (pass 1 and the rows kernel), so their h cannot drift apart.
// (ptxas contracts the `1.f +` with the last multiply of expf into one FFMA; the same expression in every caller.)
// l1_swiglu_h_tail: everything after the two scale products (gte = accg * (sa*scg), up = accu * (sa*scu)); split
// out so that the rows kernel can form those products with one FFMA each (its comment) and share the rest, bit for bit.
__device__ __forceinline__ float l1_swiglu_h_tail(float gte, float up, float rw) {
    gte = fminf(gte, 10.f);
    up = fminf(fmaxf(up, -10.f), 10.f);
    const float silu = __fdiv_rn(gte, 1.f + expf(-gte));
    return __fmul_rn(__fmul_rn(silu, up), rw);
}
__device__ __forceinline__ float l1_swiglu_h(float accg, float accu, float sa, float scg, float scu, float rw) {
    return l1_swiglu_h_tail(accg * (sa * scg), accu * (sa * scu), rw);
}

// L1 epilogue. The weight matrix is W13 = [w1; w3] stacked along N (N = 2I): gate = column n, up = column I + n.
//   g = min(acc_g * (gsa*gsb_g), 10), u = clamp(acc_u * (gsa*gsb_u), -10, 10), h = silu(g) * u * routing[row]
// then h is quantized to NVFP4 with a per-row global scale (rule of common/formats.cuh), which needs the row
// amax over all I: one CTA per row keeps the fp32 h in shared memory (I * 4 bytes), reduces the amax, then
// quantizes. `h_out` (nullable) receives the fp32 h for tests. Rows owned by no expert get h = 0, codes 0,
// scales 0, gs = 1 (the quantizer's value for an all-zero row). grid = rows_total, block = 512, smem = I * 4; each
// thread owns 4 consecutive columns per pass (float4 loads of the splits and gsb: I / 2048 passes, i.e. one memory
// round trip at I = 2048, instead of I / 256). Requires I % 16 == 0 (so I % 4 == 0 and every float4 is 16-byte aligned).
//
// Pass 1, shared by the L1 finish entries (one source, so they cannot drift apart): h of the CTA's row into
// s_h (and h_out), the row amax, the global scale gs (written to h_gs[row]). Returns gs; ends after a barrier, so
// s_h is complete for the caller's quantization pass. s_red: 32 floats (block_max). e = grp.expert_of_row(blockIdx.x),
// from the caller (the pad candidates need it before pass 1; passing it saves them a second grouping load).
template <bool kOneBarrierMax = false>
__device__ __forceinline__ float finish_l1_swiglu_to_smem(
    const float* __restrict__ partial, int splits, const Grouping& grp, int rows_total, int I,
    const float* __restrict__ gsa, const float* __restrict__ gsb, const float* __restrict__ routing,
    float* __restrict__ h_gs, float* __restrict__ h_out, float* s_h, float* s_red, int e) {
    const int row = blockIdx.x;
    const int N = 2 * I;
    const float sa = (gsa != nullptr && e >= 0) ? gsa[row] : 1.f;
    const float rw = e >= 0 ? routing[row] : 0.f;
    float amax = 0.f;
    for (int n = 4 * threadIdx.x; n < I; n += 4 * blockDim.x) {
        float h[4] = {0.f, 0.f, 0.f, 0.f};
        if (e >= 0) {
            float4 ag, au;
            reduce_splits4_gate_up(partial, splits, rows_total, N, I, row, n, ag, au);
            const float4 sg = *reinterpret_cast<const float4*>(gsb + (size_t)e * N + n);
            const float4 su = *reinterpret_cast<const float4*>(gsb + (size_t)e * N + I + n);
            const float accg[4] = {ag.x, ag.y, ag.z, ag.w}, accu[4] = {au.x, au.y, au.z, au.w};
            const float scg[4] = {sg.x, sg.y, sg.z, sg.w}, scu[4] = {su.x, su.y, su.z, su.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) h[i] = l1_swiglu_h(accg[i], accu[i], sa, scg[i], scu[i], rw);
        }
        const float4 hv = make_float4(h[0], h[1], h[2], h[3]);
        *reinterpret_cast<float4*>(s_h + n) = hv;
        if (h_out != nullptr) *reinterpret_cast<float4*>(h_out + (size_t)row * I + n) = hv;
        amax = fmaxf(amax, fmaxf(fmaxf(fabsf(h[0]), fabsf(h[1])), fmaxf(fabsf(h[2]), fabsf(h[3]))));
    }
    if constexpr (kOneBarrierMax) {
        amax = block_max_l1_one_barrier(amax, s_red);  // its barrier also completes s_h
    } else {
        amax = block_max(amax, s_red);  // also a barrier: s_h is complete
    }
    const float gs = mm::nvfp4_global_scale(amax);
    if (threadIdx.x == 0) h_gs[row] = gs;
    return gs;
}

// The 4 codes of chunk x (x | y << 4 | z << 8 | w << 12) with mm::nvfp4_element's bits, without its IEEE division
// (the rows kernels): the division-free encoder of common/e2m1_thresholds.cuh (7 thresholds per lane from
// `scale`, then a 3-compare binary search per element), falling back to mm::nvfp4_element itself wherever that
// encoder's identities do not hold or its result could differ. Why each case gives nvfp4_element's code:
// * fast path: 2^-100 <= scale <= 2^100 (so scale > 0, finite, and the FMA thresholds are the exact ones:
//   e2m1_thresholds_fma's comment) and no element is NaN. Then for each element x:
//   - x finite: e2m1_code_thr = e2m1_encode(fl(x / scale)) by the identities above e2m1_code_thr (any finite f32
//     x, subnormals included; __fdiv_rn is the correctly rounded division they assume).
//   - x = +-inf: fl(+-inf / scale) = +-inf, e2m1_encode -> 7 | sign. e2m1_code_thr: every threshold is finite
//     (<= nextup(RD32(5.0000003 * 2^100))), so a = +inf >= all 7 -> magnitude 7, sign bit 3 from x -> 7 | sign.
//   - x = +-0: e2m1_encode(+-0) = 0 | sign (its `neg` keeps -0); e2m1_code_thr: 0 < b[0] = nextup(...) >= 2^-149
//     -> magnitude 0, sign bit from x -> the same.
// * scale == 0: nvfp4_element returns code 0 for every x (no sign: e2m1_code_thr would keep the sign of -0 and
//   negative x) -> fallback.
// * scale NaN, +-inf, negative, or > 0 outside [2^-100, 2^100] (rows with amax below ~2^-88 or above ~2^111; the
//   FMA form would lose bits there): fallback (rare: the division itself is the reference).
// * some x NaN: e2m1_encode(NaN) = 7 (every ladder compare false, sign dropped by its !isnan) but e2m1_code_thr
//   gives 0 | sign (every `a >= b` false) -> the whole chunk falls back.
// The fast path has no branch; the one branch per chunk picks it (lane-divergent only where a chunk holds a NaN).
__device__ __forceinline__ uint32_t nvfp4_codes4_thr(const float4 x, float scale) {
    const bool any_nan = isnan(x.x) || isnan(x.y) || isnan(x.z) || isnan(x.w);
    if (e2m1_thresholds_fma_scale_in_range(scale) && !any_nan) {
        const E2m1Thresholds thr = e2m1_thresholds_fma_in_range(scale);
        return e2m1_code_thr(x.x, thr) | e2m1_code_thr(x.y, thr) << 4 | e2m1_code_thr(x.z, thr) << 8 |
               e2m1_code_thr(x.w, thr) << 12;
    }
    return (uint32_t)mm::nvfp4_element(x.x, scale) | (uint32_t)mm::nvfp4_element(x.y, scale) << 4 |
           (uint32_t)mm::nvfp4_element(x.z, scale) << 8 | (uint32_t)mm::nvfp4_element(x.w, scale) << 12;
}

// NVFP4 quantization of chunk c = h elements 4c..4c+3 (x) of a row with global scale gs: the 4 lanes of the chunk's
// 16-block (lanes 4*(lane/4) + 0..3, all named in `mask`) share the block amax by two xor-shuffles; the lane with
// c % 4 == 0 stores the block scale byte, every lane its 2 code bytes (the rules are in the comment of
// the comment below finish_l1_nvfp4_q4_pass). One source for the q4 pass and the rows kernels. kThresholdEncoder:
// the codes by nvfp4_codes4_thr (the same bits) instead of 4 x mm::nvfp4_element.
template <bool kThresholdEncoder = false>
__device__ __forceinline__ void nvfp4_quant_chunk4(const float4 x, float gs, unsigned mask, int c,
                                                   uint8_t* __restrict__ codes_row, uint8_t* __restrict__ scales_row) {
    float bmax = fmaxf(fmaxf(0.f, fmaxf(fabsf(x.x), fabsf(x.y))), fmaxf(fabsf(x.z), fabsf(x.w)));
    bmax = fmaxf(bmax, __shfl_xor_sync(mask, bmax, 1));
    bmax = fmaxf(bmax, __shfl_xor_sync(mask, bmax, 2));
    const uint8_t sc = mm::nvfp4_block_scale(bmax, gs);
    const float scale = __fmul_rn(mm::e4m3_decode(sc), gs);
    if ((c & 3) == 0) scales_row[c >> 2] = sc;
    uint32_t q;
    if constexpr (kThresholdEncoder) {
        q = nvfp4_codes4_thr(x, scale);
    } else {
        q = (uint32_t)mm::nvfp4_element(x.x, scale) | (uint32_t)mm::nvfp4_element(x.y, scale) << 4 |
            (uint32_t)mm::nvfp4_element(x.z, scale) << 8 | (uint32_t)mm::nvfp4_element(x.w, scale) << 12;
    }
    *reinterpret_cast<uint16_t*>(codes_row + 2 * c) = (uint16_t)q;
}

// Pass 2 of the q4 finish (and of the candidates built on it): NVFP4 quantization of the h row in s_h with global
// scale gs, 4 elements per thread (the rules are in the comment below it).
__device__ __forceinline__ void finish_l1_nvfp4_q4_pass(const float* s_h, int I, float gs, int row,
                                                        uint8_t* __restrict__ h_codes, uint8_t* __restrict__ h_scales) {
    const int chunks = I / 4;
    const int lane = threadIdx.x & 31;
    uint8_t* codes_row = h_codes + (size_t)row * (I / 2);
    uint8_t* scales_row = h_scales + (size_t)row * (I / 16);
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        const int lanes_in = min(32, chunks - (c - lane));  // >= lane + 1 >= 1, a multiple of 4 (above)
        const unsigned mask = lanes_in == 32 ? 0xffffffffu : (1u << lanes_in) - 1u;
        nvfp4_quant_chunk4(*reinterpret_cast<const float4*>(s_h + 4 * c), gs, mask, c, codes_row, scales_row);
    }
}

// Why finish_l1_nvfp4_q4_pass (pass 2 of the per-row finish) equals the one-block-per-thread CPU quantizer (h, h_out
// and gs come from pass 1): every thread quantizes 4 consecutive elements (chunk c = elements 4c..4c+3, one
// conflict-free float4 load) and the 4 lanes of one 16-block cooperate:
// * lane <-> chunk: c = threadIdx.x + k * blockDim.x with blockDim.x % 32 == 0 (launcher: 512), so c % 32 == lane
//   and the 4 chunks of 16-block b = c / 4 (c % 4 = 0..3) sit on the 4 consecutive lanes 4*(lane/4) + 0..3 of one
//   warp; xor 1 and xor 2 stay inside that group.
// * block amax: _vec computes max(0, |x_0|, ..., |x_15|) by a chain of fmaxf from 0. fmaxf of non-NaN values is
//   the exact maximum, independent of order and grouping, and fmaxf(a, NaN) = a, so max(0, own 4) then two
//   xor-shuffle fmaxf gives the same bits (the leading 0 keeps even an all-NaN chunk at the _vec value).
// * the block scale byte and `scale` are the same functions of (bmax, gs), so the same bits on all 4 lanes; each
//   element goes through the same mm::nvfp4_element(x, scale).
// * packing: _vec stores element 16b + i at code byte 8b + i/2, low nibble for even i (uint2, little-endian).
//   Element 4c + i (i = 0..3) is 16b + 4(c%4) + i, i.e. byte 8b + 2(c%4) + i/2 = 2c + i/2: the little-endian
//   uint16 (x0 | x1 << 4 | x2 << 8 | x3 << 12) at byte 2c (2-byte aligned: the row base is I/2, a multiple of 8).
// * the scale byte of block b is stored once, by the lane with c % 4 == 0.
// * shuffle mask: lane l is in iteration k iff c_l = c - lane + l < I/4, a prefix of the warp of
//   min(32, I/4 - (c - lane)) lanes. I % 16 == 0 makes I/4 a multiple of 4 and c - lane is a multiple of 32, so the
//   prefix length is a multiple of 4: the 4 lanes of a 16-block are all in the loop or all out (I > 4 * blockDim.x,
//   e.g. Pro I = 3072, takes a second, partly filled iteration), and the mask names exactly the lanes present.
// ---- The decode L1 finish with direct padding rows (FinishL1Kernel::PerRow) --------------------------------------
// In the masked layout almost every finish CTA runs on a padding row (expert_of_row(row) < 0): at 1 token 250 of
// Flash's 256 rows (378 of Pro's 384), at 8 / 64 tokens ~94% / ~75% of rows_total = experts * max count. The q4
// finish still runs both passes on them: h = 0 into s_h (and h_out), the block_max barriers, then pass 2 on zeros.
// At 2 CTAs per SM (61 registers x 512 threads) those CTAs fill whole waves from 384 rows on (Pro 1 token, Flash
// 8 and 64 tokens) and delay the real rows' CTAs of later waves.
//
// What q4 writes for a padding row (e < 0), step by step (h = +0 everywhere: h[i] starts as 0.f and e < 0 skips
// the SwiGLU):
// * h_out (if requested): I floats +0 (bits 0x00000000).
// * pass 1: amax = fmaxf(0.f, |+0| ...) = +0 in every thread; block_max folds the 16 slots from 0.f: +0.
//   gs = mm::nvfp4_global_scale(+0) = 1.0f (amax == 0 branch); h_gs[row] = 1.0f (0x3f800000).
// * pass 2: bmax = +0; sc = mm::nvfp4_block_scale(+0, 1.0f) = e4m3_encode(__fdiv_rn(+0, 6.f)) = e4m3(+0) = 0x00;
//   scale = __fmul_rn(mm::e4m3_decode(0x00), 1.0f) = +0; mm::nvfp4_element(+0, +0) = 0 (scale == 0 branch).
//   So every code byte is 0x00 (nibbles 0 | 0 << 4) and every block scale byte 0x00.
// finish_l1_write_padding_row writes exactly these bytes, computed by the same device functions on the same inputs
// (+0 amax, +0 block max, +0 element) rather than hard-coded, with no shared memory, no barrier and no reduction.
__device__ __forceinline__ void finish_l1_write_padding_row(int row, int I, uint8_t* __restrict__ h_codes,
                                                            uint8_t* __restrict__ h_scales, float* __restrict__ h_gs,
                                                            float* __restrict__ h_out) {
    const float gs = mm::nvfp4_global_scale(0.f);                 // row amax +0 -> 1.0f
    const uint8_t sc = mm::nvfp4_block_scale(0.f, gs);            // block amax +0 -> 0x00
    const float scale = __fmul_rn(mm::e4m3_decode(sc), gs);      // +0
    const uint32_t code = mm::nvfp4_element(0.f, scale);          // element +0 -> 0
    const uint32_t code_byte = code | code << 4;                  // two elements per byte, low nibble first
    const uint32_t code_word = code_byte * 0x01010101u;           // the byte in all 4 lanes of a word
    const uint32_t scale_word = (uint32_t)sc * 0x01010101u;
    if (threadIdx.x == 0) h_gs[row] = gs;
    // Codes: I / 2 bytes per row, I % 16 == 0 (launcher) -> the row base (row * I / 2) is a multiple of 8: uint2.
    uint2* codes_row = reinterpret_cast<uint2*>(h_codes + (size_t)row * (I / 2));
    for (int i = threadIdx.x; i < I / 16; i += blockDim.x) codes_row[i] = make_uint2(code_word, code_word);
    // Block scales: I / 16 bytes per row; 4-byte stores when I % 64 == 0 (row base a multiple of 4: Flash 2048,
    // Pro 3072), bytes otherwise.
    uint8_t* scales_row = h_scales + (size_t)row * (I / 16);
    if ((I & 63) == 0) {
        for (int i = threadIdx.x; i < I / 64; i += blockDim.x) reinterpret_cast<uint32_t*>(scales_row)[i] = scale_word;
    } else {
        for (int i = threadIdx.x; i < I / 16; i += blockDim.x) scales_row[i] = sc;
    }
    // h: I % 4 == 0 -> float4 stores of +0 (the quantization pass stores make_float4(h[0..3]) with h = 0.f).
    if (h_out != nullptr) {
        float4* h_row = reinterpret_cast<float4*>(h_out + (size_t)row * I);
        for (int i = threadIdx.x; i < I / 4; i += blockDim.x) h_row[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

// The per-row finish: a padding row (uniform per CTA: the whole block returns, so no barrier is left half-reached)
// takes finish_l1_write_padding_row; a real row runs SwiGLU to shared memory, the one-barrier row amax
// (block_max_l1_one_barrier) and the four-elements-per-lane quantization pass (finish_l1_nvfp4_q4_pass).
__device__ __forceinline__ void finish_l1_pad_body(
    const float* __restrict__ partial, int splits, const int* group, int capacity, int experts, int rows_total, int I,
    const float* __restrict__ gsa, const float* __restrict__ gsb, const float* __restrict__ routing,
    uint8_t* __restrict__ h_codes, uint8_t* __restrict__ h_scales, float* __restrict__ h_gs, float* __restrict__ h_out,
    float* s_h, float* s_red) {
    Grouping grp{group, capacity, experts, rows_total};
    const int row = blockIdx.x;
    const int e = grp.expert_of_row(row);  // one grouping load, reused by pass 1
    if (e < 0) {
        finish_l1_write_padding_row(row, I, h_codes, h_scales, h_gs, h_out);
        return;
    }
    const float gs = finish_l1_swiglu_to_smem<true>(partial, splits, grp, rows_total, I, gsa, gsb, routing, h_gs, h_out,
                                                    s_h, s_red, e);
    finish_l1_nvfp4_q4_pass(s_h, I, gs, row, h_codes, h_scales);
}

extern "C" __global__ void __launch_bounds__(kFinishL1Threads) moe_gemm_finish_l1_per_row(
    const float* __restrict__ partial, int splits, const int* group, int capacity, int experts, int rows_total, int I,
    const float* __restrict__ gsa, const float* __restrict__ gsb, const float* __restrict__ routing,
    uint8_t* __restrict__ h_codes, uint8_t* __restrict__ h_scales, float* __restrict__ h_gs, float* __restrict__ h_out) {
    extern __shared__ float s_h[];
    __shared__ __align__(16) float s_red[32];  // block_max_l1_one_barrier reads the 16 slots as float4
    finish_l1_pad_body(partial, splits, group, capacity, experts, rows_total, I, gsa, gsb, routing, h_codes,
                             h_scales, h_gs, h_out, s_h, s_red);
}

// ---- The prefill L1 finish: the rows design (FinishL1Kernel::Rows builds on it, below) ---------------------------
// Why not the per-row finish at prefill sizes (Flash 4096 tokens, 24,576 rows): it runs one CTA per
// row; every CTA walks a chain of dependent memory steps before its math (the contiguous expert lookup, a binary
// search of ~8 dependent loads; gsa / routing; the row's 16 KB of partials; then gsb, which ptxas loads after the
// split loop's adds), then SwiGLU, a 512-thread barrier, the quantization, and exits. At 2 CTAs per SM only
// 2 x 16 KB of partials per SM are ever requested, and only during one phase of each CTA's life.
// Here:
// * grid = ceil(rows_total / rows_per_cta) CTAs of 256 threads, CTA b owns the contiguous rows
//   [b * rows_per_cta, ...) (rows_per_cta <= 256: the launcher picks one wave of resident CTAs). The expert, gsa and
//   routing weight of the CTA's rows are looked up once, thread t for row t, into shared memory (one barrier).
// * thread t owns the chunks c = t + 256 k (k < KC, c < I / 4) of every row: h columns 4c..4c+3, i.e. the float4 of
//   gate columns [4c, 4c+4) and of up columns [I+4c, I+4c+4). Split 0 of those 2 x KC float4 is copied by cp.async
//   into a per-thread slot of a shared ring of kStages rows, kStages - 1 rows ahead of the row being computed; a
//   thread reads back only the 16-byte units it copied itself, so cp.async.wait_group alone orders the ring (no
//   barrier). Splits 1.. (decode) are loaded directly when the row is computed (correct, not prefetched).
// * gsb of the current expert stays in registers (reloaded when the CTA-uniform expert changes: rows of one expert
//   are contiguous in the prefill layout).
// * h stays in registers (no shared h row); the row amax takes one barrier per row: row i's per-warp slots are
//   s_red[i & 1]. A thread writes the same parity again for row i + 2 only after passing row i + 1's barrier, which
//   every thread reaches only after it has read row i's slots, so no second barrier is needed.
// Bit-identical to the per-row finish (the same fp32 operations on the same values):
// * split sums: acc = +0 + p_0 + p_1 + ... in split order, component-wise (reduce_splits4_gate_up's order).
// * h: l1_swiglu_h, the function of pass 1, with the same sa (gsa[row], 1 without gsa), gsb and routing weight.
//   A row owned by no expert gets h = +0 (pass 1: h[i] = 0.f); its quantization then yields the per-row finish's bytes for an
//   all-zero row (codes 0, block scales 0, gs 1.0: the derivation at finish_l1_write_padding_row).
// * row amax: each thread folds fmaxf(amax, max4 |h|) from amax = 0 as pass 1 does; the block maximum of non-NaN
//   values >= +0 is one well-defined float whatever the grouping (block_max_l1_one_barrier's comment), so gs =
//   mm::nvfp4_global_scale(amax) has the same bits.
// * quantization: nvfp4_quant_chunk4, the function of the per-row quantization pass, on the same chunk <-> lane mapping
//   (blockDim % 32 == 0, so c % 32 == lane and a 16-block's 4 chunks sit on 4 consecutive lanes; the shuffle mask
//   is the same prefix argument with 256 for 512 threads: the lanes of a warp with c < I / 4 are a prefix whose
//   length is a multiple of 4).
// Requirements (launcher): I % 16 == 0, I / 4 <= KC * 256, dynamic smem = kStages * KC * 2 * 256 * 16 bytes,
// 1 <= rows_per_cta <= 256 and every CTA owns >= 1 row.
constexpr int kFinishL1RowsThreads = 256;
constexpr int kFinishL1RowsMaxRowsPerCta = kFinishL1RowsThreads;  // one metadata row per thread

// Wait until at most kPending of this thread's cp.async groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait_group() {
    asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// ---- The prefill L1 finish, 8 elements per thread (FinishL1Kernel::Rows: moe_gemm_finish_l1_rows_kc*) -----------
// The rows design with 4 elements per thread (kc2, Flash I = 2048) spends ~94 thread-instructions per element
// (ncu: 147 M warp-instructions for 50.3 M elements), issue-bound. About a third of that is per-16-block work done
// by all 4 lanes of a block (block amax shuffles and their variable-mask convergence code, the block-scale
// division, e4m3 round trip, the 7 thresholds and their range check: ~60 per 4-element chunk). Here:
// * a thread owns 8 elements of a 16-block instead of 4: pair p = tid + 256 j (j < KP = ceil(KC / 2)) of a row
//   is block b = p / 2, quarters (chunks) q = p % 2 and q + 2, i.e. units 4b + q and 4b + q + 2 (unit = 4 h
//   columns = one float4 of gate and one of up). The pair of lanes (p, p ^ 1) holds the whole block: one xor-1
//   shuffle, and the block scale and thresholds are computed once per 8 elements instead of once per 4.
//   Quarters q and q + 2 (not 2q, 2q + 1) so that every cp.async instruction of a warp copies whole 32-byte sectors
//   (units 4b + q for q = 0, 1 are 32 contiguous bytes).
// * splits == 1 (prefill) is a template branch: split 0's `0 + p` and the scale product are one FFMA (identity at
//   finish_l1_rows2_swiglu), and the split loop is gone from that path.
// * the shuffle mask is the full warp (no per-iteration mask / convergence code): a warp whose first pair is in
//   the row runs the quantization on all lanes (lanes past the row carry h = 0 and store nothing).
// Bit-identical to the 4-elements-per-thread rows design (and so to the per-row finish), per output:
// * h, h_out, row amax, gs: l1_swiglu_h (or its tail, finish_l1_rows2_swiglu) on the same split sums / scales, the
//   same fmaxf fold (order-free on non-NaN values >= 0; block_max_l1_one_barrier's comment) and mm::nvfp4_global_scale.
// * block amax: max(0, 16 |h|) of one block; fmaxf on non-NaN values is exact and order-free, fmaxf(a, NaN) = a, so
//   max(0, own 8) then one xor-1 fmaxf is the 4-element form's max(0, own 4) then two shuffles. Lanes p and p ^ 1 share b
//   (p - lane and 256 j are multiples of 32); pairs = I / 8 is even (I % 16 == 0), so both are in the row or both
//   out, and an out-of-row lane never feeds an in-row one.
// * block scale byte, scale: the same functions of (bmax, gs) as nvfp4_quant_chunk4.
// * codes: nvfp4_codes8_thr = nvfp4_codes4_thr on each quarter (its comment); stored at byte 2 * unit like
//   the 4-element form's chunk c = unit; the scale byte of block b by the lane with p even.
// Ring: own-copy (a thread reads back only what it copied; cp.async.wait_group orders it), unit slot
// (k = 2 j + hh, g) of thread tid at [((slot * KU + k) * 2 + g) * 256 + tid] (conflict-free). Dynamic smem =
// kStages * KU * 2 * 256 * 16 bytes (launcher: FinishL1RowsKind). Requirements as the rows design above.

template <bool B>
struct BoolConst {
    static constexpr bool value = B;
};

// The codes of two chunks x0, x1 of one 16-block with block scale `scale`: nvfp4_codes4_thr(x0, scale) and
// nvfp4_codes4_thr(x1, scale), with its range / NaN check and its 7 thresholds (functions of scale alone) done
// once. When the check passes for all 8 elements both calls would take the fast path with these same thresholds;
// otherwise each half goes through nvfp4_codes4_thr itself (which re-checks its own 4 elements). Same bits.
__device__ __forceinline__ void nvfp4_codes8_thr(const float4 x0, const float4 x1, float scale, uint32_t& q0,
                                                 uint32_t& q1) {
    const bool any_nan = isnan(x0.x) || isnan(x0.y) || isnan(x0.z) || isnan(x0.w) || isnan(x1.x) || isnan(x1.y) ||
                         isnan(x1.z) || isnan(x1.w);
    if (e2m1_thresholds_fma_scale_in_range(scale) && !any_nan) {
        const E2m1Thresholds thr = e2m1_thresholds_fma_in_range(scale);
        q0 = e2m1_code_thr(x0.x, thr) | e2m1_code_thr(x0.y, thr) << 4 | e2m1_code_thr(x0.z, thr) << 8 |
             e2m1_code_thr(x0.w, thr) << 12;
        q1 = e2m1_code_thr(x1.x, thr) | e2m1_code_thr(x1.y, thr) << 4 | e2m1_code_thr(x1.z, thr) << 8 |
             e2m1_code_thr(x1.w, thr) << 12;
        return;
    }
    q0 = nvfp4_codes4_thr(x0, scale);
    q1 = nvfp4_codes4_thr(x1, scale);
}

// h of one column for splits == 1 with the products fused: returns l1_swiglu_h(0.f + p_g, 0.f + p_u, sa, scg, scu,
// rw) bit for bit when mg = fl(sa * scg) and mu = fl(sa * scu) are each > 0 or NaN (the caller's check).
// l1_swiglu_h forms gte = (0.f + p) * m; here gte = fma(p, m, +0) (one rounding of p * m + 0). For m > 0 (incl.
// +inf, subnormal) and any p:
// * p = +-0: 0 + p = +0, (+0) * m = +0 (m finite) or NaN (m = inf); fma: p * m = +-0 (or NaN), +-0 + +0 = +0 in
//   round-to-nearest (or NaN). Same.
// * p finite != 0: 0 + p = p exactly; the exact p * m is != 0, so adding +0 changes nothing and both round the same
//   real once: fl(p * m). Same.
// * p = +-inf or NaN: +-inf or NaN in both.
// For m NaN both are NaN. NaN bits never reach h: fminf(NaN, 10) = 10 and fmaxf(NaN, -10) = -10 in the tail.
// The check (caller): sa >= 2^-64 and every scale of the thread's columns >= 2^-64 (fminf ignores NaN scales, which
// are fine) gives m >= fl(2^-128) > 0 or m = +inf / NaN. Otherwise (or splits > 1) the caller takes l1_swiglu_h.
__device__ __forceinline__ float l1_swiglu_h_fused1(float pg, float pu, float sa, float scg, float scu, float rw) {
    return l1_swiglu_h_tail(__fmaf_rn(pg, __fmul_rn(sa, scg), 0.f), __fmaf_rn(pu, __fmul_rn(sa, scu), 0.f), rw);
}

template <int KC, int kStages, bool kOneSplit>
__device__ __forceinline__ void finish_l1_rows2_body(
    const float* __restrict__ partial, int splits, const int* group, int capacity, int experts, int rows_total, int I,
    const float* __restrict__ gsa, const float* __restrict__ gsb, const float* __restrict__ routing,
    uint8_t* __restrict__ h_codes, uint8_t* __restrict__ h_scales, float* __restrict__ h_gs, float* __restrict__ h_out,
    int rows_per_cta, float4* s_meta, float (*s_red)[kFinishL1RowsThreads / 32]) {
    constexpr int KP = (KC + 1) / 2;  // pairs per thread and row
    constexpr int KU = 2 * KP;        // units per thread and row (k = 2 j + hh)
    constexpr int T = kFinishL1RowsThreads;
    extern __shared__ uint4 s_ring[];  // [kStages][KU][2 (gate, up)][256] 16-byte units
    // s_meta[i]: row metadata, one 16-byte load per row: (expert as int bits, sa, routing weight, unused).
    // s_red[2][8]: per-warp amax, by row parity (the rows design's comment above). Both from the entry (declared there once, not
    // per instantiation of this body: the entry holds two).
    static_assert(T / 32 == 8, "2 float4 slots per parity");
    const int tid = threadIdx.x, lane = tid & 31;
    const int N = 2 * I, pairs = I / 8;
    const int first = blockIdx.x * rows_per_cta;
    const int nrows = min(rows_per_cta, rows_total - first);  // >= 1 (launcher grid)
    const Grouping grp{group, capacity, experts, rows_total};
    if (tid < nrows) {
        const int row = first + tid;
        const int e = grp.expert_of_row(row);
        s_meta[tid] = make_float4(__int_as_float(e), (gsa != nullptr && e >= 0) ? gsa[row] : 1.f,
                                  e >= 0 ? routing[row] : 0.f, 0.f);
    }
    // Pair j of this thread: p = tid + 256 j, units u0(j) = 4 (p >> 1) + (p & 1) and u0(j) + 2. As 256 j is even,
    // u0(j) = u0(0) + 512 j: every unit of the thread is at a compile-time offset 4 * (512 j + 2 hh) floats from
    // column 4 u0(0) (gate; up at + I), which the running row pointers below use.
    const int u00 = 4 * (tid >> 1) + (tid & 1);
    auto pair_in = [&](int j) { return tid + j * T < pairs; };
    // Copies split 0 of one row (src_row = partial + row * N + 4 u00) into ring slot `slot`; one commit group per
    // call, empty or not (uniform wait counts).
    auto issue = [&](const float* src_row, int slot, bool take) {
        if (take) {
            uint4* dst = s_ring + (size_t)slot * KU * 2 * T + tid;
#pragma unroll
            for (int j = 0; j < KP; ++j) {
                if (pair_in(j)) {
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        const int k = 2 * j + hh, off = 4 * (512 * j + 2 * hh);
                        cp_async_16(dst + (2 * k) * T, src_row + off);
                        cp_async_16(dst + (2 * k + 1) * T, src_row + I + off);
                    }
                }
            }
        }
        cp_async_commit();
    };
    const float* src_thr = partial + (size_t)first * N + 4 * u00;
    // The first kStages - 1 rows are copied before their experts are known (the rows design's comment above).
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) issue(src_thr + (size_t)i * N, i, i < nrows);
    __syncthreads();  // s_meta
    int e_cur = -1;
    float4 sg[KU], su[KU];     // gsb of expert e_cur at the thread's units (gate, up)
    float gsb_min = INFINITY;  // fminf of those (NaN ignored): the fused-product check
#pragma unroll
    for (int k = 0; k < KU; ++k) sg[k] = su[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    const size_t split_stride = (size_t)rows_total * N;
    // Running per-row pointers / ring slots (row i: slot i % kStages; the issued row i + kStages - 1).
    const float* src_issue = src_thr + (size_t)(kStages - 1) * N;
    int slot_issue = kStages - 1, slot_read = 0;
    uint8_t* codes_thr = h_codes + (size_t)first * (I / 2) + 2 * u00;  // code byte of unit u00 of the row
    uint8_t* scales_thr = h_scales + (size_t)first * (I / 16) + (tid >> 1);  // block scale of pair 0's block
    for (int i = 0; i < nrows; ++i) {
        const int ia = i + kStages - 1;
        issue(src_issue, slot_issue, ia < nrows && __float_as_int(s_meta[min(ia, nrows - 1)].x) >= 0);
        src_issue += N;
        slot_issue = slot_issue + 1 == kStages ? 0 : slot_issue + 1;
        cp_async_wait_group<kStages - 1>();  // this thread's copies of row i have landed
        const int row = first + i;
        const float4 meta = s_meta[i];
        const int e = __float_as_int(meta.x);
        const float sa = meta.y, rw = meta.z;
        if (e >= 0 && e != e_cur) {  // CTA-uniform
            e_cur = e;
            gsb_min = INFINITY;
            const float* gsb_thr = gsb + (size_t)e * N + 4 * u00;
#pragma unroll
            for (int j = 0; j < KP; ++j) {
                if (pair_in(j)) {
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        const int k = 2 * j + hh, off = 4 * (512 * j + 2 * hh);
                        sg[k] = *reinterpret_cast<const float4*>(gsb_thr + off);
                        su[k] = *reinterpret_cast<const float4*>(gsb_thr + I + off);
                        gsb_min = fminf(gsb_min, fminf(fminf(fminf(sg[k].x, sg[k].y), fminf(sg[k].z, sg[k].w)),
                                                       fminf(fminf(su[k].x, su[k].y), fminf(su[k].z, su[k].w))));
                    }
                }
            }
        }
        const uint4* slot = s_ring + (size_t)slot_read * KU * 2 * T + tid;
        slot_read = slot_read + 1 == kStages ? 0 : slot_read + 1;
        float4 h[KU];
#pragma unroll
        for (int k = 0; k < KU; ++k) h[k] = make_float4(0.f, 0.f, 0.f, 0.f);
        // h of the thread's units; kFused: the FFMA form (l1_swiglu_h_fused1's identity), else l1_swiglu_h on
        // 0 + p_0 + p_1 + ... (the rows design's split order).
        auto swiglu_units = [&](auto fused_tag) {
            constexpr bool kFused = decltype(fused_tag)::value;
#pragma unroll
            for (int j = 0; j < KP; ++j) {
                if (pair_in(j)) {
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        const int k = 2 * j + hh;
                        const uint4 pg0 = slot[(2 * k) * T];
                        const uint4 pu0 = slot[(2 * k + 1) * T];
                        if constexpr (kFused) {
                            h[k].x = l1_swiglu_h_fused1(__uint_as_float(pg0.x), __uint_as_float(pu0.x), sa, sg[k].x,
                                                        su[k].x, rw);
                            h[k].y = l1_swiglu_h_fused1(__uint_as_float(pg0.y), __uint_as_float(pu0.y), sa, sg[k].y,
                                                        su[k].y, rw);
                            h[k].z = l1_swiglu_h_fused1(__uint_as_float(pg0.z), __uint_as_float(pu0.z), sa, sg[k].z,
                                                        su[k].z, rw);
                            h[k].w = l1_swiglu_h_fused1(__uint_as_float(pg0.w), __uint_as_float(pu0.w), sa, sg[k].w,
                                                        su[k].w, rw);
                        } else {
                            float4 ag = make_float4(0.f, 0.f, 0.f, 0.f), au = ag;
                            ag.x += __uint_as_float(pg0.x); ag.y += __uint_as_float(pg0.y);
                            ag.z += __uint_as_float(pg0.z); ag.w += __uint_as_float(pg0.w);
                            au.x += __uint_as_float(pu0.x); au.y += __uint_as_float(pu0.y);
                            au.z += __uint_as_float(pu0.z); au.w += __uint_as_float(pu0.w);
                            if constexpr (!kOneSplit) {
                                const int off = 4 * (512 * j + 2 * hh);
                                for (int s = 1; s < splits; ++s) {
                                    const float* src = partial + s * split_stride + (size_t)row * N + 4 * u00 + off;
                                    const float4 pg = *reinterpret_cast<const float4*>(src);
                                    const float4 pu = *reinterpret_cast<const float4*>(src + I);
                                    ag.x += pg.x; ag.y += pg.y; ag.z += pg.z; ag.w += pg.w;
                                    au.x += pu.x; au.y += pu.y; au.z += pu.z; au.w += pu.w;
                                }
                            }
                            h[k].x = l1_swiglu_h(ag.x, au.x, sa, sg[k].x, su[k].x, rw);
                            h[k].y = l1_swiglu_h(ag.y, au.y, sa, sg[k].y, su[k].y, rw);
                            h[k].z = l1_swiglu_h(ag.z, au.z, sa, sg[k].z, su[k].z, rw);
                            h[k].w = l1_swiglu_h(ag.w, au.w, sa, sg[k].w, su[k].w, rw);
                        }
                    }
                }
            }
        };
        if (e >= 0) {
            // Per thread (gsb_min) and row (sa); uniform in practice. The NaN-false compares send NaN sa / an
            // all-NaN gsb_min to the unfused form (also exact).
            if (kOneSplit && sa >= 0x1p-64f && gsb_min >= 0x1p-64f) {
                swiglu_units(BoolConst<true>{});
            } else {
                swiglu_units(BoolConst<false>{});
            }
        }
        // own8[j] = max(0, |h| of pair j's 8 elements): both the thread's share of the row amax (the per-row finish folds
        // fmaxf(amax, max4 |h|) from 0 over the same values: the same maximum, order-free) and its share of the
        // block amax below. Pairs past the row have h = +0, own8 = +0, which changes neither maximum.
        float own8[KP];
        float amax = 0.f;
#pragma unroll
        for (int j = 0; j < KP; ++j) {
            const float4 x0 = h[2 * j], x1 = h[2 * j + 1];
            own8[j] = fmaxf(fmaxf(0.f, fmaxf(fmaxf(fabsf(x0.x), fabsf(x0.y)), fmaxf(fabsf(x0.z), fabsf(x0.w)))),
                            fmaxf(fmaxf(fabsf(x1.x), fabsf(x1.y)), fmaxf(fabsf(x1.z), fabsf(x1.w))));
            amax = fmaxf(amax, own8[j]);
            if (h_out != nullptr && pair_in(j)) {
                float* hrow = h_out + (size_t)row * I + 4 * u00 + 4 * 512 * j;
                *reinterpret_cast<float4*>(hrow) = x0;
                *reinterpret_cast<float4*>(hrow + 8) = x1;
            }
        }
        // Row amax: warp tree, then the 8 warp slots of this row's parity (one barrier; the rows design's header above).
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        float* red = s_red[i & 1];
        if (lane == 0) red[tid >> 5] = amax;
        __syncthreads();
        const float4 ra = reinterpret_cast<const float4*>(red)[0], rb = reinterpret_cast<const float4*>(red)[1];
        amax = fmaxf(0.f, fmaxf(fmaxf(fmaxf(ra.x, ra.y), fmaxf(ra.z, ra.w)), fmaxf(fmaxf(rb.x, rb.y), fmaxf(rb.z, rb.w))));
        const float gs = mm::nvfp4_global_scale(amax);
        if (tid == 0) h_gs[row] = gs;
#pragma unroll
        for (int j = 0; j < KP; ++j) {
            const int p = tid + j * T;
            if (p - lane < pairs) {  // warp-uniform: every lane takes the full-mask shuffle
                const float bmax = fmaxf(own8[j], __shfl_xor_sync(0xffffffffu, own8[j], 1));
                const uint8_t sc = mm::nvfp4_block_scale(bmax, gs);
                const float scale = __fmul_rn(mm::e4m3_decode(sc), gs);
                uint32_t q0, q1;
                nvfp4_codes8_thr(h[2 * j], h[2 * j + 1], scale, q0, q1);  // +0 on lanes past the row
                if (p < pairs) {
                    // unit u0(j) = u00 + 512 j: code bytes 2 u0(j) and 2 (u0(j) + 2); block (p >> 1) = (tid >> 1) + 128 j.
                    if ((tid & 1) == 0) scales_thr[128 * j] = sc;
                    *reinterpret_cast<uint16_t*>(codes_thr + 1024 * j) = (uint16_t)q0;
                    *reinterpret_cast<uint16_t*>(codes_thr + 1024 * j + 4) = (uint16_t)q1;
                }
            }
        }
        codes_thr += I / 2;
        scales_thr += I / 16;
    }
}

// The rows entries: the splits == 1 path is its own instantiation inside the entry (CTA-uniform branch).
#define MOE_FINISH_L1_ROWS_THR2(KC, STAGES, MINB)                                                                    \
    extern "C" __global__ void __launch_bounds__(kFinishL1RowsThreads, MINB) moe_gemm_finish_l1_rows_kc##KC( \
        const float* __restrict__ partial, int splits, const int* group, int capacity, int experts, int rows_total,   \
        int I, const float* __restrict__ gsa, const float* __restrict__ gsb, const float* __restrict__ routing,       \
        uint8_t* __restrict__ h_codes, uint8_t* __restrict__ h_scales, float* __restrict__ h_gs,                      \
        float* __restrict__ h_out, int rows_per_cta) {                                                                \
        __shared__ float4 s_meta[kFinishL1RowsMaxRowsPerCta];                                                         \
        __shared__ __align__(16) float s_red[2][kFinishL1RowsThreads / 32];                                           \
        if (splits == 1) {                                                                                            \
            finish_l1_rows2_body<KC, STAGES, true>(partial, splits, group, capacity, experts, rows_total, I, gsa, gsb, \
                                                   routing, h_codes, h_scales, h_gs, h_out, rows_per_cta, s_meta,     \
                                                   s_red);                                                            \
        } else {                                                                                                      \
            finish_l1_rows2_body<KC, STAGES, false>(partial, splits, group, capacity, experts, rows_total, I, gsa,    \
                                                    gsb, routing, h_codes, h_scales, h_gs, h_out, rows_per_cta,       \
                                                    s_meta, s_red);                                                   \
        }                                                                                                             \
    }
// (KC, ring stages, CTAs per SM): FINISH_L1_ROWS_KINDS' thr2_stages / thr2_ctas_per_sm in src/ops/moe_gemm/mod.rs
// must match. KC keeps the rows design's meaning (I / 4 <= KC * 256); ring = stages * ceil(KC / 2) * 16 KB: kc1, kc2
// 4 x 16 KB, kc3, kc4 2 x 32 KB. kc3 (Pro) at 2 CTAs per SM: 16 h + 32 gsb registers per thread need 128 registers
// (held to 80 for 3 CTAs, ptxas spilled 80 bytes: 61 LDL/STL in the loop).
MOE_FINISH_L1_ROWS_THR2(1, 4, 3)
MOE_FINISH_L1_ROWS_THR2(2, 4, 3)
MOE_FINISH_L1_ROWS_THR2(3, 2, 2)
MOE_FINISH_L1_ROWS_THR2(4, 2, 2)

// L2 epilogue: out[tok, n] = bf16( sum_{j < topk, rows[tok, j] >= 0} acc(rows[tok,j], n) * (gsa * gsb) ) with the
// fp32 sum taken in routing order j = 0, 1, ... (deterministic). The routing weight was applied in L1 (DSV4 applies
// it to h before w2). The token's routed rows, experts and gsa are resolved once per CTA into shared memory (topk <=
// kFinishMaxTopk, launcher check). Three kernels (FinishL2Kernel::for_tokens picks one), all with the same fp32
// operations on the same values in the same order per column, so bit-identical outputs (the order of the CPU
// reference):
// * acc of a valid slot j (rows[tok, j] owned by an expert): +0.0 plus its splits in split order (FADD), as
//   reduce_splits;
// * y = fma(acc_j, fl(sa_j * sb_j), y) (__fmul_rn / __fmaf_rn) for the valid j in routing order, from y = +0.0. A
//   slot a kernel masks instead of skipping enters as fma(+0, +0, y) = y + (+0) = y, because y is never -0.0 (it
//   starts at +0.0 and round-to-nearest gives -0 only for (-0) + (-0)); no valid slot leaves y = +0.0;
// * with an addend (a nullable BF16 [tokens, N], the shared expert's output): y = __fadd_rn(y, float(addend[tok, n]))
//   once, after the routed sum (the CPU model's order: the routed experts summed, then the shared expert added);
//   without one y is left as is (no add of +0.0, so the routed-only output keeps its bits);
// * out = bf16(y), round to nearest even (__float2bfloat16_rn, or cvt.rn.bf16x2.f32 per element).
constexpr int kFinishMaxTopk = 32;

// The L2 combines' per-token slot table in shared memory: slot j < topk gets its routed row, the row's expert (-1:
// no expert owns it) and the row's gsa (1 for BF16 activations or an unowned row); ends with a barrier.
__device__ __forceinline__ void stage_token_slots(const Grouping& grp, const float* __restrict__ gsa,
                                                  const int* __restrict__ token_rows, int topk, int tok, int* s_row,
                                                  int* s_exp, float* s_sa) {
    if ((int)threadIdx.x < topk) {
        const int row = token_rows[(size_t)tok * topk + threadIdx.x];
        const int e = grp.expert_of_row(row);
        s_row[threadIdx.x] = row;
        s_exp[threadIdx.x] = e;
        s_sa[threadIdx.x] = (gsa != nullptr && e >= 0) ? gsa[row] : 1.f;
    }
    __syncthreads();
}
// The L2 finish with one warp per routed row (FinishL2Kernel::RowWarps, bench `nvfp4_l2rowwarps` forces it).
// grid = (tokens, ceil(N / 32)), block 256 = 8 warps: in pass j0 warp u owns routed slot j = j0 + u and lane l column
// n = 32 * blockIdx.y + l (coalesced 128-byte loads). A warp's validity is warp-uniform (a branch, not a predicate
// per load); its split loads use clamped addresses (always inside the workspace) so all of them are in flight at
// once (a thread that holds a column's 8 rows x 4 splits, each load and add under its own validity predicate, gets
// them interleaved by ptxas: ~12 dependent L2 round trips at decode sizes). Then warp 0 combines the 8 slots in
// routing order (a clamped load past `splits` is not added; an invalid slot's factors are stored as +0.0).
// kF32Out (moe_gemm_finish_l2_partial_rowwarps, expert parallelism's rank partial, ops::moe_gemm::finish::
// launch_finish_l2_partial): y itself, f32, no addend and no rounding, so bf16(y [+ addend]) is the BF16 entry's output.
template <bool kF32Out>
__device__ __forceinline__ void finish_l2_rowwarps(const float* __restrict__ partial, int splits, const int* group,
                                                   int capacity, int experts, int rows_total, int N,
                                                   const float* __restrict__ gsa, const float* __restrict__ gsb,
                                                   const int* __restrict__ token_rows, int topk,
                                                   const __nv_bfloat16* __restrict__ addend, void* __restrict__ out) {
    constexpr int kSlots = 8, kSplitsPerPass = 8;
    __shared__ int s_row[kFinishMaxTopk];
    __shared__ int s_exp[kFinishMaxTopk];
    __shared__ float s_sa[kFinishMaxTopk];
    __shared__ float s_acc[kSlots][32];
    __shared__ float s_scale[kSlots][32];
    const int tok = blockIdx.x;
    stage_token_slots(Grouping{group, capacity, experts, rows_total}, gsa, token_rows, topk, tok, s_row, s_exp, s_sa);
    const int lane = threadIdx.x & 31, u = threadIdx.x >> 5;
    const int n = blockIdx.y * 32 + lane;
    const bool col_ok = n < N;
    const size_t split_stride = (size_t)rows_total * N;
    float y = 0.f;
    for (int j0 = 0; j0 < topk; j0 += kSlots) {  // topk <= kFinishMaxTopk: j = j0 + u < 32
        const int j = j0 + u;
        float acc = 0.f, scale = 0.f;
        if (j < topk && s_exp[j] >= 0 && col_ok) {  // uniform across the warp except col_ok (last column block)
            const float* src = partial + (size_t)s_row[j] * N + n;
            const float sb = gsb[(size_t)s_exp[j] * N + n];
            for (int s0 = 0; s0 < splits; s0 += kSplitsPerPass) {
                float p[kSplitsPerPass];
#pragma unroll
                for (int v = 0; v < kSplitsPerPass; ++v) p[v] = src[(size_t)min(s0 + v, splits - 1) * split_stride];
#pragma unroll
                for (int v = 0; v < kSplitsPerPass; ++v)
                    if (s0 + v < splits) acc += p[v];
            }
            scale = __fmul_rn(s_sa[j], sb);
        }
        s_acc[u][lane] = acc;
        s_scale[u][lane] = scale;
        __syncthreads();
        if (u == 0) {
#pragma unroll
            for (int k = 0; k < kSlots; ++k) y = __fmaf_rn(s_acc[k][lane], s_scale[k][lane], y);
        }
        __syncthreads();  // s_acc / s_scale are rewritten by the next pass
    }
    if (u == 0 && col_ok) {
        if constexpr (kF32Out) {
            static_cast<float*>(out)[(size_t)tok * N + n] = y;
        } else {
            if (addend != nullptr) y = __fadd_rn(y, __bfloat162float(addend[(size_t)tok * N + n]));
            static_cast<__nv_bfloat16*>(out)[(size_t)tok * N + n] = __float2bfloat16_rn(y);
        }
    }
}
extern "C" __global__ void __launch_bounds__(256) moe_gemm_finish_l2_combine_rowwarps(
    const float* __restrict__ partial, int splits, const int* group, int capacity, int experts, int rows_total, int N,
    const float* __restrict__ gsa, const float* __restrict__ gsb, const int* __restrict__ token_rows, int topk,
    const __nv_bfloat16* __restrict__ addend, __nv_bfloat16* __restrict__ out) {
    finish_l2_rowwarps<false>(partial, splits, group, capacity, experts, rows_total, N, gsa, gsb, token_rows, topk,
                              addend, out);
}
extern "C" __global__ void __launch_bounds__(256) moe_gemm_finish_l2_partial_rowwarps(
    const float* __restrict__ partial, int splits, const int* group, int capacity, int experts, int rows_total, int N,
    const float* __restrict__ gsa, const float* __restrict__ gsb, const int* __restrict__ token_rows, int topk,
    float* __restrict__ out) {
    finish_l2_rowwarps<true>(partial, splits, group, capacity, experts, rows_total, N, gsa, gsb, token_rows, topk,
                             nullptr, out);
}



// The L2 finish with 2 columns per thread and every partial load of a pass in flight (FinishL2Kernel::Cols2; bench
// `nvfp4_l2cols2` forces it). Why: at many tokens the combine is bound by the partials' bytes, and RowWarps spends
// two barriers and a serial combine per 32 columns. Here grid = (tokens, ceil(N / 512)), block 256, thread ->
// columns n0, n0 + 1 (float2 loads of partials and gsb, one 4-byte BF16 store). Warp 0 compacts the token's
// valid slots (routing order kept: position = popc of the valid lanes below) into shared memory, one barrier;
// then per pass of 8 compacted slots every load is unconditional (a slot past the valid count reloads the last
// valid row, is masked to +0.0 and never counted), so the 8 float2 partial loads and 8 gsb loads of a split
// issue together. (With float4, ~120 values live, ptxas issues the loads two at a time next to their adds; with
// float2, 64 registers, the SASS issues all 8 partial loads of a split back to back.)
// Order: the L2 epilogue's (above): acc of a valid slot by FADDs in split order (a masked slot adds +0.0 to +0.0),
// y by __fmul_rn / __fmaf_rn over the compacted slots, i.e. the valid j in routing order.
// Launcher: N % 2 == 0 (8-byte aligned float2 rows of partials and gsb, 4-byte aligned BF16 output).
// The token's valid slots, compacted in routing order by warp 0 (rows, experts, gsa) into shared memory; returns
// their count after a barrier. topk <= kFinishMaxTopk = 32 (launcher).
__device__ __forceinline__ int l2_stage_valid_slots(const Grouping& grp, const float* __restrict__ gsa,
                                                    const int* __restrict__ token_rows, int topk, int tok, int* s_row,
                                                    int* s_exp, float* s_sa, int* s_valid) {
    if (threadIdx.x < 32) {
        const int j = threadIdx.x;
        int row = -1, e = -1;
        if (j < topk) {
            row = token_rows[(size_t)tok * topk + j];
            e = grp.expert_of_row(row);
        }
        const unsigned ballot = __ballot_sync(0xffffffffu, e >= 0);
        if (e >= 0) {
            const int pos = __popc(ballot & ((1u << j) - 1u));
            s_row[pos] = row;
            s_exp[pos] = e;
            s_sa[pos] = gsa != nullptr ? gsa[row] : 1.f;
        }
        if (j == 0) *s_valid = __popc(ballot);
    }
    __syncthreads();
    return *s_valid;
}

// Columns n0, n0 + 1 of token tok from the staged valid slots (the comment above: every load of a pass unconditional).
__device__ __forceinline__ void l2_cols2_columns(const float* __restrict__ partial, int splits, int rows_total, int N,
                                                 const float* __restrict__ gsb, const int* s_row, const int* s_exp,
                                                 const float* s_sa, int valid, int tok, int n0,
                                                 const __nv_bfloat16* __restrict__ addend,
                                                 __nv_bfloat16* __restrict__ out) {
    constexpr int kSlots = 8, kCols = 2;
    const size_t split_stride2 = (size_t)rows_total * N / kCols;  // float2 units (N % 2 == 0)
    float y[kCols] = {0.f, 0.f};
    for (int u0 = 0; u0 < valid; u0 += kSlots) {
        const float2* src[kSlots];
        float2 sb[kSlots];
        unsigned m[kSlots];
        float acc[kSlots][kCols];
#pragma unroll
        for (int u = 0; u < kSlots; ++u) {
            const int uu = min(u0 + u, valid - 1);
            m[u] = u0 + u < valid ? 0xffffffffu : 0u;
            src[u] = reinterpret_cast<const float2*>(partial + (size_t)s_row[uu] * N + n0);
            sb[u] = *reinterpret_cast<const float2*>(gsb + (size_t)s_exp[uu] * N + n0);
            acc[u][0] = 0.f;
            acc[u][1] = 0.f;
        }
        for (int s = 0; s < splits; ++s) {
            float2 p[kSlots];
#pragma unroll
            for (int u = 0; u < kSlots; ++u) p[u] = src[u][(size_t)s * split_stride2];
#pragma unroll
            for (int u = 0; u < kSlots; ++u) {
                acc[u][0] += __uint_as_float(__float_as_uint(p[u].x) & m[u]);
                acc[u][1] += __uint_as_float(__float_as_uint(p[u].y) & m[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < kSlots; ++u) {
            const float sa = s_sa[min(u0 + u, valid - 1)];
            const float sbv[kCols] = {sb[u].x, sb[u].y};
#pragma unroll
            for (int c = 0; c < kCols; ++c) {
                const float scale = __uint_as_float(__float_as_uint(__fmul_rn(sa, sbv[c])) & m[u]);
                y[c] = __fmaf_rn(__uint_as_float(__float_as_uint(acc[u][c]) & m[u]), scale, y[c]);
            }
        }
    }
    if (addend != nullptr) {  // 4-byte aligned: n0 even, N even, the addend's base 4-byte aligned (launcher)
        const __nv_bfloat162 a = *reinterpret_cast<const __nv_bfloat162*>(addend + (size_t)tok * N + n0);
        y[0] = __fadd_rn(y[0], __low2float(a));
        y[1] = __fadd_rn(y[1], __high2float(a));
    }
    // __floats2bfloat162_rn (cvt.rn.bf16x2.f32) rounds each element as __float2bfloat16_rn does (RNE, the same NaN
    // result); here y need not be exact in BF16.
    *reinterpret_cast<uint32_t*>(out + (size_t)tok * N + n0) = pack_bf16x2(y[0], y[1]);
}

extern "C" __global__ void __launch_bounds__(256) moe_gemm_finish_l2_combine_cols2(
    const float* __restrict__ partial, int splits, const int* group, int capacity, int experts, int rows_total, int N,
    const float* __restrict__ gsa, const float* __restrict__ gsb, const int* __restrict__ token_rows, int topk,
    const __nv_bfloat16* __restrict__ addend, __nv_bfloat16* __restrict__ out) {
    __shared__ int s_row[kFinishMaxTopk];  // the valid slots, compacted in routing order
    __shared__ int s_exp[kFinishMaxTopk];
    __shared__ float s_sa[kFinishMaxTopk];
    __shared__ int s_valid;
    const Grouping grp{group, capacity, experts, rows_total};
    const int tok = blockIdx.x;
    const int valid = l2_stage_valid_slots(grp, gsa, token_rows, topk, tok, s_row, s_exp, s_sa, &s_valid);
    const int n0 = 2 * (blockIdx.y * blockDim.x + threadIdx.x);
    if (n0 >= N) return;  // no barrier below
    l2_cols2_columns(partial, splits, rows_total, N, gsb, s_row, s_exp, s_sa, valid, tok, n0, addend, out);
}

// Cols2 with one CTA per token over all N columns (FinishL2Kernel::Cols2Tok; bench `nvfp4_l2cols2tok` forces it):
// grid = tokens. Why: in Cols2 each of the ceil(N / 512) CTAs of a token first walks the same dependent chain
// (token_rows -> the expert search over the offsets -> gsa -> barrier) before its first partial load; at prefill
// (4096 tokens x 8 slices = 32,768 CTAs of 12 KB each) that chain, not the bytes, sets the pace (the combine alone
// ran at ~2.1 TB/s under ncu). Here the table is built once per token and a thread walks the token's
// 512-column slices in order. Each column is computed by l2_cols2_columns as in Cols2: bit-identical outputs.
extern "C" __global__ void __launch_bounds__(256) moe_gemm_finish_l2_combine_cols2_tok(
    const float* __restrict__ partial, int splits, const int* group, int capacity, int experts, int rows_total, int N,
    const float* __restrict__ gsa, const float* __restrict__ gsb, const int* __restrict__ token_rows, int topk,
    const __nv_bfloat16* __restrict__ addend, __nv_bfloat16* __restrict__ out) {
    __shared__ int s_row[kFinishMaxTopk];
    __shared__ int s_exp[kFinishMaxTopk];
    __shared__ float s_sa[kFinishMaxTopk];
    __shared__ int s_valid;
    const Grouping grp{group, capacity, experts, rows_total};
    const int tok = blockIdx.x;
    const int valid = l2_stage_valid_slots(grp, gsa, token_rows, topk, tok, s_row, s_exp, s_sa, &s_valid);
    for (int n0 = 2 * threadIdx.x; n0 < N; n0 += 2 * blockDim.x)
        l2_cols2_columns(partial, splits, rows_total, N, gsb, s_row, s_exp, s_sa, valid, tok, n0, addend, out);
}

// Benchmark weights without a host round trip: codes are hash bytes (every nibble is a valid e2m1 code), block
// scales are e4m3 codes in [0x28, 0x37] (2^-2 .. 0.94, never NaN), so timings never run on zeros.
extern "C" __global__ void moe_gemm_fill_bench_weights(uint8_t* __restrict__ codes, unsigned long long n_codes,
                                                       uint8_t* __restrict__ scales, unsigned long long n_scales,
                                                       unsigned int seed) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n_codes + n_scales; i += stride) {
        unsigned int h = (unsigned int)(i * 0x9E3779B97F4A7C15ull >> 32) ^ seed;
        h ^= h >> 16; h *= 0x7FEB352Du; h ^= h >> 15; h *= 0x846CA68Bu; h ^= h >> 16;
        if (i < n_codes) codes[i] = (uint8_t)h;
        else scales[i - n_codes] = (uint8_t)(0x28 + (h & 0xF));
    }
}

// Baseline support: dequantize NVFP4 rows to BF16 (value = bf16((e2m1 * s) * gs)), one thread per element pair.
extern "C" __global__ void moe_gemm_dequant_rows_bf16(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                                                      const float* __restrict__ global, long long rows, int K,
                                                      __nv_bfloat16* __restrict__ out) {
    const long long pairs = rows * (long long)(K / 2);
    for (long long p = blockIdx.x * (long long)blockDim.x + threadIdx.x; p < pairs; p += (long long)gridDim.x * blockDim.x) {
        const long long r = p / (K / 2);
        const int k = (int)(p - r * (K / 2)) * 2;
        const float s = mm::e4m3_decode(scales[r * (K / 16) + k / 16]) * global[r];
        const uint8_t b = codes[p];
        out[r * K + k] = __float2bfloat16_rn(e2m1_value(b & 0xF) * s);
        out[r * K + k + 1] = __float2bfloat16_rn(e2m1_value(b >> 4) * s);
    }
}
