//! Measurement hooks of the moe_gemm family (the sweep adapter that turns bench-config parameters into these
//! calls and CSV rows is `crate::bench::kernels::moe_gemm`): one point is a routed batch of `tokens` tokens, each
//! routed top-`topk` of `experts` (uniform, seeded), through the L1 GEMM (W13: N = 2 * inter, K = hidden, then
//! SwiGLU + routing weight + NVFP4 quant of h) or the L2 GEMM (W2: N = hidden, K = inter, then the per-token
//! combine). Up to [`MASKED_MAX_TOKENS`] tokens use the masked (decode) layout, above it the contiguous one.
//!
//! Variants, raced on the same routing in the same run:
//! * `nvfp4`: the routed path ([`launch_partial`] + the routed finish) on the tiled weights.
//! * `nvfp4_decode_bf16_operands` (masked points only): the decode mainloop forced to BF16 operands
//!   ([`DecodeOperands::Bf16`]); the other side of [`DecodeOperands::routed_for`].
//! * `nvfp4_decode_mainloop` (contiguous points only): the mma.sync decode mainloop forced ([`launch_partial_mma`])
//!   where `nvfp4` may take the prefill mainloop: the other side of [`prefill::MIN_MEAN_ROWS_PER_EXPERT`].
//! * `nvfp4_finish_per_row` (`moe_gemm_l1` contiguous points only): the L1 finish forced to
//!   [`FinishL1Kernel::PerRow`]: the other side of [`FinishL1Kernel::for_grouping`].
//! * `nvfp4_l2rowwarps` / `nvfp4_l2cols2` / `nvfp4_l2cols2tok` (`moe_gemm_l2` only): the L2 combine forced; the
//!   sides of [`FinishL2Kernel::for_tokens`]'s thresholds.
//! * `nvfp4_splits1` / `2` / `4` / `8` (masked points only): the K split count forced instead of
//!   [`GemmConfig::choose`]'s (a point whose K is not a multiple of splits x [`STAGE_K`] is skipped).
//! * `cublaslt_bf16`: weights pre-dequantized to BF16 (the dequant is not timed: an optimistic baseline that also
//!   needs 3.6x the weight memory), one cuBLASLt GEMM per active expert. The speed-up baseline.
//! * `cublaslt_fp8`: FP8 e4m3 per-tensor weights and activations, one cuBLASLt GEMM per active expert with M
//!   padded to 16 rows (cuBLASLt's FP8 kernels want aligned M): the 8-bit reference point.
//!
//! `bytes` = weight bytes of the active experts (what must stream from HBM) + activations read + outputs written
//! once; `flops` = 2 * routed pairs * N * K. Weights are filled on the device with hash bytes (valid codes, block
//! scales in [0.25, 0.94], never NaN), so no timing runs on zeros. Weight preparation (the tiling, the BF16 copy
//! of the baseline) is not timed.

use anyhow::{bail, Result};
use cudarc::driver::CudaSlice;
use half::bf16;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::gpu::arena::Arena;
use crate::gpu::blas::{Blas, GemmInput};
use crate::gpu::timing::TimingPlan;

/// Every variant a sweep may name (see the module doc).
pub const VARIANTS: &[&str] = &[
    "nvfp4",
    "nvfp4_decode_bf16_operands",
    "nvfp4_decode_mainloop",
    "nvfp4_finish_per_row",
    "nvfp4_l2rowwarps",
    "nvfp4_l2cols2",
    "nvfp4_l2cols2tok",
    "nvfp4_splits1",
    "nvfp4_splits2",
    "nvfp4_splits4",
    "nvfp4_splits8",
    "cublaslt_bf16",
    "cublaslt_fp8",
];

/// Most tokens of a point that uses the masked (decode) layout.
pub const MASKED_MAX_TOKENS: usize = 256;

/// Which GEMM of the MoE layer a point measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layer {
    /// W13 GEMM + SwiGLU + routing weight + NVFP4 quant (`moe_gemm_l1`).
    L1,
    /// W2 GEMM + per-token combine (`moe_gemm_l2`).
    L2,
}

/// The model shape of a point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelShape {
    pub hidden: usize,
    pub inter: usize,
    pub experts: usize,
    pub topk: usize,
}

