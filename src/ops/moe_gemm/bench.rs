//! Bench hooks of the moe_gemm family: kernels `moe_gemm_l1` (W13 GEMM + SwiGLU + NVFP4 quant of h) and
//! `moe_gemm_l2` (W2 GEMM + per-token combine), axis `tokens` (routed top-k of `experts`, uniform, seeded),
//! params `hidden`, `inter`, `experts`, `topk` (bench-configs/moe_gemm.toml).
//!
//! Variants, raced on the same routing in the same run:
//! * `nvfp4`: our mainloop + finish kernel (masked layout up to 256 tokens, contiguous above; contiguous points
//!   with >= 64 rows per expert on average use the wgmma prefill mainloop, 128 x 256 tile when N % 256 == 0, see
//!   `prefill.rs`; the other points run the v3 mma.sync mainloop, 3 CTAs per SM for token tiles <= 16, in its
//!   F16-operand form v3th on the tiled weights since session 15).
//!   The A/B variants `nvfp4_v1` / `nvfp4_v3` were removed: v3 (now `nvfp4`) beat v1 and v2 (the old `nvfp4`)
//!   at every point; the H200 numbers are in the kernels/moe_gemm.cu header.
//! * `nvfp4_finishq4` (`moe_gemm_l1` masked / decode points only): `nvfp4` (same mainloop and config) with the
//!   previous L1 finish `FinishL1Kernel::Q4` instead of the default pad1b (bit-identical outputs; the session-8 A/B
//!   made pad1b the default), kept measurable for one run. `moe_gemm_l2` skips it.
//! * `nvfp4_finishpad1b` (`moe_gemm_l1` only): `nvfp4` with the L1 finish forced to `FinishL1Kernel::PadOneBarrier`,
//!   the finish of contiguous (prefill) points before session 9 made `FinishL1Kernel::Rows` their routed finish
//!   (bit-identical outputs), kept measurable for one run. `moe_gemm_l2` skips it.
//! * `nvfp4_finishrowsthr` / `nvfp4_finishrows` (`moe_gemm_l1` contiguous points only): `nvfp4` with the L1 finish
//!   forced to `FinishL1Kernel::RowsThr` (session 11: the rows finish with the division-free e2m1 encoder,
//!   bit-identical; the routed contiguous finish in session 11) / `FinishL1Kernel::Rows` (the one before).
//! * `nvfp4_finishrowsthr2` (`moe_gemm_l1` contiguous points only): `nvfp4` with the L1 finish forced to
//!   `FinishL1Kernel::RowsThr2` (RowsThr with fewer instructions per element, bit-identical; the routed contiguous
//!   finish since session 12, so this equals `nvfp4` there).
//! * `nvfp4_l2cols` / `nvfp4_l2rowwarps` / `nvfp4_l2cols2` / `nvfp4_l2cols2tok` (`moe_gemm_l2` only): `nvfp4` with
//!   the L2 combine forced to `FinishL2Kernel::Cols` (the default before session 8 at every token count) /
//!   `RowWarps` / `Cols2` / `Cols2Tok` (session 11: one CTA per token),
//!   where `nvfp4` takes `FinishL2Kernel::for_tokens` (RowWarps up to 8 tokens, Cols2 above, Cols2Tok from 512). Bit-identical
//!   outputs. `moe_gemm_l1` skips them.
//! * `nvfp4_wgmma` / `nvfp4_wgmma256` (contiguous points only): the wgmma mainloop forced with a 128 x 128 /
//!   128 x 256 CTA tile, same finish kernels, so one run races the tile widths at every prefill token count.
//! * `nvfp4_wgmma_rswtma` (contiguous points only): the session-10 routed RS mainloop forced
//!   (`PrefillKernel::RsWtma`: weights in the TMA ring, narrow token tiles; `K % 256 == 0`), same pre-pass and finish.
//! * `nvfp4_wgmma_rswtma_tiled` (contiguous points only): the RS wtma mainloop on weights re-laid once per point,
//!   before timing, into one contiguous 18 KiB block per stage (`PrefillKernel::RsWtmaTiled`,
//!   [`prefill::tile_weights_for_rs`]: weight preparation, not timed; the tiled copy is held next to the plain one).
//!   Since session 11 `nvfp4` prepares the same copy at contiguous points and routes the prefill mainloop to it;
//!   `nvfp4_wgmma_rswtma` keeps the plain-layout kernel measurable beside it.
//! * `nvfp4_splits1` / `nvfp4_splits2` / `nvfp4_splits4` / `nvfp4_splits8` (masked / decode points only): `nvfp4`
//!   (tiled weights, v3t mainloop, routed finish) with the K split count forced instead of [`GemmConfig::choose`]'s;
//!   a point whose K is not a multiple of splits x [`STAGE_K`] is skipped. Session 15: the choice's cost model counts
//!   2 CTA slots per SM where the grid holds 3 (1 split at 4 Flash tokens: 736 items on 396 CTAs, a second round
//!   of 340); these rows measure each split count at every decode point.
//! * `nvfp4_bf16ops` (masked / decode points only): `nvfp4` with the decode mainloop forced to BF16 operands
//!   ([`DecodeOperands::Bf16`], v3t), where `nvfp4` runs the F16-operand form v3th since session 15 (NVFP4
//!   activations on the tiled weights); same config and finish. The session-15 bench candidate `nvfp4_half` (v3th
//!   forced) became `nvfp4`; its rows are in results/h200/session15-ab/.
//! * `nvfp4_plain`: `nvfp4` without the tiling (the plain-layout mainloops v3 / rs_wtma, `nvfp4` before session 11),
//!   the comparison for the tiled routes at every point (since session 11 `nvfp4` prepares the tiling of the
//!   weights before timing, and both its mainloops read it).
//! * `nvfp4_decode` (contiguous points only): `nvfp4` with the mma.sync decode mainloop forced
//!   ([`launch_partial_mma`], the chosen config), where `nvfp4` may route the point to the
//!   prefill mainloop: the other side of the [`prefill::MIN_MEAN_ROWS_PER_EXPERT`] threshold.
//! * `cublaslt_bf16`: weights pre-dequantized to BF16 (the dequant is not timed: an optimistic baseline that also
//!   needs 3.6x the weight memory), one cuBLASLt GEMM per active expert. The baseline of the speed-up column.
//! * `cublaslt_fp8`: FP8 e4m3 per-tensor weights and activations, one cuBLASLt GEMM per active expert with M
//!   padded to 16 rows (cuBLASLt's FP8 kernels want aligned M): the 8-bit reference point.
//!
//! `bytes` = weight bytes of the active experts (what must stream from HBM) + activations read + outputs
//! written once; `flops` = 2 * routed pairs * N * K. Weights are filled on the device with hash bytes (valid codes,
//! block scales in [0.25, 0.94], never NaN), so no timing runs on zeros.

