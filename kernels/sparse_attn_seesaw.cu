// sparse_attn_seesaw: the decode attention of kernels/sparse_attn.cu (`sparse_attn_decode_fp8`, same inputs, same
// outputs, same numerics) under a warp-specialized main loop: one producer warp group streams and dequantizes the
// FP8 entries, two consumer warp groups run QK^T / softmax / P.V on alternate tiles in a seesaw, so that one group's
// softmax and O rescale overlap the other group's tensor-core work (issue #26; design and cycle budget:
// docs/deep-dive-2026-12-06-sparse-attn-budget.md sections 1 and 4, the compact budget at the top of
// kernels/sparse_attn.cu).
//
// Entry point
//   sparse_attn_decode_fp8_seesaw  grid (heads / 64, n_splits, batch), block 384, dynamic smem kSsSmemBytes; the
//                                  SA_DECODE_PARAMS of sparse_attn.cu. n_splits == 1 writes `out` (BF16, sink,
//                                  inverse RoPE), n_splits > 1 writes part_o / part_lse in the layout of
//                                  store_split_partial, merged by sparse_attn.cu's combines. Path::Fp8Seesaw.
//
// Per-tile budget (64 entries x 64 rows; derivation in the deep dive, section 1): tensor 2,048 clk (QK^T 32 x
// m64n64k16 in one group 1,024 + P.V 2 groups x 4 x m64n256k16 1,024) = 1.38-1.41 us at the measured BF16 rate;
// shared memory 272 KiB = 2,176 clk (one QK^T group reads q once: 64 KB; K 64 KB; V 64 KB; P 8 KB read by the other
// group; dequant writes 64 KB; P writes 8 KB); HBM 37,376 B = 2,290 clk of an SM's share (Flash); dequant 890 issue
// clk over the 4 producer warps; softmax 256 MUFU clk. Predicted ~1.75 us (1.55-2.0) per tile against 3.11 us for
// sparse_attn_decode_fp8. Measured: (to be filled in by the GPU A/B, bench config sparse_attn.toml).
//
// Roles (384 threads, __launch_bounds__(384, 1), registers rebalanced with setmaxnreg: 128 x (104 + 2 x 200) =
// 64,512 = the 168 x 384 the CTA starts with; the design's 96 / 208 / 208 sums to 512 x 128 and would hang
// setmaxnreg.inc)
//   * consumer group wh = 0 (threads 0..127, warps 0..3) owns the even tiles of the CTA's range and output dims
//     0..255; consumer group wh = 1 (threads 128..255, warps 4..7) the odd tiles and dims 256..511. Warp wm of a
//     group holds rows 16 wm + g, +8 (g = lane / 4): the warp layout of sparse_attn_decode_fp8, so the epilogue
//     (finish_staged, row_sums with pair barriers 1..4) is that kernel's code.
//   * producer group (threads 256..383): thread p converts quarter q = p % 4 of entries e = p / 4 and e + 32 of
//     every tile (load_raw_regs_based / dequant_regs, the exact e4m3 x 2^k -> BF16 images), one tile of raw loads
//     (2 x 19 x 8 B = 76 registers) in flight ahead of the stage it converts into, and writes the tile's resolved
//     candidate indices (the mask). ptxas (nvcc 13, sm_90a): 0 spills; the producer's code uses R0..R101 of its
//     104, the consumers' R0..R191 of their 200; 32-byte stack = sincosf's slow path, as in sparse_attn_decode_fp8.
//
// Seesaw, per tile t (owner G = t & 1, other group H = 1 - G), both groups keep the same running row max m:
//   owner G:   S_t = q K_t^T (32 x m64n64k16, SS)  ->  m_t = max(m_{t-1}, rowmax S_t), alpha_t = 2^(m_{t-1} - m_t),
//              P_t = 2^(S_t - m_t) (f32; l_G = l_G alpha_t + sum P_t, unrounded), P_t -> BF16 registers and the
//              swizzled P block of G, m_t -> the m buffer of G  ->  O_G = O_G alpha_t + P_t V_t[dims of G] (RS).
//   other H:   reads m_t, alpha_t = 2^(m_{t-1} - m_t) (the owner's expression on the same values: the same float),
//              l_H *= alpha_t, O_H = O_H alpha_t + P_t V_t[dims of H] (SS, P_t from G's block).
//   Group G's loop over its own tiles t = G, G + 2, ...: [retire its P.V of t-2, release stage t-2] -> [wait stage
//   t full, issue QK^T(t)] -> [wait m / P of t-1 from H, rescale O, issue P.V(t-1) SS] -> [wait QK^T(t), softmax(t),
//   publish m / P of t] -> [retire P.V(t-1), release stage t-1] -> [rescale O, issue P.V(t) RS]. While G runs its
//   softmax, H's QK^T(t+1) and G's P.V(t-1) are queued on the tensor cores; while H runs softmax(t+1), G's P.V(t) and
//   QK^T(t+2) are. The m chain (softmax t needs m_{t-1}) is the one serial dependency between the groups.
//   Passes: a first pass (group 0: tile 0 alone; group 1: tile 1 folding in tile 0), steady passes t < n_it (own and
//   other, straight-line: the P.V of t stays in flight across the loop's back edge), and a last pass that folds in
//   the other group's tile n_it - 1 when it is the other's. Every wgmma wait count is compile-time in each pass
//   and everything is retired between the passes' branches (ptxas serializes all wgmma of a kernel when a path may
//   touch an in-flight accumulator: C7514 / C7520; checked: no such report, HGMMA issued back to back).
//
// Barriers
//   full[s]  (mbarrier, count 128): the producer's 128 threads arrive after writing stage s and its indices
//            (generic stores, then fence.proxy.async); consumers wait parity (t >> 1) & 1 for tile t.
//   empty[s] (mbarrier, count 256): every consumer thread arrives once its warp group's last wgmma reading tile t
//            in stage s (the owner's RS P.V, the other's SS P.V; QK^T precedes them in commit order) has retired;
//            the producer waits parity ((t - 2) >> 1) & 1 before writing tile t into stage t & 1.
//   named 5 + G (bar.arrive by G's 128 threads / bar.sync by H's 128): "m_t and P_t of G's tile t are published".
//   named 7 (bar.sync, 256): the consumers' CTA-wide step of finish_staged (the producer has left by then).
//   named 1..4 (bar.sync, 64): row_sums' pair barriers (warps wm and wm + 4), as in sparse_attn_decode_fp8.
//   CTA barrier 0 (barrier.sync, all 384, once): mbarrier init, q image, rope table visible before the loop.
//
// Shared memory (bytes, the base aligned to 1024 in the kernel)
//   kSsQ      65,536  q image, 128B-swizzled (common/sparse_attn_common.cuh layout)
//   kSsStage 131,072  two K = V stages (the BF16 images), later the epilogue's BF16 staging image
//   kSsP      16,384  the P block of group 0 (even tiles) and of group 1 (odd tiles)
//   kSsM         512  the owner's row max m_t per group [2][64] f32
//   kSsRedSum    512  row_sums' exchange
//   kSsIdx       512  the resolved candidate index of every entry of each stage [2][64] (-1 = masked)
//   kSsBars       32  full[2], empty[2]
//   kSsRopeCs    256  cos / sin of the 32 rope pairs at the query position (finish_staged)
//   + 1,024 alignment slack = 215,840 of 232,448.
//
// Identities this loop relies on (each with where it is established)
//   * Numerics are sparse_attn_decode_fp8's: q quantized per (head, 64-tile) to UE8M0 x e4m3 and held as exact BF16
//     (store_q_image), K = V exact BF16 images (dequant_regs), f32 accumulation in wgmma, scores scaled to the log2
//     domain and masked as there, P rounded to BF16 only for P.V, the f32 P in the row sum, the sink only in the final
//     denominator (finish_staged / the combines). Only the summation order differs: the running max advances one
//     64-entry tile at a time (not per 32-entry half) and l is summed per group before the pair sum, so results are
//     not bit-identical to Path::Fp8; they are within the same f64-reference tolerance (tests/sparse_attn.rs).
//   * Both groups hold the same m after every tile: the owner sets m = fmaxf(m, rowmax); the other copies that
//     float; both evaluate alpha = exp2f(m_old - m_use) on equal inputs. So l = l_0 + l_1 and O = [O_0 | O_1] are
//     scaled consistently, and finish_staged sees the same m in both groups (its lse and sink terms).
//   * The m64n64 accumulator of QK^T holds, in warp wm, lane (g, tq), rows 16 wm + g (+8) and columns 8 j + 2 tq
//     (+1) in acc[4 j .. 4 j + 3]: a warp owns whole rows, so the row max is a quad reduction (no cross-warp step).
//     Packed to BF16 pairs, acc[8 k .. 8 k + 7] are the m64k16 A fragment {a0, a1, a2, a3} = {(g, 2tq), (g+8, 2tq),
//     (g, 8+2tq), (g+8, 8+2tq)} of entries 16 k ..: P feeds the owner's P.V from registers.
//   * P of tile t in G's block is overwritten (by tile t + 2) only after H's SS P.V of tile t retired: G writes it
//     after waiting full for tile t + 2, which needs empty of tile t, which needs H's arrival after that retire.
//     m_t is overwritten (by m_{t+2}) only after H read it: H reads m_t before it publishes m_{t+1}, which G waits
//     for before its softmax of t + 2.
//   * Named-barrier phases cannot lap: G publishes tile t + 2 only after reading m_{t+1}, which H publishes only after
//     it passed its sync on tile t. Every publish has exactly one matching sync (tiles t <= n - 1 are synced by the
//     other group at its pass t + 1 <= n).
//   * No deadlock through the stages: a group waits full for tile t only after it released tile t - 2 (its own P.V
//     retired at the top of the pass), and the other group's release of t - 2 happens in its pass t - 1, which needs
//     nothing from this group after this group's pass t - 2.
//   * Graph safety: every loop bound derives from lengths / tiles_per_split read on the device (tile_range).
#include <cuda_bf16.h>
#include <stdint.h>

