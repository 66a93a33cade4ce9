// mhc: the DSV4 manifold-constrained hyper-connection (mHC) boundary around a sub-layer, fused with the
// sub-layer's RMSNorm + quantization: hc_pre (split-K mixes of the 4 residual streams, Sinkhorn, u = sum pre_i X_i)
// + RMSNorm(u) -> {NVFP4, FP8 1x128, BF16}; hc_post; hc_post fused into the next boundary's mixes; hc_head; and
// the op-by-op chain the fused boundary is measured against. Launchers: src/ops/mhc/mod.rs.
//
// Layouts (token-major; every kernel computes each token independently): X [T, 4, D] BF16 stream-major,
// F [NMIX, 4D] f32 (NMIX = 24 for a sub-layer boundary, 4 for the head), split-K partials [T, NMIX+1, S] f32
// (S contiguous; entry NMIX is the sum of squares), pre/post [T, 4], comb [T, 16] row-major C[j][k], u [T, D].
//
// Boundary, two kernels: a split-K mix (mhc_mix_partial24_staged: every CTA stages its whole tile, F 24 x 128
//   fp32 = 12 KB and X <= 32 x 128 BF16 = 8 KB, with cp.async in ONE round trip, then computes from shared
//   memory) and a per-token finish (mhc_pre_finish_*: grid (T, 2); y = 0 reduces the partials, writes pre, u and
//   RMSNorm(u) + quant; y = 1 writes post and runs the Sinkhorn on 16 lanes). The launcher takes them
//   - as a programmatic-dependent-launch pair (mhc_mix_partial24_pdl + mhc_pre_finish_pdl_*; same arithmetic,
//     bit-identical outputs) at decode sizes: the finish's launch latency hides behind the mix, and in a graph
//     of consecutive boundaries the next mix stages F while the previous finish runs;
//   - as two plain launches at middle token counts (a waiting PDL finish grid holds SM resources the mix needs);
//   - with the mix on BF16 tensor cores (kernels/mhc_mix_tc.cu, its own S) for prefill-sized batches; the finish
//     kernels take S as an argument and are shared.
//   The routing rule and the measurements that decided it: mhc_pre_auto_path in src/ops/mhc/mod.rs.
// hc_head: mhc_mix_partial4 (lane = token, warp-uniform broadcast loads of F) + mhc_head_finish_bf16.
// mhc_post: X'[k] = post_k y + sum_j C[j][k] X[j], fp32 (explicit rn ops, no FMA), BF16 store.
// Bytes per decode token (D = 4096): F 1.5 MB (shared by all tokens of a launch), X 32 KB, out ~ 2-8 KB.
//
// Rounding points (the CPU reference in src/ops/mhc/reference.rs has the same): rho = 1/sqrt(ss/4D + eps),
// logits rho * dot * scale + base with rn ops, sigmoid 1/(1 + exp(-z)), the Sinkhorn with correctly rounded
// reciprocals; u BF16; the RMSNorm + quantizer of common/norm_row.cuh. Only the fp32 sums (F.x, sum of squares)
// have a reduction order different from the reference.
#include "common/norm_row.cuh"
#include "common/pdl.cuh"

