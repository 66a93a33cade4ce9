//! Measurement harness (docs/measurement.md), the GPU-independent half.
//!
//! Everything here works on plain numbers: timing samples arrive as `Vec<f64>` of microseconds from
//! the GPU runtime (`crate::gpu`), and this module turns them into one CSV schema for every kernel,
//! PNG + SVG plots, and a markdown report.
//!
//! - [`stats`]: median / percentiles of timing samples.
//! - [`row`]: the one CSV row type ([`Row`]) with its derived columns (GB/s, TFLOP/s, % of limits,
//!   speedup over a baseline measured in the same run).
//! - [`limits`]: the measured denominators ([`Limits`]) and which matmul rate a kernel is held to.
//! - [`telemetry`]: GPU name, clocks, power, temperature at measurement time ([`Telemetry`]).
//! - [`csv_out`]: write / append / read CSV files of rows.
//! - [`plot`]: line plots without system fonts (an embedded DejaVu Sans).
//! - [`report`]: `REPORT.md` for one GPU's results directory.
//! - [`config`]: the TOML schema of `bench-configs/*.toml` sweeps.
//! - [`env`]: git commit and UTC timestamp of a run.

pub mod config;
pub mod csv_out;
pub mod env;
pub mod hook;
pub mod kernels;
pub mod limits;
pub mod plot;
pub mod probe;
/// Progress lives at the crate root (a leaf, so ops such as the indexer stress run use it too).
pub mod report;
pub mod row;
pub mod runner;
pub mod stats;
pub mod telemetry;

pub use limits::{Limits, MatmulKind};
pub use row::{fill_speedups, Row};
pub use stats::Summary;
pub use telemetry::Telemetry;