#include "sparse_attn_common.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace sa {

constexpr int kSsProducerRegs = 104;      // setmaxnreg of the producer group
constexpr int kSsConsumerRegs = 200;      // setmaxnreg of each consumer group
static_assert(kSsProducerRegs + 2 * kSsConsumerRegs == 3 * 168,
              "setmaxnreg moves registers between groups: the sum stays the 168 x 384 of __launch_bounds__(384, 1)");
static_assert(kSsProducerRegs % 8 == 0 && kSsConsumerRegs % 8 == 0, "setmaxnreg counts are multiples of 8");

constexpr int kBarMaxReady = 5;  // + G: group G published m_t / P_t of its tile t (bar.arrive G, bar.sync 1 - G)
constexpr int kBarMath = 7;      // the 256 consumer threads (finish_staged's math_sync)

constexpr int kSsQ = 0;
constexpr int kSsStage = kSsQ + kSwTileBytes;         // two K = V stages
constexpr int kSsP = kSsStage + 2 * kSwTileBytes;     // P block of group 0, group 1
constexpr int kSsM = kSsP + 2 * kPswBytes;            // [2][64] f32
constexpr int kSsRedSum = kSsM + 2 * kHeadsPerCta * 4;
constexpr int kSsIdx = kSsRedSum + kRedBytes;         // [2][64] i32
constexpr int kSsBars = kSsIdx + 2 * kBlockN * 4;     // full[2], empty[2]
constexpr int kSsRopeCs = kSsBars + 4 * 8;
constexpr int kSsSmemBytes = kSsRopeCs + 32 * 8 + 1024;
static_assert(kSsSmemBytes == 215840, "mirror SEESAW_SMEM_BYTES in src/ops/sparse_attn/mod.rs");
static_assert(kSsSmemBytes <= 232448, "sm_90 opt-in shared memory");
static_assert(kSsStage % 1024 == 0 && kSsP % 1024 == 0, "wgmma tiles 1024-aligned");
static_assert(kSsBars % 8 == 0, "mbarriers 8-byte aligned");

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
// Non-aligned CTA barrier: the producer and the consumers reach it from different call sites.
__device__ __forceinline__ void cta_barrier_all() { asm volatile("barrier.sync 0;\n" ::: "memory"); }
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
struct SyncMath {
    __device__ __forceinline__ void operator()() const { named_sync(kBarMath, 256); }
};

