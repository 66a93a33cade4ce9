//! The attention half of a decode layer (docs/engine.md, "The decode step", steps 1-11): `x_in` -> hc_pre +
//! attn_norm -> q/kv projections -> window ring entry, compressors, indexer top-k -> sparse attention -> output
//! projection -> hc_post -> `x_out`.
//!
//! [`AttnHalf::run`] is the CPU model's `Model::decode_step` up to `residual_mid`, for a batch of sequences each at
//! its own position (read on the device), in this order:
//!
//! | step | what | launches |
//! |---|---|---|
//! | 1 | `hc_pre`: `a` = RMSNorm(hc_pre(x_in); attn_norm) as BF16 and its FP8 1x128 form (written by the finish kernel) | `mhc::mhc_pre_copies` |
//! | 2-5 | `projections`: `qa = wq_a a`, `kv_raw = wkv a`, `qr = q_norm(qa)` and `q = wq_b qr` in one launch (the GEMV normalizes qa; CSA: with `indexer.wq_b qr`); every BF16 linear of `a` in one launch (CSA: `weights_proj a`; each compressor's `wkv a`, `wgate a` in f32); then one launch for the per-head RMS + RoPE of q, the window ring entry and (CSA) the indexer query with the rows' visible key counts | `dense::fp8_linears`, `dense::fp8_linears_of_bf16`, `dense::bf16_linear`, `qkv_prep::prep` |
//! | 6-7 | `compress`: each compressor's state update (the kernel adds `ape`) and every m-th position an entry (CSA: also the indexer key) | `compressor::decode_step` |
//! | 8 | `select` (CSA): logits over the sequence's visible keys, top-k | `indexer::{logits, topk}` |
//! | 9 | `attend`: each sequence's candidate row (window slots oldest first, then the selected / all visible compressed entries ascending), sparse attention with the sink and the inverse RoPE | `attn_candidates`, `sparse_attn::decode` |
//! | 10-11 | `output`: `z = wo_a o` grouped, `z` -> FP8 1x128, `y = wo_b z`, hc_post (unless linked) | `dense::wo_a_grouped`, `dense::fp8_linears_of_bf16` (the GEMV quantizes z; the tensor-core route after `quantize_bf16_rows`), `mhc::mhc_post` |
//!
//! Graph-safe: every buffer is carved from the step's arena or allocated in [`AttnHalf::new`]; positions, lengths,
//! visible key counts and cache slots are read on the device; nothing is read back.
//!
//! Numerics: the launchers follow `src/model` except where they differ by design: sums in other orders (f32 trees,
//! tensor cores), sparse attention quantizes q's nope dims to FP8 per 64 (the KV entry rule) and forms the RoPE
//! angle as one f32 product where the model uses f64, the indexer's logits run on FP8 tensor cores over FP8 keys
//! with an f32 scale (the model scores the FP4-simulated keys in f32 with BF16 roundings), so its top-k may differ
//! from the model's among near-tied scores.
//!
//! An idle slot (position < 0) writes no cache (window entry, compressor state and entries are skipped), gets an
//! empty candidate row, and its `x_out` rows are unspecified; all sequences active is the supported case.

