//! Sparse FP8 decode attention (DSV4 §3.6): placeholder while the launcher is written.
pub mod reference;
