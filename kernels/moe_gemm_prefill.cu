// NVFP4 MoE grouped GEMM, PREFILL path (many tokens per expert) on Hopper wgmma (sm_90a).
// Computes the same fp32 partial sums as kernels/moe_gemm.cu with one K split:
//   partial[row, n] = sum_k A[row, k] * B[e(row), n, k]      (no global scales; the finish kernels apply them)
// so the finish kernels (plain BF16, L1 SwiGLU + NVFP4 quant, L2 combine) run unchanged after it.
// Contiguous grouping only (tokens sorted by expert, offsets[E+1]); the decode kernel keeps the masked layout.
//
// Three kernels (launcher: src/ops/moe_gemm/prefill.rs):
// * moe_gemm_prefill_tile_weights_rs: weight preparation, once per weight set: the weights re-laid so that one
//   128-K stage of one 256-row tile is one contiguous block (read by this mainloop and by the decode mainloop).
// * moe_gemm_prefill_act_rs: the activation pre-pass, once per launch: A in the mainloop's permuted BF16 order.
// * moe_gemm_prefill_rs_tiled: the mainloop. Weights dequantized IN REGISTERS as the wgmma A operand (RS form),
//   activations from a TMA ring in shared memory, each stage's weights one bulk copy into the same ring.
//
// Shared-memory operand layout of the activations (128B swizzle, K-major), for a tile of R rows x 64 bf16:
// byte offset of (row r, 16-byte chunk c in 0..8) = r * 128 + ((c ^ (r & 7)) << 4); tiles are 1024-aligned.
// This is the canonical SWIZZLE_128B K-major atom (8 rows x 128 B; 16-byte chunk index XOR row mod 8, i.e.
// address bits [4,7) ^= bits [7,10)), what a TMA copy with CU_TENSOR_MAP_SWIZZLE_128B writes; a CPU mirror
// (prefill.rs tests) checks it is a bijection on the tile.
// Matrix descriptor (64 bit; PTX ISA "asynchronous warpgroup level matrix shared memory layout: matrix
// descriptor"; same fields as CUTLASS GmmaDescriptor in cute/arch/mma_sm90_desc.hpp): bits 0-13 start address
// >> 4, bits 16-29 leading-dimension byte offset >> 4, bits 32-45 stride-dimension byte offset >> 4, bits 49-51
// base offset (0: tiles 1024-byte aligned), bits 62-63 swizzle mode (1 = 128B). For K-major 128B swizzle the LBO
// is unused (set to 1, as CUTLASS does) and the SBO is the distance between 8-row core-matrix groups = 8 * 128 B
// = 1024 B. The k-th K=16 slice of a 64-wide atom starts 32 * k bytes further (start address + 2k in descriptor
// units): the hardware applies the XOR swizzle to the full address, which is why the tiles must be 1024-byte
// aligned.
// Accumulator fragment of m64nNk16 (PTX ISA figure "WGMMA .m64nNk16 register fragment layout for accumulator
// D"): thread t of the warp group, warp w = t / 32, lane l: d[4j + {0,1}] is row 16w + l/4, columns
// 8j + 2(l%4) + {0,1}; d[4j + {2,3}] is row 16w + l/4 + 8, same columns.
#include "common/formats.cuh"
#include "common/expert_tiles.cuh"
#include "common/wgmma.cuh"
#include "common/tma.cuh"
#include "common/nvfp4_dequant.cuh"