namespace {

constexpr int MIX_COLS = 128;   // columns of 4D per CTA in mhc_mix_partial
constexpr int MIX_THREADS = 128;

template <int NMIX>
__device__ void mhc_mix_partial(const __nv_bfloat16* __restrict__ X, const float* __restrict__ F,
                                float* __restrict__ part, int T, int D4) {
    __shared__ float red[MIX_THREADS / 32][NMIX + 1][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int s = blockIdx.x;
    const int token = blockIdx.y * 32 + lane;
    const bool valid = token < T;
    const int c0 = s * MIX_COLS + warp * (MIX_COLS / 4);
    float acc[NMIX + 1];
#pragma unroll
    for (int j = 0; j <= NMIX; ++j) acc[j] = 0.f;
#pragma unroll
    for (int it = 0; it < MIX_COLS / 4 / 8; ++it) {
        const int c = c0 + it * 8;
        float xv[8];
        if (valid) {
            load8(X + (long)token * D4 + c, xv);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) xv[e] = 0.f;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[NMIX] = fmaf(xv[e], xv[e], acc[NMIX]);
#pragma unroll
        for (int j = 0; j < NMIX; ++j) {
            float fv[8];
            load8(F + (long)j * D4 + c, fv);  // warp-uniform address: one broadcast transaction
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[j] = fmaf(fv[e], xv[e], acc[j]);
        }
    }
#pragma unroll
    for (int j = 0; j <= NMIX; ++j) red[warp][j][lane] = acc[j];
    __syncthreads();
    for (int i = threadIdx.x; i < (NMIX + 1) * 32; i += MIX_THREADS) {
        const int j = i / 32, l = i % 32;
        const int t = blockIdx.y * 32 + l;
        if (t < T) {
            const float v = ((red[0][j][l] + red[1][j][l]) + red[2][j][l]) + red[3][j][l];
            part[((long)t * (NMIX + 1) + j) * gridDim.x + s] = v;  // [T][NMIX+1][S]: S contiguous
        }
    }
}

// ---- staged split-K mixes: stage the tile in shared memory with cp.async, then compute from shared -------------
// The broadcast-load mix (mhc_mix_partial above, kept for the head's 4 mixes) reads F with warp-uniform 16-B loads: 32 B in flight per warp-load and,
// with 118 registers, only a few loads in flight per warp, so the 4 x 24 F loads per thread run as ~12
// serialized memory round trips (Nsight Compute, T = 1, D = 4096: 10.6 us, 0.09 eligible warps/scheduler,
// L1TEX scoreboard stalls). Here a CTA issues its whole tile at once as 16-B cp.async copies (no registers
// held: F slice 24 x 128 fp32 = 12 KB, X slice <= 32 tokens x 128 BF16 = 8 KB): one round trip.
// Compute: item (token t, lane q of 16) covers columns {4q..4q+3} and {64+4q..64+4q+3} of the 128 (float4
// reads of F at consecutive 16 B per lane: no bank conflicts), 25 fp32 dots of 8 terms (fma chain), then an
// xor tree over the 16 lanes of the half warp that holds token t. The partials layout [T][NMIX+1][S] and the
// finish's reduction are those of mhc_mix_partial; only the order inside one split's 128-column partial differs.
constexpr int MIX_TT = 32;  // tokens per mix tile

struct MixSmem {
    float f[24 * MIX_COLS];                        // F[j][c0 .. c0 + 128)
    __nv_bfloat16 x[MIX_TT * MIX_COLS];            // X[t0 + t][c0 .. c0 + 128)
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Programmatic dependent launch (common/pdl.cuh states the rules). Only loads of constant weights (never written by
// any kernel: F, hc_scale, hc_base) are issued before the wait; every output store comes after it. PDL-launched:
// mhc_mix_partial24_pdl and mhc_pre_finish_pdl_* (the trigger and the F copies precede their wait, which is what
// they are for), and mhc_post_mix_partial24_pdl (trigger, then wait). mhc_post and mhc_head_finish_bf16 are
// launched plainly and trigger first, so the next layer's PDL mix, or the LM head's GEMV, stages its weights while
// they run. Every other entry point is launched plainly.

// One mix tile: split s (columns [128 s, 128 s + 128) of 4D), tokens [32 tile, 32 tile + 32) & < T.
// All threads of the CTA call it; blockDim % 32 == 0. Ends with the CTA's shared memory free to reuse
// only after a __syncthreads (the caller's).
// PDL (only mhc_mix_partial24_pdl): the F copies (weights) are issued before pdl_wait, X's and the
// partial stores after it, so the F round trip overlaps the previous kernel's tail. PDL = false: unchanged.
// hc_post of one element of stream k: post_k y + sum_j C[j][k] X[j] in fp32, each product and sum rounded (no FMA),
// j in order. The one formula of mhc_post and of the linked boundary's fused mix (post_mix_tile_smem).
__device__ __forceinline__ float post_element(float pk, const float (&ck)[4], float y, float x0, float x1, float x2,
                                              float x3) {
    float a = __fmul_rn(pk, y);
    a = __fadd_rn(a, __fmul_rn(ck[0], x0));
    a = __fadd_rn(a, __fmul_rn(ck[1], x1));
    a = __fadd_rn(a, __fmul_rn(ck[2], x2));
    return __fadd_rn(a, __fmul_rn(ck[3], x3));
}

// The dots of one mix tile (split s, tokens [t0, t0 + nt)) from F staged in sm.f: item i = 16 t + q (a warp holds
// tokens 2k, 2k + 1) gets the 8 values of columns {4q..4q+3} and {64+4q..64+4q+3} of its token from x_of(t, q, xv)
// and forms 25 fp32 dots of 8 terms (an fma chain), then an xor tree over the 16 lanes of the half warp that holds
// token t. One body for the plain tile and the tile with hc_post fused: the same partials from the same X values.
// The loop count is uniform across the CTA and a warp is skipped only as a whole (its first item past the tokens),
// so the shuffles stay convergent.
template <int NMIX, typename XOf>
__device__ __forceinline__ void mix_tile_dots(const MixSmem& sm, float* __restrict__ part, int S, int s, int t0,
                                              int nt, XOf x_of) {
    const int tid = threadIdx.x, bd = blockDim.x;
    const int lane = tid & 31;
    for (int base = 0; base < MIX_TT * 16; base += bd) {
        const int i = base + tid;
        if (i - lane >= nt * 16 || i - lane >= MIX_TT * 16) continue;  // warp-uniform
        const int t = i >> 4, q = i & 15;
        const bool valid = t < nt;
        float xv[8];
        if (valid) {
            x_of(t, q, xv);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) xv[e] = 0.f;
        }
        float acc[NMIX + 1];
        acc[NMIX] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[NMIX] = fmaf(xv[e], xv[e], acc[NMIX]);
#pragma unroll
        for (int j = 0; j < NMIX; ++j) {
            const float4 fa = *reinterpret_cast<const float4*>(&sm.f[j * MIX_COLS + 4 * q]);
            const float4 fb = *reinterpret_cast<const float4*>(&sm.f[j * MIX_COLS + 64 + 4 * q]);
            float a = fa.x * xv[0];
            a = fmaf(fa.y, xv[1], a); a = fmaf(fa.z, xv[2], a); a = fmaf(fa.w, xv[3], a);
            a = fmaf(fb.x, xv[4], a); a = fmaf(fb.y, xv[5], a); a = fmaf(fb.z, xv[6], a); a = fmaf(fb.w, xv[7], a);
            acc[j] = a;
        }
#pragma unroll
        for (int j = 0; j <= NMIX; ++j) {
#pragma unroll
            for (int o = 1; o < 16; o <<= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
        }
        if (valid && q == 0) {
            float* dst = part + (long)(t0 + t) * (NMIX + 1) * S + s;
#pragma unroll
            for (int j = 0; j <= NMIX; ++j) dst[(long)j * S] = acc[j];
        }
    }
}

// Issues the cp.async copies of the tile's F slice (NMIX x 128 fp32 of split s) into sm.f.
template <int NMIX>
__device__ __forceinline__ void stage_f(const float* __restrict__ F, int D4, int c0, MixSmem& sm) {
    for (int i = threadIdx.x; i < NMIX * (MIX_COLS / 4); i += blockDim.x) {
        const int j = i / (MIX_COLS / 4), qq = i % (MIX_COLS / 4);
        cp_async16(&sm.f[j * MIX_COLS + qq * 4], F + (long)j * D4 + c0 + qq * 4);
    }
}

template <int NMIX, bool PDL = false>
__device__ void mix_tile_smem(const __nv_bfloat16* __restrict__ X, const float* __restrict__ F,
                              float* __restrict__ part, int T, int D4, int S, int s, int tile, MixSmem& sm) {
    const int tid = threadIdx.x, bd = blockDim.x;
    const int c0 = s * MIX_COLS, t0 = tile * MIX_TT;
    const int nt = min(MIX_TT, T - t0);
    stage_f<NMIX>(F, D4, c0, sm);
    if (PDL) pdl_wait();  // X may be the previous kernel's output; part may still be read by it
    for (int i = tid; i < nt * (MIX_COLS / 8); i += bd) {
        const int t = i / (MIX_COLS / 8), qq = i % (MIX_COLS / 8);
        cp_async16(&sm.x[t * MIX_COLS + qq * 8], X + (long)(t0 + t) * D4 + c0 + qq * 8);
    }
    cp_async_wait_all();
    __syncthreads();
    mix_tile_dots<NMIX>(sm, part, S, s, t0, nt, [&](int t, int q, float* xv) {
        const uint2 a = *reinterpret_cast<const uint2*>(&sm.x[t * MIX_COLS + 4 * q]);
        const uint2 b = *reinterpret_cast<const uint2*>(&sm.x[t * MIX_COLS + 64 + 4 * q]);
        xv[0] = bf16_lo(a.x); xv[1] = bf16_hi(a.x); xv[2] = bf16_lo(a.y); xv[3] = bf16_hi(a.y);
        xv[4] = bf16_lo(b.x); xv[5] = bf16_hi(b.x); xv[6] = bf16_lo(b.y); xv[7] = bf16_hi(b.y);
    });
}

// hc_post of the previous sub-layer fused into the next boundary's staged mixes: the tile's item (t, q) computes
// X'[t][k][c] = post_k y[c] + sum_j C[j][k] X[j][c] for its 8 columns c of stream k = c0 / D (MIX_COLS divides D:
// a split lies in one stream) with mhc_post's operations in mhc_post's order (fp32 rn, no FMA), stores X' as BF16
// and feeds the stored values to mix_tile_dots: X' is mhc_post's bit for bit, and the partials are
// mix_tile_smem's of X' bit for bit. Every X' element has one owner, so X' is written exactly once; the finish
// kernel then reads X' as the boundary's X. y, X, post and comb are read straight from global memory (5 x 8 KB for
// a 32-token tile would not fit beside F in static shared memory; at decode sizes a CTA has 16-32 active items).
// PDL: F is staged before the wait (weights), everything else after it.
template <int NMIX, bool PDL>
__device__ void post_mix_tile_smem(const __nv_bfloat16* __restrict__ y, const __nv_bfloat16* __restrict__ X,
                                   const float* __restrict__ post, const float* __restrict__ comb,
                                   __nv_bfloat16* __restrict__ Xout, const float* __restrict__ F,
                                   float* __restrict__ part, int T, int D, int S, int s, int tile, MixSmem& sm) {
    const int D4 = 4 * D;
    const int c0 = s * MIX_COLS, t0 = tile * MIX_TT;
    const int nt = min(MIX_TT, T - t0);
    const int k = c0 / D, cd = c0 - k * D;
    stage_f<NMIX>(F, D4, c0, sm);
    if (PDL) pdl_wait();  // y, X, post, comb are earlier kernels' outputs; part may still be read by one
    cp_async_wait_all();
    __syncthreads();
    mix_tile_dots<NMIX>(sm, part, S, s, t0, nt, [&](int t, int q, float* xv) {
        const int tok = t0 + t;
        const float pk = post[tok * 4 + k];
        float ck[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) ck[j] = comb[tok * 16 + 4 * j + k];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int col = h * 64 + 4 * q;
            const uint2 yu = *reinterpret_cast<const uint2*>(y + (long)tok * D + cd + col);
            const float yv[4] = {bf16_lo(yu.x), bf16_hi(yu.x), bf16_lo(yu.y), bf16_hi(yu.y)};
            float xs[4][4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const uint2 xu = *reinterpret_cast<const uint2*>(X + ((long)tok * 4 + j) * D + cd + col);
                xs[j][0] = bf16_lo(xu.x); xs[j][1] = bf16_hi(xu.x); xs[j][2] = bf16_lo(xu.y); xs[j][3] = bf16_hi(xu.y);
            }
            float o[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) o[e] = post_element(pk, ck, yv[e], xs[0][e], xs[1][e], xs[2][e], xs[3][e]);
            uint2 r;
            r.x = pack_bf16x2(o[0], o[1]);
            r.y = pack_bf16x2(o[2], o[3]);
            *reinterpret_cast<uint2*>(Xout + (long)tok * D4 + c0 + col) = r;
            xv[4 * h + 0] = bf16_lo(r.x); xv[4 * h + 1] = bf16_hi(r.x);
            xv[4 * h + 2] = bf16_lo(r.y); xv[4 * h + 3] = bf16_hi(r.y);
        }
    });
}

__device__ __forceinline__ float sigmoid_f(float z) { return __fdiv_rn(1.f, __fadd_rn(1.f, expf(-z))); }

__device__ __forceinline__ float mix_logit(float rho, float dot, float s, float b) {
    return __fadd_rn(__fmul_rn(__fmul_rn(rho, dot), s), b);
}

// Reduce the split-K partials of `token` into mix[0..NMIX] (mix[NMIX] = sum of squares) in a fixed order:
// warp w takes the 32-wide blocks of splits w, w + nw, ...; in each block lane l loads split 32b + l (0 past
// S) for all NMIX+1 mixes at once (all loads in flight: this is the decode critical path), an xor tree sums
// the 32 lanes, blocks add up in order; then the warps' sums add up in warp order.
// tests/mhc.rs (reduce_like_gpu) replays exactly this order on the CPU.
template <int NMIX>
__device__ void reduce_partials(const float* __restrict__ part, int S, int token, float* mix, float* wsum) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const float* base = part + (long)token * (NMIX + 1) * S;
    float acc[NMIX + 1];
#pragma unroll
    for (int j = 0; j <= NMIX; ++j) acc[j] = 0.f;
    for (int sb = warp; sb * 32 < S; sb += nw) {
        const int s = sb * 32 + lane;
        float v[NMIX + 1];
#pragma unroll
        for (int j = 0; j <= NMIX; ++j) v[j] = s < S ? __ldcg(base + (long)j * S + s) : 0.f;
#pragma unroll
        for (int j = 0; j <= NMIX; ++j) acc[j] += warp_sum(v[j]);
    }
    if (lane == 0) {
#pragma unroll
        for (int j = 0; j <= NMIX; ++j) wsum[warp * (NMIX + 1) + j] = acc[j];
    }
    __syncthreads();
    if (threadIdx.x <= NMIX) {
        float total = 0.f;
        for (int w = 0; w < nw; ++w) total += wsum[w * (NMIX + 1) + threadIdx.x];
        mix[threadIdx.x] = total;
    }
    __syncthreads();
}

// 4x4 Sinkhorn of DSV4 in one thread (no shuffles: the decode critical path is 40 dependent normalizations).
// z: logits row-major [j][k]. Order as the CPU reference (reference::sinkhorn): row softmax (e * (1/sum)) + eps,
// column normalization, 19 x (rows, columns); every normalization multiplies by the correctly rounded
// reciprocal 1/(pairwise sum + eps): one rounding more than a division, the same in the reference.
__device__ void sinkhorn_thread(const float (&z)[16], float (&c)[16]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float mx = fmaxf(fmaxf(z[4 * j], z[4 * j + 1]), fmaxf(z[4 * j + 2], z[4 * j + 3]));
        float e[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) e[k] = expf(__fsub_rn(z[4 * j + k], mx));
        const float r = __frcp_rn(__fadd_rn(__fadd_rn(e[0], e[1]), __fadd_rn(e[2], e[3])));
#pragma unroll
        for (int k = 0; k < 4; ++k) c[4 * j + k] = __fadd_rn(__fmul_rn(e[k], r), 1e-6f);
    }
    auto cols = [&]() {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float r = __frcp_rn(
                __fadd_rn(__fadd_rn(__fadd_rn(c[k], c[4 + k]), __fadd_rn(c[8 + k], c[12 + k])), 1e-6f));
#pragma unroll
            for (int j = 0; j < 4; ++j) c[4 * j + k] = __fmul_rn(c[4 * j + k], r);
        }
    };
    auto rows = [&]() {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float r = __frcp_rn(__fadd_rn(
                __fadd_rn(__fadd_rn(c[4 * j], c[4 * j + 1]), __fadd_rn(c[4 * j + 2], c[4 * j + 3])), 1e-6f));
#pragma unroll
            for (int k = 0; k < 4; ++k) c[4 * j + k] = __fmul_rn(c[4 * j + k], r);
        }
    };
    cols();
    for (int it = 1; it < 20; ++it) {
        rows();
        cols();
    }
}

