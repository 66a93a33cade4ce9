//! `megamoe exec` entries of the norm_quant family. The RMSNorm weight is stored BF16 (as in the DSV4
//! checkpoint); an F32 weight is rounded to BF16 first, on both paths.

use anyhow::{bail, Result};
use safetensors::Dtype;

use super::reference as r;
use super::{
    rmsnorm_quant, upload_checked_bf16, upload_checked_f32, HostQuant, NormOutputs, OutFormat,
    RowsIn,
};
use crate::formats::bf16 as fbf16;
use crate::gpu::Gpu;
use crate::ops::exec::{input, ExecKernel, HostTensor, TensorMap};

pub(crate) const FLOATS: &[Dtype] = &[Dtype::F32, Dtype::BF16];

pub fn exec_kernels() -> Vec<ExecKernel> {
    vec![
        ExecKernel {
            name: "rmsnorm_nvfp4",
            doc: "RMSNorm(x; weight) -> NVFP4. in: x F32|BF16 [rows, D], weight F32|BF16 [D] (rounded to BF16); rows >= 1, D % 128 == 0, D <= 32768, finite values. out: data U8 [rows, D/2] (e2m1 codes, lower index in the low nibble), scales F8_E4M3 [rows, D/16], global_scale F32 [rows], rstd F32 [rows]",
            run: |i, g| run_rmsnorm(i, g, OutFormat::Nvfp4),
        },
        ExecKernel {
            name: "rmsnorm_fp8",
            doc: "RMSNorm(x; weight) -> FP8 e4m3 1x128. in: x F32|BF16 [rows, D], weight F32|BF16 [D] (rounded to BF16); rows >= 1, D % 128 == 0, D <= 32768, finite values. out: data F8_E4M3 [rows, D], scales U8 (ue8m0) [rows, D/128], rstd F32 [rows]",
            run: |i, g| run_rmsnorm(i, g, OutFormat::Fp8),
        },
        ExecKernel {
            name: "rmsnorm_bf16",
            doc: "RMSNorm(x; weight) -> BF16. in: x F32|BF16 [rows, D], weight F32|BF16 [D] (rounded to BF16); rows >= 1, D % 128 == 0, D <= 32768, finite values. out: y BF16 [rows, D], rstd F32 [rows]",
            run: |i, g| run_rmsnorm(i, g, OutFormat::Bf16),
        },
    ]
}

pub(crate) fn weight(inputs: &TensorMap, kernel: &str, d: usize) -> Result<Vec<f32>> {
    let w = input(inputs, kernel, "weight", FLOATS, &[Some(d)])?.to_f32()?;
    Ok(w.iter().map(|&v| fbf16::round(v)).collect())
}

pub(crate) fn bf16_tensor(shape: Vec<usize>, v: &[f32]) -> HostTensor {
    HostTensor::from_bf16(shape, &fbf16::to_bf16_vec(v))
}

pub(crate) fn put_quant(m: &mut TensorMap, q: &HostQuant, rows: usize, d: usize, rstd: &[f32]) {
    match q {
        HostQuant::Nvfp4(n) => {
            m.insert(
                "data".into(),
                HostTensor::from_u8(Dtype::U8, vec![rows, d / 2], n.data.clone()),
            );
            m.insert(
                "scales".into(),
                HostTensor::from_u8(Dtype::F8_E4M3, vec![rows, d / 16], n.scales.clone()),
            );
            m.insert(
                "global_scale".into(),
                HostTensor::from_f32(vec![rows], &n.global_scale),
            );
        }
        HostQuant::Fp8(f) => {
            m.insert(
                "data".into(),
                HostTensor::from_u8(Dtype::F8_E4M3, vec![rows, d], f.data.clone()),
            );
            m.insert(
                "scales".into(),
                HostTensor::from_u8(Dtype::U8, vec![rows, d / 128], f.scales.clone()),
            );
        }
        HostQuant::Bf16(y) => {
            m.insert("y".into(), bf16_tensor(vec![rows, d], y));
        }
    }
    m.insert("rstd".into(), HostTensor::from_f32(vec![rows], rstd));
}

fn run_rmsnorm(inputs: &TensorMap, gpu: Option<&Gpu>, format: OutFormat) -> Result<TensorMap> {
    let k = "rmsnorm";
    let xt = input(inputs, k, "x", FLOATS, &[None, None])?;
    let (rows, d) = (xt.shape[0], xt.shape[1]);
    super::check_rows(rows, d)?;
    let x = xt.to_f32()?;
    if let Some(i) = x.iter().position(|v| !v.is_finite()) {
        bail!("rmsnorm: x has a non-finite value at index {i}");
    }
    let w = weight(inputs, k, d)?;
    let (q, rstd) = match gpu {
        Some(g) => {
            let dw = upload_checked_bf16(g, "weight", &w)?;
            let mut out = NormOutputs::alloc_poisoned(g, format, rows, d)?;
            if xt.dtype == Dtype::BF16 {
                let dx = upload_checked_bf16(g, "x", &x)?;
                rmsnorm_quant(g, &g.stream, RowsIn::Bf16(&dx), &dw, r::RMS_EPS, &mut out)?;
            } else {
                let dx = upload_checked_f32(g, "x", &x)?;
                rmsnorm_quant(g, &g.stream, RowsIn::F32(&dx), &dw, r::RMS_EPS, &mut out)?;
            }
            let h = out.download(g)?;
            (h.q, h.rstd)
        }
        None => {
            let (y, rstd) = r::rmsnorm_rows(&x, rows, d, &w, r::RMS_EPS)?;
            (HostQuant::encode(format, &y, rows, d)?, rstd)
        }
    };
    let mut m = TensorMap::new();
    put_quant(&mut m, &q, rows, d, &rstd);
    Ok(m)
}
