//! Session-4 A/B candidate for the fused mHC boundary: the same split-K mix kernels as [`super::mhc_pre`]
//! (norm_quant.cu `mhc_mix_partial24_pdl` / `_v2`), then the WIDE finish of kernels/mhc_boundary.cu
//! (`mhc_pre_finish_wide_*`: one 8-value chunk per thread, a CTA of `4 x roundup32(D/32)` threads per token
//! and task, the Sinkhorn's reciprocals without the slow-path branch). Outputs are bit-identical to
//! [`super::MhcPrePath::PdlPair`] / [`super::MhcPrePath::TwoLaunch`] (the .cu header says why, item by item).
//! Taken through [`super::mhc_pre_with`] with [`super::MhcPrePath::Wide`]. Launch rule as [`super::mhc_pre`]:
//! the PDL pair up to [`super::MHC_PDL_MAX_TOKENS`] tokens, two plain launches above.

use anyhow::{bail, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

use super::{
    launch_mix_partial_v2, mix_splits, row_block_threads, MhcPreOutputs, MhcWeights, QuantBufs,
    FAMILY, MHC_PDL_MAX_TOKENS,
};
use crate::gpu::pdl::{launch_pdl, RawArgs};
use crate::gpu::{drv, launch_cfg, Gpu, PushKernelArg};

/// Kernel family of the wide finish (kernels/mhc_boundary.cu).
pub const WIDE_FAMILY: &str = "mhc_boundary";
/// Largest hidden size of the wide finish: its CTA has `4 x roundup32(D/32)` threads, at most 1024.
pub const WIDE_MAX_D: usize = 8192;

/// Threads per CTA of the wide finish for hidden size `d` (one 8-value chunk each, a multiple of 128).
pub fn wide_block_threads(d: usize) -> u32 {
    4 * row_block_threads(d)
}

/// Mixes then wide finish; `x`, `w`, `eps`, `out` already checked by `mhc_pre_with`.
pub(super) fn mhc_pre_wide(
    gpu: &Gpu,
    x: &CudaSlice<bf16>,
    w: &MhcWeights,
    eps: f32,
    out: &mut MhcPreOutputs,
) -> Result<()> {
    let (tokens, d) = (out.tokens, out.d);
    if d > WIDE_MAX_D {
        bail!(
            "mhc_pre (wide finish): hidden size {d} is above {WIDE_MAX_D} (the finish CTA would need {} \
             threads, at most 1024); use MhcPrePath::PdlPair or TwoLaunch",
            wide_block_threads(d)
        );
    }
    let pdl = tokens <= MHC_PDL_MAX_TOKENS;
    if pdl {
        let name = "mhc_mix_partial24_pdl";
        let f = gpu.function(FAMILY, name)?;
        let mut a = RawArgs::default();
        a.slice(gpu, x)
            .slice(gpu, &w.mix_fn)
            .slice(gpu, &out.partials)
            .i32(tokens as i32)
            .i32((4 * d) as i32);
        let grid = (mix_splits(d) as u32, tokens.div_ceil(32) as u32, 1);
        launch_pdl(gpu, &f, grid, (128, 1, 1), &mut a, name)?;
    } else {
        launch_mix_partial_v2(gpu, x, w, tokens, &mut out.partials)?;
    }

    let name = format!("mhc_pre_finish_wide_{}", out.normed.format.name());
    let f = gpu.function(WIDE_FAMILY, &name)?;
    // y = 0: pre, u, RMSNorm + quant; y = 1: post and the Sinkhorn, concurrently.
    let grid = (tokens as u32, 2, 1);
    let block = (wide_block_threads(d), 1, 1);
    let (s_i, t_i, d_i) = (mix_splits(d) as i32, tokens as i32, d as i32);
    if pdl {
        let mut a = RawArgs::default();
        a.slice(gpu, x)
            .slice(gpu, &out.partials)
            .i32(s_i)
            .i32(t_i)
            .i32(d_i)
            .slice(gpu, &w.scale)
            .slice(gpu, &w.base)
            .slice(gpu, &w.norm_weight)
            .f32(eps)
            .slice(gpu, &out.pre)
            .slice(gpu, &out.post)
            .slice(gpu, &out.comb)
            .slice(gpu, &out.u);
        match &out.normed.q {
            QuantBufs::Nvfp4 {
                data,
                scales,
                global_scale,
            } => {
                a.slice(gpu, data)
                    .slice(gpu, scales)
                    .slice(gpu, global_scale);
            }
            QuantBufs::Fp8 { data, scales } => {
                a.slice(gpu, data).slice(gpu, scales);
            }
            QuantBufs::Bf16 { y } => {
                a.slice(gpu, y);
            }
        }
        a.slice(gpu, &out.normed.rstd);
        launch_pdl(gpu, &f, grid, block, &mut a, &name)
    } else {
        let cfg = launch_cfg(grid, block, 0);
        let mut b = gpu.stream.launch_builder(&f);
        b.arg(x)
            .arg(&out.partials)
            .arg(&s_i)
            .arg(&t_i)
            .arg(&d_i)
            .arg(&w.scale)
            .arg(&w.base)
            .arg(&w.norm_weight);
        b.arg(&eps)
            .arg(&mut out.pre)
            .arg(&mut out.post)
            .arg(&mut out.comb)
            .arg(&mut out.u);
        match &mut out.normed.q {
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
        b.arg(&mut out.normed.rstd);
        drv(unsafe { b.launch(cfg) }, &name)?;
        Ok(())
    }
}