use crate::engine::cache::{LayerCacheLayout, LayerCaches, RowTables};
use crate::engine::io::{group, LayerIo, StepShape, STREAMS};
use crate::engine::plan::LayerCachePlan;
use crate::engine::weights::DeviceWeights;
use crate::gpu::arena::{self, Arena, WorkspaceLayout};
use crate::gpu::launch::{launch, KernelArgs, Launch};
use crate::gpu::{DevBuf, DeviceBuf, Gpu, Stream};
use crate::model::reference::{indexer_weight_scale, layer_rope};
use crate::model::{LayerKind, ModelConfig};
use crate::ops::compressor::{
    self, CompressorKind, CompressorShape, CompressorWeights, DecodeIo, EntryCache, EntrySlots,
};
use crate::ops::dense::{
    self, Bf16Job, Bf16Rows, DenseKind, DenseShape, DenseWorkspace, Fp8Job, Fp8Rows, Fp8Weight,
};
use crate::ops::indexer::{self, QueryBatch, TopkWorkspace};
use crate::ops::mhc::{self, MhcPreOutputs, MhcWeights, MhcWorkspace, PriorPost};
use crate::ops::norm_quant::{self, OutFormat, QuantView, RowsOut};
use crate::ops::qkv_prep::{self, WindowRing};
use crate::ops::sparse_attn::{self, DecodeInputs, DecodeShape, DecodeWorkspace, SplitPlan};
use anyhow::{bail, ensure, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

/// Kernel family of the attention half's glue (kernels/engine_attn.cu).
pub const FAMILY: &str = "engine_attn";
/// Block size of the glue kernels (`kAttnGlueThreads`).
const GLUE_THREADS: u32 = 256;

// ---- the geometry of one attention half -----------------------------------------------------------------------

/// Every size the half's buffers and launches depend on, from the model and the step's shape: what
/// [`AttnHalf::layout`] counts and [`AttnHalf::new`] carves.
struct Sizes {
    /// Rows of the half: the decode batch, or a prefill chunk's capacity.
    batch: usize,
    /// Sequences of the caches the half reads (the decode batch; `batch` for a decode half).
    pool_batch: usize,
    dim: usize,
    q_lora: usize,
    heads: usize,
    head_dim: usize,
    /// `o_groups x o_lora_rank`: z's width.
    o_dim: usize,
    index_heads: usize,
    index_dim: usize,
    /// Each layer's cache plan (as `DecodeState` sizes its caches) and the attention group it belongs to.
    plans: Vec<LayerCachePlan>,
    layer_group: Vec<usize>,
    groups: Vec<GroupShape>,
    /// The widest main compressor's W (0 without compressed layers).
    comp_width: usize,
    /// CSA layers: the indexer's key capacity per sequence and k (`min(index_topk, capacity)`).
    index: Option<(usize, usize)>,
    dense: Vec<DenseShape>,
    sm_count: usize,
}

/// The sparse-attention geometry of the layers that share one cache plan.
#[derive(Clone, Copy, Debug)]
struct GroupShape {
    plan: LayerCachePlan,
    shape: DecodeShape,
    split: SplitPlan,
}

/// The longest candidate list a layer of `plan` may see: the window, plus CSA's top-k (at most its key capacity) or
/// HCA's every compressed entry.
pub fn candidate_stride(plan: &LayerCachePlan, index_topk: usize) -> usize {
    plan.window
        + match plan.kind {
            LayerKind::SlidingWindow => 0,
            LayerKind::Csa { .. } => index_topk.min(plan.index_keys),
            LayerKind::Hca { .. } => plan.compressed_entries,
        }
}

/// The geometry the launchers hard-wire (qkv_prep, sparse_attn, the indexer), checked before any work.
fn check_geometry(cfg: &ModelConfig) -> Result<()> {
    ensure!(
        cfg.hc_mult == STREAMS,
        "the attention half runs {STREAMS} mHC streams, the model has {}",
        cfg.hc_mult
    );
    ensure!(
        cfg.head_dim == qkv_prep::HEAD_DIM && cfg.rope_head_dim == qkv_prep::ROPE_DIM,
        "the attention kernels need head_dim {} with {} RoPE dims, the model has {} / {}",
        qkv_prep::HEAD_DIM,
        qkv_prep::ROPE_DIM,
        cfg.head_dim,
        cfg.rope_head_dim
    );
    let csa = (0..cfg.n_layers).any(|l| matches!(cfg.layer_kind(l), LayerKind::Csa { .. }));
    ensure!(
        !csa || (cfg.index_head_dim == indexer::HEAD_DIM
            && cfg.index_n_heads == indexer::NUM_HEADS),
        "the indexer kernels need {} heads of {} dims, the model has {} of {}",
        indexer::NUM_HEADS,
        indexer::HEAD_DIM,
        cfg.index_n_heads,
        cfg.index_head_dim
    );
    ensure!(
        cfg.n_heads.is_multiple_of(cfg.o_groups),
        "{} heads do not split into {} output groups",
        cfg.n_heads,
        cfg.o_groups
    );
    Ok(())
}

impl Sizes {
    fn of(
        cfg: &ModelConfig,
        shape: &StepShape,
        pool_batch: usize,
        sm_count: usize,
    ) -> Result<Sizes> {
        check_geometry(cfg)?;
        let batch = shape.batch;
        ensure!(pool_batch >= 1, "caches of no sequence");
        let plans: Vec<LayerCachePlan> = (0..cfg.n_layers)
            .map(|l| LayerCachePlan::of(cfg, l, shape.context))
            .collect();
        let mut groups: Vec<GroupShape> = Vec::new();
        let mut layer_group = Vec::with_capacity(plans.len());
        for plan in &plans {
            if let Some(g) = groups.iter().position(|g| g.plan == *plan) {
                layer_group.push(g);
                continue;
            }
            let lay = LayerCacheLayout {
                plan: *plan,
                batch: pool_batch,
            };
            let shape = DecodeShape {
                batch,
                heads: cfg.n_heads,
                stride: candidate_stride(plan, cfg.index_topk),
                n_entries: lay.n_entries(),
            };
            shape.validate()?;
            let split = SplitPlan::fp8(sm_count, &shape);
            layer_group.push(groups.len());
            groups.push(GroupShape {
                plan: *plan,
                shape,
                split,
            });
        }
        let mut index = None;
        let mut comp_width = 0;
        for p in &plans {
            match p.kind {
                LayerKind::SlidingWindow => {}
                LayerKind::Hca { .. } => comp_width = comp_width.max(cfg.head_dim),
                LayerKind::Csa { ratio } => {
                    comp_width = comp_width.max(2 * cfg.head_dim);
                    ensure!(
                        p.index_keys >= 1,
                        "a context of {} tokens holds no CSA indexer key (ratio {ratio}): the attention half \
                         needs at least one",
                        shape.context
                    );
                    let k = cfg.index_topk.min(p.index_keys);
                    ensure!(
                        index.is_none_or(|i| i == (p.index_keys, k)),
                        "CSA layers with different key capacities"
                    );
                    index = Some((p.index_keys, k));
                }
            }
        }
        // Every launch of AttnHalf::projections and AttnHalf::output, jobs in launch order.
        let fp8 =
            |heights: &[usize], k: usize| DenseShape::of_heights(DenseKind::Fp8, batch, k, heights);
        let bf16 =
            |heights: &[usize]| DenseShape::of_heights(DenseKind::Bf16, batch, cfg.dim, heights);
        let o_dim = cfg.o_groups * cfg.o_lora_rank;
        let mut dense = vec![
            // wq_a and wkv in one launch.
            fp8(&[cfg.q_lora_rank, cfg.head_dim], cfg.dim),
            fp8(&[cfg.n_heads * cfg.head_dim], cfg.q_lora_rank),
            DenseShape::new(
                DenseKind::Fp8Bf16x,
                batch,
                cfg.o_lora_rank,
                cfg.heads_per_group() * cfg.head_dim,
                cfg.o_groups,
            ),
            fp8(&[cfg.dim], o_dim),
        ];
        for p in &plans {
            match p.kind {
                LayerKind::SlidingWindow => {}
                // The compressor's wkv and wgate in one launch.
                LayerKind::Hca { .. } => dense.push(bf16(&[cfg.head_dim, cfg.head_dim])),
                LayerKind::Csa { .. } => {
                    // The indexer's weights_proj, then both compressors' wkv and wgate (overlapping windows:
                    // twice the head width) in one launch.
                    let (w, wi) = (2 * cfg.head_dim, 2 * cfg.index_head_dim);
                    dense.push(bf16(&[cfg.index_n_heads, w, w, wi, wi]));
                    // wq_b and the indexer's wq_b in one launch.
                    dense.push(fp8(
                        &[
                            cfg.n_heads * cfg.head_dim,
                            cfg.index_n_heads * cfg.index_head_dim,
                        ],
                        cfg.q_lora_rank,
                    ));
                }
            }
        }
        for s in &dense {
            s.check()?;
        }
        Ok(Sizes {
            batch,
            pool_batch,
            dim: cfg.dim,
            q_lora: cfg.q_lora_rank,
            heads: cfg.n_heads,
            head_dim: cfg.head_dim,
            o_dim,
            index_heads: cfg.index_n_heads,
            index_dim: cfg.index_head_dim,
            plans,
            layer_group,
            groups,
            comp_width,
            index,
            dense,
            sm_count,
        })
    }

    /// The arena carves of [`AttnBuffers::carve`], in its order.
    fn layout(&self) -> WorkspaceLayout {
        let (b, d) = (self.batch, self.dim);
        let mut l = WorkspaceLayout::new();
        l.add_bytes(MhcWorkspace::layout(b, d).bytes())
            .add_bytes(RowsOut::layout(OutFormat::Fp8, b, d).bytes())
            .add::<bf16>(b * self.q_lora)
            .add::<bf16>(b * self.head_dim)
            .add_bytes(RowsOut::layout(OutFormat::Fp8, b, self.q_lora).bytes())
            .add::<bf16>(b * self.heads * self.head_dim)
            .add::<f32>(b * self.heads)
            .add::<f32>(b)
            .add::<f32>(b * self.comp_width.max(1))
            .add::<f32>(b * self.comp_width.max(1))
            .add::<u32>(1)
            .add::<bf16>(b * self.o_dim)
            .add_bytes(RowsOut::layout(OutFormat::Fp8, b, self.o_dim).bytes())
            .add::<bf16>(b * d)
            .add_bytes(
                dense::workspace_layout(&self.dense, self.sm_count)
                    .expect("checked shapes")
                    .bytes(),
            );
        if let Some((capacity, k)) = self.index {
            let rows = b * self.index_heads;
            l.add::<bf16>(rows * self.index_dim)
                .add::<f32>(rows)
                .add::<f32>(b * 2 * self.index_dim)
                .add::<f32>(b * 2 * self.index_dim)
                .add::<f32>(b * capacity)
                .add_bytes(TopkWorkspace::layout(b, k, capacity).bytes())
                .add::<i32>(b * k)
                .add::<f32>(b * k);
        }
        for g in &self.groups {
            l.add_bytes(sparse_attn::workspace_bytes(&g.shape, g.split, false));
        }
        l
    }
}

// ---- the half's buffers ---------------------------------------------------------------------------------------

/// The workspaces of the half, carved once from the step's arena and shared by every layer (each sized for the
/// largest layer kind).
pub struct AttnBuffers {
    /// mhc_pre's split-K partials.
    pub mhc: MhcWorkspace,
    /// Step 1: `a` as FP8 1x128 `[B, D]` (wq_a's and wkv's input; its rstd unused).
    pub a_fp8: RowsOut,
    /// Step 2: `qa = wq_a a` BF16 `[B, q_lora]`, `kv_raw = wkv a` BF16 `[B, head_dim]`.
    pub qa: DevBuf<bf16>,
    pub kv_raw: DevBuf<bf16>,
    /// Step 3: `qr = q_norm(qa)` as FP8 1x128 `[B, q_lora]` and its rstd.
    pub qr: RowsOut,
    /// Step 4: `wq_b qr` BF16 `[B, heads, head_dim]` before the per-head RMS and RoPE.
    pub q_raw: DevBuf<bf16>,
    /// Step 5: the per-head RMS factors `[B, heads]` and the window KV rows' rstd `[B]`.
    pub q_rstd: DevBuf<f32>,
    pub kv_rstd: DevBuf<f32>,
    /// Step 6: the main compressor's inputs `wkv a`, `wgate a`, f32 `[B, W]` (W of the widest compressor).
    pub comp_kv: DevBuf<f32>,
    pub comp_gate: DevBuf<f32>,
    /// u32 `[1]`: bit 0 set by a compressor whose entry fell outside its cache (sticky; zero after `new`).
    pub error: DevBuf<u32>,
    /// Step 10: `z = wo_a o` BF16 `[B, o_groups x o_lora]`, its FP8 1x128 form, `y = wo_b z` BF16 `[B, D]`.
    pub z: DevBuf<bf16>,
    pub z_fp8: RowsOut,
    pub y: DevBuf<bf16>,
    /// Split-K partials and tile counters of every dense linear of the half.
    pub dense: DenseWorkspace,
    /// CSA layers' indexer buffers (None when the model has no CSA layer).
    pub index: Option<IndexBuffers>,
}

/// The CSA indexer's buffers.
pub struct IndexBuffers {
    /// Step 4: `indexer.wq_b qr` BF16 `[B, 64, 128]`.
    pub qi_raw: DevBuf<bf16>,
    /// Step 5: `weights_proj a` f32 `[B, 64]` (indexer_q rounds it to BF16).
    pub w_f32: DevBuf<f32>,
    /// Step 6: the indexer compressor's inputs f32 `[B, 2 x 128]`.
    pub comp_kv: DevBuf<f32>,
    pub comp_gate: DevBuf<f32>,
    /// Step 8: scores `[B, capacity]` (row stride = the key capacity), the top-k scratch and its outputs `[B, k]`
    /// (indices in score order then -1, scores).
    pub scores: DevBuf<f32>,
    pub score_stride: usize,
    pub topk: TopkWorkspace,
    pub top_idx: DevBuf<i32>,
    pub top_score: DevBuf<f32>,
    /// Step 5's outputs, the logits' query: e4m3 q `[B, 64, 128]`, f32 head weights `[B, 64]`, and the visible
    /// key counts `[B]` (allocated in `new`: the indexer takes owned buffers).
    pub query: QueryBatch,
}

impl AttnBuffers {
    /// Carves in [`Sizes::layout`]'s order (the counters and top-k protocol buffers zeroed on `stream`).
    fn carve(gpu: &Gpu, s: &Sizes, arena: &mut Arena) -> Result<AttnBuffers> {
        let (b, d, stream) = (s.batch, s.dim, &gpu.stream);
        let mhc = MhcWorkspace::carve(arena, b, d)?;
        let a_fp8 = RowsOut::carve(arena, OutFormat::Fp8, b, d)?;
        let qa = arena.carve(b * s.q_lora, "attn qa")?;
        let kv_raw = arena.carve(b * s.head_dim, "attn kv_raw")?;
        let qr = RowsOut::carve(arena, OutFormat::Fp8, b, s.q_lora)?;
        let q_raw = arena.carve(b * s.heads * s.head_dim, "attn q before the head finish")?;
        let q_rstd = arena.carve(b * s.heads, "attn q head rstd")?;
        let kv_rstd = arena.carve(b, "attn kv rstd")?;
        let comp_kv = arena.carve(b * s.comp_width.max(1), "compressor kv inputs")?;
        let comp_gate = arena.carve(b * s.comp_width.max(1), "compressor gate inputs")?;
        let error = arena.carve(1, "attn error word")?;
        let z = arena.carve(b * s.o_dim, "attn z")?;
        let z_fp8 = RowsOut::carve(arena, OutFormat::Fp8, b, s.o_dim)?;
        let y = arena.carve(b * d, "attn y")?;
        let dense = DenseWorkspace::carve(arena, stream, &s.dense, s.sm_count)?;
        dense.prepare(gpu)?;
        arena::fill(stream, &error, 0)?;
        let index = match s.index {
            None => None,
            Some((capacity, k)) => {
                let rows = b * s.index_heads;
                Some(IndexBuffers {
                    qi_raw: arena.carve(rows * s.index_dim, "indexer q before the rotation")?,
                    w_f32: arena.carve(rows, "indexer weights_proj f32")?,
                    comp_kv: arena.carve(b * 2 * s.index_dim, "indexer compressor kv inputs")?,
                    comp_gate: arena
                        .carve(b * 2 * s.index_dim, "indexer compressor gate inputs")?,
                    scores: arena.carve(b * capacity, "indexer scores")?,
                    score_stride: capacity,
                    topk: TopkWorkspace::carve(arena, stream, b, k, capacity)?,
                    top_idx: arena.carve(b * k, "indexer top-k indices")?,
                    top_score: arena.carve(b * k, "indexer top-k scores")?,
                    query: QueryBatch {
                        batch: b,
                        next_n: 1,
                        q: gpu.zeros(rows * s.index_dim)?,
                        w: gpu.zeros(rows)?,
                        num_valid: gpu.zeros(b)?,
                    },
                })
            }
        };
        Ok(AttnBuffers {
            mhc,
            a_fp8,
            qa,
            kv_raw,
            qr,
            q_raw,
            q_rstd,
            kv_rstd,
            comp_kv,
            comp_gate,
            error,
            z,
            z_fp8,
            y,
            dense,
            index,
        })
    }
}

/// The sparse attention of the layers sharing one cache plan: the capacity shape, its split workspace (carved from
/// the arena) and the candidate rows (allocated in `new`: `sparse_attn::DecodeInputs` takes owned buffers).
pub struct AttnGroup {
    pub shape: DecodeShape,
    pub ws: DecodeWorkspace,
    /// i32 `[B, stride]` pool indices (-1 after each row's length) and `[B]` lengths.
    pub candidates: CudaSlice<i32>,
    pub lengths: CudaSlice<i32>,
}

// ---- per-layer weights ----------------------------------------------------------------------------------------

/// An FP8 weight of the dense pool: e4m3 codes `[n, k]` and UE8M0 128x128 scales, and the scales as f32 (the
/// dense tensor-core route's, built at load: `DeviceWeights::scales_f32`).
#[derive(Clone, Copy, Debug)]
pub struct Fp8View {
    pub codes: DevBuf<u8>,
    pub scales: DevBuf<u8>,
    pub n: usize,
    pub k: usize,
    pub scales_f32: Option<DevBuf<f32>>,
}

impl Fp8View {
    fn of(w: &DeviceWeights, prefix: &str, n: usize, k: usize) -> Result<Fp8View> {
        let codes = w.typed::<u8>(&format!("{prefix}.weight"))?;
        let scales = w.typed::<u8>(&format!("{prefix}.scale"))?;
        ensure!(
            codes.len() == n * k && scales.len() == n.div_ceil(128) * k.div_ceil(128),
            "{prefix}: {} codes and {} scales, expected [{n}, {k}]",
            codes.len(),
            scales.len()
        );
        Ok(Fp8View {
            codes,
            scales,
            n,
            k,
            scales_f32: w.scales_f32(&format!("{prefix}.weight")),
        })
    }
    fn weight(&self) -> Fp8Weight<'_> {
        Fp8Weight {
            codes: &self.codes,
            scales: &self.scales,
            n: self.n,
            k: self.k,
            scales_f32: self.scales_f32.as_ref().map(|s| s as &dyn DeviceBuf<f32>),
        }
    }
}

