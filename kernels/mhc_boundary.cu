// mhc_boundary: A/B candidate (session 4) for the finish kernel of the fused DSV4 mHC boundary (hc_pre +
// RMSNorm + quant), next to the measured pair in kernels/norm_quant.cu. The split-K mix kernels stay those of
// norm_quant.cu (mhc_mix_partial24_pdl / _v2, same partials layout [T][25][S], S = 4D/128); only the finish
// changes: mhc_pre_finish_wide_{nvfp4,fp8,bf16}. Outputs are bit-identical to mhc_pre_finish{2,_pdl}_*.
//
// Why (Nsight Compute, session-4 start, T = 1, D = 4096, NVFP4): the current finish runs one token on two CTAs
// of D/32 threads; its pre-mix/RMSNorm/quant CTA issues ~2000 instructions per warp (4 chunks of 8 values per
// thread: apply 4 x ~80, norm ~250, quant 4 x ~150, plus three block reductions and the partials reduce with 25
// warp trees per warp) with ONE warp per scheduler, so nearly every instruction waits for its predecessor
// (6.3 cycles per issued instruction, IPC 0.54 on 2 SMs): ~12 K cycles, a serial latency chain.
//
// Design: the same grid (T, 2) (y = 0: pre, u, RMSNorm, quant; y = 1: post + Sinkhorn, concurrently), but a
// CTA of W = 4 x bd threads (bd = the current finish's block, roundup32(D/32); D = 4096: 512 threads, 7168: 896)
// and ONE 8-value chunk per thread (chunk c = threadIdx.x, the chunk numbering of the current kernel): the
// per-element work per warp drops 4x and 4-7 warps share each scheduler, so latency is hidden instead of
// serialized. Changes against the current finish, each keeping its bits:
//  1. Prefetch: the weight chunk (a constant) before griddepcontrol.wait, the 4 X chunks right after it, in
//     flight together with the partials loads (the current kernel loads X after pre is known: one more L2 round
//     trip on the chain).
//  2. Partials reduce: the (split-block b, mix j) warp trees are spread over all W/32 warps (<= 7 per warp
//     instead of 25); each tree is the same 32-lane xor butterfly over the same 32 splits as reduce_partials.
//     reduce_partials' warp w owns split-block w (its bd/32 warps = ceil(S/32) blocks for every D: bd/32 =
//     ceil(D/1024) = ceil(S/32)), and sums acc_w = 0 + tree_w, total = ((0 + acc_0) + acc_1) + ...; here
//     total = ((0 + tree_0) + tree_1) + ...: equal, because 0 + x == x for every x except -0 (-> +0), and
//     0 + (0 + x) == 0 + x. Each thread sums only the totals it needs (no barrier, no broadcast).
//  3. pre = sigmoid(...) is computed by every thread (the same IEEE ops in every thread: same bits), not by 4
//     threads + shared memory + a barrier.
//  4. RMSNorm sum of squares: the current kernel's thread tid sums fmaf(v, v, ss) over its chunks tid,
//     tid + bd, tid + 2 bd, tid + 3 bd (8 values each, in order), then warp xor trees, then the bd/32 warp sums
//     in warp order. Here every thread stores its BF16 u chunk in shared memory; the first bd threads (= the
//     current kernel's threads, same lanes and warps) replay exactly that fmaf chain from shared memory and the
//     same trees: same bits. The rest of the work (y, amax, codes) is per chunk, or an exact max, or a 16-lane
//     group of consecutive chunks (FP8 128-block), or lanes (2i, 2i+1) (NVFP4 16-block): all unchanged by the
//     4x wider CTA, because chunk c is still thread c and every group sits in one warp.
//  5. Sinkhorn (y = 1): the one-thread form of norm_quant.cu (sinkhorn_thread: the reference's op order; same
//     bits as the 16-lane sinkhorn_lanes the current finish runs), every lane of warp 0 holding the whole 4x4,
//     with the correctly rounded reciprocal written as its fast path (rcp_rn_fast below): no range-check
//     branch and slow-path call on each of the 40 normalizations, and no shuffle on the chain.
//
// Cycle budget at T = 1 (graph replay, H200 ~1.98 GHz, L2-resident operands ~600-800 cycles per round trip):
//   griddep wait + partials round trip (X, w in flight alongside)        ~800
//   partials trees (<= 7 per warp, 5 shuffle levels) + totals + rho/pre  ~400
//   apply (1 chunk) + u store + barrier + 32-step fmaf chain + 2 trees   ~450
//   rstd (div, sqrt, div) + y                                             ~200
//   NVFP4: block amax (tree + barrier) + scale + thresholds + codes      ~450  (FP8 ~250, no row amax)
//   total ~2300 cycles ~ 1.2 us for the finish, against ~12 K cycles (ncu, cold caches) / ~4 us (graph) now.
//   Sinkhorn CTA: ~800 + ~300 + gather/softmax ~200 + 40 normalizations x ~46 cycles (4 independent 3-deep add
//   chains 12, rcp fast path ~25, mul 4, ~40 instructions to issue) ~ 3100 cycles ~ 1.6 us: the Sinkhorn stays
//   the critical path of the finish (the current one: ~90 cycles per normalization on 16 lanes).
// Prediction (graph16, per boundary, T = 1): D = 4096 NVFP4 7.3 -> ~5.3 us, FP8 6.6 -> ~5.0 us (mix ~2.5-3 us +
// finish ~2 us + launch overlap); D = 7168 NVFP4 8.7 -> ~6.2 us. The 4 us target needs the mix cut too.
//
// Limits: W <= 1024 threads, so D <= 8192 (the launcher refuses larger D with a message); 64 registers per
// thread at most (__launch_bounds__(1024, 1)).
#include "common/mhc.cuh"

