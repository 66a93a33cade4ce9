//! Prefill mainloop of the NVFP4 MoE grouped GEMM on Hopper wgmma (kernels/moe_gemm_prefill.cu).
//!
//! Same contract as [`super::launch_partial`] with one K split: it writes the fp32 accumulator
//! `partial[row, n] = sum_k A[row, k] * B[e(row), n, k]` (no global scales) into a [`Workspace`] with
//! `splits == 1`, so the finish kernels ([`super::launch_finish_bf16`], [`super::launch_finish_l1`],
//! [`super::launch_finish_l2`]) apply the epilogues unchanged. Contiguous grouping only (prefill: tokens sorted
//! by expert, offsets). The mainloop (`moe_gemm_prefill_rs_tiled`): 256 weight rows x up to 128 tokens, the
//! weights dequantized in registers as the wgmma A operand (RS form) from the weights' tiling
//! ([`super::DeviceExpertWeights::tiled`]: one contiguous block per 256-row tile and 128-K stage, made at upload by
//! [`tile_weights_for_rs`]; the decode mainloop reads it too), the activations pre-permuted once by a pre-pass
//! ([`permute_activations_for_rs`]) and both fed through one TMA ring, K stages of 128.
//!
//! [`super::launch_partial`] routes here when [`routes_here`] holds (contiguous layout, mean rows per
//! expert >= [`MIN_MEAN_ROWS_PER_EXPERT`], one K split); [`launch_partial_prefill`] forces this path.
//!
//! The CPU mirrors at the bottom ([`sw128_offset`], [`sw128_desc`], the RS index maps and the pre-pass) restate the
//! device address, descriptor and permutation logic so unit tests can check them without a GPU.

use anyhow::{ensure, Result};
use half::bf16;

use super::{
    as_i32, push_activations, DeviceActivations, DeviceExpertWeights, DeviceGrouping, GemmConfig,
    Workspace, MAX_EXPERTS,
};
use crate::formats::e4m3;
use crate::gpu::launch::{launch, DeviceBuf, KernelArgs, Launch, Stream};
use crate::gpu::tma::{encode_tiled, TensorMap};
use crate::gpu::Gpu;
use cudarc::driver::sys;
use cudarc::driver::CudaSlice;

/// Kernel family name (kernels/moe_gemm_prefill.cu).
pub const FAMILY: &str = "moe_gemm_prefill";
/// Most tokens per CTA tile (the wgmma N dimension; narrower tiles of 32 / 64 / 96 for experts with fewer rows).
pub const TILE_M: usize = 128;
/// Weight rows per CTA tile (2 warp groups x 2 m64 blocks): N must be a multiple of it.
pub const TILE_N: usize = 256;
/// K per stage (two NVFP4 blocks per lane of a quad): K must be a multiple of it.
pub const STAGE_K: usize = 128;
const THREADS: u32 = 256;
/// Dynamic shared memory of the mainloop: a 4-slot ring of (activation tile 32 KiB, tiled weight block 18 KiB,
/// 2 KiB unused) plus 1 KiB so the kernel can align the ring to 1024 bytes (`rs::kBytesW + 1024` in the .cu, pinned
/// there by a static_assert).
pub const SMEM_BYTES: usize = 4 * (32768 + 16384 + 4096) + 1024;
/// Token rows of the activation boxes the mainloop's narrow tiles load (one tensor map each, in this order).
const ACT_BOX_ROWS: [usize; 4] = [32, 64, 96, 128];
/// [`super::launch_partial`] routes a contiguous grouping here from this mean number of rows per expert
/// (`rows_total / experts`; Flash top-6 of 256 crosses it at 256 tokens, Pro top-6 of 384 at 384). The RS kernel
/// beat the mma.sync decode kernel at every contiguous point measured, from 6.75 rows per expert (Flash 288 tokens)
/// up, L1 and L2, Flash and Pro (results/h200/archive/session10-ab2/, variant `nvfp4_decode`, now
/// `nvfp4_decode_mainloop`); below 6 rows per expert nothing was measured on a contiguous grouping (the bench runs
/// the masked layout up to 256 tokens).
pub const MIN_MEAN_ROWS_PER_EXPERT: usize = 6;

