//! Fused RMSNorm + quantization and the fused DSV4 mHC boundary (kernels/norm_quant.cu).
//!
//! * [`rmsnorm_quant`]: rows `[rows, D]` (BF16 or f32, D a multiple of 128, at most 32768) -> RMSNorm with
//!   a BF16 weight -> NVFP4 (per-row global scale), FP8 e4m3 1x128 (ue8m0 scales) or BF16, one launch.
//!   BF16 in -> NVFP4 / FP8 picks its kernel by shape ([`rows_path`]): from 4096 rows when D is a multiple
//!   of 1024 the resident-wave kernels (one wave of CTAs looping over rows, weight staged once per CTA: v6
//!   for NVFP4 up to D 8192, v5 for FP8), otherwise the v4p row loop (NVFP4 up to [`V4P_NVFP4_MAX_D`]) /
//!   one CTA per row (FP8, and NVFP4 above that D); everything else one CTA per row.
//!   [`rmsnorm_quant_with`] forces one [`RowsPath`]; both give the same bits.
//! * [`rmsnorm_then_quant`]: the unfused baseline (RMSNorm kernel -> BF16 in HBM -> quantize kernel). It
//!   produces the same bits as the fused kernel (the quantizer sees the BF16 `y` in both).
//! * [`mhc_pre`]: the mHC boundary `hc_pre` + RMSNorm + quant, as a split-K mix kernel plus a per-token
//!   finish kernel; [`mhc_pre_unfused`] is the op-by-op chain (rms, GEMV, Sinkhorn, apply, RMSNorm,
//!   quant: 6 launches); [`mhc_post`] and [`hc_head`]. [`mhc_pre`] launches its two kernels as a
//!   programmatic-dependent-launch pair up to 8 tokens, as two plain launches up to 127, and with the mix on
//!   BF16 tensor cores (kernels/mhc_mix_tc.cu) from 128 tokens ([`mhc_pre_auto_path`]); [`mhc_pre_with`] takes an
//!   explicit [`MhcPrePath`] (same bits on the FFMA paths; [`MhcPrePath::TensorMix`] sums in another order).
//!   Every mHC launcher takes any token count >= 1: batches above [`MHC_LAUNCH_MAX_TOKENS`] (65535, the
//!   grid.y cap) run as consecutive launches over token chunks ([`mhc_token_chunks`]), bit-identical to one.
//!
//! Layouts: NVFP4 codes `[rows, D/2]` (lower index in the low nibble), e4m3 scales `[rows, D/16]`,
//! global scale `[rows]` f32; FP8 codes `[rows, D]`, ue8m0 scale codes `[rows, D/128]`; residual streams
//! `X` of a token `[4, D]` BF16 stream-major (so `[T, 4, D]` for T tokens); mHC mix weights `[24, 4D]` f32.
//! `rstd` (the per-row `1/sqrt(mean(x^2)+eps)` of the RMSNorm) is always written: the tests use it to
//! separate the reduction-order effect from everything else, and it costs 4 bytes per row.
//! The same `eps` is used for the mHC residual RMS and the sub-layer RMSNorm (both 1e-6 in DSV4).
//!
//! Non-finite inputs are not rejected on the device path (that would cost a pass over the data); the
//! host-side helpers ([`upload_checked_f32`], [`MhcWeights::upload`]) reject them.

pub mod bench;
pub mod exec;
pub mod reference;

pub use exec::exec_kernels;

use anyhow::{bail, Result};
use cudarc::driver::{CudaFunction, CudaSlice};
use half::bf16;

use crate::gpu::pdl::{launch_ex, LaunchExOpts, RawArgs};
use crate::gpu::timing::TimingPlan;
use crate::gpu::{drv, launch_cfg, Gpu, PushKernelArg};

/// Kernel family name (kernels/norm_quant.cu).
pub const FAMILY: &str = "norm_quant";
/// Chunks of 8 values per thread in the row kernels (`CH` in the .cu).
const CHUNKS_PER_THREAD: usize = 4;
/// Largest supported hidden size: 1024 threads x 4 chunks x 8 values.
pub const MAX_D: usize = 1024 * CHUNKS_PER_THREAD * 8;
/// Columns of 4D per CTA of the split-K mix kernel (`MIX_COLS`).
const MIX_COLS: usize = 128;

/// The dtype a normalized row is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutFormat {
    Nvfp4,
    Fp8,
    Bf16,
}

impl OutFormat {
    pub fn name(self) -> &'static str {
        match self {
            OutFormat::Nvfp4 => "nvfp4",
            OutFormat::Fp8 => "fp8",
            OutFormat::Bf16 => "bf16",
        }
    }
    pub fn parse(s: &str) -> Result<OutFormat> {
        match s {
            "nvfp4" => Ok(OutFormat::Nvfp4),
            "fp8" => Ok(OutFormat::Fp8),
            "bf16" => Ok(OutFormat::Bf16),
            _ => bail!("unknown output format `{s}` (nvfp4, fp8, bf16)"),
        }
    }
    /// Bytes written per row of `d` values (rstd excluded).
    pub fn row_bytes(self, d: usize) -> usize {
        match self {
            OutFormat::Nvfp4 => d / 2 + d / 16 + 4,
            OutFormat::Fp8 => d + d / 128,
            OutFormat::Bf16 => 2 * d,
        }
    }
}

/// Input rows on the device.
pub enum RowsIn<'a> {
    Bf16(&'a CudaSlice<bf16>),
    F32(&'a CudaSlice<f32>),
}

impl RowsIn<'_> {
    fn len(&self) -> usize {
        match self {
            RowsIn::Bf16(s) => s.len(),
            RowsIn::F32(s) => s.len(),
        }
    }
    fn suffix(&self) -> &'static str {
        match self {
            RowsIn::Bf16(_) => "bf16in",
            RowsIn::F32(_) => "f32in",
        }
    }
    pub fn elem_bytes(&self) -> usize {
        match self {
            RowsIn::Bf16(_) => 2,
            RowsIn::F32(_) => 4,
        }
    }
}

/// Device buffers of a normalized + quantized output.
pub enum QuantBufs {
    Nvfp4 {
        data: CudaSlice<u8>,
        scales: CudaSlice<u8>,
        global_scale: CudaSlice<f32>,
    },
    Fp8 {
        data: CudaSlice<u8>,
        scales: CudaSlice<u8>,
    },
    Bf16 {
        y: CudaSlice<bf16>,
    },
}

impl QuantBufs {
    /// Push the output buffers in the kernels' parameter order: NVFP4 (codes, block scales, global scales),
    /// FP8 (codes, scales), BF16 (y).
    fn push_launch_args<'a>(&'a mut self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        match self {
            QuantBufs::Nvfp4 {
                data,
                scales,
                global_scale,
            } => {
                b.arg(data).arg(scales).arg(global_scale);
            }
            QuantBufs::Fp8 { data, scales } => {
                b.arg(data).arg(scales);
            }
            QuantBufs::Bf16 { y } => {
                b.arg(y);
            }
        }
    }
}

/// The output of one RMSNorm(+quant) over `rows` rows of `d`.
pub struct NormOutputs {
    pub rows: usize,
    pub d: usize,
    pub format: OutFormat,
    pub q: QuantBufs,
    /// Per-row `1/sqrt(mean(x^2) + eps)`.
    pub rstd: CudaSlice<f32>,
}

impl NormOutputs {
    /// Buffers poisoned with 0xFF (NaN for f32/bf16/e4m3; codes are checked against the reference).
    pub fn alloc_poisoned(
        gpu: &Gpu,
        format: OutFormat,
        rows: usize,
        d: usize,
    ) -> Result<NormOutputs> {
        check_rows(rows, d)?;
        let q = match format {
            OutFormat::Nvfp4 => QuantBufs::Nvfp4 {
                data: gpu.poisoned(rows * d / 2, 0xFF)?,
                scales: gpu.poisoned(rows * d / 16, 0xFF)?,
                global_scale: gpu.poisoned(rows, 0xFF)?,
            },
            OutFormat::Fp8 => QuantBufs::Fp8 {
                data: gpu.poisoned(rows * d, 0xFF)?,
                scales: gpu.poisoned(rows * d / 128, 0xFF)?,
            },
            OutFormat::Bf16 => QuantBufs::Bf16 {
                y: gpu.poisoned(rows * d, 0xFF)?,
            },
        };
        Ok(NormOutputs {
            rows,
            d,
            format,
            q,
            rstd: gpu.poisoned(rows, 0xFF)?,
        })
    }

    /// Re-poison every buffer (before a checked run).
    pub fn poison(&mut self, gpu: &Gpu) -> Result<()> {
        match &mut self.q {
            QuantBufs::Nvfp4 {
                data,
                scales,
                global_scale,
            } => {
                gpu.fill_bytes(data, 0xFF)?;
                gpu.fill_bytes(scales, 0xFF)?;
                gpu.fill_bytes(global_scale, 0xFF)?;
            }
            QuantBufs::Fp8 { data, scales } => {
                gpu.fill_bytes(data, 0xFF)?;
                gpu.fill_bytes(scales, 0xFF)?;
            }
            QuantBufs::Bf16 { y } => gpu.fill_bytes(y, 0xFF)?,
        }
        gpu.fill_bytes(&mut self.rstd, 0xFF)
    }

    pub fn download(&self, gpu: &Gpu) -> Result<HostNormOutputs> {
        let q = match &self.q {
            QuantBufs::Nvfp4 {
                data,
                scales,
                global_scale,
            } => HostQuant::Nvfp4(reference::Nvfp4Rows {
                rows: self.rows,
                cols: self.d,
                data: gpu.download(data)?,
                scales: gpu.download(scales)?,
                global_scale: gpu.download(global_scale)?,
            }),
            QuantBufs::Fp8 { data, scales } => HostQuant::Fp8(reference::Fp8Rows {
                rows: self.rows,
                cols: self.d,
                data: gpu.download(data)?,
                scales: gpu.download(scales)?,
            }),
            QuantBufs::Bf16 { y } => {
                HostQuant::Bf16(gpu.download(y)?.iter().map(|v| v.to_f32()).collect())
            }
        };
        Ok(HostNormOutputs {
            q,
            rstd: gpu.download(&self.rstd)?,
        })
    }
}

/// Host copy of a quantized output.
#[derive(Debug, Clone, PartialEq)]
pub enum HostQuant {
    Nvfp4(reference::Nvfp4Rows),
    Fp8(reference::Fp8Rows),
    /// BF16 values widened to f32.
    Bf16(Vec<f32>),
}

impl HostQuant {
    /// The CPU reference's encoding of BF16-rounded normalized rows `y` in `format`.
    pub fn encode(format: OutFormat, y: &[f32], rows: usize, d: usize) -> Result<HostQuant> {
        Ok(match format {
            OutFormat::Nvfp4 => HostQuant::Nvfp4(reference::quantize_nvfp4_rows(y, rows, d)?),
            OutFormat::Fp8 => HostQuant::Fp8(reference::quantize_fp8_rows(y, rows, d)?),
            OutFormat::Bf16 => HostQuant::Bf16(y.to_vec()),
        })
    }
}

#[derive(Debug, Clone)]
pub struct HostNormOutputs {
    pub q: HostQuant,
    pub rstd: Vec<f32>,
}

