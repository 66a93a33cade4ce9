//! Measurement hooks of the norm_quant family and the baseline its targets are measured against: the unfused
//! chain [`rmsnorm_then_quant`] (RMSNorm kernel -> BF16 rows in HBM -> quantize kernel [`quantize_bf16_rows`]),
//! the quantize-only hook of the resident NVFP4 encoder the tests use, and a device-to-device
//! copy of the same bytes (the bandwidth reference). The bench layer (src/bench/kernels/norm_quant.rs) turns
//! sweep points into calls of [`bench_rows`]; the seeded inputs here are shared with the tests and the mHC hooks.

use anyhow::{bail, Result};
use half::bf16;

use super::{
    check_len, check_resident, check_rows, quantize_bf16_rows, reference, resident_block_threads,
    resident_grid, resident_nvfp4_entry, rmsnorm_quant, rmsnorm_quant_into, upload_checked_bf16,
    NormOutputs, OutFormat, QuantView, RowsIn, RowsOut, FAMILY,
};
use crate::gpu::arena::{Arena, WorkspaceLayout};
use crate::gpu::launch::{launch, DeviceBuf, KernelArgs, Launch, Stream};
use crate::gpu::timing::TimingPlan;
use crate::gpu::{drv, Gpu};

/// The workspace of the unfused chain for `rows` rows of `d`: the BF16 staging rows and their rstd
/// ([`RowsOut::carve`] with [`OutFormat::Bf16`]).
pub fn unfused_workspace_layout(rows: usize, d: usize) -> WorkspaceLayout {
    RowsOut::layout(OutFormat::Bf16, rows, d)
}

/// The unfused baseline: the RMSNorm kernel writes BF16 `staging` (and its rstd, `staging.rstd`), then the
/// quantize kernel reads it into `out` (whose rstd is left untouched). For a BF16 `out` it is just the RMSNorm
/// kernel, writing `out`. The same bits as the fused kernel: the quantizer sees the BF16 `y` in both.
pub fn rmsnorm_then_quant(
    gpu: &Gpu,
    stream: &Stream,
    x: RowsIn<'_>,
    w: &impl DeviceBuf<bf16>,
    eps: f32,
    staging: &RowsOut,
    out: &RowsOut,
) -> Result<()> {
    let QuantView::Bf16 { y } = staging.q else {
        bail!("rmsnorm_then_quant: staging must be BF16");
    };
    if staging.rows != out.rows || staging.d != out.d {
        bail!("rmsnorm_then_quant: staging must have the output's shape");
    }
    if out.format == OutFormat::Bf16 {
        return rmsnorm_quant_into(gpu, stream, x, w, eps, out);
    }
    rmsnorm_quant_into(gpu, stream, x, w, eps, staging)?;
    quantize_bf16_rows(gpu, stream, &y, out)
}

/// Quantize-only resident NVFP4 (`quant_nvfp4_bf16in_resident_nw<d / 1024>`): BF16 rows `y` -> NVFP4, the same
/// bits as [`quantize_bf16_rows`]; the test hook of the [`RowsPath::ResidentNvfp4`] encoder at exact e2m1
/// decision points. `out.rstd` untouched.
pub fn quantize_bf16_rows_resident_nvfp4(
    gpu: &Gpu,
    stream: &Stream,
    y: &impl DeviceBuf<bf16>,
    out: &RowsOut,
) -> Result<()> {
    let (rows, d) = (out.rows, out.d);
    check_resident(rows, d, out.format, true)?;
    check_len("y", y.elems(), rows * d)?;
    // (y, q, scales, gsa, rows)
    let k = gpu.kernel(FAMILY, &resident_nvfp4_entry("quant_nvfp4_bf16in", d))?;
    let threads = resident_block_threads(d);
    let grid = resident_grid(gpu, &k, threads, 0, rows)?;
    let mut a = KernelArgs::new();
    a.buf(y);
    out.push(&mut a, 0, false);
    a.i32(rows as i32);
    unsafe {
        launch(
            stream,
            &k,
            Launch::new((grid, 1, 1), (threads, 1, 1)),
            &mut a,
        )
    }
}

/// One timed point: samples in microseconds and the bytes a perfect kernel moves (inputs read once, outputs
/// written once).
#[derive(Debug, Clone)]
pub struct BenchPoint {
    pub kernel: &'static str,
    pub variant: String,
    pub rows: usize,
    pub d: usize,
    pub bytes: u64,
    pub samples_us: Vec<f64>,
    /// The variant this one is raced against (None for a baseline).
    pub baseline: Option<String>,
}

/// Variants of the row kernels: `fused_<fmt>` ([`rmsnorm_quant`] as called: its kernel choice by shape,
/// [`super::rows_path`]), `unfused_<fmt>` (fmt in nvfp4, fp8; bf16 has only the one kernel, `fused_bf16`) and
/// `copy` (device-to-device copy of the same number of bytes, the bandwidth reference).
pub const ROW_VARIANTS: &[&str] = &[
    "fused_nvfp4",
    "unfused_nvfp4",
    "fused_fp8",
    "unfused_fp8",
    "fused_bf16",
    "copy",
];

