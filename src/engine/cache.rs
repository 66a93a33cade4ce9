//! The KV cache pool of a decode batch: per layer, one pool of 584-byte entries (`formats::kv`) holding every
//! sequence's window ring and compressed entries, the CSA indexer key cache, and the compressor states, sized by
//! [`LayerCachePlan`].
//!
//! Layout of layer `l` for `batch` sequences (all host arithmetic in [`LayerCacheLayout`], the device buffers in
//! [`LayerCaches`]):
//!
//! * KV pool, `batch x (window_entries + compressed_entries)` entries: sequence `b` owns the block starting at
//!   `b x per_seq`; its window ring first (position `p` at `window_base(b) + p mod window_entries`, the rule of
//!   `qkv_prep::kv_entries`), then its compressed entries (entry `j` at `compressed_base(b) + j`, the rule of
//!   `compressor::EntrySlots` with `capacity = compressed_entries`). `sparse_attn::decode` reads candidates as pool
//!   indices, so one pool per layer serves every sequence.
//! * Indexer keys (CSA), `batch x index_keys` rows of each plane (`indexer::KeyCacheGpu`'s `[batch, capacity]`):
//!   key `j` of sequence `b` at `b x index_keys + j`.
//! * Compressor states, f32 `[batch, compressor_floats]` (kv rows then score rows, `compressor::reference::
//!   host_state`), and the indexer compressor's `[batch, index_compressor_floats]`.
//!
//! The window ring holds `min(context, window_size + PREFILL_CHUNK_MAX - 1)` entries (`LayerCachePlan::
//! window_entries`), more than the attention window (`LayerCachePlan::window`) so that a prefill chunk can write all
//! its window entries before its attention: with a context no longer than the ring, the ring never wraps, since
//! positions stay below `context`.
//!
//! Every per-sequence table a layer half reads (the window ring's base, the compressed entries' base and capacity,
//! the indexer keys' base and capacity, the key sequence of the indexer's logits) is indexed by the half's row,
//! not by the sequence: [`RowTables`]. The decode batch's tables are the identity (row `b` = sequence `b`,
//! [`LayerCaches::rows`]); a prefill chunk's tables point every row at the one sequence it prefills.

use crate::engine::plan::{IndexKeyFormat, LayerCachePlan};
use crate::formats::kv;
use crate::gpu::arena;
use crate::gpu::{Gpu, Stream};
use crate::model::reference::CompressorState;
use crate::model::{LayerKind, ModelConfig};
use crate::ops::compressor::reference::host_state;
use crate::ops::indexer::{KeyCacheGpu, KeyFormat};
use anyhow::{bail, ensure, Result};
use cudarc::driver::CudaSlice;

/// The indexer's key format for a plan's.
pub fn key_format(f: IndexKeyFormat) -> KeyFormat {
    match f {
        IndexKeyFormat::Fp8 => KeyFormat::Fp8,
        IndexKeyFormat::Mxfp4 => KeyFormat::Mxfp4,
    }
}

/// Where one layer's caches of each sequence live (see the module docs). Pure host arithmetic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerCacheLayout {
    pub plan: LayerCachePlan,
    pub batch: usize,
}