/// Shape rules of the row kernels.
pub fn check_rows(rows: usize, d: usize) -> Result<()> {
    if rows == 0 {
        bail!("norm_quant: rows must be >= 1");
    }
    if d == 0 || !d.is_multiple_of(128) || d > MAX_D {
        bail!("norm_quant: hidden size {d} must be a positive multiple of 128 and at most {MAX_D}");
    }
    if rows > i32::MAX as usize || rows.checked_mul(4 * d).is_none_or(|n| n > (1usize << 40)) {
        bail!("norm_quant: {rows} rows of {d} is too large");
    }
    Ok(())
}

fn check_eps(eps: f32) -> Result<()> {
    if !(eps.is_finite() && eps > 0.0) {
        bail!("norm_quant: eps must be finite and > 0, got {eps}");
    }
    Ok(())
}

/// Threads per CTA of the row kernels: enough for `CHUNKS_PER_THREAD` chunks each, a multiple of 32.
pub fn row_block_threads(d: usize) -> u32 {
    let threads = (d / 8).div_ceil(CHUNKS_PER_THREAD);
    (threads.div_ceil(32) * 32) as u32
}

fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        bail!("norm_quant: `{what}` has {got} elements, expected {want}");
    }
    Ok(())
}

/// Upload host f32 values after checking they are all finite.
pub fn upload_checked_f32(gpu: &Gpu, what: &str, v: &[f32]) -> Result<CudaSlice<f32>> {
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        bail!(
            "norm_quant: `{what}` has a non-finite value {} at index {i}",
            v[i]
        );
    }
    gpu.upload(v)
}

/// Upload host values as BF16 after checking they are all finite.
pub fn upload_checked_bf16(gpu: &Gpu, what: &str, v: &[f32]) -> Result<CudaSlice<bf16>> {
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        bail!(
            "norm_quant: `{what}` has a non-finite value {} at index {i}",
            v[i]
        );
    }
    gpu.upload(&crate::formats::bf16::to_bf16_vec(v))
}

/// Fused RMSNorm + quantization of `rows` rows of `d` with weight `w` (BF16 [d]) into `out`.
///
/// BF16 input -> NVFP4 / FP8 runs the kernel [`rows_path`] picks for the shape (v6 / v5 from 4096 rows, else
/// [`RowsPath::V4`]); F32 input and BF16 output always run [`RowsPath::V4`] (one CTA per row). Every path
/// gives the same bits.
pub fn rmsnorm_quant(
    gpu: &Gpu,
    x: RowsIn<'_>,
    w: &CudaSlice<bf16>,
    eps: f32,
    out: &mut NormOutputs,
) -> Result<()> {
    let path = match x {
        RowsIn::Bf16(_) => rows_path(out.rows, out.d, out.format),
        RowsIn::F32(_) => RowsPath::V4,
    };
    rmsnorm_quant_with(gpu, x, w, eps, out, path)
}

/// Which kernels run BF16 rows -> NVFP4 / FP8 ([`rmsnorm_quant`] picks one with [`rows_path`],
/// [`rmsnorm_quant_with`] forces one). Both give the same bits (tests/norm_quant.rs checks them against each
/// other and against the CPU reference).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowsPath {
    /// The session-3 kernels: BF16 -> NVFP4 `rmsnorm_nvfp4_bf16in_v4p` (one resident wave looping over rows
    /// with the next row's loads in flight, packed BF16-pair e2m1 encoder, grid [`v4_grid`]; it replaced the
    /// one-CTA-per-row kernel: 30.5 vs 34.1 us at 4096 x 4096, a tie at 1-64 rows; above
    /// [`V4P_NVFP4_MAX_D`], where a v4p CTA does not fit on an SM, that one-CTA-per-row kernel
    /// `rmsnorm_nvfp4_bf16in` again); every other input/format pair the one-CTA-per-row kernel
    /// `rmsnorm_<fmt>_<in>` (a looping FP8 v4 lost: 23.4 vs 21.6 us). Any shape.
    V4,
    /// BF16 -> FP8 only: the v5 kernel `rmsnorm_fp8_bf16in_v5`, one resident wave of CTAs looping over rows,
    /// the weight staged once per CTA in shared memory (as f32), a division-free ue8m0 scale. `d` a multiple
    /// of [`V5_D_MULTIPLE`]. (The v5 NVFP4 kernel was removed in session 7: v6 beat it twice, see
    /// [`rows_path`].)
    V5,
    /// BF16 -> NVFP4 only: `rmsnorm_nvfp4_bf16in_v6_w<d / 1024>`, the (removed) v5 NVFP4 kernel with D fixed
    /// at compile time (straight-line reads of the reduction partials), ss / D as a multiply for D = 2^k, and a
    /// binary-search e2m1 encoder (fewer SASS instructions per element; the same bits as v4p). `d` a multiple
    /// of 1024 up to [`V6_MAX_D`]. [`rows_path`] takes it where it took v5 for NVFP4 since the session-6 A/B.
    V6,
}

/// Largest D the v4p BF16 -> NVFP4 row kernels launch at: they run roundup32(D / 32) threads held to 80
/// registers (`__maxnreg__`), i.e. 2,560 registers per warp, and an SM's 65,536 registers hold 25 such warps
/// = 800 threads = D 25,600 (found by the H200 run: D 32,768 failed with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES).
/// Above it [`RowsPath::V4`] (and the unfused chain's quantizer) run the one-CTA-per-row kernels
/// `rmsnorm_nvfp4_bf16in` / `quant_nvfp4_bf16in` instead (until session 7 the v5 NVFP4 kernel ran them; in
/// between, session 7's last commits refused these D). No DSV4 shape is among them (D 4096 and 7168).
pub const V4P_NVFP4_MAX_D: usize = 25_600;

/// Fewest rows for which [`rows_path`] picks a resident-wave kernel ([`RowsPath::V5`] FP8, [`RowsPath::V6`]
/// NVFP4).
pub const V5_MIN_ROWS: usize = 4096;

/// The kernels [`rmsnorm_quant`] runs for BF16 rows `[rows, d]` -> `format`, when `rows >= V5_MIN_ROWS` and
/// `d` is a multiple of [`V5_D_MULTIPLE`]: FP8 [`RowsPath::V5`], NVFP4 with `d <= V6_MAX_D` [`RowsPath::V6`];
/// [`RowsPath::V4`] otherwise (BF16 output, smaller row counts, other D).
///
/// NVFP4 with `d` above [`V6_MAX_D`] (9216 ..= 32768, multiples of 1024): the v5 NVFP4 kernel ran these from
/// 4096 rows (and at any row count above [`V4P_NVFP4_MAX_D`]) until session 7; now they take v4p (one
/// resident wave too, the weight re-read per row instead of staged; session-4 A/B at D 7168, the nearest
/// measured D: v4p 756.0 vs v5 598.8 us at 65536 rows, so expect v4p ~25% slower there than v5 was; not
/// measured above 8192), and above [`V4P_NVFP4_MAX_D`] one CTA per row. No DSV4 shape is among them.
///
/// Session-7 H200 run (commit 7666184, median us, v6 vs v5, bit-identical): NVFP4 4096 x 4096 25.41 vs 27.46,
/// 65536 x 4096 275.0 vs 307.1: the session-6 result again, so the v5 NVFP4 kernel was removed.
///
/// Session-6 A/B (results/h200/session6-ab/rmsnorm_quant.csv, median us, v6 vs v5, bit-identical): NVFP4 D 4096
/// rows 4096 25.4 vs 27.8, 16384 74.7 vs 82.7, 65536 275.0 (58.9% of copy bandwidth) vs 306.9 (52.8%); D 7168
/// 4096 43.0 vs 45.9, 16384 146.1 vs 156.2, 65536 558.5 vs 601.0. v6 won every point.
///
/// Measured on the H200 (session-4 A/B, BF16 in, median us, v5 vs V4; results/h200/session4-ab/rmsnorm_quant.csv):
/// * NVFP4 D 4096: rows 1 6.8 vs 6.3, 64 7.2 vs 6.4, 1024 12.7 vs 12.7, 4096 27.8 vs 30.6, 16384 83.1 vs
///   100.4, 65536 306.8 (52.8% of copy bandwidth) vs 380.6 (42.5%); D 7168: 1 7.5 vs 6.6, 64 7.8 vs 7.4, 1024
///   17.1 vs 19.8, 4096 46.3 vs 53.8, 16384 156.0 vs 193.0, 65536 598.8 vs 756.0.
/// * FP8 D 4096: rows 1 6.3 vs 5.3, 64 6.5 vs 5.9, 1024 11.1 vs 10.3, 4096 21.2 vs 21.6, 16384 58.1 vs 63.6,
///   65536 220.4 (86.3%) vs 233.9 (81.3%); D 7168: 1 6.8 vs 5.9, 64 7.1 vs 6.4, 1024 13.6 vs 14.1, 4096 32.2
///   vs 36.5, 16384 104.5 vs 117.7, 65536 397.4 vs 448.9.
///
/// v5 won every measured point from 4096 rows on, for both formats and both D; it lost at 1-64 rows (its
/// per-CTA weight staging has few rows to amortize over, a likely reason, not profiled); at 1024 rows it won
/// at D 7168, tied (NVFP4) or lost (FP8) at D 4096. 4096 is the smallest measured row count where v5 wins
/// everywhere, so the switch sits there (rows between 1024 and 4096 were not measured).
pub fn rows_path(rows: usize, d: usize, format: OutFormat) -> RowsPath {
    let resident_wave = rows >= V5_MIN_ROWS && d.is_multiple_of(V5_D_MULTIPLE);
    match format {
        OutFormat::Nvfp4 if resident_wave && d <= V6_MAX_D => RowsPath::V6,
        OutFormat::Fp8 if resident_wave => RowsPath::V5,
        _ => RowsPath::V4,
    }
}

fn check_rmsnorm_args(
    x: &RowsIn<'_>,
    w: &CudaSlice<bf16>,
    eps: f32,
    out: &NormOutputs,
) -> Result<()> {
    check_rows(out.rows, out.d)?;
    check_eps(eps)?;
    check_len("x", x.len(), out.rows * out.d)?;
    check_len("weight", w.len(), out.d)
}

/// One CTA per row: `rmsnorm_<fmt>_<in>`.
fn rmsnorm_quant_per_row_kernel(
    gpu: &Gpu,
    x: RowsIn<'_>,
    w: &CudaSlice<bf16>,
    eps: f32,
    out: &mut NormOutputs,
) -> Result<()> {
    check_rmsnorm_args(&x, w, eps, out)?;
    let (rows, d) = (out.rows, out.d);
    let name = format!("rmsnorm_{}_{}", out.format.name(), x.suffix());
    let f = gpu.function(FAMILY, &name)?;
    let cfg = launch_cfg((rows as u32, 1, 1), (row_block_threads(d), 1, 1), 0);
    let d_i = d as i32;
    let mut b = gpu.stream.launch_builder(&f);
    match &x {
        RowsIn::Bf16(s) => b.arg(*s),
        RowsIn::F32(s) => b.arg(*s),
    };
    b.arg(w);
    out.q.push_launch_args(&mut b);
    b.arg(&mut out.rstd).arg(&d_i).arg(&eps);
    drv(unsafe { b.launch(cfg) }, &name)?;
    Ok(())
}

