// NVFP4 x NVFP4 decode mainloop without tensor cores (session 12): integer dot products (IDP4A) on e2m1 codes.
// Same contract as the mma.sync decode mainloop of kernels/moe_gemm.cu (launcher: src/ops/moe_gemm/gemv.rs):
// part[split][row][n] = sum over the split's K range of A[row, k] * B[e, n, k] for every OWNED row of every expert
// (padding rows of the masked layout and rows past the groups are not written, exactly like v3; the finish kernels
// handle them), no global scales (gsa, gsb are applied by the finish kernels). NVFP4 A only.
//
// Exactness. Every NVFP4 product is (e2m1_a * sa) * (e2m1_w * sw). Doubling maps each e2m1 value onto an int8:
// 2 * {0, .5, 1, 1.5, 2, 3, 4, 6} = {0, 1, 2, 3, 4, 6, 8, 12} (and negatives). For one 16-element block
//   sum_k a_k w_k = sa * sw * (1/4) * isum,  isum = sum_k (2 e2m1_a,k) (2 e2m1_w,k),  |isum| <= 16 * 144,
// an exact integer from 4 + 4 IDP4A (below). float(isum) (<= 12 significant bits) times sw * (sa / 4)
// (4-bit x 4-bit significands, no under/overflow: >= 2^-20, <= 448^2 / 4) has <= 20 significant bits: the block
// product is exact in fp32, so only the fp32 order of adding blocks (and the split order) differs from the
// reference, as for v3.
//
// Weight nibble -> int8 with PRMT (prmt.b32 default mode, selector = low 16 bits, one nibble per result byte):
// nibble bits [2:0] pick one of the 8 bytes of {lo, hi}; nibble bit 3 set means "replicate the msb (sign) of the
// picked byte into the whole result byte". The table bytes are the magnitudes 0,1,2,3,4,6,8,12 (msb 0), so
//   P = prmt(tbl, w)           : magnitude for a positive code (bit 3 = 0), 0x00 for a negative one,
//   M = prmt(tbl, w ^ 0x8888)  : magnitude for a negative code, 0x00 for a positive one,
// and a . w = dp4a(a, P) - dp4a(a, M) (signed int8 a). The low 4 nibbles of a code word use w, the high 4 use
// w >> 16: 1 XOR + 2 SHF + 4 PRMT per 8 weights, then 4 IDP4A per 8 weights and token. Rust mirror and an
// exhaustive check over all 256 code bytes: src/ops/moe_gemm/gemv.rs (tests).
//
// Layout of the work. Items = (expert token tile of <= kMaxTok = 2 or 4 tokens (entry _t2 / _t4), 64-row block of
// N, K split), enumerated like v3 (split fastest, then row block, then the expert tiles in expert order:
// common/expert_tiles.cuh), so empty experts cost nothing but the per-CTA scan. Persistent grid, stride gridDim.x. Per item the CTA converts its
// tokens' activation codes (K split range) once into int8 (2 x e2m1) in shared memory plus sa / 4 per block as
// fp32; each warp then streams 8 weight rows over the K range in 512-K steps: lane l reads the 8 code bytes and
// the scale byte of block l of the step (k = 512 p + 16 l .. + 15) of each of the 8 rows, i.e. 256 contiguous code
// bytes per warp and row (whole 32-byte sectors), 2 KB per warp and step. The next step's loads (also across
// items) are issued before the current step's math (register double buffer: 2 x 24 registers). Each lane keeps
// fp32 partials per (row, token); a warp butterfly sums them when the item's K range is done. (A lane covering 32 K
// with 16-byte loads would need K / splits % 1024 == 0, which Flash L2 / Pro at the chosen splits do not meet.)
// Activation smem: int8 [token][k_split] in natural K order: lane l of step p reads 16-byte unit 32 p + l (32
// consecutive units per warp: conflict-free). Scales sa/4: float [token][block], natural order.
// Both entries hold 2 CTAs (16 warps) per SM: the 2-token entry spilled 16 B at the 80 registers of 3 CTAs/SM.
//
// Rounding points: none before the fp32 accumulation (exact block products), fp32 adds over the blocks in this
// lane's K order, then a warp butterfly (xor 16, 8, 4, 2, 1) over the lanes; split partials added by the finish.
#include <stdint.h>
#include <cuda_fp16.h>
#include "common/formats.cuh"
#include "common/expert_tiles.cuh"
#include "common/nvfp4_dequant.cuh"
#include "common/grouping.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerStep = 8;                                  // weight rows per warp and step
constexpr int kGroupsPerWarp = 1;                                // row groups per warp and item
constexpr int kBlockRows = kWarps * kRowsPerStep * kGroupsPerWarp;  // 64 weight rows per item
constexpr int kPassK = 512;                                      // K per warp and step (one 16-block per lane)
constexpr int kMaxExperts = 512;

