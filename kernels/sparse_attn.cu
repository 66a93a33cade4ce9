// sparse_attn: DeepSeek-V4 decode attention over a gathered candidate set (sliding window ++ selected
// compressed entries), reading the 584-byte FP8 KV cache directly.
//
// KV entry (formats::kv layout, 584 B): [0,448) e4m3 nope codes in 7 tiles of 64, [448,576) 64 BF16 rope
// dims, [576,583) 7 UE8M0 tile scales, [583] pad. The cache is a pool of entries indexed by i32; a candidate
// list row holds pool indices (-1 = invalid). Entries are only 8-byte aligned (584 = 8 * 73), so every
// global access to an entry is 8 bytes wide.
//
// The FP8 kernel, the BF16 baseline and the merges share the entry constants, the online softmax, the finish /
// inverse RoPE pieces and the split-partial layout, and the bit-identity of the two merges and of the two finish
// paths rests on them being the same code. Some of those pieces live in common/sparse_attn_common.cuh (the split
// partials are written by its store_split_partial and merged by the combines here).
//
// Entry points
//   kv_write_entries_f32 / _bf16   quantize new 512-dim vectors into pool slots (bit-exact vs the CPU codec);
//                                  the slots are read on the device, an out-of-pool slot (-1) skips its vector.
//   sparse_attn_decode_fp8         the routed path (Path::Fp8): QK^T and P.V on wgmma over exact BF16 images of
//                                  the FP8 values, the next tile's dequant overlapped with QK^T (design notes
//                                  above load_raw_regs), a q prologue that quantizes by exact power-of-two
//                                  products, and an epilogue that stores the finished output in whole 16-byte
//                                  chunks (notes above finish_staged and decode_fp8_body).
//   sparse_attn_gather_bf16        baseline step 1: gather + dequantize candidates into a BF16 staging buffer.
//   sparse_attn_decode_bf16        baseline step 2: the same attention over the BF16 staging buffer (mma.sync).
//   sparse_attn_combine_warp_per_head
//                                  split-KV merge (log-sum-exp with the sink), inverse RoPE, BF16 output; one
//                                  warp per head.
//   sparse_attn_combine_heads_per_thread_{1,2,4}
//                                  the same merge, bit for bit, latency-parallel: one CTA per (sequence, 1 / 2 /
//                                  4 heads), 8 partials' loads in flight per thread. The host routes by split
//                                  count (HEADS_PER_THREAD_MIN_SPLITS in src/ops/sparse_attn/mod.rs).
//
// Every launch is shaped by capacities only (batch, heads, the candidate stride, the split plan): the per-query
// lengths are read here, clamped to [0, stride], so a captured decode replays with any lengths.
//
// Decode kernel design (FP8 path; the BF16 baseline shares the warp layout, online softmax and finish). One
// CTA = 64 heads of one sequence x one split of its candidate list, 256 threads (two warp groups):
//   * MQA: all 64 heads share each KV entry, so a CTA streams its candidates once (tiles of 64 entries).
//     128-head models run two head-group CTAs per (sequence, split) with adjacent block indices; the second
//     read of a tile is served by L2 (the two CTAs run concurrently), so HBM sees each entry about once.
//   * q is quantized in the prologue exactly like a KV entry: per (head, 64-tile) a UE8M0 power-of-two scale
//     2^ceil(log2(max(amax,1e-4)/448)) and e4m3 codes; the codes times their scale are then held as BF16
//     (exact: e4m3 * 2^k has <= 4 significant bits). q's rope dims stay BF16.
//   * Each raw FP8 tile is dequantized once into a BF16 tile (same exactness) that serves as both K and V
//     (K = V in DSV4), with the entry's BF16 rope dims next to the nope dims; q and the tile are stored in the
//     128B-swizzled wgmma layout.
//   * QK^T: BF16 wgmma.m64n32k16 over all 512 dims (warp group wh: 64 heads x entries 32wh..+31). Every
//     product q_d * k_d is an exact product of two FP8 values times two powers of two; the only rounding is
//     the f32 accumulation.
//   * softmax in f32 (log2 domain), online over tiles; the sink enters only the final denominator. O is not
//     rescaled when no row maximum of the warp moved (x * 1.0f == x, bit-identical).
//   * P is rounded to BF16 for P.V (swizzled P block); the unrounded f32 probabilities form the denominator.
//     P.V: BF16 wgmma.m64n256k16 (warp group wh: 64 heads x dims 256wh..+255); O lives in registers, 128 f32
//     per thread, in the mma.sync m16n8 fragment layout (heads 16*(w%4) + l/4 (+8) of warp w).
//   * The two warps sharing a head block exchange their row maxima through shared memory (named barrier).
//   * Split-KV: with n_splits > 1 each CTA writes O/l (f32) and lse = m + log2(l); a combine kernel (a second
//     launch) merges them. With n_splits == 1 the CTA finishes itself (sink, inverse RoPE, BF16 store).
//
// Cycle budget per 64-entry tile (64 entries x 64 query rows; derivation, rates and the design it implies:
// docs/deep-dive-2026-12-06-sparse-attn-budget.md). Rates per SM: issue 4 warp-instr/clk; tensor 4096 BF16 /
// 8192 FP8 FLOP/clk (measured cuBLASLt 787-806 / 1386-1438 TFLOP/s = the time ceiling); FMA pipe 128, ALU (F2FP
// included) 64, MUFU 16 lanes/clk; shared memory 128 B/clk, assumed to carry wgmma operand reads; HBM 4.27 TB/s /
// 132 = 16.3 B/clk at 1.98 GHz.
//   bytes      entries 64 x 584 = 37,376 B (scales inside the entry) -> 2,290 clk of the SM's HBM share (Flash);
//              Pro / next_n 2 rows share each tile through L2: 1,145 / 573 clk; + q 64 KB and out 64 KB (BF16) or
//              128 KB (f32 partial) per work item.
//   wgmma      QK^T 64x64x512 BF16: 32 x m64n64k16 in one warp group = 1,024 clk (today: 2 groups x 32 x
//              m64n32k16); P.V 64x512x64 BF16: 2 groups x 4 x m64n256k16 = 1,024 clk. Total 2,048 clk = 1.38-1.41 us
//              at the measured BF16 rate. (FP8 QK^T nope: 14 x m64n64k32 + 4 BF16 rope = 576 clk, + 448 FMA clk
//              of per-block scale fix-up.)
//   dequant    28,672 e4m3 -> BF16 per tile; SASS today per element: 0.5 F2FP unpack + 1 HADD2.F32 + 1 FMUL +
//              0.5 F2FP pack + shifts / STS (~4.0 instr): 3,560 warp-instr = 890 issue clk, 680 ALU, 448 FMA.
//   softmax    4,096 MUFU.EX2 = 256 clk; ~16 K FMA/ALU lanes; 4 SHFL per thread; O rescale 32,768 FMUL = 256 clk;
//              exchanges: P (8 KB) and the row scale through shared memory, stage full / empty mbarriers.
//   smem       today 344 KiB (q read by both groups) = 2,752 clk; one QK^T group + P.V RS/SS: 272 KiB = 2,176 clk.
//   binding    tensor 2,048 ~ shared memory 2,176 ~ HBM 2,290 (Flash, every SM streaming) clk; at the
//              measured BF16 rate the tile is 1.38-1.41 us vs HBM 1.16 us (Flash) / 0.58 (Pro): tensor + the shared-
//              memory port bind at batch >= 64 (both shapes), fixed per-call costs (launch, q prologue, first-tile
//              latency, combine) at batch <= 32, the latency chain at batch 1-8.
//   today      3.11 us = ~6,160 clk per tile (results/h200/sparse_attn_decode.csv, one-wave unsplit points): QK^T
//              smem-bound ~2,000 || dequant, then softmax + row-max exchange ~700, then P.V alone ~1,150, barriers
//              and raw-load latency ~1,500: the tensor cores ~33% busy. FlashMLA (issue #26, same H200): ~4.1 us per
//              tile at 64 heads, ~2.8 at 128.
//   predicted  a warp-specialized loop (producer warp group + two consumer groups in seesaw, BF16 products):
//              ~1.75 us (1.55-2.0) = ~2,600-3,000 clk per tile; Flash b128 ~33 us (FlashMLA 50), Pro b128 ~80 (107).
//   measured   that loop was built and LOST at every point (H100, bde2acd, graph replay, us, this kernel / seesaw):
//              Flash b1 14.8 / 16.1, b64 41.5 / 53.1, b128 48.3 / 56.5; Pro b1 16.1 / 17.6, b64 72.1 / 87.5, b128
//              139.6 / 168.7 (results/h100/sparse_attn_decode.csv): 9-28% slower, so it was removed (git history
//              keeps it; results/h100/PERF-LOG.md has the reading).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>
#include "common/pdl.cuh"

