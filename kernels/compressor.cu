// KV compressors of DeepSeek-V4 (dsv4-architecture §3.7) on the device: the decode-time state update with the
// block emission, and a chunk of one sequence continuing its state (the chunked prefill). The CPU oracle is
// model::reference::{CompressorState, pool_softmax} + Model::{compressor_inputs, finalize_entry}.
//
// Shapes. A compressor has ratio m, d output channels (main: head_dim 512; indexer: index_head_dim 128) and is
// overlapping (CSA, coff = 2) or not (HCA, coff = 1). Its inputs per token are kv and gate, f32 [coff*d] each
// (BF16 linears of the attention input), and the learned position bias ape f32 [m, coff*d]; the score of a token
// at position t is gate + ape[t mod m] (one f32 add).
//
// State (one sequence, f32, exactly CompressorState's fields): kv plane [coff*m, coff*d] then score plane
// [coff*m, coff*d]; W = coff*d channels per row, rows_per_seq = coff*m, state floats per sequence =
// 2 * coff*m * coff*d. Token t writes row (CSA) m + t%m, (HCA) t%m. An empty row holds kv 0, score -inf.
// After an emission the state is canonical: CSA moves rows m..2m to 0..m (the next block's "previous block")
// and empties rows m..2m; HCA empties every row.
//
// Emission (t + 1 ≡ 0 mod m, entry j = (t+1)/m - 1):
//   pooled[c] = Σ_s softmax_s(score_s[off_s + c]) kv_s[off_s + c], sources in order: CSA rows 0..m with
//     off 0 (the previous block's first channel half), rows m..2m with off d; HCA rows 0..m with off 0.
//     Computed exactly like pool_softmax: max by a left fold, then num += e*kv, den += e in source order, each
//     product/sum rounded separately (no FMA), out = num / den. e = exp(score - max) is formed as the f64 exp
//     rounded to f32; the host's expf (glibc) is correctly rounded in all but rare cases, and so is this, so
//     the two agree except where exp's value sits within ~1e-3 f32 ulp of a rounding boundary.
//   finalize: x = bf16(pooled); inv = 1 / sqrt(Σ x² / d + eps) with the sum of the squares in f64 (each
//     square of a BF16 value is exact in f64, and so is the sum while it fits 53 bits: then the block tree's
//     order does not matter and inv equals model::numerics::inv_rms bit for bit); y = bf16(w * (x * inv));
//     RoPE at position j*m on the last 64 dims (mm::rope_rotate_pair, the layer's f64 freqs), BF16 again.
//   store, main: the 584-byte KV entry (mm::kv_entry_store_warp: FP8 per 64 nope dims + BF16 rope dims;
//     decoding it gives finalize_entry's fp8_sim values exactly).
//   store, indexer: Hadamard (index_key::hadamard128_warp) -> BF16 -> FP4 rule per 32 dims; MXFP4 cache: the
//     FP4 codes and scales themselves (decode = finalize_entry's values exactly); FP8 cache: the FP4-simulated
//     values e2m1 * 2^e (exact f32) encoded as a 132-byte FP8 key (= formats::indexer_key::encode_fp8 of
//     finalize_entry's values).
//   slot = base[b] + j, written only when 0 <= j < capacity[b] and 0 <= slot < n_slots; otherwise nothing is
//     written and bit 0 of *error is set (atomicOr; the host reads it after the step).
//
// Graph safety: grids come from the batch capacity (decode) or the chunk's rows (chunk); positions, bases and
// capacities are read on the device. A decode row with position < 0 changes nothing.
// Decode: one cluster of d / 64 CTAs per sequence (each owns 64 channels of each channel half: their state
// update, pooling and reset; cluster rank 0 finalizes the row), see decode_body. Chunk: one CTA per entry, d
// threads (thread c owns channel c, and d + c for CSA), then one CTA per state row pair.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "common/formats.cuh"
#include "common/index_key.cuh"
#include "common/kv_entry.cuh"
#include "common/rope.cuh"

