//! The TOML schema of sweep configs (`bench-configs/*.toml`).
//!
//! ```toml
//! [defaults]                         # optional; every key optional
//! reps = 50                          # timed repetitions per point
//! warmup = 5                         # untimed repetitions first
//! flush_l2 = true                    # flush L2 between reps ...
//! min_bytes_for_no_flush = 200_000_000   # ... unless the working set is at least this large
//!
//! [[sweep]]
//! kernel = "copy"                    # required
//! variants = ["memcpy", "kernel"]    # optional; default: all of the kernel's variants
//! baseline = "memcpy"                # optional; the variant the others are raced against
//! axis = "bytes"                     # required: the swept parameter
//! values = [1_048_576, 67_108_864]   # required, non-empty, non-negative integers
//! reps = 100                         # optional per-sweep override of reps / warmup / flush_l2
//! [sweep.params]                     # fixed parameters: integers, floats, strings
//! # (e.g. `cols = 4096` for nvfp4_quantize_rows, whose axis is `rows`)
//! ```
//!
//! Unknown keys are errors (a typo must not silently fall back to a default). Errors from the TOML
//! parser carry the line and column; checks after parsing name the sweep (`sweep #2 (kernel `copy`)`).
//! What a config means for the registered kernels (kernel, variant, axis and parameter names, sizes) is
//! checked by `bench::runner::plan` / `check`, still before any GPU work.

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::Deserialize;

/// A parsed, checked sweep config file.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SweepConfig {
    /// The `[defaults]` table, with built-in values for absent keys.
    #[serde(default)]
    pub defaults: RunSettings,
    /// The `[[sweep]]` entries, in file order.
    #[serde(default, rename = "sweep")]
    pub sweeps: Vec<Sweep>,
}

/// How each point is timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunSettings {
    /// Timed repetitions per point (>= 1).
    pub reps: u32,
    /// Untimed repetitions before timing (clocks up, caches and JIT warm).
    pub warmup: u32,
    /// Flush L2 between reps so every rep reads from HBM.
    pub flush_l2: bool,
    /// A working set at least this large cannot stay in L2 (60 MB on H200) anyway, so no flush.
    pub min_bytes_for_no_flush: u64,
}

impl Default for RunSettings {
    fn default() -> RunSettings {
        RunSettings {
            reps: 50,
            warmup: 5,
            flush_l2: true,
            min_bytes_for_no_flush: 200_000_000,
        }
    }
}

impl RunSettings {
    /// Whether to flush L2 between reps of a kernel whose working set is `working_set_bytes`.
    pub fn needs_flush(&self, working_set_bytes: u64) -> bool {
        self.flush_l2 && working_set_bytes < self.min_bytes_for_no_flush
    }
}

/// One `[[sweep]]`: a kernel run over `values` of `axis`, other parameters fixed.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sweep {
    pub kernel: String,
    /// `None`: all of the kernel's variants (see [`Sweep::variants_from`]).
    #[serde(default)]
    pub variants: Option<Vec<String>>,
    /// The variant every other one is raced against (fills `Row::baseline`).
    #[serde(default)]
    pub baseline: Option<String>,
    pub axis: String,
    pub values: Vec<u64>,
    #[serde(default)]
    pub reps: Option<u32>,
    #[serde(default)]
    pub warmup: Option<u32>,
    #[serde(default)]
    pub flush_l2: Option<bool>,
    #[serde(default)]
    pub params: toml::Table,
    /// 1-based position in the file, for error messages; set by the parser.
    #[serde(skip)]
    index: usize,
}

impl SweepConfig {
    /// Parse and check a config from TOML text.
    pub fn from_toml_str(text: &str) -> Result<SweepConfig> {
        let mut config: SweepConfig = toml::from_str(text).map_err(|e| anyhow::anyhow!("{e}"))?;
        for (i, sweep) in config.sweeps.iter_mut().enumerate() {
            sweep.index = i + 1;
        }
        config.check()?;
        Ok(config)
    }

    /// Read, parse and check a config file; every error names the file.
    pub fn from_path(path: &Path) -> Result<SweepConfig> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read sweep config {}", path.display()))?;
        SweepConfig::from_toml_str(&text)
            .with_context(|| format!("invalid sweep config {}", path.display()))
    }

    fn check(&self) -> Result<()> {
        if self.sweeps.is_empty() {
            bail!("the config has no [[sweep]] entries");
        }
        if self.defaults.reps == 0 {
            bail!("[defaults] reps must be at least 1");
        }
        for sweep in &self.sweeps {
            sweep.check()?;
        }
        Ok(())
    }
}

impl Sweep {
    /// `sweep #N (kernel `name`)`, the prefix of every error about this sweep.
    pub fn name(&self) -> String {
        format!("sweep #{} (kernel `{}`)", self.index, self.kernel)
    }

    /// Timing settings for this sweep: `defaults` with this sweep's overrides applied.
    pub fn settings(&self, defaults: &RunSettings) -> RunSettings {
        RunSettings {
            reps: self.reps.unwrap_or(defaults.reps),
            warmup: self.warmup.unwrap_or(defaults.warmup),
            flush_l2: self.flush_l2.unwrap_or(defaults.flush_l2),
            min_bytes_for_no_flush: defaults.min_bytes_for_no_flush,
        }
    }

