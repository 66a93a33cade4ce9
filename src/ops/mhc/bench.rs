//! Measurement hooks of the mHC family and the baseline its targets are measured against: the op-by-op chain
//! [`mhc_pre_unfused`] (rms, GEMV, Sinkhorn, apply, RMSNorm, quantize: 6 launches). The bench layer
//! (src/bench/kernels/mhc.rs) turns sweep points into calls of [`bench_mhc`].

use anyhow::{bail, Result};
use half::bf16;

use super::reference::{self as r, HC_HEAD_MIX, HC_MIX};
use super::{
    check_boundary, hc_head, mhc_post, mhc_post_then_pre, mhc_pre, mhc_pre_with, mhc_token_chunks,
    MhcPreOutputs, MhcPrePath, MhcWeights, MhcWorkspace, FAMILY,
};
use crate::gpu::arena::{Arena, WorkspaceLayout};
use crate::gpu::launch::{launch, DevBuf, DeviceBuf, KernelArgs, Launch, Stream};
use crate::gpu::timing::TimingPlan;
use crate::gpu::Gpu;
use crate::ops::norm_quant::bench::{random_weight, timing_rows, BenchPoint};
use crate::ops::norm_quant::{
    check_rows, quantize_bf16_rows, reference::RMS_EPS, rmsnorm_quant_into, upload_checked_bf16,
    OutFormat, QuantView, RowsIn, RowsOut,
};

/// Scratch of the op-by-op chain for up to `tokens` tokens of `d`: rho `[T]`, dots `[T, 24]` and the BF16
/// staging rows of RMSNorm(u) `[T, D]` (before the quantize kernel).
#[derive(Debug, Clone, Copy)]
pub struct MhcUnfusedWorkspace {
    pub tokens: usize,
    pub d: usize,
    rho: DevBuf<f32>,
    dots: DevBuf<f32>,
    staging: DevBuf<bf16>,
}

impl MhcUnfusedWorkspace {
    pub fn layout(tokens: usize, d: usize) -> WorkspaceLayout {
        let mut l = WorkspaceLayout::new();
        l.add::<f32>(tokens)
            .add::<f32>(tokens * HC_MIX)
            .add::<bf16>(tokens * d);
        l
    }
    pub fn carve(arena: &mut Arena, tokens: usize, d: usize) -> Result<MhcUnfusedWorkspace> {
        check_rows(tokens, d)?;
        Ok(MhcUnfusedWorkspace {
            tokens,
            d,
            rho: arena.carve(tokens, "mhc unfused rho")?,
            dots: arena.carve(tokens * HC_MIX, "mhc unfused dots")?,
            staging: arena.carve(tokens * d, "mhc unfused staging")?,
        })
    }
}