namespace cg = cooperative_groups;

namespace {

constexpr int kRopeDims = 64;
constexpr int kMainDim = 512;
constexpr int kIndexDim = 128;

enum Store { STORE_KV_ENTRY = 0, STORE_INDEX_FP8 = 1, STORE_INDEX_MXFP4 = 2 };

__device__ __forceinline__ float bf16_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// Everything the finalize + store step needs besides the pooled value.
struct Finalize {
    const float* norm_w;  // [d] the compressor's norm.weight
    const double* freqs;  // [32] the layer's RoPE frequencies
    float eps;
    uint8_t* out_codes;   // main: entries [n_slots, 584]; indexer: codes [n_slots, 128 (FP8) or 64 (MXFP4)]
    void* out_scales;     // indexer: f32 [n_slots] (FP8) or ue8m0 [n_slots, 4] (MXFP4); main: unused
    int n_slots;
    unsigned* error;      // bit 0: an emitted entry fell outside the sequence's capacity or the cache
};

// Pooling of one channel over n sources in order; src(s, kv, score) yields source s (pool_softmax's order).
template <typename Src>
__device__ __forceinline__ float pool_channel(int n, Src src) {
    float mx = -INFINITY;
    for (int s = 0; s < n; ++s) {
        float kv, sc;
        src(s, kv, sc);
        mx = fmaxf(mx, sc);
    }
    float num = 0.f, den = 0.f;
    for (int s = 0; s < n; ++s) {
        float kv, sc;
        src(s, kv, sc);
        const float e = static_cast<float>(exp(static_cast<double>(__fsub_rn(sc, mx))));
        num = __fadd_rn(num, __fmul_rn(e, kv));
        den = __fadd_rn(den, e);
    }
    return __fdiv_rn(num, den);
}

// f64 block sum over D threads (D / 32 warps), the result broadcast to every thread.
template <int D>
__device__ __forceinline__ double block_sum_f64(double v, double* red) {
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    double s = 0.0;
#pragma unroll
    for (int w = 0; w < D / 32; ++w) s += red[w];
    return s;
}

// Finalize entry j of pooled channel values (thread c holds pooled[c]) and store it at `slot` (already checked).
// Every thread of the CTA calls it (barriers inside).
template <int D, int STORE>
__device__ __forceinline__ void finalize_store(float pooled, long long rope_pos, int slot, const Finalize& f) {
    __shared__ float k[D];
    __shared__ double red[D / 32];
    const int c = threadIdx.x;
    const float x = bf16_round(pooled);
    const double ss = block_sum_f64<D>(static_cast<double>(x) * static_cast<double>(x), red);
    const float inv = static_cast<float>(__ddiv_rn(1.0, __dsqrt_rn(__dadd_rn(__ddiv_rn(ss, (double)D), (double)f.eps))));
    k[c] = bf16_round(__fmul_rn(f.norm_w[c], __fmul_rn(x, inv)));
    __syncthreads();
    if (c < kRopeDims / 2) {
        float& x0 = k[D - kRopeDims + 2 * c];
        float& x1 = k[D - kRopeDims + 2 * c + 1];
        float a = x0, b = x1;
        mm::rope_rotate_pair(a, b, rope_pos, f.freqs[c], false);
        x0 = bf16_round(a);
        x1 = bf16_round(b);
    }
    __syncthreads();
    if (slot < 0 || c >= 32) return;  // the store is one warp's
    const int lane = c;
    if constexpr (STORE == STORE_KV_ENTRY) {
        static_assert(D == 512, "the KV entry holds 512 dims");
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = k[16 * lane + i];
        mm::kv_entry_store_warp(f.out_codes, slot, v, lane);
    } else {
        static_assert(D == index_key::kDim, "an indexer key holds 128 dims");
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = k[4 * lane + i];
        index_key::hadamard128_warp(v, lane);
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = bf16_round(v[i]);
        if constexpr (STORE == STORE_INDEX_MXFP4) {
            index_key::store_mxfp4(v, lane, f.out_codes, static_cast<uint8_t*>(f.out_scales), slot);
        } else {
            uint32_t e[4];
            uint8_t sc;
            index_key::mxfp4_quantize(v, e, sc);
            const float s = mm::ue8m0_decode(sc);
#pragma unroll
            for (int i = 0; i < 4; ++i) v[i] = __fmul_rn(mm::e2m1_decode((uint8_t)e[i]), s);
            index_key::store_fp8(v, lane, f.out_codes, static_cast<float*>(f.out_scales), slot);
        }
    }
}

// The slot of entry j of sequence b, or -1 (and the error bit) when it is outside the capacity or the cache.
__device__ __forceinline__ int entry_slot(int j, int base, int capacity, const Finalize& f) {
    const long long slot = (long long)base + j;
    if (j < 0 || j >= capacity || base < 0 || slot >= f.n_slots) {
        if (threadIdx.x == 0) atomicOr(f.error, 1u);
        return -1;
    }
    return (int)slot;
}

// The one-CTA decode step (CTA b, D threads: thread c owns channel c, and d + c for CSA, of every row), the
// kernel before decode_body spread the emission over a cluster; kept as the bit-exactness reference of
// decode_body (tests/compressor.rs compares the two bit for bit) and as the A/B baseline.
template <int D, bool OVERLAP, int STORE>
__device__ __forceinline__ void decode_body_one_cta(const float* __restrict__ kv_in, const float* __restrict__ gate_in,
                                            const float* __restrict__ ape, const int* __restrict__ positions,
                                            int ratio, float* __restrict__ state, const int* __restrict__ base,
                                            const int* __restrict__ capacity, float* __restrict__ pooled_out,
                                            const Finalize& f) {
    constexpr int kCoff = OVERLAP ? 2 : 1;
    constexpr int W = kCoff * D;
    const int b = blockIdx.x;
    const int c = threadIdx.x;
    const int t = positions[b];
    if (t < 0) return;  // an empty batch row (CTA-uniform)
    const int m = ratio;
    const int rows = kCoff * m;
    float* kv_st = state + (size_t)b * 2 * rows * W;
    float* sc_st = kv_st + (size_t)rows * W;
    const int r_new = OVERLAP ? m + t % m : t % m;
#pragma unroll
    for (int h = 0; h < kCoff; ++h) {
        const int ch = h * D + c;
        kv_st[(size_t)r_new * W + ch] = kv_in[(size_t)b * W + ch];
        sc_st[(size_t)r_new * W + ch] = __fadd_rn(gate_in[(size_t)b * W + ch], ape[(size_t)(t % m) * W + ch]);
    }
    if ((t + 1) % m != 0) return;  // CTA-uniform
    // Every address read below was written by this thread (now or in an earlier step): no barrier needed.
    float pooled;
    if (OVERLAP) {
        pooled = pool_channel(2 * m, [&](int s, float& kv, float& sc) {
            const size_t i = (size_t)s * W + (s < m ? c : D + c);
            kv = kv_st[i];
            sc = sc_st[i];
        });
    } else {
        pooled = pool_channel(m, [&](int s, float& kv, float& sc) {
            const size_t i = (size_t)s * W + c;
            kv = kv_st[i];
            sc = sc_st[i];
        });
    }
    if (pooled_out != nullptr) pooled_out[(size_t)b * D + c] = pooled;
    // Canonical state for the next block (each thread resets the channels it owns).
#pragma unroll
    for (int h = 0; h < kCoff; ++h) {
        const int ch = h * D + c;
        if (OVERLAP) {
            for (int r = 0; r < m; ++r) {
                kv_st[(size_t)r * W + ch] = kv_st[(size_t)(m + r) * W + ch];
                sc_st[(size_t)r * W + ch] = sc_st[(size_t)(m + r) * W + ch];
                kv_st[(size_t)(m + r) * W + ch] = 0.f;
                sc_st[(size_t)(m + r) * W + ch] = -INFINITY;
            }
        } else {
            for (int r = 0; r < m; ++r) {
                kv_st[(size_t)r * W + ch] = 0.f;
                sc_st[(size_t)r * W + ch] = -INFINITY;
            }
        }
    }
    const int j = (t + 1) / m - 1;
    const int slot = entry_slot(j, base[b], capacity[b], f);
    finalize_store<D, STORE>(pooled, (long long)j * m, slot, f);
}

// ---- decode: one cluster of D / kSliceDims CTAs per sequence ------------------------------------------------------
// CTA (slice r = cluster rank, sequence b = blockIdx.y), D threads, owns the channels c0 + [0, 64) of each channel
// half (c0 = 64 r; channels c and D + c for CSA): the state update, the pooling and the post-emission reset of
// those channels touch only addresses this CTA owns. The pooling of one channel is spread over TPC = D / 64
// threads (part p takes the sources s = p mod TPC) in two steps, each bit-identical to pool_channel's serial loop:
//   max:  each part folds fmaxf over its sources from -inf, then the TPC partial maxima are folded. fmaxf returns
//         the numeric operand when one is NaN, so a fold from -inf is the maximum of -inf and the non-NaN sources
//         in any order and grouping (exact; signed zeros aside, and sc - (+0) and sc - (-0) give the same exp).
//   sums: per chunk of kChunk sources, every thread forms e = f32(exp(f64(sc - mx))) and e * kv (rounded, as in
//         pool_channel) of its sources into shared memory; then part 0 adds them into num and den in source
//         order, each sum rounded: pool_channel's operations in pool_channel's order.
// The finalize (RMSNorm over the row, RoPE, the entry's FP8 / the key's Hadamard + FP4) needs the whole row: every
// CTA writes its 64 pooled values into the shared memory of cluster rank 0 (distributed shared memory), the cluster
// barrier makes them visible, and rank 0 runs finalize_store with thread c = channel c, as the one-CTA kernel did.
// Grid (D / 64, batch), cluster (D / 64, 1, 1) (8 CTAs for the main compressors, 2 for the indexer); every branch
// before the cluster barrier is uniform over the cluster (it depends on b only).
constexpr int kSliceDims = 64;   // channels per CTA (per channel half)
constexpr int kChunk = 32;       // sources per shared-memory chunk of the sums

template <int D, bool OVERLAP, int STORE>
__device__ __forceinline__ void decode_body(const float* __restrict__ kv_in, const float* __restrict__ gate_in,
                                            const float* __restrict__ ape, const int* __restrict__ positions,
                                            int ratio, float* __restrict__ state, const int* __restrict__ base,
                                            const int* __restrict__ capacity, float* __restrict__ pooled_out,
                                            const Finalize& f) {
    constexpr int kCoff = OVERLAP ? 2 : 1;
    constexpr int W = kCoff * D;
    constexpr int TPC = D / kSliceDims;  // threads per channel = CTAs per cluster
    static_assert(D % kSliceDims == 0 && TPC >= kCoff, "a CTA's D threads cover its 64 x coff state channels");
    __shared__ float part_max[TPC][kSliceDims];
    __shared__ float e_sh[kChunk][kSliceDims];
    __shared__ float p_sh[kChunk][kSliceDims];
    __shared__ float pooled_row[D];  // rank 0's copy is the row the finalize reads
    cg::cluster_group cluster = cg::this_cluster();
    const int r = (int)cluster.block_rank();
    const int c0 = r * kSliceDims;
    const int b = blockIdx.y;
    const int tid = threadIdx.x;
    const int cl = tid % kSliceDims, part = tid / kSliceDims;
    const int c = c0 + cl;
    const int t = positions[b];
    if (t < 0) return;  // an empty batch row (uniform over the cluster)
    const int m = ratio;
    const int rows = kCoff * m;
    float* kv_st = state + (size_t)b * 2 * rows * W;
    float* sc_st = kv_st + (size_t)rows * W;
    const int r_new = OVERLAP ? m + t % m : t % m;
    if (part < kCoff) {
        const int ch = part * D + c;
        kv_st[(size_t)r_new * W + ch] = kv_in[(size_t)b * W + ch];
        sc_st[(size_t)r_new * W + ch] = __fadd_rn(gate_in[(size_t)b * W + ch], ape[(size_t)(t % m) * W + ch]);
    }
    if ((t + 1) % m != 0) return;  // uniform over the cluster
    __syncthreads();  // the new row is read by other threads of this CTA below
    const int n = OVERLAP ? 2 * m : m;
    // source s of channel c: row s, channel half 1 for the second block of an overlapping compressor
    auto src_index = [&](int s) -> size_t { return (size_t)s * W + ((OVERLAP && s >= m) ? D + c : c); };
    float mx = -INFINITY;
    for (int s = part; s < n; s += TPC) mx = fmaxf(mx, sc_st[src_index(s)]);
    part_max[part][cl] = mx;
    __syncthreads();
    mx = -INFINITY;
#pragma unroll
    for (int q = 0; q < TPC; ++q) mx = fmaxf(mx, part_max[q][cl]);
    float num = 0.f, den = 0.f;
    for (int s0 = 0; s0 < n; s0 += kChunk) {
        const int len = min(kChunk, n - s0);
        for (int i = part; i < len; i += TPC) {
            const size_t at = src_index(s0 + i);
            const float e = static_cast<float>(exp(static_cast<double>(__fsub_rn(sc_st[at], mx))));
            e_sh[i][cl] = e;
            p_sh[i][cl] = __fmul_rn(e, kv_st[at]);
        }
        __syncthreads();
        if (part == 0) {
            for (int i = 0; i < len; ++i) {
                num = __fadd_rn(num, p_sh[i][cl]);
                den = __fadd_rn(den, e_sh[i][cl]);
            }
        }
        __syncthreads();  // e_sh / p_sh are rewritten by the next chunk; the last one orders the reads below
    }
    if (part == 0) {
        const float pooled = __fdiv_rn(num, den);
        if (pooled_out != nullptr) pooled_out[(size_t)b * D + c] = pooled;
        cluster.map_shared_rank(pooled_row, 0)[c] = pooled;
    }
    // Canonical state for the next block: every read of the state above precedes the last __syncthreads. Item
    // (row rr, half h) of channel c moves / empties rows rr and m + rr only: the items are independent.
    for (int i = part; i < m * kCoff; i += TPC) {
        const int rr = i / kCoff, ch = (i % kCoff) * D + c;
        if (OVERLAP) {
            kv_st[(size_t)rr * W + ch] = kv_st[(size_t)(m + rr) * W + ch];
            sc_st[(size_t)rr * W + ch] = sc_st[(size_t)(m + rr) * W + ch];
            kv_st[(size_t)(m + rr) * W + ch] = 0.f;
            sc_st[(size_t)(m + rr) * W + ch] = -INFINITY;
        } else {
            kv_st[(size_t)rr * W + ch] = 0.f;
            sc_st[(size_t)rr * W + ch] = -INFINITY;
        }
    }
    cluster.sync();  // every CTA's pooled values are in rank 0's pooled_row (release / acquire at cluster scope)
    if (r != 0) return;
    const int j = (t + 1) / m - 1;
    const int slot = entry_slot(j, base[b], capacity[b], f);
    finalize_store<D, STORE>(pooled_row[tid], (long long)j * m, slot, f);
}

// ---- a chunk of one sequence, continuing its state (the engine's chunked prefill) ----------------------------------
// n tokens at positions p0 .. p0 + n - 1 (p0 = positions[0], read on the device; p0 < 0 or n <= 0: nothing), rows
// 0..n of kv_in / gate_in [n, W], after the p0 tokens the sequence's state holds as p0 decode steps left it. Token t
// of channel ch, (kv, score), for done0 = (p0 / m) m:
//   t >= p0:                  input row t - p0, score = gate + ape[t mod m] (the decode step's f32 add);
//   done0 <= t < p0:          the state's row (CSA) m + t - done0, (HCA) t - done0 (the current block);
//   done0 - m <= t < done0:   (CSA) the state's row t - done0 + m (the previous block, rows 0..m);
//   t < 0:                    empty (kv 0, score -inf), as a new state's rows are.
// Entries (compressor_chunk_entries_*): CTA i emits entry j = p0 / m + i when its block ends inside the chunk ((j + 1)
// m <= p0 + n), pooling the sources in the decode step's order (CSA: tokens (j - 1) m + s through channel half 0,
// then j m + s through half 1, 2m sources even for j = 0, whose first m are empty as in decode; HCA: j m + s), then
// the decode step's finalize and store: the entries of n decode steps bit for bit. Grid n / m + 1 (the most
// emissions a chunk of n holds), block d threads, thread c = channel c.
// State (compressor_chunk_state): afterwards the state is what n more decode steps leave, done1 = ((p0 + n) / m) m:
// CSA row r < m = token done1 - m + r (empty when done1 = 0), row m + r = token done1 + r while < p0 + n; HCA row r =
// token done1 + r while < p0 + n; every other row empty. A new row reads an old row only at its own row index or at
// r + m from row r < m (the block that straddles p0), so CTA r owns rows r and m + r, and each thread reads its
// channel's sources before it writes them. Runs after the entries kernel (which reads the old state). Grid m, block
// 256 over W channels.
template <bool OVERLAP>
struct ChunkTokens {
    const float* kv_in;
    const float* gate_in;
    const float* ape;
    const float* state;  // kv plane [rows, W] then score plane [rows, W]
    int m, W, p0, done0;
    __device__ __forceinline__ void get(int t, int ch, float& kv, float& sc) const {
        const int rows = (OVERLAP ? 2 : 1) * m;
        int row = -1;
        if (t >= p0) {
            kv = kv_in[(size_t)(t - p0) * W + ch];
            sc = __fadd_rn(gate_in[(size_t)(t - p0) * W + ch], ape[(size_t)(t % m) * W + ch]);
            return;
        }
        if (t >= done0) {
            row = OVERLAP ? m + t - done0 : t - done0;
        } else if (OVERLAP && t >= 0 && t >= done0 - m) {
            row = t - done0 + m;
        }
        if (row < 0) {
            kv = 0.f;
            sc = -INFINITY;
            return;
        }
        kv = state[(size_t)row * W + ch];
        sc = state[(size_t)rows * W + (size_t)row * W + ch];
    }
};

template <int D, bool OVERLAP, int STORE>
__device__ __forceinline__ void chunk_entries_body(const float* __restrict__ kv_in, const float* __restrict__ gate_in,
                                                   const float* __restrict__ ape, const int* __restrict__ positions,
                                                   int n, int ratio, const float* __restrict__ state,
                                                   const int* __restrict__ base, const int* __restrict__ capacity,
                                                   const Finalize& f) {
    constexpr int W = (OVERLAP ? 2 : 1) * D;
    const int m = ratio;
    const int p0 = positions[0];
    if (p0 < 0 || n <= 0) return;  // CTA-uniform
    const int j = p0 / m + (int)blockIdx.x;
    if ((long long)(j + 1) * m > (long long)p0 + n) return;  // the block does not end inside the chunk (CTA-uniform)
    const int c = threadIdx.x;
    const ChunkTokens<OVERLAP> tok{kv_in, gate_in, ape, state, m, W, p0, (p0 / m) * m};
    float pooled;
    if (OVERLAP) {
        pooled = pool_channel(2 * m, [&](int s, float& kv, float& sc) {
            if (s < m) tok.get((j - 1) * m + s, c, kv, sc);
            else tok.get(j * m + s - m, D + c, kv, sc);
        });
    } else {
        pooled = pool_channel(m, [&](int s, float& kv, float& sc) { tok.get(j * m + s, c, kv, sc); });
    }
    const int slot = entry_slot(j, *base, *capacity, f);
    finalize_store<D, STORE>(pooled, (long long)j * m, slot, f);
}

template <bool OVERLAP>
__device__ __forceinline__ void chunk_state_body(const float* __restrict__ kv_in, const float* __restrict__ gate_in,
                                                 const float* __restrict__ ape, const int* __restrict__ positions,
                                                 int n, int ratio, int width, float* state) {
    const int m = ratio;
    const int p0 = positions[0];
    if (p0 < 0 || n <= 0) return;  // CTA-uniform
    const int r = blockIdx.x;
    if (r >= m) return;
    const int rows = (OVERLAP ? 2 : 1) * m;
    const int end = p0 + n;
    const int done1 = (end / m) * m;
    const ChunkTokens<OVERLAP> tok{kv_in, gate_in, ape, state, m, width, p0, (p0 / m) * m};
    // Row r's token, and (CSA) row m + r's; -1: empty.
    const int ta = OVERLAP ? (done1 > 0 ? done1 - m + r : -1) : (done1 + r < end ? done1 + r : -1);
    const int tb = done1 + r < end ? done1 + r : -1;
    for (int ch = threadIdx.x; ch < width; ch += blockDim.x) {
        float kva = 0.f, sca = -INFINITY, kvb = 0.f, scb = -INFINITY;
        if (ta >= 0) tok.get(ta, ch, kva, sca);
        if (OVERLAP && tb >= 0) tok.get(tb, ch, kvb, scb);
        // Every old value this thread needs is read above: rows r and m + r of channel ch are only its own.
        state[(size_t)r * width + ch] = kva;
        state[(size_t)rows * width + (size_t)r * width + ch] = sca;
        if (OVERLAP) {
            state[(size_t)(m + r) * width + ch] = kvb;
            state[(size_t)rows * width + (size_t)(m + r) * width + ch] = scb;
        }
    }
}

}  // namespace

