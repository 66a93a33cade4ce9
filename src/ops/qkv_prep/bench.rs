//! Measurement hooks of the qkv_prep family: one decode step's attention-side prep of `rows` tokens at a DSV4
//! shape (the q heads, the window-KV entries, the indexer query), each captured in a CUDA graph and replayed back
//! to back (the decode step's form), beside an empty kernel's replay (the launch floor, measured in the same
//! run). The sweep adapter is `bench::kernels::qkv_prep`.

use anyhow::{anyhow, bail, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

use super::{
    indexer_q, kv_entries, launch_floor, prep, q_heads, IndexerQ, KvEntries, Prep, QHeads,
    WindowRing, ENTRY_BYTES, HEAD_DIM, INDEX_HEAD_DIM,
};
use crate::formats::bf16::to_bf16_vec;
use crate::gpu::timing::TimingPlan;
use crate::gpu::Gpu;
use crate::model::config::ModelConfig;
use crate::model::reference::{indexer_weight_scale, layer_rope};
use crate::ops::inputs;

/// The measured variants: each part alone, the three parts in one launch (`all`, the engine's), and the empty launch.
pub const VARIANTS: &[&str] = &["q_heads", "kv_entries", "indexer_q", "all", "launch_floor"];

/// DSV4's RMSNorm epsilon.
pub const EPS: f32 = 1e-6;
/// Window ring length (DSV4 `window_size`).
pub const WINDOW: usize = 128;

/// Device inputs and outputs of one decode-shaped call: `rows` tokens (one per sequence), `heads` query heads,
/// `index_heads` indexer heads, one window ring of 128 entries per sequence.
pub struct Problem {
    pub rows: usize,
    pub heads: usize,
    pub index_heads: usize,
    pub q_in: CudaSlice<bf16>,
    pub q_out: CudaSlice<bf16>,
    pub q_rstd: CudaSlice<f32>,
    pub kv_in: CudaSlice<bf16>,
    pub kv_norm: CudaSlice<bf16>,
    pub kv_rstd: CudaSlice<f32>,
    pub pool: CudaSlice<u8>,
    pub seq_base: CudaSlice<i32>,
    pub qi_in: CudaSlice<bf16>,
    pub w_in: CudaSlice<f32>,
    pub q_codes: CudaSlice<u8>,
    pub w_out: CudaSlice<f32>,
    pub positions: CudaSlice<i32>,
    pub freqs: CudaSlice<f64>,
    pub w_scale: f32,
}

impl Problem {
    /// Seeded activation-like inputs, positions `1000 + 37 r`, the RoPE table of DSV4-Flash's first compressed layer (θ = 160000, YaRN),
    /// outputs poisoned with 0xFF.
    pub fn new(
        gpu: &Gpu,
        rows: usize,
        heads: usize,
        index_heads: usize,
        seed: u64,
    ) -> Result<Problem> {
        super::check_rows_heads(rows, heads)?;
        super::check_rows_heads(rows, index_heads)?;
        let up = |v: Vec<f32>| gpu.upload(&to_bf16_vec(&v));
        let cfg = ModelConfig::flash();
        let rope = layer_rope(
            &cfg,
            cfg.compress_ratios.iter().position(|&m| m > 0).unwrap_or(0),
        );
        let positions: Vec<i32> = (0..rows).map(|r| 1000 + 37 * r as i32).collect();
        let seq_base: Vec<i32> = (0..rows).map(|r| (r * WINDOW) as i32).collect();
        Ok(Problem {
            rows,
            heads,
            index_heads,
            q_in: up(inputs::activation_rows(rows * heads, HEAD_DIM, seed))?,
            q_out: gpu.poisoned(rows * heads * HEAD_DIM, 0xFF)?,
            q_rstd: gpu.poisoned(rows * heads, 0xFF)?,
            kv_in: up(inputs::activation_rows(rows, HEAD_DIM, seed ^ 1))?,
            kv_norm: up(inputs::uniform(HEAD_DIM, 1.0, seed ^ 2))?,
            kv_rstd: gpu.poisoned(rows, 0xFF)?,
            pool: gpu.poisoned(rows * WINDOW * ENTRY_BYTES, 0xFF)?,
            seq_base: gpu.upload(&seq_base)?,
            qi_in: up(inputs::activation_rows(
                rows * index_heads,
                INDEX_HEAD_DIM,
                seed ^ 3,
            ))?,
            w_in: gpu.upload(&inputs::uniform(rows * index_heads, 4.0, seed ^ 4))?,
            q_codes: gpu.poisoned(rows * index_heads * INDEX_HEAD_DIM, 0xFF)?,
            w_out: gpu.poisoned(rows * index_heads, 0xFF)?,
            positions: gpu.upload(&positions)?,
            freqs: gpu.upload(&rope.freqs)?,
            w_scale: indexer_weight_scale(INDEX_HEAD_DIM, index_heads),
        })
    }

    pub fn run_q_heads(&self, gpu: &Gpu) -> Result<()> {
        q_heads(
            gpu,
            &gpu.stream,
            &self.q_in,
            &self.positions,
            &self.freqs,
            self.rows,
            self.heads,
            EPS,
            &self.q_out,
            &self.q_rstd,
        )
    }

    pub fn run_kv_entries(&self, gpu: &Gpu) -> Result<()> {
        let ring = WindowRing {
            pool: &self.pool,
            seq_base: &self.seq_base,
            tokens_per_seq: 1,
            window: WINDOW,
        };
        kv_entries(
            gpu,
            &gpu.stream,
            &self.kv_in,
            &self.kv_norm,
            &self.positions,
            &self.freqs,
            self.rows,
            EPS,
            &ring,
            &self.kv_rstd,
        )
    }

    pub fn run_indexer_q(&self, gpu: &Gpu) -> Result<()> {
        indexer_q(
            gpu,
            &gpu.stream,
            &self.qi_in,
            &self.w_in,
            &self.positions,
            &self.freqs,
            self.rows,
            self.index_heads,
            self.w_scale,
            &self.q_codes,
            &self.w_out,
            None,
        )
    }

    /// The three parts in one [`prep`] launch, as the engine's projections run them.
    pub fn run_all(&self, gpu: &Gpu) -> Result<()> {
        let ring = WindowRing {
            pool: &self.pool,
            seq_base: &self.seq_base,
            tokens_per_seq: 1,
            window: WINDOW,
        };
        prep(
            gpu,
            &gpu.stream,
            &Prep {
                rows: self.rows,
                positions: &self.positions,
                freqs: &self.freqs,
                eps: EPS,
                q: Some(QHeads {
                    q_in: &self.q_in,
                    heads: self.heads,
                    q_out: &self.q_out,
                    rstd: &self.q_rstd,
                }),
                kv: Some(KvEntries {
                    kv_in: &self.kv_in,
                    kv_norm: &self.kv_norm,
                    ring: &ring,
                    rstd: &self.kv_rstd,
                }),
                index: Some(IndexerQ {
                    qi: &self.qi_in,
                    w_in: &self.w_in,
                    heads: self.index_heads,
                    w_scale: self.w_scale,
                    q_codes: &self.q_codes,
                    w_out: &self.w_out,
                    visible: None,
                }),
            },
        )
    }

    /// The launches of `variant` (one of [`VARIANTS`]).
    pub fn run(&self, gpu: &Gpu, variant: &str) -> Result<()> {
        match variant {
            "q_heads" => self.run_q_heads(gpu),
            "kv_entries" => self.run_kv_entries(gpu),
            "indexer_q" => self.run_indexer_q(gpu),
            "all" => self.run_all(gpu),
            "launch_floor" => launch_floor(gpu, &gpu.stream),
            v => bail!("qkv_prep: unknown variant `{v}` ({})", VARIANTS.join(", ")),
        }
    }

    /// Bytes `variant` reads plus writes (the launch floor moves none).
    pub fn bytes(&self, variant: &str) -> u64 {
        let (r, h, hi) = (self.rows, self.heads, self.index_heads);
        let q = r * h * (2 * HEAD_DIM * 2 + 4) + 4 * r;
        let kv = r * (2 * HEAD_DIM + ENTRY_BYTES + 4 + 4 + 4) + 2 * HEAD_DIM;
        let iq = r * hi * (2 * INDEX_HEAD_DIM + INDEX_HEAD_DIM + 2 + 4) + 4 * r;
        let freqs = 8 * 32;
        (match variant {
            "q_heads" => q + freqs,
            "kv_entries" => kv + freqs,
            "indexer_q" => iq + freqs,
            "all" => q + kv + iq + 3 * freqs,
            _ => 0,
        }) as u64
    }
}

/// One measured point: per-sample times of one call (a graph replay of the variant's launches) and its bytes.
pub struct Measured {
    pub samples_us: Vec<f64>,
    pub bytes: u64,
}

/// Time `variant` at `rows` tokens as a captured graph, 20 replays back to back per sample.
pub fn measure(
    gpu: &Gpu,
    plan: impl Fn(u64) -> TimingPlan,
    variant: &str,
    rows: usize,
    heads: usize,
    index_heads: usize,
    seed: u64,
) -> Result<Measured> {
    let p = Problem::new(gpu, rows, heads, index_heads, seed)?;
    // One plain call first: the kernels are resolved outside the capture.
    p.run(gpu, variant)?;
    let graph = gpu.capture(|| p.run(gpu, variant))?;
    graph
        .launch()
        .map_err(|e| anyhow!("qkv_prep graph launch: {e:?}"))?;
    let bytes = p.bytes(variant);
    let samples_us = gpu.time_graph_us(&graph, plan(bytes), 20)?;
    Ok(Measured { samples_us, bytes })
}