/// One compressor of a layer: its shape, the BF16 projections (views) and what its kernel reads (uploaded).
pub struct CompressorParams {
    pub shape: CompressorShape,
    pub wkv: DevBuf<bf16>,
    pub wgate: DevBuf<bf16>,
    pub weights: CompressorWeights,
}

impl CompressorParams {
    fn load(
        gpu: &Gpu,
        w: &DeviceWeights,
        prefix: &str,
        shape: CompressorShape,
        freqs: &[f64],
        eps: f32,
    ) -> Result<CompressorParams> {
        let s = &gpu.stream;
        let wkv = w.typed::<bf16>(&format!("{prefix}.wkv.weight"))?;
        let wgate = w.typed::<bf16>(&format!("{prefix}.wgate.weight"))?;
        ensure!(
            wkv.len() == shape.width() * w.plan.config.dim && wgate.len() == wkv.len(),
            "{prefix}: projections of {} / {} values, expected [{}, {}]",
            wkv.len(),
            wgate.len(),
            shape.width(),
            w.plan.config.dim
        );
        let weights = CompressorWeights::upload(
            gpu,
            &shape,
            &w.host_f32(s, &format!("{prefix}.ape"))?,
            &w.host_f32(s, &format!("{prefix}.norm.weight"))?,
            freqs,
            eps,
        )?;
        Ok(CompressorParams {
            shape,
            wkv,
            wgate,
            weights,
        })
    }
}

/// The CSA indexer's weights of a layer.
pub struct IndexerParams {
    pub wq_b: Fp8View,
    pub weights_proj: DevBuf<bf16>,
    pub compressor: CompressorParams,
    /// `indexer_weight_scale(128, 64)`.
    pub w_scale: f32,
}

/// One compressor of a layer with the batch's rows of its inputs (its `wkv a`, `wgate a`, f32).
struct CompressorInput<'a> {
    params: &'a CompressorParams,
    kv: DevBuf<f32>,
    gate: DevBuf<f32>,
    /// The indexer's compressor (keys into the key cache), not the main one (entries into the pool).
    indexer: bool,
}

/// One layer's weights as the half's launchers read them.
pub struct AttnLayer {
    pub kind: LayerKind,
    /// `hc_attn_{fn, scale, base}` and `attn_norm.weight` (uploaded: the mHC launchers take owned weights).
    pub hc: MhcWeights,
    pub wq_a: Fp8View,
    pub wkv: Fp8View,
    pub wq_b: Fp8View,
    pub wo_a: Fp8View,
    pub wo_b: Fp8View,
    pub q_norm: DevBuf<bf16>,
    pub kv_norm: DevBuf<bf16>,
    /// The layer's RoPE frequencies (`layer_rope`): f64 for qkv_prep and the compressors, f32 for sparse_attn.
    pub rope: CudaSlice<f64>,
    pub rope_f32: CudaSlice<f32>,
    /// `attn_sink` f32 `[heads]`.
    pub sink: CudaSlice<f32>,
    pub compressor: Option<CompressorParams>,
    pub indexer: Option<IndexerParams>,
    /// Index into [`AttnHalf::groups`].
    pub group: usize,
}