__device__ __forceinline__ void wgmma_wait_1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }

// Keeps the A-fragment registers of an in-flight RS wgmma alive (and unmoved) until the wait that retires it.
__device__ __forceinline__ void fence_regs(uint32_t (&r)[16]) {
#pragma unroll
    for (int i = 0; i < 16; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// D(64 x 64, f32) += A(64 x 16 bf16, smem desc) * B(64 x 16 bf16, smem desc)^T; both K-major.
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(1));
}

// D(64 x 256, f32, the WarpState O layout) += A(64 x 16 bf16, registers: the m64k16 A fragment) * B(16 x 256 bf16,
// N-major smem desc, imm-trans-b = 1).
__device__ __forceinline__ void wgmma_m64n256k16_rs(float (&d)[32][4], uint32_t a0, uint32_t a1, uint32_t a2,
                                                    uint32_t a3, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]), "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]), "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]), "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]), "+f"(d[25][0]), "+f"(d[25][1]), "+f"(d[25][2]), "+f"(d[25][3]), "+f"(d[26][0]), "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]), "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), "+f"(d[27][3]), "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]), "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]), "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]), "+f"(d[31][0]), "+f"(d[31][1]), "+f"(d[31][2]), "+f"(d[31][3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(1));
}

// The tile's owner: online-softmax step on its 64 x 64 scores. acc = the QK^T accumulator; idx = the stage's
// resolved candidate indices (>= 0: valid). Scores scaled / masked and the softmax evaluated with the expressions of
// sparse_attn_decode_fp8's softmax_step (the running max over 64 entries at once). Outputs: P (BF16 pairs, p[2 j] row
// row0, p[2 j + 1] row row0 + 8, entries 8 j + 2 tq, +1) in registers and in the swizzled P block psw, the new row
// max in m_out (tq == 0 lanes), alpha (the O rescale factor). st.l is rescaled and accumulates the f32 P.
__device__ __forceinline__ void own_softmax(WarpState& st, const float (&acc)[32], const int* idx, uint32_t (&p)[16],
                                            uint8_t* psw, float* m_out, int row0, int g, int tq, float (&alpha)[2]) {
    float s[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int2 v = *reinterpret_cast<const int2*>(idx + 8 * j + 2 * tq);
        const bool v0 = v.x >= 0, v1 = v.y >= 0;
        s[j][0] = v0 ? acc[4 * j + 0] * kScoreScaleLog2 : -INFINITY;
        s[j][1] = v1 ? acc[4 * j + 1] * kScoreScaleLog2 : -INFINITY;
        s[j][2] = v0 ? acc[4 * j + 2] * kScoreScaleLog2 : -INFINITY;
        s[j][3] = v1 ? acc[4 * j + 3] * kScoreScaleLog2 : -INFINITY;
    }
    float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        tmax[0] = fmaxf(tmax[0], fmaxf(s[j][0], s[j][1]));
        tmax[1] = fmaxf(tmax[1], fmaxf(s[j][2], s[j][3]));
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 1));
        tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 2));
    }
    float m_use[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float m_new = fmaxf(st.m[r], tmax[r]);
        // While nothing valid has been seen m_new is -inf; subtracting 0 keeps exp2 finite (exp2(-inf) = 0).
        m_use[r] = (m_new == -INFINITY) ? 0.f : m_new;
        alpha[r] = exp2f(st.m[r] - m_use[r]);
        st.m[r] = m_new;
        st.l[r] *= alpha[r];
    }
    if (tq == 0) {
        m_out[row0] = st.m[0];
        m_out[row0 + 8] = st.m[1];
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float p0 = exp2f(s[j][0] - m_use[0]);
        const float p1 = exp2f(s[j][1] - m_use[0]);
        const float p2 = exp2f(s[j][2] - m_use[1]);
        const float p3 = exp2f(s[j][3] - m_use[1]);
        st.l[0] += p0 + p1;
        st.l[1] += p2 + p3;
        p[2 * j] = pack_bf16x2(p0, p1);
        p[2 * j + 1] = pack_bf16x2(p2, p3);
        // Entries 8 j + 2 tq (+1) = chunk j, bytes 4 tq; rows row0 and row0 + 8 share row & 7 = g.
        const uint32_t inrow = (uint32_t)(((j ^ g) << 4) + 4 * tq);
        *reinterpret_cast<uint32_t*>(psw + row0 * 128 + inrow) = p[2 * j];
        *reinterpret_cast<uint32_t*>(psw + (row0 + 8) * 128 + inrow) = p[2 * j + 1];
    }
}