/// Grid of a row-looping kernel (v4p, v5 or v6): one full resident wave of `f` at `threads` per CTA and `smem` bytes
/// of dynamic shared memory (see [`v4_grid`]), or `rows` CTAs if fewer.
fn resident_wave_grid(
    gpu: &Gpu,
    f: &CudaFunction,
    threads: u32,
    smem: usize,
    rows: usize,
    name: &str,
) -> Result<usize> {
    let per_sm = drv(
        f.occupancy_max_active_blocks_per_multiprocessor(threads, smem, None),
        "cuOccupancyMaxActiveBlocksPerMultiprocessor",
    )?;
    // Zero when one CTA needs more registers or shared memory than an SM has (e.g. the v4p NVFP4 kernel, 80
    // registers, above V4P_NVFP4_MAX_D): refuse before the launch instead of failing in it.
    anyhow::ensure!(
        per_sm > 0,
        "{name}: a CTA of {threads} threads and {smem} B of shared memory does not fit on one SM (the v4p \
         NVFP4 row kernels support D up to {V4P_NVFP4_MAX_D})"
    );
    Ok(v4_grid(
        rows,
        per_sm as usize * gpu.info.sm_count.max(1) as usize,
    ))
}

/// `rmsnorm_nvfp4_bf16in_v4p`: BF16 rows -> NVFP4, rows looped by one resident wave.
fn rmsnorm_nvfp4_bf16in_rows_v4p(
    gpu: &Gpu,
    x: RowsIn<'_>,
    w: &CudaSlice<bf16>,
    eps: f32,
    out: &mut NormOutputs,
) -> Result<()> {
    check_rmsnorm_args(&x, w, eps, out)?;
    let (rows, d) = (out.rows, out.d);
    let name = "rmsnorm_nvfp4_bf16in_v4p";
    let RowsIn::Bf16(xs) = x else {
        bail!("{name}: the input must be BF16");
    };
    let QuantBufs::Nvfp4 {
        data,
        scales,
        global_scale,
    } = &mut out.q
    else {
        bail!("{name}: the output format must be nvfp4");
    };
    let f = gpu.function(FAMILY, name)?;
    let threads = row_block_threads(d);
    let grid = resident_wave_grid(gpu, &f, threads, 0, rows, name)?;
    let cfg = launch_cfg((grid as u32, 1, 1), (threads, 1, 1), 0);
    let (rows_i, d_i) = (rows as i32, d as i32);
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(xs)
        .arg(w)
        .arg(data)
        .arg(scales)
        .arg(global_scale)
        .arg(&mut out.rstd)
        .arg(&rows_i)
        .arg(&d_i)
        .arg(&eps);
    drv(unsafe { b.launch(cfg) }, name)?;
    Ok(())
}

/// CTAs of a v4 launch: one full resident wave (`max_resident` = occupancy x SMs), or one CTA per row when
/// there are fewer rows. A full wave puts the same number of CTAs on every SM and CTA b runs rows b, b + grid,
/// ...: per SM the row counts differ by at most one per CTA, spread over the SMs. (Fewer, evenly loaded CTAs
/// would leave some SMs with one CTA more than others: up to 1/occupancy of an SM's work as tail.)
pub fn v4_grid(rows: usize, max_resident: usize) -> usize {
    rows.min(max_resident.max(1))
}

/// Second kernel of the unfused chain: quantize BF16 rows `y` [rows, d] to NVFP4 or FP8 (no norm).
/// NVFP4 runs `quant_nvfp4_bf16in_v4p` (the encoder of [`rmsnorm_quant`]'s BF16 NVFP4 kernel, rows looped by
/// one resident wave), FP8 `quant_fp8_bf16in` (one CTA per row). `out.rstd` is left untouched.
pub fn quantize_bf16_rows(gpu: &Gpu, y: &CudaSlice<bf16>, out: &mut NormOutputs) -> Result<()> {
    let (rows, d) = (out.rows, out.d);
    check_rows(rows, d)?;
    check_len("y", y.len(), rows * d)?;
    let threads = row_block_threads(d);
    let d_i = d as i32;
    match &mut out.q {
        QuantBufs::Nvfp4 { .. } if d <= V4P_NVFP4_MAX_D => {
            launch_quant_nvfp4_rows(gpu, "quant_nvfp4_bf16in_v4p", threads, true, y, out)?;
        }
        QuantBufs::Nvfp4 {
            data,
            scales,
            global_scale,
        } => {
            // Above the v4p limit: one CTA per row (same encoder contract, the CPU quantizer's bits).
            let cfg = launch_cfg((rows as u32, 1, 1), (threads, 1, 1), 0);
            let f = gpu.function(FAMILY, "quant_nvfp4_bf16in")?;
            let mut b = gpu.stream.launch_builder(&f);
            b.arg(y).arg(data).arg(scales).arg(global_scale).arg(&d_i);
            drv(unsafe { b.launch(cfg) }, "quant_nvfp4_bf16in")?;
        }
        QuantBufs::Fp8 { data, scales } => {
            let cfg = launch_cfg((rows as u32, 1, 1), (threads, 1, 1), 0);
            let f = gpu.function(FAMILY, "quant_fp8_bf16in")?;
            let mut b = gpu.stream.launch_builder(&f);
            b.arg(y).arg(data).arg(scales).arg(&d_i);
            drv(unsafe { b.launch(cfg) }, "quant_fp8_bf16in")?;
        }
        QuantBufs::Bf16 { .. } => {
            bail!("quantize_bf16_rows: the output format must be nvfp4 or fp8")
        }
    }
    Ok(())
}

// ---- the v5 FP8 row kernel (RowsPath::V5) ---------------------------------------------------------------------

/// The v5 and v6 kernels give every thread exactly 4 chunks of 8 values (blockDim = d / 32, whole warps).
pub const V5_D_MULTIPLE: usize = 1024;

/// The D rule the v5 and v6 kernels share: `d` a multiple of [`V5_D_MULTIPLE`] (`kernel` names the kernel).
fn check_resident_wave_d(kernel: &str, rows: usize, d: usize) -> Result<()> {
    check_rows(rows, d)?;
    if !d.is_multiple_of(V5_D_MULTIPLE) {
        bail!(
            "norm_quant {kernel}: hidden size {d} must be a multiple of {V5_D_MULTIPLE} (one warp per 1024 values)"
        );
    }
    Ok(())
}

/// Shape / format rules of the v5 kernel (checked before any launch): FP8 output (the v5 NVFP4 kernel was
/// removed in session 7; NVFP4 runs [`RowsPath::V6`] or [`RowsPath::V4`]), `d` a multiple of 1024.
pub fn check_v5(rows: usize, d: usize, format: OutFormat) -> Result<()> {
    check_resident_wave_d("v5", rows, d)?;
    if format != OutFormat::Fp8 {
        bail!(
            "norm_quant v5: output format must be fp8 (v5 is the FP8 kernel only; its NVFP4 kernel was removed \
             in session 7 for v6)"
        );
    }
    Ok(())
}

/// Threads per CTA of the v5 / v6 kernels (= [`row_block_threads`] for their sizes: the same channel ownership).
pub fn v5_block_threads(d: usize) -> u32 {
    (d / 32) as u32
}

/// [`rmsnorm_quant`] with an explicit kernel choice ([`RowsPath`]); every path gives the same bits.
/// [`RowsPath::V5`] / [`RowsPath::V6`] refuse (before any launch) what they do not run: F32 input, another
/// output format than FP8 / NVFP4, `d` not a multiple of [`V5_D_MULTIPLE`] (V6: or above [`V6_MAX_D`]).
pub fn rmsnorm_quant_with(
    gpu: &Gpu,
    x: RowsIn<'_>,
    w: &CudaSlice<bf16>,
    eps: f32,
    out: &mut NormOutputs,
    path: RowsPath,
) -> Result<()> {
    match path {
        RowsPath::V4
            if out.format == OutFormat::Nvfp4
                && matches!(x, RowsIn::Bf16(_))
                && out.d <= V4P_NVFP4_MAX_D =>
        {
            rmsnorm_nvfp4_bf16in_rows_v4p(gpu, x, w, eps, out)
        }
        RowsPath::V4 => rmsnorm_quant_per_row_kernel(gpu, x, w, eps, out),
        RowsPath::V5 => rmsnorm_quant_resident_wave(gpu, x, w, eps, out, false),
        RowsPath::V6 => rmsnorm_quant_resident_wave(gpu, x, w, eps, out, true),
    }
}

/// The resident-wave row kernels: v5 FP8 (`rmsnorm_fp8_bf16in_v5`, parameters ..., rows, d, eps) or, with
/// `v6`, the NVFP4 v6 entry point for `d` (`rmsnorm_nvfp4_bf16in_v6_w<d / 1024>`, D compiled in: ..., rows, eps).
/// Same grid rule, block size and shared memory (the weight as f32).
fn rmsnorm_quant_resident_wave(
    gpu: &Gpu,
    x: RowsIn<'_>,
    w: &CudaSlice<bf16>,
    eps: f32,
    out: &mut NormOutputs,
    v6: bool,
) -> Result<()> {
    check_rmsnorm_args(&x, w, eps, out)?;
    let (rows, d) = (out.rows, out.d);
    if v6 {
        check_v6(rows, d, out.format)?;
    } else {
        check_v5(rows, d, out.format)?;
    }
    let RowsIn::Bf16(xs) = x else {
        bail!(
            "norm_quant {}: the input must be BF16",
            if v6 { "v6" } else { "v5" }
        );
    };
    let name = if v6 {
        v6_entry("rmsnorm_nvfp4_bf16in", d)
    } else {
        "rmsnorm_fp8_bf16in_v5".to_string()
    };
    let smem = d * 4; // the weight as f32
    let f = gpu.function_with_smem(FAMILY, &name, smem)?;
    let threads = v5_block_threads(d);
    let grid = resident_wave_grid(gpu, &f, threads, smem, rows, &name)?;
    let cfg = launch_cfg((grid as u32, 1, 1), (threads, 1, 1), smem as u32);
    let (rows_i, d_i) = (rows as i32, d as i32);
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(xs).arg(w);
    out.q.push_launch_args(&mut b); // v6: NVFP4, v5: FP8 (the checks above)
    b.arg(&mut out.rstd).arg(&rows_i);
    if !v6 {
        b.arg(&d_i);
    }
    b.arg(&eps);
    drv(unsafe { b.launch(cfg) }, &name)?;
    Ok(())
}

// ---- the v6 NVFP4 row kernels (RowsPath::V6, the NVFP4 default from 4096 rows since session 6) ---------------------

/// Largest D of the v6 kernels: one entry point per warp count d / 1024 = 1..=8 (DSV4: 4096 and 7168).
pub const V6_MAX_D: usize = 8 * V5_D_MULTIPLE;

