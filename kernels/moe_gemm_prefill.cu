// NVFP4 MoE grouped GEMM, PREFILL path (many tokens per expert) on Hopper wgmma (sm_90a).
// Computes the same fp32 partial sums as kernels/moe_gemm.cu with one K split:
//   partial[row, n] = sum_k A[row, k] * B[e(row), n, k]      (no global scales; the finish kernels apply them)
// so the existing finish kernels (plain BF16, L1 SwiGLU + NVFP4 quant, L2 combine) run unchanged after it.
// Contiguous grouping only (tokens sorted by expert, offsets[E+1]); the decode kernel keeps the masked layout.
//
// Two mainloop designs live here: the SS kernels (this header; both wgmma operands from shared memory, the fallback
// for shapes the RS kernel does not take) and the RS kernels (own header further down; weights dequantized in
// registers; the routed one reads the weights' tiling, moe_gemm_prefill_partial_rs_wtma_tiled).
//
// Design (SS)
// -----------
// * CTA tile: 128 tokens (wgmma M; two consumer warp groups of 64 rows each) x 128 weight rows (wgmma N) x K.
//   K advances in stages of 64 (one 128-byte BF16 row segment = exactly one 128B-swizzle atom width).
//   Per stage and warp group: 4 x `wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16`, both operands from
//   shared memory through matrix descriptors, fp32 accumulators in registers (64 per thread).
//   Second entry `moe_gemm_prefill_partial_n256`: 128 x 256 tile, m64n256k16, 128 accumulators per thread
//   (half the A-operand shared-memory reads and barriers per FLOP; 187 KB of shared memory). Bench variant
//   (faster than 128 x 128 at every H200 prefill point). Both SS entries are the fallback: the launcher routes every
//   shape with N % 256 == 0 and K % 128 == 0 to an RS mainloop (PrefillKernel::default_for in prefill.rs).
//   Why this design is not the routed one: the shared-memory traffic of the BF16 B tile (~155 KB per 64-K stage
//   written then read) bounds it, not the barriers (a warp-specialized form moving the dequant off the wgmma
//   warps did not help).
// * Producer = all 256 threads, through cp.async into a 4-slot ring of RAW stages (prefetch distance 3 stages):
//   weight codes (128 rows x 32 B) + e4m3 block scales (128 rows x 4 B) -- 4x fewer bytes than BF16 -- and A:
//   BF16 A goes straight into its swizzled BF16 tile (ring of 4 tiles); NVFP4 A goes to the raw ring as well.
// * Dequant step (all threads, while the tensor cores run the previous stage): raw NVFP4 -> BF16 tile in the
//   128B-swizzled K-major layout. e2m1 * s_e4m3 is exact in BF16 (<= 5 significant bits, DESIGN.md §3).
//   Bit trick (same identity as kernels/moe_gemm.cu, proven there): for a 32-bit word w of 8 codes (nibble i =
//   element i), v = w << (12 - 4i); (v & 0x80008000) | ((v >> 6) & 0x01C001C0) is the bf16x2 (element i low,
//   element i+4 high) equal to e2m1 * 2^-126 each; `mul.rn.bf16x2` by bf16(s * 2^117) gives e2m1 * s * 2^-9
//   exactly. Two `prmt` per output word then restore natural K order ((x0,x1),(x2,x3),(x4,x5),(x6,x7)), which
//   wgmma needs (unlike the mma.sync kernel, whose activations are stored permuted). A CPU mirror of this
//   natural-order dequant is tested exhaustively in src/ops/moe_gemm/prefill.rs.
//   The accumulators therefore hold sum * 2^-9 (BF16 A) or sum * 2^-18 (NVFP4 A, dequantized by the same
//   code); the epilogue multiplies by 2^9 / 2^18, exact in fp32 (power of two, no overflow or underflow for
//   the value ranges of e2m1 * e4m3 and of activations above ~2^-100).
// * Shared-memory operand layout (128B swizzle, K-major), for a tile of R rows x 64 bf16:
//   byte offset of (row r, 16-byte chunk c in 0..8) = r * 128 + ((c ^ (r & 7)) << 4); tiles are 1024-aligned.
//   This is the canonical SWIZZLE_128B K-major atom (8 rows x 128 B; 16-byte chunk index XOR row mod 8, i.e.
//   address bits [4,7) ^= bits [7,10)); a CPU mirror (prefill.rs tests) checks it is a bijection on the tile.
// * Matrix descriptor (64 bit; PTX ISA "asynchronous warpgroup level matrix shared memory layout: matrix
//   descriptor"; same fields as CUTLASS GmmaDescriptor in cute/arch/mma_sm90_desc.hpp, also listed in the Mojo
//   WGMMADescriptor docs): bits 0-13 start address >> 4, bits 16-29 leading-dimension byte offset >> 4,
//   bits 32-45 stride-dimension byte offset >> 4, bits 49-51 base offset (0: tiles 1024-byte aligned),
//   bits 62-63 swizzle mode (1 = 128B). For K-major 128B swizzle the LBO is unused (set to 1, as CUTLASS
//   does) and the SBO is the distance between 8-row core-matrix groups = 8 * 128 B = 1024 B. The k-th K=16
//   slice of a 64-wide atom starts 32 * k bytes further (start address + 2k in descriptor units): the hardware
//   applies the XOR swizzle to the full address, which is why the tiles must be 1024-byte aligned.
// * Accumulator fragment of m64nNk16 (PTX ISA figure "WGMMA .m64nNk16 register fragment layout for
//   accumulator D"): thread t of the warp group, warp w = t / 32, lane l: d[4j + {0,1}] is row 16w + l/4,
//   columns 8j + 2(l%4) + {0,1}; d[4j + {2,3}] is row 16w + l/4 + 8, same columns.
// * Synchronization per stage s (one __syncthreads pipeline, no warp specialization):
//     issue cp.async for stage s+3 into ring slot (s+3)%4 (that slot's last reader, stage s-1, finished);
//     wgmma.fence; 4 wgmma on stage s tiles; commit;
//     cp.async.wait_group 2 (stage s+1 landed); __syncthreads; dequant stage s+1 -> other B tile (and A tile);
//     fence.proxy.async (generic-proxy smem writes -> visible to the async proxy that wgmma reads through);
//     wgmma.wait_group 0; __syncthreads.
//   The dequant of stage s+1 overlaps the tensor-core work of stage s.
// * Persistent grid over work items (expert token tile of 128, n tile of 128), n tile fastest so that
//   concurrent CTAs share one A token tile and walk one expert's weights once.
//
// Budget (per CTA stage: 128 x 128 x 64 MACs = 1 Mi MAC = ~1024 tensor cycles at 1024 bf16 FMA/clk/SM):
// dequant 8 Ki weights (16 Ki with NVFP4 A) at ~7 ALU ops per pair = ~230 issue cycles over 4 schedulers,
// 16-32 KB of st.shared (~128-256 cycles), wgmma smem reads 48 KB (~384 cycles): all below the MMA time, so
// the loop should be tensor-bound apart from the exposed barrier + wait gap between stages (~10-15%).
// Global bytes per stage: 4.5 KB weights + 16 KB BF16 A (L2 hits: one A tile is shared by all n tiles).
#include "common/formats.cuh"
#include "common/expert_tiles.cuh"
#include "common/wgmma.cuh"
#include "common/cp_async.cuh"
#include "common/tma.cuh"
#include "common/nvfp4_dequant.cuh"