impl AttnLayer {
    fn load(gpu: &Gpu, w: &DeviceWeights, l: usize, group: usize) -> Result<AttnLayer> {
        let cfg = &w.plan.config;
        let s = &gpu.stream;
        let (d, hd, eps) = (cfg.dim, cfg.head_dim, cfg.norm_eps);
        let p = format!("layers.{l}");
        let a = format!("{p}.attn");
        let hc = w.mhc_boundary(gpu, l, "attn")?;
        let rope = layer_rope(cfg, l).freqs;
        let rope_f32: Vec<f32> = rope.iter().map(|&f| f as f32).collect();
        let kind = cfg.layer_kind(l);
        let compressor = match kind {
            LayerKind::SlidingWindow => None,
            LayerKind::Csa { ratio } | LayerKind::Hca { ratio } => {
                let ck = if matches!(kind, LayerKind::Csa { .. }) {
                    CompressorKind::CsaMain
                } else {
                    CompressorKind::HcaMain
                };
                let shape = CompressorShape { kind: ck, ratio };
                Some(CompressorParams::load(
                    gpu,
                    w,
                    &format!("{a}.compressor"),
                    shape,
                    &rope,
                    eps,
                )?)
            }
        };
        let indexer = match kind {
            LayerKind::Csa { ratio } => {
                let ix = format!("{a}.indexer");
                let keys = crate::engine::cache::key_format(w.plan.request.index_keys);
                let shape = CompressorShape {
                    kind: CompressorKind::CsaIndex(keys),
                    ratio,
                };
                let weights_proj = w.typed::<bf16>(&format!("{ix}.weights_proj.weight"))?;
                ensure!(
                    weights_proj.len() == cfg.index_n_heads * d,
                    "{ix}.weights_proj has {} values",
                    weights_proj.len()
                );
                Some(IndexerParams {
                    wq_b: Fp8View::of(
                        w,
                        &format!("{ix}.wq_b"),
                        cfg.index_n_heads * cfg.index_head_dim,
                        cfg.q_lora_rank,
                    )?,
                    weights_proj,
                    compressor: CompressorParams::load(
                        gpu,
                        w,
                        &format!("{ix}.compressor"),
                        shape,
                        &rope,
                        eps,
                    )?,
                    w_scale: indexer_weight_scale(cfg.index_head_dim, cfg.index_n_heads),
                })
            }
            _ => None,
        };
        let sink = w.host_f32(s, &format!("{a}.attn_sink"))?;
        ensure!(
            sink.len() == cfg.n_heads,
            "{a}.attn_sink has {} values",
            sink.len()
        );
        let bf16_vec = |name: String, n: usize| -> Result<DevBuf<bf16>> {
            let v = w.typed::<bf16>(&name)?;
            ensure!(v.len() == n, "{name} has {} values, expected {n}", v.len());
            Ok(v)
        };
        let o_dim = cfg.o_groups * cfg.o_lora_rank;
        Ok(AttnLayer {
            kind,
            hc,
            wq_a: Fp8View::of(w, &format!("{a}.wq_a"), cfg.q_lora_rank, d)?,
            wkv: Fp8View::of(w, &format!("{a}.wkv"), hd, d)?,
            wq_b: Fp8View::of(w, &format!("{a}.wq_b"), cfg.n_heads * hd, cfg.q_lora_rank)?,
            wo_a: Fp8View::of(w, &format!("{a}.wo_a"), o_dim, cfg.heads_per_group() * hd)?,
            wo_b: Fp8View::of(w, &format!("{a}.wo_b"), d, o_dim)?,
            q_norm: bf16_vec(format!("{a}.q_norm.weight"), cfg.q_lora_rank)?,
            kv_norm: bf16_vec(format!("{a}.kv_norm.weight"), hd)?,
            rope: gpu.upload(&rope)?,
            rope_f32: gpu.upload(&rope_f32)?,
            sink: gpu.upload(&sink)?,
            compressor,
            indexer,
            group,
        })
    }
}

// ---- the half -------------------------------------------------------------------------------------------------

/// The attention half's per-layer weights (views into the dense pool, plus what the launchers need uploaded) and
/// its workspaces (carved once from the step's arena, shared by every layer). Every buffer is public for the
/// parity tests.
pub struct AttnHalf {
    pub config: ModelConfig,
    /// Rows of every launch (the decode batch or a prefill chunk's capacity).
    pub batch: usize,
    /// Sequences of the caches a run is handed (= `batch` for a decode half).
    pub pool_batch: usize,
    pub layers: Vec<AttnLayer>,
    pub bufs: AttnBuffers,
    pub groups: Vec<AttnGroup>,
    /// Each layer's cache plan (checked against the caches a run is handed).
    plans: Vec<LayerCachePlan>,
    /// Step 1's outputs (pre, post, comb, u, and `a` = RMSNorm(u) as BF16 `[B, D]`), allocated in `new`.
    pub hc_out: MhcPreOutputs,
    /// A view of `hc_out`'s BF16 `a`.
    pub a: DevBuf<bf16>,
    /// Step 5's q `[B, heads, head_dim]` BF16 (RoPE'd; sparse_attn's input) and step 9's attention output o (same
    /// layout, inverse RoPE'd), allocated in `new` (`sparse_attn::decode` takes owned buffers).
    pub q: CudaSlice<bf16>,
    pub o: CudaSlice<bf16>,
    /// The dense pool the weight views point into.
    pool_addr: u64,
}

impl AttnHalf {
    /// The carves of [`AttnHalf::new`] for `shape` (the largest any layer of `cfg` needs).
    pub fn layout(
        cfg: &ModelConfig,
        shape: &StepShape,
        sm_count: usize,
    ) -> Result<WorkspaceLayout> {
        Ok(Sizes::of(cfg, shape, shape.batch, sm_count)?.layout())
    }

    /// The carves of [`AttnHalf::new_rows`]: `shape.batch` rows over caches of `pool_batch` sequences.
    pub fn layout_rows(
        cfg: &ModelConfig,
        shape: &StepShape,
        pool_batch: usize,
        sm_count: usize,
    ) -> Result<WorkspaceLayout> {
        Ok(Sizes::of(cfg, shape, pool_batch, sm_count)?.layout())
    }

    /// Builds every layer's weights (views into `weights`' pool; the mHC parameters, RoPE tables, sinks and
    /// compressor parameters read back and uploaded once) and carves the workspaces from `arena` (on the GPU's
    /// stream). `run` must be handed the same `weights`.
    pub fn new(
        gpu: &Gpu,
        weights: &DeviceWeights,
        shape: &StepShape,
        arena: &mut Arena,
    ) -> Result<AttnHalf> {
        Self::new_rows(gpu, weights, shape, shape.batch, arena)
    }

    /// A half of `shape.batch` rows over the caches of `pool_batch` sequences (a prefill chunk's half: its rows
    /// read the caches through the [`RowTables`] a run is handed).
    pub fn new_rows(
        gpu: &Gpu,
        weights: &DeviceWeights,
        shape: &StepShape,
        pool_batch: usize,
        arena: &mut Arena,
    ) -> Result<AttnHalf> {
        let cfg = weights.plan.config.clone();
        let s = Sizes::of(&cfg, shape, pool_batch, gpu.info.sm_count as usize)?;
        let used = arena.used();
        let bufs = AttnBuffers::carve(gpu, &s, arena)?;
        let mut groups = Vec::with_capacity(s.groups.len());
        for g in &s.groups {
            groups.push(AttnGroup {
                shape: g.shape,
                ws: DecodeWorkspace::carve(arena, &g.shape, g.split, false)?,
                candidates: gpu.poisoned(s.batch * g.shape.stride, 0xFF)?,
                lengths: gpu.zeros(s.batch)?,
            });
        }
        ensure!(
            arena.used() - used == s.layout().bytes(),
            "the attention half carved {} B, its layout counts {} B",
            arena.used() - used,
            s.layout().bytes()
        );
        let layers = (0..cfg.n_layers)
            .map(|l| AttnLayer::load(gpu, weights, l, s.layer_group[l]))
            .collect::<Result<Vec<_>>>()?;
        let hc_out = MhcPreOutputs::alloc_poisoned(gpu, OutFormat::Bf16, s.batch, s.dim)?;
        let QuantView::Bf16 { y: a } = hc_out.normed.view().q else {
            bail!("mhc_pre's outputs were allocated as BF16")
        };
        let qo = s.batch * s.heads * s.head_dim;
        Ok(AttnHalf {
            batch: s.batch,
            pool_batch: s.pool_batch,
            layers,
            bufs,
            groups,
            plans: s.plans,
            hc_out,
            a,
            q: gpu.poisoned(qo, 0xFF)?,
            o: gpu.poisoned(qo, 0xFF)?,
            pool_addr: weights.pool().device_addr(),
            config: cfg,
        })
    }