/// What one measured point returns.
#[derive(Debug, Clone)]
pub struct Measured {
    pub samples: Vec<f64>,
    pub bytes: u64,
    pub flops: u64,
    pub tokens: usize,
    /// Routed (token, expert) pairs: the GEMM rows that carry work.
    pub pairs: usize,
    pub n: usize,
}

/// A variant of ours (not a cuBLASLt baseline).
pub fn is_ours(variant: &str) -> bool {
    variant.starts_with("nvfp4")
}

/// Whether `variant` measures nothing at this point: forcing variants whose rule does not apply to the layout,
/// L1 finish variants at L2 points and L2 combine variants at L1 points.
fn skips(variant: &str, layer: Layer, masked: bool) -> bool {
    let l2_combine = variant.starts_with("nvfp4_l2");
    let prefill_only = matches!(variant, "nvfp4_finish_per_row" | "nvfp4_decode_mainloop");
    let decode_only = variant == "nvfp4_decode_bf16_operands" || forced_splits(variant).is_some();
    (prefill_only && masked)
        || (decode_only && !masked)
        || (l2_combine && layer == Layer::L1)
        || (variant == "nvfp4_finish_per_row" && layer == Layer::L2)
}

/// The L1 finish kernel of a variant: `nvfp4_finish_per_row` forces PadOneBarrier, every other variant takes the
/// routed one ([`FinishL1Kernel::for_grouping`]).
fn finish_l1_for(variant: &str, dg: &DeviceGrouping, i_dim: usize) -> FinishL1Kernel {
    match variant {
        "nvfp4_finish_per_row" => FinishL1Kernel::PerRow,
        _ => FinishL1Kernel::for_grouping(dg, i_dim),
    }
}