// The same 4x4 Sinkhorn on 16 lanes, one element each (lane l holds C[l / 4][l % 4]; lanes 16..31 repeat
// lanes 0..15 so the whole warp can take part in the shuffles). Bit-identical to sinkhorn_thread: a row sum
// is (c + xor1(c)) + (xor2(c) + xor3(c)), i.e. in lane k of row j: k = 0: (c0 + c1) + (c2 + c3); k = 1:
// (c1 + c0) + (c3 + c2); k = 2: (c2 + c3) + (c0 + c1); k = 3: (c3 + c2) + (c1 + c0) -- the same bits as
// the reference's (c0 + c1) + (c2 + c3), IEEE addition being commutative. Columns use xor 4, 8, 12 the same
// way. The three shuffles of a step are independent (one shuffle latency on the chain, not two). Row maxima
// are exact in any order. Each lane then does the serial code's rounded ops (rcp_rn, mul_rn, add_rn).
// Why: the serial version is a 40-step dependent chain issuing ~2500 instructions from one thread (~8 us at
// ~6 cycles each, Nsight Compute on the H200); here a step is 3 parallel shuffles, 3 adds, rcp and mul.
// Must be called by all 32 lanes of a warp (convergent); returns this lane's element.
__device__ __forceinline__ float quad_sum(float c, int m) {  // m = 1 (rows) or 4 (columns)
    const float a = __shfl_xor_sync(0xffffffffu, c, m);
    const float b = __shfl_xor_sync(0xffffffffu, c, 2 * m);
    const float d = __shfl_xor_sync(0xffffffffu, c, 3 * m);
    return __fadd_rn(__fadd_rn(c, a), __fadd_rn(b, d));
}

