//! Fused RMSNorm + quantization (kernels/norm_quant.cu, shared row code in kernels/common/norm_row.cuh).
//!
//! [`rmsnorm_quant`]: rows `[rows, D]` (BF16 or f32, `D % 128 == 0`, `D <= 32768`) -> RMSNorm with a BF16 weight
//! -> NVFP4 (per-row global scale), FP8 e4m3 1x128 (ue8m0 scales) or BF16, one launch. BF16 in -> NVFP4 / FP8
//! picks its kernel by shape ([`rows_path`]); [`rmsnorm_quant_with`] forces one [`RowsPath`]; every path gives
//! the same bits. The unfused baseline the fused kernels are measured against (RMSNorm kernel -> BF16 in HBM ->
//! quantize kernel) is [`bench::rmsnorm_then_quant`], its quantizer [`quantize_bf16_rows`].
//!
//! Layouts: NVFP4 codes `[rows, D/2]` (lower index in the low nibble), e4m3 scales `[rows, D/16]`, global scale
//! `[rows]` f32; FP8 codes `[rows, D]`, ue8m0 scale codes `[rows, D/128]`; BF16 `[rows, D]`. `rstd` (the per-row
//! `1/sqrt(mean(x^2)+eps)` of the RMSNorm) is always written: the tests use it to separate the reduction-order
//! effect from everything else, and it costs 4 bytes per row.
//!
//! Every launcher takes the stream it enqueues on and allocates nothing; the grids depend only on the shape, so
//! a captured call replays with new data in the same buffers. Non-finite inputs are not rejected on the device
//! path (that would cost a pass over the data); the host-side helpers ([`upload_checked_f32`],
//! [`upload_checked_bf16`]) reject them.

pub mod bench;
pub mod exec;
pub mod reference;

pub use exec::exec_kernels;

