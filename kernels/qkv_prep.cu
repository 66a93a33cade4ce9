// qkv_prep: the attention side of DeepSeek-V4 between the dense linears (wq_b, wkv, indexer wq_b, weights_proj)
// and the attention / indexer kernels (dsv4-architecture §3.6, §3.8; the CPU oracle is Model::attn_projections
// through the per-token steps of src/model/reference.rs: q_heads_finish, window_kv_rope, indexer_q_rotate,
// indexer_head_weights). The q_lora RMSNorm before wq_b is norm_quant's FP8 row kernel (no kernel here).
//
// One entry point, qkv_prep_attn (M token rows, a capacity; row m's position is positions[m], read on the device; a
// position < 0 marks an empty row: its warps return before any store), doing any of three parts over the same
// rows, positions and RoPE table, each part a range of the grid's CTAs (one launch after the projections instead
// of three; every warp runs the code its part's own launch ran, so the bits are those of separate launches):
//   q heads       q [M, H, 512] BF16 (wq_b out) -> per-head RMS without weight in the official BF16 op
//                 order, RoPE on dims 448..511 -> q [M, H, 512] BF16 (sparse_attn's q layout) + the
//                 per-head RMS factor [M, H] (a BF16 value, stored as f32).
//   kv entries    kv [M, 512] BF16 (wkv out) -> RMSNorm(kv_norm), RoPE on dims 448..511, BF16 -> one
//                 584-byte FP8 entry (common/kv_entry.cuh, = fp8_sim per 64 of the nope dims) in the
//                 window ring slot seq_base[m / tokens_per_seq] + position % window, + the RMS factor [M].
//   indexer q     qI [M, HI, 128] BF16 (indexer wq_b out) -> RoPE on dims 64..127, BF16, Hadamard, BF16,
//                 FP4 sim per 32 -> the indexer's e4m3 query codes [M, HI, 128]; weights_proj out
//                 [M, HI] f32, rounded to BF16 -> w [M, HI] f32 = bf16(w * scale) * 2^e_h (the q scale
//                 folded in); and the rows' visible key counts num_valid [M] for the indexer.
//   qkv_prep_launch_floor an empty kernel: the bench's launch floor, measured in the same run.
//
// Work split: one warp per (row, head) vector. A 512-dim vector: lane l holds dims [16l, 16l+16) (two 16-byte
// loads), so lanes 28..31 hold the 64 rope dims and the KV entry writer takes the registers as they are. A
// 128-dim indexer head: lane l holds dims [4l, 4l+4) (common/hadamard.cuh's layout); lanes 16..31 are the rope
// dims, a 32-block is 8 consecutive lanes.
//
// Rounding points (each an IEEE f32 operation with _rn intrinsics, no contraction; the CPU steps are the same):
//   q factor    The official `q *= rsqrt(q.square().mean(-1) + eps)` with every op rounded to BF16
//               (model::numerics::head_rms_scale_bf16): s_i = bf16(q_i * q_i) (the f32 product of two BF16
//               values is exact), ss = their f32 sum (16 adds per lane in dim order, then the xor-butterfly warp
//               sum of common/norm_row.cuh), m = bf16(ss * (1/512)) (a power of two: exact while ss / 512 stays
//               normal; below that m + eps is eps anyway), e = bf16(m + eps), r = bf16(__frsqrt_rn(e)) (the
//               correctly rounded f32 rsqrt, as the CPU's rsqrt_f32_rn). The CPU sums in f64: the two sums are
//               within 20 * 2^-24 relative (20 roundings on a term's path, all terms >= 0), so m is the CPU's
//               unless the exact mean lies that close to a BF16 rounding midpoint (the tests count those heads
//               and demand r within one BF16 step there); every other step is the CPU's bit for bit.
//   q head      y = bf16(q * r) (one rounding: the product of two BF16 values is exact); rope dims:
//               common/rope.cuh on the BF16 values, then BF16.
//   kv factor   rstd = 1 / sqrt(ss / D + eps), ss the f32 sum of squares (fmaf per lane, then the warp sum). Only
//               this sum's order differs from the CPU's inv_rms (f64 sum, then rounded to f32): the tests compare
//               the CPU steps run with the kernel's rstd bit for bit and bound |rstd - inv_rms| separately.
//   kv          y = bf16(w * (x * rstd)); rope dims as above; the entry encoder sees these BF16 values.
//   indexer q   rope dims as above; Hadamard (f32 butterfly, * f32(1/sqrt(128))); BF16; FP4 sim per 32:
//               scale code sc_b = ue8m0(max(amax_b, 6 * 2^-126) / 6), f = e2m1(x / 2^sc_b) * 2^sc_b.
//   indexer out The indexer reads e4m3 codes with a per-(row, head) scale folded into its f32 head weight. With
//               K the largest sc_b of the head, the head scale is 2^e, e = max(K - 6, -126) (code hc = e + 127),
//               codes = e4m3(f * 2^-e) and w = bf16(w_in * scale) * 2^e.
//               Identity: f = c * 2^k_b (c an e2m1 value: <= 2 significant bits, |c| <= 6, lsb >= 2^-1), so
//               f * 2^-e = c * 2^(k_b - e) is at most 6 * 2^6 = 384 <= 448 and, for k_b >= K - 14, a multiple of
//               2^-9 with <= 2 significant bits: an e4m3 value, so the code is exact and
//               decode(code) * 2^e == f. A 32-block more than 14 binades below the head's largest is rounded to
//               e4m3 (RNE, subnormals): its values are below 2^-14 of the head's largest. The product
//               2^-e * f is exact in f32 (a power of two times an f32 value that stays normal or rounds to 0
//               in e4m3 anyway); w * 2^e is exact unless it leaves the f32 range (|w| * 2^e, e in [-126, 121]).
#include <cuda_bf16.h>
#include <stdint.h>
#include "common/pdl.cuh"