namespace {

constexpr int kMaxExperts = 512;

// ---- Work items of the mainloop: (expert token tile of 128 rows, n tile), n tile fastest ------------------------
// Rows of expert e in the contiguous grouping, clamped to [0, rows_total] so a bad offset cannot index out of bounds.
__device__ __forceinline__ void contiguous_expert_rows(const int* __restrict__ offsets, int rows_total, int e,
                                                       int& start, int& count) {
    const int lo = min(max(offsets[e], 0), rows_total);
    const int hi = min(max(offsets[e + 1], lo), rows_total);
    start = lo;
    count = hi - lo;
}

// s_tile_prefix[e] = 128-row token tiles of the experts before e (e = 0..E); thread t owns experts 2t and 2t+1.
// Leaves the CTA synchronized (expert_tile_prefix).
template <int THREADS>
__device__ __forceinline__ void token_tile_prefix(const int* __restrict__ offsets, int E, int rows_total,
                                                  int* s_warp_sum, int* s_tile_prefix) {
    const int tid = threadIdx.x;
    int tiles0 = 0, tiles1 = 0, s, c;
    if (2 * tid < E) { contiguous_expert_rows(offsets, rows_total, 2 * tid, s, c); tiles0 = (c + 127) / 128; }
    if (2 * tid + 1 < E) { contiguous_expert_rows(offsets, rows_total, 2 * tid + 1, s, c); tiles1 = (c + 127) / 128; }
    expert_tile_prefix<THREADS>(tiles0, tiles1, E, s_warp_sum, s_tile_prefix);
}

struct TileItem {
    int e, n_tile, row0, ntok;  // expert, n tile, first row of the token tile, its valid rows (1..128)
};
__device__ __forceinline__ TileItem locate_item(long long item, int n_tiles, const int* s_tile_prefix, int E,
                                                const int* __restrict__ offsets, int rows_total) {
    TileItem it;
    it.n_tile = (int)(item % n_tiles);
    const int et = (int)(item / n_tiles);
    int lo = 0, hi = E - 1;  // largest e with prefix[e] <= et
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (s_tile_prefix[mid] <= et) lo = mid; else hi = mid - 1;
    }
    it.e = lo;
    int start, count;
    contiguous_expert_rows(offsets, rows_total, lo, start, count);
    const int tile = et - s_tile_prefix[lo];
    it.row0 = start + tile * 128;
    it.ntok = min(128, count - tile * 128);
    return it;
}
}  // namespace
// =====================================================================================================================
// The RS mainloop design: weights dequantized IN REGISTERS as the wgmma A operand; activations pre-permuted once
// (`moe_gemm_prefill_act_rs`) and fed by TMA.
// =====================================================================================================================
// Why: a mainloop that dequantizes the weights into a BF16 shared-memory tile and reads it back through wgmma (both
// operands from shared memory) moves ~150 KB of shared memory per 1024 tensor cycles (~146 B/clk against the
// 128 B/clk an SM's shared memory delivers), so its tensor cores wait. Here the roles swap (as in the decode kernel):
// weight rows are the wgmma M dimension and come from REGISTERS (`wgmma ... {a0..a3}, b-desc`: the RS form), tokens
// are the wgmma N dimension and come from shared memory; the B operand (tokens) is 64 B/clk of shared-memory reads at
// the full rate.
//
// * CTA tile: 256 weight rows (2 warp groups x 2 m64 blocks) x up to 128 tokens (m64n128k16, 2 x 64 fp32
//   accumulators per thread) x K in stages of 128 (two 128B-swizzle atoms of 64 K).
// * K permutation (the decode kernel's, kernels/moe_gemm.cu header; free because both operands agree): lane t of a
//   quad owns the 32 contiguous K [32t, 32t+32) of a 128-K stage, i.e. two NVFP4 blocks = 4 code words j = 0..3
//   (word 4t+j holds physical K 32t+8j .. 32t+8j+7). Pair P_i(word) = (x_i, x_{i+4}) of a word (i = 0..3) is one
//   bf16x2 after the shift-and-mask trick (e2m1_pair_to_bf16x2_tiny) and one mul.rn.bf16x2 by the block scale.
//   Logical k16 slice S = 2j + h (S = 0..7 across the stage) takes from word j: a0 = P_2h(row g), a1 = P_2h(row
//   g+8), a2 = P_2h+1(row g), a3 = P_2h+1(row g+8) -- the m64nNk16 A register fragment is the mma.sync m16n8k16
//   one per warp (a0: row g, k 2t..2t+1; a1: row g+8; a2: row g, k 2t+8..2t+9; a3: row g+8), warp w holding rows
//   16w .. 16w+15 of the m64 block.
//   So logical k = 2t + b of slice S is physical K 32t + 8j + 2h + 4b, and logical k = 2t + 8 + b is physical
//   32t + 8j + 2h + 1 + 4b. The activations must hold the same physical elements at those logical places:
//   logical 16-byte chunk c = 4j + i (i = 0..3) of a token's 128-K row = [P_i(word 4t+j) for t = 0..3], which the
//   pre-pass writes (chunks 0..7 = TMA box / swizzle atom 0, 8..15 = atom 1).
//   CPU mirrors of both index maps are checked against each other in src/ops/moe_gemm/prefill.rs
//   (rs_fragments_and_activation_tile_agree_on_a_permutation_of_k).
// * Numerics: products exact (e2m1 * s * 2^-9 per dequantized operand: <= 5 significant bits, inside the normal
//   bf16 range), fp32 accumulation; the epilogue multiplies by 2^18 (NVFP4 A) or 2^9 (BF16 A), exact (a power of
//   two, no overflow or underflow for the value ranges of e2m1 * e4m3 and of activations above ~2^-100).
// * Budget per CTA stage: 256 x 128 x 128 MAC = 4 Mi MAC at 2048 BF16 MAC/clk/SM (H200 dense BF16 peak) = 2048
//   tensor cycles. SASS per warp and stage: ~520 (64 HMUL2 + ~190 integer ops of the e2m1 trick for 64 weight
//   pairs, 8 scale decodes, 16 HGMMA with their fences / waits, loads, ring protocol): ~1040 issue cycles per
//   scheduler (2 warps) per 2048 tensor cycles.
// * The activations are converted once by the pre-pass, not per CTA: dequantizing each stage's NVFP4 activation
//   tile inside every CTA costs ~850 SASS per warp and stage, a mid-stage barrier, and 16 CTAs repeating the tile.
namespace rs {
constexpr int kThreads = 256;
constexpr int kTileT = 128;                       // tokens per CTA tile (wgmma N)
static_assert(kTileT == 128, "locate_item / token_tile_prefix assume 128-row token tiles");
constexpr int kTileRows = 256;                    // weight rows per CTA tile (2 WG x 2 m64 blocks)
constexpr int kStageK = 128;
constexpr int kAtomBytes = kTileT * 128;          // one [128 tokens][64 K] BF16 swizzle atom: 16 KiB
constexpr int kActTile = 2 * kAtomBytes;          // one 128-K stage of BF16 activations: 32 KiB

// Weights of one 128-K stage for one thread: rows g and g+8 of its two m64 blocks (16 B of codes each) and their
// block scales (lo16: row g blocks 2t, 2t+1; hi16: row g+8).
struct WStage {
    uint4 lo[2], hi[2];
    uint32_t sc[2];
};

__device__ __forceinline__ uint32_t word_of(const uint4& v, int j) {
    return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// D(64 x 128, fp32) += A(64 x 16, bf16, registers) * B(128 x 16, bf16, smem desc, K-major)^T.
__device__ __forceinline__ void wgmma_rs_m64n128k16(float (&d)[64], uint32_t a0, uint32_t a1, uint32_t a2,
                                                    uint32_t a3, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(1));
}
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

// Narrow token tiles: the RS wgmma with N = 32 / 64 / 96 tokens. Accumulator fragment layout of
// m64nNk16 = the first N/2 registers of the n128 layout (d[4j + ..] is column group j), so one float[64] array serves
// every width and store_partials_n stores the first N/8 column groups.
__device__ __forceinline__ void wgmma_rs_m64n32k16(float (&d)[64], uint32_t a0, uint32_t a1, uint32_t a2,
                                                   uint32_t a3, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(1));
}
__device__ __forceinline__ void wgmma_rs_m64n64k16(float (&d)[64], uint32_t a0, uint32_t a1, uint32_t a2,
                                                   uint32_t a3, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(1));
}
__device__ __forceinline__ void wgmma_rs_m64n96k16(float (&d)[64], uint32_t a0, uint32_t a1, uint32_t a2,
                                                   uint32_t a3, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, {%48, %49, %50, %51}, %52, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(1));
}