use anyhow::{bail, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

use crate::gpu::arena::{Arena, WorkspaceLayout};
use crate::gpu::launch::{launch, DevBuf, DeviceBuf, Kernel, KernelArgs, Launch, Stream};
use crate::gpu::Gpu;

/// Kernel family name (kernels/norm_quant.cu).
pub const FAMILY: &str = "norm_quant";
/// Chunks of 8 values per thread in the row kernels (`CH` in common/norm_row.cuh).
const CHUNKS_PER_THREAD: usize = 4;
/// Largest supported hidden size: 1024 threads x 4 chunks x 8 values.
pub const MAX_D: usize = 1024 * CHUNKS_PER_THREAD * 8;

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

/// Input rows on the device (any [`DeviceBuf`]: an owned slice or a region of a workspace arena).
#[derive(Clone, Copy)]
pub enum RowsIn<'a> {
    Bf16(&'a dyn DeviceBuf<bf16>),
    F32(&'a dyn DeviceBuf<f32>),
}

impl RowsIn<'_> {
    fn len(&self) -> usize {
        match self {
            RowsIn::Bf16(s) => s.elems(),
            RowsIn::F32(s) => s.elems(),
        }
    }
    fn addr(&self) -> u64 {
        match self {
            RowsIn::Bf16(s) => s.device_addr(),
            RowsIn::F32(s) => s.device_addr(),
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

/// Device buffers of a normalized + quantized output (owned).
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

/// The output of one RMSNorm(+quant) over `rows` rows of `d` (owned buffers; [`NormOutputs::view`] is what the
/// launchers write through).
pub struct NormOutputs {
    pub rows: usize,
    pub d: usize,
    pub format: OutFormat,
    pub q: QuantBufs,
    /// Per-row `1/sqrt(mean(x^2) + eps)`.
    pub rstd: CudaSlice<f32>,
}

/// A non-owning view of the quantized buffers of `rows` rows: what the kernels write.
#[derive(Debug, Clone, Copy)]
pub enum QuantView {
    Nvfp4 {
        data: DevBuf<u8>,
        scales: DevBuf<u8>,
        global_scale: DevBuf<f32>,
    },
    Fp8 {
        data: DevBuf<u8>,
        scales: DevBuf<u8>,
    },
    Bf16 {
        y: DevBuf<bf16>,
    },
}

/// A non-owning view of a row output: [`NormOutputs::view`], or carved from an arena ([`RowsOut::carve`], e.g.
/// the BF16 staging of the unfused chain).
#[derive(Debug, Clone, Copy)]
pub struct RowsOut {
    pub rows: usize,
    pub d: usize,
    pub format: OutFormat,
    pub q: QuantView,
    pub rstd: DevBuf<f32>,
}

impl RowsOut {
    /// The carves of [`RowsOut::carve`] for `rows` rows of `d` in `format`.
    pub fn layout(format: OutFormat, rows: usize, d: usize) -> WorkspaceLayout {
        let mut l = WorkspaceLayout::new();
        match format {
            OutFormat::Nvfp4 => l
                .add::<u8>(rows * d / 2)
                .add::<u8>(rows * d / 16)
                .add::<f32>(rows),
            OutFormat::Fp8 => l.add::<u8>(rows * d).add::<u8>(rows * d / 128),
            OutFormat::Bf16 => l.add::<bf16>(rows * d),
        };
        l.add::<f32>(rows);
        l
    }

    /// A row output for `rows` rows of `d` in `format`, carved from `arena`.
    pub fn carve(arena: &mut Arena, format: OutFormat, rows: usize, d: usize) -> Result<RowsOut> {
        check_rows(rows, d)?;
        let q = match format {
            OutFormat::Nvfp4 => QuantView::Nvfp4 {
                data: arena.carve(rows * d / 2, "nvfp4 codes")?,
                scales: arena.carve(rows * d / 16, "nvfp4 scales")?,
                global_scale: arena.carve(rows, "nvfp4 global scales")?,
            },
            OutFormat::Fp8 => QuantView::Fp8 {
                data: arena.carve(rows * d, "fp8 codes")?,
                scales: arena.carve(rows * d / 128, "fp8 scales")?,
            },
            OutFormat::Bf16 => QuantView::Bf16 {
                y: arena.carve(rows * d, "bf16 rows")?,
            },
        };
        Ok(RowsOut {
            rows,
            d,
            format,
            q,
            rstd: arena.carve(rows, "rstd")?,
        })
    }

    /// Push the quantized-row buffers from row `r0` on, in the kernels' parameter order (NVFP4: codes, block
    /// scales, global scales; FP8: codes, scales; BF16: y), then the rstd when `with_rstd`.
    pub(crate) fn push(&self, a: &mut KernelArgs, r0: usize, with_rstd: bool) {
        let d = self.d;
        match &self.q {
            QuantView::Nvfp4 {
                data,
                scales,
                global_scale,
            } => {
                a.buf_at(data, r0 * d / 2)
                    .buf_at(scales, r0 * d / 16)
                    .buf_at(global_scale, r0);
            }
            QuantView::Fp8 { data, scales } => {
                a.buf_at(data, r0 * d).buf_at(scales, r0 * d / 128);
            }
            QuantView::Bf16 { y } => {
                a.buf_at(y, r0 * d);
            }
        }
        if with_rstd {
            a.buf_at(&self.rstd, r0);
        }
    }
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

    /// The view the launchers write through (valid while `self` lives).
    pub fn view(&self) -> RowsOut {
        let q = match &self.q {
            QuantBufs::Nvfp4 {
                data,
                scales,
                global_scale,
            } => QuantView::Nvfp4 {
                data: DevBuf::of(data),
                scales: DevBuf::of(scales),
                global_scale: DevBuf::of(global_scale),
            },
            QuantBufs::Fp8 { data, scales } => QuantView::Fp8 {
                data: DevBuf::of(data),
                scales: DevBuf::of(scales),
            },
            QuantBufs::Bf16 { y } => QuantView::Bf16 { y: DevBuf::of(y) },
        };
        RowsOut {
            rows: self.rows,
            d: self.d,
            format: self.format,
            q,
            rstd: DevBuf::of(&self.rstd),
        }
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

/// Shape rules of the row kernels: `rows >= 1`, `D % 128 == 0`, `0 < D <= MAX_D` (32768).
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

/// `eps` must be finite and positive.
pub fn check_eps(eps: f32) -> Result<()> {
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

/// A buffer length check with the family's message.
pub fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
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

/// Fused RMSNorm + quantization of `out.rows` rows of `out.d` with weight `w` (BF16 `[d]`) into `out`, on
/// `stream`.
///
/// BF16 input -> NVFP4 / FP8 runs the kernel [`rows_path`] picks for the shape; F32 input and BF16 output
/// always run [`RowsPath::PerRow`]. Every path gives the same bits.
pub fn rmsnorm_quant(
    gpu: &Gpu,
    stream: &Stream,
    x: RowsIn<'_>,
    w: &impl DeviceBuf<bf16>,
    eps: f32,
    out: &mut NormOutputs,
) -> Result<()> {
    rmsnorm_quant_into(gpu, stream, x, w, eps, &out.view())
}

/// [`rmsnorm_quant`] into a non-owning output view (an arena carve, or [`NormOutputs::view`]).
pub fn rmsnorm_quant_into(
    gpu: &Gpu,
    stream: &Stream,
    x: RowsIn<'_>,
    w: &impl DeviceBuf<bf16>,
    eps: f32,
    out: &RowsOut,
) -> Result<()> {
    let path = match x {
        RowsIn::Bf16(_) => rows_path(out.rows, out.d, out.format),
        RowsIn::F32(_) => RowsPath::PerRow,
    };
    launch_rows(gpu, stream, x, w, eps, out, path)
}

/// Which kernels run BF16 rows -> NVFP4 / FP8 ([`rmsnorm_quant`] picks one with [`rows_path`],
/// [`rmsnorm_quant_with`] forces one). Every path gives the same bits (tests/norm_quant.rs checks them against
/// each other and against the CPU reference).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowsPath {
    /// The register-resident row kernels. BF16 -> NVFP4 up to [`ROW_LOOP_NVFP4_MAX_D`]:
    /// `rmsnorm_nvfp4_bf16in_row_loop`, one resident wave of CTAs looping over rows with the next row's loads in
    /// flight and a packed BF16-pair e2m1 encoder (grid [`resident_grid`]). Every other input/format pair, and
    /// NVFP4 above that D: one CTA per row, `rmsnorm_<fmt>_<in>`. Any shape.
    PerRow,
    /// BF16 -> FP8 only: `rmsnorm_fp8_bf16in_resident`, one resident wave of CTAs looping over rows, the weight
    /// staged once per CTA in shared memory (as f32), a division-free ue8m0 scale. `d % 1024 == 0`.
    ResidentFp8,
    /// BF16 -> NVFP4 only: `rmsnorm_nvfp4_bf16in_resident_nw<d / 1024>`, the same resident wave with the weight
    /// staged, D fixed at compile time (straight-line reads of the reduction partials), `ss / D` as a multiply
    /// for `D = 2^k`, and a binary-search e2m1 encoder. `d % 1024 == 0`, `d <= RESIDENT_NVFP4_MAX_D`.
    ResidentNvfp4,
}

/// Largest D the row-loop BF16 -> NVFP4 kernels launch at: they run roundup32(D / 32) threads held to 80
/// registers (`__maxnreg__`), i.e. 2,560 registers per warp, and an SM's 65,536 registers hold 25 such warps
/// = 800 threads = D 25,600 (D 32,768 fails with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES). Above it
/// [`RowsPath::PerRow`] (and the unfused chain's quantizer) run the one-CTA-per-row kernels
/// `rmsnorm_nvfp4_bf16in` / `quant_nvfp4_bf16in`. No DSV4 shape is among them (D 4096 and 7168).
pub const ROW_LOOP_NVFP4_MAX_D: usize = 25_600;

/// Fewest rows for which [`rows_path`] picks a resident-wave kernel with the weight staged
/// ([`RowsPath::ResidentFp8`], [`RowsPath::ResidentNvfp4`]).
pub const RESIDENT_MIN_ROWS: usize = 4096;

/// The resident kernels give every thread exactly 4 chunks of 8 values (blockDim = d / 32, whole warps).
pub const RESIDENT_D_MULTIPLE: usize = 1024;

/// Largest D of the resident NVFP4 kernels: one entry point per warp count d / 1024 = 1..=8 (DSV4: 4096, 7168).
pub const RESIDENT_NVFP4_MAX_D: usize = 8 * RESIDENT_D_MULTIPLE;

/// The kernels [`rmsnorm_quant`] runs for BF16 rows `[rows, d]` -> `format`: from [`RESIDENT_MIN_ROWS`] rows
/// with `d % 1024 == 0`, FP8 [`RowsPath::ResidentFp8`] and NVFP4 (`d <= 8192`) [`RowsPath::ResidentNvfp4`];
/// [`RowsPath::PerRow`] otherwise (BF16 output, fewer rows, other D).
///
/// Decided on the H200 (BF16 in, D 4096 and 7168, rows 1 .. 65536; results/h200/archive/session4-ab/rmsnorm_quant.csv
/// for the resident FP8 kernel and the resident-wave rule against the per-row paths,
/// results/h200/archive/session6-ab/rmsnorm_quant.csv for the NVFP4 kernel with D compiled in): the resident kernels win
/// every measured point from 4096 rows on for both formats and both D, and lose at 1-64 rows (their per-CTA
/// weight staging has few rows to amortize over); 1024 rows is mixed and rows between 1024 and 4096 were not
/// measured, so the switch sits at 4096. NVFP4 above 8192 (no DSV4 shape) takes the row loop.
pub fn rows_path(rows: usize, d: usize, format: OutFormat) -> RowsPath {
    let resident = rows >= RESIDENT_MIN_ROWS && d.is_multiple_of(RESIDENT_D_MULTIPLE);
    match format {
        OutFormat::Nvfp4 if resident && d <= RESIDENT_NVFP4_MAX_D => RowsPath::ResidentNvfp4,
        OutFormat::Fp8 if resident => RowsPath::ResidentFp8,
        _ => RowsPath::PerRow,
    }
}

/// [`rmsnorm_quant`] with an explicit kernel choice ([`RowsPath`]); every path gives the same bits. The resident
/// paths refuse (before any launch) what they do not run: F32 input, another output format than theirs, `d` not a
/// multiple of 1024 (NVFP4: or above [`RESIDENT_NVFP4_MAX_D`]).
pub fn rmsnorm_quant_with(
    gpu: &Gpu,
    stream: &Stream,
    x: RowsIn<'_>,
    w: &impl DeviceBuf<bf16>,
    eps: f32,
    out: &mut NormOutputs,
    path: RowsPath,
) -> Result<()> {
    launch_rows(gpu, stream, x, w, eps, &out.view(), path)
}

fn launch_rows(
    gpu: &Gpu,
    stream: &Stream,
    x: RowsIn<'_>,
    w: &impl DeviceBuf<bf16>,
    eps: f32,
    out: &RowsOut,
    path: RowsPath,
) -> Result<()> {
    check_rows(out.rows, out.d)?;
    check_eps(eps)?;
    check_len("x", x.len(), out.rows * out.d)?;
    check_len("weight", w.elems(), out.d)?;
    let (rows, d) = (out.rows, out.d);
    let (rows_i, d_i) = (rows as i32, d as i32);
    let mut a = KernelArgs::new();
    a.u64(x.addr()).buf(w);
    match path {
        RowsPath::PerRow
            if out.format == OutFormat::Nvfp4
                && matches!(x, RowsIn::Bf16(_))
                && d <= ROW_LOOP_NVFP4_MAX_D =>
        {
            // (x, w, q, scales, gsa, rstd, rows, D, eps)
            let k = gpu.kernel(FAMILY, "rmsnorm_nvfp4_bf16in_row_loop")?;
            let threads = row_block_threads(d);
            let grid = resident_grid(gpu, &k, threads, 0, rows)?;
            out.push(&mut a, 0, true);
            a.i32(rows_i).i32(d_i).f32(eps);
            unsafe {
                launch(
                    stream,
                    &k,
                    Launch::new((grid, 1, 1), (threads, 1, 1)),
                    &mut a,
                )
            }
        }
        RowsPath::PerRow => {
            // (x, w, [q...], rstd, D, eps), one CTA per row
            let name = format!("rmsnorm_{}_{}", out.format.name(), x.suffix());
            let k = gpu.kernel(FAMILY, &name)?;
            out.push(&mut a, 0, true);
            a.i32(d_i).f32(eps);
            let l = Launch::new((rows as u32, 1, 1), (row_block_threads(d), 1, 1));
            unsafe { launch(stream, &k, l, &mut a) }
        }
        RowsPath::ResidentFp8 | RowsPath::ResidentNvfp4 => {
            let nvfp4 = path == RowsPath::ResidentNvfp4;
            check_resident(rows, d, out.format, nvfp4)?;
            if !matches!(x, RowsIn::Bf16(_)) {
                bail!("norm_quant {path:?}: the input must be BF16");
            }
            // FP8: (x, w, q, scales, rstd, rows, D, eps); NVFP4 (D compiled in): (x, w, q, scales, gsa, rstd,
            // rows, eps). The weight is staged as f32 in dynamic shared memory.
            let name = if nvfp4 {
                resident_nvfp4_entry("rmsnorm_nvfp4_bf16in", d)
            } else {
                "rmsnorm_fp8_bf16in_resident".to_string()
            };
            let smem = d * 4;
            let k = gpu.kernel_with_smem(FAMILY, &name, smem)?;
            let threads = resident_block_threads(d);
            let grid = resident_grid(gpu, &k, threads, smem, rows)?;
            out.push(&mut a, 0, true);
            a.i32(rows_i);
            if !nvfp4 {
                a.i32(d_i);
            }
            a.f32(eps);
            let l = Launch::new((grid, 1, 1), (threads, 1, 1)).smem(smem);
            unsafe { launch(stream, &k, l, &mut a) }
        }
    }
}

/// Grid of a row-looping kernel: one full resident wave of `k` at `threads` per CTA and `smem` bytes of dynamic
/// shared memory, or `rows` CTAs if fewer ([`resident_wave_ctas`]). Depends only on the shape and the device.
pub(crate) fn resident_grid(
    gpu: &Gpu,
    k: &Kernel,
    threads: u32,
    smem: usize,
    rows: usize,
) -> Result<u32> {
    let per_sm = k
        .function()
        .occupancy_max_active_blocks_per_multiprocessor(threads, smem, None)
        .map_err(|e| anyhow::anyhow!("{}: occupancy query: {e:?}", k.name()))?;
    // Zero when one CTA needs more registers or shared memory than an SM has (e.g. the row-loop NVFP4 kernel,
    // 80 registers, above ROW_LOOP_NVFP4_MAX_D): refuse before the launch instead of failing in it.
    anyhow::ensure!(
        per_sm > 0,
        "{}: a CTA of {threads} threads and {smem} B of shared memory does not fit on one SM (the row-loop \
         NVFP4 kernels support D up to {ROW_LOOP_NVFP4_MAX_D})",
        k.name()
    );
    Ok(resident_wave_ctas(rows, per_sm as usize * gpu.info.sm_count.max(1) as usize) as u32)
}

/// CTAs of a row-looping launch: one full resident wave (`max_resident` = occupancy x SMs), or one CTA per row
/// when there are fewer rows. A full wave puts the same number of CTAs on every SM and CTA b runs rows b, b +
/// grid, ...: per SM the row counts differ by at most one per CTA. (Fewer, evenly loaded CTAs would leave some
/// SMs with one CTA more than others: up to 1/occupancy of an SM's work as tail.)
pub fn resident_wave_ctas(rows: usize, max_resident: usize) -> usize {
    rows.min(max_resident.max(1))
}

/// Shape / format rules of the resident kernels (checked before any launch): `d % 1024 == 0`; FP8 output for
/// the FP8 kernel; NVFP4 output and `d <= RESIDENT_NVFP4_MAX_D` for the NVFP4 kernels.
pub fn check_resident(rows: usize, d: usize, format: OutFormat, nvfp4: bool) -> Result<()> {
    check_rows(rows, d)?;
    let kernel = if nvfp4 {
        "resident NVFP4"
    } else {
        "resident FP8"
    };
    if !d.is_multiple_of(RESIDENT_D_MULTIPLE) {
        bail!(
            "norm_quant {kernel}: hidden size {d} must be a multiple of {RESIDENT_D_MULTIPLE} (one warp per 1024 \
             values)"
        );
    }
    let want = if nvfp4 {
        OutFormat::Nvfp4
    } else {
        OutFormat::Fp8
    };
    if format != want {
        bail!("norm_quant {kernel}: output format must be {}", want.name());
    }
    if nvfp4 && d > RESIDENT_NVFP4_MAX_D {
        bail!(
            "norm_quant {kernel}: hidden size {d} is above {RESIDENT_NVFP4_MAX_D} (entry points exist for d / 1024 \
             = 1..=8)"
        );
    }
    Ok(())
}

/// Threads per CTA of the resident kernels (= [`row_block_threads`] for their sizes: the same channel ownership).
pub fn resident_block_threads(d: usize) -> u32 {
    (d / 32) as u32
}

/// Entry point of the resident NVFP4 kernel for `d` (`prefix` = `rmsnorm_nvfp4_bf16in` or `quant_nvfp4_bf16in`).
pub(crate) fn resident_nvfp4_entry(prefix: &str, d: usize) -> String {
    format!("{prefix}_resident_nw{}", d / RESIDENT_D_MULTIPLE)
}

/// Quantize BF16 rows `y` `[rows, d]` to NVFP4 or FP8 (no norm) into `out` (its rstd untouched): the engine's
/// quantizer of rows normalized elsewhere (mhc_pre's BF16 output, the attention's `z`), and the second kernel of
/// the unfused chain [`bench::rmsnorm_then_quant`]. NVFP4 runs `quant_nvfp4_bf16in_row_loop` (the encoder of the
/// fused row-loop kernel) up to [`ROW_LOOP_NVFP4_MAX_D`], `quant_nvfp4_bf16in` (one CTA per row) above; FP8 runs
/// `quant_fp8_bf16in` (one CTA per row). The CPU quantizer's bits in every case.
pub fn quantize_bf16_rows(
    gpu: &Gpu,
    stream: &Stream,
    y: &impl DeviceBuf<bf16>,
    out: &RowsOut,
) -> Result<()> {
    let (rows, d) = (out.rows, out.d);
    check_rows(rows, d)?;
    check_len("y", y.elems(), rows * d)?;
    let threads = row_block_threads(d);
    let mut a = KernelArgs::new();
    a.buf(y);
    match out.format {
        OutFormat::Nvfp4 if d <= ROW_LOOP_NVFP4_MAX_D => {
            // (y, q, scales, gsa, rows, D)
            let k = gpu.kernel(FAMILY, "quant_nvfp4_bf16in_row_loop")?;
            let grid = resident_grid(gpu, &k, threads, 0, rows)?;
            out.push(&mut a, 0, false);
            a.i32(rows as i32).i32(d as i32);
            unsafe {
                launch(
                    stream,
                    &k,
                    Launch::new((grid, 1, 1), (threads, 1, 1)),
                    &mut a,
                )
            }
        }
        OutFormat::Nvfp4 | OutFormat::Fp8 => {
            // (y, [q...], D), one CTA per row
            let name = format!("quant_{}_bf16in", out.format.name());
            let k = gpu.kernel(FAMILY, &name)?;
            out.push(&mut a, 0, false);
            a.i32(d as i32);
            let l = Launch::new((rows as u32, 1, 1), (threads, 1, 1));
            unsafe { launch(stream, &k, l, &mut a) }
        }
        OutFormat::Bf16 => bail!("quantize_bf16_rows: the output format must be nvfp4 or fp8"),
    }
}