use anyhow::{anyhow, bail, Result};
use cudarc::driver::{CudaSlice, DevicePtr};
use half::bf16;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::bench::config::Sweep;
use crate::bench::runner::{BenchCtx, BenchKernel};
use crate::bench::{MatmulKind, Row, Summary};
use crate::gpu::blas::{Blas, GemmInput};
use crate::gpu::grid_1d;

pub const VARIANTS: &[&str] = &[
    "nvfp4",
    "nvfp4_finishq4",
    "nvfp4_finishpad1b",
    "nvfp4_finishrowsthr",
    "nvfp4_finishrowsthr2",
    "nvfp4_finishrows",
    "nvfp4_l2cols",
    "nvfp4_l2rowwarps",
    "nvfp4_l2cols2",
    "nvfp4_l2cols2tok",
    "nvfp4_wgmma",
    "nvfp4_wgmma256",
    "nvfp4_wgmma_rswtma",
    "nvfp4_wgmma_rswtma_tiled",
    "nvfp4_decode",
    "nvfp4_splits1",
    "nvfp4_splits2",
    "nvfp4_splits4",
    "nvfp4_splits8",
    "nvfp4_bf16ops",
    "nvfp4_plain",
    "cublaslt_bf16",
    "cublaslt_fp8",
];

/// Our variants: `nvfp4` goes through [`launch_partial`] (which routes prefill shapes to the wgmma kernel),
/// `nvfp4_wgmma` / `nvfp4_wgmma256` the wgmma prefill kernel with a
/// 128 x 128 / 128 x 256 CTA tile (one K split); the wgmma variants only run on contiguous (prefill) points.
fn is_ours(variant: &str) -> bool {
    matches!(
        variant,
        "nvfp4"
            | "nvfp4_finishq4"
            | "nvfp4_finishpad1b"
            | "nvfp4_finishrowsthr"
            | "nvfp4_finishrowsthr2"
            | "nvfp4_finishrows"
            | "nvfp4_l2cols"
            | "nvfp4_l2rowwarps"
            | "nvfp4_l2cols2"
            | "nvfp4_l2cols2tok"
            | "nvfp4_wgmma"
            | "nvfp4_wgmma256"
            | "nvfp4_wgmma_rswtma"
            | "nvfp4_wgmma_rswtma_tiled"
            | "nvfp4_decode"
            | "nvfp4_splits1"
            | "nvfp4_splits2"
            | "nvfp4_splits4"
            | "nvfp4_splits8"
            | "nvfp4_bf16ops"
            | "nvfp4_plain"
    )
}