template <int NT>
__device__ __forceinline__ void wgmma_rs_n(float (&d)[64], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                           uint64_t db) {
    if constexpr (NT == 128) wgmma_rs_m64n128k16(d, a0, a1, a2, a3, db);
    else if constexpr (NT == 96) wgmma_rs_m64n96k16(d, a0, a1, a2, a3, db);
    else if constexpr (NT == 64) wgmma_rs_m64n64k16(d, a0, a1, a2, a3, db);
    else wgmma_rs_m64n32k16(d, a0, a1, a2, a3, db);
}

// One logical k16 slice S = 2j + h for both m64 blocks with NT-token wgmmas: fragments from word j of the stage's
// weights (header), then two RS wgmmas on the activation tile described by `db`, committed as one group; waits until
// at most this group is in flight, so the previous slice's fragment registers are free again. NT = 128: the full
// token tile; 32 / 64 / 96: the narrow tiles (same fragments, same order).
template <int NT>
__device__ __forceinline__ void mma_slice_n(float (&d)[2][64], const WStage& w, int S, uint64_t db) {
    const int j = S >> 1, h = S & 1;
    uint32_t a[2][4];
#pragma unroll
    for (int mb = 0; mb < 2; ++mb) {
        const uint32_t sl = scale_bf16x2((w.sc[mb] >> (8 * (j >> 1))) & 0xFF);
        const uint32_t sh = scale_bf16x2((w.sc[mb] >> (16 + 8 * (j >> 1))) & 0xFF);
        const uint32_t wl = word_of(w.lo[mb], j), wh = word_of(w.hi[mb], j);
        a[mb][0] = bf16x2_mul(e2m1_pair_to_bf16x2_tiny(wl, 2 * h), sl);
        a[mb][1] = bf16x2_mul(e2m1_pair_to_bf16x2_tiny(wh, 2 * h), sh);
        a[mb][2] = bf16x2_mul(e2m1_pair_to_bf16x2_tiny(wl, 2 * h + 1), sl);
        a[mb][3] = bf16x2_mul(e2m1_pair_to_bf16x2_tiny(wh, 2 * h + 1), sh);
    }
    // Slice S sits in atom S / 4 at +32 bytes per slice (+2 in the descriptor's 16-byte units).
    const uint64_t dbs = db + (uint64_t)((S >> 2) * (kAtomBytes >> 4)) + 2 * (S & 3);
    fence_acc(d[0]);
    fence_acc(d[1]);
    wgmma_fence();
    wgmma_rs_n<NT>(d[0], a[0][0], a[0][1], a[0][2], a[0][3], dbs);
    wgmma_rs_n<NT>(d[1], a[1][0], a[1][1], a[1][2], a[1][3], dbs);
    wgmma_commit();
    wgmma_wait<1>();
    fence_acc(d[0]);
    fence_acc(d[1]);
}

// Epilogue: accumulator (weight row 16 wq + g (+8) of m64 block mb, token 8 jj + 2t (+1)) * restore ->
// partial[row0 + token][wrow0 + 64 mb (+8)], tokens < ntok only (the rest of the tile belongs to other experts), over
// the first NT tokens of the tile (columns past NT were never computed).
template <int NT>
__device__ __forceinline__ void store_partials_n(const float (&d)[2][64], float* __restrict__ partial, int N,
                                                 int row0, int ntok, int wrow0, int t, float restore) {
#pragma unroll
    for (int mb = 0; mb < 2; ++mb) {
        const int n = wrow0 + 64 * mb;
#pragma unroll
        for (int jj = 0; jj < NT / 8; ++jj) {
#pragma unroll
            for (int b = 0; b < 2; ++b) {
                const int tok = 8 * jj + 2 * t + b;
                if (tok < ntok) {
                    float* p = partial + (size_t)(row0 + tok) * N + n;
                    p[0] = d[mb][4 * jj + b] * restore;
                    p[8] = d[mb][4 * jj + 2 + b] * restore;
                }
            }
        }
    }
}

}  // namespace rs

// =====================================================================================================================
// The activation pre-pass (`moe_gemm_prefill_act_rs`) and the TMA ring of the RS mainloop.
// =====================================================================================================================
// One pass over A writes it once, in the RS logical order, as BF16 [rows][K] (e2m1 * s * 2^-9 for NVFP4 A, the
// values the weights' trick produces too; the BF16 values themselves for BF16 A); the mainloop streams each stage's
// two [128 tokens][64 K] atoms with two TMA copies (SWIZZLE_128B lands exactly the swizzled K-major layout the
// descriptor expects) into a 4-slot ring: one thread issues, mbarriers count the bytes, no CTA-wide barrier and no
// generic-proxy writes of wgmma operands (hence no proxy fence). Token rows past the expert's count are loaded too
// (rows of the next expert, or zeros past rows_total): their accumulator columns are never stored.
// Ring protocol (fills and consumptions counted per CTA across its work items, same order): fill f goes to slot
// f % 4; its full barrier (count 1: the producer's arrive.expect_tx of the slot's bytes) completes phase f / 4; the
// empty barrier (count 256: every thread releases the slot itself) must have completed phase f / 4 - 1 before fill f
// reuses the slot (when each slot is released and why the protocol cannot deadlock: the mainloop's section below).
namespace rs {
constexpr int kRingT = 4;

// Thread 0: the ring's full barriers (count 1: the producer's arrive.expect_tx) and empty barriers (count 256: every
// thread of the CTA), made visible to the async proxy. The caller's next __syncthreads publishes them to the CTA.
__device__ __forceinline__ void ring_init(uint64_t* full, uint64_t* empty) {
    constexpr int kEmptyArrivals = kThreads;
    static_assert(kEmptyArrivals >= 1 && kEmptyArrivals < (1 << 20), "mbarrier expected count is 20 bits");
    if (threadIdx.x == 0) {
        for (int s = 0; s < kRingT; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], kEmptyArrivals);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // inits visible to the async proxy
    }
}
}  // namespace rs