/// Shape / format rules of the v6 kernels (checked before any launch): `d` a multiple of 1024 (as v5), NVFP4
/// output, `d` <= [`V6_MAX_D`].
pub fn check_v6(rows: usize, d: usize, format: OutFormat) -> Result<()> {
    check_resident_wave_d("v6", rows, d)?;
    if format != OutFormat::Nvfp4 {
        bail!("norm_quant v6: output format must be nvfp4 (v6 is the NVFP4 kernel only)");
    }
    if d > V6_MAX_D {
        bail!("norm_quant v6: hidden size {d} is above {V6_MAX_D} (entry points exist for d / 1024 = 1..=8)");
    }
    Ok(())
}

/// Entry point of the v6 kernel for `d` (`prefix` = `rmsnorm_nvfp4_bf16in` or `quant_nvfp4_bf16in`).
fn v6_entry(prefix: &str, d: usize) -> String {
    format!("{prefix}_v6_w{}", d / V5_D_MULTIPLE)
}

/// Quantize-only v6 NVFP4 (`quant_nvfp4_bf16in_v6_w<d / 1024>`): BF16 rows `y` -> NVFP4, the same bits as
/// [`quantize_bf16_rows`] (v4p); tests the v6 encoder at exact e2m1 decision points. `out.rstd` untouched.
pub fn quantize_bf16_rows_v6(gpu: &Gpu, y: &CudaSlice<bf16>, out: &mut NormOutputs) -> Result<()> {
    let (rows, d) = (out.rows, out.d);
    check_v6(rows, d, out.format)?;
    check_len("y", y.len(), rows * d)?;
    let name = v6_entry("quant_nvfp4_bf16in", d);
    launch_quant_nvfp4_rows(gpu, &name, v5_block_threads(d), false, y, out)
}

/// A quantize-only BF16 -> NVFP4 row-looping kernel (`quant_nvfp4_bf16in_v4p` / `_v6_w<d / 1024>`: the
/// same parameters, except that v6 has D compiled in and takes no `d`, `with_d` false): one resident wave of
/// `threads`-thread CTAs over `out.rows` rows. The caller checked the shapes.
fn launch_quant_nvfp4_rows(
    gpu: &Gpu,
    name: &str,
    threads: u32,
    with_d: bool,
    y: &CudaSlice<bf16>,
    out: &mut NormOutputs,
) -> Result<()> {
    let (rows, d) = (out.rows, out.d);
    let QuantBufs::Nvfp4 {
        data,
        scales,
        global_scale,
    } = &mut out.q
    else {
        bail!("{name}: the output format must be nvfp4");
    };
    let f = gpu.function(FAMILY, name)?;
    let grid = resident_wave_grid(gpu, &f, threads, 0, rows, name)?;
    let cfg = launch_cfg((grid as u32, 1, 1), (threads, 1, 1), 0);
    let (rows_i, d_i) = (rows as i32, d as i32);
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(y)
        .arg(data)
        .arg(scales)
        .arg(global_scale)
        .arg(&rows_i);
    if with_d {
        b.arg(&d_i);
    }
    drv(unsafe { b.launch(cfg) }, name)?;
    Ok(())
}

/// The unfused baseline: RMSNorm kernel writing BF16 `staging` [rows, d] (rstd into `out.rstd`), then the
/// quantize kernel. For a BF16 `out` it is just the RMSNorm kernel.
pub fn rmsnorm_then_quant(
    gpu: &Gpu,
    x: RowsIn<'_>,
    w: &CudaSlice<bf16>,
    eps: f32,
    staging: &mut NormOutputs,
    out: &mut NormOutputs,
) -> Result<()> {
    if staging.format != OutFormat::Bf16 || staging.rows != out.rows || staging.d != out.d {
        bail!("rmsnorm_then_quant: staging must be BF16 with the output's shape");
    }
    rmsnorm_quant(gpu, x, w, eps, staging)?;
    if out.format == OutFormat::Bf16 {
        return Ok(());
    }
    let QuantBufs::Bf16 { y } = &staging.q else {
        unreachable!("checked above")
    };
    quantize_bf16_rows(gpu, y, out)
}

// ---- mHC ----------------------------------------------------------------------------------------------------

/// One mHC boundary's parameters on the device, plus the sub-layer's RMSNorm weight.
pub struct MhcWeights {
    pub d: usize,
    /// 24 for a sub-layer boundary, 4 for the head.
    pub nmix: usize,
    pub mix_fn: CudaSlice<f32>,
    /// The mix weights as three BF16 planes `[f1; f2; f3]`, `[3 nmix, 4D]` ([`mix_fn_bf16_planes`]:
    /// `f1 + f2 + f3 == F` exactly), the B operand of the tensor-core mix ([`MhcPrePath::TensorMix`]); sub-layer
    /// boundaries only (`None` for the head).
    pub mix_planes: Option<CudaSlice<bf16>>,
    pub scale: CudaSlice<f32>,
    pub base: CudaSlice<f32>,
    pub norm_weight: CudaSlice<bf16>,
}

impl MhcWeights {
    /// A sub-layer boundary (`hc_attn_*` / `hc_ffn_*`) and its RMSNorm weight (BF16-rounded on upload).
    pub fn upload(
        gpu: &Gpu,
        p: &reference::MhcParams,
        norm_weight: &[f32],
        d: usize,
    ) -> Result<MhcWeights> {
        check_rows(1, d)?;
        check_len("hc mix fn", p.mix_fn.len(), reference::HC_MIX * 4 * d)?;
        check_len("norm weight", norm_weight.len(), d)?;
        Ok(MhcWeights {
            d,
            nmix: reference::HC_MIX,
            mix_fn: upload_checked_f32(gpu, "hc mix fn", &p.mix_fn)?,
            mix_planes: Some(gpu.upload(&mix_fn_bf16_planes(&p.mix_fn))?),
            scale: upload_checked_f32(gpu, "hc scale", &p.scale)?,
            base: upload_checked_f32(gpu, "hc base", &p.base)?,
            norm_weight: upload_checked_bf16(gpu, "norm weight", norm_weight)?,
        })
    }

    /// The final head (`hc_head_fn` [4, 4D], `hc_head_scale` [1], `hc_head_base` [4]) and `norm.weight`.
    pub fn upload_head(
        gpu: &Gpu,
        head_fn: &[f32],
        scale: f32,
        base: &[f32; 4],
        norm_weight: &[f32],
        d: usize,
    ) -> Result<MhcWeights> {
        check_rows(1, d)?;
        check_len("hc head fn", head_fn.len(), reference::HC_HEAD_MIX * 4 * d)?;
        check_len("norm weight", norm_weight.len(), d)?;
        Ok(MhcWeights {
            d,
            nmix: reference::HC_HEAD_MIX,
            mix_fn: upload_checked_f32(gpu, "hc head fn", head_fn)?,
            mix_planes: None,
            scale: upload_checked_f32(gpu, "hc head scale", &[scale])?,
            base: upload_checked_f32(gpu, "hc head base", base)?,
            norm_weight: upload_checked_bf16(gpu, "norm weight", norm_weight)?,
        })
    }
}

/// Outputs of [`mhc_pre`] / [`hc_head`] for `tokens` tokens.
pub struct MhcPreOutputs {
    pub tokens: usize,
    pub d: usize,
    /// [T, 4]
    pub pre: CudaSlice<f32>,
    /// [T, 4] (unused by the head)
    pub post: CudaSlice<f32>,
    /// [T, 16], row-major C[j][k] (unused by the head)
    pub comb: CudaSlice<f32>,
    /// [T, D] BF16: the sub-layer input before its RMSNorm.
    pub u: CudaSlice<bf16>,
    /// RMSNorm(u; weight) in the requested format, and its rstd.
    pub normed: NormOutputs,
    /// Split-K workspace [T, nmix+1, S] (sized for 24 mixes and S = [`mix_splits`], the most any mix uses).
    partials: CudaSlice<f32>,
    /// S of the last launch's partials ([`mix_splits`] for the FFMA mixes, [`tc_mix_splits`] for the tensor-core
    /// mix).
    partial_splits: usize,
}

impl MhcPreOutputs {
    pub fn alloc_poisoned(
        gpu: &Gpu,
        format: OutFormat,
        tokens: usize,
        d: usize,
    ) -> Result<MhcPreOutputs> {
        check_rows(tokens, d)?;
        if d > MHC_MAX_D {
            bail!("mhc: hidden size {d} is above the supported {MHC_MAX_D}");
        }
        Ok(MhcPreOutputs {
            tokens,
            d,
            pre: gpu.poisoned(tokens * 4, 0xFF)?,
            post: gpu.poisoned(tokens * 4, 0xFF)?,
            comb: gpu.poisoned(tokens * 16, 0xFF)?,
            u: gpu.poisoned(tokens * d, 0xFF)?,
            normed: NormOutputs::alloc_poisoned(gpu, format, tokens, d)?,
            partials: gpu.zeros(mix_splits(d) * tokens * (reference::HC_MIX + 1))?,
            partial_splits: mix_splits(d),
        })
    }

    /// The split-K partials of the last launch, `[T, nmix+1, S]` with `S = `[`MhcPreOutputs::partial_splits`]
    /// (the first `T (nmix+1) S` elements of the buffer): entry `[t][j][s]` is the partial `F_j . x` over the
    /// columns of split `s` (`[128 s, 128 s + 128)` of 4D for the FFMA mixes, `[4D s / S, 4D (s+1) / S)` for the
    /// tensor-core mix), `j = nmix` the partial sum of squares. Tests reduce them in the finish's order to
    /// check the rest exactly.
    pub fn partials(&self) -> &CudaSlice<f32> {
        &self.partials
    }

    /// S (splits per token) of the last launch's partials.
    pub fn partial_splits(&self) -> usize {
        self.partial_splits
    }

    /// Fill the split-K workspace with NaN (0xFF bytes): a finish that read it before the mixes wrote it
    /// would turn every output into NaN (tests of the PDL path use this).
    pub fn poison_partials(&mut self, gpu: &Gpu) -> Result<()> {
        gpu.fill_bytes(&mut self.partials, 0xFF)
    }

    pub fn poison(&mut self, gpu: &Gpu) -> Result<()> {
        gpu.fill_bytes(&mut self.pre, 0xFF)?;
        gpu.fill_bytes(&mut self.post, 0xFF)?;
        gpu.fill_bytes(&mut self.comb, 0xFF)?;
        gpu.fill_bytes(&mut self.u, 0xFF)?;
        self.normed.poison(gpu)
    }
}

/// Split-K CTAs over 4D (`4D / MIX_COLS`).
pub fn mix_splits(d: usize) -> usize {
    4 * d / MIX_COLS
}

/// Tokens per CTA tile of the tensor-core mix (`kTileTokens` in kernels/mhc_mix_tc.cu).
const TC_MIX_TILE_TOKENS: usize = 128;
/// Columns of 4D per k-block of the tensor-core mix (`kBlockK`).
const TC_MIX_BLOCK_K: usize = 64;
/// Most K splits of the tensor-core mix (small batches: 1 tile x 64 splits of 4 k-blocks at D 4096).
const TC_MIX_MAX_SPLITS: usize = 64;
/// CTAs the tensor-core mix aims to fill: 2 resident per SM (100 KB of shared memory each) on the H200's 132.
const TC_MIX_TARGET_CTAS: usize = 2 * 132;
/// Dynamic shared memory of `mhc_mix_tc_partial24`: 4 stages x (16 KB X + 9 KB planes) + 1 KB alignment slack.
const TC_MIX_SMEM_BYTES: usize = 4 * (TC_MIX_TILE_TOKENS * 128 + 72 * 128) + 1024;
/// Kernel family of the tensor-core mix (kernels/mhc_mix_tc.cu).
const TC_FAMILY: &str = "mhc_mix_tc";
/// Token count from which [`mhc_pre`] takes [`MhcPrePath::TensorMix`] ([`mhc_pre_auto_path`]): the smallest
/// token count of the session-14 A/B, where the tensor-core mix already won (numbers at [`mhc_pre_auto_path`]).
/// Below it the decode-tuned FFMA paths stay (64 .. 127 tokens not measured with the tensor-core mix).
pub const MHC_TENSOR_MIX_MIN_TOKENS: usize = 128;