/// The wgmma variants (forced prefill mainloops) run only on contiguous (prefill) points, the
/// previous decode finish `nvfp4_finishq4` only on masked (decode) points; `nvfp4_finishpad1b` (the previous prefill
/// finish) and `nvfp4_decode` (the decode mainloop where `nvfp4` may take the prefill one) only on contiguous points.
fn forced_variant_skips(variant: &str, dg: &DeviceGrouping) -> bool {
    let masked = dg.capacity != 0;
    let prefill_only = variant.starts_with("nvfp4_wgmma")
        || variant == "nvfp4_finishpad1b"
        || variant == "nvfp4_finishrowsthr"
        || variant == "nvfp4_finishrowsthr2"
        || variant == "nvfp4_finishrows"
        || variant == "nvfp4_decode";
    let decode_only = variant == "nvfp4_finishq4"
        || variant == "nvfp4_bf16ops"
        || forced_splits(variant).is_some();
    (prefill_only && masked) || (decode_only && !masked)
}

/// The L1 finish kernel of a variant: `nvfp4_finishq4` runs q4, `nvfp4_finishpad1b` pad1b (the default before
/// session 9 at contiguous points), every other variant the routed one ([`FinishL1Kernel::for_grouping`]).
fn finish_l1_for(variant: &str, dg: &DeviceGrouping, i_dim: usize) -> FinishL1Kernel {
    match variant {
        "nvfp4_finishq4" => FinishL1Kernel::Q4,
        "nvfp4_finishpad1b" => FinishL1Kernel::PadOneBarrier,
        "nvfp4_finishrowsthr" => FinishL1Kernel::RowsThr,
        "nvfp4_finishrowsthr2" => FinishL1Kernel::RowsThr2,
        "nvfp4_finishrows" => FinishL1Kernel::Rows,
        _ => FinishL1Kernel::for_grouping(dg, i_dim),
    }
}

/// The L2 combine kernel of a variant at `tokens` tokens of `n` columns: `nvfp4_l2cols` / `nvfp4_l2rowwarps` /
/// `nvfp4_l2cols2` / `nvfp4_l2cols2tok` force theirs, every other variant takes the default routing ([`FinishL2Kernel::for_tokens`]).
fn finish_l2_for(variant: &str, tokens: usize, n: usize) -> FinishL2Kernel {
    match variant {
        "nvfp4_l2cols" => FinishL2Kernel::Cols,
        "nvfp4_l2rowwarps" => FinishL2Kernel::RowWarps,
        "nvfp4_l2cols2" => FinishL2Kernel::Cols2,
        "nvfp4_l2cols2tok" => FinishL2Kernel::Cols2Tok,
        _ => FinishL2Kernel::for_tokens(tokens, n),
    }
}

/// The K split count a `nvfp4_splits<s>` variant forces.
fn forced_splits(variant: &str) -> Option<usize> {
    match variant {
        "nvfp4_splits1" => Some(1),
        "nvfp4_splits2" => Some(2),
        "nvfp4_splits4" => Some(4),
        "nvfp4_splits8" => Some(8),
        _ => None,
    }
}

