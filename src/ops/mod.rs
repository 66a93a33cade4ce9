//! Kernel families. Each reads the same way (DESIGN §1): `kernels/<family>.cu` (device code) ->
//! `ops/<family>/mod.rs` (launcher: checks before any launch, config choice, launch) ->
//! `ops/<family>/reference.rs` or `formats` (CPU reference) -> `tests/<family>.rs` -> `bench-configs/<family>.toml`.

pub mod exec;
pub mod indexer;
pub mod inputs;
pub mod nvfp4;
pub mod sparse_attn;

use crate::bench::runner::BenchKernel;

/// Every kernel the sweep runner knows. A kernel family adds its entries here.
pub fn bench_kernels() -> Vec<BenchKernel> {
    let mut v = Vec::new();
    v.extend(nvfp4::bench::kernels());
    v.extend(indexer::bench::kernels());
    v.extend(sparse_attn::bench_kernels());
    v
}