/// K splits of the tensor-core mix for `tokens` tokens: the largest power of two `S <= 64` with
/// `ceil(tokens / 128) x S <= 264` (two CTAs per SM on 132 SMs; 1 from 33,792 tokens on) that divides the
/// `4D / 64` k-blocks and does not exceed [`mix_splits`] (the workspace is sized for that many).
/// 4096 tokens -> 8, 16384 -> 2, 65536 -> 1; 1..128 tokens -> 64.
pub fn tc_mix_splits(tokens: usize, d: usize) -> usize {
    let tiles = tokens.div_ceil(TC_MIX_TILE_TOKENS).max(1);
    let kblocks = 4 * d / TC_MIX_BLOCK_K;
    let mut s = 1;
    while s * 2 <= TC_MIX_MAX_SPLITS
        && tiles * s * 2 <= TC_MIX_TARGET_CTAS
        && kblocks.is_multiple_of(s * 2)
        && s * 2 <= mix_splits(d)
    {
        s *= 2;
    }
    s
}

/// The three BF16 planes of the mix weights F (`[nmix, 4D]` f32) as one `[3 nmix, 4D]` BF16 matrix
/// `[f1; f2; f3]`: `f1 = bf16_rn(F)`, `f2 = bf16_rn(F - f1)`, `f3 = bf16_rn(F - f1 - f2)`, with
/// `f1 + f2 + f3 == F` exactly for every F with 2^-110 <= |F| < 2^127 (2 - 2^-8) (above, f1 rounds to infinity),
/// and F = 0. Why (F in `[2^e, 2^(e+1))`, a
/// multiple of `2^(e-23)`): `r1 = F - f1` is a multiple of `2^(e-23)` of magnitude `<= 2^(e-8)` (half an 8-bit
/// ulp), so it has <= 16 significant bits and the fp32 subtraction is exact; `r2 = r1 - f2` likewise is a
/// multiple of `2^(e-23)` of magnitude `<= 2^(e-16)`: <= 8 significant bits, exact in fp32 and in BF16, so
/// `f3 = r2`. (Only F so small that r2 falls below BF16's subnormal grid, 2^-133, loses bits.)
pub fn mix_fn_bf16_planes(mix_fn: &[f32]) -> Vec<bf16> {
    let f1: Vec<bf16> = mix_fn.iter().map(|&f| bf16::from_f32(f)).collect();
    let r1: Vec<f32> = mix_fn
        .iter()
        .zip(&f1)
        .map(|(&f, a)| f - a.to_f32())
        .collect();
    let f2: Vec<bf16> = r1.iter().map(|&r| bf16::from_f32(r)).collect();
    let f3 = r1
        .iter()
        .zip(&f2)
        .map(|(&r, b)| bf16::from_f32(r - b.to_f32()));
    f1.iter()
        .copied()
        .chain(f2.iter().copied())
        .chain(f3)
        .collect()
}

/// Largest hidden size of the mHC kernels: the finish kernel uses up to 128 registers per thread, so its
/// D/32 threads must stay <= 512.
pub const MHC_MAX_D: usize = 16384;
/// Most tokens per mHC kernel launch. `mhc_post` and `mhc_unfused_apply` put the token on grid.y, which the
/// hardware caps at 65535; the other mHC kernels (token on grid.x, or token tiles of 32 on grid.y) would go
/// further, but every mHC launcher splits a batch into chunks of at most this many tokens
/// ([`mhc_token_chunks`]) so that one rule covers them all. Every mHC kernel is token-major (X `[T, 4, D]`,
/// y/u `[T, D]`, pre/post `[T, 4]`, comb `[T, 16]`, partials `[T, nmix+1, S]`, normed rows `[T, ...]`) and
/// computes each token independently of the others, so a chunk is the same kernel on pointers advanced by
/// `t0` tokens with `T = n`: the outputs are bit-identical to one launch over the whole batch (the layout of
/// the partials included). Only batches above this size launch more than once.
pub const MHC_LAUNCH_MAX_TOKENS: usize = 65535;

/// `(first token, token count)` of each launch chunk of a `tokens`-token batch ([`MHC_LAUNCH_MAX_TOKENS`]).
pub fn mhc_token_chunks(tokens: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..tokens)
        .step_by(MHC_LAUNCH_MAX_TOKENS)
        .map(move |t0| (t0, MHC_LAUNCH_MAX_TOKENS.min(tokens - t0)))
}

/// Launch `f` with the parameters in `a` (plain stream-ordered launch, or PDL), no dynamic shared memory.
fn launch_raw(
    gpu: &Gpu,
    f: &CudaFunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    pdl: bool,
    a: &mut RawArgs,
    what: &str,
) -> Result<()> {
    let opts = LaunchExOpts { smem_bytes: 0, pdl };
    launch_ex(gpu, f, grid, block, opts, a, what)
}

fn check_mhc(x: &CudaSlice<bf16>, w: &MhcWeights, out: &MhcPreOutputs) -> Result<()> {
    if out.d > MHC_MAX_D {
        bail!(
            "mhc: hidden size {} is above the supported {MHC_MAX_D}",
            out.d
        );
    }
    if w.d != out.d {
        bail!(
            "mhc: weights are for D = {}, outputs for D = {}",
            w.d,
            out.d
        );
    }
    check_rows(out.tokens, out.d)?;
    check_len("X", x.len(), out.tokens * 4 * out.d)
}

/// One split-K mix kernel (`name`: `mhc_mix_partial4` for the head's 4 mixes, `mhc_mix_partial24_v2` /
/// `_pdl` for a boundary's 24) over tokens `[t0, t0 + n)`: parameters `(X, F, part, T, 4D)`, grid
/// `[S, ceil(n/32)]`. `part` is the `[T, nmix+1, S]` workspace of the whole batch.
fn launch_mix_chunk(
    gpu: &Gpu,
    name: &str,
    x: &CudaSlice<bf16>,
    w: &MhcWeights,
    part: &CudaSlice<f32>,
    (t0, n): (usize, usize),
    pdl: bool,
) -> Result<()> {
    let (d, splits) = (w.d, mix_splits(w.d));
    let f = gpu.function(FAMILY, name)?;
    let mut a = RawArgs::default();
    a.slice_from(gpu, x, t0 * 4 * d)
        .slice(gpu, &w.mix_fn)
        .slice_from(gpu, part, t0 * (w.nmix + 1) * splits)
        .i32(n as i32)
        .i32((4 * d) as i32);
    let grid = (splits as u32, n.div_ceil(32) as u32, 1);
    launch_raw(gpu, &f, grid, (128, 1, 1), pdl, &mut a, name)
}

/// The tensor-core mix (`mhc_mix_tc_partial24`) over tokens `[t0, t0 + n)`: parameters `(X, planes, part, T,
/// 4D)`, grid `[splits, ceil(n/128)]`, 256 threads, [`TC_MIX_SMEM_BYTES`] of dynamic shared memory. `part` is
/// the `[T, 25, splits]` workspace of the whole batch.
fn launch_tc_mix_chunk(
    gpu: &Gpu,
    x: &CudaSlice<bf16>,
    w: &MhcWeights,
    part: &CudaSlice<f32>,
    splits: usize,
    (t0, n): (usize, usize),
) -> Result<()> {
    let d = w.d;
    let Some(planes) = &w.mix_planes else {
        bail!("mhc tensor-core mix: the weights have no BF16 planes (head weights?)");
    };
    let kblocks = 4 * d / TC_MIX_BLOCK_K;
    if splits == 0
        || !(4 * d).is_multiple_of(TC_MIX_BLOCK_K)
        || !kblocks.is_multiple_of(splits)
        || splits > mix_splits(d)
    {
        bail!(
            "mhc tensor-core mix: {splits} splits do not divide the {kblocks} k-blocks of 4D = {}",
            4 * d
        );
    }
    let name = "mhc_mix_tc_partial24";
    let f = gpu.function_with_smem(TC_FAMILY, name, TC_MIX_SMEM_BYTES)?;
    let mut a = RawArgs::default();
    a.slice_from(gpu, x, t0 * 4 * d)
        .slice(gpu, planes)
        .slice_from(gpu, part, t0 * (reference::HC_MIX + 1) * splits)
        .i32(n as i32)
        .i32((4 * d) as i32);
    let grid = (splits as u32, n.div_ceil(TC_MIX_TILE_TOKENS) as u32, 1);
    let opts = LaunchExOpts {
        smem_bytes: TC_MIX_SMEM_BYTES as u32,
        pdl: false,
    };
    launch_ex(gpu, &f, grid, (256, 1, 1), opts, &mut a, name)
}

/// Fused mHC boundary: `(pre, post, C, u) = hc_pre(X)`, then `RMSNorm(u; weight)` in `out.normed.format`.
/// Two kernels (split-K mixes, then two CTAs per token); `x` is `[T, 4, D]`. The launch path is chosen by token
/// count ([`mhc_pre_auto_path`]); the FFMA paths give the same bits, the tensor-core mix (from
/// [`MHC_TENSOR_MIX_MIN_TOKENS`] tokens) sums the same exact products in another order.
pub fn mhc_pre(
    gpu: &Gpu,
    x: &CudaSlice<bf16>,
    w: &MhcWeights,
    eps: f32,
    out: &mut MhcPreOutputs,
) -> Result<()> {
    let path = mhc_pre_auto_path(out.tokens);
    mhc_pre_with(gpu, x, w, eps, out, path)
}

/// Largest token count for which [`mhc_pre`] launches the PDL pair.
pub const MHC_PDL_MAX_TOKENS: usize = 8;

