//! Expert parallelism's combine (kernels/ep_combine.cu; docs/multi-gpu.md): the rank-ordered sum of the W ranks'
//! f32 partials (each rank's from `moe_gemm::finish::launch_finish_l2_partial`) with the shared expert's output
//! ([`combine`]). No communication lives here: the partials of the other ranks arrive by an
//! all-gather (`dist::comm`) into the `[W, B D]` buffer [`combine`] reads.
//!
//! Graph-safe: the grid comes from the shapes, no host sync.

use anyhow::{ensure, Result};
use half::bf16;

use crate::gpu::launch::{launch, DeviceBuf, KernelArgs, Launch, Stream};
use crate::gpu::Gpu;

/// Kernel family name (kernels/ep_combine.cu).
pub const FAMILY: &str = "ep_combine";

const THREADS: u32 = 256;

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
