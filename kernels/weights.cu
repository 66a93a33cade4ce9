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