impl LayerCacheLayout {
    /// Pool entries one sequence owns: its window ring, then its compressed entries.
    pub fn per_seq(&self) -> usize {
        self.plan.window_entries + self.plan.compressed_entries
    }
    /// Entries of the layer's pool.
    pub fn n_entries(&self) -> usize {
        self.batch * self.per_seq()
    }
    /// Pool index of ring slot 0 of sequence `b` (`qkv_prep::WindowRing::seq_base`).
    pub fn window_base(&self, b: usize) -> usize {
        b * self.per_seq()
    }
    /// Pool index of the window entry of position `pos` of sequence `b`.
    pub fn window_slot(&self, b: usize, pos: usize) -> usize {
        self.window_base(b) + pos % self.plan.window_entries
    }
    /// Pool index of compressed entry 0 of sequence `b` (`compressor::EntrySlots::base`).
    pub fn compressed_base(&self, b: usize) -> usize {
        self.window_base(b) + self.plan.window_entries
    }
    /// Pool index of compressed entry `j` of sequence `b`.
    pub fn compressed_slot(&self, b: usize, j: usize) -> usize {
        self.compressed_base(b) + j
    }
    /// Row of indexer key `j` of sequence `b` in the key planes (`EntrySlots::base` of the indexer compressor is
    /// `b x index_keys`).
    pub fn key_slot(&self, b: usize, j: usize) -> usize {
        b * self.plan.index_keys + j
    }
    /// The compression ratio (0 for sliding-window layers).
    pub fn ratio(&self) -> usize {
        match self.plan.kind {
            LayerKind::SlidingWindow => 0,
            LayerKind::Csa { ratio } | LayerKind::Hca { ratio } => ratio,
        }
    }
    /// Compressed entries a sequence holds once position `pos` has been processed (the compressor emits an entry
    /// after every `ratio`-th token: `(pos + 1) / ratio`).
    pub fn compressed_after(&self, pos: usize) -> usize {
        match self.ratio() {
            0 => 0,
            r => (pos + 1) / r,
        }
    }
    /// Pool indices of the window candidates of the query at `pos` of sequence `b`, oldest first: positions
    /// `max(0, pos + 1 - window) ..= pos` (`Model::window_positions`) in their ring slots (`pos mod
    /// window_entries`; the ring is at least as long as the window).
    pub fn window_candidates(&self, b: usize, pos: usize) -> Vec<i32> {
        let w = self.plan.window;
        (pos.saturating_sub(w - 1)..=pos)
            .map(|p| self.window_slot(b, p) as i32)
            .collect()
    }
    /// The full candidate list of the query at `pos` of sequence `b` as `sparse_attn::decode` reads it: the
    /// window candidates, then compressed entries `selected` (indices into the sequence's compressed entries:
    /// the indexer's top-k for CSA, `0..compressed_after(pos)` for HCA).
    pub fn candidates(&self, b: usize, pos: usize, selected: &[usize]) -> Vec<i32> {
        let mut c = self.window_candidates(b, pos);
        c.extend(selected.iter().map(|&j| self.compressed_slot(b, j) as i32));
        c
    }
    /// The candidate rows of a batch as `sparse_attn::decode` reads them: `[batch, stride]` pool indices (row `b`
    /// = [`candidates`](Self::candidates) of `positions[b]` and `selected[b]`, the rest of the row -1) and the
    /// lengths `[batch]`; a sequence with a negative position gets length 0. What the device's candidate builder
    /// must write (the parity hook's input until it exists).
    pub fn candidate_rows(
        &self,
        positions: &[i32],
        selected: &[Vec<usize>],
        stride: usize,
    ) -> Result<(Vec<i32>, Vec<i32>)> {
        ensure!(
            positions.len() == self.batch,
            "{} positions for a batch of {}",
            positions.len(),
            self.batch
        );
        let seqs: Vec<usize> = (0..self.batch).collect();
        self.row_candidate_rows(&seqs, positions, selected, stride)
    }
    /// [`candidate_rows`](Self::candidate_rows) of rows that read sequences `seqs` (row `i` = the query of
    /// sequence `seqs[i]` at `positions[i]`): what `attn_candidates` writes with [`RowTables`] of `seqs` (a prefill
    /// chunk: every row one sequence, consecutive positions).
    pub fn row_candidate_rows(
        &self,
        seqs: &[usize],
        positions: &[i32],
        selected: &[Vec<usize>],
        stride: usize,
    ) -> Result<(Vec<i32>, Vec<i32>)> {
        let n = seqs.len();
        ensure!(
            positions.len() == n && selected.len() == n,
            "{} positions and {} selections for {n} rows",
            positions.len(),
            selected.len()
        );
        let mut rows = vec![-1i32; n * stride];
        let mut lengths = vec![0i32; n];
        for (r, ((&p, sel), &b)) in positions.iter().zip(selected).zip(seqs).enumerate() {
            if p < 0 {
                continue;
            }
            ensure!(
                b < self.batch,
                "row {r} reads sequence {b} of {}",
                self.batch
            );
            let c = self.candidates(b, p as usize, sel);
            ensure!(
                c.len() <= stride,
                "row {r} at position {p} has {} candidates, the stride is {stride}",
                c.len()
            );
            rows[r * stride..][..c.len()].copy_from_slice(&c);
            lengths[r] = c.len() as i32;
        }
        Ok((rows, lengths))
    }
    /// The row tables of rows that read sequences `seqs` (row `i` -> sequence `seqs[i]`): what [`RowTables`]
    /// uploads. The identity `0..batch` is the decode batch's; `[s; C]` a prefill chunk of sequence `s`.
    pub fn row_tables(&self, seqs: &[usize]) -> Result<HostRowTables> {
        ensure!(!seqs.is_empty(), "row tables of no rows");
        if let Some(&s) = seqs.iter().find(|&&s| s >= self.batch) {
            bail!("row of sequence {s} in caches of {} sequences", self.batch);
        }
        let _ = to_i32([self.n_entries(), self.batch * self.plan.index_keys])?;
        let col = |f: &dyn Fn(usize) -> usize| seqs.iter().map(|&s| f(s) as i32).collect();
        Ok(HostRowTables {
            window_base: col(&|s| self.window_base(s)),
            compressed_base: col(&|s| self.compressed_base(s)),
            compressed_capacity: col(&|_| self.plan.compressed_entries),
            key_base: col(&|s| self.key_slot(s, 0)),
            key_capacity: col(&|_| self.plan.index_keys),
            key_seq: col(&|s| s),
        })
    }
    /// Checks a sequence's position fits the layer's capacity (a compressed entry emitted at `pos` must have a
    /// slot).
    pub fn check_position(&self, pos: usize) -> Result<()> {
        ensure!(
            self.compressed_after(pos) <= self.plan.compressed_entries,
            "position {pos} needs {} compressed entries, the cache holds {}",
            self.compressed_after(pos),
            self.plan.compressed_entries
        );
        Ok(())
    }
}