#include "formats.cuh"
#include "hadamard.cuh"
#include "kv_entry.cuh"
#include "norm_row.cuh"
#include "rope.cuh"

namespace qp {

constexpr int kDim = 512;        // q head / KV vector
constexpr int kRopeLane0 = 28;   // first lane of the rope dims 448..511 (16 dims per lane)
constexpr int kIndexDim = 128;   // indexer head
constexpr int kHeadsPerCta = 8;  // warps per CTA of the per-head kernels

__device__ __forceinline__ float bf16r(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// The lane's 16 dims [16l, 16l+16) of a 512-vector.
__device__ __forceinline__ void load16(const __nv_bfloat16* row, int lane, float (&v)[16]) {
    load8(row + 16 * lane, v);
    load8(row + 16 * lane + 8, v + 8);
}

// The query head's RMS factor r = bf16(rsqrt(bf16(bf16(sum_i bf16(q_i^2) / 512) + eps))), the sum in f32 (see the
// top of the file); a BF16 value, identical in every lane.
__device__ __forceinline__ float warp_q_rms_scale_bf16(const float (&v)[16], float eps) {
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) ss = __fadd_rn(ss, bf16r(__fmul_rn(v[i], v[i])));
    ss = warp_sum(ss);
    const float mean = bf16r(__fmul_rn(ss, 1.f / (float)kDim));
    return bf16r(__frsqrt_rn(bf16r(__fadd_rn(mean, eps))));
}

// 1 / sqrt(ss / D + eps) of the warp's 512-vector (the window KV's RMSNorm factor); identical in every lane.
__device__ __forceinline__ float warp_rstd(const float (&v)[16], float eps) {
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) ss = fmaf(v[i], v[i], ss);
    ss = warp_sum(ss);
    return __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)kDim), eps)));
}

// RoPE at `pos` on the rope lanes' 16 dims (8 pairs, pair index 8 (lane - 28) + p), each result rounded to BF16.
// The inputs are BF16 values already.
__device__ __forceinline__ void rope_lane16(float (&v)[16], int lane, long long pos, const double* __restrict__ freqs) {
    if (lane < kRopeLane0) return;
#pragma unroll
    for (int p = 0; p < 8; ++p) {
        mm::rope_rotate_pair(v[2 * p], v[2 * p + 1], pos, freqs[8 * (lane - kRopeLane0) + p], false);
        v[2 * p] = bf16r(v[2 * p]);
        v[2 * p + 1] = bf16r(v[2 * p + 1]);
    }
}

}  // namespace qp

