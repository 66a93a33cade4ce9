//! Exact CPU codecs for every storage format the kernels read or write (DESIGN §3).
//!
//! Scalar codecs: [`e2m1`], [`e4m3`], [`ue8m0`], [`bf16`]. Every GPU kernel that rounds to one of these
//! formats implements the same rule, and the tests compare GPU and CPU bit for bit.

pub mod bf16;
pub mod e2m1;
pub mod e4m3;
pub mod ue8m0;
