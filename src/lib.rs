//! megamoe: kernels, CPU references and benchmarks for DeepSeek-V4-class MoE inference on Hopper.
//!
//! Layout (docs/design.md): `formats` (exact CPU codecs), `gpu` (driver runtime), `ops` (one module per
//! kernel family: launcher + CPU reference), `model` (DSV4 config, weights, reference decode),
//! `bench` (sweeps, CSV, plots, report), `cli` (the `megamoe` binary's commands), `progress` (progress of
//! long sweeps and stress runs; a leaf that ops and bench both use).

pub mod bench;
pub mod cli;
pub mod dist;
pub mod engine;
pub mod formats;
pub mod gpu;
pub mod model;
pub mod ops;
pub mod progress;