/// The launch configuration of a variant: the wgmma variants run one split, `nvfp4_splits<s>` its s splits (None:
/// K is not a multiple of s x [`STAGE_K`], the point is skipped), every other variant `cfg` (the chosen one).
fn config_for(variant: &str, cfg: GemmConfig, k: usize) -> Option<GemmConfig> {
    if variant.starts_with("nvfp4_wgmma") {
        Some(GemmConfig { splits: 1, ..cfg })
    } else if let Some(splits) = forced_splits(variant) {
        k.is_multiple_of(splits * STAGE_K)
            .then_some(GemmConfig { splits, ..cfg })
    } else {
        Some(cfg)
    }
}

fn launch_variant(
    gpu: &Gpu,
    variant: &str,
    w: &DeviceExpertWeights,
    a: &DeviceActivations,
    dg: &DeviceGrouping,
    cfg: &GemmConfig,
    ws: &mut Workspace,
) -> Result<()> {
    match variant {
        "nvfp4_wgmma" => {
            prefill::launch_partial_prefill_with(gpu, w, a, dg, ws, prefill::PrefillKernel::Ss128)
        }
        "nvfp4_wgmma256" => {
            prefill::launch_partial_prefill_with(gpu, w, a, dg, ws, prefill::PrefillKernel::Ss256)
        }
        "nvfp4_wgmma_rswtma" => {
            prefill::launch_partial_prefill_with(gpu, w, a, dg, ws, prefill::PrefillKernel::RsWtma)
        }
        "nvfp4_wgmma_rswtma_tiled" => prefill::launch_partial_prefill_with(
            gpu,
            w,
            a,
            dg,
            ws,
            prefill::PrefillKernel::RsWtmaTiled,
        ),
        "nvfp4_decode" => launch_partial_mma(gpu, w, a, dg, cfg, ws),
        "nvfp4_bf16ops" => launch_partial_mma_with(gpu, w, a, dg, cfg, ws, DecodeOperands::Bf16),
        _ => launch_partial(gpu, w, a, dg, cfg, ws),
    }
}

/// Weight preparation before the timed loop (not timed, like the BF16 copy of the cuBLASLt baseline): `nvfp4`, the
/// tiled forcing variants and the L1 finish variants (so that they differ from `nvfp4` in the finish only) get the
/// tiling ([`DeviceExpertWeights::prepare_prefill_tiling`]),
/// which both routed mainloops then read; every other variant (`nvfp4_plain` among them) keeps the plain layout only.
fn prepare_weights(gpu: &Gpu, variant: &str, w: &mut DeviceExpertWeights) -> Result<()> {
    if matches!(
        variant,
        "nvfp4"
            | "nvfp4_wgmma_rswtma_tiled"
            | "nvfp4_splits1"
            | "nvfp4_splits2"
            | "nvfp4_splits4"
            | "nvfp4_splits8"
            | "nvfp4_bf16ops"
            | "nvfp4_finishrows"
            | "nvfp4_finishrowsthr"
            | "nvfp4_finishrowsthr2"
    ) {
        w.prepare_prefill_tiling(gpu)?;
        gpu.synchronize()?;
    }
    Ok(())
}

pub fn kernels() -> Vec<BenchKernel> {
    vec![
        BenchKernel {
            name: "moe_gemm_l1",
            variants: VARIANTS,
            matmul: MatmulKind::Bf16,
            run_point: l1_point,
            headline: &[],
            targets: &[],
            params: &[],
            check_point: None,
        },
        BenchKernel {
            name: "moe_gemm_l2",
            variants: VARIANTS,
            matmul: MatmulKind::Bf16,
            run_point: l2_point,
            headline: &[],
            targets: &[],
            params: &[],
            check_point: None,
        },
    ]
}

fn fill_weights(
    gpu: &Gpu,
    codes: &mut CudaSlice<u8>,
    scales: &mut CudaSlice<u8>,
    seed: u32,
) -> Result<()> {
    let f = gpu.function(FAMILY, "moe_gemm_fill_bench_weights")?;
    let (pc, ps) = (
        codes.device_ptr(&gpu.stream).0,
        scales.device_ptr(&gpu.stream).0,
    );
    let (nc, ns) = (codes.len() as u64, scales.len() as u64);
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(&pc).arg(&nc).arg(&ps).arg(&ns).arg(&seed);
    unsafe { b.launch(grid_1d(1 << 20, 256)) }
        .map_err(|e| anyhow!("moe_gemm_fill_bench_weights: {e:?}"))?;
    Ok(())
}