/// The L2 combine kernel of a variant at `tokens` tokens.
fn finish_l2_for(variant: &str, tokens: usize) -> FinishL2Kernel {
    match variant {
        "nvfp4_l2rowwarps" => FinishL2Kernel::RowWarps,
        "nvfp4_l2cols2" => FinishL2Kernel::Cols2,
        "nvfp4_l2cols2tok" => FinishL2Kernel::Cols2Tok,
        _ => FinishL2Kernel::for_tokens(tokens),
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

/// The launch configuration of a variant: `nvfp4_splits<s>` its s splits (None: K is not a multiple of
/// s x [`STAGE_K`], the point is skipped), every other variant `cfg` (the chosen one).
fn config_for(variant: &str, cfg: GemmConfig, k: usize) -> Option<GemmConfig> {
    match forced_splits(variant) {
        Some(splits) => k
            .is_multiple_of(splits * STAGE_K)
            .then_some(GemmConfig { splits, ..cfg }),
        None => Some(cfg),
    }
}

#[allow(clippy::too_many_arguments)]
fn launch_variant(
    gpu: &Gpu,
    stream: &Stream,
    variant: &str,
    w: &DeviceExpertWeights,
    a: &DeviceActivations,
    dg: &DeviceGrouping,
    cfg: &GemmConfig,
    ws: &Workspace,
) -> Result<()> {
    match variant {
        "nvfp4_decode_mainloop" => launch_partial_mma(gpu, stream, w, a, dg, cfg, ws),
        "nvfp4_decode_bf16_operands" => {
            launch_partial_mma_with(gpu, stream, w, a, dg, cfg, ws, DecodeOperands::Bf16)
        }
        _ => launch_partial(gpu, stream, w, a, dg, cfg, ws),
    }
}

fn fill_weights(
    gpu: &Gpu,
    codes: &mut CudaSlice<u8>,
    scales: &mut CudaSlice<u8>,
    seed: u32,
) -> Result<()> {
    let kern = gpu.kernel(FAMILY, "moe_gemm_fill_bench_weights")?;
    let mut args = KernelArgs::new();
    args.buf(codes)
        .u64(codes.len() as u64)
        .buf(scales)
        .u64(scales.len() as u64)
        .u32(seed);
    // SAFETY: arguments in the kernel's order; the kernel grid-strides over the two lengths it is given.
    unsafe { launch(&gpu.stream, &kern, Launch::over(1 << 20, 256), &mut args) }
}

/// Fill `buf` with e4m3/bf16-safe bytes 0x28..0x37 (the fill kernel's scale path).
fn fill_small_positive(gpu: &Gpu, buf: &mut CudaSlice<u8>, seed: u32) -> Result<()> {
    let mut none = gpu.zeros::<u8>(1)?;
    fill_weights(gpu, &mut none, buf, seed)
}

/// Plain synthetic NVFP4 codes `[E, N, K/2]` and block scales `[E, N, K/16]` filled on the device (hash bytes:
/// valid codes, block scales in [0.25, 0.94]).
fn synthetic_plain(
    gpu: &Gpu,
    experts: usize,
    n: usize,
    k: usize,
    seed: u32,
) -> Result<(CudaSlice<u8>, CudaSlice<u8>)> {
    check_gemm_shape(n, k)?;
    let mut codes = gpu.zeros::<u8>(experts * n * k / 2)?;
    let mut scales = gpu.zeros::<u8>(experts * n * k / 16)?;
    fill_weights(gpu, &mut codes, &mut scales, seed)?;
    Ok((codes, scales))
}

/// The global scale of every synthetic weight row.
const SYNTHETIC_GLOBAL: f32 = 1.0 / 64.0;

/// Synthetic NVFP4 expert weights filled on the device and tiled (the plain fill is dropped), global scale 2^-6
/// per row.
pub fn synthetic_weights(
    gpu: &Gpu,
    experts: usize,
    n: usize,
    k: usize,
    seed: u32,
) -> Result<DeviceExpertWeights> {
    let (codes, scales) = synthetic_plain(gpu, experts, n, k, seed)?;
    let global = gpu.upload(&vec![SYNTHETIC_GLOBAL; experts * n])?;
    DeviceExpertWeights::from_plain(gpu, &codes, &scales, global, experts, n, k)
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
    fn new(shape: &ModelShape, tokens: usize, seed: u64, layer: Layer) -> Result<Point> {
        let (experts, topk) = (shape.experts, shape.topk);
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
        let masked = tokens <= MASKED_MAX_TOKENS;
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
        let (n, k) = match layer {
            Layer::L1 => (2 * shape.inter, shape.hidden),
            Layer::L2 => (shape.hidden, shape.inter),
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
    fn measured(&self, samples: Vec<f64>, bytes: u64) -> Measured {
        Measured {
            samples,
            bytes,
            flops: self.flops(),
            tokens: self.tokens,
            pairs: self.pairs(),
            n: self.n,
        }
    }
}

/// Measure one point of `variant` (one of [`VARIANTS`]); `plan` gives the timing plan for a working set of that
/// many bytes. None: the variant measures nothing at this point (see [`skips`], [`config_for`]).
pub fn measure(
    gpu: &Gpu,
    layer: Layer,
    shape: &ModelShape,
    tokens: usize,
    seed: u64,
    variant: &str,
    plan: &dyn Fn(u64) -> TimingPlan,
) -> Result<Option<Measured>> {
    let p = Point::new(shape, tokens, seed, layer)?;
    if !is_ours(variant) {
        return cublaslt_point(gpu, variant, &p, plan).map(Some);
    }
    if !VARIANTS.contains(&variant) {
        bail!("moe_gemm: unknown variant `{variant}` (known: {VARIANTS:?})");
    }
    let masked = matches!(p.rb.grouping, Grouping::Masked { .. });
    if skips(variant, layer, masked) {
        return Ok(None);
    }
    let Some(cfg) = config_for(variant, p.chosen_config(gpu), p.k) else {
        return Ok(None);
    };
    let stream = gpu.stream.clone();
    let seed_w = if layer == Layer::L1 { 11 } else { 13 };
    let w = synthetic_weights(gpu, shape.experts, p.n, p.k, seed_w)?;
    let rows = p.rb.grouping.rows_total();
    let dg = DeviceGrouping::upload(gpu, &p.rb.grouping)?;
    let ws_shape = WorkspaceShape::for_launch(&w, &dg, &cfg);
    let mut arena = Arena::new(gpu, workspace_bytes(&ws_shape))?;
    let ws = Workspace::carve(&mut arena, &ws_shape)?;
    gpu.synchronize()?;
    let samples;
    let bytes;
    match layer {
        Layer::L1 => {
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
            let i = p.n / 2;
            let mut out = L1Output::new(gpu, rows, i, false)?;
            bytes = w.bytes_per_expert() * p.active.len()
                + p.pairs() * (p.k / 2 + p.k / 16 + 4 + i / 2 + i / 16 + 4);
            let finish = finish_l1_for(variant, &dg, i);
            samples = gpu.time_us(plan(bytes as u64), || {
                launch_variant(gpu, &stream, variant, &w, &a, &dg, &cfg, &ws)?;
                launch_finish_l1_with(gpu, &stream, &ws, &dg, &w, &a, &routing, &mut out, finish)
            })?;
        }
        Layer::L2 => {
            // The L1 output (NVFP4 h with a per-row global scale), synthetic.
            let mut h = L1Output::new(gpu, rows, p.k, false)?;
            fill_weights(gpu, &mut h.codes, &mut h.scales, 19)?;
            h.global = gpu.upload(&vec![0.01f32; rows.max(1)])?;
            let token_rows = gpu.upload(&p.rb.token_rows)?;
            let mut y = gpu.zeros::<bf16>(p.tokens * p.n)?;
            bytes = w.bytes_per_expert() * p.active.len()
                + p.pairs() * (p.k / 2 + p.k / 16 + 4)
                + p.tokens * p.n * 2;
            let finish = finish_l2_for(variant, p.tokens);
            samples = gpu.time_us(plan(bytes as u64), || {
                let a = h.as_activations();
                launch_variant(gpu, &stream, variant, &w, &a, &dg, &cfg, &ws)?;
                launch_finish_l2_with(
                    gpu,
                    &stream,
                    &ws,
                    &dg,
                    &w,
                    &a,
                    &token_rows,
                    p.topk,
                    None,
                    &mut y,
                    finish,
                )
            })?;
        }
    }
    Ok(Some(p.measured(samples, bytes as u64)))
}

/// Per-active-expert cuBLASLt GEMMs (BF16 from dequantized NVFP4 weights, or FP8 per-tensor).
fn cublaslt_point(
    gpu: &Gpu,
    variant: &str,
    p: &Point,
    plan: &dyn Fn(u64) -> TimingPlan,
) -> Result<Measured> {
    let blas = Blas::new(gpu)?;
    let (n, k) = (p.n, p.k);
    let kind = match variant {
        "cublaslt_bf16" => GemmInput::Bf16,
        "cublaslt_fp8" => GemmInput::Fp8E4m3,
        other => bail!("moe_gemm: unknown variant `{other}` (known: {VARIANTS:?})"),
    };
    let dq = gpu.kernel(FAMILY, "moe_gemm_dequant_rows_bf16")?;
    // One expert's NVFP4 weights in the plain row-major layout the dequant kernel reads (the baseline's own copy:
    // DeviceExpertWeights keeps only the tiling), dequantized into each expert's BF16 copy.
    let (one_codes, one_scales) = synthetic_plain(gpu, 1, n, k, 23)?;
    let one_global = gpu.upload(&vec![SYNTHETIC_GLOBAL; n])?;
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
            let mut args = KernelArgs::new();
            args.buf(&one_codes)
                .buf(&one_scales)
                .buf(&one_global)
                .u64(n as u64)
                .i32(k as i32)
                .buf(&wbuf);
            // SAFETY: arguments in the kernel's order (rows as a 64-bit count); `wbuf` holds N x K BF16 values.
            unsafe {
                launch(&gpu.stream, &dq, Launch::over(1 << 18, 256), &mut args)?;
            }
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
    let samples = gpu.time_us(plan(bytes as u64), || {
        for (m, wbuf, abuf, d) in per_expert.iter_mut() {
            blas.gemm_tn(gpu, kind, *m, n, k, abuf, wbuf, d, 1.0)?;
        }
        Ok(())
    })?;
    Ok(p.measured(samples, bytes as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An L1 point skips every variant named `nvfp4_l2*` as an L2-combine variant: a new variant with that prefix
    /// would silently measure nothing at L1 points.
    #[test]
    fn only_l2_combine_variants_carry_the_l2_prefix() {
        for v in VARIANTS.iter().filter(|v| v.starts_with("nvfp4_l2")) {
            assert!(
                matches!(
                    *v,
                    "nvfp4_l2rowwarps" | "nvfp4_l2cols2" | "nvfp4_l2cols2tok"
                ),
                "{v}: the nvfp4_l2 prefix marks L2-combine variants (skipped at L1 points)"
            );
        }
    }
}