namespace {

constexpr int kThreads = 256;      // 2 consumer warp groups
constexpr int kTileM = 128;        // tokens per CTA tile
static_assert(kTileM == 128, "locate_item / token_tile_prefix assume 128-row token tiles");
constexpr int kStageK = 64;        // K per stage
constexpr int kRing = 4;           // raw/A ring depth (prefetch distance kRing - 1)
constexpr int kMaxExperts = 512;

constexpr int kTileBytes = kTileM * kStageK * 2;   // 16 KiB: one 128-row BF16 tile
constexpr int kRawCodes = 128 * kStageK / 2;       // 4 KiB of codes per 128 rows
constexpr int kRawScales = 128 * kStageK / 16;     // 512 B of block scales per 128 rows

// Shared-memory layout for a CTA tile of TN weight rows (128 or 256): A ring (kRing BF16 tiles of 128 rows),
// 2 BF16 B tiles of TN rows, kRing raw stages (B codes, B scales, A codes, A scales).
template <int TN>
struct Layout {
    static constexpr int kBTile = TN * kStageK * 2;
    static constexpr int kRawBCodes = TN / 128 * kRawCodes;
    static constexpr int kRawBScales = TN / 128 * kRawScales;
    static constexpr int kRawA = kRawBCodes + kRawBScales;
    static constexpr int kRawStage = kRawA + kRawCodes + kRawScales;
    static constexpr int kA = 0;
    static constexpr int kB = kA + kRing * kTileBytes;
    static constexpr int kRaw = kB + 2 * kBTile;
    static constexpr int kBytes = kRaw + kRing * kRawStage;  // + 1024 alignment slack requested by the host
};
// prefill.rs SMEM_BYTES / SMEM_BYTES_N256 must equal these + 1024; an H200 CTA may opt in to 227 KiB.
static_assert(Layout<128>::kBytes + 1024 == 136192, "keep src/ops/moe_gemm/prefill.rs SMEM_BYTES in sync");
static_assert(Layout<256>::kBytes + 1024 == 187392, "keep src/ops/moe_gemm/prefill.rs SMEM_BYTES_N256 in sync");


// cp_async16 / cp_async_commit / cp_async_wait<N>: common/cp_async.cuh.
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, uint32_t src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}


// D(64 x 128, fp32) += A(64 x 16, bf16, smem desc) * B(128 x 16, bf16, smem desc)^T; both K-major (trans 0).
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(1));
}

// D(64 x 256, fp32) += A(64 x 16) * B(256 x 16)^T, same operand conventions as the n128 form.
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(1));
}

template <int TN>
__device__ __forceinline__ void wgmma_tile(float (&d)[TN / 2], uint64_t da, uint64_t db) {
    if constexpr (TN == 128) wgmma_m64n128k16(d, da, db);
    else wgmma_m64n256k16(d, da, db);
}

// sw128_offset (byte of (row, 16-byte chunk) in a 128B-swizzled K-major tile): common/wgmma.cuh.


// 8 codes (one word, nibble i = element i) times one block scale -> 8 BF16 (e2m1 * s * 2^-9) in natural order.
__device__ __forceinline__ uint4 dequant8(uint32_t w, uint32_t s2) {
    const uint32_t p0 = bf16x2_mul(e2m1_pair_to_bf16x2_tiny(w, 0), s2);  // (x0, x4)
    const uint32_t p1 = bf16x2_mul(e2m1_pair_to_bf16x2_tiny(w, 1), s2);  // (x1, x5)
    const uint32_t p2 = bf16x2_mul(e2m1_pair_to_bf16x2_tiny(w, 2), s2);  // (x2, x6)
    const uint32_t p3 = bf16x2_mul(e2m1_pair_to_bf16x2_tiny(w, 3), s2);  // (x3, x7)
    uint4 o;
    o.x = __byte_perm(p0, p1, 0x5410);  // (x0, x1)
    o.y = __byte_perm(p2, p3, 0x5410);  // (x2, x3)
    o.z = __byte_perm(p0, p1, 0x7632);  // (x4, x5)
    o.w = __byte_perm(p2, p3, 0x7632);  // (x6, x7)
    return o;
}

// Raw NVFP4 stage (128 rows x 32 B codes, 128 rows x 4 scale bytes) -> 128 x 64 BF16 swizzled tile.
// Thread t handles row t/2, K half t%2 (32 elements = 16 code bytes, 2 block scales, 4 output chunks).
__device__ __forceinline__ void dequant_tile(const uint8_t* raw_codes, const uint8_t* raw_scales, uint8_t* tile) {
    const uint32_t row = threadIdx.x >> 1, h = threadIdx.x & 1;
    const uint4 c = *reinterpret_cast<const uint4*>(raw_codes + row * 32 + h * 16);
    const uint32_t sc = *reinterpret_cast<const uint16_t*>(raw_scales + row * 4 + h * 2);
    const uint32_t s0 = scale_bf16x2(sc & 0xFF), s1 = scale_bf16x2(sc >> 8);
    const uint32_t words[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const uint4 o = dequant8(words[j], j < 2 ? s0 : s1);
        *reinterpret_cast<uint4*>(tile + sw128_offset(row, 4 * h + j)) = o;
    }
}


// ---- Work items shared by the prefill mainloops: (expert token tile of 128 rows, n tile), n tile fastest ----------
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

