// Synthetic weights on the GPU: the stored bytes of elements [first, first + count) of one tensor of the
// synthetic checkpoint, written to `out` (byte 0 of `out` = byte 0 of element `first`). The CPU oracle is
// src/model/weights.rs (`synthetic_bytes`); every entry point here is its bit-exact twin for one
// (SyntheticInit, StoredDtype) pair, and tests/weights.rs compares them byte for byte. Launchers:
// src/ops/weights/mod.rs (which computes the per-tensor key `tensor_key(seed, name)` on the host).
//
// The hash (src/model/weights.rs):
//   splitmix64(z)         = mix64(z + G),  G = 0x9E3779B97F4A7C15
//   element_bits(key, i)  = splitmix64(key + i * G) = mix64(key + (i + 1) * G)
// so the mix64 inputs of consecutive elements differ by G: a thread walks its elements with one 64-bit add
// each instead of a multiply (identical in wrapping u64 arithmetic).
//   synthetic_uniform(b)  = ((b >> 40) as f32 + 0.5) / 2^23 - 1
//
// Float parity with the CPU: Rust never contracts a * b + c into an FMA, and every f32 operation there rounds
// to nearest even. nvcc contracts by default, so each float step here is an explicit `__fadd_rn` /
// `__fmul_rn` (never fused). The division by 2^23 is a multiplication by 2^-23: scaling by a power of two is
// exact for these normal values (>= 2^-24), so it equals the CPU's correctly rounded division. The CPU's
// `(b >> 40) as f32` converts a 24-bit integer, exact in both; `+ 0.5` rounds for values >= 2^23 (25
// significant bits), identically under round-to-nearest-even on both sides. BF16 rounding mirrors
// half::bf16::from_f32 in integer arithmetic (round to nearest even on the bit pattern; NaN quieted).
//
// Layout of the work: each thread produces one 16-byte chunk of `out` (16 / element-size elements) per
// grid-stride step and stores it with one 16-byte store when `out` is 16-byte aligned and the chunk is whole;
// otherwise (an unaligned `out`, the last partial chunk) byte by byte. Little-endian bytes, as stored.
#include <cstdint>

#include "common/formats.cuh"

