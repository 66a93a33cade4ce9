//! The registry of the sweep runner: every kernel a bench config can name, with its variants and the hook that
//! measures one point. Each family's adapter (sweep parameters -> the family's measurement hook in
//! `ops::<family>::bench` -> CSV rows) lives here, in the bench layer, so no op module imports the runner.

use super::runner::BenchKernel;

pub mod nvfp4;

/// Every kernel the sweep runner knows. A kernel family adds its entries here.
pub fn all() -> Vec<BenchKernel> {
    let mut v = Vec::new();
    v.extend(nvfp4::kernels());
    v.extend(crate::ops::norm_quant::bench::kernels());
    v.extend(crate::ops::moe_gemm::bench::kernels());
    v.extend(crate::ops::sparse_attn::bench_kernels());
    v.extend(crate::ops::indexer::bench::kernels());
    v
}
