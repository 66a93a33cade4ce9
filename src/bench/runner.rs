//! The sweep runner behind `megamoe bench` and the default suite: for every `[[sweep]]` of a config, every
//! value of its axis and every variant, run the kernel's bench hook, stamp each row with the limits measured
//! in the same run, the GPU's telemetry and the git commit, and write one CSV per kernel, plots and REPORT.md.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::bench::config::{Sweep, SweepConfig};
use crate::bench::hook::{BenchCtx, BenchKernel, MAX_SIZE};
use crate::bench::{csv_out, env, fill_speedups, report, Limits, Row, Telemetry};
use crate::gpu::telemetry::Telemetry as Nvml;
use crate::gpu::Gpu;
use crate::progress::Progress;

/// Options of one run.
pub struct RunOptions {
    pub out_dir: PathBuf,
    pub kernels: Vec<String>,
    pub reps: Option<u32>,
    pub seed: u64,
    /// No sweep flushes L2 between repetitions (`bench --warm-l2`): each point timed with what the repetition
    /// before it left in L2, the bound of what keeping its bytes in L2 could buy. Its rows carry no mark of it, so
    /// [`check`] wants them in a directory of their own.
    pub warm_l2: bool,
    /// An output directory was named (`--out`), not the default results/<gpu>.
    pub out_named: bool,
}

/// Run every sweep of `config` (restricted to `opts.kernels` when non-empty; nothing when it sweeps none of
/// them). Returns the CSV paths written. A failing point is reported and the run goes on; the error count makes
/// the result an `Err` at the end. [`check`] the options and configs first: this checks `config` again, but
/// only after the caller has opened the GPU.
pub fn run(
    gpu: &Gpu,
    config: &SweepConfig,
    limits: &Limits,
    opts: &RunOptions,
) -> Result<Vec<PathBuf>> {
    let registry = crate::bench::kernels::all();
    let nvml = Nvml::new(gpu.info.ordinal as u32);
    let commit = env::git_commit();
    let plan = plan(config, &registry, &opts.kernels)?;
    if plan.is_empty() {
        return Ok(Vec::new());
    }
    let total: usize = plan.iter().map(|(s, _, v)| s.values.len() * v.len()).sum();
    let mut progress = Progress::new("bench", total);
    let mut by_kernel: BTreeMap<&str, Vec<Row>> = BTreeMap::new();
    let mut failures = Vec::new();
    let mut written = Vec::new();
    for (s, k, variants) in plan.iter() {
        let mut settings = s.settings(&config.defaults);
        if let Some(r) = opts.reps {
            settings.reps = r;
        }
        if opts.warm_l2 {
            settings.flush_l2 = false;
        }
        for &value in &s.values {
            for v in variants {
                // The point's data seed depends on the kernel and the point's shape only, not on which sweep
                // lists it: a variant measured in its own sweep sees the same inputs (e.g. the same MoE routing,
                // hence the same expert loads) as the variants of another sweep at that point, so rows of
                // different sweeps compare like for like.
                let seed = opts.seed
                    ^ crate::model::weights::fnv1a64(&format!(
                        "{} {}",
                        k.name,
                        s.shape_label(value)
                    ));
                let ctx = BenchCtx {
                    gpu,
                    settings,
                    seed,
                };
                progress.tick(&format!("{} {v} {}", k.name, s.shape_label(value)));
                match (k.run_point)(&ctx, s, v, value) {
                    Ok(rows) => {
                        let reading = nvml.read();
                        let tel = Telemetry {
                            gpu: reading.gpu.clone().unwrap_or_else(|| gpu.info.name.clone()),
                            sm_clock_mhz: reading.sm_clock_mhz,
                            mem_clock_mhz: reading.mem_clock_mhz,
                            power_w: reading.power_w,
                            temp_c: reading.temp_c,
                        };
                        for mut r in rows {
                            r = r.with_limits(limits, k.matmul).with_telemetry(&tel);
                            if r.baseline.is_none() {
                                if let Some(b) = s.baseline.as_ref().filter(|b| *b != v) {
                                    r = r.with_baseline(b);
                                }
                            }
                            r.git_commit = commit.clone();
                            r.timestamp = env::timestamp_utc();
                            by_kernel.entry(k.name).or_default().push(r);
                        }
                    }
                    Err(e) => {
                        progress.println(&format!(
                            "FAILED {} {v} {}: {e:#}",
                            k.name,
                            s.shape_label(value)
                        ));
                        failures.push(format!("{} {v} {}: {e:#}", k.name, s.shape_label(value)));
                    }
                }
            }
        }
        // After every sweep, so a run stopped by a time limit keeps what it measured.
        write_kernel_rows(&opts.out_dir, &mut by_kernel, &mut written)?;
    }
    report::report_from_csv_dir(&opts.out_dir)?;
    if !failures.is_empty() {
        bail!(
            "{} point(s) failed:\n{}",
            failures.len(),
            failures.join("\n")
        );
    }
    Ok(written)
}

