// norm_quant: fused RMSNorm -> {NVFP4, FP8 1x128, BF16} over rows [rows, D] (BF16 or f32 in). Launchers:
// src/ops/norm_quant/mod.rs; the routing rule (rows_path) and the measurements that decided it are documented there.
//
// Kernels
// -------
// * One CTA per row (rmsnorm_<fmt>_<in>, quant_<fmt>_bf16in): blockDim = roundup32(D/8/CH) threads (CH = 4 chunks
//   of 8 values per thread; D = 4096 -> 128 threads, 7168 -> 224). Each thread loads its chunks with 16-byte loads
//   (two for f32 input) into registers; the row is never re-read from HBM. The per-row work is norm_quant_row
//   (common/norm_row.cuh): sum of squares -> block reduce -> rstd; y = bf16(w * (x * rstd)) in registers; then
//   the quantizer (NVFP4: row amax -> gs = amax/2688, 16-block amax = own 8 values + lane^1, e4m3 block scale,
//   e2m1 codes; FP8: 128-block amax over 16 lanes, ue8m0 scale, e4m3 codes; BF16: 16 bytes per thread).
//   Chunk c of a row belongs to thread c % blockDim; blockDim % 32 == 0, so a 16-block is lanes (2i, 2i+1) and a
//   128-block is a 16-lane half-warp. Every reduction is a fixed tree: identical result in every thread.
// * Row loop, BF16 -> NVFP4 (rmsnorm_nvfp4_bf16in_row_loop, quant_nvfp4_bf16in_row_loop): the same per-row work
//   with rows looped by one resident wave of CTAs, the next row's loads in flight, and a packed BF16-pair e2m1
//   encoder (own section).
// * Resident FP8 (rmsnorm_fp8_bf16in_resident) and resident NVFP4 (rmsnorm_nvfp4_bf16in_resident_nw<NW>,
//   quant_nvfp4_bf16in_resident_nw<NW>, D = 1024 NW compiled in): one resident wave looping over rows with the
//   weight staged once per CTA in shared memory, one barrier per reduction, one thread per 16-block (own sections).
// Every kernel of a format gives the same bits (the tests compare them with each other and with the CPU reference).
//
// Byte budget (D = 4096, BF16 in): 8192 B read per row; writes NVFP4 2048 + 256 + 4 B, FP8 4096 + 32 B,
// BF16 8192 B. At ~4.3 TB/s a 4096x4096 NVFP4 pass moves 43 MB ~ 10 us. Instruction budget: an H200 issues
// ~1e12 warp-instructions/s, i.e. ~60 per element of that pass before issue becomes the limit next to HBM;
// the exact e2m1 rule would cost an IEEE division (~10 SASS instructions) plus a 7-step ladder per element,
// so the NVFP4 paths use a division-free exact encoder (per-block thresholds, 3 compares per element, see
// e2m1_thresholds) and paired BF16 / e4m3 conversions.
//
// Rounding points (the CPU reference in src/ops/norm_quant/reference.rs has the same): rstd = 1/sqrt(ss/D+eps)
// with IEEE ops; t = x*rstd, y = w*t (fp32, no FMA), y -> BF16; quantizers see the BF16 y. Only the fp32
// sum of squares has a reduction order different from the reference.
#include "common/norm_row.cuh"
#include "common/pdl.cuh"

namespace {

template <typename Tin, int KIND, bool NORM, bool WEARLY = true>
__device__ void rmsnorm_rows(const Tin* __restrict__ x, const __nv_bfloat16* __restrict__ w, uint8_t* q,
                             uint8_t* scales, float* gsa, __nv_bfloat16* bf, float* rstd, int D, float eps) {
    __shared__ float red[MAX_WARPS];
    const long row = blockIdx.x;
    const int nchunks = D / 8;
    float v[CH][8];
#pragma unroll
    for (int k = 0; k < CH; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        if (c < nchunks) {
            load8(x + row * D + c * 8, v[k]);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) v[k][e] = 0.f;
        }
    }
    RowOut o;
    o.q = KIND == KIND_NVFP4 ? q + row * (D / 2) : q + row * D;
    o.scales = KIND == KIND_NVFP4 ? scales + row * (D / 16) : scales + row * (D / 128);
    o.gsa = gsa + row;
    o.bf = bf + row * D;
    o.rstd = rstd ? rstd + row : nullptr;
    norm_quant_row<KIND, NORM, WEARLY>(v, nchunks, D, w, eps, o, red);
}

// ---- row-loop NVFP4 kernels (the BF16 -> NVFP4 path below the resident threshold) -----------------------------
// Instantiated as rmsnorm_nvfp4_bf16in_row_loop / quant_nvfp4_bf16in_row_loop (PRMT_PLACE = true, BF16 in). The
// shift placement (PRMT_PLACE = false) and the FP8 branch of rmsnorm_rows_loop are not instantiated; the CPU mirror
// test checks the prmt placement against the shift placement. Two changes against the one-CTA-per-row kernels:
//  (1) Rows in flight: a CTA walks rows blockIdx.x, blockIdx.x + gridDim.x, ... (the launcher sizes the grid to
//      one full resident wave) and issues the NEXT row's 16-byte loads before it reduces and quantizes the
//      current one, so a row's HBM latency overlaps the previous row's barriers and ALU work (one CTA per row is
//      latency-bound with few rows per SM, or ALU-bound for NVFP4).
//  (2) The e2m1 codes are found with 16-bit integer compares on packed BF16 pairs instead of a per-element f32
//      binary search (~16 -> ~10 instructions per element), and the 16-block amax with max.u16x2 on the same
//      pairs.
// Identities the packed encoder relies on (all for finite y; NaN y may get other codes than norm_quant_row):
//  * norm_quant_row's code magnitude is #{i : a >= B_i}, a = |y|, B_i = e2m1_thresholds(scale) non-decreasing
//    (directed roundings are monotone). y is a BF16 value, so a >= B_i <=> a >= RU_bf16(B_i) (the smallest BF16
//    >= B_i), and for non-negative BF16 values (subnormals and +inf included) a >= b <=> bits(a) >= bits(b) as
//    16-bit integers. For 0 < B_i <= +inf, RU_bf16(B_i) = (bits(B_i) + 0xFFFF) >> 16 (a carry out of the
//    mantissa moves to the next binade, max finite f32 -> 0x7F80 = +inf).
//  * Compare by subtraction: with G = 0x8000 in each half, (G + a) - T for a, T <= 0x7F80 lies in
//    [0x80, 0xFF80]: no borrow crosses a half, and bit 15 of the half is [a >= T]. One 32-bit subtraction
//    compares both halves of a pair against T replicated in both halves.
//  * The 7 compare bits b_0..b_6 form a thermometer (b_i >= b_{i+1}); their count c is the code magnitude:
//    c bit 2 = b_3; c bit 1 = (b_1 & !b_3) | b_5; c bit 0 = parity = b_0 ^ ... ^ b_6.
//  * Pairs are (element p, element p + 4) of a chunk, so the two halves of a pair go to nibbles p and p + 4
//    of the chunk's 32-bit code word: 16 bits apart, like the halves; one shift + mask per code bit places both.
// src/ops/norm_quant/reference.rs has a Rust mirror of e2m1_codes8_keys (same u32 operations) that the CPU tests
// compare against formats::e2m1 of the IEEE quotient for every BF16 value at a sweep of scales.

