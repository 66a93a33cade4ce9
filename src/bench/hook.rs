//! What a kernel family gives the sweep runner: a [`BenchKernel`] (its variants, the parameters it reads, the hook
//! that measures one point, what the default plots draw) and the [`BenchCtx`] a hook runs in. Kept apart from the
//! runner so that the registry (`bench::kernels`) and the runner both depend on it and not on each other.

use anyhow::Result;

use crate::bench::config::{RunSettings, Sweep};
use crate::bench::{MatmulKind, Row};
use crate::gpu::timing::TimingPlan;
use crate::gpu::Gpu;

/// The largest size any axis value or integer parameter may have: 2^40 (1 TiB). A point with a count of
/// elements or bytes above it cannot fit on any GPU, whatever the element type.
pub const MAX_SIZE: u64 = 1 << 40;

/// What a bench hook gets for one point of a sweep.
pub struct BenchCtx<'a> {
    pub gpu: &'a Gpu,
    pub settings: RunSettings,
    /// Seed for this point's random inputs (printed in the run log).
    pub seed: u64,
}

impl BenchCtx<'_> {
    /// The timing plan for a kernel whose working set is `working_set_bytes` (L2 flushed unless it cannot fit).
    pub fn plan(&self, working_set_bytes: u64) -> TimingPlan {
        TimingPlan {
            warmup: self.settings.warmup as usize,
            reps: self.settings.reps as usize,
            flush_l2: self.settings.needs_flush(working_set_bytes),
        }
    }
}

/// A kernel that sweeps can run: its variants and the hook that measures one (variant, axis value) point.
pub struct BenchKernel {
    pub name: &'static str,
    pub variants: &'static [&'static str],
    /// Which measured matmul rate `pct_matmul` uses.
    pub matmul: MatmulKind,
    /// Returns the rows of one point (timing, work, errors, shape columns); the runner adds limits,
    /// telemetry, commit and timestamp.
    pub run_point: fn(&BenchCtx<'_>, &Sweep, &str, u64) -> Result<Vec<Row>>,
    /// Variants the default plots draw: the routed kernel and the baselines its targets are measured against
    /// (every variant stays in the CSV and can be plotted on request). Empty: every variant.
    pub headline: &'static [&'static str],
    /// Target lines the default plots draw.
    pub targets: &'static [PlotTarget],
    /// Every name `run_point` reads from a sweep, as its axis or from `[sweep.params]`. Checked before any GPU
    /// work: a sweep whose axis or a parameter is not listed is an error naming the valid ones. Empty: not
    /// checked.
    pub params: &'static [&'static str],
    /// A GPU-free check of one point (parameter types, shape rules, sizes no GPU can hold), run on every point
    /// of every sweep before any GPU work. `None`: only the generic size check.
    pub check_point: Option<fn(&Sweep, u64) -> Result<()>>,
}

/// A target drawn as a horizontal line on a kernel's default plots.
#[derive(Debug, Clone, Copy)]
pub struct PlotTarget {
    /// The CSV column the target is stated in (e.g. `pct_copy_bw`).
    pub metric: &'static str,
    pub value: f64,
    /// Legend text, e.g. "target: decode >= 80% of copy BW".
    pub label: &'static str,
}