// Mainloop for a CTA tile of 128 tokens x TN weight rows (see the header). TN = 256 halves the A tile reads
// per MMA and the barrier count per FLOP at the cost of 128 accumulator registers per thread.
template <int TN>
__device__ __forceinline__ void prefill_body(
    const uint8_t* __restrict__ w_codes, const uint8_t* __restrict__ w_scales, int N, int K,
    const void* __restrict__ act, const uint8_t* __restrict__ act_scales, int act_is_nvfp4,
    const int* __restrict__ offsets, int experts, int rows_total, float* __restrict__ partial) {
    using L = Layout<TN>;
    extern __shared__ uint8_t smem_raw[];
    __shared__ int s_tile_prefix[kMaxExperts + 1];
    __shared__ int s_warp_sum[kThreads / 32];

    uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
    const int tid = threadIdx.x, lane = tid & 31;
    const int E = experts;

    token_tile_prefix<kThreads>(offsets, E, rows_total, s_warp_sum, s_tile_prefix);

    const int n_tiles = N / TN;
    const long long items = (long long)s_tile_prefix[E] * n_tiles;
    const int stages = K / kStageK;
    const size_t codes_row = (size_t)K / 2, scales_row = (size_t)K / 16;
    // Accumulators hold sum * 2^-9 per dequantized operand (see the header).
    const float restore = act_is_nvfp4 ? 0x1p18f : 0x1p9f;

    const int wg = tid >> 7;                  // warp group: token rows [64 wg, 64 wg + 64)
    const uint32_t smem_base = smem_u32(smem);

    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        const TileItem it = locate_item(item, n_tiles, s_tile_prefix, E, offsets, rows_total);
        const int n_tile = it.n_tile, e = it.e, row0 = it.row0, ntok = it.ntok;
        const int n0 = n_tile * TN;
        const uint8_t* b_codes = w_codes + ((size_t)e * N + n0) * codes_row;
        const uint8_t* b_scales = w_scales + ((size_t)e * N + n0) * scales_row;

        // Producer: stage st -> ring slot st % kRing (always commits one group, possibly empty).
        auto issue_stage = [&](int st) {
            if (st < stages) {
                const int slot = st % kRing;
                const uint32_t raw = smem_base + L::kRaw + slot * L::kRawStage;
#pragma unroll
                for (int i = 0; i < TN / 128; ++i) {  // weight codes: row tid/2 + 128 i, half tid%2
                    const int r = (tid >> 1) + 128 * i, h = tid & 1;
                    cp_async16(raw + r * 32 + h * 16, b_codes + r * codes_row + st * 32 + h * 16, 16);
                }
                if (tid < TN) {
                    cp_async4(raw + L::kRawBCodes + tid * 4, b_scales + tid * scales_row + st * 4, 4);
                }
                if (!act_is_nvfp4) {
                    const __nv_bfloat16* a = reinterpret_cast<const __nv_bfloat16*>(act);
                    const uint32_t tile = smem_base + L::kA + slot * kTileBytes;
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int q = tid + kThreads * i;
                        const int r = q >> 3, c = q & 7;
                        const bool ok = r < ntok;
                        const size_t grow = (size_t)(row0 + (ok ? r : 0));
                        cp_async16(tile + sw128_offset(r, c), a + grow * K + st * kStageK + c * 8, ok ? 16 : 0);
                    }
                } else {
                    const uint8_t* a = reinterpret_cast<const uint8_t*>(act);
                    const uint32_t rawa = raw + L::kRawA;
                    const int r = tid >> 1, h = tid & 1;
                    const bool ok = r < ntok;
                    const size_t grow = (size_t)(row0 + (ok ? r : 0));
                    cp_async16(rawa + r * 32 + h * 16, a + grow * codes_row + st * 32 + h * 16, ok ? 16 : 0);
                    if (tid >= 128) {
                        const int r2 = tid - 128;
                        const bool ok2 = r2 < ntok;
                        const size_t grow2 = (size_t)(row0 + (ok2 ? r2 : 0));
                        cp_async4(rawa + kRawCodes + r2 * 4, act_scales + grow2 * scales_row + st * 4, ok2 ? 4 : 0);
                    }
                }
            }
            cp_async_commit();
        };
        auto dequant_stage = [&](int st) {
            const int slot = st % kRing;
            const uint8_t* raw = smem + L::kRaw + slot * L::kRawStage;
            // Rows 128 i + r of a TN-row tile sit 16 KiB * i further: (128 i + r) & 7 == r & 7, same swizzle.
#pragma unroll
            for (int i = 0; i < TN / 128; ++i) {
                dequant_tile(raw + i * kRawCodes, raw + L::kRawBCodes + i * kRawScales,
                             smem + L::kB + (st & 1) * L::kBTile + i * kTileBytes);
            }
            if (act_is_nvfp4) {
                const uint8_t* rawa = raw + L::kRawA;
                dequant_tile(rawa, rawa + kRawCodes, smem + L::kA + slot * kTileBytes);
            }
            fence_proxy_async();
        };

        float d[TN / 2];
#pragma unroll
        for (int i = 0; i < TN / 2; ++i) d[i] = 0.f;

        // Prologue: kRing - 1 stages in flight, stage 0 dequantized.
#pragma unroll
        for (int st = 0; st < kRing - 1; ++st) issue_stage(st);
        cp_async_wait<kRing - 2>();
        __syncthreads();
        dequant_stage(0);
        __syncthreads();

        for (int st = 0; st < stages; ++st) {
            issue_stage(st + kRing - 1);
            const uint32_t a_tile = smem_base + L::kA + (st % kRing) * kTileBytes + wg * (64 * 128);
            const uint32_t b_tile = smem_base + L::kB + (st & 1) * L::kBTile;
            const uint64_t da = sw128_desc(a_tile), db = sw128_desc(b_tile);
            fence_acc(d);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kStageK / 16; ++kk) {
                // +32 bytes per K=16 slice = +2 in the 16-byte units of the start-address field.
                wgmma_tile<TN>(d, da + 2 * kk, db + 2 * kk);
            }
            wgmma_commit();
            if (st + 1 < stages) {
                cp_async_wait<kRing - 2>();  // this thread's copies for stage st + 1 have landed
                __syncthreads();             // ... and everyone's
                dequant_stage(st + 1);
            }
            wgmma_wait_all();
            fence_acc(d);
            __syncthreads();  // stage st + 1 tiles complete; stage st tiles free for reuse
        }

        // Epilogue: fp32 partial sums (scale restored), rows < ntok only.
        const int wl = (tid & 127) >> 5;
        const int r_lo = wg * 64 + wl * 16 + (lane >> 2);
#pragma unroll
        for (int j = 0; j < TN / 8; ++j) {
            const int col = n0 + 8 * j + 2 * (lane & 3);
            if (r_lo < ntok) {
                *reinterpret_cast<float2*>(partial + (size_t)(row0 + r_lo) * N + col) =
                    make_float2(d[4 * j] * restore, d[4 * j + 1] * restore);
            }
            if (r_lo + 8 < ntok) {
                *reinterpret_cast<float2*>(partial + (size_t)(row0 + r_lo + 8) * N + col) =
                    make_float2(d[4 * j + 2] * restore, d[4 * j + 3] * restore);
            }
        }
    }
}

