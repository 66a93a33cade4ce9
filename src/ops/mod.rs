//! Kernel families: one module per family, each a launcher (checks, config, launch) plus a CPU reference.

pub mod indexer;