__device__ __forceinline__ uint32_t max_u16x2(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("max.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// RU_bf16(b) as a 16-bit key, replicated into both halves. Requires 0 < b <= +inf.
__device__ __forceinline__ uint32_t bf16_key_ru_x2(float b) {
    return __byte_perm(__float_as_uint(b) + 0xFFFFu, 0u, 0x3232);
}

// prmt.b32 in its default mode: selector nibble n picks byte (nibble & 7) of {b, a} for result byte n; with
// the nibble's bit 3 set, the picked byte's msb is replicated over the result byte (0x00 or 0xFF).
__device__ __forceinline__ uint32_t prmt_b32(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// Codes of the 8 values held as pairs pk[p] = (y[p] low half, y[p + 4] high half); nibble e = code of y[e]
// (sign in bit 3, kept for -0). keys[i] = bf16_key_ru_x2(B_i).
// Placement of the code bits (each at bits 15 / 31 of its plane word X[j][p], j = 0..3: m0, m1, m2, sign):
//  * PRMT_PLACE = false: per plane and pair, shift right by 15 - 4p - j and mask: 32 operations per 8 values.
//  * PRMT_PLACE = true: one sign-replicating prmt per plane and pair PAIR (p, p + 2) turns the four compare bits
//    into four 0x00/0xFF bytes: byte 0 <- X[j][p] lo, byte 1 <- X[j][p + 2] lo, byte 2 <- X[j][p] hi, byte 3 <-
//    X[j][p + 2] hi (selector 0xFBD9: bytes 1, 5, 3, 7 of {X[j][p + 2], X[j][p]}, each sign-replicated); masking
//    byte bit j (p = 0) or 4 + j (p = 1) lands each bit at output bit 4 * (element) + j: element p -> byte 0,
//    p + 2 -> byte 1, p + 4 -> byte 2, p + 6 -> byte 3. 16 operations per 8 values.
template <bool PRMT_PLACE>
__device__ __forceinline__ uint32_t e2m1_codes8_keys(const uint32_t (&pk)[4], const uint32_t (&keys)[7]) {
    uint32_t out = 0;
    uint32_t x[3][4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const uint32_t a = pk[p] | 0x80008000u;
        uint32_t d[7];
#pragma unroll
        for (int i = 0; i < 7; ++i) d[i] = a - keys[i];
        const uint32_t m2 = d[3];
        const uint32_t m1 = (d[1] & ~d[3]) | d[5];
        const uint32_t m0 = d[0] ^ d[1] ^ d[2] ^ d[3] ^ d[4] ^ d[5] ^ d[6];
        if (PRMT_PLACE) {
            x[0][p] = m0; x[1][p] = m1; x[2][p] = m2;
        } else {
            out |= ((m0 >> (15 - 4 * p)) & (0x00010001u << (4 * p))) |
                   ((m1 >> (14 - 4 * p)) & (0x00020002u << (4 * p))) |
                   ((m2 >> (13 - 4 * p)) & (0x00040004u << (4 * p))) |
                   ((pk[p] >> (12 - 4 * p)) & (0x00080008u << (4 * p)));
        }
    }
    if (PRMT_PLACE) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint32_t* xj = j < 3 ? x[j] : pk;
            out |= (prmt_b32(xj[0], xj[2], 0xFBD9u) & (0x01010101u << j)) |
                   (prmt_b32(xj[1], xj[3], 0xFBD9u) & (0x10101010u << j));
        }
    }
    return out;
}

// NVFP4 row of the row loop: RMSNorm as in norm_quant_row (same rounding points), then the packed-pair quantizer.
// x[k][e] = chunk tid + k*bd (zeros when invalid). All threads of the block call it.
// NORM = false: quantize x itself (BF16 values: the packing is exact), for the boundary test of the encoder.
template <bool NORM, bool PRMT_PLACE = false>
__device__ void nvfp4_row_packed(const float (&x)[CH][8], int nchunks, int D, const __nv_bfloat16* __restrict__ w,
                                     float eps, const RowOut& o, float* red) {
    const int tid = threadIdx.x, bd = blockDim.x;
    uint4 wraw[CH] = {};  // stays zero (unused) without NORM
    float rstd = 1.f;
    if (NORM) {
#pragma unroll
        for (int k = 0; k < CH; ++k) {
            const int c = tid + k * bd;
            wraw[k] = c < nchunks ? __ldg(reinterpret_cast<const uint4*>(w + c * 8)) : make_uint4(0u, 0u, 0u, 0u);
        }
        float ss = 0.f;
#pragma unroll
        for (int k = 0; k < CH; ++k)
#pragma unroll
            for (int e = 0; e < 8; ++e) ss = fmaf(x[k][e], x[k][e], ss);
        ss = block_sum(ss, red);
        rstd = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)D), eps)));
        if (tid == 0 && o.rstd) *o.rstd = rstd;
    }
    // y pairs (p, p + 4) and the chunk amax as a guarded 16-bit key (0x8000 + bits(|y|)): invalid chunks are 0.
    uint32_t pk[CH][4];
    uint32_t key[CH];
    uint32_t row_key = 0x8000u;
#pragma unroll
    for (int k = 0; k < CH; ++k) {
        const float wv[8] = {bf16_lo(wraw[k].x), bf16_hi(wraw[k].x), bf16_lo(wraw[k].y), bf16_hi(wraw[k].y),
                             bf16_lo(wraw[k].z), bf16_hi(wraw[k].z), bf16_lo(wraw[k].w), bf16_hi(wraw[k].w)};
#pragma unroll
        for (int p = 0; p < 4; ++p)
            pk[k][p] = NORM ? pack_bf16x2(__fmul_rn(wv[p], __fmul_rn(x[k][p], rstd)),
                                          __fmul_rn(wv[p + 4], __fmul_rn(x[k][p + 4], rstd)))
                            : pack_bf16x2(x[k][p], x[k][p + 4]);
        const uint32_t m = max_u16x2(max_u16x2(pk[k][0] | 0x80008000u, pk[k][1] | 0x80008000u),
                                     max_u16x2(pk[k][2] | 0x80008000u, pk[k][3] | 0x80008000u));
        key[k] = max(m & 0xFFFFu, m >> 16);
        row_key = max(row_key, key[k]);
    }
    // max over non-negative BF16 values = max of their bit patterns (no NaN): norm_quant_row's fmaxf result.
    const float amax_row = block_max(__uint_as_float((row_key & 0x7FFFu) << 16), red);
    const float gs = mm::nvfp4_global_scale(amax_row);
    if (tid == 0) *o.gsa = gs;
