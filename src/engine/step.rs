//! The decode step of a batch of sequences (docs/engine.md, "The decode step").
//!
//! [`DecodeState`] is everything a step reads and writes on the device: the residual `x` (4 mHC streams, BF16
//! `[B, 4, D]`), the positions `[B]` i32, the token ids that feed the embedding (the sampler's `next`), the KV
//! pool ([`KvPool`]), the sampler's state, and one [`Arena`] carved once for the step's workspaces. Every launch
//! reads its counts and positions from the device, so a step can be captured into a CUDA graph and replayed.
//!
//! A layer is two halves, each reading one residual buffer and writing the other (hc_post reads all four streams
//! of a token before writing them, so it does not run in place): the attention half ([`AttnHalf`], steps 1-11)
//! `x -> x_mid`, the FFN half ([`FfnHalf`], steps 12-16) `x_mid -> x`. The parity hooks load a residual from
//! the CPU model's trace into either buffer and read them and the logits back.

use crate::engine::attn::AttnHalf;
use crate::engine::cache::KvPool;
use crate::engine::ffn::FfnHalf;
use crate::engine::io::{group, LayerIo, Residual, StepMarks, StepShape, STREAMS};
use crate::engine::plan::{IndexKeyFormat, LayerCachePlan};
use crate::engine::weights::DeviceWeights;
use crate::gpu::arena::{self, Arena, WorkspaceLayout};
use crate::gpu::{DevBuf, Gpu, Stream};
use crate::model::ModelConfig;
use crate::ops::dense::{self, Bf16Job, DenseKind, DenseShape, DenseWorkspace};
use crate::ops::head::{self, EmbedShape};
use crate::ops::mhc::{MhcPreOutputs, MhcWeights, MhcWorkspace};
use crate::ops::norm_quant::{OutFormat, QuantView};
use crate::ops::sampler::{self, SamplerState, SamplerWorkspace};
use anyhow::{bail, ensure, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

/// The LM head's linear: `[B, D] x head.weight [vocab, D]^T -> f32 [B, vocab]`.
pub fn lm_head_shape(cfg: &ModelConfig, shape: &StepShape) -> DenseShape {
    DenseShape::new(DenseKind::Bf16, shape.batch, cfg.vocab_size, cfg.dim, 1)
}

/// [`DecodeState::read_error`] bit: an embedding id was outside the vocabulary.
pub const ERR_EMBED_ID: u32 = 1;
/// [`DecodeState::read_error`] bit: a compressor's entry fell outside its cache.
pub const ERR_CACHE_FULL: u32 = 2;

/// The step's arena: every workspace and per-step buffer ([`StepWorkspace::carve`], then the halves' carves in
/// [`AttnHalf::new`] and [`FfnHalf::new`]; each carve is rounded on its own, so the total does not depend on the
/// order). `sm_count`: the dense linears' split plan depends on it.
pub fn step_layout(
    cfg: &ModelConfig,
    shape: &StepShape,
    sm_count: usize,
) -> Result<WorkspaceLayout> {
    let s = shape.sampler(cfg);
    let mut l = WorkspaceLayout::new();
    for part in [
        SamplerState::layout(&s),
        SamplerWorkspace::layout(&s),
        MhcWorkspace::layout(shape.batch, cfg.dim),
        dense::workspace_layout(&[lm_head_shape(cfg, shape)], sm_count)?,
        AttnHalf::layout(cfg, shape, sm_count)?,
        FfnHalf::layout(cfg, shape, sm_count)?,
    ] {
        l.add_bytes(part.bytes());
    }
    // The step's error word (embedding ids out of range) and the logits f32 [B, vocab].
    l.add::<u32>(1).add::<f32>(shape.batch * cfg.vocab_size);
    Ok(l)
}

/// Bytes of the step's arena.
pub fn workspace_bytes(cfg: &ModelConfig, shape: &StepShape, sm_count: usize) -> Result<usize> {
    Ok(step_layout(cfg, shape, sm_count)?.bytes())
}

/// The buffers carved from the step's arena.
pub struct StepWorkspace {
    pub sampler: SamplerState,
    pub sampler_ws: SamplerWorkspace,
    /// The final norm's (`hc_head`) split-K partials.
    pub head_mhc: MhcWorkspace,
    /// The LM head's split-K partials and tile counters.
    pub lm_head: DenseWorkspace,
    /// u32 `[1]`: set by the embedding when an id is outside the vocabulary.
    pub error: DevBuf<u32>,
    /// f32 `[B, vocab]`: the LM head's output, the sampler's input.
    pub logits: DevBuf<f32>,
}

impl StepWorkspace {
    pub fn carve(
        arena: &mut Arena,
        stream: &Stream,
        cfg: &ModelConfig,
        shape: &StepShape,
        sm_count: usize,
    ) -> Result<StepWorkspace> {
        let s = shape.sampler(cfg);
        Ok(StepWorkspace {
            sampler: SamplerState::carve(arena, &s)?,
            sampler_ws: SamplerWorkspace::carve(arena, &s)?,
            head_mhc: MhcWorkspace::carve(arena, shape.batch, cfg.dim)?,
            lm_head: DenseWorkspace::carve(arena, stream, &[lm_head_shape(cfg, shape)], sm_count)?,
            error: arena.carve(1, "step error word")?,
            logits: arena.carve(shape.batch * cfg.vocab_size, "logits")?,
        })
    }
}

/// What runs a layer's FFN half inside the step loop ([`DecodeState::decode_step_with`]): the state and the layer.
pub type FfnRunner<'a> = dyn FnMut(&mut DecodeState, usize) -> Result<()> + 'a;

/// The two halves of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Half {
    Attention,
    Ffn,
}