    /// Steps 1-11 of layer `layer`: reads `io.x_in`, writes `io.x_out`, updates the layer's caches.
    pub fn run(
        &mut self,
        gpu: &Gpu,
        stream: &Stream,
        weights: &DeviceWeights,
        layer: usize,
        io: &LayerIo,
    ) -> Result<()> {
        ensure!(
            layer < self.layers.len(),
            "layer {layer} of {}",
            self.layers.len()
        );
        ensure!(
            weights.pool().device_addr() == self.pool_addr,
            "the attention half was built on other weights"
        );
        ensure!(
            io.caches.layout.plan == self.plans[layer] && io.caches.layout.batch == self.pool_batch,
            "layer {layer}: caches of {:?} for a half built for {:?} x {}",
            io.caches.layout,
            self.plans[layer],
            self.pool_batch
        );
        ensure!(
            io.rows.rows() == self.batch,
            "layer {layer}: row tables of {} rows for a half of {}",
            io.rows.rows(),
            self.batch
        );
        if let Some(n) = io.chunk_rows {
            ensure!(
                (1..=self.batch).contains(&n) && io.rows.single_sequence().is_some(),
                "layer {layer}: a prefill chunk of {n} real rows in {} rows of sequences {:?}",
                self.batch,
                io.rows.seqs
            );
        }
        self.hc_pre(gpu, stream, layer, io)?;
        io.mark(stream, group::ATTN_HC_PRE)?;
        self.projections(gpu, stream, layer, io)?;
        io.mark(stream, group::ATTN_PROJECTIONS)?;
        self.compress(gpu, stream, layer, io)?;
        io.mark(stream, group::ATTN_COMPRESSORS)?;
        self.select(gpu, stream, layer, io)?;
        io.mark(stream, group::ATTN_INDEXER)?;
        self.attend(gpu, stream, layer, io)?;
        io.mark(stream, group::ATTN_SPARSE)?;
        self.output(gpu, stream, layer, io)?;
        io.mark(stream, group::ATTN_OUTPUT)
    }

    /// The sparse-attention group of `layer` (its candidate rows and lengths after a run).
    pub fn group(&self, layer: usize) -> &AttnGroup {
        &self.groups[self.layers[layer].group]
    }

    /// Step 1: hc_pre of `x_in` with `hc_attn_*` and attn_norm -> `a` BF16 (compressors, weights_proj) and its
    /// FP8 1x128 form (wq_a, wkv): the model's `fp8_act_quant(a)` of the BF16 `a`, bit for bit.
    fn hc_pre(&mut self, gpu: &Gpu, stream: &Stream, layer: usize, io: &LayerIo) -> Result<()> {
        let eps = self.config.norm_eps;
        let hc = &self.layers[layer].hc;
        // One finish kernel writes `a` BF16 and its FP8 copy (the bits of quantize_bf16_rows of `a`).
        let copies = mhc::NormCopies {
            fp8: Some(&self.bufs.a_fp8),
            nvfp4: None,
        };
        mhc::mhc_pre_copies(
            gpu,
            stream,
            io.x_in,
            hc,
            eps,
            &self.bufs.mhc,
            &mut self.hc_out,
            copies,
            io.prior_post.as_ref(),
        )
    }

    /// The hc_post this half leaves to the next half's hc_pre when `io.defer_post` (`x_in` is this half's input):
    /// `x_out = post (x) y + comb^T x_in`, `y` the output projection's.
    pub fn pending_post(&self, x_in: &impl DeviceBuf<bf16>) -> PriorPost {
        PriorPost {
            y: self.bufs.y,
            x_prev: DevBuf::of(x_in),
            post: DevBuf::of(&self.hc_out.post),
            comb: DevBuf::of(&self.hc_out.comb),
        }
    }

    /// Steps 2-5: `qa = wq_a a`, `kv_raw = wkv a`, `qr = q_norm(qa)` (FP8), `q = wq_b qr` finished per head
    /// (RMS, RoPE at the position) into [`AttnHalf::q`]; the window KV entry into the ring slot of each sequence's
    /// position; CSA: `qi = indexer.wq_b qr`, `w = bf16(weights_proj a)`, the visible key counts and the indexer
    /// query (rotated FP8 q, head weights with the scale folded in).
    fn projections(&self, gpu: &Gpu, stream: &Stream, layer: usize, io: &LayerIo) -> Result<()> {
        let (l, b, cfg) = (&self.layers[layer], &self.bufs, &self.config);
        let (n, eps) = (self.batch, cfg.norm_eps);
        let a8 = fp8_rows(&b.a_fp8)?;
        // wq_a and wkv both read `a`: one launch.
        let (wq_a, wkv) = (l.wq_a.weight(), l.wkv.weight());
        let jobs = [
            Fp8Job { w: &wq_a, y: &b.qa },
            Fp8Job {
                w: &wkv,
                y: &b.kv_raw,
            },
        ];
        dense::fp8_linears(gpu, stream, &a8, &jobs, &b.dense)?;
        // `qr = q_norm(qa)` as FP8 1x128, read by wq_b and (CSA) the indexer's wq_b in one launch: on the GEMV route
        // the GEMV normalizes and quantizes qa as it stages it (no norm launch).
        let wq_b = l.wq_b.weight();
        let iwq_b = l.indexer.as_ref().map(|ix| ix.wq_b.weight());
        let mut jobs = vec![Fp8Job {
            w: &wq_b,
            y: &b.q_raw,
        }];
        if let (Some(w), Some(ib)) = (&iwq_b, &b.index) {
            jobs.push(Fp8Job { w, y: &ib.qi_raw });
        }
        let norm = Bf16Rows::NormQuantize {
            weight: &l.q_norm,
            eps,
        };
        dense::fp8_linears_of_bf16(
            gpu,
            stream,
            &b.qa,
            norm,
            &fp8_rows(&b.qr)?,
            || qkv_prep::q_lora_norm(gpu, stream, &b.qa, &l.q_norm, eps, &b.qr),
            &jobs,
            &b.dense,
        )?;
        // Every BF16 linear of `a` in one launch: (CSA) the indexer's weights_proj, then each compressor's wkv and
        // wgate (f32; their state updates run in `compress`). Jobs of different heights share one launch.
        let mut jobs = Vec::with_capacity(5);
        if let (Some(ix), Some(ib)) = (&l.indexer, &b.index) {
            jobs.push(Bf16Job {
                w: &ix.weights_proj,
                n: cfg.index_n_heads,
                y: &ib.w_f32,
            });
        }
        let inputs = self.compressor_inputs(layer);
        for c in &inputs {
            let w = c.params.shape.width();
            jobs.push(Bf16Job {
                w: &c.params.wkv,
                n: w,
                y: &c.kv,
            });
            jobs.push(Bf16Job {
                w: &c.params.wgate,
                n: w,
                y: &c.gate,
            });
        }
        if !jobs.is_empty() {
            dense::bf16_linear(gpu, stream, &self.a, n, cfg.dim, &jobs, &b.dense)?;
        }
        // The heads' finish, the window ring entry and (CSA) the indexer query in one launch. One row per ring
        // entry, each at its row's sequence base (a chunk's rows all at its sequence's: their positions are
        // consecutive and span at most PREFILL_CHUNK_MAX <= ring - window + 1, so no two share a slot and no entry
        // the chunk's earlier queries read is overwritten; plan::LayerCachePlan::window_entries).
        let ring = WindowRing {
            pool: &io.caches.pool,
            seq_base: &io.rows.window_base,
            tokens_per_seq: 1,
            window: io.caches.layout.plan.window_entries,
        };
        let index = match (&l.indexer, &b.index) {
            (Some(ix), Some(ib)) => Some(qkv_prep::IndexerQ {
                qi: &ib.qi_raw,
                w_in: &ib.w_f32,
                heads: cfg.index_n_heads,
                w_scale: ix.w_scale,
                q_codes: &ib.query.q,
                w_out: &ib.query.w,
                visible: Some(qkv_prep::VisibleKeys {
                    ratio: ix.compressor.shape.ratio,
                    num_valid: &ib.query.num_valid,
                }),
            }),
            _ => None,
        };
        qkv_prep::prep(
            gpu,
            stream,
            &qkv_prep::Prep {
                rows: n,
                positions: io.positions,
                freqs: &l.rope,
                eps,
                q: Some(qkv_prep::QHeads {
                    q_in: &b.q_raw,
                    heads: cfg.n_heads,
                    q_out: &self.q,
                    rstd: &b.q_rstd,
                }),
                kv: Some(qkv_prep::KvEntries {
                    kv_in: &b.kv_raw,
                    kv_norm: &l.kv_norm,
                    ring: &ring,
                    rstd: &b.kv_rstd,
                }),
                index,
            },
        )
    }

