//! Benchmark hook of the MoE grouped GEMM: one point of the token sweep (routed top-k of E experts) for our
//! kernels and the baselines a user would otherwise run, in the same process and with the same routing.
//!
//! Variants (`variant` column):
//! * `nvfp4_l1` / `nvfp4_l2`: our mainloop + L1 finish (SwiGLU + NVFP4) / + L2 combine.
//! * `cublaslt_bf16_l1` / `_l2`: weights pre-dequantized to BF16 (dequant not timed: an optimistic baseline,
//!   and 4x the memory), one cuBLASLt GEMM per active expert.
//! * `cublaslt_fp8_l1` / `_l2`: FP8 e4m3 per-tensor weights and activations, one cuBLASLt GEMM per active expert
//!   with M padded to 16 rows (cuBLASLt's FP8 kernels want aligned M); the 8-bit reference point.
//!
//! Each point carries its own denominators measured in the same run: device-to-device copy bandwidth
//! (bytes read + written) and the dense BF16 cuBLASLt rate (8192^3). `bytes` counts the weights each GEMM must
//! stream (active experts only) plus activations read and outputs written once.
//! Until `crate::bench::Row` lands this returns [`BenchPoint`]s; the integrator maps them to rows.

use anyhow::{anyhow, Result};
use cudarc::driver::{CudaSlice, DevicePtr};
use half::bf16;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::gpu::blas::{Blas, GemmInput};
use crate::gpu::timing::TimingPlan;
use crate::gpu::{grid_1d, Gpu, PushKernelArg};

/// MoE expert geometry.
#[derive(Debug, Clone, Copy)]
pub struct MoeShape {
    pub name: &'static str,
    pub hidden: usize,
    pub inter: usize,
    pub experts: usize,
    pub topk: usize,
}

/// DSV4-Flash routed experts (dsv4-architecture §3.9, §5).
pub const FLASH: MoeShape = MoeShape {
    name: "flash",
    hidden: 4096,
    inter: 2048,
    experts: 256,
    topk: 6,
};
/// DSV4-Pro routed experts.
pub const PRO: MoeShape = MoeShape {
    name: "pro",
    hidden: 7168,
    inter: 3072,
    experts: 384,
    topk: 6,
};

/// One measured point.
#[derive(Debug, Clone)]
pub struct BenchPoint {
    pub kernel: &'static str,
    pub variant: String,
    pub shape: String,
    pub tokens: usize,
    pub active_experts: usize,
    pub median_us: f64,
    pub bytes: f64,
    pub flops: f64,
    pub gb_per_s: f64,
    pub tflops: f64,
    pub copy_gb_per_s: f64,
    pub bf16_tflops: f64,
    /// The baseline a user would otherwise run (dequantize + cuBLASLt BF16) and our speed-up over it.
    pub baseline: Option<String>,
    pub speedup_vs_baseline: Option<f64>,
    /// Speed-up over the FP8 per-tensor cuBLASLt reference point of the same shape.
    pub speedup_vs_fp8: Option<f64>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
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
    unsafe { b.launch(grid_1d(1 << 20, 256)) }.map_err(|e| anyhow!("fill: {e:?}"))?;
    Ok(())
}

/// Synthetic NVFP4 weights filled on the device (no host round trip), global scale 2^-6 per row.
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
    })
}

/// Measured denominators: copy bandwidth (GB/s, read + write) and dense BF16 cuBLASLt TFLOPS.
pub fn measure_limits(gpu: &Gpu, blas: &Blas, plan: TimingPlan) -> Result<(f64, f64)> {
    let bytes = 1usize << 30;
    let src = gpu.zeros::<u8>(bytes)?;
    let mut dst = gpu.zeros::<u8>(bytes)?;
    let t = median(gpu.time_us(plan, || {
        gpu.stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(|e| anyhow!("dtod: {e:?}"))
    })?);
    let copy = 2.0 * bytes as f64 / (t * 1e-6) / 1e9;
    let m = 8192;
    let mut a = gpu.zeros::<u8>(m * m * 2)?;
    let mut s = gpu.zeros::<u8>(1)?;
    fill_weights(gpu, &mut a, &mut s, 7)?; // random bytes: finite bf16 values in every sane range except rare NaN/Inf
    let mut d = gpu.zeros::<bf16>(m * m)?;
    let t = median(gpu.time_us(plan, || {
        blas.gemm_tn(gpu, GemmInput::Bf16, m, m, m, &a, &a, &mut d, 1.0)
    })?);
    Ok((copy, 2.0 * (m as f64).powi(3) / (t * 1e-6) / 1e12))
}