/// `N % 256 == 0`, `K % 128 == 0` (all DSV4 expert shapes qualify; [`super::check_gemm_shape`] requires both).
pub fn check_shape(n: usize, k: usize) -> Result<()> {
    ensure!(
        n > 0 && n.is_multiple_of(TILE_N),
        "moe_gemm prefill: N = {n} must be a positive multiple of {TILE_N}"
    );
    ensure!(
        k > 0 && k.is_multiple_of(STAGE_K),
        "moe_gemm prefill: K = {k} must be a positive multiple of {STAGE_K}"
    );
    Ok(())
}

/// Whether [`super::launch_partial`] sends this launch to the prefill kernel.
pub fn routes_here(w: &DeviceExpertWeights, grp: &DeviceGrouping, cfg: &GemmConfig) -> bool {
    grp.capacity == 0
        && cfg.splits == 1
        && grp.experts >= 1
        && grp.rows_total >= MIN_MEAN_ROWS_PER_EXPERT * grp.experts
        && check_shape(w.n, w.k).is_ok()
}

/// Prefill mainloop: fp32 `A . B^T` per owned row into `ws` (`ws.splits` must be 1, carved with the pre-pass
/// scratch: [`super::WorkspaceShape::for_launch`]). Contiguous grouping only. Refuses what the kernel does not
/// take before any launch. Two launches on `stream`: the activation pre-pass, then `moe_gemm_prefill_rs_tiled`.
pub fn launch_partial_prefill(
    gpu: &Gpu,
    stream: &Stream,
    w: &DeviceExpertWeights,
    a: &DeviceActivations,
    grp: &DeviceGrouping,
    ws: &Workspace,
) -> Result<()> {
    super::check_weights(w)?;
    a.check()?;
    let (a_rows, a_k) = a.rows_k();
    ensure!(
        a_k == w.k,
        "moe_gemm prefill: A has K = {a_k}, weights K = {}",
        w.k
    );
    ensure!(
        a_rows >= grp.rows_total,
        "moe_gemm prefill: A has {a_rows} rows, the grouping spans {}",
        grp.rows_total
    );
    ensure!(
        grp.capacity == 0,
        "moe_gemm prefill: needs the contiguous grouping (got masked, capacity {})",
        grp.capacity
    );
    ensure!(
        grp.experts == w.experts && grp.experts >= 1 && grp.experts <= MAX_EXPERTS,
        "moe_gemm prefill: grouping has {} experts, weights {} (1..={MAX_EXPERTS})",
        grp.experts,
        w.experts
    );
    ensure!(
        ws.splits == 1 && ws.rows_total == grp.rows_total && ws.n == w.n,
        "moe_gemm prefill: workspace is [{}, {}, {}], needs [1, {}, {}]",
        ws.splits,
        ws.rows_total,
        ws.n,
        grp.rows_total,
        w.n
    );
    super::check_partial_len(ws)?;
    if grp.rows_total == 0 {
        return Ok(());
    }
    // Static + dynamic shared memory checked against the device's opt-in limit (exactly, from the loaded
    // kernel's attributes) before any launch.
    let kern = gpu.kernel_with_smem(FAMILY, "moe_gemm_prefill_rs_tiled", SMEM_BYTES)?;
    let (n, k) = (as_i32(w.n, "N")?, as_i32(w.k, "K")?);
    let (e, rows) = (
        as_i32(grp.experts, "experts")?,
        as_i32(grp.rows_total, "rows")?,
    );
    // The kernel indexes tiles of the tiled weights (e * N / 256 + n tile) with 32-bit ints.
    ensure!(
        w.experts * (w.n / TILE_N) <= i32::MAX as usize,
        "moe_gemm prefill: {} experts x N = {} exceed the kernel's i32 tile index",
        w.experts,
        w.n
    );
    // Persistent grid: one CTA per SM (209 KB of shared memory, up to 255 registers per thread), never more than
    // the most work items any grouping of these rows can produce (token tiles of 128: sum_e ceil(c_e / 128) <=
    // rows / 128 + experts).
    let max_items = (grp.rows_total / TILE_M + grp.experts) * (w.n / TILE_N);
    let ctas = (gpu.info.sm_count as usize).clamp(1, max_items.max(1)) as u32;
    let act_rs = permute_activations_for_rs(gpu, stream, a, grp.rows_total, w.k, ws)?;
    // The accumulators hold sum * 2^-18 (NVFP4 A) or sum * 2^-9 (BF16 A), see the .cu.
    let restore: f32 = if a.is_nvfp4() { 262144.0 } else { 512.0 };
    let act_maps = ACT_BOX_ROWS
        .iter()
        .map(|&r| rs_activation_map(act_rs, grp.rows_total, w.k, r))
        .collect::<Result<Vec<_>>>()?;
    let mut args = KernelArgs::new();
    args.buf(&w.tiled).i32(n).i32(k);
    for m in &act_maps {
        args.pod(m);
    }
    args.f32(restore)
        .buf(&grp.group)
        .i32(e)
        .i32(rows)
        .buf(&ws.partial);
    // SAFETY: arguments in the kernel's order; weights, activations, grouping and partials were checked against the
    // shape above, the pre-pass output against rows x K.
    unsafe {
        launch(
            stream,
            &kern,
            Launch::new((ctas, 1, 1), (THREADS, 1, 1)).smem(SMEM_BYTES),
            &mut args,
        )
    }
}