/// Fill `buf` with e4m3/bf16-safe bytes 0x28..0x37 (the fill kernel's scale path).
fn fill_small_positive(gpu: &Gpu, buf: &mut CudaSlice<u8>, seed: u32) -> Result<()> {
    let mut none = gpu.zeros::<u8>(1)?;
    fill_weights(gpu, &mut none, buf, seed)
}

/// Synthetic NVFP4 expert weights filled on the device, global scale 2^-6 per row.
pub fn synthetic_weights(
    gpu: &Gpu,
    experts: usize,
    n: usize,
    k: usize,
    seed: u32,
) -> Result<DeviceExpertWeights> {
    check_gemm_shape(n, k)?;
    let mut codes = gpu.zeros::<u8>(experts * n * k / 2)?;
    let mut scales = gpu.zeros::<u8>(experts * n * k / 16)?;
    fill_weights(gpu, &mut codes, &mut scales, seed)?;
    let global = gpu.upload(&vec![1.0f32 / 64.0; experts * n])?;
    Ok(DeviceExpertWeights {
        experts,
        n,
        k,
        codes,
        scales,
        global,
        prefill_tiled: None,
    })
}

struct Point {
    tokens: usize,
    topk: usize,
    n: usize,
    k: usize,
    rb: RoutedBatch,
    active: Vec<usize>,
}

impl Point {
    fn new(s: &Sweep, tokens: u64, seed: u64, layer: u8) -> Result<Point> {
        let (hidden, inter) = (
            s.param_u64("hidden")? as usize,
            s.param_u64("inter")? as usize,
        );
        let (experts, topk) = (
            s.param_u64("experts")? as usize,
            s.param_u64("topk")? as usize,
        );
        let tokens = tokens as usize;
        if tokens == 0 {
            bail!("moe_gemm bench: tokens must be >= 1");
        }
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let rb0 = RoutedBatch::random(&mut rng, tokens, experts, topk, None)?;
        let most = (0..experts)
            .map(|e| rb0.grouping.expert_rows(e).len())
            .max()
            .unwrap_or(1)
            .max(1);
        let masked = tokens <= 256;
        let rb = RoutedBatch::from_choices(
            tokens,
            experts,
            topk,
            rb0.experts_of,
            masked.then_some(most),
        )?;
        let active = (0..experts)
            .filter(|&e| !rb.grouping.expert_rows(e).is_empty())
            .collect();
        let (n, k) = if layer == 1 {
            (2 * inter, hidden)
        } else {
            (hidden, inter)
        };
        Ok(Point {
            tokens,
            topk,
            n,
            k,
            rb,
            active,
        })
    }
    fn pairs(&self) -> usize {
        self.tokens * self.topk
    }
    /// [`GemmConfig::choose`] for this point on `gpu`.
    fn chosen_config(&self, gpu: &Gpu) -> GemmConfig {
        GemmConfig::choose(
            gpu.info.sm_count as usize,
            self.rows_per_active(),
            self.active.len(),
            self.n,
            self.k,
        )
    }

    fn rows_per_active(&self) -> f64 {
        self.pairs() as f64 / self.active.len().max(1) as f64
    }
    fn flops(&self) -> u64 {
        2 * (self.pairs() * self.n * self.k) as u64
    }
}

fn row(
    kernel: &str,
    variant: &str,
    s: &Sweep,
    p: &Point,
    samples: &[f64],
    bytes: u64,
) -> Result<Row> {
    let sum = Summary::of(samples)?;
    Ok(Row::new(kernel, variant, &s.shape_label(p.tokens as u64))
        .with_tokens(p.tokens as u64)
        .with_rows(p.pairs() as u64)
        .with_cols(p.n as u64)
        .with_timing(&sum, samples.len() as u64)
        .with_work(Some(bytes), Some(p.flops()))
        .with_baseline("cublaslt_bf16"))
}