#pragma unroll
    for (int k = 0; k < CH; ++k) {
        const int c = tid + k * bd;
        const uint32_t kb = max(key[k], __shfl_xor_sync(0xffffffffu, key[k], 1));  // 16-block = chunks (2i, 2i+1)
        if (c < nchunks) {
            const float ab = __uint_as_float((kb & 0x7FFFu) << 16);
            const uint8_t s = mm::nvfp4_block_scale(ab, gs);
            const float scale = __fmul_rn(mm::e4m3_decode(s), gs);
            uint32_t packed = 0;
            if (scale != 0.f) {  // scale 0: every code is 0 (formats rule)
                // FMA thresholds (same bits, see e2m1_thresholds_fma) or the FP64 form of norm_quant_row.
                const E2m1Thresholds thr = PRMT_PLACE ? e2m1_thresholds_fma(scale) : e2m1_thresholds(scale);
                if (scale < INFINITY) {  // finite positive scale: thresholds in (0, +inf], the identities hold
                    uint32_t keys[7];
#pragma unroll
                    for (int i = 0; i < 7; ++i) keys[i] = bf16_key_ru_x2(thr.b[i]);
                    packed = e2m1_codes8_keys<PRMT_PLACE>(pk[k], keys);
                } else {  // non-finite scale (non-finite input): norm_quant_row's per-element search, same bits
#pragma unroll
                    for (int p = 0; p < 4; ++p) {
                        packed |= e2m1_code_thr(bf16_lo(pk[k][p]), thr) << (4 * p);
                        packed |= e2m1_code_thr(bf16_hi(pk[k][p]), thr) << (4 * (p + 4));
                    }
                }
            }
            *reinterpret_cast<uint32_t*>(o.q + c * 4) = packed;
            if ((c & 1) == 0) o.scales[c >> 1] = s;
        }
    }
}

// Raw 16-byte loads of one 8-value chunk, kept packed while in flight (BF16: 4 registers, f32: 8).
struct RawBf16 { uint4 r; };
struct RawF32 { float4 a, b; };
template <typename Tin> struct RawOf;
template <> struct RawOf<__nv_bfloat16> { using T = RawBf16; };
template <> struct RawOf<float> { using T = RawF32; };

__device__ __forceinline__ void load_raw(const __nv_bfloat16* p, RawBf16& r) { r.r = __ldg(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ void load_raw(const float* p, RawF32& r) {
    r.a = __ldg(reinterpret_cast<const float4*>(p));
    r.b = __ldg(reinterpret_cast<const float4*>(p) + 1);
}
__device__ __forceinline__ void zero_raw(RawBf16& r) { r.r = make_uint4(0u, 0u, 0u, 0u); }
__device__ __forceinline__ void zero_raw(RawF32& r) { r.a = make_float4(0.f, 0.f, 0.f, 0.f); r.b = r.a; }
__device__ __forceinline__ void unpack_raw(const RawBf16& r, float v[8]) {
    v[0] = bf16_lo(r.r.x); v[1] = bf16_hi(r.r.x); v[2] = bf16_lo(r.r.y); v[3] = bf16_hi(r.r.y);
    v[4] = bf16_lo(r.r.z); v[5] = bf16_hi(r.r.z); v[6] = bf16_lo(r.r.w); v[7] = bf16_hi(r.r.w);
}
__device__ __forceinline__ void unpack_raw(const RawF32& r, float v[8]) {
    v[0] = r.a.x; v[1] = r.a.y; v[2] = r.a.z; v[3] = r.a.w; v[4] = r.b.x; v[5] = r.b.y; v[6] = r.b.z; v[7] = r.b.w;
}

// Rows blockIdx.x + i * gridDim.x; the next row's loads are issued before the current row is processed.
template <typename Tin, int KIND, bool NORM = true, bool PRMT_PLACE = false>
__device__ void rmsnorm_rows_loop(const Tin* __restrict__ x, const __nv_bfloat16* __restrict__ w, uint8_t* q,
                                uint8_t* scales, float* gsa, float* rstd, int rows, int D, float eps) {
    __shared__ float red[MAX_WARPS];
    const int nchunks = D / 8;
    typename RawOf<Tin>::T raw[CH];
    auto load_row = [&](long row) {
#pragma unroll
        for (int k = 0; k < CH; ++k) {
            const int c = threadIdx.x + k * blockDim.x;
            if (c < nchunks) load_raw(x + row * D + c * 8, raw[k]); else zero_raw(raw[k]);
        }
    };
    long row = blockIdx.x;
    if (row < rows) load_row(row);
    for (; row < rows; row += gridDim.x) {
        float v[CH][8];
#pragma unroll
        for (int k = 0; k < CH; ++k) unpack_raw(raw[k], v[k]);
        if (row + gridDim.x < rows) load_row(row + gridDim.x);  // in flight during this row's reductions
        RowOut o;
        o.q = KIND == KIND_NVFP4 ? q + row * (D / 2) : q + row * D;
        o.scales = KIND == KIND_NVFP4 ? scales + row * (D / 16) : scales + row * (D / 128);
        o.gsa = gsa + row;
        o.bf = nullptr;
        o.rstd = rstd ? rstd + row : nullptr;
        if (KIND == KIND_NVFP4) {
            nvfp4_row_packed<NORM, PRMT_PLACE>(v, nchunks, D, w, eps, o, red);
        } else {
            norm_quant_row<KIND, NORM>(v, nchunks, D, w, eps, o, red);
        }
    }
}

// ==== Resident rows (persistent CTAs, fixed channels, weight staged once per CTA): BF16 in, D % 1024 == 0 ==========
// rmsnorm_fp8_bf16in_resident here; the resident NVFP4 kernels (next section) share these helpers (resident_stage_weight,
// resident_load_row, resident_norm_pairs' order). Built around the instruction count: the row-loop NVFP4 kernel issues
// ~34 thread-instructions per element and the one-CTA-per-row FP8 kernel ~24 (Nsight Compute, 4096 x 4096), where
// 85% of copy bandwidth needs <= ~15 / ~12. Same per-thread channel ownership as the other row kernels, so the same
// fp32 sum-of-squares order and rstd:
//  * D % 1024 == 0 only (launcher error otherwise): blockDim = D/32, every thread owns exactly CH = 4 chunks
//    (c = tid + k * blockDim): no validity predicates anywhere.
//  * Persistent CTAs (one resident wave, rows looped, the next row's 16-byte loads in flight while the current
//    row is reduced and quantized). The weight is converted to f32 ONCE per CTA into shared memory (D * 4 bytes,
//    split layout: elements 0..3 of every chunk, then 4..7, so a lane's float4 reads are 16 B apart:
//    conflict-free) and read back with 2 LDS.128 per chunk (no L2 re-read per row, no unpacks).
//  * Reductions: the same warp trees and warp-order sums as block_sum / block_max (identical values), but with
//    one barrier each: the sum uses buffer red_ss[row parity], the max red_mx[row parity]. Why one barrier is
//    enough: a buffer is rewritten two rows later at the earliest, and a thread gets there only after passing
//    the next row's barrier(s), which every thread reaches after its reads of the buffer. (One buffer per
//    reduction without the parity would race when a row has only one barrier: FP8, or NVFP4 without NORM.)
//  * NVFP4 (the resident NVFP4 kernels): lane pairs (2i, 2i+1) hold the two halves of each 16-block (chunks 2i,
//    2i+1 of the same k). After the row max, they swap half their y words (one shuffle per word) so that the even
//    lane owns the blocks of k = 0, 2 and the odd lane those of k = 1, 3: the block scale and the 7 threshold keys
//    are computed ONCE per block, the block amax needs no extra shuffle (the chunk keys travel with the halves),
//    and a block's 8 code bytes go out as one 8-byte store. Encoder and fallbacks are the row loop's functions
//    (e2m1_codes8_keys<true>, e2m1_thresholds_fma, e2m1_code_thr): same bits.
//  * FP8: the chunk amax is an fmaxf over |y| (NaN ignored: same bits for every input); two chunks' amax values
//    (non-negative BF16 values, so their high halves order like the floats) share one 32-bit shuffle in the
//    16-lane max tree (max.u16x2); the ue8m0 scale is found without the division, see ue8m0_scale_448_divfree
//    (CPU mirror tested against formats::ue8m0 for every BF16 amax).
// Rounding points unchanged: rstd, t = x*rstd, y = w*t (no FMA), y -> BF16, then the NVFP4 / FP8 quantizers.
constexpr int RESIDENT_CH = 4;

__device__ __forceinline__ float resident_block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = 0.f;
    for (int w = 0; w < nw; ++w) s += red[w];
    return s;  // same value as block_sum; no trailing barrier (see the header of this section)
}

// Weight -> f32 shared memory, split layout: wsm[c] = elements 0..3 of chunk c, wsm[nchunks + c] = 4..7.
__device__ __forceinline__ void resident_stage_weight(const __nv_bfloat16* __restrict__ w, float4* wsm, int nchunks) {
    for (int c = threadIdx.x; c < nchunks; c += blockDim.x) {
        const uint4 r = __ldg(reinterpret_cast<const uint4*>(w + c * 8));
        wsm[c] = make_float4(bf16_lo(r.x), bf16_hi(r.x), bf16_lo(r.y), bf16_hi(r.y));
        wsm[nchunks + c] = make_float4(bf16_lo(r.z), bf16_hi(r.z), bf16_lo(r.w), bf16_hi(r.w));
    }
}

__device__ __forceinline__ void resident_load_row(const __nv_bfloat16* __restrict__ x, long row, int D, uint4 (&raw)[RESIDENT_CH]) {
    const __nv_bfloat16* p = x + row * D + threadIdx.x * 8;
#pragma unroll
    for (int k = 0; k < RESIDENT_CH; ++k) raw[k] = __ldg(reinterpret_cast<const uint4*>(p + k * blockDim.x * 8));
}

// y of one row as pairs (element p, element p + 4) of each chunk, the rounding points of norm_quant_row /
// nvfp4_row_packed (t = x * rstd, y = w * t, no FMA, RNE to BF16); rstd written by thread 0.
// NORM = false: y = x (BF16 input, packing exact), rstd not computed.
template <bool NORM>
__device__ __forceinline__ void resident_norm_pairs(const uint4 (&raw)[RESIDENT_CH], const float4* wsm, int nchunks, int D, float eps,
                                              float* red_ss, float* rstd_out, uint32_t (&pk)[RESIDENT_CH][4]) {
    float x[RESIDENT_CH][8];
#pragma unroll
    for (int k = 0; k < RESIDENT_CH; ++k) {
        x[k][0] = bf16_lo(raw[k].x); x[k][1] = bf16_hi(raw[k].x); x[k][2] = bf16_lo(raw[k].y); x[k][3] = bf16_hi(raw[k].y);
        x[k][4] = bf16_lo(raw[k].z); x[k][5] = bf16_hi(raw[k].z); x[k][6] = bf16_lo(raw[k].w); x[k][7] = bf16_hi(raw[k].w);
    }
    if (!NORM) {
#pragma unroll
        for (int k = 0; k < RESIDENT_CH; ++k)
#pragma unroll
            for (int p = 0; p < 4; ++p) pk[k][p] = pack_bf16x2(x[k][p], x[k][p + 4]);
        return;
    }
    float ss = 0.f;  // the order of norm_quant_row / nvfp4_row_packed: chunks k = 0..3, elements 0..7
#pragma unroll
    for (int k = 0; k < RESIDENT_CH; ++k)
#pragma unroll
        for (int e = 0; e < 8; ++e) ss = fmaf(x[k][e], x[k][e], ss);
    ss = resident_block_sum(ss, red_ss);
    const float rstd = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)D), eps)));
    if (threadIdx.x == 0 && rstd_out) *rstd_out = rstd;