/// The op-by-op baseline: rms kernel, GEMV kernel (one CTA per token, no split-K), Sinkhorn kernel, apply kernel
/// (u BF16), then the RMSNorm kernel (BF16 rows into the scratch's staging, rstd into `out.normed.rstd`) and the
/// quantize kernel: 6 launches (5 for a BF16 output, where the RMSNorm writes `out.normed` directly). The same
/// outputs as [`mhc_pre`] up to the order of the fp32 sums (dots, sum of squares).
pub fn mhc_pre_unfused(
    gpu: &Gpu,
    stream: &Stream,
    x: &impl DeviceBuf<bf16>,
    w: &MhcWeights,
    eps: f32,
    scratch: &MhcUnfusedWorkspace,
    out: &mut MhcPreOutputs,
) -> Result<()> {
    check_boundary(x, w, eps, out, HC_MIX, "mhc_pre_unfused")?;
    let (tokens, d) = (out.tokens, out.d);
    if scratch.tokens < tokens || scratch.d != d {
        bail!(
            "mhc_pre_unfused: the scratch is for up to {} tokens of D = {}, the call is {tokens} of D = {d}",
            scratch.tokens,
            scratch.d
        );
    }
    let (d_i, d4_i) = (d as i32, (4 * d) as i32);
    let t = tokens as u32;
    // The rms, GEMV and Sinkhorn kernels put the token on grid.x and run in one launch.
    let k = gpu.kernel(FAMILY, "mhc_unfused_rms")?;
    let mut a = KernelArgs::new();
    a.buf(x).buf(&scratch.rho).i32(d4_i).f32(eps);
    unsafe { launch(stream, &k, Launch::new((t, 1, 1), (256, 1, 1)), &mut a) }?;
    let k = gpu.kernel(FAMILY, "mhc_unfused_gemv")?;
    let mut a = KernelArgs::new();
    a.buf(x).buf(&w.mix_fn).buf(&scratch.dots).i32(d4_i);
    unsafe { launch(stream, &k, Launch::new((t, 1, 1), (256, 1, 1)), &mut a) }?;
    let k = gpu.kernel(FAMILY, "mhc_unfused_sinkhorn")?;
    let mut a = KernelArgs::new();
    a.buf(&scratch.rho)
        .buf(&scratch.dots)
        .buf(&w.scale)
        .buf(&w.base)
        .buf(&out.pre)
        .buf(&out.post)
        .buf(&out.comb);
    unsafe { launch(stream, &k, Launch::new((t, 1, 1), (32, 1, 1)), &mut a) }?;
    // The apply kernel puts the token on grid.y (at most 65535 per launch): chunked.
    let k = gpu.kernel(FAMILY, "mhc_unfused_apply")?;
    for (t0, n) in mhc_token_chunks(tokens) {
        let mut a = KernelArgs::new();
        a.buf_at(x, t0 * 4 * d)
            .buf_at(&out.pre, t0 * 4)
            .buf_at(&out.u, t0 * d)
            .i32(d_i);
        let l = Launch::new(((d / 8).div_ceil(64) as u32, n as u32, 1), (64, 1, 1));
        unsafe { launch(stream, &k, l, &mut a) }?;
    }
    let normed = out.normed.view();
    if normed.format == OutFormat::Bf16 {
        return rmsnorm_quant_into(
            gpu,
            stream,
            RowsIn::Bf16(&out.u),
            &w.norm_weight,
            eps,
            &normed,
        );
    }
    // The RMSNorm writes BF16 rows to the staging and its rstd straight into the outputs' rstd.
    let staging_y = scratch.staging.sub(0, tokens * d);
    let staging = RowsOut {
        rows: tokens,
        d,
        format: OutFormat::Bf16,
        q: QuantView::Bf16 { y: staging_y },
        rstd: normed.rstd,
    };
    rmsnorm_quant_into(
        gpu,
        stream,
        RowsIn::Bf16(&out.u),
        &w.norm_weight,
        eps,
        &staging,
    )?;
    quantize_bf16_rows(gpu, stream, &staging_y, &normed)
}

/// Variants of the mHC boundary, `<kind>_<fmt>` with kind
/// * `fused`: [`mhc_pre`] as called, i.e. its automatic path choice ([`super::mhc_pre_auto_path`]);
/// * `fused_pdl` / `fused_twolaunch` / `fused_tc`: one path forced ([`MhcPrePath::PdlPair`] /
///   [`MhcPrePath::TwoLaunch`] / [`MhcPrePath::TensorMix`]): the forcing variants that decide
///   `mhc_pre_auto_path`'s thresholds, measurable on both sides of them (`fused_pdl` in graph form only);
/// * `unfused`: the op-by-op chain ([`mhc_pre_unfused`], the baseline);
///
/// each timed three ways:
/// * `<kind>_<fmt>`: plain stream launches, one boundary per event pair (host launch cost included);
/// * `graph_<kind>_<fmt>`: a graph holding ONE boundary, replayed 20 times back to back, time / 20. Each replay
///   is one `cuGraphLaunch`: when the host needs longer to launch a graph than the GPU needs to run it, this
///   measures the launch rate, not the boundary;
/// * `graph16_<kind>_<fmt>`: a graph holding 16 consecutive boundaries (same inputs, as the boundaries of a
///   captured decode step follow each other), replayed 4 times, time / (4 x 16): the per-boundary GPU time
///   inside a decode graph, with one graph launch per 16 boundaries. As in `graph_`, F stays in L2 after the
///   first boundary (in a real decode step every layer's F is different).
///
/// Plus `post` ([`mhc_post`]), `head` ([`hc_head`]), and `graph_postpre_{fused,separate}_nvfp4`
/// ([`mhc_post_then_pre`] against [`mhc_post`] + [`mhc_pre`]).
pub const MHC_VARIANTS: &[&str] = &[
    "fused_nvfp4",
    "unfused_nvfp4",
    "fused_fp8",
    "unfused_fp8",
    "fused_bf16",
    "unfused_bf16",
    "graph_fused_nvfp4",
    "graph_unfused_nvfp4",
    "graph_fused_fp8",
    "graph_unfused_fp8",
    "post",
    "head",
    "graph_postpre_fused_nvfp4",
    "graph_postpre_separate_nvfp4",
    "graph16_fused_nvfp4",
    "graph16_unfused_nvfp4",
    "graph16_fused_fp8",
    "graph16_unfused_fp8",
    "graph_fused_pdl_nvfp4",
    "graph_fused_pdl_fp8",
    "graph16_fused_pdl_nvfp4",
    "graph16_fused_pdl_fp8",
    "graph_fused_twolaunch_nvfp4",
    "graph_fused_twolaunch_fp8",
    "graph16_fused_twolaunch_nvfp4",
    "graph16_fused_twolaunch_fp8",
    "fused_tc_nvfp4",
    "fused_tc_fp8",
    "fused_tc_bf16",
    "fused_twolaunch_nvfp4",
    "fused_twolaunch_fp8",
    "fused_twolaunch_bf16",
];

