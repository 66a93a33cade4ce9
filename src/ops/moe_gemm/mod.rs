//! NVFP4 MoE grouped GEMM (kernels/moe_gemm.cu): `D[m, n] = gsa[m] * gsb[e, n] * sum_k A[m, k] * B[e, n, k]`.
//!
//! * B: NVFP4 expert weights `[E, N, K]` (e2m1 codes, e4m3 scale per 16 along K, fp32 global scale per
//!   (expert, row)); uploaded once with [`DeviceExpertWeights::upload`], which validates them (no NaN scale,
//!   finite positive global scales). The kernel reads the natural row-major layout: no offline swizzle is
//!   needed because each lane-quad reads whole 64-byte row segments (see the .cu header).
//! * A: BF16 rows (gsa = 1) or NVFP4 rows with a per-row fp32 `gsa[m]` (the fused norm + quant output).
//! * Grouping: masked (decode; per-expert slots of fixed capacity, device-side counts, graph-capturable) or
//!   contiguous (prefill; tokens sorted by expert, offsets).
//! * Work is split in two launches: [`launch_partial`] (tensor-core mainloop, fp32 partial sums per K split into
//!   a [`Workspace`]) and one finish kernel: [`launch_finish_bf16`] (plain BF16 output),
//!   [`launch_finish_l1`] (DSV4 SwiGLU with clamp, routing weight, NVFP4 quant with per-row global scale: the L2
//!   input) or [`launch_finish_l2`] (BF16 output combined per token over its top-k rows, fixed order).
//!
//! Non-finite activations: device-resident inputs are produced by our own kernels (which never emit NaN); host
//! inputs go through the CPU quantizer, which rejects them. Device-side counts/offsets are clamped by the
//! kernels, so a bad value can never cause an out-of-bounds access; host-side groupings are validated.

pub mod bench;
pub mod exec;
pub mod prefill;
pub mod reference;

use anyhow::{anyhow, bail, ensure, Result};
use cudarc::driver::CudaSlice;
use half::bf16;
use rand::seq::index::sample;
use rand::Rng;

use crate::gpu::arena::{Arena, WorkspaceLayout};
use crate::gpu::launch::{launch, DevBuf, KernelArgs, Launch, Stream};
use crate::gpu::Gpu;
pub use exec::exec_kernels;
use reference::{ExpertWeights, Grouping, NVFP4_BLOCK};

/// Kernel family name (kernels/moe_gemm.cu).
pub const FAMILY: &str = "moe_gemm";
/// Weight rows per CTA: N must be a multiple of it.
pub const BLOCK_N: usize = 128;
/// K per pipeline stage: K / splits must be a multiple of it.
pub const STAGE_K: usize = 512;
/// Token tiles compiled (MMA N = 8 per n-tile).
pub const TOKEN_TILES: [usize; 4] = [8, 16, 32, 64];
/// Most experts one launch can group (shared-memory prefix in the kernel).
pub const MAX_EXPERTS: usize = 512;
const THREADS: u32 = 256;
/// Block of the L1 finish kernels (`__launch_bounds__(512)`): 4 columns per thread, so I = 2048 is one pass.
const FINISH_L1_THREADS: u32 = 512;

/// `N % 128 == 0`, `K % 512 == 0`: the tile shapes of the kernel (all DSV4 shapes qualify).
pub fn check_gemm_shape(n: usize, k: usize) -> Result<()> {
    ensure!(
        n > 0 && n.is_multiple_of(BLOCK_N),
        "moe_gemm: N = {n} must be a positive multiple of {BLOCK_N}"
    );
    ensure!(
        k > 0 && k.is_multiple_of(STAGE_K),
        "moe_gemm: K = {k} must be a positive multiple of {STAGE_K}"
    );
    ensure!(
        n <= i32::MAX as usize && k <= i32::MAX as usize,
        "moe_gemm: N or K does not fit an i32"
    );
    Ok(())
}

/// Push the activation arguments every mainloop and the pre-pass take: codes or BF16 data, block scales (null
/// for BF16), is_nvfp4.
fn push_activations(args: &mut KernelArgs, a: &DeviceActivations) {
    match a {
        DeviceActivations::Bf16 { data, .. } => args.buf(*data).null().i32(0),
        DeviceActivations::Nvfp4 { codes, scales, .. } => args.buf(*codes).buf(*scales).i32(1),
    };
}

fn as_i32(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| anyhow!("moe_gemm: {what} = {v} does not fit an i32"))
}

/// NVFP4 expert weights on the device.
pub struct DeviceExpertWeights {
    pub experts: usize,
    pub n: usize,
    pub k: usize,
    pub codes: CudaSlice<u8>,
    pub scales: CudaSlice<u8>,
    /// fp32 global scale per (expert, row), `[E, N]`.
    pub global: CudaSlice<f32>,
    /// The same codes and block scales re-laid once (one contiguous block per 256-row tile and 128-K stage,
    /// [`prefill::tile_weights_for_rs`]), or None. Prepared on request ([`DeviceExpertWeights::prepare_prefill_tiling`],
    /// from `codes` / `scales` as they are then: re-prepare after changing them); when present, both routed mainloops
    /// read it ([`prefill::launch_partial_prefill`]: `PrefillKernel::RsWtmaTiled`; [`launch_partial_mma`]: v3t). The
    /// plain copy stays for the SS / RsTma fallbacks and the forcing variants, so the weight memory is doubled.
    pub prefill_tiled: Option<CudaSlice<u8>>,
}

impl DeviceExpertWeights {
    /// Validate (sizes, no NaN block scale, finite positive global scales, tile shape) and upload.
    pub fn upload(gpu: &Gpu, w: &ExpertWeights) -> Result<DeviceExpertWeights> {
        w.validate()?;
        check_gemm_shape(w.n, w.k)?;
        ensure!(
            w.experts >= 1 && w.experts <= MAX_EXPERTS,
            "moe_gemm: {} experts (1..={MAX_EXPERTS})",
            w.experts
        );
        Ok(DeviceExpertWeights {
            experts: w.experts,
            n: w.n,
            k: w.k,
            codes: gpu.upload(&w.rows.codes)?,
            scales: gpu.upload(&w.rows.scales)?,
            global: gpu.upload(&w.rows.global)?,
            prefill_tiled: None,
        })
    }

    /// Re-lay the weights once for the prefill mainloop ([`DeviceExpertWeights::prefill_tiled`]); a no-op (Ok) for
    /// shapes it does not take (N % 256 != 0 or K % 128 != 0), which keep the plain-layout kernels.
    pub fn prepare_prefill_tiling(&mut self, gpu: &Gpu) -> Result<()> {
        if self.prefill_tiled.is_none() && prefill::tiling_fits(self.n, self.k) {
            self.prefill_tiled = Some(prefill::tile_weights_for_rs(gpu, self)?);
        }
        Ok(())
    }

    /// Bytes one expert's weights occupy (codes + block scales + global scales): what a kernel streams per expert.
    pub fn bytes_per_expert(&self) -> usize {
        self.n * self.k / 2 + self.n * self.k / NVFP4_BLOCK + self.n * 4
    }
}

/// The A operand on the device.
pub enum DeviceActivations<'a> {
    Bf16 {
        rows: usize,
        k: usize,
        data: &'a CudaSlice<bf16>,
    },
    Nvfp4 {
        rows: usize,
        k: usize,
        codes: &'a CudaSlice<u8>,
        scales: &'a CudaSlice<u8>,
        global: &'a CudaSlice<f32>,
    },
}

impl DeviceActivations<'_> {
    fn rows_k(&self) -> (usize, usize) {
        match self {
            DeviceActivations::Bf16 { rows, k, .. } | DeviceActivations::Nvfp4 { rows, k, .. } => {
                (*rows, *k)
            }
        }
    }
    fn check(&self) -> Result<()> {
        let (rows, k) = self.rows_k();
        match self {
            DeviceActivations::Bf16 { data, .. } => {
                ensure!(
                    data.len() >= rows * k,
                    "moe_gemm: BF16 A has {} elements, needs {rows} x {k}",
                    data.len()
                )
            }
            DeviceActivations::Nvfp4 {
                codes,
                scales,
                global,
                ..
            } => {
                ensure!(
                    codes.len() >= rows * k / 2,
                    "moe_gemm: NVFP4 A codes {} bytes < {}",
                    codes.len(),
                    rows * k / 2
                );
                ensure!(
                    scales.len() >= rows * k / 16,
                    "moe_gemm: NVFP4 A scales {} < {}",
                    scales.len(),
                    rows * k / 16
                );
                ensure!(
                    global.len() >= rows,
                    "moe_gemm: NVFP4 A has {} global scales for {rows} rows",
                    global.len()
                );
            }
        }
        Ok(())
    }
    fn is_nvfp4(&self) -> bool {
        matches!(self, DeviceActivations::Nvfp4 { .. })
    }
    /// Push the per-row global scale (null for BF16 activations: gsa = 1).
    fn push_gsa(&self, args: &mut KernelArgs) {
        match self {
            DeviceActivations::Bf16 { .. } => args.null(),
            DeviceActivations::Nvfp4 { global, .. } => args.buf(*global),
        };
    }
}