__device__ float sinkhorn_lanes(float z) {
    const float mx = fmaxf(fmaxf(z, __shfl_xor_sync(0xffffffffu, z, 1)),
                           fmaxf(__shfl_xor_sync(0xffffffffu, z, 2), __shfl_xor_sync(0xffffffffu, z, 3)));
    const float e = expf(__fsub_rn(z, mx));
    float c = __fadd_rn(__fmul_rn(e, __frcp_rn(quad_sum(e, 1))), 1e-6f);
    c = __fmul_rn(c, __frcp_rn(__fadd_rn(quad_sum(c, 4), 1e-6f)));  // columns
    for (int it = 1; it < 20; ++it) {
        c = __fmul_rn(c, __frcp_rn(__fadd_rn(quad_sum(c, 1), 1e-6f)));  // rows
        c = __fmul_rn(c, __frcp_rn(__fadd_rn(quad_sum(c, 4), 1e-6f)));  // columns
    }
    return c;
}

// u chunk = ((p0 x0 + p1 x1) + p2 x2) + p3 x3, BF16-rounded; written to u and kept in v.
__device__ __forceinline__ void apply_pre_chunk(const __nv_bfloat16* __restrict__ Xt, int D, int c,
                                                const float* pre, float v[8]) {
    float xs[4][8];
#pragma unroll
    for (int i = 0; i < 4; ++i) load8(Xt + (long)i * D + c * 8, xs[i]);
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        acc[e] = __fmul_rn(pre[0], xs[0][e]);
#pragma unroll
        for (int i = 1; i < 4; ++i) acc[e] = __fadd_rn(acc[e], __fmul_rn(pre[i], xs[i][e]));
    }
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
        const uint32_t pk = pack_bf16x2(acc[e], acc[e + 1]);
        v[e] = bf16_lo(pk);
        v[e + 1] = bf16_hi(pk);
    }
}