/// Segment pairs per warp step of `moe_gemm_prefill_act_rs` (`act_rs::kPairsNvfp4` = `kPairsBf16` in the .cu): a warp
/// step converts 2 x 4 = 8 segments of 128 K, a CTA of 8 warps 64.
const ACT_RS_SEGMENTS_PER_WARP_STEP: usize = 8;
/// Threads per CTA of `moe_gemm_prefill_act_rs` (`act_rs::kThreads`).
const ACT_RS_THREADS: u32 = 256;
/// CTAs per SM the pre-pass is built for (`act_rs::kCtasPerSm`, its `__launch_bounds__` minimum): the grid when the
/// occupancy query fails.
const ACT_RS_CTAS_PER_SM: usize = 8;

/// The RS pre-pass: the first `rows` activation rows, in the RS permuted BF16 order, into the workspace's
/// `act_rs` (carved with `prepass_k == k`; nothing past its first `rows * k` elements is written); returns its
/// device address for [`rs_activation_map`]. `k % 128 == 0`. Grid: one resident wave (occupancy x SMs) of
/// 256-thread CTAs, or fewer when there are fewer warp steps; the kernel loops over its warp steps (8 segments of
/// 128 K each).
pub fn permute_activations_for_rs(
    gpu: &Gpu,
    stream: &Stream,
    a: &DeviceActivations,
    rows: usize,
    k: usize,
    ws: &Workspace,
) -> Result<u64> {
    ensure!(
        k > 0 && k.is_multiple_of(STAGE_K),
        "moe_gemm_prefill_act_rs: K = {k} must be a positive multiple of {STAGE_K}"
    );
    a.check()?;
    let (a_rows, a_k) = a.rows_k();
    ensure!(
        a_k == k && a_rows >= rows,
        "moe_gemm_prefill_act_rs: activations are {a_rows} x {a_k}, need at least {rows} x {k}"
    );
    // The kernel indexes 128-K segments (rows * K / 128 of them) with 32-bit ints.
    let segments = rows * (k / STAGE_K);
    ensure!(
        segments <= i32::MAX as usize,
        "moe_gemm_prefill_act_rs: {rows} rows x K {k} = {segments} segments of 128 K exceed the kernel's i32 index"
    );
    ensure!(
        ws.act_rs.len() >= rows * k,
        "moe_gemm_prefill_act_rs: the workspace's pre-pass buffer holds {} elements, {rows} x {k} needed (carve the \
         workspace with WorkspaceShape::for_launch)",
        ws.act_rs.len()
    );
    // The kernel's vector accesses: 4-byte code words (NVFP4) or 16-byte BF16 chunks in, 16-byte chunks out.
    let out = ws.act_rs.device_addr();
    let (act, act_align) = match a {
        DeviceActivations::Bf16 { data, .. } => (data.device_addr(), 16),
        DeviceActivations::Nvfp4 { codes, .. } => (codes.device_addr(), 4),
    };
    ensure!(
        act.is_multiple_of(act_align) && out.is_multiple_of(16),
        "moe_gemm_prefill_act_rs: activations at {act:#x} (need {act_align}-byte alignment) or output at {out:#x} \
         (need 16) misaligned"
    );
    if segments == 0 {
        return Ok(out);
    }
    let kern = gpu.kernel(FAMILY, "moe_gemm_prefill_act_rs")?;
    let per_sm = kern
        .function()
        .occupancy_max_active_blocks_per_multiprocessor(ACT_RS_THREADS, 0, None)
        .map(|b| b as usize)
        .unwrap_or(ACT_RS_CTAS_PER_SM)
        .max(1);
    let warp_steps = segments.div_ceil(ACT_RS_SEGMENTS_PER_WARP_STEP);
    let ctas = warp_steps
        .div_ceil(ACT_RS_THREADS as usize / 32)
        .min(per_sm * gpu.info.sm_count.max(1) as usize);
    let mut args = KernelArgs::new();
    push_activations(&mut args, a);
    args.i32(as_i32(rows, "rows")?)
        .i32(as_i32(k, "K")?)
        .buf(&ws.act_rs);
    // SAFETY: arguments in the kernel's order; activations hold >= rows x K, the output rows x K elements.
    unsafe {
        launch(
            stream,
            &kern,
            Launch::new((ctas as u32, 1, 1), (ACT_RS_THREADS, 1, 1)),
            &mut args,
        )?;
    }
    Ok(out)
}