#include "formats.cuh"
#include "kv_entry.cuh"
#include "sparse_attn_common.cuh"
#include "wgmma.cuh"

namespace sa {

// Shared-memory row strides of the BF16 baseline, padded so that fragment loads hit 32 distinct banks:
// 520 bf16 = 1040 B (260 words: 4g + t distinct; 1040 mod 128 = 16 for ldmatrix rows); 72 bf16 = 36 words
// (4g + t distinct).
constexpr int kVStride = 520;
constexpr int kPStride = 72;

// ---- shared memory pieces (bytes) ----
constexpr int kVtBytes = kBlockN * kVStride * 2;                 // 66560
constexpr int kPBytes = kHeadsPerCta * kPStride * 2;             //  9216
constexpr int kIdxBytes = 3 * kBlockN * 4;                       //   768

// ---- BF16 baseline kernel shared memory map ----
constexpr int kQbBytes = kHeadsPerCta * kVStride * 2;  // 66560
constexpr int kB16Q = 0;
constexpr int kB16Vt = kB16Q + kQbBytes;
constexpr int kB16P = kB16Vt + 2 * kVtBytes;
constexpr int kB16RedMax = kB16P + kPBytes;
constexpr int kB16RedSum = kB16RedMax + kRedBytes;
constexpr int kB16Idx = kB16RedSum + kRedBytes;
constexpr int kB16SmemBytes = kB16Idx + kIdxBytes;  // 210688

static_assert(kB16SmemBytes <= 232448, "BF16 kernel exceeds the sm_90 opt-in shared memory");

// ---------------------------------------------------------------------------------------------------------
// Small PTX wrappers
// ---------------------------------------------------------------------------------------------------------
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

__device__ __forceinline__ uint32_t ld_smem_u32(const void* p) { return *reinterpret_cast<const uint32_t*>(p); }

// D += A(16x16 bf16, row) * B(16x8 bf16, col), f32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                                                  const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_addr(p)));
}

// ---------------------------------------------------------------------------------------------------------
// Entry quantization, one warp per 512-dim vector: common/kv_entry.cuh (shared with kernels/qkv_prep.cu).
// ---------------------------------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ void kv_write_body(uint8_t* __restrict__ pool, int n_entries, const T* __restrict__ src,
                                              const int* __restrict__ dst_index, int n) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (warp >= n) return;
    const int idx = dst_index[warp];
    if (idx < 0 || idx >= n_entries) return;  // an unused slot (-1) or one outside the pool: nothing to write
    float x[16];
    const T* row = src + (size_t)warp * kDim + 16 * lane;
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] = to_f32(row[i]);
    const LaneQuant q = mm::kv_quantize_lane(x);
    mm::kv_entry_store_lane(pool + (size_t)idx * kEntryBytes, q, x, lane);
}

// Where softmax_step stores P (BF16 pairs: entries 32wh + 8n + 2tq and +1 of head rows row0 and row0 + 8).
// Row-major [heads][kPStride] for the mma.sync P.V of the BF16 baseline:
struct PRowMajor {
    __nv_bfloat16* ps;
    int wh, tq;
    __device__ __forceinline__ void operator()(int row0, int n, uint32_t lo, uint32_t hi) const {
        const int col = 32 * wh + 8 * n + 2 * tq;
        *reinterpret_cast<uint32_t*>(ps + row0 * kPStride + col) = lo;
        *reinterpret_cast<uint32_t*>(ps + (row0 + 8) * kPStride + col) = hi;
    }
};
// 128B-swizzled 128-byte rows, the wgmma A operand of the FP8 kernel's P.V: entries 32wh + 8n + 2tq (+1) are
// chunk 4wh + n, byte 4tq inside it; rows row0 and row0 + 8 share row & 7 = g, so one swizzled offset serves both.
struct PSwizzled {
    uint8_t* psw;
    int wh, g, tq;
    __device__ __forceinline__ void operator()(int row0, int n, uint32_t lo, uint32_t hi) const {
        const uint32_t inrow = (uint32_t)((((4 * wh + n) ^ g) << 4) + 4 * tq);
        *reinterpret_cast<uint32_t*>(psw + row0 * 128 + inrow) = lo;
        *reinterpret_cast<uint32_t*>(psw + (row0 + 8) * 128 + inrow) = hi;
    }
};