// grid = persistent (<= number of work items is fine; extra CTAs exit), block = 256, dynamic smem =
// Layout<TN>::kBytes + 1024. N % TN == 0, K % 64 == 0, 1 <= experts <= 512 (checked by the launcher).
// offsets[E+1]: contiguous grouping (clamped to [0, rows_total] on the device so a bad value cannot fault).
// partial: [rows_total, N] fp32; rows owned by no expert are not written.
#define MOE_GEMM_PREFILL_ENTRY(NAME, TN)                                                                          \
    extern "C" __global__ void __launch_bounds__(kThreads, 1) NAME(                                             \
        const uint8_t* __restrict__ w_codes, const uint8_t* __restrict__ w_scales, int N, int K,                 \
        const void* __restrict__ act, const uint8_t* __restrict__ act_scales, int act_is_nvfp4,                 \
        const int* __restrict__ offsets, int experts, int rows_total, float* __restrict__ partial) {           \
        prefill_body<TN>(w_codes, w_scales, N, K, act, act_scales, act_is_nvfp4, offsets, experts, rows_total,  \
                         partial);                                                                               \
    }

MOE_GEMM_PREFILL_ENTRY(moe_gemm_prefill_partial, 128)
MOE_GEMM_PREFILL_ENTRY(moe_gemm_prefill_partial_n256, 256)

// =====================================================================================================================
// RS mainloop (`moe_gemm_prefill_partial_rs_tma`, the fallback for K % 256 != 0): weights dequantized
// IN REGISTERS as the wgmma A operand; activations pre-permuted once (`moe_gemm_prefill_act_rs`) and fed by TMA.
// =====================================================================================================================
// Why: the SS mainloop above writes every dequantized BF16 weight tile to shared memory and reads it back through
// wgmma; with the A tile, the raw stages and the cp.async traffic that is ~150 KB of shared-memory traffic per
// 1024 tensor cycles (~146 B/clk against the 128 B/clk an SM's shared memory delivers), so the tensor cores wait
// (Nsight: HGMMA 1.7% of the stall samples; short_sb, dequant issue and weight loads dominate).
// Here the roles swap (as in the decode kernel): weight rows are the wgmma M dimension and come from REGISTERS
// (`wgmma ... {a0..a3}, b-desc`: the RS form), tokens are the wgmma N dimension and come from shared memory. The
// weights never touch shared memory (16-byte ld.global.nc straight into registers, one 128-K stage ahead, exactly
// as the decode kernel loads them); the B operand (tokens) is 64 B/clk of shared-memory reads at the full rate.
//
// * CTA tile: 256 weight rows (2 warp groups x 2 m64 blocks) x 128 tokens (m64n128k16, 2 x 64 fp32 accumulators
//   per thread) x K in stages of 128 (two 128B-swizzle atoms of 64 K).
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
// * Numerics: identical rounding points to the SS kernel (products exact: e2m1 * s * 2^-9 per dequantized operand,
//   fp32 accumulation; the epilogue multiplies by 2^18 (NVFP4 A) or 2^9 (BF16 A), exact), only the fp32 summation
//   order differs.
// * Budget per CTA stage: 256 x 128 x 128 MAC = 4 Mi MAC at 2048 BF16 MAC/clk/SM (H200 dense BF16 peak) = 2048
//   tensor cycles. SASS per warp and stage: ~520 (64 HMUL2 + ~190 integer ops of the e2m1 trick for 64 weight
//   pairs, 8 scale decodes, 16 HGMMA with their fences / waits, loads, ring protocol): ~1040 issue cycles per
//   scheduler (2 warps) per 2048 tensor cycles. HBM: 16 KB of weight codes + 1 KB scales per CTA stage.
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

// This thread's weights of 128-K stage st: rows g and g+8 of both m64 blocks (64 rows apart), 16 code bytes each
// at the lane's 32-K slice, and their two block scales. `wc` / `ws` point at row g of block 0, lane offset included.
__device__ __forceinline__ void load_weights(WStage& w, const uint8_t* wc, const uint8_t* ws, size_t codes_row,
                                             size_t scales_row, int st) {
#pragma unroll
    for (int mb = 0; mb < 2; ++mb) {
        const size_t r = (size_t)64 * mb;
        w.lo[mb] = ldg_stream(wc + r * codes_row + st * 64);
        w.hi[mb] = ldg_stream(wc + (r + 8) * codes_row + st * 64);
        w.sc[mb] = ldg_u16(ws + r * scales_row + st * 8) | (ldg_u16(ws + (r + 8) * scales_row + st * 8) << 16);
    }
}

// L2 prefetch of the bytes load_weights(.., st) will read (codes of the 4 rows, their scale bytes): no registers.
__device__ __forceinline__ void prefetch_weights_l2(const uint8_t* wc, const uint8_t* ws, size_t codes_row,
                                                    size_t scales_row, int st) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // rows g, g+8, g+64, g+72
        const size_t row = (size_t)(r >> 1) * 64 + (r & 1) * 8;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(wc + row * codes_row + st * 64) : "memory");
        asm volatile("prefetch.global.L2 [%0];" ::"l"(ws + row * scales_row + st * 8) : "memory");
    }
}

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
// token tile (rs_tma); 32 / 64 / 96: the narrow tiles of rs_wtma (same fragments, same order).
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
// f % 4; its full barrier (count 1: the producer's arrive.expect_tx of 32 KiB) completes phase f / 4; the empty
// barrier (count 8: lane 0 of every warp after wgmma.wait_group 0 of the stage; 256 in rs_wtma_tiled, where every
// thread arrives) must have completed phase f / 4 - 1 before fill f reuses the slot. Thread 0 produces and
// consumes; its empty-wait is for the consumption one stage back, which it finished itself, so the protocol cannot
// deadlock.
namespace rs {
constexpr int kRingT = 4;

// Thread 0: the ring's full barriers (count 1: the producer's arrive.expect_tx) and empty barriers (count 8: lane 0 of
// every warp), made visible to the async proxy. The caller's next __syncthreads publishes them to the CTA.
// kEmptyArrivals: arrivals that complete a phase of an empty barrier: one per consumer warp (lane 0 after a
// __syncwarp), or one per thread for the all-lane release of rs_wtma_tiled (256 << the mbarrier's 2^20 - 1).
template <int kEmptyArrivals = kThreads / 32>
__device__ __forceinline__ void ring_init(uint64_t* full, uint64_t* empty) {
    static_assert(kEmptyArrivals >= 1 && kEmptyArrivals < (1 << 20), "mbarrier expected count is 20 bits");
    if (threadIdx.x == 0) {
        for (int s = 0; s < kRingT; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], kEmptyArrivals);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // inits visible to the async proxy
    }
}
constexpr int kBytesT = kRingT * kActTile;  // 128 KiB (+ 1024 alignment slack from the host)
static_assert(kBytesT + 1024 == 132096, "keep src/ops/moe_gemm/prefill.rs SMEM_BYTES_RS_TMA in sync");
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
// Values are produced by the same helpers on the same inputs as before (e2m1_pair_to_bf16x2_tiny, bf16x2_mul,
// the scale decode of scale_bf16x2; BF16: the same byte_perm selectors), so the output bytes are unchanged.
// Why the transpose: one task = (row, chunk, j) per thread, the four 16-byte chunks 4j .. 4j + 3 from one thread):
// 124 us under ncu at 24,576 rows x K 4096 NVFP4 (~2.1 TB/s); each of its STG.128 wrote 16 B at a 64-byte lane
// stride (half of every 32-byte sector per instruction), one dependent load -> store chain per thread, and a 64-bit
// division per thread (its 32-bit path, ~20 instructions). SASS per lane and 64 output bytes (NVFP4 / BF16): 196 / 96
// then, 192 / 124 now (the transpose's 3 SHFL + 8 SEL per chunk replace the division and most address math), 36 ->
// 32 registers (6 -> 8 CTAs per SM).
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

