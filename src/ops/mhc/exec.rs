//! `megamoe exec` entries of the mHC family. X is BF16 (the residual streams); the RMSNorm weight is stored BF16
//! (as in the DSV4 checkpoint), an F32 weight is rounded to BF16 first, on both paths. Shapes: X `[T, 4, D]` with
//! `T >= 1`, `D % 128 == 0` and `D <= 16384`.

use anyhow::{bail, Result};
use cudarc::driver::CudaSlice;
use half::bf16;
use safetensors::Dtype;

use super::reference as r;
use super::{
    hc_head, mhc_post, mhc_post_then_pre, mhc_pre, MhcPreOutputs, MhcWeights, MhcWorkspace,
};
use crate::gpu::arena::Arena;
use crate::gpu::Gpu;
use crate::ops::exec::{input, ExecKernel, HostTensor, TensorMap};
use crate::ops::norm_quant::exec::{bf16_tensor, put_quant, weight};
use crate::ops::norm_quant::reference as nr;
use crate::ops::norm_quant::{upload_checked_bf16, upload_checked_f32, HostQuant, OutFormat};

pub fn exec_kernels() -> Vec<ExecKernel> {
    vec![
        ExecKernel {
            name: "mhc_pre_nvfp4",
            doc: "hc_pre + RMSNorm(u; weight) -> NVFP4. in: X BF16 [T, 4, D] (4 residual streams per token), hc_fn F32 [24, 4D], hc_scale F32 [3], hc_base F32 [24], weight F32|BF16 [D] (rounded to BF16); T >= 1, D % 128 == 0, D <= 16384, finite values. out: pre F32 [T, 4], post F32 [T, 4], comb F32 [T, 4, 4], u BF16 [T, D], data U8 [T, D/2], scales F8_E4M3 [T, D/16], global_scale F32 [T], rstd F32 [T]",
            run: |i, g| run_mhc_pre(i, g, OutFormat::Nvfp4),
        },
        ExecKernel {
            name: "mhc_pre_fp8",
            doc: "hc_pre + RMSNorm(u; weight) -> FP8. in: as mhc_pre_nvfp4 (X, hc_fn, hc_scale, hc_base, weight; same constraints). out: pre, post, comb, u as mhc_pre_nvfp4; data F8_E4M3 [T, D], scales U8 (ue8m0) [T, D/128], rstd F32 [T]",
            run: |i, g| run_mhc_pre(i, g, OutFormat::Fp8),
        },
        ExecKernel {
            name: "mhc_pre_bf16",
            doc: "hc_pre + RMSNorm(u; weight) -> BF16. in: as mhc_pre_nvfp4 (X, hc_fn, hc_scale, hc_base, weight; same constraints). out: pre, post, comb, u as mhc_pre_nvfp4; y BF16 [T, D], rstd F32 [T]",
            run: |i, g| run_mhc_pre(i, g, OutFormat::Bf16),
        },
        ExecKernel {
            name: "mhc_post",
            doc: "hc_post. in: y BF16 [T, D], X BF16 [T, 4, D], post F32 [T, 4], comb F32 [T, 4, 4] (row-major C[j][k]); T >= 1, D % 128 == 0, D <= 16384, finite values. out: X_out BF16 [T, 4, D], X_out[t][k] = post[t][k] y[t] + sum_j comb[t][j][k] X[t][j]",
            run: run_mhc_post,
        },
        ExecKernel {
            name: "mhc_post_then_pre_nvfp4",
            doc: "hc_post of one sub-layer fused with hc_pre + RMSNorm -> NVFP4 of the next. in: y BF16 [T, D], X BF16 [T, 4, D], post F32 [T, 4], comb F32 [T, 4, 4] (the previous boundary's), hc_fn F32 [24, 4D], hc_scale F32 [3], hc_base F32 [24], weight F32|BF16 [D] (the next boundary's); T >= 1, D % 128 == 0, D <= 16384, finite values. out: X_out BF16 [T, 4, D] (as mhc_post), and pre, post, comb, u, data, scales, global_scale, rstd of mhc_pre_nvfp4 on X_out",
            run: run_mhc_post_then_pre,
        },
        ExecKernel {
            name: "hc_head",
            doc: "hc_head + RMSNorm(u; weight) -> BF16. in: X BF16 [T, 4, D], hc_head_fn F32 [4, 4D], hc_head_scale F32 [1], hc_head_base F32 [4], weight F32|BF16 [D] (rounded to BF16); T >= 1, D % 128 == 0, D <= 16384, finite values. out: pre F32 [T, 4], u BF16 [T, D], y BF16 [T, D] = RMSNorm(u), rstd F32 [T]",
            run: run_hc_head,
        },
    ]
}