// Online-softmax step on one tile's scores (log2 units, -inf = masked). Writes P (BF16) to shared memory through
// `store_p` and rescales O. kSkipUnitRescale: skip the 128 multiplies when every row of the warp has alpha == 1
// (the running max did not move); x * 1.0f == x exactly, so the result is bit-identical.
template <bool kSkipUnitRescale, class StoreP>
__device__ __forceinline__ void softmax_step(WarpState& st, float (&s)[4][4], float* red_max, const StoreP& store_p,
                                             int wm, int wh, int g, int tq) {
    float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 4; ++n) {
        tmax[0] = fmaxf(tmax[0], fmaxf(s[n][0], s[n][1]));
        tmax[1] = fmaxf(tmax[1], fmaxf(s[n][2], s[n][3]));
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 1));
        tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 2));
    }
    const int row0 = 16 * wm + g;
    if (tq == 0) {
        red_max[wh * kHeadsPerCta + row0] = tmax[0];
        red_max[wh * kHeadsPerCta + row0 + 8] = tmax[1];
    }
    pair_barrier(wm);
    tmax[0] = fmaxf(tmax[0], red_max[(1 - wh) * kHeadsPerCta + row0]);
    tmax[1] = fmaxf(tmax[1], red_max[(1 - wh) * kHeadsPerCta + row0 + 8]);
    float alpha[2], m_use[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float m_new = fmaxf(st.m[r], tmax[r]);
        // While nothing valid has been seen m_new is -inf; subtracting 0 keeps exp2 finite (exp2(-inf) = 0).
        m_use[r] = (m_new == -INFINITY) ? 0.f : m_new;
        alpha[r] = exp2f(st.m[r] - m_use[r]);
        st.m[r] = m_new;
        st.l[r] *= alpha[r];
    }
#pragma unroll
    for (int n = 0; n < 4; ++n) {
        const float p0 = exp2f(s[n][0] - m_use[0]);
        const float p1 = exp2f(s[n][1] - m_use[0]);
        const float p2 = exp2f(s[n][2] - m_use[1]);
        const float p3 = exp2f(s[n][3] - m_use[1]);
        st.l[0] += p0 + p1;
        st.l[1] += p2 + p3;
        store_p(row0, n, pack_bf16x2(p0, p1), pack_bf16x2(p2, p3));
    }
    if (kSkipUnitRescale && __all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) return;
#pragma unroll
    for (int nt = 0; nt < 32; ++nt) {
        st.o[nt][0] *= alpha[0];
        st.o[nt][1] *= alpha[0];
        st.o[nt][2] *= alpha[1];
        st.o[nt][3] *= alpha[1];
    }
}

// O += P (16 heads x 64 entries) . V (64 entries x 256 dims of this warp's half).
__device__ __forceinline__ void pv_step(WarpState& st, const __nv_bfloat16* ps, const __nv_bfloat16* vt, int wm,
                                        int wh, int g, int tq, int lane) {
    const int row0 = 16 * wm + g;
    const int mi = lane >> 3, r8 = lane & 7;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        const int kb = 16 * ks + 2 * tq;
        const uint32_t a0 = ld_smem_u32(ps + row0 * kPStride + kb);
        const uint32_t a1 = ld_smem_u32(ps + (row0 + 8) * kPStride + kb);
        const uint32_t a2 = ld_smem_u32(ps + row0 * kPStride + kb + 8);
        const uint32_t a3 = ld_smem_u32(ps + (row0 + 8) * kPStride + kb + 8);
        // ldmatrix.x4.trans: matrices (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15) give
        // b0/b1 of n-tile 2np and b0/b1 of n-tile 2np+1. Lane l supplies row r8 of matrix mi.
        const __nv_bfloat16* vrow = vt + (16 * ks + r8 + (mi & 1) * 8) * kVStride + 256 * wh + (mi >> 1) * 8;
#pragma unroll
        for (int np = 0; np < 16; ++np) {
            uint32_t b0, b1, b2, b3;
            ldmatrix_x4_trans(b0, b1, b2, b3, vrow + 16 * np);
            mma_bf16(st.o[2 * np], a0, a1, a2, a3, b0, b1);
            mma_bf16(st.o[2 * np + 1], a0, a1, a2, a3, b2, b3);
        }
    }
}