// grid = persistent, block = 256, dynamic smem = rs::kBytesT + 1024. act_map: 2D tensor map over the pre-pass
// output [rows_total][K] BF16 (inner dim K), box 64 x 128 rows, SWIZZLE_128B. restore = 2^18 (NVFP4 A) or 2^9
// (BF16 A): the accumulators hold sum * 2^-9 per dequantized operand. N % 256 == 0, K % 128 == 0.
// Weight loads: registers one stage ahead, and an L2 prefetch (prefetch.global.L2, no registers held) kL2Ahead
// stages ahead, so that the register load finds them in L2. Why: without it 31% of the warp-stall samples sit on
// the first use of each stage's weight registers (long_sb): one 128-K stage (~1 us) does not hide an HBM load under
// this load (with the prefetch the mainloop at Flash L1 4096 went 2.32 -> 2.12 ms under ncu).
extern "C" __global__ void __launch_bounds__(rs::kThreads, 1) moe_gemm_prefill_partial_rs_tma(
    const uint8_t* __restrict__ w_codes, const uint8_t* __restrict__ w_scales, int N, int K,
    const __grid_constant__ TmaDesc act_map, float restore, const int* __restrict__ offsets, int experts,
    int rows_total, float* __restrict__ partial) {
    constexpr int kL2Ahead = 2;
    extern __shared__ uint8_t rs_tma_smem_raw[];
    __shared__ int s_tile_prefix[kMaxExperts + 1];
    __shared__ int s_warp_sum[rs::kThreads / 32];
    __shared__ __align__(8) uint64_t bar_full[rs::kRingT], bar_empty[rs::kRingT];

    uint8_t* ring = rs_tma_smem_raw + ((1024u - (smem_u32(rs_tma_smem_raw) & 1023u)) & 1023u);
    const uint32_t ring_base = smem_u32(ring);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, wq = warp & 3;
    const int g = lane >> 2, t = lane & 3;
    const int E = experts;
    rs::ring_init(bar_full, bar_empty);
    token_tile_prefix<rs::kThreads>(offsets, E, rows_total, s_warp_sum, s_tile_prefix);  // also publishes inits

    const int n_tiles = N / rs::kTileRows;
    const long long items = (long long)s_tile_prefix[E] * n_tiles;
    const int stages = K / rs::kStageK;
    const size_t codes_row = (size_t)K / 2, scales_row = (size_t)K / 16;
    uint32_t fills = 0, cons = 0;  // ring counters (fills: thread 0 only; cons: CTA-uniform)

    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        const TileItem it = locate_item(item, n_tiles, s_tile_prefix, E, offsets, rows_total);
        const int n_tile = it.n_tile, e = it.e, row0 = it.row0, ntok = it.ntok;
        const int wrow0 = n_tile * rs::kTileRows + 128 * wg + 16 * wq + g;
        const uint8_t* wc = w_codes + ((size_t)e * N + wrow0) * codes_row + 16 * t;
        const uint8_t* ws = w_scales + ((size_t)e * N + wrow0) * scales_row + 2 * t;

        // Producer (thread 0): stage st of this item -> the next ring slot. Both boxes start 16-byte aligned
        // (x = 128 st and 128 st + 64 elements).
        bool ok = true;
        auto fill = [&](int st) {
            const uint32_t slot = fills % rs::kRingT;
            if (fills >= (uint32_t)rs::kRingT &&
                !mbar_wait(&bar_empty[slot], ((fills / rs::kRingT) - 1) & 1u)) {
                ok = false;
                return;
            }
            mbar_arrive_expect_tx(&bar_full[slot], rs::kActTile);
            tma_load_2d(ring + slot * rs::kActTile, &act_map, st * rs::kStageK, row0, &bar_full[slot]);
            tma_load_2d(ring + slot * rs::kActTile + rs::kAtomBytes, &act_map, st * rs::kStageK + 64, row0,
                        &bar_full[slot]);
            ++fills;
        };
        if (tid == 0) {
            for (int st = 0; st < rs::kRingT - 1 && st < stages; ++st) fill(st);
        }
        __syncwarp();

        rs::WStage w_cur, w_next;
        rs::load_weights(w_cur, wc, ws, codes_row, scales_row, 0);
        float d[2][64];
#pragma unroll
        for (int mb = 0; mb < 2; ++mb)
#pragma unroll
            for (int i = 0; i < 64; ++i) d[mb][i] = 0.f;

        for (int st = 0; st < stages; ++st) {
            if (tid == 0 && st + rs::kRingT - 1 < stages) fill(st + rs::kRingT - 1);
            __syncwarp();
            if (st + 1 < stages) rs::load_weights(w_next, wc, ws, codes_row, scales_row, st + 1);
            if (st + kL2Ahead < stages) rs::prefetch_weights_l2(wc, ws, codes_row, scales_row, st + kL2Ahead);
            const uint32_t slot = cons % rs::kRingT;
            if (!mbar_wait(&bar_full[slot], (cons / rs::kRingT) & 1u)) return;  // protocol timeout: outputs unwritten
            const uint64_t db = sw128_desc(ring_base + slot * rs::kActTile);
#pragma unroll
            for (int S = 0; S < 8; ++S) rs::mma_slice_n<128>(d, w_cur, S, db);
            rs::wgmma_wait<0>();  // this warp group's reads of the slot are done
            if (lane == 0) mbar_arrive(&bar_empty[slot]);
            ++cons;
            w_cur = w_next;
        }
        if (tid == 0 && !ok) return;
        fence_acc(d[0]);
        fence_acc(d[1]);
        rs::store_partials_n<128>(d, partial, N, row0, ntok, wrow0, t, restore);
    }
}