#pragma unroll
    for (int k = 0; k < RESIDENT_CH; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        const float4 wa = wsm[c], wb = wsm[nchunks + c];
        const float wlo[4] = {wa.x, wa.y, wa.z, wa.w}, whi[4] = {wb.x, wb.y, wb.z, wb.w};
#pragma unroll
        for (int p = 0; p < 4; ++p)
            pk[k][p] = pack_bf16x2(__fmul_rn(wlo[p], __fmul_rn(x[k][p], rstd)),
                                   __fmul_rn(whi[p], __fmul_rn(x[k][p + 4], rstd)));
    }
}

// ue8m0 scale code of amax / 448 without the division, for amax = fmaxf(block amax, 1e-4f) (never NaN):
// mm::ue8m0_pow2_scale_for(a, 448) = clamp(E(r) + [M(r) != 0], 1, 254) with r = fl(a / 448), E/M its exponent
// and mantissa fields. With a = (1 + f) 2^ea normal (a >= 1e-4 > 2^-14) and 448 = 1.75 * 2^8:
//  * 1 + f <= 1.75: a/448 in [2^(ea-9), 2^(ea-8)]; r = 2^(ea-9) would need 1 + f <= 0.875 (1 + 2^-24) < 1, so
//    either r is not a power of two (E = ea - 9 + 127, +1) or r = 2^(ea-8) (E = ea - 8 + 127, +0): code ea + 119.
//  * 1 + f > 1.75, i.e. 1 + f >= 1.75 + 2^-23 > 1.75 (1 + 2^-24): r > 2^(ea-8) (its rounding cannot reach it),
//    r <= 2^(ea-7): code ea + 120 either way.
// So code = E(a) - 8 + [M(a) > 0x600000] = ((bits(a) + 0x1FFFFF) >> 23) - 8 (the carry out of the mantissa
// adds the 1), in [105, 247] for finite a: no clamp. a = +inf: r = +inf, code clamp(255) = 254.
// Mirrored by reference.rs (ue8m0_scale_448_divfree) and compared with formats::ue8m0 on every BF16 amax.
__device__ __forceinline__ uint32_t ue8m0_scale_448_divfree(float a) {
    const uint32_t b = __float_as_uint(a);
    return b >= 0x7F800000u ? 254u : ((b + 0x1FFFFFu) >> 23) - 8u;
}