#define COMPRESSOR_DECODE_PARAMS                                                                                 \
    const float *kv_in, const float *gate_in, const float *ape, const int *positions, int ratio, float *state,   \
        const float *norm_w, const double *freqs, float eps, const int *base, const int *capacity, int n_slots, \
        uint8_t *out_codes, void *out_scales, float *pooled_out, unsigned *error
#define COMPRESSOR_FINALIZE Finalize{norm_w, freqs, eps, out_codes, out_scales, n_slots, error}

// Decode step, grid (d / 64, batch capacity) in clusters of (d / 64, 1, 1), block = d threads. kv_in/gate_in
// [B, W]; ape [m, W]; positions [B]; state [B, 2, coff*m, W]; base/capacity [B]; pooled_out [B, d] or null (a
// test probe).
#define COMPRESSOR_DECODE_ENTRY(NAME, D, OVERLAP, STORE)                                                       \
    extern "C" __global__ void __launch_bounds__(D) __cluster_dims__(D / kSliceDims, 1, 1)                    \
        NAME(COMPRESSOR_DECODE_PARAMS) {                                                                      \
        decode_body<D, OVERLAP, STORE>(kv_in, gate_in, ape, positions, ratio, state, base, capacity, pooled_out, \
                                       COMPRESSOR_FINALIZE);                                                     \
    }