/// The per-row tables of one layer on the host ([`LayerCacheLayout::row_tables`]), each `[rows]` i32.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostRowTables {
    /// `window_base(seq)`: the ring's slot 0 (`qkv_prep::WindowRing::seq_base`, `attn_candidates`).
    pub window_base: Vec<i32>,
    /// `compressed_base(seq)` and `compressed_entries` (`compressor::EntrySlots` of the main compressor).
    pub compressed_base: Vec<i32>,
    pub compressed_capacity: Vec<i32>,
    /// `key_slot(seq, 0)` and `index_keys` (`EntrySlots` of the indexer compressor).
    pub key_base: Vec<i32>,
    pub key_capacity: Vec<i32>,
    /// The sequence whose indexer keys the row's query scores (`indexer::logits_mapped`'s `key_seq`).
    pub key_seq: Vec<i32>,
}

/// The per-row tables of one layer on the device (module docs): row `i` of a half reads the caches of sequence
/// `seqs[i]`. Uploaded outside any graph; a captured half reads them by address.
pub struct RowTables {
    /// The sequence of each row (host copy of what the tables encode).
    pub seqs: Vec<usize>,
    pub window_base: CudaSlice<i32>,
    pub compressed_base: CudaSlice<i32>,
    pub compressed_capacity: CudaSlice<i32>,
    pub key_base: CudaSlice<i32>,
    pub key_capacity: CudaSlice<i32>,
    pub key_seq: CudaSlice<i32>,
}

