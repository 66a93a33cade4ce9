//! NVFP4 rows on the GPU (kernels/nvfp4.cu): quantize with a per-row fp32 global scale and dequantize to
//! BF16, plus the 16-byte copy kernel the limits probe measures beside `cuMemcpyDtoD`.
//!
//! Contract: the GPU results equal the CPU codec bit for bit. The reference is the codec itself,
//! [`formats::nvfp4`](crate::formats::nvfp4) (its module doc states the layout and the exact operation order the
//! kernels mirror). Launchers check shapes and buffer sizes before any launch and run on the caller's stream;
//! none allocates (the host entries [`quantize_rows`] / [`dequantize_rows`] do, for `exec` and the tests).
//!
//! Rooms: `bench.rs` (measurement hooks), `exec.rs` (`megamoe exec` entries).

use anyhow::{bail, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

use crate::formats::nvfp4::Nvfp4Rows;
use crate::gpu::launch::{launch, KernelArgs, Launch, Stream};
use crate::gpu::Gpu;

pub mod bench;
pub mod exec;

const FAMILY: &str = "nvfp4";
/// Threads per CTA of every kernel of the family (`kThreads` in kernels/nvfp4.cu, its `__launch_bounds__`).
const THREADS: u32 = 256;

/// NVFP4 rows resident on the GPU (same layout as [`Nvfp4Rows`]).
pub struct Nvfp4Device {
    pub rows: usize,
    pub cols: usize,
    pub data: CudaSlice<u8>,
    pub scales: CudaSlice<u8>,
    pub global_scale: CudaSlice<f32>,
}

impl Nvfp4Device {
    /// Poisoned (0xFF) buffers for a `rows x cols` quantization output.
    pub fn alloc(gpu: &Gpu, rows: usize, cols: usize) -> Result<Nvfp4Device> {
        check_shape(rows, cols)?;
        Ok(Nvfp4Device {
            rows,
            cols,
            data: gpu.poisoned(rows * cols / 2, 0xFF)?,
            scales: gpu.poisoned(rows * cols / 16, 0xFF)?,
            global_scale: gpu.poisoned(rows, 0xFF)?,
        })
    }
    /// `q` copied to the device.
    pub fn upload(gpu: &Gpu, q: &Nvfp4Rows) -> Result<Nvfp4Device> {
        check_shape(q.rows, q.cols)?;
        Ok(Nvfp4Device {
            rows: q.rows,
            cols: q.cols,
            data: gpu.upload(&q.data)?,
            scales: gpu.upload(&q.scales)?,
            global_scale: gpu.upload(&q.global_scale)?,
        })
    }
    /// The rows copied back to the host (waits for the GPU's stream).
    pub fn download(&self, gpu: &Gpu) -> Result<Nvfp4Rows> {
        Ok(Nvfp4Rows {
            rows: self.rows,
            cols: self.cols,
            data: gpu.download(&self.data)?,
            scales: gpu.download(&self.scales)?,
            global_scale: gpu.download(&self.global_scale)?,
        })
    }
    /// Bytes of the packed representation (codes + block scales + global scales).
    pub fn bytes(rows: usize, cols: usize) -> usize {
        rows * cols / 2 + rows * cols / 16 + rows * 4
    }
}

/// The shape rules of NVFP4 rows: non-empty, `cols % 16 == 0` (the block size), both dimensions within `i32`
/// (the kernels' index type).
pub fn check_shape(rows: usize, cols: usize) -> Result<()> {
    if rows == 0 || cols == 0 {
        bail!("NVFP4 rows: empty shape {rows} x {cols}");
    }
    if !cols.is_multiple_of(16) {
        bail!("NVFP4 rows: cols = {cols} is not a multiple of 16 (the block size)");
    }
    if rows > i32::MAX as usize || cols > i32::MAX as usize || rows * cols / 2 > isize::MAX as usize
    {
        bail!("NVFP4 rows: shape {rows} x {cols} too large");
    }
    Ok(())
}

/// Input rows for the quantizer: fp32 or bf16 on the device.
pub enum RowsInput<'a> {
    F32(&'a CudaSlice<f32>),
    Bf16(&'a CudaSlice<bf16>),
}

/// Quantize `out.rows x out.cols` values of `x` into `out` on `stream`: one CTA per row. The caller guarantees
/// finite inputs (the host entry checks); non-finite values follow the codec's saturation policy.
pub fn quantize_rows_into(
    gpu: &Gpu,
    stream: &Stream,
    x: RowsInput<'_>,
    out: &mut Nvfp4Device,
) -> Result<()> {
    let (rows, cols) = (out.rows, out.cols);
    check_shape(rows, cols)?;
    let n = match &x {
        RowsInput::F32(s) => s.len(),
        RowsInput::Bf16(s) => s.len(),
    };
    if n < rows * cols {
        bail!("NVFP4 quantize: input has {n} elements, need {rows} x {cols}");
    }
    check_output(out)?;
    let mut args = KernelArgs::new();
    let name = match x {
        RowsInput::F32(s) => {
            args.buf(s);
            "nvfp4_quantize_rows_f32"
        }
        RowsInput::Bf16(s) => {
            args.buf(s);
            "nvfp4_quantize_rows_bf16"
        }
    };
    args.i32(rows as i32)
        .i32(cols as i32)
        .buf(&out.data)
        .buf(&out.scales)
        .buf(&out.global_scale);
    let k = gpu.kernel(FAMILY, name)?;
    let l = Launch::new((rows as u32, 1, 1), (THREADS, 1, 1));
    // SAFETY: arguments match the kernel's (x, rows, cols, data, scales, global_scale); the shape and every
    // buffer size were checked above.
    unsafe { launch(stream, &k, l, &mut args) }
}

/// Dequantize `q` to BF16 into `out` (`q.rows * q.cols` elements) on `stream`: a grid-stride loop over packed
/// byte pairs, at most 16 CTAs per SM.
pub fn dequantize_rows_into(
    gpu: &Gpu,
    stream: &Stream,
    q: &Nvfp4Device,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    check_shape(q.rows, q.cols)?;
    check_output(q)?;
    if out.len() < q.rows * q.cols {
        bail!(
            "NVFP4 dequantize: output has {} elements, need {}",
            out.len(),
            q.rows * q.cols
        );
    }
    let quads = q.rows * q.cols / 4;
    let blocks = quads
        .div_ceil(THREADS as usize)
        .clamp(1, gpu.info.sm_count as usize * 16);
    let mut args = KernelArgs::new();
    args.buf(&q.data)
        .buf(&q.scales)
        .buf(&q.global_scale)
        .i32(q.rows as i32)
        .i32(q.cols as i32)
        .buf(&*out);
    let k = gpu.kernel(FAMILY, "nvfp4_dequantize_rows_bf16")?;
    let l = Launch::new((blocks as u32, 1, 1), (THREADS, 1, 1));
    // SAFETY: arguments match (data, scales, global_scale, rows, cols, out); sizes checked above.
    unsafe { launch(stream, &k, l, &mut args) }
}

/// The buffers of `q` hold at least the `rows x cols` layout.
fn check_output(q: &Nvfp4Device) -> Result<()> {
    let (rows, cols) = (q.rows, q.cols);
    if q.data.len() < rows * cols / 2
        || q.scales.len() < rows * cols / 16
        || q.global_scale.len() < rows
    {
        bail!(
            "NVFP4 rows {rows} x {cols}: buffers too small (data {}, scales {}, global_scale {}; need {}, {}, {})",
            q.data.len(),
            q.scales.len(),
            q.global_scale.len(),
            rows * cols / 2,
            rows * cols / 16,
            rows
        );
    }
    Ok(())
}

/// Host entry: quantize finite fp32 rows on the GPU and bring the result back.
pub fn quantize_rows(gpu: &Gpu, x: &[f32], rows: usize, cols: usize) -> Result<Nvfp4Rows> {
    check_shape(rows, cols)?;
    if x.len() != rows * cols {
        bail!(
            "NVFP4 quantize: {} values given for {rows} x {cols}",
            x.len()
        );
    }
    if let Some(i) = x.iter().position(|v| !v.is_finite()) {
        bail!(
            "NVFP4 quantize: non-finite input {} at row {}, col {}",
            x[i],
            i / cols,
            i % cols
        );
    }
    let dx = gpu.upload(x)?;
    let mut out = Nvfp4Device::alloc(gpu, rows, cols)?;
    quantize_rows_into(gpu, &gpu.stream, RowsInput::F32(&dx), &mut out)?;
    out.download(gpu)
}

/// Host entry: dequantize NVFP4 rows to BF16 on the GPU.
pub fn dequantize_rows(gpu: &Gpu, q: &Nvfp4Rows) -> Result<Vec<bf16>> {
    let dq = Nvfp4Device::upload(gpu, q)?;
    let mut out = gpu.poisoned::<bf16>(q.rows * q.cols, 0xFF)?;
    dequantize_rows_into(gpu, &gpu.stream, &dq, &mut out)?;
    gpu.download(&out)
}

/// Copy `min(src, dst)` bytes rounded down to 16 with 16-byte accesses on `stream` (the limits probe's copy
/// kernel): a grid-stride loop, at most 8 CTAs per SM. Both buffers are 16-byte aligned (device allocations
/// are 256-byte aligned).
pub fn copy_u128(
    gpu: &Gpu,
    stream: &Stream,
    src: &CudaSlice<u8>,
    dst: &mut CudaSlice<u8>,
) -> Result<()> {
    let n16 = src.len().min(dst.len()) / 16;
    let blocks = n16
        .div_ceil(THREADS as usize)
        .clamp(1, gpu.info.sm_count as usize * 8);
    let l = Launch::new((blocks as u32, 1, 1), (THREADS, 1, 1));
    let mut args = KernelArgs::new();
    args.buf(src).buf(dst).u64(n16 as u64);
    let k = gpu.kernel(FAMILY, "copy_u128")?;
    // SAFETY: arguments match (src, dst, n); both hold at least n16 16-byte words.
    unsafe { launch(stream, &k, l, &mut args) }
}