// The other group's tile: adopt the owner's new row max (m_in, rows row0 and row0 + 8) and rescale l; alpha as the
// owner computed it (same expression, same inputs).
__device__ __forceinline__ void follow_max(WarpState& st, const float* m_in, int row0, float (&alpha)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float m_new = m_in[row0 + 8 * r];
        const float m_use = (m_new == -INFINITY) ? 0.f : m_new;
        alpha[r] = exp2f(st.m[r] - m_use);
        st.m[r] = m_new;
        st.l[r] *= alpha[r];
    }
}

// O *= alpha per row, skipped when no row of the warp moved its max (x * 1.0f == x: the result is the same).
__device__ __forceinline__ void rescale_o(WarpState& st, const float (&alpha)[2]) {
    if (__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) return;
#pragma unroll
    for (int nt = 0; nt < 32; ++nt) {
        st.o[nt][0] *= alpha[0];
        st.o[nt][1] *= alpha[0];
        st.o[nt][2] *= alpha[1];
        st.o[nt][3] *= alpha[1];
    }
}

// Every consumer thread arrives on empty[s] once its warp group's wgmma reads of the stage have retired.
__device__ __forceinline__ void release_stage(uint64_t* empty_bar) { mbar_arrive(empty_bar); }

// load_raw_regs (common/sparse_attn_common.cuh): the same bytes into the same RawRegs slots, addressed from four
// base pointers so that every chunk offset is an immediate. With the shared form's per-chunk address expression
// ptxas keeps fourteen 64-bit chunk addresses live across the producer's loop and spills them at 104 registers.
// Chunk of nope slot i: 8 (i >> 1) + q + 4 ((i & 1) ^ odd) -> byte 64 (i >> 1) + 8 q + 32 ((i & 1) ^ odd).
__device__ __forceinline__ void load_raw_regs_based(RawRegs& r, const uint8_t* __restrict__ pool, int idx, int q,
                                                    int odd) {
    if (idx >= 0) {
        const uint8_t* entry = pool + (size_t)idx * kEntryBytes;
        const uint8_t* even = entry + 8 * q + 32 * odd;       // slots i = 0, 2, .., 12
        const uint8_t* oddp = entry + 8 * q + 32 * (odd ^ 1);  // slots i = 1, 3, .., 13
        const uint8_t* rope = entry + kRopeOffset + 16 * q;
#pragma unroll
        for (int i = 0; i < 14; ++i)
            r.nope[i] = __ldg(reinterpret_cast<const uint2*>(((i & 1) ? oddp : even) + 64 * (i >> 1)));
        r.sc = __ldg(reinterpret_cast<const uint2*>(entry + kScaleOffset));
#pragma unroll
        for (int j = 0; j < 4; ++j) r.rope[j] = __ldg(reinterpret_cast<const uint2*>(rope + 8 * (j & 1) + 64 * (j >> 1)));
    } else {  // zero codes and scale code 0: K = V = 0, never NaN (the score is masked anyway)
#pragma unroll
        for (int i = 0; i < 14; ++i) r.nope[i] = make_uint2(0u, 0u);
        r.sc = make_uint2(0u, 0u);
#pragma unroll
        for (int j = 0; j < 4; ++j) r.rope[j] = make_uint2(0u, 0u);
    }
}