// Final step of a BF16 baseline CTA (sparse_attn_decode_bf16): full row sums, then either the split partial
// (store_split_partial, the FP8 kernels' code) or the finished output (sink, 1/Z, inverse RoPE, BF16).
__device__ __forceinline__ void finish(WarpState& st, const DecodeArgs& a, float* red_sum, int b, int hg, int split,
                                       int wm, int wh, int g, int tq) {
    float l[2];
    row_sums(st, red_sum, wm, wh, g, tq, l);
    const int row0 = 16 * wm + g;
    if (a.n_splits != 1) {
        store_split_partial(st, a, l, b, hg, split, row0, wh, tq);
        return;
    }
    const int pos = a.positions[b];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int h = hg * kHeadsPerCta + row0 + 8 * r;
        const bool empty = (st.m[r] == -INFINITY);
        const float z = empty ? 1.f : l[r] + exp2f(a.sinks[h] * kLog2e - st.m[r]);
        const float inv = empty ? 0.f : 1.f / z;
        __nv_bfloat16* orow = a.out + ((size_t)b * a.heads + h) * kDim + 256 * wh;
#pragma unroll
        for (int nt = 0; nt < 32; ++nt) {
            float x = st.o[nt][2 * r] * inv, y = st.o[nt][2 * r + 1] * inv;
            const int dim = 256 * wh + 8 * nt + 2 * tq;
            if (dim >= kNope) inverse_rope_pair(x, y, pos, __ldg(a.freqs + (dim - kNope) / 2));
            *reinterpret_cast<uint32_t*>(orow + 8 * nt + 2 * tq) = pack_bf16x2(x, y);
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// wgmma pieces of the FP8 path: the QK^T instruction (the swizzled layout and descriptors are in
// common/sparse_attn_common.cuh).
//   * QK^T: warp group wh (warps 4wh..4wh+3) computes S[64 heads, entries 32wh..32wh+31] with 32 x
//     wgmma.m64n32k16 (A = q rows 0..63, B = tile rows 32wh..; both K-major, descriptor start + 32 B per K=16
//     slice). The m64nNk16 accumulator fragment puts row 16w + l/4 (+8), columns 8j + 2(l%4) (+1) in
//     d[4j..4j+3] for warp w of the group, lane l: the mma.sync m16n8 layout the softmax consumes.
//   * The dequant writes the swizzled tile; thread (e, q) writes chunk q + 4((i & 1) ^ (e & 1)) of k-block
//     i >> 1, so the two entries of a quarter-warp hit disjoint bank quartets. fence.proxy.async orders these
//     generic-proxy stores before the async-proxy wgmma reads (after the barrier that follows).
// ---------------------------------------------------------------------------------------------------------

// D(64 x 32, f32) += A(64 x 16 bf16, smem desc) * B(32 x 16 bf16, smem desc)^T; both K-major.
__device__ __forceinline__ void wgmma_m64n32k16(float (&d)[16], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "r"(1));
}

// ---------------------------------------------------------------------------------------------------------
// FP8 main loop (decode_fp8_body runs it):
// QK^T and P.V on wgmma, with the next tile's dequant overlapped with the current tile's QK^T wgmma, and no raw shared-memory stage.
//   * Two swizzled K = V tiles (vt[0], vt[1]). The raw entries go global -> registers -> BF16 tile: thread
//     (e = tid / 4, q = tid % 4) loads exactly the 8-byte chunks its dequant converts (14 nope chunks, the scale
//     word, 4 rope words = 19 x 8 B), one tile ahead of the dequant and two tiles ahead of the math.
//   * Iteration it: [barrier] issue QK^T(it) on vt[it & 1] (async) -> dequant the registers (tile it+1) into
//     vt[(it+1) & 1] and load tile it+2 into the registers while the tensor cores run -> wait QK -> softmax ->
//     fence.proxy.async + barrier (P and vt[(it+1) & 1] complete) -> P.V(it) on vt[it & 1] -> wait.
//     The top barrier keeps the dequant of iteration it+1 (into vt[it & 1]) behind every warp group's P.V(it).
//   * Candidate indices: a ring of 4 slots; tile it+3 is resolved in iteration it (its slot was last read by the
//     masking of tile it-1, before this iteration's top barrier).
//   * P.V (common/sparse_attn_common.cuh): every warp group reads all 64 P rows (written by all 8 warps), so P.V
//     waits on a CTA barrier, preceded by fence.proxy.async (P's generic stores -> wgmma's async-proxy reads).
// ---------------------------------------------------------------------------------------------------------
constexpr int kFp8Q = 0;
constexpr int kFp8Vt = kFp8Q + kSwTileBytes;              // two tiles
constexpr int kFp8P = kFp8Vt + 2 * kSwTileBytes;          // 8 KiB swizzled P block
constexpr int kFp8RedMax = kFp8P + kPswBytes;
constexpr int kFp8RedSum = kFp8RedMax + kRedBytes;
constexpr int kFp8Idx = kFp8RedSum + kRedBytes;           // 4 slots of 64 indices
constexpr int kFp8MapBytes = kFp8Idx + 4 * kBlockN * 4;      // 206848
// decode_fp8_body's map: the main loop's pieces plus the rope cos / sin table (32 float2) of finish_staged.
constexpr int kFp8RopeCs = kFp8MapBytes;
constexpr int kFp8SmemBytes = kFp8RopeCs + 32 * 8 + 1024;
static_assert(kFp8SmemBytes == 208128, "mirror FP8_SMEM_BYTES in src/ops/sparse_attn/mod.rs");
static_assert(kFp8P % 1024 == 0 && kFp8Vt % 1024 == 0, "wgmma tiles 1024-aligned");

// ---------------------------------------------------------------------------------------------------------
// BF16 baseline path (the seeds' staging design): same tiling, K = V read as BF16 rows of the staging buffer.
// ---------------------------------------------------------------------------------------------------------
__device__ __forceinline__ void load_tile_bf16(__nv_bfloat16* vt, const int* idx, const DecodeArgs& a, int b, int j0) {
    for (int u = threadIdx.x; u < kBlockN * 64; u += kThreads) {
        const int e = u >> 6, c = u & 63;
        __nv_bfloat16* dst = vt + e * kVStride + 8 * c;
        if (idx[e] >= 0)
            cp_async16(dst, a.staging + ((size_t)b * a.stride + j0 + e) * kDim + 8 * c);
        else
            *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
    }
}

__device__ __forceinline__ void decode_bf16_body(const DecodeArgs& a) {
    extern __shared__ __align__(16) uint8_t smem[];
    __nv_bfloat16* qb = reinterpret_cast<__nv_bfloat16*>(smem + kB16Q);
    __nv_bfloat16* ps = reinterpret_cast<__nv_bfloat16*>(smem + kB16P);
    float* red_max = reinterpret_cast<float*>(smem + kB16RedMax);
    float* red_sum = reinterpret_cast<float*>(smem + kB16RedSum);
    int* idxs = reinterpret_cast<int*>(smem + kB16Idx);

    const int hg = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp & 3, wh = warp >> 2, g = lane >> 2, tq = lane & 3;
    int len, t_begin, n_it;
    tile_range(a, b, split, len, t_begin, n_it);

    if (tid < kBlockN) {
        idxs[0 * kBlockN + tid] = resolve_candidate(a, b, len, t_begin * kBlockN + tid);
        idxs[1 * kBlockN + tid] = resolve_candidate(a, b, len, (t_begin + 1) * kBlockN + tid);
    }
    for (int u = tid; u < kHeadsPerCta * 64; u += kThreads) {
        const int h = u >> 6, c = u & 63;
        *reinterpret_cast<uint4*>(qb + h * kVStride + 8 * c) = *reinterpret_cast<const uint4*>(
            a.q + ((size_t)b * a.heads + hg * kHeadsPerCta + h) * kDim + 8 * c);
    }
    WarpState st;
#pragma unroll
    for (int nt = 0; nt < 32; ++nt) st.o[nt][0] = st.o[nt][1] = st.o[nt][2] = st.o[nt][3] = 0.f;
    st.m[0] = st.m[1] = -INFINITY;
    st.l[0] = st.l[1] = 0.f;

    __syncthreads();
    if (n_it > 0) load_tile_bf16(reinterpret_cast<__nv_bfloat16*>(smem + kB16Vt), idxs, a, b, t_begin * kBlockN);
    cp_async_commit();

    const int row0 = 16 * wm + g;
    for (int it = 0; it < n_it; ++it) {
        cp_async_wait_all();
        __syncthreads();
        const __nv_bfloat16* vt = reinterpret_cast<const __nv_bfloat16*>(smem + kB16Vt + (it & 1) * kVtBytes);
        const int* idx_cur = idxs + (it % 3) * kBlockN;
        if (it + 1 < n_it)
            load_tile_bf16(reinterpret_cast<__nv_bfloat16*>(smem + kB16Vt + ((it + 1) & 1) * kVtBytes),
                           idxs + ((it + 1) % 3) * kBlockN, a, b, (t_begin + it + 1) * kBlockN);
        cp_async_commit();
        if (tid < kBlockN && it + 2 < n_it)
            idxs[((it + 2) % 3) * kBlockN + tid] = resolve_candidate(a, b, len, (t_begin + it + 2) * kBlockN + tid);

        float s[4][4];
#pragma unroll
        for (int n = 0; n < 4; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll 4
        for (int kk = 0; kk < 32; ++kk) {
            const int kb = 16 * kk + 2 * tq;
            const uint32_t a0 = ld_smem_u32(qb + row0 * kVStride + kb);
            const uint32_t a1 = ld_smem_u32(qb + (row0 + 8) * kVStride + kb);
            const uint32_t a2 = ld_smem_u32(qb + row0 * kVStride + kb + 8);
            const uint32_t a3 = ld_smem_u32(qb + (row0 + 8) * kVStride + kb + 8);
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                const int e = 32 * wh + 8 * n + g;
                const uint32_t b0 = ld_smem_u32(vt + e * kVStride + kb);
                const uint32_t b1 = ld_smem_u32(vt + e * kVStride + kb + 8);
                mma_bf16(s[n], a0, a1, a2, a3, b0, b1);
            }
        }
#pragma unroll
        for (int n = 0; n < 4; ++n) {
            const int c0 = 32 * wh + 8 * n + 2 * tq;
            const bool v0 = idx_cur[c0] >= 0, v1 = idx_cur[c0 + 1] >= 0;
            s[n][0] = v0 ? s[n][0] * kScoreScaleLog2 : -INFINITY;
            s[n][1] = v1 ? s[n][1] * kScoreScaleLog2 : -INFINITY;
            s[n][2] = v0 ? s[n][2] * kScoreScaleLog2 : -INFINITY;
            s[n][3] = v1 ? s[n][3] * kScoreScaleLog2 : -INFINITY;
        }
        softmax_step<false>(st, s, red_max, PRowMajor{ps, wh, tq}, wm, wh, g, tq);
        __syncthreads();
        pv_step(st, ps, vt, wm, wh, g, tq, lane);
    }
    finish(st, a, red_sum, b, hg, split, wm, wh, g, tq);
}

}  // namespace sa