/// Boundaries captured in one graph by the `graph16_*` variants, and replays of that graph per sample.
const MHC_GRAPH_BOUNDARIES: usize = 16;
const MHC_GRAPH16_REPLAYS: usize = 4;
/// Replays per sample of the one-boundary graphs (`graph_*`).
const MHC_GRAPH1_REPLAYS: usize = 20;

/// Time one mHC variant for `tokens` tokens of hidden size `d`.
pub fn bench_mhc(
    gpu: &Gpu,
    variant: &str,
    tokens: usize,
    d: usize,
    seed: u64,
    plan: TimingPlan,
) -> Result<BenchPoint> {
    check_rows(tokens, d)?;
    let stream = gpu.stream.clone();
    let xs = timing_rows(tokens * 4, d, seed);
    let x = upload_checked_bf16(gpu, "X", &xs)?;
    let eps = RMS_EPS;
    let x_bytes = (tokens * 4 * d * 2) as u64;
    let mut layout = MhcWorkspace::layout(tokens, d);
    layout.add_bytes(MhcUnfusedWorkspace::layout(tokens, d).bytes());
    let mut arena = Arena::for_layout(gpu, &layout)?;
    let ws = MhcWorkspace::carve(&mut arena, tokens, d)?;
    let point = |bytes: u64, samples: Vec<f64>, baseline: Option<String>| BenchPoint {
        kernel: "mhc",
        variant: variant.to_string(),
        rows: tokens,
        d,
        bytes,
        samples_us: samples,
        baseline,
    };
    if variant == "post" {
        let y = upload_checked_bf16(gpu, "y", &timing_rows(tokens, d, seed ^ 1))?;
        let post = gpu.upload(&vec![1.0f32; tokens * 4])?;
        let comb = gpu.upload(&vec![0.25f32; tokens * 16])?;
        let xo = gpu.zeros::<bf16>(tokens * 4 * d)?;
        let s = gpu.time_us(plan, || {
            mhc_post(gpu, &stream, &y, &x, &post, &comb, tokens, d, &xo)
        })?;
        return Ok(point(
            2 * x_bytes + (tokens * d * 2 + tokens * 80) as u64,
            s,
            None,
        ));
    }
    let params = random_mhc_params(d, HC_MIX, seed ^ 2);
    let nw = random_weight(d, seed ^ 3);
    if let Some(kind) = variant.strip_prefix("graph_postpre_") {
        // hc_post of one sub-layer + hc_pre of the next (NVFP4 out): fused (2 launches) or separate (3).
        let fused = kind.starts_with("fused");
        let y = upload_checked_bf16(gpu, "y", &timing_rows(tokens, d, seed ^ 1))?;
        let post = gpu.upload(&vec![1.0f32; tokens * 4])?;
        let comb = gpu.upload(&vec![0.25f32; tokens * 16])?;
        let xo = gpu.zeros::<bf16>(tokens * 4 * d)?;
        let w = MhcWeights::upload(gpu, &params, &nw, d)?;
        let mut out = MhcPreOutputs::alloc_poisoned(gpu, OutFormat::Nvfp4, tokens, d)?;
        let run = |out: &mut MhcPreOutputs| {
            if fused {
                mhc_post_then_pre(gpu, &stream, &y, &x, &post, &comb, &w, eps, &ws, &xo, out)
            } else {
                mhc_post(gpu, &stream, &y, &x, &post, &comb, tokens, d, &xo)?;
                mhc_pre(gpu, &stream, &xo, &w, eps, &ws, out)
            }
        };
        run(&mut out)?;
        gpu.synchronize()?;
        let g = gpu.capture(|| run(&mut out))?;
        let s = gpu.time_graph_us(&g, plan, 20)?;
        let bytes = 2 * x_bytes
            + (tokens * d * 2 + tokens * 80) as u64
            + (HC_MIX * 4 * d * 4 + d * 2) as u64
            + (tokens * (24 * 4 + 2 * d + 4 + OutFormat::Nvfp4.row_bytes(d))) as u64;
        return Ok(point(
            bytes,
            s,
            fused.then(|| "graph_postpre_separate_nvfp4".to_string()),
        ));
    }
    if variant == "head" {
        let hf = random_mhc_params(d, HC_HEAD_MIX, seed ^ 4);
        let w = MhcWeights::upload_head(gpu, &hf.mix_fn, 1.0, &[0.1, -0.1, 0.2, 0.0], &nw, d)?;
        let mut out = MhcPreOutputs::alloc_poisoned(gpu, OutFormat::Bf16, tokens, d)?;
        let s = gpu.time_us(plan, || hc_head(gpu, &stream, &x, &w, eps, &ws, &mut out))?;
        let bytes = x_bytes + (4 * 4 * d * 4 + d * 2 + tokens * (4 * d + 16 + 4)) as u64;
        return Ok(point(bytes, s, None));
    }
    // Boundaries per captured graph: 0 = no graph (plain launches), 1 = `graph_`, 16 = `graph16_`.
    let (per_graph, rest) = if let Some(r) = variant.strip_prefix("graph16_") {
        (MHC_GRAPH_BOUNDARIES, r)
    } else if let Some(r) = variant.strip_prefix("graph_") {
        (1, r)
    } else {
        (0, variant)
    };
    // kind_fmt with kind in fused (mhc_pre's automatic path), fused_pdl / fused_twolaunch / fused_tc (one path
    // forced), unfused (the op-by-op chain). path: None = unfused, Some(None) = automatic, Some(Some(p)) = forced.
    let (kind, fmt) = rest
        .rsplit_once('_')
        .ok_or_else(|| anyhow::anyhow!("unknown mhc variant `{variant}`"))?;
    let format = OutFormat::parse(fmt)?;
    let w = MhcWeights::upload(gpu, &params, &nw, d)?;
    let mut out = MhcPreOutputs::alloc_poisoned(gpu, format, tokens, d)?;
    let scratch = MhcUnfusedWorkspace::carve(&mut arena, tokens, d)?;
    let path = match kind {
        "fused" => Some(None),
        "fused_pdl" => Some(Some(MhcPrePath::PdlPair)),
        "fused_twolaunch" => Some(Some(MhcPrePath::TwoLaunch)),
        "fused_tc" => Some(Some(MhcPrePath::TensorMix)),
        "unfused" => None,
        _ => bail!(
            "unknown mhc variant `{variant}` (known: {})",
            MHC_VARIANTS.join(", ")
        ),
    };
    let fused = path.is_some();
    let run = |out: &mut MhcPreOutputs| match path {
        Some(None) => mhc_pre(gpu, &stream, &x, &w, eps, &ws, out),
        Some(Some(p)) => mhc_pre_with(gpu, &stream, &x, &w, eps, &ws, out, p),
        None => mhc_pre_unfused(gpu, &stream, &x, &w, eps, &scratch, out),
    };
    let s = if per_graph > 0 {
        run(&mut out)?; // loads the module and checks shapes outside the capture
        gpu.synchronize()?;
        let g = gpu.capture(|| {
            for _ in 0..per_graph {
                run(&mut out)?;
            }
            Ok(())
        })?;
        let replays = if per_graph == 1 {
            MHC_GRAPH1_REPLAYS
        } else {
            MHC_GRAPH16_REPLAYS
        };
        // time_graph_us divides by the replays; per boundary divides by the boundaries of one graph too.
        gpu.time_graph_us(&g, plan, replays)?
            .into_iter()
            .map(|us| us / per_graph as f64)
            .collect()
    } else {
        gpu.time_us(plan, || run(&mut out))?
    };
    // Inputs once (X, F, norm weight, scale/base), outputs once (pre, post, C, u, rstd, quantized y).
    let bytes = x_bytes
        + (HC_MIX * 4 * d * 4 + d * 2 + 27 * 4) as u64
        + (tokens * (24 * 4 + 2 * d + 4 + format.row_bytes(d))) as u64;
    // Raced against the op-by-op chain timed the same way (same graph shape).
    let prefix = match per_graph {
        0 => "",
        1 => "graph_",
        _ => "graph16_",
    };
    let base = fused.then(|| format!("{prefix}unfused_{fmt}"));
    Ok(point(bytes, s, base))
}

/// mHC parameters of realistic size: mix weights ~ U(-1,1)/sqrt(4D) (so mixes are O(1)), scales around 1,
/// bases ~ U(-1, 1).
pub fn random_mhc_params(d: usize, nmix: usize, seed: u64) -> r::MhcParams {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let a = 1.0 / ((4 * d) as f32).sqrt();
    let mix_fn = (0..nmix * 4 * d).map(|_| rng.random_range(-a..a)).collect();
    let mut scale = [0f32; 3];
    for s in &mut scale {
        *s = rng.random_range(0.5..1.5);
    }
    let mut base = [0f32; 24];
    for b in &mut base {
        *b = rng.random_range(-1.0..1.0);
    }
    r::MhcParams {
        mix_fn,
        scale,
        base,
    }
}