// The pre-pass kernel. A's rows are contiguous 128-K segments: segment g = row * (K / 128) + (128-K chunk) has its
// 64 code bytes at g * 64 (NVFP4; 8 block-scale bytes at g * 8) or its 256 BF16 bytes at g * 256, and its 256
// output bytes at g * 256, so the pass is one flat stream of segments (no division by K / 128). Per segment (RS
// header): output chunk c = 4j + i, 32-bit slot s = P_i(word 4s + j) (times the block scale of word 4s + j, byte
// (4s + j) / 2, for NVFP4), where word k = code bytes 4k .. 4k + 3 (BF16: input 16-byte chunk k, elements 8k ..
// 8k + 7, whose P_i = (e_i, e_{i+4})).
// Lane roles (16 lanes per segment, a warp covers a segment PAIR g, g + 1 per step; lane l = 4t + j of its half):
// * load: lane l reads word l (4 B of codes + its scale byte l / 2, or 16 B of BF16): per segment pair the warp
//   loads 128 contiguous code bytes + 16 scale bytes (NVFP4) or 512 contiguous bytes (BF16);
// * compute: it forms A[t][i] = P_i(word l) (scaled) for i = 0..3, all four chunks' slot t;
// * transpose: the 4 lanes j, 4 + j, 8 + j, 12 + j (t = 0..3) swap them so that lane 4t + j holds chunk c = 4j + t
//   = [A[s][t], s = 0..3]: slot q of lane t holds A[t][t ^ q] (the i order is free: a shift amount for NVFP4, a
//   register / selector choice for BF16), shfl.bfly by 4q hands it to lane t ^ q, which wants exactly A[t][t ^ q]
//   as its slot t; so received value m (m = 0 own) is slot s = t ^ m, a fixed xor placement (8 SEL);
// * store: lane 4t + j writes chunk 4j + t: each STG.128 of the warp writes 512 contiguous bytes (two segments).
// Values come from the helpers the weights' dequant uses (e2m1_pair_to_bf16x2_tiny, bf16x2_mul, the scale decode of
// scale_bf16x2; BF16: the pair selectors of byte_perm); the CPU mirrors rs_prepass_*_like_kernel (prefill.rs) state
// the output.
// Why the transpose: with one (row, chunk, j) task per thread (the four 16-byte chunks 4j .. 4j + 3 from one thread)
// each STG.128 writes 16 B at a 64-byte lane stride (half of every 32-byte sector per instruction), and the address
// math needs a 64-bit division per thread; the lane transpose (3 SHFL + 8 SEL per chunk) makes every warp store 512
// contiguous bytes from a flat segment index, at 32 registers (8 CTAs per SM).
namespace act_rs {
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kCtasPerSm = 8;  // 2048 threads: at most 32 registers
constexpr int kPairsNvfp4 = 4;  // segment pairs per warp step: 4 x (code word + scale byte) in flight per lane
constexpr int kPairsBf16 = 4;   // 4 x 16 B in flight per lane
static_assert(kPairsNvfp4 % 2 == 0, "nvfp4_step converts the scale codes of two pairs at a time");
static_assert(kPairsNvfp4 == 4 && kPairsBf16 == 4,
              "keep src/ops/moe_gemm/prefill.rs ACT_RS_SEGMENTS_PER_WARP_STEP (= 2 x pairs) in sync");

// scale_bf16x2 (nvfp4_dequant.cuh) of the e4m3 codes in bytes 0 and 1 of `two`, with one cvt.rn.f16x2.e4m3x2 for
// both (e4m3_decode converts a single code with the same instruction, the code in the low byte: the conversion is
// per element) and b | b << 16 as one byte_perm (bytes 2, 3, 2, 3 of the f32 = its high half twice).
__device__ __forceinline__ void scale_bf16x2_two(uint32_t two, uint32_t& s0, uint32_t& s1) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(two & 0xFFFF), __NV_E4M3);
    __half_raw h0, h1;
    h0.x = h.x;
    h1.x = h.y;
    s0 = __byte_perm(__float_as_uint(__half2float(__half(h0)) * 0x1p117f), 0, 0x3232);
    s1 = __byte_perm(__float_as_uint(__half2float(__half(h1)) * 0x1p117f), 0, 0x3232);
}

// The transpose of the header: v[m] = A[t ^ m][t] (v[0] own, v[m] from shfl.bfly 4m) -> chunk slot s = t ^ m.
__device__ __forceinline__ uint4 transpose_to_chunk(const uint32_t (&a)[4], bool t0, bool t1) {
    uint32_t v[4];
    v[0] = a[0];
#pragma unroll
    for (int m = 1; m < 4; ++m) v[m] = __shfl_xor_sync(0xffffffffu, a[m], 4 * m);
    // out[s] = v[s ^ t]: first xor by t0 (u[s] = v[s ^ t0]), then by 2 t1.
    const uint32_t u0 = t0 ? v[1] : v[0], u1 = t0 ? v[0] : v[1];
    const uint32_t u2 = t0 ? v[3] : v[2], u3 = t0 ? v[2] : v[3];
    uint4 o;
    o.x = t1 ? u2 : u0;
    o.y = t1 ? u3 : u1;
    o.z = t1 ? u0 : u2;
    o.w = t1 ? u1 : u3;
    return o;
}

