//! The limits probe (`megamoe limits`): the denominators every sweep row is divided by, measured on the GPU
//! in the same run (docs/measurement.md): device-to-device copy bandwidth (bytes read + written, buffers far larger
//! than L2), and the BF16 and FP8 dense matmul rates through cuBLASLt on random data.

use anyhow::Result;
use half::bf16;
use rand::{Rng, SeedableRng};

use crate::bench::limits::Limits;
use crate::bench::stats::Summary;
use crate::formats::e4m3;
use crate::gpu::blas::{Blas, GemmInput};
use crate::gpu::timing::TimingPlan;
use crate::gpu::{drv, Gpu};

/// One measured ceiling, with how it was obtained.
#[derive(Debug, Clone)]
pub struct ProbeResult {
    pub name: &'static str,
    pub method: String,
    pub us: Summary,
    pub value: f64,
    pub unit: &'static str,
}

/// Sizes used by the probe.
#[derive(Debug, Clone, Copy)]
pub struct ProbeConfig {
    pub copy_bytes: usize,
    pub gemm_mnk: usize,
    pub reps: usize,
}

impl Default for ProbeConfig {
    fn default() -> Self {
        ProbeConfig {
            copy_bytes: 2 << 30,
            gemm_mnk: 8192,
            reps: 20,
        }
    }
}

/// The copy bandwidth: the better of cuMemcpyDtoD and a 16-byte-access copy kernel over `n` bytes (read +
/// written), `reps` timed repetitions each; one result per method.
pub fn measure_copy(gpu: &Gpu, n: usize, reps: usize) -> Result<Vec<ProbeResult>> {
    let mut results = Vec::new();
    let plan = TimingPlan {
        warmup: 3,
        reps,
        flush_l2: false,
    };
    let mut src = gpu.zeros::<u8>(n)?;
    gpu.fill_bytes(&mut src, 0x3C)?;
    let mut dst = gpu.zeros::<u8>(n)?;
    let moved = 2.0 * n as f64;
    let s = Summary::of(&gpu.time_us(plan, || {
        drv(gpu.stream.memcpy_dtod(&src, &mut dst), "memcpy_dtod")
    })?)?;
    results.push(ProbeResult {
        name: "copy_memcpy",
        method: format!(
            "cuMemcpyDtoDAsync of {} MiB (bytes read + written)",
            n >> 20
        ),
        value: moved / (s.median * 1e-6) / 1e9,
        us: s,
        unit: "GB/s",
    });
    let s = Summary::of(&gpu.time_us(plan, || {
        crate::ops::nvfp4::copy_u128(gpu, &gpu.stream, &src, &mut dst)
    })?)?;
    results.push(ProbeResult {
        name: "copy_kernel",
        method: format!("copy_u128 kernel, 16-byte accesses, {} MiB", n >> 20),
        value: moved / (s.median * 1e-6) / 1e9,
        us: s,
        unit: "GB/s",
    });
    drop(src);
    drop(dst);
    Ok(results)
}

/// The best copy bandwidth of [`measure_copy`]'s results, GB/s.
pub fn best_copy_gbps(results: &[ProbeResult]) -> f64 {
    results.iter().map(|r| r.value).fold(0.0, f64::max)
}

/// Random bytes that are finite, non-zero-heavy e4m3 codes drawn from N(0,1)-like values.
fn random_e4m3(n: usize, rng: &mut impl Rng) -> Vec<u8> {
    (0..n)
        .map(|_| e4m3::encode_rne(rng.random_range(-4.0f32..4.0)))
        .collect()
}

fn random_bf16_bytes(n: usize, rng: &mut impl Rng) -> Vec<u8> {
    (0..n)
        .flat_map(|_| {
            bf16::from_f32(rng.random_range(-1.0f32..1.0))
                .to_bits()
                .to_le_bytes()
        })
        .collect()
}

/// Measure copy bandwidth and matmul rates. Copy: the better of cuMemcpyDtoD and a 16-byte-access copy kernel.
pub fn measure(gpu: &Gpu, cfg: ProbeConfig, seed: u64) -> Result<(Limits, Vec<ProbeResult>)> {
    let plan = TimingPlan {
        warmup: 3,
        reps: cfg.reps,
        flush_l2: false,
    };
    let mut results = measure_copy(gpu, cfg.copy_bytes, cfg.reps)?;
    let copy_bw = best_copy_gbps(&results);
    // ---- matmul ----
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let d = cfg.gemm_mnk;
    let flops = 2.0 * (d as f64).powi(3);
    let blas = Blas::new(gpu);
    let mut rates = [None, None];
    match blas {
        Ok(blas) => {
            let mut out = gpu.zeros::<bf16>(d * d)?;
            for (i, kind) in [GemmInput::Bf16, GemmInput::Fp8E4m3]
                .into_iter()
                .enumerate()
            {
                let (a, b) = match kind {
                    GemmInput::Bf16 => (
                        random_bf16_bytes(d * d, &mut rng),
                        random_bf16_bytes(d * d, &mut rng),
                    ),
                    GemmInput::Fp8E4m3 => {
                        (random_e4m3(d * d, &mut rng), random_e4m3(d * d, &mut rng))
                    }
                };
                let (a, b) = (gpu.upload(&a)?, gpu.upload(&b)?);
                let s = Summary::of(&gpu.time_us(plan, || {
                    blas.gemm_tn_on(&gpu.stream, kind, d, d, d, &a, &b, &mut out, 1.0)
                })?)?;
                let tflops = flops / (s.median * 1e-6) / 1e12;
                rates[i] = Some(tflops);
                results.push(ProbeResult {
                    name: if i == 0 { "matmul_bf16" } else { "matmul_fp8" },
                    method: format!("cuBLASLt {kind:?} {d}x{d}x{d}, fp32 accumulate, random data"),
                    value: tflops,
                    us: s,
                    unit: "TFLOPS",
                });
            }
        }
        Err(e) => eprintln!("warning: no matmul rates ({e:#}); pct_matmul columns will be empty"),
    }
    Ok((
        Limits {
            copy_bw_gbps: copy_bw,
            bf16_tflops: rates[0],
            fp8_tflops: rates[1],
        },
        results,
    ))
}