/// The launch path [`mhc_pre`] takes for `tokens` tokens: [`MhcPrePath::PdlPair`] up to
/// [`MHC_PDL_MAX_TOKENS`], [`MhcPrePath::TwoLaunch`] above, [`MhcPrePath::TensorMix`] from
/// [`MHC_TENSOR_MIX_MIN_TOKENS`]. Session-14 A/B (H200, c7c9893, us per boundary, NVFP4 out, plain
/// launches, medians of 50; FFMA two-launch / tensor-core mix / unfused chain): D = 4096, 128 tokens 27.3 / 20.5 /
/// 71.0, 512: 72.0 / 39.2 / 95.5, 2048: 257.7 / 93.2 / 250.6, 8192: 963.3 / 275.3 / 809.4, 65536: 7620 / 2137 /
/// 6100; D = 7168, 128: 38.7 / 23.3 / 99.1, 8192: 1774 / 553 / 1319, 65536: 14073 / 4439 / 10162 (FP8 alike;
/// results/h200/session14-ab/mhc-c7c9893.csv). PDL pair vs two launches, measured on the H200 (us per boundary, D = 4096
/// NVFP4, 16 boundaries in one graph, two launches vs PDL pair): 1 token 8.3 vs 7.3, 8 tokens 8.9 vs 8.8,
/// 16 tokens 10.3 vs 11.0, 32: 12.4 vs 16.8, 64: 15.3 vs 27.7 (D = 7168: 9.7 vs 8.7 at 1 token, 11.0 vs
/// 11.4 at 8, 12.8 vs 14.9 at 16; FP8 alike). From 16 tokens on, the finish grid (two CTAs per token) is
/// resident and waiting while the mix runs and holds the SM resources the mix's CTAs would use.
pub fn mhc_pre_auto_path(tokens: usize) -> MhcPrePath {
    if tokens <= MHC_PDL_MAX_TOKENS {
        MhcPrePath::PdlPair
    } else if tokens < MHC_TENSOR_MIX_MIN_TOKENS {
        MhcPrePath::TwoLaunch
    } else {
        MhcPrePath::TensorMix
    }
}

fn check_mhc_pre(x: &CudaSlice<bf16>, w: &MhcWeights, eps: f32, out: &MhcPreOutputs) -> Result<()> {
    check_mhc(x, w, out)?;
    check_eps(eps)?;
    if w.nmix != reference::HC_MIX {
        bail!(
            "mhc_pre needs sub-layer weights (24 mixes), got {} (head weights go to hc_head)",
            w.nmix
        );
    }
    Ok(())
}

/// The per-token finish of [`mhc_pre`] (`prefix` `mhc_pre_finish2` for the two-launch path,
/// `mhc_pre_finish_pdl` for the PDL pair; `_<format>` is appended) on the partials already in `out`, over
/// tokens `[t0, t0 + n)`: grid `[n, 2]` (y = 0: pre, u, RMSNorm + quant; y = 1: post and the Sinkhorn on 16
/// lanes, concurrently).
#[allow(clippy::too_many_arguments)]
fn launch_pre_finish_chunk(
    gpu: &Gpu,
    prefix: &str,
    x: &CudaSlice<bf16>,
    w: &MhcWeights,
    eps: f32,
    out: &MhcPreOutputs,
    (t0, n): (usize, usize),
    pdl: bool,
) -> Result<()> {
    let d = out.d;
    let splits = out.partial_splits;
    let name = format!("{prefix}_{}", out.normed.format.name());
    let f = gpu.function(FAMILY, &name)?;
    let mut a = RawArgs::default();
    a.slice_from(gpu, x, t0 * 4 * d)
        .slice_from(gpu, &out.partials, t0 * (reference::HC_MIX + 1) * splits)
        .i32(splits as i32)
        .i32(n as i32)
        .i32(d as i32)
        .slice(gpu, &w.scale)
        .slice(gpu, &w.base)
        .slice(gpu, &w.norm_weight)
        .f32(eps)
        .slice_from(gpu, &out.pre, t0 * 4)
        .slice_from(gpu, &out.post, t0 * 4)
        .slice_from(gpu, &out.comb, t0 * 16)
        .slice_from(gpu, &out.u, t0 * d);
    push_normed_rows(gpu, &mut a, &out.normed, t0);
    let grid = (n as u32, 2, 1);
    launch_raw(
        gpu,
        &f,
        grid,
        (row_block_threads(d), 1, 1),
        pdl,
        &mut a,
        &name,
    )
}

/// Push the quantized-row buffers (kernel parameter order: NVFP4 codes, block scales, global scales; FP8
/// codes, scales; BF16 y) and the rstd, from row `r0` on.
fn push_normed_rows(gpu: &Gpu, a: &mut RawArgs, normed: &NormOutputs, r0: usize) {
    let d = normed.d;
    match &normed.q {
        QuantBufs::Nvfp4 {
            data,
            scales,
            global_scale,
        } => {
            a.slice_from(gpu, data, r0 * d / 2)
                .slice_from(gpu, scales, r0 * d / 16)
                .slice_from(gpu, global_scale, r0);
        }
        QuantBufs::Fp8 { data, scales } => {
            a.slice_from(gpu, data, r0 * d)
                .slice_from(gpu, scales, r0 * d / 128);
        }
        QuantBufs::Bf16 { y } => {
            a.slice_from(gpu, y, r0 * d);
        }
    }
    a.slice_from(gpu, &normed.rstd, r0);
}

/// How the two kernels of the fused mHC boundary are launched ([`mhc_pre`] picks one by token count,
/// [`mhc_pre_auto_path`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MhcPrePath {
    /// `mhc_mix_partial24_v2` then `mhc_pre_finish2_*`, plain stream-ordered launches (9 .. 127 tokens).
    TwoLaunch,
    /// `mhc_mix_partial24_pdl` then `mhc_pre_finish_pdl_*`: the same arithmetic (bit-identical outputs),
    /// both launched with programmatic dependent launch (PDL): the finish grid is scheduled while the mix
    /// runs and waits on the device (`griddepcontrol.wait`) for the mix to complete; a following PDL mix
    /// stages its weight tile while the previous finish runs. Needs sm_90 and a driver that captures PDL
    /// launches into graphs (CUDA >= 12.3).
    PdlPair,
    /// `mhc_mix_tc_partial24` (kernels/mhc_mix_tc.cu: the 24 mixes as a BF16 tensor-core GEMM of X against
    /// the three BF16 planes of F, [`MhcWeights::mix_planes`]; [`tc_mix_splits`] K splits) then
    /// `mhc_pre_finish2_*`, plain launches. NOT bit-identical to the other paths: the dots are sums of the
    /// same exact products in another order (tensor-core block accumulation, see the kernel header), so
    /// pre/post/C/u may differ in the last bits. [`mhc_pre`]'s path from [`MHC_TENSOR_MIX_MIN_TOKENS`] tokens.
    TensorMix,
}

/// [`mhc_pre`] with an explicit launch path ([`MhcPrePath`]); outputs are bit-identical across paths, except
/// [`MhcPrePath::TensorMix`] (same exact products summed in another order; see its doc).
pub fn mhc_pre_with(
    gpu: &Gpu,
    x: &CudaSlice<bf16>,
    w: &MhcWeights,
    eps: f32,
    out: &mut MhcPreOutputs,
    path: MhcPrePath,
) -> Result<()> {
    check_mhc_pre(x, w, eps, out)?;
    // Per chunk (one chunk up to MHC_LAUNCH_MAX_TOKENS tokens): the mix, then the finish on its partials.
    // PDL pair: each kernel may start before its predecessor completes and waits on the device
    // (griddepcontrol.wait) before reading it; a chunk's mix writes only its own tokens' partials, which the
    // previous chunk's finish does not read.
    let (mix, finish, pdl) = match path {
        MhcPrePath::TwoLaunch => ("mhc_mix_partial24_v2", "mhc_pre_finish2", false),
        MhcPrePath::PdlPair => ("mhc_mix_partial24_pdl", "mhc_pre_finish_pdl", true),
        MhcPrePath::TensorMix => {
            // One S for the whole batch (so the partials are one [T, 25, S] array): S only depends on the
            // tile count below 33,792 tokens, and is 1 above, so every chunk of a split batch fills the GPU.
            let splits = tc_mix_splits(out.tokens, out.d);
            out.partial_splits = splits;
            for chunk in mhc_token_chunks(out.tokens) {
                launch_tc_mix_chunk(gpu, x, w, &out.partials, splits, chunk)?;
                launch_pre_finish_chunk(gpu, "mhc_pre_finish2", x, w, eps, out, chunk, false)?;
            }
            return Ok(());
        }
    };
    out.partial_splits = mix_splits(out.d);
    for chunk in mhc_token_chunks(out.tokens) {
        launch_mix_chunk(gpu, mix, x, w, &out.partials, chunk, pdl)?;
        launch_pre_finish_chunk(gpu, finish, x, w, eps, out, chunk, pdl)?;
    }
    Ok(())
}

/// `hc_post` of one sub-layer fused with `hc_pre` of the next: `x_out = post (x) y + comb^T x` (as
/// [`mhc_post`], bit for bit) is computed inside the split-K mix kernel, which feeds it to the next
/// boundary's dots; then the two-launch finish kernel of [`mhc_pre`] (reading `x_out`). Two launches instead of
/// three, and X' is not re-read for the mixes. `post`/`comb` are the previous boundary's.
#[allow(clippy::too_many_arguments)]
pub fn mhc_post_then_pre(
    gpu: &Gpu,
    y: &CudaSlice<bf16>,
    x: &CudaSlice<bf16>,
    post: &CudaSlice<f32>,
    comb: &CudaSlice<f32>,
    w: &MhcWeights,
    eps: f32,
    x_out: &mut CudaSlice<bf16>,
    out: &mut MhcPreOutputs,
) -> Result<()> {
    check_mhc(x, w, out)?;
    check_eps(eps)?;
    if w.nmix != reference::HC_MIX {
        bail!(
            "mhc_post_then_pre needs sub-layer weights (24 mixes), got {}",
            w.nmix
        );
    }
    let (tokens, d) = (out.tokens, out.d);
    check_post_lens(y, x_out, post, comb, tokens, d)?;
    let splits = mix_splits(d);
    out.partial_splits = splits;
    let name = "mhc_post_mix_partial24";
    let f = gpu.function(FAMILY, name)?;
    for (t0, n) in mhc_token_chunks(tokens) {
        let mut a = RawArgs::default();
        post_args(&mut a, gpu, [y, x, &*x_out], post, comb, t0, d)
            .slice(gpu, &w.mix_fn)
            .slice_from(gpu, &out.partials, t0 * (reference::HC_MIX + 1) * splits)
            .i32(n as i32)
            .i32(d as i32);
        let grid = (splits as u32, n.div_ceil(32) as u32, 1);
        launch_raw(gpu, &f, grid, (128, 1, 1), false, &mut a, name)?;
        launch_pre_finish_chunk(gpu, "mhc_pre_finish2", x_out, w, eps, out, (t0, n), false)?;
    }
    Ok(())
}