// =============================================================================================================
// Entry points
// =============================================================================================================

// Quantize n f32 vectors [n, 512] into pool entries dst_index[i]. One warp per vector.
extern "C" __global__ void __launch_bounds__(256) kv_write_entries_f32(uint8_t* pool, int n_entries,
                                                                        const float* src, const int* dst_index, int n) {
    sa::kv_write_body<float>(pool, n_entries, src, dst_index, n);
}

// Same from BF16 vectors.
extern "C" __global__ void __launch_bounds__(256) kv_write_entries_bf16(uint8_t* pool, int n_entries,
                                                                         const __nv_bfloat16* src,
                                                                         const int* dst_index, int n) {
    sa::kv_write_body<__nv_bfloat16>(pool, n_entries, src, dst_index, n);
}

// grid (heads/64, n_splits, batch), block 256, dynamic smem sa::kB16SmemBytes. Reads `staging`.
extern "C" __global__ void __launch_bounds__(256, 1) sparse_attn_decode_bf16(SA_DECODE_PARAMS) {
    sa::decode_bf16_body(SA_DECODE_ARGS);
}

// Baseline step 1: staging[b, j, :] = decode(pool[candidates[b, j]]) for valid candidates j < lengths[b]
// (other rows are not written: the attention kernel masks them). grid (ceil(stride/8), batch), block 256.
extern "C" __global__ void __launch_bounds__(256) sparse_attn_gather_bf16(__nv_bfloat16* staging, const uint8_t* pool,
                                                                          int n_entries, const int* candidates,
                                                                          int stride, const int* lengths) {
    const int b = blockIdx.y;
    const int j = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    const int len = min(max(lengths[b], 0), stride);
    if (j >= len) return;
    const int idx = candidates[(size_t)b * stride + j];
    if (idx < 0 || idx >= n_entries) return;
    const uint8_t* e = pool + (size_t)idx * sa::kEntryBytes;
    uint4* dst = reinterpret_cast<uint4*>(staging + ((size_t)b * stride + j) * sa::kDim + 16 * lane);
    if (lane < 28) {
        const float scale = mm::ue8m0_decode(e[sa::kScaleOffset + (lane >> 2)]);
        const uint2 w0 = *reinterpret_cast<const uint2*>(e + 16 * lane);
        const uint2 w1 = *reinterpret_cast<const uint2*>(e + 16 * lane + 8);
        dst[0] = make_uint4(sa::e4m3x2_to_bf16x2_scaled(w0.x, scale), sa::e4m3x2_to_bf16x2_scaled(w0.x >> 16, scale),
                            sa::e4m3x2_to_bf16x2_scaled(w0.y, scale), sa::e4m3x2_to_bf16x2_scaled(w0.y >> 16, scale));
        dst[1] = make_uint4(sa::e4m3x2_to_bf16x2_scaled(w1.x, scale), sa::e4m3x2_to_bf16x2_scaled(w1.x >> 16, scale),
                            sa::e4m3x2_to_bf16x2_scaled(w1.y, scale), sa::e4m3x2_to_bf16x2_scaled(w1.y >> 16, scale));
    } else {
        const uint2* src = reinterpret_cast<const uint2*>(e + sa::kRopeOffset + 32 * (lane - 28));
        const uint2 r0 = src[0], r1 = src[1], r2 = src[2], r3 = src[3];
        dst[0] = make_uint4(r0.x, r0.y, r1.x, r1.y);
        dst[1] = make_uint4(r2.x, r2.y, r3.x, r3.y);
    }
}

