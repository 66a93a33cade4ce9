//! The CPU reference of the head family: glue that reads the head's tensors out of the CPU model's
//! [`Weights`] and runs the model's own `Model::embed` / `Model::head_hidden` per token. No arithmetic lives here.

use anyhow::{ensure, Result};
use half::bf16;

use super::STREAMS;
use crate::model::reference::Model;
use crate::model::weights::Weights;

/// The head's device inputs, as the CPU model holds them (values of the stored dtypes, widened to f32).
pub struct HeadTensors {
    /// `embed.weight` `[vocab, D]` (BF16 values).
    pub embed: Vec<bf16>,
    /// `hc_head_fn` `[4, 4D]` f32.
    pub head_fn: Vec<f32>,
    pub scale: f32,
    pub base: [f32; 4],
    /// `norm.weight` `[D]` (BF16 values).
    pub norm_weight: Vec<f32>,
}

impl HeadTensors {
    /// Reads the head's tensors of `w` (the whole embedding table: use a small geometry in tests).
    pub fn read(w: &Weights) -> Result<HeadTensors> {
        let cfg = &w.config;
        ensure!(
            cfg.hc_mult == STREAMS,
            "head: hc_mult = {}, the kernels take {STREAMS} streams",
            cfg.hc_mult
        );
        let table = w.dequant_rows("embed.weight", 0, cfg.vocab_size)?;
        let base = w.vector("hc_head_base")?;
        Ok(HeadTensors {
            embed: table.data.iter().map(|&v| bf16::from_f32(v)).collect(),
            head_fn: w.vector("hc_head_fn")?,
            scale: w.vector("hc_head_scale")?[0],
            base: [base[0], base[1], base[2], base[3]],
            norm_weight: w.vector("norm.weight")?,
        })
    }
}

/// The residual streams `[T, 4, D]` the embedding writes for `ids`: `Model::embed` of each id, zeros for an id
/// < 0 (an empty row), `None` for a row the kernel leaves untouched (an id >= vocab).
pub fn embed_rows(model: &Model, ids: &[i32]) -> Result<Vec<Option<Vec<f32>>>> {
    let cfg = model.config();
    ids.iter()
        .map(|&id| {
            if id < 0 {
                Ok(Some(vec![0.0; cfg.hc_mult * cfg.dim]))
            } else if id as usize >= cfg.vocab_size {
                Ok(None)
            } else {
                model.embed(id as u32).map(Some)
            }
        })
        .collect()
}

/// `Model::head_hidden` of each token of `x` `[T, 4, D]`: the BF16 rows `[T, D]` the LM head reads.
pub fn head_hidden_rows(model: &Model, x: &[f32]) -> Result<Vec<f32>> {
    let cfg = model.config();
    let row = cfg.hc_mult * cfg.dim;
    ensure!(
        x.len().is_multiple_of(row),
        "head: x has {} values, not a multiple of 4D",
        x.len()
    );
    let mut out = Vec::with_capacity(x.len() / cfg.hc_mult);
    for t in x.chunks_exact(row) {
        out.extend(model.head_hidden(t)?);
    }
    Ok(out)
}