/// The device state of a decode batch (module docs).
pub struct DecodeState {
    pub config: ModelConfig,
    pub shape: StepShape,
    /// BF16 `[B, 4, D]`: the residual streams entering the next layer.
    pub x: CudaSlice<bf16>,
    /// BF16 `[B, 4, D]`: the residual between a layer's attention and FFN halves.
    pub x_mid: CudaSlice<bf16>,
    /// i32 `[B]`: the position each sequence's next token takes (< 0: an idle slot).
    pub positions: CudaSlice<i32>,
    pub caches: KvPool,
    pub arena: Arena,
    pub ws: StepWorkspace,
    /// The final norm's weights (`hc_head_fn`, `hc_head_scale`, `hc_head_base`, `norm.weight`) and outputs.
    pub head_weights: MhcWeights,
    pub head_out: MhcPreOutputs,
    pub attn: AttnHalf,
    pub ffn: FfnHalf,
    /// Set while a step is being profiled ([`crate::engine::run::Engine::profile_step`]): every group of kernels
    /// records an event after it.
    pub marks: Option<StepMarks>,
}

impl DecodeState {
    /// Allocates the state of `shape` for `weights`' model: caches per the plan's layer plans re-sized to
    /// `shape.context`, residual and positions, and the step's arena (carved once here).
    pub fn new(gpu: &Gpu, weights: &DeviceWeights, shape: StepShape) -> Result<DecodeState> {
        let cfg = weights.plan.config.clone();
        shape.check(&cfg)?;
        let plans: Vec<LayerCachePlan> = (0..cfg.n_layers)
            .map(|l| LayerCachePlan::of(&cfg, l, shape.context))
            .collect();
        let keys: IndexKeyFormat = weights.plan.request.index_keys;
        let caches = KvPool::new(gpu, &cfg, &plans, shape.batch, keys)?;
        let sm_count = gpu.info.sm_count as usize;
        let mut arena = Arena::new(gpu, workspace_bytes(&cfg, &shape, sm_count)?)?;
        let ws = StepWorkspace::carve(&mut arena, &gpu.stream, &cfg, &shape, sm_count)?;
        ws.lm_head.prepare(gpu)?;
        let attn = AttnHalf::new(gpu, weights, &shape, &mut arena)?;
        let ffn = FfnHalf::new(gpu, weights, &shape, &mut arena)?;
        // The mHC launchers take owned weights, so the head's small tensors are read back from the pool and
        // uploaded once (views into the pool once `MhcWeights` takes `DevBuf`s).
        let s = &gpu.stream;
        let base = weights.host_f32(s, "hc_head_base")?;
        let base: [f32; STREAMS] = base.as_slice().try_into().map_err(|_| {
            anyhow::anyhow!("hc_head_base has {} values, expected {STREAMS}", base.len())
        })?;
        let scale = weights.host_f32(s, "hc_head_scale")?;
        ensure!(
            scale.len() == 1,
            "hc_head_scale has {} values, expected 1",
            scale.len()
        );
        let head_weights = MhcWeights::upload_head(
            gpu,
            &weights.host_f32(s, "hc_head_fn")?,
            scale[0],
            &base,
            &weights.host_f32(s, "norm.weight")?,
            cfg.dim,
        )?;
        let head_out = MhcPreOutputs::alloc_poisoned(gpu, OutFormat::Bf16, shape.batch, cfg.dim)?;
        let positions = gpu.upload(&vec![-1i32; shape.batch])?;
        // The set-up above ran on the GPU's stream; a step may run on another.
        gpu.synchronize()?;
        ws.sampler.clear(&gpu.stream)?;
        arena::fill(&gpu.stream, &ws.error, 0)?;
        Ok(DecodeState {
            x: gpu.zeros(shape.residual_elems(&cfg))?,
            x_mid: gpu.zeros(shape.residual_elems(&cfg))?,
            positions,
            attn,
            ffn,
            marks: None,
            caches,
            arena,
            ws,
            head_weights,
            head_out,
            shape,
            config: cfg,
        })
    }