    /// The layer's compressors (main, then the indexer's), each with the batch's rows of its BF16 linears' outputs
    /// ([`AttnHalf::projections`] writes them, [`AttnHalf::compress`] reads them).
    fn compressor_inputs(&self, layer: usize) -> Vec<CompressorInput<'_>> {
        let (l, b, n) = (&self.layers[layer], &self.bufs, self.batch);
        let mut v = Vec::with_capacity(2);
        if let Some(main) = &l.compressor {
            let w = main.shape.width();
            v.push(CompressorInput {
                params: main,
                kv: b.comp_kv.sub(0, n * w),
                gate: b.comp_gate.sub(0, n * w),
                indexer: false,
            });
        }
        if let (Some(ix), Some(ib)) = (&l.indexer, &b.index) {
            let w = ix.compressor.shape.width();
            v.push(CompressorInput {
                params: &ix.compressor,
                kv: ib.comp_kv.sub(0, n * w),
                gate: ib.comp_gate.sub(0, n * w),
                indexer: true,
            });
        }
        v
    }

    /// Steps 6-7: each compressor's state update from its inputs (`wkv a`, `wgate a`, computed in
    /// [`AttnHalf::projections`]; the kernel adds the position's `ape` row), which every m-th position finalizes
    /// an entry into the sequence's compressed block of the pool (CSA: also the indexer key into its key cache).
    fn compress(&self, gpu: &Gpu, stream: &Stream, layer: usize, io: &LayerIo) -> Result<()> {
        let (b, c, r) = (&self.bufs, io.caches, io.rows);
        let n = self.batch;
        for input in self.compressor_inputs(layer) {
            let (state, slots, cache) = if input.indexer {
                let Some(ic) = &c.index else {
                    bail!("layer {layer} is CSA but its caches hold no indexer keys")
                };
                let slots = EntrySlots {
                    base: DevBuf::of(&r.key_base),
                    capacity: DevBuf::of(&r.key_capacity),
                };
                (&ic.state, slots, EntryCache::index(&ic.keys))
            } else {
                let slots = EntrySlots {
                    base: DevBuf::of(&r.compressed_base),
                    capacity: DevBuf::of(&r.compressed_capacity),
                };
                (&c.state, slots, EntryCache::kv(&c.pool))
            };
            let (cp, kv, gate) = (input.params, input.kv, input.gate);
            let dio = DecodeIo {
                batch: n,
                kv,
                gate,
                positions: DevBuf::of(io.positions),
                state: DevBuf::of(state),
                slots,
                cache,
                pooled: None,
                error: b.error,
            };
            match io.chunk_rows {
                None => compressor::decode_step(gpu, stream, &cp.shape, &cp.weights, &dio)?,
                Some(real) => {
                    let seq = r.single_sequence().expect("checked in run");
                    compress_chunk(gpu, stream, cp, &dio, seq, real)?
                }
            }
        }
        Ok(())
    }

    /// Step 8 (CSA): the indexer's logits over each sequence's visible keys (the counts of step 5) and their
    /// top-k: `min(k, visible)` indices in score order, then -1.
    fn select(&self, gpu: &Gpu, stream: &Stream, layer: usize, io: &LayerIo) -> Result<()> {
        let (Some(_), Some(ib)) = (&self.layers[layer].indexer, &self.bufs.index) else {
            return Ok(());
        };
        let Some(ic) = &io.caches.index else {
            bail!("layer {layer} is CSA but its caches hold no indexer keys")
        };
        // A chunk's rows all score its sequence's keys (each row up to its own visible count); a decode batch's
        // row b scores sequence b's (the identity, no map).
        let key_seq = io.chunk_rows.map(|_| &io.rows.key_seq);
        indexer::logits_mapped(
            gpu,
            stream,
            &ib.query,
            &ic.keys,
            key_seq,
            &ib.scores,
            ib.score_stride,
        )?;
        if fuses_topk(ib.score_stride) {
            return Ok(()); // step 9's candidate build takes the top-k (Compressed::Scores)
        }
        indexer::topk(
            gpu,
            stream,
            &ib.scores,
            &ib.query.num_valid,
            &ib.topk,
            &ib.top_idx,
            &ib.top_score,
        )
    }

    /// Step 9: each sequence's candidate row ([`build_candidates`]), then sparse attention over it with the
    /// layer's sink and the inverse RoPE at the position into [`AttnHalf::o`].
    fn attend(&mut self, gpu: &Gpu, stream: &Stream, layer: usize, io: &LayerIo) -> Result<()> {
        let l = &self.layers[layer];
        let g = &self.groups[l.group];
        let num_valid = self
            .bufs
            .index
            .as_ref()
            .map(|ib| DevBuf::of(&ib.query.num_valid));
        let compressed = match (l.kind, &self.bufs.index, &num_valid) {
            (LayerKind::SlidingWindow, ..) => Compressed::None,
            (LayerKind::Hca { .. }, ..) => Compressed::AllVisible,
            (LayerKind::Csa { .. }, Some(ib), Some(nv)) if fuses_topk(ib.score_stride) => {
                Compressed::Scores(ScoreRows {
                    scores: &ib.scores,
                    score_stride: ib.score_stride,
                    num_valid: nv,
                    k: ib.topk.k,
                    idx: &ib.top_idx,
                    score: &ib.top_score,
                })
            }
            (LayerKind::Csa { .. }, Some(ib), _) => Compressed::TopK {
                idx: &ib.top_idx,
                k: ib.topk.k,
            },
            (LayerKind::Csa { .. }, None, _) => {
                bail!("layer {layer} is CSA without indexer buffers")
            }
        };
        build_candidates(
            gpu,
            stream,
            io.positions,
            io.caches,
            io.rows,
            compressed,
            &g.candidates,
            &g.lengths,
            g.shape.stride,
        )?;
        let inputs = DecodeInputs {
            q: &self.q,
            pool: &io.caches.pool,
            candidates: &g.candidates,
            lengths: &g.lengths,
            positions: io.positions,
            sinks: &l.sink,
            freqs: &l.rope_f32,
        };
        sparse_attn::decode(
            gpu,
            stream,
            sparse_attn::Path::Fp8,
            &g.shape,
            &inputs,
            &g.ws,
            &mut self.o,
        )
    }

    /// Steps 10-11: `z = wo_a o` per output group (BF16 o, FP8 weight), `z` -> FP8 1x128, `y = wo_b z`, then
    /// hc_post of `y` with step 1's post and comb over `x_in` into `x_out`.
    fn output(&self, gpu: &Gpu, stream: &Stream, layer: usize, io: &LayerIo) -> Result<()> {
        let (l, b, cfg) = (&self.layers[layer], &self.bufs, &self.config);
        let n = self.batch;
        dense::wo_a_grouped(
            gpu,
            stream,
            &self.o,
            n,
            &l.wo_a.weight(),
            cfg.o_groups,
            &b.dense,
            &b.z,
        )?;
        // `z` -> FP8 1x128 -> wo_b: on the GEMV route the GEMV quantizes z as it stages it (no quantizer launch).
        let wo_b = l.wo_b.weight();
        dense::fp8_linears_of_bf16(
            gpu,
            stream,
            &b.z,
            Bf16Rows::Quantize,
            &fp8_rows(&b.z_fp8)?,
            || norm_quant::quantize_bf16_rows(gpu, stream, &b.z, &b.z_fp8),
            &[Fp8Job { w: &wo_b, y: &b.y }],
            &b.dense,
        )?;
        if io.defer_post {
            return Ok(());
        }
        mhc::mhc_post(
            gpu,
            stream,
            &b.y,
            io.x_in,
            &self.hc_out.post,
            &self.hc_out.comb,
            n,
            cfg.dim,
            io.x_out,
        )
    }

    /// Fills every intermediate output of the half with 0xFF (NaN in f32 / BF16 / e4m3, -1 in i32) on `stream`, so
    /// a test sees any that a run fails to write. The caches, the dense tile counters and the top-k protocol
    /// buffers (which must stay zero between calls) are left alone.
    pub fn poison(&mut self, gpu: &Gpu, stream: &Stream) -> Result<()> {
        let b = &self.bufs;
        let p = |d: &DevBuf<u8>| arena::fill(stream, d, 0xFF);
        fn bytes<T>(d: &DevBuf<T>) -> DevBuf<u8> {
            // SAFETY: the same memory, viewed as bytes.
            unsafe { DevBuf::from_raw(d.device_addr(), d.bytes()) }
        }
        let rows = |r: &RowsOut| -> Vec<DevBuf<u8>> {
            let mut v = vec![bytes(&r.rstd)];
            match &r.q {
                QuantView::Fp8 { data, scales } => v.extend([*data, *scales]),
                QuantView::Bf16 { y } => v.push(bytes(y)),
                QuantView::Nvfp4 {
                    data,
                    scales,
                    global_scale,
                } => v.extend([*data, *scales, bytes(global_scale)]),
            }
            v
        };
        let mut all: Vec<DevBuf<u8>> = vec![
            bytes(&b.qa),
            bytes(&b.kv_raw),
            bytes(&b.q_raw),
            bytes(&b.q_rstd),
            bytes(&b.kv_rstd),
            bytes(&b.comp_kv),
            bytes(&b.comp_gate),
            bytes(&b.z),
            bytes(&b.y),
        ];
        for r in [&b.a_fp8, &b.qr, &b.z_fp8] {
            all.extend(rows(r));
        }
        if let Some(ib) = &b.index {
            all.extend([
                bytes(&ib.qi_raw),
                bytes(&ib.w_f32),
                bytes(&ib.comp_kv),
                bytes(&ib.comp_gate),
                bytes(&ib.scores),
                bytes(&ib.top_idx),
                bytes(&ib.top_score),
                bytes(&DevBuf::of(&ib.query.q)),
                bytes(&DevBuf::of(&ib.query.w)),
                bytes(&DevBuf::of(&ib.query.num_valid)),
            ]);
        }
        for g in &self.groups {
            all.extend([
                bytes(&DevBuf::of(&g.candidates)),
                bytes(&DevBuf::of(&g.lengths)),
            ]);
        }
        all.extend([bytes(&DevBuf::of(&self.q)), bytes(&DevBuf::of(&self.o))]);
        for d in &all {
            p(d)?;
        }
        // Step 1's owned outputs are poisoned on the GPU's stream: order it with `stream`'s work.
        stream.synchronize()?;
        self.hc_out.poison(gpu)?;
        gpu.synchronize()
    }
}

