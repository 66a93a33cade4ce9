//! NVFP4 MoE grouped GEMM (kernels/moe_gemm.cu): `D[m, n] = gsa[m] * gsb[e, n] * sum_k A[m, k] * B[e, n, k]`.
//!
//! * B: NVFP4 expert weights `[E, N, K]` (e2m1 codes, e4m3 scale per 16 along K, fp32 global scale per
//!   (expert, row)); uploaded once with [`DeviceExpertWeights::upload`], which validates them (no NaN scale,
//!   finite positive global scales) and keeps them on the device only in the tiling both routed mainloops read
//!   ([`DeviceExpertWeights::tiled`]: one contiguous block per 256-row tile and 128-K stage; `N % 256 == 0`).
//! * A: BF16 rows (gsa = 1) or NVFP4 rows with a per-row fp32 `gsa[m]` (the fused norm + quant output).
//! * Grouping: masked (decode; per-expert slots of fixed capacity, device-side counts, graph-capturable) or
//!   contiguous (prefill; tokens sorted by expert, offsets).
//! * Work is split in two launches: [`launch_partial`] (tensor-core mainloop, fp32 partial sums per K split into
//!   a caller-owned [`Workspace`] carved from an arena, sized by [`workspace_bytes`]; the decode mma.sync mainloop
//!   here, the prefill wgmma mainloop in [`prefill`]) and one finish kernel ([`finish`]): [`launch_finish_bf16`]
//!   (plain BF16 output),
//!   [`launch_finish_l1`] (DSV4 SwiGLU with clamp, routing weight, NVFP4 quant with per-row global scale: the L2
//!   input) or [`launch_finish_l2`] (BF16 output combined per token over its top-k rows, fixed order).
//!
//! Every launcher takes the stream it enqueues on and allocates nothing; the masked (decode) path reads every
//! per-expert count on the device and sizes its grids from capacities, so a decode step can be captured once in a
//! CUDA graph and replayed with new counts (GPU test `gpu_decode_step_replays_as_a_graph_with_new_device_counts`).
//!
//! Non-finite activations: device-resident inputs are produced by our own kernels (which never emit NaN); host
//! inputs go through the CPU quantizer, which rejects them. Device-side counts/offsets are clamped by the
//! kernels, so a bad value can never cause an out-of-bounds access; host-side groupings are validated.

pub mod bench;
pub mod exec;
pub mod finish;
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
pub use finish::*;
use reference::{ExpertWeights, Grouping, NVFP4_BLOCK};

/// Kernel family name (kernels/moe_gemm.cu).
pub const FAMILY: &str = "moe_gemm";
/// Weight rows per CTA of the decode mainloop.
pub const BLOCK_N: usize = 128;
/// N must be a multiple of it: the weights' tiling (256-row tiles, [`prefill::TILE_N`]) that both mainloops read.
pub const N_MULTIPLE: usize = prefill::TILE_N;
/// K per pipeline stage: K / splits must be a multiple of it.
pub const STAGE_K: usize = 512;
/// Token tiles compiled (MMA N = 8 per n-tile).
pub const TOKEN_TILES: [usize; 4] = [8, 16, 32, 64];
/// Most experts one launch can group (shared-memory prefix in the kernel).
pub const MAX_EXPERTS: usize = 512;
const THREADS: u32 = 256;

