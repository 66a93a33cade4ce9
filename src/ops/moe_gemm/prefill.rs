//! Prefill mainloop of the NVFP4 MoE grouped GEMM on Hopper wgmma (kernels/moe_gemm_prefill.cu).
//!
//! Same contract as [`super::launch_partial`] with one K split: it writes the fp32 accumulator
//! `partial[row, n] = sum_k A[row, k] * B[e(row), n, k]` (no global scales) into a [`Workspace`] with
//! `splits == 1`, so the existing finish kernels ([`super::launch_finish_bf16`], [`super::launch_finish_l1`],
//! [`super::launch_finish_l2`]) apply the epilogues unchanged. Contiguous grouping only (prefill: tokens sorted
//! by expert, offsets). Mainloops ([`PrefillKernel`]): the RS kernel (routed: 256 weight rows x 128 tokens,
//! weights dequantized in registers as the wgmma A operand, activations pre-permuted once and fed by TMA, K stages
//! of 128) and the SS kernels (CTA tile 128 tokens x 128 or 256 weight rows, both wgmma operands from shared
//! memory, K stages of 64: `N % 128 == 0`, `K % 64 == 0`; the fallback for other shapes).
//!
//! [`super::launch_partial`] routes here when [`routes_here`] holds (contiguous layout, mean rows per
//! expert >= [`MIN_MEAN_ROWS_PER_EXPERT`], one K split); [`launch_partial_prefill`] forces this path with
//! [`PrefillKernel::routed_for`], [`launch_partial_prefill_with`] with a chosen mainloop. The weights' tiling
//! ([`super::DeviceExpertWeights::tiled`], made at upload: one contiguous block per 256-row tile and 128-K stage,
//! [`tile_weights_for_rs`]) is what the routed mainloop reads, as does the decode mainloop.
//!
//! The CPU mirrors at the bottom ([`sw128_offset`], [`dequant8_like_kernel`], [`sw128_desc`]) restate the
//! device address, dequant and descriptor logic so unit tests can check them without a GPU. (Why this file passes
//! ~800 lines: those mirrors and their unit tests, about half of it, sit beside the launcher they describe.)

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
/// Tokens per CTA tile (two warp groups of 64 rows: the wgmma M dimension).
pub const TILE_M: usize = 128;
/// Weight rows per CTA tile (the wgmma N dimension): N must be a multiple of it.
pub const TILE_N: usize = 128;
/// K per pipeline stage (one 128-byte BF16 swizzle atom): K must be a multiple of it.
pub const STAGE_K: usize = 64;
const RING: usize = 4;
const THREADS: u32 = 256;
/// Dynamic shared memory: RING BF16 A tiles and 2 BF16 B tiles (16 KiB each), RING raw stages (weights and
/// NVFP4 A: 2 x (4 KiB codes + 512 B scales)), plus 1 KiB so the kernel can align its tiles to 1024 bytes.
/// Must match `kSmemBytes + 1024` in the .cu (a static_assert there pins the number).
pub const SMEM_BYTES: usize = RING * 16384 + 2 * 16384 + RING * 9216 + 1024;
/// Weight rows per CTA tile of the wide variant (`moe_gemm_prefill_partial_n256`, m64n256k16).
pub const TILE_N_WIDE: usize = 256;
/// Dynamic shared memory of the wide variant: B tiles and raw B stages twice as large (`Layout<256>` + 1024).
pub const SMEM_BYTES_N256: usize = RING * 16384 + 2 * 32768 + RING * (9216 + 4608) + 1024;
/// Weight rows per CTA tile of the RS kernel (`moe_gemm_prefill_partial_rs_tma`: 2 warp groups x 2 m64 blocks).
pub const TILE_N_RS: usize = 256;
/// K per stage of the RS kernel (two NVFP4 blocks per lane of a quad).
pub const STAGE_K_RS: usize = 128;
/// Dynamic shared memory of the TMA-fed RS kernel: a 4-slot ring of 128-token x 128-K BF16 activation tiles
/// (`rs::kBytesT + 1024` in the .cu).
pub const SMEM_BYTES_RS_TMA: usize = 4 * 32768 + 1024;
/// K granularity of the RS kernel with the weights in its TMA ring (`moe_gemm_prefill_partial_rs_wtma`): each slot
/// loads the block scales of a stage pair (a TMA box row must be a multiple of 16 bytes), so the scale tensor's row
/// pitch K / 16 must be a multiple of 16 bytes.
pub const K_MULTIPLE_RS_WTMA: usize = 256;
/// Dynamic shared memory of `moe_gemm_prefill_partial_rs_wtma`: a 4-slot ring of (activation tile 32 KiB, weight
/// codes 16 KiB, scales of the stage pair 4 KiB) (`rs::kBytesW + 1024` in the .cu).
pub const SMEM_BYTES_RS_WTMA: usize = 4 * (32768 + 16384 + 4096) + 1024;
/// [`super::launch_partial`] routes a contiguous grouping here from this mean number of rows per expert
/// (`rows_total / experts`; Flash top-6 of 256 crosses it at 256 tokens, Pro top-6 of 384 at 384). The RS kernel
/// beat the mma.sync decode kernel at every contiguous point measured, from 6.75 rows per expert (Flash 288 tokens)
/// up, L1 and L2, Flash and Pro (results/h200/session10-ab2/, variant `nvfp4_decode`, now
/// `nvfp4_decode_mainloop`); below 6 rows per expert nothing was measured on a contiguous grouping (the bench runs
/// the masked layout up to 256 tokens).
pub const MIN_MEAN_ROWS_PER_EXPERT: usize = 6;