namespace {

using namespace mhc;

constexpr int NMIX = 24;
constexpr int MAX_SPLIT_BLOCKS = 8;  // ceil(S/32) = ceil(D/1024) <= 8 for D <= 8192
constexpr int MAX_THREADS = 1024;

// Correctly rounded 1/x (== __frcp_rn(x), bit for bit) for x with a biased exponent in [1, 252], i.e. normal
// and below 2^126. This is the fast path nvcc emits for __frcp_rn on sm_90 (SASS of mhc_pre_finish_pdl_*):
//   IADD3 t, x, 0x1800000; LOP3 t &= 0x7f800000; ISETP.GT.U32 P, t, 0x1ffffff;  @!P CALL slow path
//   MUFU.RCP r, x; FFMA e = x * r - 1; FADD.FTZ e' = -e - 0; FFMA r' = r * e' + r
// The range check is true exactly for biased exponents 1..252 (the slow path takes 0, 253, 254, 255). Here:
// rcp.approx.ftz.f32 is MUFU.RCP (x normal: ftz changes nothing), fma(x, r, -1) the first FFMA, and
// fma(r, -e, r) the second (the FTZ negation is exact: e = x r - 1 is 0 or at least 2^-48 in magnitude, never
// subnormal, since x r is an exact 48-bit product near 1). Every Sinkhorn denominator is a sum of non-negative
// entries plus 1e-6 (the softmax sums are >= 1), at most ~17: well inside the range for finite logits.
// Non-finite logits (non-finite inputs) may give other NaN/Inf bits than the current path.
__device__ __forceinline__ float rcp_rn_fast(float x) {
    float r, e, o;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    asm("fma.rn.f32 %0, %1, %2, 0fBF800000;" : "=f"(e) : "f"(x), "f"(r));
    asm("fma.rn.f32 %0, %1, %2, %1;" : "=f"(o) : "f"(r), "f"(-e));
    return o;
}

// 4x4 Sinkhorn of DSV4 held whole in each lane's registers: norm_quant.cu sinkhorn_thread (the reference's op
// order: row softmax e * (1/((e0 + e1) + (e2 + e3))) + eps, then columns, 19 x (rows, columns), each
// normalization a multiply by 1/(pairwise sum + eps)) with rcp_rn_fast for __frcp_rn. sinkhorn_thread and
// sinkhorn_lanes give the same bits (tests/norm_quant.rs lane_sinkhorn_mirror_equals_the_reference_bitwise
// and the GPU post+pre tests), so this matches the current finish bit for bit.
// Why not the 16-lane form any more: with the reciprocal branch-free, a half-step here is 4 independent
// 3-deep add chains, 4 reciprocals and 16 multiplies (~46 cycles, issue-bound at ~40 instructions), against
// 3 shuffles (~25 cycles of latency) + the same adds/reciprocal/multiply in series on 16 lanes (~70 cycles):
// ~0.4 us less on what is now the finish's critical path. (The removed v1 finish ran this form with the
// branchy __frcp_rn: the slow-path calls serialized the four chains, ~375 cycles per half-step.)
__device__ __forceinline__ void sinkhorn_regs(const float (&z)[16], float (&c)[16]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float mx = fmaxf(fmaxf(z[4 * j], z[4 * j + 1]), fmaxf(z[4 * j + 2], z[4 * j + 3]));
        float e[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) e[k] = expf(__fsub_rn(z[4 * j + k], mx));
        const float r = rcp_rn_fast(__fadd_rn(__fadd_rn(e[0], e[1]), __fadd_rn(e[2], e[3])));
#pragma unroll
        for (int k = 0; k < 4; ++k) c[4 * j + k] = __fadd_rn(__fmul_rn(e[k], r), 1e-6f);
    }
    auto cols = [&]() {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float r = rcp_rn_fast(
                __fadd_rn(__fadd_rn(__fadd_rn(c[k], c[4 + k]), __fadd_rn(c[8 + k], c[12 + k])), 1e-6f));
#pragma unroll
            for (int j = 0; j < 4; ++j) c[4 * j + k] = __fmul_rn(c[4 * j + k], r);
        }
    };
    auto rows = [&]() {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float r = rcp_rn_fast(__fadd_rn(
                __fadd_rn(__fadd_rn(c[4 * j], c[4 * j + 1]), __fadd_rn(c[4 * j + 2], c[4 * j + 3])), 1e-6f));
#pragma unroll
            for (int k = 0; k < 4; ++k) c[4 * j + k] = __fmul_rn(c[4 * j + k], r);
        }
    };
    cols();
