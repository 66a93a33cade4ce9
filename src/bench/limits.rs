//! The denominators every row is measured against, taken in the same run (docs/measurement.md).
//!
//! The GPU measurements that fill [`Limits`] (device-to-device copy, cuBLASLt BF16 / FP8 GEMM) live
//! in the GPU runtime; this is only the data they produce.

use serde::{Deserialize, Serialize};

/// Measured hardware limits for one run on one GPU.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Limits {
    /// HBM copy bandwidth in GB/s (1e9 bytes per second), counting bytes read plus bytes written.
    pub copy_bw_gbps: f64,
    /// Dense BF16 matmul rate in TFLOP/s (1e12 flops per second), `None` when not measured.
    pub bf16_tflops: Option<f64>,
    /// Dense FP8 matmul rate in TFLOP/s, `None` when not measured.
    pub fp8_tflops: Option<f64>,
}

/// Which matmul rate a kernel's TFLOP/s is compared with in the `pct_matmul` column.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MatmulKind {
    /// The kernel's math runs on BF16 tensor cores (e.g. NVFP4 dequantised to BF16).
    Bf16,
    /// The kernel's math runs on FP8 tensor cores.
    Fp8,
    /// Not a matmul (copies, quantisers, norms): `pct_matmul` stays empty.
    NotMatmul,
}

impl Limits {
    /// The matmul rate (TFLOP/s) that `kind` is held to, when it was measured.
    pub fn matmul_tflops(&self, kind: MatmulKind) -> Option<f64> {
        match kind {
            MatmulKind::Bf16 => self.bf16_tflops,
            MatmulKind::Fp8 => self.fp8_tflops,
            MatmulKind::NotMatmul => None,
        }
    }
}