fn l1_point(ctx: &BenchCtx<'_>, s: &Sweep, variant: &str, tokens: u64) -> Result<Vec<Row>> {
    if variant.starts_with("nvfp4_l2") {
        return Ok(vec![]); // an L2 combine variant: nothing to measure in L1
    }
    let p = Point::new(s, tokens, ctx.seed, 1)?;
    match variant {
        v if is_ours(v) => {
            let gpu = ctx.gpu;
            let mut w = synthetic_weights(gpu, s.param_u64("experts")? as usize, p.n, p.k, 11)?;
            let rows = p.rb.grouping.rows_total();
            let dg = DeviceGrouping::upload(gpu, &p.rb.grouping)?;
            if forced_variant_skips(variant, &dg) {
                return Ok(vec![]);
            }
            prepare_weights(gpu, variant, &mut w)?;
            let mut codes = gpu.zeros::<u8>(rows * p.k / 2)?;
            let mut scales = gpu.zeros::<u8>(rows * p.k / 16)?;
            fill_weights(gpu, &mut codes, &mut scales, 17)?;
            let gsa = gpu.upload(&vec![0.05f32; rows])?;
            let a = DeviceActivations::Nvfp4 {
                rows,
                k: p.k,
                codes: &codes,
                scales: &scales,
                global: &gsa,
            };
            let routing = gpu.upload(&vec![0.25f32; rows])?;
            let Some(cfg) = config_for(variant, p.chosen_config(gpu), p.k) else {
                return Ok(vec![]); // a forced split count K does not divide into
            };
            let mut ws = Workspace::new(gpu, cfg.splits, rows, p.n)?;
            let i = p.n / 2;
            let mut out = L1Output::new(gpu, rows, i, false)?;
            let bytes = w.bytes_per_expert() * p.active.len()
                + p.pairs() * (p.k / 2 + p.k / 16 + 4 + i / 2 + i / 16 + 4);
            let finish = finish_l1_for(variant, &dg, i);
            let samples = gpu.time_us(ctx.plan(bytes as u64), || {
                launch_variant(gpu, variant, &w, &a, &dg, &cfg, &mut ws)?;
                launch_finish_l1_with(gpu, &ws, &dg, &w, &a, &routing, &mut out, finish)
            })?;
            Ok(vec![row(
                "moe_gemm_l1",
                variant,
                s,
                &p,
                &samples,
                bytes as u64,
            )?])
        }
        _ => cublaslt_point(ctx, s, "moe_gemm_l1", variant, &p),
    }
}

fn l2_point(ctx: &BenchCtx<'_>, s: &Sweep, variant: &str, tokens: u64) -> Result<Vec<Row>> {
    if matches!(
        variant,
        "nvfp4_finishq4"
            | "nvfp4_finishpad1b"
            | "nvfp4_finishrowsthr"
            | "nvfp4_finishrowsthr2"
            | "nvfp4_finishrows"
    ) {
        return Ok(vec![]); // an L1 finish variant: nothing to measure in L2
    }
    let p = Point::new(s, tokens, ctx.seed, 2)?;
    match variant {
        v if is_ours(v) => {
            let gpu = ctx.gpu;
            let mut w = synthetic_weights(gpu, s.param_u64("experts")? as usize, p.n, p.k, 13)?;
            let rows = p.rb.grouping.rows_total();
            let dg = DeviceGrouping::upload(gpu, &p.rb.grouping)?;
            if forced_variant_skips(variant, &dg) {
                return Ok(vec![]);
            }
            prepare_weights(gpu, variant, &mut w)?;
            // The L1 output (NVFP4 h with a per-row global scale), synthetic.
            let mut h = L1Output::new(gpu, rows, p.k, false)?;
            fill_weights(gpu, &mut h.codes, &mut h.scales, 19)?;
            h.global = gpu.upload(&vec![0.01f32; rows.max(1)])?;
            let token_rows = gpu.upload(&p.rb.token_rows)?;
            let Some(cfg) = config_for(variant, p.chosen_config(gpu), p.k) else {
                return Ok(vec![]); // a forced split count K does not divide into
            };
            let mut ws = Workspace::new(gpu, cfg.splits, rows, p.n)?;
            let mut y = gpu.zeros::<bf16>(p.tokens * p.n)?;
            let bytes = w.bytes_per_expert() * p.active.len()
                + p.pairs() * (p.k / 2 + p.k / 16 + 4)
                + p.tokens * p.n * 2;
            let finish = finish_l2_for(variant, p.tokens, p.n);
            let samples = gpu.time_us(ctx.plan(bytes as u64), || {
                let a = h.as_activations();
                launch_variant(gpu, variant, &w, &a, &dg, &cfg, &mut ws)?;
                launch_finish_l2_with(gpu, &ws, &dg, &w, &a, &token_rows, p.topk, &mut y, finish)
            })?;
            Ok(vec![row(
                "moe_gemm_l2",
                variant,
                s,
                &p,
                &samples,
                bytes as u64,
            )?])
        }
        _ => cublaslt_point(ctx, s, "moe_gemm_l2", variant, &p),
    }
}

