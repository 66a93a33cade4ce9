//! Expert parallelism's device pieces (kernels/ep_combine.cu; docs/multi-gpu.md): the L2 finish that leaves a rank's
//! routed sum in f32 ([`finish_l2_partial`]) and the rank-ordered combine of the W ranks' partials with the shared
//! expert's output ([`combine`]). No communication lives here: the partials of the other ranks arrive by an
//! all-gather (`dist::comm`) into the `[W, B D]` buffer [`combine`] reads.
//!
//! Both are graph-safe: grids come from the shapes, no host sync.

use anyhow::{ensure, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

use crate::gpu::launch::{launch, DeviceBuf, KernelArgs, Launch, Stream};
use crate::gpu::Gpu;
use crate::ops::moe_gemm::{DeviceActivations, DeviceExpertWeights, DeviceGrouping, Workspace};

/// Kernel family name (kernels/ep_combine.cu).
pub const FAMILY: &str = "ep_combine";

/// Most top-k rows per token [`finish_l2_partial`] resolves (`kEpMaxTopk` in the kernel).
pub const EP_MAX_TOPK: usize = 32;

const THREADS: u32 = 256;

/// moe_gemm's L2 epilogue without the addend and without the BF16 rounding: `out[t, n] = sum_j acc(rows[t, j], n) *
/// (gsa * gsb)` in f32, in routing order, with the fp32 operations of `moe_gemm::launch_finish_l2` (its
/// `FinishL2Kernel::RowWarps` kernel, to which the others are bit-identical), so `bf16(out)` is `launch_finish_l2`'s
/// output without an addend and `bf16(out + addend)` its output with one, bit for bit. A pair whose row is `-1` in
/// `token_rows` (under expert parallelism: a pair another rank computes) adds nothing; a token with no owned pair
/// gets `+0.0`. `out` is f32 `[tokens, N]`, `tokens = token_rows.len() / topk`.
#[allow(clippy::too_many_arguments)]
pub fn finish_l2_partial(
    gpu: &Gpu,
    stream: &Stream,
    ws: &Workspace,
    grp: &DeviceGrouping,
    w2: &DeviceExpertWeights,
    a: &DeviceActivations,
    token_rows: &CudaSlice<i32>,
    topk: usize,
    out: &dyn DeviceBuf<f32>,
) -> Result<()> {
    crate::ops::moe_gemm::finish::check_finish(ws, grp, w2)?;
    ensure!(
        (1..=EP_MAX_TOPK).contains(&topk),
        "ep L2 partial: topk = {topk} outside 1..={EP_MAX_TOPK}"
    );
    let tokens = crate::ops::moe_gemm::finish::l2_tokens(
        "ep L2 partial",
        token_rows.len(),
        topk,
        out.elems(),
        w2.n,
    )?;
    ensure!(
        grp.rows_total <= i32::MAX as usize && tokens <= u32::MAX as usize,
        "ep L2 partial: {} rows / {tokens} tokens exceed the kernel's indices",
        grp.rows_total
    );
    if tokens == 0 {
        return Ok(());
    }
    let gsa = match a {
        DeviceActivations::Bf16 { .. } => 0,
        DeviceActivations::Nvfp4 { global, .. } => {
            ensure!(
                global.len() >= grp.rows_total,
                "ep L2 partial: {} activation row scales for {} rows",
                global.len(),
                grp.rows_total
            );
            global.device_addr()
        }
    };
    let kern = gpu.kernel(FAMILY, "ep_finish_l2_partial")?;
    let mut args = KernelArgs::new();
    args.buf(&ws.partial)
        .i32(ws.splits as i32)
        .buf(&grp.group)
        .i32(grp.capacity as i32)
        .i32(grp.experts as i32)
        .i32(grp.rows_total as i32)
        .i32(w2.n as i32)
        .u64(gsa)
        .buf(&w2.global)
        .buf(token_rows)
        .i32(topk as i32)
        .u64(out.device_addr());
    let grid = (tokens as u32, w2.n.div_ceil(THREADS as usize) as u32, 1);
    // SAFETY: arguments in the kernel's order; partials, token_rows and the output were checked against the shape;
    // the grouping's rows are clamped on the device.
    unsafe { launch(stream, &kern, Launch::new(grid, (THREADS, 1, 1)), &mut args) }
}

/// The combine: `out[i] = bf16(((p_0[i] + p_1[i]) + ... + p_{W-1}[i]) + shared[i])`, ranks ascending, one rounding
/// (`engine::ep::combine_partials` is its CPU twin). `partials` is f32 `[world, elems]` (rank r's partial at
/// `r * elems`); `shared` the shared expert's BF16 `[elems]` (none: nothing added); `out` BF16 `[elems]`. Every rank
/// that holds the same partials writes the same bits; with `world == 1` the result is `moe_gemm::launch_finish_l2`'s
/// with the shared expert as addend, bit for bit.
pub fn combine(
    gpu: &Gpu,
    stream: &Stream,
    partials: &dyn DeviceBuf<f32>,
    world: usize,
    elems: usize,
    shared: Option<&dyn DeviceBuf<bf16>>,
    out: &dyn DeviceBuf<bf16>,
) -> Result<()> {
    ensure!(world >= 1, "ep combine: world size 0");
    ensure!(
        world <= i32::MAX as usize && elems <= i64::MAX as usize,
        "ep combine: {world} ranks of {elems} elements exceed the kernel's indices"
    );
    ensure!(
        partials.elems() >= world * elems,
        "ep combine: the partials hold {} values, {world} ranks x {elems} needed",
        partials.elems()
    );
    if let Some(s) = shared {
        ensure!(
            s.elems() >= elems,
            "ep combine: the shared expert's output has {} values, {elems} needed",
            s.elems()
        );
    }
    ensure!(
        out.elems() >= elems,
        "ep combine: the output has {} values, {elems} needed",
        out.elems()
    );
    if elems == 0 {
        return Ok(());
    }
    let kern = gpu.kernel(FAMILY, "ep_combine")?;
    let mut args = KernelArgs::new();
    args.u64(partials.device_addr())
        .i32(world as i32)
        .u64(elems as u64)
        .u64(shared.map_or(0, |s| s.device_addr()))
        .u64(out.device_addr());
    let blocks = elems.div_ceil(THREADS as usize).min(4096) as u32;
    // SAFETY: arguments in the kernel's order (elems as a 64-bit integer); every buffer was checked to hold what the
    // grid-stride loop reads or writes.
    unsafe {
        launch(
            stream,
            &kern,
            Launch::new((blocks, 1, 1), (THREADS, 1, 1)),
            &mut args,
        )
    }
}