// The producer warp group: tiles t = 0 .. n_it - 1 of the CTA's range into stage t & 1. Thread p owns quarter
// dq = p % 4 of entries e0 = p / 4 and e1 = e0 + 32 (the dequant's (entry, quarter) unit of sparse_attn_decode_fp8,
// two per thread). Registers r0 / r1 hold tile t's raw chunks on entry to iteration t; right after converting r0
// (r1) the thread issues r0's (r1's) loads of tile t + 1, so one tile of raw loads is in flight while the thread
// waits for the next stage. The indices of tile t + 1 are resolved at the top of iteration t (before the stage
// wait, whose latency covers theirs). Invalid candidates (-1, past the length, outside the pool) convert to zeros
// and are masked by the consumers through the indices written next to the stage.
__device__ __forceinline__ void seesaw_producer(const DecodeArgs& a, uint8_t* smem, RawRegs& r0, RawRegs& r1,
                                                int (&idx)[2], int b, int len, int t_begin, int n_it, int p) {
    const int e0 = p >> 2, dq = p & 3, odd = e0 & 1;  // e1 = e0 + 32 has the same parity
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + kSsBars);
    uint64_t* empty = full + 2;
    int* idx_ring = reinterpret_cast<int*>(smem + kSsIdx);
    for (int t = 0; t < n_it; ++t) {
        const int s = t & 1;
        int idx_next[2] = {-1, -1};
        if (t + 1 < n_it) {
            idx_next[0] = resolve_candidate(a, b, len, (t_begin + t + 1) * kBlockN + e0);
            idx_next[1] = resolve_candidate(a, b, len, (t_begin + t + 1) * kBlockN + e0 + 32);
        }
        // Stage s last held tile t - 2: wait for both consumer groups to release it.
        if (t >= 2) mbar_wait(empty + s, (uint32_t)(((t - 2) >> 1) & 1));
        uint8_t* stage = smem + kSsStage + s * kSwTileBytes;
        dequant_regs(r0, stage, e0, dq, odd);
        if (t + 1 < n_it) load_raw_regs_based(r0, a.pool, idx_next[0], dq, odd);
        dequant_regs(r1, stage, e0 + 32, dq, odd);
        if (t + 1 < n_it) load_raw_regs_based(r1, a.pool, idx_next[1], dq, odd);
        if (dq == 0) {
            idx_ring[s * kBlockN + e0] = idx[0];
            idx_ring[s * kBlockN + e0 + 32] = idx[1];
        }
        fence_proxy_async();  // the stage's generic stores -> the consumers' wgmma (async proxy) reads
        mbar_arrive(full + s);
        idx[0] = idx_next[0];
        idx[1] = idx_next[1];
    }
}