/// One sweep point: `tokens` routed top-k of `shape.experts`, L1 and L2, ours and both baselines.
pub fn bench_point(
    gpu: &Gpu,
    shape: MoeShape,
    tokens: usize,
    plan: TimingPlan,
    limits: (f64, f64),
) -> Result<Vec<BenchPoint>> {
    let mut rng = ChaCha8Rng::seed_from_u64(tokens as u64 * 7919 + 1);
    let masked = tokens <= 256;
    let rb0 = RoutedBatch::random(&mut rng, tokens, shape.experts, shape.topk, None)?;
    let most = (0..shape.experts)
        .map(|e| rb0.grouping.expert_rows(e).len())
        .max()
        .unwrap_or(1)
        .max(1);
    let rb = RoutedBatch::from_choices(
        tokens,
        shape.experts,
        shape.topk,
        rb0.experts_of.clone(),
        masked.then_some(most),
    )?;
    let active: Vec<usize> = (0..shape.experts)
        .filter(|&e| !rb.grouping.expert_rows(e).is_empty())
        .collect();
    let pairs = tokens * shape.topk;
    let rows = rb.grouping.rows_total();
    let rpe = pairs as f64 / active.len() as f64;
    let (h, i) = (shape.hidden, shape.inter);
    let w13 = synthetic_weights(gpu, shape.experts, 2 * i, h, 11)?;
    let w2 = synthetic_weights(gpu, shape.experts, h, i, 13)?;
    let dg = DeviceGrouping::upload(gpu, &rb.grouping)?;
    // NVFP4 activations (the fused norm+quant output) with a per-row global scale.
    let mut a_codes = gpu.zeros::<u8>(rows * h / 2)?;
    let mut a_scales = gpu.zeros::<u8>(rows * h / 16)?;
    fill_weights(gpu, &mut a_codes, &mut a_scales, 17)?;
    let gsa = gpu.upload(&vec![0.05f32; rows])?;
    let a = DeviceActivations::Nvfp4 {
        rows,
        k: h,
        codes: &a_codes,
        scales: &a_scales,
        global: &gsa,
    };
    let routing = gpu.upload(&vec![0.25f32; rows])?;
    let token_rows = gpu.upload(&rb.token_rows)?;
    let cfg1 = GemmConfig::choose(gpu.info.sm_count as usize, rpe, active.len(), 2 * i, h);
    let cfg2 = GemmConfig::choose(gpu.info.sm_count as usize, rpe, active.len(), h, i);
    let mut ws1 = Workspace::new(gpu, cfg1.splits, rows, 2 * i)?;
    let mut ws2 = Workspace::new(gpu, cfg2.splits, rows, h)?;
    let mut l1 = L1Output::new(gpu, rows, i, false)?;
    let mut y = gpu.zeros::<bf16>(tokens * h)?;

    let t_l1 = median(gpu.time_us(plan, || {
        launch_partial(gpu, &w13, &a, &dg, &cfg1, &mut ws1)?;
        launch_finish_l1(gpu, &ws1, &dg, &w13, &a, &routing, &mut l1)
    })?);
    let t_l2 = median(gpu.time_us(plan, || {
        let a2 = l1.as_activations();
        launch_partial(gpu, &w2, &a2, &dg, &cfg2, &mut ws2)?;
        launch_finish_l2(gpu, &ws2, &dg, &w2, &a2, &token_rows, shape.topk, &mut y)
    })?);

    let (b1, b2) = (
        w13.bytes_per_expert() as f64 * active.len() as f64,
        w2.bytes_per_expert() as f64 * active.len() as f64,
    );
    let io1 = (pairs * (h / 2 + h / 16 + 4) + pairs * (i / 2 + i / 16 + 4)) as f64;
    let io2 = (pairs * (i / 2 + i / 16 + 4) + tokens * h * 2) as f64;
    let (f1, f2) = (
        2.0 * pairs as f64 * (2 * i) as f64 * h as f64,
        2.0 * pairs as f64 * h as f64 * i as f64,
    );

    // Baselines: per active expert cuBLASLt on BF16 (pre-dequantized) and FP8 weights.
    let blas = Blas::new(gpu)?;
    let dq = gpu.function(FAMILY, "moe_gemm_dequant_rows_bf16")?;
    let mut base_bf16 = [0.0f64; 2];
    let mut base_fp8 = [0.0f64; 2];
    for (layer, (w, n, k)) in [(&w13, 2 * i, h), (&w2, h, i)].into_iter().enumerate() {
        let mut per_expert = Vec::new();
        for &e in &active {
            let m = rb.grouping.expert_rows(e).len();
            let wb = gpu.zeros::<u8>(n * k * 2)?;
            let (pc, ps, pg, po) = (
                w.codes.device_ptr(&gpu.stream).0 + (e * n * k / 2) as u64,
                w.scales.device_ptr(&gpu.stream).0 + (e * n * k / 16) as u64,
                w.global.device_ptr(&gpu.stream).0 + (e * n * 4) as u64,
                wb.device_ptr(&gpu.stream).0,
            );
            let (nr, kk) = (n as i64, k as i32);
            let mut bld = gpu.stream.launch_builder(&dq);
            bld.arg(&pc).arg(&ps).arg(&pg).arg(&nr).arg(&kk).arg(&po);
            unsafe { bld.launch(grid_1d(1 << 18, 256)) }.map_err(|e| anyhow!("dequant: {e:?}"))?;
            let mut ab = gpu.zeros::<u8>(m * k * 2)?;
            let mut s = gpu.zeros::<u8>(1)?;
            fill_weights(gpu, &mut s, &mut ab, 19)?; // bf16 bit patterns 0x28xx..0x37xx: small positive values
            let m8 = m.div_ceil(16) * 16;
            let mut w8 = gpu.zeros::<u8>(n * k)?;
            let mut a8 = gpu.zeros::<u8>(m8 * k)?;
            fill_weights(gpu, &mut s, &mut w8, 23)?;
            fill_weights(gpu, &mut s, &mut a8, 29)?;
            let d = gpu.zeros::<bf16>(m8 * n)?;
            per_expert.push((m, m8, wb, ab, w8, a8, d));
        }
        gpu.synchronize()?;
        base_bf16[layer] = median(gpu.time_us(plan, || {
            for (m, _, wb, ab, _, _, d) in per_expert.iter_mut() {
                blas.gemm_tn(gpu, GemmInput::Bf16, *m, n, k, ab, wb, d, 1.0)?;
            }
            Ok(())
        })?);
        base_fp8[layer] = median(gpu.time_us(plan, || {
            for (_, m8, _, _, w8, a8, d) in per_expert.iter_mut() {
                blas.gemm_tn(gpu, GemmInput::Fp8E4m3, *m8, n, k, a8, w8, d, 1.0)?;
            }
            Ok(())
        })?);
    }

    let (copy, bf16_tf) = limits;
    let shape_s = format!(
        "{} E={} top{} H={} I={}",
        shape.name, shape.experts, shape.topk, h, i
    );
    let point = |variant: &str,
                 us: f64,
                 bytes: f64,
                 flops: f64,
                 baseline: Option<(&str, f64)>,
                 fp8: Option<f64>| BenchPoint {
        kernel: "moe_gemm",
        variant: variant.to_string(),
        shape: shape_s.clone(),
        tokens,
        active_experts: active.len(),
        median_us: us,
        bytes,
        flops,
        gb_per_s: bytes / (us * 1e-6) / 1e9,
        tflops: flops / (us * 1e-6) / 1e12,
        copy_gb_per_s: copy,
        bf16_tflops: bf16_tf,
        baseline: baseline.map(|b| b.0.to_string()),
        speedup_vs_baseline: baseline.map(|b| b.1 / us),
        speedup_vs_fp8: fp8.map(|t| t / us),
    };
    // Baseline weight bytes: BF16 is 2 B per element, FP8 1 B (activation/output traffic is the same order as ours).
    let elems1 = (active.len() * 2 * i * h) as f64;
    let elems2 = (active.len() * h * i) as f64;
    Ok(vec![
        point(
            "nvfp4_l1",
            t_l1,
            b1 + io1,
            f1,
            Some(("cublaslt_bf16_l1", base_bf16[0])),
            Some(base_fp8[0]),
        ),
        point(
            "nvfp4_l2",
            t_l2,
            b2 + io2,
            f2,
            Some(("cublaslt_bf16_l2", base_bf16[1])),
            Some(base_fp8[1]),
        ),
        point(
            "cublaslt_bf16_l1",
            base_bf16[0],
            2.0 * elems1,
            f1,
            None,
            None,
        ),
        point(
            "cublaslt_bf16_l2",
            base_bf16[1],
            2.0 * elems2,
            f2,
            None,
            None,
        ),
        point("cublaslt_fp8_l1", base_fp8[0], elems1, f1, None, None),
        point("cublaslt_fp8_l2", base_fp8[1], elems2, f2, None, None),
    ])
}