    /// Sets every sequence's position (host -> device, ordered on `stream`; between graph replays the step
    /// advances them on the device). Fails when a position needs more cache than the state holds.
    pub fn set_positions(&self, stream: &Stream, positions: &[i32]) -> Result<()> {
        ensure!(
            positions.len() == self.shape.batch,
            "{} positions for a batch of {}",
            positions.len(),
            self.shape.batch
        );
        for &p in positions.iter().filter(|&&p| p >= 0) {
            ensure!(
                (p as usize) < self.shape.context,
                "position {p} is outside the context of {}",
                self.shape.context
            );
            for layer in &self.caches.layers {
                layer.layout.check_position(p as usize)?;
            }
        }
        arena::upload(stream, &self.positions, positions)
    }

    /// Sets the token ids the next embedding reads (the sampler's `next`, which the sampler overwrites each step).
    pub fn set_tokens(&self, stream: &Stream, ids: &[u32]) -> Result<()> {
        ensure!(
            ids.len() == self.shape.batch,
            "{} token ids for a batch of {}",
            ids.len(),
            self.shape.batch
        );
        let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
        arena::upload(stream, &self.ws.sampler.next, &ids)
    }

    /// Step 0: the embedding of the ids in the sampler's `next` into every stream of `x`.
    pub fn embed(&self, gpu: &Gpu, stream: &Stream, weights: &DeviceWeights) -> Result<()> {
        let cfg = &self.config;
        let table = weights.typed::<bf16>("embed.weight")?;
        let shape = EmbedShape {
            tokens: self.shape.batch,
            vocab: cfg.vocab_size,
            dim: cfg.dim,
        };
        head::embed_tokens(
            gpu,
            stream,
            &self.ws.sampler.next,
            &table,
            &shape,
            &self.x,
            &self.ws.error,
        )
    }

    /// Steps 1-11 of `layer`: `x -> x_mid`, the layer's caches updated.
    pub fn attention_half(
        &mut self,
        gpu: &Gpu,
        stream: &Stream,
        weights: &DeviceWeights,
        layer: usize,
    ) -> Result<()> {
        self.run_half(Half::Attention, gpu, stream, weights, layer, false)
    }

    /// Steps 12-16 of `layer`: `x_mid -> x`.
    pub fn ffn_half(
        &mut self,
        gpu: &Gpu,
        stream: &Stream,
        weights: &DeviceWeights,
        layer: usize,
    ) -> Result<()> {
        self.run_half(Half::Ffn, gpu, stream, weights, layer, false)
    }

    /// One half of `layer`. Unlinked, it reads its input residual and writes its output one. `linked`: the halves of
    /// a whole step, each leaving its hc_post to the next half's hc_pre (`LayerIo::prior_post`, one launch fewer a
    /// boundary), except the last FFN half, whose output the head reads. The pending post's `x_prev` is the previous
    /// half's input: this half's output buffer (they alternate).
    fn run_half(
        &mut self,
        half: Half,
        gpu: &Gpu,
        stream: &Stream,
        weights: &DeviceWeights,
        layer: usize,
        linked: bool,
    ) -> Result<()> {
        let last = layer + 1 == self.config.n_layers;
        let (mut io, attn, ffn) = self.layer_parts(half, layer)?;
        if linked {
            io.prior_post = match half {
                Half::Attention => (layer > 0).then(|| ffn.pending_post(io.x_out)),
                Half::Ffn => Some(attn.pending_post(io.x_out)),
            };
            io.defer_post = half == Half::Attention || !last;
        }
        match half {
            Half::Attention => attn.run(gpu, stream, weights, layer, &io),
            Half::Ffn => ffn.run(gpu, stream, weights, layer, &io),
        }
    }