impl RowTables {
    /// The tables of rows reading `seqs` in caches of `layout`.
    pub fn upload(gpu: &Gpu, layout: &LayerCacheLayout, seqs: &[usize]) -> Result<RowTables> {
        let h = layout.row_tables(seqs)?;
        Ok(RowTables {
            seqs: seqs.to_vec(),
            window_base: gpu.upload(&h.window_base)?,
            compressed_base: gpu.upload(&h.compressed_base)?,
            compressed_capacity: gpu.upload(&h.compressed_capacity)?,
            key_base: gpu.upload(&h.key_base)?,
            key_capacity: gpu.upload(&h.key_capacity)?,
            key_seq: gpu.upload(&h.key_seq)?,
        })
    }
    /// Points the same rows at `seqs` (as many as before; host -> device on `stream`, outside any capture).
    pub fn rewrite(
        &mut self,
        stream: &Stream,
        layout: &LayerCacheLayout,
        seqs: &[usize],
    ) -> Result<()> {
        ensure!(
            seqs.len() == self.seqs.len(),
            "row tables of {} rows rewritten with {}",
            self.seqs.len(),
            seqs.len()
        );
        let h = layout.row_tables(seqs)?;
        for (d, v) in [
            (&self.window_base, &h.window_base),
            (&self.compressed_base, &h.compressed_base),
            (&self.compressed_capacity, &h.compressed_capacity),
            (&self.key_base, &h.key_base),
            (&self.key_capacity, &h.key_capacity),
            (&self.key_seq, &h.key_seq),
        ] {
            arena::upload(stream, d, v)?;
        }
        self.seqs = seqs.to_vec();
        Ok(())
    }
    /// Rows of the tables.
    pub fn rows(&self) -> usize {
        self.seqs.len()
    }
    /// The one sequence every row reads, if they all read one (a prefill chunk; also a decode batch of one).
    pub fn single_sequence(&self) -> Option<usize> {
        let s = *self.seqs.first()?;
        self.seqs.iter().all(|&t| t == s).then_some(s)
    }
}

/// The device caches of one layer for the whole batch (layout in [`LayerCacheLayout`]).
pub struct LayerCaches {
    pub layout: LayerCacheLayout,
    /// KV pool, `n_entries x 584` bytes.
    pub pool: CudaSlice<u8>,
    /// f32 `[batch, compressor_floats]` (empty for sliding-window layers).
    pub state: CudaSlice<f32>,
    /// CSA only: the indexer key cache and its compressor state.
    pub index: Option<IndexCaches>,
    /// The decode batch's row tables: the identity (row `b` reads sequence `b`).
    pub rows: RowTables,
}

/// The CSA indexer's caches of one layer.
pub struct IndexCaches {
    pub keys: KeyCacheGpu,
    pub state: CudaSlice<f32>,
}

/// The caches of every layer.
pub struct KvPool {
    pub layers: Vec<LayerCaches>,
}

/// Initial compressor state of one sequence (kv zeros, scores -inf), repeated `batch` times.
fn initial_states(ratio: usize, overlap: bool, dim: usize, batch: usize) -> Vec<f32> {
    let one = host_state(&CompressorState::new(ratio, overlap, dim));
    one.repeat(batch)
}

fn to_i32(v: impl IntoIterator<Item = usize>) -> Result<Vec<i32>> {
    v.into_iter()
        .map(|x| i32::try_from(x).map_err(|_| anyhow::anyhow!("cache index {x} exceeds i32")))
        .collect()
}