// FP8 rows (norm_quant_row's quantizer, same bits). Grid: one resident wave or one CTA per row (launcher
// option); block D/32; dynamic smem D * 4 bytes.
__device__ void rmsnorm_fp8_rows_resident(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                                    uint8_t* __restrict__ q, uint8_t* __restrict__ scales, float* __restrict__ rstd,
                                    int rows, int D, float eps) {
    extern __shared__ float4 resident_wsm[];
    __shared__ float red_ss[2][MAX_WARPS];
    const int tid = threadIdx.x, bd = blockDim.x, nchunks = D / 8;
    uint4 raw[RESIDENT_CH];
    long row = blockIdx.x;
    if (row < rows) resident_load_row(x, row, D, raw);
    resident_stage_weight(w, resident_wsm, nchunks);
    __syncthreads();
    for (int it = 0; row < rows; row += gridDim.x, ++it) {
        uint4 cur[RESIDENT_CH];
#pragma unroll
        for (int k = 0; k < RESIDENT_CH; ++k) cur[k] = raw[k];
        if (row + gridDim.x < rows) resident_load_row(x, row + gridDim.x, D, raw);
        uint32_t pk[RESIDENT_CH][4];
        resident_norm_pairs<true>(cur, resident_wsm, nchunks, D, eps, red_ss[it & 1], rstd ? rstd + row : nullptr, pk);
        // chunk amax: fmaxf over |y| from 0 (norm_quant_row's loop; the maximum does not depend on the order)
        float am[RESIDENT_CH];
#pragma unroll
        for (int k = 0; k < RESIDENT_CH; ++k) {
            float a = 0.f;
#pragma unroll
            for (int p = 0; p < 4; ++p) a = fmaxf(a, fmaxf(fabsf(bf16_lo(pk[k][p])), fabsf(bf16_hi(pk[k][p]))));
            am[k] = a;
        }
        // 128-block = 16 consecutive chunks = the 16 lanes of a half warp (bd % 32 == 0). The chunk maxima are
        // 0 or |BF16 values| (never NaN: fmaxf drops NaN), so their high halves compare as unsigned integers
        // like the floats: chunks k and k + 1 share each shuffle as the two halves of one word.
        uint32_t am2[RESIDENT_CH / 2];
#pragma unroll
        for (int kp = 0; kp < RESIDENT_CH / 2; ++kp) {
            am2[kp] = __byte_perm(__float_as_uint(am[2 * kp]), __float_as_uint(am[2 * kp + 1]), 0x7632);
#pragma unroll
            for (int off = 1; off < 16; off <<= 1)
                am2[kp] = max_u16x2(am2[kp], __shfl_xor_sync(0xffffffffu, am2[kp], off));
        }
        uint8_t* qrow = q + row * D;
        uint8_t* srow = scales + row * (D / 128);
#pragma unroll
        for (int k = 0; k < RESIDENT_CH; ++k) {
            const int c = tid + k * bd;
            const float amax = __uint_as_float((k & 1) ? (am2[k >> 1] & 0xFFFF0000u) : (am2[k >> 1] << 16));
            const uint32_t sc = ue8m0_scale_448_divfree(fmaxf(amax, 1e-4f));
            // 2^(127 - sc) = ue8m0 code 254 - sc (sc in [1, 254]; code 0 is 2^-127), as in norm_quant_row: exact,
            // so y * inv is the IEEE y / scale (one rounding).
            const float inv = mm::ue8m0_decode((uint8_t)(254u - sc));
            uint32_t w4[4];
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                // elements 2p, 2p + 1 of the chunk: pairs (p', p' + 4) hold element e in pk[e & 3], half e >> 2
                const int e0 = 2 * p, e1 = 2 * p + 1;
                const float y0 = e0 < 4 ? bf16_lo(pk[k][e0 & 3]) : bf16_hi(pk[k][e0 & 3]);
                const float y1 = e1 < 4 ? bf16_lo(pk[k][e1 & 3]) : bf16_hi(pk[k][e1 & 3]);
                w4[p] = (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(y0 * inv, y1 * inv), __NV_SATFINITE, __NV_E4M3);
            }
            *reinterpret_cast<uint2*>(qrow + c * 8) = make_uint2(w4[0] | (w4[1] << 16), w4[2] | (w4[3] << 16));
            if ((c & 15) == 0) srow[c >> 4] = (uint8_t)sc;
        }
    }
}

}  // namespace

// Resident FP8 entry point (launcher: RowsPath::ResidentFp8).
// x [rows, D] BF16, D % 1024 == 0; block D/32; dynamic shared memory D * 4 bytes.
extern "C" __global__ void __launch_bounds__(1024) rmsnorm_fp8_bf16in_resident(const __nv_bfloat16* x, const __nv_bfloat16* w,
        uint8_t* q, uint8_t* scales, float* rstd, int rows, int D, float eps) {
    rmsnorm_fp8_rows_resident(x, w, q, scales, rstd, rows, D, eps);
}

namespace {
// ==== Resident NVFP4 rows: rmsnorm_nvfp4_bf16in_resident_nw<NW> / quant_nvfp4_bf16in_resident_nw<NW> ===========
// NW = D / 1024 = warps per CTA, 1..8 (launcher: RowsPath::ResidentNvfp4). The scheme of the resident FP8 section
// (row loop, prefetch, weight staging, one barrier per reduction) with the NVFP4 lane-pair block ownership, and:
//  * D is a compile-time constant (NW warps, D = 1024 NW, block 32 NW): the reads of the per-warp partials after
//    each barrier are NW/4 LDS.128 and NW straight-line FADD / FMNMX in warp order (no runtime loop over the
//    warps); chunk addressing folds into immediates.
//  * ss / D for D = 2^k (NW = 1, 2, 4, 8) is ss * 2^-k: both are the correctly rounded value of the same real
//    ss / 2^k (2^-k is exact in f32, and subnormal results round the same way), so one FMUL replaces the IEEE
//    division. Other D keep __fdiv_rn.
//  * e2m1 codes by a 3-step binary search over the 7 sorted keys (codes8_bsearch) instead of 7 compares + XOR
//    parity: 10 instead of 12 integer operations per BF16 pair; same code bits (proof beside it).
// The same outputs, bit for bit, as rmsnorm_nvfp4_bf16in_row_loop / quant_nvfp4_bf16in_row_loop (same channel
// ownership, same fp32 operations in the same order, same encoder decisions; the GPU tests compare them).
// Codes of 8 values pk[p] = (y[p] lo, y[p + 4] hi), keys[i] = bf16_key_ru_x2(B_i) non-decreasing in i: the same
// 32-bit word as e2m1_codes8_keys<true>(pk, keys). Identities:
//  * Per 16-bit half, with A = pk | 0x80008000 and a key K <= 0x7F80 (0 < B <= +inf): bit 15 of (A - K) is
//    [|y| bits >= K] and no borrow crosses into the high half (the low half of A - K is >= 0x8000 - 0x7F80 > 0),
//    as in e2m1_codes8_keys.
//  * The bits t_i = [a >= K_i] are a thermometer (K sorted), so their count c (the code magnitude, which
//    e2m1_codes8_keys assembles as c2 = t_3, c1 = (t_1 & !t_3) | t_5, c0 = parity) is also found by binary
//    search: c2 = t_3; c1 = [a >= (c2 ? K_5 : K_1)]; c0 = [a >= K_{4 c2 + 2 c1}]  (c >= 4 <=> t_3, and within the
//    half chosen by c2 the same argument on two and then one key). Each half of a pair chooses its own keys:
//    the per-half choice is a LOP3 select under a mask that prmt makes from bit 15 / 31 of the previous
//    difference (selector 0xBB99: bytes 1, 1, 3, 3 sign-replicated -> 0x0000 or 0xFFFF per half).
//  * The three difference words d3, d1, d0 then carry c2, c1, c0 in bits 15 and 31 exactly as the planes
//    m2, m1, m0 of e2m1_codes8_keys (their other bits differ, and the placement reads only bits 15 / 31), so
//    the prmt placement that follows is e2m1_codes8_keys<true>'s own.
// Mirrored in reference.rs (packed_e2m1_mirror::codes8_bsearch) and compared with codes8 / codes8_prmt for
// every BF16 bit pattern in each half against sorted key sets from a sweep of scales and random sorted keys.
__device__ __forceinline__ uint32_t codes8_bsearch(const uint32_t (&pk)[4], const uint32_t (&keys)[7]) {
    uint32_t x[3][4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const uint32_t a = pk[p] | 0x80008000u;
        const uint32_t d3 = a - keys[3];
        const uint32_t m2 = prmt_b32(d3, 0u, 0xBB99u);
        const uint32_t k1 = (keys[5] & m2) | (keys[1] & ~m2);
        const uint32_t d1 = a - k1;
        const uint32_t m1 = prmt_b32(d1, 0u, 0xBB99u);
        const uint32_t khi = (keys[6] & m2) | (keys[2] & ~m2);  // c1 = 1: K_6 or K_2
        const uint32_t klo = (keys[4] & m2) | (keys[0] & ~m2);  // c1 = 0: K_4 or K_0
        const uint32_t d0 = a - ((khi & m1) | (klo & ~m1));
        x[0][p] = d0; x[1][p] = d1; x[2][p] = d3;
    }
    uint32_t out = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const uint32_t* xj = j < 3 ? x[j] : pk;
        out |= (prmt_b32(xj[0], xj[2], 0xFBD9u) & (0x01010101u << j)) |
               (prmt_b32(xj[1], xj[3], 0xFBD9u) & (0x10101010u << j));
    }
    return out;
}