// Quantized copies of the BF16 RMSNorm(u) (rows of the whole launch; null when not written): FP8 codes [T, D] and
// ue8m0 scales [T, D/128]; NVFP4 codes [T, D/2], e4m3 scales [T, D/16], global scales [T].
struct QuantCopies {
    uint8_t* q8 = nullptr;
    uint8_t* s8 = nullptr;
    uint8_t* q4 = nullptr;
    uint8_t* s4 = nullptr;
    float* g4 = nullptr;
};

// Grid (T, HEAD ? 1 : 2). blockIdx.y == 1: the coefficient CTA (post + Sinkhorn -> comb), which runs
// concurrently with blockIdx.y == 0: pre, u = sum pre_i X_i, RMSNorm(u) + quant (u does not need C).
// HEAD: NMIX = 4, no post / Sinkhorn (hc_head).
// One token's finish on the calling CTA: coef_task -> post + Sinkhorn (comb); else pre, u, RMSNorm + quant.
// LANES: the Sinkhorn on 16 lanes (sinkhorn_lanes), else on one thread (sinkhorn_thread, the op-by-op chain's
// form; every finish entry point passes true).
// All threads of the CTA must call this with the same (t, coef_task); it ends without a trailing barrier.
// PDL (only the mhc_pre_finish_pdl_* entry points): let the next PDL kernel be scheduled, then wait for the
// mix kernel (pdl_wait) before the first read of the partials. PDL = false: unchanged.
// COPY_FP8 / COPY_NVFP4 (KIND_BF16 only): also write the FP8 1x128 / NVFP4 (per-row global scale) form of the BF16
// RMSNorm(u) into `copies`, with the codec of common/norm_row.cuh (quant_row_fp8 / quant_row_nvfp4) applied to the
// BF16 values just stored: the bits of norm_quant's quantize_bf16_rows of that BF16 output.
template <int KIND, bool HEAD, bool LANES, bool PDL = false, bool COPY_FP8 = false, bool COPY_NVFP4 = false>
__device__ void mhc_pre_finish(const __nv_bfloat16* __restrict__ X, const float* __restrict__ part, int S, int T,
                               int D, const float* __restrict__ hc_scale, const float* __restrict__ hc_base,
                               const __nv_bfloat16* __restrict__ w, float eps, float* pre_out, float* post_out,
                               float* comb_out, __nv_bfloat16* u_out, uint8_t* q, uint8_t* scales, float* gsa,
                               __nv_bfloat16* bf, float* rstd, int t, bool coef_task,
                               const QuantCopies& copies = QuantCopies{}) {
    static_assert(KIND == KIND_BF16 || !(COPY_FP8 || COPY_NVFP4), "quantized copies are of the BF16 output");
    constexpr int NMIX = HEAD ? 4 : 24;
    __shared__ float red[MAX_WARPS];
    __shared__ float wsum[MAX_WARPS * (NMIX + 1)];
    __shared__ float mix[NMIX + 1];
    __shared__ float pre_s[4];
    if (PDL) {
        pdl_trigger();
        pdl_wait();
    }
    reduce_partials<NMIX>(part, S, t, mix, wsum);
    const float rho = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(mix[NMIX], (float)(4 * D)), eps)));
    if (!HEAD && coef_task) {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int post_warp = blockDim.x > 32 ? 1 : 0;  // with one warp, post follows the Sinkhorn
        if (LANES) {
            if (warp == 0) {
                const int i = lane & 15;
                const float c = sinkhorn_lanes(mix_logit(rho, mix[8 + i], hc_scale[2], hc_base[8 + i]));
                if (lane < 16) comb_out[t * 16 + i] = c;
            }
        } else if (threadIdx.x == 0) {
            float z[16], c[16];
#pragma unroll
            for (int i = 0; i < 16; ++i) z[i] = mix_logit(rho, mix[8 + i], hc_scale[2], hc_base[8 + i]);
            sinkhorn_thread(z, c);
#pragma unroll
            for (int i = 0; i < 16; ++i) comb_out[t * 16 + i] = c[i];
        }
        if (warp == post_warp && lane >= 16 && lane < 20) {
            const int i = lane - 16;
            const float z = mix_logit(rho, mix[4 + i], hc_scale[1], hc_base[4 + i]);
            post_out[t * 4 + i] = __fmul_rn(2.f, sigmoid_f(z));
        }
        return;
    }
    if (threadIdx.x < 4) {
        const int i = threadIdx.x;
        const float p = __fadd_rn(sigmoid_f(mix_logit(rho, mix[i], hc_scale[0], hc_base[i])), 1e-6f);
        pre_s[i] = p;
        pre_out[t * 4 + i] = p;
    }
    __syncthreads();
    float pre[4] = {pre_s[0], pre_s[1], pre_s[2], pre_s[3]};
    const int nchunks = D / 8;
    const __nv_bfloat16* Xt = X + (long)t * 4 * D;
    float v[CH][8];
#pragma unroll
    for (int k = 0; k < CH; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        if (c < nchunks) {
            apply_pre_chunk(Xt, D, c, pre, v[k]);
            store8_bf16(u_out + (long)t * D + c * 8, v[k]);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) v[k][e] = 0.f;
        }
    }
    RowOut o;
    o.q = KIND == KIND_NVFP4 ? q + (long)t * (D / 2) : q + (long)t * D;
    o.scales = KIND == KIND_NVFP4 ? scales + (long)t * (D / 16) : scales + (long)t * (D / 128);
    o.gsa = gsa + t;
    o.bf = bf + (long)t * D;
    o.rstd = rstd + t;
    norm_quant_row<KIND, true, LANES>(v, nchunks, D, w, eps, o, red);  // LANES = true: the early weight load
    // v now holds the BF16 values of RMSNorm(u) (zeros past nchunks); block_sum's trailing barrier freed `red`.
    if (COPY_FP8) quant_row_fp8(v, nchunks, copies.q8 + (long)t * D, copies.s8 + (long)t * (D / 128));
    if (COPY_NVFP4)
        quant_row_nvfp4(v, nchunks, copies.q4 + (long)t * (D / 2), copies.s4 + (long)t * (D / 16), copies.g4 + t, red);
}

}  // namespace