// One warp step of the NVFP4 branch: P segment pairs, pair p = segments g0 + 2p (this lane's code word at cw + 128p,
// its scale byte at cs + 16p, its output chunk at co + 512p). kGuard: only pairs 2p < left exist (the grid's last
// step); otherwise all P do and the loads and stores need no predicate.
template <int P, bool kGuard>
__device__ __forceinline__ void nvfp4_step(const uint8_t* cw, const uint8_t* cs, uint8_t* co, int left, int t,
                                           bool t0, bool t1) {
    uint32_t word[P], code[P];
#pragma unroll
    for (int p = 0; p < P; ++p) {
        word[p] = 0;
        code[p] = 0;
        if (!kGuard || 2 * p < left) {
            word[p] = __ldg(reinterpret_cast<const uint32_t*>(cw + 128 * p));
            code[p] = __ldg(cs + 16 * p);
        }
    }
#pragma unroll
    for (int p = 0; p < P; p += 2) {
        uint32_t sv[2];  // two pairs share one two-code conversion
        scale_bf16x2_two(code[p] | (code[p + 1] << 8), sv[0], sv[1]);
#pragma unroll
        for (int pp = 0; pp < 2; ++pp) {
            uint32_t a[4];
#pragma unroll
            for (int q = 0; q < 4; ++q)  // slot q = A[t][t ^ q] (header)
                a[q] = bf16x2_mul(e2m1_pair_to_bf16x2_tiny(word[p + pp], t ^ q), sv[pp]);
            const uint4 o = transpose_to_chunk(a, t0, t1);
            if (!kGuard || 2 * (p + pp) < left) *reinterpret_cast<uint4*>(co + 512 * (p + pp)) = o;
        }
    }
}

// One warp step of the BF16 branch: this lane's input chunk at ci + 512p, output chunk at co + 512p. P_i = (e_i,
// e_{i+4}) = byte_perm(i >> 1 ? y : x, i >> 1 ? w : z, i & 1 ? 0x7632 : 0x5410) (the pair selectors); slot q
// has i = t ^ q, so its registers follow t1 ^ q1 and its selector t0 ^ q0 (sel_a: q0 = 0, sel_b: q0 = 1).
template <int P, bool kGuard>
__device__ __forceinline__ void bf16_step(const uint8_t* ci, uint8_t* co, int left, uint32_t sel_a, uint32_t sel_b,
                                          bool t0, bool t1) {
    uint4 v[P];
#pragma unroll
    for (int p = 0; p < P; ++p) {
        v[p] = make_uint4(0, 0, 0, 0);
        if (!kGuard || 2 * p < left) v[p] = __ldg(reinterpret_cast<const uint4*>(ci + 512 * p));
    }
#pragma unroll
    for (int p = 0; p < P; ++p) {
        const uint32_t x = t1 ? v[p].y : v[p].x, y = t1 ? v[p].x : v[p].y;
        const uint32_t z = t1 ? v[p].w : v[p].z, w = t1 ? v[p].z : v[p].w;
        uint32_t a[4];
        a[0] = __byte_perm(x, z, sel_a);  // i = t
        a[1] = __byte_perm(x, z, sel_b);  // i = t ^ 1
        a[2] = __byte_perm(y, w, sel_a);  // i = t ^ 2
        a[3] = __byte_perm(y, w, sel_b);  // i = t ^ 3
        const uint4 o = transpose_to_chunk(a, t0, t1);
        if (!kGuard || 2 * p < left) *reinterpret_cast<uint4*>(co + 512 * p) = o;
    }
}
}  // namespace act_rs

// grid = min(warp steps / 8, resident CTAs) (the loop strides over warp steps), block = 256; K % 128 == 0,
// rows * K / 128 < 2^31; NVFP4 codes 4-byte, BF16 A and out 16-byte aligned (checked by the launcher).
extern "C" __global__ void __launch_bounds__(act_rs::kThreads, act_rs::kCtasPerSm) moe_gemm_prefill_act_rs(
    const void* __restrict__ act, const uint8_t* __restrict__ act_scales, int act_is_nvfp4, int rows, int K,
    __nv_bfloat16* __restrict__ out) {
    const int segments = rows * (K / 128);
    const int lane = threadIdx.x & 31;
    const int l = lane & 15, t = l >> 2, j = l & 3;
    const bool t0 = (t & 1) != 0, t1 = (t & 2) != 0;
    const int warp0 = blockIdx.x * act_rs::kWarps + (threadIdx.x >> 5);
    const int warps = gridDim.x * act_rs::kWarps;
    // A warp step covers 2P segments: pair p = segments g0 + 2p, g0 = 2P * step + (lane >> 4); the lane writes
    // output chunk 4j + t of its segment.
    const int half = lane >> 4;
    uint8_t* const out_lane = reinterpret_cast<uint8_t*>(out) + 16 * (4 * j + t);
    if (act_is_nvfp4) {
        constexpr int P = act_rs::kPairsNvfp4;
        const uint8_t* const codes_lane = reinterpret_cast<const uint8_t*>(act) + 4 * l;  // word l
        const uint8_t* const scales_lane = act_scales + (l >> 1);                        // its block's scale
        const int steps = segments / (2 * P) + (segments % (2 * P) != 0);
        for (int st = warp0; st < steps; st += warps) {
            const int g0 = st * 2 * P + half;
            const uint8_t* const cw = codes_lane + (size_t)g0 * 64;
            const uint8_t* const cs = scales_lane + (size_t)g0 * 8;
            uint8_t* const co = out_lane + (size_t)g0 * 256;
            if (segments - st * 2 * P >= 2 * P) act_rs::nvfp4_step<P, false>(cw, cs, co, 0, t, t0, t1);
            else act_rs::nvfp4_step<P, true>(cw, cs, co, segments - g0, t, t0, t1);
        }
    } else {
        constexpr int P = act_rs::kPairsBf16;
        const uint8_t* const in_lane = reinterpret_cast<const uint8_t*>(act) + 16 * l;  // input chunk l
        const uint32_t sel_a = t0 ? 0x7632u : 0x5410u, sel_b = t0 ? 0x5410u : 0x7632u;
        const int steps = segments / (2 * P) + (segments % (2 * P) != 0);
        for (int st = warp0; st < steps; st += warps) {
            const int g0 = st * 2 * P + half;
            const uint8_t* const ci = in_lane + (size_t)g0 * 256;
            uint8_t* const co = out_lane + (size_t)g0 * 256;
            if (segments - st * 2 * P >= 2 * P) act_rs::bf16_step<P, false>(ci, co, 0, sel_a, sel_b, t0, t1);
            else act_rs::bf16_step<P, true>(ci, co, segments - g0, sel_a, sel_b, t0, t1);
        }
    }
}