/// Time one row-kernel variant on BF16 rows `[rows, d]` of seeded random data.
pub fn bench_rows(
    gpu: &Gpu,
    variant: &str,
    rows: usize,
    d: usize,
    seed: u64,
    plan: TimingPlan,
) -> Result<BenchPoint> {
    check_rows(rows, d)?;
    let stream = gpu.stream.clone();
    let host = random_rows(rows, d, seed);
    let x = upload_checked_bf16(gpu, "x", &host)?;
    let w = upload_checked_bf16(gpu, "w", &random_weight(d, seed ^ 0x5eed))?;
    let eps = reference::RMS_EPS;
    let in_bytes = (rows * d * 2 + d * 2) as u64;
    // kind_fmt, kind in fused / unfused; or `copy`.
    let (kind, fmt) = variant.rsplit_once('_').unwrap_or((variant, "bf16"));
    let point = |bytes: u64, samples: Vec<f64>, baseline: Option<String>| BenchPoint {
        kernel: "rmsnorm_quant",
        variant: variant.to_string(),
        rows,
        d,
        bytes,
        samples_us: samples,
        baseline,
    };
    match kind {
        "copy" => {
            let mut dst = gpu.zeros::<bf16>(rows * d)?;
            let s = gpu.time_us(plan, || {
                drv(stream.memcpy_dtod(&x, &mut dst), "memcpy_dtod")
            })?;
            Ok(point(4 * (rows * d) as u64, s, None))
        }
        "fused" => {
            let format = OutFormat::parse(fmt)?;
            let mut out = NormOutputs::alloc_poisoned(gpu, format, rows, d)?;
            let s = gpu.time_us(plan, || {
                rmsnorm_quant(gpu, &stream, RowsIn::Bf16(&x), &w, eps, &mut out)
            })?;
            let bytes = in_bytes + (rows * (format.row_bytes(d) + 4)) as u64;
            // raced against the unfused chain
            let baseline = (format != OutFormat::Bf16).then(|| format!("unfused_{fmt}"));
            Ok(point(bytes, s, baseline))
        }
        "unfused" => {
            let format = OutFormat::parse(fmt)?;
            let mut arena = Arena::for_layout(gpu, &unfused_workspace_layout(rows, d))?;
            let staging = RowsOut::carve(&mut arena, OutFormat::Bf16, rows, d)?;
            let out = NormOutputs::alloc_poisoned(gpu, format, rows, d)?;
            let view = out.view();
            let s = gpu.time_us(plan, || {
                rmsnorm_then_quant(gpu, &stream, RowsIn::Bf16(&x), &w, eps, &staging, &view)
            })?;
            // Same useful bytes as the fused kernel: the staging round trip is the baseline's overhead.
            let bytes = in_bytes + (rows * (format.row_bytes(d) + 4)) as u64;
            Ok(point(bytes, s, None))
        }
        _ => bail!(
            "unknown rmsnorm_quant variant `{variant}` (known: {})",
            ROW_VARIANTS.join(", ")
        ),
    }
}

// ---- seeded inputs shared by tests and benchmarks ------------------------------------------------------------

fn rng(seed: u64) -> rand_chacha::ChaCha8Rng {
    use rand::SeedableRng;
    rand_chacha::ChaCha8Rng::seed_from_u64(seed)
}

/// Rows of roughly unit-normal values with a per-row magnitude 2^-4 .. 2^4 and per-16-block factor
/// 2^-2 .. 2^2 (so block scales differ), BF16-representable (rounded), never all zero.
pub fn random_rows(rows: usize, d: usize, seed: u64) -> Vec<f32> {
    use rand::Rng;
    let mut r = rng(seed);
    let mut v = Vec::with_capacity(rows * d);
    for _ in 0..rows {
        let row_scale = 2f32.powf(r.random_range(-4.0..4.0));
        let mut block = 1.0;
        for c in 0..d {
            if c % 16 == 0 {
                block = 2f32.powf(r.random_range(-2.0..2.0));
            }
            let n: f32 = (0..4).map(|_| r.random::<f32>()).sum::<f32>() - 2.0;
            v.push(crate::formats::bf16::round(n * 1.732 * row_scale * block));
        }
    }
    v
}

/// Distinct rows a benchmark input draws ([`timing_rows`]); more rows repeat them.
const BENCH_DISTINCT_ROWS: usize = 16384;

/// [`random_rows`] for timing: the first min(rows, 16384) rows drawn, the rest repeating them in order. Why:
/// drawing every value costs ~0.2 us per token-row on the host (~50 s per variant at 65536 tokens x 4 streams x D
/// 7168), while the kernels' time does not depend on whether rows repeat (every row is read and written at its own
/// address; 16384 distinct rows of X are >= 128 MiB, beyond the 50 MB L2).
pub fn timing_rows(rows: usize, d: usize, seed: u64) -> Vec<f32> {
    let distinct = rows.min(BENCH_DISTINCT_ROWS);
    let mut v = random_rows(distinct, d, seed);
    v.reserve(rows * d - v.len());
    while v.len() < rows * d {
        let take = (rows * d - v.len()).min(distinct * d);
        v.extend_from_within(..take);
    }
    v
}

/// An RMSNorm weight around 1 (0.5 .. 1.5), BF16-representable.
pub fn random_weight(d: usize, seed: u64) -> Vec<f32> {
    use rand::Rng;
    let mut r = rng(seed);
    (0..d)
        .map(|_| crate::formats::bf16::round(r.random_range(0.5..1.5)))
        .collect()
}