/// X [T, 4, D] as f32 values, with T and D.
fn residual(inputs: &TensorMap, k: &str) -> Result<(Vec<f32>, usize, usize)> {
    let xt = input(inputs, k, "X", &[Dtype::BF16], &[None, Some(4), None])?;
    let (t, d) = (xt.shape[0], xt.shape[2]);
    crate::ops::norm_quant::check_rows(t, d)?;
    if d > super::MHC_MAX_D {
        bail!(
            "{k}: hidden size {d} is above the supported {}",
            super::MHC_MAX_D
        );
    }
    let x = xt.to_f32()?;
    if let Some(i) = x.iter().position(|v| !v.is_finite()) {
        bail!("{k}: X has a non-finite value at index {i}");
    }
    Ok((x, t, d))
}

/// The sub-layer boundary's `hc_fn` [24, 4D], `hc_scale` [3], `hc_base` [24].
fn mhc_params(inputs: &TensorMap, k: &str, d: usize) -> Result<r::MhcParams> {
    let mix_fn = input(inputs, k, "hc_fn", &[Dtype::F32], &[Some(24), Some(4 * d)])?.to_f32()?;
    let scale: [f32; 3] = input(inputs, k, "hc_scale", &[Dtype::F32], &[Some(3)])?
        .to_f32()?
        .try_into()
        .unwrap();
    let base: [f32; 24] = input(inputs, k, "hc_base", &[Dtype::F32], &[Some(24)])?
        .to_f32()?
        .try_into()
        .unwrap();
    Ok(r::MhcParams {
        mix_fn,
        scale,
        base,
    })
}

/// Outputs of one mHC boundary on the host: pre, post, comb, u, the quantized RMSNorm(u) and its rstd.
struct HostMhcPre {
    pre: Vec<f32>,
    post: Vec<f32>,
    comb: Vec<f32>,
    u: Vec<f32>,
    q: HostQuant,
    rstd: Vec<f32>,
}

impl HostMhcPre {
    fn download(g: &Gpu, out: &MhcPreOutputs) -> Result<HostMhcPre> {
        let h = out.normed.download(g)?;
        Ok(HostMhcPre {
            pre: g.download(&out.pre)?,
            post: g.download(&out.post)?,
            comb: g.download(&out.comb)?,
            u: g.download(&out.u)?
                .iter()
                .map(|v: &bf16| v.to_f32())
                .collect(),
            q: h.q,
            rstd: h.rstd,
        })
    }

    /// The CPU reference of the boundary on X [T, 4, D].
    fn reference(
        x: &[f32],
        p: &r::MhcParams,
        w: &[f32],
        t: usize,
        d: usize,
        format: OutFormat,
    ) -> Result<HostMhcPre> {
        let (mut pre, mut post, mut comb, mut u) = (vec![], vec![], vec![], vec![]);
        for tok in 0..t {
            let (c, ut) = r::mhc_pre_token(&x[tok * 4 * d..(tok + 1) * 4 * d], p);
            pre.extend(c.pre);
            post.extend(c.post);
            comb.extend(c.comb);
            u.extend(ut);
        }
        let (y, rstd) = nr::rmsnorm_rows(&u, t, d, w, nr::RMS_EPS)?;
        Ok(HostMhcPre {
            pre,
            post,
            comb,
            u,
            q: HostQuant::encode(format, &y, t, d)?,
            rstd,
        })
    }

    fn put(&self, m: &mut TensorMap, t: usize, d: usize) {
        m.insert("pre".into(), HostTensor::from_f32(vec![t, 4], &self.pre));
        m.insert("post".into(), HostTensor::from_f32(vec![t, 4], &self.post));
        m.insert(
            "comb".into(),
            HostTensor::from_f32(vec![t, 4, 4], &self.comb),
        );
        m.insert("u".into(), bf16_tensor(vec![t, d], &self.u));
        put_quant(m, &self.q, t, d, &self.rstd);
    }
}