#pragma unroll 1
    for (int it = 1; it < 20; ++it) {
        rows();
        cols();
    }
}

// Sum of the split-block trees of mix j in block order, from 0 (see the header, item 2).
__device__ __forceinline__ float mix_total(const float (*ws)[NMIX + 1], int nb, int j) {
    float total = 0.f;
    for (int b = 0; b < nb; ++b) total += ws[b][j];
    return total;
}

// Grid (T, 2), block W = 4 x roundup32(D/32) (a multiple of 128, <= 1024). Arguments as mhc_pre_finish_pdl_*.
// PDL: the griddepcontrol instructions are no-ops under a plain launch, so the same kernel serves the PDL pair
// and the two plain launches.
template <int KIND>
__device__ __forceinline__ void finish_wide(const __nv_bfloat16* __restrict__ X, const float* __restrict__ part,
                                            int S, int D, const float* __restrict__ hc_scale,
                                            const float* __restrict__ hc_base, const __nv_bfloat16* __restrict__ w,
                                            float eps, float* pre_out, float* post_out, float* comb_out,
                                            __nv_bfloat16* u_out, uint8_t* q, uint8_t* scales, float* gsa,
                                            __nv_bfloat16* ybf, float* rstd_out) {
    __shared__ float ws[MAX_SPLIT_BLOCKS][NMIX + 1];
    __shared__ uint4 u_s[MAX_THREADS];
    __shared__ float red_ss[MAX_THREADS / 32];
    __shared__ float red_max[MAX_THREADS / 32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nwarps = blockDim.x >> 5;
    const int bd = blockDim.x >> 2;  // the current finish's block size
    const int t = blockIdx.x;
    const bool coef_task = blockIdx.y == 1;
    const int nchunks = D / 8;
    const int c = tid;  // this thread's chunk
    const bool valid = c < nchunks;

    // Constants (never written by a kernel): may be read before the wait.
    uint4 wraw = make_uint4(0u, 0u, 0u, 0u);
    if (!coef_task && valid) wraw = __ldg(reinterpret_cast<const uint4*>(w + c * 8));
    // Coefficient CTA: warp 0 = the Sinkhorn logits (hc_scale[2], hc_base[8 + i]; lanes 16..31 repeat 0..15),
    // warp 1 lanes 16..19 = post (hc_scale[1], hc_base[4 + i]), as in norm_quant.cu.
    float sc = 0.f, base_i = 0.f;
    if (coef_task) {
        if (warp == 0) {
            sc = __ldg(hc_scale + 2);
            base_i = __ldg(hc_base + 8 + (lane & 15));
        } else if (warp == 1 && lane >= 16 && lane < 20) {
            sc = __ldg(hc_scale + 1);
            base_i = __ldg(hc_base + 4 + lane - 16);
        }
    } else {
        sc = __ldg(hc_scale);
    }
    float base_pre[4] = {0.f, 0.f, 0.f, 0.f};
    if (!coef_task) {
#pragma unroll
        for (int i = 0; i < 4; ++i) base_pre[i] = __ldg(hc_base + i);
    }

    griddep_launch_dependents();
    griddep_wait();

    // X chunks (pre task): in flight with the partials.
    uint4 xraw[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        xraw[i] = (!coef_task && valid)
                      ? __ldcg(reinterpret_cast<const uint4*>(X + ((long)t * 4 + i) * D + c * 8))
                      : make_uint4(0u, 0u, 0u, 0u);
    }

    // Partials: item i = (split block b = i / 25, mix j = i % 25), items warp, warp + nwarps, ...
    const int nb = (S + 31) / 32;
    const int nitems = nb * (NMIX + 1);
    const float* pbase = part + (long)t * (NMIX + 1) * S;
    for (int i0 = warp; i0 < nitems; i0 += 8 * nwarps) {
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int i = i0 + u * nwarps;
            const int b = i / (NMIX + 1), j = i % (NMIX + 1), s = b * 32 + lane;
            v[u] = (i < nitems && s < S) ? __ldcg(pbase + (long)j * S + s) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int i = i0 + u * nwarps;  // warp-uniform
            if (i < nitems) {
                const float tree = warp_sum(v[u]);
                if (lane == 0) ws[i / (NMIX + 1)][i % (NMIX + 1)] = tree;
            }
        }
    }
    __syncthreads();
    const float ssx = mix_total(ws, nb, NMIX);
    const float rho = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ssx, (float)(4 * D)), eps)));

    if (coef_task) {
        if (warp == 0) {
            // lane i < 16 forms logit i; every lane gathers all 16 (independent shuffles) and runs the
            // Sinkhorn; lane i stores C element i (static register indices: no local memory).
            const float zi = mix_logit(rho, mix_total(ws, nb, 8 + (lane & 15)), sc, base_i);
            float z[16], cm[16];
#pragma unroll
            for (int k = 0; k < 16; ++k) z[k] = __shfl_sync(0xffffffffu, zi, k);
            sinkhorn_regs(z, cm);
            float cv = cm[0];
#pragma unroll
            for (int k = 1; k < 16; ++k) cv = lane == k ? cm[k] : cv;
            if (lane < 16) comb_out[t * 16 + lane] = cv;
        }
        if (warp == 1 && lane >= 16 && lane < 20) {
            const int i = lane - 16;
            const float z = mix_logit(rho, mix_total(ws, nb, 4 + i), sc, base_i);
            post_out[t * 4 + i] = __fmul_rn(2.f, sigmoid_f(z));
        }
        return;
    }

    float pre[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        pre[i] = __fadd_rn(sigmoid_f(mix_logit(rho, mix_total(ws, nb, i), sc, base_pre[i])), 1e-6f);
    if (tid < 4) pre_out[t * 4 + tid] = pre[tid];

    // u chunk = ((p0 x0 + p1 x1) + p2 x2) + p3 x3, BF16-rounded (norm_quant.cu apply_pre_chunk).
    float v[8];
    {
        float xs[4][8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            xs[i][0] = bf16_lo(xraw[i].x); xs[i][1] = bf16_hi(xraw[i].x);
            xs[i][2] = bf16_lo(xraw[i].y); xs[i][3] = bf16_hi(xraw[i].y);
            xs[i][4] = bf16_lo(xraw[i].z); xs[i][5] = bf16_hi(xraw[i].z);
            xs[i][6] = bf16_lo(xraw[i].w); xs[i][7] = bf16_hi(xraw[i].w);
        }
        uint32_t pk[4];
#pragma unroll
        for (int e = 0; e < 8; e += 2) {
            float a0 = __fmul_rn(pre[0], xs[0][e]), a1 = __fmul_rn(pre[0], xs[0][e + 1]);
#pragma unroll
            for (int i = 1; i < 4; ++i) {
                a0 = __fadd_rn(a0, __fmul_rn(pre[i], xs[i][e]));
                a1 = __fadd_rn(a1, __fmul_rn(pre[i], xs[i][e + 1]));
            }
            pk[e / 2] = pack_bf16x2(a0, a1);
            v[e] = bf16_lo(pk[e / 2]);
            v[e + 1] = bf16_hi(pk[e / 2]);
        }
        const uint4 ur = make_uint4(pk[0], pk[1], pk[2], pk[3]);
        if (valid) *reinterpret_cast<uint4*>(u_out + (long)t * D + c * 8) = ur;
        u_s[tid] = ur;  // zeros past nchunks (xraw was zero there)
    }
    __syncthreads();

    // Sum of squares exactly as the current finish (header, item 4): threads tid < bd replay its fmaf chain.
    if (tid < bd) {
        float ss = 0.f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int ck = tid + k * bd;
            if (ck < nchunks) {
                const uint4 r = u_s[ck];
                const float uv[8] = {bf16_lo(r.x), bf16_hi(r.x), bf16_lo(r.y), bf16_hi(r.y),
                                     bf16_lo(r.z), bf16_hi(r.z), bf16_lo(r.w), bf16_hi(r.w)};
#pragma unroll
                for (int e = 0; e < 8; ++e) ss = fmaf(uv[e], uv[e], ss);
            }
        }
        ss = warp_sum(ss);
        if (lane == 0) red_ss[warp] = ss;
    }
    __syncthreads();
    float ss_total = 0.f;
    for (int wi = 0; wi < (bd >> 5); ++wi) ss_total += red_ss[wi];
    const float rstd = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss_total, (float)D), eps)));
    if (tid == 0) rstd_out[t] = rstd;

    // y = bf16(w * (u * rstd)) (norm_quant_row's paired conversion).
    {
        const float wv[8] = {bf16_lo(wraw.x), bf16_hi(wraw.x), bf16_lo(wraw.y), bf16_hi(wraw.y),
                             bf16_lo(wraw.z), bf16_hi(wraw.z), bf16_lo(wraw.w), bf16_hi(wraw.w)};
#pragma unroll
        for (int e = 0; e < 8; e += 2) {
            const uint32_t pk = pack_bf16x2(__fmul_rn(wv[e], __fmul_rn(v[e], rstd)),
                                            __fmul_rn(wv[e + 1], __fmul_rn(v[e + 1], rstd)));
            v[e] = valid ? bf16_lo(pk) : 0.f;
            v[e + 1] = valid ? bf16_hi(pk) : 0.f;
        }
    }

    if (KIND == KIND_BF16) {
        if (valid) {
            uint4 r;
            r.x = pack_bf16x2(v[0], v[1]); r.y = pack_bf16x2(v[2], v[3]);
            r.z = pack_bf16x2(v[4], v[5]); r.w = pack_bf16x2(v[6], v[7]);
            *reinterpret_cast<uint4*>(ybf + (long)t * D + c * 8) = r;
        }
    } else if (KIND == KIND_FP8) {
        float amax = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[e]));
        // 128-block = chunks 16b..16b+15 = a half warp (chunk = thread).