// Split-KV merge: o = (sum_s 2^(lse_s - M) o_s) / (sum_s 2^(lse_s - M) + 2^(sink*log2e - M)), then inverse RoPE
// at the query position, BF16. A (sequence, head) with no valid candidate in any split gets o = 0.
// grid (heads/8, batch), block 256: one warp per head, lane l owns dims [16l, 16l+16).
extern "C" __global__ void __launch_bounds__(256)
    sparse_attn_combine_warp_per_head(__nv_bfloat16* out, const float* part_o, const float* part_lse,
                                      const float* sinks, const int* positions, const float* freqs, int heads,
                                      int n_splits) {
    const int b = blockIdx.y;
    const int h = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (h >= heads) return;
    // Every lane reads lse of splits lane, lane+32, ...: the loads are independent (one L2 round trip instead of
    // n_splits serial ones, which made the combine ~7 us at 3 splits).
    const float* lse_row = part_lse + (size_t)b * n_splits * heads + h;
    float m_parts = -INFINITY;
    for (int s = lane; s < n_splits; s += 32) m_parts = fmaxf(m_parts, lse_row[(size_t)s * heads]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m_parts = fmaxf(m_parts, __shfl_xor_sync(0xffffffffu, m_parts, o));
    float acc[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) acc[i] = 0.f;
    if (m_parts != -INFINITY) {
        const float sink2 = sinks[h] * sa::kLog2e;
        const float m_all = fmaxf(m_parts, sink2);
        float zl = 0.f;
        for (int s = lane; s < n_splits; s += 32) zl += exp2f(lse_row[(size_t)s * heads] - m_all);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) zl += __shfl_xor_sync(0xffffffffu, zl, o);
        const float z = exp2f(sink2 - m_all) + zl;
        // Weighted sum in split order. An empty split has lse = -inf (w = 0) and o = 0, so it adds exactly 0;
        // no branch, so the compiler can keep several splits' loads in flight.
#pragma unroll 4
        for (int s = 0; s < n_splits; ++s) {
            const size_t row = ((size_t)b * n_splits + s) * heads + h;
            const float w = exp2f(part_lse[row] - m_all);
            const float4* src = reinterpret_cast<const float4*>(part_o + row * sa::kDim + 16 * lane);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float4 v = src[i];
                acc[4 * i] += w * v.x;
                acc[4 * i + 1] += w * v.y;
                acc[4 * i + 2] += w * v.z;
                acc[4 * i + 3] += w * v.w;
            }
        }
        const float inv = 1.f / z;
#pragma unroll
        for (int i = 0; i < 16; ++i) acc[i] *= inv;
        if (lane >= 28) {
            const int pos = positions[b];
#pragma unroll
            for (int i = 0; i < 8; ++i)
                sa::inverse_rope_pair(acc[2 * i], acc[2 * i + 1], pos, freqs[8 * (lane - 28) + i]);
        }
    }
    uint4* dst = reinterpret_cast<uint4*>(out + ((size_t)b * heads + h) * sa::kDim + 16 * lane);
    dst[0] = make_uint4(sa::pack_bf16x2(acc[0], acc[1]), sa::pack_bf16x2(acc[2], acc[3]),
                        sa::pack_bf16x2(acc[4], acc[5]), sa::pack_bf16x2(acc[6], acc[7]));
    dst[1] = make_uint4(sa::pack_bf16x2(acc[8], acc[9]), sa::pack_bf16x2(acc[10], acc[11]),
                        sa::pack_bf16x2(acc[12], acc[13]), sa::pack_bf16x2(acc[14], acc[15]));
}