/// A grouping on the device: `group` holds counts[E] (masked) or offsets[E+1] (contiguous).
pub struct DeviceGrouping {
    /// Slots per expert for the masked layout, 0 for contiguous.
    pub capacity: usize,
    pub experts: usize,
    pub rows_total: usize,
    pub group: CudaSlice<i32>,
}

impl DeviceGrouping {
    /// Validate a host grouping and upload it.
    pub fn upload(gpu: &Gpu, g: &Grouping) -> Result<DeviceGrouping> {
        g.validate()?;
        ensure!(
            g.experts() <= MAX_EXPERTS,
            "moe_gemm: {} experts (max {MAX_EXPERTS})",
            g.experts()
        );
        let (capacity, data) = match g {
            Grouping::Masked { capacity, counts } => {
                ensure!(*capacity >= 1, "masked grouping: capacity must be >= 1");
                (*capacity, counts.clone())
            }
            Grouping::Contiguous { offsets } => (0, offsets.clone()),
        };
        as_i32(g.rows_total(), "rows_total")?;
        Ok(DeviceGrouping {
            capacity,
            experts: g.experts(),
            rows_total: g.rows_total(),
            group: gpu.upload(&data)?,
        })
    }
}

/// Launch configuration of the mainloop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmConfig {
    /// Tokens per CTA tile (8, 16, 32 or 64): the MMA N extent.
    pub token_tile: usize,
    /// K splits (fp32 partials, added in the finish kernel).
    pub splits: usize,
    /// Persistent grid size.
    pub ctas: u32,
}

impl GemmConfig {
    /// Heuristic from what the host knows without reading device counts: the expected rows per active expert
    /// and the expected number of active experts. Picks the smallest token tile that holds the rows, then the
    /// K split count with the least estimated time `ceil(items * s / slots) / s` (wave quantization over 2 CTA
    /// slots per SM for tiles <= 16 tokens, 1 above), times 5% per extra split for the fp32 partials. The grid is
    /// then [`MAINLOOP_CTAS_PER_SM_SMALL_TILE`] x SMs for tiles <= 16 (the mainloop holds 3 CTAs per SM there; the
    /// splits stay those chosen for 2 slots per SM, the configuration measured on the H200), SMs above.
    pub fn choose(
        sm_count: usize,
        rows_per_active_expert: f64,
        active_experts: usize,
        n: usize,
        k: usize,
    ) -> GemmConfig {
        let token_tile = TOKEN_TILES
            .iter()
            .copied()
            .find(|&t| t as f64 >= rows_per_active_expert)
            .unwrap_or(64);
        let per_sm = if token_tile <= 16 { 2 } else { 1 };
        let slots = sm_count.max(1) * per_sm;
        let tiles = (rows_per_active_expert / token_tile as f64).ceil().max(1.0) as usize;
        let items = active_experts.max(1) * tiles * (n / BLOCK_N).max(1);
        let cost = |s: usize| {
            (items * s).div_ceil(slots) as f64 / s as f64 * (1.0 + 0.05 * (s - 1) as f64)
        };
        let splits = [1usize, 2, 4, 8]
            .into_iter()
            .filter(|&s| k.is_multiple_of(s * STAGE_K))
            .min_by(|&a, &b| cost(a).total_cmp(&cost(b)))
            .unwrap_or(1);
        let ctas = if token_tile <= 16 {
            sm_count.max(1) * MAINLOOP_CTAS_PER_SM_SMALL_TILE
        } else {
            slots
        };
        GemmConfig {
            token_tile,
            splits,
            ctas: ctas as u32,
        }
    }

    fn check(&self, k: usize) -> Result<()> {
        ensure!(
            TOKEN_TILES.contains(&self.token_tile),
            "moe_gemm: token tile {} not in {TOKEN_TILES:?}",
            self.token_tile
        );
        ensure!(
            self.splits >= 1 && k.is_multiple_of(self.splits * STAGE_K),
            "moe_gemm: K = {k} is not a multiple of splits ({}) x {STAGE_K}",
            self.splits
        );
        ensure!(self.ctas >= 1, "moe_gemm: at least one CTA");
        Ok(())
    }
}

/// CTAs per SM the mma.sync mainloop (`moe_gemm_nvfp4_partial_v3_nt1/2`, `__launch_bounds__(256, 3)`) holds for
/// token tiles <= 16; [`GemmConfig::choose`] sizes the persistent grid with it.
pub const MAINLOOP_CTAS_PER_SM_SMALL_TILE: usize = 3;

/// Most top-k rows per token the L2 combine resolves per CTA (`kFinishMaxTopk` in the kernel).
pub const FINISH_MAX_TOPK: usize = 32;

/// The caller-owned scratch of one grouped GEMM, carved from an [`Arena`] ([`Workspace::carve`]) and sized by
/// [`Workspace::layout`] / [`workspace_bytes`]: the fp32 partial sums `[splits, rows_total, N]` the mainloop
/// writes and a finish kernel reads, and, for a launch that may take the prefill mainloop (contiguous grouping,
/// one K split), the RS pre-pass output `[rows_total, K]` BF16 (the activations in the mainloop's permuted
/// order). Launchers never allocate: every address a launch uses is fixed when the workspace is carved, so a
/// sequence of launches can be captured in a CUDA graph and replayed.
#[derive(Debug, Clone, Copy)]
pub struct Workspace {
    pub splits: usize,
    pub rows_total: usize,
    pub n: usize,
    pub partial: DevBuf<f32>,
    /// The RS pre-pass output; empty when the workspace was carved without it (`prepass_k == 0`).
    pub act_rs: DevBuf<bf16>,
}

/// What a [`Workspace`] holds: `splits` K splits of `rows_total` rows of N partials, and the pre-pass scratch
/// for `prepass_k` columns (0: none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkspaceShape {
    pub splits: usize,
    pub rows_total: usize,
    pub n: usize,
    pub prepass_k: usize,
}

impl WorkspaceShape {
    /// The workspace a launch of `w` over `grp` with `cfg` needs: the pre-pass scratch whenever the grouping is
    /// contiguous with one K split (a launch that [`launch_partial`] may route, or a caller may force, to the
    /// prefill mainloop).
    pub fn for_launch(
        w: &DeviceExpertWeights,
        grp: &DeviceGrouping,
        cfg: &GemmConfig,
    ) -> WorkspaceShape {
        let prefill = grp.capacity == 0 && cfg.splits == 1;
        WorkspaceShape {
            splits: cfg.splits,
            rows_total: grp.rows_total,
            n: w.n,
            prepass_k: if prefill { w.k } else { 0 },
        }
    }
}

/// Device bytes of the [`Workspace`] of `shape` (what the caller's [`Arena`] must hold for it).
pub fn workspace_bytes(shape: &WorkspaceShape) -> usize {
    Workspace::layout(shape).bytes()
}

impl Workspace {
    /// The carves of [`Workspace::carve`], in order (at least one element each: a zero-row grouping still gets
    /// distinct, valid addresses).
    pub fn layout(shape: &WorkspaceShape) -> WorkspaceLayout {
        let mut l = WorkspaceLayout::new();
        l.add::<f32>(Self::partial_len(shape));
        if shape.prepass_k > 0 {
            l.add::<bf16>(shape.rows_total.max(1) * shape.prepass_k);
        }
        l
    }

    fn partial_len(shape: &WorkspaceShape) -> usize {
        shape.splits.max(1) * shape.rows_total.max(1) * shape.n
    }

    /// Carve the workspace of `shape` from `arena` (nothing is written: every launch writes what it reads).
    pub fn carve(arena: &mut Arena, shape: &WorkspaceShape) -> Result<Workspace> {
        let partial = arena.carve::<f32>(Self::partial_len(shape), "moe_gemm fp32 partials")?;
        let act_rs = if shape.prepass_k > 0 {
            arena.carve::<bf16>(
                shape.rows_total.max(1) * shape.prepass_k,
                "moe_gemm prefill pre-pass activations",
            )?
        } else {
            // SAFETY: an empty buffer is never dereferenced (the prefill launcher checks its length first).
            unsafe { DevBuf::from_raw(0, 0) }
        };
        Ok(Workspace {
            splits: shape.splits,
            rows_total: shape.rows_total,
            n: shape.n,
            partial,
            act_rs,
        })
    }
}