    /// The inputs and outputs of `half` of `layer` (the attention half reads `x` and writes `x_mid`, the FFN half
    /// the reverse) beside the two halves themselves, borrowed apart so that a caller can run either half on them
    /// (the expert-parallel step runs the FFN half in pieces).
    pub fn layer_parts(
        &mut self,
        half: Half,
        layer: usize,
    ) -> Result<(LayerIo<'_>, &mut AttnHalf, &mut FfnHalf)> {
        ensure!(
            layer < self.config.n_layers,
            "layer {layer} of {}",
            self.config.n_layers
        );
        let DecodeState {
            x,
            x_mid,
            positions,
            ws,
            caches,
            marks,
            attn,
            ffn,
            ..
        } = self;
        let (x_in, x_out) = match half {
            Half::Attention => (&*x, &*x_mid),
            Half::Ffn => (&*x_mid, &*x),
        };
        let io = LayerIo {
            x_in,
            x_out,
            positions,
            tokens: ws.sampler.next,
            caches: &caches.layers[layer],
            rows: &caches.layers[layer].rows,
            chunk_rows: None,
            marks: marks.as_ref(),
            prior_post: None,
            defer_post: false,
        };
        Ok((io, attn, ffn))
    }

    /// Steps 17-18: `hc_head` + final norm of `x` -> `u` BF16 `[B, D]`, then the LM head `logits = head.weight u`
    /// into `ws.logits` f32 `[B, vocab]`.
    pub fn head(&mut self, gpu: &Gpu, stream: &Stream, weights: &DeviceWeights) -> Result<()> {
        let cfg = &self.config;
        head::final_norm(
            gpu,
            stream,
            &self.x,
            &self.head_weights,
            cfg.norm_eps,
            &self.ws.head_mhc,
            &mut self.head_out,
        )?;
        let QuantView::Bf16 { y: u } = self.head_out.normed.view().q else {
            bail!("the final norm's outputs must be BF16")
        };
        let lm = weights.typed::<bf16>("head.weight")?;
        let job = Bf16Job {
            w: &lm,
            n: cfg.vocab_size,
            y: &self.ws.logits,
        };
        dense::bf16_linear(
            gpu,
            stream,
            &u,
            self.shape.batch,
            cfg.dim,
            &[job],
            &self.ws.lm_head,
        )
    }

    /// Step 19: samples every running slot from `ws.logits`; the ids land in the sampler's `next`, which the
    /// next step's embedding reads.
    pub fn sample(&self, gpu: &Gpu, stream: &Stream) -> Result<()> {
        sampler::sample_step(
            gpu,
            stream,
            &self.ws.logits,
            &self.ws.sampler,
            &self.ws.sampler_ws,
        )
    }

    /// One decode step: embedding, every layer, final norm, LM head, sampling (steps 0-19), then every running
    /// sequence's position advances (`sampler::advance_positions`), so a replay needs no host work..
    pub fn decode_step(
        &mut self,
        gpu: &Gpu,
        stream: &Stream,
        weights: &DeviceWeights,
    ) -> Result<()> {
        self.layers(gpu, stream, weights, None)?;
        self.head_and_sample(gpu, stream, weights)
    }

    /// [`DecodeState::decode_step`] with `ffn` running each layer's FFN half (`x_mid -> x`; the expert-parallel step
    /// runs its own; every half then writes its own output, no hc_post is left to the next half): the one step
    /// loop, marks included, for both.
    pub fn decode_step_with(
        &mut self,
        gpu: &Gpu,
        stream: &Stream,
        weights: &DeviceWeights,
        ffn: &mut FfnRunner<'_>,
    ) -> Result<()> {
        self.layers(gpu, stream, weights, Some(ffn))?;
        self.head_and_sample(gpu, stream, weights)
    }

    /// Steps 17-19 and the positions' advance, after the layers.
    fn head_and_sample(
        &mut self,
        gpu: &Gpu,
        stream: &Stream,
        weights: &DeviceWeights,
    ) -> Result<()> {
        self.head(gpu, stream, weights)?;
        self.mark(stream, group::HEAD)?;
        self.sample(gpu, stream)?;
        sampler::advance_positions(gpu, stream, &self.ws.sampler, &self.positions)?;
        self.mark(stream, group::SAMPLER)
    }