// mHC split-K mixes: grid (S = 4D/128, ceil(T/32)), block 128. X [T, 4, D] BF16, F [NMIX, 4D] f32,
// part [T, NMIX+1, S] f32.
extern "C" __global__ void __launch_bounds__(128) mhc_mix_partial4(const __nv_bfloat16* X, const float* F,
                                                                  float* part, int T, int D4) {
    mhc_mix_partial<4>(X, F, part, T, D4);
}

// Staged split-K mixes (cp.async staging): grid (S = 4D/128, ceil(T/32)), any block multiple of 32 (128 used).
extern "C" __global__ void __launch_bounds__(128) mhc_mix_partial24_staged(const __nv_bfloat16* X, const float* F,
                                                                      float* part, int T, int D4) {
    __shared__ MixSmem sm;
    mix_tile_smem<24>(X, F, part, T, D4, gridDim.x, blockIdx.x, blockIdx.y, sm);
}

// Fused hc_post + the next boundary's staged mixes (post_mix_tile_smem): grid (S = 4D/128, ceil(T/32)), block 128.
// y [T, D], X [T, 4, D], post [T, 4], comb [T, 16] of the previous boundary; writes Xout [T, 4, D] (mhc_post's, bit
// for bit) and part (mhc_mix_partial24_staged's of Xout, bit for bit) for mhc_pre_finish_* (given Xout as its X).
extern "C" __global__ void __launch_bounds__(128) mhc_post_mix_partial24(const __nv_bfloat16* y, const __nv_bfloat16* X,
                                                                        const float* post, const float* comb,
                                                                        __nv_bfloat16* Xout, const float* F,
                                                                        float* part, int T, int D) {
    __shared__ MixSmem sm;
    post_mix_tile_smem<24, false>(y, X, post, comb, Xout, F, part, T, D, gridDim.x, blockIdx.x, blockIdx.y, sm);
}

// mHC finish: grid (T, 2), block as RMSNorm. hc_scale [3], hc_base [24], w [D]; outputs pre/post [T,4],
// comb [T,16] (row-major [j][k]), u [T,D] BF16, rstd [T] (RMSNorm of u), and the quantized RMSNorm(u).
#define MHC_PRE_COMMON                                                                                            \
    const __nv_bfloat16 *X, const float *part, int S, int T, int D, const float *hc_scale, const float *hc_base, \
        const __nv_bfloat16 *w, float eps, float *pre, float *post, float *comb, __nv_bfloat16 *u
// (the Sinkhorn on 16 lanes)
extern "C" __global__ void mhc_pre_finish_nvfp4(MHC_PRE_COMMON, uint8_t* q, uint8_t* scales, float* gsa,
                                                 float* rstd) {
    mhc_pre_finish<KIND_NVFP4, false, true>(X, part, S, T, D, hc_scale, hc_base, w, eps, pre, post, comb, u, q,
                                            scales, gsa, nullptr, rstd, blockIdx.x, blockIdx.y == 1);
}
extern "C" __global__ void mhc_pre_finish_fp8(MHC_PRE_COMMON, uint8_t* q, uint8_t* scales, float* rstd) {
    mhc_pre_finish<KIND_FP8, false, true>(X, part, S, T, D, hc_scale, hc_base, w, eps, pre, post, comb, u, q,
                                          scales, nullptr, nullptr, rstd, blockIdx.x, blockIdx.y == 1);
}
extern "C" __global__ void mhc_pre_finish_bf16(MHC_PRE_COMMON, __nv_bfloat16* y, float* rstd) {
    mhc_pre_finish<KIND_BF16, false, true>(X, part, S, T, D, hc_scale, hc_base, w, eps, pre, post, comb, u,
                                           nullptr, nullptr, nullptr, y, rstd, blockIdx.x, blockIdx.y == 1);
}

// ---- the same two kernels, launched as a programmatic dependent pair (the decode path) --------------------------
// Same arithmetic, same partials layout and reduction order as mhc_mix_partial24_staged + mhc_pre_finish_*: every
// output is bit-identical (tests/mhc.rs checks it). Only the launch overlap differs: the finish grid
// is scheduled as soon as every mix CTA has started (launch_dependents first thing), so its launch latency
// hides behind the mix; and, in a graph of consecutive boundaries, the next mix CTAs stage their F tile
// (12 KB of weights, the mix's one HBM round trip) while the previous finish still runs.
// Budget, T = 1 in a graph: the ~1-1.5 us launch gap between the two nodes and the F round trip (~1 us, after the
// first boundary of a graph) leave the critical chain.
extern "C" __global__ void __launch_bounds__(128) mhc_mix_partial24_pdl(const __nv_bfloat16* X, const float* F,
                                                                       float* part, int T, int D4) {
    __shared__ MixSmem sm;
    pdl_trigger();
    mix_tile_smem<24, true>(X, F, part, T, D4, gridDim.x, blockIdx.x, blockIdx.y, sm);
}
// The fused hc_post + mixes as the PDL pair's first kernel (the engine's decode boundaries: the sub-layer that just
// ran leaves its hc_post to the next sub-layer's hc_pre): trigger first, F staged before the wait.
extern "C" __global__ void __launch_bounds__(128)
    mhc_post_mix_partial24_pdl(const __nv_bfloat16* y, const __nv_bfloat16* X, const float* post, const float* comb,
                               __nv_bfloat16* Xout, const float* F, float* part, int T, int D) {
    __shared__ MixSmem sm;
    pdl_trigger();
    post_mix_tile_smem<24, true>(y, X, post, comb, Xout, F, part, T, D, gridDim.x, blockIdx.x, blockIdx.y, sm);
}
extern "C" __global__ void mhc_pre_finish_pdl_nvfp4(MHC_PRE_COMMON, uint8_t* q, uint8_t* scales, float* gsa,
                                                    float* rstd) {
    mhc_pre_finish<KIND_NVFP4, false, true, true>(X, part, S, T, D, hc_scale, hc_base, w, eps, pre, post, comb, u,
                                                  q, scales, gsa, nullptr, rstd, blockIdx.x, blockIdx.y == 1);
}
extern "C" __global__ void mhc_pre_finish_pdl_fp8(MHC_PRE_COMMON, uint8_t* q, uint8_t* scales, float* rstd) {
    mhc_pre_finish<KIND_FP8, false, true, true>(X, part, S, T, D, hc_scale, hc_base, w, eps, pre, post, comb, u,
                                                q, scales, nullptr, nullptr, rstd, blockIdx.x, blockIdx.y == 1);
}
extern "C" __global__ void mhc_pre_finish_pdl_bf16(MHC_PRE_COMMON, __nv_bfloat16* y, float* rstd) {
    mhc_pre_finish<KIND_BF16, false, true, true>(X, part, S, T, D, hc_scale, hc_base, w, eps, pre, post, comb, u,
                                                 nullptr, nullptr, nullptr, y, rstd, blockIdx.x, blockIdx.y == 1);
}