// What a consumer warp group's passes share (loop invariants).
struct ConsumerCtx {
    uint64_t* full;
    uint64_t* empty;
    const int* idx_ring;
    float* m_own;          // the m buffer this group publishes into
    const float* m_other;  // the m buffer of the other group
    uint8_t* psw_own;      // this group's P block
    uint64_t p_desc_other; // the other group's P block as a wgmma A descriptor
    uint32_t q_base, stage_base;
    int G, row0, g, tq;
};

// Retire every wgmma of this warp group (a wait with nothing pending returns at once).
__device__ __forceinline__ void retire_all(WarpState& st, uint32_t (&p)[16]) {
    wgmma_wait_all();
    fence_acc_o(st.o);
    fence_regs(p);
}

// One pass of consumer group G at its tile t (the seesaw order of the header). kOwn: tile t is G's (t < n_it): QK^T,
// softmax, publish, P.V from registers. kOther: tile t - 1 (the other group's) is folded in: adopt its max, P.V from
// its P block. On entry at most G's own P.V of tile t - 2 is in flight; on return (kOwn) G's P.V of tile t is.
// The wait_group counts are compile-time per instantiation: ptxas checks the accumulator hazards path by path and
// serializes every wgmma of the kernel when a path reads an accumulator that may be in flight (C7514), so the passes
// carry no run-time branch around a wgmma (the caller's branches between passes retire everything first).
template <bool kOwn, bool kOther>
__device__ __forceinline__ void consumer_pass(WarpState& st, uint32_t (&p)[16], const ConsumerCtx& c, int t) {
    // ---- retire G's P.V of tile t - 2 (RS: reads p); release that stage ----
    retire_all(st, p);
    if (t >= 2) release_stage(c.empty + (t & 1));
    // ---- S_t = q K_t^T, issued async ----
    float acc[32];
    if (kOwn) {
        mbar_wait(c.full + (t & 1), (uint32_t)((t >> 1) & 1));
        const uint32_t kt = c.stage_base + (uint32_t)((t & 1) * kSwTileBytes);
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[i] = 0.f;
        fence_acc(acc);
        wgmma_fence();
#pragma unroll
        for (int kb = 0; kb < 8; ++kb) {
            const uint64_t da = sw128_desc(c.q_base + kb * kSwBlockBytes);
            const uint64_t db = sw128_desc(kt + kb * kSwBlockBytes);
#pragma unroll
            for (int k = 0; k < 4; ++k) wgmma_m64n64k16(acc, da + 2 * k, db + 2 * k);
        }
        wgmma_commit();
    }
    // ---- the other group's tile t - 1: adopt its max, rescale, O_G += P_{t-1} V_{t-1} (SS) ----
    if (kOther) {
        named_sync(kBarMaxReady + 1 - c.G, 256);
        float alpha[2];
        follow_max(st, c.m_other, c.row0, alpha);
        rescale_o(st, alpha);
        const uint64_t v_desc = sw128_desc_mn(c.stage_base + (uint32_t)(((t - 1) & 1) * kSwTileBytes) +
                                              (uint32_t)(4 * c.G * kSwBlockBytes));
        fence_acc_o(st.o);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k) wgmma_m64n256k16_tb(st.o, c.p_desc_other + 2 * k, v_desc + (2048 >> 4) * k);
        wgmma_commit();
    }
    if (!kOwn) return;
    // ---- wait QK^T(t) (P.V(t-1), committed after it, may stay in flight), softmax, publish m_t and P_t ----
    if (kOther)
        wgmma_wait_1();
    else
        wgmma_wait_all();
    fence_acc(acc);
    float alpha[2];
    own_softmax(st, acc, c.idx_ring + (t & 1) * kBlockN, p, c.psw_own, c.m_own, c.row0, c.g, c.tq, alpha);
    fence_proxy_async();  // P_t's generic stores -> the other group's wgmma reads
    named_arrive(kBarMaxReady + c.G, 256);
    // ---- retire P.V(t-1), release its stage; O_G = O_G alpha_t + P_t V_t (RS) ----
    if (kOther) {
        wgmma_wait_all();
        fence_acc_o(st.o);
        release_stage(c.empty + ((t - 1) & 1));
    }
    rescale_o(st, alpha);
    const uint64_t v_desc =
        sw128_desc_mn(c.stage_base + (uint32_t)((t & 1) * kSwTileBytes) + (uint32_t)(4 * c.G * kSwBlockBytes));
    fence_acc_o(st.o);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k)
        wgmma_m64n256k16_rs(st.o, p[4 * k], p[4 * k + 1], p[4 * k + 2], p[4 * k + 3], v_desc + (2048 >> 4) * k);
    wgmma_commit();
}