/// Mainloop: fp32 partial sums of `A . B^T` (no global scales) into `ws` for every owned row. Contiguous
/// groupings with many rows per expert go to the wgmma prefill kernel ([`prefill::routes_here`]), the rest to
/// the mma.sync kernel ([`launch_partial_mma`]).
pub fn launch_partial(
    gpu: &Gpu,
    stream: &Stream,
    w: &DeviceExpertWeights,
    a: &DeviceActivations,
    grp: &DeviceGrouping,
    cfg: &GemmConfig,
    ws: &Workspace,
) -> Result<()> {
    if prefill::routes_here(w, grp, cfg) {
        return prefill::launch_partial_prefill(gpu, stream, w, a, grp, ws);
    }
    launch_partial_mma(gpu, stream, w, a, grp, cfg, ws)
}

/// The launch checks of the mma.sync decode mainloop (config, A, grouping, workspace against the weights).
fn check_partial_launch(
    w: &DeviceExpertWeights,
    a: &DeviceActivations,
    grp: &DeviceGrouping,
    cfg: &GemmConfig,
    ws: &Workspace,
) -> Result<()> {
    cfg.check(w.k)?;
    a.check()?;
    let (a_rows, a_k) = a.rows_k();
    ensure!(a_k == w.k, "moe_gemm: A has K = {a_k}, weights K = {}", w.k);
    ensure!(
        a_rows >= grp.rows_total,
        "moe_gemm: A has {a_rows} rows, the grouping spans {}",
        grp.rows_total
    );
    ensure!(
        grp.experts == w.experts,
        "moe_gemm: grouping has {} experts, weights {}",
        grp.experts,
        w.experts
    );
    ensure!(
        ws.splits == cfg.splits && ws.rows_total == grp.rows_total && ws.n == w.n,
        "moe_gemm: workspace is [{}, {}, {}], launch needs [{}, {}, {}]",
        ws.splits,
        ws.rows_total,
        ws.n,
        cfg.splits,
        grp.rows_total,
        w.n
    );
    check_partial_len(ws)
}

/// The partials buffer holds the `[splits, rows_total, N]` the workspace's fields claim.
fn check_partial_len(ws: &Workspace) -> Result<()> {
    ensure!(
        ws.partial.len() >= ws.splits.max(1) * ws.rows_total * ws.n,
        "moe_gemm: workspace partials hold {} floats, [{}, {}, {}] needs more",
        ws.partial.len(),
        ws.splits,
        ws.rows_total,
        ws.n
    );
    Ok(())
}

/// The swap-AB mma.sync mainloop (kernels/moe_gemm.cu, `moe_gemm_nvfp4_partial_v3_nt*`) for every grouping and
/// config; [`launch_partial`] routes prefill shapes to the wgmma kernel instead. Shared memory: the permuted BF16
/// activation tile (token_tile x 512 x 2 B) plus the raw cp.async tile, sized for BF16 A (the same again).
/// When the weights carry their tiling ([`DeviceExpertWeights::prefill_tiled`]) it runs `moe_gemm_nvfp4_partial_v3t_nt*`
/// on it: bit-identical partials, faster at every decode point of the session-11 A/B (H200, 1bb6168, whole calls,
/// us, v3 / v3t): Flash L1 1 token 39.1 / 36.3, 8 189.7 / 175.8, 64 738.5 / 702.4, 256 1180.8 / 1120.9; L2 1 26.1 /
/// 25.0, 8 98.1 / 90.4, 64 396.6 / 373.1; Pro L1 1 80.8 / 74.1, 16 764.9 / 720.6. With NVFP4 activations on the
/// tiling, the F16-operand form `moe_gemm_nvfp4_partial_v3th_nt*` ([`DecodeOperands::routed_for`], since session 15).
pub fn launch_partial_mma(
    gpu: &Gpu,
    stream: &Stream,
    w: &DeviceExpertWeights,
    a: &DeviceActivations,
    grp: &DeviceGrouping,
    cfg: &GemmConfig,
    ws: &Workspace,
) -> Result<()> {
    launch_partial_mma_with(
        gpu,
        stream,
        w,
        a,
        grp,
        cfg,
        ws,
        DecodeOperands::routed_for(w, a),
    )
}

/// The operand type of the mma.sync decode mainloop's MMAs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeOperands {
    /// BF16 weight fragments and activations (v3 / v3t): either A format.
    Bf16,
    /// F16 (`moe_gemm_nvfp4_partial_v3th_nt*`): the weight fragments built with fewer integer ops per code
    /// (kernels/common/nvfp4_dequant.cuh, `e2m1_word_to_f16x2_tiny`, `scales_f16x2`); NVFP4 activations and the
    /// tiled weights only (BF16 activations are not exact in f16). Same exact products and mma order as v3t:
    /// bit-identical partials (GPU test). Routed since session 15 (H200, 580c580, whole calls, us, v3t / v3th: Flash
    /// L1 1 token 35.6 / 33.6, 8 176.1 / 153.2, 64 696.4 / 599.2 (64.5% -> 75.0% of copy bandwidth); L2 64 370.2 /
    /// 322.9; Pro L1 64 2117.5 / 1835.4; faster at every decode point, -5% to -14.5%).
    F16,
}

impl DecodeOperands {
    /// [`DecodeOperands::F16`] for NVFP4 activations on weights with the tiled copy, else
    /// [`DecodeOperands::Bf16`].
    pub fn routed_for(w: &DeviceExpertWeights, a: &DeviceActivations) -> DecodeOperands {
        if w.prefill_tiled.is_some() && matches!(a, DeviceActivations::Nvfp4 { .. }) {
            DecodeOperands::F16
        } else {
            DecodeOperands::Bf16
        }
    }
}

/// [`launch_partial_mma`] with a chosen operand type; refuses what the F16 mainloop does not take (BF16
/// activations, weights without their tiled copy) before any launch.
#[allow(clippy::too_many_arguments)]
pub fn launch_partial_mma_with(
    gpu: &Gpu,
    stream: &Stream,
    w: &DeviceExpertWeights,
    a: &DeviceActivations,
    grp: &DeviceGrouping,
    cfg: &GemmConfig,
    ws: &Workspace,
    operands: DecodeOperands,
) -> Result<()> {
    let tiled = w.prefill_tiled.is_some();
    check_partial_launch(w, a, grp, cfg, ws)?;
    if operands == DecodeOperands::F16 {
        ensure!(
            a.is_nvfp4(),
            "moe_gemm decode (F16 operands): needs NVFP4 activations (BF16 values are not exact in f16)"
        );
        ensure!(
            tiled,
            "moe_gemm decode (F16 operands): needs the weights' tiled copy (prepare_prefill_tiling)"
        );
    }
    let name = format!(
        "moe_gemm_nvfp4_partial_{}_nt{}",
        match (tiled, operands) {
            (_, DecodeOperands::F16) => "v3th",
            (true, DecodeOperands::Bf16) => "v3t",
            (false, DecodeOperands::Bf16) => "v3",
        },
        cfg.token_tile / 8
    );
    // The permuted BF16 tile plus the raw tile, sized for BF16 A (token_tile x 512 x 2 B each).
    let smem = 2 * cfg.token_tile * STAGE_K * 2;
    let kern = gpu.kernel_with_smem(FAMILY, &name, smem)?;
    let (n, k) = (as_i32(w.n, "N")?, as_i32(w.k, "K")?);
    let (cap, e, rows) = (
        as_i32(grp.capacity, "capacity")?,
        as_i32(grp.experts, "experts")?,
        as_i32(grp.rows_total, "rows")?,
    );
    let mut args = KernelArgs::new();
    match &w.prefill_tiled {
        Some(t) => args.buf(t),
        None => args.buf(&w.codes),
    };
    args.buf(&w.scales).i32(n).i32(k);
    push_activations(&mut args, a);
    args.buf(&grp.group)
        .i32(cap)
        .i32(e)
        .i32(rows)
        .buf(&ws.partial)
        .i32(cfg.splits as i32);
    // SAFETY: the arguments follow the kernel's signature; check_partial_launch checked every buffer's extent
    // against the shape (A rows, the grouping's rows, the workspace's [splits, rows, N]).
    unsafe {
        launch(
            stream,
            &kern,
            Launch::new((cfg.ctas, 1, 1), (THREADS, 1, 1)).smem(smem),
            &mut args,
        )
    }
}

