//! Kernel families: one module per family (launcher + CPU reference), see DESIGN §1.

pub mod moe_gemm;