/// FP8 1x128 rows of a row output (the dense linears' activation view).
fn fp8_rows(r: &RowsOut) -> Result<Fp8Rows<'_>> {
    let QuantView::Fp8 { data, scales } = &r.q else {
        bail!("expected FP8 rows, got {}", r.format.name())
    };
    Ok(Fp8Rows {
        codes: data,
        scales,
        rows: r.rows,
        k: r.d,
    })
}

/// A prefill chunk's compressor step (one compressor of a layer): `compressor::chunk` over the chunk's `real` rows
/// (row i at position p0 + i, p0 = row 0's position, read on the device) continuing the sequence's state: the
/// entries whose blocks end in the chunk, then the state as `real` decode steps leave it, in two launches; the
/// kernels' contract is that of `real` decode steps bit for bit (kernels/compressor.cu; host twin
/// `compressor::reference::chunk_host`, checked against the CPU state's pushes). The padding rows (copies of the
/// last real row) are not read: a second update with the last token would advance the state twice.
fn compress_chunk(
    gpu: &Gpu,
    stream: &Stream,
    cp: &CompressorParams,
    dio: &DecodeIo,
    seq: usize,
    real: usize,
) -> Result<()> {
    let (w, floats) = (cp.shape.width(), cp.shape.state_floats());
    ensure!(
        (1..=dio.batch).contains(&real) && dio.state.len() >= (seq + 1) * floats,
        "compressor chunk: {real} rows of {} over a state of {} floats for sequence {seq}",
        dio.batch,
        dio.state.len()
    );
    let io = compressor::ChunkIo {
        n: real,
        kv: dio.kv.sub(0, real * w),
        gate: dio.gate.sub(0, real * w),
        positions: dio.positions.sub(0, 1),
        state: dio.state.sub(seq * floats, floats),
        slots: EntrySlots {
            base: dio.slots.base.sub(0, 1),
            capacity: dio.slots.capacity.sub(0, 1),
        },
        cache: dio.cache,
        error: dio.error,
    };
    compressor::chunk(gpu, stream, &cp.shape, &cp.weights, &io)
}

// ---- the glue launchers (kernels/engine_attn.cu) --------------------------------------------------------------

/// The host twin of the visible key counts `qkv_prep::indexer_q` writes: the indexer keys a query at each position
/// sees, `(t + 1) / ratio` (`LayerCacheLayout::compressed_after`), 0 for an idle slot.
pub fn visible_keys(positions: &[i32], ratio: usize) -> Vec<i32> {
    positions
        .iter()
        .map(|&t| if t >= 0 { (t + 1) / ratio as i32 } else { 0 })
        .collect()
}

/// Which compressed entries a query attends to besides its window (the candidate builder's mode).
#[derive(Clone, Copy, Debug)]
pub enum Compressed<'a> {
    /// Sliding-window layers: none.
    None,
    /// CSA: the indexer's top-k rows `[batch, k]` (`min(k, visible)` indices in score order, then -1), which the
    /// builder sorts ascending (the model sorts its selection).
    TopK { idx: &'a DevBuf<i32>, k: usize },
    /// HCA: every visible entry `0..(t + 1) / ratio`.
    AllVisible,
    /// CSA with score rows of at most [`FUSED_TOPK_MAX_KEYS`] keys ([`fuses_topk`]): the builder takes each row's
    /// top-k itself ([`ScoreRows`]).
    Scores(ScoreRows<'a>),
}

/// A CSA layer's indexer scores `[batch, score_stride]` and visible counts `[batch]`, from which
/// `attn_candidates_topk` takes each row's top-k inside the candidate build (one launch for `indexer::topk`'s three
/// and `attn_candidates`), and where it writes the top-k rows `idx` / `score` `[batch, k]` with `indexer::topk`'s
/// contract, bit for bit.
#[derive(Clone, Copy, Debug)]
pub struct ScoreRows<'a> {
    pub scores: &'a DevBuf<f32>,
    pub score_stride: usize,
    pub num_valid: &'a DevBuf<i32>,
    pub k: usize,
    pub idx: &'a DevBuf<i32>,
    pub score: &'a DevBuf<f32>,
}

/// The longest score row `attn_candidates_topk` selects from (`kTopkThreads * kTopkPerThread` entries sorted in one
/// CTA's shared memory): a CSA layer whose indexer holds at most this many keys a sequence takes [`Compressed::Scores`]
/// (Flash and Pro at 4K context: 1,024 keys), a longer one `indexer::topk` then [`Compressed::TopK`].
pub const FUSED_TOPK_MAX_KEYS: usize = 4096;

/// Block size of `attn_candidates_topk` (`kTopkThreads`).
const FUSED_TOPK_THREADS: u32 = 1024;

/// Whether a CSA layer with score rows of `score_stride` keys takes its top-k inside the candidate build.
pub fn fuses_topk(score_stride: usize) -> bool {
    score_stride <= FUSED_TOPK_MAX_KEYS
}

/// The longest top-k row `attn_candidates` sorts, rounded up to a power of two (kernels/engine_attn.cu:
/// `kAttnGlueThreads * kSortPerThread`).
const MAX_SORTED_SELECTION: usize = 2048;