namespace sa {
// (split, head) partials a thread of the heads-per-thread combine holds in registers at once (8 float4 + 8 lse): small
// enough for 64 registers, i.e. 8 CTAs (1024 threads) per SM.
constexpr int kCombineLoads = 8;

// Split-KV merge, latency-parallel (Combine::HeadsPerThread, routed from 3 splits): the same values as
// sparse_attn_combine_warp_per_head, bit for bit, with far more CTAs and the loads in flight together. The
// warp-per-head kernel has one warp per head (grid heads/8 x batch: 8 CTAs at Flash batch 1) and walks the splits
// 4 at a time after two serial lse passes; ncu measured it at 9-15 us whatever the size, 64% of its stalls on loads.
// grid (heads / kHeads, batch), block 128: thread t owns dims [4t, 4t+4) of heads kHeads*blockIdx.x + j
// (j < kHeads) of sequence blockIdx.y. kHeads (1, 2, 4: entry points sparse_attn_combine_heads_per_thread_1/2/4; the host
// takes the largest with kHeads * n_splits <= 8) gives a thread of a plan with few splits (Flash batch 64: 2)
// as many loads in flight as one with 8 splits, and 4x fewer CTAs, instead of 4x more CTA rounds per SM.
//   * Every thread first issues the loads of splits 0..kChunk-1 (kChunk = 8 / kHeads; its float4 of O and the
//     split's lse, for each of its heads); they do not depend on the merge statistics, so they overlap the lse
//     pass; later chunks cost one L2 round trip each (33 splits at HCA 1M batch 1: 4 more).
//   * Bit-identity with sparse_attn_combine_warp_per_head, per head: each warp computes the merge statistics with
//     that kernel's code (lane-strided max, which is exact in any order; the lane-strided sum s = lane, lane+32, ...
//     from 0.f, then the xor butterfly 16, 8, 4, 2, 1, whose result is the same in every lane because each step
//     adds the same two values, a + b == b + a); w_s = exp2f(lse_s - m_all) of the same lse values;
//     acc = fma(w_s, o_s, acc) in split order 0, 1, ... from 0.f (the warp-per-head loop's `acc += w * v` contracts to that
//     FFMA); acc * (1/z) with the IEEE reciprocal; the same inverse_rope_pair on the same (dim pair, frequency)
//     pairs (dims 448..511: threads 112..127, pairs (4t, 4t+1) and (4t+2, 4t+3) with frequencies 2(t-112) and
//     2(t-112)+1); the same BF16 rounding; a head with no valid candidate (every lse = -inf) gets 0. The lse
//     pass is repeated by the 4 warps of a CTA (n_splits L1-resident loads each): cheaper than a barrier on the
//     chain. m_parts is warp-uniform after the butterfly, so the per-head branches keep the shuffles converged.
template <int kHeads>
__device__ __forceinline__ void combine_heads_per_thread_body(__nv_bfloat16* out, const float* part_o, const float* part_lse,
                                                const float* sinks, const int* positions, const float* freqs,
                                                int heads, int n_splits) {
    constexpr int kChunk = kCombineLoads / kHeads;  // splits per chunk
    constexpr int kVecPerRow = kDim / 4;            // float4s per partial row
    const int h0 = blockIdx.x * kHeads;
    const int b = blockIdx.y;
    const int t = threadIdx.x;
    const int lane = t & 31;
    if (h0 + kHeads > heads) return;  // the host launches heads / kHeads CTAs (heads % kHeads == 0)
    // Partial row of (split s, head h0 + j): (b * n_splits + s) * heads + h0 + j = row0 + s * heads + j.
    const size_t row0 = (size_t)b * n_splits * heads + h0;
    const float* lse_row = part_lse + row0;
    const float4* o_row = reinterpret_cast<const float4*>(part_o) + row0 * kVecPerRow + t;
    const size_t o_split_step = (size_t)heads * kVecPerRow;

    // Chunk 0's loads first (independent of everything below).
    float4 v[kHeads][kChunk];
    float lse[kHeads][kChunk];
    {
        // Stepped pointers (not base + i * step): fewer live 64-bit addresses while the loads are issued.
        const float4* o_ptr = o_row;
        const float* lse_ptr = lse_row;
#pragma unroll
        for (int i = 0; i < kChunk; ++i) {
            if (i < n_splits) {
#pragma unroll
                for (int j = 0; j < kHeads; ++j) {
                    v[j][i] = o_ptr[j * kVecPerRow];
                    lse[j][i] = lse_ptr[j];
                }
            }
            o_ptr += o_split_step;
            lse_ptr += heads;
        }
    }
    float sink[kHeads];
#pragma unroll
    for (int j = 0; j < kHeads; ++j) sink[j] = sinks[h0 + j];

    // Merge statistics per head: the code of sparse_attn_combine_warp_per_head (see the identities above).
    float m_parts[kHeads], m_all[kHeads], z[kHeads];
#pragma unroll
    for (int j = 0; j < kHeads; ++j) m_parts[j] = -INFINITY;
    for (int s = lane; s < n_splits; s += 32) {
#pragma unroll
        for (int j = 0; j < kHeads; ++j) m_parts[j] = fmaxf(m_parts[j], lse_row[(size_t)s * heads + j]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
        for (int j = 0; j < kHeads; ++j) m_parts[j] = fmaxf(m_parts[j], __shfl_xor_sync(0xffffffffu, m_parts[j], o));
    }
#pragma unroll
    for (int j = 0; j < kHeads; ++j) {
        m_all[j] = 0.f;
        z[j] = 1.f;
        if (m_parts[j] != -INFINITY) {
            const float sink2 = sink[j] * kLog2e;
            m_all[j] = fmaxf(m_parts[j], sink2);
            float zl = 0.f;
            for (int s = lane; s < n_splits; s += 32) zl += exp2f(lse_row[(size_t)s * heads + j] - m_all[j]);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) zl += __shfl_xor_sync(0xffffffffu, zl, o);
            z[j] = exp2f(sink2 - m_all[j]) + zl;
        }
    }

    // Weighted sum in split order. An empty split has lse = -inf (w = 0) and o = 0: it adds exactly 0.
    float acc[kHeads][4];
#pragma unroll
    for (int j = 0; j < kHeads; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    for (int base = 0; base < n_splits; base += kChunk) {
        if (base > 0) {
#pragma unroll
            for (int i = 0; i < kChunk; ++i) {
                if (base + i < n_splits) {
#pragma unroll
                    for (int j = 0; j < kHeads; ++j) {
                        v[j][i] = o_row[(size_t)(base + i) * o_split_step + j * kVecPerRow];
                        lse[j][i] = lse_row[(size_t)(base + i) * heads + j];
                    }
                }
            }
        }
#pragma unroll
        for (int i = 0; i < kChunk; ++i) {
            if (base + i < n_splits) {
#pragma unroll
                for (int j = 0; j < kHeads; ++j) {
                    if (m_parts[j] != -INFINITY) {
                        const float w = exp2f(lse[j][i] - m_all[j]);
                        acc[j][0] = __fmaf_rn(w, v[j][i].x, acc[j][0]);
                        acc[j][1] = __fmaf_rn(w, v[j][i].y, acc[j][1]);
                        acc[j][2] = __fmaf_rn(w, v[j][i].z, acc[j][2]);
                        acc[j][3] = __fmaf_rn(w, v[j][i].w, acc[j][3]);
                    }
                }
            }
        }
    }
    const int pos = positions[b];
#pragma unroll
    for (int j = 0; j < kHeads; ++j) {
        if (m_parts[j] != -INFINITY) {
            const float inv = 1.f / z[j];
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[j][i] *= inv;
            if (4 * t >= kRopeOffset) {
                const int f = 2 * (t - kRopeOffset / 4);
                inverse_rope_pair(acc[j][0], acc[j][1], pos, freqs[f]);
                inverse_rope_pair(acc[j][2], acc[j][3], pos, freqs[f + 1]);
            }
        }
        uint2* dst = reinterpret_cast<uint2*>(out + ((size_t)b * heads + h0 + j) * kDim + 4 * t);
        *dst = make_uint2(pack_bf16x2(acc[j][0], acc[j][1]), pack_bf16x2(acc[j][2], acc[j][3]));
    }
}
}  // namespace sa

#define SA_COMBINE_PARAMS                                                                                     \
    __nv_bfloat16 *out, const float *part_o, const float *part_lse, const float *sinks, const int *positions, \
        const float *freqs, int heads, int n_splits
#define SA_COMBINE_ARGS out, part_o, part_lse, sinks, positions, freqs, heads, n_splits
// One head per thread (n_splits >= 5), grid (heads, batch), block 128.
extern "C" __global__ void __launch_bounds__(128, 8) sparse_attn_combine_heads_per_thread_1(SA_COMBINE_PARAMS) {
    pdl_trigger();  // a PDL-launched successor (the decode GEMV) stages its weights meanwhile
    sa::combine_heads_per_thread_body<1>(SA_COMBINE_ARGS);
}
// Two heads per thread (n_splits 3..4), grid (heads / 2, batch), block 128.
extern "C" __global__ void __launch_bounds__(128, 8) sparse_attn_combine_heads_per_thread_2(SA_COMBINE_PARAMS) {
    pdl_trigger();  // a PDL-launched successor (the decode GEMV) stages its weights meanwhile
    sa::combine_heads_per_thread_body<2>(SA_COMBINE_ARGS);
}
// Four heads per thread (n_splits 2), grid (heads / 4, batch), block 128. 6 CTAs per SM (up to 80 registers):
// at 64 the four heads' statistics and accumulators spilled.
extern "C" __global__ void __launch_bounds__(128, 6) sparse_attn_combine_heads_per_thread_4(SA_COMBINE_PARAMS) {
    pdl_trigger();  // a PDL-launched successor (the decode GEMV) stages its weights meanwhile
    sa::combine_heads_per_thread_body<4>(SA_COMBINE_ARGS);
}

namespace sa {

// The FP8 decode body (sparse_attn_decode_fp8): the q prologue (quantize_lane_pow2_mul, common/sparse_attn_common.cuh), the FP8 main loop, and finish_staged as the
// epilogue, which keeps the code executed once per warp small: the rope cos / sin table of the query position
// (32 pairs) is computed once per CTA into rope_cs (kFp8RopeCs) for finish_staged (see there).
__device__ __forceinline__ void decode_fp8_body(const DecodeArgs& a) {
    extern __shared__ __align__(16) uint8_t smem_unaligned[];
    uint8_t* smem = smem_unaligned + ((1024u - (smem_addr(smem_unaligned) & 1023u)) & 1023u);
    uint8_t* qsw = smem + kFp8Q;
    uint8_t* psw = smem + kFp8P;
    float* red_max = reinterpret_cast<float*>(smem + kFp8RedMax);
    float* red_sum = reinterpret_cast<float*>(smem + kFp8RedSum);
    int* idxs = reinterpret_cast<int*>(smem + kFp8Idx);

    const int hg = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp & 3, wh = warp >> 2, g = lane >> 2, tq = lane & 3;
    const int de = tid >> 2, dq = tid & 3, dodd = de & 1;  // this thread's dequant entry / chunk phase
    int len, t_begin, n_it;
    tile_range(a, b, split, len, t_begin, n_it);

    // q: quantized per (head, 64-tile) like a KV entry (warp w: heads 8w..8w+7), stored in the swizzled layout.
    // Order: q's loads first (they depend on nothing), then the candidate indices, then tile 0's raw entries
    // (thread (de, dq) resolves its own entry's index: the same resolve_candidate value idx slot 0 gets, so the
    // same bytes as a load after the barrier would read), then the q quantization while both are in flight.
    uint4 raw[8][2];
    load_q_rows(raw, a, b, hg, warp, lane);
    if (tid < kBlockN) {
#pragma unroll
        for (int t = 0; t < 3; ++t) idxs[t * kBlockN + tid] = resolve_candidate(a, b, len, (t_begin + t) * kBlockN + tid);
    }
    RawRegs rr;
    if (n_it > 0) load_raw_regs(rr, a.pool, resolve_candidate(a, b, len, t_begin * kBlockN + de), dq, dodd);
    if (a.n_splits == 1 && tid < 32) {
        float sn, cs;
        sincosf(__fmul_rn(static_cast<float>(a.positions[b]), __ldg(a.freqs + tid)), &sn, &cs);
        reinterpret_cast<float2*>(smem + kFp8RopeCs)[tid] = make_float2(cs, sn);
    }
    store_q_image(raw, qsw, warp, lane);

    WarpState st;
#pragma unroll
    for (int nt = 0; nt < 32; ++nt) st.o[nt][0] = st.o[nt][1] = st.o[nt][2] = st.o[nt][3] = 0.f;
    st.m[0] = st.m[1] = -INFINITY;
    st.l[0] = st.l[1] = 0.f;

    __syncthreads();  // idx slots 0..2 visible
    if (n_it > 0) dequant_regs(rr, smem + kFp8Vt, de, dq, dodd);
    if (n_it > 1) load_raw_regs(rr, a.pool, idxs[kBlockN + de], dq, dodd);
    fence_proxy_async();  // q and vt[0] generic stores -> async proxy (after the loop-top barrier)

    const uint32_t q_base = smem_addr(qsw);
    const uint32_t vt_base0 = smem_addr(smem + kFp8Vt);
    const uint64_t p_desc = sw128_desc(smem_addr(psw));

    for (int it = 0; it < n_it; ++it) {
        __syncthreads();  // vt[it & 1] complete; every warp group finished P.V(it-1); idx slot (it+2)%4 visible
        const uint32_t vt_cur = vt_base0 + (uint32_t)((it & 1) * kSwTileBytes);
        const int* idx_cur = idxs + (it % 4) * kBlockN;
        if (tid < kBlockN && it + 3 < n_it)
            idxs[((it + 3) % 4) * kBlockN + tid] = resolve_candidate(a, b, len, (t_begin + it + 3) * kBlockN + tid);

        // ---- S = q . K^T on vt[it & 1], issued async ----
        float acc[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) acc[i] = 0.f;
        fence_acc(acc);
        wgmma_fence();
        {
            const uint32_t b_rows = vt_cur + (uint32_t)(32 * wh * 128);
#pragma unroll
            for (int kb = 0; kb < 8; ++kb) {
                const uint64_t da = sw128_desc(q_base + kb * kSwBlockBytes);
                const uint64_t db = sw128_desc(b_rows + kb * kSwBlockBytes);
#pragma unroll
                for (int k = 0; k < 4; ++k) wgmma_m64n32k16(acc, da + 2 * k, db + 2 * k);
            }
        }
        wgmma_commit();

        // ---- while the tensor cores run: tile it+1 registers -> vt[(it+1) & 1]; load tile it+2 ----
        if (it + 1 < n_it) {
            dequant_regs(rr, smem + kFp8Vt + ((it + 1) & 1) * kSwTileBytes, de, dq, dodd);
            if (it + 2 < n_it) load_raw_regs(rr, a.pool, idxs[((it + 2) % 4) * kBlockN + de], dq, dodd);
        }

        wgmma_wait_all();
        fence_acc(acc);

        float s[4][4];
#pragma unroll
        for (int n = 0; n < 4; ++n) {
            const int c0 = 32 * wh + 8 * n + 2 * tq;
            const bool v0 = idx_cur[c0] >= 0, v1 = idx_cur[c0 + 1] >= 0;
            s[n][0] = v0 ? acc[4 * n + 0] * kScoreScaleLog2 : -INFINITY;
            s[n][1] = v1 ? acc[4 * n + 1] * kScoreScaleLog2 : -INFINITY;
            s[n][2] = v0 ? acc[4 * n + 2] * kScoreScaleLog2 : -INFINITY;
            s[n][3] = v1 ? acc[4 * n + 3] * kScoreScaleLog2 : -INFINITY;
        }

        softmax_step<true>(st, s, red_max, PSwizzled{psw, wh, g, tq}, wm, wh, g, tq);
        fence_proxy_async();  // P and vt[(it+1) & 1] generic stores -> async proxy
        __syncthreads();      // all 64 P rows written

        // ---- O[64 heads, dims 256wh..+255] += P . V(it) ----
        const uint64_t v_desc = sw128_desc_mn(vt_cur + (uint32_t)(4 * wh * kSwBlockBytes));
        fence_acc_o(st.o);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k) wgmma_m64n256k16_tb(st.o, p_desc + 2 * k, v_desc + (2048 >> 4) * k);
        wgmma_commit();
        wgmma_wait_all();
        fence_acc_o(st.o);
    }
    finish_staged(st, a, red_sum, reinterpret_cast<const float2*>(smem + kFp8RopeCs), smem + kFp8Vt, b, hg, split, wm,
                  wh, g, tq, tid, SyncCta{});
}

}  // namespace sa

// The FP8 path (Path::Fp8, bench "fp8"). grid (heads/64, n_splits, batch), block 256, dynamic smem
// sa::kFp8SmemBytes; n_splits == 1 writes `out`, n_splits > 1 writes part_o / part_lse for the combine.
extern "C" __global__ void __launch_bounds__(256, 1) sparse_attn_decode_fp8(SA_DECODE_PARAMS) {
    pdl_trigger();  // a PDL-launched successor (the decode GEMV) stages its weights meanwhile
    sa::decode_fp8_body(SA_DECODE_ARGS);
}