/// `N % 128 == 0`, `K % 64 == 0` (all DSV4 expert shapes qualify).
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

/// Which prefill mainloop runs (kernels/moe_gemm_prefill.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillKernel {
    /// `moe_gemm_prefill_partial`: 128 tokens x 128 weight rows, both wgmma operands from shared memory (the
    /// weights dequantized into a BF16 tile). `N % 128 == 0`, `K % 64 == 0`, either A format.
    Ss128,
    /// `moe_gemm_prefill_partial_n256`: the same with 128 x 256 (m64n256k16). `N % 256 == 0`.
    Ss256,
    /// `moe_gemm_prefill_act_rs` + `moe_gemm_prefill_partial_rs_tma`: 256 weight rows x 128 tokens, the weights
    /// dequantized in registers as the wgmma A operand (RS form); a pre-pass writes the activations once in the RS
    /// permuted BF16 order (into [`Workspace::act_rs`]), which the mainloop streams with TMA. `N % 256 == 0`,
    /// `K % 128 == 0`, either A format. The fallback for `K % 256 != 0`.
    RsTma,
    /// `moe_gemm_prefill_act_rs` + `moe_gemm_prefill_partial_rs_wtma`: [`PrefillKernel::RsTma`] with each stage's
    /// weight codes and block scales in the same TMA ring as the activations (three stages ahead), the ring slot
    /// released one stage later, and a token tile with `ntok <= 96` valid rows run with N = 32 * ceil(ntok / 32)
    /// wgmmas (and activation boxes of as many rows) instead of 128. Bit-identical partials. `N % 256 == 0`,
    /// `K % 256 == 0`. Routed for weights without their tiling.
    RsWtma,
    /// `moe_gemm_prefill_partial_rs_wtma_tiled`: [`PrefillKernel::RsWtma`] on the weights' re-laid copy
    /// ([`DeviceExpertWeights::tiled`], one contiguous 18 KiB block per stage, one bulk copy instead of two 2D
    /// boxes of 256 rows). Bit-identical partials. Routed whenever that copy exists (faster than RsWtma at every
    /// prefill point measured, Flash and Pro, L1 and L2: results/h200/session11-ab2/). Every thread releases a ring
    /// slot itself (empty barrier count 256, not lane 0 per warp after a `__syncwarp`): the same ordering under the
    /// PTX memory model, and one that compute-sanitizer racecheck can follow (0 hazards).
    RsWtmaTiled,
}

