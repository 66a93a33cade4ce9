//! Chunked prefill (docs/engine.md, "Chunked prefill"): a chunk of up to C prompt tokens of ONE sequence goes
//! through each layer as C rows of the layer halves ([`AttnHalf`] built with [`AttnHalf::new_rows`] over the decode
//! state's caches, [`FfnHalf`] at batch C), so every weight is read once per chunk instead of once per token. C is at
//! most [`PREFILL_CHUNK_MAX`] (1024); above 64 rows the halves take their long-chunk paths: the FP8 / BF16 dense
//! linears on cuBLASLt's tensor cores, the grouped wo_a as 64-row GEMV pieces, the shared expert's SwiGLU between
//! two tensor-core GEMMs, the routed experts through the contiguous grouping and moe_gemm's prefill mainloop.
//!
//! What makes C rows of one sequence work in halves written for one row per sequence:
//! * [`RowTables`]: every per-sequence table a half reads (ring base, compressed base / capacity, indexer key base
//!   / capacity, the indexer's key sequence) is indexed by row; a chunk's tables point every row at the sequence it
//!   prefills ([`PrefillState::tables`], rewritten when the sequence changes, outside any graph).
//! * The window ring is longer than the window (`LayerCachePlan::window_entries` >= window + C - 1), so the chunk's
//!   window entries can all be written before its attention.
//! * The indexer's logits take a key-sequence map (`indexer::logits_mapped`): the chunk's rows score the one
//!   sequence's keys, each up to its own visible count (causality: row at position q sees `(q + 1) / m` keys).
//! * The compressors run once per chunk (`attn::compress_chunk`, `compressor::chunk`): the chunk's entries, then the
//!   state as its real rows' decode steps leave it, continuing the sequence's state.
//! * The rows past the prompt's end in the last chunk are copies of its last real row (same token, same position):
//!   their window entry is the same bytes in the same slot, the compressors do not read them, their outputs are
//!   never read.
//!
//! Launches are eager: a chunk uploads its ids and positions and the host knows the real row count; the decode
//! step's graph is untouched. The prompt's last token is not part of a chunk: the first decode step runs it
//! (embedding, layers, head, sampling), as the token-by-token prefill does.