// The 8 magnitudes 2 * |e2m1| = 0, 1, 2, 3, 4, 6, 8, 12 as bytes 0..7 of {kTblLo, kTblHi}.
constexpr uint32_t kTblLo = 0x03020100u;
constexpr uint32_t kTblHi = 0x0C080604u;

__device__ __forceinline__ uint32_t prmt(uint32_t lo, uint32_t hi, uint32_t sel) {
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(sel));
    return r;
}

// Four e2m1 codes (the low 16 bits of `codes`, nibble i = element i) -> four int8 2 * e2m1 (byte i = element i):
// P - M per byte (one of them is 0), with -M per byte = (0x80 - m) ^ 0x80 for m <= 12 (no borrow between bytes),
// so P | -M is the signed byte. Used once per item for the activations.
__device__ __forceinline__ uint32_t e2m1x4_to_int8x4(uint32_t codes) {
    const uint32_t pos = prmt(kTblLo, kTblHi, codes);
    const uint32_t neg = prmt(kTblLo, kTblHi, codes ^ 0x8888u);
    return pos | ((0x80808080u - neg) ^ 0x80808080u);
}

// 8-byte / 1-byte read-only loads of the weight stream (read once: no L1 allocation for the codes).
__device__ __forceinline__ uint2 ldg_stream8(const void* p) {
    uint2 r;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}