// ---- BF16 output plus its quantized copies (the engine's boundaries: the attention half's FP8 `a`, the FFN half's
// FP8 + NVFP4 `f`) -------------------------------------------------------------------------------------------------
// As mhc_pre_finish_bf16 / mhc_pre_finish_pdl_bf16 (same grid, same BF16 bits), plus: _q8 the FP8 1x128 copy, _q4 the
// NVFP4 copy (per-row global scale), _q8q4 both, each equal bit for bit to norm_quant's quantize_bf16_rows of the
// BF16 output. Every copy pointer is passed (null where not written). The _pdl_ ones follow mhc_pre_finish_pdl_*'s
// protocol (listed in src/gpu/launch.rs PDL_OWN_PROTOCOL).
#define MHC_COPIES_PARAMS uint8_t *q8, uint8_t *s8, uint8_t *q4, uint8_t *s4, float *g4
__device__ __forceinline__ QuantCopies copies_of(uint8_t* q8, uint8_t* s8, uint8_t* q4, uint8_t* s4, float* g4) {
    QuantCopies c;
    c.q8 = q8; c.s8 = s8; c.q4 = q4; c.s4 = s4; c.g4 = g4;
    return c;
}
extern "C" __global__ void mhc_pre_finish_bf16_q8(MHC_PRE_COMMON, __nv_bfloat16* y, float* rstd, MHC_COPIES_PARAMS) {
    mhc_pre_finish<KIND_BF16, false, true, false, true, false>(X, part, S, T, D, hc_scale, hc_base, w, eps, pre, post, comb,
                                                          u, nullptr, nullptr, nullptr, y, rstd, blockIdx.x,
                                                          blockIdx.y == 1, copies_of(q8, s8, q4, s4, g4));
}
extern "C" __global__ void mhc_pre_finish_bf16_q4(MHC_PRE_COMMON, __nv_bfloat16* y, float* rstd, MHC_COPIES_PARAMS) {
    mhc_pre_finish<KIND_BF16, false, true, false, false, true>(X, part, S, T, D, hc_scale, hc_base, w, eps, pre, post, comb,
                                                          u, nullptr, nullptr, nullptr, y, rstd, blockIdx.x,
                                                          blockIdx.y == 1, copies_of(q8, s8, q4, s4, g4));
}
extern "C" __global__ void mhc_pre_finish_bf16_q8q4(MHC_PRE_COMMON, __nv_bfloat16* y, float* rstd, MHC_COPIES_PARAMS) {
    mhc_pre_finish<KIND_BF16, false, true, false, true, true>(X, part, S, T, D, hc_scale, hc_base, w, eps, pre, post, comb,
                                                          u, nullptr, nullptr, nullptr, y, rstd, blockIdx.x,
                                                          blockIdx.y == 1, copies_of(q8, s8, q4, s4, g4));
}
extern "C" __global__ void mhc_pre_finish_pdl_bf16_q8(MHC_PRE_COMMON, __nv_bfloat16* y, float* rstd, MHC_COPIES_PARAMS) {
    mhc_pre_finish<KIND_BF16, false, true, true, true, false>(X, part, S, T, D, hc_scale, hc_base, w, eps, pre, post, comb,
                                                          u, nullptr, nullptr, nullptr, y, rstd, blockIdx.x,
                                                          blockIdx.y == 1, copies_of(q8, s8, q4, s4, g4));
}
extern "C" __global__ void mhc_pre_finish_pdl_bf16_q4(MHC_PRE_COMMON, __nv_bfloat16* y, float* rstd, MHC_COPIES_PARAMS) {
    mhc_pre_finish<KIND_BF16, false, true, true, false, true>(X, part, S, T, D, hc_scale, hc_base, w, eps, pre, post, comb,
                                                          u, nullptr, nullptr, nullptr, y, rstd, blockIdx.x,
                                                          blockIdx.y == 1, copies_of(q8, s8, q4, s4, g4));
}
extern "C" __global__ void mhc_pre_finish_pdl_bf16_q8q4(MHC_PRE_COMMON, __nv_bfloat16* y, float* rstd, MHC_COPIES_PARAMS) {
    mhc_pre_finish<KIND_BF16, false, true, true, true, true>(X, part, S, T, D, hc_scale, hc_base, w, eps, pre, post, comb,
                                                          u, nullptr, nullptr, nullptr, y, rstd, blockIdx.x,
                                                          blockIdx.y == 1, copies_of(q8, s8, q4, s4, g4));
}
#undef MHC_COPIES_PARAMS