// =====================================================================================================================
// RS mainloop with the weights in the TMA ring too and narrow token tiles (`moe_gemm_prefill_partial_rs_wtma`,
// PrefillKernel::RsWtma: routed for weights without their tiling).
// =====================================================================================================================
// Why: the profile of the RS kernel put 31% of its warp-stall samples on the first use of each stage's
// weight registers (long_sb) and 5.5% on the end-of-stage wgmma.wait_group 0. The register double buffer holds one
// stage (~1-2 us) of weights in flight, which does not cover an HBM load under this load; the L2 prefetch two
// stages ahead removed only part of it (2.32 -> 2.12 ms). Here each ring slot carries, beside the stage's two
// activation atoms, the stage's weight codes and block scales, loaded by the same producer thread with TMA three
// stages ahead and counted by the same full barrier; the weights then come from shared memory (LDS into the very
// registers the RS kernel loaded from global memory: same fragments, same wgmma order, bit-identical partials).
// * Slot layout (53,248 B, a multiple of 1024 so every activation atom stays 1024-aligned for the 128B swizzle):
//   [0, 32 KiB) the activation atoms (as in rs_tma); [32 KiB, 48 KiB) codes of the tile's 256 weight rows for this
//   stage, row r at 64 r (box 64 B x 256 rows of the [E*N][K/2] byte tensor, no swizzle); [48 KiB, 52 KiB) the block
//   scales of the stage PAIR (st & ~1, st | 1), row r at 16 r (box 16 B x 256 rows of the [E*N][K/16] byte tensor:
//   a TMA box row must be a multiple of 16 bytes and one stage has only 8 scale bytes per row, so each slot loads
//   its pair and reads half; the duplicate 4 KiB per stage is an L2 hit). Needs K % 256 == 0 (the scale tensor's
//   row pitch K/16 must be a multiple of 16 bytes), so the stage count is even and every pair lies in bounds.
// * Bank conflicts: a warp's LDS.128 of codes covers rows g = 0..7 (64 B apart) x 16 B at 16 t = 512 contiguous
//   bytes (4 wavefronts, the minimum); its u16 scale loads fall in one 128-byte span (one wavefront).
// * Slot release one stage later: a consumer warp arrives on a slot's empty barrier after the FIRST slice of the
//   next stage, whose wgmma.wait_group 1 guarantees that every wgmma of the previous stage has completed (its
//   activation reads are done; its weight LDS were consumed before its own slices). So the wgmma pipe is not drained
//   at every stage end (rs_tma: wait_group 0 per stage); only the last stage of a work item waits for 0.
// * Producer: thread 0 fills stages 0..2 of an item at its start and stage st + 3 after the slices of stage st. The
//   fill three consumptions ahead reuses the slot of the consumption one before the current one, released by every
//   warp after slice 0 of the current stage (or, at an item start, after the previous item's wait_group 0): thread
//   0 has passed that point itself, and no warp needs thread 0 to get there (the current stage was filled earlier),
//   so the wait cannot deadlock. The counters run on across items (fills / consumptions per CTA, same order).
// * Budget of one 128-K stage per SM (one CTA per SM), n128 item: 256 x 128 x 128 MAC = 2048 tensor cycles at the
//   dense BF16 rate; ~520 SASS per warp (the e2m1 dequant of 64 weight pairs, 8 scale decodes, 16 HGMMA with their
//   fences / waits, 8 LDS, the ring protocol), 8 warps on 4 schedulers = ~1040 issue cycles; 20 KiB of weights from
//   HBM and 2 x NT x 128 B of activations (mostly L2 hits: the 16 n tiles of a token tile run close together). An
//   n32 item has a quarter of the tensor cycles and the same weight bytes and dequant issue, so below ~1000 tokens
//   the issue and the weight stream, not the tensor pipe, set the pace. Measured (ncu, Flash L1 4096):
//   ~1.5 us per stage (~2900 cycles at ~1.9 GHz) against the 2048 of a full tile: tensor pipe 70% of elapsed cycles,
//   issue slots ~35% busy, and ~15% of the warp-stall samples on the full-barrier wait of a stage (its TMA bytes
//   not there yet), which neither a producer running ahead across items nor smaller activation boxes removed.
namespace rs {
constexpr int kWCodes = kTileRows * 64;                       // 16 KiB of codes per stage
constexpr int kWScales = kTileRows * 16;                      // 4 KiB: scale bytes of the stage pair
constexpr int kTiledBlock = kWCodes + kTileRows * 8;          // 18 KiB: a pre-tiled stage (codes, its own scales)
static_assert(kTiledBlock == 18432, "keep src/ops/moe_gemm/prefill.rs TILED_BLOCK_BYTES in sync");
constexpr int kSlotW = kActTile + kWCodes + kWScales;         // 52 KiB
constexpr int kBytesW = kRingT * kSlotW;                      // 208 KiB (+ 1024 alignment slack from the host)
static_assert(kSlotW % 1024 == 0, "activation atoms must stay 1024-byte aligned");
static_assert(kBytesW + 1024 == 214016, "keep src/ops/moe_gemm/prefill.rs SMEM_BYTES_RS_WTMA in sync");

// This thread's weights of the stage in ring slot `slot` (local tile row `lrow` = 128 wg + 16 wq + g): the same
// registers load_weights fills from global memory.
// kTiled (weights pre-tiled, rs_wtma_tiled): the slot's scale rows hold this stage's 8 bytes only (pitch 8).
template <bool kTiled = false>
__device__ __forceinline__ void lds_weights(WStage& w, const uint8_t* slot, int lrow, int t, int st) {
    const uint8_t* codes = slot + kActTile;
    const uint8_t* scales = slot + kActTile + kWCodes;
    constexpr int kScalePitch = kTiled ? 8 : 16;
#pragma unroll
    for (int mb = 0; mb < 2; ++mb) {
        const int r = lrow + 64 * mb;
        w.lo[mb] = *reinterpret_cast<const uint4*>(codes + r * 64 + 16 * t);
        w.hi[mb] = *reinterpret_cast<const uint4*>(codes + (r + 8) * 64 + 16 * t);
        const int so = (kTiled ? 0 : (st & 1) * 8) + 2 * t;
        w.sc[mb] = (uint32_t)*reinterpret_cast<const uint16_t*>(scales + r * kScalePitch + so) |
                   ((uint32_t)*reinterpret_cast<const uint16_t*>(scales + (r + 8) * kScalePitch + so) << 16);
    }
}

// The TMA ring of the wtma kernels as seen by one CTA (counters run on across its work items).
struct WRing {
    uint8_t* base;
    uint32_t base_u32;
    uint64_t* full;
    uint64_t* empty;
    uint32_t fills, cons;  // fills: thread 0 only; cons: CTA-uniform
    bool ok;               // thread 0: false after a timed-out empty wait (its fills stop)
};

// Producer (thread 0): stage st of the item (token rows from row0, weight rows from wtile) -> the next ring slot.
// act_map's box holds act_rows token rows (two boxes of act_rows x 128 bytes: the expected transaction bytes).
// kTiled: `wtile` is the tile's index in the pre-tiled weights (x.tiled): stage st of it is one contiguous block of
// kTiledBlock bytes (the slot's codes image, then this stage's scale bytes), loaded by one 1D bulk copy.
template <bool kTiled = false>
__device__ __forceinline__ void wring_fill(WRing& r, const TmaDesc* act_map, uint32_t act_rows,
                                           const TmaDesc* codes_map, const TmaDesc* scales_map,
                                           const uint8_t* tiled, int stages, int st, int row0, int wtile) {
    const uint32_t slot = r.fills % kRingT;
    if (r.fills >= (uint32_t)kRingT && !mbar_wait(&r.empty[slot], ((r.fills / kRingT) - 1) & 1u)) {
        r.ok = false;
        return;
    }
    uint8_t* s = r.base + slot * kSlotW;
    mbar_arrive_expect_tx(&r.full[slot], 2u * act_rows * 128u + (kTiled ? kTiledBlock : kWCodes + kWScales));
    tma_load_2d(s, act_map, st * kStageK, row0, &r.full[slot]);
    tma_load_2d(s + kAtomBytes, act_map, st * kStageK + 64, row0, &r.full[slot]);
    if constexpr (kTiled) {
        bulk_load_1d(s + kActTile, tiled + ((size_t)wtile * stages + st) * kTiledBlock, kTiledBlock, &r.full[slot]);
    } else {
        tma_load_2d(s + kActTile, codes_map, st * 64, wtile, &r.full[slot]);
        tma_load_2d(s + kActTile + kWCodes, scales_map, (st & ~1) * 8, wtile, &r.full[slot]);
    }
    ++r.fills;
}

// Kernel-wide constants of the wtma kernel. act[i]: the activation tensor map with a box of 32 (i + 1) token rows (an
// item of NT-token wgmmas loads only the NT rows they read).
struct WCtx {
    const TmaDesc* act[4];
    const TmaDesc* codes;
    const TmaDesc* scales;
    const uint8_t* tiled;  // rs_wtma_tiled only
    int N, stages;
};

// One work item with NT-token wgmmas (the ring protocol of the section header). False on a protocol timeout
// (outputs of the item unwritten). The activation boxes hold NT token rows (2 x NT x 128 bytes per stage instead of
// 32 KiB), at the same smem offsets (the first NT rows of each 128-row atom: rows 128 B apart, 8-row
// groups 1024 B apart, the same swizzle pattern), which are the only rows an NT-token wgmma reads.
// kLaneRelease (rs_wtma_tiled; empty barriers initialized with kThreads arrivals): every lane arrives on the empty
// barrier itself instead of lane 0 for its warp. Same ordering on the hardware (the __syncwarp stays); it makes
// racecheck see each lane's reads released (see moe_gemm_prefill_partial_rs_wtma_tiled).
template <int NT, bool kTiled = false, bool kLaneRelease = false>
__device__ __forceinline__ bool wtma_item(WRing& r, const WCtx& x, int row0, int ntok, int wtile, int wrow0,
                                          int lrow, float* __restrict__ partial, float restore) {
    const int tid = threadIdx.x, lane = tid & 31, t = lane & 3;
    const int stages = x.stages;
    const TmaDesc* act = x.act[NT / 32 - 1];
    constexpr uint32_t kActRows = NT;
    if (tid == 0 && r.ok) {
        for (int st = 0; st < kRingT - 1 && st < stages && r.ok; ++st)
            wring_fill<kTiled>(r, act, kActRows, x.codes, x.scales, x.tiled, stages, st, row0, wtile);
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
        lds_weights<kTiled>(w, r.base + slot * kSlotW, lrow, t, st);
        const uint64_t db = sw128_desc(r.base_u32 + slot * kSlotW);
        mma_slice_n<NT>(d, w, 0, db);
        // wait_group 1 inside slice 0: every wgmma of the previous stage has completed -> release its slot.
        if (st > 0 && (kLaneRelease || lane == 0)) mbar_arrive(&r.empty[(r.cons - 1) % kRingT]);
#pragma unroll
        for (int S = 1; S < 8; ++S) mma_slice_n<NT>(d, w, S, db);
        ++r.cons;
        if (tid == 0 && r.ok && st + kRingT - 1 < stages)
            wring_fill<kTiled>(r, act, kActRows, x.codes, x.scales, x.tiled, stages, st + kRingT - 1, row0,
                               wtile);
        __syncwarp();
    }
    wgmma_wait<0>();
    if (timed_out) return false;
    if (kLaneRelease || lane == 0) mbar_arrive(&r.empty[(r.cons - 1) % kRingT]);  // the item's last stage
    if (tid == 0 && !r.ok) return false;
    fence_acc(d[0]);
    fence_acc(d[1]);
    store_partials_n<NT>(d, partial, x.N, row0, ntok, wrow0, t, restore);
    return true;
}
}  // namespace rs

