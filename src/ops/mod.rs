//! Kernel families: one module per `kernels/<family>.cu` (launcher + CPU reference), DESIGN §1.

pub mod sparse_attn;