fn run_mhc_pre(inputs: &TensorMap, gpu: Option<&Gpu>, format: OutFormat) -> Result<TensorMap> {
    let k = "mhc_pre";
    let (x, t, d) = residual(inputs, k)?;
    let p = mhc_params(inputs, k, d)?;
    let w = weight(inputs, k, d)?;
    let h = match gpu {
        Some(g) => {
            let dw = MhcWeights::upload(g, &p, &w, d)?;
            let dx = upload_checked_bf16(g, "X", &x)?;
            let mut out = MhcPreOutputs::alloc_poisoned(g, format, t, d)?;
            let mut arena = Arena::for_layout(g, &MhcWorkspace::layout(t, d))?;
            let ws = MhcWorkspace::carve(&mut arena, t, d)?;
            mhc_pre(g, &g.stream, &dx, &dw, nr::RMS_EPS, &ws, &mut out)?;
            HostMhcPre::download(g, &out)?
        }
        None => HostMhcPre::reference(&x, &p, &w, t, d, format)?,
    };
    let mut m = TensorMap::new();
    h.put(&mut m, t, d);
    Ok(m)
}

/// mhc_post's inputs besides X: y [T, D], post [T, 4], comb [T, 4, 4].
fn post_inputs(
    inputs: &TensorMap,
    k: &str,
    t: usize,
    d: usize,
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let y = input(inputs, k, "y", &[Dtype::BF16], &[Some(t), Some(d)])?.to_f32()?;
    let post = input(inputs, k, "post", &[Dtype::F32], &[Some(t), Some(4)])?.to_f32()?;
    let comb = input(
        inputs,
        k,
        "comb",
        &[Dtype::F32],
        &[Some(t), Some(4), Some(4)],
    )?
    .to_f32()?;
    Ok((y, post, comb))
}

/// The CPU reference of mhc_post: X_out [T, 4, D] (BF16 values).
fn mhc_post_reference(
    y: &[f32],
    x: &[f32],
    post: &[f32],
    comb: &[f32],
    t: usize,
    d: usize,
) -> Vec<f32> {
    (0..t)
        .flat_map(|tok| {
            let p: [f32; 4] = post[tok * 4..tok * 4 + 4].try_into().unwrap();
            let c: [f32; 16] = comb[tok * 16..tok * 16 + 16].try_into().unwrap();
            r::mhc_post_token(
                &y[tok * d..(tok + 1) * d],
                &x[tok * 4 * d..(tok + 1) * 4 * d],
                &p,
                &c,
            )
        })
        .collect()
}

/// hc_post's inputs on the device (each checked while uploading): y, X (BF16), post, comb (f32).
type PostInputsOnDevice = (
    CudaSlice<bf16>,
    CudaSlice<bf16>,
    CudaSlice<f32>,
    CudaSlice<f32>,
);
fn upload_post_inputs(
    g: &Gpu,
    y: &[f32],
    x: &[f32],
    post: &[f32],
    comb: &[f32],
) -> Result<PostInputsOnDevice> {
    Ok((
        upload_checked_bf16(g, "y", y)?,
        upload_checked_bf16(g, "X", x)?,
        upload_checked_f32(g, "post", post)?,
        upload_checked_f32(g, "comb", comb)?,
    ))
}

fn run_mhc_post(inputs: &TensorMap, gpu: Option<&Gpu>) -> Result<TensorMap> {
    let k = "mhc_post";
    let (x, t, d) = residual(inputs, k)?;
    let (y, post, comb) = post_inputs(inputs, k, t, d)?;
    let out: Vec<f32> = match gpu {
        Some(g) => {
            let (dy, dx, dp, dc) = upload_post_inputs(g, &y, &x, &post, &comb)?;
            let xo = g.poisoned::<bf16>(t * 4 * d, 0xFF)?;
            mhc_post(g, &g.stream, &dy, &dx, &dp, &dc, t, d, &xo)?;
            g.download(&xo)?.iter().map(|v| v.to_f32()).collect()
        }
        None => mhc_post_reference(&y, &x, &post, &comb, t, d),
    };
    let mut m = TensorMap::new();
    m.insert("X_out".into(), bf16_tensor(vec![t, 4, d], &out));
    Ok(m)
}