/// `hc_head`: pre = sigmoid mixes (no Sinkhorn), u = sum pre_i X_i (BF16), then RMSNorm(u; norm.weight)
/// as BF16 into `out.normed` (which must be BF16). `post` and `comb` are not written.
pub fn hc_head(
    gpu: &Gpu,
    x: &CudaSlice<bf16>,
    w: &MhcWeights,
    eps: f32,
    out: &mut MhcPreOutputs,
) -> Result<()> {
    check_mhc(x, w, out)?;
    check_eps(eps)?;
    if w.nmix != reference::HC_HEAD_MIX {
        bail!("hc_head needs head weights (4 mixes), got {}", w.nmix);
    }
    let (tokens, d) = (out.tokens, out.d);
    let QuantBufs::Bf16 { y } = &out.normed.q else {
        bail!("hc_head writes BF16: allocate the outputs with OutFormat::Bf16")
    };
    let splits = mix_splits(d);
    out.partial_splits = splits;
    let name = "mhc_head_finish_bf16";
    let f = gpu.function(FAMILY, name)?;
    for (t0, n) in mhc_token_chunks(tokens) {
        // The broadcast-load mix kernel, 4 mixes (the 24-mix boundary uses the cp.async kernel).
        launch_mix_chunk(gpu, "mhc_mix_partial4", x, w, &out.partials, (t0, n), false)?;
        let mut a = RawArgs::default();
        a.slice_from(gpu, x, t0 * 4 * d)
            .slice_from(
                gpu,
                &out.partials,
                t0 * (reference::HC_HEAD_MIX + 1) * splits,
            )
            .i32(splits as i32)
            .i32(n as i32)
            .i32(d as i32)
            .slice(gpu, &w.scale)
            .slice(gpu, &w.base)
            .slice(gpu, &w.norm_weight)
            .f32(eps)
            .slice_from(gpu, &out.pre, t0 * 4)
            .slice_from(gpu, &out.u, t0 * d)
            .slice_from(gpu, y, t0 * d)
            .slice_from(gpu, &out.normed.rstd, t0);
        launch_raw(
            gpu,
            &f,
            (n as u32, 1, 1),
            (row_block_threads(d), 1, 1),
            false,
            &mut a,
            name,
        )?;
    }
    Ok(())
}

/// The lengths of hc_post's inputs besides X: y [T, D], X out [T, 4, D], post [T, 4], comb [T, 16].
fn check_post_lens(
    y: &CudaSlice<bf16>,
    x_out: &CudaSlice<bf16>,
    post: &CudaSlice<f32>,
    comb: &CudaSlice<f32>,
    tokens: usize,
    d: usize,
) -> Result<()> {
    check_len("y", y.len(), tokens * d)?;
    check_len("X out", x_out.len(), tokens * 4 * d)?;
    check_len("post", post.len(), tokens * 4)?;
    check_len("comb", comb.len(), tokens * 16)
}

/// hc_post's first five kernel arguments from token t0 on (a launch over a token chunk): y, X, post, comb, X out.
/// `yx` = [y, X, X out].
fn post_args<'a>(
    a: &'a mut RawArgs,
    gpu: &Gpu,
    yx: [&CudaSlice<bf16>; 3],
    post: &CudaSlice<f32>,
    comb: &CudaSlice<f32>,
    t0: usize,
    d: usize,
) -> &'a mut RawArgs {
    a.slice_from(gpu, yx[0], t0 * d)
        .slice_from(gpu, yx[1], t0 * 4 * d)
        .slice_from(gpu, post, t0 * 4)
        .slice_from(gpu, comb, t0 * 16)
        .slice_from(gpu, yx[2], t0 * 4 * d)
}

/// `hc_post`: `x_out[t][k] = post[t][k] y[t] + sum_j comb[t][j][k] x[t][j]` (fp32, BF16 store).
/// `y` [T, D], `x`/`x_out` [T, 4, D], `post` [T, 4], `comb` [T, 16].
#[allow(clippy::too_many_arguments)]
pub fn mhc_post(
    gpu: &Gpu,
    y: &CudaSlice<bf16>,
    x: &CudaSlice<bf16>,
    post: &CudaSlice<f32>,
    comb: &CudaSlice<f32>,
    tokens: usize,
    d: usize,
    x_out: &mut CudaSlice<bf16>,
) -> Result<()> {
    check_rows(tokens, d)?;
    check_len("X", x.len(), tokens * 4 * d)?;
    check_post_lens(y, x_out, post, comb, tokens, d)?;
    let name = "mhc_post";
    let f = gpu.function(FAMILY, name)?;
    // Grid [D/8/64, n]: the token on grid.y (at most 65535 per launch: mhc_token_chunks).
    for (t0, n) in mhc_token_chunks(tokens) {
        let mut a = RawArgs::default();
        post_args(&mut a, gpu, [y, x, &*x_out], post, comb, t0, d).i32(d as i32);
        let grid = ((d / 8).div_ceil(64) as u32, n as u32, 1);
        launch_raw(gpu, &f, grid, (64, 1, 1), false, &mut a, name)?;
    }
    Ok(())
}

/// Scratch of the op-by-op mHC chain.
pub struct MhcUnfusedScratch {
    rho: CudaSlice<f32>,
    dots: CudaSlice<f32>,
}

impl MhcUnfusedScratch {
    pub fn alloc(gpu: &Gpu, tokens: usize) -> Result<MhcUnfusedScratch> {
        Ok(MhcUnfusedScratch {
            rho: gpu.zeros(tokens)?,
            dots: gpu.zeros(tokens * reference::HC_MIX)?,
        })
    }
}

/// The op-by-op baseline: rms kernel, GEMV kernel (one CTA per token, no split-K), Sinkhorn kernel, apply
/// kernel (u BF16), then the RMSNorm kernel (BF16 into `staging`) and the quantize kernel: 6 launches
/// (5 for a BF16 output, where `staging` is unused and the RMSNorm writes `out.normed` directly).
pub fn mhc_pre_unfused(
    gpu: &Gpu,
    x: &CudaSlice<bf16>,
    w: &MhcWeights,
    eps: f32,
    scratch: &mut MhcUnfusedScratch,
    staging: &mut NormOutputs,
    out: &mut MhcPreOutputs,
) -> Result<()> {
    check_mhc(x, w, out)?;
    check_eps(eps)?;
    let (tokens, d) = (out.tokens, out.d);
    if w.nmix != reference::HC_MIX
        || scratch.rho.len() < tokens
        || staging.rows != tokens
        || staging.d != d
    {
        bail!("mhc_pre_unfused: scratch/staging sized for a different shape, or head weights");
    }
    let (d_i, d4_i) = (d as i32, (4 * d) as i32);
    let t = tokens as u32;
    let f = gpu.function(FAMILY, "mhc_unfused_rms")?;
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(x).arg(&mut scratch.rho).arg(&d4_i).arg(&eps);
    drv(
        unsafe { b.launch(launch_cfg((t, 1, 1), (256, 1, 1), 0)) },
        "mhc_unfused_rms",
    )?;
    let f = gpu.function(FAMILY, "mhc_unfused_gemv")?;
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(x).arg(&w.mix_fn).arg(&mut scratch.dots).arg(&d4_i);
    drv(
        unsafe { b.launch(launch_cfg((t, 1, 1), (256, 1, 1), 0)) },
        "mhc_unfused_gemv",
    )?;
    let f = gpu.function(FAMILY, "mhc_unfused_sinkhorn")?;
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(&scratch.rho)
        .arg(&scratch.dots)
        .arg(&w.scale)
        .arg(&w.base);
    b.arg(&mut out.pre).arg(&mut out.post).arg(&mut out.comb);
    drv(
        unsafe { b.launch(launch_cfg((t, 1, 1), (32, 1, 1), 0)) },
        "mhc_unfused_sinkhorn",
    )?;
    // The apply kernel puts the token on grid.y (at most 65535 per launch): chunked (mhc_token_chunks). The
    // other unfused kernels put the token on grid.x and run in one launch.
    let name = "mhc_unfused_apply";
    let f = gpu.function(FAMILY, name)?;
    for (t0, n) in mhc_token_chunks(tokens) {
        let mut a = RawArgs::default();
        a.slice_from(gpu, x, t0 * 4 * d)
            .slice_from(gpu, &out.pre, t0 * 4)
            .slice_from(gpu, &out.u, t0 * d)
            .i32(d_i);
        let grid = ((d / 8).div_ceil(64) as u32, n as u32, 1);
        launch_raw(gpu, &f, grid, (64, 1, 1), false, &mut a, name)?;
    }
    if out.normed.format == OutFormat::Bf16 {
        return rmsnorm_quant(
            gpu,
            RowsIn::Bf16(&out.u),
            &w.norm_weight,
            eps,
            &mut out.normed,
        );
    }
    rmsnorm_quant(gpu, RowsIn::Bf16(&out.u), &w.norm_weight, eps, staging)?;
    let QuantBufs::Bf16 { y } = &staging.q else {
        bail!("mhc_pre_unfused: staging must be BF16")
    };
    quantize_bf16_rows(gpu, y, &mut out.normed)?;
    // The unfused chain's rstd is the staging RMSNorm's; copy it so callers read it in one place.
    drv(
        gpu.stream.memcpy_dtod(&staging.rstd, &mut out.normed.rstd),
        "copy rstd",
    )
}

// ---- benchmark hooks (wired into crate::bench by the integrator) ------------------------------------------