/// Per-active-expert cuBLASLt GEMMs (BF16 from dequantized NVFP4 weights, or FP8 per-tensor).
fn cublaslt_point(
    ctx: &BenchCtx<'_>,
    s: &Sweep,
    kernel: &str,
    variant: &str,
    p: &Point,
) -> Result<Vec<Row>> {
    let gpu = ctx.gpu;
    let blas = Blas::new(gpu)?;
    let (n, k) = (p.n, p.k);
    let kind = match variant {
        "cublaslt_bf16" => GemmInput::Bf16,
        "cublaslt_fp8" => GemmInput::Fp8E4m3,
        other => bail!("{kernel}: unknown variant `{other}` (known: {VARIANTS:?})"),
    };
    let dq = gpu.function(FAMILY, "moe_gemm_dequant_rows_bf16")?;
    let one = synthetic_weights(gpu, 1, n, k, 23)?; // one expert's NVFP4 weights, dequantized into each copy
    let mut per_expert = Vec::new();
    for &e in &p.active {
        let m = p.rb.grouping.expert_rows(e).len();
        let m_run = if kind == GemmInput::Fp8E4m3 {
            m.div_ceil(16) * 16
        } else {
            m
        };
        let mut wbuf = gpu.zeros::<u8>(n * k * kind.bytes())?;
        let mut abuf = gpu.zeros::<u8>(m_run * k * kind.bytes())?;
        if kind == GemmInput::Bf16 {
            let (pc, ps, pg, po) = (
                one.codes.device_ptr(&gpu.stream).0,
                one.scales.device_ptr(&gpu.stream).0,
                one.global.device_ptr(&gpu.stream).0,
                wbuf.device_ptr(&gpu.stream).0,
            );
            let (nr, kk) = (n as i64, k as i32);
            let mut b = gpu.stream.launch_builder(&dq);
            b.arg(&pc).arg(&ps).arg(&pg).arg(&nr).arg(&kk).arg(&po);
            unsafe { b.launch(grid_1d(1 << 18, 256)) }
                .map_err(|e| anyhow!("moe_gemm_dequant_rows_bf16: {e:?}"))?;
        } else {
            fill_small_positive(gpu, &mut wbuf, 29 + e as u32)?;
        }
        fill_small_positive(gpu, &mut abuf, 31 + e as u32)?; // bf16 0x28xx..0x37xx or e4m3 0.25..0.94
        let d = gpu.zeros::<bf16>(m_run * n)?;
        per_expert.push((m_run, wbuf, abuf, d));
    }
    gpu.synchronize()?;
    let elem_bytes = kind.bytes();
    let bytes =
        p.active.len() * n * k * elem_bytes + p.pairs() * k * elem_bytes + p.pairs() * n * 2;
    let samples = gpu.time_us(ctx.plan(bytes as u64), || {
        for (m, wbuf, abuf, d) in per_expert.iter_mut() {
            blas.gemm_tn(gpu, kind, *m, n, k, abuf, wbuf, d, 1.0)?;
        }
        Ok(())
    })?;
    let mut r = row(kernel, variant, s, p, &samples, bytes as u64)?;
    if variant == "cublaslt_bf16" {
        r.baseline = None;
    }
    Ok(vec![r])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `l1_point` skips every variant named `nvfp4_l2*` as an L2-combine variant (nothing to measure in L1): a new
    /// variant with that prefix would silently measure nothing at L1 points (session 15 lost an A/B run to that).
    #[test]
    fn only_l2_combine_variants_carry_the_l2_prefix() {
        for v in VARIANTS.iter().filter(|v| v.starts_with("nvfp4_l2")) {
            assert!(
                matches!(
                    *v,
                    "nvfp4_l2cols" | "nvfp4_l2rowwarps" | "nvfp4_l2cols2" | "nvfp4_l2cols2tok"
                ),
                "{v}: the nvfp4_l2 prefix marks L2-combine variants (skipped at L1 points)"
            );
        }
    }
}
