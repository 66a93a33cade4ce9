//! The model's dense linears on the GPU: [`prefill`] is the FP8 block-scaled linear through cuBLASLt.

pub mod prefill;