/// One timed point: samples in microseconds and the bytes a perfect kernel moves (inputs read once,
/// outputs written once).
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
/// [`rows_path`]), `unfused_<fmt>` (fmt in nvfp4, fp8, bf16; bf16 has only the one kernel) and `copy`
/// (device-to-device copy of the same number of bytes, the bandwidth reference). Removed candidates (see
/// kernels/norm_quant.cu): session 3 fused_v4_nvfp4, fused_v4_fp8, fused_v4p_nvfp4 (v4p became fused_nvfp4);
/// session 4 fused_nvfp4_v5 / fused_fp8_v5 (became fused_* from 4096 rows) and fused_fp8_v5r (lost);
/// session 7 fused_nvfp4_v5 (the v5 NVFP4 kernel forced: lost to v6, the default, in sessions 6 and 7).
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
                drv(gpu.stream.memcpy_dtod(&x, &mut dst), "memcpy_dtod")
            })?;
            Ok(point(4 * (rows * d) as u64, s, None))
        }
        "fused" => {
            let format = OutFormat::parse(fmt)?;
            let mut out = NormOutputs::alloc_poisoned(gpu, format, rows, d)?;
            let s = gpu.time_us(plan, || {
                rmsnorm_quant(gpu, RowsIn::Bf16(&x), &w, eps, &mut out)
            })?;
            let bytes = in_bytes + (rows * (format.row_bytes(d) + 4)) as u64;
            // raced against the unfused chain
            let baseline = (format != OutFormat::Bf16).then(|| format!("unfused_{fmt}"));
            Ok(point(bytes, s, baseline))
        }
        "unfused" => {
            let format = OutFormat::parse(fmt)?;
            let mut staging = NormOutputs::alloc_poisoned(gpu, OutFormat::Bf16, rows, d)?;
            let mut out = NormOutputs::alloc_poisoned(gpu, format, rows, d)?;
            let s = gpu.time_us(plan, || {
                rmsnorm_then_quant(gpu, RowsIn::Bf16(&x), &w, eps, &mut staging, &mut out)
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

/// Variants of the mHC boundary, `<kind>_<fmt>` with kind
/// * `fused`: [`mhc_pre`] as called, i.e. its automatic path choice (the PDL pair up to 8 tokens, two plain
///   launches up to 127, the tensor-core mix from 128, [`mhc_pre_auto_path`]);
/// * `fused_pdl` / `fused_twolaunch` / `fused_tc`: one path forced ([`MhcPrePath::PdlPair`] /
///   [`MhcPrePath::TwoLaunch`] / [`MhcPrePath::TensorMix`]), so each stays measurable on both sides of the
///   thresholds (`fused_pdl` in graph form only; `fused_twolaunch` = the FFMA mix the prefill sweeps race);
/// * `unfused`: the op-by-op chain;
///
/// each timed three ways:
/// * `<kind>_<fmt>`: plain stream launches, one boundary per event pair (host launch cost included);
/// * `graph_<kind>_<fmt>`: a graph holding ONE boundary, replayed 20 times back to back, time / 20. Each
///   replay is one `cuGraphLaunch`: when the host needs longer to launch a graph than the GPU needs to run
///   it, this measures the launch rate, not the boundary;
/// * `graph16_<kind>_<fmt>`: a graph holding 16 consecutive boundaries (same inputs, as the boundaries of a
///   captured decode step follow each other), replayed 4 times, time / (4 x 16): the per-boundary GPU time
///   inside a decode graph, with one graph launch per 16 boundaries. As in `graph_`, F stays in L2 after
///   the first boundary (in a real decode step every layer's F is different).
///
/// Plus `post`, `head`, and `graph_postpre_{fused,separate}_nvfp4`.
pub const MHC_VARIANTS: &[&str] = &[
    "fused_nvfp4",
    "unfused_nvfp4",
    "fused_fp8",
    "unfused_fp8",
    "fused_bf16",
    "unfused_bf16",
    "graph_fused_nvfp4",
    "graph_unfused_nvfp4",
    "graph_fused_fp8",
    "graph_unfused_fp8",
    "post",
    "head",
    "graph_postpre_fused_nvfp4",
    "graph_postpre_separate_nvfp4",
    "graph16_fused_nvfp4",
    "graph16_unfused_nvfp4",
    "graph16_fused_fp8",
    "graph16_unfused_fp8",
    "graph_fused_pdl_nvfp4",
    "graph_fused_pdl_fp8",
    "graph16_fused_pdl_nvfp4",
    "graph16_fused_pdl_fp8",
    "graph_fused_twolaunch_nvfp4",
    "graph_fused_twolaunch_fp8",
    "graph16_fused_twolaunch_nvfp4",
    "graph16_fused_twolaunch_fp8",
    "fused_tc_nvfp4",
    "fused_tc_fp8",
    "fused_tc_bf16",
    "fused_twolaunch_nvfp4",
    "fused_twolaunch_fp8",
    "fused_twolaunch_bf16",
];

/// Boundaries captured in one graph by the `graph16_*` mHC variants, and replays of that graph per sample.
const MHC_GRAPH_BOUNDARIES: usize = 16;
const MHC_GRAPH16_REPLAYS: usize = 4;
/// Replays per sample of the one-boundary graphs (`graph_*`).
const MHC_GRAPH1_REPLAYS: usize = 20;

/// Time one mHC variant for `tokens` tokens of hidden size `d`.
pub fn bench_mhc(
    gpu: &Gpu,
    variant: &str,
    tokens: usize,
    d: usize,
    seed: u64,
    plan: TimingPlan,
) -> Result<BenchPoint> {
    check_rows(tokens, d)?;
    let xs = timing_rows(tokens * 4, d, seed);
    let x = upload_checked_bf16(gpu, "X", &xs)?;
    let eps = reference::RMS_EPS;
    let x_bytes = (tokens * 4 * d * 2) as u64;
    let point = |bytes: u64, samples: Vec<f64>, baseline: Option<String>| BenchPoint {
        kernel: "mhc",
        variant: variant.to_string(),
        rows: tokens,
        d,
        bytes,
        samples_us: samples,
        baseline,
    };
    if variant == "post" {
        let y = upload_checked_bf16(gpu, "y", &timing_rows(tokens, d, seed ^ 1))?;
        let post = gpu.upload(&vec![1.0f32; tokens * 4])?;
        let comb = gpu.upload(&vec![0.25f32; tokens * 16])?;
        let mut xo = gpu.zeros::<bf16>(tokens * 4 * d)?;
        let s = gpu.time_us(plan, || {
            mhc_post(gpu, &y, &x, &post, &comb, tokens, d, &mut xo)
        })?;
        return Ok(point(
            2 * x_bytes + (tokens * d * 2 + tokens * 80) as u64,
            s,
            None,
        ));
    }
    let params = random_mhc_params(d, reference::HC_MIX, seed ^ 2);
    let nw = random_weight(d, seed ^ 3);
    if let Some(kind) = variant.strip_prefix("graph_postpre_") {
        // hc_post of one sub-layer + hc_pre of the next (NVFP4 out): fused (2 launches) or separate (3).
        let fused = kind.starts_with("fused");
        let y = upload_checked_bf16(gpu, "y", &timing_rows(tokens, d, seed ^ 1))?;
        let post = gpu.upload(&vec![1.0f32; tokens * 4])?;
        let comb = gpu.upload(&vec![0.25f32; tokens * 16])?;
        let mut xo = gpu.zeros::<bf16>(tokens * 4 * d)?;
        let w = MhcWeights::upload(gpu, &params, &nw, d)?;
        let mut out = MhcPreOutputs::alloc_poisoned(gpu, OutFormat::Nvfp4, tokens, d)?;
        let run = |out: &mut MhcPreOutputs, xo: &mut CudaSlice<bf16>| {
            if fused {
                mhc_post_then_pre(gpu, &y, &x, &post, &comb, &w, eps, xo, out)
            } else {
                mhc_post(gpu, &y, &x, &post, &comb, tokens, d, xo)?;
                mhc_pre(gpu, xo, &w, eps, out)
            }
        };
        run(&mut out, &mut xo)?;
        gpu.synchronize()?;
        let g = gpu.capture(|| run(&mut out, &mut xo))?;
        let s = gpu.time_graph_us(&g, plan, 20)?;
        let bytes = 2 * x_bytes
            + (tokens * d * 2 + tokens * 80) as u64
            + (reference::HC_MIX * 4 * d * 4 + d * 2) as u64
            + (tokens * (24 * 4 + 2 * d + 4 + OutFormat::Nvfp4.row_bytes(d))) as u64;
        return Ok(point(
            bytes,
            s,
            fused.then(|| "graph_postpre_separate_nvfp4".to_string()),
        ));
    }
    if variant == "head" {
        let hf = random_mhc_params(d, reference::HC_HEAD_MIX, seed ^ 4);
        let w = MhcWeights::upload_head(gpu, &hf.mix_fn, 1.0, &[0.1, -0.1, 0.2, 0.0], &nw, d)?;
        let mut out = MhcPreOutputs::alloc_poisoned(gpu, OutFormat::Bf16, tokens, d)?;
        let s = gpu.time_us(plan, || hc_head(gpu, &x, &w, eps, &mut out))?;
        let bytes = x_bytes + (4 * 4 * d * 4 + d * 2 + tokens * (4 * d + 16 + 4)) as u64;
        return Ok(point(bytes, s, None));
    }
    // Boundaries per captured graph: 0 = no graph (plain launches), 1 = `graph_`, 16 = `graph16_`.
    let (per_graph, rest) = if let Some(r) = variant.strip_prefix("graph16_") {
        (MHC_GRAPH_BOUNDARIES, r)
    } else if let Some(r) = variant.strip_prefix("graph_") {
        (1, r)
    } else {
        (0, variant)
    };
    let graph = per_graph > 0;
    // kind_fmt with kind in fused (mhc_pre's automatic path), fused_pdl / fused_twolaunch / fused_tc (one path
    // forced; fused_tc = the tensor-core mix, MhcPrePath::TensorMix),
    // unfused (the op-by-op chain). path: None = unfused, Some(None) = automatic, Some(Some(p)) = forced.
    let (kind, fmt) = rest
        .rsplit_once('_')
        .ok_or_else(|| anyhow::anyhow!("unknown mhc variant `{variant}`"))?;
    let format = OutFormat::parse(fmt)?;
    let w = MhcWeights::upload(gpu, &params, &nw, d)?;
    let mut out = MhcPreOutputs::alloc_poisoned(gpu, format, tokens, d)?;
    let mut scratch = MhcUnfusedScratch::alloc(gpu, tokens)?;
    let mut staging = NormOutputs::alloc_poisoned(gpu, OutFormat::Bf16, tokens, d)?;
    let path = match kind {
        "fused" => Some(None),
        "fused_pdl" => Some(Some(MhcPrePath::PdlPair)),
        "fused_twolaunch" => Some(Some(MhcPrePath::TwoLaunch)),
        "fused_tc" => Some(Some(MhcPrePath::TensorMix)),
        "unfused" => None,
        _ => bail!(
            "unknown mhc variant `{variant}` (known: {})",
            MHC_VARIANTS.join(", ")
        ),
    };
    let fused = path.is_some();
    let mut run = |out: &mut MhcPreOutputs| match path {
        Some(None) => mhc_pre(gpu, &x, &w, eps, out),
        Some(Some(p)) => mhc_pre_with(gpu, &x, &w, eps, out, p),
        None => mhc_pre_unfused(gpu, &x, &w, eps, &mut scratch, &mut staging, out),
    };
    let s = if graph {
        run(&mut out)?; // loads the module and checks shapes outside the capture
        gpu.synchronize()?;
        let g = gpu.capture(|| {
            for _ in 0..per_graph {
                run(&mut out)?;
            }
            Ok(())
        })?;
        let replays = if per_graph == 1 {
            MHC_GRAPH1_REPLAYS
        } else {
            MHC_GRAPH16_REPLAYS
        };
        // time_graph_us divides by the replays; per boundary divides by the boundaries of one graph too.
        gpu.time_graph_us(&g, plan, replays)?
            .into_iter()
            .map(|us| us / per_graph as f64)
            .collect()
    } else {
        gpu.time_us(plan, || run(&mut out))?
    };
    // Inputs once (X, F, norm weight, scale/base), outputs once (pre, post, C, u, rstd, quantized y).
    let bytes = x_bytes
        + (reference::HC_MIX * 4 * d * 4 + d * 2 + 27 * 4) as u64
        + (tokens * (24 * 4 + 2 * d + 4 + format.row_bytes(d))) as u64;
    // Raced against the op-by-op chain timed the same way (same graph shape).
    let prefix = match per_graph {
        0 => "",
        1 => "graph_",
        _ => "graph16_",
    };
    let base = fused.then(|| format!("{prefix}unfused_{fmt}"));
    Ok(point(bytes, s, base))
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

/// [`random_rows`] for timing: the first min(rows, 16384) rows drawn, the rest repeating them in order. Why: drawing
/// every value costs ~0.2 us per token-row on the host (~50 s per variant at 65536 tokens x 4 streams x D 7168),
/// while the kernels' time does not depend on whether rows repeat (every row is read and written at its own
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

/// mHC parameters of realistic size: mix weights ~ U(-1,1)/sqrt(4D) (so mixes are O(1)), scales
/// around 1, bases ~ U(-1, 1).
pub fn random_mhc_params(d: usize, nmix: usize, seed: u64) -> reference::MhcParams {
    use rand::Rng;
    let mut r = rng(seed);
    let a = 1.0 / ((4 * d) as f32).sqrt();
    let mix_fn = (0..nmix * 4 * d).map(|_| r.random_range(-a..a)).collect();
    let mut scale = [0f32; 3];
    for s in &mut scale {
        *s = r.random_range(0.5..1.5);
    }
    let mut base = [0f32; 24];
    for b in &mut base {
        *b = r.random_range(-1.0..1.0);
    }
    reference::MhcParams {
        mix_fn,
        scale,
        base,
    }
}