// Mirrors ops::qkv_prep::PrepParams (#[repr(C)]), passed as a __grid_constant__. A part with no CTAs is absent.
struct PrepParams {
    const int* positions;  // [rows]
    const double* freqs;   // [32] f64, the layer's RoPE table (q heads, kv entries, indexer q)
    // q heads: q_in / q_out [rows, heads, 512] BF16, rstd [rows, heads] f32 (the BF16 factor r).
    const __nv_bfloat16* q_in;
    __nv_bfloat16* q_out;
    float* q_rstd;
    // kv entries: kv_in [rows, 512] BF16, kv_norm [512] BF16, seq_base [rows / tokens_per_seq] (the pool index of
    // each sequence's window ring slot 0); pool [n_entries, 584]; kv_rstd [rows] f32.
    const __nv_bfloat16* kv_in;
    const __nv_bfloat16* kv_norm;
    const int* seq_base;
    uint8_t* pool;
    float* kv_rstd;
    // indexer q: qi_in [rows, index_heads, 128] BF16, w_in [rows, index_heads] f32 (weights_proj's output) ->
    // q_codes [rows, index_heads, 128] e4m3, w_out [rows, index_heads] f32; num_valid [rows] or null.
    const __nv_bfloat16* qi_in;
    const float* w_in;
    uint8_t* q_codes;
    float* w_out;
    int* num_valid;
    int rows, heads, index_heads, tokens_per_seq, window, n_entries, ratio;
    float eps, w_scale;
    int q_ctas, kv_ctas, index_ctas;  // the parts' CTA counts, in this grid order
};
static_assert(sizeof(PrepParams) == 168, "PrepParams must match ops::qkv_prep::PrepParams");