impl KvPool {
    /// Allocates the caches of `batch` sequences per `plans` (one per layer, from `MemoryPlan::cache_layers`),
    /// every KV entry zeroed and every compressor state empty.
    pub fn new(
        gpu: &Gpu,
        cfg: &ModelConfig,
        plans: &[LayerCachePlan],
        batch: usize,
        keys: IndexKeyFormat,
    ) -> Result<KvPool> {
        ensure!(batch >= 1, "a decode batch needs at least one sequence");
        ensure!(
            plans.len() == cfg.n_layers,
            "{} cache plans for {} layers",
            plans.len(),
            cfg.n_layers
        );
        let mut layers = Vec::with_capacity(plans.len());
        for plan in plans {
            let layout = LayerCacheLayout { plan: *plan, batch };
            ensure!(
                plan.window_entries >= 1,
                "a layer needs a window of at least one entry"
            );
            ensure!(
                plan.window_entries >= plan.window,
                "a ring of {} entries for a window of {}",
                plan.window_entries,
                plan.window
            );
            let _ = to_i32([layout.n_entries()])?;
            let seqs: Vec<usize> = (0..batch).collect();
            let rows = RowTables::upload(gpu, &layout, &seqs)?;
            let state = match plan.kind {
                LayerKind::SlidingWindow => gpu.zeros(1)?,
                LayerKind::Csa { ratio } | LayerKind::Hca { ratio } => {
                    let overlap = matches!(plan.kind, LayerKind::Csa { .. });
                    let st = initial_states(ratio, overlap, cfg.head_dim, batch);
                    ensure!(
                        st.len() == batch * plan.compressor_floats,
                        "compressor state of {} floats, the plan says {}",
                        st.len() / batch,
                        plan.compressor_floats
                    );
                    gpu.upload(&st)?
                }
            };
            let index = match plan.kind {
                LayerKind::Csa { ratio } if plan.index_keys > 0 => {
                    let format = key_format(keys);
                    let rows = batch * plan.index_keys;
                    let st = initial_states(ratio, true, cfg.index_head_dim, batch);
                    Some(IndexCaches {
                        keys: KeyCacheGpu {
                            format,
                            batch,
                            capacity: plan.index_keys,
                            codes: gpu.zeros(rows * format.code_bytes())?,
                            scales: gpu
                                .zeros(rows * crate::ops::indexer::reference::SCALE_BYTES)?,
                        },
                        state: gpu.upload(&st)?,
                    })
                }
                _ => None,
            };
            layers.push(LayerCaches {
                layout,
                pool: gpu.zeros(layout.n_entries() * kv::ENTRY_BYTES)?,
                state,
                index,
                rows,
            });
        }
        Ok(KvPool { layers })
    }

    /// Fills every CSA layer's indexer key cache with synthetic keys (random FP8 / FP4 codes and positive
    /// scales from `seed`), for a run that starts at a position without a prompt. The indexer's top-k reads
    /// scores, and over an all-zero cache every score ties, which sends the top-k to its slow path for exact
    /// ties: distinct keys make its cost that of a real context. The KV entries stay zero (sparse attention's
    /// cost does not depend on the values it reads).
    pub fn fill_synthetic_index_keys(&self, gpu: &Gpu, seed: u64) -> Result<()> {
        use crate::model::weights::{StoredDtype, SyntheticInit, TensorSpec};
        for (l, layer) in self.layers.iter().enumerate() {
            let Some(index) = &layer.index else { continue };
            let keys = &index.keys;
            let (codes, scales) = match keys.format {
                KeyFormat::Fp8 => (
                    (StoredDtype::F8E4M3, SyntheticInit::Fp8Codes),
                    // One f32 scale per key.
                    (
                        StoredDtype::F32,
                        SyntheticInit::Uniform {
                            amp: 0.25,
                            offset: 1.0,
                        },
                    ),
                ),
                KeyFormat::Mxfp4 => (
                    (StoredDtype::I8, SyntheticInit::Fp4Codes),
                    // Four UE8M0 block scales per key, 2^0 or 2^-1.
                    (StoredDtype::F8E8M0, SyntheticInit::Scale { exp_base: 0 }),
                ),
            };
            for (what, (dtype, init), buf) in [
                ("codes", codes, &keys.codes),
                ("scales", scales, &keys.scales),
            ] {
                let spec = TensorSpec {
                    name: format!("engine.synthetic_index_keys.{l}.{what}"),
                    dtype,
                    shape: vec![buf.len() / dtype.size()],
                    init,
                };
                crate::ops::weights::fill(gpu, &gpu.stream, seed, &spec, 0, spec.numel(), buf)?;
            }
        }
        Ok(())
    }
}