__device__ __forceinline__ uint32_t ldg_u8(const void* p) {
    unsigned short v;
    asm volatile("ld.global.nc.u8 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

struct WStep {
    uint2 codes[kRowsPerStep];     // 16 codes of each row: block k = 16 lane .. 16 lane + 15 of the step's 512
    uint32_t scales[kRowsPerStep]; // e4m3 scale of that block
};

struct ItemPos {
    int row0, ntok, split, expert, nblk;
};

// Expert e, token rows [row0, row0 + ntok), K split range [kbase, kbase + k_split) -> shared memory as above.
template <int kMaxTok>
__device__ __forceinline__ void load_activations(uint8_t* s_act, float* s_sa4, const uint8_t* __restrict__ act,
                                                 const uint8_t* __restrict__ act_scales, int K, int k_split,
                                                 const ItemPos& p) {
    const int kbase = p.split * k_split;
    // The 4-token path also reads token 3 when ntok == 3: give it zeros (its partials are not written either way).
    const int tok_fill = (kMaxTok == 4 && p.ntok == 3) ? 4 : p.ntok;
    const int words = k_split / 8;  // 8 codes per 32-bit word
    for (int q = threadIdx.x; q < tok_fill * words; q += kThreads) {
        const int tk = q / words, wq = q - tk * words;
        uint2 out = make_uint2(0u, 0u);
        if (tk < p.ntok) {
            const uint32_t c = __ldg(reinterpret_cast<const uint32_t*>(act + (size_t)(p.row0 + tk) * (K / 2) +
                                                                       kbase / 2) + wq);
            out.x = e2m1x4_to_int8x4(c);
            out.y = e2m1x4_to_int8x4(c >> 16);
        }
        // Natural K order: byte k of token tk at tk * k_split + k (lane l of pass p reads block 32 p + l).
        *reinterpret_cast<uint2*>(s_act + (size_t)tk * k_split + wq * 8) = out;
    }
    const int blocks = k_split / 16;
    for (int q = threadIdx.x; q < tok_fill * blocks; q += kThreads) {
        const int tk = q / blocks, b = q - tk * blocks;
        float v = 0.f;
        if (tk < p.ntok) v = mm::e4m3_decode(act_scales[(size_t)(p.row0 + tk) * (K / 16) + kbase / 16 + b]) * 0.25f;
        s_sa4[tk * blocks + b] = v;  // sa / 4: exact (power-of-two factor, sa >= 2^-9 stays normal)
    }
}

// The weight addresses of a step: lane's 8 code bytes / 1 scale byte of the step's first row (row r: + r row pitches).
struct StepPtrs {
    const uint8_t* codes;
    const uint8_t* scales;
};
__device__ __forceinline__ StepPtrs step_ptrs(const uint8_t* __restrict__ w_codes,
                                              const uint8_t* __restrict__ w_scales, int N, int K, int k_split,
                                              const ItemPos& p, int rg, int pass, int warp, int lane) {
    const int n = p.nblk * kBlockRows + warp * (kRowsPerStep * kGroupsPerWarp) + rg * kRowsPerStep;
    const size_t wrow = (size_t)p.expert * N + n;
    const int k0 = p.split * k_split + pass * kPassK;
    return StepPtrs{w_codes + wrow * (K / 2) + k0 / 2 + lane * 8, w_scales + wrow * (K / 16) + k0 / 16 + lane};
}
__device__ __forceinline__ void load_row(WStep& w, int r, const StepPtrs& q, int K) {
    w.codes[r] = ldg_stream8(q.codes + (size_t)r * (K / 2));
    w.scales[r] = ldg_u8(q.scales + (size_t)r * (K / 16));
}

// One step for T tokens (T = 1, 2 or 4; the item's ntok <= T): acc[r][t] += this lane's block of row r.
template <int T, int kMaxTok>
__device__ __forceinline__ void compute_step(float (&acc)[kRowsPerStep][kMaxTok], const WStep& w,
                                             const uint8_t* s_act, const float* s_sa4, int k_split, int pass,
                                             int lane, uint32_t tbl_lo) {
    uint4 a[T];   // the 16 activation int8 of the lane's block (consecutive 16-byte units: conflict-free)
    float sa4[T];
#pragma unroll
    for (int t = 0; t < T; ++t) {
        a[t] = reinterpret_cast<const uint4*>(s_act + (size_t)t * k_split)[pass * 32 + lane];
        sa4[t] = s_sa4[t * (k_split / 16) + pass * 32 + lane];
    }
#pragma unroll
    for (int r = 0; r < kRowsPerStep; ++r) {
        const float sw = mm::e4m3_decode((uint8_t)w.scales[r]);
        const uint32_t cw[2] = {w.codes[r].x, w.codes[r].y};
        int ipos[T], ineg[T];
#pragma unroll
        for (int t = 0; t < T; ++t) ipos[t] = ineg[t] = 0;
#pragma unroll
        for (int j = 0; j < 2; ++j) {  // code word j = elements 8j .. 8j+7 of the block
            const uint32_t x = cw[j] ^ 0x88888888u;
            const int p0 = (int)prmt(tbl_lo, kTblHi, cw[j]), p1 = (int)prmt(tbl_lo, kTblHi, cw[j] >> 16);
            const int m0 = (int)prmt(tbl_lo, kTblHi, x), m1 = (int)prmt(tbl_lo, kTblHi, x >> 16);
#pragma unroll
            for (int t = 0; t < T; ++t) {
                // activation words of elements 8j..8j+3 and 8j+4..8j+7
                const int a0 = (int)(j ? a[t].z : a[t].x);
                const int a1 = (int)(j ? a[t].w : a[t].y);
                ipos[t] = __dp4a(a0, p0, ipos[t]);
                ipos[t] = __dp4a(a1, p1, ipos[t]);
                ineg[t] = __dp4a(a0, m0, ineg[t]);
                ineg[t] = __dp4a(a1, m1, ineg[t]);
            }
        }
#pragma unroll
        for (int t = 0; t < T; ++t)  // exact product (header); fmaf == mul + add here
            acc[r][t] = fmaf((float)(ipos[t] - ineg[t]), sw * sa4[t], acc[r][t]);
    }
}

// Warp sum of acc (butterfly, same order in every lane), written by lane r * kMaxTok + t for token t < ntok.
template <int kMaxTok>
__device__ __forceinline__ void store_rows(float (&acc)[kRowsPerStep][kMaxTok], float* __restrict__ partial,
                                           const ItemPos& p, int rows_total, int N, int n0, int lane) {
    float mine = 0.f;
#pragma unroll
    for (int r = 0; r < kRowsPerStep; ++r) {
#pragma unroll
        for (int t = 0; t < kMaxTok; ++t) {
            float v = acc[r][t];
            if (t < p.ntok) {  // uniform over the warp
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            }
            if (lane == r * kMaxTok + t) mine = v;
            acc[r][t] = 0.f;
        }
    }
    const int r = lane / kMaxTok, t = lane % kMaxTok;
    if (lane < kRowsPerStep * kMaxTok && t < p.ntok)
        partial[((size_t)p.split * rows_total + p.row0 + t) * N + n0 + r] = mine;
}

}  // namespace

// grid = persistent (launcher: kCtasPerSm x SMs), block = 256, dynamic smem = kMaxTok * (k_split + k_split / 16 * 4).
// Arguments as moe_gemm_nvfp4_partial_v3_nt* without act_is_nvfp4 (A must be NVFP4).
namespace {
template <int kMaxTok>
__device__ __forceinline__ void moe_gemm_gemv_body(const uint8_t* __restrict__ w_codes,
                                                   const uint8_t* __restrict__ w_scales, int N, int K,
                                                   const uint8_t* __restrict__ act,
                                                   const uint8_t* __restrict__ act_scales, const int* group,
                                                   int capacity, int experts, int rows_total,
                                                   float* __restrict__ partial, int splits) {
    extern __shared__ uint4 s_dyn[];
    __shared__ int s_tile_prefix[kMaxExperts + 1];
    __shared__ int s_warp_sum[kWarps];
    __shared__ uint32_t s_tbl_lo[32];
    const Grouping grp{group, capacity, experts, rows_total};
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int E = grp.experts;
    const int k_split = K / splits;
    uint8_t* s_act = reinterpret_cast<uint8_t*>(s_dyn);
    float* s_sa4 = reinterpret_cast<float*>(s_act + (size_t)kMaxTok * k_split);

    if (tid < 32) s_tbl_lo[tid] = kTblLo;  // published by the barriers of expert_tile_prefix
    int tiles0 = 0, tiles1 = 0;
    {
        int s, c;
        if (2 * tid < E) { grp.expert_rows(2 * tid, s, c); tiles0 = (c + kMaxTok - 1) / kMaxTok; }
        if (2 * tid + 1 < E) { grp.expert_rows(2 * tid + 1, s, c); tiles1 = (c + kMaxTok - 1) / kMaxTok; }
    }
    expert_tile_prefix<kThreads>(tiles0, tiles1, E, s_warp_sum, s_tile_prefix);

    const int n_blocks = N / kBlockRows;
    const long long items = (long long)s_tile_prefix[E] * n_blocks * splits;
    const int passes = k_split / kPassK;

    auto locate = [&](long long item) {
        ItemPos p;
        p.split = (int)(item % splits);
        const long long rest = item / splits;
        p.nblk = (int)(rest % n_blocks);
        const int et = (int)(rest / n_blocks);
        int lo = 0, hi = E - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (s_tile_prefix[mid] <= et) lo = mid; else hi = mid - 1;
        }
        int start, count;
        grp.expert_rows(lo, start, count);
        const int tile = et - s_tile_prefix[lo];
        p.expert = lo;
        p.row0 = start + tile * kMaxTok;
        p.ntok = min(kMaxTok, count - tile * kMaxTok);
        return p;
    };

    long long item = blockIdx.x;
    if (item >= items) return;
    // kTblLo in a per-thread register: PRMT takes only one immediate (kTblHi), and ptxas otherwise keeps the
    // constant in a uniform register and copies it into a vector register before almost every PRMT (64 extra
    // IMAD.U32 per step in the SASS). Read per lane from shared memory it is an opaque, non-uniform value that
    // stays in one register.
    const uint32_t tbl_lo = s_tbl_lo[lane];
    ItemPos cur = locate(item);
    WStep wbuf;
    {
        const StepPtrs first = step_ptrs(w_codes, w_scales, N, K, k_split, cur, 0, 0, warp, lane);
#pragma unroll
        for (int r = 0; r < kRowsPerStep; ++r) load_row(wbuf, r, first, K);
    }
    load_activations<kMaxTok>(s_act, s_sa4, act, act_scales, K, k_split, cur);
    __syncthreads();
    float acc[kRowsPerStep][kMaxTok];
#pragma unroll
    for (int r = 0; r < kRowsPerStep; ++r)
#pragma unroll
        for (int t = 0; t < kMaxTok; ++t) acc[r][t] = 0.f;

    // Step = (row group rg, 512-K pass), pass fastest; counters instead of a division per step.
    int rg = 0, pass = 0;
    for (;;) {
        const bool group_done = pass + 1 == passes;
        const bool last_step = group_done && rg + 1 == kGroupsPerWarp;
        const long long next_item = last_step ? item + gridDim.x : item;
        const bool has_next = next_item < items;
        ItemPos nxt = cur;
        if (last_step && has_next) nxt = locate(next_item);
        const int next_rg = last_step ? 0 : (group_done ? rg + 1 : rg);
        const int next_pass = group_done ? 0 : pass + 1;
        WStep wnext = wbuf;
        if (has_next) {
            const StepPtrs next = step_ptrs(w_codes, w_scales, N, K, k_split, nxt, next_rg, next_pass, warp, lane);
#pragma unroll
            for (int r = 0; r < kRowsPerStep; ++r) load_row(wnext, r, next, K);
        }

        if (cur.ntok == 1)
            compute_step<1, kMaxTok>(acc, wbuf, s_act, s_sa4, k_split, pass, lane, tbl_lo);
        else if (kMaxTok == 2 || cur.ntok == 2)
            compute_step<2, kMaxTok>(acc, wbuf, s_act, s_sa4, k_split, pass, lane, tbl_lo);
        else
            compute_step<kMaxTok, kMaxTok>(acc, wbuf, s_act, s_sa4, k_split, pass, lane, tbl_lo);

        if (group_done) {
            const int n0 = cur.nblk * kBlockRows + warp * (kRowsPerStep * kGroupsPerWarp) + rg * kRowsPerStep;
            store_rows<kMaxTok>(acc, partial, cur, grp.rows_total, N, n0, lane);
        }
        if (last_step) {
            if (!has_next) break;
            __syncthreads();  // every warp is done with this item's activations
            load_activations<kMaxTok>(s_act, s_sa4, act, act_scales, K, k_split, nxt);
            __syncthreads();
        }
        item = next_item;
        cur = nxt;
        rg = next_rg;
        pass = next_pass;
        wbuf = wnext;
    }
}
}  // namespace

// Entries: _t<kMaxTok> = tokens per item (token tile); an expert with more rows is several items (the weights
// stream once per item). Both 2 CTAs per SM (launcher grid 2 x SMs). Launcher: src/ops/moe_gemm/gemv.rs.
#define MOE_GEMM_GEMV_ENTRY(TOK, MINB)                                                                            \
    extern "C" __global__ void __launch_bounds__(kThreads, MINB) moe_gemm_gemv_nvfp4_partial_t##TOK(              \
        const uint8_t* __restrict__ w_codes, const uint8_t* __restrict__ w_scales, int N, int K,                   \
        const uint8_t* __restrict__ act, const uint8_t* __restrict__ act_scales, const int* group, int capacity,  \
        int experts, int rows_total, float* __restrict__ partial, int splits) {                                   \
        moe_gemm_gemv_body<TOK>(w_codes, w_scales, N, K, act, act_scales, group, capacity, experts, rows_total,   \
                                partial, splits);                                                                 \
    }

MOE_GEMM_GEMV_ENTRY(2, 2)
MOE_GEMM_GEMV_ENTRY(4, 2)