/// `attn_candidates`: each row's candidate row for `sparse_attn::decode` from its position (device) and its
/// sequence's bases (`rows`): the window ring slots (`p mod window_entries`) of positions `max(0, t - W + 1) ..=
/// t` oldest first (W the attention window), then the compressed entries of `compressed` as pool indices
/// (ascending), then -1 up to `stride`; `lengths[b]` the count (0 for a position < 0). The host twin is
/// `LayerCacheLayout::row_candidate_rows` (with the selections sorted). `stride` must hold the longest list the
/// layer can produce ([`candidate_stride`]).
#[allow(clippy::too_many_arguments)]
pub fn build_candidates(
    gpu: &Gpu,
    stream: &Stream,
    positions: &impl DeviceBuf<i32>,
    caches: &LayerCaches,
    rows: &RowTables,
    compressed: Compressed<'_>,
    candidates: &impl DeviceBuf<i32>,
    lengths: &impl DeviceBuf<i32>,
    stride: usize,
) -> Result<()> {
    let lay = &caches.layout;
    let batch = rows.rows();
    ensure!(
        positions.elems() == batch && lengths.elems() >= batch,
        "attn_candidates: {} positions and {} lengths for a batch of {batch}",
        positions.elems(),
        lengths.elems()
    );
    ensure!(
        candidates.elems() >= batch * stride && batch * stride <= i32::MAX as usize,
        "attn_candidates: {} candidates for {batch} rows of {stride}",
        candidates.elems()
    );
    let ratio = lay.ratio();
    let (mode, sel, k, longest) = match compressed {
        Compressed::None => (0, None, 0, 0),
        Compressed::Scores(ScoreRows { k, .. }) => (1, None, k, k),
        Compressed::TopK { idx, k } => {
            ensure!(
                (1..=indexer::TOPK_MAX_K).contains(&k) && idx.len() >= batch * k,
                "attn_candidates: top-k rows of {k} in {} indices",
                idx.len()
            );
            (1, Some(idx), k, k)
        }
        Compressed::AllVisible => (2, None, 0, lay.plan.compressed_entries),
    };
    ensure!(
        mode == 0 || ratio >= 1,
        "attn_candidates: compressed candidates on a layer without compression"
    );
    ensure!(
        stride >= lay.plan.window + longest,
        "attn_candidates: stride {stride} is shorter than the window {} + {longest} compressed entries",
        lay.plan.window
    );
    ensure!(
        (1..=lay.plan.window_entries).contains(&lay.plan.window),
        "attn_candidates: a window of {} in a ring of {}",
        lay.plan.window,
        lay.plan.window_entries
    );
    ensure!(
        rows.window_base.len() >= batch && rows.compressed_base.len() >= batch,
        "attn_candidates: the row tables hold {} / {} entries for {batch} rows",
        rows.window_base.len(),
        rows.compressed_base.len()
    );
    if let Compressed::Scores(fused) = compressed {
        return fused.launch(
            gpu, stream, positions, caches, rows, candidates, lengths, stride,
        );
    }
    let sort_n = if k == 0 { 0 } else { k.next_power_of_two() };
    ensure!(
        sort_n <= MAX_SORTED_SELECTION,
        "attn_candidates: a top-k of {k} sorts {sort_n} entries; the kernel sorts at most {MAX_SORTED_SELECTION} \
         (8 a thread)"
    );
    let smem = 4 * sort_n;
    let kern = gpu.kernel_with_smem(FAMILY, "attn_candidates", smem)?;
    let mut a = window_args(positions, lay, rows);
    a.i32(ratio.max(1) as i32).i32(mode);
    match sel {
        Some(idx) => a.buf(idx),
        None => a.null(),
    };
    a.i32(k as i32)
        .i32(sort_n as i32)
        .buf(candidates)
        .i32(stride as i32)
        .buf(lengths);
    let l = Launch::new((batch as u32, 1, 1), (GLUE_THREADS, 1, 1)).smem(smem);
    // SAFETY: the kernel's parameter list; CTA b < batch reads positions / bases [b] (arrays of `batch`), top-k
    // row b (`batch * k` checked), and writes row b of `stride` (`batch * stride` checked) and lengths[b].
    unsafe { launch(stream, &kern, l, &mut a) }
}

/// The leading arguments of both candidate kernels: positions, the window bases, the window and its ring length,
/// the compressed bases.
fn window_args(
    positions: &impl DeviceBuf<i32>,
    lay: &LayerCacheLayout,
    rows: &RowTables,
) -> KernelArgs {
    let mut a = KernelArgs::new();
    a.buf(positions)
        .buf(&rows.window_base)
        .i32(lay.plan.window as i32)
        .i32(lay.plan.window_entries as i32)
        .buf(&rows.compressed_base);
    a
}

impl ScoreRows<'_> {
    /// `attn_candidates_topk`'s launch (the common checks of [`build_candidates`] passed).
    #[allow(clippy::too_many_arguments)]
    fn launch(
        &self,
        gpu: &Gpu,
        stream: &Stream,
        positions: &impl DeviceBuf<i32>,
        caches: &LayerCaches,
        rows: &RowTables,
        candidates: &impl DeviceBuf<i32>,
        lengths: &impl DeviceBuf<i32>,
        stride: usize,
    ) -> Result<()> {
        let (lay, batch, k) = (&caches.layout, rows.rows(), self.k);
        ensure!(
            (1..=FUSED_TOPK_MAX_KEYS).contains(&self.score_stride),
            "attn_candidates_topk: score rows of {} keys; the one-CTA top-k takes 1..={FUSED_TOPK_MAX_KEYS} (longer \
             rows go through indexer::topk)",
            self.score_stride
        );
        ensure!(
            (1..=indexer::TOPK_MAX_K).contains(&k)
                && self.idx.len() >= batch * k
                && self.score.len() >= batch * k,
            "attn_candidates_topk: top-k rows of {k} in {} indices / {} scores for {batch} rows",
            self.idx.len(),
            self.score.len()
        );
        ensure!(
            self.scores.len() >= batch * self.score_stride && self.num_valid.len() >= batch,
            "attn_candidates_topk: {} scores and {} visible counts for {batch} rows of {}",
            self.scores.len(),
            self.num_valid.len(),
            self.score_stride
        );
        let sort_n = self.score_stride.next_power_of_two();
        let smem = 8 * sort_n;
        let kern = gpu.kernel_with_smem(FAMILY, "attn_candidates_topk", smem)?;
        let mut a = window_args(positions, lay, rows);
        a.buf(self.scores)
            .i32(self.score_stride as i32)
            .buf(self.num_valid)
            .i32(k as i32)
            .i32(sort_n as i32)
            .buf(self.idx)
            .buf(self.score)
            .buf(candidates)
            .i32(stride as i32)
            .buf(lengths);
        let l = Launch::new((batch as u32, 1, 1), (FUSED_TOPK_THREADS, 1, 1)).smem(smem);
        // SAFETY: the kernel's parameter list; CTA b < batch reads positions / bases / num_valid [b] (`batch` each),
        // score row b (`batch * score_stride` checked), writes top-k row b (`batch * k` checked), candidate row b
        // (`batch * stride`, checked by the caller) and lengths[b].
        unsafe { launch(stream, &kern, l, &mut a) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cache::LayerCacheLayout;

    /// The visible key counts follow the cache layout's emission rule, and the candidate stride holds the longest
    /// list of every layer kind at the last position of the context.
    #[test]
    fn visible_keys_and_strides_cover_the_context() {
        let mut cfg = ModelConfig::small();
        cfg.window_size = 24;
        cfg.compress_ratios = vec![0, 0, 4, 8, 4, 8];
        let (batch, context) = (2, 64);
        for l in 0..cfg.n_layers {
            let plan = LayerCachePlan::of(&cfg, l, context);
            let lay = LayerCacheLayout { plan, batch };
            let stride = candidate_stride(&plan, cfg.index_topk);
            if lay.ratio() > 0 {
                let pos: Vec<i32> = (-1..context as i32).collect();
                let got = visible_keys(&pos, lay.ratio());
                for (&p, &g) in pos.iter().zip(&got) {
                    let want = if p < 0 {
                        0
                    } else {
                        lay.compressed_after(p as usize)
                    };
                    assert_eq!(g as usize, want, "layer {l} position {p}");
                }
            }
            let last = context - 1;
            let longest: Vec<usize> = match plan.kind {
                LayerKind::SlidingWindow => vec![],
                LayerKind::Csa { .. } => {
                    (0..cfg.index_topk.min(lay.compressed_after(last))).collect()
                }
                LayerKind::Hca { .. } => (0..lay.compressed_after(last)).collect(),
            };
            let (rows, lengths) = lay
                .candidate_rows(&[last as i32, 3], &[longest.clone(), vec![]], stride)
                .unwrap();
            assert_eq!(
                lengths[0] as usize, stride,
                "layer {l}: the last position fills the row"
            );
            assert_eq!(rows.len(), batch * stride);
        }
    }
}