// resident_block_sum / the FP8 kernel's block max (a runtime loop over the warps) with the warp count NW known: the same tree, the same warp-order sum from 0.f.
// red must be 16-byte aligned with at least 4 * ceil(NW / 4) floats (the buffers hold MAX_WARPS).
template <int NW>
__device__ __forceinline__ void read_warp_partials(const float* red, float (&r)[(NW + 3) / 4 * 4]) {
#pragma unroll
    for (int q = 0; q < (NW + 3) / 4; ++q) {
        const float4 t = reinterpret_cast<const float4*>(red)[q];
        r[4 * q] = t.x; r[4 * q + 1] = t.y; r[4 * q + 2] = t.z; r[4 * q + 3] = t.w;
    }
}

// The block sum (kMax = false: the warp partials added in warp order from 0.f) and the block max (kMax = true: their
// fmaxf from 0.f) of the resident NVFP4 kernels: one barrier, one read of the partials.
template <int NW, bool kMax>
__device__ __forceinline__ float static_block_reduce(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = kMax ? warp_max(v) : warp_sum(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float r[(NW + 3) / 4 * 4];
    read_warp_partials<NW>(red, r);
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) s = kMax ? fmaxf(s, r[w]) : s + r[w];
    return s;
}

// resident_norm_pairs with D = 1024 NW, blockDim = 32 NW fixed.
// Takes the row already unpacked to f32 (nvfp4_row_bsearch unpacks, then reuses the load registers for the next row).
template <int NW, bool NORM>
__device__ __forceinline__ void static_norm_pairs(const float (&x)[RESIDENT_CH][8], const float4* wsm, float eps, float* red_ss,
                                              float* rstd_out, uint32_t (&pk)[RESIDENT_CH][4]) {
    constexpr int D = 1024 * NW, BD = 32 * NW, NCHUNKS = D / 8;
    if (!NORM) {
#pragma unroll
        for (int k = 0; k < RESIDENT_CH; ++k)
#pragma unroll
            for (int p = 0; p < 4; ++p) pk[k][p] = pack_bf16x2(x[k][p], x[k][p + 4]);
        return;
    }
    float ss = 0.f;  // the resident FP8 kernel's order: chunks k = 0..3, elements 0..7
#pragma unroll
    for (int k = 0; k < RESIDENT_CH; ++k)
#pragma unroll
        for (int e = 0; e < 8; ++e) ss = fmaf(x[k][e], x[k][e], ss);
    ss = static_block_reduce<NW, false>(ss, red_ss);
    // D = 2^k: ss * 2^-k is the IEEE ss / D (see the section header); 1.f / D is exact then.
    constexpr bool POW2 = (NW & (NW - 1)) == 0;
    const float mean = POW2 ? __fmul_rn(ss, 1.f / (float)D) : __fdiv_rn(ss, (float)D);
    const float rstd = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(mean, eps)));
    if (threadIdx.x == 0 && rstd_out) *rstd_out = rstd;
#pragma unroll
    for (int k = 0; k < RESIDENT_CH; ++k) {
        const int c = threadIdx.x + k * BD;
        const float4 wa = wsm[c], wb = wsm[NCHUNKS + c];
        const float wlo[4] = {wa.x, wa.y, wa.z, wa.w}, whi[4] = {wb.x, wb.y, wb.z, wb.w};
#pragma unroll
        for (int p = 0; p < 4; ++p)
            pk[k][p] = pack_bf16x2(__fmul_rn(wlo[p], __fmul_rn(x[k][p], rstd)),
                                   __fmul_rn(whi[p], __fmul_rn(x[k][p + 4], rstd)));
    }
}

// Non-finite scale (non-finite input): the row loop's per-element search. Not inlined: inline,
// ptxas if-converted it into ~130 predicated FSETP / SEL per block that every block then issued.
__device__ __noinline__ uint2 codes16_nonfinite(uint32_t l0, uint32_t l1, uint32_t l2, uint32_t l3, uint32_t h0,
                                                   uint32_t h1, uint32_t h2, uint32_t h3, float b0, float b1, float b2,
                                                   float b3, float b4, float b5, float b6) {
    // scalars, not arrays by reference: the call then needs no stack (references made ptxas store the arrays
    // to local memory before the branch, on the hot path)
    const uint32_t lo[4] = {l0, l1, l2, l3}, hi[4] = {h0, h1, h2, h3};
    const E2m1Thresholds thr = {{b0, b1, b2, b3, b4, b5, b6}};
    uint2 cw = make_uint2(0u, 0u);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        cw.x |= e2m1_code_thr(bf16_lo(lo[p]), thr) << (4 * p);
        cw.x |= e2m1_code_thr(bf16_hi(lo[p]), thr) << (4 * (p + 4));
        cw.y |= e2m1_code_thr(bf16_lo(hi[p]), thr) << (4 * p);
        cw.y |= e2m1_code_thr(bf16_hi(hi[p]), thr) << (4 * (p + 4));
    }
    return cw;
}

// One NVFP4 16-block of the resident kernels with the binary-search encoder.
__device__ __forceinline__ uint8_t nvfp4_block_bsearch(const uint32_t (&lo)[4], const uint32_t (&hi)[4], uint32_t kb,
                                                  float gs, uint2& cw) {
    const float ab = __uint_as_float((kb & 0x7FFFu) << 16);
    const uint8_t s = mm::nvfp4_block_scale(ab, gs);
    const float scale = __fmul_rn(mm::e4m3_decode(s), gs);
    cw = make_uint2(0u, 0u);
    if (scale != 0.f) {  // scale 0: every code is 0 (formats rule)
        const E2m1Thresholds thr = e2m1_thresholds_fma(scale);
        if (scale < INFINITY) {
            uint32_t keys[7];
#pragma unroll
            for (int i = 0; i < 7; ++i) keys[i] = bf16_key_ru_x2(thr.b[i]);
            cw.x = codes8_bsearch(lo, keys);
            cw.y = codes8_bsearch(hi, keys);
        } else {
            cw = codes16_nonfinite(lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3], thr.b[0], thr.b[1],
                                      thr.b[2], thr.b[3], thr.b[4], thr.b[5], thr.b[6]);
        }
    }
    return s;
}