// =====================================================================================================================
// The mainloop (`moe_gemm_prefill_rs_tiled`): the RS design with each stage's weights and activations in one TMA
// ring, narrow token tiles, and the weights in their tiled layout.
// =====================================================================================================================
// * Weights in the ring: each ring slot carries, beside the stage's two activation atoms, the stage's weight codes and
//   block scales, loaded by the same producer thread three stages ahead and counted by the same full barrier; the
//   consumers read them with LDS into the registers of the RS fragments. Why: register loads one stage ahead (~1 us
//   of work) do not cover an HBM load under this load; three ring stages do.
// * Tiled weights (DeviceExpertWeights::tiled, made once per weight set by moe_gemm_prefill_tile_weights_rs): stage st
//   of tile (e, n tile) is one contiguous 18 KiB block holding exactly the slot image the consumers read: the 256 code
//   rows of 64 B, then the 256 rows of this stage's 8 scale bytes (pitch 8). One cp.async.bulk per stage instead of
//   512 row segments of 8-64 bytes, 2 KB apart in HBM (what 2D TMA boxes over the row-major weights would fetch).
//   Layout: block ((e * N / 256 + n_tile) * K / 128 + st) at byte 18432 * block; inside, code byte c of row r at
//   64 r + c, scale byte j of row r at 16384 + 8 r + j.
// * Slot layout (53,248 B, a multiple of 1024 so every activation atom stays 1024-aligned for the 128B swizzle):
//   [0, 32 KiB) the activation atoms; [32 KiB, 50 KiB) the stage's tiled weight block; [50 KiB, 52 KiB) unused (a
//   50 KiB slot would keep the alignment as well; the slot pitch is part of the measured kernel).
// * Bank conflicts: a warp's LDS.128 of codes covers rows g = 0..7 (64 B apart) x 16 B at 16 t = 512 contiguous
//   bytes (4 wavefronts, the minimum); its u16 scale loads fall in one 64-byte span (one wavefront).
// * Slot release one stage later: every thread arrives on a slot's empty barrier after the FIRST slice of the next
//   stage, whose wgmma.wait_group 1 guarantees that every wgmma of the previous stage has completed (its activation
//   reads are done; its weight LDS were consumed before its own slices). So the wgmma pipe is not drained at every
//   stage end; only the last stage of a work item waits for 0. Every thread arrives (count 256), not lane 0 per warp
//   after a __syncwarp: both orders are correct on the hardware (PTX: __syncwarp orders the warp's shared-memory
//   reads before lane 0's release-arrive), but compute-sanitizer racecheck does not credit lanes 1-31's reads to
//   lane 0's arrive; with the all-lane release it reports 0 hazards, for one more arrive per warp and stage.
// * Producer: thread 0 fills stages 0..2 of an item at its start and stage st + 3 after the slices of stage st. The
//   fill three consumptions ahead reuses the slot of the consumption one before the current one, released by every
//   thread after slice 0 of the current stage (or, at an item start, after the previous item's wait_group 0): thread
//   0 has passed that point itself, and no thread needs thread 0 to get there (the current stage was filled earlier),
//   so the wait cannot deadlock. The counters run on across items (fills / consumptions per CTA, same order).
// * Narrow token tiles: an item whose token tile holds ntok <= 96 valid rows runs the wgmma with N = 32 ceil(ntok /
//   32) instead of 128, and loads only those NT rows of the activation atoms (act32 .. act128 maps; 2 x NT x 128 B
//   per stage). Why: at 4096 Flash tokens an expert has ~96 rows, so the 128-token tile would spend ~25% of the MMA
//   work on padding rows whose columns are never stored. Each output column's dot product is the same k16 sequence
//   of the same operands at any N: the partials do not depend on the tile width.
// * Budget of one 128-K stage per SM (one CTA per SM), n128 item: 256 x 128 x 128 MAC = 2048 tensor cycles at the
//   dense BF16 rate; ~520 SASS per warp (the e2m1 dequant of 64 weight pairs, 8 scale decodes, 16 HGMMA with their
//   fences / waits, 8 LDS, the ring protocol), 8 warps on 4 schedulers = ~1040 issue cycles; 18 KiB of weights from
//   HBM and 2 x NT x 128 B of activations (mostly L2 hits: the n tiles of a token tile run close together). An n32
//   item has a quarter of the tensor cycles and the same weight bytes and dequant issue, so below ~1000 tokens the
//   issue and the weight stream, not the tensor pipe, set the pace.
namespace rs {
constexpr int kWCodes = kTileRows * 64;                       // 16 KiB of codes per stage
constexpr int kTiledBlock = kWCodes + kTileRows * 8;          // 18 KiB: a tiled stage (codes, its scales)
static_assert(kTiledBlock == 18432, "keep src/ops/moe_gemm/prefill.rs TILED_BLOCK_BYTES in sync");
constexpr int kSlotW = kActTile + kWCodes + kTileRows * 16;   // 52 KiB (slot layout above)
constexpr int kBytesW = kRingT * kSlotW;                      // 208 KiB (+ 1024 alignment slack from the host)
static_assert(kSlotW % 1024 == 0, "activation atoms must stay 1024-byte aligned");
static_assert(kSlotW >= kActTile + kTiledBlock, "a slot holds the activation atoms and the tiled weight block");
static_assert(kBytesW + 1024 == 214016, "keep src/ops/moe_gemm/prefill.rs SMEM_BYTES in sync");

// This thread's weights of the stage in ring slot `slot` (local tile row `lrow` = 128 wg + 16 wq + g): rows lrow and
// lrow + 8 of both m64 blocks, 16 code bytes at the lane's 32-K slice and its two block scales (scale rows pitch 8).
__device__ __forceinline__ void lds_weights(WStage& w, const uint8_t* slot, int lrow, int t) {
    const uint8_t* codes = slot + kActTile;
    const uint8_t* scales = slot + kActTile + kWCodes;
    constexpr int kScalePitch = 8;
#pragma unroll
    for (int mb = 0; mb < 2; ++mb) {
        const int r = lrow + 64 * mb;
        w.lo[mb] = *reinterpret_cast<const uint4*>(codes + r * 64 + 16 * t);
        w.hi[mb] = *reinterpret_cast<const uint4*>(codes + (r + 8) * 64 + 16 * t);
        const int so = 2 * t;
        w.sc[mb] = (uint32_t)*reinterpret_cast<const uint16_t*>(scales + r * kScalePitch + so) |
                   ((uint32_t)*reinterpret_cast<const uint16_t*>(scales + (r + 8) * kScalePitch + so) << 16);
    }
}

// The TMA ring as seen by one CTA (counters run on across its work items).
struct WRing {
    uint8_t* base;
    uint32_t base_u32;
    uint64_t* full;
    uint64_t* empty;
    uint32_t fills, cons;  // fills: thread 0 only; cons: CTA-uniform
    bool ok;               // thread 0: false after a timed-out empty wait (its fills stop)
};

// Producer (thread 0): stage st of the item (token rows from row0, weight tile `wtile` = e * N / 256 + n tile of the
// tiled weights) -> the next ring slot. act_map's box holds act_rows token rows (two boxes of act_rows x 128 bytes),
// then the stage's tiled block of kTiledBlock bytes by one 1D bulk copy: the expected transaction bytes.
__device__ __forceinline__ void wring_fill(WRing& r, const TmaDesc* act_map, uint32_t act_rows, const uint8_t* tiled,
                                           int stages, int st, int row0, int wtile) {
    const uint32_t slot = r.fills % kRingT;
    if (r.fills >= (uint32_t)kRingT && !mbar_wait(&r.empty[slot], ((r.fills / kRingT) - 1) & 1u)) {
        r.ok = false;
        return;
    }
    uint8_t* s = r.base + slot * kSlotW;
    mbar_arrive_expect_tx(&r.full[slot], 2u * act_rows * 128u + kTiledBlock);
    tma_load_2d(s, act_map, st * kStageK, row0, &r.full[slot]);
    tma_load_2d(s + kAtomBytes, act_map, st * kStageK + 64, row0, &r.full[slot]);
    bulk_load_1d(s + kActTile, tiled + ((size_t)wtile * stages + st) * kTiledBlock, kTiledBlock, &r.full[slot]);
    ++r.fills;
}

// Kernel-wide constants of the mainloop. act[i]: the activation tensor map with a box of 32 (i + 1) token rows (an
// item of NT-token wgmmas loads only the NT rows they read).
struct WCtx {
    const TmaDesc* act[4];
    const uint8_t* tiled;
    int N, stages;
};

// One work item with NT-token wgmmas (the ring protocol of the section header). False on a protocol timeout
// (outputs of the item unwritten). The activation boxes hold NT token rows (2 x NT x 128 bytes per stage instead of
// 32 KiB), at the same smem offsets (the first NT rows of each 128-row atom: rows 128 B apart, 8-row
// groups 1024 B apart, the same swizzle pattern), which are the only rows an NT-token wgmma reads.
template <int NT>
__device__ __forceinline__ bool wtma_item(WRing& r, const WCtx& x, int row0, int ntok, int wtile, int wrow0,
                                          int lrow, float* __restrict__ partial, float restore) {
    const int tid = threadIdx.x, lane = tid & 31, t = lane & 3;
    const int stages = x.stages;
    const TmaDesc* act = x.act[NT / 32 - 1];
    constexpr uint32_t kActRows = NT;
    if (tid == 0 && r.ok) {
        for (int st = 0; st < kRingT - 1 && st < stages && r.ok; ++st)
            wring_fill(r, act, kActRows, x.tiled, stages, st, row0, wtile);
    }
    __syncwarp();
    float d[2][64];
#pragma unroll
    for (int mb = 0; mb < 2; ++mb)
#pragma unroll
        for (int i = 0; i < 64; ++i) d[mb][i] = 0.f;
    bool timed_out = false;
    for (int st = 0; st < stages; ++st) {
        const uint32_t slot = r.cons % kRingT;
        // Protocol timeout: leave the loop (not return: a return with the last slice's wgmma in flight makes ptxas
        // inject a wait_group 0 at the top of every stage, draining the pipe the late release keeps full).
        if (!mbar_wait(&r.full[slot], (r.cons / kRingT) & 1u)) {
            timed_out = true;
            break;
        }
        WStage w;
        lds_weights(w, r.base + slot * kSlotW, lrow, t);
        const uint64_t db = sw128_desc(r.base_u32 + slot * kSlotW);
        mma_slice_n<NT>(d, w, 0, db);
        // wait_group 1 inside slice 0: every wgmma of the previous stage has completed -> release its slot.
        if (st > 0) mbar_arrive(&r.empty[(r.cons - 1) % kRingT]);
#pragma unroll
        for (int S = 1; S < 8; ++S) mma_slice_n<NT>(d, w, S, db);
        ++r.cons;
        if (tid == 0 && r.ok && st + kRingT - 1 < stages)
            wring_fill(r, act, kActRows, x.tiled, stages, st + kRingT - 1, row0, wtile);
        __syncwarp();
    }
    wgmma_wait<0>();
    if (timed_out) return false;
    mbar_arrive(&r.empty[(r.cons - 1) % kRingT]);  // the item's last stage
    if (tid == 0 && !r.ok) return false;
    fence_acc(d[0]);
    fence_acc(d[1]);
    store_partials_n<NT>(d, partial, x.N, row0, ntok, wrow0, t, restore);
    return true;
}
}  // namespace rs