    /// The variants to run, given all variants the kernel has: the listed ones (each must exist),
    /// or all of them when the sweep lists none.
    pub fn variants_from(&self, available: &[&str]) -> Result<Vec<String>> {
        match &self.variants {
            None => Ok(available.iter().map(|v| v.to_string()).collect()),
            Some(listed) => {
                for v in listed {
                    if !available.contains(&v.as_str()) {
                        bail!(
                            "{}: unknown variant `{v}`; the kernel has: {}",
                            self.name(),
                            available.join(", ")
                        );
                    }
                }
                Ok(listed.clone())
            }
        }
    }

    /// A non-negative integer parameter.
    pub fn param_u64(&self, name: &str) -> Result<u64> {
        match self.param(name)? {
            toml::Value::Integer(i) if *i >= 0 => Ok(*i as u64),
            other => bail!(
                "{}: parameter `{name}` is {}, expected a non-negative integer",
                self.name(),
                describe(other)
            ),
        }
    }

    /// A number parameter (an integer is accepted and converted).
    pub fn param_f64(&self, name: &str) -> Result<f64> {
        match self.param(name)? {
            toml::Value::Float(f) => Ok(*f),
            toml::Value::Integer(i) => Ok(*i as f64),
            other => bail!(
                "{}: parameter `{name}` is {}, expected a number",
                self.name(),
                describe(other)
            ),
        }
    }

    /// A string parameter.
    pub fn param_str(&self, name: &str) -> Result<&str> {
        match self.param(name)? {
            toml::Value::String(s) => Ok(s),
            other => bail!(
                "{}: parameter `{name}` is {}, expected a string",
                self.name(),
                describe(other)
            ),
        }
    }

    /// Whether `[sweep.params]` has `name`.
    pub fn has_param(&self, name: &str) -> bool {
        self.params.contains_key(name)
    }

    /// A shape label for one point, `axis=value` then the parameters in name order, e.g.
    /// `rows=64,cols=4096`. Rows of different variants at the same point get the same label,
    /// which is what pairs them with their baseline.
    pub fn shape_label(&self, value: u64) -> String {
        let mut parts = vec![format!("{}={value}", self.axis)];
        for (k, v) in &self.params {
            let v = match v {
                toml::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            parts.push(format!("{k}={v}"));
        }
        parts.join(",")
    }

    fn param(&self, name: &str) -> Result<&toml::Value> {
        self.params.get(name).with_context(|| {
            let known: Vec<&str> = self.params.keys().map(String::as_str).collect();
            format!(
                "{}: missing parameter `{name}` in [sweep.params] (it has: {})",
                self.name(),
                if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                }
            )
        })
    }

    fn check(&self) -> Result<()> {
        let name = self.name();
        if self.kernel.trim().is_empty() {
            bail!("{name}: `kernel` is empty");
        }
        if self.axis.trim().is_empty() {
            bail!("{name}: `axis` is empty");
        }
        if self.values.is_empty() {
            bail!(
                "{name}: `values` is empty; give at least one value of `{}`",
                self.axis
            );
        }
        if let Some(variants) = &self.variants {
            if variants.is_empty() {
                bail!("{name}: `variants` is empty; leave it out to run all variants");
            }
            let mut seen = BTreeSet::new();
            for v in variants {
                if !seen.insert(v) {
                    bail!("{name}: variant `{v}` is listed twice");
                }
            }
            if let Some(b) = &self.baseline {
                if !variants.contains(b) {
                    bail!(
                        "{name}: baseline `{b}` is not among `variants` ({})",
                        variants.join(", ")
                    );
                }
            }
        }
        if self.reps == Some(0) {
            bail!("{name}: `reps` must be at least 1");
        }
        if self.params.contains_key(&self.axis) {
            bail!(
                "{name}: `{}` is both the axis and a fixed parameter in [sweep.params]",
                self.axis
            );
        }
        for (k, v) in &self.params {
            if !matches!(
                v,
                toml::Value::Integer(_) | toml::Value::Float(_) | toml::Value::String(_)
            ) {
                bail!(
                    "{name}: parameter `{k}` is {}; parameters must be integers, floats or strings",
                    describe(v)
                );
            }
        }
        Ok(())
    }
}

fn describe(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => format!("the string {s:?}"),
        toml::Value::Integer(i) => format!("the integer {i}"),
        toml::Value::Float(f) => format!("the float {f}"),
        toml::Value::Boolean(b) => format!("the boolean {b}"),
        toml::Value::Datetime(d) => format!("the datetime {d}"),
        toml::Value::Array(_) => "an array".to_string(),
        toml::Value::Table(_) => "a table".to_string(),
    }
}

/// The default suite, `bench-configs/default.toml`, embedded so the binary runs without the repo.
pub const DEFAULT_CONFIG_TOML: &str = include_str!("../../bench-configs/default.toml");

/// The parsed default suite.
pub fn default_config() -> Result<SweepConfig> {
    SweepConfig::from_toml_str(DEFAULT_CONFIG_TOML)
        .context("the embedded bench-configs/default.toml")
}
