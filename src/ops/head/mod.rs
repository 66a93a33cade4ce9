//! The model's two ends around the layer stack on the GPU (kernels/head.cu):
//!
//! * [`embed_tokens`]: token ids (a DEVICE buffer: the sampler's `next` ids feed the next step with no host
//!   round trip) -> the 4 mHC residual streams `X [T, 4, D]` BF16, each the id's `embed.weight` row (the CPU
//!   model's `Model::embed`). An id < 0 is an empty row (written as zeros); an id >= vocab writes nothing and
//!   sets [`ERR_OOV_ID`] in the device error word (sticky: the caller clears it).
//! * [`final_norm`]: `hc_head` of the 4 streams + RMSNorm(`norm.weight`) -> the BF16 row the LM head reads
//!   (`Model::head_hidden`, i.e. `Model::head` without the LM head matvec). The math is mHC's
//!   [`hc_head`](crate::ops::mhc::hc_head) (kernels `mhc_mix_partial4` + `mhc_head_finish_bf16`), reused as is.
//!
//! Graph-safe: grids come from the shape (T, D), the ids and the error word stay on the device, and nothing on
//! the host reads a result.
//!
//! Rooms: `reference.rs` (glue to the CPU model), `bench.rs` (measurement hooks), `exec.rs` (`megamoe exec`).

pub mod bench;
pub mod exec;
pub mod reference;

pub use exec::exec_kernels;

use anyhow::{ensure, Result};
use half::bf16;

use crate::gpu::launch::{launch, DeviceBuf, KernelArgs, Launch, Stream};
use crate::gpu::Gpu;
use crate::ops::mhc::{hc_head, MhcPreOutputs, MhcWeights, MhcWorkspace};

/// Kernel family name (kernels/head.cu).
pub const FAMILY: &str = "head";
/// The mHC residual streams (`hc_mult`).
pub const STREAMS: usize = 4;
/// Bit of the device error word: an id >= vocab was seen (`HEAD_ERR_OOV_ID`).
pub const ERR_OOV_ID: u32 = 1;
/// Threads of an embedding CTA; each copies one 16-byte chunk (8 BF16) of the row to the 4 streams.
const EMBED_THREADS: usize = 256;

/// The sizes of one embedding call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbedShape {
    /// Rows (token slots) of the call: the ids buffer holds at least this many.
    pub tokens: usize,
    pub vocab: usize,
    pub dim: usize,
}

impl EmbedShape {
    /// `1 <= T <= 2^31 - 1`, `1 <= vocab <= 2^31 - 1`, `D` a positive multiple of 8 (16-byte rows), every index an i32.
    pub fn check(&self) -> Result<()> {
        let EmbedShape { tokens, vocab, dim } = *self;
        ensure!(
            (1..=i32::MAX as usize).contains(&tokens),
            "head embed: {tokens} tokens (1..=2^31-1)"
        );
        ensure!(
            (1..=i32::MAX as usize).contains(&vocab),
            "head embed: vocab = {vocab}"
        );
        ensure!(
            dim > 0 && dim.is_multiple_of(8),
            "head embed: D = {dim} must be a positive multiple of 8 (16-byte rows)"
        );
        ensure!(
            (tokens as u128) * (STREAMS * dim) as u128 <= i64::MAX as u128
                && (vocab as u128) * (dim as u128) <= i64::MAX as u128,
            "head embed: {tokens} x {vocab} x {dim} overflows the kernel's index"
        );
        Ok(())
    }
}

fn check_len<T>(b: &impl DeviceBuf<T>, need: usize, what: &str) -> Result<()> {
    ensure!(
        b.elems() >= need,
        "head: {what} has {} elements, needs {need}",
        b.elems()
    );
    Ok(())
}

/// `x[t, s, :] = table[ids[t], :]` for the 4 streams s, t < `shape.tokens` (one launch, grid
/// `(T, ceil(D / 8 / 256))`). `ids` i32 `[T]`, `table` BF16 `[vocab, D]`, `x` BF16 `[T, 4, D]`, `error` u32 `[1]`.
pub fn embed_tokens(
    gpu: &Gpu,
    stream: &Stream,
    ids: &impl DeviceBuf<i32>,
    table: &impl DeviceBuf<bf16>,
    shape: &EmbedShape,
    x: &impl DeviceBuf<bf16>,
    error: &impl DeviceBuf<u32>,
) -> Result<()> {
    shape.check()?;
    let EmbedShape { tokens, vocab, dim } = *shape;
    check_len(ids, tokens, "ids [T]")?;
    check_len(table, vocab * dim, "embed.weight [vocab, D]")?;
    check_len(x, tokens * STREAMS * dim, "x [T, 4, D]")?;
    check_len(error, 1, "error word")?;
    ensure!(
        table.device_addr() % 16 == 0 && x.device_addr() % 16 == 0,
        "head embed: the table and x must be 16-byte aligned (vector loads and stores)"
    );
    let k = gpu.kernel(FAMILY, "head_embed")?;
    let mut a = KernelArgs::new();
    a.buf(ids)
        .i32(tokens as i32)
        .buf(table)
        .i32(vocab as i32)
        .i32(dim as i32)
        .buf(x)
        .buf(error);
    let grid = (tokens as u32, (dim / 8).div_ceil(EMBED_THREADS) as u32, 1);
    // SAFETY: arguments in the kernel's order (ids, T, table, vocab, D, x, error); every buffer was checked
    // against the shape, the table and x are 16-byte aligned and D % 8 == 0, so every 16-byte access is aligned
    // and in bounds (the kernel reads ids[t] only for t < T and rows id < vocab).
    unsafe {
        launch(
            stream,
            &k,
            Launch::new(grid, (EMBED_THREADS as u32, 1, 1)),
            &mut a,
        )
    }
}

/// The final `hc_head` + RMSNorm(`norm.weight`) of `out.tokens` tokens: `out.normed` (BF16 `[T, D]`) is the row the
/// LM head reads; `out.pre` / `out.u` hold the 4 head mixes and the BF16 pre-norm row. `x` is `[T, 4, D]`;
/// `w` from [`MhcWeights::upload_head`] (`hc_head_fn`, `hc_head_scale`, `hc_head_base`, `norm.weight`); `eps` the
/// model's `norm_eps` (`hc_eps` is the kernel's 1e-6, DSV4's value). Delegates to [`hc_head`] (same checks).
pub fn final_norm(
    gpu: &Gpu,
    stream: &Stream,
    x: &impl DeviceBuf<bf16>,
    w: &MhcWeights,
    eps: f32,
    ws: &MhcWorkspace,
    out: &mut MhcPreOutputs,
) -> Result<()> {
    hc_head(gpu, stream, x, w, eps, ws, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_checks_reject_bad_dims() {
        let ok = EmbedShape {
            tokens: 1,
            vocab: 129_280,
            dim: 4096,
        };
        assert!(ok.check().is_ok());
        assert!(EmbedShape { dim: 4092, ..ok }.check().is_err());
        assert!(EmbedShape { tokens: 0, ..ok }.check().is_err());
        assert!(EmbedShape { vocab: 0, ..ok }.check().is_err());
    }
}