namespace {

constexpr int kThreads = 256;
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

// The SplitMix64 finalizer after its initial add (splitmix64(z) = mix64(z + kGolden)).
__device__ __forceinline__ uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// element_bits(key, i) of src/model/weights.rs.
__device__ __forceinline__ uint64_t element_bits(uint64_t key, uint64_t i) {
    return mix64(key + (i + 1) * kGolden);
}

// synthetic_uniform: u in (-1, 1) from the top 24 bits (see the header for why each step matches the CPU).
__device__ __forceinline__ float synthetic_uniform(uint64_t bits) {
    const float x = static_cast<float>(static_cast<uint32_t>(bits >> 40));
    return __fadd_rn(__fmul_rn(__fadd_rn(x, 0.5f), 0x1p-23f), -1.0f);
}

// half::bf16::from_f32: NaN keeps its high mantissa with the quiet bit set; otherwise round to nearest even.
__device__ __forceinline__ uint32_t bf16_bits(float v) {
    const uint32_t x = __float_as_uint(v);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (x >> 16) | 0x0040u;
    const uint32_t round_bit = 0x8000u;
    return ((x & round_bit) != 0 && (x & (3 * round_bit - 1)) != 0) ? (x >> 16) + 1 : (x >> 16);
}

// Each element generator maps (tensor index i, element_bits(key, i)) to the stored little-endian value in the
// low kSize bytes of a u64.

// (Fp8Codes, F8E4M3): fp8_code(bits >> 56): the NaN codes 0x7F / 0xFF become 0x7E / 0xFE (±448).
struct Fp8Codes {
    static constexpr int kSize = 1;
    __device__ __forceinline__ uint64_t operator()(uint64_t, uint64_t bits) const {
        const uint32_t b = static_cast<uint32_t>(bits >> 56);
        return (b & 0x7Fu) == 0x7Fu ? (b ^ 1u) : b;
    }
};

// (Fp4Codes, I8): the byte (bits >> 56) holds two e2m1 codes (low nibble = even element along K).
struct Fp4Codes {
    static constexpr int kSize = 1;
    __device__ __forceinline__ uint64_t operator()(uint64_t, uint64_t bits) const { return bits >> 56; }
};

// (Scale, F8E8M0): 2^(exp_base - (bits & 1)) as a UE8M0 byte, exponent clamped to [-127, 127].
struct Ue8m0Scale {
    static constexpr int kSize = 1;
    int exp_base;
    __device__ __forceinline__ uint64_t operator()(uint64_t, uint64_t bits) const {
        const int e = exp_base - static_cast<int>(bits & 1);
        return static_cast<uint64_t>(min(max(e, -127), 127) + 127);
    }
};

// (Uniform, BF16): bf16(offset + amp * u); the product and the sum are rounded separately, as on the CPU.
struct Bf16Uniform {
    static constexpr int kSize = 2;
    float amp, offset;
    __device__ __forceinline__ uint64_t operator()(uint64_t, uint64_t bits) const {
        return bf16_bits(__fadd_rn(offset, __fmul_rn(amp, synthetic_uniform(bits))));
    }
};

// (Uniform, F32): offset + amp * u, product and sum rounded separately.
struct F32Uniform {
    static constexpr int kSize = 4;
    float amp, offset;
    __device__ __forceinline__ uint64_t operator()(uint64_t, uint64_t bits) const {
        return __float_as_uint(__fadd_rn(offset, __fmul_rn(amp, synthetic_uniform(bits))));
    }
};

// (HcBase, F32): amp * u, plus `diag` on the diagonal of the hc x hc Sinkhorn block that follows the 2 * hc
// pre/post entries (element 2hc + r with r / hc == r % hc).
struct F32HcBase {
    static constexpr int kSize = 4;
    uint64_t hc;
    float amp, diag;
    __device__ __forceinline__ uint64_t operator()(uint64_t i, uint64_t bits) const {
        float v = __fmul_rn(amp, synthetic_uniform(bits));
        if (i >= 2 * hc) {
            const uint64_t r = i - 2 * hc;
            if (r / hc == r % hc) v = __fadd_rn(v, diag);
        }
        return __float_as_uint(v);
    }
};

// (Tid2eid, I64) of shape [V, k]: element (row, col) = (element_bits(key, row * k) % E + col * step) % E with
// step = max(E / k, 1): the row's k experts are distinct when k <= E. The row hash is drawn at the row's first
// element, so it is recomputed here from the key (not the element's own bits).
struct I64Tid2eid {
    static constexpr int kSize = 8;
    uint64_t key, k, n_experts;
    __device__ __forceinline__ uint64_t operator()(uint64_t i, uint64_t) const {
        const uint64_t row = i / k, col = i % k;
        const uint64_t step = n_experts / k > 1 ? n_experts / k : 1;
        return (element_bits(key, row * k) % n_experts + col * step) % n_experts;
    }
};

template <typename Gen>
__device__ __forceinline__ void fill_slice(uint8_t* __restrict__ out, uint64_t first, uint64_t count,
                                           uint64_t key, const Gen gen) {
    constexpr int kSize = Gen::kSize;
    constexpr int kPer = 16 / kSize;  // elements per 16-byte chunk
    const uint64_t chunks = (count + kPer - 1) / kPer;
    const bool aligned = (reinterpret_cast<uintptr_t>(out) & 15u) == 0;
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    for (uint64_t c = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks; c += stride) {
        const uint64_t e0 = c * kPer;  // slice-relative first element of the chunk
        const uint64_t i0 = first + e0;
        uint64_t z = key + (i0 + 1) * kGolden;  // mix64 input of element i0 (header identity)
        uint64_t q[2] = {0ull, 0ull};          // the chunk's 16 bytes, little-endian
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
            const uint64_t v = gen(i0 + j, mix64(z));
            z += kGolden;
            const int byte = j * kSize;
            q[byte / 8] |= (kSize == 8 ? v : (v & ((1ull << (8 * kSize)) - 1))) << (8 * (byte % 8));
        }
        uint8_t* dst = out + e0 * kSize;
        const uint64_t valid = count - e0 < kPer ? count - e0 : kPer;
        if (aligned && valid == static_cast<uint64_t>(kPer)) {
            *reinterpret_cast<uint4*>(dst) =
                make_uint4(static_cast<uint32_t>(q[0]), static_cast<uint32_t>(q[0] >> 32),
                           static_cast<uint32_t>(q[1]), static_cast<uint32_t>(q[1] >> 32));
        } else {
            // Scalar selects, not q[n / 8]: a runtime index would put q in local memory.
            const uint64_t lo = q[0], hi = q[1];
            for (uint32_t n = 0; n < valid * kSize; ++n)
                dst[n] = static_cast<uint8_t>((n < 8 ? lo : hi) >> (8 * (n % 8)));
        }
    }
}

}  // namespace

