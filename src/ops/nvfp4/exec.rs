//! `megamoe exec` entries of the nvfp4 family: quantize and dequantize NVFP4 rows on the GPU, or with the CPU
//! codec (`formats::nvfp4`) for `--cpu`.

use half::bf16;
use safetensors::Dtype;

use super::{check_shape, dequantize_rows, quantize_rows};
use crate::formats::nvfp4::{self, Nvfp4Rows};
use crate::ops::exec::{input, ExecKernel, HostTensor, TensorMap};

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
