//! Test helpers shared by tests/moe_gemm.rs and tests/moe_gemm_prefill.rs: seeded random rows, quantized
//! expert weights, gathered activations in either A format and their device copies. (Each test crate uses a
//! different subset, hence the dead_code allowance.)
#![allow(dead_code)]

use half::bf16;
use megamoe::gpu::Gpu;
use megamoe::ops::moe_gemm::reference::{quantize_rows_nvfp4, Activations, ExpertWeights};
use megamoe::ops::moe_gemm::{DeviceActivations, RoutedBatch};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub const U: f64 = 1.0 / 16_777_216.0; // 2^-24

pub fn seeded(test: &str) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(megamoe::ops::inputs::fresh_seed(test, "MOE_GEMM_SEED"))
}

/// Roughly normal values with a per-row magnitude spread of 10^[-2, 2] (exercises per-row global scales and
/// small e4m3 block scales) and a few outliers per row (exercises block-scale spread within a row).
pub fn random_rows(rng: &mut impl Rng, rows: usize, cols: usize, base: f32) -> Vec<f32> {
    let mut x = Vec::with_capacity(rows * cols);
    for _ in 0..rows {
        let mag = base * 10f32.powf(rng.random_range(-2.0..2.0));
        for _ in 0..cols {
            // One 32-bit draw per value: the sum of two 15-bit uniforms (triangular on [-1, 1)), and a 1-in-64 outlier.
            let r: u32 = rng.random();
            let tri = ((r & 0x7FFF) as f32 + ((r >> 15) & 0x7FFF) as f32) / 32768.0 - 1.0;
            let v = tri * mag;
            x.push(if r >> 26 == 0 { v * 30.0 } else { v });
        }
    }
    x
}

/// A row per routed (token, expert) pair gathered from token activations, in the chosen A format.
pub fn gathered_activations(
    rng: &mut impl Rng,
    rb: &RoutedBatch,
    k: usize,
    nvfp4: bool,
) -> Activations {
    let xf = random_rows(rng, rb.tokens, k, 1.0);
    let rows = rb.grouping.rows_total();
    let mut g = Vec::with_capacity(rows * k);
    for r in 0..rows {
        let t = rb.row_token[r];
        for kk in 0..k {
            // Padding slots hold garbage the kernel must not read into any owned row.
            g.push(if t >= 0 { xf[t as usize * k + kk] } else { 1e3 });
        }
    }
    if nvfp4 {
        Activations::Nvfp4(quantize_rows_nvfp4(&g, rows, k).unwrap())
    } else {
        Activations::Bf16 {
            rows,
            k,
            data: g.iter().map(|v| bf16::from_f32(*v)).collect(),
        }
    }
}

pub struct DevA {
    bf: Option<cudarc::driver::CudaSlice<bf16>>,
    codes: Option<cudarc::driver::CudaSlice<u8>>,
    scales: Option<cudarc::driver::CudaSlice<u8>>,
    global: Option<cudarc::driver::CudaSlice<f32>>,
    rows: usize,
    k: usize,
}

impl DevA {
    pub fn upload(gpu: &Gpu, a: &Activations) -> DevA {
        match a {
            Activations::Bf16 { rows, k, data } => DevA {
                bf: Some(gpu.upload(data).unwrap()),
                codes: None,
                scales: None,
                global: None,
                rows: *rows,
                k: *k,
            },
            Activations::Nvfp4(q) => DevA {
                bf: None,
                codes: Some(gpu.upload(&q.codes).unwrap()),
                scales: Some(gpu.upload(&q.scales).unwrap()),
                global: Some(gpu.upload(&q.global).unwrap()),
                rows: q.rows,
                k: q.cols,
            },
        }
    }
    pub fn view(&self) -> DeviceActivations<'_> {
        match &self.bf {
            Some(data) => DeviceActivations::Bf16 {
                rows: self.rows,
                k: self.k,
                data,
            },
            None => DeviceActivations::Nvfp4 {
                rows: self.rows,
                k: self.k,
                codes: self.codes.as_ref().unwrap(),
                scales: self.scales.as_ref().unwrap(),
                global: self.global.as_ref().unwrap(),
            },
        }
    }
}

pub fn quantized_weights(rng: &mut impl Rng, e: usize, n: usize, k: usize) -> ExpertWeights {
    ExpertWeights::quantize_per_row(&random_rows(rng, e * n, k, 0.05), e, n, k).unwrap()
}

/// Assert that two partial-sum buffers are identical bit for bit (`what` names the pair in the message): the
/// kernels compared this way compute the same exact products in the same MMA order.
pub fn assert_bit_identical(label: &str, what: &str, want: &[f32], got: &[f32]) {
    assert_eq!(want.len(), got.len(), "{label}: {what}: lengths differ");
    let diff = want
        .iter()
        .zip(got)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count();
    assert_eq!(
        diff,
        0,
        "{label}: {what} in {diff} of {} partials",
        want.len()
    );
}