// The one-CTA reference (decode_body_one_cta): grid = batch capacity, block = d threads, same parameters.
#define COMPRESSOR_DECODE_ONE_CTA_ENTRY(NAME, D, OVERLAP, STORE)                                               \
    extern "C" __global__ void __launch_bounds__(D) NAME(COMPRESSOR_DECODE_PARAMS) {                          \
        decode_body_one_cta<D, OVERLAP, STORE>(kv_in, gate_in, ape, positions, ratio, state, base, capacity,  \
                                               pooled_out, COMPRESSOR_FINALIZE);                               \
    }
COMPRESSOR_DECODE_ENTRY(compressor_decode_csa_main, kMainDim, true, STORE_KV_ENTRY)
COMPRESSOR_DECODE_ENTRY(compressor_decode_hca_main, kMainDim, false, STORE_KV_ENTRY)
COMPRESSOR_DECODE_ENTRY(compressor_decode_csa_index_fp8, kIndexDim, true, STORE_INDEX_FP8)
COMPRESSOR_DECODE_ENTRY(compressor_decode_csa_index_mxfp4, kIndexDim, true, STORE_INDEX_MXFP4)
COMPRESSOR_DECODE_ONE_CTA_ENTRY(compressor_decode_csa_main_one_cta, kMainDim, true, STORE_KV_ENTRY)
COMPRESSOR_DECODE_ONE_CTA_ENTRY(compressor_decode_hca_main_one_cta, kMainDim, false, STORE_KV_ENTRY)
COMPRESSOR_DECODE_ONE_CTA_ENTRY(compressor_decode_csa_index_fp8_one_cta, kIndexDim, true, STORE_INDEX_FP8)
COMPRESSOR_DECODE_ONE_CTA_ENTRY(compressor_decode_csa_index_mxfp4_one_cta, kIndexDim, true, STORE_INDEX_MXFP4)
// A chunk's entries (chunk_entries_body): grid n / m + 1, block d threads. kv_in/gate_in [n, W] (raw gate); positions
// [>= 1] (positions[0] = the chunk's first position); state: the sequence's [2, coff*m, W] (read only); base/capacity
// [1] (the sequence's).
#define COMPRESSOR_CHUNK_ENTRIES_ENTRY(NAME, D, OVERLAP, STORE)                                                \
    extern "C" __global__ void __launch_bounds__(D) NAME(                                                       \
        const float *kv_in, const float *gate_in, const float *ape, const int *positions, int n, int ratio,   \
        const float *state, const float *norm_w, const double *freqs, float eps, const int *base,             \
        const int *capacity, int n_slots, uint8_t *out_codes, void *out_scales, unsigned *error) {            \
        chunk_entries_body<D, OVERLAP, STORE>(kv_in, gate_in, ape, positions, n, ratio, state, base, capacity,  \
                                              Finalize{norm_w, freqs, eps, out_codes, out_scales, n_slots, error}); \
    }