// A consumer warp group (wh = G) over the CTA's n_it tiles: a first pass (t = G: group 0 owns tile 0 alone, group 1
// owns tile 1 and folds in tile 0), the steady passes t = G + 2, G + 4, ... < n_it (own and other), and, when the
// last tile is the other group's (t reaches n_it), a last pass that folds it in. Returns with every wgmma retired
// and st holding O_G, the common m and l_G.
__device__ __forceinline__ void seesaw_consumer(WarpState& st, uint8_t* smem, int n_it, int wm, int wh, int g,
                                                int tq) {
    ConsumerCtx c;
    c.full = reinterpret_cast<uint64_t*>(smem + kSsBars);
    c.empty = c.full + 2;
    c.idx_ring = reinterpret_cast<const int*>(smem + kSsIdx);
    c.G = wh;
    c.m_own = reinterpret_cast<float*>(smem + kSsM) + wh * kHeadsPerCta;
    c.m_other = reinterpret_cast<const float*>(smem + kSsM) + (1 - wh) * kHeadsPerCta;
    c.psw_own = smem + kSsP + wh * kPswBytes;
    c.p_desc_other = sw128_desc(smem_addr(smem + kSsP + (1 - wh) * kPswBytes));
    c.q_base = smem_addr(smem + kSsQ);
    c.stage_base = smem_addr(smem + kSsStage);
    c.row0 = 16 * wm + g;
    c.g = g;
    c.tq = tq;
    uint32_t p[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) p[i] = 0u;

    if (wh == 0) {
        if (n_it > 0) consumer_pass<true, false>(st, p, c, 0);
    } else {
        if (n_it > 1)
            consumer_pass<true, true>(st, p, c, 1);
        else if (n_it == 1)
            consumer_pass<false, true>(st, p, c, 1);
    }
    retire_all(st, p);  // no wgmma in flight across the join of the branches above
    int t = wh + 2;
    for (; t < n_it; t += 2) consumer_pass<true, true>(st, p, c, t);
    retire_all(st, p);
    if (t == n_it) consumer_pass<false, true>(st, p, c, t);  // t >= 2: the last tile is the other group's
    retire_all(st, p);
}