// grid = persistent, block = 256, dynamic smem = rs::kBytesW + 1024. act_map as for rs_tma; w_codes_map: 2D map over
// the weight codes [E*N][K/2] bytes, box 64 x 256, no swizzle; w_scales_map: over the block scales [E*N][K/16]
// bytes, box 16 x 256, no swizzle. N % 256 == 0, K % 256 == 0.
// Narrow token tiles: an item whose token tile holds ntok <= 96 valid rows runs the wgmma with N = 32 ceil(ntok / 32)
// instead of 128. Why: at 4096 Flash tokens an expert has ~96 rows, so the 128-token tile spends ~25% of the MMA
// work on padding rows whose columns are never stored. Each output column's dot product is the same k16 sequence of
// the same operands at any N: bit-identical partials (GPU test against rs_tma).
// Narrow activation boxes: an NT-token item loads NT rows of the activation atoms per stage through the act32 ..
// act128 maps (28 / 36 / 44 / 52 KiB per stage instead of 52).
// kTiled: the weights come pre-tiled (`tiled`, moe_gemm_prefill_tile_weights_rs) instead of through the 2D maps.
// kLaneRelease: every thread arrives on the empty barriers (rs::wtma_item; rs_wtma_tiled).
template <bool kTiled, bool kLaneRelease = false>
__device__ __forceinline__ void rs_wtma_kernel(const TmaDesc* w_codes_map, const TmaDesc* w_scales_map,
                                               const uint8_t* tiled, int N, int K, const TmaDesc* act32,
                                               const TmaDesc* act64, const TmaDesc* act96, const TmaDesc* act128,
                                               float restore, const int* __restrict__ offsets, int experts,
                                               int rows_total, float* __restrict__ partial, uint8_t* smem_raw) {
    __shared__ int s_tile_prefix[kMaxExperts + 1];
    __shared__ int s_warp_sum[rs::kThreads / 32];
    __shared__ __align__(8) uint64_t bar_full[rs::kRingT], bar_empty[rs::kRingT];

    rs::WRing r;
    r.base = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
    r.base_u32 = smem_u32(r.base);
    r.full = bar_full;
    r.empty = bar_empty;
    r.fills = 0;
    r.cons = 0;
    r.ok = true;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int lrow = 128 * (warp >> 2) + 16 * (warp & 3) + (lane >> 2);
    const int E = experts;
    rs::ring_init<kLaneRelease ? rs::kThreads : rs::kThreads / 32>(bar_full, bar_empty);
    token_tile_prefix<rs::kThreads>(offsets, E, rows_total, s_warp_sum, s_tile_prefix);  // also publishes inits

    rs::WCtx x;
    x.act[0] = act32;
    x.act[1] = act64;
    x.act[2] = act96;
    x.act[3] = act128;
    x.codes = w_codes_map;
    x.scales = w_scales_map;
    x.tiled = tiled;
    x.N = N;
    x.stages = K / rs::kStageK;
    const int n_tiles = N / rs::kTileRows;
    const long long items = (long long)s_tile_prefix[E] * n_tiles;
    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        const TileItem it = locate_item(item, n_tiles, s_tile_prefix, E, offsets, rows_total);
        // 2D maps: the first weight row of the tile in [E*N]; pre-tiled: the tile's index (stages blocks each).
        const int wtile = kTiled ? it.e * n_tiles + it.n_tile : it.e * N + it.n_tile * rs::kTileRows;
        const int wrow0 = it.n_tile * rs::kTileRows + lrow;
        const int nt = (it.ntok + 31) & ~31;  // CTA-uniform
        bool ok;
        if (nt == 32)
            ok = rs::wtma_item<32, kTiled, kLaneRelease>(r, x, it.row0, it.ntok, wtile, wrow0, lrow, partial,
                                                         restore);
        else if (nt == 64)
            ok = rs::wtma_item<64, kTiled, kLaneRelease>(r, x, it.row0, it.ntok, wtile, wrow0, lrow, partial,
                                                         restore);
        else if (nt == 96)
            ok = rs::wtma_item<96, kTiled, kLaneRelease>(r, x, it.row0, it.ntok, wtile, wrow0, lrow, partial,
                                                         restore);
        else
            ok = rs::wtma_item<128, kTiled, kLaneRelease>(r, x, it.row0, it.ntok, wtile, wrow0, lrow, partial,
                                                          restore);
        if (!ok) return;
    }
}

