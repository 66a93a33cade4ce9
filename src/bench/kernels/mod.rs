//! The registry of the sweep runner: every kernel a bench config can name, with its variants and the hook that
//! measures one point. Each family's adapter (sweep parameters -> the family's measurement hook in
//! `ops::<family>::bench` -> CSV rows) lives here, in the bench layer, so no op module imports the runner.

pub mod compressor;
pub mod dense;
pub mod dense_prefill;
pub mod head;
pub mod indexer;
pub mod mhc;
pub mod moe_gemm;
pub mod norm_quant;
pub mod nvfp4;
pub mod qkv_prep;
pub mod router;
pub mod sampler;
pub mod sparse_attn;
pub mod weights;

use super::hook::BenchKernel;

/// Every kernel the sweep runner knows. A kernel family adds its entries here.
pub fn all() -> Vec<BenchKernel> {
    let mut v = Vec::new();
    v.extend(nvfp4::kernels());
    v.extend(norm_quant::kernels());
    v.extend(mhc::kernels());
    v.extend(moe_gemm::kernels());
    v.extend(sparse_attn::kernels());
    v.extend(indexer::kernels());
    v.extend(weights::kernels());
    v.extend(router::kernels());
    v.extend(dense_prefill::kernels());
    v.extend(head::kernels());
    v.extend(sampler::kernels());
    v.extend(qkv_prep::kernels());
    v.extend(compressor::kernels());
    v.extend(dense::kernels());
    v
}