// Every entry point: (out, first, count, key, <init parameters>); `key` = tensor_key(seed, name). The launcher
// checks first + count <= numel and that `out` holds count * element-size bytes.

extern "C" __global__ void __launch_bounds__(kThreads)
    weights_fill_fp8_codes(uint8_t* __restrict__ out, uint64_t first, uint64_t count, uint64_t key) {
    fill_slice(out, first, count, key, Fp8Codes{});
}

extern "C" __global__ void __launch_bounds__(kThreads)
    weights_fill_fp4_codes(uint8_t* __restrict__ out, uint64_t first, uint64_t count, uint64_t key) {
    fill_slice(out, first, count, key, Fp4Codes{});
}

extern "C" __global__ void __launch_bounds__(kThreads)
    weights_fill_ue8m0_scale(uint8_t* __restrict__ out, uint64_t first, uint64_t count, uint64_t key,
                             int exp_base) {
    fill_slice(out, first, count, key, Ue8m0Scale{exp_base});
}

extern "C" __global__ void __launch_bounds__(kThreads)
    weights_fill_bf16_uniform(uint8_t* __restrict__ out, uint64_t first, uint64_t count, uint64_t key,
                              float amp, float offset) {
    fill_slice(out, first, count, key, Bf16Uniform{amp, offset});
}

extern "C" __global__ void __launch_bounds__(kThreads)
    weights_fill_f32_uniform(uint8_t* __restrict__ out, uint64_t first, uint64_t count, uint64_t key,
                             float amp, float offset) {
    fill_slice(out, first, count, key, F32Uniform{amp, offset});
}

extern "C" __global__ void __launch_bounds__(kThreads)
    weights_fill_f32_hc_base(uint8_t* __restrict__ out, uint64_t first, uint64_t count, uint64_t key,
                             uint64_t hc, float amp, float diag) {
    fill_slice(out, first, count, key, F32HcBase{hc, amp, diag});
}

extern "C" __global__ void __launch_bounds__(kThreads)
    weights_fill_i64_tid2eid(uint8_t* __restrict__ out, uint64_t first, uint64_t count, uint64_t key,
                             uint64_t k, uint64_t n_experts) {
    fill_slice(out, first, count, key, I64Tid2eid{key, k, n_experts});
}

