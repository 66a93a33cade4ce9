//! Kernel families. Each reads the same way (docs/design.md): `kernels/<family>.cu` (device code) ->
//! `ops/<family>/mod.rs` (launcher: checks before any launch, config choice, launch) ->
//! `ops/<family>/reference.rs` or `formats` (CPU reference) -> `tests/<family>.rs` -> `bench-configs/<family>.toml`.

pub mod compressor;
pub mod dense;
pub mod ep;
pub mod exec;
pub mod head;
pub mod indexer;
pub mod inputs;
pub mod mhc;
pub mod moe_gemm;
pub mod norm_quant;
pub mod nvfp4;
pub mod qkv_prep;
pub mod registry;
pub mod router;
pub mod sampler;
pub mod sparse_attn;
pub mod weights;