fn check_finish(ws: &Workspace, grp: &DeviceGrouping, w: &DeviceExpertWeights) -> Result<()> {
    ensure!(
        ws.rows_total == grp.rows_total && ws.n == w.n,
        "moe_gemm finish: workspace does not match the grouping/weights"
    );
    ensure!(
        grp.experts == w.experts,
        "moe_gemm finish: grouping has {} experts, weights {}",
        grp.experts,
        w.experts
    );
    ensure!(
        ws.splits >= 1,
        "moe_gemm finish: the workspace has no K split"
    );
    check_partial_len(ws)
}

/// Plain epilogue: `out[row, n] = bf16(acc * (gsa[row] * gsb[e, n]))`, zeros for rows owned by no expert.
pub fn launch_finish_bf16(
    gpu: &Gpu,
    stream: &Stream,
    ws: &Workspace,
    grp: &DeviceGrouping,
    w: &DeviceExpertWeights,
    a: &DeviceActivations,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    check_finish(ws, grp, w)?;
    ensure!(
        out.len() >= grp.rows_total * w.n,
        "moe_gemm: output has {} elements, needs {} x {}",
        out.len(),
        grp.rows_total,
        w.n
    );
    if grp.rows_total == 0 {
        return Ok(());
    }
    let kern = gpu.kernel(FAMILY, "moe_gemm_finish_bf16")?;
    let mut args = KernelArgs::new();
    args.buf(&ws.partial)
        .i32(ws.splits as i32)
        .buf(&grp.group)
        .i32(grp.capacity as i32)
        .i32(grp.experts as i32)
        .i32(grp.rows_total as i32)
        .i32(w.n as i32);
    a.push_gsa(&mut args);
    args.buf(&w.global).buf(out);
    // SAFETY: arguments in the kernel's order; the partials, grouping and output were checked against the shape.
    unsafe {
        launch(
            stream,
            &kern,
            Launch::new((grp.rows_total as u32, 1, 1), (THREADS, 1, 1)),
            &mut args,
        )
    }
}

/// The L1 output: h quantized to NVFP4 with a per-row global scale (the L2 GEMM's A), and optionally h in fp32.
pub struct L1Output {
    pub rows: usize,
    pub i_dim: usize,
    pub codes: CudaSlice<u8>,
    pub scales: CudaSlice<u8>,
    pub global: CudaSlice<f32>,
    pub h_f32: Option<CudaSlice<f32>>,
}

impl L1Output {
    /// Output buffers, poisoned (0xFF) so that an unwritten element shows up.
    pub fn new(gpu: &Gpu, rows: usize, i_dim: usize, keep_h_f32: bool) -> Result<L1Output> {
        Ok(L1Output {
            rows,
            i_dim,
            codes: gpu.poisoned::<u8>((rows * i_dim / 2).max(1), 0xFF)?,
            scales: gpu.poisoned::<u8>((rows * i_dim / 16).max(1), 0xFF)?,
            global: gpu.poisoned::<f32>(rows.max(1), 0xFF)?,
            h_f32: if keep_h_f32 {
                Some(gpu.poisoned::<f32>((rows * i_dim).max(1), 0xFF)?)
            } else {
                None
            },
        })
    }

    /// This output as the A operand of the L2 GEMM.
    pub fn as_activations(&self) -> DeviceActivations<'_> {
        DeviceActivations::Nvfp4 {
            rows: self.rows,
            k: self.i_dim,
            codes: &self.codes,
            scales: &self.scales,
            global: &self.global,
        }
    }
}

/// L1 epilogue on a W13 = [w1; w3] GEMM (N = 2I): DSV4 SwiGLU with clamp, times `routing[row]`, quantized to
/// NVFP4 with a per-row global scale. Kernel: [`FinishL1Kernel::for_grouping`].
#[allow(clippy::too_many_arguments)]
pub fn launch_finish_l1(
    gpu: &Gpu,
    stream: &Stream,
    ws: &Workspace,
    grp: &DeviceGrouping,
    w13: &DeviceExpertWeights,
    a: &DeviceActivations,
    routing: &CudaSlice<f32>,
    out: &mut L1Output,
) -> Result<()> {
    launch_finish_l1_with(
        gpu,
        stream,
        ws,
        grp,
        w13,
        a,
        routing,
        out,
        FinishL1Kernel::for_grouping(grp, w13.n / 2),
    )
}

/// Which L1 finish kernel [`launch_finish_l1_with`] runs. All share the first pass (split sums, SwiGLU, routing
/// weight, row amax, global scale) and write bit-identical outputs (h, codes, block scales, global scales).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FinishL1Kernel {
    /// `moe_gemm_finish_l1_swiglu_nvfp4_q4` (the default from the session-7 final run to the session-8 A/B; bench
    /// variant `nvfp4_finishq4`, kept one run): every thread quantizes 4 consecutive elements; the 4 lanes of a block
    /// share its amax by two xor-shuffles and each stores its own 2 code bytes. Session-7 final run (f24d816, us,
    /// Flash L1, the removed one-thread-per-block `vec` finish / q4): 1 token 41.86 / 39.14, 8 tokens 180.1 /
    /// 177.5, 64 tokens 775.4 / 770.1; Pro 1 token 84.45 / 82.24; the finish alone under ncu at 1 token 7.7-7.9 /
    /// 6.1-6.2. The tests check it against the CPU quantizer and every other kernel against it.
    Q4,
    /// `moe_gemm_finish_l1_swiglu_nvfp4_pad1b` (the default since the session-8 A/B): q4, except that a CTA whose
    /// row belongs to no expert (a padding slot of the masked layout: 250 of 256 rows at 1 token on Flash) writes
    /// the bytes q4 produces for an all-zero row (codes 0, block scales 0, gs 1.0, h +0) with plain wide stores,
    /// skipping both passes and their barriers, and the real rows take their amax with one barrier instead of two.
    /// Session-8 A/B (727e353, us, q4 / pad1b): Flash L1 1 token 39.42 / 38.27, 8 tokens 176.70 / 175.87, 64
    /// tokens 770.50 / 766.46; Pro 1 token 81.82 / 81.44, 64 tokens 2321.98 / 2302.53. (`pad`, the same without
    /// the one-barrier amax, measured between them and was removed.)
    #[default]
    PadOneBarrier,
    /// `moe_gemm_finish_l1_swiglu_nvfp4_rows_kc{1,2,3,4}` (session 9; routed for contiguous groupings by
    /// [`FinishL1Kernel::for_grouping`]). Session-9 A/B (H200, us, whole Flash L1 call, pad1b / rows): 1024 tokens
    /// 2582.4 / 2482.6, 4096 3628.4 / 3428.9 (the finish alone under ncu 399 / 255), 16384 12508.9 / 12009.3;
    /// masked 64 tokens 778.9 / 768.6, 256 tokens 1198.4 / 1193.9; Pro 4096 12201.3 / 11968.4. Persistent CTAs of 256 threads, each a contiguous range of
    /// up to [`FINISH_L1_ROWS_MAX_ROWS_PER_CTA`] rows; split 0 of the next rows' partials streams through a
    /// per-thread cp.async ring in shared memory while the current row computes; gsb stays in registers while the
    /// expert does; h stays in registers, one barrier per row. The instantiation is picked by I (`kcK` takes
    /// I <= 1024 K; I > 4096 is refused). Splits 1.. (decode) are read without prefetch: correct, not tuned.
    Rows,
    /// `moe_gemm_finish_l1_swiglu_nvfp4_rows_thr_kc{1,2,3,4}` (session-11 candidate, bench variant
    /// `nvfp4_finishrowsthr`): [`FinishL1Kernel::Rows`] with the division-free e2m1 encoder of
    /// kernels/common/e2m1_thresholds.cuh in its quantization step (7 thresholds per lane and 16-block, 3 compares
    /// per element, instead of an IEEE division and the 7-compare ladder; the rows kernel is issue-bound). Falls
    /// back to the division where the thresholds' identities do not hold (scale 0 / non-finite / outside
    /// [2^-100, 2^100], NaN elements): bit-identical outputs. Same instantiations, launcher and limits as Rows.
    RowsThr,
    /// `moe_gemm_finish_l1_swiglu_nvfp4_rows_thr2_kc{1,2,3,4}` (session-12 candidate, bench variant
    /// `nvfp4_finishrowsthr2`): [`FinishL1Kernel::RowsThr`] with fewer instructions per element, bit-identical: a
    /// thread owns 8 elements of a 16-block (quarters q and q + 2) instead of 4, so the block amax takes one shuffle
    /// and the block scale / thresholds are computed once per 8 elements; splits == 1 fuses split 0's `0 + p` into
    /// the scale product (one FFMA, exact when the scale products are > 0: checked per row, else the plain form);
    /// leaner per-row bookkeeping. SASS fast path at Flash kc2: ~69 thread-instructions per element vs RowsThr's
    /// ~93. Same instantiation table (its own ring stages and CTAs per SM: [`FinishL1RowsKind::thr2_stages`]).
    RowsThr2,
}