/// Tensor map over the pre-pass output `[rows][K]` BF16 at `addr` with a box of 64 K x `box_rows` token rows and the
/// 128-byte swizzle: one copy lands the first `box_rows` rows of a [128 tokens][64 K] atom in the swizzled K-major
/// layout the wgmma descriptor expects.
fn rs_activation_map(addr: u64, rows: usize, k: usize, box_rows: usize) -> Result<TensorMap> {
    encode_tiled(
        "moe_gemm prefill RS activations",
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        2,
        addr,
        &[k as u64, rows as u64],
        &[(k * 2) as u64],
        &[64, box_rows as u32],
        sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
    )
}

/// Bytes of one tiled stage (`rs::kTiledBlock` in the .cu): the 256 code rows of 64 B, then the stage's 8 scale
/// bytes of each row.
pub const TILED_BLOCK_BYTES: usize = TILE_N * 64 + TILE_N * 8;

/// Bytes of the tiling of `experts` x `n` x `k` weights (the same as their codes plus block scales).
pub fn tiled_bytes(experts: usize, n: usize, k: usize) -> usize {
    experts * (n / TILE_N) * (k / STAGE_K) * TILED_BLOCK_BYTES
}

/// The weights' codes (`[E, N, K/2]`, e2m1, low nibble first) and block scales (`[E, N, K/16]`, e4m3) re-laid into
/// the tiling both routed mainloops read (`moe_gemm_prefill_tile_weights_rs`; weight preparation, once per weight
/// set, on `stream`): block `(e * N / 256 + n_tile) * K / 128 + st` of [`TILED_BLOCK_BYTES`] holds code byte c of
/// tile row r at `64 r + c` and scale byte j at `16384 + 8 r + j` (the .cu's layout comment). Same bytes, reordered.
/// `N % 256 == 0`, `K % 128 == 0` ([`check_shape`]). The inputs may be freed once the stream has run the copy.
pub fn tile_weights_for_rs(
    gpu: &Gpu,
    stream: &Stream,
    codes: &CudaSlice<u8>,
    scales: &CudaSlice<u8>,
    experts: usize,
    n: usize,
    k: usize,
) -> Result<CudaSlice<u8>> {
    check_shape(n, k)?;
    ensure!(experts >= 1, "moe_gemm tiling: {experts} experts");
    let out = gpu.zeros::<u8>(tiled_bytes(experts, n, k))?;
    tile_weights_into(gpu, stream, codes, scales, experts, n, k, &out)?;
    Ok(out)
}