// One row of rmsnorm_nvfp4_rows_resident (the loop body): unpacks row `row` from `raw` to f32, issues the loads of
// row + gridDim.x into `raw` (in flight during this row), then normalizes and quantizes the row with the
// reduction buffers of its parity.
template <int NW, bool NORM>
__device__ __forceinline__ void nvfp4_row_bsearch(const __nv_bfloat16* __restrict__ x, const float4* wsm,
                                             uint8_t* __restrict__ q, uint8_t* __restrict__ scales,
                                             float* __restrict__ gsa, float* __restrict__ rstd, int rows, float eps,
                                             long row, uint4 (&raw)[RESIDENT_CH], float* red_ss,
                                             float* red_mx) {
    constexpr int D = 1024 * NW, BD = 32 * NW;
    const int tid = threadIdx.x;
    const bool odd = (tid & 1) != 0;
    float xf[RESIDENT_CH][8];
#pragma unroll
    for (int k = 0; k < RESIDENT_CH; ++k) {
        xf[k][0] = bf16_lo(raw[k].x); xf[k][1] = bf16_hi(raw[k].x); xf[k][2] = bf16_lo(raw[k].y); xf[k][3] = bf16_hi(raw[k].y);
        xf[k][4] = bf16_lo(raw[k].z); xf[k][5] = bf16_hi(raw[k].z); xf[k][6] = bf16_lo(raw[k].w); xf[k][7] = bf16_hi(raw[k].w);
    }
    // issued after the unpack, into the same registers: no copy of 16 registers per row
    if (row + gridDim.x < rows) resident_load_row(x, row + gridDim.x, D, raw);
    uint32_t pk[RESIDENT_CH][4];
    static_norm_pairs<NW, NORM>(xf, wsm, eps, red_ss, rstd ? rstd + row : nullptr, pk);
    uint32_t key[RESIDENT_CH];
    uint32_t row_key = 0x8000u;
#pragma unroll
    for (int k = 0; k < RESIDENT_CH; ++k) {
        const uint32_t m = max_u16x2(max_u16x2(pk[k][0] | 0x80008000u, pk[k][1] | 0x80008000u),
                                     max_u16x2(pk[k][2] | 0x80008000u, pk[k][3] | 0x80008000u));
        key[k] = max(m & 0xFFFFu, m >> 16);
        row_key = max(row_key, key[k]);
    }
    const float amax_row = static_block_reduce<NW, true>(__uint_as_float((row_key & 0x7FFFu) << 16), red_mx);
    const float gs = mm::nvfp4_global_scale(amax_row);
    if (tid == 0) gsa[row] = gs;
    uint8_t* qrow = q + row * (D / 2);
    uint8_t* srow = scales + row * (D / 16);
#pragma unroll
    for (int kp = 0; kp < RESIDENT_CH; kp += 2) {
        // even lane = block of chunk k = kp, odd lane = block of k = kp + 1 (halves swapped over xor 1)
        uint32_t other[4];
#pragma unroll
        for (int p = 0; p < 4; ++p) other[p] = __shfl_xor_sync(0xffffffffu, odd ? pk[kp][p] : pk[kp + 1][p], 1);
        const uint32_t okey = __shfl_xor_sync(0xffffffffu, odd ? key[kp] : key[kp + 1], 1);
        uint32_t lo[4], hi[4];
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            lo[p] = odd ? other[p] : pk[kp][p];
            hi[p] = odd ? pk[kp + 1][p] : other[p];
        }
        const uint32_t kb = max(odd ? key[kp + 1] : key[kp], okey);
        uint2 cw;
        const uint8_t s = nvfp4_block_bsearch(lo, hi, kb, gs, cw);
        const uint32_t blk = (uint32_t)(tid >> 1) + (uint32_t)(kp + (odd ? 1 : 0)) * (BD >> 1);  // unsigned: no
        // sign extension to hoist (signed, ptxas kept 64-bit offsets live across the row and spilled them at NW = 7)
        *reinterpret_cast<uint2*>(qrow + blk * 8) = cw;
        srow[blk] = s;
    }
}

// The resident NVFP4 row loop with D = 1024 NW. Grid: one resident wave (or rows if fewer); block 32 NW; dynamic smem
// D * 4 bytes (NORM). The row is unpacked to f32 before the next row's loads reuse its registers (no copy of the
// prefetch registers); unrolling the loop by two over two buffers would spill under the 64-register cap.
template <int NW, bool NORM>
__device__ __forceinline__ void rmsnorm_nvfp4_rows_resident(const __nv_bfloat16* __restrict__ x,
                                                      const __nv_bfloat16* __restrict__ w, uint8_t* __restrict__ q,
                                                      uint8_t* __restrict__ scales, float* __restrict__ gsa,
                                                      float* __restrict__ rstd, int rows, float eps) {
    constexpr int D = 1024 * NW, NCHUNKS = D / 8;
    extern __shared__ float4 resident_wsm[];
    __shared__ __align__(16) float red_ss[2][MAX_WARPS];
    __shared__ __align__(16) float red_mx[2][MAX_WARPS];  // by row parity
    uint4 raw[RESIDENT_CH];
    long row = blockIdx.x;
    if (row < rows) resident_load_row(x, row, D, raw);
    if (NORM) {
        resident_stage_weight(w, resident_wsm, NCHUNKS);
        __syncthreads();
    }
    for (int it = 0; row < rows; row += gridDim.x, ++it)
        nvfp4_row_bsearch<NW, NORM>(x, resident_wsm, q, scales, gsa, rstd, rows, eps, row, raw, red_ss[it & 1],
                               red_mx[it & 1]);
}

}  // namespace

// Resident NVFP4 entry points (launchers: RowsPath::ResidentNvfp4, quantize_bf16_rows_resident_nvfp4): x [rows, 1024 NW]
// BF16; block 32 NW; dynamic shared memory D * 4 bytes (quantize-only: 0). 64 registers: the resident FP8 kernel's cap (its
// __launch_bounds__(1024)), so the same CTAs per SM (uncapped, ptxas took 72 at NW = 4: 7 instead of 8 CTAs).
#define NQ_RESIDENT_NVFP4_ENTRIES(NW)                                                                                          \
    extern "C" __global__ void __maxnreg__(64) rmsnorm_nvfp4_bf16in_resident_nw##NW(                          \
        const __nv_bfloat16* x, const __nv_bfloat16* w, uint8_t* q, uint8_t* scales, float* gsa, float* rstd,      \
        int rows, float eps) {                                                                                     \
        rmsnorm_nvfp4_rows_resident<NW, true>(x, w, q, scales, gsa, rstd, rows, eps);                                    \
    }                                                                                                              \
    extern "C" __global__ void __maxnreg__(64) quant_nvfp4_bf16in_resident_nw##NW(                            \
        const __nv_bfloat16* x, uint8_t* q, uint8_t* scales, float* gsa, int rows) {                               \
        rmsnorm_nvfp4_rows_resident<NW, false>(x, nullptr, q, scales, gsa, nullptr, rows, 0.f);                          \
    }