COMPRESSOR_CHUNK_ENTRIES_ENTRY(compressor_chunk_entries_csa_main, kMainDim, true, STORE_KV_ENTRY)
COMPRESSOR_CHUNK_ENTRIES_ENTRY(compressor_chunk_entries_hca_main, kMainDim, false, STORE_KV_ENTRY)
COMPRESSOR_CHUNK_ENTRIES_ENTRY(compressor_chunk_entries_csa_index_fp8, kIndexDim, true, STORE_INDEX_FP8)
COMPRESSOR_CHUNK_ENTRIES_ENTRY(compressor_chunk_entries_csa_index_mxfp4, kIndexDim, true, STORE_INDEX_MXFP4)

// A chunk's state update (chunk_state_body): grid m, block 256. overlap selects the CSA layout.
extern "C" __global__ void __launch_bounds__(256) compressor_chunk_state(const float* __restrict__ kv_in,
                                                                        const float* __restrict__ gate_in,
                                                                        const float* __restrict__ ape,
                                                                        const int* __restrict__ positions, int n,
                                                                        int ratio, int width, int overlap,
                                                                        float* state) {
    if (overlap) {
        chunk_state_body<true>(kv_in, gate_in, ape, positions, n, ratio, width, state);
    } else {
        chunk_state_body<false>(kv_in, gate_in, ape, positions, n, ratio, width, state);
    }
}