#pragma unroll
        for (int off = 1; off < 16; off <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        if (valid) {
            const uint8_t s8 = mm::ue8m0_pow2_scale_for(fmaxf(amax, 1e-4f), 448.f);
            const float inv = mm::ue8m0_decode((uint8_t)(254 - s8));  // exact 1/scale (norm_quant.cu)
            uint32_t w4[4];
#pragma unroll
            for (int p = 0; p < 4; ++p)
                w4[p] = (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(v[2 * p] * inv, v[2 * p + 1] * inv),
                                                           __NV_SATFINITE, __NV_E4M3);
            uint8_t* qrow = q + (long)t * D;
            *reinterpret_cast<uint2*>(qrow + c * 8) = make_uint2(w4[0] | (w4[1] << 16), w4[2] | (w4[3] << 16));
            if ((c & 15) == 0) scales[(long)t * (D / 128) + (c >> 4)] = s8;
        }
    } else {  // NVFP4
        float amax = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[e]));
        // Row amax: a max of non-negative values, exact in any grouping (same value as block_max).
        const float wmax = warp_max(amax);
        if (lane == 0) red_max[warp] = wmax;
        __syncthreads();
        float amax_row = 0.f;
        for (int wi = 0; wi < nwarps; ++wi) amax_row = fmaxf(amax_row, red_max[wi]);
        const float gs = mm::nvfp4_global_scale(amax_row);
        if (tid == 0) gsa[t] = gs;
        const float ab = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));  // 16-block = chunks (2i, 2i+1)
        if (valid) {
            const uint8_t s8 = mm::nvfp4_block_scale(ab, gs);
            const float scale = __fmul_rn(mm::e4m3_decode(s8), gs);
            uint32_t packed = 0;
            if (scale != 0.f) {  // scale 0: every code is 0 (formats rule)
                const E2m1Thresholds thr = e2m1_thresholds(scale);
#pragma unroll
                for (int e = 0; e < 8; ++e) packed |= e2m1_code_thr(v[e], thr) << (4 * e);
            }
            *reinterpret_cast<uint32_t*>(q + (long)t * (D / 2) + c * 4) = packed;
            if ((c & 1) == 0) scales[(long)t * (D / 16) + (c >> 1)] = s8;
        }
    }
}

}  // namespace