/// `N % 256 == 0`, `K % 512 == 0`: the weights' tiling (256-row tiles, 128-K stages) and the decode mainloop's
/// 512-K stage (every DSV4 expert shape qualifies: N = 2 x moe_intermediate_size or hidden_size, K the other,
/// 4096 / 2048 for Flash and 7168 / 3072 for Pro).
pub fn check_gemm_shape(n: usize, k: usize) -> Result<()> {
    ensure!(
        n > 0 && n.is_multiple_of(N_MULTIPLE),
        "moe_gemm: N = {n} must be a positive multiple of {N_MULTIPLE} (the weights' 256-row tiling)"
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

/// NVFP4 expert weights on the device, `N % 256 == 0` and `K % 512 == 0` ([`check_gemm_shape`]).
pub struct DeviceExpertWeights {
    pub experts: usize,
    pub n: usize,
    pub k: usize,
    /// The e2m1 codes and e4m3 block scales in the tiling both routed mainloops read (one contiguous block per
    /// 256-row tile and 128-K stage, [`prefill::tile_weights_for_rs`]; [`prefill::tiled_bytes`] bytes, as many as
    /// the plain codes plus scales). The only device copy of them: nothing reads the plain row-major layout.
    pub tiled: CudaSlice<u8>,
    /// fp32 global scale per (expert, row), `[E, N]`.
    pub global: CudaSlice<f32>,
}

impl DeviceExpertWeights {
    /// Validate (sizes, no NaN block scale, finite positive global scales, tile shape), upload and tile (the plain
    /// codes and scales are freed after the tiling).
    pub fn upload(gpu: &Gpu, w: &ExpertWeights) -> Result<DeviceExpertWeights> {
        w.validate()?;
        let codes = gpu.upload(&w.rows.codes)?;
        let scales = gpu.upload(&w.rows.scales)?;
        let global = gpu.upload(&w.rows.global)?;
        Self::from_plain(gpu, &codes, &scales, global, w.experts, w.n, w.k)
    }

    /// Tile plain device codes `[E, N, K/2]` and block scales `[E, N, K/16]` (weights made on the device, e.g. the
    /// bench's synthetic ones; not validated) into the weights' tiling, on the GPU's own stream (the launches that
    /// read it are ordered after it on that stream or after a synchronize). The plain buffers are only read by
    /// that copy: the caller may drop them when they live on the GPU's stream (cudarc frees a buffer
    /// asynchronously on its own stream, so after the copy).
    pub fn from_plain(
        gpu: &Gpu,
        codes: &CudaSlice<u8>,
        scales: &CudaSlice<u8>,
        global: CudaSlice<f32>,
        experts: usize,
        n: usize,
        k: usize,
    ) -> Result<DeviceExpertWeights> {
        check_gemm_shape(n, k)?;
        ensure!(
            (1..=MAX_EXPERTS).contains(&experts),
            "moe_gemm: {experts} experts (1..={MAX_EXPERTS})"
        );
        ensure!(
            global.len() >= experts * n,
            "moe_gemm: {} global scales for {experts} x {n} weight rows",
            global.len()
        );
        let tiled = prefill::tile_weights_for_rs(gpu, &gpu.stream, codes, scales, experts, n, k)?;
        Ok(DeviceExpertWeights {
            experts,
            n,
            k,
            tiled,
            global,
        })
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
    /// splits stay those chosen for 2 slots per SM, the configuration measured on the H200), SMs above. Forcing 1 / 2
    /// / 4 / 8 splits at every decode point (variants `nvfp4_splits<s>`) beat this choice by more than 2% only at 1
    /// token of L2: results/h200/archive/session15-ab/moe_gemm_l1-splits-daad962.csv and moe_gemm_l2-splits-daad962.csv.
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

/// CTAs per SM the mma.sync decode mainloop (`moe_gemm_decode_*_nt1/2`, `__launch_bounds__(256, 3)`) holds for
/// token tiles <= 16; [`GemmConfig::choose`] sizes the persistent grid with it.
pub const MAINLOOP_CTAS_PER_SM_SMALL_TILE: usize = 3;

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
    check_weights(w)?;
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

/// The weights' shape and the length of their tiling (the fields are public: checked at every launch).
fn check_weights(w: &DeviceExpertWeights) -> Result<()> {
    check_gemm_shape(w.n, w.k)?;
    let need = prefill::tiled_bytes(w.experts, w.n, w.k);
    ensure!(
        w.tiled.len() >= need && w.global.len() >= w.experts * w.n,
        "moe_gemm: weights hold {} tiled bytes and {} global scales, {} x {} x {} needs {need} and {}",
        w.tiled.len(),
        w.global.len(),
        w.experts,
        w.n,
        w.k,
        w.experts * w.n
    );
    Ok(())
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

/// The swap-AB mma.sync decode mainloop (kernels/moe_gemm.cu, `moe_gemm_decode_<operands>_nt*`) on the weights'
/// tiling ([`DeviceExpertWeights::tiled`]) for every grouping and config;
/// [`launch_partial`] routes prefill shapes to the wgmma kernel instead. The operand type is
/// [`DecodeOperands::routed_for`]. Shared memory: the permuted activation tile (token_tile x 512 x 2 B) plus the raw
/// cp.async tile, sized for BF16 A (the same again). Graph-safe: the grid is `cfg.ctas` and every per-expert count
/// is read on the device.
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
        DecodeOperands::routed_for(a),
    )
}

/// The operand type of the mma.sync decode mainloop's MMAs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeOperands {
    /// BF16 weight fragments and activations (`moe_gemm_decode_bf16_operands_nt*`): either A format.
    Bf16,
    /// F16 (`moe_gemm_decode_f16_operands_nt*`): the weight fragments built with fewer integer ops per code
    /// (kernels/common/nvfp4_dequant.cuh, `e2m1_word_to_f16x2_tiny`, `scales_f16x2`); NVFP4 activations only (BF16
    /// activations are not exact in f16). The same exact products in the same mma order as [`DecodeOperands::Bf16`]:
    /// bit-identical partials (GPU test).
    F16,
}

impl DecodeOperands {
    /// [`DecodeOperands::F16`] for NVFP4 activations, [`DecodeOperands::Bf16`] for BF16 ones. F16 was faster at
    /// every decode point measured (Flash and Pro, L1 and L2, 1-256 tokens): results/h200/moe_gemm_l1.csv and
    /// moe_gemm_l2.csv, variants `nvfp4` (F16) and `nvfp4_bf16ops` (BF16, the bench's `nvfp4_decode_bf16_operands`).
    pub fn routed_for(a: &DeviceActivations) -> DecodeOperands {
        if a.is_nvfp4() {
            DecodeOperands::F16
        } else {
            DecodeOperands::Bf16
        }
    }
}

/// [`launch_partial_mma`] with a chosen operand type; refuses what the F16 mainloop does not take (BF16
/// activations) before any launch.
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
    check_partial_launch(w, a, grp, cfg, ws)?;
    if operands == DecodeOperands::F16 {
        ensure!(
            a.is_nvfp4(),
            "moe_gemm decode (F16 operands): needs NVFP4 activations (BF16 values are not exact in f16)"
        );
    }
    let name = format!(
        "moe_gemm_decode_{}_nt{}",
        match operands {
            DecodeOperands::F16 => "f16_operands",
            DecodeOperands::Bf16 => "bf16_operands",
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
    // The entry's w_scales argument is unused (the tiled blocks hold the scales): null.
    args.buf(&w.tiled).null().i32(n).i32(k);
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