impl FinishL1Kernel {
    /// The routed L1 finish: [`FinishL1Kernel::RowsThr2`] for a contiguous grouping (prefill) when an instantiation
    /// takes `i_dim`, else [`FinishL1Kernel::PadOneBarrier`] (the masked / decode layout, whose padding rows it writes
    /// directly). Rows won at every contiguous point of the session-9 A/B; RowsThr (its division-free encoder, same
    /// bits) took the finish alone from 255.7 to 214.9 us at Flash L1 4096 tokens and from 362 to 311 us at Pro
    /// 4096 under ncu (session 11, 975b3f0, profile/ncu-moe_gemm-session11-finish.txt); whole calls on the plain
    /// mainloop, Rows / RowsThr: Flash 4096 1979.8 / 1934.6 us, 1024 1197.2 / 1183.6, Pro 4096 6392.2 / 6452.9 (that
    /// point's spread is 5-8%). RowsThr2 (8 elements per thread, the splits-1 FFMA path; same bits) took it further
    /// (session 12, e1eaab5 / 2872ff5, profile/ncu-moe_gemm-session12-ab3.txt): Flash 4096 213.1 -> 179.3 us (147.2 M ->
    /// 108.5 M warp-instructions), Pro 4096 309.2 -> 294.5 us; whole Flash L1 4096 call 1798.1 -> 1767.0 us.
    pub fn for_grouping(grp: &DeviceGrouping, i_dim: usize) -> FinishL1Kernel {
        if grp.capacity == 0 && FinishL1Kernel::RowsThr2.entry(i_dim).is_some() {
            FinishL1Kernel::RowsThr2
        } else {
            FinishL1Kernel::PadOneBarrier
        }
    }

    /// Every L1 finish kernel, q4 first (the tests check it against the CPU quantizer and the others against it).
    pub const ALL: &'static [FinishL1Kernel] = &[
        FinishL1Kernel::Q4,
        FinishL1Kernel::PadOneBarrier,
        FinishL1Kernel::Rows,
        FinishL1Kernel::RowsThr,
        FinishL1Kernel::RowsThr2,
    ];

    /// The kernel's entry point in kernels/moe_gemm.cu for inner dimension `i_dim` (Rows: the instantiation whose
    /// chunks per thread cover I / 4; None when I is larger than every instantiation takes).
    pub fn entry(self, i_dim: usize) -> Option<&'static str> {
        match self {
            FinishL1Kernel::Q4 => Some("moe_gemm_finish_l1_swiglu_nvfp4_q4"),
            FinishL1Kernel::PadOneBarrier => Some("moe_gemm_finish_l1_swiglu_nvfp4_pad1b"),
            FinishL1Kernel::Rows => FinishL1RowsKind::for_i_dim(i_dim).map(|k| k.entry),
            FinishL1Kernel::RowsThr => FinishL1RowsKind::for_i_dim(i_dim).map(|k| k.thr_entry),
            FinishL1Kernel::RowsThr2 => FinishL1RowsKind::for_i_dim(i_dim).map(|k| k.thr2_entry),
        }
    }
}

/// Threads of the rows L1 finish (`kFinishL1RowsThreads` in kernels/moe_gemm.cu).
const FINISH_L1_ROWS_THREADS: usize = 256;
/// Most rows one CTA of the rows L1 finish owns (`kFinishL1RowsMaxRowsPerCta`: one metadata row per thread).
pub const FINISH_L1_ROWS_MAX_ROWS_PER_CTA: usize = 256;

/// One instantiation of the rows L1 finish (`MOE_FINISH_L1_ROWS(KC, STAGES, MINB)` in kernels/moe_gemm.cu; the
/// table below must match it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FinishL1RowsKind {
    pub entry: &'static str,
    /// The same instantiation with the division-free encoder ([`FinishL1Kernel::RowsThr`]).
    pub thr_entry: &'static str,
    /// [`FinishL1Kernel::RowsThr2`] for the same I range (`MOE_FINISH_L1_ROWS_THR2(KC, STAGES, MINB)`).
    pub thr2_entry: &'static str,
    /// RowsThr2's ring stages (its ring slot holds ceil(KC / 2) * 2 units per thread and matrix).
    pub thr2_stages: usize,
    /// RowsThr2's CTAs per SM (kc3: 2, its 128 registers; RowsThr's 80-register bound spilled 61 LDL/STL).
    pub thr2_ctas_per_sm: usize,
    /// Chunks of 4 h columns per thread: takes I / 4 <= chunks_per_thread * 256.
    pub chunks_per_thread: usize,
    /// Rows in the per-thread cp.async ring (stages - 1 rows are prefetched).
    pub stages: usize,
    /// CTAs per SM the launch bounds, registers and ring allow (the launcher sizes one wave with it).
    pub ctas_per_sm: usize,
}

const FINISH_L1_ROWS_KINDS: [FinishL1RowsKind; 4] = [
    FinishL1RowsKind {
        entry: "moe_gemm_finish_l1_swiglu_nvfp4_rows_kc1",
        thr_entry: "moe_gemm_finish_l1_swiglu_nvfp4_rows_thr_kc1",
        thr2_entry: "moe_gemm_finish_l1_swiglu_nvfp4_rows_thr2_kc1",
        thr2_stages: 4,
        thr2_ctas_per_sm: 3,
        chunks_per_thread: 1,
        stages: 8,
        ctas_per_sm: 3,
    },
    FinishL1RowsKind {
        entry: "moe_gemm_finish_l1_swiglu_nvfp4_rows_kc2",
        thr_entry: "moe_gemm_finish_l1_swiglu_nvfp4_rows_thr_kc2",
        thr2_entry: "moe_gemm_finish_l1_swiglu_nvfp4_rows_thr2_kc2",
        thr2_stages: 4,
        thr2_ctas_per_sm: 3,
        chunks_per_thread: 2,
        stages: 4,
        ctas_per_sm: 3,
    },
    FinishL1RowsKind {
        entry: "moe_gemm_finish_l1_swiglu_nvfp4_rows_kc3",
        thr_entry: "moe_gemm_finish_l1_swiglu_nvfp4_rows_thr_kc3",
        thr2_entry: "moe_gemm_finish_l1_swiglu_nvfp4_rows_thr2_kc3",
        thr2_stages: 2,
        thr2_ctas_per_sm: 2,
        chunks_per_thread: 3,
        stages: 2,
        ctas_per_sm: 3,
    },
    FinishL1RowsKind {
        entry: "moe_gemm_finish_l1_swiglu_nvfp4_rows_kc4",
        thr_entry: "moe_gemm_finish_l1_swiglu_nvfp4_rows_thr_kc4",
        thr2_entry: "moe_gemm_finish_l1_swiglu_nvfp4_rows_thr2_kc4",
        thr2_stages: 2,
        thr2_ctas_per_sm: 2,
        chunks_per_thread: 4,
        stages: 2,
        ctas_per_sm: 2,
    },
];

impl FinishL1RowsKind {
    /// The smallest instantiation whose threads cover the I / 4 chunks of a row (Flash I = 2048: kc2, Pro 3072:
    /// kc3); None above I = 4096.
    pub fn for_i_dim(i_dim: usize) -> Option<FinishL1RowsKind> {
        let chunks = i_dim / 4;
        FINISH_L1_ROWS_KINDS
            .iter()
            .copied()
            .find(|k| chunks <= k.chunks_per_thread * FINISH_L1_ROWS_THREADS)
    }

    /// Dynamic shared memory: the ring, stages x chunks x (gate, up) x 256 threads x 16 bytes.
    pub fn ring_bytes(&self) -> usize {
        self.stages * self.chunks_per_thread * 2 * FINISH_L1_ROWS_THREADS * 16
    }