// grid = persistent, block = 256, dynamic smem = rs::kBytesW + 1024. tiled: the tiled weights (layout above).
// act32 .. act128: 2D tensor maps over the pre-pass output [rows_total][K] BF16 (inner dim K) with boxes of 64 K x
// 32 / 64 / 96 / 128 token rows, SWIZZLE_128B. restore = 2^18 (NVFP4 A) or 2^9 (BF16 A): the accumulators hold
// sum * 2^-9 per dequantized operand. N % 256 == 0, K % 128 == 0, 1 <= experts <= 512 (checked by the launcher).
// offsets[E+1]: contiguous grouping (clamped to [0, rows_total] on the device so a bad value cannot fault).
// partial: [rows_total, N] fp32; rows owned by no expert are not written.
extern "C" __global__ void __launch_bounds__(rs::kThreads, 1) moe_gemm_prefill_rs_tiled(
    const uint8_t* __restrict__ tiled, int N, int K, const __grid_constant__ TmaDesc act32,
    const __grid_constant__ TmaDesc act64, const __grid_constant__ TmaDesc act96,
    const __grid_constant__ TmaDesc act128, float restore, const int* __restrict__ offsets, int experts,
    int rows_total, float* __restrict__ partial) {
    extern __shared__ uint8_t rs_tiled_smem_raw[];
    __shared__ int s_tile_prefix[kMaxExperts + 1];
    __shared__ int s_warp_sum[rs::kThreads / 32];
    __shared__ __align__(8) uint64_t bar_full[rs::kRingT], bar_empty[rs::kRingT];

    rs::WRing r;
    r.base = rs_tiled_smem_raw + ((1024u - (smem_u32(rs_tiled_smem_raw) & 1023u)) & 1023u);
    r.base_u32 = smem_u32(r.base);
    r.full = bar_full;
    r.empty = bar_empty;
    r.fills = 0;
    r.cons = 0;
    r.ok = true;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int lrow = 128 * (warp >> 2) + 16 * (warp & 3) + (lane >> 2);
    const int E = experts;
    rs::ring_init(bar_full, bar_empty);
    token_tile_prefix<rs::kThreads>(offsets, E, rows_total, s_warp_sum, s_tile_prefix);  // also publishes inits

    rs::WCtx x;
    x.act[0] = &act32;
    x.act[1] = &act64;
    x.act[2] = &act96;
    x.act[3] = &act128;
    x.tiled = tiled;
    x.N = N;
    x.stages = K / rs::kStageK;
    const int n_tiles = N / rs::kTileRows;
    const long long items = (long long)s_tile_prefix[E] * n_tiles;
    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        const TileItem it = locate_item(item, n_tiles, s_tile_prefix, E, offsets, rows_total);
        const int wtile = it.e * n_tiles + it.n_tile;  // the tile's index in the tiled weights (stages blocks each)
        const int wrow0 = it.n_tile * rs::kTileRows + lrow;
        const int nt = (it.ntok + 31) & ~31;  // CTA-uniform
        bool ok;
        if (nt == 32)
            ok = rs::wtma_item<32>(r, x, it.row0, it.ntok, wtile, wrow0, lrow, partial, restore);
        else if (nt == 64)
            ok = rs::wtma_item<64>(r, x, it.row0, it.ntok, wtile, wrow0, lrow, partial, restore);
        else if (nt == 96)
            ok = rs::wtma_item<96>(r, x, it.row0, it.ntok, wtile, wrow0, lrow, partial, restore);
        else
            ok = rs::wtma_item<128>(r, x, it.row0, it.ntok, wtile, wrow0, lrow, partial, restore);
        if (!ok) return;
    }
}