__device__ __forceinline__ void decode_seesaw_body(const DecodeArgs& a) {
    extern __shared__ __align__(16) uint8_t smem_unaligned[];
    uint8_t* smem = smem_unaligned + ((1024u - (smem_addr(smem_unaligned) & 1023u)) & 1023u);
    const int hg = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
    // The warp index through a shuffle: ptxas then knows it (and the warp group, the loop bounds derived from it) is
    // warp-uniform; wgmma under a branch it must treat as divergent is serialized (C7520).
    const int tid = threadIdx.x, lane = tid & 31, warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
    int len, t_begin, n_it;
    tile_range(a, b, split, len, t_begin, n_it);

    if (tid == 0) {
        uint64_t* bars = reinterpret_cast<uint64_t*>(smem + kSsBars);
        mbar_init(bars + 0, 128);  // full[0], full[1]: the producer's 128 threads
        mbar_init(bars + 1, 128);
        mbar_init(bars + 2, 256);  // empty[0], empty[1]: the 256 consumer threads
        mbar_init(bars + 3, 256);
    }

    if (warp >= 8) {
        // ---- producer: tile 0's raw entries in flight across the CTA barrier ----
        setmaxnreg_dec<kSsProducerRegs>();
        const int p = tid - 256, e0 = p >> 2, dq = p & 3, odd = e0 & 1;
        int idx[2] = {-1, -1};
        RawRegs r0, r1;
        if (n_it > 0) {
            idx[0] = resolve_candidate(a, b, len, t_begin * kBlockN + e0);
            idx[1] = resolve_candidate(a, b, len, t_begin * kBlockN + e0 + 32);
            load_raw_regs_based(r0, a.pool, idx[0], dq, odd);
            load_raw_regs_based(r1, a.pool, idx[1], dq, odd);
        }
        cta_barrier_all();
        seesaw_producer(a, smem, r0, r1, idx, b, len, t_begin, n_it, p);
        return;
    }

    // ---- consumers: the q image (8 warps x 8 heads, sparse_attn_decode_fp8's prologue), the rope table ----
    setmaxnreg_inc<kSsConsumerRegs>();
    const int wm = warp & 3, wh = warp >> 2, g = lane >> 2, tq = lane & 3;
    {
        uint4 raw[8][2];
        load_q_rows(raw, a, b, hg, warp, lane);
        if (a.n_splits == 1 && tid < 32) {
            float sn, cs;
            sincosf(__fmul_rn(static_cast<float>(a.positions[b]), __ldg(a.freqs + tid)), &sn, &cs);
            reinterpret_cast<float2*>(smem + kSsRopeCs)[tid] = make_float2(cs, sn);
        }
        store_q_image(raw, smem + kSsQ, warp, lane);
    }
    fence_proxy_async();  // q's generic stores -> wgmma reads (after the CTA barrier)
    WarpState st;
#pragma unroll
    for (int nt = 0; nt < 32; ++nt) st.o[nt][0] = st.o[nt][1] = st.o[nt][2] = st.o[nt][3] = 0.f;
    st.m[0] = st.m[1] = -INFINITY;
    st.l[0] = st.l[1] = 0.f;
    cta_barrier_all();  // mbarriers initialized; q image and rope table visible

    seesaw_consumer(st, smem, n_it, wm, wh, g, tq);
    finish_staged(st, a, reinterpret_cast<float*>(smem + kSsRedSum), reinterpret_cast<const float2*>(smem + kSsRopeCs),
                  smem + kSsStage, b, hg, split, wm, wh, g, tq, tid, SyncMath{});
}

}  // namespace sa

// Path::Fp8Seesaw (bench "fp8_seesaw"). grid (heads/64, n_splits, batch), block 384, dynamic smem sa::kSsSmemBytes;
// n_splits == 1 writes `out`, n_splits > 1 writes part_o / part_lse for sparse_attn.cu's combines.
extern "C" __global__ void __launch_bounds__(384, 1) sparse_attn_decode_fp8_seesaw(SA_DECODE_PARAMS) {
    sa::decode_seesaw_body(SA_DECODE_ARGS);
}
