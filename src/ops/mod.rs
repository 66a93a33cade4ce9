//! Kernel families. Each reads the same way (DESIGN §1): kernels/<family>.cu -> ops/<family>/mod.rs (launcher)
//! -> ops/<family>/reference.rs (CPU reference) -> tests/<family>.rs -> bench-configs/<family>.toml.

pub mod norm_quant;