/// [`tile_weights_for_rs`] into a caller-owned buffer of at least [`tiled_bytes`]`(experts, n, k)` bytes, 16-byte
/// aligned (the engine tiles one expert at a time into its slot of a layer's buffer: expert `e`'s blocks are the
/// contiguous bytes `[e, e + 1) x tiled_bytes(1, n, k)`).
#[allow(clippy::too_many_arguments)]
pub fn tile_weights_into(
    gpu: &Gpu,
    stream: &Stream,
    codes: &impl DeviceBuf<u8>,
    scales: &impl DeviceBuf<u8>,
    experts: usize,
    n: usize,
    k: usize,
    out: &impl DeviceBuf<u8>,
) -> Result<()> {
    check_shape(n, k)?;
    ensure!(experts >= 1, "moe_gemm tiling: {experts} experts");
    ensure!(
        codes.elems() >= experts * n * k / 2 && scales.elems() >= experts * n * k / 16,
        "moe_gemm tiling: {} code and {} scale bytes for {experts} x {n} x {k} weights",
        codes.elems(),
        scales.elems()
    );
    let bytes = tiled_bytes(experts, n, k);
    ensure!(
        out.elems() >= bytes && out.device_addr().is_multiple_of(16),
        "moe_gemm tiling: the output ({} bytes at {:#x}) must hold {bytes} bytes, 16-byte aligned",
        out.elems(),
        out.device_addr()
    );
    for (what, addr) in [
        ("codes", codes.device_addr()),
        ("scales", scales.device_addr()),
    ] {
        ensure!(
            addr.is_multiple_of(16),
            "moe_gemm tiling: the {what} at {addr:#x} are not 16-byte aligned"
        );
    }
    let kern = gpu.kernel(FAMILY, "moe_gemm_prefill_tile_weights_rs")?;
    let mut args = KernelArgs::new();
    args.buf(codes)
        .buf(scales)
        .i32(as_i32(experts, "experts")?)
        .i32(as_i32(n, "N")?)
        .i32(as_i32(k, "K")?)
        .buf(out);
    let units = bytes / 16;
    // SAFETY: arguments in the kernel's order; `out` holds every block, the inputs E x N x K weights (checked).
    unsafe {
        launch(
            stream,
            &kern,
            Launch::new((units.div_ceil(256).min(1 << 20) as u32, 1, 1), (256, 1, 1)),
            &mut args,
        )
    }
}

/// CPU mirror of the tiling (`moe_gemm_prefill_tile_weights_rs`): plain codes `[E, N, K/2]` and scales
/// `[E, N, K/16]` into the [`tiled_bytes`] bytes both mainloops read (what a test compares device weights with).
pub fn tile_weights_like_kernel(
    codes: &[u8],
    scales: &[u8],
    experts: usize,
    n: usize,
    k: usize,
) -> Vec<u8> {
    let stages = k / STAGE_K;
    let mut out = vec![0u8; tiled_bytes(experts, n, k)];
    for tile in 0..experts * (n / TILE_N) {
        for st in 0..stages {
            let block = &mut out[(tile * stages + st) * TILED_BLOCK_BYTES..][..TILED_BLOCK_BYTES];
            for r in 0..TILE_N {
                let row = tile * TILE_N + r;
                block[64 * r..64 * r + 64].copy_from_slice(&codes[row * (k / 2) + st * 64..][..64]);
                block[TILE_N * 64 + 8 * r..TILE_N * 64 + 8 * r + 8]
                    .copy_from_slice(&scales[row * (k / 16) + st * 8..][..8]);
            }
        }
    }
    out
}

// ------------------------------------------------------------------------------------ CPU mirrors of the device