// =====================================================================================================================
// MXFP4 -> NVFP4 conversion of routed-expert weights (launcher: src/ops/weights/convert.rs). The CPU oracle is
// formats::mxfp4::to_nvfp4, matched bit for bit (tests/engine.rs):
// * input: `rows` rows of `cols` e2m1 codes, packed two a byte (low nibble = lower K index), and one ue8m0 scale per
//   32 along K (the checkpoint's I8 [out, in/2] and F8_E8M0 [out, in/32] tensors);
// * per row, E_max = the largest block exponent e (scale code - 127) among the 16-element halves that hold a nonzero
//   magnitude (code & 7 != 0); global scale G = 2^(E_max - 8), or 1.0 for a row without one;
// * each half keeps its codes and gets the e4m3 scale 2^t, t = e - E_max + 8 <= 8: e2m1 * 2^t * G = e2m1 * 2^e
//   exactly when 2^t is an e4m3 value, i.e. t >= -9 (e4m3's smallest subnormal 2^-9). A half of zero magnitudes
//   gets scale 0 (its codes, signed zeros, are kept);
// * a nonzero half with t < -9 is inexact: it is counted (counters[0]), gets the scale 2^-9 and each element is
//   re-rounded to e2m1_encode(e2m1 * 2^(t + 9)). The product is a power-of-two scaling of a value of at most two
//   significant bits: exact while normal; below f32's normal range it is far under e2m1's first threshold 0.25 and
//   encodes to a signed zero whether or not it is flushed, so the code equals the CPU's;
// * scale codes above 252 (NaN, or 6 * scale overflowing f32; Mxfp4Matrix::validate rejects them) are counted in
//   counters[1] per 32-block: the launcher's caller refuses such weights.
// One warp per row: pass 1 reduces E_max over the row's halves, pass 2 writes the halves. Codes move as 8-byte
// words (the launcher checks 8-byte alignment of both code buffers; cols % 32 == 0).
// =====================================================================================================================
namespace {

constexpr int kConvertWarps = 8;
constexpr int kNoExponent = -100000;  // below every block exponent (>= -127)
constexpr uint32_t kMagnitudeBits = 0x77777777u;  // the three magnitude bits of each of 8 packed codes

// formats::pow2_f32: the exact f32 2^n, subnormals included; 0 below 2^-149 (n <= 127 here).
__device__ __forceinline__ float pow2_exact(int n) {
    if (n >= -126) return __uint_as_float(static_cast<uint32_t>(n + 127) << 23);
    if (n >= -149) return __uint_as_float(1u << (n + 149));
    return 0.0f;
}

// Re-round the 8 codes of one 32-bit word by `factor` (the inexact path).
__device__ __forceinline__ uint32_t rescale_codes(uint32_t w, float factor) {
    uint32_t out = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const uint8_t c = static_cast<uint8_t>((w >> (4 * j)) & 0xFu);
        out |= static_cast<uint32_t>(mm::e2m1_encode(__fmul_rn(mm::e2m1_decode(c), factor))) << (4 * j);
    }
    return out;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kConvertWarps * 32)
    weights_mxfp4_to_nvfp4(const uint8_t* __restrict__ mx_codes, const uint8_t* __restrict__ mx_scales, int rows,
                           int cols, uint8_t* __restrict__ nv_codes, uint8_t* __restrict__ nv_scales,
                           float* __restrict__ global, unsigned long long* __restrict__ counters) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * kConvertWarps + (threadIdx.x >> 5);
    if (row >= rows) return;  // whole warps leave together: the shuffles below see full warps
    const int halves = cols / 16;
    const uint2* const in = reinterpret_cast<const uint2*>(mx_codes + static_cast<size_t>(row) * (cols / 2));
    const uint8_t* const sc = mx_scales + static_cast<size_t>(row) * (cols / 32);
    int e_max = kNoExponent;
    unsigned long long bad_scales = 0;
    for (int h = lane; h < halves; h += 32) {
        const uint2 w = in[h];
        const int code = sc[h / 2];
        if ((h & 1) == 0 && code > 252) ++bad_scales;
        if (((w.x | w.y) & kMagnitudeBits) != 0) e_max = max(e_max, code - 127);
    }
    e_max = __reduce_max_sync(0xffffffffu, e_max);
    uint2* const out = reinterpret_cast<uint2*>(nv_codes + static_cast<size_t>(row) * (cols / 2));
    uint8_t* const out_sc = nv_scales + static_cast<size_t>(row) * halves;
    const uint8_t smallest = mm::e4m3_encode(pow2_exact(-9));
    unsigned long long inexact = 0;
    for (int h = lane; h < halves; h += 32) {
        uint2 w = in[h];
        uint8_t s = 0;
        if (((w.x | w.y) & kMagnitudeBits) != 0) {
            const int t = static_cast<int>(sc[h / 2]) - 127 - e_max + 8;
            if (t >= -9) {
                s = mm::e4m3_encode(pow2_exact(t));
            } else {
                ++inexact;
                s = smallest;
                const float factor = pow2_exact(t + 9);
                w = make_uint2(rescale_codes(w.x, factor), rescale_codes(w.y, factor));
            }
        }
        out[h] = w;
        out_sc[h] = s;
    }
    if (lane == 0) global[row] = e_max == kNoExponent ? 1.0f : pow2_exact(e_max - 8);
    // Warp sums in 32 bits: a row has fewer than 2^27 halves, so they cannot overflow; the totals are u64.
    unsigned int ni = static_cast<unsigned int>(inexact), nb = static_cast<unsigned int>(bad_scales);
    ni = __reduce_add_sync(0xffffffffu, ni);
    nb = __reduce_add_sync(0xffffffffu, nb);
    if (lane == 0) {
        if (ni != 0) atomicAdd(counters, static_cast<unsigned long long>(ni));
        if (nb != 0) atomicAdd(counters + 1, static_cast<unsigned long long>(nb));
    }
}