/// The sweeps of `config` to run (those of `kernels` when non-empty), each with its kernel and variants, every
/// one checked against the registry without a GPU: kernel and variant names, the baseline, the axis and
/// parameter names the kernel reads, and each point's sizes.
pub fn plan<'a>(
    config: &'a SweepConfig,
    registry: &'a [BenchKernel],
    kernels: &[String],
) -> Result<Vec<(&'a Sweep, &'a BenchKernel, Vec<String>)>> {
    let mut plan = Vec::new();
    for s in config
        .sweeps
        .iter()
        .filter(|s| kernels.is_empty() || kernels.iter().any(|k| k == &s.kernel))
    {
        let k = registry
            .iter()
            .find(|k| k.name == s.kernel)
            .with_context(|| {
                format!(
                    "{}: unknown kernel `{}`; the kernels are: {}",
                    s.name(),
                    s.kernel,
                    kernel_names(registry)
                )
            })?;
        let variants = s.variants_from(k.variants)?;
        if let Some(b) = &s.baseline {
            if !variants.contains(b) {
                bail!(
                    "{}: baseline `{b}` is not among the variants run ({})",
                    s.name(),
                    variants.join(", ")
                );
            }
        }
        check_names(s, k)?;
        for &value in &s.values {
            check_sizes(s, value)?;
            if let Some(check) = k.check_point {
                check(s, value)
                    .with_context(|| format!("{}: point {}", s.name(), s.shape_label(value)))?;
            }
        }
        plan.push((s, k, variants));
    }
    Ok(plan)
}

/// Check the options of a run and every config (each with the name errors give it, e.g. its path) against the
/// registry, before any GPU work: `reps` at least 1, every kernel of `opts.kernels` registered and swept by one
/// of `configs`, and every selected sweep (see [`plan`]).
pub fn check(configs: &[(String, SweepConfig)], opts: &RunOptions) -> Result<()> {
    if opts.reps == Some(0) {
        bail!("--reps must be at least 1");
    }
    if opts.warm_l2 && !opts.out_named {
        bail!(
            "--warm-l2 rows carry no mark of the warm L2: name a directory of their own with --out, apart from \
             the flushed rows of results/<gpu>"
        );
    }
    let registry = crate::bench::kernels::all();
    for k in &opts.kernels {
        if !registry.iter().any(|r| r.name == k) {
            bail!(
                "--kernel `{k}`: no such kernel; the kernels are: {}",
                kernel_names(&registry)
            );
        }
        if !configs
            .iter()
            .any(|(_, c)| c.sweeps.iter().any(|s| &s.kernel == k))
        {
            let mut swept: Vec<&str> = configs
                .iter()
                .flat_map(|(_, c)| c.sweeps.iter().map(|s| s.kernel.as_str()))
                .collect();
            swept.sort();
            swept.dedup();
            bail!(
                "--kernel `{k}`: no sweep of the config(s) runs it; they sweep: {}",
                swept.join(", ")
            );
        }
    }
    for (name, c) in configs {
        plan(c, &registry, &opts.kernels)
            .with_context(|| format!("invalid sweep config {name}"))?;
    }
    Ok(())
}

fn kernel_names(registry: &[BenchKernel]) -> String {
    registry
        .iter()
        .map(|k| k.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The axis and every parameter name must be one the kernel reads (when it lists them).
fn check_names(s: &Sweep, k: &BenchKernel) -> Result<()> {
    if k.params.is_empty() {
        return Ok(());
    }
    let known = k.params.join(", ");
    if !k.params.contains(&s.axis.as_str()) {
        bail!(
            "{}: unknown axis `{}`; the kernel reads: {known}",
            s.name(),
            s.axis
        );
    }
    for p in s.params.keys() {
        if !k.params.contains(&p.as_str()) {
            bail!(
                "{}: unknown parameter `{p}` in [sweep.params]; the kernel reads: {known}",
                s.name()
            );
        }
    }
    Ok(())
}

/// The generic size rule: no axis value or integer parameter above [`MAX_SIZE`].
fn check_sizes(s: &Sweep, value: u64) -> Result<()> {
    let too_big = |what: String, v: u64| {
        anyhow::anyhow!(
            "{}: {what} = {v} is larger than any GPU can hold (the limit for a size is {MAX_SIZE} = 1 TiB)",
            s.name()
        )
    };
    if value > MAX_SIZE {
        return Err(too_big(format!("`{}` (the axis)", s.axis), value));
    }
    for (p, v) in &s.params {
        if let toml::Value::Integer(i) = v {
            if *i as u64 > MAX_SIZE && *i > 0 {
                return Err(too_big(format!("parameter `{p}`"), *i as u64));
            }
        }
    }
    Ok(())
}

/// Move the measured rows into `<out_dir>/<kernel>.csv`. Several configs may sweep the same kernel (e.g.
/// `copy`): rows already in the file are kept except those measured again (same variant, shape and GPU), so
/// one directory holds one CSV per kernel.
fn write_kernel_rows(
    out_dir: &Path,
    by_kernel: &mut BTreeMap<&str, Vec<Row>>,
    written: &mut Vec<PathBuf>,
) -> Result<()> {
    std::fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    for (kernel, rows) in by_kernel.iter_mut() {
        if rows.is_empty() {
            continue;
        }
        let path = out_dir.join(format!("{kernel}.csv"));
        let mut all: Vec<Row> = if path.exists() {
            csv_out::read_rows(&path)?
        } else {
            Vec::new()
        };
        all.retain(|old| {
            !rows
                .iter()
                .any(|r| r.variant == old.variant && r.shape == old.shape && r.gpu == old.gpu)
        });
        all.append(rows);
        fill_speedups(&mut all);
        csv_out::write_rows(&path, &all)?;
        if !written.contains(&path) {
            written.push(path);
        }
    }
    Ok(())
}

/// Plots and REPORT.md for a directory of CSVs (`megamoe report`).
pub fn report_dir(dir: &Path) -> Result<PathBuf> {
    report::report_from_csv_dir(dir)
}