/// Byte offset of (row, 16-byte chunk) in a 128B-swizzled K-major BF16 tile (64 elements = 128 B per row):
/// `row * 128 + ((chunk ^ (row % 8)) * 16)`: where a TMA copy with the 128-byte swizzle puts the activation atoms
/// the wgmma descriptor reads (`sw128_offset` in kernels/common/wgmma.cuh, the layout of the .cu header).
pub fn sw128_offset(row: u32, chunk: u32) -> u32 {
    row * 128 + ((chunk ^ (row & 7)) << 4)
}

/// The 128B swizzle as the hardware applies it to a logical (unswizzled) byte address inside a 1024-aligned
/// tile: address bits [4, 7) XOR bits [7, 10) (cute `Swizzle<3, 4, 3>`). Used to check [`sw128_offset`] and
/// the descriptor's K advance (+32 B per K = 16 slice) against the documented pattern.
pub fn sw128_hw(logical: u32) -> u32 {
    logical ^ (((logical >> 7) & 7) << 4)
}

/// Mirror of `sw128_desc` (kernels/common/wgmma.cuh): start address >> 4 in bits 0-13, LBO = 1 (unused) in bits 16-29,
/// SBO = 1024 B >> 4 in bits 32-45, base offset 0, swizzle mode 1 (128B) in bits 62-63.
pub fn sw128_desc(smem_addr: u32) -> u64 {
    ((smem_addr & 0x3FFFF) >> 4) as u64 | (1u64 << 16) | ((1024u64 >> 4) << 32) | (1u64 << 62)
}

/// RS kernel, weight side: the physical K (0..128 inside a 128-K stage) that lane `t` of a quad feeds at
/// logical k `2t + b` (`hi_k == false`, fragment registers a0 / a1) or `2t + 8 + b` (`hi_k == true`, a2 / a3) of
/// k16 slice `s` (0..8): pair `P_i` of code word `4t + j` with `s = 2j + h`, `i = 2h + hi_k` (kernel header).
pub fn rs_weight_physical_k(t: usize, s: usize, hi_k: bool, b: usize) -> usize {
    let (j, h) = (s / 2, s % 2);
    let i = 2 * h + hi_k as usize;
    32 * t + 8 * j + i + 4 * b
}

/// RS kernel, activation side: the physical K stored at logical position `l` (0..128) of a token's BF16 row:
/// logical 16-byte chunk `c = 4j + i` holds `P_i` of word `4t + j` at 32-bit word `t` (kernel header).
pub fn rs_activation_physical_k(l: usize) -> usize {
    let (c, e) = (l / 8, l % 8);
    let (j, i) = (c / 4, c % 4);
    let (t, b) = (e / 2, e % 2);
    32 * t + 8 * j + i + 4 * b
}

/// CPU mirror of the RS pre-pass (`moe_gemm_prefill_act_rs`) for NVFP4 activations: the BF16 bits it writes for the
/// first `rows` rows of `codes` ([rows][k / 2], low nibble first) and `scales` ([rows][k / 16] e4m3). Logical
/// position `l` of 128-K segment `s` of a row holds physical K `p = 128 s + rs_activation_physical_k(l)` as
/// `bf16(e2m1(code_p) * e4m3(scale of block p / 16) * 2^-9)`: the value the kernel's shift-and-mask pair times
/// `bf16(scale * 2^117)` gives, exact (at most 6 significant bits, between 2^-19 and 6 * 448 * 2^-9), so any
/// rounding mode agrees; signed zeros follow the product's sign; a NaN scale (0x7F / 0xFF) gives NaN. Written from
/// the values (e2m1 / e4m3 decode), not from the kernel's bit trick, so it checks the trick too.
pub fn rs_prepass_nvfp4_like_kernel(
    codes: &[u8],
    scales: &[u8],
    rows: usize,
    k: usize,
) -> Vec<u16> {
    assert!(
        k.is_multiple_of(STAGE_K) && codes.len() >= rows * k / 2 && scales.len() >= rows * k / 16
    );
    let perm: Vec<usize> = (0..STAGE_K).map(rs_activation_physical_k).collect();
    // (scale code, e2m1 code) -> output bits: 256 x 16 products instead of one per element.
    let table: Vec<u16> = (0..256usize)
        .flat_map(|sc| {
            let s = e4m3::decode(sc as u8);
            (0..16u8).map(move |c| {
                bf16::from_f32(crate::formats::e2m1::decode(c) * s * f32::powi(2.0, -9)).to_bits()
            })
        })
        .collect();
    let mut out = vec![0u16; rows * k];
    for r in 0..rows {
        for (l, o) in out[r * k..(r + 1) * k].iter_mut().enumerate() {
            let p = l / STAGE_K * STAGE_K + perm[l % STAGE_K];
            let code = (codes[r * k / 2 + p / 2] >> (4 * (p % 2))) & 0xF;
            let sc = scales[r * k / 16 + p / 16];
            *o = table[sc as usize * 16 + code as usize];
        }
    }
    out
}