impl PrefillKernel {
    /// Entry point, dynamic shared memory, weight rows per CTA tile, the multiple K must be (the K per stage;
    /// for RsWtma the stage pair its scale boxes span).
    fn entry(self) -> (&'static str, usize, usize, usize) {
        match self {
            PrefillKernel::Ss128 => ("moe_gemm_prefill_partial", SMEM_BYTES, TILE_N, STAGE_K),
            PrefillKernel::Ss256 => (
                "moe_gemm_prefill_partial_n256",
                SMEM_BYTES_N256,
                TILE_N_WIDE,
                STAGE_K,
            ),
            PrefillKernel::RsTma => (
                "moe_gemm_prefill_partial_rs_tma",
                SMEM_BYTES_RS_TMA,
                TILE_N_RS,
                STAGE_K_RS,
            ),
            PrefillKernel::RsWtma => (
                "moe_gemm_prefill_partial_rs_wtma",
                SMEM_BYTES_RS_WTMA,
                TILE_N_RS,
                K_MULTIPLE_RS_WTMA,
            ),
            PrefillKernel::RsWtmaTiled => (
                "moe_gemm_prefill_partial_rs_wtma_tiled",
                SMEM_BYTES_RS_WTMA,
                TILE_N_RS,
                STAGE_K_RS,
            ),
        }
    }

    /// The mainloop [`launch_partial_prefill`] uses for `N` x `K` weights: [`PrefillKernel::RsWtma`] when
    /// `N % 256 == 0` and `K % 256 == 0` (every DSV4 expert shape), [`PrefillKernel::RsTma`] when `N % 256 == 0`
    /// and `K % 128 == 0`, else [`PrefillKernel::Ss256`] when 256 divides N, else [`PrefillKernel::Ss128`].
    pub fn default_for(n: usize, k: usize) -> PrefillKernel {
        if n.is_multiple_of(TILE_N_RS) && k.is_multiple_of(K_MULTIPLE_RS_WTMA) {
            PrefillKernel::RsWtma
        } else if n.is_multiple_of(TILE_N_RS) && k.is_multiple_of(STAGE_K_RS) {
            PrefillKernel::RsTma
        } else if n.is_multiple_of(TILE_N_WIDE) {
            PrefillKernel::Ss256
        } else {
            PrefillKernel::Ss128
        }
    }

    /// [`PrefillKernel::RsWtmaTiled`] when the weights carry their tiled copy and [`PrefillKernel::default_for`]
    /// picks [`PrefillKernel::RsWtma`], else [`PrefillKernel::default_for`].
    pub fn routed_for(w: &DeviceExpertWeights) -> PrefillKernel {
        match PrefillKernel::default_for(w.n, w.k) {
            PrefillKernel::RsWtma if w.tiled.is_some() => PrefillKernel::RsWtmaTiled,
            k => k,
        }
    }

    /// Whether the kernel reads the weights' tiled copy ([`DeviceExpertWeights::tiled`]) instead of the
    /// plain layout.
    pub fn needs_tiled_weights(self) -> bool {
        matches!(self, PrefillKernel::RsWtmaTiled)
    }
}

/// Prefill mainloop: fp32 `A . B^T` per owned row into `ws` (`ws.splits` must be 1). Contiguous grouping only.
/// The mainloop is [`PrefillKernel::routed_for`] (the RS kernel on the tiled weights for every DSV4 shape; the SS
/// tiles for shapes the RS kernels do not take, 128 x 256 where N allows: it beat 128 x 128 at every prefill point).
pub fn launch_partial_prefill(
    gpu: &Gpu,
    stream: &Stream,
    w: &DeviceExpertWeights,
    a: &DeviceActivations,
    grp: &DeviceGrouping,
    ws: &Workspace,
) -> Result<()> {
    launch_partial_prefill_with(gpu, stream, w, a, grp, ws, PrefillKernel::routed_for(w))
}