// act32 .. act128: tensor maps over the pre-pass output with boxes of 64 K x 32 / 64 / 96 / 128 token rows.
extern "C" __global__ void __launch_bounds__(rs::kThreads, 1) moe_gemm_prefill_partial_rs_wtma(
    const __grid_constant__ TmaDesc w_codes_map, const __grid_constant__ TmaDesc w_scales_map, int N, int K,
    const __grid_constant__ TmaDesc act32, const __grid_constant__ TmaDesc act64,
    const __grid_constant__ TmaDesc act96, const __grid_constant__ TmaDesc act128, float restore,
    const int* __restrict__ offsets, int experts, int rows_total, float* __restrict__ partial) {
    extern __shared__ uint8_t rs_wtma_smem_raw[];
    rs_wtma_kernel<false>(&w_codes_map, &w_scales_map, nullptr, N, K, &act32, &act64, &act96, &act128, restore,
                          offsets, experts, rows_total, partial, rs_wtma_smem_raw);
}

// =====================================================================================================================
// rs_wtma on pre-tiled weights (`moe_gemm_prefill_partial_rs_wtma_tiled`: the routed prefill mainloop)
// =====================================================================================================================
// Why: rs_wtma loads each stage's weights with two 2D TMA boxes of 256 rows x 64 B (codes) and 256 rows x 16 B (the
// scale bytes of the stage pair): 512 row segments of 16-64 bytes, 2 KB apart in HBM, per stage and CTA. The
// profile of rs_wtma kept ~15% of the warp-stall samples on the full-barrier wait of a stage (its TMA bytes late)
// with DRAM at ~42% and L2 at ~55% of peak, so the suspect is the copy engine's per-row work and the scattered DRAM
// pages, not bytes. Here the weights are re-laid ONCE, at load (moe_gemm_prefill_tile_weights_rs, not timed), so that
// stage st of tile (e, n tile) is one contiguous 18 KiB block holding exactly the slot image the consumers read: the
// 256 code rows of 64 B, then the 256 rows of this stage's 8 scale bytes (pitch 8; the 2D form loads the pair's 16
// with pitch 16, a TMA row must be 16-byte multiple). One cp.async.bulk per stage. Same registers, same fragments,
// same wgmma order: bit-identical partials (GPU test). Layout: block ((e * N / 256 + n_tile) * K / 128 + st) at
// byte 18432 * block; inside, code byte c of row r at 64 r + c, scale byte j of row r at 16384 + 8 r + j.
// Routed (PrefillKernel::routed_for) whenever the weights carry the tiling. Every thread arrives on a ring slot's
// empty barrier (count 256), not lane 0 per warp after a __syncwarp (count 8; rs_wtma keeps that). Both orders are
// correct on the hardware (PTX: __syncwarp orders the warp's shared-memory reads before lane 0's release-arrive),
// but compute-sanitizer racecheck does not credit lanes 1-31's reads to lane 0's arrive; with the all-lane release
// it reports 0 hazards, for one more arrive per warp and stage.
extern "C" __global__ void __launch_bounds__(rs::kThreads, 1) moe_gemm_prefill_partial_rs_wtma_tiled(
    const uint8_t* __restrict__ tiled, int N, int K, const __grid_constant__ TmaDesc act32,
    const __grid_constant__ TmaDesc act64, const __grid_constant__ TmaDesc act96,
    const __grid_constant__ TmaDesc act128, float restore, const int* __restrict__ offsets, int experts,
    int rows_total, float* __restrict__ partial) {
    extern __shared__ uint8_t rs_wtma_smem_raw[];
    rs_wtma_kernel<true, true>(nullptr, nullptr, tiled, N, K, &act32, &act64, &act96, &act128, restore, offsets,
                               experts, rows_total, partial, rs_wtma_smem_raw);
}

// The re-layout of moe_gemm_prefill_partial_rs_wtma_tiled (weight preparation, once per weight set): codes [E*N][K/2]
// and scales [E*N][K/16] -> blocks of 18432 bytes as described there. One thread per 16-byte output unit: units
// 0..1023 of a block are code rows (unit u: row u / 4, bytes 16 (u % 4) of the stage's 64), units 1024..1151 scale
// row pairs (unit u: rows 2 (u - 1024) and + 1, 8 bytes each). N % 256 == 0, K % 128 == 0.
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