#define MHC_WIDE_COMMON                                                                                          \
    const __nv_bfloat16 *X, const float *part, int S, int T, int D, const float *hc_scale, const float *hc_base, \
        const __nv_bfloat16 *w, float eps, float *pre, float *post, float *comb, __nv_bfloat16 *u

// Wide finish of the mHC boundary: grid (T, 2), block 4 x roundup32(D/32) <= 1024; same arguments as
// norm_quant.cu mhc_pre_finish_pdl_* (T unused: one token per blockIdx.x). Launched as the PDL partner of
// mhc_mix_partial24_pdl, or plainly after mhc_mix_partial24_v2.
extern "C" __global__ void __launch_bounds__(1024, 1) mhc_pre_finish_wide_nvfp4(MHC_WIDE_COMMON, uint8_t* q,
                                                                              uint8_t* scales, float* gsa,
                                                                              float* rstd) {
    finish_wide<KIND_NVFP4>(X, part, S, D, hc_scale, hc_base, w, eps, pre, post, comb, u, q, scales, gsa, nullptr,
                            rstd);
}
extern "C" __global__ void __launch_bounds__(1024, 1) mhc_pre_finish_wide_fp8(MHC_WIDE_COMMON, uint8_t* q,
                                                                            uint8_t* scales, float* rstd) {
    finish_wide<KIND_FP8>(X, part, S, D, hc_scale, hc_base, w, eps, pre, post, comb, u, q, scales, nullptr, nullptr,
                          rstd);
}
extern "C" __global__ void __launch_bounds__(1024, 1) mhc_pre_finish_wide_bf16(MHC_WIDE_COMMON, __nv_bfloat16* y,
                                                                             float* rstd) {
    finish_wide<KIND_BF16>(X, part, S, D, hc_scale, hc_base, w, eps, pre, post, comb, u, nullptr, nullptr, nullptr, y,
                           rstd);
}

// Test entry (tests/norm_quant.rs gpu_rcp_rn_fast_equals_frcp_rn_exhaustively): counts the f32 bit patterns in
// [lo, hi) where rcp_rn_fast and __frcp_rn differ, and the smallest such pattern (first_bad starts at ~0u).
// The test runs it over every positive float with a biased exponent 1..252 (the whole claimed range).
extern "C" __global__ void mhc_test_rcp_fast_mismatches(unsigned int* count, unsigned int* first_bad, unsigned int lo,
                                                        unsigned int hi) {
    const unsigned int stride = gridDim.x * blockDim.x;
    unsigned int local = 0, first = 0xFFFFFFFFu;
    for (unsigned int b = lo + blockIdx.x * blockDim.x + threadIdx.x; b < hi && b >= lo; b += stride) {
        const float x = __uint_as_float(b);
        if (__float_as_uint(rcp_rn_fast(x)) != __float_as_uint(__frcp_rn(x))) {
            ++local;
            first = min(first, b);
        }
        if (hi - b <= stride) break;  // the next step would pass hi (or wrap around 2^32)
    }
    if (local) {
        atomicAdd(count, local);
        atomicMin(first_bad, first);
    }
}