    /// RowsThr2's ring: thr2_stages x 2 ceil(KC / 2) units x (gate, up) x 256 threads x 16 bytes.
    pub fn thr2_ring_bytes(&self) -> usize {
        self.thr2_stages * self.chunks_per_thread.div_ceil(2) * 2 * 2 * FINISH_L1_ROWS_THREADS * 16
    }

    /// The ring bytes of rows kernel `kernel` (RowsThr2 has its own ring; Rows and RowsThr share one).
    pub fn ring_bytes_for(&self, kernel: FinishL1Kernel) -> usize {
        if kernel == FinishL1Kernel::RowsThr2 {
            self.thr2_ring_bytes()
        } else {
            self.ring_bytes()
        }
    }

    /// [`FinishL1RowsKind::default_rows_per_cta`] for rows kernel `kernel` (RowsThr2 with its own CTAs per SM).
    pub fn default_rows_per_cta_for(
        &self,
        kernel: FinishL1Kernel,
        rows: usize,
        sm_count: usize,
    ) -> usize {
        if kernel == FinishL1Kernel::RowsThr2 {
            let resident = (sm_count * self.thr2_ctas_per_sm).max(1);
            rows.div_ceil(resident)
                .clamp(1, FINISH_L1_ROWS_MAX_ROWS_PER_CTA)
        } else {
            self.default_rows_per_cta(rows, sm_count)
        }
    }

    /// Rows per CTA for `rows` rows on `sm_count` SMs: one wave of resident CTAs (ceil(rows / resident)), at least
    /// 1 and at most [`FINISH_L1_ROWS_MAX_ROWS_PER_CTA`] (more rows than that take more waves).
    pub fn default_rows_per_cta(&self, rows: usize, sm_count: usize) -> usize {
        let resident = (sm_count * self.ctas_per_sm).max(1);
        rows.div_ceil(resident)
            .clamp(1, FINISH_L1_ROWS_MAX_ROWS_PER_CTA)
    }
}

/// [`launch_finish_l1`] with an explicit finish kernel (same checks, same output contract).
#[allow(clippy::too_many_arguments)]
pub fn launch_finish_l1_with(
    gpu: &Gpu,
    stream: &Stream,
    ws: &Workspace,
    grp: &DeviceGrouping,
    w13: &DeviceExpertWeights,
    a: &DeviceActivations,
    routing: &CudaSlice<f32>,
    out: &mut L1Output,
    kernel: FinishL1Kernel,
) -> Result<()> {
    if matches!(
        kernel,
        FinishL1Kernel::Rows | FinishL1Kernel::RowsThr | FinishL1Kernel::RowsThr2
    ) {
        let i_dim = w13.n / 2;
        let kind = FinishL1RowsKind::for_i_dim(i_dim)
            .ok_or_else(|| anyhow!("moe_gemm L1: the rows finish takes I <= 4096, I = {i_dim}"))?;
        let rows_per_cta =
            kind.default_rows_per_cta_for(kernel, grp.rows_total, gpu.info.sm_count as usize);
        return launch_finish_l1_rows_with(
            gpu,
            stream,
            ws,
            grp,
            w13,
            a,
            routing,
            out,
            kernel,
            rows_per_cta,
        );
    }
    check_finish_l1(ws, grp, w13, routing, out)?;
    let i_dim = w13.n / 2;
    let smem = (i_dim * 4) as u32;
    ensure!(
        smem as usize <= gpu.info.max_smem_per_block_optin,
        "moe_gemm L1: I = {i_dim} needs {smem} B of shared memory"
    );
    if grp.rows_total == 0 {
        return Ok(());
    }
    // Every L1 finish kernel is `__launch_bounds__(512)`; the q4 pass 2 also needs the block to be whole warps (lane ==
    // chunk % 32), which 512 is, and PadOneBarrier exactly 16 warps (kFinishL1Threads in kernels/moe_gemm.cu).
    let name = kernel
        .entry(i_dim)
        .ok_or_else(|| anyhow!("moe_gemm L1: no {kernel:?} kernel for I = {i_dim}"))?;
    let kern = gpu.kernel_with_smem(FAMILY, name, smem as usize)?;
    let mut args = finish_l1_args(ws, grp, w13, a, routing, out);
    // SAFETY: arguments in the kernel's order; check_finish_l1 checked every buffer against the shape.
    unsafe {
        launch(
            stream,
            &kern,
            Launch::new((grp.rows_total as u32, 1, 1), (FINISH_L1_THREADS, 1, 1))
                .smem(smem as usize),
            &mut args,
        )
    }
}

/// A rows L1 finish (`kernel` = [`FinishL1Kernel::Rows`], [`FinishL1Kernel::RowsThr`] or
/// [`FinishL1Kernel::RowsThr2`]: same instantiation table and arguments; the entry point differs, and RowsThr2's
/// ring size) with an explicit number of rows per CTA (1 ..=
/// [`FINISH_L1_ROWS_MAX_ROWS_PER_CTA`]; [`launch_finish_l1_with`] takes
/// [`FinishL1RowsKind::default_rows_per_cta`]). The tests force small and odd values so that the ring wraps, the
/// expert changes inside a CTA and the last CTA owns fewer rows. Same checks and output contract as
/// [`launch_finish_l1`].
#[allow(clippy::too_many_arguments)]
pub fn launch_finish_l1_rows_with(
    gpu: &Gpu,
    stream: &Stream,
    ws: &Workspace,
    grp: &DeviceGrouping,
    w13: &DeviceExpertWeights,
    a: &DeviceActivations,
    routing: &CudaSlice<f32>,
    out: &mut L1Output,
    kernel: FinishL1Kernel,
    rows_per_cta: usize,
) -> Result<()> {
    check_finish_l1(ws, grp, w13, routing, out)?;
    let i_dim = w13.n / 2;
    let kind = FinishL1RowsKind::for_i_dim(i_dim)
        .ok_or_else(|| anyhow!("moe_gemm L1: the rows finish takes I <= 4096, I = {i_dim}"))?;
    let entry = match kernel {
        FinishL1Kernel::Rows => kind.entry,
        FinishL1Kernel::RowsThr => kind.thr_entry,
        FinishL1Kernel::RowsThr2 => kind.thr2_entry,
        other => bail!("moe_gemm L1: {other:?} is not a rows finish kernel"),
    };
    ensure!(
        ws.splits >= 1,
        "moe_gemm L1: the rows finish needs >= 1 K split (it streams split 0)"
    );
    ensure!(
        (1..=FINISH_L1_ROWS_MAX_ROWS_PER_CTA).contains(&rows_per_cta),
        "moe_gemm L1: rows per CTA = {rows_per_cta}, must be 1..={FINISH_L1_ROWS_MAX_ROWS_PER_CTA}"
    );
    if grp.rows_total == 0 {
        return Ok(());
    }
    // Every CTA owns >= 1 row: ceil(rows / rows_per_cta) CTAs.
    let grid = grp.rows_total.div_ceil(rows_per_cta);
    ensure!(
        grid <= u32::MAX as usize,
        "moe_gemm L1: {grid} CTAs exceed the grid"
    );
    let smem = kind.ring_bytes_for(kernel);
    let kern = gpu.kernel_with_smem(FAMILY, entry, smem)?;
    let mut args = finish_l1_args(ws, grp, w13, a, routing, out);
    args.i32(rows_per_cta as i32);
    // SAFETY: arguments in the kernel's order; check_finish_l1 checked every buffer against the shape.
    unsafe {
        launch(
            stream,
            &kern,
            Launch::new((grid as u32, 1, 1), (FINISH_L1_ROWS_THREADS as u32, 1, 1)).smem(smem),
            &mut args,
        )
    }
}

/// The arguments every L1 finish kernel takes, in order (partial .. h_out; null h_out when h is not kept).
fn finish_l1_args(
    ws: &Workspace,
    grp: &DeviceGrouping,
    w13: &DeviceExpertWeights,
    a: &DeviceActivations,
    routing: &CudaSlice<f32>,
    out: &L1Output,
) -> KernelArgs {
    let mut args = KernelArgs::new();
    args.buf(&ws.partial)
        .i32(ws.splits as i32)
        .buf(&grp.group)
        .i32(grp.capacity as i32)
        .i32(grp.experts as i32)
        .i32(grp.rows_total as i32)
        .i32((w13.n / 2) as i32);
    a.push_gsa(&mut args);
    args.buf(&w13.global)
        .buf(routing)
        .buf(&out.codes)
        .buf(&out.scales)
        .buf(&out.global);
    match &out.h_f32 {
        Some(h) => args.buf(h),
        None => args.null(),
    };
    args
}