NQ_RESIDENT_NVFP4_ENTRIES(1)
NQ_RESIDENT_NVFP4_ENTRIES(2)
NQ_RESIDENT_NVFP4_ENTRIES(3)
NQ_RESIDENT_NVFP4_ENTRIES(4)
NQ_RESIDENT_NVFP4_ENTRIES(5)
NQ_RESIDENT_NVFP4_ENTRIES(6)
NQ_RESIDENT_NVFP4_ENTRIES(7)
NQ_RESIDENT_NVFP4_ENTRIES(8)
#undef NQ_RESIDENT_NVFP4_ENTRIES

// ---- entry points ------------------------------------------------------------------------------------------------
// One-CTA-per-row kernels run roundup32(D / 32) threads, 1024 at the largest D (32,768), so they must fit in 64
// registers. ptxas takes <= 64 for most of them unasked; rmsnorm_{nvfp4,bf16}_f32in and rmsnorm_nvfp4_bf16in took
// 66-68 (a 1024-thread launch then fails with too many resources above D 28,672), so those three carry
// __launch_bounds__(kRowMaxThreads) (62-63 registers, no spills). The others need no cap.
constexpr int kRowMaxThreads = 1024;
// RMSNorm rows, one CTA per row: grid (rows), block roundup32(ceil(D/8/4)); x [rows, D], w [D] BF16, rstd [rows]
// (may be null). BF16 -> NVFP4 runs rmsnorm_nvfp4_bf16in_row_loop / _resident_nw* where they fit; rmsnorm_nvfp4_bf16in
// covers the D above the row-loop limit (25,600 < D <= 32,768: a row-loop CTA of D/32 threads at 80 registers does not fit
// on one SM), the same template as the f32-input kernel and the same bits as the row loop (both follow the CPU quantizer).

extern "C" __global__ void rmsnorm_fp8_bf16in(const __nv_bfloat16* x, const __nv_bfloat16* w, uint8_t* q, uint8_t* scales,
                                        float* rstd, int D, float eps) {
    pdl_trigger();  // a PDL-launched successor (the decode GEMV) stages its weights meanwhile
    rmsnorm_rows<__nv_bfloat16, KIND_FP8, true>(x, w, q, scales, nullptr, nullptr, rstd, D, eps);
}
extern "C" __global__ void rmsnorm_bf16_bf16in(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, float* rstd,
                                         int D, float eps) {
    rmsnorm_rows<__nv_bfloat16, KIND_BF16, true>(x, w, nullptr, nullptr, nullptr, y, rstd, D, eps);
}

extern "C" __global__ void __launch_bounds__(kRowMaxThreads) rmsnorm_nvfp4_bf16in(const __nv_bfloat16* x, const __nv_bfloat16* w, uint8_t* q,
                                           uint8_t* scales, float* gsa, float* rstd, int D, float eps) {
    rmsnorm_rows<__nv_bfloat16, KIND_NVFP4, true>(x, w, q, scales, gsa, nullptr, rstd, D, eps);
}
extern "C" __global__ void __launch_bounds__(kRowMaxThreads) rmsnorm_nvfp4_f32in(const float* x, const __nv_bfloat16* w, uint8_t* q, uint8_t* scales,
                                          float* gsa, float* rstd, int D, float eps) {
    rmsnorm_rows<float, KIND_NVFP4, true>(x, w, q, scales, gsa, nullptr, rstd, D, eps);
}
extern "C" __global__ void rmsnorm_fp8_f32in(const float* x, const __nv_bfloat16* w, uint8_t* q, uint8_t* scales,
                                        float* rstd, int D, float eps) {
    rmsnorm_rows<float, KIND_FP8, true>(x, w, q, scales, nullptr, nullptr, rstd, D, eps);
}
extern "C" __global__ void __launch_bounds__(kRowMaxThreads) rmsnorm_bf16_f32in(const float* x, const __nv_bfloat16* w, __nv_bfloat16* y, float* rstd,
                                         int D, float eps) {
    rmsnorm_rows<float, KIND_BF16, true>(x, w, nullptr, nullptr, nullptr, y, rstd, D, eps);
}

// Row-loop kernels: grid = one full resident wave (launcher: occupancy x SMs, or rows if fewer), rows
// looped. The BF16 -> NVFP4 path of rmsnorm_quant / quantize_bf16_rows. Capped registers (ptxas alone takes
// ~96-123, mostly to hold the prefetched row next to the current one): the fused kernel at 80 (24 warps per SM;
// at 72 it spills 8 bytes), the quantize-only kernel at 72 (28 warps). 0 spill bytes at these caps.
#define ROW_LOOP_QUANT_MAX_REGS 72
#define ROW_LOOP_NVFP4_MAX_REGS 80
// The row loop with the packed-pair NVFP4 encoder, prmt code placement and FMA thresholds.
extern "C" __global__ void __maxnreg__(ROW_LOOP_NVFP4_MAX_REGS) rmsnorm_nvfp4_bf16in_row_loop(const __nv_bfloat16* x,
        const __nv_bfloat16* w, uint8_t* q, uint8_t* scales, float* gsa, float* rstd, int rows, int D, float eps) {
    rmsnorm_rows_loop<__nv_bfloat16, KIND_NVFP4, true, true>(x, w, q, scales, gsa, rstd, rows, D, eps);
}
// Quantize-only row-loop NVFP4 (BF16 rows in): the unfused chain's NVFP4 quantizer and the encoder's exact-boundary
// GPU test; same grid rule.
extern "C" __global__ void __maxnreg__(ROW_LOOP_QUANT_MAX_REGS) quant_nvfp4_bf16in_row_loop(const __nv_bfloat16* x, uint8_t* q,
                                                                         uint8_t* scales, float* gsa, int rows, int D) {
    rmsnorm_rows_loop<__nv_bfloat16, KIND_NVFP4, false, true>(x, nullptr, q, scales, gsa, nullptr, rows, D, 0.f);
}

// Stand-alone FP8 quantizer of BF16 rows (the second kernel of the unfused baseline chain; its NVFP4
// counterpart is quant_nvfp4_bf16in_row_loop).
extern "C" __global__ void quant_fp8_bf16in(const __nv_bfloat16* x, uint8_t* q, uint8_t* scales, int D) {
    pdl_trigger();  // a PDL-launched successor (the decode GEMV) stages its weights meanwhile
    rmsnorm_rows<__nv_bfloat16, KIND_FP8, false>(x, nullptr, q, scales, nullptr, nullptr, nullptr, D, 0.f);
}
// Stand-alone NVFP4 quantizer of BF16 rows, one CTA per row: the unfused chain's quantizer above the row-loop D limit.
extern "C" __global__ void quant_nvfp4_bf16in(const __nv_bfloat16* x, uint8_t* q, uint8_t* scales, float* gsa, int D) {
    rmsnorm_rows<__nv_bfloat16, KIND_NVFP4, false>(x, nullptr, q, scales, gsa, nullptr, nullptr, D, 0.f);
}
