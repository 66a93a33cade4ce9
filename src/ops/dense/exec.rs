//! `megamoe exec` entries of the dense family: the FP8 linear (x quantized FP8 1x128 with the DSV4 rule, as
//! norm_quant's FP8 output) and the BF16 linear (f32 out). The CPU path is the model's math: the weight dequantized
//! (`formats::fp8`, exact), `numerics::dot` per output, BF16-rounded for the FP8 linear.

use anyhow::{ensure, Result};
use half::bf16;
use safetensors::Dtype;

use super::{
    bf16_linear, fp8_linear, workspace_layout, Bf16Job, DenseKind, DenseShape, DenseWorkspace,
    Fp8Rows, Fp8Weight,
};
use crate::formats::fp8::{dequantize_weight_128x128, quantize_act_1x128, Fp8BlockWeight};
use crate::gpu::arena::Arena;
use crate::gpu::Gpu;
use crate::model::numerics::{bf16_round, dot, fp8_act_quant};
use crate::ops::exec::{input, ExecKernel, HostTensor, TensorMap};

const FLOATS: &[Dtype] = &[Dtype::F32, Dtype::BF16];

pub fn exec_kernels() -> Vec<ExecKernel> {
    vec![
        ExecKernel {
            name: "dense_fp8_linear",
            doc: "y = bf16(fp8_1x128(x) . dequant(w)^T). in: x F32|BF16 [M, K] (rounded to BF16, then quantized FP8 1x128 with the DSV4 rule), w F8_E4M3|U8 [N, K], w_scale F8_E8M0|U8 [N/128, K/128] (ue8m0); 1 <= M <= 64, N % 128 == 0, K % 128 == 0. out: y BF16 [M, N]",
            run: run_fp8,
        },
        ExecKernel {
            name: "dense_bf16_linear",
            doc: "y = x . w^T in f32. in: x F32|BF16 [M, K] (rounded to BF16), w BF16 [N, K]; 1 <= M <= 64, K % 64 == 0. out: y F32 [M, N]",
            run: run_bf16,
        },
    ]
}

fn bf16_rows(inputs: &TensorMap, kernel: &str) -> Result<(Vec<f32>, usize, usize)> {
    let xt = input(inputs, kernel, "x", FLOATS, &[None, None])?;
    let (m, k) = (xt.shape[0], xt.shape[1]);
    let x: Vec<f32> = xt.to_f32()?.into_iter().map(bf16_round).collect();
    if let Some(i) = x.iter().position(|v| !v.is_finite()) {
        anyhow::bail!("{kernel}: x has a non-finite value at index {i}");
    }
    Ok((x, m, k))
}

/// A workspace for one call of `shape`.
fn workspace(gpu: &Gpu, shape: DenseShape) -> Result<(Arena, DenseWorkspace)> {
    let sms = gpu.info.sm_count as usize;
    let mut arena = Arena::for_layout(gpu, &workspace_layout(&[shape], sms)?)?;
    let ws = DenseWorkspace::carve(&mut arena, &gpu.stream, &[shape], sms)?;
    Ok((arena, ws))
}

fn run_fp8(inputs: &TensorMap, gpu: Option<&Gpu>) -> Result<TensorMap> {
    let kn = "dense_fp8_linear";
    let (x, m, k) = bf16_rows(inputs, kn)?;
    let wt = input(
        inputs,
        kn,
        "w",
        &[Dtype::F8_E4M3, Dtype::U8],
        &[None, Some(k)],
    )?;
    let n = wt.shape[0];
    let shape = DenseShape::new(DenseKind::Fp8, m, n, k, 1);
    shape.check()?;
    let st = input(
        inputs,
        kn,
        "w_scale",
        &[Dtype::F8_E8M0, Dtype::U8],
        &[Some(n / 128), Some(k / 128)],
    )?;
    let w = Fp8BlockWeight::from_parts(n, k, wt.bytes.clone(), st.bytes.clone())?;
    let y: Vec<f32> = match gpu {
        Some(g) => {
            let xq = quantize_act_1x128(&x, m, k)?;
            let (xc, xs) = (g.upload(&xq.data)?, g.upload(&xq.scales)?);
            let (wc, ws_) = (g.upload(&w.data)?, g.upload(&w.scales)?);
            let y = g.poisoned::<bf16>(m * n, 0xFF)?;
            let (_arena, ws) = workspace(g, shape)?;
            let xr = Fp8Rows {
                codes: &xc,
                scales: &xs,
                rows: m,
                k,
            };
            let wr = Fp8Weight {
                codes: &wc,
                scales: &ws_,
                n,
                k,
                scales_f32: None,
            };
            fp8_linear(g, &g.stream, &xr, &wr, &ws, &y)?;
            g.synchronize()?;
            g.download(&y)?.iter().map(|v| v.to_f32()).collect()
        }
        None => {
            let wd = dequantize_weight_128x128(&w);
            let mut y = Vec::with_capacity(m * n);
            for row in 0..m {
                let xq = fp8_act_quant(&x[row * k..(row + 1) * k])?;
                y.extend((0..n).map(|r| bf16_round(dot(&wd[r * k..(r + 1) * k], &xq))));
            }
            y
        }
    };
    let yb: Vec<bf16> = y.iter().map(|&v| bf16::from_f32(v)).collect();
    let mut out = TensorMap::new();
    out.insert("y".into(), HostTensor::from_bf16(vec![m, n], &yb));
    Ok(out)
}

fn run_bf16(inputs: &TensorMap, gpu: Option<&Gpu>) -> Result<TensorMap> {
    let kn = "dense_bf16_linear";
    let (x, m, k) = bf16_rows(inputs, kn)?;
    let wt = input(inputs, kn, "w", &[Dtype::BF16], &[None, Some(k)])?;
    let n = wt.shape[0];
    let shape = DenseShape::new(DenseKind::Bf16, m, n, k, 1);
    shape.check()?;
    let w = wt.to_f32()?;
    ensure!(
        w.len() == n * k,
        "{kn}: w has {} values, needs {}",
        w.len(),
        n * k
    );
    let y: Vec<f32> = match gpu {
        Some(g) => {
            let to = |v: &[f32]| v.iter().map(|&a| bf16::from_f32(a)).collect::<Vec<_>>();
            let (dx, dw) = (g.upload(&to(&x))?, g.upload(&to(&w))?);
            let y = g.poisoned::<f32>(m * n, 0xFF)?;
            let (_arena, ws) = workspace(g, shape)?;
            bf16_linear(
                g,
                &g.stream,
                &dx,
                m,
                k,
                &[Bf16Job { w: &dw, n, y: &y }],
                &ws,
            )?;
            g.synchronize()?;
            g.download(&y)?
        }
        None => (0..m * n)
            .map(|i| {
                let (row, r) = (i / n, i % n);
                dot(&w[r * k..(r + 1) * k], &x[row * k..(row + 1) * k])
            })
            .collect(),
    };
    let mut out = TensorMap::new();
    out.insert("y".into(), HostTensor::from_f32(vec![m, n], &y));
    Ok(out)
}