/// The checks every L1 finish launch makes before anything runs (shapes, the output, the routing weights).
fn check_finish_l1(
    ws: &Workspace,
    grp: &DeviceGrouping,
    w13: &DeviceExpertWeights,
    routing: &CudaSlice<f32>,
    out: &L1Output,
) -> Result<()> {
    check_finish(ws, grp, w13)?;
    ensure!(
        w13.n.is_multiple_of(2),
        "moe_gemm L1: N = {} must be 2 * I",
        w13.n
    );
    let i_dim = w13.n / 2;
    ensure!(
        i_dim.is_multiple_of(16),
        "moe_gemm L1: I = {i_dim} must be a multiple of 16"
    );
    ensure!(
        out.rows == grp.rows_total && out.i_dim == i_dim,
        "moe_gemm L1: output is {} x {}, needs {} x {i_dim}",
        out.rows,
        out.i_dim,
        grp.rows_total
    );
    ensure!(
        routing.len() >= grp.rows_total,
        "moe_gemm L1: {} routing weights for {} rows",
        routing.len(),
        grp.rows_total
    );
    ensure!(
        grp.rows_total <= i32::MAX as usize,
        "moe_gemm L1: {} rows exceed the kernels' int row index",
        grp.rows_total
    );
    Ok(())
}

/// L2 epilogue: `out[t, n] = bf16(sum_j acc(rows[t, j], n) * gsa * gsb)` in routing order (deterministic).
/// `token_rows` is `[tokens, topk]`, -1 where a token has fewer routed rows; topk <= [`FINISH_MAX_TOPK`]. The
/// combine kernel is [`FinishL2Kernel::for_tokens`]: RowWarps up to [`L2_ROWWARPS_MAX_TOKENS`] tokens, Cols2 above,
/// Cols2Tok from [`L2_COLS2TOK_MIN_TOKENS`] (Cols for an odd N); all give the same bits.
#[allow(clippy::too_many_arguments)]
pub fn launch_finish_l2(
    gpu: &Gpu,
    stream: &Stream,
    ws: &Workspace,
    grp: &DeviceGrouping,
    w2: &DeviceExpertWeights,
    a: &DeviceActivations,
    token_rows: &CudaSlice<i32>,
    topk: usize,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    launch_finish_l2_with(
        gpu,
        stream,
        ws,
        grp,
        w2,
        a,
        token_rows,
        topk,
        out,
        FinishL2Kernel::for_tokens(token_rows.len() / topk.max(1), w2.n),
    )
}

/// Which L2 combine kernel [`launch_finish_l2_with`] runs (bit-identical outputs). [`launch_finish_l2`] takes
/// [`FinishL2Kernel::for_tokens`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishL2Kernel {
    /// `moe_gemm_finish_l2_combine_cols`: one column per thread; the token's rows, experts and gsa staged in shared
    /// memory by `topk` threads, a barrier, then the column loads, each of the 8 rows x 4 splits loads of a pass and
    /// its add under its own validity predicate, which ptxas interleaves (~12 dependent round trips). The default
    /// at every token count until session 8; now only for an odd N (bench variant `nvfp4_l2cols` forces it).
    Cols,
    /// `moe_gemm_finish_l2_combine_rowwarps`: grid `tokens x ceil(N / 32)`, one warp per routed row (slot) and
    /// 32 columns per CTA, each warp's split loads in flight together, then warp 0 combines the slots in routing
    /// order. The default up to [`L2_ROWWARPS_MAX_TOKENS`] tokens (bench variant `nvfp4_l2rowwarps` forces it).
    RowWarps,
    /// `moe_gemm_finish_l2_combine_cols2`: 2 columns per thread (float2 loads), the token's valid slots compacted
    /// by warp 0, every load of a pass unconditional. Needs N % 2 == 0 (checked before the launch). The default
    /// above [`L2_ROWWARPS_MAX_TOKENS`] and below [`L2_COLS2TOK_MIN_TOKENS`] tokens (bench variant `nvfp4_l2cols2`
    /// forces it). Session-8 final run
    /// (318bcad, us, whole L2 call, Cols / Cols2; rows of one sweep each): Flash 64 tokens 411.3 / 378.7, 4096
    /// tokens 2304.8 / 1862.3, 16384 tokens 8322.4 / 6569.8; Pro 64 tokens 1177.8 / 1127.6; the combine alone
    /// under ncu at 4096 tokens 662 / 209 us, at 1 token 9.6-9.9 / 7.8-8.1 (RowWarps 4.3).
    Cols2,
    /// `moe_gemm_finish_l2_combine_cols2_tok`: Cols2's per-column code with one CTA per token over all N columns,
    /// so the token's slot table (a chain of dependent loads) is built once per token instead of once per 512
    /// columns. Needs N % 2 == 0. The default from [`L2_COLS2TOK_MIN_TOKENS`] tokens (bench variant
    /// `nvfp4_l2cols2tok` forces it).
    Cols2Tok,
}

/// Fewest tokens for which [`FinishL2Kernel::for_tokens`] picks [`FinishL2Kernel::Cols2Tok`] over Cols2. Session-11
/// A/B (H200, 8b622ad, whole L2 call, us, Cols2 / Cols2Tok): Flash 16 tokens 170.1 / 170.9, 64 410.0 / 410.1, 512
/// 629.6 / 623.1, 1024 662.6 / 653.2, 4096 1093.8 / 1063.6, 16384 4043.6 / 3769.9; Pro 4096 3290.1 / 3108.0. 512 is
/// the fewest measured tokens where it won; between 64 and 512 nothing was measured, so Cols2 stays there.
pub const L2_COLS2TOK_MIN_TOKENS: usize = 512;

/// Most tokens for which [`FinishL2Kernel::for_tokens`] picks [`FinishL2Kernel::RowWarps`]. Session-8 A/B (727e353,
/// us, whole L2 call, Cols / RowWarps): Flash 1 token 29.60 / 25.31, 8 tokens 98.11 / 97.38, 64 tokens 406.24 /
/// 412.42, 4096 tokens 2317 / 3089; Pro 1 token 50.53 / 47.55, 64 tokens 1168.3 / 1179.7. The finish alone under
/// ncu at Flash 1 token: 9.8-10.1 / 4.5 us; at 4096 tokens 667 / 1,440 us (its 2 barriers and serial slot
/// combine per 32 columns). 8 is the largest measured count where RowWarps won.
pub const L2_ROWWARPS_MAX_TOKENS: usize = 8;

impl FinishL2Kernel {
    /// Every L2 combine kernel, Cols first (the tests compare the others against it bit for bit).
    pub const ALL: &'static [FinishL2Kernel] = &[
        FinishL2Kernel::Cols,
        FinishL2Kernel::RowWarps,
        FinishL2Kernel::Cols2,
        FinishL2Kernel::Cols2Tok,
    ];

    /// The kernel [`launch_finish_l2`] runs for `tokens` tokens of `n` output columns: RowWarps up to
    /// [`L2_ROWWARPS_MAX_TOKENS`] tokens, Cols2 above, Cols2Tok from [`L2_COLS2TOK_MIN_TOKENS`] (Cols when N is odd,
    /// which neither Cols2 kernel takes).
    pub fn for_tokens(tokens: usize, n: usize) -> FinishL2Kernel {
        if tokens <= L2_ROWWARPS_MAX_TOKENS {
            FinishL2Kernel::RowWarps
        } else if !n.is_multiple_of(2) {
            FinishL2Kernel::Cols
        } else if tokens >= L2_COLS2TOK_MIN_TOKENS {
            FinishL2Kernel::Cols2Tok
        } else {
            FinishL2Kernel::Cols2
        }
    }

    /// The kernel's entry point in kernels/moe_gemm.cu.
    pub fn entry(self) -> &'static str {
        match self {
            FinishL2Kernel::Cols => "moe_gemm_finish_l2_combine_cols",
            FinishL2Kernel::RowWarps => "moe_gemm_finish_l2_combine_rowwarps",
            FinishL2Kernel::Cols2 => "moe_gemm_finish_l2_combine_cols2",
            FinishL2Kernel::Cols2Tok => "moe_gemm_finish_l2_combine_cols2_tok",
        }
    }
}

