//! Sweep adapter of the dense family: `dense` (axis `rows` = M, parameter `linear` = fp8 | wo_a | swiglu | bf16 with
//! `n`, `k`, and `groups` (wo_a) or `jobs` (bf16)), one decode linear per point through `ops::dense::bench`.

use anyhow::{bail, Result};

use crate::bench::config::Sweep;
use crate::bench::hook::{BenchCtx, BenchKernel, PlotTarget};
use crate::bench::{MatmulKind, Row, Summary};
use crate::ops::dense::bench::{measure, variant_applies, Linear, VARIANTS};

const TARGETS: &[PlotTarget] = &[
    PlotTarget {
        metric: "pct_copy_bw",
        value: 85.0,
        label: "target: M = 1..8 >= 85% of copy BW",
    },
    PlotTarget {
        metric: "pct_copy_bw",
        value: 75.0,
        label: "target: M = 64 >= 75% of copy BW",
    },
];

pub fn kernels() -> Vec<BenchKernel> {
    vec![BenchKernel {
        name: "dense",
        variants: VARIANTS,
        matmul: MatmulKind::Bf16,
        run_point: dense_point,
        headline: &["dense", "cublaslt_bf16", "cublaslt_block_scaled"],
        targets: TARGETS,
        params: &["rows", "linear", "n", "k", "groups", "jobs"],
        check_point: Some(check_dense),
    }]
}

fn linear(s: &Sweep) -> Result<Linear> {
    if s.axis != "rows" {
        bail!("the axis must be `rows` (M), not `{}`", s.axis);
    }
    let n = s.param_u64("n")? as usize;
    let k = s.param_u64("k")? as usize;
    Ok(match s.param_str("linear")? {
        "fp8" => Linear::Fp8 { n, k },
        "wo_a" => Linear::WoA {
            groups: s.param_u64("groups")? as usize,
            r: n,
            k,
        },
        "swiglu" => Linear::Swiglu { inter: n, dim: k },
        "bf16" => Linear::Bf16 {
            n,
            k,
            jobs: if s.has_param("jobs") {
                s.param_u64("jobs")? as usize
            } else {
                1
            },
        },
        other => bail!("dense: unknown linear `{other}` (fp8, wo_a, swiglu, bf16)"),
    })
}

fn check_dense(s: &Sweep, rows: u64) -> Result<()> {
    let lin = linear(s)?;
    lin.shape(rows as usize).check()?;
    let variants: Vec<&str> = match &s.variants {
        Some(v) => v.iter().map(String::as_str).collect(),
        None => VARIANTS.to_vec(),
    };
    if let Some(v) = variants.iter().find(|v| !variant_applies(lin, v)) {
        bail!(
            "variant `{v}` does not run this linear (cublaslt_block_scaled: fp8 and swiglu only; \
             dense_tensor_cores: fp8 and bf16 only); name this sweep's variants without it (e.g. variants = \
             [\"dense\", \"cublaslt_bf16\"])"
        );
    }
    Ok(())
}

fn dense_point(ctx: &BenchCtx<'_>, s: &Sweep, variant: &str, rows: u64) -> Result<Vec<Row>> {
    let lin = linear(s)?;
    let plan = |b: u64| ctx.plan(b);
    let m = measure(ctx.gpu, &plan, lin, rows as usize, ctx.seed, variant)?;
    let sum = Summary::of(&m.samples_us)?;
    let r = Row::new("dense", variant, &s.shape_label(rows))
        .with_rows(rows)
        .with_timing(&sum, m.samples_us.len() as u64)
        .with_work(Some(m.bytes), None);
    Ok(vec![if variant == "cublaslt_bf16" {
        r
    } else {
        r.with_baseline("cublaslt_bf16")
    }])
}