use crate::engine::attn::AttnHalf;
use crate::engine::cache::{KvPool, RowTables};
use crate::engine::ffn::FfnHalf;
use crate::engine::io::{group, LayerIo, StepMarks, StepShape};
use crate::engine::plan::PREFILL_CHUNK_MAX;
use crate::engine::weights::DeviceWeights;
use crate::gpu::arena::{self, Arena, WorkspaceLayout};
use crate::gpu::{DevBuf, Gpu, Stream};
use crate::model::ModelConfig;
use crate::ops::head::{self, EmbedShape};
use anyhow::{ensure, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

/// The default prefill chunk (`--prefill-chunk`): the longest ([`PREFILL_CHUNK_MAX`]). A chunk reads every
/// resident expert's weights and every dense weight once (wo_a once per 64 rows), so the fewer the chunks the fewer
/// the bytes; the tensor-core work is the same at any C.
pub const DEFAULT_PREFILL_CHUNK: usize = PREFILL_CHUNK_MAX;

/// Checks a prefill chunk size: 1 (token by token, the decode step's prompt path) ..= [`PREFILL_CHUNK_MAX`].
pub fn check_chunk(chunk: usize) -> Result<()> {
    ensure!(
        (1..=PREFILL_CHUNK_MAX).contains(&chunk),
        "--prefill-chunk {chunk}: chunks take 1..={PREFILL_CHUNK_MAX} rows (1 = token by token): every window ring \
         holds window + {} entries so that a chunk's entries fit beside the window (docs/engine.md, chunked prefill)",
        PREFILL_CHUNK_MAX - 1
    );
    Ok(())
}

/// The chunks of a prompt prefix of `len` tokens: `(first token, tokens)` of each, `chunk` tokens each but the
/// last (which holds the rest).
pub fn chunks(len: usize, chunk: usize) -> Vec<(usize, usize)> {
    assert!(chunk >= 1, "chunks of no token");
    (0..len)
        .step_by(chunk)
        .map(|start| (start, chunk.min(len - start)))
        .collect()
}

/// The ids and positions of a chunk's `rows` rows: the chunk's tokens `toks` at positions `pos0..`, then copies
/// of the last real row (same id, same position) up to `rows`.
pub fn chunk_rows(toks: &[u32], pos0: usize, rows: usize) -> Result<(Vec<i32>, Vec<i32>)> {
    let n = toks.len();
    ensure!(
        (1..=rows).contains(&n),
        "a chunk of {n} tokens in {rows} rows"
    );
    ensure!(
        pos0 + n <= i32::MAX as usize,
        "position {} exceeds i32",
        pos0 + n
    );
    let ids = (0..rows).map(|i| toks[i.min(n - 1)] as i32).collect();
    let pos = (0..rows).map(|i| (pos0 + i.min(n - 1)) as i32).collect();
    Ok((ids, pos))
}

/// The device state of chunked prefill: the halves at `rows` rows over a decode state's caches, the chunk's
/// residual, ids and positions, and the row tables of the sequence being prefilled.
pub struct PrefillState {
    pub config: ModelConfig,
    /// Rows of every chunk launch (C_max).
    pub rows: usize,
    /// BF16 `[rows, 4, D]`: the residual entering a layer / between its halves.
    pub x: CudaSlice<bf16>,
    pub x_mid: CudaSlice<bf16>,
    /// i32 `[rows]`: the chunk's positions and token ids (padded, [`chunk_rows`]).
    pub positions: CudaSlice<i32>,
    pub tokens: CudaSlice<i32>,
    pub arena: Arena,
    /// u32 `[1]`: set by the embedding when an id is outside the vocabulary.
    pub error: DevBuf<u32>,
    pub attn: AttnHalf,
    pub ffn: FfnHalf,
    /// Per layer: every row -> the sequence being prefilled.
    pub tables: Vec<RowTables>,
    /// Tokens a sequence holds (the decode state's context).
    context: usize,
    /// Events marking the kernel groups of a profiled chunk (`Engine::profile_prefill_chunk`); None otherwise.
    pub marks: Option<StepMarks>,
}

impl PrefillState {
    /// The arena of a state of `rows` rows over caches of `pool_batch` sequences of `context` tokens.
    pub fn layout(
        cfg: &ModelConfig,
        rows: usize,
        pool_batch: usize,
        context: usize,
        sm_count: usize,
    ) -> Result<WorkspaceLayout> {
        let shape = StepShape {
            batch: rows,
            context,
        };
        let mut l = WorkspaceLayout::new();
        l.add_bytes(AttnHalf::layout_rows(cfg, &shape, pool_batch, sm_count)?.bytes())
            .add_bytes(FfnHalf::layout(cfg, &shape, sm_count)?.bytes())
            .add::<u32>(1);
        Ok(l)
    }

    /// A state of `rows` (1..=[`PREFILL_CHUNK_MAX`]) rows over `caches` (a decode state's, `context` tokens a
    /// sequence), its tables pointing at sequence 0.
    pub fn new(
        gpu: &Gpu,
        weights: &DeviceWeights,
        caches: &KvPool,
        context: usize,
        rows: usize,
    ) -> Result<PrefillState> {
        let cfg = weights.plan.config.clone();
        check_chunk(rows)?;
        let shape = StepShape {
            batch: rows,
            context,
        };
        shape.check(&cfg)?;
        let pool_batch = caches.layers.first().map_or(1, |l| l.layout.batch).max(1);
        let sm_count = gpu.info.sm_count as usize;
        let bytes = Self::layout(&cfg, rows, pool_batch, context, sm_count)?.bytes();
        let mut arena = Arena::new(gpu, bytes)?;
        let attn = AttnHalf::new_rows(gpu, weights, &shape, pool_batch, &mut arena)?;
        let ffn = FfnHalf::new(gpu, weights, &shape, &mut arena)?;
        let error = arena.carve(1, "prefill embedding error word")?;
        let tables = caches
            .layers
            .iter()
            .map(|l| RowTables::upload(gpu, &l.layout, &vec![0; rows]))
            .collect::<Result<Vec<_>>>()?;
        gpu.synchronize()?;
        arena::fill(&gpu.stream, &error, 0)?;
        Ok(PrefillState {
            x: gpu.zeros(shape.residual_elems(&cfg))?,
            x_mid: gpu.zeros(shape.residual_elems(&cfg))?,
            positions: gpu.upload(&vec![-1i32; rows])?,
            tokens: gpu.zeros(rows)?,
            arena,
            error,
            attn,
            ffn,
            tables,
            context,
            rows,
            config: cfg,
            marks: None,
        })
    }

    /// Points every layer's row tables at sequence `seq` (a no-op when they already do). Host -> device on
    /// `stream`, outside any capture.
    pub fn set_sequence(&mut self, stream: &Stream, caches: &KvPool, seq: usize) -> Result<()> {
        let seqs = vec![seq; self.rows];
        for (t, l) in self.tables.iter_mut().zip(&caches.layers) {
            if t.seqs != seqs {
                t.rewrite(stream, &l.layout, &seqs)?;
            }
        }
        Ok(())
    }

    /// Runs the prompt tokens `toks` of sequence `seq` at positions `pos0..pos0 + toks.len()` (1..=`rows` tokens)
    /// through the embedding and every layer, writing the sequence's caches. Eager launches on `stream`. The
    /// chunk's last row's residual leaves in `x` (no head: the prompt's last token goes through a decode step).
    #[allow(clippy::too_many_arguments)]
    pub fn run_chunk(
        &mut self,
        gpu: &Gpu,
        stream: &Stream,
        weights: &DeviceWeights,
        caches: &KvPool,
        seq: usize,
        toks: &[u32],
        pos0: usize,
    ) -> Result<()> {
        let cfg = &self.config;
        ensure!(
            caches.layers.len() == cfg.n_layers && self.tables.len() == cfg.n_layers,
            "caches of {} layers for a model of {}",
            caches.layers.len(),
            cfg.n_layers
        );
        let (ids, pos) = chunk_rows(toks, pos0, self.rows)?;
        if let Some(&t) = toks.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            anyhow::bail!(
                "prompt token {t} is outside the vocabulary of {}",
                cfg.vocab_size
            );
        }
        let last = pos0 + toks.len() - 1;
        ensure!(
            last < self.context,
            "position {last} is outside the context of {}",
            self.context
        );
        for l in &caches.layers {
            l.layout.check_position(last)?;
        }
        self.set_sequence(stream, caches, seq)?;
        arena::upload(stream, &self.tokens, &ids)?;
        arena::upload(stream, &self.positions, &pos)?;
        let real = toks.len();
        let table = weights.typed::<bf16>("embed.weight")?;
        let shape = EmbedShape {
            tokens: self.rows,
            vocab: self.config.vocab_size,
            dim: self.config.dim,
        };
        if let Some(m) = &self.marks {
            m.mark(stream, "start")?;
        }
        head::embed_tokens(
            gpu,
            stream,
            &self.tokens,
            &table,
            &shape,
            &self.x,
            &self.error,
        )?;
        if let Some(m) = &self.marks {
            m.mark(stream, group::EMBED)?;
        }
        // Each half leaves its hc_post to the next half's hc_pre (one launch fewer a boundary where the mHC mixes
        // run on CUDA cores), except the last, whose output the head reads.
        let n_layers = caches.layers.len();
        for (layer, caches) in caches.layers.iter().enumerate() {
            let rows = &self.tables[layer];
            let attn_io = LayerIo {
                x_in: &self.x,
                x_out: &self.x_mid,
                positions: &self.positions,
                tokens: DevBuf::of(&self.tokens),
                caches,
                rows,
                chunk_rows: Some(real),
                marks: self.marks.as_ref(),
                prior_post: (layer > 0).then(|| self.ffn.pending_post(&self.x_mid)),
                defer_post: true,
            };
            self.attn.run(gpu, stream, weights, layer, &attn_io)?;
            let ffn_io = LayerIo {
                x_in: &self.x_mid,
                x_out: &self.x,
                prior_post: Some(self.attn.pending_post(&self.x)),
                defer_post: layer + 1 < n_layers,
                ..attn_io
            };
            self.ffn.run(gpu, stream, weights, layer, &ffn_io)?;
        }
        Ok(())
    }

    /// Fills the chunk's residuals and every intermediate output of both halves with 0xFF (NaN in BF16 / f32,
    /// -1 in i32), so a test sees what a chunk fails to write (the halves' `poison`; the caches are left alone).
    pub fn poison(&mut self, gpu: &Gpu) -> Result<()> {
        gpu.fill_bytes(&mut self.x, 0xFF)?;
        gpu.fill_bytes(&mut self.x_mid, 0xFF)?;
        self.attn.poison(gpu, &gpu.stream)?;
        self.ffn.poison(gpu)?;
        gpu.synchronize()
    }

    /// The error bits of the chunks run so far (waits for `stream`): `step::ERR_EMBED_ID` an id was outside the
    /// vocabulary, `step::ERR_CACHE_FULL` a compressor's entry fell outside its cache. Sticky.
    pub fn read_error(&self, stream: &Stream) -> Result<u32> {
        use crate::engine::step::{ERR_CACHE_FULL, ERR_EMBED_ID};
        let embed = arena::download(stream, &self.error)?[0];
        let attn = arena::download(stream, &self.attn.bufs.error)?[0];
        Ok(if embed != 0 { ERR_EMBED_ID } else { 0 } | if attn != 0 { ERR_CACHE_FULL } else { 0 })
    }
}