// hc_head: grid (T, 1); part from mhc_mix_partial4; hc_scale [1], hc_base [4]; outputs pre [T,4], u, y = RMSNorm(u) BF16.
extern "C" __global__ void mhc_head_finish_bf16(const __nv_bfloat16* X, const float* part, int S, int T, int D,
                                                const float* hc_scale, const float* hc_base,
                                                const __nv_bfloat16* w, float eps, float* pre, __nv_bfloat16* u,
                                                __nv_bfloat16* y, float* rstd) {
    pdl_trigger();  // the LM head's GEMV stages its weights meanwhile (common/pdl.cuh)
    mhc_pre_finish<KIND_BF16, true, true>(X, part, S, T, D, hc_scale, hc_base, w, eps, pre, nullptr, nullptr, u,
                                          nullptr, nullptr, nullptr, y, rstd, blockIdx.x, false);
}

// mHC post: grid (ceil(D/8/64), T), block 64. Xout[t][k] = post[t][k] y[t] + sum_j comb[t][j][k] X[t][j].
extern "C" __global__ void __launch_bounds__(64) mhc_post(const __nv_bfloat16* y, const __nv_bfloat16* X,
                                                         const float* post, const float* comb,
                                                         __nv_bfloat16* Xout, int D) {
    pdl_trigger();  // the next PDL mix stages its F tile meanwhile (common/pdl.cuh)
    const int t = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= D / 8) return;
    float yv[8], xs[4][8];
    load8(y + (long)t * D + c * 8, yv);
#pragma unroll
    for (int j = 0; j < 4; ++j) load8(X + ((long)t * 4 + j) * D + c * 8, xs[j]);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float pk = __ldg(post + t * 4 + k);
        float ck[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) ck[j] = __ldg(comb + t * 16 + 4 * j + k);
        float o[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) o[e] = post_element(pk, ck, yv[e], xs[0][e], xs[1][e], xs[2][e], xs[3][e]);
        store8_bf16(Xout + ((long)t * 4 + k) * D + c * 8, o);
    }
}

// ---- op-by-op mHC baseline (the chain the seeds describe): rms, GEMV, Sinkhorn, apply; then the RMSNorm and
// quant kernels above. One CTA per token for the reductions, no split-K.
extern "C" __global__ void __launch_bounds__(256) mhc_unfused_rms(const __nv_bfloat16* X, float* rho, int D4,
                                                                 float eps) {
    __shared__ float red[MAX_WARPS];
    const int t = blockIdx.x;
    float ss = 0.f;
    for (int c = threadIdx.x * 8; c < D4; c += blockDim.x * 8) {
        float v[8];
        load8(X + (long)t * D4 + c, v);
#pragma unroll
        for (int e = 0; e < 8; ++e) ss = fmaf(v[e], v[e], ss);
    }
    ss = block_sum(ss, red);
    if (threadIdx.x == 0) rho[t] = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)D4), eps)));
}

// dots [T, 24] = F . x (raw; rho applied by the Sinkhorn kernel).
extern "C" __global__ void __launch_bounds__(256) mhc_unfused_gemv(const __nv_bfloat16* X, const float* F,
                                                                  float* dots, int D4) {
    __shared__ float red[24][8];
    const int t = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float acc[24];
#pragma unroll
    for (int j = 0; j < 24; ++j) acc[j] = 0.f;
    for (int c = threadIdx.x * 4; c < D4; c += blockDim.x * 4) {
        const uint2 r = __ldg(reinterpret_cast<const uint2*>(X + (long)t * D4 + c));
        const float xv[4] = {bf16_lo(r.x), bf16_hi(r.x), bf16_lo(r.y), bf16_hi(r.y)};
#pragma unroll
        for (int j = 0; j < 24; ++j) {
            const float4 f = __ldg(reinterpret_cast<const float4*>(F + (long)j * D4 + c));
            acc[j] = fmaf(f.x, xv[0], fmaf(f.y, xv[1], fmaf(f.z, xv[2], fmaf(f.w, xv[3], acc[j]))));
        }
    }
#pragma unroll
    for (int j = 0; j < 24; ++j) {
        const float v = warp_sum(acc[j]);
        if (lane == 0) red[j][warp] = v;
    }
    __syncthreads();
    if (threadIdx.x < 24) {
        float s = 0.f;
        for (int w = 0; w < 8; ++w) s += red[threadIdx.x][w];
        dots[t * 24 + threadIdx.x] = s;
    }
}

// One warp per token: pre, post, comb from rho and dots.
extern "C" __global__ void mhc_unfused_sinkhorn(const float* rho, const float* dots, const float* hc_scale,
                                                const float* hc_base, float* pre, float* post, float* comb) {
    const int t = blockIdx.x, lane = threadIdx.x;
    const float r = rho[t];
    if (lane < 4) {
        pre[t * 4 + lane] = __fadd_rn(sigmoid_f(mix_logit(r, dots[t * 24 + lane], hc_scale[0], hc_base[lane])), 1e-6f);
        post[t * 4 + lane] =
            __fmul_rn(2.f, sigmoid_f(mix_logit(r, dots[t * 24 + 4 + lane], hc_scale[1], hc_base[4 + lane])));
    } else if (lane == 4) {
        float z[16], c[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) z[i] = mix_logit(r, dots[t * 24 + 8 + i], hc_scale[2], hc_base[8 + i]);
        sinkhorn_thread(z, c);
#pragma unroll
        for (int i = 0; i < 16; ++i) comb[t * 16 + i] = c[i];
    }
}

// u = sum_i pre_i X_i -> BF16. grid (ceil(D/8/64), T), block 64.
extern "C" __global__ void __launch_bounds__(64) mhc_unfused_apply(const __nv_bfloat16* X, const float* pre,
                                                                  __nv_bfloat16* u, int D) {
    const int t = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= D / 8) return;
    const float p[4] = {pre[t * 4], pre[t * 4 + 1], pre[t * 4 + 2], pre[t * 4 + 3]};
    float v[8];
    apply_pre_chunk(X + (long)t * 4 * D, D, c, p, v);
    store8_bf16(u + (long)t * D + c * 8, v);
}