/// CPU mirror of the RS pre-pass for BF16 activations (`data` [rows][k]): the same permutation of K inside each
/// 128-K segment, values copied bit for bit.
pub fn rs_prepass_bf16_like_kernel(data: &[bf16], rows: usize, k: usize) -> Vec<u16> {
    assert!(k.is_multiple_of(STAGE_K) && data.len() >= rows * k);
    let perm: Vec<usize> = (0..STAGE_K).map(rs_activation_physical_k).collect();
    (0..rows * k)
        .map(|i| {
            let (r, l) = (i / k, i % k);
            data[r * k + l / STAGE_K * STAGE_K + perm[l % STAGE_K]].to_bits()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sw128_offset_is_a_bijection_on_the_tile_and_matches_the_hardware_pattern() {
        // 128 rows x 8 chunks of 16 B cover [0, 16 KiB) exactly once.
        let mut seen = vec![false; 128 * 8];
        for row in 0..128u32 {
            for chunk in 0..8u32 {
                let off = sw128_offset(row, chunk);
                assert_eq!(off % 16, 0);
                assert!(off < 16384, "row {row} chunk {chunk}: offset {off}");
                let u = (off / 16) as usize;
                assert!(!seen[u], "row {row} chunk {chunk}: offset {off} used twice");
                seen[u] = true;
                // Stored where the hardware looks for logical (row, chunk): row-major 128 B rows, swizzled.
                assert_eq!(off, sw128_hw(row * 128 + chunk * 16));
                // The k-th K = 16 slice read through a descriptor whose start address is +32k bytes.
                for k in 0..4u32 {
                    for half in 0..2u32 {
                        if chunk == 2 * k + half {
                            assert_eq!(sw128_hw(32 * k + row * 128 + half * 16), off);
                        }
                    }
                }
            }
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn descriptor_fields_sit_where_the_ptx_isa_puts_them() {
        let d = sw128_desc(0x1_2400);
        assert_eq!(d & 0x3FFF, 0x1_2400 >> 4);
        assert_eq!((d >> 16) & 0x3FFF, 1);
        assert_eq!((d >> 32) & 0x3FFF, 64);
        assert_eq!((d >> 49) & 7, 0);
        assert_eq!(d >> 62, 1);
        // The K advance adds 2 per 32 bytes without carrying out of the address field.
        assert_eq!((d + 6) & 0x3FFF, (0x1_2400 + 96) >> 4);
    }

    /// The pre-pass mirror (written from values and [`rs_activation_physical_k`]) against the kernel header's
    /// formulation with the kernel's arithmetic: output chunk c = 4j + i of a segment, 32-bit slot s =
    /// `mul.rn.bf16x2(pair_tiny(word 4s + j, i), bf16x2(scale of byte (4s + j) / 2 * 2^117))`. Every e2m1 code at
    /// every nibble, every scale code (NaN codes: both NaN), two rows of two segments.
    #[test]
    fn rs_prepass_mirror_matches_the_kernel_formula() {
        let (rows, k) = (2usize, 256usize);
        let mut codes = vec![0u8; rows * k / 2];
        let mut scales = vec![0u8; rows * k / 16];
        // Word w has code (w + n) % 16 at nibble n (plus a per-row offset): every code at every nibble position.
        for (i, c) in codes.iter_mut().enumerate() {
            let (w, b) = (i / 4 + i / 128, i % 4);
            *c = (((w + 2 * b) % 16) | ((w + 2 * b + 1) % 16) << 4) as u8;
        }
        for sc0 in (0..256usize).step_by(scales.len()) {
            for (i, s) in scales.iter_mut().enumerate() {
                *s = (sc0 + i) as u8;
            }
            let got = rs_prepass_nvfp4_like_kernel(&codes, &scales, rows, k);
            let pair_tiny = |w: u32, i: u32| -> u32 {
                let v = w << (12 - 4 * i);
                (v & 0x8000_8000) | ((v >> 6) & 0x01C0_01C0)
            };
            let mul = |a: u16, s: u8| -> u16 {
                let sb = bf16::from_f32(e4m3::decode(s) * f32::powi(2.0, 117));
                bf16::from_f32(bf16::from_bits(a).to_f32() * sb.to_f32()).to_bits()
            };
            for r in 0..rows {
                for seg in 0..k / STAGE_K {
                    for c in 0..16u32 {
                        let (j, i) = (c / 4, c % 4);
                        for slot in 0..4u32 {
                            let word_idx = (4 * slot + j) as usize;
                            let base = r * k / 2 + seg * 64 + 4 * word_idx;
                            let w = u32::from_le_bytes(codes[base..base + 4].try_into().unwrap());
                            let sc = scales[r * k / 16 + seg * 8 + word_idx / 2];
                            let pr = pair_tiny(w, i);
                            let want = [mul(pr as u16, sc), mul((pr >> 16) as u16, sc)];
                            let at = r * k + seg * STAGE_K + 8 * c as usize + 2 * slot as usize;
                            for h in 0..2 {
                                let (g, w) =
                                    (bf16::from_bits(got[at + h]), bf16::from_bits(want[h]));
                                assert!(
                                    g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                                    "row {r} segment {seg} chunk {c} slot {slot} half {h} scale {sc:#04x}: \
                                     mirror {:#06x} kernel formula {:#06x}",
                                    g.to_bits(),
                                    w.to_bits()
                                );
                            }
                        }
                    }
                }
            }
        }
        // BF16: a pure permutation of each 128-K segment.
        let data: Vec<bf16> = (0..rows * k).map(|i| bf16::from_bits(i as u16)).collect();
        let got = rs_prepass_bf16_like_kernel(&data, rows, k);
        for (i, g) in got.iter().enumerate() {
            let (r, l) = (i / k, i % k);
            let p = l / 128 * 128 + rs_activation_physical_k(l % 128);
            assert_eq!(*g as usize, r * k + p);
        }
    }

    #[test]
    fn rs_fragments_and_activation_tile_agree_on_a_permutation_of_k() {
        // The activation row is a permutation of the 128 physical K of a stage ...
        let mut seen = [false; 128];
        for l in 0..128 {
            let p = rs_activation_physical_k(l);
            assert!(!seen[p], "physical K {p} stored twice");
            seen[p] = true;
        }
        // ... and at every logical k of every slice the weight fragment and the activation tile hold the same one.
        for t in 0..4 {
            for s in 0..8 {
                for hi_k in [false, true] {
                    for b in 0..2 {
                        let l = 16 * s + 2 * t + 8 * hi_k as usize + b;
                        assert_eq!(
                            rs_weight_physical_k(t, s, hi_k, b),
                            rs_activation_physical_k(l),
                            "lane {t} slice {s} hi_k {hi_k} b {b}"
                        );
                    }
                }
            }
        }
        // Each lane's fragments cover exactly its own 32 K (two NVFP4 blocks, one 16-byte load per row).
        for t in 0..4 {
            let mut ks: Vec<usize> = (0..8)
                .flat_map(|s| {
                    [false, true]
                        .into_iter()
                        .flat_map(move |h| (0..2).map(move |b| (s, h, b)))
                })
                .map(|(s, h, b)| rs_weight_physical_k(t, s, h, b))
                .collect();
            ks.sort_unstable();
            assert_eq!(ks, (32 * t..32 * t + 32).collect::<Vec<_>>());
        }
    }
}
