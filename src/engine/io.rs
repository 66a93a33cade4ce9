//! The shape of a decode batch and what one half of a layer reads and writes besides its weights: the types the
//! step (`engine::step`) and the layer halves (`engine::attn`, `engine::ffn`) share.

use crate::engine::cache::{LayerCaches, RowTables};
use crate::gpu::DevBuf;
use crate::gpu::Stream;
use crate::model::ModelConfig;
use crate::ops::mhc::PriorPost;
use crate::ops::sampler::SamplerShape;
use anyhow::{ensure, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

/// mHC streams of the residual.
pub const STREAMS: usize = 4;
/// Capacity of each sequence's repetition-penalty ring (`SamplerConfig::penalty_window` default).
pub const PENALTY_RING: usize = 256;

/// The capacity a decode state is built for: `batch` sequences of at most `context` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepShape {
    pub batch: usize,
    pub context: usize,
}

impl StepShape {
    pub fn check(&self, cfg: &ModelConfig) -> Result<()> {
        ensure!(self.batch >= 1, "a decode step needs at least one sequence");
        ensure!(
            self.context >= 1,
            "a decode step needs a context of at least one token"
        );
        ensure!(
            self.batch * STREAMS * cfg.dim <= i32::MAX as usize,
            "batch {} x 4 x D {} exceeds the kernels' i32 indices",
            self.batch,
            cfg.dim
        );
        Ok(())
    }
    /// The sampler's shape for this step.
    pub fn sampler(&self, cfg: &ModelConfig) -> SamplerShape {
        SamplerShape {
            batch: self.batch,
            vocab: cfg.vocab_size,
            ring_cap: PENALTY_RING,
        }
    }
    /// Elements of the residual `x [B, 4, D]`.
    pub fn residual_elems(&self, cfg: &ModelConfig) -> usize {
        self.batch * STREAMS * cfg.dim
    }
}

/// Which residual buffer a parity hook reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residual {
    /// `x`: entering a layer (and the head), leaving its FFN half.
    Layer,
    /// `x_mid`: leaving a layer's attention half, entering its FFN half.
    Mid,
}

/// What one half of a layer reads and writes besides its weights and workspaces.
pub struct LayerIo<'a> {
    /// BF16 `[B, 4, D]`: the residual entering the half.
    pub x_in: &'a CudaSlice<bf16>,
    /// BF16 `[B, 4, D]`: the residual leaving it (a different buffer from `x_in`).
    pub x_out: &'a CudaSlice<bf16>,
    /// i32 `[B]`: the position of each sequence's token this step.
    pub positions: &'a CudaSlice<i32>,
    /// i32 `[B]`: the token ids embedded this step (the hash-routed layers' `tid2eid` rows).
    pub tokens: DevBuf<i32>,
    /// The layer's caches (the FFN half reads none).
    pub caches: &'a LayerCaches,
    /// Which sequence's caches each row reads and writes: the caches' identity tables for a decode batch, a
    /// prefill chunk's tables (every row one sequence) for a chunk.
    pub rows: &'a RowTables,
    /// `Some(n)`: the rows are one prefill chunk of one sequence (consecutive positions, `rows.seqs` all that
    /// sequence) whose first `n` rows are real and the rest copies of row `n - 1` (same token and position): the
    /// compressors run over the `n` real rows in one chunk launch (`compressor::chunk`), the indexer's rows score that
    /// sequence's keys. `None`:
    /// a decode batch (row `b` = sequence `b`).
    pub chunk_rows: Option<usize>,
    /// Where a profiled step records an event after each group of kernels (`None`: not profiled).
    pub marks: Option<&'a StepMarks>,
    /// `Some`: the sub-layer before this half left its hc_post to this half's hc_pre, which writes `x_in` as
    /// `post (x) y + comb^T x_prev` before it mixes it (`mhc::PriorPost`: one launch fewer a boundary). `None`:
    /// `x_in` holds the residual.
    pub prior_post: Option<PriorPost>,
    /// This half leaves its own hc_post to the next half's hc_pre: it does not write `x_out`.
    pub defer_post: bool,
}

impl LayerIo<'_> {
    /// Records the end of the kernel group `what` when the step is profiled (an event record: captured into the
    /// graph as a node, so the profile is of graph replay, not of eager launches).
    pub fn mark(&self, stream: &Stream, what: &'static str) -> Result<()> {
        match self.marks {
            Some(m) => m.mark(stream, what),
            None => Ok(()),
        }
    }
}

/// The names of the kernel groups a profiled step marks ([`StepMarks`]), in step order. In a whole step the halves
/// are linked: each hc_post runs inside the next half's hc_pre group (the last layer's in its own group).
pub mod group {
    pub const EMBED: &str = "embed";
    pub const ATTN_HC_PRE: &str = "attn: (hc_post +) hc_pre + attn_norm + FP8 a";
    pub const ATTN_PROJECTIONS: &str =
        "attn: projections (wq_a, wkv, wq_b, BF16 linears, q/kv/indexer prep)";
    pub const ATTN_COMPRESSORS: &str = "attn: compressor state updates";
    pub const ATTN_INDEXER: &str = "attn: indexer logits + top-k";
    pub const ATTN_SPARSE: &str = "attn: candidates + sparse attention";
    pub const ATTN_OUTPUT: &str = "attn: wo_a, wo_b (hc_post unlinked)";
    pub const FFN_HC_PRE: &str = "ffn: (hc_post +) hc_pre + ffn_norm + FP8/NVFP4 f";
    pub const FFN_ROUTER: &str = "ffn: router";
    pub const FFN_SHARED: &str = "ffn: shared expert";
    pub const FFN_ROUTED: &str = "ffn: routed experts (L1, L2 + combine)";
    pub const FFN_HC_POST: &str = "ffn: hc_post (unlinked: the last layer)";
    pub const HEAD: &str = "head (final norm, LM head)";
    pub const SAMPLER: &str = "sampler";
}

/// The events of a profiled step: one after each group of kernels, in stream order, each with the group's name
/// (the time of a group is the time between its event and the one before it).
pub type StepMarks = crate::gpu::marks::EventMarks;