    fn mark(&self, stream: &Stream, what: &'static str) -> Result<()> {
        match &self.marks {
            Some(m) => m.mark(stream, what),
            None => Ok(()),
        }
    }

    /// One prompt token of every sequence (the ids the host wrote with [`DecodeState::set_tokens`]): embedding and
    /// every layer, filling the caches; no head or sampling (a prompt's logits are needed only at its last token,
    /// which [`DecodeState::decode_step`] runs). Positions advance as in a decode step.
    pub fn prompt_step(
        &mut self,
        gpu: &Gpu,
        stream: &Stream,
        weights: &DeviceWeights,
    ) -> Result<()> {
        self.layers(gpu, stream, weights, None)?;
        sampler::advance_positions(gpu, stream, &self.ws.sampler, &self.positions)
    }

    /// [`DecodeState::prompt_step`] with `ffn` running each layer's FFN half (as [`DecodeState::decode_step_with`]).
    pub fn prompt_step_with(
        &mut self,
        gpu: &Gpu,
        stream: &Stream,
        weights: &DeviceWeights,
        ffn: &mut FfnRunner<'_>,
    ) -> Result<()> {
        self.layers(gpu, stream, weights, Some(ffn))?;
        sampler::advance_positions(gpu, stream, &self.ws.sampler, &self.positions)
    }

    /// Steps 0-16: the embedding of `next` and every layer: the attention half, then `ffn`, or, without one, this
    /// state's FFN half with the halves linked (each leaves its hc_post to the next one's hc_pre,
    /// [`DecodeState::run_half`]).
    fn layers(
        &mut self,
        gpu: &Gpu,
        stream: &Stream,
        weights: &DeviceWeights,
        mut ffn: Option<&mut FfnRunner<'_>>,
    ) -> Result<()> {
        self.mark(stream, "start")?;
        self.embed(gpu, stream, weights)?;
        self.mark(stream, group::EMBED)?;
        for layer in 0..self.config.n_layers {
            match ffn.as_deref_mut() {
                Some(run_ffn) => {
                    self.attention_half(gpu, stream, weights, layer)?;
                    run_ffn(self, layer)?;
                }
                None => {
                    self.run_half(Half::Attention, gpu, stream, weights, layer, true)?;
                    self.run_half(Half::Ffn, gpu, stream, weights, layer, true)?;
                }
            }
        }
        Ok(())
    }

    /// The logits `[B, vocab]` (waits for `stream`).
    pub fn read_logits(&self, stream: &Stream) -> Result<Vec<f32>> {
        arena::download(stream, &self.ws.logits)
    }

    // ---- parity hooks: feed a layer the CPU model's inputs, read its outputs back ----

    /// Loads the residual of every sequence from f32 host rows `[B, 4, D]` (e.g. a `LayerTrace::residual_in`
    /// per sequence, concatenated), rounded to BF16 as the CPU model stores it.
    pub fn load_residual(&self, stream: &Stream, which: Residual, x: &[f32]) -> Result<()> {
        let dst = self.residual(which);
        ensure!(
            x.len() == dst.len(),
            "residual of {} values, the state holds {}",
            x.len(),
            dst.len()
        );
        let h: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        arena::upload(stream, dst, &h)
    }

    /// A residual `[B, 4, D]` as f32 (waits for `stream`).
    pub fn read_residual(&self, stream: &Stream, which: Residual) -> Result<Vec<f32>> {
        let d: DevBuf<bf16> = DevBuf::of(self.residual(which));
        Ok(arena::download(stream, &d)?
            .iter()
            .map(|v| v.to_f32())
            .collect())
    }

    fn residual(&self, which: Residual) -> &CudaSlice<bf16> {
        match which {
            Residual::Layer => &self.x,
            Residual::Mid => &self.x_mid,
        }
    }

    /// The step's error bits (waits for `stream`): [`ERR_EMBED_ID`] an embedding id was outside the vocabulary;
    /// [`ERR_CACHE_FULL`] a compressor's entry fell outside its cache (a sequence ran past its context). Sticky.
    pub fn read_error(&self, stream: &Stream) -> Result<u32> {
        let embed = arena::download(stream, &self.ws.error)?[0];
        let attn = arena::download(stream, &self.attn.bufs.error)?[0];
        let mut bits = 0;
        if embed != 0 {
            bits |= ERR_EMBED_ID;
        }
        if attn != 0 {
            bits |= ERR_CACHE_FULL;
        }
        Ok(bits)
    }
}