// The weights' tiling read by moe_gemm_prefill_rs_tiled and by the decode mainloop (weight preparation, once per
// weight set): codes [E*N][K/2] and scales [E*N][K/16] -> blocks of 18432 bytes as described at the mainloop. One
// thread per 16-byte output unit: units 0..1023 of a block are code rows (unit u: row u / 4, bytes 16 (u % 4) of the
// stage's 64), units 1024..1151 scale row pairs (unit u: rows 2 (u - 1024) and + 1, 8 bytes each). N % 256 == 0,
// K % 128 == 0.
extern "C" __global__ void moe_gemm_prefill_tile_weights_rs(const uint8_t* __restrict__ codes,
                                                            const uint8_t* __restrict__ scales, int experts, int N,
                                                            int K, uint8_t* __restrict__ tiled) {
    constexpr int kUnits = rs::kTiledBlock / 16;  // 1152
    const int stages = K / rs::kStageK;
    const long long blocks = (long long)experts * (N / rs::kTileRows) * stages;
    const long long total = blocks * kUnits;
    for (long long q = (long long)blockIdx.x * blockDim.x + threadIdx.x; q < total;
         q += (long long)gridDim.x * blockDim.x) {
        const long long b = q / kUnits;
        const int u = (int)(q % kUnits);
        const int st = (int)(b % stages);
        const long long tile = b / stages;  // e * (N / 256) + n_tile: its first weight row is 256 * tile
        uint4 v;
        if (u < 1024) {
            const long long row = tile * rs::kTileRows + u / 4;
            v = *reinterpret_cast<const uint4*>(codes + row * (K / 2) + st * 64 + 16 * (u % 4));
        } else {
            const long long row = tile * rs::kTileRows + 2 * (u - 1024);
            const uint2 a = *reinterpret_cast<const uint2*>(scales + row * (K / 16) + st * 8);
            const uint2 c = *reinterpret_cast<const uint2*>(scales + (row + 1) * (K / 16) + st * 8);
            v = make_uint4(a.x, a.y, c.x, c.y);
        }
        *reinterpret_cast<uint4*>(tiled + b * rs::kTiledBlock + 16 * u) = v;
    }
}