/// [`launch_finish_l2`] with an explicit combine kernel (same checks, same output contract).
#[allow(clippy::too_many_arguments)]
pub fn launch_finish_l2_with(
    gpu: &Gpu,
    stream: &Stream,
    ws: &Workspace,
    grp: &DeviceGrouping,
    w2: &DeviceExpertWeights,
    a: &DeviceActivations,
    token_rows: &CudaSlice<i32>,
    topk: usize,
    out: &mut CudaSlice<bf16>,
    kernel: FinishL2Kernel,
) -> Result<()> {
    check_finish(ws, grp, w2)?;
    ensure!(topk >= 1, "moe_gemm L2: topk must be >= 1");
    let tokens = token_rows.len() / topk;
    ensure!(
        token_rows.len() == tokens * topk,
        "moe_gemm L2: token_rows length {} is not tokens x {topk}",
        token_rows.len()
    );
    ensure!(
        out.len() >= tokens * w2.n,
        "moe_gemm L2: output has {} elements, needs {tokens} x {}",
        out.len(),
        w2.n
    );
    if tokens == 0 {
        return Ok(());
    }
    ensure!(
        topk <= FINISH_MAX_TOPK,
        "moe_gemm L2: topk = {topk} > {FINISH_MAX_TOPK} (combine kernel limit)"
    );
    ensure!(
        tokens <= u32::MAX as usize,
        "moe_gemm L2: {tokens} tokens exceed the grid"
    );
    let name = kernel.entry();
    // Columns and threads per CTA: Cols one column per thread (256), RowWarps one per lane of each slot warp (32 of
    // 256 threads), Cols2 2 per thread (512 of 256 threads), Cols2Tok all N (N % 2 == 0 for their float2 rows).
    if matches!(kernel, FinishL2Kernel::Cols2 | FinishL2Kernel::Cols2Tok) {
        ensure!(
            w2.n.is_multiple_of(2),
            "moe_gemm L2: {name} needs N % 2 == 0 (float2 rows), N = {}",
            w2.n
        );
    }
    let (cols_per_cta, block) = match kernel {
        FinishL2Kernel::Cols => (THREADS as usize, THREADS),
        FinishL2Kernel::RowWarps => (32, THREADS),
        FinishL2Kernel::Cols2 => (512, THREADS),
        FinishL2Kernel::Cols2Tok => (w2.n.max(1), THREADS),
    };
    let grid = (tokens as u32, w2.n.div_ceil(cols_per_cta) as u32, 1);
    let kern = gpu.kernel(FAMILY, name)?;
    let mut args = KernelArgs::new();
    args.buf(&ws.partial)
        .i32(ws.splits as i32)
        .buf(&grp.group)
        .i32(grp.capacity as i32)
        .i32(grp.experts as i32)
        .i32(grp.rows_total as i32)
        .i32(w2.n as i32);
    a.push_gsa(&mut args);
    args.buf(&w2.global)
        .buf(token_rows)
        .i32(topk as i32)
        .buf(out);
    // SAFETY: arguments in the kernel's order; the partials, token_rows and output were checked against the shape.
    unsafe { launch(stream, &kern, Launch::new(grid, (block, 1, 1)), &mut args) }
}

/// Mainloop + plain BF16 epilogue.
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemm_bf16(
    gpu: &Gpu,
    stream: &Stream,
    w: &DeviceExpertWeights,
    a: &DeviceActivations,
    grp: &DeviceGrouping,
    cfg: &GemmConfig,
    ws: &Workspace,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    launch_partial(gpu, stream, w, a, grp, cfg, ws)?;
    launch_finish_bf16(gpu, stream, ws, grp, w, a, out)
}

/// A routed batch: each token picks `topk` distinct experts; rows are grouped by expert.
#[derive(Debug, Clone)]
pub struct RoutedBatch {
    pub tokens: usize,
    pub topk: usize,
    /// `experts_of[t * topk + j]`: the j-th expert of token t.
    pub experts_of: Vec<usize>,
    /// Row (slot) of the pair (t, j) in the grouped layout: `[tokens, topk]`.
    pub token_rows: Vec<i32>,
    /// Token of each row (`-1` for padding slots): used to gather A rows.
    pub row_token: Vec<i32>,
    pub grouping: Grouping,
}

impl RoutedBatch {
    /// Uniform random top-k routing. `masked_capacity`: `Some(c)` for the masked layout (c >= the largest
    /// count, or an error), `None` for contiguous. Rows of an expert are in token order.
    pub fn random(
        rng: &mut impl Rng,
        tokens: usize,
        experts: usize,
        topk: usize,
        masked_capacity: Option<usize>,
    ) -> Result<RoutedBatch> {
        ensure!(
            topk >= 1 && topk <= experts,
            "routing: top-{topk} of {experts} experts"
        );
        let experts_of: Vec<usize> = (0..tokens)
            .flat_map(|_| sample(rng, experts, topk).into_vec())
            .collect();
        Self::from_choices(tokens, experts, topk, experts_of, masked_capacity)
    }

    /// Build the layout from explicit choices.
    pub fn from_choices(
        tokens: usize,
        experts: usize,
        topk: usize,
        experts_of: Vec<usize>,
        masked_capacity: Option<usize>,
    ) -> Result<RoutedBatch> {
        ensure!(
            experts_of.len() == tokens * topk,
            "routing: {} choices for {tokens} x {topk}",
            experts_of.len()
        );
        if let Some(&e) = experts_of.iter().find(|&&e| e >= experts) {
            bail!("routing: expert {e} out of range ({experts} experts)");
        }
        let mut per_expert: Vec<Vec<(usize, usize)>> = vec![Vec::new(); experts];
        for t in 0..tokens {
            for j in 0..topk {
                per_expert[experts_of[t * topk + j]].push((t, j));
            }
        }
        let mut token_rows = vec![-1i32; tokens * topk];
        let (grouping, rows_total) = match masked_capacity {
            Some(cap) => {
                let most = per_expert.iter().map(|v| v.len()).max().unwrap_or(0);
                ensure!(
                    most <= cap,
                    "routing: an expert got {most} rows, masked capacity is {cap}"
                );
                (
                    Grouping::Masked {
                        capacity: cap,
                        counts: per_expert.iter().map(|v| v.len() as i32).collect(),
                    },
                    cap * experts,
                )
            }
            None => {
                let mut offsets = vec![0i32];
                for v in &per_expert {
                    offsets.push(offsets.last().unwrap() + v.len() as i32);
                }
                let total = *offsets.last().unwrap() as usize;
                (Grouping::Contiguous { offsets }, total)
            }
        };
        let mut row_token = vec![-1i32; rows_total];
        for (e, pairs) in per_expert.iter().enumerate() {
            let start = grouping.expert_rows(e).start;
            for (i, &(t, j)) in pairs.iter().enumerate() {
                token_rows[t * topk + j] = (start + i) as i32;
                row_token[start + i] = t as i32;
            }
        }
        Ok(RoutedBatch {
            tokens,
            topk,
            experts_of,
            token_rows,
            row_token,
            grouping,
        })
    }

    /// Expert of the row holding pair (t, j).
    pub fn expert(&self, t: usize, j: usize) -> usize {
        self.experts_of[t * self.topk + j]
    }
}

#[cfg(test)]
mod finish_l1_rows_kind_tests {
    use super::*;

    /// RowsThr2's ring plus its static shared memory (s_meta 4 KB + s_red 64 B) and the 1 KB the driver reserves per
    /// CTA fit its CTAs per SM into the H200's 228 KB of shared memory per SM, and every ring fits one CTA's opt-in
    /// limit (227 KB): otherwise the launcher's one-wave rows per CTA would assume CTAs that cannot be resident.
    #[test]
    fn rows_thr2_rings_fit_their_ctas_per_sm() {
        for k in FINISH_L1_ROWS_KINDS {
            let per_cta = k.thr2_ring_bytes() + 4096 + 64 + 1024;
            assert!(k.thr2_ring_bytes() <= 227 * 1024, "{k:?}");
            assert!(k.thr2_ctas_per_sm * per_cta <= 228 * 1024, "{k:?}");
            assert_eq!(
                k.ring_bytes_for(FinishL1Kernel::RowsThr2),
                k.thr2_ring_bytes()
            );
            assert_eq!(k.ring_bytes_for(FinishL1Kernel::RowsThr), k.ring_bytes());
        }
        assert_eq!(
            FinishL1Kernel::RowsThr2.entry(2048),
            Some("moe_gemm_finish_l1_swiglu_nvfp4_rows_thr2_kc2")
        );
        assert_eq!(
            FinishL1Kernel::RowsThr2.entry(3072),
            Some("moe_gemm_finish_l1_swiglu_nvfp4_rows_thr2_kc3")
        );
        assert_eq!(FinishL1Kernel::RowsThr2.entry(4112), None);
    }
}