/// mhc_post then the next boundary's mhc_pre (NVFP4) on its X_out: the fused kernel pair on the GPU, the two
/// references in sequence on the CPU (the fused X_out is bit-identical to mhc_post's).
fn run_mhc_post_then_pre(inputs: &TensorMap, gpu: Option<&Gpu>) -> Result<TensorMap> {
    let k = "mhc_post_then_pre";
    let format = OutFormat::Nvfp4;
    let (x, t, d) = residual(inputs, k)?;
    let (y, post, comb) = post_inputs(inputs, k, t, d)?;
    let p = mhc_params(inputs, k, d)?;
    let w = weight(inputs, k, d)?;
    let (x_out, h) = match gpu {
        Some(g) => {
            let (dy, dx, dp, dc) = upload_post_inputs(g, &y, &x, &post, &comb)?;
            let dw = MhcWeights::upload(g, &p, &w, d)?;
            let xo = g.poisoned::<bf16>(t * 4 * d, 0xFF)?;
            let mut out = MhcPreOutputs::alloc_poisoned(g, format, t, d)?;
            let mut arena = Arena::for_layout(g, &MhcWorkspace::layout(t, d))?;
            let ws = MhcWorkspace::carve(&mut arena, t, d)?;
            mhc_post_then_pre(
                g,
                &g.stream,
                &dy,
                &dx,
                &dp,
                &dc,
                &dw,
                nr::RMS_EPS,
                &ws,
                &xo,
                &mut out,
            )?;
            let x_out: Vec<f32> = g.download(&xo)?.iter().map(|v| v.to_f32()).collect();
            (x_out, HostMhcPre::download(g, &out)?)
        }
        None => {
            let x_out = mhc_post_reference(&y, &x, &post, &comb, t, d);
            let h = HostMhcPre::reference(&x_out, &p, &w, t, d, format)?;
            (x_out, h)
        }
    };
    let mut m = TensorMap::new();
    m.insert("X_out".into(), bf16_tensor(vec![t, 4, d], &x_out));
    h.put(&mut m, t, d);
    Ok(m)
}

fn run_hc_head(inputs: &TensorMap, gpu: Option<&Gpu>) -> Result<TensorMap> {
    let k = "hc_head";
    let (x, t, d) = residual(inputs, k)?;
    let head_fn = input(
        inputs,
        k,
        "hc_head_fn",
        &[Dtype::F32],
        &[Some(4), Some(4 * d)],
    )?
    .to_f32()?;
    let scale = input(inputs, k, "hc_head_scale", &[Dtype::F32], &[Some(1)])?.to_f32()?[0];
    let base: [f32; 4] = input(inputs, k, "hc_head_base", &[Dtype::F32], &[Some(4)])?
        .to_f32()?
        .try_into()
        .unwrap();
    let w = weight(inputs, k, d)?;
    let (pre, u, q, rstd) = match gpu {
        Some(g) => {
            let dw = MhcWeights::upload_head(g, &head_fn, scale, &base, &w, d)?;
            let dx = upload_checked_bf16(g, "X", &x)?;
            let mut out = MhcPreOutputs::alloc_poisoned(g, OutFormat::Bf16, t, d)?;
            let mut arena = Arena::for_layout(g, &MhcWorkspace::layout(t, d))?;
            let ws = MhcWorkspace::carve(&mut arena, t, d)?;
            hc_head(g, &g.stream, &dx, &dw, nr::RMS_EPS, &ws, &mut out)?;
            let h = out.normed.download(g)?;
            let u: Vec<f32> = g
                .download(&out.u)?
                .iter()
                .map(|v: &bf16| v.to_f32())
                .collect();
            (g.download(&out.pre)?, u, h.q, h.rstd)
        }
        None => {
            let (mut pre, mut u) = (vec![], vec![]);
            for tok in 0..t {
                let (p, ut) =
                    r::hc_head_token(&x[tok * 4 * d..(tok + 1) * 4 * d], &head_fn, scale, &base);
                pre.extend(p);
                u.extend(ut);
            }
            let (y, rstd) = nr::rmsnorm_rows(&u, t, d, &w, nr::RMS_EPS)?;
            (pre, u, HostQuant::Bf16(y), rstd)
        }
    };
    let mut m = TensorMap::new();
    m.insert("pre".into(), HostTensor::from_f32(vec![t, 4], &pre));
    m.insert("u".into(), bf16_tensor(vec![t, d], &u));
    put_quant(&mut m, &q, t, d, &rstd);
    Ok(m)
}