namespace qp {

// q heads, CTA (x, m) of its part's (ceil(heads / 8), rows) grid: warp w is head 8x + w of row m.
__device__ __forceinline__ void q_heads_cta(const PrepParams& p, int x, int m) {
    const int lane = threadIdx.x & 31;
    const int head = x * kHeadsPerCta + (threadIdx.x >> 5);
    if (head >= p.heads) return;
    const int pos = p.positions[m];
    if (pos < 0) return;  // empty row: nothing written
    const size_t vec = (size_t)m * p.heads + head;
    float v[16];
    load16(p.q_in + vec * kDim, lane, v);
    const float r = warp_q_rms_scale_bf16(v, p.eps);
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = bf16r(__fmul_rn(v[i], r));
    rope_lane16(v, lane, pos, p.freqs);
    __nv_bfloat16* dst = p.q_out + vec * kDim + 16 * lane;
    store8_bf16(dst, v);  // exact: every value is BF16 already
    store8_bf16(dst + 8, v + 8);
    if (lane == 0) p.q_rstd[vec] = r;
}

// kv entries, CTA x of its part's ceil(rows / 8) CTAs: one warp per row. Row m belongs to sequence
// m / tokens_per_seq and goes to pool entry seq_base[seq] + position % window; a row with position < 0,
// seq_base < 0 or an entry outside the pool writes nothing.
__device__ __forceinline__ void kv_entries_cta(const PrepParams& p, int x) {
    const int lane = threadIdx.x & 31;
    const int m = (x * blockDim.x + threadIdx.x) >> 5;
    if (m >= p.rows) return;
    const int pos = p.positions[m];
    if (pos < 0) return;
    const int base = p.seq_base[m / p.tokens_per_seq];
    if (base < 0) return;
    const long long slot = (long long)base + pos % p.window;
    if (slot >= p.n_entries) return;  // warp-uniform: every return above precedes the warp's shuffles
    float v[16], w[16];
    load16(p.kv_in + (size_t)m * kDim, lane, v);
    load16(p.kv_norm, lane, w);
    const float rstd = warp_rstd(v, p.eps);
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = bf16r(__fmul_rn(w[i], __fmul_rn(v[i], rstd)));
    rope_lane16(v, lane, pos, p.freqs);
    const mm::KvLaneQuant q = mm::kv_quantize_lane(v);
    mm::kv_entry_store_lane(p.pool + slot * mm::kKvEntryBytes, q, v, lane);
    if (lane == 0) p.kv_rstd[m] = rstd;
}

// indexer q, CTA (x, m) of its part's (ceil(index_heads / 8), rows) grid (see the top of the file); num_valid
// (when not null) [rows] = (t + 1) / ratio for t = positions[row] >= 0, else 0: the indexer keys the query at t
// sees (the compressor has emitted (t + 1) / ratio of them after this step's update;
// LayerCacheLayout::compressed_after), written by thread 0 of the row's first CTA.
__device__ __forceinline__ void indexer_q_cta(const PrepParams& p, int x, int m) {
    const int lane = threadIdx.x & 31;
    const int head = x * kHeadsPerCta + (threadIdx.x >> 5);
    const int pos = p.positions[m];
    if (p.num_valid != nullptr && x == 0 && threadIdx.x == 0) p.num_valid[m] = pos >= 0 ? (pos + 1) / p.ratio : 0;
    if (head >= p.index_heads) return;
    if (pos < 0) return;
    const size_t vec = (size_t)m * p.index_heads + head;
    const uint2 raw = *reinterpret_cast<const uint2*>(p.qi_in + vec * kIndexDim + 4 * lane);
    float v[4] = {bf16_lo(raw.x), bf16_hi(raw.x), bf16_lo(raw.y), bf16_hi(raw.y)};
    if (lane >= 16) {  // dims 64..127: pairs 2 (lane - 16) and 2 (lane - 16) + 1
        const int pr = 2 * (lane - 16);
        mm::rope_rotate_pair(v[0], v[1], pos, p.freqs[pr], false);
        mm::rope_rotate_pair(v[2], v[3], pos, p.freqs[pr + 1], false);
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = bf16r(v[i]);
    }
    mm::hadamard128_warp(v, lane);
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = bf16r(v[i]);
    // FP4 simulation per 32 dims = 8 consecutive lanes (xor 4, 2, 1 stay inside the group).
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int o = 4; o >= 1; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float floor = __uint_as_float(0x01C00000u);  // 6 * 2^-126, DSV4's FP4 amax floor
    const uint8_t sc = mm::ue8m0_pow2_scale_for(fmaxf(amax, floor), 6.f);
    const float s = mm::ue8m0_decode(sc);
    float f[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = __fmul_rn(mm::e2m1_decode(mm::e2m1_encode(__fdiv_rn(v[i], s))), s);
    // Head scale 2^e, code hc = max(K - 6, 1) with K the largest block code (xor 8, 16 cross the four blocks).
    int k = sc;
    k = max(k, __shfl_xor_sync(0xffffffffu, k, 8));
    k = max(k, __shfl_xor_sync(0xffffffffu, k, 16));
    const int hc = max(k - 6, 1);
    const float inv_head = mm::ue8m0_decode((uint8_t)(254 - hc));  // 2^(127 - hc) = 2^-e, exact (hc in [1, 248])
    uint32_t word = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) word |= (uint32_t)mm::e4m3_encode(__fmul_rn(f[i], inv_head)) << (8 * i);
    reinterpret_cast<uint32_t*>(p.q_codes + vec * kIndexDim)[lane] = word;
    if (lane == 0) {
        const float wb = bf16r(__fmul_rn(bf16r(p.w_in[vec]), p.w_scale));
        p.w_out[vec] = __fmul_rn(wb, mm::ue8m0_decode((uint8_t)hc));
    }
}

}  // namespace qp

// Grid (q_ctas + kv_ctas + index_ctas), 256 threads. The per-head parts' CTAs are laid out row-major over their own
// (x, row) grids: CTA i of the q part is (i % ceil(heads / 8), i / ceil(heads / 8)).
extern "C" __global__ void __launch_bounds__(256) qkv_prep_attn(const __grid_constant__ PrepParams p) {
    pdl_trigger();  // a PDL-launched successor (the decode GEMV) stages its weights meanwhile
    int b = blockIdx.x;
    if (b < p.q_ctas) {
        const int xs = (p.heads + qp::kHeadsPerCta - 1) / qp::kHeadsPerCta;
        qp::q_heads_cta(p, b % xs, b / xs);
        return;
    }
    b -= p.q_ctas;
    if (b < p.kv_ctas) {
        qp::kv_entries_cta(p, b);
        return;
    }
    b -= p.kv_ctas;
    const int xs = (p.index_heads + qp::kHeadsPerCta - 1) / qp::kHeadsPerCta;
    qp::indexer_q_cta(p, b % xs, b / xs);
}

// The launch floor of the bench (one empty CTA).
extern "C" __global__ void qkv_prep_launch_floor() {}
