//! NVFP4 rows on the GPU (kernels/nvfp4.cu): quantize with a per-row fp32 global scale and dequantize to
//! BF16. The CPU reference is the codec itself, `formats::nvfp4`; the GPU results must match it bit for bit.

use anyhow::{bail, Result};
use cudarc::driver::CudaSlice;
use half::bf16;
use safetensors::Dtype;

use crate::formats::nvfp4::{self, Nvfp4Rows};
use crate::gpu::{grid_1d, launch, launch_cfg, Gpu, PushKernelArg};
use crate::ops::exec::{input, ExecKernel, HostTensor, TensorMap};

pub mod bench;

const FAMILY: &str = "nvfp4";
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

fn check_shape(rows: usize, cols: usize) -> Result<()> {
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

/// Quantize `rows x cols` values into `out` (one CTA per row). The caller guarantees finite inputs (the host
/// entry points check); non-finite values follow the codec's saturation policy.
pub fn quantize_rows_into(gpu: &Gpu, x: RowsInput<'_>, out: &mut Nvfp4Device) -> Result<()> {
    let (rows, cols) = (out.rows, out.cols);
    check_shape(rows, cols)?;
    let n = match &x {
        RowsInput::F32(s) => s.len(),
        RowsInput::Bf16(s) => s.len(),
    };
    if n < rows * cols {
        bail!("NVFP4 quantize: input has {n} elements, need {rows} x {cols}");
    }
    let (r, c) = (rows as i32, cols as i32);
    let cfg = launch_cfg((rows as u32, 1, 1), (THREADS, 1, 1), 0);
    match x {
        RowsInput::F32(s) => {
            let f = gpu.function(FAMILY, "nvfp4_quantize_rows_f32")?;
            let mut b = gpu.stream.launch_builder(&f);
            b.arg(s)
                .arg(&r)
                .arg(&c)
                .arg(&mut out.data)
                .arg(&mut out.scales)
                .arg(&mut out.global_scale);
            unsafe { launch(b, cfg, "nvfp4_quantize_rows_f32") }?;
        }
        RowsInput::Bf16(s) => {
            let f = gpu.function(FAMILY, "nvfp4_quantize_rows_bf16")?;
            let mut b = gpu.stream.launch_builder(&f);
            b.arg(s)
                .arg(&r)
                .arg(&c)
                .arg(&mut out.data)
                .arg(&mut out.scales)
                .arg(&mut out.global_scale);
            unsafe { launch(b, cfg, "nvfp4_quantize_rows_bf16") }?;
        }
    }
    Ok(())
}

/// Dequantize to BF16 into `out` (`rows * cols` elements).
pub fn dequantize_rows_into(gpu: &Gpu, q: &Nvfp4Device, out: &mut CudaSlice<bf16>) -> Result<()> {
    check_shape(q.rows, q.cols)?;
    if out.len() < q.rows * q.cols {
        bail!(
            "NVFP4 dequantize: output has {} elements, need {}",
            out.len(),
            q.rows * q.cols
        );
    }
    let f = gpu.function(FAMILY, "nvfp4_dequantize_rows_bf16")?;
    let quads = q.rows * q.cols / 4;
    let blocks = quads
        .div_ceil(THREADS as usize)
        .min(gpu.info.sm_count as usize * 16);
    let cfg = launch_cfg((blocks.max(1) as u32, 1, 1), (THREADS, 1, 1), 0);
    let (r, c) = (q.rows as i32, q.cols as i32);
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(&q.data)
        .arg(&q.scales)
        .arg(&q.global_scale)
        .arg(&r)
        .arg(&c)
        .arg(out);
    unsafe { launch(b, cfg, "nvfp4_dequantize_rows_bf16") }
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
    quantize_rows_into(gpu, RowsInput::F32(&dx), &mut out)?;
    out.download(gpu)
}

/// Host entry: dequantize NVFP4 rows to BF16 on the GPU.
pub fn dequantize_rows(gpu: &Gpu, q: &Nvfp4Rows) -> Result<Vec<bf16>> {
    let dq = Nvfp4Device::upload(gpu, q)?;
    let mut out = gpu.poisoned::<bf16>(q.rows * q.cols, 0xFF)?;
    dequantize_rows_into(gpu, &dq, &mut out)?;
    gpu.download(&out)
}

/// A copy kernel with 16-byte accesses over `n16` 16-byte words (the limits probe's own copy row).
pub fn copy_u128(gpu: &Gpu, src: &CudaSlice<u8>, dst: &mut CudaSlice<u8>) -> Result<()> {
    let n16 = src.len().min(dst.len()) / 16;
    let f = gpu.function(FAMILY, "copy_u128")?;
    let mut cfg = grid_1d(n16, THREADS);
    cfg.grid_dim.0 = cfg.grid_dim.0.min(gpu.info.sm_count as u32 * 8);
    let n = n16;
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(src).arg(dst).arg(&n);
    unsafe { launch(b, cfg, "copy_u128") }
}

fn rows_cols(t: &HostTensor) -> (usize, usize) {
    (t.shape[0], t.shape[1])
}

/// `megamoe exec` entries of this family.
pub fn exec_kernels() -> Vec<ExecKernel> {
    vec![
        ExecKernel {
            name: "nvfp4_quantize_rows",
            doc: "in: x F32|BF16 [rows, cols] (cols % 16 == 0, finite). out: data U8 [rows, cols/2] (e2m1, low nibble = lower col), scales F8_E4M3 [rows, cols/16], global_scale F32 [rows]",
            run: |inputs, gpu| {
                let x = input(inputs, "nvfp4_quantize_rows", "x", &[Dtype::F32, Dtype::BF16], &[None, None])?;
                let (rows, cols) = rows_cols(x);
                let xs = x.to_f32()?;
                let q = match gpu {
                    Some(g) => quantize_rows(g, &xs, rows, cols)?,
                    None => nvfp4::quantize_rows(&xs, rows, cols)?,
                };
                Ok(nvfp4_to_tensors(&q))
            },
        },
        ExecKernel {
            name: "nvfp4_dequantize_rows",
            doc: "in: data U8 [rows, cols/2], scales F8_E4M3|U8 [rows, cols/16], global_scale F32 [rows]. out: y BF16 [rows, cols]",
            run: |inputs, gpu| {
                let k = "nvfp4_dequantize_rows";
                let data = input(inputs, k, "data", &[Dtype::U8], &[None, None])?;
                let (rows, half_cols) = rows_cols(data);
                let cols = half_cols * 2;
                let scales = input(inputs, k, "scales", &[Dtype::F8_E4M3, Dtype::U8], &[Some(rows), Some(cols / 16)])?;
                let gs = input(inputs, k, "global_scale", &[Dtype::F32], &[Some(rows)])?;
                check_shape(rows, cols)?;
                let q = Nvfp4Rows {
                    rows,
                    cols,
                    data: data.bytes.clone(),
                    scales: scales.bytes.clone(),
                    global_scale: gs.to_f32()?,
                };
                let y: Vec<bf16> = match gpu {
                    Some(g) => dequantize_rows(g, &q)?,
                    None => nvfp4::dequantize_rows(&q).iter().map(|&v| bf16::from_f32(v)).collect(),
                };
                let mut m = TensorMap::new();
                m.insert("y".into(), HostTensor::from_bf16(vec![rows, cols], &y));
                Ok(m)
            },
        },
    ]
}

/// The output tensors of `nvfp4_quantize_rows`.
pub fn nvfp4_to_tensors(q: &Nvfp4Rows) -> TensorMap {
    let mut m = TensorMap::new();
    m.insert(
        "data".into(),
        HostTensor::from_u8(Dtype::U8, vec![q.rows, q.cols / 2], q.data.clone()),
    );
    m.insert(
        "scales".into(),
        HostTensor::from_u8(Dtype::F8_E4M3, vec![q.rows, q.cols / 16], q.scales.clone()),
    );
    m.insert(
        "global_scale".into(),
        HostTensor::from_f32(vec![q.rows], &q.global_scale),
    );
    m
}