/// [`launch_partial_prefill`] with a chosen mainloop; refuses shapes the kernel does not take before any launch
/// ([`PrefillKernel::RsWtmaTiled`] also needs [`DeviceExpertWeights::tiled`]).
pub fn launch_partial_prefill_with(
    gpu: &Gpu,
    stream: &Stream,
    w: &DeviceExpertWeights,
    a: &DeviceActivations,
    grp: &DeviceGrouping,
    ws: &Workspace,
    kernel: PrefillKernel,
) -> Result<()> {
    ensure!(
        !kernel.needs_tiled_weights() || w.tiled.is_some(),
        "moe_gemm prefill: {kernel:?} needs the weights' tiling (DeviceExpertWeights::tiled: N % 256 == 0)"
    );
    check_shape(w.n, w.k)?;
    let (name, smem, tile_n, k_multiple) = kernel.entry();
    ensure!(
        w.n.is_multiple_of(tile_n),
        "moe_gemm prefill ({name}): N = {} must be a multiple of the tile width {tile_n}",
        w.n
    );
    ensure!(
        w.k.is_multiple_of(k_multiple),
        "moe_gemm prefill ({name}): K = {} must be a multiple of {k_multiple}",
        w.k
    );
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
    let kern = gpu.kernel_with_smem(FAMILY, name, smem)?;
    let (n, k) = (as_i32(w.n, "N")?, as_i32(w.k, "K")?);
    let (e, rows) = (
        as_i32(grp.experts, "experts")?,
        as_i32(grp.rows_total, "rows")?,
    );
    // Persistent grid: one CTA per SM (136 / 187 / 130 / 209 KB of shared memory, up to 255 registers per thread),
    // never more than the most work items any grouping of these rows can produce (every kernel's token tile is
    // 128: sum_e ceil(c_e / 128) <= rows / 128 + experts).
    let max_items = (grp.rows_total / TILE_M + grp.experts) * (w.n / tile_n);
    let ctas = (gpu.info.sm_count as usize).clamp(1, max_items.max(1)) as u32;
    if matches!(
        kernel,
        PrefillKernel::RsTma | PrefillKernel::RsWtma | PrefillKernel::RsWtmaTiled
    ) {
        // TMA box coordinates are signed 32-bit: the weight row e * N + n and the token row must fit.
        ensure!(
            w.experts * w.n <= i32::MAX as usize,
            "moe_gemm prefill ({name}): {} experts x N = {} weight rows exceed the TMA coordinate range",
            w.experts,
            w.n
        );
        let act_rs = permute_activations_for_rs(gpu, stream, a, grp.rows_total, w.k, ws)?;
        // The accumulators hold sum * 2^-18 (NVFP4 A) or sum * 2^-9 (BF16 A), see the .cu.
        let restore: f32 = if a.is_nvfp4() { 262144.0 } else { 512.0 };
        // RsTma: the plain weights' addresses, one activation map (128-row boxes); RsWtma: the weight maps, then
        // activation maps with boxes of 32 / 64 / 96 / 128 token rows; RsWtmaTiled: the tiled weights' address,
        // then the same activation maps.
        let box_rows: &[usize] = match kernel {
            PrefillKernel::RsTma => &[TILE_M],
            _ => &[32, 64, 96, 128],
        };
        let act_maps = box_rows
            .iter()
            .map(|&r| rs_activation_map(act_rs, grp.rows_total, w.k, r))
            .collect::<Result<Vec<_>>>()?;
        let mut args = KernelArgs::new();
        match kernel {
            PrefillKernel::RsTma => {
                args.buf(&w.codes).buf(&w.scales);
            }
            PrefillKernel::RsWtmaTiled => {
                args.buf(w.tiled.as_ref().expect("checked above"));
            }
            _ => {
                let (codes_map, scales_map) = weight_maps_for_rs(w)?;
                args.pod(&codes_map).pod(&scales_map);
            }
        }
        args.i32(n).i32(k);
        for m in &act_maps {
            args.pod(m);
        }
        args.f32(restore)
            .buf(&grp.group)
            .i32(e)
            .i32(rows)
            .buf(&ws.partial);
        // SAFETY: arguments in the kernel's order; weights, activations, grouping and partials were checked
        // against the shape above, the pre-pass output against rows x K.
        return unsafe {
            launch(
                stream,
                &kern,
                Launch::new((ctas, 1, 1), (THREADS, 1, 1)).smem(smem),
                &mut args,
            )
        };
    }
    let mut args = KernelArgs::new();
    args.buf(&w.codes).buf(&w.scales).i32(n).i32(k);
    push_activations(&mut args, a);
    args.buf(&grp.group).i32(e).i32(rows).buf(&ws.partial);
    // SAFETY: as above.
    unsafe {
        launch(
            stream,
            &kern,
            Launch::new((ctas, 1, 1), (THREADS, 1, 1)).smem(smem),
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
        k > 0 && k.is_multiple_of(STAGE_K_RS),
        "moe_gemm_prefill_act_rs: K = {k} must be a positive multiple of {STAGE_K_RS}"
    );
    a.check()?;
    let (a_rows, a_k) = a.rows_k();
    ensure!(
        a_k == k && a_rows >= rows,
        "moe_gemm_prefill_act_rs: activations are {a_rows} x {a_k}, need at least {rows} x {k}"
    );
    // The kernel indexes 128-K segments (rows * K / 128 of them) with 32-bit ints.
    let segments = rows * (k / STAGE_K_RS);
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

/// Bytes of one pre-tiled stage (`rs::kTiledBlock` in the .cu): the 256 code rows of 64 B, then the stage's 8 scale
/// bytes of each row.
pub const TILED_BLOCK_BYTES: usize = TILE_N_RS * 64 + TILE_N_RS * 8;

/// Whether [`tile_weights_for_rs`] takes an `N` x `K` weight shape (`N % 256 == 0`, `K % 128 == 0`).
pub fn tiling_fits(n: usize, k: usize) -> bool {
    n > 0 && k > 0 && n.is_multiple_of(TILE_N_RS) && k.is_multiple_of(STAGE_K_RS)
}

/// The weights' codes and block scales re-laid for [`PrefillKernel::RsWtmaTiled`] on the device
/// (`moe_gemm_prefill_tile_weights_rs`; weight preparation, once per weight set): block
/// `(e * N / 256 + n_tile) * K / 128 + st` of [`TILED_BLOCK_BYTES`] holds code byte c of tile row r at `64 r + c` and
/// scale byte j at `16384 + 8 r + j` (the .cu's layout comment). Same bytes as the plain weights, reordered.
/// `N % 256 == 0`, `K % 128 == 0` ([`tiling_fits`]).
pub fn tile_weights_for_rs(gpu: &Gpu, w: &DeviceExpertWeights) -> Result<CudaSlice<u8>> {
    ensure!(
        tiling_fits(w.n, w.k) && w.experts >= 1,
        "moe_gemm prefill tiling: N = {} must be a multiple of {TILE_N_RS} and K = {} of {STAGE_K_RS}",
        w.n,
        w.k
    );
    let blocks = w.experts * (w.n / TILE_N_RS) * (w.k / STAGE_K_RS);
    let out = gpu.zeros::<u8>(blocks * TILED_BLOCK_BYTES)?;
    let kern = gpu.kernel(FAMILY, "moe_gemm_prefill_tile_weights_rs")?;
    let mut args = KernelArgs::new();
    args.buf(&w.codes)
        .buf(&w.scales)
        .i32(as_i32(w.experts, "experts")?)
        .i32(as_i32(w.n, "N")?)
        .i32(as_i32(w.k, "K")?)
        .buf(&out);
    let units = blocks * (TILED_BLOCK_BYTES / 16);
    // SAFETY: arguments in the kernel's order; `out` holds every block, the plain weights E x N x K.
    unsafe {
        launch(
            &gpu.stream,
            &kern,
            Launch::new((units.div_ceil(256).min(1 << 20) as u32, 1, 1), (256, 1, 1)),
            &mut args,
        )?;
    }
    Ok(out)
}

/// Tensor maps of the weights for [`PrefillKernel::RsWtma`]: codes as a [E*N][K/2] byte tensor (box 64 B = one
/// 128-K stage x 256 rows) and block scales as a [E*N][K/16] byte tensor (box 16 B = a stage pair x 256 rows); no
/// swizzle (the kernel reads rows at 64 / 16-byte pitch, conflict-free, see the .cu).
fn weight_maps_for_rs(w: &DeviceExpertWeights) -> Result<(TensorMap, TensorMap)> {
    let (codes, scales) = (w.codes.device_addr(), w.scales.device_addr());
    let rows = (w.experts * w.n) as u64;
    // A [rows][row_bytes] byte tensor read in boxes of box_bytes x 256 rows, no swizzle.
    let byte_rows = |what: &str, addr: u64, row_bytes: usize, box_bytes: u32| {
        encode_tiled(
            what,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            1,
            addr,
            &[row_bytes as u64, rows],
            &[row_bytes as u64],
            &[box_bytes, TILE_N_RS as u32],
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
        )
    };
    Ok((
        byte_rows("moe_gemm prefill RS weight codes", codes, w.k / 2, 64)?,
        byte_rows("moe_gemm prefill RS weight scales", scales, w.k / 16, 16)?,
    ))
}

// ------------------------------------------------------------------------------------ CPU mirrors of the device

/// Byte offset of (row, 16-byte chunk) in a 128B-swizzled K-major BF16 tile (64 elements = 128 B per row):
/// `row * 128 + ((chunk ^ (row % 8)) * 16)`. Mirror of `sw128_offset` in the .cu.
pub fn sw128_offset(row: u32, chunk: u32) -> u32 {
    row * 128 + ((chunk ^ (row & 7)) << 4)
}

/// The 128B swizzle as the hardware applies it to a logical (unswizzled) byte address inside a 1024-aligned
/// tile: address bits [4, 7) XOR bits [7, 10) (cute `Swizzle<3, 4, 3>`). Used to check [`sw128_offset`] and
/// the descriptor's K advance (+32 B per K = 16 slice) against the documented pattern.
pub fn sw128_hw(logical: u32) -> u32 {
    logical ^ (((logical >> 7) & 7) << 4)
}

/// Mirror of `sw128_desc` in the .cu: start address >> 4 in bits 0-13, LBO = 1 (unused) in bits 16-29,
/// SBO = 1024 B >> 4 in bits 32-45, base offset 0, swizzle mode 1 (128B) in bits 62-63.
pub fn sw128_desc(smem_addr: u32) -> u64 {
    ((smem_addr & 0x3FFFF) >> 4) as u64 | (1u64 << 16) | ((1024u64 >> 4) << 32) | (1u64 << 62)
}

/// `prmt.b32` / `__byte_perm(x, y, s)` without the sign-extension modes: byte i of the result is byte
/// `(s >> 4i) & 7` of the 8-byte value `y:x`.
pub fn byte_perm(x: u32, y: u32, s: u32) -> u32 {
    let v = ((y as u64) << 32) | x as u64;
    (0..4).fold(0u32, |r, i| {
        let sel = (s >> (4 * i)) & 7;
        r | ((((v >> (8 * sel)) & 0xFF) as u32) << (8 * i))
    })
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

/// Mirror of the kernel's `dequant8`: the 8 codes of `word` (nibble i = element i) times block scale
/// `scale_code`, as the 8 BF16 values the kernel stores in natural K order, times 2^9 (the kernel's accumulator
/// restore), i.e. what the tensor core multiplies. `mul.rn.bf16x2` is modelled as the exact f32 product
/// rounded to bf16.
pub fn dequant8_like_kernel(word: u32, scale_code: u8) -> [f32; 8] {
    let s = bf16::from_f32(e4m3::decode(scale_code) * f32::powi(2.0, 117));
    let mul2 = |bits: u32| -> u32 {
        let lo = bf16::from_bits(bits as u16).to_f32() * s.to_f32();
        let hi = bf16::from_bits((bits >> 16) as u16).to_f32() * s.to_f32();
        bf16::from_f32(lo).to_bits() as u32 | ((bf16::from_f32(hi).to_bits() as u32) << 16)
    };
    let pair = |i: u32| -> u32 {
        let v = word << (12 - 4 * i);
        mul2((v & 0x8000_8000) | ((v >> 6) & 0x01C0_01C0))
    };
    let (p0, p1, p2, p3) = (pair(0), pair(1), pair(2), pair(3));
    let out = [
        byte_perm(p0, p1, 0x5410),
        byte_perm(p2, p3, 0x5410),
        byte_perm(p0, p1, 0x7632),
        byte_perm(p2, p3, 0x7632),
    ];
    let mut v = [0f32; 8];
    for (j, w) in out.iter().enumerate() {
        v[2 * j] = bf16::from_bits(*w as u16).to_f32() * 512.0;
        v[2 * j + 1] = bf16::from_bits((*w >> 16) as u16).to_f32() * 512.0;
    }
    v
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
        k.is_multiple_of(STAGE_K_RS)
            && codes.len() >= rows * k / 2
            && scales.len() >= rows * k / 16
    );
    let perm: Vec<usize> = (0..STAGE_K_RS).map(rs_activation_physical_k).collect();
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
            let p = l / STAGE_K_RS * STAGE_K_RS + perm[l % STAGE_K_RS];
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
    assert!(k.is_multiple_of(STAGE_K_RS) && data.len() >= rows * k);
    let perm: Vec<usize> = (0..STAGE_K_RS).map(rs_activation_physical_k).collect();
    (0..rows * k)
        .map(|i| {
            let (r, l) = (i / k, i % k);
            data[r * k + l / STAGE_K_RS * STAGE_K_RS + perm[l % STAGE_K_RS]].to_bits()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::e2m1;

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
    fn sw128_stores_of_the_dequant_mapping_are_bank_conflict_free() {
        // A warp's 16-byte stores are served 8 lanes at a time; lanes 8p..8p+8 (rows 4p'..4p'+4, halves 0/1)
        // store chunk 4h + j at the same time and must hit 8 distinct 16-byte bank groups.
        for warp in 0..8u32 {
            for phase in 0..4u32 {
                for j in 0..4u32 {
                    let mut groups: Vec<u32> = (0..8u32)
                        .map(|l| {
                            let t = warp * 32 + phase * 8 + l;
                            (sw128_offset(t >> 1, 4 * (t & 1) + j) / 16) % 8
                        })
                        .collect();
                    groups.sort();
                    groups.dedup();
                    assert_eq!(groups.len(), 8, "warp {warp} phase {phase} j {j}");
                }
            }
        }
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

    #[test]
    fn byte_perm_model_matches_the_selectors_the_kernel_uses() {
        let (x, y) = (0x4433_2211u32, 0x8877_6655u32);
        assert_eq!(byte_perm(x, y, 0x5410), 0x6655_2211);
        assert_eq!(byte_perm(x, y, 0x7632), 0x8877_4433);
    }

    #[test]
    fn natural_order_dequant_is_exact_for_every_code_position_and_scale() {
        // Every non-NaN e4m3 scale; words whose nibbles take all 16 codes at every position (x over all 16-bit
        // values, the high half a different permutation of the same codes).
        for scale_code in (0..=255u8).filter(|c| c & 0x7F != 0x7F) {
            let s = e4m3::decode(scale_code);
            for x in (0..=0xFFFFu32).step_by(7).chain(0..16) {
                let word = x | ((x ^ 0xA5C3).rotate_left(5) & 0xFFFF) << 16;
                let got = dequant8_like_kernel(word, scale_code);
                for (i, g) in got.iter().enumerate() {
                    let code = ((word >> (4 * i)) & 0xF) as u8;
                    let want = e2m1::decode(code) * s;
                    assert!(
                        g.to_bits() == want.to_bits() || (*g == 0.0 && want == 0.0),
                        "word {word:#010x} element {i} scale {scale_code:#04x}: got {g} want {want}"
                    );
                }
            }
        }
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
                for seg in 0..k / STAGE_K_RS {
                    for c in 0..16u32 {
                        let (j, i) = (c / 4, c % 4);
                        for slot in 0..4u32 {
                            let word_idx = (4 * slot + j) as usize;
                            let base = r * k / 2 + seg * 64 + 4 * word_idx;
                            let w = u32::from_le_bytes(codes[base..base + 4].try_into().unwrap());
                            let sc = scales[r * k / 16 + seg * 8 + word_idx / 2];
                            let pr = pair_tiny(w, i);
                            let want = [mul(pr as u16, sc), mul((pr >> 16) as u16, sc)];
                            let at = r * k + seg * STAGE_K_RS + 8 * c as usize + 2 * slot as usize;
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
